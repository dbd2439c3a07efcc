#!/usr/bin/env bash
# Records the calibration the tests check the simulator against
# (host/tests/data/calibration): `piper calibrate`'s traces, real runs of
# 1f1b and dp on 2 devices and of the search's top 5 on 4, measured on this
# machine by the calibrate bench, which prints the ratios as it goes.
# Run it on a quiet machine when a change to the runtime, the plans or the
# search makes host/tests/it/calibrate.rs say "record it again".
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench -p piper --bench calibrate -- --record "$PWD/host/tests/data/calibration"

//! A development tool, built only with `--features fingerprint`: every
//! [`Trainer`] step appends one line to the file `PIPER_FINGERPRINT` names,
//! so two builds can be compared over every configuration a test suite
//! trains (a refactor that must not change numerics: the sorted line sets
//! of both runs are equal). Key: plan hash, options, which devices this
//! process runs, the batch's digest, the step. Value: the loss and
//! grad-norm bits, the SHA-256 of every parameter and both AdamW moments
//! (and of the captured gradients when `capture_grads` is on), the measured
//! peak and state bytes per device, the MoE counts. Peaks of plans with
//! several devices or streams depend on thread timing (compare them as
//! ranges); everything else is deterministic.
//!
//! ```sh
//! PIPER_FINGERPRINT=/tmp/a.txt cargo test --workspace --features piper/fingerprint
//! sed 's/ peak=\[[^]]*\]//' /tmp/a.txt | sort -u > /tmp/a.sorted   # then diff two builds'
//! ```

use super::{Batch, StepStats, Trainer};
use sha2::{Digest, Sha256};
use std::io::Write;

fn hex(d: impl AsRef<[u8]>) -> String {
    d.as_ref()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn tensors_digest<'a>(t: impl Iterator<Item = (&'a String, &'a Vec<f32>)>) -> String {
    let mut h = Sha256::new();
    for (k, v) in t {
        h.update(k.as_bytes());
        h.update((v.len() as u64).to_le_bytes());
        for x in v {
            h.update(x.to_bits().to_le_bytes());
        }
    }
    hex(h.finalize())
}

/// Append `s`'s line when `PIPER_FINGERPRINT` is set (a write that fails
/// is reported on stderr and the run goes on: this measures a run, it is
/// not part of one).
pub(super) fn record(t: &Trainer, batch: &Batch, s: &StepStats) {
    let Some(path) = std::env::var_os("PIPER_FINGERPRINT") else {
        return;
    };
    let o = &t.opts;
    let key = format!(
        "{} seed={} adamw={:?} clip={} mem={:?} grads={}",
        t.plan.hash,
        o.seed,
        o.adamw,
        o.clip.to_bits(),
        o.device_memory,
        o.capture_grads
    );
    let mut h = Sha256::new();
    for x in batch.tokens.iter().chain(batch.targets.iter()) {
        h.update(x.to_le_bytes());
    }
    let Ok(ck) = t.checkpoint() else {
        eprintln!("fingerprint: step {}: the states could not be read", s.step);
        return;
    };
    let states = tensors_digest(ck.params.iter().chain(ck.m.iter()).chain(ck.v.iter()));
    let grads = match o.capture_grads {
        true => match t.last_grads() {
            Ok(g) => tensors_digest(g.iter()),
            Err(e) => format!("unreadable: {e}"),
        },
        false => "-".into(),
    };
    let line = format!(
        "{} local={:?} batch={} step={} loss={:016x} norm={:016x} states={} grads={} peak={:?} state={:?} moe={}/{}\n",
        hex(Sha256::digest(key.as_bytes())),
        t.local,
        hex(h.finalize()),
        s.step,
        s.loss.to_bits(),
        s.grad_norm.to_bits(),
        states,
        grads,
        s.peak_bytes,
        s.state_bytes,
        s.moe_routed,
        s.moe_dropped
    );
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        eprintln!(
            "fingerprint: cannot append to {}: {e}",
            path.to_string_lossy()
        );
    }
}

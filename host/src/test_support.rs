//! Beside the flow, for the test suites only: how a test whose tool is missing
//! here (a guest toolchain, NVRTC, a registry, PyTorch) says that it did not run,
//! where `scripts/test.sh` collects it outside the tests' captured output and
//! prints one line per suite at the end (under `CI=true`, a failure).

use std::io::Write;

/// Record that `suite` did not run and `why`: printed, and appended as one
/// `suite<TAB>why` line to the file `PIPER_NOT_RUN` names, when it names one.
pub fn not_run(suite: &str, why: &str) {
    println!("NOT RUN: {suite}: {why}");
    let Some(path) = std::env::var_os("PIPER_NOT_RUN").filter(|p| !p.is_empty()) else {
        return;
    };
    let line = format!("{suite}\t{}\n", why.replace(['\t', '\n'], " "));
    let written = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        panic!(
            "recording that {suite} did not run in {}: {e}",
            std::path::Path::new(&path).display()
        );
    }
}

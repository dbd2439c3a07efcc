//! Per-kernel times for the trace: while a traced op runs, each kernel it
//! calls on the op's thread records its name, start and duration, so a user
//! sees where a step goes (`piper train --trace`, nested under the op in
//! Perfetto; `train` prints the totals). Off, a kernel pays one thread-local
//! read.

use crate::runtime::backend::KernelSpan;
use std::cell::RefCell;
use std::time::Instant;

thread_local! {
    static RECORDING: RefCell<Option<(Instant, Vec<KernelSpan>)>> = const { RefCell::new(None) };
}

/// Records one kernel call when it is dropped (if recording).
pub struct Span {
    name: &'static str,
    start: Option<Instant>,
}

/// Start timing kernel `name` (a no-op unless an op is being recorded on
/// this thread).
pub fn span(name: &'static str) -> Span {
    let on = RECORDING.with(|r| r.borrow().is_some());
    Span {
        name,
        start: on.then(Instant::now),
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some(start) = self.start else { return };
        let end = Instant::now();
        RECORDING.with(|r| {
            if let Some((epoch, spans)) = r.borrow_mut().as_mut() {
                spans.push(KernelSpan {
                    name: self.name,
                    start_us: start.saturating_duration_since(*epoch).as_secs_f64() * 1e6,
                    dur_us: (end - start).as_secs_f64() * 1e6,
                });
            }
        });
    }
}

/// Run `f` with this thread's kernels recorded into `out` when `on`.
pub fn recording<R>(
    on: bool,
    epoch: Instant,
    out: &mut Vec<KernelSpan>,
    f: impl FnOnce() -> R,
) -> R {
    if !on {
        return f();
    }
    let before = RECORDING.with(|r| r.borrow_mut().replace((epoch, Vec::new())));
    let result = f();
    let mine = RECORDING.with(|r| std::mem::replace(&mut *r.borrow_mut(), before));
    if let Some((_, spans)) = mine {
        out.extend(spans);
    }
    result
}

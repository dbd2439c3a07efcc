//! A device's trace: each op as it ran on its stream, with the kernels it
//! ran nested under it (`--trace`; read back by `piper sim --measured`).

use super::backend::KernelSpan;
use crate::compile::plan::Op;
use std::sync::Mutex;

/// One op (or one kernel of it) as it ran.
#[derive(Clone, Debug)]
pub(crate) struct TraceEvent {
    pub name: String,
    pub cat: &'static str,
    pub stream: usize,
    /// The op's index in its stream's plan order.
    pub op: usize,
    pub start_us: f64,
    pub dur_us: f64,
    pub step: u32,
}

/// The events of one device, in the order its streams recorded them.
#[derive(Default)]
pub(super) struct Trace {
    events: Mutex<Vec<TraceEvent>>,
}

impl Trace {
    /// Op `i` of stream `stream` ran from `start_us` to `end_us` of `step`,
    /// running `kernels`.
    pub(super) fn op(
        &self,
        op: &Op,
        (stream, i): (usize, usize),
        (start_us, end_us): (f64, f64),
        step: u32,
        kernels: Vec<KernelSpan>,
    ) {
        let kind = op.kind();
        let cat = match kind.is_compute() || kind == crate::compile::plan::OpKind::Update {
            true => "compute",
            false => "comm",
        };
        let mut ev = self.events.lock().unwrap();
        ev.push(TraceEvent {
            name: op.label(),
            cat,
            stream,
            op: i,
            start_us,
            dur_us: end_us - start_us,
            step,
        });
        ev.extend(kernels.into_iter().map(|k| TraceEvent {
            name: k.name.to_string(),
            cat: "kernel",
            stream,
            op: i,
            start_us: k.start_us,
            dur_us: k.dur_us,
            step,
        }));
    }

    pub(super) fn events(&self) -> Vec<TraceEvent> {
        self.events.lock().unwrap().clone()
    }
}

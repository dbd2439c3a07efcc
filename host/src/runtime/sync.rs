//! How a device's streams wait for each other within a step: one backend
//! stream per plan stream, the ops each stream's thread has enqueued, and
//! the backend event recorded after each op another stream waits for. A
//! waiting thread blocks until the op is enqueued (bounded: it looks for an
//! abort every 100 ms), then orders its own backend stream after the event.

use super::backend::Backend;
use crate::compile::plan::DevicePlan;
use std::collections::{HashMap, HashSet};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

/// The ops another stream waits for: `(stream, op index)`.
type Waited = HashSet<(usize, usize)>;

pub(super) struct StreamSync<B: Backend> {
    streams: Vec<B::Stream>,
    /// Ops enqueued per stream this step.
    progress: Mutex<Vec<usize>>,
    /// Of the training plan; of the forward-only plan, set at its first step.
    waited: Waited,
    eval_waited: OnceLock<Waited>,
    marks: Mutex<HashMap<(usize, usize), B::Event>>,
    cv: Condvar,
}

/// The step was aborted while a stream waited.
pub(super) struct Aborted;

impl<B: Backend> StreamSync<B> {
    /// A backend stream per stream of `plan`, none of them started.
    pub(super) fn new(b: &B, plan: &DevicePlan) -> Result<Self, super::backend::BackendError> {
        let streams = (plan.streams.iter())
            .map(|_| b.stream())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(StreamSync {
            progress: Mutex::new(vec![0; streams.len()]),
            streams,
            waited: waited_ops(plan),
            eval_waited: OnceLock::new(),
            marks: Mutex::new(HashMap::new()),
            cv: Condvar::new(),
        })
    }

    /// The backend stream of plan stream `si`.
    pub(super) fn stream(&self, si: usize) -> &B::Stream {
        &self.streams[si]
    }

    /// Block until op `op` of stream `ws` is enqueued, then order stream
    /// `si` after it on the backend; `Err` as soon as `aborted` says so.
    pub(super) fn wait_for(
        &self,
        b: &B,
        si: usize,
        (ws, op): (usize, usize),
        aborted: impl Fn() -> bool,
    ) -> Result<(), Aborted> {
        let mut p = self.progress.lock().unwrap();
        while p[ws] <= op {
            if aborted() {
                return Err(Aborted);
            }
            p = self
                .cv
                .wait_timeout(p, Duration::from_millis(100))
                .unwrap()
                .0;
        }
        drop(p);
        if let Some(e) = self.marks.lock().unwrap().get(&(ws, op)) {
            b.wait(&self.streams[si], e);
        }
        Ok(())
    }

    /// Op `i` of stream `si` is enqueued: marked on the backend when
    /// another stream of `plan` (the forward-only one when `eval`) waits for
    /// it (before progress, so a waiter that sees the progress finds the
    /// mark), and every waiter woken.
    pub(super) fn done(&self, b: &B, plan: &DevicePlan, eval: bool, (si, i): (usize, usize)) {
        let waited = match eval {
            true => self.eval_waited.get_or_init(|| waited_ops(plan)),
            false => &self.waited,
        };
        if waited.contains(&(si, i)) {
            let mark = b.record(&self.streams[si]);
            self.marks.lock().unwrap().insert((si, i), mark);
        }
        self.progress.lock().unwrap()[si] = i + 1;
        self.cv.notify_all();
    }

    /// Wake every waiting stream (one failed: they look for the abort).
    pub(super) fn wake(&self) {
        self.cv.notify_all();
    }

    /// Before a step: nothing enqueued, no marks.
    pub(super) fn reset(&self) {
        self.marks.lock().unwrap().clear();
        self.progress
            .lock()
            .unwrap()
            .iter_mut()
            .for_each(|x| *x = 0);
    }
}

fn waited_ops(dp: &DevicePlan) -> Waited {
    let mut out = HashSet::new();
    for s in &dp.streams {
        for op in s.ops.iter() {
            for w in op.waits.iter() {
                out.insert((w.stream.ix(), w.op));
            }
        }
    }
    out
}

//! One training step: a thread per (device, stream) enqueuing its ops in
//! plan order on the device's backend stream; an op that waits for another
//! stream waits until that stream's thread has enqueued the op, then on the
//! backend event recorded after it. A panic or error on any stream aborts
//! the step everywhere (every wait is bounded), and the first real failure,
//! named by device, stream and op, is the step's error.

use super::backend::Backend;
use super::comm::CommError;
use super::device::Device;
use super::error::{label, RuntimeError};
use super::ops::{exec_op, StepCtx};
use crate::compile::plan::DevicePlan;
use std::time::Duration;

/// Run every stream of every device of this process (`plans[i]` is
/// `devices[i]`'s); the first real error wins.
pub(crate) fn run_step<B: Backend>(
    devices: &[Device<B>],
    plans: &[&DevicePlan],
    ctx: &StepCtx<B>,
) -> Result<(), RuntimeError> {
    for (d, dp) in devices.iter().zip(plans) {
        d.reset(dp);
    }
    std::thread::scope(|s| {
        for (dev, &dp) in devices.iter().zip(plans) {
            for si in 0..dp.streams.len() {
                s.spawn(move || {
                    // A panic in a kernel (or anywhere in the op) is caught
                    // here: the step aborts on every device and the error
                    // names where it happened.
                    let current = std::cell::Cell::new(None::<usize>);
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        run_stream(dev, dp, si, ctx, &current)
                    }));
                    let err = match r {
                        Ok(Ok(())) => return,
                        Ok(Err(e)) => e,
                        Err(payload) => RuntimeError::Panic {
                            device: dev.id,
                            stream: dp.streams[si].stream.to_string(),
                            op: current
                                .get()
                                .map(|i| label(&dp.streams[si].ops[i]))
                                .unwrap_or_else(|| "waiting".into()),
                            message: panic_text(payload.as_ref()),
                        },
                    };
                    ctx.comm.abort();
                    dev.sync.wake();
                    ctx.failures
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(err);
                });
            }
        }
    });
    let failures = std::mem::take(&mut *ctx.failures.lock().unwrap_or_else(|p| p.into_inner()));
    let aborted = |e: &RuntimeError| {
        matches!(
            e,
            RuntimeError::Comm {
                cause: CommError::Aborted,
                ..
            }
        )
    };
    let first = failures
        .iter()
        .position(|e| !aborted(e))
        .or(if failures.is_empty() { None } else { Some(0) });
    match first {
        Some(i) => Err(failures.into_iter().nth(i).expect("index in range")),
        None => Ok(()),
    }
}

/// The message of a panic payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a non-text panic payload)".into())
}

fn run_stream<B: Backend>(
    dev: &Device<B>,
    dp: &DevicePlan,
    si: usize,
    ctx: &StepCtx<B>,
    current: &std::cell::Cell<Option<usize>>,
) -> Result<(), RuntimeError> {
    let stream = &dp.streams[si];
    for (i, op) in stream.ops.iter().enumerate() {
        // Cross-stream events.
        for w in op.waits.iter() {
            let aborted = || ctx.comm.aborted();
            if dev
                .sync
                .wait_for(&dev.b, si, (w.stream.ix(), w.op), aborted)
                .is_err()
            {
                return Err(RuntimeError::Comm {
                    device: dev.id,
                    op: label(op),
                    cause: CommError::Aborted,
                });
            }
        }
        let t0 = ctx.epoch.elapsed();
        current.set(Some(i));
        #[cfg(test)]
        if let Some((d, what)) = &ctx.opts.inject_panic {
            if *d == dev.id && op.label().starts_with(what.as_str()) {
                panic!("injected kernel panic (TrainOptions::inject_panic)");
            }
        }
        let mut kernels = Vec::new();
        // A backend reports what failed in the op's enqueued work here, so
        // the op is the one named.
        let ran = exec_op(dev, si, op, ctx, &mut kernels)
            .and_then(|()| dev.b.check().map_err(|e| dev.backend_error(op, e)));
        if let Err(e) = ran {
            ctx.comm.abort();
            // Wake this device's other streams so they notice.
            dev.sync.wake();
            return Err(e);
        }
        if ctx.opts.trace {
            let t1 = ctx.epoch.elapsed();
            let us = |t: Duration| t.as_secs_f64() * 1e6;
            dev.trace
                .op(op, (si, i), (us(t0), us(t1)), ctx.step, kernels);
        }
        dev.sync.done(&dev.b, dp, ctx.eval, (si, i));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::compile::compile;
    use crate::dag::{Cluster, TrainingDag};
    use crate::model::ModelConfig;
    use crate::plugin::{PluginHost, SandboxLimits};
    use crate::runtime::{Corpus, TrainOptions, Trainer};

    /// A panic in one device's kernel (injected: `TrainOptions::inject_panic`
    /// exists in test builds only) ends the step on every device within
    /// seconds, and the error names the device, the stream and the op.
    #[test]
    fn a_kernel_panic_on_one_device_ends_the_step_on_all_with_the_place_named() {
        let cfg = ModelConfig::tiny();
        let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
        let mut dag = TrainingDag::build(&cfg, Cluster::new(4)).unwrap();
        let p = host.load("1f1b").unwrap();
        host.apply(&p, &mut dag, &[("microbatches".into(), "4".into())])
            .unwrap();
        let opts = TrainOptions {
            inject_panic: Some((2, "B".into())),
            ..Default::default()
        };
        let mut trainer = Trainer::new(&cfg, compile(&dag).unwrap(), opts).unwrap();
        let t = std::time::Instant::now();
        let err = trainer
            .step(&Corpus::builtin().batch(1, 32, 64, 256).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        assert!(
            err.starts_with("device 2, stream `compute`: B")
                && err.contains("panicked: injected kernel panic"),
            "{err}"
        );
    }
}

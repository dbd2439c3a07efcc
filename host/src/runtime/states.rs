//! A device's model states: whole tensors by parameter id (parameters,
//! gradients, AdamW moments, and under a bf16 policy the fp32 master
//! weights the optimizer steps while the kernels read bf16 parameters), the
//! ZeRO buckets holding its shards (laid out by `zero.rs`), and the
//! gradients the last step captured for the step-1 dump and
//! `Trainer::grads`. Each behind its own lock; a lock a panic left
//! poisoned ends the process's step loudly, as before.

use super::backend::{Backend, ParamMap};
use super::zero::Bucket;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// AdamW's first and second moments of a device's whole tensors.
pub(super) type Moments<B> = (
    ParamMap<<B as Backend>::Tensor>,
    ParamMap<<B as Backend>::Tensor>,
);

type Tensors<B> = ParamMap<<B as Backend>::Tensor>;

pub(super) struct States<B: Backend> {
    params: RwLock<Tensors<B>>,
    /// fp32 master weights of bf16 parameters (empty when the parameters
    /// are their own master weights).
    master: Mutex<Tensors<B>>,
    grads: Mutex<Tensors<B>>,
    moments: Mutex<Moments<B>>,
    buckets: Mutex<Vec<Bucket<B>>>,
    captured: Mutex<Tensors<B>>,
    /// ZeRO-2/3: the last step's reduced gradient shard per bucket index.
    captured_shards: Mutex<HashMap<usize, B::Tensor>>,
}

impl<B: Backend> States<B> {
    pub(super) fn new(
        (params, master): (Tensors<B>, Tensors<B>),
        grads: Tensors<B>,
        moments: Moments<B>,
        buckets: Vec<Bucket<B>>,
    ) -> Self {
        States {
            params: RwLock::new(params),
            master: Mutex::new(master),
            grads: Mutex::new(grads),
            moments: Mutex::new(moments),
            buckets: Mutex::new(buckets),
            captured: Mutex::new(ParamMap::new()),
            captured_shards: Mutex::new(HashMap::new()),
        }
    }
    pub(super) fn params(&self) -> RwLockReadGuard<'_, Tensors<B>> {
        self.params.read().unwrap()
    }
    pub(super) fn params_mut(&self) -> RwLockWriteGuard<'_, Tensors<B>> {
        self.params.write().unwrap()
    }
    pub(super) fn master(&self) -> MutexGuard<'_, Tensors<B>> {
        self.master.lock().unwrap()
    }
    pub(super) fn grads(&self) -> MutexGuard<'_, Tensors<B>> {
        self.grads.lock().unwrap()
    }
    pub(super) fn moments(&self) -> MutexGuard<'_, Moments<B>> {
        self.moments.lock().unwrap()
    }
    pub(super) fn buckets(&self) -> MutexGuard<'_, Vec<Bucket<B>>> {
        self.buckets.lock().unwrap()
    }
    pub(super) fn captured(&self) -> MutexGuard<'_, Tensors<B>> {
        self.captured.lock().unwrap()
    }
    pub(super) fn captured_shards(&self) -> MutexGuard<'_, HashMap<usize, B::Tensor>> {
        self.captured_shards.lock().unwrap()
    }
}

//! Compute backends: what a device computes with, behind one trait. The
//! runtime's rooms (device states, buffers, ops, ZeRO, the step) are generic
//! over a [`Backend`] and never ask which one runs; `cpu` is the embedded
//! default, and a CUDA backend implements the same trait.
//!
//! The split, as candle draws it: a backend owns *storage* (its
//! [`Backend::Tensor`], f32 on the device) and *kernels*, one method per op
//! family, each as forward / backward-for-input / backward-for-weights with
//! its shapes as arguments (llm.c style). What a model does with them — a
//! GPT-2 or Llama segment's forward and backward, the phases of a
//! mixture-of-experts layer — is written once over the trait in its own
//! room (`runtime/model/`), and initialisation in [`init`], so every backend
//! computes the same arithmetic in the same order, and a new op family
//! (RMSNorm, RoPE) is a kernel per backend plus one composition. This room
//! keeps the kernels, and the routing arrays they read ([`routing`]).
//!
//! # What the trait promises a device backend (CUDA)
//! - **Storage lives on the device.** Activations, saved tensors (the
//!   forward's caches), gradients, parameters and optimizer moments are all
//!   `Tensor`s; the runtime sizes its memory account from
//!   [`Backend::bytes`], never from host lengths. Host data crosses only at
//!   named edges: [`Backend::upload`] / [`Backend::download`] for
//!   initialisation, checkpoints, dumps and messages to other processes,
//!   [`Backend::upload_ids`] for each batch's tokens.
//! - **Storage has a dtype, arithmetic is fp32.** A tensor is stored in
//!   fp32 or bf16 ([`Backend::dtype`], [`Backend::zeros_as`],
//!   [`Backend::cast`]); every kernel reads its operands as fp32, computes
//!   and accumulates in fp32, and stores its results in their own tensors'
//!   dtypes (bf16 rounded to nearest even). Host copies are fp32.
//! - **Kernels enqueue, they do not wait.** Every kernel call is made inside
//!   [`Backend::enter`] on a plan stream ([`Backend::Stream`]: a CUDA stream),
//!   which makes that stream current for the calling thread; the call
//!   returns once the work is enqueued. The only host synchronisations of a
//!   step are where the host needs a value: [`Backend::read_scalar`] (the
//!   step's loss, read once when the step ends), [`Backend::sum_squares`]
//!   (the gradient norm, once per norm op), MoE routing (the router's
//!   probabilities, once per expert layer's forward: top-k with capacity is
//!   a host decision, as the token counts of Megatron's all-to-all are), and
//!   the downloads of messages while communication is host-side.
//! - **Cross-stream order is events.** A plan op that waits for another
//!   stream's op waits for the host thread of that stream to have enqueued
//!   it, then calls [`Backend::wait`] on the [`Backend::Event`] recorded
//!   after it ([`Backend::record`]); on the CPU, where enqueuing is running,
//!   both are no-ops.
//! - **Failures are values.** Allocation can fail (a device has a cap and
//!   a caching allocator); kernels that cannot fail return nothing, and a
//!   backend that finds a device error reports it from the next call that
//!   returns a `Result` (an allocation, a read), as CUDA reports
//!   asynchronous errors.

pub mod check;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod init;

pub mod routing;

pub use crate::model::params::ParamId;
use crate::model::Dtype;
use std::ops::Range;
use std::time::Instant;

/// A failure inside a backend call or a composition over one. The runtime
/// names the device and op around it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BackendError {
    /// A tensor-parallel sum or an expert exchange failed, or brought what
    /// does not fit.
    #[error("{0}")]
    Exchange(String),
    /// A parameter the computation reads is not on this device (a plan
    /// that placed a segment without its weights).
    #[error("parameter #{} is not on this device", .0.index())]
    MissingParam(ParamId),
    /// The device could not allocate.
    #[error("cannot allocate {bytes} bytes: {message}")]
    Alloc { bytes: u64, message: String },
    /// Anything else the device reports (a launch or driver error).
    #[error("{0}")]
    Device(String),
}

/// The rows of each sequence an attention call computes, as positions in
/// the whole sequence: all of them, or context parallelism's two chunks
/// (Megatron's causal load balancing: rank `r` of `cp` holds chunks `r`
/// and `2·cp − 1 − r` of `2·cp`, so every rank gets the same share of
/// the causal triangle).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqRows {
    /// Rows per chunk.
    pub chunk: usize,
    /// Where each chunk starts in the whole sequence.
    pub starts: [usize; 2],
    /// Chunks held: 1 (the whole sequence) or 2.
    pub chunks: usize,
}

impl SeqRows {
    /// Every row of a `t`-long sequence.
    pub fn all(t: usize) -> Self {
        SeqRows {
            chunk: t,
            starts: [0, 0],
            chunks: 1,
        }
    }
    /// Rank `rank`'s chunks of a `t`-long sequence split over `cp`
    /// (`t` divides by `2·cp`, as the plan checks).
    pub fn balanced(t: usize, cp: usize, rank: usize) -> Self {
        if cp <= 1 {
            return Self::all(t);
        }
        let chunk = t / (2 * cp);
        SeqRows {
            chunk,
            starts: [rank * chunk, (2 * cp - 1 - rank) * chunk],
            chunks: 2,
        }
    }
    /// Rows held per sequence.
    pub fn len(&self) -> usize {
        self.chunk * self.chunks
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The chunks as `(first, end)` positions, in the order held.
    pub fn ranges(&self) -> Vec<(usize, usize)> {
        self.starts[..self.chunks.min(2)]
            .iter()
            .map(|&s| (s, s + self.chunk))
            .collect()
    }
    /// The position of held row `r`.
    pub fn position(&self, r: usize) -> usize {
        self.starts[(r / self.chunk.max(1)).min(1)] + r % self.chunk.max(1)
    }
}

/// AdamW's hyper-parameters (decoupled weight decay, as GPT-2 training uses
/// it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// Which backend a run computes on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendKind {
    /// Virtual devices on this machine's cores (the embedded default).
    #[default]
    Cpu,
    /// Plan devices on `gpus` GPUs of this machine, dealt to them in
    /// contiguous blocks (several plan devices may share one).
    Cuda { gpus: u32 },
}

impl BackendKind {
    /// `cpu`, `cuda` (as `--backend` takes them).
    pub fn parse(name: &str, gpus: u32) -> Result<Self, String> {
        match name {
            "cpu" => Ok(BackendKind::Cpu),
            "cuda" if gpus >= 1 => Ok(BackendKind::Cuda { gpus }),
            "cuda" => Err("--gpus must be at least 1".into()),
            other => Err(format!("no backend `{other}`: give cpu or cuda")),
        }
    }
    pub fn name(&self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda { .. } => "cuda",
        }
    }
}

/// This process's devices, as a backend is asked to start them: their plan
/// ids and predicted peaks (bytes), and the kernel threads of a CPU device.
pub struct Placement<'a> {
    pub devices: &'a [u32],
    pub peaks: &'a [u64],
    pub threads: usize,
}

/// Work generic over the backend (the runtime's devices), given the way to
/// make the backend of each of the placement's devices (by position).
pub trait WithBackend {
    type Output;
    fn run<B: Backend>(
        self,
        device: &(dyn Fn(usize) -> Result<B, BackendError> + Sync),
    ) -> Self::Output;
}

/// Run `work` on the backend `kind` names: the one place that chooses a
/// backend. A backend that cannot start here (no driver, no GPU, a plan
/// that cannot fit) says so before anything is allocated.
pub fn with_backend<W: WithBackend>(
    kind: BackendKind,
    place: &Placement<'_>,
    work: W,
) -> Result<W::Output, BackendError> {
    match kind {
        BackendKind::Cpu => {
            let threads = place.threads;
            Ok(work.run(&|i| cpu::Cpu::new(place.devices[i], threads)))
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda { gpus } => {
            let gpus = cuda::setup::open(gpus, place)?;
            Ok(work.run(&|i| cuda::Cuda::new(place.devices[i], gpus[i].clone())))
        }
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda { .. } => Err(BackendError::Device(
            "this piper was built without CUDA: build it with `cargo build --release -p piper --features cuda`".into(),
        )),
    }
}

/// Each device's memory cap when the run gives none: on the CPU, the
/// machine's available memory shared among the placement's devices and the
/// `ranks` on this machine, a device whose predicted peak passes its share
/// refused before anything is allocated (`cpu::memory`); on GPUs, none (the
/// predicted peaks are held to each GPU's free memory when it opens).
pub fn default_cap(
    kind: BackendKind,
    place: &Placement<'_>,
    ranks: usize,
) -> Result<Option<u64>, BackendError> {
    match kind {
        BackendKind::Cpu => match cpu::memory::available_bytes() {
            Some(available) => cpu::memory::default_cap(place, available, ranks).map(Some),
            None => Ok(None),
        },
        BackendKind::Cuda { .. } => Ok(None),
    }
}

/// One kernel call as the trace shows it: times in µs since the trainer's
/// epoch.
#[derive(Clone, Debug)]
pub struct KernelSpan {
    pub name: &'static str,
    pub start_us: f64,
    pub dur_us: f64,
}

/// Where a traced op's kernels go: the trainer's epoch and the list.
pub type Trace<'a> = Option<(Instant, &'a mut Vec<KernelSpan>)>;

/// How a token's top-k choices were routed (MoE): host arrays the routing
/// kernels read. See [`routing`].
pub use routing::Routing;

/// A backend: one plan device's storage, streams and kernels. One value per
/// device (a CPU device's thread pool, a GPU's context share); `Sync`, as
/// every stream of the device calls it from its own thread.
///
/// Kernel arguments: outputs first (`&mut`), then inputs, then shapes.
/// A kernel that "accumulates" adds into its output (`+=`); the others
/// overwrite it. Shapes are the callers' (checked by the plan and the
/// model); tensors are at least as long as their shapes say.
// Kernels carry their shapes as arguments, as llm.c does: readable at the call.
#[allow(clippy::too_many_arguments)]
pub trait Backend: Send + Sync + Sized + 'static {
    /// f32 storage on the device. `Default` is the empty tensor (no
    /// allocation): what a cache holds where it freed a tensor early.
    type Tensor: Default + Send + Sync + 'static;
    /// u32 storage (token ids and targets).
    type Ids: Default + Send + Sync + 'static;
    /// A value left on the device until the host reads it (a loss term).
    type Scalar: Send + 'static;
    /// A queue of work: kernels enqueued on one stream run in order.
    type Stream: Send + Sync;
    /// A point in a stream that work on another stream can wait for.
    type Event: Send + Sync;

    /// The backend's name in messages (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    // Streams.

    /// A new stream of this device (one per plan stream).
    fn stream(&self) -> Result<Self::Stream, BackendError>;
    /// Run `f` with `stream` current on this thread: every kernel `f` calls
    /// goes onto it (on the CPU: onto the device's threads). When `trace`
    /// is given, the kernels `f` runs are recorded into it.
    fn enter<R: Send>(
        &self,
        stream: &Self::Stream,
        trace: Trace<'_>,
        f: impl FnOnce() -> R + Send,
    ) -> R;
    /// Run `f` on the calling thread with `stream` current, for an op's
    /// host-side work (communication: staging its tensors to and from the
    /// host) that must be ordered on the op's stream. The CPU just runs it.
    fn with_stream<R>(&self, stream: &Self::Stream, f: impl FnOnce() -> R) -> R {
        let _ = stream;
        f()
    }
    /// Mark the point `stream` has reached.
    fn record(&self, stream: &Self::Stream) -> Self::Event;
    /// Make later work on `stream` wait until `event` is reached.
    fn wait(&self, stream: &Self::Stream, event: &Self::Event);
    /// The first failure of the work enqueued so far that no call has
    /// reported yet (a launch that failed, a fault the device reported):
    /// the runtime asks after every op, so the op is named.
    fn check(&self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Whether a tensor `other` made is usable here as it is (one memory:
    /// the CPU's threads, virtual devices on one GPU), so that a message
    /// between the two hands the tensor over instead of copying it through
    /// the host. Work the tensor's producer enqueued is ordered before its
    /// new holder's use by the backend (on CUDA, the allocation's events).
    fn shares_memory_with(&self, other: &Self) -> bool {
        let _ = other;
        false
    }

    // Storage.

    /// Elements of a tensor.
    fn len(t: &Self::Tensor) -> usize;
    /// Device bytes a tensor holds (what the memory account charges).
    fn bytes(t: &Self::Tensor) -> u64;
    /// Device bytes of a token tensor.
    fn ids_bytes(t: &Self::Ids) -> u64;
    /// The dtype a tensor is stored in. Kernels compute in fp32 whatever
    /// their operands' storage (a bf16 operand is widened as it is read, a
    /// bf16 result rounded to nearest even as it is stored).
    fn dtype(t: &Self::Tensor) -> Dtype;
    /// A tensor of `n` fp32 zeros.
    fn zeros(&self, n: usize) -> Result<Self::Tensor, BackendError>;
    /// A tensor of `n` zeros stored as `dtype`.
    fn zeros_as(&self, n: usize, dtype: Dtype) -> Result<Self::Tensor, BackendError>;
    /// A copy of `t` stored as `dtype` (rounded to nearest even when
    /// narrower).
    fn cast(&self, t: &Self::Tensor, dtype: Dtype) -> Result<Self::Tensor, BackendError>;
    /// A device copy of host values.
    fn upload(&self, v: Vec<f32>) -> Result<Self::Tensor, BackendError>;
    /// A device copy of host values stored as `dtype` (rounded when
    /// narrower).
    fn upload_as(&self, v: Vec<f32>, dtype: Dtype) -> Result<Self::Tensor, BackendError> {
        let t = self.upload(v)?;
        match dtype {
            Dtype::F32 => Ok(t),
            _ => self.cast(&t, dtype),
        }
    }
    /// A device copy of token ids.
    fn upload_ids(&self, v: &[u32]) -> Result<Self::Ids, BackendError>;
    /// A host copy of a tensor (waits for the work that writes it).
    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>, BackendError>;
    /// A host copy of `range` of a tensor.
    fn download_range(
        &self,
        t: &Self::Tensor,
        range: Range<usize>,
    ) -> Result<Vec<f32>, BackendError>;
    /// A host copy of a tensor the caller gives up (on the CPU: no copy).
    fn download_owned(&self, t: Self::Tensor) -> Result<Vec<f32>, BackendError>;
    /// A device copy of a tensor.
    fn duplicate(&self, t: &Self::Tensor) -> Result<Self::Tensor, BackendError>;
    /// A device copy of token ids.
    fn duplicate_ids(&self, t: &Self::Ids) -> Result<Self::Ids, BackendError>;
    /// `dst[at..] = src[range]`.
    fn copy(&self, dst: &mut Self::Tensor, at: usize, src: &Self::Tensor, range: Range<usize>);
    /// `dst[at..] = src` from the host.
    fn write(&self, dst: &mut Self::Tensor, at: usize, src: &[f32]);
    /// `dst[at..] += src` from the host.
    fn add_host(&self, dst: &mut Self::Tensor, at: usize, src: &[f32]);
    /// `dst += src`, elementwise.
    fn add(&self, dst: &mut Self::Tensor, src: &Self::Tensor);
    /// `t = 0`.
    fn fill_zero(&self, t: &mut Self::Tensor);
    /// A host value as a scalar term.
    fn scalar(&self, x: f64) -> Self::Scalar;
    /// The value of a scalar term (a host synchronisation).
    fn read_scalar(&self, s: Self::Scalar) -> Result<f64, BackendError>;

    // Embedding.

    /// `out[b,t,:] = wte[tokens[b,t],:] (+ wpe[t,:])`.
    fn embedding_forward(
        &self,
        out: &mut Self::Tensor,
        tokens: &Self::Ids,
        wte: &Self::Tensor,
        wpe: Option<&Self::Tensor>,
        b: usize,
        t: usize,
        c: usize,
    );
    /// Accumulates `dwte[token] += dout` (and `dwpe[t] += dout`).
    fn embedding_backward_weight(
        &self,
        dwte: &mut Self::Tensor,
        dwpe: Option<&mut Self::Tensor>,
        dout: &Self::Tensor,
        tokens: &Self::Ids,
        b: usize,
        t: usize,
        c: usize,
    );

    // LayerNorm over `c` channels of `n` rows.

    /// `out = (inp − mean) · rstd · weight + bias`, with `mean`, `rstd` per row.
    fn layernorm_forward(
        &self,
        out: &mut Self::Tensor,
        mean: &mut Self::Tensor,
        rstd: &mut Self::Tensor,
        inp: &Self::Tensor,
        weight: &Self::Tensor,
        bias: &Self::Tensor,
        n: usize,
        c: usize,
    );
    /// Accumulates the input gradient into `dinp`.
    fn layernorm_backward_input(
        &self,
        dinp: &mut Self::Tensor,
        dout: &Self::Tensor,
        inp: &Self::Tensor,
        weight: &Self::Tensor,
        mean: &Self::Tensor,
        rstd: &Self::Tensor,
        n: usize,
        c: usize,
    );
    /// Accumulates `dweight += Σ norm · dout`, `dbias += Σ dout`.
    fn layernorm_backward_weight(
        &self,
        dweight: &mut Self::Tensor,
        dbias: &mut Self::Tensor,
        dout: &Self::Tensor,
        inp: &Self::Tensor,
        mean: &Self::Tensor,
        rstd: &Self::Tensor,
        n: usize,
        c: usize,
    );

    // RMSNorm over `c` channels of `n` rows (the Llama family's norm).

    /// `out = inp · rstd · weight`, `rstd = 1/√(mean(inp²) + eps)` per row.
    fn rmsnorm_forward(
        &self,
        out: &mut Self::Tensor,
        rstd: &mut Self::Tensor,
        inp: &Self::Tensor,
        weight: &Self::Tensor,
        n: usize,
        c: usize,
        eps: f32,
    );
    /// Accumulates the input gradient into `dinp`.
    fn rmsnorm_backward_input(
        &self,
        dinp: &mut Self::Tensor,
        dout: &Self::Tensor,
        inp: &Self::Tensor,
        weight: &Self::Tensor,
        rstd: &Self::Tensor,
        n: usize,
        c: usize,
    );
    /// Accumulates `dweight += Σ_rows norm · dout`.
    fn rmsnorm_backward_weight(
        &self,
        dweight: &mut Self::Tensor,
        dout: &Self::Tensor,
        inp: &Self::Tensor,
        rstd: &Self::Tensor,
        n: usize,
        c: usize,
    );

    // Rotary position embeddings of `x[b, t, heads, hd]`, in place.

    /// Rotate each head's channel pairs `(i, i + hd/2)` by `t · θ^(−2i/hd)`
    /// (the inverse rotation when `inverse`: the backward).
    fn rope(
        &self,
        x: &mut Self::Tensor,
        b: usize,
        t: usize,
        heads: usize,
        hd: usize,
        theta: f64,
        inverse: bool,
    );

    // Linear layers: `out[n,oc] = inp[n,c] · W[oc,c]ᵀ + b[oc]`.

    /// `out = inp · Wᵀ (+ bias)`.
    fn matmul_forward(
        &self,
        out: &mut Self::Tensor,
        inp: &Self::Tensor,
        weight: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        n: usize,
        c: usize,
        oc: usize,
    );
    /// A linear layer onto a residual: `out = res (+ bias) + inp · Wᵀ`.
    fn matmul_forward_residual(
        &self,
        out: &mut Self::Tensor,
        res: &Self::Tensor,
        inp: &Self::Tensor,
        weight: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        n: usize,
        c: usize,
        oc: usize,
    );
    /// `dinp (+)= dout · W` (accumulating when `accumulate`).
    fn matmul_backward_input(
        &self,
        dinp: &mut Self::Tensor,
        dout: &Self::Tensor,
        weight: &Self::Tensor,
        n: usize,
        c: usize,
        oc: usize,
        accumulate: bool,
    );
    /// Accumulates `dW += doutᵀ · inp`, `db += Σ_rows dout`.
    fn matmul_backward_weight(
        &self,
        dweight: &mut Self::Tensor,
        dbias: Option<&mut Self::Tensor>,
        dout: &Self::Tensor,
        inp: &Self::Tensor,
        n: usize,
        c: usize,
        oc: usize,
    );
    /// `out[row] += bias` for rows of `width` (a row-parallel layer's bias,
    /// added after its group's sum).
    fn add_bias(&self, out: &mut Self::Tensor, bias: &Self::Tensor, width: usize);

    // Causal self-attention from a packed `qkv[b,t,3c]` with `nh` heads.

    /// `out[b,t,c]`, and the softmax probabilities `att[b,nh,t,t]`.
    fn attention_forward(
        &self,
        out: &mut Self::Tensor,
        att: &mut Self::Tensor,
        qkv: &Self::Tensor,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    );
    /// Accumulates `dqkv += ∂out/∂qkv · dout`.
    fn attention_backward(
        &self,
        dqkv: &mut Self::Tensor,
        dout: &Self::Tensor,
        qkv: &Self::Tensor,
        att: &Self::Tensor,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    );
    /// Memory-efficient causal attention (FlashAttention's algorithm) of
    /// the query rows `rows` of each `t`-long sequence of `qkv[b,t,3c]`:
    /// `out[b,r,c]` and each row's log-sum-exp of its scaled scores
    /// `lse[b,nh,r]` (fp32), never the probabilities (`r` = `rows.len()`;
    /// a row attends to the keys at or before its position).
    fn flash_attention_forward(
        &self,
        out: &mut Self::Tensor,
        lse: &mut Self::Tensor,
        qkv: &Self::Tensor,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        rows: SeqRows,
    );
    /// Accumulates `dqkv[b,t,3c] += ∂out/∂qkv · dout` from the forward's
    /// `out` and `lse` (of the rows `rows`), recomputing the probabilities.
    fn flash_attention_backward(
        &self,
        dqkv: &mut Self::Tensor,
        dout: &Self::Tensor,
        qkv: &Self::Tensor,
        out: &Self::Tensor,
        lse: &Self::Tensor,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        rows: SeqRows,
    );
    /// Context parallelism's ring, one forward step: into `out[b,r,c]` and
    /// `lse[b,nh,r]` (the rows `qrows` of `q[b,r,3c]`; `first`: nothing
    /// merged yet) the attention over the keys and values of
    /// `kv[b,k,3c]` at positions `krows`, merged by log-sum-exp (a row that
    /// sees none of them is left as it was).
    #[allow(clippy::too_many_arguments)]
    fn flash_ring_forward(
        &self,
        out: &mut Self::Tensor,
        lse: &mut Self::Tensor,
        q: &Self::Tensor,
        kv: &Self::Tensor,
        b: usize,
        c: usize,
        nh: usize,
        rows: (SeqRows, SeqRows),
        first: bool,
    );
    /// Context parallelism's ring, one backward step: from the rows' final
    /// `out` and `lse` and `dout[b,r,c]`, accumulates into the query part of
    /// `dq[b,r,3c]` and the key and value parts of `dkv[b,k,3c]` the
    /// gradients through the block `kv` at positions `rows.1`.
    #[allow(clippy::too_many_arguments)]
    fn flash_ring_backward(
        &self,
        dq: &mut Self::Tensor,
        dkv: &mut Self::Tensor,
        dout: &Self::Tensor,
        q: &Self::Tensor,
        kv: &Self::Tensor,
        out: &Self::Tensor,
        lse: &Self::Tensor,
        b: usize,
        c: usize,
        nh: usize,
        rows: (SeqRows, SeqRows),
    );
    /// Grouped-query attention's packed input: `qkv[n, 3·nh·hd]` from
    /// `q[n, nh·hd]` and `k`, `v[n, kvh·hd]`, query head `h` reading kv head
    /// `h / (nh / kvh)`.
    fn qkv_pack(
        &self,
        qkv: &mut Self::Tensor,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        n: usize,
        nh: usize,
        kvh: usize,
        hd: usize,
    );
    /// Accumulates [`Backend::qkv_pack`]'s backward: `dq`, and each kv
    /// head's `dk`, `dv` summed over its query heads in order.
    fn qkv_unpack_backward(
        &self,
        dq: &mut Self::Tensor,
        dk: &mut Self::Tensor,
        dv: &mut Self::Tensor,
        dqkv: &Self::Tensor,
        n: usize,
        nh: usize,
        kvh: usize,
        hd: usize,
    );

    // Elementwise.

    /// `out = gelu(inp)` (tanh approximation, GPT-2's).
    fn gelu_forward(&self, out: &mut Self::Tensor, inp: &Self::Tensor);
    /// By rows of `width`: `pre += bias`, then `out = gelu(pre)`.
    fn bias_gelu_forward(
        &self,
        pre: &mut Self::Tensor,
        out: &mut Self::Tensor,
        bias: &Self::Tensor,
        width: usize,
    );
    /// Accumulates `dinp += gelu'(inp) · dout`.
    fn gelu_backward(&self, dinp: &mut Self::Tensor, inp: &Self::Tensor, dout: &Self::Tensor);
    /// `out = a + b`.
    fn residual_forward(&self, out: &mut Self::Tensor, a: &Self::Tensor, b: &Self::Tensor);
    /// `out = silu(gate) · up` (SwiGLU).
    fn swiglu_forward(&self, out: &mut Self::Tensor, gate: &Self::Tensor, up: &Self::Tensor);
    /// Accumulates SwiGLU's gradients into `dgate` and `dup`.
    fn swiglu_backward(
        &self,
        dgate: &mut Self::Tensor,
        dup: &mut Self::Tensor,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        dout: &Self::Tensor,
    );

    // Loss.

    /// Softmax of each row of `logits[n,v]` into `probs`; the term is
    /// `Σ −log p(target)` in f64 (added in row order).
    fn crossentropy_forward(
        &self,
        probs: &mut Self::Tensor,
        logits: &Self::Tensor,
        targets: &Self::Ids,
        n: usize,
        v: usize,
    ) -> Self::Scalar;
    /// `dlogits = (probs − onehot(target)) · scale`.
    fn crossentropy_backward(
        &self,
        dlogits: &mut Self::Tensor,
        probs: &Self::Tensor,
        targets: &Self::Ids,
        n: usize,
        v: usize,
        scale: f32,
    );

    // Mixture of experts (the arithmetic is documented in `runtime/model/moe.rs`).

    /// Softmax of each row of `logits[·,e]` (the router).
    fn softmax_rows(&self, probs: &mut Self::Tensor, logits: &Self::Tensor, e: usize);
    /// `out[at..]` = the rows of `src[·,c]` of the tokens of the given
    /// assignments (`token × k + j`), in order (dispatch).
    fn gather_rows(
        &self,
        out: &mut Self::Tensor,
        at: usize,
        src: &Self::Tensor,
        assignments: &[u32],
        k: usize,
        c: usize,
    );
    /// Accumulates into `dst[·,c]` the rows of `src[at..]`, one per
    /// assignment, at its token (the input gradients coming back).
    fn scatter_add_rows(
        &self,
        dst: &mut Self::Tensor,
        src: &Self::Tensor,
        at: usize,
        assignments: &[u32],
        k: usize,
        c: usize,
    );
    /// Accumulates into `out[n,c]`, token by token and choice by choice,
    /// `weight · y` of every kept assignment (`ys[expert]` holds its rows).
    fn moe_combine(&self, out: &mut Self::Tensor, ys: &[Self::Tensor], r: &Routing, c: usize);
    /// Backward of [`Backend::moe_combine`]: each kept assignment's weight
    /// gradient `dweight[a] = dout[token] · y` and its output gradient
    /// `dys[expert][row] = weight · dout[token]`.
    fn moe_combine_backward(
        &self,
        dweight: &mut Self::Tensor,
        dys: &mut [Self::Tensor],
        dout: &Self::Tensor,
        ys: &[Self::Tensor],
        r: &Routing,
        c: usize,
    );
    /// The router logits' gradient from each choice's weight gradient
    /// (through the renormalisation and the softmax) and the balance loss
    /// (`aux` per unit of the choice shares `shares[sequence, e]`).
    fn router_backward(
        &self,
        dlogits: &mut Self::Tensor,
        probs: &Self::Tensor,
        dweight: &Self::Tensor,
        shares: &[f32],
        aux: f32,
        r: &Routing,
        t: usize,
        e: usize,
    );

    // Optimizer.

    /// One AdamW step at time `step` (1-based) on `range` of each of `param`,
    /// `grad · grad_scale`, `m` and `v`; `decay` selects weight decay.
    fn adamw(
        &self,
        param: &mut Self::Tensor,
        grad: &Self::Tensor,
        m: &mut Self::Tensor,
        v: &mut Self::Tensor,
        range: Range<usize>,
        h: &AdamW,
        step: u32,
        grad_scale: f32,
        decay: bool,
    );
    /// `Σ` over the pieces, in order, of each piece's `Σ x²` in f64 (a host
    /// synchronisation: the gradient norm).
    fn sum_squares(&self, pieces: &[(&Self::Tensor, Range<usize>)]) -> Result<f64, BackendError>;
}

/// Tensors by parameter id: a device's parameters, gradients or moments,
/// or a buffer of gathered parameters or one microbatch's gradients.
/// Iterates in id order (the parameter names' order).
#[derive(Clone)]
pub struct ParamMap<T> {
    slots: Vec<Option<T>>,
    len: usize,
}

impl<T: std::fmt::Debug> std::fmt::Debug for ParamMap<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.iter().map(|(id, t)| (id.index(), t)))
            .finish()
    }
}

impl<T> Default for ParamMap<T> {
    fn default() -> Self {
        ParamMap {
            slots: Vec::new(),
            len: 0,
        }
    }
}

impl<T> ParamMap<T> {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn get(&self, id: ParamId) -> Option<&T> {
        self.slots.get(id.index())?.as_ref()
    }
    pub fn get_mut(&mut self, id: ParamId) -> Option<&mut T> {
        self.slots.get_mut(id.index())?.as_mut()
    }
    pub fn contains(&self, id: ParamId) -> bool {
        self.get(id).is_some()
    }
    /// Put `t` at `id`, giving back what was there.
    pub fn insert(&mut self, id: ParamId, t: T) -> Option<T> {
        let i = id.index();
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, || None);
        }
        let old = self.slots[i].replace(t);
        if old.is_none() {
            self.len += 1;
        }
        old
    }
    pub fn remove(&mut self, id: ParamId) -> Option<T> {
        let old = self.slots.get_mut(id.index())?.take();
        if old.is_some() {
            self.len -= 1;
        }
        old
    }
    /// `(id, tensor)` in id order.
    pub fn iter(&self) -> impl Iterator<Item = (ParamId, &T)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| {
            let id = ParamId::from_index(i).expect("ids fit u32");
            s.as_ref().map(|t| (id, t))
        })
    }
    /// `(id, tensor)` in id order, mutable.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (ParamId, &mut T)> {
        self.slots.iter_mut().enumerate().filter_map(|(i, s)| {
            let id = ParamId::from_index(i).expect("ids fit u32");
            s.as_mut().map(|t| (id, t))
        })
    }
    /// The ids held, in order.
    pub fn ids(&self) -> impl Iterator<Item = ParamId> + '_ {
        self.iter().map(|(id, _)| id)
    }
    /// Two different entries at once, mutably (a weight's and its bias's
    /// gradients); `None` when either is missing or they are the same id.
    pub fn pair_mut(&mut self, a: ParamId, b: ParamId) -> Option<(&mut T, &mut T)> {
        let (i, j) = (a.index(), b.index());
        if i == j || i.max(j) >= self.slots.len() {
            return None;
        }
        let (lo, hi) = self.slots.split_at_mut(i.max(j));
        let (x, y) = (lo[i.min(j)].as_mut()?, hi[0].as_mut()?);
        Some(if i < j { (x, y) } else { (y, x) })
    }
    /// Convert every entry.
    pub fn map<U>(&self, mut f: impl FnMut(ParamId, &T) -> U) -> ParamMap<U> {
        let mut out = ParamMap::new();
        for (id, t) in self.iter() {
            out.insert(id, f(id, t));
        }
        out
    }
}

impl<T> IntoIterator for ParamMap<T> {
    type Item = (ParamId, T);
    type IntoIter = std::iter::FilterMap<
        std::iter::Enumerate<std::vec::IntoIter<Option<T>>>,
        fn((usize, Option<T>)) -> Option<(ParamId, T)>,
    >;
    /// `(id, tensor)` in id order.
    fn into_iter(self) -> Self::IntoIter {
        fn entry<T>((i, s): (usize, Option<T>)) -> Option<(ParamId, T)> {
            Some((ParamId::from_index(i).expect("ids fit u32"), s?))
        }
        self.slots
            .into_iter()
            .enumerate()
            .filter_map(entry as fn(_) -> _)
    }
}

impl<T> FromIterator<(ParamId, T)> for ParamMap<T> {
    fn from_iter<I: IntoIterator<Item = (ParamId, T)>>(iter: I) -> Self {
        let mut m = ParamMap::new();
        for (id, t) in iter {
            m.insert(id, t);
        }
        m
    }
}

/// Parameter `id` of `params`, or the error that names it.
pub fn param<T>(params: &ParamMap<T>, id: ParamId) -> Result<&T, BackendError> {
    params.get(id).ok_or(BackendError::MissingParam(id))
}

/// Its gradient, mutably.
pub fn grad_mut<T>(grads: &mut ParamMap<T>, id: ParamId) -> Result<&mut T, BackendError> {
    grads.get_mut(id).ok_or(BackendError::MissingParam(id))
}

/// A weight's and its bias's gradients together.
pub fn grad_pair<T>(
    grads: &mut ParamMap<T>,
    w: ParamId,
    b: ParamId,
) -> Result<(&mut T, &mut T), BackendError> {
    let missing = match (grads.contains(w), grads.contains(b)) {
        (false, _) => w,
        (_, false) => b,
        _ => return grads.pair_mut(w, b).ok_or(BackendError::MissingParam(w)),
    };
    Err(BackendError::MissingParam(missing))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_param_map_iterates_in_id_order_and_pairs_two_entries() {
        let id = |i| ParamId::from_index(i).unwrap();
        let mut m: ParamMap<u32> = [(id(5), 50), (id(1), 10), (id(3), 30)]
            .into_iter()
            .collect();
        assert_eq!(m.len(), 3);
        assert_eq!(
            m.iter().map(|(i, v)| (i.index(), *v)).collect::<Vec<_>>(),
            [(1, 10), (3, 30), (5, 50)]
        );
        let (a, b) = m.pair_mut(id(5), id(1)).unwrap();
        (*a, *b) = (51, 11);
        assert_eq!((m.get(id(5)), m.get(id(1))), (Some(&51), Some(&11)));
        assert!(m.pair_mut(id(3), id(3)).is_none());
        assert!(m.pair_mut(id(3), id(4)).is_none());
        assert_eq!(
            grad_pair(&mut m, id(3), id(9)).unwrap_err(),
            BackendError::MissingParam(id(9))
        );
        assert_eq!(m.remove(id(3)), Some(30));
        assert_eq!((m.len(), m.remove(id(3))), (2, None));
    }
}

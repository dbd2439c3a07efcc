//! The CUDA backend (feature `cuda`): a plan device is a share of one GPU —
//! several plan devices may share a GPU (virtual devices), each with its own
//! streams and memory account. Built on cudarc with the CUDA libraries
//! loaded at run time, so it builds on machines without CUDA; matrix
//! products go through cuBLAS (`blas`), the other kernels are CUDA C
//! compiled with NVRTC when the device starts (`kernels`). fp32 arithmetic
//! (no TF32) on fp32 or bf16 storage.
//!
//! - **Streams**: each plan stream is a CUDA stream with its own cuBLAS
//!   handle; [`Backend::enter`] makes it current for the calling thread,
//!   and every kernel call enqueues on the current stream and returns.
//! - **Events**: a marked op records a CUDA event, a waiting stream waits
//!   on it (no host synchronisation). cudarc also orders the uses of a
//!   tensor across streams by the events each allocation carries.
//! - **Memory**: tensors come from the GPU's stream-ordered pool (cuMemAllocAsync),
//!   whose release threshold is raised so freed memory stays cached for the
//!   next step; the runtime accounts every tensor's bytes against the
//!   device's cap as on the CPU.
//! - **Failures**: a kernel launch that fails, or a fault the device
//!   reports later, is kept and returned by the next call that returns a
//!   `Result` (the runtime checks after every op, so the op is named).
//! - **bf16 storage** (the bf16 precision policy): a tensor is fp32 or bf16
//!   ([`Store`]). A kernel reads a bf16 input through a widened fp32 copy
//!   ([`In`]) and writes a bf16 output through a widened copy that is
//!   rounded back, nearest even, when the kernel is done ([`Out`]): the CPU
//!   backend's arithmetic, at the price of the copies (an op's own operands,
//!   freed with it, not in the memory account). A linear layer whose input
//!   and weight are both bf16 hands them to cuBLAS as they are
//!   (`cublasGemmEx`, fp32 compute, tensor cores) into an fp32 view of its
//!   output, which its bias joins before the one rounding.
//! - **Host reads**: the loss (each row's term in f64, added on the host in
//!   row order), the norm's sum of squares (per-block f64 sums), MoE routing.

mod blas;
pub mod kernels;
pub mod setup;

use super::{AdamW, Backend, BackendError, Routing, SeqRows, Trace};
use crate::model::Dtype;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig,
    PushKernelArg,
};
use std::cell::RefCell;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Whether `PIPER_CUDA_SYNC=1` asks to synchronise after every op.
fn sync_every_op() -> bool {
    static SYNC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SYNC.get_or_init(|| std::env::var("PIPER_CUDA_SYNC").is_ok_and(|v| v == "1"))
}

/// Threads per block (the kernels' reductions assume it).
const BLOCK: u32 = 256;

/// One GPU: its context and kernels, shared by the plan devices on it.
pub struct Gpu {
    pub ordinal: usize,
    ctx: Arc<CudaContext>,
    k: kernels::Kernels,
}

impl Gpu {
    /// Open GPU `ordinal`: its primary context, the stream-ordered pool
    /// set to keep freed memory, and the kernels compiled for it.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>, String> {
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("GPU {ordinal}: {e}"))?;
        keep_freed_memory(&ctx).map_err(|e| format!("GPU {ordinal}: {e}"))?;
        let k = kernels::Kernels::load(&ctx).map_err(|e| format!("GPU {ordinal}: {e}"))?;
        Ok(Arc::new(Gpu { ordinal, ctx, k }))
    }
    /// Free and total device memory, bytes.
    pub fn memory(&self) -> Result<(u64, u64), String> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| format!("GPU {}: reading its memory: {e}", self.ordinal))?;
        Ok((free as u64, total as u64))
    }
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown GPU".into())
    }
}

/// Raise the release threshold of the GPU's default memory pool, so memory
/// a step frees is reused by the next instead of going back to the driver.
fn keep_freed_memory(ctx: &Arc<CudaContext>) -> Result<(), String> {
    use cudarc::driver::sys;
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the device handle is the context's; the pool out-pointer is
    // valid; the attribute takes a u64.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(|e| format!("its default memory pool: {e}"))?;
        let mut threshold: u64 = u64::MAX;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .result()
        .map_err(|e| format!("keeping freed memory in its pool: {e}"))
    }
}

/// A stream of a device with its cuBLAS handle.
pub struct Queue {
    stream: Arc<CudaStream>,
    blas: cudarc::cublas::CudaBlas,
    /// The plan device it belongs to.
    device: u32,
}

impl Queue {
    /// Its cuBLAS handle and the stream the handle runs on.
    fn on(&self) -> (&cudarc::cublas::CudaBlas, &CudaStream) {
        (&self.blas, &self.stream)
    }
}

thread_local! {
    /// The stream the calling thread enqueues on ([`Backend::enter`]).
    static CURRENT: RefCell<Option<Arc<Queue>>> = const { RefCell::new(None) };
}

/// A tensor's storage on the GPU: fp32, or bf16 (each value's bits).
pub enum Store {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl Store {
    fn len(&self) -> usize {
        match self {
            Store::F32(x) => x.len(),
            Store::Bf16(x) => x.len(),
        }
    }
}

/// Storage on the GPU; empty holds nothing.
#[derive(Default)]
pub struct GpuTensor(Option<Store>);

/// A kernel's fp32 view of an input tensor: the tensor itself (fp32), or
/// a widened copy of it (bf16), which lives as long as the view.
pub enum In<'a> {
    Own(&'a CudaSlice<f32>),
    Widened(CudaSlice<f32>),
    /// An empty tensor, or a copy that could not be made (the failure is
    /// kept, and no kernel launches after it).
    Missing,
}

/// A kernel's fp32 view of an output tensor: the tensor itself (fp32), or
/// a widened copy (bf16; kernels that accumulate see its value) rounded
/// back into it when the view drops, after the kernels that wrote it.
pub struct Out<'a> {
    cuda: &'a Cuda,
    t: &'a mut GpuTensor,
    widened: Option<CudaSlice<f32>>,
}

impl Drop for Out<'_> {
    fn drop(&mut self) {
        let (Some(tmp), Some(Store::Bf16(dst))) = (&self.widened, &mut self.t.0) else {
            return;
        };
        let q = self.cuda.q();
        self.cuda.narrow(&q, &mut dst.slice_mut(..), &tmp.slice(..));
    }
}

/// An input of a linear layer's product: bf16 as stored (when both inputs
/// are: cuBLAS reads bf16 directly), or an fp32 view.
pub enum Operand<'a> {
    Bf16(&'a CudaSlice<u16>),
    F32(In<'a>),
}

impl Operand<'_> {
    fn mat(&self) -> blas::Mat<'_> {
        match self {
            Operand::Bf16(x) => blas::Mat::Bf16(x),
            Operand::F32(v) => blas::Mat::F32(v.view()),
        }
    }
}

/// What a kernel reads as fp32.
trait View {
    fn view(&self) -> &CudaSlice<f32>;
}
/// What a kernel writes as fp32.
trait ViewMut: View {
    fn view_mut(&mut self) -> &mut CudaSlice<f32>;
}

impl View for In<'_> {
    fn view(&self) -> &CudaSlice<f32> {
        match self {
            In::Own(x) => x,
            In::Widened(x) => x,
            In::Missing => panic!("a kernel's input is an allocated tensor"),
        }
    }
}
impl View for Out<'_> {
    fn view(&self) -> &CudaSlice<f32> {
        match (&self.widened, &self.t.0) {
            (Some(x), _) | (None, Some(Store::F32(x))) => x,
            _ => panic!("a kernel's output is an allocated tensor"),
        }
    }
}
impl ViewMut for Out<'_> {
    fn view_mut(&mut self) -> &mut CudaSlice<f32> {
        match (&mut self.widened, &mut self.t.0) {
            (Some(x), _) | (None, Some(Store::F32(x))) => x,
            _ => panic!("a kernel's output is an allocated tensor"),
        }
    }
}

/// Token ids on the GPU, and their rows grouped by token (for the
/// embedding's gradient).
#[derive(Default)]
pub struct GpuIds(Option<CudaSlice<u32>>, Option<Arc<ByToken>>);

/// The rows of a token tensor grouped by token, made on the host when the
/// ids are uploaded: the distinct tokens ascending (`uniq`), where each
/// one's rows start in `rows` (`starts`, one more than `uniq`), and the rows
/// themselves, ascending within a token. A thread per (token, channel) then
/// adds the token's rows in the order the CPU does, with no two threads
/// writing one value. Index metadata beside the ids (three `u32` a token at
/// most), outside the memory account as the ids' own copies are not.
pub struct ByToken {
    uniq: CudaSlice<u32>,
    starts: CudaSlice<u32>,
    rows: CudaSlice<u32>,
    count: usize,
}

/// `(uniq, starts, rows)` of `v` (see [`ByToken`]).
fn group_by_token(v: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut rows: Vec<u32> = (0..v.len() as u32).collect();
    rows.sort_by_key(|&r| v[r as usize]);
    let (mut uniq, mut starts) = (Vec::new(), Vec::new());
    for (i, &r) in rows.iter().enumerate() {
        let tok = v[r as usize];
        if uniq.last() != Some(&tok) {
            uniq.push(tok);
            starts.push(i as u32);
        }
    }
    starts.push(rows.len() as u32);
    (uniq, starts, rows)
}

/// A loss term: a host value, or each row's `-ln p` in f64 on the GPU.
pub enum Term {
    Host(f64),
    Rows(CudaSlice<f64>),
}

/// Enqueue kernel `f` on queue `q` with the arguments in order; a failure
/// is kept (see [`Cuda::fail`]). Each argument is bound to a local first:
/// the launch reads them through pointers, so they must outlive it.
macro_rules! launch {
    ($self:expr, $q:expr, $f:ident, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        // After a failure nothing more is enqueued: an input copy that could
        // not be made leaves no view to launch with.
        if !$self.broken() {
            let queue: &Queue = &$q;
            let mut b = queue.stream.launch_builder(&$self.gpu.k.$f);
            $(
                let a = $arg;
                b.arg(a);
            )*
            // SAFETY: the arguments are the kernel's, in its order, with the
            // shapes the callers' tensors have.
            if let Err(e) = unsafe { b.launch($cfg) } {
                $self.fail(stringify!($f), e);
            }
        }
    }};
}

/// One plan device on a GPU.
pub struct Cuda {
    device: u32,
    gpu: Arc<Gpu>,
    /// The stream kernels go to outside [`Backend::enter`] (setup, restore,
    /// reads at the step's end).
    default: Arc<Queue>,
    /// The first failure not yet reported.
    failed: Mutex<Option<String>>,
    /// Whether anything has failed: no kernel is enqueued after (a failure
    /// is sticky for the run, as a CUDA context's faults are).
    broken: std::sync::atomic::AtomicBool,
}

impl Cuda {
    /// Plan device `device` on `gpu`.
    pub fn new(device: u32, gpu: Arc<Gpu>) -> Result<Self, BackendError> {
        let default = Self::queue_on(&gpu, device)?;
        Ok(Cuda {
            device,
            gpu,
            default,
            failed: Mutex::new(None),
            broken: Default::default(),
        })
    }

    fn queue_on(gpu: &Arc<Gpu>, device: u32) -> Result<Arc<Queue>, BackendError> {
        let stream = gpu
            .ctx
            .new_stream()
            .map_err(|e| BackendError::Device(format!("creating a stream: {e}")))?;
        let blas = blas::handle(stream.clone()).map_err(BackendError::Device)?;
        Ok(Arc::new(Queue {
            stream,
            blas,
            device,
        }))
    }

    /// The stream this thread enqueues on for this device.
    fn q(&self) -> Arc<Queue> {
        CURRENT
            .with(|c| c.borrow().clone())
            .filter(|q| q.device == self.device)
            .unwrap_or_else(|| self.default.clone())
    }

    /// Keep the first failure for the next call that returns a `Result`.
    fn fail(&self, what: &str, e: impl std::fmt::Display) {
        (self.broken).store(true, std::sync::atomic::Ordering::Relaxed);
        let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            *f = Some(format!("{what}: {e}"));
        }
    }

    /// A kept failure, or the context's own, as an error.
    fn pending(&self) -> Result<(), BackendError> {
        if let Some(e) = self.failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(BackendError::Device(e));
        }
        // Reported once above; every later call says kernels stopped.
        if self.broken() {
            return Err(BackendError::Device(
                "an earlier failure on this device stopped its kernels".into(),
            ));
        }
        self.gpu
            .ctx
            .check_err()
            .map_err(|e| BackendError::Device(e.to_string()))
    }

    fn alloc(&self, q: &Queue, n: usize) -> Result<CudaSlice<f32>, BackendError> {
        q.stream
            .alloc_zeros::<f32>(n)
            .map_err(|e| BackendError::Alloc {
                bytes: n as u64 * 4,
                message: e.to_string(),
            })
    }

    fn broken(&self) -> bool {
        self.broken.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `src` widened into a new fp32 slice.
    fn widen(&self, q: &Queue, src: &CudaSlice<u16>) -> Result<CudaSlice<f32>, BackendError> {
        let n = src.len();
        let mut out = self.alloc(q, n)?;
        self.widen_into(q, &mut out.slice_mut(..), &src.slice(..));
        Ok(out)
    }
    fn widen_into(&self, q: &Queue, out: &mut CudaViewMut<'_, f32>, src: &CudaView<'_, u16>) {
        let n = src.len();
        if n == 0 {
            return;
        }
        launch!(self, q, bf16_widen, elems(n), [out, src, &i64n(n)]);
    }
    /// `dst = src` rounded to bf16 (nearest, ties to even).
    fn narrow(&self, q: &Queue, dst: &mut CudaViewMut<'_, u16>, src: &CudaView<'_, f32>) {
        let n = src.len();
        if n == 0 {
            return;
        }
        launch!(self, q, bf16_narrow, elems(n), [dst, src, &i64n(n)]);
    }

    /// The channels of a head for the attention kernels (a thread per
    /// channel: at most [`BLOCK`]), or the failure kept for `op`.
    fn head_width(&self, op: &str, c: usize, nh: usize) -> Option<usize> {
        let hs = c / nh;
        if hs > BLOCK as usize {
            self.fail(op, format!("heads of {hs} channels (at most {BLOCK})"));
            return None;
        }
        Some(hs)
    }

    /// The second stage of a column sum: `dst[j] += Σ_p partial[p, j]`, the
    /// chunks in order.
    fn finish_columns(
        &self,
        q: &Queue,
        dst: &mut CudaSlice<f32>,
        partial: &CudaSlice<f32>,
        parts: usize,
        c: usize,
    ) {
        launch!(
            self,
            q,
            col_finish,
            elems(c),
            [dst, partial, &i32n(parts), &i32n(c)]
        );
    }

    /// A kernel's fp32 view of input `t` (see [`In`]).
    fn rd<'a>(&self, t: &'a GpuTensor) -> In<'a> {
        match &t.0 {
            None => In::Missing,
            Some(Store::F32(x)) => In::Own(x),
            Some(Store::Bf16(x)) => match self.widen(&self.q(), x) {
                Ok(w) => In::Widened(w),
                Err(e) => {
                    self.fail("widening a bf16 input", e);
                    In::Missing
                }
            },
        }
    }
    /// The two inputs of a product: bf16 as stored when both are, else
    /// fp32 views of both.
    fn operands<'a>(&self, a: &'a GpuTensor, b: &'a GpuTensor) -> (Operand<'a>, Operand<'a>) {
        match (&a.0, &b.0) {
            (Some(Store::Bf16(x)), Some(Store::Bf16(y))) => (Operand::Bf16(x), Operand::Bf16(y)),
            _ => (Operand::F32(self.rd(a)), Operand::F32(self.rd(b))),
        }
    }
    /// A kernel's fp32 view of output `t` (see [`Out`]).
    fn wr<'a>(&'a self, t: &'a mut GpuTensor) -> Out<'a> {
        let widened = match &t.0 {
            Some(Store::Bf16(x)) => match self.widen(&self.q(), x) {
                Ok(w) => Some(w),
                Err(e) => {
                    self.fail("widening a bf16 output", e);
                    None
                }
            },
            _ => None,
        };
        Out {
            cuda: self,
            t,
            widened,
        }
    }

    /// Wait for everything enqueued on `q` (a host read).
    fn sync(&self, q: &Queue) -> Result<(), BackendError> {
        q.stream
            .synchronize()
            .map_err(|e| BackendError::Device(format!("waiting for the stream: {e}")))?;
        self.pending()
    }
}

/// Launch shapes: a grid-stride loop over `n` elements, a block per row, a
/// thread per column.
fn elems(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 65_535 * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}
/// A column sum over `n` rows of `c` columns in two stages: the first
/// stage's grid (a thread per column, a block row per chunk of rows), the
/// number of chunks and the rows in each (at least 64, at most 128 chunks).
fn column_chunks(n: usize, c: usize) -> (LaunchConfig, usize, usize) {
    let chunk = n.div_ceil(128).max(64);
    let parts = n.div_ceil(chunk).max(1);
    let cfg = LaunchConfig {
        grid_dim: (c.div_ceil(BLOCK as usize).max(1) as u32, parts as u32, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    (cfg, parts, chunk)
}
/// Whether `assignments` (`token × k + choice`) name each token at most
/// once, so a scatter of their rows may add every element in parallel.
fn distinct_tokens(assignments: &[u32], k: usize) -> bool {
    let mut seen = std::collections::HashSet::with_capacity(assignments.len());
    assignments
        .iter()
        .all(|a| seen.insert(*a as usize / k.max(1)))
}
fn rows(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.max(1) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Elements of a tensor or of a view of one.
trait Elems {
    fn elems(&self) -> usize;
}
impl Elems for GpuTensor {
    fn elems(&self) -> usize {
        self.0.as_ref().map_or(0, |s| s.len())
    }
}
impl Elems for In<'_> {
    fn elems(&self) -> usize {
        match self {
            In::Own(x) => x.len(),
            In::Widened(x) => x.len(),
            In::Missing => 0,
        }
    }
}
impl Elems for Out<'_> {
    fn elems(&self) -> usize {
        self.t.elems()
    }
}
fn vlen<T: Elems>(t: &T) -> usize {
    t.elems()
}

/// The fp32 slice a kernel reads (a view that must hold data).
fn s<V: View>(t: &V) -> &CudaSlice<f32> {
    t.view()
}
/// The fp32 slice a kernel writes.
fn sm<V: ViewMut>(t: &mut V) -> &mut CudaSlice<f32> {
    t.view_mut()
}
fn ids(t: &GpuIds) -> &CudaSlice<u32> {
    t.0.as_ref().expect("token ids are allocated")
}

/// `n` as the kernels' 64-bit count.
fn i64n(n: usize) -> i64 {
    n as i64
}
/// A shape as the kernels' `int` (the model's shapes fit: checked by the plan).
fn i32n(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// The attention kernels' held-row arguments: rows held, rows per chunk,
/// and the chunks' first positions.
fn seq_rows(h: SeqRows) -> (i32, i32, i32, i32) {
    (
        i32n(h.len()),
        i32n(h.chunk),
        i32n(h.starts[0]),
        i32n(h.starts[1]),
    )
}

impl Backend for Cuda {
    type Tensor = GpuTensor;
    type Ids = GpuIds;
    type Scalar = Term;
    type Stream = Arc<Queue>;
    type Event = Option<CudaEvent>;

    fn name(&self) -> &'static str {
        "cuda"
    }
    /// Virtual devices on one GPU share its context: a tensor one made is
    /// the other's to use (cudarc's per-allocation events order the uses).
    fn shares_memory_with(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.gpu, &other.gpu)
    }

    fn stream(&self) -> Result<Arc<Queue>, BackendError> {
        Self::queue_on(&self.gpu, self.device)
    }
    fn enter<R: Send>(
        &self,
        stream: &Arc<Queue>,
        _trace: Trace<'_>,
        f: impl FnOnce() -> R + Send,
    ) -> R {
        let out = self.with_stream(stream, f);
        // `PIPER_CUDA_SYNC=1`: wait for each op's kernels, so a fault is
        // reported at the op that made it.
        if sync_every_op() {
            if let Err(e) = stream.stream.synchronize() {
                self.fail("synchronising after the op (PIPER_CUDA_SYNC=1)", e);
            }
        }
        out
    }
    fn with_stream<R>(&self, stream: &Arc<Queue>, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<Arc<Queue>>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let prev = self.0.take();
                CURRENT.with(|c| *c.borrow_mut() = prev);
            }
        }
        if let Err(e) = self.gpu.ctx.bind_to_thread() {
            self.fail("binding the GPU to the stream's thread", e);
        }
        let prev = CURRENT.with(|c| c.borrow_mut().replace(stream.clone()));
        let _restore = Restore(prev);
        f()
    }
    fn record(&self, stream: &Arc<Queue>) -> Option<CudaEvent> {
        match stream.stream.record_event(None) {
            Ok(e) => Some(e),
            Err(e) => {
                self.fail("recording an event", e);
                None
            }
        }
    }
    fn wait(&self, stream: &Arc<Queue>, event: &Option<CudaEvent>) {
        if let Some(e) = event {
            if let Err(err) = stream.stream.wait(e) {
                self.fail("waiting for another stream", err);
            }
        }
    }
    fn check(&self) -> Result<(), BackendError> {
        self.pending()
    }

    fn len(t: &GpuTensor) -> usize {
        t.elems()
    }
    fn bytes(t: &GpuTensor) -> u64 {
        Self::len(t) as u64 * Self::dtype(t).bytes()
    }
    fn ids_bytes(t: &GpuIds) -> u64 {
        t.0.as_ref().map_or(0, |s| s.len()) as u64 * 4
    }
    fn zeros(&self, n: usize) -> Result<GpuTensor, BackendError> {
        self.zeros_as(n, Dtype::F32)
    }
    fn dtype(t: &GpuTensor) -> Dtype {
        match &t.0 {
            Some(Store::Bf16(_)) => Dtype::Bf16,
            _ => Dtype::F32,
        }
    }
    fn zeros_as(&self, n: usize, dtype: Dtype) -> Result<GpuTensor, BackendError> {
        if n == 0 {
            return Ok(GpuTensor(None));
        }
        self.pending()?;
        let q = self.q();
        let store =
            match dtype {
                Dtype::F32 => Store::F32(self.alloc(&q, n)?),
                Dtype::Bf16 => Store::Bf16(q.stream.alloc_zeros::<u16>(n).map_err(|e| {
                    BackendError::Alloc {
                        bytes: n as u64 * 2,
                        message: e.to_string(),
                    }
                })?),
            };
        Ok(GpuTensor(Some(store)))
    }
    fn cast(&self, t: &GpuTensor, dtype: Dtype) -> Result<GpuTensor, BackendError> {
        if Self::dtype(t) == dtype {
            return self.duplicate(t);
        }
        let mut out = self.zeros_as(vlen(t), dtype)?;
        self.copy(&mut out, 0, t, 0..vlen(t));
        self.pending()?;
        Ok(out)
    }
    fn upload(&self, v: Vec<f32>) -> Result<GpuTensor, BackendError> {
        if v.is_empty() {
            return Ok(GpuTensor(None));
        }
        self.pending()?;
        let q = self.q();
        let t = q.stream.clone_htod(&v).map_err(|e| BackendError::Alloc {
            bytes: v.len() as u64 * 4,
            message: e.to_string(),
        })?;
        Ok(GpuTensor(Some(Store::F32(t))))
    }
    fn upload_ids(&self, v: &[u32]) -> Result<GpuIds, BackendError> {
        if v.is_empty() {
            return Ok(GpuIds(None, None));
        }
        // Row numbers are u32 on the device.
        if u32::try_from(v.len()).is_err() {
            return Err(BackendError::Device(format!(
                "{} token ids are past what a u32 row number holds",
                v.len()
            )));
        }
        let q = self.q();
        let up = |x: &[u32]| {
            q.stream.clone_htod(x).map_err(|e| BackendError::Alloc {
                bytes: x.len() as u64 * 4,
                message: e.to_string(),
            })
        };
        let t = up(v)?;
        let (uniq, starts, rows) = group_by_token(v);
        let by = ByToken {
            count: uniq.len(),
            uniq: up(&uniq)?,
            starts: up(&starts)?,
            rows: up(&rows)?,
        };
        Ok(GpuIds(Some(t), Some(Arc::new(by))))
    }
    fn download(&self, t: &GpuTensor) -> Result<Vec<f32>, BackendError> {
        self.download_range(t, 0..vlen(t))
    }
    fn download_range(&self, t: &GpuTensor, range: Range<usize>) -> Result<Vec<f32>, BackendError> {
        if range.is_empty() {
            return Ok(Vec::new());
        }
        let q = self.q();
        let copied = match &t.0 {
            Some(Store::F32(x)) => q.stream.clone_dtoh(&x.slice(range)),
            Some(Store::Bf16(x)) => q.stream.clone_dtoh(&x.slice(range)).map(|bits| {
                bits.into_iter()
                    .map(|b| f32::from_bits(u32::from(b) << 16))
                    .collect()
            }),
            None => {
                return Err(BackendError::Device(format!(
                    "reading {range:?} of an empty tensor"
                )))
            }
        };
        let v = copied.map_err(|e| BackendError::Device(format!("copying to the host: {e}")))?;
        self.sync(&q)?;
        Ok(v)
    }
    fn download_owned(&self, t: GpuTensor) -> Result<Vec<f32>, BackendError> {
        self.download(&t)
    }
    fn duplicate(&self, t: &GpuTensor) -> Result<GpuTensor, BackendError> {
        let Some(src) = &t.0 else {
            return Ok(GpuTensor(None));
        };
        self.pending()?;
        let q = self.q();
        let alloc = |e: cudarc::driver::DriverError| BackendError::Alloc {
            bytes: Self::bytes(t),
            message: e.to_string(),
        };
        let d = match src {
            Store::F32(x) => Store::F32(q.stream.clone_dtod(x).map_err(alloc)?),
            Store::Bf16(x) => Store::Bf16(q.stream.clone_dtod(x).map_err(alloc)?),
        };
        Ok(GpuTensor(Some(d)))
    }
    fn duplicate_ids(&self, t: &GpuIds) -> Result<GpuIds, BackendError> {
        let Some(src) = &t.0 else {
            return Ok(GpuIds(None, None));
        };
        let q = self.q();
        let d = q.stream.clone_dtod(src).map_err(|e| BackendError::Alloc {
            bytes: src.len() as u64 * 4,
            message: e.to_string(),
        })?;
        Ok(GpuIds(Some(d), t.1.clone()))
    }
    fn copy(&self, dst: &mut GpuTensor, at: usize, src: &GpuTensor, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        let q = self.q();
        let to = at..at + range.len();
        let (Some(d), Some(sr)) = (&mut dst.0, &src.0) else {
            return self.fail("copying on the device", "an empty tensor");
        };
        let done = match (d, sr) {
            (Store::F32(d), Store::F32(sr)) => {
                q.stream.memcpy_dtod(&sr.slice(range), &mut d.slice_mut(to))
            }
            (Store::Bf16(d), Store::Bf16(sr)) => {
                q.stream.memcpy_dtod(&sr.slice(range), &mut d.slice_mut(to))
            }
            (Store::F32(d), Store::Bf16(sr)) => {
                self.widen_into(&q, &mut d.slice_mut(to), &sr.slice(range));
                Ok(())
            }
            (Store::Bf16(d), Store::F32(sr)) => {
                self.narrow(&q, &mut d.slice_mut(to), &sr.slice(range));
                Ok(())
            }
        };
        if let Err(e) = done {
            self.fail("copying on the device", e);
        }
    }
    fn write(&self, dst: &mut GpuTensor, at: usize, src: &[f32]) {
        if src.is_empty() {
            return;
        }
        let q = self.q();
        let to = at..at + src.len();
        let done = match &mut dst.0 {
            Some(Store::F32(d)) => q.stream.memcpy_htod(src, &mut d.slice_mut(to)),
            Some(Store::Bf16(d)) => q.stream.clone_htod(src).map(|tmp| {
                self.narrow(&q, &mut d.slice_mut(to), &tmp.slice(..));
            }),
            None => return self.fail("copying to the device", "an empty tensor"),
        };
        if let Err(e) = done {
            self.fail("copying to the device", e);
        }
    }
    fn add_host(&self, dst: &mut GpuTensor, at: usize, src: &[f32]) {
        if src.is_empty() {
            return;
        }
        let q = self.q();
        let tmp = match q.stream.clone_htod(src) {
            Ok(t) => t,
            Err(e) => return self.fail("copying to the device", e),
        };
        let n = src.len();
        let dst = &mut self.wr(dst);
        if self.broken() {
            return;
        }
        let mut to = sm(dst).slice_mut(at..at + n);
        launch!(self, q, add_into, elems(n), [&mut to, &tmp, &i64n(n)]);
    }
    fn add(&self, dst: &mut GpuTensor, src: &GpuTensor) {
        let dst = &mut self.wr(dst);
        let src = &self.rd(src);
        if self.broken() {
            return;
        }
        let n = vlen(dst).min(vlen(src));
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(self, q, add_into, elems(n), [sm(dst), s(src), &i64n(n)]);
    }
    fn fill_zero(&self, t: &mut GpuTensor) {
        let q = self.q();
        let done = match t.0.as_mut() {
            None => return,
            Some(Store::F32(d)) => q.stream.memset_zeros(d),
            Some(Store::Bf16(d)) => q.stream.memset_zeros(d),
        };
        if let Err(e) = done {
            self.fail("zeroing", e);
        }
    }
    fn scalar(&self, x: f64) -> Term {
        Term::Host(x)
    }
    fn read_scalar(&self, s: Term) -> Result<f64, BackendError> {
        match s {
            Term::Host(x) => Ok(x),
            Term::Rows(rows) => {
                let q = self.q();
                let v = q
                    .stream
                    .clone_dtoh(&rows)
                    .map_err(|e| BackendError::Device(format!("reading the loss: {e}")))?;
                self.sync(&q)?;
                Ok(v.iter().fold(0.0f64, |a, x| a + x))
            }
        }
    }

    fn embedding_forward(
        &self,
        out: &mut GpuTensor,
        tokens: &GpuIds,
        wte: &GpuTensor,
        wpe: Option<&GpuTensor>,
        b: usize,
        t: usize,
        c: usize,
    ) {
        let out = &mut self.wr(out);
        let wte = &self.rd(wte);
        let wpe = wpe.map(|t| self.rd(t));
        let wpe = wpe.as_ref();
        if self.broken() {
            return;
        }
        let q = self.q();
        let bt = b * t;
        match wpe {
            Some(wpe) => launch!(
                self,
                q,
                embedding_forward,
                elems(bt * c),
                [
                    sm(out),
                    ids(tokens),
                    s(wte),
                    s(wpe),
                    &i32n(bt),
                    &i32n(t),
                    &i32n(c)
                ]
            ),
            None => launch!(
                self,
                q,
                token_embedding_forward,
                elems(bt * c),
                [sm(out), ids(tokens), s(wte), &i32n(bt), &i32n(c)]
            ),
        }
    }
    fn embedding_backward_weight(
        &self,
        dwte: &mut GpuTensor,
        dwpe: Option<&mut GpuTensor>,
        dout: &GpuTensor,
        tokens: &GpuIds,
        b: usize,
        t: usize,
        c: usize,
    ) {
        let dwte = &mut self.wr(dwte);
        let mut dwpe = dwpe.map(|t| self.wr(t));
        let dwpe = dwpe.as_mut();
        let dout = &self.rd(dout);
        if self.broken() {
            return;
        }
        let q = self.q();
        let bt = b * t;
        let Some(by) = &tokens.1 else {
            return self.fail(
                "embedding_backward_weight",
                "token ids uploaded without their rows by token",
            );
        };
        let (nu, count) = (i32n(by.count), by.count * c);
        launch!(
            self,
            q,
            embedding_backward_tokens,
            elems(count),
            [
                sm(dwte),
                s(dout),
                &by.uniq,
                &by.starts,
                &by.rows,
                &nu,
                &i32n(bt),
                &i32n(c)
            ]
        );
        if let Some(dwpe) = dwpe {
            launch!(
                self,
                q,
                embedding_backward_positions,
                elems(t * c),
                [sm(dwpe), s(dout), &i32n(bt), &i32n(t), &i32n(c)]
            );
        }
    }

    fn layernorm_forward(
        &self,
        out: &mut GpuTensor,
        mean: &mut GpuTensor,
        rstd: &mut GpuTensor,
        inp: &GpuTensor,
        weight: &GpuTensor,
        bias: &GpuTensor,
        n: usize,
        c: usize,
    ) {
        let out = &mut self.wr(out);
        let mean = &mut self.wr(mean);
        let rstd = &mut self.wr(rstd);
        let inp = &self.rd(inp);
        let weight = &self.rd(weight);
        let bias = &self.rd(bias);
        if self.broken() {
            return;
        }
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            layernorm_forward,
            rows(n),
            [
                sm(out),
                sm(mean),
                sm(rstd),
                s(inp),
                s(weight),
                s(bias),
                &i32n(n),
                &i32n(c)
            ]
        );
    }
    fn layernorm_backward_input(
        &self,
        dinp: &mut GpuTensor,
        dout: &GpuTensor,
        inp: &GpuTensor,
        weight: &GpuTensor,
        mean: &GpuTensor,
        rstd: &GpuTensor,
        n: usize,
        c: usize,
    ) {
        let dinp = &mut self.wr(dinp);
        let dout = &self.rd(dout);
        let inp = &self.rd(inp);
        let weight = &self.rd(weight);
        let mean = &self.rd(mean);
        let rstd = &self.rd(rstd);
        if self.broken() {
            return;
        }
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            layernorm_backward_input,
            rows(n),
            [
                sm(dinp),
                s(dout),
                s(inp),
                s(weight),
                s(mean),
                s(rstd),
                &i32n(n),
                &i32n(c)
            ]
        );
    }
    fn layernorm_backward_weight(
        &self,
        dweight: &mut GpuTensor,
        dbias: &mut GpuTensor,
        dout: &GpuTensor,
        inp: &GpuTensor,
        mean: &GpuTensor,
        rstd: &GpuTensor,
        n: usize,
        c: usize,
    ) {
        let dweight = &mut self.wr(dweight);
        let dbias = &mut self.wr(dbias);
        let dout = &self.rd(dout);
        let inp = &self.rd(inp);
        let mean = &self.rd(mean);
        let rstd = &self.rd(rstd);
        if self.broken() {
            return;
        }
        if n == 0 {
            return;
        }
        let q = self.q();
        let (cfg, parts, chunk) = column_chunks(n, c);
        let (Ok(mut pw), Ok(mut pb)) = (self.alloc(&q, parts * c), self.alloc(&q, parts * c))
        else {
            return self.fail(
                "layernorm_backward_weight",
                "cannot allocate its partial sums",
            );
        };
        launch!(
            self,
            q,
            layernorm_backward_weight,
            cfg,
            [
                &mut pw,
                &mut pb,
                s(dout),
                s(inp),
                s(mean),
                s(rstd),
                &i32n(n),
                &i32n(c),
                &i32n(chunk)
            ]
        );
        self.finish_columns(&q, sm(dweight), &pw, parts, c);
        self.finish_columns(&q, sm(dbias), &pb, parts, c);
    }

    fn rmsnorm_forward(
        &self,
        out: &mut GpuTensor,
        rstd: &mut GpuTensor,
        inp: &GpuTensor,
        weight: &GpuTensor,
        n: usize,
        c: usize,
        eps: f32,
    ) {
        let out = &mut self.wr(out);
        let rstd = &mut self.wr(rstd);
        let inp = &self.rd(inp);
        let weight = &self.rd(weight);
        if self.broken() {
            return;
        }
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            rmsnorm_forward,
            rows(n),
            [
                sm(out),
                sm(rstd),
                s(inp),
                s(weight),
                &i32n(n),
                &i32n(c),
                &eps
            ]
        );
    }
    fn rmsnorm_backward_input(
        &self,
        dinp: &mut GpuTensor,
        dout: &GpuTensor,
        inp: &GpuTensor,
        weight: &GpuTensor,
        rstd: &GpuTensor,
        n: usize,
        c: usize,
    ) {
        let dinp = &mut self.wr(dinp);
        let dout = &self.rd(dout);
        let inp = &self.rd(inp);
        let weight = &self.rd(weight);
        let rstd = &self.rd(rstd);
        if self.broken() {
            return;
        }
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            rmsnorm_backward_input,
            rows(n),
            [
                sm(dinp),
                s(dout),
                s(inp),
                s(weight),
                s(rstd),
                &i32n(n),
                &i32n(c)
            ]
        );
    }
    fn rmsnorm_backward_weight(
        &self,
        dweight: &mut GpuTensor,
        dout: &GpuTensor,
        inp: &GpuTensor,
        rstd: &GpuTensor,
        n: usize,
        c: usize,
    ) {
        let dweight = &mut self.wr(dweight);
        let dout = &self.rd(dout);
        let inp = &self.rd(inp);
        let rstd = &self.rd(rstd);
        if self.broken() {
            return;
        }
        if n == 0 {
            return;
        }
        let q = self.q();
        let (cfg, parts, chunk) = column_chunks(n, c);
        let Ok(mut pw) = self.alloc(&q, parts * c) else {
            return self.fail(
                "rmsnorm_backward_weight",
                "cannot allocate its partial sums",
            );
        };
        launch!(
            self,
            q,
            rmsnorm_backward_weight,
            cfg,
            [
                &mut pw,
                s(dout),
                s(inp),
                s(rstd),
                &i32n(n),
                &i32n(c),
                &i32n(chunk)
            ]
        );
        self.finish_columns(&q, sm(dweight), &pw, parts, c);
    }
    fn rope(
        &self,
        x: &mut GpuTensor,
        b: usize,
        t: usize,
        heads: usize,
        hd: usize,
        theta: f64,
        inverse: bool,
    ) {
        let x = &mut self.wr(x);
        if self.broken() {
            return;
        }
        let rows = b * t;
        if rows == 0 || heads == 0 || hd < 2 {
            return;
        }
        let q = self.q();
        let sign: f32 = if inverse { -1.0 } else { 1.0 };
        launch!(
            self,
            q,
            rope,
            elems(rows * heads * (hd / 2)),
            [
                sm(x),
                &i64n(rows),
                &i32n(t),
                &i32n(heads),
                &i32n(hd),
                &theta,
                &sign
            ]
        );
    }

    fn matmul_forward(
        &self,
        out: &mut GpuTensor,
        inp: &GpuTensor,
        weight: &GpuTensor,
        bias: Option<&GpuTensor>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        let out = &mut self.wr(out);
        let (inp, weight) = &self.operands(inp, weight);
        let bias = bias.map(|t| self.rd(t));
        let bias = bias.as_ref();
        if self.broken() {
            return;
        }
        if n == 0 || oc == 0 {
            return;
        }
        let q = self.q();
        let mats = (inp.mat(), weight.mat());
        if let Err(e) = blas::linear(q.on(), sm(out), mats.0, mats.1, (n, c, oc), 0.0) {
            return self.fail("matmul_forward", e);
        }
        if let Some(b) = bias {
            launch!(
                self,
                q,
                add_bias_rows,
                elems(n * oc),
                [sm(out), s(b), &i64n(n * oc), &i32n(oc)]
            );
        }
    }
    fn matmul_forward_residual(
        &self,
        out: &mut GpuTensor,
        res: &GpuTensor,
        inp: &GpuTensor,
        weight: &GpuTensor,
        bias: Option<&GpuTensor>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        let out = &mut self.wr(out);
        let res = &self.rd(res);
        let (inp, weight) = &self.operands(inp, weight);
        let bias = bias.map(|t| self.rd(t));
        let bias = bias.as_ref();
        if self.broken() {
            return;
        }
        if n == 0 || oc == 0 {
            return;
        }
        let q = self.q();
        match bias {
            Some(bias) => launch!(
                self,
                q,
                residual_bias,
                elems(n * oc),
                [sm(out), s(res), s(bias), &i64n(n * oc), &i32n(oc)]
            ),
            None => {
                let (from, mut to) = (s(res).slice(0..n * oc), sm(out).slice_mut(0..n * oc));
                if let Err(e) = q.stream.memcpy_dtod(&from, &mut to) {
                    self.fail("matmul_forward_residual", e);
                }
            }
        }
        let mats = (inp.mat(), weight.mat());
        if let Err(e) = blas::linear(q.on(), sm(out), mats.0, mats.1, (n, c, oc), 1.0) {
            self.fail("matmul_forward_residual", e);
        }
    }
    fn matmul_backward_input(
        &self,
        dinp: &mut GpuTensor,
        dout: &GpuTensor,
        weight: &GpuTensor,
        n: usize,
        c: usize,
        oc: usize,
        accumulate: bool,
    ) {
        let dinp = &mut self.wr(dinp);
        let (dout, weight) = &self.operands(dout, weight);
        if self.broken() {
            return;
        }
        if n == 0 || c == 0 {
            return;
        }
        let q = self.q();
        let beta = if accumulate { 1.0 } else { 0.0 };
        if let Err(e) = blas::linear_backward_input(
            q.on(),
            sm(dinp),
            dout.mat(),
            weight.mat(),
            (n, c, oc),
            beta,
        ) {
            self.fail("matmul_backward_input", e);
        }
    }
    fn matmul_backward_weight(
        &self,
        dweight: &mut GpuTensor,
        dbias: Option<&mut GpuTensor>,
        dout: &GpuTensor,
        inp: &GpuTensor,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        let dweight = &mut self.wr(dweight);
        let mut dbias = dbias.map(|t| self.wr(t));
        let dbias = dbias.as_mut();
        let (dout_m, inp) = &self.operands(dout, inp);
        if self.broken() {
            return;
        }
        if n == 0 || oc == 0 {
            return;
        }
        let q = self.q();
        if let Err(e) =
            blas::linear_backward_weight(q.on(), sm(dweight), dout_m.mat(), inp.mat(), (n, c, oc))
        {
            return self.fail("matmul_backward_weight", e);
        }
        if let Some(db) = dbias {
            let dout = &self.rd(dout);
            let (cfg, parts, chunk) = column_chunks(n, oc);
            let Ok(mut pb) = self.alloc(&q, parts * oc) else {
                return self.fail("matmul_backward_weight", "cannot allocate its partial sums");
            };
            launch!(
                self,
                q,
                bias_backward,
                cfg,
                [&mut pb, s(dout), &i32n(n), &i32n(oc), &i32n(chunk)]
            );
            self.finish_columns(&q, sm(db), &pb, parts, oc);
        }
    }
    fn add_bias(&self, out: &mut GpuTensor, bias: &GpuTensor, width: usize) {
        let out = &mut self.wr(out);
        let bias = &self.rd(bias);
        if self.broken() {
            return;
        }
        let n = vlen(out);
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            add_bias_rows,
            elems(n),
            [sm(out), s(bias), &i64n(n), &i32n(width)]
        );
    }

    fn attention_forward(
        &self,
        out: &mut GpuTensor,
        att: &mut GpuTensor,
        qkv: &GpuTensor,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        let out = &mut self.wr(out);
        let att = &mut self.wr(att);
        let qkv = &self.rd(qkv);
        if self.broken() {
            return;
        }
        if b * t == 0 {
            return;
        }
        let q = self.q();
        let hs = c / nh;
        let heads = blas::Heads { bh: b * nh, t, hs };
        let scratch = |n| self.alloc(&q, n);
        let (Ok(mut qs), Ok(mut ks), Ok(mut vs), Ok(mut pre), Ok(mut y)) = (
            scratch(b * t * c),
            scratch(b * t * c),
            scratch(b * t * c),
            scratch(b * nh * t * t),
            scratch(b * t * c),
        ) else {
            return self.fail("attention_forward", "cannot allocate its scratch");
        };
        let (bi, ti, nhi, hsi) = (i32n(b), i32n(t), i32n(nh), i32n(hs));
        launch!(
            self,
            q,
            attention_split,
            elems(b * t * c),
            [&mut qs, &mut ks, &mut vs, s(qkv), &bi, &ti, &nhi, &hsi]
        );
        if let Err(e) = heads.scores(&q.blas, &mut pre, &qs, &ks) {
            return self.fail("attention_forward", e);
        }
        let scale = 1.0f32 / (hs as f32).sqrt();
        let rows_n = b * nh * t;
        launch!(
            self,
            q,
            causal_softmax,
            rows(rows_n),
            [sm(att), &pre, &scale, &i64n(rows_n), &ti]
        );
        if let Err(e) = heads.mix(&q.blas, &mut y, s(att), &vs) {
            return self.fail("attention_forward", e);
        }
        launch!(
            self,
            q,
            attention_merge,
            elems(b * t * c),
            [sm(out), &y, &bi, &ti, &nhi, &hsi]
        );
    }
    fn attention_backward(
        &self,
        dqkv: &mut GpuTensor,
        dout: &GpuTensor,
        qkv: &GpuTensor,
        att: &GpuTensor,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        let dqkv = &mut self.wr(dqkv);
        let dout = &self.rd(dout);
        let qkv = &self.rd(qkv);
        let att = &self.rd(att);
        if self.broken() {
            return;
        }
        if b * t == 0 {
            return;
        }
        let q = self.q();
        let hs = c / nh;
        let heads = blas::Heads { bh: b * nh, t, hs };
        let scratch = |n| self.alloc(&q, n);
        let (Ok(mut qs), Ok(mut ks), Ok(mut vs), Ok(mut dy), Ok(mut datt), Ok(mut dpre)) = (
            scratch(b * t * c),
            scratch(b * t * c),
            scratch(b * t * c),
            scratch(b * t * c),
            scratch(b * nh * t * t),
            scratch(b * nh * t * t),
        ) else {
            return self.fail("attention_backward", "cannot allocate its scratch");
        };
        let (Ok(mut dq), Ok(mut dk), Ok(mut dv)) =
            (scratch(b * t * c), scratch(b * t * c), scratch(b * t * c))
        else {
            return self.fail("attention_backward", "cannot allocate its scratch");
        };
        let (bi, ti, nhi, hsi) = (i32n(b), i32n(t), i32n(nh), i32n(hs));
        launch!(
            self,
            q,
            attention_split,
            elems(b * t * c),
            [&mut qs, &mut ks, &mut vs, s(qkv), &bi, &ti, &nhi, &hsi]
        );
        launch!(
            self,
            q,
            attention_merge_backward,
            elems(b * t * c),
            [&mut dy, s(dout), &bi, &ti, &nhi, &hsi]
        );
        let steps = [
            heads.scores_of_mix(&q.blas, &mut datt, &dy, &vs),
            heads.values_of_mix(&q.blas, &mut dv, &dy, s(att)),
        ];
        if let Some(Err(e)) = steps.into_iter().find(|r| r.is_err()) {
            return self.fail("attention_backward", e);
        }
        let scale = 1.0f32 / (hs as f32).sqrt();
        let rows_n = b * nh * t;
        launch!(
            self,
            q,
            causal_softmax_backward,
            rows(rows_n),
            [&mut dpre, &datt, s(att), &scale, &i64n(rows_n), &ti]
        );
        let steps = [
            heads.queries_of_scores(&q.blas, &mut dq, &dpre, &ks),
            heads.keys_of_scores(&q.blas, &mut dk, &dpre, &qs),
        ];
        if let Some(Err(e)) = steps.into_iter().find(|r| r.is_err()) {
            return self.fail("attention_backward", e);
        }
        launch!(
            self,
            q,
            attention_split_backward,
            elems(b * t * c),
            [sm(dqkv), &dq, &dk, &dv, &bi, &ti, &nhi, &hsi]
        );
    }

    fn flash_attention_forward(
        &self,
        out: &mut GpuTensor,
        lse: &mut GpuTensor,
        qkv: &GpuTensor,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        held: SeqRows,
    ) {
        let out = &mut self.wr(out);
        let lse = &mut self.wr(lse);
        let qkv = &self.rd(qkv);
        if self.broken() {
            return;
        }
        if b * held.len() == 0 {
            return;
        }
        let Some(hs) = self.head_width("flash_attention_forward", c, nh) else {
            return;
        };
        let q = self.q();
        let (ti, nhi, hsi) = (i32n(t), i32n(nh), i32n(hs));
        let (tr, ch, s0, s1) = seq_rows(held);
        launch!(
            self,
            q,
            flash_forward,
            rows(b * nh * held.len()),
            [
                sm(out),
                sm(lse),
                s(qkv),
                &ti,
                &nhi,
                &hsi,
                &tr,
                &ch,
                &s0,
                &s1
            ]
        );
    }
    fn flash_attention_backward(
        &self,
        dqkv: &mut GpuTensor,
        dout: &GpuTensor,
        qkv: &GpuTensor,
        out: &GpuTensor,
        lse: &GpuTensor,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        held: SeqRows,
    ) {
        let dqkv = &mut self.wr(dqkv);
        let dout = &self.rd(dout);
        let qkv = &self.rd(qkv);
        let out = &self.rd(out);
        let lse = &self.rd(lse);
        if self.broken() {
            return;
        }
        if b * held.len() == 0 {
            return;
        }
        let Some(hs) = self.head_width("flash_attention_backward", c, nh) else {
            return;
        };
        let q = self.q();
        let (ti, nhi, hsi) = (i32n(t), i32n(nh), i32n(hs));
        let (tr, ch, s0, s1) = seq_rows(held);
        launch!(
            self,
            q,
            flash_backward_dq,
            rows(b * nh * held.len()),
            [
                sm(dqkv),
                s(dout),
                s(qkv),
                s(out),
                s(lse),
                &ti,
                &nhi,
                &hsi,
                &tr,
                &ch,
                &s0,
                &s1
            ]
        );
        launch!(
            self,
            q,
            flash_backward_dkv,
            rows(b * nh * t),
            [
                sm(dqkv),
                s(dout),
                s(qkv),
                s(out),
                s(lse),
                &ti,
                &nhi,
                &hsi,
                &tr,
                &ch,
                &s0,
                &s1
            ]
        );
    }
    fn flash_ring_forward(
        &self,
        out: &mut GpuTensor,
        lse: &mut GpuTensor,
        q: &GpuTensor,
        kv: &GpuTensor,
        b: usize,
        c: usize,
        nh: usize,
        (qrows, krows): (SeqRows, SeqRows),
        first: bool,
    ) {
        let out = &mut self.wr(out);
        let lse = &mut self.wr(lse);
        let q = &self.rd(q);
        let kv = &self.rd(kv);
        if self.broken() {
            return;
        }
        if b * qrows.len() == 0 || krows.is_empty() {
            return;
        }
        let Some(hs) = self.head_width("flash_ring_forward", c, nh) else {
            return;
        };
        let st = self.q();
        let (tr, qc, q0, q1) = seq_rows(qrows);
        let (tk, kc, k0, k1) = seq_rows(krows);
        launch!(
            self,
            st,
            ring_forward,
            rows(b * nh * qrows.len()),
            [
                sm(out),
                sm(lse),
                s(q),
                s(kv),
                &i32n(nh),
                &i32n(hs),
                &tr,
                &qc,
                &q0,
                &q1,
                &tk,
                &kc,
                &k0,
                &k1,
                &i32::from(first)
            ]
        );
    }
    fn flash_ring_backward(
        &self,
        dq: &mut GpuTensor,
        dkv: &mut GpuTensor,
        dout: &GpuTensor,
        q: &GpuTensor,
        kv: &GpuTensor,
        out: &GpuTensor,
        lse: &GpuTensor,
        b: usize,
        c: usize,
        nh: usize,
        (qrows, krows): (SeqRows, SeqRows),
    ) {
        let dq = &mut self.wr(dq);
        let dkv = &mut self.wr(dkv);
        let dout = &self.rd(dout);
        let q = &self.rd(q);
        let kv = &self.rd(kv);
        let out = &self.rd(out);
        let lse = &self.rd(lse);
        if self.broken() {
            return;
        }
        if b * qrows.len() == 0 || krows.is_empty() {
            return;
        }
        let Some(hs) = self.head_width("flash_ring_backward", c, nh) else {
            return;
        };
        let st = self.q();
        let (tr, qc, q0, q1) = seq_rows(qrows);
        let (tk, kc, k0, k1) = seq_rows(krows);
        let (nhi, hsi) = (i32n(nh), i32n(hs));
        launch!(
            self,
            st,
            ring_backward_dq,
            rows(b * nh * qrows.len()),
            [
                sm(dq),
                s(dout),
                s(q),
                s(kv),
                s(out),
                s(lse),
                &nhi,
                &hsi,
                &tr,
                &qc,
                &q0,
                &q1,
                &tk,
                &kc,
                &k0,
                &k1
            ]
        );
        launch!(
            self,
            st,
            ring_backward_dkv,
            rows(b * nh * krows.len()),
            [
                sm(dkv),
                s(dout),
                s(q),
                s(kv),
                s(out),
                s(lse),
                &nhi,
                &hsi,
                &tr,
                &qc,
                &q0,
                &q1,
                &tk,
                &kc,
                &k0,
                &k1
            ]
        );
    }
    fn qkv_pack(
        &self,
        qkv: &mut GpuTensor,
        q_: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        n: usize,
        nh: usize,
        kvh: usize,
        hd: usize,
    ) {
        let qkv = &mut self.wr(qkv);
        let q_ = &self.rd(q_);
        let k = &self.rd(k);
        let v = &self.rd(v);
        if self.broken() {
            return;
        }
        if n == 0 || kvh == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            qkv_pack,
            elems(n * 3 * nh * hd),
            [
                sm(qkv),
                s(q_),
                s(k),
                s(v),
                &i32n(n),
                &i32n(nh),
                &i32n(kvh),
                &i32n(hd)
            ]
        );
    }
    fn qkv_unpack_backward(
        &self,
        dq: &mut GpuTensor,
        dk: &mut GpuTensor,
        dv: &mut GpuTensor,
        dqkv: &GpuTensor,
        n: usize,
        nh: usize,
        kvh: usize,
        hd: usize,
    ) {
        let dq = &mut self.wr(dq);
        let dk = &mut self.wr(dk);
        let dv = &mut self.wr(dv);
        let dqkv = &self.rd(dqkv);
        if self.broken() {
            return;
        }
        if n == 0 || kvh == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            qkv_unpack_backward,
            elems(n * (nh + 2 * kvh) * hd),
            [
                sm(dq),
                sm(dk),
                sm(dv),
                s(dqkv),
                &i32n(n),
                &i32n(nh),
                &i32n(kvh),
                &i32n(hd)
            ]
        );
    }

    fn gelu_forward(&self, out: &mut GpuTensor, inp: &GpuTensor) {
        let out = &mut self.wr(out);
        let inp = &self.rd(inp);
        if self.broken() {
            return;
        }
        let n = vlen(out).min(vlen(inp));
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(self, q, gelu_forward, elems(n), [sm(out), s(inp), &i64n(n)]);
    }
    fn bias_gelu_forward(
        &self,
        pre: &mut GpuTensor,
        out: &mut GpuTensor,
        bias: &GpuTensor,
        width: usize,
    ) {
        let pre = &mut self.wr(pre);
        let out = &mut self.wr(out);
        let bias = &self.rd(bias);
        if self.broken() {
            return;
        }
        let n = vlen(pre).min(vlen(out));
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            bias_gelu_forward,
            elems(n),
            [sm(pre), sm(out), s(bias), &i64n(n), &i32n(width)]
        );
    }
    fn gelu_backward(&self, dinp: &mut GpuTensor, inp: &GpuTensor, dout: &GpuTensor) {
        let dinp = &mut self.wr(dinp);
        let inp = &self.rd(inp);
        let dout = &self.rd(dout);
        if self.broken() {
            return;
        }
        let n = vlen(dinp).min(vlen(inp)).min(vlen(dout));
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            gelu_backward,
            elems(n),
            [sm(dinp), s(inp), s(dout), &i64n(n)]
        );
    }
    fn residual_forward(&self, out: &mut GpuTensor, a: &GpuTensor, b: &GpuTensor) {
        let out = &mut self.wr(out);
        let a = &self.rd(a);
        let b = &self.rd(b);
        if self.broken() {
            return;
        }
        let n = vlen(out).min(vlen(a)).min(vlen(b));
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            residual_forward,
            elems(n),
            [sm(out), s(a), s(b), &i64n(n)]
        );
    }

    fn swiglu_forward(&self, out: &mut GpuTensor, gate: &GpuTensor, up: &GpuTensor) {
        let out = &mut self.wr(out);
        let gate = &self.rd(gate);
        let up = &self.rd(up);
        if self.broken() {
            return;
        }
        let n = vlen(out);
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            swiglu_forward,
            elems(n),
            [sm(out), s(gate), s(up), &i64n(n)]
        );
    }
    fn swiglu_backward(
        &self,
        dgate: &mut GpuTensor,
        dup: &mut GpuTensor,
        gate: &GpuTensor,
        up: &GpuTensor,
        dout: &GpuTensor,
    ) {
        let dgate = &mut self.wr(dgate);
        let dup = &mut self.wr(dup);
        let gate = &self.rd(gate);
        let up = &self.rd(up);
        let dout = &self.rd(dout);
        if self.broken() {
            return;
        }
        let n = vlen(dgate);
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            swiglu_backward,
            elems(n),
            [sm(dgate), sm(dup), s(gate), s(up), s(dout), &i64n(n)]
        );
    }

    fn crossentropy_forward(
        &self,
        probs: &mut GpuTensor,
        logits: &GpuTensor,
        targets: &GpuIds,
        n: usize,
        v: usize,
    ) -> Term {
        let probs = &mut self.wr(probs);
        let logits = &self.rd(logits);
        if self.broken() {
            return Term::Host(f64::NAN);
        }
        let q = self.q();
        let losses = match q.stream.alloc_zeros::<f64>(n.max(1)) {
            Ok(l) => l,
            Err(e) => {
                self.fail("crossentropy_forward", e);
                return Term::Host(f64::NAN);
            }
        };
        let mut losses = losses;
        if n > 0 {
            launch!(
                self,
                q,
                crossentropy_forward,
                rows(n),
                [
                    sm(probs),
                    &mut losses,
                    s(logits),
                    ids(targets),
                    &i32n(n),
                    &i32n(v)
                ]
            );
        }
        Term::Rows(losses)
    }
    fn crossentropy_backward(
        &self,
        dlogits: &mut GpuTensor,
        probs: &GpuTensor,
        targets: &GpuIds,
        n: usize,
        v: usize,
        scale: f32,
    ) {
        let dlogits = &mut self.wr(dlogits);
        let probs = &self.rd(probs);
        if self.broken() {
            return;
        }
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            crossentropy_backward,
            elems(n * v),
            [
                sm(dlogits),
                s(probs),
                ids(targets),
                &i32n(n),
                &i32n(v),
                &scale
            ]
        );
    }

    fn softmax_rows(&self, probs: &mut GpuTensor, logits: &GpuTensor, e: usize) {
        let probs = &mut self.wr(probs);
        let logits = &self.rd(logits);
        if self.broken() {
            return;
        }
        let n = vlen(logits) / e.max(1);
        if n == 0 {
            return;
        }
        let q = self.q();
        launch!(
            self,
            q,
            moe_softmax_rows,
            elems(n),
            [sm(probs), s(logits), &i32n(n), &i32n(e)]
        );
    }
    fn gather_rows(
        &self,
        out: &mut GpuTensor,
        at: usize,
        src: &GpuTensor,
        assignments: &[u32],
        k: usize,
        c: usize,
    ) {
        let out = &mut self.wr(out);
        let src = &self.rd(src);
        if self.broken() {
            return;
        }
        if assignments.is_empty() {
            return;
        }
        let q = self.q();
        let a = match q.stream.clone_htod(assignments) {
            Ok(a) => a,
            Err(e) => return self.fail("gather_rows", e),
        };
        let r = assignments.len();
        launch!(
            self,
            q,
            moe_gather_rows,
            elems(r * c),
            [sm(out), &i64n(at), s(src), &a, &i32n(r), &i32n(k), &i32n(c)]
        );
    }
    fn scatter_add_rows(
        &self,
        dst: &mut GpuTensor,
        src: &GpuTensor,
        at: usize,
        assignments: &[u32],
        k: usize,
        c: usize,
    ) {
        let dst = &mut self.wr(dst);
        let src = &self.rd(src);
        if self.broken() {
            return;
        }
        if assignments.is_empty() {
            return;
        }
        let q = self.q();
        let a = match q.stream.clone_htod(assignments) {
            Ok(a) => a,
            Err(e) => return self.fail("scatter_add_rows", e),
        };
        let r = assignments.len();
        // One expert's rows name each token once: a thread per element.
        if distinct_tokens(assignments, k) {
            launch!(
                self,
                q,
                moe_scatter_add_distinct,
                elems(r * c),
                [sm(dst), s(src), &i64n(at), &a, &i32n(r), &i32n(k), &i32n(c)]
            );
            return;
        }
        launch!(
            self,
            q,
            moe_scatter_add_rows,
            elems(c),
            [sm(dst), s(src), &i64n(at), &a, &i32n(r), &i32n(k), &i32n(c)]
        );
    }
    fn moe_combine(&self, out: &mut GpuTensor, ys: &[GpuTensor], r: &Routing, c: usize) {
        let n = r.choice.len() / r.k.max(1);
        if n == 0 {
            return;
        }
        let q = self.q();
        use cudarc::driver::DevicePtr;
        // Each expert's rows by device pointer; the guards order the reads.
        let out = &mut self.wr(out);
        if self.broken() {
            return;
        }
        let ys: Vec<In<'_>> = ys.iter().map(|y| self.rd(y)).collect();
        let ptrs: Vec<(u64, Option<cudarc::driver::SyncOnDrop<'_>>)> = ys
            .iter()
            .map(|y| match y {
                In::Own(_) | In::Widened(_) => {
                    let sl = y.view();
                    let (p, g) = sl.device_ptr(&q.stream);
                    (p, Some(g))
                }
                In::Missing => (0, None),
            })
            .collect();
        let table: Vec<u64> = ptrs.iter().map(|p| p.0).collect();
        let up = |v: &[u32]| q.stream.clone_htod(v);
        let (Ok(tab), Ok(choice), Ok(slot), Ok(weight)) = (
            q.stream.clone_htod(&table),
            up(&r.choice),
            up(&r.slot),
            q.stream.clone_htod(&r.weight),
        ) else {
            return self.fail("moe_combine", "cannot copy the routing to the device");
        };
        launch!(
            self,
            q,
            moe_combine,
            elems(n * c),
            [
                sm(out),
                &tab,
                &choice,
                &slot,
                &weight,
                &i32n(n),
                &i32n(r.k),
                &i32n(c)
            ]
        );
        drop(ptrs);
    }
    fn moe_combine_backward(
        &self,
        dweight: &mut GpuTensor,
        dys: &mut [GpuTensor],
        dout: &GpuTensor,
        ys: &[GpuTensor],
        r: &Routing,
        c: usize,
    ) {
        let q = self.q();
        let dweight = &mut self.wr(dweight);
        let dout = &self.rd(dout);
        if self.broken() {
            return;
        }
        let Ok(weight) = q.stream.clone_htod(&r.weight) else {
            return self.fail(
                "moe_combine_backward",
                "cannot copy the routing to the device",
            );
        };
        for (x, rows_of) in r.rows.iter().enumerate() {
            if rows_of.is_empty() {
                continue;
            }
            let Ok(a) = q.stream.clone_htod(rows_of) else {
                return self.fail(
                    "moe_combine_backward",
                    "cannot copy the routing to the device",
                );
            };
            let m = rows_of.len();
            let y = &self.rd(&ys[x]);
            let dy = &mut self.wr(&mut dys[x]);
            launch!(
                self,
                q,
                moe_combine_dweight,
                rows(m),
                [
                    sm(dweight),
                    s(dout),
                    s(y),
                    &a,
                    &i32n(m),
                    &i32n(r.k),
                    &i32n(c)
                ]
            );
            launch!(
                self,
                q,
                moe_combine_dy,
                elems(m * c),
                [sm(dy), s(dout), &weight, &a, &i32n(m), &i32n(r.k), &i32n(c)]
            );
        }
    }
    fn router_backward(
        &self,
        dlogits: &mut GpuTensor,
        probs: &GpuTensor,
        dweight: &GpuTensor,
        shares: &[f32],
        aux: f32,
        r: &Routing,
        t: usize,
        e: usize,
    ) {
        let dlogits = &mut self.wr(dlogits);
        let probs = &self.rd(probs);
        let dweight = &self.rd(dweight);
        if self.broken() {
            return;
        }
        let n = r.choice.len() / r.k.max(1);
        if n == 0 {
            return;
        }
        let q = self.q();
        let (Ok(f), Ok(choice), Ok(weight)) = (
            q.stream.clone_htod(shares),
            q.stream.clone_htod(&r.choice),
            q.stream.clone_htod(&r.weight),
        ) else {
            return self.fail("router_backward", "cannot copy the routing to the device");
        };
        launch!(
            self,
            q,
            moe_router_backward,
            elems(n),
            [
                sm(dlogits),
                s(probs),
                s(dweight),
                &f,
                &choice,
                &weight,
                &aux,
                &i32n(n),
                &i32n(t),
                &i32n(e),
                &i32n(r.k)
            ]
        );
    }

    fn adamw(
        &self,
        param: &mut GpuTensor,
        grad: &GpuTensor,
        m: &mut GpuTensor,
        v: &mut GpuTensor,
        range: Range<usize>,
        h: &AdamW,
        step: u32,
        grad_scale: f32,
        decay: bool,
    ) {
        let param = &mut self.wr(param);
        let grad = &self.rd(grad);
        let m = &mut self.wr(m);
        let v = &mut self.wr(v);
        if self.broken() {
            return;
        }
        if range.is_empty() {
            return;
        }
        let q = self.q();
        let bc1 = 1.0 - h.beta1.powi(step as i32);
        let bc2 = 1.0 - h.beta2.powi(step as i32);
        let wd = if decay { h.weight_decay } else { 0.0 };
        let n = range.len();
        let mut p = sm(param).slice_mut(range.clone());
        let g = s(grad).slice(range.clone());
        let mut mm = sm(m).slice_mut(range.clone());
        let mut vv = sm(v).slice_mut(range);
        launch!(
            self,
            q,
            adamw,
            elems(n),
            [
                &mut p,
                &g,
                &mut mm,
                &mut vv,
                &i64n(n),
                &h.lr,
                &h.beta1,
                &h.beta2,
                &bc1,
                &bc2,
                &h.eps,
                &wd,
                &grad_scale
            ]
        );
    }
    fn sum_squares(&self, pieces: &[(&GpuTensor, Range<usize>)]) -> Result<f64, BackendError> {
        self.pending()?;
        let live: Vec<&(&GpuTensor, Range<usize>)> =
            pieces.iter().filter(|p| !p.1.is_empty()).collect();
        if live.is_empty() {
            return Ok(0.0);
        }
        // Per piece, PARTS blocks each sum a contiguous share; one read.
        const PARTS: usize = 64;
        let q = self.q();
        let mut partial = q
            .stream
            .alloc_zeros::<f64>(PARTS * live.len())
            .map_err(|e| BackendError::Alloc {
                bytes: (PARTS * live.len()) as u64 * 8,
                message: e.to_string(),
            })?;
        let cfg = LaunchConfig {
            grid_dim: (PARTS as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        for (k, (t, r)) in live.iter().enumerate() {
            let t = &self.rd(t);
            let x = s(t).slice(r.clone());
            let mut out = partial.slice_mut(k * PARTS..(k + 1) * PARTS);
            launch!(self, q, sum_squares, cfg, [&mut out, &x, &i64n(r.len())]);
        }
        let parts = q
            .stream
            .clone_dtoh(&partial)
            .map_err(|e| BackendError::Device(format!("reading the gradient norm: {e}")))?;
        self.sync(&q)?;
        // Each piece's sum, then the pieces in order.
        Ok(parts
            .chunks(PARTS)
            .map(|c| c.iter().fold(0.0f64, |a, x| a + x))
            .fold(0.0f64, |a, x| a + x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The embedding gradient's grouping: distinct tokens ascending, each
    /// one's rows ascending (the CPU's order of additions), the starts
    /// bracketing every group.
    #[test]
    fn rows_group_by_token_in_ascending_order() {
        let (uniq, starts, rows) = group_by_token(&[5, 2, 5, 9, 2, 5]);
        assert_eq!(uniq, [2, 5, 9]);
        assert_eq!(starts, [0, 2, 5, 6]);
        assert_eq!(rows, [1, 4, 0, 2, 5, 3]);
        let (uniq, starts, rows) = group_by_token(&[7]);
        assert_eq!((uniq, starts, rows), (vec![7], vec![0, 1], vec![0]));
    }

    /// One expert's rows of a top-2 routing name each token once (the
    /// parallel scatter); a token's two choices together do not.
    #[test]
    fn a_scatter_runs_in_parallel_only_over_distinct_tokens() {
        let k = 2;
        assert!(distinct_tokens(&[0, 3, 4, 7], k));
        assert!(distinct_tokens(&[], k));
        assert!(!distinct_tokens(&[4, 5], k));
        assert!(!distinct_tokens(&[1, 6, 0], k));
    }

    /// Two-stage column sums: chunks of at least 64 rows, at most 128 of
    /// them, covering every row; a thread per column in each.
    #[test]
    fn column_sums_split_rows_into_bounded_chunks() {
        for (n, c) in [(1, 5), (140, 96), (8192, 768), (1 << 20, 4096)] {
            let (cfg, parts, chunk) = column_chunks(n, c);
            assert!(chunk >= 64 && parts <= 128, "{n} rows: {parts} × {chunk}");
            assert!(parts * chunk >= n && (parts - 1) * chunk < n, "{n} rows");
            assert_eq!(cfg.grid_dim.1 as usize, parts);
            assert!(cfg.grid_dim.0 as usize * BLOCK as usize >= c);
        }
    }
}

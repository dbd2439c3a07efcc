//! The matrix products of the CUDA backend through cuBLAS, in fp32 with
//! cuBLAS's default math (no TF32): the linear layers (`[out, in]` weights,
//! row-major activations, as llm.c calls `cublasSgemm`) and attention's
//! batched products over `[B·NH, T, HS]`. Row-major `X[r, c]` is the
//! column-major `Xᵀ`, so each product below is written as the
//! column-major call that computes it.
//!
//! A linear layer whose input and weight are both stored in bf16 reads them
//! as they are (`cublasGemmEx`: bf16 operands, fp32 compute and output, so
//! the caller rounds once, after its bias), the tensor cores' path.

use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::ffi::c_int;

const N: cublasOperation_t = cublasOperation_t::CUBLAS_OP_N;
const T: cublasOperation_t = cublasOperation_t::CUBLAS_OP_T;

/// A cuBLAS handle on a stream, set to plain fp32 math.
pub fn handle(stream: std::sync::Arc<cudarc::driver::CudaStream>) -> Result<CudaBlas, String> {
    let blas = CudaBlas::new(stream).map_err(|e| format!("creating a cuBLAS handle: {e}"))?;
    // SAFETY: the handle is live; the mode is one of cuBLAS's.
    let status = unsafe {
        cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), cublasMath_t::CUBLAS_DEFAULT_MATH)
    };
    status
        .result()
        .map_err(|e| format!("setting cuBLAS's math mode: {e}"))?;
    Ok(blas)
}

/// The dimensions as cuBLAS's `int`s, or what does not fit.
fn dims<const K: usize>(d: [usize; K]) -> Result<[c_int; K], String> {
    let mut out = [0; K];
    for (o, x) in out.iter_mut().zip(d) {
        *o = c_int::try_from(x)
            .map_err(|_| format!("a matrix dimension of {x} is past cuBLAS's int"))?;
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn gemm<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
    blas: &CudaBlas,
    (ta, tb): (cublasOperation_t, cublasOperation_t),
    (m, n, k): (usize, usize, usize),
    a: &A,
    lda: usize,
    b: &B,
    ldb: usize,
    beta: f32,
    c: &mut C,
    ldc: usize,
) -> Result<(), String> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let [m, n, k, lda, ldb, ldc] = dims([m, n, k, lda, ldb, ldc])?;
    let cfg = GemmConfig {
        transa: ta,
        transb: tb,
        m,
        n,
        k,
        alpha: 1.0f32,
        lda,
        ldb,
        beta,
        ldc,
    };
    // SAFETY: the callers' shapes describe matrices inside the slices (the
    // model's shapes, checked by the plan), and `c` aliases neither input.
    unsafe { blas.gemm(cfg, a, b, c) }.map_err(|e| format!("cublasSgemm: {e}"))
}

/// An input matrix of a linear layer's product: fp32, or bf16 bits.
#[derive(Clone, Copy)]
pub enum Mat<'a> {
    F32(&'a CudaSlice<f32>),
    Bf16(&'a CudaSlice<u16>),
}

/// `c = a · b + beta · c` (column-major, as [`gemm`]) on two inputs of one
/// dtype: fp32 through `cublasSgemm`, bf16 through `cublasGemmEx` with fp32
/// compute into the fp32 `c`.
#[allow(clippy::too_many_arguments)]
fn gemm_of(
    blas: &CudaBlas,
    stream: &CudaStream,
    ops: (cublasOperation_t, cublasOperation_t),
    (m, n, k): (usize, usize, usize),
    (a, lda): (Mat<'_>, usize),
    (b, ldb): (Mat<'_>, usize),
    beta: f32,
    c: &mut CudaSlice<f32>,
    ldc: usize,
) -> Result<(), String> {
    let (a, b) = match (a, b) {
        (Mat::F32(a), Mat::F32(b)) => {
            return gemm(blas, ops, (m, n, k), a, lda, b, ldb, beta, c, ldc)
        }
        (Mat::Bf16(a), Mat::Bf16(b)) => (a, b),
        _ => return Err("a product of an fp32 and a bf16 matrix (widen one first)".into()),
    };
    if m == 0 || n == 0 {
        return Ok(());
    }
    use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
    let [m, n, k, lda, ldb, ldc] = dims([m, n, k, lda, ldb, ldc])?;
    let (pa, _ra) = a.device_ptr(stream);
    let (pb, _rb) = b.device_ptr(stream);
    let (pc, _rc) = c.device_ptr_mut(stream);
    let alpha = 1.0f32;
    let bf16 = cudaDataType::CUDA_R_16BF;
    // SAFETY: the handle is live on `stream`; the callers' shapes describe
    // matrices inside the slices (checked by the plan); alpha and beta are
    // host fp32 values, as the fp32 compute type reads them; `c` aliases
    // neither input; the records keep the slices' stream order.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            ops.0,
            ops.1,
            m,
            n,
            k,
            (&alpha as *const f32).cast(),
            pa as *const std::ffi::c_void,
            bf16,
            lda,
            pb as *const std::ffi::c_void,
            bf16,
            ldb,
            (&beta as *const f32).cast(),
            pc as *mut std::ffi::c_void,
            cudaDataType::CUDA_R_32F,
            ldc,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
        )
    }
    .map_err(|e| format!("cublasGemmEx (bf16): {e}"))
}

/// `out[n, oc] = inp[n, c] · W[oc, c]ᵀ + beta · out`.
pub fn linear(
    (blas, stream): (&CudaBlas, &CudaStream),
    out: &mut CudaSlice<f32>,
    inp: Mat<'_>,
    w: Mat<'_>,
    (n, c, oc): (usize, usize, usize),
    beta: f32,
) -> Result<(), String> {
    gemm_of(
        blas,
        stream,
        (T, N),
        (oc, n, c),
        (w, c),
        (inp, c),
        beta,
        out,
        oc,
    )
}

/// `dinp[n, c] = dout[n, oc] · W[oc, c] + beta · dinp`.
pub fn linear_backward_input(
    (blas, stream): (&CudaBlas, &CudaStream),
    dinp: &mut CudaSlice<f32>,
    dout: Mat<'_>,
    w: Mat<'_>,
    (n, c, oc): (usize, usize, usize),
    beta: f32,
) -> Result<(), String> {
    gemm_of(
        blas,
        stream,
        (N, N),
        (c, n, oc),
        (w, c),
        (dout, oc),
        beta,
        dinp,
        c,
    )
}

/// `dW[oc, c] += dout[n, oc]ᵀ · inp[n, c]`.
pub fn linear_backward_weight(
    (blas, stream): (&CudaBlas, &CudaStream),
    dw: &mut CudaSlice<f32>,
    dout: Mat<'_>,
    inp: Mat<'_>,
    (n, c, oc): (usize, usize, usize),
) -> Result<(), String> {
    gemm_of(
        blas,
        stream,
        (N, T),
        (c, oc, n),
        (inp, c),
        (dout, oc),
        1.0,
        dw,
        c,
    )
}

/// One strided batched product over `batch` matrices, each of the
/// operands `stride` elements from the last.
#[allow(clippy::too_many_arguments)]
fn batched<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
    blas: &CudaBlas,
    ops: (cublasOperation_t, cublasOperation_t),
    (m, n, k): (usize, usize, usize),
    (a, lda, sa): (&A, usize, usize),
    (b, ldb, sb): (&B, usize, usize),
    (c, ldc, sc): (&mut C, usize, usize),
    batch: usize,
) -> Result<(), String> {
    if m == 0 || n == 0 || batch == 0 {
        return Ok(());
    }
    let [m, n, k, lda, ldb, ldc, batch] = dims([m, n, k, lda, ldb, ldc, batch])?;
    let stride =
        |s: usize| i64::try_from(s).map_err(|_| format!("a stride of {s} is past cuBLAS's"));
    let cfg = StridedBatchedConfig {
        gemm: GemmConfig {
            transa: ops.0,
            transb: ops.1,
            m,
            n,
            k,
            alpha: 1.0f32,
            lda,
            ldb,
            beta: 0.0,
            ldc,
        },
        batch_size: batch,
        stride_a: stride(sa)?,
        stride_b: stride(sb)?,
        stride_c: stride(sc)?,
    };
    // SAFETY: as in `gemm`: the strides and shapes stay inside the slices.
    unsafe { blas.gemm_strided_batched(cfg, a, b, c) }
        .map_err(|e| format!("cublasSgemmStridedBatched: {e}"))
}

/// The shapes of attention's batched products: `bh` matrices of `t` rows,
/// `hs` wide.
#[derive(Clone, Copy)]
pub struct Heads {
    pub bh: usize,
    pub t: usize,
    pub hs: usize,
}

impl Heads {
    /// `preatt[t, t'] = q[t] · k[t']` per head.
    pub fn scores<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
        &self,
        blas: &CudaBlas,
        preatt: &mut C,
        q: &A,
        k: &B,
    ) -> Result<(), String> {
        let Heads { bh, t, hs } = *self;
        batched(
            blas,
            (T, N),
            (t, t, hs),
            (k, hs, t * hs),
            (q, hs, t * hs),
            (preatt, t, t * t),
            bh,
        )
    }

    /// `y[t] = Σ_t' att[t, t'] · v[t']` per head.
    pub fn mix<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
        &self,
        blas: &CudaBlas,
        y: &mut C,
        att: &A,
        v: &B,
    ) -> Result<(), String> {
        let Heads { bh, t, hs } = *self;
        batched(
            blas,
            (N, N),
            (hs, t, t),
            (v, hs, t * hs),
            (att, t, t * t),
            (y, hs, t * hs),
            bh,
        )
    }

    /// `datt[t, t'] = dy[t] · v[t']` per head.
    pub fn scores_of_mix<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
        &self,
        blas: &CudaBlas,
        datt: &mut C,
        dy: &A,
        v: &B,
    ) -> Result<(), String> {
        let Heads { bh, t, hs } = *self;
        batched(
            blas,
            (T, N),
            (t, t, hs),
            (v, hs, t * hs),
            (dy, hs, t * hs),
            (datt, t, t * t),
            bh,
        )
    }

    /// `dv[t'] = Σ_t att[t, t'] · dy[t]` per head.
    pub fn values_of_mix<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
        &self,
        blas: &CudaBlas,
        dv: &mut C,
        dy: &A,
        att: &B,
    ) -> Result<(), String> {
        let Heads { bh, t, hs } = *self;
        batched(
            blas,
            (N, T),
            (hs, t, t),
            (dy, hs, t * hs),
            (att, t, t * t),
            (dv, hs, t * hs),
            bh,
        )
    }

    /// `dq[t] = Σ_t' dpre[t, t'] · k[t']` per head.
    pub fn queries_of_scores<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
        &self,
        blas: &CudaBlas,
        dq: &mut C,
        dpre: &A,
        k: &B,
    ) -> Result<(), String> {
        let Heads { bh, t, hs } = *self;
        batched(
            blas,
            (N, N),
            (hs, t, t),
            (k, hs, t * hs),
            (dpre, t, t * t),
            (dq, hs, t * hs),
            bh,
        )
    }

    /// `dk[t'] = Σ_t dpre[t, t'] · q[t]` per head.
    pub fn keys_of_scores<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
        &self,
        blas: &CudaBlas,
        dk: &mut C,
        dpre: &A,
        q: &B,
    ) -> Result<(), String> {
        let Heads { bh, t, hs } = *self;
        batched(
            blas,
            (N, T),
            (hs, t, t),
            (q, hs, t * hs),
            (dpre, t, t * t),
            (dk, hs, t * hs),
            bh,
        )
    }
}

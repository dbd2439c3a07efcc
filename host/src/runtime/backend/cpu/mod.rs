//! The CPU backend, the embedded default: a device is a set of kernel
//! threads with its own memory account, storage is host memory in the
//! tensor's dtype ([`CpuTensor`]: fp32 or bf16), and the kernels are
//! llm.c's, one file per op family, each op a forward plus a
//! backward-for-input and a backward-for-weights with explicit shapes,
//! computing in fp32 (bf16 operands widened, bf16 results rounded:
//! [`tensor`]); each kernel spreads over the threads of the stream it runs
//! on ([`par`]) and gives the same bits for every thread count. Enqueuing a
//! kernel runs it, so events are empty and every read is immediate.
//!
//! Each stream has kernel threads of its own ([`Lane`]): an op that waits
//! for its peers inside a kernel (a tensor-parallel sum, a ring step of
//! context parallelism) holds only its own stream's threads, so another
//! stream's op on the device never waits behind it — a wait the plan's
//! deadlock check could not see.

// Kernels carry their shapes as arguments, as llm.c does: readable at the call.
#![allow(clippy::too_many_arguments)]

pub mod adamw;
pub mod attention;
pub mod elementwise;
pub mod embedding;
pub mod flash;
pub mod lanes;
pub mod layernorm;
pub mod loss;
pub mod matmul;
pub mod memory;
pub mod moe;
pub mod par;
pub mod profile;
pub mod ring;
pub mod rmsnorm;
pub mod rope;
pub mod tensor;

#[cfg(test)]
mod llama_tests;
#[cfg(test)]
mod tests;

use super::{AdamW, Backend, BackendError, Routing, SeqRows, Trace};
use crate::model::Dtype;
use std::ops::Range;
pub use tensor::CpuTensor;
use tensor::{to_bf16, with_f32_all};

/// One CPU device: how many kernel threads each of its streams runs on.
pub struct Cpu {
    device: u32,
    threads: usize,
    /// Streams made so far (their threads' names).
    lanes: std::sync::atomic::AtomicUsize,
}

impl Cpu {
    /// Device `device` with `threads` kernel threads per stream.
    pub fn new(device: u32, threads: usize) -> Result<Self, BackendError> {
        Ok(Cpu {
            device,
            threads: threads.max(1),
            lanes: std::sync::atomic::AtomicUsize::new(0),
        })
    }
}

/// A stream of a CPU device: the kernel threads its ops run on.
pub struct Lane {
    pool: rayon::ThreadPool,
}

/// Below this many floats a buffer is filled on the calling thread.
const PAR_MIN: usize = 1 << 16;

impl Cpu {
    /// A new buffer of `n` floats filled by `fill` on the device's threads,
    /// when it is large and there are several: one core's stores reach a
    /// fraction of the memory bandwidth, and a step zeroes or copies every
    /// activation and gradient it allocates. `None`: fill it on this thread.
    fn filled(&self, n: usize, fill: impl FnOnce(&mut Vec<f32>) + Send) -> Option<Vec<f32>> {
        // On the calling stream's threads (a kernel runs inside its lane).
        if n < 4 * PAR_MIN || rayon::current_num_threads() == 1 {
            return None;
        }
        let mut v = Vec::new();
        fill(&mut v);
        Some(v)
    }
}

type T = CpuTensor;

impl Backend for Cpu {
    type Tensor = CpuTensor;
    type Ids = Vec<u32>;
    type Scalar = f64;
    type Stream = Lane;
    type Event = ();

    fn name(&self) -> &'static str {
        "cpu"
    }
    fn shares_memory_with(&self, _: &Self) -> bool {
        true
    }

    fn stream(&self) -> Result<Lane, BackendError> {
        let (device, threads) = (self.device, self.threads);
        let lane = self
            .lanes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("piper-d{device}-s{lane}-k{i}"))
            .build()
            .map_err(|e| {
                BackendError::Device(format!(
                    "device {device}: cannot start {threads} kernel threads for stream {lane}: {e}"
                ))
            })?;
        Ok(Lane { pool })
    }
    fn enter<R: Send>(&self, lane: &Lane, trace: Trace<'_>, f: impl FnOnce() -> R + Send) -> R {
        lane.pool.install(|| match trace {
            Some((epoch, spans)) => profile::recording(true, epoch, spans, f),
            None => f(),
        })
    }
    fn record(&self, _: &Lane) {}
    fn wait(&self, _: &Lane, _: &()) {}

    fn len(t: &T) -> usize {
        t.len()
    }
    fn bytes(t: &T) -> u64 {
        t.bytes()
    }
    fn ids_bytes(t: &Vec<u32>) -> u64 {
        t.len() as u64 * 4
    }
    fn dtype(t: &T) -> Dtype {
        t.dtype()
    }
    fn zeros(&self, n: usize) -> Result<T, BackendError> {
        let _k = profile::span("zeros");
        Ok(T::F32(
            self.filled(n, |v| {
                use rayon::prelude::*;
                rayon::iter::repeat_n(0.0f32, n)
                    .with_min_len(PAR_MIN)
                    .collect_into_vec(v)
            })
            .unwrap_or_else(|| vec![0.0; n]),
        ))
    }
    fn zeros_as(&self, n: usize, dtype: Dtype) -> Result<T, BackendError> {
        match dtype {
            Dtype::F32 => self.zeros(n),
            Dtype::Bf16 => {
                let _k = profile::span("zeros");
                Ok(T::zeros(n, dtype))
            }
        }
    }
    fn cast(&self, t: &T, dtype: Dtype) -> Result<T, BackendError> {
        match t.dtype() == dtype {
            true => self.duplicate(t),
            false => Ok(t.cast(dtype)),
        }
    }
    fn upload(&self, v: Vec<f32>) -> Result<T, BackendError> {
        Ok(T::F32(v))
    }
    fn upload_ids(&self, v: &[u32]) -> Result<Vec<u32>, BackendError> {
        Ok(v.to_vec())
    }
    fn download(&self, t: &T) -> Result<Vec<f32>, BackendError> {
        Ok(t.f32().into_owned())
    }
    fn download_range(&self, t: &T, range: Range<usize>) -> Result<Vec<f32>, BackendError> {
        Ok(t.f32_range(range).into_owned())
    }
    fn download_owned(&self, t: T) -> Result<Vec<f32>, BackendError> {
        Ok(t.into_f32())
    }
    fn duplicate(&self, t: &T) -> Result<T, BackendError> {
        let _k = profile::span("duplicate");
        let T::F32(t) = t else {
            return Ok(t.clone());
        };
        Ok(T::F32(
            self.filled(t.len(), |v| {
                use rayon::prelude::*;
                t.par_iter()
                    .with_min_len(PAR_MIN)
                    .copied()
                    .collect_into_vec(v)
            })
            .unwrap_or_else(|| t.clone()),
        ))
    }
    fn duplicate_ids(&self, t: &Vec<u32>) -> Result<Vec<u32>, BackendError> {
        Ok(t.clone())
    }
    fn copy(&self, dst: &mut T, at: usize, src: &T, range: Range<usize>) {
        let n = range.len();
        match (dst, src) {
            (T::F32(d), T::F32(s)) => d[at..at + n].copy_from_slice(&s[range]),
            (T::Bf16(d), T::Bf16(s)) => d[at..at + n].copy_from_slice(&s[range]),
            (d, s) => {
                let s = s.f32_range(range);
                d.with_f32_range(at..at + n, |d| d.copy_from_slice(&s));
            }
        }
    }
    fn write(&self, dst: &mut T, at: usize, src: &[f32]) {
        match dst {
            T::F32(d) => d[at..at + src.len()].copy_from_slice(src),
            T::Bf16(d) => d[at..at + src.len()].copy_from_slice(&to_bf16(src)),
        }
    }
    fn add_host(&self, dst: &mut T, at: usize, src: &[f32]) {
        dst.with_f32_range(at..at + src.len(), |d| {
            for (a, x) in d.iter_mut().zip(src) {
                *a += x;
            }
        })
    }
    fn add(&self, dst: &mut T, src: &T) {
        let src = src.f32();
        dst.with_f32(|d| d.iter_mut().zip(src.iter()).for_each(|(x, y)| *x += y));
    }
    fn fill_zero(&self, t: &mut T) {
        match t {
            T::F32(v) => v.iter_mut().for_each(|x| *x = 0.0),
            T::Bf16(v) => v.iter_mut().for_each(|x| *x = half::bf16::ZERO),
        }
    }
    fn scalar(&self, x: f64) -> f64 {
        x
    }
    fn read_scalar(&self, s: f64) -> Result<f64, BackendError> {
        Ok(s)
    }

    fn embedding_forward(
        &self,
        out: &mut T,
        tokens: &Vec<u32>,
        wte: &T,
        wpe: Option<&T>,
        b: usize,
        t: usize,
        c: usize,
    ) {
        let (wte, wpe) = (wte.f32(), wpe.map(|w| w.f32()));
        out.with_f32(|o| embedding::embedding_forward(o, tokens, &wte, wpe.as_deref(), b, t, c))
    }
    fn embedding_backward_weight(
        &self,
        dwte: &mut T,
        dwpe: Option<&mut T>,
        dout: &T,
        tokens: &Vec<u32>,
        b: usize,
        t: usize,
        c: usize,
    ) {
        let dout = dout.f32();
        dwte.with_f32(|dwte| match dwpe {
            Some(dwpe) => dwpe.with_f32(|dwpe| {
                embedding::embedding_backward_weight(dwte, Some(dwpe), &dout, tokens, b, t, c)
            }),
            None => embedding::embedding_backward_weight(dwte, None, &dout, tokens, b, t, c),
        })
    }

    fn layernorm_forward(
        &self,
        out: &mut T,
        mean: &mut T,
        rstd: &mut T,
        inp: &T,
        weight: &T,
        bias: &T,
        n: usize,
        c: usize,
    ) {
        let (inp, weight, bias) = (inp.f32(), weight.f32(), bias.f32());
        out.with_f32(|o| {
            mean.with_f32(|m| {
                rstd.with_f32(|r| layernorm::layernorm_forward(o, m, r, &inp, &weight, &bias, n, c))
            })
        })
    }
    fn layernorm_backward_input(
        &self,
        dinp: &mut T,
        dout: &T,
        inp: &T,
        weight: &T,
        mean: &T,
        rstd: &T,
        n: usize,
        c: usize,
    ) {
        let (dout, inp, weight) = (dout.f32(), inp.f32(), weight.f32());
        let (mean, rstd) = (mean.f32(), rstd.f32());
        dinp.with_f32(|d| {
            layernorm::layernorm_backward_input(d, &dout, &inp, &weight, &mean, &rstd, n, c)
        })
    }
    fn layernorm_backward_weight(
        &self,
        dweight: &mut T,
        dbias: &mut T,
        dout: &T,
        inp: &T,
        mean: &T,
        rstd: &T,
        n: usize,
        c: usize,
    ) {
        let (dout, inp, mean, rstd) = (dout.f32(), inp.f32(), mean.f32(), rstd.f32());
        dweight.with_f32(|dw| {
            dbias.with_f32(|db| {
                layernorm::layernorm_backward_weight(dw, db, &dout, &inp, &mean, &rstd, n, c)
            })
        })
    }

    fn rmsnorm_forward(
        &self,
        out: &mut T,
        rstd: &mut T,
        inp: &T,
        weight: &T,
        n: usize,
        c: usize,
        eps: f32,
    ) {
        let (inp, weight) = (inp.f32(), weight.f32());
        out.with_f32(|o| {
            rstd.with_f32(|r| rmsnorm::rmsnorm_forward(o, r, &inp, &weight, n, c, eps))
        })
    }
    fn rmsnorm_backward_input(
        &self,
        dinp: &mut T,
        dout: &T,
        inp: &T,
        weight: &T,
        rstd: &T,
        n: usize,
        c: usize,
    ) {
        let (dout, inp, weight, rstd) = (dout.f32(), inp.f32(), weight.f32(), rstd.f32());
        dinp.with_f32(|d| rmsnorm::rmsnorm_backward_input(d, &dout, &inp, &weight, &rstd, n, c))
    }
    fn rmsnorm_backward_weight(
        &self,
        dweight: &mut T,
        dout: &T,
        inp: &T,
        rstd: &T,
        n: usize,
        c: usize,
    ) {
        let (dout, inp, rstd) = (dout.f32(), inp.f32(), rstd.f32());
        dweight.with_f32(|dw| rmsnorm::rmsnorm_backward_weight(dw, &dout, &inp, &rstd, n, c))
    }
    fn rope(
        &self,
        x: &mut T,
        b: usize,
        t: usize,
        heads: usize,
        hd: usize,
        theta: f64,
        inverse: bool,
    ) {
        x.with_f32(|x| rope::rope(x, b, t, heads, hd, theta, inverse))
    }

    fn matmul_forward(
        &self,
        out: &mut T,
        inp: &T,
        weight: &T,
        bias: Option<&T>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        let (inp, weight, bias) = (inp.f32(), weight.f32(), bias.map(|b| b.f32()));
        out.with_f32(|o| matmul::matmul_forward(o, &inp, &weight, bias.as_deref(), n, c, oc))
    }
    fn matmul_forward_residual(
        &self,
        out: &mut T,
        res: &T,
        inp: &T,
        weight: &T,
        bias: Option<&T>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        let (res, inp, weight) = (res.f32(), inp.f32(), weight.f32());
        let bias = bias.map(|b| b.f32());
        out.with_f32(|o| {
            matmul::matmul_forward_residual(o, &res, &inp, &weight, bias.as_deref(), n, c, oc)
        })
    }
    fn matmul_backward_input(
        &self,
        dinp: &mut T,
        dout: &T,
        weight: &T,
        n: usize,
        c: usize,
        oc: usize,
        accumulate: bool,
    ) {
        let (dout, weight) = (dout.f32(), weight.f32());
        dinp.with_f32(|d| matmul::matmul_backward_input(d, &dout, &weight, n, c, oc, accumulate))
    }
    fn matmul_backward_weight(
        &self,
        dweight: &mut T,
        dbias: Option<&mut T>,
        dout: &T,
        inp: &T,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        let (dout, inp) = (dout.f32(), inp.f32());
        dweight.with_f32(|dw| match dbias {
            Some(db) => db
                .with_f32(|db| matmul::matmul_backward_weight(dw, Some(db), &dout, &inp, n, c, oc)),
            None => matmul::matmul_backward_weight(dw, None, &dout, &inp, n, c, oc),
        })
    }
    fn add_bias(&self, out: &mut T, bias: &T, width: usize) {
        let bias = bias.f32();
        out.with_f32(|out| {
            for row in out.chunks_exact_mut(width) {
                for (o, x) in row.iter_mut().zip(bias.iter()) {
                    *o += x;
                }
            }
        })
    }

    fn attention_forward(
        &self,
        out: &mut T,
        att: &mut T,
        qkv: &T,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        let qkv = qkv.f32();
        out.with_f32(|o| att.with_f32(|a| attention::attention_forward(o, a, &qkv, b, t, c, nh)))
    }
    fn attention_backward(
        &self,
        dqkv: &mut T,
        dout: &T,
        qkv: &T,
        att: &T,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        let (dout, qkv, att) = (dout.f32(), qkv.f32(), att.f32());
        dqkv.with_f32(|d| attention::attention_backward(d, &dout, &qkv, &att, b, t, c, nh))
    }
    fn flash_attention_forward(
        &self,
        out: &mut T,
        lse: &mut T,
        qkv: &T,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        rows: SeqRows,
    ) {
        let (qkv, rows) = (qkv.f32(), rows.ranges());
        out.with_f32(|o| lse.with_f32(|l| flash::flash_forward(o, l, &qkv, b, t, c, nh, &rows)))
    }
    fn flash_attention_backward(
        &self,
        dqkv: &mut T,
        dout: &T,
        qkv: &T,
        out: &T,
        lse: &T,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        rows: SeqRows,
    ) {
        let (dout, qkv, out, lse) = (dout.f32(), qkv.f32(), out.f32(), lse.f32());
        let rows = rows.ranges();
        dqkv.with_f32(|d| flash::flash_backward(d, &dout, &qkv, &out, &lse, b, t, c, nh, &rows))
    }

    fn flash_ring_forward(
        &self,
        out: &mut T,
        lse: &mut T,
        q: &T,
        kv: &T,
        b: usize,
        c: usize,
        nh: usize,
        (qrows, krows): (SeqRows, SeqRows),
        first: bool,
    ) {
        let (q, kv) = (q.f32(), kv.f32());
        let (qr, kr) = (qrows.ranges(), krows.ranges());
        out.with_f32(|o| {
            lse.with_f32(|l| ring::ring_forward(o, l, &q, &kv, (b, c, nh), &qr, &kr, first))
        })
    }
    fn flash_ring_backward(
        &self,
        dq: &mut T,
        dkv: &mut T,
        dout: &T,
        q: &T,
        kv: &T,
        out: &T,
        lse: &T,
        b: usize,
        c: usize,
        nh: usize,
        (qrows, krows): (SeqRows, SeqRows),
    ) {
        let (dout, q, kv, out, lse) = (dout.f32(), q.f32(), kv.f32(), out.f32(), lse.f32());
        let (qr, kr) = (qrows.ranges(), krows.ranges());
        dq.with_f32(|dq| {
            dkv.with_f32(|dkv| {
                ring::ring_backward(
                    dq,
                    dkv,
                    &dout,
                    (&q, &kv),
                    (&out, &lse),
                    (b, c, nh),
                    &qr,
                    &kr,
                )
            })
        })
    }

    fn qkv_pack(
        &self,
        qkv: &mut T,
        q: &T,
        k: &T,
        v: &T,
        n: usize,
        nh: usize,
        kvh: usize,
        hd: usize,
    ) {
        let (q, k, v) = (q.f32(), k.f32(), v.f32());
        qkv.with_f32(|o| attention::qkv_pack(o, &q, &k, &v, n, nh, kvh, hd))
    }
    fn qkv_unpack_backward(
        &self,
        dq: &mut T,
        dk: &mut T,
        dv: &mut T,
        dqkv: &T,
        n: usize,
        nh: usize,
        kvh: usize,
        hd: usize,
    ) {
        let dqkv = dqkv.f32();
        dq.with_f32(|dq| {
            dk.with_f32(|dk| {
                dv.with_f32(|dv| attention::qkv_unpack_backward(dq, dk, dv, &dqkv, n, nh, kvh, hd))
            })
        })
    }

    fn gelu_forward(&self, out: &mut T, inp: &T) {
        let inp = inp.f32();
        out.with_f32(|o| elementwise::gelu_forward(o, &inp))
    }
    fn bias_gelu_forward(&self, pre: &mut T, out: &mut T, bias: &T, width: usize) {
        let bias = bias.f32();
        pre.with_f32(|p| out.with_f32(|o| elementwise::bias_gelu_forward(p, o, &bias, width)))
    }
    fn gelu_backward(&self, dinp: &mut T, inp: &T, dout: &T) {
        let (inp, dout) = (inp.f32(), dout.f32());
        dinp.with_f32(|d| elementwise::gelu_backward(d, &inp, &dout))
    }
    fn residual_forward(&self, out: &mut T, a: &T, b: &T) {
        let (a, b) = (a.f32(), b.f32());
        out.with_f32(|o| elementwise::residual_forward(o, &a, &b))
    }
    fn swiglu_forward(&self, out: &mut T, gate: &T, up: &T) {
        let (gate, up) = (gate.f32(), up.f32());
        out.with_f32(|o| elementwise::swiglu_forward(o, &gate, &up))
    }
    fn swiglu_backward(&self, dgate: &mut T, dup: &mut T, gate: &T, up: &T, dout: &T) {
        let (gate, up, dout) = (gate.f32(), up.f32(), dout.f32());
        dgate.with_f32(|dg| {
            dup.with_f32(|du| elementwise::swiglu_backward(dg, du, &gate, &up, &dout))
        })
    }

    fn crossentropy_forward(
        &self,
        probs: &mut T,
        logits: &T,
        targets: &Vec<u32>,
        n: usize,
        v: usize,
    ) -> f64 {
        let logits = logits.f32();
        probs.with_f32(|p| loss::crossentropy_forward(p, &logits, targets, n, v))
    }
    fn crossentropy_backward(
        &self,
        dlogits: &mut T,
        probs: &T,
        targets: &Vec<u32>,
        n: usize,
        v: usize,
        scale: f32,
    ) {
        let probs = probs.f32();
        dlogits.with_f32(|d| loss::crossentropy_backward(d, &probs, targets, n, v, scale))
    }

    fn softmax_rows(&self, probs: &mut T, logits: &T, e: usize) {
        let logits = logits.f32();
        probs.with_f32(|p| moe::softmax_rows(p, &logits, e))
    }
    fn gather_rows(
        &self,
        out: &mut T,
        at: usize,
        src: &T,
        assignments: &[u32],
        k: usize,
        c: usize,
    ) {
        let src = src.f32();
        out.with_f32(|o| moe::gather_rows(o, at, &src, assignments, k, c))
    }
    fn scatter_add_rows(
        &self,
        dst: &mut T,
        src: &T,
        at: usize,
        assignments: &[u32],
        k: usize,
        c: usize,
    ) {
        let src = src.f32();
        dst.with_f32(|d| moe::scatter_add_rows(d, &src, at, assignments, k, c))
    }
    fn moe_combine(&self, out: &mut T, ys: &[T], r: &Routing, c: usize) {
        let ys: Vec<_> = ys.iter().map(|y| y.f32()).collect();
        out.with_f32(|o| moe::combine(o, &ys, r, c))
    }
    fn moe_combine_backward(
        &self,
        dweight: &mut T,
        dys: &mut [T],
        dout: &T,
        ys: &[T],
        r: &Routing,
        c: usize,
    ) {
        let dout = dout.f32();
        let ys: Vec<_> = ys.iter().map(|y| y.f32()).collect();
        dweight.with_f32(|dw| {
            with_f32_all(dys, |dys| moe::combine_backward(dw, dys, &dout, &ys, r, c))
        })
    }
    fn router_backward(
        &self,
        dlogits: &mut T,
        probs: &T,
        dweight: &T,
        shares: &[f32],
        aux: f32,
        r: &Routing,
        t: usize,
        e: usize,
    ) {
        let (probs, dweight) = (probs.f32(), dweight.f32());
        dlogits.with_f32(|d| moe::router_backward(d, &probs, &dweight, shares, aux, r, t, e))
    }

    fn adamw(
        &self,
        param: &mut T,
        grad: &T,
        m: &mut T,
        v: &mut T,
        range: Range<usize>,
        h: &AdamW,
        step: u32,
        grad_scale: f32,
        decay: bool,
    ) {
        let grad = grad.f32_range(range.clone());
        param.with_f32_range(range.clone(), |p| {
            m.with_f32_range(range.clone(), |m| {
                v.with_f32_range(range, |v| {
                    adamw::adamw_update(p, &grad, m, v, h, step, grad_scale, decay)
                })
            })
        })
    }
    fn sum_squares(&self, pieces: &[(&T, Range<usize>)]) -> Result<f64, BackendError> {
        // One fold over the pieces' sums, as `Iterator::sum` adds.
        Ok(pieces
            .iter()
            .map(|(t, r)| {
                t.f32_range(r.clone())
                    .iter()
                    .map(|x| (*x as f64) * (*x as f64))
                    .sum::<f64>()
            })
            .sum())
    }
}

//! The CPU backend, the embedded default: a device is a thread pool with
//! its own memory account, storage is host memory (`Vec<f32>`), and the
//! kernels are llm.c's, one file per op family, each op a forward plus a
//! backward-for-input and a backward-for-weights with explicit shapes. fp32;
//! each kernel spreads over its device's thread pool ([`par`]) and gives the
//! same bits for every thread count. Enqueuing a kernel runs it, so streams
//! and events are empty and every read is immediate.

// Kernels carry their shapes as arguments, as llm.c does: readable at the call.
#![allow(clippy::too_many_arguments)]

pub mod adamw;
pub mod attention;
pub mod elementwise;
pub mod embedding;
pub mod lanes;
pub mod layernorm;
pub mod loss;
pub mod matmul;
pub mod memory;
pub mod moe;
pub mod par;
pub mod profile;
pub mod rmsnorm;
pub mod rope;

#[cfg(test)]
mod llama_tests;
#[cfg(test)]
mod tests;

use super::{AdamW, Backend, BackendError, Routing, Trace};
use std::ops::Range;

/// One CPU device: the threads its kernels run on.
pub struct Cpu {
    pool: rayon::ThreadPool,
}

impl Cpu {
    /// Device `device` with `threads` kernel threads.
    pub fn new(device: u32, threads: usize) -> Result<Self, BackendError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(move |i| format!("piper-d{device}-k{i}"))
            .build()
            .map_err(|e| {
                BackendError::Device(format!(
                    "device {device}: cannot start {threads} kernel threads: {e}"
                ))
            })?;
        Ok(Cpu { pool })
    }
}

/// Below this many floats a buffer is filled on the calling thread.
const PAR_MIN: usize = 1 << 16;

impl Cpu {
    /// A new buffer of `n` floats filled by `fill` on the device's threads,
    /// when it is large and there are several: one core's stores reach a
    /// fraction of the memory bandwidth, and a step zeroes or copies every
    /// activation and gradient it allocates. `None`: fill it on this thread.
    fn filled(&self, n: usize, fill: impl FnOnce(&mut Vec<f32>) + Send) -> Option<Vec<f32>> {
        if n < 4 * PAR_MIN || self.pool.current_num_threads() == 1 {
            return None;
        }
        let mut v = Vec::new();
        self.pool.install(|| fill(&mut v));
        Some(v)
    }
}

/// No queue: a kernel runs when it is called.
pub struct Inline;

impl Backend for Cpu {
    type Tensor = Vec<f32>;
    type Ids = Vec<u32>;
    type Scalar = f64;
    type Stream = Inline;
    type Event = ();

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn stream(&self) -> Result<Inline, BackendError> {
        Ok(Inline)
    }
    fn enter<R: Send>(&self, _: &Inline, trace: Trace<'_>, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(|| match trace {
            Some((epoch, spans)) => profile::recording(true, epoch, spans, f),
            None => f(),
        })
    }
    fn record(&self, _: &Inline) {}
    fn wait(&self, _: &Inline, _: &()) {}

    fn len(t: &Vec<f32>) -> usize {
        t.len()
    }
    fn bytes(t: &Vec<f32>) -> u64 {
        t.len() as u64 * 4
    }
    fn ids_bytes(t: &Vec<u32>) -> u64 {
        t.len() as u64 * 4
    }
    fn zeros(&self, n: usize) -> Result<Vec<f32>, BackendError> {
        let _k = profile::span("zeros");
        Ok(self
            .filled(n, |v| {
                use rayon::prelude::*;
                rayon::iter::repeat_n(0.0f32, n)
                    .with_min_len(PAR_MIN)
                    .collect_into_vec(v)
            })
            .unwrap_or_else(|| vec![0.0; n]))
    }
    fn upload(&self, v: Vec<f32>) -> Result<Vec<f32>, BackendError> {
        Ok(v)
    }
    fn upload_ids(&self, v: &[u32]) -> Result<Vec<u32>, BackendError> {
        Ok(v.to_vec())
    }
    fn download(&self, t: &Vec<f32>) -> Result<Vec<f32>, BackendError> {
        Ok(t.clone())
    }
    fn download_range(&self, t: &Vec<f32>, range: Range<usize>) -> Result<Vec<f32>, BackendError> {
        Ok(t[range].to_vec())
    }
    fn download_owned(&self, t: Vec<f32>) -> Result<Vec<f32>, BackendError> {
        Ok(t)
    }
    fn duplicate(&self, t: &Vec<f32>) -> Result<Vec<f32>, BackendError> {
        let _k = profile::span("duplicate");
        Ok(self
            .filled(t.len(), |v| {
                use rayon::prelude::*;
                t.par_iter()
                    .with_min_len(PAR_MIN)
                    .copied()
                    .collect_into_vec(v)
            })
            .unwrap_or_else(|| t.clone()))
    }
    fn duplicate_ids(&self, t: &Vec<u32>) -> Result<Vec<u32>, BackendError> {
        Ok(t.clone())
    }
    fn copy(&self, dst: &mut Vec<f32>, at: usize, src: &Vec<f32>, range: Range<usize>) {
        dst[at..at + range.len()].copy_from_slice(&src[range]);
    }
    fn write(&self, dst: &mut Vec<f32>, at: usize, src: &[f32]) {
        dst[at..at + src.len()].copy_from_slice(src);
    }
    fn add_host(&self, dst: &mut Vec<f32>, at: usize, src: &[f32]) {
        for (a, x) in dst[at..].iter_mut().zip(src) {
            *a += x;
        }
    }
    fn add(&self, dst: &mut Vec<f32>, src: &Vec<f32>) {
        dst.iter_mut().zip(src).for_each(|(x, y)| *x += y);
    }
    fn fill_zero(&self, t: &mut Vec<f32>) {
        t.iter_mut().for_each(|x| *x = 0.0);
    }
    fn scalar(&self, x: f64) -> f64 {
        x
    }
    fn read_scalar(&self, s: f64) -> Result<f64, BackendError> {
        Ok(s)
    }

    fn embedding_forward(
        &self,
        out: &mut Vec<f32>,
        tokens: &Vec<u32>,
        wte: &Vec<f32>,
        wpe: Option<&Vec<f32>>,
        b: usize,
        t: usize,
        c: usize,
    ) {
        embedding::embedding_forward(out, tokens, wte, wpe.map(|w| w.as_slice()), b, t, c)
    }
    fn embedding_backward_weight(
        &self,
        dwte: &mut Vec<f32>,
        dwpe: Option<&mut Vec<f32>>,
        dout: &Vec<f32>,
        tokens: &Vec<u32>,
        b: usize,
        t: usize,
        c: usize,
    ) {
        embedding::embedding_backward_weight(
            dwte,
            dwpe.map(|w| w.as_mut_slice()),
            dout,
            tokens,
            b,
            t,
            c,
        )
    }

    fn layernorm_forward(
        &self,
        out: &mut Vec<f32>,
        mean: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        inp: &Vec<f32>,
        weight: &Vec<f32>,
        bias: &Vec<f32>,
        n: usize,
        c: usize,
    ) {
        layernorm::layernorm_forward(out, mean, rstd, inp, weight, bias, n, c)
    }
    fn layernorm_backward_input(
        &self,
        dinp: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        weight: &Vec<f32>,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        n: usize,
        c: usize,
    ) {
        layernorm::layernorm_backward_input(dinp, dout, inp, weight, mean, rstd, n, c)
    }
    fn layernorm_backward_weight(
        &self,
        dweight: &mut Vec<f32>,
        dbias: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        n: usize,
        c: usize,
    ) {
        layernorm::layernorm_backward_weight(dweight, dbias, dout, inp, mean, rstd, n, c)
    }

    fn rmsnorm_forward(
        &self,
        out: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        inp: &Vec<f32>,
        weight: &Vec<f32>,
        n: usize,
        c: usize,
        eps: f32,
    ) {
        rmsnorm::rmsnorm_forward(out, rstd, inp, weight, n, c, eps)
    }
    fn rmsnorm_backward_input(
        &self,
        dinp: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        weight: &Vec<f32>,
        rstd: &Vec<f32>,
        n: usize,
        c: usize,
    ) {
        rmsnorm::rmsnorm_backward_input(dinp, dout, inp, weight, rstd, n, c)
    }
    fn rmsnorm_backward_weight(
        &self,
        dweight: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        rstd: &Vec<f32>,
        n: usize,
        c: usize,
    ) {
        rmsnorm::rmsnorm_backward_weight(dweight, dout, inp, rstd, n, c)
    }
    fn rope(
        &self,
        x: &mut Vec<f32>,
        b: usize,
        t: usize,
        heads: usize,
        hd: usize,
        theta: f64,
        inverse: bool,
    ) {
        rope::rope(x, b, t, heads, hd, theta, inverse)
    }

    fn matmul_forward(
        &self,
        out: &mut Vec<f32>,
        inp: &Vec<f32>,
        weight: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        matmul::matmul_forward(out, inp, weight, bias.map(|b| b.as_slice()), n, c, oc)
    }
    fn matmul_forward_residual(
        &self,
        out: &mut Vec<f32>,
        res: &Vec<f32>,
        inp: &Vec<f32>,
        weight: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        matmul::matmul_forward_residual(out, res, inp, weight, bias.map(|b| b.as_slice()), n, c, oc)
    }
    fn matmul_backward_input(
        &self,
        dinp: &mut Vec<f32>,
        dout: &Vec<f32>,
        weight: &Vec<f32>,
        n: usize,
        c: usize,
        oc: usize,
        accumulate: bool,
    ) {
        matmul::matmul_backward_input(dinp, dout, weight, n, c, oc, accumulate)
    }
    fn matmul_backward_weight(
        &self,
        dweight: &mut Vec<f32>,
        dbias: Option<&mut Vec<f32>>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        matmul::matmul_backward_weight(
            dweight,
            dbias.map(|b| b.as_mut_slice()),
            dout,
            inp,
            n,
            c,
            oc,
        )
    }
    fn add_bias(&self, out: &mut Vec<f32>, bias: &Vec<f32>, width: usize) {
        for row in out.chunks_exact_mut(width) {
            for (o, x) in row.iter_mut().zip(bias) {
                *o += x;
            }
        }
    }

    fn attention_forward(
        &self,
        out: &mut Vec<f32>,
        att: &mut Vec<f32>,
        qkv: &Vec<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        attention::attention_forward(out, att, qkv, b, t, c, nh)
    }
    fn attention_backward(
        &self,
        dqkv: &mut Vec<f32>,
        dout: &Vec<f32>,
        qkv: &Vec<f32>,
        att: &Vec<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        attention::attention_backward(dqkv, dout, qkv, att, b, t, c, nh)
    }

    fn qkv_pack(
        &self,
        qkv: &mut Vec<f32>,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        n: usize,
        nh: usize,
        kvh: usize,
        hd: usize,
    ) {
        attention::qkv_pack(qkv, q, k, v, n, nh, kvh, hd)
    }
    fn qkv_unpack_backward(
        &self,
        dq: &mut Vec<f32>,
        dk: &mut Vec<f32>,
        dv: &mut Vec<f32>,
        dqkv: &Vec<f32>,
        n: usize,
        nh: usize,
        kvh: usize,
        hd: usize,
    ) {
        attention::qkv_unpack_backward(dq, dk, dv, dqkv, n, nh, kvh, hd)
    }

    fn gelu_forward(&self, out: &mut Vec<f32>, inp: &Vec<f32>) {
        elementwise::gelu_forward(out, inp)
    }
    fn bias_gelu_forward(
        &self,
        pre: &mut Vec<f32>,
        out: &mut Vec<f32>,
        bias: &Vec<f32>,
        width: usize,
    ) {
        elementwise::bias_gelu_forward(pre, out, bias, width)
    }
    fn gelu_backward(&self, dinp: &mut Vec<f32>, inp: &Vec<f32>, dout: &Vec<f32>) {
        elementwise::gelu_backward(dinp, inp, dout)
    }
    fn residual_forward(&self, out: &mut Vec<f32>, a: &Vec<f32>, b: &Vec<f32>) {
        elementwise::residual_forward(out, a, b)
    }
    fn swiglu_forward(&self, out: &mut Vec<f32>, gate: &Vec<f32>, up: &Vec<f32>) {
        elementwise::swiglu_forward(out, gate, up)
    }
    fn swiglu_backward(
        &self,
        dgate: &mut Vec<f32>,
        dup: &mut Vec<f32>,
        gate: &Vec<f32>,
        up: &Vec<f32>,
        dout: &Vec<f32>,
    ) {
        elementwise::swiglu_backward(dgate, dup, gate, up, dout)
    }

    fn crossentropy_forward(
        &self,
        probs: &mut Vec<f32>,
        logits: &Vec<f32>,
        targets: &Vec<u32>,
        n: usize,
        v: usize,
    ) -> f64 {
        loss::crossentropy_forward(probs, logits, targets, n, v)
    }
    fn crossentropy_backward(
        &self,
        dlogits: &mut Vec<f32>,
        probs: &Vec<f32>,
        targets: &Vec<u32>,
        n: usize,
        v: usize,
        scale: f32,
    ) {
        loss::crossentropy_backward(dlogits, probs, targets, n, v, scale)
    }

    fn softmax_rows(&self, probs: &mut Vec<f32>, logits: &Vec<f32>, e: usize) {
        moe::softmax_rows(probs, logits, e)
    }
    fn gather_rows(
        &self,
        out: &mut Vec<f32>,
        at: usize,
        src: &Vec<f32>,
        assignments: &[u32],
        k: usize,
        c: usize,
    ) {
        moe::gather_rows(out, at, src, assignments, k, c)
    }
    fn scatter_add_rows(
        &self,
        dst: &mut Vec<f32>,
        src: &Vec<f32>,
        at: usize,
        assignments: &[u32],
        k: usize,
        c: usize,
    ) {
        moe::scatter_add_rows(dst, src, at, assignments, k, c)
    }
    fn moe_combine(&self, out: &mut Vec<f32>, ys: &[Vec<f32>], r: &Routing, c: usize) {
        moe::combine(out, ys, r, c)
    }
    fn moe_combine_backward(
        &self,
        dweight: &mut Vec<f32>,
        dys: &mut [Vec<f32>],
        dout: &Vec<f32>,
        ys: &[Vec<f32>],
        r: &Routing,
        c: usize,
    ) {
        moe::combine_backward(dweight, dys, dout, ys, r, c)
    }
    fn router_backward(
        &self,
        dlogits: &mut Vec<f32>,
        probs: &Vec<f32>,
        dweight: &Vec<f32>,
        shares: &[f32],
        aux: f32,
        r: &Routing,
        t: usize,
        e: usize,
    ) {
        moe::router_backward(dlogits, probs, dweight, shares, aux, r, t, e)
    }

    fn adamw(
        &self,
        param: &mut Vec<f32>,
        grad: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
        range: Range<usize>,
        h: &AdamW,
        step: u32,
        grad_scale: f32,
        decay: bool,
    ) {
        adamw::adamw_update(
            &mut param[range.clone()],
            &grad[range.clone()],
            &mut m[range.clone()],
            &mut v[range],
            h,
            step,
            grad_scale,
            decay,
        )
    }
    fn sum_squares(&self, pieces: &[(&Vec<f32>, Range<usize>)]) -> Result<f64, BackendError> {
        // One fold over the pieces' sums, as `Iterator::sum` adds.
        Ok(pieces
            .iter()
            .map(|(t, r)| {
                t[r.clone()]
                    .iter()
                    .map(|x| (*x as f64) * (*x as f64))
                    .sum::<f64>()
            })
            .sum())
    }
}

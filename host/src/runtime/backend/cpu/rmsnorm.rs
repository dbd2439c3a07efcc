//! RMSNorm over the channel dimension (the Llama family's norm, Hugging
//! Face's `LlamaRMSNorm`), with the reciprocal root mean square cached for
//! backward; split into input and weight gradients like LayerNorm. Rows in
//! parallel, their sums in [`lanes`]' order; the weight gradient by column, summed over the rows in order.

use super::{lanes, par};

/// `out = inp · rstd · weight`, `rstd = 1 / √(mean(inp²) + eps)` per row of
/// `c` channels.
pub fn rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    eps: f32,
) {
    let _k = super::profile::span("rmsnorm_forward");
    par::rows_mut_work(&mut rstd[..n], 1, c, |i0, rstd| {
        for (k, s_out) in rstd.iter_mut().enumerate() {
            let x = &inp[(i0 + k) * c..][..c];
            let ms = lanes::dot(x, x) / c as f32;
            *s_out = 1.0 / (ms + eps).sqrt();
        }
    });
    let rstd = &*rstd;
    par::rows_mut(&mut out[..n * c], c, |i0, block| {
        for (k, o) in block.chunks_exact_mut(c).enumerate() {
            let i = i0 + k;
            let (x, s) = (&inp[i * c..][..c], rstd[i]);
            for j in 0..c {
                o[j] = x[j] * s * weight[j];
            }
        }
    });
}

/// Backward for the input: `dinp += rstd · (g − norm · mean(g · norm))`,
/// `g = dout · weight`, `norm = inp · rstd`.
pub fn rmsnorm_backward_input(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    let _k = super::profile::span("rmsnorm_backward_input");
    par::rows_mut_work(&mut dinp[..n * c], c, 3 * c, |i0, block| {
        for (k, dx) in block.chunks_exact_mut(c).enumerate() {
            let i = i0 + k;
            let (x, dy) = (&inp[i * c..(i + 1) * c], &dout[i * c..(i + 1) * c]);
            let s = rstd[i];
            let g_norm_mean = lanes::sum_zip3(weight, dy, x, |w, d, x| w * d * (x * s)) / c as f32;
            for j in 0..c {
                let norm = x[j] * s;
                dx[j] += (weight[j] * dy[j] - norm * g_norm_mean) * s;
            }
        }
    });
}

/// Backward for the weight: `dweight += Σ_rows norm · dout`.
pub fn rmsnorm_backward_weight(
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    let _k = super::profile::span("rmsnorm_backward_weight");
    par::rows_mut_work(&mut dweight[..c], 1, 2 * n, |j0, dw| {
        let w = dw.len();
        for i in 0..n {
            let (x, dy) = (&inp[i * c + j0..][..w], &dout[i * c + j0..][..w]);
            for j in 0..w {
                dw[j] += x[j] * rstd[i] * dy[j];
            }
        }
    });
}

//! LayerNorm over the channel dimension, with the mean and reciprocal standard
//! deviation cached for backward (llm.c's `layernorm_forward/backward`, split
//! into input and weight gradients). Rows in parallel; the weight gradients
//! by column, each summed over the rows in order.

use super::par;

const EPS: f32 = 1e-5;

/// `out = (inp − mean) · rstd · weight + bias`, per row of `c` channels.
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    n: usize,
    c: usize,
) {
    let _k = super::profile::span("layernorm_forward");
    let (mean, rstd) = (&mut mean[..n], &mut rstd[..n]);
    par::rows_mut2(mean, 1, rstd, 1, 2 * c, |i0, mean, rstd| {
        for (k, (m_out, s_out)) in mean.iter_mut().zip(rstd.iter_mut()).enumerate() {
            let x = &inp[(i0 + k) * c..][..c];
            let m = x.iter().sum::<f32>() / c as f32;
            let v = x.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / c as f32;
            *m_out = m;
            *s_out = 1.0 / (v + EPS).sqrt();
        }
    });
    let (mean, rstd) = (&*mean, &*rstd);
    par::rows_mut(&mut out[..n * c], c, |i0, block| {
        for (k, o) in block.chunks_exact_mut(c).enumerate() {
            let i = i0 + k;
            let (x, m, s) = (&inp[i * c..][..c], mean[i], rstd[i]);
            for j in 0..c {
                o[j] = (x[j] - m) * s * weight[j] + bias[j];
            }
        }
    });
}

/// Backward for the input: `dinp += rstd · (dnorm − mean(dnorm) − norm · mean(dnorm · norm))`,
/// `dnorm = dout · weight`.
pub fn layernorm_backward_input(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    let _k = super::profile::span("layernorm_backward_input");
    par::rows_mut_work(&mut dinp[..n * c], c, 3 * c, |i0, block| {
        for (k, dx) in block.chunks_exact_mut(c).enumerate() {
            let i = i0 + k;
            let (x, dy) = (&inp[i * c..(i + 1) * c], &dout[i * c..(i + 1) * c]);
            let (m, s) = (mean[i], rstd[i]);
            let mut dnorm_mean = 0.0f32;
            let mut dnorm_norm_mean = 0.0f32;
            for j in 0..c {
                let norm = (x[j] - m) * s;
                let dnorm = weight[j] * dy[j];
                dnorm_mean += dnorm;
                dnorm_norm_mean += dnorm * norm;
            }
            dnorm_mean /= c as f32;
            dnorm_norm_mean /= c as f32;
            for j in 0..c {
                let norm = (x[j] - m) * s;
                let dnorm = weight[j] * dy[j];
                dx[j] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
            }
        }
    });
}

/// Backward for the weights: `dweight += Σ norm · dout`, `dbias += Σ dout`.
pub fn layernorm_backward_weight(
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    let _k = super::profile::span("layernorm_backward_weight");
    // By column: each thread sums its columns over every row, in row order.
    par::rows_mut2(
        &mut dweight[..c],
        1,
        &mut dbias[..c],
        1,
        2 * n,
        |j0, dw, db| {
            let w = dw.len();
            for i in 0..n {
                let (x, dy) = (&inp[i * c + j0..][..w], &dout[i * c + j0..][..w]);
                for j in 0..w {
                    let norm = (x[j] - mean[i]) * rstd[i];
                    dw[j] += norm * dy[j];
                    db[j] += dy[j];
                }
            }
        },
    );
}

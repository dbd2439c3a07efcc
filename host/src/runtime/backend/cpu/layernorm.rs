//! LayerNorm over the channel dimension, with the mean and reciprocal standard
//! deviation cached for backward (llm.c's `layernorm_forward/backward`, split
//! into input and weight gradients).

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
    for i in 0..n {
        let x = &inp[i * c..(i + 1) * c];
        let m = x.iter().sum::<f32>() / c as f32;
        let v = x.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / c as f32;
        let s = 1.0 / (v + EPS).sqrt();
        let o = &mut out[i * c..(i + 1) * c];
        for j in 0..c {
            o[j] = (x[j] - m) * s * weight[j] + bias[j];
        }
        mean[i] = m;
        rstd[i] = s;
    }
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
    for i in 0..n {
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
        let dx = &mut dinp[i * c..(i + 1) * c];
        for j in 0..c {
            let norm = (x[j] - m) * s;
            let dnorm = weight[j] * dy[j];
            dx[j] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
    }
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
    for i in 0..n {
        let (x, dy) = (&inp[i * c..(i + 1) * c], &dout[i * c..(i + 1) * c]);
        for j in 0..c {
            let norm = (x[j] - mean[i]) * rstd[i];
            dweight[j] += norm * dy[j];
            dbias[j] += dy[j];
        }
    }
}

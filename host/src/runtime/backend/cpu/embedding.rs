//! Token + position embedding. The input (token ids) has no gradient, so the
//! backward is a backward-for-weights only.

/// `out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]`.
pub fn embedding_forward(
    out: &mut [f32],
    tokens: &[u32],
    wte: &[f32],
    wpe: &[f32],
    b: usize,
    t: usize,
    c: usize,
) {
    let _k = super::profile::span("embedding_forward");
    for bi in 0..b {
        for ti in 0..t {
            let tok = tokens[bi * t + ti] as usize;
            let o = &mut out[(bi * t + ti) * c..][..c];
            let (e, p) = (&wte[tok * c..][..c], &wpe[ti * c..][..c]);
            for j in 0..c {
                o[j] = e[j] + p[j];
            }
        }
    }
}

/// `dwte[token] += dout`, `dwpe[t] += dout`.
pub fn embedding_backward_weight(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    b: usize,
    t: usize,
    c: usize,
) {
    let _k = super::profile::span("embedding_backward_weight");
    for bi in 0..b {
        for ti in 0..t {
            let tok = tokens[bi * t + ti] as usize;
            let g = &dout[(bi * t + ti) * c..][..c];
            for j in 0..c {
                dwte[tok * c + j] += g[j];
                dwpe[ti * c + j] += g[j];
            }
        }
    }
}

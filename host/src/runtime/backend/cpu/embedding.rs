//! Token (+ position) embedding: GPT-2 adds learned positions, the Llama
//! family has none (its positions are rotary, inside attention). The input (token ids) has no gradient, so the
//! backward is a backward-for-weights only.

/// `out[b,t,:] = wte[tokens[b,t],:] (+ wpe[t,:])`.
pub fn embedding_forward(
    out: &mut [f32],
    tokens: &[u32],
    wte: &[f32],
    wpe: Option<&[f32]>,
    b: usize,
    t: usize,
    c: usize,
) {
    let _k = super::profile::span("embedding_forward");
    for bi in 0..b {
        for ti in 0..t {
            let tok = tokens[bi * t + ti] as usize;
            let o = &mut out[(bi * t + ti) * c..][..c];
            let e = &wte[tok * c..][..c];
            match wpe {
                Some(wpe) => {
                    let p = &wpe[ti * c..][..c];
                    for j in 0..c {
                        o[j] = e[j] + p[j];
                    }
                }
                None => o.copy_from_slice(e),
            }
        }
    }
}

/// `dwte[token] += dout` (and `dwpe[t] += dout`).
pub fn embedding_backward_weight(
    dwte: &mut [f32],
    mut dwpe: Option<&mut [f32]>,
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
            }
            if let Some(dwpe) = dwpe.as_deref_mut() {
                for j in 0..c {
                    dwpe[ti * c + j] += g[j];
                }
            }
        }
    }
}

//! Causal multi-head self-attention from a packed `qkv[B,T,3C]`: per head,
//! `att = softmax(q·kᵀ/√hs)` masked to `t2 ≤ t`, `out = att·v`. The softmax
//! probabilities are cached for backward. No weights: the whole backward is a
//! backward-for-input.

/// Forward. `att[B,NH,T,T]` receives the probabilities (zero above the diagonal).
pub fn attention_forward(
    out: &mut [f32],
    att: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = 3 * c;
    for bi in 0..b {
        for h in 0..nh {
            for ti in 0..t {
                let q = &qkv[(bi * t + ti) * c3 + h * hs..][..hs];
                let arow = &mut att[((bi * nh + h) * t + ti) * t..][..t];
                let mut maxv = f32::NEG_INFINITY;
                for t2 in 0..=ti {
                    let k = &qkv[(bi * t + t2) * c3 + c + h * hs..][..hs];
                    let v: f32 = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                    arow[t2] = v;
                    maxv = maxv.max(v);
                }
                let mut sum = 0.0f32;
                for a in arow.iter_mut().take(ti + 1) {
                    *a = (*a - maxv).exp();
                    sum += *a;
                }
                let inv = 1.0 / sum;
                for a in arow.iter_mut().take(ti + 1) {
                    *a *= inv;
                }
                for a in arow.iter_mut().skip(ti + 1) {
                    *a = 0.0;
                }
                let o = &mut out[(bi * t + ti) * c + h * hs..][..hs];
                o.fill(0.0);
                for t2 in 0..=ti {
                    let v = &qkv[(bi * t + t2) * c3 + 2 * c + h * hs..][..hs];
                    let a = arow[t2];
                    for (oo, vv) in o.iter_mut().zip(v) {
                        *oo += a * vv;
                    }
                }
            }
        }
    }
}

/// Backward: `dqkv += ∂out/∂qkv · dout`.
pub fn attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    att: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = 3 * c;
    let mut datt = vec![0.0f32; t];
    let mut dpre = vec![0.0f32; t];
    for bi in 0..b {
        for h in 0..nh {
            for ti in 0..t {
                let arow = &att[((bi * nh + h) * t + ti) * t..][..t];
                let dout_h = &dout[(bi * t + ti) * c + h * hs..][..hs];
                // out = Σ att·v  →  datt, dv
                for t2 in 0..=ti {
                    let v = &qkv[(bi * t + t2) * c3 + 2 * c + h * hs..][..hs];
                    datt[t2] = v.iter().zip(dout_h).map(|(a, b)| a * b).sum();
                    let dv = &mut dqkv[(bi * t + t2) * c3 + 2 * c + h * hs..][..hs];
                    for (d, g) in dv.iter_mut().zip(dout_h) {
                        *d += arow[t2] * g;
                    }
                }
                // softmax backward: dpre = att ⊙ (datt − Σ att·datt)
                let dot: f32 = (0..=ti).map(|t2| arow[t2] * datt[t2]).sum();
                for t2 in 0..=ti {
                    dpre[t2] = arow[t2] * (datt[t2] - dot) * scale;
                }
                // pre = q·k  →  dq, dk
                for t2 in 0..=ti {
                    let g = dpre[t2];
                    for i in 0..hs {
                        let k = qkv[(bi * t + t2) * c3 + c + h * hs + i];
                        let q = qkv[(bi * t + ti) * c3 + h * hs + i];
                        dqkv[(bi * t + ti) * c3 + h * hs + i] += g * k;
                        dqkv[(bi * t + t2) * c3 + c + h * hs + i] += g * q;
                    }
                }
            }
        }
    }
}

//! Elementwise ops: GELU (tanh approximation, as GPT-2), SwiGLU (the Llama
//! family's), residual add; in
//! parallel chunks on the device's threads. GELU's tanh is computed without
//! a libm call ([`tanh`]), so its loops vectorize: libm's `tanhf` made GELU
//! a fifth of the mid-size model's step.

use super::par;

const GELU_SCALE: f32 = 0.797_884_6; // √(2/π)

/// `e^x` for |x| ≤ 20 by range reduction, `x = k·ln 2 + r` with |r| ≤ ln 2 / 2,
/// and Cephes' degree-6 polynomial for `e^r` (relative error < 2e-7): only
/// multiplies, adds and bit operations, which the compiler vectorizes.
#[inline(always)]
pub(super) fn exp_small(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that k·LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Round to nearest by the 1.5·2²³ trick (|x·log2 e| < 2²²).
    const ROUND: f32 = 12_582_912.0;
    let k = (x * LOG2E + ROUND) - ROUND;
    let r = x - k * LN2_HI - k * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // |k| ≤ 29, so the exponent never wraps; `wrapping_add` keeps the
    // overflow check of debug builds out of the loop, which would stop it
    // vectorizing.
    er * f32::from_bits(((k as i32).wrapping_add(127) << 23) as u32)
}

/// `tanh(u) = 1 − 2 / (1 + e^{2u})`, within 3e-7 of the true value
/// (absolute; what GELU's `1 + tanh` needs), exactly ±1 past |u| = 10.
#[inline(always)]
pub fn tanh(u: f32) -> f32 {
    let e = exp_small(2.0 * u.clamp(-10.0, 10.0));
    1.0 - 2.0 / (1.0 + e)
}

/// `out = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    let _k = super::profile::span("gelu_forward");
    let n = out.len().min(inp.len());
    par::elements_mut(&mut out[..n], |o0, out| {
        for (o, &x) in out.iter_mut().zip(&inp[o0..]) {
            let cube = 0.044715 * x * x * x;
            *o = 0.5 * x * (1.0 + tanh(GELU_SCALE * (x + cube)));
        }
    });
}

/// The fc layer's bias fused into GELU: by rows of `width`, `pre += bias`,
/// then `out = gelu(pre)`, in one pass over both (the same operations as
/// adding the bias and then [`gelu_forward`], so the same bits).
pub fn bias_gelu_forward(pre: &mut [f32], out: &mut [f32], bias: &[f32], width: usize) {
    let _k = super::profile::span("bias_gelu_forward");
    let n = pre.len().min(out.len());
    par::rows_mut2(
        &mut pre[..n],
        width,
        &mut out[..n],
        width,
        2 * width,
        |_, pre, out| {
            for (prow, orow) in pre.chunks_exact_mut(width).zip(out.chunks_exact_mut(width)) {
                for ((p, o), b) in prow.iter_mut().zip(orow.iter_mut()).zip(bias) {
                    let x = *p + b;
                    *p = x;
                    let cube = 0.044715 * x * x * x;
                    *o = 0.5 * x * (1.0 + tanh(GELU_SCALE * (x + cube)));
                }
            }
        },
    );
}

/// `dinp += gelu'(x) · dout`.
pub fn gelu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    let _k = super::profile::span("gelu_backward");
    let n = dinp.len().min(inp.len()).min(dout.len());
    par::elements_mut(&mut dinp[..n], |o0, dinp| {
        for ((d, &x), &g) in dinp.iter_mut().zip(&inp[o0..]).zip(&dout[o0..]) {
            let cube = 0.044715 * x * x * x;
            let arg = GELU_SCALE * (x + cube);
            let th = tanh(arg);
            let sech2 = 1.0 - th * th;
            let local =
                0.5 * (1.0 + th) + x * 0.5 * sech2 * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x);
            *d += local * g;
        }
    });
}

/// `σ(x) = 1 / (1 + e^{−x})` through [`exp_small`] (the argument clamped
/// to ±20, where σ is 0 or 1 to f32's precision but for a tail of 2e-9).
#[inline(always)]
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_small((-x).clamp(-20.0, 20.0)))
}

/// SwiGLU: `out = silu(gate) · up`, `silu(x) = x · σ(x)`.
pub fn swiglu_forward(out: &mut [f32], gate: &[f32], up: &[f32]) {
    let _k = super::profile::span("swiglu_forward");
    let n = out.len().min(gate.len()).min(up.len());
    par::elements_mut(&mut out[..n], |o0, out| {
        for ((o, &g), &u) in out.iter_mut().zip(&gate[o0..]).zip(&up[o0..]) {
            *o = g * sigmoid(g) * u;
        }
    });
}

/// SwiGLU's backward: `dgate += dout · up · σ(g)(1 + g(1 − σ(g)))`,
/// `dup += dout · silu(g)`.
pub fn swiglu_backward(dgate: &mut [f32], dup: &mut [f32], gate: &[f32], up: &[f32], dout: &[f32]) {
    let _k = super::profile::span("swiglu_backward");
    let n = dgate.len().min(dup.len()).min(gate.len());
    par::rows_mut2(&mut dgate[..n], 1, &mut dup[..n], 1, 5, |o0, dg, du| {
        let len = dg.len();
        let inputs = gate[o0..o0 + len]
            .iter()
            .zip(&up[o0..o0 + len])
            .zip(&dout[o0..o0 + len]);
        for ((dg, du), ((&g, &u), &d)) in dg.iter_mut().zip(du.iter_mut()).zip(inputs) {
            let s = sigmoid(g);
            *dg += d * u * (s * (1.0 + g * (1.0 - s)));
            *du += d * (g * s);
        }
    });
}

/// `out = a + b`.
pub fn residual_forward(out: &mut [f32], a: &[f32], b: &[f32]) {
    let _k = super::profile::span("residual_forward");
    let n = out.len().min(a.len()).min(b.len());
    par::elements_mut(&mut out[..n], |o0, out| {
        for ((o, x), y) in out.iter_mut().zip(&a[o0..]).zip(&b[o0..]) {
            *o = x + y;
        }
    });
}

/// `da += dout`, `db += dout`.
pub fn residual_backward(da: &mut [f32], db: &mut [f32], dout: &[f32]) {
    let _k = super::profile::span("residual_backward");
    let n = da.len().min(db.len()).min(dout.len());
    par::rows_mut2(&mut da[..n], 1, &mut db[..n], 1, 3, |o0, da, db| {
        for ((a, b), g) in da.iter_mut().zip(db.iter_mut()).zip(&dout[o0..]) {
            *a += g;
            *b += g;
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn tanh_is_within_3e_7_of_the_true_value_everywhere() {
        let mut worst = (0.0f64, 0.0f32);
        let mut u = -12.0f32;
        while u <= 12.0 {
            let err = (super::tanh(u) as f64 - (u as f64).tanh()).abs();
            if err > worst.0 {
                worst = (err, u);
            }
            u += 1.0 / 1024.0;
        }
        assert!(worst.0 < 3e-7, "error {:.2e} at {}", worst.0, worst.1);
        assert_eq!(super::tanh(1e30), 1.0);
        assert_eq!(super::tanh(-1e30), -1.0);
        assert_eq!(super::tanh(0.0), 0.0);
    }
}

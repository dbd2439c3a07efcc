//! Elementwise ops: GELU (tanh approximation, as GPT-2), residual add; in
//! parallel chunks on the device's threads.

use super::par;

const GELU_SCALE: f32 = 0.797_884_6; // √(2/π)

/// `out = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    let _k = super::profile::span("gelu_forward");
    let n = out.len().min(inp.len());
    par::elements_mut(&mut out[..n], |o0, out| {
        for (o, &x) in out.iter_mut().zip(&inp[o0..]) {
            let cube = 0.044715 * x * x * x;
            *o = 0.5 * x * (1.0 + (GELU_SCALE * (x + cube)).tanh());
        }
    });
}

/// `dinp += gelu'(x) · dout`.
pub fn gelu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    let _k = super::profile::span("gelu_backward");
    let n = dinp.len().min(inp.len()).min(dout.len());
    par::elements_mut(&mut dinp[..n], |o0, dinp| {
        for ((d, &x), &g) in dinp.iter_mut().zip(&inp[o0..]).zip(&dout[o0..]) {
            let cube = 0.044715 * x * x * x;
            let arg = GELU_SCALE * (x + cube);
            let th = arg.tanh();
            let sech2 = 1.0 - th * th;
            let local =
                0.5 * (1.0 + th) + x * 0.5 * sech2 * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x);
            *d += local * g;
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

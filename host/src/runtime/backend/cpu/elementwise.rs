//! Elementwise ops: GELU (tanh approximation, as GPT-2), residual add.

const GELU_SCALE: f32 = 0.797_884_6; // √(2/π)

/// `out = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    for (o, &x) in out.iter_mut().zip(inp) {
        let cube = 0.044715 * x * x * x;
        *o = 0.5 * x * (1.0 + (GELU_SCALE * (x + cube)).tanh());
    }
}

/// `dinp += gelu'(x) · dout`.
pub fn gelu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    for ((d, &x), &g) in dinp.iter_mut().zip(inp).zip(dout) {
        let cube = 0.044715 * x * x * x;
        let arg = GELU_SCALE * (x + cube);
        let th = arg.tanh();
        let sech2 = 1.0 - th * th;
        let local =
            0.5 * (1.0 + th) + x * 0.5 * sech2 * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x);
        *d += local * g;
    }
}

/// `out = a + b`.
pub fn residual_forward(out: &mut [f32], a: &[f32], b: &[f32]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = x + y;
    }
}

/// `da += dout`, `db += dout`.
pub fn residual_backward(da: &mut [f32], db: &mut [f32], dout: &[f32]) {
    for ((a, b), g) in da.iter_mut().zip(db.iter_mut()).zip(dout) {
        *a += g;
        *b += g;
    }
}

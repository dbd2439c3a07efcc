//! Rotary position embeddings (RoPE) as the Llama family applies them
//! (Hugging Face's `rotate_half` convention): in each head of `hd`
//! channels, channel `i < hd/2` and channel `i + hd/2` rotate together by
//! the angle `t · θ^(−2i/hd)` of the token's position `t`. The backward is
//! the inverse rotation. Angles in f64, rounded once to f32 cos/sin.

use super::par;
use std::sync::{Arc, Mutex};

/// cos and sin of every (position, pair) angle, `[t, hd/2]` each.
pub fn rope_table(t: usize, hd: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let half = hd / 2;
    let freqs: Vec<f64> = (0..half)
        .map(|i| theta.powf(-((2 * i) as f64) / hd as f64))
        .collect();
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for pos in 0..t {
        for &freq in &freqs {
            let angle = pos as f64 * freq;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// cos and sin tables, shared.
type Table = Arc<(Vec<f32>, Vec<f32>)>;
/// (positions, head dim, θ's bits).
type Shape = (usize, usize, u64);
/// The table of the last shape asked for: every layer of a model asks for
/// the same one, and its f64 cos and sin cost more than the rotation.
static LAST: Mutex<Option<(Shape, Table)>> = Mutex::new(None);

fn cached_table(t: usize, hd: usize, theta: f64) -> Table {
    let key = (t, hd, theta.to_bits());
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    match &*last {
        Some((k, table)) if *k == key => table.clone(),
        _ => {
            let table = Arc::new(rope_table(t, hd, theta));
            *last = Some((key, table.clone()));
            table
        }
    }
}

/// Rotate `x[b, t, heads, hd]` in place (by the negative angles when
/// `inverse`: the backward).
pub fn rope(x: &mut [f32], b: usize, t: usize, heads: usize, hd: usize, theta: f64, inverse: bool) {
    let _k = super::profile::span(if inverse {
        "rope_backward"
    } else {
        "rope_forward"
    });
    let half = hd / 2;
    let table = cached_table(t, hd, theta);
    let (cos, sin) = (&table.0, &table.1);
    let sign = if inverse { -1.0f32 } else { 1.0 };
    let row = heads * hd;
    par::rows_mut(&mut x[..b * t * row], row, |r0, block| {
        for (k, tok) in block.chunks_exact_mut(row).enumerate() {
            let pos = (r0 + k) % t;
            let (c, s) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
            for head in tok.chunks_exact_mut(hd) {
                let (x1, x2) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, bb, si) = (x1[i], x2[i], sign * s[i]);
                    x1[i] = a * c[i] - bb * si;
                    x2[i] = bb * c[i] + a * si;
                }
            }
        }
    });
}

//! Reductions in a fixed order that vectorizes, for the kernels' row sums,
//! dot products and maxima: 16 interleaved partial results (lane `i` takes
//! elements `i`, `i + 16`, …), folded pairwise, then the tail in order. A
//! left-to-right sum is one serial chain of adds that no compiler may
//! reorder; this order is just as fixed (the same bits on every CPU and
//! thread count) and runs a vector's width at a time.

const LANES: usize = 16;

/// `a[0] op a[8]`, … halving to one value.
#[inline(always)]
fn fold(mut a: [f32; LANES], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            a[i] = op(a[i], a[i + w]);
        }
    }
    a[0]
}

/// `Σ f(a[j], b[j])` over the shorter slice's length.
#[inline(always)]
pub fn sum_zip(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (a[..n].chunks_exact(LANES), b[..n].chunks_exact(LANES));
    let (at, bt) = (a.remainder(), b.remainder());
    let mut acc = [0.0f32; LANES];
    for (x, y) in a.zip(b) {
        for i in 0..LANES {
            acc[i] += f(x[i], y[i]);
        }
    }
    let mut s = fold(acc, |p, q| p + q);
    for (&x, &y) in at.iter().zip(bt) {
        s += f(x, y);
    }
    s
}

/// `Σ f(a[j], b[j], c[j])` over the shortest slice's length.
#[inline(always)]
pub fn sum_zip3(a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32) -> f32 {
    let n = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (
        a[..n].chunks_exact(LANES),
        b[..n].chunks_exact(LANES),
        c[..n].chunks_exact(LANES),
    );
    let (at, bt, ct) = (a.remainder(), b.remainder(), c.remainder());
    let mut acc = [0.0f32; LANES];
    for ((x, y), z) in a.zip(b).zip(c) {
        for i in 0..LANES {
            acc[i] += f(x[i], y[i], z[i]);
        }
    }
    let mut s = fold(acc, |p, q| p + q);
    for ((&x, &y), &z) in at.iter().zip(bt).zip(ct) {
        s += f(x, y, z);
    }
    s
}

/// `Σ a[j]`.
#[inline(always)]
pub fn sum(a: &[f32]) -> f32 {
    sum_zip(a, a, |x, _| x)
}

/// `Σ a[j]·b[j]`.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    sum_zip(a, b, |x, y| x * y)
}

/// The largest element (−∞ for none; NaN-ignoring, as `f32::max`).
#[inline(always)]
pub fn max(a: &[f32]) -> f32 {
    let chunks = a.chunks_exact(LANES);
    let tail = chunks.remainder();
    let mut acc = [f32::NEG_INFINITY; LANES];
    for x in chunks {
        for i in 0..LANES {
            acc[i] = acc[i].max(x[i]);
        }
    }
    tail.iter().fold(fold(acc, f32::max), |m, &x| m.max(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against f64 sums of the same values, every length through two
    /// full lane blocks and a tail.
    #[test]
    fn sums_dots_and_maxima_match_a_plain_reference_at_every_length() {
        let a: Vec<f32> = (0..53)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173)
            .collect();
        let b: Vec<f32> = (0..53)
            .map(|i| ((i * 11 % 19) as f32 - 9.0) * 0.071)
            .collect();
        let c: Vec<f32> = (0..53).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.5).collect();
        for n in 0..=53 {
            let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
            let s: f64 = a.iter().map(|&x| x as f64).sum();
            let d: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
            let t: f64 = (0..n)
                .map(|j| a[j] as f64 * b[j] as f64 * c[j] as f64)
                .sum();
            assert!((sum(a) as f64 - s).abs() < 1e-5, "sum, n = {n}");
            assert!((dot(a, b) as f64 - d).abs() < 1e-5, "dot, n = {n}");
            assert!(
                (sum_zip3(a, b, c, |x, y, z| x * y * z) as f64 - t).abs() < 1e-5,
                "sum_zip3, n = {n}"
            );
            let m = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(a), m, "max, n = {n}");
        }
    }
}

//! Linear layers: `out[N,OC] = inp[N,C] · W[OC,C]ᵀ + b[OC]`, through the
//! `gemm` crate on the device's threads. gemm splits the output among its
//! threads and keeps each element's k-blocking (which depends on the shape
//! only), so results are bit-identical for every thread count (checked in
//! the kernel tests).

use super::par;
use gemm::{gemm, Parallelism};

/// gemm's threading in the calling kernel's pool.
fn parallelism() -> Parallelism {
    match par::threads() {
        1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// `dst[m,n] (+)= a[m,k] · b[k,n]`, every matrix given by (row stride, col
/// stride); `dst` row-major with row stride `dst_rs`.
#[allow(clippy::too_many_arguments)]
fn mm(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    b_rs: usize,
    b_cs: usize,
    parallelism: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst_rs >= n && dst.len() >= (m - 1) * dst_rs + n);
    if k == 0 {
        if !accumulate {
            for row in dst.chunks_mut(dst_rs).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: the strides describe matrices that lie inside the given slices
    // (checked by the callers' shape asserts), and `dst` does not alias them.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `out[n,oc] (+)= inp[n,c] · Wᵀ[c,oc]` (Wᵀ: row stride 1, column stride
/// c): the product of both forward linear layers.
#[allow(clippy::too_many_arguments)]
fn linear(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    oc: usize,
    accumulate: bool,
) {
    assert_eq!(inp.len(), n * c);
    assert_eq!(weight.len(), oc * c);
    assert_eq!(out.len(), n * oc);
    mm(
        n,
        oc,
        c,
        out,
        oc,
        accumulate,
        inp,
        c,
        1,
        weight,
        1,
        c,
        parallelism(),
    );
}

/// Forward: `out = inp · Wᵀ + bias`.
pub fn matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    let _k = super::profile::span("matmul_forward");
    linear(out, inp, weight, n, c, oc, false);
    if let Some(b) = bias {
        par::rows_mut(out, oc, |_, block| {
            for row in block.chunks_exact_mut(oc) {
                for (o, bb) in row.iter_mut().zip(b) {
                    *o += bb;
                }
            }
        });
    }
}

/// A linear layer onto a residual: `out = res + bias + inp · Wᵀ`. The
/// residual and the bias go in first (one pass), the GEMM accumulates onto
/// them in its epilogue, so neither the layer's output nor the residual sum
/// is a pass of its own.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward_residual(
    out: &mut [f32],
    res: &[f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    let _k = super::profile::span("matmul_forward_residual");
    assert_eq!(res.len(), n * oc);
    par::rows_mut(out, oc, |r0, block| {
        for (k, row) in block.chunks_exact_mut(oc).enumerate() {
            let x = &res[(r0 + k) * oc..][..oc];
            match bias {
                Some(bias) => {
                    for ((o, x), b) in row.iter_mut().zip(x).zip(bias) {
                        *o = x + b;
                    }
                }
                None => row.copy_from_slice(x),
            }
        }
    });
    linear(out, inp, weight, n, c, oc, true);
}

/// Backward for the input: `dinp (+)= dout · W`.
pub fn matmul_backward_input(
    dinp: &mut [f32],
    dout: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    oc: usize,
    accumulate: bool,
) {
    let _k = super::profile::span("matmul_backward_input");
    assert_eq!(dinp.len(), n * c);
    assert_eq!(dout.len(), n * oc);
    mm(
        n,
        c,
        oc,
        dinp,
        c,
        accumulate,
        dout,
        oc,
        1,
        weight,
        c,
        1,
        parallelism(),
    );
}

/// Backward for the weights: `dW += doutᵀ · inp`, `db += Σ_rows dout`.
pub fn matmul_backward_weight(
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    n: usize,
    c: usize,
    oc: usize,
) {
    let _k = super::profile::span("matmul_backward_weight");
    assert_eq!(dweight.len(), oc * c);
    // dW[oc,c] += doutᵀ[oc,n] · inp[n,c]  (doutᵀ: row stride 1, col stride oc)
    mm(
        oc,
        c,
        n,
        dweight,
        c,
        true,
        dout,
        1,
        oc,
        inp,
        c,
        1,
        parallelism(),
    );
    if let Some(db) = dbias {
        // By column, each summed over the rows in order.
        par::rows_mut_work(&mut db[..oc], 1, n, |j0, db| {
            for row in dout.chunks_exact(oc) {
                for (d, g) in db.iter_mut().zip(&row[j0..]) {
                    *d += g;
                }
            }
        });
    }
}

/// `dst[m,n] (+)= a[m,k] · b[k,n]` with `a` and `b` given by row and column
/// strides into their slices (attention reads heads out of the packed `qkv`)
/// and `dst` by its row stride, on the calling thread (attention runs its
/// heads in parallel instead).
#[allow(clippy::too_many_arguments)]
pub fn matmul_strided(
    m: usize,
    n: usize,
    k: usize,
    (dst, dst_rs): (&mut [f32], usize),
    accumulate: bool,
    a: &[f32],
    (a_rs, a_cs): (usize, usize),
    b: &[f32],
    (b_rs, b_cs): (usize, usize),
) {
    if m > 0 && n > 0 && k > 0 {
        assert!(
            (m - 1) * a_rs + (k - 1) * a_cs < a.len(),
            "lhs strides leave its slice"
        );
        assert!(
            (k - 1) * b_rs + (n - 1) * b_cs < b.len(),
            "rhs strides leave its slice"
        );
    }
    mm(
        m,
        n,
        k,
        dst,
        dst_rs,
        accumulate,
        a,
        a_rs,
        a_cs,
        b,
        b_rs,
        b_cs,
        Parallelism::None,
    );
}

/// `out[m,n] = a[m,k] · b[k,n]` for plain row-major matrices.
pub fn matmul_plain(out: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize) {
    mm(m, n, k, out, n, false, a, k, 1, b, n, 1, parallelism());
}

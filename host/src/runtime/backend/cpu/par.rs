//! How a kernel spreads over its device's threads (a rayon pool per device,
//! `TrainOptions::threads`). Work is split by *outputs* only: every output
//! element is computed by one thread, with the same operations in the same
//! order as on one thread, so results are bit-identical for every thread
//! count. Reductions across rows (weight gradients, the loss) are split by
//! column or summed afterwards in row order, never reordered.
//!
//! Each block runs through [`simd`], so the kernels' plain loops are
//! compiled for the widest vector instructions the CPU has.

use rayon::prelude::*;

/// Runs `f` in a context compiled for this CPU's widest vector
/// instructions (AVX-512 or AVX2 + FMA on x86-64, detected once; pulp's
/// dispatch), so the loops inlined into it vectorize beyond the baseline
/// target's SSE2. The same IEEE operations in the same order (Rust never
/// fuses a multiply and an add on its own), so the same bits on every CPU.
#[inline(always)]
pub fn simd<R>(f: impl FnOnce() -> R) -> R {
    pulp::Arch::new().dispatch(f)
}

/// Threads of the pool the calling kernel runs in (1: run inline).
pub fn threads() -> usize {
    rayon::current_num_threads()
}

/// Rows per task so that each thread gets a few tasks (load balance) and a
/// task is never tiny.
fn rows_per_task(rows: usize, width: usize) -> usize {
    let tasks = 4 * threads();
    let by_count = rows.div_ceil(tasks.max(1));
    // At least ~16 K floats of work per task.
    let by_size = (16 * 1024 / width.max(1)).max(1);
    by_count.max(by_size).max(1)
}

/// `f(first_row, block)` over blocks of whole rows of `out` (`width` floats
/// a row), in parallel when the pool has more than one thread.
pub fn rows_mut(out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    rows_mut_work(out, width, width, f)
}

/// [`rows_mut`] where each row costs `work` floats of reading and writing.
pub fn rows_mut_work(
    out: &mut [f32],
    width: usize,
    work: usize,
    f: impl Fn(usize, &mut [f32]) + Sync + Send,
) {
    let rows = out.len() / width.max(1);
    if threads() == 1 || rows <= 1 {
        simd(|| f(0, out));
        return;
    }
    let r = rows_per_task(rows, work);
    out.par_chunks_mut(r * width)
        .enumerate()
        .for_each(|(i, block)| simd(|| f(i * r, block)));
}

/// `f(first, a_block, b_block)` over matching blocks of two outputs, the
/// first `wa` floats per row, the second `wb`; `work` floats are read or
/// written per row (a column of a weight gradient reads every row).
pub fn rows_mut2(
    a: &mut [f32],
    wa: usize,
    b: &mut [f32],
    wb: usize,
    work: usize,
    f: impl Fn(usize, &mut [f32], &mut [f32]) + Sync + Send,
) {
    let rows = a.len() / wa.max(1);
    // Equal row counts, or the zip below would leave rows undone.
    assert_eq!(
        rows,
        b.len() / wb.max(1),
        "rows_mut2: outputs of different row counts"
    );
    if threads() == 1 || rows <= 1 {
        simd(|| f(0, a, b));
        return;
    }
    let r = rows_per_task(rows, work);
    a.par_chunks_mut(r * wa)
        .zip(b.par_chunks_mut(r * wb))
        .enumerate()
        .for_each(|(i, (x, y))| simd(|| f(i * r, x, y)));
}

/// Elementwise over equal-length slices: `f(offset, chunk)`.
pub fn elements_mut(out: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    rows_mut(out, 1, f)
}

/// `f(index, item)` for every item, in parallel when the pool allows.
pub fn each_mut<T: Send>(items: &mut [T], f: impl Fn(usize, &mut T) + Sync + Send) {
    if threads() == 1 {
        items
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| simd(|| f(i, x)));
    } else {
        items
            .par_iter_mut()
            .enumerate()
            .for_each(|(i, x)| simd(|| f(i, x)));
    }
}

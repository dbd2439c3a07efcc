//! One backend checked against another, kernel by kernel, on the same
//! inputs: every method of [`Backend`] runs on both with the same host
//! data (outputs that accumulate start from the same values), and its
//! outputs come back to the host to be compared. `piper backend check`
//! runs it with the CPU backend as the reference (`scripts/gpu-check.sh`
//! on a GPU machine; the CPU against itself on other thread counts here).
//!
//! A kernel's error is the largest `|got − want|` over the largest `|want|`
//! of each output tensor (relative to the tensor's scale, so a value near
//! zero after cancellation does not count as a large error), the worst over
//! its outputs.

use super::routing::{route, MoeDims};
use super::{AdamW, Backend, BackendError, Routing, SeqRows};
use crate::model::MoeConfig;

/// One kernel's comparison.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KernelCheck {
    pub kernel: &'static str,
    /// The shapes it ran at (`small`, `gpt2-small`).
    pub shape: &'static str,
    /// The worst relative error over its outputs.
    pub error: f64,
    pub tolerance: f64,
}

impl KernelCheck {
    pub fn passed(&self) -> bool {
        self.error <= self.tolerance
    }
}

/// Deterministic inputs in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

/// The largest `|a − b|` over the largest `|b|` (0 for two empty tensors).
pub fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()));
    if !diff.is_finite() || got.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    if scale == 0.0 {
        return diff;
    }
    diff / scale
}

/// A tensor on both backends from the same host values.
struct Pair<R: Backend, B: Backend> {
    r: R::Tensor,
    b: B::Tensor,
}

/// The two backends under comparison and the checks so far.
struct Bench<'a, R: Backend, B: Backend> {
    r: &'a R,
    b: &'a B,
    rs: R::Stream,
    bs: B::Stream,
    out: Vec<KernelCheck>,
    /// The shapes being checked, recorded with each kernel.
    shape: &'static str,
}

impl<'a, R: Backend, B: Backend> Bench<'a, R, B> {
    fn pair(&self, v: &[f32]) -> Result<Pair<R, B>, BackendError> {
        Ok(Pair {
            r: self.r.upload(v.to_vec())?,
            b: self.b.upload(v.to_vec())?,
        })
    }
    fn ids(&self, v: &[u32]) -> Result<(R::Ids, B::Ids), BackendError> {
        Ok((self.r.upload_ids(v)?, self.b.upload_ids(v)?))
    }
    /// Run `f` on each backend inside its stream.
    fn run(
        &self,
        fr: impl FnOnce(&R) + Send,
        fb: impl FnOnce(&B) + Send,
    ) -> Result<(), BackendError> {
        self.r.enter(&self.rs, None, || fr(self.r));
        self.b.enter(&self.bs, None, || fb(self.b));
        self.r.check()?;
        self.b.check()
    }
    /// Compare the given outputs and record the kernel's worst error.
    fn record(
        &mut self,
        kernel: &'static str,
        tolerance: f64,
        outs: &[&Pair<R, B>],
    ) -> Result<(), BackendError> {
        let mut error = 0f64;
        for p in outs {
            let want = self.r.download(&p.r)?;
            let got = self.b.download(&p.b)?;
            error = error.max(relative_error(&got, &want));
        }
        self.out.push(KernelCheck {
            kernel,
            shape: self.shape,
            error,
            tolerance,
        });
        Ok(())
    }
    fn record_value(&mut self, kernel: &'static str, tolerance: f64, got: f64, want: f64) {
        let error = if want == 0.0 {
            (got - want).abs()
        } else {
            ((got - want) / want).abs()
        };
        self.out.push(KernelCheck {
            kernel,
            shape: self.shape,
            error: if error.is_finite() {
                error
            } else {
                f64::INFINITY
            },
            tolerance,
        });
    }
}

/// fp32 kernels whose arithmetic matches operation for operation up to the
/// order of their sums.
const FP32: f64 = 1e-5;

/// Check every kernel of `b` against `reference` on shapes that cover
/// partial blocks and rows longer than a block.
pub fn kernels<R: Backend, B: Backend>(
    reference: &R,
    b: &B,
) -> Result<Vec<KernelCheck>, BackendError> {
    let mut k = Bench {
        r: reference,
        b,
        rs: reference.stream()?,
        bs: b.stream()?,
        out: Vec::new(),
        shape: "small",
    };
    let mut rng = Rng(0x5eed);
    // Shapes: 2 sequences of 70 tokens, d_model 96 (4 heads of 24), a
    // vocabulary of 300, a linear layer of 96 -> 288 (partial blocks, rows
    // longer than a block); then gpt2-small's widths (one sequence of 1024,
    // d_model 768 in 12 heads, the MLP's 3072; a 4096-token vocabulary),
    // whose reductions loop where the small shapes do not.
    let (bb, t, c, v) = (2usize, 70usize, 96usize, 300usize);
    let n = bb * t;
    dense_kernels(&mut k, &mut rng, (bb, t, c, 4, v, 288))?;
    k.shape = "gpt2-small";
    dense_kernels(&mut k, &mut rng, (1, 1024, 768, 12, 4096, 3072))?;
    k.shape = "small";

    moe_kernels(&mut k, &mut rng, n, t, c)?;

    // Optimizer and the norm.
    let len = 5000;
    let (mut p, mut m, mut vv) = (
        k.pair(&rng.vec(len, 1.0))?,
        k.pair(&rng.vec(len, 0.01))?,
        k.pair(
            &rng.vec(len, 0.01)
                .iter()
                .map(|x| x.abs())
                .collect::<Vec<_>>(),
        )?,
    );
    let grad = k.pair(&rng.vec(len, 1.0))?;
    let h = AdamW::default();
    k.run(
        |r| {
            r.adamw(
                &mut p.r,
                &grad.r,
                &mut m.r,
                &mut vv.r,
                100..4100,
                &h,
                3,
                0.7,
                true,
            )
        },
        |g| {
            g.adamw(
                &mut p.b,
                &grad.b,
                &mut m.b,
                &mut vv.b,
                100..4100,
                &h,
                3,
                0.7,
                true,
            )
        },
    )?;
    k.record("adamw", FP32, &[&p, &m, &vv])?;
    let want = reference.sum_squares(&[(&grad.r, 0..len), (&p.r, 7..4007)])?;
    let got = b.sum_squares(&[(&grad.b, 0..len), (&p.b, 7..4007)])?;
    k.record_value("sum_squares", 1e-12, got, want);

    // Storage.
    let mut dst = k.pair(&rng.vec(len, 1.0))?;
    let host = rng.vec(300, 1.0);
    k.run(
        |r| {
            r.copy(&mut dst.r, 10, &grad.r, 500..900);
            r.write(&mut dst.r, 1000, &host);
            r.add_host(&mut dst.r, 2000, &host);
            r.add(&mut dst.r, &p.r);
        },
        |g| {
            g.copy(&mut dst.b, 10, &grad.b, 500..900);
            g.write(&mut dst.b, 1000, &host);
            g.add_host(&mut dst.b, 2000, &host);
            g.add(&mut dst.b, &p.b);
        },
    )?;
    k.record("copy, write, add_host, add", FP32, &[&dst])?;
    let part_r = reference.download_range(&dst.r, 990..1400)?;
    let part_b = b.download_range(&dst.b, 990..1400)?;
    k.record_value("download_range", 0.0, relative_error(&part_b, &part_r), 0.0);
    let dup = Pair::<R, B> {
        r: reference.duplicate(&dst.r)?,
        b: b.duplicate(&dst.b)?,
    };
    k.run(|r| r.fill_zero(&mut dst.r), |g| g.fill_zero(&mut dst.b))?;
    k.record("duplicate", 0.0, &[&dup])?;
    k.record("fill_zero", 0.0, &[&dst])?;
    bf16_storage(&mut k, &mut rng)?;
    llama_kernels(&mut k, &mut rng, (bb, t, c, v))?;
    Ok(k.out)
}

/// Outputs stored in bf16 from fp32 arithmetic that agrees up to the order
/// of its sums: a value near a rounding boundary may round one way on one
/// backend and the other way on the other, one bf16 step (2⁻⁸ relative).
const BF16: f64 = 1e-2;

/// bf16 storage: casts to bf16 round to nearest, ties to even (the same
/// bits on both backends, ties, signed zero and subnormals included), casts
/// back are exact, copies between dtypes land at their offsets, host writes
/// and adds into bf16 round; kernels on bf16 operands (a linear layer with
/// its bias, GELU) compute in fp32 and round their stores.
fn bf16_storage<R: Backend, B: Backend>(
    k: &mut Bench<'_, R, B>,
    rng: &mut Rng,
) -> Result<(), BackendError> {
    use crate::model::Dtype::{Bf16, F32};
    let len = 3000;
    let mut v = rng.vec(len, 3.0);
    // A tie that rounds to even (down), one that rounds up, -0, a
    // subnormal, a large value.
    v[..5].copy_from_slice(&[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -0.0, 1e-40, 3.0e38]);
    let x = k.pair(&v)?;
    let (r, b) = (k.r, k.b);
    let xb = Pair::<R, B> {
        r: r.cast(&x.r, Bf16)?,
        b: b.cast(&x.b, Bf16)?,
    };
    k.record("cast to bf16", 0.0, &[&xb])?;
    let (want, got) = (r.download(&xb.r)?, b.download(&xb.b)?);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let same_bits = bits(&want) == bits(&got) && want[0] == 1.0 && want[1] == 1.0 + 4.0 / 256.0;
    k.record_value(
        "bf16 rounding bits",
        0.0,
        f64::from(u8::from(!same_bits)),
        0.0,
    );
    k.record_value(
        "bf16 dtype and bytes",
        0.0,
        (B::bytes(&xb.b) * u64::from(B::dtype(&xb.b) == Bf16)) as f64,
        (R::bytes(&xb.r) * u64::from(R::dtype(&xb.r) == Bf16)) as f64,
    );
    let back = Pair::<R, B> {
        r: r.cast(&xb.r, F32)?,
        b: b.cast(&xb.b, F32)?,
    };
    k.record("cast back to fp32", 0.0, &[&back])?;
    let host = rng.vec(300, 1.0);
    let mut d32 = k.pair(&rng.vec(len, 1.0))?;
    let mut d16 = Pair::<R, B> {
        r: r.zeros_as(len, Bf16)?,
        b: b.zeros_as(len, Bf16)?,
    };
    k.run(
        |r| {
            r.copy(&mut d32.r, 7, &xb.r, 100..900);
            r.copy(&mut d16.r, 11, &x.r, 50..1050);
            r.write(&mut d16.r, 1500, &host);
            r.add_host(&mut d16.r, 2000, &host);
            r.add(&mut d16.r, &d32.r);
        },
        |g| {
            g.copy(&mut d32.b, 7, &xb.b, 100..900);
            g.copy(&mut d16.b, 11, &x.b, 50..1050);
            g.write(&mut d16.b, 1500, &host);
            g.add_host(&mut d16.b, 2000, &host);
            g.add(&mut d16.b, &d32.b);
        },
    )?;
    k.record("bf16 copies, writes and adds", 0.0, &[&d32, &d16])?;
    // A linear layer 96 -> 288 over 140 rows, then GELU, all in bf16.
    let (n, c, oc) = (140usize, 96usize, 288usize);
    let narrow = |k: &Bench<'_, R, B>, v: Vec<f32>| -> Result<Pair<R, B>, BackendError> {
        Ok(Pair {
            r: k.r.upload_as(v.clone(), Bf16)?,
            b: k.b.upload_as(v, Bf16)?,
        })
    };
    let inp = narrow(k, rng.vec(n * c, 1.0))?;
    let w = narrow(k, rng.vec(oc * c, 0.1))?;
    let bias = narrow(k, rng.vec(oc, 0.1))?;
    let mut out = narrow(k, vec![0.0; n * oc])?;
    let mut act = narrow(k, vec![0.0; n * oc])?;
    k.run(
        |r| {
            r.matmul_forward(&mut out.r, &inp.r, &w.r, Some(&bias.r), n, c, oc);
            r.gelu_forward(&mut act.r, &out.r);
        },
        |g| {
            g.matmul_forward(&mut out.b, &inp.b, &w.b, Some(&bias.b), n, c, oc);
            g.gelu_forward(&mut act.b, &out.b);
        },
    )?;
    k.record("bf16 linear and GELU", BF16, &[&out, &act])?;
    // Its backward: the input's gradient in bf16, the weight's and bias's
    // in fp32 (fp32 reductions), from bf16 operands.
    let dout = narrow(k, rng.vec(n * oc, 1.0))?;
    let mut dinp = narrow(k, vec![0.0; n * c])?;
    let (mut dw, mut db) = (k.pair(&vec![0.0; oc * c])?, k.pair(&vec![0.0; oc])?);
    k.run(
        |r| {
            r.matmul_backward_input(&mut dinp.r, &dout.r, &w.r, n, c, oc, false);
            r.matmul_backward_weight(&mut dw.r, Some(&mut db.r), &dout.r, &inp.r, n, c, oc);
        },
        |g| {
            g.matmul_backward_input(&mut dinp.b, &dout.b, &w.b, n, c, oc, false);
            g.matmul_backward_weight(&mut dw.b, Some(&mut db.b), &dout.b, &inp.b, n, c, oc);
        },
    )?;
    k.record("bf16 linear backward input", BF16, &[&dinp])?;
    k.record("bf16 linear backward weight", 1e-4, &[&dw, &db])
}

/// Context parallelism's ring on rank 1 of 2 (its rows `held`): a forward
/// over its own block then rank 0's (whose keys at 0..17 every held row
/// sees and whose keys at 51..68 none does), and the backward through both.
fn ring_steps<R: Backend, B: Backend>(
    k: &mut Bench<'_, R, B>,
    rng: &mut Rng,
    (bb, c, nh): (usize, usize, usize),
    held: SeqRows,
) -> Result<(), BackendError> {
    let other = SeqRows::balanced(held.chunk * 4, 2, 0);
    let (tr, tk) = (held.len(), other.len());
    let q = k.pair(&rng.vec(bb * tr * 3 * c, 1.0))?;
    let own = k.pair(&rng.vec(bb * tr * 3 * c, 1.0))?;
    let theirs = k.pair(&rng.vec(bb * tk * 3 * c, 1.0))?;
    let (mut out, mut lse) = (
        k.pair(&vec![0.0; bb * tr * c])?,
        k.pair(&vec![0.0; bb * nh * tr])?,
    );
    k.run(
        |r| {
            r.flash_ring_forward(
                &mut out.r,
                &mut lse.r,
                &q.r,
                &own.r,
                bb,
                c,
                nh,
                (held, held),
                true,
            );
            let step = (held, other);
            r.flash_ring_forward(
                &mut out.r, &mut lse.r, &q.r, &theirs.r, bb, c, nh, step, false,
            );
        },
        |g| {
            g.flash_ring_forward(
                &mut out.b,
                &mut lse.b,
                &q.b,
                &own.b,
                bb,
                c,
                nh,
                (held, held),
                true,
            );
            let step = (held, other);
            g.flash_ring_forward(
                &mut out.b, &mut lse.b, &q.b, &theirs.b, bb, c, nh, step, false,
            );
        },
    )?;
    k.record("flash_ring_forward (2 steps)", FP32, &[&out, &lse])?;
    let dout = k.pair(&rng.vec(bb * tr * c, 0.5))?;
    let mut dq = k.pair(&vec![0.0; bb * tr * 3 * c])?;
    let mut d_own = k.pair(&vec![0.0; bb * tr * 3 * c])?;
    let mut d_theirs = k.pair(&vec![0.0; bb * tk * 3 * c])?;
    k.run(
        |r| {
            let kept = (&out.r, &lse.r);
            let steps = [
                (&own.r, &mut d_own.r, held),
                (&theirs.r, &mut d_theirs.r, other),
            ];
            for (kv, dkv, rows) in steps {
                let step = (held, rows);
                r.flash_ring_backward(
                    &mut dq.r, dkv, &dout.r, &q.r, kv, kept.0, kept.1, bb, c, nh, step,
                );
            }
        },
        |g| {
            let kept = (&out.b, &lse.b);
            let steps = [
                (&own.b, &mut d_own.b, held),
                (&theirs.b, &mut d_theirs.b, other),
            ];
            for (kv, dkv, rows) in steps {
                let step = (held, rows);
                g.flash_ring_backward(
                    &mut dq.b, dkv, &dout.b, &q.b, kv, kept.0, kept.1, bb, c, nh, step,
                );
            }
        },
    )?;
    k.record(
        "flash_ring_backward (2 steps)",
        FP32,
        &[&dq, &d_own, &d_theirs],
    )
}

/// Shapes of the dense checks: `(sequences, tokens, d_model, heads,
/// vocabulary, linear width)`.
type DenseShape = (usize, usize, usize, usize, usize, usize);

/// The dense kernels (embedding, layernorm, linear layers, attention, GELU,
/// residual, cross-entropy) at `shape`.
fn dense_kernels<R: Backend, B: Backend>(
    k: &mut Bench<'_, R, B>,
    rng: &mut Rng,
    shape: DenseShape,
) -> Result<(), BackendError> {
    let inputs = embedding_and_norm_kernels(k, rng, shape)?;
    layer_kernels(k, rng, shape, inputs)
}

/// An output gradient, an activation and a norm gain the later checks share.
type Shared<R, B> = (Pair<R, B>, Pair<R, B>, Pair<R, B>);

/// The embedding and layernorm; gives the output gradient, the norm's
/// input and its gain for the checks after them.
fn embedding_and_norm_kernels<R: Backend, B: Backend>(
    k: &mut Bench<'_, R, B>,
    rng: &mut Rng,
    shape: DenseShape,
) -> Result<Shared<R, B>, BackendError> {
    let (bb, t, c, _, v, _) = shape;
    let n = bb * t;

    // Embedding.
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 5) % v as u32).collect();
    let (tr, tb) = k.ids(&tokens)?;
    let wte = k.pair(&rng.vec(v * c, 0.5))?;
    let wpe = k.pair(&rng.vec(t * c, 0.5))?;
    let mut emb = k.pair(&vec![0.0; n * c])?;
    k.run(
        |r| r.embedding_forward(&mut emb.r, &tr, &wte.r, Some(&wpe.r), bb, t, c),
        |g| g.embedding_forward(&mut emb.b, &tb, &wte.b, Some(&wpe.b), bb, t, c),
    )?;
    k.record("embedding_forward", FP32, &[&emb])?;
    let dout = k.pair(&rng.vec(n * c, 1.0))?;
    let mut dwte = k.pair(&rng.vec(v * c, 0.1))?;
    let mut dwpe = k.pair(&rng.vec(t * c, 0.1))?;
    k.run(
        |r| r.embedding_backward_weight(&mut dwte.r, Some(&mut dwpe.r), &dout.r, &tr, bb, t, c),
        |g| g.embedding_backward_weight(&mut dwte.b, Some(&mut dwpe.b), &dout.b, &tb, bb, t, c),
    )?;
    k.record("embedding_backward_weight", FP32, &[&dwte, &dwpe])?;

    // LayerNorm.
    let x = k.pair(&rng.vec(n * c, 2.0))?;
    let w = k.pair(&rng.vec(c, 1.0))?;
    let bias = k.pair(&rng.vec(c, 1.0))?;
    let (mut ln, mut mean, mut rstd) = (
        k.pair(&vec![0.0; n * c])?,
        k.pair(&vec![0.0; n])?,
        k.pair(&vec![0.0; n])?,
    );
    k.run(
        |r| {
            r.layernorm_forward(
                &mut ln.r,
                &mut mean.r,
                &mut rstd.r,
                &x.r,
                &w.r,
                &bias.r,
                n,
                c,
            )
        },
        |g| {
            g.layernorm_forward(
                &mut ln.b,
                &mut mean.b,
                &mut rstd.b,
                &x.b,
                &w.b,
                &bias.b,
                n,
                c,
            )
        },
    )?;
    k.record("layernorm_forward", FP32, &[&ln, &mean, &rstd])?;
    let mut dx = k.pair(&rng.vec(n * c, 0.5))?;
    k.run(
        |r| r.layernorm_backward_input(&mut dx.r, &dout.r, &x.r, &w.r, &mean.r, &rstd.r, n, c),
        |g| g.layernorm_backward_input(&mut dx.b, &dout.b, &x.b, &w.b, &mean.b, &rstd.b, n, c),
    )?;
    k.record("layernorm_backward_input", FP32, &[&dx])?;
    let (mut dw, mut db) = (k.pair(&rng.vec(c, 0.1))?, k.pair(&rng.vec(c, 0.1))?);
    k.run(
        |r| {
            r.layernorm_backward_weight(&mut dw.r, &mut db.r, &dout.r, &x.r, &mean.r, &rstd.r, n, c)
        },
        |g| {
            g.layernorm_backward_weight(&mut dw.b, &mut db.b, &dout.b, &x.b, &mean.b, &rstd.b, n, c)
        },
    )?;
    k.record("layernorm_backward_weight", FP32, &[&dw, &db])?;
    Ok((dout, x, w))
}

/// Linear layers, attention, the elementwise kernels and the loss.
fn layer_kernels<R: Backend, B: Backend>(
    k: &mut Bench<'_, R, B>,
    rng: &mut Rng,
    shape: DenseShape,
    (dout, x, w): Shared<R, B>,
) -> Result<(), BackendError> {
    let (bb, t, c, nh, v, oc) = shape;
    let n = bb * t;

    // Linear layers.
    let lw = k.pair(&rng.vec(oc * c, 0.2))?;
    let lb = k.pair(&rng.vec(oc, 0.5))?;
    let mut y = k.pair(&vec![0.0; n * oc])?;
    k.run(
        |r| r.matmul_forward(&mut y.r, &x.r, &lw.r, Some(&lb.r), n, c, oc),
        |g| g.matmul_forward(&mut y.b, &x.b, &lw.b, Some(&lb.b), n, c, oc),
    )?;
    k.record("matmul_forward", FP32, &[&y])?;
    let res = k.pair(&rng.vec(n * oc, 1.0))?;
    let mut yr = k.pair(&vec![0.0; n * oc])?;
    k.run(
        |r| r.matmul_forward_residual(&mut yr.r, &res.r, &x.r, &lw.r, Some(&lb.r), n, c, oc),
        |g| g.matmul_forward_residual(&mut yr.b, &res.b, &x.b, &lw.b, Some(&lb.b), n, c, oc),
    )?;
    k.record("matmul_forward_residual", FP32, &[&yr])?;
    let dy = k.pair(&rng.vec(n * oc, 1.0))?;
    let mut dinp = k.pair(&rng.vec(n * c, 0.5))?;
    k.run(
        |r| r.matmul_backward_input(&mut dinp.r, &dy.r, &lw.r, n, c, oc, true),
        |g| g.matmul_backward_input(&mut dinp.b, &dy.b, &lw.b, n, c, oc, true),
    )?;
    k.record("matmul_backward_input", FP32, &[&dinp])?;
    let (mut dlw, mut dlb) = (k.pair(&rng.vec(oc * c, 0.1))?, k.pair(&rng.vec(oc, 0.1))?);
    k.run(
        |r| r.matmul_backward_weight(&mut dlw.r, Some(&mut dlb.r), &dy.r, &x.r, n, c, oc),
        |g| g.matmul_backward_weight(&mut dlw.b, Some(&mut dlb.b), &dy.b, &x.b, n, c, oc),
    )?;
    k.record("matmul_backward_weight", FP32, &[&dlw, &dlb])?;
    let mut yb = k.pair(&rng.vec(n * oc, 1.0))?;
    k.run(
        |r| r.add_bias(&mut yb.r, &lb.r, oc),
        |g| g.add_bias(&mut yb.b, &lb.b, oc),
    )?;
    k.record("add_bias", FP32, &[&yb])?;

    // Attention (a causal softmax over rows longer than a block: t = 70).
    let qkv = k.pair(&rng.vec(n * 3 * c, 1.0))?;
    let (mut att_out, mut att) = (
        k.pair(&vec![0.0; n * c])?,
        k.pair(&vec![0.0; bb * nh * t * t])?,
    );
    k.run(
        |r| r.attention_forward(&mut att_out.r, &mut att.r, &qkv.r, bb, t, c, nh),
        |g| g.attention_forward(&mut att_out.b, &mut att.b, &qkv.b, bb, t, c, nh),
    )?;
    k.record("attention_forward", FP32, &[&att_out, &att])?;
    let mut dqkv = k.pair(&rng.vec(n * 3 * c, 0.5))?;
    k.run(
        |r| r.attention_backward(&mut dqkv.r, &dout.r, &qkv.r, &att.r, bb, t, c, nh),
        |g| g.attention_backward(&mut dqkv.b, &dout.b, &qkv.b, &att.b, bb, t, c, nh),
    )?;
    k.record("attention_backward", FP32, &[&dqkv])?;
    // The memory-efficient kernel on the same inputs (the CPU's tiles of
    // 64 queries: t = 70 crosses one).
    let (mut fl_out, mut lse) = (k.pair(&vec![0.0; n * c])?, k.pair(&vec![0.0; bb * nh * t])?);
    let all = SeqRows::all(t);
    k.run(
        |r| r.flash_attention_forward(&mut fl_out.r, &mut lse.r, &qkv.r, bb, t, c, nh, all),
        |g| g.flash_attention_forward(&mut fl_out.b, &mut lse.b, &qkv.b, bb, t, c, nh, all),
    )?;
    k.record("flash_attention_forward", FP32, &[&fl_out, &lse])?;
    let mut fl_dqkv = k.pair(&rng.vec(n * 3 * c, 0.5))?;
    k.run(
        |r| {
            r.flash_attention_backward(
                &mut fl_dqkv.r,
                &dout.r,
                &qkv.r,
                &fl_out.r,
                &lse.r,
                bb,
                t,
                c,
                nh,
                all,
            )
        },
        |g| {
            g.flash_attention_backward(
                &mut fl_dqkv.b,
                &dout.b,
                &qkv.b,
                &fl_out.b,
                &lse.b,
                bb,
                t,
                c,
                nh,
                all,
            )
        },
    )?;
    k.record("flash_attention_backward", FP32, &[&fl_dqkv])?;
    // Context parallelism's chunks: rank 1 of 2 holds positions 17..34
    // and 34..51 of t = 70 (chunks of 17; rank 0 holds 0..17 and 51..68).
    let held = SeqRows::balanced(68, 2, 1);
    let tr = held.len();
    let (mut cp_out, mut cp_lse) = (
        k.pair(&vec![0.0; bb * tr * c])?,
        k.pair(&vec![0.0; bb * nh * tr])?,
    );
    k.run(
        |r| r.flash_attention_forward(&mut cp_out.r, &mut cp_lse.r, &qkv.r, bb, t, c, nh, held),
        |g| g.flash_attention_forward(&mut cp_out.b, &mut cp_lse.b, &qkv.b, bb, t, c, nh, held),
    )?;
    k.record(
        "flash_attention_forward (chunks)",
        FP32,
        &[&cp_out, &cp_lse],
    )?;
    let cp_dout = k.pair(&rng.vec(bb * tr * c, 0.5))?;
    let mut cp_dqkv = k.pair(&rng.vec(n * 3 * c, 0.5))?;
    k.run(
        |r| {
            let kept = (&cp_out.r, &cp_lse.r);
            r.flash_attention_backward(
                &mut cp_dqkv.r,
                &cp_dout.r,
                &qkv.r,
                kept.0,
                kept.1,
                bb,
                t,
                c,
                nh,
                held,
            )
        },
        |g| {
            let kept = (&cp_out.b, &cp_lse.b);
            g.flash_attention_backward(
                &mut cp_dqkv.b,
                &cp_dout.b,
                &qkv.b,
                kept.0,
                kept.1,
                bb,
                t,
                c,
                nh,
                held,
            )
        },
    )?;
    k.record("flash_attention_backward (chunks)", FP32, &[&cp_dqkv])?;
    ring_steps(k, rng, (bb, c, nh), held)?;

    // Elementwise.
    let mut ge = k.pair(&vec![0.0; n * c])?;
    k.run(
        |r| r.gelu_forward(&mut ge.r, &x.r),
        |g| g.gelu_forward(&mut ge.b, &x.b),
    )?;
    k.record("gelu_forward", FP32, &[&ge])?;
    let (mut pre, mut post) = (k.pair(&rng.vec(n * c, 2.0))?, k.pair(&vec![0.0; n * c])?);
    k.run(
        |r| r.bias_gelu_forward(&mut pre.r, &mut post.r, &w.r, c),
        |g| g.bias_gelu_forward(&mut pre.b, &mut post.b, &w.b, c),
    )?;
    k.record("bias_gelu_forward", FP32, &[&pre, &post])?;
    let mut dge = k.pair(&rng.vec(n * c, 0.5))?;
    k.run(
        |r| r.gelu_backward(&mut dge.r, &x.r, &dout.r),
        |g| g.gelu_backward(&mut dge.b, &x.b, &dout.b),
    )?;
    k.record("gelu_backward", FP32, &[&dge])?;
    let mut sum = k.pair(&vec![0.0; n * c])?;
    k.run(
        |r| r.residual_forward(&mut sum.r, &x.r, &dout.r),
        |g| g.residual_forward(&mut sum.b, &x.b, &dout.b),
    )?;
    k.record("residual_forward", FP32, &[&sum])?;

    // Loss.
    let logits = k.pair(&rng.vec(n * v, 4.0))?;
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 53 + 1) % v as u32).collect();
    let (gr, gb) = k.ids(&targets)?;
    let mut probs = k.pair(&vec![0.0; n * v])?;
    let (mut lr_, mut lb_) = (None, None);
    k.run(
        |r| lr_ = Some(r.crossentropy_forward(&mut probs.r, &logits.r, &gr, n, v)),
        |g| lb_ = Some(g.crossentropy_forward(&mut probs.b, &logits.b, &gb, n, v)),
    )?;
    k.record("crossentropy_forward", FP32, &[&probs])?;
    let want = k.r.read_scalar(lr_.expect("ran"))?;
    let got = k.b.read_scalar(lb_.expect("ran"))?;
    k.record_value("crossentropy_forward loss", FP32, got, want);
    let mut dlogits = k.pair(&vec![0.0; n * v])?;
    let scale = 1.0 / n as f32;
    k.run(
        |r| r.crossentropy_backward(&mut dlogits.r, &probs.r, &gr, n, v, scale),
        |g| g.crossentropy_backward(&mut dlogits.b, &probs.b, &gb, n, v, scale),
    )?;
    k.record("crossentropy_backward", FP32, &[&dlogits])?;

    Ok(())
}

/// The Llama family's kernels: RMSNorm, the embedding without positions,
/// RoPE, grouped-query packing (8 query heads of 12 over 2 kv heads),
/// SwiGLU, a linear layer onto the residual without bias.
fn llama_kernels<R: Backend, B: Backend>(
    k: &mut Bench<'_, R, B>,
    rng: &mut Rng,
    (bb, t, c, v): (usize, usize, usize, usize),
) -> Result<(), BackendError> {
    let n = bb * t;
    let (nh, kvh, hd, hid) = (8usize, 2usize, 12usize, 200usize);
    let (qw, kvw) = (nh * hd, kvh * hd);
    let x = k.pair(&rng.vec(n * c, 2.0))?;
    let w = k.pair(&rng.vec(c, 1.0))?;
    let dout = k.pair(&rng.vec(n * c, 1.0))?;
    let (mut y, mut rstd) = (k.pair(&vec![0.0; n * c])?, k.pair(&vec![0.0; n])?);
    k.run(
        |r| r.rmsnorm_forward(&mut y.r, &mut rstd.r, &x.r, &w.r, n, c, 1e-6),
        |g| g.rmsnorm_forward(&mut y.b, &mut rstd.b, &x.b, &w.b, n, c, 1e-6),
    )?;
    k.record("rmsnorm_forward", FP32, &[&y, &rstd])?;
    let mut dx = k.pair(&rng.vec(n * c, 0.5))?;
    k.run(
        |r| r.rmsnorm_backward_input(&mut dx.r, &dout.r, &x.r, &w.r, &rstd.r, n, c),
        |g| g.rmsnorm_backward_input(&mut dx.b, &dout.b, &x.b, &w.b, &rstd.b, n, c),
    )?;
    k.record("rmsnorm_backward_input", FP32, &[&dx])?;
    let mut dw = k.pair(&rng.vec(c, 0.1))?;
    k.run(
        |r| r.rmsnorm_backward_weight(&mut dw.r, &dout.r, &x.r, &rstd.r, n, c),
        |g| g.rmsnorm_backward_weight(&mut dw.b, &dout.b, &x.b, &rstd.b, n, c),
    )?;
    k.record("rmsnorm_backward_weight", FP32, &[&dw])?;

    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 53 + 7) % v as u32).collect();
    let (tr, tb) = k.ids(&tokens)?;
    let wte = k.pair(&rng.vec(v * c, 0.5))?;
    let mut emb = k.pair(&vec![0.0; n * c])?;
    k.run(
        |r| r.embedding_forward(&mut emb.r, &tr, &wte.r, None, bb, t, c),
        |g| g.embedding_forward(&mut emb.b, &tb, &wte.b, None, bb, t, c),
    )?;
    k.record("embedding_forward without positions", 0.0, &[&emb])?;
    let mut dwte = k.pair(&rng.vec(v * c, 0.1))?;
    k.run(
        |r| r.embedding_backward_weight(&mut dwte.r, None, &dout.r, &tr, bb, t, c),
        |g| g.embedding_backward_weight(&mut dwte.b, None, &dout.b, &tb, bb, t, c),
    )?;
    k.record(
        "embedding_backward_weight without positions",
        FP32,
        &[&dwte],
    )?;

    let mut q = k.pair(&rng.vec(n * qw, 1.0))?;
    k.run(
        |r| r.rope(&mut q.r, bb, t, nh, hd, 500_000.0, false),
        |g| g.rope(&mut q.b, bb, t, nh, hd, 500_000.0, false),
    )?;
    k.record("rope", FP32, &[&q])?;
    k.run(
        |r| r.rope(&mut q.r, bb, t, nh, hd, 500_000.0, true),
        |g| g.rope(&mut q.b, bb, t, nh, hd, 500_000.0, true),
    )?;
    k.record("rope inverse", FP32, &[&q])?;
    let (kk, vv) = (
        k.pair(&rng.vec(n * kvw, 1.0))?,
        k.pair(&rng.vec(n * kvw, 1.0))?,
    );
    let mut qkv = k.pair(&vec![0.0; n * 3 * qw])?;
    k.run(
        |r| r.qkv_pack(&mut qkv.r, &q.r, &kk.r, &vv.r, n, nh, kvh, hd),
        |g| g.qkv_pack(&mut qkv.b, &q.b, &kk.b, &vv.b, n, nh, kvh, hd),
    )?;
    k.record("qkv_pack", 0.0, &[&qkv])?;
    let (mut dq, mut dk, mut dv) = (
        k.pair(&rng.vec(n * qw, 0.5))?,
        k.pair(&rng.vec(n * kvw, 0.5))?,
        k.pair(&rng.vec(n * kvw, 0.5))?,
    );
    k.run(
        |r| r.qkv_unpack_backward(&mut dq.r, &mut dk.r, &mut dv.r, &qkv.r, n, nh, kvh, hd),
        |g| g.qkv_unpack_backward(&mut dq.b, &mut dk.b, &mut dv.b, &qkv.b, n, nh, kvh, hd),
    )?;
    k.record("qkv_unpack_backward", FP32, &[&dq, &dk, &dv])?;

    let gate = k.pair(&rng.vec(n * hid, 8.0))?;
    let up = k.pair(&rng.vec(n * hid, 1.0))?;
    let dact = k.pair(&rng.vec(n * hid, 1.0))?;
    let mut act = k.pair(&vec![0.0; n * hid])?;
    k.run(
        |r| r.swiglu_forward(&mut act.r, &gate.r, &up.r),
        |g| g.swiglu_forward(&mut act.b, &gate.b, &up.b),
    )?;
    k.record("swiglu_forward", FP32, &[&act])?;
    let (mut dg, mut du) = (
        k.pair(&rng.vec(n * hid, 0.5))?,
        k.pair(&rng.vec(n * hid, 0.5))?,
    );
    k.run(
        |r| r.swiglu_backward(&mut dg.r, &mut du.r, &gate.r, &up.r, &dact.r),
        |g| g.swiglu_backward(&mut dg.b, &mut du.b, &gate.b, &up.b, &dact.b),
    )?;
    k.record("swiglu_backward", FP32, &[&dg, &du])?;

    let lw = k.pair(&rng.vec(c * hid, 0.2))?;
    let res = k.pair(&rng.vec(n * c, 1.0))?;
    let mut yr = k.pair(&vec![0.0; n * c])?;
    k.run(
        |r| r.matmul_forward_residual(&mut yr.r, &res.r, &act.r, &lw.r, None, n, hid, c),
        |g| g.matmul_forward_residual(&mut yr.b, &res.b, &act.b, &lw.b, None, n, hid, c),
    )?;
    k.record("matmul_forward_residual without bias", FP32, &[&yr])
}

/// The mixture-of-experts kernels on one layer's routing: 4 experts, top-2,
/// capacity that drops some choices.
fn moe_kernels<R: Backend, B: Backend>(
    k: &mut Bench<'_, R, B>,
    rng: &mut Rng,
    n: usize,
    t: usize,
    c: usize,
) -> Result<(), BackendError> {
    let mut cfg = MoeConfig::new(4, 2);
    cfg.capacity_factor = Some(0.9);
    let d = MoeDims::new(&cfg, n, t, c);
    let e = d.e;
    let logits = k.pair(&rng.vec(n * e, 3.0))?;
    let mut probs = k.pair(&vec![0.0; n * e])?;
    k.run(
        |r| r.softmax_rows(&mut probs.r, &logits.r, e),
        |g| g.softmax_rows(&mut probs.b, &logits.b, e),
    )?;
    k.record("softmax_rows", FP32, &[&probs])?;
    // One routing for both (the reference's probabilities).
    let routing: Routing = route(&k.r.download(&probs.r)?, d, cfg.capacity_factor);
    let src = k.pair(&rng.vec(n * c, 1.0))?;
    let rows: usize = routing.rows.iter().map(Vec::len).sum();
    let mut gathered = k.pair(&vec![0.0; 7 + rows * c])?;
    let mut scattered = k.pair(&rng.vec(n * c, 0.5))?;
    // As the model scatters: expert by expert (each token once per call).
    let mut by_expert = k.pair(&rng.vec(n * c, 0.5))?;
    k.run(
        |r| {
            let mut at = 7;
            for x in 0..e {
                r.gather_rows(&mut gathered.r, at, &src.r, &routing.rows[x], d.k, c);
                at += routing.rows[x].len() * c;
            }
            r.scatter_add_rows(
                &mut scattered.r,
                &gathered.r,
                7,
                &routing.rows.concat(),
                d.k,
                c,
            );
            let mut at = 7;
            for x in 0..e {
                r.scatter_add_rows(&mut by_expert.r, &gathered.r, at, &routing.rows[x], d.k, c);
                at += routing.rows[x].len() * c;
            }
        },
        |g| {
            let mut at = 7;
            for x in 0..e {
                g.gather_rows(&mut gathered.b, at, &src.b, &routing.rows[x], d.k, c);
                at += routing.rows[x].len() * c;
            }
            g.scatter_add_rows(
                &mut scattered.b,
                &gathered.b,
                7,
                &routing.rows.concat(),
                d.k,
                c,
            );
            let mut at = 7;
            for x in 0..e {
                g.scatter_add_rows(&mut by_expert.b, &gathered.b, at, &routing.rows[x], d.k, c);
                at += routing.rows[x].len() * c;
            }
        },
    )?;
    k.record("gather_rows", FP32, &[&gathered])?;
    k.record("scatter_add_rows", FP32, &[&scattered])?;
    k.record("scatter_add_rows (one expert's rows)", FP32, &[&by_expert])?;
    let ys: Vec<Pair<R, B>> = routing
        .rows
        .iter()
        .map(|r| k.pair(&rng.vec(r.len() * c, 1.0)))
        .collect::<Result<_, _>>()?;
    let ys_r: Vec<R::Tensor> = ys
        .iter()
        .map(|p| k.r.duplicate(&p.r))
        .collect::<Result<_, _>>()?;
    let ys_b: Vec<B::Tensor> = ys
        .iter()
        .map(|p| k.b.duplicate(&p.b))
        .collect::<Result<_, _>>()?;
    let mut out = k.pair(&rng.vec(n * c, 1.0))?;
    k.run(
        |r| r.moe_combine(&mut out.r, &ys_r, &routing, c),
        |g| g.moe_combine(&mut out.b, &ys_b, &routing, c),
    )?;
    k.record("moe_combine", FP32, &[&out])?;
    let dout = k.pair(&rng.vec(n * c, 1.0))?;
    let mut dweight = k.pair(&vec![0.0; n * d.k])?;
    let mut dys: Vec<Pair<R, B>> = routing
        .rows
        .iter()
        .map(|r| k.pair(&vec![0.0; r.len() * c]))
        .collect::<Result<_, _>>()?;
    let mut dys_r: Vec<R::Tensor> = dys.iter_mut().map(|p| std::mem::take(&mut p.r)).collect();
    let mut dys_b: Vec<B::Tensor> = dys.iter_mut().map(|p| std::mem::take(&mut p.b)).collect();
    k.run(
        |r| r.moe_combine_backward(&mut dweight.r, &mut dys_r, &dout.r, &ys_r, &routing, c),
        |g| g.moe_combine_backward(&mut dweight.b, &mut dys_b, &dout.b, &ys_b, &routing, c),
    )?;
    for (p, (r, g)) in dys.iter_mut().zip(dys_r.into_iter().zip(dys_b)) {
        p.r = r;
        p.b = g;
    }
    let mut outs: Vec<&Pair<R, B>> = vec![&dweight];
    outs.extend(dys.iter());
    k.record("moe_combine_backward", FP32, &outs)?;
    let shares: Vec<f32> = rng.vec((n / t) * e, 0.5).iter().map(|x| x.abs()).collect();
    let mut dlogits = k.pair(&vec![0.0; n * e])?;
    k.run(
        |r| {
            r.router_backward(
                &mut dlogits.r,
                &probs.r,
                &dweight.r,
                &shares,
                0.03,
                &routing,
                t,
                e,
            )
        },
        |g| {
            g.router_backward(
                &mut dlogits.b,
                &probs.b,
                &dweight.b,
                &shares,
                0.03,
                &routing,
                t,
                e,
            )
        },
    )?;
    k.record("router_backward", FP32, &[&dlogits])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::backend::cpu::Cpu;

    #[test]
    fn the_cpu_backend_checks_against_itself_on_other_thread_counts_exactly() {
        let one = Cpu::new(0, 1).unwrap();
        let three = Cpu::new(1, 3).unwrap();
        let checks = kernels(&one, &three).unwrap();
        assert!(checks.len() >= 30, "{} checks", checks.len());
        for c in &checks {
            assert_eq!(
                c.error, 0.0,
                "{}: the same bits on every thread count",
                c.kernel
            );
        }
    }

    #[test]
    fn the_error_is_relative_to_the_tensors_scale_and_catches_what_is_not_finite() {
        assert_eq!(relative_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((relative_error(&[1.0, 2.1], &[1.0, 2.0]) - 0.05).abs() < 1e-6);
        assert_eq!(relative_error(&[f32::NAN], &[1.0]), f64::INFINITY);
        assert_eq!(relative_error(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(relative_error(&[0.5], &[0.0]), 0.5);
    }
}

//! The model as segments, over any [`Backend`]: for each segment a forward
//! (with the caches backward needs, as device tensors), a backward-for-input
//! (which also stashes the gradients the weight pass needs) and a
//! backward-for-weights, each running its parts in order through the
//! family that owns them (`gpt2`, `llama`, `moe`).

// Compositions carry their shapes as arguments, as the kernels do.
#![allow(clippy::too_many_arguments)]

use super::block::{Half, HalfKind, HalfStash};
use super::common::{bytes_of, Coll, Dims, Model, Peers, Reduce};
use super::moe::{ExpertGroup, MoeCache, MoeDims, MoeStash};
use crate::model::params::FamilyIds;
use crate::model::{Part, Segment};
use crate::runtime::backend::{grad_mut, grad_pair, param, Backend, BackendError, ParamMap};

/// What each part of a segment keeps from forward.
pub enum PartCache<B: Backend> {
    Embedding {
        tokens: B::Ids,
    },
    /// A block's halves in order: attention and the dense MLP, or a MoE
    /// layer's attention alone.
    Halves(Vec<Box<dyn Half<B>>>),
    Experts(Box<MoeCache<B>>),
    /// The final norm (`mean` empty for RMSNorm), head and loss.
    Head {
        x: B::Tensor,
        lnf: B::Tensor,
        mean: B::Tensor,
        rstd: B::Tensor,
        probs: B::Tensor,
        targets: B::Ids,
    },
}

/// A segment's forward cache.
pub struct SegmentCache<B: Backend> {
    pub dims: Dims,
    pub parts: Vec<PartCache<B>>,
}

impl<B: Backend> SegmentCache<B> {
    pub fn bytes(&self) -> u64 {
        self.parts
            .iter()
            .map(|p| match p {
                PartCache::Embedding { tokens } => B::ids_bytes(tokens),
                PartCache::Halves(hs) => hs.iter().map(|h| h.bytes()).sum(),
                PartCache::Experts(m) => m.bytes(),
                PartCache::Head {
                    x,
                    lnf,
                    mean,
                    rstd,
                    probs,
                    targets,
                } => bytes_of::<B>(&[x, lnf, mean, rstd, probs]) + B::ids_bytes(targets),
            })
            .sum()
    }

    /// Expert assignments this forward routed and dropped for capacity
    /// (zero without experts).
    pub fn moe_counts(&self) -> (u64, u64) {
        self.parts.iter().fold((0, 0), |(r, d), p| match p {
            PartCache::Experts(m) => (
                r + m.routed.routing.choice.len() as u64,
                d + m.routed.routing.dropped,
            ),
            _ => (r, d),
        })
    }

    /// A device copy (a forward cache two backward ops read).
    /// What a selective recompute keeps of this cache: the norm outputs,
    /// the attention probabilities and the activations are dropped
    /// ([`Model::rebuild`] computes them again); expert parts, the head and
    /// the embedding keep everything.
    /// Under sequence parallelism the norm outputs, gathered over the
    /// group, are kept too (the recompute runs without the group).
    pub fn thin(mut self) -> Self {
        let sp = self.dims.sp;
        for p in &mut self.parts {
            if let PartCache::Halves(hs) = p {
                hs.iter_mut().for_each(|h| h.thin(sp));
            }
        }
        self
    }

    pub fn duplicate(&self, b: &B) -> Result<Self, BackendError> {
        let parts = self
            .parts
            .iter()
            .map(|p| {
                Ok(match p {
                    PartCache::Embedding { tokens } => PartCache::Embedding {
                        tokens: b.duplicate_ids(tokens)?,
                    },
                    PartCache::Halves(hs) => PartCache::Halves(
                        hs.iter()
                            .map(|h| h.duplicate(b))
                            .collect::<Result<_, _>>()?,
                    ),
                    PartCache::Experts(m) => PartCache::Experts(Box::new(m.duplicate(b)?)),
                    PartCache::Head {
                        x,
                        lnf,
                        mean,
                        rstd,
                        probs,
                        targets,
                    } => PartCache::Head {
                        x: b.duplicate(x)?,
                        lnf: b.duplicate(lnf)?,
                        mean: b.duplicate(mean)?,
                        rstd: b.duplicate(rstd)?,
                        probs: b.duplicate(probs)?,
                        targets: b.duplicate_ids(targets)?,
                    },
                })
            })
            .collect::<Result<Vec<_>, BackendError>>()?;
        Ok(SegmentCache {
            dims: self.dims,
            parts,
        })
    }
}

/// Gradients the weight pass needs, produced by the input pass.
pub enum PartStash<B: Backend> {
    Embedding {
        dout: B::Tensor,
    },
    /// One per half of the block, in the halves' order.
    Halves(Vec<Box<dyn HalfStash<B>>>),
    Experts(Box<MoeStash<B>>),
    Head {
        dlogits: B::Tensor,
        dlnf: B::Tensor,
    },
}

/// A segment's input-pass stash.
pub struct SegmentStash<B: Backend> {
    pub parts: Vec<PartStash<B>>,
    /// The forward tensors the weight pass reads (inputs of the matmuls and
    /// layernorms), kept by a split backward so the rest of the forward
    /// cache (attention probabilities, qkv, the MLP pre-activation, the
    /// head's probabilities) is freed at `BI` instead of living until `BW`.
    pub kept: Option<SegmentCache<B>>,
}

impl<B: Backend> SegmentStash<B> {
    pub fn bytes(&self) -> u64 {
        self.parts
            .iter()
            .map(|p| match p {
                PartStash::Embedding { dout } => B::bytes(dout),
                PartStash::Halves(hs) => hs.iter().map(|h| h.bytes()).sum(),
                PartStash::Experts(m) => m.bytes(),
                PartStash::Head { dlogits, dlnf } => bytes_of::<B>(&[dlogits, dlnf]),
            })
            .sum::<u64>()
            + self.kept.as_ref().map_or(0, |c| c.bytes())
    }

    /// Keep from `cache` what [`Model::backward_weight`] reads.
    pub fn keep_for_weights(&mut self, cache: SegmentCache<B>) {
        let parts = cache
            .parts
            .into_iter()
            .map(|p| match p {
                PartCache::Halves(mut hs) => {
                    hs.iter_mut().for_each(|h| h.keep_for_weights());
                    PartCache::Halves(hs)
                }
                PartCache::Experts(m) => PartCache::Experts(Box::new(m.keep_for_weights())),
                PartCache::Head {
                    x, lnf, mean, rstd, ..
                } => PartCache::Head {
                    x,
                    lnf,
                    mean,
                    rstd,
                    probs: Default::default(),
                    targets: Default::default(),
                },
                e => e,
            })
            .collect();
        self.kept = Some(SegmentCache {
            dims: cache.dims,
            parts,
        });
    }
}

/// What a segment's forward gives: its output activations (`None` after
/// the head), its cache, and its terms of the summed token losses (the
/// cross-entropy at the head, the load-balancing loss of expert halves), in
/// order; the step adds them up once it ends.
pub type Forward<B> = (
    Option<<B as Backend>::Tensor>,
    SegmentCache<B>,
    Vec<<B as Backend>::Scalar>,
);

impl<B: Backend> Model<'_, B> {
    /// A selective recompute: the tensors [`SegmentCache::thin`] dropped,
    /// computed again with the forward's kernels from what it kept (the
    /// same bits as the forward's).
    pub fn rebuild(
        &self,
        params: &ParamMap<B::Tensor>,
        mut cache: SegmentCache<B>,
        mut peers: Option<Peers<'_, '_, B>>,
    ) -> Result<SegmentCache<B>, BackendError> {
        let dims = cache.dims;
        for p in &mut cache.parts {
            if let PartCache::Halves(hs) = p {
                for h in hs {
                    let group = peers.as_mut().and_then(|s| s.reduce());
                    h.rebuild(self, params, dims, group)?;
                }
            }
        }
        Ok(cache)
    }

    /// Under sequence parallelism, the residual stream (or its gradient)
    /// as the next part reads it: this member's rows inside the blocks
    /// (`inside`), whole elsewhere (the embedding, experts, the head, and
    /// between segments). `sharded` says what `x` is now.
    fn residual_as(
        &self,
        x: B::Tensor,
        sharded: &mut bool,
        inside: bool,
        dims: Dims,
        group: Option<&mut Reduce<'_, B>>,
    ) -> Result<B::Tensor, BackendError> {
        let Some(group) = group.filter(|_| dims.sp && *sharded != inside) else {
            return Ok(x);
        };
        *sharded = inside;
        group(if inside { Coll::Shard } else { Coll::Gather }, x)
    }

    /// The head's weight (the tied embedding, or `lm_head`) and its final
    /// norm's gain.
    pub(super) fn head_ids(
        &self,
    ) -> (crate::model::params::ParamId, crate::model::params::ParamId) {
        match &self.table.family {
            FamilyIds::Gpt2 { lnf, .. } => (self.table.wte, lnf.weight),
            FamilyIds::Llama { norm, lm_head, .. } => (*lm_head, *norm),
        }
    }

    /// Forward of a segment on `dims.b` sequences. `tokens` feed the
    /// embedding (first segment), `input` the activations from the previous
    /// segment; `targets` the loss (last segment). With `peers`, the segment
    /// is spread over a group and every member calls this for the same
    /// microbatch together.
    pub fn forward(
        &self,
        seg: &Segment,
        params: &ParamMap<B::Tensor>,
        tokens: Option<&[u32]>,
        input: Option<B::Tensor>,
        targets: Option<&[u32]>,
        dims: Dims,
        mut peers: Option<Peers<'_, '_, B>>,
    ) -> Result<Forward<B>, BackendError> {
        let Dims { b, t, c, v, .. } = dims;
        let n = dims.n();
        let missing = |what: &str| {
            BackendError::Device(format!("segment {} runs without its {what}", seg.index))
        };
        let mut x: B::Tensor = input.unwrap_or_default();
        let mut caches = Vec::with_capacity(seg.parts.len());
        let mut loss: Vec<B::Scalar> = Vec::new();
        let mut out_present = true;
        let mut sharded = false;
        for part in &seg.parts {
            if *part != Part::Embedding {
                let inside = matches!(part, Part::Block(_) | Part::Attention(_));
                let group = peers.as_mut().and_then(|s| s.reduce());
                x = self.residual_as(x, &mut sharded, inside, dims, group)?;
            }
            match *part {
                Part::Embedding => {
                    let tokens = tokens.ok_or_else(|| missing("tokens"))?;
                    let ids = self.b.upload_ids(tokens)?;
                    x = self.zeros(n * c)?;
                    let wpe = match self.table.gpt2_ends() {
                        Some((wpe, _)) => Some(param(params, wpe)?),
                        None => None,
                    };
                    let wte = param(params, self.table.wte)?;
                    match wpe {
                        // Context parallelism: the positions of the rows held.
                        Some(wpe) if dims.context() => {
                            self.b.embedding_forward(&mut x, &ids, wte, None, b, t, c);
                            let mut pe = self.zeros(n * c)?;
                            let at = dims.held_positions();
                            self.b.gather_rows(&mut pe, 0, wpe, &at, 1, c);
                            self.b.add(&mut x, &pe);
                        }
                        _ => self.b.embedding_forward(&mut x, &ids, wte, wpe, b, t, c),
                    }
                    caches.push(PartCache::Embedding { tokens: ids });
                }
                Part::Block(l) | Part::Attention(l) => {
                    let kinds: &[HalfKind] = match part {
                        Part::Block(_) => &[HalfKind::Attention, HalfKind::Mlp],
                        _ => &[HalfKind::Attention],
                    };
                    let mut halves = Vec::with_capacity(kinds.len());
                    for &kind in kinds {
                        let inp = std::mem::take(&mut x);
                        let group = peers.as_mut().and_then(|s| s.reduce());
                        let (out, half) = self.half_forward(params, kind, l, inp, dims, group)?;
                        x = out;
                        halves.push(half);
                    }
                    caches.push(PartCache::Halves(halves));
                }
                Part::Experts(l) => {
                    let moe = dims.moe.ok_or_else(|| missing("MoE configuration"))?;
                    let d = MoeDims::new(&moe, n, t, c).of_sequences(dims.seq);
                    let inp = std::mem::take(&mut x);
                    let (out, cache, aux) = match peers.as_mut() {
                        Some(Peers::Experts {
                            group,
                            exchange,
                            context,
                        }) => self.moe_forward(
                            params,
                            l,
                            &moe,
                            inp,
                            d,
                            *group,
                            *exchange,
                            context.as_deref_mut(),
                        )?,
                        _ => self.moe_forward(
                            params,
                            l,
                            &moe,
                            inp,
                            d,
                            ExpertGroup::ALONE,
                            &mut super::moe::alone::<B>,
                            peers.as_mut().and_then(|p| p.context()),
                        )?,
                    };
                    x = out;
                    loss.push(self.b.scalar(aux));
                    caches.push(PartCache::Experts(Box::new(cache)));
                }
                Part::Head => {
                    let targets = targets.ok_or_else(|| missing("targets"))?;
                    let targets = self.b.upload_ids(targets)?;
                    let (lnf, mean, rstd, head) = match &self.table.family {
                        FamilyIds::Gpt2 { lnf, .. } => {
                            let (o, m, r) = self.layernorm(params, *lnf, &x, n, c)?;
                            (o, m, r, self.table.wte)
                        }
                        FamilyIds::Llama { norm, lm_head, .. } => {
                            let (o, r) =
                                self.rmsnorm(params, *norm, &x, n, c, dims.arch.norm_eps)?;
                            (o, Default::default(), r, *lm_head)
                        }
                    };
                    let mut logits = self.zeros(n * v)?;
                    self.b
                        .matmul_forward(&mut logits, &lnf, param(params, head)?, None, n, c, v);
                    let mut probs = self.zeros(n * v)?;
                    loss.push(
                        self.b
                            .crossentropy_forward(&mut probs, &logits, &targets, n, v),
                    );
                    caches.push(PartCache::Head {
                        x: std::mem::take(&mut x),
                        lnf,
                        mean,
                        rstd,
                        probs,
                        targets,
                    });
                    out_present = false;
                }
            }
        }
        let group = peers.as_mut().and_then(|s| s.reduce());
        x = self.residual_as(x, &mut sharded, false, dims, group)?;
        let out = out_present.then_some(x);
        Ok((
            out,
            SegmentCache {
                dims,
                parts: caches,
            },
            loss,
        ))
    }

    /// Backward for inputs: from `dout` (or, for the head, the loss with
    /// `loss_scale` = 1 / tokens of the global batch) to the gradient of
    /// the segment's input (`None` for the first segment), stashing what
    /// the weight pass needs.
    pub fn backward_input(
        &self,
        params: &ParamMap<B::Tensor>,
        cache: &SegmentCache<B>,
        dout: Option<B::Tensor>,
        loss_scale: f32,
        mut peers: Option<Peers<'_, '_, B>>,
    ) -> Result<(Option<B::Tensor>, SegmentStash<B>), BackendError> {
        let dims = cache.dims;
        let Dims { c, v, .. } = dims;
        let n = dims.n();
        let mut d: B::Tensor = dout.unwrap_or_default();
        let mut stash = Vec::with_capacity(cache.parts.len());
        let mut has_input = true;
        let mut sharded = false;
        for pc in cache.parts.iter().rev() {
            if !matches!(pc, PartCache::Head { .. }) {
                let inside = matches!(pc, PartCache::Halves(_));
                let group = peers.as_mut().and_then(|s| s.reduce());
                d = self.residual_as(d, &mut sharded, inside, dims, group)?;
            }
            match pc {
                PartCache::Head {
                    x,
                    mean,
                    rstd,
                    probs,
                    targets,
                    ..
                } => {
                    let mut dlogits = self.zeros(n * v)?;
                    self.b
                        .crossentropy_backward(&mut dlogits, probs, targets, n, v, loss_scale);
                    let mut dlnf = self.zeros(n * c)?;
                    let (head, norm) = self.head_ids();
                    self.b.matmul_backward_input(
                        &mut dlnf,
                        &dlogits,
                        param(params, head)?,
                        n,
                        c,
                        v,
                        false,
                    );
                    let mut dx = self.zeros(n * c)?;
                    match &self.table.family {
                        FamilyIds::Gpt2 { .. } => self.b.layernorm_backward_input(
                            &mut dx,
                            &dlnf,
                            x,
                            param(params, norm)?,
                            mean,
                            rstd,
                            n,
                            c,
                        ),
                        FamilyIds::Llama { .. } => self.b.rmsnorm_backward_input(
                            &mut dx,
                            &dlnf,
                            x,
                            param(params, norm)?,
                            rstd,
                            n,
                            c,
                        ),
                    }
                    d = dx;
                    stash.push(PartStash::Head { dlogits, dlnf });
                }
                PartCache::Halves(hs) => {
                    let mut stashes = Vec::with_capacity(hs.len());
                    for h in hs.iter().rev() {
                        let dout = std::mem::take(&mut d);
                        let group = peers.as_mut().and_then(|s| s.reduce());
                        let (dx, st) = h.backward_input(self, params, dout, dims, group)?;
                        d = dx;
                        stashes.push(st);
                    }
                    stashes.reverse();
                    stash.push(PartStash::Halves(stashes));
                }
                PartCache::Experts(m) => {
                    let dout = std::mem::take(&mut d);
                    let (dx, ms) = match peers.as_mut() {
                        Some(Peers::Experts { exchange, .. }) => {
                            self.moe_backward_input(params, m, dout, loss_scale, *exchange)?
                        }
                        _ => self.moe_backward_input(
                            params,
                            m,
                            dout,
                            loss_scale,
                            &mut super::moe::alone::<B>,
                        )?,
                    };
                    d = dx;
                    stash.push(PartStash::Experts(Box::new(ms)));
                }
                PartCache::Embedding { .. } => {
                    stash.push(PartStash::Embedding {
                        dout: std::mem::take(&mut d),
                    });
                    has_input = false;
                }
            }
        }
        stash.reverse();
        if has_input {
            let group = peers.as_mut().and_then(|s| s.reduce());
            d = self.residual_as(d, &mut sharded, false, dims, group)?;
        }
        Ok((
            has_input.then_some(d),
            SegmentStash {
                parts: stash,
                kept: None,
            },
        ))
    }

    /// Backward for weights: accumulate the segment's parameter gradients.
    pub fn backward_weight(
        &self,
        grads: &mut ParamMap<B::Tensor>,
        cache: &SegmentCache<B>,
        stash: &SegmentStash<B>,
    ) -> Result<(), BackendError> {
        let Dims { b, t, c, v, .. } = cache.dims;
        let n = b * t;
        for (pc, st) in cache.parts.iter().zip(&stash.parts) {
            match (pc, st) {
                (PartCache::Embedding { tokens }, PartStash::Embedding { dout }) => {
                    match self.table.gpt2_ends() {
                        Some((wpe, _)) if cache.dims.context() => {
                            let (dwte, dwpe) = grad_pair(grads, self.table.wte, wpe)?;
                            self.b
                                .embedding_backward_weight(dwte, None, dout, tokens, b, t, c);
                            let at = cache.dims.held_positions();
                            self.b.scatter_add_rows(dwpe, dout, 0, &at, 1, c);
                        }
                        Some((wpe, _)) => {
                            let (dwte, dwpe) = grad_pair(grads, self.table.wte, wpe)?;
                            self.b.embedding_backward_weight(
                                dwte,
                                Some(dwpe),
                                dout,
                                tokens,
                                b,
                                t,
                                c,
                            );
                        }
                        None => self.b.embedding_backward_weight(
                            grad_mut(grads, self.table.wte)?,
                            None,
                            dout,
                            tokens,
                            b,
                            t,
                            c,
                        ),
                    }
                }
                (PartCache::Halves(hs), PartStash::Halves(ss)) if hs.len() == ss.len() => {
                    for (h, st) in hs.iter().zip(ss).rev() {
                        h.backward_weight(self, grads, st.as_ref(), cache.dims)?;
                    }
                }
                (PartCache::Experts(m), PartStash::Experts(ms)) => {
                    self.moe_backward_weight(grads, m, ms)?;
                }
                (
                    PartCache::Head {
                        x, lnf, mean, rstd, ..
                    },
                    PartStash::Head { dlogits, dlnf },
                ) => {
                    let (head, _) = self.head_ids();
                    self.b.matmul_backward_weight(
                        grad_mut(grads, head)?,
                        None,
                        dlogits,
                        lnf,
                        n,
                        c,
                        v,
                    );
                    match &self.table.family {
                        FamilyIds::Gpt2 { lnf: norm, .. } => {
                            self.layernorm_weight(grads, *norm, dlnf, x, mean, rstd, n, c)?
                        }
                        FamilyIds::Llama { norm, .. } => self.b.rmsnorm_backward_weight(
                            grad_mut(grads, *norm)?,
                            dlnf,
                            x,
                            rstd,
                            n,
                            c,
                        ),
                    }
                }
                _ => {
                    return Err(BackendError::Device(
                        "a weight pass whose stash is not its cache's segment's".into(),
                    ))
                }
            }
        }
        Ok(())
    }
}

//! A transformer block as the segment runs it: one or two halves (attention,
//! then the dense MLP; a MoE layer's attention half alone), each a family's
//! composition (`gpt2`, `llama`) behind one trait. A half's forward cache
//! knows its backward, its recompute and what its weight pass keeps, so the
//! segment never asks which family it runs.

use super::common::{Dims, Model, Reduce};
use crate::model::Family;
use crate::runtime::backend::{Backend, BackendError, ParamMap};

/// A half's input gradient and the stash its weight pass reads.
pub type HalfBack<B> = (<B as Backend>::Tensor, Box<dyn HalfStash<B>>);
/// A half's output and its forward cache.
pub type HalfOut<B> = (<B as Backend>::Tensor, Box<dyn Half<B>>);

/// Which half of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfKind {
    Attention,
    Mlp,
}

/// What one half kept from its forward, and the passes that read it.
pub trait Half<B: Backend>: Send + Sync {
    /// Device bytes held.
    fn bytes(&self) -> u64;
    /// A device copy.
    fn duplicate(&self, b: &B) -> Result<Box<dyn Half<B>>, BackendError>;
    /// Drop what a selective recompute computes again (the norm output,
    /// kept under sequence parallelism: it was gathered over the group).
    fn thin(&mut self, sp: bool);
    /// Compute again what [`Half::thin`] dropped.
    fn rebuild(
        &mut self,
        m: &Model<'_, B>,
        params: &ParamMap<B::Tensor>,
        dims: Dims,
        group: Option<&mut Reduce<'_, B>>,
    ) -> Result<(), BackendError>;
    /// Drop what the weight pass does not read.
    fn keep_for_weights(&mut self);
    /// The half's input gradient from its output's, and what the weight
    /// pass reads.
    fn backward_input(
        &self,
        m: &Model<'_, B>,
        params: &ParamMap<B::Tensor>,
        dout: B::Tensor,
        dims: Dims,
        group: Option<&mut Reduce<'_, B>>,
    ) -> Result<HalfBack<B>, BackendError>;
    /// Accumulate the half's weight gradients from its input pass's stash.
    fn backward_weight(
        &self,
        m: &Model<'_, B>,
        grads: &mut ParamMap<B::Tensor>,
        stash: &dyn HalfStash<B>,
        dims: Dims,
    ) -> Result<(), BackendError>;
}

/// The gradients one half's input pass hands its weight pass.
pub trait HalfStash<B: Backend>: Send + Sync {
    fn bytes(&self) -> u64;
    /// The concrete stash, for the half that made it.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// The stash `S` a half's weight pass reads, or an error naming the half.
pub(super) fn stash_of<'s, B: Backend, S: 'static>(
    stash: &'s dyn HalfStash<B>,
    half: &str,
) -> Result<&'s S, BackendError> {
    stash.as_any().downcast_ref::<S>().ok_or_else(|| {
        BackendError::Device(format!(
            "the weight pass of {half} got another half's stash"
        ))
    })
}

/// `Half` for a family's cache type: `$cache` holds its norm output in
/// `$norm` and drops `$rec` for a selective recompute (rebuilt by
/// `Model::$rebuild`), the weight pass reads all but `$skip`; its passes are
/// `Model::$input` (giving a `$stash`) and `Model::$weight`.
macro_rules! half {
    ($cache:ident, $stash:ident, $what:literal, norm: $norm:ident, recomputed: $rec:ident,
     weights_skip: ($($skip:ident),+), rebuild: $rebuild:ident, input: $input:ident,
     weight: $weight:ident) => {
        impl<B: Backend> Half<B> for $cache<B> {
            fn bytes(&self) -> u64 {
                $cache::bytes(self)
            }
            fn duplicate(&self, b: &B) -> Result<Box<dyn Half<B>>, BackendError> {
                Ok(Box::new($cache::duplicate(self, b)?))
            }
            fn thin(&mut self, sp: bool) {
                if !sp {
                    self.$norm = Default::default();
                }
                self.$rec = Default::default();
            }
            fn rebuild(
                &mut self,
                m: &Model<'_, B>,
                params: &ParamMap<B::Tensor>,
                dims: Dims,
                group: Option<&mut Reduce<'_, B>>,
            ) -> Result<(), BackendError> {
                m.$rebuild(params, self, dims, group)
            }
            fn keep_for_weights(&mut self) {
                $(self.$skip = Default::default();)+
            }
            fn backward_input(
                &self,
                m: &Model<'_, B>,
                params: &ParamMap<B::Tensor>,
                dout: B::Tensor,
                dims: Dims,
                group: Option<&mut Reduce<'_, B>>,
            ) -> Result<HalfBack<B>, BackendError> {
                let (dx, st) = m.$input(params, self, dout, dims, group)?;
                Ok((dx, Box::new(st)))
            }
            fn backward_weight(
                &self,
                m: &Model<'_, B>,
                grads: &mut ParamMap<B::Tensor>,
                stash: &dyn HalfStash<B>,
                dims: Dims,
            ) -> Result<(), BackendError> {
                let st = stash_of::<B, $stash<B>>(stash, $what)?;
                m.$weight(grads, self, st, dims)
            }
        }

        impl<B: Backend> HalfStash<B> for $stash<B> {
            fn bytes(&self) -> u64 {
                $stash::bytes(self)
            }
            fn as_any(&self) -> &dyn std::any::Any {
                self
            }
        }
    };
}
pub(super) use half;

impl<B: Backend> Model<'_, B> {
    /// Half `kind` of layer `l` forward, as the model's family composes it.
    pub(super) fn half_forward(
        &self,
        params: &ParamMap<B::Tensor>,
        kind: HalfKind,
        l: u32,
        x: B::Tensor,
        dims: Dims,
        group: Option<&mut Reduce<'_, B>>,
    ) -> Result<HalfOut<B>, BackendError> {
        Ok(match (dims.arch.family, kind) {
            (Family::Gpt2, HalfKind::Attention) => {
                let (out, c) = self.attn_forward(params, l, x, dims, group)?;
                (out, Box::new(c))
            }
            (Family::Gpt2, HalfKind::Mlp) => {
                let (out, c) = self.mlp_forward(params, l, x, dims, group)?;
                (out, Box::new(c))
            }
            (Family::Llama, HalfKind::Attention) => {
                let (out, c) = self.llama_attn_forward(params, l, x, dims, group)?;
                (out, Box::new(c))
            }
            (Family::Llama, HalfKind::Mlp) => {
                let (out, c) = self.swiglu_forward(params, l, x, dims, group)?;
                (out, Box::new(c))
            }
        })
    }
}

//! A relayout (compile's, where a data edge joins two layouts): each
//! member that produced the tensor sends every other the pieces it needs
//! (`Relayout::pieces`, the same list on every member), and each member that
//! reads it assembles its holding from the pieces, its own first. Pieces
//! travel through the host in the tensor's dtype, one message per pair of
//! members under the op's node id; the input is released, the output put
//! where the consumer takes it.

use super::{comm_error, missing, StepCtx};
use crate::compile::plan::{Holding, Op, Piece, Relayout, TensorKind};
use crate::runtime::backend::{Backend, BackendError};
use crate::runtime::buffers::Buf;
use crate::runtime::comm::packed;
use crate::runtime::device::Device;
use crate::runtime::error::RuntimeError;

/// Values of `p` (rows × spans) out of `held`, a member's `[rows,
/// positions, width]` tensor holding `h`, in piece order.
fn pack(held: &[f32], h: &Holding, p: &Piece, width: usize) -> Option<Vec<f32>> {
    let per_row = h.positions() as usize * width;
    let mut out = Vec::with_capacity(p.cells() as usize * width);
    for r in p.rows[0]..p.rows[1] {
        let row = (r.checked_sub(h.rows[0])? as usize) * per_row;
        for s in &p.spans {
            let at = row + h.offset(s[0])? as usize * width;
            let len = (s[1] - s[0]) as usize * width;
            out.extend_from_slice(held.get(at..at + len)?);
        }
    }
    Some(out)
}

/// Put `values` (piece `p`, packed) into `out`, the receiver's tensor of
/// holding `h`.
fn unpack(out: &mut [f32], h: &Holding, p: &Piece, width: usize, values: &[f32]) -> Option<()> {
    let per_row = h.positions() as usize * width;
    let mut from = 0;
    for r in p.rows[0]..p.rows[1] {
        let row = (r.checked_sub(h.rows[0])? as usize) * per_row;
        for s in &p.spans {
            let at = row + h.offset(s[0])? as usize * width;
            let len = (s[1] - s[0]) as usize * width;
            out.get_mut(at..at + len)?
                .copy_from_slice(values.get(from..from + len)?);
            from += len;
        }
    }
    Some(())
}

pub(super) fn run<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    group: &[u32],
    spec: &Relayout,
) -> Result<(), RuntimeError> {
    let bad = |why: String| dev.backend_error(op, BackendError::Exchange(why));
    let me = spec
        .members
        .iter()
        .position(|&m| m == dev.id)
        .filter(|_| spec.members[..] == *group)
        .ok_or_else(|| {
            bad(format!(
                "device {} is not a member of the relayout over {:?}",
                dev.id, spec.members
            ))
        })?;
    let pieces = spec.pieces().map_err(&bad)?;
    let kind = op.tensor.unwrap_or(TensorKind::Activation);
    let what = format!("{kind:?} relayout");
    // What this member holds before: its producer's tensor, on the host.
    let mine = match &spec.from[me] {
        Some(h) => {
            let buf = dev.bufs.take(op, kind)?;
            let t = dev
                .tensor_of(op, buf)?
                .ok_or_else(|| missing(dev, op, &format!("the {kind:?} to relayout")))?;
            let dtype = B::dtype(&t);
            let values = dev
                .b
                .download_owned(t)
                .map_err(|e| dev.backend_error(op, e))?;
            let cells = h.cells() as usize;
            if cells == 0 || !values.len().is_multiple_of(cells) {
                return Err(bad(format!(
                    "{} values do not hold {cells} row-positions",
                    values.len()
                )));
            }
            Some((values, h, dtype))
        }
        None => None,
    };
    let width = |cells: u64, len: usize| -> Result<usize, RuntimeError> {
        let cells = cells as usize;
        if cells == 0 || !len.is_multiple_of(cells) {
            return Err(bad(format!(
                "{len} values do not hold {cells} row-positions"
            )));
        }
        Ok(len / cells)
    };
    // Send each other member its pieces from here, in piece order, as one
    // message.
    if let Some((values, h, dtype)) = &mine {
        let w = width(h.cells(), values.len())?;
        for (to, &peer) in spec.members.iter().enumerate() {
            if to == me {
                continue;
            }
            let mut msg = Vec::new();
            for p in pieces.iter().filter(|p| p.from == me && p.to == to) {
                msg.extend(
                    pack(values, h, p, w).ok_or_else(|| {
                        bad(format!("piece {p:?} is not inside the holding {h:?}"))
                    })?,
                );
            }
            if !msg.is_empty() {
                packed::send(ctx.comm, op.node, (dev.id, peer), msg, *dtype)
                    .map_err(|e| comm_error(dev, op, e))?;
            }
        }
    }
    let Some(need) = &spec.to[me] else {
        return Ok(());
    };
    // Assemble what this member's consumer reads: its own pieces first,
    // then each sender's message in piece order.
    let dtype = mine.as_ref().map_or(dev.act, |(_, _, d)| *d);
    let mut out: Option<Vec<f32>> = None;
    let mut w = mine
        .as_ref()
        .map(|(values, h, _)| width(h.cells(), values.len()))
        .transpose()?;
    for from in std::iter::once(me).chain((0..spec.members.len()).filter(|&m| m != me)) {
        let mut mine_here: Vec<&Piece> = pieces
            .iter()
            .filter(|p| p.from == from && p.to == me)
            .collect();
        if mine_here.is_empty() {
            continue;
        }
        let values =
            if from == me {
                let (held, h, _) = mine
                    .as_ref()
                    .ok_or_else(|| bad("a piece of its own that it does not hold".into()))?;
                let w = w.ok_or_else(|| bad("no width".into()))?;
                let mut all = Vec::new();
                for p in &mine_here {
                    all.extend(pack(held, h, p, w).ok_or_else(|| {
                        bad(format!("piece {p:?} is not inside the holding {h:?}"))
                    })?);
                }
                all
            } else {
                packed::recv(
                    ctx.comm,
                    op.node,
                    (spec.members[from], dev.id),
                    &what,
                    dtype,
                )
                .map_err(|e| comm_error(dev, op, e))?
            };
        let cells: u64 = mine_here.iter().map(|p| p.cells()).sum();
        let pw = width(cells, values.len())?;
        if *w.get_or_insert(pw) != pw {
            return Err(bad(format!(
                "device {} sent rows of width {pw}, this member holds width {}",
                spec.members[from],
                w.unwrap_or(0)
            )));
        }
        let target = out.get_or_insert_with(|| vec![0.0; need.cells() as usize * pw]);
        let mut at = 0;
        for p in mine_here.drain(..) {
            let len = p.cells() as usize * pw;
            let part = values
                .get(at..at + len)
                .ok_or_else(|| bad(format!("a message too short for piece {p:?}")))?;
            unpack(target, need, p, pw, part)
                .ok_or_else(|| bad(format!("piece {p:?} is not inside the holding {need:?}")))?;
            at += len;
        }
    }
    let out = out.ok_or_else(|| missing(dev, op, "any piece of its holding"))?;
    let t = dev
        .b
        .upload_as(out, dtype)
        .map_err(|e| dev.backend_error(op, e))?;
    dev.bufs.put(op, kind, Buf::Tensor(t))
}

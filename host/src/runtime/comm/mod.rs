//! Communication between devices, as the runtime sees it: buffered
//! point-to-point messages matched by (send node, source, destination) and
//! the collectives plans name (all-reduce, reduce-scatter, all-gather,
//! all-to-all) matched by (node, group). The runtime talks only to the
//! [`Comm`] trait; an implementation decides how bytes move:
//!
//! - [`local::LocalComm`]: devices that are threads of this process
//!   (mailboxes and collectives in shared memory);
//! - [`mpi::MpiComm`] (feature `mpi`): devices on other ranks, the same
//!   collectives over MPI messages.
//!
//! Every collective is the direct (pairwise) algorithm: a reduce-scatter
//! sends each member the chunk of the buffer it owns and each member sums
//! its own chunk; an all-gather sends each member's shard to every other
//! member; an all-reduce is the two in turn. Of a buffer of S bytes over N
//! members, each member sends (N−1)/N·S for a reduce-scatter or an
//! all-gather (its own shard N−1 times) and 2(N−1)/N·S for an all-reduce:
//! a ring's volume, in one round instead of N−1. Each implementation
//! records the bytes every device sends ([`Comm::sent_bytes`]).
//!
//! Contract every implementation keeps: each element of a reduction is the
//! members' contributions added in device order from zero (the same
//! additions in one process and across ranks: results are bit-identical run
//! to run and between transports); every wait is bounded by
//! [`Comm::timeout`] and ends early with [`CommError::Aborted`] once any
//! device fails; errors name the devices involved.

pub mod check;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod packed;

pub use local::LocalComm;

use std::sync::Arc;
use std::time::Duration;

/// A communication failure.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    #[error(
        "device {me} waited {waited_ms} ms for {what} #{node} from device {peer}; it never came"
    )]
    RecvTimeout {
        me: u32,
        peer: u32,
        node: u32,
        what: String,
        waited_ms: u64,
    },
    #[error("{op} #{node} on group {group:?}: device {me} waited {waited_ms} ms, devices {missing:?} never joined")]
    CollectiveTimeout {
        op: String,
        node: u32,
        group: Vec<u32>,
        me: u32,
        missing: Vec<u32>,
        waited_ms: u64,
    },
    #[error("{op} #{node} on group {group:?}: members disagree about its size: {sizes}")]
    Mismatch {
        op: String,
        node: u32,
        group: Vec<u32>,
        sizes: String,
    },
    #[error(
        "device {from} sent #{node} to device {to} twice; the first message was not received yet"
    )]
    Duplicate { node: u32, from: u32, to: u32 },
    #[error("aborted: another device failed")]
    Aborted,
}

/// The sum every implementation computes: members' contributions
/// (`(device, values)`, ascending device order) added in that order from
/// zero, or a `Mismatch` naming each member's size. One function, so every
/// transport does the same additions and results are bit-identical.
pub fn sum_in_device_order<'a>(
    op: &str,
    node: u32,
    group: &[u32],
    contrib: impl Iterator<Item = (u32, &'a [f32])> + Clone,
) -> Result<Vec<f32>, CommError> {
    let n = contrib.clone().next().map_or(0, |(_, v)| v.len());
    if contrib.clone().any(|(_, v)| v.len() != n) {
        return Err(CommError::Mismatch {
            op: op.into(),
            node,
            group: group.to_vec(),
            sizes: contrib
                .map(|(d, v)| format!("device {d}: {} floats", v.len()))
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    let mut members = contrib;
    // `0.0 + first`, then each other member in turn: the additions from
    // zero, without a pass that only writes the zeros.
    let mut sum: Vec<f32> = match members.next() {
        Some((_, first)) => first.iter().map(|x| 0.0 + x).collect(),
        None => Vec::new(),
    };
    for (_, v) in members {
        for (a, b) in sum.iter_mut().zip(v) {
            *a += b;
        }
    }
    Ok(sum)
}

/// Key of exchange number `phase` (< 1024) inside the op of plan node
/// `node` (< 2^20): the mailbox pair of an all-to-all, the node of an
/// all-reduce. Bit 30 set, so it never meets a point-to-point pair (a send
/// node's id), a plan collective (its node id) or an MPI collective's key
/// (bit 31). `None` when the numbers do not fit.
pub fn in_op_key(node: u32, phase: u32) -> Option<u32> {
    (node < (1 << 20) && phase < (1 << 10)).then_some((1 << 30) | (node << 10) | phase)
}

/// The chunk lengths of `total` elements over `n` members: `ceil(total/n)`
/// each, the last ones shorter or empty (ZeRO's shards, an all-reduce's
/// chunks).
pub fn even_shards(total: usize, n: usize) -> Vec<usize> {
    let n = n.max(1);
    let per = total.div_ceil(n);
    (0..n)
        .map(|r| ((r + 1) * per).min(total) - (r * per).min(total))
        .collect()
}

/// The mailbox key of phase `phase` of the collective of plan node (or
/// in-op key) `node`, when a transport builds it on point-to-point
/// messages: above every `u32` key of sends, receives and all-to-alls.
pub fn collective_key(node: u32, phase: u8) -> u64 {
    (1u64 << 32) | (u64::from(phase) << 40) | u64::from(node)
}

/// `group`'s size problem for a collective, if any: `me` must be a member,
/// each member once, and `lens` (a reduce-scatter's chunks) one per member
/// adding up to `len`.
fn check_group(
    op: &str,
    node: u32,
    group: &[u32],
    me: u32,
    shape: Option<(usize, &[usize])>,
) -> Result<usize, CommError> {
    let bad = |sizes: String| CommError::Mismatch {
        op: op.into(),
        node,
        group: group.to_vec(),
        sizes,
    };
    let Some(pos) = group.iter().position(|d| *d == me) else {
        return Err(bad(format!("device {me} is not a member")));
    };
    let mut sorted = group.to_vec();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1]) {
        return Err(bad("a device is named twice".into()));
    }
    if let Some((len, lens)) = shape {
        let total = lens.iter().try_fold(0usize, |a, l| a.checked_add(*l));
        if lens.len() != group.len() || total != Some(len) {
            return Err(bad(format!(
                "device {me} cut {len} floats into {} chunks of {lens:?} for a group of {}",
                lens.len(),
                group.len()
            )));
        }
    }
    Ok(pos)
}

/// Where member `pos`'s chunk starts.
fn chunk_start(lens: &[usize], pos: usize) -> usize {
    lens[..pos].iter().sum()
}

/// How devices exchange tensors during a step (one instance per step).
pub trait Comm: Send + Sync {
    /// Buffered send: never blocks. A second message to a mailbox whose
    /// first was not received yet is an error, never an overwrite.
    fn send(&self, pair: u32, from: u32, to: u32, data: Arc<Vec<f32>>) -> Result<(), CommError>;
    /// Receive the matching send (`what` names the tensor in errors),
    /// waiting at most the timeout.
    fn recv(&self, pair: u32, from: u32, to: u32, what: &str) -> Result<Arc<Vec<f32>>, CommError>;
    /// Sum `data` over `group` in device order; every member gets the sum.
    /// `op` names the collective in errors. A reduce-scatter of even chunks,
    /// then an all-gather of the sums (the two never share a mailbox or a
    /// meeting: each transport keeps them apart by phase).
    fn all_reduce(
        &self,
        op: &str,
        node: u32,
        group: &[u32],
        me: u32,
        data: Vec<f32>,
    ) -> Result<Arc<Vec<f32>>, CommError> {
        let lens = even_shards(data.len(), group.len());
        let chunk = self.reduce_scatter(op, node, group, me, data, &lens)?;
        self.all_gather(op, node, group, me, chunk)
    }
    /// Reduce-scatter: `data` (the same length on every member) is cut
    /// into `lens` (one chunk per member, in group order, the same on every
    /// member); member `group[i]` gets the sum of every member's chunk `i`.
    fn reduce_scatter(
        &self,
        op: &str,
        node: u32,
        group: &[u32],
        me: u32,
        data: Vec<f32>,
        lens: &[usize],
    ) -> Result<Vec<f32>, CommError>;
    /// All-gather: every member gets the members' shards concatenated in
    /// group order (shards may differ in length).
    fn all_gather(
        &self,
        op: &str,
        node: u32,
        group: &[u32],
        me: u32,
        shard: Vec<f32>,
    ) -> Result<Arc<Vec<f32>>, CommError>;
    /// Bytes each device of this process sent so far in this step (its
    /// messages and its part of every collective), by device.
    fn sent_bytes(&self) -> std::collections::BTreeMap<u32, u64>;
    /// Count `bytes` as sent by `device` for a message that did not go
    /// through the transport (a tensor handed over in one memory).
    fn count_sent(&self, device: u32, bytes: u64);
    /// All-to-all over `group` (ascending devices): `chunks[i]` goes to
    /// `group[i]`, and the result's `[i]` came from `group[i]` (this device's
    /// own chunk stays here). Chunks may differ in size. `key` tells this
    /// exchange apart from every other of the step (see [`in_op_key`]);
    /// `what` names it in errors. Built on the buffered point-to-point
    /// calls, so it moves exactly the bytes of the chunks and cannot
    /// deadlock against itself; a transport with a native all-to-all (NCCL)
    /// overrides it.
    fn all_to_all(
        &self,
        what: &str,
        key: u32,
        group: &[u32],
        me: u32,
        chunks: Vec<Vec<f32>>,
    ) -> Result<Vec<Arc<Vec<f32>>>, CommError> {
        if chunks.len() != group.len() || !group.contains(&me) {
            return Err(CommError::Mismatch {
                op: what.into(),
                node: key,
                group: group.to_vec(),
                sizes: format!(
                    "device {me} brought {} chunks for a group of {}",
                    chunks.len(),
                    group.len()
                ),
            });
        }
        let mut own = None;
        for (&peer, chunk) in group.iter().zip(chunks) {
            if peer == me {
                own = Some(Arc::new(chunk));
            } else {
                self.send(key, me, peer, Arc::new(chunk))?;
            }
        }
        group
            .iter()
            .map(|&peer| match peer == me {
                true => Ok(own.take().expect("this device's own chunk")),
                false => self.recv(key, peer, me, what),
            })
            .collect()
    }
    /// Wake every waiter (here and, for a distributed implementation, on
    /// every peer) with [`CommError::Aborted`].
    fn abort(&self);
    fn aborted(&self) -> bool;
    /// The wait limit of every receive and collective.
    fn timeout(&self) -> Duration;
    /// Does `device` run in this process? (A receiver releases a local
    /// sender's in-flight bytes; a remote sender's leave its account when
    /// the transport has them.)
    fn is_local(&self, _device: u32) -> bool {
        true
    }
}

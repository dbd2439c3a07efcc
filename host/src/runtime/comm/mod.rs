//! Communication between devices, as the runtime sees it: buffered
//! point-to-point messages matched by (send node, source, destination) and
//! sum collectives matched by (node, group). The runtime talks only to the
//! [`Comm`] trait; an implementation decides how bytes move:
//!
//! - [`local::LocalComm`]: devices that are threads of this process
//!   (mailboxes and shared reductions in memory);
//! - an MPI implementation (devices on other ranks: point-to-point and
//!   collectives over sub-communicators), and a NCCL one on the CUDA backend,
//!   implement the same calls.
//!
//! Contract every implementation keeps: reductions add the members'
//! contributions in device order (results bit-identical from run to run and
//! across implementations); every wait is bounded by [`Comm::timeout`] and
//! ends early with [`CommError::Aborted`] once any device fails; errors name
//! the devices involved.

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;

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
    let mut sum = vec![0.0f32; n];
    for (_, v) in contrib {
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

/// How devices exchange tensors during a step (one instance per step).
pub trait Comm: Send + Sync {
    /// Buffered send: never blocks. A second message to a mailbox whose
    /// first was not received yet is an error, never an overwrite.
    fn send(&self, pair: u32, from: u32, to: u32, data: Arc<Vec<f32>>) -> Result<(), CommError>;
    /// Receive the matching send (`what` names the tensor in errors),
    /// waiting at most the timeout.
    fn recv(&self, pair: u32, from: u32, to: u32, what: &str) -> Result<Arc<Vec<f32>>, CommError>;
    /// Sum `data` over `group` in device order; every member gets the sum.
    /// `op` names the collective in errors.
    fn all_reduce(
        &self,
        op: &str,
        node: u32,
        group: &[u32],
        me: u32,
        data: Vec<f32>,
    ) -> Result<Arc<Vec<f32>>, CommError>;
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

//! Op costs: a cluster's roofline-and-links model, or unit costs per pass
//! for checking schedules against their published bubble formulas.

use super::device::DeviceClass;
use super::Cluster;
use crate::compile::plan::{Act, Op, OpKind, OpShape, Spread};
use crate::dag::Pass;

/// Seconds an op takes.
pub trait CostModel {
    /// A compute op or an optimizer step.
    fn compute(&self, op: &Op) -> f64;
    /// A send of `bytes` from device `from` to `to`.
    fn p2p(&self, bytes: u64, from: u32, to: u32) -> f64;
    /// A collective over `group` (every device, this one included).
    fn collective(&self, op: &Op, group: &[u32]) -> f64;
    /// The part of [`CostModel::compute`] that is communication inside the
    /// op (an expert pass exchanging its tokens inside the op: `shard` on
    /// `compute`). Reported as exposed communication, since the op waits on it.
    fn in_op_exchange(&self, op: &Op) -> f64;
    /// Of [`CostModel::in_op_exchange`], context parallelism's exchanges
    /// inside attention (reported on their own).
    fn in_op_context(&self, _op: &Op) -> f64 {
        0.0
    }
    /// Whether a node's devices share its compute (virtual devices on the
    /// cores of one machine), and how; `None`: each device computes on its
    /// own (GPUs).
    fn shared_compute(&self) -> Option<super::Sharing> {
        None
    }
    /// The fraction of its speed a device's compute loses while one of its
    /// transfers or collectives is in flight; `None`: none (or not modelled).
    fn contention(&self) -> Option<f64> {
        None
    }
}

/// AdamW reads parameters, gradients and two moments and writes three of
/// them back: seven passes over fp32 state per parameter byte.
pub(super) const ADAMW_PASSES: f64 = 7.0;

impl CostModel for Cluster {
    fn compute(&self, op: &Op) -> f64 {
        if let Act::Update = op.act {
            return ADAMW_PASSES * op.param_bytes as f64 / self.memory_bytes_per_s;
        }
        self.arithmetic(op) + self.in_op_exchange(op)
    }

    fn in_op_exchange(&self, op: &Op) -> f64 {
        self.in_op_context(op) + self.in_op_spread(op)
    }

    /// A context-parallel pass: all-gathered keys and values are waited
    /// for (ring collectives over its group sending `cp_bytes` in all, a
    /// latency per step); around the ring each block is passed on while
    /// the one in hand is attended to, so the transfers hide behind the
    /// op's arithmetic (the whole op's, an upper bound on the attention's)
    /// but for a latency per step.
    fn in_op_context(&self, op: &Op) -> f64 {
        match op.context_group() {
            Some(g) if op.cp_bytes > 0 && g.len() > 1 => {
                let n = g.len() as f64;
                let one_node = g.iter().all(|d| self.same_node(*d, g[0]));
                let (beta, alpha) = self.link(one_node);
                let transfer = op.cp_bytes as f64 / beta;
                match op.cp_ring {
                    true => (n - 1.0) * alpha + (transfer - self.arithmetic(op)).max(0.0),
                    false => (n - 1.0) * alpha + transfer,
                }
            }
            _ => 0.0,
        }
    }

    fn contention(&self) -> Option<f64> {
        self.device
            .as_ref()
            .map(|d| d.comm_slowdown)
            .filter(|s| *s > 0.0)
    }

    fn shared_compute(&self) -> Option<super::Sharing> {
        self.compute_slots
            .filter(|s| *s < f64::from(self.devices_per_node))
            .map(|slots| super::Sharing {
                devices_per_node: self.devices_per_node,
                slots,
            })
    }
    fn p2p(&self, bytes: u64, from: u32, to: u32) -> f64 {
        if from == to {
            return 0.0;
        }
        let (beta, alpha) = self.link(self.same_node(from, to));
        alpha + bytes as f64 / beta
    }

    fn collective(&self, op: &Op, group: &[u32]) -> f64 {
        let n = group.len() as f64;
        if n <= 1.0 {
            return 0.0;
        }
        let one_node = group.iter().all(|d| self.same_node(*d, group[0]));
        let (beta, alpha) = self.link(one_node);
        // A relayout: each member sends its pieces to the others at once;
        // the one that sends the most sets the time.
        if let Some(r) = op.relayout() {
            let most = group.iter().map(|d| r.sent_bytes(*d)).max().unwrap_or(0);
            return (n - 1.0) * alpha + most as f64 / beta;
        }
        let s = op.bytes as f64;
        // Ring: all-reduce moves 2(n−1)/n of the buffer over n−1 steps each
        // way; reduce-scatter, all-gather and all-to-all half of that.
        // Tree (double binary, as NCCL for all-reduce): 2·log2(n) latencies,
        // the buffer twice at link speed. Over several nodes the
        // hierarchical form too (`hierarchical`); the fastest is taken, as
        // NCCL's tuner does.
        let flat = match op.kind() {
            OpKind::AllReduce => {
                let ring = 2.0 * (n - 1.0) * alpha + 2.0 * (n - 1.0) / n * s / beta;
                let tree = 2.0 * n.log2().ceil() * alpha + 2.0 * s / beta;
                ring.min(tree)
            }
            _ => self.all_to_all(op.bytes, group),
        };
        match (one_node, op.kind()) {
            (true, _) | (false, OpKind::AllToAll) => flat,
            (false, kind) => flat.min(self.hierarchical(kind == OpKind::AllReduce, s, group)),
        }
    }
}

impl Cluster {
    /// A compute op's arithmetic: its fixed overhead and its FLOPs at its
    /// pass's efficiency, or with a device class and the op's shapes, its
    /// products, attention and memory-bound kernels as `sim::device` says
    /// (0 for what is not compute).
    fn arithmetic(&self, op: &Op) -> f64 {
        let Act::Compute { pass, .. } = op.act else {
            return 0.0;
        };
        let (eff, fixed) = self.pass_rate(pass);
        match (&self.device, &op.shape.0) {
            (Some(dev), Some(shape)) => fixed + self.shaped(dev, shape, eff),
            _ => fixed + op.flops / (self.peak_flops * eff),
        }
    }

    /// A pass's efficiency and fixed overhead per op.
    fn pass_rate(&self, pass: Pass) -> (f64, f64) {
        match pass {
            // A recompute is its forward again, at the forward's rate.
            Pass::F | Pass::R => (self.efficiency.f, self.op_overhead_s.f),
            Pass::B => (self.efficiency.b, self.op_overhead_s.b),
            Pass::BI => (self.efficiency.bi, self.op_overhead_s.bi),
            Pass::BW => (self.efficiency.bw, self.op_overhead_s.bw),
        }
    }

    /// A compute op's seconds in its weight products (with shapes; by
    /// FLOPs, all its arithmetic but the fixed overhead).
    fn products(&self, op: &Op) -> f64 {
        let Act::Compute { pass, .. } = op.act else {
            return 0.0;
        };
        let (eff, _) = self.pass_rate(pass);
        match (&self.device, &op.shape.0) {
            (Some(dev), Some(s)) => self.gemms_s(dev, s, eff),
            _ => op.flops / (self.peak_flops * eff),
        }
    }

    /// The weight products of a shaped op at `eff` of peak times the share
    /// its tiles and depth allow, no faster than their bytes over HBM.
    fn gemms_s(&self, dev: &DeviceClass, s: &OpShape, eff: f64) -> f64 {
        let peak = self.peak_for(dev, s.elem_bytes);
        (s.gemms.iter())
            .map(|g| {
                let flops = 2.0 * g.m * g.n * g.k;
                let rate = peak * eff * dev.gemm_share(g.m, g.n, g.k);
                let bytes = (g.m * g.k + g.k * g.n + g.m * g.n) * s.elem_bytes;
                g.count * (flops / rate).max(self.stream_s(dev, bytes))
            })
            .sum()
    }

    /// An op's time from its shapes (arithmetic at the device's peak for
    /// the operands' dtype): each product at `eff` of peak times
    /// the share its tiles and depth allow, no faster than its bytes over
    /// HBM; the attention kernel at its measured rate; the memory-bound
    /// kernels' bytes over HBM; a launch gap per kernel.
    fn shaped(&self, dev: &DeviceClass, s: &OpShape, eff: f64) -> f64 {
        self.gemms_s(dev, s, eff) + self.unscaled(dev, s)
    }

    /// The arithmetic peak for operands of `elem_bytes`: the cluster's
    /// (dense BF16), or for fp32 (4) the device class's FP32 one.
    fn peak_for(&self, dev: &DeviceClass, elem_bytes: f64) -> f64 {
        match elem_bytes >= 4.0 {
            true => dev.fp32_flops,
            false => self.peak_flops,
        }
    }

    /// Seconds to move `bytes` through HBM in streaming kernels: the
    /// cluster's bandwidth at the class's streaming efficiency.
    fn stream_s(&self, dev: &DeviceClass, bytes: f64) -> f64 {
        bytes / (self.memory_bytes_per_s * dev.memory_efficiency)
    }

    /// What of a shaped op the efficiencies do not scale: the attention
    /// kernel at its measured rate, the memory-bound kernels, the launches.
    fn unscaled(&self, dev: &DeviceClass, s: &OpShape) -> f64 {
        let attention = match s.attention_flops > 0.0 {
            true => {
                let rate = dev.attention_rate(s.attention_forward, s.attention_seq);
                s.attention_flops / (self.peak_for(dev, s.elem_bytes) * rate)
            }
            false => 0.0,
        };
        let (bytes, kernels) = match self.eager {
            true => (s.eager_stream_bytes, s.eager_kernels),
            false => (s.stream_bytes, s.kernels),
        };
        attention + self.stream_s(dev, bytes) + kernels * dev.kernel_launch_s
    }

    /// A compute op's shaped time in the two parts calibration fits it by:
    /// its products' seconds at an efficiency of 1 (their arithmetic, the
    /// HBM floor left out), which the pass's efficiency divides, and the
    /// seconds it does not scale ([`Cluster::unscaled`]). `None` without a
    /// device class or shapes.
    pub fn shaped_terms(&self, op: &Op) -> Option<(f64, f64)> {
        let (dev, s) = (self.device.as_ref()?, op.shape.0.as_ref()?);
        if !matches!(op.act, Act::Compute { .. }) {
            return None;
        }
        let peak = self.peak_for(dev, s.elem_bytes);
        let products = (s.gemms.iter())
            .map(|g| g.count * 2.0 * g.m * g.n * g.k / (peak * dev.gemm_share(g.m, g.n, g.k)))
            .sum();
        Some((products, self.unscaled(dev, s)))
    }

    fn in_op_spread(&self, op: &Op) -> f64 {
        // An expert pass exchanging inside its op waits for its two
        // all-to-alls (`shard` on `compute`; split passes have their own);
        // a tensor-parallel pass for its sums (as one ring all-reduce of
        // all their bytes: one latency, not one per sum).
        match (op.kind(), op.group(), op.spread, op.phase) {
            (
                OpKind::F | OpKind::R | OpKind::B | OpKind::BI,
                Some(g),
                Some(Spread::Experts),
                None,
            ) if op.bytes > 0 => 2.0 * self.all_to_all(op.bytes, g),
            (OpKind::F | OpKind::R | OpKind::B | OpKind::BI, Some(g), Some(Spread::Tensor), _)
                if op.bytes > 0 && g.len() > 1 =>
            {
                let n = g.len() as f64;
                let one_node = g.iter().all(|d| self.same_node(*d, g[0]));
                let (beta, alpha) = self.link(one_node);
                let sums = 2.0 * (n - 1.0) * alpha + 2.0 * (n - 1.0) / n * op.bytes as f64 / beta;
                match op.sp {
                    // Sequence parallelism's gathers and reduce-scatters
                    // inside the blocks run beside the products they feed
                    // or read, a member's rows at a time
                    // (`Model::gathered_products`, `scattered_products`):
                    // the member's own rows need no exchange, so they hide
                    // behind the other `(n − 1)/n` of the products unless
                    // they take longer, and what they hide slows them as
                    // any communication in flight does (`comm_slowdown`).
                    // The gather where a run of blocks ends waits. A plan
                    // read back without shapes counts all of it beside.
                    true => {
                        let beside = op.shape.0.as_ref().map_or(1.0, |s| {
                            (s.tp_overlap_bytes / op.bytes as f64).clamp(0.0, 1.0)
                        });
                        let hidden = ((n - 1.0) / n * self.products(op)).min(sums * beside);
                        sums - hidden + hidden * self.contention().unwrap_or(0.0)
                    }
                    false => sums,
                }
            }
            _ => 0.0,
        }
    }

    /// A collective over several nodes in two levels, as NCCL runs it with
    /// a NIC per GPU: inside each node a reduce-scatter over NVLink, then
    /// each member's `1/g` share reduced among the members of the same local
    /// rank on the other nodes, each over its own NIC, then an all-gather
    /// inside the node (an all-reduce does all three; a reduce-scatter the
    /// first two, an all-gather the last two, the same time). `g` is the
    /// most members on one node, `k` the nodes the group spans.
    fn hierarchical(&self, all_reduce: bool, bytes: f64, group: &[u32]) -> f64 {
        let mut nodes: Vec<u32> = group.iter().map(|d| d / self.devices_per_node).collect();
        nodes.sort_unstable();
        let (mut g, mut run, mut k) = (1u32, 0u32, 0u32);
        for (i, node) in nodes.iter().enumerate() {
            if i == 0 || nodes[i - 1] != *node {
                k += 1;
                run = 0;
            }
            run += 1;
            g = g.max(run);
        }
        let (g, k) = (f64::from(g), f64::from(k));
        let (bi, ai) = self.link(true);
        let (bx, ax) = self.link(false);
        let inside = (g - 1.0) * ai + (g - 1.0) / g * bytes / bi;
        let between = (k - 1.0) * ax + (k - 1.0) / k * (bytes / g) / bx;
        match all_reduce {
            true => 2.0 * (inside + between),
            false => inside + between,
        }
    }

    /// Ring-style exchange of `bytes` per device over `group` (reduce-scatter,
    /// all-gather and all-to-all alike): `(n−1)/n` of it leaves each device.
    fn all_to_all(&self, bytes: u64, group: &[u32]) -> f64 {
        let n = group.len() as f64;
        if n <= 1.0 {
            return 0.0;
        }
        let one_node = group.iter().all(|d| self.same_node(*d, group[0]));
        let (beta, alpha) = self.link(one_node);
        (n - 1.0) * alpha + (n - 1.0) / n * bytes as f64 / beta
    }

    /// (bytes/s, latency) of the link between two devices.
    fn link(&self, same_node: bool) -> (f64, f64) {
        if same_node {
            (self.intra_bytes_per_s, self.intra_latency_s)
        } else {
            (self.inter_bytes_per_s, self.inter_latency_s)
        }
    }
}

/// Fixed seconds per op kind and free communication: the setting of the
/// published bubble formulas (F, B, W per microbatch and stage).
#[derive(Clone, Copy, Debug)]
pub struct UnitCosts {
    pub f: f64,
    /// A fused backward (input and weight gradients).
    pub b: f64,
    /// The input-gradient half of a split backward.
    pub bi: f64,
    /// The weight-gradient half (W).
    pub bw: f64,
}

impl CostModel for UnitCosts {
    fn compute(&self, op: &Op) -> f64 {
        match op.act {
            Act::Compute { pass, .. } => match pass {
                Pass::F | Pass::R => self.f,
                Pass::B => self.b,
                Pass::BI => self.bi,
                Pass::BW => self.bw,
            },
            Act::Send { .. }
            | Act::Recv { .. }
            | Act::Collective { .. }
            | Act::Relayout { .. }
            | Act::Update => 0.0,
        }
    }
    fn p2p(&self, _: u64, _: u32, _: u32) -> f64 {
        0.0
    }
    fn collective(&self, _: &Op, _: &[u32]) -> f64 {
        0.0
    }
    fn in_op_exchange(&self, _: &Op) -> f64 {
        0.0
    }
}

//! MoE routing as the kernels see it: each token's top-k choices, their
//! renormalised weights and capacity slots, made on the host from the
//! router's probabilities (the experts' composition is `runtime/model/moe.rs`).

use crate::model::MoeConfig;

/// Marks an assignment dropped for capacity.
pub const DROPPED: u32 = u32::MAX;

/// Shapes of one MoE forward: `n` tokens in sequences of `t` (this
/// device's rows of each; `seq` positions in all, more than `t` when a
/// context-parallel group shares the sequences).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub n: usize,
    pub t: usize,
    pub seq: usize,
    pub c: usize,
    pub e: usize,
    pub k: usize,
    pub hid: usize,
}

impl MoeDims {
    pub fn new(moe: &MoeConfig, n: usize, t: usize, c: usize) -> Self {
        MoeDims {
            n,
            t,
            seq: t,
            c,
            e: moe.experts as usize,
            k: moe.top_k as usize,
            hid: moe.hidden_width(c as u32) as usize,
        }
    }
    /// Sequences of `seq` positions of which this device holds `t`.
    pub fn of_sequences(self, seq: usize) -> Self {
        MoeDims { seq, ..self }
    }
}

/// Where each token's choices went (host arrays).
#[derive(Clone, Debug, Default)]
pub struct Routing {
    /// Choices per token (`top_k`).
    pub k: usize,
    /// `[n, k]`: the expert of each choice.
    pub choice: Vec<u32>,
    /// `[n, k]`: its renormalised weight.
    pub weight: Vec<f32>,
    /// `[n, k]`: its row in the expert's batch, or [`DROPPED`].
    pub slot: Vec<u32>,
    /// Per expert: the assignments (`token × k + j`) it runs, in row order.
    pub rows: Vec<Vec<u32>>,
    /// Assignments dropped for capacity.
    pub dropped: u64,
}

impl Routing {
    /// Host bytes the routing keeps (counted with the cache it is in).
    pub(crate) fn bytes(&self) -> u64 {
        (self.weight.len()
            + self.choice.len()
            + self.slot.len()
            + self.rows.iter().map(Vec::len).sum::<usize>()) as u64
            * 4
    }
}

/// Top-k choices of every token, renormalised weights, and the capacity
/// assignment (first choices first, each in token order).
pub fn route(probs: &[f32], d: MoeDims, capacity_factor: Option<f64>) -> Routing {
    let MoeDims { n, e, k, .. } = d;
    let mut choice = vec![0u32; n * k];
    let mut weight = vec![0.0f32; n * k];
    let mut taken = vec![false; e];
    for t in 0..n {
        let p = &probs[t * e..][..e];
        let ch = &mut choice[t * k..][..k];
        // Selection by repeated max: k is small; ties go to the lower index.
        taken.iter_mut().for_each(|x| *x = false);
        let mut sum = 0.0f32;
        for c in ch.iter_mut() {
            let mut best = usize::MAX;
            for (x, &px) in p.iter().enumerate() {
                if !taken[x] && (best == usize::MAX || px > p[best]) {
                    best = x;
                }
            }
            taken[best] = true;
            *c = best as u32;
            sum += p[best];
        }
        for (w, c) in weight[t * k..][..k].iter_mut().zip(ch.iter()) {
            *w = p[*c as usize] / sum;
        }
    }
    let cap = capacity_factor.map_or(usize::MAX, |cf| {
        // cf ≤ 1e6 and n·k ≤ 2^60 (checked by the config): finite.
        (cf * (n * k) as f64 / e as f64).ceil() as usize
    });
    let mut rows: Vec<Vec<u32>> = vec![Vec::new(); e];
    let mut slot = vec![DROPPED; n * k];
    let mut dropped = 0u64;
    for j in 0..k {
        for t in 0..n {
            let a = t * k + j;
            let r = &mut rows[choice[a] as usize];
            if r.len() < cap {
                slot[a] = r.len() as u32;
                r.push(a as u32);
            } else {
                dropped += 1;
            }
        }
    }
    Routing {
        k,
        choice,
        weight,
        slot,
        rows,
        dropped,
    }
}

//! Calibration: a cluster description fitted to measured steps of the CPU
//! runtime (`piper calibrate`), so the simulator predicts this machine.
//!
//! Each op's time is its trimmed mean over the measured steps (the fastest
//! and slowest tenth left out). Not the median: on shared cores most ops
//! are slowed now and then by a preempting thread, the median of each op
//! leaves every such slowdown out, yet a step pays them all (most on `dp`,
//! whose devices compute back to back with no bubble to absorb them). The
//! mean keeps them; trimming drops the rare stall of tens of milliseconds.
//!
//! Compute ops are fitted per kind as `overhead + FLOPs / rate` (least
//! squares, overhead ≥ 0); optimizer steps as the AdamW bytes at a memory
//! bandwidth; transfers and collectives jointly as `α·k + bytes·k'/β` with
//! the coefficients of the cost model (a send: 1 and 1; a ring all-reduce
//! over n: 2(n−1) and 2(n−1)/n; the other collectives half that), so the
//! fitted cluster costs them exactly as [`super::cost`] does.
//!
//! A GPU measured on a cluster with a device class (`piper calibrate
//! --backend cuda`) is fitted on its ops' shapes instead: per pass, the
//! measured time less what the device class costs at fixed rates
//! (attention, memory-bound kernels, launches) is `overhead + products ÷
//! efficiency`; peak, device class and links stay the base cluster's.

use super::cluster::{Cluster, Efficiency, Overhead};
use super::Simulation;
use crate::compile::plan::{OpKind, Plan};

/// Per-op times gathered from measured runs.
#[derive(Clone, Debug, Default)]
pub struct Samples {
    /// (FLOPs, seconds) per compute kind: F, B, BI, BW.
    pub compute: [Vec<(f64, f64)>; 4],
    /// (AdamW bytes moved, seconds) per optimizer step.
    pub update: Vec<(f64, f64)>,
    /// (latency coefficient, bytes × bandwidth coefficient, seconds).
    pub comm: Vec<(f64, f64, f64)>,
    /// On a cluster with a device class, per compute kind: (seconds of the
    /// op's products at an efficiency of 1, seconds of the rest of its
    /// shaped cost, measured seconds). See [`Cluster::shaped_terms`].
    pub shaped: [Vec<(f64, f64, f64)>; 4],
}

/// How well a fitted kind explains its samples.
#[derive(Clone, Debug)]
pub struct Fit {
    pub kind: &'static str,
    pub samples: usize,
    /// Σ predicted ÷ Σ measured − 1.
    pub total_error: f64,
    /// The largest |predicted ÷ measured − 1| of one op.
    pub worst_error: f64,
}

/// Calibration that could not be fitted.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    #[error("no measured step to calibrate from")]
    NoSteps,
    #[error("the measured steps are of different plans ({0} ops vs {1})")]
    Mismatch(usize, usize),
    #[error("no {0} op took a measurable time: cannot fit its rate")]
    Unmeasured(&'static str),
}

const KINDS: [(OpKind, &str); 4] = [
    (OpKind::F, "F"),
    (OpKind::B, "B"),
    (OpKind::BI, "BI"),
    (OpKind::BW, "BW"),
];

/// AdamW bytes an optimizer step moves (see [`super::cost`]).
fn adamw_bytes(op: &crate::compile::plan::Op) -> f64 {
    super::cost::ADAMW_PASSES * op.param_bytes as f64
}

/// The mean of `v` without its fastest and slowest tenth (⌊n/10⌋ each).
fn trimmed_mean(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let k = v.len() / 10;
    let kept = &v[k..v.len() - k];
    kept.iter().sum::<f64>() / kept.len() as f64
}

impl Samples {
    /// Add every op of `plan` with its trimmed mean time over `steps` (measured
    /// steps of that plan, e.g. [`super::measured::from_trace`] per step).
    pub fn add(&mut self, plan: &Plan, steps: &[Simulation]) -> Result<(), CalibrateError> {
        self.add_on(plan, steps, None)
    }

    /// As [`Samples::add`]; on `base` with a device class (a GPU measured)
    /// each compute op is a sample of its pass's efficiency on its shapes.
    pub fn add_on(
        &mut self,
        plan: &Plan,
        steps: &[Simulation],
        base: Option<&Cluster>,
    ) -> Result<(), CalibrateError> {
        if steps.is_empty() {
            return Err(CalibrateError::NoSteps);
        }
        let ix = super::OpIndex::of(plan);
        for s in steps {
            if s.spans.len() != ix.at.len() {
                return Err(CalibrateError::Mismatch(ix.at.len(), s.spans.len()));
            }
        }
        let mut times = Vec::with_capacity(steps.len());
        for (g, &(d, _, i)) in ix.at.iter().enumerate() {
            let op = &plan.devices[d as usize].streams[ix.local[g] as usize].ops[i as usize];
            times.clear();
            times.extend(steps.iter().map(|s| s.spans[g].end - s.spans[g].start));
            let t = trimmed_mean(&mut times);
            // A recompute is a sample of the forward's rate.
            let kind = if op.kind() == OpKind::R {
                OpKind::F
            } else {
                op.kind()
            };
            if let Some(k) = KINDS.iter().position(|(k, _)| *k == kind) {
                match base.and_then(|c| c.shaped_terms(op)) {
                    Some((products, rest)) => self.shaped[k].push((products, rest, t)),
                    None => self.compute[k].push((op.flops, t)),
                }
                continue;
            }
            let n = op.group().map_or(1, |g| g.len()) as f64;
            let b = op.bytes as f64;
            match op.kind() {
                OpKind::Update if op.param_bytes > 0 => self.update.push((adamw_bytes(op), t)),
                OpKind::Send => self.comm.push((1.0, b, t)),
                OpKind::AllReduce if n > 1.0 => {
                    self.comm
                        .push((2.0 * (n - 1.0), 2.0 * (n - 1.0) / n * b, t))
                }
                OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll if n > 1.0 => {
                    self.comm.push((n - 1.0, (n - 1.0) / n * b, t))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The cluster these samples describe: `base` (name, memory, device
    /// count) with its rates, overheads and links fitted. Also how well each
    /// fitted kind matches its samples.
    pub fn fit(&self, base: &Cluster) -> Result<(Cluster, Vec<Fit>), CalibrateError> {
        if base.device.is_some() && !self.shaped[0].is_empty() {
            return self.fit_shaped(base);
        }
        let mut rates = [0.0; 4];
        let mut overheads = [0.0; 4];
        let mut fits = Vec::new();
        for (k, (_, name)) in KINDS.iter().enumerate() {
            let pts = &self.compute[k];
            if pts.is_empty() {
                continue;
            }
            let (slope, c) = line_fit(pts);
            if !(slope.is_finite() && slope > 0.0) {
                return Err(CalibrateError::Unmeasured(name));
            }
            rates[k] = 1.0 / slope;
            overheads[k] = c;
            fits.push(quality(name, pts.iter().map(|&(f, t)| (c + f * slope, t))));
        }
        if rates[0] == 0.0 {
            return Err(CalibrateError::Unmeasured("F"));
        }
        if rates[1] == 0.0 {
            return Err(CalibrateError::Unmeasured("B"));
        }
        // A split backward not measured: its halves run at B's rate.
        for k in [2, 3] {
            if rates[k] == 0.0 {
                rates[k] = rates[1];
                overheads[k] = overheads[1];
            }
        }
        let mut c = base.clone();
        c.peak_flops = rates[0];
        c.efficiency = Efficiency {
            f: 1.0,
            b: rates[1] / rates[0],
            bi: rates[2] / rates[0],
            bw: rates[3] / rates[0],
        };
        c.op_overhead_s = Overhead::from(overheads);
        self.fit_update(&mut c, &mut fits);
        if !self.comm.is_empty() {
            let (alpha, inv_beta) = comm_fit(&self.comm);
            c.intra_latency_s = alpha;
            c.inter_latency_s = alpha;
            if inv_beta > 0.0 {
                c.intra_bytes_per_s = 1.0 / inv_beta;
                c.inter_bytes_per_s = 1.0 / inv_beta;
            }
            fits.push(quality(
                "comm",
                self.comm
                    .iter()
                    .map(|&(ka, kb, t)| (ka * alpha + kb * inv_beta, t)),
            ));
        }
        Ok((c, fits))
    }
}

impl Samples {
    /// A GPU measured on `base`'s device class: per pass `t − rest =
    /// overhead + products ÷ efficiency` (least squares, overhead ≥ 0), the
    /// optimizer's memory rate as on the CPU; peak, device class and links
    /// stay `base`'s (virtual devices on one GPU measure no network), and so
    /// does its HBM rate, which the fixed-rate part was costed at.
    fn fit_shaped(&self, base: &Cluster) -> Result<(Cluster, Vec<Fit>), CalibrateError> {
        let mut eff = [0.0; 4];
        let mut overheads = [0.0; 4];
        let mut fits = Vec::new();
        for (k, (_, name)) in KINDS.iter().enumerate() {
            let pts: Vec<(f64, f64)> = self.shaped[k].iter().map(|&(x, r, t)| (x, t - r)).collect();
            if pts.is_empty() {
                continue;
            }
            let (slope, c) = line_fit(&pts);
            if !(slope.is_finite() && slope > 0.0) {
                return Err(CalibrateError::Unmeasured(name));
            }
            eff[k] = 1.0 / slope;
            overheads[k] = c;
            let predicted = self.shaped[k]
                .iter()
                .map(|&(x, r, t)| (c + x * slope + r, t));
            fits.push(quality(name, predicted));
        }
        for (k, name) in [(0, "F"), (1, "B")] {
            if eff[k] == 0.0 {
                return Err(CalibrateError::Unmeasured(name));
            }
        }
        for k in [2, 3] {
            if eff[k] == 0.0 {
                eff[k] = eff[1];
                overheads[k] = overheads[1];
            }
        }
        let mut c = base.clone();
        c.efficiency = Efficiency {
            f: eff[0],
            b: eff[1],
            bi: eff[2],
            bw: eff[3],
        };
        c.op_overhead_s = Overhead::from(overheads);
        // The memory-bound kernels were taken at `base`'s HBM rate: the
        // fitted cluster keeps it (AdamW's rate is not refitted here).
        Ok((c, fits))
    }

    /// The optimizer steps' memory rate: their AdamW bytes over their time.
    fn fit_update(&self, c: &mut Cluster, fits: &mut Vec<Fit>) {
        let (bytes, secs) = self
            .update
            .iter()
            .fold((0.0, 0.0), |a, (b, t)| (a.0 + b, a.1 + t));
        if bytes > 0.0 && secs > 0.0 {
            c.memory_bytes_per_s = bytes / secs;
            let bw = c.memory_bytes_per_s;
            fits.push(quality(
                "update",
                self.update.iter().map(|&(b, t)| (b / bw, t)),
            ));
        }
    }
}

/// Least squares `t = c + slope·x` with `c ≥ 0`; through the origin when
/// every x is the same or the intercept would be negative.
fn line_fit(pts: &[(f64, f64)]) -> (f64, f64) {
    let n = pts.len() as f64;
    let (sx, st) = pts.iter().fold((0.0, 0.0), |a, p| (a.0 + p.0, a.1 + p.1));
    let (mx, mt) = (sx / n, st / n);
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let sxt: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - mt)).sum();
    if sxx > 1e-12 * (mx * mx * n).max(f64::MIN_POSITIVE) {
        let slope = sxt / sxx;
        let c = mt - slope * mx;
        if slope > 0.0 && c >= 0.0 {
            return (slope, c);
        }
    }
    let sxx0: f64 = pts.iter().map(|p| p.0 * p.0).sum();
    let sxt0: f64 = pts.iter().map(|p| p.0 * p.1).sum();
    if sxx0 > 0.0 {
        (sxt0 / sxx0, 0.0)
    } else {
        (f64::NAN, 0.0)
    }
}

/// Least squares `t = α·ka + kb/β` over (α, 1/β), both ≥ 0.
fn comm_fit(pts: &[(f64, f64, f64)]) -> (f64, f64) {
    let (mut aa, mut ab, mut bb, mut at, mut bt) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(a, b, t) in pts {
        aa += a * a;
        ab += a * b;
        bb += b * b;
        at += a * t;
        bt += b * t;
    }
    let det = aa * bb - ab * ab;
    if det.abs() > 1e-12 * (aa * bb).max(f64::MIN_POSITIVE) {
        let alpha = (at * bb - bt * ab) / det;
        let inv_beta = (aa * bt - ab * at) / det;
        if alpha >= 0.0 && inv_beta >= 0.0 {
            return (alpha, inv_beta);
        }
    }
    // One of them is not supported by the data: the better single term.
    let only_beta = if bb > 0.0 { (bt / bb).max(0.0) } else { 0.0 };
    let only_alpha = if aa > 0.0 { (at / aa).max(0.0) } else { 0.0 };
    let err = |alpha: f64, ib: f64| -> f64 {
        pts.iter()
            .map(|&(a, b, t)| (alpha * a + ib * b - t).powi(2))
            .sum()
    };
    if err(0.0, only_beta) <= err(only_alpha, 0.0) {
        (0.0, only_beta)
    } else {
        (only_alpha, 0.0)
    }
}

/// How well (predicted, measured) pairs agree.
fn quality(kind: &'static str, pairs: impl Iterator<Item = (f64, f64)>) -> Fit {
    let (mut p, mut m, mut worst, mut samples) = (0.0, 0.0, 0.0f64, 0);
    for (y, t) in pairs {
        p += y;
        m += t;
        samples += 1;
        if t > 0.0 {
            worst = worst.max((y / t - 1.0).abs());
        }
    }
    Fit {
        kind,
        samples,
        total_error: if m > 0.0 { p / m - 1.0 } else { 0.0 },
        worst_error: worst,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_op_time_keeps_frequent_slowdowns_and_drops_a_rare_stall() {
        // Ten steps of 1 ms with three slowed by 0.3 ms, one stalled 40 ms
        // and one unusually fast: the steps pay the slowdowns (1.09 ms on
        // average over the eight kept), not the stall.
        let mut t = [1.0, 1.3, 1.0, 1.0, 41.0, 1.3, 1.0, 0.5, 1.0, 1.3].map(|x| x * 1e-3);
        let m = trimmed_mean(&mut t);
        assert!((m - 8.9e-3 / 8.0).abs() < 1e-12, "{m}");
        // Fewer than ten samples: nothing is trimmed, the plain mean.
        let mut few = [2.0, 4.0, 9.0];
        assert_eq!(trimmed_mean(&mut few), 5.0);
    }

    #[test]
    fn a_line_with_an_overhead_is_recovered() {
        let pts: Vec<(f64, f64)> = [1e6, 2e6, 5e6, 9e6]
            .iter()
            .map(|&f| (f, 3e-4 + f / 2e9))
            .collect();
        let (slope, c) = line_fit(&pts);
        assert!((1.0 / slope / 2e9 - 1.0).abs() < 1e-9);
        assert!((c / 3e-4 - 1.0).abs() < 1e-9);
        // Every x the same: through the origin.
        let (slope, c) = line_fit(&[(4.0, 2.0), (4.0, 2.0)]);
        assert_eq!((slope, c), (0.5, 0.0));
    }

    #[test]
    fn latency_and_bandwidth_are_recovered_from_sends_and_all_reduces() {
        let (alpha, beta) = (20e-6, 3e9);
        let mut pts = Vec::new();
        for bytes in [1e3, 1e5, 1e6, 8e6] {
            pts.push((1.0, bytes, alpha + bytes / beta));
            pts.push((2.0, bytes, 2.0 * alpha + bytes / beta)); // ring over 2
        }
        let (a, ib) = comm_fit(&pts);
        assert!((a / alpha - 1.0).abs() < 1e-6, "{a}");
        assert!((1.0 / ib / beta - 1.0).abs() < 1e-6, "{}", 1.0 / ib);
    }

    #[test]
    fn a_fitted_cluster_costs_the_samples_it_came_from() {
        let mut s = Samples::default();
        for f in [1e8, 3e8, 6e8] {
            s.compute[0].push((f, 1e-3 + f / 4e10));
            s.compute[1].push((2.0 * f, 2e-3 + 2.0 * f / 3e10));
        }
        s.update.push((7e6, 7e6 / 5e9));
        let (c, fits) = s.fit(&Cluster::cpu_local_default()).unwrap();
        c.validate().unwrap();
        assert!((c.peak_flops / 4e10 - 1.0).abs() < 1e-9);
        assert!((c.efficiency.b * c.peak_flops / 3e10 - 1.0).abs() < 1e-9);
        assert!((c.op_overhead_s.b / 2e-3 - 1.0).abs() < 1e-9);
        // BI and BW, not measured, run at B's rate.
        assert_eq!(c.efficiency.bi, c.efficiency.b);
        assert!((c.memory_bytes_per_s / 5e9 - 1.0).abs() < 1e-9);
        for f in fits {
            assert!(f.worst_error < 1e-9, "{f:?}");
        }
        // Nothing measured for F: a clear error, not a zero rate.
        let mut empty = Samples::default();
        empty.compute[1].push((1.0, 1.0));
        assert!(matches!(
            empty.fit(&Cluster::cpu_local_default()),
            Err(CalibrateError::Unmeasured("F"))
        ));
    }
}

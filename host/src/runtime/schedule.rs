//! Learning-rate schedules: the AdamW learning rate of every step, a pure
//! function of the step, so a resumed run continues its schedule exactly.
//! Read by [`super::Trainer::step`] before the step's update runs.
//!
//! Steps are 1-based. With `warmup = W` steps, step `s ≤ W` runs at
//! `peak · s / W` (nanoGPT's and torchtitan's linear warmup, the first step
//! above zero). After warmup:
//! - `constant`: `peak`;
//! - `cosine`: from `peak` at the end of warmup down to `min` at the last
//!   step (`total`), `min + (peak − min) · ½ (1 + cos(π p))` with
//!   `p = (s − W) / (total − W)`;
//! - `wsd` (warmup-stable-decay, torchtitan's linear decay): `peak` until
//!   the last `decay_steps`, then linearly to `min` at `total`.

use serde::{Deserialize, Serialize};

/// How the learning rate falls after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Decay {
    Constant,
    Cosine,
    Wsd { decay_steps: u32 },
}

/// A learning-rate schedule over a run of `total` steps.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// The learning rate after warmup (AdamW's `lr`).
    pub peak: f32,
    /// Where `cosine` and `wsd` end.
    pub min: f32,
    pub warmup: u32,
    pub decay: Decay,
    /// The run's last step (`--steps`).
    pub total: u32,
}

impl Schedule {
    /// A constant rate from the first step.
    pub fn constant(lr: f32) -> Self {
        Schedule {
            peak: lr,
            min: lr,
            warmup: 0,
            decay: Decay::Constant,
            total: 1,
        }
    }

    /// Every number checked: a schedule that would divide by zero, run
    /// backwards or leave the range of a learning rate is an error saying
    /// which number is wrong.
    pub fn check(&self) -> Result<(), String> {
        if !(self.peak.is_finite() && self.peak > 0.0) {
            return Err(format!(
                "the learning rate must be a positive number, got {}",
                self.peak
            ));
        }
        if self.total == 0 {
            return Err("a schedule needs at least one step".into());
        }
        if self.warmup > self.total {
            return Err(format!(
                "--warmup {} is longer than the schedule ({} steps)",
                self.warmup, self.total
            ));
        }
        if self.decay != Decay::Constant && !(self.min.is_finite() && self.min >= 0.0) {
            return Err(format!(
                "--min-lr must be 0 or a positive number, got {}",
                self.min
            ));
        }
        if self.decay != Decay::Constant && self.min > self.peak {
            return Err(format!(
                "--min-lr {} is above the peak learning rate {}",
                self.min, self.peak
            ));
        }
        if let Decay::Wsd { decay_steps } = self.decay {
            if decay_steps == 0 || decay_steps > self.total - self.warmup {
                return Err(format!(
                    "--decay-steps {decay_steps} must be between 1 and the {} steps after warmup",
                    self.total - self.warmup
                ));
            }
        }
        Ok(())
    }

    /// The learning rate of `step` (1-based). Steps past `total` stay at
    /// the schedule's last rate.
    pub fn lr(&self, step: u32) -> f32 {
        let (peak, min) = (self.peak as f64, self.min as f64);
        let s = step.max(1) as f64;
        let w = self.warmup as f64;
        if s <= w {
            return (peak * s / w) as f32;
        }
        let total = self.total as f64;
        let lr = match self.decay {
            Decay::Constant => peak,
            Decay::Cosine => {
                let span = total - w;
                // Warmup over the whole run leaves no decay phase.
                if span <= 0.0 {
                    return self.peak;
                }
                let p = ((s - w) / span).min(1.0);
                min + (peak - min) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
            Decay::Wsd { decay_steps } => {
                let d = decay_steps as f64;
                let start = total - d;
                if s <= start {
                    peak
                } else {
                    let p = ((s - start) / d).min(1.0);
                    peak - (peak - min) * p
                }
            }
        };
        lr as f32
    }

    /// Whether a run resumed under `self` continues the schedule the
    /// checkpoint `saved` was trained under: the first difference, named.
    /// The run's length matters only to schedules that decay.
    pub fn continues(&self, saved: &Schedule) -> Result<(), String> {
        let mut diffs = Vec::new();
        if self.peak != saved.peak {
            diffs.push(format!(
                "--lr {} (the checkpoint's {})",
                self.peak, saved.peak
            ));
        }
        if self.warmup != saved.warmup {
            diffs.push(format!(
                "--warmup {} (the checkpoint's {})",
                self.warmup, saved.warmup
            ));
        }
        if self.decay != saved.decay {
            diffs.push(format!(
                "--schedule {} (the checkpoint's {})",
                self.decay_name(),
                saved.decay_name()
            ));
        } else if self.decay != Decay::Constant {
            if self.min != saved.min {
                diffs.push(format!(
                    "--min-lr {} (the checkpoint's {})",
                    self.min, saved.min
                ));
            }
            if self.total != saved.total {
                diffs.push(format!(
                    "a schedule ending at step {} (the checkpoint's ends at {}: give --schedule-steps {})",
                    self.total, saved.total, saved.total
                ));
            }
        }
        match diffs.is_empty() {
            true => Ok(()),
            false => Err(diffs.join(", ")),
        }
    }

    fn decay_name(&self) -> String {
        match self.decay {
            Decay::Constant => "constant".into(),
            Decay::Cosine => "cosine".into(),
            Decay::Wsd { decay_steps } => format!("wsd with --decay-steps {decay_steps}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f64) {
        assert!(
            (a as f64 - b).abs() <= 1e-7 * b.abs().max(1e-3),
            "{a} vs {b}"
        );
    }

    #[test]
    fn warmup_then_cosine_follows_its_formula() {
        let s = Schedule {
            peak: 6e-4,
            min: 6e-5,
            warmup: 10,
            decay: Decay::Cosine,
            total: 110,
        };
        s.check().unwrap();
        close(s.lr(1), 6e-5);
        close(s.lr(5), 3e-4);
        close(s.lr(10), 6e-4);
        // Halfway through the decay: the midpoint of peak and min.
        close(s.lr(60), 6e-5 + (6e-4 - 6e-5) * 0.5);
        // A quarter: ½(1 + cos(π/4)).
        let q = 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos());
        close(s.lr(35), 6e-5 + (6e-4 - 6e-5) * q);
        close(s.lr(110), 6e-5);
        close(s.lr(500), 6e-5);
    }

    #[test]
    fn wsd_is_flat_then_linear() {
        let s = Schedule {
            peak: 1e-3,
            min: 0.0,
            warmup: 4,
            decay: Decay::Wsd { decay_steps: 20 },
            total: 100,
        };
        s.check().unwrap();
        close(s.lr(2), 5e-4);
        close(s.lr(4), 1e-3);
        close(s.lr(80), 1e-3);
        close(s.lr(85), 1e-3 * 0.75);
        close(s.lr(90), 5e-4);
        close(s.lr(100), 0.0);
    }

    #[test]
    fn constant_ignores_the_run_length() {
        let s = Schedule::constant(3e-3);
        close(s.lr(1), 3e-3);
        close(s.lr(1_000_000), 3e-3);
        let longer = Schedule { total: 500, ..s };
        assert!(longer.continues(&s).is_ok());
        let cos = Schedule {
            decay: Decay::Cosine,
            total: 500,
            min: 0.0,
            ..s
        };
        let e = cos.continues(&s).unwrap_err();
        assert!(
            e.contains("--schedule cosine (the checkpoint's constant)"),
            "{e}"
        );
        let cos2 = Schedule { total: 600, ..cos };
        let e = cos2.continues(&cos).unwrap_err();
        assert!(
            e.contains(
                "ending at step 600 (the checkpoint's ends at 500: give --schedule-steps 500)"
            ),
            "{e}"
        );
    }

    #[test]
    fn hostile_numbers_are_refused_by_name() {
        let base = Schedule {
            peak: 1e-3,
            min: 0.0,
            warmup: 10,
            decay: Decay::Cosine,
            total: 100,
        };
        let cases = [
            (
                Schedule {
                    peak: f32::NAN,
                    ..base
                },
                "positive",
            ),
            (Schedule { peak: 0.0, ..base }, "positive"),
            (
                Schedule {
                    warmup: 101,
                    ..base
                },
                "--warmup 101",
            ),
            (Schedule { min: -1.0, ..base }, "--min-lr"),
            (
                Schedule {
                    min: f32::INFINITY,
                    ..base
                },
                "--min-lr",
            ),
            (Schedule { min: 1.0, ..base }, "above the peak"),
            (
                Schedule {
                    decay: Decay::Wsd { decay_steps: 91 },
                    ..base
                },
                "--decay-steps 91",
            ),
            (
                Schedule {
                    decay: Decay::Wsd { decay_steps: 0 },
                    ..base
                },
                "--decay-steps 0",
            ),
        ];
        for (s, want) in cases {
            let e = s.check().unwrap_err();
            assert!(e.contains(want), "{s:?}: {e}");
        }
        // Warmup over the whole run is allowed and never divides by zero.
        let all = Schedule {
            warmup: 100,
            ..base
        };
        all.check().unwrap();
        close(all.lr(100), 1e-3);
        close(all.lr(101), 1e-3);
    }
}

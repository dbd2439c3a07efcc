//! Initialisation, on the host: every parameter's values depend only on the
//! seed and the parameter (its name seeds the generator), so they are the
//! same wherever a strategy places it and on every backend; a device
//! uploads its part.

use crate::model::params::{Init, ParamId, ParamTable};

/// SplitMix64: a small, well-mixed generator for reproducible initialisation.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        // Box–Muller.
        let (u1, u2) = (self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// FNV-1a of the name, mixed with the seed.
fn name_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The initial values of parameter `id` of a model of `layers` layers
/// (GPT-2's initialisation: [`crate::model::params::Entry::init`]).
pub fn param_values(table: &ParamTable, id: ParamId, layers: u32, seed: u64) -> Vec<f32> {
    let entry = table.entry(id);
    let n = entry.numel();
    match entry.init(layers) {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Normal { std } => {
            let mut rng = SplitMix(name_seed(seed, table.name(id)));
            (0..n).map(|_| rng.normal() * std).collect()
        }
    }
}

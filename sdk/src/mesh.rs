//! Device meshes: which devices each parallelism of a composed layout gets.
//!
//! Strategies compose on one device mesh. By default its axes run, from
//! the fastest-varying: tensor parallelism (`tp`, its groups contiguous, so
//! inside a node), then pipeline positions, then data parallelism (`dp`,
//! `zero`, its replicas `devices ÷ degree` apart). On 8 devices, tp 2 × pp
//! 2 × dp 2 puts replica 0's stage 0 on [0, 1], its stage 1 on [2, 3] and
//! replica 1 on [4, 5] and [6, 7]: device `i·(devices/dp) + s·tp + j`.
//!
//! Each strategy gives only its own axis's group; the host lays meshes:
//! `shard-tensor` on a replicated model lays its group's shape on every
//! replica, `replicate` on a tensor-parallel model lays the model's group
//! on every replica's device, and a pipeline shifts the whole group by the
//! smallest step that keeps its positions apart ([`crate::pipeline`]). So
//! `dp`, `zero` and `tp` compose in either order, and before a pipeline.
//! A `stride` option on `dp` and `zero` chooses another order: `stride` =
//! tp puts the replicas next to each other (Megatron-LM's `tp-dp-pp`).

use crate::{Dag, Error, Filter, Pass};

/// The device group every forward sits on, after the strategies applied
/// so far (`None` when nothing is placed yet). A strategy that spreads the
/// whole model (`dp`, `zero`, `tp`) needs it on one group: `who` is refused
/// after a pipeline, naming both groups found.
pub fn model_group(dag: &mut dyn Dag, who: &str) -> Result<Option<Vec<u32>>, Error> {
    let forwards = dag.query(&Filter::all().pass(Pass::F))?;
    let first = forwards
        .first()
        .map(|n| n.devices.clone())
        .unwrap_or_default();
    if let Some(other) = forwards.iter().find(|n| n.devices != first) {
        return Err(Error::msg(format!(
            "{who} spreads the whole model, but a strategy before it put forwards on {:?} and {:?}: apply {who} before the pipeline strategy",
            first, other.devices
        )));
    }
    Ok((!first.is_empty()).then_some(first))
}

/// A tensor-parallel group: `degree` consecutive devices from 0 (inside
/// one node). `degree` must divide `devices`; `strategy` and `option`
/// name them in the error.
pub fn contiguous_group(
    strategy: &str,
    option: &str,
    degree: u32,
    devices: u32,
) -> Result<Vec<u32>, Error> {
    // The same degree check as a strided group's; laid out contiguously.
    crate::strided_group(strategy, option, degree, devices)?;
    Ok((0..degree).collect())
}

/// A data-parallel group: `degree` replicas `stride` devices apart (by
/// default `devices ÷ degree`, which `degree` must then divide, leaving
/// each replica a block for its pipeline and tensor-parallel groups).
pub fn replica_group(
    strategy: &str,
    option: &str,
    degree: u32,
    stride: Option<u32>,
    devices: u32,
) -> Result<Vec<u32>, Error> {
    let Some(stride) = stride else {
        return crate::strided_group(strategy, option, degree, devices);
    };
    let last = u64::from(degree.max(1) - 1) * u64::from(stride);
    if degree == 0 || stride == 0 || last >= u64::from(devices) {
        return Err(Error::msg(format!(
            "{strategy} needs {option} ≥ 1 replicas a stride ≥ 1 apart inside the devices: got {option} {degree}, stride {stride} for {devices} devices"
        )));
    }
    Ok((0..degree).map(|i| i * stride).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_the_mesh_order_and_refuse_with_the_numbers() {
        assert_eq!(contiguous_group("tp", "tp", 2, 8).unwrap(), vec![0, 1]);
        assert_eq!(
            replica_group("dp", "degree", 2, None, 8).unwrap(),
            vec![0, 4]
        );
        assert_eq!(
            replica_group("dp", "degree", 4, Some(2), 8).unwrap(),
            vec![0, 2, 4, 6]
        );
        let e = contiguous_group("tp", "tp", 3, 8).unwrap_err().0;
        assert!(e.contains("got tp 3 for 8 devices"), "{e}");
        let e = replica_group("zero", "dp", 4, Some(3), 8).unwrap_err().0;
        assert!(e.contains("got dp 4, stride 3 for 8 devices"), "{e}");
    }
}

//! Pipeline layout shared by the pipeline strategies: which devices each stage
//! runs on and which `PP` regions it holds.
//!
//! A pipeline composes with a data-parallel strategy applied before it: if
//! every forward already sits on one device group `G` (e.g. `dp:degree=2` put
//! the model on `[0, 4]` of 8 devices), stage `s` runs on `G + s`
//! (`[s, 4 + s]`), so each stage keeps `|G|` data-parallel replicas. Otherwise
//! the pipeline starts from device 0.

use crate::{Dag, Error, Filter, Pass};

/// Stages, their device groups and their regions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pipeline {
    /// Device group of each stage.
    pub groups: Vec<Vec<u32>>,
    /// `PP` regions of each stage, contiguous and in order.
    pub regions: Vec<Vec<u32>>,
}

impl Pipeline {
    /// Lay out `stages` stages (default: as many as the devices allow).
    /// `who` names the strategy in error messages.
    pub fn plan(dag: &mut dyn Dag, stages: Option<u32>, who: &str) -> Result<Self, Error> {
        let devices = dag.cluster().devices;
        let n_regions = dag.tag_extents().get("PP").copied().unwrap_or(0);
        if n_regions == 0 {
            return Err(Error::msg(format!(
                "{who} needs a model annotated with PP regions"
            )));
        }
        // The group a previous strategy (dp, zero) put the model on, if any.
        let forwards = dag.query(&Filter::all().pass(Pass::F))?;
        let first = forwards[0].devices.clone();
        if let Some(other) = forwards.iter().find(|n| n.devices != first) {
            return Err(Error::msg(format!(
                "{who} needs the whole model on one device group before it runs: found forwards on {:?} and {:?}",
                first, other.devices
            )));
        }
        let base: Vec<u32> = if first.is_empty() { vec![0] } else { first };
        let dp = base.len() as u32;
        let stages = stages.unwrap_or(devices / dp);
        if stages == 0 {
            return Err(Error::msg(format!("{who} needs at least 1 stage, got 0")));
        }
        if stages > n_regions {
            return Err(Error::msg(format!(
                "{who} needs stages ≤ PP regions: got {stages} stages for {n_regions} regions"
            )));
        }
        if stages * dp > devices {
            return Err(Error::msg(format!(
                "{who} needs stages × data-parallel degree ≤ devices: {stages} × {dp} > {devices}"
            )));
        }
        let groups: Vec<Vec<u32>> = (0..stages)
            .map(|s| base.iter().map(|g| g + s).collect())
            .collect();
        let mut seen = std::collections::BTreeSet::new();
        for g in groups.iter().flatten() {
            if *g >= devices || !seen.insert(*g) {
                return Err(Error::msg(format!(
                    "{who}: the data-parallel group {base:?} leaves no room for {stages} stages on {devices} devices (stage s runs on the group shifted by s)"
                )));
            }
        }
        // Regions as evenly as possible, earlier stages taking the remainder.
        let (per, extra) = (n_regions / stages, n_regions % stages);
        let mut regions = Vec::new();
        let mut next = 0;
        for s in 0..stages {
            let take = per + u32::from(s < extra);
            regions.push((next..next + take).collect());
            next += take;
        }
        Ok(Pipeline { groups, regions })
    }

    /// The usual prologue of a pipeline strategy: lay out the stages from the
    /// `stages` option, read `microbatches` (default 2 × stages), split the
    /// batch into them and place the stages with transfers on the `stream`
    /// option (default `pp`). Returns the layout and the microbatch count.
    pub fn split_and_place(
        dag: &mut dyn Dag,
        options: &crate::Options,
        who: &str,
    ) -> Result<(Self, u32), Error> {
        let pipe = Pipeline::plan(dag, options.u32("stages")?, who)?;
        let mbs = options.u32("microbatches")?.unwrap_or(2 * pipe.stages());
        if mbs == 0 {
            return Err(Error::msg(format!(
                "{who} needs at least 1 microbatch, got 0"
            )));
        }
        // Microbatches.
        dag.split(&Filter::all(), "MB", mbs)?;
        // One stage per device group.
        pipe.place(dag, options.str("stream")?.unwrap_or("pp"))?;
        Ok((pipe, mbs))
    }

    pub fn stages(&self) -> u32 {
        self.groups.len() as u32
    }

    /// Place every stage's regions on its group, transfers on `stream`.
    pub fn place(&self, dag: &mut dyn Dag, stream: &str) -> Result<(), Error> {
        for (group, regions) in self.groups.iter().zip(&self.regions) {
            for r in regions {
                dag.place(&Filter::tag("PP", *r), group, stream)?;
            }
        }
        Ok(())
    }

    /// One order group: `pass` of microbatch `mb` over stage `s`'s regions
    /// (forward regions in order; backward ones too — the DAG's edges fix
    /// the direction within a group).
    pub fn step(&self, s: u32, mb: u32, pass: Pass) -> Vec<Filter> {
        self.regions[s as usize]
            .iter()
            .map(|r| Filter::tag("PP", *r).and("MB", mb).pass(pass))
            .collect()
    }
}

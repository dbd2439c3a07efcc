//! `piper comm check`: the runtime's collectives against a reference, on
//! this process's devices or, under `mpirun`/`srun` (feature `mpi`), across
//! the ranks of the job, as training deals devices to them.

use crate::runtime::comm::{check, Comm, LocalComm};
use anyhow::{bail, Result};
use clap::Args;
use std::time::Duration;

#[derive(Args)]
pub struct CheckArgs {
    /// Plan devices to spread the groups over (default: 5, or the number of
    /// MPI ranks when there are more).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    devices: Option<u32>,
    /// How long a device waits for another before the check fails.
    #[arg(long, default_value_t = 60)]
    timeout_s: u64,
}

pub fn check(a: CheckArgs) -> Result<()> {
    let timeout = Duration::from_secs(a.timeout_s.max(1));
    #[cfg(feature = "mpi")]
    if let Some(mpi) = super::job::Mpi::launched()? {
        let rank = mpi.rank();
        let result = check_ranks(&a, &mpi, timeout);
        return super::job::finish(rank, result);
    }
    let devices = a.devices.unwrap_or(5);
    let local: Vec<u32> = (0..devices).collect();
    let outcomes = check::run(
        devices,
        &local,
        &|_| Box::new(LocalComm::new(timeout)) as Box<dyn Comm>,
        &|_| {},
    );
    report(
        &format!("{devices} devices in this process"),
        outcomes.into_iter().map(|o| (o.line, o.failures)).collect(),
    )
}

#[cfg(feature = "mpi")]
fn check_ranks(a: &CheckArgs, mpi: &super::job::Mpi, timeout: Duration) -> Result<()> {
    let devices = a.devices.unwrap_or(5).max(mpi.size());
    let fabric = mpi.fabric(devices, timeout)?;
    let local = fabric.ranks.devices_of(mpi.rank());
    let outcomes = check::run(
        devices,
        &local,
        &|c| Box::new(fabric.step(c)) as Box<dyn Comm>,
        &|c| fabric.finish(c),
    );
    // Every rank's lines and failures, to the first rank, which reports.
    let mine: Vec<(String, Vec<String>)> = outcomes
        .into_iter()
        .map(|o| {
            let line = format!("rank {}: {}", mpi.rank(), o.line);
            (line, o.failures)
        })
        .collect();
    let text = serde_json::to_vec(&mine)?;
    let Some(all) = fabric.gather_to_root(&text) else {
        return Ok(());
    };
    let mut rows = Vec::new();
    for part in all {
        let got: Vec<(String, Vec<String>)> = serde_json::from_slice(&part)?;
        rows.extend(got);
    }
    report(
        &format!("{devices} devices on {} MPI ranks", mpi.size()),
        rows,
    )
}

/// Print each case and fail naming every disagreement.
fn report(what: &str, rows: Vec<(String, Vec<String>)>) -> Result<()> {
    let mut failures = Vec::new();
    for (line, f) in &rows {
        println!("{line}");
        failures.extend(f.iter().cloned());
    }
    if !failures.is_empty() {
        bail!(
            "{} of the collectives' results or byte counts disagree ({what}):\n  {}",
            failures.len(),
            failures.join("\n  ")
        );
    }
    println!(
        "comm check: {} collective runs on {what}: every result equals the reference bit for bit, every device sent what the algorithm states",
        rows.len()
    );
    Ok(())
}

//! `piper train` as one rank of an MPI job (feature `mpi`): launched by
//! `mpirun` or `srun`, MPI says who is who; every rank loads the plugins and
//! compiles the plan itself, the ranks agree on the plan and the data before
//! the first step, and a rank that fails ends the job on every rank.

use crate::runtime::comm::mpi::{MpiFabric, Ranks};
use anyhow::{bail, Result};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::sync::Arc;
use std::time::Duration;

/// This process's place in an MPI job.
pub struct Mpi {
    // Finalizes MPI when dropped (after the fabric stopped).
    _universe: mpi::environment::Universe,
    rank: u32,
    size: u32,
    fabric: std::cell::RefCell<Option<Arc<MpiFabric>>>,
}

impl Mpi {
    /// `Some` when a launcher started this process (Open MPI, PMI, PMIx:
    /// `mpirun`, `mpiexec`, `srun`); `None` for a plain run.
    pub fn launched() -> Result<Option<Mpi>> {
        let by_launcher = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
            .iter()
            .any(|v| std::env::var_os(v).is_some());
        if !by_launcher {
            return Ok(None);
        }
        let Some((universe, threading)) = mpi::initialize_with_threading(mpi::Threading::Multiple)
        else {
            bail!("MPI was already initialised");
        };
        if threading != mpi::Threading::Multiple {
            bail!("this MPI library does not provide MPI_THREAD_MULTIPLE (got {threading:?}); piper's devices are threads that communicate at once");
        }
        let w = universe.world();
        Ok(Some(Mpi {
            rank: w.rank() as u32,
            size: w.size() as u32,
            _universe: universe,
            fabric: std::cell::RefCell::new(None),
        }))
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }
    pub fn size(&self) -> u32 {
        self.size
    }

    /// Every rank compiled the same plan from the same data and resumes
    /// from the same step: compare each `(what, value)` (`what` as in
    /// "rank 1 {what} {value}"; values compared on their first 16
    /// characters); any difference stops every rank with
    /// the differing values and ranks named.
    pub fn agree(&self, fields: &[(&str, &str)]) -> Result<()> {
        const W: usize = 16;
        let row = W * fields.len();
        let mine: String = fields.iter().map(|(_, v)| format!("{v:>W$.W$}")).collect();
        let mut all = vec![0u8; row * self.size as usize];
        SimpleCommunicator::world().all_gather_into(mine.as_bytes(), &mut all[..]);
        let field = |r: usize, f: usize| {
            let at = row * r + W * f;
            String::from_utf8_lossy(&all[at..at + W])
                .trim_start()
                .to_string()
        };
        let mut diffs = Vec::new();
        for r in 1..self.size as usize {
            for (f, (what, _)) in fields.iter().enumerate() {
                if field(r, f) != field(0, f) {
                    diffs.push(format!(
                        "rank {r} {what} {} but rank 0 {what} {}",
                        field(r, f),
                        field(0, f)
                    ));
                }
            }
        }
        if !diffs.is_empty() {
            bail!(
                "the ranks disagree before the first step (give every rank the same model, strategies, options, data and checkpoint): {}",
                diffs.join("; ")
            );
        }
        Ok(())
    }

    /// Deal the plan's devices to the ranks and start the transport.
    pub fn fabric(&self, devices: u32, timeout: Duration) -> Result<Arc<MpiFabric>> {
        if devices < self.size {
            bail!(
                "the plan has {devices} device(s) for {} MPI ranks: give at least one device per rank (--devices)",
                self.size
            );
        }
        let f = MpiFabric::start(Ranks::deal(devices, self.size, self.rank), timeout);
        *self.fabric.borrow_mut() = Some(f.clone());
        Ok(f)
    }
}

impl Drop for Mpi {
    fn drop(&mut self) {
        if let Some(f) = self.fabric.borrow_mut().take() {
            f.stop();
        }
    }
}

/// End a rank's run: on an error, print it with the rank and end the job on
/// every rank (`MPI_Abort`), so no rank waits for one that is gone.
pub fn finish(rank: u32, result: Result<()>) -> Result<()> {
    match result {
        Ok(()) => Ok(()),
        Err(e) => {
            // One write: mpirun forwards each rank's stderr as it comes, so
            // a line written in pieces could interleave with another rank's.
            use std::io::Write;
            let line = format!("error: rank {rank}: {e:#}\n");
            let _ = std::io::stderr().write_all(line.as_bytes());
            SimpleCommunicator::world().abort(1)
        }
    }
}

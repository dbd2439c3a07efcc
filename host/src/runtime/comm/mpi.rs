//! [`Comm`] across MPI ranks (feature `mpi`). The plan's devices are dealt to
//! ranks in contiguous blocks ([`Ranks`]); a rank runs its own devices as
//! threads, exactly as in one process. Traffic between two devices of one
//! rank stays in the rank's [`LocalComm`]; a message to a device of another
//! rank goes out as one MPI message (a small header, then the floats), and a
//! dispatcher thread on the receiving rank puts it into that rank's table for
//! the message's step, so a receive waits the same way whoever sent.
//!
//! Collectives over devices of several ranks gather every member's
//! contribution at the group's lowest device, which adds them in device order
//! and sends the sum back: the same additions in the same order as
//! [`LocalComm`], so results are bit-identical to one process. An abort
//! reaches every rank. MPI itself starts the ranks, says who is who, moves
//! the bytes and tears the job down; this needs `MPI_THREAD_MULTIPLE`.

use super::{sum_in_device_order, Comm, CommError, LocalComm};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const TAG_MSG: i32 = 11;
const TAG_ABORT: i32 = 12;
const TAG_STOP: i32 = 13;
/// Mailbox keys of collective traffic (node ids stay below 2³¹: the host
/// budget caps nodes far lower).
const COLLECTIVE: u32 = 1 << 31;
const HEADER: usize = 4 * 4;

/// Which rank runs which plan device: contiguous blocks, the first
/// `devices % ranks` ranks one device more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ranks {
    pub rank: u32,
    pub size: u32,
    owner: Vec<u32>,
}

impl Ranks {
    pub fn deal(devices: u32, size: u32, rank: u32) -> Ranks {
        let size = size.max(1);
        let (base, extra) = (devices / size, devices % size);
        let mut owner = Vec::with_capacity(devices as usize);
        for r in 0..size {
            let n = base + u32::from(r < extra);
            owner.extend(std::iter::repeat_n(r, n as usize));
        }
        Ranks { rank, size, owner }
    }
    /// The rank that runs `device`.
    pub fn owner(&self, device: u32) -> u32 {
        self.owner.get(device as usize).copied().unwrap_or(0)
    }
    pub fn is_local(&self, device: u32) -> bool {
        self.owner(device) == self.rank
    }
    /// The devices of `rank`, in order.
    pub fn devices_of(&self, rank: u32) -> Vec<u32> {
        (0..self.owner.len() as u32)
            .filter(|d| self.owner(*d) == rank)
            .collect()
    }
}

/// The MPI side of a job on this rank: the dispatcher thread and the
/// per-step tables it delivers into. One per process, for the whole run.
pub struct MpiFabric {
    pub ranks: Ranks,
    timeout: Duration,
    tables: Mutex<BTreeMap<u32, Arc<LocalComm>>>,
    aborted: AtomicBool,
    dispatcher: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn world() -> SimpleCommunicator {
    SimpleCommunicator::world()
}

fn encode(step: u32, pair: u32, from: u32, to: u32, data: &[f32]) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER + 4 * data.len());
    for w in [step, pair, from, to] {
        b.extend_from_slice(&w.to_le_bytes());
    }
    for x in data {
        b.extend_from_slice(&x.to_le_bytes());
    }
    b
}

fn word(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}

impl MpiFabric {
    /// Start the dispatcher. Every rank of the job calls this once, after
    /// MPI is initialised with `MPI_THREAD_MULTIPLE`.
    pub fn start(ranks: Ranks, timeout: Duration) -> Arc<MpiFabric> {
        let fabric = Arc::new(MpiFabric {
            ranks,
            timeout,
            tables: Mutex::new(BTreeMap::new()),
            aborted: AtomicBool::new(false),
            dispatcher: Mutex::new(None),
        });
        let f = fabric.clone();
        let handle = std::thread::Builder::new()
            .name("piper-mpi-dispatch".into())
            .spawn(move || f.dispatch())
            .expect("spawn the MPI dispatcher thread");
        *fabric.dispatcher.lock().unwrap() = Some(handle);
        fabric
    }

    /// The table of one step (made on first use: a faster rank's messages
    /// for the next step may arrive before this rank starts it).
    fn table(&self, step: u32) -> Arc<LocalComm> {
        let mut t = self.tables.lock().unwrap();
        let c = t
            .entry(step)
            .or_insert_with(|| Arc::new(LocalComm::new(self.timeout)))
            .clone();
        if self.aborted.load(Ordering::SeqCst) {
            c.abort();
        }
        c
    }

    fn dispatch(&self) {
        let w = world();
        let mut idle = Duration::ZERO;
        loop {
            // Probe, and sleep a little (backing off to 1 ms) while nothing
            // came: a blocking receive would busy-poll a whole core, which
            // the devices' compute threads need.
            let Some(probed) = w.any_process().immediate_matched_probe() else {
                idle = (idle * 2).clamp(Duration::from_micros(20), Duration::from_millis(1));
                std::thread::sleep(idle);
                continue;
            };
            idle = Duration::ZERO;
            let (msg, status) = probed.matched_receive_vec::<u8>();
            match status.tag() {
                TAG_STOP => return,
                TAG_ABORT => {
                    self.aborted.store(true, Ordering::SeqCst);
                    for c in self.tables.lock().unwrap().values() {
                        c.abort();
                    }
                }
                TAG_MSG if msg.len() >= HEADER && (msg.len() - HEADER).is_multiple_of(4) => {
                    let (step, pair, from, to) =
                        (word(&msg, 0), word(&msg, 1), word(&msg, 2), word(&msg, 3));
                    let data: Vec<f32> = msg[HEADER..]
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                        .collect();
                    if let Err(e) = self.table(step).send(pair, from, to, Arc::new(data)) {
                        tracing::error!("rank {}: {e}", self.ranks.rank);
                        self.abort_all();
                    }
                }
                tag => {
                    tracing::error!(
                        "rank {}: a malformed message (tag {tag}, {} bytes) from rank {}",
                        self.ranks.rank,
                        msg.len(),
                        status.source_rank()
                    );
                    self.abort_all();
                }
            }
        }
    }

    fn abort_all(&self) {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        for c in self.tables.lock().unwrap().values() {
            c.abort();
        }
        let w = world();
        for r in 0..self.ranks.size {
            if r != self.ranks.rank {
                w.process_at_rank(r as i32)
                    .send_with_tag(&[0u8][..], TAG_ABORT);
            }
        }
    }

    /// The [`Comm`] of one step.
    pub fn step(self: &Arc<Self>, step: u32) -> MpiComm {
        MpiComm {
            fabric: self.clone(),
            step,
            local: self.table(step),
        }
    }

    /// Forget a finished step's table.
    pub fn finish(&self, step: u32) {
        self.tables.lock().unwrap().remove(&step);
    }

    /// Every rank's step figures, combined: per-device losses, peak and
    /// state bytes (each device's from its rank, zeros elsewhere: the sum is
    /// exact) and the norm's maximum, which is returned.
    pub fn reduce_stats(&self, losses: &mut [f64], grad_norm: f64, counts: [&mut [u64]; 4]) -> f64 {
        use mpi::collective::SystemOperation;
        let w = world();
        let mut g = 0.0f64;
        // MPI's max may drop a NaN: sent as +inf, still not finite.
        let grad_norm = if grad_norm.is_nan() {
            f64::INFINITY
        } else {
            grad_norm
        };
        w.all_reduce_into(&grad_norm, &mut g, SystemOperation::max());
        let mine = losses.to_vec();
        w.all_reduce_into(&mine[..], losses, SystemOperation::sum());
        for v in counts {
            let mine = v.to_vec();
            w.all_reduce_into(&mine[..], v, SystemOperation::sum());
        }
        g
    }

    /// Every rank's `bytes`, in rank order, on the first rank (`None` on
    /// the others). Collective: every rank calls it at the same point.
    pub fn gather_to_root(&self, bytes: &[u8]) -> Option<Vec<Vec<u8>>> {
        let w = world();
        let size = self.ranks.size as usize;
        let mut lens = vec![0u64; size];
        w.all_gather_into(&(bytes.len() as u64), &mut lens[..]);
        let max = lens.iter().copied().max().unwrap_or(0) as usize;
        let mut padded = bytes.to_vec();
        padded.resize(max, 0);
        let root = w.process_at_rank(0);
        if self.ranks.rank != 0 {
            root.gather_into(&padded[..]);
            return None;
        }
        let mut all = vec![0u8; max * size];
        root.gather_into_root(&padded[..], &mut all[..]);
        Some(
            (0..size)
                .map(|r| all[r * max..r * max + lens[r] as usize].to_vec())
                .collect(),
        )
    }

    /// Stop the dispatcher (every rank, at the end of the run).
    pub fn stop(&self) {
        let handle = self.dispatcher.lock().unwrap().take();
        if let Some(h) = handle {
            world()
                .process_at_rank(self.ranks.rank as i32)
                .send_with_tag(&[0u8][..], TAG_STOP);
            let _ = h.join();
        }
    }
}

/// One step's [`Comm`] on this rank.
pub struct MpiComm {
    fabric: Arc<MpiFabric>,
    step: u32,
    local: Arc<LocalComm>,
}

impl Comm for MpiComm {
    fn send(&self, pair: u32, from: u32, to: u32, data: Arc<Vec<f32>>) -> Result<(), CommError> {
        let owner = self.fabric.ranks.owner(to);
        if owner == self.fabric.ranks.rank {
            return self.local.send(pair, from, to, data);
        }
        if self.aborted() {
            return Err(CommError::Aborted);
        }
        let msg = encode(self.step, pair, from, to, &data);
        world()
            .process_at_rank(owner as i32)
            .send_with_tag(&msg[..], TAG_MSG);
        Ok(())
    }

    fn recv(&self, pair: u32, from: u32, to: u32, what: &str) -> Result<Arc<Vec<f32>>, CommError> {
        self.local.recv(pair, from, to, what)
    }

    fn all_reduce(
        &self,
        op: &str,
        node: u32,
        group: &[u32],
        me: u32,
        data: Vec<f32>,
    ) -> Result<Arc<Vec<f32>>, CommError> {
        let ranks = &self.fabric.ranks;
        if group.iter().all(|d| ranks.is_local(*d)) {
            return self.local.all_reduce(op, node, group, me, data);
        }
        let key = node | COLLECTIVE;
        let leader = group.iter().copied().min().unwrap_or(me);
        if me != leader {
            self.send(key, me, leader, Arc::new(data))?;
            return self.recv(key, leader, me, op);
        }
        let mut contrib: BTreeMap<u32, Arc<Vec<f32>>> = BTreeMap::new();
        contrib.insert(me, Arc::new(data));
        for &m in group.iter().filter(|m| **m != me) {
            contrib.insert(m, self.recv(key, m, me, op)?);
        }
        let sum = sum_in_device_order(
            op,
            node,
            group,
            contrib.iter().map(|(d, v)| (*d, v.as_slice())),
        )
        .inspect_err(|_| self.abort())?;
        let sum = Arc::new(sum);
        for &m in group.iter().filter(|m| **m != me) {
            self.send(key, me, m, sum.clone())?;
        }
        Ok(sum)
    }

    fn abort(&self) {
        self.local.abort();
        self.fabric.abort_all();
    }

    fn aborted(&self) -> bool {
        self.local.aborted()
    }

    fn timeout(&self) -> Duration {
        self.local.timeout()
    }

    fn is_local(&self, device: u32) -> bool {
        self.fabric.ranks.is_local(device)
    }
}

#[cfg(test)]
mod tests {
    use super::Ranks;

    #[test]
    fn devices_are_dealt_in_contiguous_blocks() {
        let r = Ranks::deal(8, 2, 1);
        assert_eq!(r.devices_of(0), vec![0, 1, 2, 3]);
        assert_eq!(r.devices_of(1), vec![4, 5, 6, 7]);
        assert!(r.is_local(5) && !r.is_local(3));
        // Uneven: the first ranks take one more.
        let r = Ranks::deal(3, 2, 0);
        assert_eq!(r.devices_of(0), vec![0, 1]);
        assert_eq!(r.devices_of(1), vec![2]);
        let r = Ranks::deal(5, 3, 2);
        assert_eq!(r.devices_of(2), vec![4]);
    }
}

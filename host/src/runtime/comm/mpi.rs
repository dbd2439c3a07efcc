//! [`Comm`] across MPI ranks (feature `mpi`). The plan's devices are dealt to
//! ranks in contiguous blocks ([`Ranks`]); a rank runs its own devices as
//! threads, exactly as in one process. Traffic between two devices of one
//! rank stays in the rank's [`LocalComm`]; a message to a device of another
//! rank goes out as two MPI messages (a small head, then the floats straight
//! from the sender's buffer), and a dispatcher thread on the receiving rank
//! puts it into that rank's table for the message's step, so a receive waits
//! the same way whoever sent.
//!
//! Collectives over devices of several ranks are the direct algorithm of
//! [`super`] on these messages: a reduce-scatter sends each member its
//! chunk of this device's buffer and sums the chunks it receives in device
//! order (the same additions in the same order as [`LocalComm`], so results
//! are bit-identical to one process); an all-gather sends this device's
//! shard to every other member. A group within one rank stays in its
//! [`LocalComm`]. An abort reaches every rank. MPI itself starts the ranks,
//! says who is who, moves the bytes and tears the job down; this needs
//! `MPI_THREAD_MULTIPLE`.

use super::{
    check_group, chunk_start, collective_key, sum_in_device_order, Comm, CommError, LocalComm,
};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A message is two: its head (step, mailbox key in two words, source,
/// destination) then its floats, sent straight from the sender's buffer.
const TAG_HEAD: i32 = 11;
const TAG_DATA: i32 = 14;
const TAG_ABORT: i32 = 12;
const TAG_STOP: i32 = 13;

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
    /// Held while a message to that rank goes out (head, then data).
    sending: Vec<Mutex<()>>,
}

fn world() -> SimpleCommunicator {
    SimpleCommunicator::world()
}

/// A message's head: its words carried as floats' bit patterns (MPI copies
/// the bytes; nothing computes on them), so every message is floats.
fn head(step: u32, key: u64, from: u32, to: u32) -> [f32; 5] {
    [step, key as u32, (key >> 32) as u32, from, to].map(f32::from_bits)
}

impl MpiFabric {
    /// Start the dispatcher. Every rank of the job calls this once, after
    /// MPI is initialised with `MPI_THREAD_MULTIPLE`.
    pub fn start(ranks: Ranks, timeout: Duration) -> Arc<MpiFabric> {
        let fabric = Arc::new(MpiFabric {
            sending: (0..ranks.size).map(|_| Mutex::new(())).collect(),
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
            let (msg, status) = probed.matched_receive_vec::<f32>();
            match (status.tag(), msg.len()) {
                (TAG_STOP, _) => return,
                (TAG_ABORT, _) => {
                    self.aborted.store(true, Ordering::SeqCst);
                    for c in self.tables.lock().unwrap().values() {
                        c.abort();
                    }
                }
                (TAG_HEAD, 5) => {
                    let [step, lo, hi, from, to] = [0, 1, 2, 3, 4].map(|i| msg[i].to_bits());
                    let key = u64::from(lo) | u64::from(hi) << 32;
                    // The floats follow from the same rank (its sends to
                    // this rank go head then data, one message at a time).
                    let (data, _) = w
                        .process_at_rank(status.source_rank())
                        .receive_vec_with_tag::<f32>(TAG_DATA);
                    // Counted by the sending rank.
                    let table = self.table(step);
                    if let Err(e) = table.post(key, from, to, Arc::new(data), false) {
                        tracing::error!("rank {}: {e}", self.ranks.rank);
                        self.abort_all();
                    }
                }
                (tag, _) => {
                    tracing::error!(
                        "rank {}: a malformed message (tag {tag}) from rank {}",
                        self.ranks.rank,
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
                    .send_with_tag(&[0f32][..], TAG_ABORT);
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

    /// Every rank's step figures, combined: per-device losses and counts
    /// (peak, state and sent bytes, expert routing; each device's from its
    /// rank, zeros elsewhere: the sum is exact) and the norm's maximum, which is returned.
    pub fn reduce_stats(&self, losses: &mut [f64], grad_norm: f64, counts: [&mut [u64]; 5]) -> f64 {
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
                .send_with_tag(&[0f32][..], TAG_STOP);
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

impl MpiComm {
    /// Send to mailbox `(key, from, to)`: into this rank's table, or as one
    /// MPI message to the rank of `to`.
    fn post(&self, key: u64, from: u32, to: u32, data: Arc<Vec<f32>>) -> Result<(), CommError> {
        match self.fabric.ranks.is_local(to) {
            true => self.local.post(key, from, to, data, true),
            false => self.post_remote(key, from, to, &data),
        }
    }

    /// [`Self::post`] of a slice: copied once, into the table or the message.
    fn post_slice(&self, key: u64, from: u32, to: u32, data: &[f32]) -> Result<(), CommError> {
        match self.fabric.ranks.is_local(to) {
            true => self
                .local
                .post(key, from, to, Arc::new(data.to_vec()), true),
            false => self.post_remote(key, from, to, data),
        }
    }

    fn post_remote(&self, key: u64, from: u32, to: u32, data: &[f32]) -> Result<(), CommError> {
        if self.aborted() {
            return Err(CommError::Aborted);
        }
        self.local.count(from, data.len() as u64 * 4);
        let owner = self.fabric.ranks.owner(to);
        let w = world();
        let peer = w.process_at_rank(owner as i32);
        // Head and data back to back: the receiver pairs them in order.
        let _one_at_a_time = self.fabric.sending[owner as usize].lock().unwrap();
        peer.send_with_tag(&head(self.step, key, from, to)[..], TAG_HEAD);
        peer.send_with_tag(data, TAG_DATA);
        Ok(())
    }

    fn on_ranks(&self, group: &[u32]) -> bool {
        !group.iter().all(|d| self.fabric.ranks.is_local(*d))
    }

    /// A reduce-scatter across ranks (mailbox phase 0 of `node`): each
    /// other member's chunk of `data` goes to it; this device's chunk of
    /// every member's buffer comes here and is summed in device order.
    #[allow(clippy::too_many_arguments)]
    fn scatter(
        &self,
        op: &str,
        node: u32,
        group: &[u32],
        me: u32,
        data: Vec<f32>,
        lens: &[usize],
    ) -> Result<Vec<f32>, CommError> {
        let pos = check_group(op, node, group, me, Some((data.len(), lens)))?;
        let key = collective_key(node, 0);
        for (i, &peer) in group.iter().enumerate() {
            if peer != me {
                let at = chunk_start(lens, i);
                self.post_slice(key, me, peer, &data[at..at + lens[i]])?;
            }
        }
        let at = chunk_start(lens, pos);
        let own = &data[at..at + lens[pos]];
        let mut got: BTreeMap<u32, Arc<Vec<f32>>> = BTreeMap::new();
        for &peer in group.iter().filter(|p| **p != me) {
            got.insert(peer, self.local.take(key, peer, me, op)?);
        }
        // By device (the map's order), this device's own chunk in its place.
        let mut chunks: BTreeMap<u32, &[f32]> = got.iter().map(|(d, c)| (*d, &c[..])).collect();
        chunks.insert(me, own);
        let by_device = chunks.iter().map(|(d, c)| (*d, *c));
        sum_in_device_order(op, node, group, by_device).inspect_err(|_| self.abort())
    }

    /// An all-gather across ranks (mailbox phase 1 of `node`: an
    /// all-reduce's two halves share its node).
    fn gather(
        &self,
        op: &str,
        node: u32,
        group: &[u32],
        me: u32,
        shard: Vec<f32>,
    ) -> Result<Arc<Vec<f32>>, CommError> {
        check_group(op, node, group, me, None)?;
        let key = collective_key(node, 1);
        let shard = Arc::new(shard);
        for &peer in group.iter().filter(|p| **p != me) {
            self.post(key, me, peer, shard.clone())?;
        }
        let mut full = Vec::new();
        for &peer in group {
            match peer == me {
                true => full.extend_from_slice(&shard),
                false => full.extend_from_slice(&self.local.take(key, peer, me, op)?),
            }
        }
        Ok(Arc::new(full))
    }
}

impl Comm for MpiComm {
    fn send(&self, pair: u32, from: u32, to: u32, data: Arc<Vec<f32>>) -> Result<(), CommError> {
        self.post(u64::from(pair), from, to, data)
    }

    fn recv(&self, pair: u32, from: u32, to: u32, what: &str) -> Result<Arc<Vec<f32>>, CommError> {
        self.local.take(u64::from(pair), from, to, what)
    }

    fn reduce_scatter(
        &self,
        op: &str,
        node: u32,
        group: &[u32],
        me: u32,
        data: Vec<f32>,
        lens: &[usize],
    ) -> Result<Vec<f32>, CommError> {
        if !self.on_ranks(group) {
            return self.local.reduce_scatter(op, node, group, me, data, lens);
        }
        self.scatter(op, node, group, me, data, lens)
    }

    fn all_gather(
        &self,
        op: &str,
        node: u32,
        group: &[u32],
        me: u32,
        shard: Vec<f32>,
    ) -> Result<Arc<Vec<f32>>, CommError> {
        if !self.on_ranks(group) {
            return self.local.all_gather(op, node, group, me, shard);
        }
        self.gather(op, node, group, me, shard)
    }

    fn sent_bytes(&self) -> BTreeMap<u32, u64> {
        self.local.sent_bytes()
    }
    fn count_sent(&self, device: u32, bytes: u64) {
        self.local.count(device, bytes);
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

//! The in-process [`Comm`]: devices are threads of one process. Mailboxes
//! and collectives live in one mutex-guarded table. A collective is a
//! meeting: each member leaves its buffer (shared, not copied) and, once
//! all are there, reads what the algorithm sends it (its chunk of every
//! member's buffer, or every member's shard) outside the lock; sums add in
//! device order, so results are bit-identical from run to run and to the
//! MPI transport. The bytes a device's buffer gives to other members count
//! as sent by it.

use super::{check_group, chunk_start, sum_in_device_order, Comm, CommError};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What one member left at a meeting: its buffer and, for a
/// reduce-scatter, how it is cut.
#[derive(Clone)]
struct Left {
    data: Arc<Vec<f32>>,
    lens: Arc<[usize]>,
}

#[derive(Default)]
struct Meeting {
    left: BTreeMap<u32, Left>,
    /// Members that have read the others' buffers; the meeting ends when
    /// all have.
    read: usize,
}

/// Meeting phases: an all-reduce's reduce-scatter and all-gather share its
/// node.
const SCATTER: u8 = 0;
const GATHER: u8 = 1;

#[derive(Default)]
struct State {
    mail: HashMap<(u64, u32, u32), Arc<Vec<f32>>>,
    meetings: HashMap<(u32, u8, Vec<u32>), Meeting>,
    sent: BTreeMap<u32, u64>,
}

/// The shared fabric of one training step between devices of this process.
pub struct LocalComm {
    state: Mutex<State>,
    cv: Condvar,
    timeout: Duration,
    abort: AtomicBool,
}

impl LocalComm {
    pub fn new(timeout: Duration) -> Self {
        LocalComm {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            timeout,
            abort: AtomicBool::new(false),
        }
    }

    /// Put a message in mailbox `(key, from, to)`; `count` adds its bytes to
    /// `from`'s (a message from another rank was counted there).
    pub(super) fn post(
        &self,
        key: u64,
        from: u32,
        to: u32,
        data: Arc<Vec<f32>>,
        count: bool,
    ) -> Result<(), CommError> {
        let mut s = self.state.lock().unwrap();
        let bytes = data.len() as u64 * 4;
        match s.mail.entry((key, from, to)) {
            std::collections::hash_map::Entry::Occupied(_) => {
                return Err(CommError::Duplicate {
                    node: key as u32,
                    from,
                    to,
                })
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(data);
            }
        }
        if count {
            *s.sent.entry(from).or_default() += bytes;
        }
        self.cv.notify_all();
        Ok(())
    }

    /// Add `bytes` to what `device` sent (a transport's own messages).
    pub(super) fn count(&self, device: u32, bytes: u64) {
        *self.state.lock().unwrap().sent.entry(device).or_default() += bytes;
    }

    /// Take the message of mailbox `(key, from, to)`, waiting at most the
    /// timeout (`what` names it in errors).
    pub(super) fn take(
        &self,
        key: u64,
        from: u32,
        to: u32,
        what: &str,
    ) -> Result<Arc<Vec<f32>>, CommError> {
        let start = Instant::now();
        let mut s = self.state.lock().unwrap();
        loop {
            if let Some(d) = s.mail.remove(&(key, from, to)) {
                return Ok(d);
            }
            if self.aborted() {
                return Err(CommError::Aborted);
            }
            let Some(left) = self.timeout.checked_sub(start.elapsed()) else {
                return Err(CommError::RecvTimeout {
                    me: to,
                    peer: from,
                    node: key as u32,
                    what: what.into(),
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            };
            s = self
                .cv
                .wait_timeout(s, left.min(Duration::from_millis(200)))
                .unwrap()
                .0;
        }
    }

    /// Leave `mine` at the meeting of `(node, phase, group)` and return
    /// what every member left, by device, once all have (at most the
    /// timeout; a member that never comes is named).
    fn meet(
        &self,
        op: &str,
        node: u32,
        phase: u8,
        group: &[u32],
        me: u32,
        mine: Left,
    ) -> Result<BTreeMap<u32, Left>, CommError> {
        let start = Instant::now();
        let key = (node, phase, group.to_vec());
        let mut s = self.state.lock().unwrap();
        let m = s.meetings.entry(key.clone()).or_default();
        if m.left.insert(me, mine).is_some() {
            return Err(CommError::Mismatch {
                op: op.into(),
                node,
                group: group.to_vec(),
                sizes: format!("device {me} joined twice"),
            });
        }
        if m.left.len() == group.len() {
            self.cv.notify_all();
        }
        loop {
            let m = s
                .meetings
                .get_mut(&key)
                .expect("a meeting lasts until every member read it");
            if m.left.len() == group.len() {
                let all = m.left.clone();
                m.read += 1;
                if m.read == group.len() {
                    s.meetings.remove(&key);
                }
                return Ok(all);
            }
            if self.aborted() {
                return Err(CommError::Aborted);
            }
            let Some(left) = self.timeout.checked_sub(start.elapsed()) else {
                let missing = group
                    .iter()
                    .copied()
                    .filter(|d| !m.left.contains_key(d))
                    .collect();
                return Err(CommError::CollectiveTimeout {
                    op: op.into(),
                    node,
                    group: group.to_vec(),
                    me,
                    missing,
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            };
            s = self
                .cv
                .wait_timeout(s, left.min(Duration::from_millis(200)))
                .unwrap()
                .0;
        }
    }

    /// A reduce-scatter (meeting phase `SCATTER`).
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
        let len = data.len();
        let mine = Left {
            data: Arc::new(data),
            lens: lens.into(),
        };
        let all = self.meet(op, node, SCATTER, group, me, mine)?;
        if all
            .values()
            .any(|l| l.data.len() != len || *l.lens != *lens)
        {
            let same_len = all.values().all(|l| l.data.len() == len);
            return Err(CommError::Mismatch {
                op: op.into(),
                node,
                group: group.to_vec(),
                sizes: all
                    .iter()
                    .map(|(d, l)| match same_len {
                        true => format!("device {d}: {len} floats in chunks {:?}", l.lens),
                        false => format!("device {d}: {} floats", l.data.len()),
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        let at = chunk_start(lens, pos);
        let range = at..at + lens[pos];
        let chunks = all.iter().map(|(d, l)| (*d, &l.data[range.clone()]));
        let sum = sum_in_device_order(op, node, group, chunks)?;
        self.count(me, (len - lens[pos]) as u64 * 4);
        Ok(sum)
    }

    /// An all-gather (meeting phase `GATHER`).
    fn gather(
        &self,
        op: &str,
        node: u32,
        group: &[u32],
        me: u32,
        shard: Vec<f32>,
    ) -> Result<Arc<Vec<f32>>, CommError> {
        check_group(op, node, group, me, None)?;
        let len = shard.len();
        let mine = Left {
            data: Arc::new(shard),
            lens: Arc::new([]),
        };
        let all = self.meet(op, node, GATHER, group, me, mine)?;
        let mut full = Vec::with_capacity(all.values().map(|l| l.data.len()).sum());
        for d in group {
            full.extend_from_slice(&all[d].data);
        }
        self.count(me, (len * (group.len() - 1)) as u64 * 4);
        Ok(Arc::new(full))
    }
}

impl Comm for LocalComm {
    /// Wake every waiter with [`CommError::Aborted`].
    fn abort(&self) {
        self.abort.store(true, Ordering::SeqCst);
        let _g = self.state.lock().unwrap();
        self.cv.notify_all();
    }

    fn aborted(&self) -> bool {
        self.abort.load(Ordering::SeqCst)
    }

    /// Buffered send: never blocks. A second message to a mailbox whose
    /// first was not received yet is an error, never an overwrite.
    fn send(&self, pair: u32, from: u32, to: u32, data: Arc<Vec<f32>>) -> Result<(), CommError> {
        self.post(u64::from(pair), from, to, data, true)
    }

    /// The wait limit of every receive and collective.
    fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Receive the matching send, waiting at most the timeout.
    fn recv(&self, pair: u32, from: u32, to: u32, what: &str) -> Result<Arc<Vec<f32>>, CommError> {
        self.take(u64::from(pair), from, to, what)
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
        self.gather(op, node, group, me, shard)
    }

    fn sent_bytes(&self) -> BTreeMap<u32, u64> {
        self.state.lock().unwrap().sent.clone()
    }
    fn count_sent(&self, device: u32, bytes: u64) {
        self.count(device, bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_sums_in_device_order_and_checks_sizes() {
        let comm = Arc::new(LocalComm::new(Duration::from_secs(5)));
        let r: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3u32)
                .map(|d| {
                    let comm = comm.clone();
                    s.spawn(move || {
                        comm.all_reduce("all-reduce", 7, &[0, 1, 2], d, vec![d as f32 + 1.0; 4])
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        assert!(r.iter().all(|v| **v == vec![6.0; 4]));
        let err = std::thread::scope(|s| {
            let a = s.spawn(|| comm.all_reduce("all-reduce", 8, &[0, 1], 0, vec![1.0; 3]));
            let b = s.spawn(|| comm.all_reduce("all-reduce", 8, &[0, 1], 1, vec![1.0; 2]));
            (a.join().unwrap(), b.join().unwrap())
        });
        let msg = err.0.unwrap_err().to_string();
        assert!(
            msg.contains("device 0: 3 floats, device 1: 2 floats"),
            "{msg}"
        );
        assert!(err.1.is_err());
    }

    #[test]
    fn all_to_all_delivers_each_chunk_to_its_member_whatever_the_sizes() {
        let comm = Arc::new(LocalComm::new(Duration::from_secs(5)));
        let group = [1u32, 3, 4];
        let key = super::super::in_op_key(9, 1).unwrap();
        let got: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = group
                .iter()
                .map(|&d| {
                    let comm = comm.clone();
                    // Device d sends `d·10 + peer` repeated peer+1 times to each peer.
                    let chunks = group
                        .iter()
                        .map(|&p| vec![(d * 10 + p) as f32; p as usize + 1])
                        .collect();
                    s.spawn(move || comm.all_to_all("dispatch", key, &group, d, chunks))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        for (i, &d) in group.iter().enumerate() {
            for (j, &src) in group.iter().enumerate() {
                assert_eq!(*got[i][j], vec![(src * 10 + d) as f32; d as usize + 1]);
            }
        }
        // A wrong chunk count is refused, naming the numbers; a missing
        // member times out with its name.
        let err = comm
            .all_to_all("dispatch", key, &group, 1, vec![vec![]; 2])
            .unwrap_err()
            .to_string();
        assert!(err.contains("brought 2 chunks for a group of 3"), "{err}");
        let short = LocalComm::new(Duration::from_millis(200));
        let err = short
            .all_to_all("combine", key, &[0, 1], 0, vec![vec![1.0], vec![2.0]])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("combine") && err.contains("from device 1"),
            "{err}"
        );
        assert_eq!(super::super::in_op_key(1 << 20, 0), None);
    }

    #[test]
    fn a_missing_peer_is_an_error_within_the_timeout() {
        let comm = LocalComm::new(Duration::from_millis(300));
        let t = Instant::now();
        let err = comm
            .all_reduce("all-reduce", 3, &[0, 1], 0, vec![1.0])
            .unwrap_err()
            .to_string();
        assert!(err.contains("devices [1] never joined"), "{err}");
        let err = comm.recv(5, 1, 0, "activation").unwrap_err().to_string();
        assert!(err.contains("from device 1; it never came"), "{err}");
        assert!(t.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn a_second_send_to_a_full_mailbox_is_an_error_not_an_overwrite() {
        let comm = LocalComm::new(Duration::from_secs(1));
        comm.send(9, 0, 1, Arc::new(vec![1.0])).unwrap();
        let err = comm.send(9, 0, 1, Arc::new(vec![2.0])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "device 0 sent #9 to device 1 twice; the first message was not received yet"
        );
        // The first message is intact, and the mailbox is free again after it.
        assert_eq!(*comm.recv(9, 0, 1, "activation").unwrap(), vec![1.0]);
        comm.send(9, 0, 1, Arc::new(vec![3.0])).unwrap();
    }
}

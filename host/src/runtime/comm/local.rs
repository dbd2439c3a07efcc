//! The in-process [`Comm`]: devices are threads of one process. Mailboxes
//! and collectives live in one mutex-guarded table; reductions add the
//! members' contributions in device order (a `BTreeMap` by device), so
//! results are bit-identical from run to run.

use super::{sum_in_device_order, Comm, CommError};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Collective {
    contrib: BTreeMap<u32, Vec<f32>>,
    result: Option<Result<Arc<Vec<f32>>, CommError>>,
    taken: usize,
}

#[derive(Default)]
struct State {
    mail: HashMap<(u32, u32, u32), Arc<Vec<f32>>>,
    colls: HashMap<(u32, Vec<u32>), Collective>,
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
        let mut s = self.state.lock().unwrap();
        match s.mail.entry((pair, from, to)) {
            std::collections::hash_map::Entry::Occupied(_) => {
                return Err(CommError::Duplicate {
                    node: pair,
                    from,
                    to,
                })
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(data);
            }
        }
        self.cv.notify_all();
        Ok(())
    }

    /// The wait limit of every receive and collective.
    fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Receive the matching send, waiting at most the timeout.
    fn recv(&self, pair: u32, from: u32, to: u32, what: &str) -> Result<Arc<Vec<f32>>, CommError> {
        let start = Instant::now();
        let mut s = self.state.lock().unwrap();
        loop {
            if let Some(d) = s.mail.remove(&(pair, from, to)) {
                return Ok(d);
            }
            if self.aborted() {
                return Err(CommError::Aborted);
            }
            let left = self.timeout.checked_sub(start.elapsed());
            let Some(left) = left else {
                return Err(CommError::RecvTimeout {
                    me: to,
                    peer: from,
                    node: pair,
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

    /// Sum `data` over `group` (every member gets the sum).
    fn all_reduce(
        &self,
        op: &str,
        node: u32,
        group: &[u32],
        me: u32,
        data: Vec<f32>,
    ) -> Result<Arc<Vec<f32>>, CommError> {
        let start = Instant::now();
        let key = (node, group.to_vec());
        let mut s = self.state.lock().unwrap();
        {
            let c = s.colls.entry(key.clone()).or_default();
            c.contrib.insert(me, data);
            if c.contrib.len() == group.len() && c.result.is_none() {
                let contrib = c.contrib.iter().map(|(d, v)| (*d, v.as_slice()));
                c.result = Some(sum_in_device_order(op, node, group, contrib).map(Arc::new));
                self.cv.notify_all();
            }
        }
        loop {
            let c = s
                .colls
                .get_mut(&key)
                .expect("collective entry exists until all took it");
            if let Some(r) = &c.result {
                let r = r.clone();
                c.taken += 1;
                if c.taken == group.len() {
                    s.colls.remove(&key);
                }
                return r;
            }
            if self.aborted() {
                return Err(CommError::Aborted);
            }
            let Some(left) = self.timeout.checked_sub(start.elapsed()) else {
                let missing = group
                    .iter()
                    .copied()
                    .filter(|d| !c.contrib.contains_key(d))
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

//! `piper comm check`: every collective of [`Comm`] over groups of 1 to N
//! devices with uneven sizes (empty chunks and shards included), each
//! device's result against a reference computed here (sums in device
//! order, concatenations: equal bit for bit), and the bytes each device's
//! transport recorded against what the direct algorithm sends. It runs the
//! devices of this process as threads, one fresh [`Comm`] per case, so the
//! same check covers one process and an MPI job (each rank its devices).

use super::{chunk_start, even_shards, in_op_key, Comm};
use std::collections::BTreeMap;
use std::time::Instant;

/// One collective over one group.
#[derive(Clone, Debug)]
struct Case {
    kind: Kind,
    group: Vec<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllReduce,
    ReduceScatter,
    AllGather,
    AllToAll,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all-reduce",
            Kind::ReduceScatter => "reduce-scatter",
            Kind::AllGather => "all-gather",
            Kind::AllToAll => "all-to-all",
        }
    }
}

/// What one case gave: its line for the report and what went wrong.
#[derive(Debug)]
pub struct Outcome {
    pub line: String,
    pub failures: Vec<String>,
}

/// Device `d`'s value `i` in case `c`: exact in f32, different per device,
/// with fractions so that the order of additions shows.
fn value(c: usize, d: u32, i: usize) -> f32 {
    let x = (d as usize * 7919 + c * 104_729 + i * 31) % 1009;
    x as f32 / 7.0 - 60.0
}

fn values(c: usize, d: u32, range: std::ops::Range<usize>) -> Vec<f32> {
    range.map(|i| value(c, d, i)).collect()
}

/// An all-reduce's or a reduce-scatter's buffer length in case `c`.
fn reduce_len(c: usize, n: usize) -> usize {
    1000 + 37 * n + c % 5
}

/// Uneven reduce-scatter chunks: some empty, the rest of different sizes.
fn scatter_lens(len: usize, n: usize) -> Vec<usize> {
    let mut lens: Vec<usize> = (0..n).map(|i| (i * 5 + 3) % 7 * 40).collect();
    let given: usize = lens.iter().sum();
    lens[n - 1] += len.saturating_sub(given);
    lens
}

/// Member `d`'s all-gather shard length (some empty).
fn shard_len(d: u32) -> usize {
    (d as usize * 3 + 1) % 5 * 100
}

/// The all-to-all chunk device `from` sends device `to`.
fn chunk_len(from: u32, to: u32) -> usize {
    ((from * 3 + to * 5) % 4) as usize * 50
}

/// The sum, in device order from zero, of every member's `range`.
fn reference_sum(c: usize, group: &[u32], range: std::ops::Range<usize>) -> Vec<f32> {
    let mut sorted = group.to_vec();
    sorted.sort_unstable();
    let mut sum = vec![0.0f32; range.len()];
    for &d in &sorted {
        for (s, v) in sum.iter_mut().zip(values(c, d, range.clone())) {
            *s += v;
        }
    }
    sum
}

/// The cases for `devices` devices: each collective over 1..=devices
/// members, spread over the devices (every group its own members).
fn cases(devices: u32) -> Vec<Case> {
    let mut out = Vec::new();
    for kind in [
        Kind::AllReduce,
        Kind::ReduceScatter,
        Kind::AllGather,
        Kind::AllToAll,
    ] {
        for n in 1..=devices {
            let group = (0..n).map(|i| i * devices / n).collect();
            out.push(Case { kind, group });
        }
    }
    out
}

/// Run case `c` as device `me`: the result checked against the
/// reference; returns the bytes the algorithm says `me` sends.
fn run_as(comm: &dyn Comm, c: usize, case: &Case, me: u32) -> Result<u64, String> {
    let g = &case.group;
    let n = g.len();
    let pos = g.iter().position(|d| *d == me).expect("a member");
    let node = c as u32;
    let err = |e: super::CommError| e.to_string();
    let same = |got: &[f32], want: &[f32]| match got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    {
        true => Ok(()),
        false => Err(format!(
            "device {me} got {} values{}, the reference {}",
            got.len(),
            got.iter()
                .zip(want)
                .position(|(a, b)| a.to_bits() != b.to_bits())
                .map_or(String::new(), |i| format!(
                    " ({} at {i} where the reference has {})",
                    got[i], want[i]
                )),
            want.len()
        )),
    };
    match case.kind {
        Kind::AllReduce => {
            let len = reduce_len(c, n);
            let got = comm
                .all_reduce("all-reduce", node, g, me, values(c, me, 0..len))
                .map_err(err)?;
            same(&got, &reference_sum(c, g, 0..len))?;
            let own = even_shards(len, n)[pos];
            Ok(4 * ((len - own) + (n - 1) * own) as u64)
        }
        Kind::ReduceScatter => {
            let len = reduce_len(c, n);
            let lens = scatter_lens(len, n);
            let got = comm
                .reduce_scatter("reduce-scatter", node, g, me, values(c, me, 0..len), &lens)
                .map_err(err)?;
            let at = chunk_start(&lens, pos);
            same(&got, &reference_sum(c, g, at..at + lens[pos]))?;
            Ok(4 * (len - lens[pos]) as u64)
        }
        Kind::AllGather => {
            let got = comm
                .all_gather("all-gather", node, g, me, values(c, me, 0..shard_len(me)))
                .map_err(err)?;
            let want: Vec<f32> = g
                .iter()
                .flat_map(|&d| values(c, d, 0..shard_len(d)))
                .collect();
            same(&got, &want)?;
            Ok(4 * ((n - 1) * shard_len(me)) as u64)
        }
        Kind::AllToAll => {
            let key = in_op_key(node, 0).ok_or("too many cases for a key")?;
            let chunks = g
                .iter()
                .map(|&to| values(c, me * 1000 + to, 0..chunk_len(me, to)))
                .collect();
            let got = comm
                .all_to_all("all-to-all", key, g, me, chunks)
                .map_err(err)?;
            for (&from, chunk) in g.iter().zip(&got) {
                same(chunk, &values(c, from * 1000 + me, 0..chunk_len(from, me)))?;
            }
            let out: usize = g
                .iter()
                .filter(|&&to| to != me)
                .map(|&to| chunk_len(me, to))
                .sum();
            Ok(4 * out as u64)
        }
    }
}

/// Run every case on the devices `local` of this process (of `devices` in
/// all), `comm(case)` giving a fresh [`Comm`] per case and `done(case)`
/// called after it. One [`Outcome`] per case that has a device here.
pub fn run(
    devices: u32,
    local: &[u32],
    comm: &dyn Fn(u32) -> Box<dyn Comm>,
    done: &dyn Fn(u32),
) -> Vec<Outcome> {
    let mut out = Vec::new();
    for (c, case) in cases(devices).iter().enumerate() {
        let mine: Vec<u32> = case
            .group
            .iter()
            .copied()
            .filter(|d| local.contains(d))
            .collect();
        if mine.is_empty() {
            continue;
        }
        let fabric = comm(c as u32);
        let t = Instant::now();
        let results: Vec<(u32, Result<u64, String>)> = std::thread::scope(|s| {
            let handles: Vec<_> = mine
                .iter()
                .map(|&d| {
                    let f = fabric.as_ref();
                    s.spawn(move || (d, run_as(f, c, case, d)))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a check thread"))
                .collect()
        });
        let secs = t.elapsed().as_secs_f64();
        let sent = fabric.sent_bytes();
        drop(fabric);
        done(c as u32);
        let mut failures = Vec::new();
        let mut bytes = BTreeMap::new();
        for (d, r) in results {
            match r {
                Err(e) => failures.push(format!("{} over {:?}: {e}", case.kind.name(), case.group)),
                Ok(want) => {
                    let got = sent.get(&d).copied().unwrap_or(0);
                    if got != want {
                        failures.push(format!(
                            "{} over {:?}: device {d} sent {got} bytes, the algorithm {want}",
                            case.kind.name(),
                            case.group
                        ));
                    }
                    bytes.insert(d, got);
                }
            }
        }
        let bytes: Vec<String> = bytes.iter().map(|(d, b)| format!("{d}:{b}")).collect();
        out.push(Outcome {
            line: format!(
                "{:<15} {:>2} members {:<18} sent bytes {}  {:.1} ms",
                case.kind.name(),
                case.group.len(),
                format!("{:?}", case.group),
                bytes.join(" "),
                secs * 1e3
            ),
            failures,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::LocalComm;
    use super::*;
    use std::time::Duration;

    #[test]
    fn every_collective_on_1_to_5_members_matches_the_reference_and_its_bytes() {
        let outcomes = run(
            5,
            &[0, 1, 2, 3, 4],
            &|_| Box::new(LocalComm::new(Duration::from_secs(10))),
            &|_| {},
        );
        assert_eq!(outcomes.len(), 4 * 5);
        let failures: Vec<&String> = outcomes.iter().flat_map(|o| &o.failures).collect();
        assert!(failures.is_empty(), "{failures:#?}");
        // Reduce-scatter and all-gather of S bytes over N members: each
        // member sends (N−1)/N·S with even shards (a ring's volume).
        let comm = LocalComm::new(Duration::from_secs(10));
        let group = [0u32, 1, 2, 3];
        let len = 4000usize;
        let lens = even_shards(len, 4);
        std::thread::scope(|s| {
            for &d in &group {
                let (comm, lens) = (&comm, &lens);
                s.spawn(move || {
                    let shard = comm
                        .reduce_scatter("rs", 1, &group, d, vec![1.0; len], lens)
                        .unwrap();
                    assert_eq!(shard, vec![4.0; len / 4]);
                    let full = comm.all_gather("ag", 2, &group, d, shard).unwrap();
                    assert_eq!(*full, vec![4.0; len]);
                });
            }
        });
        let s = (len * 4) as u64;
        for d in group {
            assert_eq!(comm.sent_bytes()[&d], 2 * (s * 3 / 4), "device {d}");
        }
    }

    #[test]
    fn a_member_that_cuts_the_buffer_differently_is_named() {
        let comm = LocalComm::new(Duration::from_secs(5));
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| comm.reduce_scatter("rs", 3, &[0, 1], 0, vec![1.0; 4], &[2, 2]));
            let b = s.spawn(|| comm.reduce_scatter("rs", 3, &[0, 1], 1, vec![1.0; 4], &[3, 1]));
            (a.join().unwrap(), b.join().unwrap())
        });
        let e = a.unwrap_err().to_string();
        assert!(
            e.contains("device 0: 4 floats in chunks [2, 2], device 1: 4 floats in chunks [3, 1]"),
            "{e}"
        );
        assert!(b.is_err());
        // Chunks that do not add up, or a device outside the group.
        let e = comm
            .reduce_scatter("rs", 4, &[0, 1], 0, vec![1.0; 4], &[1, 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("cut 4 floats into 2 chunks of [1, 1]"), "{e}");
        let e = comm
            .all_gather("ag", 5, &[0, 1], 7, vec![])
            .unwrap_err()
            .to_string();
        assert!(e.contains("device 7 is not a member"), "{e}");
    }
}

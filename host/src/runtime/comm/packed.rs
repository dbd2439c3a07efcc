//! Tensors on the wire in their own dtype. A transport moves 32-bit words
//! and never does arithmetic on what it moves except in a reduction; so
//! bf16 values travel two to a word (their bits, low half first), and a
//! bf16 reduction is built from moves: each member's chunks go to their
//! owners by all-to-all, the owner adds them in fp32 in device order and
//! rounds once, and the rounded chunks are all-gathered. fp32 tensors take
//! the transport's own calls unchanged. The ops hand these functions host
//! values of a tensor of the dtype they name (bf16 values exactly
//! representable), so packing loses nothing.
//!
//! Bytes on the wire are then the plan's: 2 a bf16 element, plus one word
//! heading a point-to-point message (its element count, which the
//! receiver checks).

use super::{even_shards, sum_in_device_order, Comm, CommError};
use crate::model::Dtype;
use half::bf16;
use std::sync::Arc;

/// Words of `n` elements of `dtype` on the wire.
pub fn words(n: usize, dtype: Dtype) -> usize {
    match dtype {
        Dtype::F32 => n,
        Dtype::Bf16 => n.div_ceil(2),
    }
}

/// `values` as the words that carry them (rounded to nearest even where a
/// value is not a bf16 already).
pub fn pack(values: &[f32], dtype: Dtype) -> Vec<f32> {
    match dtype {
        Dtype::F32 => values.to_vec(),
        Dtype::Bf16 => values
            .chunks(2)
            .map(|p| {
                let lo = u32::from(bf16::from_f32(p[0]).to_bits());
                let hi = p
                    .get(1)
                    .map_or(0, |x| u32::from(bf16::from_f32(*x).to_bits()));
                f32::from_bits(lo | hi << 16)
            })
            .collect(),
    }
}

/// The `n` values `words` carry, appended to `out`.
fn unpack_into(words: &[f32], n: usize, dtype: Dtype, out: &mut Vec<f32>) {
    match dtype {
        Dtype::F32 => out.extend_from_slice(&words[..n]),
        Dtype::Bf16 => {
            let half = |w: &f32, i: usize| {
                let bits = (w.to_bits() >> (16 * (i % 2))) as u16;
                f32::from(bf16::from_bits(bits))
            };
            out.extend((0..n).map(|i| half(&words[i / 2], i)));
        }
    }
}

/// A message that does not hold what its dtype and length say.
fn malformed(what: &str, node: u32, group: &[u32], sizes: String) -> CommError {
    CommError::Mismatch {
        op: what.into(),
        node,
        group: group.to_vec(),
        sizes,
    }
}

/// Send `values` of a `dtype` tensor (see [`Comm::send`]).
pub fn send(
    comm: &dyn Comm,
    pair: u32,
    (from, to): (u32, u32),
    values: Vec<f32>,
    dtype: Dtype,
) -> Result<(), CommError> {
    let msg = match dtype {
        Dtype::F32 => values,
        _ => headed(values, dtype, ("bf16 message", pair), &[from, to])?,
    };
    comm.send(pair, from, to, Arc::new(msg))
}

/// Receive a message of a `dtype` tensor (see [`Comm::recv`]); its length
/// is checked against its head.
pub fn recv(
    comm: &dyn Comm,
    pair: u32,
    (from, to): (u32, u32),
    what: &str,
    dtype: Dtype,
) -> Result<Vec<f32>, CommError> {
    let msg = comm.recv(pair, from, to, what)?;
    match dtype {
        Dtype::F32 => Ok(Arc::unwrap_or_clone(msg)),
        _ => unheaded(&msg, dtype, (what, pair), (from, &[from, to])),
    }
}

/// All-to-all (see [`Comm::all_to_all`]) of chunks of a `dtype` tensor:
/// each a message with its element count at its head, as [`send`]'s.
pub fn all_to_all(
    comm: &dyn Comm,
    (what, key): (&str, u32),
    group: &[u32],
    me: u32,
    chunks: Vec<Vec<f32>>,
    dtype: Dtype,
) -> Result<Vec<Vec<f32>>, CommError> {
    if dtype == Dtype::F32 {
        let got = comm.all_to_all(what, key, group, me, chunks)?;
        return Ok(got.into_iter().map(Arc::unwrap_or_clone).collect());
    }
    let msgs = chunks
        .into_iter()
        .map(|c| headed(c, dtype, (what, key), group))
        .collect::<Result<Vec<_>, _>>()?;
    let got = comm.all_to_all(what, key, group, me, msgs)?;
    group
        .iter()
        .zip(got)
        .map(|(from, msg)| unheaded(&msg, dtype, (what, key), (*from, group)))
        .collect()
}

/// A message of `values`: its element count, then the packed values.
fn headed(
    values: Vec<f32>,
    dtype: Dtype,
    (what, key): (&str, u32),
    group: &[u32],
) -> Result<Vec<f32>, CommError> {
    let n = u32::try_from(values.len()).map_err(|_| {
        let sizes = format!("{} elements do not fit one message", values.len());
        malformed(what, key, group, sizes)
    })?;
    let mut msg = Vec::with_capacity(1 + words(values.len(), dtype));
    msg.push(f32::from_bits(n));
    msg.extend(pack(&values, dtype));
    Ok(msg)
}

/// The values of a [`headed`] message from `from`, its length checked
/// against its head.
fn unheaded(
    msg: &[f32],
    dtype: Dtype,
    (what, key): (&str, u32),
    (from, group): (u32, &[u32]),
) -> Result<Vec<f32>, CommError> {
    let n = msg.first().map_or(0, |h| h.to_bits() as usize);
    if msg.is_empty() || msg.len() != 1 + words(n, dtype) {
        let sizes = format!(
            "device {from} sent {} words, not a bf16 message's head and its elements",
            msg.len()
        );
        return Err(malformed(what, key, group, sizes));
    }
    let mut out = Vec::with_capacity(n);
    unpack_into(&msg[1..], n, dtype, &mut out);
    Ok(out)
}

/// All-gather (see [`Comm::all_gather`]) of shards of `lens` elements (one
/// per member, in group order; `shard` is this device's).
pub fn all_gather(
    comm: &dyn Comm,
    (what, node): (&str, u32),
    group: &[u32],
    me: u32,
    shard: Vec<f32>,
    lens: &[usize],
    dtype: Dtype,
) -> Result<Vec<f32>, CommError> {
    if dtype == Dtype::F32 {
        return comm
            .all_gather(what, node, group, me, shard)
            .map(Arc::unwrap_or_clone);
    }
    let got = comm.all_gather(what, node, group, me, pack(&shard, dtype))?;
    let expected: usize = lens.iter().map(|l| words(*l, dtype)).sum();
    if lens.len() != group.len() || got.len() != expected {
        let sizes = format!(
            "{} words gathered for shards of {lens:?} bf16 elements",
            got.len()
        );
        return Err(malformed(what, node, group, sizes));
    }
    let mut out = Vec::with_capacity(lens.iter().sum());
    let mut at = 0;
    for l in lens {
        let w = words(*l, dtype);
        unpack_into(&got[at..at + w], *l, dtype, &mut out);
        at += w;
    }
    Ok(out)
}

/// Reduce-scatter (see [`Comm::reduce_scatter`]); in bf16 an all-to-all
/// under `key` (see [`super::in_op_key`]), each chunk summed in fp32 in
/// device order and rounded once.
pub fn reduce_scatter(
    comm: &dyn Comm,
    (what, key): (&str, u32),
    group: &[u32],
    me: u32,
    data: Vec<f32>,
    lens: &[usize],
    dtype: Dtype,
) -> Result<Vec<f32>, CommError> {
    if dtype == Dtype::F32 {
        return comm.reduce_scatter(what, key, group, me, data, lens);
    }
    let total = lens.iter().try_fold(0usize, |a, l| a.checked_add(*l));
    if lens.len() != group.len() || total != Some(data.len()) {
        let sizes = format!(
            "device {me} cut {} values into chunks of {lens:?}",
            data.len()
        );
        return Err(malformed(what, key, group, sizes));
    }
    let mut chunks = Vec::with_capacity(lens.len());
    let mut at = 0;
    for l in lens {
        chunks.push(pack(&data[at..at + l], dtype));
        at += l;
    }
    let got = comm.all_to_all(what, key, group, me, chunks)?;
    let mine = group.iter().position(|d| *d == me).map_or(0, |p| lens[p]);
    let mut members: Vec<(u32, Vec<f32>)> = Vec::with_capacity(group.len());
    for (d, words_) in group.iter().zip(&got) {
        if words_.len() != words(mine, dtype) {
            let sizes = format!("device {d} sent {} words for {mine} elements", words_.len());
            return Err(malformed(what, key, group, sizes));
        }
        let mut v = Vec::with_capacity(mine);
        unpack_into(words_, mine, dtype, &mut v);
        members.push((*d, v));
    }
    members.sort_by_key(|(d, _)| *d);
    let sum = sum_in_device_order(what, key, group, members.iter().map(|(d, v)| (*d, &v[..])))?;
    // Rounded as the tensor holds it.
    let mut out = Vec::with_capacity(sum.len());
    unpack_into(&pack(&sum, dtype), sum.len(), dtype, &mut out);
    Ok(out)
}

/// All-reduce (see [`Comm::all_reduce`]): a reduce-scatter under
/// `keys.0` and an all-gather under `keys.1` of even chunks.
pub fn all_reduce(
    comm: &dyn Comm,
    what: &str,
    keys: (u32, u32),
    group: &[u32],
    me: u32,
    data: Vec<f32>,
    dtype: Dtype,
) -> Result<Vec<f32>, CommError> {
    if dtype == Dtype::F32 {
        return comm
            .all_reduce(what, keys.0, group, me, data)
            .map(Arc::unwrap_or_clone);
    }
    let lens = even_shards(data.len(), group.len());
    let chunk = reduce_scatter(comm, (what, keys.0), group, me, data, &lens, dtype)?;
    all_gather(comm, (what, keys.1), group, me, chunk, &lens, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::comm::LocalComm;
    use std::time::Duration;

    fn on_three<T: Send>(f: impl Fn(&LocalComm, u32) -> T + Sync) -> Vec<T> {
        let comm = LocalComm::new(Duration::from_secs(5));
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3u32)
                .map(|d| {
                    let (comm, f) = (&comm, &f);
                    s.spawn(move || f(comm, d))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn bf16_values_round_trip_two_to_a_word_and_odd_lengths_keep_their_last() {
        let v: Vec<f32> = [1.0f32, -2.5, 3.0e-3, f32::INFINITY, 65280.0]
            .iter()
            .map(|x| f32::from(bf16::from_f32(*x)))
            .collect();
        let w = pack(&v, Dtype::Bf16);
        assert_eq!(w.len(), 3);
        let mut back = Vec::new();
        unpack_into(&w, v.len(), Dtype::Bf16, &mut back);
        assert_eq!(back, v);
        // A value that is not a bf16 is rounded to nearest, as a cast does.
        let mut r = Vec::new();
        unpack_into(
            &pack(&[1.0 + 1.0 / 256.0 + 1e-4], Dtype::Bf16),
            1,
            Dtype::Bf16,
            &mut r,
        );
        assert_eq!(r, [1.0 + 1.0 / 128.0]);
    }

    #[test]
    fn a_bf16_all_reduce_sums_in_fp32_rounds_once_and_sends_half_the_bytes() {
        // 256 + 1 + 1: adding in bf16 (8 significant bits) would round
        // 257 back to 256; in fp32 the sum is 258, a bf16.
        let out = on_three(|c, d| {
            let x = if d == 0 { 256.0 } else { 1.0 };
            let data = vec![x; 7];
            let r = all_reduce(c, "sum", (5, 6), &[0, 1, 2], d, data, Dtype::Bf16);
            (r.unwrap(), c.sent_bytes()[&d])
        });
        // Chunks of 3, 3 and 1 elements, 2 bytes each in whole words: the
        // other members' chunks out, this member's chunk to each of them
        // (fp32: 40, 40 and 32 bytes).
        for (d, (sum, sent)) in out.into_iter().enumerate() {
            assert_eq!(sum, vec![258.0; 7]);
            assert_eq!(sent, [28, 28, 24][d], "device {d}");
        }
        let out = on_three(|c, d| {
            let data = vec![1.0f32; 7];
            all_reduce(c, "sum", (5, 6), &[0, 1, 2], d, data, Dtype::F32).unwrap()
        });
        assert!(out.iter().all(|s| s == &vec![3.0; 7]));
    }

    #[test]
    fn a_bf16_message_carries_its_length_and_a_wrong_one_is_an_error() {
        let comm = LocalComm::new(Duration::from_secs(1));
        let v = vec![0.5f32, 1.5, -4.0];
        send(&comm, 9, (0, 1), v.clone(), Dtype::Bf16).unwrap();
        assert_eq!(recv(&comm, 9, (0, 1), "act", Dtype::Bf16).unwrap(), v);
        assert_eq!(comm.sent_bytes()[&0], 4 * 3);
        comm.send(3, 0, 1, Arc::new(vec![f32::from_bits(5), 0.0]))
            .unwrap();
        let err = recv(&comm, 3, (0, 1), "act", Dtype::Bf16).unwrap_err();
        assert!(err.to_string().contains("not a bf16 message"), "{err}");
    }
}

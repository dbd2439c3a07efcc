//! The bytes of per-device state parts (whole tensors and ZeRO shards, by
//! parameter id) sent from the ranks of an MPI job to the first one, which
//! writes checkpoints and step-1 dumps once. Little-endian; every length
//! read is checked against what is left and every id against the model's
//! table, so a short or corrupt buffer is an error, not a panic or a huge
//! allocation.

use super::backend::{ParamId, ParamMap};
use super::zero::Shard;
use super::Part;

fn put_u64(b: &mut Vec<u8>, x: u64) {
    b.extend_from_slice(&x.to_le_bytes());
}

fn put_floats(b: &mut Vec<u8>, v: &[f32]) {
    put_u64(b, v.len() as u64);
    for x in v {
        b.extend_from_slice(&x.to_le_bytes());
    }
}

/// Encode the parts of some devices, in order.
pub(crate) fn encode(parts: &[Part]) -> Vec<u8> {
    let mut b = Vec::new();
    put_u64(&mut b, parts.len() as u64);
    for (whole, shards) in parts {
        put_u64(&mut b, whole.len() as u64);
        for (id, v) in whole.iter() {
            put_u64(&mut b, id.index() as u64);
            put_floats(&mut b, v);
        }
        put_u64(&mut b, shards.len() as u64);
        for s in shards {
            put_u64(&mut b, s.names.len() as u64);
            for (n, len) in &s.names {
                put_u64(&mut b, n.index() as u64);
                put_u64(&mut b, *len as u64);
            }
            put_u64(&mut b, s.total as u64);
            put_u64(&mut b, s.range.start as u64);
            put_u64(&mut b, s.range.end as u64);
            put_floats(&mut b, &s.values);
        }
    }
    b
}

struct Reader<'a> {
    b: &'a [u8],
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if n > self.b.len() {
            return Err(format!("needs {n} more bytes, {} are left", self.b.len()));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// A count of items of at least `min_bytes` each: never more than the
    /// bytes left could hold.
    fn count(&mut self, min_bytes: usize) -> Result<usize, String> {
        let n = self.u64()?;
        if n > (self.b.len() / min_bytes.max(1)) as u64 {
            return Err(format!(
                "a count of {n} does not fit in {} bytes",
                self.b.len()
            ));
        }
        Ok(n as usize)
    }
    /// A parameter id of a table of `params`.
    fn id(&mut self, params: usize) -> Result<ParamId, String> {
        let i = self.u64()?;
        match usize::try_from(i).ok().filter(|i| *i < params) {
            Some(i) => ParamId::from_index(i).ok_or_else(|| format!("parameter #{i}")),
            None => Err(format!("parameter #{i} is not one of the model's {params}")),
        }
    }
    fn floats(&mut self) -> Result<Vec<f32>, String> {
        let n = self.count(4)?;
        Ok(self
            .take(4 * n)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
}

/// Decode what [`encode`] wrote, for a model of `params` parameters.
pub(crate) fn decode(bytes: &[u8], params: usize) -> Result<Vec<Part>, String> {
    let mut r = Reader { b: bytes };
    let n = r.count(16)?;
    let mut parts = Vec::with_capacity(n);
    for _ in 0..n {
        let mut whole = ParamMap::new();
        for _ in 0..r.count(16)? {
            let id = r.id(params)?;
            whole.insert(id, r.floats()?);
        }
        let mut shards = Vec::new();
        for _ in 0..r.count(40)? {
            let mut names = Vec::new();
            for _ in 0..r.count(16)? {
                let n = r.id(params)?;
                names.push((n, r.u64()? as usize));
            }
            let total = r.u64()? as usize;
            let (start, end) = (r.u64()? as usize, r.u64()? as usize);
            let values = r.floats()?;
            let sum: usize = names.iter().map(|(_, l)| *l).sum();
            if sum != total || start > end || end > total || values.len() < end - start {
                return Err(format!(
                    "a shard of {total} values ({sum} named) claims range {start}..{end} with {} values",
                    values.len()
                ));
            }
            shards.push(Shard {
                names,
                total,
                range: start..end,
                values,
            });
        }
        parts.push((whole, shards));
    }
    if !r.b.is_empty() {
        return Err(format!("{} bytes left over", r.b.len()));
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_round_trip_bit_for_bit_and_bad_bytes_are_errors() {
        let id = |i| ParamId::from_index(i).unwrap();
        let mut whole = ParamMap::new();
        whole.insert(id(4), vec![1.5, -0.0, f32::MIN_POSITIVE, 3.25e-7]);
        let shard = Shard {
            names: vec![(id(0), 3), (id(2), 2)],
            total: 5,
            range: 2..4,
            values: vec![0.1, 0.2],
        };
        let parts = vec![(whole, vec![shard]), (ParamMap::new(), Vec::new())];
        let bytes = encode(&parts);
        let back = decode(&bytes, 5).unwrap();
        assert_eq!(back.len(), 2);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(back[0].0.get(id(4)).unwrap()),
            bits(parts[0].0.get(id(4)).unwrap())
        );
        assert_eq!(back[0].0.len(), 1);
        assert_eq!(back[0].1[0].names, [(id(0), 3), (id(2), 2)]);
        assert_eq!(back[0].1[0].range, 2..4);
        assert_eq!(back[0].1[0].values, vec![0.1, 0.2]);
        // Every truncation is an error, never a panic.
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut], 5).is_err(), "cut at {cut}");
        }
        // A count claiming more than the buffer holds.
        let mut huge = bytes.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode(&huge, 5).unwrap_err().contains("does not fit"));
        // An id past the model's table.
        assert!(decode(&bytes, 4)
            .unwrap_err()
            .contains("parameter #4 is not one of the model's 4"));
    }
}

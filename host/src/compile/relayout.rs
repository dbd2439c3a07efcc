//! A relayout: the op compile plans where a data edge joins two layouts
//! (`layout.rs`), moving a batch-sized tensor from how its producer holds
//! it to how its consumer needs it. Both are [`Holding`]s per member: a
//! block of rows of the global batch and, of every row, some positions of
//! the sequence (all of them, or a context-parallel rank's two chunks). The
//! pieces each member sends each other follow from the two lists alone
//! ([`Relayout::pieces`]), so every member computes the same ones: the
//! runtime sends and assembles them, compile checks they cover what every
//! consumer needs, counts their bytes and the simulator costs them.

use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// What one device holds of a batch-sized tensor (`[rows, positions,
/// width]`, row-major): rows `rows[0]..rows[1]` of the global batch and,
/// of each, the positions of `spans` (each `[first, end)`), in that order.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Holding {
    pub rows: [u32; 2],
    pub spans: Vec<[u32; 2]>,
}

impl Holding {
    /// Rows held.
    pub fn row_count(&self) -> u64 {
        u64::from(self.rows[1].saturating_sub(self.rows[0]))
    }
    /// Positions held of each row.
    pub fn positions(&self) -> u64 {
        self.spans
            .iter()
            .map(|s| u64::from(s[1].saturating_sub(s[0])))
            .sum()
    }
    /// Row-positions held (the tensor's length over its width).
    pub fn cells(&self) -> u64 {
        self.row_count() * self.positions()
    }
    /// Where position `p` sits among the positions held (`None`: not held).
    pub fn offset(&self, p: u32) -> Option<u64> {
        let mut before = 0u64;
        for s in &self.spans {
            if (s[0]..s[1]).contains(&p) {
                return Some(before + u64::from(p - s[0]));
            }
            before += u64::from(s[1] - s[0]);
        }
        None
    }
    /// Rows and spans in order, each span inside `[0, seq)`, none empty or
    /// overlapping another.
    fn valid(&self, rows: u32, seq: u32) -> bool {
        let mut spans = self.spans.clone();
        spans.sort_unstable();
        self.rows[0] < self.rows[1]
            && self.rows[1] <= rows
            && !spans.is_empty()
            && spans.iter().all(|s| s[0] < s[1] && s[1] <= seq)
            && spans.windows(2).all(|w| w[0][1] <= w[1][0])
    }
}

/// One piece of a relayout: rows `rows` and positions `spans` (in the
/// receiver's order) of the tensor, from member `from` to member `to`
/// (indices into [`Relayout::members`]; equal for what a member keeps).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub from: usize,
    pub to: usize,
    pub rows: [u32; 2],
    pub spans: Vec<[u32; 2]>,
}

impl Piece {
    pub fn cells(&self) -> u64 {
        u64::from(self.rows[1] - self.rows[0])
            * self
                .spans
                .iter()
                .map(|s| u64::from(s[1] - s[0]))
                .sum::<u64>()
    }
}

/// A batch-sized tensor moved between two layouts over `members`: each
/// member's holding before (`from`; `None`: it does not produce the
/// tensor) and after (`to`; `None`: it does not read it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Relayout {
    pub members: Arc<[u32]>,
    pub from: Vec<Option<Holding>>,
    pub to: Vec<Option<Holding>>,
    /// Bytes of one row-position (the tensor's width × its dtype's bytes).
    pub position_bytes: u64,
    /// The batch's rows and the sequence's positions the holdings index.
    pub batch_rows: u32,
    pub seq: u32,
}

/// A rectangle of the tensor: rows × one span of positions.
type Rect = ([u32; 2], [u32; 2]);

fn meet(a: [u32; 2], b: [u32; 2]) -> Option<[u32; 2]> {
    let m = [a[0].max(b[0]), a[1].min(b[1])];
    (m[0] < m[1]).then_some(m)
}

/// `r` less the part of it inside `cut` (rows × positions): up to four
/// rectangles.
fn subtract(r: Rect, cut: Rect) -> Vec<Rect> {
    let (Some(rows), Some(pos)) = (meet(r.0, cut.0), meet(r.1, cut.1)) else {
        return vec![r];
    };
    let mut out = Vec::new();
    if r.0[0] < rows[0] {
        out.push(([r.0[0], rows[0]], r.1));
    }
    if rows[1] < r.0[1] {
        out.push(([rows[1], r.0[1]], r.1));
    }
    if r.1[0] < pos[0] {
        out.push((rows, [r.1[0], pos[0]]));
    }
    if pos[1] < r.1[1] {
        out.push((rows, [pos[1], r.1[1]]));
    }
    out
}

impl Relayout {
    /// What every member sends every other (and keeps of its own), each
    /// receiver's needs covered from itself first, then from the members
    /// in order; `Err` names a member whose needs no member holds, or a
    /// spec that is not one (lists of another length, holdings outside the
    /// batch or the sequence).
    pub fn pieces(&self) -> Result<Vec<Piece>, String> {
        let n = self.members.len();
        if self.from.len() != n || self.to.len() != n {
            return Err(format!(
                "{} members, {} holdings before and {} after",
                n,
                self.from.len(),
                self.to.len()
            ));
        }
        for (i, h) in self.from.iter().chain(&self.to).enumerate() {
            if let Some(h) = h.as_ref().filter(|h| !h.valid(self.batch_rows, self.seq)) {
                return Err(format!(
                    "member {}'s holding {h:?} is not rows and spans of a batch of {} rows of {} positions",
                    self.members[i % n],
                    self.batch_rows,
                    self.seq
                ));
            }
        }
        let mut pieces = Vec::new();
        for (to, need) in self.to.iter().enumerate() {
            let Some(need) = need else { continue };
            // What is left to find, in the receiver's span order.
            let mut left: Vec<Rect> = need.spans.iter().map(|s| (need.rows, *s)).collect();
            let sources = std::iter::once(to).chain((0..n).filter(|&m| m != to));
            for from in sources {
                let Some(have) = &self.from[from] else {
                    continue;
                };
                let mut got: Vec<Rect> = Vec::new();
                let mut rest = Vec::new();
                for r in left {
                    let mut pieces_of_r = vec![r];
                    for s in &have.spans {
                        let cut = (have.rows, *s);
                        let mut next = Vec::new();
                        for p in pieces_of_r {
                            if let (Some(rows), Some(pos)) = (meet(p.0, cut.0), meet(p.1, cut.1)) {
                                got.push((rows, pos));
                            }
                            next.extend(subtract(p, cut));
                        }
                        pieces_of_r = next;
                    }
                    rest.extend(pieces_of_r);
                }
                left = rest;
                // One piece per row block, its spans in the receiver's order.
                got.sort_by_key(|(rows, pos)| (*rows, need.offset(pos[0])));
                for (rows, pos) in got {
                    match pieces.last_mut() {
                        Some(Piece {
                            from: f,
                            to: t,
                            rows: r,
                            spans,
                        }) if *f == from && *t == to && *r == rows => spans.push(pos),
                        _ => pieces.push(Piece {
                            from,
                            to,
                            rows,
                            spans: vec![pos],
                        }),
                    }
                }
                if left.is_empty() {
                    break;
                }
            }
            if let Some((rows, pos)) = left.first() {
                return Err(format!(
                    "device {} needs rows {}..{} at positions {}..{}, which no member holds",
                    self.members[to], rows[0], rows[1], pos[0], pos[1]
                ));
            }
        }
        Ok(pieces)
    }

    /// Bytes member `device` sends the others.
    pub fn sent_bytes(&self, device: u32) -> u64 {
        let Some(me) = self.members.iter().position(|&m| m == device) else {
            return 0;
        };
        self.pieces()
            .unwrap_or_default()
            .iter()
            .filter(|p| p.from == me && p.to != me)
            .map(|p| p.cells() * self.position_bytes)
            .sum()
    }

    /// Bytes member `device` holds after the move (its consumer's input).
    pub fn held_bytes(&self, device: u32) -> u64 {
        self.members
            .iter()
            .position(|&m| m == device)
            .and_then(|i| self.to[i].as_ref())
            .map_or(0, |h| h.cells() * self.position_bytes)
    }

    /// Bytes member `device` holds before the move (its producer's output).
    pub fn source_bytes(&self, device: u32) -> u64 {
        self.members
            .iter()
            .position(|&m| m == device)
            .and_then(|i| self.from[i].as_ref())
            .map_or(0, |h| h.cells() * self.position_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(rows: [u32; 2], spans: &[[u32; 2]]) -> Option<Holding> {
        Some(Holding {
            rows,
            spans: spans.to_vec(),
        })
    }

    fn relayout(from: Vec<Option<Holding>>, to: Vec<Option<Holding>>) -> Relayout {
        Relayout {
            members: (0..from.len() as u32).collect(),
            from,
            to,
            position_bytes: 4,
            batch_rows: 8,
            seq: 8,
        }
    }

    /// Context-parallel chunks (2 ranks, 4 chunks of 2) to two data-parallel
    /// halves of the rows: each half takes its own chunks from itself and
    /// the other rank's from the other, in position order.
    #[test]
    fn context_chunks_to_row_halves_take_the_others_chunks() {
        let r = relayout(
            vec![h([0, 8], &[[0, 2], [6, 8]]), h([0, 8], &[[2, 4], [4, 6]])],
            vec![h([0, 4], &[[0, 8]]), h([4, 8], &[[0, 8]])],
        );
        let p = r.pieces().unwrap();
        let cells = |from, to| {
            p.iter()
                .filter(|x| x.from == from && x.to == to)
                .map(Piece::cells)
                .sum::<u64>()
        };
        assert_eq!(
            (cells(0, 0), cells(1, 0), cells(0, 1), cells(1, 1)),
            (16, 16, 16, 16)
        );
        let from_1_to_0: Vec<_> = p.iter().filter(|x| x.from == 1 && x.to == 0).collect();
        assert_eq!(from_1_to_0[0].spans, vec![[2, 4], [4, 6]]);
        assert_eq!(r.sent_bytes(0), 16 * 4);
    }

    /// A tensor-parallel pair holds the whole batch twice: each data-parallel
    /// half is cut from the receiver's own copy, nothing is sent.
    #[test]
    fn what_a_receiver_holds_already_is_kept_not_sent() {
        let whole = h([0, 8], &[[0, 8]]);
        let r = relayout(
            vec![whole.clone(), whole],
            vec![h([0, 4], &[[0, 8]]), h([4, 8], &[[0, 8]])],
        );
        assert!(r.pieces().unwrap().iter().all(|p| p.from == p.to));
        assert_eq!(r.sent_bytes(0) + r.sent_bytes(1), 0);
    }

    /// A group feeding a wider one: the new member's rows come from the
    /// one device that has them; what nobody holds is refused by name.
    #[test]
    fn a_new_member_receives_and_a_gap_is_named() {
        let r = relayout(
            vec![h([0, 8], &[[0, 8]]), None],
            vec![h([0, 4], &[[0, 8]]), h([4, 8], &[[0, 8]])],
        );
        let p = r.pieces().unwrap();
        assert!(p
            .iter()
            .any(|x| x.from == 0 && x.to == 1 && x.rows == [4, 8]));
        let gap = relayout(
            vec![h([0, 4], &[[0, 8]]), None],
            vec![None, h([0, 8], &[[0, 8]])],
        );
        let e = gap.pieces().unwrap_err();
        assert!(
            e.contains("device 1 needs rows 4..8 at positions 0..8, which no member holds"),
            "{e}"
        );
    }

    #[test]
    fn a_holding_outside_the_batch_is_refused() {
        let r = relayout(vec![h([0, 9], &[[0, 8]])], vec![h([0, 8], &[[0, 8]])]);
        assert!(r
            .pieces()
            .unwrap_err()
            .contains("is not rows and spans of a batch of 8 rows"));
    }
}

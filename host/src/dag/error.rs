//! Errors of the DAG stage. Every directive and primitive returns a
//! [`DagError`] that names the call (directive and arguments) and what was
//! wrong, quoting the offending nodes by label (`F{PP:1,MB:3}#17`).

use std::fmt;

/// What went wrong in a directive or primitive.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DagErrorKind {
    #[error("unknown tag `{tag}`: the DAG's tags are {known:?}")]
    UnknownTag { tag: String, known: Vec<String> },
    #[error("filter {filter} matches no node")]
    NoMatch { filter: String },
    #[error("filter {filter} matches no {what} node (it matched {matched:?})")]
    WrongKind {
        filter: String,
        what: &'static str,
        matched: Vec<String>,
    },
    #[error("device {device} does not exist, the cluster has {cluster}")]
    DeviceOutOfRange { device: u32, cluster: u32 },
    #[error("the device list is empty")]
    EmptyDevices,
    #[error("device {device} appears twice in the device list")]
    DuplicateDevice { device: u32 },
    #[error("it would make a cycle: {}", cycle.join(" -> "))]
    Cycle { cycle: Vec<String> },
    #[error("it crosses devices: {a} is on {a_devices:?} but {b} is on {b_devices:?}")]
    CrossDevice {
        a: String,
        a_devices: Vec<u32>,
        b: String,
        b_devices: Vec<u32>,
    },
    #[error("{node} is not placed on any device yet; place it first")]
    Unplaced { node: String },
    #[error("the region is not contiguous: data edge {inside} -> {outside} leaves it; split must cover whole forward/backward chains")]
    NonContiguous { inside: String, outside: String },
    #[error("the matched nodes are already split along `{dim}`")]
    AlreadySplit { dim: String },
    #[error("{node}: its partner {partner} is not matched; a segment's forward and backward must be replicated (or sharded) together")]
    Unpaired { node: String, partner: String },
    #[error("no node has id {id}")]
    UnknownNode { id: u32 },
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{what} is not yet supported")]
    Unsupported { what: String },
    /// A host budget (see [`super::DagBudget`]) would be exceeded: refused
    /// before any work was done.
    #[error("over the host budget `{budget}` = {limit}: {request}")]
    Limit {
        budget: &'static str,
        limit: u64,
        request: String,
    },
}

/// A failed directive or primitive: the call and its cause. The DAG is
/// unchanged when one of these is returned.
#[derive(Debug, Clone, PartialEq)]
pub struct DagError {
    /// The directive or primitive with its arguments, e.g.
    /// `place({PP:1}, devices [0, 9], stream "pp")`.
    pub call: String,
    pub kind: DagErrorKind,
}

impl DagError {
    pub fn new(call: impl Into<String>, kind: DagErrorKind) -> Self {
        DagError {
            call: call.into(),
            kind,
        }
    }
}

impl fmt::Display for DagError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "directive `{}`: {}", self.call, self.kind)
    }
}

impl std::error::Error for DagError {}

/// A name from the caller as it appears in a message: at most 64 bytes
/// (longer ones are cut, with their length given).
pub(crate) fn short(s: &str) -> String {
    const MAX: usize = 64;
    if s.len() <= MAX {
        return s.to_string();
    }
    let mut cut = MAX;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}… ({} bytes)", &s[..cut], s.len())
}

/// [`short`], quoted as a string literal.
pub(crate) fn quote(s: &str) -> String {
    if s.len() <= 64 {
        format!("{s:?}")
    } else {
        format!("\"{}\"", short(s))
    }
}

/// `1.50 MiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// A list from the caller as it appears in a message: the first 16 items,
/// then how many there are.
pub(crate) fn list<T: fmt::Debug>(items: &[T]) -> String {
    const MAX: usize = 16;
    if items.len() <= MAX {
        return format!("{items:?}");
    }
    let head: Vec<String> = items[..MAX].iter().map(|i| format!("{i:?}")).collect();
    format!("[{}, … ({} in all)]", head.join(", "), items.len())
}

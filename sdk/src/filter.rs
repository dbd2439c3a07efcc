//! Filters: how a strategy names nodes. `Filter::tag("PP", 2).and("MB", 3).pass(Pass::F)`
//! is `{PP: 2, MB: 3, PASS: F}`; keys are ANDed, `any` is `*` (the tag must be
//! present), and keys a filter does not mention match anything.

use crate::bindings::piper::strategy::types as wit;

/// The op a node performs (the `PASS` key of a filter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward.
    F,
    /// Fused backward.
    B,
    /// Backward for inputs.
    BI,
    /// Backward for weights.
    BW,
    /// A forward recomputed before its backward (`recompute`).
    R,
    Update,
    Send,
    Recv,
    AllReduce,
    ReduceScatter,
    AllGather,
    AllToAll,
    Marker,
}

impl Pass {
    pub fn as_str(self) -> &'static str {
        match self {
            Pass::F => "F",
            Pass::B => "B",
            Pass::BI => "BI",
            Pass::BW => "BW",
            Pass::R => "R",
            Pass::Update => "update",
            Pass::Send => "send",
            Pass::Recv => "recv",
            Pass::AllReduce => "all-reduce",
            Pass::ReduceScatter => "reduce-scatter",
            Pass::AllGather => "all-gather",
            Pass::AllToAll => "all-to-all",
            Pass::Marker => "marker",
        }
    }
}

/// How one tag key is matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TagMatch {
    Any,
    Index(u32),
}

/// A node selector.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Filter {
    pub tags: Vec<(String, TagMatch)>,
    pub pass: Option<Pass>,
}

impl Filter {
    /// Every node.
    pub fn all() -> Self {
        Filter::default()
    }
    /// `{key: index}`.
    pub fn tag(key: &str, index: u32) -> Self {
        Filter::all().and(key, index)
    }
    /// Add `key: index`.
    pub fn and(mut self, key: &str, index: u32) -> Self {
        self.set(key, TagMatch::Index(index));
        self
    }
    /// Add `key: *`.
    pub fn any(mut self, key: &str) -> Self {
        self.set(key, TagMatch::Any);
        self
    }
    /// Restrict to one pass / op.
    pub fn pass(mut self, pass: Pass) -> Self {
        self.pass = Some(pass);
        self
    }
    fn set(&mut self, key: &str, m: TagMatch) {
        match self.tags.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = m,
            None => self.tags.push((key.to_string(), m)),
        }
    }

    pub(crate) fn to_wit(&self) -> wit::Filter {
        wit::Filter {
            tags: self
                .tags
                .iter()
                .map(|(k, m)| wit::TagFilter {
                    key: k.clone(),
                    value: match m {
                        TagMatch::Any => wit::TagMatch::Any,
                        TagMatch::Index(i) => wit::TagMatch::Index(*i),
                    },
                })
                .collect(),
            pass: self.pass.map(|p| p.as_str().to_string()),
        }
    }
}

impl std::fmt::Display for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts: Vec<String> = self
            .tags
            .iter()
            .map(|(k, m)| match m {
                TagMatch::Any => format!("{k}:*"),
                TagMatch::Index(i) => format!("{k}:{i}"),
            })
            .collect();
        if let Some(p) = self.pass {
            parts.push(format!("PASS:{}", p.as_str()));
        }
        write!(f, "{{{}}}", parts.join(","))
    }
}

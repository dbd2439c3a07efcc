//! Filters: how strategy code names nodes. A filter is an AND of tag matches
//! (`{PP: 2, MB: *}`) and an optional pass (`PASS: F`). `*` matches any index
//! but requires the tag to be present; a key the filter does not mention
//! matches anything.

use super::{CommOp, NodeKind, Pass};
use std::fmt;
use std::str::FromStr;

/// How one tag key is matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TagMatch {
    /// `*`: the node has this tag, whatever its index.
    Any,
    /// Exactly this index.
    Index(u32),
}

/// A node selector: tag matches ANDed, plus an optional label.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Filter {
    pub tags: Vec<(String, TagMatch)>,
    /// The `PASS` key: what the node does.
    pub pass: Option<Label>,
}

/// What a filter's `PASS` key matches: a node's label, its compute pass,
/// `update`, its communication op, or `marker` (the SDK's `Pass`). Its
/// names are [`PASS_VALUES`], in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Label {
    F,
    B,
    BI,
    BW,
    Update,
    Send,
    Recv,
    AllReduce,
    ReduceScatter,
    AllGather,
    AllToAll,
    R,
    Marker,
}

/// Values the `PASS` key can take, in [`Label`]'s order.
pub const PASS_VALUES: [&str; 13] = [
    "F",
    "B",
    "BI",
    "BW",
    "update",
    "send",
    "recv",
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "R",
    "marker",
];

impl Label {
    /// Every label, in [`PASS_VALUES`]' order.
    pub const ALL: [Label; 13] = [
        Label::F,
        Label::B,
        Label::BI,
        Label::BW,
        Label::Update,
        Label::Send,
        Label::Recv,
        Label::AllReduce,
        Label::ReduceScatter,
        Label::AllGather,
        Label::AllToAll,
        Label::R,
        Label::Marker,
    ];
    pub fn as_str(self) -> &'static str {
        PASS_VALUES[self as usize]
    }
    /// The label of a node of this kind.
    pub fn of(kind: &NodeKind) -> Label {
        match kind {
            NodeKind::Compute { pass, .. } => match pass {
                Pass::F => Label::F,
                Pass::B => Label::B,
                Pass::BI => Label::BI,
                Pass::BW => Label::BW,
                Pass::R => Label::R,
            },
            NodeKind::Update { .. } => Label::Update,
            NodeKind::Comm(c) => match c.op {
                CommOp::Send => Label::Send,
                CommOp::Recv => Label::Recv,
                CommOp::AllReduce => Label::AllReduce,
                CommOp::ReduceScatter => Label::ReduceScatter,
                CommOp::AllGather => Label::AllGather,
                CommOp::AllToAll => Label::AllToAll,
            },
            NodeKind::Marker => Label::Marker,
        }
    }
}

impl FromStr for Label {
    type Err = String;
    /// A name from [`PASS_VALUES`]; anything else is refused, naming them.
    fn from_str(s: &str) -> Result<Self, String> {
        match PASS_VALUES.iter().position(|v| *v == s) {
            Some(i) => Ok(Label::ALL[i]),
            None => Err(format!(
                "PASS {} is not one of {PASS_VALUES:?}",
                super::error::quote(s)
            )),
        }
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for Label {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Label {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Filter {
    /// Matches every node.
    pub fn all() -> Self {
        Filter::default()
    }
    /// A filter on one tag index.
    pub fn tag(key: &str, index: u32) -> Self {
        Filter::all().and(key, index)
    }
    /// Add `key = index`.
    pub fn and(mut self, key: &str, index: u32) -> Self {
        self.set(key, TagMatch::Index(index));
        self
    }
    /// Add `key = *`.
    pub fn any(mut self, key: &str) -> Self {
        self.set(key, TagMatch::Any);
        self
    }
    /// Restrict to one label (`Label::F`, `Label::AllReduce`, …).
    pub fn pass(mut self, pass: Label) -> Self {
        self.pass = Some(pass);
        self
    }
    fn set(&mut self, key: &str, m: TagMatch) {
        if key == "PASS" {
            return;
        }
        if let Some(slot) = self.tags.iter_mut().find(|(k, _)| k == key) {
            slot.1 = m;
        } else {
            self.tags.push((key.to_string(), m));
        }
    }
}

impl fmt::Display for Filter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Filters come from plugins: long keys and long tag lists are elided.
        const MAX_TAGS: usize = 16;
        let short = |k: &str| {
            if k.len() <= 32 {
                k.to_string()
            } else {
                let mut cut = 32;
                while !k.is_char_boundary(cut) {
                    cut -= 1;
                }
                format!("{}…", &k[..cut])
            }
        };
        let mut parts: Vec<String> = self
            .tags
            .iter()
            .take(MAX_TAGS)
            .map(|(k, m)| match m {
                TagMatch::Any => format!("{}:*", short(k)),
                TagMatch::Index(i) => format!("{}:{i}", short(k)),
            })
            .collect();
        if self.tags.len() > MAX_TAGS {
            parts.push(format!("… ({} tags)", self.tags.len()));
        }
        if let Some(p) = self.pass {
            parts.push(format!("PASS:{p}"));
        }
        write!(f, "{{{}}}", parts.join(","))
    }
}

/// Parse `{PP:1,MB:*,PASS:F}` (braces optional, `=` also accepted).
impl FromStr for Filter {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let inner = s
            .trim()
            .trim_start_matches('{')
            .trim_end_matches('}')
            .trim();
        let mut filter = Filter::all();
        if inner.is_empty() {
            return Ok(filter);
        }
        for item in inner.split(',') {
            let (k, v) = item
                .split_once(':')
                .or_else(|| item.split_once('='))
                .ok_or_else(|| format!("filter item `{item}` is not KEY:VALUE in `{s}`"))?;
            let (k, v) = (k.trim(), v.trim());
            if k == "PASS" {
                filter.pass = Some(v.parse()?);
            } else if v == "*" {
                filter = filter.any(k);
            } else {
                let i: u32 = v
                    .parse()
                    .map_err(|_| format!("tag {k}: `{v}` is neither an index nor `*`"))?;
                filter = filter.and(k, i);
            }
        }
        Ok(filter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_displays() {
        let f: Filter = "{PP:1, MB:*, PASS:F}".parse().unwrap();
        assert_eq!(f, Filter::tag("PP", 1).any("MB").pass(Label::F));
        assert_eq!(f.to_string(), "{PP:1,MB:*,PASS:F}");
        assert!("{PP:x}".parse::<Filter>().is_err());
        assert!("{PASS:Q}".parse::<Filter>().unwrap_err().contains("PASS"));
        assert_eq!("{}".parse::<Filter>().unwrap(), Filter::all());
    }
}

//! Filters: how strategy code names nodes. A filter is an AND of tag matches
//! (`{PP: 2, MB: *}`) and an optional pass (`PASS: F`). `*` matches any index
//! but requires the tag to be present; a key the filter does not mention
//! matches anything.

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

/// A node selector: tag matches ANDed, plus an optional pass / op name.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Filter {
    pub tags: Vec<(String, TagMatch)>,
    /// `F`, `B`, `BI`, `BW`, `update`, `send`, `recv`, `all-reduce`,
    /// `reduce-scatter`, `all-gather`, `all-to-all` or `marker`.
    pub pass: Option<String>,
}

/// Values the `PASS` key can take.
pub const PASS_VALUES: [&str; 12] = [
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
    "marker",
];

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
    /// Restrict to one pass or op (`F`, `B`, `BI`, `BW`, `all-reduce`, …).
    pub fn pass(mut self, pass: &str) -> Self {
        self.pass = Some(pass.to_string());
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
        if let Some(p) = &self.pass {
            parts.push(format!("PASS:{}", short(p)));
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
                if !PASS_VALUES.contains(&v) {
                    return Err(format!("PASS `{v}` is not one of {PASS_VALUES:?}"));
                }
                filter.pass = Some(v.to_string());
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
        assert_eq!(f, Filter::tag("PP", 1).any("MB").pass("F"));
        assert_eq!(f.to_string(), "{PP:1,MB:*,PASS:F}");
        assert!("{PP:x}".parse::<Filter>().is_err());
        assert!("{PASS:Q}".parse::<Filter>().unwrap_err().contains("PASS"));
        assert_eq!("{}".parse::<Filter>().unwrap(), Filter::all());
    }
}

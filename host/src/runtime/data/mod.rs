//! Training data: a byte-level tokenizer (vocabulary 256), GPT-2's BPE
//! (`--tokenizer gpt2`, vocabulary 50257, embedded by the `tiktoken-rs` crate:
//! nothing is downloaded) or a Hugging Face `tokenizer.json` (`--tokenizer
//! FILE`: Llama 3's, Qwen3's, through the `tokenizers` crate) over any UTF-8 text (`--data FILE`), token files
//! (`--data FILE.bin`, memory-mapped: `file.rs`), or the built-in corpus —
//! generated, so it needs no files, with structure a small model learns
//! quickly (a tiny grammar of sentences).
//!
//! Batches are a pure function of the step: sequence `r` of step `s` starts at
//! token `((s − 1) · B + r) · T` (wrapping), targets are inputs shifted by one.
//! Every strategy therefore sees the same global batch, a resumed run the
//! batches the uninterrupted one would have seen, and a process reads only
//! the rows its devices train on (`Corpus::batch_rows`).

pub mod file;

use file::{TokenFile, Width};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// One global batch: `tokens[B·T]` and `targets[B·T]`, row-major; rows no
/// device of this process reads are left out (zeros, `loaded` false).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub b: usize,
    pub t: usize,
    pub tokens: Vec<u32>,
    pub targets: Vec<u32>,
    pub loaded: Vec<bool>,
}

impl Batch {
    /// Rows `[first, first + rows)`, if this process read them.
    pub fn rows(&self, first: usize, rows: usize) -> Option<(&[u32], &[u32])> {
        let end = first.checked_add(rows)?;
        if end > self.b || !self.loaded[first..end].iter().all(|l| *l) {
            return None;
        }
        let r = first * self.t..end * self.t;
        Some((&self.tokens[r.clone()], &self.targets[r]))
    }
}

/// A token stream to train on: all of a source, or a part of it.
#[derive(Clone, Debug)]
pub struct Corpus {
    pub name: String,
    source: Arc<Source>,
    /// The tokens of `source` this corpus reads.
    range: Range<usize>,
    /// `fingerprint()`, computed once.
    fingerprint: std::sync::OnceLock<String>,
}

#[derive(Debug)]
enum Source {
    /// Text tokenized at start.
    Text {
        tokens: Vec<u32>,
        tokenizer: Tokenizer,
    },
    /// A memory-mapped token file.
    File(TokenFile),
}

impl Source {
    fn read_into(&self, start: usize, n: usize, out: &mut Vec<u32>) {
        match self {
            Source::Text { tokens, .. } => out.extend_from_slice(&tokens[start..start + n]),
            Source::File(f) => f.read_into(start, n, out),
        }
    }
}

/// Where a checkpoint's run was in its data: which data (its fingerprint)
/// and the token the next step's batch starts at.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DataPosition {
    pub name: String,
    pub fingerprint: String,
    pub tokens: u64,
    pub next_token: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read training data {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("training data {path} is not UTF-8 text (first bad byte at offset {offset})")]
    NotUtf8 { path: String, offset: usize },
    #[error("training data {name} has {len} tokens; a sequence needs {need}")]
    TooShort {
        name: String,
        len: usize,
        need: usize,
    },
    #[error("the model's vocabulary ({vocab}) is smaller than the {tokenizer} tokenizer's {need}")]
    Vocab {
        vocab: u32,
        tokenizer: String,
        need: u32,
    },
    #[error(
        "token {token} at position {at} of {name} is outside the model's vocabulary ({vocab})"
    )]
    TokenRange {
        name: String,
        at: usize,
        token: u32,
        vocab: u32,
    },
    #[error("token file {0}")]
    Format(String),
    #[error("a token type is for token files (names ending in .bin); {0} is read as UTF-8 text")]
    TypeForText(String),
    #[error("unknown tokenizer `{0}`: use `byte`, `gpt2`, or a Hugging Face tokenizer.json (a file, or a directory holding one)")]
    UnknownTokenizer(String),
    #[error("tokenizer {path}: {message}")]
    HfTokenizer { path: String, message: String },
    #[error("the GPT-2 tokenizer failed to load: {0}")]
    Bpe(String),
}

/// How text becomes tokens.
#[derive(Clone, Debug)]
pub enum Tokenizer {
    /// One token per byte (vocabulary 256).
    Byte,
    /// GPT-2's byte-level BPE (`r50k_base`, vocabulary 50257).
    Gpt2,
    /// A Hugging Face `tokenizer.json`.
    Hf(Arc<HfTokenizer>),
}

/// A Hugging Face tokenizer and where it came from.
#[derive(Debug)]
pub struct HfTokenizer {
    name: String,
    inner: tokenizers::Tokenizer,
}

/// The largest tokenizer.json read (Llama 3's is 9 MB, Qwen3's 11 MB).
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

impl Tokenizer {
    /// `byte`, `gpt2`, or a path to a `tokenizer.json` (or a directory
    /// holding one, as a Hugging Face model directory does).
    pub fn parse(s: &str) -> Result<Self, DataError> {
        match s {
            "byte" | "bytes" => Ok(Tokenizer::Byte),
            "gpt2" => Ok(Tokenizer::Gpt2),
            other => {
                let p = Path::new(other);
                let file = if p.is_dir() {
                    p.join("tokenizer.json")
                } else {
                    p.to_path_buf()
                };
                if !file.is_file() {
                    return Err(DataError::UnknownTokenizer(other.into()));
                }
                Self::from_file(&file)
            }
        }
    }

    /// A Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        let fail = |message: String| DataError::HfTokenizer {
            path: path.display().to_string(),
            message,
        };
        let len = std::fs::metadata(path)
            .map_err(|source| DataError::Io {
                path: path.display().to_string(),
                source,
            })?
            .len();
        if len > MAX_TOKENIZER_BYTES {
            return Err(fail(format!(
                "is {len} bytes; more than {MAX_TOKENIZER_BYTES} is not read"
            )));
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| fail(e.to_string()))?;
        let name = path
            .parent()
            .and_then(|d| d.file_name())
            .filter(|_| path.file_name().is_some_and(|f| f == "tokenizer.json"))
            .or(path.file_name())
            .map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
        Ok(Tokenizer::Hf(Arc::new(HfTokenizer { name, inner })))
    }

    pub fn vocab(&self) -> u32 {
        match self {
            Tokenizer::Byte => 256,
            Tokenizer::Gpt2 => 50257,
            Tokenizer::Hf(t) => t.inner.get_vocab_size(true) as u32,
        }
    }
    pub fn name(&self) -> String {
        match self {
            Tokenizer::Byte => "byte".into(),
            Tokenizer::Gpt2 => "gpt2".into(),
            Tokenizer::Hf(t) => format!("hf:{}", t.name),
        }
    }
    /// Tokens of `text` (no special tokens added). A Hugging Face tokenizer
    /// encodes it a megabyte at a time, cut after a newline, so its working
    /// memory stays bounded on any file.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Tokenizer::Byte => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Gpt2 => {
                let bpe = tiktoken_rs::r50k_base().map_err(|e| DataError::Bpe(e.to_string()))?;
                Ok(bpe.encode_ordinary(text))
            }
            Tokenizer::Hf(t) => {
                let mut out = Vec::new();
                let mut rest = text;
                while !rest.is_empty() {
                    let mut cut = rest.len().min(1 << 20);
                    while !rest.is_char_boundary(cut) {
                        cut += 1;
                    }
                    if let Some(nl) = rest[..cut].rfind('\n').filter(|_| cut < rest.len()) {
                        cut = nl + 1;
                    }
                    let enc = t.inner.encode(&rest[..cut], false).map_err(|e| {
                        DataError::HfTokenizer {
                            path: t.name.clone(),
                            message: e.to_string(),
                        }
                    })?;
                    out.extend_from_slice(enc.get_ids());
                    rest = &rest[cut..];
                }
                Ok(out)
            }
        }
    }
}

const SUBJECTS: [&str; 8] = [
    "the cat",
    "a dog",
    "my sister",
    "the old man",
    "our teacher",
    "a small bird",
    "the farmer",
    "his friend",
];
const VERBS: [&str; 8] = [
    "sees", "likes", "finds", "follows", "feeds", "paints", "calls", "helps",
];
const OBJECTS: [&str; 8] = [
    "the red ball",
    "a green apple",
    "the big house",
    "a quiet river",
    "the tall tree",
    "a warm coat",
    "the blue boat",
    "a bright star",
];
const PLACES: [&str; 6] = [
    "in the morning",
    "near the hill",
    "at the market",
    "after dinner",
    "by the sea",
    "every day",
];

impl Corpus {
    fn text(name: String, tokens: Vec<u32>, tokenizer: Tokenizer) -> Self {
        let range = 0..tokens.len();
        Corpus {
            name,
            source: Arc::new(Source::Text { tokens, tokenizer }),
            range,
            fingerprint: Default::default(),
        }
    }

    /// The built-in corpus: 20,000 generated sentences (≈ 0.8 MB), byte tokens.
    pub fn builtin() -> Self {
        Self::builtin_with(Tokenizer::Byte).expect("byte tokenization cannot fail")
    }

    /// The built-in corpus under a tokenizer.
    pub fn builtin_with(tokenizer: Tokenizer) -> Result<Self, DataError> {
        Ok(Self::text(
            format!("built-in sentences ({} tokens)", tokenizer.name()),
            tokenizer.encode(&builtin_text())?,
            tokenizer,
        ))
    }

    /// `--data PATH`: a token file when its name ends in `.bin` (`width`
    /// for one without a header), else UTF-8 text under `tokenizer`.
    pub fn open(
        path: &Path,
        tokenizer: Tokenizer,
        width: Option<Width>,
    ) -> Result<Self, DataError> {
        let bin = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("bin"));
        match bin {
            true => Self::from_token_file(path, width),
            false if width.is_some() => Err(DataError::TypeForText(path.display().to_string())),
            false => Self::from_file_with(path, tokenizer),
        }
    }

    /// A token file, memory-mapped.
    pub fn from_token_file(path: &Path, width: Option<Width>) -> Result<Self, DataError> {
        let f = TokenFile::open(path, width)?;
        let name = format!(
            "{} ({} {} tokens{})",
            path.display(),
            f.len,
            f.width.name(),
            if f.header { ", llm.c header" } else { "" }
        );
        let range = 0..f.len;
        Ok(Corpus {
            name,
            source: Arc::new(Source::File(f)),
            range,
            fingerprint: Default::default(),
        })
    }

    /// Any UTF-8 text file, byte-tokenized.
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        Self::from_file_with(path, Tokenizer::Byte)
    }

    /// Any UTF-8 text file under a tokenizer.
    pub fn from_file_with(path: &Path, tokenizer: Tokenizer) -> Result<Self, DataError> {
        let text = read_text(path)?;
        Ok(Self::text(
            format!("{} ({} tokens)", path.display(), tokenizer.name()),
            tokenizer.encode(&text)?,
            tokenizer,
        ))
    }

    /// The first part for training and the last `fraction` held out for
    /// evaluation (nanoGPT's and Megatron's split: the tail, not a sample).
    pub fn hold_out(&self, fraction: f64) -> (Corpus, Corpus) {
        let n = self.len();
        let held = ((n as f64 * fraction).ceil() as usize).min(n);
        let cut = self.range.start + n - held;
        let part = |range: Range<usize>, what: &str| Corpus {
            name: format!(
                "{}, tokens {}..{} ({what})",
                self.name, range.start, range.end
            ),
            source: self.source.clone(),
            range,
            fingerprint: Default::default(),
        };
        (
            part(self.range.start..cut, "training"),
            part(cut..self.range.end, "held out"),
        )
    }

    /// Tokens this corpus reads.
    pub fn len(&self) -> usize {
        self.range.len()
    }
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Tokens `[start, start + n)` of this corpus.
    pub fn tokens(&self, start: usize, n: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(n);
        self.source.read_into(self.range.start + start, n, &mut out);
        out
    }

    /// A short hash of the tokens this corpus reads (hex): equal data,
    /// equal fingerprint, on every machine. Text is hashed whole; a token
    /// file by its length and 64 windows of 4,096 tokens spread evenly over
    /// it (the first and the last included), so it costs the same for any
    /// size: it tells datasets apart, it does not check their integrity.
    pub fn fingerprint(&self) -> String {
        self.fingerprint.get_or_init(|| self.hash()).clone()
    }

    fn hash(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let (start, len) = (self.range.start, self.len());
        match &*self.source {
            Source::Text { tokens, tokenizer } => {
                h.update(tokenizer.name().as_bytes());
                for t in &tokens[self.range.clone()] {
                    h.update(t.to_le_bytes());
                }
            }
            Source::File(f) => {
                h.update(format!("tokens {} {start} {len}", f.width.name()).as_bytes());
                const WINDOWS: usize = 64;
                const WINDOW: usize = 4096;
                let mut buf = Vec::with_capacity(WINDOW);
                let mut next = 0;
                for i in 0..WINDOWS {
                    let at = (len.saturating_sub(WINDOW) * i / (WINDOWS - 1)).max(next);
                    let n = WINDOW.min(len - at.min(len));
                    if n == 0 {
                        break;
                    }
                    buf.clear();
                    f.read_into(start + at, n, &mut buf);
                    for t in &buf {
                        h.update(t.to_le_bytes());
                    }
                    next = at + n;
                }
            }
        }
        h.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Check the corpus fits the model.
    pub fn check(&self, vocab: u32, seq_len: usize) -> Result<(), DataError> {
        if let Source::Text { tokenizer, .. } = &*self.source {
            if vocab < tokenizer.vocab() {
                return Err(DataError::Vocab {
                    vocab,
                    tokenizer: tokenizer.name(),
                    need: tokenizer.vocab(),
                });
            }
        }
        if self.len() < seq_len + 2 {
            return Err(DataError::TooShort {
                name: self.name.clone(),
                len: self.len(),
                need: seq_len + 2,
            });
        }
        Ok(())
    }

    /// Where row `r` of step `step`'s batch starts in this corpus.
    fn row_start(&self, step: u32, b: usize, t: usize, r: usize) -> usize {
        let span = self.len() - t - 1;
        (((step as usize).saturating_sub(1) * b + r) * t) % span
    }

    /// Where a run stands in this corpus after `step` steps of batches
    /// `b × t`: what a checkpoint records, so a resume can be refused on
    /// other data.
    pub fn position(&self, step: u32, b: usize, t: usize) -> DataPosition {
        DataPosition {
            name: self.name.clone(),
            fingerprint: self.fingerprint(),
            tokens: self.len() as u64,
            next_token: (self.range.start + self.row_start(step + 1, b, t, 0)) as u64,
        }
    }

    /// The global batch of `step` (1-based), every row read (the corpus
    /// must have passed `check`). A token at or above `vocab` is refused.
    pub fn batch(&self, step: u32, b: usize, t: usize, vocab: u32) -> Result<Batch, DataError> {
        self.batch_rows(step, b, t, vocab, &vec![true; b])
    }

    /// The global batch of `step` with only the rows `read[r]` read (a
    /// process reads the rows of its own devices).
    pub fn batch_rows(
        &self,
        step: u32,
        b: usize,
        t: usize,
        vocab: u32,
        read: &[bool],
    ) -> Result<Batch, DataError> {
        let mut tokens = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        let mut row = Vec::with_capacity(t + 1);
        for r in 0..b {
            if !read.get(r).copied().unwrap_or(false) {
                tokens.resize(tokens.len() + t, 0);
                targets.resize(targets.len() + t, 0);
                continue;
            }
            let start = self.row_start(step, b, t, r);
            row.clear();
            self.source
                .read_into(self.range.start + start, t + 1, &mut row);
            if let Some(i) = row.iter().position(|tok| *tok >= vocab) {
                return Err(DataError::TokenRange {
                    name: self.name.clone(),
                    at: self.range.start + start + i,
                    token: row[i],
                    vocab,
                });
            }
            tokens.extend_from_slice(&row[..t]);
            targets.extend_from_slice(&row[1..]);
        }
        Ok(Batch {
            b,
            t,
            tokens,
            targets,
            loaded: (0..b)
                .map(|r| read.get(r).copied().unwrap_or(false))
                .collect(),
        })
    }
}

fn builtin_text() -> String {
    let mut state: u64 = 0x5eed_c0de;
    let mut next = |n: usize| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) as usize) % n
    };
    let mut text = String::new();
    for _ in 0..20_000 {
        let s = SUBJECTS[next(SUBJECTS.len())];
        let v = VERBS[next(VERBS.len())];
        let o = OBJECTS[next(OBJECTS.len())];
        let p = PLACES[next(PLACES.len())];
        text.push_str(&format!("{s} {v} {o} {p}. "));
    }
    text
}

/// A UTF-8 text file, whole.
pub fn read_text(path: &Path) -> Result<String, DataError> {
    let bytes = std::fs::read(path).map_err(|source| DataError::Io {
        path: path.display().to_string(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
        path: path.display().to_string(),
        offset: e.utf8_error().valid_up_to(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Hugging Face `tokenizer.json` (a word-level model over the
    /// built-in corpus's words, whitespace pre-tokenizer), as transformers
    /// saves one.
    fn word_level_tokenizer(dir: &Path) -> Vec<String> {
        let mut words: Vec<String> = builtin_text()
            .split_whitespace()
            .map(|w| w.to_string())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        words.insert(0, "[UNK]".into());
        let vocab: serde_json::Map<String, serde_json::Value> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.clone(), serde_json::json!(i)))
            .collect();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": { "type": "Whitespace" },
            "post_processor": null, "decoder": null,
            "model": { "type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]" }
        });
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
        words
    }

    #[test]
    fn a_hugging_face_tokenizer_json_tokenizes_text_and_bounds_the_vocabulary() {
        let dir = std::env::temp_dir().join(format!("piper-tok-{}", std::process::id()));
        let words = word_level_tokenizer(&dir);
        // A directory holding tokenizer.json, or the file itself.
        for spec in [dir.clone(), dir.join("tokenizer.json")] {
            let t = Tokenizer::parse(spec.to_str().unwrap()).unwrap();
            assert_eq!(t.vocab() as usize, words.len());
            assert!(t.name().starts_with("hf:"), "{}", t.name());
            let ids = t.encode("the cat sees zebra").unwrap();
            let id = |w: &str| words.iter().position(|x| x == w).unwrap() as u32;
            assert_eq!(ids, vec![id("the"), id("cat"), id("sees"), 0]);
        }
        // Past a megabyte, cut at newlines: the same tokens as line by line.
        let t = Tokenizer::parse(dir.to_str().unwrap()).unwrap();
        let text = builtin_text().repeat(2);
        assert!(text.len() > 1 << 20);
        let whole = t.encode(&text).unwrap();
        let by_line: Vec<u32> = text.lines().flat_map(|l| t.encode(l).unwrap()).collect();
        assert_eq!(whole, by_line);
        let c = Corpus::builtin_with(t).unwrap();
        let err = c.check(16, 8).unwrap_err().to_string();
        assert!(err.contains("smaller than the hf:"), "{err}");
        // Not a tokenizer: named.
        std::fs::write(dir.join("tokenizer.json"), "{\"model\": 3}").unwrap();
        let err = Tokenizer::parse(dir.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("tokenizer ") && err.contains("tokenizer.json"),
            "{err}"
        );
        let err = Tokenizer::parse("no-such-tokenizer")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`byte`, `gpt2`, or a Hugging Face tokenizer.json"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn gpt2_bpe_tokenizes_with_the_real_vocabulary() {
        // "Hello world" is [15496, 995] in GPT-2's vocabulary.
        assert_eq!(
            Tokenizer::Gpt2.encode("Hello world").unwrap(),
            vec![15496, 995]
        );
        let c = Corpus::builtin_with(Tokenizer::Gpt2).unwrap();
        assert!(c.tokens(0, c.len()).iter().all(|t| *t < 50257));
        let err = c.check(256, 64).unwrap_err().to_string();
        assert!(
            err.contains("smaller than the gpt2 tokenizer's 50257"),
            "{err}"
        );
        assert!(Tokenizer::parse("sentencepiece").is_err());
    }

    #[test]
    fn batches_are_a_function_of_the_step() {
        let c = Corpus::builtin();
        let batch = |s| c.batch(s, 4, 8, 256).unwrap();
        let (a, b) = (batch(3), batch(3));
        assert_eq!(a, b);
        assert_eq!(&a.tokens[1..8], &a.targets[..7]);
        assert_ne!(batch(4).tokens, a.tokens);
        // The held-out tail is the corpus's last tenth, apart from training.
        let (train, held) = c.hold_out(0.1);
        assert_eq!(train.len() + held.len(), c.len());
        assert_eq!(held.len(), c.len().div_ceil(10));
        assert_eq!(held.tokens(0, 8), c.tokens(train.len(), 8));
        assert_ne!(train.fingerprint(), c.fingerprint());
        // A process reading rows 1 and 3 gets exactly those rows.
        let part = c
            .batch_rows(3, 4, 8, 256, &[false, true, false, true])
            .unwrap();
        assert_eq!(part.rows(1, 1), a.rows(1, 1));
        assert_eq!(part.rows(3, 1), a.rows(3, 1));
        assert_eq!(part.rows(0, 2), None);
        assert_eq!(a.rows(3, 2), None);
    }
}

//! Training data: a byte-level tokenizer (vocabulary 256) or GPT-2's BPE
//! (`--tokenizer gpt2`, vocabulary 50257, embedded by the `tiktoken-rs` crate:
//! nothing is downloaded) over any UTF-8 text (`--data FILE`), or the built-in corpus — generated, so it needs no files,
//! with structure a small model learns quickly (a tiny grammar of sentences).
//!
//! Batches are a pure function of the step: sequence `r` of step `s` starts at
//! byte `((s − 1) · B + r) · T` (wrapping), targets are inputs shifted by one.
//! Every strategy therefore sees the same global batch; a data-parallel replica
//! reads its own rows of it.

use std::path::Path;

/// One global batch: `tokens[B·T]` and `targets[B·T]`, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub b: usize,
    pub t: usize,
    pub tokens: Vec<u32>,
    pub targets: Vec<u32>,
}

impl Batch {
    /// Rows `[first, first + rows)`.
    pub fn rows(&self, first: usize, rows: usize) -> (&[u32], &[u32]) {
        let r = first * self.t..(first + rows) * self.t;
        (&self.tokens[r.clone()], &self.targets[r])
    }
}

/// A token stream to train on.
#[derive(Clone, Debug)]
pub struct Corpus {
    pub name: String,
    pub tokens: Vec<u32>,
    pub tokenizer: Tokenizer,
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
        tokenizer: &'static str,
        need: u32,
    },
    #[error("unknown tokenizer `{0}`: use `byte` or `gpt2`")]
    UnknownTokenizer(String),
    #[error("the GPT-2 tokenizer failed to load: {0}")]
    Bpe(String),
}

/// How text becomes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokenizer {
    /// One token per byte (vocabulary 256).
    Byte,
    /// GPT-2's byte-level BPE (`r50k_base`, vocabulary 50257).
    Gpt2,
}

impl Tokenizer {
    pub fn parse(s: &str) -> Result<Self, DataError> {
        match s {
            "byte" | "bytes" => Ok(Tokenizer::Byte),
            "gpt2" => Ok(Tokenizer::Gpt2),
            other => Err(DataError::UnknownTokenizer(other.into())),
        }
    }
    pub fn vocab(self) -> u32 {
        match self {
            Tokenizer::Byte => 256,
            Tokenizer::Gpt2 => 50257,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Tokenizer::Byte => "byte",
            Tokenizer::Gpt2 => "gpt2",
        }
    }
    /// Tokens of `text`.
    pub fn encode(self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Tokenizer::Byte => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Gpt2 => {
                let bpe = tiktoken_rs::r50k_base().map_err(|e| DataError::Bpe(e.to_string()))?;
                Ok(bpe.encode_ordinary(text))
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
    /// The built-in corpus: 20,000 generated sentences (≈ 0.8 MB), byte tokens.
    pub fn builtin() -> Self {
        Self::builtin_with(Tokenizer::Byte).expect("byte tokenization cannot fail")
    }

    /// The built-in corpus under a tokenizer.
    pub fn builtin_with(tokenizer: Tokenizer) -> Result<Self, DataError> {
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
        Ok(Corpus {
            name: format!("built-in sentences ({} tokens)", tokenizer.name()),
            tokens: tokenizer.encode(&text)?,
            tokenizer,
        })
    }

    /// Any UTF-8 text file, byte-tokenized.
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        Self::from_file_with(path, Tokenizer::Byte)
    }

    /// Any UTF-8 text file under a tokenizer.
    pub fn from_file_with(path: &Path, tokenizer: Tokenizer) -> Result<Self, DataError> {
        let bytes = std::fs::read(path).map_err(|source| DataError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let text = std::str::from_utf8(&bytes).map_err(|e| DataError::NotUtf8 {
            path: path.display().to_string(),
            offset: e.valid_up_to(),
        })?;
        Ok(Corpus {
            name: format!("{} ({} tokens)", path.display(), tokenizer.name()),
            tokens: tokenizer.encode(text)?,
            tokenizer,
        })
    }

    /// A short hash of the token stream (hex): equal data, equal
    /// fingerprint, on every machine.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(self.tokenizer.name().as_bytes());
        for t in &self.tokens {
            h.update(t.to_le_bytes());
        }
        h.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Check the corpus fits the model.
    pub fn check(&self, vocab: u32, seq_len: usize) -> Result<(), DataError> {
        if vocab < self.tokenizer.vocab() {
            return Err(DataError::Vocab {
                vocab,
                tokenizer: self.tokenizer.name(),
                need: self.tokenizer.vocab(),
            });
        }
        if self.tokens.len() < seq_len + 2 {
            return Err(DataError::TooShort {
                name: self.name.clone(),
                len: self.tokens.len(),
                need: seq_len + 2,
            });
        }
        Ok(())
    }

    /// The global batch of `step` (1-based).
    pub fn batch(&self, step: u32, b: usize, t: usize) -> Batch {
        let span = self.tokens.len() - t - 1;
        let mut tokens = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        for r in 0..b {
            let start = (((step as usize - 1) * b + r) * t) % span;
            tokens.extend_from_slice(&self.tokens[start..start + t]);
            targets.extend_from_slice(&self.tokens[start + 1..start + t + 1]);
        }
        Batch {
            b,
            t,
            tokens,
            targets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_bpe_tokenizes_with_the_real_vocabulary() {
        // "Hello world" is [15496, 995] in GPT-2's vocabulary.
        assert_eq!(
            Tokenizer::Gpt2.encode("Hello world").unwrap(),
            vec![15496, 995]
        );
        let c = Corpus::builtin_with(Tokenizer::Gpt2).unwrap();
        assert!(c.tokens.iter().all(|t| *t < 50257));
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
        let (a, b) = (c.batch(3, 4, 8), c.batch(3, 4, 8));
        assert_eq!(a, b);
        assert_eq!(&a.tokens[1..8], &a.targets[..7]);
        assert_ne!(c.batch(4, 4, 8).tokens, a.tokens);
    }
}

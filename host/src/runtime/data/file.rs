//! Token files (`--data FILE.bin`): little-endian `uint16` or `uint32`
//! tokens, as nanoGPT's `prepare.py` writes them (no header) or as llm.c's
//! `.bin` files (a header of 256 `int32`: magic, version, token count).
//! The file is memory-mapped and only the pages a batch reads are touched,
//! so a file of any size costs the process a few pages per step.
//!
//! A header is recognised by its magic: `20240520` (version 1, `uint16`,
//! llm.c's GPT-2 files) or `20240801` (version 7, `uint32`, its Llama 3
//! files). Both read as a first token of 54472 or more in a headerless
//! `uint16` file (and 20,240,520 in a `uint32` one), beyond every
//! vocabulary Piper trains, so a headerless file is never mistaken for one
//! with a header.

use super::DataError;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// llm.c's header: 256 little-endian `int32`.
pub const HEADER_BYTES: usize = 256 * 4;
/// llm.c's magic for `uint16` token files (GPT-2), and its version.
pub const MAGIC_U16: i32 = 20240520;
const VERSION_U16: i32 = 1;
/// llm.c's magic for `uint32` token files (Llama 3), and its version.
pub const MAGIC_U32: i32 = 20240801;
const VERSION_U32: i32 = 7;

/// Bytes per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    U16,
    U32,
}

impl Width {
    pub fn parse(s: &str) -> Result<Self, DataError> {
        match s {
            "uint16" | "u16" => Ok(Width::U16),
            "uint32" | "u32" => Ok(Width::U32),
            other => Err(DataError::Format(format!(
                "unknown token type `{other}`: use `uint16` or `uint32`"
            ))),
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            Width::U16 => 2,
            Width::U32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Width::U16 => "uint16",
            Width::U32 => "uint32",
        }
    }
    /// The smallest width that holds every token below `vocab`.
    pub fn for_vocab(vocab: u32) -> Self {
        match vocab <= 1 << 16 {
            true => Width::U16,
            false => Width::U32,
        }
    }
}

/// A memory-mapped token file.
pub struct TokenFile {
    pub path: PathBuf,
    map: memmap2::Mmap,
    /// Byte offset of the first token (the header's size, or 0).
    offset: usize,
    pub width: Width,
    pub len: usize,
    /// Whether the file has llm.c's header.
    pub header: bool,
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenFile")
            .field("path", &self.path)
            .field("width", &self.width)
            .field("len", &self.len)
            .field("header", &self.header)
            .finish()
    }
}

impl TokenFile {
    /// Map `path`. `width` is the token type of a file without a header
    /// (default `uint16`); a file with one must agree with it.
    pub fn open(path: &Path, width: Option<Width>) -> Result<Self, DataError> {
        let name = path.display().to_string();
        let io = |source| DataError::Io {
            path: name.clone(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        let size = usize::try_from(size).map_err(|_| {
            DataError::Format(format!(
                "{name}: {size} bytes do not fit this machine's address space"
            ))
        })?;
        let bad = |why: String| DataError::Format(format!("{name}: {why}"));
        if size == 0 {
            return Err(DataError::TooShort {
                name,
                len: 0,
                need: 2,
            });
        }
        // SAFETY: the map is read-only and lives as long as `self`. Piper
        // never writes a file it trains on; another process truncating it
        // during the run would fault the reads (as a numpy memmap would).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let word =
            |i: usize| i32::from_le_bytes(map[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        let magic = match size >= HEADER_BYTES {
            true => Some(word(0)).filter(|m| *m == MAGIC_U16 || *m == MAGIC_U32),
            false => None,
        };
        let (offset, w, len) = match magic {
            Some(magic) => {
                let (w, version) = match magic {
                    MAGIC_U16 => (Width::U16, VERSION_U16),
                    _ => (Width::U32, VERSION_U32),
                };
                if word(1) != version {
                    return Err(bad(format!(
                        "llm.c header magic {magic} with version {}; that magic's files are version {version}",
                        word(1)
                    )));
                }
                if let Some(asked) = width.filter(|asked| *asked != w) {
                    return Err(bad(format!(
                        "its llm.c header says {} tokens, but --token-type {} was given",
                        w.name(),
                        asked.name()
                    )));
                }
                let count = usize::try_from(word(2))
                    .map_err(|_| bad(format!("header token count {} is negative", word(2))))?;
                let want = count
                    .checked_mul(w.bytes())
                    .and_then(|b| b.checked_add(HEADER_BYTES))
                    .ok_or_else(|| bad(format!("header token count {count} is too large")))?;
                if want != size {
                    return Err(bad(format!(
                        "its header says {count} {} tokens ({want} bytes with the header), but the file has {size} bytes{}",
                        w.name(),
                        if size < want { ": truncated" } else { "" }
                    )));
                }
                (HEADER_BYTES, w, count)
            }
            None => {
                let w = width.unwrap_or(Width::U16);
                if size % w.bytes() != 0 {
                    return Err(bad(format!(
                        "{size} bytes are not a whole number of {} tokens",
                        w.name()
                    )));
                }
                (0, w, size / w.bytes())
            }
        };
        Ok(TokenFile {
            path: path.to_path_buf(),
            map,
            offset,
            width: w,
            len,
            header: magic.is_some(),
        })
    }

    /// Append tokens `[start, start + n)` to `out`.
    pub fn read_into(&self, start: usize, n: usize, out: &mut Vec<u32>) {
        let w = self.width.bytes();
        let bytes = &self.map[self.offset + start * w..self.offset + (start + n) * w];
        match self.width {
            Width::U16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
            ),
            Width::U32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
        }
    }
}

/// Write `tokens` as an llm.c token file (header, then the tokens at
/// `width`), under a temporary name renamed into place when whole.
pub fn write(path: &Path, tokens: &[u32], width: Width) -> Result<(), DataError> {
    let name = path.display().to_string();
    let count = i32::try_from(tokens.len()).map_err(|_| {
        DataError::Format(format!(
            "{name}: {} tokens are more than an llm.c header counts ({})",
            tokens.len(),
            i32::MAX
        ))
    })?;
    if let Some((i, t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, t)| width == Width::U16 && **t > u32::from(u16::MAX))
    {
        return Err(DataError::Format(format!(
            "{name}: token {t} at {i} does not fit uint16"
        )));
    }
    let (magic, version) = match width {
        Width::U16 => (MAGIC_U16, VERSION_U16),
        Width::U32 => (MAGIC_U32, VERSION_U32),
    };
    let mut header = [0i32; 256];
    header[..3].copy_from_slice(&[magic, version, count]);
    let file_name = path
        .file_name()
        .ok_or_else(|| DataError::Format(format!("{name}: not a file name")))?;
    let tmp = path.with_file_name(format!(".{}.tmp", file_name.to_string_lossy()));
    let io = |source| DataError::Io {
        path: name.clone(),
        source,
    };
    let result = (|| {
        let mut out = std::io::BufWriter::new(File::create(&tmp)?);
        for h in header {
            out.write_all(&h.to_le_bytes())?;
        }
        for &t in tokens {
            match width {
                Width::U16 => out.write_all(&(t as u16).to_le_bytes())?,
                Width::U32 => out.write_all(&t.to_le_bytes())?,
            }
        }
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("piper-tokens-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn headers_raw_files_and_both_widths_read_back() {
        let d = dir("formats");
        let toks: Vec<u32> = (0..1000).map(|i| (i * 37) % 50257).collect();
        for w in [Width::U16, Width::U32] {
            let p = d.join(format!("{}.bin", w.name()));
            write(&p, &toks, w).unwrap();
            let f = TokenFile::open(&p, None).unwrap();
            assert_eq!((f.width, f.len, f.header), (w, 1000, true));
            let mut out = Vec::new();
            f.read_into(10, 5, &mut out);
            assert_eq!(out, &toks[10..15]);
        }
        // nanoGPT's prepare.py: raw uint16, no header; uint32 when asked.
        let raw = d.join("raw.bin");
        let bytes: Vec<u8> = toks
            .iter()
            .flat_map(|t| (*t as u16).to_le_bytes())
            .collect();
        std::fs::write(&raw, &bytes).unwrap();
        let f = TokenFile::open(&raw, None).unwrap();
        assert_eq!((f.width, f.len, f.header), (Width::U16, 1000, false));
        let f = TokenFile::open(&raw, Some(Width::U32)).unwrap();
        assert_eq!(f.len, 500);
        let mut out = Vec::new();
        f.read_into(0, 1, &mut out);
        assert_eq!(out, [toks[0] | (toks[1] << 16)]);
    }

    #[test]
    fn damaged_or_contradicting_files_are_refused_naming_the_problem() {
        let d = dir("damaged");
        let p = d.join("t.bin");
        write(&p, &[1, 2, 3, 4], Width::U16).unwrap();
        let whole = std::fs::read(&p).unwrap();
        let err = |bytes: &[u8], w: Option<Width>| {
            std::fs::write(&p, bytes).unwrap();
            TokenFile::open(&p, w).unwrap_err().to_string()
        };
        let e = err(&whole[..whole.len() - 2], None);
        assert!(
            e.contains("says 4 uint16 tokens") && e.contains("truncated"),
            "{e}"
        );
        let e = err(&whole, Some(Width::U32));
        assert!(
            e.contains("header says uint16 tokens, but --token-type uint32"),
            "{e}"
        );
        let mut v = whole.clone();
        v[4] = 9;
        let e = err(&v, None);
        assert!(
            e.contains("version 9; that magic's files are version 1"),
            "{e}"
        );
        let mut v = whole.clone();
        v[8..12].copy_from_slice(&(-1i32).to_le_bytes());
        assert!(err(&v, None).contains("count -1 is negative"));
        assert!(err(&[1, 2, 3], None).contains("not a whole number of uint16 tokens"));
        assert!(err(&[], None).contains("has 0 tokens"));
        assert!(write(&p, &[70_000], Width::U16)
            .unwrap_err()
            .to_string()
            .contains("does not fit uint16"));
    }
}

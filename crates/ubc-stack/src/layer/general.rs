//! The general layers: `zstd` (compression) and `aead` (authenticated encryption). Each
//! renames the bytes of its lower file — the paper's *general naming* — so each open file
//! gets its own domain (cache object) above the lower file's, and a [`Translate`] tells the
//! cache manager which bytes correspond.

use super::{Below, Layer, Opened};
use crate::coherence::{ALL, Translate};
use crate::compress::{CompressOptions, CompressPager};
use crate::encrypt::{EncryptPager, Key};
use crate::error::{Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// `zstd`: per-chunk compression.
pub struct Zstd {
    lower: Arc<dyn Layer>,
    chunk_size: usize,
    level: i32,
}

impl Zstd {
    pub fn new(lower: Arc<dyn Layer>, opts: CompressOptions) -> Zstd {
        Zstd { lower, chunk_size: opts.chunk_size, level: opts.level }
    }
}

/// Compressed chunks move when rewritten, so stored ranges say nothing precise about
/// logical ones: every translation is the whole file. Its index becomes visible only by a
/// commit, and a commit must follow durable data (crash consistency), so a flush is a full
/// `sync` (the default of `flush_metadata`).
struct ZstdXlate(Arc<CompressPager>);

impl Translate for ZstdXlate {
    fn down(&self, _upper: Range<u64>) -> Vec<Range<u64>> {
        vec![ALL]
    }
    fn up(&self, _lower: Range<u64>) -> Option<Range<u64>> {
        None
    }
    fn reload(&self) -> std::io::Result<()> {
        self.0.reload()
    }
}

impl Layer for Zstd {
    fn spec(&self) -> String {
        format!("zstd:level={},chunk={}", self.level, self.chunk_size)
    }
    fn lower(&self) -> Option<&Arc<dyn Layer>> {
        Some(&self.lower)
    }
    fn is_general(&self) -> bool {
        true
    }
    fn open(&self, _path: &str, _access: ubc::Access, _below: &dyn Below) -> Result<Opened> {
        Ok(Opened::Wrap)
    }
    fn wrap(&self, path: &str, lower: ubc::File) -> Result<(Arc<dyn ubc::Pager>, Arc<dyn Translate>)> {
        let p = Arc::new(
            CompressPager::open(lower, CompressOptions { chunk_size: self.chunk_size, level: self.level })
                .map_err(|e| Error::io(path, e))?,
        );
        Ok((p.clone(), Arc::new(ZstdXlate(p))))
    }
}

/// `aead`: XChaCha20-Poly1305 per 4 KiB block.
pub struct Aead {
    lower: Arc<dyn Layer>,
    key: Arc<Key>,
    key_source: String,
}

impl Aead {
    /// `key_source` is how the spec names the key (never the key itself).
    pub fn new(lower: Arc<dyn Layer>, key: Arc<Key>, key_source: String) -> Aead {
        Aead { lower, key, key_source }
    }
}

/// Past this, ranges are treated as open-ended (no file is this long: offsets end at 2^63).
const HUGE: u64 = 1 << 62;

/// Blocks map one to one; the header (file id, length) is metadata every access depends on.
struct AeadXlate(Arc<EncryptPager>);

impl Translate for AeadXlate {
    fn down(&self, upper: Range<u64>) -> Vec<Range<u64>> {
        // Open-ended ranges ("to the end of the file") stay open-ended.
        let blocks = if upper.end > HUGE {
            self.0.lower_range(upper.start.min(HUGE)..upper.start.min(HUGE) + 1).start..u64::MAX
        } else {
            self.0.lower_range(upper)
        };
        // Reads depend on the header too (file id, length): a restore underneath that
        // rewrote it must be seen by readers above, and a write may update it.
        let header = 0..self.0.lower_range(0..1).start;
        vec![header, blocks]
    }
    fn up(&self, lower: Range<u64>) -> Option<Range<u64>> {
        if lower.end > HUGE {
            let s = lower.start.min(HUGE);
            return self.0.upper_range(s..s + 1).map(|r| r.start..u64::MAX);
        }
        self.0.upper_range(lower)
    }
    fn reload(&self) -> std::io::Result<()> {
        self.0.reload()
    }
    fn flush_metadata(&self) -> std::io::Result<bool> {
        self.0.flush_metadata().map(|()| true)
    }
}

impl Layer for Aead {
    fn spec(&self) -> String {
        format!("aead:{}", self.key_source)
    }
    fn lower(&self) -> Option<&Arc<dyn Layer>> {
        Some(&self.lower)
    }
    fn is_general(&self) -> bool {
        true
    }
    fn open(&self, _path: &str, _access: ubc::Access, _below: &dyn Below) -> Result<Opened> {
        Ok(Opened::Wrap)
    }
    // Extended attributes would reach the store in the clear (names and values): refused,
    // not passed down, until they are encrypted like data (docs/formats.md).
    fn getxattr(&self, path: &str, _name: &str) -> Result<Vec<u8>> {
        Err(Error::NotSupported(format!("{path}: extended attributes through an encryption layer")))
    }
    fn setxattr(&self, path: &str, _name: &str, _value: &[u8], _flags: i32) -> Result<()> {
        Err(Error::NotSupported(format!("{path}: extended attributes through an encryption layer")))
    }
    fn listxattr(&self, path: &str) -> Result<Vec<String>> {
        Err(Error::NotSupported(format!("{path}: extended attributes through an encryption layer")))
    }
    fn removexattr(&self, path: &str, _name: &str) -> Result<()> {
        Err(Error::NotSupported(format!("{path}: extended attributes through an encryption layer")))
    }
    fn wrap(&self, path: &str, lower: ubc::File) -> Result<(Arc<dyn ubc::Pager>, Arc<dyn Translate>)> {
        let p = Arc::new(EncryptPager::open(lower, self.key.clone()).map_err(|e| Error::io(path, e))?);
        Ok((p.clone(), Arc::new(AeadXlate(p))))
    }
}

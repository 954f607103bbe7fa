//! The general layers: `zstd` (compression) and `aead` (authenticated encryption). Each
//! renames the bytes of its lower file — the paper's *general naming* — so each open file
//! gets its own domain (cache object) above the lower file's, and a [`Translate`] tells the
//! cache manager which bytes correspond.

use super::{Below, Layer, Opened};
use crate::coherence::{ALL, LowerWrites, Translate};
use crate::compress::{CompressOptions, CompressPager};
use crate::encrypt::xattr::{self, XattrCrypt};
use crate::encrypt::{AuthError, EncryptPager, Failure, Key};
use crate::error::{Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// Drop the lower file's clean pages that hold stored bytes `range`, which a general
/// layer's pager has just read (`read_at_no_readahead`) and decoded into the page being
/// filled above. The page above is the file's bytes now; the stored form below would be a
/// second copy of them in the one budget (exclusive caching between layers: as the mount
/// leaves a page read through it to the kernel, a layer leaves a decoded page to the layer
/// above). Stored blocks and extents do not align with pages: the page holding the start
/// of `range` goes too (in a forward scan its other bytes belong to the range read just
/// before), the one holding its end stays (they belong to the next range, which drops it
/// as its first). Out of order, a neighbour finds its edge page gone and reads that one
/// page again. Dirty and held pages stay (`ubc::File::drop_clean`). Cost: a page dropped
/// here and later evicted above is read from the store again — as it is anyway once the
/// budget is full.
pub(crate) fn drop_read_below(lower: &ubc::File, range: Range<u64>) {
    const PAGE: u64 = 4096;
    let _ = lower.drop_clean(range.start / PAGE * PAGE..range.end);
}

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
/// commit; a flush publishes one (written through, not waited for: `CompressPager::publish`)
/// unless the space kept for the last durable commit calls for a durable one.
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
    /// Published, or committed durably (`publish` decides, see there): either way the
    /// stored bytes are a complete file now, so the manager need not `sync`. A file with
    /// nothing to commit is complete already. Before a sync: the sync's one durable commit
    /// (a published one first would write the index twice).
    fn flush_metadata(&self, for_sync: bool) -> std::io::Result<bool> {
        if for_sync {
            return Ok(false);
        }
        self.0.publish().map(|()| true)
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
    fn wrap(
        &self,
        path: &str,
        lower: ubc::File,
        writes: &Arc<LowerWrites>,
    ) -> Result<(Arc<dyn ubc::Pager>, Arc<dyn Translate>)> {
        let p = Arc::new(
            CompressPager::open(lower, CompressOptions { chunk_size: self.chunk_size, level: self.level })
                .map_err(|e| Error::io(path, e))?
                .reading_settled(writes.clone())
                .on_shared_store(self.lower.is_shared()),
        );
        Ok((p.clone(), Arc::new(ZstdXlate(p))))
    }
}

/// `aead`: XChaCha20-Poly1305 per 4 KiB block; extended attributes sealed one by one
/// ([`crate::encrypt::xattr`]).
pub struct Aead {
    lower: Arc<dyn Layer>,
    key: Arc<Key>,
    key_source: String,
    xattrs: XattrCrypt,
}

impl Aead {
    /// `key_source` is how the spec names the key (never the key itself).
    pub fn new(lower: Arc<dyn Layer>, key: Arc<Key>, key_source: String) -> Aead {
        let xattrs = XattrCrypt::new(key.clone());
        Aead { lower, key, key_source, xattrs }
    }

    /// The stored name of cleartext attribute `name` of `path`, or the error the host gives
    /// for a name it would not store: `ERANGE` past `XATTR_NAME_MAX` (the kernel's answer
    /// before a request reaches a mount; the stored name is short and would not fail), and
    /// `EOPNOTSUPP` outside `user.`/`trusted.`/`security.` (`system.*` holds ACLs and the
    /// like, which the kernel enforces from the value and so cannot be encrypted).
    fn stored_name(&self, path: &str, name: &str) -> Result<String> {
        if name.len() > xattr::NAME_MAX {
            return Err(Error::io(path, std::io::Error::from_raw_os_error(libc::ERANGE)));
        }
        if !xattr::storable(name) {
            return Err(Error::NotSupported(format!(
                "{path}: extended attribute {name:?} through an encryption layer (only user., trusted. and security. names are stored, encrypted)"
            )));
        }
        Ok(self.xattrs.stored_name(name))
    }

    /// Read and open the stored attribute `stored` of `path`: its cleartext name and value.
    /// An authentication failure is an `Io` error of kind `InvalidData` carrying
    /// [`AuthError`] (EIO through a mount), never a value.
    fn open_stored(&self, path: &str, stored: &str) -> Result<(String, Vec<u8>)> {
        let sealed = self.lower.getxattr(path, stored)?;
        self.xattrs.open(stored, &sealed).map_err(|e| Error::io(path, e.into()))
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
    fn flush_metadata(&self, _for_sync: bool) -> std::io::Result<bool> {
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
    // Extended attributes: one stored attribute per cleartext one, under a keyed hash of
    // the name, the name and value sealed (docs/formats.md, "Extended attributes below the
    // encryption layer").
    fn getxattr(&self, path: &str, name: &str) -> Result<Vec<u8>> {
        let stored = self.stored_name(path, name)?;
        let (n, v) = self.open_stored(path, &stored)?;
        if n != name {
            // Authentic, but sealed for another name under the same hash: only a hash
            // collision (or a bug) gets here. Never answer with another name's value.
            return Err(Error::io(path, AuthError::Xattr { failure: Failure::BadTag }.into()));
        }
        Ok(v)
    }
    fn setxattr(&self, path: &str, name: &str, value: &[u8], flags: i32) -> Result<()> {
        let stored = self.stored_name(path, name)?;
        let sealed = self.xattrs.seal(&stored, name, value).map_err(|e| Error::io(path, e))?;
        // XATTR_CREATE/XATTR_REPLACE apply to the stored name, which stands one to one for
        // the cleartext name: EEXIST/ENODATA come from the store as on the host.
        self.lower.setxattr(path, &stored, &sealed, flags)
    }
    fn listxattr(&self, path: &str) -> Result<Vec<String>> {
        let mut names = Vec::new();
        for stored in self.lower.listxattr(path)? {
            // Attributes without the prefix were not written through this layer: not shown.
            if !stored.starts_with(xattr::STORED_PREFIX) {
                continue;
            }
            match self.open_stored(path, &stored) {
                Ok((n, _)) => names.push(n),
                // Removed between the listing and the read: gone, as a later listing says.
                Err(e) if e.errno() == libc::ENODATA => {}
                // A stored value that fails authentication fails the listing: hiding it
                // would hide the tampering.
                Err(e) => return Err(e),
            }
        }
        Ok(names)
    }
    fn removexattr(&self, path: &str, name: &str) -> Result<()> {
        let stored = self.stored_name(path, name)?;
        self.lower.removexattr(path, &stored)
    }
    fn wrap(
        &self,
        path: &str,
        lower: ubc::File,
        writes: &Arc<LowerWrites>,
    ) -> Result<(Arc<dyn ubc::Pager>, Arc<dyn Translate>)> {
        let p = Arc::new(
            EncryptPager::open(lower, self.key.clone())
                .map_err(|e| Error::io(path, e))?
                .reading_settled(writes.clone()),
        );
        Ok((p.clone(), Arc::new(AeadXlate(p))))
    }
}

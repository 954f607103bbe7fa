//! The aead layer: a file's cleartext stored encrypted and authenticated, block by block, in a
//! *lower* `ubc::File` (a host file, memory, or another layer).
//!
//! # Why this shape
//!
//! * **Per-block AEAD (XChaCha20-Poly1305), 4096-byte cleartext blocks.** The cache moves
//!   whole pages at page-aligned offsets, so a page maps onto whole blocks and a read or
//!   write never needs a read-modify-write of a neighbour. Each block is sealed on its own
//!   so random access costs one block, not the file.
//! * **A fresh random 24-byte nonce on every write.** Blocks are rewritten in place any
//!   number of times; with XChaCha's 192-bit nonces random choice is safe (no counter to
//!   persist, nothing to go wrong after a crash or a restore), and a reused nonce is
//!   never produced by a rewrite.
//! * **AAD = domain ‖ file id ‖ block index.** The tag then covers *where* a block belongs:
//!   a block moved to another index or copied from another file fails authentication just
//!   like a modified one. The file id is 16 random bytes chosen when the file is created.
//! * **An authenticated header carrying the cleartext length.** Without it, cutting blocks
//!   off the end (truncation) would be invisible. The header is sealed with the same key
//!   (an AEAD tag over the header fields, fresh nonce per header write), so a wrong key is
//!   reported at open, before any block is read.
//! * **Every block inside the header's length exists and is full-size on store.** Holes
//!   are written as encrypted zero blocks (when `set_len` grows the file; a write landing
//!   past the end leaves a gap of promised zeros, stored before the next header write
//!   unless a write fills it first: `gaps`), so a run of zero bytes in the store can
//!   never pass for cleartext zeros, and the
//!   last, partial block is padded with encrypted zeros to the full block size: the position
//!   and size of every stored block is a function of its index only, which keeps blocks
//!   decryptable whatever a crash did to the header's length. Cost: a hole costs its full
//!   stored size (4136 bytes per 4096 cleartext bytes) and a file's tail up to 4095 bytes.
//!
//! The exact bytes are in `docs/formats.md`, "aead layer".
//!
//! # Concurrency
//!
//! The cache calls `get_pages`/`put_pages` from several threads for different ranges. Reads
//! and writes run in parallel under a shared lock, wherever they land; `set_len`, `reload`
//! and the filling of gaps (at `sync` and other header writes, only if there is a gap) take
//! it exclusively, so zeros written into a gap can never overwrite data another thread is
//! putting there.
//!
//! # Crashes
//!
//! The length in the header is brought up to date by `sync` and `set_len` (writes that
//! extend the file only move the in-memory length). Between syncs the lower file may be
//! left with blocks newer than the header: after a crash, data written past the header's
//! length is not visible (the file has its last synced length); a block whose store was
//! torn fails authentication (`AuthError`), never reads as garbage; a truncation whose
//! header reached the store but whose shortened data did not is harmless, the reverse
//! reads the missing blocks as `AuthError` (indistinguishable from a truncation attack).
//!
//! # Limitations (by design)
//!
//! Rolling back the *whole* file to an older complete ciphertext is accepted (the stack
//! restores old versions on purpose). Rolling back a *single block* to an older version of
//! itself (same file, same index) is not detected: there is no per-block version or Merkle
//! tree. Copying a stored file copies its file id, so blocks can be exchanged between the
//! copies undetected. Lengths and the positions of writes are visible to whoever sees the
//! store.

mod gaps;
mod key;
pub mod xattr;

use gaps::Gaps;

pub use key::{ARGON2_M_COST_KIB, ARGON2_P_COST, ARGON2_T_COST, Key};

use crate::coherence::LowerWrites;
use chacha20poly1305::{AeadInOut, KeyInit, Tag, XChaCha20Poly1305, XNonce};
use parking_lot::{Mutex, RecursiveRwLock};
use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use ubc::{Fill, Identity, IoMode, Pager};
use zeroize::Zeroize;

/// Cleartext bytes per block.
pub const BLOCK: u64 = 4096;
/// Nonce bytes at the start of each stored block.
pub const NONCE_LEN: usize = 24;
/// Tag bytes at the end of each stored block.
pub const TAG_LEN: usize = 16;
/// Stored bytes per block: nonce ‖ ciphertext (always `BLOCK` bytes) ‖ tag.
pub const STORED_BLOCK: u64 = NONCE_LEN as u64 + BLOCK + TAG_LEN as u64;
/// Stored bytes of the header; block `i` is stored at `HEADER_LEN + i * STORED_BLOCK`.
pub const HEADER_LEN: u64 = 80;
/// Largest cleartext length: the stored blocks of a longer file would end past the largest
/// file offset the cache supports (2^63 - 64 KiB). A header claiming more is refused
/// (`BadVersion`); growing a file past it is `InvalidInput`.
pub const MAX_LEN: u64 = ((i64::MAX as u64 & !0xffff) - HEADER_LEN) / STORED_BLOCK * BLOCK;
/// Magic bytes at offset 0 of every stored file.
pub const MAGIC: &[u8; 8] = b"UBC-AEAD";
/// Format version in the header.
pub const VERSION: u32 = 1;

const B: usize = BLOCK as usize;
const S: usize = STORED_BLOCK as usize;
const H: usize = HEADER_LEN as usize;
/// Length of the header fields the header tag covers (magic .. length).
const HEADER_FIELDS: usize = 40;
const BLOCK_DOMAIN: &[u8; 16] = b"ubc-aead1 block\0";
const HEADER_DOMAIN: &[u8; 16] = b"ubc-aead1 header";

/// What failed authentication (see [`AuthError`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// The store ends before the data the authenticated length says it holds.
    Truncated,
    /// The header does not start with the magic bytes: not an aead file.
    BadMagic,
    /// Unknown format version or block size.
    BadVersion,
    /// The tag does not match: modified, moved to another index or file, or a wrong key.
    BadTag,
    /// The stored block is all zero bytes: a hole or zeroed store, never authentic.
    Zeroed,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Failure::Truncated => "stored data is shorter than the authenticated length (truncated)",
            Failure::BadMagic => "not an aead file (bad magic)",
            Failure::BadVersion => "unsupported format version or block size",
            Failure::BadTag => "authentication failed (tampered, moved, from another file, or wrong key)",
            Failure::Zeroed => "stored block is all zeros (a hole or zeroed data cannot be authentic)",
        })
    }
}

/// An authentication failure. Returned as an `io::Error` of kind `InvalidData` whose inner
/// error is this type: `err.get_ref().and_then(|e| e.downcast_ref::<AuthError>())`.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The header failed (wrong key, tampering, truncation, not an aead file).
    #[error("aead header: {0}")]
    Header(Failure),
    /// Block `index` (cleartext bytes `index * 4096 ..`) failed.
    #[error("aead block {index}: {failure}")]
    Block { index: u64, failure: Failure },
    /// A stored extended attribute's value failed (see [`xattr`]).
    #[error("aead extended attribute: {failure}")]
    Xattr { failure: Failure },
}

impl AuthError {
    /// Find an `AuthError` anywhere in `err`'s source chain (through `ubc::Error` and
    /// `io::Error` wrappers).
    pub fn find<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a AuthError> {
        let mut cur: Option<&'a (dyn std::error::Error + 'static)> = Some(err);
        while let Some(e) = cur {
            if let Some(a) = e.downcast_ref::<AuthError>() {
                return Some(a);
            }
            if let Some(io) = e.downcast_ref::<io::Error>()
                && let Some(inner) = io.get_ref()
                && let Some(a) = AuthError::find(inner)
            {
                return Some(a);
            }
            cur = e.source();
        }
        None
    }
}

impl From<AuthError> for io::Error {
    fn from(e: AuthError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// In-memory state of one stored file. `len`, `header_len` and `header_on_store` are atomics
/// so that puts under the shared lock can move them; `file_id` changes only under the
/// exclusive lock (reload).
struct State {
    /// Random id bound into every block's AAD.
    file_id: [u8; 16],
    /// Whether the lower file holds a header (false for a new, empty lower file).
    header_on_store: AtomicBool,
    /// The cleartext length: authoritative.
    len: AtomicU64,
    /// The length in the stored header (differs from `len` until the next header write).
    header_len: AtomicU64,
    /// Blocks inside `len` not stored yet: promised zeros (see `gaps`).
    gaps: Mutex<Gaps>,
    /// `gaps` has a gap (reads must look) / is not settled (a header must wait for a fill).
    /// Written under the `gaps` mutex; read without it.
    has_gaps: AtomicBool,
    unsettled: AtomicBool,
}

impl State {
    fn new(file_id: [u8; 16], header_on_store: bool, len: u64) -> State {
        State {
            file_id,
            header_on_store: AtomicBool::new(header_on_store),
            len: AtomicU64::new(len),
            header_len: AtomicU64::new(len),
            gaps: Mutex::new(Gaps::new(blocks(len))),
            has_gaps: AtomicBool::new(false),
            unsettled: AtomicBool::new(false),
        }
    }

    /// Run `f` on the gaps and publish their flags.
    fn with_gaps<T>(&self, f: impl FnOnce(&mut Gaps) -> T) -> T {
        let mut g = self.gaps.lock();
        let r = f(&mut g);
        self.has_gaps.store(g.has_gaps(), SeqCst);
        self.unsettled.store(!g.is_settled(), SeqCst);
        r
    }

    /// The gaps among blocks `a..b` (cheap when there are none).
    fn gaps_within(&self, a: u64, b: u64) -> Vec<Range<u64>> {
        if !self.has_gaps.load(SeqCst) {
            return Vec::new();
        }
        self.gaps.lock().within(a, b)
    }

    /// The length a header may carry now: `len`, cut at the first block not stored yet.
    fn storable_len(&self) -> u64 {
        let len = self.len.load(SeqCst);
        if !self.unsettled.load(SeqCst) {
            return len;
        }
        match self.gaps.lock().first_unstored() {
            Some(b) => len.min(b * BLOCK),
            None => len,
        }
    }
}

/// What `flush_header` does when another thread is writing the header.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Writer {
    /// Wait for it, then write if still stale (`sync`, `flush_metadata`).
    Wait,
    /// Leave it to that thread (a put, which must not wait: it may be re-entered).
    Yield,
}

/// How the caller of `first_header` holds the state lock.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Held {
    Shared,
    Exclusive,
}

/// A [`Pager`] storing a file's cleartext encrypted per block in a lower `ubc::File`.
pub struct EncryptPager {
    lower: ubc::File,
    cipher: XChaCha20Poly1305,
    writable: bool,
    /// Shared: reads, puts, header writes. Exclusive: filling gaps, `set_len`, `reload`. Shared acquisitions are
    /// recursive (`RecursiveRwLock`: readers never queue behind a waiting writer): a lower write may re-enter this pager from the same
    /// thread through the cache's writeback (see the report on throttling).
    state: RecursiveRwLock<State>,
    /// Serializes header writes made under the shared lock.
    header_lock: Mutex<()>,
    /// The stack's writes into the lower file (none, unless a stack made this pager):
    /// blocks read while one of them is half written fail authentication, and are read
    /// again.
    writes: Arc<LowerWrites>,
}

fn ubc_io(e: ubc::Error) -> io::Error {
    io::Error::from(e)
}

fn random(buf: &mut [u8]) -> io::Result<()> {
    getrandom::fill(buf).map_err(|e| io::Error::other(format!("OS random number generator: {e}")))
}

fn cipher_for(key: &Key) -> XChaCha20Poly1305 {
    let mut k = chacha20poly1305::Key::from(*key.bytes());
    let c = XChaCha20Poly1305::new(&k);
    k.as_mut_slice().zeroize();
    c
}

fn block_aad(file_id: &[u8; 16], index: u64) -> [u8; 40] {
    let mut a = [0u8; 40];
    a[..16].copy_from_slice(BLOCK_DOMAIN);
    a[16..32].copy_from_slice(file_id);
    a[32..].copy_from_slice(&index.to_le_bytes());
    a
}

fn header_aad(fields: &[u8]) -> [u8; 16 + HEADER_FIELDS] {
    let mut a = [0u8; 16 + HEADER_FIELDS];
    a[..16].copy_from_slice(HEADER_DOMAIN);
    a[16..].copy_from_slice(&fields[..HEADER_FIELDS]);
    a
}

/// Where block `index` is stored. Saturating: range translations (locks, maps, coherence)
/// may ask about indexes up to `u64::MAX / BLOCK`, whose slots lie past any file.
fn slot(index: u64) -> u64 {
    index.saturating_mul(STORED_BLOCK).saturating_add(HEADER_LEN)
}

/// Number of blocks holding `len` cleartext bytes.
fn blocks(len: u64) -> u64 {
    len.div_ceil(BLOCK)
}

/// Read as much of `buf` as the file holds at `offset`; returns the bytes read. Without
/// read-ahead in the lower file: this pager is read ahead by the cache above it, and asks
/// for exactly the blocks it fills (`ubc::File::read_at_no_readahead`).
fn read_full(f: &ubc::File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let n = f.read_at_no_readahead(&mut buf[done..], offset + done as u64).map_err(ubc_io)?;
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(done)
}

fn write_all(f: &ubc::File, buf: &[u8], offset: u64) -> io::Result<()> {
    // A short count means the write stopped at an error after some bytes; writing the rest
    // again returns that error (or succeeds, if it was passing).
    let mut done = 0;
    while done < buf.len() {
        let n = f.write_at(&buf[done..], offset + done as u64).map_err(ubc_io)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("lower file took {done} of {} bytes at {offset}", buf.len()),
            ));
        }
        done += n;
    }
    Ok(())
}

/// Read and authenticate the header of `lower`: `Ok(None)` for an empty lower file,
/// else `(file id, length)`.
fn read_header(lower: &ubc::File, cipher: &XChaCha20Poly1305) -> io::Result<Option<([u8; 16], u64)>> {
    let stored = lower.len().map_err(ubc_io)?;
    if stored == 0 {
        return Ok(None);
    }
    let mut h = [0u8; H];
    let got = read_full(lower, &mut h, 0)?;
    if h[..got.min(8)] != MAGIC[..got.min(8)] {
        return Err(AuthError::Header(Failure::BadMagic).into());
    }
    if got < H {
        return Err(AuthError::Header(Failure::Truncated).into());
    }
    let nonce = XNonce::try_from(&h[40..64]).expect("24 bytes");
    let tag = Tag::try_from(&h[64..80]).expect("16 bytes");
    if cipher.decrypt_inout_detached(&nonce, &header_aad(&h), (&mut [][..]).into(), &tag).is_err() {
        return Err(AuthError::Header(Failure::BadTag).into());
    }
    // Authenticated from here on: the fields were written by a holder of the key.
    let version = u32::from_le_bytes(h[8..12].try_into().unwrap());
    let block = u32::from_le_bytes(h[12..16].try_into().unwrap());
    if version != VERSION || block as u64 != BLOCK {
        return Err(AuthError::Header(Failure::BadVersion).into());
    }
    let id: [u8; 16] = h[16..32].try_into().unwrap();
    let len = u64::from_le_bytes(h[32..40].try_into().unwrap());
    if len > MAX_LEN {
        return Err(AuthError::Header(Failure::BadVersion).into());
    }
    Ok(Some((id, len)))
}

impl EncryptPager {
    /// Open the encrypted file stored in `lower`. An empty lower file is an empty file (a new
    /// random file id is chosen; the header is written on the first put/set_len/sync).
    /// Otherwise the header is read and authenticated: a wrong key or a damaged header is an
    /// `InvalidData` error carrying [`AuthError::Header`]. Read-only if `lower` is.
    pub fn open(lower: ubc::File, key: Arc<Key>) -> io::Result<EncryptPager> {
        let cipher = cipher_for(&key);
        let state = Self::load(&lower, &cipher)?;
        let writable = lower.is_writable();
        Ok(EncryptPager {
            lower,
            cipher,
            writable,
            state: RecursiveRwLock::new(state),
            header_lock: Mutex::new(()),
            writes: Arc::default(),
        })
    }

    /// Read the blocks of pages that fail authentication while a write through the stack
    /// changes them again ([`LowerWrites::settled`]): without it, a mapping's fault that
    /// reads a block half rewritten below gets SIGBUS.
    pub fn reading_settled(mut self, writes: Arc<LowerWrites>) -> EncryptPager {
        self.writes = writes;
        self
    }

    fn load(lower: &ubc::File, cipher: &XChaCha20Poly1305) -> io::Result<State> {
        Ok(match read_header(lower, cipher)? {
            Some((file_id, len)) => State::new(file_id, true, len),
            None => {
                let mut file_id = [0u8; 16];
                random(&mut file_id)?;
                State::new(file_id, false, 0)
            }
        })
    }

    /// Cleartext length of the file stored in `lower` (0 for an empty lower file). Reads and
    /// authenticates the header; it does not check that the blocks are present.
    pub fn logical_len(lower: &ubc::File, key: &Key) -> io::Result<u64> {
        Ok(read_header(lower, &cipher_for(key))?.map_or(0, |(_, len)| len))
    }

    /// Write the header if its length is stale, without syncing the lower file: what the
    /// cache manager needs to make the stored bytes a complete file for a reader below
    /// (durability is `sync`'s job). => no `reload` in flight.
    pub fn flush_metadata(&self) -> io::Result<()> {
        if !self.writable {
            return Ok(());
        }
        let _scope = self.scope();
        self.fill_gaps()?;
        let st = self.state.read();
        if Self::header_due(&st) {
            self.flush_header(&st, Writer::Wait)?;
        }
        Ok(())
    }

    /// Store the promised zeros of every gap inside the length, so that the header can
    /// carry the whole length. Takes the lock exclusively, only if there is a gap or a put
    /// into one is in flight. => not under this pager's lock (the cache's sync or flush
    /// paths, or `Drop`).
    fn fill_gaps(&self) -> io::Result<()> {
        if !self.state.read().unsettled.load(SeqCst) {
            return Ok(());
        }
        let st = self.state.write();
        self.fill_gaps_locked(&st)
    }

    /// As `fill_gaps`, and forget what lies past the length (blocks of failed puts, or cut
    /// off). => exclusive lock held (no put in flight).
    fn fill_gaps_locked(&self, st: &State) -> io::Result<()> {
        let todo = st.with_gaps(|g| g.settle(blocks(st.len.load(SeqCst))));
        for (k, r) in todo.iter().enumerate() {
            if let Err(e) = self.write_zero_blocks(&st.file_id, r.start, r.end) {
                st.with_gaps(|g| g.give_back(&todo[k..]));
                return Err(e);
            }
        }
        Ok(())
    }

    /// Forget the in-memory header, file id and length and read them again from the lower
    /// file (it was changed underneath, e.g. an old ciphertext restored). Unsynced length
    /// changes are dropped. Precondition: no `get_pages`/`put_pages` in flight, and the
    /// upper file's cached pages are invalidated by the caller afterwards.
    pub fn reload(&self) -> io::Result<()> {
        let _scope = self.scope();
        let mut st = self.state.write();
        *st = Self::load(&self.lower, &self.cipher)?;
        Ok(())
    }

    /// Called from outside the cache (the cache manager, drop) we take our locks and then
    /// use the lower file, as in a pager call: reclaim there must not write back this file
    /// or any above it (see `ubc::pager::PagerScope`).
    fn scope(&self) -> ubc::pager::PagerScope {
        ubc::pager::PagerScope::enter(self.lower.depth() + 1)
    }

    /// The lower file holding the ciphertext.
    pub fn lower(&self) -> &ubc::File {
        &self.lower
    }

    /// The stored bytes holding cleartext bytes `upper`: whole blocks, header excluded.
    /// An empty `upper` maps to an empty range.
    pub fn lower_range(&self, upper: Range<u64>) -> Range<u64> {
        if upper.end <= upper.start {
            let s = slot(upper.start / BLOCK);
            return s..s;
        }
        slot(upper.start / BLOCK)..slot(blocks(upper.end))
    }

    /// The cleartext range whose blocks overlap stored bytes `lower` (whole blocks; not
    /// clipped to the length). `None` if `lower` touches the header: then the file id or
    /// length may have changed and the whole file must be treated as changed.
    pub fn upper_range(&self, lower: Range<u64>) -> Option<Range<u64>> {
        if lower.end <= lower.start {
            let b = lower.start.saturating_sub(HEADER_LEN) / STORED_BLOCK * BLOCK;
            return Some(b..b);
        }
        if lower.start < HEADER_LEN {
            return None;
        }
        let first = (lower.start - HEADER_LEN) / STORED_BLOCK;
        let last = (lower.end - HEADER_LEN).div_ceil(STORED_BLOCK);
        Some(first * BLOCK..last * BLOCK)
    }

    /// Seal and write the header with the current length — cut at the first block not
    /// stored yet (a gap, or a gap a put is filling), so that the store always holds a
    /// complete file of the header's length; `fill_gaps` first for the whole length. =>
    /// the state lock held, either exclusively or shared together with `header_lock`
    /// (header writers never overlap).
    fn write_header(&self, st: &State) -> io::Result<()> {
        let len = st.storable_len();
        let mut h = [0u8; H];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&(BLOCK as u32).to_le_bytes());
        h[16..32].copy_from_slice(&st.file_id);
        h[32..40].copy_from_slice(&len.to_le_bytes());
        random(&mut h[40..64])?;
        let nonce = XNonce::try_from(&h[40..64]).expect("24 bytes");
        let tag = self
            .cipher
            .encrypt_inout_detached(&nonce, &header_aad(&h), (&mut [][..]).into())
            .map_err(|_| io::Error::other("aead: sealing the header failed"))?;
        h[64..80].copy_from_slice(&tag);
        write_all(&self.lower, &h, 0)?;
        st.header_len.store(len, SeqCst);
        st.header_on_store.store(true, SeqCst);
        Ok(())
    }

    fn header_stale(st: &State) -> bool {
        !st.header_on_store.load(SeqCst) || st.header_len.load(SeqCst) != st.len.load(SeqCst)
    }

    /// Whether a sync must write the header: it is stale, unless the file is new and still
    /// empty — an empty lower file *is* an empty file (see [`EncryptPager::open`]), so a
    /// file created and closed unwritten stores nothing and its ctime stays put. (The first
    /// block written still puts a header on the store first: [`Self::first_header`].)
    fn header_due(st: &State) -> bool {
        Self::header_stale(st) && (st.header_on_store.load(SeqCst) || st.len.load(SeqCst) != 0)
    }

    /// Write the header if it is missing or its length is stale. => shared state lock held.
    /// With [`Writer::Yield`], skip if another thread is writing it (it or the next `sync`
    /// brings it up to date; never waiting here keeps a re-entered put from deadlocking).
    fn flush_header(&self, st: &State, other: Writer) -> io::Result<()> {
        let _g = if other == Writer::Wait {
            self.header_lock.lock()
        } else {
            match self.header_lock.try_lock() {
                Some(g) => g,
                None => return Ok(()),
            }
        };
        if Self::header_stale(st) {
            self.write_header(st)?;
        }
        Ok(())
    }

    /// A new file's first header, with the current length, *on the lower store* — not only
    /// in its cache, where the lower's write-behind could store later pages first; a crash,
    /// or a truncation (which cuts the store at once), then left blocks or zeros without a
    /// header: "not an aead file" (checked by tests/crash.rs). Once per file. `held`: how the
    /// caller holds the state lock; held shared, a header another thread is writing right now
    /// is left to it.
    fn first_header(&self, st: &State, held: Held) -> io::Result<()> {
        if st.header_on_store.load(SeqCst) {
            return Ok(());
        }
        if held == Held::Exclusive {
            self.write_header(st)?;
        } else {
            self.flush_header(st, Writer::Yield)?;
            if !st.header_on_store.load(SeqCst) {
                return Ok(());
            }
        }
        self.lower.clean(0..HEADER_LEN).map_err(ubc_io)
    }

    /// Seal `plain` (cleartext from block `first` on; the last block is padded with zeros
    /// to a full block) and write it to the store. => lock held (shared suffices if the
    /// blocks lie inside the length).
    fn write_blocks(&self, file_id: &[u8; 16], first: u64, plain: &[u8]) -> io::Result<()> {
        let n = plain.len().div_ceil(B);
        let mut out = vec![0u8; n * S];
        let mut nonces = vec![0u8; n * NONCE_LEN];
        random(&mut nonces)?;
        for k in 0..n {
            let s = &mut out[k * S..(k + 1) * S];
            s[..NONCE_LEN].copy_from_slice(&nonces[k * NONCE_LEN..(k + 1) * NONCE_LEN]);
            let src = &plain[k * B..((k + 1) * B).min(plain.len())];
            let (head, tag_dst) = s.split_at_mut(NONCE_LEN + B);
            let (nonce_bytes, ct) = head.split_at_mut(NONCE_LEN);
            ct[..src.len()].copy_from_slice(src); // the rest stays zero: padding
            let nonce = XNonce::try_from(&*nonce_bytes).expect("24 bytes");
            let tag = self
                .cipher
                .encrypt_inout_detached(&nonce, &block_aad(file_id, first + k as u64), (&mut *ct).into())
                .map_err(|_| io::Error::other("aead: sealing a block failed"))?;
            tag_dst.copy_from_slice(&tag);
        }
        write_all(&self.lower, &out, slot(first))
    }

    /// Write encrypted zero blocks `from..to`, in batches. => exclusive lock held.
    fn write_zero_blocks(&self, file_id: &[u8; 16], from: u64, to: u64) -> io::Result<()> {
        const BATCH: u64 = 256;
        let zeros = vec![0u8; (BATCH.min(to.saturating_sub(from)) as usize) * B];
        let mut i = from;
        while i < to {
            let n = BATCH.min(to - i);
            self.write_blocks(file_id, i, &zeros[..n as usize * B])?;
            i += n;
        }
        Ok(())
    }

    /// Read and open block `index` into `out` (a full block). => lock held.
    fn read_block(&self, file_id: &[u8; 16], index: u64, out: &mut [u8; B]) -> io::Result<()> {
        let mut s = vec![0u8; S];
        let got = read_full(&self.lower, &mut s, slot(index))?;
        self.open_slot(file_id, index, &s, got == S, out)
    }

    /// Read, authenticate and decrypt the blocks of `buf.len()` bytes at `offset`, which
    /// lies below `len`. => state lock held (shared); `offset` a multiple of `BLOCK`.
    fn read_pages(&self, st: &State, len: u64, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        let data = ((len - offset).min(buf.len() as u64)) as usize;
        let n = data.div_ceil(B);
        let first = offset / BLOCK;
        let mut stored = vec![0u8; n * S];
        let got = read_full(&self.lower, &mut stored, slot(first))?;
        crate::layer::general::drop_read_below(&self.lower, slot(first)..slot(first) + (n * S) as u64);
        let gaps = st.gaps_within(first, first + n as u64);
        for k in 0..n {
            let out_end = ((k + 1) * B).min(buf.len());
            if gaps.iter().any(|r| r.contains(&(first + k as u64))) {
                // Promised zeros, not stored yet.
                buf[k * B..out_end].fill(0);
                continue;
            }
            self.open_slot(
                &st.file_id,
                first + k as u64,
                &stored[k * S..(k + 1) * S],
                got >= (k + 1) * S,
                &mut buf[k * B..out_end],
            )?;
        }
        // Past the end reads as zero (the padding is zero already; the rest of `buf` is not
        // ours to assume).
        buf[data..].fill(0);
        Ok(Fill::Data)
    }

    /// Authenticate and decrypt one stored block `s` into `out` (`out.len() <= BLOCK`;
    /// a shorter `out` takes the first bytes). `complete`: the store held all of `s`.
    fn open_slot(&self, file_id: &[u8; 16], index: u64, s: &[u8], complete: bool, out: &mut [u8]) -> io::Result<()> {
        if !complete {
            return Err(AuthError::Block { index, failure: Failure::Truncated }.into());
        }
        let nonce = XNonce::try_from(&s[..NONCE_LEN]).expect("24 bytes");
        let tag = Tag::try_from(&s[NONCE_LEN + B..]).expect("16 bytes");
        let aad = block_aad(file_id, index);
        let ok = if out.len() == B {
            out.copy_from_slice(&s[NONCE_LEN..NONCE_LEN + B]);
            self.cipher.decrypt_inout_detached(&nonce, &aad, out.into(), &tag).is_ok()
        } else {
            let mut tmp = [0u8; B];
            tmp.copy_from_slice(&s[NONCE_LEN..NONCE_LEN + B]);
            let ok = self.cipher.decrypt_inout_detached(&nonce, &aad, (&mut tmp[..]).into(), &tag).is_ok();
            if ok {
                let n = out.len();
                out.copy_from_slice(&tmp[..n]);
            }
            tmp.zeroize();
            ok
        };
        if ok {
            return Ok(());
        }
        out.fill(0);
        let failure = if s.iter().all(|&b| b == 0) { Failure::Zeroed } else { Failure::BadTag };
        Err(AuthError::Block { index, failure }.into())
    }

    fn check_aligned(offset: u64) -> io::Result<()> {
        if !offset.is_multiple_of(BLOCK) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("aead: offset {offset} is not a multiple of the {BLOCK}-byte block"),
            ));
        }
        Ok(())
    }

    fn check_writable(&self) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, "aead: the lower file is read-only"));
        }
        Ok(())
    }
}

impl Pager for EncryptPager {
    /// A fault of this layer's mapping needs what a fault of the lower file does (its
    /// bytes are made of the lower file's; which ones is this layer's business, so the
    /// whole lower file is asked about).
    fn fault_guard(&self, _range: std::ops::Range<u64>, store: bool) -> io::Result<Option<ubc::FaultGuard>> {
        Ok(self.lower.fault_guard(0..u64::MAX, store)?)
    }
    /// Precondition: `offset` is a multiple of 4096 (the cache's pages are). Any `buf`
    /// length works. Every block of the range inside the length is authenticated; one
    /// failing block fails the call with its [`AuthError`].
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        Self::check_aligned(offset)?;
        let st = self.state.read();
        let len = st.len.load(SeqCst);
        if offset >= len || buf.is_empty() {
            return Ok(Fill::Hole);
        }
        self.writes.settled(|| self.read_pages(&st, len, offset, buf))
    }

    /// Precondition: `offset` is a multiple of 4096; `data` runs to a block boundary or is
    /// clipped at the file's length. A write past the end leaves a gap of promised zeros
    /// (stored as encrypted zero blocks before the next header write, unless a put fills
    /// them first) and moves the in-memory length; the header follows at the next
    /// `sync`/`set_len`/publish.
    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check_writable()?;
        Self::check_aligned(offset)?;
        if data.is_empty() {
            return Ok(());
        }
        let end = offset.checked_add(data.len() as u64).filter(|&e| e <= MAX_LEN).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("aead: write at {offset} past the largest length ({MAX_LEN})"),
            )
        })?;
        let first = offset / BLOCK;
        let st = self.state.read();
        // A new file's header goes to the store *before* its first blocks, with the length
        // from before this put: a crash in between must leave an aead file showing its last
        // length. Written after the blocks, a crash could leave blocks without any header
        // ("not an aead file") or a header with a length the file never had (tests/crash.rs
        // checks both).
        self.first_header(&st, Held::Shared)?;
        // Blocks between the ones accounted for and this put become a gap: promised zeros,
        // stored at the next header write if no put fills them first (see `gaps`). The put
        // runs under the shared lock, in parallel with every other put, wherever it lands.
        let fresh = st.with_gaps(|g| g.take(first, blocks(end)));
        let r = self.write_blocks(&st.file_id, first, data);
        if r.is_ok() {
            // A failed put leaves the length alone (the cache retries it).
            st.len.fetch_max(end, SeqCst);
        }
        st.with_gaps(|g| g.finish(fresh, r.is_ok()));
        r
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.state.read().len.load(SeqCst))
    }

    /// Growing writes encrypted zero blocks for the new range; shrinking to the middle of a
    /// block re-encrypts that block with its tail zeroed (so a later extension reads zeros),
    /// which fails with its `AuthError` if the block is damaged. The header is written.
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.check_writable()?;
        if len > MAX_LEN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("aead: length {len} past the largest ({MAX_LEN})"),
            ));
        }
        let st = self.state.write();
        let id = st.file_id;
        let old = st.len.load(SeqCst);
        if len > old {
            // A new file's header (with the old length) goes first, as in `put_pages`: zero
            // blocks without a header on the store would make it "not an aead file".
            self.first_header(&st, Held::Exclusive)?;
            // The gaps inside the old length first, then blocks past `old`: they are new
            // (the last old block's tail is already zero).
            self.fill_gaps_locked(&st)?;
            self.write_zero_blocks(&id, blocks(old), blocks(len))?;
            st.len.store(len, SeqCst);
            // Every block below the new length is stored now: that is the accounted end
            // (the gaps were emptied above, so nothing is returned to fill).
            let none = st.with_gaps(|g| g.settle(blocks(len)));
            debug_assert!(none.is_empty());
            self.write_header(&st)?;
        } else if len < old {
            // A cut block that is promised zeros has nothing stored to re-encrypt: it is
            // filled below, like every gap inside the new length.
            if !len.is_multiple_of(BLOCK) && !st.gaps.lock().contains(len / BLOCK) {
                let index = len / BLOCK;
                let mut b = Box::new([0u8; B]);
                let r = self.read_block(&id, index, &mut b).and_then(|()| {
                    b[(len % BLOCK) as usize..].fill(0);
                    self.write_blocks(&id, index, &b[..])
                });
                b.zeroize();
                r?;
            }
            // Gaps past the new end are forgotten, those below it stored.
            st.len.store(len, SeqCst);
            self.fill_gaps_locked(&st)?;
            // Header first: a crash after it leaves extra blocks (ignored), not missing ones.
            self.write_header(&st)?;
            self.lower.set_len(slot(blocks(len))).map_err(ubc_io)?;
        } else if Self::header_due(&st) {
            self.fill_gaps_locked(&st)?;
            self.write_header(&st)?;
        }
        Ok(())
    }

    /// Write the header if the length changed since it was last written, then sync the
    /// lower file (durability goes down the stack).
    /// The stored file's metadata below (its times): a sync of the lower file with
    /// nothing new to write is no more than that.
    fn sync_metadata(&self) -> io::Result<()> {
        self.lower.sync_all().map_err(ubc_io)
    }

    fn sync(&self) -> io::Result<()> {
        if self.writable {
            self.fill_gaps()?;
            let st = self.state.read();
            if Self::header_due(&st) {
                self.flush_header(&st, Writer::Wait)?;
            }
        }
        self.lower.sync().map_err(ubc_io)
    }

    /// The header if stale, then the lower file flushed: the stored bytes are a complete
    /// file in the store below, not yet durable.
    fn write_through(&self) -> io::Result<()> {
        self.flush_metadata()?;
        self.lower.write_through().map_err(ubc_io)
    }

    fn identity(&self) -> Option<Identity> {
        self.lower.identity().map(|id| Identity::Named { kind: "aead", name: format!("{:?}", Some(id)) })
    }

    fn is_writable(&self) -> bool {
        self.writable
    }

    fn describe(&self) -> String {
        format!("aead over {:?}", self.lower)
    }

    fn io_mode(&self) -> IoMode {
        self.lower.stats().io_mode
    }
    fn depth(&self) -> u32 {
        self.lower.depth() + 1
    }
}

/// Write a stale header on drop: the cache may drop a closed file's object (and this pager)
/// without a `sync` — at once when none of its pages is resident any more. Writes that
/// extended the file move the length in memory only, so without this the next open read
/// the old length from the header and the data past it was gone, crash or not: a file's
/// last extending write would be lost at a clean close (tests/crash.rs checks it).
/// Dropping then behaves like closing a file, as with the zstd layer's commit on drop; no
/// fsync (durability is `sync`'s job). Best effort: errors have nobody to go to.
impl Drop for EncryptPager {
    fn drop(&mut self) {
        let _ = self.flush_metadata();
    }
}

impl std::fmt::Debug for EncryptPager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncryptPager")
            .field("lower", &self.lower)
            .field("writable", &self.writable)
            .finish_non_exhaustive()
    }
}

//! The zstd layer: a file's logical bytes stored compressed, chunk by chunk, in a *lower*
//! `ubc::File` (a host file, a memory file or another layer in the same cache).
//!
//! # Why this shape
//!
//! * **Fixed-size logical chunks (default 64 KiB), each its own zstd frame.** Random access
//!   costs one chunk, not the file; a rewrite touches only the chunks it covers. Chunks are
//!   bigger than pages because zstd needs some context to compress well; a partial-chunk
//!   write is a read-modify-write of that chunk. Trailing zeros of a chunk are not stored
//!   (`data_len`) and an all-zero chunk is not stored at all (a hole), so sparse files stay
//!   sparse. A chunk that does not shrink is stored raw (flag in the index).
//! * **Copy-on-write extents.** A rewritten chunk goes to free space; the extent it replaces
//!   is freed only when no committed index can still reference it. So the lower file always
//!   holds the last committed state intact, whatever happened since: a crash between syncs
//!   loses the writes since the last sync and nothing else.
//! * **Commit = index + superblock.** `sync` writes the in-memory index to free space,
//!   `lower.sync()`, then writes a superblock (generation, logical length, index location and
//!   checksum, its own checksum) into the slot the last durable commit does *not* use, and
//!   `lower.sync()` again. The reader takes the valid slot with the highest generation, so a
//!   torn superblock write leaves the previous commit in force. Both slots live in separate
//!   4 KiB sectors at the start of the file.
//! * **A close publishes, a sync makes durable.** A close (the cache manager pushing the
//!   file down, `Pager::write_through`) commits the same way with `lower.write_through()` in place of each
//!   `lower.sync()` and a `PUBLISHED` flag in the superblock: written through to the store in
//!   order, not waited for — the kernel's own contract for `close` without `fsync`. Every
//!   commit goes into the slot the last *durable* one does not use, and that one's extents
//!   stay protected until the next durable commit, so a machine crash that loses a published
//!   commit (or part of it) falls back to it whole (`docs/formats.md`, "Published commits").
//!   Before, each close of a stacked file waited for the device twice (two `fdatasync`s of
//!   the host file, 0.8 ms on this VM's ext4).
//! * **The index lives in memory.** Reads look a chunk up in a `BTreeMap` under a short
//!   mutex; no I/O is done under that mutex. Free space is recomputed at open (the complement
//!   of what the committed index references), so it never needs to be stored.
//! * **Optimistic concurrency, no lock held across lower I/O.** The lower file is a file of
//!   the same cache: a write to it may throttle and make this thread write back *other*
//!   dirty objects, including this layer's own pages, re-entering `put_pages`. Holding a
//!   chunk lock across that would deadlock. Instead every installed extent gets a unique id;
//!   a read validates, after reading the stored bytes, that the chunk still maps to the same
//!   id (then the bytes cannot have been freed and reused meanwhile), and a read-modify-write
//!   installs its new extent only if the chunk's id is still the one it read (else it frees
//!   its extent and redoes the merge). The cache never writes the same page from two threads
//!   at once, so conflicts only come from different pages of one chunk and are rare.
//! * **Protection sets instead of reference counts.** An extent referenced by the committed
//!   index, by the last durable commit's, by the snapshot a commit is writing, or by a commit whose outcome is unknown
//!   (the superblock write or its `lower.sync()` failed) is *protected*: superseding it parks
//!   it on a pending list, released after the next successful commit.

mod alloc;
mod format;

use crate::coherence::LowerWrites;
use alloc::Alloc;
use format::*;
use parking_lot::Mutex;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashSet};
use std::io;
use std::sync::atomic::{AtomicU32, Ordering::*};
use ubc::{Fill, Identity, IoMode, Pager, Seek};

/// Options for a new compressed file. For an existing file the chunk size stored in its
/// superblock wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompressOptions {
    /// Logical chunk size: a power of two from 4 KiB to 16 MiB. Default 64 KiB.
    pub chunk_size: usize,
    /// zstd compression level (negative levels are the fast modes). Default 1: the layer
    /// compresses on the write path of every write, and level 1 keeps within a few percent
    /// of level 3's ratio at 1.3–2.4× its speed (a Python tree: 3.10× vs 3.22× at 394 vs
    /// 305 MB/s; fio's write buffers: 1.116× vs 1.119× at 320 vs 135 MB/s; one core).
    pub level: i32,
}

impl Default for CompressOptions {
    fn default() -> Self {
        CompressOptions { chunk_size: 64 << 10, level: 1 }
    }
}

impl CompressOptions {
    /// These options with chunk size `bytes`.
    pub fn with_chunk_size(mut self, bytes: usize) -> Self {
        self.chunk_size = bytes;
        self
    }

    /// These options with zstd level `level`.
    pub fn with_level(mut self, level: i32) -> Self {
        self.level = level;
        self
    }
}

/// Space statistics of a compressed file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct CompressStats {
    /// Logical (uncompressed) length.
    pub logical_len: u64,
    /// Logical chunk size.
    pub chunk_size: usize,
    /// Chunks with stored data (holes and all-zero chunks are not stored).
    pub chunks: u64,
    /// Of those, chunks stored uncompressed (they did not shrink).
    pub raw_chunks: u64,
    /// Uncompressed bytes of the stored chunks (without their trailing zeros).
    pub data_bytes: u64,
    /// Stored bytes of the live chunks (compressed or raw, without alignment padding).
    pub stored_bytes: u64,
    /// End of the allocated part of the lower file (header, extents, index, free gaps).
    pub allocated_end: u64,
    /// Free bytes below `allocated_end` (reusable by later writes).
    pub free_bytes: u64,
    /// Bytes held by superseded extents a commit still references (freed at the next sync).
    pub pending_bytes: u64,
    /// Generation of the last commit (0: never committed).
    pub generation: u64,
    /// The last commit was published (at a close: in the store, not waited for), not made
    /// durable; the durable one before it is kept whole until the next `sync`.
    pub published: bool,
    /// At open, the commit published last was found damaged (the machine stopped before
    /// all of it reached the device) and the last durable one was used instead.
    pub recovered_durable: bool,
}

/// A chunk's current extent and the id it was installed with.
#[derive(Debug, Clone, Copy)]
struct Entry {
    ext: Extent,
    id: u64,
}

/// Everything mutable, under one short mutex (never held across lower I/O, except the
/// page-aligned truncation of the lower file after a commit, which cannot dirty pages).
struct State {
    chunk_shift: u32,
    index: BTreeMap<u64, Entry>,
    len: u64,
    next_id: u64,
    alloc: Alloc,
    /// Offsets of extents the last commit references (its index extent included).
    committed: HashSet<u64>,
    /// While the last commit is a published one (see [`CompressPager::publish`]): the
    /// offsets of extents the last *durable* commit references (empty if there is none),
    /// protected until the next durable commit, so that a crash that loses what was written
    /// since finds that commit whole. `None`: the last commit is durable (`committed` is its
    /// set).
    durable: Option<HashSet<u64>>,
    /// The slot of the last durable commit (`None`: none known). Commits go into the other
    /// one.
    durable_slot: Option<u64>,
    /// `load` fell back from a damaged published commit to the durable one.
    recovered_durable: bool,
    /// Offsets referenced by the snapshot a `sync` is committing right now.
    inflight: HashSet<u64>,
    /// Offsets referenced by commits whose outcome is unknown (kept until a commit succeeds).
    uncertain: HashSet<u64>,
    /// Superseded protected extents (offset, allocated length), freed when unprotected.
    pending: Vec<(u64, u64)>,
    /// The last commit's generation and index extent (offset, allocated length).
    generation: u64,
    index_ext: Option<(u64, u64)>,
    /// Changed since the last commit.
    dirty: bool,
    stored_bytes: u64,
    data_bytes: u64,
    raw_chunks: u64,
}

impl State {
    fn chunk_size(&self) -> u64 {
        1 << self.chunk_shift
    }

    fn protected(&self, off: u64) -> bool {
        self.committed.contains(&off)
            || self.durable.as_ref().is_some_and(|d| d.contains(&off))
            || self.inflight.contains(&off)
            || self.uncertain.contains(&off)
    }

    /// Generation of the next commit, whose parity names its slot: never the last durable
    /// commit's slot, so a torn or lost write of this one leaves that one in force.
    fn next_generation(&self) -> u64 {
        let g = self.generation + 1;
        if self.durable_slot == Some(g % 2) { g + 1 } else { g }
    }

    /// Give back a block nobody references any more (or park it while a commit may need it).
    fn release(&mut self, off: u64, len: u64) {
        if self.protected(off) {
            self.pending.push((off, len));
        } else {
            self.alloc.free(off, len);
        }
    }

    /// Free the pending blocks that are no longer protected.
    fn flush_pending(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        for (off, len) in pending {
            self.release(off, len);
        }
    }

    fn account(&mut self, e: &Extent, sign: i64) {
        let f = |v: &mut u64, d: u64| *v = if sign > 0 { *v + d } else { *v - d };
        f(&mut self.stored_bytes, e.stored as u64);
        f(&mut self.data_bytes, e.data_len as u64);
        if e.raw {
            f(&mut self.raw_chunks, 1);
        }
    }

    /// Map `chunk` to `new` (None: a hole), releasing its old extent.
    fn install(&mut self, chunk: u64, new: Option<Extent>) {
        let old = match new {
            Some(ext) => {
                self.account(&ext, 1);
                let id = self.next_id;
                self.next_id += 1;
                self.index.insert(chunk, Entry { ext, id })
            }
            None => self.index.remove(&chunk),
        };
        if let Some(o) = old {
            self.account(&o.ext, -1);
            self.release(o.ext.off, o.ext.alloc_len());
        }
        self.dirty = true;
    }

    fn id_of(&self, chunk: u64) -> Option<u64> {
        self.index.get(&chunk).map(|e| e.id)
    }
}

/// The zstd layer's pager. See the module docs for the design and `docs/formats.md`
/// ("zstd layer") for the on-disk format.
pub struct CompressPager {
    lower: ubc::File,
    level: i32,
    writable: bool,
    /// Lower cache page size: the lower file is only truncated to a multiple of it.
    lower_page: u64,
    /// Placement unit of new extents (and indexes): `ALIGN`, or the block of a lower file
    /// that rewrites whole blocks. Over aead, writing a new extent into a 4 KiB block that
    /// also holds committed bytes re-encrypts that block, and its 4136 stored bytes straddle
    /// two pages of the file below, which reach the disk at different times: a crash in
    /// between would tear the block, and the *committed* extent would fail authentication
    /// (tests/crash.rs). So over aead, new data goes only into whole blocks holding nothing
    /// else, and blocks with committed data are never rewritten before a commit frees them.
    /// The format is unchanged (offsets stay multiples of `ALIGN`; files written either way
    /// read the same).
    grain: u64,
    /// Copy of `State::chunk_shift` readable without the lock (changes only in `reload`).
    chunk_shift: AtomicU32,
    state: Mutex<State>,
    /// One commit at a time.
    sync_lock: Mutex<()>,
    /// The stack's writes into the lower file (none, unless a stack made this pager): an
    /// extent read while one of them is half written fails to decode, and is read again.
    writes: std::sync::Arc<LowerWrites>,
    /// The store below is shared with other machines: a `sync` writes only what this pager
    /// changed (see [`CompressPager::on_shared_store`]).
    shared_store: bool,
}

/// Index entries read and checked per piece at open (1 MiB).
const INDEX_PIECE_ENTRIES: u64 = (1 << 20) / IDX_ENTRY as u64;

thread_local! {
    static COMPRESSOR: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
    /// Scratch buffers, taken out while in use (a re-entrant call finds them empty and
    /// allocates its own), so no borrow is held across lower I/O.
    static STORED_BUF: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
    static CHUNK_BUF: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
}

fn take_buf(k: &'static std::thread::LocalKey<Cell<Vec<u8>>>) -> Vec<u8> {
    k.with(|c| c.take())
}

fn give_buf(k: &'static std::thread::LocalKey<Cell<Vec<u8>>>, v: Vec<u8>) {
    k.with(|c| c.set(v))
}

/// Length of `b` without its trailing zeros.
fn trimmed_len(b: &[u8]) -> usize {
    let mut end = b.len();
    while end >= 64 && b[end - 64..end].iter().all(|&x| x == 0) {
        end -= 64;
    }
    while end > 0 && b[end - 1] == 0 {
        end -= 1;
    }
    end
}

fn ubc_err(e: ubc::Error) -> io::Error {
    io::Error::from(e)
}

/// Compress `src` into `out` (cleared first) at `level`. Returns true if the result should
/// be stored raw instead (it does not shrink by at least 1/32).
fn compress(level: i32, src: &[u8], out: &mut Vec<u8>) -> io::Result<bool> {
    out.clear();
    out.reserve(zstd::zstd_safe::compress_bound(src.len()));
    COMPRESSOR.with(|c| {
        let mut c = c.borrow_mut();
        if c.as_ref().is_none_or(|(l, _)| *l != level) {
            *c = Some((level, zstd::bulk::Compressor::new(level)?));
        }
        c.as_mut().unwrap().1.compress_to_buffer(src, out)
    })?;
    Ok(out.len() >= src.len() - src.len() / 32)
}

impl CompressPager {
    /// Open the compressed file stored in `lower`. An empty lower file (or one whose header
    /// was never committed) is an empty compressed file; nothing is written until the first
    /// `put_pages`/`set_len`/`sync`. Read-only if `lower.is_writable()` is false.
    /// A malformed lower file is an `InvalidData` error; bad options are `InvalidInput`.
    pub fn open(lower: ubc::File, opts: CompressOptions) -> io::Result<CompressPager> {
        let cs = opts.chunk_size;
        if !cs.is_power_of_two() || !(MIN_CHUNK_SHIFT..=MAX_CHUNK_SHIFT).contains(&cs.trailing_zeros()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("zstd layer: chunk size {cs} is not a power of two from 4 KiB to 16 MiB"),
            ));
        }
        // Fail early on a level zstd refuses — by its range, not by making a compressor:
        // a context per open was 2% of a mount's CPU for small files.
        if !zstd::compression_level_range().contains(&opts.level) {
            let r = zstd::compression_level_range();
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("zstd layer: compression level {} is outside {}..={}", opts.level, r.start(), r.end()),
            ));
        }
        let state = Self::load(&lower, cs.trailing_zeros())?;
        let grain = match lower.identity() {
            Some(Identity::Named { kind: "aead", .. }) => crate::encrypt::BLOCK,
            _ => ALIGN,
        };
        Ok(CompressPager {
            writable: lower.is_writable(),
            lower_page: lower.cache().page_size() as u64,
            grain,
            chunk_shift: AtomicU32::new(state.chunk_shift),
            level: opts.level,
            lower,
            state: Mutex::new(state),
            sync_lock: Mutex::new(()),
            writes: Default::default(),
            shared_store: false,
        })
    }

    /// The store below is shared with other machines (`s3` with `etcd=`): a `sync` writes
    /// only what this pager changed since its last commit. It neither makes a published
    /// commit durable — the object store's commit below already is, and the commit may be
    /// another machine's, or this machine's from before its write token left — nor compacts
    /// a file it committed nothing to: either rewrote the shared file without the write token
    /// (a sync by a machine that only read the file, or that gave it to another: a mount's
    /// shutdown, which syncs every file it cached, failed on the fence and exited 74). The
    /// extents of the last durable commit then stay reserved until this machine's next
    /// durable commit of a change.
    pub fn on_shared_store(mut self, shared: bool) -> CompressPager {
        self.shared_store = shared;
        self
    }

    /// Read the extents of chunks that fail to decode while a write through the stack
    /// changes them again ([`LowerWrites::settled`]): without it, a mapping's fault that
    /// reads an extent half rewritten below gets SIGBUS.
    pub fn reading_settled(mut self, writes: std::sync::Arc<LowerWrites>) -> CompressPager {
        self.writes = writes;
        self
    }

    /// The valid superblocks of `lower`, newest first, and the lower length (reads the
    /// header only).
    fn read_superblocks(lower: &ubc::File) -> io::Result<(Vec<Superblock>, u64)> {
        let lower_len = lower.len().map_err(ubc_err)?;
        if lower_len == 0 {
            return Ok((Vec::new(), 0));
        }
        let mut header = vec![0u8; DATA_START as usize];
        let n = DATA_START.min(lower_len);
        // Slot by slot: a lower file that authenticates blocks (aead) fails the read of a
        // slot torn by a crash during its commit. Such a slot is read as empty (never
        // written), so the other slot — the last commit — stays in force, as with a slot
        // failing its checksum; both failing is an error.
        let mut failed = false;
        for slot in 0..2 {
            let (from, to) = (slot * SLOT_SIZE, ((slot + 1) * SLOT_SIZE).min(n));
            if from >= to {
                continue;
            }
            let buf = &mut header[from as usize..to as usize];
            if let Err(e) = lower.read_exact_at(buf, from) {
                let e = ubc_err(e);
                if e.kind() != io::ErrorKind::InvalidData || failed {
                    return Err(e);
                }
                buf.fill(0);
                failed = true;
            }
        }
        Ok((superblocks(&header)?, lower_len))
    }

    /// Read the committed state from `lower`. `new_shift`: chunk shift for a never-committed
    /// file. The newest valid superblock wins; if it is a published one (written at a close,
    /// not waited for) whose index is damaged — the machine stopped before all of it reached
    /// the device — the other slot's commit, the last durable one, is used instead. Loading a
    /// published commit also protects the durable one's extents (read from the other slot),
    /// as they were before: until the next durable commit nothing of it is overwritten.
    fn load(lower: &ubc::File, new_shift: u32) -> io::Result<State> {
        let (sbs, lower_len) = Self::read_superblocks(lower)?;
        let mut st = State {
            chunk_shift: new_shift,
            index: BTreeMap::new(),
            len: 0,
            next_id: 1,
            alloc: Alloc::from_used(DATA_START, Vec::new()),
            committed: HashSet::new(),
            durable: None,
            durable_slot: None,
            recovered_durable: false,
            inflight: HashSet::new(),
            uncertain: HashSet::new(),
            pending: Vec::new(),
            generation: 0,
            index_ext: None,
            dirty: false,
            stored_bytes: 0,
            data_bytes: 0,
            raw_chunks: 0,
        };
        let mut chosen = None;
        for (i, sb) in sbs.iter().enumerate() {
            match Self::read_index(lower, sb, lower_len) {
                Ok(entries) => {
                    chosen = Some((i, *sb, entries));
                    break;
                }
                // Told in `CompressStats::recovered_durable`.
                Err(_) if sb.published && i + 1 < sbs.len() => st.recovered_durable = true,
                Err(e) => return Err(e),
            }
        }
        let Some((i, sb, entries)) = chosen else { return Ok(st) };
        st.chunk_shift = sb.chunk_shift;
        st.len = sb.logical_len;
        // Above both slots' (a damaged published one included): generations only grow.
        st.generation = sbs.iter().map(|s| s.generation).max().unwrap_or(sb.generation);
        let idx_ext = (sb.index_off, align_up(sb.index_len));
        st.index_ext = Some(idx_ext);
        // Offset -> allocated length of everything in use (the two commits share extents).
        let mut used: BTreeMap<u64, u64> = BTreeMap::new();
        used.insert(idx_ext.0, idx_ext.1);
        st.committed.insert(idx_ext.0);
        for (chunk, ext) in entries {
            used.insert(ext.off, ext.alloc_len());
            st.committed.insert(ext.off);
            st.account(&ext, 1);
            let id = st.next_id;
            st.next_id += 1;
            st.index.insert(chunk, Entry { ext, id });
        }
        if !sb.published {
            st.durable_slot = Some(sb.generation % 2);
        } else {
            let mut durable = HashSet::new();
            if let Some(d) = sbs.get(i + 1) {
                // The durable commit below the published one: unreadable, it protects nothing
                // (it is then no fallback either), and the next commit may take its slot.
                if let Ok(entries) = Self::read_index(lower, d, lower_len) {
                    let dext = (d.index_off, align_up(d.index_len));
                    used.entry(dext.0).or_insert(dext.1);
                    durable.insert(dext.0);
                    for (_, ext) in entries {
                        used.entry(ext.off).or_insert(ext.alloc_len());
                        durable.insert(ext.off);
                    }
                    st.durable_slot = Some(d.generation % 2);
                }
            }
            st.durable = Some(durable);
        }
        st.alloc = Alloc::from_used(DATA_START, used.into_iter().collect());
        Ok(st)
    }

    /// The index `sb` names, read and checked piece by piece (see `IndexReader`): the index
    /// length is read from the file, so it must not size an allocation or a read before it
    /// is believed.
    fn read_index(lower: &ubc::File, sb: &Superblock, lower_len: u64) -> io::Result<Vec<(u64, Extent)>> {
        if sb.index_off + sb.index_len > lower_len {
            return Err(invalid(format!(
                "index at lower offset {} (len {}) extends past the end of the lower file ({lower_len})",
                sb.index_off, sb.index_len
            )));
        }
        let mut header = [0u8; IDX_HEADER];
        lower.read_exact_at(&mut header, sb.index_off).map_err(ubc_err)?;
        let mut reader = IndexReader::new(&header, sb, lower_len)?;
        let mut piece = Vec::new();
        let mut pos = sb.index_off + IDX_HEADER as u64;
        while reader.remaining() > 0 {
            let n = reader.remaining().min(INDEX_PIECE_ENTRIES) as usize * IDX_ENTRY;
            piece.resize(n, 0);
            lower.read_exact_at(&mut piece, pos).map_err(ubc_err)?;
            reader.entries(&piece)?;
            pos += n as u64;
        }
        reader.finish()
    }

    /// Logical length of the compressed file stored in `lower`, from its newest valid
    /// superblock (0 for an empty or never-committed file). Reads only the header (a
    /// published commit whose index did not survive a crash is not noticed here; `open`
    /// then falls back to the durable one, whose length may differ).
    pub fn logical_len(lower: &ubc::File) -> io::Result<u64> {
        Ok(Self::read_superblocks(lower)?.0.first().map_or(0, |sb| sb.logical_len))
    }

    /// Forget all in-memory state and re-read it from `lower` (the lower file was changed
    /// underneath, e.g. an old version restored). Uncommitted changes are dropped.
    /// Precondition: no `get_pages`/`put_pages`/`set_len` in flight.
    pub fn reload(&self) -> io::Result<()> {
        let _scope = self.scope();
        let _s = self.sync_lock.lock();
        let shift = self.chunk_shift.load(Relaxed);
        let fresh = Self::load(&self.lower, shift)?;
        self.chunk_shift.store(fresh.chunk_shift, Relaxed);
        *self.state.lock() = fresh;
        Ok(())
    }

    /// Called from outside the cache (the cache manager, drop) we take our locks and then
    /// use the lower file, as in a pager call: reclaim there must not write back this file
    /// or any above it (see `ubc::pager::PagerScope`).
    fn scope(&self) -> ubc::pager::PagerScope {
        ubc::pager::PagerScope::enter(self.lower.depth() + 1)
    }

    /// The lower file.
    pub fn lower(&self) -> &ubc::File {
        &self.lower
    }

    /// Space statistics.
    pub fn stored_stats(&self) -> CompressStats {
        let st = self.state.lock();
        CompressStats {
            logical_len: st.len,
            chunk_size: st.chunk_size() as usize,
            chunks: st.index.len() as u64,
            raw_chunks: st.raw_chunks,
            data_bytes: st.data_bytes,
            stored_bytes: st.stored_bytes,
            allocated_end: st.alloc.end(),
            free_bytes: st.alloc.free_bytes(),
            pending_bytes: st.pending.iter().map(|p| p.1).sum(),
            generation: st.generation,
            published: st.durable.is_some(),
            recovered_durable: st.recovered_durable,
        }
    }

    fn read_only_err() -> io::Error {
        io::Error::new(io::ErrorKind::PermissionDenied, "zstd layer: the lower file is read-only")
    }

    /// The stored bytes of `chunk`, checksum verified, and the id of the extent they came
    /// from; `None` if the chunk is a hole. Lock-free against writers (see module docs).
    fn fetch(&self, chunk: u64, buf: &mut Vec<u8>) -> io::Result<Option<(Extent, u64)>> {
        loop {
            let Some(Entry { ext, id }) = self.state.lock().index.get(&chunk).copied() else {
                return Ok(None);
            };
            buf.clear();
            buf.resize(ext.stored as usize, 0);
            // Exactly the extent, without read-ahead below: the cache above reads ahead in
            // chunk order, and extents are not stored in chunk order.
            let r = read_exact_no_readahead(&self.lower, buf, ext.off);
            if self.state.lock().id_of(chunk) != Some(id) {
                continue; // Superseded while we read: its space may have been reused.
            }
            r.map_err(ubc_err)?;
            if crc32fast::hash(buf) != ext.crc {
                return Err(invalid(format!(
                    "chunk {chunk} (logical offset {}) at lower offset {} (len {}): checksum mismatch",
                    chunk << self.chunk_shift.load(Relaxed),
                    ext.off,
                    ext.stored
                )));
            }
            return Ok(Some((ext, id)));
        }
    }

    /// Decode stored bytes into `dst` (at least `data_len` long): the chunk's bytes, zeros
    /// past `data_len`.
    fn decode(&self, chunk: u64, ext: &Extent, stored: &[u8], dst: &mut [u8]) -> io::Result<()> {
        let n = ext.data_len as usize;
        if ext.raw {
            dst[..n].copy_from_slice(stored);
        } else {
            let r = DECOMPRESSOR.with(|d| {
                let mut d = d.borrow_mut();
                if d.is_none() {
                    *d = Some(zstd::bulk::Decompressor::new()?);
                }
                d.as_mut().unwrap().decompress_to_buffer(stored, &mut dst[..n])
            });
            match r {
                Ok(got) if got == n => {}
                Ok(got) => {
                    return Err(invalid(format!(
                        "chunk {chunk} at lower offset {}: decompressed to {got} bytes, index says {n}",
                        ext.off
                    )));
                }
                Err(e) => {
                    return Err(invalid(format!(
                        "chunk {chunk} at lower offset {}: decompression failed: {e}",
                        ext.off
                    )));
                }
            }
        }
        dst[n..].fill(0);
        Ok(())
    }

    /// Compress `data` (a chunk's bytes without trailing zeros, non-empty), write it to newly
    /// allocated space and return its extent (not yet installed).
    fn store(&self, data: &[u8], out: &mut Vec<u8>) -> io::Result<Extent> {
        let raw = compress(self.level, data, out)?;
        let bytes: &[u8] = if raw { data } else { out };
        let mut ext = Extent {
            off: 0,
            stored: bytes.len() as u32,
            data_len: data.len() as u32,
            crc: crc32fast::hash(bytes),
            raw,
        };
        let alen = ext.alloc_len();
        ext.off = self.state.lock().alloc.alloc(alen, self.grain);
        if let Err(e) = self.lower.write_at(bytes, ext.off) {
            self.state.lock().release(ext.off, alen);
            return Err(ubc_err(e));
        }
        Ok(ext)
    }

    /// Store a new version of one chunk: `fill` builds its bytes in `buf` (chunk-sized),
    /// which holds the current contents (zeros for a hole) if `need_old(logical length)`
    /// says they matter, else zeros. Installs it if the chunk was not changed meanwhile, else
    /// redoes it. `extend_to`: new minimum logical length.
    fn update_chunk(
        &self,
        chunk: u64,
        need_old: &dyn Fn(u64) -> bool,
        extend_to: u64,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> io::Result<()> {
        let cs = 1usize << self.chunk_shift.load(Relaxed);
        let mut buf = take_buf(&CHUNK_BUF);
        let mut stored = take_buf(&STORED_BUF);
        let r = (|| loop {
            buf.clear();
            buf.resize(cs, 0);
            // Length and chunk id read together: whether the old bytes matter depends on the
            // length, and a writer extending it installs in this chunk (changing its id), so
            // a decision made on a stale length is caught at install time.
            let (len, id) = {
                let st = self.state.lock();
                (st.len, st.id_of(chunk))
            };
            let seen = if need_old(len) {
                match self.fetch(chunk, &mut stored)? {
                    Some((ext, id)) => {
                        self.decode(chunk, &ext, &stored, &mut buf)?;
                        Some(id)
                    }
                    None => None,
                }
            } else {
                id
            };
            fill(&mut buf);
            let n = trimmed_len(&buf);
            let new = if n == 0 { None } else { Some(self.store(&buf[..n], &mut stored)?) };
            let mut st = self.state.lock();
            if st.id_of(chunk) != seen {
                // Another writer changed this chunk meanwhile: merge again on top of it.
                if let Some(e) = new {
                    st.release(e.off, e.alloc_len());
                }
                continue;
            }
            st.install(chunk, new);
            if st.len < extend_to {
                st.len = extend_to;
            }
            return Ok(());
        })();
        give_buf(&CHUNK_BUF, buf);
        give_buf(&STORED_BUF, stored);
        r
    }

    /// Write the index snapshot and a superblock for the next generation, into the slot the
    /// last durable commit does not use. `durable`: each step waits for the device
    /// (`lower.sync()` after the index, and after the superblock), and the commit becomes
    /// the one a crash falls back to. Else the commit is *published*: each step is only
    /// pushed through to the store (`lower.write_through()`, so that a reader below, or this
    /// process restarted after being killed, finds the index and its extents before the
    /// superblock naming them), and the last durable commit stays protected. Returns
    /// whether it did commit: a durable one ends with `lower.sync()` after every write to
    /// the lower file made before the call, so the caller's `sync` needs no other.
    /// => `sync_lock` held.
    fn commit(&self, durable: bool) -> io::Result<bool> {
        // Snapshot under the lock; protect what it references from reuse until we know.
        let (bytes, sb) = {
            let mut st = self.state.lock();
            // Nothing changed since the last commit, or since a never-committed (empty) file
            // was opened: an empty lower file already is an empty compressed file, so a file
            // created and closed unwritten stores nothing (and its ctime stays put, as on
            // any file system where a close changes nothing). A published commit is made
            // durable by a new durable commit (its superblock says which it is).
            let promote = durable && st.durable.is_some() && !self.shared_store;
            if !st.dirty && st.uncertain.is_empty() && !promote {
                return Ok(false);
            }
            // The free tail the last commit left: cut before this commit's writes, so that
            // its syncs (or its writing through) cover the cut too.
            self.cut_tail(&st);
            let generation = st.next_generation();
            let bytes = encode_index(generation, st.index.iter().map(|(c, e)| (*c, &e.ext)));
            // Lowest free block, not best fit: after a compaction the index must not land in
            // a small hole near the top, where it would keep the file from shrinking.
            let ilen = align_up(bytes.len() as u64);
            let idx_off = match st.alloc.alloc_below(ilen, u64::MAX, self.grain) {
                Some(off) => off,
                None => st.alloc.alloc(ilen, self.grain),
            };
            let mut inflight: HashSet<u64> = st.index.values().map(|e| e.ext.off).collect();
            inflight.insert(idx_off);
            st.inflight = inflight;
            st.dirty = false;
            let sb = Superblock {
                chunk_shift: st.chunk_shift,
                generation,
                logical_len: st.len,
                index_off: idx_off,
                index_len: bytes.len() as u64,
                index_crc: crc32fast::hash(&bytes),
                published: !durable,
            };
            (bytes, sb)
        };
        let through = || if durable { self.lower.sync() } else { self.lower.write_through() };
        let idx_ext = (sb.index_off, align_up(sb.index_len));
        // 1. Index, then it and every extent it references durable (or in the store).
        let data = self.lower.write_at(&bytes, sb.index_off).and_then(|_| through());
        if let Err(e) = data {
            // Nothing references the new index: forget it.
            let mut st = self.state.lock();
            st.inflight.clear();
            st.dirty = true;
            st.release(idx_ext.0, idx_ext.1);
            st.flush_pending();
            return Err(ubc_err(e));
        }
        // 2. The superblock, into the slot the last durable commit does not use.
        let slot = sb.generation % 2;
        let r = self.lower.write_at(&encode_superblock(&sb), slot * SLOT_SIZE).and_then(|_| through());
        let mut st = self.state.lock();
        if let Err(e) = r {
            // Maybe in force, maybe not: keep both it and the last commit protected. The
            // next commit takes this generation and slot again, so the last durable
            // commit's slot stays intact.
            let inflight = std::mem::take(&mut st.inflight);
            st.uncertain.extend(inflight);
            st.pending.push(idx_ext);
            st.dirty = true;
            return Err(ubc_err(e));
        }
        let inflight = std::mem::take(&mut st.inflight);
        let previous = std::mem::replace(&mut st.committed, inflight);
        st.uncertain.clear();
        st.generation = sb.generation;
        if durable {
            st.durable = None;
            st.durable_slot = Some(slot);
        } else if st.durable.is_none() {
            // The commit this one supersedes was the durable one: its extents stay protected.
            st.durable = Some(previous);
        }
        if let Some(old) = st.index_ext.replace(idx_ext) {
            st.pending.push(old);
        }
        st.flush_pending();
        Ok(true)
    }

    /// Give back the free tail of the lower file (superseded extents a commit freed), if
    /// any; returns whether it cut. Page-aligned, so the lower truncation dirties nothing and
    /// cannot re-enter this layer; under the state lock (`st`) so no writer allocates past
    /// it meanwhile. Only space is at stake: a failure is ignored. The cut changes the
    /// layer below (an aead header with the new length): a caller after a commit's last
    /// sync must sync again, or the sync it returns from leaves that change behind.
    fn cut_tail(&self, st: &State) -> bool {
        let keep = st.alloc.end().div_ceil(self.lower_page) * self.lower_page;
        self.lower.len().is_ok_and(|l| l > keep) && self.lower.set_len(keep).is_ok()
    }

    /// Publish the file: a commit written through to the store below without waiting for
    /// the device (`docs/formats.md`, "Published commits"), as a close does — readers of the layers
    /// below then see a complete file, and a killed process loses nothing of it, but only
    /// `sync` makes it durable. Until then the last durable commit's superseded extents stay
    /// allocated (at most that commit's size: each publish frees the one before it); when
    /// they hold more than 16 MiB and more than the file's own stored bytes (a file synced
    /// large, then cut), this commit is made durable instead, which frees them. A file with
    /// nothing to commit writes nothing.
    pub fn publish(&self) -> io::Result<()> {
        if !self.writable {
            return Ok(());
        }
        let _scope = self.scope();
        let _s = self.sync_lock.lock();
        let durable = {
            let st = self.state.lock();
            let kept: u64 = st.pending.iter().map(|p| p.1).sum();
            kept > PUBLISH_KEEP_MAX.max(st.stored_bytes)
        };
        self.commit(durable).map(drop)
    }
}

/// Superseded bytes a published commit may keep for the last durable one (see
/// [`CompressPager::publish`]).
const PUBLISH_KEEP_MAX: u64 = 16 << 20;

/// Compact when at least this share (1/N) of the data region is free...
const COMPACT_FREE_DIVISOR: u64 = 4;
/// ...and at least this many bytes.
const COMPACT_MIN_FREE: u64 = 64 << 10;
/// Most stored bytes moved by one compaction.
const COMPACT_BUDGET: u64 = 32 << 20;

impl CompressPager {
    /// Move extents from the top of the data region into free space below them (a byte copy,
    /// no recompression), so that the next commit frees the top and the lower file can be
    /// truncated: copy-on-write leaves new extents at the end while freeing old ones in the
    /// middle, which would otherwise keep the file long after a shrink or many rewrites.
    /// Only when a quarter of the region is free. Returns whether anything moved (then a
    /// commit is needed to free the old places). Best effort: an error just stops it.
    /// => `sync_lock` held, right after a successful commit.
    fn compact(&self) -> bool {
        let candidates: Vec<(u64, u64)> = {
            let st = self.state.lock();
            let (end, free) = (st.alloc.end(), st.alloc.free_bytes());
            if free < COMPACT_MIN_FREE || free * COMPACT_FREE_DIVISOR < end - DATA_START {
                return false;
            }
            // Extents above where a perfectly packed region would end, highest first.
            let line = end - free;
            let mut c: Vec<(u64, u64, u64)> = st
                .index
                .iter()
                .filter(|(_, e)| e.ext.off + e.ext.alloc_len() > line)
                .map(|(c, e)| (e.ext.off, *c, e.ext.alloc_len()))
                .collect();
            c.sort_unstable_by(|a, b| b.cmp(a));
            c.into_iter().map(|(_, chunk, alen)| (chunk, alen)).collect()
        };
        let mut buf = take_buf(&STORED_BUF);
        let (mut moved, mut bytes) = (false, 0u64);
        // The smallest extent that found no place below it. Candidates come highest first,
        // so every later one has a lower limit: one at least this long cannot fit either
        // (unless a concurrent rewrite freed space meanwhile: then it merely stays put), and
        // is skipped before it is read and without scanning the free list again. Reading
        // and scanning for every candidate is quadratic: after random 4 KiB writes cut the
        // free space into tens of thousands of pieces, a 1 GiB file's close would spend over
        // 10 s in `alloc_below`.
        let mut no_room_from = u64::MAX;
        for (chunk, listed_len) in candidates {
            if listed_len >= no_room_from {
                continue;
            }
            let Ok(Some((ext, id))) = self.fetch(chunk, &mut buf) else { continue };
            let alen = ext.alloc_len();
            let Some(off) = self.state.lock().alloc.alloc_below(alen, ext.off, self.grain) else {
                no_room_from = no_room_from.min(alen);
                continue;
            };
            if self.lower.write_at(&buf, off).is_err() {
                self.state.lock().release(off, alen);
                break;
            }
            let mut st = self.state.lock();
            if st.id_of(chunk) == Some(id) {
                st.install(chunk, Some(Extent { off, ..ext }));
                moved = true;
            } else {
                st.release(off, alen);
            }
            bytes += alen;
            if bytes >= COMPACT_BUDGET {
                break;
            }
        }
        give_buf(&STORED_BUF, buf);
        moved
    }
}

/// Commit on drop: the cache writes a closed file's pages back and then may drop its
/// object (and this pager) without a `sync`. With a host file those writes would be visible
/// to the next open; here they would vanish with the in-memory index, so a last commit makes
/// dropping behave like closing a file. Best effort (errors have nobody to go to); crash
/// consistency does not depend on it.
impl Drop for CompressPager {
    fn drop(&mut self) {
        let pending = {
            let st = self.state.lock();
            st.dirty || !st.uncertain.is_empty()
        };
        if self.writable && pending {
            let _scope = self.scope();
            let _ = self.sync();
        }
    }
}

/// `read_exact_at` without read-ahead in `lower` (see [`ubc::File::read_at_no_readahead`];
/// like `read_at`, it is short only at the end of the file).
fn read_exact_no_readahead(lower: &ubc::File, buf: &mut [u8], offset: u64) -> ubc::Result<()> {
    let n = lower.read_at_no_readahead(buf, offset)?;
    if n < buf.len() {
        return Err(ubc::Error::UnexpectedEof { object: "zstd lower file".into(), offset: offset + n as u64 });
    }
    Ok(())
}

impl Pager for CompressPager {
    /// A fault of this layer's mapping needs what a fault of the lower file does (its
    /// bytes are made of the lower file's; which ones is this layer's business, so the
    /// whole lower file is asked about).
    fn fault_guard(&self, _range: std::ops::Range<u64>, store: bool) -> io::Result<Option<ubc::FaultGuard>> {
        Ok(self.lower.fault_guard(0..u64::MAX, store)?)
    }
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        if buf.is_empty() {
            return Ok(Fill::Hole);
        }
        let shift = self.chunk_shift.load(Relaxed);
        let cs = 1u64 << shift;
        let end = offset.saturating_add(buf.len() as u64);
        let (first, last) = (offset >> shift, (end - 1) >> shift);
        {
            let st = self.state.lock();
            if offset >= st.len || st.index.range(first..=last).next().is_none() {
                return Ok(Fill::Hole);
            }
        }
        let mut stored = take_buf(&STORED_BUF);
        let mut scratch = take_buf(&CHUNK_BUF);
        let r = self.writes.settled(|| {
            for chunk in first..=last {
                let cstart = chunk << shift;
                let (from, to) = (offset.max(cstart), end.min(cstart + cs));
                let dst = &mut buf[(from - offset) as usize..(to - offset) as usize];
                let Some((ext, _)) = self.fetch(chunk, &mut stored)? else {
                    dst.fill(0);
                    continue;
                };
                // The cache fills whole chunks (`fill_granule`): the extent is not needed
                // again for this chunk (a partial fill — pages of the chunk valid already —
                // fetches it again, as before).
                crate::layer::general::drop_read_below(&self.lower, ext.off..ext.off + u64::from(ext.stored));
                if from == cstart && to == cstart + cs {
                    self.decode(chunk, &ext, &stored, dst)?;
                } else {
                    scratch.clear();
                    scratch.resize(cs as usize, 0);
                    self.decode(chunk, &ext, &stored, &mut scratch)?;
                    dst.copy_from_slice(&scratch[(from - cstart) as usize..(to - cstart) as usize]);
                }
            }
            Ok(Fill::Data)
        });
        give_buf(&STORED_BUF, stored);
        give_buf(&CHUNK_BUF, scratch);
        r
    }

    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        if !self.writable {
            return Err(Self::read_only_err());
        }
        if data.is_empty() {
            return Ok(());
        }
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|&e| e <= MAX_LOGICAL)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "zstd layer: write past the largest offset"))?;
        let shift = self.chunk_shift.load(Relaxed);
        let cs = 1u64 << shift;
        for chunk in (offset >> shift)..=((end - 1) >> shift) {
            let cstart = chunk << shift;
            let (from, to) = (offset.max(cstart), end.min(cstart + cs));
            let src = &data[(from - offset) as usize..(to - offset) as usize];
            // The old bytes matter unless we cover the chunk up to its end or the file's end
            // (bytes past the logical end are zero by invariant).
            let need_old = |len: u64| from > cstart || to < (cstart + cs).min(len.max(to));
            let at = (from - cstart) as usize;
            self.update_chunk(chunk, &need_old, to, &mut |b| b[at..at + src.len()].copy_from_slice(src))?;
        }
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.state.lock().len)
    }

    /// A chunk: it is stored (and decoded) whole.
    fn fill_granule(&self) -> u64 {
        1 << self.chunk_shift.load(Relaxed)
    }

    fn set_len(&self, new: u64) -> io::Result<()> {
        if !self.writable {
            return Err(Self::read_only_err());
        }
        if new > MAX_LOGICAL {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zstd layer: length too large"));
        }
        let shift = self.chunk_shift.load(Relaxed);
        let cs = 1u64 << shift;
        let last = new >> shift;
        let tail = (new & (cs - 1)) as usize;
        // Zero the tail of the chunk holding the new end (if it stores bytes past it), so
        // that a later extension reads zeros there.
        let needs_cut = {
            let st = self.state.lock();
            new < st.len && tail != 0 && st.index.get(&last).is_some_and(|e| e.ext.data_len as usize > tail)
        };
        if needs_cut {
            self.update_chunk(last, &|_| true, 0, &mut |b| b[tail..].fill(0))?;
        }
        let mut st = self.state.lock();
        if new < st.len {
            let drop_from = new.div_ceil(cs);
            let gone: Vec<u64> = st.index.range(drop_from..).map(|(c, _)| *c).collect();
            for c in gone {
                st.install(c, None);
            }
        }
        if st.len != new {
            st.len = new;
            st.dirty = true;
        }
        Ok(())
    }

    /// The stored file's metadata below (its times): a sync of the lower file with
    /// nothing new to write is no more than that.
    fn sync_metadata(&self) -> io::Result<()> {
        self.lower.sync_all().map_err(ubc_err)
    }

    fn sync(&self) -> io::Result<()> {
        let _s = self.sync_lock.lock();
        let mut synced = false;
        if self.writable {
            synced = self.commit(true)?;
            // On a shared store, only after committing a change of this machine's (see
            // `on_shared_store`): moving extents rewrites the file.
            if (synced || !self.shared_store) && self.compact() {
                synced = self.commit(true)?;
            }
            // What the last commit freed at the end (a shrink, a compaction): given back
            // now, and made durable with one more sync, rather than at the next commit.
            let st = self.state.lock();
            if synced && self.cut_tail(&st) {
                drop(st);
                return self.lower.sync().map_err(ubc_err);
            }
        }
        // A commit ends with `lower.sync()`; a third one (each a device wait through every
        // layer below: an `fdatasync` of the host file) would make nothing more durable.
        if synced { Ok(()) } else { self.lower.sync().map_err(ubc_err) }
    }

    /// A published commit (see [`CompressPager::publish`]).
    fn write_through(&self) -> io::Result<()> {
        self.publish()
    }

    fn identity(&self) -> Option<Identity> {
        let id = self.lower.identity()?;
        Some(Identity::Named { kind: "zstd", name: format!("{:?}", Some(id)) })
    }

    fn can_punch(&self) -> bool {
        self.writable
    }

    /// Chunks the range covers whole (or up to the end of the file) become holes — out of
    /// the index, their extents freed once no commit references them; the parts of chunks
    /// at its edges are zeroed by rewriting those chunks. Bytes past the end are zeros
    /// already.
    fn punch(&self, offset: u64, len: u64) -> io::Result<bool> {
        let shift = self.chunk_shift.load(Relaxed);
        let cs = 1u64 << shift;
        let file_len = self.state.lock().len;
        let end = offset.saturating_add(len).min(file_len);
        if offset >= end {
            return Ok(true);
        }
        for chunk in (offset >> shift)..=((end - 1) >> shift) {
            let cstart = chunk << shift;
            let (from, to) = (offset.max(cstart), end.min(cstart + cs));
            if from == cstart && (to == cstart + cs || to == file_len) {
                let mut st = self.state.lock();
                if st.index.contains_key(&chunk) {
                    st.install(chunk, None);
                }
            } else if self.state.lock().index.contains_key(&chunk) {
                let (at, n) = ((from - cstart) as usize, (to - from) as usize);
                self.update_chunk(chunk, &|_| true, 0, &mut |b| b[at..at + n].fill(0))?;
            }
        }
        Ok(true)
    }

    /// Holes are the chunks not in the index (never written, punched, or all zeros), and
    /// everything past the end.
    fn seek(&self, offset: u64, what: Seek) -> io::Result<Option<u64>> {
        let shift = self.chunk_shift.load(Relaxed);
        let st = self.state.lock();
        let present = st.index.range(offset >> shift..).map(|(&c, _)| c);
        Ok(ubc::pager::seek_blocks(present, shift, st.len, offset, what))
    }

    fn is_writable(&self) -> bool {
        self.writable
    }

    fn describe(&self) -> String {
        format!("zstd over {:?}", self.lower)
    }

    fn io_mode(&self) -> IoMode {
        self.lower.stats().io_mode
    }
    fn depth(&self) -> u32 {
        self.lower.depth() + 1
    }
}

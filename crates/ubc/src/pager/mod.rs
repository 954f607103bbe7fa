//! Pagers move ranges of pages between the cache and a backing store.
//!
//! This is UBC's `VOP_GETPAGES` / `VOP_PUTPAGES` pair and Mach's external pager protocol
//! (`pager_data_request` answered with data or `pager_data_unavailable`, and
//! `pager_data_write`). The cache decides *what* to move and *when* (misses, clustering,
//! write-behind, eviction); a pager only knows *how* to reach its store.
//!
//! The trait is object safe and has no ubc-internal types in it, so layers and object
//! stores outside this crate implement it directly.

pub(crate) mod file;
pub mod host_fds;
#[cfg(feature = "testing")]
mod inject;
mod mem;
mod shm;

pub(crate) use file::Access;
pub(crate) use file::AlignedBuf;
pub use file::FilePager;
#[cfg(feature = "testing")]
pub use inject::{InjectedCounts, InjectingPager, Injector};
pub use mem::MemPager;
pub use shm::{ShmPager, StoreMemory};

use std::io;

/// What [`Pager::get_pages`] put into the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fill {
    /// The buffer holds the data (bytes past the end of the store are zero).
    Data,
    /// Mach's `pager_data_unavailable`: the whole range is a hole. The buffer was not
    /// touched; the cache zero-fills it without copying.
    Hole,
}

/// How a pager reaches its store, reported in [`Stats::io_mode`](crate::Stats::io_mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum IoMode {
    /// Not reported by the pager.
    #[default]
    Unknown,
    /// Process memory (no I/O).
    Memory,
    /// `O_DIRECT`: the kernel's page cache is bypassed, pages live once (in ubc).
    Direct,
    /// Buffered I/O through the kernel's page cache (dropped after writeback where possible).
    Buffered,
}

/// A stable identity for the stored data, so that two opens of the same backing file
/// share one cache object (one copy of each page).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Identity {
    /// A host file: device and inode number.
    HostFile { dev: u64, ino: u64 },
    /// Any other store: a name unique within its kind.
    Named { kind: &'static str, name: String },
}

/// A backing store for one file's pages.
///
/// Offsets are byte offsets in the file. The cache calls `get_pages` and `put_pages` with
/// page-aligned offsets and whole pages, except that `put_pages` is clipped at the file's
/// length (so a store never grows past the length the cache knows). Calls may come from
/// several threads at once, for different ranges; implementations must be thread-safe.
/// Errors are returned as they are: the cache adds context and decides what to retry.
#[allow(clippy::len_without_is_empty)] // `len` is a file's length; emptiness is not a question a pager answers
pub trait Pager: Send + Sync + 'static {
    /// `VOP_GETPAGES`: fill `buf` with the bytes at `offset..offset+buf.len()`.
    /// Bytes past the end of the store read as zero. May answer [`Fill::Hole`] without
    /// touching `buf` when the whole range holds no data. An error of kind
    /// [`io::ErrorKind::Interrupted`] says the stored bytes were changing underneath (a
    /// stacked layer read them beside a write below) and nothing is known to be wrong with
    /// them: a mapping's fault then faults again a moment later instead of raising SIGBUS;
    /// a read returns the error.
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill>;

    /// `VOP_PUTPAGES`: store `data` at `offset` (a cluster of contiguous dirty pages).
    /// Extends the store if it ends before `offset + data.len()`.
    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()>;

    /// NFS's `UNSTABLE` write (RFC 1813, 3.3.7): store `data` at `offset` as
    /// [`Pager::put_pages`] does, except that the store need not have it durable, nor even
    /// kept safe, before the next [`Pager::sync_fs`] of its [`Pager::sync_domain`] returns:
    /// a `sync_fs` that fails may have lost it. [`crate::Cache::sync_all`] uses it for the
    /// small files of a file system it syncs at once: a host file is written into the
    /// kernel's page cache without waiting, and the `syncfs` then writes all of them as the
    /// kernel writes its own dirty files (allocated together, merged into large requests),
    /// where a direct write per file is one request to the device each.
    ///
    /// The cache calls it only on a store that answers a sync domain, only from `sync_all`,
    /// and like NFS's client until the `COMMIT`: it keeps the pages so stored (not
    /// evictable, though clean) until that `sync_fs` has returned, marks them dirty again if
    /// it failed, and calls [`Pager::committed`] if it did not. Default: `put_pages`.
    fn put_pages_unstable(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.put_pages(offset, data)
    }

    /// The `sync_fs` that covered this store's [`Pager::put_pages_unstable`] calls returned
    /// `Ok` (or, after a failed one, this store's own `sync` did): what those calls left
    /// aside may go. A host file drops the kernel's copy of the file here (a direct
    /// `put_pages` leaves none). Default: nothing.
    fn committed(&self) {}

    /// Current length of the stored file in bytes.
    fn len(&self) -> io::Result<u64>;

    /// Truncate or extend the stored file to `len` bytes (extension reads as zeros).
    fn set_len(&self, len: u64) -> io::Result<()>;

    /// Make everything stored so far durable, and whatever reading it back needs
    /// (`fdatasync` for a host file: the data, the length, the blocks).
    fn sync(&self) -> io::Result<()>;

    /// Mach's `pager_init`: the cache made an object over this pager and hands it the
    /// requests it may make of the cache ([`PagerRequest`]: clean, flush). Called once per
    /// cached object, with the pager the object was made with, before any other call of the
    /// object's reaches it through that object. Default: nothing.
    fn init(&self, request: PagerRequest) {
        let _ = request;
    }

    /// A mapping of this file faulted on bytes `range` (whole cache pages) and the cache is
    /// about to serve it — fill, then map — holding nothing of the file yet: a fault is the
    /// one access no call of the file's own brackets, so a pager whose bytes other parties
    /// change under a token (a file shared between machines) takes that token here. The
    /// guard returned is held until the fault is resolved (its pages filled and mapped),
    /// then dropped. `store`: the mapping is shared and writable, so stores through it
    /// will not be seen one by one — the pager should give leave to write, not only to
    /// read. A layer's pager over another file passes the question down
    /// ([`crate::File::fault_guard`]). An error fails the access (`SIGBUS`), as a failed
    /// fill does. Called on one of the cache's fault threads (`CacheBuilder::fault_threads`),
    /// which serves no other fault meanwhile. Default: no guard.
    fn fault_guard(&self, range: std::ops::Range<u64>, store: bool) -> io::Result<Option<FaultGuard>> {
        let _ = (range, store);
        Ok(None)
    }

    /// Mach's `pager_data_unlock`: the cache is about to change bytes `range` of the file,
    /// which this pager write-locked ([`PagerRequest::lock`]) — a write, a writable window,
    /// a truncation or extension, or a fault of a shared writable mapping (whose stores the
    /// cache cannot see one by one, so even a read fault through such a mapping asks).
    /// Return `Ok` once the change may go ahead: the cache then forgets the lock on
    /// `range` (lock it again to be asked again). An error fails the change with it
    /// ([`crate::Error::Io`], [`PagerOp::Unlock`](crate::PagerOp::Unlock); a mapping's access
    /// gets `SIGBUS`). `range` is whole cache pages, clipped to what is locked.
    ///
    /// Called with nothing of this object's held by the calling thread except, for a write,
    /// its size lock shared (so the pager may read the cache, and may make requests of it
    /// other than `lock`, which would wait for that write). Default: `Ok` (a pager that
    /// never locks is never asked).
    fn unlock_request(&self, range: std::ops::Range<u64>) -> io::Result<()> {
        let _ = range;
        Ok(())
    }

    /// After [`Pager::sync`]: make the rest of the store's metadata durable too — what
    /// reading the data back does not need, such as its times (`fsync` after `fdatasync`,
    /// TLPI 13.3). Called by [`crate::File::sync_all`]. Default: nothing (a store without
    /// such metadata, or one whose `sync` covers it). A wrapper forwards it.
    fn sync_metadata(&self) -> io::Result<()> {
        Ok(())
    }

    /// Push everything stored so far through to the backing store, *without* making it
    /// durable: afterwards a reader of the store (another process, or this one after it was
    /// killed) finds it, as after a `write(2)` without `fsync`. A store written in place at
    /// `put_pages` (a host file, memory) has nothing to do: the default. A layer that
    /// stores into another `ubc::File` writes its own metadata and flushes that file
    /// ([`crate::File::write_through`]); `sync` stays the only promise of durability.
    fn write_through(&self) -> io::Result<()> {
        Ok(())
    }

    /// The file system whose `syncfs(2)` makes this store durable together with every other
    /// store answering the same key: [`crate::Cache::sync_all`] then syncs many such stores
    /// with one [`Pager::sync_fs`] instead of a `sync` each (one flush of the device instead
    /// of one per file). `None` (the default): `sync` is called on each. A wrapper that
    /// changes what `sync` does (injects faults, syncs a layer below) answers `None`.
    fn sync_domain(&self) -> Option<u64> {
        None
    }

    /// Make everything stored so far durable in every store of this one's
    /// [`Pager::sync_domain`] (`syncfs(2)` for a host file system). Only called on a store
    /// that answers a domain. Default: [`Pager::sync`].
    fn sync_fs(&self) -> io::Result<()> {
        self.sync()
    }

    /// A way to do what [`Pager::sync_fs`] does that holds nothing of this store (for a
    /// host file, a `syncfs` through a directory of its file system: the file itself may be
    /// removed and must not be kept open). The cache keeps one for a store it forgot before
    /// it was synced, and calls it at the next [`crate::Cache::sync_all`]. `None` (the
    /// default): such a store is not followed once forgotten.
    fn domain_syncer(&self) -> Option<DomainSyncer> {
        None
    }

    /// UBC's execute-in-place: the store's own memory, if it keeps its bytes in shared
    /// memory — byte `o` of the file at offset `o` of a tmpfs file or memfd ([`StoreMemory`]).
    /// A cache built with [`CacheBuilder::xip`](crate::CacheBuilder::xip) on (the default)
    /// whose pages are shmem pages (not hugetlb) then serves the file *from* those pages:
    /// reads copy out of them, writes copy into them, windows and mappings map them; it makes
    /// no copy, charges nothing to its budget, never evicts them, and
    /// [`Stats::resident_bytes`](crate::Stats::resident_bytes) stays 0 (the pages are counted
    /// in [`Stats::xip_bytes`](crate::Stats::xip_bytes)).
    ///
    /// What the store must do then: keep its bytes there (`get_pages` and `put_pages` are no
    /// longer called for the file; a write reaches the store when it is copied, and a
    /// writeback only marks pages clean), answer `len` with the length, and apply `set_len`
    /// and `punch` to that memory at once (the cache never frees the store's pages itself:
    /// a truncation is the store's `set_len`). Asked once per cached object, when it is made;
    /// the default (`None`) keeps the usual copy. A wrapper that must see the transfers (one
    /// that injects faults, encrypts, counts) answers `None`.
    fn memory(&self) -> Option<StoreMemory> {
        None
    }

    /// Identity of the stored data, if two pagers can reach the same data.
    fn identity(&self) -> Option<Identity> {
        None
    }

    /// Whether `put_pages` and `set_len` may be called.
    fn is_writable(&self) -> bool {
        true
    }

    /// A short human description for error messages ("file /data/a", "memory").
    fn describe(&self) -> String;

    /// How many pagers of the same cache lie below this one: 0 for a pager that reaches its
    /// store without the cache (a host file, memory, an object store); a layer whose store
    /// is a file of the cache returns that file's [`File::depth`](crate::File::depth) + 1.
    ///
    /// The cache relies on it to stay live: background I/O for a file runs in the pool of
    /// its depth, and reclaim inside a pager call writes back only files of lower depth
    /// (see [`PagerScope`] and the lock order in [`order`](crate::order)). A layer (or a
    /// wrapper: forward the inner pager's depth) that reports a wrong depth may deadlock;
    /// debug builds catch it as a lock-order violation.
    fn depth(&self) -> u32 {
        0
    }

    /// The unit, in bytes, this pager makes pages from (0: any page). A pager that decodes
    /// whole units — a compressed chunk — pays for a unit on every call that asks for part
    /// of it, and a unit filled in two calls is fetched and decoded twice. The cache fills
    /// a demand miss, and ends a read-ahead window, on such boundaries (pages already valid
    /// stay as they are) — as Linux gives a mapping whose block is larger than a page a
    /// minimum folio order. A power of two; anything else counts as 0. A wrapper forwards
    /// its inner pager's.
    fn fill_granule(&self) -> u64 {
        0
    }

    /// How this pager reaches its store (for statistics).
    fn io_mode(&self) -> IoMode {
        IoMode::Unknown
    }

    /// Whether [`Pager::punch`] may deallocate: if not, the cache punches a hole by writing
    /// zeros, and never calls it.
    fn can_punch(&self) -> bool {
        false
    }

    /// Deallocate bytes `offset..offset+len` of the store, which then read as zeros
    /// (`fallocate(PUNCH_HOLE | KEEP_SIZE)`); the length does not change. Returns `false`,
    /// having done nothing, if the store turns out unable to (the cache then writes zeros).
    /// The cache calls it only if [`Pager::can_punch`], with whole pages, with no
    /// writeback of the range in flight.
    fn punch(&self, offset: u64, len: u64) -> io::Result<bool> {
        let _ = (offset, len);
        Ok(false)
    }

    /// Reserve space for bytes `offset..offset+len` so that writing them later cannot fail
    /// for want of space (`fallocate(KEEP_SIZE)`: the length does not change; the cache
    /// extends it itself). A store that allocates nothing ahead does nothing.
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        let _ = (offset, len);
        Ok(())
    }

    /// Where the store's data and holes lie (`lseek(SEEK_DATA / SEEK_HOLE)`) from `offset`
    /// on: with [`Seek::Data`], the first offset at or after `offset` that holds data, or
    /// `None` if none does before the store's end; with [`Seek::Hole`], the first offset at
    /// or after `offset` in a hole, the store's end counting as one. A store that does not
    /// know its holes reports everything before its end as data (the default).
    fn seek(&self, offset: u64, what: Seek) -> io::Result<Option<u64>> {
        let len = self.len()?;
        Ok(match what {
            Seek::Data => (offset < len).then_some(offset),
            Seek::Hole => Some(offset.max(len)),
        })
    }
}

/// Makes a whole sync domain durable (see [`Pager::domain_syncer`]).
pub type DomainSyncer = std::sync::Arc<dyn Fn() -> io::Result<()> + Send + Sync>;

/// What [`Pager::seek`] looks for ([`File::seek_data`](crate::File::seek_data) and [`File::seek_hole`](crate::File::seek_hole) ask for each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seek {
    /// The next byte that holds data (`SEEK_DATA`).
    Data,
    /// The next byte in a hole (`SEEK_HOLE`); the end of the file is one.
    Hole,
}

/// [`Pager::seek`] for a store that keeps data in blocks of `1 << shift` bytes and knows
/// which are present (absent blocks are holes): `present` lists, in ascending order, the
/// present blocks from `offset`'s on; `len` is the store's length (past it all is hole).
pub fn seek_blocks(
    present: impl IntoIterator<Item = u64>,
    shift: u32,
    len: u64,
    offset: u64,
    what: Seek,
) -> Option<u64> {
    if offset >= len {
        return match what {
            Seek::Data => None,
            Seek::Hole => Some(offset),
        };
    }
    let first = offset >> shift;
    let mut present = present.into_iter();
    match what {
        Seek::Data => present.next().map(|b| (b << shift).max(offset)).filter(|&d| d < len),
        Seek::Hole => {
            // The first block at or after `first` that is not present.
            let mut next = first;
            for b in present {
                if b != next {
                    break;
                }
                next += 1;
            }
            Some((next << shift).max(offset).min(len))
        }
    }
}

/// The requests a pager may make of the cache about its object (Mach's pager request port:
/// `pager_clean_request`, `pager_flush_request`, `pager_data_lock`), handed to it by
/// [`Pager::init`]. It does
/// not keep the object cached: once the cache lets the object go, requests do nothing and
/// return `Ok`. For a store whose data another party changes or needs — another machine
/// holding a token, a backup reading below — the pager's own thread calls them when told.
///
/// Precondition of every call: the calling thread is not inside a call the cache made into
/// this pager (it would wait for pages that call holds; debug builds check the lock order).
#[derive(Clone)]
pub struct PagerRequest {
    target: std::sync::Arc<dyn RequestTarget>,
}

/// What a pager gives the cache to hold while one fault of a mapping is served
/// ([`Pager::fault_guard`]): dropped once the fault is resolved.
pub struct FaultGuard(#[allow(dead_code)] Box<dyn Send>);

impl FaultGuard {
    /// A guard holding `held` (a token's pin, a lock guard) until the fault is resolved.
    pub fn new<T: Send + 'static>(held: T) -> FaultGuard {
        FaultGuard(Box::new(held))
    }
}

/// What a [`PagerRequest`] reaches: the object (`object/holders.rs` implements it on a
/// reference that does not keep the object; the pager sits below objects and reaches them
/// only through this).
pub(crate) trait RequestTarget: Send + Sync {
    fn clean(&self, from: u64, to: u64) -> crate::Result<()>;
    fn flush(&self, from: u64, to: u64, reload: bool) -> crate::Result<()>;
    fn cached(&self) -> bool;
    fn lock(&self, from: u64, to: u64) -> crate::Result<()>;
    fn unlock(&self, from: u64, to: u64);
}

impl PagerRequest {
    pub(crate) fn new(target: std::sync::Arc<dyn RequestTarget>) -> PagerRequest {
        PagerRequest { target }
    }

    /// `pager_clean_request`: write the cached changes of bytes `range` back to the pager
    /// (stores through mappings included) and wait; the cache keeps using its pages.
    pub fn clean(&self, range: std::ops::Range<u64>) -> crate::Result<()> {
        self.target.clean(range.start, range.end)
    }

    /// `pager_flush_request`: clean bytes `range`, then destroy the cached copy (its pages
    /// leave the cache and every mapping; the next access asks the pager). The length the
    /// cache knows stays ([`PagerRequest::flush_reload`] asks again).
    pub fn flush(&self, range: std::ops::Range<u64>) -> crate::Result<()> {
        self.target.flush(range.start, range.end, false)
    }

    /// [`PagerRequest::flush`], and the file's length asked of the pager again.
    pub fn flush_reload(&self, range: std::ops::Range<u64>) -> crate::Result<()> {
        self.target.flush(range.start, range.end, true)
    }

    /// `pager_data_lock` (write access): from now on the cache asks this pager
    /// ([`Pager::unlock_request`]) before it changes any byte of `range` — through a write,
    /// a writable window, `set_len`, or a shared writable mapping — and keeps reading its
    /// cached pages meanwhile. Returns once writes in progress on the file have finished and
    /// the stores already made through mappings are found (marked dirty: a
    /// [`PagerRequest::clean`] after the lock writes them back, and no store lands after
    /// it). Whole cache pages: `range` is widened to them.
    pub fn lock(&self, range: std::ops::Range<u64>) -> crate::Result<()> {
        self.target.lock(range.start, range.end)
    }

    /// Lift a lock on `range` without being asked (the pager gives leave to write).
    pub fn unlock(&self, range: std::ops::Range<u64>) {
        self.target.unlock(range.start, range.end)
    }

    /// Whether the cache still holds the object these requests are about.
    pub fn is_cached(&self) -> bool {
        self.target.cached()
    }
}

impl std::fmt::Debug for PagerRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagerRequest").field("cached", &self.is_cached()).finish()
    }
}

/// Marks the current thread, for its lifetime, as working for a pager of the given depth
/// (see [`Pager::depth`]): the cache enters one around every pager
/// call it makes, and a layer enters one itself when it holds its own locks and uses its
/// lower file outside such a call (a metadata flush requested from outside the cache).
/// It holds the rank `Pager(depth)` of the lock order (`order.rs`).
///
/// Inside a scope the thread is *cleaning* memory for the layer above, perhaps holding
/// that layer's locks, so the cache, on this thread:
/// * does not throttle its writes at the dirty limit nor make it write back other files
///   there (Linux exempts loop devices and FUSE servers the same way: `PF_LOCAL_THROTTLE`);
/// * when it must reclaim memory, writes back only files of *lower* depth than the scope —
///   never the layer's own file or one above it, whose writeback would need the locks this
///   thread holds (an aead `put_pages` holds its state lock while it writes its lower
///   file; reclaim there writing back that same aead file would wait for the lock forever).
///   Linux's `GFP_NOFS` / `memalloc_nofs_save` is the same rule, and it is
///   the lock order's rule for any thread holding `Pager(depth)`;
/// * may use the memory reserve that other allocations leave alone (`PF_MEMALLOC`): the
///   cache full of the upper layer's dirty pages must not stop the lower writes that are
///   the only way to clean them.
///
/// Scopes nest; the lowest depth wins.
#[must_use = "the scope ends when this is dropped"]
pub struct PagerScope {
    _rank: crate::order::Hold,
}

impl PagerScope {
    /// Enter a scope for a pager of `depth` (a layer over a file of depth `d` has `d + 1`).
    /// => the thread holds nothing that ranks after `Pager(depth)` (debug builds check).
    pub fn enter(depth: u32) -> PagerScope {
        PagerScope { _rank: crate::order::hold(crate::order::Rank::pager(depth)) }
    }
}

impl std::fmt::Debug for PagerScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagerScope").finish_non_exhaustive()
    }
}

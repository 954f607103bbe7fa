//! Objects: one cached file (NetBSD's `uvm_object` / vnode). An object owns its page table,
//! the memfd holding its pages and its pager, and implements the data paths every front
//! end uses, one mechanism per file:
//!
//! * `fill.rs` — fills from the pager and the read path;
//! * `readahead.rs` — sequential detection and asynchronous read-ahead;
//! * `write.rs` — the write path and writable windows;
//! * `truncate.rs` — `set_len`, dropping pages, invalidation;
//! * `holes.rs` — punching holes, reserving space, finding data and holes;
//! * `writeback.rs` — writing dirty pages to the pager, `clean`, `sync`;
//! * `evict.rs` — releasing pages the replacement policy took;
//! * `mapped.rs` — what memory mappings need (found stores, fault pins);
//! * `holders.rs` — counted holds of work apart from the handles (I/O jobs, the flusher),
//!   which the last close of a file that left the cache waits for.
//!
//! This file holds the object itself, its accessors and the one way to call its pager.
//!
//! Locking, from outside in:
//! * `size_lock` — shared by writers, exclusive for `set_len` (like `i_rwsem` for truncate);
//!   readers never take it.
//! * page state words (see `page/state.rs`) — per page, lock-free CAS transitions. Threads
//!   that hold several pages took them in ascending order.
//! * the cache's policy mutex — only on fills, truncation and reclaim, never on hits.
//!
//! An object draws on the shared [`Resources`] (budget, policy, windows, I/O, dirty
//! accounting) and never on the cache that keeps the registry of objects: where a resource
//! needs other objects (reclaim), it reaches them through the cache's `Reclaim` hook.

use crate::Advice;
use crate::error::{Error, PagerOp, Result};
use crate::evict::{Admission, EvictionPolicy, NO_SLOT, PageKey};
use crate::map::{Holes, UserMap};
use crate::memfd::Memory;
use crate::page::state::{self, Filled, IfHeld, Pin, WriteLock, Written};
use crate::page::table::{Chunk, PageTable, WIN_RETIRING};
use crate::pager::{Fill, Identity, Pager};
use crate::resources::{DirtyWriter, Resources};
use crate::stats::{Counters, Stats, bump};
use parking_lot::{Mutex, RwLock};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, OnceLock, Weak};

mod advice;
mod datalock;
mod evict;
mod fill;
mod holders;
mod holes;
mod loan;
mod mapped;
mod readahead;
mod truncate;
mod write;
mod writeback;

pub(crate) use fill::Publish;
pub(crate) use holders::{ObjectRef, WorkHold};
pub(crate) use loan::Lent;
pub(crate) use mapped::Harvest;
pub use truncate::Length;
use write::Held;
pub(crate) use writeback::Pass;

/// Largest file length ubc supports: 2^63 - 64 KiB (offsets are `i64` in POSIX, and a
/// memfd holds at most 2^63 - 1 bytes), or less under a finite `RLIMIT_FSIZE` (see
/// `memfd::max_size`).
#[inline]
pub(crate) fn max_end() -> u64 {
    crate::memfd::max_size()
}

pub(crate) use crate::memfd::checked_end;

/// What makes two opens reach the same cached object: the data's identity if the pager
/// has one, else the pager instance itself (its address: the object keeps the pager alive,
/// so the address cannot be reused while the entry exists).
///
/// Every cached object carries its key: a host file's is kept inline (24 bytes), the rarer
/// named identity boxed (an `Identity` is 40 bytes).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum ObjectKey {
    HostFile { dev: u64, ino: u64 },
    Named(Box<Identity>),
    Instance(usize),
}

impl ObjectKey {
    pub(crate) fn of(pager: &Arc<dyn Pager>) -> ObjectKey {
        match pager.identity() {
            Some(i) => ObjectKey::data(i),
            None => ObjectKey::Instance(Arc::as_ptr(pager) as *const () as usize),
        }
    }

    /// The key of the data with `identity`.
    pub(crate) fn data(identity: Identity) -> ObjectKey {
        match identity {
            Identity::HostFile { dev, ino } => ObjectKey::HostFile { dev, ino },
            named => ObjectKey::Named(Box::new(named)),
        }
    }
}

/// The user mappings of an object (`File::map`): none for nearly every object, so the list
/// is made with the first (8 bytes in each object instead of a 24-byte `Vec`).
#[derive(Default)]
#[allow(clippy::box_collection)] // the point: one pointer in the object, the Vec's 24 bytes apart
pub(crate) struct MapList(Option<Box<Vec<Arc<UserMap>>>>);

impl MapList {
    pub(crate) fn iter(&self) -> std::slice::Iter<'_, Arc<UserMap>> {
        self.0.as_deref().map_or([].iter(), |v| v.iter())
    }

    pub(crate) fn push(&mut self, m: Arc<UserMap>) {
        self.0.get_or_insert_with(Default::default).push(m);
    }

    /// Remove `m`; the list goes with its last mapping.
    pub(crate) fn remove(&mut self, m: &Arc<UserMap>) {
        if let Some(v) = &mut self.0 {
            v.retain(|x| !Arc::ptr_eq(x, m));
            if v.is_empty() {
                self.0 = None;
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |v| v.len())
    }
}

/// Told of the byte ranges of a file that changed, and whether by stores through a
/// mapping (see [`crate::File::watch`]).
pub type Watcher = std::sync::Arc<dyn Fn(std::ops::Range<u64>, bool) + Send + Sync>;

/// Called before bytes of a file are written back to its pager, with their byte range;
/// returns when they may go (see [`crate::File::set_writeback_hook`]). An error fails that
/// writeback: the pages stay dirty and the error is reported as a writeback's.
pub type WritebackHook = std::sync::Arc<dyn Fn(std::ops::Range<u64>) -> std::io::Result<()> + Send + Sync>;

pub(crate) struct Object {
    pub(crate) id: u64,
    /// Ourselves, for handing work to I/O threads.
    pub(crate) me: Weak<Object>,
    /// Holds of work apart from the handles (see `holders.rs`).
    pub(crate) holders: Arc<holders::Holders>,
    /// Read-ahead streams of this object (see `readahead.rs`); a leaf lock.
    /// Made at the first read-ahead decision and dropped when the last handle closes (392
    /// bytes an idle cached file need not carry).
    pub(crate) ra_streams: Mutex<Option<Box<readahead::Streams>>>,
    pub(crate) res: Arc<Resources>,
    pager: RwLock<Arc<dyn Pager>>,
    pub(crate) table: PageTable,
    /// The memory holding this object's pages (made on first use; see `memfd.rs`), or the
    /// store's own (XIP, set when the object is made).
    memory: OnceLock<ObjectMemory>,
    memory_init: Mutex<()>,
    /// Logical length: the cache's, authoritative while the object lives.
    len: AtomicU64,
    pub(crate) size_lock: RwLock<()>,
    /// Open `File` handles.
    pub(crate) handles: AtomicU32,
    /// Valid pages of this object.
    resident: AtomicU64,
    /// Pages with the DIRTY bit.
    dirty: AtomicU64,
    // `resident` and `dirty` (and the flusher's unclean count) are gauges: one thread counts
    // a page in, another may count it out. They stay single atomics, and a page is counted in
    // *before* the state change that lets anyone else see it valid or dirty (or while its
    // counter holds it WRITING, which no one else can act on), and counted out only *after*
    // the state change that takes it out. The decrement then happens-after its increment
    // (through the page's state word), so in the counter's modification order every
    // decrement follows the increment it pays for: a gauge read at any moment is at least
    // the pages truly in that state, never below zero. (Counted after the state change, a
    // writeback or an eviction on another thread could uncount a page first: `dirty` and
    // `resident` wrapped below zero and `Cache::stats` overflowed summing them.)
    /// When the object last went from clean to dirty (flusher clock, ms; see writeback.rs).
    dirtied_at: AtomicU64,
    /// The store may hold something its last successful sync did not make durable, or
    /// differ in length from ours with no page dirty: set after every call that changes
    /// the store (and by a writeback before it counts its pages out), when the length grows, and for a writable pager at the start
    /// (the first sync always goes to the pager); cleared as a sync hands over to the
    /// pager's own (see `writeback.rs`, "Syncing what changed").
    unsynced: AtomicBool,
    /// Passes of `Cache::sync_all` whose unstable writes of this object wait for their
    /// file system's sync (see `writeback.rs`, "Unstable writes"): while any does, no page
    /// of the object is evicted.
    uncommitted: AtomicU32,
    pub(crate) counters: Counters,
    /// The registry key this object is filed under.
    pub(crate) key: ObjectKey,
    /// The pager's depth (the highest any of its pagers reported): reclaim inside a pager
    /// call writes back only objects of lower depth.
    depth: AtomicU32,
    /// User mappings of this object (`File::map`), and how many there are (checked on every
    /// fill, so kept apart from the lock).
    pub(crate) maps: RwLock<MapList>,
    pub(crate) nmaps: AtomicU32,
    /// Serializes finding stores through mappings (a scan takes the written state and
    /// re-protects): eviction holds it from zapping its pages to punching them, so a store
    /// found by another scan meanwhile is never lost with the page.
    scan_lock: Mutex<()>,
    /// Writeback failures, reported to every handle once (see `errseq.rs`).
    pub(crate) wb_errors: crate::errseq::WbErrors,
    /// Told of every change to the bytes or the length (see [`crate::File::watch`]).
    /// (In a `OnceBox`: one thin pointer in every object, where the watcher is a wide one
    /// and a `OnceLock` of a box two words.)
    watcher: once_cell::race::OnceBox<Watcher>,
    /// Called before each writeback of this object's pages (see
    /// [`crate::File::set_writeback_hook`]); replaceable, hence the lock (one thin pointer
    /// in objects that never had a hook).
    writeback_hook: once_cell::race::OnceBox<RwLock<Option<WritebackHook>>>,
}

impl Object {
    /// A new object over `pager`, of length `len` if the caller just learned it from the
    /// store (else the pager is asked).
    pub(crate) fn new(
        id: u64,
        res: Arc<Resources>,
        pager: Arc<dyn Pager>,
        key: ObjectKey,
        len: Option<u64>,
    ) -> Result<Arc<Object>> {
        let len = match len {
            Some(len) => len,
            None => pager.len().map_err(|e| Error::Io {
                op: PagerOp::Len,
                offset: 0,
                object: pager.describe(),
                source: e,
            })?,
        };
        let writable = pager.is_writable();
        let memory = OnceLock::new();
        if let Some(m) = pager.memory().filter(|_| res.xip) {
            let _ = memory.set(ObjectMemory::Store(m.0));
        }
        Ok(Arc::new_cyclic(|me| Object {
            id,
            me: me.clone(),
            holders: Default::default(),
            ra_streams: Mutex::new(None),
            table: PageTable::new(1 << res.geo.chunk_shift),
            key,
            depth: AtomicU32::new(pager.depth()),
            pager: RwLock::new(pager),
            res,
            memory,
            memory_init: Mutex::new(()),
            len: AtomicU64::new(len),
            size_lock: RwLock::new(()),
            handles: AtomicU32::new(0),
            resident: AtomicU64::new(0),
            dirty: AtomicU64::new(0),
            dirtied_at: AtomicU64::new(0),
            unsynced: AtomicBool::new(writable),
            uncommitted: AtomicU32::new(0),
            counters: Counters::default(),
            maps: RwLock::new(MapList::default()),
            nmaps: AtomicU32::new(0),
            scan_lock: Mutex::new(()),
            wb_errors: Default::default(),
            watcher: once_cell::race::OnceBox::new(),
            writeback_hook: once_cell::race::OnceBox::new(),
        }))
    }

    /// Tell the watcher, if any, that bytes `range` (or, reaching `u64::MAX`, the length)
    /// changed (`mapped`: by stores through a mapping). Called after the change, maybe with
    /// locks of the object held: the watcher must not block or call back into the cache.
    pub(crate) fn changed(&self, range: std::ops::Range<u64>, mapped: bool) {
        if let Some(w) = self.watcher.get()
            && range.start < range.end
        {
            w(range, mapped);
        }
    }

    /// Set the watcher; false if one was set already (it stays).
    pub(crate) fn set_watcher(&self, w: Watcher) -> bool {
        self.watcher.set(Box::new(w)).is_ok()
    }

    /// Set (or with `None` remove) the hook called before each writeback.
    pub(crate) fn set_writeback_hook(&self, hook: Option<WritebackHook>) {
        *self.writeback_hook.get_or_init(|| Box::new(RwLock::new(None))).write() = hook;
    }

    /// The hook called before each writeback, if any.
    pub(crate) fn writeback_hook(&self) -> Option<WritebackHook> {
        self.writeback_hook.get().and_then(|h| h.read().clone())
    }

    pub(crate) fn pager(&self) -> Arc<dyn Pager> {
        self.pager.read().clone()
    }

    /// Replace a read-only pager by a writable one for the same data (a later writable open).
    pub(crate) fn upgrade_pager(&self, pager: Arc<dyn Pager>) {
        let mut p = self.pager.write();
        self.depth.fetch_max(pager.depth(), SeqCst);
        self.mark_unsynced();
        if !p.is_writable() && pager.is_writable() {
            *p = pager;
        }
    }

    /// `size_lock` shared (writers, the stored-length fix-up of `sync`), its rank held.
    fn size_shared(&self) -> SizeGuard<parking_lot::RwLockReadGuard<'_, ()>> {
        let rank = crate::order::hold(crate::order::Rank::size(self.depth()));
        SizeGuard { _lock: self.size_lock.read(), _rank: rank }
    }

    /// `size_lock` exclusive (truncation, invalidation), its rank held.
    fn size_exclusive(&self) -> SizeGuard<parking_lot::RwLockWriteGuard<'_, ()>> {
        let rank = crate::order::hold(crate::order::Rank::size(self.depth()));
        SizeGuard { _lock: self.size_lock.write(), _rank: rank }
    }

    /// How many pagers of this cache lie below this object's (see [`Pager::depth`]).
    pub(crate) fn depth(&self) -> u32 {
        self.depth.load(Relaxed)
    }

    /// What the object is, for messages: its pager's description (made when asked, not
    /// kept: every cached object would carry the string).
    pub(crate) fn describe(&self) -> String {
        self.pager().describe()
    }

    #[inline]
    pub(crate) fn len(&self) -> u64 {
        self.len.load(SeqCst)
    }

    pub(crate) fn resident_pages(&self) -> u64 {
        self.resident.load(Relaxed)
    }

    pub(crate) fn dirty_pages(&self) -> u64 {
        self.dirty.load(Relaxed)
    }

    pub(crate) fn dirtied_at(&self) -> u64 {
        self.dirtied_at.load(Relaxed)
    }

    pub(crate) fn set_dirtied_at(&self, ms: u64) {
        self.dirtied_at.store(ms, Relaxed);
    }

    /// `n` pages got the DIRTY bit whose unclean slots their writer reserved.
    fn publish_dirtied(&self, n: u64) {
        self.res.dirty.publish(n);
        self.note_dirtied(n);
    }

    /// `n` pages get the DIRTY bit (already counted unclean: a failed writeback). Called
    /// before the bit is set, unless the caller holds the pages WRITING (see `dirty`).
    fn note_dirtied(&self, n: u64) {
        if self.dirty.fetch_add(n, Relaxed) == 0 {
            self.dirtied_at.store(self.res.dirty.now_ms(), Relaxed);
        }
    }

    /// Memory held by this object's own memfd (its pages past `memfd::SLICE`); the pages in
    /// its slice are counted with the cache's arena.
    pub(crate) fn own_allocated_bytes(&self) -> u64 {
        match self.memory.get() {
            Some(ObjectMemory::Own(m)) => m.own_allocated_bytes(),
            _ => 0,
        }
    }

    pub(crate) fn stats(&self) -> Stats {
        let mut s = self.counters.snapshot();
        let valid = self.resident_pages() << self.res.geo.page_shift;
        if self.xip() {
            s.xip_bytes = valid;
        } else {
            s.resident_bytes = valid;
        }
        s.dirty_bytes = self.dirty_pages() << self.res.geo.page_shift;
        s.io_mode = self.pager.read().io_mode();
        s
    }

    fn memory(&self) -> Result<&Memory> {
        crate::memfd::get_or_try_init(&self.memory, &self.memory_init, || {
            Memory::new(&self.res.arena).map(ObjectMemory::Own)
        })
        .map(|m| &**m)
    }

    // Execute in place. UBC's planned work (Silvers, conclusions): "Adding support for "XIP"
    // (eXecute In Place). This will allow zero-copy access to filesystem images stored in
    // flash roms or other memory-mapped storage devices." Here the memory-mapped storage is
    // a store kept in shared memory (`Pager::memory`). An XIP object keeps the whole page machinery — page
    // states, pins, writers, dirty bits, windows, loans, locks, mappings and their faults —
    // over memory that is the store itself, so every path and every coherence rule stays the
    // same, and changes only what is about *owning* the memory:
    // * a fill copies nothing (`fill_locked`): the bytes are there;
    // * no page is charged to the budget nor admitted to the replacement policy (`charge`,
    //   `publish_filled`), so the page daemon never picks one; closing the file forgets its
    //   pages' states but frees no memory;
    // * the cache never frees (punches) the memory (`free_memory`): dropping a page forgets its
    //   state; truncation and hole punching are the store's (`set_len`, `punch`), which it
    //   applies to the memory at once;
    // * a writeback writes nothing (`write_run`): the write reached the store when it was
    //   copied; a write that extends the file extends the store first (`xip_extend`);
    // * `Stats::resident_bytes` stays 0; the valid pages are `Stats::xip_bytes`.

    /// Execute-in-place: the pages are the store's own memory (`Pager::memory`, set when the
    /// object was made). They are not filled, written back, charged to the budget, known to
    /// the replacement policy nor freed by the cache.
    #[inline]
    pub(crate) fn xip(&self) -> bool {
        matches!(self.memory.get(), Some(ObjectMemory::Store(_)))
    }

    /// Charge `n` pages to the budget (`Resources::reserve`, which may reclaim): nothing for
    /// XIP pages.
    fn charge(&self, n: u64) -> Result<()> {
        if self.xip() { Ok(()) } else { self.res.reserve(n) }
    }

    /// `charge` without reclaiming (`Resources::try_reserve`).
    fn try_charge(&self, n: u64) -> Result<()> {
        if self.xip() { Ok(()) } else { self.res.try_reserve(n) }
    }

    /// Give back `n` charged pages.
    fn uncharge(&self, n: u64) {
        if !self.xip() {
            self.res.unreserve(n);
        }
    }

    /// Free the memory of pages `offset..offset+len` that left the cache: nothing for XIP
    /// (the memory is the store's data).
    fn free_memory(&self, offset: u64, len: u64) -> Result<()> {
        match self.memory.get() {
            Some(ObjectMemory::Own(m)) => m.punch(offset, len),
            _ => Ok(()),
        }
    }

    /// XIP: make the store at least `end` long before a write or a writable window reaches
    /// past the file's end (a touch past a store file's end through a window would be
    /// `SIGBUS`), as a writeback extends the store for other objects. Once per write, before
    /// its pages are copied: a write that fails part-way leaves the store longer, with zeros,
    /// as an extension by `set_len` would. => size_lock held shared (no truncation runs).
    fn xip_extend(&self, end: u64) -> Result<()> {
        if !self.xip() || end <= self.len() {
            return Ok(());
        }
        // The memory's lock (its memory was set when the object was made, so it guards
        // nothing else): two writers extending at once must not shrink the store.
        let _g = self.memory_init.lock();
        let stored = self.call_pager(PagerOp::Len, 0, |p| p.len())?;
        if stored < end {
            self.call_pager(PagerOp::SetLen, end, |p| p.set_len(end))?;
        }
        Ok(())
    }

    fn io_err(&self, op: PagerOp, offset: u64, source: std::io::Error) -> Error {
        Error::Io { op, offset, object: self.describe(), source }
    }

    /// Call the pager (every call after the object is made goes through here). The call
    /// runs in a [`PagerScope`](crate::pager::PagerScope) of this object's depth: a layer's
    /// pager writes its lower file of the same cache, maybe holding a lock that writeback of
    /// its own object needs (an aead `set_len` or `put_pages` holds its state lock), so that
    /// write must not wait at the dirty limit nor reclaim by writing back this object or one
    /// above it: either would wait for that lock. A failure comes back with `op`, `offset`
    /// and the object; `f` sees the raw error first (to record it, see `errseq.rs`).
    fn call_pager<T>(&self, op: PagerOp, offset: u64, f: impl FnOnce(&dyn Pager) -> std::io::Result<T>) -> Result<T> {
        let pager = self.pager();
        let _in = crate::pager::PagerScope::enter(self.depth());
        let r = f(&*pager).map_err(|e| self.io_err(op, offset, e));
        if op.changes_store() {
            // News to the next sync, marked once the change is made: a sync that cleared the
            // mark meanwhile syncs the pager after clearing it, so it covers the change too.
            // (A writeback also marks before it counts its pages out: `write_run`.)
            self.mark_unsynced();
        }
        r
    }

    /// The whole pages covering bytes `from..to` (empty when `to <= from`).
    pub(crate) fn pages_of(&self, from: u64, to: u64) -> std::ops::Range<u64> {
        let ps = self.ps();
        (from >> ps)..to.div_ceil(1 << ps).max(from >> ps)
    }

    #[inline]
    pub(crate) fn ps(&self) -> u32 {
        self.res.geo.page_shift
    }

    pub(crate) fn page_shift(&self) -> u32 {
        self.res.geo.page_shift
    }

    /// The memory holding this object's pages (made on first use).
    pub(crate) fn memory_for_map(&self) -> Result<&Memory> {
        self.memory()
    }

    /// Allocate (zeroed) memfd memory for `offset..offset+len` of a valid page that is a hole
    /// (counted resident, never written), so it can be mapped into a user mapping.
    /// => caller holds the page.
    pub(crate) fn materialize(&self, offset: u64, len: u64) {
        if let Ok(m) = self.memory() {
            let _ = m.allocate(offset, len);
        }
    }

    /// Chunk index and slot of a page.
    #[inline]
    pub(crate) fn locate(&self, page: u64) -> (u64, usize) {
        let cs = self.res.geo.chunk_shift;
        (page >> cs, (page & ((1 << cs) - 1)) as usize)
    }

    /// Byte offset of the start of `chunk` in the file (and the memfd).
    #[inline]
    fn chunk_offset(&self, chunk: &Chunk) -> u64 {
        chunk.index << (self.res.geo.chunk_shift + self.ps())
    }

    fn key(&self, page: u64) -> PageKey {
        PageKey { object: self.id, index: page }
    }

    /// Tell the policy that page `page` (of `chunk`) is valid, and keep the slot it gives.
    /// Preconditions: `pol` is the cache's policy, locked; the page is held (being filled, or
    /// locked for eviction and kept back) and not known to the policy.
    fn policy_admit(&self, pol: &mut dyn EvictionPolicy, chunk: &Chunk, page: u64, admission: Admission) {
        let slot = pol.insert(self.key(page), admission);
        chunk.pages.slot_at(self.locate(page).1).store(slot, Relaxed);
    }

    /// Tell the policy that page `page` (of `chunk`) left the cache. Preconditions: `pol` is
    /// the cache's policy, locked; the page is locked for drop or eviction, so it cannot be
    /// admitted again meanwhile. If the policy forgot the page already (a victim search found
    /// it gone), the kept slot no longer holds this key and the policy ignores it.
    pub(crate) fn policy_forget(&self, pol: &mut dyn EvictionPolicy, chunk: &Chunk, page: u64) {
        let slot = chunk.pages.slot_at(self.locate(page).1).swap(NO_SLOT, Relaxed);
        pol.remove(slot, self.key(page));
    }

    /// Whether a copy to or from `chunk`'s pages goes by `pread`/`pwrite` on the memfd
    /// rather than through a window: while the chunk has no window, the whole file fits in
    /// one chunk, and the chunk has been copied fewer than [`COLD_COPIES`] times so. A
    /// window costs an `mmap`, a page fault per page touched and, when it is retired or its
    /// object freed, an `munmap` whose TLB shootdown interrupts every CPU running the
    /// process — for a small file touched a few times, most of the work: opening thousands
    /// of 4 KiB files through a `dir | aead | zstd` mount spent 16 % of the daemon's time
    /// in those interrupts (`perf`: `smp_call_function_many_cond`), three windows per file.
    /// A file copied more often than that (1-byte `read_at`s: a system call each would be
    /// 25× slower than a copy through a window, `tlpi_copy_1b`) gets its window; so does a
    /// larger file (its copies repeat over the same mapping), and a chunk mapped already
    /// (a `Window` guard made one) is used. Both ways reach the same memfd pages, so the
    /// choice is the copier's own business.
    /// hugetlb memory has no `write`: its copies always go through a window.
    /// A store's own file (XIP of a host file) is always copied by system call: its length is
    /// the file's, and another process may shorten it under a window (`SIGBUS`).
    fn by_syscall(&self, chunk: &Chunk) -> bool {
        if let Some(ObjectMemory::Store(m)) = self.memory.get()
            && m.is_store_file()
        {
            return true;
        }
        !self.res.arena.is_hugetlb()
            && chunk.window.load(SeqCst) <= WIN_RETIRING
            && self.len() <= 1 << (self.res.geo.chunk_shift + self.ps())
            && chunk.cold_copies.load(Relaxed) < COLD_COPIES
            && chunk.cold_copies.fetch_add(1, Relaxed) < COLD_COPIES
    }

    /// The address of file byte `pos` in `chunk`'s window, mapping one if needed.
    /// => caller holds a page of `chunk` and touches only pages it holds (see `window.rs`).
    fn window_at(&self, chunk: &Chunk, memory: &Memory, pos: u64) -> Result<*mut u8> {
        let win = self.res.windows.address(chunk, memory)?;
        // SAFETY: the window maps the whole chunk, and `pos` lies in it.
        Ok(unsafe { win.add((pos - self.chunk_offset(chunk)) as usize) })
    }

    /// Copy the cached bytes at `pos..pos + dst.len()` (within `chunk`) into `dst`.
    /// => caller holds the pages (pinned, BUSY, WRITING or WRITEBACK).
    fn copy_out(&self, chunk: &Chunk, pos: u64, dst: &mut [u8]) -> Result<()> {
        let m = self.memory()?;
        if self.by_syscall(chunk) {
            return m.read_at(dst, pos);
        }
        let at = self.window_at(chunk, m, pos)?;
        // SAFETY: the caller holds the pages (valid, not evicted, the window not retired).
        // `copy`, not `copy_nonoverlapping`: `dst` may be a `WindowMut` of this very file,
        // whose bytes are the window's own (`read_at(&mut window, …)` over its own range):
        // overlapping regions, which `copy_nonoverlapping` leaves undefined (issue 20).
        unsafe { std::ptr::copy(at, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copy `src` into the cached bytes at `pos..pos + src.len()` (within `chunk`).
    /// => caller holds the pages for writing (WRITING or BUSY).
    fn copy_in(&self, chunk: &Chunk, pos: u64, src: &[u8]) -> Result<()> {
        let m = self.memory()?;
        if self.by_syscall(chunk) {
            return m.write_at(src, pos);
        }
        let at = self.window_at(chunk, m, pos)?;
        // SAFETY: as in `copy_out`, and no one else writes these bytes. `copy`: `src` may
        // be a `Window` of this file over the same bytes (`write_at(&window, …)`).
        unsafe { std::ptr::copy(src.as_ptr(), at, src.len()) };
        Ok(())
    }
}

/// An object's memory: its own (a slice of the cache's arena), or the store's (XIP).
enum ObjectMemory {
    Own(Memory),
    Store(Arc<Memory>),
}

impl std::ops::Deref for ObjectMemory {
    type Target = Memory;
    fn deref(&self) -> &Memory {
        match self {
            ObjectMemory::Own(m) => m,
            ObjectMemory::Store(m) => m,
        }
    }
}

/// Copies of a small file's chunk made by system call before it gets a window (see
/// `Object::by_syscall`): the mount's life of a small file — written, written back, read
/// in, read — is a handful per domain.
const COLD_COPIES: u32 = 16;

impl Drop for Object {
    fn drop(&mut self) {
        // Teardown: the registry no longer lists us and no File exists, so no page is held.
        // The pages' memory is freed when `memory` drops, after this (one punch of the slice).
        let resident = self.resident.load(Relaxed);
        if resident > 0 {
            let _ = self.drop_pages_punching(0, u64::MAX, false);
        }
        let table = &self.table;
        self.res.windows.release_all(|f| table.for_each(0, u64::MAX, |c| f(c)));
        self.forget_locks();
        self.forget_loans();
        self.res.retire_stats(self.counters.snapshot());
    }
}

impl crate::resources::AdmitStaged for Object {
    /// Pages a fill staged (`resources/policy.rs`), each admitted only if it is still the page
    /// that was staged: valid, not taken for a drop, and not in the policy already (its slot
    /// `NO_SLOT`).
    fn admit_staged(&self, pol: &mut dyn EvictionPolicy, first: u64, n: u64, admission: Admission) {
        for p in first..first + n {
            let (Some(chunk), Some(st)) = (self.chunk_of(p), self.page_state(p)) else { continue };
            let st = st.snapshot();
            if st.valid() && !st.busy() && chunk.pages.slot_at(self.locate(p).1).load(Relaxed) == NO_SLOT {
                self.policy_admit(pol, chunk, p, admission);
            }
        }
    }
}

impl DirtyWriter for Object {
    fn id(&self) -> u64 {
        self.id
    }

    fn depth(&self) -> u32 {
        Object::depth(self)
    }

    fn dirty_pages(&self) -> u64 {
        Object::dirty_pages(self)
    }

    fn write_back_inline(&self) -> Result<()> {
        self.writeback(0, u64::MAX, Pass::Inline)
    }
}

/// A `size_lock` guard and its place in the lock order (`order.rs`); the lock is released
/// first (fields drop in order).
struct SizeGuard<G> {
    _lock: G,
    _rank: crate::order::Hold,
}

/// Contiguous runs `[a, b)` of a sorted list of page indexes.
fn runs(pages: &[u64]) -> impl Iterator<Item = (u64, u64)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= pages.len() {
            return None;
        }
        let a = pages[i];
        let mut b = a + 1;
        i += 1;
        while i < pages.len() && pages[i] == b {
            b += 1;
            i += 1;
        }
        Some((a, b))
    })
}

//! Objects: one cached file (NetBSD's `uvm_object` / vnode). An object owns its page table,
//! the memfd holding its pages and its pager, and implements the data paths every front
//! end uses: fill, read, write, truncate, writeback and the release of evicted pages.
//!
//! Locking, from outside in:
//! * `size_lock` — shared by writers, exclusive for `set_len` (like `i_rwsem` for truncate);
//!   readers never take it.
//! * page state words (see `page/state.rs`) — per page, lock-free CAS transitions. Threads
//!   that hold several pages took them in ascending order.
//! * the cache's policy mutex — only on fills, truncation and reclaim, never on hits.

use crate::cache::CacheCore;
use crate::map::UserMap;
use crate::error::{Error, PagerOp, Result};
use crate::evict::{Admission, PageKey};
use crate::memfd::Memfd;
use crate::page::state::{self, Pin, WriteLock, BUSY, DIRTY, VALID, WRITEBACK};
use crate::page::table::{Chunk, PageTable};
use crate::pager::{Fill, Pager};
use crate::stats::{bump, Counters, Stats};
use parking_lot::{Mutex, RwLock};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock, Weak};

/// Largest file length ubc supports: 2^63 - 64 KiB (offsets are `i64` in POSIX, and a
/// memfd holds at most 2^63 - 1 bytes), or less under a finite `RLIMIT_FSIZE` (see
/// `memfd::max_size`).
#[inline]
pub(crate) fn max_end() -> u64 {
    crate::memfd::max_size()
}

/// `offset + len`, or an `OffsetOverflow` error past `max_end()`.
pub(crate) fn checked_end(offset: u64, len: usize) -> Result<u64> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= max_end() => Ok(end),
        _ => Err(Error::OffsetOverflow { offset, len: len as u64 }),
    }
}

pub(crate) struct Object {
    pub(crate) id: u64,
    /// Ourselves, for handing work to I/O threads.
    pub(crate) me: Weak<Object>,
    /// Read-ahead windows in flight: marker page → window size (see `readahead.rs`).
    pub(crate) ra_windows: Mutex<HashMap<u64, u64>>,
    pub(crate) core: Arc<CacheCore>,
    pager: RwLock<Arc<dyn Pager>>,
    pub(crate) table: PageTable,
    memfd: OnceLock<Memfd>,
    memfd_init: Mutex<()>,
    /// Logical length: the cache's, authoritative while the object lives.
    len: AtomicU64,
    pub(crate) size_lock: RwLock<()>,
    /// Open `File` handles.
    pub(crate) handles: AtomicUsize,
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
    pub(crate) counters: Counters,
    /// The registry key this object is filed under.
    pub(crate) key: crate::cache::ObjectKey,
    name: String,
    /// The pager's depth (the highest any of its pagers reported): reclaim inside a pager
    /// call writes back only objects of lower depth.
    depth: AtomicU32,
    /// User mappings of this object (`File::map`), and how many there are (checked on every
    /// fill, so kept apart from the lock).
    pub(crate) maps: RwLock<Vec<Arc<UserMap>>>,
    pub(crate) nmaps: AtomicUsize,
    /// Serializes finding stores through mappings (a scan takes the written state and
    /// re-protects): eviction holds it from zapping its pages to punching them, so a store
    /// found by another scan meanwhile is never lost with the page.
    scan_lock: Mutex<()>,
    /// Writeback failures, reported to every handle once (see `errseq.rs`).
    pub(crate) wb_errors: crate::errseq::WbErrors,
}

/// A page a writer holds between copying into it and publishing it (lock coupling).
enum Held<'a> {
    /// A resident page in WRITING state, marked DIRTY when it was taken. Like every held
    /// page, its unclean slot is counted *held*, not published, until the writer lets it go
    /// (see `dirty_held`).
    Writing(&'a state::PageState),
    /// A page taken empty, still BUSY: (chunk, page index, fresh). Filled from the pager
    /// unless the writer covers it whole or it lies past the end; `fresh` says it was not,
    /// so the memfd holds no memory for it yet.
    Filled(&'a Chunk, u64, bool),
}

impl Object {
    pub(crate) fn new(id: u64, core: Arc<CacheCore>, pager: Arc<dyn Pager>, key: crate::cache::ObjectKey) -> Result<Arc<Object>> {
        let len = pager.len().map_err(|e| Error::Io { op: PagerOp::Len, offset: 0, object: pager.describe(), source: e })?;
        Ok(Arc::new_cyclic(|me| Object {
            id,
            me: me.clone(),
            ra_windows: Mutex::new(HashMap::new()),
            table: PageTable::new(1 << core.chunk_shift),
            key,
            name: pager.describe(),
            depth: AtomicU32::new(pager.depth()),
            pager: RwLock::new(pager),
            core,
            memfd: OnceLock::new(),
            memfd_init: Mutex::new(()),
            len: AtomicU64::new(len),
            size_lock: RwLock::new(()),
            handles: AtomicUsize::new(0),
            resident: AtomicU64::new(0),
            dirty: AtomicU64::new(0),
            dirtied_at: AtomicU64::new(0),
            counters: Counters::default(),
            maps: RwLock::new(Vec::new()),
            nmaps: AtomicUsize::new(0),
            scan_lock: Mutex::new(()),
            wb_errors: Default::default(),
        }))
    }

    pub(crate) fn pager(&self) -> Arc<dyn Pager> {
        self.pager.read().clone()
    }

    /// Replace a read-only pager by a writable one for the same data (a later writable open).
    pub(crate) fn upgrade_pager(&self, pager: Arc<dyn Pager>) {
        let mut p = self.pager.write();
        self.depth.fetch_max(pager.depth(), SeqCst);
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

    pub(crate) fn describe(&self) -> &str {
        &self.name
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
        self.core.flusher.publish(n);
        self.note_dirtied(n);
    }

    /// `n` pages get the DIRTY bit (already counted unclean: a failed writeback). Called
    /// before the bit is set, unless the caller holds the pages WRITING (see `dirty`).
    fn note_dirtied(&self, n: u64) {
        if self.dirty.fetch_add(n, Relaxed) == 0 {
            self.dirtied_at.store(self.core.flusher.now_ms(), Relaxed);
        }
    }

    pub(crate) fn allocated_bytes(&self) -> u64 {
        self.memfd.get().map_or(0, |m| m.allocated_bytes())
    }

    pub(crate) fn stats(&self) -> Stats {
        let mut s = self.counters.snapshot();
        s.resident_bytes = self.resident_pages() << self.core.page_shift;
        s.dirty_bytes = self.dirty_pages() << self.core.page_shift;
        s.io_mode = self.pager.read().io_mode();
        s
    }

    fn memfd(&self) -> Result<&Memfd> {
        if let Some(m) = self.memfd.get() {
            return Ok(m);
        }
        let _g = self.memfd_init.lock();
        if let Some(m) = self.memfd.get() {
            return Ok(m);
        }
        let m = Memfd::create(&self.id.to_string())?;
        Ok(self.memfd.get_or_init(|| m))
    }

    fn io_err(&self, op: PagerOp, offset: u64, source: std::io::Error) -> Error {
        Error::Io { op, offset, object: self.name.clone(), source }
    }

    /// Call the pager (every call after the object is made goes through here). The call
    /// runs in a [`PagerScope`](crate::pager::PagerScope) of this object's depth: a layer's
    /// pager writes its lower file of the same cache, maybe holding a lock that writeback of
    /// its own object needs, so that write must not wait at the dirty limit (without it the
    /// stress test hung in an aead `set_len`) nor reclaim by writing back this object or one
    /// above it (it hung in an aead `put_pages`). A failure comes back with `op`, `offset`
    /// and the object; `f` sees the raw error first (to record it, see `errseq.rs`).
    fn call_pager<T>(&self, op: PagerOp, offset: u64, f: impl FnOnce(&dyn Pager) -> std::io::Result<T>) -> Result<T> {
        let pager = self.pager();
        let _in = crate::writeback::PagerScope::enter(self.depth());
        f(&*pager).map_err(|e| self.io_err(op, offset, e))
    }

    #[inline]
    fn ps(&self) -> u32 {
        self.core.page_shift
    }

    pub(crate) fn page_shift(&self) -> u32 {
        self.core.page_shift
    }

    /// The memfd holding this object's pages (made on first use).
    pub(crate) fn memfd_for_map(&self) -> Result<&Memfd> {
        self.memfd()
    }

    /// Allocate (zeroed) memfd memory for `offset..offset+len` of a valid page that is a hole
    /// (counted resident, never written), so it can be mapped into a user mapping.
    /// => caller holds the page.
    pub(crate) fn materialize(&self, offset: u64, len: u64) {
        if let Ok(m) = self.memfd() {
            let _ = m.allocate(offset, len);
        }
    }

    /// Chunk index and slot of a page.
    #[inline]
    pub(crate) fn locate(&self, page: u64) -> (u64, usize) {
        let cs = self.core.chunk_shift;
        (page >> cs, (page & ((1 << cs) - 1)) as usize)
    }

    /// Byte offset of the start of `chunk` in the file (and the memfd).
    #[inline]
    fn chunk_offset(&self, chunk: &Chunk) -> u64 {
        chunk.index << (self.core.chunk_shift + self.ps())
    }

    fn key(&self, page: u64) -> PageKey {
        PageKey { object: self.id, index: page }
    }

    // ---------------------------------------------------------------- fill

    /// Fill pages `first..=last` of `chunk` (a cluster) from the pager; they come back
    /// valid, and pinned if `pin`. Returns how many pages were filled starting at `first`
    /// (fewer than asked if a later page was not empty), or 0 if `first` itself was taken
    /// by someone else (the caller retries its pin, which waits for that filler).
    fn fill_run(&self, chunk: &Chunk, first: u64, last: u64, pin: bool, admission: Admission) -> Result<u64> {
        let base = chunk.index << self.core.chunk_shift;
        let s0 = (first - base) as usize;
        let max = self.core.max_fill_pages;
        // Memory first, pages second (Linux allocates a page before it adds it locked to
        // the page cache): reserving may reclaim, and reclaim may write back any file —
        // which it could not do while this thread held pages BUSY (`order.rs`: a pager
        // above could be waiting for them).
        let mut want = 0u64;
        while first + want <= last && want < max && chunk.pages[s0 + want as usize].is_empty() {
            want += 1;
        }
        if want == 0 {
            return Ok(0);
        }
        self.core.reserve(want)?;
        let _pages = crate::order::hold(crate::order::Rank::page(self.depth()));
        if !chunk.pages[s0].try_lock_empty() {
            self.core.unreserve(want);
            return Ok(0);
        }
        let mut n = 1u64;
        while n < want && chunk.pages[s0 + n as usize].try_lock_empty() {
            n += 1;
        }
        if n < want {
            self.core.unreserve(want - n);
        }
        let locked = &chunk.pages[s0..s0 + n as usize];
        if let Err(e) = self.fill_locked(chunk, first, n) {
            self.core.unreserve(n);
            locked.iter().for_each(|p| {
                p.release_empty();
            });
            return Err(e);
        }
        self.publish_filled(chunk, first, n, false, pin, admission, None);
        bump(&self.counters.mine().misses, n);
        Ok(n)
    }

    /// Read pages `first..first+n` of `chunk` from the pager into the cache.
    /// => caller holds those pages BUSY and has reserved budget for them.
    pub(crate) fn fill_locked(&self, chunk: &Chunk, first: u64, n: u64) -> Result<()> {
        let offset = first << self.ps();
        if offset >= self.len() {
            // Entirely past the end of the file: a hole, zero-filled by the memfd.
            return Ok(());
        }
        let memfd = self.memfd()?;
        let win = self.core.windows.address(chunk, memfd)?;
        let bytes = (n << self.ps()) as usize;
        // SAFETY: the window maps the whole chunk; the caller holds these pages BUSY, so no
        // one else reads or writes these bytes, and the window cannot be retired.
        let buf = unsafe {
            std::slice::from_raw_parts_mut(win.add((offset - self.chunk_offset(chunk)) as usize), bytes)
        };
        let sh = self.counters.mine();
        bump(&sh.get_calls, 1);
        match self.call_pager(PagerOp::GetPages, offset, |p| p.get_pages(offset, buf)) {
            Ok(Fill::Data) => {
                bump(&sh.read_bytes, bytes as u64);
                Ok(())
            }
            Ok(Fill::Hole) => Ok(()),
            Err(e) => {
                // The pager may have written part of the buffer: free whatever it allocated.
                let _ = memfd.punch(offset, bytes as u64);
                Err(e)
            }
        }
    }

    /// Make filled BUSY pages valid and hand them to the replacement policy; `mark` puts the
    /// read-ahead trigger on one of them.
    pub(crate) fn publish_filled(&self, chunk: &Chunk, first: u64, n: u64, dirty: bool, pin: bool, admission: Admission, mark: Option<u64>) {
        let base = chunk.index << self.core.chunk_shift;
        // Insert into the policy before the pages become visible as valid: a page must
        // never be valid (evictable) without the policy knowing it.
        {
            let mut pol = self.core.policy.lock();
            for p in first..first + n {
                pol.insert(self.key(p), admission);
            }
        }
        // Valid first, then mapped into every user mapping, held by a pin meanwhile (a page
        // reaches a user page table only while held: it cannot be evicted in between).
        // Mapped while still BUSY, as this once did, a store through the mapping could land
        // before the page was valid; a scan (the flusher's harvest) found it, could not mark
        // a page that was not valid yet dirty, and re-protected it: the store was lost
        // (`file_pager_mapping_round_trip_through_a_fresh_cache`, under load, once read-ahead
        // published pages ahead of a writer storing through a mapping). The contents are
        // final at `finish_fill`, so no mapping sees a half-made page either way. Resident
        // pages never trap, except the read-ahead marker, which `map_pages` leaves out.
        let svc = if self.nmaps.load(SeqCst) > 0 { self.core.maps.get() } else { None };
        let pins = u32::from(pin) + u32::from(svc.is_some());
        // Counted before they are valid (and dirty): from `finish_fill` on, an eviction or a
        // writeback may count them out (see `dirty`).
        self.resident.fetch_add(n, Relaxed);
        if dirty {
            self.publish_dirtied(n);
        }
        for p in first..first + n {
            chunk.pages[(p - base) as usize].finish_fill(dirty, pins, admission == Admission::ReadAhead, mark == Some(p));
        }
        if let Some(svc) = svc {
            for m in self.maps.read().iter() {
                svc.map_pages(self, m, first, first + n, false);
            }
            self.unpin_run(chunk, first, n);
        }
    }

    // ---------------------------------------------------------------- read

    /// Pin a run of valid pages `first..=last` of `chunk`, filling the first one if needed.
    /// Returns the number pinned (at least 1). `req_last` is the last page of the whole read
    /// (for read-ahead decisions); `None` for accesses that get no read-ahead (windows).
    fn pin_run(&self, chunk: &Chunk, first: u64, last: u64, req_last: Option<u64>) -> Result<u64> {
        // A pin waits while the page is BUSY (a fill, perhaps a queued read-ahead job).
        crate::order::check_wait(crate::order::Rank::page(self.depth()));
        let base = chunk.index << self.core.chunk_shift;
        let mut n = 0;
        loop {
            let p = first + n;
            if p > last {
                break;
            }
            match chunk.pages[(p - base) as usize].pin() {
                Pin::Pinned { ra_mark, first_use } => {
                    n += 1;
                    if first_use {
                        bump(&self.counters.mine().readahead_hits, 1);
                    }
                    if ra_mark && req_last.is_some() {
                        self.readahead_on_mark(p);
                    }
                }
                Pin::Invalid if n > 0 => break,
                Pin::Invalid => {
                    if let Some(rl) = req_last {
                        self.readahead_on_miss(p, rl);
                    }
                    let got = self.fill_run(chunk, p, last, true, Admission::Demand)?;
                    if got > 0 {
                        return Ok(got);
                    }
                    // Someone else is filling it; pin() will wait for them.
                }
            }
        }
        bump(&self.counters.mine().hits, n);
        Ok(n)
    }

    fn unpin_run(&self, chunk: &Chunk, first: u64, n: u64) {
        let base = chunk.index << self.core.chunk_shift;
        for p in first..first + n {
            chunk.pages[(p - base) as usize].unpin();
        }
    }

    /// `read_at`: copy `buf.len()` bytes at `offset` (fewer at end of file).
    pub(crate) fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        checked_end(offset, buf.len())?;
        let mut end = offset.saturating_add(buf.len() as u64).min(self.len());
        let ps = self.ps();
        let mut pos = offset;
        while pos < end {
            let page = pos >> ps;
            let (ci, _) = self.locate(page);
            let chunk = self.table.get_or_create(ci);
            let chunk_last = ((ci + 1) << self.core.chunk_shift) - 1;
            let req_last = (end - 1) >> ps;
            let last = req_last.min(chunk_last);
            let n = self.pin_run(chunk, page, last, Some(req_last))?;
            // A truncation may have raced with us; pinned pages are stable, but do not
            // return bytes past the current end.
            end = end.min(self.len());
            let to = end.min((page + n) << ps);
            if pos < to {
                let r = self.memfd().and_then(|m| self.core.windows.address(chunk, m));
                match r {
                    Ok(win) => {
                        // SAFETY: pages page..page+n are pinned (valid, cannot be evicted or
                        // retired); the window maps the whole chunk.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                win.add((pos - self.chunk_offset(chunk)) as usize),
                                buf.as_mut_ptr().add((pos - offset) as usize),
                                (to - pos) as usize,
                            );
                        }
                    }
                    Err(e) => {
                        self.unpin_run(chunk, page, n);
                        return Err(e);
                    }
                }
            }
            self.unpin_run(chunk, page, n);
            pos = to.max(pos);
            if pos >= end {
                break;
            }
        }
        Ok((pos.max(offset) - offset) as usize)
    }

    /// Pin every page of `offset..offset+len` (one chunk) for a read window. Returns the
    /// window address of the chunk. => range within one chunk and within the file.
    pub(crate) fn pin_range(&self, chunk: &Chunk, first: u64, last: u64) -> Result<*mut u8> {
        let mut p = first;
        while p <= last {
            match self.pin_run(chunk, p, last, None) {
                Ok(n) => p += n,
                Err(e) => {
                    self.unpin_run(chunk, first, p - first);
                    return Err(e);
                }
            }
        }
        match self.memfd().and_then(|m| self.core.windows.address(chunk, m)) {
            Ok(w) => Ok(w),
            Err(e) => {
                self.unpin_run(chunk, first, last + 1 - first);
                Err(e)
            }
        }
    }

    pub(crate) fn unpin_range(&self, chunk: &Chunk, first: u64, last: u64) {
        self.unpin_run(chunk, first, last + 1 - first);
    }

    // ---------------------------------------------------------------- write

    /// Take page `page` for writing bytes `from..to` of the file (within that page): a
    /// resident page becomes WRITING; an empty one is filled first unless it lies past the
    /// end of the file, or `overwrite` promises the caller will write every byte of
    /// `from..to` and that range covers the page. => caller holds `size_lock` shared.
    fn lock_page_for_write<'a>(&self, chunk: &'a Chunk, page: u64, from: u64, to: u64, overwrite: bool) -> Result<Held<'a>> {
        let (_, slot) = self.locate(page);
        let st = &chunk.pages[slot];
        match st.begin_write() {
            WriteLock::Resident => {
                bump(&self.counters.mine().hits, 1);
                if let Err(e) = self.dirty_held(st) {
                    st.abort_write();
                    return Err(e);
                }
                Ok(Held::Writing(st))
            }
            WriteLock::Empty => {
                bump(&self.counters.mine().misses, 1);
                if let Err(e) = self.core.reserve(1) {
                    st.release_empty();
                    return Err(e);
                }
                if let Err(e) = self.core.reserve_dirty(self, None) {
                    self.core.unreserve(1);
                    st.release_empty();
                    return Err(e);
                }
                let page_off = page << self.ps();
                let covers = overwrite && from == page_off && to == page_off + (1 << self.ps());
                let fresh = covers || page_off >= self.len();
                if !fresh {
                    if let Err(e) = self.fill_locked(chunk, page, 1) {
                        self.core.unreserve(1);
                        self.core.unreserve_dirty();
                        st.release_empty();
                        return Err(e);
                    }
                }
                Ok(Held::Filled(chunk, page, fresh))
            }
        }
    }

    /// Mark a page the caller holds WRITING dirty before changing it, taking an unclean slot
    /// (the dirty limit) if it was clean. Dirty from the start of the write, not its end: a
    /// store through a mapping found meanwhile (which also sets DIRTY) then needs no
    /// reconciling with the writer's reservation.
    /// The page's unclean slot is *held* by the caller until it lets the page go
    /// (`release_written` / `abort_held` publish it): a page held WRITING cannot be cleaned,
    /// so a writer waiting at the dirty limit must not count it as something writeback
    /// could clean. An already dirty page's published slot moves to held.
    fn dirty_held(&self, st: &state::PageState) -> Result<()> {
        // Nobody else clears DIRTY while we hold the page WRITING (writeback cannot begin).
        if st.load() & DIRTY != 0 {
            self.core.flusher.hold(1);
            return Ok(());
        }
        if !self.core.reserve_dirty(self, Some(st))? {
            // A store through a mapping dirtied it while we waited and published its slot.
            self.core.flusher.hold(1);
            return Ok(());
        }
        if st.mark_dirty() {
            self.note_dirtied(1);
        } else {
            // A store found through a mapping dirtied it first and published its slot.
            self.core.unreserve_dirty();
            self.core.flusher.hold(1);
        }
        Ok(())
    }

    /// Give back a page a writer held without having written it: a resident page stays (it
    /// may stay marked dirty: a needless writeback, never a lost one); a new one is
    /// discarded (its contents may never have been produced).
    fn abort_held(&self, h: Held<'_>) {
        match h {
            Held::Writing(st) => {
                // The page stays dirty (marked when taken): its slot becomes a published one,
                // before the page is let go (a writeback may clean it at once; see `dirty`).
                self.core.flusher.publish(1);
                st.abort_write();
            }
            Held::Filled(chunk, page, _) => {
                if let Some(m) = self.memfd.get() {
                    let _ = m.punch(page << self.ps(), 1 << self.ps());
                }
                self.core.unreserve(1);
                self.core.unreserve_dirty();
                chunk.pages[self.locate(page).1].release_empty();
            }
        }
    }

    /// Publish a page a writer held: it is now valid and dirty.
    fn release_written(&self, h: Held<'_>) {
        match h {
            Held::Writing(st) => {
                // Published before the page is let go: a writeback may clean it (and count
                // its slot out) as soon as it is (see `dirty`).
                self.core.flusher.publish(1);
                let was_clean = st.end_write();
                debug_assert!(!was_clean, "a held page is dirty from the start of the write");
            }
            Held::Filled(chunk, page, _) => self.publish_filled(chunk, page, 1, true, false, Admission::Demand, None),
        }
    }

    /// `write_at`: copy `buf` into the file at `offset`, extending it if needed.
    /// Writers take pages in ascending order with lock coupling (the next page is taken
    /// before the previous is released), so overlapping writes are applied in one order
    /// on every page they share.
    pub(crate) fn write(&self, buf: &[u8], offset: u64) -> Result<usize> {
        let end = checked_end(offset, buf.len())?;
        if buf.is_empty() {
            return Ok(0);
        }
        if self.core.maps.get().is_some_and(|svc| svc.overlaps(buf.as_ptr() as usize, buf.len())) {
            return self.write_bounced(buf, offset);
        }
        let ps = self.ps();
        // Smooth dirty throttling happens here, before any page is held.
        self.core.balance_dirty(((end - 1) >> ps) - (offset >> ps) + 1);
        let _size = self.size_shared();
        // Pages are held from here on (lock coupling), each taken in ascending order.
        let _pages = crate::order::hold(crate::order::Rank::page(self.depth()));
        let mut held: Option<Held<'_>> = None;
        let mut pos = offset;
        let mut result = Ok(());
        while pos < end {
            let page = pos >> ps;
            let to = end.min((page + 1) << ps);
            let (ci, _) = self.locate(page);
            let chunk = self.table.get_or_create(ci);
            let h = match self.lock_page_for_write(chunk, page, pos, to, true) {
                Ok(h) => h,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            if let Some(prev) = held.take() {
                self.release_written(prev);
            }
            let src = &buf[(pos - offset) as usize..(to - offset) as usize];
            let copied = if matches!(h, Held::Filled(_, _, true)) {
                // A page with no memory yet: `pwrite` into the memfd allocates it in the
                // kernel without zeroing it first and without a page fault on the window
                // (table1 writes +40%, A/B on this host: docs/bench.md). The page is BUSY: no mapping maps it (they are registered
                // MINOR), no reader reads it. `checked_end` kept the write below the memfd's
                // size, so below any RLIMIT_FSIZE.
                self.memfd().and_then(|m| m.write_at(src, pos))
            } else {
                self.memfd().and_then(|m| self.core.windows.address(chunk, m)).map(|win| {
                    // SAFETY: we hold the page (WRITING or BUSY): no other writer, no
                    // eviction, no window retirement; the window maps the whole chunk.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src.as_ptr(), win.add((pos - self.chunk_offset(chunk)) as usize), src.len());
                    }
                })
            };
            match copied {
                Ok(()) => {}
                Err(e) => {
                    // Nothing was copied into this page: give it back untouched.
                    self.abort_held(h);
                    result = Err(e);
                    break;
                }
            }
            // Extend the file before the page is published (released): once published it
            // may be written back and evicted, and writeback clips at the length.
            self.len.fetch_max(to, SeqCst);
            held = Some(h);
            pos = to;
        }
        if let Some(h) = held.take() {
            self.release_written(h);
        }
        match result {
            Ok(()) => Ok(buf.len()),
            Err(_) if pos > offset => Ok((pos - offset) as usize),
            Err(e) => Err(e),
        }
    }

    /// `write` from a buffer that lies in a user mapping of this cache (UBC's deadlock: the
    /// copy could fault on a page we hold). Copy it out first, a piece at a time, while
    /// holding nothing, so its faults are resolved like any other.
    fn write_bounced(&self, buf: &[u8], offset: u64) -> Result<usize> {
        const PIECE: usize = 1 << 20;
        let mut bounce = vec![0u8; PIECE.min(buf.len())];
        let mut done = 0;
        for piece in buf.chunks(PIECE) {
            let b = &mut bounce[..piece.len()];
            b.copy_from_slice(piece);
            match self.write(b, offset + done as u64) {
                Ok(n) if n == piece.len() => done += n,
                Ok(n) => return Ok(done + n),
                Err(_) if done > 0 => return Ok(done),
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    /// Take every page of `first..=last` (one chunk) for writing, filling partial ones, for
    /// a writable window over bytes `from..to`. Returns the chunk's window address.
    /// => caller holds `size_lock` shared until `unlock_range_written`.
    pub(crate) fn lock_range_for_write(&self, chunk: &Chunk, from: u64, to: u64) -> Result<*mut u8> {
        let ps = self.ps();
        let (first, last) = (from >> ps, (to - 1) >> ps);
        let mut helds = Vec::with_capacity((last + 1 - first) as usize);
        let _pages = crate::order::hold(crate::order::Rank::page(self.depth()));
        for page in first..=last {
            let a = from.max(page << ps);
            let b = to.min((page + 1) << ps);
            // A window shows the file's current bytes, so every page is read in.
            match self.lock_page_for_write(chunk, page, a, b, false) {
                Ok(h) => helds.push(h),
                Err(e) => {
                    helds.into_iter().for_each(|h| self.abort_held(h));
                    return Err(e);
                }
            }
        }
        match self.memfd().and_then(|m| self.core.windows.address(chunk, m)) {
            Ok(w) => Ok(w),
            Err(e) => {
                helds.into_iter().for_each(|h| self.abort_held(h));
                Err(e)
            }
        }
    }

    /// Publish the pages of a writable window and extend the file to `to`.
    pub(crate) fn unlock_range_written(&self, chunk: &Chunk, from: u64, to: u64) {
        let ps = self.ps();
        self.len.fetch_max(to, SeqCst);
        for page in from >> ps..=(to - 1) >> ps {
            let (_, slot) = self.locate(page);
            let st = &chunk.pages[slot];
            if st.load() & VALID != 0 {
                self.release_written(Held::Writing(st));
            } else {
                self.release_written(Held::Filled(chunk, page, false));
            }
        }
    }

    // ---------------------------------------------------------------- truncate

    /// `set_len`: truncate (dropping cached pages past the end and zeroing the tail of the
    /// last page) or extend; then tell the pager.
    pub(crate) fn set_len(&self, new: u64) -> Result<()> {
        if new > max_end() {
            return Err(Error::OffsetOverflow { offset: new, len: 0 });
        }
        let _size = self.size_exclusive();
        let old = self.len();
        let ps = self.ps();
        if new < old {
            // Order matters: publish the new length first (writebacks and read-ahead that
            // start from now on clip to it), then drop pages (waiting for writebacks in
            // flight), then truncate the pager, so no writeback can re-extend the stored
            // file, then zero the last page's tail.
            self.len.store(new, SeqCst);
            let dropped = self.drop_pages(new.div_ceil(1 << ps), u64::MAX);
            // The store is truncated whatever happened above: its bytes past the new end
            // must not come back when the file grows again.
            self.call_pager(PagerOp::SetLen, new, |p| p.set_len(new))?;
            dropped?;
            // Zero the cached last page's tail only now: a fill of that page in flight
            // (read-ahead) may have read the store before it was truncated; `zero_tail`
            // waits for it, and fills that start later read the truncated store.
            return if new % (1 << ps) != 0 { self.zero_tail(new) } else { Ok(()) };
        } else {
            // Growing: the pager first, so that a refusal (a layer's own limit, an I/O
            // error) leaves the file as it was instead of longer than its store can be.
            if new > old {
                self.call_pager(PagerOp::SetLen, new, |p| p.set_len(new))?;
            }
            self.len.store(new, SeqCst);
            if new > old && self.nmaps.load(SeqCst) > 0 {
                // Touches past the old end were answered with SIGBUS markers: clear them.
                if let Some(svc) = self.core.maps.get() {
                    for m in self.maps.read().iter() {
                        svc.unpoison(m, old.div_ceil(1 << ps), new.div_ceil(1 << ps), ps);
                    }
                }
            }
        }
        Ok(())
    }

    /// Zero the bytes of the last page past `new_len` if it is cached. => size_lock held.
    fn zero_tail(&self, new_len: u64) -> Result<()> {
        let ps = self.ps();
        let page = new_len >> ps;
        let (ci, slot) = self.locate(page);
        let Some(chunk) = self.table.get(ci) else { return Ok(()) };
        let st = &chunk.pages[slot];
        if st.load() & (VALID | BUSY) == 0 {
            return Ok(()); // not cached, no fill in flight
        }
        // Waits for a fill in flight (BUSY) to finish.
        match st.begin_write() {
            WriteLock::Resident => {
                // Dirty without waiting at the dirty limit: a truncation must not stop
                // half-way (its length is published already) because other pages cannot be
                // written back — that left old bytes past the new end, in the cache and in
                // the store, to reappear when the file grew again (found by the long model
                // run). One page over the limit, like a store found through a mapping.
                if st.load() & DIRTY != 0 {
                    self.core.flusher.hold(1);
                } else if st.mark_dirty() {
                    self.core.flusher.add_unclean(1);
                    self.note_dirtied(1);
                    self.core.flusher.hold(1);
                } else {
                    self.core.flusher.hold(1); // a found store dirtied it meanwhile
                }
                let r = self.memfd().and_then(|m| self.core.windows.address(chunk, m));
                if let Ok(win) = r {
                    let from = (new_len - self.chunk_offset(chunk)) as usize;
                    let to = (((page + 1) << ps) - self.chunk_offset(chunk)) as usize;
                    // SAFETY: page held WRITING; window maps the chunk.
                    unsafe { std::ptr::write_bytes(win.add(from), 0, to - from) };
                }
                self.release_written(Held::Writing(st));
                r.map(|_| ())
            }
            // Evicted meanwhile: nothing cached to zero.
            WriteLock::Empty => {
                st.release_empty();
                Ok(())
            }
        }
    }

    /// Drop every cached page with index in `from..to`, dirty or not (truncation,
    /// invalidation, teardown). Waits for pins, writers and writebacks on those pages.
    pub(crate) fn drop_pages(&self, from: u64, to: u64) -> Result<()> {
        let _pages = crate::order::hold(crate::order::Rank::page(self.depth()));
        let cs = self.core.chunk_shift;
        let ps = self.ps();
        let mut err = Ok(());
        self.table.for_each(from >> cs, (to >> cs).saturating_add(1), |chunk| {
            let base = chunk.index << cs;
            let lo = from.max(base);
            let hi = to.min(base + (1 << cs));
            if lo >= hi {
                return;
            }
            let mut dropped = Vec::new();
            for p in lo..hi {
                let st = &chunk.pages[(p - base) as usize];
                if st.load() & (VALID | BUSY) == 0 {
                    continue;
                }
                let prior = st.lock_for_drop();
                if prior & VALID == 0 {
                    st.release_empty(); // was empty by the time we got it
                    continue;
                }
                if st.clear_dirty_locked() {
                    self.dirty.fetch_sub(1, Relaxed);
                    self.core.flusher.cleaned(1);
                }
                dropped.push(p);
            }
            if dropped.is_empty() {
                return;
            }
            {
                let mut pol = self.core.policy.lock();
                for &p in &dropped {
                    pol.remove(self.key(p));
                }
            }
            if let Some(m) = self.memfd.get() {
                for (a, b) in runs(&dropped) {
                    if let Err(e) = m.punch(a << ps, (b - a) << ps) {
                        err = Err(e);
                    }
                }
            }
            let mut late_dirty = 0;
            for &p in &dropped {
                // A store through a mapping found at the last moment dirtied it: dropped too.
                late_dirty += u64::from(chunk.pages[(p - base) as usize].release_empty() & DIRTY != 0);
            }
            if late_dirty > 0 {
                self.dirty.fetch_sub(late_dirty, Relaxed);
                self.core.flusher.cleaned(late_dirty);
            }
            let n = dropped.len() as u64;
            self.resident.fetch_sub(n, Relaxed);
            self.core.unreserve(n);
        });
        err
    }

    // ---------------------------------------------------------------- coherence

    /// Mach's `pager_clean_request`: write back the dirty pages in bytes `from..to`
    /// (stores through mappings included) and wait for writebacks in flight there. On error
    /// the pages stay dirty and the first error is returned.
    pub(crate) fn clean(&self, from: u64, to: u64) -> Result<()> {
        let ps = self.ps();
        let (a, b) = (from >> ps, to.div_ceil(1 << ps).max(from >> ps));
        self.harvest(a, b, true);
        self.writeback(a, b, true, true)
    }

    /// Mach's `pager_flush_request`: clean bytes `from..to`, then drop their cached pages
    /// from the cache and from every mapping (a mapping re-faults them from the pager).
    /// With `reload_len`, the length is then taken from the pager again (the stored data
    /// changed underneath: a restore through a lower layer). Writers on this object wait.
    /// A store through a mapping that lands between the clean and the drop is lost: the
    /// caller (the cache manager) invalidates only ranges another domain is about to
    /// overwrite or has overwritten.
    pub(crate) fn invalidate(&self, from: u64, to: u64, reload_len: bool) -> Result<()> {
        self.clean(from, to)?;
        let _size = self.size_exclusive();
        let ps = self.ps();
        self.drop_pages(from >> ps, to.div_ceil(1 << ps).max(from >> ps))?;
        if reload_len {
            let old = self.len();
            let new = self.call_pager(PagerOp::Len, 0, |p| p.len())?;
            if new != old {
                self.len.store(new, SeqCst);
                if new < old {
                    // Pages past the new end read as SIGBUS in mappings, as after set_len.
                    self.drop_pages(new.div_ceil(1 << ps), u64::MAX)?;
                } else if self.nmaps.load(SeqCst) > 0 {
                    if let Some(svc) = self.core.maps.get() {
                        for m in self.maps.read().iter() {
                            svc.unpoison(m, old.div_ceil(1 << ps), new.div_ceil(1 << ps), ps);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- writeback

    /// Write back dirty pages with index in `from..to`, clustered into contiguous runs of at
    /// most `max_put_pages`. With `wait`, also waits for pages being written or written back
    /// by others (and retries those whose writeback failed); without, skips busy pages.
    /// With `parallel`, runs are spread over the I/O pool (several requests in flight) and
    /// waited for — except on an I/O thread, which must not wait for the pool.
    /// Failed runs stay dirty; the first error is returned after trying every run.
    pub(crate) fn writeback(&self, from: u64, to: u64, wait: bool, parallel: bool) -> Result<()> {
        if self.dirty_pages() == 0 && !wait {
            return Ok(());
        }
        let depth = self.depth();
        if wait {
            crate::order::check_wait(crate::order::Rank::page(depth));
        }
        // This thread holds the pages it takes WRITEBACK until it hands them to a job or
        // has written them itself.
        let _pages = crate::order::hold(crate::order::Rank::page(depth));
        let me = if parallel && !crate::io::on_io_thread() { self.me.upgrade() } else { None };
        let batch = crate::io::Batch::default();
        let cs = self.core.chunk_shift;
        let mut first_err: Option<Error> = None;
        self.table.for_each(from >> cs, (to >> cs).saturating_add(1), |chunk| {
            let base = chunk.index << cs;
            let lo = from.max(base);
            let hi = to.min(base + (1 << cs));
            let mut p = lo;
            while p < hi {
                let st = &chunk.pages[(p - base) as usize];
                let s = st.load();
                if s & (DIRTY | WRITEBACK) == 0 || !st.begin_writeback(wait) {
                    p += 1;
                    continue;
                }
                let mut n = 1;
                while p + n < hi
                    && n < self.core.max_put_pages
                    && chunk.pages[(p + n - base) as usize].begin_writeback(false)
                {
                    n += 1;
                }
                match &me {
                    Some(obj) => {
                        let (obj, ticket, ci, first) = (obj.clone(), batch.ticket(), chunk.index, p);
                        self.core.io.submit(depth, move || {
                            let chunk = obj.table.get(ci).expect("chunk of pages under writeback");
                            let _pages = crate::order::hold(crate::order::Rank::page(depth));
                            ticket.done(obj.write_run(chunk, first, n));
                        });
                    }
                    None => {
                        if let Err(e) = self.write_run(chunk, p, n) {
                            first_err.get_or_insert(e);
                        }
                    }
                }
                p += n;
            }
        });
        let r = batch.wait(depth);
        match first_err {
            Some(e) => Err(e),
            None => r,
        }
    }

    /// Write pages `first..first+n` (WRITEBACK, taken by the caller) to the pager.
    fn write_run(&self, chunk: &Chunk, first: u64, n: u64) -> Result<()> {
        let ps = self.ps();
        let base = chunk.index << self.core.chunk_shift;
        // begin_writeback cleared DIRTY; the pages stay unclean until they are written.
        self.dirty.fetch_sub(n, Relaxed);
        let offset = first << ps;
        // Clip at the end of the file: the store must not grow past the length we know.
        let bytes = ((n << ps).min(self.len().saturating_sub(offset))) as usize;
        let sh = self.counters.mine();
        let r = if bytes == 0 {
            Ok(())
        } else {
            self.memfd().and_then(|m| self.core.windows.address(chunk, m)).and_then(|win| {
                // SAFETY: pages held WRITEBACK (stable: no writer, no eviction, no retirement).
                let data = unsafe {
                    std::slice::from_raw_parts(win.add((offset - self.chunk_offset(chunk)) as usize), bytes)
                };
                bump(&sh.put_calls, 1);
                self.call_pager(PagerOp::PutPages, offset, |p| {
                    p.put_pages(offset, data).inspect_err(|e| self.wb_errors.retained(PagerOp::PutPages, e))
                })
            })
        };
        let ok = r.is_ok();
        if !ok {
            // Dirty again: counted before `end_writeback` sets DIRTY, since another writeback
            // may take the pages (and count them out) at once (see `dirty`).
            self.note_dirtied(n);
        }
        let mut redirtied = 0;
        for p in first..first + n {
            redirtied += chunk.pages[(p - base) as usize].end_writeback(ok) as u64;
        }
        if ok {
            bump(&sh.written_bytes, bytes as u64);
            bump(&sh.writebacks, n);
            self.core.flusher.cleaned(n);
        } else {
            // Each page is dirty again, counted once: pages re-dirtied meanwhile (by a store
            // found through a mapping) were counted dirty and unclean when found, so the
            // count just made for them and their writeback's unclean slot go.
            if redirtied > 0 {
                self.dirty.fetch_sub(redirtied, Relaxed);
                self.core.flusher.cleaned(redirtied);
            }
            bump(&sh.writeback_errors, 1);
        }
        r
    }

    /// `sync`: every dirty page reaches the pager, the stored length matches, then the
    /// pager's own sync. On error the pages stay dirty and the error is returned.
    pub(crate) fn sync(&self) -> Result<()> {
        self.harvest(0, u64::MAX, true);
        self.writeback(0, u64::MAX, true, true)?;
        self.sync_pager()
    }

    /// The stored length matches ours, then the pager's own sync (the durable half of
    /// `sync`). => dirty pages were written back.
    pub(crate) fn sync_pager(&self) -> Result<()> {
        let stored = self.call_pager(PagerOp::Len, 0, |p| p.len())?;
        if stored != self.len() && self.pager().is_writable() {
            // Exclusive, and both lengths read again under it: with writers running (they
            // hold the lock shared), the length read before could be stale by the time the
            // pager is told, and a writer's page past it could already be written back —
            // `set_len` to the stale length then cut that page off the store while the
            // cache kept it clean, and it read back as zeros after eviction (a zstd chunk
            // failing its checksum when a commit synced its lower file while other threads
            // wrote: tests/nested_writeback.rs). Held exclusive, the length cannot move and
            // writebacks in flight are clipped to it, so the store cannot pass it meanwhile.
            let _size = self.size_exclusive();
            let len = self.len();
            let stored = self.call_pager(PagerOp::Len, 0, |p| p.len())?;
            if stored != len {
                self.call_pager(PagerOp::SetLen, len, |p| p.set_len(len))?;
            }
        }
        self.call_pager(PagerOp::Sync, 0, |p| p.sync().inspect_err(|e| self.wb_errors.lost(PagerOp::Sync, e)))
    }

    // ---------------------------------------------------------------- eviction

    /// The state word of a cached page, if its chunk exists.
    pub(crate) fn page_state(&self, page: u64) -> Option<&state::PageState> {
        let (ci, slot) = self.locate(page);
        self.table.get(ci).map(|c| &c.pages[slot])
    }

    /// Free pages the replacement policy took for eviction (each held VALID|BUSY, already
    /// forgotten by the policy). `pages` sorted ascending.
    pub(crate) fn release_evicted(&self, pages: &[u64]) {
        let ps = self.ps();
        // Pages that may be mapped: zap them out of the tracked mappings first (a store now
        // traps and waits for us), then look for stores made before; a page found written
        // stays, dirty. The scan lock keeps another scan from taking those stores meanwhile.
        let _scan = (self.nmaps.load(SeqCst) > 0).then(|| self.scan_lock.lock());
        if _scan.is_some() {
            let mut found = Vec::new();
            if let Some(svc) = self.core.maps.get() {
                for m in self.maps.read().iter().filter(|m| m.tracked) {
                    for (a, b) in runs(pages) {
                        svc.zap(m, a, b, ps);
                        svc.take_written(m, a, b, ps, &mut found);
                    }
                }
            }
            crate::map::dedup_pages(&mut found);
            self.mark_found_dirty(&found);
        }
        // A page dirtied while we held it stays, dirty: by a store found just above, or by
        // the last scan of a mapping dropped since the policy took the page — that scan
        // (`Mapping`'s drop) marks it dirty, then the mapping is gone and `nmaps` may read 0
        // above (the stress test lost such stores: the page was punched dirty and refilled
        // from the pager). Checked whatever `nmaps` said.
        let is_dirty = |p: &u64| self.page_state(*p).is_some_and(|st| st.load() & DIRTY != 0);
        let kept_back;
        let pages = if pages.iter().any(is_dirty) {
            let (keep, go): (Vec<u64>, Vec<u64>) = pages.iter().partition(|p| is_dirty(p));
            {
                let mut pol = self.core.policy.lock();
                for &p in &keep {
                    pol.insert(self.key(p), Admission::Demand);
                }
            }
            for &p in &keep {
                if let Some(st) = self.page_state(p) {
                    st.cancel_evict();
                }
            }
            kept_back = go;
            &kept_back[..]
        } else {
            pages
        };
        if let Some(m) = self.memfd.get() {
            for (a, b) in runs(pages) {
                // A failed punch would leave memory allocated that we no longer account; it
                // cannot fail for a valid range of a memfd, so there is nothing to undo.
                let _ = m.punch(a << ps, (b - a) << ps);
            }
        }
        let mut waste = 0;
        for &p in pages {
            if let Some(st) = self.page_state(p) {
                waste += u64::from(st.load() & state::SPECULATIVE != 0);
                st.release_empty();
            }
        }
        let n = pages.len() as u64;
        self.resident.fetch_sub(n, Relaxed);
        self.core.unreserve(n);
        let sh = self.counters.mine();
        bump(&sh.evictions, n);
        bump(&sh.readahead_waste, waste);
    }
}

// ---------------------------------------------------------------- mappings

impl Object {
    /// Mark the valid pages in `found` dirty (stores found through mappings) and count the
    /// ones that were clean. They took no unclean slot: the stores happened already, so the
    /// dirty limit cannot hold them back; the flusher is kicked if they pass the threshold.
    fn mark_found_dirty(&self, found: &[u64]) -> u64 {
        // Counted dirty and unclean before they are marked: from `mark_dirty` on, a
        // writeback may clean them and count them out (see `dirty`). Pages dirty already
        // need nothing (the store happened before this look, so their coming writeback
        // copies it); pages that became dirty or were dropped by the time we mark them give
        // their counts back.
        let clean: Vec<&state::PageState> =
            found.iter().filter_map(|&p| self.page_state(p)).filter(|st| st.load() & (VALID | DIRTY) == VALID).collect();
        let k = clean.len() as u64;
        if k == 0 {
            return 0;
        }
        self.core.flusher.add_unclean(k);
        self.note_dirtied(k);
        let n = clean.iter().filter(|st| st.mark_dirty()).count() as u64;
        if n < k {
            self.dirty.fetch_sub(k - n, Relaxed);
            // Out of the published unclean count without counting as cleaned (which would
            // tell waiting writers that writeback made progress): as slots a writer took and
            // gave back unused.
            self.core.flusher.hold(k - n);
            for _ in n..k {
                self.core.flusher.unreserve();
            }
        }
        if n > 0 {
            if let Some(svc) = self.core.maps.get() {
                svc.scan_dirty.fetch_add(n, Relaxed);
            }
        }
        n
    }

    /// Find stores made through this object's mappings to pages `[a, b)` since the last
    /// scan, and mark those pages dirty. `explicit`: a sync or flush (in populate mode, where
    /// stores cannot be seen, every page of a writable shared mapping counts as written then;
    /// the flusher's periodic scans find nothing there). Returns pages newly dirty.
    pub(crate) fn harvest(&self, a: u64, b: u64, explicit: bool) -> u64 {
        if self.nmaps.load(SeqCst) == 0 {
            return 0;
        }
        let Some(svc) = self.core.maps.get() else { return 0 };
        let ps = self.ps();
        let _g = self.scan_lock.lock();
        let mut found = Vec::new();
        for m in self.maps.read().iter().filter(|m| m.tracked) {
            if svc.kernel.is_some() {
                svc.take_written(m, a, b, ps, &mut found);
            } else if explicit {
                let r = m.pages(ps);
                let end = self.len().div_ceil(1 << ps);
                found.extend(r.start.max(a)..r.end.min(b).min(end));
            }
        }
        crate::map::dedup_pages(&mut found);
        self.mark_found_dirty(&found)
    }

    /// Pin the valid pages from `page` up to `last` (within one chunk), filling `page` (and
    /// a cluster after it) if needed, for the fault handler. Returns the chunk and how many
    /// pages are pinned (at least one). Read-ahead runs as for a read of `page..=last`: a
    /// sequential miss opens a window beyond the cluster, a marked page queues the next one.
    /// => `page` lies within the file.
    pub(crate) fn pin_for_fault(&self, page: u64, last: u64) -> Result<(&Chunk, u64)> {
        let (ci, _) = self.locate(page);
        let chunk = self.table.get_or_create(ci);
        let chunk_last = ((ci + 1) << self.core.chunk_shift) - 1;
        let last = last.min(chunk_last);
        let n = self.pin_run(chunk, page, last, Some(last))?;
        Ok((chunk, n))
    }

    pub(crate) fn unpin_fault(&self, chunk: &Chunk, page: u64, n: u64) {
        self.unpin_run(chunk, page, n);
    }

    /// Map every page of `[a, b)` resident now into the new mapping `m` (so resident pages
    /// never trap). Pages being filled are waited for; their filler may map them first.
    pub(crate) fn map_resident(&self, svc: &crate::map::MapService, m: &UserMap, a: u64, b: u64) {
        let cs = self.core.chunk_shift;
        self.table.for_each(a >> cs, (b >> cs).saturating_add(1), |chunk| {
            let base = chunk.index << cs;
            let (lo, hi) = (a.max(base), b.min(base + (1 << cs)));
            let mut p = lo;
            while p < hi {
                let mut n = 0;
                while p + n < hi {
                    let st = &chunk.pages[(p + n - base) as usize];
                    if st.load() & (VALID | BUSY) == 0 || !matches!(st.pin(), Pin::Pinned { .. }) {
                        break;
                    }
                    n += 1;
                }
                if n > 0 {
                    svc.map_pages(self, m, p, p + n, true);
                    self.unpin_run(chunk, p, n);
                }
                p += n + 1;
            }
        });
    }

    /// Populate mode (no userfaultfd): pin every page of `[a, b)` within the file, filling
    /// them, for the life of a mapping. Returns the pinned runs (chunk index, first, last).
    pub(crate) fn pin_all(&self, a: u64, b: u64) -> Result<Vec<(u64, u64, u64)>> {
        let cs = self.core.chunk_shift;
        let b = b.min(self.len().div_ceil(1 << self.ps()));
        if b.saturating_sub(a) > self.core.budget_pages / 2 {
            return Err(Error::BudgetExceeded {
                needed: (b - a) << self.ps(),
                budget: self.core.budget_pages << self.ps(),
            });
        }
        let mut runs = Vec::new();
        let mut p = a;
        while p < b {
            let ci = p >> cs;
            let last = (b - 1).min(((ci + 1) << cs) - 1);
            let chunk = self.table.get_or_create(ci);
            if let Err(e) = self.pin_range(chunk, p, last) {
                self.unpin_all(&runs);
                return Err(e);
            }
            runs.push((ci, p, last));
            p = last + 1;
        }
        Ok(runs)
    }

    pub(crate) fn unpin_all(&self, runs: &[(u64, u64, u64)]) {
        for &(ci, first, last) in runs {
            if let Some(chunk) = self.table.get(ci) {
                self.unpin_range(chunk, first, last);
            }
        }
    }
}

impl Object {
    /// Evict every clean, unheld page (deactivation of a closed object). Returns pages freed.
    pub(crate) fn evict_clean(&self) -> u64 {
        let cs = self.core.chunk_shift;
        let mut freed = 0;
        self.table.for_each(0, u64::MAX, |chunk| {
            let base = chunk.index << cs;
            let taken: Vec<u64> = (0..chunk.pages.len())
                .filter(|&i| chunk.pages[i].try_lock_for_evict())
                .map(|i| base + i as u64)
                .collect();
            if taken.is_empty() {
                return;
            }
            {
                let mut pol = self.core.policy.lock();
                for &p in &taken {
                    pol.remove(self.key(p));
                }
            }
            self.release_evicted(&taken);
            freed += taken.len() as u64;
        });
        freed
    }
}

impl Drop for Object {
    fn drop(&mut self) {
        // Teardown: the registry no longer lists us and no File exists, so no page is held.
        let resident = self.resident.load(Relaxed);
        if resident > 0 {
            let _ = self.drop_pages(0, u64::MAX);
        }
        let table = &self.table;
        self.core.windows.release_all(|f| table.for_each(0, u64::MAX, |c| f(c)));
        self.core.retire_stats(self.counters.snapshot());
    }
}

/// Contiguous runs `[a, b)` of a sorted list of page indexes.
/// A `size_lock` guard and its place in the lock order (`order.rs`); the lock is released
/// first (fields drop in order).
struct SizeGuard<G> {
    _lock: G,
    _rank: crate::order::Hold,
}

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

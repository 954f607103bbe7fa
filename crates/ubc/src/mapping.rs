//! Memory mappings served by the cache (`File::map`): the object's own pages mapped into
//! the caller's address space, so a store through a mapping is at once visible to `read_at`
//! and every other mapping, and a `write_at` at once visible through every mapping — one copy,
//! coherent by construction (UBC: "So what is UBC anyway?"; Mach's `map_fd`).
//!
//! Shared mappings map the object's memfd `MAP_SHARED`; private mappings `MAP_PRIVATE` (Mach's
//! virtual copy: copy-on-write, the file never sees their stores). Pages arrive on demand
//! through the cache's fault handler (`map/service.rs`); stores are found by write-protect
//! tracking and written back by [`Mapping::flush`], `File::sync`, the flusher and eviction.
//!
//! Without userfaultfd (or with `CacheBuilder::userfaultfd(false)`) a mapping is populated
//! at creation and its pages stay pinned until it is dropped; stores cannot be seen, so a
//! flush or sync writes back every page of a writable shared mapping. `CacheStats::map_mode`
//! tells which mode is in use and why.

use crate::error::{Error, Result};
use crate::file::File;
use crate::map::UserMap;
use crate::memfd::Sharing;
use crate::object::{Harvest, Object, Pass, checked_end};
use crate::pager::Access;
use std::ops::{Deref, DerefMut, Range};
use std::sync::Arc;

/// A mapping of a range of a cached file (see [`File::map`]).
///
/// The slice it derefs to aliases memory that other threads, `write_at` and other mappings
/// may change at any time (like any shared mapping, or `memmap2`): read it as a snapshot of
/// bytes, not as memory Rust owns exclusively. Touching a page past the end of the file
/// raises `SIGBUS`, as with the kernel's own `mmap`; so does a page the pager cannot read
/// (the error is counted in `CacheStats::map_sigbus`), unless the pager's read was
/// interrupted by the bytes changing underneath (`io::ErrorKind::Interrupted`, see
/// [`Pager::get_pages`](crate::Pager::get_pages)): then the access faults again.
pub struct Mapping {
    map: Arc<UserMap>,
    obj: Arc<Object>,
    /// Keeps the file (and the cache) open for as long as the mapping exists.
    _file: File,
    /// The caller's range within the mapping (which starts at a page boundary).
    ptr: *mut u8,
    len: usize,
    offset: u64,
    writable: bool,
    /// Populate mode: the pinned runs to release on drop.
    pinned: Vec<(u64, u64, u64)>,
}

// SAFETY: the mapping is process memory shared by design; all cache state it refers to is
// thread-safe.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only hands out shared slices and thread-safe calls.
unsafe impl Sync for Mapping {}

impl File {
    /// Map bytes `range` of the file into memory (`mmap(2)` served by the cache): the
    /// mapping shows the cache's own pages, so it is coherent with `read_at`/`write_at`,
    /// windows and every other mapping of the file, with no second copy.
    ///
    /// `access` is the protection: a `ReadWrite` `Shared` mapping needs a writable handle
    /// ([`Error::ReadOnly`] otherwise); a `Private` mapping may be written through a
    /// read-only handle (its stores never reach the file). The range may extend past the
    /// end of the file; touching a page wholly past the end raises `SIGBUS`, as with the
    /// kernel's `mmap`. An empty range or one ending past 2^63 is an error.
    ///
    /// Pages are faulted in on demand by the cache's userfaultfd handler and count against
    /// the cache budget; without userfaultfd the range is populated and pinned at once and
    /// may be at most half the budget ([`Error::BudgetExceeded`]). See [`Mapping`].
    pub fn map(&self, range: std::ops::Range<u64>, access: Access, sharing: Sharing) -> Result<Mapping> {
        if access == Access::ReadWrite && sharing == Sharing::Shared {
            self.live_writable()?;
        } else {
            self.live()?;
        }
        Mapping::new(self, &self.obj, range, access, sharing)
    }
}

impl Mapping {
    /// Map `range` of `file`. => `file` is open.
    pub(crate) fn new(
        file: &File,
        obj: &Arc<Object>,
        range: Range<u64>,
        access: Access,
        sharing: Sharing,
    ) -> Result<Mapping> {
        if range.end <= range.start {
            return Err(Error::InvalidArgument(format!("cannot map an empty range {range:?}")));
        }
        checked_end(range.start, 0)?;
        let len = usize::try_from(range.end - range.start)
            .map_err(|_| Error::InvalidArgument("mapping larger than the address space".into()))?;
        checked_end(range.start, len)?;
        let memory = obj.memory_for_map()?;
        if sharing == Sharing::Private && memory.is_hugetlb() {
            // hugetlbfs drops a private mapping's copies with the file's page when a hole is
            // punched (measured: a stored byte reads 0 after the punch, where shmem keeps
            // it), and eviction punches: the stores would be lost.
            return Err(Error::InvalidArgument(
                "a private mapping of a cache on hugetlb pages would lose its stores when the page is evicted".into(),
            ));
        }
        let ps = obj.page_shift();
        let start = range.start >> ps << ps;
        let end = range.end.div_ceil(1 << ps) << ps;
        let map_len = (end - start) as usize;
        let svc = obj.res.map_service().clone();
        let addr = memory.map_user(start, map_len, sharing, access)? as usize;
        let unmap = || {
            // SAFETY: our fresh mapping; nothing refers to it yet.
            unsafe { crate::memfd::unmap(addr as *mut u8, map_len) }
        };
        let target: std::sync::Weak<dyn crate::map::Mapped> = Arc::downgrade(obj) as _;
        let um = Arc::new(UserMap::new(addr, map_len, start, target, sharing, access, memory.granule()));
        let (a, b) = (start >> ps, end >> ps);
        let mut pinned = Vec::new();
        if svc.kernel.is_some() {
            if let Err(e) = svc.register(&um) {
                unmap();
                return Err(e);
            }
            // Listed before populating: a fill from now on maps its pages here itself, and
            // a fill already running is waited for by `map_resident`.
            obj.maps.write().push(um.clone());
            obj.nmaps.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            obj.map_resident(&svc, &um, a, b);
        } else {
            if um.tracked
                && let Err(e) = obj.unlock_for_change(start, end)
            {
                // Without userfaultfd stores cannot be trapped later: the whole range is
                // asked for now.
                unmap();
                return Err(e);
            }
            match obj.pin_all(a, b) {
                Ok(runs) => pinned = runs,
                Err(e) => {
                    unmap();
                    return Err(e);
                }
            }
            svc.register(&um)?;
            obj.maps.write().push(um.clone());
            obj.nmaps.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if um.tracked {
                // Stores will reach these pages with no fault to see them: windows that lent
                // them get their copies now (a window lent later copies them itself).
                obj.break_loans(a, b - 1);
            }
        }
        let delta = (range.start - start) as usize;
        Ok(Mapping {
            map: um,
            obj: obj.clone(),
            _file: file.try_clone()?,
            ptr: (addr + delta) as *mut u8,
            len,
            offset: range.start,
            writable: access == Access::ReadWrite,
            pinned,
        })
    }

    /// The first mapped byte (file offset [`Mapping::offset`]).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The first mapped byte, for stores (a read-only mapping faults on them).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// File offset of the first mapped byte.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// `madvise(2)` for this mapping: `Normal`, `Random` (each fault fills its page alone:
    /// no fault-around, no read-ahead), `Sequential` (faults read ahead from the first, up to
    /// twice the window) and `NoReuse` (pages its faults fill are kept least) steer its
    /// faults from now on; `WillNeed` queues the fill of the mapped range's pages not cached
    /// (as `File::advise`); `DontNeed` writes the range's stores and dirty pages back and
    /// waits — the pages stay mapped and cached (on a shared file mapping Linux only drops
    /// the page-table entries, which ubc needs to find stores).
    pub fn advise(&self, advice: crate::Advice) -> Result<()> {
        let (from, to) = (self.offset, self.offset + self.len as u64);
        match advice {
            crate::Advice::WillNeed => self.obj.will_need(from, to),
            crate::Advice::DontNeed => self.obj.clean(from, to)?,
            pattern => self.map.pattern.store(pattern as u8, std::sync::atomic::Ordering::Relaxed),
        }
        Ok(())
    }

    /// `msync(MS_SYNC)`: stores made through this mapping (and any other dirty page of the
    /// range) reach the pager, then the pager's sync. On error the pages stay dirty.
    pub fn flush(&self) -> Result<()> {
        let ps = self.obj.page_shift();
        let (a, b) = (self.offset >> ps, (self.offset + self.len as u64).div_ceil(1 << ps));
        self.obj.harvest(a, b, Harvest::Explicit);
        self.obj.writeback(a, b, Pass::Wait)?;
        self.obj.sync_pager()
    }
}

impl Deref for Mapping {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is mapped for as long as `self` lives (see the type's note
        // on concurrent changes).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for Mapping {
    /// Panics if the mapping is read-only (a store would be a segmentation fault).
    fn deref_mut(&mut self) -> &mut [u8] {
        assert!(self.writable, "ubc::Mapping: mutable access to a read-only mapping");
        // SAFETY: as in `deref`; writable.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let ps = self.obj.page_shift();
        let (a, b) = (self.map.offset >> ps, (self.map.offset + self.map.len as u64) >> ps);
        // Stores made through this mapping are found before it goes (munmap forgets them).
        self.obj.harvest(a, b, Harvest::Explicit);
        if let Some(svc) = self.obj.res.maps.get() {
            svc.unregister(&self.map);
        }
        {
            let mut maps = self.obj.maps.write();
            maps.remove(&self.map);
            self.obj.nmaps.store(maps.len() as u32, std::sync::atomic::Ordering::SeqCst);
        }
        // SAFETY: nobody maps pages into it any more (unregistered under its `alive` lock);
        // the caller gave the mapping up.
        unsafe { crate::memfd::unmap(self.map.addr as *mut u8, self.map.len) };
        self.obj.unpin_all(&self.pinned);
    }
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("writable", &self.writable)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use crate::evict::PageKey;
    use crate::pager::MemPager;
    use crate::{Access, Cache, Sharing};
    use std::sync::Arc;

    /// The eviction daemon takes a clean mapped page; a store through the mapping lands
    /// before the page is zapped, and the mapping is dropped (its last scan marks the held
    /// page dirty); only then does the eviction go on, with no mapping left. The store must
    /// stay: `release_evicted` must look for dirty pages whether or not mappings still
    /// exist, else it punches the page and the store is lost (reading right after
    /// unmapping shows zeros or old data).
    #[test]
    fn store_found_when_its_mapping_is_dropped_survives_an_eviction_in_flight() {
        let cache = Cache::builder().budget(16 << 20).build().unwrap();
        let mem = Arc::new(MemPager::new());
        crate::Pager::put_pages(&*mem, 0, &[7u8; 4 * 4096]).unwrap();
        let f = cache.open(mem.clone(), Access::ReadWrite).unwrap();
        let mut m = f.map(0..4 * 4096, Access::ReadWrite, Sharing::Shared).unwrap();
        if cache.stats().map_mode != "userfaultfd" {
            return; // populate mode pins mapped pages: nothing to evict
        }
        assert_eq!(m[4096], 7);
        let obj = m.obj.clone();
        // What the daemon does to a victim: take it, make the policy forget it. (The fault
        // handler may still pin it for a moment after waking the access.)
        let st = obj.page_state(1).unwrap();
        let t0 = std::time::Instant::now();
        while !st.try_lock_for_evict() {
            assert!(t0.elapsed().as_secs() < 10, "page 1 never became clean and idle: {:?}", st.snapshot());
            std::thread::yield_now();
        }
        let slot = obj.table.get(0).unwrap().pages.slot_at(1).load(std::sync::atomic::Ordering::Relaxed);
        obj.res.policy.lock().remove(slot, PageKey { object: obj.id, index: 1 });
        m[4096..4096 + 5].copy_from_slice(b"hello");
        drop(m);
        obj.release_evicted(&[1]);
        let mut buf = [0u8; 5];
        f.read_exact_at(&mut buf, 4096).unwrap();
        assert_eq!(&buf, b"hello", "a store found at unmap survives the eviction that held its page");
        f.sync().unwrap();
        let mut stored = [0u8; 5];
        crate::Pager::get_pages(&*mem, 4096, &mut stored).unwrap();
        assert_eq!(&stored, b"hello", "and reaches the pager");
    }
}

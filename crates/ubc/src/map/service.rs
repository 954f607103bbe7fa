//! The mapping service: the cache's fault handler threads and the table of user mappings
//! (NetBSD's `uvm_fault.c` and the map entries it looks faults up in).
//!
//! Made the first time a file of the cache is mapped (a cache that never maps costs
//! nothing). One userfaultfd serves every mapping of the cache; `threads` handler threads
//! read it, so faults on different files (or different pages) are resolved in parallel: the
//! only shared lock on the fault path is the read side of the address table.
//!
//! The scheme (see `mod.rs`, "How the cache uses it"):
//! * user mappings are registered MISSING + MINOR (+ WP for shared writable ones): a page
//!   reaches a user page table only through [`MapService::map_pages`] (`UFFDIO_CONTINUE`),
//!   called by someone holding the page (pinned, or BUSY at the end of a fill). The kernel
//!   never maps a memfd page behind the cache's back, so eviction can zap a page out of
//!   every mapping, find its stores, and punch it, without a store slipping in between.
//! * every fill maps its pages into the object's mappings before they become valid, and a
//!   new mapping maps every resident page at once: resident pages never trap.
//! * a fault on a page that is not resident fills it through the ordinary read path, maps
//!   it, wakes. A fault right after the mapping's previous one fills a cluster (16 pages,
//!   doubling on each further sequential fault up to 256); any other fills the one page, and
//!   read-ahead decides by the object's streams as for a `read` (`object/readahead.rs`):
//!   random faults read one page each, as random reads do.
//! * a fault past the end of the file, or a pager error, poisons the page in that mapping:
//!   the access gets SIGBUS (EFAULT for a kernel access), like the kernel's own mmap.

use super::{Event, FillMode, Mode, Pagemap, Ready, Uffd, UffdMsg, Waker, feature};
use crate::Advice;
use crate::error::{Error, Result};
use crate::memfd::Sharing;
use crate::page::state::PageState;
use crate::page::table::Chunk;
use crate::pager::Access;
use parking_lot::{Mutex, RwLock};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

/// Fault-around cluster after a sequential fault, and its largest size (pages). A fault not
/// right after the previous one reads its page alone.
const CLUSTER_INIT: u64 = 16;
const CLUSTER_MAX: u64 = 256;

/// The kernel half: present when userfaultfd and `PAGEMAP_SCAN` can run the scheme.
pub(crate) struct Kernel {
    pub(crate) uffd: Uffd,
    pub(crate) pagemap: Pagemap,
    waker: Waker,
}

pub(crate) struct MapService {
    /// `None`: mappings are populated and pinned instead (the reason is in `mode`).
    pub(crate) kernel: Option<Kernel>,
    /// "userfaultfd" or "populate: <why userfaultfd cannot be used>".
    pub(crate) mode: String,
    /// Live user mappings by start address.
    table: RwLock<BTreeMap<usize, Arc<UserMap>>>,
    live: AtomicU64,
    stopping: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    pub(crate) faults: AtomicU64,
    pub(crate) fault_pages: AtomicU64,
    pub(crate) sigbus: AtomicU64,
    /// Faults whose pager failed (a part of `sigbus`); the first few are told on stderr.
    fill_errors: AtomicU64,
    pub(crate) scan_dirty: AtomicU64,
}

/// Fill errors told on stderr, per process. A SIGBUS usually ends the process with no word of
/// its cause, and nothing else reports it (stats.rs died of SIGBUS in CI, and which error the
/// fill had met could only be reasoned out afterwards); a program that handles SIGBUS and
/// goes on is told of only the first few.
const FILL_ERRORS_TOLD: u64 = 8;

/// Interrupted fills (see `Pager::get_pages`): the pause before the access faults again,
/// and how many in a row one mapping may have before the next raises SIGBUS (about two
/// seconds of a file being rewritten without a moment's rest).
const INTERRUPTED_PAUSE: std::time::Duration = std::time::Duration::from_micros(200);
const INTERRUPTED_MAX: u32 = 10_000;

/// What the fault service needs from a mapped object (`object/mapped.rs` implements it). The
/// service sits below objects: it reaches them only through this, and objects call down
/// into it (to map pages they hold).
pub(crate) trait Mapped: Send + Sync {
    /// log2 of the cache page size.
    fn page_shift(&self) -> u32;
    /// The file's length in bytes.
    fn len(&self) -> u64;
    /// The state word of cached page `page`, if its chunk exists.
    fn page_state(&self, page: u64) -> Option<&PageState>;
    /// Make sure the memfd holds memory for bytes `offset..offset + len` (so CONTINUE finds
    /// pages there).
    fn materialize(&self, offset: u64, len: u64);
    /// Pin pages `page..=last` for a fault, filling them if needed (read-ahead and admission
    /// as `pattern`, the mapping's advice, says): the chunk and how many pages from `page`
    /// are pinned.
    fn pin_for_fault(&self, page: u64, last: u64, pattern: Advice) -> Result<(&Chunk, u64)>;
    /// Undo `pin_for_fault`.
    fn unpin_fault(&self, chunk: &Chunk, page: u64, n: u64);
    /// Pages `a..b` are about to be mapped into a shared writable mapping, where stores
    /// reach them unseen: give windows that lent them their copies first (page loanout).
    /// => the caller holds the pages.
    fn before_writable_map(&self, a: u64, b: u64);
    /// Whether the pager write-locked page `page` (a shared writable mapping must not map
    /// it until the pager allows stores: `allow_stores`).
    fn store_locked(&self, page: u64) -> bool;
    /// Bracket the mapping of pages into a shared writable mapping, their locks looked at
    /// inside (a pager's lock waits for brackets begun before it).
    fn begin_writable_map(&self) -> usize;
    fn end_writable_map(&self, token: usize);
    /// A fault of a shared writable mapping on pages `a..b`: ask the pager to unlock those
    /// it locked (`Pager::unlock_request`). => nothing of the object held.
    fn allow_stores(&self, a: u64, b: u64) -> Result<()>;
    /// A fault on page `page` is about to be served: what the pager needs held meanwhile
    /// (`Pager::fault_guard`; `store`: a shared writable mapping's). => nothing of the
    /// object held.
    fn fault_guard(&self, page: u64, store: bool) -> Result<Option<crate::pager::FaultGuard>>;
}

/// One user mapping of an object: its address range and how it was registered.
pub(crate) struct UserMap {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    /// File (and memfd) offset of `addr`; a multiple of the cache page size.
    pub(crate) offset: u64,
    pub(crate) obj: Weak<dyn Mapped>,
    /// MAP_SHARED and writable: stores reach the file and are tracked (WP_ASYNC). (A
    /// MAP_PRIVATE mapping's stores are copied on write: the file never sees them.)
    pub(crate) tracked: bool,
    /// MAP_PRIVATE: the pages its stores copy are the program's memory, counted against the
    /// cache's budget (`MapService::private_copies`).
    pub(crate) private: bool,
    /// Set false (under the write lock) before the address range is unmapped: whoever maps
    /// pages into it, poisons or wakes holds the read lock and checks it first, so nothing is
    /// ever placed at an address that a later mmap may have reused.
    pub(crate) alive: RwLock<bool>,
    /// Fault-around: the page after the last cluster, and the current cluster size.
    next: AtomicU64,
    cluster: AtomicU64,
    /// Faults in a row whose fill was interrupted (the bytes were changing underneath):
    /// past `INTERRUPTED_MAX` the next one raises SIGBUS, so that a pager that never
    /// stops answering "interrupted" cannot keep an access faulting forever.
    interrupted: AtomicU32,
    /// The mapping's advice (`Mapping::advise`), an `Advice` as u8: steers its faults.
    pub(crate) pattern: std::sync::atomic::AtomicU8,
    /// The smallest unit the kernel maps, poisons and wakes in it: the system page, or the
    /// huge page of a hugetlb memfd (whose ranges must be aligned to it).
    pub(crate) granule: usize,
}

impl UserMap {
    pub(crate) fn new(
        addr: usize,
        len: usize,
        offset: u64,
        obj: Weak<dyn Mapped>,
        sharing: Sharing,
        access: Access,
        granule: usize,
    ) -> UserMap {
        UserMap {
            granule,
            addr,
            len,
            offset,
            obj,
            tracked: sharing == Sharing::Shared && access == Access::ReadWrite,
            private: sharing == Sharing::Private,
            alive: RwLock::new(true),
            next: AtomicU64::new(u64::MAX),
            cluster: AtomicU64::new(CLUSTER_INIT),
            interrupted: AtomicU32::new(0),
            pattern: std::sync::atomic::AtomicU8::new(Advice::Normal as u8),
        }
    }

    /// File pages `[first, end)` this mapping covers, for a page shift `ps`.
    pub(crate) fn pages(&self, ps: u32) -> Range<u64> {
        self.offset >> ps..(self.offset + self.len as u64) >> ps
    }

    /// Address of file page `page` in this mapping. => `page` within `pages()`.
    pub(crate) fn addr_of(&self, page: u64, ps: u32) -> usize {
        self.addr + ((page << ps) - self.offset) as usize
    }

    /// The part of file pages `[a, b)` inside this mapping, as an address range.
    pub(crate) fn span(&self, a: u64, b: u64, ps: u32) -> Option<(usize, usize)> {
        let r = self.pages(ps);
        let (a, b) = (a.max(r.start), b.min(r.end));
        (a < b).then(|| (self.addr_of(a, ps), ((b - a) << ps) as usize))
    }
}

/// How a cache serves memory mappings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Serve {
    /// Through userfaultfd, if the kernel offers it (else as `Populate`, saying why).
    Userfaultfd,
    /// Populate and pin each mapping's pages when it is made (`CacheBuilder::userfaultfd(false)`).
    Populate,
}

/// What `map_pages` does with a valid page the memfd holds no memory for (a hole, which
/// `UFFDIO_CONTINUE` refuses with `EFAULT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Holes {
    /// Allocate its (zeroed) memory and map it: a fault or a new mapping needs the page now.
    Allocate,
    /// Leave it unmapped (it traps when touched): a fill publishing pages maps what it can
    /// without allocating memory for holes no one may touch.
    Skip,
}

impl MapService {
    /// Pages the private mappings have copied on write (anonymous pages present in them),
    /// counted by `PAGEMAP_SCAN`; 0 without the kernel's help (populate mode). The page
    /// daemon charges them against the budget (`Resources::charged`).
    /// Bytes of the private mappings' copies (anonymous pages present in them).
    pub(crate) fn private_copies(&self) -> u64 {
        let Some(k) = &self.kernel else { return 0 };
        let private: Vec<Arc<UserMap>> = self.table.read().values().filter(|m| m.private).cloned().collect();
        let anon = super::pagemap::Query::ANON;
        private
            .iter()
            .filter(|m| *m.alive.read())
            .map(|m| k.pagemap.scan(m.addr, m.len, anon, |_| {}).unwrap_or(0))
            .sum::<u64>()
            * super::page_size() as u64
    }

    /// Probe the kernel and start `threads` handler threads; without userfaultfd (or with
    /// `Serve::Populate`), a service in populate mode.
    pub(crate) fn start(serve: Serve, threads: usize) -> Arc<MapService> {
        let kernel = match serve {
            Serve::Userfaultfd => open_kernel(),
            Serve::Populate => Err("userfaultfd disabled by CacheBuilder::userfaultfd(false)".into()),
        };
        let mode = match &kernel {
            Ok(_) => "userfaultfd".to_string(),
            Err(why) => format!("populate ({why})"),
        };
        let svc = Arc::new(MapService {
            kernel: kernel.ok(),
            mode,
            table: RwLock::new(BTreeMap::new()),
            live: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            faults: AtomicU64::new(0),
            fault_pages: AtomicU64::new(0),
            sigbus: AtomicU64::new(0),
            fill_errors: AtomicU64::new(0),
            scan_dirty: AtomicU64::new(0),
        });
        if svc.kernel.is_some() {
            let mut ts = svc.threads.lock();
            for i in 0..threads.max(1) {
                let s = svc.clone();
                match std::thread::Builder::new().name(format!("ubc-fault-{i}")).spawn(move || s.handler_loop()) {
                    Ok(t) => ts.push(t),
                    Err(e) if i == 0 => panic!("cannot start the ubc fault handler thread: {e}"),
                    Err(_) => break,
                }
            }
        }
        svc
    }

    /// Stop the handler threads. => no user mapping is left (each holds the cache open).
    pub(crate) fn stop(&self) {
        self.stopping.store(true, SeqCst);
        if let Some(k) = &self.kernel {
            k.waker.wake();
        }
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }

    pub(crate) fn live(&self) -> u64 {
        self.live.load(Relaxed)
    }

    /// Register a new user mapping `m` (already mmapped) with the kernel and the table.
    pub(crate) fn register(&self, m: &Arc<UserMap>) -> Result<()> {
        if let Some(k) = &self.kernel {
            let mode = Mode { missing: true, minor: true, wp: m.tracked };
            k.uffd.register(m.addr, m.len, mode).map_err(|e| Error::os("userfaultfd register", e))?;
            if m.tracked {
                // Protect at once: it leaves markers in empty ptes, so every page mapped later
                // arrives protected and the first scan does not see the whole range written.
                k.uffd.writeprotect(m.addr, m.len, true).map_err(|e| Error::os("userfaultfd writeprotect", e))?;
            }
        }
        self.table.write().insert(m.addr, m.clone());
        self.live.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Forget a user mapping: after this nobody maps pages into it. => it is still mapped.
    pub(crate) fn unregister(&self, m: &UserMap) {
        *m.alive.write() = false;
        self.table.write().remove(&m.addr);
        self.live.fetch_sub(1, Relaxed);
    }

    /// Whether `ptr..ptr+len` overlaps any user mapping of this cache.
    pub(crate) fn overlaps(&self, ptr: usize, len: usize) -> bool {
        if self.live() == 0 || len == 0 {
            return false;
        }
        let t = self.table.read();
        t.range(..ptr + len).next_back().is_some_and(|(_, m)| m.addr + m.len > ptr)
    }

    /// Map file pages `[a, b)` (valid, and held by the caller: pinned, or BUSY for
    /// eviction) into `m`. With `materialize`, a valid page the memfd does not hold yet (a
    /// hole never written) is allocated (zeroed) and mapped; without, it is skipped (it
    /// will trap once). Only pages `PageState::is_mappable` says may be are mapped, whatever
    /// the caller holds:
    /// * not a page that is not valid: a store through the mapping must land on a page a
    ///   scan can mark dirty (pages once mapped while still being filled lost a store found
    ///   then — see `publish_filled`); a caller that maps too early gets traps, not lost
    ///   stores;
    /// * not the read-ahead marker a fill just published: a reader through the mapping
    ///   traps there once (MINOR: the page is resident) and the handler, pinning it, queues
    ///   the next window — Linux's `PG_readahead` met by a fault (`do_async_mmap_readahead`).
    ///
    /// Errors are ignored: a page not mapped now traps and is mapped then.
    pub(crate) fn map_pages(&self, obj: &dyn Mapped, m: &UserMap, a: u64, b: u64, holes: Holes) {
        if self.kernel.is_none() {
            return;
        }
        if m.tracked && b > a {
            obj.before_writable_map(a, b);
        }
        // A page the pager write-locked stays out of a shared writable mapping: the access
        // faults, and the fault asks the pager first.
        let token = m.tracked.then(|| obj.begin_writable_map());
        let mappable =
            |p: u64| obj.page_state(p).is_some_and(|s| s.is_mappable()) && !(m.tracked && obj.store_locked(p));
        let mut p = a;
        while p < b {
            if !mappable(p) {
                p += 1;
                continue;
            }
            let mut q = p + 1;
            while q < b && mappable(q) {
                q += 1;
            }
            self.map_run(obj, m, p, q, holes);
            p = q;
        }
        if let Some(t) = token {
            obj.end_writable_map(t);
        }
    }

    /// `map_pages` for a run of mappable pages.
    fn map_run(&self, obj: &dyn Mapped, m: &UserMap, a: u64, b: u64, holes: Holes) {
        let Some(k) = &self.kernel else { return };
        let ps = obj.page_shift();
        let Some((start, len)) = m.span(a, b, ps) else { return };
        let alive = m.alive.read();
        if !*alive {
            return;
        }
        let sys = m.granule;
        let mode = FillMode { dontwake: true, wp: m.tracked };
        let mut off = 0;
        let mut tries = 0;
        while off < len {
            match k.uffd.continue_(start + off, len - off, mode) {
                Ok(()) => break,
                Err(e) if e.done > 0 => {
                    off += e.done;
                    tries = 0;
                }
                Err(e) if e.errno == libc::EFAULT && holes == Holes::Allocate && tries == 0 => {
                    // Not in the memfd: a valid hole. Allocate the zero page and retry.
                    let file_off = m.offset + (start + off - m.addr) as u64;
                    obj.materialize(file_off, sys as u64);
                    tries += 1;
                }
                Err(e) if e.errno == libc::EAGAIN && tries < 8 => tries += 1,
                Err(_) => {
                    // EEXIST (mapped already) or a page we cannot map now: skip it.
                    off += sys;
                    tries = 0;
                }
            }
        }
    }

    /// Find the written pages of `m` within file pages `[a, b)` and protect them again.
    /// Returns their file page indexes (ascending, may repeat when pages are larger than the
    /// system page). => caller holds the object's scan lock.
    pub(crate) fn take_written(&self, m: &UserMap, a: u64, b: u64, ps: u32, out: &mut Vec<u64>) {
        self.collect_written(m, a, b, ps, out, false);
    }

    /// Zap file pages `[a, b)` out of tracked mapping `m` and append to `out` those stored
    /// to since the last scan (eviction and a pager's lock: afterwards a store traps, and
    /// waits for whoever holds the page). => caller holds the object's scan lock and the
    /// pages.
    ///
    /// Zap first, then look: a store between a look and the zap would otherwise be lost with
    /// the page. On shmem the written state survives the zap (an empty pte where a marker is
    /// not reads as written). On hugetlb it does not — a zapped written huge pte is just
    /// empty, which `PAGEMAP_SCAN` does not call written (measured on 6.18) — but a zapped
    /// *protected* one leaves a WP marker, and every pte of the mapping holds a page or a
    /// marker from registration on; so an empty pte after the zap is a page written since
    /// the last scan. Those are then protected again (a marker each), so the next scan does
    /// not find them a second time.
    pub(crate) fn zap_taking_written(&self, m: &UserMap, a: u64, b: u64, ps: u32, out: &mut Vec<u64>) {
        self.zap(m, a, b, ps);
        self.collect_written(m, a, b, ps, out, m.granule > super::page_size());
    }

    /// `take_written`, or with `zapped_huge` the empty ptes of a zapped hugetlb range (see
    /// `zap_taking_written`), protected again.
    fn collect_written(&self, m: &UserMap, a: u64, b: u64, ps: u32, out: &mut Vec<u64>, zapped_huge: bool) {
        let Some(k) = &self.kernel else { return };
        if !m.tracked {
            return;
        }
        let Some((start, len)) = m.span(a, b, ps) else { return };
        let alive = m.alive.read();
        if !*alive {
            return;
        }
        let mut runs = Vec::new();
        let scanned = if zapped_huge {
            k.pagemap.empty(start, len, &mut runs)
        } else {
            k.pagemap.take_written(start, len, &mut runs)
        };
        if scanned.is_err() {
            // Cannot happen for a range registered WP on a WP_ASYNC uffd; if it did, the
            // safe answer is that every page may be written.
            #[allow(clippy::single_range_in_vec_init)] // one run: the whole mapping
            {
                runs = vec![start..start + len];
            }
        }
        for r in runs {
            let first = (m.offset + (r.start - m.addr) as u64) >> ps;
            let end = (m.offset + (r.end - m.addr) as u64).div_ceil(1 << ps);
            out.extend(first..end);
            if zapped_huge {
                let _ = k.uffd.writeprotect(r.start, r.end - r.start, true);
            }
        }
    }

    /// Zap file pages `[a, b)` out of `m`'s page table (eviction: afterwards a store traps
    /// instead of reaching the page). The written state of the ptes survives for the scan.
    pub(crate) fn zap(&self, m: &UserMap, a: u64, b: u64, ps: u32) {
        let Some((start, len)) = m.span(a, b, ps) else { return };
        let alive = m.alive.read();
        if *alive {
            // SAFETY: MADV_DONTNEED on a shared memfd mapping only drops ptes; the memfd keeps
            // its pages, so no memory a Rust reference points to changes.
            unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED) };
        }
    }

    /// After the file grew: clear poison (SIGBUS markers left by touches past the old end)
    /// from file pages `[a, b)` of `m`.
    pub(crate) fn unpoison(&self, m: &UserMap, a: u64, b: u64, ps: u32) {
        let Some(k) = &self.kernel else { return };
        let Some((start, len)) = m.span(a, b, ps) else { return };
        let alive = m.alive.read();
        if *alive {
            if m.tracked {
                let _ = super::clear_poison(&k.uffd, start, len);
            } else {
                // SAFETY: as in `zap`; for a private mapping this also drops private copies,
                // but pages past the old end held none (touching them raised SIGBUS).
                unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED) };
            }
        }
    }

    // ---------------------------------------------------------------- fault handling

    fn handler_loop(self: Arc<Self>) {
        let k = self.kernel.as_ref().expect("handler threads run only with userfaultfd");
        let mut msgs = [UffdMsg::ZERO; 16];
        loop {
            match k.uffd.wait(Some(&k.waker), None) {
                Ok(Ready::Woken) if self.stopping.load(SeqCst) => return,
                Ok(_) => {}
                Err(_) => {
                    if self.stopping.load(SeqCst) {
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    continue;
                }
            }
            let events: Vec<Event> = match k.uffd.read_events(&mut msgs) {
                Ok(evs) => evs.collect(),
                Err(_) => continue,
            };
            for ev in events {
                if let Event::PageFault { addr, minor, .. } = ev {
                    self.serve_fault(k, addr, minor);
                }
            }
        }
    }

    /// Resolve one fault at `addr`: fill and map a cluster, or poison the page. Always wakes.
    /// A `minor` fault is on a page the memfd holds but this mapping does not map (a
    /// read-ahead marker, or a page still being filled when touched): only that page is
    /// mapped — the pages around it are mapped already by their fill — and the stream's
    /// fault-around state is left alone.
    fn serve_fault(&self, k: &Kernel, addr: usize, minor: bool) {
        self.faults.fetch_add(1, Relaxed);
        let mut sys = super::page_size();
        let mut addr = addr & !(sys - 1);
        let m = {
            let t = self.table.read();
            t.range(..=addr).next_back().filter(|(_, m)| addr < m.addr + m.len).map(|(_, m)| m.clone())
        };
        let Some(m) = m else {
            // Unmapped meanwhile (the faulting access is gone with it); wake to be safe.
            let _ = k.uffd.wake(addr, sys);
            return;
        };
        let Some(obj) = m.obj.upgrade() else {
            let _ = k.uffd.wake(addr, sys);
            return;
        };
        // Poison and wake whole granules (a hugetlb mapping refuses less).
        sys = m.granule;
        addr &= !(sys - 1);
        let ps = obj.page_shift();
        let page = (m.offset + (addr - m.addr) as u64) >> ps;
        // First, holding nothing: what the pager needs held while the fault is served (a
        // file shared between machines: its token). The length is read after it (taking a
        // token may reload it). Held to the end of the fault.
        let _guard = match obj.fault_guard(page, m.tracked) {
            Ok(g) => g,
            Err(e) => {
                self.tell_fill_error(page, &e);
                self.poison(k, &m, addr, sys);
                return;
            }
        };
        let end = obj.len().div_ceil(1 << ps).min(m.pages(ps).end);
        if page >= end {
            self.poison(k, &m, addr, sys);
            return;
        }
        // Fault-around only on sequential faults, growing like read-ahead; a random fault
        // reads its page alone (reading 16 pages for one touched made each random miss cost
        // 16 reads, and pushed 15 useful pages out of a full cache). A mapping advised
        // `Random` never faults around; one advised `Sequential` does from its first fault.
        let pattern = Advice::from_u8(m.pattern.load(Relaxed));
        let last = if minor || pattern == Advice::Random {
            page
        } else {
            let c = if m.next.load(Relaxed) == page || pattern == Advice::Sequential {
                (m.cluster.load(Relaxed) * 2).clamp(CLUSTER_INIT, CLUSTER_MAX)
            } else {
                1
            };
            m.cluster.store(c, Relaxed);
            (page + c - 1).min(end - 1)
        };
        // A shared writable mapping's fault on pages the pager write-locked: its stores will
        // not be seen one by one, so the pager is asked now, read fault or not.
        if m.tracked
            && let Err(e) = obj.allow_stores(page, last + 1)
        {
            self.tell_fill_error(page, &e);
            self.poison(k, &m, addr, sys);
            return;
        }
        match obj.pin_for_fault(page, last, pattern) {
            Ok((chunk, n)) => {
                self.fault_pages.fetch_add(n, Relaxed);
                self.map_pages(&*obj, &m, page, page + n, Holes::Allocate);
                {
                    let alive = m.alive.read();
                    if *alive {
                        if let Some((start, len)) = m.span(page, page + n, ps) {
                            let _ = k.uffd.wake(start, len);
                        }
                        let _ = k.uffd.wake(addr, sys);
                    }
                }
                obj.unpin_fault(chunk, page, n);
                m.interrupted.store(0, Relaxed);
                if !minor {
                    m.next.store(page + n, Relaxed);
                }
            }
            Err(e) if e.is_interrupted() && m.interrupted.fetch_add(1, Relaxed) < INTERRUPTED_MAX => {
                // The pager read bytes being rewritten (a stacked layer beside a write below):
                // the pages are let go (the writer's invalidation waits for them); the access
                // faults again after a pause, when the write is likely done.
                std::thread::sleep(INTERRUPTED_PAUSE);
                let alive = m.alive.read();
                if *alive {
                    let _ = k.uffd.wake(addr, sys);
                }
            }
            Err(e) => {
                m.interrupted.store(0, Relaxed);
                self.tell_fill_error(page, &e);
                self.poison(k, &m, addr, sys)
            }
        }
    }

    /// Say why a fault gets SIGBUS (the first few times).
    fn tell_fill_error(&self, page: u64, e: &Error) {
        if self.fill_errors.fetch_add(1, Relaxed) < FILL_ERRORS_TOLD {
            // To the process's stderr itself, not `eprintln!`: a test harness captures that
            // for the thread that made the cache (its threads inherit the capture), and the
            // capture dies with the process the SIGBUS ends — as the message did when
            // tests/stack.rs died of one in CI.
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "ubc: a fault on page {page} of a mapping could not be filled, so the access gets SIGBUS: {e}"
            );
        }
    }

    /// Make the access at `addr` fail with SIGBUS (and wake it so it does).
    fn poison(&self, k: &Kernel, m: &UserMap, addr: usize, sys: usize) {
        self.sigbus.fetch_add(1, Relaxed);
        let alive = m.alive.read();
        if !*alive {
            return;
        }
        if m.tracked {
            // POISON refuses a pte holding a WP marker.
            let _ = k.uffd.writeprotect(addr, sys, false);
        }
        if k.uffd.poison(addr, sys, false).is_err() {
            // Something is mapped there after all (the file grew meanwhile): let it retry.
            let _ = k.uffd.wake(addr, sys);
        }
    }
}

/// Open the uffd with the features the scheme needs and check `PAGEMAP_SCAN`.
fn open_kernel() -> std::result::Result<Kernel, String> {
    super::probe().map_err(|u| u.reason)?;
    let uffd =
        Uffd::open(feature::SCHEME | feature::MINOR_SHMEM, feature::MINOR_HUGETLBFS | feature::MISSING_HUGETLBFS)
            .map_err(|u| u.reason)?;
    let pagemap = Pagemap::open().map_err(|e| format!("open /proc/self/pagemap: {e}"))?;
    let waker = Waker::new().map_err(|e| format!("eventfd: {e}"))?;
    Ok(Kernel { uffd, pagemap, waker })
}

/// Written pages → ascending unique list.
pub(crate) fn dedup_pages(v: &mut Vec<u64>) {
    v.sort_unstable();
    v.dedup();
}

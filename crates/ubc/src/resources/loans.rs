//! Page loanout with copy-on-write (NetBSD UBC/UVM's loans, Cranor & Parulkar, "The UVM
//! Virtual Memory System", §7 "Page loanout"): a [`Window`](crate::Window) lends the
//! cache's pages to a borrower without copying them, and keeps the bytes it showed when it
//! was taken. A later change of a lent page through any path — `write_at`, a writable
//! window, a truncation's zeroing, a store through a shared writable mapping — first gives
//! the borrower a copy of the page as it was ("breaks the loan", UVM's `uvm_loanbreak`);
//! the cache keeps the page and takes the change.
//!
//! How the borrower's bytes are kept: loans read the cache's pages through *views*, each a
//! read-only `MAP_PRIVATE` mapping of one chunk of the object's memfd. A private file
//! mapping shows the file's pages themselves (zero copy; a read fault maps 16 at a time)
//! until something replaces them; breaking a loan copies a run of the view's pages into
//! fresh anonymous memory and moves that over the view's run with `mremap`, which replaces
//! the range in one step — a borrower reading the same addresses meanwhile sees the same
//! bytes before and after.
//!
//! Views are shared and kept: every loan of a chunk taken while its view is intact uses
//! that view (they were all lent the bytes it shows), and a view whose last loan ended
//! stays mapped for the next one (up to `IDLE_VIEWS` per cache) — it still shows the
//! memfd's current pages, as nothing was copied into it. A view a break copied into is
//! *detached*: it belongs to the loans holding it and is unmapped with the last of them;
//! the next loan of the chunk maps a fresh one. So a window costs a map of its chunk only
//! the first time, or after a write broke the chunk's loans.
//!
//! One registry per cache, keyed by object id: a writer pays one atomic load (`active`) when
//! no loan exists, and the objects pay no memory for it.
//!
//! Ordering (why a write never slips past a loan being taken), see `Object::lend`: the loan
//! is registered (`active` raised) before its pages are pinned, it gets its view under the
//! registry lock, and only then does it wait for writers already copying into its pages. A
//! writer takes its page (WRITING) and then looks for loans: either its WRITING was seen by
//! the loan's wait (which waited for it), or its look comes after the loan had its view and
//! it breaks the loan first.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::*};

/// Views whose loans all ended, kept mapped for the next loan of their chunk.
const IDLE_VIEWS: usize = 64;

/// A private read-only mapping of one chunk of an object's memfd.
struct View {
    id: u64,
    obj: u64,
    /// The chunk's first page and its number of pages.
    first: u64,
    pages: u64,
    addr: usize,
    /// Loans reading through it now.
    loans: u32,
    /// A break copied pages into it: no new loan may use it.
    detached: bool,
    /// Pages copied into it (one bit per page of the chunk).
    copied: Vec<u64>,
    /// When it last lost its last loan (a count), for dropping idle views oldest first.
    idle_since: u64,
}

/// A registered loan: which pages of which object, and (once it has one) its view.
struct Loan {
    id: u64,
    obj: u64,
    first: u64,
    last: u64,
    view: Option<u64>,
    /// The loan waited for the writers it found copying into its pages (`settle`): only
    /// then may a dropper copy its pages and take its pins (`hand_back`).
    settled: bool,
    /// Pages of `first..=last` the loan still pins (one bit each): all of them, until a
    /// truncation or invalidation that wanted a page took it back (`hand_back`).
    pinned: Vec<u64>,
}

#[derive(Default)]
struct Table {
    views: Vec<View>,
    loans: Vec<Loan>,
    ended: u64,
}

#[derive(Default)]
pub(crate) struct Loans {
    /// Loans registered (taken or being taken). Writers look at the table only when nonzero.
    active: AtomicU64,
    table: Mutex<Table>,
    next_id: AtomicU64,
    /// Pages copied into views still mapped: the borrowers' memory, charged against the
    /// budget while it lasts (`Resources::charged`).
    copied_now: AtomicU64,
    /// Pages ever copied into views (`CacheStats::loan_copies`).
    copied_total: AtomicU64,
    /// Loans ever taken (`CacheStats::loans_taken`).
    taken_total: AtomicU64,
    /// Lent pages whose pin a truncation or invalidation took back.
    handed_back: AtomicU64,
    /// Views ever mapped (`CacheStats::loan_views`).
    views_made: AtomicU64,
}

impl Loans {
    /// Register a loan of pages `first..=last` of object `obj` (no view yet). Returns its id.
    pub(crate) fn register(&self, obj: u64, first: u64, last: u64) -> u64 {
        let id = self.next_id.fetch_add(1, Relaxed);
        let n = last - first + 1;
        let words = n.div_ceil(64) as usize;
        let mut pinned = vec![u64::MAX; words];
        if !n.is_multiple_of(64) {
            pinned[words - 1] = (1 << (n % 64)) - 1;
        }
        self.table.lock().loans.push(Loan { id, obj, first, last, view: None, settled: false, pinned });
        self.active.fetch_add(1, SeqCst);
        self.taken_total.fetch_add(1, Relaxed);
        id
    }

    /// Give loan `id` a view of its chunk (`pages` pages from `chunk_first`): the chunk's
    /// intact view, or a new one `map` makes (its address). Returns the view's address (of
    /// page `chunk_first`).
    pub(crate) fn attach_view(
        &self,
        id: u64,
        chunk_first: u64,
        pages: u64,
        map: impl FnOnce() -> crate::error::Result<usize>,
    ) -> crate::error::Result<usize> {
        let mut t = self.table.lock();
        let Some(li) = t.loans.iter().position(|l| l.id == id) else {
            return Err(crate::error::Error::InvalidArgument("loan not registered".into()));
        };
        let obj = t.loans[li].obj;
        let vi = match t.views.iter().position(|v| v.obj == obj && v.first == chunk_first && !v.detached) {
            Some(vi) => vi,
            None => {
                // Under the table lock: a leaf (`mmap` waits for nothing of ours), and a
                // second loan of the chunk must find this view, not make another.
                let addr = map()?;
                let vid = self.next_id.fetch_add(1, Relaxed);
                let words = pages.div_ceil(64) as usize;
                t.views.push(View {
                    id: vid,
                    obj,
                    first: chunk_first,
                    pages,
                    addr,
                    loans: 0,
                    detached: false,
                    copied: vec![0; words],
                    idle_since: 0,
                });
                self.views_made.fetch_add(1, Relaxed);
                t.views.len() - 1
            }
        };
        t.views[vi].loans += 1;
        let (vid, addr) = (t.views[vi].id, t.views[vi].addr);
        t.loans[li].view = Some(vid);
        Ok(addr)
    }

    /// Loan `id` waited for the writers it found: from now on every writer of its pages
    /// breaks it before writing, so its pages' bytes are the lent ones whenever nobody
    /// holds them WRITING.
    pub(crate) fn settle(&self, id: u64) {
        if let Some(l) = self.table.lock().loans.iter_mut().find(|l| l.id == id) {
            l.settled = true;
        }
    }

    /// Forget loan `id`. Returns the pages (indexes in the object) it still pins, for the
    /// caller to unpin, and the views to unmap now (its view if it was detached and this
    /// was its last loan, or the oldest idle view past `IDLE_VIEWS`): no break reaches them
    /// once this returns.
    pub(crate) fn unregister(&self, id: u64) -> (Vec<u64>, Vec<(usize, usize)>) {
        let mut t = self.table.lock();
        let Some(li) = t.loans.iter().position(|l| l.id == id) else { return (Vec::new(), Vec::new()) };
        let l = t.loans.swap_remove(li);
        self.active.fetch_sub(1, SeqCst);
        let pinned = (l.first..=l.last).filter(|&p| bit(&l.pinned, p - l.first)).collect();
        let mut unmap = Vec::new();
        if let Some(vi) = l.view.and_then(|vid| t.views.iter().position(|v| v.id == vid)) {
            t.ended += 1;
            let ended = t.ended;
            let v = &mut t.views[vi];
            v.loans -= 1;
            if v.loans == 0 {
                v.idle_since = ended;
                if v.detached {
                    let v = t.views.swap_remove(vi);
                    unmap.push(self.retire(&v));
                }
            }
            let idle = t.views.iter().filter(|v| v.loans == 0).count();
            if idle > IDLE_VIEWS
                && let Some(oldest) =
                    (0..t.views.len()).filter(|&i| t.views[i].loans == 0).min_by_key(|&i| t.views[i].idle_since)
            {
                let v = t.views.swap_remove(oldest);
                unmap.push(self.retire(&v));
            }
        }
        (pinned, unmap)
    }

    /// A view leaves the table: its copies stop being charged. Returns what to unmap.
    fn retire(&self, v: &View) -> (usize, usize) {
        let n: u64 = v.copied.iter().map(|w| w.count_ones() as u64).sum();
        self.copied_now.fetch_sub(n, Relaxed);
        (v.addr, v.pages as usize)
    }

    /// Forget every view of object `obj` (its id; it is being dropped, so no loan of it
    /// exists). Returns what to unmap.
    pub(crate) fn forget(&self, obj: u64) -> Vec<(usize, usize)> {
        let mut t = self.table.lock();
        if t.views.is_empty() {
            return Vec::new();
        }
        let (gone, kept): (Vec<View>, Vec<View>) = std::mem::take(&mut t.views).into_iter().partition(|v| v.obj == obj);
        t.views = kept;
        gone.iter().map(|v| self.retire(v)).collect()
    }

    /// A truncation or invalidation wants page `page` of object `obj`: every settled loan of
    /// it gets its copy and lets go of its pin (`unpin` is called once for each such pin),
    /// so the page can be dropped while the windows keep their bytes (UVM lets an owner free
    /// a loaned page, which then belongs to the loan alone). A loan still being made keeps
    /// its pin; the dropper waits for it as for any pin (copied before it settled, the page
    /// could hold a write half done: `schedules_loan_against_truncation` found that).
    /// => no writer holds the page (the droppers hold the size lock exclusively); the caller
    /// takes the page for dropping next.
    pub(crate) fn hand_back(&self, obj: u64, page: u64, page_shift: u32, unpin: &mut dyn FnMut()) {
        if !self.any() {
            return;
        }
        let mut t = self.table.lock();
        self.copy_lent(&mut t, obj, page, page, page_shift, true);
        for l in t.loans.iter_mut().filter(|l| l.obj == obj && l.settled && l.first <= page && page <= l.last) {
            let i = page - l.first;
            if bit(&l.pinned, i) {
                clear_bit(&mut l.pinned, i);
                self.handed_back.fetch_add(1, Relaxed);
                unpin();
            }
        }
    }

    /// Whether any loan is registered: the writers' fast path.
    #[inline]
    pub(crate) fn any(&self) -> bool {
        self.active.load(SeqCst) != 0
    }

    /// Break every loan of pages `a..=b` of object `obj`: each lent page not copied yet is
    /// copied into its loan's view, and the view is detached (later loans map a fresh one).
    /// => the caller holds the pages so that their bytes are the ones lent (WRITING, or
    /// pinned/BUSY before mapping them writable): nothing may have changed them yet.
    pub(crate) fn break_range(&self, obj: u64, a: u64, b: u64, page_shift: u32) {
        if self.any() {
            self.copy_lent(&mut self.table.lock(), obj, a, b, page_shift, false);
        }
    }

    /// Copy pages `a..=b` of `obj` into the views of the loans of them (only the settled
    /// ones if `settled_only`) that have no copy yet, and detach those views.
    fn copy_lent(&self, t: &mut Table, obj: u64, a: u64, b: u64, page_shift: u32, settled_only: bool) {
        for l in t.loans.iter().filter(|l| l.obj == obj && l.first <= b && a <= l.last && (l.settled || !settled_only))
        {
            let Some(v) = l.view.and_then(|vid| t.views.iter_mut().find(|v| v.id == vid)) else { continue };
            let (lo, hi) = (a.max(l.first), b.min(l.last));
            let mut p = lo;
            while p <= hi {
                // A run of pages not copied yet.
                if bit(&v.copied, p - v.first) {
                    p += 1;
                    continue;
                }
                let mut q = p;
                while q < hi && !bit(&v.copied, q + 1 - v.first) {
                    q += 1;
                }
                let at = v.addr + (((p - v.first) as usize) << page_shift);
                copy_into_view(at, ((q - p + 1) as usize) << page_shift);
                for i in p..=q {
                    set_bit(&mut v.copied, i - v.first);
                }
                v.detached = true;
                let n = q - p + 1;
                self.copied_now.fetch_add(n, Relaxed);
                self.copied_total.fetch_add(n, Relaxed);
                p = q + 1;
            }
        }
    }

    /// Pages held by borrowers as copies now (charged against the budget).
    pub(crate) fn copied_now(&self) -> u64 {
        self.copied_now.load(Relaxed)
    }

    /// (loans live now, loans ever taken, pages ever copied, pages handed back, views ever
    /// mapped).
    pub(crate) fn counts(&self) -> (u64, u64, u64, u64, u64) {
        (
            self.active.load(Relaxed),
            self.taken_total.load(Relaxed),
            self.copied_total.load(Relaxed),
            self.handed_back.load(Relaxed),
            self.views_made.load(Relaxed),
        )
    }
}

fn bit(v: &[u64], i: u64) -> bool {
    v[(i / 64) as usize] & (1 << (i % 64)) != 0
}

fn set_bit(v: &mut [u64], i: u64) {
    v[(i / 64) as usize] |= 1 << (i % 64);
}

fn clear_bit(v: &mut [u64], i: u64) {
    v[(i / 64) as usize] &= !(1 << (i % 64));
}

/// Make the view `at..at + len` hold copies of the pages it shows, without changing a byte
/// of it: the run is copied into fresh anonymous memory, which is then moved over the view's
/// run (`mremap` replaces the range in one step, so a reader of the view sees the lent pages
/// or their copy, never a gap). => `at..at + len` is page-aligned, part of a loan's view.
fn copy_into_view(at: usize, len: usize) {
    // SAFETY: a fresh anonymous mapping, filled from the view (readable), then moved over
    // the view's run: the view's address range stays mapped throughout.
    unsafe {
        let copy = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if copy == libc::MAP_FAILED {
            // Out of memory for the copy: the borrower keeps the shared pages (and may see
            // the change). Nothing better is possible here; say so.
            eprintln!("ubc: could not copy lent pages (mmap failed): the window may change");
            return;
        }
        std::ptr::copy_nonoverlapping(at as *const u8, copy as *mut u8, len);
        // Read-only, as the view was (a window hands out `&[u8]`).
        libc::mprotect(copy, len, libc::PROT_READ);
        let moved = libc::mremap(copy, len, len, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, at as *mut libc::c_void);
        if moved == libc::MAP_FAILED {
            libc::munmap(copy, len);
            eprintln!("ubc: could not copy lent pages (mremap failed): the window may change");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A private, read-only mapping of `len` bytes of `fd` from its start: a view.
    fn private_view(fd: &std::os::fd::OwnedFd, len: usize) -> usize {
        // SAFETY: a fresh mapping at a kernel-chosen address; it aliases nothing of ours.
        unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::PRIVATE,
                fd,
                0,
            )
            .unwrap() as usize
        }
    }

    /// A view keeps its bytes after a break, while the memfd's pages are then rewritten; a
    /// page not copied shows the file.
    #[test]
    fn a_broken_view_keeps_its_bytes_while_the_file_changes() {
        let ps = crate::map::page_size();
        let fd = rustix::fs::memfd_create("loan-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::io::pwrite(&fd, &vec![1u8; 2 * ps], 0).unwrap();
        let view = private_view(&fd, 2 * ps);
        // SAFETY: within the view.
        let read = |i: usize| unsafe { std::ptr::read_volatile((view + i) as *const u8) };
        assert_eq!(read(0), 1);
        copy_into_view(view, ps);
        rustix::io::pwrite(&fd, &vec![2u8; 2 * ps], 0).unwrap();
        assert_eq!(read(0), 1, "the copied page keeps the lent bytes");
        assert_eq!(read(ps - 1), 1);
        assert_eq!(read(ps), 2, "a page not copied shows the file");
        unsafe { rustix::mm::munmap(view as *mut _, 2 * ps).unwrap() };
    }

    #[test]
    fn loans_share_an_intact_view_and_a_break_detaches_it() {
        let ps = crate::map::page_size();
        let shift = ps.trailing_zeros();
        let fd = rustix::fs::memfd_create("loan-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::io::pwrite(&fd, &vec![1u8; 16 * ps], 0).unwrap();
        let loans = Loans::default();
        let map = || Ok(private_view(&fd, 16 * ps));
        assert!(!loans.any());
        // Two loans of one chunk (pages 0..16) share one view; a third, of another object,
        // gets its own.
        let a = loans.register(7, 10, 13);
        loans.break_range(7, 10, 13, shift); // no view yet: nothing to copy
        let va = loans.attach_view(a, 0, 16, map).unwrap();
        let b = loans.register(7, 12, 15);
        assert_eq!(loans.attach_view(b, 0, 16, map).unwrap(), va, "one view per intact chunk");
        let c = loans.register(8, 0, 0);
        let vc = loans.attach_view(c, 0, 16, map).unwrap();
        assert_ne!(vc, va);
        loans.break_range(7, 14, 20, shift);
        assert_eq!(loans.counts().2, 2, "pages 14 and 15 copied once for both loans");
        loans.break_range(7, 0, 20, shift);
        assert_eq!(loans.counts().2, 6, "then 10..=13: the chunk's view holds copies of 10..=15");
        assert_eq!(loans.copied_now(), 6);
        // Detached: a new loan of the chunk maps a fresh view.
        let d = loans.register(7, 0, 1);
        let vd = loans.attach_view(d, 0, 16, map).unwrap();
        assert_ne!(vd, va, "a broken view is not lent again");
        let mut unpinned = 0;
        loans.hand_back(7, 12, shift, &mut || unpinned += 1);
        assert_eq!(unpinned, 0, "loans not settled keep their pins");
        loans.settle(a);
        loans.settle(b);
        loans.hand_back(7, 12, shift, &mut || unpinned += 1);
        loans.hand_back(7, 12, shift, &mut || unpinned += 1);
        assert_eq!((unpinned, loans.counts().3), (2, 2), "both loans of page 12 hand it back, once");
        let (pinned, unmap) = loans.unregister(a);
        assert_eq!((pinned, unmap), (vec![10, 11, 13], vec![]), "the view still has a loan");
        let (pinned, unmap) = loans.unregister(b);
        assert_eq!((pinned, unmap), (vec![13, 14, 15], vec![(va, 16)]), "the last loan of a detached view unmaps it");
        assert_eq!(loans.copied_now(), 0);
        // An intact view stays for the next loan after its last one ended.
        assert_eq!(loans.unregister(d).1, vec![], "kept idle");
        let e = loans.register(7, 5, 5);
        assert_eq!(loans.attach_view(e, 0, 16, map).unwrap(), vd);
        assert_eq!(loans.unregister(e).1, vec![]);
        assert_eq!(loans.unregister(c).1, vec![]);
        assert!(!loans.any());
        let mut gone = loans.forget(7);
        gone.extend(loans.forget(8));
        gone.sort();
        let mut want = vec![(vd, 16), (vc, 16)];
        want.sort();
        assert_eq!(gone, want, "the object's idle views go with it");
        assert_eq!(loans.counts().4, 3);
        for (addr, pages) in [(va, 16), (vc, 16), (vd, 16)] {
            unsafe { rustix::mm::munmap(addr as *mut _, pages * ps).unwrap() };
        }
    }
}

//! Page loanout with copy-on-write (NetBSD UBC/UVM's loans, Cranor & Parulkar, "The UVM
//! Virtual Memory System", §7 "Page loanout"): a [`Window`](crate::Window) lends the
//! cache's pages to a borrower without copying them, and keeps the bytes it showed when it
//! was taken. A later change of a lent page through any path — `write_at`, a writable
//! window, a truncation's zeroing, a store through a shared writable mapping — first gives
//! the borrower a copy of the page as it was ("breaks the loan", UVM's `uvm_loanbreak`);
//! the cache keeps the page and takes the change.
//!
//! How the borrower's bytes are kept: each loan reads the cache's pages through a view of
//! its own, a `MAP_PRIVATE` mapping of the object's memfd range. Until a write to the view
//! copies a page, a private file mapping shows the file's page itself (zero copy); breaking
//! the loan is `MADV_POPULATE_WRITE` on the view's pages, which makes the kernel copy each
//! one into the view (the copy-on-write a store would do) without storing anything — the
//! borrower, reading the same addresses meanwhile, sees the same bytes before and after.
//!
//! One registry per cache, keyed by object: loans are rare and short, so a writer pays one
//! atomic load (`active`) when there are none, and the objects pay no memory for them.
//!
//! Ordering (why a write never slips past a loan being taken), see `File::window`: the loan
//! is registered (`active` raised) before its pages are pinned, its view is published under
//! the registry lock, and only then does the loan wait for writers already copying into
//! its pages. A writer takes its page (WRITING) and then looks for loans: either its
//! WRITING was seen by the loan's wait (which waited for it), or its look comes after the
//! loan's view was published and it breaks the loan first.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::*};

/// A registered loan: which pages of which object, and (once made) its view.
struct Loan {
    id: u64,
    /// The lending object's identity (its address: objects do not move while lent).
    obj: usize,
    first: u64,
    last: u64,
    /// The view's address (page `first` of the object); 0 until it is mapped.
    view: usize,
    /// Pages of `first..=last` copied into the view so far (one bit each).
    copied: Vec<u64>,
    /// Pages of `first..=last` the loan still pins (one bit each): all of them, until a
    /// truncation or invalidation that wanted a page took it back (`hand_back`).
    pinned: Vec<u64>,
}

#[derive(Default)]
pub(crate) struct Loans {
    /// Loans registered (taken or being taken). Writers look at the list only when nonzero.
    active: AtomicU64,
    list: Mutex<Vec<Loan>>,
    next_id: AtomicU64,
    /// Pages copied into views and not yet returned: the borrowers' memory, charged against
    /// the budget while the loans last (`Resources::charged`).
    copied_now: AtomicU64,
    /// Pages ever copied into views (`CacheStats::loan_copies`).
    copied_total: AtomicU64,
    /// Loans ever taken (`CacheStats::loans_taken`).
    taken_total: AtomicU64,
    /// Lent pages whose pin a truncation or invalidation took back.
    handed_back: AtomicU64,
}

impl Loans {
    /// Register a loan of pages `first..=last` of object `obj` (no view yet). Returns its id.
    pub(crate) fn register(&self, obj: usize, first: u64, last: u64) -> u64 {
        let id = self.next_id.fetch_add(1, Relaxed);
        let n = last - first + 1;
        let words = n.div_ceil(64) as usize;
        let mut pinned = vec![u64::MAX; words];
        if !n.is_multiple_of(64) {
            pinned[words - 1] = (1 << (n % 64)) - 1;
        }
        self.list.lock().push(Loan { id, obj, first, last, view: 0, copied: vec![0; words], pinned });
        self.active.fetch_add(1, SeqCst);
        self.taken_total.fetch_add(1, Relaxed);
        id
    }

    /// Publish loan `id`'s view (the address of its page `first`).
    pub(crate) fn set_view(&self, id: u64, view: usize) {
        if let Some(l) = self.list.lock().iter_mut().find(|l| l.id == id) {
            l.view = view;
        }
    }

    /// Forget loan `id`; its view is the caller's to unmap afterwards (no break reaches it
    /// once this returns). Its copied pages stop being charged. Returns the pages (indexes
    /// in the object) the loan still pins, for the caller to unpin.
    pub(crate) fn unregister(&self, id: u64) -> Vec<u64> {
        let mut list = self.list.lock();
        let Some(i) = list.iter().position(|l| l.id == id) else { return Vec::new() };
        let l = list.swap_remove(i);
        let n: u64 = l.copied.iter().map(|w| w.count_ones() as u64).sum();
        self.copied_now.fetch_sub(n, Relaxed);
        self.active.fetch_sub(1, SeqCst);
        (l.first..=l.last).filter(|&p| bit(&l.pinned, p - l.first)).collect()
    }

    /// A truncation or invalidation wants page `page` of object `obj`: every loan of it that
    /// has its view gets its copy and lets go of its pin (`unpin` is called once for each
    /// such pin), so the page can be dropped while the windows keep their bytes (UVM lets
    /// an owner free a loaned page, which then belongs to the loan alone). A loan still
    /// being made keeps its pin; the dropper waits for it as for any pin. => the caller
    /// will take the page for dropping next (its bytes are still the lent ones).
    pub(crate) fn hand_back(&self, obj: usize, page: u64, page_shift: u32, unpin: &mut dyn FnMut()) {
        if !self.any() {
            return;
        }
        self.break_range(obj, page, page, page_shift);
        let mut list = self.list.lock();
        for l in list.iter_mut().filter(|l| l.obj == obj && l.view != 0 && l.first <= page && page <= l.last) {
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
    /// copied into its loan's view. => the caller holds the pages so that their bytes are
    /// the ones lent (WRITING, or pinned/BUSY before mapping them writable): nothing may
    /// have changed them yet.
    pub(crate) fn break_range(&self, obj: usize, a: u64, b: u64, page_shift: u32) {
        if !self.any() {
            return;
        }
        let mut list = self.list.lock();
        for l in list.iter_mut().filter(|l| l.obj == obj && l.view != 0 && l.first <= b && a <= l.last) {
            let (lo, hi) = (a.max(l.first), b.min(l.last));
            let mut p = lo;
            while p <= hi {
                // A run of pages not copied yet.
                if bit(&l.copied, p - l.first) {
                    p += 1;
                    continue;
                }
                let mut q = p;
                while q < hi && !bit(&l.copied, q + 1 - l.first) {
                    q += 1;
                }
                let at = l.view + (((p - l.first) as usize) << page_shift);
                let len = ((q - p + 1) as usize) << page_shift;
                copy_into_view(at, len);
                for i in p..=q {
                    set_bit(&mut l.copied, i - l.first);
                }
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

    /// (loans live now, loans ever taken, pages ever copied, pages handed back).
    pub(crate) fn counts(&self) -> (u64, u64, u64, u64) {
        (
            self.active.load(Relaxed),
            self.taken_total.load(Relaxed),
            self.copied_total.load(Relaxed),
            self.handed_back.load(Relaxed),
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

/// Make the private view `at..at + len` hold copies of the pages it shows, without
/// changing a byte of it. => `at..at + len` is a private, writable mapping whose pages are
/// all in the file (lent pages are resident).
fn copy_into_view(at: usize, len: usize) {
    // SAFETY: MADV_POPULATE_WRITE on our own private mapping writes nothing: it takes the
    // write faults a store would (each page copied), so what the borrower reads stays.
    let r = unsafe { libc::madvise(at as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
    if r != 0 {
        // Before Linux 5.14 (EINVAL): copy page by page and move each copy over the view's
        // page (`mremap` replaces it in one step, so a reader sees the old page or its copy).
        copy_into_view_by_remap(at, len);
    }
}

/// The fallback of `copy_into_view`, also used by its test. => as `copy_into_view`.
pub(crate) fn copy_into_view_by_remap(at: usize, len: usize) {
    let ps = crate::map::page_size();
    let mut off = 0;
    while off < len {
        // SAFETY: a fresh anonymous page, filled from the view's page (readable), then moved
        // over it: the view's address range stays mapped throughout.
        unsafe {
            let copy = libc::mmap(
                std::ptr::null_mut(),
                ps,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if copy == libc::MAP_FAILED {
                // Out of memory for the copy: the borrower keeps the shared page (and may
                // see the change). Nothing better is possible here; say so.
                eprintln!("ubc: could not copy a lent page (mmap failed): the window may change");
                return;
            }
            std::ptr::copy_nonoverlapping((at + off) as *const u8, copy as *mut u8, ps);
            let moved =
                libc::mremap(copy, ps, ps, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, (at + off) as *mut libc::c_void);
            if moved == libc::MAP_FAILED {
                libc::munmap(copy, ps);
                eprintln!("ubc: could not copy a lent page (mremap failed): the window may change");
                return;
            }
        }
        off += ps;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A private, writable mapping of `len` bytes of `fd` from its start: a loan's view.
    fn private_view(fd: &std::os::fd::OwnedFd, len: usize) -> usize {
        // SAFETY: a fresh mapping at a kernel-chosen address; it aliases nothing of ours.
        unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
                fd,
                0,
            )
            .unwrap() as usize
        }
    }

    /// A view (a private mapping of a memfd) keeps its bytes after a break, by either way of
    /// copying, while the memfd's page is then rewritten.
    #[test]
    fn a_broken_view_keeps_its_bytes_while_the_file_changes() {
        for remap in [false, true] {
            let ps = crate::map::page_size();
            let fd = rustix::fs::memfd_create("loan-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
            rustix::io::pwrite(&fd, &vec![1u8; 2 * ps], 0).unwrap();
            let view = private_view(&fd, 2 * ps);
            let read = |i: usize| unsafe { std::ptr::read_volatile((view + i) as *const u8) };
            assert_eq!(read(0), 1);
            if remap {
                copy_into_view_by_remap(view, ps);
            } else {
                copy_into_view(view, ps);
            }
            rustix::io::pwrite(&fd, &vec![2u8; 2 * ps], 0).unwrap();
            assert_eq!(read(0), 1, "the copied page keeps the lent bytes (remap: {remap})");
            assert_eq!(read(ps - 1), 1);
            assert_eq!(read(ps), 2, "a page not copied shows the file (remap: {remap})");
            unsafe { rustix::mm::munmap(view as *mut _, 2 * ps).unwrap() };
        }
    }

    #[test]
    fn breaks_copy_each_page_once_and_forget_the_copies_with_the_loan() {
        let ps = crate::map::page_size();
        let fd = rustix::fs::memfd_create("loan-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::io::pwrite(&fd, &vec![1u8; 4 * ps], 0).unwrap();
        let view = private_view(&fd, 4 * ps);
        let loans = Loans::default();
        assert!(!loans.any());
        let id = loans.register(7, 10, 13);
        loans.break_range(7, 10, 13, ps.trailing_zeros()); // no view yet: nothing to copy
        assert_eq!(loans.counts().2, 0);
        loans.set_view(id, view);
        loans.break_range(8, 10, 13, ps.trailing_zeros()); // another object
        loans.break_range(7, 14, 20, ps.trailing_zeros()); // other pages
        assert_eq!(loans.counts().2, 0);
        loans.break_range(7, 11, 12, ps.trailing_zeros());
        loans.break_range(7, 0, 20, ps.trailing_zeros());
        assert_eq!(loans.counts(), (1, 1, 4, 0), "pages 11 and 12, then 10 and 13");
        assert_eq!(loans.copied_now(), 4);
        let mut unpinned = 0;
        loans.hand_back(7, 12, ps.trailing_zeros(), &mut || unpinned += 1);
        loans.hand_back(7, 12, ps.trailing_zeros(), &mut || unpinned += 1);
        assert_eq!((unpinned, loans.counts().3), (1, 1), "a pin is handed back once");
        assert_eq!(loans.unregister(id), vec![10, 11, 13], "the loan still pins the rest");
        assert_eq!(loans.copied_now(), 0);
        assert!(!loans.any());
        unsafe { rustix::mm::munmap(view as *mut _, 4 * ps).unwrap() };
    }
}

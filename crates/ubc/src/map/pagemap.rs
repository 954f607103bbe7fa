//! `PAGEMAP_SCAN` (Linux 6.7+): find pages of our own mappings by state, and write-protect
//! the ones found in the same page-table walk.
//!
//! With a uffd in `WP_ASYNC` mode, a store to a write-protected page is resolved by the kernel
//! (no trap) and leaves the pte unprotected: "written". [`Pagemap::take_written`] returns the
//! written pages of a range and protects them again atomically per pte (the kernel clears
//! and rewrites each pte under its lock, so a store racing with the scan is either seen by
//! this scan or faults afterwards and is seen by the next one). That is the mapping's dirty
//! tracking: a store is lost to it only if its pte is zapped before a scan sees it (see
//! `map/mod.rs`, "Punching").
//!
//! ABI from Linux 6.18 `include/uapi/linux/fs.h`:
//! `PAGEMAP_SCAN = _IOWR('f', 16, struct pm_scan_arg)`, a 96-byte argument of twelve u64s,
//! and an output vector of 24-byte `struct page_region { start, end, categories }`.

use super::uffd::ioc;
use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub(super) const PAGEMAP_SCAN: u32 = ioc(3, b'f' as u32, 16, size_of::<PmScanArg>());

/// Page categories (`PAGE_IS_*`), for masks and in [`Region::categories`].
pub(crate) mod category {
    /// The VMA is registered for uffd WP (async), so WP_MATCHING can protect it.
    pub(crate) const WPALLOWED: u64 = 1 << 0;
    /// Mapped and not uffd-write-protected: stored to since it was last protected.
    pub(crate) const WRITTEN: u64 = 1 << 1;
    pub(crate) const FILE: u64 = 1 << 2;
    /// A page is mapped at the address.
    pub(crate) const PRESENT: u64 = 1 << 3;
    /// A swap entry — including uffd pte markers (WP markers, poison).
    pub(crate) const SWAPPED: u64 = 1 << 4;
    pub(crate) const PFNZERO: u64 = 1 << 5;
    pub(crate) const HUGE: u64 = 1 << 6;
    pub(crate) const SOFT_DIRTY: u64 = 1 << 7;
    pub(crate) const GUARD: u64 = 1 << 8;
}

/// `PM_SCAN_WP_MATCHING`: write-protect the pages that match.
pub(crate) const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
/// `PM_SCAN_CHECK_WPASYNC`: fail with EPERM if a VMA in the range is not async-WP registered.
pub(crate) const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;

#[repr(C)]
#[derive(Default)]
pub(super) struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// One `struct page_region`: pages `start..end` that share `categories` (masked by the
/// query's return mask).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Region {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) categories: u64,
}

/// What to look for, in the kernel's terms: a page matches when
/// `((cats ^ inverted) & mask) == mask` and, if `anyof` is non-zero, `(cats ^ inverted) & anyof != 0`.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Query {
    pub(crate) flags: u64,
    pub(crate) inverted: u64,
    pub(crate) mask: u64,
    pub(crate) anyof: u64,
    /// Categories reported in each region (regions are merged runs of equal reported bits).
    pub(crate) ret: u64,
    /// Stop after this many matching pages (0: no limit).
    pub(crate) max_pages: u64,
}

impl Query {
    /// Written pages, protected again as they are found (the dirty scan).
    pub(crate) const TAKE_WRITTEN: Query = Query {
        flags: PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
        inverted: 0,
        mask: category::WRITTEN,
        anyof: 0,
        ret: category::WRITTEN,
        max_pages: 0,
    };
    /// Written pages, left as they are.
    pub(crate) const WRITTEN: Query = Query { flags: 0, ..Query::TAKE_WRITTEN };
    /// Anonymous pages mapped at the address: in a private mapping of a file, the copies its
    /// stores made.
    pub(crate) const ANON: Query = Query {
        flags: 0,
        inverted: category::FILE,
        mask: category::PRESENT | category::FILE,
        anyof: 0,
        ret: category::PRESENT,
        max_pages: 0,
    };
    /// Empty ptes: neither a page nor a marker. In a WP-registered hugetlb mapping, whose
    /// unmapped ptes all hold WP markers, that is a huge page zapped while written (a zap
    /// leaves a marker only where the pte was protected).
    pub(crate) const EMPTY: Query = Query {
        flags: 0,
        inverted: category::PRESENT | category::SWAPPED,
        mask: category::PRESENT | category::SWAPPED,
        anyof: 0,
        ret: category::PRESENT | category::SWAPPED,
        max_pages: 0,
    };
    /// Pages mapped at the address.
    pub(crate) const PRESENT: Query =
        Query { flags: 0, inverted: 0, mask: category::PRESENT, anyof: 0, ret: category::PRESENT, max_pages: 0 };
}

/// How many regions one ioctl may return; the walk resumes at `walk_end` when they fill.
const VEC_LEN: usize = 256;

/// `/proc/self/pagemap`, the handle `PAGEMAP_SCAN` needs. Shareable between threads.
pub(crate) struct Pagemap {
    fd: OwnedFd,
}

impl Pagemap {
    /// Open this process's pagemap. => Linux ≥ 6.7 for the scan itself (ENOTTY before).
    pub(crate) fn open() -> io::Result<Pagemap> {
        // SAFETY: a NUL-terminated path; open takes no other pointers.
        let fd = unsafe { libc::open(c"/proc/self/pagemap".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nobody else owns.
        Ok(Pagemap { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Scan `start..start+len` for pages matching `q`, calling `each` with every region found
    /// (in address order, a run may be split in two across ioctls). Returns the pages matched.
    /// => page-aligned range of this process. With `PM_SCAN_CHECK_WPASYNC`, EPERM if part of
    /// it is not registered WP on a `WP_ASYNC` uffd; unmapped gaps are skipped.
    pub(crate) fn scan(&self, start: usize, len: usize, q: Query, mut each: impl FnMut(Region)) -> io::Result<u64> {
        let page = super::page_size() as u64;
        let end = (start + len) as u64;
        let mut vec = [Region::default(); VEC_LEN];
        let mut at = start as u64;
        let mut pages = 0u64;
        while at < end {
            let mut arg = PmScanArg {
                size: size_of::<PmScanArg>() as u64,
                flags: q.flags,
                start: at,
                end,
                walk_end: 0,
                vec: vec.as_mut_ptr() as u64,
                vec_len: VEC_LEN as u64,
                max_pages: if q.max_pages == 0 { 0 } else { q.max_pages - pages },
                category_inverted: q.inverted,
                category_mask: q.mask,
                category_anyof_mask: q.anyof,
                return_mask: q.ret,
            };
            // SAFETY: PAGEMAP_SCAN reads a live pm_scan_arg, writes its walk_end, and writes at
            // most vec_len regions into `vec`, which lives until after the call.
            let n = unsafe { libc::ioctl(self.fd.as_raw_fd(), PAGEMAP_SCAN as libc::Ioctl, &mut arg) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            for r in &vec[..n as usize] {
                pages += (r.end - r.start) / page;
                each(*r);
            }
            // The kernel stops early when the vector fills or max_pages is reached, and says
            // where in walk_end; it never goes backwards.
            if arg.walk_end >= end || (q.max_pages != 0 && pages >= q.max_pages) {
                break;
            }
            debug_assert!(arg.walk_end > at, "PAGEMAP_SCAN made no progress");
            if arg.walk_end <= at {
                return Err(io::Error::other("PAGEMAP_SCAN made no progress"));
            }
            at = arg.walk_end;
        }
        Ok(pages)
    }

    /// Append to `out` the pages of `start..start+len` written since they were last
    /// protected, and protect them again (atomically per pte). Adjacent runs are merged.
    /// Returns the number of pages. => the range is registered WP on a `WP_ASYNC` uffd
    /// (EPERM otherwise) and was write-protected after registering.
    pub(crate) fn take_written(&self, start: usize, len: usize, out: &mut Vec<Range<usize>>) -> io::Result<u64> {
        self.scan(start, len, Query::TAKE_WRITTEN, |r| push_merged(out, r.start as usize..r.end as usize))
    }

    /// Like [`Pagemap::take_written`] but leaves the pages as they are (a peek).
    pub(crate) fn written(&self, start: usize, len: usize, out: &mut Vec<Range<usize>>) -> io::Result<u64> {
        self.scan(start, len, Query::WRITTEN, |r| push_merged(out, r.start as usize..r.end as usize))
    }

    /// Append to `out` the empty ptes of `start..start+len` ([`Query::EMPTY`]).
    pub(crate) fn empty(&self, start: usize, len: usize, out: &mut Vec<Range<usize>>) -> io::Result<u64> {
        self.scan(start, len, Query::EMPTY, |r| push_merged(out, r.start as usize..r.end as usize))
    }

    /// Append to `out` the pages of `start..start+len` mapped (present) at their address.
    pub(crate) fn present(&self, start: usize, len: usize, out: &mut Vec<Range<usize>>) -> io::Result<u64> {
        self.scan(start, len, Query::PRESENT, |r| push_merged(out, r.start as usize..r.end as usize))
    }
}

/// Push `r` onto `out`, extending the last range if they touch.
fn push_merged(out: &mut Vec<Range<usize>>, r: Range<usize>) {
    match out.last_mut() {
        Some(last) if last.end == r.start => last.end = r.end,
        _ => out.push(r),
    }
}

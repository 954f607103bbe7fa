//! The kernel interface for mappings served by the cache: userfaultfd and `PAGEMAP_SCAN`.
//!
//! This layer knows nothing of page tables or pagers; it is the set of kernel calls the
//! cache's mapping scheme needs (`service.rs` uses them), each checked on Linux 6.18 by the
//! tests in `tests.rs` (run `cargo test -p ubc --lib map::`; costs: `map::tests::bench_costs`).
//!
//! # How the cache uses it
//!
//! 1. **Once**: [`probe`]. `Err(Unavailable { reason, .. })` names every missing feature
//!    ("userfaultfd lacks WP_ASYNC: …"): the cache then falls back to populating mappings
//!    eagerly, with that message. Then one [`Uffd::open`]`(feature::SCHEME, optional)` for the
//!    whole cache.
//! 2. **Per user mapping**: `mmap(MAP_SHARED)` of the object's memfd, registered MISSING +
//!    MINOR (+ WP for a shared writable mapping), then at once [`Uffd::writeprotect`]`(whole,
//!    true)`: that leaves WP markers in every empty pte, so pages mapped later arrive
//!    protected. (An empty pte in a WP range counts as *written* to `PAGEMAP_SCAN`: skip the
//!    protect and the first scan reports the whole mapping dirty.) With MINOR, the kernel
//!    never maps a memfd page into a user mapping by itself: a page that is in the memfd but
//!    not mapped traps too.
//! 3. **Mapping pages in**: a page reaches a user page table only through
//!    [`Uffd::continue_`] (`UFFDIO_CONTINUE`, ~0.2 µs/page), called by a thread that holds the
//!    page (pinned, or BUSY at the end of its fill). Every fill maps its pages into the
//!    object's mappings that way, and a new mapping maps every resident page at once, so
//!    resident pages never trap.
//! 4. **The fault thread(s)** loop on [`Uffd::wait`] (with a [`Waker`] for shutdown: it
//!    stays signalled, so every handler thread sees it) and [`Uffd::read_events`]. For a
//!    [`Event::PageFault`] on a page that is not resident: fill a cluster through the
//!    ordinary read path, `continue_` it into the mapping, wake. Rules:
//!    * **Always wake**, also when every page turned out mapped already (`EEXIST`: another
//!      path mapped it meanwhile) — the faulting thread sleeps until woken.
//!    * `EAGAIN` with no progress means a non-cooperative event (Remove/Unmap) is pending in
//!      the uffd queue: read events, then retry — do not spin in the only reader.
//!    * Several threads may serve one uffd; each message goes to one reader. No lock here.
//! 5. **Pager errors and touches past EOF**: `writeprotect(page, false)` then
//!    [`Uffd::poison`] the page *in the user mapping* (poison is a pte of that mapping, not a
//!    memfd page, and it refuses any pte — a WP marker included — with `EEXIST`). The access
//!    gets SIGBUS (a kernel access, EFAULT); the fault thread and other mappings go on.
//!    Punching does not clear it; [`clear_poison`] does (after a successful retry or growth).
//! 6. **Dirty tracking**: [`Pagemap::take_written`] over each user mapping returns the pages
//!    stored to since the last scan and protects them again in the same walk (0.4 ms per 16k
//!    pages, 0.04 ms when nothing was written). First stores never trap (`WP_ASYNC`).
//! 7. **Eviction**: `MADV_DONTNEED` the page's range in every user mapping (the written
//!    state survives as an empty pte), scan, write back what was written, punch the memfd.
//!    Because of MINOR, a zapped pte cannot come back without the fault thread, which waits
//!    for the page held by eviction: no store slips in between the scan and the punch
//!    (test `minor_registration_makes_eviction_race_free`). Without MINOR (MISSING + WP
//!    only), the kernel would map a resident page on its own and a store between scan and
//!    punch would be lost with the page — detectable afterwards, not preventable
//!    (`tests.rs` shows both).
//! 8. **Teardown**: unmap every user mapping before dropping the uffd: closing it turns them
//!    into plain shared memory, where touching an unfilled page allocates a zero page in the
//!    memfd. A forked child's copies are likewise unregistered (no `EVENT_FORK`).
//!
//! The kernel layer also offers an *installer* scheme (a second, MISSING-only mapping that
//! fills pages with `UFFDIO_COPY`, [`Mode::INSTALLER`]); the cache does not use it, its
//! tests keep it measured against the MINOR scheme.
//!
//! # Optional events
//!
//! `EVENT_REMOVE` reports `madvise(MADV_DONTNEED / MADV_REMOVE)` by the user on a mapping
//! (REMOVE punches the memfd behind the cache's back; both zap ptes); `EVENT_UNMAP` reports
//! `munmap`. Both make the calling thread wait until the event is read, and make fills fail
//! with `EAGAIN` meanwhile — so with them enabled, the fault thread must never madvise or
//! unmap a registered range itself (it would wait for itself).

#![allow(dead_code, unused_imports)] // parts of the kernel layer serve only its tests

mod pagemap;
mod service;
mod uffd;

pub(crate) use service::{Holes, MapService, Mapped, Serve, UserMap, dedup_pages};

#[cfg(test)]
mod tests;

pub(crate) use pagemap::{Pagemap, Query, Region, category};
pub(crate) use uffd::{
    CopyError, Event, Events, Features, FillMode, Installed, Mode, Ready, Source, Uffd, UffdMsg, Unavailable, Waker,
    clear_poison, feature, range_ioctl,
};

/// The system page size (what every address and length here must be aligned to).
pub(crate) fn page_size() -> usize {
    rustix::param::page_size()
}

/// Whether userfaultfd resolves minor and missing faults on hugetlb memory here (what the
/// hugetlb page path needs from it; `false` also when userfaultfd cannot be opened).
pub(crate) fn hugetlb_faults() -> bool {
    let both = feature::MINOR_HUGETLBFS | feature::MISSING_HUGETLBFS;
    uffd::offered_features().is_some_and(|f| f & both == both)
}

/// Check once whether the mapping scheme can run here: the features, a uffd that lets
/// kernel accesses wait, registration of a memfd mapping as the service registers user
/// mappings with the range ioctls it uses, and `PAGEMAP_SCAN`. => call once (it opens and closes a few
/// descriptors and maps a page).
pub(crate) fn probe() -> Result<Features, Unavailable> {
    let uffd = Uffd::open(feature::SCHEME, 0)?;
    let features = uffd.features();
    let fail = |reason: String| Unavailable { reason, features: Some(features) };
    if let Some(reason) = features.shortfall() {
        return Err(fail(reason));
    }
    let page = page_size();
    let memfd = rustix::fs::memfd_create(c"ubc:probe", rustix::fs::MemfdFlags::CLOEXEC)
        .map_err(|e| fail(format!("memfd_create: {e}")))?;
    rustix::fs::ftruncate(&memfd, page as u64).map_err(|e| fail(format!("ftruncate(memfd): {e}")))?;
    let map = || -> Result<usize, Unavailable> {
        // SAFETY: a fresh mapping at a kernel-chosen address; it aliases no Rust object.
        unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                page,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                &memfd,
                0,
            )
        }
        .map(|p| p as usize)
        .map_err(|e| fail(format!("mmap(memfd): {e}")))
    };
    let user = map()?;
    let result = (|| {
        // The registration `MapService::register` makes for a shared writable mapping, and
        // the range ioctls the service calls on it.
        let need = range_ioctl::CONTINUE | range_ioctl::WAKE | range_ioctl::WRITEPROTECT | range_ioctl::POISON;
        let got = uffd.register(user, page, Mode { missing: true, minor: true, wp: true }).map_err(|e| {
            fail(format!("userfaultfd: registering a memfd mapping for MISSING + MINOR + WP failed: {e}"))
        })?;
        if got & need != need {
            return Err(fail(format!(
                "userfaultfd: a MISSING + MINOR + WP memfd range lacks ioctls (offered 0x{got:x}, needed 0x{need:x})"
            )));
        }
        uffd.writeprotect(user, page, true)
            .map_err(|e| fail(format!("userfaultfd: UFFDIO_WRITEPROTECT on a memfd mapping failed: {e}")))?;
        let pm = Pagemap::open().map_err(|e| fail(format!("open /proc/self/pagemap: {e}")))?;
        pm.take_written(user, page, &mut Vec::new()).map_err(|e| {
            fail(if e.raw_os_error() == Some(libc::ENOTTY) {
                "PAGEMAP_SCAN is not supported (Linux < 6.7): stores through mappings cannot be found".to_string()
            } else {
                format!("PAGEMAP_SCAN failed: {e}")
            })
        })?;
        Ok(features)
    })();
    // SAFETY: our own mapping made above; nothing refers to it any more.
    let _ = unsafe { rustix::mm::munmap(user as *mut _, page) };
    result
}

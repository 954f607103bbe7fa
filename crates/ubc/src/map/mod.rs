//! The kernel interface for mappings served by the cache: userfaultfd and `PAGEMAP_SCAN`.
//!
//! This layer knows nothing of pages tables or pagers; it is the set of kernel calls the
//! mapping scheme of `../shared/DESIGN.md` needs, each checked on Linux 6.18 by the tests in
//! `tests.rs` (run `cargo test -p ubc --lib map::`; costs: `map::tests::bench_costs`).
//!
//! # How the cache uses it
//!
//! 1. **Once**: [`probe`]. `Err(Unavailable { reason, .. })` names every missing feature
//!    ("userfaultfd lacks WP_ASYNC: …"): fall back to eager population with that message.
//!    Then one [`Uffd::open`]`(feature::SCHEME, optional)` for the whole cache.
//! 2. **Per object**: an *installer* mapping of the memfd, [`Mode::INSTALLER`] (MISSING
//!    only), never touched: every fill goes in through it with [`Uffd::install`], so a page
//!    appears in every mapping whole (no half-filled page is ever visible).
//! 3. **Per user mapping**: `mmap(MAP_SHARED)` of the memfd, [`Uffd::register`] with
//!    [`Mode::USER`], then at once [`Uffd::writeprotect`]`(whole, true)`: that leaves WP markers
//!    in every empty pte, so pages mapped later arrive protected. (An empty pte in a WP range
//!    counts as *written* to `PAGEMAP_SCAN`: skip the protect and the first scan reports the
//!    whole mapping dirty.) Resident pages never trap; touching them costs ~1.2 µs/page
//!    (fault-around is off in uffd ranges), `MADV_POPULATE_READ` over runs the page table
//!    knows resident costs ~0.6 µs/page and also maps them protected.
//! 4. **The fault thread(s)** loop on [`Uffd::wait`] (with a [`Waker`] for shutdown: it
//!    stays signalled, so every handler thread sees it) and [`Uffd::read_events`]. For a
//!    [`Event::PageFault`]: take the cluster BUSY, fill a buffer from the pager, `install` it
//!    into the installer with [`FillMode::DONTWAKE`], `writeprotect(user cluster, true)`, then
//!    [`Uffd::wake`] the user cluster. Rules:
//!    * **Always wake**, also when `install` found every page existing (`EEXIST`: another
//!      path filled it meanwhile; it is never overwritten) — the thread sleeps until woken.
//!    * **Protect before waking**: a page written, then punched before a scan saw it, leaves an
//!      empty pte (no marker); its refill would be mapped writable and look written forever.
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
//! 7. **Eviction**: scan, write back, `fallocate(PUNCH_HOLE)`: every mapping loses the page
//!    (clean pages keep their WP marker), the next touch traps MISSING and refills.
//!    **The race:** the kernel maps a resident page into a user mapping without asking us, so
//!    a store between the scan and the punch is lost with the page. It is *detectable*: a scan
//!    after the punch reports that page written although the cache holds no page there. To
//!    *close* it, register user mappings MISSING + MINOR + WP and map resident pages with
//!    [`Uffd::continue_`] (WP) instead of touching them (one call, ~0.2 µs/page): then a
//!    zapped pte cannot come back without the fault thread, and eviction is `MADV_DONTNEED`
//!    the range in every user mapping (the written state survives as an empty pte), scan,
//!    write back, punch, release the held faults. The price: a page filled *after* a mapping
//!    was made traps MINOR on first touch through it, unless the fill also CONTINUEs it into
//!    each user mapping. (Test `minor_registration_makes_eviction_race_free`.)
//! 8. **Teardown**: unmap every user mapping before dropping the uffd: closing it turns them
//!    into plain shared memory, where touching an unfilled page allocates a zero page in the
//!    memfd. A forked child's copies are likewise unregistered (no `EVENT_FORK`).
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

pub(crate) use service::{MapService, UserMap, dedup_pages};

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

/// Check once whether the mapping scheme can run here: the features, a uffd that lets
/// kernel accesses wait, registration of a memfd mapping in both modes with the range
/// ioctls the scheme uses, and `PAGEMAP_SCAN`. => call once (it opens and closes a few
/// descriptors and maps two pages).
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
    let installer = map();
    let result = (|| {
        let installer = installer.clone()?;
        let need_user = range_ioctl::COPY | range_ioctl::WAKE | range_ioctl::WRITEPROTECT | range_ioctl::POISON;
        let got = uffd
            .register(user, page, Mode::USER)
            .map_err(|e| fail(format!("userfaultfd: registering a memfd mapping for MISSING + WP failed: {e}")))?;
        if got & need_user != need_user {
            return Err(fail(format!(
                "userfaultfd: a MISSING + WP memfd range lacks ioctls (offered 0x{got:x}, needed 0x{need_user:x})"
            )));
        }
        uffd.writeprotect(user, page, true)
            .map_err(|e| fail(format!("userfaultfd: UFFDIO_WRITEPROTECT on a memfd mapping failed: {e}")))?;
        uffd.register(installer, page, Mode::INSTALLER)
            .map_err(|e| fail(format!("userfaultfd: registering a memfd mapping for MISSING failed: {e}")))?;
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
    for addr in [Ok(user), installer].into_iter().flatten() {
        // SAFETY: our own mappings made above; nothing refers to them any more.
        let _ = unsafe { rustix::mm::munmap(addr as *mut _, page) };
    }
    result
}

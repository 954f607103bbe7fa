//! The mapping scheme end to end on raw memfds (no cache involved), plus the ABI checks.
//!
//! Each test builds [`Area`]s — a memfd with a *user* mapping (registered MISSING + WP and
//! write-protected at once) and an *installer* mapping (registered MISSING, never touched) —
//! and a [`Handler`] that serves MISSING faults the way the cache will: fill a cluster with
//! `UFFDIO_COPY` into the installer mapping (`DONTWAKE`), then `UFFDIO_WAKE` the user range.

use super::pagemap::{PAGEMAP_SCAN, PmScanArg};
use super::uffd::*;
use super::*;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

fn ps() -> usize {
    page_size()
}

/// Optional events the tests ask for besides the scheme's features.
const EVENTS: u64 = feature::EVENT_REMOVE | feature::EVENT_UNMAP | feature::THREAD_ID;

fn open_uffd(optional: u64) -> Arc<Uffd> {
    Arc::new(Uffd::open(feature::SCHEME, optional).unwrap_or_else(|e| panic!("userfaultfd unavailable: {e}")))
}

/// A fresh memfd of `pages` pages, none allocated.
fn memfd(pages: usize) -> OwnedFd {
    let fd = rustix::fs::memfd_create(c"ubc:map-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, (pages * ps()) as u64).unwrap();
    fd
}

/// A shared read-write mapping, unmapped on drop.
struct Map {
    addr: usize,
    len: usize,
}

impl Map {
    fn shared(fd: &OwnedFd, pages: usize) -> Map {
        let len = pages * ps();
        // SAFETY: a fresh mapping at a kernel-chosen address; it aliases no Rust object.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                fd,
                0,
            )
        }
        .unwrap();
        Map { addr: p as usize, len }
    }
    fn at(&self, page: usize) -> usize {
        assert!(page * ps() < self.len);
        self.addr + page * ps()
    }
    fn read(&self, page: usize, off: usize) -> u8 {
        // SAFETY: inside our live mapping; volatile because other mappings and the kernel
        // change the memory behind the compiler's back.
        unsafe { std::ptr::read_volatile((self.at(page) + off) as *const u8) }
    }
    fn write(&self, page: usize, off: usize, v: u8) {
        // SAFETY: as for read.
        unsafe { std::ptr::write_volatile((self.at(page) + off) as *mut u8, v) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: our mapping; nothing refers to it after drop.
        let _ = unsafe { rustix::mm::munmap(self.addr as *mut _, self.len) };
    }
}

/// One memfd served the ubc way: user mapping (MISSING + WP, protected) and installer (MISSING).
struct Area {
    fd: OwnedFd,
    pages: usize,
    user: Map,
    installer: Map,
    /// The handler fills page `i` with `seed + i` (every byte), so refills can be told apart.
    seed: AtomicU8,
}

impl Area {
    fn new(uffd: &Uffd, pages: usize) -> Area {
        let fd = memfd(pages);
        let user = Map::shared(&fd, pages);
        let installer = Map::shared(&fd, pages);
        let ioctls = uffd.register(user.addr, user.len, Mode::USER).unwrap();
        assert_eq!(ioctls & range_ioctl::WRITEPROTECT, range_ioctl::WRITEPROTECT);
        uffd.writeprotect(user.addr, user.len, true).unwrap();
        uffd.register(installer.addr, installer.len, Mode::INSTALLER).unwrap();
        Area { fd, pages, user, installer, seed: AtomicU8::new(0x40) }
    }
    fn fill_byte(&self, page: usize) -> u8 {
        self.seed.load(SeqCst).wrapping_add(page as u8)
    }
    /// Make pages resident the way a window write does: straight into the memfd.
    fn pwrite(&self, page: usize, n: usize, byte: u8) {
        let buf = vec![byte; n * ps()];
        let w = rustix::io::pwrite(&self.fd, &buf, (page * ps()) as u64).unwrap();
        assert_eq!(w, buf.len());
    }
    fn pread(&self, page: usize, n: usize) -> Vec<u8> {
        let mut buf = vec![0; n * ps()];
        let r = rustix::io::pread(&self.fd, &mut buf, (page * ps()) as u64).unwrap();
        assert_eq!(r, buf.len());
        buf
    }
    fn punch(&self, page: usize, n: usize) {
        rustix::fs::fallocate(
            &self.fd,
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            (page * ps()) as u64,
            (n * ps()) as u64,
        )
        .unwrap();
    }
    /// Pages of the memfd that hold memory (from st_blocks).
    fn allocated_pages(&self) -> usize {
        rustix::fs::fstat(&self.fd).unwrap().st_blocks as usize * 512 / ps()
    }
    /// Written pages of the user mapping, protected again, as page-index ranges.
    fn take_written(&self, pm: &Pagemap) -> Vec<Range<usize>> {
        let mut v = Vec::new();
        pm.take_written(self.user.addr, self.user.len, &mut v).unwrap();
        v.into_iter().map(|r| (r.start - self.user.addr) / ps()..(r.end - self.user.addr) / ps()).collect()
    }
    fn contains(&self, addr: usize) -> bool {
        (self.user.addr..self.user.addr + self.user.len).contains(&addr)
    }
}

#[derive(Clone, Copy)]
struct HandlerConfig {
    /// Pages filled per fault (aligned clusters, clipped to the area).
    cluster: usize,
    /// `UFFDIO_WRITEPROTECT` the filled cluster in the user mapping before waking.
    protect_before_wake: bool,
    /// Spin on the uffd instead of blocking in poll (measures the wake-up cost).
    spin: bool,
}

impl Default for HandlerConfig {
    fn default() -> Self {
        HandlerConfig { cluster: 16, protect_before_wake: false, spin: false }
    }
}

#[derive(Default)]
struct HandlerStats {
    faults: AtomicUsize,
    write_faults: AtomicUsize,
    wp_faults: AtomicUsize,
    installed: AtomicUsize,
    existing: AtomicUsize,
    /// Pages to poison instead of filling (a pager error), as user addresses.
    poison: Mutex<Vec<usize>>,
    other_events: Mutex<Vec<Event>>,
}

/// Fault-handler threads serving `areas` through one uffd.
struct Handler {
    stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    threads: Vec<JoinHandle<()>>,
    stats: Arc<HandlerStats>,
}

impl Handler {
    fn start(uffd: &Arc<Uffd>, areas: &Arc<Vec<Area>>, cfg: HandlerConfig, nthreads: usize) -> Handler {
        let stop = Arc::new(AtomicBool::new(false));
        let waker = Arc::new(Waker::new().unwrap());
        let stats = Arc::new(HandlerStats::default());
        let threads = (0..nthreads)
            .map(|_| {
                let (uffd, areas, stop, waker, stats) =
                    (uffd.clone(), areas.clone(), stop.clone(), waker.clone(), stats.clone());
                std::thread::spawn(move || serve(&uffd, &areas, cfg, &stop, &waker, &stats))
            })
            .collect();
        Handler { stop, waker, threads, stats }
    }
    fn faults(&self) -> usize {
        self.stats.faults.load(SeqCst)
    }
}

impl Drop for Handler {
    fn drop(&mut self) {
        self.stop.store(true, SeqCst);
        self.waker.wake();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The handler loop: what the cache's fault thread will do, minus the page table.
fn serve(uffd: &Uffd, areas: &[Area], cfg: HandlerConfig, stop: &AtomicBool, waker: &Waker, stats: &HandlerStats) {
    let page = ps();
    let mut buf = vec![0u8; cfg.cluster * page];
    let mut msgs = [UffdMsg::ZERO; 16];
    while !stop.load(SeqCst) {
        if !cfg.spin {
            match uffd.wait(Some(waker), None).unwrap() {
                Ready::Woken => continue, // the loop condition sees `stop`
                Ready::Events | Ready::Timeout => {}
            }
        }
        for ev in uffd.read_events(&mut msgs).unwrap() {
            let Event::PageFault { addr, write, wp, .. } = ev else {
                stats.other_events.lock().unwrap().push(ev);
                continue;
            };
            stats.faults.fetch_add(1, SeqCst);
            if write {
                stats.write_faults.fetch_add(1, SeqCst);
            }
            if wp {
                stats.wp_faults.fetch_add(1, SeqCst);
            }
            let a = areas.iter().find(|a| a.contains(addr)).expect("fault outside every area");
            let idx = (addr - a.user.addr) / page;
            if stats.poison.lock().unwrap().contains(&addr) {
                // A pager error: the WP marker must go first (poison refuses any pte).
                uffd.writeprotect(addr, page, false).unwrap();
                uffd.poison(addr, page, false).unwrap();
                continue;
            }
            let first = idx / cfg.cluster * cfg.cluster;
            let n = cfg.cluster.min(a.pages - first);
            for i in 0..n {
                buf[i * page..(i + 1) * page].fill(a.fill_byte(first + i));
            }
            let done = loop {
                match uffd.install(a.installer.at(first), buf.as_ptr(), n * page, FillMode::DONTWAKE) {
                    Ok(done) => break done,
                    // A non-cooperative event is pending: it is in our queue; the next read
                    // picks it up. Retry after letting another handler thread read it.
                    Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => std::thread::yield_now(),
                    Err(e) => panic!("install: {e}"),
                }
            };
            stats.installed.fetch_add(done.copied, SeqCst);
            stats.existing.fetch_add(done.existing, SeqCst);
            if cfg.protect_before_wake {
                uffd.writeprotect(a.user.at(first), n * page, true).unwrap();
            }
            // Always wake, even when every page existed already: the faulting thread sleeps
            // until someone does.
            uffd.wake(a.user.at(first), n * page).unwrap();
        }
    }
}

/// Run `f` on a thread and fail if it does not finish within `secs` (a hung fault).
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).expect("timed out: a fault was never resolved")
}

fn pages_of(v: &[Range<usize>]) -> Vec<usize> {
    v.iter().flat_map(|r| r.clone()).collect()
}

// ---------------------------------------------------------------------------------------------
// ABI.

#[test]
fn abi_constants_match_linux() {
    // Values from linux-raw-sys 0.12 (generated from Linux 6.18 headers) and fs.h.
    assert_eq!(UFFDIO_API, 3222841919);
    assert_eq!(UFFDIO_REGISTER, 3223366144);
    assert_eq!(UFFDIO_UNREGISTER, 2148575745);
    assert_eq!(UFFDIO_WAKE, 2148575746);
    assert_eq!(UFFDIO_COPY, 3223890435);
    assert_eq!(UFFDIO_ZEROPAGE, 3223366148);
    assert_eq!(UFFDIO_WRITEPROTECT, 3222841862);
    assert_eq!(UFFDIO_CONTINUE, 3223366151);
    assert_eq!(UFFDIO_POISON, 0xC020_AA08);
    assert_eq!(USERFAULTFD_IOC_NEW, 0xAA00);
    assert_eq!(PAGEMAP_SCAN, 0xC060_6610);
    assert_eq!(size_of::<UffdMsg>(), 32);
    assert_eq!(size_of::<PmScanArg>(), 96);
    assert_eq!(size_of::<Region>(), 24);
}

#[test]
fn probe_reports_features() {
    let f = probe().unwrap_or_else(|e| panic!("probe: {e}"));
    println!("probe: {f}");
    assert!(f.has(feature::SCHEME));
    assert!(f.kernel_faults());
    assert!(f.shortfall().is_none());
    // The report names what is missing, for the fallback message.
    let lacking = Features { offered: f.offered & !feature::WP_ASYNC, enabled: 0, source: Source::Device };
    let why = lacking.shortfall().unwrap();
    assert!(why.starts_with("userfaultfd lacks WP_ASYNC: "), "{why}");
    assert!(lacking.to_string().contains("the scheme lacks: WP_ASYNC"));
}

#[test]
fn uffd_enables_what_it_asked_for() {
    let u = open_uffd(EVENTS);
    let f = u.features();
    assert!(f.has(feature::SCHEME | feature::EVENT_REMOVE | feature::EVENT_UNMAP));
    let u = open_uffd(0);
    assert!(!u.features().has(feature::EVENT_REMOVE));
}

// ---------------------------------------------------------------------------------------------
// 1. MISSING faults filled through the installer, in clusters.

#[test]
fn missing_fault_fills_cluster_through_installer() {
    let uffd = open_uffd(0);
    let areas = Arc::new(vec![Area::new(&uffd, 64)]);
    let h = Handler::start(&uffd, &areas, HandlerConfig::default(), 1);
    let a = areas.clone();
    within(10, move || {
        let a = &a[0];
        assert_eq!(a.user.read(3, 100), a.fill_byte(3)); // traps: the handler fills pages 0..16
        for p in 0..16 {
            assert_eq!(a.user.read(p, 0), a.fill_byte(p));
            assert_eq!(a.user.read(p, ps() - 1), a.fill_byte(p));
        }
    });
    assert_eq!(h.faults(), 1, "a second touch of an installed page must not trap");
    assert_eq!(h.stats.installed.load(SeqCst), 16);
    assert_eq!(areas[0].allocated_pages(), 16);
    // The installed pages are in the memfd itself: the kernel sees them too.
    assert_eq!(areas[0].pread(5, 1), vec![areas[0].fill_byte(5); ps()]);
    // The next cluster traps once more.
    let a = areas.clone();
    within(10, move || assert_eq!(a[0].user.read(20, 0), a[0].fill_byte(20)));
    assert_eq!(h.faults(), 2);
    // Read faults on a WP-registered range are MISSING faults, never WP.
    assert_eq!(h.stats.wp_faults.load(SeqCst), 0);
}

#[test]
fn write_fault_on_missing_page_is_served_and_tracked() {
    let uffd = open_uffd(0);
    let pm = Pagemap::open().unwrap();
    let areas = Arc::new(vec![Area::new(&uffd, 32)]);
    let h = Handler::start(&uffd, &areas, HandlerConfig::default(), 1);
    let a = areas.clone();
    within(10, move || a[0].user.write(7, 9, 0xEE));
    assert_eq!(h.faults(), 1);
    assert_eq!(h.stats.write_faults.load(SeqCst), 1);
    let page7 = areas[0].pread(7, 1);
    assert_eq!(page7[9], 0xEE);
    assert_eq!(page7[8], areas[0].fill_byte(7), "the store lands on the filled page");
    // The page arrived write-protected (WP marker), so the store shows as written.
    assert_eq!(areas[0].take_written(&pm), vec![7..8]);
}

// ---------------------------------------------------------------------------------------------
// 2. Resident pages never trap.

#[test]
fn resident_pages_never_trap() {
    let uffd = open_uffd(0);
    let n = 256;
    let fd_pages = |a: &Area| {
        a.pwrite(0, n / 2, 0x11); // window-style writes
    };
    let areas = Arc::new(vec![Area::new(&uffd, n)]);
    fd_pages(&areas[0]);
    let h = Handler::start(&uffd, &areas, HandlerConfig::default(), 1);
    // Fill the upper half through faults on the first user mapping.
    let a = areas.clone();
    within(10, move || {
        for p in n / 2..n {
            assert_eq!(a[0].user.read(p, 1), a[0].fill_byte(p));
        }
    });
    let after_fill = h.faults();
    assert_eq!(after_fill, n / 2 / 16);
    // A second, fresh user mapping of the same memfd: every page is resident, none traps.
    let second = Map::shared(&areas[0].fd, n);
    uffd.register(second.addr, second.len, Mode::USER).unwrap();
    uffd.writeprotect(second.addr, second.len, true).unwrap();
    for p in 0..n {
        let want = if p < n / 2 { 0x11 } else { areas[0].fill_byte(p) };
        assert_eq!(second.read(p, 0), want);
    }
    // And the first mapping again.
    for p in 0..n / 2 {
        assert_eq!(areas[0].user.read(p, 0), 0x11);
    }
    assert_eq!(h.faults(), after_fill, "touching resident pages trapped");
    drop(h);
    uffd.unregister(second.addr, second.len).unwrap();
}

/// `MADV_POPULATE_READ` maps resident pages of a registered mapping in one call (about half
/// the cost of touching them one by one), without traps, and they arrive write-protected.
#[test]
fn populate_read_maps_resident_pages_protected() {
    let uffd = open_uffd(0);
    let pm = Pagemap::open().unwrap();
    let areas = Arc::new(vec![Area::new(&uffd, 64)]);
    let a = &areas[0];
    a.pwrite(0, 64, 3);
    let h = Handler::start(&uffd, &areas, HandlerConfig::default(), 1);
    // SAFETY: populate our own mapping; every page is resident.
    assert_eq!(unsafe { libc::madvise(a.user.addr as *mut _, a.user.len, libc::MADV_POPULATE_READ) }, 0);
    let mut v = Vec::new();
    assert_eq!(pm.present(a.user.addr, a.user.len, &mut v).unwrap(), 64);
    assert_eq!(a.take_written(&pm), vec![]);
    a.user.write(10, 0, 4);
    assert_eq!(a.take_written(&pm), vec![10..11]);
    assert_eq!(h.faults(), 0);
}

// ---------------------------------------------------------------------------------------------
// 3. First writes with WP_ASYNC: no trap; PAGEMAP_SCAN finds exactly them and re-protects.

#[test]
fn async_wp_tracks_writes_without_traps() {
    let uffd = open_uffd(0);
    let pm = Pagemap::open().unwrap();
    let n = 64;
    let areas = Arc::new(vec![Area::new(&uffd, n)]);
    let a = &areas[0];
    a.pwrite(0, n, 0x22);
    let h = Handler::start(&uffd, &areas, HandlerConfig::default(), 1);
    assert_eq!(a.take_written(&pm), vec![], "nothing written yet");
    // Pages 0..8 mapped by a read first (pte present, protected); 40 never touched (marker).
    for p in 0..8 {
        assert_eq!(a.user.read(p, 0), 0x22);
    }
    for p in [1, 5, 6, 7, 40] {
        a.user.write(p, 3, 0x99);
    }
    assert_eq!(h.faults(), 0, "first writes to clean resident pages must not trap");
    assert_eq!(a.take_written(&pm), vec![1..2, 5..8, 40..41]);
    assert_eq!(a.take_written(&pm), vec![], "the scan re-protects what it found");
    a.user.write(6, 0, 1);
    a.user.write(6, 1, 2); // a second store to the same page, still one page
    assert_eq!(a.take_written(&pm), vec![6..7]);
    assert_eq!(a.pread(6, 1)[..4], [1, 2, 0x22, 0x99]);
    // A peek leaves the state alone.
    a.user.write(9, 0, 1);
    let mut v = Vec::new();
    pm.written(a.user.addr, a.user.len, &mut v).unwrap();
    assert_eq!(v, vec![a.user.at(9)..a.user.at(10)]);
    assert_eq!(a.take_written(&pm), vec![9..10]);
    assert_eq!(h.faults(), 0);
    // The installer mapping is not WP-registered: a scan demanding async WP refuses it.
    let err = pm.take_written(a.installer.addr, a.installer.len, &mut Vec::new()).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM));
}

#[test]
fn scan_loops_when_the_region_vector_fills() {
    // Every other page written: more regions than one ioctl's vector holds (256).
    let uffd = open_uffd(0);
    let pm = Pagemap::open().unwrap();
    let n = 2048;
    let areas = Arc::new(vec![Area::new(&uffd, n)]);
    let a = &areas[0];
    a.pwrite(0, n, 0);
    for p in (0..n).step_by(2) {
        a.user.write(p, 0, 1);
    }
    let got = a.take_written(&pm);
    assert_eq!(got.len(), n / 2);
    assert_eq!(pages_of(&got), (0..n).step_by(2).collect::<Vec<_>>());
    assert_eq!(a.take_written(&pm), vec![]);
    // max_pages stops early, the rest stays written for the next scan.
    for p in 0..10 {
        a.user.write(p, 0, 2);
    }
    let q = Query { max_pages: 4, ..Query::TAKE_WRITTEN };
    let mut first = Vec::new();
    let pages = pm.scan(a.user.addr, a.user.len, q, |r| first.push(r)).unwrap();
    assert_eq!(pages, 4);
    assert_eq!(pages_of(&a.take_written(&pm)), (4..10).collect::<Vec<_>>());
}

// ---------------------------------------------------------------------------------------------
// 4. Punching removes a page from every mapping; it refills through a MISSING trap.

#[test]
fn punch_hole_refaults_and_keeps_tracking() {
    let uffd = open_uffd(0);
    let pm = Pagemap::open().unwrap();
    let n = 32;
    let areas = Arc::new(vec![Area::new(&uffd, n)]);
    let a = &areas[0];
    a.pwrite(0, n, 0x33);
    let h = Handler::start(&uffd, &areas, HandlerConfig { cluster: 1, ..Default::default() }, 1);
    for p in 0..n {
        assert_eq!(a.user.read(p, 0), 0x33);
    }
    a.user.write(2, 0, 0x44);
    // Eviction order: scan (protects page 2 again), write back, punch.
    assert_eq!(a.take_written(&pm), vec![2..3]);
    a.punch(2, 2);
    assert_eq!(a.allocated_pages(), n - 2);
    let mut present = Vec::new();
    pm.present(a.user.addr, a.user.len, &mut present).unwrap();
    assert_eq!(present, vec![a.user.at(0)..a.user.at(2), a.user.at(4)..a.user.at(n - 1) + ps()]);
    assert_eq!(h.faults(), 0);
    a.seed.store(0x70, SeqCst);
    let a2 = areas.clone();
    assert_eq!(within(10, move || a2[0].user.read(2, 0)), a.fill_byte(2), "refilled from the pager");
    assert_eq!(h.faults(), 1);
    let a2 = areas.clone();
    assert_eq!(within(10, move || a2[0].user.read(3, 0)), a.fill_byte(3));
    assert_eq!(h.faults(), 2, "page 3 was punched too: one more trap (cluster 1)");
    // Writes after the refill are tracked again.
    assert_eq!(a.take_written(&pm), vec![]);
    a.user.write(2, 1, 0x55);
    a.user.write(3, 1, 0x55);
    assert_eq!(a.take_written(&pm), vec![2..4]);
    assert_eq!(h.faults(), 2);
}

/// A page written and punched *before* a scan saw the write: the store is gone with the
/// page (the cache must scan before it punches), but not unnoticed — the zap leaves an empty
/// pte, and an empty pte in a WP range counts as written, so the next scan reports it. The
/// refill then maps the page unprotected, so it looks written even if only read — unless the
/// handler write-protects the cluster before waking.
#[test]
fn punch_of_unscanned_write_is_reported_and_protect_before_wake_keeps_refill_clean() {
    for protect in [false, true] {
        let uffd = open_uffd(0);
        let pm = Pagemap::open().unwrap();
        let areas = Arc::new(vec![Area::new(&uffd, 8)]);
        let a = &areas[0];
        a.pwrite(0, 8, 0);
        let cfg = HandlerConfig { cluster: 1, protect_before_wake: protect, ..Default::default() };
        let h = Handler::start(&uffd, &areas, cfg, 1);
        a.user.write(4, 0, 1); // written, not scanned
        a.punch(4, 1); // the store is gone with the page
        let mut v = Vec::new();
        pm.written(a.user.addr, a.user.len, &mut v).unwrap();
        assert_eq!(v, vec![a.user.at(4)..a.user.at(5)], "an empty pte counts as written");
        let a2 = areas.clone();
        within(10, move || a2[0].user.read(4, 0)); // traps MISSING, refilled
        assert_eq!(h.faults(), 1);
        if protect {
            assert_eq!(a.take_written(&pm), vec![], "protect-before-wake: the refill is clean");
        } else {
            assert_eq!(a.take_written(&pm), vec![4..5], "without it, a refill from an empty pte looks written");
        }
        a.user.write(4, 0, 2);
        assert_eq!(a.take_written(&pm), vec![4..5], "a store after the refill is tracked");
    }
}

/// The eviction race of the default scheme: a store between the dirty scan and the punch is
/// lost with the page (the kernel maps resident pages into user mappings without asking us,
/// so nothing stops it). A scan after the punch reports the page written, so the cache can
/// at least detect it.
#[test]
fn store_racing_with_eviction_is_detected_after_punch() {
    let uffd = open_uffd(0);
    let pm = Pagemap::open().unwrap();
    let a = Area::new(&uffd, 4);
    a.pwrite(0, 4, 0);
    a.user.read(1, 0);
    assert_eq!(a.take_written(&pm), vec![]); // eviction: clean, nothing to write back
    a.user.write(1, 0, 7); // the racing store (async WP: no trap, nothing to stop it)
    a.punch(1, 1);
    assert_eq!(a.allocated_pages(), 3);
    assert_eq!(a.take_written(&pm), vec![1..2], "detected after the fact");
}

/// How the cache closes that race (the scheme `service.rs` uses; measured in bench_costs): register
/// user mappings MISSING + MINOR + WP and map resident pages in bulk with UFFDIO_CONTINUE
/// (WP). Then a pte that is zapped cannot come back without the handler (MINOR traps a
/// resident page with no pte), so eviction = zap the range in every user mapping
/// (MADV_DONTNEED: written state survives as an empty pte), scan, write back, punch,
/// and only then let the held faults refill.
#[test]
fn minor_registration_makes_eviction_race_free() {
    let uffd = open_uffd(0);
    let pm = Pagemap::open().unwrap();
    let n = 16;
    let fd = memfd(n);
    rustix::io::pwrite(&fd, &vec![1u8; n * ps()], 0).unwrap();
    let user = Map::shared(&fd, n);
    let installer = Map::shared(&fd, n);
    let both = Mode { missing: true, wp: true, minor: true };
    let ioctls = uffd.register(user.addr, user.len, both).unwrap();
    assert_ne!(ioctls & range_ioctl::CONTINUE, 0);
    uffd.writeprotect(user.addr, user.len, true).unwrap();
    uffd.register(installer.addr, installer.len, Mode::INSTALLER).unwrap();
    // Map every resident page at once, write-protected: no faults at all afterwards.
    uffd.continue_(user.addr, user.len, FillMode { dontwake: true, wp: true }).unwrap();
    let mut v = Vec::new();
    assert_eq!(pm.present(user.addr, user.len, &mut v).unwrap(), n as u64);
    assert_eq!(user.read(5, 0), 1);
    user.write(3, 0, 2); // async WP, no trap
    // Evict pages 2..4: zap them from the user mapping, then scan.
    // SAFETY: DONTNEED on our shared mapping drops ptes only.
    assert_eq!(unsafe { libc::madvise(user.at(2) as *mut _, 2 * ps(), libc::MADV_DONTNEED) }, 0);
    v.clear();
    pm.take_written(user.at(2), 2 * ps(), &mut v).unwrap();
    assert_eq!(v, vec![user.at(3)..user.at(4)], "the zapped store is still seen");
    // A store now traps (MINOR) instead of reaching the page behind our back.
    let page3 = user.at(3);
    let t = std::thread::spawn(move || {
        // SAFETY: our mapping, alive until the thread is joined.
        unsafe { std::ptr::write_volatile(page3 as *mut u8, 9) }
    });
    assert_eq!(uffd.wait(None, Some(Duration::from_secs(5))).unwrap(), Ready::Events);
    let mut msgs = [UffdMsg::ZERO; 4];
    let evs: Vec<_> = uffd.read_events(&mut msgs).unwrap().collect();
    assert!(matches!(evs[..], [Event::PageFault { addr, minor: true, write: true, .. }] if addr == page3), "{evs:?}");
    assert_eq!(fd_byte(&fd, 3, 0), 2, "the page still holds the store being written back");
    // Write back (here: nothing), punch, refill through the installer, map, wake.
    rustix::fs::fallocate(
        &fd,
        rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
        (2 * ps()) as u64,
        (2 * ps()) as u64,
    )
    .unwrap();
    let src = vec![5u8; ps()];
    uffd.copy(installer.at(3), src.as_ptr(), ps(), FillMode::DONTWAKE).unwrap();
    uffd.continue_(page3, ps(), FillMode { dontwake: false, wp: true }).unwrap();
    t.join().unwrap();
    assert_eq!((fd_byte(&fd, 3, 0), fd_byte(&fd, 3, 1)), (9, 5), "the held store lands on the refilled page");
    v.clear();
    pm.take_written(user.addr, user.len, &mut v).unwrap();
    assert_eq!(v, vec![page3..page3 + ps()]);
}

fn fd_byte(fd: &OwnedFd, page: usize, off: usize) -> u8 {
    let mut b = [0u8];
    rustix::io::pread(fd, &mut b, (page * ps() + off) as u64).unwrap();
    b[0]
}

/// A clean (protected) page punched keeps its WP marker: the refill arrives protected even
/// without protect-before-wake, in this mapping and in a second user mapping.
#[test]
fn punch_of_clean_page_keeps_marker_in_every_mapping() {
    let uffd = open_uffd(0);
    let pm = Pagemap::open().unwrap();
    let areas = Arc::new(vec![Area::new(&uffd, 8)]);
    let a = &areas[0];
    let second = Map::shared(&a.fd, 8);
    uffd.register(second.addr, second.len, Mode::USER).unwrap();
    uffd.writeprotect(second.addr, second.len, true).unwrap();
    let h = Handler::start(&uffd, &areas, HandlerConfig { cluster: 1, ..Default::default() }, 1);
    let a2 = areas.clone();
    within(10, move || a2[0].user.read(2, 0));
    assert_eq!(second.read(2, 0), a.fill_byte(2), "no trap: resident");
    a.punch(2, 1);
    let a2 = areas.clone();
    within(10, move || a2[0].user.read(2, 0));
    assert_eq!(h.faults(), 2);
    second.write(2, 0, 9);
    a.user.write(2, 1, 9);
    assert_eq!(a.take_written(&pm), vec![2..3]);
    let mut v = Vec::new();
    pm.take_written(second.addr, second.len, &mut v).unwrap();
    assert_eq!(v, vec![second.at(2)..second.at(3)]);
    drop(h);
    uffd.unregister(second.addr, second.len).unwrap();
}

// ---------------------------------------------------------------------------------------------
// 5. Kernel accesses to unfilled pages wait for the handler.

#[test]
fn kernel_access_waits_for_handler() {
    let uffd = open_uffd(0);
    assert!(uffd.features().kernel_faults());
    let areas = Arc::new(vec![Area::new(&uffd, 64)]);
    let h = Handler::start(&uffd, &areas, HandlerConfig { cluster: 4, ..Default::default() }, 1);
    let a = areas.clone();
    let n = 12 * ps();
    // write(2) from the mapping into another memfd: copy_from_user faults, waits, succeeds.
    let (written, copy) = within(10, move || {
        let dst = memfd(0);
        // SAFETY: reads n bytes of our live mapping.
        let w = unsafe { libc::write(dst.as_raw_fd(), a[0].user.at(2) as *const libc::c_void, n) };
        let mut copy = vec![0u8; n];
        rustix::io::pread(&dst, &mut copy, 0).unwrap();
        (w, copy)
    });
    assert_eq!(written, n as isize);
    for (i, chunk) in copy.chunks(ps()).enumerate() {
        assert!(chunk.iter().all(|&b| b == areas[0].fill_byte(2 + i)), "page {}", 2 + i);
    }
    assert_eq!(h.faults(), 4, "pages 2..14 in clusters of 4: 0..4, 4..8, 8..12, 12..16");
    // read(2) into the mapping (the kernel stores into unfilled pages): also waits.
    let a = areas.clone();
    let r = within(10, move || {
        let mut p = [0; 2];
        // SAFETY: pipe2 fills two ints.
        assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: the descriptors are fresh and ours.
        let (rx, tx) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        rustix::io::write(&tx, &[0xAB; 100]).unwrap();
        // SAFETY: writes 100 bytes into our live mapping.
        unsafe { libc::read(rx.as_raw_fd(), (a[0].user.at(40) + 10) as *mut libc::c_void, 100) }
    });
    assert_eq!(r, 100);
    assert_eq!(areas[0].pread(40, 1)[10..110], [0xAB; 100]);
    assert_eq!(areas[0].pread(40, 1)[0], areas[0].fill_byte(40));
}

// ---------------------------------------------------------------------------------------------
// 6. Poison: SIGBUS for a pager error, EFAULT for the kernel; the rest keeps working.

#[test]
fn poison_fails_kernel_access_and_can_be_cleared() {
    let uffd = open_uffd(0);
    let areas = Arc::new(vec![Area::new(&uffd, 16)]);
    let a = &areas[0];
    let h = Handler::start(&uffd, &areas, HandlerConfig { cluster: 1, ..Default::default() }, 1);
    // The WP marker left by write-protecting counts as a pte: poison refuses it.
    let err = uffd.poison(a.user.at(5), ps(), false).unwrap_err();
    assert_eq!(err.errno, libc::EEXIST);
    uffd.writeprotect(a.user.at(5), ps(), false).unwrap();
    uffd.poison(a.user.at(5), ps(), false).unwrap();
    // Poison is a pte of this mapping, not a memfd page.
    assert_eq!(a.allocated_pages(), 0);
    let dst = memfd(0);
    // SAFETY: reads one page of our live mapping (poisoned: the kernel returns EFAULT).
    let w = unsafe { libc::write(dst.as_raw_fd(), a.user.at(5) as *const libc::c_void, ps()) };
    assert_eq!(w, -1);
    assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EFAULT));
    // Neighbours and other mappings still work.
    let a2 = areas.clone();
    within(10, move || (a2[0].user.read(4, 0), a2[0].user.read(6, 0)));
    assert_eq!(h.faults(), 2);
    // Punching does not clear poison: it is a marker, not a page.
    a.punch(0, 16);
    // SAFETY: as above.
    let w = unsafe { libc::write(dst.as_raw_fd(), a.user.at(5) as *const libc::c_void, ps()) };
    assert_eq!(w, -1);
    // clear_poison: zap the pte and protect again; the next touch traps MISSING and fills.
    clear_poison(&uffd, a.user.at(5), ps()).unwrap();
    let a2 = areas.clone();
    assert_eq!(within(10, move || a2[0].user.read(5, 0)), a.fill_byte(5));
    let pm = Pagemap::open().unwrap();
    a.user.write(5, 0, 1);
    assert_eq!(a.take_written(&pm), vec![5..6], "tracked again after clearing");
}

/// The SIGBUS half runs in a child process (this test binary again, told by an environment
/// variable to run `poison_child`), which must die of SIGBUS after the checks before it pass.
#[test]
fn poison_raises_sigbus_in_child() {
    use std::os::unix::process::ExitStatusExt;
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "map::tests::poison_child", "--nocapture", "--test-threads=1"])
        .env("UBC_MAP_POISON_CHILD", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("child: other pages work"),
        "child output:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stdout.contains("child: survived"), "{stdout}");
    assert_eq!(out.status.signal(), Some(libc::SIGBUS), "child status {:?}\n{stdout}", out.status);
}

#[test]
fn poison_child() {
    if std::env::var_os("UBC_MAP_POISON_CHILD").is_none() {
        return; // only in the child of poison_raises_sigbus_in_child
    }
    let uffd = open_uffd(0);
    let areas = Arc::new(vec![Area::new(&uffd, 16), Area::new(&uffd, 16)]);
    // The handler turns the fault on page 7 of the first area into poison (a pager error).
    let h = Handler::start(&uffd, &areas, HandlerConfig { cluster: 1, ..Default::default() }, 1);
    h.stats.poison.lock().unwrap().push(areas[0].user.at(7));
    // Kernel access to the failing page: EFAULT, not a crash.
    let dst = memfd(0);
    // SAFETY: reads one page of our live mapping.
    let w = unsafe { libc::write(dst.as_raw_fd(), areas[0].user.at(7) as *const libc::c_void, ps()) };
    assert_eq!((w, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EFAULT)));
    assert_eq!(areas[0].user.read(6, 0), areas[0].fill_byte(6));
    assert_eq!(areas[1].user.read(7, 0), areas[1].fill_byte(7));
    println!("child: other pages work");
    let _ = areas[0].user.read(7, 0); // SIGBUS
    println!("child: survived");
    std::process::exit(3);
}

// ---------------------------------------------------------------------------------------------
// 7. Several mappings, several faulting threads, several handler threads, one uffd.

#[test]
fn two_memfds_two_threads_served_in_parallel() {
    let uffd = open_uffd(0);
    let n = 512;
    let areas = Arc::new(vec![Area::new(&uffd, n), Area::new(&uffd, n)]);
    areas[1].seed.store(0x90, SeqCst);
    let h = Handler::start(&uffd, &areas, HandlerConfig { cluster: 4, ..Default::default() }, 2);
    let a = areas.clone();
    within(30, move || {
        let ts: Vec<_> = (0..4)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    // Threads 0,1 on area 0 and 2,3 on area 1, in opposite directions, so
                    // they race on clusters.
                    let area = &a[t / 2];
                    for i in 0..n {
                        let p = if t % 2 == 0 { i } else { n - 1 - i };
                        assert_eq!(area.user.read(p, (p * 7) % ps()), area.fill_byte(p));
                    }
                })
            })
            .collect();
        for t in ts {
            t.join().unwrap();
        }
    });
    let f = h.faults();
    let installed = h.stats.installed.load(SeqCst);
    assert_eq!(installed, 2 * n, "every page installed exactly once");
    assert!((2 * n / 4..=4 * n / 4).contains(&f), "faults {f}");
    assert_eq!(areas[0].allocated_pages() + areas[1].allocated_pages(), 2 * n);
}

// ---------------------------------------------------------------------------------------------
// Races and events the cache must handle.

#[test]
fn install_skips_pages_that_exist() {
    let uffd = open_uffd(0);
    let a = Area::new(&uffd, 8);
    a.pwrite(3, 1, 0x77); // filled by another path meanwhile (a window write)
    let src = vec![0x10u8; 8 * ps()];
    let got = uffd.install(a.installer.at(0), src.as_ptr(), 8 * ps(), FillMode::DONTWAKE).unwrap();
    assert_eq!(got, Installed { copied: 7, existing: 1 });
    assert_eq!(a.pread(3, 1), vec![0x77; ps()], "an existing page is never overwritten");
    assert_eq!(a.pread(4, 1), vec![0x10; ps()]);
    // The raw copy reports the partial progress and the reason.
    let b = Area::new(&uffd, 8);
    b.pwrite(2, 1, 0);
    let e = uffd.copy(b.installer.at(0), src.as_ptr(), 8 * ps(), FillMode::DONTWAKE).unwrap_err();
    assert_eq!((e.done, e.errno), (2 * ps(), libc::EAGAIN));
    let e = uffd.copy(b.installer.at(2), src.as_ptr(), 6 * ps(), FillMode::DONTWAKE).unwrap_err();
    assert_eq!((e.done, e.errno), (0, libc::EEXIST));
    // Zero-fill (a hole) also refuses existing pages, and allocates real pages on shmem.
    let e = uffd.zeropage(b.installer.at(2), ps(), true).unwrap_err();
    assert_eq!(e.errno, libc::EEXIST);
    uffd.zeropage(b.installer.at(6), 2 * ps(), true).unwrap();
    assert_eq!(b.allocated_pages(), 5);
    // Copying into a range this uffd does not cover fails cleanly.
    let stray = Map::shared(&b.fd, 8);
    let e = uffd.copy(stray.at(7), src.as_ptr(), ps(), FillMode::DONTWAKE).unwrap_err();
    assert_eq!(e.errno, libc::ENOENT);
}

#[test]
fn remove_and_unmap_events_and_eagain_while_pending() {
    let uffd = open_uffd(EVENTS);
    let a = Arc::new(Area::new(&uffd, 16));
    let mut msgs = [UffdMsg::ZERO; 8];
    assert_eq!(uffd.read_events(&mut msgs).unwrap().count(), 0);
    // madvise(DONTNEED) on the user mapping blocks until the handler reads the event...
    let a2 = a.clone();
    let t = std::thread::spawn(move || {
        // SAFETY: DONTNEED on our shared mapping drops ptes only.
        unsafe { libc::madvise(a2.user.at(4) as *mut _, 2 * ps(), libc::MADV_DONTNEED) }
    });
    std::thread::sleep(Duration::from_millis(100));
    assert!(!t.is_finished(), "madvise waits for the Remove event to be read");
    // ...and meanwhile fills fail with EAGAIN (mmap_changing), without progress.
    let src = vec![1u8; ps()];
    let e = uffd.copy(a.installer.at(0), src.as_ptr(), ps(), FillMode::DONTWAKE).unwrap_err();
    assert_eq!((e.done, e.errno), (0, libc::EAGAIN));
    assert_eq!(uffd.wait(None, Some(Duration::from_secs(5))).unwrap(), Ready::Events);
    let evs: Vec<_> = uffd.read_events(&mut msgs).unwrap().collect();
    assert_eq!(evs, vec![Event::Remove { start: a.user.at(4), end: a.user.at(6) }]);
    assert_eq!(t.join().unwrap(), 0);
    uffd.copy(a.installer.at(0), src.as_ptr(), ps(), FillMode::DONTWAKE).unwrap();
    // munmap of a registered range: an Unmap event. The unmapper waits until it is read —
    // for each of the Area's two registered mappings — so keep reading until it is done.
    let a = Arc::into_inner(a).unwrap();
    let (user, inst) =
        ((a.user.addr, a.user.addr + a.user.len), (a.installer.addr, a.installer.addr + a.installer.len));
    let t = std::thread::spawn(move || drop(a));
    let mut evs = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !t.is_finished() && Instant::now() < deadline {
        uffd.wait(None, Some(Duration::from_millis(20))).unwrap();
        evs.extend(uffd.read_events(&mut msgs).unwrap());
    }
    t.join().unwrap();
    assert!(evs.contains(&Event::Unmap { start: user.0, end: user.1 }), "{evs:?}");
    assert!(evs.contains(&Event::Unmap { start: inst.0, end: inst.1 }), "{evs:?}");
}

/// Closing the uffd while user mappings remain turns them into plain shared memory: a touch
/// of an unfilled page then allocates a zero page in the memfd (a page no write produced).
/// The cache must unmap (or poison) every user mapping before it drops its uffd.
#[test]
fn dropping_the_uffd_unregisters_its_mappings() {
    let uffd = open_uffd(0);
    let a = Area::new(&uffd, 4);
    drop(uffd);
    assert_eq!(a.user.read(1, 0), 0);
    assert_eq!(a.allocated_pages(), 1);
}

#[test]
fn waker_interrupts_wait() {
    let uffd = open_uffd(0);
    let w = Arc::new(Waker::new().unwrap());
    assert_eq!(uffd.wait(Some(&w), Some(Duration::from_millis(10))).unwrap(), Ready::Timeout);
    let w2 = w.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        w2.wake();
    });
    assert_eq!(uffd.wait(Some(&w), Some(Duration::from_secs(5))).unwrap(), Ready::Woken);
    t.join().unwrap();
    // It stays signalled until drained (so every handler thread sees a shutdown).
    assert_eq!(uffd.wait(Some(&w), Some(Duration::from_millis(10))).unwrap(), Ready::Woken);
    assert!(w.drain());
    assert_eq!(uffd.wait(Some(&w), Some(Duration::from_millis(10))).unwrap(), Ready::Timeout);
}

#[test]
fn minor_mode_continue_maps_resident_page() {
    // MINOR is not part of the scheme (it would trap on resident pages), but continue_ works.
    let uffd = open_uffd(0);
    let fd = memfd(4);
    let m = Map::shared(&fd, 4);
    uffd.register(m.addr, m.len, Mode { minor: true, ..Default::default() }).unwrap();
    rustix::io::pwrite(&fd, &vec![5u8; ps()], 0).unwrap();
    let addr = m.at(0);
    let u = uffd.clone();
    let t = std::thread::spawn(move || {
        let mut msgs = [UffdMsg::ZERO; 4];
        u.wait(None, Some(Duration::from_secs(5))).unwrap();
        let ev: Vec<_> = u.read_events(&mut msgs).unwrap().collect();
        u.continue_(addr, ps(), FillMode::WAKE).unwrap();
        ev
    });
    assert_eq!(m.read(0, 0), 5);
    let ev = t.join().unwrap();
    assert!(matches!(ev[..], [Event::PageFault { minor: true, .. }]), "{ev:?}");
}

// ---------------------------------------------------------------------------------------------
// 8. Costs. `cargo test --release -p ubc --lib map::tests::bench -- --ignored --nocapture`

fn per_page(t: Duration, pages: usize) -> f64 {
    t.as_secs_f64() * 1e6 / pages as f64
}

#[test]
#[ignore]
fn bench_costs() {
    let n = 16384;
    let pm = Pagemap::open().unwrap();
    println!("costs per 4 KiB page ({n} pages unless said):");

    // Baseline: a fresh unregistered mapping of resident pages (kernel path, fault-around).
    let fd = memfd(n);
    rustix::io::pwrite(&fd, &vec![1u8; n * ps()], 0).unwrap();
    let m = Map::shared(&fd, n);
    let t = Instant::now();
    for p in 0..n {
        m.read(p, 0);
    }
    println!("  resident touch, plain mapping (kernel fault-around): {:.3} µs", per_page(t.elapsed(), n));
    drop(m);

    // Resident touch through a registered, protected mapping: zero traps.
    let uffd = open_uffd(0);
    let m = Map::shared(&fd, n);
    uffd.register(m.addr, m.len, Mode::USER).unwrap();
    uffd.writeprotect(m.addr, m.len, true).unwrap();
    let t = Instant::now();
    for p in 0..n {
        m.read(p, 0);
    }
    println!("  resident touch, MISSING+WP registered mapping (no trap): {:.3} µs", per_page(t.elapsed(), n));
    drop(m);
    let m = Map::shared(&fd, n);
    uffd.register(m.addr, m.len, Mode::USER).unwrap();
    uffd.writeprotect(m.addr, m.len, true).unwrap();
    let t = Instant::now();
    // SAFETY: populate our own mapping; every page is resident so no uffd fault occurs.
    let r = unsafe { libc::madvise(m.addr as *mut _, m.len, libc::MADV_POPULATE_READ) };
    assert_eq!(r, 0);
    println!("  resident, MADV_POPULATE_READ of a registered mapping: {:.3} µs", per_page(t.elapsed(), n));
    let t = Instant::now();
    for p in 0..n {
        m.read(p, 0);
    }
    println!("  resident touch after populate: {:.3} µs", per_page(t.elapsed(), n));

    drop(m);
    // The MINOR variant: map every resident page of a fresh mapping in one UFFDIO_CONTINUE.
    let m = Map::shared(&fd, n);
    uffd.register(m.addr, m.len, Mode { missing: true, wp: true, minor: true }).unwrap();
    uffd.writeprotect(m.addr, m.len, true).unwrap();
    let t = Instant::now();
    uffd.continue_(m.addr, m.len, FillMode { dontwake: true, wp: true }).unwrap();
    println!("  resident, one UFFDIO_CONTINUE(WP) over a MISSING+MINOR+WP mapping: {:.3} µs", per_page(t.elapsed(), n));
    let t = Instant::now();
    for p in 0..n {
        m.read(p, 0);
    }
    println!("  resident touch after CONTINUE: {:.3} µs", per_page(t.elapsed(), n));
    let t = Instant::now();
    // SAFETY: DONTNEED on our shared mapping drops ptes only (the eviction zap).
    assert_eq!(unsafe { libc::madvise(m.addr as *mut _, m.len, libc::MADV_DONTNEED) }, 0);
    println!("  MADV_DONTNEED of a mapped registered range: {:.3} µs", per_page(t.elapsed(), n));
    drop(m);
    let m = Map::shared(&fd, n);
    uffd.register(m.addr, m.len, Mode::USER).unwrap();
    uffd.writeprotect(m.addr, m.len, true).unwrap();
    for p in 0..n {
        m.read(p, 0);
    }

    // First write to clean resident pages (async WP): ptes present first, then via markers.
    let t = Instant::now();
    for p in 0..n {
        m.write(p, 0, 2);
    }
    println!("  first write, WP_ASYNC, pte present (no trap): {:.3} µs", per_page(t.elapsed(), n));
    let t = Instant::now();
    let mut v = Vec::new();
    let got = pm.take_written(m.addr, m.len, &mut v).unwrap();
    let el = t.elapsed();
    assert_eq!(got, n as u64);
    println!("  PAGEMAP_SCAN take_written, all {n} written: {:.3} ms total", el.as_secs_f64() * 1e3);
    let t = Instant::now();
    v.clear();
    assert_eq!(pm.take_written(m.addr, m.len, &mut v).unwrap(), 0);
    println!("  PAGEMAP_SCAN take_written, none written: {:.3} ms total", t.elapsed().as_secs_f64() * 1e3);
    for p in (0..n).step_by(2) {
        m.write(p, 0, 3);
    }
    let t = Instant::now();
    v.clear();
    assert_eq!(pm.take_written(m.addr, m.len, &mut v).unwrap(), n as u64 / 2);
    println!(
        "  PAGEMAP_SCAN take_written, every other page written ({} regions): {:.3} ms total",
        v.len(),
        t.elapsed().as_secs_f64() * 1e3
    );
    drop(m);
    let m = Map::shared(&fd, n);
    uffd.register(m.addr, m.len, Mode::USER).unwrap();
    uffd.writeprotect(m.addr, m.len, true).unwrap();
    let t = Instant::now();
    for p in 0..n {
        m.write(p, 0, 4);
    }
    println!(
        "  first write, WP_ASYNC, untouched page (marker: fault + wp fault, no trap): {:.3} µs",
        per_page(t.elapsed(), n)
    );
    drop(m);
    drop(fd);

    // UFFDIO_COPY cost without faults: 1 page per ioctl vs 16.
    for batch in [1, 16] {
        let fd = memfd(n);
        let inst = Map::shared(&fd, n);
        uffd.register(inst.addr, inst.len, Mode::INSTALLER).unwrap();
        let src = vec![7u8; batch * ps()];
        let t = Instant::now();
        for p in (0..n).step_by(batch) {
            uffd.copy(inst.at(p), src.as_ptr(), batch * ps(), FillMode::DONTWAKE).unwrap();
        }
        println!("  UFFDIO_COPY into the installer, {batch:2} pages per ioctl: {:.3} µs", per_page(t.elapsed(), n));
    }

    // MISSING faults served by a handler thread.
    for (cluster, spin, pages) in [(1, false, 2048), (16, false, n), (1, true, 2048), (16, true, n)] {
        let uffd = open_uffd(0);
        let areas = Arc::new(vec![Area::new(&uffd, pages)]);
        let h = Handler::start(&uffd, &areas, HandlerConfig { cluster, spin, ..Default::default() }, 1);
        let a = areas.clone();
        let el = within(120, move || {
            let t = Instant::now();
            for p in 0..pages {
                a[0].user.read(p, 0);
            }
            t.elapsed()
        });
        println!(
            "  MISSING fault, cluster {cluster:2}, handler {}: {:.3} µs ({pages} pages, {} traps)",
            if spin { "spinning" } else { "blocked in poll" },
            per_page(el, pages),
            h.faults()
        );
    }
}

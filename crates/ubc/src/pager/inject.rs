//! A pager wrapper that fails on cue: error injection for tests of error paths (EIO at
//! read, ENOSPC at writeback, failing sync, torn reads and writes, slow I/O, a hang that
//! recovers), at any layer of a stack — one [`Injector`] switchboard can drive the pagers of
//! many files (`InjectingPager::with_injector`), so a layer can arm every file it opens at once.

use super::{Fill, Identity, IoMode, Pager};
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering::*};
use std::time::{Duration, Instant};

/// What to break, shared by any number of [`InjectingPager`]s.
pub struct Injector {
    get_errno: AtomicI32,
    put_errno: AtomicI32,
    sync_errno: AtomicI32,
    set_len_errno: AtomicI32,
    /// Torn transfers: an armed read fills the buffer with the data, then scribbles over
    /// its second half before failing; an armed write stores the first half, then fails.
    torn: AtomicBool,
    delay_us: AtomicU64,
    /// Every operation blocks until this instant (µs since `epoch`; 0 = no hang).
    hang_until_us: AtomicU64,
    epoch: Instant,
    /// Fail only this many more operations of the armed kinds (u64::MAX = until cleared).
    remaining: AtomicU64,
    gets: AtomicU64,
    puts: AtomicU64,
    syncs: AtomicU64,
    failures: AtomicU64,
    hung: AtomicU64,
}

/// Operation counts of a [`InjectingPager`] (of every pager sharing its [`Injector`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InjectedCounts {
    pub gets: u64,
    pub puts: u64,
    pub syncs: u64,
    /// Operations that were made to fail.
    pub failures: u64,
    /// Operations that were held by [`Injector::hang_for`].
    pub hung: u64,
}

impl Default for Injector {
    fn default() -> Injector {
        Injector {
            get_errno: AtomicI32::new(0),
            put_errno: AtomicI32::new(0),
            sync_errno: AtomicI32::new(0),
            set_len_errno: AtomicI32::new(0),
            torn: AtomicBool::new(false),
            delay_us: AtomicU64::new(0),
            hang_until_us: AtomicU64::new(0),
            epoch: Instant::now(),
            remaining: AtomicU64::new(u64::MAX),
            gets: AtomicU64::new(0),
            puts: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            hung: AtomicU64::new(0),
        }
    }
}

impl Injector {
    pub fn new() -> Arc<Injector> {
        Arc::new(Injector::default())
    }

    /// `get_pages` fails with `errno` (e.g. `libc::EIO`) until cleared with `None`.
    pub fn fail_reads(&self, errno: Option<i32>) {
        self.get_errno.store(errno.unwrap_or(0), SeqCst);
    }
    /// `put_pages` fails with `errno` (e.g. `libc::ENOSPC`) until cleared with `None`.
    pub fn fail_writes(&self, errno: Option<i32>) {
        self.put_errno.store(errno.unwrap_or(0), SeqCst);
    }
    /// `sync` fails with `errno` until cleared.
    pub fn fail_syncs(&self, errno: Option<i32>) {
        self.sync_errno.store(errno.unwrap_or(0), SeqCst);
    }
    /// `set_len` fails with `errno` until cleared.
    pub fn fail_set_len(&self, errno: Option<i32>) {
        self.set_len_errno.store(errno.unwrap_or(0), SeqCst);
    }
    /// Armed reads and writes are torn rather than refused: a read returns its error after
    /// filling the buffer and scribbling over the second half (a short read the store
    /// reported late); a write stores the first half of the data before failing (a short
    /// write). The cache must neither keep the scribbled buffer nor treat the half-stored
    /// pages as clean.
    pub fn tear(&self, on: bool) {
        self.torn.store(on, SeqCst);
    }
    /// Only the next `n` armed operations fail; later ones succeed (a transient failure).
    pub fn fail_only_next(&self, n: u64) {
        self.remaining.store(n, SeqCst);
    }
    /// Every operation sleeps this long first (slow storage).
    pub fn set_delay(&self, d: Duration) {
        self.delay_us.store(d.as_micros() as u64, SeqCst);
    }
    /// Every operation started in the next `d` blocks until `d` has passed, then proceeds
    /// normally (a store that hangs and recovers: a stalled NFS server, a path failover).
    pub fn hang_for(&self, d: Duration) {
        let until = (self.epoch.elapsed() + d).as_micros() as u64;
        self.hang_until_us.store(until.max(1), SeqCst);
    }
    /// Clear every injected failure (a hang ends now).
    pub fn heal(&self) {
        for e in [&self.get_errno, &self.put_errno, &self.sync_errno, &self.set_len_errno] {
            e.store(0, SeqCst);
        }
        self.torn.store(false, SeqCst);
        self.delay_us.store(0, SeqCst);
        self.hang_until_us.store(0, SeqCst);
        self.remaining.store(u64::MAX, SeqCst);
    }

    pub fn counts(&self) -> InjectedCounts {
        InjectedCounts {
            gets: self.gets.load(SeqCst),
            puts: self.puts.load(SeqCst),
            syncs: self.syncs.load(SeqCst),
            failures: self.failures.load(SeqCst),
            hung: self.hung.load(SeqCst),
        }
    }

    /// Delay and hang, then whether this operation fails (and with which errno).
    fn check(&self, errno: &AtomicI32) -> Option<i32> {
        let d = self.delay_us.load(Relaxed);
        if d > 0 {
            std::thread::sleep(Duration::from_micros(d));
        }
        let mut counted = false;
        loop {
            let until = self.hang_until_us.load(SeqCst);
            let now = self.epoch.elapsed().as_micros() as u64;
            if until == 0 || now >= until {
                break;
            }
            if !counted {
                self.hung.fetch_add(1, SeqCst);
                counted = true;
            }
            // Short naps so that `heal` ends a hang promptly.
            std::thread::sleep(Duration::from_micros((until - now).min(2000)));
        }
        let e = errno.load(SeqCst);
        if e == 0 {
            return None;
        }
        let armed = self.remaining.fetch_update(SeqCst, SeqCst, |r| match r {
            0 => None,
            u64::MAX => Some(u64::MAX),
            r => Some(r - 1),
        });
        if armed.is_err() {
            return None;
        }
        self.failures.fetch_add(1, SeqCst);
        Some(e)
    }
}

/// Wraps a pager; each operation can be made to fail with an errno, be torn, slow or hang.
/// Derefs to its [`Injector`].
pub struct InjectingPager {
    inner: Arc<dyn Pager>,
    faults: Arc<Injector>,
}

impl InjectingPager {
    /// A wrapper with a switchboard of its own.
    pub fn new(inner: Arc<dyn Pager>) -> InjectingPager {
        InjectingPager::with_injector(inner, Injector::new())
    }

    /// A wrapper driven by a shared switchboard.
    pub fn with_injector(inner: Arc<dyn Pager>, faults: Arc<Injector>) -> InjectingPager {
        InjectingPager { inner, faults }
    }

    pub fn injector(&self) -> &Arc<Injector> {
        &self.faults
    }
}

impl std::ops::Deref for InjectingPager {
    type Target = Injector;
    fn deref(&self) -> &Injector {
        &self.faults
    }
}

fn err(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

impl Pager for InjectingPager {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        let f = &self.faults;
        f.gets.fetch_add(1, SeqCst);
        match f.check(&f.get_errno) {
            None => self.inner.get_pages(offset, buf),
            Some(e) if f.torn.load(SeqCst) => {
                if self.inner.get_pages(offset, buf)? == Fill::Data {
                    let half = buf.len() / 2;
                    buf[half..].fill(0xa5);
                }
                Err(err(e))
            }
            Some(e) => Err(err(e)),
        }
    }
    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let f = &self.faults;
        f.puts.fetch_add(1, SeqCst);
        match f.check(&f.put_errno) {
            None => self.inner.put_pages(offset, data),
            Some(e) => {
                if f.torn.load(SeqCst) {
                    self.inner.put_pages(offset, &data[..data.len() / 2])?;
                }
                Err(err(e))
            }
        }
    }
    fn fill_granule(&self) -> u64 {
        self.inner.fill_granule()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        match self.faults.check(&self.faults.set_len_errno) {
            None => self.inner.set_len(len),
            Some(e) => Err(err(e)),
        }
    }
    fn sync(&self) -> io::Result<()> {
        let f = &self.faults;
        f.syncs.fetch_add(1, SeqCst);
        match f.check(&f.sync_errno) {
            None => self.inner.sync(),
            Some(e) => Err(err(e)),
        }
    }
    fn sync_metadata(&self) -> io::Result<()> {
        let f = &self.faults;
        f.syncs.fetch_add(1, SeqCst);
        match f.check(&f.sync_errno) {
            None => self.inner.sync_metadata(),
            Some(e) => Err(err(e)),
        }
    }
    fn write_through(&self) -> io::Result<()> {
        self.inner.write_through()
    }
    fn init(&self, request: crate::PagerRequest) {
        self.inner.init(request)
    }
    fn unlock_request(&self, range: std::ops::Range<u64>) -> io::Result<()> {
        self.inner.unlock_request(range)
    }
    fn fault_guard(&self, range: std::ops::Range<u64>, store: bool) -> io::Result<Option<crate::pager::FaultGuard>> {
        self.inner.fault_guard(range, store)
    }
    fn identity(&self) -> Option<Identity> {
        self.inner.identity()
    }
    fn is_writable(&self) -> bool {
        self.inner.is_writable()
    }
    fn describe(&self) -> String {
        format!("fault-injected {}", self.inner.describe())
    }
    fn io_mode(&self) -> IoMode {
        self.inner.io_mode()
    }
    fn can_punch(&self) -> bool {
        self.inner.can_punch()
    }
    fn punch(&self, offset: u64, len: u64) -> io::Result<bool> {
        match self.faults.check(&self.faults.put_errno) {
            None => self.inner.punch(offset, len),
            Some(e) => Err(err(e)),
        }
    }
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        match self.faults.check(&self.faults.put_errno) {
            None => self.inner.allocate(offset, len),
            Some(e) => Err(err(e)),
        }
    }
    fn seek(&self, offset: u64, what: super::Seek) -> io::Result<Option<u64>> {
        self.inner.seek(offset, what)
    }
    fn depth(&self) -> u32 {
        // A wrapper is at its inner pager's depth: the lock order (`order.rs`) ranks its
        // calls by it, and a wrapped layer reporting 0 would break that order.
        self.inner.depth()
    }
}

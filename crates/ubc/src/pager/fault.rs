//! A pager wrapper that fails on cue: fault injection for tests of error paths (EIO at
//! read, ENOSPC at writeback, failing sync, slow I/O), at any layer of a stack.

use super::{Fill, Identity, IoMode, Pager};
use std::io;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering::*};
use std::sync::Arc;
use std::time::Duration;

/// Wraps a pager; each operation can be made to fail with an errno, or to be slow.
pub struct FaultPager {
    inner: Arc<dyn Pager>,
    get_errno: AtomicI32,
    put_errno: AtomicI32,
    sync_errno: AtomicI32,
    set_len_errno: AtomicI32,
    delay_us: AtomicU64,
    /// Fail only this many more operations of the armed kinds (u64::MAX = until cleared).
    remaining: AtomicU64,
    gets: AtomicU64,
    puts: AtomicU64,
    syncs: AtomicU64,
    failures: AtomicU64,
}

/// Operation counts of a [`FaultPager`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub gets: u64,
    pub puts: u64,
    pub syncs: u64,
    /// Operations that were made to fail.
    pub failures: u64,
}

impl FaultPager {
    pub fn new(inner: Arc<dyn Pager>) -> FaultPager {
        FaultPager {
            inner,
            get_errno: AtomicI32::new(0),
            put_errno: AtomicI32::new(0),
            sync_errno: AtomicI32::new(0),
            set_len_errno: AtomicI32::new(0),
            delay_us: AtomicU64::new(0),
            remaining: AtomicU64::new(u64::MAX),
            gets: AtomicU64::new(0),
            puts: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        }
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
    /// Only the next `n` armed operations fail; later ones succeed (a transient fault).
    pub fn fail_only_next(&self, n: u64) {
        self.remaining.store(n, SeqCst);
    }
    /// Every operation sleeps this long first (slow storage).
    pub fn set_delay(&self, d: Duration) {
        self.delay_us.store(d.as_micros() as u64, SeqCst);
    }
    /// Clear every fault.
    pub fn heal(&self) {
        for e in [&self.get_errno, &self.put_errno, &self.sync_errno, &self.set_len_errno] {
            e.store(0, SeqCst);
        }
        self.delay_us.store(0, SeqCst);
        self.remaining.store(u64::MAX, SeqCst);
    }

    pub fn counts(&self) -> FaultCounts {
        FaultCounts {
            gets: self.gets.load(SeqCst),
            puts: self.puts.load(SeqCst),
            syncs: self.syncs.load(SeqCst),
            failures: self.failures.load(SeqCst),
        }
    }

    fn check(&self, errno: &AtomicI32) -> io::Result<()> {
        let d = self.delay_us.load(Relaxed);
        if d > 0 {
            std::thread::sleep(Duration::from_micros(d));
        }
        let e = errno.load(SeqCst);
        if e == 0 {
            return Ok(());
        }
        let armed = self.remaining.fetch_update(SeqCst, SeqCst, |r| match r {
            0 => None,
            u64::MAX => Some(u64::MAX),
            r => Some(r - 1),
        });
        if armed.is_err() {
            return Ok(());
        }
        self.failures.fetch_add(1, SeqCst);
        Err(io::Error::from_raw_os_error(e))
    }
}

impl Pager for FaultPager {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        self.gets.fetch_add(1, SeqCst);
        self.check(&self.get_errno)?;
        self.inner.get_pages(offset, buf)
    }
    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.puts.fetch_add(1, SeqCst);
        self.check(&self.put_errno)?;
        self.inner.put_pages(offset, data)
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.check(&self.set_len_errno)?;
        self.inner.set_len(len)
    }
    fn sync(&self) -> io::Result<()> {
        self.syncs.fetch_add(1, SeqCst);
        self.check(&self.sync_errno)?;
        self.inner.sync()
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
}

//! Write-behind accounting: unclean pages, dirty thresholds and throttling (Linux's
//! `balance_dirty_pages` in `mm/page-writeback.c`, simplified). The flusher thread that
//! cleans them walks objects and belongs to the cache (`cache/flusher.rs`).
//!
//! The contract:
//! * *Unclean* pages — dirty, under writeback, or reserved by a writer about to dirty a
//!   clean page — are counted cache-wide. A writer reserves a slot before it dirties a clean
//!   page (`reserve_dirty`), so the count does not exceed `dirty_limit`: at the limit the
//!   writer waits for writeback; it does not fail while writeback makes progress.
//!   Reserved slots whose pages are still held by their writers cannot be cleaned by anyone,
//!   so they are counted apart (`held`): a writer only waits while some *published* unclean
//!   page exists that writeback can clean. If every unclean page is held by a writer, waiting
//!   could never end (a writable window taking more pages than a tiny limit, or as many
//!   concurrent writers as the limit has pages), so the writer proceeds: the limit can then be
//!   passed by at most the pages writers hold at that moment.
//! * Between the set-point (midway between the background threshold and the limit) and the
//!   limit, a writer pauses at the start of each `write_at` for a time proportional to how far
//!   above the set-point the cache is and to the pages it is about to dirty, at the measured
//!   writeback bandwidth: the dirtying rate is matched smoothly to the cleaning rate instead of
//!   hitting a wall.
//! * The flusher thread wakes every `writeback_interval` (default 5 s, Linux's
//!   `dirty_writeback_centisecs`) and writes back every object dirty for longer than
//!   `dirty_expire` (default 30 s, `dirty_expire_centisecs`), oldest first; and, when kicked
//!   because unclean pages passed the background threshold, it writes back objects, oldest
//!   first, until they are below it again. Writeback is clustered (runs of up to `max_put`)
//!   and spread over the I/O pool, so several requests are in flight.
//! * A writer stuck at the limit for long (writeback makes no progress: the store fails or
//!   hangs) writes back its own object's dirty pages itself, then other objects' (the unclean
//!   pages may all belong to another file whose store fails; the cache's `Reclaim::clean_others`),
//!   so a persistent I/O error reaches it instead of blocking it forever. If, even so, nothing
//!   is cleaned anywhere for 2 s and no error comes back, it passes the limit by its one page
//!   (liveness over the limit: a hung store, or an accounting error, must not deadlock
//!   writers).

use super::Resources;
use crate::error::Result;
use crate::page::state::PageState;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::time::{Duration, Instant};

/// Longest single pause of a throttled writer.
const MAX_PAUSE: Duration = Duration::from_millis(200);
/// How long a writer waits at the limit before it writes back its own pages.
const HELP_AFTER: Duration = Duration::from_millis(50);
/// How long a writer waits at the limit while nothing at all is cleaned cache-wide, and its
/// own writeback finds nothing to write and no error, before it passes the limit.
const GIVE_UP_AFTER: Duration = Duration::from_secs(2);

/// What the dirty throttle needs of the writer's own object: a writer stuck at the limit
/// cleans its own pages first.
pub(crate) trait DirtyWriter {
    fn id(&self) -> u64;
    /// The object's pager depth (`order::may_call_pager`).
    fn depth(&self) -> u32;
    fn dirty_pages(&self) -> u64;
    /// Write back every dirty page of the object on this thread. => as for an inline
    /// writeback: the caller holds at most the pages it is writing (never one in writeback).
    fn write_back_inline(&self) -> Result<()>;
}

/// Write-behind thresholds and counts, shared by every object.
pub(crate) struct DirtyAccount {
    /// Thresholds in pages of unclean memory.
    pub(crate) background: u64,
    pub(crate) setpoint: u64,
    pub(crate) limit: u64,
    /// Packed counts: low 32 bits published unclean pages (dirty + under writeback), high
    /// 32 bits reserved slots still held by writers. One word, so reserving is one CAS.
    counts: AtomicU64,
    /// Writeback bandwidth estimate, pages per second (measured by the flusher).
    pub(crate) rate: AtomicU64,
    /// Pages cleaned so far (monotonic).
    pub(crate) cleaned: AtomicU64,
    /// Writers waiting for unclean pages to drop.
    waiters: Mutex<usize>,
    cleaned_cv: Condvar,
    /// The flusher's wake-up.
    ctl: Mutex<Ctl>,
    ctl_cv: Condvar,
    pub(crate) throttled_us: AtomicU64,
    epoch: Instant,
}

#[derive(Default)]
struct Ctl {
    kick: bool,
    shutdown: bool,
}

impl DirtyAccount {
    pub(crate) fn new(background: u64, limit: u64) -> DirtyAccount {
        let limit = limit.max(2);
        let background = background.clamp(1, limit - 1);
        DirtyAccount {
            background,
            setpoint: (background + limit) / 2,
            limit,
            counts: AtomicU64::new(0),
            rate: AtomicU64::new(25_000),
            cleaned: AtomicU64::new(0),
            waiters: Mutex::new(0),
            cleaned_cv: Condvar::new(),
            ctl: Mutex::new(Ctl::default()),
            ctl_cv: Condvar::new(),
            throttled_us: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// Milliseconds since the cache started (for object dirty ages); never 0.
    pub(crate) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    /// Wake the flusher.
    pub(crate) fn kick(&self) {
        let mut c = self.ctl.lock();
        if !c.kick {
            c.kick = true;
            self.ctl_cv.notify_one();
        }
    }

    /// The flusher's sleep: until kicked, shut down or `nap` passed (`None`: do not sleep);
    /// then take the kick. Returns false once shut down. => called only by the flusher
    /// thread, holding no lock.
    pub(crate) fn wait_for_kick(&self, nap: Option<Duration>) -> bool {
        let mut c = self.ctl.lock();
        if let Some(nap) = nap
            && !c.shutdown
            && !c.kick
        {
            self.ctl_cv.wait_for(&mut c, nap);
        }
        if c.shutdown {
            return false;
        }
        c.kick = false;
        true
    }

    /// Tell the flusher to stop (it returns from its next `wait_for_kick`).
    pub(crate) fn shut_down(&self) {
        let mut c = self.ctl.lock();
        c.shutdown = true;
        self.ctl_cv.notify_all();
    }

    /// (published unclean pages, held reservations).
    fn split(c: u64) -> (u64, u64) {
        (c & 0xffff_ffff, c >> 32)
    }

    /// All unclean pages, held reservations included (for statistics and thresholds).
    pub(crate) fn unclean(&self) -> u64 {
        let (u, h) = Self::split(self.counts.load(SeqCst));
        u + h
    }

    /// Published unclean pages: what writeback can clean.
    pub(crate) fn published(&self) -> u64 {
        Self::split(self.counts.load(SeqCst)).0
    }

    /// `n` published unclean pages were taken by writers: count them held until `publish`.
    pub(crate) fn hold(&self, n: u64) {
        self.counts.fetch_add((n << 32).wrapping_sub(n), SeqCst);
    }

    /// `n` reserved slots became dirty pages (their writers published them).
    pub(crate) fn publish(&self, n: u64) {
        self.counts.fetch_add(n.wrapping_sub(n << 32), SeqCst);
    }

    /// `n` pages became dirty without a reservation (stores found through mappings: they
    /// happened already). Kicks the flusher if that passes the background threshold.
    pub(crate) fn add_unclean(&self, n: u64) {
        let old = self.counts.fetch_add(n, SeqCst);
        if Self::split(old).0 + n > self.background {
            self.kick();
        }
    }

    /// A reserved slot was not used.
    pub(crate) fn unreserve(&self) {
        let old = self.counts.fetch_sub(1 << 32, SeqCst);
        debug_assert!(old >> 32 >= 1);
    }

    /// `n` published pages left the unclean set (written back, or dropped by truncation).
    pub(crate) fn cleaned(&self, n: u64) {
        let old = self.counts.fetch_sub(n, SeqCst);
        debug_assert!(old & 0xffff_ffff >= n, "unclean underflow {old:#x} - {n}");
        self.cleaned.fetch_add(n, Relaxed);
        if *self.waiters.lock() > 0 {
            self.cleaned_cv.notify_all();
        }
    }
}

impl Resources {
    /// Reserve an unclean slot for a clean page the caller is about to dirty, waiting while
    /// the cache is at its dirty limit. => the caller holds the page (WRITING or BUSY) and at
    /// most one other page of `obj`, and no policy or registry lock.
    ///
    /// `page`: the held page, if it is valid. A store through a mapping found while we wait
    /// marks it dirty and publishes a slot for it — the very slot we wait for, on a page
    /// nobody can clean while we hold it. So we stop waiting then and return `Ok(false)`
    /// (nothing reserved: the caller moves that published slot to held). `Ok(true)`: a slot
    /// was reserved.
    pub(crate) fn reserve_dirty(&self, obj: &dyn DirtyWriter, page: Option<&PageState>) -> Result<bool> {
        let f = &self.dirty;
        if crate::order::in_pager() {
            // Not throttled (see `PagerScope`), but not unbounded either: a layer's call can
            // dirty a lot of its lower file at once (an aead growth seals every gap block),
            // and if those pages filled the cache, only lower writes could clean them — which
            // need memory (at a 2 MiB budget, zstd writeback inside an aead `set_len` would
            // fail with BudgetExceeded). Past the limit this thread cleans
            // the file it is writing once it holds a cluster's worth: allowed, the file is
            // below the scope (Linux's PF_LOCAL_THROTTLE: a loop device's writer is throttled
            // on its own device's dirty pages, not on everyone's). An error stays with the
            // pages (retained for `sync`); this write goes on.
            let batch = (f.limit / 4).clamp(1, self.geo.max_put_pages);
            if f.unclean() >= f.limit && obj.dirty_pages() >= batch && crate::order::may_call_pager(obj.depth()) {
                let _ = obj.write_back_inline();
            }
            f.counts.fetch_add(1 << 32, SeqCst);
            return Ok(true);
        }
        let mut waited: Option<Instant> = None;
        let cleaned_at_start = f.cleaned.load(SeqCst);
        loop {
            if page.is_some_and(|st| st.snapshot().dirty()) {
                return Ok(false);
            }
            let c = f.counts.load(SeqCst);
            let (published, held) = DirtyAccount::split(c);
            // Below the limit, or nothing that writeback could clean (see module docs).
            if published + held < f.limit || published == 0 {
                if f.counts.compare_exchange_weak(c, c + (1 << 32), SeqCst, SeqCst).is_ok() {
                    if published + held + 1 > f.background {
                        f.kick();
                    }
                    if let Some(t) = waited {
                        f.throttled_us.fetch_add(t.elapsed().as_micros() as u64, Relaxed);
                    }
                    return Ok(true);
                }
                continue;
            }
            // At the limit: wait for the flusher to clean something.
            f.kick();
            let start = *waited.get_or_insert_with(Instant::now);
            if start.elapsed() > HELP_AFTER {
                // No progress for a while: write back our own pages; an I/O error that keeps
                // the cache at its limit is returned to the writer instead of blocking it.
                obj.write_back_inline()?;
                // Our own pages were not what kept the cache at its limit (they may all be
                // held by us, or clean): the published unclean pages belong to other objects
                // whose store is failing or hung. Write those back too, oldest first, so a
                // persistent error reaches this writer instead of blocking it forever. The
                // error names the object it came from.
                if f.unclean() >= f.limit
                    && f.published() > 0
                    && let Some(up) = self.up()
                {
                    up.clean_others(obj.id())?;
                }
                // Backstop for liveness: nothing was cleaned anywhere for a long time and no
                // writeback returned an error — the unclean pages are held by other writers,
                // or a store hangs, or the count is wrong. Pass the limit by one page rather
                // than wait forever (the memory budget still bounds the cache).
                if start.elapsed() > GIVE_UP_AFTER && f.cleaned.load(SeqCst) == cleaned_at_start {
                    f.counts.fetch_add(1 << 32, SeqCst);
                    f.throttled_us.fetch_add(start.elapsed().as_micros() as u64, Relaxed);
                    return Ok(true);
                }
            }
            let mut w = f.waiters.lock();
            *w += 1;
            if f.unclean() >= f.limit && f.published() > 0 {
                f.cleaned_cv.wait_for(&mut w, Duration::from_millis(50));
            }
            *w -= 1;
        }
    }

    /// Give back a slot reserved with `reserve_dirty` that was not used.
    pub(crate) fn unreserve_dirty(&self) {
        self.dirty.unreserve();
    }

    /// Smooth throttling at the start of a write that may dirty `pages` pages: pause in
    /// proportion to how far unclean memory is above the set-point. Never fails.
    /// => the caller holds no page, no size lock and no policy or registry lock (it sleeps).
    pub(crate) fn balance_dirty(&self, pages: u64) {
        let f = &self.dirty;
        if crate::order::in_pager() {
            return;
        }
        let cur = f.unclean();
        if cur <= f.background {
            return;
        }
        f.kick();
        if cur <= f.setpoint || f.limit <= f.setpoint {
            return;
        }
        // pos: 0 at the set-point, 1 at the limit. At pos 1/2 a writer dirties at the
        // writeback rate; nearer the limit, slower.
        let pos = ((cur - f.setpoint) as f64 / (f.limit - f.setpoint) as f64).min(1.0);
        let rate = f.rate.load(Relaxed).max(256) as f64;
        let pause = Duration::from_secs_f64((2.0 * pos * pages as f64 / rate).min(MAX_PAUSE.as_secs_f64()));
        if pause > Duration::from_micros(50) {
            std::thread::sleep(pause);
            f.throttled_us.fetch_add(pause.as_micros() as u64, Relaxed);
        }
    }
}

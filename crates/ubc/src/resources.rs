//! The resources every object draws on, below the objects and the cache that keeps them:
//! page geometry, the memory budget and its reservations, the replacement policy, the window
//! pool, the I/O pools, the mapping service, the write-behind accounting (`dirty.rs`) and the
//! statistics of objects already gone.
//!
//! Budget. `resident` counts pages that are valid or reserved for a fill in progress;
//! a fill reserves before it allocates, so memory never exceeds the budget (the memfds may
//! hold less: a hole page counts resident before anything touches it). When a reservation
//! does not fit, the reserving thread reclaims (direct reclaim), as `uvm_pagealloc` falls back
//! to the page daemon's work when free pages run out.
//!
//! Reclaim walks the objects, which sit above this module: it is reached through the
//! [`Reclaim`] trait the cache implements and installs here once it is built (as the
//! kernel's allocator calls into page reclaim through a hook, not by owning the LRU lists).
//! The page daemon's and the flusher's wake-ups live here too (a flag and a condition
//! variable each); their threads belong to the cache.

use crate::error::{Error, Result};
use crate::evict::EvictionPolicy;
use crate::map::Serve;
use crate::stats::Stats;
use crate::window::Windows;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

mod dirty;
pub(crate) mod loans;
pub(crate) mod locks;
mod policy;
pub(crate) mod pressure;

pub(crate) use dirty::{DirtyAccount, DirtyWriter};
pub(crate) use policy::AdmitStaged;

/// What the resources need from the cache above them: freeing memory and cleaning pages
/// means visiting other objects, which only the cache's registry knows.
pub(crate) trait Reclaim: Send + Sync {
    /// Free up to `want` pages through the replacement policy (dirty victims are written
    /// back and taken on a later round). Returns pages freed; an error only if nothing was
    /// freed because writeback failed. => the caller holds neither the policy lock nor the
    /// registry lock (reclaim takes them in that order).
    fn reclaim(&self, want: u64) -> Result<u64>;

    /// Write back, oldest dirty first, every object other than `except` that has dirty pages
    /// and whose pager this thread may call (`order::may_call_pager`); the first error stops
    /// it. For a writer stuck at the dirty limit. => the caller holds no registry or policy
    /// lock (it may hold pages of `except`).
    fn clean_others(&self, except: u64) -> Result<()>;
}

/// Sizes fixed when the cache is built.
pub(crate) struct Geometry {
    pub(crate) page_size: usize,
    pub(crate) page_shift: u32,
    /// log2 of pages per chunk (= per window).
    pub(crate) chunk_shift: u32,
    pub(crate) budget_pages: u64,
    pub(crate) max_fill_pages: u64,
    pub(crate) max_put_pages: u64,
    /// Read-ahead window sizes in pages (`ra_max_pages` 0: off).
    pub(crate) ra_init_pages: u64,
    pub(crate) ra_max_pages: u64,
    /// Free pages below which the page daemon wakes, and up to which it frees.
    pub(crate) low_free: u64,
    pub(crate) high_free: u64,
    /// Pages only pager scopes may use (see `limit`).
    pub(crate) reserve_pages: u64,
    /// How long a fill waits for pinned pages before it fails.
    pub(crate) reserve_timeout: Duration,
}

/// A background thread's wake-up: a kick flag, a shutdown flag and a condition variable.
#[derive(Default)]
pub(crate) struct Wakeup {
    state: Mutex<WakeState>,
    cv: Condvar,
    /// Set from the first kick until the thread takes it: later kicks skip the mutex.
    kicked: AtomicBool,
}

#[derive(Default)]
struct WakeState {
    kick: bool,
    shutdown: bool,
}

impl Wakeup {
    /// Wake the thread if it sleeps (cheap when already kicked).
    pub(crate) fn kick(&self) {
        if !self.kicked.swap(true, Relaxed) {
            let mut st = self.state.lock();
            st.kick = true;
            self.cv.notify_one();
        }
    }

    /// Sleep until kicked, shut down or `nap` passed (`None`: do not sleep), then take the
    /// kick. Returns false once shut down. => called only by the thread this wakes, holding
    /// no lock.
    pub(crate) fn wait(&self, nap: Option<Duration>) -> bool {
        let mut st = self.state.lock();
        if let Some(nap) = nap
            && !st.kick
            && !st.shutdown
        {
            self.cv.wait_for(&mut st, nap);
        }
        if st.shutdown {
            return false;
        }
        st.kick = false;
        self.kicked.store(false, Relaxed);
        true
    }

    /// Tell the thread to stop (it returns from its next `wait`).
    pub(crate) fn shut_down(&self) {
        let mut st = self.state.lock();
        st.shutdown = true;
        self.cv.notify_all();
    }
}

pub(crate) struct Resources {
    pub(crate) geo: Geometry,
    /// Pages valid or reserved, over all objects.
    pub(crate) resident: AtomicU64,
    /// Pages copied on write by private mappings of cached files (`Sharing::Private`): the
    /// program's memory, made of the cache's pages, charged against the budget (see
    /// `charged`). Counted by the page daemon each round and by `Cache::stats`.
    pub(crate) private_pages: AtomicU64,
    /// Pages of the budget given back under memory pressure (`resources/pressure.rs`), and
    /// the memory cgroup watched for it (none: no limit, or watching is off).
    pub(crate) withheld_pages: AtomicU64,
    /// Windows lent out, and the pages copied for them (`resources/loans.rs`).
    pub(crate) loans: loans::Loans,
    /// Ranges pagers write-locked (`resources/locks.rs`, Mach's `pager_data_lock`).
    pub(crate) locks: locks::Locks,
    pub(crate) cgroup: Option<pressure::MemCgroup>,
    /// When pressure was last looked at (µs since `born`), for the fills' own looks.
    pressure_seen_us: AtomicU64,
    /// When the withheld pages last rose (µs since `born`).
    pressure_rose_us: AtomicU64,
    born: std::time::Instant,
    /// Wakes the page daemon (the cache's thread) when free space drops below `low_free`.
    pub(crate) daemon: Wakeup,
    /// Write-behind accounting: unclean pages, thresholds, throttling.
    pub(crate) dirty: DirtyAccount,
    /// Background I/O threads (read-ahead, writeback).
    pub(crate) io: crate::io::IoPool,
    /// Memory mappings: fault handling and the mapping table (made on first `map`).
    pub(crate) maps: OnceLock<Arc<crate::map::MapService>>,
    serve: Serve,
    fault_threads: usize,
    /// The replacement policy, and the pages fills left for it (see `resources/policy.rs`).
    pub(crate) policy: policy::PolicyLock,
    pub(crate) policy_name: String,
    pub(crate) windows: Windows,
    /// The memfds objects' pages share (see `memfd.rs`).
    pub(crate) arena: crate::memfd::Arena,
    /// Whether a store that offers its own memory (`Pager::memory`) is served from it in
    /// place (XIP): the cache's setting, and off for hugetlb pages (the store's are shmem).
    pub(crate) xip: bool,
    /// `CacheStats::page_memory`: which memory the pages live in, and why.
    pub(crate) page_memory: String,
    /// Counters of objects already dropped.
    retired: Mutex<Stats>,
    /// Pages that eviction must keep for `Cache::sync_all`'s unstable writes until their
    /// commit (`object/writeback.rs`, "Unstable writes"), at most `uncommitted_max()`.
    uncommitted: AtomicU64,
    /// The cache above, for reclaim (set once it is built).
    up: OnceLock<Weak<dyn Reclaim>>,
    /// Last, so dropped last: every object is gone by then (each holds `Resources`), and so
    /// is every other part of the cache.
    _heap: ReturnHeap,
}

/// Gives the heap the cache freed back to the system when dropped. glibc returns freed
/// memory to the kernel only from the top of the main heap (`M_TRIM_THRESHOLD`); the page
/// states, page-table groups and objects of a cache are many small blocks allocated by many
/// threads, each from its own arena, so after a cache was dropped most of its metadata stayed
/// resident (issue 19: 70 MiB after a 1 GiB working set; 7.4 MiB after 64 MiB read by four
/// threads and 3,000 small files, `tests/memory.rs`). `malloc_trim` walks every arena and
/// releases their free pages: one walk of every arena per cache dropped.
struct ReturnHeap;

impl Drop for ReturnHeap {
    fn drop(&mut self) {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim has no preconditions; it only releases free memory.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// The settings `Resources::new` needs besides the geometry.
pub(crate) struct Parts {
    pub(crate) dirty: DirtyAccount,
    pub(crate) io: crate::io::IoPool,
    pub(crate) serve: Serve,
    pub(crate) fault_threads: usize,
    pub(crate) policy: Box<dyn EvictionPolicy>,
    pub(crate) policy_name: String,
    pub(crate) windows: Windows,
    pub(crate) watch_pressure: bool,
    /// `CacheBuilder::xip`.
    pub(crate) xip: bool,
    /// The memory pages live in (huge pages or not), and why.
    pub(crate) page_memory: crate::huge::Choice,
}

/// Pages reclaimed per policy-lock hold.
pub(crate) const RECLAIM_BATCH: u64 = 64;

impl Resources {
    /// Most pages unstable writes may keep from eviction at once: an eighth of the budget.
    /// Kept pages cannot be evicted, and a thread that needs memory while they are kept
    /// may be one the commit waits for (a layer's sync writing its lower file inside the
    /// same `sync_all`): bounded, the rest of the budget can always be reclaimed, and a
    /// file that would pass the bound is written with direct writes instead.
    fn uncommitted_max(&self) -> u64 {
        self.geo.budget_pages / 8
    }

    /// Take `n` pages of the bound on pages kept for unstable writes; `false` if that
    /// would pass it. => `give_uncommitted(n)` follows a `true`.
    pub(crate) fn take_uncommitted(&self, n: u64) -> bool {
        let max = self.uncommitted_max();
        self.uncommitted.fetch_update(SeqCst, SeqCst, |u| (u + n <= max).then_some(u + n)).is_ok()
    }

    /// Give back `n` pages taken by `take_uncommitted` (their commit is over).
    pub(crate) fn give_uncommitted(&self, n: u64) {
        self.uncommitted.fetch_sub(n, SeqCst);
    }

    pub(crate) fn new(geo: Geometry, p: Parts) -> Resources {
        Resources {
            geo,
            resident: AtomicU64::new(0),
            private_pages: AtomicU64::new(0),
            withheld_pages: AtomicU64::new(0),
            loans: loans::Loans::default(),
            locks: locks::Locks::default(),
            pressure_seen_us: AtomicU64::new(0),
            pressure_rose_us: AtomicU64::new(0),
            born: std::time::Instant::now(),
            cgroup: if p.watch_pressure { pressure::MemCgroup::of_self() } else { None },
            daemon: Wakeup::default(),
            dirty: p.dirty,
            io: p.io,
            maps: OnceLock::new(),
            serve: p.serve,
            fault_threads: p.fault_threads,
            policy: policy::PolicyLock::new(p.policy),
            policy_name: p.policy_name,
            windows: p.windows,
            arena: crate::memfd::Arena::new(p.page_memory.memory),
            xip: p.xip && p.page_memory.memory == crate::huge::PageMemory::Shmem,
            page_memory: p.page_memory.report,
            retired: Mutex::new(Stats::default()),
            uncommitted: AtomicU64::new(0),
            up: OnceLock::new(),
            _heap: ReturnHeap,
        }
    }

    /// Connect the cache above. => called once, by `CacheBuilder::build`, before any object
    /// exists (until then reclaim finds nothing to free).
    pub(crate) fn install(&self, up: Weak<dyn Reclaim>) {
        let _ = self.up.set(up);
    }

    /// The cache above, unless it is gone (then nothing can be reclaimed).
    fn up(&self) -> Option<Arc<dyn Reclaim>> {
        self.up.get().and_then(Weak::upgrade)
    }

    /// Reclaim through the cache above; 0 if it is gone. => as [`Reclaim::reclaim`].
    pub(crate) fn reclaim(&self, want: u64) -> Result<u64> {
        match self.up() {
            Some(up) => up.reclaim(want),
            None => Ok(0),
        }
    }

    /// The mapping service, started on first use.
    pub(crate) fn map_service(&self) -> &Arc<crate::map::MapService> {
        self.maps.get_or_init(|| crate::map::MapService::start(self.serve, self.fault_threads))
    }

    pub(crate) fn retire_stats(&self, s: Stats) {
        self.retired.lock().add(&s);
    }

    /// Counters of every object already dropped.
    pub(crate) fn retired(&self) -> Stats {
        *self.retired.lock()
    }

    /// Reserve budget for `n` pages about to be filled, reclaiming if needed.
    /// Fails only if nothing can be freed for `reserve_timeout`: with the writeback error
    /// that kept dirty pages from leaving if there was one, else `BudgetExceeded` (every
    /// page pinned).
    /// => the caller holds no policy or registry lock (reclaim takes them).
    pub(crate) fn reserve(&self, n: u64) -> Result<()> {
        let g = &self.geo;
        // Under a memory limit, the thread asking for memory looks at the pressure itself
        // every 10 ms (see `resources/pressure.rs`).
        if self.cgroup.is_some()
            && self.born.elapsed().as_micros() as u64 > self.pressure_seen_us.load(Relaxed) + 10_000
        {
            self.watch_pressure();
        }
        let limit = self.limit();
        if n > limit {
            return Err(self.budget_exceeded(n));
        }
        let mut deadline: Option<Instant> = None;
        let mut spins = 0u32;
        // The last writeback error that kept reclaim from freeing anything. It is not
        // returned at once: it may be another file's, and transient (the flusher or a sync
        // may succeed a moment later); a fill that failed on it would fail a read of a file
        // that has no error of its own, or raise SIGBUS in a mapping. It is what the caller
        // learns if nothing can be freed until the deadline.
        let mut writeback_err = None;
        loop {
            let cur = self.resident.load(SeqCst);
            if cur + n <= limit {
                if self.resident.compare_exchange_weak(cur, cur + n, SeqCst, SeqCst).is_ok() {
                    if self.free_after(cur + n) < g.low_free {
                        self.daemon.kick();
                    }
                    return Ok(());
                }
                continue;
            }
            self.daemon.kick();
            // A batch, but no more than the daemon's target: freeing more would leave budget
            // unused (Linux's direct reclaim takes SWAP_CLUSTER_MAX pages).
            let want = (cur + n - limit).max(RECLAIM_BATCH.min(g.high_free).max(1));
            match self.reclaim(want) {
                Ok(freed) if freed > 0 => {
                    deadline = None;
                    continue;
                }
                Ok(_) => {}
                Err(e) => writeback_err = Some(e),
            }
            // Nothing evictable right now (pinned, busy, in writeback, or dirty and failing
            // to be written): wait for holders and retry.
            let d = *deadline.get_or_insert_with(|| Instant::now() + g.reserve_timeout);
            if Instant::now() > d {
                return Err(writeback_err.unwrap_or_else(|| self.budget_exceeded(n)));
            }
            spins += 1;
            if spins < 16 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// Reserve budget for `n` pages without waiting: one round of reclaim at most. For
    /// optional work (read-ahead), which should give up rather than wait for pinned pages.
    /// => as `reserve`.
    pub(crate) fn try_reserve(&self, n: u64) -> Result<()> {
        let limit = self.limit();
        for attempt in 0..2 {
            let cur = self.resident.load(SeqCst);
            if cur + n <= limit {
                if self.resident.compare_exchange(cur, cur + n, SeqCst, SeqCst).is_ok() {
                    if self.free_after(cur + n) < self.geo.low_free {
                        self.daemon.kick();
                    }
                    return Ok(());
                }
                continue;
            }
            if attempt == 0 && cur + n > limit {
                self.reclaim(cur + n - limit)?;
            }
        }
        Err(self.budget_exceeded(n))
    }

    /// Pages this thread may have resident: the budget inside a pager scope, the budget less
    /// the reserve elsewhere. The reserve is for writeback (Linux's `PF_MEMALLOC` reserves
    /// below the min watermark): a layer's pager cleaning upper pages writes lower ones, and
    /// with the cache full of dirty upper pages it would otherwise compete for each freed
    /// page with every thread that is dirtying more.
    ///
    /// The reserve is held back only while something is unclean: with nothing dirty there is
    /// nothing for a pager to write back, and a reserve kept free anyway left 6 % of the
    /// budget unused by read-only work (issue 19: 232 of 256 MiB resident). When pages get
    /// dirty, the next reservation outside a pager scope (or the page daemon) reclaims the
    /// reserve back.
    fn limit(&self) -> u64 {
        let g = &self.geo;
        if crate::order::in_pager() { g.budget_pages } else { self.charged_limit(g.budget_pages - self.reserve_now()) }
    }

    /// `avail` pages less what private copies and memory pressure take (`charged`), but
    /// never below the `floor`.
    fn charged_limit(&self, avail: u64) -> u64 {
        avail.saturating_sub(self.charged()).max(self.floor().min(avail))
    }

    /// The pages a cache keeps whatever private copies and memory pressure take: a
    /// sixteenth of the budget, and at least two of the largest fills (a reservation larger
    /// than the limit fails at once, so a floor below one fill would turn pressure into read
    /// errors).
    fn floor(&self) -> u64 {
        let g = &self.geo;
        (g.budget_pages / 16).max(2 * g.max_fill_pages).min(g.budget_pages)
    }

    /// Count the private mappings' copied pages again (`private_pages`).
    pub(crate) fn count_private_copies(&self) {
        if let Some(svc) = self.maps.get() {
            // In cache pages: the scan counts system pages, a cache page may be larger.
            self.private_pages.store(svc.private_copies().div_ceil(self.geo.page_size as u64), Relaxed);
        }
    }

    /// The private mappings' copied pages the cache makes room for: all of them up to three
    /// quarters of the budget. Past that they stay outside it: a cache left with no room
    /// could fill nothing, and the copies are the program's, not the cache's to evict.
    ///
    /// Lent windows' copies (pages a write copied for their borrowers) count the same way.
    ///
    /// Plus the pages withheld under memory pressure. (`charged_limit` keeps a floor under
    /// what is left.)
    pub(crate) fn charged(&self) -> u64 {
        let b = self.geo.budget_pages;
        (self.private_pages.load(Relaxed) + self.loans.copied_now()).min(b / 4 * 3) + self.withheld_pages.load(Relaxed)
    }

    /// The page daemon's look at memory pressure: withhold more of the budget, or hand some
    /// back (`pressure::next_withheld`). Returns whether a limit applies (the daemon then
    /// looks again sooner).
    pub(crate) fn watch_pressure(&self) -> bool {
        let Some(cg) = &self.cgroup else { return false };
        self.pressure_seen_us.store(self.born.elapsed().as_micros() as u64, Relaxed);
        let Some(st) = cg.state() else { return false };
        let g = &self.geo;
        let page = 1u64 << g.page_shift;
        let now = self.withheld_pages.load(Relaxed);
        let at = self.born.elapsed().as_micros() as u64;
        // Handed back only after a second without a rise: pressure that comes and goes
        // would otherwise have the cache fill pages only to evict them again.
        let calm = at > self.pressure_rose_us.load(Relaxed) + 1_000_000;
        let ours = self.resident.load(SeqCst) << g.page_shift;
        let max = g.budget_pages - self.floor();
        let next =
            pressure::next_withheld(st, ours, g.budget_pages, now, page, pressure::headroom(st.limit), max, calm);
        if next > now {
            self.pressure_rose_us.store(at, Relaxed);
        }
        if next != now {
            self.withheld_pages.store(next, Relaxed);
        }
        true
    }

    /// The pages the reserve holds back now (see `limit`).
    fn reserve_now(&self) -> u64 {
        if self.dirty.unclean() == 0 { 0 } else { self.geo.reserve_pages }
    }

    /// Pages free for ordinary use (the reserve excluded) when `resident` are resident: what
    /// the page daemon keeps between its watermarks.
    pub(crate) fn free_after(&self, resident: u64) -> u64 {
        self.charged_limit(self.geo.budget_pages - self.reserve_now()).saturating_sub(resident)
    }

    fn budget_exceeded(&self, n: u64) -> Error {
        let g = &self.geo;
        Error::BudgetExceeded { needed: n << g.page_shift, budget: g.budget_pages << g.page_shift }
    }

    /// Give back `n` pages reserved with `reserve` or `try_reserve` (or counted resident by
    /// a fill that published them and is now evicted or dropped).
    pub(crate) fn unreserve(&self, n: u64) {
        let old = self.resident.fetch_sub(n, SeqCst);
        debug_assert!(old >= n);
    }
}

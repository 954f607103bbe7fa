//! The page daemon and reclaim (NetBSD `uvm_pdaemon.c`, Linux `kswapd` and direct reclaim):
//! budget reservations for fills, reclaim through the replacement policy (dirty victims are
//! written back, clustered, and taken on the next round), and the background thread that
//! keeps free space between the low and high watermarks.

use super::*;
use crate::evict::{EvictAttempt, PageKey, PageProbe};
use crate::object::Pass;

#[derive(Default)]
pub(super) struct DaemonCtl {
    state: Mutex<DaemonState>,
    cv: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
    kicked: AtomicBool,
}

#[derive(Default)]
struct DaemonState {
    kick: bool,
    shutdown: bool,
}

/// Pages reclaimed per policy-lock hold.
const RECLAIM_BATCH: u64 = 64;
/// Dirty victims collected for writeback per reclaim round.
const MAX_DIRTY_VICTIMS: usize = 1024;

impl CacheCore {
    /// Reserve budget for `n` pages about to be filled, reclaiming if needed.
    /// Fails with `BudgetExceeded` only if nothing can be freed for `reserve_timeout`
    /// (every page pinned), or with the writeback error that kept dirty pages from leaving.
    pub(crate) fn reserve(&self, n: u64) -> Result<()> {
        let limit = self.limit();
        if n > limit {
            return Err(self.budget_exceeded(n));
        }
        let mut deadline: Option<Instant> = None;
        let mut spins = 0u32;
        loop {
            let cur = self.resident.load(SeqCst);
            if cur + n <= limit {
                if self.resident.compare_exchange_weak(cur, cur + n, SeqCst, SeqCst).is_ok() {
                    if self.free_after(cur + n) < self.low_free {
                        self.kick_daemon();
                    }
                    return Ok(());
                }
                continue;
            }
            self.kick_daemon();
            let want = (cur + n - limit).max(RECLAIM_BATCH.min(self.budget_pages / 8).max(1));
            match self.reclaim(want) {
                Ok(freed) if freed > 0 => {
                    deadline = None;
                    continue;
                }
                Ok(_) => {}
                Err(e) => return Err(e),
            }
            // Nothing evictable right now (pinned, busy or in writeback): wait for holders.
            let d = *deadline.get_or_insert_with(|| Instant::now() + self.reserve_timeout);
            if Instant::now() > d {
                return Err(self.budget_exceeded(n));
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
    pub(crate) fn try_reserve(&self, n: u64) -> Result<()> {
        let limit = self.limit();
        for attempt in 0..2 {
            let cur = self.resident.load(SeqCst);
            if cur + n <= limit {
                if self.resident.compare_exchange(cur, cur + n, SeqCst, SeqCst).is_ok() {
                    if self.free_after(cur + n) < self.low_free {
                        self.kick_daemon();
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
    fn limit(&self) -> u64 {
        if crate::order::in_pager() { self.budget_pages } else { self.budget_pages - self.reserve_pages }
    }

    /// Pages free for ordinary use (the reserve excluded) when `resident` are resident: what
    /// the page daemon keeps between its watermarks.
    fn free_after(&self, resident: u64) -> u64 {
        (self.budget_pages - self.reserve_pages).saturating_sub(resident)
    }

    fn budget_exceeded(&self, n: u64) -> Error {
        Error::BudgetExceeded { needed: n << self.page_shift, budget: self.budget_pages << self.page_shift }
    }

    pub(crate) fn unreserve(&self, n: u64) {
        let old = self.resident.fetch_sub(n, SeqCst);
        debug_assert!(old >= n);
    }

    fn kick_daemon(&self) {
        if !self.daemon.kicked.swap(true, Relaxed) {
            let mut st = self.daemon.state.lock();
            st.kick = true;
            self.daemon.cv.notify_one();
        }
    }

    /// Free up to `want` pages: the policy picks victims, dirty ones are written back and
    /// picked again. Returns pages freed; an error only if nothing was freed because
    /// writeback failed.
    pub(crate) fn reclaim(&self, want: u64) -> Result<u64> {
        let mut freed = 0;
        let mut last_err = None;
        for _round in 0..4 {
            let mut probe = Prober { core: self, objects: HashMap::new(), dirty: Vec::new() };
            let mut victims = Vec::new();
            {
                let mut pol = self.policy.lock();
                while (victims.len() as u64) < want - freed {
                    match pol.select_victim(&mut probe) {
                        Some(k) => victims.push(k),
                        None => break,
                    }
                }
            }
            freed += victims.len() as u64;
            probe.release(victims);
            if freed >= want || probe.dirty.is_empty() {
                break;
            }
            if let Err(e) = probe.clean() {
                last_err = Some(e);
            }
        }
        match last_err {
            Some(e) if freed == 0 => Err(e),
            _ => Ok(freed),
        }
    }

    /// Start the page daemon thread.
    pub(super) fn start_daemon(core: &Arc<CacheCore>) -> Result<()> {
        let c = core.clone();
        let t = std::thread::Builder::new()
            .name("ubc-pagedaemon".into())
            .spawn(move || c.daemon_loop())
            .map_err(|e| Error::os("spawn page daemon", e))?;
        *core.daemon.thread.lock() = Some(t);
        Ok(())
    }

    /// Stop the page daemon thread and wait for it (shutdown).
    pub(super) fn stop_daemon(&self) {
        {
            let mut st = self.daemon.state.lock();
            st.shutdown = true;
            self.daemon.cv.notify_all();
        }
        if let Some(t) = self.daemon.thread.lock().take() {
            let _ = t.join();
        }
    }

    fn daemon_loop(self: Arc<Self>) {
        loop {
            {
                let mut st = self.daemon.state.lock();
                if !st.kick && !st.shutdown {
                    self.daemon.cv.wait_for(&mut st, Duration::from_millis(250));
                }
                if st.shutdown {
                    return;
                }
                st.kick = false;
                self.daemon.kicked.store(false, Relaxed);
            }
            let free = self.free_after(self.resident.load(SeqCst));
            if free < self.low_free {
                self.daemon_runs.fetch_add(1, Relaxed);
                if let Ok(n) = self.reclaim(self.high_free - free) {
                    self.daemon_evictions.fetch_add(n, Relaxed);
                }
            }
        }
    }
}

/// The cache's side of the policy's [`PageProbe`]: page states looked up by key.
struct Prober<'a> {
    core: &'a CacheCore,
    objects: HashMap<u64, Option<Arc<Object>>>,
    /// Dirty pages the policy wanted to evict: written back before the next round.
    dirty: Vec<PageKey>,
}

impl Prober<'_> {
    fn object(&mut self, id: u64) -> Option<Arc<Object>> {
        let core = self.core;
        self.objects.entry(id).or_insert_with(|| core.object(id)).clone()
    }

    /// Free taken victims, grouped by object.
    fn release(&mut self, mut victims: Vec<PageKey>) {
        victims.sort_unstable();
        for group in victims.chunk_by(|a, b| a.object == b.object) {
            let Some(obj) = self.object(group[0].object) else { continue };
            let pages: Vec<u64> = group.iter().map(|k| k.index).collect();
            obj.release_evicted(&pages);
            if obj.resident_pages() == 0 {
                self.core.object_idle(&obj, Idle::Emptied);
            }
        }
    }

    /// Write back the dirty pages the policy wanted, clustered.
    fn clean(&mut self) -> Result<()> {
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        let mut first = Ok(());
        let max = self.core.max_put_pages;
        for group in dirty.chunk_by(|a, b| a.object == b.object) {
            let Some(obj) = self.object(group[0].object) else { continue };
            // Inside a pager call, only files below it (see `PagerScope`).
            if !crate::order::may_call_pager(obj.depth()) {
                continue;
            }
            let mut done_to = 0;
            for k in group {
                if k.index < done_to {
                    continue;
                }
                if let Err(e) = obj.writeback(k.index, k.index + max, Pass::Inline)
                    && first.is_ok()
                {
                    first = Err(e);
                }
                done_to = k.index + max;
            }
        }
        first
    }
}

impl PageProbe for Prober<'_> {
    fn take_accesses(&mut self, key: PageKey) -> Option<u8> {
        let obj = self.object(key.object)?;
        let st = obj.page_state(key.index)?;
        if !st.snapshot().cached() {
            return None;
        }
        Some(st.take_accesses())
    }

    fn try_evict(&mut self, key: PageKey) -> EvictAttempt {
        let Some(obj) = self.object(key.object) else { return EvictAttempt::Gone };
        let Some(st) = obj.page_state(key.index) else { return EvictAttempt::Gone };
        if st.try_lock_for_evict() {
            return EvictAttempt::Taken;
        }
        let s = st.snapshot();
        if !s.cached() {
            return EvictAttempt::Gone;
        }
        if s.writeback_due() && self.dirty.len() < MAX_DIRTY_VICTIMS {
            self.dirty.push(key);
        }
        EvictAttempt::Unavailable
    }
}

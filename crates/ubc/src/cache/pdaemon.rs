//! The page daemon and reclaim (NetBSD `uvm_pdaemon.c`, Linux `kswapd` and direct reclaim):
//! reclaim through the replacement policy (dirty victims are written back, clustered, and
//! taken on the next round), reached by fills through `Resources::reserve` (the `Reclaim`
//! trait), and the background thread that keeps free space between the low and high
//! watermarks. The reservations themselves are counted in `resources.rs`.

use super::*;
use crate::evict::{EvictAttempt, PageKey, PageProbe};
use crate::object::Pass;

/// Victims selected per hold of the policy lock.
const LOCK_BATCH: u64 = 32;

/// Dirty victims collected for writeback per reclaim round.
const MAX_DIRTY_VICTIMS: usize = 1024;

impl CacheCore {
    /// Free up to `want` pages: the policy picks victims, dirty ones are written back and
    /// picked again. Returns pages freed; an error only if nothing was freed because
    /// writeback failed. => the caller holds neither the policy nor the registry lock: this
    /// takes the policy lock, and under it the registry's (the order `order.rs` checks).
    pub(crate) fn reclaim(&self, want: u64) -> Result<u64> {
        let mut freed = 0;
        let mut last_err = None;
        for _round in 0..4 {
            let mut probe = Prober { core: self, objects: HashMap::new(), dirty: Vec::new() };
            let mut victims = Vec::new();
            // The policy lock is taken per batch of `LOCK_BATCH` victims, not for the whole
            // round: a fill publishing its pages (`publish_filled` inserts under this lock)
            // waits for one batch at most, never for the page daemon's whole refill.
            let mut dry = false;
            while !dry && (victims.len() as u64) < want - freed {
                let goal = victims.len() + (want - freed - victims.len() as u64).min(LOCK_BATCH) as usize;
                let mut pol = self.res.policy.lock();
                while victims.len() < goal {
                    match pol.select_victim(&mut probe) {
                        Some(k) => victims.push(k),
                        None => {
                            dry = true;
                            break;
                        }
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
        *core.daemon_thread.lock() = Some(t);
        Ok(())
    }

    /// Stop the page daemon thread and wait for it (shutdown).
    pub(super) fn stop_daemon(&self) {
        self.res.daemon.shut_down();
        if let Some(t) = self.daemon_thread.lock().take() {
            let _ = t.join();
        }
    }

    fn daemon_loop(self: Arc<Self>) {
        lower_priority();
        let res = &*self.res;
        res.policy.set_daemon(true);
        let mut nap = Duration::from_millis(250);
        while res.daemon.wait(Some(nap)) {
            // Pages fills staged while the policy lock was taken are admitted by the next
            // holder; on a quiet cache that may be nobody, so each round takes the lock once.
            if res.policy.has_staged() {
                drop(res.policy.lock());
            }
            res.count_private_copies();
            // Under a memory limit, look every 50 ms: memory withheld late is an OOM kill.
            nap = Duration::from_millis(if res.watch_pressure() { 50 } else { 250 });
            let resident = res.resident.load(SeqCst);
            let free = res.free_after(resident);
            if free < res.geo.low_free {
                // Past the budget (part of it withheld, or taken by private copies): all of
                // the excess at once, then the usual refill to the high watermark.
                let over = resident.saturating_sub(res.free_after(0));
                self.daemon_runs.fetch_add(1, Relaxed);
                if let Ok(n) = self.reclaim(res.geo.high_free - free + over) {
                    self.daemon_evictions.fetch_add(n, Relaxed);
                }
            }
        }
        // Nobody admits staged pages from now on but threads holding nothing: fills wait
        // for the lock again, and what is staged now is admitted here.
        res.policy.set_daemon(false);
        drop(res.policy.lock());
    }
}

/// How much less CPU the page daemon asks for than the threads it serves (a nice value; Linux
/// applies it to this thread alone).
///
/// Its rounds are bursts of system calls (a punch of a memfd page costs ~3.5 µs on the 2-core
/// VM, 12 µs when the page was mapped and another thread of the process runs: the TLB
/// shootdown). At the same priority, a reader whose device read completed during a round was
/// often left waiting for the CPU until the round ended: with 4 KiB random reads of a file 4x
/// the budget on 2 cores, 0.5–1.8 % of the misses took ~400 µs inside their `pread`, against
/// 0.2–0.6 % with the daemon at +10 (and 2 % with no daemon at all, every 64th miss reclaiming
/// a batch itself). A
/// daemon starved by a busy machine costs nothing in correctness: a fill that finds no free
/// page reclaims for itself (`Resources::reserve`). RocksDB lowers its background threads'
/// priority for the same reason.
const DAEMON_NICE: i32 = 10;

fn lower_priority() {
    // SAFETY: plain system calls on this thread's own scheduling priority. A failure (a
    // seccomp filter, say) leaves the daemon at the default priority: nothing to undo.
    unsafe {
        let _ = libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, DAEMON_NICE);
    }
}

/// The cache's side of the policy's [`PageProbe`]: page states looked up by key.
struct Prober<'a> {
    core: &'a CacheCore,
    /// Objects of the round, held (`holders.rs`): the `Arc`s handed out are dropped before
    /// the round ends, and with it these holds.
    objects: HashMap<u64, Option<WorkHold>>,
    /// Dirty pages the policy wanted to evict: written back before the next round.
    dirty: Vec<PageKey>,
}

impl Prober<'_> {
    fn object(&mut self, id: u64) -> Option<Arc<Object>> {
        let core = self.core;
        self.objects.entry(id).or_insert_with(|| core.hold(id)).as_ref().map(|h| Arc::clone(h))
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
        let max = self.core.res.geo.max_put_pages;
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

#[cfg(test)]
mod tests {
    use crate::resources::AdmitStaged;
    use crate::{Access, Cache, evict::Admission, pager::MemPager};
    use std::sync::Arc;

    /// A staged run is checked again when it is admitted (`resources/policy.rs`): between
    /// stage and admission the page may have been admitted by a new fill (a truncation dropped
    /// it and a writer, who does not admit, made it again), dropped for good, or be taken for
    /// a drop right now. Only a page valid, not BUSY and not in the policy is inserted: the
    /// policy then holds each resident page once (the stress test in `budget.rs` rarely meets
    /// these windows; this one makes each).
    #[test]
    fn a_staged_page_is_admitted_only_if_it_is_still_the_one_staged() {
        let cache = Cache::builder().budget(4 << 20).daemon(false).build().unwrap();
        let f = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
        f.write_at(&[7u8; 8192], 0).unwrap();
        let obj = f.obj.clone();
        let pages = || obj.res.policy.lock().len();
        assert_eq!(pages(), 2, "both pages admitted by their fills");
        // Already in the policy (a stale run of page 0): not inserted again.
        obj.admit_staged(obj.res.policy.lock().as_mut(), 0, 2, Admission::Demand);
        assert_eq!(pages(), 2, "a page in the policy was admitted twice");
        // Dropped since: nothing to admit.
        f.set_len(4096).unwrap();
        assert_eq!(pages(), 1);
        obj.admit_staged(obj.res.policy.lock().as_mut(), 1, 1, Admission::Demand);
        assert_eq!(pages(), 1, "a dropped page was admitted");
        // Valid and not in the policy (what a fill that staged leaves): admitted, once.
        let chunk = obj.chunk_of(0).unwrap();
        {
            let mut pol = obj.res.policy.lock();
            obj.policy_forget(pol.as_mut(), chunk, 0);
        }
        assert_eq!(pages(), 0);
        obj.admit_staged(obj.res.policy.lock().as_mut(), 0, 1, Admission::Demand);
        obj.admit_staged(obj.res.policy.lock().as_mut(), 0, 1, Admission::Demand);
        assert_eq!(pages(), 1, "a staged page is admitted exactly once");
        // Taken for a drop (BUSY): left to the dropper.
        {
            let mut pol = obj.res.policy.lock();
            obj.policy_forget(pol.as_mut(), chunk, 0);
        }
        let st = obj.page_state(0).unwrap();
        let _prior = st.lock_for_drop();
        obj.admit_staged(obj.res.policy.lock().as_mut(), 0, 1, Admission::Demand);
        assert_eq!(pages(), 0, "a page being dropped was admitted");
        st.cancel_evict();
        obj.admit_staged(obj.res.policy.lock().as_mut(), 0, 1, Admission::Demand);
        assert_eq!(pages(), 1);
    }
}

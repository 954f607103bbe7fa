//! The flusher thread: write-behind (Linux's `fs/fs-writeback.c`, simplified). It wakes every
//! `writeback_interval` and writes back every object dirty for longer than `dirty_expire`,
//! oldest first; when kicked because unclean pages passed the background threshold, it writes
//! back objects, oldest first, until they are below it again. It walks the registry, so it
//! belongs to the cache; the counts, thresholds and throttling it serves are the
//! resources' (`resources/dirty.rs`, which states the contract).

use super::CacheCore;
use crate::error::Result;
use crate::object::{Harvest, Object, ObjectRef, Pass, WorkHold};
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::time::{Duration, Instant};

/// The flusher thread and its timing.
pub(super) struct Flusher {
    interval: Duration,
    expire: Duration,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    pub(super) runs: AtomicU64,
}

impl Flusher {
    pub(super) fn new(interval: Duration, expire: Duration) -> Flusher {
        Flusher { interval, expire, thread: Mutex::new(None), runs: AtomicU64::new(0) }
    }

    pub(super) fn start(&self, core: Arc<CacheCore>) {
        let t = std::thread::Builder::new()
            .name("ubc-flusher".into())
            .spawn(move || core.flusher_loop())
            .expect("spawn ubc flusher");
        *self.thread.lock() = Some(t);
    }

    /// Stop the thread (woken through `dirty`) and wait for it.
    pub(super) fn stop(&self, dirty: &crate::resources::DirtyAccount) {
        dirty.shut_down();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl CacheCore {
    /// For a writer stuck at the dirty limit (`Resources::reserve_dirty`, through
    /// `Reclaim::clean_others`): write back, oldest dirty first, every object but `except`
    /// whose pager this thread may call. => the caller holds no registry or policy lock; it
    /// may hold a page of `except` (hence the depth filter: only pagers that cannot wait
    /// for it).
    pub(super) fn write_back_others(&self, except: u64) -> Result<()> {
        // Only files whose pagers cannot wait for the page we hold (`order.rs`): the same
        // depth or below.
        for o in self.oldest_dirty_first(|o| o.id != except && crate::order::may_call_pager(o.depth())) {
            o.writeback(0, u64::MAX, Pass::Inline)?;
        }
        Ok(())
    }

    /// The dirty objects `keep` accepts, oldest dirty first (`Object::dirtied_at`, read as
    /// they are listed), each held only when the caller comes to it (`holders.rs`): a
    /// round keeps one object alive, not all.
    fn oldest_dirty_first(&self, keep: impl Fn(&Object) -> bool) -> impl Iterator<Item = WorkHold> {
        let mut refs: Vec<(u64, ObjectRef)> = self
            .registry
            .read()
            .by_id
            .values()
            .filter(|o| o.dirty_pages() > 0 && keep(o))
            .map(|o| (o.dirtied_at(), ObjectRef::of(o)))
            .collect();
        refs.sort_by_key(|d| d.0);
        refs.into_iter().filter_map(|(_, r)| r.hold())
    }

    /// The flusher thread: age-based and threshold-based write-behind.
    fn flusher_loop(self: Arc<Self>) {
        let f = &self.res.dirty;
        let (interval, expire) = (self.flusher.interval, self.flusher.expire);
        let mut last = (Instant::now(), f.cleaned.load(Relaxed));
        // Whether the previous round cleaned anything. Over the background threshold we go
        // round again at once only while rounds make progress; otherwise (the store fails,
        // or every unclean page is held by a writer) we back off instead of spinning.
        let mut progressed = false;
        loop {
            let over = f.published() > f.background;
            let nap = (!over || !progressed).then(|| {
                let nap = if over { Duration::from_millis(20) } else { interval.min(expire) };
                nap.max(Duration::from_millis(1))
            });
            if !f.wait_for_kick(nap) {
                return;
            }
            let cleaned_before = f.cleaned.load(Relaxed);
            self.flusher.runs.fetch_add(1, Relaxed);
            let now = f.now_ms();
            let expire_ms = expire.as_millis() as u64;
            // Stores through mappings are found by scanning (cheap when nothing was written).
            for o in self.listed(|o| o.nmaps.load(Relaxed) > 0).iter().filter_map(ObjectRef::hold) {
                o.harvest(0, u64::MAX, Harvest::Periodic);
            }
            for obj in self.oldest_dirty_first(|_| true) {
                let since = obj.dirtied_at();
                let expired = now.saturating_sub(since) >= expire_ms;
                if !expired && f.published() <= f.background {
                    break; // oldest first: the rest are younger and we are below threshold
                }
                if obj.writeback(0, u64::MAX, Pass::Background).is_err() {
                    // The pages stay dirty; try again after another expiry period rather
                    // than spinning on a failing store. `sync` reports the error.
                    obj.set_dirtied_at(f.now_ms());
                }
            }
            // Writeback bandwidth estimate for smooth throttling.
            let (t0, c0) = last;
            let c1 = f.cleaned.load(Relaxed);
            let dt = t0.elapsed().as_secs_f64();
            if c1 > c0 && dt > 0.01 {
                let sample = ((c1 - c0) as f64 / dt) as u64;
                let old = f.rate.load(Relaxed);
                f.rate.store((old * 7 + sample * 3) / 10, Relaxed);
                last = (Instant::now(), c1);
            } else if dt > 1.0 {
                last = (Instant::now(), c1);
            }
            progressed = f.cleaned.load(Relaxed) > cleaned_before;
        }
    }
}

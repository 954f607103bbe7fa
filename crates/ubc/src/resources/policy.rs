//! The replacement policy behind its lock, and the fills that could not wait for it.
//!
//! One policy serves the whole cache under one mutex (`ubc-evict`'s contract). The page daemon
//! holds it while it picks a batch of victims (tens of µs), and every fill takes it to admit
//! the pages it made. A reader whose fill found the lock taken used to sleep on it; on this
//! 2-core VM the sleeper was woken hundreds of µs after the daemon let go (`ws_4x`: 1–1.5 % of
//! the misses took ~400 µs, against 0.1–0.2 % for a `quick_cache` read-through cache doing the
//! same reads, where nothing waits for a background thread).
//!
//! So a fill never waits for it: it tries the lock, and if the lock is taken it *stages* its
//! pages — a few words in a short list — and goes on; a later holder of the lock admits them
//! (below). This is Linux's LRU batching (`mm/swap.c`: a new folio goes to a
//! per-CPU `folio_batch` and reaches the LRU lists — and `lru_lock` — only when the batch is
//! drained), for the same reason: the lock that eviction holds is kept off the path of the
//! page that was just read.
//!
//! A staged page is valid but not yet known to the policy, so it cannot be chosen as a victim
//! until it is admitted. The lock admits staged pages when it is taken by a thread that holds
//! no rank (`order.rs`): the page daemon on each round and tick, a fill reserving memory (which
//! it does before it takes pages), `stats`. Admission looks the object up through a weak
//! reference, and the strong one it makes may be the object's last: dropped, it tears the
//! object down, taking its pages — which a thread holding pages of another object must not do
//! (the lock order). Between stage and admission a truncation may drop the page, and a fill
//! may make it again and admit or stage it; so admission inserts only a page still valid, not
//! BUSY, and not in the policy (slot `NO_SLOT`: a fill stages with `NO_SLOT`, an admission or a
//! direct insert sets the slot, a truncation resets it). The policy then never keeps a page
//! that is gone, nor one page twice (`budget.rs`:
//! `pages_staged_while_the_policy_is_busy_are_admitted_exactly_once`). Reclaim that finds too
//! little to evict wakes the page daemon, which admits what is staged. Without a page daemon
//! (`CacheBuilder::daemon(false)`) a fill waits for the lock as before: a cache used only by
//! writers, who hold their file's size lock while they fill, might otherwise never admit.

use crate::evict::{Admission, EvictionPolicy};
use parking_lot::{Mutex, MutexGuard};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::{Arc, Weak};

/// What staged pages belong to: a cached object, which checks and admits them.
pub(crate) trait AdmitStaged: Send + Sync {
    /// Admit pages `first..first + n` if each is still the page that was staged (valid, not
    /// taken for a drop, not in the policy). => `pol` is the cache's policy, locked.
    fn admit_staged(&self, pol: &mut dyn EvictionPolicy, first: u64, n: u64, admission: Admission);
}

/// A run of pages a fill published while the policy lock was taken.
struct Staged {
    object: Weak<dyn AdmitStaged>,
    first: u64,
    n: u64,
    admission: Admission,
}

pub(crate) struct PolicyLock {
    policy: Mutex<Box<dyn EvictionPolicy>>,
    /// Lock order: taken alone, or under `policy` (never the other way round).
    staged: Mutex<Vec<Staged>>,
    /// Whether `staged` may hold something: lets the lock holder skip taking it.
    any_staged: AtomicBool,
    /// Whether a page daemon runs to admit what is staged (without one, a fill waits for
    /// the lock as before: only threads that hold nothing admit, and a cache of writers
    /// might have none).
    daemon: AtomicBool,
}

/// The policy, locked (with the staged pages admitted, if the taker holds nothing). The
/// objects that admission looked up are released after the lock (`keep` drops after
/// `guard`): the last hold of an object dropped under the lock would run its teardown, which
/// takes the lock again.
pub(crate) struct PolicyGuard<'a> {
    guard: MutexGuard<'a, Box<dyn EvictionPolicy>>,
    #[allow(dead_code)] // held for its drop order only
    keep: Vec<Arc<dyn AdmitStaged>>,
}

impl std::ops::Deref for PolicyGuard<'_> {
    type Target = Box<dyn EvictionPolicy>;
    fn deref(&self) -> &Self::Target {
        &self.guard
    }
}

impl std::ops::DerefMut for PolicyGuard<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.guard
    }
}

impl PolicyLock {
    pub(crate) fn new(policy: Box<dyn EvictionPolicy>) -> PolicyLock {
        PolicyLock {
            policy: Mutex::new(policy),
            staged: Mutex::new(Vec::new()),
            any_staged: AtomicBool::new(false),
            daemon: AtomicBool::new(false),
        }
    }

    /// A page daemon runs (true) or stopped (false).
    pub(crate) fn set_daemon(&self, running: bool) {
        self.daemon.store(running, SeqCst);
    }

    /// For a fill publishing pages: the policy, locked, or `None` when the lock is taken and
    /// the fill should stage its pages instead (only while a page daemon runs).
    pub(crate) fn lock_or_stage(&self) -> Option<PolicyGuard<'_>> {
        if self.daemon.load(Relaxed) { self.try_lock() } else { Some(self.lock()) }
    }

    /// Lock the policy (may wait for the holder), admitting the staged pages first if this
    /// thread holds nothing (see above).
    pub(crate) fn lock(&self) -> PolicyGuard<'_> {
        self.admitted(self.policy.lock())
    }

    /// Lock the policy if nobody holds it, as `lock`.
    pub(crate) fn try_lock(&self) -> Option<PolicyGuard<'_>> {
        self.policy.try_lock().map(|g| self.admitted(g))
    }

    /// Leave `n` pages from `first` of `object` for the next holder of the lock to admit.
    /// => the pages are valid now (published), and their slots were set to `NO_SLOT` while
    /// they were still BUSY.
    pub(crate) fn stage(&self, object: Weak<dyn AdmitStaged>, first: u64, n: u64, admission: Admission) {
        let mut s = self.staged.lock();
        s.push(Staged { object, first, n, admission });
        self.any_staged.store(true, Release);
    }

    /// Whether pages wait for admission (the page daemon admits them on its rounds).
    pub(crate) fn has_staged(&self) -> bool {
        self.any_staged.load(Acquire)
    }

    fn admitted<'a>(&'a self, mut guard: MutexGuard<'a, Box<dyn EvictionPolicy>>) -> PolicyGuard<'a> {
        let mut keep = Vec::new();
        if self.any_staged.load(Acquire) && crate::order::holds_nothing() {
            let staged = {
                let mut s = self.staged.lock();
                self.any_staged.store(false, Relaxed);
                std::mem::take(&mut *s)
            };
            for s in staged {
                if let Some(obj) = s.object.upgrade() {
                    obj.admit_staged(guard.as_mut(), s.first, s.n, s.admission);
                    keep.push(obj);
                }
            }
        }
        PolicyGuard { guard, keep }
    }
}

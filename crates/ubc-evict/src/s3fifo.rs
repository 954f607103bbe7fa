//! S3-FIFO: a small probationary FIFO, a main FIFO with reinsertion, and a ghost FIFO.
//!
//! Source: J. Yang, Y. Zhang, Z. Qiu, Y. Yue, K. V. Rashmi, "FIFO queues are all you need for
//! cache eviction", SOSP 2023 (Algorithm 1), and the authors' libCacheSim `S3FIFO.c`.
//!
//! * **S** (small, ~10% of the resident pages) receives new pages. Most pages are used once
//!   ("one-hit wonders"); S lets them leave after a short stay without disturbing M.
//! * **M** (main, the rest) holds pages that proved reuse. It is FIFO with reinsertion and a
//!   2-bit frequency: at the tail, a page with `freq > 0` is reinserted at the head with
//!   `freq - 1`, a page with `freq == 0` is evicted. Pages evicted from M are not remembered.
//! * **G** (ghost, keys only, as many entries as M's share of the capacity) remembers pages
//!   recently evicted from S without reuse. A miss on a key in G means the page *was* reused,
//!   just later than S's short window, so it is inserted straight into M. G holds 64-bit key
//!   fingerprints, not nodes (`ghost.rs`).
//!
//! Eviction takes from S while S holds at least its 10% share, otherwise from M. At S's tail
//! a page accessed since insertion moves to M (its counter cleared), otherwise it is evicted
//! and its key pushed into G.
//!
//! The cache never reports hits to the policy; `freq` accumulates (saturating at 3) what
//! [`PageProbe::take_accesses`] returns whenever a page reaches the tail of S or M, which is
//! exactly when the paper's algorithm reads `freq`. Hits between two looks are capped at 3 by
//! the cache's 2-bit counter, the same cap the paper uses.
//!
//! Deviations from the paper, and why:
//! * S's 10% share is measured against the pages currently tracked, not the configured
//!   capacity. When the cache is full the two are the same; when the cache evicts below its
//!   nominal capacity (memory pressure, dirty pages holding space) a capacity-based target
//!   would leave S permanently "under target" and turn every eviction into an M eviction,
//!   letting one-hit wonders pile up in S.
//! * Promotion S→M does not trigger an M eviction inside the S eviction (the paper's
//!   `if M is full: evictM()`); like libCacheSim we let M overshoot its share and the next
//!   call evicts from M. Each call then evicts exactly one page, as the trait requires.
//! * [`Admission::ReadAhead`] pages are worth less than used ones: they always enter S (a
//!   ghost hit by read-ahead is no evidence of reuse, so never straight into M); their first
//!   access is the use they were read for, so it does not count towards promotion; and an
//!   unused read-ahead page leaving S is not pushed into G (it was never used, so its return
//!   would prove nothing). We put them at S's head rather than its tail: at the tail they
//!   would be evicted before the sequential reader reaches them under memory pressure
//!   (read-ahead thrashing), and S is already where pages leave first.
//! * Contract handling (crate docs): `Unavailable` pages are rotated to the head of their
//!   queue (a dirty page stays in S or M and is looked at again later); `Gone` pages are
//!   forgotten without a ghost entry (they left for reasons unrelated to reuse). After
//!   rotating `min(len, 64)` unavailable pages in one queue, a call looks only at the other
//!   queue (so a dirty S does not cost a walk of all of S per eviction). The paper's
//!   loop is bounded; if it runs out (everything pinned, or concurrent hits keep feeding
//!   `freq`), one final pass over S then M takes the first takeable page regardless of
//!   frequency, and only if that pass takes nothing does `select_victim` return `None`.

use crate::ghost::GhostFifo;
use crate::list::{Arena, List};
use crate::{Admission, EvictAttempt, EvictionPolicy, PageKey, PageProbe, Slot};

/// Highest value of the per-page frequency (2 bits, as in the paper).
const MAX_FREQ: u8 = 3;

/// Unavailable pages one `select_victim` call rotates in a queue before it stops looking
/// there (it looks at the other queue instead, then falls back to the forced pass).
///
/// Without a cap, a write burst that leaves all of S dirty would make every eviction walk
/// all of S (10% of the cache) before turning to M; with it, each call does bounded work and
/// the rotations still advance through S across calls, so selection stays amortized O(1).
const UNAVAILABLE_RUN_LIMIT: usize = 64;

/// Which queue a resident node is linked on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Queue {
    Small,
    Main,
}

/// Per-node state.
#[derive(Clone, Copy, Debug)]
struct Meta {
    queue: Queue,
    freq: u8,
    readahead_unused: bool,
}

/// Tunables, kept within the paper's design space. [`S3Fifo::new`] uses the paper's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct S3FifoParams {
    /// S's share of the resident pages, in percent (paper: 10).
    pub small_percent: u8,
    /// Accesses while in S needed to move to M (paper text: 1, "accessed at least once";
    /// libCacheSim's current default is 2).
    pub move_to_main_threshold: u8,
    /// Ghost entries as a percentage of the capacity (paper: M's size, i.e. 90).
    pub ghost_percent: u8,
}

impl Default for S3FifoParams {
    /// The paper's parameters: 10% S, promote after one access, ghost as large as M.
    fn default() -> Self {
        S3FifoParams { small_percent: 10, move_to_main_threshold: 1, ghost_percent: 90 }
    }
}

/// S3-FIFO replacement. See the module documentation.
#[derive(Debug)]
pub struct S3Fifo {
    /// Resident pages; the node's `queue` tells which list it is on.
    arena: Arena<Meta>,
    small: List,
    main: List,
    ghost: GhostFifo,
    params: S3FifoParams,
}

impl S3Fifo {
    /// An S3-FIFO policy for a cache of `capacity_pages` pages with the paper's parameters.
    pub fn new(capacity_pages: usize) -> Self {
        Self::with_params(capacity_pages, S3FifoParams::default())
    }

    /// An S3-FIFO policy with explicit tunables. Precondition: `small_percent` in 1..=99,
    /// `move_to_main_threshold` in 1..=3.
    pub fn with_params(capacity_pages: usize, params: S3FifoParams) -> Self {
        assert!((1..=99).contains(&params.small_percent), "small_percent out of range");
        assert!((1..=MAX_FREQ).contains(&params.move_to_main_threshold), "move_to_main_threshold out of range");
        let ghost_capacity = (capacity_pages * usize::from(params.ghost_percent) / 100).max(1);
        S3Fifo {
            arena: Arena::with_capacity(capacity_pages),
            small: List::new(),
            main: List::new(),
            ghost: GhostFifo::new(ghost_capacity),
            params,
        }
    }

    /// The list a resident node is on, by queue tag.
    fn list_mut(&mut self, queue: Queue) -> &mut List {
        match queue {
            Queue::Small => &mut self.small,
            Queue::Main => &mut self.main,
        }
    }

    /// Unlink `slot` from whichever queue it is on. Precondition: `slot` is live and linked.
    fn unlink(&mut self, slot: u32) {
        let queue = self.arena.get(slot).data.queue;
        let mut list = *self.list_mut(queue);
        self.arena.unlink(&mut list, slot);
        *self.list_mut(queue) = list;
    }

    /// Link `slot` at the head (newest end) of `queue`. Precondition: `slot` is unlinked.
    fn push(&mut self, slot: u32, queue: Queue) {
        self.arena.get_mut(slot).data.queue = queue;
        let mut list = *self.list_mut(queue);
        self.arena.push_back(&mut list, slot);
        *self.list_mut(queue) = list;
    }

    /// Move `slot` to the head of `queue` (same queue = rotate). Precondition: `slot` linked.
    fn requeue(&mut self, slot: u32, queue: Queue) {
        self.unlink(slot);
        self.push(slot, queue);
    }

    /// Drop `slot` without a trace. Precondition: `slot` is live and linked.
    fn forget(&mut self, slot: u32) {
        self.unlink(slot);
        self.arena.free(slot);
    }

    /// Drop resident `slot` and remember its key in G (which forgets its oldest if full).
    /// Precondition: `slot` is live and linked.
    fn make_ghost(&mut self, slot: u32) {
        let key = self.arena.get(slot).key;
        self.forget(slot);
        self.ghost.push(key);
    }

    /// Fold new accesses into `freq`; a read-ahead page's first access is its first use and
    /// does not count. Precondition: `slot` is live and resident.
    fn absorb(&mut self, slot: u32, accesses: u8) -> u8 {
        let meta = &mut self.arena.get_mut(slot).data;
        let mut accesses = accesses;
        if meta.readahead_unused && accesses > 0 {
            meta.readahead_unused = false;
            accesses -= 1;
        }
        meta.freq = (meta.freq + accesses).min(MAX_FREQ);
        meta.freq
    }

    /// True when the next eviction should come from S: S holds at least its share of the
    /// resident pages (the paper's `S.size >= 0.1 * cache size`, see module docs).
    fn small_over_share(&self) -> bool {
        self.small.len() * 100 >= self.len() * usize::from(self.params.small_percent)
    }

    /// One step at S's tail: promote, evict (returning the key) or rotate.
    /// Precondition: S is not empty.
    fn step_small(&mut self, probe: &mut dyn PageProbe, unavailable: &mut usize) -> Option<PageKey> {
        let slot = self.small.front()?;
        let key = self.arena.get(slot).key;
        let Some(accesses) = probe.take_accesses(key) else {
            self.forget(slot);
            return None;
        };
        if self.absorb(slot, accesses) >= self.params.move_to_main_threshold {
            // Reused during its probation: promote, with the access bits cleared (paper §4.1).
            self.arena.get_mut(slot).data.freq = 0;
            self.requeue(slot, Queue::Main);
            return None;
        }
        match probe.try_evict(key) {
            EvictAttempt::Taken => {
                if self.arena.get(slot).data.readahead_unused {
                    self.forget(slot); // never used: its return would prove nothing
                } else {
                    self.make_ghost(slot);
                }
                Some(key)
            }
            EvictAttempt::Gone => {
                self.forget(slot);
                None
            }
            EvictAttempt::Unavailable => {
                *unavailable += 1;
                self.requeue(slot, Queue::Small);
                None
            }
        }
    }

    /// One step at M's tail: reinsert with `freq - 1`, evict (returning the key) or rotate.
    /// Precondition: M is not empty.
    fn step_main(&mut self, probe: &mut dyn PageProbe, unavailable: &mut usize) -> Option<PageKey> {
        let slot = self.main.front()?;
        let key = self.arena.get(slot).key;
        let Some(accesses) = probe.take_accesses(key) else {
            self.forget(slot);
            return None;
        };
        if self.absorb(slot, accesses) > 0 {
            self.arena.get_mut(slot).data.freq -= 1;
            self.requeue(slot, Queue::Main);
            return None;
        }
        match probe.try_evict(key) {
            EvictAttempt::Taken => {
                self.forget(slot); // M evictions are not remembered in G (paper)
                Some(key)
            }
            EvictAttempt::Gone => {
                self.forget(slot);
                None
            }
            EvictAttempt::Unavailable => {
                *unavailable += 1;
                self.requeue(slot, Queue::Main);
                None
            }
        }
    }

    /// Last resort: oldest-first over S then M, take the first takeable page regardless of
    /// frequency. Pages that are unavailable stay where they are.
    fn forced_pass(&mut self, probe: &mut dyn PageProbe) -> Option<PageKey> {
        for queue in [Queue::Small, Queue::Main] {
            let mut cursor = self.list_mut(queue).front();
            while let Some(slot) = cursor {
                cursor = self.arena.newer(slot); // read before `slot` may be unlinked
                let key = self.arena.get(slot).key;
                if probe.take_accesses(key).is_none() {
                    self.forget(slot);
                    continue;
                }
                match probe.try_evict(key) {
                    EvictAttempt::Taken => {
                        let meta = self.arena.get(slot).data;
                        if queue == Queue::Small && !meta.readahead_unused {
                            self.make_ghost(slot);
                        } else {
                            self.forget(slot);
                        }
                        return Some(key);
                    }
                    EvictAttempt::Gone => self.forget(slot),
                    EvictAttempt::Unavailable => {}
                }
            }
        }
        None
    }

    /// Number of ghost entries (tests and diagnostics).
    pub fn ghost_len(&self) -> usize {
        self.ghost.len()
    }

    /// Number of resident pages in S (tests and diagnostics).
    pub fn small_len(&self) -> usize {
        self.small.len()
    }

    /// Number of resident pages in M (tests and diagnostics).
    pub fn main_len(&self) -> usize {
        self.main.len()
    }

    /// Keys of the queue `which` (0 = S, 1 = M) oldest first (tests only).
    #[cfg(test)]
    fn keys(&self, which: usize) -> Vec<PageKey> {
        self.arena.keys([&self.small, &self.main][which])
    }
}

impl EvictionPolicy for S3Fifo {
    /// "s3fifo".
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    /// Admit a filled page: demand fills remembered in G go to M, everything else to S.
    fn insert(&mut self, key: PageKey, admission: Admission) -> Slot {
        let readahead = admission == Admission::ReadAhead;
        // Only a demand fill is evidence of reuse; read-ahead goes to S (and its key leaves G
        // either way: the page is back).
        let queue = if self.ghost.take(key) && !readahead { Queue::Main } else { Queue::Small };
        let slot = self.arena.alloc(key, Meta { queue, freq: 0, readahead_unused: readahead });
        self.push(slot, queue);
        slot
    }

    /// Forget a resident page the cache dropped itself; a stale slot is ignored (and
    /// dropping the page says nothing about its reuse, so G is not told).
    fn remove(&mut self, slot: Slot, key: PageKey) {
        if self.arena.holds(slot, key) {
            self.forget(slot);
        }
    }

    /// Evict one page following the paper's algorithm, bounded (see module docs).
    fn select_victim(&mut self, probe: &mut dyn PageProbe) -> Option<PageKey> {
        // Bound on the paper's loop. Single-threaded it always ends well within it: each S
        // step promotes, evicts or rotates an unavailable page; each M step decrements a
        // freq of at most 3 or rotates; a queue stops being looked at once we have rotated as
        // many unavailable pages as it holds (or UNAVAILABLE_RUN_LIMIT).
        let mut budget = 6 * self.len() + 8;
        let (mut small_unavailable, mut main_unavailable) = (0usize, 0usize);
        let open =
            |unavailable: usize, list: &List| !list.is_empty() && unavailable < list.len().min(UNAVAILABLE_RUN_LIMIT);
        while budget > 0 {
            budget -= 1;
            let small_ok = open(small_unavailable, &self.small);
            let main_ok = open(main_unavailable, &self.main);
            let from_small = match (small_ok, main_ok) {
                (false, false) => break,
                (true, false) => true,
                (false, true) => false,
                (true, true) => self.small_over_share(),
            };
            let victim = if from_small {
                self.step_small(probe, &mut small_unavailable)
            } else {
                self.step_main(probe, &mut main_unavailable)
            };
            if victim.is_some() {
                return victim;
            }
        }
        self.forced_pass(probe)
    }

    /// Exact number of resident pages tracked (S + M; ghost keys are not pages).
    fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testprobe::{TestProbe, k};

    /// Insert `key` as a demand fill into both the policy and the probe.
    fn fill(p: &mut S3Fifo, probe: &mut TestProbe, key: PageKey) {
        p.insert(key, Admission::Demand);
        probe.add(key);
    }

    #[test]
    fn unaccessed_small_page_goes_to_ghost_and_returns_to_main() {
        let mut p = S3Fifo::new(10);
        let mut probe = TestProbe::default();
        for i in 0..10 {
            fill(&mut p, &mut probe, k(i));
        }
        // M is empty, so S (everything) is over its share: the oldest S page goes, to G.
        assert_eq!(p.select_victim(&mut probe), Some(k(0)));
        assert!(p.ghost.contains(k(0)) && p.ghost_len() == 1);
        // Page 0 comes back on demand: the ghost sends it straight to M.
        fill(&mut p, &mut probe, k(0));
        assert_eq!(p.keys(1), vec![k(0)]);
        assert_eq!(p.ghost_len(), 0);
        assert_eq!(p.len(), 10);
    }

    #[test]
    fn accessed_small_page_is_promoted() {
        let mut p = S3Fifo::new(10);
        let mut probe = TestProbe::default();
        for i in 0..10 {
            fill(&mut p, &mut probe, k(i));
        }
        probe.touch(k(0));
        assert_eq!(p.select_victim(&mut probe), Some(k(1)));
        assert_eq!(p.keys(1), vec![k(0)]);
        assert!(p.ghost.contains(k(1)) && p.ghost_len() == 1);
    }

    #[test]
    fn main_reinserts_with_decrement() {
        let mut p = S3Fifo::new(4);
        let mut probe = TestProbe::default();
        // Get 0 and 1 into M via the ghost.
        for i in 0..4 {
            fill(&mut p, &mut probe, k(i));
        }
        assert_eq!(p.select_victim(&mut probe), Some(k(0)));
        assert_eq!(p.select_victim(&mut probe), Some(k(1)));
        fill(&mut p, &mut probe, k(0));
        fill(&mut p, &mut probe, k(1));
        assert_eq!(p.keys(1), vec![k(0), k(1)]);
        // S = {2, 3} is 50% of 4 pages: drain it first.
        assert_eq!(p.select_victim(&mut probe), Some(k(2)));
        assert_eq!(p.select_victim(&mut probe), Some(k(3)));
        // Now M only. 0 was hit twice: reinserted (freq 2 -> 1); 1 is evicted.
        probe.touch(k(0));
        probe.touch(k(0));
        assert_eq!(p.select_victim(&mut probe), Some(k(1)));
        fill(&mut p, &mut probe, k(5)); // S = {5}, M = {0}
        probe.touch(k(5));
        // S is over its share; 5 was used, so it is promoted and the loop moves on to M:
        // 0 still has freq 1 -> reinserted with 0; 5 (freq cleared on promotion) goes.
        assert_eq!(p.select_victim(&mut probe), Some(k(5)));
        assert_eq!(p.select_victim(&mut probe), Some(k(0)));
        assert!(p.is_empty());
    }

    #[test]
    fn scan_does_not_flush_main() {
        let cap = 100u64;
        let mut p = S3Fifo::new(cap as usize);
        let mut probe = TestProbe::default();
        // A hot set of 50 pages, all used twice, ends up in M.
        let mut resident = 0;
        let mut admit = |p: &mut S3Fifo, probe: &mut TestProbe, key: PageKey| {
            if resident == cap {
                assert!(p.select_victim(probe).is_some());
            } else {
                resident += 1;
            }
            fill(p, probe, key);
        };
        for i in 0..50 {
            admit(&mut p, &mut probe, k(i));
            probe.touch(k(i));
        }
        // A one-time scan of 1000 pages; the hot set keeps being used meanwhile.
        for j in 0..1000u64 {
            admit(&mut p, &mut probe, PageKey { object: 1, index: j });
            if j % 20 == 0 {
                for i in 0..50 {
                    if p.keys(0).contains(&k(i)) || p.keys(1).contains(&k(i)) {
                        probe.touch(k(i));
                    }
                }
            }
        }
        let main = p.keys(1);
        let hot_left = (0..50).filter(|&i| main.contains(&k(i))).count();
        assert_eq!(hot_left, 50, "the scan must not push the hot set out of M");
        // The scan only ever occupied the space M did not need.
        assert_eq!((p.main_len(), p.small_len()), (50, 50));
    }

    #[test]
    fn readahead_never_enters_main_from_ghost_and_skips_ghost_unused() {
        let mut p = S3Fifo::new(10);
        let mut probe = TestProbe::default();
        for i in 0..10 {
            fill(&mut p, &mut probe, k(i));
        }
        assert_eq!(p.select_victim(&mut probe), Some(k(0)));
        assert_eq!(p.ghost_len(), 1);
        // Read-ahead brings 0 back: to S, not M.
        p.insert(k(0), Admission::ReadAhead);
        probe.add(k(0));
        assert_eq!(p.main_len(), 0);
        assert_eq!(p.ghost_len(), 0);
        // An unused read-ahead page leaves S without a ghost entry.
        p.insert(k(20), Admission::ReadAhead);
        probe.add(k(20));
        for i in 1..10 {
            assert_eq!(p.select_victim(&mut probe), Some(k(i)));
        }
        assert_eq!(p.select_victim(&mut probe), Some(k(0)));
        assert_eq!(p.select_victim(&mut probe), Some(k(20)));
        assert!(p.is_empty() && !p.ghost.contains(k(0)) && !p.ghost.contains(k(20)), "neither is remembered");
        // A read-ahead page used once (the read it anticipated) is not promoted.
        p.insert(k(30), Admission::ReadAhead);
        probe.add(k(30));
        probe.touch(k(30));
        assert_eq!(p.select_victim(&mut probe), Some(k(30)));
        assert!(p.ghost.contains(k(30)), "used once: remembered like a demand page");
    }

    #[test]
    fn all_unavailable_returns_none_then_recovers() {
        let mut p = S3Fifo::new(8);
        let mut probe = TestProbe::default();
        for i in 0..8 {
            fill(&mut p, &mut probe, k(i));
            probe.pin(k(i));
            probe.touch(k(i));
        }
        assert_eq!(p.select_victim(&mut probe), None);
        assert_eq!(p.len(), 8);
        probe.unpin(k(5));
        assert_eq!(p.select_victim(&mut probe), Some(k(5)));
        assert_eq!(p.len(), 7);
    }

    #[test]
    fn dirty_small_queue_does_not_cost_a_full_walk() {
        let cap = 1000u64;
        let mut p = S3Fifo::new(cap as usize);
        let mut probe = TestProbe::default();
        // 900 clean pages in M (via the ghost), then 100 dirty pages in S.
        for i in 0..900 {
            fill(&mut p, &mut probe, k(i));
        }
        for i in 0..900 {
            assert_eq!(p.select_victim(&mut probe), Some(k(i)));
        }
        for i in 0..900 {
            fill(&mut p, &mut probe, k(i));
        }
        for i in 900..1000 {
            fill(&mut p, &mut probe, k(i));
            probe.pin(k(i));
        }
        assert_eq!((p.small_len(), p.main_len()), (100, 900));
        let mut counting = Counting { inner: &mut probe, probes: 0 };
        assert_eq!(p.select_victim(&mut counting), Some(k(0)));
        assert!(counting.probes <= 2 * UNAVAILABLE_RUN_LIMIT + 2, "{} probes", counting.probes);
    }

    /// A probe wrapper counting the policy's calls.
    struct Counting<'a> {
        inner: &'a mut TestProbe,
        probes: usize,
    }

    impl PageProbe for Counting<'_> {
        fn take_accesses(&mut self, key: PageKey) -> Option<u8> {
            self.probes += 1;
            self.inner.take_accesses(key)
        }
        fn try_evict(&mut self, key: PageKey) -> EvictAttempt {
            self.probes += 1;
            self.inner.try_evict(key)
        }
    }

    #[test]
    fn ghost_is_bounded() {
        let mut p = S3Fifo::new(10);
        let mut probe = TestProbe::default();
        for i in 0..1000 {
            if p.len() == 10 {
                assert!(p.select_victim(&mut probe).is_some());
            }
            fill(&mut p, &mut probe, k(i));
        }
        assert_eq!(p.ghost_len(), 9);
        assert_eq!(p.arena.live(), 10, "ghosts are fingerprints, not nodes");
    }
}

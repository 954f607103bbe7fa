//! CLOCK ("second chance"): an LRU approximation from reference bits.
//!
//! Source: F. J. Corbató, "A Paging Experiment with the Multics System" (MIT Project MAC,
//! 1968); the same algorithm drives NetBSD's `uvm_pdaemon.c` and Linux's inactive-list scan.
//!
//! Pages sit on a circle with a hand. To find a victim the hand looks at the page under it:
//! if the page was referenced since the hand last passed (here: the cache's access counter,
//! read and cleared with [`PageProbe::take_accesses`], is non-zero) the page gets a second
//! chance and the hand moves on; otherwise the page is evicted. New pages are placed just
//! behind the hand, i.e. they are the last the hand reaches. We keep the circle as a FIFO
//! whose front is the hand: "the hand moves past a page" is "move the front to the back",
//! which is O(1) on the intrusive list.
//!
//! Contract handling (see the crate docs): `Unavailable` pages (pinned, busy, dirty) are
//! passed over like referenced ones; `Gone` pages (and pages whose counter reads `None`) are
//! forgotten. A call makes at most two passes over the circle: the first honours reference
//! bits, the second ignores them. In a single thread the second pass sees no bits anyway (the
//! first cleared them), but concurrent hits on the cache's lock-free hit path can keep setting
//! bits, and a policy that honoured them forever would never terminate. If the second pass
//! takes nothing, every page is unavailable and `select_victim` returns `None`.
//!
//! Read-ahead: a page filled by read-ahead has not been used yet, so its first access is the
//! use it was read for, not a re-reference; that one access is absorbed (see
//! `MarkedQueue::absorb`).

use crate::queue::MarkedQueue;
use crate::{Admission, EvictAttempt, EvictionPolicy, PageKey, PageProbe, Slot};

/// CLOCK replacement. See the module documentation.
#[derive(Debug)]
pub struct Clock {
    /// The circle; its front is the page under the hand.
    ring: MarkedQueue,
}

impl Clock {
    /// A CLOCK policy sized for about `capacity_pages` resident pages (a sizing hint only:
    /// the cache decides when to evict).
    pub fn new(capacity_pages: usize) -> Self {
        Clock { ring: MarkedQueue::new(capacity_pages) }
    }
}

impl EvictionPolicy for Clock {
    /// "clock".
    fn name(&self) -> &'static str {
        "clock"
    }

    /// Place a newly filled page just behind the hand; returns its slot.
    fn insert(&mut self, key: PageKey, admission: Admission) -> Slot {
        self.ring.insert(key, admission)
    }

    /// Forget a page the cache dropped itself; a stale slot is ignored.
    fn remove(&mut self, slot: Slot, key: PageKey) {
        if self.ring.holds(slot, key) {
            self.ring.forget(slot);
        }
    }

    /// Sweep the hand until an unreferenced, takeable page is found (at most two passes).
    fn select_victim(&mut self, probe: &mut dyn PageProbe) -> Option<PageKey> {
        for honour_references in [true, false] {
            // One pass = as many steps as pages at its start: every step either removes the
            // page under the hand or moves the hand past it, so each page is seen once.
            for _ in 0..self.ring.len() {
                let slot = self.ring.front()?;
                let key = self.ring.key(slot);
                let Some(accesses) = probe.take_accesses(key) else {
                    self.ring.forget(slot); // left the cache behind our back
                    continue;
                };
                if self.ring.absorb(slot, accesses) > 0 && honour_references {
                    self.ring.move_to_back(slot); // second chance
                    continue;
                }
                match probe.try_evict(key) {
                    EvictAttempt::Taken => {
                        self.ring.forget(slot);
                        return Some(key);
                    }
                    EvictAttempt::Gone => self.ring.forget(slot),
                    EvictAttempt::Unavailable => self.ring.move_to_back(slot),
                }
            }
        }
        None
    }

    /// Exact number of tracked pages.
    fn len(&self) -> usize {
        self.ring.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testprobe::{TestProbe, k};

    #[test]
    fn second_chance_spares_referenced_page() {
        let mut p = Clock::new(4);
        let mut probe = TestProbe::default();
        for i in 0..4 {
            p.insert(k(i), Admission::Demand);
            probe.add(k(i));
        }
        probe.touch(k(0));
        // Page 0 is referenced: it is passed over and page 1 goes.
        assert_eq!(p.select_victim(&mut probe), Some(k(1)));
        // Page 0's bit was consumed; the hand is now at 2, then 3, then 0 again.
        assert_eq!(p.select_victim(&mut probe), Some(k(2)));
        assert_eq!(p.select_victim(&mut probe), Some(k(3)));
        assert_eq!(p.select_victim(&mut probe), Some(k(0)));
        assert!(p.is_empty());
    }

    #[test]
    fn all_referenced_degrades_to_fifo() {
        let mut p = Clock::new(3);
        let mut probe = TestProbe::default();
        for i in 0..3 {
            p.insert(k(i), Admission::Demand);
            probe.add(k(i));
            probe.touch(k(i));
        }
        assert_eq!(p.select_victim(&mut probe), Some(k(0)));
    }

    #[test]
    fn unavailable_kept_and_none_when_all_unavailable() {
        let mut p = Clock::new(3);
        let mut probe = TestProbe::default();
        for i in 0..3 {
            p.insert(k(i), Admission::Demand);
            probe.add(k(i));
            probe.pin(k(i));
        }
        assert_eq!(p.select_victim(&mut probe), None);
        assert_eq!(p.len(), 3);
        probe.unpin(k(1));
        assert_eq!(p.select_victim(&mut probe), Some(k(1)));
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn gone_is_forgotten() {
        let mut p = Clock::new(3);
        let mut probe = TestProbe::default();
        for i in 0..3 {
            p.insert(k(i), Admission::Demand);
            probe.add(k(i));
        }
        probe.drop_page(k(0));
        assert_eq!(p.select_victim(&mut probe), Some(k(1)));
        assert_eq!(p.len(), 1);
    }

    #[test]
    fn readahead_first_access_is_not_a_second_chance() {
        let mut p = Clock::new(3);
        let mut probe = TestProbe::default();
        p.insert(k(0), Admission::ReadAhead);
        p.insert(k(1), Admission::Demand);
        probe.add(k(0));
        probe.add(k(1));
        probe.touch(k(0)); // the read the read-ahead anticipated
        probe.touch(k(1)); // a genuine re-reference
        assert_eq!(p.select_victim(&mut probe), Some(k(0)));
    }
}

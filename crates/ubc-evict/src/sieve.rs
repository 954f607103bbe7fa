//! SIEVE: one FIFO queue and a hand that sifts out unvisited pages.
//!
//! Source: Y. Zhang, J. Yang, Y. Yue, Y. Vigfusson, K. V. Rashmi, "SIEVE is Simpler than LRU:
//! an Efficient Turn-Key Eviction Algorithm for Web Caches", NSDI 2024.
//!
//! Pages are kept in insertion order; new pages enter at the newest end and hits never move
//! anything. Each page has a "visited" bit — here: the cache's access counter, read and
//! cleared through [`PageProbe::take_accesses`], is non-zero. To evict, the hand starts where
//! it last stopped (initially at the oldest page) and walks towards newer pages, wrapping from
//! the newest back to the oldest: a visited page has its bit cleared (the read clears it) and
//! stays *in place*; the first unvisited page is evicted and the hand stops at its newer
//! neighbour. Unlike CLOCK, survivors are not moved behind new arrivals, so new pages that are
//! not re-used are sifted out quickly while old popular pages stay put.
//!
//! Contract handling (see the crate docs): `Unavailable` pages stay in place and the hand
//! moves on, as for a visited page; `Gone` pages (or counters reading `None`) are forgotten. A
//! call makes at most two full rounds of the hand: the first honours visited bits, the second
//! ignores them (needed only when concurrent hits keep re-setting bits — single-threaded, the
//! first round has already cleared them). If the second round takes nothing, `None`.
//!
//! Read-ahead: a read-ahead page's first access is the use it was read for, not a re-visit;
//! that access is absorbed (see `MarkedQueue::absorb`), so an unused or once-used read-ahead
//! page is sifted out like a once-used demand page.

use crate::list::NIL;
use crate::queue::MarkedQueue;
use crate::{Admission, EvictAttempt, EvictionPolicy, PageKey, PageProbe, Slot};

/// SIEVE replacement. See the module documentation.
#[derive(Debug)]
pub struct Sieve {
    /// Insertion order: front = oldest, back = newest.
    queue: MarkedQueue,
    /// The page the hand points at; `NIL` means "start at the oldest page".
    hand: u32,
}

impl Sieve {
    /// A SIEVE policy sized for about `capacity_pages` resident pages (a sizing hint only:
    /// the cache decides when to evict).
    pub fn new(capacity_pages: usize) -> Self {
        Sieve { queue: MarkedQueue::new(capacity_pages), hand: NIL }
    }

    /// The hand's position after passing `slot`: its newer neighbour, or wrap to the oldest.
    /// Precondition: `slot` is linked.
    fn step_past(&self, slot: u32) -> u32 {
        self.queue.newer(slot).unwrap_or(NIL)
    }

    /// Drop the node in `slot`, moving the hand off it first. Precondition: `slot` is live.
    fn forget(&mut self, slot: u32) {
        if self.hand == slot {
            self.hand = self.step_past(slot);
        }
        self.queue.forget(slot);
    }

    /// Keys from oldest to newest (tests only).
    #[cfg(test)]
    fn keys(&self) -> Vec<PageKey> {
        self.queue.keys()
    }
}

impl EvictionPolicy for Sieve {
    /// "sieve".
    fn name(&self) -> &'static str {
        "sieve"
    }

    /// Append a newly filled page at the newest end; returns its slot.
    fn insert(&mut self, key: PageKey, admission: Admission) -> Slot {
        self.queue.insert(key, admission)
    }

    /// Forget a page the cache dropped itself; a stale slot is ignored.
    fn remove(&mut self, slot: Slot, key: PageKey) {
        if self.queue.holds(slot, key) {
            self.forget(slot);
        }
    }

    /// Move the hand until an unvisited, takeable page is found (at most two rounds).
    fn select_victim(&mut self, probe: &mut dyn PageProbe) -> Option<PageKey> {
        for honour_visits in [true, false] {
            // One round = as many steps as pages at its start; each step passes or removes
            // one page, so every page is looked at once per round.
            for _ in 0..self.queue.len() {
                let slot = if self.hand == NIL { self.queue.front()? } else { self.hand };
                let key = self.queue.key(slot);
                let Some(accesses) = probe.take_accesses(key) else {
                    self.forget(slot); // left the cache behind our back
                    continue;
                };
                if self.queue.absorb(slot, accesses) > 0 && honour_visits {
                    // Visited: the read cleared the bit; the page stays where it is.
                    self.hand = self.step_past(slot);
                    continue;
                }
                match probe.try_evict(key) {
                    EvictAttempt::Taken => {
                        self.forget(slot); // also parks the hand on the newer neighbour
                        return Some(key);
                    }
                    EvictAttempt::Gone => self.forget(slot),
                    EvictAttempt::Unavailable => self.hand = self.step_past(slot),
                }
            }
        }
        None
    }

    /// Exact number of tracked pages.
    fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testprobe::{TestProbe, k};

    /// Insert pages `0..n` into both the policy and the probe.
    fn filled(n: u64) -> (Sieve, TestProbe) {
        let mut p = Sieve::new(n as usize);
        let mut probe = TestProbe::default();
        for i in 0..n {
            // Slot i: the arena hands out slots in order (`remove` below relies on it).
            assert_eq!(p.insert(k(i), Admission::Demand), i as Slot);
            probe.add(k(i));
        }
        (p, probe)
    }

    #[test]
    fn visited_pages_stay_in_place() {
        let (mut p, mut probe) = filled(4);
        probe.touch(k(0));
        probe.touch(k(2));
        // Hand starts at the oldest (0, visited, kept), evicts 1 and stops at 2.
        assert_eq!(p.select_victim(&mut probe), Some(k(1)));
        // No reordering: 0 is still the oldest (CLOCK would have moved it behind 3).
        assert_eq!(p.keys(), vec![k(0), k(2), k(3)]);
        // Hand at 2 (visited, kept), evicts 3.
        assert_eq!(p.select_victim(&mut probe), Some(k(3)));
        p.insert(k(4), Admission::Demand);
        probe.add(k(4));
        // Hand wrapped to the oldest: 0's bit was cleared on the first pass, so 0 goes now.
        assert_eq!(p.select_victim(&mut probe), Some(k(0)));
        assert_eq!(p.keys(), vec![k(2), k(4)]);
    }

    #[test]
    fn hand_resumes_where_it_stopped() {
        let (mut p, mut probe) = filled(5);
        probe.touch(k(0));
        probe.touch(k(1));
        assert_eq!(p.select_victim(&mut probe), Some(k(2)));
        // A new page arriving does not reset the hand: it continues at 3.
        p.insert(k(5), Admission::Demand);
        probe.add(k(5));
        probe.touch(k(3));
        assert_eq!(p.select_victim(&mut probe), Some(k(4)));
    }

    #[test]
    fn unavailable_stays_and_none_when_all_unavailable() {
        let (mut p, mut probe) = filled(3);
        for i in 0..3 {
            probe.pin(k(i));
            probe.touch(k(i));
        }
        assert_eq!(p.select_victim(&mut probe), None);
        assert_eq!(p.keys(), vec![k(0), k(1), k(2)]);
        probe.unpin(k(2));
        assert_eq!(p.select_victim(&mut probe), Some(k(2)));
    }

    #[test]
    fn remove_under_the_hand_moves_the_hand() {
        let (mut p, mut probe) = filled(4);
        probe.touch(k(0));
        assert_eq!(p.select_victim(&mut probe), Some(k(1)));
        // The hand is on 2; removing 2 must leave the hand on 3.
        p.remove(1, k(2)); // a stale slot (1 held page 1, gone): ignored
        assert_eq!(p.keys(), vec![k(0), k(2), k(3)]);
        p.remove(2, k(2));
        probe.drop_page(k(2));
        assert_eq!(p.select_victim(&mut probe), Some(k(3)));
        assert_eq!(p.keys(), vec![k(0)]);
    }
}

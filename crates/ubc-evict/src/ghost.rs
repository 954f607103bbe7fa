//! S3-FIFO's ghost queue G, kept as fingerprints: an exact FIFO of 64-bit key hashes with an
//! O(1) membership test, at ~18 bytes per remembered key.
//!
//! G remembers keys, not pages, and it is as large as 90% of the cache: kept as arena nodes
//! with a hash index (as the resident queues once were), it cost more than the resident pages'
//! own metadata. The S3-FIFO paper notes that the ghost queue can be "implemented as part of
//! the indexing structure", storing only a fingerprint and an insertion time per entry
//! (Yang et al., SOSP 2023, §4.2); this is that idea in a form that stays an exact FIFO, so the
//! policy still agrees decision for decision with the paper's pseudocode
//! (`tests/reference.rs`):
//!
//! * `ring` holds the fingerprints in insertion order (a circular buffer with 25% slack);
//!   an entry taken out by a ghost hit becomes [`DEAD`] where it stands, and the ring is
//!   compacted when the slack is used up (amortized O(1): once per capacity/4 removals).
//! * `index` is an open-addressing table (linear probing, load ≤ 1/2, deletion by backward
//!   shift, so no tombstones) from fingerprint to ring position.
//!
//! Two keys with the same 64-bit hash are one ghost entry: a ghost hit for a key that was never
//! evicted, with probability ~2^-64 per pair of keys — an admission into M instead of S, never
//! a wrong page.

use crate::PageKey;
use crate::list::key_hash;

/// The fingerprint of a removed ring entry (no key hashes to it: see [`fingerprint`]).
const DEAD: u64 = 0;

/// The key's fingerprint, never [`DEAD`].
fn fingerprint(key: PageKey) -> u64 {
    key_hash(key).max(1)
}

/// Exact FIFO of at most `capacity` key fingerprints. See the module documentation.
#[derive(Debug)]
pub(crate) struct GhostFifo {
    /// Fingerprints oldest first from `head`, circularly; `used` positions from `head` are in
    /// use, some of them `DEAD`. Invariant: `ring[head]` is live whenever `live > 0`.
    ring: Vec<u64>,
    head: usize,
    used: usize,
    live: usize,
    capacity: usize,
    /// Ring position + 1 of each live entry; 0 = empty slot.
    index: Vec<u32>,
}

impl GhostFifo {
    /// An empty ghost queue for up to `capacity` keys. Precondition: `capacity < 2^31`.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        assert!(capacity < 1 << 31, "ghost queue too large");
        // `vec![0; n]` is calloc: untouched parts cost no memory until G fills.
        GhostFifo {
            ring: vec![DEAD; capacity + capacity / 4 + 1],
            head: 0,
            used: 0,
            live: 0,
            capacity,
            index: vec![0; 2 * capacity + 2],
        }
    }

    /// Number of keys remembered.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Remember `key` as the newest entry, forgetting the oldest if G is full.
    /// Precondition: `key` is not in G (the policy takes a key out of G when it returns).
    pub fn push(&mut self, key: PageKey) {
        let fp = fingerprint(key);
        if self.live == self.capacity {
            self.pop_oldest();
        }
        if self.used == self.ring.len() {
            self.compact();
        }
        let pos = (self.head + self.used) % self.ring.len();
        self.ring[pos] = fp;
        self.used += 1;
        self.live += 1;
        self.index_insert(fp, pos);
    }

    /// If `key` is in G, take it out and return true (a ghost hit).
    pub fn take(&mut self, key: PageKey) -> bool {
        let Some(i) = self.find(fingerprint(key)) else { return false };
        self.remove_at(i);
        true
    }

    /// Whether `key` is in G (tests and diagnostics).
    #[cfg(test)]
    pub fn contains(&self, key: PageKey) -> bool {
        self.find(fingerprint(key)).is_some()
    }

    /// Forget the oldest entry. Precondition: `live > 0`.
    fn pop_oldest(&mut self) {
        let i = self.find(self.ring[self.head]).expect("ghost ring and index agree");
        self.remove_at(i);
    }

    /// Take out the live entry recorded in index slot `i`: its ring position becomes `DEAD`.
    fn remove_at(&mut self, i: usize) {
        let pos = self.index[i] as usize - 1;
        self.index_delete(i);
        self.ring[pos] = DEAD;
        self.live -= 1;
        self.skip_dead();
    }

    /// Move `head` past dead entries (restores the invariant on `ring[head]`).
    fn skip_dead(&mut self) {
        while self.used > 0 && self.ring[self.head] == DEAD {
            self.head = (self.head + 1) % self.ring.len();
            self.used -= 1;
        }
    }

    /// Rewrite the ring with its live entries only, oldest at 0, and rebuild the index.
    fn compact(&mut self) {
        let n = self.ring.len();
        let live: Vec<u64> = (0..self.used).map(|k| self.ring[(self.head + k) % n]).filter(|&fp| fp != DEAD).collect();
        debug_assert_eq!(live.len(), self.live);
        self.ring.fill(DEAD);
        self.index.fill(0);
        for (pos, &fp) in live.iter().enumerate() {
            self.ring[pos] = fp;
            self.index_insert(fp, pos);
        }
        self.head = 0;
        self.used = live.len();
    }

    /// Home slot of `fp` in the index (multiply-shift onto `0..index.len()`).
    fn home(&self, fp: u64) -> usize {
        ((u128::from(fp) * self.index.len() as u128) >> 64) as usize
    }

    /// The index slot of the live entry with fingerprint `fp`.
    fn find(&self, fp: u64) -> Option<usize> {
        let n = self.index.len();
        let mut i = self.home(fp);
        loop {
            match self.index[i] {
                0 => return None,
                e if self.ring[e as usize - 1] == fp => return Some(i),
                _ => i = (i + 1) % n,
            }
        }
    }

    /// Record that ring position `pos` holds `fp`. Load ≤ 1/2, so an empty slot is near.
    fn index_insert(&mut self, fp: u64, pos: usize) {
        let n = self.index.len();
        let mut i = self.home(fp);
        while self.index[i] != 0 {
            i = (i + 1) % n;
        }
        self.index[i] = pos as u32 + 1;
    }

    /// Empty index slot `i`, shifting later entries of its probe run back (Knuth's algorithm
    /// R for linear probing), so lookups never meet a hole inside a run.
    fn index_delete(&mut self, i: usize) {
        let n = self.index.len();
        let mut hole = i;
        let mut j = (i + 1) % n;
        loop {
            let e = self.index[j];
            if e == 0 {
                break;
            }
            let h = self.home(self.ring[e as usize - 1]);
            // The entry at `j` may fill the hole unless its home lies cyclically in (hole, j].
            let home_after_hole = if hole <= j { hole < h && h <= j } else { hole < h || h <= j };
            if !home_after_hole {
                self.index[hole] = e;
                hole = j;
            }
            j = (j + 1) % n;
        }
        self.index[hole] = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SplitMix64;
    use std::collections::VecDeque;

    fn k(i: u64) -> PageKey {
        PageKey { object: i % 7, index: i }
    }

    /// Against a `VecDeque` doing the same FIFO by linear search, over random pushes and hits
    /// at several capacities (compactions, wrap-arounds and backward shifts included).
    #[test]
    fn matches_a_naive_fifo() {
        for capacity in [1usize, 2, 3, 5, 8, 33, 200] {
            let mut rng = SplitMix64::new(capacity as u64);
            let mut g = GhostFifo::new(capacity);
            let mut naive: VecDeque<PageKey> = VecDeque::new();
            let universe = (capacity as u64) * 3 + 2;
            for _ in 0..20_000 {
                let key = k(rng.below(universe));
                let was = naive.iter().position(|&x| x == key);
                assert_eq!(g.contains(key), was.is_some(), "capacity {capacity}");
                if rng.below(3) == 0 {
                    assert_eq!(g.take(key), was.is_some());
                    if let Some(p) = was {
                        naive.remove(p);
                    }
                } else if was.is_none() {
                    g.push(key);
                    if naive.len() == capacity {
                        naive.pop_front();
                    }
                    naive.push_back(key);
                }
                assert_eq!(g.len(), naive.len());
            }
            for &key in &naive {
                assert!(g.contains(key));
            }
        }
    }

    /// The ring never grows: a long run of push-and-hit compacts instead.
    #[test]
    fn hits_do_not_grow_the_ring() {
        let mut g = GhostFifo::new(4);
        let ring = g.ring.len();
        g.push(k(1_000_000));
        for i in 0..10_000 {
            g.push(k(i));
            assert!(g.take(k(i)));
        }
        assert_eq!(g.ring.len(), ring);
        assert!(g.contains(k(1_000_000)) && g.len() == 1);
    }
}

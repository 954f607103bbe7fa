//! Promised zeros: blocks inside an aead file's length that no put has stored yet.
//!
//! The cache writes a file back from several threads, and a file written past its end (the
//! zstd layer appending extents, a program seeking forward) reaches this pager out of order:
//! the put of blocks 20..22 may come before the put of 12..20. Stored blocks must be
//! authentic, so a gap cannot be left as a hole in the store; it used to be filled with
//! encrypted zero blocks at once, under the exclusive lock — work thrown away when the put of
//! 12..20 arrived a moment later, and every other put of the file stopped meanwhile (a third
//! of the puts of a sequential write through `dir | aead | zstd` did that). Now the gap is
//! recorded here and reads as zeros; it is filled only when the header is brought up to date
//! (`sync`, a publish, `set_len`), if a put has not filled it by then. The header never
//! carries a length that covers a gap (see `EncryptPager::write_header`), so what is on the
//! store is always a complete aead file of the header's length.

use std::collections::BTreeMap;
use std::ops::Range;

/// The gaps of one file and how far its blocks are accounted for. Every block below `end`
/// is stored, being stored by a put in flight, or in a gap; none at or past `end` is.
#[derive(Debug, Default)]
pub(super) struct Gaps {
    /// Disjoint, non-adjacent ranges of block indexes: start → end.
    ranges: BTreeMap<u64, u64>,
    end: u64,
    /// Blocks that were not stored before a put in flight took them (`take`, until
    /// `finish`): start → number of puts. Not stored yet either, so no header may cover them.
    pending: BTreeMap<u64, u32>,
}

impl Gaps {
    /// A file whose blocks below `end` are all stored.
    pub(super) fn new(end: u64) -> Gaps {
        Gaps { ranges: BTreeMap::new(), end, pending: BTreeMap::new() }
    }

    /// No gap and no put in flight into one: every block below the end is stored.
    pub(super) fn is_settled(&self) -> bool {
        self.ranges.is_empty() && self.pending.is_empty()
    }

    /// Whether reads must look here (a gap exists).
    pub(super) fn has_gaps(&self) -> bool {
        !self.ranges.is_empty()
    }

    /// The lowest block that is not known to be stored: every block below it is (or is
    /// being overwritten by a put, as any stored block may be).
    pub(super) fn first_unstored(&self) -> Option<u64> {
        let g = self.ranges.keys().next().copied();
        let p = self.pending.keys().next().copied();
        match (g, p) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Blocks `a..b` are about to be stored by one put: a gap opens between the accounted
    /// end and `a`, and `a..b` leave the gaps. Returns the blocks of `a..b` that were not
    /// stored before (a gap or past the end): what a failed put gives back (`give_back`).
    pub(super) fn take(&mut self, a: u64, b: u64) -> Vec<Range<u64>> {
        let mut fresh = Vec::new();
        if a >= b {
            return fresh;
        }
        if a > self.end {
            self.add(self.end, a);
        }
        for r in self.remove(a, b.min(self.end)) {
            fresh.push(r);
        }
        if b > self.end {
            fresh.push(self.end.max(a)..b);
            self.end = b;
        }
        for r in &fresh {
            *self.pending.entry(r.start).or_default() += 1;
        }
        fresh
    }

    /// The put that took `fresh` (returned by `take`) is over: its blocks are stored, or,
    /// if it failed, they are gaps again.
    pub(super) fn finish(&mut self, fresh: Vec<Range<u64>>, stored: bool) {
        for r in fresh {
            if let Some(n) = self.pending.get_mut(&r.start) {
                *n -= 1;
                if *n == 0 {
                    self.pending.remove(&r.start);
                }
            }
            if !stored {
                self.add(r.start, r.end);
            }
        }
    }

    /// The gaps overlapping blocks `a..b`, clipped to it.
    pub(super) fn within(&self, a: u64, b: u64) -> Vec<Range<u64>> {
        let mut out = Vec::new();
        if a >= b {
            return out;
        }
        if let Some((_, &e)) = self.ranges.range(..a).next_back()
            && e > a
        {
            out.push(a..e.min(b));
        }
        for (&s, &e) in self.ranges.range(a..b) {
            out.push(s..e.min(b));
        }
        out
    }

    pub(super) fn contains(&self, i: u64) -> bool {
        self.ranges.range(..=i).next_back().is_some_and(|(_, &e)| e > i)
    }

    /// The file is `blocks` blocks long and no put is in flight (exclusive lock): forget
    /// what lies past it (blocks of failed puts past the length, or cut off), and take out
    /// and return the gaps below it, for the caller to fill (or give back with
    /// `give_back` if it cannot).
    pub(super) fn settle(&mut self, blocks: u64) -> Vec<Range<u64>> {
        debug_assert!(self.pending.is_empty(), "settle with a put in flight");
        self.remove(blocks, u64::MAX);
        self.end = blocks;
        let out: Vec<Range<u64>> = self.ranges.iter().map(|(&s, &e)| s..e).collect();
        self.ranges.clear();
        out
    }

    /// Filling `ranges` (from `settle`) failed: they are gaps again.
    pub(super) fn give_back(&mut self, ranges: &[Range<u64>]) {
        for r in ranges {
            self.add(r.start, r.end);
        }
    }

    /// Add `a..b` to the gaps, merging with neighbours.
    fn add(&mut self, mut a: u64, mut b: u64) {
        if a >= b {
            return;
        }
        if let Some((&s, &e)) = self.ranges.range(..=a).next_back()
            && e >= a
        {
            a = s;
            b = b.max(e);
            self.ranges.remove(&s);
        }
        while let Some((&s, &e)) = self.ranges.range(a..=b).next() {
            b = b.max(e);
            self.ranges.remove(&s);
        }
        self.ranges.insert(a, b);
    }

    /// Remove `a..b` from the gaps; returns the parts that were gaps.
    fn remove(&mut self, a: u64, b: u64) -> Vec<Range<u64>> {
        let mut out = Vec::new();
        if a >= b {
            return out;
        }
        if let Some((&s, &e)) = self.ranges.range(..a).next_back()
            && e > a
        {
            self.ranges.insert(s, a);
            if e > b {
                self.ranges.insert(b, e);
                out.push(a..b);
                return out;
            }
            out.push(a..e);
        }
        let inside: Vec<(u64, u64)> = self.ranges.range(a..b).map(|(&s, &e)| (s, e)).collect();
        for (s, e) in inside {
            self.ranges.remove(&s);
            if e > b {
                self.ranges.insert(b, e);
                out.push(s..b);
            } else {
                out.push(s..e);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng, rngs::StdRng};

    /// Per block: stored (true) or a gap (false); `end` the accounted length.
    #[derive(Clone)]
    struct Model {
        stored: Vec<bool>,
    }

    fn check(g: &Gaps, m: &Model) {
        assert_eq!(g.end as usize, m.stored.len());
        for (i, &s) in m.stored.iter().enumerate() {
            assert_eq!(g.contains(i as u64), !s, "block {i}: {g:?}");
        }
        let mut prev_end = None;
        for (&s, &e) in &g.ranges {
            assert!(s < e && e <= g.end, "{g:?}");
            if let Some(p) = prev_end {
                assert!(s > p, "ranges must be disjoint and not adjacent: {g:?}");
            }
            prev_end = Some(e);
        }
        let listed: usize = g.within(0, u64::MAX).iter().map(|r| (r.end - r.start) as usize).sum();
        assert_eq!(listed, m.stored.iter().filter(|&&s| !s).count());
        assert_eq!(g.first_unstored(), m.stored.iter().position(|&s| !s).map(|i| i as u64));
    }

    #[test]
    fn random_puts_failures_and_settles_match_a_block_model() {
        for seed in 0..200 {
            let mut rng = StdRng::seed_from_u64(seed);
            let start = rng.random_range(0..8u64);
            let mut g = Gaps::new(start);
            let mut m = Model { stored: vec![true; start as usize] };
            for _ in 0..60 {
                match rng.random_range(0..10) {
                    0..7 => {
                        let a = rng.random_range(0..m.stored.len() as u64 + 12);
                        let b = a + rng.random_range(1..6);
                        let before = m.clone();
                        let fresh = g.take(a, b);
                        if m.stored.len() < b as usize {
                            m.stored.resize(b as usize, false);
                        }
                        // What was not stored before in a..b is exactly what `take` returned.
                        let mut expect = Vec::new();
                        for i in a..b {
                            if before.stored.get(i as usize) != Some(&true) {
                                expect.push(i);
                            }
                        }
                        let got: Vec<u64> = fresh.iter().flat_map(|r| r.clone()).collect();
                        assert_eq!(got, expect, "seed {seed}: take({a}, {b})");
                        // In flight, nothing at or past the first fresh block may be
                        // covered by a header.
                        if let Some(&f) = expect.first() {
                            assert!(g.first_unstored().is_some_and(|u| u <= f), "seed {seed}");
                        }
                        if rng.random_bool(0.2) {
                            g.finish(fresh, false);
                            for i in expect {
                                m.stored[i as usize] = false;
                            }
                        } else {
                            g.finish(fresh, true);
                            for i in a..b {
                                m.stored[i as usize] = true;
                            }
                        }
                        assert!(g.pending.is_empty());
                    }
                    7 => {
                        let a = rng.random_range(0..m.stored.len() as u64 + 2);
                        let b = a + rng.random_range(0..8);
                        let w = g.within(a, b);
                        let got: Vec<u64> = w.iter().flat_map(|r| r.clone()).collect();
                        let want: Vec<u64> =
                            (a..b).filter(|&i| m.stored.get(i as usize).is_some_and(|&s| !s)).collect();
                        assert_eq!(got, want, "seed {seed}: within({a}, {b})");
                    }
                    _ => {
                        let n = rng.random_range(0..m.stored.len() as u64 + 3);
                        let filled = g.settle(n);
                        m.stored.resize(n as usize, true);
                        let got: Vec<u64> = filled.iter().flat_map(|r| r.clone()).collect();
                        let want: Vec<u64> = (0..n).filter(|&i| !m.stored[i as usize]).collect();
                        assert_eq!(got, want, "seed {seed}: settle({n})");
                        if rng.random_bool(0.3) {
                            g.give_back(&filled); // the fill failed
                        } else {
                            m.stored.iter_mut().for_each(|s| *s = true);
                        }
                        assert_eq!(g.is_settled(), m.stored.iter().all(|&s| s));
                    }
                }
                check(&g, &m);
            }
        }
    }
}

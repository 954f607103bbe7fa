//! Randomized model test of the cache/policy contract, for every policy.
//!
//! A fake cache drives random inserts (demand and read-ahead, re-using keys so ghosts and
//! re-admissions happen), removals (by the slot kept at insert: live, stale or never given), hits, pins, pages dropped behind
//! the policy's back (the truncation race), concurrent-looking hits that re-set counters while
//! the policy scans, and random `Unavailable` answers. After every operation it checks:
//! * `select_victim` returns only the one page it took (`Taken`), and takes nothing it then
//!   fails to return;
//! * the returned key was tracked (never a removed, evicted or forgotten key);
//! * `len` is exact (tracked = inserted - removed - evicted - reported `Gone`/`None`);
//! * each call terminates within a linear number of probes;
//! * `None` only after every tracked page was offered `try_evict` and refused.
//!
//! At the end all pages become available, and every tracked page must come out.

use std::collections::{BTreeMap, BTreeSet};

use ubc_evict::sim::SplitMix64;
use ubc_evict::{Admission, EvictAttempt, EvictionPolicy, PageKey, PageProbe, PolicyKind, Slot};

/// The fake cache's state of one page.
#[derive(Clone, Copy, Default, Debug)]
struct Page {
    accesses: u8,
    pinned: bool,
}

/// Fake cache + expectations about the policy.
struct Fake {
    rng: SplitMix64,
    /// Pages resident in the fake cache.
    pages: BTreeMap<PageKey, Page>,
    /// Keys the policy must currently be tracking.
    tracked: BTreeSet<PageKey>,
    /// Probability (percent) that an available page answers `Unavailable` anyway (busy).
    busy_percent: u64,
    /// Probability (percent) that `take_accesses` finds fresh hits (a concurrent hit path).
    racing_hits_percent: u64,
    /// Probability (percent) that a page is truncated just as `try_evict` looks at it.
    truncate_percent: u64,
    // Per select_victim call:
    taken: Vec<PageKey>,
    refused: BTreeSet<PageKey>,
    probes: usize,
}

impl PageProbe for Fake {
    /// Return and clear the counter; sometimes pretend hits raced in.
    fn take_accesses(&mut self, key: PageKey) -> Option<u8> {
        self.probes += 1;
        assert!(!self.taken.contains(&key), "probed {key:?} after taking it");
        let racing = self.rng.below(100) < self.racing_hits_percent;
        let extra = if racing { 1 + self.rng.below(3) as u8 } else { 0 };
        match self.pages.get_mut(&key) {
            None => {
                // The policy must forget it now.
                self.tracked.remove(&key);
                None
            }
            Some(p) => Some((std::mem::take(&mut p.accesses) + extra).min(3)),
        }
    }

    /// Gone if not resident (or truncated right now, at random), Unavailable if pinned or
    /// (randomly) busy, else Taken.
    fn try_evict(&mut self, key: PageKey) -> EvictAttempt {
        self.probes += 1;
        assert!(!self.taken.contains(&key), "tried {key:?} after taking it");
        if self.rng.below(100) < self.truncate_percent {
            self.pages.remove(&key); // truncated between take_accesses and try_evict
        }
        match self.pages.get(&key) {
            None => {
                self.tracked.remove(&key);
                EvictAttempt::Gone
            }
            Some(p) if p.pinned || self.rng.below(100) < self.busy_percent => {
                self.refused.insert(key);
                EvictAttempt::Unavailable
            }
            Some(_) => {
                self.pages.remove(&key);
                self.taken.push(key);
                EvictAttempt::Taken
            }
        }
    }
}

impl Fake {
    /// Call `select_victim` and check everything the contract promises about the call.
    fn select(&mut self, policy: &mut dyn EvictionPolicy) -> Option<PageKey> {
        let tracked_before = self.tracked.clone();
        self.taken.clear();
        self.refused.clear();
        self.probes = 0;
        let victim = policy.select_victim(self);
        // Linear work per call, whatever the answers (a loose bound on every policy here).
        assert!(
            self.probes <= 16 * tracked_before.len() + 32,
            "{}: {} probes for {} pages",
            policy.name(),
            self.probes,
            tracked_before.len()
        );
        match victim {
            Some(v) => {
                assert_eq!(self.taken, [v], "{}: must return exactly the page it took", policy.name());
                assert!(tracked_before.contains(&v), "{}: returned untracked {v:?}", policy.name());
                self.tracked.remove(&v);
            }
            None => {
                assert!(self.taken.is_empty(), "{}: took a page and returned None", policy.name());
                for k in &self.tracked {
                    assert!(self.refused.contains(k), "{}: None but {k:?} was never offered", policy.name());
                }
            }
        }
        assert_eq!(policy.len(), self.tracked.len(), "{}: len", policy.name());
        victim
    }
}

/// One random run of `steps` operations against `kind`, from `seed`.
fn run(kind: PolicyKind, seed: u64, steps: usize) {
    let mut rng = SplitMix64::new(seed);
    let universe = 4 + rng.below(60);
    let capacity = 1 + rng.below(universe) as usize;
    let mut policy = kind.build(capacity);
    let mut fake = Fake {
        rng: SplitMix64::new(seed ^ 0xdead_beef),
        pages: BTreeMap::new(),
        tracked: BTreeSet::new(),
        busy_percent: [0, 5, 30][rng.below(3) as usize],
        racing_hits_percent: [0, 10, 90][rng.below(3) as usize],
        truncate_percent: [0, 3][rng.below(2) as usize],
        taken: Vec::new(),
        refused: BTreeSet::new(),
        probes: 0,
    };
    // The slot the policy gave each key at its latest insert, as the cache keeps it.
    let mut slots: BTreeMap<PageKey, Slot> = BTreeMap::new();
    let key = |rng: &mut SplitMix64| PageKey { object: rng.below(2), index: rng.below(universe / 2 + 1) };
    for _ in 0..steps {
        match rng.below(100) {
            // Fill a page that the policy is not tracking (it may be in a ghost).
            0..35 => {
                let k = key(&mut rng);
                if fake.tracked.contains(&k) || fake.pages.contains_key(&k) {
                    continue;
                }
                if fake.tracked.len() >= capacity && fake.select(policy.as_mut()).is_none() {
                    continue; // everything pinned: the cache would wait
                }
                let adm = if rng.below(4) == 0 { Admission::ReadAhead } else { Admission::Demand };
                fake.pages.insert(k, Page::default());
                slots.insert(k, policy.insert(k, adm));
                fake.tracked.insert(k);
            }
            // Hits.
            35..60 => {
                let k = key(&mut rng);
                if let Some(p) = fake.pages.get_mut(&k) {
                    p.accesses = (p.accesses + 1).min(3);
                }
            }
            // The cache drops a page and tells the policy, with the slot it kept for the page
            // (stale when the policy forgot the page meanwhile; a random one for a key never
            // filled): a no-op unless the slot still holds the key.
            60..67 => {
                let k = key(&mut rng);
                fake.pages.remove(&k);
                let slot = slots.get(&k).copied().unwrap_or(rng.below(2 * capacity as u64 + 2) as Slot);
                policy.remove(slot, k);
                fake.tracked.remove(&k);
            }
            // The cache drops a page without telling the policy yet (truncation race).
            67..70 => {
                let k = key(&mut rng);
                fake.pages.remove(&k);
            }
            // Pin / unpin / dirty / clean.
            70..80 => {
                let k = key(&mut rng);
                if let Some(p) = fake.pages.get_mut(&k) {
                    p.pinned = !p.pinned;
                }
            }
            // Memory pressure: evict.
            _ => {
                fake.select(policy.as_mut());
            }
        }
        assert_eq!(policy.len(), fake.tracked.len(), "{kind}: len after an operation");
    }
    // Drain: everything becomes available; every tracked page must come out, then None.
    fake.busy_percent = 0;
    fake.truncate_percent = 0;
    for p in fake.pages.values_mut() {
        p.pinned = false;
    }
    let mut out = BTreeSet::new();
    let expected: BTreeSet<PageKey> = fake.tracked.iter().copied().filter(|k| fake.pages.contains_key(k)).collect();
    while let Some(v) = fake.select(policy.as_mut()) {
        assert!(out.insert(v), "{kind}: returned {v:?} twice");
    }
    assert_eq!(out, expected, "{kind}: drain must return every available tracked page");
    assert!(policy.is_empty(), "{kind}: empty after the drain");
    assert!(fake.tracked.is_empty(), "{kind}: pages dropped behind its back were found Gone");
}

#[test]
fn clock_contract() {
    for seed in 0..300 {
        run(PolicyKind::Clock, seed, 1500);
    }
}

#[test]
fn sieve_contract() {
    for seed in 0..300 {
        run(PolicyKind::Sieve, seed, 1500);
    }
}

#[test]
fn s3fifo_contract() {
    for seed in 0..300 {
        run(PolicyKind::S3Fifo, seed, 1500);
    }
}

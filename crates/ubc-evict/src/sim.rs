//! Trace-driven simulator: hit ratios of the policies (and of exact LRU) on synthetic traces.
//!
//! A trace is a sequence of [`PageKey`] accesses. [`PolicySim`] models the cache around an
//! [`EvictionPolicy`] the way ubc drives it: the resident set keeps a saturating 2-bit access
//! counter per page that a hit bumps *without* calling the policy; a miss on a full cache
//! calls [`EvictionPolicy::select_victim`] (through a [`PageProbe`] over those counters, on
//! which every resident page is always takeable), drops the victim, and inserts the new page
//! with [`Admission::Demand`]. The simulator also checks the policy's side of the contract:
//! the victim must be the one page it took, and `len` must match the resident set.
//!
//! [`LruSim`] is exact LRU (a list update per hit) with the same `simulate` interface; it is
//! the reference, not a live policy (see the crate docs for why).
//!
//! Workload generators are seeded and deterministic (SplitMix64 + a Zipf sampler over a
//! precomputed CDF), so results are reproducible across runs and machines:
//! [`loop_scan`], [`zipf`], [`scan_mix`], [`shifting`], [`db_mix`]; [`standard_workloads`]
//! sizes all of them relative to a cache capacity.

use crate::list::{Arena, KeyMap, List, key_map};
use crate::{Admission, EvictAttempt, EvictionPolicy, PageKey, PageProbe, PolicyKind};

/// Counters from one simulation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Accesses simulated.
    pub accesses: u64,
    /// Accesses that found the page resident.
    pub hits: u64,
    /// Pages evicted to make room.
    pub evictions: u64,
    /// Calls the policy made into the probe (`take_accesses` + `try_evict`): its work.
    pub probes: u64,
}

impl SimStats {
    /// The counters accumulated since `before` (an earlier copy of these).
    fn since(&self, before: SimStats) -> SimStats {
        SimStats {
            accesses: self.accesses - before.accesses,
            hits: self.hits - before.hits,
            evictions: self.evictions - before.evictions,
            probes: self.probes - before.probes,
        }
    }

    /// Fraction of accesses that hit (0 for an empty trace).
    pub fn hit_ratio(&self) -> f64 {
        if self.accesses == 0 { 0.0 } else { self.hits as f64 / self.accesses as f64 }
    }

    /// Accesses that missed.
    pub fn misses(&self) -> u64 {
        self.accesses - self.hits
    }
}

/// The simulated cache's page state: resident pages and their 2-bit access counters.
struct Resident {
    counters: KeyMap<u8>,
    /// Pages the policy took during the current `select_victim` call.
    taken: Vec<PageKey>,
    probes: u64,
}

impl PageProbe for Resident {
    /// Return and clear the page's counter; `None` if not resident.
    fn take_accesses(&mut self, key: PageKey) -> Option<u8> {
        self.probes += 1;
        self.counters.get_mut(&key).map(std::mem::take)
    }

    /// Every resident page is takeable (no pins or dirty pages in the simulator).
    fn try_evict(&mut self, key: PageKey) -> EvictAttempt {
        self.probes += 1;
        if self.counters.remove(&key).is_some() {
            self.taken.push(key);
            EvictAttempt::Taken
        } else {
            EvictAttempt::Gone
        }
    }
}

/// A cache of fixed capacity (in pages) run by an [`EvictionPolicy`].
pub struct PolicySim {
    policy: Box<dyn EvictionPolicy>,
    capacity: usize,
    resident: Resident,
    stats: SimStats,
}

impl PolicySim {
    /// A cold cache of `capacity` pages managed by `policy`. Precondition: `capacity > 0` and
    /// the policy tracks no pages.
    pub fn new(policy: Box<dyn EvictionPolicy>, capacity: usize) -> Self {
        assert!(capacity > 0, "capacity must be positive");
        assert!(policy.is_empty(), "policy must start empty");
        PolicySim {
            policy,
            capacity,
            resident: Resident { counters: key_map(capacity), taken: Vec::new(), probes: 0 },
            stats: SimStats::default(),
        }
    }

    /// Simulate one access; returns true on a hit. Panics if the policy breaks the contract.
    pub fn access(&mut self, key: PageKey) -> bool {
        self.stats.accesses += 1;
        if let Some(counter) = self.resident.counters.get_mut(&key) {
            // The hit path: bump the saturating counter, do not call the policy.
            *counter = (*counter + 1).min(3);
            self.stats.hits += 1;
            return true;
        }
        if self.resident.counters.len() >= self.capacity {
            let victim = self.policy.select_victim(&mut self.resident);
            let taken = std::mem::take(&mut self.resident.taken);
            match victim {
                Some(v) => assert_eq!(taken, [v], "{}: victim must be the page it took", self.policy.name()),
                None => panic!("{}: no victim although every page is takeable", self.policy.name()),
            }
            self.stats.evictions += 1;
        }
        self.resident.counters.insert(key, 0);
        self.policy.insert(key, Admission::Demand);
        assert_eq!(self.policy.len(), self.resident.counters.len(), "{}: len drifted", self.policy.name());
        self.stats.probes = self.resident.probes;
        false
    }

    /// Run `trace` and return the counters accumulated over this call.
    pub fn simulate(&mut self, trace: &[PageKey]) -> SimStats {
        let before = self.stats;
        for &key in trace {
            self.access(key);
        }
        self.stats.since(before)
    }

    /// Counters since construction.
    pub fn stats(&self) -> SimStats {
        self.stats
    }
}

/// Exact LRU over a fixed capacity: the reference model (updates a list on every hit).
pub struct LruSim {
    arena: Arena<()>,
    map: KeyMap<u32>,
    /// Recency order: front = least recently used.
    list: List,
    capacity: usize,
    stats: SimStats,
}

impl LruSim {
    /// A cold LRU cache of `capacity` pages. Precondition: `capacity > 0`.
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0, "capacity must be positive");
        LruSim {
            arena: Arena::with_capacity(capacity),
            map: key_map(capacity),
            list: List::new(),
            capacity,
            stats: SimStats::default(),
        }
    }

    /// Simulate one access; returns true on a hit.
    pub fn access(&mut self, key: PageKey) -> bool {
        self.stats.accesses += 1;
        if let Some(&slot) = self.map.get(&key) {
            self.arena.move_to_back(&mut self.list, slot);
            self.stats.hits += 1;
            return true;
        }
        if self.list.len() >= self.capacity
            && let Some(lru) = self.list.front()
        {
            let old = self.arena.get(lru).key;
            self.arena.unlink(&mut self.list, lru);
            self.arena.free(lru);
            self.map.remove(&old);
            self.stats.evictions += 1;
        }
        let slot = self.arena.alloc(key, ());
        self.arena.push_back(&mut self.list, slot);
        self.map.insert(key, slot);
        false
    }

    /// Run `trace` and return the counters accumulated over this call.
    pub fn simulate(&mut self, trace: &[PageKey]) -> SimStats {
        let before = self.stats;
        for &key in trace {
            self.access(key);
        }
        self.stats.since(before)
    }

    /// Counters since construction.
    pub fn stats(&self) -> SimStats {
        self.stats
    }
}

/// Something to simulate: exact LRU or one of the live policies.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Model {
    /// Exact LRU ([`LruSim`]).
    Lru,
    /// A live policy run by [`PolicySim`].
    Policy(PolicyKind),
}

impl Model {
    /// LRU first, then every policy.
    pub const ALL: [Model; 4] = [
        Model::Lru,
        Model::Policy(PolicyKind::Clock),
        Model::Policy(PolicyKind::Sieve),
        Model::Policy(PolicyKind::S3Fifo),
    ];

    /// Short name: "lru" or the policy's name.
    pub fn name(self) -> &'static str {
        match self {
            Model::Lru => "lru",
            Model::Policy(kind) => kind.name(),
        }
    }

    /// Run `trace` on a cold cache of `capacity` pages.
    pub fn simulate(self, capacity: usize, trace: &[PageKey]) -> SimStats {
        match self {
            Model::Lru => LruSim::new(capacity).simulate(trace),
            Model::Policy(kind) => PolicySim::new(kind.build(capacity), capacity).simulate(trace),
        }
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, good enough for workload generation.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator from `seed` (any value, including 0).
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, n) (Lemire's multiply-shift; the bias is < n / 2^64). Precondition: n > 0.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// Zipf distribution over ranks `0..n`: P(rank r) ∝ 1 / (r + 1)^alpha.
///
/// Sampled by binary search in a precomputed CDF: exact for any alpha (including 1.0) at
/// 8 bytes per rank, which is fine for the universes a simulation uses.
#[derive(Clone, Debug)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// Zipf over `n` ranks with exponent `alpha`. Precondition: n > 0, alpha >= 0.
    pub fn new(n: u64, alpha: f64) -> Self {
        assert!(n > 0 && alpha >= 0.0, "Zipf needs n > 0 and alpha >= 0");
        let mut cdf = Vec::with_capacity(n as usize);
        let mut sum = 0.0;
        for r in 0..n {
            sum += ((r + 1) as f64).powf(-alpha);
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Zipf { cdf }
    }

    /// Draw one rank in `0..n` (0 is the most popular).
    pub fn sample(&self, rng: &mut SplitMix64) -> u64 {
        let u = rng.next_f64();
        // First rank whose cumulative probability exceeds u; clamp against rounding at 1.0.
        (self.cdf.partition_point(|&c| c <= u) as u64).min(self.cdf.len() as u64 - 1)
    }
}

/// One named trace to run against a cache of `capacity` pages.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Short name, used as `policy_<name>` in benchmark records.
    pub name: &'static str,
    /// Cache size in pages the trace was designed for.
    pub capacity: usize,
    /// The accesses.
    pub trace: Vec<PageKey>,
}

/// Object ids used by the generators, so that workloads mixing streams never collide.
const OBJ_HOT: u64 = 1;
const OBJ_SCAN: u64 = 2;
const OBJ_LOG: u64 = 3;

/// A looping sequential scan over `pages` pages of one object, `accesses` long.
/// With `pages` > capacity this defeats LRU completely (every access misses).
pub fn loop_scan(pages: u64, accesses: usize) -> Vec<PageKey> {
    assert!(pages > 0);
    (0..accesses as u64).map(|i| PageKey { object: OBJ_SCAN, index: i % pages }).collect()
}

/// Independent Zipf(`alpha`) accesses over `universe` pages of one object.
pub fn zipf(universe: u64, alpha: f64, accesses: usize, seed: u64) -> Vec<PageKey> {
    let dist = Zipf::new(universe, alpha);
    let mut rng = SplitMix64::new(seed);
    (0..accesses).map(|_| PageKey { object: OBJ_HOT, index: dist.sample(&mut rng) }).collect()
}

/// Scan resistance: a hot Zipf(`alpha`) set of `hot_pages` pages (smaller than the cache)
/// alternating with one-time sequential scans.
///
/// The trace repeats: `hot_phase` hot accesses, then a scan of `scan_pages` never-seen pages
/// during which the application keeps running at a lower rate (one hot access per
/// `scan_per_hot` scan pages), as when a backup or a report reads a big file beside it.
pub fn scan_mix(
    hot_pages: u64,
    alpha: f64,
    hot_phase: usize,
    scan_pages: u64,
    scan_per_hot: u64,
    accesses: usize,
    seed: u64,
) -> Vec<PageKey> {
    let dist = Zipf::new(hot_pages, alpha);
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::with_capacity(accesses);
    let mut next_scan_page = 0u64;
    while out.len() < accesses {
        for _ in 0..hot_phase {
            out.push(PageKey { object: OBJ_HOT, index: dist.sample(&mut rng) });
        }
        for i in 0..scan_pages {
            out.push(PageKey { object: OBJ_SCAN, index: next_scan_page });
            next_scan_page += 1;
            if scan_per_hot > 0 && i % scan_per_hot == scan_per_hot - 1 {
                out.push(PageKey { object: OBJ_HOT, index: dist.sample(&mut rng) });
            }
        }
    }
    out.truncate(accesses);
    out
}

/// A shifting working set: Zipf(`alpha`) over `working_set` pages whose base moves by
/// `shift` pages every `phase` accesses, so yesterday's lukewarm pages become today's hot
/// ones and the old hottest pages go cold. Measures how fast a policy adapts.
pub fn shifting(working_set: u64, alpha: f64, shift: u64, phase: usize, accesses: usize, seed: u64) -> Vec<PageKey> {
    let dist = Zipf::new(working_set, alpha);
    let mut rng = SplitMix64::new(seed);
    (0..accesses)
        .map(|i| {
            let base = (i / phase) as u64 * shift;
            PageKey { object: OBJ_HOT, index: base + dist.sample(&mut rng) }
        })
        .collect()
}

/// A database-like mix over three files:
/// * 60%: index/row lookups, Zipf(1.0) over `index_pages` pages;
/// * 25%: a table scan, looping over `table_pages` pages (repeated full scans of a table
///   larger than the cache);
/// * 15%: appends to a log, each new log page written `records_per_page` times in a row and
///   never read again (a short burst of reuse that frequency-based policies can mistake for
///   popularity).
pub fn db_mix(index_pages: u64, table_pages: u64, records_per_page: u64, accesses: usize, seed: u64) -> Vec<PageKey> {
    let dist = Zipf::new(index_pages, 1.0);
    let mut rng = SplitMix64::new(seed);
    let (mut table_pos, mut log_record) = (0u64, 0u64);
    (0..accesses)
        .map(|_| match rng.below(100) {
            0..60 => PageKey { object: OBJ_HOT, index: dist.sample(&mut rng) },
            60..85 => {
                table_pos += 1;
                PageKey { object: OBJ_SCAN, index: table_pos % table_pages }
            }
            _ => {
                log_record += 1;
                PageKey { object: OBJ_LOG, index: log_record / records_per_page }
            }
        })
        .collect()
}

/// The standard set of workloads for a cache of `capacity` pages, each `accesses` long:
/// `loop_scan`, `zipf_0.8`, `zipf_1.0`, `scan_mix`, `shifting`, `db_mix`.
pub fn standard_workloads(capacity: usize, accesses: usize, seed: u64) -> Vec<Workload> {
    let c = capacity as u64;
    let w = |name, trace| Workload { name, capacity, trace };
    vec![
        // 1.5x the cache: LRU's worst case.
        w("loop_scan", loop_scan(c * 3 / 2, accesses)),
        // Universe 50x the cache.
        w("zipf_0.8", zipf(c * 50, 0.8, accesses, seed)),
        w("zipf_1.0", zipf(c * 50, 1.0, accesses, seed.wrapping_add(1))),
        // Hot set = 60% of the cache; every 4 cache-fulls of hot accesses, a scan of twice
        // the cache with one hot access per 4 scan pages.
        w("scan_mix", scan_mix(c * 3 / 5, 0.9, 4 * capacity, 2 * c, 4, accesses, seed.wrapping_add(2))),
        // Working set 2x the cache, moving by half a cache every 5 cache-fulls of accesses.
        w("shifting", shifting(2 * c, 0.9, c / 2, 5 * capacity, accesses, seed.wrapping_add(3))),
        // Index 4x the cache, table 3x the cache, 4 log records per page.
        w("db_mix", db_mix(4 * c, 3 * c, 4, accesses, seed.wrapping_add(4))),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_loop_larger_than_cache_never_hits() {
        let trace = loop_scan(15, 300);
        assert_eq!(LruSim::new(10).simulate(&trace).hits, 0);
        let fits = loop_scan(10, 300);
        assert_eq!(LruSim::new(10).simulate(&fits).hits, 290);
    }

    #[test]
    fn lru_evicts_least_recent() {
        let k = |i| PageKey { object: 0, index: i };
        let mut lru = LruSim::new(2);
        assert!(!lru.access(k(1)));
        assert!(!lru.access(k(2)));
        assert!(lru.access(k(1)));
        assert!(!lru.access(k(3))); // evicts 2
        assert!(lru.access(k(1)));
        assert!(!lru.access(k(2)));
    }

    #[test]
    fn zipf_matches_its_distribution() {
        let z = Zipf::new(100, 1.0);
        let mut rng = SplitMix64::new(7);
        let mut counts = [0u32; 100];
        let n = 200_000;
        for _ in 0..n {
            counts[z.sample(&mut rng) as usize] += 1;
        }
        let h: f64 = (1..=100).map(|r| 1.0 / r as f64).sum();
        for (r, &c) in counts.iter().enumerate().take(5) {
            let expect = n as f64 / ((r + 1) as f64 * h);
            assert!((c as f64 - expect).abs() < 0.05 * expect, "rank {r}: {c} vs {expect}");
        }
    }

    #[test]
    fn generators_are_deterministic() {
        assert_eq!(zipf(1000, 0.8, 100, 3), zipf(1000, 0.8, 100, 3));
        assert_ne!(zipf(1000, 0.8, 100, 3), zipf(1000, 0.8, 100, 4));
        assert_eq!(db_mix(100, 100, 4, 1000, 1), db_mix(100, 100, 4, 1000, 1));
        for w in standard_workloads(64, 5000, 1) {
            assert_eq!(w.trace.len(), 5000, "{}", w.name);
        }
    }

    #[test]
    fn policy_sim_checks_every_policy() {
        for w in standard_workloads(64, 20_000, 9) {
            for model in Model::ALL {
                let s = model.simulate(w.capacity, &w.trace);
                assert_eq!(s.accesses, 20_000);
                assert!(s.hits <= s.accesses);
            }
        }
    }
}

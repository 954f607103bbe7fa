//! Page replacement for ubc: which resident page leaves the cache next.
//!
//! One policy instance serves the whole cache (one budget, no per-file partition). The
//! cache calls it only on the slow paths — after a fill (`insert`), when a page leaves for
//! another reason (`remove`), and when it needs room (`select_victim`) — always under one
//! mutex. The cache-hit path never calls the policy: a hit only bumps a small saturating
//! access counter in the page's state word (CLOCK-style reference bits, as in NetBSD's
//! `uvm_pdaemon.c` and Linux's `PG_referenced`). A policy learns about hits when it asks the
//! cache through [`PageProbe::take_accesses`], which returns and clears that counter.
//!
//! This is why exact LRU is not offered as a live policy: it needs a list update on every
//! hit, i.e. a global lock on the hit path. The simulator in [`sim`] has an exact LRU as the
//! reference to measure against.
//!
//! Contract between cache and policy:
//! * `insert(key, ..)` is called exactly once per fill of a page, after the page is valid.
//!   The same key is never inserted twice without a `remove` or a victim selection between.
//!   It returns the page's [`Slot`]: the cache keeps it with the page's state, as Linux's
//!   `struct page` carries its own LRU links, so the policy needs no index from key to page
//!   (that index cost more than the rest of the per-page metadata together).
//! * `remove(slot, key)` forgets a page the cache dropped itself (truncation, invalidation,
//!   object teardown), given the slot `insert` returned for it. A slot that no longer holds
//!   `key` (the policy forgot the page meanwhile, and may have reused the slot) is a no-op.
//! * `select_victim` must return a key only after `probe.try_evict(key)` returned
//!   [`EvictAttempt::Taken`]; from then on the page belongs to the cache and the policy must
//!   have forgotten it. `Gone` means the page left the cache without the policy being told
//!   yet (a race with truncation): forget it. `Unavailable` means it is pinned, busy or dirty
//!   right now: keep it (the cache will clean dirty pages) and move on.
//! * `select_victim` returns `None` when a full pass finds nothing it may take.
//!
//! Policies (all O(1) amortized per operation: an arena of nodes on intrusive lists, 32 bytes
//! a page; choose one with [`PolicyKind`]):
//! * [`S3Fifo`] (default) — small/main/ghost FIFOs, scan resistant (SOSP'23);
//! * [`Sieve`] — one FIFO with a sifting hand (NSDI'24);
//! * [`Clock`] — second chance, an LRU approximation.
//!
//! [`sim`] replays traces against them and against exact LRU; `examples/policy_sim.rs`
//! prints the comparison the default was chosen from.

/// Identifies one cached page: the object (file) and the page index within it.
#[derive(Copy, Clone, Eq, PartialEq, Hash, Debug, PartialOrd, Ord)]
pub struct PageKey {
    pub object: u64,
    pub index: u64,
}

/// Where a policy keeps one page: returned by [`EvictionPolicy::insert`], handed back to
/// [`EvictionPolicy::remove`]. Valid until the page is removed or chosen as a victim.
pub type Slot = u32;

/// A slot value no policy returns: "this page is not in the policy".
pub const NO_SLOT: Slot = u32::MAX;

/// How a page entered the cache.
#[derive(Copy, Clone, Eq, PartialEq, Debug)]
pub enum Admission {
    /// Filled because someone asked for it (read miss, write, fault).
    Demand,
    /// Filled speculatively by read-ahead; worth less than a page that was used.
    ReadAhead,
}

/// The outcome of trying to take a page for eviction.
#[derive(Copy, Clone, Eq, PartialEq, Debug)]
pub enum EvictAttempt {
    /// The page is now locked for eviction; the policy must forget it and return it.
    Taken,
    /// The page is no longer cached; forget it.
    Gone,
    /// Pinned, under I/O or dirty: cannot be taken now; keep it.
    Unavailable,
}

/// The policy's view of the cache's per-page state.
pub trait PageProbe {
    /// Accesses since the previous call for this page (saturating at 3), and clears them.
    /// Every access is reported, including the first use of a page admitted by read-ahead;
    /// policies discount that one themselves.
    /// `None` if the page is no longer cached.
    fn take_accesses(&mut self, key: PageKey) -> Option<u8>;
    /// Try to take the page for eviction (see [`EvictAttempt`]).
    fn try_evict(&mut self, key: PageKey) -> EvictAttempt;
}

/// A page replacement policy. See the module documentation for the contract.
pub trait EvictionPolicy: Send {
    /// Short name for statistics and reports ("s3fifo", "sieve", "clock").
    fn name(&self) -> &'static str;
    /// A page was filled and is now valid; returns where the policy keeps it.
    fn insert(&mut self, key: PageKey, admission: Admission) -> Slot;
    /// The cache dropped this page itself; forget it. No-op unless `slot` (from `insert`)
    /// still holds `key`.
    fn remove(&mut self, slot: Slot, key: PageKey);
    /// Choose a page to evict; see the contract above.
    fn select_victim(&mut self, probe: &mut dyn PageProbe) -> Option<PageKey>;
    /// Number of pages the policy tracks.
    fn len(&self) -> usize;
    /// True when no pages are tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

mod ghost;
mod list;
mod queue;
#[cfg(test)]
mod testprobe;

pub mod clock;
pub mod s3fifo;
pub mod sieve;
pub mod sim;

pub use clock::Clock;
pub use s3fifo::{S3Fifo, S3FifoParams};
pub use sieve::Sieve;

/// The policies this crate offers, for configuration and statistics.
///
/// The default is S3-FIFO, chosen by measurement with the simulator in [`sim`] (see
/// `examples/policy_sim.rs` and the acceptance test `tests/acceptance.rs`): it has the best
/// hit ratio of the three on Zipf, scan-polluted and database-like mixes, and it is the only
/// one that survives a loop slightly larger than the cache (where LRU, CLOCK and SIEVE hit
/// nothing). Its weak spot is a fast-shifting working set, where LRU and CLOCK adapt faster.
#[derive(Copy, Clone, Eq, PartialEq, Hash, Debug, Default)]
pub enum PolicyKind {
    /// [`S3Fifo`]: small + main + ghost FIFOs (SOSP'23).
    #[default]
    S3Fifo,
    /// [`Sieve`]: one FIFO and a sifting hand (NSDI'24).
    Sieve,
    /// [`Clock`]: second chance.
    Clock,
}

impl PolicyKind {
    /// Every policy, default first.
    pub const ALL: [PolicyKind; 3] = [PolicyKind::S3Fifo, PolicyKind::Sieve, PolicyKind::Clock];

    /// Construct the policy for a cache of `capacity_pages` pages.
    pub fn build(self, capacity_pages: usize) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::S3Fifo => Box::new(S3Fifo::new(capacity_pages)),
            PolicyKind::Sieve => Box::new(Sieve::new(capacity_pages)),
            PolicyKind::Clock => Box::new(Clock::new(capacity_pages)),
        }
    }

    /// The policy's short name, identical to [`EvictionPolicy::name`] of what `build` makes.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::S3Fifo => "s3fifo",
            PolicyKind::Sieve => "sieve",
            PolicyKind::Clock => "clock",
        }
    }
}

impl std::fmt::Display for PolicyKind {
    /// Writes the short name ("s3fifo", "sieve", "clock").
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Error from parsing a [`PolicyKind`]: the name is not one of "s3fifo", "sieve", "clock".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownPolicy(pub String);

impl std::fmt::Display for UnknownPolicy {
    /// Names the rejected input and the accepted ones.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unknown eviction policy {:?} (expected s3fifo, sieve or clock)", self.0)
    }
}

impl std::error::Error for UnknownPolicy {}

impl std::str::FromStr for PolicyKind {
    type Err = UnknownPolicy;

    /// Parse a short name, case-insensitively; "s3-fifo" is accepted as a spelling of "s3fifo".
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "s3fifo" | "s3-fifo" => Ok(PolicyKind::S3Fifo),
            "sieve" => Ok(PolicyKind::Sieve),
            "clock" => Ok(PolicyKind::Clock),
            _ => Err(UnknownPolicy(s.to_string())),
        }
    }
}

#[cfg(test)]
mod kind_tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.to_string().parse::<PolicyKind>(), Ok(kind));
            assert_eq!(kind.build(8).name(), kind.name());
        }
        assert_eq!("S3-FIFO".parse::<PolicyKind>(), Ok(PolicyKind::S3Fifo));
        assert!("lru".parse::<PolicyKind>().is_err());
    }
}

//! Statistics: plain structs any front end can print, and the sharded counters behind them.
//!
//! Hits are counted on the hit path, so they must not become a shared cache line that every
//! reading thread writes: an object read by several threads counts them in cache-line-sized
//! shards, a thread always in the same one (see `Counters`). Only event counters (which only
//! grow) are sharded: a sum of shards read one by one is then between the totals at the
//! start and the end of the read. Gauges (resident and dirty pages, the flusher's unclean count) go up on one
//! thread and down on another, so they are single atomics, counted in before the page
//! state change that lets anyone count them out (see `Object::dirty`): never below zero.

use crossbeam_utils::CachePadded;
use std::cell::Cell;
// Set-once boxes in one pointer each (a `OnceLock` of a box takes two words).
use once_cell::race::OnceBox;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// Counts for one object or, summed, for the whole cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Pages found valid in the cache by reads and writes.
    pub hits: u64,
    /// Pages that had to be filled on demand (from the pager or zero-filled).
    pub misses: u64,
    /// Bytes read from pagers (holes cost nothing and are not counted).
    pub read_bytes: u64,
    /// Bytes written to pagers.
    pub written_bytes: u64,
    /// `get_pages` calls.
    pub get_calls: u64,
    /// `put_pages` calls (one per clustered writeback).
    pub put_calls: u64,
    /// Pages evicted (freed to make room).
    pub evictions: u64,
    /// Pages written back (cleaned).
    pub writebacks: u64,
    /// Writebacks that failed (the pages stayed dirty).
    pub writeback_errors: u64,
    /// Pages filled by read-ahead; of them, used later (hits) and evicted unused (waste).
    pub readahead_pages: u64,
    pub readahead_hits: u64,
    pub readahead_waste: u64,
    /// Bytes currently resident (cache-wide: including pages being filled right now).
    pub resident_bytes: u64,
    /// Bytes currently dirty.
    pub dirty_bytes: u64,
    /// Bytes of pages served in place from a store's own memory (execute-in-place,
    /// [`CacheBuilder::xip`](crate::CacheBuilder::xip)): valid pages the cache did not copy,
    /// not part of `resident_bytes` nor of the budget. Cache-wide: summed over the cached
    /// objects.
    pub xip_bytes: u64,
    /// How the object's pager reaches its store (`Unknown` in cache-wide totals).
    pub io_mode: crate::IoMode,
}

impl Stats {
    /// Fraction of page accesses served from the cache.
    pub fn hit_ratio(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 { 0.0 } else { self.hits as f64 / total as f64 }
    }

    pub(crate) fn add(&mut self, o: &Stats) {
        self.hits += o.hits;
        self.misses += o.misses;
        self.read_bytes += o.read_bytes;
        self.written_bytes += o.written_bytes;
        self.get_calls += o.get_calls;
        self.put_calls += o.put_calls;
        self.evictions += o.evictions;
        self.writebacks += o.writebacks;
        self.writeback_errors += o.writeback_errors;
        self.readahead_pages += o.readahead_pages;
        self.readahead_hits += o.readahead_hits;
        self.readahead_waste += o.readahead_waste;
        self.resident_bytes += o.resident_bytes;
        self.dirty_bytes += o.dirty_bytes;
        self.xip_bytes += o.xip_bytes;
    }
}

/// Whole-cache statistics.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Sums over all objects, live and gone.
    pub totals: Stats,
    /// The memory budget in bytes.
    pub budget_bytes: u64,
    /// Bytes of memory the cache's memfds actually hold, from the kernel (`fstat`).
    /// At most `totals.resident_bytes`: pages that are holes are counted resident but may
    /// not be allocated yet.
    pub allocated_bytes: u64,
    /// The memfds objects' pages share (each object a slice of one; see the crate's
    /// documentation of descriptors): one for up to 8,388,607 objects made.
    pub shared_memfds: usize,
    pub page_size: usize,
    /// Objects (files) the cache knows, open or cached.
    pub objects: usize,
    /// Window mappings alive now, and made/retired so far.
    pub windows: usize,
    pub window_maps: u64,
    pub window_retires: u64,
    /// Times the page daemon ran, and pages it freed.
    pub daemon_runs: u64,
    pub daemon_evictions: u64,
    /// The replacement policy in use.
    pub policy: &'static str,
    /// Pages the policy tracks now: the resident pages, whenever no fill or eviction is in
    /// progress (every valid page is known to the policy, and only those).
    pub policy_pages: u64,
    /// Unclean bytes now (dirty + under writeback + reserved by writers) and their limit.
    pub unclean_bytes: u64,
    pub dirty_limit_bytes: u64,
    /// Total time writers were paused by dirty throttling, and flusher rounds.
    pub throttled_ms: u64,
    pub flusher_runs: u64,
    /// The memory pages live in, chosen at build (`CacheBuilder::huge_pages`), and why:
    /// "hugetlb, 2 MiB pages (…)", "shmem THP, 2 MiB pages mapped in 4 KiB PTEs (…)" or
    /// "shmem, 4 KiB pages (…)".
    pub page_memory: String,
    /// How mappings are served: "userfaultfd", or "populate (‹why not userfaultfd›)";
    /// "none yet" before the first `map`.
    pub map_mode: String,
    /// User mappings alive now.
    pub mappings: u64,
    /// Injector resolved by the cache, pages they mapped, and faults answered with SIGBUS
    /// (past the end of the file, or a pager error).
    pub map_faults: u64,
    pub map_fault_pages: u64,
    pub map_sigbus: u64,
    /// Pages found dirty by scanning mappings for stores.
    pub map_dirty_found: u64,
    /// Bytes private mappings (`Sharing::Private`) copied on write, counted now; the cache
    /// keeps that much less of its own (up to three quarters of the budget).
    pub private_copy_bytes: u64,
    /// Bytes of the budget given back under memory pressure (`CacheBuilder::memory_pressure`).
    pub withheld_bytes: u64,
    /// Read windows lent out now ([`File::window`](crate::File::window)), windows ever lent,
    /// pages ever copied for them (a lent page changed while a window showed it), and
    /// bytes of such copies held now (charged against the budget like private copies).
    pub loans: u64,
    pub loans_taken: u64,
    pub loan_copies: u64,
    pub loan_copy_bytes: u64,
    /// Lent pages a truncation or invalidation took back from their windows (which kept
    /// copies) instead of waiting for them.
    pub loan_pages_handed_back: u64,
    /// Views mapped for windows (one per chunk, shared by its windows and kept for the
    /// next ones until a write copies pages into it).
    pub loan_views: u64,
    /// Bytes pagers write-locked now (`PagerRequest::lock`), unlock requests made of
    /// pagers before changes (`Pager::unlock_request`), and those refused.
    pub locked_bytes: u64,
    pub unlock_requests: u64,
    pub unlock_refusals: u64,
}

impl std::fmt::Display for CacheStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = &self.totals;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        writeln!(
            f,
            "budget        {:>10.1} MiB   withheld under memory pressure {:.1} MiB   page size {} B   policy {}",
            mib(self.budget_bytes),
            mib(self.withheld_bytes),
            self.page_size,
            self.policy
        )?;
        writeln!(
            f,
            "resident      {:>10.1} MiB   (allocated {:.1} MiB)   dirty {:.1} MiB   in place (xip) {:.1} MiB",
            mib(t.resident_bytes),
            mib(self.allocated_bytes),
            mib(t.dirty_bytes),
            mib(t.xip_bytes)
        )?;
        writeln!(
            f,
            "hits          {:>10}       misses {}   hit ratio {:.1}%",
            t.hits,
            t.misses,
            100.0 * t.hit_ratio()
        )?;
        writeln!(f, "pager reads   {:>10.1} MiB   in {} calls", mib(t.read_bytes), t.get_calls)?;
        writeln!(
            f,
            "pager writes  {:>10.1} MiB   in {} calls   ({} errors)",
            mib(t.written_bytes),
            t.put_calls,
            t.writeback_errors
        )?;
        writeln!(
            f,
            "evictions     {:>10}       writebacks {}   page daemon runs {} (freed {})",
            t.evictions, t.writebacks, self.daemon_runs, self.daemon_evictions
        )?;
        writeln!(
            f,
            "read-ahead    {:>10} pages  used {}   wasted {}",
            t.readahead_pages, t.readahead_hits, t.readahead_waste
        )?;
        writeln!(
            f,
            "write-behind  {:>10.1} MiB unclean (limit {:.1} MiB)   writers throttled {} ms   flusher rounds {}",
            mib(self.unclean_bytes),
            mib(self.dirty_limit_bytes),
            self.throttled_ms,
            self.flusher_runs
        )?;
        writeln!(
            f,
            "mappings      {:>10}       faults {} ({} pages)   SIGBUS {}   dirty found by scans {}   private copies {:.1} MiB   mode {}",
            self.mappings,
            self.map_faults,
            self.map_fault_pages,
            self.map_sigbus,
            self.map_dirty_found,
            mib(self.private_copy_bytes),
            self.map_mode
        )?;
        writeln!(f, "page memory   {}", self.page_memory)?;
        write!(
            f,
            "objects       {:>10}       windows {} (mapped {}, retired {})   loans {} (taken {}, pages copied {}, {:.1} MiB held)   locked {:.1} MiB (unlock requests {}, refused {})",
            self.objects,
            self.windows,
            self.window_maps,
            self.window_retires,
            self.loans,
            self.loans_taken,
            self.loan_copies,
            mib(self.loan_copy_bytes),
            mib(self.locked_bytes),
            self.unlock_requests,
            self.unlock_refusals
        )
    }
}

const SHARDS: usize = 8;

/// The counters every object read moves.
#[derive(Default)]
pub(crate) struct Shard {
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) read_bytes: AtomicU64,
    pub(crate) get_calls: AtomicU64,
    pub(crate) readahead_pages: AtomicU64,
}

/// The counters only writing back, eviction and read-ahead hits move: made by the first of
/// those (an object read and left idle — most cached files — never has them: 56 bytes).
#[derive(Default)]
pub(crate) struct Cold {
    pub(crate) written_bytes: AtomicU64,
    pub(crate) put_calls: AtomicU64,
    pub(crate) evictions: AtomicU64,
    pub(crate) writebacks: AtomicU64,
    pub(crate) writeback_errors: AtomicU64,
    pub(crate) readahead_hits: AtomicU64,
    pub(crate) readahead_waste: AtomicU64,
}

/// Per-object event counters.
///
/// Every counter but `hits` is bumped on a slow path (a miss, a writeback, an eviction), so
/// one set per object does. `hits` is bumped by every cached read, and two threads reading
/// one file at millions of reads a second would bounce its cache line between their CPUs
/// (`cached_random_read_4k_2t`): the first thread to count a hit owns the set's `hits`, and
/// the first hit counted by another thread gives the object one padded hit counter per
/// thread shard, which every thread counts in from then on (the first one too). So the
/// set's own `hits` is only ever written by a file's one reading thread, and the set is not
/// padded to a cache line pair of its own: that padding (128-byte alignment) made every
/// object's allocation 128 bytes of header and tail larger (768 bytes where 540 do) for a
/// line no second thread writes. An object read by one thread — nearly every cached file —
/// costs 64 bytes of counters (the write-back and eviction ones made when first moved)
/// instead of eight padded sets (1 KiB).
#[derive(Default)]
pub(crate) struct Counters(Home);

/// The counters of one object.
#[derive(Default)]
struct Home {
    counts: Shard,
    cold: OnceBox<Cold>,
    /// Each thread shard's hits, once a second thread counted one (see `Counters`).
    spread: OnceBox<[CachePadded<AtomicU64>; SHARDS]>,
    /// The shard (+ 1) of the thread that owns `counts.hits`; 0 before the first hit.
    hitter: AtomicUsize,
}

thread_local! {
    static SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

/// This thread's shard.
#[inline]
fn my_shard() -> usize {
    SHARD.with(|s| {
        let mut i = s.get();
        if i == usize::MAX {
            i = NEXT_SHARD.fetch_add(1, Relaxed) % SHARDS;
            s.set(i);
        }
        i
    })
}

impl Counters {
    /// The object's counters (for every counter but `hits`: see [`Counters::hit`]).
    #[inline]
    pub(crate) fn mine(&self) -> &Shard {
        &self.0.counts
    }

    /// The object's write-back, eviction and read-ahead-hit counters, made if needed.
    #[inline]
    pub(crate) fn cold(&self) -> &Cold {
        self.0.cold.get_or_init(Box::default)
    }

    /// Count `n` hits.
    #[inline]
    pub(crate) fn hit(&self, n: u64) {
        let home = &self.0;
        if let Some(s) = home.spread.get() {
            s[my_shard()].fetch_add(n, Relaxed);
            return;
        }
        let me = my_shard() + 1;
        let owner = match home.hitter.load(Relaxed) {
            0 => match home.hitter.compare_exchange(0, me, Relaxed, Relaxed) {
                Ok(_) => me,
                Err(o) => o,
            },
            o => o,
        };
        if owner == me {
            home.counts.hits.fetch_add(n, Relaxed);
        } else {
            home.spread.get_or_init(Box::default)[me - 1].fetch_add(n, Relaxed);
        }
    }

    pub(crate) fn snapshot(&self) -> Stats {
        let s = &self.0.counts;
        let mut st = Stats {
            hits: s.hits.load(Relaxed),
            misses: s.misses.load(Relaxed),
            read_bytes: s.read_bytes.load(Relaxed),
            get_calls: s.get_calls.load(Relaxed),
            readahead_pages: s.readahead_pages.load(Relaxed),
            ..Stats::default()
        };
        if let Some(c) = self.0.cold.get() {
            st.written_bytes = c.written_bytes.load(Relaxed);
            st.put_calls = c.put_calls.load(Relaxed);
            st.evictions = c.evictions.load(Relaxed);
            st.writebacks = c.writebacks.load(Relaxed);
            st.writeback_errors = c.writeback_errors.load(Relaxed);
            st.readahead_hits = c.readahead_hits.load(Relaxed);
            st.readahead_waste = c.readahead_waste.load(Relaxed);
        }
        if let Some(spread) = self.0.spread.get() {
            st.hits += spread.iter().map(|h| h.load(Relaxed)).sum::<u64>();
        }
        st
    }
}

#[inline]
pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every cached object carries its counters: one padded line pair, not a set per thread
    /// shard (8 x 128 bytes were the largest part of an idle cached file, issue 19).
    #[test]
    fn an_objects_counters_are_one_line_pair_until_a_second_thread_counts_hits() {
        assert!(std::mem::size_of::<Counters>() <= 128, "{}", std::mem::size_of::<Counters>());
        // Unpadded: an object embedding it keeps the heap's usual alignment.
        assert!(std::mem::align_of::<Counters>() <= 8, "{}", std::mem::align_of::<Counters>());
        let c = Counters::default();
        c.hit(3);
        assert!(c.0.spread.get().is_none(), "one thread: no shards");
        std::thread::scope(|s| {
            s.spawn(|| c.hit(4));
        });
        // The second thread's shard may be the first's (8 shards, threads assigned in turn):
        // then it counted in the home set too. Either way nothing is lost.
        c.hit(5);
        assert_eq!(c.snapshot().hits, 12);
    }
}

//! Statistics under contention: `Cache::stats` and `File::stats`
//! read while pages move between objects (fills, read-ahead, evictions, writes, writebacks,
//! failed writebacks, stores found through mappings, truncations) must be sane in every
//! snapshot: no gauge below zero (a wrapped counter reads near `u64::MAX` and made the sum
//! in `Cache::stats` overflow), gauges within the budget, event counters never going back.

mod common;
use common::*;
use rand::{RngExt, SeedableRng, rngs::StdRng};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::time::{Duration, Instant};
use ubc::pager::{InjectingPager, MemPager};
use ubc::{Access, Cache, Sharing, Stats};

const BUDGET: u64 = 512 << 10;
const FILE: u64 = 512 << 10;
const FILES: usize = 4;
const PAGE: u64 = 4096;

/// Every gauge of one snapshot is within what the cache can hold, and no counter went back
/// since the previous snapshot of the same thing.
fn check(what: &str, s: &Stats, prev: &Stats, gauge_max: u64) {
    let fields = [
        ("hits", s.hits, prev.hits),
        ("misses", s.misses, prev.misses),
        ("read_bytes", s.read_bytes, prev.read_bytes),
        ("written_bytes", s.written_bytes, prev.written_bytes),
        ("get_calls", s.get_calls, prev.get_calls),
        ("put_calls", s.put_calls, prev.put_calls),
        ("evictions", s.evictions, prev.evictions),
        ("writebacks", s.writebacks, prev.writebacks),
        ("writeback_errors", s.writeback_errors, prev.writeback_errors),
        ("readahead_pages", s.readahead_pages, prev.readahead_pages),
        ("readahead_hits", s.readahead_hits, prev.readahead_hits),
        ("readahead_waste", s.readahead_waste, prev.readahead_waste),
    ];
    for (name, now, before) in fields {
        assert!(now < u64::MAX / 2, "{what}: {name} = {now:#x}: wrapped below zero\n{s:#?}");
        assert!(now >= before, "{what}: {name} went back from {before} to {now}\n{s:#?}");
    }
    assert!(s.resident_bytes <= gauge_max, "{what}: resident {:#x} > {gauge_max:#x}\n{s:#?}", s.resident_bytes);
    assert!(s.dirty_bytes <= gauge_max, "{what}: dirty {:#x} > {gauge_max:#x}\n{s:#?}", s.dirty_bytes);
}

#[test]
fn stats_snapshots_stay_sane_while_pages_move_between_objects() {
    let secs: f64 = std::env::var("UBC_STATS_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let cache = Cache::builder()
        .budget(BUDGET)
        .writeback(Duration::from_millis(2), Duration::from_millis(1))
        .max_put(16 << 10)
        .build()
        .unwrap();
    let mut files = Vec::new();
    let mut faults = Vec::new();
    for i in 0..FILES {
        let mem = Arc::new(MemPager::new());
        ubc::Pager::put_pages(&*mem, 0, &pattern(i as u64, 0, FILE as usize)).unwrap();
        let fault = Arc::new(InjectingPager::new(mem));
        files.push(Arc::new(cache.open(fault.clone(), Access::ReadWrite).unwrap()));
        faults.push(fault);
    }
    // Stores through a mapping past the end raise SIGBUS: truncations wait for them.
    let sizing: Arc<Vec<std::sync::RwLock<()>>> = Arc::new((0..FILES).map(|_| Default::default()).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    // Workers: each mixes sequential reads (read-ahead), random page and sub-page writes,
    // writebacks, stores through a mapping, truncations and regrowth.
    for t in 0..6u64 {
        let (files, stop, ops, sizing) = (files.clone(), stop.clone(), ops.clone(), sizing.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(t);
            let mut buf = vec![0u8; 64 << 10];
            while !stop.load(Relaxed) {
                let i = rng.random_range(0..FILES);
                let f = &files[i];
                match rng.random_range(0..100) {
                    0..35 => {
                        // Sequential run: opens read-ahead windows.
                        let mut off = rng.random_range(0..FILE / PAGE) * PAGE;
                        for _ in 0..8 {
                            let _ = f.read_at(&mut buf[..16 << 10], off);
                            off += 16 << 10;
                        }
                    }
                    35..65 => {
                        let n = if rng.random_bool(0.5) {
                            PAGE as usize * rng.random_range(1..8)
                        } else {
                            rng.random_range(1..3000)
                        };
                        let off = rng.random_range(0..FILE - n as u64);
                        buf[..n].fill(t as u8 + 1);
                        let _ = f.write_at(&buf[..n], off);
                    }
                    65..75 => {
                        let _ = f.sync();
                    }
                    75..80 => {
                        let a = rng.random_range(0..FILE / PAGE) * PAGE;
                        let _ = f.clean(a..a + (64 << 10));
                    }
                    80..92 => {
                        // Stores through a shared mapping, found by its flush or its drop.
                        let a = rng.random_range(0..FILE / PAGE - 16) * PAGE;
                        let _g = sizing[i].read().unwrap();
                        if let Ok(mut m) = f.map(a..a + 16 * PAGE, Access::ReadWrite, Sharing::Shared) {
                            {
                                for p in 0..16 {
                                    if rng.random_bool(0.7) {
                                        m[p * PAGE as usize + 7] = t as u8;
                                    }
                                }
                                if rng.random_bool(0.5) {
                                    let _ = m.flush();
                                }
                            }
                        }
                    }
                    92..96 => {
                        // Truncate (drops pages, dirty ones included), then grow back.
                        let cut = rng.random_range(FILE / 2..FILE);
                        let _g = sizing[i].write().unwrap();
                        let _ = f.set_len(cut);
                        let _ = f.set_len(FILE);
                    }
                    _ => {
                        let _ = f.invalidate(0..FILE, ubc::Length::Keep);
                    }
                }
                ops.fetch_add(1, Relaxed);
            }
        }));
    }
    // Failing writebacks now and then: their pages are dirty again.
    {
        let (faults, stop) = (faults.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(99);
            while !stop.load(Relaxed) {
                let f = &faults[rng.random_range(0..FILES)];
                f.fail_writes(Some(libc_eio()));
                std::thread::sleep(Duration::from_micros(rng.random_range(100..2000)));
                f.heal();
                std::thread::sleep(Duration::from_micros(rng.random_range(100..5000)));
            }
            for f in &faults {
                f.heal();
            }
        }));
    }

    // The observer: snapshots as fast as it can.
    let start = Instant::now();
    let mut prev_cache = Stats::default();
    let mut prev: Vec<Stats> = vec![Stats::default(); FILES];
    let mut snapshots = 0u64;
    let (mut max_dirty, mut max_res) = (0u64, 0u64);
    while start.elapsed().as_secs_f64() < secs {
        let cs = cache.stats();
        check("cache", &cs.totals, &prev_cache, BUDGET);
        assert!(cs.unclean_bytes <= BUDGET, "unclean {:#x} > budget", cs.unclean_bytes);
        prev_cache = cs.totals;
        for (i, f) in files.iter().enumerate() {
            let s = f.stats();
            check(&format!("file {i}"), &s, &prev[i], BUDGET);
            max_dirty = max_dirty.max(s.dirty_bytes);
            max_res = max_res.max(s.resident_bytes);
            prev[i] = s;
        }
        snapshots += 1;
    }
    stop.store(true, SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    let cs = cache.stats();
    println!(
        "{snapshots} snapshots, {} operations; max per-file resident {} KiB, dirty {} KiB; evictions {}, writebacks {}, writeback errors {}, read-ahead {} pages",
        ops.load(SeqCst),
        max_res >> 10,
        max_dirty >> 10,
        cs.totals.evictions,
        cs.totals.writebacks,
        cs.totals.writeback_errors,
        cs.totals.readahead_pages,
    );
    // The test must have moved pages around for its snapshots to mean anything.
    assert!(cs.totals.evictions > 0 && cs.totals.writebacks > 0 && cs.totals.writeback_errors > 0, "{cs}");
    // At rest, the gauges agree with what is there: sync everything, and nothing is dirty.
    cache.sync_all().unwrap();
    let cs = cache.stats();
    assert_eq!(cs.totals.dirty_bytes, 0, "{cs}");
    // Read-ahead submitted by the workers and the page daemon may still be finishing.
    let t0 = Instant::now();
    loop {
        let sum: u64 = files.iter().map(|f| f.stats().resident_bytes).sum();
        let cs = cache.stats();
        if sum == cs.totals.resident_bytes {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "at rest, the objects' resident pages ({sum}) are the cache's\n{cs}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn libc_eio() -> i32 {
    5 // EIO
}

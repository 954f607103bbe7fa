//! One budget for everything: memory stays within budget + 5% under any workload, and
//! thousands of cached files fit within the mapping and open-file limits.

mod common;
use common::*;
use rand::{RngExt, SeedableRng, rngs::StdRng};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use ubc::pager::MemPager;
use ubc::{Access, Cache};

fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).unwrap().count()
}

fn count_maps() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().count()
}

/// The tests here count the process's descriptors and mappings, which every other test of
/// this binary changes while it runs: they take turns (one failed in CI-like runs: another
/// test mapped windows between the two counts of `memory_is_returned_when_the_cache_goes_away`).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn memory_stays_within_budget_with_a_working_set_ten_times_larger() {
    let _turn = one_at_a_time();
    let budget: u64 = 4 << 20;
    let cache = Cache::builder().budget(budget).build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // 4 host files of 10 MiB: 40 MiB working set, 10x the budget.
    let files: Vec<Arc<ubc::File>> = (0..4)
        .map(|i| {
            let p = dir.path().join(format!("f{i}"));
            std::fs::write(&p, pattern(i, 0, 10 << 20)).unwrap();
            Arc::new(cache.open_path(&p, Access::ReadWrite).unwrap())
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let max_alloc = Arc::new(AtomicU64::new(0));
    let max_resident = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (cache, stop, max_alloc, max_resident) =
            (cache.clone(), stop.clone(), max_alloc.clone(), max_resident.clone());
        std::thread::spawn(move || {
            // A real-time sampler is not preempted halfway through summing the memfds, so
            // each sample is a near-instant snapshot (needs root; without it, samples are
            // merely noisier).
            let param = libc::sched_param { sched_priority: 10 };
            // SAFETY: plain syscall on the calling thread.
            let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
            let mut samples = 0;
            while !stop.load(SeqCst) {
                let st = cache.stats();
                max_alloc.fetch_max(st.allocated_bytes, SeqCst);
                max_resident.fetch_max(st.totals.resident_bytes, SeqCst);
                samples += 1;
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            samples
        })
    };
    let workers: Vec<_> = (0..4u64)
        .map(|t| {
            let files = files.clone();
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(t);
                let mut buf = vec![0u8; 64 << 10];
                for i in 0..1500 {
                    let f = &files[rng.random_range(0..files.len())];
                    let len = rng.random_range(1..buf.len());
                    let off = rng.random_range(0..(10u64 << 20) - len as u64);
                    match i % 5 {
                        // sequential scans, random reads, and writes
                        0 => {
                            let start = rng.random_range(0..(9u64 << 20));
                            for k in 0..16u64 {
                                f.read_at(&mut buf, start + k * (64 << 10)).unwrap();
                            }
                        }
                        1 | 2 => {
                            f.read_at(&mut buf[..len], off).unwrap();
                        }
                        _ => {
                            f.write_at(&buf[..len], off).unwrap();
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, SeqCst);
    let samples = sampler.join().unwrap();
    // `allocated` sums fstat over memfds one by one while pages move between them, so a
    // sample can count a moving page twice: that is what the 5% allows for. `resident` is
    // the cache's own atomic count and must never pass the budget.
    let limit = budget + budget / 20;
    let (alloc, resident) = (max_alloc.load(SeqCst), max_resident.load(SeqCst));
    println!("samples {samples}, max allocated {alloc}, max resident {resident}, budget {budget}");
    assert!(samples > 10);
    assert!(alloc <= limit, "allocated {alloc} > budget + 5% ({limit})");
    assert!(resident <= budget, "resident {resident} > budget {budget}");
    let st = cache.stats();
    assert!(st.totals.evictions > 1000, "{st:?}");
    assert!(st.daemon_runs > 0, "the page daemon ran");
    // Allocation and accounting agree once quiet: no page is allocated that is not counted.
    std::thread::sleep(std::time::Duration::from_millis(100));
    let st = cache.stats();
    assert!(st.allocated_bytes <= st.totals.resident_bytes, "{st:?}");
    cache.sync_all().unwrap();
}

#[test]
fn thousands_of_cached_files_stay_within_fd_and_mapping_limits() {
    let _turn = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let cache =
        Cache::builder().budget(64 << 20).window_size(64 << 10).max_windows(128).max_cached_files(300).build().unwrap();
    let fds_before = count_dir("/proc/self/fd");
    let maps_before = count_maps();
    let n = 3000u64;
    for i in 0..n {
        let f = cache.create_path(dir.path().join(format!("{i}"))).unwrap();
        f.write_at(&pattern(i, 0, 5000), 0).unwrap();
        let mut b = vec![0u8; 5000];
        f.read_at(&mut b, 0).unwrap();
    }
    let st = cache.stats();
    let fds = count_dir("/proc/self/fd").saturating_sub(fds_before);
    let maps = count_maps().saturating_sub(maps_before);
    println!("objects {}, extra fds {fds}, extra maps {maps}, windows {}", st.objects, st.windows);
    assert!(st.objects <= 301, "cached files bounded: {}", st.objects);
    assert!(fds <= 2 * 301 + 16, "fds bounded: {fds}");
    assert!(st.windows <= 128 + 4, "windows bounded: {}", st.windows);
    assert!(maps <= 2 * 128 + 32, "mappings bounded: {maps}");
    // Nothing was lost: every file reads back, from the cache or from disk.
    for i in (0..n).step_by(7) {
        let f = cache.open_path(dir.path().join(format!("{i}")), Access::ReadOnly).unwrap();
        let mut b = vec![0u8; 5000];
        f.read_exact_at(&mut b, 0).unwrap();
        assert_same(&b, &pattern(i, 0, 5000), "file contents");
    }
}

#[test]
fn memory_is_returned_when_the_cache_goes_away() {
    let _turn = one_at_a_time();
    let cache = small_cache(8 << 20);
    let f = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    f.write_at(&vec![3u8; 4 << 20], 0).unwrap();
    assert_eq!(cache.stats().allocated_bytes, 4 << 20);
    // Windows are mappings of the cache's memfd; counting only those, a thread stack or a
    // malloc arena mapped meanwhile (the test harness starting the next test's thread) does
    // not hide them (it did once, under load).
    let memfd_maps =
        || std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains("/memfd:")).count();
    // A window held now: whether write-back has mapped one yet depends on when the
    // flusher ran (writes fill new pages with `pwrite`, mapping nothing), which under load
    // it had not — the assertion below failed once in scripts/test.
    let w = f.window(0, 64 << 10).unwrap();
    let maps_with = memfd_maps();
    assert!(maps_with > 0, "the cache's windows are mappings of its memfd");
    drop(w);
    drop(f);
    drop(cache);
    assert!(memfd_maps() < maps_with, "windows unmapped at shutdown");
}

#[test]
fn a_full_cache_keeps_the_whole_budget_resident() {
    let _turn = one_at_a_time();
    // Read-only work over a file twice the budget: at steady state at least 98 % of the budget
    // holds pages (no reserve held back with nothing to write back, small watermarks; issue
    // 19 found 91 %).
    let budget: u64 = 8 << 20;
    let cache = Cache::builder().budget(budget).build().unwrap();
    let size = 2 * budget as usize;
    let pager = RecordingPager::with_data(size, 11);
    let f = cache.open(pager, Access::ReadOnly).unwrap();
    let mut big = vec![0u8; 64 << 10];
    let mut off = 0;
    while off < size as u64 {
        off += f.read_at(&mut big, off).unwrap() as u64;
    }
    let mut rng = StdRng::seed_from_u64(11);
    let mut b = vec![0u8; 4096];
    for _ in 0..2 * (budget / 4096) {
        let p = rng.random_range(0..size as u64 / 4096);
        f.read_exact_at(&mut b, p * 4096).unwrap();
        assert_same(&b, &pattern(11, p * 4096, 4096), "random read");
    }
    let resident = cache.stats().totals.resident_bytes;
    println!("resident {resident} of {budget}");
    assert!(resident * 100 >= budget * 98, "resident {resident} of a budget of {budget}");
    assert!(resident <= budget);
}

/// The policy keeps no index of its own: the cache hands back the slot it kept with each
/// page (`EvictionPolicy::remove(slot, key)`). Whatever path a page leaves by — eviction,
/// truncation, a punched hole, `drop_clean`, the cache letting a closed file go — the
/// policy must be told, with the right slot: at every quiet point it tracks exactly the
/// resident pages. (A wrong slot is ignored by the policy, so it would keep a page that is
/// gone and `policy_pages` would exceed the resident pages.)
#[test]
fn the_policy_tracks_exactly_the_resident_pages_whatever_way_pages_leave() {
    let _turn = one_at_a_time();
    let budget: u64 = 4 << 20;
    let cache = Cache::builder().budget(budget).build().unwrap();
    let quiet = |what: &str| {
        // Background work (page daemon, flusher) may still be finishing: look until two
        // readings agree.
        let mut last = (u64::MAX, u64::MAX);
        for _ in 0..200 {
            let st = cache.stats();
            let now = (st.policy_pages, st.totals.resident_bytes / 4096);
            if now == last && now.0 == now.1 {
                return now.1;
            }
            last = now;
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        panic!("{what}: the policy tracks {} pages, {} are resident", last.0, last.1);
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    std::fs::write(&path, pattern(5, 0, 16 << 20)).unwrap();
    let f = cache.open_path(&path, Access::ReadWrite).unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    let mut b = vec![0u8; 16 << 10];
    // Reads and writes over 4x the budget: evictions, kept-back dirty pages, write-back.
    for i in 0..3000 {
        let off = rng.random_range(0..(16u64 << 20) - b.len() as u64);
        if i % 4 == 0 {
            f.write_at(&b, off).unwrap();
        } else {
            f.read_at(&mut b, off).unwrap();
        }
    }
    f.sync().unwrap();
    assert!(cache.stats().totals.evictions > 500);
    assert!(quiet("after reads and writes") > 0);
    f.set_len(1 << 20).unwrap();
    quiet("after truncation");
    f.read_exact_at(&mut vec![0u8; 1 << 20], 0).unwrap();
    f.punch_hole(4096..(512 << 10)).unwrap();
    quiet("after punching a hole");
    f.drop_clean(0..(1 << 20)).unwrap();
    quiet("after drop_clean");
    // A second file pushes the first, closed, out of the budget.
    f.read_exact_at(&mut vec![0u8; 1 << 20], 0).unwrap();
    drop(f);
    let g = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    g.write_at(&vec![7u8; 6 << 20], 0).unwrap();
    g.sync().unwrap();
    quiet("after a second file");
    g.set_len(0).unwrap();
    quiet("after truncating the second file to 0");
}

/// A fill that finds the policy's lock taken (the page daemon choosing victims, another fill
/// admitting its pages) does not wait for it: it stages its pages, valid already, and the
/// next holder of the lock admits them (`resources/policy.rs`). Staged pages must reach the
/// policy exactly once, also when a truncation drops them and a fill makes them again
/// meanwhile: afterwards the policy tracks exactly the resident pages (a page admitted twice
/// would be counted twice; one never admitted could not be evicted, and the cache would fill
/// up with pages it cannot free — checked: with `stage` losing its pages this fails with
/// "the policy tracks 490 pages, 995 are resident").
#[test]
fn pages_staged_while_the_policy_is_busy_are_admitted_exactly_once() {
    let _turn = one_at_a_time();
    let staged = Arc::new(AtomicU64::new(0));
    let counted = staged.clone();
    let _hook = ubc::testing::hook(move |point| {
        if point == ubc::testing::Point::FillStaged
            && std::thread::current().name().is_some_and(|n| n.starts_with("staging-"))
        {
            counted.fetch_add(1, Relaxed);
        }
    });
    let budget: u64 = 4 << 20;
    let cache = Cache::builder().budget(budget).build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (len_a, len_b) = (16u64 << 20, 8u64 << 20);
    std::fs::write(dir.path().join("a"), pattern(11, 0, len_a as usize)).unwrap();
    std::fs::write(dir.path().join("b"), pattern(12, 0, len_b as usize)).unwrap();
    let a = Arc::new(cache.open_path(dir.path().join("a"), Access::ReadOnly).unwrap());
    let b = Arc::new(cache.open_path(dir.path().join("b"), Access::ReadWrite).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = vec![];
    // Readers of `a`, 4x the budget: misses all the time, so the page daemon holds the
    // policy lock often, and the readers' fills meet it and each other.
    for t in 0..4u64 {
        let (a, stop) = (a.clone(), stop.clone());
        threads.push(
            std::thread::Builder::new()
                .name(format!("staging-reader-{t}"))
                .spawn(move || {
                    let mut rng = StdRng::seed_from_u64(t);
                    let mut buf = vec![0u8; 16 << 10];
                    while !stop.load(Relaxed) {
                        let n = 4096 * rng.random_range(1..=4usize);
                        let off = rng.random_range(0..(len_a - n as u64) / 4096) * 4096;
                        a.read_exact_at(&mut buf[..n], off).unwrap();
                        assert!(buf[..n] == pattern(11, off, n)[..], "a: wrong bytes at {off}");
                    }
                })
                .unwrap(),
        );
    }
    // One thread reads `b` and truncates it: staged pages of `b` are dropped before they are
    // admitted, and read (staged) again.
    {
        let (b, stop) = (b.clone(), stop.clone());
        threads.push(
            std::thread::Builder::new()
                .name("staging-truncater".into())
                .spawn(move || {
                    let mut rng = StdRng::seed_from_u64(99);
                    let mut buf = vec![0u8; 64 << 10];
                    let mut cut = len_b;
                    while !stop.load(Relaxed) {
                        let off = rng.random_range(0..len_b / 4096) * 4096;
                        let n = buf.len().min((len_b - off) as usize);
                        let got = b.read_at(&mut buf[..n], off).unwrap();
                        // Below the lowest cut the bytes are the file's; above it, zeros.
                        for (i, &x) in buf[..got].iter().enumerate() {
                            let pos = off + i as u64;
                            let want = if pos < cut { byte_at(12, pos) } else { 0 };
                            assert_eq!(x, want, "b: byte {pos} (cut at {cut})");
                        }
                        if rng.random_range(0..8) == 0 {
                            cut = cut.min(rng.random_range(len_b / 2..len_b) / 4096 * 4096);
                            b.set_len(cut).unwrap();
                            b.set_len(len_b).unwrap();
                        }
                    }
                })
                .unwrap(),
        );
    }
    let start = std::time::Instant::now();
    while staged.load(Relaxed) < 200 && start.elapsed() < std::time::Duration::from_secs(20) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    stop.store(true, Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    assert!(staged.load(Relaxed) > 0, "no fill ever found the policy busy: nothing was tested");
    // Quiet: the policy holds exactly the resident pages (stats takes the policy's lock,
    // which admits whatever is still staged).
    let mut last = (u64::MAX, u64::MAX);
    for _ in 0..200 {
        let st = cache.stats();
        let now = (st.policy_pages, st.totals.resident_bytes / 4096);
        if now == last && now.0 == now.1 {
            break;
        }
        last = now;
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(last.0, last.1, "the policy tracks {} pages, {} are resident", last.0, last.1);
    // And every page can still be evicted: reading all of `a` again stays in the budget.
    let mut whole = vec![0u8; len_a as usize];
    a.read_exact_at(&mut whole, 0).unwrap();
    assert!(whole == pattern(11, 0, len_a as usize), "a: wrong bytes after the run");
    let st = cache.stats();
    assert!(st.totals.resident_bytes <= budget, "resident {} over the budget", st.totals.resident_bytes);
    assert!(st.totals.evictions > 1000, "evictions {}", st.totals.evictions);
}

//! Read-ahead: sequential streams are detected (also interleaved ones), windows grow,
//! random access gets none, and waste is accounted. Tests look at what the pager was
//! asked for and at statistics — never at timings.

mod common;
use common::*;
use std::sync::Arc;
use ubc::{Access, Cache};

fn cache() -> Cache {
    Cache::builder().budget(64 << 20).readahead(128 << 10, 1 << 20).build().unwrap()
}

/// Read `len` bytes at `off` in `step`-byte calls and check the data.
fn read_seq(f: &ubc::File, seed: u64, off: u64, len: u64, step: usize) {
    let mut buf = vec![0u8; step];
    let mut pos = off;
    while pos < off + len {
        let n = f.read_at(&mut buf, pos).unwrap();
        assert_same(&buf[..n], &pattern(seed, pos, n), "sequential read");
        pos += n as u64;
    }
}

#[test]
fn sequential_reader_gets_growing_windows_and_few_demand_misses() {
    let size = 16 << 20;
    let pager = RecordingPager::with_data(size, 1);
    let cache = cache();
    let f = cache.open(pager.clone(), Access::ReadOnly).unwrap();
    read_seq(&f, 1, 0, size as u64, 4096);
    let st = f.stats();
    let pages = (size / 4096) as u64;
    println!("{st:?}");
    assert!(st.readahead_pages >= pages * 9 / 10, "most pages came by read-ahead: {st:?}");
    assert!(st.misses < pages / 20, "a sequential reader rarely misses: {} of {pages}", st.misses);
    assert!(st.readahead_hits >= pages * 9 / 10, "read-ahead pages were used: {st:?}");
    assert_eq!(st.readahead_waste, 0);
    // Nothing was read twice, and requests are large (clustered).
    assert_eq!(pager.bytes_requested(), size as u64);
    let reqs = pager.requests();
    assert!(reqs.len() < (size / (64 << 10)) * 2, "{} requests for {} MiB", reqs.len(), size >> 20);
}

#[test]
fn window_grows_from_init_to_max() {
    // With one I/O thread and pieces of max_fill, the growth shows in the offsets at which
    // windows start: 128K, then 256K, 512K, 1M, 1M... after the initial request.
    let size = 8 << 20;
    let pager = RecordingPager::with_data(size, 2);
    let cache = Cache::builder()
        .budget(64 << 20)
        .readahead(128 << 10, 1 << 20)
        .max_fill(1 << 20)
        .io_threads(1)
        .build()
        .unwrap();
    let f = cache.open(pager.clone(), Access::ReadOnly).unwrap();
    read_seq(&f, 2, 0, size as u64, 4096);
    let reqs = pager.requests();
    let sizes: Vec<usize> = reqs.iter().map(|r| r.1).collect();
    println!("{sizes:?}");
    assert!(sizes.contains(&(1 << 20)), "reaches the maximum window");
    assert!(sizes.iter().all(|&s| s <= 1 << 20), "never beyond the maximum");
    assert!(sizes.iter().any(|&s| s < 1 << 20 && s > 4096), "starts smaller and grows");
}

#[test]
fn random_reads_get_no_readahead() {
    let size = 32 << 20;
    let pager = RecordingPager::with_data(size, 3);
    let cache = cache();
    let f = cache.open(pager.clone(), Access::ReadOnly).unwrap();
    let offs = {
        let mut x = 0x9e3779b97f4a7c15u64;
        (0..2000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % (size as u64 / 4096 - 1)) * 4096 + 4096 // never page 0 (start of file is sequential)
            })
            .collect::<Vec<_>>()
    };
    let mut b = vec![0u8; 4096];
    for &o in &offs {
        f.read_exact_at(&mut b, o).unwrap();
        assert_same(&b, &pattern(3, o, 4096), "random read");
    }
    let st = f.stats();
    println!("{st:?}");
    // A random read next to an earlier one may look like a tiny stream now and then; the
    // bulk must be demand reads of exactly what was asked.
    assert!(st.readahead_pages < st.misses / 10, "random access read ahead: {st:?}");
    let per_request: Vec<usize> = pager.requests().iter().map(|r| r.1).collect();
    let single = per_request.iter().filter(|&&s| s == 4096).count();
    assert!(
        single * 10 >= per_request.len() * 9,
        "{single} of {} requests were exactly the page asked for",
        per_request.len()
    );
}

#[test]
fn interleaved_streams_on_one_handle_are_both_detected() {
    let size = 16 << 20;
    let pager = RecordingPager::with_data(size, 4);
    let cache = cache();
    let f = cache.open(pager.clone(), Access::ReadOnly).unwrap();
    // Two streams: one from 1 MiB, one from 9 MiB, alternating 4 KiB reads on one handle.
    let (mut a, mut b) = (1u64 << 20, 9u64 << 20);
    let mut buf = vec![0u8; 4096];
    let start_a = a;
    let start_b = b;
    while a < start_a + (6 << 20) {
        for pos in [&mut a, &mut b] {
            f.read_exact_at(&mut buf, *pos).unwrap();
            *pos += 4096;
        }
    }
    let _ = (start_b, buf);
    let st = f.stats();
    let pages = 2 * (6u64 << 20) / 4096;
    println!("{st:?}");
    assert!(st.readahead_pages >= pages * 8 / 10, "both streams read ahead: {st:?}");
    assert!(st.misses < pages / 10, "demand misses {} of {pages}", st.misses);
    // Read-ahead covered both regions.
    let reqs = pager.requests();
    assert!(reqs.iter().any(|r| r.0 > (2 << 20) && r.0 < (7 << 20)));
    assert!(reqs.iter().any(|r| r.0 > (10 << 20) && r.0 < (15 << 20)));
}

#[test]
fn interleaved_streams_on_two_threads_and_handles() {
    let size = 16 << 20;
    let pager = RecordingPager::with_data(size, 5);
    let cache = cache();
    let f = Arc::new(cache.open(pager.clone(), Access::ReadOnly).unwrap());
    let g = Arc::new(f.try_clone().unwrap());
    let t1 = {
        let f = f.clone();
        std::thread::spawn(move || read_seq(&f, 5, 0, 8 << 20, 8192))
    };
    let t2 = {
        let g = g.clone();
        std::thread::spawn(move || read_seq(&g, 5, 8 << 20, 8 << 20, 8192))
    };
    t1.join().unwrap();
    t2.join().unwrap();
    let st = f.stats();
    let pages = (size / 4096) as u64;
    assert!(st.readahead_pages >= pages * 8 / 10, "{st:?}");
    assert_eq!(pager.bytes_requested(), size as u64, "no page read twice");
}

#[test]
fn unused_readahead_is_counted_as_waste() {
    let size = 8 << 20;
    let pager = RecordingPager::with_data(size, 6);
    let cache = cache();
    let f = cache.open(pager.clone(), Access::ReadOnly).unwrap();
    // Read 64 KiB from the start (sequential: a window beyond it is read ahead), then stop.
    read_seq(&f, 6, 0, 64 << 10, 4096);
    // Wait for the asynchronous fills to land, then evict everything.
    for _ in 0..200 {
        if f.stats().readahead_pages > 0 && cache.stats().totals.resident_bytes >= 128 << 10 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    cache.evict_all().unwrap();
    let st = f.stats();
    println!("{st:?}");
    assert!(st.readahead_pages > 0);
    assert!(st.readahead_waste > 0, "evicted unused read-ahead pages are waste: {st:?}");
    assert_eq!(st.readahead_waste + st.readahead_hits, st.readahead_pages);
}

#[test]
fn readahead_off_reads_only_what_is_asked() {
    let size = 4 << 20;
    let pager = RecordingPager::with_data(size, 7);
    let cache = Cache::builder().budget(64 << 20).readahead(0, 0).build().unwrap();
    let f = cache.open(pager.clone(), Access::ReadOnly).unwrap();
    read_seq(&f, 7, 0, size as u64, 4096);
    assert_eq!(f.stats().readahead_pages, 0);
}

/// The pages of `1..pages` in a fixed pseudo-random order (Fisher-Yates, xorshift).
fn shuffled_pages(pages: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (1..pages).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

#[test]
fn random_reads_of_a_mostly_resident_file_read_one_page_per_miss() {
    // Every page once, in random order: as the file fills, the pages before a miss are more
    // and more often cached — the trace a sequential stream leaves, which must not pass for
    // one (issue 19: a full cache read 5.5 pages per random miss).
    let size = 8 << 20;
    let pager = RecordingPager::with_data(size, 8);
    let cache = cache();
    let f = cache.open(pager.clone(), Access::ReadOnly).unwrap();
    let mut b = vec![0u8; 4096];
    for p in shuffled_pages(size as u64 / 4096, 0x51ed) {
        f.read_exact_at(&mut b, p * 4096).unwrap();
        assert_same(&b, &pattern(8, p * 4096, 4096), "random read");
    }
    let st = f.stats();
    println!("{st:?}");
    assert!(st.readahead_pages * 20 <= st.misses, "read ahead on random misses: {st:?}");
    let reqs = pager.requests();
    let single = reqs.iter().filter(|r| r.1 == 4096).count();
    assert!(single * 20 >= reqs.len() * 19, "{single} of {} requests were the page asked for", reqs.len());
}

#[test]
fn a_stream_starting_mid_file_is_found_by_its_second_read() {
    let size = 8 << 20;
    let pager = RecordingPager::with_data(size, 9);
    let cache = cache();
    let f = cache.open(pager.clone(), Access::ReadOnly).unwrap();
    // A few random reads first (candidates in the stream table), then one stream from 3 MiB.
    let mut b = vec![0u8; 4096];
    for p in [100u64, 1700, 40, 900] {
        f.read_exact_at(&mut b, p * 4096).unwrap();
    }
    read_seq(&f, 9, 3 << 20, 4 << 20, 4096);
    let st = f.stats();
    let pages = (4u64 << 20) / 4096;
    println!("{st:?}");
    assert!(st.readahead_pages >= pages * 9 / 10, "the stream was read ahead: {st:?}");
    assert!(st.misses < pages / 20, "demand misses {} of {pages}", st.misses);
}

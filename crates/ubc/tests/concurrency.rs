//! Many threads on the same and different files, against a model of what each file holds.

mod common;
use common::*;
use rand::{Rng, RngExt, SeedableRng, rngs::StdRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Barrier};
use std::time::Duration;
use ubc::pager::{InjectingPager, MemPager};
use ubc::{Access, Cache, Pager};

#[test]
fn concurrent_misses_on_one_page_do_one_io() {
    for round in 0..20 {
        let cache = small_cache(1 << 20);
        let mem = Arc::new(MemPager::new());
        mem.put_pages(0, &pattern(round, 0, 1 << 16)).unwrap();
        let fault = Arc::new(InjectingPager::new(mem.clone()));
        fault.set_delay(Duration::from_millis(5)); // make the race window wide
        let f = Arc::new(cache.open(fault.clone(), Access::ReadOnly).unwrap());
        let barrier = Arc::new(Barrier::new(8));
        let ts: Vec<_> = (0..8)
            .map(|_| {
                let (f, b) = (f.clone(), barrier.clone());
                std::thread::spawn(move || {
                    b.wait();
                    let mut buf = vec![0u8; 100];
                    f.read_exact_at(&mut buf, 8192 + 50).unwrap();
                    buf
                })
            })
            .collect();
        for t in ts {
            assert_same(&t.join().unwrap(), &pattern(round, 8192 + 50, 100), "concurrent read");
        }
        assert_eq!(fault.counts().gets, 1, "8 concurrent misses on one page: one get_pages");
    }
}

/// The stress test: writers own disjoint slots of each file and record what they wrote;
/// readers check that every byte they see is one its owner wrote there (or zero before
/// any write); at the end every file must equal the model exactly, in the cache and, after
/// sync, in the store. The budget is a fraction of the data, so eviction and writeback run
/// all the time, and the page daemon runs too.
#[test]
fn stress_mixed_read_write_against_a_model() {
    const FILES: usize = 3;
    const SLOT: u64 = 1000; // not page aligned: slots share pages between writers
    const SLOTS: u64 = 600; // ~600 KB per file
    const WRITERS: u64 = 4;
    let cache = Cache::builder().budget(384 << 10).build().unwrap();
    let mems: Vec<Arc<MemPager>> = (0..FILES).map(|_| Arc::new(MemPager::new())).collect();
    let files: Vec<Arc<ubc::File>> =
        mems.iter().map(|m| Arc::new(cache.open(m.clone(), Access::ReadWrite).unwrap())).collect();
    // version[file][slot]: last version written (0 = never); the byte pattern encodes it.
    let versions: Arc<Vec<Vec<AtomicU64>>> =
        Arc::new((0..FILES).map(|_| (0..SLOTS).map(|_| AtomicU64::new(0)).collect()).collect());
    let fill = |file: usize, slot: u64, ver: u64| -> Vec<u8> {
        let seed = (file as u64) << 48 | slot << 20 | ver;
        pattern(seed, 0, SLOT as usize)
    };
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = vec![];
    for w in 0..WRITERS {
        let (files, versions) = (files.clone(), versions.clone());
        handles.push(std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(w);
            for _ in 0..3000 {
                let fi = rng.random_range(0..FILES);
                // writer w owns slots with slot % WRITERS == w
                let slot = rng.random_range(0..SLOTS / WRITERS) * WRITERS + w;
                let ver = versions[fi][slot as usize].load(SeqCst) + 1;
                files[fi].write_at(&fill(fi, slot, ver), slot * SLOT).unwrap();
                versions[fi][slot as usize].store(ver, SeqCst);
                if rng.random_range(0..200) == 0 {
                    files[fi].sync().unwrap();
                }
            }
        }));
    }
    let mut readers = vec![];
    for r in 0..3u64 {
        let (files, versions, stop) = (files.clone(), versions.clone(), stop.clone());
        readers.push(std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(100 + r);
            let mut checks = 0u64;
            while !stop.load(SeqCst) {
                let fi = rng.random_range(0..FILES);
                let slot = rng.random_range(0..SLOTS);
                let mut buf = vec![0u8; SLOT as usize];
                let n = files[fi].read_at(&mut buf, slot * SLOT).unwrap();
                let hi = versions[fi][slot as usize].load(SeqCst);
                // Every byte must come from some version 0..=hi+1 of this slot (a write may be
                // in flight), byte by byte (reads are not atomic against writes).
                for (i, &b) in buf[..n].iter().enumerate() {
                    let ok = b == 0 || (1..=hi + 1).any(|v| fill(fi, slot, v)[i] == b);
                    assert!(ok, "file {fi} slot {slot} byte {i}: {b:#x} was never written there (hi={hi})");
                }
                checks += 1;
            }
            checks
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    stop.store(true, SeqCst);
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
    let st = cache.stats();
    assert!(st.totals.evictions > 0 && st.totals.writebacks > 0, "pressure was real: {st:?}");
    assert!(st.totals.resident_bytes <= st.budget_bytes);
    // Final contents: exactly the model, through the cache and in the store.
    for fi in 0..FILES {
        let len = files[fi].len().unwrap();
        let mut model = vec![0u8; len as usize];
        for slot in 0..SLOTS {
            let v = versions[fi][slot as usize].load(SeqCst);
            if v > 0 {
                model[(slot * SLOT) as usize..((slot + 1) * SLOT) as usize].copy_from_slice(&fill(fi, slot, v));
            }
        }
        let mut back = vec![0u8; len as usize];
        files[fi].read_at(&mut back, 0).unwrap();
        assert_same(&back, &model, "cache contents");
        files[fi].sync().unwrap();
        assert_same(&store_contents(&*mems[fi]), &model, "store contents");
    }
}

/// Overlapping writers: lock coupling makes every pair of overlapping writes apply in one
/// order on all pages they share, so each final page range holds one writer's bytes
/// consistently (no page from writer A next to a page from writer B inside one write).
#[test]
fn overlapping_writes_are_ordered_consistently() {
    let cache = small_cache(1 << 20);
    let f = Arc::new(cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap());
    for round in 0..30 {
        let barrier = Arc::new(Barrier::new(2));
        let ts: Vec<_> = [1u8, 2u8]
            .into_iter()
            .map(|v| {
                let (f, b) = (f.clone(), barrier.clone());
                std::thread::spawn(move || {
                    b.wait();
                    f.write_at(&vec![v; 16 * 4096], 0).unwrap();
                })
            })
            .collect();
        for t in ts {
            t.join().unwrap();
        }
        let mut back = vec![0u8; 16 * 4096];
        f.read_at(&mut back, 0).unwrap();
        assert!(back.iter().all(|&b| b == back[0]), "round {round}: torn overlapping writes");
    }
}

#[test]
fn truncate_races_with_readers() {
    let cache = small_cache(512 << 10);
    let f = Arc::new(cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|i| {
            let (f, stop) = (f.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(i);
                let mut buf = vec![0u8; 10_000];
                while !stop.load(SeqCst) {
                    let off = rng.random_range(0..300_000u64);
                    let n = f.read_at(&mut buf, off).unwrap();
                    // The file only ever holds 0x77 bytes or zeros past a truncation point.
                    assert!(buf[..n].iter().all(|&b| b == 0x77 || b == 0));
                }
            })
        })
        .collect();
    let mut rng = StdRng::seed_from_u64(9);
    for _ in 0..300 {
        let len = rng.random_range(0..300_000u64);
        f.set_len(len).unwrap();
        let off = rng.random_range(0..300_000u64);
        f.write_at(&vec![0x77; 5000], off).unwrap();
    }
    stop.store(true, SeqCst);
    for r in readers {
        r.join().unwrap();
    }
    let _ = rng.next_u64();
}

//! Execute-in-place (issue 20, item 6; UBC's XIP): files whose store keeps its bytes in
//! shared memory — `ShmPager` (the `mem` layer's store) and host files on tmpfs — are read,
//! written and mapped in the store's own pages. What each test shows:
//! * the cache holds no copy and charges nothing: `resident_bytes` and the cache's allocated
//!   memory stay 0 while the store holds the data once, however small the budget;
//! * the store sees every write at once, with no writeback, and a mapping shows the store's
//!   own page (a write to the store by any other way is in the mapping at once);
//! * a host file on tmpfs is coherent with other descriptors of it (another program)
//!   both ways, length included;
//! * truncation, growth, holes and closing/forgetting the file lose nothing and keep no
//!   stale byte (checked against a model), under a budget far smaller than the file, with
//!   several threads writing, reading and storing through mappings at once;
//! * with XIP off the same stores are cached as copies, and give the same bytes.

mod common;
use common::*;
use rand::{RngExt, SeedableRng, rngs::StdRng};
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use ubc::pager::ShmPager;
use ubc::{Access, Cache, Length, Pager, Sharing};

const MIB: u64 = 1 << 20;

fn xip_cache(budget: u64) -> Cache {
    Cache::builder().budget(budget).build().unwrap()
}

/// A file in `/dev/shm` (tmpfs), or `None` where there is none (the test says so and passes).
fn tmpfs_dir() -> Option<tempfile::TempDir> {
    let d = tempfile::tempdir_in("/dev/shm").ok()?;
    let st = rustix::fs::statfs(d.path()).ok()?;
    (st.f_type as u64 & 0xffff_ffff == 0x0102_1994).then_some(d)
}

#[test]
fn a_shared_memory_store_is_served_in_place_with_no_copy_and_no_budget() {
    // A 1 MiB budget, a 16 MiB file: without XIP this would evict all the time.
    let cache = xip_cache(MIB);
    let store = Arc::new(ShmPager::new());
    let f = cache.open(store.clone(), Access::ReadWrite).unwrap();
    let data = pattern(1, 0, (16 * MIB) as usize);
    for (i, piece) in data.chunks(100_000).enumerate() {
        f.write_at(piece, i as u64 * 100_000).unwrap();
    }
    // The store has every byte already: no sync, no writeback.
    assert_same(&store_contents(&*store), &data, "store right after the writes");
    let mut back = vec![0u8; data.len()];
    f.read_exact_at(&mut back, 0).unwrap();
    assert_same(&back, &data, "read back");
    let s = cache.stats();
    assert_eq!(s.totals.resident_bytes, 0, "nothing resident in the cache: {s:#?}");
    assert_eq!(s.allocated_bytes, 0, "the cache's memfds hold nothing: {s:#?}");
    assert_eq!(s.totals.evictions, 0, "nothing to evict: {s:#?}");
    assert_eq!(s.totals.get_calls + s.totals.put_calls, 0, "no transfer to or from the store: {s:#?}");
    assert!(s.totals.xip_bytes >= 15 * MIB, "the pages are counted in place: {s:#?}");
    let fs = f.stats();
    assert_eq!(fs.resident_bytes, 0);
    assert!(fs.xip_bytes >= 15 * MIB);
    // One copy: the store's memory is the data, rounded to pages.
    assert_eq!(store.stored_bytes(), 16 * MIB);
    // Syncs and writebacks succeed and write nothing.
    f.sync().unwrap();
    let t = cache.stats().totals;
    assert_eq!((t.put_calls, t.written_bytes, t.read_bytes), (0, 0, 0), "{t:#?}");
}

#[test]
fn a_mapping_of_an_in_place_file_is_the_stores_own_memory() {
    let cache = xip_cache(MIB);
    let store = Arc::new(ShmPager::new());
    let f = cache.open(store.clone(), Access::ReadWrite).unwrap();
    f.write_at(&pattern(2, 0, 4 * MIB as usize), 0).unwrap();
    let mut m = f.map(0..4 * MIB, Access::ReadWrite, Sharing::Shared).unwrap();
    assert_same(&m[..], &pattern(2, 0, 4 * MIB as usize), "mapping");
    // A store through the mapping is in the store at once (no msync, no flusher).
    m[4096 * 3 + 7] = 0xAB;
    let mut b = [0u8; 4096];
    store.get_pages(4096 * 3, &mut b).unwrap();
    assert_eq!(b[7], 0xAB, "the store's page is the mapped page");
    // The store changed by its own pager (below the cache): the mapping shows it at once.
    store.put_pages(4096 * 9, &[0xCD; 4096]).unwrap();
    assert!(m[4096 * 9..4096 * 10].iter().all(|&x| x == 0xCD), "the mapping shows the store's page");
    // And through the cache.
    f.write_at(&[0xEF; 10], 4096 * 20).unwrap();
    assert_eq!(&m[4096 * 20..4096 * 20 + 10], &[0xEF; 10]);
    drop(m);
    f.sync().unwrap();
    let s = cache.stats();
    assert_eq!(s.totals.resident_bytes, 0, "{s:#?}");
    assert_eq!(s.allocated_bytes, 0, "{s:#?}");
}

#[test]
fn a_host_file_on_tmpfs_is_served_in_place_and_coherent_with_other_descriptors() {
    let Some(dir) = tmpfs_dir() else {
        eprintln!("no tmpfs at /dev/shm: skipped");
        return;
    };
    let path = dir.path().join("f");
    let cache = xip_cache(MIB);
    let f = cache.create_path(&path).unwrap();
    let other = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let data = pattern(3, 0, (8 * MIB) as usize);
    f.write_at(&data, 0).unwrap();
    // Another descriptor (another program) sees the bytes and the length at once.
    assert_eq!(other.metadata().unwrap().len(), 8 * MIB);
    let mut back = vec![0u8; data.len()];
    other.read_exact_at(&mut back, 0).unwrap();
    assert_same(&back, &data, "the host file right after the write");
    // The other way: a write through the other descriptor is in the cache's reads and mapping.
    let m = f.map(0..8 * MIB, Access::ReadOnly, Sharing::Shared).unwrap();
    other.write_all_at(&[0x5A; 5000], 3 * MIB + 100).unwrap();
    let mut b = vec![0u8; 5000];
    f.read_exact_at(&mut b, 3 * MIB + 100).unwrap();
    assert!(b.iter().all(|&x| x == 0x5A), "read_at sees the other descriptor's write");
    assert!(m[(3 * MIB + 100) as usize..(3 * MIB + 5100) as usize].iter().all(|&x| x == 0x5A), "so does the mapping");
    drop(m);
    // Length changes reach the host file at once, and zeros come back after a shrink.
    f.set_len(5 * MIB + 10).unwrap();
    assert_eq!(other.metadata().unwrap().len(), 5 * MIB + 10);
    f.set_len(6 * MIB).unwrap();
    let mut tail = vec![1u8; (MIB - 10) as usize];
    other.read_exact_at(&mut tail, 5 * MIB + 10).unwrap();
    assert!(tail.iter().all(|&x| x == 0), "grown bytes read zero in the host file");
    f.read_exact_at(&mut tail, 5 * MIB + 10).unwrap();
    assert!(tail.iter().all(|&x| x == 0), "and through the cache");
    let s = cache.stats();
    assert_eq!(s.totals.resident_bytes, 0, "{s:#?}");
    assert_eq!(s.allocated_bytes, 0, "{s:#?}");
    assert!(s.totals.xip_bytes > 0, "{s:#?}");
}

#[test]
fn a_read_only_open_of_a_tmpfs_file_is_in_place_too() {
    let Some(dir) = tmpfs_dir() else { return };
    let path = dir.path().join("ro");
    std::fs::write(&path, pattern(4, 0, 300_000)).unwrap();
    let cache = xip_cache(MIB);
    let f = cache.open_path(&path, Access::ReadOnly).unwrap();
    let mut b = vec![0u8; 300_000];
    f.read_exact_at(&mut b, 0).unwrap();
    assert_same(&b, &pattern(4, 0, 300_000), "read");
    assert!(f.write_at(b"x", 0).is_err(), "a read-only handle does not write");
    let m = f.map(0..300_000, Access::ReadOnly, Sharing::Shared).unwrap();
    assert_same(&m[..], &pattern(4, 0, 300_000), "mapped");
    assert_eq!(cache.stats().totals.resident_bytes, 0);
}

/// Random operations on an in-place file against a model, then the file closed, pushed out
/// of the cache (its states forgotten: the memory must stay the store's) and read again.
fn model_run(cache: &Cache, open: &dyn Fn() -> ubc::File, seed: u64, ops: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut model: Vec<u8> = Vec::new();
    let f = open();
    const MAX: u64 = 3 * MIB;
    for i in 0..ops {
        match rng.random_range(0..100) {
            0..40 => {
                let off = rng.random_range(0..MAX);
                let len = rng.random_range(1..70_000usize).min((MAX + 1000 - off) as usize);
                let data = pattern(seed ^ i as u64, off, len);
                f.write_at(&data, off).unwrap();
                let end = off as usize + len;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&data);
            }
            40..60 => {
                let off = rng.random_range(0..MAX);
                let mut b = vec![0u8; rng.random_range(1..100_000)];
                let n = f.read_at(&mut b, off).unwrap();
                let want = model.get(off as usize..).map_or(&[][..], |m| &m[..m.len().min(b.len())]);
                assert_same(&b[..n], want, &format!("op {i}: read at {off}"));
            }
            60..70 => {
                let len = rng.random_range(0..MAX);
                f.set_len(len).unwrap();
                model.resize(len as usize, 0);
            }
            70..78 => {
                let a = rng.random_range(0..MAX);
                let b = (a + rng.random_range(1..300_000)).min(MAX);
                f.punch_hole(a..b).unwrap();
                let (a, b) = (a as usize, (b as usize).min(model.len()));
                if a < b {
                    model[a..b].fill(0);
                }
            }
            78..88 if !model.is_empty() => {
                let len = model.len() as u64;
                let a = rng.random_range(0..len);
                let b = (a + rng.random_range(1..200_000)).min(len);
                let mut m = f.map(a..b, Access::ReadWrite, Sharing::Shared).unwrap();
                let v = (i as u8) | 1;
                let step = rng.random_range(1..5000usize);
                for j in (0..m.len()).step_by(step) {
                    m[j] = v;
                    model[a as usize + j] = v;
                }
            }
            88..93 => f.sync().unwrap(),
            93..96 => {
                f.invalidate(0..u64::MAX, Length::Keep).unwrap();
            }
            _ => {
                let _ = f.drop_clean(0..u64::MAX);
            }
        }
        assert_eq!(f.len().unwrap(), model.len() as u64, "op {i}: length");
    }
    let mut all = vec![0u8; model.len()];
    f.read_exact_at(&mut all, 0).unwrap();
    assert_same(&all, &model, "whole file");
    f.close().unwrap();
    drop(f);
    cache.evict_all().unwrap();
    let g = open();
    let mut again = vec![0u8; model.len()];
    assert_eq!(g.len().unwrap(), model.len() as u64, "length after reopening");
    g.read_exact_at(&mut again, 0).unwrap();
    assert_same(&again, &model, "after closing, evicting everything and reopening");
    if cache.stats().totals.xip_bytes > 0 {
        let s = cache.stats();
        assert_eq!(s.totals.resident_bytes, 0, "{s:#?}");
    }
}

#[test]
fn in_place_files_follow_a_model_through_truncation_holes_mappings_and_eviction() {
    guarded("xip model", 240, || {
        for seed in 0..4 {
            let cache = xip_cache(256 << 10);
            let store = Arc::new(ShmPager::new());
            let open = || cache.open(store.clone(), Access::ReadWrite).unwrap();
            model_run(&cache, &open, seed, 600);
            assert_eq!(cache.stats().allocated_bytes, 0);
        }
        if let Some(dir) = tmpfs_dir() {
            for seed in 10..13 {
                let cache = xip_cache(256 << 10);
                let path = dir.path().join(format!("m{seed}"));
                std::fs::write(&path, b"").unwrap();
                let open = || cache.open_path(&path, Access::ReadWrite).unwrap();
                model_run(&cache, &open, seed, 600);
                assert_eq!(cache.stats().allocated_bytes, 0);
            }
        }
    });
}

#[test]
fn with_xip_off_the_same_stores_are_cached_as_copies() {
    guarded("xip off", 240, || {
        for seed in 20..22 {
            let cache = Cache::builder().budget(256 << 10).xip(false).build().unwrap();
            let store = Arc::new(ShmPager::new());
            let open = || cache.open(store.clone(), Access::ReadWrite).unwrap();
            model_run(&cache, &open, seed, 400);
            let s = cache.stats();
            assert_eq!(s.totals.xip_bytes, 0, "{s:#?}");
            assert!(s.totals.get_calls > 0 && s.totals.put_calls > 0, "copies moved: {s:#?}");
        }
        let cache = Cache::builder().budget(MIB).xip(false).build().unwrap();
        let f = cache.open(Arc::new(ShmPager::new()), Access::ReadWrite).unwrap();
        f.write_at(&[1; 100_000], 0).unwrap();
        assert!(cache.stats().totals.resident_bytes > 0);
    });
}

#[test]
fn threads_writing_reading_and_storing_through_mappings_agree_with_the_store() {
    guarded("xip threads", 240, || {
        const THREADS: u64 = 4;
        const REGION: u64 = 2 * MIB;
        let cache = xip_cache(256 << 10);
        let store = Arc::new(ShmPager::new());
        let f = Arc::new(cache.open(store.clone(), Access::ReadWrite).unwrap());
        f.set_len(THREADS * REGION).unwrap();
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let mut rng = StdRng::seed_from_u64(t);
                    let base = t * REGION;
                    let mut model = vec![0u8; REGION as usize];
                    for i in 0..400u64 {
                        let off = rng.random_range(0..REGION - 70_000);
                        match i % 4 {
                            0 | 1 => {
                                let d = pattern(t * 1000 + i, off, rng.random_range(1..70_000));
                                f.write_at(&d, base + off).unwrap();
                                model[off as usize..off as usize + d.len()].copy_from_slice(&d);
                            }
                            2 => {
                                let mut m =
                                    f.map(base + off..base + off + 65_536, Access::ReadWrite, Sharing::Shared).unwrap();
                                for j in (0..m.len()).step_by(997) {
                                    m[j] = (i as u8) | 1;
                                    model[off as usize + j] = (i as u8) | 1;
                                }
                            }
                            _ => {
                                let mut b = vec![0u8; 50_000];
                                f.read_exact_at(&mut b, base + off).unwrap();
                                assert_same(&b, &model[off as usize..off as usize + 50_000], "thread read");
                            }
                        }
                    }
                    model
                })
            })
            .collect();
        let models: Vec<Vec<u8>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let want: Vec<u8> = models.concat();
        assert_same(&store_contents(&*store), &want, "the store, never synced");
        let s = cache.stats();
        assert_eq!(s.totals.resident_bytes, 0, "{s:#?}");
        assert_eq!(s.allocated_bytes, 0, "{s:#?}");
    });
}

#[test]
fn cached_files_keep_their_budget_beside_in_place_files() {
    // An in-place file as large as the budget does not push a cached file's pages out.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk");
    std::fs::write(&path, pattern(7, 0, 512 << 10)).unwrap();
    let cache = xip_cache(MIB);
    let disk = cache.open_path(&path, Access::ReadOnly).unwrap();
    let mut b = vec![0u8; 512 << 10];
    disk.read_exact_at(&mut b, 0).unwrap();
    let before = disk.stats().resident_bytes;
    let mem = cache.open(Arc::new(ShmPager::new()), Access::ReadWrite).unwrap();
    mem.write_at(&pattern(8, 0, (8 * MIB) as usize), 0).unwrap();
    let mut big = vec![0u8; (8 * MIB) as usize];
    mem.read_exact_at(&mut big, 0).unwrap();
    assert_eq!(disk.stats().resident_bytes, before, "the cached file kept its pages");
    assert_eq!(disk.stats().evictions, 0);
}

#[test]
fn a_tmpfs_file_shortened_by_another_program_is_an_error_not_a_crash() {
    let Some(dir) = tmpfs_dir() else { return };
    let path = dir.path().join("short");
    let cache = xip_cache(MIB);
    let f = cache.create_path(&path).unwrap();
    f.write_at(&pattern(9, 0, (6 * MIB) as usize), 0).unwrap();
    let mut b = vec![0u8; 4096];
    f.read_exact_at(&mut b, 5 * MIB).unwrap();
    assert!(f.stats().xip_bytes > 0);
    // Another program cuts the file under the cache (which still knows 6 MiB, more than a window: copies of a small file go by system call anyway): the pages
    // past the new end are gone from the store. A read there gets an I/O error — the copy is
    // a `pread`, where a touch through a window would have killed the process with SIGBUS.
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(4096).unwrap();
    match f.read_exact_at(&mut b, 5 * MIB).unwrap_err() {
        ubc::Error::Os { source, .. } => assert_eq!(source.raw_os_error(), Some(libc::EIO)),
        e => panic!("not an I/O error of the store's memory: {e:?}"),
    }
    // What is left still reads, and the cache takes the new length when told.
    f.read_exact_at(&mut b, 0).unwrap();
    assert_same(&b, &pattern(9, 0, 4096), "the part left");
    f.invalidate(0..u64::MAX, Length::Reload).unwrap();
    assert_eq!(f.len().unwrap(), 4096);
}

#[test]
fn windows_keep_their_bytes_and_private_mappings_their_copies_in_place() {
    let cache = xip_cache(MIB);
    let store = Arc::new(ShmPager::new());
    let f = cache.open(store.clone(), Access::ReadWrite).unwrap();
    f.write_at(&[1; 64 << 10], 0).unwrap();
    // A lent window keeps what it showed when a write changes the store's page under it.
    let w = f.window(4096, 8192).unwrap();
    f.write_at(&[2; 100], 4096 + 50).unwrap();
    assert!(w.iter().all(|&b| b == 1), "the window kept its bytes");
    drop(w);
    let mut b = [0u8; 100];
    f.read_exact_at(&mut b, 4096 + 50).unwrap();
    assert_eq!(b, [2; 100], "the store has the write");
    // A private mapping: its stores stay its own; the file shows through where it did not
    // store (as Linux's MAP_PRIVATE), and its copies are counted against the budget.
    let mut p = f.map(0..64 << 10, Access::ReadWrite, Sharing::Private).unwrap();
    p[8192] = 9;
    f.write_at(&[3; 10], 8192).unwrap();
    f.write_at(&[4; 10], 16384).unwrap();
    assert_eq!(p[8192], 9, "the private store stays");
    assert_eq!(p[16384], 4, "a page not stored to shows the file");
    let mut s = [0u8; 1];
    f.read_exact_at(&mut s, 8192).unwrap();
    assert_eq!(s[0], 3, "the file never sees the private store");
    assert!(cache.stats().private_copy_bytes >= 4096);
    drop(p);
    // A writeback hook hears of in-place writes, in order, at writeback (it cannot hold
    // bytes back: they are in the store already).
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    f.set_writeback_hook(Some(Arc::new(move |r: std::ops::Range<u64>| {
        s2.lock().unwrap().push(r);
        Ok(())
    })))
    .unwrap();
    f.write_at(&[5; 4096], 40960).unwrap();
    f.sync().unwrap();
    assert!(seen.lock().unwrap().iter().any(|r| r.contains(&40960)), "hook: {:?}", seen.lock().unwrap());
}

#[test]
fn stores_through_a_mapping_of_an_in_place_file_are_found_even_after_its_pages_were_dropped() {
    // The coherence of layers above rests on this: the cache hears of every store made
    // through a mapping (the file's watcher, `mapped == true`), whether the page was read
    // before, and after its state was dropped (`drop_clean`, `invalidate`: for XIP pages
    // these forget the state and leave the store's page mapped).
    for (read_first, drop_between) in [(false, false), (true, false), (false, true), (true, true)] {
        let cache = xip_cache(MIB);
        let f = cache.open(Arc::new(ShmPager::new()), Access::ReadWrite).unwrap();
        f.write_at(&[1; MIB as usize], 0).unwrap();
        f.sync().unwrap();
        let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
        let h = heard.clone();
        assert!(f.watch(Arc::new(move |r: std::ops::Range<u64>, mapped: bool| {
            if mapped {
                h.lock().unwrap().push(r)
            }
        })));
        if read_first {
            let mut b = vec![0u8; MIB as usize];
            f.read_exact_at(&mut b, 0).unwrap();
        }
        let mut m = f.map(0..MIB, Access::ReadWrite, Sharing::Shared).unwrap();
        assert_eq!(m[8192], 1);
        if drop_between {
            f.drop_clean(0..u64::MAX).unwrap();
            f.invalidate(0..u64::MAX, Length::Keep).unwrap();
        }
        m[4096 * 100] = 9;
        m.flush().unwrap();
        f.sync().unwrap();
        let got = heard.lock().unwrap().clone();
        assert!(
            got.iter().any(|r| r.contains(&(4096 * 100))),
            "read_first {read_first}, drop_between {drop_between}: heard {got:?}"
        );
        assert!(f.stats().xip_bytes > 0 || drop_between);
    }
}

//! Huge pages (issue 20, item 4): a cache built with `HugePages::Try` takes 2 MiB pages from
//! the host's hugetlb pool when its free pages hold the budget, maps them one PMD per page,
//! tracks stores per huge page, and keeps every byte right through reads, writes, stores,
//! eviction with a budget far below the file, truncation and a pool that runs dry.
//!
//! The hugetlb path needs reserved pages (`/proc/sys/vm/nr_hugepages`). `./scripts/test`
//! reserves them and sets `UBC_TEST_HUGETLB=1`, which makes these tests fail if the cache
//! does not take the pool; run by hand without a pool, they check the fallback instead
//! and say so.

mod common;

use common::{byte_at, guarded, pattern};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use std::io::Write;
use std::sync::Mutex;
use ubc::{Access, Cache, Error, HugePages, Sharing};

const HUGE: u64 = 2 << 20;

/// The pool is the host's, shared by every test here: one at a time.
static POOL: Mutex<()> = Mutex::new(());

fn pool_free() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn pool_total() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn shmem_thp() -> String {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").unwrap_or_default();
    s.split_whitespace().find(|w| w.starts_with('[')).unwrap_or("").trim_matches(['[', ']']).to_string()
}

fn required() -> bool {
    std::env::var("UBC_TEST_HUGETLB").is_ok_and(|v| v == "1")
}

/// A `Try` cache of `budget` bytes on the hugetlb path, or `None` (said on stderr) where the
/// host has no pool for it and the test script did not promise one.
fn hugetlb_cache(budget: u64) -> Option<Cache> {
    let c = Cache::builder().budget(budget).huge_pages(HugePages::Try).build().unwrap();
    let mem = c.stats().page_memory;
    if mem.starts_with("hugetlb") {
        assert_eq!(c.page_size() as u64, HUGE, "{mem}");
        return Some(c);
    }
    assert!(!required(), "UBC_TEST_HUGETLB=1 but the cache did not take the hugetlb pool: {mem}");
    eprintln!("not tested here (no hugetlb pool for {} MiB): {mem}", budget >> 20);
    None
}

fn host_file(dir: &std::path::Path, name: &str, len: u64, seed: u64) -> std::path::PathBuf {
    let p = dir.join(name);
    let mut f = std::fs::File::create(&p).unwrap();
    f.write_all(&pattern(seed, 0, len as usize)).unwrap();
    p
}

/// `VmFlags`-style field `key` (in kB) of the smaps entry of the mapping at `addr`.
fn smaps_kb(addr: usize, key: &str) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ')
            && let Some((a, b)) = range.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = (a..b).contains(&addr);
            continue;
        }
        if inside && let Some(v) = line.strip_prefix(key) {
            return v.trim_start_matches(':').trim().trim_end_matches("kB").trim().parse().unwrap();
        }
    }
    panic!("no smaps entry with {key} for {addr:#x}")
}

#[test]
fn try_takes_the_pool_or_says_why_and_require_refuses() {
    let _g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let free = pool_free();
    let c = Cache::builder().budget(8 << 20).huge_pages(HugePages::Try).build().unwrap();
    let mem = c.stats().page_memory;
    if free >= 4 {
        assert!(mem.starts_with("hugetlb, 2 MiB pages"), "{mem}");
        assert_eq!(c.page_size(), 2 << 20);
    } else {
        assert!(!required(), "pool promised but only {free} pages free");
        assert!(mem.contains("hugetlb pages"), "the report says why not hugetlb: {mem}");
    }
    drop(c);
    // A budget one page more than the whole pool (free or not): never hugetlb.
    let over = (pool_total() + 1) * HUGE;
    let c = Cache::builder().budget(over).huge_pages(HugePages::Try).build().unwrap();
    let mem = c.stats().page_memory;
    assert!(!mem.starts_with("hugetlb"), "{mem}");
    let on_write = matches!(shmem_thp().as_str(), "always" | "within_size" | "force");
    assert_eq!(mem.starts_with("shmem THP"), on_write, "{mem}");
    assert_eq!(c.page_size() as u64, if on_write { HUGE } else { 4096 }, "{mem}");
    drop(c);
    let r = Cache::builder().budget(over).huge_pages(HugePages::Require).build();
    if on_write {
        assert!(r.is_ok());
    } else {
        let e = r.err().expect("Require with no huge-page path fails");
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("huge pages required")), "{e}");
    }
    // Never is the default, and says so; a page size that is not 2 MiB is refused with Try.
    let c = Cache::builder().budget(8 << 20).build().unwrap();
    assert!(c.stats().page_memory.starts_with("shmem, 4 KiB pages (huge pages not asked for)"));
    let e = Cache::builder().budget(8 << 20).page_size(65536).huge_pages(HugePages::Try).build().err().unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

/// Every path against a model, the file six times the budget: `read_at`, `write_at`,
/// stores through a shared mapping, `set_len` into the middle of a huge page and back,
/// eviction under all of it; then the host file, read without ubc, is the model.
#[test]
fn every_path_keeps_every_byte_with_a_budget_far_below_the_file() {
    let _g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    guarded("hugetlb model", 300, || {
        let Some(c) = hugetlb_cache(8 << 20) else { return };
        model_run(c);
    });
}

/// The same on ordinary memfds with 2 MiB cache pages: the shmem THP path's geometry (with
/// THP on, the kernel backs each such page with one folio; the cache's code is the same).
#[test]
fn every_path_keeps_every_byte_on_2mib_shmem_pages() {
    guarded("2 MiB shmem model", 300, || {
        let c = Cache::builder().budget(8 << 20).page_size(2 << 20).window_size(32 << 20).build().unwrap();
        assert!(c.stats().page_memory.starts_with("shmem, 2 MiB pages"), "{}", c.stats().page_memory);
        model_run(c);
    });
}

/// Random `read_at`, `write_at`, stores through a mapping and truncations against a model,
/// the file six times `c`'s 8 MiB budget; then the host file, read without ubc, is the model.
fn model_run(c: Cache) {
    let dir = tempfile::tempdir().unwrap();
    let len = 48u64 << 20;
    let path = host_file(dir.path(), "f", len, 7);
    let mut model = pattern(7, 0, len as usize);
    let f = c.open_path(&path, Access::ReadWrite).unwrap();
    let mut rng = StdRng::seed_from_u64(20);
    let mut buf = vec![0u8; 3 << 20];
    for round in 0..400 {
        let cur = model.len() as u64;
        let off = rng.random_range(0..cur);
        let n = rng.random_range(1..=(3u64 << 20).min(cur - off)) as usize;
        match rng.random_range(0..10) {
            0..=4 => {
                let got = f.read_at(&mut buf[..n], off).unwrap();
                assert_eq!(got, n);
                assert!(buf[..n] == model[off as usize..off as usize + n], "round {round}: read {off}+{n}");
            }
            5..=7 => {
                let data: Vec<u8> = (0..n as u64).map(|i| byte_at(round, i)).collect();
                f.write_at(&data, off).unwrap();
                model[off as usize..off as usize + n].copy_from_slice(&data);
            }
            8 => {
                // Stores through a shared mapping of a stretch around `off`.
                let a = off & !(HUGE - 1);
                let b = (a + 8 * HUGE).min(cur);
                let mut m = f.map(a..b, Access::ReadWrite, Sharing::Shared).unwrap();
                let s: &mut [u8] = &mut m;
                for _ in 0..64 {
                    let i = rng.random_range(0..s.len());
                    let v = (round as u8) | 1;
                    s[i] = v;
                    model[a as usize + i] = v;
                }
                if *s != model[a as usize..b as usize] {
                    let i = s.iter().zip(&model[a as usize..b as usize]).position(|(x, y)| x != y).unwrap();
                    let mut r = vec![0u8; 16];
                    f.read_at(&mut r, a + i as u64).unwrap();
                    panic!(
                        "round {round}: mapping {a}..{b} differs at {} (page {}, +{}): map {:?} model {:?} read_at {:?}",
                        a + i as u64,
                        (a + i as u64) / HUGE,
                        (a + i as u64) % HUGE,
                        &s[i..i + 16],
                        &model[a as usize + i..a as usize + i + 16],
                        r
                    );
                }
                m.flush().unwrap();
            }
            _ => {
                // Cut into the middle of a huge page, then grow back: zeros past the cut.
                let cut = rng.random_range(cur / 2..cur);
                f.set_len(cut).unwrap();
                f.set_len(len).unwrap();
                model.truncate(cut as usize);
                model.resize(len as usize, 0);
            }
        }
        let st = c.stats();
        assert!(st.totals.resident_bytes <= 8 << 20, "round {round}: {} resident", st.totals.resident_bytes);
    }
    let st = c.stats();
    assert!(st.totals.evictions > 0, "the budget was far below the file: {st}");
    f.sync().unwrap();
    drop(f);
    drop(c);
    let host = std::fs::read(&path).unwrap();
    assert_eq!(host.len(), model.len());
    let first = host.iter().zip(&model).position(|(a, b)| a != b);
    assert_eq!(first, None, "the host file differs from the model");
}

/// A mapping of a resident file is mapped at map time, one PMD per cache page: no fault
/// when touched, and the kernel accounts it as hugetlb memory of 2 MiB pages. A first store
/// marks one whole huge page written, and only that one is written back.
#[test]
fn mappings_are_huge_and_stores_are_tracked_per_huge_page() {
    let _g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    guarded("hugetlb mapping", 120, || {
        let Some(c) = hugetlb_cache(32 << 20) else { return };
        let dir = tempfile::tempdir().unwrap();
        let len = 16u64 << 20;
        let path = host_file(dir.path(), "m", len, 3);
        let f = c.open_path(&path, Access::ReadWrite).unwrap();
        let mut buf = vec![0u8; len as usize];
        f.read_at(&mut buf, 0).unwrap(); // resident
        let before = c.stats();
        let mut m = f.map(0..len, Access::ReadWrite, Sharing::Shared).unwrap();
        let addr = m.as_ptr() as usize;
        assert_eq!(smaps_kb(addr, "KernelPageSize"), 2048);
        let sum: u64 = m.iter().step_by(4096).map(|&b| b as u64).sum();
        assert_eq!(sum, buf.iter().step_by(4096).map(|&b| b as u64).sum::<u64>());
        // (Shared or private by the pages' map count: the cache's window may map them too.)
        let huge_kb = smaps_kb(addr, "Shared_Hugetlb") + smaps_kb(addr, "Private_Hugetlb");
        assert_eq!(huge_kb, len >> 10, "every page mapped as a huge page");
        let after = c.stats();
        assert_eq!(after.map_faults - before.map_faults, 0, "resident pages never trap");
        // One store in page 3.
        let written = after.totals.written_bytes;
        m[3 * HUGE as usize + 17] = 0;
        m.flush().unwrap();
        let st = c.stats();
        assert_eq!(st.totals.written_bytes - written, HUGE, "one huge page written back: {st}");
        drop(m);
        drop(f);
        drop(c);
        let host = std::fs::read(&path).unwrap();
        assert_eq!(host[3 * HUGE as usize + 17], 0);
        buf[3 * HUGE as usize + 17] = 0;
        assert!(host == buf);
    });
}

/// A pool emptied by another process after the cache was built: a fill or a new page fails
/// with an error naming the pool, nothing is lost, and it works again once pages are free.
#[test]
fn an_empty_pool_is_an_error_not_a_crash() {
    let _g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    guarded("hugetlb pool exhausted", 120, || {
        let Some(c) = hugetlb_cache(16 << 20) else { return };
        let dir = tempfile::tempdir().unwrap();
        let path = host_file(dir.path(), "e", 8 << 20, 5);
        let f = c.open_path(&path, Access::ReadWrite).unwrap();
        // A file whose pager copies into the cache's page from user space (a memory
        // store, as the compression and encryption layers do): 4 MiB, nothing resident.
        let mem = c.open(std::sync::Arc::new(ubc::pager::MemPager::new()), Access::ReadWrite).unwrap();
        mem.write_at(&pattern(6, 0, 4 << 20), 0).unwrap();
        mem.sync().unwrap();
        mem.invalidate(0..4 << 20, ubc::Length::Keep).unwrap();
        let mut b = vec![0u8; 4096];
        f.read_at(&mut b, 0).unwrap(); // page 0 resident
        f.write_at(&[9u8; 10], 5).unwrap(); // and dirty
        // Take every free page of the pool.
        let hog = hog_pool();
        let e = mem.read_at(&mut b, 3 << 20).unwrap_err();
        assert!(e.to_string().contains("hugetlb pool"), "{e}");
        let e = f.read_at(&mut b, 5 << 20).unwrap_err();
        assert!(e.to_string().contains("hugetlb pool"), "{e}");
        let e = f.write_at(&[1u8; 10], (7 << 20) + 3).unwrap_err();
        assert!(e.to_string().contains("hugetlb pool"), "{e}");
        // The resident page still reads and writes.
        f.read_at(&mut b[..16], 0).unwrap();
        assert_eq!(&b[5..15], &[9u8; 10]);
        f.write_at(&[8u8; 4], 100).unwrap();
        drop(hog);
        mem.read_at(&mut b, 3 << 20).unwrap();
        assert!(b == pattern(6, 3 << 20, 4096));
        f.read_at(&mut b, 5 << 20).unwrap();
        assert!(b == pattern(5, 5 << 20, 4096));
        f.write_at(&[1u8; 10], (7 << 20) + 3).unwrap();
        f.sync().unwrap();
        drop(f);
        drop(c);
        let host = std::fs::read(&path).unwrap();
        assert_eq!(&host[5..15], &[9u8; 10]);
        assert_eq!(&host[100..104], &[8u8; 4]);
        assert_eq!(&host[(7 << 20) + 3..(7 << 20) + 13], &[1u8; 10]);
    });
}

/// A hugetlb memfd holding every free page of the pool until dropped.
fn hog_pool() -> rustix::fd::OwnedFd {
    use rustix::fs::{FallocateFlags, MemfdFlags};
    let fd = rustix::fs::memfd_create("hog", MemfdFlags::CLOEXEC | MemfdFlags::HUGETLB | MemfdFlags::HUGE_2MB).unwrap();
    // A page at a time until the pool says no (others may take or free pages meanwhile).
    let mut n = 0;
    loop {
        rustix::fs::ftruncate(&fd, (n + 1) * HUGE).unwrap();
        match rustix::fs::fallocate(&fd, FallocateFlags::empty(), n * HUGE, HUGE) {
            Ok(()) => n += 1,
            Err(rustix::io::Errno::NOSPC) => break,
            Err(e) => panic!("fallocate(hugetlb): {e}"),
        }
    }
    assert_eq!(pool_free(), 0);
    fd
}

/// The loan path on huge pages: a window keeps the bytes it was lent when the file changes
/// under it (the break copies a whole 2 MiB page into anonymous memory over the hugetlb
/// view). Private mappings are refused: hugetlbfs would drop their copies at eviction.
#[test]
fn windows_keep_their_bytes_and_private_mappings_are_refused_on_huge_pages() {
    let _g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    guarded("hugetlb loans", 120, || {
        let Some(c) = hugetlb_cache(32 << 20) else { return };
        let dir = tempfile::tempdir().unwrap();
        let len = 8u64 << 20;
        let path = host_file(dir.path(), "w", len, 11);
        let f = c.open_path(&path, Access::ReadWrite).unwrap();
        let before = pattern(11, HUGE + 100, 5000);
        let w = f.window(HUGE + 100, 5000).unwrap();
        f.write_at(&[0xAB; 3000], HUGE + 1000).unwrap();
        assert!(*w == before[..], "the window keeps the bytes it was lent");
        drop(w);
        let mut now = before.clone();
        now[900..3900].fill(0xAB);
        let mut b = vec![0u8; 5000];
        f.read_at(&mut b, HUGE + 100).unwrap();
        assert!(b == now, "the file has the write");
        // hugetlbfs drops private copies when eviction punches the page: refused.
        let Err(e) = f.map(0..len, Access::ReadWrite, Sharing::Private) else { panic!("private map accepted") };
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("private mapping")), "{e}");
    });
}

/// Four threads at once, each on its own 4 MiB stretch of one file (two huge pages each,
/// one cache page shared by nobody), mixing `write_at`, `read_at` and stores through a
/// shared mapping of the whole file, with a budget of a third of the file: faults, fills,
/// scans and eviction of huge pages race; every byte is checked against each thread's
/// model, then the host file against the union.
#[test]
fn threads_mixing_writes_reads_and_stores_on_huge_pages() {
    let _g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    guarded("hugetlb threads", 300, || {
        let Some(c) = hugetlb_cache(6 << 20) else { return };
        let dir = tempfile::tempdir().unwrap();
        let stretch = 4u64 << 20;
        let len = 4 * stretch;
        let path = host_file(dir.path(), "t", len, 13);
        let f = std::sync::Arc::new(c.open_path(&path, Access::ReadWrite).unwrap());
        let m = f.map(0..len, Access::ReadWrite, Sharing::Shared).unwrap();
        let base = m.as_ptr() as usize;
        let models: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4u64)
                .map(|t| {
                    let f = f.clone();
                    s.spawn(move || {
                        let lo = t * stretch;
                        let mut model = pattern(13, lo, stretch as usize);
                        let mut rng = StdRng::seed_from_u64(t);
                        let mut buf = vec![0u8; 64 << 10];
                        for round in 0..600u64 {
                            let off = rng.random_range(0..stretch - (64 << 10));
                            let n = rng.random_range(1..=(64 << 10)) as usize;
                            match rng.random_range(0..3) {
                                0 => {
                                    f.read_at(&mut buf[..n], lo + off).unwrap();
                                    assert!(
                                        buf[..n] == model[off as usize..off as usize + n],
                                        "thread {t} round {round}"
                                    );
                                }
                                1 => {
                                    let d: Vec<u8> = (0..n as u64).map(|i| byte_at(round * 4 + t, i)).collect();
                                    f.write_at(&d, lo + off).unwrap();
                                    model[off as usize..off as usize + n].copy_from_slice(&d);
                                }
                                _ => {
                                    let v = (round as u8) | 1;
                                    // SAFETY: the mapping lives until the end of the test;
                                    // this thread alone stores into its stretch.
                                    unsafe { std::ptr::write_volatile((base + (lo + off) as usize) as *mut u8, v) };
                                    model[off as usize] = v;
                                }
                            }
                        }
                        model
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let st = c.stats();
        assert!(st.totals.evictions > 0, "the budget was a third of the file: {st}");
        m.flush().unwrap();
        drop(m);
        c.sync_all().unwrap();
        let host = std::fs::read(&path).unwrap();
        for (t, m) in models.iter().enumerate() {
            let lo = t * stretch as usize;
            let first = host[lo..lo + stretch as usize].iter().zip(m).position(|(a, b)| a != b);
            assert_eq!(first, None, "thread {t}'s stretch differs on the host");
        }
    });
}

/// The shmem THP path, where the host enables it for tmpfs writes: the cache's pages come in
/// huge folios (`ShmemHugePages` grows by the file's size). On a host with THP for shmem
/// off, the cache must say so and keep ordinary pages.
#[test]
fn shmem_thp_path_takes_huge_folios_where_the_host_allows() {
    let _g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    guarded("shmem THP", 120, || {
        let on_write = matches!(shmem_thp().as_str(), "always" | "within_size" | "force");
        // A budget past the whole pool: never hugetlb.
        let c = Cache::builder().budget((pool_total() + 1) * HUGE).huge_pages(HugePages::Try).build().unwrap();
        let mem = c.stats().page_memory;
        if !on_write {
            assert!(std::env::var("UBC_TEST_THP").is_err(), "UBC_TEST_THP set but shmem_enabled is {}", shmem_thp());
            assert!(mem.starts_with("shmem, 4 KiB pages (huge pages tried"), "{mem}");
            eprintln!("not tested here (shmem_enabled is {}): {mem}", shmem_thp());
            return;
        }
        assert!(mem.starts_with("shmem THP, 2 MiB pages"), "{mem}");
        let meminfo = |key: &str| -> u64 {
            let m = std::fs::read_to_string("/proc/meminfo").unwrap();
            let l = m.lines().find(|l| l.starts_with(key)).unwrap();
            l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() << 10
        };
        let before = meminfo("ShmemHugePages:");
        let dir = tempfile::tempdir().unwrap();
        let len = 32u64 << 20;
        let path = host_file(dir.path(), "thp", len, 17);
        let f = c.open_path(&path, Access::ReadOnly).unwrap();
        let mut b = vec![0u8; len as usize];
        f.read_at(&mut b, 0).unwrap();
        assert!(b == pattern(17, 0, len as usize));
        let grew = meminfo("ShmemHugePages:").saturating_sub(before);
        // Other processes may allocate or free shmem THPs meanwhile: most of it is enough.
        eprintln!("ShmemHugePages grew by {} MiB for {} MiB cached", grew >> 20, len >> 20);
        assert!(grew >= len / 2, "ShmemHugePages grew by {grew} B for {len} B cached: {mem}");
    });
}

/// Private copies are counted in cache pages, not system pages: three 4 KiB stores into one
/// 2 MiB cache page of a private mapping are one page (2 MiB) against the budget. (Counted
/// as three cache pages before — and a hugetlb copy, 512 system pages, as 512 cache pages,
/// which made the page daemon evict most of a cache for one private store.)
#[test]
fn private_copies_count_in_cache_pages() {
    guarded("private copies on 2 MiB pages", 60, || {
        let c = Cache::builder().budget(32 << 20).page_size(2 << 20).window_size(32 << 20).build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = host_file(dir.path(), "p", 8 << 20, 19);
        let f = c.open_path(&path, Access::ReadWrite).unwrap();
        let mut p = f.map(0..8 << 20, Access::ReadWrite, Sharing::Private).unwrap();
        for i in 0..3 {
            p[(HUGE as usize) + i * 4096] = 0x33;
        }
        assert_eq!(c.stats().private_copy_bytes, HUGE, "{}", c.stats());
    });
}

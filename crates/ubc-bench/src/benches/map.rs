//! Memory mappings: `ubc::File::map` (the cache's own pages mapped into the caller, faults on
//! non-resident pages served by ubc's userfaultfd handler threads) against the kernel's
//! `mmap(MAP_SHARED)` of a host file (faults served by the kernel's page cache). Pages are
//! touched with volatile loads/stores of one byte per 4 KiB page, so no touch can be elided.
//!
//! Rows (the baseline always runs in the same process, alternating with ubc, `runs` times):
//!
//! * `map_resident_touch`: the file resident in ubc (read once with `read_at`) and in the
//!   kernel's page cache; time *create a fresh mapping of the whole file + touch every page +
//!   drop it*. ubc maps resident pages at map time; the kernel maps them on fault (with its
//!   fault-around, a whole large folio per fault). Both pay setup, page-table population and
//!   teardown; neither touches storage. A sample is several such cycles (one takes
//!   milliseconds); the note has the minor faults per mapping of each side.
//! * `map_cold_seq_touch`: nothing resident: a fresh `Cache` and the kernel's copy dropped
//!   (`fadvise(DONTNEED)`, mincore-checked) before *every* timed run of either side (ubc's
//!   file pager reads the host file, so a warm kernel cache would flatter ubc). Time open +
//!   map + touch every page in order + unmap. ubc's budget is twice the file.
//! * `map_random_read`: both files resident, mapped once, every page already touched (so it
//!   is plain memory for both); time random page-aligned 4 KiB copies out of the mapping. This
//!   measures what remains of ubc in the steady state: only the memory and its page tables.
//!   The note gives how physically contiguous each mapping is (from `/proc/self/pagemap`):
//!   the kernel's large folios are, ubc's 4 KiB memfd pages mostly not, and some TLBs
//!   (AMD's PTE coalescing) reward contiguity.
//! * `map_first_write`: both files resident and clean; a fresh writable shared mapping each
//!   run; time one store to every page. ubc's pages are mapped (write-protected, userfaultfd
//!   `WP_ASYNC`) at map time, so a first store is resolved in the kernel without a trip to
//!   user space; the kernel's first store to a shared file page is a write fault that runs
//!   the file system's `page_mkwrite`. Untimed afterwards: `Mapping::flush` / `msync(MS_SYNC)`
//!   so the next run starts clean again. A sample is a few such mappings, stores summed. Map
//!   creation and flush times, and minor faults during the stores, are in the note.
//! * `mach_map_read_first` / `mach_map_read_second`: the Mach paper's Table 6-3 (reading a
//!   file through a mapping vs. with `read`, first and second time). ubc map-read (map + touch
//!   every page + unmap) of a cold file on a fresh `Cache`, then again on the same `Cache` (now
//!   resident), against the kernel's `read()` of the same file into a 64 KiB buffer, cold
//!   then warm. The note carries the other two cells of each system — ubc `read_at` and
//!   kernel `mmap`, cold and warm — so map vs. read can be compared inside each system too.
//!
//! For the resident rows ubc and the kernel use two identical files (same generator, same
//! size, same file system), so ubc's write-back in `map_first_write` can neither dirty nor
//! invalidate the kernel's copy, and the kernel's `msync` cannot change ubc's.

use super::Ctx;
use super::table1::drop_notes;
use crate::report::{Better, Record, median};
use crate::util::*;
use std::fs::File;
use std::hint::black_box;
use std::path::Path;
use ubc::{Access, Cache, CacheStats, HugePages, Sharing};

/// Touch stride: one byte per 4 KiB page.
const STEP: usize = 4096;
/// `read()` buffer of the Mach rows.
const CHUNK: usize = 64 << 10;

/// Sum of one volatile byte per page of `ptr..ptr+len`.
fn touch(ptr: *const u8, len: usize) -> u64 {
    let mut s = 0u64;
    let mut i = 0;
    while i < len {
        // SAFETY: callers pass a live mapping of at least `len` readable bytes.
        s = s.wrapping_add(unsafe { std::ptr::read_volatile(ptr.add(i)) } as u64);
        i += STEP;
    }
    s
}

/// One volatile store of `v` to the first byte of every page of `ptr..ptr+len`.
fn store(ptr: *mut u8, len: usize, v: u8) {
    let mut i = 0;
    while i < len {
        // SAFETY: callers pass a live writable mapping of at least `len` bytes.
        unsafe { std::ptr::write_volatile(ptr.add(i), v) };
        i += STEP;
    }
}

/// Minor page faults of this process so far (all threads).
fn minflt() -> u64 {
    // SAFETY: getrusage fills the zeroed struct.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) };
    r.ru_minflt as u64
}

/// Mapping counters of ubc, as deltas over a measured span (or totals from a fresh cache).
fn map_counters(before: Option<&CacheStats>, after: &CacheStats) -> String {
    let d = |f: fn(&CacheStats) -> u64| f(after) - before.map_or(0, f);
    let (faults, pages) = (d(|s| s.map_faults), d(|s| s.map_fault_pages));
    let mut s = format!("ubc map mode {}, map faults {faults} ({pages} pages", after.map_mode);
    if faults > 0 {
        s += &format!(", {:.1}/fault", pages as f64 / faults as f64);
    }
    s += ")";
    let sigbus = d(|s| s.map_sigbus);
    if sigbus > 0 {
        s += &format!(", SIGBUS {sigbus}");
    }
    let dirty = d(|s| s.map_dirty_found);
    if dirty > 0 {
        s += &format!(", dirty pages found by scans {dirty}");
    }
    s
}

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let mut out = resident(ctx, Pages::Default);
    out.push(cold_seq(ctx, Pages::Default));
    out.extend(mach(ctx));
    // The same rows on 2 MiB hugetlb pages, where the host's pool can hold the budget
    // (`scripts/bench` reserves one when it may; the notes say which settings were in force).
    match hugetlb_holds(ctx.scale(512 * MIB, 256 * MIB)) {
        Ok(()) => {
            out.extend(resident(ctx, Pages::Hugetlb));
            out.push(cold_seq(ctx, Pages::Hugetlb));
        }
        Err(why) => eprintln!("map: no _hugetlb rows: {why}"),
    }
    out
}

/// Which cache pages a row runs on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pages {
    /// The builder's default: 4 KiB shmem pages.
    Default,
    /// `HugePages::Require` with a pool that holds the budget: 2 MiB hugetlb pages.
    Hugetlb,
}

impl Pages {
    fn suffix(self) -> &'static str {
        match self {
            Pages::Default => "",
            Pages::Hugetlb => "_hugetlb",
        }
    }

    fn cache(self, budget: u64) -> Cache {
        let b = Cache::builder().budget(budget);
        let c = match self {
            Pages::Default => b.build(),
            Pages::Hugetlb => b.huge_pages(HugePages::Require).build(),
        }
        .expect("ubc cache");
        if self == Pages::Hugetlb {
            assert!(c.stats().page_memory.starts_with("hugetlb"), "{}", c.stats().page_memory);
        }
        c
    }
}

/// Whether a cache of `budget` bytes gets hugetlb pages now (else what it gets, and why).
fn hugetlb_holds(budget: u64) -> Result<(), String> {
    let c = Cache::builder().budget(budget).huge_pages(HugePages::Try).build().map_err(|e| e.to_string())?;
    let m = c.stats().page_memory;
    if m.starts_with("hugetlb") { Ok(()) } else { Err(m) }
}

/// The host's huge-page settings, for the notes of the rows they bear on.
fn host_huge_settings() -> String {
    let rd = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_else(|_| "?".into());
    let sel = |s: String| {
        s.split_whitespace().find(|w| w.starts_with('[')).map(|w| w.trim_matches(['[', ']']).to_string()).unwrap_or(s)
    };
    format!(
        "host: nr_hugepages {} (2 MiB, {} free), THP enabled {}, shmem_enabled {}",
        rd("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"),
        rd("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages"),
        sel(rd("/sys/kernel/mm/transparent_hugepage/enabled")),
        sel(rd("/sys/kernel/mm/transparent_hugepage/shmem_enabled")),
    )
}

/// `map_resident_touch`, `map_random_read`, `map_first_write`: one cache, two identical files.
fn resident(ctx: &Ctx, pages: Pages) -> Vec<Record> {
    let sfx = pages.suffix();
    let name = |row: &str| format!("{row}{sfx}");
    let len = ctx.scale(64 * MIB, 32 * MIB);
    let n = len as usize;
    let budget = 2 * len;
    let upath = ctx.dir.join("map_ubc.dat");
    let kpath = ctx.dir.join("map_kernel.dat");
    make_file(&upath, len).expect("make file");
    make_file(&kpath, len).expect("make file");
    let c = pages.cache(budget);
    let f = c.open_path(&upath, Access::ReadWrite).expect("ubc open");
    let mut buf = AlignedBuf::new(CHUNK);
    assert_eq!(ubc_read_all(&f, &mut buf), len); // resident in ubc
    warm_kernel_cache(&kpath);
    let kf = std::fs::OpenOptions::new().read(true).write(true).open(&kpath).expect("open");
    let fair = format!(
        "{} MiB file, ubc budget {} MiB, one byte per 4 KiB page; ubc pages: {}; {}",
        len >> 20,
        budget >> 20,
        c.stats().page_memory,
        host_huge_settings()
    );
    let mut out = vec![];

    // --- map_resident_touch -----------------------------------------------------------
    // One cycle takes milliseconds: each sample is `cycles` of them.
    let cycles = ctx.scale(16, 8);
    let bytes = (cycles * len) as f64;
    let before = c.stats();
    let (mut u, mut k, mut fl, mut uflt, mut kflt) = (vec![], vec![], vec![], 0, 0);
    let floor_fd = crate::floor::memfd(len);
    crate::floor::fill(&floor_fd, n);
    for _ in 0..ctx.runs {
        let f0 = minflt();
        let (secs, s) = time(|| {
            (0..cycles).fold(0u64, |acc, _| {
                let m = f.map(0..len, Access::ReadOnly, Sharing::Shared).expect("ubc map");
                acc.wrapping_add(touch(m.as_ptr(), m.len()))
            })
        });
        uflt += minflt() - f0;
        black_box(s);
        u.push(bytes / secs / 1e9);
        warm_kernel_cache(&kpath);
        let f0 = minflt();
        let (secs, s) = time(|| {
            (0..cycles).fold(0u64, |acc, _| {
                let m = SharedMap::new(&kf, 0, n, false);
                acc.wrapping_add(touch(m.ptr, m.len))
            })
        });
        kflt += minflt() - f0;
        black_box(s);
        k.push(bytes / secs / 1e9);
        // The memfd floor: the same cycles on a bare memfd holding the same bytes.
        let (secs, s) = time(|| {
            (0..cycles).fold(0u64, |acc, _| {
                let m = SharedMap::new(&floor_fd, 0, n, false);
                acc.wrapping_add(touch(m.ptr, m.len))
            })
        });
        black_box(s);
        fl.push(bytes / secs / 1e9);
    }
    let after = c.stats();
    out.push(Record::from_samples(
        &name("map_resident_touch"),
        "GB/s",
        Better::Higher,
        &u,
        &k,
        "kernel mmap (page-cache resident)",
        &format!(
            "{fair}; map + touch every page + unmap, {cycles} cycles per sample, GB of file covered per s; \
             minor faults per mapping of {} pages: ubc {}, kernel {}; {}; target >= 0.5x",
            n.div_ceil(STEP),
            uflt / (cycles * ctx.runs as u64),
            kflt / (cycles * ctx.runs as u64),
            map_counters(Some(&before), &after)
        ),
    ));
    // The floor is a 4 KiB shmem memfd: the floor of the default pages only (hugetlb pages
    // are no such memfd's).
    if pages == Pages::Default {
        out.push(Record::from_samples(
            "map_resident_touch_vs_memfd",
            "GB/s",
            Better::Higher,
            &u,
            &fl,
            "mmap of a bare memfd holding the same bytes (no cache, no userfaultfd)",
            &format!(
                "{fair}; the floor of any cache whose pages live in memfds here: 4 KiB shmem pages, \
             mapped 16 per fault (fault-around), where the kernel maps its file's large folios whole; \
             the floor itself vs. the kernel: {:.2}x; ubc maps resident pages at map time with \
             UFFDIO_CONTINUE (so that eviction can never race a store)",
                median(&fl) / median(&k)
            ),
        ));
    }
    drop(floor_fd);

    // --- map_random_read ----------------------------------------------------------------
    let ops = ctx.scale(2_000_000, 500_000) as usize;
    let offsets = random_offsets(ops, len, 4096, 7);
    let um = f.map(0..len, Access::ReadOnly, Sharing::Shared).expect("ubc map");
    let km = SharedMap::new(&kf, 0, n, false);
    black_box(touch(um.as_ptr(), um.len()));
    black_box(touch(km.ptr, km.len));
    let contig = format!(
        "physically contiguous page neighbours: ubc {}, kernel {}",
        contiguity(um.as_ptr(), n),
        contiguity(km.ptr, n)
    );
    let before = c.stats();
    let random = |src: &[u8]| {
        let mut b = [0u8; 4096];
        let mut sum = 0u64;
        for &off in &offsets {
            let off = off as usize;
            b.copy_from_slice(&black_box(src)[off..off + 4096]);
            sum = sum.wrapping_add(black_box(&b)[17] as u64);
        }
        sum
    };
    let (mut u, mut k) = (vec![], vec![]);
    for _ in 0..ctx.runs {
        let (secs, s) = time(|| random(&um));
        black_box(s);
        u.push(ops as f64 / secs);
        let (secs, s) = time(|| random(km.slice()));
        black_box(s);
        k.push(ops as f64 / secs);
    }
    let after = c.stats();
    drop((um, km));
    out.push(Record::from_samples(
        &name("map_random_read"),
        "ops/s",
        Better::Higher,
        &u,
        &k,
        "kernel mmap (resident, pre-touched)",
        &format!(
            "{} MiB file, {ops} random 4 KiB copies out of a mapping whose pages were all touched before; \
             during timing: {}; {contig}; target >= 0.95x",
            len >> 20,
            map_counters(Some(&before), &after)
        ),
    ));

    // --- map_first_write ----------------------------------------------------------------
    // A sample is `cycles` fresh mappings; only the stores are timed (summed).
    let cycles = ctx.scale(4, 2);
    let pages = (cycles as usize * n.div_ceil(STEP)) as f64;
    let before = c.stats();
    let (mut u, mut k) = (vec![], vec![]);
    let (mut umap, mut kmap, mut uflush, mut kflush) = (vec![], vec![], vec![], vec![]);
    let (mut uflt, mut kflt) = (0, 0);
    for rep in 0..ctx.runs {
        let (mut us, mut ks) = (0.0, 0.0);
        for cycle in 0..cycles {
            let v = 0x40 | (rep as u64 * cycles + cycle) as u8;
            let (secs, mut m) = time(|| f.map(0..len, Access::ReadWrite, Sharing::Shared).expect("ubc map rw"));
            umap.push(secs);
            let p = m.as_mut_ptr();
            let f0 = minflt();
            us += time(|| store(p, n, v)).0;
            uflt += minflt() - f0;
            uflush.push(time(|| m.flush().expect("ubc flush")).0);
            drop(m);
            warm_kernel_cache(&kpath);
            let (secs, m) = time(|| SharedMap::new(&kf, 0, n, true));
            kmap.push(secs);
            let f0 = minflt();
            ks += time(|| store(m.ptr, n, v)).0;
            kflt += minflt() - f0;
            kflush.push(time(|| m.sync()).0);
            drop(m);
        }
        u.push(pages / us);
        k.push(pages / ks);
    }
    let after = c.stats();
    let ms = |v: &[f64]| median(v) * 1e3;
    out.push(Record::from_samples(
        &name("map_first_write"),
        "pages/s",
        Better::Higher,
        &u,
        &k,
        "kernel mmap (resident, clean)",
        &format!(
            "{fair}; fresh writable shared mapping of clean resident pages, first store to every page timed, {cycles} mappings per sample; \
             minor faults per mapping during the stores: ubc {}, kernel {}; untimed: map ubc {:.2} ms vs kernel {:.2} ms, flush ubc {:.1} ms vs msync {:.1} ms; {}; {}; target >= 0.5x",
            uflt / (cycles * ctx.runs as u64),
            kflt / (cycles * ctx.runs as u64),
            ms(&umap),
            ms(&kmap),
            ms(&uflush),
            ms(&kflush),
            map_counters(Some(&before), &after),
            ubc_note(&after, f.stats().io_mode)
        ),
    ));
    drop((f, c));
    let _ = std::fs::remove_file(&upath);
    let _ = std::fs::remove_file(&kpath);
    out
}

/// `map_cold_seq_touch`: nothing resident anywhere before each timed run.
fn cold_seq(ctx: &Ctx, pages: Pages) -> Record {
    let len = ctx.scale(256 * MIB, 128 * MIB);
    let n = len as usize;
    let budget = 2 * len;
    let path = ctx.dir.join("map_cold.dat");
    make_file(&path, len).expect("make file");
    let (mut u, mut k, mut drops) = (vec![], vec![], vec![]);
    let (mut note, mut ud, mut kd) = (String::new(), IoStat::default(), IoStat::default());
    for _ in 0..ctx.runs {
        drops.push(drop_kernel_cache_checked(&path));
        let c = pages.cache(budget);
        let d0 = IoStat::now();
        let (secs, (s, io)) = time(|| {
            let f = c.open_path(&path, Access::ReadOnly).expect("ubc open");
            let m = f.map(0..len, Access::ReadOnly, Sharing::Shared).expect("ubc map");
            (touch(m.as_ptr(), m.len()), f.stats().io_mode)
        });
        ud = IoStat::now().since(&d0);
        black_box(s);
        u.push(len as f64 / secs / 1e9);
        let cs = c.stats();
        note = format!("{}; {}; ubc pages: {}", map_counters(None, &cs), ubc_note(&cs, io), cs.page_memory);
        drop(c);
        drops.push(drop_kernel_cache_checked(&path));
        let d0 = IoStat::now();
        let (secs, s) = time(|| {
            let kf = File::open(&path).expect("open");
            let m = SharedMap::new(&kf, 0, n, false);
            touch(m.ptr, m.len)
        });
        kd = IoStat::now().since(&d0);
        black_box(s);
        k.push(len as f64 / secs / 1e9);
    }
    let _ = std::fs::remove_file(&path);
    Record::from_samples(
        &format!("map_cold_seq_touch{}", pages.suffix()),
        "GB/s",
        Better::Higher,
        &u,
        &k,
        "kernel mmap (cold)",
        &format!(
            "{} MiB file, ubc budget {} MiB, fresh Cache and kernel cache dropped before every run; \
             open + map + touch every page in order + unmap; last run: ubc {}, kernel {}; {note}; {}; target >= 0.7x{}",
            len >> 20,
            budget >> 20,
            ud.describe(1),
            kd.describe(1),
            host_huge_settings(),
            drop_notes(&drops)
        ),
    )
}

/// Time ubc map-read of `path` (open + map + touch + unmap) on `c`.
fn ubc_map_read(c: &Cache, path: &Path, len: u64) -> f64 {
    time(|| {
        let f = c.open_path(path, Access::ReadOnly).expect("ubc open");
        let m = f.map(0..len, Access::ReadOnly, Sharing::Shared).expect("ubc map");
        black_box(touch(m.as_ptr(), m.len()))
    })
    .0
}

/// `mach_map_read_first`, `mach_map_read_second`: the Mach paper's Table 6-3.
fn mach(ctx: &Ctx) -> Vec<Record> {
    let len = ctx.scale(64 * MIB, 32 * MIB);
    let n = len as usize;
    let budget = 2 * len;
    let path = ctx.dir.join("map_mach.dat");
    make_file(&path, len).expect("make file");
    let mut buf = AlignedBuf::new(CHUNK);
    let (mut um1, mut um2, mut ur1, mut ur2) = (vec![], vec![], vec![], vec![]);
    let (mut kr1, mut kr2, mut km1, mut km2) = (vec![], vec![], vec![], vec![]);
    let (mut drops, mut counters) = (vec![], String::new());
    for _ in 0..ctx.runs {
        // ubc map-read: cold, then resident.
        drops.push(drop_kernel_cache_checked(&path));
        let c = Cache::builder().budget(budget).build().expect("ubc cache");
        um1.push(ubc_map_read(&c, &path, len));
        um2.push(ubc_map_read(&c, &path, len));
        counters = map_counters(None, &c.stats());
        drop(c);
        // Kernel read(): cold, then warm.
        drops.push(drop_kernel_cache_checked(&path));
        for v in [&mut kr1, &mut kr2] {
            v.push(
                time(|| {
                    let kf = File::open(&path).expect("open");
                    assert_eq!(kernel_read_all(&kf, &mut buf), len);
                })
                .0,
            );
        }
        // ubc read_at: cold, then resident (note only).
        drops.push(drop_kernel_cache_checked(&path));
        let c = Cache::builder().budget(budget).build().expect("ubc cache");
        for v in [&mut ur1, &mut ur2] {
            v.push(
                time(|| {
                    let f = c.open_path(&path, Access::ReadOnly).expect("ubc open");
                    assert_eq!(ubc_read_all(&f, &mut buf), len);
                })
                .0,
            );
        }
        drop(c);
        // Kernel mmap: cold, then warm (note only).
        drops.push(drop_kernel_cache_checked(&path));
        for v in [&mut km1, &mut km2] {
            v.push(
                time(|| {
                    let kf = File::open(&path).expect("open");
                    let m = SharedMap::new(&kf, 0, n, false);
                    black_box(touch(m.ptr, m.len))
                })
                .0,
            );
        }
    }
    let _ = std::fs::remove_file(&path);
    let ms = |v: &[f64]| median(v) * 1e3;
    let table = format!(
        "ms, map-read vs read: ubc map {:.1}/{:.1}, ubc read_at {:.1}/{:.1}; kernel mmap {:.1}/{:.1}, kernel read {:.1}/{:.1} (first/second)",
        ms(&um1),
        ms(&um2),
        ms(&ur1),
        ms(&ur2),
        ms(&km1),
        ms(&km2),
        ms(&kr1),
        ms(&kr2)
    );
    let head = format!(
        "{} MiB file, ubc budget {} MiB, map-read = open + map + touch one byte per 4 KiB page + unmap, \
         read = open + read() with a 64 KiB buffer; {table}; {counters}",
        len >> 20,
        budget >> 20
    );
    vec![
        Record::from_samples(
            "mach_map_read_first",
            "s",
            Better::Lower,
            &um1,
            &kr1,
            "kernel read() (cold)",
            &format!("{head}; first = fresh Cache, kernel cache dropped{}", drop_notes(&drops)),
        ),
        Record::from_samples(
            "mach_map_read_second",
            "s",
            Better::Lower,
            &um2,
            &kr2,
            "kernel read() (warm)",
            &format!("{head}; second = same Cache right after the first (resident){}", drop_notes(&drops)),
        ),
    ]
}

/// Share of the pages of `ptr..ptr+len` whose physical frame follows the previous page's
/// (from `/proc/self/pagemap`; large folios give runs, 4 KiB shmem pages rarely do), as text.
fn contiguity(ptr: *const u8, len: usize) -> String {
    use std::os::unix::fs::FileExt;
    let ps = sys_page();
    let pages = len / ps;
    let mut b = vec![0u8; pages * 8];
    let ok = File::open("/proc/self/pagemap").and_then(|f| f.read_exact_at(&mut b, (ptr as usize / ps * 8) as u64));
    let pfn: Vec<u64> = b.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap()) & ((1 << 55) - 1)).collect();
    if ok.is_err() || pages < 2 || pfn.iter().all(|&p| p == 0) {
        return "unknown (no PFNs in pagemap)".into();
    }
    let next = pfn.windows(2).filter(|w| w[1] == w[0] + 1).count();
    format!("{:.0}%", 100.0 * next as f64 / (pages - 1) as f64)
}

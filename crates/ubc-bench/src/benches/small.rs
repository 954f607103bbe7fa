//! Many small files (issue 19, items 3 and 5): what a file and a cached page cost.
//!
//! * `small_sync_writes`: create a file, write 4 KiB, sync, close — one file after another,
//!   µs per file; baseline `std::fs` (`File::create`, `write_all`, `sync_all`).
//! * `small_sync_batch`: create and write every file, then one sync of all of them
//!   (`Cache::sync_all`), µs per file; baseline `std::fs` writes and one `syncfs(2)`.
//! * `open_read_small`: open, read and close each of many 4 KiB files that neither side has
//!   cached (the kernel's copies dropped first; ubc a fresh cache), µs per file; baseline
//!   `std::fs::File::open` + `read`.
//! * `meta_bytes_per_page`: the process's anonymous memory (heap: page states, the
//!   replacement policy, tables) per cached 4 KiB page after reading a file the budget
//!   holds, against Linux's `struct page` (64 bytes). File data lives in memfds (shared
//!   memory), not counted here. `meta_bytes_per_page_steady`: the same at steady state past
//!   the budget (evictions happening, the policy's ghost queue full).
//!
//! The ubc side of each timed row makes its cache and drops it inside the timing: a closed
//! file stays cached (its descriptors open) until the cache lets it go, so the drop is where
//! ubc pays what `std::fs` pays at each `close`.

use super::Ctx;
use crate::report::{Better, Record, median};
use crate::util::*;
use std::io::{Read, Write};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use ubc::{Access, Cache};

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let n = ctx.scale(10_000, 2_000) as usize;
    let mut records = vec![sync_each(ctx, n)];
    records.extend(sync_batch(ctx, n));
    records.extend([open_read(ctx, n)]);
    records.extend(meta_per_page(ctx));
    records.push(open_handles_max(ctx));
    for d in ["small_sync", "small_batch", "small_open_read", "small_handles"] {
        let _ = std::fs::remove_dir_all(ctx.dir.join(format!("{d}-{}", std::process::id())));
    }
    records
}

/// An empty directory `name` in the scratch directory.
fn fresh_dir(ctx: &Ctx, name: &str) -> std::path::PathBuf {
    let d = ctx.dir.join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch directory");
    d
}

fn syncfs(dir: &Path) {
    let f = std::fs::File::open(dir).expect("open directory");
    // SAFETY: a plain syscall on a descriptor we own.
    assert_eq!(unsafe { libc::syncfs(f.as_raw_fd()) }, 0, "syncfs");
}

/// Time `std_side` and `ubc_side` (µs per file, `n` files) `2 × runs` times, each side
/// first in half of them. This host's ext4 (no journal) makes the cost of a create depend on the file
/// system's recent past: without a journal, ext4 skips free inodes deleted in the last
/// 60-300 s when it allocates one (`recently_deleted`, reading the inode table block of
/// each), which made creates 10-30x slower in a block group where many files had just been
/// removed (perf: `recently_deleted`, `find_inode_bit` on top). So both sides of a run
/// create their files in the same directory (the same block group: file name prefixes
/// `s` and `u`), a run of `std_side` warms up first, nothing is removed until the end, and
/// the directories are new to this process (a benchmark run right after another still
/// finds the first one's removed inodes: run it after a quiet minute).
fn alternate(
    ctx: &Ctx,
    what: &str,
    n: usize,
    std_side: impl Fn(&Path, &str) -> f64,
    ubc_side: impl Fn(&Path, &str) -> f64,
) -> Samples {
    let root = fresh_dir(ctx, what);
    // Two directories a run: one where `std_side` goes first, one where `ubc_side` does
    // (the second to create in a directory found the files of the first there, and with
    // an odd number of runs a plain alternation gave one side more first places).
    let dirs: Vec<std::path::PathBuf> = (0..=2 * ctx.runs)
        .map(|r| {
            let d = root.join(format!("dir{r}"));
            std::fs::create_dir(&d).expect("scratch directory");
            d
        })
        .collect();
    std_side(&dirs[2 * ctx.runs], "w");
    let mut out = Samples::default();
    let per_file = |secs: f64| secs * 1e6 / n as f64;
    for (k, d) in dirs[..2 * ctx.runs].iter().enumerate() {
        for side in if k % 2 == 0 { [0, 1] } else { [1, 0] } {
            // SAFETY: sync(2) has no preconditions.
            unsafe { libc::sync() };
            if side == 0 {
                let (all, sync) = time(|| std_side(d, "s"));
                out.std.push(per_file(all));
                out.std_sync.push(per_file(sync));
            } else {
                let (all, sync) = time(|| ubc_side(d, "u"));
                out.ubc.push(per_file(all));
                out.ubc_sync.push(per_file(sync));
            }
        }
    }
    // Removed by `run` at the end, for the reason above.
    out
}

/// µs per file of each side, whole and the part its closure reported (the final sync).
#[derive(Default)]
struct Samples {
    ubc: Vec<f64>,
    std: Vec<f64>,
    ubc_sync: Vec<f64>,
    std_sync: Vec<f64>,
}

fn sync_each(ctx: &Ctx, n: usize) -> Record {
    let buf = vec![0x5au8; 4096];
    let s = alternate(
        ctx,
        "small_sync",
        n,
        |d, p| {
            for i in 0..n {
                let mut f = std::fs::File::create(d.join(format!("{p}{i}"))).expect("create");
                f.write_all(&buf).expect("write");
                f.sync_all().expect("fsync");
            }
            0.0
        },
        |d, p| {
            let cache = Cache::builder().budget(256 << 20).build().expect("cache");
            for i in 0..n {
                let f = cache.create_path(d.join(format!("{p}{i}"))).expect("create");
                f.write_at(&buf, 0).expect("write");
                f.sync().expect("sync");
                f.close().expect("close");
            }
            0.0
        },
    );
    Record::from_samples(
        "small_sync_writes",
        "us/file",
        Better::Lower,
        &s.ubc,
        &s.std,
        "std::fs create, write_all, sync_all",
        &format!("{n} new files of 4 KiB, each created, written, synced and closed in turn; target >= 0.9x"),
    )
}

fn sync_batch(ctx: &Ctx, n: usize) -> Vec<Record> {
    let buf = vec![0xa5u8; 4096];
    let s = alternate(
        ctx,
        "small_batch",
        n,
        |d, p| {
            for i in 0..n {
                let mut f = std::fs::File::create(d.join(format!("{p}{i}"))).expect("create");
                f.write_all(&buf).expect("write");
            }
            time(|| syncfs(d)).0
        },
        |d, p| {
            let cache = Cache::builder().budget(256 << 20).build().expect("cache");
            for i in 0..n {
                let f = cache.create_path(d.join(format!("{p}{i}"))).expect("create");
                f.write_at(&buf, 0).expect("write");
            }
            time(|| cache.sync_all().expect("sync_all")).0
        },
    );
    vec![
        Record::from_samples(
            "small_sync_batch",
            "us/file",
            Better::Lower,
            &s.ubc,
            &s.std,
            "std::fs writes, then syncfs",
            &format!(
                "{n} new files of 4 KiB created and written (closed), then one sync of all (Cache::sync_all); \
                 target >= 1.0x"
            ),
        ),
        Record::from_samples(
            "small_sync_batch_sync",
            "us/file",
            Better::Lower,
            &s.ubc_sync,
            &s.std_sync,
            "syncfs after std::fs writes",
            &format!(
                "the sync alone of small_sync_batch: Cache::sync_all of {n} files written into the cache, \
                 against syncfs of the same files written with std::fs; the creates above swing with the host \
                 file system's state"
            ),
        ),
    ]
}

fn open_read(ctx: &Ctx, n: usize) -> Record {
    let d = fresh_dir(ctx, "small_open_read");
    for i in 0..n {
        let mut f = std::fs::File::create(d.join(format!("f{i}"))).expect("create");
        f.write_all(&vec![(i % 251) as u8; 4096]).expect("write");
    }
    syncfs(&d);
    let drop_all = || {
        for i in 0..n {
            drop_kernel_cache(&d.join(format!("f{i}")));
        }
    };
    let (mut u, mut b) = (vec![], vec![]);
    let mut buf = vec![0u8; 4096];
    for _ in 0..ctx.runs {
        drop_all();
        let (secs, ()) = time(|| {
            for i in 0..n {
                let mut f = std::fs::File::open(d.join(format!("f{i}"))).expect("open");
                assert_eq!(f.read(&mut buf).expect("read"), 4096);
            }
        });
        b.push(secs * 1e6 / n as f64);
        drop_all();
        let (secs, ()) = time(|| {
            let cache = Cache::builder().budget(256 << 20).build().expect("cache");
            for i in 0..n {
                let f = cache.open_path(d.join(format!("f{i}")), Access::ReadOnly).expect("open");
                assert_eq!(f.read_at(&mut buf, 0).expect("read"), 4096);
                f.close().expect("close");
            }
        });
        u.push(secs * 1e6 / n as f64);
    }
    Record::from_samples(
        "open_read_small",
        "us/file",
        Better::Lower,
        &u,
        &b,
        "std::fs open + read",
        &format!("{n} files of 4 KiB, the kernel's copies dropped before each side; target >= 0.8x"),
    )
}

/// How many host files can be open at once: ubc `File`s (each with a cached page) against
/// `std::fs::File`s, opened one by one and all kept open, until `EMFILE` or the target of
/// 100,000 (issue 19; 30,000 with `--quick`). The kernel's side stops at the open-file
/// limit; ubc's descriptors live in a bounded pool (`ubc::pager::host_fds`).
fn open_handles_max(ctx: &Ctx) -> Record {
    let n = ctx.scale(100_000, 30_000) as usize;
    let d = fresh_dir(ctx, "small_handles");
    for i in 0..n {
        std::fs::write(d.join(format!("f{i}")), format!("file {i}")).expect("create");
    }
    // Written out first: a direct read of a range the kernel holds dirty waits for its
    // write-back (a device write per file, ~200 us each, which is not what is measured).
    syncfs(&d);
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct we pass.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    let nofile = lim.rlim_cur;
    let mut kernel = Vec::new();
    for i in 0..n {
        match std::fs::File::open(d.join(format!("f{i}"))) {
            Ok(f) => kernel.push(f),
            Err(_) => break,
        }
    }
    let k = kernel.len();
    drop(kernel);
    // SAFETY: glibc's malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
    let before = rss_anon();
    let cache = Cache::builder().budget((n as u64 + 1024) * 4096).max_cached_files(n + 16).build().expect("cache");
    let mut files = Vec::new();
    let mut buf = [0u8; 16];
    let mut error = String::new();
    let (secs, ()) = time(|| {
        for i in 0..n {
            match cache.open_path(d.join(format!("f{i}")), Access::ReadOnly) {
                Ok(f) => {
                    if let Err(e) = f.read_at(&mut buf, 0) {
                        error = e.to_string();
                        break;
                    }
                    files.push(f);
                }
                Err(e) => {
                    error = e.to_string();
                    break;
                }
            }
        }
    });
    // Every one still reads its own bytes (most through a reopened descriptor).
    let wrong = files
        .iter()
        .enumerate()
        .filter(|(i, f)| {
            let want = format!("file {i}");
            let got = f.read_at(&mut buf, 0).map(|m| buf[..m] == *want.as_bytes());
            !matches!(got, Ok(true))
        })
        .count();
    let u = files.len();
    let grown = rss_anon().saturating_sub(before) as f64 / u.max(1) as f64;
    let pool = ubc::pager::host_fds::stats();
    let fds = std::fs::read_dir("/proc/self/fd").map(|r| r.count()).unwrap_or(0);
    // Closed, they stay cached (each with its page): what an idle cached file costs.
    drop(files);
    // What the handles freed goes back first (glibc keeps it otherwise).
    // SAFETY: glibc's malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
    let cached = cache.stats().objects;
    let idle = rss_anon().saturating_sub(before) as f64 / cached.max(1) as f64;
    drop(cache);
    Record::from_samples(
        "open_handles_max",
        "files open",
        Better::Higher,
        &[u as f64],
        &[k as f64],
        "std::fs::File",
        &format!(
            "host files of ~10 bytes opened one by one and all kept open, each with its page cached, until an error or \
             {n}; open-file limit {nofile}; ubc: {:.1} us per open + read, {:.0} bytes of anonymous memory per open \
             file, {fds} descriptors in the process at the end, pool {} open of limit {} ({} parked so far, {} \
             pinned); {wrong} files read wrong bytes at the end{}; closed, {cached} files stay cached at {:.0} \
             bytes each (issue 19 target for an idle cached file: <= 1 KiB, page not counted); target {n} \
             (100,000 without --quick)",
            secs * 1e6 / u.max(1) as f64,
            grown,
            pool.open,
            pool.limit,
            pool.parks,
            pool.pinned,
            if error.is_empty() { String::new() } else { format!("; stopped by: {error}") },
            idle,
        ),
    )
}

/// The process's anonymous resident memory (`RssAnon`), bytes.
fn rss_anon() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

fn meta_per_page(ctx: &Ctx) -> Vec<Record> {
    let len = ctx.scale(1 << 30, 256 << 20);
    let path = ctx.dir.join("meta.dat");
    make_file(&path, len).expect("make file");
    // Touched before any measurement, so that no run counts the buffer as the cache's.
    let mut buf = vec![1u8; 1 << 20];
    let mut u = vec![];
    let mut total = vec![];
    let mut after_drop = 0i64;
    for _ in 0..ctx.runs {
        let m = grown_per_page(&path, len, len + (64 << 20), 1, &mut buf);
        u.push(m.per_page);
        total.push(m.total_per_page);
        after_drop = m.after_drop;
    }
    // Past the budget: the same file through a cache of half its size, read front to back
    // twice, so that pages are evicted and the policy's ghost queue (S3-FIFO's memory of
    // evicted keys, 90% of the budget) is full — the metadata a cache carries at steady state.
    let mut steady = vec![];
    let mut steady_total = vec![];
    let mut evictions = 0;
    for _ in 0..ctx.runs {
        let m = grown_per_page(&path, len, len / 2, 2, &mut buf);
        steady.push(m.per_page);
        steady_total.push(m.total_per_page);
        evictions = m.evictions;
    }
    let (total, steady_total) = (median(&total), median(&steady_total));
    let _ = std::fs::remove_file(&path);
    vec![
        Record::from_samples(
            "meta_bytes_per_page",
            "bytes/page",
            Better::Lower,
            &u,
            &[64.0],
            "Linux struct page",
            &format!(
                "anonymous memory grown per cached 4 KiB page, a {} MiB file read into a budget that holds it, \
                 counted from the first 8 MiB cached on (from before the cache was made, with its threads' stacks \
                 and bounce buffers: {total:.1}); after dropping the cache: {} KiB above the start; target <= 64",
                len >> 20,
                after_drop / 1024
            ),
        ),
        Record::from_samples(
            "meta_bytes_per_page_steady",
            "bytes/page",
            Better::Lower,
            &steady,
            &[64.0],
            "Linux struct page",
            &format!(
                "the same per cached page at steady state past the budget: the {} MiB file read twice through a \
                 {} MiB budget ({evictions} evictions, the ghost queue full; the page table keeps 8 bytes for each \
                 page of the file, resident or not, i.e. 16 of these bytes; from before the cache was made: \
                 {steady_total:.1}); target <= 64",
                len >> 20,
                len >> 21
            ),
        ),
    ]
}

/// What one measurement of [`grown_per_page`] found.
struct Grown {
    /// Anonymous memory grown per cached page while the cache held the file, at the margin.
    per_page: f64,
    /// The same, from before the cache was made.
    total_per_page: f64,
    evictions: u64,
    /// Anonymous memory above the start once the cache was dropped, in bytes.
    after_drop: i64,
}

/// Read `path` (`len` bytes) front to back `passes` times through a fresh cache of `budget`
/// bytes, and measure the process's anonymous memory per cached page, then after the drop.
///
/// Per page means at the margin: the growth from a point where the cache already runs and
/// holds its first `WARM` bytes of the file — its I/O threads started, with their stacks and
/// their 1 MiB bounce buffers for direct reads (`object/fill.rs`), the malloc arenas they use
/// made — to the end, over the pages cached meanwhile. Counted from before the cache was
/// made (`total_per_page`, also reported), the same build measured 52.5–63.0 in a fresh
/// process (first to third cache) and 58.8–66.6 after the other rows of this group (their
/// threads had made more arenas): ~1 MiB of costs per cache and per process, not per page
/// (building the cache and opening the file grew it by 12–276 KiB, budget 32 or 320 MiB;
/// the first 1 MiB read by 0.5–1.4 MiB).
fn grown_per_page(path: &Path, len: u64, budget: u64, passes: u32, buf: &mut [u8]) -> Grown {
    const WARM: u64 = 8 << 20;
    // Heap left free by what ran before would be reused and hide the growth: give it back
    // first. (Not after the drop: whether the cache returns its memory by itself is what
    // `after_drop` shows.)
    // SAFETY: glibc's malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
    let start = rss_anon();
    let cache = Cache::builder().budget(budget).build().expect("cache");
    let f = cache.open_path(path, Access::ReadOnly).expect("open");
    let mut before = None;
    for _ in 0..passes {
        let mut off = 0;
        while off < len {
            f.read_exact_at(buf, off).expect("read");
            off += buf.len() as u64;
            if off >= WARM && before.is_none() {
                before = Some((rss_anon(), cache.stats().totals.resident_bytes));
            }
        }
    }
    let totals = cache.stats().totals;
    let (rss0, res0) = before.unwrap_or((start, 0));
    let pages = (totals.resident_bytes.saturating_sub(res0) / 4096).max(1);
    let now = rss_anon();
    let per_page = now.saturating_sub(rss0) as f64 / pages as f64;
    let total_per_page = now.saturating_sub(start) as f64 / (totals.resident_bytes / 4096).max(1) as f64;
    drop(f);
    drop(cache);
    Grown { per_page, total_per_page, evictions: totals.evictions, after_drop: rss_anon() as i64 - start as i64 }
}

//! Working sets around the budget (issue 19): 4 KiB uniform random reads of a file half, one,
//! two and four times ubc's budget, each compared with the ideal a cache of that budget could
//! reach on this machine, measured in the same run:
//!
//! `ideal = hits × hit cost + misses × O_DIRECT 4 KiB read cost`
//!
//! where the hit cost is ubc's own 4 KiB read of a resident page (a separate, fully resident
//! pass) and the miss cost is a bare `O_DIRECT` `pread` of a random page of the same file
//! (no cache at all). The ratio `ideal / ubc` is 1.0 when a miss costs no more than the device
//! read (target ≥ 0.9). The ubc side counts its own hits and misses, so a policy that misses
//! more than the `budget ÷ file` a uniform pattern allows is charged for it too: the note
//! gives both hit ratios and the resident fraction of the budget.
//!
//! Also: `miss_cost_us` (the ubc time not explained by hits, per miss, at 2× the budget, vs.
//! the `O_DIRECT` read), `ra_pages_per_random_miss` (pages read from the pager per miss of the
//! random pattern: 1.0 means no read-ahead fired; target ≤ 1.05) and `ws_seq_read` (a cold
//! file twice the budget read front to back with 4 KiB `read_at`, so only read-ahead makes it
//! fast, vs. `O_DIRECT` 1 MiB `pread`s of the same file: the device's bandwidth).
//!
//! And `ws_*_vs_quick_cache`: the same reads through the read-through cache a user would
//! build from a well-kept crate instead of ubc — `quick_cache` (S3-FIFO, sharded) holding
//! 4 KiB pages of the file, filled by `O_DIRECT` `pread`, with ubc's budget in pages, warmed
//! the same way (target ≥ 1.0 at every size).

use super::Ctx;
use crate::report::{Better, Record, median};
use crate::util::*;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use ubc::{Access, Cache};

/// One measured pass of ubc over a working set.
struct Pass {
    secs: f64,
    hits: u64,
    misses: u64,
    /// Pages read from the pager.
    read_pages: u64,
    resident: u64,
    /// Latency of the misses, µs: median and 99th percentile.
    miss_lat: (f64, f64),
}

/// The median and 99th percentile of the slowest `misses` of `lat` (ns per read), in µs: a
/// read that missed waited for the device, so the misses are the slowest reads.
fn miss_latency(lat: &mut [u64], misses: u64) -> (f64, f64) {
    lat.sort_unstable();
    let slow = &lat[lat.len() - (misses as usize).min(lat.len())..];
    if slow.is_empty() {
        return (0.0, 0.0);
    }
    let at = |q: f64| slow[((slow.len() - 1) as f64 * q) as usize] as f64 / 1e3;
    (at(0.5), at(0.99))
}

fn open_direct(path: &Path) -> std::fs::File {
    let mut o = std::fs::OpenOptions::new();
    o.read(true).custom_flags(libc::O_DIRECT);
    o.open(path).expect("open O_DIRECT")
}

/// Seconds per 4 KiB `O_DIRECT` read at `n` random offsets of `path`.
fn direct_cost(path: &Path, len: u64, n: usize, seed: u64) -> f64 {
    let f = open_direct(path);
    let mut b = AlignedBuf::new(4096);
    let offs = random_offsets(n, len, 4096, seed);
    let (secs, _) = time(|| {
        for &o in &offs {
            f.read_at(&mut b, o).expect("O_DIRECT pread");
        }
    });
    secs / n as f64
}

/// Seconds per 4 KiB `O_DIRECT` read at `n` random offsets of `path` into a fresh page of a
/// memfd (punched after use, as eviction does): the floor of a miss for any cache keeping its
/// pages in memfds (`floor.rs`): the kernel allocates and zeroes a shmem page under the read.
fn direct_cost_memfd(path: &Path, len: u64, n: usize, seed: u64) -> f64 {
    const WIN: usize = 2 << 20;
    let f = open_direct(path);
    let m = crate::floor::memfd(WIN as u64);
    let w = SharedMap::new(&m, 0, WIN, true);
    let offs = random_offsets(n, len, 4096, seed);
    let mut secs = 0.0;
    for (i, &o) in offs.iter().enumerate() {
        let slot = (i * 4096) % WIN;
        // SAFETY: a page inside our own shared mapping of the memfd.
        let buf = unsafe { std::slice::from_raw_parts_mut(w.ptr.add(slot), 4096) };
        let (t, _) = time(|| f.read_at(buf, o).expect("O_DIRECT pread into memfd"));
        secs += t;
        // SAFETY: punching a page of our own memfd.
        unsafe {
            libc::fallocate(
                std::os::unix::io::AsRawFd::as_raw_fd(&m),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                slot as libc::off_t,
                4096,
            )
        };
    }
    secs / n as f64
}

/// As `direct_cost_memfd`, but the `O_DIRECT` read goes into one reused buffer and `pwrite`
/// copies it into the memfd (which allocates the page without zeroing it or faulting).
fn bounce_cost_memfd(path: &Path, len: u64, n: usize, seed: u64) -> f64 {
    const WIN: u64 = 2 << 20;
    let f = open_direct(path);
    let m = crate::floor::memfd(WIN);
    let mfile = std::fs::File::from(m);
    let mut b = AlignedBuf::new(4096);
    let offs = random_offsets(n, len, 4096, seed);
    let mut secs = 0.0;
    for (i, &o) in offs.iter().enumerate() {
        let slot = (i as u64 * 4096) % WIN;
        let (t, _) = time(|| {
            f.read_at(&mut b, o).expect("O_DIRECT pread");
            mfile.write_at(&b, slot).expect("pwrite into memfd");
        });
        secs += t;
        // SAFETY: punching a page of our own memfd.
        unsafe {
            libc::fallocate(
                std::os::unix::io::AsRawFd::as_raw_fd(&mfile),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                slot as libc::off_t,
                4096,
            )
        };
    }
    secs / n as f64
}

/// The user-space read-through cache of the `_vs_quick_cache` rows: 4 KiB pages of one file
/// in a `quick_cache` of `budget ÷ 4 KiB` items, each miss an `O_DIRECT` `pread` of the page.
struct QuickCache {
    file: std::fs::File,
    pages: quick_cache::sync::Cache<u64, std::sync::Arc<[u8]>>,
    buf: AlignedBuf,
    hits: u64,
    misses: u64,
}

impl QuickCache {
    fn new(path: &Path, budget: u64) -> QuickCache {
        QuickCache {
            file: open_direct(path),
            pages: quick_cache::sync::Cache::new((budget / 4096) as usize),
            buf: AlignedBuf::new(1 << 20),
            hits: 0,
            misses: 0,
        }
    }

    /// Read the 4 KiB page at `off` (page-aligned) into `out`.
    fn read_page(&mut self, out: &mut [u8; 4096], off: u64) {
        let page = off / 4096;
        if let Some(p) = self.pages.get(&page) {
            self.hits += 1;
            out.copy_from_slice(&p);
            return;
        }
        self.misses += 1;
        let n = self.file.read_at(&mut self.buf[..4096], off).expect("O_DIRECT pread");
        assert_eq!(n, 4096, "whole pages inside the file");
        out.copy_from_slice(&self.buf[..4096]);
        self.pages.insert(page, std::sync::Arc::from(&self.buf[..4096]));
    }

    /// The sequential warm-up pass: 1 MiB `O_DIRECT` reads, every page inserted.
    fn load_all(&mut self, len: u64) {
        let mut off = 0;
        while off < len {
            let n = self.file.read_at(&mut self.buf, off).expect("O_DIRECT pread");
            assert!(n > 0 && n % 4096 == 0, "whole pages inside the file");
            for (i, p) in self.buf[..n].chunks(4096).enumerate() {
                self.pages.insert(off / 4096 + i as u64, std::sync::Arc::from(p));
            }
            off += n as u64;
        }
    }
}

/// As `ubc_pass`, through `QuickCache`: seconds, hits, misses of the timed reads and the
/// misses' latency (median and 99th percentile, µs).
fn quick_cache_pass(
    path: &Path,
    len: u64,
    budget: u64,
    warm: usize,
    n: usize,
    seed: u64,
) -> (f64, u64, u64, (f64, f64)) {
    let mut q = QuickCache::new(path, budget);
    q.load_all(len);
    let mut b = [0u8; 4096];
    for &o in &random_offsets(warm, len, 4096, seed ^ 0x5555) {
        q.read_page(&mut b, o);
    }
    let offs = random_offsets(n, len, 4096, seed);
    let (h0, m0) = (q.hits, q.misses);
    let mut lat = Vec::with_capacity(offs.len());
    let (secs, _) = time(|| {
        for &o in &offs {
            let t = std::time::Instant::now();
            q.read_page(&mut b, o);
            lat.push(t.elapsed().as_nanos() as u64);
        }
    });
    let misses = q.misses - m0;
    (secs, q.hits - h0, misses, miss_latency(&mut lat, misses))
}

/// Build a fresh cache of `budget`, bring it to steady state on `path` (one sequential pass
/// and `warm` random reads), then time `n` random reads.
fn ubc_pass(path: &Path, len: u64, budget: u64, warm: usize, n: usize, seed: u64) -> Pass {
    let c = Cache::builder().budget(budget).build().expect("cache");
    let f = c.open_path(path, Access::ReadOnly).expect("open");
    let mut big = AlignedBuf::new(1 << 20);
    ubc_read_all(&f, &mut big);
    let mut b = [0u8; 4096];
    for &o in &random_offsets(warm, len, 4096, seed ^ 0x5555) {
        f.read_at(&mut b, o).expect("read");
    }
    let offs = random_offsets(n, len, 4096, seed);
    let s0 = c.stats().totals;
    let mut lat = Vec::with_capacity(offs.len());
    let (secs, _) = time(|| {
        for &o in &offs {
            let t = std::time::Instant::now();
            f.read_at(&mut b, o).expect("read");
            lat.push(t.elapsed().as_nanos() as u64);
        }
    });
    let s1 = c.stats();
    let t = &s1.totals;
    let misses = t.misses - s0.misses;
    Pass {
        secs,
        hits: t.hits - s0.hits,
        misses,
        miss_lat: miss_latency(&mut lat, misses),
        read_pages: (t.read_bytes - s0.read_bytes) / 4096,
        resident: t.resident_bytes,
    }
}

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let budget = ctx.scale(128 * MIB, 64 * MIB);
    let n = ctx.scale(40_000, 20_000) as usize;
    let nd = ctx.scale(6_000, 3_000) as usize;
    let budget_pages = (budget / 4096) as usize;
    let mut records = vec![];
    // The hit cost: ubc reading a file half the budget, entirely resident in a cache of its
    // own, measured right before each pass it is charged to (the machine is shared: a
    // number taken minutes earlier would compare different loads).
    let hit_path = ctx.dir.join("ws_hit.dat");
    make_file(&hit_path, budget / 2).expect("make file");
    let hit_cache = Cache::builder().budget(budget).build().expect("cache");
    let hit_file = hit_cache.open_path(&hit_path, Access::ReadOnly).expect("open");
    ubc_read_all(&hit_file, &mut AlignedBuf::new(1 << 20));
    let mut hit_round = 0u64;
    let mut hit_cost = || {
        hit_round += 1;
        let offs = random_offsets(n, budget / 2, 4096, 7 + hit_round);
        let mut b = [0u8; 4096];
        let s0 = hit_cache.stats().totals.misses;
        let (secs, _) = time(|| {
            for &o in &offs {
                hit_file.read_at(&mut b, o).expect("read");
            }
        });
        assert_eq!(hit_cache.stats().totals.misses, s0, "the hit-cost file is resident");
        secs / n as f64
    };
    // `UBC_WS_ONLY=ws_2x,...`: only those sizes (for profiling one of them).
    let only = std::env::var("UBC_WS_ONLY").ok();
    for (name, factor2) in [("ws_half", 1u64), ("ws_1x", 2), ("ws_2x", 4), ("ws_4x", 8)] {
        if only.as_ref().is_some_and(|o| !o.split(',').any(|x| x == name)) {
            continue;
        }
        let len = budget * factor2 / 2;
        let path = ctx.dir.join("ws.dat");
        make_file(&path, len).expect("make file");
        drop_kernel_cache(&path);
        let (mut ubc_t, mut ideal_t, mut direct, mut passes, mut floor, mut hits, mut bounce) =
            (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        let (mut quick_t, mut quick_hit_ratio, mut quick_miss) = (vec![], vec![], vec![]);
        for r in 0..ctx.runs {
            let d = direct_cost(&path, len, nd, 99 + r as u64);
            let hit_cost = hit_cost();
            hits.push(hit_cost * 1e6);
            floor.push(direct_cost_memfd(&path, len, nd, 199 + r as u64) * 1e6);
            bounce.push(bounce_cost_memfd(&path, len, nd, 299 + r as u64) * 1e6);
            let (secs, h, m, miss_lat) = quick_cache_pass(&path, len, budget, budget_pages, n, 11 + r as u64);
            quick_miss.push(miss_lat);
            let p = ubc_pass(&path, len, budget, budget_pages, n, 11 + r as u64);
            ubc_t.push(p.secs / n as f64 * 1e6);
            ideal_t.push((p.hits as f64 * hit_cost + p.misses as f64 * d) / n as f64 * 1e6);
            direct.push(d * 1e6);
            passes.push(p);
            quick_t.push(secs / n as f64 * 1e6);
            quick_hit_ratio.push(h as f64 / (h + m) as f64);
        }
        let hit_ratio: Vec<f64> = passes.iter().map(|p| p.hits as f64 / (p.hits + p.misses) as f64).collect();
        let resident: Vec<f64> = passes.iter().map(|p| p.resident as f64 / budget as f64).collect();
        let promised = (budget as f64 / len as f64).min(1.0);
        records.push(Record::from_samples(
            name,
            "µs/read",
            Better::Lower,
            &ubc_t,
            &ideal_t,
            "ideal: hits x hit cost + misses x O_DIRECT read",
            &format!(
                "file {} MiB, budget {} MiB, {n} random 4 KiB reads after a sequential pass and {budget_pages} \
                 random reads; hit cost {:.2} µs, O_DIRECT read {:.1} µs; hit ratio {:.1}% (uniform promises \
                 {:.1}%); resident {:.1}% of the budget; target >= 0.9x",
                len >> 20,
                budget >> 20,
                median(&hits),
                median(&direct),
                100.0 * median(&hit_ratio),
                100.0 * promised,
                100.0 * median(&resident),
            ),
        ));
        records.push(Record::from_samples(
            &format!("{name}_vs_quick_cache"),
            "µs/read",
            Better::Lower,
            &ubc_t,
            &quick_t,
            "quick_cache read-through cache over O_DIRECT pread",
            &format!(
                "the reads of {name} (same offsets, same warm-up) through a quick_cache of {budget_pages} 4 KiB \
                 pages filled by O_DIRECT pread; hit ratio ubc {:.1}%, quick_cache {:.1}%; misses' median / p99 ubc \
                 {:.1} / {:.0} µs, quick_cache {:.1} / {:.0} µs; target >= 1.0x",
                100.0 * median(&hit_ratio),
                100.0 * median(&quick_hit_ratio),
                median(&passes.iter().map(|p| p.miss_lat.0).collect::<Vec<_>>()),
                median(&passes.iter().map(|p| p.miss_lat.1).collect::<Vec<_>>()),
                median(&quick_miss.iter().map(|l| l.0).collect::<Vec<_>>()),
                median(&quick_miss.iter().map(|l| l.1).collect::<Vec<_>>()),
            ),
        ));
        if name == "ws_2x" {
            let miss: Vec<f64> = passes
                .iter()
                .zip(&ubc_t)
                .zip(&hits)
                .map(|((p, &t), &h)| (t * n as f64 - p.hits as f64 * h) / p.misses.max(1) as f64)
                .collect();
            records.push(Record::from_samples(
                "miss_cost_us",
                "µs/miss",
                Better::Lower,
                &miss,
                &direct,
                "O_DIRECT 4 KiB pread",
                &format!(
                    "4 KiB random reads of a file 2x the budget ({} MiB): ubc time less hits x hit cost, per miss; \
                     O_DIRECT read into a fresh memfd page (the memfd floor) {:.1} µs, into a reused buffer \
                     then pwrite into the memfd {:.1} µs",
                    budget >> 20,
                    median(&floor),
                    median(&bounce)
                ),
            ));
            let ra: Vec<f64> = passes.iter().map(|p| p.read_pages as f64 / p.misses.max(1) as f64).collect();
            records.push(Record::from_samples(
                "ra_pages_per_random_miss",
                "pages/miss",
                Better::Lower,
                &ra,
                &vec![1.0; ra.len()],
                "one page per miss",
                "pages read from the pager per miss, 4 KiB uniform random reads of a file 2x the budget; \
                 target <= 1.05",
            ));
        }
        let _ = std::fs::remove_file(&path);
    }
    drop((hit_file, hit_cache));
    let _ = std::fs::remove_file(&hit_path);
    records.push(seq(ctx, budget));
    records
}

/// A cold file twice the budget read front to back with 4 KiB `read_at` (read-ahead is what
/// makes it fast) vs. `O_DIRECT` 1 MiB `pread`s: GB/s.
fn seq(ctx: &Ctx, budget: u64) -> Record {
    let len = 2 * budget;
    let path = ctx.dir.join("ws_seq.dat");
    make_file(&path, len).expect("make file");
    let (mut u, mut d, mut ra, mut misses) = (vec![], vec![], 0, 0);
    for _ in 0..ctx.runs {
        drop_kernel_cache(&path);
        let f = open_direct(&path);
        let mut big = AlignedBuf::new(1 << 20);
        let (secs, _) = time(|| kernel_read_all(&f, &mut big));
        d.push(len as f64 / secs / 1e9);
        drop_kernel_cache(&path);
        let c = Cache::builder().budget(budget).build().expect("cache");
        let f = c.open_path(&path, Access::ReadOnly).expect("open");
        let mut b = AlignedBuf::new(4096);
        let (secs, _) = time(|| ubc_read_all(&f, &mut b));
        u.push(len as f64 / secs / 1e9);
        let t = c.stats().totals;
        ra = t.readahead_pages;
        misses = t.misses;
    }
    let _ = std::fs::remove_file(&path);
    Record::from_samples(
        "ws_seq_read",
        "GB/s",
        Better::Higher,
        &u,
        &d,
        "O_DIRECT 1 MiB pread",
        &format!(
            "cold {} MiB file, budget {} MiB, 4 KiB read_at front to back; last run: {misses} demand misses, \
             {ra} read-ahead pages; target >= 0.9x",
            len >> 20,
            budget >> 20
        ),
    )
}

//! The UBC paper's Table 1 (Silvers, "UBC: An Efficient Unified I/O and Memory Caching
//! Subsystem for NetBSD", USENIX 2000), scaled to this machine: write a new file, overwrite
//! it, read it cold, and re-read a small file. The file is larger than ubc's budget, so ubc
//! must write back and evict while it works; the kernel baseline (`std::fs::File`, pread /
//! pwrite) may use all free RAM as its cache.
//!
//! Every timed run uses a fresh `Cache` (cold ubc), and the kernel's copy of the file is
//! dropped with `posix_fadvise(DONTNEED)` after an fsync before each cold run; the drop is
//! checked with `mincore` and any failure is written in the record's note.

use super::Ctx;
use crate::report::{Better, Record, median};
use crate::util::*;
use std::os::unix::fs::FileExt;
use ubc::{Access, Cache};

const CHUNK: usize = 64 << 10;
const BUDGET: u64 = 256 * MIB;

fn cache() -> Cache {
    Cache::builder().budget(BUDGET).build().expect("ubc cache")
}

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let mut n = ctx.scale(GIB, 384 * MIB);
    // The file, its overwrite and the small re-read file must fit with room to spare.
    let free = disk_free(&ctx.dir);
    let mut size_note = String::new();
    if free < 2 * n + GIB {
        let fit = (free.saturating_sub(GIB) / 2) & !(MIB - 1);
        size_note = format!(" (scaled down from {} MiB: {} MiB free on disk)", n >> 20, free >> 20);
        n = fit.max(BUDGET + 64 * MIB) & !(64 * MIB - 1); // whole 64 MiB windows (floor.rs)
    }
    let ram = mem_available();
    let fair = format!(
        "{} MiB file{size_note}, 64 KiB calls, ubc budget {} MiB; kernel may cache in all {:.1} GiB available RAM",
        n >> 20,
        BUDGET >> 20,
        ram as f64 / GIB as f64
    );
    let path = ctx.dir.join("table1.dat");
    let mut buf = AlignedBuf::new(CHUNK);
    let mut out = vec![];

    // --- write a new file, then sync --------------------------------------------------
    let (mut u, mut k, mut note) = (vec![], vec![], String::new());
    for rep in 0..ctx.runs {
        buf[0] = rep as u8;
        let _ = std::fs::remove_file(&path);
        let c = cache();
        let (secs, io) = time(|| {
            let f = c.create_path(&path).expect("ubc create");
            let mut off = 0;
            while off < n {
                f.write_at(&buf, off).expect("ubc write_at");
                off += CHUNK as u64;
            }
            f.sync().expect("ubc sync");
            f.stats().io_mode
        });
        u.push(n as f64 / secs / 1e9);
        note = ubc_note(&c.stats(), io);
        drop(c);
        let _ = std::fs::remove_file(&path);
        let (secs, _) = time(|| {
            let f = std::fs::File::create(&path).expect("create");
            let mut off = 0;
            while off < n {
                f.write_all_at(&buf, off).expect("pwrite");
                off += CHUNK as u64;
            }
            f.sync_data().expect("fdatasync");
        });
        k.push(n as f64 / secs / 1e9);
    }
    out.push(Record::from_samples(
        "table1_write_new",
        "GB/s",
        Better::Higher,
        &u,
        &k,
        "kernel pwrite + fdatasync",
        &format!("{fair}; create + write + sync timed; {note}"),
    ));

    // --- overwrite the existing file, then sync ---------------------------------------
    let (mut u, mut k, mut note, mut drops, mut fl) = (vec![], vec![], String::new(), vec![], vec![]);
    for rep in 0..ctx.runs {
        buf[0] = 0x80 | rep as u8;
        // The memfd floor (floor.rs): the same overwrite through fresh memfd pages, no cache.
        drops.push(drop_kernel_cache_checked(&path));
        let secs = crate::floor::direct_write_through_memfd(&path, n, &buf, 64 << 20, BUDGET);
        fl.push(n as f64 / secs / 1e9);
        drops.push(drop_kernel_cache_checked(&path));
        let c = cache();
        let (secs, io) = time(|| {
            let f = c.open_path(&path, Access::ReadWrite).expect("ubc open");
            let mut off = 0;
            while off < n {
                f.write_at(&buf, off).expect("ubc write_at");
                off += CHUNK as u64;
            }
            f.sync().expect("ubc sync");
            f.stats().io_mode
        });
        u.push(n as f64 / secs / 1e9);
        note = ubc_note(&c.stats(), io);
        drop(c);
        drops.push(drop_kernel_cache_checked(&path));
        let (secs, _) = time(|| {
            let f = std::fs::OpenOptions::new().write(true).open(&path).expect("open");
            let mut off = 0;
            while off < n {
                f.write_all_at(&buf, off).expect("pwrite");
                off += CHUNK as u64;
            }
            f.sync_data().expect("fdatasync");
        });
        k.push(n as f64 / secs / 1e9);
    }
    out.push(Record::from_samples(
        "table1_overwrite",
        "GB/s",
        Better::Higher,
        &u,
        &k,
        "kernel pwrite + fdatasync",
        &format!("{fair}; file not cached at start; {note}{}", drop_notes(&drops)),
    ));
    out.push(Record::from_samples(
        "table1_overwrite_vs_memfd_floor",
        "GB/s",
        Better::Higher,
        &u,
        &fl,
        "64 KiB copies into fresh memfd pages, O_DIRECT 1 MiB writes, fdatasync; no cache",
        &format!(
            "{fair}; the floor of any cache whose pages live in memfds here (a fresh zeroed shmem page per \
             4 KiB written, O_DIRECT out of it, punched behind), one thread; the floor itself vs. the \
             kernel's overwrite: {:.2}x",
            median(&fl) / median(&k)
        ),
    ));

    // --- sequential read, cold ---------------------------------------------------------
    let (mut u, mut k, mut note, mut drops) = (vec![], vec![], String::new(), vec![]);
    let (mut ud, mut kd, mut fl) = (vec![], vec![], vec![]);
    for _ in 0..ctx.runs {
        // The memfd floor: O_DIRECT into fresh memfd pages, no cache (floor.rs).
        drops.push(drop_kernel_cache_checked(&path));
        let secs = crate::floor::direct_read_into_memfd(&path, n, 1 << 20, 64 << 20, BUDGET);
        fl.push(n as f64 / secs / 1e9);
        drops.push(drop_kernel_cache_checked(&path));
        let c = cache();
        let d0 = IoStat::now();
        let (secs, (got, io)) = time(|| {
            let f = c.open_path(&path, Access::ReadOnly).expect("ubc open");
            (ubc_read_all(&f, &mut buf), f.stats().io_mode)
        });
        assert_eq!(got, n);
        ud.push(IoStat::now().since(&d0));
        u.push(n as f64 / secs / 1e9);
        note = ubc_note(&c.stats(), io);
        drop(c);
        drops.push(drop_kernel_cache_checked(&path));
        let d0 = IoStat::now();
        let (secs, got) = time(|| {
            let f = std::fs::File::open(&path).expect("open");
            kernel_read_all(&f, &mut buf)
        });
        kd.push(IoStat::now().since(&d0));
        assert_eq!(got, n);
        k.push(n as f64 / secs / 1e9);
    }
    out.push(Record::from_samples(
        "table1_cold_read",
        "GB/s",
        Better::Higher,
        &u,
        &k,
        "kernel pread (cold)",
        &format!(
            "{fair}; fresh Cache, kernel cache dropped (fadvise DONTNEED, mincore-checked); last run: \
             ubc {}, kernel {}; {note}{}",
            ud.last().map_or(String::new(), |d| d.describe(1)),
            kd.last().map_or(String::new(), |d| d.describe(1)),
            drop_notes(&drops)
        ),
    ));
    out.push(Record::from_samples(
        "table1_cold_read_vs_memfd_floor",
        "GB/s",
        Better::Higher,
        &u,
        &fl,
        "O_DIRECT 1 MiB reads into fresh memfd pages, no cache",
        &format!(
            "{fair}; the floor of any cache whose pages live in memfds here (allocating and zeroing \
             a fresh shmem page per 4 KiB, pinning it for O_DIRECT, punching it at eviction); \
             the floor itself vs. the kernel's cold read: {:.2}x",
            median(&fl) / median(&k)
        ),
    ));
    let _ = std::fs::remove_file(&path);

    // --- re-read a 50 MiB file five times: cold, then resident --------------------------
    let small = 50 * MIB;
    let spath = ctx.dir.join("table1_50m.dat");
    make_file(&spath, small).expect("make 50 MiB file");
    let (mut u, mut k, mut note, mut drops) = (vec![], vec![], String::new(), vec![]);
    let (mut u_first, mut k_first) = (vec![], vec![]);
    for _ in 0..ctx.runs {
        drops.push(drop_kernel_cache_checked(&spath));
        let c = cache();
        let mut first = 0.0;
        let (secs, io) = time(|| {
            let f = c.open_path(&spath, Access::ReadOnly).expect("ubc open");
            for pass in 0..5 {
                let (s, got) = time(|| ubc_read_all(&f, &mut buf));
                assert_eq!(got, small);
                if pass == 0 {
                    first = s;
                }
            }
            f.stats().io_mode
        });
        u.push(secs);
        u_first.push(first);
        note = ubc_note(&c.stats(), io);
        drop(c);
        drops.push(drop_kernel_cache_checked(&spath));
        let (secs, _) = time(|| {
            let f = std::fs::File::open(&spath).expect("open");
            for pass in 0..5 {
                let (s, got) = time(|| kernel_read_all(&f, &mut buf));
                assert_eq!(got, small);
                if pass == 0 {
                    first = s;
                }
            }
        });
        k.push(secs);
        k_first.push(first);
    }
    let (uf, kf) = (median(&u_first), median(&k_first));
    let (ut, kt) = (median(&u), median(&k));
    out.push(Record::from_samples(
        "table1_reread_50mib",
        "s",
        Better::Lower,
        &u,
        &k,
        "kernel pread",
        &format!(
            "50 MiB x 5 reads, 64 KiB calls, total seconds; cold first read ubc {:.3} s vs kernel {:.3} s, \
             4 resident reads ubc {:.1} GB/s vs kernel {:.1} GB/s; {note}{}",
            uf,
            kf,
            4.0 * small as f64 / (ut - uf) / 1e9,
            4.0 * small as f64 / (kt - kf) / 1e9,
            drop_notes(&drops)
        ),
    ));
    let _ = std::fs::remove_file(&spath);
    out
}

/// Distinct drop failures, for a note ("" when every drop worked).
pub fn drop_notes(drops: &[String]) -> String {
    let mut d: Vec<&String> = drops.iter().filter(|s| !s.is_empty()).collect();
    d.dedup();
    if d.is_empty() {
        String::new()
    } else {
        format!("; WARNING: {}", d.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("; "))
    }
}

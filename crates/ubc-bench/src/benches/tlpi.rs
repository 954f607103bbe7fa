//! TLPI Table 13-1 (Kerrisk, "The Linux Programming Interface", §13.1): the time to copy a
//! file with `read()`/`write()` and different buffer sizes, which shows the cost of a system
//! call per buffer. Here ubc copies with `read_at`/`write_at` of that size from one ubc file
//! into another (no system call while the data is cached); the baseline does the same with
//! `read(2)`/`write(2)` on `std::fs::File` (TLPI's `copy.c`).
//!
//! The source is resident in both caches before the copy (as in TLPI, where it had just been
//! written); the destination is a new file. The copy is timed without a final sync (TLPI's
//! table does not sync either); each repetition syncs and removes the copy untimed.
//! One-byte and 1 KiB buffers copy a small file (a syscall per byte is slow).

use super::Ctx;
use crate::report::{Better, Record};
use crate::util::*;
use std::io::{Read, Write};
use ubc::{Access, Cache};

const BUDGET: u64 = 256 * MIB;

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let small_len = ctx.scale(4 * MIB, MIB);
    let big_len = ctx.scale(100 * MIB, 64 * MIB);
    let small = ctx.dir.join("tlpi_small.dat");
    let big = ctx.dir.join("tlpi_big.dat");
    make_file(&small, small_len).expect("make small file");
    make_file(&big, big_len).expect("make big file");
    let dst = ctx.dir.join("tlpi_copy.dat");
    let mut out = vec![];
    for (name, bs, src, len) in [
        ("tlpi_copy_1b", 1usize, &small, small_len),
        ("tlpi_copy_1k", 1024, &small, small_len),
        ("tlpi_copy_4k", 4096, &big, big_len),
        ("tlpi_copy_64k", 65536, &big, big_len),
    ] {
        let mut buf = vec![0u8; bs];
        let (mut u, mut k, mut note) = (vec![], vec![], String::new());
        for _ in 0..ctx.runs {
            // ubc: a fresh cache, the source read in (untimed), a new destination.
            let _ = std::fs::remove_file(&dst);
            let c = Cache::builder().budget(BUDGET).build().expect("ubc cache");
            let s = c.open_path(src, Access::ReadOnly).expect("ubc open");
            ubc_read_all(&s, &mut vec![0u8; 1 << 20]);
            let (secs, (copied, d)) = time(|| {
                let d = c.create_path(&dst).expect("ubc create");
                let mut off = 0u64;
                loop {
                    let n = s.read_at(&mut buf, off).expect("ubc read_at");
                    if n == 0 {
                        break (off, d);
                    }
                    d.write_at(&buf[..n], off).expect("ubc write_at");
                    off += n as u64;
                }
            });
            assert_eq!(copied, len);
            u.push(len as f64 / secs / 1e6);
            d.sync().expect("ubc sync");
            note = ubc_note(&c.stats(), d.stats().io_mode);
            drop((s, d, c));
            let _ = std::fs::remove_file(&dst);
            // kernel: the source is in the page cache; read(2)/write(2) with file offsets.
            warm_kernel_cache(src);
            let mut sf = std::fs::File::open(src).expect("open");
            let (secs, copied) = time(|| {
                let mut df = std::fs::File::create(&dst).expect("create");
                let mut total = 0u64;
                loop {
                    let n = sf.read(&mut buf).expect("read");
                    if n == 0 {
                        break total;
                    }
                    df.write_all(&buf[..n]).expect("write");
                    total += n as u64;
                }
            });
            assert_eq!(copied, len);
            k.push(len as f64 / secs / 1e6);
            std::fs::File::open(&dst).and_then(|f| f.sync_data()).expect("sync copy");
            let _ = std::fs::remove_file(&dst);
        }
        out.push(Record::from_samples(
            name,
            "MB/s",
            Better::Higher,
            &u,
            &k,
            "kernel read/write",
            &format!(
                "copy {} MiB, {bs} B buffer, source resident, no sync in timing; ubc budget {} MiB; {note}",
                len >> 20,
                BUDGET >> 20
            ),
        ));
    }
    let _ = std::fs::remove_file(&small);
    let _ = std::fs::remove_file(&big);
    out
}

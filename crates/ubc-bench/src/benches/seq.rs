//! Cached sequential reads: a file resident in ubc read front to back with 64 KiB
//! `read_at`, against two baselines on the same data and the same 64 KiB destination
//! buffer: `memcpy` from a plain in-memory copy (the floor: what any cache must pay to copy),
//! and kernel `pread` of the file resident in the kernel's page cache.

use super::Ctx;
use crate::report::{Better, Record};
use crate::util::*;
use std::hint::black_box;
use ubc::{Access, Cache};

const CHUNK: usize = 64 << 10;

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let len = ctx.scale(128 * MIB, 64 * MIB);
    let passes = ctx.scale(8, 4) as usize;
    let budget = 256 * MIB;
    let path = ctx.dir.join("seq.dat");
    make_file(&path, len).expect("make file");
    let c = Cache::builder().budget(budget).build().expect("ubc cache");
    let f = c.open_path(&path, Access::ReadOnly).expect("ubc open");
    let mut buf = AlignedBuf::new(CHUNK);
    ubc_read_all(&f, &mut buf); // now resident in ubc
    warm_kernel_cache(&path);
    let kf = std::fs::File::open(&path).expect("open");
    let mem = std::fs::read(&path).expect("read into memory");
    let before = c.stats();
    let (mut u, mut m, mut k) = (vec![], vec![], vec![]);
    let bytes = (passes as u64 * len) as f64;
    for _ in 0..ctx.runs {
        let (secs, _) = time(|| {
            for _ in 0..passes {
                assert_eq!(ubc_read_all(&f, &mut buf), len);
                black_box(&buf[..]);
            }
        });
        u.push(bytes / secs / 1e9);
        let (secs, _) = time(|| {
            for _ in 0..passes {
                for chunk in black_box(&mem[..]).chunks(CHUNK) {
                    buf[..chunk.len()].copy_from_slice(chunk);
                    black_box(&buf[..]);
                }
            }
        });
        m.push(bytes / secs / 1e9);
        let (secs, _) = time(|| {
            for _ in 0..passes {
                assert_eq!(kernel_read_all(&kf, &mut buf), len);
                black_box(&buf[..]);
            }
        });
        k.push(bytes / secs / 1e9);
    }
    let after = c.stats();
    let misses = after.totals.misses - before.totals.misses;
    let note = format!(
        "{} MiB file x {passes} passes, 64 KiB calls, 1 thread, ubc budget {} MiB; ubc misses during timing {misses}; {}",
        len >> 20,
        budget >> 20,
        ubc_note(&after, f.stats().io_mode)
    );
    drop((f, c));
    let _ = std::fs::remove_file(&path);
    vec![
        Record::from_samples("cached_seq_read", "GB/s", Better::Higher, &u, &m, "memcpy", &note),
        Record::from_samples(
            "cached_seq_read_vs_pread",
            "GB/s",
            Better::Higher,
            &u,
            &k,
            "kernel pread (page-cache resident)",
            &note,
        ),
    ]
}

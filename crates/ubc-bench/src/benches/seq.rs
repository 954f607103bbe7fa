//! Cached sequential reads: a file resident in ubc read front to back with 64 KiB
//! `read_at`, against two baselines on the same data and the same 64 KiB destination
//! buffer: `memcpy` from a plain in-memory copy (the floor: what any cache must pay to copy),
//! and kernel `pread` of the file resident in the kernel's page cache.
//!
//! And the same file consumed in place (each 64 KiB summed as `u64` words, as a checksum or
//! a parser would): through `File::window` loans (UBC's page loanout: no copy; a private
//! view per chunk, kept for the next window) against `read_at` into a buffer then the same sum, and against
//! kernel `pread` then the sum.

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
    // Consumed in place: windows against copies. `step(off)` sums the bytes at `off` and
    // says how many it covered.
    let sum_passes = |step: &mut dyn FnMut(u64) -> (u64, u64)| {
        time(|| {
            let mut s = 0u64;
            for _ in 0..passes {
                let mut off = 0;
                while off < len {
                    let (n, part) = step(off);
                    s = s.wrapping_add(part);
                    off += n;
                }
            }
            s
        })
    };
    let (mut w, mut uc, mut kc) = (vec![], vec![], vec![]);
    for _ in 0..ctx.runs {
        let (secs, check) = sum_passes(&mut |off| {
            let win = f.window(off, CHUNK).expect("window");
            (win.len() as u64, sum_words(&win))
        });
        w.push(bytes / secs / 1e9);
        let (secs, s) = sum_passes(&mut |off| {
            let n = f.read_at(&mut buf, off).expect("read_at");
            (n as u64, sum_words(&buf[..n]))
        });
        uc.push(bytes / secs / 1e9);
        assert_eq!(s, check, "windows and copies read the same bytes");
        let (secs, s) = sum_passes(&mut |off| {
            use std::os::unix::fs::FileExt;
            let n = kf.read_at(&mut buf, off).expect("pread");
            (n as u64, sum_words(&buf[..n]))
        });
        kc.push(bytes / secs / 1e9);
        assert_eq!(s, check, "the kernel reads the same bytes");
    }
    let after = c.stats();
    let misses = after.totals.misses - before.totals.misses;
    let wnote = format!(
        "{} MiB file x {passes} passes, 64 KiB windows summed in place vs 64 KiB read_at into one buffer then summed; loans taken {}, views mapped {}, pages copied {}",
        len >> 20,
        after.loans_taken,
        after.loan_views,
        after.loan_copies
    );
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
        Record::from_samples("cached_window_sum", "GB/s", Better::Higher, &w, &uc, "ubc read_at + sum", &wnote),
        Record::from_samples(
            "cached_window_sum_vs_pread",
            "GB/s",
            Better::Higher,
            &w,
            &kc,
            "kernel pread + sum",
            &wnote,
        ),
    ]
}

/// The sum of `b`'s 8-byte words (and its tail bytes): a consumer that reads every byte.
fn sum_words(b: &[u8]) -> u64 {
    let (words, tail) = b.split_at(b.len() / 8 * 8);
    let mut s = 0u64;
    for w in words.chunks_exact(8) {
        s = s.wrapping_add(u64::from_ne_bytes(w.try_into().unwrap()));
    }
    tail.iter().fold(s, |s, &x| s.wrapping_add(x as u64))
}

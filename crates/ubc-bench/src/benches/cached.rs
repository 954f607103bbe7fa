//! Cached random reads: 4 KiB `read_at` on data resident in ubc vs. kernel `pread` on a
//! file resident in the kernel's page cache (same file, same offsets), 1 and 2 threads.
//!
//! Two working sets: one that fits the CPU caches (8 MiB: the cost is the call itself,
//! where ubc saves the system call) and one that does not (the copy from DRAM dominates
//! both, and ubc's windows use 4 KiB TLB entries where the kernel's direct map uses huge
//! pages). The record names are the small set; `_dram` rows are the large one.

use super::Ctx;
use crate::report::{Better, Record};
use crate::util::{make_file, random_offsets, time, warm_kernel_cache};
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use ubc::{Access, Cache};

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let mut v = one(ctx, 8 << 20, "");
    v.extend(one(ctx, ctx.scale(256 << 20, 64 << 20), "_dram"));
    v
}

fn one(ctx: &Ctx, len: u64, suffix: &str) -> Vec<Record> {
    let path = ctx.dir.join("cached_random.dat");
    make_file(&path, len).unwrap();
    let ops = ctx.scale(2_000_000, 500_000) as usize;
    let cache = Cache::builder().budget(2 * len).build().unwrap();
    let f = Arc::new(cache.open_path(&path, Access::ReadOnly).unwrap());
    // Warm both caches with the whole file.
    let mut big = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < len {
        off += f.read_at(&mut big, off).unwrap() as u64;
    }
    warm_kernel_cache(&path);
    let kfile = Arc::new(std::fs::File::open(&path).unwrap());
    let mut records = vec![];
    for threads in [1usize, 2] {
        let per = ops / threads;
        let offsets: Vec<Arc<Vec<u64>>> =
            (0..threads).map(|t| Arc::new(random_offsets(per, len, 4096, 42 + t as u64))).collect();
        let (mut u, mut k) = (vec![], vec![]);
        for _ in 0..ctx.runs {
            let (secs, _) = time(|| {
                let hs: Vec<_> = offsets
                    .iter()
                    .map(|o| {
                        let (f, o) = (f.clone(), o.clone());
                        std::thread::spawn(move || {
                            let mut b = [0u8; 4096];
                            let mut sum = 0u64;
                            for &off in o.iter() {
                                f.read_at(&mut b, off).unwrap();
                                sum = sum.wrapping_add(b[17] as u64);
                            }
                            sum
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).sum::<u64>()
            });
            u.push(ops as f64 / secs);
            let (secs, _) = time(|| {
                let hs: Vec<_> = offsets
                    .iter()
                    .map(|o| {
                        let (f, o) = (kfile.clone(), o.clone());
                        std::thread::spawn(move || {
                            let mut b = [0u8; 4096];
                            let mut sum = 0u64;
                            for &off in o.iter() {
                                f.read_at(&mut b, off).unwrap();
                                sum = sum.wrapping_add(b[17] as u64);
                            }
                            sum
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).sum::<u64>()
            });
            k.push(ops as f64 / secs);
        }
        let name = if threads == 1 { "cached_random_read_4k" } else { "cached_random_read_4k_2t" };
        records.push(Record::from_samples(
            &format!("{name}{suffix}"),
            "ops/s",
            Better::Higher,
            &u,
            &k,
            "kernel pread (page-cache resident)",
            &format!("{} MiB file, {threads} thread(s), target >= 2.0x", len >> 20),
        ));
    }
    let _ = std::fs::remove_file(&path);
    records
}

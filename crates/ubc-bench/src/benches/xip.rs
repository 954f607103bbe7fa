//! Execute-in-place (issue 20, item 6): a host file on tmpfs read through ubc, which serves
//! it from the file's own tmpfs pages, against the kernel reading the same file.
//!
//! * `xip_tmpfs_randread_4k`: 4 KiB `read_at` at uniform random offsets of a file four times
//!   the budget (ubc) vs `pread` (the kernel), M reads/s.
//! * `xip_tmpfs_seqread`: 1 MiB `read_at` over the whole file vs 1 MiB `pread`, GB/s.
//! * `xip_tmpfs_memory`: memory holding the file after both reads — the tmpfs file's pages
//!   plus every byte the cache's memfds hold — per byte of file, vs the tmpfs file alone
//!   (1.0: one copy). The note gives the same with execute-in-place off (a copy in the
//!   cache up to its budget) for comparison.
//!
//! Skipped (no records) where `/dev/shm` is not tmpfs.

use super::Ctx;
use crate::report::{Better, Record};
use crate::util::*;
use std::fs::File;
use std::hint::black_box;
use std::os::unix::fs::FileExt;
use std::path::Path;
use ubc::{Access, Cache};

/// Bytes the file occupies on tmpfs (`st_blocks`).
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

/// Whether `dir` is on tmpfs.
fn on_tmpfs(dir: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: statfs writes the struct we pass; `c` is a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as u64 & 0xffff_ffff == 0x0102_1994 }
}

/// A scratch directory on /dev/shm, removed when dropped.
struct ShmDir(std::path::PathBuf);

impl Drop for ShmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A 4 KiB read at each of `offsets` with `read`.
fn random_reads(offsets: &[u64], buf: &mut [u8], mut read: impl FnMut(&mut [u8], u64) -> usize) {
    for &o in offsets {
        black_box(read(&mut buf[..4096], o));
    }
}

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let dir = ShmDir(Path::new("/dev/shm").join(format!("ubc-bench-xip-{}", std::process::id())));
    if !on_tmpfs(Path::new("/dev/shm")) || std::fs::create_dir_all(&dir.0).is_err() {
        return vec![];
    }
    let len = ctx.scale(256 * MIB, 64 * MIB);
    let budget = len / 4;
    let path = dir.0.join("xip.dat");
    make_file(&path, len).expect("make file");
    let reads = ctx.scale(1_000_000, 200_000) as usize;
    let offsets = random_offsets(reads, len, 4096, 7);
    let kf = File::open(&path).expect("open");
    let mut buf = vec![0u8; 1 << 20];
    let (mut ur, mut kr, mut us, mut ks) = (vec![], vec![], vec![], vec![]);
    let mut note = String::new();
    let mut mem = (0.0, 0.0);
    for _ in 0..ctx.runs {
        let c = Cache::builder().budget(budget).build().expect("cache");
        let f = c.open_path(&path, Access::ReadOnly).expect("ubc open");
        let (secs, _) = time(|| random_reads(&offsets, &mut buf, |b, o| f.read_at(b, o).expect("read_at")));
        ur.push(reads as f64 / secs / 1e6);
        let (secs, n) = time(|| ubc_read_all(&f, &mut buf));
        us.push(n as f64 / secs / 1e9);
        let cs = c.stats();
        mem.0 = (allocated(&path) + cs.allocated_bytes) as f64 / len as f64;
        note = format!(
            "ubc in place {} MiB, resident {} MiB, cache memfds {} MiB; {}",
            cs.totals.xip_bytes >> 20,
            cs.totals.resident_bytes >> 20,
            cs.allocated_bytes >> 20,
            ubc_note(&cs, f.stats().io_mode)
        );
        drop((f, c));
        let (secs, _) = time(|| random_reads(&offsets, &mut buf, |b, o| kf.read_at(b, o).expect("pread")));
        kr.push(reads as f64 / secs / 1e6);
        let (secs, n) = time(|| kernel_read_all(&kf, &mut buf));
        ks.push(n as f64 / secs / 1e9);
        mem.1 = allocated(&path) as f64 / len as f64;
    }
    // The same reads with execute-in-place off: a copy in the cache, up to its budget.
    let copy = {
        let c = Cache::builder().budget(budget).xip(false).build().expect("cache");
        let f = c.open_path(&path, Access::ReadOnly).expect("ubc open");
        random_reads(&offsets, &mut buf, |b, o| f.read_at(b, o).expect("read_at"));
        ubc_read_all(&f, &mut buf);
        (allocated(&path) + c.stats().allocated_bytes) as f64 / len as f64
    };
    let what = format!("{} MiB file on /dev/shm (tmpfs), ubc budget {} MiB", len >> 20, budget >> 20);
    vec![
        Record::from_samples(
            "xip_tmpfs_randread_4k",
            "M reads/s",
            Better::Higher,
            &ur,
            &kr,
            "kernel pread (tmpfs)",
            &format!("{what}; {reads} reads at uniform random 4 KiB offsets; {note}"),
        ),
        Record::from_samples(
            "xip_tmpfs_seqread",
            "GB/s",
            Better::Higher,
            &us,
            &ks,
            "kernel pread (tmpfs)",
            &format!("{what}; 1 MiB reads of the whole file, after the random reads"),
        ),
        Record::from_samples(
            "xip_tmpfs_memory",
            "x file size",
            Better::Lower,
            &[mem.0],
            &[mem.1],
            "the tmpfs file alone",
            &format!(
                "{what}; memory after both reads: the file's tmpfs pages + the cache's memfds; \
                 with execute-in-place off (a copy in the cache): {copy:.2}x"
            ),
        ),
    ]
}

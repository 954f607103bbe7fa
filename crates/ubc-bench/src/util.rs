//! Shared helpers: test files, dropping the kernel's cache, timing.

use std::fs::File;
use std::io::Write;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::Instant;

/// Create `path` with `len` bytes of non-zero, non-repeating data.
pub fn make_file(path: &Path, len: u64) -> std::io::Result<()> {
    let mut f = File::create(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut done = 0;
    while done < len {
        for chunk in buf.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
        let n = (len - done).min(buf.len() as u64) as usize;
        f.write_all(&buf[..n])?;
        done += n as u64;
    }
    f.sync_all()
}

/// Drop the kernel's cached pages of `path` (write back first). Returns false if refused.
pub fn drop_kernel_cache(path: &Path) -> bool {
    let Ok(f) = File::open(path) else { return false };
    let _ = f.sync_all();
    // SAFETY: plain syscall on a valid fd.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0 }
}

/// Read `path` once so the kernel caches it.
pub fn warm_kernel_cache(path: &Path) {
    let _ = std::fs::read(path);
}

/// Seconds `f` takes.
pub fn time<T>(f: impl FnOnce() -> T) -> (f64, T) {
    let t = Instant::now();
    let r = f();
    (t.elapsed().as_secs_f64(), r)
}

/// Deterministic page-aligned random offsets within `len`.
pub fn random_offsets(n: usize, len: u64, align: u64, seed: u64) -> Vec<u64> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % (len / align)) * align
        })
        .collect()
}

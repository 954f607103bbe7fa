//! The floors of a memfd-backed cache on this machine: the same work done with a bare
//! memfd and no cache at all. ubc keeps each file's pages in a memfd (so that mappings and
//! `read_at` share one copy); whatever the kernel charges for memfd pages — allocating and
//! zeroing a fresh page, mapping 4 KiB pages one by one where a file system maps a large
//! folio at once — no cache built this way can beat. A row "vs. memfd floor" says how close
//! ubc comes to it; a row "vs. kernel" how far that floor is from the kernel's own cache.

use crate::util::SharedMap;
use std::os::unix::io::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// A memfd of `len` bytes (sparse).
pub fn memfd(len: u64) -> OwnedFd {
    // SAFETY: plain syscalls on a fresh descriptor we own.
    unsafe {
        let fd = libc::memfd_create(c"ubc-bench-floor".as_ptr(), libc::MFD_CLOEXEC);
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        let fd = OwnedFd::from_raw_fd(fd);
        assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0, "ftruncate memfd");
        fd
    }
}

/// Walk a fresh memfd of `len` bytes the way a cache of `keep` bytes that evicts in order
/// does: map each `window` of it in turn (its pages are new), let `body` fill or drain it
/// (`body(window address, file offset)`), unmap it, and punch the window `keep` bytes
/// behind. Returns the seconds it all took. => `window` divides `keep`, page multiples.
fn through_fresh_windows(len: u64, window: usize, keep: u64, mut body: impl FnMut(*mut u8, u64)) -> f64 {
    let m = memfd(len);
    let t = std::time::Instant::now();
    let mut off = 0u64;
    while off < len {
        let w = SharedMap::new(&m, off, window, true);
        body(w.ptr, off);
        drop(w);
        if off >= keep {
            // SAFETY: punching a range of our own memfd.
            unsafe {
                libc::fallocate(
                    m.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    (off - keep) as libc::off_t,
                    window as libc::off_t,
                )
            };
        }
        off += window as u64;
    }
    t.elapsed().as_secs_f64()
}

/// Open `path` with `O_DIRECT` (`write`: for writing, else reading).
fn open_direct(path: &Path, write: bool) -> std::fs::File {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(!write)
        .write(write)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open O_DIRECT")
}

/// Read the whole (cold) file at `path` with `O_DIRECT` in `chunk`-byte reads into fresh
/// memfd pages (`through_fresh_windows`). This is ubc's cold read minus the cache: the
/// device, `O_DIRECT` into memfd pages, their allocation and their punching. Returns
/// seconds. => `chunk` divides `window`, both page multiples.
pub fn direct_read_into_memfd(path: &Path, len: u64, chunk: usize, window: usize, keep: u64) -> f64 {
    let f = open_direct(path, false);
    through_fresh_windows(len, window, keep, |w, off| {
        let mut k = 0;
        while k < window && off + (k as u64) < len {
            // SAFETY: `w` maps `window` writable bytes; the read stays within them.
            let n = unsafe {
                libc::pread(f.as_raw_fd(), w.add(k) as *mut libc::c_void, chunk, (off + k as u64) as libc::off_t)
            };
            assert!(n > 0, "pread O_DIRECT: {}", std::io::Error::last_os_error());
            k += n as usize;
        }
    })
}

/// Write `len` bytes over the existing file at `path` the way a memfd-backed cache must:
/// copy `data` (`data.len()`-byte calls) into fresh memfd pages (`through_fresh_windows`),
/// write each window out with `O_DIRECT` in 1 MiB writes, and `fdatasync` at the end. One
/// thread, no overlap of copying and writing (ubc overlaps them, so it can beat this).
/// Returns seconds. => `data.len()` divides `window`, `window` a multiple of 1 MiB, `len`
/// of `window`.
pub fn direct_write_through_memfd(path: &Path, len: u64, data: &[u8], window: usize, keep: u64) -> f64 {
    let f = open_direct(path, true);
    let secs = through_fresh_windows(len, window, keep, |w, off| {
        for k in (0..window).step_by(data.len()) {
            // SAFETY: within the `window` writable bytes of `w`.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), w.add(k), data.len()) };
        }
        for k in (0..window).step_by(1 << 20) {
            // SAFETY: `w` maps `window` bytes; the write stays within them.
            let n = unsafe {
                libc::pwrite(f.as_raw_fd(), w.add(k) as *const libc::c_void, 1 << 20, (off + k as u64) as libc::off_t)
            };
            assert_eq!(n, 1 << 20, "pwrite O_DIRECT: {}", std::io::Error::last_os_error());
        }
    });
    let t = std::time::Instant::now();
    f.sync_data().expect("fdatasync");
    secs + t.elapsed().as_secs_f64()
}

/// Fill memfd `fd` with `len` bytes of non-zero data (resident afterwards).
pub fn fill(fd: &OwnedFd, len: usize) {
    let m = SharedMap::new(fd, 0, len, true);
    // SAFETY: the mapping is `len` writable bytes we own.
    let s = unsafe { std::slice::from_raw_parts_mut(m.ptr, len) };
    for (i, b) in s.iter_mut().enumerate() {
        *b = (i % 251) as u8 + 1;
    }
}

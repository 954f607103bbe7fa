//! Private mappings (`Sharing::Private`, `MAP_PRIVATE`) side by side with the kernel's own
//! `mmap(MAP_PRIVATE)` of a host file doing the same work: a page shows the file as it is
//! until the mapping first stores to it, and from then on its private copy (Linux's
//! behaviour, which POSIX leaves unspecified); the file never sees the stores. And the copies
//! count against the cache's budget.

mod common;
use common::*;
use std::os::unix::fs::FileExt;
use ubc::{Access, Cache, Sharing};

const PAGE: usize = 4096;
const PAGES: usize = 16;

/// The kernel's private mapping of a host file.
struct KernelMap {
    ptr: *mut u8,
    len: usize,
}

impl KernelMap {
    fn new(f: &std::fs::File, len: usize) -> KernelMap {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh mapping of `len` bytes of an open file; unmapped in Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        KernelMap { ptr: p as *mut u8, len }
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: mapped for `len` bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn store(&self, at: usize, b: &[u8]) {
        // SAFETY: in bounds of a writable mapping.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.ptr.add(at), b.len()) }
    }
}

impl Drop for KernelMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

#[test]
fn a_private_mapping_shows_what_the_kernels_shows_step_by_step() {
    let dir = tempfile::tempdir().unwrap();
    let len = PAGES * PAGE;
    let (ka, ub) = (dir.path().join("kernel"), dir.path().join("ubc"));
    for p in [&ka, &ub] {
        std::fs::write(p, pattern(1, 0, len)).unwrap();
    }
    let kf = std::fs::OpenOptions::new().read(true).write(true).open(&ka).unwrap();
    let km = KernelMap::new(&kf, len);
    let cache = Cache::new(16 << 20).unwrap();
    let uf = cache.open_path(&ub, Access::ReadWrite).unwrap();
    let mut um = uf.map(0..len as u64, Access::ReadWrite, Sharing::Private).unwrap();
    let up = um.as_mut_ptr();

    let same = |step: &str| {
        assert_same(&um[..], km.bytes(), &format!("mappings after {step}"));
        let mut ubuf = vec![0u8; len];
        uf.read_exact_at(&mut ubuf, 0).unwrap();
        assert_same(&ubuf, &std::fs::read(&ka).unwrap(), &format!("files after {step}"));
    };
    same("mapping");
    // Touch pages 0 and 1 (read), then write the file there and at page 5 (never touched).
    let _ = (um[0], km.bytes()[0], um[PAGE], km.bytes()[PAGE]);
    for (at, seed) in [(0, 2), (PAGE + 100, 3), (5 * PAGE, 4)] {
        let b = pattern(seed, at as u64, 3000);
        kf.write_all_at(&b, at as u64).unwrap();
        uf.write_at(&b, at as u64).unwrap();
    }
    same("file writes to pages read and not read");
    // Store to pages 2 and 3 through the mappings, then write the file over page 2.
    for m in [0, 1] {
        let b = pattern(5, 0, 2 * PAGE);
        if m == 0 {
            // SAFETY: in bounds of the writable private mapping, which outlives the store.
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), up.add(2 * PAGE), b.len()) };
        } else {
            km.store(2 * PAGE, &b);
        }
    }
    same("private stores");
    let b = pattern(6, 0, PAGE);
    kf.write_all_at(&b, 2 * PAGE as u64).unwrap();
    uf.write_at(&b, 2 * PAGE as u64).unwrap();
    same("a file write over a page the mapping copied");
    // The cache drops its pages (the kernel: its clean page cache): nothing changes.
    uf.sync().unwrap();
    cache.evict_all().unwrap();
    kf.sync_all().unwrap();
    // SAFETY: plain fadvise on an open descriptor.
    unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&kf), 0, 0, libc::POSIX_FADV_DONTNEED) };
    same("the caches dropped");
    // Stores never reached the files.
    uf.sync().unwrap();
    assert_same(&std::fs::read(&ub).unwrap(), &std::fs::read(&ka).unwrap(), "host files");
}

#[test]
fn private_copies_count_against_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::write(&a, pattern(7, 0, 8 << 20)).unwrap();
    std::fs::write(&b, pattern(8, 0, 16 << 20)).unwrap();
    let cache = Cache::new(4 << 20).unwrap();
    let fa = cache.open_path(&a, Access::ReadOnly).unwrap();
    let mut m = fa.map(0..8 << 20, Access::ReadWrite, Sharing::Private).unwrap();
    // Private stores copy 512 pages (2 MiB) — through a read-only handle: the file never
    // sees them.
    for i in 0..512 {
        m[i * PAGE * 2] = 0xee;
    }
    let st = cache.stats();
    assert_eq!(st.private_copy_bytes, 2 << 20, "{st}");
    // Reading another file through the cache now keeps it within the rest of the budget.
    let fb = cache.open_path(&b, Access::ReadOnly).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..16u64 {
        fb.read_exact_at(&mut buf, i << 20).unwrap();
        assert_same(&buf, &pattern(8, i << 20, 1 << 20), "read");
    }
    eventually("the cache makes room for the copies", || {
        cache.stats().totals.resident_bytes <= (2 << 20) + (256 << 10)
    });
    assert_eq!(m[0], 0xee);
    assert_eq!(m[PAGE], byte_at(7, PAGE as u64), "an untouched page shows the file");
    drop(m);
    assert_eq!(cache.stats().private_copy_bytes, 0);
}

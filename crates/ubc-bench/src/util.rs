//! Shared helpers: test files, dropping the kernel's cache, timing.

use std::fs::File;
use std::io::Write;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::Instant;

/// Fill `buf` with the xorshift stream whose state is `x` (non-repeating data).
pub fn fill_pattern(x: &mut u64, buf: &mut [u8]) {
    for chunk in buf.chunks_mut(8) {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// Create `path` with `len` bytes of non-zero, non-repeating data.
pub fn make_file(path: &Path, len: u64) -> std::io::Result<()> {
    let mut f = File::create(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut done = 0;
    while done < len {
        fill_pattern(&mut x, &mut buf);
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

/// Bytes in a MiB, GiB.
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// The system page size.
pub fn sys_page() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// Run `f` on a fresh shared read-only mapping of `path` (its address, the page size, and
/// mincore's byte per page: bit 0 set where the page is in the kernel's page cache; mapping
/// does not fault anything in). `None` if the file cannot be opened or mapped or mincore
/// fails; an empty file gives `f` an empty slice at address 0.
fn with_residency<T>(path: &Path, f: impl FnOnce(usize, usize, &[u8]) -> T) -> Option<T> {
    let file = File::open(path).ok()?;
    let len = file.metadata().ok()?.len() as usize;
    let ps = sys_page();
    if len == 0 {
        return Some(f(0, ps, &[]));
    }
    // SAFETY: read-only shared mapping of a file we hold open; unmapped below.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return None;
    }
    let mut vec = vec![0u8; len.div_ceil(ps)];
    // SAFETY: `vec` has one byte per page of the mapping.
    let ok = unsafe { libc::mincore(p, len, vec.as_mut_ptr()) } == 0;
    let r = ok.then(|| f(p as usize, ps, &vec));
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(p, len) };
    r
}

/// Pages of `path` resident in the kernel's page cache, and its length in pages. `None` if
/// it cannot be checked.
pub fn kernel_resident(path: &Path) -> Option<(u64, u64)> {
    with_residency(path, |_, _, pages| (pages.iter().filter(|&&b| b & 1 != 0).count() as u64, pages.len() as u64))
}

/// The physical pages (page frame numbers) of `path` resident in the kernel's page cache,
/// or `None` where /proc/self/pagemap gives no frame numbers (they need `CAP_SYS_ADMIN`).
/// Two files can share pages — a FUSE passthrough file maps its backing file's — so the
/// memory two files hold is the size of the union of their frames, not the sum. Resident
/// pages are touched (a read of one byte) to map them; no page is read from a device.
pub fn resident_frames(path: &Path) -> Option<std::collections::HashSet<u64>> {
    use std::os::unix::fs::FileExt;
    let pagemap = File::open("/proc/self/pagemap").ok()?;
    with_residency(path, |base, ps, pages| {
        let mut frames = std::collections::HashSet::new();
        for i in pages.iter().enumerate().filter(|(_, b)| **b & 1 != 0).map(|(i, _)| i) {
            let addr = base + i * ps;
            // SAFETY: in bounds of the mapping; the page is resident, so the load faults it
            // in from the page cache without I/O.
            unsafe { std::ptr::read_volatile(addr as *const u8) };
            let mut e = [0u8; 8];
            pagemap.read_exact_at(&mut e, (addr / ps * 8) as u64).ok()?;
            let entry = u64::from_le_bytes(e);
            let pfn = entry & ((1 << 55) - 1);
            if entry >> 63 == 0 || pfn == 0 {
                return None;
            }
            frames.insert(pfn);
        }
        Some(frames)
    })
    .flatten()
}

/// Drop the kernel's cached pages of `path` and check with mincore that it worked.
/// Returns a note for the record: empty if the file is fully out of the page cache.
pub fn drop_kernel_cache_checked(path: &Path) -> String {
    if !drop_kernel_cache(path) {
        return "posix_fadvise(DONTNEED) refused: kernel cache NOT dropped".into();
    }
    match kernel_resident(path) {
        Some((0, _)) => String::new(),
        Some((r, n)) => format!("kernel cache drop incomplete: {r}/{n} pages still resident"),
        None => "mincore check failed: kernel cache drop unverified".into(),
    }
}

/// Free bytes on the file system holding `dir`.
pub fn disk_free(dir: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    // SAFETY: statvfs writes into the zeroed struct.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return u64::MAX;
    }
    s.f_bavail as u64 * s.f_frsize as u64
}

/// `MemAvailable` from /proc/meminfo, in bytes.
pub fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        })
        .map_or(0, |kib| kib * 1024)
}

/// A buffer of `len` bytes of non-zero data, aligned to 4 KiB (usable for O_DIRECT).
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain owned memory.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> AlignedBuf {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null(), "allocation failed");
        let mut b = AlignedBuf { ptr, len };
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for c in b.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
        b
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: owned allocation of `len` bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: owned allocation of `len` bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, std::alloc::Layout::from_size_align(self.len.max(1), 4096).unwrap()) }
    }
}

/// Read a ubc file sequentially with `buf`-sized `read_at` calls; returns bytes read.
pub fn ubc_read_all(f: &ubc::File, buf: &mut [u8]) -> u64 {
    let mut off = 0;
    loop {
        let n = f.read_at(buf, off).expect("ubc read_at");
        if n == 0 {
            return off;
        }
        off += n as u64;
    }
}

/// Read a host file sequentially with `buf`-sized `pread` calls; returns bytes read.
pub fn kernel_read_all(f: &File, buf: &mut [u8]) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut off = 0;
    loop {
        let n = f.read_at(buf, off).expect("pread");
        if n == 0 {
            return off;
        }
        off += n as u64;
    }
}

/// The interesting parts of ubc's statistics, for a record's note: the file's `io_mode`
/// and the cache-wide counters that are not zero.
pub fn ubc_note(cs: &ubc::CacheStats, io_mode: ubc::IoMode) -> String {
    let t = &cs.totals;
    let mib = |b: u64| b as f64 / MIB as f64;
    let mut parts = vec![format!("ubc io_mode {io_mode:?}")];
    if t.hits + t.misses > 0 {
        parts.push(format!("hit {:.1}%", 100.0 * t.hit_ratio()));
    }
    if t.get_calls > 0 {
        parts.push(format!("pager read {:.0} MiB/{} calls", mib(t.read_bytes), t.get_calls));
    }
    if t.put_calls > 0 {
        parts.push(format!("pager wrote {:.0} MiB/{} calls", mib(t.written_bytes), t.put_calls));
    }
    if t.readahead_pages > 0 {
        parts.push(format!(
            "readahead {} pages (used {}, wasted {})",
            t.readahead_pages, t.readahead_hits, t.readahead_waste
        ));
    }
    if t.evictions > 0 {
        parts.push(format!("evictions {}", t.evictions));
    }
    if cs.throttled_ms > 0 {
        parts.push(format!("writers throttled {} ms", cs.throttled_ms));
    }
    if cs.flusher_runs > 0 {
        parts.push(format!("flusher rounds {}", cs.flusher_runs));
    }
    if t.writeback_errors > 0 {
        parts.push(format!("WRITEBACK ERRORS {}", t.writeback_errors));
    }
    parts.join(", ")
}

/// A small deterministic generator (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(s) over `n` items: rank r (0-based) has weight 1/(r+1)^s. Sampled by inverting the
/// CDF (binary search), so it is exact for any `s`.
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Zipf {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|r| {
                acc += (r as f64).powf(-s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }
    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

/// This process's storage I/O from `/proc/self/io`: bytes really read from the device
/// (page-cache hits and memfd copies are not counted; O_DIRECT reads are), bytes written
/// (buffered writes count when they dirty the page cache), and read/write system calls.
#[derive(Debug, Clone, Copy, Default)]
pub struct IoStat {
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub syscr: u64,
    pub syscw: u64,
}

impl IoStat {
    pub fn now() -> IoStat {
        let s = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
        let get = |k: &str| {
            s.lines()
                .find_map(|l| l.strip_prefix(k).and_then(|v| v.trim_start_matches(':').trim().parse::<u64>().ok()))
                .unwrap_or(0)
        };
        IoStat {
            read_bytes: get("read_bytes"),
            write_bytes: get("write_bytes"),
            syscr: get("syscr"),
            syscw: get("syscw"),
        }
    }

    /// Counts since `earlier`.
    pub fn since(&self, earlier: &IoStat) -> IoStat {
        IoStat {
            read_bytes: self.read_bytes.saturating_sub(earlier.read_bytes),
            write_bytes: self.write_bytes.saturating_sub(earlier.write_bytes),
            syscr: self.syscr.saturating_sub(earlier.syscr),
            syscw: self.syscw.saturating_sub(earlier.syscw),
        }
    }

    pub fn add(&self, o: &IoStat) -> IoStat {
        IoStat {
            read_bytes: self.read_bytes + o.read_bytes,
            write_bytes: self.write_bytes + o.write_bytes,
            syscr: self.syscr + o.syscr,
            syscw: self.syscw + o.syscw,
        }
    }

    /// "read X MiB, wrote Y MiB from/to storage", divided by `per`.
    pub fn describe(&self, per: u64) -> String {
        let per = per.max(1) as f64;
        format!(
            "storage read {:.0} MiB, written {:.0} MiB",
            self.read_bytes as f64 / per / MIB as f64,
            self.write_bytes as f64 / per / MIB as f64
        )
    }
}

/// `mmap(MAP_SHARED)` of `len` bytes of a file or memfd at `offset`; unmapped on drop.
pub struct SharedMap {
    pub ptr: *mut u8,
    pub len: usize,
}

impl SharedMap {
    pub fn new(fd: &impl AsRawFd, offset: u64, len: usize, writable: bool) -> SharedMap {
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: a fresh shared mapping at a kernel-chosen address of a descriptor the
        // caller holds open; it aliases no Rust object and is unmapped in `drop`.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), offset as libc::off_t)
        };
        assert!(p != libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        SharedMap { ptr: p as *mut u8, len }
    }

    pub fn slice(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is mapped for as long as `self` lives (callers map only
        // bytes within the file).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// `msync(MS_SYNC)`.
    pub fn sync(&self) {
        // SAFETY: our mapping.
        let rc = unsafe { libc::msync(self.ptr as *mut libc::c_void, self.len, libc::MS_SYNC) };
        assert_eq!(rc, 0, "msync: {}", std::io::Error::last_os_error());
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// The file system holding `dir` (longest matching mount point): "ext4 on /dev/vda".
pub fn file_system(dir: &Path) -> String {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let mp = pre.split_whitespace().nth(4)?;
            let mut p = post.split_whitespace();
            let (fs, src) = (p.next()?, p.next()?);
            dir.starts_with(mp).then(|| (mp.len(), format!("{fs} on {src}")))
        })
        .max_by_key(|x| x.0)
        .map_or_else(|| "unknown file system".into(), |x| x.1)
}

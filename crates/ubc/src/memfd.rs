//! The memory that holds cached pages: memfds, whose pages are allocated when first
//! written (through a window, a mapping or `pwrite`) and freed by punching a hole, which
//! also removes them from every mapping.
//!
//! # Objects share memfds
//!
//! An object's pages at file offsets below [`SLICE`] (1 TiB) live in a *slice* of a memfd
//! the whole cache shares (the cache's [`Arena`]): the slice starts at `base`, and file
//! offset `o` is memfd offset `base + o`, so a window or a user mapping of any range below
//! 1 TiB is still one contiguous `mmap`. Pages at or past 1 TiB live in a memfd of the
//! object's own, at their file offsets, made when the first such page is; a mapping across
//! 1 TiB is two `mmap`s, the second placed right after the first (`MAP_FIXED`). So a cached
//! file costs no descriptor for its pages (before, every object with a page held a memfd:
//! 15,000 cached files were 15,000 descriptors, and the process's limit was the limit on
//! cached files), and making an object's memory is no system call.
//!
//! Slices are never reused: an arena memfd hands out `max_size() / SLICE` of them
//! (8,388,607), and is closed when the last object of it is dropped; then the next one is
//! made. A slice is punched whole (up to the highest offset ever touched) when its object
//! is dropped. Not reusing them means a mapping that outlives its object — a forked
//! child's copy of a user mapping, which ubc does not track — never shows another object's
//! pages (it reads zeros where the object's pages were punched, as it would after an
//! eviction).
//!
//! Under a finite `RLIMIT_FSIZE` below 1 TiB there are no slices (every offset of a memfd
//! must stay below the limit): every object then has a memfd of its own, as before.
//!
//! # Lanes
//!
//! The arena hands slices out of [`lanes`] memfds in turn, not one. Every `pwrite` into a
//! tmpfs file and every hole punched in it takes that file's inode lock (`i_rwsem`,
//! exclusive: `shmem_file_write_iter`, `shmem_fallocate`), so with one memfd for the whole
//! cache every fill and every eviction of every file waited for every other — a sequential
//! write through `dir | aead | zstd` spent 3–5 % of its samples spinning on that lock (`perf`:
//! `rwsem_spin_on_owner` under `Memory::write_at`), its three domains' fills and the page
//! daemon's punches all queued on one inode. Reads (`shmem_file_read_iter`) and faults take
//! no inode lock. The lanes' memfds are made together at the first slice: a cache holds
//! none before its first cached page, and a fixed number (a descriptor each) from then on.

use crate::error::{Error, Result};
use crate::huge::PageMemory;
use crate::pager::Access;
use parking_lot::Mutex;
use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{FallocateFlags, MemfdFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::sync::{Arc, OnceLock, Weak};

/// The largest size a memfd may have (tmpfs allows `MAX_LFS_FILESIZE`, 2^63 - 1), rounded
/// down to 64 KiB so every supported page size divides it.
pub(crate) const MEMFD_SIZE: u64 = (i64::MAX as u64) & !0xffff;

/// The file offsets an object keeps in its slice of a shared memfd: `0..SLICE`. A power of
/// two, so every window (a power of two no larger) lies wholly on one side of it.
pub(crate) const SLICE: u64 = 1 << 40;

/// The size of every memfd, and the largest file length ubc supports (a page must lie
/// wholly inside the memfd): `MEMFD_SIZE`, or less under a finite `RLIMIT_FSIZE`. A memfd's
/// offsets are file offsets, so sizing one past the process's file size limit — or writing
/// past it — makes the kernel send `SIGXFSZ`, which kills the process by default (it did:
/// any program run under `ulimit -f` died at its first ubc file). Under a limit, offsets at
/// or past it are refused with `OffsetOverflow` (EFBIG) instead. Read once, at first use:
/// a limit lowered later is not seen.
pub(crate) fn max_size() -> u64 {
    static SIZE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SIZE.get_or_init(|| {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes the struct we pass.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut r) } == 0;
        if !ok || r.rlim_cur == libc::RLIM_INFINITY { MEMFD_SIZE } else { r.rlim_cur.min(MEMFD_SIZE) & !0xffff }
    })
}

/// `offset + len`, or an `OffsetOverflow` error past `max_size()` (the largest file length).
pub(crate) fn checked_end(offset: u64, len: usize) -> Result<u64> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= max_size() => Ok(end),
        _ => Err(Error::OffsetOverflow { offset, len: len as u64 }),
    }
}

/// Whether stores through a mapping reach the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Sharing {
    /// `MAP_SHARED`: the cache's pages themselves; stores reach the file.
    Shared,
    /// `MAP_PRIVATE`: copy-on-write; stores stay in this mapping. Pages not yet stored to
    /// show the file's current contents (as Linux's `MAP_PRIVATE` of a file). The copies
    /// count against the cache's budget (`CacheStats::private_copy_bytes`).
    Private,
}

/// How many memfds the arena hands slices out of, in turn: twice the cores, at least 4 and at
/// most 16 (a descriptor each, made on first use; see "Lanes" above).
pub(crate) fn lanes() -> usize {
    static LANES: OnceLock<usize> = OnceLock::new();
    *LANES.get_or_init(|| std::thread::available_parallelism().map_or(4, |n| n.get() * 2).clamp(4, 16))
}

/// The cache's shared memfds: hands out slices (see the module documentation).
pub(crate) struct Arena {
    /// The memory every memfd of this cache is made of.
    memory: PageMemory,
    lanes: Box<[Mutex<ArenaState>]>,
    /// The lane the next slice comes from (modulo the number of lanes).
    turn: AtomicU64,
    /// Whether every lane has its memfd (made at the first slice).
    opened: AtomicBool,
}

struct ArenaState {
    /// The memfd slices are taken from, and the next slice's index in it.
    current: Option<Arc<Memfd>>,
    next: u64,
    /// Every arena memfd still alive (an object of it lives), for `allocated_bytes`.
    all: Vec<Weak<Memfd>>,
}

impl Arena {
    pub(crate) fn new(memory: PageMemory) -> Arena {
        let lanes = (0..lanes()).map(|_| Mutex::new(ArenaState { current: None, next: 0, all: Vec::new() })).collect();
        Arena { memory, lanes, turn: AtomicU64::new(0), opened: AtomicBool::new(false) }
    }

    /// Whether the cache's pages are hugetlb pages (see `Memory::is_hugetlb`).
    pub(crate) fn is_hugetlb(&self) -> bool {
        matches!(self.memory, PageMemory::Hugetlb(_))
    }

    /// Slices one memfd holds (0 under an `RLIMIT_FSIZE` below `SLICE`).
    fn slices_per_memfd() -> u64 {
        max_size() / SLICE
    }

    /// A fresh slice: its memfd and base offset; `None` where there are no slices.
    fn slice(&self) -> Result<Option<(Arc<Memfd>, u64)>> {
        let per = Self::slices_per_memfd();
        if per == 0 {
            return Ok(None);
        }
        if !self.opened.load(Acquire) {
            // Every lane's memfd at the first slice, not one by one later: the cache's
            // descriptors stay put from its first cached page on.
            for l in self.lanes.iter() {
                let mut s = l.lock();
                if s.current.is_none() {
                    s.renew(self.memory)?;
                }
            }
            self.opened.store(true, Release);
        }
        let lane = (self.turn.fetch_add(1, Relaxed) % self.lanes.len() as u64) as usize;
        let mut s = self.lanes[lane].lock();
        if s.current.is_none() || s.next == per {
            s.renew(self.memory)?;
        }
        let base = s.next * SLICE;
        s.next += 1;
        Ok(Some((s.current.clone().expect("made above"), base)))
    }

    /// Bytes of memory the shared memfds hold.
    pub(crate) fn allocated_bytes(&self) -> u64 {
        // Each lane's memfds are upgraded under its lock and asked (`fstat`) after it.
        let lane_bytes = |l: &Mutex<ArenaState>| {
            let live: Vec<Arc<Memfd>> = l.lock().all.iter().filter_map(Weak::upgrade).collect();
            live.iter().map(|m| m.allocated_bytes()).sum::<u64>()
        };
        self.lanes.iter().map(lane_bytes).sum()
    }

    /// The cache is shutting down, its objects about to be dropped: their slices need no
    /// punch each (a `fallocate` per cached file, ~3 µs here), as the memfds close with the
    /// last of them and free every page at once. Safe because no user mapping outlives the
    /// cache (each holds a handle) and the cache's windows are gone; a mapping copied into a
    /// forked child keeps showing the old bytes, where after a punch it would show zeros.
    pub(crate) fn retire(&self) {
        for l in self.lanes.iter() {
            for m in l.lock().all.iter().filter_map(Weak::upgrade) {
                m.retiring.store(true, Relaxed);
            }
        }
    }

    /// Shared memfds alive.
    pub(crate) fn memfds(&self) -> usize {
        self.lanes.iter().map(|l| l.lock().all.iter().filter(|w| w.strong_count() > 0).count()).sum()
    }
}

impl ArenaState {
    /// Hand slices out of a new memfd from now on.
    fn renew(&mut self, memory: PageMemory) -> Result<()> {
        // Under the lane's lock, a leaf: memfd_create and ftruncate take no lock of ours.
        let m = Arc::new(Memfd::create("pages", memory)?);
        self.all.retain(|w| w.strong_count() > 0);
        self.all.push(Arc::downgrade(&m));
        self.current = Some(m);
        self.next = 0;
        Ok(())
    }
}

/// One object's memory: offsets below `SLICE` in a slice of a shared memfd (where there are
/// slices), the rest in a memfd of its own (see the module documentation). Every method
/// takes file offsets.
pub(crate) struct Memory {
    /// What the memfds are made of.
    kind: PageMemory,
    /// The shared memfd and the slice's base; `None` where there are no slices.
    low: Option<(Arc<Memfd>, u64)>,
    /// The memfd for the other offsets, made on first use.
    high: OnceLock<Memfd>,
    high_init: Mutex<()>,
    /// One past the highest slice offset ever written, allocated or mapped: what a drop
    /// punches.
    touched: AtomicU64,
    /// A store's own file (`Memory::of_store_file`), not memory of ours: its length is the
    /// file's, and another process may shorten it, so the cache copies to and from it with
    /// `pread`/`pwrite` (a short file is an error, where a touch through a window past its end
    /// would be `SIGBUS`).
    foreign: bool,
}

/// `cell`'s value, made by `make` if there is none yet; `lock` serializes the makers, so
/// `make` runs once unless it fails (`OnceLock::get_or_try_init` is not stable).
pub(crate) fn get_or_try_init<'a, T>(
    cell: &'a OnceLock<T>,
    lock: &Mutex<()>,
    make: impl FnOnce() -> Result<T>,
) -> Result<&'a T> {
    if let Some(v) = cell.get() {
        return Ok(v);
    }
    let _g = lock.lock();
    if let Some(v) = cell.get() {
        return Ok(v);
    }
    let v = make()?;
    Ok(cell.get_or_init(|| v))
}

impl Memory {
    /// An object's memory, empty: a slice of `arena` (no system call) where there are
    /// slices.
    pub(crate) fn new(arena: &Arena) -> Result<Memory> {
        Ok(Memory {
            kind: arena.memory,
            low: arena.slice()?,
            high: OnceLock::new(),
            high_init: Mutex::new(()),
            touched: AtomicU64::new(0),
            foreign: false,
        })
    }

    /// The memory of a store kept in a shmem file of its own (a file on tmpfs, a memfd) —
    /// file offset `o` at `o` in `fd` — for a cache that serves the store's pages in place
    /// (XIP, `pager::StoreMemory`). Nothing is allocated or punched by its drop: the pages are
    /// the store's.
    pub(crate) fn of_store_file(fd: OwnedFd) -> Memory {
        STORE_FILES.fetch_add(1, Relaxed);
        let high = OnceLock::new();
        let _ = high.set(Memfd { fd, huge: 0, retiring: AtomicBool::new(false) });
        Memory {
            kind: PageMemory::Shmem,
            low: None,
            high,
            high_init: Mutex::new(()),
            touched: AtomicU64::new(0),
            foreign: true,
        }
    }

    /// Whether this is a store's own file (see `foreign`).
    pub(crate) fn is_store_file(&self) -> bool {
        self.foreign
    }

    /// Where data or a hole lies from file offset `offset` on, within `offset..end`
    /// (`lseek(SEEK_DATA / SEEK_HOLE)` on the memfds): the first offset of the kind, `end`
    /// if there is none before it.
    pub(crate) fn seek(&self, offset: u64, end: u64, data: bool) -> Result<u64> {
        let mut at = offset;
        while at < end {
            let (low, n) = self.in_slice(at, end - at);
            let (fd, base, stop) = match low {
                Some((m, mat)) => (Some(&m.fd), mat - at, at + n),
                None => (self.high.get().map(|h| &h.fd), 0, end),
            };
            let Some(fd) = fd else {
                // No own memfd: all hole.
                return Ok(if data { end } else { at });
            };
            // SEEK_DATA past the last data is ENXIO; SEEK_HOLE always finds one (the size).
            let whence =
                if data { rustix::fs::SeekFrom::Data(base + at) } else { rustix::fs::SeekFrom::Hole(base + at) };
            let found = match rustix::fs::seek(fd, whence) {
                Ok(o) => o - base,
                Err(rustix::io::Errno::NXIO) => u64::MAX,
                Err(e) => return Err(Error::os("lseek(memfd)", e)),
            };
            if found < stop {
                return Ok(found.max(at).min(end));
            }
            at = stop;
        }
        Ok(end)
    }

    /// The own memfd, made if needed. (Named by what it is, not by its object's id: an id
    /// kept for the name was 8 bytes in every cached object, for the rare one past 1 TiB.)
    fn high(&self) -> Result<&Memfd> {
        get_or_try_init(&self.high, &self.high_init, || Memfd::create("object", self.kind))
    }

    /// Whether the pages are hugetlb pages, which must be allocated (`allocate`) before
    /// anything but the kernel touches them (see `huge.rs`).
    pub(crate) fn is_hugetlb(&self) -> bool {
        matches!(self.kind, PageMemory::Hugetlb(_))
    }

    /// The unit of mapping: the system page, or the huge page.
    pub(crate) fn granule(&self) -> usize {
        self.kind.granule()
    }

    /// The part of `offset..offset+len` in the slice: the shared memfd, the offset there and
    /// the length (0, and no memfd, when none of it is).
    fn in_slice(&self, offset: u64, len: u64) -> (Option<(&Memfd, u64)>, u64) {
        match &self.low {
            Some((m, base)) if offset < SLICE && len > 0 => (Some((m, base + offset)), len.min(SLICE - offset)),
            _ => (None, 0),
        }
    }

    /// Note slice offsets below `end` as touched.
    fn touch(&self, end: u64) {
        let end = end.next_multiple_of(self.granule() as u64);
        self.touched.fetch_max(end.min(SLICE), Relaxed);
    }

    /// Free the pages in `offset..offset+len` (and unmap them from every mapping).
    pub(crate) fn punch(&self, offset: u64, len: u64) -> Result<()> {
        let len = len.min(max_size().saturating_sub(offset));
        let (low, n) = self.in_slice(offset, len);
        if let Some((m, at)) = low {
            m.punch(at, n)?;
        }
        if n < len
            && let Some(h) = self.high.get()
        {
            h.punch(offset + n, len - n)?;
        }
        Ok(())
    }

    /// Allocate zeroed memory for the holes in `offset..offset+len` (existing pages stay).
    pub(crate) fn allocate(&self, offset: u64, len: u64) -> Result<()> {
        let (low, n) = self.in_slice(offset, len);
        if let Some((m, at)) = low {
            self.touch(offset + n);
            m.allocate(at, n)?;
        }
        if n < len {
            self.high()?.allocate(offset + n, len - n)?;
        }
        Ok(())
    }

    /// Write `buf` at `offset` with `pwrite` (see `Memfd::write_at`).
    pub(crate) fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let (low, n) = self.in_slice(offset, buf.len() as u64);
        let n = n as usize;
        if let Some((m, at)) = low {
            self.touch(offset + n as u64);
            m.write_at(&buf[..n], at)?;
        }
        if n < buf.len() {
            self.high()?.write_at(&buf[n..], offset + n as u64)?;
        }
        Ok(())
    }

    /// Read `buf.len()` bytes at `offset` with `pread` (a hole reads as zeros and stays one).
    pub(crate) fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let (low, n) = self.in_slice(offset, buf.len() as u64);
        let n = n as usize;
        if let Some((m, at)) = low {
            m.read_at(&mut buf[..n], at)?;
        }
        if n < buf.len() {
            match self.high.get() {
                Some(h) => h.read_at(&mut buf[n..], offset + n as u64)?,
                None => buf[n..].fill(0),
            }
        }
        Ok(())
    }

    /// A user mapping of `len` bytes at `offset`: shared or private (copy-on-write),
    /// writable or not.
    pub(crate) fn map_user(&self, offset: u64, len: usize, sharing: Sharing, access: Access) -> Result<*mut u8> {
        let prot = match access {
            Access::ReadWrite => ProtFlags::READ | ProtFlags::WRITE,
            Access::ReadOnly => ProtFlags::READ,
        };
        let flags = match sharing {
            Sharing::Shared => MapFlags::SHARED,
            Sharing::Private => MapFlags::PRIVATE,
        };
        self.map_range(offset, len, prot, flags, "mmap(user mapping)")
    }

    /// Lent windows' view of `len` bytes at `offset`: private (a later copy of a page into
    /// it is the borrowers' own) and read-only. Not populated: a read fault maps a run of
    /// resident pages at once (the kernel's fault-around), which measured faster than
    /// `MAP_POPULATE`'s page-by-page walk.
    pub(crate) fn map_view(&self, offset: u64, len: usize) -> Result<*mut u8> {
        self.map_range(offset, len, ProtFlags::READ, MapFlags::PRIVATE, "mmap(window view)")
    }

    /// Map `len` bytes at `offset` shared, read-write (a window).
    pub(crate) fn map(&self, offset: u64, len: usize) -> Result<*mut u8> {
        self.map_range(offset, len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, "mmap(window)")
    }

    /// One contiguous mapping of `offset..offset+len`: from the slice, from the own memfd,
    /// or both (the own memfd's part first, over the whole length; then the slice's part
    /// placed over its start with `MAP_FIXED`, which replaces those pages atomically).
    fn map_range(
        &self,
        offset: u64,
        len: usize,
        prot: ProtFlags,
        flags: MapFlags,
        what: &'static str,
    ) -> Result<*mut u8> {
        let (low, n) = self.in_slice(offset, len as u64);
        let n = n as usize;
        if let Some((m, at)) = low {
            self.touch(offset + n as u64);
            if n == len {
                return m.mmap(std::ptr::null_mut(), at, len, prot, flags, what);
            }
        }
        let whole = self.high()?.mmap(std::ptr::null_mut(), offset, len, prot, flags, what)?;
        if let Some((m, at)) = low
            && let Err(e) = m.mmap(whole, at, n, prot, flags | MapFlags::FIXED, what)
        {
            // SAFETY: our fresh mapping; nothing refers to it yet.
            unsafe { unmap(whole, len) };
            return Err(e);
        }
        Ok(whole)
    }

    /// Bytes of memory the object's own memfd holds (the slice's are counted by the arena).
    pub(crate) fn own_allocated_bytes(&self) -> u64 {
        self.high.get().map_or(0, Memfd::allocated_bytes)
    }
}

/// Store files' memories alive (`Memory::of_store_file`): a descriptor each.
static STORE_FILES: AtomicU64 = AtomicU64::new(0);

/// How many descriptors store files' memories hold now.
pub(crate) fn store_files() -> usize {
    STORE_FILES.load(Relaxed) as usize
}

impl Drop for Memory {
    fn drop(&mut self) {
        if self.foreign {
            STORE_FILES.fetch_sub(1, Relaxed);
        }
        // The object's teardown leaves its pages to this (it accounts them gone, and punches
        // nothing): one `fallocate` of every slice offset ever written, allocated or mapped,
        // per object that had pages. Without it that memory would stay allocated until the
        // whole shared memfd closes, as the slice is never handed out again.
        let t = self.touched.load(Relaxed);
        if t > 0
            && let Some((m, base)) = &self.low
            && !m.retiring.load(Relaxed)
        {
            let _ = m.punch(*base, t);
        }
    }
}

/// One memfd: offsets are the memfd's own.
pub(crate) struct Memfd {
    fd: OwnedFd,
    /// The hugetlb page size, 0 for shmem.
    huge: u64,
    /// Its cache is shutting down (`Arena::retire`): a slice dropped now punches nothing,
    /// since the whole memfd (and every page in it) goes when the last slice does.
    retiring: AtomicBool,
}

impl Memfd {
    /// A new, empty memfd sized to cover every file offset (sparse: costs nothing).
    /// Of hugetlb memory, its size is rounded down to the huge page (hugetlbfs refuses any
    /// other).
    pub(crate) fn create(name: &str, memory: PageMemory) -> Result<Memfd> {
        let cname = CString::new(format!("ubc:{name}")).unwrap_or_else(|_| CString::new("ubc").unwrap());
        let (flags, huge) = match memory {
            PageMemory::Shmem => (MemfdFlags::CLOEXEC, 0),
            PageMemory::Hugetlb(h) => (MemfdFlags::CLOEXEC | MemfdFlags::HUGETLB | huge_flag(h), h),
        };
        let fd = rustix::fs::memfd_create(&cname, flags).map_err(|e| Error::os("memfd_create", e))?;
        let size = if huge > 0 { max_size() & !(huge - 1) } else { max_size() };
        rustix::fs::ftruncate(&fd, size).map_err(|e| Error::os("ftruncate(memfd)", e))?;
        Ok(Memfd { fd, huge, retiring: AtomicBool::new(false) })
    }

    /// Free the pages in `offset..offset+len` (and unmap them from every mapping).
    pub(crate) fn punch(&self, offset: u64, len: u64) -> Result<()> {
        rustix::fs::fallocate(&self.fd, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len)
            .map_err(|e| Error::os("fallocate(PUNCH_HOLE)", e))
    }

    /// Allocate zeroed memory for the holes in `offset..offset+len` (existing pages stay).
    pub(crate) fn allocate(&self, offset: u64, len: u64) -> Result<()> {
        rustix::fs::fallocate(&self.fd, FallocateFlags::KEEP_SIZE, offset, len).map_err(|e| {
            if self.huge > 0 && e == rustix::io::Errno::NOSPC {
                Error::os("fallocate(hugetlb memfd): the host's hugetlb pool has no free page", e)
            } else {
                Error::os("fallocate(memfd)", e)
            }
        })
    }

    /// Write `buf` at `offset` with `pwrite` (for pages that hold no memory yet: the kernel
    /// allocates them without zeroing what the write covers). => `offset + buf.len()` is at
    /// most `max_size()`, so the write never meets `RLIMIT_FSIZE`. Not for hugetlb memory
    /// (hugetlbfs has no `write`: `EINVAL`); its writers allocate and copy through a window.
    pub(crate) fn write_at(&self, mut buf: &[u8], mut offset: u64) -> Result<()> {
        debug_assert_eq!(self.huge, 0, "pwrite into hugetlb memory");
        while !buf.is_empty() {
            match rustix::io::pwrite(&self.fd, buf, offset) {
                Ok(0) => return Err(Error::os("pwrite(memfd)", rustix::io::Errno::NOSPC)),
                Ok(n) => {
                    buf = &buf[n..];
                    offset += n as u64;
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Error::os("pwrite(memfd)", e)),
            }
        }
        Ok(())
    }

    /// Read `buf.len()` bytes at `offset` with `pread` (a hole reads as zeros and stays one).
    pub(crate) fn read_at(&self, mut buf: &mut [u8], mut offset: u64) -> Result<()> {
        while !buf.is_empty() {
            match rustix::io::pread(&self.fd, &mut *buf, offset) {
                // The memfd is sized past every offset a file can have.
                Ok(0) => return Err(Error::os("pread(memfd)", rustix::io::Errno::IO)),
                Ok(n) => {
                    buf = &mut buf[n..];
                    offset += n as u64;
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Error::os("pread(memfd)", e)),
            }
        }
        Ok(())
    }

    /// Bytes of memory the memfd holds (allocated pages), from `fstat`.
    pub(crate) fn allocated_bytes(&self) -> u64 {
        rustix::fs::fstat(&self.fd).map(|st| st.st_blocks as u64 * 512).unwrap_or(0)
    }

    /// `mmap` `len` bytes at memfd offset `offset`, at `addr` (with `MAP_FIXED` in `flags`)
    /// or where the kernel chooses (`addr` null). => with `MAP_FIXED`, `addr..addr+len` is a
    /// mapping of ours that nothing uses yet.
    fn mmap(
        &self,
        addr: *mut u8,
        offset: u64,
        len: usize,
        prot: ProtFlags,
        flags: MapFlags,
        what: &'static str,
    ) -> Result<*mut u8> {
        // hugetlb: no reservation for the whole range at mmap (a user mapping of a large file
        // would need as many free pool pages as it spans); pages are allocated one by one
        // before use (`allocate`), so a shortage is an error there instead.
        let flags = if self.huge > 0 { flags | MapFlags::NORESERVE } else { flags };
        // SAFETY: a fresh mapping at a kernel-chosen address, or (per the precondition) over
        // our own unused one; it aliases no Rust object.
        let p = unsafe { rustix::mm::mmap(addr as *mut _, len, prot, flags, self.fd.as_fd(), offset) }
            .map_err(|e| Error::os(what, e))?;
        Ok(p as *mut u8)
    }
}

/// `MFD_HUGE_*` for a huge page of `size` bytes: log2 of the size in bits 26..32.
fn huge_flag(size: u64) -> MemfdFlags {
    MemfdFlags::from_bits_retain((size.trailing_zeros()) << 26)
}

/// Unmap a window. => nobody uses the address any more.
pub(crate) unsafe fn unmap(addr: *mut u8, len: usize) {
    // SAFETY: per the precondition. A failure here would mean the address was not mapped,
    // a bug we cannot recover from meaningfully; ignore it rather than abort.
    let _ = unsafe { rustix::mm::munmap(addr as *mut _, len) };
}

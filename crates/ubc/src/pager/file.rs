//! The local-file pager: positional I/O on a host file (the vnode pager of a local file
//! system).
//!
//! # No double caching: direct and buffered modes
//!
//! ubc holds a file's pages itself; if the kernel kept its own copy in the page cache, every
//! page would be cached twice. So a `FilePager` moves pages with `O_DIRECT` where the host
//! file system allows it ([`IoMode::Direct`]), and otherwise uses buffered I/O and tells the
//! kernel to drop its copy after each transfer ([`IoMode::Buffered`]).
//!
//! * **Opening.** [`FilePager::open`]/[`FilePager::create`] open the file by name with
//!   `O_DIRECT` at once and clear it again (`F_SETFL`) where direct I/O does not suit the
//!   file; one `statx` decides (opening and reading a small cold file is mostly system
//!   calls). [`FilePager::from_file`] reopens the file through `/proc/self/fd/N` with
//!   `O_DIRECT` and, if that works, closes the buffered descriptor. Either way a pager holds
//!   one descriptor (many cached files must not cost twice the descriptors). `len`, `set_len` and `sync`
//!   work on the direct descriptor; unaligned tails use a short-lived buffered one. The
//!   required alignment comes from `statx(STATX_DIOALIGN)` (Linux 6.1+); when the file
//!   system does not report it, 4096 bytes (or the file system block size, if larger and at
//!   most 64 KiB). Direct I/O is not used when the file system reports zero alignment (no
//!   direct I/O), when the open is refused (`EINVAL`, e.g. older tmpfs), or on tmpfs/ramfs,
//!   where the page cache *is* the storage and `O_DIRECT` (accepted since Linux 6.6) is a
//!   copy through it. If a direct transfer with aligned arguments fails with `EINVAL` (some
//!   FUSE file systems accept the open and refuse the I/O) and the same transfer then
//!   succeeds buffered, the pager switches to buffered I/O for good (keeping a buffered
//!   descriptor from then on). [`FilePager::buffered`] forces buffered I/O.
//!   [`Pager::io_mode`] reports the mode actually in use.
//! * **Direct transfers.** The cache's buffers are page-aligned windows, so they go to the
//!   kernel as they are. A caller buffer whose address is not aligned to the memory
//!   alignment goes through an aligned bounce buffer (at most 1 MiB at a time).
//!   Reads of a final partial block go through a one-block bounce buffer (the kernel returns
//!   a short read at end of file; the rest of the caller's buffer is zeroed, and a read that
//!   finds nothing at all is a [`Fill::Hole`]). A write whose length is not a multiple of the
//!   offset alignment (the cache clips the last run at the file's length) writes its aligned
//!   prefix directly and the tail through a buffered descriptor, then writes that tail out
//!   (`sync_file_range`) and drops it (`POSIX_FADV_DONTNEED`).
//! * **Buffered transfers.** Kernel read-ahead is turned off (`POSIX_FADV_RANDOM`: ubc reads
//!   ahead itself). After a read the range read is dropped (`POSIX_FADV_DONTNEED`); after a
//!   write the range is written out and waited for (`sync_file_range(WAIT_BEFORE | WRITE |
//!   WAIT_AFTER)`, since `DONTNEED` only drops clean pages) and then dropped. So writeback
//!   in buffered mode is synchronous with the device, like direct I/O; `sync` still issues
//!   `fdatasync` for metadata and the device cache, and drops whatever is left of the file.
//!   `DONTNEED` cannot drop pages that someone else has mapped or dirtied.
//!
//! **Coherence between direct and buffered transfers** (to the same inode). This
//! relies on Linux's direct I/O rules: before a direct write the kernel writes back and
//! invalidates the page-cache pages of the range (and invalidates them again after), and
//! before a direct read it writes back dirty pages of the range. So a tail written buffered
//! and later overwritten or read directly is seen correctly, and no stale page-cache copy
//! survives a direct write. Within one `put_pages` call the direct prefix is written before
//! the buffered tail, so a kernel page shared by both (alignment below the page size) is
//! read back from disk with the new prefix. The cache never transfers the same page in two
//! calls at once. The kernel cannot invalidate pages that another process has mapped and
//! dirtied; like any cache, ubc is not coherent with outside writers of the file.

use super::host_fds::HostFd;
use super::{Fill, Identity, IoMode, Pager, Seek};
use rustix::fs::{Advice, AtFlags, Mode, OFlags, StatxFlags};
use std::alloc::Layout;
use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::num::NonZeroU64;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, LazyLock, OnceLock};

/// Whether a handle may modify the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Access {
    ReadOnly,
    ReadWrite,
}

impl Access {
    /// The access mode bits of an `open` with this access.
    fn flags(self) -> OFlags {
        match self {
            Access::ReadOnly => OFlags::RDONLY,
            Access::ReadWrite => OFlags::RDWR,
        }
    }
}

/// What the path a pager is made with is: the file's name, by which it may be reopened (for
/// `O_DIRECT` when `/proc/self/fd` is missing), or only a name for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PathRole {
    Reopenable,
    Label,
}

/// Largest bounce buffer used for one direct transfer from or to an unaligned caller buffer.
const BOUNCE_MAX: usize = 1 << 20;

const TMPFS_MAGIC: u64 = 0x0102_1994;
const RAMFS_MAGIC: u64 = 0x8584_58f6;

/// Pages of a host file, read and written with `pread`/`pwrite`, with `O_DIRECT` where the
/// file system allows it (see the module documentation).
#[derive(Debug)]
pub struct FilePager {
    /// The pager's descriptor: opened with `O_DIRECT` when `align` is set, buffered
    /// otherwise. Metadata, `set_len` and `sync` use it in both modes. It lives in the
    /// process's pool of host descriptors (`host_fds.rs`): closed while the pool is full and
    /// the file unused, reopened by file handle when next used.
    file: HostFd,
    /// Alignment of direct I/O on `file`, if it was opened with `O_DIRECT`.
    align: Option<Align>,
    /// False once direct I/O was refused at run time (`EINVAL`): buffered for good.
    direct_on: AtomicBool,
    /// The buffered descriptor kept after such a refusal.
    fallback: OnceLock<File>,
    /// Whether `path` is where to reopen the file if `/proc/self/fd` is not available
    /// (`open`/`create` only; `from_file`'s path is only for messages).
    reopenable: bool,
    path: Box<Path>,
    access: Access,
    /// Held while `put_pages_unstable` has `O_DIRECT` cleared on `file` (one at a time, so
    /// that one cannot set it again under another's buffered write).
    unstable: parking_lot::Mutex<()>,
}

/// Alignment required by direct I/O: powers of two, kept as their logarithms (every cached
/// host file carries one: two bytes, where the two 32-bit numbers `statx` gives took eight
/// and, with the option's tag, twelve).
#[derive(Debug, Clone, Copy)]
struct Align {
    /// Of buffer addresses.
    mem_shift: u8,
    /// Of file offsets and transfer lengths.
    offset_shift: u8,
}

impl Align {
    /// => `mem` and `offset` are powers of two.
    fn new(mem: usize, offset: usize) -> Align {
        Align { mem_shift: mem.trailing_zeros() as u8, offset_shift: offset.trailing_zeros() as u8 }
    }

    fn mem(self) -> usize {
        1 << self.mem_shift
    }

    fn offset(self) -> usize {
        1 << self.offset_shift
    }
}

/// A buffered descriptor: the pager's own (pooled, or the fallback kept after a refusal of
/// direct I/O), or a short-lived one for a transfer.
enum Fd<'a> {
    Pooled(Arc<File>),
    Borrowed(&'a File),
    Owned(File),
}

impl std::ops::Deref for Fd<'_> {
    type Target = File;
    fn deref(&self) -> &File {
        match self {
            Fd::Pooled(f) => f,
            Fd::Borrowed(f) => f,
            Fd::Owned(f) => f,
        }
    }
}

impl FilePager {
    /// Open an existing host file, read-only or read-write.
    pub fn open(path: impl AsRef<Path>, access: Access) -> io::Result<FilePager> {
        Ok(FilePager::open_by_name(path.as_ref(), access, OFlags::empty())?.0)
    }

    /// Open a host file read-write, creating it if it does not exist.
    pub fn create(path: impl AsRef<Path>) -> io::Result<FilePager> {
        Ok(FilePager::open_by_name(path.as_ref(), Access::ReadWrite, OFlags::CREATE)?.0)
    }

    /// Open `path` with `O_DIRECT` at once: one `open` and one `statx` decide, where opening
    /// buffered and reopening for direct I/O took two opens, a close and three `stat`s — a
    /// fifth of what ubc adds to opening and reading a small cold file (issue 19,
    /// `open_read_small`). A file system that refuses `O_DIRECT` at open (`EINVAL`) gets the
    /// buffered open and the usual checks. Also the file's length when that `statx` gave it
    /// (`Cache::open_path`: the new object then needs no `statx` of its own).
    pub(crate) fn open_by_name(path: &Path, access: Access, extra: OFlags) -> io::Result<(FilePager, Option<u64>)> {
        let flags = access.flags() | OFlags::CLOEXEC | extra;
        let mode = Mode::from_bits_truncate(0o666);
        match rustix::fs::open(path, flags | OFlags::DIRECT, mode) {
            Ok(fd) => FilePager::new_opened_direct(File::from(fd), path, access),
            Err(e) if e == rustix::io::Errno::INVAL => {
                let file = File::from(rustix::fs::open(path, flags, mode)?);
                Ok((FilePager::new(file, path, access, PathRole::Reopenable)?, None))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A pager for `file`, opened by `path` with `O_DIRECT`: kept so if direct I/O suits the
    /// file ([`direct_alignment`]), else `O_DIRECT` is cleared on it (our own open file
    /// description) and it is used buffered. Also the file's length, from the same `statx`.
    fn new_opened_direct(file: File, path: &Path, access: Access) -> io::Result<(FilePager, Option<u64>)> {
        let want = StatxFlags::BASIC_STATS | StatxFlags::DIOALIGN | STATX_MNT_ID_UNIQUE;
        let sx = rustix::fs::statx(&file, "", AtFlags::EMPTY_PATH, want)?;
        if u32::from(sx.stx_mode) & libc::S_IFMT != libc::S_IFREG {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
        }
        let dev = libc::makedev(sx.stx_dev_major, sx.stx_dev_minor);
        let align = direct_alignment(&file, Some(&sx));
        if align.is_none() {
            // Of the flags F_SETFL can change we set only O_DIRECT at open: clear them all.
            rustix::fs::fcntl_setfl(&file, OFlags::empty())?;
        }
        let len = (sx.stx_mask & StatxFlags::SIZE.bits() != 0).then_some(sx.stx_size);
        Ok((FilePager::with(file, align, path, true, access, dev, sx.stx_ino), len))
    }

    /// Wrap an already open host file. `path` is only used in messages. Direct I/O is tried
    /// by reopening the file through `/proc/self/fd` (a new open file description, so other
    /// duplicates of `file` are not affected); `file` itself is then closed.
    pub fn from_file(file: File, path: impl AsRef<Path>, access: Access) -> io::Result<FilePager> {
        FilePager::new(file, path.as_ref(), access, PathRole::Label)
    }

    fn new(file: File, path: &Path, access: Access, role: PathRole) -> io::Result<FilePager> {
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
        }
        let (dev, ino) = (meta.dev(), meta.ino());
        let reopenable = role == PathRole::Reopenable;
        // In direct mode the buffered descriptor is closed: one descriptor per pager.
        let (file, align) = match open_direct(&file, reopenable.then_some(path), access, dev, ino) {
            Some((direct, align)) => (direct, Some(align)),
            None => (file, None),
        };
        Ok(FilePager::with(file, align, path, reopenable, access, dev, ino))
    }

    /// The pager over `file`, direct with `align` or else buffered (without the kernel's
    /// read-ahead: ubc reads ahead itself).
    fn with(
        file: File,
        align: Option<Align>,
        path: &Path,
        reopenable: bool,
        access: Access,
        dev: u64,
        ino: u64,
    ) -> FilePager {
        if align.is_none() {
            no_readahead(&file);
        }
        let flags = reopen_flags(access, align.is_some());
        FilePager {
            direct_on: AtomicBool::new(align.is_some()),
            align,
            file: HostFd::new(file, flags, dev, ino, path.parent()),
            fallback: OnceLock::new(),
            reopenable,
            path: path.into(),
            access,
            unstable: parking_lot::Mutex::new(()),
        }
    }

    /// Use buffered I/O only (dropping pages from the kernel's cache after each transfer),
    /// even where `O_DIRECT` would work: `FilePager::open(path, Access::ReadWrite)?.buffered()`.
    pub fn buffered(mut self) -> FilePager {
        if self.align.take().is_some() {
            // Reopened buffered from now on; the open one is our own open file description
            // (never shared): clear O_DIRECT on it.
            self.file.set_flags(reopen_flags(self.access, false));
            if let Ok(f) = self.file.get() {
                if let Ok(fl) = rustix::fs::fcntl_getfl(&*f) {
                    let _ = rustix::fs::fcntl_setfl(&*f, fl - OFlags::DIRECT);
                }
                no_readahead(&f);
            }
        }
        if let Some(f) = self.fallback.take() {
            let (dev, ino) = (self.file.dev(), self.file.ino());
            self.file = HostFd::new(f, reopen_flags(self.access, false), dev, ino, self.path.parent());
        }
        self.direct_on.store(false, Relaxed);
        self
    }

    /// The host path this pager was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `(memory, offset)` alignment of direct I/O, or `None` in buffered mode.
    pub fn direct_alignment(&self) -> Option<(usize, usize)> {
        self.direct_io().map(|a| (a.mem(), a.offset()))
    }

    fn direct_io(&self) -> Option<Align> {
        self.align.filter(|_| self.direct_on.load(Relaxed))
    }

    /// A buffered descriptor: the pager's own in buffered mode; in direct mode a short-lived
    /// one for an unaligned tail, or the one kept after direct I/O was refused.
    fn buffered_fd(&self) -> io::Result<Fd<'_>> {
        if self.align.is_none() {
            return Ok(Fd::Pooled(self.file.get()?));
        }
        if let Some(f) = self.fallback.get() {
            return Ok(Fd::Borrowed(f));
        }
        let flags = self.access.flags() | OFlags::CLOEXEC;
        let f = reopen(
            &*self.file.get()?,
            self.reopenable.then_some(&*self.path),
            flags,
            self.file.dev(),
            self.file.ino(),
        )?;
        if self.direct_on.load(Relaxed) {
            return Ok(Fd::Owned(f));
        }
        no_readahead(&f);
        Ok(Fd::Borrowed(self.fallback.get_or_init(|| f)))
    }

    /// Run `buffered` after a direct transfer failed with `EINVAL`; if it works, direct I/O
    /// was refused by the file system: stay buffered from now on.
    fn after_refusal<T>(&self, e: io::Error, buffered: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(e);
        }
        let r = buffered()?;
        self.direct_on.store(false, Relaxed);
        Ok(r)
    }

    /// Buffered read until `buf` is full or end of file; drops the range from the page
    /// cache. Returns the bytes read.
    fn read_buffered(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let f = self.buffered_fd()?;
        let mut done = 0;
        while done < buf.len() {
            match f.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break, // end of file
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if done > 0 {
            drop_cached(&f, offset, done as u64);
        }
        Ok(done)
    }

    /// Buffered write, written out to the device and dropped from the page cache.
    fn write_buffered(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let f = self.buffered_fd()?;
        f.write_all_at(data, offset)?;
        let (start, len) = page_span(offset, data.len() as u64);
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        // SAFETY: plain syscall on an open descriptor.
        let r = unsafe { libc::sync_file_range(f.as_raw_fd(), start as i64, len as i64, flags) };
        if r != 0 {
            let e = io::Error::last_os_error();
            // A write error is the caller's to see (the pages stay dirty in the cache); a
            // file system without sync_file_range only keeps its pages cached.
            match e.raw_os_error() {
                Some(libc::EINVAL | libc::ENOSYS | libc::ESPIPE | libc::EOPNOTSUPP) => {}
                _ => return Err(e),
            }
        }
        drop_cached(&f, offset, data.len() as u64);
        Ok(())
    }

    /// Direct read into `buf`; returns the bytes read (fewer at end of file).
    fn read_direct(&self, a: Align, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let file = self.file.get()?;
        let (ma, oa) = (a.mem(), a.offset());
        let len = buf.len();
        let mut done = 0;
        let mut bounce: Option<AlignedBuf> = None;
        while done < len {
            let pos = offset + done as u64;
            if !pos.is_multiple_of(oa as u64) {
                break; // a short read ended mid-block (end of file): finish buffered below
            }
            let want = len - done;
            let n = if want >= oa && (buf.as_ptr() as usize + done).is_multiple_of(ma) {
                // Straight into the caller's buffer (the cache's page-aligned windows).
                let k = want / oa * oa;
                retry(|| file.read_at(&mut buf[done..done + k], pos))?
            } else {
                let b = bounce
                    .get_or_insert_with(|| AlignedBuf::new(want.next_multiple_of(oa).min(BOUNCE_MAX), ma.max(oa)));
                let k = want.next_multiple_of(oa).min(b.len());
                let n = retry(|| file.read_at(&mut b.as_mut()[..k], pos))?.min(want);
                buf[done..done + n].copy_from_slice(&b.as_mut()[..n]);
                n
            };
            if n == 0 {
                return Ok(done); // end of file
            }
            done += n;
        }
        if done < len {
            // Unaligned position after a short read: normally end of file (this then reads
            // nothing and caches nothing).
            done += self.read_buffered(offset + done as u64, &mut buf[done..])?;
        }
        Ok(done)
    }

    /// Direct write of the aligned prefix of `data`, buffered write of the rest.
    fn write_direct(&self, a: Align, offset: u64, data: &[u8]) -> io::Result<()> {
        let file = self.file.get()?;
        let (ma, oa) = (a.mem(), a.offset());
        let len = data.len();
        let mut done = 0;
        let mut bounce: Option<AlignedBuf> = None;
        while len - done >= oa && (offset + done as u64).is_multiple_of(oa as u64) {
            let pos = offset + done as u64;
            let k = (len - done) / oa * oa;
            let n = if (data.as_ptr() as usize + done).is_multiple_of(ma) {
                retry(|| file.write_at(&data[done..done + k], pos))?
            } else {
                let b = bounce.get_or_insert_with(|| AlignedBuf::new(k.min(BOUNCE_MAX), ma.max(oa)));
                let k = k.min(b.len());
                b.as_mut()[..k].copy_from_slice(&data[done..done + k]);
                retry(|| file.write_at(&b.as_mut()[..k], pos))?
            };
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::WriteZero, "direct write wrote nothing"));
            }
            done += n;
        }
        if done < len {
            // The unaligned tail (the file ends there).
            self.write_buffered(offset + done as u64, &data[done..])?;
        }
        Ok(())
    }
}

impl Pager for FilePager {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        let done = match self.direct_io() {
            Some(a) => match self.read_direct(a, offset, buf) {
                Ok(n) => n,
                Err(e) => self.after_refusal(e, || self.read_buffered(offset, buf))?,
            },
            None => self.read_buffered(offset, buf)?,
        };
        if done == 0 {
            // Entirely past the end: nothing to copy, the cache zero-fills.
            return Ok(Fill::Hole);
        }
        buf[done..].fill(0);
        Ok(Fill::Data)
    }

    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        match self.direct_io() {
            Some(a) => match self.write_direct(a, offset, data) {
                Ok(()) => Ok(()),
                Err(e) => self.after_refusal(e, || self.write_buffered(offset, data)),
            },
            None => self.write_buffered(offset, data),
        }
    }

    /// In direct mode, a buffered write through the pager's own descriptor, `O_DIRECT`
    /// cleared for it (`F_SETFL`; three `fcntl`s cost less than opening a buffered
    /// descriptor), not written out nor dropped: the domain's `syncfs` writes it, and
    /// `committed` drops the kernel's copy. A transfer of another thread through the same
    /// descriptor meanwhile is buffered too, which is correct in either direction (only
    /// alignment differs) and leaves a copy that `committed` or the next `sync` drops.
    fn put_pages_unstable(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        if self.direct_io().is_none() {
            return self.put_pages(offset, data);
        }
        let f = self.file.get()?;
        let _one = self.unstable.lock();
        let flags = rustix::fs::fcntl_getfl(&*f)?;
        rustix::fs::fcntl_setfl(&*f, flags - OFlags::DIRECT)?;
        let r = f.write_all_at(data, offset);
        if rustix::fs::fcntl_setfl(&*f, flags).is_err() {
            // Cannot happen on an open descriptor; if it did, the descriptor stays
            // buffered, and buffered mode is what then keeps the page cache clean.
            self.direct_on.store(false, Relaxed);
        }
        r
    }

    fn committed(&self) {
        if self.direct_io().is_some()
            && let Ok(f) = self.file.get()
        {
            let _ = rustix::fs::fadvise(&*f, 0, None, Advice::DontNeed);
        }
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.get()?.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.get()?.set_len(len)
    }

    fn sync_metadata(&self) -> io::Result<()> {
        // `fsync` after the `fdatasync` of `sync`: the inode's times and other metadata.
        self.file.get()?.sync_all()
    }

    fn sync(&self) -> io::Result<()> {
        let file = self.file.get()?;
        file.sync_data()?;
        if self.direct_io().is_none() {
            // Everything is clean now: drop whatever the kernel still holds of the file.
            let _ = rustix::fs::fadvise(&*file, 0, None, Advice::DontNeed);
        }
        Ok(())
    }

    /// The host file system, while the file is written with direct I/O: its `syncfs` then
    /// leaves exactly what `sync` does (data on the device, metadata written, the device
    /// cache flushed). Written buffered, `sync` also drops the kernel's copy of the file
    /// afterwards, which a `syncfs` would not: synced on its own.
    fn sync_domain(&self) -> Option<u64> {
        self.direct_io().map(|_| self.file.dev())
    }

    fn sync_fs(&self) -> io::Result<()> {
        rustix::fs::syncfs(&*self.file.get()?).map_err(io::Error::from)
    }

    /// A `syncfs` through the directory of the file's file system that the descriptor pool
    /// reopens files by (found at the first file of each device): no descriptor of the
    /// file itself is kept. `None` where the pool knows none (handles do not work there).
    fn domain_syncer(&self) -> Option<super::DomainSyncer> {
        self.sync_domain()?;
        let dir = self.file.fs_dir()?;
        Some(Arc::new(move || rustix::fs::syncfs(&*dir).map_err(io::Error::from)))
    }

    fn identity(&self) -> Option<Identity> {
        Some(Identity::HostFile { dev: self.file.dev(), ino: self.file.ino() })
    }

    fn can_punch(&self) -> bool {
        self.access == Access::ReadWrite
    }

    fn punch(&self, offset: u64, len: u64) -> io::Result<bool> {
        let mode = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        match rustix::fs::fallocate(&*self.file.get()?, mode, offset, len) {
            Ok(()) => Ok(true),
            // The host file system cannot punch: the cache writes zeros instead.
            Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::NOSYS) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        match rustix::fs::fallocate(&*self.file.get()?, rustix::fs::FallocateFlags::KEEP_SIZE, offset, len) {
            // A file system that cannot reserve (tmpfs before 3.5, some FUSE ones) allocates
            // at write time, as posix_fallocate's emulation would; nothing is promised then.
            Ok(()) | Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::NOSYS) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn seek(&self, offset: u64, what: Seek) -> io::Result<Option<u64>> {
        let whence = match what {
            Seek::Data => rustix::fs::SeekFrom::Data(offset),
            Seek::Hole => rustix::fs::SeekFrom::Hole(offset),
        };
        // The pager's transfers are positional, so the file position is nobody's; lseek
        // returns the offset it computed even when seeks race. ENXIO: no data (or `offset`
        // past the end).
        match rustix::fs::seek(&*self.file.get()?, whence) {
            Ok(at) => Ok(Some(at)),
            Err(rustix::io::Errno::NXIO) => match what {
                Seek::Data => Ok(None),
                Seek::Hole => Ok(Some(offset.max(self.len()?))),
            },
            Err(e) => Err(e.into()),
        }
    }

    fn is_writable(&self) -> bool {
        self.access == Access::ReadWrite
    }

    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }

    fn io_mode(&self) -> IoMode {
        if self.direct_io().is_some() { IoMode::Direct } else { IoMode::Buffered }
    }

    /// A file on tmpfs (or a memfd) keeps its bytes in shmem pages: the cache can serve it
    /// from them in place (XIP) instead of holding a second copy. The memory is a descriptor
    /// of its own (the pooled one may be closed and reopened; a mapping needs one that
    /// stays), read-write where this process may write the file — whatever this pager's
    /// access, so a later writable open of the same cached file can write through it — and
    /// read-only otherwise. Files opened for direct I/O are not on tmpfs: no `fstatfs` for
    /// them. Such descriptors are bounded like the pool's (`host_fds`): past its limit a file
    /// on tmpfs is cached as a copy (its descriptor pooled) instead.
    fn memory(&self) -> Option<super::StoreMemory> {
        if self.align.is_some() || crate::memfd::store_files() >= super::host_fds::limit() {
            return None;
        }
        let f = self.file.get().ok()?;
        let fs_type = rustix::fs::fstatfs(&*f).ok()?.f_type as u64 & 0xffff_ffff;
        if fs_type != TMPFS_MAGIC {
            return None;
        }
        let (dev, ino) = (self.file.dev(), self.file.ino());
        let path = self.reopenable.then_some(&*self.path);
        let flags = OFlags::RDWR | OFlags::CLOEXEC;
        let fd = match reopen(&f, path, flags, dev, ino) {
            Ok(rw) => rw,
            Err(_) => f.try_clone().ok()?,
        };
        super::StoreMemory::from_fd(fd.into()).ok()
    }
}

/// Open an `O_DIRECT` descriptor on the same inode as `file`, with its alignment, or `None`
/// if the file system does not support (or does not benefit from) direct I/O.
fn open_direct(file: &File, path: Option<&Path>, access: Access, dev: u64, ino: u64) -> Option<(File, Align)> {
    let sx = rustix::fs::statx(file, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN | STATX_MNT_ID_UNIQUE).ok();
    let align = direct_alignment(file, sx.as_ref())?;
    let flags = access.flags() | OFlags::DIRECT | OFlags::CLOEXEC;
    // EINVAL: O_DIRECT refused.
    let direct = reopen(file, path, flags, dev, ino).ok()?;
    Some((direct, align))
}

/// The alignment of direct I/O on `file` (`sx`: its `statx` with `STATX_DIOALIGN` asked,
/// if that worked), or `None` if it should be read and written buffered: on tmpfs and ramfs
/// (the page cache is the storage: `O_DIRECT` would copy through it anyway), where the file
/// system says no direct I/O, or at an alignment the bounce buffers do not serve.
fn direct_alignment(file: &File, sx: Option<&rustix::fs::Statx>) -> Option<Align> {
    if on_memory_fs(file, sx)? {
        return None;
    }
    let (mem, offset) = match sx {
        Some(sx) if sx.stx_mask & StatxFlags::DIOALIGN.bits() != 0 => {
            if sx.stx_dio_mem_align == 0 || sx.stx_dio_offset_align == 0 {
                return None; // the file system says: no direct I/O on this file
            }
            (sx.stx_dio_mem_align as usize, sx.stx_dio_offset_align as usize)
        }
        Some(sx) => {
            let bs = sx.stx_blksize as usize;
            let oa = if bs.is_power_of_two() && (4096..=1 << 16).contains(&bs) { bs } else { 4096 };
            (4096, oa)
        }
        None => (4096, 4096),
    };
    if !mem.is_power_of_two() || !offset.is_power_of_two() || offset > BOUNCE_MAX {
        return None;
    }
    Some(Align::new(mem, offset))
}

/// `STATX_MNT_ID_UNIQUE` (Linux 6.8): `stx_mnt_id` is then a mount's id that is never
/// reused (rustix does not name it yet).
const STATX_MNT_ID_UNIQUE: StatxFlags = StatxFlags::from_bits_retain(0x4000);

/// Whether `file` is on tmpfs or ramfs (`None` if `fstatfs` fails). Asked at every open
/// of a host file, so answered per mount where `sx` carries the mount's unique id: an
/// `fstatfs` was a tenth of ubc's own part of opening a small file. Mounts are few; the
/// table is never pruned (an entry is 9 bytes, and an id is never reused).
fn on_memory_fs(file: &File, sx: Option<&rustix::fs::Statx>) -> Option<bool> {
    static MOUNTS: LazyLock<parking_lot::Mutex<HashMap<u64, bool>>> = LazyLock::new(Default::default);
    let mount = sx.filter(|sx| sx.stx_mask & STATX_MNT_ID_UNIQUE.bits() != 0).map(|sx| sx.stx_mnt_id);
    if let Some(m) = mount
        && let Some(&mem) = MOUNTS.lock().get(&m)
    {
        return Some(mem);
    }
    let fs_type = rustix::fs::fstatfs(file).ok()?.f_type as u64 & 0xffff_ffff;
    let mem = fs_type == TMPFS_MAGIC || fs_type == RAMFS_MAGIC;
    if let Some(m) = mount {
        MOUNTS.lock().insert(m, mem);
    }
    Some(mem)
}

/// Open `file` again (a new open file description) with `flags`, through `/proc/self/fd`,
/// or else by `path` if it still names the same file.
fn reopen(file: &File, path: Option<&Path>, flags: OFlags, dev: u64, ino: u64) -> io::Result<File> {
    let proc_path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let fd = match rustix::fs::open(proc_path.as_str(), flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(e) if e == rustix::io::Errno::INVAL => return Err(e.into()),
        Err(e) => match path {
            Some(p) => rustix::fs::open(p, flags, Mode::empty())?,
            None => return Err(e.into()),
        },
    };
    let st = rustix::fs::fstat(&fd)?;
    if st.st_dev as u64 != dev || st.st_ino as u64 != ino {
        return Err(io::Error::other("the file was replaced while reopening it"));
    }
    Ok(File::from(fd))
}

/// `POSIX_FADV_DONTNEED` on `f`'s pages covering `offset..offset+len` (the kernel keeps
/// partial pages at the ends of the range, so it is widened to whole pages). `f` is the
/// descriptor the transfer used: any of the file's drops the inode's pages.
fn drop_cached(f: &File, offset: u64, len: u64) {
    let (start, len) = page_span(offset, len);
    if let Some(len) = NonZeroU64::new(len) {
        let _ = rustix::fs::fadvise(f, start, Some(len), Advice::DontNeed);
    }
}

/// The flags a pooled descriptor is reopened with: the access, `O_CLOEXEC`, and `O_DIRECT`
/// in direct mode.
fn reopen_flags(access: Access, direct: bool) -> OFlags {
    let f = access.flags() | OFlags::CLOEXEC;
    if direct { f | OFlags::DIRECT } else { f }
}

/// ubc reads ahead itself; kernel read-ahead through a buffered descriptor would only leave
/// pages behind in the page cache.
fn no_readahead(f: &File) {
    let _ = rustix::fs::fadvise(f, 0, None, Advice::Random);
}

/// The whole pages covering `offset..offset+len`: `(start, len)`.
fn page_span(offset: u64, len: u64) -> (u64, u64) {
    let ps = rustix::param::page_size() as u64;
    let start = offset / ps * ps;
    let end = offset.saturating_add(len).saturating_add(ps - 1) / ps * ps;
    (start, end - start)
}

/// Retry a transfer interrupted by a signal.
fn retry(mut f: impl FnMut() -> io::Result<usize>) -> io::Result<usize> {
    loop {
        match f() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// A zeroed heap buffer with a given alignment, for direct transfers from or to unaligned
/// caller buffers.
pub(crate) struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: Layout,
}

impl AlignedBuf {
    pub(crate) fn new(len: usize, align: usize) -> AlignedBuf {
        let layout = Layout::from_size_align(len.max(1), align).expect("bounce buffer layout");
        // SAFETY: the layout has a nonzero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }

    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }

    pub(crate) fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` owns `len` initialised (zeroed) bytes, borrowed mutably through self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

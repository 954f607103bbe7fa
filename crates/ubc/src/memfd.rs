//! The memory that holds one object's cached pages: a memfd, offset in memfd = offset in
//! the file. Pages are allocated when first written through a window and freed by punching
//! a hole, which also removes them from every mapping of the memfd.

use crate::error::{Error, Result};
use crate::pager::Access;
use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{FallocateFlags, MemfdFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::ffi::CString;

/// The largest size a memfd may have (tmpfs allows `MAX_LFS_FILESIZE`, 2^63 - 1), rounded
/// down to 64 KiB so every supported page size divides it.
pub(crate) const MEMFD_SIZE: u64 = (i64::MAX as u64) & !0xffff;

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

/// Whether stores through a mapping reach the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Sharing {
    /// `MAP_SHARED`: the cache's pages themselves; stores reach the file.
    Shared,
    /// `MAP_PRIVATE`: copy-on-write; stores stay in this mapping. Pages not yet stored to
    /// show the file's current contents.
    Private,
}

pub(crate) struct Memfd {
    fd: OwnedFd,
}

impl Memfd {
    /// A new, empty memfd sized to cover every file offset (sparse: costs nothing).
    pub(crate) fn create(name: &str) -> Result<Memfd> {
        let cname = CString::new(format!("ubc:{name}")).unwrap_or_else(|_| CString::new("ubc").unwrap());
        let fd = rustix::fs::memfd_create(&cname, MemfdFlags::CLOEXEC).map_err(|e| Error::os("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, max_size()).map_err(|e| Error::os("ftruncate(memfd)", e))?;
        Ok(Memfd { fd })
    }

    /// Free the pages in `offset..offset+len` (and unmap them from every mapping).
    pub(crate) fn punch(&self, offset: u64, len: u64) -> Result<()> {
        rustix::fs::fallocate(&self.fd, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len)
            .map_err(|e| Error::os("fallocate(PUNCH_HOLE)", e))
    }

    /// Allocate zeroed memory for the holes in `offset..offset+len` (existing pages stay).
    pub(crate) fn allocate(&self, offset: u64, len: u64) -> Result<()> {
        rustix::fs::fallocate(&self.fd, FallocateFlags::KEEP_SIZE, offset, len)
            .map_err(|e| Error::os("fallocate(memfd)", e))
    }

    /// Write `buf` at `offset` with `pwrite` (for pages that hold no memory yet: the kernel
    /// allocates them without zeroing what the write covers). => `offset + buf.len()` is at
    /// most `max_size()`, so the write never meets `RLIMIT_FSIZE`.
    pub(crate) fn write_at(&self, mut buf: &[u8], mut offset: u64) -> Result<()> {
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
        // SAFETY: a fresh mapping at a kernel-chosen address; it aliases no Rust object.
        let p = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, flags, self.fd.as_fd(), offset) }
            .map_err(|e| Error::os("mmap(user mapping)", e))?;
        Ok(p as *mut u8)
    }

    /// Bytes of memory the memfd holds (allocated pages), from `fstat`.
    pub(crate) fn allocated_bytes(&self) -> u64 {
        rustix::fs::fstat(&self.fd).map(|st| st.st_blocks as u64 * 512).unwrap_or(0)
    }

    /// Map `len` bytes at `offset` shared, read-write.
    pub(crate) fn map(&self, offset: u64, len: usize) -> Result<*mut u8> {
        // SAFETY: a fresh mapping at a kernel-chosen address; it aliases no Rust object.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                self.fd.as_fd(),
                offset,
            )
        }
        .map_err(|e| Error::os("mmap(window)", e))?;
        Ok(p as *mut u8)
    }
}

/// Unmap a window. => nobody uses the address any more.
pub(crate) unsafe fn unmap(addr: *mut u8, len: usize) {
    // SAFETY: per the precondition. A failure here would mean the address was not mapped,
    // a bug we cannot recover from meaningfully; ignore it rather than abort.
    let _ = unsafe { rustix::mm::munmap(addr as *mut _, len) };
}

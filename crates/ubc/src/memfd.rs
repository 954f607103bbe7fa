//! The memory that holds one object's cached pages: a memfd, offset in memfd = offset in
//! the file. Pages are allocated when first written through a window and freed by punching
//! a hole, which also removes them from every mapping of the memfd.

use crate::error::{Error, Result};
use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{FallocateFlags, MemfdFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::ffi::CString;

/// The largest size a memfd may have (tmpfs allows `MAX_LFS_FILESIZE`, 2^63 - 1), rounded
/// down to 64 KiB so every supported page size divides it. This is also the largest file
/// length ubc supports: a page must lie wholly inside the memfd.
pub(crate) const MEMFD_SIZE: u64 = (i64::MAX as u64) & !0xffff;

pub(crate) struct Memfd {
    fd: OwnedFd,
}

impl Memfd {
    /// A new, empty memfd sized to cover every file offset (sparse: costs nothing).
    pub(crate) fn create(name: &str) -> Result<Memfd> {
        let cname = CString::new(format!("ubc:{name}")).unwrap_or_else(|_| CString::new("ubc").unwrap());
        let fd = rustix::fs::memfd_create(&cname, MemfdFlags::CLOEXEC)
            .map_err(|e| Error::os("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, MEMFD_SIZE).map_err(|e| Error::os("ftruncate(memfd)", e))?;
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

    /// A user mapping of `len` bytes at `offset`: shared or private (copy-on-write),
    /// writable or not.
    pub(crate) fn map_user(&self, offset: u64, len: usize, shared: bool, writable: bool) -> Result<*mut u8> {
        let prot = if writable { ProtFlags::READ | ProtFlags::WRITE } else { ProtFlags::READ };
        let flags = if shared { MapFlags::SHARED } else { MapFlags::PRIVATE };
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

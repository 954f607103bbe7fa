//! Stores in shared memory, and the memory a pager offers the cache for execute-in-place
//! (UBC's planned "XIP (eXecute In Place)", for "zero-copy access to filesystem images
//! stored in flash roms or other memory-mapped storage devices": here, stores kept in
//! shared memory).
//!
//! [`ShmPager`] is the memory pager whose bytes live in shmem pages — a slice of a memfd
//! shared by every such store in the process (`memfd.rs`: offset `o` of the file at `base +
//! o`, so a range is one contiguous mapping) — rather than in the heap. A cache maps those
//! pages themselves ([`Pager::memory`]): reading a file of the `mem` layer copies once,
//! from the store into the reader's buffer, and a mapping of it maps the store's own page.
//! Through a cache with XIP off (or of hugetlb pages) it is an ordinary pager: `pread` and
//! `pwrite` on its memfd.

use super::{Fill, IoMode, Pager, Seek};
use crate::huge::PageMemory;
use crate::memfd::{Arena, Memory, get_or_try_init};
use parking_lot::Mutex;
use rustix::fd::OwnedFd;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, LazyLock, OnceLock};

/// `TMPFS_MAGIC`: the file system of tmpfs files and memfds.
const TMPFS_MAGIC: u64 = 0x0102_1994;

/// The memfds every `ShmPager`'s slice comes from (a few descriptors for the whole process).
static STORES: LazyLock<Arena> = LazyLock::new(|| Arena::new(PageMemory::Shmem));

/// A store's own shared memory, offered to the cache for execute-in-place
/// ([`Pager::memory`]): byte `o` of the file at offset `o` of a shmem file.
#[derive(Clone)]
pub struct StoreMemory(pub(crate) Arc<Memory>);

impl StoreMemory {
    /// The memory of a file on tmpfs or of a memfd (not hugetlbfs, not ramfs: the cache maps
    /// it under userfaultfd minor faults, which only shmem has): byte `o` of the stored file
    /// is byte `o` of `fd`. `fd` must be open read-write for the cache to write the file
    /// (else writes fail with `EBADF`), and stays open as long as the cache uses the memory
    /// (a descriptor per such file). The file's length is the store's.
    pub fn from_fd(fd: OwnedFd) -> io::Result<StoreMemory> {
        let fs = rustix::fs::fstatfs(&fd)?;
        if fs.f_type as u64 & 0xffff_ffff != TMPFS_MAGIC {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a file on tmpfs nor a memfd"));
        }
        let st = rustix::fs::fstat(&fd)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
        }
        Ok(StoreMemory(Arc::new(Memory::of_store_file(fd))))
    }
}

impl std::fmt::Debug for StoreMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreMemory").field("store_file", &self.0.is_store_file()).finish()
    }
}

/// An anonymous, zero-filled store in shared memory: a memory pager whose pages a cache can
/// use in place ([`Pager::memory`]; see the module documentation). Never-written ranges are
/// holes and cost nothing. Its bytes go with it (and with the last cache object using them).
#[derive(Default)]
pub struct ShmPager {
    /// Made at the first write (an empty store holds no slice).
    memory: OnceLock<Arc<Memory>>,
    init: Mutex<()>,
    len: AtomicU64,
    /// Serializes changes of the length (`set_len`) with each other.
    resize: Mutex<()>,
}

impl std::fmt::Debug for ShmPager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmPager").field("len", &self.len.load(SeqCst)).finish()
    }
}

impl ShmPager {
    /// An empty store of length 0.
    pub fn new() -> ShmPager {
        ShmPager::default()
    }

    fn memory_made(&self) -> io::Result<&Arc<Memory>> {
        Ok(get_or_try_init(&self.memory, &self.init, || Memory::new(&STORES).map(Arc::new))?)
    }

    /// Bytes of memory holding data (holes cost nothing).
    pub fn stored_bytes(&self) -> u64 {
        let Some(m) = self.memory.get() else { return 0 };
        let end = self.len.load(SeqCst).next_multiple_of(4096);
        let (mut at, mut bytes) = (0, 0);
        while at < end {
            let Ok(data) = m.seek(at, end, true) else { break };
            if data >= end {
                break;
            }
            let hole = m.seek(data, end, false).unwrap_or(end);
            bytes += hole - data;
            at = hole;
        }
        bytes
    }
}

impl Pager for ShmPager {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        let end = offset.saturating_add(buf.len() as u64);
        let Some(m) = self.memory.get() else { return Ok(Fill::Hole) };
        if m.seek(offset, end, true)? >= end {
            return Ok(Fill::Hole);
        }
        // Past the length the memory is punched (`set_len`): zeros, as a pager promises.
        m.read_at(buf, offset)?;
        Ok(Fill::Data)
    }

    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let end = crate::memfd::checked_end(offset, data.len())?;
        self.memory_made()?.write_at(data, offset)?;
        self.len.fetch_max(end, SeqCst);
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.len.load(SeqCst))
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        crate::memfd::checked_end(len, 0)?;
        let _g = self.resize.lock();
        let old = self.len.load(SeqCst);
        if len < old
            && let Some(m) = self.memory.get()
        {
            // Whole pages past the end are freed, the last page's tail zeroed (tmpfs's punch
            // does both), so a growth later reads zeros there.
            m.punch(len, old.next_multiple_of(4096) - len)?;
        }
        self.len.store(len, SeqCst);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        Ok(())
    }

    fn describe(&self) -> String {
        "shared memory".to_string()
    }

    fn io_mode(&self) -> IoMode {
        IoMode::Memory
    }

    fn can_punch(&self) -> bool {
        true
    }

    fn punch(&self, offset: u64, len: u64) -> io::Result<bool> {
        if let Some(m) = self.memory.get() {
            m.punch(offset, len)?;
        }
        Ok(true)
    }

    fn seek(&self, offset: u64, what: Seek) -> io::Result<Option<u64>> {
        let len = self.len.load(SeqCst);
        if offset >= len {
            return Ok(match what {
                Seek::Data => None,
                Seek::Hole => Some(offset),
            });
        }
        let Some(m) = self.memory.get() else {
            return Ok(match what {
                Seek::Data => None,
                Seek::Hole => Some(offset),
            });
        };
        Ok(match what {
            Seek::Data => Some(m.seek(offset, len, true)?).filter(|&d| d < len),
            Seek::Hole => Some(m.seek(offset, len, false)?),
        })
    }

    fn memory(&self) -> Option<StoreMemory> {
        self.memory_made().ok().map(|m| StoreMemory(m.clone()))
    }
}

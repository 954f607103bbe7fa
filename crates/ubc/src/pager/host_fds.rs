//! Host descriptors in a bounded pool: a file pager's descriptor may be closed ("parked")
//! while the pool holds more than its limit, and is opened again on the pager's next call —
//! by *file handle* (`name_to_handle_at` when first parked, `open_by_handle_at` at each
//! reopen), so a file renamed meanwhile is found where it is now, and nothing is ever
//! reopened by a name that may name another file. So cached files, and open ones, are bounded by memory and
//! not by `RLIMIT_NOFILE` (issue 19: a descriptor per file made 15,000 cached files fail
//! with `EMFILE` under this machine's limit of 20,000).
//!
//! What is never parked (the file keeps its descriptor, as before):
//! * a file whose link count is 0 when it would be parked: its inode lives only as long as a
//!   descriptor does, so closing the last one would free its data;
//! * a file [`keep_open`] was called for: a process about to unlink or rename over a file
//!   it may have cached (the `dir` layer of a stack does, before every unlink and every
//!   rename that replaces a file) pins it first, so an open handle on it keeps working like
//!   an open descriptor would;
//! * a file on a file system without file handles (`name_to_handle_at` fails: some FUSE
//!   and network file systems), or where the process may not use them
//!   (`open_by_handle_at` needs `CAP_DAC_READ_SEARCH`, tried once per device): parking would
//!   have no safe way back. [`stats`] counts such files.
//!
//! What is not covered: another process unlinking a cached file whose descriptor is
//! parked. Its inode is then freed, and the pager's next call fails with `ESTALE` (a read
//! miss is an error; dirty pages stay dirty and `sync` reports it) — where an open
//! descriptor would have kept the unlinked data alive until its close.
//!
//! The pool is the process's (pagers are made apart from any cache). Its limit defaults to
//! a quarter of the soft `RLIMIT_NOFILE` at first use, at least 64; [`set_limit`] changes it.
//! Choosing what to park is CLOCK (each use sets a reference bit; the hand clears it or
//! parks), so a pager's use costs an uncontended lock and an atomic store, never the pool's
//! lock. A descriptor in use by a transfer when it is parked is closed when that transfer
//! ends (users hold it through an `Arc`): the limit is soft by the transfers in flight.
//!
//! Lock order: an entry's lock, then the pool's; the pool takes other entries' locks only
//! with `try_lock` (skipping busy ones), so no order between entries is needed.

use parking_lot::Mutex;
use rustix::fd::{AsRawFd, FromRawFd, OwnedFd};
use rustix::fs::OFlags;
use std::collections::HashMap;
use std::fs::File;
use std::hash::BuildHasher;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, LazyLock};

/// One pager's descriptor, parked when the pool is over its limit.
#[derive(Debug)]
pub(crate) struct HostFd {
    entry: Arc<Entry>,
}

struct Entry {
    /// The open descriptor, or `None` while parked.
    file: Mutex<Option<Arc<File>>>,
    /// CLOCK's reference bit: used since the hand last passed.
    recent: AtomicBool,
    /// Never parked (see the module documentation).
    pinned: AtomicBool,
    /// The `open` flags a reopen uses (access, `O_DIRECT`, `O_CLOEXEC`).
    flags: AtomicU32,
    /// How to reopen it, found when it is first parked (a file never parked costs no
    /// `name_to_handle_at`); `None`: it cannot be, so it is pinned.
    /// (A `OnceBox`: one pointer in every entry, where a `OnceLock` took two words.)
    handle: once_cell::race::OnceBox<Option<Handle>>,
    dev: u64,
    ino: u64,
    /// Its index in the pool's list of open descriptors (`usize::MAX` while parked). Changed
    /// under the pool's lock only.
    open_idx: AtomicUsize,
    /// Its `HostFd` is dropped: a reopen racing with that (`keep_open`) must not list it.
    gone: AtomicBool,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostFd")
            .field("open", &self.file.lock().is_some())
            .field("pinned", &self.pinned.load(Relaxed))
            .field("dev", &self.dev)
            .field("ino", &self.ino)
            .finish()
    }
}

/// A file handle and a descriptor on its mount (`open_by_handle_at`'s `mount_fd`).
struct Handle {
    mount: Arc<OwnedFd>,
    /// A `struct file_handle` with its `f_handle` bytes, as `name_to_handle_at` wrote it.
    raw: Box<[u64]>,
}

struct Pool {
    limit: AtomicUsize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The clock: the entries whose descriptor is open. Parking one moves the last into its
    /// place, so the hand only ever passes open descriptors (a clock of every entry made
    /// each park walk past all the parked ones: quadratic in the files opened).
    open: Vec<Arc<Entry>>,
    hand: usize,
    /// Entries alive (file pagers).
    files: usize,
    /// Entries by inode, for `keep_open`: one element per entry (a file opened twice has
    /// two), hashed by its inode, which the entry holds. (A map from inode to a `Vec` of
    /// entries took 41 bytes a slot and an allocation per file; the inode and a weak
    /// reference in each slot 25 bytes; a strong reference 9 — an entry is indexed from its
    /// `HostFd`'s making to its drop, which unindexes it.)
    by_inode: hashbrown::HashTable<Arc<Entry>>,
    inode_hasher: std::hash::RandomState,
    /// Per device: a directory on it to pass `open_by_handle_at` as its `mount_fd`, or `None`
    /// where handles do not work (found once per device, by `mount_of`).
    mounts: HashMap<u64, Option<Arc<OwnedFd>>>,
    parks: u64,
    reopens: u64,
}

impl State {
    fn inode_hash(&self, dev: u64, ino: u64) -> u64 {
        self.inode_hasher.hash_one((dev, ino))
    }

    /// File `e` under its inode.
    fn index_inode(&mut self, e: &Arc<Entry>) {
        let h = self.inode_hash(e.dev, e.ino);
        let hasher = &self.inode_hasher;
        self.by_inode.insert_unique(h, e.clone(), |x| hasher.hash_one((x.dev, x.ino)));
    }
}

static POOL: LazyLock<Pool> = LazyLock::new(|| {
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(1024);
    Pool { limit: AtomicUsize::new((nofile as usize / 4).max(64)), state: Mutex::new(State::default()) }
});

/// What the pool holds now (for tests and benchmarks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DescriptorPoolStats {
    /// The limit on open descriptors of file pagers.
    pub limit: usize,
    /// File pagers alive.
    pub files: usize,
    /// Of them, with their descriptor open now.
    pub open: usize,
    /// Of them, never parked (unlinked, `keep_open`, or no file handles).
    pub pinned: usize,
    /// Descriptors closed to stay under the limit, and reopened by handle, so far.
    pub parks: u64,
    pub reopens: u64,
    /// Descriptors held apart from the pool by host files a cache serves in place (XIP: a
    /// file on tmpfs; see `FilePager`'s `Pager::memory`): at most the limit — past it such
    /// files are cached as copies, with pooled descriptors.
    pub in_place: usize,
}

/// Set the limit on descriptors file pagers keep open (at least 1): beyond it the least
/// recently used are closed, to be reopened by handle when next used.
pub fn set_limit(n: usize) {
    POOL.limit.store(n.max(1), Relaxed);
    POOL.park_over_limit();
}

/// The pool's counts now.
pub fn stats() -> DescriptorPoolStats {
    let s = POOL.state.lock();
    let pinned = s.by_inode.iter().filter(|e| e.pinned.load(Relaxed)).count();
    DescriptorPoolStats {
        limit: POOL.limit.load(Relaxed),
        files: s.files,
        open: s.open.len(),
        pinned,
        parks: s.parks,
        reopens: s.reopens,
        in_place: crate::memfd::store_files(),
    }
}

/// The pool's limit now.
pub(crate) fn limit() -> usize {
    POOL.limit.load(Relaxed)
}

/// Keep the descriptors of every file pager on inode `(dev, ino)` open from now on
/// (reopening a parked one): call it before unlinking a file, or renaming another over it,
/// that a pager of this process may hold — so an open handle on it keeps working after its
/// last name is gone. Idempotent; costs a hash lookup when no pager holds the file.
pub fn keep_open(dev: u64, ino: u64) {
    let entries: Vec<Arc<Entry>> = {
        let s = POOL.state.lock();
        s.by_inode.iter_hash(s.inode_hash(dev, ino)).filter(|e| e.dev == dev && e.ino == ino).cloned().collect()
    };
    for e in entries {
        // Pinned first, so no park can come between the reopen and the pin; then reopened
        // while the file still has its name. (A park that read the flag just before holds
        // the entry's lock: the reopen waits for it and finds the descriptor parked.) A
        // reopen failure leaves it parked, and the unlink that follows makes that final —
        // nothing better is possible.
        e.pinned.store(true, Relaxed);
        let _ = POOL.get(&e);
    }
}

impl HostFd {
    /// Pool `file` (open with `flags`, on inode `(dev, ino)`, in directory `dir` if known).
    pub(crate) fn new(file: File, flags: OFlags, dev: u64, ino: u64, dir: Option<&Path>) -> HostFd {
        let entry = Arc::new(Entry {
            pinned: AtomicBool::new(false),
            file: Mutex::new(Some(Arc::new(file))),
            recent: AtomicBool::new(true),
            flags: AtomicU32::new(flags.bits()),
            handle: once_cell::race::OnceBox::new(),
            dev,
            ino,
            open_idx: AtomicUsize::new(usize::MAX),
            gone: AtomicBool::new(false),
        });
        if !POOL.add(&entry) {
            // The first file of its device: outside the pool's lock (an open and a probe).
            let file = entry.file.lock().clone().expect("just opened");
            if let Some(m) = mount_of(&file, dir, dev) {
                POOL.state.lock().mounts.entry(dev).or_insert(m);
            }
        }
        HostFd { entry }
    }

    /// The descriptor, reopened if it was parked. The caller holds it only for the call it
    /// makes (a parked descriptor closes when its last user lets go).
    #[inline]
    pub(crate) fn get(&self) -> io::Result<Arc<File>> {
        let e = &self.entry;
        if let Some(f) = &*e.file.lock() {
            if !e.recent.load(Relaxed) {
                e.recent.store(true, Relaxed);
            }
            return Ok(f.clone());
        }
        POOL.get(e)
    }

    /// A directory on the host file's file system (the one reopens by handle go through),
    /// if the pool found one.
    pub(crate) fn fs_dir(&self) -> Option<Arc<OwnedFd>> {
        POOL.state.lock().mounts.get(&self.entry.dev).cloned().flatten()
    }

    /// The host file's device number.
    pub(crate) fn dev(&self) -> u64 {
        self.entry.dev
    }

    /// The host file's inode number.
    pub(crate) fn ino(&self) -> u64 {
        self.entry.ino
    }

    /// Reopen with `flags` from now on (the pager switched to buffered I/O). => the caller
    /// changed the open descriptor's flags alike, or is about to.
    pub(crate) fn set_flags(&self, flags: OFlags) {
        self.entry.flags.store(flags.bits(), Relaxed);
    }
}

impl Drop for HostFd {
    fn drop(&mut self) {
        POOL.remove(&self.entry);
    }
}

impl Pool {
    /// The file handle of `file` (of entry `e`) with its device's directory, if reopening by
    /// handle works there.
    fn handle_of(s: &State, e: &Entry, file: &File) -> Option<Handle> {
        let mount = s.mounts.get(&e.dev)?.clone()?;
        Some(Handle { mount, raw: file_handle(file)? })
    }

    /// List a new entry; whether its device's directory was looked for already.
    fn add(&self, e: &Arc<Entry>) -> bool {
        let mut s = self.state.lock();
        s.files += 1;
        Self::list(&mut s, e);
        s.index_inode(e);
        self.park_locked(&mut s, Some(e));
        s.mounts.contains_key(&e.dev)
    }

    /// Put `e` (its descriptor just opened) on the clock.
    fn list(s: &mut State, e: &Arc<Entry>) {
        e.open_idx.store(s.open.len(), Relaxed);
        s.open.push(e.clone());
    }

    /// Take the entry at `i` off the clock (its descriptor closed or going).
    fn unlist(s: &mut State, i: usize) {
        let e = s.open.swap_remove(i);
        e.open_idx.store(usize::MAX, Relaxed);
        if let Some(moved) = s.open.get(i) {
            moved.open_idx.store(i, Relaxed);
        }
    }

    fn remove(&self, e: &Arc<Entry>) {
        // The entry's lock first (the order), then the pool's: a reopen by `keep_open` either
        // listed it already (unlisted here) or sees `gone` and does not.
        let file = e.file.lock().take();
        let mut s = self.state.lock();
        e.gone.store(true, Relaxed);
        let i = e.open_idx.load(Relaxed);
        if i != usize::MAX {
            Self::unlist(&mut s, i);
        }
        s.files -= 1;
        drop(file);
        // Its element (the index's reference to it).
        let h = s.inode_hash(e.dev, e.ino);
        if let Ok(x) = s.by_inode.find_entry(h, |x| Arc::ptr_eq(x, e)) {
            x.remove();
        }
    }

    /// The descriptor of `e`, reopened by handle if parked.
    fn get(&self, e: &Arc<Entry>) -> io::Result<Arc<File>> {
        let mut slot = e.file.lock();
        if let Some(f) = &*slot {
            return Ok(f.clone());
        }
        let h = e
            .handle
            .get()
            .and_then(|h| h.as_ref())
            .ok_or_else(|| io::Error::other("a descriptor with no handle was closed"))?;
        let f = h.open(OFlags::from_bits_retain(e.flags.load(Relaxed)))?;
        let st = rustix::fs::fstat(&f)?;
        if st.st_dev as u64 != e.dev || st.st_ino as u64 != e.ino {
            return Err(io::Error::from_raw_os_error(libc::ESTALE));
        }
        if !OFlags::from_bits_retain(e.flags.load(Relaxed)).contains(OFlags::DIRECT) {
            // ubc reads ahead itself (as `file.rs` sets on every buffered descriptor).
            let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::Random);
        }
        let f = Arc::new(f);
        e.recent.store(true, Relaxed);
        let mut s = self.state.lock();
        s.reopens += 1;
        if !e.gone.load(Relaxed) {
            *slot = Some(f.clone());
            Self::list(&mut s, e);
            self.park_locked(&mut s, Some(e));
        }
        Ok(f)
    }

    fn park_over_limit(&self) {
        self.park_locked(&mut self.state.lock(), None);
    }

    /// Park descriptors (CLOCK) until at most `limit` are open, never `keep`'s (the one just
    /// opened: its caller holds its lock). Two sweeps at most: the first may only clear
    /// reference bits.
    fn park_locked(&self, s: &mut State, keep: Option<&Arc<Entry>>) {
        let limit = self.limit.load(Relaxed);
        let mut steps = 2 * s.open.len();
        while s.open.len() > limit && steps > 0 {
            steps -= 1;
            if s.hand >= s.open.len() {
                s.hand = 0;
            }
            let i = s.hand;
            s.hand += 1;
            let e = s.open[i].clone();
            if keep.is_some_and(|k| Arc::ptr_eq(&e, k)) || e.pinned.load(Relaxed) {
                continue;
            }
            if e.recent.swap(false, Relaxed) {
                continue;
            }
            let Some(mut slot) = e.file.try_lock() else { continue };
            let Some(f) = slot.as_ref() else { continue };
            // Unlinked: its data lives only while a descriptor does. No way back: neither.
            let unlinked = rustix::fs::fstat(&**f).map_or(true, |st| st.st_nlink == 0);
            if unlinked || e.handle.get_or_init(|| Box::new(Self::handle_of(s, &e, f))).is_none() {
                e.pinned.store(true, Relaxed);
                continue;
            }
            *slot = None;
            drop(slot);
            Self::unlist(s, i);
            // The entry moved into `i` is the hand's next.
            s.hand = i;
            s.parks += 1;
        }
    }
}

impl Handle {
    fn open(&self, flags: OFlags) -> io::Result<File> {
        let mut raw = self.raw.clone();
        // SAFETY: `raw` is a file_handle as name_to_handle_at wrote it; the kernel reads it.
        let fd = unsafe {
            libc::open_by_handle_at(
                self.mount.as_raw_fd(),
                raw.as_mut_ptr() as *mut libc::file_handle,
                flags.bits() as i32,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor we just opened and own.
        Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
}

/// `file`'s handle (`name_to_handle_at`): a `struct file_handle` and its bytes.
fn file_handle(file: &File) -> Option<Box<[u64]>> {
    const HDR: usize = std::mem::size_of::<libc::file_handle>();
    let mut raw = vec![0u64; (HDR + libc::MAX_HANDLE_SZ as usize).div_ceil(8)].into_boxed_slice();
    let fh = raw.as_mut_ptr() as *mut libc::file_handle;
    let mut mount_id: libc::c_int = 0;
    // SAFETY: `raw` holds a file_handle header and MAX_HANDLE_SZ bytes, as handle_bytes says;
    // the kernel writes at most that.
    let ok = unsafe {
        (*fh).handle_bytes = libc::MAX_HANDLE_SZ as u32;
        libc::name_to_handle_at(file.as_raw_fd(), c"".as_ptr(), fh, &mut mount_id, libc::AT_EMPTY_PATH)
    } == 0;
    ok.then_some(raw)
}

/// A descriptor `open_by_handle_at` accepts as `mount_fd` for files of device `dev` — any
/// object on the file system; here the directory `dir` holding `file` (opened read-only:
/// an `O_PATH` descriptor is refused with `EBADF`) — if a handle of `file` opens through it
/// (`EPERM` without `CAP_DAC_READ_SEARCH`; no handle at all on file systems without export
/// support). `Some(None)`: handles do not work on this device, its files are never parked;
/// `None`: no directory of the device to try (`dir` unknown, gone, or elsewhere), ask again
/// with the device's next file.
fn mount_of(file: &File, dir: Option<&Path>, dev: u64) -> Option<Option<Arc<OwnedFd>>> {
    let dir = dir.map(|d| if d.as_os_str().is_empty() { Path::new(".") } else { d })?;
    let fd =
        rustix::fs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, rustix::fs::Mode::empty()).ok()?;
    if rustix::fs::fstat(&fd).ok()?.st_dev != dev {
        return None;
    }
    let Some(raw) = file_handle(file) else { return Some(None) };
    let h = Handle { mount: Arc::new(fd), raw };
    Some(h.open(OFlags::RDONLY | OFlags::CLOEXEC).ok().map(|_| h.mount))
}

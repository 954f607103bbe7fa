//! The kernels' caches as caches of the stack: each mount's kernel keeps pages, attributes
//! and names of the files it serves (long TTLs, `FOPEN_KEEP_CACHE`), and is told to drop
//! them whenever they change through anything else — another mount of the stack, another
//! layer, the write-back of a layer above into this one's bytes. The seeds' cache manager
//! with the kernel as one more cache (Heidemann & Popek: a layer's cache is invalidated when
//! a layer below writes the same file).
//!
//! News comes two ways:
//!
//! * **data** from the stack's watcher ([`ubc_stack::Stack::watch`]): bytes of a stored file
//!   changed in domain `d`. A mount whose layer lives in domain `d` drops the pages of that
//!   range (`FUSE_NOTIFY_INVAL_INODE`, which also drops the attributes: the length may have
//!   moved) — unless the change is its own write, made by one of its request threads
//!   through a kernel-cached handle (see [`Origin`]): its kernel put those bytes in its page
//!   cache itself. A change *made in* domain `d` ([`ubc_stack::Change::direct`]) changes what
//!   every layer above shows too, in bytes no translation can name in general (a
//!   compressed chunk moves): mounts above drop the whole file. Write-back into `d` from
//!   above changes nothing above.
//! * **another machine's turn** ([`ubc_stack::Change::remote`]): this machine gave up (or
//!   lost) the token of a file whose store other machines share, and its cache dropped the
//!   file; every mount drops it too — before the token goes (the watcher waits for the
//!   notices then, bounded as [`Kernels::wait_told`] is), so that a mapped load after the
//!   other machine's write faults and asks for the token again. The only pages a shared
//!   stack's mount keeps in its kernel (`--cache direct`) are those of mapped files.
//! * **names and attributes** from the mounts' own request handlers: a name removed,
//!   renamed or made (`FUSE_NOTIFY_INVAL_ENTRY` in every other mount that knows the parent
//!   directory, and `FUSE_NOTIFY_INVAL_INODE` of the directory: its attributes and its
//!   cached listing, `FOPEN_CACHE_DIR`), attributes set (`FUSE_NOTIFY_INVAL_INODE` with no
//!   range: attributes only).
//!
//! Notices are sent by one thread of their own, never by the thread that made the change:
//! the kernel's invalidation waits for locked pages, and a page stays locked while a read
//! of it waits for a request thread — which may wait for the changing thread's locks.
//! A request that changed something waits (at most a second) until the notices are sent
//! before it replies ([`Kernels::wait_told`]), so a change is visible everywhere when the
//! call that made it returns: a mapping on one mount saw a write through another after
//! 44 µs (median; `kernel_caches_of_every_mount_follow_changes_through_the_others` in
//! `tests/mount.rs` prints it).
//!
//! Not covered, and why: changes made to the store by anything but this daemon (the
//! host's own programs writing the directory under `dir:`) are seen when the attributes
//! time out (`--attr-timeout`) and a changed length drops the pages (or never, for a
//! change that keeps the length: use `--cache direct` then); a store through a shared mapping on a mount reaches the
//! stack when the kernel writes the page back (`msync`, or its periodic write-back), and
//! other mounts then.

use super::inodes::Inodes;
use fuser::{INodeNo, Notifier};
use std::ffi::OsString;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock, mpsc};
use std::time::{Duration, Instant};
use ubc_stack::Change;

/// One mount, as the notifier sees it.
pub(super) struct KernelMount {
    pub(super) id: usize,
    /// The domain its layer's files live in ([`ubc_stack::LayerRef::domain`]).
    pub(super) domain: usize,
    pub(super) notifier: Notifier,
    pub(super) inodes: Arc<RwLock<Inodes>>,
    /// Its mount point (canonical) and FUSE connection number, if it was found in the mount
    /// table: the device of the mounted file system is (0, connection), which tells the
    /// mount from what the point shows once it is unmounted.
    pub(super) point: Option<(PathBuf, u32)>,
}

type Mount = KernelMount;

enum News {
    /// Bytes of a file changed; `origin`: the mount whose own request made the change
    /// through a kernel-cached handle.
    Data(Change, Option<usize>),
    /// The entry `name` of directory `parent` (a path) was removed, replaced or made by
    /// mount `origin`.
    Entry { parent: String, name: OsString, origin: usize },
    /// The attributes of `path` changed through mount `origin`.
    Attr { path: String, origin: usize },
}

/// Every mount of the daemon, and the channel to the notifier thread.
pub(super) struct Kernels {
    /// Set once, before any mount serves a request: read without a lock by the watcher
    /// (on threads holding cache locks) and the notifier (while it waits for the kernel).
    mounts: OnceLock<Vec<Mount>>,
    queue: Queue,
}

/// The notifier's queue: news numbered in order, and how far the notifier has got.
struct Queue {
    /// The sender and the number of the last news sent (together: numbers follow the
    /// order of the channel).
    tx: Mutex<(mpsc::Sender<(u64, News)>, u64)>,
    /// The number of the last news whose notices were sent.
    done: Mutex<u64>,
    done_cv: Condvar,
}

impl Queue {
    fn send(&self, n: News) {
        let mut tx = self.tx.lock().unwrap();
        tx.1 += 1;
        let seq = tx.1;
        let _ = tx.0.send((seq, n));
    }
}

thread_local! {
    /// The mount whose request this thread is serving through a kernel-cached handle.
    static ORIGIN: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// How long a request waits for the notices of its changes before it replies anyway
/// (`Kernels::wait_told`).
const TOLD_LIMIT: Duration = Duration::from_secs(1);

/// Marks this thread as making mount `id`'s own change, while alive: its kernel already
/// holds what the change writes (the kernel copies a write into its page cache before
/// sending it, and truncates or punches its own pages).
pub(super) struct Origin(Option<usize>);

impl Origin {
    pub(super) fn enter(id: usize) -> Origin {
        Origin(ORIGIN.with(|c| c.replace(Some(id))))
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        ORIGIN.with(|c| c.set(self.0));
    }
}

impl Kernels {
    /// The registry, with its notifier thread, and the watcher to give the stack.
    pub(super) fn start() -> (Arc<Kernels>, ubc_stack::ChangeWatcher) {
        let (tx, rx) = mpsc::channel::<(u64, News)>();
        let queue = Queue { tx: Mutex::new((tx, 0)), done: Mutex::new(0), done_cv: Condvar::new() };
        let k = Arc::new(Kernels { mounts: OnceLock::new(), queue });
        let weak = Arc::downgrade(&k);
        std::thread::Builder::new()
            .name("ubc-kernel-notify".into())
            .spawn(move || {
                while let Ok((seq, n)) = rx.recv() {
                    let Some(k) = weak.upgrade() else { return };
                    k.tell(n);
                    *k.queue.done.lock().unwrap() = seq;
                    k.queue.done_cv.notify_all();
                }
            })
            .expect("spawn the notifier thread");
        let weak = Arc::downgrade(&k);
        let watcher: ubc_stack::ChangeWatcher = Arc::new(move |c: &Change| {
            let origin = ORIGIN.with(|o| o.get());
            if let Some(k) = weak.upgrade()
                && k.mounts().iter().any(|m| m.span(c, origin).is_some())
            {
                k.queue.send(News::Data(c.clone(), origin));
                // Another machine may write the file once this returns: the kernels must
                // have dropped its pages (a mapping's) by then, or a mapped read after that
                // write would see the old bytes. Bounded (`wait_told`): the notice waits for
                // pages a request of the mount may be reading, which waits for the token.
                if c.remote {
                    k.wait_told();
                }
            }
        });
        (k, watcher)
    }

    /// Wait until the notices for every change made so far are sent (at most
    /// `TOLD_LIMIT`): a request that changed a file calls it before it replies, so that
    /// when a program's write (rename, chmod, fsync …) returns, no mount's kernel still
    /// holds what it replaced — the next read or stat anywhere sees it. Every change, not
    /// only this thread's: the write-back an fsync starts may run on the cache's I/O
    /// threads. Call it holding no lock of the stack or the cache.
    ///
    /// Why a limit: a notice waits for the pages it drops, and a page being read stays
    /// locked until a request thread of that mount serves the read. If every request
    /// thread of that mount were itself waiting here, none would serve it; after the limit
    /// they reply, serve it, and the notice goes through — late, never deadlocked.
    pub(super) fn wait_told(&self) {
        let last = self.queue.tx.lock().unwrap().1;
        let deadline = Instant::now() + TOLD_LIMIT;
        let mut done = self.queue.done.lock().unwrap();
        while *done < last {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            done = self.queue.done_cv.wait_timeout(done, deadline - now).unwrap().0;
        }
    }

    /// Register every mount, once, before any of them serves a request.
    pub(super) fn set_mounts(&self, mounts: Vec<KernelMount>) {
        assert!(self.mounts.set(mounts).is_ok(), "the mounts are registered once");
    }

    fn mounts(&self) -> &[Mount] {
        self.mounts.get().map_or(&[], |v| v)
    }

    /// Make mount `id`'s kernel send what it holds written of the files `files` (inode,
    /// path in the layer), then drop their pages and attributes. Returns when the kernel
    /// has done so; the caller holds no lock of the stack or the cache and is not a request
    /// thread of that mount (the kernel's write-back needs them).
    ///
    /// Two steps, because each alone falls short on Linux 6.18: `syncfs` of the mount
    /// starts the write-back of every dirty page (and no longer waits for it on FUSE:
    /// `wait_sb_inodes` skips FUSE mounts so that a stuck daemon cannot hang `sync`);
    /// `FUSE_NOTIFY_INVAL_INODE` of each file then waits for those writes, writes back what
    /// is still dirty as it drops the pages (`launder_folio` — which since FUSE's buffered
    /// I/O moved to iomap's large folios sends only the first dirty range of a folio: seen
    /// here, one 4 KiB block per notice, hence the `syncfs` first), and makes the kernel ask
    /// for the attributes before its next write (`fuse_cache_write_iter`: the shutdown
    /// refuses them). Not `sync_file` of each file: opening a file by name asks the store,
    /// which at a shutdown may be the thing that is stuck. The notices alone are the
    /// fallback when the mount point no longer reaches the mount (detached).
    pub(super) fn pull_writes(&self, id: usize, inos: &[u64]) {
        let Some(m) = self.mounts().iter().find(|m| m.id == id) else { return };
        let _ = m.sync_fs();
        for &ino in inos {
            let _ = m.notifier.inval_inode(INodeNo(ino), 0, 0);
        }
    }

    /// Wait until no `write(2)` is copying into mount `id`'s files at `rels` (paths in the
    /// layer): open each read-only through the mount point and `lseek(SEEK_END)`, which
    /// takes the file's inode lock (`fuse_file_llseek`) — what a `write(2)` into the
    /// kernel's write-back cache holds while it copies. Such a write asked for the
    /// attributes before it took the lock, so one that asked before the shutdown made them
    /// stale cannot be refused any more: it returns Ok with its bytes in the kernel's cache,
    /// and must be waited for before the last pull (`shutdown::finish`). The close of the
    /// descriptor writes back what the kernel holds dirty of the file too (`fuse_flush`).
    /// A file the point does not reach (detached, renamed) is skipped. Same preconditions
    /// as `pull_writes`.
    pub(super) fn wait_writers(&self, id: usize, rels: &[String]) {
        let Some(m) = self.mounts().iter().find(|m| m.id == id) else { return };
        for rel in rels {
            if let Ok(f) = m.open_through_point(rel, libc::O_NOFOLLOW | libc::O_NONBLOCK) {
                // SAFETY: lseek takes a descriptor, open for the call, and integers.
                unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(&f), 0, libc::SEEK_END) };
            }
        }
    }

    /// Have mount `id`'s kernel send what it holds written of the file at `rel` (its
    /// write-back cache) before this returns — at most `TOLD_LIMIT` later. For a request
    /// that must see those bytes; called holding no lock of the stack or the cache. The
    /// write-back is asked for on a thread of its own: it needs request threads of the
    /// mount, which may all be waiting here (hence the limit).
    pub(super) fn pull(self: &Arc<Self>, id: usize, rel: &str) {
        let (tx, rx) = mpsc::channel();
        let k = self.clone();
        let rel = rel.to_string();
        let spawned = std::thread::Builder::new().name("ubc-kernel-pull".into()).spawn(move || {
            if let Some(m) = k.mounts().iter().find(|m| m.id == id)
                && let Err(e) = m.sync_file(&rel)
            {
                eprintln!("ubc mount: cannot pull the kernel's writes: {e}");
            }
            let _ = tx.send(());
        });
        if spawned.is_ok() && rx.recv_timeout(TOLD_LIMIT).is_err() {
            eprintln!("ubc mount: the kernel's writes were not all pulled within {TOLD_LIMIT:?}");
        }
    }

    /// Make mount `id`'s kernel ask again for the attributes of inode `ino` (its cached
    /// ones went stale where the kernel does not follow them: the blocks a write-back
    /// allocated). Sent at once, from the calling thread: an attribute-only invalidation
    /// takes no page lock.
    pub(super) fn attrs_stale(&self, id: usize, ino: u64) {
        if let Some(m) = self.mounts().iter().find(|m| m.id == id) {
            let _ = m.notifier.inval_inode(INodeNo(ino), -1, 0);
        }
    }

    /// Queue news of a mount's own name or attribute change, unless no other mount exists
    /// to hear it (the common case of one mount: no notifier round trip).
    fn send(&self, origin: usize, n: News) {
        if self.mounts().iter().any(|m| m.id != origin) {
            self.queue.send(n);
        }
    }

    /// Mount `origin` removed, replaced or made the entry `name` of directory `parent`.
    pub(super) fn entry_changed(&self, origin: usize, parent: &str, name: &std::ffi::OsStr) {
        self.send(origin, News::Entry { parent: parent.to_string(), name: name.to_os_string(), origin });
    }

    /// Mount `origin` changed the attributes of `path` (mode, owner, times, links).
    pub(super) fn attr_changed(&self, origin: usize, path: &str) {
        self.send(origin, News::Attr { path: path.to_string(), origin });
    }

    /// Send the notices for `n` (on the notifier thread). A notice for a node the kernel
    /// has forgotten fails with ENOENT, which is fine: it holds nothing of it.
    fn tell(&self, n: News) {
        let mounts = self.mounts();
        match n {
            News::Data(c, origin) => {
                let Some(key) = c.key else { return };
                for m in mounts.iter() {
                    let Some(range) = m.span(&c, origin) else { continue };
                    let Some(ino) = m.inodes.read().unwrap().of_key(key) else { continue };
                    let (off, len) = inval_range(&range);
                    let _ = m.notifier.inval_inode(INodeNo(ino), off, len);
                }
            }
            News::Entry { parent, name, origin } => {
                for m in mounts.iter().filter(|m| m.id != origin) {
                    let Some(dir) = m.inodes.read().unwrap().known(&parent) else { continue };
                    let _ = m.notifier.inval_entry(INodeNo(dir), &name);
                    // The directory's attributes (mtime, links) and its cached listing, which
                    // the kernel keeps in the directory's pages.
                    let _ = m.notifier.inval_inode(INodeNo(dir), 0, 0);
                }
            }
            News::Attr { path, origin } => {
                for m in mounts.iter().filter(|m| m.id != origin) {
                    let Some(ino) = m.inodes.read().unwrap().known(&path) else { continue };
                    let _ = m.notifier.inval_inode(INodeNo(ino), -1, 0);
                }
            }
        }
    }
}

impl Mount {
    /// `syncfs(2)` of this mount through its mount point, if the point still reaches it:
    /// starts the kernel's write-back of every dirty page (see `pull_writes`). Opening the
    /// root sends OPENDIR, served by the request threads; nothing is held open between calls.
    fn sync_fs(&self) -> std::result::Result<(), String> {
        let dir = self.open_through_point("", 0)?;
        // SAFETY: syncfs takes a descriptor, open for the call.
        if unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&dir)) } != 0 {
            return Err(format!("syncfs: {}", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Write back what the kernel holds dirty of the file at `rel` (a path in the layer)
    /// and wait for it: `sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)` on a descriptor
    /// opened through the mount point, if the point still reaches this mount. The kernel
    /// sends WRITE requests, served by the mount's request threads. Not `fsync` (it takes
    /// the file's lock, which a `lseek` asking here holds) and not `syncfs` (Linux 6.18
    /// starts a FUSE mount's write-back without waiting for it: `wait_sb_inodes` skips
    /// FUSE, so that a stuck daemon cannot hang `sync`). Nothing stays open between calls,
    /// so an unmount is never kept busy by this daemon.
    fn sync_file(&self, rel: &str) -> std::result::Result<(), String> {
        let f = self.open_through_point(rel, libc::O_NOFOLLOW | libc::O_NONBLOCK)?;
        let how = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        // SAFETY: sync_file_range takes a descriptor, open for the call, and integers.
        if unsafe { libc::sync_file_range(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, how) } != 0 {
            return Err(format!("sync_file_range {rel}: {}", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// `rel` (a path in the layer; "" for the root) opened read-only through the mount
    /// point with `flags`, if the point still reaches this mount: the mounted file system's
    /// device is (0, connection), which tells it from what the point shows once unmounted.
    fn open_through_point(&self, rel: &str, flags: i32) -> std::result::Result<std::fs::File, String> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let Some((point, connection)) = &self.point else { return Err("not found in the mount table".into()) };
        let path = if rel.is_empty() { point.clone() } else { point.join(rel) };
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(flags)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if f.metadata().map(|m| m.dev()).ok() != Some(libc::makedev(0, *connection)) {
            return Err(format!("{} no longer reaches the mount", point.display()));
        }
        Ok(f)
    }

    /// The bytes of the file this mount's kernel must drop for change `c` (made by a
    /// request of mount `origin` through a kernel-cached handle): the range in its own
    /// domain — unless it is its own write —, the whole file above a domain written
    /// directly, nothing below (see the module docs).
    fn span(&self, c: &Change, origin: Option<usize>) -> Option<Range<u64>> {
        if self.domain == c.domain {
            (!(c.direct && origin == Some(self.id))).then(|| c.range.clone())
        } else if self.domain > c.domain && c.direct {
            Some(0..u64::MAX)
        } else {
            None
        }
    }
}

/// `FUSE_NOTIFY_INVAL_INODE`'s (offset, length) for bytes `r`: a length of 0 reaches the
/// end of the file.
fn inval_range(r: &Range<u64>) -> (i64, i64) {
    let off = r.start.min(i64::MAX as u64) as i64;
    if r.end >= i64::MAX as u64 { (off, 0) } else { (off, (r.end - r.start) as i64) }
}

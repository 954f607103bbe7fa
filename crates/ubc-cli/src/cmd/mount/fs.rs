//! The FUSE request handlers of one mount, serving one layer of the shared stack.
//!
//! Every change (write, create, open for writing, setattr, rename, remove, mkdir) holds a
//! pass of the gate until it is in the cache, so that it fails with EROFS once the shutdown
//! has begun and the shutdown's sync covers it otherwise.

use super::attr;
use super::gate::Gate;
use super::handles::{Handle, Handles, Opener, Via};
use super::inodes::Inodes;
use super::kernels::{Kernels, Origin};
use super::passthrough::Backings;
use super::waits::{self, Interrupts};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig,
    LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus,
    ReplyEmpty, ReplyEntry, ReplyLock, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow,
    WriteFlags,
};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};
use ubc_stack::{LayerRef, LockKind, LockWait, OpenOptions, Rename, SetAttr};

/// How the kernel caches what a mount serves.
#[derive(Clone, Copy, Debug)]
pub(super) struct Caching {
    /// The kernel keeps file pages (`FOPEN_KEEP_CACHE`) and is told when they change
    /// (`kernels`); else every read and write goes to the stack (`FOPEN_DIRECT_IO`).
    pub(super) data: bool,
    /// With `data`: the kernel also keeps writes and sends them later
    /// (`FUSE_WRITEBACK_CACHE`). Only for a daemon serving one mount: nothing else then
    /// reads or writes the stack but this kernel, which holds the newest bytes and length
    /// of every file it serves (see `mod.rs`).
    pub(super) writeback: bool,
    /// With `data`: the kernel reads and writes every regular file's host file itself
    /// (`passthrough`), if it can; else `writeback` applies. Only for one mount of a `dir`
    /// layer: the kernel is then the stack's one way in, and the files it serves are the
    /// host's.
    pub(super) passthrough: bool,
    /// How long the kernel may keep attributes and names without asking.
    pub(super) ttl: Duration,
}

pub(super) struct LayerFs {
    layer: LayerRef,
    /// This mount's number among the daemon's mounts (`kernels`).
    id: usize,
    caching: Caching,
    ttl: Duration,
    /// The host directory under the bottom layer, if it is one: `statfs` reports its file
    /// system.
    statfs_dir: Option<PathBuf>,
    inodes: Arc<RwLock<Inodes>>,
    /// Every mount's kernel, told of changes made through this one.
    kernels: Arc<Kernels>,
    handles: Arc<Handles>,
    gate: Arc<Gate>,
    /// The kernel drops the cached pages a direct write overwrites (it granted
    /// `FUSE_DIRECT_IO_ALLOW_MMAP`, Linux 6.6+, whose direct writes keep the page cache of
    /// a mapped file coherent): a direct write through this mount is not news to it.
    direct_write_drops_pages: bool,
    /// The kernel agreed to cache writes (`Caching::writeback`, granted at init).
    writeback: bool,
    /// The kernel agreed to pass regular files through (`Caching::passthrough`, granted
    /// at init): every open hands it the host file.
    passthrough: bool,
    /// The backing ids of the inodes open through passthrough.
    backings: Backings,
    /// Requests the kernel interrupted, for the lock waits (`waits`).
    interrupts: Arc<Interrupts>,
}

type Result<T> = std::result::Result<T, Errno>;

/// A directory entry as listed: its `d_ino`, kind and name.
type Listed = (u64, FileType, String);

/// The errno for `e`. An EIO — a real I/O failure or a failed authentication, the errors a
/// program cannot tell apart by number — is also logged, once per message (which names the
/// path), so that the daemon's log says what broke.
fn errno(e: &ubc_stack::Error) -> Errno {
    let n = e.errno();
    if n == libc::EIO {
        log_once(&e.to_string());
    }
    Errno::from_i32(n)
}

/// Print `msg` to stderr unless it was printed before (at most 10 000 remembered).
fn log_once(msg: &str) {
    static SEEN: Mutex<Option<std::collections::HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap();
    let set = seen.get_or_insert_with(Default::default);
    if set.len() < 10_000 && set.insert(msg.to_string()) {
        eprintln!("ubc mount: I/O error: {msg}");
    }
}

/// The path of `name` in the directory `parent`; EINVAL for a name that is not one entry.
fn join(parent: &str, name: &OsStr) -> Result<String> {
    if name.len() > ubc_stack::layer::NAME_MAX {
        return Err(Errno::ENAMETOOLONG);
    }
    let name = name.to_str().ok_or(Errno::EINVAL)?;
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(Errno::EINVAL);
    }
    Ok(if parent.is_empty() { name.to_string() } else { format!("{parent}/{name}") })
}

impl LayerFs {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        layer: LayerRef,
        id: usize,
        caching: Caching,
        statfs_dir: Option<PathBuf>,
        gate: Arc<Gate>,
        handles: Arc<Handles>,
        inodes: Arc<RwLock<Inodes>>,
        kernels: Arc<Kernels>,
    ) -> LayerFs {
        LayerFs {
            layer,
            id,
            caching,
            ttl: caching.ttl,
            statfs_dir,
            inodes,
            kernels,
            handles,
            gate,
            interrupts: Arc::default(),
            direct_write_drops_pages: false,
            writeback: false,
            passthrough: false,
            backings: Backings::new(),
        }
    }

    /// A lock request: granted at once if `take(Try)` succeeds; else `busy` (`EAGAIN` for
    /// a record lock, `EWOULDBLOCK` for flock) without `sleep`, or a wait on a thread of
    /// its own (`waits`, asking `take(Retry)`) until granted, released or interrupted.
    fn lock_or_wait(
        &self,
        req: &Request,
        fh: FileHandle,
        sleep: bool,
        busy: Errno,
        mut take: impl FnMut(LockWait) -> bool + Send + 'static,
        reply: ReplyEmpty,
    ) {
        if take(LockWait::Try) {
            reply.ok()
        } else if !sleep {
            reply.error(busy)
        } else {
            let retry = move || take(LockWait::Retry);
            waits::wait_for(self.handles.clone(), self.interrupts.clone(), fh.0, req.unique().0, retry, reply)
        }
    }

    fn path(&self, ino: INodeNo) -> Result<String> {
        self.inodes.read().unwrap().path(ino.0).ok_or(Errno::ENOENT)
    }

    fn handle(&self, fh: FileHandle) -> Result<Arc<Handle>> {
        self.handles.get(fh.0).ok_or(Errno::EBADF)
    }

    /// Attributes of `path`, with its node id.
    fn stat(&self, path: &str) -> Result<FileAttr> {
        self.stat_attr(path).map(|(ino, a)| attr::file_attr(ino, &a))
    }

    /// The errno of a failed `getattr` of `path`; a name found missing (removed or renamed
    /// through another mount of the stack) is forgotten.
    fn gone(&self, path: &str, e: ubc_stack::Error) -> Errno {
        let n = errno(&e);
        if n == Errno::ENOENT {
            self.inodes.write().unwrap().remove(path);
        }
        n
    }

    /// Attributes of node `ino` by any of its names, the newest first (names found missing
    /// on the way are forgotten).
    fn stat_node(&self, ino: INodeNo) -> Result<FileAttr> {
        let paths = self.inodes.read().unwrap().paths(ino.0);
        let mut last = Errno::ENOENT;
        for p in paths {
            match self.stat(&p) {
                Err(e) if e == Errno::ENOENT => last = e,
                r => return r,
            }
        }
        Err(last)
    }

    /// The entries of directory `ino` as `readdir` shows them — ".", "..", then the layer's
    /// — each with its `d_ino` (the node id where the name is known, else the store's
    /// number: what a later lookup will show, unless that number is taken) and kind; and the
    /// directory's path.
    fn listing(&self, ino: INodeNo) -> Result<(String, Vec<Listed>)> {
        let p = self.path(ino)?;
        let entries = self.layer.readdir(&p).map_err(|e| errno(&e))?;
        let inodes = self.inodes.read().unwrap();
        // `..`: the parent's node (the kernel looked it up to reach this directory); the
        // root's parent is the root itself (node 1), as on the host's file systems.
        let parent = p.rfind('/').map_or("", |i| &p[..i]);
        let mut all = vec![
            (ino.0, FileType::Directory, ".".to_string()),
            (inodes.known(parent).unwrap_or(1), FileType::Directory, "..".to_string()),
        ];
        for e in entries {
            let child = if p.is_empty() { e.name.clone() } else { format!("{p}/{}", e.name) };
            all.push((inodes.known(&child).unwrap_or(e.ino), attr::file_type(e.kind), e.name));
        }
        drop(inodes);
        Ok((p, all))
    }

    /// Attributes of `path` for an entry reply (lookup, create, mkdir, …): the kernel then
    /// holds one more reference to the node, until it sends FORGET.
    fn entry(&self, path: &str) -> Result<FileAttr> {
        let a = self.layer.getattr(path).map_err(|e| self.gone(path, e))?;
        let ino = self.inodes.write().unwrap().node(path, (a.dev, a.ino), true);
        Ok(attr::file_attr(ino, &a))
    }

    fn stat_attr(&self, path: &str) -> Result<(u64, ubc_stack::Attr)> {
        let a = self.layer.getattr(path).map_err(|e| self.gone(path, e))?;
        let key = (a.dev, a.ino);
        let known = self.inodes.read().unwrap().current(path, key);
        let ino = match known {
            Some(ino) => ino,
            None => self.inodes.write().unwrap().node(path, key, false),
        };
        Ok((ino, a))
    }

    /// Attributes through an open handle: by its name while it has one, else what the
    /// handle last saw with the current size (the name may be gone).
    fn stat_handle(&self, ino: u64, h: &Handle) -> Result<FileAttr> {
        if let Ok(p) = self.path(INodeNo(ino))
            && let Ok((i, a)) = self.stat_attr(&p)
        {
            *h.last.lock().unwrap() = a.clone();
            return Ok(attr::file_attr(i, &a));
        }
        let last = h.last.lock().unwrap().clone();
        let size = match &h.via {
            Via::Stack(f) => f.len().map_err(|e| errno(&e))?,
            // The host file's own attributes, name or no name.
            Via::Host(p) => return p.attr().map(|a| attr::file_attr(ino, &a)).map_err(|e| errno(&e)),
        };
        Ok(attr::file_attr(ino, &attr::unlinked_file_attr(&last, size)))
    }

    /// A new file or directory belongs to the process that made it, as on the host: chown it
    /// to the requester's user and group when they are not this daemon's. Needs the
    /// privilege to give files away (a daemon run by root, as `allow_other` mounts are);
    /// otherwise every file belongs to the daemon's user, as with any unprivileged mount.
    fn give_to_requester(&self, req: &Request, path: &str) -> Result<()> {
        // SAFETY: geteuid and getegid take no arguments and always succeed.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        if (req.uid(), req.gid()) == (uid, gid) || uid != 0 {
            return Ok(());
        }
        let set = SetAttr::new().with_owner(Some(req.uid()), Some(req.gid()));
        self.layer.setattr(path, &set).map_err(|e| errno(&e))
    }

    /// After a write by `req` through `h`: a writer without `CAP_FSETID` (taken to be any
    /// user but root) clears the set-user-ID bit, and the set-group-ID bit when group execute
    /// is set, as the kernel does for its own file systems (FUSE leaves it to the daemon
    /// when writes bypass the kernel's cache). Best effort: the write itself succeeded.
    /// A truncation by such a writer does the same (`h`: the handle it came through, if any).
    fn kill_setid(&self, req: &Request, ino: INodeNo, h: Option<&Handle>) {
        let kills = |mode: u32| {
            let mut k = mode & libc::S_ISUID;
            if mode & libc::S_IXGRP != 0 {
                k |= mode & libc::S_ISGID;
            }
            k
        };
        if req.uid() == 0 || h.is_some_and(|h| kills(h.last.lock().unwrap().mode) == 0) {
            return;
        }
        let Ok(p) = self.path(ino) else { return };
        let Ok((_, a)) = self.stat_attr(&p) else { return };
        let k = kills(a.mode);
        if k != 0 {
            let mode = a.mode & !k & 0o7777;
            if self.layer.setattr(&p, &SetAttr::new().with_mode(mode)).is_ok()
                && let Some(h) = h
            {
                h.last.lock().unwrap().mode = mode;
            }
        }
    }

    /// Set the modification time the kernel's write-back cache sent for `h` and this mount
    /// deferred (`setattr`): after the bytes went to the store, which stamped it with the
    /// time of their write-back. Best effort, as the kernel's own time flush is.
    fn set_deferred_mtime(&self, h: &Handle) {
        if let Some(t) = h.take_mtime()
            && let Some(f) = h.file()
        {
            let mut set = SetAttr::new();
            set.mtime = Some(t);
            let _ = self.layer.setattr(f.path(), &set);
        }
    }

    /// Sync through `h`, as `fsync` does.
    fn sync(&self, h: &Handle) -> Result<()> {
        let r = h.sync().map_err(|e| errno(&e));
        self.set_deferred_mtime(h);
        // Written back into the domains below: their mounts' kernels drop the old bytes
        // before the fsync returns.
        self.kernels.wait_told();
        r
    }

    /// Write back through `h`, as `flush` and `release` do.
    fn write_back(&self, h: &Handle) -> Result<()> {
        let r = h.write_back().map_err(|e| errno(&e));
        self.set_deferred_mtime(h);
        // As for a sync: before the close returns.
        self.kernels.wait_told();
        r
    }

    /// Enter an open (for writing if `write`); its handle and the open flags for the
    /// kernel. With a write-through cache appends bypass the kernel's page cache: they go
    /// to the end as the stack knows it (another mount may have appended since the kernel
    /// last saw the length), which the kernel, placing them at its own idea of the end,
    /// would cache at the wrong offset. With the write-back cache the kernel's idea of the
    /// end is the newest one (it is the only writer, and holds appends not sent yet): it
    /// places appends itself, and they come here at their offsets.
    fn add_handle(
        &self,
        file: ubc_stack::File,
        ino: u64,
        append: bool,
        write: bool,
        opener: Opener,
        attr: ubc_stack::Attr,
    ) -> (FileHandle, FopenFlags) {
        let cached = self.caching.data && (!append || self.writeback);
        let append = append && !cached;
        let kernel_writes = cached && write && self.writeback;
        let flags = if cached { FopenFlags::FOPEN_KEEP_CACHE } else { FopenFlags::FOPEN_DIRECT_IO };
        (FileHandle(self.handles.add(Via::Stack(file), ino, append, cached, kernel_writes, opener, attr)), flags)
    }

    /// Open `path` for the kernel to read and write itself (`passthrough`): the host file,
    /// with access mode and `extra` flags of `flags`; a regular file (the kernel opens
    /// nothing else through a file system).
    fn open_host(&self, path: &str, flags: i32, extra: i32, mode: u32) -> Result<std::fs::File> {
        let acc = flags & libc::O_ACCMODE;
        let host = self.layer.open_host(path, acc | extra, mode).map_err(|e| errno(&e))?;
        // Only a `dir` layer has host files, and only such a mount passes files through.
        host.ok_or(Errno::EIO)
    }

    /// Enter a passed-through open of inode `ino` on `host`, registering its backing file
    /// with `register` if the inode has none yet: its handle and the backing id to reply
    /// with; `None` if the kernel refused backing files (`passthrough`): the caller serves
    /// the open through the stack.
    fn add_passed(
        &self,
        req: &Request,
        ino: u64,
        path: &str,
        host: std::fs::File,
        attr: ubc_stack::Attr,
        register: impl FnOnce(&std::fs::File) -> std::io::Result<fuser::BackingId>,
    ) -> Option<(FileHandle, Arc<fuser::BackingId>)> {
        let passed = self.backings.pass(ino, host, path, register)?;
        let backing = passed.backing();
        // Nothing to write back at its close: the opener does not matter.
        let opener = Opener::unasked(req.pid());
        Some((FileHandle(self.handles.add(Via::Host(passed), ino, false, true, false, opener, attr)), backing))
    }

    /// `open` through the stack: its handle and the open flags for the kernel.
    fn open_stack(&self, req: &Request, ino: INodeNo, flags: OpenFlags) -> Result<(FileHandle, FopenFlags)> {
        let r = (|| {
            let p = self.path(ino)?;
            let write = flags.0 & libc::O_ACCMODE != libc::O_RDONLY;
            let _pass = if write { Some(self.gate.enter()?) } else { None };
            let truncate = write && flags.0 & libc::O_TRUNC != 0;
            let f =
                self.layer.open_with(&p, OpenOptions::new().write(write).truncate(truncate)).map_err(|e| errno(&e))?;
            let (_, a) = self.stat_attr(&p)?;
            Ok(self.add_handle(f, ino.0, flags.0 & libc::O_APPEND != 0, write, Opener::of(req.pid()), a))
        })();
        self.kernels.wait_told();
        r
    }

    /// `open` on a passed-through mount.
    fn open_passed(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let r = (|| {
            let p = self.path(ino)?;
            let write = flags.0 & libc::O_ACCMODE != libc::O_RDONLY;
            let _pass = if write { Some(self.gate.enter()?) } else { None };
            let trunc = if write { flags.0 & libc::O_TRUNC } else { 0 };
            let host = self.open_host(&p, flags.0, trunc, 0)?;
            let a = ubc_stack::LayerRef::host_attr(&host).map_err(|e| errno(&e))?;
            // The kernel writes with this daemon's credentials, which keep set-ID bits: a
            // writer without the privilege to keep them loses them at its open instead of
            // at its first write, which never comes here (before, never after: the bits
            // never cover bytes written by someone else).
            if write && a.mode & (libc::S_ISUID | libc::S_ISGID) != 0 {
                self.kill_setid(req, ino, None);
                // The kernel keeps the mode it had: it does not follow a change it did not ask for.
                self.kernels.attrs_stale(self.id, ino.0);
            }
            Ok(self.add_passed(req, ino.0, &p, host, a, |f| reply.open_backing(f)))
        })();
        match r {
            Ok(Some((fh, backing))) => reply.opened_passthrough(fh, FopenFlags::empty(), &backing),
            // Backing files refused: through the stack, as without passthrough.
            Ok(None) => match self.open_stack(req, ino, flags) {
                Ok((fh, flags)) => reply.opened(fh, flags),
                Err(e) => reply.error(e),
            },
            Err(e) => reply.error(e),
        }
    }

    /// `create` on a passed-through mount (`perm`: the mode with the umask applied).
    fn create_passed(&self, req: &Request, parent: INodeNo, name: &OsStr, perm: u32, flags: i32, reply: ReplyCreate) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let parent_path = self.path(parent)?;
            let p = join(&parent_path, name)?;
            let host = self.open_host(&p, flags, libc::O_CREAT | (flags & (libc::O_EXCL | libc::O_TRUNC)), perm)?;
            self.give_to_requester(req, &p)?;
            let a = ubc_stack::LayerRef::host_attr(&host).map_err(|e| errno(&e))?;
            let ino = self.inodes.write().unwrap().node(&p, (a.dev, a.ino), true);
            let attr = attr::file_attr(ino, &a);
            let passed = self.add_passed(req, ino, &p, host, a.clone(), |f| reply.open_backing(f));
            self.entry_changed(&parent_path, name);
            match passed {
                Some((fh, backing)) => Ok((attr, fh, Ok(backing))),
                // Backing files refused: the file made, opened through the stack.
                None => {
                    let f = self.layer.open_with(&p, OpenOptions::new().write(true)).map_err(|e| errno(&e))?;
                    let append = flags & libc::O_APPEND != 0;
                    let (fh, open) = self.add_handle(f, ino, append, true, Opener::of(req.pid()), a);
                    Ok((attr, fh, Err(open)))
                }
            }
        })();
        self.kernels.wait_told();
        match r {
            Ok((a, fh, Ok(backing))) => {
                reply.created_passthrough(&self.ttl, &a, Generation(0), fh, FopenFlags::empty(), &backing)
            }
            Ok((a, fh, Err(open))) => reply.created(&self.ttl, &a, Generation(0), fh, open),
            Err(e) => reply.error(e),
        }
    }

    /// Cut the host file `path` to `len` (`passthrough`: by name, without the stack).
    fn truncate_host(&self, path: &str, len: u64) -> Result<()> {
        let f = self.open_host(path, libc::O_WRONLY, 0, 0)?;
        f.set_len(len).map_err(|e| errno(&ubc_stack::Error::io(path, e)))
    }

    /// Tell the other mounts' kernels that the entry `name` of `parent` changed (removed,
    /// replaced or made), and with it the directory's attributes and listing.
    fn entry_changed(&self, parent: &str, name: &OsStr) {
        self.kernels.entry_changed(self.id, parent, name);
    }

    /// `unlink` and `rmdir`: `remove` the entry `name` of `parent` from the layer, then
    /// forget its inode numbers (those under it too).
    fn remove(
        &self,
        parent: INodeNo,
        name: &OsStr,
        reply: ReplyEmpty,
        remove: impl FnOnce(&str) -> ubc_stack::Result<()>,
    ) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let dir = self.path(parent)?;
            let p = join(&dir, name)?;
            remove(&p).map_err(|e| errno(&e))?;
            self.inodes.write().unwrap().remove(&p);
            self.entry_changed(&dir, name);
            Ok(())
        })();
        self.kernels.wait_told();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }
}

impl Filesystem for LayerFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Shared mmap of direct-I/O files (Linux >= 6.6; appends are direct even with the
        // kernel's cache on); without it MAP_SHARED of them gives ENODEV.
        self.direct_write_drops_pages = config.add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP).is_ok();
        // Lookups and readdirs of one directory at once (they only read the layer), and,
        // while the kernel caches, symlink targets (a link's target never changes: a new
        // one is a new inode, whose entry the other mounts are told of).
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        if self.caching.data {
            let _ = config.add_capabilities(InitFlags::FUSE_CACHE_SYMLINKS);
            // Listings with attributes (`readdirplus`), when the kernel sees a listing
            // followed by lookups of its names (`_AUTO`: a bare `ls` stays a plain listing,
            // which costs no `getattr` per entry).
            let _ = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO);
            // This daemon clears set-user/group-ID bits on writes (`kill_setid`) and the host
            // does on chown, so the kernel need not check each file before each write: without
            // it, every write(2) through the page cache costs a GETXATTR of
            // "security.capability" first (`file_remove_privs`); with it the kernel sets
            // SB_NOSEC and checks an inode once.
            let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
            // Every regular file handed to the kernel (`passthrough`): its reads, writes and
            // mappings never come here. The kernel cannot do this and keep a write-back cache
            // on the same connection: one or the other. Stack depth 1: the host files are on
            // a file system that stacks on nothing (and this mount may be under overlayfs).
            if self.caching.passthrough {
                self.passthrough = config.set_max_stack_depth(1).is_ok()
                    && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok();
                if !self.passthrough {
                    eprintln!("ubc mount: the kernel has no FUSE passthrough (Linux 6.9+): files are served by ubc");
                }
            }
            // Writes stay in the kernel's page cache until it writes them back (at close,
            // fsync, memory pressure or its periodic write-back): a write(2) costs a copy,
            // not a round trip. A kernel without it keeps the write-through cache.
            if self.caching.writeback && !self.passthrough {
                self.writeback = config.add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE).is_ok();
                if !self.writeback {
                    eprintln!("ubc mount: the kernel has no write-back cache for FUSE: writes go through");
                }
            }
        }
        // Read-ahead of up to 1 MiB a request (the kernel's own limit caps it).
        let _ = config.set_max_readahead(1 << 20);
        // POSIX record locks, OFD locks and flock(2) locks come here, to the stack's one lock
        // table per file, so that a lock through one mount conflicts with one through
        // another (flock requests are told apart by the patched fuser: vendor/fuser/PATCH.md).
        // A passed-through mount is the stack's one way in: the kernel's own lock table of
        // the mount sees every locker, at no round trip.
        if !self.passthrough {
            let _ = config.add_capabilities(InitFlags::FUSE_POSIX_LOCKS | InitFlags::FUSE_FLOCK_LOCKS);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let r = self.path(parent).and_then(|p| join(&p, name)).and_then(|p| self.entry(&p));
        match r {
            Ok(a) => reply.entry(&self.ttl, &a, Generation(0)),
            // A negative entry (node 0), kept by the kernel as long as a positive one: a name
            // made through any mount or layer of the stack drops it (`entry_changed`), as a
            // removal drops a positive one. Programs look up missing names over and over
            // (search paths, lock files, `.gitignore` in every directory); with an error
            // reply each one is a round trip.
            Err(Errno::ENOENT) if !self.ttl.is_zero() => reply.entry(&self.ttl, &attr::negative(), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    /// A file removed (or renamed over) while open has no path, and the kernel's `fstat`
    /// of it comes without a file handle: its attributes come from a handle open on the inode.
    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let r = match fh.and_then(|f| self.handle(f).ok()) {
            // With the kernel's write-back cache a write(2) asks for the attributes first
            // when they are invalid, which the shutdown makes them (`shutdown::finish`):
            // refused once new changes are, the write fails with EROFS as through any other
            // path, instead of going into a cache that can no longer be written back.
            Some(h) if h.kernel_writes() && self.gate.closed() => Err(Errno::EROFS),
            Some(h) => self.stat_handle(ino.0, &h),
            None => match self.stat_node(ino) {
                Ok(a) => Ok(a),
                Err(e) => match self.handles.of_ino(ino.0) {
                    Some(h) => self.stat_handle(ino.0, &h),
                    None => Err(e),
                },
            },
        };
        match r {
            Ok(a) => reply.attr(&self.ttl, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let r = (|| {
            // The kernel's write-back cache sends the times of the bytes it writes back
            // (mtime with ctime): part of its write-back, admitted as that is (`gate`).
            let times_only = size.is_none() && mode.is_none() && uid.is_none() && gid.is_none() && atime.is_none();
            let kernel_times = times_only && ctime.is_some();
            let _pass = if kernel_times { self.gate.enter_write_back()? } else { self.gate.enter()? };
            // The kernel sends them with every write-back, also from a close by a process
            // that only inherited the descriptor (a forked child): kept on the handle and set
            // on the store when the handle writes back, so that such a close never waits on
            // the store.
            if kernel_times && let Some(h) = fh.and_then(|f| self.handle(f).ok()).filter(|h| h.kernel_writes()) {
                if let Some(m) = mtime {
                    h.defer_mtime(attr::time(m));
                }
                let size = h.file().map_or(Ok(0), |f| f.len()).map_err(|e| errno(&e))?;
                let mut a = h.last.lock().unwrap().clone();
                a.size = size;
                return Ok(attr::file_attr(ino.0, &a));
            }
            let path = self.path(ino);
            // Without a path (removed while open), a handle on the inode answers.
            let h =
                fh.and_then(|f| self.handle(f).ok()).or_else(|| path.is_err().then(|| self.handles.of_ino(ino.0))?);
            // A truncation through this mount: its kernel cuts its own pages.
            let _origin = (self.caching.data && size.is_some()).then(|| Origin::enter(self.id));
            let mut set = SetAttr::new().with_owner(uid, gid);
            set.mode = mode.map(|m| m & 0o7777);
            set.atime = atime.map(attr::time);
            set.mtime = mtime.map(attr::time);
            if let Some(s) = size {
                match (&h, &path) {
                    (Some(h), _) => {
                        let r = match &h.via {
                            Via::Stack(f) => f.set_len(s),
                            Via::Host(p) => p.set_len(s),
                        };
                        h.mark_written();
                        r.map_err(|e| errno(&e))?
                    }
                    // Passed through, the host file is cut by name: the stack must not open
                    // (and cache) a file the kernel writes behind its back.
                    (None, Ok(p)) if self.passthrough => self.truncate_host(p, s)?,
                    (None, Ok(_)) => set.size = Some(s),
                    (None, Err(e)) => return Err(*e),
                }
            }
            match &path {
                Ok(p) => {
                    if set.size.is_some() || set.changes_metadata() {
                        self.layer.setattr(p, &set).map_err(|e| errno(&e))?;
                    }
                    // A truncation by a writer without privilege clears set-ID bits, as a
                    // write does (the kernel leaves it to us: FUSE_HANDLE_KILLPRIV_V2).
                    if size.is_some() && mode.is_none() {
                        self.kill_setid(req, ino, h.as_deref());
                    }
                    self.kernels.attr_changed(self.id, p);
                    match self.stat(p) {
                        Ok(a) => Ok(a),
                        Err(e) => h.map_or(Err(e), |h| self.stat_handle(ino.0, &h)),
                    }
                }
                Err(e) => h.map_or(Err(*e), |h| self.stat_handle(ino.0, &h)),
            }
        })();
        self.kernels.wait_told();
        match r {
            Ok(a) => reply.attr(&self.ttl, &a),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let dir = self.path(parent)?;
            let p = join(&dir, name)?;
            self.layer.mkdir(&p).map_err(|e| errno(&e))?;
            self.entry_changed(&dir, name);
            let m = mode & !umask & 0o7777;
            if m != 0o755 {
                self.layer.setattr(&p, &SetAttr::new().with_mode(m)).map_err(|e| errno(&e))?;
            }
            self.give_to_requester(req, &p)?;
            self.entry(&p)
        })();
        self.kernels.wait_told();
        match r {
            Ok(a) => reply.entry(&self.ttl, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, reply, |p| self.layer.remove(p))
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, reply, |p| self.layer.rmdir(p))
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.inodes.write().unwrap().forget(ino.0, nlookup);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.path(ino).and_then(|p| self.layer.readlink(&p).map_err(|e| errno(&e))) {
            Ok(t) => reply.data(t.as_bytes()),
            Err(e) => reply.error(e),
        }
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let dir = self.path(parent)?;
            let p = join(&dir, link_name)?;
            let t = target.to_str().ok_or(Errno::EINVAL)?;
            self.layer.symlink(t, &p).map_err(|e| errno(&e))?;
            self.entry_changed(&dir, link_name);
            self.give_to_requester(req, &p)?;
            self.entry(&p)
        })();
        self.kernels.wait_told();
        match r {
            Ok(a) => reply.entry(&self.ttl, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn link(&self, _req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let from = self.path(ino)?;
            let dir = self.path(newparent)?;
            let to = join(&dir, newname)?;
            self.layer.link(&from, &to).map_err(|e| match e {
                // link(2) on a file system that cannot: EPERM.
                ubc_stack::Error::NotSupported(_) => Errno::EPERM,
                e => errno(&e),
            })?;
            self.entry_changed(&dir, newname);
            self.kernels.attr_changed(self.id, &from);
            self.entry(&to)
        })();
        self.kernels.wait_told();
        match r {
            Ok(a) => reply.entry(&self.ttl, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: ReplyEntry) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let dir = self.path(parent)?;
            let p = join(&dir, name)?;
            let kind = ubc_stack::Kind::of_mode(mode).ok_or(Errno::EINVAL)?;
            let perm = mode & !umask & 0o7777;
            if kind == ubc_stack::Kind::File {
                // mknod(S_IFREG) makes an empty regular file.
                let opts = OpenOptions::new().write(true).create(true).exclusive(true).mode(perm);
                drop(self.layer.open_with(&p, opts).map_err(|e| errno(&e))?);
            } else {
                self.layer.mknod(&p, kind, perm, rdev as u64).map_err(|e| errno(&e))?;
            }
            self.entry_changed(&dir, name);
            self.give_to_requester(req, &p)?;
            self.entry(&p)
        })();
        self.kernels.wait_told();
        match r {
            Ok(a) => reply.entry(&self.ttl, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let p = self.path(ino)?;
            let n = name.to_str().ok_or(Errno::EINVAL)?;
            self.layer.setxattr(&p, n, value, flags).map_err(|e| errno(&e))?;
            self.kernels.attr_changed(self.id, &p);
            Ok(())
        })();
        self.kernels.wait_told();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let r = (|| {
            let p = self.path(ino)?;
            let n = name.to_str().ok_or(Errno::ENODATA)?;
            self.layer.getxattr(&p, n).map_err(|e| errno(&e))
        })();
        match r {
            Ok(v) => xattr_reply(reply, &v, size),
            Err(e) => reply.error(e),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let r = self.path(ino).and_then(|p| self.layer.listxattr(&p).map_err(|e| errno(&e)));
        match r {
            Ok(names) => {
                let mut v = Vec::new();
                for n in names {
                    v.extend_from_slice(n.as_bytes());
                    v.push(0);
                }
                xattr_reply(reply, &v, size)
            }
            Err(e) => reply.error(e),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let p = self.path(ino)?;
            let n = name.to_str().ok_or(Errno::ENODATA)?;
            self.layer.removexattr(&p, n).map_err(|e| errno(&e))?;
            self.kernels.attr_changed(self.id, &p);
            Ok(())
        })();
        self.kernels.wait_told();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let (from_dir, to_dir) = (self.path(parent)?, self.path(newparent)?);
            let from = join(&from_dir, name)?;
            let to = join(&to_dir, newname)?;
            let how = if flags.contains(RenameFlags::RENAME_WHITEOUT) {
                return Err(Errno::EINVAL);
            } else if flags.contains(RenameFlags::RENAME_EXCHANGE) {
                Rename::Exchange
            } else if flags.contains(RenameFlags::RENAME_NOREPLACE) {
                Rename::NoReplace
            } else {
                Rename::Replace
            };
            self.layer.rename_with(&from, &to, how).map_err(|e| match e {
                // renameat2(2) on a file system without the mode: EINVAL.
                ubc_stack::Error::NotSupported(_) => Errno::EINVAL,
                e => errno(&e),
            })?;
            {
                let mut inodes = self.inodes.write().unwrap();
                match how {
                    Rename::Exchange => inodes.exchange(&from, &to),
                    _ => inodes.rename(&from, &to),
                }
            }
            self.entry_changed(&from_dir, name);
            self.entry_changed(&to_dir, newname);
            // The moved file's ctime (and a directory's `..`).
            self.kernels.attr_changed(self.id, &to);
            Ok(())
        })();
        self.kernels.wait_told();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if self.passthrough {
            return self.open_passed(req, ino, flags, reply);
        }
        match self.open_stack(req, ino, flags) {
            Ok((fh, flags)) => reply.opened(fh, flags),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        if self.passthrough {
            return self.create_passed(req, parent, name, mode & !umask & 0o7777, flags, reply);
        }
        let r = (|| {
            let _pass = self.gate.enter()?;
            let parent_path = self.path(parent)?;
            let p = join(&parent_path, name)?;
            let opts = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(flags & libc::O_TRUNC != 0)
                .exclusive(flags & libc::O_EXCL != 0)
                .mode(mode & !umask & 0o7777);
            let f = self.layer.open_with(&p, opts).map_err(|e| errno(&e))?;
            self.give_to_requester(req, &p)?;
            let a = self.layer.getattr(&p).map_err(|e| errno(&e))?;
            let ino = self.inodes.write().unwrap().node(&p, (a.dev, a.ino), true);
            let append = flags & libc::O_APPEND != 0;
            let (fh, open) = self.add_handle(f, ino, append, true, Opener::of(req.pid()), a.clone());
            self.entry_changed(&parent_path, name);
            Ok((attr::file_attr(ino, &a), fh, open))
        })();
        self.kernels.wait_told();
        match r {
            Ok((a, fh, open)) => reply.created(&self.ttl, &a, Generation(0), fh, open),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let r = (|| {
            let h = self.handle(fh)?;
            // The kernel reads a passed-through file itself: no READ comes for one.
            let f = h.file().ok_or(Errno::EIO)?;
            let mut buf = vec![0u8; size as usize];
            let mut n = 0;
            while n < buf.len() {
                let k = f.read_at(&mut buf[n..], offset + n as u64).map_err(|e| errno(&e))?;
                if k == 0 {
                    break;
                }
                n += k;
            }
            buf.truncate(n);
            if h.cached {
                // The kernel keeps these bytes now: ubc drops its clean copy (exclusive
                // caching), so a file read through the mount is in memory once.
                let _ = f.drop_clean(offset..offset + n as u64);
            }
            Ok(buf)
        })();
        match r {
            Ok(b) => reply.data(&b),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let r = (|| {
            // Through the gate: a write that returns Ok is in the cache before the
            // shutdown's sync starts, so it reaches the disk. The kernel's write-back of
            // what it holds (a program's write that returned, a store through a mapping) is
            // admitted while the shutdown pulls it out of the kernel (`gate`).
            let _pass = if write_flags.contains(WriteFlags::FUSE_WRITE_CACHE) {
                self.gate.enter_write_back().inspect_err(|_| {
                    // Bytes a program's write(2) was told were written: say they are lost
                    // (the program hears only at its fsync or close, if ever).
                    let path = self.handle(fh).ok().and_then(|h| h.file().map(|f| f.path().to_string()));
                    eprintln!(
                        "ubc: the kernel wrote back {} bytes at offset {offset} of {} after the final sync \
                         began: refused, those bytes are lost",
                        data.len(),
                        path.as_deref().unwrap_or("a file")
                    );
                })?
            } else {
                self.gate.enter()?
            };
            let h = self.handle(fh)?;
            // The kernel writes a passed-through file itself: no WRITE comes for one.
            let f = h.file().ok_or(Errno::EIO)?;
            // The kernel copied the bytes into its page cache (or writes back its own dirty
            // pages: a store through a mapping): not news to it.
            // A direct write drops the pages it overwrites from the kernel's cache by itself
            // on kernels with FUSE_DIRECT_IO_ALLOW_MMAP (6.6+; `direct_write_drops_pages`).
            // (Every write not into the kernel's cache is direct: appends, and every write
            // of a `--cache direct` mount.)
            let own = h.cached || write_flags.contains(WriteFlags::FUSE_WRITE_CACHE) || self.direct_write_drops_pages;
            let _origin = own.then(|| Origin::enter(self.id));
            // O_APPEND: at the end as the stack knows it (the kernel's idea of the size may be
            // stale: other mounts), read and written in one step against other appenders.
            let r = if h.append {
                match f.append(data) {
                    Ok((_, n)) if n == data.len() => Ok(n as u32),
                    Ok(_) => Err(Errno::EIO),
                    Err(e) => Err(errno(&e)),
                }
            } else {
                write_all(f, data, offset).map(|()| data.len() as u32)
            };
            h.mark_written();
            if r.is_ok() {
                self.kill_setid(req, ino, Some(&h));
            }
            r
        })();
        self.kernels.wait_told();
        match r {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    /// Every `close` of a descriptor sends FLUSH, also a forked child's close of one it
    /// inherited. Only the opener's close writes back what it wrote (into the store, without
    /// the store's fsync — durable at `fsync`, as on the host) and reports write-back errors,
    /// as NFS does; anybody else's returns at once, so that a program that forks (a shell,
    /// a test harness) is never held up — the last close (RELEASE) writes back anyway.
    fn flush(&self, req: &Request, _ino: INodeNo, fh: FileHandle, lock_owner: LockOwner, reply: ReplyEmpty) {
        // Passed through, a close has nothing to write back and no lock of the daemon's to
        // drop (locks stay in the kernel): ENOSYS makes the kernel stop sending FLUSH on
        // this connection, a round trip less per close.
        if self.passthrough {
            return reply.error(Errno::ENOSYS);
        }
        // POSIX: closing any descriptor of a file drops the process's record locks on it.
        if let Some(f) = self.handle(fh).ok().as_deref().and_then(Handle::file) {
            f.unlock_owner(ubc_stack::LockOwner(lock_owner.0));
        }
        // Only a handle written through has anything to write back: a read-only close skips
        // the question of who closes.
        let r = self
            .handle(fh)
            .and_then(|h| if h.written() && h.opener.is(req.pid()) { self.write_back(&h) } else { Ok(()) });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let h = self.handles.remove(fh.0);
        // `lock_owner` comes with FUSE_RELEASE_FLOCK_UNLOCK: the open file description that
        // held flock locks is gone.
        if let (Some(f), Some(o)) = (h.as_deref().and_then(Handle::file), lock_owner) {
            f.funlock_as(ubc_stack::LockOwner(o.0));
            f.unlock_owner(ubc_stack::LockOwner(o.0));
        }
        let ino = h.as_ref().map(|h| h.ino);
        let r = h.map(|h| self.write_back(&h));
        // The handle is gone (a request holding it finishes with it): its inode's backing id
        // may be too.
        if let Some(ino) = ino.filter(|_| self.passthrough) {
            self.backings.released(ino);
        }
        match r {
            Some(Err(e)) => reply.error(e),
            _ => reply.ok(),
        }
    }

    /// `fsync(2)`, or `fdatasync(2)` with `datasync`. The deferred modification time is set
    /// after the data is written back (whose writes would move the store's time again), so
    /// a full `fsync` makes the store's metadata durable after that.
    fn fsync(&self, _req: &Request, ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let r = self.handle(fh).and_then(|h| {
            self.sync(&h)?;
            if datasync { Ok(()) } else { h.sync_metadata().map_err(|e| errno(&e)) }
        });
        match r {
            Ok(()) => {
                // With the write-back cache the kernel keeps the attributes it had before
                // its writes (it owns size and times, and does not ask after writing): the
                // blocks the sync allocated are news to it.
                if self.writeback {
                    self.kernels.attrs_stale(self.id, ino.0);
                }
                reply.ok()
            }
            Err(e) => reply.error(e),
        }
    }

    /// `fallocate(2)`, with the kernel's effects on size and content: plain and `ZERO_RANGE`
    /// extend the file unless `KEEP_SIZE`; `PUNCH_HOLE` (which needs `KEEP_SIZE`) and
    /// `ZERO_RANGE` make the range read as zeros. Plain mode reserves the store's space
    /// where the layer's bytes are the stored ones (`ubc_stack::File::allocate`: a full
    /// store fails here); `PUNCH_HOLE` deallocates where the layer can
    /// (`ubc_stack::File::punch_hole`). `COLLAPSE_RANGE`, `INSERT_RANGE` and
    /// `UNSHARE_RANGE`: EOPNOTSUPP.
    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let h = self.handle(fh)?;
            let f = match &h.via {
                Via::Stack(f) => f,
                // The host's own fallocate, every mode and error its file system has.
                Via::Host(p) => return p.fallocate(mode, offset, length).map_err(|e| errno(&e)),
            };
            let end = offset.checked_add(length).filter(|&e| e <= i64::MAX as u64).ok_or(Errno::EFBIG)?;
            let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
            // What each mode does to the range: read as zeros, and keep space reserved.
            // ZERO_RANGE is both, as on ext4 (a punch, then the space allocated again).
            let (zero, reserve) = match mode & !libc::FALLOC_FL_KEEP_SIZE {
                0 => (false, true),
                libc::FALLOC_FL_PUNCH_HOLE if keep => (true, false),
                libc::FALLOC_FL_ZERO_RANGE => (true, true),
                _ => return Err(Errno::EOPNOTSUPP),
            };
            let size = f.len().map_err(|e| errno(&e))?;
            let r = (|| {
                if zero {
                    // Deallocated in the store where the layer can, zeros written elsewhere;
                    // clipped at the length.
                    f.punch_hole(offset..end).map_err(|e| errno(&e))?;
                }
                if reserve {
                    // Before the length moves: a full store fails here (ENOSPC).
                    f.allocate(offset..end).map_err(|e| errno(&e))?;
                }
                if !keep && end > size {
                    f.set_len(end).map_err(|e| errno(&e))?;
                }
                Ok(())
            })();
            self.kernels.wait_told();
            h.mark_written();
            r
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    /// `lseek(2)` with `SEEK_DATA` / `SEEK_HOLE` (the kernel answers the other kinds
    /// itself): holes as the stack's cache and the store know them (see
    /// `ubc::File::seek_data`); `ENXIO` at or past the end, or when no data follows.
    fn lseek(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: i64, whence: i32, reply: ReplyLseek) {
        let r = (|| {
            let h = self.handle(fh)?;
            let f = match &h.via {
                Via::Stack(f) => f,
                Via::Host(p) => return p.seek(offset, whence).map(|at| at as i64).map_err(|e| errno(&e)),
            };
            // With the write-back cache the kernel may hold written bytes ubc has not seen
            // (an extension of the file, data written into a hole) while the file is open
            // for writing: it sends them first (it asks here holding the file's lock, which
            // its write-back does not need).
            if self.writeback && self.handles.of_ino_where(h.ino, |h| h.kernel_writes()).is_some() {
                self.kernels.pull(self.id, f.path());
            }
            let offset = u64::try_from(offset).map_err(|_| Errno::ENXIO)?;
            let found = match whence {
                libc::SEEK_DATA => f.seek_data(offset),
                libc::SEEK_HOLE => f.seek_hole(offset),
                _ => return Err(Errno::EINVAL),
            };
            match found.map_err(|e| errno(&e))? {
                Some(at) => Ok(at as i64),
                None => Err(Errno::ENXIO),
            }
        })();
        match r {
            Ok(at) => reply.offset(at),
            Err(e) => reply.error(e),
        }
    }

    /// `copy_file_range(2)` inside the daemon, through the cache: up to `len` bytes, fewer
    /// only at the end of the source as the cache knows it (0 only there), so callers that
    /// loop to the length they asked for end.
    fn copy_file_range(
        &self,
        _req: &Request,
        _ino_in: INodeNo,
        fh_in: FileHandle,
        offset_in: u64,
        _ino_out: INodeNo,
        fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let (src_h, dst_h) = (self.handle(fh_in)?, self.handle(fh_out)?);
            // The reply counts bytes in 32 bits.
            let len = len.min(u32::MAX as u64 & !0xfff);
            let (src, dst) = match (&src_h.via, &dst_h.via) {
                (Via::Stack(s), Via::Stack(d)) => (s, d),
                // The host's own copy (it may share extents instead of copying).
                (Via::Host(s), Via::Host(d)) => {
                    return s.copy_to(offset_in, d, offset_out, len).map(|n| n as u32).map_err(|e| errno(&e));
                }
                // One passed through and one not (opened after the kernel refused a backing
                // file): EXDEV, and the kernel copies through read and write instead.
                _ => return Err(Errno::EXDEV),
            };
            let mut buf = vec![0u8; len.min(1 << 20) as usize];
            let mut done = 0u64;
            let r = (|| {
                while done < len {
                    let want = (len - done).min(buf.len() as u64) as usize;
                    let n = src.read_at(&mut buf[..want], offset_in + done).map_err(|e| errno(&e))?;
                    if n == 0 {
                        break;
                    }
                    write_all(dst, &buf[..n], offset_out + done)?;
                    done += n as u64;
                }
                Ok(())
            })();
            self.kernels.wait_told();
            dst_h.mark_written();
            match r {
                Ok(()) => Ok(done as u32),
                Err(_) if done > 0 => Ok(done as u32),
                Err(e) => Err(e),
            }
        })();
        match r {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn getlk(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        _pid: u32,
        reply: ReplyLock,
    ) {
        let r = (|| {
            let h = self.handle(fh)?;
            let kind = lock_kind(typ).ok_or(Errno::EINVAL)?;
            // Passed-through mounts keep locks in the kernel (never asked here).
            let f = h.file().ok_or(Errno::ENOLCK)?;
            Ok(f.test_lock(ubc_stack::LockOwner(lock_owner.0), lock_range(start, end), kind))
        })();
        match r {
            Ok(None) => reply.locked(start, end, libc::F_UNLCK, 0),
            Ok(Some(c)) => {
                let typ = if c.kind == LockKind::Exclusive { libc::F_WRLCK } else { libc::F_RDLCK };
                let end = if c.range.end == u64::MAX { i64::MAX as u64 } else { c.range.end - 1 };
                reply.locked(c.range.start, end, typ, c.pid)
            }
            Err(e) => reply.error(e),
        }
    }

    /// `F_SETLK`, and `F_SETLKW` (`sleep`): a waiting lock is waited for on a thread of its
    /// own, so that this mount goes on serving (the unlock that ends the wait may come
    /// through it). The wait ends when the lock is granted, the handle is released or the
    /// request is interrupted (`waits`).
    fn setlk(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        let h = match self.handle(fh) {
            Ok(h) if h.file().is_some() => h,
            Ok(_) => return reply.error(Errno::ENOLCK),
            Err(e) => return reply.error(e),
        };
        let (owner, range) = (ubc_stack::LockOwner(lock_owner.0), lock_range(start, end));
        if typ == libc::F_UNLCK {
            if let Some(f) = h.file() {
                f.unlock_as(owner, range);
            }
            return reply.ok();
        }
        let Some(kind) = lock_kind(typ) else { return reply.error(Errno::EINVAL) };
        let take = move |wait| h.file().is_some_and(|f| f.lock_as(owner, pid, range.clone(), kind, wait));
        self.lock_or_wait(req, fh, sleep, Errno::EAGAIN, take, reply);
    }

    /// `flock(2)`: whole-file locks of an open file description, held in the stack's lock
    /// table like record locks (so they hold across mounts and layers) but never in
    /// conflict with them. A blocking request waits on a thread of its own, as in `setlk`.
    fn flock(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        typ: i32,
        _pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        let h = match self.handle(fh) {
            Ok(h) if h.file().is_some() => h,
            Ok(_) => return reply.error(Errno::ENOLCK),
            Err(e) => return reply.error(e),
        };
        let owner = ubc_stack::LockOwner(lock_owner.0);
        if typ == libc::F_UNLCK {
            if let Some(f) = h.file() {
                f.funlock_as(owner);
            }
            return reply.ok();
        }
        let Some(kind) = lock_kind(typ) else { return reply.error(Errno::EINVAL) };
        let take = move |wait| h.file().is_some_and(|f| f.flock_as(owner, kind, wait));
        self.lock_or_wait(req, fh, sleep, Errno::EWOULDBLOCK, take, reply);
    }

    /// The kernel interrupted a request (its process got a signal): a lock wait ends with
    /// `EINTR` (`waits`); anything else finishes as it would have.
    fn interrupt(&self, unique: fuser::RequestId) -> bool {
        self.interrupts.note(unique.0);
        true
    }

    /// With the kernel's caches on, it keeps a directory's listing (`FOPEN_CACHE_DIR`, across
    /// opens: `FOPEN_KEEP_CACHE`) until the directory changes: through this mount the kernel
    /// drops it itself; a change through another reaches it as an invalidation of the
    /// directory's pages (`kernels`), where the listing lives.
    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let flags = if self.caching.data {
            FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE
        } else {
            FopenFlags::empty()
        };
        reply.opened(FileHandle(0), flags)
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        match self.listing(ino) {
            Ok((_, all)) => {
                for (i, (ino, kind, name)) in all.into_iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(e),
        }
    }

    /// A listing with each entry's attributes, which the kernel keeps as if each name had
    /// been looked up (`FUSE_DO_READDIRPLUS`, asked for while the kernel caches): `ls -l`,
    /// `find`, `rm -rf`, `diff -r`, `rsync` list a directory and then look at every entry —
    /// one round trip per entry saved. Each entry given a node is one reference, as a
    /// lookup's; "." and ".." get none (the kernel takes none for them). An entry gone
    /// between the listing and its `getattr` is listed without a node.
    fn readdirplus(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectoryPlus) {
        let (dir, all) = match self.listing(ino) {
            Ok(l) => l,
            Err(e) => return reply.error(e),
        };
        for (i, (d_ino, kind, name)) in all.into_iter().enumerate().skip(offset as usize) {
            let off = i as u64 + 1;
            let mut none = attr::negative();
            none.kind = kind;
            let full = if i < 2 {
                reply.add(INodeNo(d_ino), off, &name, &Duration::ZERO, &none, Generation(0))
            } else {
                let child = if dir.is_empty() { name.clone() } else { format!("{dir}/{name}") };
                match self.layer.getattr(&child) {
                    Ok(a) => {
                        let mut inodes = self.inodes.write().unwrap();
                        let id = inodes.node(&child, (a.dev, a.ino), true);
                        let full =
                            reply.add(INodeNo(id), off, &name, &self.ttl, &attr::file_attr(id, &a), Generation(0));
                        if full {
                            // Not sent: the reference was not handed over.
                            inodes.forget(id, 1);
                        }
                        full
                    }
                    Err(_) => reply.add(INodeNo(d_ino), off, &name, &Duration::ZERO, &none, Generation(0)),
                }
            };
            if full {
                break;
            }
        }
        reply.ok()
    }
    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.path(ino).and_then(|p| self.layer.sync_dir(&p).map_err(|e| errno(&e))) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        if let Some(s) = self.statfs_dir.as_deref().and_then(host_statvfs) {
            // The statvfs field types differ between targets (u32 on some 32-bit ones).
            #[allow(clippy::unnecessary_cast)]
            return reply.statfs(
                s.f_blocks as u64,
                s.f_bfree as u64,
                s.f_bavail as u64,
                s.f_files as u64,
                s.f_ffree as u64,
                s.f_bsize as u32,
                255,
                s.f_frsize as u32,
            );
        }
        // Not over a host directory: a nominal, empty-looking 1 TiB.
        reply.statfs(1 << 28, 1 << 28, 1 << 28, 1 << 20, 1 << 20, 4096, 255, 4096)
    }
}

/// Write all of `buf` at `at`. `File::write_at` writes it all or stops only at an error; a
/// short count (an error after some bytes) is EIO here, since FUSE replies carry no partial
/// result with an error.
fn write_all(f: &ubc_stack::File, buf: &[u8], at: u64) -> Result<()> {
    match f.write_at(buf, at) {
        Ok(n) if n == buf.len() => Ok(()),
        Ok(_) => Err(Errno::EIO),
        Err(e) => Err(errno(&e)),
    }
}

/// The lock kind of an fcntl lock type (`F_RDLCK`, `F_WRLCK`).
fn lock_kind(typ: i32) -> Option<LockKind> {
    match typ {
        libc::F_RDLCK => Some(LockKind::Shared),
        libc::F_WRLCK => Some(LockKind::Exclusive),
        _ => None,
    }
}

/// FUSE's inclusive lock range (`end` = `OFFSET_MAX`: to the end of any file) as bytes.
fn lock_range(start: u64, end: u64) -> std::ops::Range<u64> {
    let end = if end >= i64::MAX as u64 { u64::MAX } else { end + 1 };
    start..end.max(start + 1)
}

/// An extended attribute's value (or name list) `v` for a caller with a `size`-byte buffer:
/// the size alone when asked with 0, ERANGE when it does not fit.
fn xattr_reply(reply: ReplyXattr, v: &[u8], size: u32) {
    if size == 0 {
        reply.size(v.len() as u32)
    } else if v.len() > size as usize {
        reply.error(Errno::ERANGE)
    } else {
        reply.data(v)
    }
}

/// `statvfs(2)` of the host path `dir`; None if it fails.
fn host_statvfs(dir: &std::path::Path) -> Option<libc::statvfs> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs is a C struct of integers (and padding): all zeroes is a valid value.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated string and `s` a writable statvfs, both live across
    // the call, which only reads the one and writes the other.
    (unsafe { libc::statvfs(c.as_ptr(), &mut s) } == 0).then_some(s)
}

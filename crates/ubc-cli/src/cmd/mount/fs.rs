//! The FUSE request handlers of one mount, serving one layer of the shared stack.
//!
//! Every change (write, create, open for writing, setattr, rename, remove, mkdir) holds a
//! pass of the gate until it is in the cache, so that it fails with EROFS once the shutdown
//! has begun and the shutdown's sync covers it otherwise.

use super::attr::{self, Owner};
use super::gate::Gate;
use super::handles::{Handle, Handles};
use super::inodes::Inodes;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig,
    LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use ubc_stack::{LayerRef, OpenOptions, SetAttr};

pub(super) struct LayerFs {
    layer: LayerRef,
    /// Keep the kernel page cache (no direct I/O) and let the kernel cache attributes and
    /// entries for `ttl`.
    kernel_cache: bool,
    ttl: Duration,
    owner: Owner,
    /// The host directory under the bottom layer, if it is one: `statfs` reports its file
    /// system.
    statfs_dir: Option<PathBuf>,
    inodes: Mutex<Inodes>,
    handles: Arc<Handles>,
    gate: Arc<Gate>,
}

type Result<T> = std::result::Result<T, Errno>;

fn errno(e: &ubc_stack::Error) -> Errno {
    Errno::from_i32(e.errno())
}

/// The path of `name` in the directory `parent`; EINVAL for a name that is not one entry.
fn join(parent: &str, name: &OsStr) -> Result<String> {
    let name = name.to_str().ok_or(Errno::EINVAL)?;
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(Errno::EINVAL);
    }
    Ok(if parent.is_empty() { name.to_string() } else { format!("{parent}/{name}") })
}

/// The process of thread `tid` (FUSE requests carry the thread's id): its thread group
/// id from /proc, or `tid` itself if that is gone.
fn process_of(tid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Tgid:").and_then(|v| v.trim().parse().ok())))
        .unwrap_or(tid)
}

impl LayerFs {
    pub(super) fn new(
        layer: LayerRef,
        kernel_cache: bool,
        statfs_dir: Option<PathBuf>,
        gate: Arc<Gate>,
        handles: Arc<Handles>,
    ) -> LayerFs {
        LayerFs {
            layer,
            kernel_cache,
            ttl: if kernel_cache { Duration::from_secs(1) } else { Duration::ZERO },
            owner: Owner::of_process(),
            statfs_dir,
            inodes: Mutex::new(Inodes::new()),
            handles,
            gate,
        }
    }

    fn path(&self, ino: INodeNo) -> Result<String> {
        self.inodes.lock().unwrap().path(ino.0).ok_or(Errno::ENOENT)
    }

    fn handle(&self, fh: FileHandle) -> Result<Arc<Handle>> {
        self.handles.get(fh.0).ok_or(Errno::EBADF)
    }

    /// Attributes of `path`, with its inode number.
    fn stat(&self, path: &str) -> Result<FileAttr> {
        let a = self.layer.getattr(path).map_err(|e| errno(&e))?;
        let ino = self.inodes.lock().unwrap().ino(path);
        Ok(attr::file_attr(ino, &a, self.owner))
    }

    /// Attributes through an open handle (the name may be gone).
    fn stat_handle(&self, ino: u64, h: &Handle) -> Result<FileAttr> {
        let size = h.file.len().map_err(|e| errno(&e))?;
        Ok(attr::file_attr(ino, &attr::open_file_attr(ino, size), self.owner))
    }

    /// Sync through `h`, as `flush`, `release` and `fsync` do.
    fn sync(h: &Handle) -> Result<()> {
        h.sync().map_err(|e| errno(&e))
    }

    fn add_handle(&self, file: ubc_stack::File, ino: u64, append: bool, pid: u32) -> FileHandle {
        FileHandle(self.handles.add(file, ino, append, pid))
    }

    fn open_flags(&self) -> FopenFlags {
        if self.kernel_cache { FopenFlags::empty() } else { FopenFlags::FOPEN_DIRECT_IO }
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
            let p = join(&self.path(parent)?, name)?;
            remove(&p).map_err(|e| errno(&e))?;
            self.inodes.lock().unwrap().remove(&p);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }
}

impl Filesystem for LayerFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if !self.kernel_cache {
            // Shared mmap of direct-I/O files (Linux >= 6.6); without it MAP_SHARED gives ENODEV.
            let _ = config.add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let r = self.path(parent).and_then(|p| join(&p, name)).and_then(|p| self.stat(&p));
        match r {
            Ok(a) => reply.entry(&self.ttl, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    /// A file removed (or renamed over) while open has no path, and the kernel's `fstat`
    /// of it comes without a file handle: its attributes come from a handle open on the inode.
    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let r = match self.path(ino).and_then(|p| self.stat(&p)) {
            Ok(a) => Ok(a),
            Err(e) => match fh.and_then(|f| self.handle(f).ok()).or_else(|| self.handles.of_ino(ino.0)) {
                Some(h) => self.stat_handle(ino.0, &h),
                None => Err(e),
            },
        };
        match r {
            Ok(a) => reply.attr(&self.ttl, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let path = self.path(ino);
            // Without a path (removed while open), a handle on the inode answers.
            let h =
                fh.and_then(|f| self.handle(f).ok()).or_else(|| path.is_err().then(|| self.handles.of_ino(ino.0))?);
            let mut set = SetAttr {
                size: None,
                mode: mode.map(|m| m & 0o7777),
                atime: atime.map(attr::time),
                mtime: mtime.map(attr::time),
            };
            if let Some(s) = size {
                match (&h, &path) {
                    (Some(h), _) => {
                        let r = h.file.set_len(s);
                        h.mark_written();
                        r.map_err(|e| errno(&e))?
                    }
                    (None, Ok(_)) => set.size = Some(s),
                    (None, Err(e)) => return Err(*e),
                }
            }
            match &path {
                Ok(p) => {
                    if set.size.is_some() || set.mode.is_some() || set.atime.is_some() || set.mtime.is_some() {
                        self.layer.setattr(p, &set).map_err(|e| errno(&e))?;
                    }
                    match self.stat(p) {
                        Ok(a) => Ok(a),
                        Err(e) => h.map_or(Err(e), |h| self.stat_handle(ino.0, &h)),
                    }
                }
                Err(e) => h.map_or(Err(*e), |h| self.stat_handle(ino.0, &h)),
            }
        })();
        match r {
            Ok(a) => reply.attr(&self.ttl, &a),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let r = (|| {
            let _pass = self.gate.enter()?;
            let p = join(&self.path(parent)?, name)?;
            self.layer.mkdir(&p).map_err(|e| errno(&e))?;
            let m = mode & !umask & 0o7777;
            if m != 0o755 {
                let _ = self.layer.setattr(&p, &SetAttr { mode: Some(m), ..Default::default() });
            }
            self.stat(&p)
        })();
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
            let from = join(&self.path(parent)?, name)?;
            let to = join(&self.path(newparent)?, newname)?;
            if flags.contains(RenameFlags::RENAME_EXCHANGE) || flags.contains(RenameFlags::RENAME_WHITEOUT) {
                return Err(Errno::EINVAL);
            }
            if flags.contains(RenameFlags::RENAME_NOREPLACE) && self.layer.getattr(&to).is_ok() {
                return Err(Errno::EEXIST);
            }
            self.layer.rename(&from, &to).map_err(|e| errno(&e))?;
            self.inodes.lock().unwrap().rename(&from, &to);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let r = (|| {
            let p = self.path(ino)?;
            let write = flags.0 & libc::O_ACCMODE != libc::O_RDONLY;
            let _pass = if write { Some(self.gate.enter()?) } else { None };
            let truncate = write && flags.0 & libc::O_TRUNC != 0;
            let f = self.layer.open_with(&p, OpenOptions { write, create: false, truncate }).map_err(|e| errno(&e))?;
            Ok(self.add_handle(f, ino.0, flags.0 & libc::O_APPEND != 0, process_of(req.pid())))
        })();
        match r {
            Ok(fh) => reply.opened(fh, self.open_flags()),
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
        let r = (|| {
            let _pass = self.gate.enter()?;
            let p = join(&self.path(parent)?, name)?;
            if flags & libc::O_EXCL != 0 && self.layer.getattr(&p).is_ok() {
                return Err(Errno::EEXIST);
            }
            let truncate = flags & libc::O_TRUNC != 0;
            let f =
                self.layer.open_with(&p, OpenOptions { write: true, create: true, truncate }).map_err(|e| errno(&e))?;
            let m = mode & !umask & 0o7777;
            if m != 0o644 {
                let _ = self.layer.setattr(&p, &SetAttr { mode: Some(m), ..Default::default() });
            }
            let a = self.stat(&p)?;
            let fh = self.add_handle(f, a.ino.0, flags & libc::O_APPEND != 0, process_of(req.pid()));
            Ok((a, fh))
        })();
        match r {
            Ok((a, fh)) => reply.created(&self.ttl, &a, Generation(0), fh, self.open_flags()),
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
            let mut buf = vec![0u8; size as usize];
            let mut n = 0;
            while n < buf.len() {
                let k = h.file.read_at(&mut buf[n..], offset + n as u64).map_err(|e| errno(&e))?;
                if k == 0 {
                    break;
                }
                n += k;
            }
            buf.truncate(n);
            Ok(buf)
        })();
        match r {
            Ok(b) => reply.data(&b),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let r = (|| {
            // Through the gate: a write that returns Ok is in the cache before the
            // shutdown's sync starts, so it reaches the disk.
            let _pass = self.gate.enter()?;
            let h = self.handle(fh)?;
            // The kernel's idea of the size may be stale (other mounts): append at ours.
            let offset = if h.append { h.file.len().map_err(|e| errno(&e))? } else { offset };
            let mut n = 0;
            let r = loop {
                if n == data.len() {
                    break Ok(n as u32);
                }
                match h.file.write_at(&data[n..], offset + n as u64) {
                    Ok(0) => break Err(Errno::EIO),
                    Ok(k) => n += k,
                    Err(e) => break Err(errno(&e)),
                }
            };
            h.mark_written();
            r
        })();
        match r {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    /// Every `close` of a descriptor sends FLUSH, also a forked child's close of one it
    /// inherited. Only the opener's close syncs (and reports write-back errors, as NFS
    /// does); anybody else's returns at once, so that a program that forks (a shell, a
    /// test harness) is never held up by a sync — which the last close (RELEASE) does anyway.
    fn flush(&self, req: &Request, _ino: INodeNo, fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        let r = self.handle(fh).and_then(|h| if h.pid == process_of(req.pid()) { Self::sync(&h) } else { Ok(()) });
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
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let h = self.handles.remove(fh.0);
        match h.map(|h| Self::sync(&h)) {
            Some(Err(e)) => reply.error(e),
            _ => reply.ok(),
        }
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.handle(fh).and_then(|h| Self::sync(&h)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let r = (|| {
            let p = self.path(ino)?;
            let entries = self.layer.readdir(&p).map_err(|e| errno(&e))?;
            let mut all =
                vec![(ino.0, FileType::Directory, ".".to_string()), (1, FileType::Directory, "..".to_string())];
            let mut inodes = self.inodes.lock().unwrap();
            for e in entries {
                let child = if p.is_empty() { e.name.clone() } else { format!("{p}/{}", e.name) };
                all.push((inodes.ino(&child), attr::file_type(e.kind), e.name));
            }
            Ok(all)
        })();
        match r {
            Ok(all) => {
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

    fn fsyncdir(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        reply.ok()
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

/// `statvfs(2)` of the host path `dir`; None if it fails.
fn host_statvfs(dir: &std::path::Path) -> Option<libc::statvfs> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs is a C struct of integers (and padding): all zeroes is a valid value.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated string and `s` a writable statvfs, both live across
    // the call, which only reads the one and writes the other.
    (unsafe { libc::statvfs(c.as_ptr(), &mut s) } == 0).then_some(s)
}

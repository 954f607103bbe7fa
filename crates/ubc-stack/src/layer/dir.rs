//! `dir`: a host directory. Files are host files reached through the local-file pager
//! (`O_DIRECT` where the file system allows, so the kernel keeps no second copy).
//!
//! Paths never leave the root: `..` is refused by [`norm`](super::norm), and symbolic links
//! are not followed when opening or stat-ing (`O_NOFOLLOW`, `lstat`), so a link planted in
//! the directory cannot lead the stack outside it.
//!
//! Every operation works relative to a descriptor of the root held open, never on the
//! host path `root/path`: a name the mount accepts (up to `PATH_MAX` under the mount point)
//! is reachable however long the root's own path is — `root/path` could pass `PATH_MAX`
//! and fail with `ENAMETOOLONG` where the host file system would not. An operation on a
//! name resolves its parent directory beneath the root (no symbolic link followed, see
//! `Dir::open_beneath`) and acts on the last component with the `*at` call.

use super::{Attr, Below, DirEntry, Kind, Layer, Opened, Rename, SetAttr};
use crate::error::{Error, Result};
use rustix::fs::{AtFlags, Mode, OFlags};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

/// A layer over a host directory.
pub struct Dir {
    root: PathBuf,
    /// The root, `O_PATH | O_DIRECTORY`: what every operation resolves names against.
    root_fd: OwnedFd,
}

/// The directory a name lives in: the root itself, or a directory opened beneath it.
enum DirFd<'a> {
    Root(BorrowedFd<'a>),
    Sub(OwnedFd),
}

impl AsFd for DirFd<'_> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            DirFd::Root(fd) => *fd,
            DirFd::Sub(fd) => fd.as_fd(),
        }
    }
}

impl DirFd<'_> {
    /// `name` in this directory as a short path through `/proc/self/fd`, for the calls that
    /// have no `*at` form (extended attributes): never longer than a name plus a few bytes.
    fn proc_path(&self, name: &str) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}/{name}", self.as_fd().as_raw_fd()))
    }
}

fn io(path: &str, e: rustix::io::Errno) -> Error {
    Error::io(path, e.into())
}

impl Dir {
    /// A layer over the existing directory `root`.
    pub fn new(root: impl Into<PathBuf>) -> Result<Dir> {
        let root = root.into();
        let md = std::fs::metadata(&root).map_err(|e| Error::io(&root.display().to_string(), e))?;
        if !md.is_dir() {
            return Err(Error::NotDir(root.display().to_string()));
        }
        let root_fd = rustix::fs::open(&root, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| io(&root.display().to_string(), e))?;
        Ok(Dir { root, root_fd })
    }

    /// The host directory.
    pub fn root(&self) -> &std::path::Path {
        &self.root
    }

    /// The host path of `path`, for messages and labels only: operations go through
    /// the root's descriptor.
    fn host(&self, path: &str) -> PathBuf {
        if path.is_empty() { self.root.clone() } else { self.root.join(path) }
    }

    /// The directory holding `path` (opened beneath the root, no link followed) and the
    /// last component; `"."` for the root itself. => `path` normalized.
    fn parent<'p>(&self, path: &'p str) -> Result<(DirFd<'_>, &'p str)> {
        match path.rfind('/') {
            None if path.is_empty() => Ok((DirFd::Root(self.root_fd.as_fd()), ".")),
            None => Ok((DirFd::Root(self.root_fd.as_fd()), path)),
            Some(i) => {
                let d = self.open_beneath(&path[..i], libc::O_PATH | libc::O_DIRECTORY, 0)?;
                Ok((DirFd::Sub(d.into()), &path[i + 1..]))
            }
        }
    }

    /// Open `path` beneath the root without following a symbolic link anywhere in it.
    /// Race-free where the kernel has openat2(2) (Linux 5.6+: `RESOLVE_BENEATH |
    /// RESOLVE_NO_SYMLINKS`, resolved against the root's descriptor); on older kernels
    /// the components are checked first and the last one is opened `O_NOFOLLOW`, which a
    /// link swapped into an intermediate component between the two steps could defeat.
    /// `flags` are open(2) flags besides `O_CLOEXEC|O_NOFOLLOW`; `mode` is for `O_CREAT`.
    pub(crate) fn open_beneath(&self, path: &str, flags: i32, mode: u32) -> Result<std::fs::File> {
        use rustix::fs::ResolveFlags;
        let oflags = OFlags::from_bits_retain((flags | libc::O_CLOEXEC | libc::O_NOFOLLOW) as u32);
        let rel = if path.is_empty() { "." } else { path };
        let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        match rustix::fs::openat2(&self.root_fd, rel, oflags, Mode::from_bits_truncate(mode), resolve) {
            Ok(fd) => Ok(std::fs::File::from(fd)),
            Err(rustix::io::Errno::NOSYS) => {
                self.check_components(path)?;
                let fd = rustix::fs::openat(&self.root_fd, rel, oflags, Mode::from_bits_truncate(mode))
                    .map_err(|e| io(path, e))?;
                Ok(std::fs::File::from(fd))
            }
            // ELOOP / EXDEV: a link or an escape on the way.
            Err(e @ (rustix::io::Errno::LOOP | rustix::io::Errno::XDEV)) => {
                Err(Error::Invalid(format!("{path}: path goes through a symbolic link or leaves the directory ({e})")))
            }
            Err(e) => Err(io(path, e)),
        }
    }

    /// Reject a path whose intermediate components are symbolic links (a link to `/etc`
    /// inside the directory must not make `etc-link/passwd` reachable). Only for kernels
    /// without openat2(2).
    fn check_components(&self, path: &str) -> Result<()> {
        let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
        for i in 1..comps.len() {
            let prefix = comps[..i].join("/");
            if let Ok(st) = rustix::fs::statat(&self.root_fd, prefix.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                && rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Symlink
            {
                return Err(Error::Invalid(format!("{path}: path goes through a symbolic link")));
            }
        }
        Ok(())
    }
}

/// A host file's metadata as the stack's attributes.
// `struct stat`'s field types differ between architectures: the casts are not all no-ops.
#[allow(clippy::unnecessary_cast)]
pub(crate) fn attr_of(st: &rustix::fs::Stat) -> Attr {
    let at = |sec: i64, nsec: i64| {
        let d = std::time::Duration::new(sec.unsigned_abs(), nsec.clamp(0, 999_999_999) as u32);
        if sec >= 0 { std::time::UNIX_EPOCH + d } else { std::time::UNIX_EPOCH - d }
    };
    let mode = st.st_mode as u32;
    Attr {
        kind: Kind::of_mode(mode).unwrap_or(Kind::File),
        ino: st.st_ino as u64,
        mode: mode & 0o7777,
        size: st.st_size as u64,
        mtime: at(st.st_mtime as i64, st.st_mtime_nsec as i64),
        atime: at(st.st_atime as i64, st.st_atime_nsec as i64),
        ctime: at(st.st_ctime as i64, st.st_ctime_nsec as i64),
        uid: st.st_uid,
        gid: st.st_gid,
        nlink: (st.st_nlink as u64).min(u32::MAX as u64) as u32,
        blocks: st.st_blocks as u64,
        rdev: st.st_rdev as u64,
        dev: st.st_dev as u64,
    }
}

/// A rustix timestamp for `utimensat`: `t`, or "leave it" (`UTIME_OMIT`).
fn timespec(t: Option<std::time::SystemTime>) -> rustix::fs::Timespec {
    match t {
        None => rustix::fs::Timespec { tv_sec: 0, tv_nsec: rustix::fs::UTIME_OMIT },
        Some(t) => {
            let (sec, nsec) = match t.duration_since(std::time::UNIX_EPOCH) {
                Ok(d) => (d.as_secs() as i64, d.subsec_nanos() as i64),
                Err(e) => {
                    // Before 1970: whole seconds down, then the nanoseconds up from there.
                    let d = e.duration();
                    let (s, n) = (d.as_secs() as i64, d.subsec_nanos() as i64);
                    if n == 0 { (-s, 0) } else { (-s - 1, 1_000_000_000 - n) }
                }
            };
            rustix::fs::Timespec { tv_sec: sec, tv_nsec: nsec }
        }
    }
}

impl Layer for Dir {
    fn spec(&self) -> String {
        format!("dir:{}", self.root.display())
    }

    fn host_root(&self) -> Option<&std::path::Path> {
        Some(&self.root)
    }

    fn lower(&self) -> Option<&Arc<dyn Layer>> {
        None
    }

    fn getattr(&self, path: &str) -> Result<Attr> {
        let (dir, name) = self.parent(path)?;
        let st = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| io(path, e))?;
        Ok(attr_of(&st))
    }

    fn setattr(&self, path: &str, set: &SetAttr) -> Result<()> {
        let (dir, name) = self.parent(path)?;
        if set.changes_metadata() {
            // chmod(2), chown(2) and utimensat(2) on a name follow a final symbolic link (and
            // Linux cannot chmod a link itself): pin the inode without following
            // (O_PATH|O_NOFOLLOW), refuse a link, and change that very inode through its
            // descriptor — no window for a swapped-in link. O_PATH needs no permission on
            // the file, so a mode-000 file's owner can still change it, as on the host.
            let pinned =
                rustix::fs::openat(&dir, name, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())
                    .map_err(|e| io(path, e))?;
            let st = rustix::fs::fstat(&pinned).map_err(|e| io(path, e))?;
            // A link's owner and times are its own (lchown, lutimes); Linux has no mode of a
            // link to change (chmod follows links, so the kernel never asks).
            let link = rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Symlink;
            if link && set.mode.is_some() {
                return Err(Error::NotSupported(format!("{path}: the mode of a symbolic link")));
            }
            let via = PathBuf::from(format!("/proc/self/fd/{}", pinned.as_raw_fd()));
            if set.uid.is_some() || set.gid.is_some() {
                // -1 means "leave it" to chown(2): the same as None.
                let uid = set.uid.filter(|&u| u != u32::MAX).map(rustix::fs::Uid::from_raw);
                let gid = set.gid.filter(|&g| g != u32::MAX).map(rustix::fs::Gid::from_raw);
                rustix::fs::chownat(&pinned, "", uid, gid, AtFlags::EMPTY_PATH).map_err(|e| io(path, e))?;
            }
            if let Some(mode) = set.mode {
                rustix::fs::chmod(&via, Mode::from_bits_retain(mode)).map_err(|e| io(path, e))?;
            }
            if set.mtime.is_some() || set.atime.is_some() {
                let ts =
                    rustix::fs::Timestamps { last_access: timespec(set.atime), last_modification: timespec(set.mtime) };
                // /proc/self/fd/N of a link's O_PATH descriptor would be followed to the link's
                // target: a link's times are set by name in its pinned parent, not followed.
                let r = if link {
                    rustix::fs::utimensat(&dir, name, &ts, AtFlags::SYMLINK_NOFOLLOW)
                } else {
                    rustix::fs::utimensat(rustix::fs::CWD, &via, &ts, AtFlags::empty())
                };
                r.map_err(|e| io(path, e))?;
            }
        }
        if let Some(size) = set.size {
            // Only reached for files not open through the stack (the stack resizes open
            // files through the cache).
            let f = rustix::fs::openat(&dir, name, OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| io(path, e))?;
            rustix::fs::ftruncate(&f, size).map_err(|e| io(path, e))?;
        }
        Ok(())
    }

    fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        use rustix::fs::FileType;
        let d = self.open_beneath(path, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        let mut out = Vec::new();
        let entries = rustix::fs::Dir::read_from(&d).map_err(|e| io(path, e))?;
        for e in entries {
            let e = e.map_err(|e| io(path, e))?;
            let name = e.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let name = String::from_utf8_lossy(name).into_owned();
            // Some file systems leave the type out of their entries (DT_UNKNOWN): ask.
            let ft = match e.file_type() {
                FileType::Unknown => match rustix::fs::statat(&d, name.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(st) => FileType::from_raw_mode(st.st_mode),
                    Err(_) => continue, // removed meanwhile
                },
                ft => ft,
            };
            let kind = match ft {
                FileType::Directory => Kind::Dir,
                FileType::Symlink => Kind::Symlink,
                FileType::Fifo => Kind::Fifo,
                FileType::Socket => Kind::Socket,
                FileType::CharacterDevice => Kind::CharDevice,
                FileType::BlockDevice => Kind::BlockDevice,
                _ => Kind::File,
            };
            out.push(DirEntry { name, kind, ino: e.ino() });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn create(&self, path: &str, mode: u32) -> Result<()> {
        // O_EXCL: an existing name — a planted link included — is an error, never followed.
        self.open_beneath(path, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, mode).map(|_| ())
    }

    fn mkdir(&self, path: &str, mode: u32) -> Result<()> {
        let (dir, name) = self.parent(path)?;
        rustix::fs::mkdirat(&dir, name, Mode::from_bits_truncate(mode)).map_err(|e| io(path, e))
    }

    fn remove(&self, path: &str) -> Result<()> {
        let (dir, name) = self.parent(path)?;
        keep_open_before_unlink(&dir, name);
        rustix::fs::unlinkat(&dir, name, AtFlags::empty()).map_err(|e| io(path, e))
    }

    fn rmdir(&self, path: &str) -> Result<()> {
        let (dir, name) = self.parent(path)?;
        rustix::fs::unlinkat(&dir, name, AtFlags::REMOVEDIR).map_err(|e| io(path, e))
    }

    fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.rename_with(from, to, Rename::Replace)
    }

    fn rename_with(&self, from: &str, to: &str, how: Rename) -> Result<()> {
        let (fdir, fname) = self.parent(from)?;
        let (tdir, tname) = self.parent(to)?;
        if how == Rename::Replace {
            keep_open_before_unlink(&tdir, tname);
        }
        let flags = match how {
            Rename::Replace => rustix::fs::RenameFlags::empty(),
            Rename::NoReplace => rustix::fs::RenameFlags::NOREPLACE,
            Rename::Exchange => rustix::fs::RenameFlags::EXCHANGE,
        };
        rustix::fs::renameat_with(&fdir, fname, &tdir, tname, flags).map_err(|e| io(from, e))
    }

    fn sync_dir(&self, path: &str) -> Result<()> {
        let d = self.open_beneath(path, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        d.sync_all().map_err(|e| Error::io(path, e))
    }

    fn symlink(&self, target: &str, path: &str) -> Result<()> {
        let (dir, name) = self.parent(path)?;
        rustix::fs::symlinkat(target, &dir, name).map_err(|e| io(path, e))
    }

    fn readlink(&self, path: &str) -> Result<String> {
        let (dir, name) = self.parent(path)?;
        let t = rustix::fs::readlinkat(&dir, name, Vec::new()).map_err(|e| match e {
            rustix::io::Errno::INVAL => Error::Invalid(format!("{path}: not a symbolic link")),
            e => io(path, e),
        })?;
        t.into_string().map_err(|_| Error::Invalid(format!("{path}: link target is not UTF-8")))
    }

    fn link(&self, from: &str, to: &str) -> Result<()> {
        let (fdir, fname) = self.parent(from)?;
        let (tdir, tname) = self.parent(to)?;
        // linkat(2) without AT_SYMLINK_FOLLOW: a final link is linked, not followed.
        rustix::fs::linkat(&fdir, fname, &tdir, tname, AtFlags::empty()).map_err(|e| io(to, e))
    }

    fn mknod(&self, path: &str, kind: Kind, mode: u32, rdev: u64) -> Result<()> {
        let ft = match kind {
            Kind::Fifo => rustix::fs::FileType::Fifo,
            Kind::Socket => rustix::fs::FileType::Socket,
            Kind::CharDevice => rustix::fs::FileType::CharacterDevice,
            Kind::BlockDevice => rustix::fs::FileType::BlockDevice,
            _ => return Err(Error::Invalid(format!("{path}: mknod makes special files only"))),
        };
        let (dir, name) = self.parent(path)?;
        rustix::fs::mknodat(&dir, name, ft, Mode::from_bits_truncate(mode), rdev).map_err(|e| io(path, e))
    }

    fn getxattr(&self, path: &str, name: &str) -> Result<Vec<u8>> {
        let (dir, last) = self.parent(path)?;
        let p = dir.proc_path(last);
        // The value may grow between the size query and the read (ERANGE): ask again.
        loop {
            let n = rustix::fs::lgetxattr_query(&p, name).map_err(|e| io(path, e))?;
            let mut buf = vec![0u8; n];
            match rustix::fs::lgetxattr(&p, name, &mut buf[..]) {
                Ok(got) => {
                    buf.truncate(got);
                    return Ok(buf);
                }
                Err(rustix::io::Errno::RANGE) => continue,
                Err(e) => return Err(io(path, e)),
            }
        }
    }

    fn setxattr(&self, path: &str, name: &str, value: &[u8], flags: i32) -> Result<()> {
        let (dir, last) = self.parent(path)?;
        let f = rustix::fs::XattrFlags::from_bits_retain(flags as u32);
        rustix::fs::lsetxattr(dir.proc_path(last), name, value, f).map_err(|e| io(path, e))
    }

    fn listxattr(&self, path: &str) -> Result<Vec<String>> {
        let (dir, last) = self.parent(path)?;
        let p = dir.proc_path(last);
        let (buf, n) = loop {
            let n = rustix::fs::llistxattr_query(&p).map_err(|e| io(path, e))?;
            let mut buf = vec![0u8; n];
            match rustix::fs::llistxattr(&p, &mut buf[..]) {
                Ok(got) => break (buf, got),
                Err(rustix::io::Errno::RANGE) => continue,
                Err(e) => return Err(io(path, e)),
            }
        };
        Ok(buf[..n]
            .split(|&b| b == 0)
            .filter(|x| !x.is_empty())
            .map(|x| String::from_utf8_lossy(x).into_owned())
            .collect())
    }

    fn removexattr(&self, path: &str, name: &str) -> Result<()> {
        let (dir, last) = self.parent(path)?;
        rustix::fs::lremovexattr(dir.proc_path(last), name).map_err(|e| io(path, e))
    }

    fn host_file(&self, path: &str, flags: i32, mode: u32) -> Option<Result<std::fs::File>> {
        Some(self.open_beneath(path, flags, mode))
    }

    fn open(&self, path: &str, access: ubc::Access, _below: &dyn Below) -> Result<Opened> {
        let flags = if access == ubc::Access::ReadWrite { libc::O_RDWR } else { libc::O_RDONLY };
        let f = self.open_beneath(path, flags, 0)?;
        let pager = ubc::pager::FilePager::from_file(f, self.host(path), access).map_err(|e| Error::io(path, e))?;
        Ok(Opened::Store(Arc::new(pager)))
    }
}

/// Before `name` in `dir` loses a name (unlink, or a rename over it): if it is a regular
/// file a file pager of this process holds, its descriptor must stay open from now on — a
/// parked descriptor (`ubc::pager::host_fds`) could not be reopened once the file has no
/// name and no descriptor, and an open handle on a removed file keeps working like an
/// open descriptor.
fn keep_open_before_unlink(dir: &impl rustix::fd::AsFd, name: &str) {
    if let Ok(st) = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
        && st.st_mode & libc::S_IFMT == libc::S_IFREG
    {
        ubc::pager::host_fds::keep_open(st.st_dev, st.st_ino);
    }
}

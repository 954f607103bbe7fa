//! `dir`: a host directory. Files are host files reached through the local-file pager
//! (`O_DIRECT` where the file system allows, so the kernel keeps no second copy).
//!
//! Paths never leave the root: `..` is refused by [`norm`](super::norm), and symbolic links
//! are not followed when opening or stat-ing (`O_NOFOLLOW`, `lstat`), so a link planted in
//! the directory cannot lead the stack outside it.

use super::{Attr, Below, DirEntry, Kind, Layer, Opened, Rename, SetAttr};
use crate::error::{Error, Result};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::Arc;

/// A layer over a host directory.
pub struct Dir {
    root: PathBuf,
}

impl Dir {
    /// A layer over the existing directory `root`.
    pub fn new(root: impl Into<PathBuf>) -> Result<Dir> {
        let root = root.into();
        let md = std::fs::metadata(&root).map_err(|e| Error::io(&root.display().to_string(), e))?;
        if !md.is_dir() {
            return Err(Error::NotDir(root.display().to_string()));
        }
        Ok(Dir { root })
    }

    /// The host directory.
    pub fn root(&self) -> &std::path::Path {
        &self.root
    }

    fn host(&self, path: &str) -> PathBuf {
        if path.is_empty() { self.root.clone() } else { self.root.join(path) }
    }

    /// Open `path` beneath the root without following a symbolic link anywhere in it.
    /// Race-free where the kernel has openat2(2) (Linux 5.6+: `RESOLVE_BENEATH |
    /// RESOLVE_NO_SYMLINKS`, resolved against a descriptor of the root); on older kernels
    /// the components are checked first and the last one is opened `O_NOFOLLOW`, which a
    /// link swapped into an intermediate component between the two steps could defeat.
    /// `flags` are open(2) flags besides `O_CLOEXEC|O_NOFOLLOW`; `mode` is for `O_CREAT`.
    pub(crate) fn open_beneath(&self, path: &str, flags: i32, mode: u32) -> Result<std::fs::File> {
        use rustix::fs::{Mode, OFlags, ResolveFlags};
        let root = std::fs::File::options()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
            .open(&self.root)
            .map_err(|e| Error::io("", e))?;
        let oflags = OFlags::from_bits_retain((flags | libc::O_CLOEXEC | libc::O_NOFOLLOW) as u32);
        let rel = if path.is_empty() { "." } else { path };
        let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        match rustix::fs::openat2(&root, rel, oflags, Mode::from_bits_truncate(mode), resolve) {
            Ok(fd) => Ok(std::fs::File::from(fd)),
            Err(rustix::io::Errno::NOSYS) => {
                self.check_components(path)?;
                let fd = rustix::fs::openat(&root, rel, oflags, Mode::from_bits_truncate(mode))
                    .map_err(|e| Error::io(path, e.into()))?;
                Ok(std::fs::File::from(fd))
            }
            // ELOOP / EXDEV: a link or an escape on the way.
            Err(e @ (rustix::io::Errno::LOOP | rustix::io::Errno::XDEV)) => {
                Err(Error::Invalid(format!("{path}: path goes through a symbolic link or leaves the directory ({e})")))
            }
            Err(e) => Err(Error::io(path, e.into())),
        }
    }

    /// Reject a path whose intermediate components are symbolic links (a link to `/etc`
    /// inside the directory must not make `etc-link/passwd` reachable).
    fn check_components(&self, path: &str) -> Result<()> {
        let mut cur = self.root.clone();
        let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
        for c in comps.iter().take(comps.len().saturating_sub(1)) {
            cur.push(c);
            match std::fs::symlink_metadata(&cur) {
                Ok(md) if md.file_type().is_symlink() => {
                    return Err(Error::Invalid(format!("{path}: path goes through a symbolic link")));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

pub(crate) fn attr_of(md: &std::fs::Metadata) -> Attr {
    let at = |sec: i64, nsec: i64| {
        let d = std::time::Duration::new(sec.unsigned_abs(), nsec.clamp(0, 999_999_999) as u32);
        if sec >= 0 { std::time::UNIX_EPOCH + d } else { std::time::UNIX_EPOCH - d }
    };
    Attr {
        kind: Kind::of_mode(md.mode()).unwrap_or(Kind::File),
        ino: md.ino(),
        mode: md.mode() & 0o7777,
        size: md.len(),
        mtime: at(md.mtime(), md.mtime_nsec()),
        atime: at(md.atime(), md.atime_nsec()),
        ctime: at(md.ctime(), md.ctime_nsec()),
        uid: md.uid(),
        gid: md.gid(),
        nlink: md.nlink().min(u32::MAX as u64) as u32,
        blocks: md.blocks(),
        rdev: md.rdev(),
        dev: md.dev(),
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

    fn lower(&self) -> Option<&Arc<dyn Layer>> {
        None
    }

    fn getattr(&self, path: &str) -> Result<Attr> {
        self.check_components(path)?;
        let md = std::fs::symlink_metadata(self.host(path)).map_err(|e| Error::io(path, e))?;
        Ok(attr_of(&md))
    }

    fn setattr(&self, path: &str, set: &SetAttr) -> Result<()> {
        self.check_components(path)?;
        let p = self.host(path);
        if set.changes_metadata() {
            // chmod(2), chown(2) and utimensat(2) on a name follow a final symbolic link (and
            // Linux cannot chmod a link itself): pin the inode without following
            // (O_PATH|O_NOFOLLOW), refuse a link, and change that very inode through its
            // descriptor — no window for a swapped-in link. O_PATH needs no permission on
            // the file, so a mode-000 file's owner can still change it, as on the host.
            let pinned = std::fs::File::options()
                .read(true)
                .custom_flags(libc::O_PATH | libc::O_NOFOLLOW)
                .open(&p)
                .map_err(|e| Error::io(path, e))?;
            let md = pinned.metadata().map_err(|e| Error::io(path, e))?;
            // A link's owner and times are its own (lchown, lutimes); Linux has no mode of a
            // link to change (chmod follows links, so the kernel never asks).
            let link = md.file_type().is_symlink();
            if link && set.mode.is_some() {
                return Err(Error::NotSupported(format!("{path}: the mode of a symbolic link")));
            }
            use std::os::fd::AsRawFd;
            let via = PathBuf::from(format!("/proc/self/fd/{}", pinned.as_raw_fd()));
            if set.uid.is_some() || set.gid.is_some() {
                // -1 means "leave it" to chown(2): the same as None.
                let uid = set.uid.filter(|&u| u != u32::MAX).map(rustix::fs::Uid::from_raw);
                let gid = set.gid.filter(|&g| g != u32::MAX).map(rustix::fs::Gid::from_raw);
                rustix::fs::chownat(&pinned, "", uid, gid, rustix::fs::AtFlags::EMPTY_PATH)
                    .map_err(|e| Error::io(path, e.into()))?;
            }
            if let Some(mode) = set.mode {
                std::fs::set_permissions(&via, std::fs::Permissions::from_mode(mode))
                    .map_err(|e| Error::io(path, e))?;
            }
            if set.mtime.is_some() || set.atime.is_some() {
                let ts =
                    rustix::fs::Timestamps { last_access: timespec(set.atime), last_modification: timespec(set.mtime) };
                // /proc/self/fd/N of a link's O_PATH descriptor would be followed to the link's
                // target: a link's times are set by name without following it (its parents
                // were checked above).
                let r = if link {
                    rustix::fs::utimensat(rustix::fs::CWD, &p, &ts, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
                } else {
                    rustix::fs::utimensat(rustix::fs::CWD, &via, &ts, rustix::fs::AtFlags::empty())
                };
                r.map_err(|e| Error::io(path, e.into()))?;
            }
        }
        if let Some(size) = set.size {
            // Only reached for files not open through the stack (the stack resizes open
            // files through the cache).
            let f = std::fs::File::options()
                .write(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&p)
                .map_err(|e| Error::io(path, e))?;
            f.set_len(size).map_err(|e| Error::io(path, e))?;
        }
        Ok(())
    }

    fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.check_components(path)?;
        let mut out = Vec::new();
        for e in std::fs::read_dir(self.host(path)).map_err(|e| Error::io(path, e))? {
            let e = e.map_err(|e| Error::io(path, e))?;
            let ft = e.file_type().map_err(|e| Error::io(path, e))?;
            use std::os::unix::fs::{DirEntryExt, FileTypeExt};
            let kind = if ft.is_dir() {
                Kind::Dir
            } else if ft.is_symlink() {
                Kind::Symlink
            } else if ft.is_fifo() {
                Kind::Fifo
            } else if ft.is_socket() {
                Kind::Socket
            } else if ft.is_char_device() {
                Kind::CharDevice
            } else if ft.is_block_device() {
                Kind::BlockDevice
            } else {
                Kind::File
            };
            out.push(DirEntry { name: e.file_name().to_string_lossy().into_owned(), kind, ino: e.ino() });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn create(&self, path: &str, mode: u32) -> Result<()> {
        // O_EXCL: an existing name — a planted link included — is an error, never followed.
        self.open_beneath(path, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, mode).map(|_| ())
    }

    fn mkdir(&self, path: &str, mode: u32) -> Result<()> {
        self.check_components(path)?;
        std::fs::DirBuilder::new().mode(mode).create(self.host(path)).map_err(|e| Error::io(path, e))
    }

    fn remove(&self, path: &str) -> Result<()> {
        self.check_components(path)?;
        std::fs::remove_file(self.host(path)).map_err(|e| Error::io(path, e))
    }

    fn rmdir(&self, path: &str) -> Result<()> {
        self.check_components(path)?;
        std::fs::remove_dir(self.host(path)).map_err(|e| Error::io(path, e))
    }

    fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.check_components(from)?;
        self.check_components(to)?;
        std::fs::rename(self.host(from), self.host(to)).map_err(|e| Error::io(from, e))
    }

    fn rename_with(&self, from: &str, to: &str, how: Rename) -> Result<()> {
        self.check_components(from)?;
        self.check_components(to)?;
        let flags = match how {
            Rename::Replace => rustix::fs::RenameFlags::empty(),
            Rename::NoReplace => rustix::fs::RenameFlags::NOREPLACE,
            Rename::Exchange => rustix::fs::RenameFlags::EXCHANGE,
        };
        rustix::fs::renameat_with(rustix::fs::CWD, self.host(from), rustix::fs::CWD, self.host(to), flags)
            .map_err(|e| Error::io(from, e.into()))
    }

    fn sync_dir(&self, path: &str) -> Result<()> {
        let d = self.open_beneath(path, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        d.sync_all().map_err(|e| Error::io(path, e))
    }

    fn symlink(&self, target: &str, path: &str) -> Result<()> {
        self.check_components(path)?;
        std::os::unix::fs::symlink(target, self.host(path)).map_err(|e| Error::io(path, e))
    }

    fn readlink(&self, path: &str) -> Result<String> {
        self.check_components(path)?;
        let t = std::fs::read_link(self.host(path)).map_err(|e| match e.raw_os_error() {
            Some(libc::EINVAL) => Error::Invalid(format!("{path}: not a symbolic link")),
            _ => Error::io(path, e),
        })?;
        t.into_os_string().into_string().map_err(|_| Error::Invalid(format!("{path}: link target is not UTF-8")))
    }

    fn link(&self, from: &str, to: &str) -> Result<()> {
        self.check_components(from)?;
        self.check_components(to)?;
        // linkat(2) without AT_SYMLINK_FOLLOW: a final link is linked, not followed.
        std::fs::hard_link(self.host(from), self.host(to)).map_err(|e| Error::io(to, e))
    }

    fn mknod(&self, path: &str, kind: Kind, mode: u32, rdev: u64) -> Result<()> {
        self.check_components(path)?;
        let ft = match kind {
            Kind::Fifo => rustix::fs::FileType::Fifo,
            Kind::Socket => rustix::fs::FileType::Socket,
            Kind::CharDevice => rustix::fs::FileType::CharacterDevice,
            Kind::BlockDevice => rustix::fs::FileType::BlockDevice,
            _ => return Err(Error::Invalid(format!("{path}: mknod makes special files only"))),
        };
        rustix::fs::mknodat(rustix::fs::CWD, self.host(path), ft, rustix::fs::Mode::from_bits_truncate(mode), rdev)
            .map_err(|e| Error::io(path, e.into()))
    }

    fn getxattr(&self, path: &str, name: &str) -> Result<Vec<u8>> {
        self.check_components(path)?;
        let p = self.host(path);
        // The value may grow between the size query and the read (ERANGE): ask again.
        loop {
            let n = rustix::fs::lgetxattr_query(&p, name).map_err(|e| Error::io(path, e.into()))?;
            let mut buf = vec![0u8; n];
            match rustix::fs::lgetxattr(&p, name, &mut buf[..]) {
                Ok(got) => {
                    buf.truncate(got);
                    return Ok(buf);
                }
                Err(rustix::io::Errno::RANGE) => continue,
                Err(e) => return Err(Error::io(path, e.into())),
            }
        }
    }

    fn setxattr(&self, path: &str, name: &str, value: &[u8], flags: i32) -> Result<()> {
        self.check_components(path)?;
        let f = rustix::fs::XattrFlags::from_bits_retain(flags as u32);
        rustix::fs::lsetxattr(self.host(path), name, value, f).map_err(|e| Error::io(path, e.into()))
    }

    fn listxattr(&self, path: &str) -> Result<Vec<String>> {
        self.check_components(path)?;
        let p = self.host(path);
        let (buf, n) = loop {
            let n = rustix::fs::llistxattr_query(&p).map_err(|e| Error::io(path, e.into()))?;
            let mut buf = vec![0u8; n];
            match rustix::fs::llistxattr(&p, &mut buf[..]) {
                Ok(got) => break (buf, got),
                Err(rustix::io::Errno::RANGE) => continue,
                Err(e) => return Err(Error::io(path, e.into())),
            }
        };
        Ok(buf[..n]
            .split(|&b| b == 0)
            .filter(|x| !x.is_empty())
            .map(|x| String::from_utf8_lossy(x).into_owned())
            .collect())
    }

    fn removexattr(&self, path: &str, name: &str) -> Result<()> {
        self.check_components(path)?;
        rustix::fs::lremovexattr(self.host(path), name).map_err(|e| Error::io(path, e.into()))
    }

    fn open(&self, path: &str, access: ubc::Access, _below: &dyn Below) -> Result<Opened> {
        let flags = if access == ubc::Access::ReadWrite { libc::O_RDWR } else { libc::O_RDONLY };
        let f = self.open_beneath(path, flags, 0)?;
        let pager = ubc::pager::FilePager::from_file(f, self.host(path), access).map_err(|e| Error::io(path, e))?;
        Ok(Opened::Store(Arc::new(pager)))
    }
}

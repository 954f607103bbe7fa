//! The `Layer` trait: one stackable filing layer (the paper's vnode operations).
//!
//! A layer offers namespace operations and, per open file, a way to reach the file's data:
//!
//! * a *store* layer (dir, mem, a union's upper branch) owns the bytes: it gives a
//!   [`ubc::Pager`] and the file becomes a new coherence group (a new file token);
//! * a *simply-named* layer (null) changes nothing about the bytes: the file is the lower
//!   layer's file — same cache object, same domain (page sharing);
//! * a *general* layer (zstd, aead) renames the bytes: it gives a pager over the lower
//!   layer's file and a [`Translate`] for byte ranges, and the file gets a new domain in the
//!   lower file's group.
//!
//! Paths are `/`-separated and relative to the stack's root ("" or "/" is the root);
//! [`norm`] checks them. File names are the same in every layer (the aead layer keeps names
//! in the clear), which is what lets name-cache invalidations be broadcast by path.

pub mod dir;
pub mod general;
#[cfg(feature = "testing")]
pub mod inject;
pub mod mem;
pub mod null;
#[cfg(feature = "s3")]
pub mod s3;
pub(crate) mod tree;
pub mod union;

use crate::coherence::Translate;
use crate::error::{Error, Result};
use std::sync::Arc;
use std::time::SystemTime;

/// What kind of object a name refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    File,
    Dir,
    Symlink,
    /// A named pipe: the kernel serves its opens, the store keeps only the name.
    Fifo,
    /// A socket's name (`bind(2)` on a path).
    Socket,
    CharDevice,
    BlockDevice,
}

impl Kind {
    /// The `S_IFMT` bits of this kind.
    pub fn mode_bits(self) -> u32 {
        match self {
            Kind::File => libc::S_IFREG,
            Kind::Dir => libc::S_IFDIR,
            Kind::Symlink => libc::S_IFLNK,
            Kind::Fifo => libc::S_IFIFO,
            Kind::Socket => libc::S_IFSOCK,
            Kind::CharDevice => libc::S_IFCHR,
            Kind::BlockDevice => libc::S_IFBLK,
        }
    }

    /// The kind named by the `S_IFMT` bits of `mode`, if any.
    pub fn of_mode(mode: u32) -> Option<Kind> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG => Kind::File,
            libc::S_IFDIR => Kind::Dir,
            libc::S_IFLNK => Kind::Symlink,
            libc::S_IFIFO => Kind::Fifo,
            libc::S_IFSOCK => Kind::Socket,
            libc::S_IFCHR => Kind::CharDevice,
            libc::S_IFBLK => Kind::BlockDevice,
            _ => return None,
        })
    }
}

/// How [`Layer::rename_with`] treats an existing `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rename {
    /// Replace it (`rename(2)`).
    Replace,
    /// Fail with [`Error::Exists`] (`RENAME_NOREPLACE`).
    NoReplace,
    /// Swap the two names; both must exist (`RENAME_EXCHANGE`).
    Exchange,
}

/// File attributes. Grouped as the paper's cache manager groups them: `kind` and `ino`
/// never change; `mode`, owner and links sometimes; `size` and the times often.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Attr {
    pub kind: Kind,
    /// The store's number for the file, stable for its life (the host's inode number on
    /// `dir`); unique within one store.
    pub ino: u64,
    /// Permission bits with set-user-ID, set-group-ID and sticky (`0o7777`).
    pub mode: u32,
    pub size: u64,
    pub mtime: SystemTime,
    pub atime: SystemTime,
    /// Last change of the data or of any attribute.
    pub ctime: SystemTime,
    pub uid: u32,
    pub gid: u32,
    /// Names of the file (for a directory: 2 plus its subdirectories, as on the host).
    pub nlink: u32,
    /// 512-byte blocks the store allocated for the file. Above a general layer these are the
    /// stored (compressed, encrypted) bytes' blocks: what the file costs on the device.
    pub blocks: u64,
    /// The device a device node stands for (0 for other kinds).
    pub rdev: u64,
    /// Which store `ino` is unique in (the host's device number on `dir`): a union shows
    /// files of two stores, whose inode numbers may collide.
    pub dev: u64,
}

impl Attr {
    /// The attributes of a new object of `kind`, numbered `ino` in store `dev`: owned by
    /// this process's user and group, one link (two for a directory), times now. For
    /// layers outside this crate, which set the rest by field.
    pub fn new(kind: Kind, dev: u64, ino: u64, mode: u32, size: u64) -> Attr {
        let now = SystemTime::now();
        // SAFETY: geteuid and getegid take no arguments and always succeed.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let nlink = if kind == Kind::Dir { 2 } else { 1 };
        Attr {
            kind,
            ino,
            mode,
            size,
            mtime: now,
            atime: now,
            ctime: now,
            uid,
            gid,
            nlink,
            blocks: size.div_ceil(512),
            rdev: 0,
            dev,
        }
    }
}

/// Changes for [`Layer::setattr`]; `None` leaves a field alone. Built as
/// `SetAttr::new().with_mode(0o600)` (fields may be added).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct SetAttr {
    pub size: Option<u64>,
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mtime: Option<SystemTime>,
    pub atime: Option<SystemTime>,
}

impl SetAttr {
    /// No change.
    pub fn new() -> SetAttr {
        SetAttr::default()
    }
    pub fn with_size(mut self, size: u64) -> SetAttr {
        self.size = Some(size);
        self
    }
    pub fn with_mode(mut self, mode: u32) -> SetAttr {
        self.mode = Some(mode);
        self
    }
    /// Owner and group; `None` leaves either alone.
    pub fn with_owner(mut self, uid: Option<u32>, gid: Option<u32>) -> SetAttr {
        (self.uid, self.gid) = (uid, gid);
        self
    }
    pub fn with_mtime(mut self, t: SystemTime) -> SetAttr {
        self.mtime = Some(t);
        self
    }
    pub fn with_atime(mut self, t: SystemTime) -> SetAttr {
        self.atime = Some(t);
        self
    }

    /// Apply the changes besides the size to a node's fields (mode masked to `0o7777`);
    /// the caller sets the ctime.
    pub(crate) fn apply(
        &self,
        mode: &mut u32,
        uid: &mut u32,
        gid: &mut u32,
        mtime: &mut SystemTime,
        atime: &mut SystemTime,
    ) {
        if let Some(m) = self.mode {
            *mode = m & 0o7777;
        }
        if let Some(u) = self.uid {
            *uid = u;
        }
        if let Some(g) = self.gid {
            *gid = g;
        }
        if let Some(t) = self.mtime {
            *mtime = t;
        }
        if let Some(t) = self.atime {
            *atime = t;
        }
    }

    /// Whether anything besides the size is to change.
    pub fn changes_metadata(&self) -> bool {
        self.mode.is_some() || self.uid.is_some() || self.gid.is_some() || self.mtime.is_some() || self.atime.is_some()
    }
}

/// One directory entry.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DirEntry {
    pub name: String,
    pub kind: Kind,
    /// The entry's [`Attr::ino`].
    pub ino: u64,
}

impl DirEntry {
    pub fn new(name: String, kind: Kind, ino: u64) -> DirEntry {
        DirEntry { name, kind, ino }
    }
}

/// What a layer gives for an open file.
#[non_exhaustive]
pub enum Opened {
    /// This layer stores the bytes (a new file token).
    Store(Arc<dyn ubc::Pager>),
    /// This layer stores the bytes and other machines share them (issue 21: `s3` with
    /// `etcd=`): the stack pins `remote`, the file's token between machines, around every
    /// operation on the file and attaches the file's caches to it. Given with the pager by
    /// the one lookup of the open, so that both name the same file (a rename elsewhere
    /// between two lookups could not split them) and an open costs one round trip.
    Shared { pager: Arc<dyn ubc::Pager>, remote: Arc<dyn crate::coherence::Remote> },
    /// The file is the lower layer's file (simply named).
    Lower,
    /// The file is the lower layer's file under another naming of its bytes: the stack
    /// opens the lower file and calls [`Layer::wrap`].
    Wrap,
}

/// How a layer's open reaches the layer below (given by the stack).
pub trait Below {
    /// Open `path` in the layer below; the handle is writable if `writable`.
    fn open_lower(&self, path: &str, access: ubc::Access) -> Result<ubc::File>;
}

/// A stackable layer.
///
/// Namespace operations forward to `lower()` by default, so a layer overrides only what it
/// changes. Implementations must be thread-safe.
pub trait Layer: Send + Sync {
    /// Spec form of this layer (`"dir:/data"`, `"zstd:level=3"`).
    fn spec(&self) -> String;

    /// The layer this one is stacked on (`None` for a bottom layer).
    fn lower(&self) -> Option<&Arc<dyn Layer>>;

    /// Whether [`Layer::open`] answers [`Opened::Wrap`] (the file size seen here differs
    /// from the lower layer's and is taken from the opened file).
    fn is_general(&self) -> bool {
        false
    }

    fn getattr(&self, path: &str) -> Result<Attr> {
        self.below()?.getattr(path)
    }
    fn setattr(&self, path: &str, set: &SetAttr) -> Result<()> {
        self.below()?.setattr(path, set)
    }
    fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.below()?.readdir(path)
    }
    fn create(&self, path: &str, mode: u32) -> Result<()> {
        self.below()?.create(path, mode)
    }
    fn mkdir(&self, path: &str, mode: u32) -> Result<()> {
        self.below()?.mkdir(path, mode)
    }
    fn remove(&self, path: &str) -> Result<()> {
        self.below()?.remove(path)
    }
    fn rmdir(&self, path: &str) -> Result<()> {
        self.below()?.rmdir(path)
    }
    fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.below()?.rename(from, to)
    }
    /// [`Layer::rename`] with `renameat2(2)`'s modes: fail if `to` exists, or swap the two
    /// names, in one step of the store. Layers above pass it down.
    fn rename_with(&self, from: &str, to: &str, how: Rename) -> Result<()> {
        match self.lower() {
            Some(l) => l.rename_with(from, to, how),
            None if how == Rename::Replace => self.rename(from, to),
            None => Err(Error::NotSupported(format!("{to}: renaming with {how:?}"))),
        }
    }
    /// Make the entries of directory `path` durable (`fsync` of a directory: creates,
    /// removes and renames in it survive a crash).
    fn sync_dir(&self, path: &str) -> Result<()> {
        self.below()?.sync_dir(path)
    }
    /// Make everything this layer keeps of its own durable, beyond the files' pagers (which
    /// `Cache::sync_all` syncs): a store that batches its names and attributes (`s3`
    /// commits its tree). Called by [`crate::Stack::sync_all`] for every layer, bottom
    /// first. Default: nothing.
    fn sync_all(&self) -> Result<()> {
        Ok(())
    }
    /// Make `path` a symbolic link to `target` (kept as given; never followed by a layer).
    fn symlink(&self, target: &str, path: &str) -> Result<()> {
        self.below()?.symlink(target, path)
    }
    /// The target of the symbolic link `path`.
    fn readlink(&self, path: &str) -> Result<String> {
        self.below()?.readlink(path)
    }
    /// Give the file `from` a second name `to` (a hard link: one file, its data shared).
    fn link(&self, from: &str, to: &str) -> Result<()> {
        self.below()?.link(from, to)
    }
    /// Make a special file (`Fifo`, `Socket`, `CharDevice`, `BlockDevice`) at `path`.
    fn mknod(&self, path: &str, kind: Kind, mode: u32, rdev: u64) -> Result<()> {
        self.below()?.mknod(path, kind, mode, rdev)
    }
    /// The value of extended attribute `name` of `path`.
    fn getxattr(&self, path: &str, name: &str) -> Result<Vec<u8>> {
        self.below()?.getxattr(path, name)
    }
    /// Set extended attribute `name` (`flags`: `XATTR_CREATE`/`XATTR_REPLACE` as setxattr(2)).
    fn setxattr(&self, path: &str, name: &str, value: &[u8], flags: i32) -> Result<()> {
        self.below()?.setxattr(path, name, value, flags)
    }
    /// The names of `path`'s extended attributes.
    fn listxattr(&self, path: &str) -> Result<Vec<String>> {
        self.below()?.listxattr(path)
    }
    fn removexattr(&self, path: &str, name: &str) -> Result<()> {
        self.below()?.removexattr(path, name)
    }

    /// Open the data of regular file `path`. => the file exists (the stack checked).
    fn open(&self, path: &str, access: ubc::Access, below: &dyn Below) -> Result<Opened>;

    /// Whether other machines use this store at once (`s3` with `etcd=`): their changes
    /// reach this machine's cache through the files' tokens, but no other cache of this
    /// machine (a kernel's, in front of a mount) hears of them. A layer above answers for
    /// the store below it (the default).
    fn is_shared(&self) -> bool {
        self.lower().is_some_and(|l| l.is_shared())
    }

    /// The identity of the cached file `a` describes (the one its pager gives, see
    /// [`ubc::Pager::identity`]), for a bottom layer whose names another party changes
    /// (`s3` with `etcd=`: another machine): the stack then checks that a name it cached
    /// still names that file. `None`: the stack's own name caches are the truth.
    fn file_identity(&self, a: &Attr) -> Option<ubc::Identity> {
        let _ = a;
        None
    }

    /// The (device, inode number) this layer's attributes give the file whose pager's
    /// identity is `id`, if this layer's files have such identities (the inverse of
    /// [`Layer::file_identity`]): what tells a mount's kernel which of its nodes changed.
    fn attr_key(&self, id: &ubc::Identity) -> Option<(u64, u64)> {
        let _ = id;
        None
    }

    /// The host directory whose files *are* this layer's files, byte for byte (`dir`);
    /// `None` for every other layer. A file's attributes then name its host file.
    fn host_root(&self) -> Option<&std::path::Path> {
        None
    }

    /// The host file that holds `path`'s bytes as they are, opened with open(2) `flags`
    /// (`mode` for `O_CREAT`), for a layer whose files *are* host files (`dir`); `None`
    /// for every other layer. Used to hand a file to the kernel itself (FUSE passthrough):
    /// what is done through it bypasses the cache, see [`crate::LayerRef::open_host`].
    fn host_file(&self, path: &str, flags: i32, mode: u32) -> Option<Result<std::fs::File>> {
        let _ = (path, flags, mode);
        None
    }

    /// A general layer's pager over the lower layer's file (opened writable when the
    /// lower store allows it), and how ranges translate between the two namings. `path`
    /// names the file in errors. A pager that fails on bytes read while a write changes
    /// them (it authenticates or decodes them) reads through `writes`
    /// ([`LowerWrites::settled`](crate::coherence::LowerWrites::settled)).
    fn wrap(
        &self,
        path: &str,
        lower: ubc::File,
        writes: &Arc<crate::coherence::LowerWrites>,
    ) -> Result<(Arc<dyn ubc::Pager>, Arc<dyn Translate>)> {
        let _ = (path, lower, writes);
        Err(Error::Invalid(format!("layer {} does not wrap files", self.spec())))
    }

    /// The lower layer or an error for a bottom layer that forgot to override.
    fn below(&self) -> Result<&Arc<dyn Layer>> {
        self.lower().ok_or_else(|| Error::Invalid(format!("layer {} has no lower layer", self.spec())))
    }
}

/// Longest stack path in bytes (Linux `PATH_MAX` less its NUL) and longest name (`NAME_MAX`).
pub const PATH_MAX: usize = 4095;
pub const NAME_MAX: usize = 255;

/// Check and normalize a stack path: no `..`, no NUL, no empty or `.` components, names of
/// at most [`NAME_MAX`] bytes and paths of at most [`PATH_MAX`] (the host's limits for
/// every layer, so that no layer walks a path of unbounded depth); returns it without
/// leading/trailing slashes ("" is the root).
pub fn norm(path: &str) -> Result<String> {
    if path.len() > PATH_MAX {
        return Err(Error::NameTooLong(format!("path of {} bytes: longer than {PATH_MAX}", path.len())));
    }
    let mut out = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => continue,
            ".." => return Err(Error::Invalid(format!("{path}: `..` is not allowed in stack paths"))),
            c if c.contains('\0') => return Err(Error::Invalid(format!("{path:?}: NUL in path"))),
            c if c.len() > NAME_MAX => {
                return Err(Error::NameTooLong(format!("{path}: a name longer than {NAME_MAX} bytes")));
            }
            c => out.push(c),
        }
    }
    Ok(out.join("/"))
}

/// Parent directory of a normalized path ("" for top-level names).
pub(crate) fn parent(path: &str) -> &str {
    path.rfind('/').map_or("", |i| &path[..i])
}

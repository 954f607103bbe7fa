//! File metadata between the stack and FUSE: the stack's attributes as FUSE's, and the
//! times FUSE asks to set as the stack's.

use fuser::{FileAttr, FileType, INodeNo, TimeOrNow};
use std::time::SystemTime;
use ubc_stack::{Attr, Kind};

/// Who every file of the mounts appears to belong to: the stack keeps no owners.
#[derive(Clone, Copy)]
pub(super) struct Owner {
    uid: u32,
    gid: u32,
}

impl Owner {
    /// The effective user and group of this process.
    pub(super) fn of_process() -> Owner {
        // SAFETY: geteuid and getegid take no arguments, touch no memory of ours and
        // always succeed.
        unsafe { Owner { uid: libc::geteuid(), gid: libc::getegid() } }
    }
}

/// `a`, the attributes of the file numbered `ino`, as FUSE's.
pub(super) fn file_attr(ino: u64, a: &Attr, owner: Owner) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.atime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind: file_type(a.kind),
        perm: (a.mode & 0o7777) as u16,
        nlink: if a.kind == Kind::Dir { 2 } else { 1 },
        uid: owner.uid,
        gid: owner.gid,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

/// The attributes of a file reached through an open handle only (its name may be gone): the
/// size is the file's, the mode a regular file's default and the times are now.
pub(super) fn open_file_attr(ino: u64, size: u64) -> Attr {
    let now = SystemTime::now();
    Attr { kind: Kind::File, ino, mode: 0o644, size, mtime: now, atime: now }
}

pub(super) fn file_type(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
    }
}

pub(super) fn time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

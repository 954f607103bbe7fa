//! File metadata between the stack and FUSE: the stack's attributes as FUSE's, and the
//! times FUSE asks to set as the stack's.

use fuser::{FileAttr, FileType, INodeNo, TimeOrNow};
use std::time::SystemTime;
use ubc_stack::{Attr, Kind};

/// `a`, the attributes of the file numbered `ino`, as FUSE's.
pub(super) fn file_attr(ino: u64, a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: a.size,
        blocks: a.blocks,
        atime: a.atime,
        mtime: a.mtime,
        ctime: a.ctime,
        crtime: a.ctime,
        kind: file_type(a.kind),
        perm: (a.mode & 0o7777) as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev as u32,
        blksize: 4096,
        flags: 0,
    }
}

/// The attributes of a negative entry (a name that does not exist): node 0, which the
/// kernel caches as "no such name"; it reads nothing else of them.
pub(super) fn negative() -> FileAttr {
    let t = SystemTime::UNIX_EPOCH;
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: t,
        mtime: t,
        ctime: t,
        crtime: t,
        kind: FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

/// The attributes of a file reached through an open handle only, its name gone: the size
/// is the file's, no name links to it, the rest is what the handle last saw.
pub(super) fn unlinked_file_attr(last: &Attr, size: u64) -> Attr {
    let mut a = last.clone();
    (a.size, a.nlink) = (size, 0);
    a
}

pub(super) fn file_type(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::CharDevice => FileType::CharDevice,
        Kind::BlockDevice => FileType::BlockDevice,
        // A kind this mount does not know yet: shown as a regular file.
        _ => FileType::RegularFile,
    }
}

pub(super) fn time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

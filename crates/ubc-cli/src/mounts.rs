//! This process's mount table, `/proc/self/mountinfo`: `ubc mount` finds its own mounts in
//! it and notices when they leave it; the soak driver and the tests wait for mounts to
//! appear in it and lazily unmount what they left.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const MOUNTINFO: &str = "/proc/self/mountinfo";

/// One line of the mount table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    /// Unique among the mounts present; a number may be reused once its mount is gone.
    pub id: u64,
    /// The device's minor number: for FUSE, the connection (/sys/fs/fuse/connections/N).
    pub minor: u32,
    /// Where it is mounted (canonical, unescaped).
    pub point: PathBuf,
    /// The file system type, e.g. "fuse" or "fuse.ubc".
    pub fstype: String,
    /// The mount source, e.g. "ubc".
    pub source: String,
}

impl Mount {
    /// One of `ubc mount`'s: mounted directly the type is "fuse", through fusermount3
    /// "fuse.ubc"; the source is "ubc" either way.
    pub fn is_ubc(&self) -> bool {
        self.source == "ubc" && (self.fstype == "fuse" || self.fstype == "fuse.ubc")
    }
}

/// The mount table now; empty if it cannot be read.
pub fn table() -> Vec<Mount> {
    parse(&std::fs::read_to_string(MOUNTINFO).unwrap_or_default())
}

/// Whether anything is mounted at `point` (canonicalized first where it can be: the table
/// holds canonical paths).
pub fn is_mounted(point: &Path) -> bool {
    let point = point.canonicalize().unwrap_or_else(|_| point.to_path_buf());
    table().iter().any(|m| m.point == point)
}

/// The ids of `ubc mount`'s mounts at `point`, which must be canonical.
pub fn ubc_ids(point: &Path) -> Vec<u64> {
    table().into_iter().filter(|m| m.is_ubc() && m.point == point).map(|m| m.id).collect()
}

/// The mount points at or below `dir` (canonicalized first where it can be).
pub fn under(dir: &Path) -> Vec<PathBuf> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    table().into_iter().map(|m| m.point).filter(|p| p.starts_with(&dir)).collect()
}

/// Waits for changes of the mount table.
pub struct Watch(Option<std::fs::File>);

impl Watch {
    pub fn new() -> Watch {
        Watch(std::fs::File::open(MOUNTINFO).ok())
    }

    /// Return once the table has changed since the previous call (since `new` at the
    /// first), or when `timeout` has passed, whichever comes first; only the latter if the
    /// table could not be opened.
    pub fn wait(&self, timeout: Duration) {
        let Some(f) = &self.0 else {
            std::thread::sleep(timeout);
            return;
        };
        use std::os::fd::AsRawFd;
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        let mut p = libc::pollfd { fd: f.as_raw_fd(), events: libc::POLLPRI, revents: 0 };
        // SAFETY: `p` is one valid pollfd, exclusively borrowed for the call (nfds = 1), and
        // its descriptor stays open meanwhile (`f` is borrowed from self).
        unsafe { libc::poll(&mut p, 1, ms) };
    }
}

impl Default for Watch {
    fn default() -> Watch {
        Watch::new()
    }
}

/// Mountinfo lines: `ID PARENT MAJOR:MINOR ROOT POINT OPTIONS [OPTIONAL...] - TYPE SOURCE
/// SUPER_OPTIONS`; lines that do not parse are left out.
fn parse(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let id = f.first()?.parse().ok()?;
            let sep = f.iter().position(|x| *x == "-")?;
            let minor = f.get(2)?.split_once(':')?.1.parse().ok()?;
            Some(Mount {
                id,
                minor,
                point: PathBuf::from(OsString::from_vec(unescape(f.get(4)?))),
                fstype: f.get(sep + 1)?.to_string(),
                source: String::from_utf8_lossy(&unescape(f.get(sep + 2)?)).into_owned(),
            })
        })
        .collect()
}

/// Mountinfo escapes space, tab, newline and backslash as a backslash and three octal
/// digits.
fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = u32::from(b[i + 1] - b'0') * 64 + u32::from(b[i + 2] - b'0') * 8 + u32::from(b[i + 3] - b'0');
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(unescape(r"/tmp/a\040b\011c\134d\012"), b"/tmp/a b\tc\\d\n");
        assert_eq!(unescape(r"/x\04"), br"/x\04");
        assert_eq!(unescape(r"/x\999"), br"/x\999");
    }

    #[test]
    fn mountinfo_lines_parse() {
        let text = "36 35 98:0 /mnt1 /mnt/a\\040b rw,noatime master:1 - fuse.ubc ubc rw,user_id=0\n\
                    37 1 0:58 / /proc rw - proc proc rw\n\
                    not a mount line\n";
        let t = parse(text);
        assert_eq!(t.len(), 2);
        assert_eq!(
            t[0],
            Mount { id: 36, minor: 0, point: "/mnt/a b".into(), fstype: "fuse.ubc".into(), source: "ubc".into() }
        );
        assert!(t[0].is_ubc() && !t[1].is_ubc());
        assert_eq!((t[1].id, t[1].minor, t[1].point.as_path()), (37, 58, Path::new("/proc")));
    }
}

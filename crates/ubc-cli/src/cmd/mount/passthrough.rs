//! FUSE passthrough: the kernel reads, writes and maps the host file itself (Linux 6.9+,
//! `FUSE_PASSTHROUGH`), with no request to the daemon and one copy of the data — the host's
//! own page cache, with its large folios and read-ahead.
//!
//! Used by a mount that is the stack's only way in and serves the layer whose files *are*
//! the host's files (`dir`, `--at 0:…` alone): nothing else then reads or writes those
//! files through ubc, so ubc has nothing to keep coherent with and the kernel's view of
//! the host file is the file (design.md, "Passthrough"). Every regular file the mount opens
//! is passed through; the daemon still answers what the kernel does not pass on — names,
//! attributes, `fsync`, `fallocate`, `lseek(SEEK_DATA/HOLE)`, `copy_file_range` — on the
//! same host file, so the answers are the host's own. POSIX and BSD locks stay in the
//! kernel (one mount: its local lock table sees every locker), and a close has nothing to
//! write back: the first FLUSH is answered ENOSYS, after which the kernel sends none.
//!
//! The kernel wants one backing file per inode while the inode is open (a second open with
//! another gives EBUSY or EIO), so the backing ids are shared per inode ([`Backings`]) and
//! closed with the last open handle.
//!
//! If the kernel ever refuses a backing file (the privilege check passed but the ioctl
//! failed: a container's capabilities, a file table full), passthrough ends for the mount:
//! from then on an inode open through passthrough keeps it (the kernel wants every open of
//! it passed through) and every other open is served by the stack, so no file is ever
//! written by the kernel behind a cache that holds it. `UBC_MOUNT_REFUSE_BACKING=1` makes
//! the daemon refuse them itself (fault injection for the tests).

use fuser::BackingId;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, Weak};

/// Whether this process may register backing files (`FUSE_DEV_IOC_BACKING_OPEN` wants
/// `CAP_SYS_ADMIN` in the initial user namespace): effective capability 21 in
/// /proc/self/status, and no user namespace of its own (the uid map is the identity).
pub(super) fn may_pass_through() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_SYS_ADMIN) != 0);
    let init_ns = std::fs::read_to_string("/proc/self/uid_map")
        .map(|m| m.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"])
        .unwrap_or(false);
    cap && init_ns
}

/// The kind of stacking file system `dir` is on (FUSE, overlayfs, eCryptfs), if it is on
/// one: a backing file there would make this mount a second level of stacking, which
/// `max_stack_depth` 1 refuses (and a FUSE store below is better served by ubc's own cache).
pub(super) fn stacked_fs(dir: &std::path::Path) -> Option<&'static str> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: a zeroed statfs is a valid out-parameter; `c` is a NUL-terminated path.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    match st.f_type as i64 {
        0x6573_5546 => Some("FUSE"),
        0x794c_7630 => Some("overlayfs"),
        0xf15f => Some("eCryptfs"),
        _ => None,
    }
}

/// One open, passed through: the daemon's own descriptor of the host file (for the calls
/// still sent here) and the kernel's backing id for its inode.
pub(super) struct Passed {
    pub(super) host: std::fs::File,
    /// Held while the handle is open: the id is closed when the inode's last handle goes.
    backing: Arc<BackingId>,
    /// The path it was opened by, for error messages.
    path: String,
}

/// The backing id of every inode open through passthrough.
pub(super) struct Backings {
    by_ino: Mutex<HashMap<u64, Weak<BackingId>>>,
    /// The kernel refused a backing file once: no new ones (see the module docs).
    refused: std::sync::atomic::AtomicBool,
    /// Refuse every new backing file (`UBC_MOUNT_REFUSE_BACKING`, fault injection).
    inject_refusal: bool,
}

impl Backings {
    pub(super) fn new() -> Backings {
        Backings {
            by_ino: Mutex::default(),
            refused: Default::default(),
            inject_refusal: std::env::var_os("UBC_MOUNT_REFUSE_BACKING").is_some_and(|v| v == "1"),
        }
    }

    /// A passed-through open of inode `ino` on `host`: the inode's backing id if it has
    /// one, else a new one registered with `register` (the reply's `open_backing`); `None`
    /// if the open must be served by the stack instead (a backing file was refused, now or
    /// before, and the inode has none).
    pub(super) fn pass(
        &self,
        ino: u64,
        host: std::fs::File,
        path: &str,
        register: impl FnOnce(&std::fs::File) -> std::io::Result<BackingId>,
    ) -> Option<Passed> {
        use std::sync::atomic::Ordering::SeqCst;
        let mut map = self.by_ino.lock().unwrap();
        let backing = match map.get(&ino).and_then(Weak::upgrade) {
            Some(b) => b,
            None if self.refused.load(SeqCst) => return None,
            None => {
                let r = if self.inject_refusal {
                    Err(std::io::Error::from_raw_os_error(libc::EPERM))
                } else {
                    register(&host)
                };
                let b = match r {
                    Ok(b) => Arc::new(b),
                    Err(e) => {
                        self.refused.store(true, SeqCst);
                        eprintln!(
                            "ubc mount: {path}: the kernel refused a backing file ({e}): files not open now are served by ubc from here on"
                        );
                        return None;
                    }
                };
                map.insert(ino, Arc::downgrade(&b));
                b
            }
        };
        Some(Passed { host, backing, path: path.to_string() })
    }
}

impl Backings {
    /// A handle of inode `ino` was released: forget the inode if it has no open handle left
    /// (its backing id was closed with the last one).
    pub(super) fn released(&self, ino: u64) {
        let mut map = self.by_ino.lock().unwrap();
        if map.get(&ino).is_some_and(|w| w.strong_count() == 0) {
            map.remove(&ino);
        }
    }
}

/// `Ok(v)` for a non-negative syscall result, else the thread's errno as an error.
fn check(r: libc::c_long, path: &str) -> ubc_stack::Result<u64> {
    if r < 0 { Err(ubc_stack::Error::io(path, std::io::Error::last_os_error())) } else { Ok(r as u64) }
}

impl Passed {
    fn fd(&self) -> i32 {
        self.host.as_raw_fd()
    }

    fn err(&self, e: std::io::Error) -> ubc_stack::Error {
        ubc_stack::Error::io(&self.path, e)
    }

    /// The inode's backing id.
    pub(super) fn backing(&self) -> Arc<BackingId> {
        self.backing.clone()
    }

    /// The host file's attributes now.
    pub(super) fn attr(&self) -> ubc_stack::Result<ubc_stack::Attr> {
        ubc_stack::LayerRef::host_attr(&self.host)
    }

    /// `fsync(2)` of the host file.
    pub(super) fn sync(&self) -> ubc_stack::Result<()> {
        self.host.sync_all().map_err(|e| self.err(e))
    }

    pub(super) fn set_len(&self, len: u64) -> ubc_stack::Result<()> {
        self.host.set_len(len).map_err(|e| self.err(e))
    }

    /// `fallocate(2)` with the caller's mode: the host's own semantics and errors.
    pub(super) fn fallocate(&self, mode: i32, offset: u64, len: u64) -> ubc_stack::Result<()> {
        // SAFETY: a plain syscall on a descriptor we own.
        let r = unsafe { libc::fallocate(self.fd(), mode, offset as libc::off_t, len as libc::off_t) };
        check(r as libc::c_long, &self.path).map(|_| ())
    }

    /// `lseek(2)` (`SEEK_DATA`, `SEEK_HOLE`): the new offset.
    pub(super) fn seek(&self, offset: i64, whence: i32) -> ubc_stack::Result<u64> {
        // SAFETY: as above; lseek on our own descriptor moves only its offset, which no
        // other call here uses (they are all positional).
        let r = unsafe { libc::lseek(self.fd(), offset as libc::off_t, whence) };
        check(r as libc::c_long, &self.path)
    }

    /// `copy_file_range(2)` of up to `len` bytes from `self` at `from` to `dst` at `to`,
    /// looping until `len` or the end of the source: the host may clone extents.
    pub(super) fn copy_to(&self, from: u64, dst: &Passed, to: u64, len: u64) -> ubc_stack::Result<u64> {
        let mut done = 0u64;
        while done < len {
            let (mut off_in, mut off_out) = ((from + done) as libc::loff_t, (to + done) as libc::loff_t);
            let want = (len - done).min(1 << 30) as usize;
            // SAFETY: both descriptors are ours; the offsets are passed by pointer and only
            // updated by the kernel.
            let r = unsafe { libc::copy_file_range(self.fd(), &mut off_in, dst.fd(), &mut off_out, want, 0) };
            let n = check(r as libc::c_long, &self.path)?;
            if n == 0 {
                break;
            }
            done += n;
        }
        Ok(done)
    }
}

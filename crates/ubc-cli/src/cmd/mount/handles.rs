//! The handle table of one mount: FUSE file handle numbers ↔ open files of the layer.

use super::passthrough::Passed;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

/// The thread that opened a file, and its process.
#[derive(Clone, Copy, Debug)]
pub(super) struct Opener {
    tid: u32,
    pid: u32,
}

impl Opener {
    /// The opener behind a request from thread `tid`.
    pub(super) fn of(tid: u32) -> Opener {
        Opener { tid, pid: process_of(tid) }
    }

    /// The opener behind a request from thread `tid`, its process not looked up (taken to
    /// be `tid`): for an open whose close has nothing to write back.
    pub(super) fn unasked(tid: u32) -> Opener {
        Opener { tid, pid: tid }
    }

    /// Whether a request from thread `tid` comes from the opening process. The opening
    /// thread itself is answered without asking /proc (a reused thread id could only
    /// make a close write back that need not: harmless).
    pub(super) fn is(&self, tid: u32) -> bool {
        tid == self.tid || process_of(tid) == self.pid
    }
}

/// The process of thread `tid` (FUSE requests carry the thread's id, not the process's):
/// `tid` itself if it leads its thread group — `pidfd_open` without `PIDFD_THREAD` takes
/// only a group leader, one cheap call for the common single-threaded caller — else the
/// thread group id from /proc (read in one call: `Tgid:` is on the fourth line), or `tid`
/// if the thread is gone.
fn process_of(tid: u32) -> u32 {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, tid as libc::pid_t, 0u32) };
    if fd >= 0 {
        // SAFETY: the descriptor was just returned to us and is closed once.
        unsafe { libc::close(fd as i32) };
        return tid;
    }
    use std::io::Read;
    let mut buf = [0u8; 512];
    let n = std::fs::File::open(format!("/proc/{tid}/status")).and_then(|mut f| f.read(&mut buf)).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n])
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:").and_then(|v| v.trim().parse().ok()))
        .unwrap_or(tid)
}

/// What an open reads and writes through.
pub(super) enum Via {
    /// The stack's cache: reads and writes come to the daemon (or the kernel's page cache
    /// of the mount, kept coherent by `kernels`).
    Stack(ubc_stack::File),
    /// The host file itself, handed to the kernel (`passthrough`).
    Host(Passed),
}

/// One open of a file.
pub(super) struct Handle {
    pub(super) via: Via,
    /// Opened with O_APPEND: every write goes to the end of the file as the stack knows it.
    pub(super) append: bool,
    /// Who opened it: only the opening process's `close` writes back.
    pub(super) opener: Opener,
    /// The inode number the file was opened by (the kernel keeps using it after the name
    /// is removed).
    pub(super) ino: u64,
    /// The kernel caches this open's data (no `FOPEN_DIRECT_IO`): it copies writes through
    /// it into its page cache, so they need not invalidate it (`kernels`).
    pub(super) cached: bool,
    /// Opened for writing with the kernel's write-back cache: the kernel may hold bytes
    /// written through it that it sends later, through any writable handle of the file, so
    /// it counts as written until it is closed.
    kernel_writes: bool,
    /// Written (or resized) through this handle since its last successful sync.
    written: AtomicBool,
    /// The modification time the kernel's write-back cache sent with its write-back, not
    /// yet set on the store: set when the handle writes back or syncs (`take_mtime`).
    mtime: Mutex<Option<std::time::SystemTime>>,
    /// The file's attributes when last seen by name: what `fstat` shows (with the current
    /// size) once the name is gone.
    pub(super) last: Mutex<ubc_stack::Attr>,
}

impl Handle {
    /// Note a write or resize through this handle. Call it after the bytes are in (failed
    /// or not): a sync that cleared the mark while they went in may have missed them.
    pub(super) fn mark_written(&self) {
        self.written.store(true, SeqCst);
    }

    /// Keep `t`, the modification time the kernel sent for the bytes it wrote back
    /// through this handle, until the handle writes back or syncs.
    pub(super) fn defer_mtime(&self, t: std::time::SystemTime) {
        *self.mtime.lock().unwrap() = Some(t);
        self.last.lock().unwrap().mtime = t;
    }

    /// The deferred modification time, if any (taken: set it now).
    pub(super) fn take_mtime(&self) -> Option<std::time::SystemTime> {
        self.mtime.lock().unwrap().take()
    }

    /// Open for writing with the kernel's write-back cache (see the field).
    pub(super) fn kernel_writes(&self) -> bool {
        self.kernel_writes
    }

    /// Written (or resized) since the last successful sync.
    pub(super) fn written(&self) -> bool {
        self.kernel_writes || self.written.load(SeqCst)
    }

    /// The stack's file, unless the open is passed through to the host file.
    pub(super) fn file(&self) -> Option<&ubc_stack::File> {
        match &self.via {
            Via::Stack(f) => Some(f),
            Via::Host(_) => None,
        }
    }

    /// Write back what was written through this handle (`ubc_stack::File::write_back`: into
    /// the store, errors reported, not made durable) — what `close` does. Nothing for a
    /// handle never written, nor for one passed through (the kernel wrote the host file
    /// itself). The mark stays: the data is not synced.
    pub(super) fn write_back(&self) -> ubc_stack::Result<()> {
        match &self.via {
            Via::Stack(f) if self.written() => f.write_back(),
            _ => Ok(()),
        }
    }

    /// Sync the file. The mark is cleared first, so a write racing with the sync sets it
    /// again, and set again if the sync fails.
    pub(super) fn sync(&self) -> ubc_stack::Result<()> {
        self.written.store(false, SeqCst);
        let r = match &self.via {
            Via::Stack(f) => f.sync(),
            Via::Host(p) => p.sync(),
        };
        if r.is_err() {
            self.written.store(true, SeqCst);
        }
        r
    }

    /// After `sync` (`fdatasync`): the store's other metadata — the times set since — made
    /// durable too, as `fsync` promises. A passed-through file's `sync` is a full `fsync`
    /// already.
    pub(super) fn sync_metadata(&self) -> ubc_stack::Result<()> {
        match &self.via {
            Via::Stack(f) => f.sync_all(),
            Via::Host(_) => Ok(()),
        }
    }
}

/// Shards of the table: every read and write looks its handle up, from several request
/// threads at once, so the table is split by handle number rather than behind one lock.
const SHARDS: usize = 16;

pub(super) struct Handles {
    open: [Mutex<HashMap<u64, Arc<Handle>>>; SHARDS],
    /// The next handle number: numbers start at 1 and are never reused.
    next: AtomicU64,
}

impl Handles {
    pub(super) fn new() -> Handles {
        Handles { open: std::array::from_fn(|_| Mutex::new(HashMap::new())), next: AtomicU64::new(1) }
    }

    fn shard(&self, fh: u64) -> &Mutex<HashMap<u64, Arc<Handle>>> {
        &self.open[fh as usize % SHARDS]
    }

    /// Enter an open through `via` (inode `ino`, attributes `attr`) by `opener`, `cached`
    /// by the kernel or not, writes `kernel_writes` (see [`Handle`]); its handle number.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn add(
        &self,
        via: Via,
        ino: u64,
        append: bool,
        cached: bool,
        kernel_writes: bool,
        opener: Opener,
        attr: ubc_stack::Attr,
    ) -> u64 {
        let fh = self.next.fetch_add(1, Relaxed);
        let written = AtomicBool::new(false);
        let mtime = Mutex::new(None);
        let h = Handle { via, append, cached, kernel_writes, opener, ino, written, mtime, last: Mutex::new(attr) };
        self.shard(fh).lock().unwrap().insert(fh, Arc::new(h));
        fh
    }

    /// An open handle of inode `ino`, if any: a file removed while open has no path left,
    /// and the kernel asks for its attributes (`fstat`) by inode alone.
    pub(super) fn of_ino(&self, ino: u64) -> Option<Arc<Handle>> {
        self.of_ino_where(ino, |_| true)
    }

    /// An open handle of inode `ino` for which `f` holds, if any.
    pub(super) fn of_ino_where(&self, ino: u64, f: impl Fn(&Handle) -> bool) -> Option<Arc<Handle>> {
        self.open.iter().find_map(|s| s.lock().unwrap().values().find(|h| h.ino == ino && f(h)).cloned())
    }

    pub(super) fn get(&self, fh: u64) -> Option<Arc<Handle>> {
        self.shard(fh).lock().unwrap().get(&fh).cloned()
    }

    pub(super) fn remove(&self, fh: u64) -> Option<Arc<Handle>> {
        self.shard(fh).lock().unwrap().remove(&fh)
    }

    /// Every open handle now.
    pub(super) fn all(&self) -> Vec<Arc<Handle>> {
        self.open.iter().flat_map(|s| s.lock().unwrap().values().cloned().collect::<Vec<_>>()).collect()
    }
}

//! How the command ends (see the module above for the user's view): what ends it
//! (sessions that end, signals, mounts that leave the mount table), the final sync with its
//! deadline, the lazy unmount, and the exit status.

use super::gate::Gate;
use super::handles::{Handle, Handles};
use super::kernels::Kernels;
use crate::error::{EX_IOERR, Fail};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};
use ubc_cli::mounts;
use ubc_stack::Stack;

/// Exit status when the command gave up before everything was synced (a second signal, or
/// the sync deadline passed): sysexits' EX_TEMPFAIL.
const EX_TEMPFAIL: i32 = 75;

/// How long a `write(2)` into a kernel's write-back cache that checked the attributes (and
/// found them valid, or got them) may take to reach the file's lock and copy, as the
/// shutdown assumes: its thread is runnable from then on, and this covers being preempted
/// for a few scheduler slices on a loaded machine. One held off the CPU for longer still
/// escapes the last pull (the kernel gives no way to wait for a `write(2)` in progress on
/// a FUSE file: `FIFREEZE` is EOPNOTSUPP).
const WRITER_SETTLE: Duration = Duration::from_millis(100);

/// What the main thread waits for.
pub(super) enum Event {
    /// A mount's session ended (unmounted, or the connection was aborted).
    Ended(PathBuf, std::io::Result<()>),
    /// The first SIGINT/SIGTERM/SIGHUP.
    Signal(i32),
    /// None of the mounts is in the mount table any more (`umount -l`, `fusermount3 -u -z`)
    /// but sessions still run: some process holds files of a detached mount open.
    Detached,
}

/// What the shutdown works on, from the main thread or from the signal thread: the stack,
/// the gate, and every mount with its open handles and FUSE connection.
pub(super) struct Daemon {
    stack: Stack,
    pub(super) gate: Arc<Gate>,
    /// Set once when the shutdown starts (by a signal or because the mounts went away).
    stopping: AtomicBool,
    mounts: Mutex<Vec<Served>>,
    /// Every mount's kernel: the shutdown pulls the writes the write-back caches hold.
    kernels: Arc<Kernels>,
    /// The FUSE connections of the mounts (their device minors: /sys/fs/fuse/connections/N).
    connections: Mutex<Vec<u32>>,
    /// The host directory whose files a mount passes through to the kernel (`passthrough`):
    /// what was written to them is in the host's page cache, not in the stack's, and the
    /// shutdown syncs that file system too (`syncfs`).
    host_sync: Mutex<Option<PathBuf>>,
}

/// A mount: its point (as given, and canonical) and its open handles (for the report of
/// what was not synced).
struct Served {
    /// The mount's number (`kernels`).
    id: usize,
    point: PathBuf,
    canon: PathBuf,
    handles: Arc<Handles>,
}

impl Daemon {
    pub(super) fn new(stack: Stack, kernels: Arc<Kernels>) -> Daemon {
        Daemon {
            stack,
            kernels,
            gate: Arc::default(),
            stopping: AtomicBool::new(false),
            mounts: Mutex::default(),
            connections: Mutex::default(),
            host_sync: Mutex::default(),
        }
    }

    /// Sync the file system of host directory `dir` at the shutdown, after the stack.
    pub(super) fn sync_host(&self, dir: PathBuf) {
        *self.host_sync.lock().unwrap() = Some(dir);
    }

    /// A mount made at `point` (canonical: `canon`), its connection if it was found.
    pub(super) fn add_mount(
        &self,
        id: usize,
        point: PathBuf,
        canon: PathBuf,
        handles: Arc<Handles>,
        connection: Option<u32>,
    ) {
        if let Some(c) = connection {
            self.connections.lock().unwrap().push(c);
        }
        self.mounts.lock().unwrap().push(Served { id, point, canon, handles });
    }

    /// Per mount with any, what `of` gives for each file open for writing through its
    /// kernel's write-back cache (files the kernel may hold written bytes of), sorted and
    /// without repeats.
    fn kernel_written<T: Ord>(&self, of: impl Fn(&Handle) -> Option<T>) -> Vec<(usize, Vec<T>)> {
        self.mounts
            .lock()
            .unwrap()
            .iter()
            .map(|m| {
                let mut v: Vec<T> =
                    m.handles.all().iter().filter(|h| h.kernel_writes()).filter_map(|h| of(h)).collect();
                v.sort_unstable();
                v.dedup();
                (m.id, v)
            })
            .filter(|(_, v)| !v.is_empty())
            .collect()
    }

    /// Wait for the `write(2)`s into the kernels' write-back caches that the kernels let
    /// through before their attributes were made stale — by the pull just before — and
    /// that may still be copying: first `WRITER_SETTLE`, then for each file's lock
    /// ([`Kernels::wait_writers`]). False if `deadline` passed first. Nothing to wait for
    /// without a file open for writing through a write-back cache.
    fn wait_kernel_writers(self: &Arc<Self>, deadline: Instant) -> bool {
        let work = self.kernel_written(|h| h.file().map(|f| f.path().to_string()));
        if work.is_empty() {
            return true;
        }
        std::thread::sleep(WRITER_SETTLE.min(deadline.saturating_duration_since(Instant::now())));
        let d = self.clone();
        on_thread_until(deadline, move || {
            for (id, paths) in work {
                d.kernels.wait_writers(id, &paths);
            }
        })
    }

    /// Pull what the kernels' write-back caches hold written out of them, into the stack:
    /// every file open for writing through such a cache (a file the kernel may hold
    /// written bytes of: closing one writes them back). False if `deadline` passed first
    /// (the pull goes on in its thread).
    fn pull_kernel_writes(self: &Arc<Self>, deadline: Instant) -> bool {
        let work = self.kernel_written(|h| Some(h.ino));
        if work.is_empty() {
            return true;
        }
        let d = self.clone();
        on_thread_until(deadline, move || {
            for (id, inos) in work {
                d.kernels.pull_writes(id, &inos);
            }
        })
    }

    /// Open files written since their last sync, or with dirty pages: (mount path, dirty
    /// bytes at that layer — pages already being written back are not counted).
    fn dirty_files(&self) -> Vec<(PathBuf, u64)> {
        let mounts: Vec<(PathBuf, Arc<Handles>)> =
            self.mounts.lock().unwrap().iter().map(|m| (m.point.clone(), m.handles.clone())).collect();
        let mut out: Vec<(PathBuf, u64)> = Vec::new();
        for (mp, handles) in mounts {
            for h in handles.all() {
                // A passed-through file is the host's own: the host file system's sync covers it.
                let Some(f) = h.file() else { continue };
                let dirty = f.stats().dirty_bytes;
                let path = mp.join(f.path());
                if (dirty > 0 || h.written()) && !out.iter().any(|(p, _)| *p == path) {
                    out.push((path, dirty));
                }
            }
        }
        out.sort();
        out
    }

    /// Print what is not synced, unmount (lazily) every mount, and leave at once with
    /// EX_TEMPFAIL — each step bounded (one second each), since the stack may be stuck.
    fn give_up(self: &Arc<Self>, why: &str) -> ! {
        eprintln!("ubc: {why}: exiting without syncing everything");
        self.report_unsynced();
        let d = self.clone();
        on_thread_until(Instant::now() + Duration::from_secs(1), move || {
            // The kernels' attributes of files open for writing first (an attribute-only
            // notice waits for nothing): with the write-back cache a write(2) asks the daemon
            // only when they are stale, so without this one into a file whose attributes
            // were fresh would land in the page cache of a connection nobody serves, and
            // return success (measured: 35 GB accepted and lost after such an exit).
            d.stale_kernel_attrs();
            // Abort the connections: every request in flight ends (ECONNABORTED), every
            // process waiting on a mount gets ENOTCONN now, not when this process has
            // finished exiting — which can take as long as the stuck store (the exit closes
            // the store's files, and a FUSE store's close waits unkillably). And a thread of
            // ours inside the kernel waiting for the kernel's write-back (the pull's page
            // invalidation) is released: left waiting, it kept this process a zombie and the
            // connection alive for ever, since the write-back needs request threads, which
            // the exit ends (seen once in nine SIGTERMs during a 1 MiB write loop).
            // `umount2(MNT_FORCE)` aborts a FUSE connection before it tries to unmount (the
            // file system's `umount_begin`), without fusectl; the fusectl abort is for
            // mounts whose point is gone from this namespace.
            d.force_all();
            for c in d.connections.lock().unwrap().iter() {
                let _ = std::fs::write(format!("/sys/fs/fuse/connections/{c}/abort"), "1");
            }
            d.detach_all();
        });
        // Not `std::process::exit`: it runs exit handlers and flushes stdout, which can
        // wait on a lock that a thread stuck in the stack holds.
        // SAFETY: _exit has no preconditions; it ends the process without returning.
        unsafe { libc::_exit(EX_TEMPFAIL) }
    }

    /// Make every kernel's attributes of the files open for writing through its write-back
    /// cache stale (see `give_up`).
    fn stale_kernel_attrs(&self) {
        for (id, inos) in self.kernel_written(|h| Some(h.ino)) {
            for ino in inos {
                self.kernels.attrs_stale(id, ino);
            }
        }
    }

    /// `umount2(MNT_FORCE)` every mount (root only): FUSE aborts the connection first, and
    /// the unmount itself fails (EBUSY) while files are open — `detach_all` follows.
    fn force_all(&self) {
        // SAFETY: geteuid takes no arguments, touches no memory of ours and always succeeds.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let points: Vec<PathBuf> = self.mounts.lock().unwrap().iter().map(|m| m.canon.clone()).collect();
        for mp in points {
            if mounts::ubc_ids(&mp).is_empty() {
                continue;
            }
            if let Ok(c) = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes()) {
                // SAFETY: `c` is a NUL-terminated path that lives across the call, which only reads it.
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_FORCE) };
            }
        }
    }

    fn detach_all(&self) {
        let points: Vec<(PathBuf, PathBuf)> =
            self.mounts.lock().unwrap().iter().map(|m| (m.point.clone(), m.canon.clone())).collect();
        for (mp, canon) in points {
            if let Err(e) = detach(&canon) {
                eprintln!("ubc: {}: unmount: {e}", mp.display());
            }
        }
    }

    /// Print how much the cache holds unwritten and which open files were written since
    /// their last sync; bounded to one second, since the stack may be stuck.
    fn report_unsynced(self: &Arc<Self>) {
        let (tx, rx) = mpsc::channel();
        let d = self.clone();
        std::thread::spawn(move || {
            let _ = tx.send((d.stack.cache().stats().unclean_bytes, d.dirty_files()));
        });
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok((unclean, files)) => {
                eprintln!("ubc: not synced: {} in the cache (all layers)", mib(unclean));
                for (p, b) in files {
                    let dirty = if b > 0 { format!("; {} dirty", mib(b)) } else { String::new() };
                    eprintln!("ubc: not synced: {} (written since its last sync{dirty})", p.display());
                }
            }
            Err(_) => eprintln!("ubc: not synced: unknown (the cache did not answer within 1s)"),
        }
    }
}

/// The sessions still running, and the error the last failed one ended with: the
/// command's failure, unless the final sync fails after it.
pub(super) struct Sessions {
    events: mpsc::Receiver<Event>,
    live: usize,
    fail: Option<Fail>,
}

impl Sessions {
    pub(super) fn new(events: mpsc::Receiver<Event>, live: usize) -> Sessions {
        Sessions { events, live, fail: None }
    }

    /// Every session has ended.
    pub(super) fn all_ended(&self) -> bool {
        self.live == 0
    }

    /// The next event; None once nothing can send one any more.
    pub(super) fn next(&self) -> Option<Event> {
        self.events.recv().ok()
    }

    /// Note that the session of `mp` ended, with `r`.
    pub(super) fn ended(&mut self, mp: PathBuf, r: std::io::Result<()>) {
        if let Err(e) = r {
            self.fail = Some(Fail::new(EX_IOERR, mp.display().to_string(), crate::error::io_cause(&e)));
        }
        self.live -= 1;
    }

    /// Wait until every session has ended, or until `until`; other events are dropped.
    pub(super) fn wait_until(&mut self, until: Instant) {
        while self.live > 0 {
            match self.events.recv_timeout(until.saturating_duration_since(Instant::now())) {
                Ok(Event::Ended(mp, r)) => self.ended(mp, r),
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }

    /// How the command ends: Ok, or the last failure.
    pub(super) fn result(self) -> crate::error::Result<()> {
        self.fail.map_or(Ok(()), Err)
    }
}

/// Close the gate, sync the whole stack (`spec`) within `sync_timeout` seconds, and
/// unmount what is still mounted. `why` names what started the shutdown; None when every
/// session ended by itself, which makes it quiet. Past the deadline it gives up: the
/// process exits 75 here.
pub(super) fn finish(
    daemon: &Arc<Daemon>,
    why: Option<String>,
    sessions: &mut Sessions,
    sync_timeout: u64,
    spec: &str,
) {
    let loud = why.is_some();
    // From here on a signal (a second one, if one started this) exits at once.
    daemon.stopping.store(true, SeqCst);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(sync_timeout);
    if let Some(why) = &why {
        let u = daemon.stack.cache().stats().unclean_bytes;
        let files = daemon.dirty_files().len();
        eprintln!(
            "ubc: {why}: shutting down: writes now fail (EROFS); syncing {} ({files} open files written since their last sync); a second signal exits at once",
            mib(u)
        );
    }
    // The kernels' write-back caches hold writes that returned: pull them into the stack
    // before new changes are refused (the programs' closes then find nothing left to
    // write), and again after (what was written meanwhile; the kernel's write-back is
    // still admitted then), and only then seal the gate. A write into a kernel's cache
    // after that is refused when the kernel sends it: the program sees the error at its
    // fsync or close, as for any failed write-back.
    if !daemon.pull_kernel_writes(deadline) {
        daemon.give_up(&format!("{sync_timeout}s sync deadline passed (the kernel's write-back did not finish)"));
    }
    if !daemon.gate.close(deadline) {
        daemon.give_up(&format!("{sync_timeout}s sync deadline passed (a write did not finish)"));
    }
    // Twice: each pull also makes the kernels ask before each further write, which the
    // closed gate refuses. A write(2) that checked the attributes before the second pull
    // made them stale goes on without the daemon: it copies into the kernel's cache once
    // its thread runs, under the file's lock. So the last pull waits for those writers
    // first (`wait_kernel_writers`) and then takes what they left. Waiting for the file's
    // lock alone, `sigterm_with_a_writer_active_dir` lost the last write that returned Ok in
    // 2 of ~40 runs beside other tests (its record missing from the file); with the pause
    // before it, in none of 150.
    if !daemon.pull_kernel_writes(deadline)
        || !daemon.wait_kernel_writers(deadline)
        || !daemon.pull_kernel_writes(deadline)
        || !daemon.gate.seal(deadline)
    {
        daemon.give_up(&format!("{sync_timeout}s sync deadline passed (the kernel's write-back did not finish)"));
    }
    let host = daemon.host_sync.lock().unwrap().clone();
    match timed_sync(&daemon.stack, host, deadline, loud) {
        Sync::Done(Ok(())) => {
            if loud {
                eprintln!("ubc: synced in {:.1}s", start.elapsed().as_secs_f64());
            }
        }
        Sync::Done(Err(e)) => {
            daemon.report_unsynced();
            sessions.fail = Some(Fail::stack(crate::error::Side::Output, spec, e));
        }
        Sync::TimedOut => daemon.give_up(&format!("{sync_timeout}s sync deadline passed")),
    }
    if sessions.live > 0 {
        // Unmount every mount, also those with files open (a lazy unmount: the open files
        // fail with ENOTCONN once this process is gone).
        // Not fuser's unmount: a plain umount fails (EBUSY) with files open.
        daemon.detach_all();
        sessions.wait_until(Instant::now() + Duration::from_millis(500));
        if sessions.live > 0 {
            eprintln!(
                "ubc: {} mount(s) unmounted with files still open: their further use fails (ENOTCONN)",
                sessions.live
            );
        }
    }
}

/// Run `work` on a thread of its own and wait for it until `deadline`; false if that
/// passed first (the work goes on in its thread: the stack it works on may be stuck).
fn on_thread_until(deadline: Instant, work: impl FnOnce() + Send + 'static) -> bool {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        work();
        let _ = tx.send(());
    });
    rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_ok()
}

enum Sync {
    Done(ubc_stack::Result<()>),
    TimedOut,
}

/// `Stack::sync_all` — then `syncfs` of the file system of `host`, if given — with a
/// deadline (it runs on in another thread if the deadline passes), printing what is left
/// every two seconds when `loud` or slow.
fn timed_sync(stack: &Stack, host: Option<PathBuf>, deadline: Instant, loud: bool) -> Sync {
    let (tx, rx) = mpsc::channel();
    let s = stack.clone();
    std::thread::spawn(move || {
        let _ = tx.send(s.sync_all().and_then(|()| host.map_or(Ok(()), |dir| syncfs(&dir))));
    });
    let start = Instant::now();
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Sync::TimedOut;
        }
        match rx.recv_timeout((deadline - now).min(Duration::from_secs(2))) {
            Ok(r) => return Sync::Done(r),
            // The sync thread died without an answer (it panicked): nothing says the data
            // is down, so this is a failed sync, never a clean exit.
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let e = std::io::Error::other("the sync thread panicked");
                return Sync::Done(Err(ubc_stack::Error::Cache(ubc::Error::Os { call: "sync", source: e })));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if loud || start.elapsed() >= Duration::from_secs(2) {
                    let left = deadline.saturating_duration_since(Instant::now()).as_secs();
                    let unclean = mib(stack.cache().stats().unclean_bytes);
                    eprintln!("ubc: syncing: {unclean} not yet written back ({left}s to the deadline)");
                }
            }
        }
    }
}

/// `syncfs(2)` of the file system holding directory `dir`.
fn syncfs(dir: &Path) -> ubc_stack::Result<()> {
    use std::os::fd::AsRawFd;
    let path = dir.display().to_string();
    let d = std::fs::File::open(dir).map_err(|e| ubc_stack::Error::io(&path, e))?;
    // SAFETY: syncfs on a descriptor we hold open.
    if unsafe { libc::syncfs(d.as_raw_fd()) } != 0 {
        return Err(ubc_stack::Error::io(&path, std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Lazily unmount `mp` (MNT_DETACH: also with files open): `umount2` as root, else
/// `fusermount3 -u -z`. Not mounted any more is success.
fn detach(mp: &Path) -> Result<(), String> {
    let is_mounted = || !mounts::ubc_ids(mp).is_empty();
    if !is_mounted() {
        return Ok(());
    }
    // SAFETY: geteuid takes no arguments, touches no memory of ours and always succeeds.
    if unsafe { libc::geteuid() } == 0 {
        let c = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: `c` is a NUL-terminated path that lives across the call, which only reads it.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
            return Ok(());
        }
    }
    let out = std::process::Command::new("fusermount3")
        .args(["-u", "-z", "-q"])
        .arg(mp)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("fusermount3: {e}"))?;
    if out.status.success() || !is_mounted() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// Send `Event::Detached` once none of `ids` is in the mount table (checked on every change
/// of the table, and every second).
pub(super) fn watch_detach(ids: Vec<u64>, tx: mpsc::Sender<Event>) {
    std::thread::spawn(move || {
        let watch = mounts::Watch::new();
        loop {
            watch.wait(Duration::from_secs(1));
            let now: Vec<u64> = mounts::table().into_iter().map(|m| m.id).collect();
            if !ids.iter().any(|i| now.contains(i)) {
                let _ = tx.send(Event::Detached);
                return;
            }
        }
    });
}

/// The termination signals (SIGINT, SIGTERM, SIGHUP), blocked in every thread and taken by
/// one thread with `sigwait`.
pub(super) struct Signals(libc::sigset_t);

impl Signals {
    /// Block the termination signals in the calling thread and in the threads it starts
    /// from now on (they inherit the mask). Call it before any other thread exists, else
    /// those threads may still take the signals (and die of them).
    pub(super) fn block() -> Signals {
        // SAFETY: sigset_t is plain data: all zeroes is a value sigemptyset may overwrite,
        // and it is initialized by sigemptyset before sigaddset and pthread_sigmask read it.
        // The pointers are to this local set; a null old set is allowed.
        unsafe {
            let mut s: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut s);
            libc::sigaddset(&mut s, libc::SIGINT);
            libc::sigaddset(&mut s, libc::SIGTERM);
            libc::sigaddset(&mut s, libc::SIGHUP);
            libc::pthread_sigmask(libc::SIG_BLOCK, &s, std::ptr::null_mut());
            Signals(s)
        }
    }

    /// Take the signals in a thread of their own: the first sends `Event::Signal` (unless
    /// the shutdown has already begun: then it only announces itself), the next gives up.
    pub(super) fn take(self, daemon: Arc<Daemon>, tx: mpsc::Sender<Event>) {
        std::thread::spawn(move || {
            let mut seen = false;
            loop {
                let mut sig = 0;
                // SAFETY: the set is initialized (`block`) and `sig` a writable int, both
                // live across the call.
                if unsafe { libc::sigwait(&self.0, &mut sig) } != 0 {
                    return;
                }
                if !daemon.stopping.swap(true, SeqCst) {
                    seen = true;
                    let _ = tx.send(Event::Signal(sig));
                } else if !seen {
                    // The mounts went away and the final sync runs: this is the first signal.
                    seen = true;
                    eprintln!(
                        "ubc: {}: syncing before exit; another signal exits at once without waiting",
                        signal_name(sig)
                    );
                } else {
                    daemon.give_up(&format!("second {}", signal_name(sig)));
                }
            }
        });
    }
}

pub(super) fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "signal",
    }
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

//! `ubc mount`: serve several layers of ONE stack through FUSE, one mount (and one
//! thread) per layer, all sharing the same `Stack`, so that unmodified programs see
//! coherent data through every mount at once.
//!
//! Policy: files are opened with `FOPEN_DIRECT_IO` and attributes/entries are not cached
//! by the kernel (TTL 0), so the kernel keeps no second copy and every read goes to the
//! stack's one cache. Shared `mmap` of such files needs `FUSE_DIRECT_IO_ALLOW_MMAP`
//! (Linux >= 6.6), which is requested at init; on older kernels shared mappings fail with
//! ENODEV (private mappings work).
//!
//! `--kernel-cache` keeps the kernel page cache (and 1 s attribute/entry TTLs) instead.
//! Invalidation across mounts is NOT implemented: a write through one mount is seen
//! through another only when that file is next opened there (close-to-open, the page
//! cache is dropped at each open) or the attributes time out.
//!
//! Each mount runs four request threads, so that one request waiting on a slow store does
//! not hold up the others. `close` (FLUSH) syncs the file — and reports write-back errors —
//! only when the process that opened it closes it; a close by anybody else (a forked child
//! closing the descriptors it inherited, at exec or exit) returns at once, so a program
//! that forks is never held up by a sync. The last close (RELEASE) syncs too, in the
//! background; `fsync` syncs.
//!
//! # Shutdown
//!
//! The command ends in one of three ways:
//!
//! * **Unmounted** (`fusermount3 -u` of every mount, or `umount`): the sessions end, the
//!   whole stack is synced and the command exits 0.
//! * **SIGTERM, SIGINT (Ctrl-C) or SIGHUP**, also with files open and writers active:
//!   1. from then on every change — `write`, create, open for writing, truncate, chmod,
//!      rename, remove, mkdir — fails with **EROFS** (the file system is read-only now;
//!      reads still work), and the writes already in flight are waited for: every write
//!      that returned Ok, before the signal or after it, is in the cache;
//!   2. the whole stack is synced (`Stack::sync_all`: every file's dirty pages pushed down
//!      through every layer, top first, so each layer's metadata — aead headers, zstd
//!      commits — reaches the bottom, then every store synced), with progress on stderr;
//!   3. every mount is unmounted lazily (`umount2(MNT_DETACH)` as root, else
//!      `fusermount3 -u -z`), which works with files open: those files then fail with
//!      ENOTCONN once the command is gone;
//!   4. the command exits 0 (or 74 if the sync failed, after listing what was not synced).
//!
//!   The sync has a deadline, `--sync-timeout` (60 s): past it the command lists what was
//!   not synced, unmounts and exits **75** (EX_TEMPFAIL). A **second signal** during the
//!   shutdown does the same at once. "Not synced" is the amount the cache still holds
//!   unwritten (all layers) and every open file written since its last sync, by path.
//! * **The mounts left the mount table** (`fusermount3 -u -z`, `umount -l`) while some
//!   process still holds a file open in them (the kernel then keeps the sessions alive):
//!   after a second's grace, the shutdown above runs as if signalled. With nothing open
//!   the kernel ends the sessions itself and this is the first case.
//!
//! SIGKILL loses only what was not synced (`fsync`, the opener's `close`, or the shutdown):
//! what a crash of the stack keeps is documented in docs/guarantees.md, section 2. Stores
//! through a shared mapping reach the stack when the kernel writes the mapping back
//! (`msync`); those not yet written back at the shutdown are not covered.

use crate::common::StackArgs;
use crate::error::{Fail, Result, EX_IOERR, EX_UNAVAILABLE};
use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig, LockOwner,
    MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen,
    ReplyStatfs, ReplyWrite, Request, Session, SessionUnmounter, TimeOrNow, WriteFlags,
};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::{Duration, Instant, SystemTime};
use ubc_stack::{Attr, Kind, LayerRef, OpenOptions, SetAttr};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The stack, bottom layer first, e.g. 'dir:/data | zstd | aead:keyfile=/etc/k'
    #[arg(long, short = 's', value_name = "SPEC")]
    stack: String,
    /// Serve layer N at MOUNTPOINT (repeatable; 0 is the bottom layer)
    #[arg(long = "at", value_name = "LAYER:MOUNTPOINT", required = true)]
    at: Vec<String>,
    /// Keep the kernel page cache (no direct I/O). Writes through one mount are then seen
    /// through another only after a re-open there: cross-mount invalidation is not done
    #[arg(long)]
    kernel_cache: bool,
    /// Let other users in (FUSE `allow_other`; non-root mounters need `user_allow_other` in
    /// /etc/fuse.conf). The kernel then checks file modes (`default_permissions`, always on).
    /// Without it only the user who mounted can use the mounts — not even root
    #[arg(long)]
    allow_other: bool,
    /// Cache budget in MiB
    #[arg(long, value_name = "MiB", default_value_t = 64)]
    budget: u64,
    /// At shutdown, give up syncing after this many seconds: what is still dirty is listed
    /// and the command exits 75
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    sync_timeout: u64,
}

/// Exit status when the command gave up before everything was synced (a second signal, or
/// the sync deadline passed): sysexits' EX_TEMPFAIL.
const EX_TEMPFAIL: i32 = 75;

/// Request-loop threads per mount: a request stuck in the stack (a sync waiting on a slow
/// store) does not hold up the others — a `close` by a forked child, a `stat` — nor
/// the shutdown.
const LOOP_THREADS: usize = 4;

fn parse_at(s: &str) -> Result<(usize, PathBuf)> {
    let bad = || Fail::usage(format!("--at {s}"), "expected LAYER:MOUNTPOINT, e.g. 2:/mnt/clear");
    let (n, p) = s.split_once(':').ok_or_else(bad)?;
    let n: usize = n.trim().parse().map_err(|_| bad())?;
    if p.is_empty() {
        return Err(bad());
    }
    Ok((n, PathBuf::from(p)))
}

/// What the mount threads, the signal thread and the shutdown share.
#[derive(Default)]
struct Shared {
    /// Changes (writes, creates, renames, …) pass through the gate; shutdown closes it.
    gate: Mutex<Gate>,
    drained: Condvar,
    /// Set once when the shutdown starts (by a signal or because the mounts went away).
    stopping: AtomicBool,
    /// Each mount: its point (as given, and canonical) and its open handles (for the report
    /// of what was not synced).
    mounts: Mutex<Vec<(PathBuf, PathBuf, Handles)>>,
    /// The FUSE connections of the mounts (their device minors: /sys/fs/fuse/connections/N).
    connections: Mutex<Vec<u32>>,
}

#[derive(Default)]
struct Gate {
    closed: bool,
    busy: usize,
}

type Handles = Arc<Mutex<HashMap<u64, Arc<Handle>>>>;

/// A change in flight: the shutdown waits for it before it syncs.
struct Pass<'a>(&'a Shared);

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let mut g = self.0.gate.lock().unwrap();
        g.busy -= 1;
        if g.busy == 0 {
            self.0.drained.notify_all();
        }
    }
}

impl Shared {
    /// Admit a change, or EROFS once the shutdown has begun.
    fn enter(&self) -> std::result::Result<Pass<'_>, Errno> {
        let mut g = self.gate.lock().unwrap();
        if g.closed {
            return Err(Errno::EROFS);
        }
        g.busy += 1;
        Ok(Pass(self))
    }

    /// Refuse new changes and wait, until `deadline`, for those in flight; false if some
    /// are still running then.
    fn close(&self, deadline: Instant) -> bool {
        let mut g = self.gate.lock().unwrap();
        g.closed = true;
        while g.busy > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self.drained.wait_timeout(g, left).unwrap().0;
        }
        true
    }

    /// Open files written since their last sync, or with dirty pages: (mount path, dirty
    /// bytes at that layer — pages already being written back are not counted).
    fn dirty_files(&self) -> Vec<(PathBuf, u64)> {
        let mounts: Vec<(PathBuf, Handles)> = self.mounts.lock().unwrap().iter().map(|(p, _, h)| (p.clone(), h.clone())).collect();
        let mut out: Vec<(PathBuf, u64)> = Vec::new();
        for (mp, handles) in mounts {
            let hs: Vec<Arc<Handle>> = handles.lock().unwrap().values().cloned().collect();
            for h in hs {
                let dirty = h.file.stats().dirty_bytes;
                let path = mp.join(h.file.path());
                if (dirty > 0 || h.written.load(SeqCst)) && !out.iter().any(|(p, _)| *p == path) {
                    out.push((path, dirty));
                }
            }
        }
        out.sort();
        out
    }
}

/// What the main thread waits for.
enum Event {
    /// A mount's session ended (unmounted, or the connection was aborted).
    Ended(PathBuf, std::io::Result<()>),
    /// The first SIGINT/SIGTERM/SIGHUP.
    Signal(i32),
    /// None of the mounts is in the mount table any more (`umount -l`, `fusermount3 -u -z`)
    /// but sessions still run: some process holds files of a detached mount open.
    Detached,
}

fn signal_name(sig: i32) -> &'static str {
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

pub fn run(a: Args) -> Result<()> {
    let ats = a.at.iter().map(|s| parse_at(s)).collect::<Result<Vec<_>>>()?;
    // Block the termination signals before any thread exists (the cache's own threads
    // included): they inherit the mask, and one thread waits for the signals.
    let sigs = termination_sigset();
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &sigs, std::ptr::null_mut()) };
    let sa = StackArgs { stack: a.stack.clone(), layer: None, budget: a.budget };
    let (stack, _) = sa.open()?;
    let mut layers = Vec::new();
    for (n, mp) in &ats {
        let layer = stack.layer(*n).map_err(|_| {
            Fail::usage(format!("--at {n}:{}", mp.display()), format!("the stack has {} layers (0..={})", stack.depth(), stack.depth() - 1))
        })?;
        match std::fs::metadata(mp) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(Fail::usage(mp.display().to_string(), "mount point is not a directory")),
            Err(e) => return Err(Fail::io(crate::error::Side::Input, &mp.display().to_string(), e)),
        }
        layers.push((layer, mp.clone()));
    }
    let statfs_dir = stack.layer(0).ok().and_then(|l| l.spec().strip_prefix("dir:").map(|p| PathBuf::from(p.trim())));

    let shared = Arc::new(Shared::default());
    let (tx, rx) = mpsc::channel::<Event>();
    let mut unmounters: Vec<SessionUnmounter> = Vec::new();
    // Each mount: (canonical path, mount id in /proc/self/mountinfo).
    let mut points: Vec<(PathBuf, Option<u64>)> = Vec::new();
    for (layer, mp) in layers {
        let handles = Handles::default();
        let fs = UbcFs::new(layer, a.kernel_cache, statfs_dir.clone(), shared.clone(), handles.clone());
        let mut config = Config::default();
        config.mount_options = vec![MountOption::FSName("ubc".into()), MountOption::Subtype("ubc".into()), MountOption::DefaultPermissions];
        if a.allow_other {
            config.acl = fuser::SessionACL::All;
        }
        config.n_threads = Some(LOOP_THREADS);
        let canon = mp.canonicalize().unwrap_or_else(|_| mp.clone());
        let before = ubc_mount_ids(&canon);
        let mut session = match Session::new(fs, &mp, &config) {
            Ok(s) => s,
            Err(e) => {
                // Undo the mounts made so far.
                for u in unmounters.iter_mut() {
                    let _ = u.unmount();
                }
                return Err(Fail::new(EX_UNAVAILABLE, mp.display().to_string(), format!("cannot mount: {}", crate::error::io_cause(&e))));
            }
        };
        unmounters.push(session.unmount_callable());
        let id = ubc_mount_ids(&canon).into_iter().filter(|i| !before.contains(i)).max();
        if let Some(minor) = mount_table().into_iter().find(|m| Some(m.0) == id).map(|m| m.1) {
            shared.connections.lock().unwrap().push(minor);
        }
        shared.mounts.lock().unwrap().push((mp.clone(), canon.clone(), handles));
        points.push((canon, id));
        let name = format!("ubc-mount-{}", mp.display());
        let tx = tx.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let r = session.run();
                let _ = tx.send(Event::Ended(mp, r));
            })
            .map_err(|e| Fail::new(EX_IOERR, "<thread>", e.to_string()))?;
    }

    {
        let (tx, shared, stack) = (tx.clone(), shared.clone(), stack.clone());
        std::thread::spawn(move || {
            let mut seen = false;
            loop {
                let mut sig = 0;
                if unsafe { libc::sigwait(&sigs, &mut sig) } != 0 {
                    return;
                }
                if !shared.stopping.swap(true, SeqCst) {
                    seen = true;
                    let _ = tx.send(Event::Signal(sig));
                } else if !seen {
                    // The mounts went away and the final sync runs: this is the first signal.
                    seen = true;
                    eprintln!("ubc: {}: syncing before exit; another signal exits at once without waiting", signal_name(sig));
                } else {
                    give_up(&shared, &stack, &format!("second {}", signal_name(sig)));
                }
            }
        });
    }
    let ids: Vec<u64> = points.iter().filter_map(|p| p.1).collect();
    if ids.len() == points.len() {
        let tx = tx.clone();
        std::thread::spawn(move || watch_mount_table(&ids, tx));
    }
    drop(tx);

    let timeout = Duration::from_secs(a.sync_timeout);
    let mut live = points.len();
    let mut fail = None;
    // Wait until every session has ended, a signal comes, or the mounts were detached.
    let why = loop {
        match rx.recv() {
            Ok(Event::Ended(mp, r)) => {
                note_end(mp, r, &mut fail);
                live -= 1;
                if live == 0 {
                    break None;
                }
            }
            Ok(Event::Signal(sig)) => break Some(signal_name(sig).to_string()),
            Ok(Event::Detached) => {
                // Give the kernel a moment: with nothing open it ends the sessions itself.
                let until = Instant::now() + Duration::from_secs(1);
                while live > 0 {
                    match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                        Ok(Event::Ended(mp, r)) => {
                            note_end(mp, r, &mut fail);
                            live -= 1;
                        }
                        Ok(_) => {}
                        Err(_) => break,
                    }
                }
                if live == 0 {
                    break None;
                }
                break Some("mounts detached with files still open".to_string());
            }
            Err(_) => break None,
        }
    };
    let loud = why.is_some();
    // From here on a signal (a second one, if one started this) exits at once.
    shared.stopping.store(true, SeqCst);
    let start = Instant::now();
    let deadline = start + timeout;
    if let Some(why) = &why {
        let u = stack.cache().stats().unclean_bytes;
        let files = shared.dirty_files().len();
        eprintln!(
            "ubc: {why}: shutting down: writes now fail (EROFS); syncing {} ({files} open files written since their last sync); a second signal exits at once",
            mib(u)
        );
    }
    if !shared.close(deadline) {
        give_up(&shared, &stack, &format!("{}s sync deadline passed (a write did not finish)", a.sync_timeout));
    }
    match timed_sync(&stack, deadline, loud) {
        Sync::Done(Ok(())) => {
            if loud {
                eprintln!("ubc: synced in {:.1}s", start.elapsed().as_secs_f64());
            }
        }
        Sync::Done(Err(e)) => {
            report_unsynced(&shared, &stack);
            fail = Some(Fail::stack(crate::error::Side::Output, &a.stack, e));
        }
        Sync::TimedOut => give_up(&shared, &stack, &format!("{}s sync deadline passed", a.sync_timeout)),
    }
    if live > 0 {
        // Unmount every mount, also those with files open (a lazy unmount: the open files
        // fail with ENOTCONN once this process is gone).
        // Not fuser's unmount: a plain umount fails (EBUSY) with files open.
        detach_all(&shared);
        let until = Instant::now() + Duration::from_millis(500);
        while live > 0 {
            match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                Ok(Event::Ended(mp, r)) => {
                    note_end(mp, r, &mut fail);
                    live -= 1;
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        if live > 0 {
            eprintln!("ubc: {live} mount(s) unmounted with files still open: their further use fails (ENOTCONN)");
        }
    }
    fail.map_or(Ok(()), Err)
}

fn note_end(mp: PathBuf, r: std::io::Result<()>, fail: &mut Option<Fail>) {
    if let Err(e) = r {
        *fail = Some(Fail::new(EX_IOERR, mp.display().to_string(), crate::error::io_cause(&e)));
    }
}

enum Sync {
    Done(ubc_stack::Result<()>),
    TimedOut,
}

/// `Stack::sync_all` with a deadline (it runs on in another thread if the deadline passes),
/// printing what is left every two seconds when `loud` or slow.
fn timed_sync(stack: &ubc_stack::Stack, deadline: Instant, loud: bool) -> Sync {
    let (tx, rx) = mpsc::channel();
    let s = stack.clone();
    std::thread::spawn(move || {
        let _ = tx.send(s.sync_all());
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
                    eprintln!("ubc: syncing: {} not yet written back ({left}s to the deadline)", mib(stack.cache().stats().unclean_bytes));
                }
            }
        }
    }
}

/// Print what is not synced, unmount (lazily) every mount, and leave at once with
/// EX_TEMPFAIL — each step bounded (one second each), since the stack may be stuck.
fn give_up(shared: &Arc<Shared>, stack: &ubc_stack::Stack, why: &str) -> ! {
    eprintln!("ubc: {why}: exiting without syncing everything");
    report_unsynced(shared, stack);
    let (tx, rx) = mpsc::channel();
    let sh = shared.clone();
    std::thread::spawn(move || {
        detach_all(&sh);
        // Abort the connections (root, with fusectl mounted): every process waiting on a
        // mount gets ENOTCONN now, not when this process has finished exiting — which can
        // take as long as the stuck store (the exit closes the store's files, and a FUSE
        // store's close waits unkillably).
        for c in sh.connections.lock().unwrap().iter() {
            let _ = std::fs::write(format!("/sys/fs/fuse/connections/{c}/abort"), "1");
        }
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(Duration::from_secs(1));
    unsafe { libc::_exit(EX_TEMPFAIL) }
}

fn detach_all(shared: &Shared) {
    let points: Vec<(PathBuf, PathBuf)> = shared.mounts.lock().unwrap().iter().map(|(p, c, _)| (p.clone(), c.clone())).collect();
    for (mp, canon) in points {
        if let Err(e) = detach(&canon) {
            eprintln!("ubc: {}: unmount: {e}", mp.display());
        }
    }
}

fn report_unsynced(shared: &Arc<Shared>, stack: &ubc_stack::Stack) {
    let (tx, rx) = mpsc::channel();
    let (sh, st) = (shared.clone(), stack.clone());
    std::thread::spawn(move || {
        let _ = tx.send((st.cache().stats().unclean_bytes, sh.dirty_files()));
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

/// Lazily unmount `mp` (MNT_DETACH: also with files open): `umount2` as root, else
/// `fusermount3 -u -z`. Not mounted any more is success.
fn detach(mp: &Path) -> std::result::Result<(), String> {
    if !is_mounted(mp) {
        return Ok(());
    }
    if unsafe { libc::geteuid() } == 0 {
        let c = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
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
    if out.status.success() || !is_mounted(mp) {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// `/proc/self/mountinfo` lines: (mount id, device minor, mount point, "fstype source").
fn mount_table() -> Vec<(u64, u32, String, String)> {
    let m = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    m.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let id = f.first()?.parse().ok()?;
            let sep = f.iter().position(|x| *x == "-")?;
            let minor = f.get(2)?.split_once(':')?.1.parse().ok()?;
            Some((id, minor, unescape(f.get(4)?), format!("{} {}", f.get(sep + 1)?, f.get(sep + 2)?)))
        })
        .collect()
}

/// Mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
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
    String::from_utf8_lossy(&out).into_owned()
}

fn ubc_mount_ids(mp: &Path) -> Vec<u64> {
    let mp = mp.to_string_lossy();
    // Mounted directly the type is "fuse", through fusermount3 "fuse.ubc"; the source is "ubc".
    mount_table().into_iter().filter(|(_, _, p, t)| *p == mp && (t == "fuse ubc" || t == "fuse.ubc ubc")).map(|m| m.0).collect()
}

fn is_mounted(mp: &Path) -> bool {
    !ubc_mount_ids(mp).is_empty()
}

/// Tell the main thread once none of `ids` is in the mount table (checked on every change
/// of the table, and every second).
fn watch_mount_table(ids: &[u64], tx: mpsc::Sender<Event>) {
    let f = std::fs::File::open("/proc/self/mountinfo").ok();
    loop {
        if let Some(f) = &f {
            use std::os::fd::AsRawFd;
            let mut p = libc::pollfd { fd: f.as_raw_fd(), events: libc::POLLPRI, revents: 0 };
            unsafe { libc::poll(&mut p, 1, 1000) };
        } else {
            std::thread::sleep(Duration::from_secs(1));
        }
        let now: Vec<u64> = mount_table().into_iter().map(|m| m.0).collect();
        if !ids.iter().any(|i| now.contains(i)) {
            let _ = tx.send(Event::Detached);
            return;
        }
    }
}

fn termination_sigset() -> libc::sigset_t {
    unsafe {
        let mut s: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut s);
        libc::sigaddset(&mut s, libc::SIGINT);
        libc::sigaddset(&mut s, libc::SIGTERM);
        libc::sigaddset(&mut s, libc::SIGHUP);
        s
    }
}

/// Inode numbers ↔ stack paths ("" is the root, inode 1) of one mount.
#[derive(Default)]
struct Inodes {
    by_ino: HashMap<u64, String>,
    by_path: HashMap<String, u64>,
    next: u64,
}

impl Inodes {
    fn new() -> Inodes {
        let mut i = Inodes { next: 2, ..Default::default() };
        i.by_ino.insert(1, String::new());
        i.by_path.insert(String::new(), 1);
        i
    }

    fn ino(&mut self, path: &str) -> u64 {
        if let Some(&i) = self.by_path.get(path) {
            return i;
        }
        let i = self.next;
        self.next += 1;
        self.by_ino.insert(i, path.to_string());
        self.by_path.insert(path.to_string(), i);
        i
    }

    fn path(&self, ino: u64) -> Option<String> {
        self.by_ino.get(&ino).cloned()
    }

    /// Forget `path` and everything under it.
    fn remove(&mut self, path: &str) {
        let prefix = format!("{path}/");
        let doomed: Vec<(String, u64)> =
            self.by_path.iter().filter(|(p, _)| p.as_str() == path || p.starts_with(&prefix)).map(|(p, i)| (p.clone(), *i)).collect();
        for (p, i) in doomed {
            self.by_path.remove(&p);
            self.by_ino.remove(&i);
        }
    }

    /// `from` (and everything under it) is now `to`.
    fn rename(&mut self, from: &str, to: &str) {
        self.remove(to);
        let prefix = format!("{from}/");
        let moved: Vec<(String, u64)> =
            self.by_path.iter().filter(|(p, _)| p.as_str() == from || p.starts_with(&prefix)).map(|(p, i)| (p.clone(), *i)).collect();
        for (p, i) in moved {
            let np = format!("{to}{}", &p[from.len()..]);
            self.by_path.remove(&p);
            self.by_path.insert(np.clone(), i);
            self.by_ino.insert(i, np);
        }
    }
}

struct Handle {
    file: ubc_stack::File,
    append: bool,
    /// The process (thread group) that opened it: only its `close` waits for a sync (see
    /// `flush`).
    pid: u32,
    /// Written (or resized) through this handle since its last successful sync.
    written: AtomicBool,
}

impl Handle {
    /// Sync the file; `written` is cleared first (a write racing with the sync sets it again).
    fn sync(&self) -> std::result::Result<(), Errno> {
        self.written.store(false, SeqCst);
        let r = self.file.sync().map_err(|e| errno(&e));
        if r.is_err() {
            self.written.store(true, SeqCst);
        }
        r
    }
}

/// One mount: one layer of the shared stack.
struct UbcFs {
    layer: LayerRef,
    kernel_cache: bool,
    ttl: Duration,
    uid: u32,
    gid: u32,
    statfs_dir: Option<PathBuf>,
    inodes: Mutex<Inodes>,
    handles: Handles,
    next_fh: AtomicU64,
    shared: Arc<Shared>,
}

/// The process of thread `tid` (FUSE requests carry the thread's id): its thread group
/// id from /proc, or `tid` itself if that is gone.
fn process_of(tid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Tgid:").and_then(|v| v.trim().parse().ok())))
        .unwrap_or(tid)
}

fn errno(e: &ubc_stack::Error) -> Errno {
    Errno::from_i32(e.errno())
}

fn join(parent: &str, name: &OsStr) -> std::result::Result<String, Errno> {
    let name = name.to_str().ok_or(Errno::EINVAL)?;
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(Errno::EINVAL);
    }
    Ok(if parent.is_empty() { name.to_string() } else { format!("{parent}/{name}") })
}

fn file_type(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
    }
}

fn time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

impl UbcFs {
    fn new(layer: LayerRef, kernel_cache: bool, statfs_dir: Option<PathBuf>, shared: Arc<Shared>, handles: Handles) -> UbcFs {
        UbcFs {
            layer,
            kernel_cache,
            ttl: if kernel_cache { Duration::from_secs(1) } else { Duration::ZERO },
            uid: unsafe { libc::geteuid() },
            gid: unsafe { libc::getegid() },
            statfs_dir,
            inodes: Mutex::new(Inodes::new()),
            handles,
            next_fh: AtomicU64::new(1),
            shared,
        }
    }

    fn path(&self, ino: INodeNo) -> std::result::Result<String, Errno> {
        self.inodes.lock().unwrap().path(ino.0).ok_or(Errno::ENOENT)
    }

    fn handle(&self, fh: FileHandle) -> std::result::Result<Arc<Handle>, Errno> {
        self.handles.lock().unwrap().get(&fh.0).cloned().ok_or(Errno::EBADF)
    }

    fn fattr(&self, ino: u64, a: &Attr) -> FileAttr {
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
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    /// Attributes of `path`, with its inode number.
    fn stat(&self, path: &str) -> std::result::Result<FileAttr, Errno> {
        let a = self.layer.getattr(path).map_err(|e| errno(&e))?;
        let ino = self.inodes.lock().unwrap().ino(path);
        Ok(self.fattr(ino, &a))
    }

    /// Attributes through an open handle (the name may be gone).
    fn stat_handle(&self, ino: u64, h: &Handle) -> std::result::Result<FileAttr, Errno> {
        let size = h.file.len().map_err(|e| errno(&e))?;
        let now = SystemTime::now();
        let a = Attr { kind: Kind::File, ino, mode: 0o644, size, mtime: now, atime: now };
        Ok(self.fattr(ino, &a))
    }

    fn add_handle(&self, file: ubc_stack::File, append: bool, pid: u32) -> FileHandle {
        let fh = self.next_fh.fetch_add(1, Relaxed);
        self.handles.lock().unwrap().insert(fh, Arc::new(Handle { file, append, pid, written: AtomicBool::new(false) }));
        FileHandle(fh)
    }

    fn open_flags(&self) -> FopenFlags {
        if self.kernel_cache { FopenFlags::empty() } else { FopenFlags::FOPEN_DIRECT_IO }
    }
}

impl Filesystem for UbcFs {
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

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let r = match self.path(ino).and_then(|p| self.stat(&p)) {
            Ok(a) => Ok(a),
            Err(e) => match fh.map(|f| self.handle(f)) {
                Some(Ok(h)) => self.stat_handle(ino.0, &h),
                _ => Err(e),
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
            let _pass = self.shared.enter()?;
            let path = self.path(ino);
            let h = fh.and_then(|f| self.handle(f).ok());
            let mut set = SetAttr { size: None, mode: mode.map(|m| m & 0o7777), atime: atime.map(time), mtime: mtime.map(time) };
            if let Some(s) = size {
                match (&h, &path) {
                    (Some(h), _) => {
                        let r = h.file.set_len(s);
                        h.written.store(true, SeqCst); // after, as for writes
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
            let _pass = self.shared.enter()?;
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
        let r = (|| {
            let _pass = self.shared.enter()?;
            let p = join(&self.path(parent)?, name)?;
            self.layer.remove(&p).map_err(|e| errno(&e))?;
            self.inodes.lock().unwrap().remove(&p);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            let _pass = self.shared.enter()?;
            let p = join(&self.path(parent)?, name)?;
            self.layer.rmdir(&p).map_err(|e| errno(&e))?;
            self.inodes.lock().unwrap().remove(&p);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
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
            let _pass = self.shared.enter()?;
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
            let _pass = if write { Some(self.shared.enter()?) } else { None };
            let truncate = write && flags.0 & libc::O_TRUNC != 0;
            let f = self.layer.open_with(&p, OpenOptions { write, create: false, truncate }).map_err(|e| errno(&e))?;
            Ok(self.add_handle(f, flags.0 & libc::O_APPEND != 0, process_of(req.pid())))
        })();
        match r {
            Ok(fh) => reply.opened(fh, self.open_flags()),
            Err(e) => reply.error(e),
        }
    }

    fn create(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, flags: i32, reply: ReplyCreate) {
        let r = (|| {
            let _pass = self.shared.enter()?;
            let p = join(&self.path(parent)?, name)?;
            if flags & libc::O_EXCL != 0 && self.layer.getattr(&p).is_ok() {
                return Err(Errno::EEXIST);
            }
            let truncate = flags & libc::O_TRUNC != 0;
            let f = self.layer.open_with(&p, OpenOptions { write: true, create: true, truncate }).map_err(|e| errno(&e))?;
            let m = mode & !umask & 0o7777;
            if m != 0o644 {
                let _ = self.layer.setattr(&p, &SetAttr { mode: Some(m), ..Default::default() });
            }
            let a = self.stat(&p)?;
            Ok((a, self.add_handle(f, flags & libc::O_APPEND != 0, process_of(req.pid()))))
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
            let _pass = self.shared.enter()?;
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
            // Marked after the bytes are in, failed or not: a sync that cleared the mark
            // while they went in may have missed them.
            h.written.store(true, SeqCst);
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
        let r = self.handle(fh).and_then(|h| if h.pid == process_of(req.pid()) { h.sync() } else { Ok(()) });
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
        let h = self.handles.lock().unwrap().remove(&fh.0);
        match h.map(|h| h.sync()) {
            Some(Err(e)) => reply.error(e),
            _ => reply.ok(),
        }
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.handle(fh).and_then(|h| h.sync()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let r = (|| {
            let p = self.path(ino)?;
            let entries = self.layer.readdir(&p).map_err(|e| errno(&e))?;
            let mut all = vec![(ino.0, FileType::Directory, ".".to_string()), (1, FileType::Directory, "..".to_string())];
            let mut inodes = self.inodes.lock().unwrap();
            for e in entries {
                let child = if p.is_empty() { e.name.clone() } else { format!("{p}/{}", e.name) };
                all.push((inodes.ino(&child), file_type(e.kind), e.name));
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
        if let Some(d) = &self.statfs_dir {
            if let Ok(c) = std::ffi::CString::new(d.as_os_str().as_encoded_bytes()) {
                let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
                if unsafe { libc::statvfs(c.as_ptr(), &mut s) } == 0 {
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
            }
        }
        // Not over a host directory: a nominal, empty-looking 1 TiB.
        reply.statfs(1 << 28, 1 << 28, 1 << 28, 1 << 20, 1 << 20, 4096, 255, 4096)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(unescape(r"/tmp/a\040b\011c\134d\012"), "/tmp/a b\tc\\d\n");
        assert_eq!(unescape(r"/x\04"), r"/x\04");
        assert_eq!(unescape(r"/x\999"), r"/x\999");
    }
}

//! `ubc mount`: serve several layers of ONE stack through FUSE, one mount (and one
//! thread) per layer, all sharing the same `Stack`, so that unmodified programs see
//! coherent data through every mount at once.
//!
//! Policy with one mount of layer 0 over a host directory (`--cache passthrough`, the
//! default then where the kernel allows it — Linux 6.9+, a daemon with `CAP_SYS_ADMIN`): every
//! regular file is handed to the kernel, which reads, writes and maps the host file itself
//! (`passthrough`); the daemon answers names, attributes, `fsync`, `fallocate`, `lseek` and
//! `copy_file_range` on the same host files, holds none of their data, and the shutdown
//! syncs the host's file system after the stack. Sound because that kernel is the only way
//! into the stack and the files it serves are the host's own (design.md, "Passthrough").
//!
//! Policy with one mount otherwise (`--cache writeback`, the default then): as `--cache kernel` below,
//! and the kernel also keeps writes (`FUSE_WRITEBACK_CACHE`), sending them at close, fsync,
//! msync or its own write-back — sound because that kernel is the only way into the stack
//! (design.md, "The mount and the kernel's caches"). Appends are then cached too (the kernel
//! owns the length and places them), `SEEK_DATA`/`SEEK_HOLE` have the kernel write the file
//! back first, and the shutdown pulls the kernel's writes before it syncs.
//!
//! Policy with several mounts (`--cache kernel`, the default then): the kernel caches file pages
//! (`FOPEN_KEEP_CACHE`, write-through: every write reaches the stack before it returns),
//! attributes and names (`--attr-timeout`, 60 s), and is told to drop each of them the
//! moment it changes through anything else — another mount, another layer, the write-back
//! of a layer above into a lower layer's bytes (`kernels`). Reads the kernel holds never
//! reach the daemon. Appends (`O_APPEND`) are direct I/O: they go to the end as the stack
//! knows it. `--cache direct` keeps nothing in the kernel (`FOPEN_DIRECT_IO`, TTL 0): one
//! copy of the data, a round trip per call; shared `mmap` of such files needs
//! `FUSE_DIRECT_IO_ALLOW_MMAP` (Linux >= 6.6, requested at init; older kernels: ENODEV),
//! with which the kernel keeps the pages of a mapped file — told, like the other modes'
//! caches, of changes through anything else (other mounts, layers, machines).
//! Stacks over memory stores are always direct (their files have no identity to match
//! changes by).
//!
//! Each mount runs `--threads` request threads (default: the cores, at least 4), each on
//! its own clone of the session's `/dev/fuse` descriptor, so that one request waiting on a
//! slow store does not hold up the others. `close` (FLUSH) writes back what was written
//! through the file into the store (`ubc_stack::File::write_back`: no store fsync where the
//! layers allow — `dir`, `aead`; through `zstd` it syncs), reporting write-back errors, only
//! when the process that opened it closes it; a close by anybody else (a forked child
//! closing the descriptors it inherited, at exec or exit) returns at once, so a program
//! that forks is never held up by it. The last close (RELEASE) writes back too, in the
//! background; `fsync` syncs (durable).
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
//!      that returned Ok, before the signal or after it, is in the cache. With the
//!      write-back cache the kernel's cached writes are pulled into the stack before and
//!      after (`shutdown::finish`), and the kernel's next write asks for attributes, which
//!      are refused: the writer gets EROFS there; a write copied into the kernel after the
//!      last pull fails at its `fsync` or `close`;
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
//! # Descriptors
//!
//! A file used through a mount holds at most one descriptor (its host file's; the pages of
//! every layer's object are slices of the cache's shared memfds), and those descriptors live
//! in the process's bounded pool of host descriptors (`--host-fds`, default a quarter of the
//! open-file limit; `ubc::pager::host_fds`): beyond it the least recently used are closed and
//! reopened by file handle when next used. Closed files stay known only within the stack's
//! pool of idle files (`--idle-files`, see `ubc_stack::stack`) and the cache's closed
//! objects (`--cached-files`), so a tree of any size can be copied in. A file removed or
//! renamed over while open keeps working (its descriptor is pinned open before the unlink,
//! `fstat` included) and is gone, with every descriptor of it, at its last close.
//!
//! SIGKILL of the daemon loses only what was not written back (`fsync`, the opener's
//! `close`, or the shutdown); a crash of the host, what was not synced (`fsync`):
//! what a crash of the stack keeps is documented in docs/guarantees.md, section 2. Stores
//! through a shared mapping reach the stack when the kernel writes the mapping back
//! (`msync`); those not yet written back at the shutdown are not covered.
//!
//! # Parts
//!
//! * this module: the command's options, the mounts' setup, and the wait for what ends it;
//! * `fs`: the FUSE request handlers of one mount (one layer), over
//!   * `inodes` and `handles`: the mount's inode table and open-file table,
//!   * `passthrough`: files handed to the kernel (backing ids, the host-file calls),
//!   * `attr`: stack metadata as FUSE attributes;
//! * `waits`: lock requests that wait (`F_SETLKW`, `flock`), until granted, released or
//!   interrupted;
//! * `gate`: what changes pass through and the shutdown closes;
//! * `shutdown`: signals, the final sync and its deadline, the lazy unmount, exit statuses.
//!
//! * `kernels`: the kernels' caches kept coherent (the notifier thread);
//!
//! Imports go one way: `fs` uses the tables, `attr`, `gate`, `waits`, `kernels` and
//! `passthrough`; `waits` and `shutdown` use `handles` (`shutdown` also `gate`, to name the
//! files not synced); `handles` holds `passthrough`'s open files; nothing uses `fs` or
//! `shutdown` but this module, and `passthrough`, `inodes`, `attr` and `gate` use none of
//! the others.

mod attr;
mod fs;
mod gate;
mod handles;
mod inodes;
mod kernels;
mod passthrough;
mod shutdown;
mod waits;

use crate::common::StackArgs;
use crate::error::{EX_IOERR, EX_UNAVAILABLE, Fail, Result};
use fs::{Caching, LayerFs};
use fuser::{Config, MountOption, Session, SessionUnmounter};
use handles::Handles;
use inodes::Inodes;
use kernels::KernelMount;
use kernels::Kernels;
use shutdown::{Daemon, Event, Sessions, Signals};
use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};
use ubc_cli::mounts;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The stack, bottom layer first, e.g. 'dir:/data | aead:keyfile=/etc/k | zstd' (compress, then encrypt)
    #[arg(long, short = 's', value_name = "SPEC")]
    stack: String,
    /// Serve layer N at MOUNTPOINT (repeatable; 0 is the bottom layer)
    #[arg(long = "at", value_name = "LAYER:MOUNTPOINT", required = true)]
    at: Vec<String>,
    /// What the kernel caches: `passthrough` — the kernel reads, writes and maps each host
    /// file itself, at the host's speed (FUSE passthrough, Linux 6.9+, root): one mount of a
    /// `dir` bottom layer only (the default then, where the kernel allows it; else
    /// `writeback`); `writeback` — file pages, writes not yet sent (written back
    /// at close, fsync and the kernel's own write-back), attributes and names: one mount
    /// only (the default then); `kernel` — file pages (writes go through at once),
    /// attributes and names, each dropped when it changes through any mount or layer of
    /// the stack (the default with several mounts); `direct` — nothing (every read, write
    /// and stat goes to the stack: one copy of the data, at a round trip per call). Stacks
    /// over memory stores are always `direct` (their files carry no identity to match
    /// changes by), and so are stacks over a store shared with other machines
    /// (`s3:…?etcd=…`: the kernel would not hear their changes)
    #[arg(long, value_name = "MODE", value_parser = ["passthrough", "writeback", "kernel", "direct"])]
    cache: Option<String>,
    /// With `--cache kernel` or `writeback`: how long the kernel may keep attributes and
    /// names (also that a name does not exist) before it asks again. Changes through ubc
    /// reach it at once; this bounds how long a change made to the store behind ubc's back
    /// stays unseen
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    attr_timeout: f64,
    /// Request threads per mount (each with its own /dev/fuse descriptor). Default: the
    /// number of cores, at least 4 — a request may wait on the store (a sync at close), and
    /// the others must go on
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// How long one request thread keeps polling /dev/fuse after answering a request
    /// before it sleeps. A program sends its requests one after another (a `tar -x` sends
    /// ~9 per file); a thread that is still polling picks the next one up at once, where a
    /// sleeping thread must first be woken (on a VM, an idle vCPU's halt and wake-up cost
    /// more than the request). It costs that much CPU after each request; 0 sleeps at once
    #[arg(long, value_name = "MICROSECONDS", default_value_t = 200)]
    poll_us: u64,
    /// Let other users in (FUSE `allow_other`; non-root mounters need `user_allow_other` in
    /// /etc/fuse.conf). The kernel then checks file modes (`default_permissions`, always on).
    /// Without it only the user who mounted can use the mounts — not even root
    #[arg(long)]
    allow_other: bool,
    /// Cache budget in MiB
    #[arg(long, value_name = "MiB", default_value_t = 64)]
    budget: u64,
    /// Huge pages for the cache: never, try (2 MiB hugetlb pages if the host's pool holds
    /// the budget, else shmem THP if tmpfs allocates it, else ordinary pages) or require.
    /// Which one the cache got is said on stderr when it is not what was asked for
    #[arg(long, value_name = "WHEN", default_value = "never")]
    huge_pages: ubc::HugePages,
    /// Cache files of memory-backed stores (the `mem` layer, host files on tmpfs) as copies,
    /// instead of serving them in place from the store's own pages (execute-in-place)
    #[arg(long)]
    no_xip: bool,
    /// With `--cache writeback`: how much written data the kernel may hold for the mount
    /// before it makes writers wait (the FUSE connection's `max_bytes` in /sys/class/bdi;
    /// Linux caps a FUSE mount at 1% of its dirty limit, ~50 MB here, unless raised — root
    /// only). Default: 4 × the budget. 0 keeps the kernel's limit
    #[arg(long, value_name = "MiB")]
    kernel_dirty: Option<u64>,
    /// Closed files kept open (every layer's object of the file) for a quick reopen; beyond
    /// them the least recently used are flushed down and closed. Default: a quarter of the
    /// open-file limit (a file holds one descriptor, its host file's)
    #[arg(long, value_name = "N")]
    idle_files: Option<usize>,
    /// Closed files the cache keeps (with their pages; the stored file's descriptor each);
    /// beyond them the least recently closed are written back and dropped. Default: a
    /// quarter of the open-file limit
    #[arg(long, value_name = "N")]
    cached_files: Option<usize>,
    /// Host descriptors kept open for files; beyond them the least recently used are closed
    /// and reopened by file handle when next used (needs CAP_DAC_READ_SEARCH; without it,
    /// files keep their descriptors). Default: a quarter of the open-file limit
    #[arg(long, value_name = "N")]
    host_fds: Option<usize>,
    /// At shutdown, give up syncing after this many seconds: what is still dirty is listed
    /// and the command exits 75
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    sync_timeout: u64,
}

/// The fewest request threads a mount gets by default: a request stuck in the stack (a sync
/// waiting on a slow store) must not hold up the others — a `close` by a forked child, a
/// `stat` — nor the shutdown.
const MIN_THREADS: usize = 4;

fn parse_at(s: &str) -> Result<(usize, PathBuf)> {
    let bad = || Fail::usage(format!("--at {s}"), "expected LAYER:MOUNTPOINT, e.g. 2:/mnt/clear");
    let (n, p) = s.split_once(':').ok_or_else(bad)?;
    let n: usize = n.trim().parse().map_err(|_| bad())?;
    if p.is_empty() {
        return Err(bad());
    }
    Ok((n, PathBuf::from(p)))
}

pub fn run(a: Args) -> Result<()> {
    let ats = a.at.iter().map(|s| parse_at(s)).collect::<Result<Vec<_>>>()?;
    // Before any thread exists (the cache's own threads included): they inherit the mask,
    // and one thread takes the signals.
    let signals = Signals::block();
    if let Some(n) = a.host_fds {
        ubc::pager::host_fds::set_limit(n);
    }
    let sa =
        StackArgs { stack: a.stack.clone(), layer: None, budget: a.budget, huge_pages: a.huge_pages, no_xip: a.no_xip };
    let (stack, _) = sa.open_caching(a.cached_files)?;
    if a.huge_pages == ubc::HugePages::Try && !stack.cache().stats().page_memory.starts_with("hugetlb") {
        // Asked for and not (wholly) given: say which memory the pages got, and why.
        eprintln!("ubc mount: pages: {}", stack.cache().stats().page_memory);
    }
    if let Some(n) = a.idle_files {
        stack.set_idle_files(n);
    }
    let mut layers = Vec::new();
    for (n, mp) in &ats {
        let layer = stack.layer(*n).map_err(|_| {
            Fail::usage(
                format!("--at {n}:{}", mp.display()),
                format!("the stack has {} layers (0..={})", stack.depth(), stack.depth() - 1),
            )
        })?;
        match std::fs::metadata(mp) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(Fail::usage(mp.display().to_string(), "mount point is not a directory")),
            Err(e) => return Err(Fail::io(crate::error::Side::Input, &mp.display().to_string(), e)),
        }
        layers.push((layer, mp.clone()));
    }
    let statfs_dir = stack.layer(0).ok().and_then(|l| l.host_root());

    // Kernel caching needs files known by their store's identity (`kernels`): a stack over
    // memory has none.
    let identified = !stack.layer(0).map(|l| l.spec().starts_with("mem")).unwrap_or(true);
    // A store other machines change (s3 with etcd): their changes reach ubc's cache through
    // the files' tokens, not the kernel's caches — so the kernel caches nothing.
    let shared = stack.layer(0).map(|l| l.is_shared()).unwrap_or(false);
    if shared && a.cache.as_deref().is_some_and(|m| m != "direct") {
        return Err(Fail::usage(
            "--cache",
            "the stack's store is shared with other machines (etcd=): the kernel's caches would not hear their changes (use --cache direct, the default here)",
        ));
    }
    // A kernel's write-back cache holds bytes nothing else can see until it sends them:
    // sound only when that kernel is the one way into the stack, i.e. one mount.
    // Passthrough hands the host files to the kernel, bypassing the cache: sound only when
    // that kernel is the one way into the stack (one mount) and serves the host files
    // themselves (the bottom layer, a host directory). It also needs the privilege to
    // register backing files; without it the default is the write-back cache.
    let host_files = ats.len() == 1 && ats[0].0 == 0 && statfs_dir.is_some();
    let stacked_fs = statfs_dir.as_deref().and_then(passthrough::stacked_fs);
    let mode = a.cache.clone().unwrap_or_else(|| {
        if shared {
            "direct"
        } else if host_files && stacked_fs.is_none() && passthrough::may_pass_through() {
            "passthrough"
        } else if ats.len() == 1 {
            "writeback"
        } else {
            "kernel"
        }
        .to_string()
    });
    if mode == "writeback" && ats.len() > 1 {
        return Err(Fail::usage(
            "--cache writeback",
            "needs one mount: each mount's kernel would hold writes that the other mounts cannot see (use --cache kernel)",
        ));
    }
    if mode == "passthrough" && !host_files {
        return Err(Fail::usage(
            "--cache passthrough",
            "needs one mount of layer 0 over a host directory (dir:): the kernel would write files behind the cache of the other mounts and layers",
        ));
    }
    if let (true, Some(fs)) = (mode == "passthrough", stacked_fs) {
        return Err(Fail::usage(
            "--cache passthrough",
            format!("the directory is on {fs}: the kernel passes files through to one level of stacking only"),
        ));
    }
    let caching = if mode != "direct" && identified {
        Caching {
            data: true,
            // Where the kernel refuses passthrough, one mount still gets its write-back cache.
            writeback: mode == "writeback" || mode == "passthrough",
            passthrough: mode == "passthrough",
            ttl: Duration::from_secs_f64(a.attr_timeout.max(0.0)),
        }
    } else {
        Caching { data: false, writeback: false, passthrough: false, ttl: Duration::ZERO }
    };
    // Told in every mode: a `--cache direct` mount's kernel keeps the pages of mapped files
    // (`FUSE_DIRECT_IO_ALLOW_MMAP`), which other mounts' and other machines' changes must drop.
    let (kernels, watcher) = Kernels::start();
    stack.watch(watcher);
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(MIN_THREADS, |n| n.get().max(MIN_THREADS)))
        .max(1);
    let daemon = Arc::new(Daemon::new(stack, kernels.clone()));
    if let (true, Some(dir)) = (caching.passthrough, &statfs_dir) {
        daemon.sync_host(dir.clone());
    }
    let (tx, rx) = mpsc::channel::<Event>();
    let mut unmounters: Vec<SessionUnmounter> = Vec::new();
    // Each mount's id in the mount table, if it was found.
    let mut ids: Vec<Option<u64>> = Vec::new();
    // The sessions, mounted but not yet served, and what the notifier needs of each: every
    // mount is registered before any serves a request, so the list never changes while
    // requests run (the notifier and the stack's watcher read it without a lock).
    let mut sessions_to_run = Vec::new();
    let mut kernel_mounts = Vec::new();
    for (id, (layer, mp)) in layers.into_iter().enumerate() {
        let handles = Arc::new(Handles::new());
        let inodes = Arc::new(std::sync::RwLock::new(Inodes::new()));
        let domain = layer.domain();
        let fs = LayerFs::new(
            layer,
            id,
            caching,
            statfs_dir.clone(),
            daemon.gate.clone(),
            handles.clone(),
            inodes.clone(),
            kernels.clone(),
        );
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName("ubc".into()),
            MountOption::Subtype("ubc".into()),
            MountOption::DefaultPermissions,
        ];
        if a.allow_other {
            config.acl = fuser::SessionACL::All;
        }
        config.n_threads = Some(threads);
        // Each thread reads requests from its own clone of the session's /dev/fuse
        // descriptor (FUSE_DEV_IOC_CLONE): the kernel hands a request to one waiting reader
        // instead of waking all of them on one shared descriptor.
        config.clone_fd = true;
        config.spin = std::time::Duration::from_micros(a.poll_us);
        let canon = mp.canonicalize().unwrap_or_else(|_| mp.clone());
        let before = mounts::ubc_ids(&canon);
        let mut session = match Session::new(fs, &mp, &config) {
            Ok(s) => s,
            Err(e) => {
                // Undo the mounts made so far.
                for u in unmounters.iter_mut() {
                    let _ = u.unmount();
                }
                return Err(Fail::new(
                    EX_UNAVAILABLE,
                    mp.display().to_string(),
                    format!("cannot mount: {}", crate::error::io_cause(&e)),
                ));
            }
        };
        unmounters.push(session.unmount_callable());
        let table_id = mounts::ubc_ids(&canon).into_iter().filter(|i| !before.contains(i)).max();
        let connection = mounts::table().into_iter().find(|m| Some(m.id) == table_id).map(|m| m.minor);
        if let (true, Some(c)) = (caching.writeback, connection) {
            let mib = a.kernel_dirty.unwrap_or(4 * a.budget);
            if mib > 0 {
                kernel_dirty_limit(c, mib << 20);
            }
        }
        let point = connection.map(|c| (canon.clone(), c));
        kernel_mounts.push(KernelMount { id, domain, notifier: session.notifier(), inodes, point });
        daemon.add_mount(id, mp.clone(), canon, handles, connection);
        ids.push(table_id);
        sessions_to_run.push((session, mp));
    }
    kernels.set_mounts(kernel_mounts);
    for (session, mp) in sessions_to_run {
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

    signals.take(daemon.clone(), tx.clone());
    // Only if every mount was found in the table: one that was not cannot be seen leaving it.
    let found: Vec<u64> = ids.iter().flatten().copied().collect();
    if found.len() == ids.len() {
        shutdown::watch_detach(found, tx.clone());
    }
    drop(tx);

    let mut sessions = Sessions::new(rx, ids.len());
    let why = wait_for_end(&mut sessions);
    shutdown::finish(&daemon, why, &mut sessions, a.sync_timeout, &a.stack);
    sessions.result()
}

/// Let the kernel hold up to `bytes` of written data for FUSE connection `connection`
/// before it throttles writers: its backing device's `max_bytes` (Linux 6.2+). FUSE devices
/// start at 1% of the dirty limit with a strict limit, which throttles a writer through the
/// write-back cache at ~50 MB in flight — the rate of the stack's write-back then, however
/// briefly it writes: a burst of random 4 KiB writes into a 64 MiB file went through a
/// `dir | aead | zstd` mount at 33–41 k/s, 780–840 k/s with 256 MiB allowed. Best effort
/// (root only): the kernel's limit stays otherwise.
fn kernel_dirty_limit(connection: u32, bytes: u64) {
    let _ = std::fs::write(format!("/sys/class/bdi/0:{connection}/max_bytes"), bytes.to_string());
}

/// Wait until every session has ended (None), a signal comes, or the mounts were detached
/// with files still open: what starts the shutdown.
fn wait_for_end(sessions: &mut Sessions) -> Option<String> {
    loop {
        match sessions.next() {
            Some(Event::Ended(mp, r)) => {
                sessions.ended(mp, r);
                if sessions.all_ended() {
                    return None;
                }
            }
            Some(Event::Signal(sig)) => return Some(shutdown::signal_name(sig).to_string()),
            Some(Event::Detached) => {
                // Give the kernel a moment: with nothing open it ends the sessions itself.
                sessions.wait_until(Instant::now() + Duration::from_secs(1));
                if sessions.all_ended() {
                    return None;
                }
                return Some("mounts detached with files still open".to_string());
            }
            None => return None,
        }
    }
}

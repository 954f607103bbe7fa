//! The `ubc mount` FUSE file system (issue 18) against the host's own file system doing the
//! same work in the same run.
//!
//! Three sides, alternating in every repetition: the host directory itself (the baseline),
//! a mount of `dir:STORE` at layer 0, and a mount of `dir:STORE | aead:keyfile=KEY | zstd` at
//! layer 2 (rows with the suffix `_stacked`, against the same host samples). Each mount is
//! `target/release/ubc mount … --budget 64` (the `ubc` binary next to this executable),
//! started as a child process, waited for in `/proc/self/mountinfo`, and stopped with
//! SIGTERM (the daemon syncs and must exit 0). Extra mount options come from the environment
//! variable `UBC_MOUNT_ARGS` (split on whitespace, appended), e.g. `--cache direct`; every
//! note says which were used.
//!
//! Rows (ratio > 1 means the mount is better):
//!
//! * `mount_randread_4k[_4j]`: fio `randread`, 4 KiB, `psync`, 1 (4, one shared file,
//!   `group_reporting`) jobs, time based, on a file laid out and read once beforehand
//!   (256 MiB, 64 MiB with `--quick`: 4x / 1x the budget). IOPS.
//! * `mount_seqread`: fio 1 MiB sequential reads of the same file, MB/s.
//! * `mount_mmap_randread`: fio `ioengine=mmap` 4 KiB random reads of the same file, IOPS.
//! * `mount_randwrite_4k`: fio 4 KiB random writes to the same file, `end_fsync=1`, IOPS.
//! * `mount_seqwrite`: fio 1 MiB sequential writes of a new file, `end_fsync=1`, MB/s (fio's
//!   runtime includes the final fsync).
//! * `mount_smallfiles`: create, stat, read (checked) and delete 10,000 files of 4 KiB (2,000
//!   with `--quick`), `std::fs`, files/s for the whole cycle.
//! * `mount_ram`: memory used to read a file twice the budget twice, as a multiple of the
//!   file's size (lower is better). Mount: growth of the daemon's `RssAnon` + the pages held
//!   by the daemon's memfds (`SEEK_DATA` over `/proc/PID/fd/*` links to `/memfd:`) + the
//!   store's files and the mounted file resident in the kernel's page cache (`mincore`; the
//!   mounted file's pages that are the stored file's own — FUSE passthrough — count once, by
//!   page frame number where /proc/self/pagemap gives them).
//!   Host: the file's pages resident in the page cache (`mincore`). Fresh mount, caches
//!   dropped (`drop_caches` as root, else `POSIX_FADV_DONTNEED`) before each sample; the
//!   note also gives the growth of `Cached:` in `/proc/meminfo` (noisy: other processes).
//! * Programs, timed end to end (seconds, lower is better; 1 run with `--quick`):
//!   `mount_tree` (extract a tarball of `/usr/lib/python3.*`, `diff -r` against the source,
//!   `rsync -a` a copy, `diff -r`, `rm -rf`), `mount_git` (`git init`, add 300 files,
//!   commit, modify 100, commit, `git fsck --full`, `git gc`), `mount_sqlite[_wal]` (python3's
//!   sqlite3: 200,000 inserts in 10 transactions, 20,000 updates in 4, integrity check; with
//!   a rollback journal and with WAL), `mount_append_read` (a thread appends 4 KiB records,
//!   fsync every 100, while another thread reads each record back as it arrives, checking
//!   it; 20,000 records). Every step checks its result and the row fails loudly otherwise.
//!
//! Every child command and every workload has a timeout (300 s, `UBC_MOUNT_TIMEOUT`): a hung mount fails the
//! benchmark with the daemon's threads' kernel stacks and its stderr, saved under
//! `<scratch>/../mount-logs/`. The mounts are unmounted in a drop guard whatever happens.

use super::Ctx;
use crate::report::{Better, Record, median};
use crate::util::*;
use serde_json::Value;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const BUDGET_MIB: u64 = 64;
/// The limit on every child command and workload; `UBC_MOUNT_TIMEOUT` (seconds) overrides.
fn timeout() -> Duration {
    Duration::from_secs(std::env::var("UBC_MOUNT_TIMEOUT").ok().and_then(|v| v.parse().ok()).unwrap_or(300))
}
const STACKED_TAIL: &str = " | aead:keyfile=KEY | zstd";

/// The running mounts, for the diagnosis of a hang: (name, daemon pid, stderr file).
static RUNNING: Mutex<Vec<(String, u32, PathBuf)>> = Mutex::new(Vec::new());
/// Where stderr files and hang reports go.
static LOGS: Mutex<Option<PathBuf>> = Mutex::new(None);

fn logs_dir() -> PathBuf {
    LOGS.lock().unwrap().clone().unwrap_or_else(|| PathBuf::from("."))
}

/// `UBC_MOUNT_ARGS`, split on whitespace.
fn extra_args() -> Vec<String> {
    std::env::var("UBC_MOUNT_ARGS").unwrap_or_default().split_whitespace().map(String::from).collect()
}

fn ubc_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().expect("exe dir").join("ubc")
}

/// Whether something is mounted at `mp` (canonical) per `/proc/self/mountinfo`.
fn is_mounted(mp: &Path) -> bool {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let want = mp.to_string_lossy().replace(' ', "\\040");
    table.lines().any(|l| l.split_whitespace().nth(4) == Some(want.as_str()))
}

/// What the daemon's threads are doing: state, wchan and kernel stack of every thread.
fn diagnose(pid: u32) -> String {
    let mut s = String::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return format!("(pid {pid}: no /proc entry)\n");
    };
    for t in tasks.flatten() {
        let p = t.path();
        let rd = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        let stat = rd("stat");
        let state = stat.rsplit_once(") ").map(|x| x.1.chars().next().unwrap_or('?')).unwrap_or('?');
        s += &format!(
            "  tid {} comm {} state {} wchan {}\n",
            t.file_name().to_string_lossy(),
            rd("comm").trim(),
            state,
            rd("wchan").trim()
        );
        for l in rd("stack").lines() {
            s += &format!("      {l}\n");
        }
    }
    s
}

/// The processes of process group `pgid` (a command and the children it forked: fio runs
/// each job in a process of its own).
fn group_members(pgid: u32) -> Vec<u32> {
    let mut v: Vec<u32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // Fields after the command: state ppid pgrp ...
            stat.rsplit_once(") ").and_then(|x| x.1.split_whitespace().nth(2)?.parse::<u32>().ok()) == Some(pgid)
        })
        .collect();
    v.sort();
    v
}

/// Fail loudly: the message, what every running mount is doing and the tail of its stderr,
/// also saved under the logs directory.
fn fail(msg: &str) -> ! {
    let mut report = format!("mount bench FAILED: {msg}\n");
    for (name, pid, err) in RUNNING.lock().unwrap().iter() {
        let e = std::fs::read_to_string(err).unwrap_or_default();
        let tail: Vec<&str> = e.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect();
        report += &format!("mount {name} (daemon pid {pid}, stderr {}):\n{}", err.display(), diagnose(*pid));
        report += &format!("  stderr tail:\n    {}\n", tail.join("\n    "));
    }
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let file = logs_dir().join(format!("failure-{stamp}.txt"));
    let _ = std::fs::write(&file, &report);
    panic!("{report}(saved to {})", file.display());
}

/// Run `f` on a thread of its own; fail (with a diagnosis) if it takes longer than `TIMEOUT`.
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let _ = tx.send(r);
    });
    match rx.recv_timeout(timeout()) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => fail(&format!("TIMEOUT: {what} did not finish in {} s (hung?)", timeout().as_secs())),
    }
}

/// Run a command in `cwd` with a timeout; its stdout, or a loud failure with its stderr.
/// Returns (seconds, stdout).
fn run_cmd(what: &str, cmd: &mut Command, cwd: &Path) -> (f64, String) {
    let logs = logs_dir();
    let out_path = logs.join("cmd.stdout");
    let err_path = logs.join("cmd.stderr");
    use std::os::unix::process::CommandExt;
    cmd.current_dir(cwd)
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"));
    let t = Instant::now();
    let mut child = cmd.spawn().unwrap_or_else(|e| fail(&format!("{what}: cannot start {cmd:?}: {e}")));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = match rx.recv_timeout(timeout()) {
        Ok(s) => s.expect("wait"),
        Err(_) => {
            let d: String = group_members(pid).into_iter().map(|p| format!("process {p}:\n{}", diagnose(p))).collect();
            // SAFETY: plain kill of our own child's process group.
            unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
            fail(&format!(
                "TIMEOUT: {what} ({cmd:?}) ran over {} s; the command's processes:\n{d}",
                timeout().as_secs()
            ))
        }
    };
    let secs = t.elapsed().as_secs_f64();
    let out = std::fs::read_to_string(&out_path).unwrap_or_default();
    if !status.success() {
        let err = std::fs::read_to_string(&err_path).unwrap_or_default();
        let o: String = out.chars().take(4000).collect();
        let e: String = err.chars().take(4000).collect();
        fail(&format!("{what}: {cmd:?} in {}: {status}\nstdout:\n{o}\nstderr:\n{e}", cwd.display()));
    }
    (secs, out)
}

/// One `ubc mount` daemon; unmounted and stopped on drop whatever happened.
struct Mount {
    name: String,
    child: Option<Child>,
    mp: PathBuf,
    store: PathBuf,
    err: PathBuf,
}

impl Mount {
    /// Mount `dir:BASE/store` (with the aead and zstd layers on top if `stacked`) at
    /// `BASE/mnt`.
    fn start(name: &str, base: &Path, stacked: bool, key: &Path) -> Mount {
        let (store, mp) = (base.join("store"), base.join("mnt"));
        std::fs::create_dir_all(&store).expect("store dir");
        std::fs::create_dir_all(&mp).expect("mount point");
        let (spec, layer) = mount_spec(&store, stacked, key);
        let err = logs_dir().join(format!("{name}.stderr"));
        let mut cmd = Command::new(ubc_bin());
        cmd.args(["mount", "--stack", &spec, "--budget", &BUDGET_MIB.to_string(), "--at"])
            .arg(format!("{layer}:{}", mp.display()))
            .args(extra_args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err).expect("stderr file"));
        let child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {} ({cmd:?}): {e}", ubc_bin().display()));
        RUNNING.lock().unwrap().push((name.into(), child.id(), err.clone()));
        let mut m = Mount { name: name.into(), child: Some(child), mp, store, err };
        let t = Instant::now();
        while !is_mounted(&m.mp) {
            if let Some(st) = m.child.as_mut().unwrap().try_wait().expect("try_wait") {
                fail(&format!("ubc mount {name} exited before mounting: {st}: {}", m.stderr()));
            }
            if t.elapsed() > Duration::from_secs(30) {
                fail(&format!("ubc mount {name}: the mount did not appear in 30 s"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        m
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// SIGTERM: the daemon syncs, unmounts and must exit 0 within the timeout.
    fn stop(mut self) {
        let mut child = self.child.take().unwrap();
        // SAFETY: plain kill of our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        let st = loop {
            if let Some(st) = child.try_wait().expect("try_wait") {
                break st;
            }
            if t.elapsed() > timeout() {
                self.child = Some(child);
                fail(&format!(
                    "TIMEOUT: ubc mount {} did not exit within {} s of SIGTERM",
                    self.name,
                    timeout().as_secs()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        RUNNING.lock().unwrap().retain(|r| r.0 != self.name);
        if !st.success() {
            fail(&format!("ubc mount {} exited with {st} after SIGTERM; stderr:\n{}", self.name, self.stderr()));
        }
        if is_mounted(&self.mp) {
            fail(&format!("ubc mount {} exited but {} is still mounted", self.name, self.mp.display()));
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if is_mounted(&self.mp) {
            let _ = Command::new("fusermount3").args(["-u", "-z", "-q"]).arg(&self.mp).status();
        }
        let Some(mut child) = self.child.take() else { return };
        // SAFETY: plain kill of our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        if let Ok(mut r) = RUNNING.lock() {
            r.retain(|x| x.0 != self.name);
        }
    }
}

/// The spec and the layer to mount.
fn mount_spec(store: &Path, stacked: bool, key: &Path) -> (String, usize) {
    if stacked {
        (format!("dir:{}{}", store.display(), STACKED_TAIL.replace("KEY", &key.display().to_string())), 2)
    } else {
        (format!("dir:{}", store.display()), 0)
    }
}

/// The mount command of a side, for notes.
fn mount_desc(stacked: bool) -> String {
    let (spec, at) = if stacked { (format!("dir:STORE{STACKED_TAIL}"), 2) } else { ("dir:STORE".into(), 0) };
    let extra = extra_args();
    format!(
        "ubc mount --stack '{spec}' --at {at}:MNT --budget {BUDGET_MIB}{}{}",
        if extra.is_empty() { "" } else { " " },
        extra.join(" ")
    )
}

/// Where one side works.
#[derive(Clone)]
struct Side {
    name: &'static str,
    dir: PathBuf,
}

/// Drop the kernel's page cache (root), else the file's own pages.
fn drop_caches(files: &[PathBuf]) -> &'static str {
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
    if std::fs::write("/proc/sys/vm/drop_caches", "3\n").is_ok() {
        return "drop_caches";
    }
    for f in files {
        drop_kernel_cache(f);
    }
    "POSIX_FADV_DONTNEED"
}

/// Read `path` front to back with 1 MiB reads; returns bytes read.
fn read_through(path: &Path) -> u64 {
    let f = std::fs::File::open(path).unwrap_or_else(|e| fail(&format!("open {}: {e}", path.display())));
    let mut buf = vec![0u8; 1 << 20];
    kernel_read_all(&f, &mut buf)
}

// ---- fio ----

/// Runs fio with `args` (plus `--output-format=json`) in `cwd`; returns its only job.
fn fio(what: &str, cwd: &Path, args: &[String]) -> Value {
    let mut cmd = Command::new("fio");
    cmd.args(args).arg("--output-format=json");
    let (_, out) = run_cmd(what, &mut cmd, cwd);
    let json = &out[out.find('{').unwrap_or_else(|| fail(&format!("{what}: no JSON from fio: {out}")))..];
    let v: Value = serde_json::from_str(json).unwrap_or_else(|e| fail(&format!("{what}: fio JSON: {e}: {out}")));
    let job = v["jobs"][0].clone();
    if job["error"].as_i64() != Some(0) {
        fail(&format!("{what}: fio job error {}: {json}", job["error"]));
    }
    job
}

struct FioRow {
    name: &'static str,
    metric: &'static str,
    /// fio options without the file name.
    opts: String,
    /// Read from the "read" or the "write" section; IOPS or MB/s.
    write: bool,
    iops: bool,
    /// A new file (removed after each sample) instead of the laid-out one.
    new_file: bool,
}

fn fio_rows(len: u64, secs: u64) -> Vec<FioRow> {
    let t = format!("--time_based --runtime={secs} --invalidate=0 --size={len}");
    let row = |name, metric, opts: String, write, iops, new_file| FioRow { name, metric, opts, write, iops, new_file };
    vec![
        row(
            "mount_randread_4k",
            "IOPS",
            format!("--rw=randread --bs=4k --ioengine=psync --numjobs=1 {t}"),
            false,
            true,
            false,
        ),
        row(
            "mount_randread_4k_4j",
            "IOPS",
            format!("--rw=randread --bs=4k --ioengine=psync --numjobs=4 --group_reporting {t}"),
            false,
            true,
            false,
        ),
        row(
            "mount_seqread",
            "MB/s",
            format!("--rw=read --bs=1m --ioengine=psync --numjobs=1 {t}"),
            false,
            false,
            false,
        ),
        row(
            "mount_mmap_randread",
            "IOPS",
            format!("--rw=randread --bs=4k --ioengine=mmap --numjobs=1 {t}"),
            false,
            true,
            false,
        ),
        row(
            "mount_randwrite_4k",
            "IOPS",
            format!("--rw=randwrite --bs=4k --ioengine=psync --numjobs=1 --end_fsync=1 {t}"),
            true,
            true,
            false,
        ),
        row(
            "mount_seqwrite",
            "MB/s",
            format!("--rw=write --bs=1m --ioengine=psync --numjobs=1 --end_fsync=1 --fallocate=none --size={len}"),
            true,
            false,
            true,
        ),
    ]
}

fn fio_sample(row: &FioRow, side: &Side, cwd: &Path) -> f64 {
    let file = side.dir.join(if row.new_file { "fio-new.dat" } else { "fio.dat" });
    let mut args = vec![format!("--name={}", row.name), format!("--filename={}", file.display())];
    args.extend(row.opts.split_whitespace().map(String::from));
    let job = fio(&format!("{} on {}", row.name, side.name), cwd, &args);
    let sec = &job[if row.write { "write" } else { "read" }];
    let v = if row.iops { sec["iops"].as_f64() } else { sec["bw_bytes"].as_f64().map(|b| b / 1e6) };
    let v = v.unwrap_or_else(|| fail(&format!("{} on {}: no iops/bw in fio output", row.name, side.name)));
    if sec["io_bytes"].as_u64().unwrap_or(0) == 0 {
        fail(&format!("{} on {}: fio moved no bytes", row.name, side.name));
    }
    if row.new_file {
        std::fs::remove_file(&file).unwrap_or_else(|e| fail(&format!("remove {}: {e}", file.display())));
    }
    v
}

// ---- Rust workloads ----

/// Create, stat, read and delete `n` files of 4 KiB in `dir/small`; seconds.
fn smallfiles(dir: &Path, n: usize) -> f64 {
    let d = dir.join("small");
    let dd = d.clone();
    let (secs, _) = time(|| {
        within("smallfiles", move || {
            let d = dd;
            std::fs::create_dir(&d).expect("mkdir small");
            let content = |i: usize| {
                let mut b = vec![(i % 251) as u8; 4096];
                b[..8].copy_from_slice(&(i as u64).to_le_bytes());
                b
            };
            for i in 0..n {
                std::fs::write(d.join(format!("f{i}")), content(i)).expect("create small file");
            }
            for i in 0..n {
                let m = std::fs::metadata(d.join(format!("f{i}"))).expect("stat small file");
                assert_eq!(m.len(), 4096, "size of f{i}");
            }
            for i in 0..n {
                let b = std::fs::read(d.join(format!("f{i}"))).expect("read small file");
                assert!(b == content(i), "content of f{i}");
            }
            for i in 0..n {
                std::fs::remove_file(d.join(format!("f{i}"))).expect("delete small file");
            }
            std::fs::remove_dir(&d).expect("rmdir small");
        })
    });
    secs
}

/// One thread appends `n` records of 4 KiB (fsync every 100) while another reads them back
/// as they arrive, checking each; seconds until the reader has all of them.
fn append_read(dir: &Path, n: u64) -> f64 {
    const REC: usize = 4096;
    let path = dir.join("append.log");
    let _ = std::fs::remove_file(&path);
    std::fs::File::create(&path).expect("create append file");
    let record = |i: u64| {
        let mut b = vec![(i % 253) as u8 + 1; REC];
        b[..8].copy_from_slice(&i.to_le_bytes());
        b
    };
    let p = path.clone();
    let secs = within("append_read", move || {
        let t = Instant::now();
        let pw = p.clone();
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new().append(true).open(&pw).expect("open for append");
            for i in 0..n {
                f.write_all(&record(i)).expect("append");
                if (i + 1) % 100 == 0 {
                    f.sync_data().expect("fsync");
                }
            }
            f.sync_data().expect("fsync");
        });
        let f = std::fs::File::open(&p).expect("open for reading");
        let mut buf = vec![0u8; REC];
        let (mut i, mut have) = (0u64, 0usize);
        while i < n {
            let got = f.read_at(&mut buf[have..], i * REC as u64 + have as u64).expect("read");
            if got == 0 {
                if writer.is_finished() && have == 0 && f.metadata().map_or(0, |m| m.len()) <= i * REC as u64 {
                    panic!("append_read: writer finished but record {i} never arrived");
                }
                std::thread::sleep(Duration::from_micros(50));
                continue;
            }
            have += got;
            if have == REC {
                assert!(buf == record(i), "append_read: record {i} read back wrong");
                i += 1;
                have = 0;
            }
        }
        let secs = t.elapsed().as_secs_f64();
        writer.join().expect("writer");
        secs
    });
    std::fs::remove_file(&path).unwrap_or_else(|e| fail(&format!("remove {}: {e}", path.display())));
    secs
}

// ---- programs ----

/// A real tree to copy: the largest `/usr/lib/python3*` (or another system tree).
fn tree_source() -> Option<PathBuf> {
    let mut c: Vec<PathBuf> = std::fs::read_dir("/usr/lib")
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("python3.")) && p.is_dir())
        .collect();
    c.sort();
    c.pop().or_else(|| ["/usr/include", "/usr/share/perl5"].iter().map(PathBuf::from).find(|p| p.is_dir()))
}

fn empty_dir(d: &Path) {
    let n = std::fs::read_dir(d).map(|r| r.count()).unwrap_or(usize::MAX);
    if n != 0 {
        fail(&format!("{} is not empty after rm -rf ({n} entries)", d.display()));
    }
}

fn tree(side: &Side, tarball: &Path, src: &Path, cwd: &Path) -> f64 {
    let d = side.dir.join("tree");
    std::fs::create_dir_all(&d).expect("tree dir");
    let top = src.file_name().unwrap();
    let (a, copy) = (d.join(top), d.join("copy"));
    let w = |s: &str| format!("mount_tree on {}: {s}", side.name);
    let t = Instant::now();
    run_cmd(&w("tar -x"), Command::new("tar").arg("-xf").arg(tarball).arg("-C").arg(&d), cwd);
    run_cmd(
        &w("diff -r against the source"),
        Command::new("diff").args(["-r", "--no-dereference"]).arg(src).arg(&a),
        cwd,
    );
    std::fs::create_dir(&copy).expect("copy dir");
    run_cmd(&w("rsync -a"), Command::new("rsync").arg("-a").arg(&a).arg(&copy), cwd);
    run_cmd(
        &w("diff -r of the copy"),
        Command::new("diff").args(["-r", "--no-dereference"]).arg(&a).arg(copy.join(top)),
        cwd,
    );
    run_cmd(&w("rm -rf"), Command::new("rm").arg("-rf").arg(&a).arg(&copy), cwd);
    let secs = t.elapsed().as_secs_f64();
    empty_dir(&d);
    std::fs::remove_dir(&d).expect("rmdir tree");
    secs
}

fn git(side: &Side, files: usize, cwd: &Path) -> f64 {
    let d = side.dir.join("repo");
    let w = |s: &str| format!("mount_git on {}: {s}", side.name);
    let g = |args: &[&str]| {
        let mut c = Command::new("git");
        c.arg("-C")
            .arg(&d)
            .args(["-c", "init.defaultBranch=main", "-c", "gc.auto=0"])
            .args(args)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_AUTHOR_NAME", "ubc-bench")
            .env("GIT_AUTHOR_EMAIL", "bench@ubc.invalid")
            .env("GIT_COMMITTER_NAME", "ubc-bench")
            .env("GIT_COMMITTER_EMAIL", "bench@ubc.invalid");
        c
    };
    let text = |i: usize, rev: usize| {
        (0..40 + i % 80).map(|l| format!("file {i} line {l} revision {rev}: the quick brown fox\n")).collect::<String>()
    };
    let t = Instant::now();
    std::fs::create_dir(&d).expect("repo dir");
    run_cmd(&w("git init"), &mut g(&["init", "-q"]), cwd);
    let dd = d.clone();
    within("mount_git: write files", move || {
        for i in 0..files {
            let sub = dd.join(format!("d{}", i % 10));
            std::fs::create_dir_all(&sub).expect("mkdir");
            std::fs::write(sub.join(format!("f{i}.txt")), text(i, 0)).expect("write file");
        }
    });
    run_cmd(&w("git add"), &mut g(&["add", "-A"]), cwd);
    run_cmd(&w("git commit"), &mut g(&["commit", "-q", "-m", "first"]), cwd);
    let dd = d.clone();
    within("mount_git: modify files", move || {
        for i in (0..files).step_by(files / 100).take(100) {
            std::fs::write(dd.join(format!("d{}", i % 10)).join(format!("f{i}.txt")), text(i, 1)).expect("modify");
        }
    });
    run_cmd(&w("git commit -a"), &mut g(&["commit", "-q", "-a", "-m", "second"]), cwd);
    run_cmd(&w("git fsck --full"), &mut g(&["fsck", "--full", "--no-progress"]), cwd);
    run_cmd(&w("git gc"), &mut g(&["gc", "-q"]), cwd);
    let secs = t.elapsed().as_secs_f64();
    let (_, count) = run_cmd(&w("git rev-list"), &mut g(&["rev-list", "--count", "HEAD"]), cwd);
    if count.trim() != "2" {
        fail(&w(&format!("expected 2 commits, git rev-list says {}", count.trim())));
    }
    let (_, st) = run_cmd(&w("git status"), &mut g(&["status", "--porcelain"]), cwd);
    if !st.trim().is_empty() {
        fail(&w(&format!("work tree not clean after the commits: {st}")));
    }
    let (_, changed) = run_cmd(&w("git diff --stat"), &mut g(&["diff", "--name-only", "HEAD~1", "HEAD"]), cwd);
    if changed.lines().count() != 100 {
        fail(&w(&format!("second commit changed {} files, not 100", changed.lines().count())));
    }
    std::fs::remove_dir_all(&d).unwrap_or_else(|e| fail(&w(&format!("rm -rf repo: {e}"))));
    secs
}

const SQLITE_PY: &str = r#"
import sqlite3, sys
path, mode, n, u = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
c = sqlite3.connect(path, isolation_level=None)
got = c.execute("PRAGMA journal_mode=" + mode).fetchone()[0]
assert got.lower() == mode.lower(), "journal_mode is " + got
c.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, k INTEGER, v TEXT)")
b = n // 10
for t in range(10):
    c.execute("BEGIN")
    c.executemany("INSERT INTO t VALUES (?, ?, ?)", ((i, i % 1000, "v%08d" % i * 8) for i in range(t * b, (t + 1) * b)))
    c.execute("COMMIT")
ub = u // 4
for t in range(4):
    c.execute("BEGIN")
    c.executemany("UPDATE t SET k = -1 WHERE id = ?", (((j * 7919) % n,) for j in range(t * ub, (t + 1) * ub)))
    c.execute("COMMIT")
rows = c.execute("SELECT count(*) FROM t").fetchone()[0]
upd = c.execute("SELECT count(*) FROM t WHERE k = -1").fetchone()[0]
ok = c.execute("PRAGMA integrity_check").fetchone()[0]
c.close()
assert rows == b * 10, "rows %d" % rows
assert upd == ub * 4, "updated %d" % upd
assert ok == "ok", ok
print("rows", rows, "updated", upd, ok)
"#;

fn sqlite(side: &Side, wal: bool, n: u64, u: u64, cwd: &Path) -> f64 {
    let db = side.dir.join("bench.db");
    let what = format!("mount_sqlite{} on {}", if wal { "_wal" } else { "" }, side.name);
    let mut c = Command::new("python3");
    c.arg("-c").arg(SQLITE_PY).arg(&db).arg(if wal { "wal" } else { "delete" }).arg(n.to_string()).arg(u.to_string());
    let (secs, out) = run_cmd(&what, &mut c, cwd);
    if !out.starts_with("rows ") {
        fail(&format!("{what}: unexpected output {out}"));
    }
    for f in ["bench.db", "bench.db-wal", "bench.db-shm", "bench.db-journal"] {
        let _ = std::fs::remove_file(side.dir.join(f));
    }
    secs
}

// ---- memory ----

/// A field of `/proc/PID/status` in bytes (the kB value × 1024).
fn status_kb(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix(key).and_then(|v| v.trim_start_matches(':').split_whitespace().next()?.parse().ok())
        })
        .map_or(0, |kb: u64| kb * 1024)
}

/// `Cached:` of /proc/meminfo in bytes.
fn meminfo_cached() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Cached:").and_then(|v| v.split_whitespace().next()?.parse().ok()))
        .map_or(0, |kb: u64| kb * 1024)
}

/// Bytes held by the daemon's memfds: the data extents (`SEEK_DATA`/`SEEK_HOLE`) of every
/// descriptor that is a memfd (each counted once per inode).
fn memfd_bytes(pid: u32) -> u64 {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::io::AsRawFd;
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return 0 };
    for fd in fds.flatten() {
        let Ok(link) = std::fs::read_link(fd.path()) else { continue };
        if !link.to_string_lossy().starts_with("/memfd:") {
            continue;
        }
        let Ok(f) = std::fs::File::open(fd.path()) else { continue };
        let Ok(m) = f.metadata() else { continue };
        if !seen.insert(m.ino()) {
            continue;
        }
        let (raw, len) = (f.as_raw_fd(), m.len() as i64);
        let mut off = 0i64;
        while off < len {
            // SAFETY: lseek on a descriptor we hold.
            let data = unsafe { libc::lseek(raw, off, libc::SEEK_DATA) };
            if data < 0 {
                break;
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(raw, data, libc::SEEK_HOLE) };
            if hole < 0 {
                break;
            }
            total += (hole - data) as u64;
            off = hole;
        }
    }
    total
}

/// Bytes of every regular file under `dir` resident in the kernel's page cache.
fn resident_under(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                total += kernel_resident(&e.path()).map_or(0, |(r, _)| r * sys_page() as u64);
            }
        }
    }
    total
}

struct RamSample {
    bytes: f64,
    cached_growth: f64,
    anon_growth: f64,
    memfd: f64,
    store_cached: f64,
    mount_cached: f64,
}

/// One sample of `mount_ram` on a fresh mount: the file is written through a mount that is
/// then stopped, so the daemon that reads it starts cold.
fn ram_mount(base: &Path, stacked: bool, key: &Path, len: u64) -> RamSample {
    let name = if stacked { "ram_stacked" } else { "ram_dir" };
    let _ = std::fs::remove_dir_all(base);
    let m = Mount::start(name, base, stacked, key);
    let path = m.mp.join("ram.dat");
    let p = path.clone();
    within("mount_ram: write the file", move || make_file(&p, len).expect("write ram.dat through the mount"));
    m.stop();
    let m = Mount::start(name, base, stacked, key);
    drop_caches(&[]);
    let pid = m.pid();
    let (anon0, cached0, memfd0) = (status_kb(pid, "RssAnon"), meminfo_cached(), memfd_bytes(pid));
    let p = path.clone();
    let got = within("mount_ram: read the file twice", move || read_through(&p) + read_through(&p));
    if got != 2 * len {
        fail(&format!("mount_ram: read {got} bytes of 2 x {len}"));
    }
    let anon = status_kb(pid, "RssAnon").saturating_sub(anon0) as f64;
    let cached = meminfo_cached() as f64 - cached0 as f64;
    let memfd = memfd_bytes(pid).saturating_sub(memfd0) as f64;
    let store_cached = resident_under(&m.store) as f64;
    let mut mount_cached = kernel_resident(&path).map_or(0, |(r, _)| r * sys_page() as u64) as f64;
    // A passed-through file maps the store's own pages: count the frames both hold once.
    let stored = m.store.join("ram.dat");
    if let (Some(a), Some(b)) = (resident_frames(&path), resident_frames(&stored)) {
        mount_cached = (a.difference(&b).count() * sys_page()) as f64;
    }
    m.stop();
    let _ = std::fs::remove_dir_all(base);
    RamSample {
        bytes: anon + memfd + store_cached + mount_cached,
        cached_growth: cached,
        anon_growth: anon,
        memfd,
        store_cached,
        mount_cached,
    }
}

fn ram_host(dir: &Path, len: u64) -> RamSample {
    let path = dir.join("ram.dat");
    make_file(&path, len).expect("write ram.dat");
    drop_caches(std::slice::from_ref(&path));
    let cached0 = meminfo_cached();
    let got = read_through(&path) + read_through(&path);
    assert_eq!(got, 2 * len);
    let cached = meminfo_cached() as f64 - cached0 as f64;
    let res = kernel_resident(&path).map_or(0, |(r, _)| r * sys_page() as u64) as f64;
    std::fs::remove_file(&path).expect("remove ram.dat");
    RamSample { bytes: res, cached_growth: cached, anon_growth: 0.0, memfd: 0.0, store_cached: res, mount_cached: 0.0 }
}

// ---- the benchmark ----

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let scratch = std::fs::canonicalize(&ctx.dir).unwrap_or_else(|_| ctx.dir.clone());
    let base = scratch.join("mount");
    let logs = scratch.parent().unwrap_or(&scratch).join("mount-logs");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("mount scratch dir");
    std::fs::create_dir_all(&logs).expect("mount logs dir");
    *LOGS.lock().unwrap() = Some(logs.clone());
    if !ubc_bin().exists() {
        eprintln!("   SKIP mount: {} is missing (build -p ubc-cli)", ubc_bin().display());
        return vec![];
    }
    if !Path::new("/dev/fuse").exists() || Command::new("fusermount3").arg("-V").output().is_err() {
        eprintln!("   SKIP mount: /dev/fuse or fusermount3 is missing");
        return vec![];
    }
    if Command::new("fio").arg("--version").output().is_err() {
        eprintln!("   SKIP mount: fio is missing (apt-get install fio)");
        return vec![];
    }
    let key = base.join("key");
    ubc_stack::encrypt::Key::generate().write_file(&key).expect("write key");
    // fio writes state files into its working directory: run it (and every command) here.
    let cwd = base.join("cwd");
    std::fs::create_dir_all(&cwd).expect("cwd");
    let host = Side { name: "host", dir: base.join("host") };
    std::fs::create_dir_all(&host.dir).expect("host dir");

    let len = ctx.scale(256 * MIB, 64 * MIB);
    let fio_secs = ctx.scale(8, 3);
    let prog_runs = if ctx.quick { 1 } else { ctx.runs };
    let host_fs = crate::util::file_system(&host.dir);
    let note_side = |stacked: bool| {
        format!(
            "{}; budget {BUDGET_MIB} MiB; host: {host_fs}; mount defaults: one mount, so {}, attr timeout 60 s, threads = max(cores, 4), unless UBC_MOUNT_ARGS says otherwise",
            mount_desc(stacked),
            if stacked {
                "--cache writeback (pages, writes not yet sent, attributes and names cached by the kernel)"
            } else {
                "--cache passthrough where the kernel and privilege allow (the kernel reads and writes the host files itself), else --cache writeback"
            }
        )
    };

    let mut out = vec![];
    // Fresh mounts for the RAM row first (a cold daemon each sample).
    {
        let file = 2 * BUDGET_MIB * MIB;
        let mut s: [Vec<RamSample>; 3] = Default::default();
        for _ in 0..ctx.runs.min(3) {
            s[0].push(ram_host(&host.dir, file));
            s[1].push(ram_mount(&base.join("ram-dir"), false, &key, file));
            s[2].push(ram_mount(&base.join("ram-stacked"), true, &key, file));
        }
        let f = file as f64;
        let med = |v: &[RamSample], g: fn(&RamSample) -> f64| median(&v.iter().map(g).collect::<Vec<_>>());
        let xs = |v: &[RamSample]| v.iter().map(|r| r.bytes / f).collect::<Vec<_>>();
        let mib = |b: f64| b / MIB as f64;
        for (i, stacked) in [(1, false), (2, true)] {
            let v = &s[i];
            let note = format!(
                "file {} MiB read twice (1 MiB reads) through a fresh mount after drop_caches; mount = growth of the daemon's RssAnon {:.1} MiB + its memfds' data {:.1} MiB + store files in the page cache {:.1} MiB + the mounted file in the page cache {:.1} MiB (medians); host = the file's pages in the page cache {:.1} MiB; growth of meminfo Cached (whole machine, includes shmem): mount {:.1} MiB, host {:.1} MiB; {}",
                file >> 20,
                mib(med(v, |r| r.anon_growth)),
                mib(med(v, |r| r.memfd)),
                mib(med(v, |r| r.store_cached)),
                mib(med(v, |r| r.mount_cached)),
                mib(med(&s[0], |r| r.bytes)),
                mib(med(v, |r| r.cached_growth)),
                mib(med(&s[0], |r| r.cached_growth)),
                note_side(stacked)
            );
            let name = if stacked { "mount_ram_stacked" } else { "mount_ram" };
            out.push(Record::from_samples(
                name,
                "x file size",
                Better::Lower,
                &xs(v),
                &xs(&s[0]),
                "host file system",
                &note,
            ));
        }
    }

    let dm = Mount::start("dir", &base.join("dir"), false, &key);
    let sm = Mount::start("stacked", &base.join("stacked"), true, &key);
    let sides =
        [host.clone(), Side { name: "ubc dir", dir: dm.mp.clone() }, Side { name: "ubc stacked", dir: sm.mp.clone() }];
    let mut push = |name: &str, metric: &str, better: Better, s: &[Vec<f64>; 3], note: &str| {
        out.push(Record::from_samples(
            name,
            metric,
            better,
            &s[1],
            &s[0],
            "host file system",
            &format!("{note}; {}", note_side(false)),
        ));
        out.push(Record::from_samples(
            &format!("{name}_stacked"),
            metric,
            better,
            &s[2],
            &s[0],
            "host file system",
            &format!("{note}; {}", note_side(true)),
        ));
    };

    // fio rows: a laid-out file, read once.
    for side in &sides {
        let p = side.dir.join("fio.dat");
        let p2 = p.clone();
        within("lay out fio.dat", move || {
            make_file(&p2, len).expect("lay out fio.dat");
            read_through(&p2)
        });
    }
    for row in fio_rows(len, fio_secs) {
        let s = per_side(ctx.runs, &sides, |side| fio_sample(&row, side, &cwd));
        let note = format!(
            "fio {} on {} MiB{}, file laid out and read once before",
            row.opts,
            len >> 20,
            if row.new_file { " (a new file each sample)" } else { "" }
        );
        push(row.name, row.metric, Better::Higher, &s, &note);
    }
    for side in &sides {
        std::fs::remove_file(side.dir.join("fio.dat")).unwrap_or_else(|e| fail(&format!("remove fio.dat: {e}")));
    }

    let nsmall = ctx.scale(10_000, 2_000) as usize;
    let s = per_side(ctx.runs, &sides, |side| nsmall as f64 / smallfiles(&side.dir, nsmall));
    push(
        "mount_smallfiles",
        "files/s",
        Better::Higher,
        &s,
        &format!(
            "{nsmall} files of 4 KiB in one directory: create+write, stat, read (checked), delete, std::fs, 1 thread"
        ),
    );

    let nrec = ctx.scale(20_000, 5_000);
    let s = per_side(ctx.runs, &sides, |side| nrec as f64 / append_read(&side.dir, nrec));
    push(
        "mount_append_read",
        "records/s",
        Better::Higher,
        &s,
        &format!(
            "{nrec} records of 4 KiB ({} MiB) appended by one thread (O_APPEND, fdatasync every 100) and read back, checked, by another thread with its own descriptor as they arrive",
            (nrec * 4096) >> 20
        ),
    );

    // Programs.
    if let Some(src) = tree_source() {
        let tarball = base.join("tree.tar");
        run_cmd(
            "make the tarball",
            Command::new("tar")
                .arg("-cf")
                .arg(&tarball)
                .arg("-C")
                .arg(src.parent().unwrap())
                .arg(src.file_name().unwrap()),
            &cwd,
        );
        let tar_mib = std::fs::metadata(&tarball).map_or(0, |m| m.len() >> 20);
        let s = per_side(prog_runs, &sides, |side| tree(side, &tarball, &src, &cwd));
        push(
            "mount_tree",
            "s",
            Better::Lower,
            &s,
            &format!(
                "tar -xf of {} ({tar_mib} MiB tarball), diff -r --no-dereference against the source, rsync -a a copy, diff -r, rm -rf; end to end",
                src.display()
            ),
        );
        let _ = std::fs::remove_file(&tarball);
    } else {
        eprintln!("   SKIP mount_tree: no /usr/lib/python3.* or other tree to copy");
    }

    let gitfiles = 300;
    let s = per_side(prog_runs, &sides, |side| git(side, gitfiles, &cwd));
    push(
        "mount_git",
        "s",
        Better::Lower,
        &s,
        &format!(
            "git init, write {gitfiles} files (2-8 KiB), add, commit, modify 100, commit -a, fsck --full, gc; end to end"
        ),
    );

    let (n, u) = (ctx.scale(200_000, 50_000), ctx.scale(20_000, 5_000));
    for wal in [false, true] {
        let s = per_side(prog_runs, &sides, |side| sqlite(side, wal, n, u, &cwd));
        push(
            if wal { "mount_sqlite_wal" } else { "mount_sqlite" },
            "s",
            Better::Lower,
            &s,
            &format!(
                "python3 sqlite3: {n} inserts in 10 transactions, {u} updates in 4, integrity_check; journal_mode={}; end to end",
                if wal { "WAL" } else { "DELETE" }
            ),
        );
    }

    dm.stop();
    sm.stop();
    let _ = std::fs::remove_dir_all(&base);
    out
}

/// `runs` samples of `f` on each side (host, dir mount, stacked mount), in alternation.
fn per_side(runs: usize, sides: &[Side], mut f: impl FnMut(&Side) -> f64) -> [Vec<f64>; 3] {
    let mut s: [Vec<f64>; 3] = Default::default();
    for _ in 0..runs {
        for (i, side) in sides.iter().enumerate() {
            s[i].push(f(side));
        }
    }
    s
}

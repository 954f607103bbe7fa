//! `ubc-soak`: the soak driver behind `scripts/soak`.
//!
//! Drives stacks through the FUSE mount (`ubc mount`) and through the library (`ubc_stack`)
//! with write patterns that stress stacked writeback (nested write-backs under memory
//! pressure), verifies every byte against a model after a fresh mount (or a fresh `Stack::open`), and turns a stall (a worker
//! without progress for `--stall-secs`) into a failure with every thread's stack dumped by
//! gdb.
//!
//! Structure: `ubc-soak run` (the orchestrator) runs each case in a child process
//! (`ubc-soak case …`, its own process group, which also holds `ubc mount`, fio and the
//! library worker processes). Workers count their progress in a small shared file
//! (`progress`): counters, plus pids whose `/proc/PID/io` counts as progress (fio, and
//! `ubc mount` while it syncs at unmount). The orchestrator watches it; on a stall it runs
//! `gdb -p PID -batch -ex 'thread apply all bt'` on the dump pids the case registered (the
//! `ubc mount` process, or the case process itself for the library), writes the stacks to a
//! file, prints a summary (frames by ubc function), kills the case's process group and
//! lazily unmounts what it left. So a hang is a failure within seconds, never a stuck run.
//!
//! Content model: a block written with generation `g` at offset `o` holds the 12-byte unit
//! `g (u32 big-endian) ++ o (u64 little-endian)` repeated from the block's start — the bytes
//! fio writes for `--verify=pattern --verify_pattern=0xGGGGGGGG%o`, so fio's writes and
//! ours share one model. Generation 0 is a hole (zeros).

use clap::{Parser, Subcommand};
use std::collections::HashMap;
use std::fs::File as HostFile;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};
use ubc_cli::mounts;

type R<T> = Result<T, String>;

trait Ctx<T> {
    fn ctx(self, what: impl std::fmt::Display) -> R<T>;
}
impl<T, E: std::fmt::Display> Ctx<T> for Result<T, E> {
    fn ctx(self, what: impl std::fmt::Display) -> R<T> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

const BS4K: u64 = 4096;
const MIB: u64 = 1 << 20;

// ---------------------------------------------------------------------------------------
// Command line

#[derive(Parser)]
#[command(name = "ubc-soak", about = "Soak ubc stacks through the mount and the library (see scripts/soak)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the matrix of cases and print the table
    Run(RunArgs),
    /// One case (internal: run by `run` in a child process)
    #[command(hide = true)]
    Case(CaseArgs),
    /// One library writer process (internal: run by a `rand4k-procs` library case)
    #[command(hide = true)]
    LibWorker(LibWorkerArgs),
    /// Summarize a file of gdb stacks (`thread apply all bt`) as a stall does
    Summarize { file: PathBuf },
}

/// Later options replace earlier ones (`scripts/soak --quick --budgets 64` overrides the
/// quick run's budget).
#[derive(clap::Args, Clone)]
#[command(args_override_self = true)]
struct RunArgs {
    /// Stacks, comma-separated: dir, dir|zstd, dir|aead, dir|aead|zstd, dir|zstd|aead, union
    #[arg(long, default_value = "dir,dir|zstd,dir|aead,dir|aead|zstd,dir|zstd|aead,union")]
    stacks: String,
    /// Cache budgets in MiB, comma-separated
    #[arg(long, default_value = "16,64,1024")]
    budgets: String,
    /// Huge pages for every cache of the run (mounts and the library): never, try, require
    #[arg(long, default_value = "never")]
    huge_pages: String,
    /// Patterns, comma-separated: rand4k-threads, rand4k-procs, seq1m-fsync, mixed, two-mounts
    #[arg(long, default_value = "rand4k-threads,rand4k-procs,seq1m-fsync,mixed,two-mounts")]
    patterns: String,
    /// Front ends, comma-separated: mount, lib
    #[arg(long, default_value = "mount,lib")]
    frontends: String,
    /// Cap on the random-write file (8x budget) and the sequential write (16x budget), MiB
    #[arg(long, default_value_t = 2048)]
    max_file_mib: u64,
    /// Cap on the two-mounts file (default: --max-file-mib); reading the bottom layer
    /// throughout makes the top's writes slow (each read writes the top's dirty data down)
    #[arg(long)]
    max_two_mounts_mib: Option<u64>,
    /// Cap on each of the 4 files of the mixed pattern (the model is held in memory), MiB
    #[arg(long, default_value_t = 64)]
    max_mixed_mib: u64,
    /// Stop starting cases after this many minutes (0: no limit)
    #[arg(long, default_value_t = 0)]
    minutes: u64,
    /// A worker without progress for this long is a stall
    #[arg(long, default_value_t = 10)]
    stall_secs: u64,
    /// Rounds of fio random writes (each a full pass of the file)
    #[arg(long, default_value_t = 2)]
    fio_rounds: u32,
    /// Operations of the mixed pattern per thread
    #[arg(long, default_value_t = 3000)]
    mixed_ops: u64,
    /// Working directory (default: $TMPDIR/ubc-soak-PID); kept when a case fails
    #[arg(long)]
    work: Option<PathBuf>,
    /// The `ubc` binary (default: next to this one)
    #[arg(long)]
    ubc: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(clap::Args, Clone, Debug)]
struct CaseArgs {
    #[arg(long)]
    stack: String,
    #[arg(long)]
    budget: u64,
    #[arg(long, default_value = "never")]
    huge_pages: String,
    #[arg(long)]
    pattern: String,
    #[arg(long)]
    frontend: String,
    /// File size for random writes / sequential write size, bytes
    #[arg(long)]
    size: u64,
    #[arg(long)]
    mixed_size: u64,
    #[arg(long)]
    mixed_ops: u64,
    #[arg(long)]
    fio_rounds: u32,
    #[arg(long)]
    dir: PathBuf,
    #[arg(long)]
    ubc: PathBuf,
    #[arg(long)]
    seed: u64,
}

#[derive(clap::Args, Clone, Debug)]
struct LibWorkerArgs {
    #[arg(long)]
    spec: String,
    #[arg(long)]
    budget: u64,
    #[arg(long, default_value = "never")]
    huge_pages: String,
    #[arg(long)]
    file: String,
    #[arg(long)]
    size: u64,
    #[arg(long)]
    seed: u64,
    #[arg(long)]
    ops: u64,
    #[arg(long)]
    progress: PathBuf,
    #[arg(long)]
    slot: usize,
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Run(a) => run(a),
        Cmd::Case(a) => case_main(a),
        Cmd::Summarize { file } => {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            print_summary(&text);
            0
        }
        Cmd::LibWorker(a) => match lib_worker(a) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("lib-worker: {e}");
                1
            }
        },
    };
    std::process::exit(code);
}

// ---------------------------------------------------------------------------------------
// Content model

struct Rng(u64);
impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

/// The bytes of a block of generation `generation` at `block_off` (fio's `0xGGGGGGGG%o`).
fn fill_pattern(buf: &mut [u8], generation: u32, block_off: u64) {
    if generation == 0 {
        buf.fill(0);
        return;
    }
    let mut unit = [0u8; 12];
    unit[..4].copy_from_slice(&generation.to_be_bytes());
    unit[4..].copy_from_slice(&block_off.to_le_bytes());
    for (i, b) in buf.iter_mut().enumerate() {
        *b = unit[i % 12];
    }
}

/// Expected content of one file.
enum Model {
    /// Fixed-size blocks, each of the generation given (0: zeros); `len` bytes long.
    Blocks { bs: u64, gens: Vec<u32>, len: u64 },
    /// Every byte.
    Bytes(Vec<u8>),
}

impl Model {
    fn len(&self) -> u64 {
        match self {
            Model::Blocks { len, .. } => *len,
            Model::Bytes(v) => v.len() as u64,
        }
    }
    /// Expected bytes at `off..off+out.len()` (within `len`).
    fn expected(&self, out: &mut [u8], off: u64) {
        match self {
            Model::Bytes(v) => out.copy_from_slice(&v[off as usize..off as usize + out.len()]),
            Model::Blocks { bs, gens, .. } => {
                let mut blk = vec![0u8; *bs as usize];
                let mut done = 0usize;
                while done < out.len() {
                    let o = off + done as u64;
                    let b = o / bs;
                    fill_pattern(&mut blk, gens.get(b as usize).copied().unwrap_or(0), b * bs);
                    let inb = (o % bs) as usize;
                    let n = (*bs as usize - inb).min(out.len() - done);
                    out[done..done + n].copy_from_slice(&blk[inb..inb + n]);
                    done += n;
                }
            }
        }
    }
}

/// The random 4 KiB writer `t` of `nt` over `nblocks` blocks: which blocks it writes with
/// which generations, deterministically from the seed. Writer `t` owns the blocks `b` with
/// `b % nt == t`, so concurrent writers never overlap and the final content is exact.
fn rand_plan(seed: u64, t: u64, nt: u64, nblocks: u64, ops: u64, mut each: impl FnMut(u64, u32) -> bool) {
    let mine = (nblocks + nt - 1 - t) / nt;
    if mine == 0 {
        return;
    }
    let mut rng = Rng::new(seed.wrapping_mul(1_000_003) ^ t);
    for i in 0..ops {
        let b = t + nt * rng.below(mine);
        let g = (i * nt + t + 1) as u32;
        if !each(b, g) {
            return;
        }
    }
}

fn rand_model(seed: u64, nt: u64, size: u64, ops_per_thread: u64) -> Model {
    let nblocks = size / BS4K;
    let mut gens = vec![0u32; nblocks as usize];
    for t in 0..nt {
        rand_plan(seed, t, nt, nblocks, ops_per_thread, |b, g| {
            gens[b as usize] = g;
            true
        });
    }
    Model::Blocks { bs: BS4K, gens, len: size }
}

// ---------------------------------------------------------------------------------------
// Progress: a shared 4 KiB file of u64 words.
//   [0]       number of dump pids, [1..9) dump pids
//   [9]       next counter slot to hand out
//   [10]      the server: `ubc mount`, or the case process for the library. A worker is
//             stalled only while the server writes nothing too (a long fsync or final sync
//             is the server writing back, not a stall)
//   [16..48)  pid workers (0: none): bytes they (and their children) write are progress
//   [64..512) counters: 0 unused, DONE finished, else 1 + progress

const DUMP0: usize = 1;
const NEXT_SLOT: usize = 9;
const SERVER: usize = 10;
const PID0: usize = 16;
const PIDN: usize = 48;
const SLOT0: usize = 64;
const SLOTN: usize = 512;
const DONE: u64 = u64::MAX;

#[derive(Clone)]
struct Progress {
    ptr: *mut AtomicU64,
    _file: Arc<HostFile>,
}
// SAFETY: `ptr` points into a shared mapping that lives as long as `_file` (unmapped never);
// it is only accessed through `AtomicU64`s, which are safe to share between threads.
unsafe impl Send for Progress {}
// SAFETY: as for Send: every access is atomic.
unsafe impl Sync for Progress {}

impl Progress {
    fn open(path: &Path, create: bool) -> R<Progress> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(create)
            .open(path)
            .ctx(path.display())?;
        f.set_len(4096).ctx("progress set_len")?;
        use std::os::fd::AsRawFd;
        // SAFETY: a new shared mapping of our own 4 KiB file at a kernel-chosen address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err("mmap progress".into());
        }
        Ok(Progress { ptr: p as *mut AtomicU64, _file: Arc::new(f) })
    }
    fn w(&self, i: usize) -> &AtomicU64 {
        assert!(i < 512);
        // SAFETY: `i < 512` and the mapping holds 512 u64s (4 KiB), aligned (page-aligned).
        unsafe { &*self.ptr.add(i) }
    }
    /// A new counter (for a worker of this process, or handed to a worker process).
    fn slot(&self) -> Counter {
        let i = SLOT0 + self.w(NEXT_SLOT).fetch_add(1, SeqCst) as usize;
        assert!(i < SLOTN, "out of progress slots");
        self.w(i).store(1, SeqCst);
        Counter { p: self.clone(), i }
    }
    fn counter_at(&self, i: usize) -> Counter {
        self.w(i).store(1, SeqCst);
        Counter { p: self.clone(), i }
    }
    fn set_dump_pids(&self, pids: &[u32]) {
        for (k, p) in pids.iter().take(8).enumerate() {
            self.w(DUMP0 + k).store(*p as u64, SeqCst);
        }
        self.w(0).store(pids.len().min(8) as u64, SeqCst);
    }
    fn dump_pids(&self) -> Vec<u32> {
        (0..self.w(0).load(SeqCst) as usize).map(|k| self.w(DUMP0 + k).load(SeqCst) as u32).collect()
    }
    /// Watch `pid`'s I/O as progress until the guard drops.
    fn watch_pid(&self, pid: u32) -> PidGuard {
        for i in PID0..PIDN {
            if self.w(i).compare_exchange(0, pid as u64, SeqCst, SeqCst).is_ok() {
                return PidGuard { p: self.clone(), i };
            }
        }
        panic!("out of pid slots");
    }
}

struct PidGuard {
    p: Progress,
    i: usize,
}
impl Drop for PidGuard {
    fn drop(&mut self) {
        self.p.w(self.i).store(0, SeqCst);
    }
}

struct Counter {
    p: Progress,
    i: usize,
}
impl Counter {
    fn tick(&self) {
        self.p.w(self.i).fetch_add(1, SeqCst);
    }
}
impl Drop for Counter {
    fn drop(&mut self) {
        self.p.w(self.i).store(DONE, SeqCst);
    }
}

fn proc_io(pid: u32) -> Option<u64> {
    proc_io_field(pid, "wchar: ")
}

/// Bytes a process sent to storage (`write_bytes`: not its replies to /dev/fuse).
fn proc_stored(pid: u32) -> Option<u64> {
    let mut t = proc_io_field(pid, "write_bytes: ")?;
    for c in children(pid) {
        t += proc_io_field(c, "write_bytes: ").unwrap_or(0);
    }
    Some(t)
}

fn proc_io_field(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    let mut t = 0u64;
    for l in s.lines() {
        // Bytes written only: fio's main thread keeps reading (status files) while its jobs
        // are stuck, and a pid is watched only while it should be writing.
        if let Some(v) = l.strip_prefix(field) {
            t += v.trim().parse::<u64>().unwrap_or(0);
        }
    }
    Some(t)
}

fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in rd.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|x| x.parse::<u32>().ok()));
            }
        }
    }
    out
}

/// Bytes written by `pid` and its children (fio's job processes), or None when `pid` is gone.
fn tree_io(pid: u32) -> Option<u64> {
    let mut t = proc_io(pid)?;
    for c in children(pid) {
        t += proc_io(c).unwrap_or(0);
    }
    Some(t)
}

// ---------------------------------------------------------------------------------------
// Stacks, mounts

struct Layout {
    data: PathBuf,
    upper: PathBuf,
    key: PathBuf,
}

fn spec_of(stack: &str, l: &Layout) -> R<(String, usize)> {
    let d = l.data.display();
    let k = l.key.display();
    let s = match stack.replace(' ', "").as_str() {
        "dir" => (format!("dir:{d}"), 1),
        "dir|zstd" => (format!("dir:{d} | zstd"), 2),
        "dir|aead" => (format!("dir:{d} | aead:keyfile={k}"), 2),
        "dir|aead|zstd" => (format!("dir:{d} | aead:keyfile={k} | zstd"), 3),
        "dir|zstd|aead" => (format!("dir:{d} | zstd | aead:keyfile={k}"), 3),
        "union" => (format!("dir:{d} | union:upper={}", l.upper.display()), 2),
        other => {
            return Err(format!(
                "unknown stack `{other}` (dir, dir|zstd, dir|aead, dir|aead|zstd, dir|zstd|aead, union)"
            ));
        }
    };
    Ok(s)
}

struct Mount {
    child: Option<Child>,
    mps: Vec<PathBuf>,
}

impl Mount {
    fn start(c: &CaseArgs, spec: &str, ats: &[(usize, PathBuf)], prog: &Progress, log: &Path) -> R<Mount> {
        let mut cmd = Command::new(&c.ubc);
        cmd.args(["mount", "--stack", spec, "--budget", &c.budget.to_string(), "--huge-pages", &c.huge_pages]);
        for (n, mp) in ats {
            std::fs::create_dir_all(mp).ctx(mp.display())?;
            cmd.arg("--at").arg(format!("{n}:{}", mp.display()));
        }
        let logf = std::fs::OpenOptions::new().create(true).append(true).open(log).ctx(log.display())?;
        cmd.stdin(Stdio::null()).stdout(logf.try_clone().ctx("log")?).stderr(logf);
        let mut child = cmd.spawn().ctx("spawn ubc mount")?;
        prog.set_dump_pids(&[child.id()]);
        prog.w(SERVER).store(child.id() as u64, SeqCst);
        let t0 = Instant::now();
        while !ats.iter().all(|(_, mp)| mounts::is_mounted(mp)) {
            if let Some(st) = child.try_wait().ctx("wait")? {
                return Err(format!("ubc mount exited early: {st} (see {})", log.display()));
            }
            if t0.elapsed() > Duration::from_secs(30) {
                let _ = child.kill();
                return Err("mounts did not appear in 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Mount { child: Some(child), mps: ats.iter().map(|(_, m)| m.clone()).collect() })
    }

    /// `fusermount3 -u` every mount point and wait for `ubc mount` to sync and exit 0; its
    /// I/O counts as progress meanwhile (a hang in the final sync is a stall).
    fn stop(mut self, prog: &Progress) -> R<()> {
        let mut child = self.child.take().unwrap();
        let _g = prog.watch_pid(child.id());
        for mp in &self.mps {
            let mut tries = 0;
            loop {
                let out = Command::new("fusermount3").arg("-u").arg(mp).output();
                if out.as_ref().is_ok_and(|o| o.status.success()) {
                    break;
                }
                tries += 1;
                if tries > 50 {
                    let why = match out {
                        Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                        Err(e) => e.to_string(),
                    };
                    self.child = Some(child); // Drop unmounts lazily, kills and waits
                    return Err(format!("fusermount3 -u {}: {why}", mp.display()));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let st = child.wait().ctx("wait ubc mount")?;
        if !st.success() {
            return Err(format!("ubc mount exited with {st} after unmount"));
        }
        Ok(())
    }
}

impl Mount {
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            for mp in &self.mps {
                let _ = Command::new("fusermount3").arg("-u").arg("-z").arg(mp).stderr(Stdio::null()).status();
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------
// File access, the same for the mount (host files) and the library (stack files)

trait Io: Sync {
    fn pwrite(&self, buf: &[u8], off: u64) -> R<()>;
    fn pread(&self, buf: &mut [u8], off: u64) -> R<usize>;
    fn truncate(&self, len: u64) -> R<()>;
    fn length(&self) -> R<u64>;
    fn fsync(&self) -> R<()>;
    /// Store `data` at page-aligned `off` through a shared writable mapping, then flush it.
    fn map_store(&self, data: &[u8], off: u64) -> R<()>;
}

impl Io for HostFile {
    fn pwrite(&self, buf: &[u8], off: u64) -> R<()> {
        self.write_all_at(buf, off).ctx(format!("pwrite {} @{off}", buf.len()))
    }
    fn pread(&self, buf: &mut [u8], off: u64) -> R<usize> {
        let mut n = 0;
        while n < buf.len() {
            let k = self.read_at(&mut buf[n..], off + n as u64).ctx(format!("pread @{}", off + n as u64))?;
            if k == 0 {
                break;
            }
            n += k;
        }
        Ok(n)
    }
    fn truncate(&self, len: u64) -> R<()> {
        self.set_len(len).ctx(format!("ftruncate {len}"))
    }
    fn length(&self) -> R<u64> {
        Ok(self.metadata().ctx("fstat")?.len())
    }
    fn fsync(&self) -> R<()> {
        self.sync_all().ctx("fsync")
    }
    fn map_store(&self, data: &[u8], off: u64) -> R<()> {
        use std::os::fd::AsRawFd;
        let len = data.len();
        // SAFETY: a new shared mapping of this file (fresh address, aliases nothing), written
        // only within its `len` bytes and unmapped before returning.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.as_raw_fd(),
                off as i64,
            );
            if p == libc::MAP_FAILED {
                return Err(format!("mmap {len} @{off}: {}", std::io::Error::last_os_error()));
            }
            std::ptr::copy_nonoverlapping(data.as_ptr(), p as *mut u8, len);
            let r = libc::msync(p, len, libc::MS_SYNC);
            let e = std::io::Error::last_os_error();
            libc::munmap(p, len);
            if r != 0 {
                return Err(format!("msync: {e}"));
            }
        }
        Ok(())
    }
}

impl Io for ubc_stack::File {
    fn pwrite(&self, buf: &[u8], off: u64) -> R<()> {
        let mut n = 0;
        while n < buf.len() {
            n += self.write_at(&buf[n..], off + n as u64).ctx(format!("write_at @{}", off + n as u64))?;
        }
        Ok(())
    }
    fn pread(&self, buf: &mut [u8], off: u64) -> R<usize> {
        let mut n = 0;
        while n < buf.len() {
            let k = self.read_at(&mut buf[n..], off + n as u64).ctx(format!("read_at @{}", off + n as u64))?;
            if k == 0 {
                break;
            }
            n += k;
        }
        Ok(n)
    }
    fn truncate(&self, len: u64) -> R<()> {
        self.set_len(len).ctx(format!("set_len {len}"))
    }
    fn length(&self) -> R<u64> {
        self.len().ctx("len")
    }
    fn fsync(&self) -> R<()> {
        self.sync().ctx("sync")
    }
    fn map_store(&self, data: &[u8], off: u64) -> R<()> {
        let mut m = self
            .map(off..off + data.len() as u64, ubc::Access::ReadWrite, ubc::Sharing::Shared)
            .ctx(format!("map @{off}"))?;
        m[..].copy_from_slice(data);
        m.flush().ctx("mapping flush")
    }
}

/// Compare a file with its model; differing bytes (a length difference counts its bytes).
fn verify(f: &dyn Io, model: &Model, ctr: &Counter) -> R<(u64, u64)> {
    let flen = f.length()?;
    let mlen = model.len();
    let mut diff = flen.abs_diff(mlen);
    let n = flen.min(mlen);
    let mut got = vec![0u8; MIB as usize];
    let mut want = vec![0u8; MIB as usize];
    let mut off = 0;
    let mut first: Option<u64> = None;
    while off < n {
        let k = (n - off).min(MIB) as usize;
        let r = f.pread(&mut got[..k], off)?;
        model.expected(&mut want[..k], off);
        for i in 0..k {
            if i >= r || got[i] != want[i] {
                diff += 1;
                first.get_or_insert(off + i as u64);
            }
        }
        off += k as u64;
        ctr.tick();
    }
    if let Some(o) = first {
        eprintln!("verify: first differing byte at offset {o} (file {flen} bytes, model {mlen})");
    } else if flen != mlen {
        eprintln!("verify: length {flen}, model {mlen}");
    }
    Ok((diff, n))
}

// ---------------------------------------------------------------------------------------
// One case (child process)

#[derive(Default)]
struct Outcome {
    ops: u64,
    bytes: u64,
    secs: f64,
    diff: u64,
    note: String,
}

fn case_main(c: CaseArgs) -> i32 {
    let prog = match Progress::open(&c.dir.join("progress"), false) {
        Ok(p) => p,
        Err(e) => {
            println!("SOAK-RESULT error={e}");
            return 1;
        }
    };
    match case(&c, &prog) {
        Ok(o) => {
            println!("SOAK-RESULT ops={} bytes={} secs={:.3} diff={} note={}", o.ops, o.bytes, o.secs, o.diff, o.note);
            0
        }
        Err(e) => {
            println!("SOAK-RESULT error={}", e.replace('\n', " "));
            1
        }
    }
}

fn case(c: &CaseArgs, prog: &Progress) -> R<Outcome> {
    let l = Layout { data: c.dir.join("data"), upper: c.dir.join("upper"), key: c.dir.join("key") };
    std::fs::create_dir_all(&l.data).ctx("mkdir data")?;
    std::fs::create_dir_all(&l.upper).ctx("mkdir upper")?;
    let st = Command::new(&c.ubc).arg("keygen").arg(&l.key).status().ctx("ubc keygen")?;
    if !st.success() {
        return Err("ubc keygen failed".into());
    }
    let (spec, depth) = spec_of(&c.stack, &l)?;
    let top = depth - 1;
    let log = c.dir.join("mount.log");
    let mt = c.dir.join("mnt-top");
    let m0 = c.dir.join("mnt-0");

    // Write phase: returns the files' models and the counts.
    let (models, mut out): (Vec<(String, Model)>, Outcome) = match c.frontend.as_str() {
        "mount" => {
            let ats: Vec<(usize, PathBuf)> = if c.pattern == "two-mounts" {
                vec![(top, mt.clone()), (0, m0.clone())]
            } else {
                vec![(top, mt.clone())]
            };
            if c.pattern == "two-mounts" && depth < 2 {
                return Err("two-mounts needs a stack of two layers or more".into());
            }
            let mut m = Mount::start(c, &spec, &ats, prog, &log)?;
            // An error with the mount gone (ENOTCONN) says how `ubc mount` ended.
            let r = mount_pattern(c, prog, &mt, &m0).map_err(|e| match m.exited() {
                Some(st) => format!("{e}; ubc mount had exited: {st} (log: {})", log.display()),
                None => e,
            })?;
            m.stop(prog)?;
            r
        }
        "lib" => {
            prog.set_dump_pids(&[std::process::id()]);
            prog.w(SERVER).store(std::process::id() as u64, SeqCst);
            lib_pattern(c, prog, &spec)?
        }
        other => return Err(format!("unknown front end {other}")),
    };

    // Self-test of the checker: UBC_SOAK_SELFTEST_CORRUPT=1 makes the model wrong in its
    // first block (4 KiB or 1 MiB) or byte: the case must then fail with that many bytes.
    let mut models = models;
    if std::env::var_os("UBC_SOAK_SELFTEST_CORRUPT").is_some() {
        match models.first_mut() {
            Some((_, Model::Blocks { gens, .. })) if !gens.is_empty() => gens[0] = gens[0].wrapping_add(7),
            Some((_, Model::Bytes(v))) if !v.is_empty() => v[0] ^= 0xff,
            _ => {}
        }
    }
    // Verify after a fresh mount / a fresh stack.
    let ctr = prog.slot();
    let mut checked = 0;
    match c.frontend.as_str() {
        "mount" => {
            let m = Mount::start(c, &spec, &[(top, mt.clone())], prog, &log)?;
            for (name, model) in &models {
                let f = HostFile::open(mt.join(name)).ctx(format!("open {name} after remount"))?;
                let (d, n) = verify(&f, model, &ctr)?;
                out.diff += d;
                checked += n;
            }
            m.stop(prog)?;
        }
        _ => {
            let cache = soak_cache(c.budget, &c.huge_pages)?;
            let stack = ubc_stack::Stack::open(&spec, cache).ctx("reopen stack")?;
            for (name, model) in &models {
                let f = stack.top().open(name).ctx(format!("open {name} after reopen"))?;
                let (d, n) = verify(&f, model, &ctr)?;
                out.diff += d;
                checked += n;
            }
        }
    }
    out.note = format!("{}verified {} MiB", out.note, checked >> 20);
    Ok(out)
}

/// Random 4 KiB writes from `nt` threads over `f` (size `size`); returns the op count.
fn rand_threads(f: &dyn Io, seed: u64, nt: u64, size: u64, ops_per_thread: u64, prog: &Progress) -> R<u64> {
    let nblocks = size / BS4K;
    let total = AtomicU64::new(0);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..nt)
            .map(|t| {
                let total = &total;
                s.spawn(move || -> R<()> {
                    let ctr = prog.slot();
                    let mut buf = vec![0u8; BS4K as usize];
                    let mut err = None;
                    rand_plan(seed, t, nt, nblocks, ops_per_thread, |b, g| {
                        fill_pattern(&mut buf, g, b * BS4K);
                        if let Err(e) = f.pwrite(&buf, b * BS4K) {
                            err = Some(e);
                            return false;
                        }
                        ctr.tick();
                        total.fetch_add(1, SeqCst);
                        true
                    });
                    err.map_or(Ok(()), Err)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("writer panicked".into()))).collect::<R<Vec<()>>>()
    })?;
    Ok(total.load(SeqCst))
}

/// 1 MiB sequential writes of `size` bytes, then fsync.
fn seq_write(f: &dyn Io, size: u64, prog: &Progress) -> R<u64> {
    let ctr = prog.slot();
    let mut buf = vec![0u8; MIB as usize];
    let mut ops = 0;
    let mut off = 0;
    while off < size {
        let n = (size - off).min(MIB);
        fill_pattern(&mut buf[..n as usize], 1, off);
        f.pwrite(&buf[..n as usize], off)?;
        ops += 1;
        off += n;
        ctr.tick();
    }
    f.fsync()?;
    Ok(ops)
}

/// Mixed operations on one file by one thread against its byte model: writes, reads
/// (checked at once), truncations, stores through a shared mapping, syncs.
fn mixed_one(
    f: &dyn Io,
    seed: u64,
    max: u64,
    ops: u64,
    prog: &Progress,
    diff: &AtomicU64,
    bytes: &AtomicU64,
) -> R<Vec<u8>> {
    let ctr = prog.slot();
    let mut rng = Rng::new(seed);
    let mut model: Vec<u8> = vec![0; f.length()? as usize];
    let mut buf = vec![0u8; 256 << 10];
    for i in 0..ops {
        let len = model.len() as u64;
        let op = rng.below(100);
        if op < 40 {
            // write, possibly extending
            let n = 1 + rng.below(256 << 10);
            let off = rng.below(max.saturating_sub(n).max(1));
            let b = &mut buf[..n as usize];
            let v = rng.next();
            for (k, x) in b.iter_mut().enumerate() {
                *x = (v as u8).wrapping_add((k as u8).wrapping_mul(v as u8 | 1)) ^ (i as u8);
            }
            f.pwrite(b, off)?;
            let end = (off + n) as usize;
            if model.len() < end {
                model.resize(end, 0);
            }
            model[off as usize..end].copy_from_slice(b);
            bytes.fetch_add(n, SeqCst);
        } else if op < 65 {
            // read and check
            if len == 0 {
                continue;
            }
            let off = rng.below(len);
            let n = (1 + rng.below(256 << 10)).min(len - off);
            let b = &mut buf[..n as usize];
            let r = f.pread(b, off)?;
            let want = &model[off as usize..(off + n) as usize];
            let d = (0..n as usize).filter(|&k| k >= r || b[k] != want[k]).count() as u64;
            if d > 0 {
                eprintln!("mixed: read {n} @{off} (op {i}): {d} bytes differ from the model");
            }
            diff.fetch_add(d, SeqCst);
            bytes.fetch_add(n, SeqCst);
        } else if op < 75 {
            let nl = rng.below(max + 1);
            f.truncate(nl)?;
            model.resize(nl as usize, 0);
        } else if op < 92 {
            // store through a mapping: whole pages inside the file
            let pages = len / BS4K;
            if pages == 0 {
                continue;
            }
            let np = (1 + rng.below(16)).min(pages);
            let p0 = rng.below(pages - np + 1);
            let n = (np * BS4K) as usize;
            let v = rng.next();
            let b = &mut buf[..n];
            for (k, x) in b.iter_mut().enumerate() {
                *x = (v as u8) ^ (k as u8).wrapping_mul(31) ^ 0x5a;
            }
            f.map_store(b, p0 * BS4K)?;
            model[(p0 * BS4K) as usize..(p0 * BS4K) as usize + n].copy_from_slice(b);
            bytes.fetch_add(n as u64, SeqCst);
        } else {
            f.fsync()?;
        }
        ctr.tick();
    }
    Ok(model)
}

type Phase = (Vec<(String, Model)>, Outcome);

fn mixed(c: &CaseArgs, prog: &Progress, open: &(dyn Fn(&str) -> R<Box<dyn Io + Send>> + Sync)) -> R<Phase> {
    let diff = AtomicU64::new(0);
    let bytes = AtomicU64::new(0);
    let t0 = Instant::now();
    let models = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let (diff, bytes) = (&diff, &bytes);
                s.spawn(move || -> R<(String, Model)> {
                    let name = format!("m{t}");
                    let f = open(&name)?;
                    let m = mixed_one(&*f, c.seed * 31 + t, c.mixed_size, c.mixed_ops, prog, diff, bytes)?;
                    Ok((name, Model::Bytes(m)))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("mixed worker panicked".into()))).collect::<R<Vec<_>>>()
    })?;
    let secs = t0.elapsed().as_secs_f64();
    Ok((
        models,
        Outcome { ops: 4 * c.mixed_ops, bytes: bytes.load(SeqCst), secs, diff: diff.load(SeqCst), note: String::new() },
    ))
}

fn host_create(p: &Path) -> R<Box<dyn Io + Send>> {
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(p).ctx(p.display())?;
    Ok(Box::new(f))
}

fn mount_pattern(c: &CaseArgs, prog: &Progress, mt: &Path, m0: &Path) -> R<Phase> {
    match c.pattern.as_str() {
        "rand4k-threads" | "rand4k-procs" => {
            let f = host_create(&mt.join("f"))?;
            f.truncate(c.size)?;
            drop(f);
            let t0 = Instant::now();
            let nblocks = c.size / BS4K;
            for round in 1..=c.fio_rounds {
                let quarter = c.size / 4 / BS4K * BS4K;
                let mut cmd = Command::new("fio");
                cmd.args([
                    "--name=soak",
                    "--rw=randwrite",
                    "--bs=4k",
                    "--ioengine=psync",
                    "--numjobs=4",
                    "--fallocate=none",
                ])
                .arg(format!("--filename={}", mt.join("f").display()))
                .arg(format!("--size={quarter}"))
                .arg(format!("--offset_increment={quarter}"))
                .arg(format!("--randseed={}", c.seed + round as u64))
                .args(["--verify=pattern", "--do_verify=0", "--group_reporting", "--output-format=terse"])
                .arg(format!("--verify_pattern=0x{round:08x}%o"));
                if c.pattern == "rand4k-threads" {
                    cmd.arg("--thread");
                }
                run_fio(cmd, prog, &c.dir)?;
            }
            let quarter_blocks = c.size / 4 / BS4K;
            let gens = (0..nblocks).map(|b| if b < 4 * quarter_blocks { c.fio_rounds } else { 0 }).collect();
            let secs = t0.elapsed().as_secs_f64();
            let ops = 4 * quarter_blocks * c.fio_rounds as u64;
            Ok((
                vec![("f".into(), Model::Blocks { bs: BS4K, gens, len: c.size })],
                Outcome { ops, bytes: ops * BS4K, secs, ..Default::default() },
            ))
        }
        "seq1m-fsync" => {
            let t0 = Instant::now();
            let mut cmd = Command::new("fio");
            cmd.args([
                "--name=soak",
                "--rw=write",
                "--bs=1M",
                "--ioengine=psync",
                "--numjobs=1",
                "--fallocate=none",
                "--end_fsync=1",
            ])
            .arg(format!("--filename={}", mt.join("f").display()))
            .arg(format!("--size={}", c.size))
            .args([
                "--verify=pattern",
                "--do_verify=0",
                "--output-format=terse",
                "--verify_pattern=0x00000001%o",
            ]);
            run_fio(cmd, prog, &c.dir)?;
            let secs = t0.elapsed().as_secs_f64();
            let nb = c.size.div_ceil(MIB);
            let model = Model::Blocks { bs: MIB, gens: vec![1; nb as usize], len: c.size };
            Ok((vec![("f".into(), model)], Outcome { ops: nb, bytes: c.size, secs, ..Default::default() }))
        }
        "mixed" => {
            let open = |name: &str| host_create(&mt.join(name));
            mixed(c, prog, &open)
        }
        "two-mounts" => {
            // 4 threads of random 4 KiB writes of cleartext at the top while one thread
            // reads every file of the bottom layer over and over.
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(mt.join("f"))
                .ctx("create f")?;
            f.set_len(c.size).ctx("set_len")?;
            let ops_per = c.size / BS4K / 4;
            let stop = std::sync::atomic::AtomicBool::new(false);
            let t0 = Instant::now();
            let (ops, lower) = std::thread::scope(|s| -> R<(u64, u64)> {
                let reader = s.spawn(|| -> R<u64> {
                    let ctr = prog.slot();
                    let mut buf = vec![0u8; MIB as usize];
                    let mut total = 0u64;
                    let mut sum = 0u64;
                    while !stop.load(SeqCst) {
                        for e in std::fs::read_dir(m0).ctx("readdir lower")? {
                            let p = e.ctx("readdir")?.path();
                            let g = HostFile::open(&p).ctx(p.display())?;
                            let mut off = 0;
                            loop {
                                let n = g.read_at(&mut buf, off).ctx(format!("read lower {} @{off}", p.display()))?;
                                if n == 0 || stop.load(SeqCst) {
                                    break;
                                }
                                sum = sum.wrapping_add(buf[..n].iter().map(|&x| x as u64).sum::<u64>());
                                off += n as u64;
                                total += n as u64;
                                ctr.tick();
                            }
                        }
                        ctr.tick();
                    }
                    std::hint::black_box(sum);
                    Ok(total)
                });
                let w = rand_threads(&f, c.seed, 4, c.size, ops_per, prog);
                stop.store(true, SeqCst);
                let r = reader.join().unwrap_or_else(|_| Err("reader panicked".into()));
                let ops = w?;
                Ok((ops, r?))
            })?;
            f.sync_all().ctx("fsync")?;
            drop(f);
            let secs = t0.elapsed().as_secs_f64();
            let model = rand_model(c.seed, 4, c.size, ops_per);
            let note = format!("lower read {} MiB; ", lower >> 20);
            Ok((vec![("f".into(), model)], Outcome { ops, bytes: ops * BS4K, secs, diff: 0, note }))
        }
        p => Err(format!("unknown pattern {p}")),
    }
}

fn run_fio(mut cmd: Command, prog: &Progress, dir: &Path) -> R<()> {
    let log = dir.join("fio.log");
    let logf = std::fs::OpenOptions::new().create(true).append(true).open(&log).ctx("fio log")?;
    // No verify state files (fio writes them into its working directory).
    cmd.arg("--verify_state_save=0").current_dir(dir);
    cmd.stdin(Stdio::null()).stdout(logf.try_clone().ctx("log")?).stderr(logf);
    let mut child = cmd.spawn().ctx("spawn fio (is it installed?)")?;
    let st = {
        let _g = prog.watch_pid(child.id());
        child.wait().ctx("wait fio")?
    };
    if !st.success() {
        let tail = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = tail.lines().rev().take(5).collect();
        return Err(format!("fio failed ({st}): {}", tail.into_iter().rev().collect::<Vec<_>>().join(" | ")));
    }
    Ok(())
}

fn lib_pattern(c: &CaseArgs, prog: &Progress, spec: &str) -> R<Phase> {
    if c.pattern == "rand4k-procs" {
        // 4 processes, each with its own stack over the same directory (the library has
        // no coherence across processes) and its own quarter-size file.
        let quarter = c.size / 4 / BS4K * BS4K;
        let ops = quarter / BS4K;
        let me = std::env::current_exe().ctx("current_exe")?;
        let t0 = Instant::now();
        let mut kids = Vec::new();
        for k in 0..4u64 {
            let slot = prog.slot();
            let child = Command::new(&me)
                .args(["lib-worker", "--spec", spec, "--budget", &c.budget.to_string(), "--file", &format!("f{k}")])
                .args(["--huge-pages", &c.huge_pages])
                .args([
                    "--size",
                    &quarter.to_string(),
                    "--seed",
                    &(c.seed + 100 * k).to_string(),
                    "--ops",
                    &ops.to_string(),
                ])
                .arg("--progress")
                .arg(c.dir.join("progress"))
                .args(["--slot", &slot.i.to_string()])
                .stdin(Stdio::null())
                .spawn()
                .ctx("spawn lib-worker")?;
            std::mem::forget(slot); // the worker owns the slot now
            kids.push(child);
        }
        prog.set_dump_pids(&kids.iter().map(|k| k.id()).collect::<Vec<_>>());
        let mut err = None;
        for mut k in kids {
            let st = k.wait().ctx("wait lib-worker")?;
            if !st.success() {
                err.get_or_insert(format!("lib-worker exited with {st}"));
            }
        }
        if let Some(e) = err {
            return Err(e);
        }
        prog.set_dump_pids(&[std::process::id()]);
        let secs = t0.elapsed().as_secs_f64();
        let models = (0..4u64).map(|k| (format!("f{k}"), rand_model(c.seed + 100 * k, 1, quarter, ops))).collect();
        return Ok((models, Outcome { ops: 4 * ops, bytes: 4 * ops * BS4K, secs, ..Default::default() }));
    }
    let cache = soak_cache(c.budget, &c.huge_pages)?;
    let stack = ubc_stack::Stack::open(spec, cache).ctx("open stack")?;
    let r = match c.pattern.as_str() {
        "rand4k-threads" => {
            let f = stack.top().create("f").ctx("create f")?;
            f.set_len(c.size).ctx("set_len")?;
            let ops_per = c.size / BS4K / 4;
            let t0 = Instant::now();
            let ops = rand_threads(&f, c.seed, 4, c.size, ops_per, prog)?;
            let secs = t0.elapsed().as_secs_f64();
            (
                vec![("f".into(), rand_model(c.seed, 4, c.size, ops_per))],
                Outcome { ops, bytes: ops * BS4K, secs, ..Default::default() },
            )
        }
        "seq1m-fsync" => {
            let f = stack.top().create("f").ctx("create f")?;
            let t0 = Instant::now();
            let ops = seq_write(&f, c.size, prog)?;
            let secs = t0.elapsed().as_secs_f64();
            let model = Model::Blocks { bs: MIB, gens: vec![1; c.size.div_ceil(MIB) as usize], len: c.size };
            (vec![("f".into(), model)], Outcome { ops, bytes: c.size, secs, ..Default::default() })
        }
        "mixed" => {
            let open = |name: &str| -> R<Box<dyn Io + Send>> {
                Ok(Box::new(stack.top().create(name).ctx(format!("create {name}"))?))
            };
            mixed(c, prog, &open)?
        }
        "two-mounts" => return Err("two-mounts is a mount pattern".into()),
        p => return Err(format!("unknown pattern {p}")),
    };
    // Drop the stack (syncing it) with its own progress: a hang there is a stall too.
    let ctr = prog.slot();
    stack.sync_all().ctx("sync_all")?;
    ctr.tick();
    drop(stack);
    Ok(r)
}

/// A cache of `budget` MiB with huge pages as `--huge-pages` says.
fn soak_cache(budget: u64, huge: &str) -> R<ubc::Cache> {
    let h: ubc::HugePages = huge.parse().map_err(|e| format!("--huge-pages {e}"))?;
    ubc::Cache::builder().budget(budget << 20).huge_pages(h).build().ctx("cache")
}

fn lib_worker(a: LibWorkerArgs) -> R<()> {
    let prog = Progress::open(&a.progress, false)?;
    let ctr = prog.counter_at(a.slot);
    let cache = soak_cache(a.budget, &a.huge_pages)?;
    let stack = ubc_stack::Stack::open(&a.spec, cache).ctx("open stack")?;
    let f = stack.top().create(&a.file).ctx("create")?;
    f.set_len(a.size).ctx("set_len")?;
    let mut buf = vec![0u8; BS4K as usize];
    let mut err = None;
    rand_plan(a.seed, 0, 1, a.size / BS4K, a.ops, |b, g| {
        fill_pattern(&mut buf, g, b * BS4K);
        if let Err(e) = f.pwrite(&buf, b * BS4K) {
            err = Some(e);
            return false;
        }
        ctr.tick();
        true
    });
    if let Some(e) = err {
        return Err(e);
    }
    drop(f);
    stack.sync_all().ctx("sync_all")?;
    ctr.tick();
    drop(stack);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The orchestrator

struct Row {
    stack: String,
    budget: u64,
    pattern: String,
    frontend: String,
    mib: u64,
    /// The size the pattern asks for (8x / 16x / 2x the budget) when a cap made it smaller.
    want: u64,
    ops: u64,
    mibs: f64,
    stalls: u32,
    diff: u64,
    result: String,
}

fn free_bytes(p: &Path) -> u64 {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: statvfs is plain data (all-zero is valid); `c` is a NUL-terminated path and
    // `s` a live out-parameter.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return u64::MAX;
    }
    s.f_bavail as u64 * s.f_frsize as u64
}

fn list(s: &str) -> Vec<String> {
    s.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect()
}

/// Set by SIGTERM/SIGINT/SIGHUP (`timeout` around the soak): kill the case, clean up, report.
static TERMINATED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    TERMINATED.store(true, SeqCst);
}

fn run(a: RunArgs) -> i32 {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: `on_term` is an `extern "C" fn(c_int)` that only stores to an atomic
        // (async-signal-safe).
        unsafe { libc::signal(sig, on_term as *const () as libc::sighandler_t) };
    }
    let ubc = a.ubc.clone().unwrap_or_else(|| std::env::current_exe().unwrap().with_file_name("ubc"));
    if !ubc.exists() {
        eprintln!("ubc-soak: {} missing (cargo build --release -p ubc-cli)", ubc.display());
        return 2;
    }
    let work = a.work.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("ubc-soak-{}", std::process::id())));
    if let Err(e) = std::fs::create_dir_all(&work) {
        eprintln!("ubc-soak: {}: {e}", work.display());
        return 2;
    }
    let free = free_bytes(&work);
    // The biggest case stores its file once or twice (zstd/aead rewrite out of place): keep
    // it under a quarter of the free space.
    let space_cap = free / 4 / MIB;
    let cap = a.max_file_mib.min(space_cap).max(4);
    println!(
        "ubc-soak: work {}; {} GiB free; file sizes are 8x budget (random writes) and 16x budget (sequential), capped at {} MiB ({}); mixed: 4 files of up to {} MiB",
        work.display(),
        free >> 30,
        cap,
        if cap == a.max_file_mib { "--max-file-mib" } else { "a quarter of the free space" },
        a.max_mixed_mib
    );
    let t_start = Instant::now();
    let mut rows = Vec::new();
    let mut failed = false;
    let mut n = 0;
    for budget in list(&a.budgets).iter().filter_map(|b| b.parse::<u64>().ok()) {
        for stack in list(&a.stacks) {
            for pattern in list(&a.patterns) {
                for frontend in list(&a.frontends) {
                    if pattern == "two-mounts" && (frontend != "mount" || stack == "dir") {
                        continue; // one layer, or the library: no second mount
                    }
                    n += 1;
                    let want = if pattern == "seq1m-fsync" { 16 * budget } else { 8 * budget };
                    let mut mib = want.min(cap);
                    if pattern == "two-mounts" {
                        mib = mib.min(a.max_two_mounts_mib.unwrap_or(u64::MAX));
                    }
                    let want = if pattern == "mixed" { 2 * budget } else { want };
                    let mut row = Row {
                        want,
                        stack: stack.clone(),
                        budget,
                        pattern: pattern.clone(),
                        frontend: frontend.clone(),
                        mib: if pattern == "mixed" { (2 * budget).min(a.max_mixed_mib) } else { mib },
                        ops: 0,
                        mibs: 0.0,
                        stalls: 0,
                        diff: 0,
                        result: String::new(),
                    };
                    if TERMINATED.load(SeqCst) {
                        row.result = "skipped (terminated)".into();
                        failed = true;
                        rows.push(row);
                        continue;
                    }
                    if a.minutes > 0 && t_start.elapsed() > Duration::from_secs(a.minutes * 60) {
                        row.result = "skipped (--minutes)".into();
                        rows.push(row);
                        continue;
                    }
                    let dir = work.join(format!("{n:03}-{}-{budget}-{pattern}-{frontend}", stack.replace('|', "_")));
                    let _ = std::fs::remove_dir_all(&dir);
                    std::fs::create_dir_all(&dir).unwrap();
                    let ca = CaseArgs {
                        stack: stack.clone(),
                        budget,
                        huge_pages: a.huge_pages.clone(),
                        pattern: pattern.clone(),
                        frontend: frontend.clone(),
                        size: mib * MIB,
                        mixed_size: row.mib * MIB,
                        mixed_ops: a.mixed_ops,
                        fio_rounds: a.fio_rounds,
                        dir: dir.clone(),
                        ubc: ubc.clone(),
                        seed: a.seed,
                    };
                    println!(
                        "-- case {n}: stack '{stack}' budget {budget} MiB, {pattern}, {frontend}, {} MiB",
                        row.mib
                    );
                    let _ = std::io::stdout().flush();
                    run_case(&ca, &a, &mut row);
                    let ok = row.result == "ok";
                    println!("   {} ({} ops, {:.1} MiB/s, {} bytes differ)", row.result, row.ops, row.mibs, row.diff);
                    if ok {
                        let _ = std::fs::remove_dir_all(&dir);
                    } else {
                        failed = true;
                        println!("   case directory kept: {}", dir.display());
                    }
                    rows.push(row);
                }
            }
        }
    }
    print_table(&rows);
    if !failed {
        let _ = std::fs::remove_dir(&work);
    }
    println!(
        "ubc-soak: {} cases in {:.0} s: {}",
        rows.len(),
        t_start.elapsed().as_secs_f64(),
        if failed { "FAILED" } else { "ok" }
    );
    if failed { 1 } else { 0 }
}

fn print_table(rows: &[Row]) {
    println!();
    println!(
        "| stack | budget MiB | pattern | front end | file MiB | ops | MiB/s | stalls | bytes differing | result |"
    );
    println!("|---|---:|---|---|---:|---:|---:|---:|---:|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {}{} | {} | {:.1} | {} | {} | {} |",
            r.stack.replace('|', " \\| "),
            r.budget,
            r.pattern,
            r.frontend,
            r.mib,
            if r.want > r.mib { format!(" (capped; {} wanted)", r.want) } else { String::new() },
            r.ops,
            r.mibs,
            r.stalls,
            r.diff,
            r.result
        );
    }
}

fn run_case(ca: &CaseArgs, a: &RunArgs, row: &mut Row) {
    let prog = match Progress::open(&ca.dir.join("progress"), true) {
        Ok(p) => p,
        Err(e) => {
            row.result = format!("error: {e}");
            return;
        }
    };
    let me = std::env::current_exe().unwrap();
    let stderr = HostFile::create(ca.dir.join("case.log")).unwrap();
    let mut cmd = Command::new(me);
    cmd.arg("case")
        .args([
            "--stack",
            &ca.stack,
            "--budget",
            &ca.budget.to_string(),
            "--huge-pages",
            &ca.huge_pages,
            "--pattern",
            &ca.pattern,
            "--frontend",
            &ca.frontend,
        ])
        .args([
            "--size",
            &ca.size.to_string(),
            "--mixed-size",
            &ca.mixed_size.to_string(),
            "--mixed-ops",
            &ca.mixed_ops.to_string(),
        ])
        .args(["--fio-rounds", &ca.fio_rounds.to_string(), "--seed", &ca.seed.to_string()])
        .arg("--dir")
        .arg(&ca.dir)
        .arg("--ubc")
        .arg(&ca.ubc)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .process_group(0);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            row.result = format!("error: spawn: {e}");
            return;
        }
    };
    let pgid = child.id() as i32;
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let stall = Duration::from_secs(a.stall_secs);
    let mut seen: HashMap<(char, u64), (u64, Instant)> = HashMap::new();
    // Last time anything moved: a case with no worker moving (or none registered, e.g. hung
    // opening a stack) for the stall time is stalled too.
    let mut last_any = Instant::now();
    let mut server: (u64, u64, Instant) = (0, 0, Instant::now()); // pid, bytes written, when it changed
    let mut result_line = None;
    let status = loop {
        while let Ok(l) = rx.try_recv() {
            if let Some(r) = l.strip_prefix("SOAK-RESULT ") {
                result_line = Some(r.to_string());
            }
        }
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) => {}
            Err(_) => break None,
        }
        // Progress of every active worker.
        let now = Instant::now();
        let spid = prog.w(SERVER).load(SeqCst);
        if spid != 0 {
            let v = proc_stored(spid as u32).unwrap_or(0);
            if spid != server.0 || v != server.1 {
                server = (spid, v, now);
            }
        }
        let server_idle = now - server.2 > stall;
        let mut stale: Option<String> = None;
        let mut live = std::collections::HashSet::new();
        for i in SLOT0..SLOTN {
            let v = prog.w(i).load(SeqCst);
            if v == 0 || v == DONE {
                continue;
            }
            live.insert(('c', i as u64));
            let e = seen.entry(('c', i as u64)).or_insert_with(|| {
                last_any = now;
                (v, now)
            });
            if e.0 != v {
                *e = (v, now);
                last_any = now;
            } else if now - e.1 > stall && server_idle {
                stale = Some(format!(
                    "worker {} made no progress for {} s (at {} ops), nor did the server store anything",
                    i - SLOT0,
                    a.stall_secs,
                    v - 1
                ));
            }
        }
        for i in PID0..PIDN {
            let pid = prog.w(i).load(SeqCst);
            if pid == 0 {
                continue;
            }
            let Some(v) = tree_io(pid as u32) else { continue };
            live.insert(('p', pid));
            let e = seen.entry(('p', pid)).or_insert_with(|| {
                last_any = now;
                (v, now)
            });
            if e.0 != v {
                *e = (v, now);
                last_any = now;
            } else if now - e.1 > stall && server_idle {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                stale = Some(format!(
                    "process {pid} ({}) wrote nothing for {} s, nor did the server store anything",
                    comm.trim(),
                    a.stall_secs
                ));
            }
        }
        seen.retain(|k, _| live.contains(k));
        if stale.is_none() && now - last_any > stall && server_idle {
            stale = Some(format!("nothing made progress for {} s (the server stored nothing either)", a.stall_secs));
        }
        if TERMINATED.load(SeqCst) {
            println!("   terminated: killing the case");
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
            for p in prog.dump_pids() {
                // SAFETY: as above.
                unsafe { libc::kill(p as i32, libc::SIGKILL) };
            }
            let _ = child.wait();
            lazy_unmount_under(&ca.dir);
            row.result = "terminated".into();
            return;
        }
        if let Some(why) = stale {
            row.stalls += 1;
            println!("   STALL: {why}");
            let mut pids = prog.dump_pids();
            if pids.is_empty() {
                pids.push(child.id());
            }
            let path = ca.dir.join("stall-stacks.txt");
            dump_stacks(&pids, &path);
            // Kill the case: its process group holds ubc mount, fio and the workers.
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
            for p in &pids {
                // SAFETY: as above.
                unsafe { libc::kill(*p as i32, libc::SIGKILL) };
            }
            lazy_unmount_under(&ca.dir);
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(20) {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            lazy_unmount_under(&ca.dir);
            row.result = format!("STALL (stacks: {})", path.display());
            return;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    // The rest of its output: the reader thread ends (and the channel with it) when the
    // case's stdout closes; the timeout only guards against a grandchild holding it open.
    while let Ok(l) = rx.recv_timeout(Duration::from_secs(5)) {
        if let Some(r) = l.strip_prefix("SOAK-RESULT ") {
            result_line = Some(r.to_string());
        }
    }
    lazy_unmount_under(&ca.dir);
    let Some(r) = result_line else {
        row.result =
            format!("error: case exited {status:?} without a result (see {})", ca.dir.join("case.log").display());
        return;
    };
    if let Some(e) = r.strip_prefix("error=") {
        row.result = format!("error: {e}");
        return;
    }
    let mut kv = HashMap::new();
    let (head, note) = r.split_once(" note=").unwrap_or((&r, ""));
    for p in head.split_whitespace() {
        if let Some((k, v)) = p.split_once('=') {
            kv.insert(k.to_string(), v.to_string());
        }
    }
    let g = |k: &str| kv.get(k).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    row.ops = g("ops") as u64;
    row.mibs = if g("secs") > 0.0 { g("bytes") / MIB as f64 / g("secs") } else { 0.0 };
    // A result without its byte count, or from a case that did not exit cleanly, is not a
    // pass: nothing says every byte was compared.
    let Some(diff) = kv.get("diff").and_then(|v| v.parse::<u64>().ok()) else {
        row.result = format!("error: result without a byte count: {r}");
        return;
    };
    row.diff = diff;
    row.result = match (status.map(|s| s.success()), diff) {
        (Some(true), 0) => "ok".into(),
        (Some(true), _) => "MISMATCH".into(),
        _ => format!("error: case exited {status:?} after its result"),
    };
    if !note.is_empty() {
        println!("   {note}");
    }
}

fn lazy_unmount_under(dir: &Path) {
    for mp in mounts::under(dir) {
        let _ = Command::new("fusermount3").args(["-u", "-z"]).arg(mp).stderr(Stdio::null()).status();
    }
}

/// gdb every thread's stack of `pids` into `path`; print a summary of the ubc frames.
fn dump_stacks(pids: &[u32], path: &Path) {
    let mut text = String::new();
    for pid in pids {
        let out = Command::new("timeout")
            .args([
                "60",
                "gdb",
                "-p",
                &pid.to_string(),
                "-batch",
                "-ex",
                "set pagination off",
                "-ex",
                "thread apply all bt",
            ])
            .stdin(Stdio::null())
            .output();
        match out {
            Ok(o) => {
                text.push_str(&format!("==== pid {pid}\n"));
                text.push_str(&String::from_utf8_lossy(&o.stdout));
                text.push_str(&String::from_utf8_lossy(&o.stderr));
            }
            Err(e) => text.push_str(&format!("==== pid {pid}: gdb: {e} (apt-get install gdb)\n")),
        }
    }
    let _ = std::fs::write(path, &text);
    let threads = text.lines().filter(|l| l.starts_with("Thread ")).count();
    println!("   every thread's stack ({threads} threads of pid {pids:?}): {}", path.display());
    print_summary(&text);
}

fn print_summary(text: &str) {
    let (by_name, innermost, frames) = summarize(text);
    let top = |m: HashMap<String, usize>, n: usize, what: &str| {
        let mut v: Vec<_> = m.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        println!("   {what}:");
        for (f, k) in v.iter().take(n) {
            println!("   {k:5}  {f}");
        }
    };
    top(by_name, 8, "threads by name");
    top(innermost, 10, "threads by innermost ubc frame (where they wait)");
    top(frames, 15, "threads by ubc function on their stack (top 15)");
}

/// A gdb frame's function without generic arguments; `<A as B>::f` becomes `A::f`.
fn frame_function(line: &str) -> Option<String> {
    let rest = line.strip_prefix('#')?;
    let f = match rest.split_once(" in ") {
        Some((_, f)) => f,
        None => rest.trim_start_matches(|c: char| c.is_ascii_digit()).trim_start(),
    };
    let name = f.split(" (").next().unwrap_or("").trim();
    let mut s = String::new();
    let mut depth = 0;
    let mut qualified = false; // inside a leading `<A as B>`: keep A
    let mut skip_as = false;
    for (k, ch) in name.char_indices() {
        match ch {
            '<' if k == 0 => qualified = true,
            '<' => depth += 1,
            '>' if depth > 0 => depth -= 1,
            '>' if qualified => {
                qualified = false;
                skip_as = false;
            }
            _ if depth == 0 && qualified && !skip_as && name[k..].starts_with(" as ") => skip_as = true,
            _ if depth == 0 && !skip_as => s.push(ch),
            _ => {}
        }
    }
    Some(s)
}

/// Per thread of a gdb dump: its name, its innermost ubc frame, the ubc functions on it.
fn summarize(text: &str) -> (HashMap<String, usize>, HashMap<String, usize>, HashMap<String, usize>) {
    let (mut by_name, mut innermost, mut frames) = (HashMap::new(), HashMap::new(), HashMap::new());
    let mut inner: Option<String> = None;
    let mut fns: std::collections::HashSet<String> = Default::default();
    let mut flush = |inner: &mut Option<String>, fns: &mut std::collections::HashSet<String>| {
        if let Some(f) = inner.take() {
            *innermost.entry(f).or_insert(0usize) += 1;
        }
        for f in fns.drain() {
            *frames.entry(f).or_insert(0usize) += 1;
        }
    };
    for l in text.lines() {
        if l.starts_with("Thread ") {
            flush(&mut inner, &mut fns);
            let name =
                l.rsplit_once(" \"").map(|(_, n)| n.trim_end_matches("\"):").trim_end_matches('"')).unwrap_or("?");
            // ubc-io-0, ubc-io-1… count as one name.
            let base = name.trim_end_matches(|c: char| c.is_ascii_digit()).to_string();
            *by_name.entry(base).or_insert(0usize) += 1;
        } else if let Some(f) = frame_function(l).filter(|f| f.starts_with("ubc")) {
            if inner.is_none() {
                inner = Some(f.clone());
            }
            fns.insert(f);
        }
    }
    flush(&mut inner, &mut fns);
    (by_name, innermost, frames)
}

//! A skewed mixed workload larger than the cache: 4 KiB random reads of pages drawn from a
//! Zipf(0.9) distribution (hot pages scattered over the file) with 20% 4 KiB writes, on a
//! file four times ubc's budget. Each timed segment ends with a sync (so deferred writes are
//! paid for); ops/s = segment ops / (ops + sync time).
//!
//! Baselines, all `pread`/`pwrite` on the same file and the same operation sequence:
//! * the kernel limited to ubc's budget: a child process in a cgroup v2 with `memory.max`
//!   = budget (+ the child's own small footprint), if this machine lets us create one;
//! * the kernel with its page cache unlimited (all free RAM: the file stays resident);
//! * the kernel with `O_DIRECT` (no cache at all: every operation goes to the disk).
//!
//! ubc must sit between the last two; the first is the fair comparison.

use super::Ctx;
use crate::report::{Better, Record, median};
use crate::util::*;
use std::io::{BufRead, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::time::Instant;
use ubc::{Access, Cache};

const PAGE: u64 = 4096;
const WRITE: u32 = 1 << 31;
const SKEW: f64 = 0.9;
const WRITE_FRACTION: f64 = 0.2;
/// The environment variable that turns the binary into the cgroup child.
pub const CHILD_ENV: &str = "UBC_BENCH_ZIPF_CHILD";

/// What both sides run: the same operation list, cut into the same segments.
#[derive(Debug, Clone)]
struct Spec {
    path: PathBuf,
    pages: u64,
    warm: usize,
    timed: usize,
    runs: usize,
    seed: u64,
}

impl Spec {
    fn encode(&self) -> String {
        format!("{}\n{}\n{}\n{}\n{}\n{}", self.pages, self.warm, self.timed, self.runs, self.seed, self.path.display())
    }
    fn decode(s: &str) -> Spec {
        let mut it = s.splitn(6, '\n');
        let mut num = || it.next().unwrap().parse::<u64>().unwrap();
        let (pages, warm, timed, runs, seed) = (num(), num() as usize, num() as usize, num() as usize, num());
        Spec { pages, warm, timed, runs, seed, path: PathBuf::from(it.next().unwrap()) }
    }
    /// Page numbers (bit 31: a write). Zipf ranks are scattered over the file by a
    /// multiplicative permutation, so hot pages are not adjacent.
    fn ops(&self) -> Vec<u32> {
        let n = self.pages;
        assert!(n < WRITE as u64);
        let z = Zipf::new(n as usize, SKEW);
        let mut mult = 2_654_435_761u64 % n;
        while gcd(mult, n) != 1 {
            mult += 1;
        }
        let mut rng = Rng::new(self.seed);
        (0..self.warm + self.runs * self.timed)
            .map(|_| {
                let page = (z.sample(&mut rng) as u64 * mult % n) as u32;
                if rng.unit() < WRITE_FRACTION { page | WRITE } else { page }
            })
            .collect()
    }
    fn segment<'a>(&self, ops: &'a [u32], rep: usize) -> &'a [u32] {
        &ops[self.warm + rep * self.timed..self.warm + (rep + 1) * self.timed]
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Run `ops` with pread/pwrite on `f`, then fdatasync. Returns (ops seconds, sync seconds).
fn kernel_ops(f: &std::fs::File, ops: &[u32], buf: &mut [u8]) -> (f64, f64) {
    let t = Instant::now();
    for &op in ops {
        let off = (op & !WRITE) as u64 * PAGE;
        if op & WRITE != 0 {
            buf[0] = buf[0].wrapping_add(1);
            f.write_all_at(&buf[..PAGE as usize], off).expect("pwrite");
        } else {
            f.read_exact_at(&mut buf[..PAGE as usize], off).expect("pread");
        }
    }
    let ops_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    f.sync_data().expect("fdatasync");
    (ops_s, t.elapsed().as_secs_f64())
}

fn ubc_ops(f: &ubc::File, ops: &[u32], buf: &mut [u8]) -> (f64, f64) {
    let t = Instant::now();
    for &op in ops {
        let off = (op & !WRITE) as u64 * PAGE;
        if op & WRITE != 0 {
            buf[0] = buf[0].wrapping_add(1);
            f.write_at(&buf[..PAGE as usize], off).expect("ubc write_at");
        } else {
            f.read_exact_at(&mut buf[..PAGE as usize], off).expect("ubc read_at");
        }
    }
    let ops_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    f.sync().expect("ubc sync");
    (ops_s, t.elapsed().as_secs_f64())
}

/// The kernel baseline: warm up, then time every segment. Returns ops/s per segment and
/// the median sync seconds.
fn kernel_baseline(spec: &Spec, ops: &[u32], direct: bool, per_rep: usize) -> (Vec<f64>, f64) {
    let mut o = std::fs::OpenOptions::new();
    o.read(true).write(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    let f = o.open(&spec.path).expect("open");
    let mut buf = AlignedBuf::new(PAGE as usize);
    if !direct {
        kernel_ops(&f, &ops[..spec.warm], &mut buf);
    }
    let (mut v, mut syncs) = (vec![], vec![]);
    for rep in 0..spec.runs {
        let seg = &spec.segment(ops, rep)[..per_rep];
        let (a, b) = kernel_ops(&f, seg, &mut buf);
        v.push(seg.len() as f64 / (a + b));
        syncs.push(b);
    }
    (v, median(&syncs))
}

/// Entry point of the cgroup child: wait for the parent to move us into the cgroup, run
/// the kernel baseline, print `ops/s ... ; sync_s ; resident_pages` on stdout.
pub fn child_main(spec: &str) {
    let spec = Spec::decode(spec);
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).expect("wait for parent");
    let ops = spec.ops();
    let (v, sync) = kernel_baseline(&spec, &ops, false, spec.timed);
    let resident = kernel_resident(&spec.path).map_or(u64::MAX, |r| r.0);
    let list = v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" ");
    println!("{list};{sync};{resident}");
}

/// A cgroup v2 made for the child; removed on drop.
struct Cgroup(PathBuf);

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Make a cgroup v2 with `memory.max = limit` at the root of a cgroup2 mount that offers the
/// memory controller, or say why not.
fn make_memory_cgroup(limit: u64) -> Result<Cgroup, String> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("mountinfo: {e}"))?;
    let v2: Vec<PathBuf> = mounts
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let mp = pre.split_whitespace().nth(4)?;
            (post.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mp))
        })
        .collect();
    let v1_memory = mounts.lines().any(|l| {
        l.split_once(" - ").is_some_and(|(_, post)| {
            let f: Vec<&str> = post.split_whitespace().collect();
            f.first() == Some(&"cgroup") && f.get(2).is_some_and(|o| o.split(',').any(|x| x == "memory"))
        })
    });
    let v1 = if v1_memory {
        "; the memory controller is bound to the cgroup v1 hierarchy, which is managed by this machine's \
         process supervisor (not touched by the benchmark)"
    } else {
        ""
    };
    if v2.is_empty() {
        return Err(format!("no cgroup v2 mount{v1}"));
    }
    let mut why = vec![];
    for m in v2 {
        let controllers = std::fs::read_to_string(m.join("cgroup.controllers")).unwrap_or_default();
        if !controllers.split_whitespace().any(|c| c == "memory") {
            why.push(format!(
                "cgroup v2 at {} offers no memory controller (controllers: {})",
                m.display(),
                controllers.trim()
            ));
            continue;
        }
        let sub = std::fs::read_to_string(m.join("cgroup.subtree_control")).unwrap_or_default();
        if !sub.split_whitespace().any(|c| c == "memory")
            && let Err(e) = std::fs::write(m.join("cgroup.subtree_control"), "+memory")
        {
            why.push(format!("cannot enable memory in {}/cgroup.subtree_control: {e}", m.display()));
            continue;
        }
        let dir = m.join(format!("ubc-bench-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir(&dir) {
            why.push(format!("cannot create {}: {e}", dir.display()));
            continue;
        }
        let cg = Cgroup(dir);
        if let Err(e) = std::fs::write(cg.0.join("memory.max"), limit.to_string()) {
            why.push(format!("cannot set {}/memory.max: {e}", cg.0.display()));
            continue;
        }
        let _ = std::fs::write(cg.0.join("memory.swap.max"), "0");
        return Ok(cg);
    }
    Err(format!("{}{v1}", why.join("; ")))
}

/// Run the kernel baseline in a child process inside a memory-limited cgroup.
/// Returns (ops/s samples, median sync seconds, file pages resident at the end).
fn kernel_in_cgroup(spec: &Spec, limit: u64) -> Result<(Vec<f64>, f64, u64), String> {
    let cg = make_memory_cgroup(limit)?;
    // Pages already cached stay charged to whoever faulted them: start the child cold.
    let _ = drop_kernel_cache(&spec.path);
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let mut child = std::process::Command::new(exe)
        .env(CHILD_ENV, spec.encode())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn child: {e}"))?;
    let moved = std::fs::write(cg.0.join("cgroup.procs"), child.id().to_string());
    if let Err(e) = moved {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("cannot move the child into {}: {e}", cg.0.display()));
    }
    child.stdin.take().unwrap().write_all(b"go\n").map_err(|e| format!("child stdin: {e}"))?;
    let out = child.wait_with_output().map_err(|e| format!("child: {e}"))?;
    if !out.status.success() {
        return Err(format!("child failed ({}), maybe killed by the memory limit", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut parts = text.trim().split(';');
    let v: Vec<f64> = parts.next().unwrap_or("").split_whitespace().filter_map(|x| x.parse().ok()).collect();
    let sync = parts.next().and_then(|x| x.parse().ok()).unwrap_or(f64::NAN);
    let resident = parts.next().and_then(|x| x.parse().ok()).unwrap_or(u64::MAX);
    if v.len() != spec.runs {
        return Err(format!("child printed {text:?}"));
    }
    drop(cg);
    Ok((v, sync, resident))
}

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let budget = ctx.scale(256 * MIB, 128 * MIB);
    let len = 4 * budget;
    // Separate, identical files for ubc and the kernel: ubc's O_DIRECT I/O and the
    // kernel's cached pages of one file would interfere (a direct read first flushes
    // overlapping dirty cached pages; a direct write invalidates them).
    let path = ctx.dir.join("zipf_ubc.dat");
    let kpath = ctx.dir.join("zipf_kernel.dat");
    make_file(&path, len).expect("make file");
    make_file(&kpath, len).expect("make file");
    // ubc starts with nothing cached anywhere (in Buffered mode, the kernel's copy would
    // serve ubc's misses from RAM).
    let _ = drop_kernel_cache(&path);
    let spec = Spec {
        path: kpath.clone(),
        pages: len / PAGE,
        warm: ctx.scale(300_000, 100_000) as usize,
        timed: ctx.scale(500_000, 200_000) as usize,
        runs: ctx.runs,
        seed: 7,
    };
    let ops = spec.ops();
    let c = Cache::builder().budget(budget).build().expect("ubc cache");
    let f = c.open_path(&path, Access::ReadWrite).expect("ubc open");
    let mut buf = AlignedBuf::new(PAGE as usize);
    ubc_ops(&f, &ops[..spec.warm], &mut buf);
    // The kernel baseline without a limit: the file is resident (just written) and stays so.
    let kf = std::fs::OpenOptions::new().read(true).write(true).open(&kpath).expect("open");
    kernel_ops(&kf, &ops[..spec.warm], &mut buf);
    let before = c.stats().totals;
    let (mut u, mut k, mut us, mut ks, mut uo, mut ko) = (vec![], vec![], vec![], vec![], vec![], vec![]);
    let (mut udisk, mut kdisk) = (IoStat::default(), IoStat::default());
    for rep in 0..spec.runs {
        let seg = spec.segment(&ops, rep);
        let d0 = IoStat::now();
        let (a, b) = ubc_ops(&f, seg, &mut buf);
        let d1 = IoStat::now();
        udisk = udisk.add(&d1.since(&d0));
        u.push(seg.len() as f64 / (a + b));
        uo.push(seg.len() as f64 / a);
        us.push(b);
        let (a, b) = kernel_ops(&kf, seg, &mut buf);
        kdisk = kdisk.add(&IoStat::now().since(&d1));
        k.push(seg.len() as f64 / (a + b));
        ko.push(seg.len() as f64 / a);
        ks.push(b);
    }
    let after = c.stats();
    let (hits, misses) = (after.totals.hits - before.hits, after.totals.misses - before.misses);
    let kernel_res = kernel_resident(&kpath).map_or("?".into(), |(r, _)| format!("{}", (r * sys_page() as u64) >> 20));
    let common = format!(
        "{} MiB file = 4x ubc budget {} MiB, zipf {SKEW} over pages, {:.0}% writes, 4 KiB ops, {} ops/segment after {} warm-up ops, \
         each segment ends with a sync; ubc hit ratio in timed segments {:.1}%, ubc sync {:.3} s/segment, \
         ubc without the sync {:.0} ops/s; per ubc segment {}; {}",
        len >> 20,
        budget >> 20,
        100.0 * WRITE_FRACTION,
        spec.timed,
        spec.warm,
        100.0 * hits as f64 / (hits + misses).max(1) as f64,
        median(&us),
        median(&uo),
        udisk.describe(spec.runs as u64),
        ubc_note(&after, f.stats().io_mode)
    );
    drop((f, c, kf));
    let unlimited_note = format!(
        "kernel unlimited: {kernel_res} MiB of the file in its page cache, kernel sync {:.3} s/segment, kernel without the sync {:.0} ops/s, \
         per kernel segment {}",
        median(&ks),
        median(&ko),
        kdisk.describe(spec.runs as u64)
    );

    let mut out = vec![];
    // The fair baseline: the kernel limited to the same memory, in a cgroup.
    let slack = 32 * MIB; // the child's own memory: operation list, Zipf table, binary
    match kernel_in_cgroup(&spec, budget + slack) {
        Ok((v, sync, resident)) => {
            out.push(Record::from_samples(
                "zipf_mixed",
                "ops/s",
                Better::Higher,
                &u,
                &v,
                "kernel pread/pwrite in cgroup v2 (memory.max = budget)",
                &format!(
                    "{common}; kernel child in a cgroup with memory.max = budget + {} MiB for its own memory, \
                     {} MiB of the file cached at its end, sync {sync:.3} s/segment",
                    slack >> 20,
                    (resident * sys_page() as u64) >> 20
                ),
            ));
            out.push(Record::from_samples(
                "zipf_mixed_vs_unlimited",
                "ops/s",
                Better::Higher,
                &u,
                &k,
                "kernel pread/pwrite (unlimited page cache)",
                &format!("{common}; {unlimited_note}"),
            ));
        }
        Err(why) => {
            eprintln!("   zipf_mixed: no memory-limited kernel baseline: {why}");
            out.push(Record::from_samples(
                "zipf_mixed",
                "ops/s",
                Better::Higher,
                &u,
                &k,
                "kernel pread/pwrite (unlimited page cache)",
                &format!("{common}; {unlimited_note}; UNFAIR: kernel not memory-limited, no cgroup: {why}"),
            ));
        }
    }
    // The floor: no cache at all.
    let per_rep = (spec.timed / 10).max(2000).min(spec.timed);
    // On ubc's file, now closed and synced (ubc and O_DIRECT do not share this file).
    let dspec = Spec { path: path.clone(), ..spec.clone() };
    let d0 = IoStat::now();
    let (d, dsync) = kernel_baseline(&dspec, &ops, true, per_rep);
    let ddisk = IoStat::now().since(&d0);
    out.push(Record::from_samples(
        "zipf_mixed_vs_direct",
        "ops/s",
        Better::Higher,
        &u,
        &d,
        "kernel O_DIRECT pread/pwrite (no cache)",
        &format!(
            "{common}; O_DIRECT baseline runs the first {per_rep} ops of each segment, sync {dsync:.3} s/segment, \
             per O_DIRECT segment {}",
            ddisk.describe(spec.runs as u64)
        ),
    ));
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&kpath);
    out
}

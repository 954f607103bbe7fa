//! Contention across layers: many threads reading, writing, truncating,
//! syncing and storing through shared mappings on many files of two stacks that share one
//! small cache (working set 4x the budget), while other threads read the ciphertext at the
//! bottom. Checked against a model of every file; memory sampled every millisecond must stay
//! within budget + 5%; a watchdog aborts the run if any operation stalls past a bound.
//!
//! Short in `cargo test`; at length:
//! `UBC_STRESS_SECS=600 cargo test --release -p ubc-stack --test stress -- --nocapture`.
//! Knobs for hunting a failure (defaults unchanged): `UBC_STRESS_SEED`, `UBC_STRESS_STACKS=0|1`
//! (files on one stack only), `UBC_STRESS_BOTTOM_READERS=n`, `UBC_STRESS_CHECK_MAP=1` (read
//! back a mapping's pages right after unmapping it). A mismatch prints the file's last
//! operations.

mod common;

use common::dump_threads;
use parking_lot::Mutex;
use rand::{RngExt, SeedableRng};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::time::{Duration, Instant};
use ubc_stack::encrypt::Key;
use ubc_stack::{OpenOptions, Stack};

const FILES_PER_STACK: usize = 6;
const MAX_FILE: u64 = 2 << 20;
const BUDGET: u64 = 6 << 20;
const WORKERS: usize = 6;
const BOTTOM_READERS: usize = 2;
/// An operation running longer than this is a hang (debug builds on a loaded 2-core VM
/// included: a fault-around fill of a cold cluster through zstd+aead is the slowest).
const STALL: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Op {
    Read,
    Write,
    MapStore,
    SetLen,
    Sync,
    BottomRead,
}

struct FileState {
    top: ubc_stack::File,
    model: Vec<u8>,
    log: std::collections::VecDeque<String>,
}

impl FileState {
    fn note(&mut self, s: String) {
        if self.log.len() >= 300 {
            self.log.pop_front();
        }
        self.log.push_back(s);
    }
    fn dump(&self) -> String {
        self.log.iter().cloned().collect::<Vec<_>>().join("\n")
    }
}

/// Per-thread "operation in progress since" (ms after start; 0 = idle), for the watchdog.
struct Busy {
    since: Vec<AtomicU64>,
    what: Vec<Mutex<String>>,
}

fn fill(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<u8> {
    let b: u8 = rng.random();
    let step: u8 = rng.random::<u8>() | 1;
    (0..n).map(|i| b.wrapping_add((i as u8).wrapping_mul(step))).collect()
}

#[test]
fn many_threads_many_files_two_stacks_one_small_cache() {
    let secs: u64 = std::env::var("UBC_STRESS_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(6);
    let seed: u64 = std::env::var("UBC_STRESS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    println!("stress: {secs} s, seed {seed} (UBC_STRESS_SEED={seed} to replay the schedule of operations)");
    let tmp = tempfile::tempdir().unwrap();
    let key = tmp.path().join("key");
    Key::generate().write_file(&key).unwrap();
    let cache = ubc::Cache::builder().budget(BUDGET).build().unwrap();
    let mut specs = Vec::new();
    // UBC_STRESS_UPPER="null" (say) replaces stack 1's layers above the directory, to tell
    // whether a failure needs a given layer.
    let upper1 = std::env::var("UBC_STRESS_UPPER").unwrap_or_else(|_| "aead:keyfile=@KEY | null".into());
    for (i, upper) in ["zstd:chunk=16K | aead:keyfile=@KEY", upper1.as_str()].iter().enumerate() {
        let d = tmp.path().join(format!("data{i}"));
        std::fs::create_dir(&d).unwrap();
        specs.push(format!("dir:{} | {}", d.display(), upper.replace("@KEY", key.to_str().unwrap())));
    }
    let stacks: Vec<Stack> = specs.iter().map(|s| Stack::open(s, cache.clone()).unwrap()).collect();
    let mut files = Vec::new();
    // UBC_STRESS_STACKS=0 or =1: files on that stack only (to shorten the hunt for a
    // failure seen on one); default both.
    let only: Option<usize> = std::env::var("UBC_STRESS_STACKS").ok().and_then(|s| s.parse().ok());
    for (si, s) in stacks.iter().enumerate() {
        if only.is_some_and(|o| o != si) {
            continue;
        }
        for i in 0..FILES_PER_STACK {
            let name = format!("f{i}");
            let top = s.top().create(&name).unwrap();
            files.push((si, name, Mutex::new(FileState { top, model: Vec::new(), log: Default::default() })));
        }
    }
    let files = Arc::new(files);
    let stacks = Arc::new(stacks);
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    // UBC_STRESS_BOTTOM_READERS=n: threads reading the bottom layer (default BOTTOM_READERS).
    let bottom: usize =
        std::env::var("UBC_STRESS_BOTTOM_READERS").ok().and_then(|s| s.parse().ok()).unwrap_or(BOTTOM_READERS);
    let nthreads = WORKERS + bottom;
    let busy = Arc::new(Busy {
        since: (0..nthreads).map(|_| AtomicU64::new(0)).collect(),
        what: (0..nthreads).map(|_| Mutex::new(String::new())).collect(),
    });
    let ops = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(Mutex::new(std::collections::BTreeMap::<Op, (u64, Duration)>::new()));

    // Watchdog: any operation running past STALL fails the whole run, loudly.
    let joined = Arc::new(AtomicBool::new(false));
    let wd = {
        let (busy, joined) = (busy.clone(), joined.clone());
        std::thread::spawn(move || {
            // Until every worker is joined: an operation stalled while the run stops counts.
            while !joined.load(SeqCst) {
                std::thread::sleep(Duration::from_millis(100));
                let now = start.elapsed().as_millis() as u64;
                for (t, s) in busy.since.iter().enumerate() {
                    let s = s.load(SeqCst);
                    // Saturating: an operation may have started after `now` was taken.
                    if s != 0 && now.saturating_sub(s) > STALL.as_millis() as u64 {
                        eprintln!("WATCHDOG: thread {t} stuck {} ms in {}", now - s, busy.what[t].lock());
                        eprintln!("seed {seed}");
                        dump_threads();
                        std::process::abort();
                    }
                }
            }
        })
    };
    // Memory sampler.
    let sampler = {
        let (cache, stop) = (cache.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut max_alloc, mut max_res, mut n) = (0u64, 0u64, 0u64);
            while !stop.load(SeqCst) {
                let st = cache.stats();
                max_alloc = max_alloc.max(st.allocated_bytes);
                max_res = max_res.max(st.totals.resident_bytes);
                // The gauges read while pages move between objects: a page counted out
                // before it is counted in must not wrap them below zero (in a debug build
                // `Cache::stats` would overflow summing them). Slack: the dirty total is
                // summed object by object while pages move.
                assert!(
                    st.totals.dirty_bytes <= 2 * BUDGET && st.unclean_bytes <= 2 * BUDGET,
                    "stats read garbage: {st:?}"
                );
                n += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            (n, max_alloc, max_res)
        })
    };

    let mut threads = Vec::new();
    for t in 0..nthreads {
        let (files, stacks, stop, busy, ops, lat) =
            (files.clone(), stacks.clone(), stop.clone(), busy.clone(), ops.clone(), latencies.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let bottom_reader = t >= WORKERS;
            let mut buf = vec![0u8; 256 << 10];
            while !stop.load(SeqCst) {
                let fi = rng.random_range(0..files.len());
                let (si, name, state) = &files[fi];
                let op = if bottom_reader {
                    Op::BottomRead
                } else {
                    match rng.random_range(0..100) {
                        0..40 => Op::Read,
                        40..75 => Op::Write,
                        75..88 => Op::MapStore,
                        88..95 => Op::SetLen,
                        _ => Op::Sync,
                    }
                };
                *busy.what[t].lock() = format!("{op:?} on {name} of stack {si}");
                busy.since[t].store(start.elapsed().as_millis().max(1) as u64, SeqCst);
                let t0 = Instant::now();
                match op {
                    Op::BottomRead => {
                        // The ciphertext under a file others are writing: the manager must
                        // write their pages down first; only errors are checked here.
                        let f = stacks[*si].layer(0).unwrap().open(name).unwrap();
                        let len = f.len().unwrap();
                        let off = rng.random_range(0..=len);
                        let n = rng.random_range(1..=buf.len());
                        f.read_at(&mut buf[..n], off).unwrap();
                    }
                    _ => {
                        let mut st = state.lock();
                        let st = &mut *st;
                        let len = st.model.len() as u64;
                        match op {
                            Op::Read => {
                                let off = rng.random_range(0..=len);
                                let n = rng.random_range(1..=buf.len());
                                let got = st.top.read_at(&mut buf[..n], off).unwrap();
                                let want = &st.model[off as usize..(off as usize + n).min(st.model.len())];
                                assert_eq!(got, want.len(), "{name}@{si}: read length at {off}");
                                if buf[..got] != *want {
                                    let first = buf[..got].iter().zip(want).position(|(a, b)| a != b).unwrap();
                                    let last = buf[..got].iter().zip(want).rposition(|(a, b)| a != b).unwrap();
                                    let mut again = vec![0u8; got];
                                    st.top.read_exact_at(&mut again, off).unwrap();
                                    eprintln!("HISTORY of {name}@{si}:\n{}", st.dump());
                                    panic!(
                                        "{name}@{si}: read at {off}+{n} differs from the model at file bytes {}..={} (seed {seed}); \
                                         a second read {} the model; got {:02x?} want {:02x?}",
                                        off + first as u64,
                                        off + last as u64,
                                        if again == *want { "matches" } else { "still differs from" },
                                        &buf[first..(first + 8).min(got)],
                                        &want[first..(first + 8).min(got)],
                                    );
                                }
                            }
                            Op::Write => {
                                let off = rng.random_range(0..MAX_FILE - 1);
                                let n = rng.random_range(1..=(MAX_FILE - off).min(128 << 10)) as usize;
                                let data = fill(&mut rng, n);
                                assert_eq!(st.top.write_at(&data, off).unwrap(), n);
                                let end = off as usize + n;
                                if st.model.len() < end {
                                    st.model.resize(end, 0);
                                }
                                st.model[off as usize..end].copy_from_slice(&data);
                                st.note(format!("{:?} write {off}..{end} (len {len}->{})", start.elapsed(), st.model.len()));
                            }
                            Op::MapStore if len >= 4096 => {
                                let pages = len / 4096;
                                let p0 = rng.random_range(0..pages);
                                let np = rng.random_range(1..=(pages - p0).min(16));
                                let mut m = st.top.map(p0 * 4096..(p0 + np) * 4096, ubc::Access::ReadWrite, ubc::Sharing::Shared).unwrap();
                                for _ in 0..rng.random_range(1..8) {
                                    let o = rng.random_range(0..np * 4096) as usize;
                                    let n = rng.random_range(1..=(np as usize * 4096 - o).min(3000));
                                    let data = fill(&mut rng, n);
                                    m[o..o + n].copy_from_slice(&data);
                                    let mo = (p0 * 4096) as usize + o;
                                    st.model[mo..mo + n].copy_from_slice(&data);
                                }
                                if m[..] != st.model[(p0 * 4096) as usize..((p0 + np) * 4096) as usize] {
                                    let w = &st.model[(p0 * 4096) as usize..((p0 + np) * 4096) as usize];
                                    let first = m.iter().zip(w).position(|(a, b)| a != b).unwrap();
                                    let last = m.iter().zip(w).rposition(|(a, b)| a != b).unwrap();
                                    eprintln!("HISTORY of {name}@{si}:\n{}", st.dump());
                                    panic!("{name}@{si}: mapping of pages {p0}+{np} differs at file bytes {}..={}; got {:02x?} want {:02x?}", p0 * 4096 + first as u64, p0 * 4096 + last as u64, &m[first..(first + 8).min(m.len())], &w[first..(first + 8).min(w.len())]);
                                }
                                let fl = rng.random_bool(0.5);
                                if fl {
                                    m.flush().unwrap();
                                }
                                drop(m);
                                st.note(format!("{:?} mapstore pages {p0}+{np} flush {fl}", start.elapsed()));
                                if std::env::var("UBC_STRESS_CHECK_MAP").is_ok() {
                                    let w = st.model[(p0 * 4096) as usize..((p0 + np) * 4096) as usize].to_vec();
                                    let mut g = vec![0u8; w.len()];
                                    st.top.read_exact_at(&mut g, p0 * 4096).unwrap();
                                    if g != w {
                                        let first = g.iter().zip(&w).position(|(a, b)| a != b).unwrap();
                                        eprintln!("HISTORY of {name}@{si}:\n{}", st.dump());
                                        panic!("{name}@{si}: right after unmapping, pages {p0}+{np} differ at {}", p0 * 4096 + first as u64);
                                    }
                                }
                            }
                            Op::MapStore => {}
                            Op::SetLen => {
                                let new = rng.random_range(0..MAX_FILE);
                                st.top.set_len(new).unwrap();
                                st.model.resize(new as usize, 0);
                                st.note(format!("set_len {len} -> {new}"));
                            }
                            Op::Sync => {
                                st.top.sync().unwrap();
                                st.note("sync".into());
                            }
                            Op::BottomRead => unreachable!(),
                        }
                    }
                }
                let dt = t0.elapsed();
                busy.since[t].store(0, SeqCst);
                ops.fetch_add(1, Relaxed);
                let mut l = lat.lock();
                let e = l.entry(op).or_insert((0, Duration::ZERO));
                e.0 += 1;
                e.1 = e.1.max(dt);
            }
        }));
    }
    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, SeqCst);
    for t in threads {
        t.join().expect("a worker failed (see its panic above)");
    }
    joined.store(true, SeqCst);
    let (samples, max_alloc, max_res) = sampler.join().unwrap();
    wd.join().unwrap();

    // Everything synced, then read back through fresh stacks with a fresh cache.
    for (_, _, st) in files.iter() {
        st.lock().top.sync().unwrap();
    }
    let fresh = ubc::Cache::new(64 << 20).unwrap();
    for (si, name, st) in files.iter() {
        let s = Stack::open(&specs[*si], fresh.clone()).unwrap();
        let f = s.top().open_with(name, OpenOptions::default()).unwrap();
        let model = &st.lock().model;
        let mut v = vec![0u8; f.len().unwrap() as usize];
        f.read_exact_at(&mut v, 0).unwrap();
        assert!(v == *model, "{name}@{si}: stored content differs from the model after sync (seed {seed})");
    }

    let st = cache.stats();
    let limit = BUDGET + BUDGET / 20;
    println!(
        "stress: {} ops in {:.1} s by {nthreads} threads on {} files; memory samples {samples}, max allocated {:.2} MiB, max resident {:.2} MiB, budget {:.2} MiB; writeback errors {}, evictions {}",
        ops.load(SeqCst),
        start.elapsed().as_secs_f64(),
        files.len(),
        max_alloc as f64 / 1048576.0,
        max_res as f64 / 1048576.0,
        BUDGET as f64 / 1048576.0,
        st.totals.writeback_errors,
        st.daemon_evictions,
    );
    for (op, (n, max)) in latencies.lock().iter() {
        println!("stress: {op:?}: {n} ops, longest {:.1} ms", max.as_secs_f64() * 1e3);
    }
    assert!(max_alloc <= limit, "allocated {max_alloc} > budget + 5% ({limit})");
    assert!(max_res <= BUDGET, "resident {max_res} > budget {BUDGET}");
}

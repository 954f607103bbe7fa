//! Crash consistency: a writer runs in a child process (this test binary, re-executed with
//! `UBC_CRASH_CHILD` set), is killed with `SIGKILL` at a random point, and the parent reopens
//! the stack in a fresh `ubc::Cache` and checks every file through every layer.
//!
//! The child journals to a plain host file (length-prefixed, CRC-checked records, so a torn
//! last record is detected and ignored): the intent of every operation *before* it is issued,
//! and a "synced" record only after a `sync` *returned* Ok. The checker replays the journal:
//! for each file, `S_0` is its content at its last completed sync, and `S_1..S_n` the states
//! reachable by applying the operations logged after it, in order. It then checks what each
//! stack promises after a process crash (the kernel keeps what reached it):
//!
//! * **`dir`** (host file) — per 4 KiB page: the bytes below the file's length equal the same
//!   bytes of some `S_k` (zero past its end), and the length lies between the smallest and
//!   the largest `len(S_k)`. (Write-behind writes pages back in any order and at any time.)
//!   Three finer cases, all allowed and counted: (a) a truncation reaches the host file at
//!   once (`ftruncate`) while earlier writes may still be only in ubc's cache, so the page
//!   holding the new end may show an older `S_k` cut at that later length; (b) ubc's file
//!   pager writes a run ending inside a page as an O_DIRECT prefix and a buffered tail (two
//!   system calls), so such a page may be old/new per direct-I/O sector (512 bytes here);
//!   (c) a store through a mapping is many CPU stores, and a page may be written back between
//!   two of them (the copy faulting on a later page gives the flusher time to): a page
//!   touched by such a store may hold any of its bytes new and the rest as before it.
//! * **`dir | aead`** — per 4 KiB block: the block equals that block of some `S_k` (or of an
//!   older `S_k` cut by a later `set_len`, or part way through a mapped store, as above),
//!   *or*, only for a block an operation after the last sync wrote, truncated or zero-filled,
//!   it fails authentication (`AuthError`: a torn stored block — 4136 stored bytes straddle
//!   two host pages, which reach the file at different times — or a block past what the
//!   store holds). The length is exactly some `len(S_k)`. Never garbage, never an error on
//!   a block no operation touched since the last sync. (A never-synced file shows length 0
//!   until its first sync or `set_len`.)
//! * **`dir | zstd`, `dir | zstd | aead`, `dir | aead | zstd`** — the file is exactly one
//!   commit: `S_0`, or the state at a `Mapping::flush` since (at a general layer it syncs the
//!   whole file), or the newest state if a `sync` or the close was in flight at the kill.
//!   Every lower layer must open and read; in `dir | aead | zstd` the aead layer may show torn
//!   blocks only in space the committed zstd index does not reference (counted), since the
//!   top read succeeding proves the rest.
//!
//! In every stack: a file synced before the kill opens through the top and every lower layer,
//! and its synced bytes are there byte for byte (the rules above with no later operation
//! reduce to exactly `S_0`). A file created after the last sync may be missing.
//!
//! `UBC_CRASH_ITERATIONS` (default 3) sets the runs per stack, `UBC_CRASH_SEED` the base seed;
//! a long run: `UBC_CRASH_ITERATIONS=300 cargo test --release -p ubc-stack --test crash`.
//! Each stack prints a summary line to stderr.

use rand::{RngExt, SeedableRng, rngs::StdRng};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use ubc_stack::Stack;
use ubc_stack::encrypt::{AuthError, Key};

const CHILD_ENV: &str = "UBC_CRASH_CHILD";
const PAGE: u64 = 4096;
/// Files stay below this length (small enough to model every reachable state).
const MAX_LEN: u64 = 160 << 10;
/// Operations a child does at most (the parent kills it at a random one before that).
const MAX_OPS: u64 = 150;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Model {
    /// A host file: per page old or new, length between the extremes.
    Page,
    /// aead over a host file: per block old or new, or (touched blocks only) an AuthError.
    Block,
    /// zstd in the stack: exactly a committed state; per page after an msync.
    Commit,
}

struct Kind {
    name: &'static str,
    tail: &'static str,
    model: Model,
}

const STACKS: &[Kind] = &[
    Kind { name: "dir", tail: "", model: Model::Page },
    Kind { name: "dir|zstd", tail: " | zstd:chunk=16K", model: Model::Commit },
    Kind { name: "dir|aead", tail: " | aead:keyfile=KEY", model: Model::Block },
    Kind { name: "dir|zstd|aead", tail: " | zstd:chunk=16K | aead:keyfile=KEY", model: Model::Commit },
    Kind { name: "dir|aead|zstd", tail: " | aead:keyfile=KEY | zstd:chunk=16K", model: Model::Commit },
];

fn spec(kind: &Kind, dir: &Path) -> String {
    let key = dir.join("key");
    format!("dir:{}{}", dir.join("data").display(), kind.tail.replace("KEY", &key.display().to_string()))
}

// ------------------------------------------------------------------------------------ data

/// The bytes of a write: incompressible, patterned, low-entropy text, or (rarely) zeros —
/// regenerated by the checker from the seed.
fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut r = StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    match seed % 8 {
        0..=3 => r.fill(&mut v[..]),
        4 | 5 => {
            let mut pat = [0u8; 24];
            r.fill(&mut pat[..]);
            for (i, b) in v.iter_mut().enumerate() {
                *b = pat[i % 24];
            }
        }
        6 => {
            for b in v.iter_mut() {
                *b = b'a' + r.random_range(0..4u8);
            }
        }
        _ => {
            if seed % 64 != 7 {
                r.fill(&mut v[..]);
            }
        }
    }
    v
}

fn apply_write(v: &mut Vec<u8>, off: u64, data: &[u8]) {
    let end = off as usize + data.len();
    if v.len() < end {
        v.resize(end, 0);
    }
    v[off as usize..end].copy_from_slice(data);
}

// --------------------------------------------------------------------------------- journal

#[derive(Clone, Debug, PartialEq)]
enum Rec {
    Create(String),
    /// `map`: stored through a shared mapping (never extends the file).
    Write {
        f: String,
        off: u64,
        len: u64,
        seed: u64,
        map: bool,
    },
    SetLen {
        f: String,
        len: u64,
    },
    /// `Mapping::flush` (an msync: commits what was written back so far).
    MapFlush(String),
    /// `File::write_back` (what the mount does at `close`: the file pushed through every
    /// layer into the store; through zstd a published commit, not waited for).
    WriteBack(String),
    /// Intent to sync one file (`None`: `Stack::sync_all`).
    Sync(Option<String>),
    /// That sync returned Ok.
    Synced(Option<String>),
    /// The writer is about to drop its files and stack (a clean close: everything is
    /// written back, each zstd file commits as its pager goes).
    Closing,
    /// It did.
    Closed,
}

impl Rec {
    fn encode(&self) -> String {
        let o = |f: &Option<String>| f.clone().unwrap_or_else(|| "*".into());
        match self {
            Rec::Create(f) => format!("C {f}"),
            Rec::Write { f, off, len, seed, map } => format!("{} {f} {off} {len} {seed}", if *map { "M" } else { "W" }),
            Rec::SetLen { f, len } => format!("T {f} {len}"),
            Rec::MapFlush(f) => format!("F {f}"),
            Rec::WriteBack(f) => format!("P {f}"),
            Rec::Sync(f) => format!("S {}", o(f)),
            Rec::Synced(f) => format!("D {}", o(f)),
            Rec::Closing => "Q".into(),
            Rec::Closed => "X".into(),
        }
    }

    fn decode(s: &str) -> Option<Rec> {
        let w: Vec<&str> = s.split(' ').collect();
        let n = |i: usize| w.get(i).and_then(|x| x.parse::<u64>().ok());
        let f = || w.get(1).map(|x| x.to_string());
        let o = || f().map(|x| if x == "*" { None } else { Some(x) });
        Some(match *w.first()? {
            "C" => Rec::Create(f()?),
            "W" | "M" => Rec::Write { f: f()?, off: n(2)?, len: n(3)?, seed: n(4)?, map: w[0] == "M" },
            "T" => Rec::SetLen { f: f()?, len: n(2)? },
            "F" => Rec::MapFlush(f()?),
            "P" => Rec::WriteBack(f()?),
            "S" => Rec::Sync(o()?),
            "D" => Rec::Synced(o()?),
            "Q" => Rec::Closing,
            "X" => Rec::Closed,
            _ => return None,
        })
    }
}

struct Journal(std::fs::File);

impl Journal {
    fn create(path: &Path) -> Journal {
        Journal(std::fs::OpenOptions::new().create_new(true).append(true).open(path).expect("journal"))
    }

    /// One record, one `write(2)`: `[len u32][crc32 u32][payload]`.
    fn log(&mut self, r: &Rec) {
        let p = r.encode().into_bytes();
        let mut b = Vec::with_capacity(8 + p.len());
        b.extend_from_slice(&(p.len() as u32).to_le_bytes());
        b.extend_from_slice(&crc32fast::hash(&p).to_le_bytes());
        b.extend_from_slice(&p);
        self.0.write_all(&b).expect("journal write");
    }
}

/// The records of a journal, and whether its last record was torn (ignored).
fn read_journal(path: &Path) -> Result<(Vec<Rec>, bool), String> {
    let b = std::fs::read(path).map_err(|e| format!("journal: {e}"))?;
    let mut out = Vec::new();
    let mut pos = 0usize;
    while pos < b.len() {
        if pos + 8 > b.len() {
            return Ok((out, true));
        }
        let len = u32::from_le_bytes(b[pos..pos + 4].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(b[pos + 4..pos + 8].try_into().unwrap());
        let end = pos + 8 + len;
        if end > b.len() {
            return Ok((out, true));
        }
        let p = &b[pos + 8..end];
        if crc32fast::hash(p) != crc {
            if end == b.len() {
                return Ok((out, true));
            }
            return Err(format!("journal record at {pos} is damaged and not the last"));
        }
        let s = std::str::from_utf8(p).map_err(|_| format!("journal record at {pos}: not utf-8"))?;
        out.push(Rec::decode(s).ok_or_else(|| format!("journal record at {pos}: {s:?}"))?);
        pos = end;
    }
    Ok((out, false))
}

// ----------------------------------------------------------------------------------- child

struct ChildCfg {
    stack: usize,
    seed: u64,
    budget: u64,
    fast_flusher: bool,
    dir: PathBuf,
}

impl ChildCfg {
    fn encode(&self) -> String {
        format!("{};{};{};{};{}", self.stack, self.seed, self.budget, self.fast_flusher as u8, self.dir.display())
    }
    fn decode(s: &str) -> ChildCfg {
        let p: Vec<&str> = s.splitn(5, ';').collect();
        ChildCfg {
            stack: p[0].parse().unwrap(),
            seed: p[1].parse().unwrap(),
            budget: p[2].parse().unwrap(),
            fast_flusher: p[3] == "1",
            dir: PathBuf::from(p[4]),
        }
    }
}

fn read_all(f: &ubc_stack::File) -> ubc_stack::Result<Vec<u8>> {
    let mut v = vec![0u8; f.len()? as usize];
    f.read_exact_at(&mut v, 0)?;
    Ok(v)
}

/// The writer. Every operation's intent is journaled before it is issued; syncs are
/// journaled as done after they return. Reads are checked against the child's own model.
fn child_main(cfg: ChildCfg) {
    let kind = &STACKS[cfg.stack];
    let mut b = ubc::Cache::builder().budget(cfg.budget);
    if cfg.fast_flusher {
        b = b.writeback(Duration::from_millis(5), Duration::from_millis(5));
    }
    let stack = Stack::open(&spec(kind, &cfg.dir), b.build().unwrap()).unwrap();
    let mut j = Journal::create(&cfg.dir.join("journal"));
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut files: Vec<(String, ubc_stack::File, Vec<u8>)> = Vec::new();
    for name in ["a", "b", "c"] {
        j.log(&Rec::Create(name.into()));
        files.push((name.into(), stack.top().create(name).unwrap(), Vec::new()));
    }
    j.log(&Rec::Sync(None));
    stack.sync_all().unwrap();
    j.log(&Rec::Synced(None));
    let mut next_seed = cfg.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for op in 1..=MAX_OPS {
        println!("CRASHOP {op}");
        next_seed = next_seed.wrapping_add(1);
        let r = rng.random_range(0..100);
        if (88..90).contains(&r) && files.len() < 6 {
            let name = format!("n{}", files.len());
            j.log(&Rec::Create(name.clone()));
            let f = stack.top().create(&name).unwrap();
            files.push((name, f, Vec::new()));
            continue;
        }
        let fi = rng.random_range(0..files.len());
        let (name, f, model) = &mut files[fi];
        let len = model.len() as u64;
        match r {
            // Writes: unaligned, small to several chunks, sometimes past the end (a gap).
            0..45 => {
                let off = rng.random_range(0..=(len + (24 << 10)).min(MAX_LEN - 1));
                let max = match rng.random_range(0..4) {
                    0 => 100,
                    1 => 6000,
                    _ => 40 << 10,
                };
                let n = rng.random_range(1..=max.min(MAX_LEN - off));
                let data = payload(next_seed, n as usize);
                j.log(&Rec::Write { f: name.clone(), off, len: n, seed: next_seed, map: false });
                assert_eq!(f.write_at(&data, off).unwrap(), n as usize);
                apply_write(model, off, &data);
            }
            45..55 => {
                let new = match rng.random_range(0..4) {
                    0 => 0,
                    1 => rng.random_range(0..=len),
                    2 => rng.random_range(0..MAX_LEN) / PAGE * PAGE,
                    _ => rng.random_range(0..MAX_LEN),
                };
                j.log(&Rec::SetLen { f: name.clone(), len: new });
                f.set_len(new).unwrap();
                model.resize(new as usize, 0);
            }
            // The mount's close of a written file: pushed into the store, not synced.
            63..67 => {
                j.log(&Rec::WriteBack(name.clone()));
                f.write_back().unwrap();
            }
            // Stores through a shared mapping, flushed (msync) half of the time.
            55..63 if len > 0 => {
                let off = rng.random_range(0..len);
                let n = rng.random_range(1..=(12 << 10).min(len - off));
                let data = payload(next_seed, n as usize);
                j.log(&Rec::Write { f: name.clone(), off, len: n, seed: next_seed, map: true });
                let mut m = f.map(off..off + n, ubc::Access::ReadWrite, ubc::Sharing::Shared).unwrap();
                m[..].copy_from_slice(&data);
                apply_write(model, off, &data);
                if rng.random_bool(0.5) {
                    j.log(&Rec::MapFlush(name.clone()));
                    m.flush().unwrap();
                }
                drop(m);
            }
            75..85 => {
                j.log(&Rec::Sync(Some(name.clone())));
                f.sync().unwrap();
                j.log(&Rec::Synced(Some(name.clone())));
            }
            85..88 => {
                j.log(&Rec::Sync(None));
                stack.sync_all().unwrap();
                j.log(&Rec::Synced(None));
            }
            90..95 => {
                let off = rng.random_range(0..MAX_LEN);
                let n = rng.random_range(1..64u64);
                let data = payload(next_seed, n as usize);
                j.log(&Rec::Write { f: name.clone(), off, len: n, seed: next_seed, map: false });
                assert_eq!(f.write_at(&data, off).unwrap(), n as usize);
                apply_write(model, off, &data);
            }
            // Reads, checked against the model (through the cache: eviction, read-ahead).
            _ => {
                let off = rng.random_range(0..=len);
                let n = rng.random_range(0..=(48u64 << 10));
                let mut buf = vec![0u8; n as usize];
                let got = f.read_at(&mut buf, off).unwrap();
                let want = &model[(off as usize).min(model.len())..((off + n) as usize).min(model.len())];
                assert!(got <= want.len(), "{name}: read {got} bytes at {off}, file has {}", model.len());
                assert!(buf[..got] == want[..got], "{name}: read at {off} differs from what was written");
            }
        }
    }
    j.log(&Rec::Closing);
    println!("CRASHCLOSE");
    drop(files);
    drop(stack);
    j.log(&Rec::Closed);
    println!("CRASHDONE");
}

#[test]
fn crash_child() {
    if let Ok(cfg) = std::env::var(CHILD_ENV) {
        child_main(ChildCfg::decode(&cfg));
    }
}

// --------------------------------------------------------------------------------- checker

/// One file's history since its last completed sync.
#[derive(Default, Clone)]
struct Hist {
    /// Ever synced (else it may be missing, and `S_0` is empty).
    synced: bool,
    /// `states[0]` = content at the last completed sync; `states[k]` after `k` more
    /// content-changing operations.
    states: Vec<Vec<u8>>,
    /// Blocks (4 KiB) an operation since the last sync wrote, zero-filled or truncated.
    touched: BTreeSet<u64>,
    /// A mapping flush (msync) was issued since the last completed sync.
    msync: bool,
    /// States a mapping flush (an msync: a full sync at a general layer) may have committed.
    commit_points: Vec<usize>,
    /// `(j, len)`: `states[j]` came from a `set_len(len)`. A truncation reaches the store at
    /// once, while earlier writes may still be in the cache.
    cuts: Vec<(usize, u64)>,
    /// `k`: `states[k]` came from a store through a mapping. That store is many CPU stores
    /// (glibc's `memcpy` writes the unaligned head last, after the aligned body), and a page
    /// can be written back between two of them: when the copy faults on a later page, the
    /// fault takes long enough for the flusher to harvest and write back the page already
    /// half stored (the kernel's own writeback does the same to a mapped page). If the page
    /// stored again after is lost to the kill, the store holds a block with any of the
    /// copy's bytes new and the others as in `states[k - 1]`.
    mapped: Vec<usize>,
    /// The last record is a sync intent that has no "done" record.
    sync_in_flight: bool,
    /// The writer was closing its files (a clean close commits everything).
    closing: bool,
}

impl Hist {
    fn cur(&self) -> &Vec<u8> {
        self.states.last().unwrap()
    }
    fn reset(&mut self) {
        let c = self.cur().clone();
        *self = Hist { synced: true, states: vec![c], ..Default::default() };
    }
    fn touch(&mut self, from: u64, to: u64) {
        for b in from / PAGE..to.div_ceil(PAGE) {
            self.touched.insert(b);
        }
    }
}

fn replay(recs: &[Rec]) -> Result<BTreeMap<String, Hist>, String> {
    let mut files: BTreeMap<String, Hist> = BTreeMap::new();
    let last = recs.len().saturating_sub(1);
    for (i, r) in recs.iter().enumerate() {
        for h in files.values_mut() {
            h.sync_in_flight = false;
        }
        match r {
            Rec::Create(f) => {
                files.insert(f.clone(), Hist { states: vec![Vec::new()], ..Default::default() });
            }
            Rec::Write { f, off, len, seed, map } => {
                let h = files.get_mut(f).ok_or_else(|| format!("journal: {f} used before created"))?;
                let old = h.cur().len() as u64;
                let mut s = h.cur().clone();
                apply_write(&mut s, *off, &payload(*seed, *len as usize));
                // A write past the end zero-fills the gap (aead writes zero blocks there,
                // from the first block past the old end).
                let from = if *off > old && !*map { (*off).min(old.div_ceil(PAGE) * PAGE) } else { *off };
                h.touch(from, off + len);
                h.states.push(s);
                if *map {
                    h.mapped.push(h.states.len() - 1);
                }
            }
            Rec::SetLen { f, len } => {
                let h = files.get_mut(f).ok_or_else(|| format!("journal: {f} used before created"))?;
                let old = h.cur().len() as u64;
                let mut s = h.cur().clone();
                s.resize(*len as usize, 0);
                h.touch(old.min(*len), old.max(*len).max(old.min(*len) + 1));
                h.states.push(s);
                h.cuts.push((h.states.len() - 1, *len));
            }
            Rec::MapFlush(f) => {
                let h = files.get_mut(f).ok_or_else(|| format!("journal: {f} used before created"))?;
                h.msync = true;
                h.commit_points.push(h.states.len() - 1);
            }
            // A published commit is one more state the store may hold whole (never a mix:
            // its index and extents reach the host file before its superblock).
            Rec::WriteBack(f) => {
                let h = files.get_mut(f).ok_or_else(|| format!("journal: {f} used before created"))?;
                h.commit_points.push(h.states.len() - 1);
            }
            Rec::Sync(f) => {
                for (name, h) in files.iter_mut() {
                    if f.as_deref().is_none_or(|x| x == name) {
                        h.sync_in_flight = i == last;
                    }
                }
            }
            Rec::Synced(f) => {
                for (name, h) in files.iter_mut() {
                    if f.as_deref().is_none_or(|x| x == name) {
                        h.reset();
                    }
                }
            }
            Rec::Closing => {
                for h in files.values_mut() {
                    h.closing = true;
                }
            }
            Rec::Closed => {
                for h in files.values_mut() {
                    h.reset();
                }
            }
        }
    }
    Ok(files)
}

#[derive(Default, Debug)]
struct Tally {
    iterations: u64,
    killed: u64,
    /// Of those, killed while closing its files and stack.
    killed_in_close: u64,
    completed: u64,
    files: u64,
    ops_sum: u64,
    ops_min: u64,
    ops_max: u64,
    torn_journal: u64,
    /// Files equal to their last synced state.
    exact_synced: u64,
    /// Files equal to the state an in-flight sync was committing (or the newest state).
    exact_newest: u64,
    /// Files in some other valid state (per page/block old or new).
    mixed: u64,
    /// Files created after the last sync that are missing.
    absent: u64,
    /// Host-file pages old or new only per direct-I/O sector (dir only).
    sector_torn: u64,
    /// Pages (blocks) holding an older state's bytes cut by a later truncation.
    cut_pages: u64,
    /// Pages (blocks) written back part way through a store made through a mapping.
    torn_stores: u64,
    /// Blocks failing authentication at the top (dir|aead only; touched blocks).
    auth_blocks: u64,
    /// Blocks failing authentication in a lower aead layer (unreferenced by zstd).
    lower_auth_blocks: u64,
    /// Writers that stopped making progress (killed and checked; the run fails).
    hangs: Vec<String>,
}

fn is_auth(e: &ubc_stack::Error) -> bool {
    AuthError::find(e).is_some()
}

/// Per-block contents of `f` at the top: `Ok(bytes)` or the error of that block alone.
fn read_blocks(f: &ubc_stack::File, len: u64) -> Vec<Result<Vec<u8>, ubc_stack::Error>> {
    let mut out = Vec::new();
    for b in 0..len.div_ceil(PAGE) {
        let n = (len - b * PAGE).min(PAGE) as usize;
        let mut buf = vec![0u8; n];
        out.push(f.read_exact_at(&mut buf, b * PAGE).map(|()| buf));
    }
    out
}

/// Whether `got` (bytes `[at, at+got.len())` of the file) equals those bytes of `state`
/// (zero past its end).
fn same_range(state: &[u8], at: u64, got: &[u8]) -> bool {
    got.iter().enumerate().all(|(i, &b)| state.get(at as usize + i).copied().unwrap_or(0) == b)
}

/// [`same_range`] against `state` truncated to `cut` (zero from there on).
fn same_range_cut(state: &[u8], at: u64, got: &[u8], cut: u64) -> bool {
    got.iter().enumerate().all(|(i, &b)| {
        let o = at + i as u64;
        (if o >= cut { 0 } else { state.get(o as usize).copied().unwrap_or(0) }) == b
    })
}

/// Whether each byte of `got` (bytes `[at, at+got.len())` of the file) equals that byte of
/// `old` or of `new` (zero past their ends): a store from `old` to `new` written back part
/// way.
fn mixed_range(old: &[u8], new: &[u8], at: u64, got: &[u8]) -> bool {
    got.iter().enumerate().all(|(i, &b)| {
        let o = at as usize + i;
        old.get(o).copied().unwrap_or(0) == b || new.get(o).copied().unwrap_or(0) == b
    })
}

/// How bytes `got` at `at` fit the reachable states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fit {
    /// Equal to some `S_k`.
    State,
    /// Equal to some `S_k` cut at the length of a later `set_len`.
    Cut,
    /// Part way through a store made through a mapping (see `Hist::mapped`).
    TornStore,
}

/// How `got` (bytes at `at`) relates to the reachable states, if at all.
fn classify(h: &Hist, at: u64, got: &[u8]) -> Option<Fit> {
    if h.states.iter().any(|s| same_range(s, at, got)) {
        return Some(Fit::State);
    }
    let cut = h
        .states
        .iter()
        .enumerate()
        .any(|(k, s)| h.cuts.iter().any(|&(j, len)| j > k && same_range_cut(s, at, got, len)));
    if cut {
        return Some(Fit::Cut);
    }
    let torn = h.mapped.iter().any(|&k| mixed_range(&h.states[k - 1], &h.states[k], at, got));
    torn.then_some(Fit::TornStore)
}

fn fresh_stack(kind: &Kind, dir: &Path, readahead: bool) -> Stack {
    let mut b = ubc::Cache::builder().budget(64 << 20);
    if !readahead {
        b = b.readahead(4096, 0);
    }
    Stack::open(&spec(kind, dir), b.build().unwrap()).unwrap()
}

/// Check one file against its history; updates the tally.
fn check_file(kind: &Kind, dir: &Path, name: &str, h: &Hist, t: &mut Tally) -> Result<(), String> {
    let host = dir.join("data").join(name);
    if !host.exists() {
        if h.synced {
            return Err(format!("{name}: synced file is missing"));
        }
        t.absent += 1;
        return Ok(());
    }
    t.files += 1;
    let stack = fresh_stack(kind, dir, true);
    let top = stack.top().open(name).map_err(|e| format!("{name}: open at the top: {e}"))?;
    let len = top.len().map_err(|e| format!("{name}: len: {e}"))?;
    let lens: BTreeSet<u64> = h.states.iter().map(|s| s.len() as u64).collect();
    let (min, max) = (*lens.first().unwrap(), *lens.last().unwrap());
    let whole = read_all(&top);
    let blocks: Vec<Result<Vec<u8>, ubc_stack::Error>> = match &whole {
        Ok(v) => v.chunks(PAGE as usize).map(|c| Ok(c.to_vec())).collect(),
        Err(e) => {
            if !(kind.model == Model::Block && is_auth(e)) {
                return Err(format!("{name}: reading {len} bytes at the top: {e}"));
            }
            // Which blocks fail: one at a time, without read-ahead.
            let s = fresh_stack(kind, dir, false);
            let f = s.top().open(name).map_err(|e| format!("{name}: reopen: {e}"))?;
            read_blocks(&f, len)
        }
    };
    let newest = h.cur();
    let exact = |v: &[u8]| whole.as_ref().is_ok_and(|w| w == v);
    let describe = |b: u64| {
        let ks: Vec<usize> = (0..h.states.len())
            .filter(|&k| matches!(&blocks[b as usize], Ok(g) if same_range(&h.states[k], b * PAGE, g)))
            .collect();
        format!(
            "block {b} matches states {ks:?} of {} (len {len}, lens {lens:?}, touched {})",
            h.states.len(),
            h.touched.contains(&b)
        )
    };
    match kind.model {
        Model::Commit => {
            // Exactly a commit: the synced state, one a mapping flush committed (a full sync
            // of the layer), or the newest if a sync or the close was in flight.
            if exact(&h.states[0]) {
                t.exact_synced += 1;
            } else if (h.sync_in_flight || h.closing) && exact(newest) {
                t.exact_newest += 1;
            } else if h.commit_points.iter().any(|&k| exact(&h.states[k])) {
                t.mixed += 1;
            } else {
                let bad = (0..blocks.len() as u64)
                    .find(|&b| !matches!(&blocks[b as usize], Ok(g) if same_range(&h.states[0], b * PAGE, g)));
                return Err(format!(
                    "{name}: not a committed state (len {len}, synced len {}, newest len {}, sync in flight {}, closing {}, msync points {:?}); first differing block vs synced: {:?}",
                    h.states[0].len(),
                    newest.len(),
                    h.sync_in_flight,
                    h.closing,
                    h.commit_points,
                    bad.map(describe)
                ));
            }
        }
        _ => {
            let len_ok = match kind.model {
                Model::Page => (min..=max).contains(&len),
                _ => lens.contains(&len),
            };
            if !len_ok {
                return Err(format!("{name}: length {len} is no reachable state's (lens {lens:?})"));
            }
            // A host file's page written back at the end of the file is torn at the
            // direct-I/O alignment: ubc's file pager writes its aligned prefix with O_DIRECT
            // and the tail through a buffered descriptor (two system calls).
            let sector = match kind.model {
                Model::Page => ubc::pager::FilePager::open(&host, ubc::Access::ReadOnly)
                    .ok()
                    .and_then(|p| p.direct_alignment())
                    .map_or(PAGE, |a| a.1 as u64),
                _ => PAGE,
            };
            for (b, r) in blocks.iter().enumerate() {
                let b = b as u64;
                match r {
                    Ok(got) => match classify(h, b * PAGE, got) {
                        Some(Fit::State) => {}
                        Some(Fit::Cut) => t.cut_pages += 1,
                        Some(Fit::TornStore) => t.torn_stores += 1,
                        None => {
                            let by_sector = got
                                .chunks(sector as usize)
                                .enumerate()
                                .all(|(i, c)| classify(h, b * PAGE + i as u64 * sector, c).is_some());
                            if sector == PAGE || !by_sector {
                                return Err(format!("{name}: garbage: {}", describe(b)));
                            }
                            t.sector_torn += 1;
                        }
                    },
                    Err(e) if kind.model == Model::Block && is_auth(e) && h.touched.contains(&b) => t.auth_blocks += 1,
                    Err(e) => return Err(format!("{name}: block {b}: {e} ({})", describe(b))),
                }
            }
            if exact(&h.states[0]) {
                t.exact_synced += 1;
            } else if exact(newest) {
                t.exact_newest += 1;
            } else {
                t.mixed += 1;
            }
        }
    }
    // Every layer below opens and reads.
    for level in 0..stack.depth() - 1 {
        let s = fresh_stack(kind, dir, true);
        let f = s.layer(level).unwrap().open(name).map_err(|e| format!("{name}: open at layer {level}: {e}"))?;
        if let Err(e) = read_all(&f) {
            let torn_ok = kind.name == "dir|aead|zstd" && level == 1 && is_auth(&e);
            if !torn_ok {
                return Err(format!("{name}: reading layer {level}: {e}"));
            }
            let s = fresh_stack(kind, dir, false);
            let f = s.layer(level).unwrap().open(name).unwrap();
            let l = f.len().unwrap();
            for r in read_blocks(&f, l) {
                match r {
                    Ok(_) => {}
                    Err(e) if is_auth(&e) => t.lower_auth_blocks += 1,
                    Err(e) => return Err(format!("{name}: reading layer {level}: {e}")),
                }
            }
        }
    }
    Ok(())
}

fn check(kind: &Kind, dir: &Path, t: &mut Tally) -> Result<(), String> {
    let (recs, torn) = read_journal(&dir.join("journal"))?;
    t.torn_journal += torn as u64;
    let files = replay(&recs)?;
    for (name, h) in &files {
        check_file(kind, dir, name, h, t)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------- parent

fn iterations() -> u64 {
    std::env::var("UBC_CRASH_ITERATIONS").ok().and_then(|s| s.parse().ok()).unwrap_or(3)
}

fn base_seed() -> u64 {
    std::env::var("UBC_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).unwrap();
        u64::from_le_bytes(b)
    })
}

/// One run: start the writer, kill it at a random operation (plus a random delay), check.
fn one(stack: usize, seed: u64, t: &mut Tally) {
    let kind = &STACKS[stack];
    let tmp = tempfile::Builder::new().prefix("ubc-crash-").tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    std::fs::create_dir(dir.join("data")).unwrap();
    std::fs::write(dir.join("stack"), kind.name).unwrap();
    Key::generate().write_file(&dir.join("key")).unwrap();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let budget = match rng.random_range(0..3) {
        0 => 384 << 10,
        1 => 1 << 20,
        _ => 64 << 20,
    };
    let cfg = ChildCfg { stack, seed, budget, fast_flusher: rng.random_bool(0.5), dir: dir.clone() };
    let target = rng.random_range(1..=MAX_OPS + 8); // past MAX_OPS: the child completes
    // Sometimes kill it while it closes its files and stack (instead of at an operation).
    let kill_in_close = rng.random_bool(0.15);
    let target = if kill_in_close { u64::MAX } else { target };
    let delay = if rng.random_bool(0.3) { 0 } else { rng.random_range(0..4000u64) };
    let stderr = std::fs::File::create(dir.join("stderr")).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, cfg.encode())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    // Lines come through a thread, so that a writer that stops making progress (a
    // deadlock) is noticed even though it prints nothing.
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut reached = 0u64;
    let mut last = Instant::now();
    let mut hung = false;
    loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(line) => {
                last = Instant::now();
                if line == "CRASHCLOSE" && kill_in_close {
                    std::thread::sleep(Duration::from_micros(delay));
                    let _ = child.kill();
                    break;
                }
                if let Some(n) = line.strip_prefix("CRASHOP ") {
                    reached = n.parse().unwrap();
                    if reached == target {
                        std::thread::sleep(Duration::from_micros(delay));
                        let _ = child.kill();
                        break;
                    }
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) if last.elapsed() > HANG => {
                // A hang: its thread stacks are kept, the writer is killed (a crash like
                // any other: the files are checked), and the stack's run fails at the end.
                dump_stacks(child.id(), &dir.join("stacks.txt"));
                let _ = child.kill();
                hung = true;
                break;
            }
            Err(_) => {}
        }
    }
    let status = child.wait().unwrap();
    let killed = status.signal() == Some(libc::SIGKILL);
    if hung {
        t.hangs.push(format!(
            "seed {seed}: no progress for {HANG:?} after op {reached} (budget {budget}); thread stacks, if gdb is installed: {}",
            dir.join("stacks.txt").display()
        ));
    }
    if !killed && !status.success() {
        let err = std::fs::read_to_string(dir.join("stderr")).unwrap_or_default();
        let path = tmp.keep();
        panic!("{}: seed {seed}: the writer failed ({status}), kept {}:\n{err}", kind.name, path.display());
    }
    t.iterations += 1;
    if killed {
        t.killed += 1;
        t.killed_in_close += kill_in_close as u64;
    } else {
        t.completed += 1;
    }
    t.ops_sum += reached;
    t.ops_min = if t.iterations == 1 { reached } else { t.ops_min.min(reached) };
    t.ops_max = t.ops_max.max(reached);
    let r = check(kind, &dir, t);
    let path = if hung || r.is_err() { tmp.keep() } else { dir };
    if let Err(e) = r {
        panic!(
            "{}: seed {seed} (UBC_CRASH_SEED={} UBC_CRASH_ITERATIONS=1 reproduces the writer's choices), killed at op {reached}, budget {budget}: {e}\nkept {}",
            kind.name,
            seed.wrapping_sub(stack as u64),
            path.display()
        );
    }
}

/// No operation of the writer takes this long unless it hangs.
const HANG: Duration = Duration::from_secs(60);

/// Every thread's stack of process `pid`, into `to` (best effort: needs gdb).
fn dump_stacks(pid: u32, to: &Path) {
    let out = Command::new("gdb")
        .args(["-p", &pid.to_string(), "-batch", "-ex", "thread apply all bt 40"])
        .stdin(Stdio::null())
        .output();
    if let Ok(o) = out {
        let _ = std::fs::write(to, [o.stdout, o.stderr].concat());
    }
}

fn run(name: &str) {
    let stack = STACKS.iter().position(|k| k.name == name).unwrap();
    let base = base_seed();
    let mut t = Tally::default();
    let n = iterations();
    for i in 0..n {
        one(stack, base.wrapping_add(i.wrapping_mul(1000)).wrapping_add(stack as u64), &mut t);
    }
    let line = format!(
        "crash {name}: {} iterations (base seed {base}), {} killed ({} while closing), {} completed; {} files checked; ops before kill avg {:.0} (min {}, max {}); \
         outcomes: {} = synced state, {} = newest (sync or close in flight), {} other valid (an msync's commit; per page/block old or new), {} unsynced files absent, {} pages cut by a later truncation, {} pages written back part way through a mapped store, {} pages torn per sector, {} torn blocks (auth errors, unsynced), \
         {} lower aead blocks torn (unreferenced); {} torn journal tails; {} hangs\n",
        t.iterations,
        t.killed,
        t.killed_in_close,
        t.completed,
        t.files,
        t.ops_sum as f64 / t.iterations.max(1) as f64,
        t.ops_min,
        t.ops_max,
        t.exact_synced,
        t.exact_newest,
        t.mixed,
        t.absent,
        t.cut_pages,
        t.torn_stores,
        t.sector_torn,
        t.auth_blocks,
        t.lower_auth_blocks,
        t.torn_journal,
        t.hangs.len()
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
    assert!(t.hangs.is_empty(), "{name}: {} writer(s) hung (deadlock):\n{}", t.hangs.len(), t.hangs.join("\n"));
}

fn in_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

// ------------------------------------------------------------------ deterministic regressions

/// A new aead file's first write-back puts a header on the store *before* its blocks, with
/// the length from before the write (0): a crash then shows the file as it was. The header
/// must reach the store itself first, not only the lower file's cache (a never-synced file
/// grown, written, then truncated to 0 was left as 80 zero bytes: "not an aead file"). It used to
/// be written after the blocks with the new length — a crash in between left blocks without
/// a header ("not an aead file"), and the header's length was one the file never had (found
/// by the crash runs of `dir | aead`: a never-synced file 8192 bytes long, states 0, 4350, …).
#[test]
fn regression_new_aead_file_header_first_with_old_length() {
    use ubc::Pager;
    use ubc_stack::encrypt::EncryptPager;
    let tmp = tempfile::tempdir().unwrap();
    let cache = ubc::Cache::new(16 << 20).unwrap();
    let key = std::sync::Arc::new(Key::generate());
    let lower = cache.create_path(tmp.path().join("f")).unwrap();
    let pager = EncryptPager::open(lower.try_clone().unwrap(), key.clone()).unwrap();
    pager.put_pages(0, &[7u8; 6000]).unwrap();
    assert_eq!(EncryptPager::logical_len(&lower, &key).unwrap(), 0, "the header keeps the old length until a sync");
    // And it is on the store itself, not only in the lower file's cache (whose write-behind
    // may store later pages first; a truncation cuts the store at once).
    let on_disk = std::fs::read(tmp.path().join("f")).unwrap();
    assert!(
        on_disk.starts_with(ubc_stack::encrypt::MAGIC),
        "no header on the store after the first write ({} bytes)",
        on_disk.len()
    );
    let lower3 = cache.create_path(tmp.path().join("h")).unwrap();
    let pager3 = EncryptPager::open(lower3.try_clone().unwrap(), key.clone()).unwrap();
    pager3.set_len(50000).unwrap();
    assert!(
        std::fs::read(tmp.path().join("h")).unwrap().starts_with(ubc_stack::encrypt::MAGIC),
        "no header on the store after growth"
    );
    // A gap (exclusive path) on another new file.
    let lower2 = cache.create_path(tmp.path().join("g")).unwrap();
    let pager2 = EncryptPager::open(lower2.try_clone().unwrap(), key.clone()).unwrap();
    pager2.put_pages(3 * PAGE, &[9u8; 100]).unwrap();
    assert_eq!(EncryptPager::logical_len(&lower2, &key).unwrap(), 0);
    // The sync brings the length.
    pager.sync().unwrap();
    pager2.sync().unwrap();
    assert_eq!(EncryptPager::logical_len(&lower, &key).unwrap(), 6000);
    assert_eq!(EncryptPager::logical_len(&lower2, &key).unwrap(), 3 * PAGE + 100);
}

/// A mapping flush (msync) at a general layer syncs the whole file of that layer, waiting
/// for its write-backs in flight, before the layer commits below. Writing back only the
/// mapped range and then committing would commit half-written a block of the same file that
/// the flusher is writing into the zstd layer at that moment, and after a crash the top of
/// `dir | zstd | aead` would fail authentication on it. The
/// race itself needs a concurrent write-back; this checks what closes it: after the flush,
/// the commit on disk holds every write made before it, not only the mapped range.
#[test]
fn regression_mapping_flush_at_a_general_layer_syncs_the_whole_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir(dir.join("data")).unwrap();
    Key::generate().write_file(&dir.join("key")).unwrap();
    for kind in STACKS.iter().filter(|k| k.model != Model::Page) {
        let name = kind.name.replace('|', "-");
        let s = Stack::open(&spec(kind, dir), ubc::Cache::new(64 << 20).unwrap()).unwrap();
        let f = s.top().create(&name).unwrap();
        f.write_at(&[1u8; 20000], 0).unwrap();
        f.sync().unwrap();
        f.write_at(&[2u8; 5000], 30000).unwrap(); // dirty, outside the mapping
        let mut m = f.map(0..4096, ubc::Access::ReadWrite, ubc::Sharing::Shared).unwrap();
        m[..10].copy_from_slice(&[3u8; 10]);
        m.flush().unwrap();
        // What is on disk now, read by an independent stack and cache.
        let other = fresh_stack(kind, dir, true);
        let got = read_all(&other.top().open(&name).unwrap()).unwrap();
        let mut want = vec![1u8; 20000];
        want[..10].fill(3);
        want.resize(30000, 0);
        want.extend_from_slice(&[2u8; 5000]);
        assert!(got == want, "{}: the flush committed {} bytes, not the file's current state", kind.name, got.len());
        drop(m);
    }
}

/// `dir | aead | zstd`: a crash between two commits may leave any host page written after
/// the first one (write-behind) and the others not. The first commit must read back exactly
/// from every such image: one host page of the second state over the first state's file.
/// Two ways it failed: (1) zstd placed new extents at 512-byte alignment, so a new extent
/// shared an aead block with committed data; rewriting that block re-encrypts it, its 4136
/// stored bytes straddle two host pages, and an image with only one of them made committed
/// data fail authentication; (2) the superblock slots were read in one piece, so a slot torn
/// the same way (the commit in flight) made the whole file unreadable instead of leaving the
/// other slot in force.
#[test]
fn regression_zstd_over_aead_first_commit_survives_every_torn_page_of_the_next() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir(dir.join("data")).unwrap();
    Key::generate().write_file(&dir.join("key")).unwrap();
    let kind = STACKS.iter().find(|k| k.name == "dir|aead|zstd").unwrap();
    let host = dir.join("data").join("f");
    let (old, new, want) = {
        let s = Stack::open(&spec(kind, dir), ubc::Cache::new(64 << 20).unwrap()).unwrap();
        let f = s.top().create("f").unwrap();
        // Small extents (compressible chunks) and an incompressible one.
        f.write_at(&[b'a'; 16384], 0).unwrap();
        f.write_at(&payload(4, 3000), 16384).unwrap();
        f.write_at(&payload(1, 5000), 40000).unwrap();
        f.sync().unwrap();
        let want = read_all(&f).unwrap();
        let old = std::fs::read(&host).unwrap();
        // After the commit: chunks rewritten and added next to the committed extents.
        f.write_at(&payload(5, 700), 16500).unwrap();
        f.write_at(&payload(6, 300), 70000).unwrap();
        f.write_at(&[b'b'; 9000], 1000).unwrap();
        f.sync().unwrap();
        (old, std::fs::read(&host).unwrap(), want)
    };
    let pages = old.len().max(new.len()).div_ceil(PAGE as usize);
    let mut bad = Vec::new();
    for p in 0..pages {
        let (a, b) = (p * PAGE as usize, ((p + 1) * PAGE as usize).min(new.len()));
        if a >= new.len() || old.get(a..b) == Some(&new[a..b]) {
            continue;
        }
        let mut img = old.clone();
        if img.len() < b {
            img.resize(b, 0);
        }
        img[a..b].copy_from_slice(&new[a..b]);
        std::fs::write(&host, &img).unwrap();
        let s = fresh_stack(kind, dir, true);
        let got = s.top().open("f").and_then(|f| read_all(&f));
        match got {
            Ok(g) if g == want => {}
            Ok(g) => bad.push(format!("page {p}: {} bytes, not the first commit", g.len())),
            Err(e) => bad.push(format!("page {p}: {e}")),
        }
    }
    assert!(bad.is_empty(), "images with one page of the second commit:\n{}", bad.join("\n"));
}

/// Debugging aid: `UBC_CRASH_INSPECT=<kept dir> cargo test --test crash
/// crash_inspect -- --nocapture` prints, per file, the operations since its last sync and
/// how each block compares with every reachable state.
#[test]
fn crash_inspect() {
    let Ok(dir) = std::env::var("UBC_CRASH_INSPECT") else { return };
    let dir = Path::new(&dir);
    let name = std::fs::read_to_string(dir.join("stack")).unwrap();
    let kind = STACKS.iter().find(|k| k.name == name).unwrap();
    let (recs, torn) = read_journal(&dir.join("journal")).unwrap();
    println!("{} records, torn tail {torn}", recs.len());
    let last_sync = |f: &str| {
        recs.iter().rposition(|r| matches!(r, Rec::Synced(None) | Rec::Closed) || *r == Rec::Synced(Some(f.into())))
    };
    for (fname, h) in replay(&recs).unwrap() {
        let from = last_sync(&fname).map_or(0, |i| i + 1);
        println!(
            "== {fname}: synced {} msync {} in-flight {} touched {:?}",
            h.synced, h.msync, h.sync_in_flight, h.touched
        );
        for r in &recs[from..] {
            let mine = match r {
                Rec::Write { f, .. }
                | Rec::SetLen { f, .. }
                | Rec::MapFlush(f)
                | Rec::WriteBack(f)
                | Rec::Create(f) => f == &fname,
                Rec::Sync(f) | Rec::Synced(f) => f.as_deref().is_none_or(|x| x == fname),
                Rec::Closing | Rec::Closed => true,
            };
            if mine {
                println!("   {r:?}");
            }
        }
        let s = fresh_stack(kind, dir, false);
        let f = match s.top().open(&fname) {
            Ok(f) => f,
            Err(e) => {
                println!("   open: {e}");
                continue;
            }
        };
        let len = f.len().unwrap();
        println!(
            "   len {len}, state lens {:?}, cuts {:?}",
            h.states.iter().map(|s| s.len()).collect::<Vec<_>>(),
            h.cuts
        );
        println!("   check: {:?}", check_file(kind, dir, &fname, &h, &mut Tally::default()));
        for (b, r) in read_blocks(&f, len).into_iter().enumerate() {
            let b = b as u64;
            match r {
                Err(e) => println!("   block {b}: {e}"),
                Ok(g) => {
                    let ks: Vec<usize> =
                        (0..h.states.len()).filter(|&k| same_range(&h.states[k], b * PAGE, &g)).collect();
                    if ks.is_empty() {
                        for (k, st) in h.states.iter().enumerate() {
                            let diff: Vec<usize> = (0..g.len())
                                .filter(|&i| st.get((b * PAGE) as usize + i).copied().unwrap_or(0) != g[i])
                                .collect();
                            println!(
                                "   block {b} vs state {k}: {} bytes differ, first {:?} last {:?}",
                                diff.len(),
                                diff.first(),
                                diff.last()
                            );
                        }
                    } else if !ks.contains(&0) {
                        println!("   block {b}: states {ks:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn crash_dir() {
    if !in_child() {
        run("dir");
    }
}

#[test]
fn crash_dir_zstd() {
    if !in_child() {
        run("dir|zstd");
    }
}

#[test]
fn crash_dir_aead() {
    if !in_child() {
        run("dir|aead");
    }
}

#[test]
fn crash_dir_zstd_aead() {
    if !in_child() {
        run("dir|zstd|aead");
    }
}

#[test]
fn crash_dir_aead_zstd() {
    if !in_child() {
        run("dir|aead|zstd");
    }
}

/// A closed aead file whose pages were all written back and dropped (so the cache forgets
/// its object at once, without a sync) keeps the length its writes gave it. Were the header's
/// length written only by `sync`/`set_len`, the pager would be dropped with the new length in
/// memory and the next open would cut the file back (`dir | zstd | aead`, clean close, 1 MiB
/// budget).
#[test]
fn regression_aead_length_survives_a_close_without_sync() {
    use ubc_stack::encrypt::EncryptPager;
    let tmp = tempfile::tempdir().unwrap();
    let cache = ubc::Cache::new(16 << 20).unwrap();
    let key = std::sync::Arc::new(Key::generate());
    let lower = cache.create_path(tmp.path().join("f")).unwrap();
    let open = || {
        let p = EncryptPager::open(lower.try_clone().unwrap(), key.clone()).unwrap();
        cache.open(std::sync::Arc::new(p), ubc::Access::ReadWrite).unwrap()
    };
    let f = open();
    f.write_at(&payload(1, 28478), 0).unwrap();
    f.sync().unwrap();
    f.write_at(&payload(2, 164), 29049).unwrap();
    // Written back and dropped from the cache, no sync: the object holds no page now, so
    // closing its last handle forgets it (and drops the pager) at once.
    f.invalidate(0..u64::MAX, ubc::Length::Keep).unwrap();
    drop(f);
    // The last reference to the object may go on an I/O thread a moment later.
    let t = Instant::now();
    while EncryptPager::logical_len(&lower, &key).unwrap() != 29213 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(EncryptPager::logical_len(&lower, &key).unwrap(), 29213);
    let f = open();
    let mut want = payload(1, 28478);
    want.resize(29049, 0);
    want.extend_from_slice(&payload(2, 164));
    let mut got = vec![0u8; f.len().unwrap() as usize];
    f.read_exact_at(&mut got, 0).unwrap();
    assert!(got == want);
}

/// A directory with file `f` of 20,000 bytes (`payload(1, …)`) written and synced through
/// `kind`, journaled as the crash writer journals; the journal stays open for more records.
fn synced_fixture(kind: &Kind) -> (tempfile::TempDir, Journal) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir(dir.join("data")).unwrap();
    Key::generate().write_file(&dir.join("key")).unwrap();
    let s = Stack::open(&spec(kind, dir), ubc::Cache::new(16 << 20).unwrap()).unwrap();
    let mut j = Journal::create(&dir.join("journal"));
    j.log(&Rec::Create("f".into()));
    let f = s.top().create("f").unwrap();
    j.log(&Rec::Write { f: "f".into(), off: 0, len: 20000, seed: 1, map: false });
    f.write_at(&payload(1, 20000), 0).unwrap();
    j.log(&Rec::Sync(Some("f".into())));
    f.sync().unwrap();
    j.log(&Rec::Synced(Some("f".into())));
    (tmp, j)
}

/// The checker is not vacuous: after a journaled write and sync it accepts the files as they
/// are, and it rejects a changed synced byte (garbage), a cut-off synced tail (lost data), a
/// damaged aead block nobody wrote since the sync, and a zstd commit the journal knows
/// nothing of.
#[test]
fn checker_rejects_lost_synced_data_and_garbage() {
    for kind in STACKS.iter().filter(|k| ["dir", "dir|aead", "dir|zstd"].contains(&k.name)) {
        let (tmp, journal) = synced_fixture(kind);
        drop(journal);
        let dir = tmp.path();
        let host = dir.join("data").join("f");
        let good = std::fs::read(&host).unwrap();
        check(kind, dir, &mut Tally::default())
            .unwrap_or_else(|e| panic!("{}: the untouched files fail: {e}", kind.name));
        let bad = |what: &str, img: Vec<u8>| {
            std::fs::write(&host, &img).unwrap();
            let r = check(kind, dir, &mut Tally::default());
            assert!(r.is_err(), "{}: {what} was accepted", kind.name);
            std::fs::write(&host, &good).unwrap();
        };
        match kind.name {
            "dir" => {
                let mut g = good.clone();
                g[5000] ^= 1;
                bad("a changed synced byte", g);
                bad("a lost synced tail", good[..12000].to_vec());
            }
            "dir|aead" => {
                let mut g = good.clone();
                g[(ubc_stack::encrypt::HEADER_LEN + ubc_stack::encrypt::STORED_BLOCK + 100) as usize] ^= 1;
                bad("a damaged block nobody wrote since the sync", g);
            }
            _ => {
                // A newer commit the journal does not know: a write and a sync nobody logged.
                let s = fresh_stack(kind, dir, true);
                let f = s.top().open_with("f", ubc_stack::OpenOptions::new().write(true)).unwrap();
                f.write_at(b"unlogged", 100).unwrap();
                f.sync().unwrap();
                drop(f);
                drop(s);
                let img = std::fs::read(&host).unwrap();
                std::fs::write(&host, &good).unwrap();
                bad("a commit the journal does not know", img);
            }
        }
    }
}

/// A store through a mapping written back part way (crash runs of `dir | aead`, 384 KiB
/// budget: seeds 9522743119410117708 and 1030002 at 7d70574). glibc's `memcpy` of 10002
/// bytes to offset 2649 stores the 39 bytes up to the first 64-byte boundary last; the copy
/// faulted on page 1 (a read-ahead marker, then pages still being read ahead), the 5 ms
/// flusher harvested page 0 and wrote it back meanwhile, and the writer was killed before
/// page 0, stored again, was written back: block 0 held bytes 2688.. new and 2649..2688 old.
/// The checker takes that block, and still rejects bytes of neither state.
#[test]
fn checker_takes_a_block_written_back_part_way_through_a_mapped_store() {
    if in_child() {
        return;
    }
    for kind in STACKS.iter().filter(|k| ["dir", "dir|aead"].contains(&k.name)) {
        let (tmp, mut j) = synced_fixture(kind);
        let dir = tmp.path();
        let (off, len) = (2649u64, 10002u64);
        let new = payload(2, len as usize);
        j.log(&Rec::Write { f: "f".into(), off, len, seed: 2, map: true });
        drop(j);
        // What reached the store: the copy's body, not its head (written through a fresh
        // stack, so that an aead block is sealed as the cache would have sealed it).
        let store = |at: u64, bytes: &[u8]| {
            let s = fresh_stack(kind, dir, false);
            let f = s.top().open_with("f", ubc_stack::OpenOptions::new().write(true)).unwrap();
            f.write_at(bytes, at).unwrap();
            f.sync().unwrap();
        };
        let host = dir.join("data").join("f");
        let synced = std::fs::read(&host).unwrap();
        let head = 2688 - off;
        store(off + head, &new[head as usize..]);
        let mut t = Tally::default();
        check(kind, dir, &mut t).unwrap_or_else(|e| panic!("{}: a part-way mapped store was rejected: {e}", kind.name));
        assert!(t.torn_stores > 0, "{}: {t:?}", kind.name);
        // The body one byte off: bytes of neither state.
        std::fs::write(&host, &synced).unwrap();
        store(off + head + 1, &new[head as usize..]);
        assert!(
            check(kind, dir, &mut Tally::default()).is_err(),
            "{}: a store at the wrong place was accepted",
            kind.name
        );
    }
}

/// Dropping a stack keeps an aead file's length that only write-back moved: the pager's
/// drop writes the header, and it must run while the cache still runs. The stack's domain
/// dropped its file handle before the layer's translation (which holds the pager too): with
/// the file's pages all gone the cache shut down right there, and the pager's header write
/// came after the final write-back (crash runs of `dir | aead`, clean close, 384 KiB budget).
#[test]
fn regression_dropping_a_stack_keeps_an_aead_length_moved_by_write_back() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir(dir.join("data")).unwrap();
    Key::generate().write_file(&dir.join("key")).unwrap();
    for kind in STACKS.iter().filter(|k| k.model != Model::Page) {
        let name = kind.name.replace('|', "-");
        {
            let s = Stack::open(&spec(kind, dir), ubc::Cache::new(16 << 20).unwrap()).unwrap();
            let f = s.top().create(&name).unwrap();
            f.write_at(&payload(1, 28478), 0).unwrap();
            f.sync().unwrap();
            f.write_at(&payload(2, 164), 29049).unwrap();
            // Written back into the layer below and dropped from the cache, no sync.
            f.cache_file().invalidate(0..u64::MAX, ubc::Length::Keep).unwrap();
        }
        let s = fresh_stack(kind, dir, true);
        let got = read_all(&s.top().open(&name).unwrap()).unwrap();
        let mut want = payload(1, 28478);
        want.resize(29049, 0);
        want.extend_from_slice(&payload(2, 164));
        assert!(got == want, "{}: {} bytes after the stack was dropped, want {}", kind.name, got.len(), want.len());
    }
}

/// Generation of the newest valid-looking zstd superblock in a stored file (the format:
/// magic `UBCZSTD1` at a slot's start, generation at byte 16).
fn zstd_generation(stored: &[u8]) -> u64 {
    (0..2)
        .filter_map(|s| stored.get(s * 4096..s * 4096 + 24))
        .filter(|b| &b[..8] == b"UBCZSTD1")
        .map(|b| u64::from_le_bytes(b[16..24].try_into().unwrap()))
        .max()
        .unwrap_or(0)
}

/// Dropping a stack commits each zstd file once, after the layers above pushed everything
/// down — not first with part of it. The cache's shutdown syncs objects in no particular
/// order: a zstd domain synced before the aead domain above it committed the aead header
/// and zero blocks a `set_len` had pushed down, without the aead blocks written before it,
/// and then committed again. A crash between the two left that mix (crash runs of
/// `dir | zstd | aead`, killed during the close). With the stack pushing every group down
/// top first as it closes, the close makes exactly one commit per file.
#[test]
fn regression_closing_a_stack_commits_each_file_once_after_the_layers_above() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir(dir.join("data")).unwrap();
    Key::generate().write_file(&dir.join("key")).unwrap();
    let kind = STACKS.iter().find(|k| k.name == "dir|zstd|aead").unwrap();
    let names: Vec<String> = (0..24).map(|i| format!("f{i}")).collect();
    let gens: Vec<u64> = {
        let s = Stack::open(&spec(kind, dir), ubc::Cache::new(64 << 20).unwrap()).unwrap();
        let files: Vec<_> = names.iter().map(|n| s.top().create(n).unwrap()).collect();
        for f in &files {
            f.write_at(&payload(3, 5000), 0).unwrap();
            f.sync().unwrap();
        }
        let gens = names.iter().map(|n| zstd_generation(&std::fs::read(dir.join("data").join(n)).unwrap())).collect();
        for f in &files {
            f.write_at(b"new bytes", 10).unwrap(); // dirty at the top only
            f.set_len(9000).unwrap(); // header and a zero block pushed into the zstd layer
        }
        gens
    };
    let s = fresh_stack(kind, dir, true);
    let mut want = payload(3, 5000);
    want[10..19].copy_from_slice(b"new bytes");
    want.resize(9000, 0);
    for (n, g) in names.iter().zip(gens) {
        let now = zstd_generation(&std::fs::read(dir.join("data").join(n)).unwrap());
        assert_eq!(now, g + 1, "{n}: the close made {} commits", now - g);
        assert!(read_all(&s.top().open(n).unwrap()).unwrap() == want, "{n}");
    }
}

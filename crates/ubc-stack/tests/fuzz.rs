//! Fuzzing of the on-disk formats and the stack spec parser, through whole stacks.
//!
//! * zstd: valid compressed files are made by random writes through `dir|mem | zstd:chunk=…`
//!   (synced, several commits), then their stored bytes are damaged — bit flips and byte
//!   overwrites aimed at the superblocks, the index, the extents and free space, zeroed
//!   regions, truncation, junk appended, extents swapped or duplicated, slots swapped, index
//!   and superblock fields forged with their checksums fixed up, sparse giant files, random
//!   files — and every chunk is read back through the stack. The expected outcome is
//!   computed from which bytes changed (see `docs/formats.md`, "What corruption produces").
//! * aead: the same for encrypted files: flipped, zeroed, truncated, swapped, duplicated,
//!   reordered blocks, blocks and headers from another file, another key. Every block whose
//!   stored bytes changed must fail with its `AuthError`, every other block must read.
//! * the spec parser: arbitrary strings and near-valid specs.
//!
//! Every case runs on a watchdog thread (a hang fails the test) and a panic hook counts
//! panics in *any* thread (the cache's I/O threads turn a panicking pager into an error, so
//! the hook is what sees them).
//!
//! Case counts are modest by default; `PROPTEST_CASES=N` sets every test's count, e.g.
//! `PROPTEST_CASES=20000 cargo test --release -p ubc-stack --test fuzz`.

mod common;

use common::data::gen_data;
use proptest::prelude::*;
use proptest::sample::Index;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Once, mpsc};
use std::time::Duration;
use ubc_stack::encrypt::{AuthError, Failure, Key};
use ubc_stack::{Error, OpenOptions, Stack};

// ------------------------------------------------------------------ harness

static PANICS: AtomicUsize = AtomicUsize::new(0);

fn hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, SeqCst);
            prev(info)
        }));
    });
}

/// Run `f` on its own thread; fail if it panics (in any thread) or takes longer than `secs`.
fn guarded<T: Send + 'static>(what: String, secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    hook();
    let before = PANICS.load(SeqCst);
    let (tx, rx) = mpsc::channel();
    let h = std::thread::Builder::new()
        .name("fuzz-case".into())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(r);
        })
        .unwrap();
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(Ok(v)) => {
            h.join().unwrap();
            let after = PANICS.load(SeqCst);
            assert_eq!(before, after, "{what}: a thread panicked (see the message above)");
            v
        }
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("{what}: no answer after {secs} s (hang)"),
    }
}

/// `PROPTEST_CASES` if set, else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn config(default: u32) -> ProptestConfig {
    ProptestConfig {
        cases: cases(default),
        max_shrink_iters: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// `FUZZ_VERBOSE=1`: print each case's outcome (to see what the generators reach).
fn verbose() -> bool {
    std::env::var_os("FUZZ_VERBOSE").is_some()
}

fn cache() -> ubc::Cache {
    ubc::Cache::builder().budget(32 << 20).build().unwrap()
}

fn model_write(m: &mut Vec<u8>, off: usize, d: &[u8]) {
    if m.len() < off + d.len() {
        m.resize(off + d.len(), 0);
    }
    m[off..off + d.len()].copy_from_slice(d);
}

/// The `io::Error` a stack error carries (open errors and pager errors through the cache).
fn io_of(e: &Error) -> Option<&io::Error> {
    match e {
        Error::Io { source, .. } => Some(source),
        Error::Cache(ubc::Error::Io { source, .. }) => Some(source),
        _ => None,
    }
}

/// Where the stored file lives.
#[derive(Debug, Clone, Copy)]
enum Bottom {
    Dir,
    Mem,
}

/// A stack over stored bytes `bytes` (then extended sparsely to `sparse` if given) named
/// "f" at layer 0; `upper` is the spec of the layers above the bottom.
struct Env {
    stack: Stack,
    _tmp: Option<tempfile::TempDir>,
}

fn env_over(bottom: Bottom, bytes: &[u8], sparse: Option<u64>, upper: &str) -> Env {
    match bottom {
        Bottom::Dir => {
            let tmp = tempfile::tempdir().unwrap();
            let p = tmp.path().join("f");
            std::fs::write(&p, bytes).unwrap();
            if let Some(n) = sparse {
                std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(n).unwrap();
            }
            let stack = Stack::open(&format!("dir:{} | {upper}", tmp.path().display()), cache()).unwrap();
            Env { stack, _tmp: Some(tmp) }
        }
        Bottom::Mem => {
            let stack = Stack::open(&format!("mem | {upper}"), cache()).unwrap();
            let f = stack.layer(0).unwrap().create("f").unwrap();
            f.write_at(bytes, 0).unwrap();
            if let Some(n) = sparse {
                f.set_len(n).unwrap();
            }
            Env { stack, _tmp: None }
        }
    }
}

fn rw() -> OpenOptions {
    OpenOptions::new().write(true)
}

// ------------------------------------------------------------------ zstd: the format, per docs

const SLOT: usize = 4096;
const SB_LEN: usize = 68;
const DATA_START: usize = 8192;

fn u32le(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64le(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// A valid compressed file and what it holds.
#[derive(Debug, Clone)]
struct ZImage {
    bytes: Vec<u8>,
    chunk: usize,
    /// Content at each sync (the last is the newest commit).
    versions: Vec<Vec<u8>>,
    newest_slot: usize,
    index: Range<usize>,
    /// (chunk, stored bytes, offset of the index entry)
    extents: Vec<(u64, Range<usize>, usize)>,
}

impl ZImage {
    fn latest(&self) -> &[u8] {
        self.versions.last().unwrap()
    }

    fn parse(bytes: Vec<u8>, chunk: usize, versions: Vec<Vec<u8>>) -> ZImage {
        let mut best: Option<(usize, u64)> = None;
        for s in 0..2 {
            let b = &bytes[s * SLOT..s * SLOT + SB_LEN];
            if &b[..8] == b"UBCZSTD1" && crc32fast::hash(&b[..64]) == u32le(b, 64) {
                let g = u64le(b, 16);
                if best.is_none_or(|(_, bg)| bg < g) {
                    best = Some((s, g));
                }
            }
        }
        let (slot, _) = best.expect("a valid superblock");
        let sb = &bytes[slot * SLOT..];
        let (io, il) = (u64le(sb, 32) as usize, u64le(sb, 40) as usize);
        let count = u64le(&bytes, io + 16) as usize;
        let extents = (0..count)
            .map(|i| {
                let p = io + 24 + i * 32;
                let off = u64le(&bytes, p + 8) as usize;
                (u64le(&bytes, p), off..off + u32le(&bytes, p + 16) as usize, p)
            })
            .collect();
        ZImage { bytes, chunk, versions, newest_slot: slot, index: io..io + il, extents }
    }

    /// Byte ranges the newest commit depends on.
    fn meaningful(&self) -> Vec<Range<usize>> {
        let s = self.newest_slot * SLOT;
        let mut v = vec![s..s + SB_LEN, self.index.clone()];
        v.extend(self.extents.iter().map(|e| e.1.clone()));
        v
    }

    /// Fix the index checksum in the newest superblock and the superblock's own checksum.
    fn fix_crcs(&self, b: &mut [u8]) {
        let s = self.newest_slot * SLOT;
        let crc = crc32fast::hash(&b[self.index.clone()]);
        b[s + 48..s + 52].copy_from_slice(&crc.to_le_bytes());
        let c = crc32fast::hash(&b[s..s + 64]);
        b[s + 64..s + 68].copy_from_slice(&c.to_le_bytes());
    }
}

#[derive(Debug, Clone)]
enum ZOp {
    Write { off: usize, len: usize, seed: u64, kind: u8 },
    SetLen(usize),
    Sync,
}

fn zop() -> impl Strategy<Value = ZOp> {
    prop_oneof![
        6 => (0usize..140_000, 1usize..40_000, any::<u64>(), 0u8..3).prop_map(|(off, len, seed, kind)| ZOp::Write { off, len, seed, kind }),
        1 => (0usize..160_000).prop_map(ZOp::SetLen),
        2 => Just(ZOp::Sync),
    ]
}

/// Make a compressed file by `ops` through a stack (then a last sync); its stored bytes.
fn make_zimage(bottom: Bottom, shift: u32, level: i32, ops: &[ZOp]) -> ZImage {
    let cs = 1usize << shift;
    let upper = format!("zstd:chunk={cs},level={level}");
    let env = env_over(bottom, &[], None, &upper);
    let top = env.stack.top().open_with("f", rw()).unwrap();
    let mut model = Vec::new();
    let mut versions = Vec::new();
    for op in ops.iter().chain([&ZOp::Write { off: 0, len: 1, seed: 7, kind: 0 }, &ZOp::Sync]) {
        match op {
            ZOp::Write { off, len, seed, kind } => {
                let d = gen_data(*seed, *len, *kind);
                top.write_at(&d, *off as u64).unwrap();
                model_write(&mut model, *off, &d);
            }
            ZOp::SetLen(n) => {
                top.set_len(*n as u64).unwrap();
                model.resize(*n, 0);
            }
            ZOp::Sync => {
                top.sync().unwrap();
                versions.push(model.clone());
            }
        }
    }
    let bottom_f = env.stack.layer(0).unwrap().open("f").unwrap();
    let mut bytes = vec![0u8; bottom_f.len().unwrap() as usize];
    bottom_f.read_exact_at(&mut bytes, 0).unwrap();
    ZImage::parse(bytes, cs, versions)
}

/// Where in the image a mutation aims.
#[derive(Debug, Clone, Copy)]
enum Target {
    NewestSlot,
    OlderSlot,
    SlotTail,
    Index,
    Extent,
    Free,
    Anywhere,
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        1 => Just(Target::NewestSlot),
        1 => Just(Target::OlderSlot),
        1 => Just(Target::SlotTail),
        1 => Just(Target::Index),
        3 => Just(Target::Extent),
        2 => Just(Target::Free),
        1 => Just(Target::Anywhere),
    ]
}

impl ZImage {
    fn pick(&self, t: Target, at: Index) -> usize {
        let len = self.bytes.len();
        let free: Vec<usize> = match t {
            Target::Free => {
                let m = self.meaningful();
                // Sampled candidates, to keep it cheap on large images.
                (DATA_START..len).step_by(7).filter(|p| !m.iter().any(|r| r.contains(p))).collect()
            }
            _ => Vec::new(),
        };
        match t {
            Target::NewestSlot => self.newest_slot * SLOT + at.index(SB_LEN),
            Target::OlderSlot => (1 - self.newest_slot) * SLOT + at.index(SB_LEN),
            Target::SlotTail => (at.index(2) * SLOT + SB_LEN + at.index(SLOT - SB_LEN)).min(len - 1),
            Target::Index => self.index.start + at.index(self.index.len()),
            Target::Extent if !self.extents.is_empty() => {
                let total: usize = self.extents.iter().map(|e| e.1.len()).sum();
                let mut k = at.index(total);
                for e in &self.extents {
                    if k < e.1.len() {
                        return e.1.start + k;
                    }
                    k -= e.1.len();
                }
                unreachable!()
            }
            Target::Free if !free.is_empty() => free[at.index(free.len())],
            _ => at.index(len),
        }
    }
}

#[derive(Debug, Clone)]
enum ZMut {
    Flip {
        t: Target,
        at: Index,
        bit: u8,
    },
    Overwrite {
        t: Target,
        at: Index,
        bytes: Vec<u8>,
    },
    Zero {
        t: Target,
        at: Index,
        len: usize,
    },
    Truncate(Index),
    Extend(Vec<u8>),
    SwapExtents(Index, Index),
    CopyExtent(Index, Index),
    SwapSlots,
    ZeroSlots,
    /// An index entry field set to `value`, checksums fixed up (a forged but "valid" index).
    ForgeEntry {
        entry: Index,
        field: u8,
        value: u64,
    },
    /// A superblock field set to `value`, checksums fixed up.
    ForgeSb {
        field: u8,
        value: u64,
    },
    /// The lower file extended sparsely to `2^shift` bytes and the index length (checksums
    /// fixed) made to cover much of it.
    GiantIndex {
        shift: u8,
    },
    Random(Vec<u8>),
}

fn edge_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        0u64..70_000,
        Just(0u64),
        Just(u64::MAX),
        Just(1u64 << 63),
        Just((1u64 << 62) + 1),
        Just(u32::MAX as u64),
        Just(u32::MAX as u64 + 1),
        (0u64..64).prop_map(|s| 1u64 << s),
        (0u64..64).prop_map(|s| (1u64 << s).wrapping_sub(1)),
    ]
}

fn zmut() -> impl Strategy<Value = ZMut> {
    prop_oneof![
        4 => (target(), any::<Index>(), 0u8..8).prop_map(|(t, at, bit)| ZMut::Flip { t, at, bit }),
        3 => (target(), any::<Index>(), prop::collection::vec(any::<u8>(), 1..40)).prop_map(|(t, at, bytes)| ZMut::Overwrite { t, at, bytes }),
        2 => (target(), any::<Index>(), 1usize..5000).prop_map(|(t, at, len)| ZMut::Zero { t, at, len }),
        2 => any::<Index>().prop_map(ZMut::Truncate),
        1 => prop::collection::vec(any::<u8>(), 1..9000).prop_map(ZMut::Extend),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| ZMut::SwapExtents(a, b)),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| ZMut::CopyExtent(a, b)),
        1 => Just(ZMut::SwapSlots),
        1 => Just(ZMut::ZeroSlots),
        3 => (any::<Index>(), 0u8..6, edge_u64()).prop_map(|(entry, field, value)| ZMut::ForgeEntry { entry, field, value }),
        2 => (0u8..7, edge_u64()).prop_map(|(field, value)| ZMut::ForgeSb { field, value }),
        1 => (20u8..42).prop_map(|shift| ZMut::GiantIndex { shift }),
        1 => prop::collection::vec(any::<u8>(), 0..20_000).prop_map(ZMut::Random),
    ]
}

/// A damaged store: its bytes, a sparse length, and whether checksums were forged (then
/// only "no panic, no hang, typed errors" is promised).
#[derive(Debug, Clone)]
struct Damaged {
    bytes: Vec<u8>,
    sparse: Option<u64>,
    forged: bool,
}

impl ZImage {
    fn apply(&self, m: &ZMut) -> Damaged {
        let mut b = self.bytes.clone();
        let len = b.len();
        let (mut sparse, mut forged) = (None, false);
        match m {
            ZMut::Flip { t, at, bit } => {
                let p = self.pick(*t, *at);
                b[p] ^= 1 << bit;
            }
            ZMut::Overwrite { t, at, bytes } => {
                let p = self.pick(*t, *at);
                let n = bytes.len().min(len - p);
                b[p..p + n].copy_from_slice(&bytes[..n]);
            }
            ZMut::Zero { t, at, len: n } => {
                let p = self.pick(*t, *at);
                let e = (p + n).min(len);
                b[p..e].fill(0);
            }
            ZMut::Truncate(at) => b.truncate(at.index(len)),
            ZMut::Extend(junk) => b.extend_from_slice(junk),
            ZMut::SwapExtents(x, y) | ZMut::CopyExtent(x, y) if self.extents.len() >= 2 => {
                let a = self.extents[x.index(self.extents.len())].1.clone();
                let c = self.extents[y.index(self.extents.len())].1.clone();
                let n = a.len().min(c.len());
                let (sa, sc) = (b[a.start..a.start + n].to_vec(), b[c.start..c.start + n].to_vec());
                b[c.start..c.start + n].copy_from_slice(&sa);
                if matches!(m, ZMut::SwapExtents(..)) {
                    b[a.start..a.start + n].copy_from_slice(&sc);
                }
            }
            ZMut::SwapExtents(..) | ZMut::CopyExtent(..) => {}
            ZMut::SwapSlots => {
                let s0 = b[..SLOT].to_vec();
                b.copy_within(SLOT..2 * SLOT, 0);
                b[SLOT..2 * SLOT].copy_from_slice(&s0);
            }
            ZMut::ZeroSlots => b[..2 * SLOT].fill(0),
            ZMut::ForgeEntry { entry, field, value } => {
                forged = true;
                if !self.extents.is_empty() {
                    let p = self.extents[entry.index(self.extents.len())].2;
                    let v = *value;
                    match field {
                        0 => b[p..p + 8].copy_from_slice(&v.to_le_bytes()),
                        1 => b[p + 8..p + 16].copy_from_slice(&v.to_le_bytes()),
                        2 => b[p + 16..p + 20].copy_from_slice(&(v as u32).to_le_bytes()),
                        3 => b[p + 20..p + 24].copy_from_slice(&(v as u32).to_le_bytes()),
                        4 => b[p + 24..p + 28].copy_from_slice(&(v as u32).to_le_bytes()),
                        _ => b[p + 28..p + 32].copy_from_slice(&(v as u32).to_le_bytes()),
                    }
                    self.fix_crcs(&mut b);
                }
            }
            ZMut::ForgeSb { field, value } => {
                forged = true;
                let s = self.newest_slot * SLOT;
                let v = *value;
                match field {
                    0 => b[s + 8..s + 12].copy_from_slice(&(v as u32).to_le_bytes()),
                    1 => b[s + 12..s + 16].copy_from_slice(&(v as u32).to_le_bytes()),
                    2 => b[s + 16..s + 24].copy_from_slice(&v.to_le_bytes()),
                    3 => b[s + 24..s + 32].copy_from_slice(&v.to_le_bytes()),
                    4 => b[s + 32..s + 40].copy_from_slice(&v.to_le_bytes()),
                    5 => b[s + 40..s + 48].copy_from_slice(&v.to_le_bytes()),
                    _ => b[s + 52..s + 56].copy_from_slice(&(v as u32).to_le_bytes()),
                }
                let c = crc32fast::hash(&b[s..s + 64]);
                b[s + 64..s + 68].copy_from_slice(&c.to_le_bytes());
            }
            ZMut::GiantIndex { shift } => {
                forged = true;
                let total = 1u64 << shift;
                sparse = Some(total.max(len as u64));
                let s = self.newest_slot * SLOT;
                let room = total.saturating_sub(self.index.start as u64);
                let il = 24 + room.saturating_sub(24) / 32 * 32;
                b[s + 40..s + 48].copy_from_slice(&il.to_le_bytes());
                // The index header agrees (so the count check passes): what follows the real
                // entries is other data, then sparse zeros.
                let h = self.index.start + 16;
                b[h..h + 8].copy_from_slice(&((il - 24) / 32).to_le_bytes());
                let c = crc32fast::hash(&b[s..s + 64]);
                b[s + 64..s + 68].copy_from_slice(&c.to_le_bytes());
            }
            ZMut::Random(r) => {
                forged = true;
                b = r.clone();
            }
        }
        Damaged { bytes: b, sparse, forged }
    }
}

/// What reading chunk `c` gave: `Ok(bytes)` or the error's text.
type ChunkRead = Result<Vec<u8>, String>;

/// Check that a zstd error is what the format promises: `InvalidData` naming the layer.
fn zstd_err(e: &Error, ctx: &str) -> Result<String, TestCaseError> {
    let msg = e.to_string();
    let io = io_of(e).ok_or_else(|| TestCaseError::fail(format!("{ctx}: not an I/O error: {e:?}")))?;
    prop_assert_eq!(io.kind(), io::ErrorKind::InvalidData, "{}: {}", ctx, msg);
    prop_assert!(msg.contains("zstd layer"), "{}: {}", ctx, msg);
    Ok(msg)
}

/// Read chunks `which` of "f" at the top: each `Ok(bytes)` or `Err(message)`.
fn read_chunks(
    f: &ubc_stack::File,
    cs: usize,
    len: u64,
    which: &[u64],
) -> Result<Vec<(u64, ChunkRead)>, TestCaseError> {
    let mut out = Vec::new();
    for &c in which {
        let start = c * cs as u64;
        if start >= len {
            continue;
        }
        let n = (len - start).min(cs as u64) as usize;
        let mut buf = vec![0u8; n];
        let r = match f.read_exact_at(&mut buf, start) {
            Ok(()) => Ok(buf),
            Err(e) => Err(zstd_err(&e, &format!("reading chunk {c}"))?),
        };
        out.push((c, r));
    }
    Ok(out)
}

/// Open the damaged store, read it, check the outcome against what the format promises;
/// then write a chunk, sync, reopen and check again.
fn zstd_check(img: &ZImage, d: &Damaged, m: &ZMut, bottom: Bottom, write_chunk: Index) -> Result<(), TestCaseError> {
    let cs = img.chunk;
    let env = env_over(bottom, &d.bytes, d.sparse, &format!("zstd:chunk={cs}"));
    let opened = env.stack.top().open_with("f", rw());
    let changed = |r: &Range<usize>| r.clone().any(|i| d.bytes.get(i) != Some(&img.bytes[i]));
    let newest = img.newest_slot * SLOT..img.newest_slot * SLOT + SB_LEN;

    // The expected outcome (unless checksums were forged).
    enum Expect {
        Empty,
        /// Newest superblock damaged: an error or an older commit (any synced version).
        Fallback,
        OpenFails(&'static str),
        /// Open works; these chunks fail, every other reads as the newest commit.
        Chunks(Vec<u64>),
    }
    let expect = if d.forged {
        None
    } else if d.bytes.is_empty() {
        Some(Expect::Empty)
    } else if changed(&newest) {
        Some(Expect::Fallback)
    } else if changed(&img.index) {
        Some(Expect::OpenFails("index"))
    } else if img.extents.iter().any(|e| e.1.end > d.bytes.len()) {
        Some(Expect::OpenFails("chunk"))
    } else {
        Some(Expect::Chunks(img.extents.iter().filter(|e| changed(&e.1)).map(|e| e.0).collect()))
    };
    if matches!(m, ZMut::SwapSlots) && !d.forged {
        // The generation's parity names its slot: swapped slots are both invalid.
        let e = opened.as_ref().err().ok_or_else(|| TestCaseError::fail("swapped slots opened"))?;
        zstd_err(e, "swapped slots")?;
        return Ok(());
    }
    let f = match opened {
        Err(e) => {
            let msg = zstd_err(&e, "open")?;
            if verbose() {
                eprintln!("zstd {bottom:?} open failed: {msg}");
            }
            match &expect {
                None | Some(Expect::Fallback) => {}
                Some(Expect::OpenFails(what)) => {
                    prop_assert!(msg.contains(what), "open error should name the {}: {}", what, msg)
                }
                Some(Expect::Empty) | Some(Expect::Chunks(_)) => {
                    return Err(TestCaseError::fail(format!("open failed: {msg}")));
                }
            }
            return Ok(());
        }
        Ok(f) => f,
    };
    if let Some(Expect::OpenFails(what)) = &expect {
        return Err(TestCaseError::fail(format!("damaged {what} but open succeeded")));
    }
    let len = f.len().map_err(|e| TestCaseError::fail(format!("len: {e}")))?;
    let nchunks = len.div_ceil(cs as u64);
    // Every chunk when the file is small; the first, the last and some in between if not.
    let which: Vec<u64> = if nchunks <= 64 {
        (0..nchunks).collect()
    } else {
        (0..32).chain((0..16).map(|k| nchunks / 16 * k)).chain([nchunks - 1]).collect()
    };
    let reads = read_chunks(&f, cs, len, &which)?;
    if verbose() {
        let bad = reads.iter().filter(|r| r.1.is_err()).count();
        let class = match &expect {
            None => "forged".to_string(),
            Some(Expect::Empty) => "empty".into(),
            Some(Expect::Fallback) => "fallback".into(),
            Some(Expect::OpenFails(_)) => "open-fails".into(),
            Some(Expect::Chunks(b)) => format!("chunks(bad {})", b.len()),
        };
        eprintln!("zstd {bottom:?} {class}: opened, len {len}, {} chunks read, {bad} failed", reads.len());
    }
    let latest = img.latest();
    let agrees = |v: &[u8], reads: &[(u64, ChunkRead)]| {
        v.len() as u64 == len
            && reads.iter().all(|(c, r)| match r {
                Ok(b) => {
                    let s = *c as usize * cs;
                    b[..] == v[s..s + b.len()]
                }
                Err(_) => true,
            })
    };
    match &expect {
        None => {}
        Some(Expect::Empty) => prop_assert_eq!(len, 0),
        Some(Expect::Fallback) => {
            // An older commit, with chunks whose space was reused failing; or empty.
            let ok = len == 0 || img.versions.iter().any(|v| agrees(v, &reads));
            prop_assert!(ok, "fallback read matches no synced version (len {})", len);
        }
        Some(Expect::OpenFails(_)) => unreachable!(),
        Some(Expect::Chunks(bad)) => {
            prop_assert_eq!(len, latest.len() as u64);
            for (c, r) in &reads {
                match r {
                    Err(msg) => prop_assert!(
                        bad.contains(c) && msg.contains(&format!("chunk {c} ")),
                        "chunk {} failed: {}",
                        c,
                        msg
                    ),
                    Ok(b) => {
                        prop_assert!(!bad.contains(c), "damaged chunk {} read without an error", c);
                        let s = *c as usize * cs;
                        prop_assert!(b[..] == latest[s..s + b.len()], "chunk {} reads wrong bytes", c);
                    }
                }
            }
        }
    }
    // Writing on top of whatever was accepted must work and stay readable. A full chunk
    // write never needs the old bytes.
    if len > (1 << 40) {
        return Ok(()); // a forged giant length: writing there is not the point
    }
    let k = write_chunk.index(nchunks as usize + 2) as u64;
    let data = gen_data(k + 99, cs, 0);
    f.write_at(&data, k * cs as u64).map_err(|e| TestCaseError::fail(format!("write: {e}")))?;
    match f.sync() {
        Ok(()) => {}
        Err(e) if d.forged => {
            zstd_err(&e, "sync of a forged file")?;
            return Ok(());
        }
        Err(e) => return Err(TestCaseError::fail(format!("sync: {e}"))),
    }
    let mut back = vec![0u8; cs];
    f.read_exact_at(&mut back, k * cs as u64).map_err(|e| TestCaseError::fail(format!("read back: {e}")))?;
    prop_assert!(back == data, "written chunk {} reads back wrong", k);
    let after = read_chunks(&f, cs, len, &which)?;
    drop(f);
    // Reopen in a fresh stack over the stored bytes as they are now.
    let stored = {
        let b = env.stack.layer(0).unwrap().open("f").unwrap();
        let mut v = vec![0u8; b.len().unwrap() as usize];
        b.read_exact_at(&mut v, 0).unwrap();
        v
    };
    drop(env);
    let env2 = env_over(bottom, &stored, None, &format!("zstd:chunk={cs}"));
    let g = env2.stack.top().open("f").map_err(|e| TestCaseError::fail(format!("reopen after a commit: {e}")))?;
    prop_assert_eq!(g.len().unwrap(), len.max((k + 1) * cs as u64));
    g.read_exact_at(&mut back, k * cs as u64)
        .map_err(|e| TestCaseError::fail(format!("read back after reopen: {e}")))?;
    prop_assert!(back == data, "written chunk {} reads back wrong after reopen", k);
    let again = read_chunks(&g, cs, len, &which)?;
    for ((c, x), (_, y)) in after.iter().zip(&again) {
        if *c == k {
            continue;
        }
        match (x, y) {
            (Ok(a), Ok(b)) => prop_assert!(a == b, "chunk {} changed across the commit", c),
            (Err(_), Err(_)) => {}
            _ => {
                return Err(TestCaseError::fail(
                    format!("chunk {c}: {x:?} before, {y:?} after reopen").chars().take(300).collect::<String>(),
                ));
            }
        }
    }
    Ok(())
}

fn bottom() -> impl Strategy<Value = Bottom> {
    prop_oneof![Just(Bottom::Dir), Just(Bottom::Mem)]
}

proptest! {
    #![proptest_config(config(40))]

    /// Damage valid compressed files in every way; never a panic or a hang, and exactly
    /// the outcome the format promises.
    #[test]
    fn zstd_damaged_files(
        bot in bottom(),
        shift in 12u32..16,
        level in 1i32..6,
        ops in prop::collection::vec(zop(), 1..10),
        muts in prop::collection::vec((zmut(), any::<Index>()), 1..5),
    ) {
        let r = guarded(format!("zstd case {muts:?}").chars().take(400).collect(), 120, move || -> Result<(), TestCaseError> {
            let img = make_zimage(bot, shift, level, &ops);
            for (m, w) in &muts {
                let d = img.apply(m);
                zstd_check(&img, &d, m, bot, *w).map_err(|e| TestCaseError::fail(format!("{m:?}: {e}").chars().take(2000).collect::<String>()))?;
            }
            Ok(())
        });
        r?;
    }

    /// Arbitrary bytes as a compressed file.
    #[test]
    fn zstd_random_stores(bytes in prop::collection::vec(any::<u8>(), 0..30_000), magic in any::<bool>(), shift in 12u32..17, w in any::<Index>()) {
        let r = guarded("zstd random store".into(), 60, move || -> Result<(), TestCaseError> {
            let mut bytes = bytes;
            if magic && bytes.len() >= 8 {
                bytes[..8].copy_from_slice(b"UBCZSTD1");
            }
            let img = ZImage { bytes: Vec::new(), chunk: 1 << shift, versions: vec![Vec::new()], newest_slot: 0, index: 0..0, extents: Vec::new() };
            let d = Damaged { bytes, sparse: None, forged: true };
            zstd_check(&img, &d, &ZMut::Random(Vec::new()), Bottom::Mem, w)
        });
        r?;
    }
}

// ------------------------------------------------------------------ aead

const HEADER: usize = 80;
const SB: usize = 4136;
const BLK: usize = 4096;

fn slot_of(i: usize) -> Range<usize> {
    HEADER + i * SB..HEADER + (i + 1) * SB
}

struct Keys {
    dir: tempfile::TempDir,
}

impl Keys {
    fn new() -> Keys {
        let dir = tempfile::tempdir().unwrap();
        Key::generate().write_file(&dir.path().join("k1")).unwrap();
        Key::generate().write_file(&dir.path().join("k2")).unwrap();
        Keys { dir }
    }
    fn spec(&self, which: &str) -> String {
        format!("aead:keyfile={}", self.dir.path().join(which).display())
    }
}

/// Two encrypted files under the same key (different file ids) and their cleartexts.
struct AImage {
    a: Vec<u8>,
    a_clear: Vec<u8>,
    b: Vec<u8>,
    b_clear: Vec<u8>,
}

#[derive(Debug, Clone)]
enum AOp {
    Write { off: usize, len: usize, seed: u64 },
    SetLen(usize),
    Sync,
}

fn aop() -> impl Strategy<Value = AOp> {
    prop_oneof![
        6 => (0usize..60_000, 1usize..20_000, any::<u64>()).prop_map(|(off, len, seed)| AOp::Write { off, len, seed }),
        1 => (0usize..70_000).prop_map(AOp::SetLen),
        1 => Just(AOp::Sync),
    ]
}

fn make_aead(keys: &Keys, bottom: Bottom, ops: &[AOp], seed: u64) -> (Vec<u8>, Vec<u8>) {
    let env = env_over(bottom, &[], None, &keys.spec("k1"));
    let top = env.stack.top().open_with("f", rw()).unwrap();
    let mut model = Vec::new();
    for op in ops.iter().chain([&AOp::Write { off: 0, len: 1, seed }, &AOp::Sync]) {
        match op {
            AOp::Write { off, len, seed } => {
                let d = gen_data(*seed, *len, 0);
                top.write_at(&d, *off as u64).unwrap();
                model_write(&mut model, *off, &d);
            }
            AOp::SetLen(n) => {
                top.set_len(*n as u64).unwrap();
                model.resize(*n, 0);
            }
            AOp::Sync => top.sync().unwrap(),
        }
    }
    let b = env.stack.layer(0).unwrap().open("f").unwrap();
    let mut bytes = vec![0u8; b.len().unwrap() as usize];
    b.read_exact_at(&mut bytes, 0).unwrap();
    (bytes, model)
}

#[derive(Debug, Clone)]
enum AMut {
    Flip {
        at: Index,
        bit: u8,
    },
    FlipInBlock {
        block: Index,
        at: Index,
        bit: u8,
    },
    Overwrite {
        at: Index,
        bytes: Vec<u8>,
    },
    ZeroBlock(Index),
    ZeroRange {
        at: Index,
        len: usize,
    },
    Truncate(Index),
    Extend(Vec<u8>),
    SwapBlocks(Index, Index),
    DupBlock(Index, Index),
    Reorder(Vec<Index>),
    /// Block i of the other file (same key, another file id) at index i.
    Splice(Index),
    /// The other file's header over this file's blocks.
    HeaderFrom,
    HeaderField {
        at: Index,
        value: u8,
    },
    WrongKey,
    Random(Vec<u8>),
}

fn amut() -> impl Strategy<Value = AMut> {
    prop_oneof![
        3 => (any::<Index>(), 0u8..8).prop_map(|(at, bit)| AMut::Flip { at, bit }),
        3 => (any::<Index>(), any::<Index>(), 0u8..8).prop_map(|(block, at, bit)| AMut::FlipInBlock { block, at, bit }),
        2 => (any::<Index>(), prop::collection::vec(any::<u8>(), 1..64)).prop_map(|(at, bytes)| AMut::Overwrite { at, bytes }),
        1 => any::<Index>().prop_map(AMut::ZeroBlock),
        1 => (any::<Index>(), 1usize..9000).prop_map(|(at, len)| AMut::ZeroRange { at, len }),
        2 => any::<Index>().prop_map(AMut::Truncate),
        1 => prop::collection::vec(any::<u8>(), 1..9000).prop_map(AMut::Extend),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| AMut::SwapBlocks(a, b)),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| AMut::DupBlock(a, b)),
        1 => prop::collection::vec(any::<Index>(), 2..6).prop_map(AMut::Reorder),
        1 => any::<Index>().prop_map(AMut::Splice),
        1 => Just(AMut::HeaderFrom),
        2 => (any::<Index>(), any::<u8>()).prop_map(|(at, value)| AMut::HeaderField { at, value }),
        1 => Just(AMut::WrongKey),
        1 => prop::collection::vec(any::<u8>(), 0..12_000).prop_map(AMut::Random),
    ]
}

fn apply_aead(img: &AImage, m: &AMut) -> Vec<u8> {
    let mut x = img.a.clone();
    let len = x.len();
    let nblocks = (len - HEADER) / SB;
    let blk = |i: &Index| slot_of(i.index(nblocks.max(1)));
    match m {
        AMut::Flip { at, bit } => x[at.index(len)] ^= 1 << bit,
        AMut::FlipInBlock { block, at, bit } if nblocks > 0 => {
            let r = blk(block);
            x[r.start + at.index(SB)] ^= 1 << bit;
        }
        AMut::FlipInBlock { .. } => {}
        AMut::Overwrite { at, bytes } => {
            let p = at.index(len);
            let n = bytes.len().min(len - p);
            x[p..p + n].copy_from_slice(&bytes[..n]);
        }
        AMut::ZeroBlock(i) if nblocks > 0 => x[blk(i)].fill(0),
        AMut::ZeroBlock(_) => {}
        AMut::ZeroRange { at, len: n } => {
            let p = at.index(len);
            x[p..(p + n).min(len)].fill(0);
        }
        AMut::Truncate(at) => x.truncate(at.index(len)),
        AMut::Extend(j) => x.extend_from_slice(j),
        AMut::SwapBlocks(a, b) if nblocks > 0 => {
            let (ra, rb) = (blk(a), blk(b));
            let sa = x[ra.clone()].to_vec();
            x.copy_within(rb.clone(), ra.start);
            x[rb].copy_from_slice(&sa);
        }
        AMut::DupBlock(a, b) if nblocks > 0 => {
            let (ra, rb) = (blk(a), blk(b));
            x.copy_within(ra, rb.start);
        }
        AMut::SwapBlocks(..) | AMut::DupBlock(..) => {}
        AMut::Reorder(ix) if nblocks > 0 => {
            // Rotate the chosen blocks' contents one place.
            let slots: Vec<Range<usize>> = ix.iter().map(blk).collect();
            let saved: Vec<Vec<u8>> = slots.iter().map(|r| x[r.clone()].to_vec()).collect();
            for (k, r) in slots.iter().enumerate() {
                x[r.clone()].copy_from_slice(&saved[(k + 1) % saved.len()]);
            }
        }
        AMut::Reorder(_) => {}
        AMut::Splice(i) => {
            let ob = (img.b.len() - HEADER) / SB;
            let k = i.index(nblocks.min(ob).max(1));
            if k < nblocks.min(ob) {
                x[slot_of(k)].copy_from_slice(&img.b[slot_of(k)]);
            }
        }
        AMut::HeaderFrom => x[..HEADER].copy_from_slice(&img.b[..HEADER]),
        AMut::HeaderField { at, value } => x[at.index(HEADER)] = *value,
        AMut::WrongKey => {}
        AMut::Random(r) => x = r.clone(),
    }
    x
}

fn auth_failure(e: &Error, ctx: &str) -> Result<AuthError, TestCaseError> {
    prop_assert!(e.is_auth(), "{}: not an authentication error: {}", ctx, e);
    let io = io_of(e).ok_or_else(|| TestCaseError::fail(format!("{ctx}: not an I/O error: {e:?}")))?;
    prop_assert_eq!(io.kind(), io::ErrorKind::InvalidData, "{}", ctx);
    AuthError::find(e).cloned().ok_or_else(|| TestCaseError::fail(format!("{ctx}: no AuthError in {e:?}")))
}

fn aead_check(keys: &Keys, img: &AImage, m: &AMut, bottom: Bottom) -> Result<(), TestCaseError> {
    let bytes = apply_aead(img, m);
    let key = if matches!(m, AMut::WrongKey) { "k2" } else { "k1" };
    let env = env_over(bottom, &bytes, None, &keys.spec(key));
    let opened = env.stack.top().open("f");
    let changed = |r: Range<usize>| r.clone().any(|i| bytes.get(i) != img.a.get(i));
    let missing = |r: &Range<usize>| r.end > bytes.len();
    if bytes.is_empty() {
        // An empty store is an empty file (documented: a store cut to nothing is a new file).
        let f = opened.map_err(|e| TestCaseError::fail(format!("empty store: {e}")))?;
        prop_assert_eq!(f.len().unwrap(), 0);
        return Ok(());
    }
    if matches!(m, AMut::WrongKey) || changed(0..HEADER) && !matches!(m, AMut::HeaderFrom) {
        let e = opened.err().ok_or_else(|| TestCaseError::fail("damaged header (or wrong key) opened"))?;
        let a = auth_failure(&e, "open")?;
        prop_assert!(matches!(a, AuthError::Header(_)), "{:?}", a);
        if matches!(m, AMut::WrongKey) {
            prop_assert!(matches!(a, AuthError::Header(Failure::BadTag)), "{:?}", a);
        }
        return Ok(());
    }
    let f = opened.map_err(|e| TestCaseError::fail(format!("open: {e}")))?;
    let (clear, foreign) = if matches!(m, AMut::HeaderFrom) { (&img.b_clear, true) } else { (&img.a_clear, false) };
    let len = f.len().unwrap();
    prop_assert_eq!(len, clear.len() as u64);
    let n = clear.len().div_ceil(BLK);
    // Read every block alone, in a shuffled-ish order (odd blocks first) to defeat read-ahead
    // luck.
    let order: Vec<usize> = (0..n).filter(|i| i % 2 == 1).chain((0..n).filter(|i| i % 2 == 0)).collect();
    for i in order {
        let r = slot_of(i);
        let want = &clear[i * BLK..((i + 1) * BLK).min(clear.len())];
        let mut buf = vec![0u8; want.len()];
        let got = f.read_exact_at(&mut buf, (i * BLK) as u64);
        if foreign || missing(&r) || changed(r.clone()) {
            let e = got.err().ok_or_else(|| {
                TestCaseError::fail(format!("block {i}: damaged (or foreign) but read without an error"))
            })?;
            let a = auth_failure(&e, &format!("block {i}"))?;
            match a {
                AuthError::Block { index, failure } => {
                    prop_assert_eq!(index, i as u64);
                    if missing(&r) {
                        prop_assert_eq!(failure, Failure::Truncated);
                    } else if bytes[r].iter().all(|&b| b == 0) {
                        prop_assert_eq!(failure, Failure::Zeroed);
                    } else {
                        prop_assert_eq!(failure, Failure::BadTag);
                    }
                }
                other => return Err(TestCaseError::fail(format!("block {i}: {other:?}"))),
            }
        } else {
            got.map_err(|e| TestCaseError::fail(format!("intact block {i} failed: {e}")))?;
            prop_assert!(buf == want, "block {} reads wrong bytes", i);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(48))]

    /// Damage valid encrypted files; every changed block fails authentication with its
    /// index, every other block reads, nothing panics or hangs.
    #[test]
    fn aead_damaged_files(
        bot in bottom(),
        ops in prop::collection::vec(aop(), 1..6),
        ops_b in prop::collection::vec(aop(), 1..4),
        muts in prop::collection::vec(amut(), 1..5),
    ) {
        let r = guarded(format!("aead case {muts:?}").chars().take(400).collect(), 120, move || -> Result<(), TestCaseError> {
            let keys = Keys::new();
            let (a, a_clear) = make_aead(&keys, bot, &ops, 1);
            let (b, b_clear) = make_aead(&keys, bot, &ops_b, 2);
            let img = AImage { a, a_clear, b, b_clear };
            for m in &muts {
                aead_check(&keys, &img, m, bot).map_err(|e| TestCaseError::fail(format!("{m:?}: {e}").chars().take(2000).collect::<String>()))?;
            }
            Ok(())
        });
        r?;
    }

    /// Arbitrary bytes as an encrypted file (with and without the magic): the header fails.
    #[test]
    fn aead_random_stores(bytes in prop::collection::vec(any::<u8>(), 1..20_000), magic in any::<bool>()) {
        let r = guarded("aead random store".into(), 60, move || -> Result<(), TestCaseError> {
            let keys = Keys::new();
            let mut bytes = bytes;
            if magic && bytes.len() >= 8 {
                bytes[..8].copy_from_slice(b"UBC-AEAD");
            }
            let env = env_over(Bottom::Mem, &bytes, None, &keys.spec("k1"));
            let e = env.stack.top().open("f").err().ok_or_else(|| TestCaseError::fail("random bytes opened"))?;
            let a = auth_failure(&e, "open")?;
            prop_assert!(matches!(a, AuthError::Header(_)), "{:?}", a);
            Ok(())
        });
        r?;
    }
}

// ------------------------------------------------------------------ spec parser

struct SpecFx {
    tmp: tempfile::TempDir,
}

impl SpecFx {
    fn new() -> SpecFx {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        std::fs::create_dir(t.join("d")).unwrap();
        std::fs::create_dir(t.join("up")).unwrap();
        std::fs::write(t.join("file"), b"not a dir").unwrap();
        Key::generate().write_file(&t.join("key")).unwrap();
        std::fs::write(t.join("badkey"), b"xyz\n").unwrap();
        std::fs::write(t.join("pass"), b"secret\n").unwrap();
        SpecFx { tmp }
    }
    fn p(&self, s: &str) -> PathBuf {
        self.tmp.path().join(s)
    }
}

fn path_choice(fx: &SpecFx, k: usize) -> String {
    let t = fx.tmp.path();
    let v: Vec<String> = vec![
        fx.p("d").display().to_string(),
        format!("{}/d/..", t.display()),
        format!("{}/d/../d", t.display()),
        fx.p("file").display().to_string(),
        fx.p("missing").display().to_string(),
        String::new(),
        "\0".into(),
        format!("{}/d\0x", t.display()),
        "d/../../..".into(),
        "/proc/self/root/nonexistent".into(),
        "ünï/cødé ☃".into(),
        " ".repeat(3),
        "x".repeat(5000),
        fx.p("key").display().to_string(),
        fx.p("badkey").display().to_string(),
        "/dev/zero".into(),
        "/dev/null".into(),
        fx.p("pass").display().to_string(),
        t.display().to_string(),
    ];
    v[k % v.len()].clone()
}

fn number_choice(k: usize, raw: u64) -> String {
    let v = [
        raw.to_string(),
        "0".into(),
        "-1".into(),
        "4096".into(),
        "4k".into(),
        "16M".into(),
        "32M".into(),
        "18446744073709551615".into(),
        "18446744073709551615K".into(),
        "99999999999999999999999".into(),
        "3".into(),
        "22".into(),
        "23".into(),
        "-2147483648".into(),
        "1e3".into(),
        "0x10".into(),
        "".into(),
        "k".into(),
        "4kk".into(),
        " 4096 ".into(),
        "٣".into(),
    ];
    v[k % v.len()].clone()
}

/// One layer of a near-valid spec.
fn layer_text(fx: &SpecFx, name: usize, opts: &[(usize, usize, u64)]) -> String {
    let names = ["dir", "mem", "null", "zstd", "aead", "union", "DIR", "zst", "", " zstd ", "dir:", "null:x", "☃"];
    let keys = [
        "level",
        "chunk",
        "keyfile",
        "passphrase-file",
        "salt",
        "upper",
        "bogus",
        "",
        "level=",
        "=",
        " ",
        "chunk,chunk",
    ];
    let n = names[name % names.len()];
    if opts.is_empty() {
        return n.to_string();
    }
    let mut parts = Vec::new();
    for &(k, v, raw) in opts {
        let key = keys[k % keys.len()];
        let val = match key {
            "keyfile" | "passphrase-file" | "upper" => path_choice(fx, v),
            "salt" => [
                "00112233445566778899aabbccddeeff",
                "xyz",
                "",
                "0011223344556677889900112233445566",
                "ÿÿÿÿÿÿÿÿÿÿÿÿÿÿÿÿ",
            ][v % 5]
                .to_string(),
            _ => number_choice(v, raw),
        };
        parts.push(format!("{key}={val}"));
    }
    if n == "dir" {
        return format!("dir:{}", path_choice(fx, opts[0].1));
    }
    format!("{n}:{}", parts.join(","))
}

/// Parse `spec`: an error must be typed and say something; a stack must answer simple
/// read-only calls. Never a panic or a hang.
fn try_spec(spec: String) -> Result<(), TestCaseError> {
    // A stack with an `s3` layer would reach the network (AWS, without an endpoint) and wait
    // out its retries: its options are parsed instead, which must not panic either.
    let s3 = ubc_stack::s3_layers(&spec);
    if !s3.is_empty() {
        for o in s3 {
            let _ = ubc_stack::layer::s3::S3Options::parse(o);
        }
        return Ok(());
    }
    // A valid passphrase spec derives a key with Argon2 (64 MiB, seconds in debug builds):
    // allowed, but given more time.
    let r =
        guarded(format!("spec {spec:?}").chars().take(300).collect(), 120, move || match Stack::open(&spec, cache()) {
            Ok(s) => {
                let _ = s.spec();
                let _ = s.top().getattr("");
                let _ = s.top().open("no-such-file");
                Ok(())
            }
            Err(e) => {
                let msg = e.to_string();
                if msg.is_empty() {
                    return Err(format!("{spec:?}: empty error message ({e:?})"));
                }
                match e {
                    Error::Spec(_) | Error::Io { .. } | Error::NotFound(_) | Error::NotDir(_) | Error::Invalid(_) => {
                        Ok(())
                    }
                    other => Err(format!("{spec:?}: unexpected error kind {other:?}")),
                }
            }
        });
    r.map_err(TestCaseError::fail)
}

proptest! {
    #![proptest_config(config(400))]

    #[test]
    fn spec_arbitrary_strings(s in any::<String>()) {
        try_spec(s)?;
    }

    #[test]
    fn spec_spec_alphabet(s in "[a-z|:=, ./0-9kKmM\\-]{0,60}") {
        try_spec(s)?;
    }

    #[test]
    fn spec_near_valid(
        layers in prop::collection::vec((0usize..13, prop::collection::vec((0usize..12, 0usize..40, any::<u64>()), 0..4)), 1..5),
        sep in prop::sample::select(vec![" | ", "|", "||", " |", "| |", "\u{0}|"]),
    ) {
        let fx = SpecFx::new();
        let spec = layers.iter().map(|(n, o)| layer_text(&fx, *n, o)).collect::<Vec<_>>().join(sep);
        try_spec(spec)?;
    }
}

// ------------------------------------------------------------------ regressions

/// Reading a passphrase file was unbounded: `passphrase-file=/dev/zero` read until memory
/// ran out. It is now cut at a limit and refused.
#[test]
fn spec_passphrase_from_an_endless_file_is_refused() {
    let r = guarded("passphrase /dev/zero".into(), 30, || {
        Stack::open("mem | aead:passphrase-file=/dev/zero,salt=00112233445566778899aabbccddeeff", cache())
            .err()
            .map(|e| e.to_string())
    });
    let msg = r.expect("an endless passphrase file must be refused");
    assert!(msg.contains("passphrase-file") && msg.contains("/dev/zero"), "{msg}");
}

// ------------------------------------------------------------------ cargo-fuzz replays

/// The cargo-fuzz cases themselves (`fuzz/src/lib.rs`), compiled here on stable so the
/// inputs it found are replayed by `cargo test`. It includes the shared data generator
/// (`common/data.rs`) itself, as the fuzz crate has no `common`: a second copy here.
#[path = "../../../fuzz/src/lib.rs"]
#[allow(dead_code, clippy::duplicate_mod)]
mod cases;

/// Every input cargo-fuzz found crashing (`tests/fuzz-regressions/TARGET/`), run through
/// its target's case: none may panic, hang or abort now.
#[test]
fn cargo_fuzz_crashes_replay() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-regressions");
    let mut n = 0;
    for target in ["zstd_format", "aead_format", "spec"] {
        let Ok(dir) = std::fs::read_dir(root.join(target)) else { continue };
        for e in dir {
            let p = e.unwrap().path();
            let data = std::fs::read(&p).unwrap();
            let t = target.to_string();
            guarded(format!("{}", p.display()), 60, move || match t.as_str() {
                "zstd_format" => cases::zstd_case(&data),
                "aead_format" => cases::aead_case(&data),
                _ => cases::spec_case(&data),
            });
            n += 1;
        }
    }
    assert!(n > 0, "no inputs under {}", root.display());
}

/// Found by cargo-fuzz (aead_format, crash-76b9a1e0…): a header sealed with the key but
/// claiming a length near 2^63 opened, and reading its last block asked the lower file for
/// bytes past the largest offset the cache supports — an `OffsetOverflow`, not an
/// authentication error. A length whose blocks cannot be stored is now refused at open
/// (`BadVersion`), and the largest that can (`MAX_LEN`) opens and reads as truncated.
#[test]
fn aead_header_length_past_what_can_be_stored() {
    use ubc_stack::encrypt::{EncryptPager, MAX_LEN};
    guarded("aead giant length".into(), 60, || {
        let valid = cases::aead_file(b"hello");
        let key = std::sync::Arc::new(Key::from_bytes(cases::KEY));
        let with_len = |len: u64| {
            let mut b = valid.clone();
            b[32..40].copy_from_slice(&len.to_le_bytes());
            cases::reseal_aead_header(&mut b);
            b
        };
        for len in [MAX_LEN + 1, MAX_LEN + 4096, i64::MAX as u64, u64::MAX] {
            let e = EncryptPager::open(cases::lower_with(&with_len(len)), key.clone()).unwrap_err();
            assert!(matches!(AuthError::find(&e), Some(AuthError::Header(Failure::BadVersion))), "{len}: {e}");
        }
        let p = EncryptPager::open(cases::lower_with(&with_len(MAX_LEN)), key).unwrap();
        let mut b = [0u8; 4096];
        let last = (MAX_LEN - 1) / 4096 * 4096;
        let e = ubc::Pager::get_pages(&p, last, &mut b).unwrap_err();
        assert!(matches!(AuthError::find(&e), Some(AuthError::Block { failure: Failure::Truncated, .. })), "{e}");
        // Growing past it is refused, not attempted.
        assert_eq!(ubc::Pager::set_len(&p, MAX_LEN + 1).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(
            ubc::Pager::put_pages(&p, MAX_LEN / 4096 * 4096, &b).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    });
}

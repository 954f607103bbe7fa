//! Tests of the zstd layer through a real `ubc::Cache` over real files in a tempdir.

mod common;

use common::data::gen_data;
use proptest::prelude::*;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use ubc::pager::MemPager;
use ubc::{Access, Cache, Fill, Pager};
use ubc_stack::compress::{CompressOptions, CompressPager};

const KB: usize = 1024;

// Field order is drop order: the cache handle goes last.
struct Env {
    path: PathBuf,
    upper: ubc::File,
    pager: Arc<CompressPager>,
    lower: ubc::File,
    cache: Cache,
}

impl Drop for Env {
    fn drop(&mut self) {
        teardown(&self.cache);
    }
}

fn new_cache() -> Cache {
    Cache::new(64 << 20).unwrap()
}

/// Tear a cache holding a zstd file down. The layer's lower handle is a handle on the same
/// cache, held by the upper object the cache itself holds: a cycle, so dropping every handle
/// does not shut the cache down (see the report). After `evict_all` (which syncs, so the
/// layer commits) the upper object has no pages and is forgotten when its last handle
/// closes, which drops the pager and its lower handle and breaks the cycle.
fn teardown(cache: &Cache) {
    let _ = cache.evict_all();
}

fn open_env(path: &Path, opts: CompressOptions) -> io::Result<Env> {
    open_env_in(new_cache(), path, opts)
}

fn open_env_in(cache: Cache, path: &Path, opts: CompressOptions) -> io::Result<Env> {
    let lower = cache.create_path(path)?;
    let pager = Arc::new(CompressPager::open(lower.try_clone()?, opts)?);
    let upper = cache.open(pager.clone(), Access::ReadWrite)?;
    Ok(Env { path: path.to_path_buf(), upper, pager, lower, cache })
}

impl Env {
    fn read_all(&self) -> Vec<u8> {
        let len = self.upper.len().unwrap() as usize;
        let mut v = vec![0u8; len];
        self.upper.read_exact_at(&mut v, 0).unwrap();
        v
    }

    /// Drop everything (no explicit sync) and open again in a new cache.
    fn reopen(self, opts: CompressOptions) -> Env {
        let path = self.path.clone();
        drop(self);
        open_env(&path, opts).unwrap()
    }
}

fn opts(chunk_size: usize) -> CompressOptions {
    CompressOptions::default().with_chunk_size(chunk_size)
}

fn model_write(model: &mut Vec<u8>, off: usize, data: &[u8]) {
    if model.len() < off + data.len() {
        model.resize(off + data.len(), 0);
    }
    model[off..off + data.len()].copy_from_slice(data);
}

/// Host file bytes.
/// A new zstd file at `path` (chunks of `cs` bytes) holding `gen_data(seed, len, 1)`,
/// synced: the durable state later steps are checked against.
fn synced_file(path: &Path, cs: usize, seed: u64, len: usize) -> (Env, Vec<u8>) {
    let env = open_env(path, opts(cs)).unwrap();
    let a = gen_data(seed, len, 1);
    env.upper.write_at(&a, 0).unwrap();
    env.upper.sync().unwrap();
    (env, a)
}

fn host_bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

// ---------------------------------------------------------------- on-disk parsing (per docs)

struct Sb {
    slot: usize,
    generation: u64,
    logical_len: u64,
    index_off: u64,
    index_len: u64,
}

fn u32le(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64le(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// The newest superblock with a valid checksum.
fn newest_sb(file: &[u8]) -> Sb {
    let mut best: Option<Sb> = None;
    for slot in 0..2 {
        let b = &file[slot * 4096..slot * 4096 + 68];
        if &b[0..8] != b"UBCZSTD1" || crc32fast::hash(&b[..64]) != u32le(b, 64) {
            continue;
        }
        let sb = Sb {
            slot,
            generation: u64le(b, 16),
            logical_len: u64le(b, 24),
            index_off: u64le(b, 32),
            index_len: u64le(b, 40),
        };
        if best.as_ref().is_none_or(|x| x.generation < sb.generation) {
            best = Some(sb);
        }
    }
    best.expect("a valid superblock")
}

/// (chunk, lower offset, stored len, entry offset in file)
fn index_entries(file: &[u8], sb: &Sb) -> Vec<(u64, u64, u32, usize)> {
    let at = sb.index_off as usize;
    let count = u64le(file, at + 16) as usize;
    (0..count)
        .map(|i| {
            let p = at + 24 + i * 32;
            (u64le(file, p), u64le(file, p + 8), u32le(file, p + 16), p)
        })
        .collect()
}

/// Recompute the index checksum in the superblock and the superblock checksum.
fn fix_crcs(file: &mut [u8], sb: &Sb) {
    let (io, il) = (sb.index_off as usize, sb.index_len as usize);
    let crc = crc32fast::hash(&file[io..io + il]);
    let s = sb.slot * 4096;
    file[s + 48..s + 52].copy_from_slice(&crc.to_le_bytes());
    let c = crc32fast::hash(&file[s..s + 64]);
    file[s + 64..s + 68].copy_from_slice(&c.to_le_bytes());
}

/// Compare without printing megabytes: lengths and the first/last differing offsets.
fn diff(got: &[u8], want: &[u8]) -> Option<String> {
    if got == want {
        return None;
    }
    let n = got.len().max(want.len());
    let first = (0..n).find(|&i| got.get(i) != want.get(i));
    let last = (0..n).rev().find(|&i| got.get(i) != want.get(i));
    Some(format!("len {} vs {}, differ {first:?}..={last:?}", got.len(), want.len()))
}

/// `assert_eq!` for byte vectors that reports offsets instead of dumping the bytes.
macro_rules! assert_bytes {
    ($got:expr, $want:expr) => {
        assert_bytes!($got, $want, "")
    };
    ($got:expr, $want:expr, $($ctx:tt)+) => {{
        let (g, w): (&[u8], &[u8]) = (&$got[..], &$want[..]);
        if let Some(d) = diff(g, w) {
            panic!("bytes differ: {d}: {}", format!($($ctx)+));
        }
    }};
}

fn is_invalid_data(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::InvalidData
}

fn open_err(path: &Path) -> io::Error {
    let cache = new_cache();
    let lower = cache.create_path(path).unwrap();
    match CompressPager::open(lower, CompressOptions::default()) {
        Ok(_) => panic!("open of a corrupt file succeeded"),
        Err(e) => e,
    }
}

// ---------------------------------------------------------------- tests

#[test]
fn round_trip_many_sizes() {
    let dir = tempfile::tempdir().unwrap();
    for (ci, &cs) in [4 * KB, 16 * KB, 64 * KB].iter().enumerate() {
        let path = dir.path().join(format!("f{ci}.z"));
        let env = open_env(&path, opts(cs)).unwrap();
        let mut model = Vec::new();
        let sizes = [1, 100, 4095, 4096, 4097, cs - 1, cs, cs + 1, 3 * cs + 17, 200_000];
        let mut off = 0usize;
        for (i, &n) in sizes.iter().enumerate() {
            for kind in 0..3u8 {
                let d = gen_data((i * 3 + kind as usize) as u64, n, kind);
                // Chunk-straddling, unaligned offsets, and overwrites of earlier data.
                let at = (off + cs - 7 * (i + 1)) % (off + cs);
                env.upper.write_at(&d, at as u64).unwrap();
                model_write(&mut model, at, &d);
                off = off.max(at + n);
            }
        }
        assert_bytes!(env.read_all(), model, "before sync, cs {cs}");
        env.upper.sync().unwrap();
        let env = env.reopen(opts(cs));
        assert_eq!(env.upper.len().unwrap() as usize, model.len());
        assert_bytes!(env.read_all(), model, "after reopen, cs {cs}");
        // Sub-page reads at odd places.
        for at in [0usize, 1, 4095, 4097, cs - 3, model.len() - 5] {
            let mut b = [0u8; 10];
            let n = env.upper.read_at(&mut b, at as u64).unwrap();
            assert_eq!(&b[..n], &model[at..(at + 10).min(model.len())]);
        }
    }
}

#[test]
fn reopen_sees_exactly_synced_data_and_options_of_file_win() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.z");
    let env = open_env(&path, opts(16 * KB)).unwrap();
    let d = gen_data(7, 1_000_000, 1);
    env.upper.write_at(&d, 0).unwrap();
    env.upper.sync().unwrap();
    assert_eq!(CompressPager::logical_len(&env.lower).unwrap(), 1_000_000);
    let st = env.pager.stored_stats();
    assert_eq!(st.chunk_size, 16 * KB);
    assert!(st.stored_bytes < 1_000_000 / 2, "text compresses: {st:?}");
    // Reopen with different options: the file's chunk size is kept.
    let env = env.reopen(opts(64 * KB));
    assert_eq!(env.pager.stored_stats().chunk_size, 16 * KB);
    assert_bytes!(env.read_all(), d);
}

#[test]
fn empty_lower_is_empty_file_and_nothing_written_until_needed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.z");
    let env = open_env(&path, CompressOptions::default()).unwrap();
    assert_eq!(env.upper.len().unwrap(), 0);
    assert_eq!(env.lower.len().unwrap(), 0);
    assert_eq!(CompressPager::logical_len(&env.lower).unwrap(), 0);
    env.upper.sync().unwrap();
    let env = env.reopen(CompressOptions::default());
    assert_eq!(env.upper.len().unwrap(), 0);
    assert_eq!(env.pager.identity().map(|i| matches!(i, ubc::Identity::Named { kind: "zstd", .. })), Some(true));
    assert!(env.pager.is_writable());
}

#[test]
fn close_without_sync_commits_when_the_cache_drops_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.z");
    let env = open_env(&path, CompressOptions::default()).unwrap();
    let d = gen_data(3, 777_777, 1);
    env.upper.write_at(&d, 0).unwrap();
    let env = env.reopen(CompressOptions::default());
    assert_bytes!(env.read_all(), d);
}

#[test]
fn bad_options_are_rejected() {
    let cache = new_cache();
    for cs in [0usize, 1000, 2048, 3 * 4096, 32 << 20] {
        let lower = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
        let e = CompressPager::open(lower, opts(cs)).err().expect("rejected");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{cs}");
    }
    for level in [23, 1000, -200_000] {
        let lower = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
        let e = CompressPager::open(lower, CompressOptions::default().with_level(level)).err().expect("rejected");
        assert!(e.kind() == io::ErrorKind::InvalidInput && e.to_string().contains("level"), "{level}: {e}");
    }
}

#[test]
fn rewrite_of_one_chunk_stays_bounded_and_touches_only_that_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.z");
    let cs = 64 * KB;
    let env = open_env(&path, opts(cs)).unwrap();
    // 16 incompressible chunks: each stored raw, 64 KiB.
    let mut model = gen_data(1, 16 * cs, 0);
    env.upper.write_at(&model, 0).unwrap();
    env.upper.sync().unwrap();
    let before = host_bytes(&path);
    let base_len = before.len();
    // One rewrite + sync: count changed bytes in the file.
    let d = gen_data(1000, cs, 0);
    env.upper.write_at(&d, 5 * cs as u64).unwrap();
    model_write(&mut model, 5 * cs, &d);
    env.upper.sync().unwrap();
    let after = host_bytes(&path);
    let common = before.len().min(after.len());
    let changed = (0..common).filter(|&i| before[i] != after[i]).count() + after.len().saturating_sub(before.len());
    // The new chunk (64 KiB) + index (< 1 KiB) + a superblock, not the other 15 chunks.
    assert!(changed <= cs + 8 * KB, "changed {changed} bytes");
    // The other chunks' stored bytes are where they were, unchanged.
    let sb_old = newest_sb(&before);
    let sb_new = newest_sb(&after);
    let old_e = index_entries(&before, &sb_old);
    let new_e = index_entries(&after, &sb_new);
    assert_eq!(old_e.len(), 16);
    for (o, n) in old_e.iter().zip(&new_e) {
        assert_eq!(o.0, n.0);
        if o.0 != 5 {
            assert_eq!((o.1, o.2), (n.1, n.2), "chunk {} moved", o.0);
            let (a, l) = (o.1 as usize, o.2 as usize);
            assert_bytes!(before[a..a + l], after[a..a + l], "chunk {} bytes changed", o.0);
        } else {
            assert_ne!(o.1, n.1, "copy-on-write: chunk 5 must move");
        }
    }
    // 100 rewrites of the same chunk, each synced: space is reused.
    for i in 0..100u64 {
        let d = gen_data(2000 + i, cs, (i % 2) as u8);
        env.upper.write_at(&d, 5 * cs as u64).unwrap();
        model_write(&mut model, 5 * cs, &d);
        env.upper.sync().unwrap();
    }
    let len = env.lower.len().unwrap() as usize;
    assert!(len <= base_len + 2 * cs + 8 * KB, "lower grew to {len} from {base_len}");
    // 100 rewrites straight to the pager, no sync between: reused at once.
    for i in 0..100u64 {
        let d = gen_data(3000 + i, cs, 0);
        env.pager.put_pages(5 * cs as u64, &d).unwrap();
    }
    let st = env.pager.stored_stats();
    assert!(st.allocated_end <= (base_len + 3 * cs + 8 * KB) as u64, "{st:?}");
    drop(env);
}

#[test]
fn truncate_and_extend() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.z");
    let cs = 16 * KB;
    let env = open_env(&path, opts(cs)).unwrap();
    let mut model = gen_data(3, 10 * cs + 500, 0);
    env.upper.write_at(&model, 0).unwrap();
    env.upper.sync().unwrap();
    let full = env.lower.len().unwrap();
    // Shrink to the middle of a chunk, then grow: the cut tail reads as zeros.
    let cut = 3 * cs + 1234;
    env.upper.set_len(cut as u64).unwrap();
    model.truncate(cut);
    env.upper.set_len(8 * cs as u64).unwrap();
    model.resize(8 * cs, 0);
    assert_bytes!(env.read_all(), model);
    env.upper.sync().unwrap();
    // The lower file gave its free tail back.
    assert!(env.lower.len().unwrap() < full / 2, "{} vs {full}", env.lower.len().unwrap());
    let env = env.reopen(opts(cs));
    assert_bytes!(env.read_all(), model);
    // The same straight on the pager (no cache in between).
    env.pager.set_len(cs as u64 + 10).unwrap();
    env.pager.set_len(4 * cs as u64).unwrap();
    let mut b = vec![0xAAu8; 2 * cs];
    assert_eq!(env.pager.get_pages(0, &mut b).unwrap(), Fill::Data);
    assert_bytes!(&b[..cs + 10], &model[..cs + 10]);
    assert!(b[cs + 10..].iter().all(|&x| x == 0));
    // Shrink to zero and back.
    env.upper.set_len(0).unwrap();
    env.upper.set_len(100).unwrap();
    assert_bytes!(env.read_all(), vec![0u8; 100]);
    env.upper.sync().unwrap();
    let env = env.reopen(opts(cs));
    assert_bytes!(env.read_all(), vec![0u8; 100]);
    assert_eq!(env.pager.stored_stats().chunks, 0);
}

#[test]
fn holes_read_as_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.z");
    let env = open_env(&path, CompressOptions::default()).unwrap();
    let far = 10u64 << 20;
    let d = gen_data(4, 5000, 1);
    env.upper.write_at(&d, far).unwrap();
    // A chunk of explicit zeros is not stored either.
    env.upper.write_at(&vec![0u8; 64 * KB], 1 << 20).unwrap();
    env.upper.sync().unwrap();
    let mut b = vec![0xFFu8; 256 * KB];
    env.upper.read_exact_at(&mut b, 4096).unwrap();
    assert!(b.iter().all(|&x| x == 0));
    let mut b = vec![0xFFu8; 64 * KB];
    assert_eq!(env.pager.get_pages(0, &mut b).unwrap(), Fill::Hole);
    assert_eq!(env.pager.get_pages(1 << 20, &mut b).unwrap(), Fill::Hole);
    assert_eq!(env.pager.get_pages(far + (1 << 20), &mut b).unwrap(), Fill::Hole, "past the end");
    assert_eq!(env.pager.stored_stats().chunks, 1);
    assert!(env.lower.len().unwrap() < 64 * 1024, "sparse: {}", env.lower.len().unwrap());
    let env = env.reopen(CompressOptions::default());
    let mut b = vec![0u8; 5000];
    env.upper.read_exact_at(&mut b, far).unwrap();
    assert_bytes!(b, d);
    assert_eq!(env.upper.len().unwrap(), far + 5000);
}

/// A crash between syncs: put_pages reached the lower file (and the lower file was even
/// synced), but the compress layer was not synced. The host file at that moment, opened
/// elsewhere, must show exactly the last synced state.
#[test]
fn crash_between_syncs_recovers_last_sync() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.z");
    let cs = 16 * KB;
    let (env, a) = synced_file(&path, cs, 5, 20 * cs + 300);
    // After state A: writes straight to the pager (as writeback would), a truncation, an
    // extension — all reaching the lower file, which is synced, but no compress-layer sync.
    for i in 0..20u64 {
        let d = gen_data(100 + i, 3 * cs, (i % 3) as u8);
        env.pager.put_pages(i * cs as u64 / 2 * 2, &d).unwrap();
    }
    env.pager.set_len(5 * cs as u64 + 77).unwrap();
    env.pager.put_pages(40 * cs as u64, &gen_data(9, cs, 0)).unwrap();
    env.lower.sync().unwrap();
    let crash = dir.path().join("crash.z");
    std::fs::copy(&path, &crash).unwrap();
    {
        let c = open_env(&crash, opts(cs)).unwrap();
        assert_bytes!(c.read_all(), a, "crash image shows state A");
    }
    // Also the image from the middle of the puts (lower not synced: whatever reached the host).
    let mid = gen_data(77, cs, 0);
    env.pager.put_pages(0, &mid).unwrap();
    std::fs::copy(&path, &crash).unwrap();
    {
        let c = open_env(&crash, opts(cs)).unwrap();
        assert_bytes!(c.read_all(), a, "second crash image shows state A");
    }
    drop(env);
}

/// A lower pager whose `sync` fails once, at a chosen call.
struct FailNthSync {
    inner: ubc::pager::FilePager,
    syncs: std::sync::atomic::AtomicU64,
    fail_at: std::sync::atomic::AtomicU64,
}

impl Pager for FailNthSync {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        self.inner.get_pages(offset, buf)
    }
    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.inner.put_pages(offset, data)
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }
    fn sync(&self) -> io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        let n = self.syncs.fetch_add(1, SeqCst) + 1;
        if n == self.fail_at.load(SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.sync()
    }
    fn describe(&self) -> String {
        "fail-nth-sync".into()
    }
}

/// A commit whose first lower sync (data + index) fails: the last commit stays in force.
/// A commit whose second lower sync (superblock) fails: the outcome is unknown — the image
/// shows the old or the new state, never a damaged one — and a later sync succeeds.
#[test]
fn failed_sync_keeps_a_consistent_commit_and_retries() {
    use std::sync::atomic::Ordering::SeqCst;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.z");
    let cs = 16 * KB;
    let cache = new_cache();
    let fp = Arc::new(FailNthSync {
        inner: ubc::pager::FilePager::create(&path).unwrap(),
        syncs: 0.into(),
        fail_at: 0.into(),
    });
    let lower = cache.open(fp.clone(), Access::ReadWrite).unwrap();
    let pager = Arc::new(CompressPager::open(lower.try_clone().unwrap(), opts(cs)).unwrap());
    let upper = cache.open(pager.clone(), Access::ReadWrite).unwrap();
    let a = gen_data(1, 8 * cs, 0);
    upper.write_at(&a, 0).unwrap();
    upper.sync().unwrap();
    let b = gen_data(2, 8 * cs, 1);
    let crash = dir.path().join("crash.z");
    for (nth, name) in [(1u64, "data sync"), (2, "superblock sync")] {
        upper.write_at(&b, 0).unwrap();
        fp.fail_at.store(fp.syncs.load(SeqCst) + nth, SeqCst);
        assert!(upper.sync().is_err(), "{name}");
        std::fs::copy(&path, &crash).unwrap();
        let got = open_env(&crash, opts(cs)).unwrap().read_all();
        if nth == 1 {
            assert_bytes!(got, a, "{name}");
        } else {
            assert!(got == a || got == b, "{name}: neither old nor new state");
        }
    }
    upper.sync().unwrap();
    assert_eq!(pager.stored_stats().pending_bytes, 0);
    std::fs::copy(&path, &crash).unwrap();
    assert_bytes!(open_env(&crash, opts(cs)).unwrap().read_all(), b);
    teardown(&cache);
    drop((upper, pager, lower, cache));
    let env = open_env(&path, opts(cs)).unwrap();
    assert_bytes!(env.read_all(), b);
}

#[test]
fn concurrent_puts_and_gets_in_shared_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.z");
    let cs = 64 * KB;
    let env = open_env(&path, opts(cs)).unwrap();
    let pager = env.pager.clone();
    let pages = 4 * cs / 4096;
    // Each thread owns every 8th page of 4 chunks and rewrites its pages; readers read
    // whole chunks meanwhile (every read must succeed).
    std::thread::scope(|s| {
        for t in 0..8usize {
            let pager = pager.clone();
            s.spawn(move || {
                for round in 0..20u64 {
                    for p in (t..pages).step_by(8) {
                        let d = vec![(t as u8) << 4 | (round as u8 & 15); 4096];
                        pager.put_pages((p * 4096) as u64, &d).unwrap();
                    }
                }
            });
        }
        for _ in 0..2 {
            let pager = pager.clone();
            s.spawn(move || {
                let mut b = vec![0u8; cs];
                for i in 0..200u64 {
                    pager.get_pages((i % 4) * cs as u64, &mut b).unwrap();
                }
            });
        }
    });
    let mut b = vec![0u8; 4 * cs];
    pager.get_pages(0, &mut b).unwrap();
    for p in 0..pages {
        let want = ((p % 8) as u8) << 4 | (19 & 15);
        assert!(b[p * 4096..(p + 1) * 4096].iter().all(|&x| x == want), "page {p}");
    }
    pager.sync().unwrap();
    // Check a copy: the cache object in front never saw these direct puts (its length is 0,
    // so closing it would rightly truncate the layer).
    let copy = dir.path().join("copy.z");
    std::fs::copy(&path, &copy).unwrap();
    assert_bytes!(open_env(&copy, opts(cs)).unwrap().read_all(), b);
    drop(pager);
    drop(env);
}

#[test]
fn read_only_lower() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.z");
    let d = gen_data(8, 300_000, 1);
    {
        let env = open_env(&path, CompressOptions::default()).unwrap();
        env.upper.write_at(&d, 0).unwrap();
        env.upper.sync().unwrap();
    }
    let cache = new_cache();
    let lower = cache.open_path(&path, Access::ReadOnly).unwrap();
    let pager = Arc::new(CompressPager::open(lower, CompressOptions::default()).unwrap());
    assert!(!pager.is_writable());
    assert!(cache.open(pager.clone(), Access::ReadWrite).is_err());
    assert!(pager.put_pages(0, &[1; 4096]).is_err());
    let f = cache.open(pager.clone(), Access::ReadOnly).unwrap();
    let mut b = vec![0u8; d.len()];
    f.read_exact_at(&mut b, 0).unwrap();
    assert_bytes!(b, d);
    f.sync().unwrap();
    teardown(&cache);
}

#[test]
fn reload_after_restore() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.z");
    let cs = 16 * KB;
    let (env, a) = synced_file(&path, cs, 1, 5 * cs);
    let saved = host_bytes(&path);
    env.upper.write_at(&gen_data(2, 9 * cs, 0), 0).unwrap();
    env.upper.sync().unwrap();
    // Restore the old version underneath, through the lower file.
    env.lower.set_len(0).unwrap();
    env.lower.write_at(&saved, 0).unwrap();
    env.pager.reload().unwrap();
    assert_eq!(env.pager.len().unwrap(), a.len() as u64);
    let mut b = vec![0u8; a.len()];
    env.pager.get_pages(0, &mut b).unwrap();
    assert_bytes!(b, a);
    env.pager.put_pages(0, &[7u8; 4096]).unwrap();
    env.pager.sync().unwrap();
}

// ---------------------------------------------------------------- corruption

/// A file with two commits: gen 1 = `a` (8 chunks of 16 KiB), gen 2 = chunk 0 rewritten.
fn two_commits(dir: &Path) -> (PathBuf, Vec<u8>, Vec<u8>) {
    let path = dir.join("c.z");
    let cs = 16 * KB;
    let (env, a) = synced_file(&path, cs, 11, 8 * cs);
    let mut b = a.clone();
    let d = gen_data(12, cs, 1);
    env.upper.write_at(&d, 0).unwrap();
    model_write(&mut b, 0, &d);
    env.upper.sync().unwrap();
    drop(env);
    (path, a, b)
}

fn read_through(path: &Path) -> io::Result<Vec<u8>> {
    let env = open_env(path, opts(16 * KB))?;
    let mut v = vec![0u8; env.upper.len()? as usize];
    env.upper.read_exact_at(&mut v, 0)?;
    Ok(v)
}

#[test]
fn corrupt_newest_superblock_falls_back_to_previous_commit() {
    let dir = tempfile::tempdir().unwrap();
    let (path, a, b) = two_commits(dir.path());
    assert_bytes!(read_through(&path).unwrap(), b);
    let mut f = host_bytes(&path);
    let sb = newest_sb(&f);
    assert_eq!(sb.generation, 2);
    f[sb.slot * 4096 + 30] ^= 0x40; // torn newest superblock
    std::fs::write(&path, &f).unwrap();
    assert_bytes!(read_through(&path).unwrap(), a, "previous commit");
}

/// The slot holding a published commit (superblock flags bit 0), if any.
fn published_slot(file: &[u8]) -> Option<usize> {
    (0..2).find(|&s| &file[s * 4096..s * 4096 + 8] == b"UBCZSTD1" && u32le(file, s * 4096 + 52) & 1 == 1)
}

/// Stats of the file stored at `path`, opened afresh.
fn stats_of(path: &Path) -> ubc_stack::compress::CompressStats {
    open_env(path, opts(16 * KB)).unwrap().pager.stored_stats()
}

/// A close publishes a commit (`File::write_through`: written through, not waited for); the last
/// durable one stays whole under any number of them. A machine crash can lose any write
/// made since that durable commit: the images below are the worst cases — the published
/// superblock lost, or it arrived but its index did not — and each must read as the
/// durable state, exactly. Fails if a publish reuses the durable commit's extents or index,
/// or writes into its slot.
#[test]
fn published_commits_keep_the_last_durable_one_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.z");
    let cs = 16 * KB;
    let (env, a) = synced_file(&path, cs, 21, 12 * cs + 500);
    assert!(!env.pager.stored_stats().published);
    let mut b = a.clone();
    for i in 0..6u64 {
        // Rewrites of chunks the durable commit holds, a growth, and a cut.
        let d = gen_data(30 + i, cs + 777, (i % 2) as u8);
        let off = (i as usize * 5 % 12) * cs + 100;
        env.upper.write_at(&d, off as u64).unwrap();
        model_write(&mut b, off, &d);
        if i == 4 {
            env.upper.set_len(9 * cs as u64 + 3).unwrap();
            b.resize(9 * cs + 3, 0);
        }
        env.upper.write_through().unwrap();
        let st = env.pager.stored_stats();
        assert!(st.published, "after flush {i}: {st:?}");
        assert_bytes!(host_stack_read(&path), b, "the store holds the published state after flush {i}");
    }
    let image = host_bytes(&path);
    let slot = published_slot(&image).expect("a published superblock");
    let durable = 1 - slot;
    assert_eq!(u32le(&image, durable * 4096 + 52), 0, "the other slot is the durable commit");
    let crash = dir.path().join("crash.z");
    // 1. The published superblock never reached the device.
    let mut f = image.clone();
    f[slot * 4096..slot * 4096 + 68].fill(0);
    std::fs::write(&crash, &f).unwrap();
    assert_bytes!(read_through(&crash).unwrap(), a, "published superblock lost: the durable state");
    // 2. It did, its index did not (overwritten by whatever was there).
    let mut f = image.clone();
    let sb = newest_sb(&f);
    assert_eq!(sb.slot, slot);
    f[sb.index_off as usize + 24 + 3] ^= 0x20;
    std::fs::write(&crash, &f).unwrap();
    assert_bytes!(read_through(&crash).unwrap(), a, "published index damaged: the durable state");
    assert!(stats_of(&crash).recovered_durable);
    // 3. Everything arrived: the published state, and it keeps the durable one protected
    //    after the reopen too (a new publish there must not take its extents).
    std::fs::write(&crash, &image).unwrap();
    let mut f = {
        let e = open_env(&crash, opts(cs)).unwrap();
        assert_bytes!(e.read_all(), b, "the published state");
        assert!(e.pager.stored_stats().published && !e.pager.stored_stats().recovered_durable);
        for i in 0..4u64 {
            e.upper.write_at(&gen_data(60 + i, 3 * cs, 0), i * cs as u64).unwrap();
            e.upper.write_through().unwrap();
        }
        // Before the teardown, which syncs.
        host_bytes(&crash)
    };
    let s2 = published_slot(&f).expect("still published");
    assert_eq!(s2, slot, "publishes after a reopen stay out of the durable slot");
    f[s2 * 4096..s2 * 4096 + 68].fill(0);
    std::fs::write(&crash, &f).unwrap();
    assert_bytes!(read_through(&crash).unwrap(), a, "the durable state survives publishes after a reopen");
    // 4. A sync makes the newest state durable (flags clear) and frees the old extents.
    env.upper.sync().unwrap();
    let st = env.pager.stored_stats();
    assert!(!st.published && st.pending_bytes == 0, "{st:?}");
    let f = host_bytes(&path);
    assert_eq!(published_slot(&f), None);
    assert_bytes!(read_through(&path).unwrap(), b);
    drop(env);
}

/// Read `path` as a zstd file through a fresh cache (what a process started after a kill
/// of this one would see).
fn host_stack_read(path: &Path) -> Vec<u8> {
    let copy = path.with_extension("copy");
    std::fs::copy(path, &copy).unwrap();
    let v = read_through(&copy).unwrap();
    std::fs::remove_file(&copy).unwrap();
    v
}

/// What a publish keeps for the last durable commit is that commit's superseded extents —
/// at most its own size, however often the file is rewritten and closed (each publish frees
/// the one before it) — and no more than 16 MiB beyond the file's own stored bytes: a file
/// synced large, then cut and closed, is committed durably at that close, which frees the
/// old extents, instead of keeping them until a sync that may never come.
#[test]
fn publishes_keep_at_most_the_durable_commit_and_never_much_more_than_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.z");
    let env = open_env(&path, opts(64 * KB)).unwrap();
    let mb = 1 << 20;
    // Incompressible, so stored bytes are logical bytes.
    env.upper.write_at(&gen_data(200, 2 * mb, 0), 0).unwrap();
    env.upper.sync().unwrap();
    for i in 0..30u64 {
        env.upper.write_at(&gen_data(201 + i, 2 * mb, 0), 0).unwrap();
        env.upper.write_through().unwrap();
        let st = env.pager.stored_stats();
        assert!(st.published, "rewrite {i}: a 2 MiB file keeps its durable commit: {st:?}");
        assert!(
            st.pending_bytes <= 2 * mb as u64 + 64 * KB as u64,
            "rewrite {i}: kept only the durable commit: {st:?}"
        );
    }
    assert_bytes!(host_stack_read(&path), gen_data(230, 2 * mb, 0));
    // Synced at 20 MiB, cut to 1 MiB and closed: 20 MiB kept for 1 MiB of file is past the
    // bound, so this close commits durably and keeps nothing.
    env.upper.write_at(&gen_data(300, 20 * mb, 0), 0).unwrap();
    env.upper.sync().unwrap();
    env.upper.set_len(mb as u64).unwrap();
    env.upper.write_through().unwrap();
    let st = env.pager.stored_stats();
    assert!(!st.published && st.pending_bytes == 0, "a cut file's close commits durably: {st:?}");
    assert_bytes!(host_stack_read(&path), gen_data(300, mb, 0));
    drop(env);
}

#[test]
fn corrupt_both_superblocks_is_invalid_data() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _) = two_commits(dir.path());
    let mut f = host_bytes(&path);
    f[20] ^= 1;
    f[4096 + 20] ^= 1;
    std::fs::write(&path, &f).unwrap();
    let e = open_err(&path);
    assert!(is_invalid_data(&e) && e.to_string().contains("superblock"), "{e}");
    // Not our format at all.
    std::fs::write(&path, vec![0x55u8; 10000]).unwrap();
    let e = open_err(&path);
    assert!(is_invalid_data(&e) && e.to_string().contains("magic"), "{e}");
}

#[test]
fn corrupt_index_is_invalid_data() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _) = two_commits(dir.path());
    let orig = host_bytes(&path);
    let mut f = orig.clone();
    let sb = newest_sb(&f);
    f[sb.index_off as usize + 24 + 9] ^= 0x10;
    std::fs::write(&path, &f).unwrap();
    let e = open_err(&path);
    assert!(is_invalid_data(&e) && e.to_string().contains("index"), "{e}");
    assert!(e.to_string().contains(&sb.index_off.to_string()), "names the offset: {e}");
    // Other damage, to the intact file, with checksums fixed up: the entry's validation
    // catches it.
    let mut f = orig.clone();
    let ents = index_entries(&f, &sb);
    let p = ents[3].3;
    f[p + 8..p + 16].copy_from_slice(&(1u64 << 40).to_le_bytes()); // extent past the end
    fix_crcs(&mut f, &sb);
    std::fs::write(&path, &f).unwrap();
    let e = open_err(&path);
    assert!(is_invalid_data(&e) && e.to_string().contains("chunk 3"), "{e}");
    // Truncated lower file.
    let f = host_bytes(&path);
    std::fs::write(&path, &f[..f.len() / 2]).unwrap();
    let e = open_err(&path);
    assert!(is_invalid_data(&e), "{e}");
}

#[test]
fn corrupt_chunk_fails_only_that_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, b) = two_commits(dir.path());
    let cs = 16 * KB;
    let mut f = host_bytes(&path);
    let sb = newest_sb(&f);
    assert_eq!(sb.logical_len, b.len() as u64);
    let ents = index_entries(&f, &sb);
    let (_, off, stored, entry_at) = ents[3];
    f[off as usize + stored as usize / 2] ^= 0xFF;
    std::fs::write(&path, &f).unwrap();
    let env = open_env(&path, opts(cs)).unwrap();
    let mut buf = vec![0u8; cs];
    let e = env.pager.get_pages(3 * cs as u64, &mut buf).unwrap_err();
    assert!(
        is_invalid_data(&e) && e.to_string().contains("chunk 3") && e.to_string().contains(&off.to_string()),
        "{e}"
    );
    assert!(env.upper.read_at(&mut buf, 3 * cs as u64 + 100).is_err());
    for c in [0usize, 2, 4, 7] {
        env.upper.read_exact_at(&mut buf, (c * cs) as u64).unwrap();
        assert_bytes!(buf, b[c * cs..(c + 1) * cs], "chunk {c}");
    }
    drop(env);
    // Garbage with a matching checksum: the decompressor reports it.
    let mut f = host_bytes(&path);
    let junk = gen_data(99, stored as usize, 0);
    f[off as usize..off as usize + stored as usize].copy_from_slice(&junk);
    let crc = crc32fast::hash(&junk);
    f[entry_at + 24..entry_at + 28].copy_from_slice(&crc.to_le_bytes());
    fix_crcs(&mut f, &sb);
    std::fs::write(&path, &f).unwrap();
    let env = open_env(&path, opts(cs)).unwrap();
    let e = env.pager.get_pages(3 * cs as u64, &mut buf).unwrap_err();
    assert!(is_invalid_data(&e) && e.to_string().contains("chunk 3"), "{e}");
    env.upper.read_exact_at(&mut buf, 4 * cs as u64).unwrap();
}

// ---------------------------------------------------------------- property tests

#[derive(Debug, Clone)]
enum Op {
    Write {
        off: usize,
        len: usize,
        seed: u64,
        kind: u8,
    },
    SetLen(usize),
    /// Punch a hole through the cache (whole chunks leave the index), then check the seeks.
    Punch {
        off: usize,
        len: usize,
    },
    Sync,
    /// Drop every handle and the cache (no explicit sync), reopen.
    Reopen,
    /// Copy the host file now (as a crash would leave it), open the copy: the last sync.
    Crash {
        lower_sync: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..400_000, 1usize..150_000, any::<u64>(), 0u8..3).prop_map(|(off, len, seed, kind)| Op::Write { off, len, seed, kind }),
        2 => (0usize..500_000).prop_map(Op::SetLen),
        2 => (0usize..400_000, 1usize..200_000).prop_map(|(off, len)| Op::Punch { off, len }),
        2 => Just(Op::Sync),
        1 => Just(Op::Reopen),
        2 => any::<bool>().prop_map(|lower_sync| Op::Crash { lower_sync }),
    ]
}

fn small_cache() -> Cache {
    // Fast write-behind so that put_pages runs in the background between syncs.
    Cache::builder()
        .budget(32 << 20)
        .writeback(std::time::Duration::from_millis(5), std::time::Duration::from_millis(1))
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn model_check(ops in prop::collection::vec(op(), 1..14), shift in 12u32..17) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.z");
        let o = opts(1 << shift);
        let mut env = open_env_in(small_cache(), &path, o).unwrap();
        let mut model: Vec<u8> = Vec::new();
        let mut synced: Vec<u8> = Vec::new();
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Write { off, len, seed, kind } => {
                    let d = gen_data(seed, len, kind);
                    env.upper.write_at(&d, off as u64).unwrap();
                    model_write(&mut model, off, &d);
                }
                Op::SetLen(n) => {
                    env.upper.set_len(n as u64).unwrap();
                    model.resize(n, 0);
                }
                Op::Punch { off, len } => {
                    env.upper.punch_hole(off as u64..(off + len) as u64).unwrap();
                    let end = (off + len).min(model.len());
                    if off < end {
                        model[off..end].fill(0);
                    }
                    let n = model.len();
                    match env.upper.seek_data(off as u64).unwrap() {
                        None => prop_assert!(off >= n || model[off..].iter().all(|&b| b == 0), "no data after {}", off),
                        Some(d) => prop_assert!(d as usize >= off && (d as usize) < n
                            && model[off..d as usize].iter().all(|&b| b == 0), "seek_data({}) = {} skipped data", off, d),
                    }
                    match env.upper.seek_hole(off as u64).unwrap() {
                        None => prop_assert!(off >= n),
                        Some(h) => prop_assert!(h as usize >= off && (h as usize == n || model[h as usize] == 0),
                            "seek_hole({}) = {}", off, h),
                    }
                }
                Op::Sync => {
                    env.upper.sync().unwrap();
                    synced = model.clone();
                }
                Op::Reopen => {
                    // Closing commits (the pager commits when the cache drops it).
                    let p = env.path.clone();
                    drop(env);
                    env = open_env_in(small_cache(), &p, o).unwrap();
                    synced = model.clone();
                }
                Op::Crash { lower_sync } => {
                    if lower_sync {
                        env.lower.sync().unwrap();
                    }
                    let crash = dir.path().join(format!("crash{i}.z"));
                    std::fs::copy(&path, &crash).unwrap();
                    let c = open_env(&crash, o).unwrap();
                    let d = diff(&c.read_all(), &synced);
                    prop_assert!(d.is_none(), "crash image at op {}: {:?}", i, d);
                }
            }
            prop_assert_eq!(env.upper.len().unwrap() as usize, model.len());
        }
        let d = diff(&env.read_all(), &model);
        prop_assert!(d.is_none(), "before the final sync: {:?}", d);
        env.upper.sync().unwrap();
        let st = env.pager.stored_stats();
        let env = env.reopen(o);
        let d = diff(&env.read_all(), &model);
        prop_assert!(d.is_none(), "after reopen: {:?} {:?} {:?}", d, st, env.pager.stored_stats());
        let _ = &env.cache;
    }
}

/// Open `bytes` as a lower file (in memory) and read what it claims to hold. Must not panic.
fn poke(bytes: &[u8]) {
    let cache = new_cache();
    let lower = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    lower.write_at(bytes, 0).unwrap();
    let _ = CompressPager::logical_len(&lower);
    let Ok(p) = CompressPager::open(lower, CompressOptions::default()) else { return };
    let len = p.len().unwrap();
    let cs = p.stored_stats().chunk_size as u64;
    let mut buf = vec![0u8; cs as usize];
    for off in (0..len.min(1 << 20)).step_by(cs as usize).chain([len.saturating_sub(1) / cs * cs]) {
        let _ = p.get_pages(off, &mut buf);
    }
    // Writes on top of a garbage-but-valid-looking file must not panic either.
    let _ = p.put_pages(0, &buf[..4096]);
    let _ = p.set_len(len / 2);
    let _ = p.sync();
}

fn valid_image() -> Vec<u8> {
    let cache = new_cache();
    let lower = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    let p = Arc::new(CompressPager::open(lower.try_clone().unwrap(), opts(4096)).unwrap());
    let f = cache.open(p, Access::ReadWrite).unwrap();
    f.write_at(&gen_data(1, 20_000, 1), 0).unwrap();
    f.write_at(&gen_data(2, 9_000, 0), 30_000).unwrap();
    f.sync().unwrap();
    let mut v = vec![0u8; lower.len().unwrap() as usize];
    lower.read_exact_at(&mut v, 0).unwrap();
    teardown(&cache);
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn fuzz_random_lower(bytes in prop::collection::vec(any::<u8>(), 0..12_000)) {
        poke(&bytes);
    }

    #[test]
    fn fuzz_mutated_lower(muts in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6), fix in any::<bool>(), cut in any::<prop::sample::Index>(), truncate in any::<bool>()) {
        let mut f = valid_image();
        let sb = newest_sb(&f);
        let idx = sb.index_off as usize..(sb.index_off + sb.index_len) as usize;
        for (i, v) in muts {
            // Half of the mutations aimed at the header and the index, where they matter most.
            let at = match v % 3 {
                0 => i.index(68) + sb.slot * 4096,
                1 => idx.start + i.index(idx.len()),
                _ => i.index(f.len()),
            };
            f[at] = v;
        }
        if fix {
            fix_crcs(&mut f, &sb);
        }
        if truncate {
            f.truncate(cut.index(f.len()));
        }
        poke(&f);
    }
}

/// Rough numbers: `cargo test --release -p ubc-stack --test compress -- --ignored --nocapture`.
#[test]
#[ignore]
fn measure_throughput_and_ratio() {
    let dir = tempfile::tempdir().unwrap();
    for (name, kind) in [("text", 1u8), ("random", 0)] {
        let path = dir.path().join(format!("{name}.z"));
        let env = open_env(&path, CompressOptions::default()).unwrap();
        let total = 128usize << 20;
        let block = gen_data(42, 8 << 20, kind);
        let t = std::time::Instant::now();
        for i in 0..total / block.len() {
            env.upper.write_at(&block, (i * block.len()) as u64).unwrap();
        }
        env.upper.sync().unwrap();
        let w = t.elapsed();
        let st = env.pager.stored_stats();
        let env = env.reopen(CompressOptions::default());
        let t = std::time::Instant::now();
        let mut buf = vec![0u8; 1 << 20];
        let n = buf.len();
        for i in 0..total / n {
            env.upper.read_exact_at(&mut buf, (i * n) as u64).unwrap();
        }
        let r = t.elapsed();
        let mb = (total >> 20) as f64;
        eprintln!(
            "{name}: write+sync {:.0} MiB/s, cold read {:.0} MiB/s, stored {} of {} bytes (ratio {:.2}), raw chunks {}",
            mb / w.as_secs_f64(),
            mb / r.as_secs_f64(),
            st.stored_bytes,
            st.logical_len,
            st.logical_len as f64 / st.stored_bytes.max(1) as f64,
            st.raw_chunks
        );
    }
}

//! The `s3:` bottom layer against a real S3 server (issue 21): `./scripts/test` starts
//! `s3s-fs` (an S3 server from crates.io, on a file-system root) and sets
//! `UBC_TEST_S3_ENDPOINT`, `UBC_TEST_S3_BUCKET` and the standard `AWS_*` credentials. Without
//! them each test says it skipped, unless `UBC_TEST_S3_REQUIRED=1` (the test script's runs),
//! where that is a failure.
//!
//! What is shown: files and names survive a new stack over the same prefix (a restart),
//! with layers above; a random 4 KiB write uploads its bytes, not its chunk, and a cold
//! random read fetches its bytes, while a sequential one streams whole chunks; what was synced
//! is there after a "crash" (the process's layer dropped without a commit); removed files'
//! objects are deleted; a damaged tree object is refused, not guessed.

use rand::{RngExt, SeedableRng, rngs::StdRng};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use ubc_stack::layer::s3::{S3, S3Options};
use ubc_stack::{OpenOptions, Stack};

mod common;
use common::servers::{fresh_prefix, nonzero_data as data, s3_server as server, same};

fn spec(endpoint: &str, bucket: &str, prefix: &str) -> String {
    format!("s3:{bucket}/{prefix}?endpoint={endpoint}&chunk=64K")
}

fn cache(budget: u64) -> ubc::Cache {
    ubc::Cache::builder().budget(budget).build().unwrap()
}

/// A stack over an s3 layer this test keeps a handle on (for its statistics), 64 KiB chunks.
fn own_layer(endpoint: &str, bucket: &str, test: &str) -> (S3Options, Arc<S3>, Stack) {
    let o = S3Options::parse(&format!("{bucket}/{}?endpoint={endpoint}&chunk=64K", fresh_prefix(test))).unwrap();
    let (layer, s) = open_layer(&o, 1 << 20);
    (o, layer, s)
}

/// The s3 layer `o` opened, and a stack of it alone over a cache of `budget` bytes.
fn open_layer(o: &S3Options, budget: u64) -> (Arc<S3>, Stack) {
    let layer = Arc::new(S3::open(o).unwrap());
    let l2 = layer.clone();
    let s = Stack::builder(cache(budget)).push(move |_| Ok(l2 as Arc<dyn ubc_stack::Layer>)).unwrap().build().unwrap();
    (layer, s)
}

/// Write `d` at `off` through `f` and into `model` (growing it as the file grows).
fn write_both(f: &ubc_stack::File, model: &mut Vec<u8>, off: u64, d: &[u8]) {
    f.write_at(d, off).unwrap();
    let end = off as usize + d.len();
    if model.len() < end {
        model.resize(end, 0);
    }
    model[off as usize..end].copy_from_slice(d);
}

fn write_file(s: &Stack, path: &str, bytes: &[u8]) {
    let f = s.top().open_with(path, OpenOptions::new().write(true).create(true).truncate(true)).unwrap();
    f.write_at(bytes, 0).unwrap();
    f.sync().unwrap();
}

fn read_file(s: &Stack, path: &str) -> Vec<u8> {
    let f = s.top().open_with(path, OpenOptions::new()).unwrap();
    let mut v = vec![0u8; f.len().unwrap() as usize];
    f.read_exact_at(&mut v, 0).unwrap();
    v
}

#[test]
fn files_and_names_survive_a_restart_with_layers_above() {
    let Some((e, b)) = server("files_and_names_survive_a_restart") else { return };
    for above in ["", " | zstd", " | aead:keyfile=KEY | zstd"] {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "11".repeat(32)).unwrap();
        let p = fresh_prefix("restart");
        let sp = format!("{}{}", spec(&e, &b, &p), above.replace("KEY", key.to_str().unwrap()));
        let files: Vec<(String, Vec<u8>)> = [0usize, 1, 4095, 65536, 65537, 300_000, 1 << 20]
            .iter()
            .enumerate()
            .map(|(i, &n)| (format!("d/f{i}"), data(i as u64, n)))
            .collect();
        {
            let s = Stack::open(&sp, cache(256 << 10)).unwrap();
            s.top().mkdir("d").unwrap();
            s.top().mkdir("d/sub").unwrap();
            for (p, d) in &files {
                write_file(&s, p, d);
            }
            s.top().rename("d/f0", "d/sub/moved").unwrap();
            s.sync_all().unwrap();
        }
        let s = Stack::open(&sp, cache(256 << 10)).unwrap();
        for (p, d) in &files[1..] {
            same(&read_file(&s, p), d, &format!("{above}: {p} after a restart"));
        }
        same(&read_file(&s, "d/sub/moved"), &files[0].1, "moved");
        let mut names: Vec<String> = s.top().readdir("d").unwrap().into_iter().map(|d| d.name).collect();
        names.sort();
        assert_eq!(names, ["f1", "f2", "f3", "f4", "f5", "f6", "sub"], "{above}");
    }
}

/// A random 4 KiB write into a stored file uploads those 4 KiB as a patch of its chunk —
/// not the chunk, let alone the file — and reads nothing first (the old chunk is not
/// fetched to be rewritten); a cold reader lays the patches over the chunks.
#[test]
fn a_random_4k_write_uploads_its_bytes_and_fetches_nothing() {
    let Some((e, b)) = server("a_random_4k_write_uploads_its_bytes") else { return };
    let (o, layer, s) = own_layer(&e, &b, "rand");
    let len = 8 << 20;
    let mut model = data(1, len);
    write_file(&s, "big", &model);
    drop(s);
    drop(layer);
    // Cold: a new layer, nothing fetched ahead.
    let (layer, s) = open_layer(&o, 1 << 20);
    let f = s.top().open_with("big", OpenOptions::new().write(true)).unwrap();
    let before = layer.stats();
    let mut r = StdRng::seed_from_u64(2);
    for _ in 0..20 {
        let off = r.random_range(0..(len - 4096) as u64) & !4095;
        let d = data(off, 4096);
        f.write_at(&d, off).unwrap();
        model[off as usize..off as usize + 4096].copy_from_slice(&d);
    }
    f.sync().unwrap();
    let after = layer.stats();
    let uploaded = after.put_bytes - before.put_bytes;
    let tree = 4096; // the tree object, a few hundred bytes here
    assert!(uploaded <= 20 * 4096 + tree, "20 random 4 KiB writes uploaded {uploaded} bytes");
    assert_eq!(after.gets, before.gets, "a write of whole pages fetched the chunk it went into");
    drop(f);
    drop(s);
    drop(layer);
    let s = Stack::open(&spec(&e, &b, &o.prefix), cache(1 << 20)).unwrap();
    same(&read_file(&s, "big"), &model, "after a restart");
}

/// A cold random read fetches the 64 KiB block around what it asked for — that range of the
/// chunk's base and of the patches laid over it — not the chunk (1 MiB here), and reads what
/// a model says; a read from the file's start still gets whole chunks, fetched ahead of the
/// reader.
#[test]
fn a_cold_random_read_fetches_its_range_not_its_chunk() {
    let Some((e, b)) = server("a_cold_random_read_fetches_its_range") else { return };
    let o = S3Options::parse(&format!("{b}/{}?endpoint={e}&chunk=1M", fresh_prefix("randread"))).unwrap();
    let len = 32usize << 20;
    let mut model = data(3, len);
    {
        let (_l, s) = open_layer(&o, 16 << 20);
        write_file(&s, "big", &model);
    }
    // Patches over the bases: small writes (across chunk edges too) in two syncs, and a
    // growth past the last base.
    {
        let (_l, s) = open_layer(&o, 16 << 20);
        let f = s.top().open_with("big", OpenOptions::new().write(true)).unwrap();
        let mut r = StdRng::seed_from_u64(5);
        for i in 0..60u64 {
            let off = r.random_range(0..(len - 10_000) as u64);
            write_both(&f, &mut model, off, &data(100 + i, r.random_range(1..9_000)));
            if i % 30 == 29 {
                f.sync().unwrap();
            }
        }
        write_both(&f, &mut model, len as u64 - 100, &data(7, 3000));
        f.sync().unwrap();
    }
    let (layer, s) = open_layer(&o, 16 << 20);
    let f = s.top().open_with("big", OpenOptions::new()).unwrap();
    assert_eq!(f.len().unwrap(), model.len() as u64);
    let before = layer.stats();
    let mut r = StdRng::seed_from_u64(6);
    let reads = 32u64;
    let mut buf = vec![0u8; 4096];
    for i in 0..reads {
        // Never at the start and never where the last read ended: random, unaligned too.
        let off = r.random_range(4096..(model.len() - 4096) as u64);
        f.read_exact_at(&mut buf, off).unwrap();
        same(&buf, &model[off as usize..off as usize + 4096], &format!("random read {i} at {off}"));
    }
    let got = layer.stats();
    // Each read fills at most two blocks of 64 KiB, fetched from the base and from the few
    // patches that meet them (small: ~4 KiB each).
    let bound = reads * 3 * (64 << 10);
    let fetched = got.get_bytes - before.get_bytes;
    assert!(fetched <= bound, "{reads} random 4 KiB reads fetched {fetched} bytes (whole chunks?)");
    // From the start: the whole file, each object fetched once (whole chunks, not a GET per fill).
    let mut all = vec![0u8; model.len()];
    let mut off = 0;
    while off < all.len() {
        let n = f.read_at(&mut all[off..(off + (128 << 10)).min(model.len())], off as u64).unwrap();
        assert!(n > 0);
        off += n;
    }
    same(&all, &model, "read from the start");
    let objects = 33 * 4; // 33 chunks, each a base and at most three patches
    let gets = layer.stats().gets - got.gets;
    assert!(gets <= objects, "a sequential read of {} chunks made {gets} GETs", model.len().div_ceil(1 << 20));
    eprintln!("random: {fetched} bytes in {} GETs for {reads} reads; sequential: {gets} GETs", got.gets - before.gets);
}

/// Small writes, each few synced, become patches of their chunks; a chunk whose patches
/// grow too many or too large is stored whole again, and the objects it replaced go.
/// Checked against a model through a cache far smaller than the file (so reads fill from
/// the layer, laying staged extents and stored patches over the chunks), across restarts,
/// with truncations and growth in between.
#[test]
fn small_writes_become_patches_that_are_compacted_and_read_as_a_model_says() {
    let Some((e, b)) = server("small_writes_become_patches") else { return };
    let prefix = fresh_prefix("patches");
    let o = S3Options::parse(&format!("{b}/{prefix}?endpoint={e}&chunk=64K")).unwrap();
    let mut model = data(5, 300_000);
    let mut r = StdRng::seed_from_u64(11);
    let (mut syncs, mut uploaded) = (0u64, 0u64);
    for round in 0..4u64 {
        let (layer, s) = open_layer(&o, 128 << 10);
        if round == 0 {
            write_file(&s, "m", &model);
        }
        let f = s.top().open_with("m", OpenOptions::new().write(true)).unwrap();
        let before = layer.stats().put_bytes;
        for i in 0..120u64 {
            match r.random_range(0..40) {
                0 => {
                    let n = r.random_range(100_000..360_000usize);
                    f.set_len(n as u64).unwrap();
                    model.resize(n, 0);
                }
                _ => {
                    let off = r.random_range(0..model.len() as u64 + 5_000);
                    write_both(&f, &mut model, off, &data(round * 1000 + i, r.random_range(1..6_000)));
                }
            }
            if i % 3 == 2 {
                f.sync().unwrap();
                syncs += 1;
            }
            if i % 10 == 9 {
                let mut all = vec![0u8; model.len()];
                f.read_exact_at(&mut all, 0).unwrap();
                same(&all, &model, &format!("round {round}, step {i}"));
            }
        }
        f.sync().unwrap();
        uploaded += layer.stats().put_bytes - before;
        drop(f);
        s.sync_all().unwrap();
    }
    let s = Stack::open(&spec(&e, &b, &prefix), cache(128 << 10)).unwrap();
    same(&read_file(&s, "m"), &model, "after the last restart");
    // Each sync stores ~3 writes of < 6 KB: as whole 64 KiB chunks that would be ~192 KiB.
    assert!(uploaded < syncs * (64 << 10), "{uploaded} bytes uploaded for {syncs} syncs: patches not used");
    let root = std::path::PathBuf::from(std::env::var("UBC_TEST_S3_ROOT").unwrap_or_default());
    if root.as_os_str().is_empty() {
        return; // the server's files are not visible to this test
    }
    // A chunk is at most its base and 16 patches; nothing replaced is left.
    let mut per_chunk = std::collections::BTreeMap::<String, usize>::new();
    let mut stack = vec![root.join(&b).join(&prefix).join("ubc-s3/c")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else if !name.starts_with('.') {
                let idx = name.split('.').next().unwrap().to_string();
                *per_chunk.entry(idx).or_default() += 1;
            }
        }
    }
    let chunks = model.len().div_ceil(64 << 10);
    assert!(per_chunk.len() <= chunks, "objects of {} chunks for {chunks}: {per_chunk:?}", per_chunk.len());
    assert!(per_chunk.values().all(|&n| n <= 17), "a chunk of more than 17 objects: {per_chunk:?}");
    assert!(per_chunk.values().any(|&n| n > 1), "no chunk has a patch: {per_chunk:?}");
}

/// A database's pattern — a small write into the same chunk, a sync, again — costs one
/// PUT of the chunk (and the tree) per sync, and no GET: the next write stages the chunk
/// from the bytes just uploaded, not by fetching back what was just PUT (each such GET was
/// a round trip to the store inside the next `fsync`: 41 ms against 2.9 ms a sync through a
/// mount, on this test's server).
#[test]
fn a_write_after_a_sync_needs_no_get() {
    let Some((e, b)) = server("a_write_after_a_sync_needs_no_get") else { return };
    let (o, layer, s) = own_layer(&e, &b, "resync");
    let mut model = data(1, 200_000);
    write_file(&s, "db", &model);
    let f = s.top().open_with("db", OpenOptions::new().write(true)).unwrap();
    f.write_at(b"first", 10).unwrap();
    model[10..15].copy_from_slice(b"first");
    f.sync().unwrap();
    let before = layer.stats();
    for i in 0..10u64 {
        let d = data(100 + i, 4096);
        let off = 70_000 + i * 512;
        f.write_at(&d, off).unwrap();
        model[off as usize..off as usize + 4096].copy_from_slice(&d);
        f.sync().unwrap();
    }
    let after = layer.stats();
    assert_eq!(after.gets, before.gets, "a write after a sync fetched the chunk it had just uploaded");
    assert!(after.puts - before.puts <= 20, "one chunk and one tree per sync: {}", after.puts - before.puts);
    drop(f);
    drop(s);
    drop(layer);
    let s = Stack::open(&spec(&e, &b, &o.prefix), cache(1 << 20)).unwrap();
    same(&read_file(&s, "db"), &model, "after a restart");
}

#[test]
fn large_chunks_are_uploaded_in_parts() {
    let Some((e, b)) = server("large_chunks_are_uploaded_in_parts") else { return };
    let p = fresh_prefix("multipart");
    let sp = format!("s3:{b}/{p}?endpoint={e}&chunk=16M");
    let o = S3Options::parse(sp.trim_start_matches("s3:")).unwrap();
    let (layer, s) = open_layer(&o, 4 << 20);
    // Two whole chunks of 16 MiB and one of 9 MiB: three uploads in parts; a small file: one PUT.
    let model = data(9, (41 << 20) + 123);
    write_file(&s, "big", &model);
    write_file(&s, "small", b"tiny");
    let st = layer.stats();
    assert_eq!(st.multipart, 3, "{st:?}");
    drop((s, layer));
    let s = Stack::open(&sp, cache(4 << 20)).unwrap();
    same(&read_file(&s, "big"), &model, "after a restart");
    same(&read_file(&s, "small"), b"tiny", "the small file");
}

#[test]
fn what_was_synced_survives_a_crash_and_the_rest_may_not() {
    let Some((e, b)) = server("what_was_synced_survives_a_crash") else { return };
    let p = fresh_prefix("crash");
    let sp = spec(&e, &b, &p);
    let synced = data(5, 200_000);
    {
        let s = Stack::open(&sp, cache(1 << 20)).unwrap();
        write_file(&s, "kept", &synced);
        // Written and never synced, then the process "dies": its staged chunks and tree
        // are never uploaded (the stack and its layer are leaked, so nothing commits).
        let f = s.top().open_with("kept", OpenOptions::new().write(true)).unwrap();
        f.write_at(&[0xEE; 1000], 10).unwrap();
        let g = s.top().open_with("lost", OpenOptions::new().write(true).create(true)).unwrap();
        g.write_at(&[1; 100], 0).unwrap();
        std::mem::forget((f, g, s));
    }
    let s = Stack::open(&sp, cache(1 << 20)).unwrap();
    let got = read_file(&s, "kept");
    assert_eq!(got.len(), synced.len());
    same(&got, &synced, "the synced bytes, not the later unsynced write");
    assert!(s.top().getattr("lost").is_err(), "a file never committed is not there");
}

#[test]
fn removed_files_and_replaced_chunks_leave_no_objects() {
    let Some((e, b)) = server("removed_files_leave_no_objects") else { return };
    let (o, _layer, s) = own_layer(&e, &b, "gc");
    write_file(&s, "a", &data(1, 500_000));
    write_file(&s, "b", &data(2, 500_000));
    // Rewritten twice: each chunk's old versions go.
    write_file(&s, "a", &data(3, 500_000));
    write_file(&s, "a", &data(4, 300_000));
    s.top().remove("b").unwrap();
    s.sync_all().unwrap();
    let root = std::path::PathBuf::from(std::env::var("UBC_TEST_S3_ROOT").unwrap_or_default());
    if root.as_os_str().is_empty() {
        return; // the server's files are not visible to this test
    }
    let chunks = root.join(&b).join(&o.prefix).join("ubc-s3/c");
    let mut objs = Vec::new();
    let mut stack = vec![chunks];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else if !e.file_name().to_string_lossy().starts_with('.') {
                objs.push(e.path());
            }
        }
    }
    // "a": 300,000 bytes in 64 KiB chunks = 5 objects; "b": none.
    assert_eq!(objs.len(), 5, "objects left: {objs:?}");
    same(&read_file(&s, "a"), &data(4, 300_000), "a");
}

#[test]
fn truncation_and_holes_follow_a_model_across_restarts() {
    let Some((e, b)) = server("truncation_and_holes_follow_a_model") else { return };
    let sp = spec(&e, &b, &fresh_prefix("model"));
    let mut model: Vec<u8> = Vec::new();
    let mut r = StdRng::seed_from_u64(9);
    for round in 0..4 {
        let s = Stack::open(&sp, cache(512 << 10)).unwrap();
        let f = s.top().open_with("m", OpenOptions::new().write(true).create(true)).unwrap();
        assert_eq!(f.len().unwrap(), model.len() as u64, "round {round}: length after restart");
        for i in 0..60 {
            match r.random_range(0..10) {
                0..6 => {
                    let off = r.random_range(0..600_000u64);
                    write_both(&f, &mut model, off, &data(round * 1000 + i, r.random_range(1..100_000)));
                }
                6..8 => {
                    let n = r.random_range(0..700_000usize);
                    f.set_len(n as u64).unwrap();
                    model.resize(n, 0);
                }
                _ => f.sync().unwrap(),
            }
        }
        f.sync().unwrap();
        let mut all = vec![0u8; model.len()];
        f.read_exact_at(&mut all, 0).unwrap();
        same(&all, &model, &format!("round {round}"));
    }
    let s = Stack::open(&sp, cache(512 << 10)).unwrap();
    same(&read_file(&s, "m"), &model, "after the last restart");
}

#[test]
fn a_damaged_tree_is_an_error_not_a_guess() {
    let Some((e, b)) = server("a_damaged_tree_is_an_error") else { return };
    let root = std::env::var("UBC_TEST_S3_ROOT").unwrap_or_default();
    if root.is_empty() {
        return;
    }
    let p = fresh_prefix("damaged");
    let sp = spec(&e, &b, &p);
    {
        let s = Stack::open(&sp, cache(1 << 20)).unwrap();
        write_file(&s, "x", b"hello");
        s.sync_all().unwrap();
    }
    // The last committed tree: the highest sequence number under `tree/`.
    let trees = std::path::Path::new(&root).join(&b).join(&p).join("ubc-s3/tree");
    let mut names: Vec<_> = std::fs::read_dir(&trees)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect();
    names.sort();
    let tree = names.last().expect("a committed tree").clone();
    let mut t = std::fs::read(&tree).unwrap();
    let mid = t.len() / 2;
    t[mid] ^= 1;
    std::fs::write(&tree, &t).unwrap();
    let err = Stack::open(&sp, cache(1 << 20)).err().expect("a damaged tree opened");
    assert!(err.to_string().contains("checksum"), "{err}");
}

/// A server of this test's own (`s3s-fs` on a free port over `root`), killed on drop.
struct OwnServer {
    child: std::process::Child,
    port: u16,
}

impl OwnServer {
    fn start(bin: &str, root: &std::path::Path, port: Option<u16>) -> OwnServer {
        let port =
            port.unwrap_or_else(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port());
        let (ak, sk) = (std::env::var("AWS_ACCESS_KEY_ID").unwrap(), std::env::var("AWS_SECRET_ACCESS_KEY").unwrap());
        let child = std::process::Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--access-key", &ak, "--secret-key", &sk])
            .arg(root)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start s3s-fs");
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        OwnServer { child, port }
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_server_killed_and_restarted_loses_nothing_that_was_synced_and_sync_reports_the_outage() {
    let Some(_) = server("a_server_killed_and_restarted") else { return };
    let Ok(bin) = std::env::var("UBC_TEST_S3FS") else {
        assert!(std::env::var("UBC_TEST_S3_REQUIRED").as_deref() != Ok("1"), "UBC_TEST_S3FS (the server binary) unset");
        return;
    };
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("ubc-fault")).unwrap();
    let srv = OwnServer::start(&bin, root.path(), None);
    let port = srv.port;
    let sp = format!("s3:ubc-fault/p?endpoint=http://127.0.0.1:{port}&chunk=64K&retry_timeout=1");
    let first = data(11, 300_000);
    let second = data(12, 200_000);
    {
        let s = Stack::open(&sp, cache(1 << 20)).unwrap();
        write_file(&s, "f", &first);
        // The server dies with writes pending: the sync fails and says so.
        drop(srv);
        let f = s.top().open_with("f", OpenOptions::new().write(true)).unwrap();
        f.write_at(&second, 100_000).unwrap();
        let err = f.sync().expect_err("a sync with the server down succeeded");
        eprintln!("sync with the server down: {err}");
        // Back on the same port and data: the next sync stores everything.
        let _srv = OwnServer::start(&bin, root.path(), Some(port));
        f.sync().unwrap();
        drop(f);
        s.sync_all().unwrap();
    }
    let _srv = OwnServer::start(&bin, root.path(), Some(port));
    let s = Stack::open(&sp, cache(1 << 20)).unwrap();
    let mut want = first.clone();
    want[100_000..300_000].copy_from_slice(&second);
    same(&read_file(&s, "f"), &want, "after the outage");
}

#[test]
fn chunks_fetched_ahead_never_show_bytes_written_since() {
    let Some((e, b)) = server("chunks_fetched_ahead_never_show_stale_bytes") else { return };
    let sp = spec(&e, &b, &fresh_prefix("ahead"));
    // A budget of 256 KiB for a 2 MiB file: every read goes to the pager, whose sequential
    // reads fetch up to 8 chunks ahead; writes between the reads replace chunks (staged,
    // then uploaded as new versions) that were fetched ahead already.
    let s = Stack::open(&sp, cache(256 << 10)).unwrap();
    let mut model = data(21, 2 << 20);
    write_file(&s, "f", &model);
    let f = s.top().open_with("f", OpenOptions::new().write(true)).unwrap();
    let mut r = StdRng::seed_from_u64(22);
    for round in 0..6u64 {
        let mut all = vec![0u8; model.len()];
        for (i, piece) in all.chunks_mut(64 << 10).enumerate() {
            f.read_exact_at(piece, (i as u64) << 16).unwrap();
            if i % 5 == 2 {
                // Change a chunk ahead of the reader (fetched ahead by now, likely).
                let at = (((i as u64 + 3) << 16) + r.random_range(0..60_000)).min(model.len() as u64 - 100);
                let d = data(round * 100 + i as u64, 100);
                f.write_at(&d, at).unwrap();
                model[at as usize..at as usize + 100].copy_from_slice(&d);
                if round % 2 == 1 {
                    f.sync().unwrap(); // uploaded: a new version of that chunk
                }
            }
        }
        // What this pass read is the model as it was when each piece was read; check the
        // whole file once more after the pass.
        let mut again = vec![0u8; model.len()];
        f.read_exact_at(&mut again, 0).unwrap();
        same(&again, &model, &format!("round {round}"));
    }
}

/// A TCP proxy whose requests can be slowed down (`delay_ms`) or held (`stall`; only
/// `DELETE`s: `stall_deletes`) at will.
struct Throttle {
    port: u16,
    delay_ms: Arc<AtomicU64>,
    stall: Arc<std::sync::atomic::AtomicBool>,
    stall_deletes: Arc<std::sync::atomic::AtomicBool>,
}

impl Throttle {
    fn start(upstream_port: u16) -> Throttle {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let stall = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stall_deletes = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (d, st, sd) = (delay_ms.clone(), stall.clone(), stall_deletes.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", upstream_port)) else { continue };
                let (mut c_in, mut s_out) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (d, st, sd) = (d.clone(), st.clone(), sd.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n) = c_in.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        // A read that starts a request starts with its method (requests on
                        // one connection follow each other: the client waits for answers).
                        // (object_store deletes with `DELETE` or a batch `POST /?delete`.)
                        let line = buf[..n].split(|&b| b == b'\n').next().unwrap_or_default();
                        let delete = line.starts_with(b"DELETE ")
                            || (line.starts_with(b"POST ") && line.windows(7).any(|w| w == b"?delete"));
                        while st.load(Relaxed) || (delete && sd.load(Relaxed)) {
                            std::thread::sleep(std::time::Duration::from_millis(10));
                        }
                        std::thread::sleep(std::time::Duration::from_millis(d.load(Relaxed)));
                        if s_out.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = s_out.shutdown(std::net::Shutdown::Write);
                });
                let (mut s_in, mut c_out) = (server, client);
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut s_in, &mut c_out);
                    let _ = c_out.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        Throttle { port, delay_ms, stall, stall_deletes }
    }
}

/// A server of the test's own over a fresh directory with bucket `bucket`, behind a
/// [`Throttle`]; `None` (the test skips) without the server binary, unless it is required.
fn own_server_behind_a_proxy(test: &str, bucket: &str) -> Option<(tempfile::TempDir, OwnServer, Throttle)> {
    server(test)?;
    let Ok(bin) = std::env::var("UBC_TEST_S3FS") else {
        assert!(std::env::var("UBC_TEST_S3_REQUIRED").as_deref() != Ok("1"), "UBC_TEST_S3FS (the server binary) unset");
        return None;
    };
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join(bucket)).unwrap();
    let srv = OwnServer::start(&bin, root.path(), None);
    let proxy = Throttle::start(srv.port);
    Some((root, srv, proxy))
}

#[test]
fn a_slow_or_stalled_server_delays_or_fails_a_sync_and_loses_nothing() {
    let Some((_root, srv, proxy)) = own_server_behind_a_proxy("a_slow_or_stalled_server", "ubc-slow") else { return };
    let via = format!("s3:ubc-slow/p?endpoint=http://127.0.0.1:{}&chunk=64K&timeout=1&retry_timeout=3", proxy.port);
    let s = Stack::open(&via, cache(1 << 20)).unwrap();
    let mut model = data(31, 400_000);
    write_file(&s, "f", &model);
    let f = s.top().open_with("f", OpenOptions::new().write(true)).unwrap();
    // Slow (300 ms per request, under the 1 s attempt timeout): the sync takes longer and
    // succeeds.
    proxy.delay_ms.store(300, Relaxed);
    let d = data(32, 70_000);
    f.write_at(&d, 50_000).unwrap();
    model[50_000..120_000].copy_from_slice(&d);
    let t = std::time::Instant::now();
    f.sync().unwrap();
    assert!(t.elapsed() >= std::time::Duration::from_millis(300), "the slow server was not in the path");
    // Stalled (no answer at all): every attempt times out; the sync fails once the retries
    // are spent, and says so.
    proxy.delay_ms.store(0, Relaxed);
    proxy.stall.store(true, Relaxed);
    let d = data(33, 100_000);
    f.write_at(&d, 250_000).unwrap();
    model[250_000..350_000].copy_from_slice(&d);
    let t = std::time::Instant::now();
    let err = f.sync().expect_err("a sync through a stalled server succeeded");
    eprintln!("sync through a stalled server, after {:?}: {err}", t.elapsed());
    assert!(t.elapsed() < std::time::Duration::from_secs(60), "the sync waited {:?}", t.elapsed());
    // The server answers again: the next sync stores everything.
    proxy.stall.store(false, Relaxed);
    f.sync().unwrap();
    drop(f);
    s.sync_all().unwrap();
    drop(s);
    let direct = format!("s3:ubc-slow/p?endpoint=http://127.0.0.1:{}&chunk=64K", srv.port);
    let s = Stack::open(&direct, cache(1 << 20)).unwrap();
    same(&read_file(&s, "f"), &model, "after the slow and stalled syncs");
}

/// Deleting what nothing names any more is garbage collection: a server that holds the
/// deletions must not hold a sync, or the layer's drop (a daemon's shutdown), for longer than
/// `SETTLE_WAIT` (5 s) — not for the requests' own timeouts (20 s an attempt, retried for
/// 60 s here). What is left is garbage: no file names it.
#[test]
fn deletions_a_server_holds_delay_a_sync_or_a_drop_only_briefly() {
    let Some((_root, srv, proxy)) = own_server_behind_a_proxy("deletions_a_server_holds", "ubc-held") else { return };
    let o = S3Options::parse(&format!(
        "ubc-held/p?endpoint=http://127.0.0.1:{}&chunk=64K&timeout=20&retry_timeout=60",
        proxy.port
    ))
    .unwrap();
    let (layer, s) = open_layer(&o, 4 << 20);
    for i in 0..20 {
        write_file(&s, &format!("f{i}"), &data(40 + i, 100_000));
    }
    write_file(&s, "kept", &data(60, 150_000));
    s.sync_all().unwrap();
    proxy.stall_deletes.store(true, Relaxed);
    for i in 0..20 {
        s.top().remove(&format!("f{i}")).unwrap();
    }
    drop(s); // the removed files' last handles (the cache's): their objects are to go
    let deleted = layer.stats().deletes;
    let t = std::time::Instant::now();
    layer.commit().unwrap();
    let sync = t.elapsed();
    // Whoever else held the layer (the stack's threads) lets go: the drop below is its last.
    let mut layer = Some(layer);
    let t = std::time::Instant::now();
    while Arc::strong_count(layer.as_ref().unwrap()) > 1 {
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "the layer is still held");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(layer.as_ref().unwrap().stats().deletes, deleted, "the deletions were not held");
    let t = std::time::Instant::now();
    drop(layer.take());
    let dropped = t.elapsed();
    eprintln!("sync {sync:?}, drop {dropped:?} with every deletion held");
    // At least the wait (the deletions were started and held), not much more.
    assert!(sync >= std::time::Duration::from_secs(4), "the sync did not wait for the deletions: {sync:?}");
    assert!(sync < std::time::Duration::from_secs(15), "a sync waited {sync:?} for deletions");
    assert!(dropped < std::time::Duration::from_secs(15), "the drop waited {dropped:?} for deletions");
    proxy.stall_deletes.store(false, Relaxed);
    let direct = format!("s3:ubc-held/p?endpoint=http://127.0.0.1:{}&chunk=64K", srv.port);
    let s = Stack::open(&direct, cache(4 << 20)).unwrap();
    assert!(s.top().getattr("f0").is_err(), "a removed file is back");
    same(&read_file(&s, "kept"), &data(60, 150_000), "the file kept");
}

#[test]
fn a_tree_put_delayed_past_newer_commits_is_never_read() {
    let Some((e, b)) = server("a_tree_put_delayed_past_newer_commits") else { return };
    let root = std::env::var("UBC_TEST_S3_ROOT").unwrap_or_default();
    if root.is_empty() {
        return;
    }
    let p = fresh_prefix("delayed");
    let sp = spec(&e, &b, &p);
    let trees = std::path::Path::new(&root).join(&b).join(&p).join("ubc-s3/tree");
    let listed = || {
        let mut v: Vec<std::path::PathBuf> = std::fs::read_dir(&trees)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
            .collect();
        v.sort();
        v
    };
    let s = Stack::open(&sp, cache(1 << 20)).unwrap();
    write_file(&s, "old", b"old");
    s.sync_all().unwrap();
    let first = std::fs::read(listed().last().unwrap()).unwrap();
    write_file(&s, "new", b"new");
    s.top().remove("old").unwrap();
    s.sync_all().unwrap();
    s.sync_all().unwrap();
    drop(s);
    // The first commit's PUT "arrives late": an old tree written again under its old number
    // (the lowest); a reopen must read the newest, and drop the straggler.
    let trees_now = listed();
    assert!(trees_now.len() <= 2, "older trees are deleted: {trees_now:?}");
    std::fs::write(trees.join(format!("{:016x}", 1)), &first).unwrap();
    let s = Stack::open(&sp, cache(1 << 20)).unwrap();
    same(&read_file(&s, "new"), b"new", "the newest tree's file");
    assert!(s.top().getattr("old").is_err(), "the straggler's name came back");
    drop(s);
    assert!(!trees.join(format!("{:016x}", 1)).exists(), "the straggler was not deleted");
}

#[test]
fn s3_specs_parse_or_say_why_not() {
    let o = S3Options::parse("bkt/a/b/?endpoint=http://h:9&region=eu&chunk=256K&retry_timeout=2.5&timeout=1").unwrap();
    assert_eq!((o.bucket.as_str(), o.prefix.as_str()), ("bkt", "a/b"));
    assert_eq!(o.endpoint.as_deref(), Some("http://h:9"));
    assert_eq!(o.region.as_deref(), Some("eu"));
    assert_eq!(o.chunk_size, 256 << 10);
    assert_eq!(o.retry_timeout, std::time::Duration::from_millis(2500));
    assert_eq!(o.timeout, std::time::Duration::from_secs(1));
    let d = S3Options::parse("bkt").unwrap();
    assert_eq!((d.prefix.as_str(), d.chunk_size), ("", 1 << 20));
    for bad in [
        "",
        "/",
        "b?chunk=3K",
        "b?chunk=32M",
        "b?chunk=32K",
        "b?nope=1",
        "b?endpoint",
        "b?timeout=0",
        "b?retry_timeout=-1",
        "b?timeout=nan",
    ] {
        let e = S3Options::parse(bad).expect_err(bad).to_string();
        assert!(e.starts_with("stack spec: s3"), "{bad}: {e}");
    }
    assert_eq!(ubc_stack::s3_layers("mem | s3:x?y=z| zstd |s3 : q"), ["x?y=z", "q"]);
    assert!(Stack::open("mem | s3:b", cache(1 << 20)).is_err(), "s3 above another layer");
}

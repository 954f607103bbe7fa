//! Coherence between machines (issue 21): several `s3:…?etcd=…` stacks over one bucket and
//! one etcd, each with its own cache — as separate machines are. `./scripts/test` starts a
//! real S3 server (s3s-fs) and a real etcd and sets `UBC_TEST_S3_ENDPOINT`,
//! `UBC_TEST_S3_BUCKET`, `UBC_TEST_ETCD` (and the `AWS_*` credentials); without them each
//! test says it skipped, unless `UBC_TEST_ETCD_REQUIRED=1`, where that is a failure.
//!
//! The guarantee under test (docs/guarantees.md, "Between machines"): a read that starts
//! after a write returned on another machine sees it — data, length and names — through
//! any layers above; a machine cut off from etcd stops using what it cached once its lease
//! runs out, and what it had not stored is refused at `sync`, never written over what
//! another machine stored since.
#![cfg(feature = "etcd")]

use rand::{RngExt, SeedableRng, rngs::StdRng};
use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};
use ubc_stack::{OpenOptions, Stack};

mod common;
use common::servers::{SharedEnv, fresh_prefix, nonzero_data as data, same};

fn cache() -> ubc::Cache {
    ubc::Cache::builder().budget(1 << 20).build().unwrap()
}

fn read_all(f: &ubc_stack::File) -> Vec<u8> {
    let mut v = vec![0u8; f.len().unwrap() as usize];
    f.read_exact_at(&mut v, 0).unwrap();
    v
}

/// For each layer tail of `tails` (`KEY`: an aead key the test makes in `dir`), the tail as
/// the spec names it and the shared store's spec under it, over a fresh prefix `name`.
fn shared_specs(env: &SharedEnv, dir: &std::path::Path, name: &str, tails: &[&str]) -> Vec<(String, String)> {
    let key = dir.join("key");
    std::fs::write(&key, "22".repeat(32)).unwrap();
    tails
        .iter()
        .map(|t| {
            let above = t.replace("KEY", key.to_str().unwrap());
            let spec = format!("{}{above}", env.spec(&fresh_prefix(name), &env.etcd, ""));
            (above, spec)
        })
        .collect()
}

fn rw() -> OpenOptions {
    OpenOptions::new().write(true).create(true)
}

#[test]
fn a_write_on_one_machine_is_read_on_another_without_a_sync() {
    let Some(env) = SharedEnv::get("a_write_on_one_machine_is_read_on_another") else { return };
    let dir = tempfile::tempdir().unwrap();
    for (above, sp) in shared_specs(&env, dir.path(), "rw", &["", " | zstd", " | aead:keyfile=KEY | zstd"]) {
        let a = Stack::open(&sp, cache()).unwrap();
        let b = Stack::open(&sp, cache()).unwrap();
        let fa = a.top().open_with("f", rw()).unwrap();
        let one = data(1, 150_000);
        fa.write_at(&one, 0).unwrap();
        // No sync: B's read takes A's write token away, which stores A's pages first.
        let fb = b.top().open_with("f", OpenOptions::new().write(true)).unwrap();
        same(&read_all(&fb), &one, &format!("{above}: B reads A's write"));
        // B overwrites the middle and extends; A (which cached the file) sees both.
        let two = data(2, 70_000);
        fb.write_at(&two, 100_000).unwrap();
        let mut want = one.clone();
        want.resize(170_000, 0);
        want[100_000..170_000].copy_from_slice(&two);
        assert_eq!(fa.len().unwrap(), 170_000, "{above}: A sees B's length");
        same(&read_all(&fa), &want, &format!("{above}: A reads B's write"));
        // Truncation travels too.
        fa.set_len(5_000).unwrap();
        assert_eq!(fb.len().unwrap(), 5_000, "{above}: B sees A's truncation");
        same(&read_all(&fb), &want[..5_000], &format!("{above}: B after the truncation"));
        // Names: a file made on A is there on B, a removal on B is seen on A.
        a.top().mkdir("d").unwrap();
        a.top().open_with("d/new", rw()).unwrap().write_at(b"fresh", 0).unwrap();
        let mut got = vec![0u8; 5];
        b.top().open("d/new").unwrap().read_exact_at(&mut got, 0).unwrap();
        assert_eq!(&got, b"fresh", "{above}: a new file");
        b.top().remove("d/new").unwrap();
        assert!(a.top().readdir("d").unwrap().is_empty(), "{above}: the removal seen on A");
        // A name moved to another file on B: A's `stat` and open find the new file, not
        // the one A has cached under that name.
        drop(fa);
        b.top().rename("f", "g").unwrap();
        b.top().open_with("f", rw()).unwrap().write_at(b"short", 0).unwrap();
        assert_eq!(a.top().getattr("f").unwrap().size, 5, "{above}: stat of a name moved on B");
        assert_eq!(a.top().getattr("g").unwrap().size, 5_000, "{above}: stat of the moved file");
        same(&read_all(&a.top().open("f").unwrap()), b"short", &format!("{above}: the new file under the old name"));
        let fa = a.top().open("g").unwrap();
        drop((fa, fb));
    }
}

#[test]
fn two_machines_follow_one_model_under_random_operations() {
    let Some(env) = SharedEnv::get("two_machines_follow_one_model") else { return };
    let dir = tempfile::tempdir().unwrap();
    for (k, (above, sp)) in
        shared_specs(&env, dir.path(), "model", &["", " | aead:keyfile=KEY | zstd"]).into_iter().enumerate()
    {
        let machines: Vec<Stack> = (0..3).map(|_| Stack::open(&sp, cache()).unwrap()).collect();
        let files: Vec<ubc_stack::File> = machines.iter().map(|m| m.top().open_with("m", rw()).unwrap()).collect();
        let mut model: Vec<u8> = Vec::new();
        let mut r = StdRng::seed_from_u64(7 + k as u64);
        for step in 0..150 {
            let which = r.random_range(0..files.len());
            let f = &files[which];
            let op = r.random_range(0..10);
            match op {
                0..=3 => {
                    let at = r.random_range(0..300_000u64);
                    let n = r.random_range(1..20_000usize);
                    let bytes = data(step, n);
                    f.write_at(&bytes, at).unwrap();
                    let end = at as usize + n;
                    if model.len() < end {
                        model.resize(end, 0);
                    }
                    model[at as usize..end].copy_from_slice(&bytes);
                }
                4 => {
                    let len = r.random_range(0..300_000usize);
                    f.set_len(len as u64).unwrap();
                    model.resize(len, 0);
                }
                5 => f.sync().unwrap(),
                _ => {
                    assert_eq!(f.len().unwrap() as usize, model.len(), "{above}: step {step}: length");
                    let at = r.random_range(0..=model.len());
                    let n = r.random_range(0..30_000usize).min(model.len() - at);
                    let mut got = vec![0u8; n];
                    f.read_exact_at(&mut got, at as u64).unwrap();
                    same(&got, &model[at..at + n], &format!("{above}: step {step}: read at {at}"));
                }
            }
        }
        for (i, f) in files.iter().enumerate() {
            same(&read_all(f), &model, &format!("{above}: machine {i} at the end"));
        }
        // And a fresh machine, after the others closed.
        drop(files);
        drop(machines);
        let fresh = Stack::open(&sp, cache()).unwrap();
        same(&read_all(&fresh.top().open("m").unwrap()), &model, &format!("{above}: a machine that came later"));
    }
}

#[test]
fn writers_on_two_machines_interleave_without_losing_a_record() {
    let Some(env) = SharedEnv::get("writers_on_two_machines_interleave") else { return };
    let sp = env.spec(&fresh_prefix("interleave"), &env.etcd, "");
    let machines: Vec<Arc<Stack>> = (0..2).map(|_| Arc::new(Stack::open(&sp, cache()).unwrap())).collect();
    // Machine 1 keeps no closed file cached: its file is dropped at each last close and made
    // again at the next open, while the token may still be held (a new holder takes it over).
    machines[1].set_idle_files(0);
    machines[0].top().open_with("log", rw()).unwrap();
    const REC: usize = 512;
    const PER: usize = 60;
    // Each of 2 machines × 2 threads writes its own records (slot = thread × PER + i),
    // reading back a random earlier record of any writer now and then, and closing and
    // opening the file again every 10 records.
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let m = machines[t % 2].clone();
            std::thread::spawn(move || {
                let mut f = m.top().open_with("log", OpenOptions::new().write(true)).unwrap();
                let mut r = StdRng::seed_from_u64(t as u64);
                for i in 0..PER {
                    if i % 10 == 9 {
                        drop(f);
                        f = m.top().open_with("log", OpenOptions::new().write(true)).unwrap();
                    }
                    let slot = t * PER + i;
                    let rec = vec![(slot % 251) as u8 + 1; REC];
                    f.write_at(&rec, (slot * REC) as u64).unwrap();
                    if r.random_range(0..4) == 0 {
                        let mut got = vec![0u8; REC];
                        f.read_exact_at(&mut got, (slot * REC) as u64).unwrap();
                        assert_eq!(got, rec, "thread {t}: my own record {slot}");
                    }
                }
                f.sync().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for (k, m) in machines.iter().enumerate() {
        let got = read_all(&m.top().open("log").unwrap());
        assert_eq!(got.len(), 4 * PER * REC, "machine {k}: length");
        for slot in 0..4 * PER {
            assert!(
                got[slot * REC..(slot + 1) * REC].iter().all(|&b| b == (slot % 251) as u8 + 1),
                "machine {k}: record {slot} lost or torn"
            );
        }
    }
}

/// A TCP proxy to etcd that can be cut: while `cut`, nothing passes either way (a network
/// partition: silence, not a refused connection).
struct Partition {
    url: String,
    cut: Arc<AtomicBool>,
}

impl Partition {
    fn start(upstream: &str) -> Partition {
        let up = upstream.trim_start_matches("http://").to_string();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let cut = Arc::new(AtomicBool::new(false));
        let c = cut.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = std::net::TcpStream::connect(&up) else { continue };
                for (mut from, mut to) in [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                {
                    let c = c.clone();
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 64 << 10];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 {
                                break;
                            }
                            while c.load(Relaxed) {
                                std::thread::sleep(Duration::from_millis(10));
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        Partition { url, cut }
    }
}

#[test]
fn a_partitioned_machine_stops_serving_and_cannot_overwrite_what_others_stored() {
    let Some(env) = SharedEnv::get("a_partitioned_machine") else { return };
    let prefix = fresh_prefix("partition");
    let net = Partition::start(&env.etcd);
    // C reaches etcd through the proxy, with a 2 s lease; A directly.
    let c = Stack::open(&env.spec(&prefix, &net.url, "&lease=2"), cache()).unwrap();
    let a = Stack::open(&env.spec(&prefix, &env.etcd, ""), cache()).unwrap();
    let fc = c.top().open_with("f", rw()).unwrap();
    fc.write_at(&[b'c'; 10_000], 0).unwrap();
    fc.sync().unwrap();
    fc.write_at(&[b'C'; 100], 0).unwrap(); // not stored: C still holds the write token
    net.cut.store(true, Relaxed);
    let cut_at = Instant::now();
    // A's write waits for C's token: C cannot be asked, so until C's lease expires.
    let fa = a.top().open_with("f", OpenOptions::new().write(true)).unwrap();
    fa.write_at(&[b'a'; 100], 5_000).unwrap();
    let waited = cut_at.elapsed();
    eprintln!("A's write went through {waited:?} after C was cut off (C's lease: 2 s)");
    fa.sync().unwrap();
    assert!(
        waited >= Duration::from_millis(1_000),
        "A got the token {waited:?} after the cut: C's lease was not waited for"
    );
    assert!(waited < Duration::from_secs(15), "A waited {waited:?}: longer than the lease bounds");
    // C has stopped using what it held (three quarters of its lease after its last renewal):
    // its unstored write is refused at sync, with the network still cut.
    let err = fc.sync().expect_err("C's changes were lost with its lease: sync must say so");
    assert_eq!(err.errno(), libc::ESTALE, "{err}");
    net.cut.store(false, Relaxed);
    // Healed: C reads what A stored, and A's bytes and C's synced bytes are there — C's
    // unstored write never overwrote them.
    let mut want = vec![b'c'; 10_000];
    want[5_000..5_100].fill(b'a');
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = read_all(&c.top().open("f").unwrap());
        if got == want || Instant::now() > deadline {
            same(&got, &want, "C after the partition healed");
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    same(&read_all(&fa), &want, "A");
}

/// One machine in a process of its own (see `machines_in_separate_processes…`): opens
/// `UBC_DIST_CHILD` (a stack spec) with its own cache and serves commands from stdin, one
/// per line, answering each on stdout after `@@ `: `w OFFSET SEED LEN` (write `data(SEED,
/// LEN)`), `r OFFSET LEN` (the bytes, hex), `len`, `truncate LEN`, `sync`.
#[test]
fn child_machine() {
    let Ok(spec) = std::env::var("UBC_DIST_CHILD") else { return };
    let s = Stack::open(&spec, cache()).unwrap();
    let f = s.top().open_with("shared", rw()).unwrap();
    let stdin = std::io::stdin();
    let mut line = String::new();
    let mut out = std::io::stdout();
    while {
        line.clear();
        stdin.read_line(&mut line).unwrap() > 0
    } {
        let w: Vec<&str> = line.split_whitespace().collect();
        let n = |i: usize| w[i].parse::<u64>().unwrap();
        let answer = match w.first().copied() {
            Some("w") => {
                f.write_at(&data(n(2), n(3) as usize), n(1)).unwrap();
                "done".to_string()
            }
            Some("r") => {
                let mut b = vec![0u8; n(2) as usize];
                f.read_exact_at(&mut b, n(1)).unwrap();
                b.iter().map(|x| format!("{x:02x}")).collect()
            }
            Some("len") => f.len().unwrap().to_string(),
            Some("truncate") => {
                f.set_len(n(1)).unwrap();
                "done".to_string()
            }
            Some("sync") => {
                f.sync().unwrap();
                "done".to_string()
            }
            _ => break,
        };
        writeln!(out, "@@ {answer}").unwrap();
        out.flush().unwrap();
    }
}

struct Child {
    proc: std::process::Child,
    input: std::process::ChildStdin,
    output: std::io::BufReader<std::process::ChildStdout>,
}

impl Child {
    fn start(spec: &str) -> Child {
        let mut proc = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_machine", "--nocapture", "--test-threads=1"])
            .env("UBC_DIST_CHILD", spec)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let input = proc.stdin.take().unwrap();
        let output = std::io::BufReader::new(proc.stdout.take().unwrap());
        Child { proc, input, output }
    }

    /// Send one command; its answer, once the child has done it.
    fn ask(&mut self, cmd: &str) -> String {
        use std::io::BufRead;
        writeln!(self.input, "{cmd}").unwrap();
        self.input.flush().unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.output.read_line(&mut line).unwrap() > 0, "the child machine died at `{cmd}`");
            // (The first answer follows the test harness's "test child_machine ... ".)
            if let Some(i) = line.find("@@ ") {
                return line[i + 3..].trim_end().to_string();
            }
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = writeln!(self.input, "q");
        let _ = self.proc.wait();
    }
}

#[test]
fn machines_in_separate_processes_see_every_write_that_returned() {
    let Some(env) = SharedEnv::get("machines_in_separate_processes") else { return };
    let sp = format!("{} | zstd", env.spec(&fresh_prefix("procs"), &env.etcd, ""));
    let mut kids: Vec<Child> = (0..3).map(|_| Child::start(&sp)).collect();
    let mut model: Vec<u8> = Vec::new();
    let mut r = StdRng::seed_from_u64(21);
    for step in 0..120u64 {
        let k = r.random_range(0..kids.len());
        let op = r.random_range(0..8);
        match op {
            0..=2 => {
                let at = r.random_range(0..200_000u64);
                let n = r.random_range(1..5_000u64);
                assert_eq!(kids[k].ask(&format!("w {at} {step} {n}")), "done");
                let end = (at + n) as usize;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[at as usize..end].copy_from_slice(&data(step, n as usize));
            }
            3 => {
                let len = r.random_range(0..200_000u64);
                assert_eq!(kids[k].ask(&format!("truncate {len}")), "done");
                model.resize(len as usize, 0);
            }
            4 => assert_eq!(kids[k].ask("sync"), "done"),
            _ => {
                let len: usize = kids[k].ask("len").parse().unwrap();
                assert_eq!(len, model.len(), "step {step}: machine {k}'s length");
                let at = r.random_range(0..=len);
                let n = r.random_range(0..4_000usize).min(len - at);
                let got = kids[k].ask(&format!("r {at} {n}"));
                let want: String = model[at..at + n].iter().map(|x| format!("{x:02x}")).collect();
                assert!(got == want, "step {step}: machine {k} read stale bytes at {at}..{}", at + n);
            }
        }
    }
}

/// An s3 layer on `spec` (`s3:` stripped) that this test keeps a handle on (its
/// statistics), in a stack of its own.
fn own_machine(spec: &str) -> (Arc<ubc_stack::layer::s3::S3>, Stack) {
    use ubc_stack::layer::s3::{S3, S3Options};
    let o = S3Options::parse(spec.trim_start_matches("s3:")).unwrap();
    let layer = Arc::new(S3::open(&o).unwrap());
    let l2 = layer.clone();
    let s = Stack::builder(cache()).push(move |_| Ok(l2 as Arc<dyn ubc_stack::Layer>)).unwrap().build().unwrap();
    (layer, s)
}

/// etcd, reached directly by the test (as an operator's `etcdctl` would).
fn etcd_admin(url: &str) -> (tokio::runtime::Runtime, etcd_client::Client) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let c = rt.block_on(etcd_client::Client::connect([url.trim_start_matches("http://")], None)).unwrap();
    (rt, c)
}

/// The token keys (`/ubc/<bucket>/<prefix>/ubc-s3/t/<ino>/<machine>`, docs/formats.md) of
/// one file system, with their leases.
fn token_keys(rt: &tokio::runtime::Runtime, c: &etcd_client::Client, bucket: &str, prefix: &str) -> Vec<(String, i64)> {
    let mut c = c.clone();
    let under = format!("/ubc/{bucket}/{prefix}");
    let r = rt.block_on(c.get(under.as_str(), Some(etcd_client::GetOptions::new().with_prefix()))).unwrap();
    r.kvs()
        .iter()
        .map(|kv| (kv.key_str().unwrap().to_string(), kv.lease()))
        .filter(|(k, _)| k[under.len()..].starts_with("/ubc-s3/t/"))
        .collect()
}

/// The fence on its own: a machine whose write token vanished from etcd without its
/// knowing (an operator deleted the key; the machine's lease is alive, so nothing tells it)
/// cannot rewrite the file's record over what the next holder stored — its commit is
/// refused with `ESTALE` (a whole chunk written: nothing to fetch, the record's fence says
/// no), and so is a write-back that needs a chunk the next holder replaced (a partial chunk
/// written: the old version is gone) — and the token is lost here too, so the machine reads
/// the other's bytes next. And a machine whose lease etcd says is gone (revoked) stops
/// serving at its next renewal, not three quarters of a lease later.
#[test]
fn a_commit_without_the_write_token_in_etcd_is_fenced_off() {
    let Some(env) = SharedEnv::get("a_commit_without_the_write_token") else { return };
    let (rt, admin) = etcd_admin(&env.etcd);
    const CHUNK: usize = 65_536; // the chunk size of `SharedEnv::spec`
    for (case, (at, len)) in [("a whole chunk", (0, CHUNK)), ("part of a chunk", (100, 1_000))] {
        let prefix = fresh_prefix("fence");
        // A long lease for A: its first renewal is 12 s away, so only the fence can stop it.
        let (la, a) = own_machine(&env.spec(&prefix, &env.etcd, "&lease=60"));
        let (_, b) = own_machine(&env.spec(&prefix, &env.etcd, ""));
        let fa = a.top().open_with("f", rw()).unwrap();
        fa.write_at(&[b'a'; 50_000], 0).unwrap();
        fa.sync().unwrap();
        fa.write_at(&vec![b'A'; len], at).unwrap(); // A holds the write token, not stored
        let keys = token_keys(&rt, &admin, &env.bucket, &prefix);
        assert_eq!(keys.len(), 1, "{case}: A's write token is the only key: {keys:?}");
        rt.block_on(admin.clone().delete(keys[0].0.as_str(), None)).unwrap();
        // B takes the token at once (nobody holds it in etcd) and stores.
        let fb = b.top().open_with("f", OpenOptions::new().write(true)).unwrap();
        fb.write_at(&[b'b'; 1_000], 10_000).unwrap();
        fb.sync().unwrap();
        drop(fb);
        let err = fa.sync().expect_err("A's commit without its token in etcd must be refused");
        assert_eq!(err.errno(), libc::ESTALE, "{case}: {err}");
        let st = la.dist_stats().unwrap();
        assert_eq!((st.fenced, st.leases_lost), (1, 0), "{case}: refused by the fence, not by a lease loss: {st:?}");
        // What is stored is A's synced bytes with B's write: A's unstored write never
        // landed, and A (its token lost) reads that too.
        let mut want = vec![b'a'; 50_000];
        want[10_000..11_000].fill(b'b');
        let (_, c) = own_machine(&env.spec(&prefix, &env.etcd, ""));
        same(&read_all(&c.top().open("f").unwrap()), &want, &format!("{case}: a third machine"));
        // The loss runs on a thread of its own once the failed sync's pin is gone: A's
        // unstored bytes must never come back, and B's must show within moments.
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let got = read_all(&fa);
            if got == want || Instant::now() > deadline {
                same(&got, &want, &format!("{case}: A after its token was lost"));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // And they never reach the store later (a dirty page kept and written back under
        // the next token would): written and synced again under a new token, the file is
        // B's bytes plus only this.
        fa.write_at(b"again", 20_000).unwrap();
        fa.sync().unwrap();
        want[20_000..20_005].copy_from_slice(b"again");
        let (_, e) = own_machine(&env.spec(&prefix, &env.etcd, ""));
        same(&read_all(&e.top().open("f").unwrap()), &want, &format!("{case}: after A wrote again"));
    }

    // A lease revoked in etcd: the machine hears it at its next renewal (a fifth of the
    // lease: 2 s here) and drops what it held, well before 3/4 of the lease (7.5 s).
    let prefix = fresh_prefix("revoked");
    let (ld, d) = own_machine(&env.spec(&prefix, &env.etcd, "&lease=10"));
    let fd = d.top().open_with("g", rw()).unwrap();
    fd.write_at(b"unstored", 0).unwrap();
    let keys = token_keys(&rt, &admin, &env.bucket, &prefix);
    assert_eq!(keys.len(), 1, "D's write token is the only key: {keys:?}");
    rt.block_on(admin.clone().lease_revoke(keys[0].1)).unwrap();
    let revoked_at = Instant::now();
    while ld.dist_stats().unwrap().leases_lost == 0 {
        assert!(revoked_at.elapsed() < Duration::from_secs(5), "D did not notice its revoked lease in 5 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("D noticed its revoked lease after {:?} (lease 10 s)", revoked_at.elapsed());
    let err = fd.sync().expect_err("D's unstored write went with its lease");
    assert_eq!(err.errno(), libc::ESTALE, "{err}");
}

/// The bucket, reached directly by the test (as another S3 client would).
fn bucket_client(env: &SharedEnv) -> (tokio::runtime::Runtime, Arc<dyn object_store::ObjectStore>) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let s = object_store::aws::AmazonS3Builder::from_env()
        .with_bucket_name(&env.bucket)
        .with_region("us-east-1")
        .with_endpoint(&env.s3)
        .with_allow_http(true)
        .with_virtual_hosted_style_request(false)
        .build()
        .unwrap();
    (rt, Arc::new(s))
}

/// The chunk objects of one file system (`<prefix>/ubc-s3/c/…`, docs/formats.md).
fn chunk_objects(rt: &tokio::runtime::Runtime, s: &Arc<dyn object_store::ObjectStore>, prefix: &str) -> Vec<String> {
    use futures::StreamExt;
    let p = object_store::path::Path::from(format!("{prefix}/ubc-s3/c"));
    let mut v: Vec<String> = rt.block_on(s.list(Some(&p)).map(|m| m.unwrap().location.to_string()).collect::<Vec<_>>());
    v.sort();
    v
}

/// A machine that crashed between an upload and its commit leaves chunk objects no record
/// names; the sweep of a shared file system deletes them — but never those of a file some
/// machine holds a token of (the write token's holder may not have committed its uploads
/// yet), nor any chunk a record names.
#[test]
fn a_sweep_deletes_what_crashed_machines_left_and_nothing_a_live_one_may_need() {
    let Some(env) = SharedEnv::get("a_sweep_deletes_what_crashed_machines_left") else { return };
    let prefix = fresh_prefix("sweep");
    let (rt, bucket) = bucket_client(&env);
    let (la, a) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let f = a.top().open_with("f", rw()).unwrap();
    let want = data(7, 200_000);
    f.write_at(&want, 0).unwrap();
    f.sync().unwrap(); // A keeps the write token of f
    let ino = a.top().getattr("f").unwrap().ino;
    let stored = chunk_objects(&rt, &bucket, &prefix);
    assert_eq!(stored.len(), 4, "200,000 bytes in 64 KiB chunks: {stored:?}");
    // Leftovers: an uncommitted version of f (A might have uploaded it: A holds the write
    // token), and versions of a file whose machine crashed (no record, no token).
    let of_f = format!("{prefix}/ubc-s3/c/{ino:016x}/{:016x}.{:016x}", 9, 0xdead);
    let crashed = format!("{prefix}/ubc-s3/c/{:016x}/{:016x}.{:016x}", 0x7777, 0, 1);
    for p in [&of_f, &crashed] {
        use object_store::ObjectStoreExt;
        rt.block_on(bucket.put(&object_store::path::Path::from(p.as_str()), b"left".to_vec().into())).unwrap();
    }
    // B's layer sweeps once in the background when it opens; the test's sweep runs too.
    // (Counts are not compared: which of the two deletes an object is a race.)
    let (lb, _b) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    lb.sweep().unwrap();
    let mut expect = stored.clone();
    expect.push(of_f.clone());
    expect.sort();
    assert_eq!(chunk_objects(&rt, &bucket, &prefix), expect, "only the crashed machine's object goes");
    // A gives the file up (closed, layer dropped): the uncommitted version is a leftover now.
    drop((f, a, la));
    lb.sweep().unwrap();
    assert_eq!(chunk_objects(&rt, &bucket, &prefix), stored, "A's leftover goes; every chunk a record names stays");
    let (_, c) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    same(&read_all(&c.top().open("f").unwrap()), &want, "the file after the sweeps");
}

/// Mappings between machines: a fault is served under the file's token (the read token,
/// or the write token for a shared writable mapping), so a mapping shows what another
/// machine wrote once the token came back — and a store through a shared writable mapping
/// reaches the other machine, before and after it gave the token up (a downgrade takes the
/// mapping's pages away, so the next store faults and takes the write token back).
#[test]
fn mappings_follow_the_token_between_machines() {
    let Some(env) = SharedEnv::get("mappings_follow_the_token") else { return };
    let dir = tempfile::tempdir().unwrap();
    for (above, sp) in shared_specs(&env, dir.path(), "maps", &["", " | aead:keyfile=KEY | zstd"]) {
        let a = Stack::open(&sp, cache()).unwrap();
        let b = Stack::open(&sp, cache()).unwrap();
        let n = 200_000usize;
        let fa = a.top().open_with("f", rw()).unwrap();
        fa.write_at(&vec![b'a'; n], 0).unwrap();
        fa.sync().unwrap();
        // A read-only mapping on A; B writes (taking A's token: A's pages dropped).
        let ma = fa.map(0..n as u64, ubc::Access::ReadOnly, ubc::Sharing::Shared).unwrap();
        assert_eq!(ma[100], b'a');
        let fb = b.top().open_with("f", OpenOptions::new().write(true)).unwrap();
        fb.write_at(&[b'b'; 1_000], 0).unwrap();
        fb.write_at(&[b'B'; 1_000], 150_000).unwrap();
        // No sync: A's fault takes the read token, which makes B store first.
        assert_eq!((ma[100], ma[150_500], ma[199_999]), (b'b', b'B', b'a'), "{above}: A's mapping after B's writes");
        drop(ma);
        // A shared writable mapping on A: its stores reach B, and after B read them (A kept
        // only the read token) the next store takes the write token back.
        let mut mw = fa.map(0..n as u64, ubc::Access::ReadWrite, ubc::Sharing::Shared).unwrap();
        mw[10] = b'1';
        let mut got = [0u8; 1];
        fb.read_exact_at(&mut got, 10).unwrap();
        assert_eq!(got[0], b'1', "{above}: B reads A's store through the mapping");
        mw[20] = b'2';
        mw[160_000] = b'3';
        let mut got = [0u8; 3];
        fb.read_exact_at(&mut got[..1], 20).unwrap();
        fb.read_exact_at(&mut got[1..2], 160_000).unwrap();
        fb.read_exact_at(&mut got[2..], 10).unwrap();
        assert_eq!(&got, b"231", "{above}: B reads A's stores made after A gave the write token up");
        // And B's write shows in A's writable mapping.
        fb.write_at(b"4", 30).unwrap();
        assert_eq!(mw[30], b'4', "{above}: A's writable mapping after B's write");
        drop(mw);
        // Every store landed in the store: a third machine reads them.
        let c = Stack::open(&sp, cache()).unwrap();
        let fc = c.top().open("f").unwrap();
        let all = read_all(&fc);
        assert_eq!(
            (all[10], all[20], all[30], all[160_000], all[150_500]),
            (b'1', b'2', b'4', b'3', b'B'),
            "{above}: C"
        );
    }
}

/// Two machines in tight loops on one file — one writing, one reading — both make
/// progress: a machine that gave its token up to a request waits for the requester's turn
/// before taking it back (without that, whichever loop ran got the token back every time:
/// one read in 3 s against 680,000 writes, and the reverse). And the writes' bytes come
/// from a mapping of the same file: a write pins the token, then its copy faults on the
/// mapping and the fault pins it again — a revocation waiting for the write's pin must not
/// make the fault wait for it (it would wait for itself).
#[test]
fn loops_on_two_machines_take_turns_even_writing_from_a_mapping_of_the_file() {
    let Some(env) = SharedEnv::get("loops_on_two_machines_take_turns") else { return };
    let _dog = common::Watchdog::new("loops_on_two_machines_take_turns", Duration::from_secs(60));
    let sp = env.spec(&fresh_prefix("selfmap"), &env.etcd, "");
    let a = Stack::open(&sp, cache()).unwrap();
    let b = Stack::open(&sp, cache()).unwrap();
    let fa = a.top().open_with("f", rw()).unwrap();
    // A mapping of the file's first MiB (16 chunks), copied whole by each write: its pages
    // fault one cluster at a time while the write holds its pin.
    const M: usize = 1 << 20;
    fa.write_at(&data(5, 2 * M), 0).unwrap();
    let m = fa.map(0..M as u64, ubc::Access::ReadOnly, ubc::Sharing::Shared).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // B reads, and writes now and then: a write takes A's token entirely, which drops A's
    // pages — the mapping's too, so A's next write faults inside its copy.
    let reader = {
        let stop = stop.clone();
        let fb = b.top().open_with("f", OpenOptions::new().write(true)).unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 16];
            let mut n = 0u64;
            while !stop.load(Relaxed) {
                if n % 4 == 3 {
                    fb.write_at(b"from B", 30_000).unwrap();
                } else {
                    fb.read_exact_at(&mut buf, M as u64 + 8192).unwrap();
                }
                n += 1;
            }
            n
        })
    };
    let start = Instant::now();
    let mut writes = 0u64;
    while start.elapsed() < Duration::from_secs(4) {
        fa.write_at(&m[..], M as u64).unwrap();
        writes += 1;
    }
    stop.store(true, Relaxed);
    let reads = reader.join().unwrap();
    eprintln!("{writes} writes from the mapping, {reads} reads and writes on the other machine");
    // (Starved, a side made 0 or 1; each turn costs a commit, and a write here copies 1 MiB
    // through faults, so a few turns are all a loaded machine gives in 4 s.)
    assert!(writes > 2 && reads > 2, "both machines made progress: {writes} writes, {reads} reads and writes");
}

/// Advisory locks hold between machines (what SQLite, `flock(1)` and friends rely on):
/// record locks conflict across machines as within one — overlapping, one exclusive — and
/// `F_GETLK` names the other machine's process; a waiting lock is granted once the other
/// machine releases (an unlock, a closed handle); `flock` locks exclude each other across
/// machines and never conflict with record locks; a machine that leaves (its lease
/// revoked) leaves no lock behind. Plain and through `zstd` (locks compare in the stored
/// bytes there). Before, each machine's table was its own: both took the same lock.
#[test]
fn locks_hold_between_machines() {
    use ubc_stack::{LockKind::*, LockOwner, LockWait::*};
    let Some(env) = SharedEnv::get("locks_hold_between_machines") else { return };
    for above in ["", " | zstd"] {
        let sp = format!("{}{above}", env.spec(&fresh_prefix("locks"), &env.etcd, ""));
        let a = Stack::open(&sp, cache()).unwrap();
        let b = Stack::open(&sp, cache()).unwrap();
        let fa = a.top().open_with("db", rw()).unwrap();
        fa.write_at(&data(1, 10_000), 0).unwrap();
        let fb = b.top().open_with("db", OpenOptions::new().write(true)).unwrap();
        let (pa, pb) = (LockOwner(11), LockOwner(22));
        assert!(fa.lock_as(pa, 4242, 0..100, Exclusive, Try), "{above}: A's lock");
        assert!(!fb.lock_as(pb, 7, 50..60, Shared, Try), "{above}: B's overlapping lock refused");
        assert!(!fb.lock_as(pb, 7, 0..1, Exclusive, Try), "{above}: B's exclusive lock refused");
        if above.is_empty() {
            // In the stored bytes, plain: a lock past A's is free (through zstd both cover
            // the same compressed chunk, so the conflict stands there).
            assert!(fb.lock_as(pb, 7, 200..300, Exclusive, Try), "{above}: B's lock elsewhere");
            fb.unlock_as(pb, 200..300);
        }
        let c = fb.test_lock(pb, 10..20, Shared).expect("F_GETLK sees A's lock");
        assert_eq!((c.kind, c.pid), (Exclusive, 4242), "{above}: F_GETLK names A's process");
        // A downgrade to shared lets B's shared lock in, not its exclusive one.
        assert!(fa.lock_as(pa, 4242, 0..100, Shared, Try));
        assert!(fb.lock_as(pb, 7, 50..60, Shared, Try), "{above}: shared with shared");
        assert!(!fa.lock_as(pa, 4242, 0..100, Exclusive, Try), "{above}: A's upgrade meets B's shared lock");
        fb.unlock_as(pb, 0..u64::MAX);
        // B waits for A's exclusive lock; A's unlock lets it in.
        assert!(fa.lock_as(pa, 4242, 0..100, Exclusive, Try));
        // (Granted after the unlock: measured from before B asks, since B now hears the
        // unlock at once — timed from inside B's thread, which may start late, the wait
        // measured less than the 300 ms that A held the lock.)
        let (granted, released) = std::thread::scope(|s| {
            let w = s.spawn(|| {
                assert!(fb.lock_as(pb, 7, 0..10, Exclusive, Block));
                Instant::now()
            });
            std::thread::sleep(Duration::from_millis(300));
            assert!(!w.is_finished(), "{above}: B's waiting lock granted while A holds it");
            let released = Instant::now();
            fa.unlock_as(pa, 0..u64::MAX);
            (w.join().unwrap(), released)
        });
        assert!(granted >= released, "{above}: B's lock granted before A's unlock");
        assert!(!fa.lock_as(pa, 1, 5..6, Shared, Try), "{above}: B holds it now");
        // Closing B's handle's owner releases its locks for A.
        fb.unlock_owner(pb);
        assert!(fa.lock_as(pa, 1, 5..6, Exclusive, Try), "{above}: released by B's close");
        fa.unlock_owner(pa);
        // flock: exclusive across machines, apart from record locks.
        assert!(fa.flock_as(pa, Exclusive, Try));
        assert!(!fb.flock_as(pb, Shared, Try), "{above}: B's flock refused");
        assert!(fb.lock_as(pb, 7, 0..10, Exclusive, Try), "{above}: record locks ignore flocks");
        fb.unlock_owner(pb);
        fa.funlock_as(pa);
        assert!(fb.flock_as(pb, Shared, Try), "{above}: after A's LOCK_UN");
        assert!(fa.flock_as(pa, Shared, Try), "{above}: shared flocks on both machines");
        assert!(!fa.flock_as(LockOwner(33), Exclusive, Try), "{above}: B's shared flock holds against A");
        // A machine that leaves takes its locks with it.
        assert!(fb.lock_as(pb, 7, 0..10, Exclusive, Try));
        // (Its lease is revoked when the layer's last reference goes, which here took
        // 0.5-1.2 s after the stack's drop, more under load; at the latest the lease
        // expires, 10 s after B's last renewal. Measured before the bound: 5 s failed once
        // on a loaded machine.)
        drop(fb);
        drop(b);
        let t = Instant::now();
        while !fa.lock_as(pa, 1, 0..10, Exclusive, Try) {
            assert!(t.elapsed() < Duration::from_secs(15), "{above}: B's lock outlived B's lease");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A lock waiting for another machine's asks etcd again only when a lock key changes (the
/// machine's watch of every file's locks hears it), not at every try: the mount tries a
/// waiting lock every 5 ms (`LockWait::Retry`), and each try was a read of etcd. A wait
/// ends when the holder lets go, not at the next poll. A first try (`LockWait::Try`)
/// always asks (`locks_hold_between_machines`: a try after the other machine's unlock
/// returned gets the lock).
#[test]
fn a_lock_waiting_for_another_machine_asks_etcd_only_when_locks_change() {
    use ubc_stack::{LockKind::*, LockOwner, LockWait::*};
    let Some(env) = SharedEnv::get("a_lock_waiting_for_another_machine") else { return };
    let prefix = fresh_prefix("lockwait");
    let (_, a) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let (lb, b) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let fa = a.top().open_with("db", rw()).unwrap();
    fa.write_at(&data(1, 10_000), 0).unwrap();
    let fb = b.top().open_with("db", OpenOptions::new().write(true)).unwrap();
    let (pa, pb) = (LockOwner(1), LockOwner(2));
    assert!(fa.lock_as(pa, 100, 0..100, Exclusive, Try));
    // B's watch of the lock keys may still be starting: a first refusal after it is live.
    std::thread::sleep(Duration::from_millis(300));
    assert!(!fb.lock_as(pb, 200, 0..10, Exclusive, Try));
    let first = lb.dist_stats().unwrap().lock_asks;
    assert!(!fb.lock_as(pb, 200, 0..10, Exclusive, Try));
    assert_eq!(lb.dist_stats().unwrap().lock_asks, first + 1, "a first try did not ask etcd");
    // The mount's way: try again every 2 ms, here for 300 ms (150 tries).
    let asks = lb.dist_stats().unwrap().lock_asks;
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(300) {
        assert!(!fb.lock_as(pb, 200, 0..10, Exclusive, Retry), "granted while A holds it");
        std::thread::sleep(Duration::from_millis(2));
    }
    let polled = lb.dist_stats().unwrap().lock_asks - asks;
    assert!(polled <= 2, "150 tries of a refused lock asked etcd {polled} times");
    // A lock on another file's keys changing makes B look again, and still refused.
    let fa2 = a.top().open_with("other", rw()).unwrap();
    assert!(fa2.lock_as(pa, 100, 0..1, Exclusive, Try));
    let t = Instant::now();
    while lb.dist_stats().unwrap().lock_asks == asks + polled {
        assert!(!fb.lock_as(pb, 200, 0..10, Exclusive, Retry));
        assert!(t.elapsed() < Duration::from_secs(10), "B never looked again after a lock changed");
        std::thread::sleep(Duration::from_millis(2));
    }
    // A waiting lock (the library's) is granted when A lets go: woken by the watch, not at
    // its next ask (every second when nothing is heard).
    let (waited, asks_waiting) = std::thread::scope(|s| {
        let w = s.spawn(|| {
            let before = lb.dist_stats().unwrap().lock_asks;
            assert!(fb.lock_as(pb, 200, 0..10, Exclusive, Block));
            (Instant::now(), lb.dist_stats().unwrap().lock_asks - before)
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!w.is_finished(), "B's waiting lock granted while A holds it");
        let released = Instant::now();
        fa.unlock_as(pa, 0..u64::MAX);
        let (granted, asks) = w.join().unwrap();
        (granted - released, asks)
    });
    assert!(asks_waiting <= 4, "a waiting lock asked etcd {asks_waiting} times");
    // (Waking at its next ask instead, it would be granted ~950 ms after the unlock.)
    assert!(waited < Duration::from_millis(700), "B's lock was granted {waited:?} after A's unlock");
    assert!(!fa.lock_as(pa, 100, 5..6, Shared, Try), "B holds it now");
}

/// A file closed everywhere on a machine keeps its token there (Frangipani's and GPFS's
/// clients cache tokens): opening it again, writing and closing it take no token from etcd —
/// before, each last close gave the token up and the next open took it again (a file
/// created, closed, opened and written cost six etcd writes, three for the token). Another
/// machine still gets it when it asks, and reads what was written; a file removed here gives
/// its kept token up. And `stat` right after a close shows what was written, with the pages
/// not yet written back.
#[test]
fn a_closed_file_keeps_its_token_for_the_next_open_and_gives_it_to_whoever_asks() {
    let Some(env) = SharedEnv::get("a_closed_file_keeps_its_token") else { return };
    let prefix = fresh_prefix("kept");
    let (la, a) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let (_, b) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    // Every file leaves the stack at its last close (no pool of idle files).
    a.set_idle_files(0);
    let mut model = Vec::new();
    let mut acquired = 0;
    for i in 0..5u64 {
        let f = a.top().open_with("f", rw()).unwrap();
        let d = data(10 + i, 3000);
        f.write_at(&d, i * 1000).unwrap();
        model.resize(model.len().max(i as usize * 1000 + d.len()), 0);
        model[i as usize * 1000..i as usize * 1000 + d.len()].copy_from_slice(&d);
        drop(f);
        // Closed, its pages not written back yet: `stat` shows what was written (it showed
        // the store's older size until the flusher ran, ~5 s).
        assert_eq!(a.top().getattr("f").unwrap().size, model.len() as u64, "stat after close {i}");
        // Out of the cache too: the file is stored and dropped on this machine.
        a.cache().evict_all().unwrap();
        let st = la.dist_stats().unwrap();
        if i == 0 {
            acquired = st.acquired;
        }
        assert_eq!(st.acquired, acquired, "closed and opened again ({i}), the file took its token again: {st:?}");
    }
    // B asks; A gives the kept token up (nothing to store: stored at each close).
    let fb = b.top().open("f").unwrap();
    same(&read_all(&fb), &model, "B reads what A wrote before closing");
    assert!(la.dist_stats().unwrap().revoked >= 1);
    drop(fb);
    // A file removed here gives its kept token up: no key of it is left in etcd.
    let g = a.top().open_with("g", rw()).unwrap();
    g.write_at(b"gone soon", 0).unwrap();
    drop(g);
    let ino = a.top().getattr("g").unwrap().ino;
    a.cache().evict_all().unwrap();
    let (rt, admin) = etcd_admin(&env.etcd);
    let of_g = |keys: Vec<(String, i64)>| keys.iter().filter(|(k, _)| k.contains(&format!("/t/{ino:016x}/"))).count();
    assert_eq!(of_g(token_keys(&rt, &admin, &env.bucket, &prefix)), 1, "g's token not kept after its close");
    a.top().remove("g").unwrap();
    assert_eq!(of_g(token_keys(&rt, &admin, &env.bucket, &prefix)), 0, "a removed file's kept token stayed in etcd");
    assert!(b.top().getattr("g").is_err(), "B still sees the removed file");
}

/// A file another machine removed, which this machine only read, is nothing for this
/// machine's `sync_all` to store: it succeeds (through layers above too). Before, through
/// `zstd`, this machine's sync made the other machine's published commit durable — writing
/// a superblock into the shared file without the write token — and, the file being gone,
/// failed: a mount's shutdown then exited 74 ("not synced") over a file it never wrote.
#[test]
fn a_file_removed_elsewhere_that_this_machine_only_read_does_not_fail_its_sync() {
    let Some(env) = SharedEnv::get("a_file_removed_elsewhere_does_not_fail_sync") else { return };
    let dir = tempfile::tempdir().unwrap();
    for (above, sp) in shared_specs(&env, dir.path(), "rmsync", &["", " | zstd", " | aead:keyfile=KEY | zstd"]) {
        let a = Stack::open(&sp, cache()).unwrap();
        let b = Stack::open(&sp, cache()).unwrap();
        let fa = a.top().open_with("f", rw()).unwrap();
        fa.write_at(&data(5, 100_000), 0).unwrap();
        // What a mount's close does: through zstd, a published commit (not a durable one).
        fa.write_back().unwrap();
        drop(fa);
        // Opened for writing, as a mount opens a file it may write; only read.
        let fb = b.top().open_with("f", OpenOptions::new().write(true)).unwrap();
        same(&read_all(&fb), &data(5, 100_000), &format!("{above}: B reads"));
        drop(fb);
        a.top().remove("f").unwrap();
        a.sync_all().unwrap();
        b.sync_all().unwrap_or_else(|e| panic!("{above}: B's sync after A removed a file B only read: {e}"));
        assert!(b.top().getattr("f").is_err(), "{above}: gone on B");
    }
}

/// A small write on one machine costs a machine that had read the file a GET of the bytes
/// written (the patch), not of their chunk: the chunk as it was is still here, keyed by its
/// newest object, and only the patches since are fetched and laid over it.
#[test]
fn another_machine_s_small_write_is_fetched_as_its_bytes_not_its_chunk() {
    let Some(env) = SharedEnv::get("another_machine_s_small_write_is_fetched") else { return };
    let prefix = fresh_prefix("patchget");
    let (_, a) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let (lb, b) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let fa = a.top().open_with("f", rw()).unwrap();
    let mut model = data(3, 256 << 10);
    fa.write_at(&model, 0).unwrap();
    fa.sync().unwrap();
    let fb = b.top().open("f").unwrap();
    same(&read_all(&fb), &model, "B's first read");
    for i in 0..6u64 {
        let off = (i * 37 + 5) % 60 * 4096;
        let d = data(100 + i, 4096);
        fa.write_at(&d, off).unwrap();
        model[off as usize..off as usize + 4096].copy_from_slice(&d);
        let before = lb.stats();
        if i % 2 == 0 {
            same(&read_all(&fb), &model, &format!("B after A's write {i}"));
        } else {
            // Only those 4 KiB, as `dist_coherence` reads (a random miss, which alone would
            // fetch its 64 KiB block of the base and the patches meeting it).
            let mut got = vec![0u8; 4096];
            fb.read_exact_at(&mut got, off).unwrap();
            same(&got, &d, &format!("B's 4 KiB after A's write {i}"));
        }
        let got = lb.stats().get_bytes - before.get_bytes;
        assert!(got <= 4096, "write {i}: B fetched {got} bytes for A's 4 KiB");
    }
}

/// A machine that opened a file (taking its read token from the writer, which yields) and
/// closed it again does not hold the writer's next write up: the writer finds that machine's
/// turn over — no key of its own, no request left — instead of waiting the whole grace
/// (500 ms) for a key that will not come (`dist_coherence`'s first round, and every first
/// write after another machine's look at a file).
#[test]
fn a_turn_taken_and_left_does_not_hold_the_next_writer_up() {
    let Some(env) = SharedEnv::get("a_turn_taken_and_left") else { return };
    let prefix = fresh_prefix("turns");
    let (la, a) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let (_, b) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let fa = a.top().open_with("f", rw()).unwrap();
    let mut model = data(1, 10_000);
    fa.write_at(&model, 0).unwrap();
    fa.sync().unwrap();
    for i in 0..3u64 {
        // B opens the file (A yields to B, which gives the token up again once the open
        // has what it needs); then A writes, and B reads what A wrote.
        let fb = b.top().open("f").unwrap();
        let d = data(10 + i, 100);
        fa.write_at(&d, 0).unwrap();
        fa.sync().unwrap();
        model[..100].copy_from_slice(&d);
        same(&read_all(&fb), &model, &format!("B's read {i}"));
    }
    let st = la.dist_stats().unwrap();
    assert!(st.revoked >= 1, "A never yielded to B: {st:?}");
    assert_eq!(st.turns_waited_out, 0, "A waited out B's turn: {st:?}");
}

/// Through `zstd`, a machine whose close published a commit (a mount's close) and whose
/// token then went to another machine that wrote the file has nothing left to store: its
/// `sync_all` (a mount's shutdown) succeeds and leaves the other machine's bytes as they are
/// — it neither writes its own commit over them, nor compacts the file, nor fails on the
/// fence (a user's two mounts under `ubc-fsx`: both daemons exited 74 at unmount).
#[test]
fn a_machine_whose_published_commit_another_overwrote_syncs_without_error() {
    let Some(env) = SharedEnv::get("a_machine_whose_published_commit") else { return };
    let dir = tempfile::tempdir().unwrap();
    for (above, sp) in shared_specs(&env, dir.path(), "pubsync", &[" | zstd", " | aead:keyfile=KEY | zstd"]) {
        let a = Stack::open(&sp, cache()).unwrap();
        let b = Stack::open(&sp, cache()).unwrap();
        let fb = b.top().open_with("f", rw()).unwrap();
        // Rewritten whole, incompressible, three times — synced, then closed twice (the
        // mount's close: a published commit): the stored file holds the free space a
        // compaction would reclaim, which B's own sync would have taken.
        let mut r = StdRng::seed_from_u64(4);
        for i in 0..3 {
            let noise: Vec<u8> = (0..600_000).map(|_| r.random()).collect();
            fb.write_at(&noise, 0).unwrap();
            if i == 0 { fb.sync().unwrap() } else { fb.write_back().unwrap() }
        }
        fb.write_at(&data(1, 100_000), 0).unwrap();
        fb.write_back().unwrap();
        let mut want = read_all(&fb);
        drop(fb);
        let fa = a.top().open_with("f", rw()).unwrap();
        let two = data(2, 30_000);
        fa.write_at(&two, 50_000).unwrap();
        want[50_000..80_000].copy_from_slice(&two);
        fa.sync().unwrap();
        b.sync_all().unwrap_or_else(|e| panic!("{above}: B's sync after A overwrote B's published commit: {e}"));
        a.sync_all().unwrap();
        let c = Stack::open(&sp, cache()).unwrap();
        same(&read_all(&c.top().open("f").unwrap()), &want, &format!("{above}: a third machine"));
        // A truncation through zstd changes no page, only the layer's index and length:
        // giving the token up stores it too, and the next holder sees the new length.
        let fb = b.top().open_with("f", rw()).unwrap();
        fb.set_len(10_000).unwrap();
        assert_eq!(fa.len().unwrap(), 10_000, "{above}: A after B's truncation");
        same(&read_all(&fa), &want[..10_000], &format!("{above}: A reads B's truncation"));
        drop(fb);
        b.sync_all().unwrap_or_else(|e| panic!("{above}: B's sync after its truncation went to A: {e}"));
    }
}

/// A `stat` of a file no machine writes reads its name, record and token keys in one etcd
/// transaction (for a name read on this machine before) and takes no token; while another
/// machine holds the write token, it takes the read token, and shows what that machine
/// wrote (stored first). A directory's `stat` reads its record, not its entries (it read
/// every name under it: 30 ms a `stat` below a directory of 3,000 names).
#[test]
fn a_stat_of_a_file_nobody_writes_is_one_etcd_read_and_takes_no_token() {
    let Some(env) = SharedEnv::get("a_stat_of_a_file_nobody_writes") else { return };
    let prefix = fresh_prefix("stat");
    let (_, a) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let (lb, b) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let f = a.top().open_with("f", rw()).unwrap();
    f.write_at(&data(3, 100_000), 0).unwrap();
    drop(f);
    a.sync_all().unwrap();
    for d in ["d", "d/x", "d/y", "d/z"] {
        a.top().mkdir(d).unwrap();
    }
    for i in 0..200 {
        a.top().open_with(&format!("d/x/{i}"), rw()).unwrap();
    }
    // B's first `stat`s: the names are new here (two reads each), and A kept f's write
    // token at its close (B takes the read token from it).
    assert_eq!(b.top().getattr("f").unwrap().size, 100_000);
    assert_eq!(b.top().getattr("d").unwrap().nlink, 5);
    let before = lb.dist_stats().unwrap();
    for _ in 0..20 {
        assert_eq!(b.top().getattr("f").unwrap().size, 100_000);
        assert_eq!(b.top().getattr("d").unwrap().nlink, 5);
    }
    let after = lb.dist_stats().unwrap();
    assert_eq!(after.acquired, before.acquired, "a stat of a file nobody writes took a token");
    assert_eq!(after.meta_requests - before.meta_requests, 40, "etcd requests for 40 stats: {before:?} → {after:?}");
    // B gives its read token up (pushed out of its kept tokens by none: asked by A's write).
    let f = a.top().open_with("f", OpenOptions::new().write(true)).unwrap();
    f.write_at(&data(4, 50_000), 80_000).unwrap();
    // Not synced, not closed: B's stat asks A for the file and sees the new length.
    let before = lb.dist_stats().unwrap();
    assert_eq!(b.top().getattr("f").unwrap().size, 130_000, "a stat after a write returned elsewhere");
    assert!(lb.dist_stats().unwrap().acquired > before.acquired, "the writer's file was stat'ed without its token");
    drop(f);
}

/// A file created here holds its write token from the create's own etcd transaction: its
/// first write takes no token (one transaction and one fsync of etcd's log less per file
/// created), and another machine still gets the token when it asks, and reads the bytes.
#[test]
fn a_created_file_holds_its_write_token_from_the_create_s_own_transaction() {
    let Some(env) = SharedEnv::get("a_created_file_holds_its_write_token") else { return };
    let prefix = fresh_prefix("created");
    let (la, a) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let (_, b) = own_machine(&env.spec(&prefix, &env.etcd, ""));
    let before = la.dist_stats().unwrap();
    for i in 0..10u64 {
        let f = a.top().open_with(&format!("f{i}"), rw()).unwrap();
        f.write_at(&data(i, 5000), 0).unwrap();
    }
    let after = la.dist_stats().unwrap();
    assert_eq!(after.created - before.created, 10, "{before:?} → {after:?}");
    assert_eq!(after.acquired, before.acquired, "a created file's first write took its token: {after:?}");
    let (rt, admin) = etcd_admin(&env.etcd);
    let tokens = token_keys(&rt, &admin, &env.bucket, &prefix);
    assert_eq!(tokens.len(), 10, "one token key per file created: {tokens:?}");
    assert!(tokens.iter().all(|(_, lease)| *lease != 0), "a created file's token is not under the lease: {tokens:?}");
    for i in 0..10u64 {
        let fb = b.top().open(&format!("f{i}")).unwrap();
        same(&read_all(&fb), &data(i, 5000), &format!("B reads f{i}"));
    }
    assert!(la.dist_stats().unwrap().revoked >= 10);
}

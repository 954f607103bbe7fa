//! Coherence between machines (issue 21, item 4): `s3:…?etcd=…` stacks, each with its own
//! cache as separate machines have, over the s3 server and the etcd `scripts/bench` starts
//! (`UBC_BENCH_S3_ENDPOINT`, `UBC_BENCH_S3_BUCKET`, `UBC_BENCH_ETCD`; without them the group is
//! skipped), against the plain S3 client on the same server:
//!
//! * `dist_coherence`: one machine writes 4 KiB into a shared file and syncs, another then
//!   reads those bytes: the time from the write's start to the read's end, p50 and p99 (ms),
//!   vs. the plain client's PUT of a 4 KiB object and another client's GET of it;
//! * `dist_readers`: 4 machines read one 16 MiB file (64 MiB at full scale) front to back,
//!   3 times each: bytes fetched from the store per byte read, vs. the plain client (every
//!   read a GET of the object: 1.0).
//!
//! Each row twice: against the server as it is, and through the s3 rows' `SlowProxy` (20 ms
//! per request, 50 MB/s per connection; rows `*_20ms`). etcd is reached directly in both (a
//! metadata service near its clients, as deployments place it).

use super::Ctx;
use crate::report::{Better, Record};
use crate::util::*;
use object_store::ObjectStoreExt;
use std::sync::Arc;
use std::time::Instant;
use ubc_stack::layer::s3::{S3, S3Options};
use ubc_stack::{OpenOptions, Stack};

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let (Ok(endpoint), Ok(bucket), Ok(etcd)) =
        (std::env::var("UBC_BENCH_S3_ENDPOINT"), std::env::var("UBC_BENCH_S3_BUCKET"), std::env::var("UBC_BENCH_ETCD"))
    else {
        eprintln!(
            "dist: no s3 server or etcd (UBC_BENCH_S3_ENDPOINT, UBC_BENCH_ETCD; scripts/bench starts both): skipped"
        );
        return vec![];
    };
    let mut records = rows(ctx, &endpoint, &bucket, &etcd, "", "s3s-fs and etcd on this host");
    let upstream: std::net::SocketAddr =
        endpoint.trim_start_matches("http://").parse().expect("UBC_BENCH_S3_ENDPOINT is http://IP:PORT");
    let proxy = super::s3::SlowProxy::start(upstream, std::time::Duration::from_millis(20), 50_000_000);
    records.extend(rows(
        ctx,
        &format!("http://{}", proxy.addr),
        &bucket,
        &etcd,
        "_20ms",
        "s3s-fs through a proxy adding 20 ms per request (50 MB/s per connection), etcd on this host",
    ));
    records
}

/// The two rows, named with `suffix`, against the s3 server at `endpoint`.
fn rows(ctx: &Ctx, endpoint: &str, bucket: &str, etcd: &str, suffix: &str, how: &str) -> Vec<Record> {
    let prefix = format!("bench-dist-{}{suffix}", std::process::id());
    let opts = S3Options::parse(&format!("{bucket}/{prefix}?endpoint={endpoint}&etcd={etcd}")).expect("s3 options");
    // A machine: its own layer (hence its own etcd lease and tokens) and its own cache.
    let machine = || {
        let layer = Arc::new(S3::open(&opts).expect("s3 open"));
        let cache = ubc::Cache::builder().budget(256 * MIB).build().expect("cache");
        let l2 = layer.clone();
        let s = Stack::builder(cache).push(move |_| Ok(l2 as Arc<dyn ubc_stack::Layer>)).unwrap().build().unwrap();
        (layer, s)
    };
    let (store, rt) = super::s3::plain_client(endpoint, bucket);

    // dist_coherence
    let iters = ctx.scale(400, 100) as usize / if suffix.is_empty() { 1 } else { 2 };
    let (_la, a) = machine();
    let (_lb, b) = machine();
    let fa = a.top().open_with("c", OpenOptions::new().write(true).create(true)).expect("create");
    fa.write_at(&vec![0u8; 1 << 20], 0).expect("write");
    fa.sync().expect("sync");
    let fb = b.top().open_with("c", OpenOptions::new()).expect("open");
    let offs = random_offsets(iters, (1 << 20) - 4096, 4096, 11);
    let (mut ubc_ms, mut plain_ms) = (Vec::new(), Vec::new());
    let mut buf = vec![0u8; 4096];
    for (i, &o) in offs.iter().enumerate() {
        let rec = [(i % 250) as u8 + 1; 4096];
        let t = Instant::now();
        fa.write_at(&rec, o).expect("write");
        fa.sync().expect("sync");
        fb.read_exact_at(&mut buf, o).expect("read");
        ubc_ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(buf, rec, "machine B read stale bytes");
        let path = object_store::path::Path::from(format!("{prefix}/plain-{i}"));
        let t = Instant::now();
        rt.block_on(store.put(&path, bytes::Bytes::copy_from_slice(&rec).into())).expect("put");
        let got = rt.block_on(async { store.get(&path).await.expect("get").bytes().await.expect("body") });
        plain_ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(&got[..], &rec[..]);
        let _ = rt.block_on(store.delete(&path));
    }
    let (u50, u99) = (percentile(&ubc_ms, 50.0), percentile(&ubc_ms, 99.0));
    let (p50, p99) = (percentile(&plain_ms, 50.0), percentile(&plain_ms, 99.0));
    drop((fa, fb, a, b));

    // dist_readers
    let len = ctx.scale(64 * MIB, 16 * MIB) as usize;
    let mut data = vec![0u8; len];
    fill_pattern(&mut 0x5151_2323_7777_0001u64, &mut data);
    {
        let (_l, s) = machine();
        let f = s.top().open_with("hot", OpenOptions::new().write(true).create(true)).expect("create");
        f.write_at(&data, 0).expect("write");
        f.sync().expect("sync");
    }
    let readers: Vec<_> = (0..4).map(|_| machine()).collect();
    let before: u64 = readers.iter().map(|(l, _)| l.stats().get_bytes).sum();
    let passes = 3;
    let t = Instant::now();
    std::thread::scope(|sc| {
        for (_, s) in &readers {
            sc.spawn(|| {
                let f = s.top().open_with("hot", OpenOptions::new()).expect("open");
                let mut b = vec![0u8; 1 << 20];
                for _ in 0..passes {
                    let mut off = 0u64;
                    while off < len as u64 {
                        let n = f.read_at(&mut b, off).expect("read");
                        assert!(n > 0);
                        off += n as u64;
                    }
                }
            });
        }
    });
    let secs = t.elapsed().as_secs_f64();
    let fetched: u64 = readers.iter().map(|(l, _)| l.stats().get_bytes).sum::<u64>() - before;
    let read = (4 * passes * len) as f64;
    vec![
        Record::from_samples(
            &format!("dist_coherence{suffix}"),
            "ms (p50)",
            Better::Lower,
            &[u50],
            &[p50],
            "a PUT of a 4 KiB object, then another client's GET of it",
            &format!(
                "{iters} rounds: machine A writes 4 KiB into a 1 MiB file and syncs, machine B reads them (its read token takes A's write token, which stores the chunk and the record first); p99 {u99:.1} ms vs {p99:.1} ms; {how}"
            ),
        ),
        Record::from_samples(
            &format!("dist_readers{suffix}"),
            "bytes fetched / byte read",
            Better::Lower,
            &[fetched as f64 / read],
            &[1.0],
            "every read a GET of the object (1.0)",
            &format!(
                "4 machines each read a {} MiB file front to back {passes} times, in parallel ({:.0} MB/s in all); each fetches the file once and shares the read token; {how}",
                len >> 20,
                read / secs / 1e6
            ),
        ),
    ]
}

/// The `p`th percentile of `v` (nearest rank).
fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0 * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1;
    s[i]
}

//! The `s3:` layer against the plain S3 client on the same server (issue 21, item 4; the
//! server is `s3s-fs`, started by `scripts/bench` — `UBC_BENCH_S3_ENDPOINT`,
//! `UBC_BENCH_S3_BUCKET`, `AWS_*` credentials; without them the group is skipped):
//!
//! * `s3_seqread_cold`: read a file once, 1 MiB `read_at`s through a fresh cache (its
//!   read-ahead fetches chunks in parallel), vs one streaming GET of an object of the same
//!   size with `object_store`, GB/s;
//! * `s3_reread`: the same file read again, warm (in the cache), vs the cold read, GB/s;
//! * `s3_randread_4k`: 256 cold random 4 KiB reads, one at a time, through a fresh cache,
//!   vs a ranged GET of the same 4 KiB with `object_store`, reads/s; and
//!   `s3_randread_4k_bytes`, the bytes ubc fetched per byte read (the plain GET: 1);
//! * `s3_randwrite_4k`: 1,000 random 4 KiB writes to the file, then one sync: bytes uploaded
//!   per byte written, vs rewriting the whole object (the file size per sync), lower is
//!   better.
//!
//! Each row twice: against the server as it is (on this host), and through `SlowProxy`, which
//! adds 20 ms to every request and paces each connection to 50 MB/s (rows `*_20ms`).

use super::Ctx;
use crate::report::{Better, Record};
use crate::util::*;
use object_store::ObjectStoreExt;
use std::sync::Arc;
use ubc_stack::layer::s3::{S3, S3Options};
use ubc_stack::{OpenOptions, Stack};

/// A TCP proxy in front of the server that makes it look remote: every request waits
/// `latency` before it is forwarded (a client's bytes after a quiet moment start a request),
/// and each connection's responses flow at most `bytes_per_sec` — one S3 connection's
/// typical ceiling, the reason S3 clients read with several requests at once.
pub(crate) struct SlowProxy {
    pub(crate) addr: std::net::SocketAddr,
}

impl SlowProxy {
    pub(crate) fn start(upstream: std::net::SocketAddr, latency: std::time::Duration, bytes_per_sec: u64) -> SlowProxy {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("proxy listen");
        let addr = listener.local_addr().expect("proxy address");
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = std::net::TcpStream::connect(upstream) else { continue };
                let (mut c_in, mut s_out) = (client.try_clone().expect("clone"), server.try_clone().expect("clone"));
                // Requests: delayed when they start after a quiet moment.
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    let mut last = std::time::Instant::now() - latency;
                    while let Ok(n) = c_in.read(&mut buf) {
                        if n == 0 || {
                            if last.elapsed() > std::time::Duration::from_millis(1) {
                                std::thread::sleep(latency);
                            }
                            s_out.write_all(&buf[..n]).is_err()
                        } {
                            break;
                        }
                        last = std::time::Instant::now();
                    }
                    let _ = s_out.shutdown(std::net::Shutdown::Write);
                });
                // Responses: paced to `bytes_per_sec`.
                let (mut s_in, mut c_out) = (server, client);
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n) = s_in.read(&mut buf) {
                        if n == 0 || c_out.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        std::thread::sleep(std::time::Duration::from_secs_f64(n as f64 / bytes_per_sec as f64));
                    }
                    let _ = c_out.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        SlowProxy { addr }
    }
}

/// The baseline: the plain `object_store` client of the server at `endpoint`, and a runtime
/// to drive it.
pub(crate) fn plain_client(endpoint: &str, bucket: &str) -> (object_store::aws::AmazonS3, tokio::runtime::Runtime) {
    let store = object_store::aws::AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_region("us-east-1")
        .with_endpoint(endpoint)
        .with_allow_http(true)
        .build()
        .expect("client");
    (store, tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime"))
}

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let (Ok(endpoint), Ok(bucket)) = (std::env::var("UBC_BENCH_S3_ENDPOINT"), std::env::var("UBC_BENCH_S3_BUCKET"))
    else {
        eprintln!("s3: no server (UBC_BENCH_S3_ENDPOINT; scripts/bench starts one): skipped");
        return vec![];
    };
    let mut records = rows(ctx, &endpoint, &bucket, "", "no added latency");
    // The same through a proxy: 20 ms per request, 50 MB/s per connection.
    let upstream: std::net::SocketAddr =
        endpoint.trim_start_matches("http://").parse().expect("UBC_BENCH_S3_ENDPOINT is http://IP:PORT");
    let proxy = SlowProxy::start(upstream, std::time::Duration::from_millis(20), 50_000_000);
    records.extend(rows(
        ctx,
        &format!("http://{}", proxy.addr),
        &bucket,
        "_20ms",
        "through a proxy adding 20 ms per request and pacing each connection to 50 MB/s",
    ));
    records
}

/// The three rows, named with `suffix`, against the server at `endpoint`.
fn rows(ctx: &Ctx, endpoint: &str, bucket: &str, suffix: &str, how: &str) -> Vec<Record> {
    let len = ctx.scale(256 * MIB, 64 * MIB) as usize;
    let prefix = format!("bench-{}{suffix}", std::process::id());
    let mut data = vec![0u8; len];
    fill_pattern(&mut 0x9e37_79b9_7f4a_7c15u64, &mut data);
    // UBC_BENCH_S3_CHUNK: the chunk size to try (default: the layer's).
    let chunk = std::env::var("UBC_BENCH_S3_CHUNK").map(|c| format!("&chunk={c}")).unwrap_or_default();
    let opts = S3Options::parse(&format!("{bucket}/{prefix}?endpoint={endpoint}{chunk}")).expect("s3 options");
    let open = |budget: u64| {
        let layer = Arc::new(S3::open(&opts).expect("s3 open"));
        let cache = ubc::Cache::builder().budget(budget).build().expect("cache");
        let l2 = layer.clone();
        let s = Stack::builder(cache).push(move |_| Ok(l2 as Arc<dyn ubc_stack::Layer>)).unwrap().build().unwrap();
        (layer, s)
    };
    {
        let (_l, s) = open(64 * MIB);
        let f = s.top().open_with("f", OpenOptions::new().write(true).create(true)).expect("create");
        f.write_at(&data, 0).expect("write");
        f.sync().expect("sync");
    }
    // The plain client's object: the same bytes as one object.
    let (store, rt) = plain_client(endpoint, bucket);
    let plain = object_store::path::Path::from(format!("{prefix}/plain"));
    rt.block_on(store.put(&plain, bytes::Bytes::from(data.clone()).into())).expect("put plain");
    let (mut cold, mut warm, mut base) = (vec![], vec![], vec![]);
    let mut note = String::new();
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..ctx.runs {
        let (_l, s) = open(2 * len as u64);
        let f = s.top().open_with("f", OpenOptions::new()).expect("open");
        let read_all = |buf: &mut [u8]| {
            let mut off = 0u64;
            loop {
                let n = f.read_at(buf, off).expect("read_at");
                if n == 0 {
                    return off;
                }
                off += n as u64;
            }
        };
        let (secs, n) = time(|| read_all(&mut buf));
        assert_eq!(n as usize, len);
        cold.push(len as f64 / secs / 1e9);
        let (secs, _) = time(|| read_all(&mut buf));
        warm.push(len as f64 / secs / 1e9);
        note = ubc_note(&s.cache().stats(), ubc::IoMode::Unknown);
        let (secs, got) = time(|| {
            rt.block_on(async {
                let r = store.get(&plain).await.expect("get");
                r.bytes().await.expect("body").len()
            })
        });
        assert_eq!(got, len);
        base.push(len as f64 / secs / 1e9);
    }
    // Cold random 4 KiB reads, one at a time: ubc through a fresh cache, the plain client
    // with a ranged GET of the same 4 KiB.
    let reads = 256;
    let (mut rand_ubc, mut rand_plain, mut fetched) = (vec![], vec![], vec![]);
    let mut page = [0u8; 4096];
    for run in 0..ctx.runs {
        let offs = random_offsets(reads, len as u64 - 4096, 4096, 7 + run as u64);
        let (layer, s) = open(64 * MIB);
        let f = s.top().open_with("f", OpenOptions::new()).expect("open");
        let before = layer.stats().get_bytes;
        let (secs, _) = time(|| {
            for &o in &offs {
                f.read_exact_at(&mut page, o).expect("read_at");
            }
        });
        rand_ubc.push(reads as f64 / secs);
        fetched.push((layer.stats().get_bytes - before) as f64 / (reads * 4096) as f64);
        assert_eq!(&page[..], &data[offs[reads - 1] as usize..][..4096]);
        let (secs, _) = time(|| {
            rt.block_on(async {
                for &o in &offs {
                    let b = store.get_range(&plain, o..o + 4096).await.expect("ranged get");
                    assert_eq!(b.len(), 4096);
                }
            })
        });
        rand_plain.push(reads as f64 / secs);
    }
    // Random 4 KiB writes, one sync.
    let (layer, s) = open(64 * MIB);
    let f = s.top().open_with("f", OpenOptions::new().write(true)).expect("open");
    let before = layer.stats();
    let offs = random_offsets(1000, len as u64 - 4096, 4096, 3);
    for &o in &offs {
        f.write_at(&[7u8; 4096], o).expect("write");
    }
    f.sync().expect("sync");
    let uploaded = (layer.stats().put_bytes - before.put_bytes) as f64;
    let written = (offs.len() * 4096) as f64;
    drop((f, s, layer));
    let _ = rt.block_on(store.delete(&plain));
    let what = format!("{} MiB file, {} KiB chunks, s3s-fs on this host, {how}", len >> 20, opts.chunk_size >> 10);
    vec![
        Record::from_samples(
            &format!("s3_seqread_cold{suffix}"),
            "GB/s",
            Better::Higher,
            &cold,
            &base,
            "one streaming GET (object_store)",
            &format!("{what}; 1 MiB read_at through a fresh cache; {note}; target >= 1.5x"),
        ),
        Record::from_samples(
            &format!("s3_reread{suffix}"),
            "GB/s",
            Better::Higher,
            &warm,
            &cold,
            "the cold read through ubc",
            &format!("{what}; the second read of the file through the same cache; target >= 20x"),
        ),
        Record::from_samples(
            &format!("s3_randread_4k{suffix}"),
            "reads/s",
            Better::Higher,
            &rand_ubc,
            &rand_plain,
            "a ranged GET of the 4 KiB (object_store), one at a time",
            &format!("{what}; {reads} cold random 4 KiB read_at, one at a time, through a fresh cache"),
        ),
        Record::from_samples(
            &format!("s3_randread_4k_bytes{suffix}"),
            "bytes fetched / byte read",
            Better::Lower,
            &fetched,
            &vec![1.0; fetched.len()],
            "the plain client's ranged GET (exactly the bytes read)",
            &format!("{what}; the same {reads} cold random 4 KiB reads"),
        ),
        Record::from_samples(
            &format!("s3_randwrite_4k{suffix}"),
            "bytes uploaded / byte written",
            Better::Lower,
            &[uploaded / written],
            &[len as f64 / written],
            "rewriting the whole object",
            &format!("{what}; 1,000 random 4 KiB writes, then one sync"),
        ),
    ]
}

//! The `s3:` layer against the plain S3 client on the same server (issue 21, item 4; the
//! server is `s3s-fs`, started by `scripts/bench` — `UBC_BENCH_S3_ENDPOINT`,
//! `UBC_BENCH_S3_BUCKET`, `AWS_*` credentials; without them the group is skipped):
//!
//! * `s3_seqread_cold`: read a file once, 1 MiB `read_at`s through a fresh cache (its
//!   read-ahead fetches chunks in parallel), vs one streaming GET of an object of the same
//!   size with `object_store`, GB/s;
//! * `s3_reread`: the same file read again, warm (in the cache), vs the cold read, GB/s;
//! * `s3_randwrite_4k`: 1,000 random 4 KiB writes to the file, then one sync: bytes uploaded
//!   per byte written, vs rewriting the whole object (the file size per sync), lower is
//!   better.
//!
//! No added latency: the server is on this host (a proxy adding a realistic per-request
//! latency, as the issue asks, is not built yet).

use super::Ctx;
use crate::report::{Better, Record};
use crate::util::*;
use object_store::ObjectStoreExt;
use std::sync::Arc;
use ubc_stack::layer::s3::{S3, S3Options};
use ubc_stack::{OpenOptions, Stack};

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let (Ok(endpoint), Ok(bucket)) = (std::env::var("UBC_BENCH_S3_ENDPOINT"), std::env::var("UBC_BENCH_S3_BUCKET"))
    else {
        eprintln!("s3: no server (UBC_BENCH_S3_ENDPOINT; scripts/bench starts one): skipped");
        return vec![];
    };
    let len = ctx.scale(256 * MIB, 64 * MIB) as usize;
    let prefix = format!("bench-{}", std::process::id());
    let mut data = vec![0u8; len];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for c in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
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
    let store = object_store::aws::AmazonS3Builder::from_env()
        .with_bucket_name(&bucket)
        .with_region("us-east-1")
        .with_endpoint(&endpoint)
        .with_allow_http(true)
        .build()
        .expect("client");
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
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
    let what =
        format!("{} MiB file, {} KiB chunks, s3s-fs on this host, no added latency", len >> 20, opts.chunk_size >> 10);
    vec![
        Record::from_samples(
            "s3_seqread_cold",
            "GB/s",
            Better::Higher,
            &cold,
            &base,
            "one streaming GET (object_store)",
            &format!("{what}; 1 MiB read_at through a fresh cache; {note}; target >= 1.5x"),
        ),
        Record::from_samples(
            "s3_reread",
            "GB/s",
            Better::Higher,
            &warm,
            &cold,
            "the cold read through ubc",
            &format!("{what}; the second read of the file through the same cache; target >= 20x"),
        ),
        Record::from_samples(
            "s3_randwrite_4k",
            "bytes uploaded / byte written",
            Better::Lower,
            &[uploaded / written],
            &[len as f64 / written],
            "rewriting the whole object",
            &format!("{what}; 1,000 random 4 KiB writes, then one sync"),
        ),
    ]
}

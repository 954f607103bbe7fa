//! The real servers some tests need (issue 21) — an S3 server and etcd, which
//! `./scripts/test` starts and names in the environment — and the helpers those tests share.
//! Without a server a test says it skipped, unless the matching `*_REQUIRED=1` is set (the
//! test script's runs), where that is a failure.

use rand::{RngExt, SeedableRng, rngs::StdRng};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A test's servers are missing: `None` (the test skips), or a failure when the test
/// script's `required` variable says they must be there.
fn missing<T>(test: &str, required: &str, what: &str) -> Option<T> {
    assert!(std::env::var(required).as_deref() != Ok("1"), "{test}: {required}=1 but no {what}");
    eprintln!("SKIP {test}: no {what} (run ./scripts/test, which starts it)");
    None
}

/// The S3 server and bucket (`UBC_TEST_S3_ENDPOINT`, `UBC_TEST_S3_BUCKET`), or `None`
/// (skipped; a failure under `UBC_TEST_S3_REQUIRED=1`).
pub fn s3_server(test: &str) -> Option<(String, String)> {
    match (std::env::var("UBC_TEST_S3_ENDPOINT"), std::env::var("UBC_TEST_S3_BUCKET")) {
        (Ok(e), Ok(b)) => Some((e, b)),
        _ => missing(test, "UBC_TEST_S3_REQUIRED", "S3 server (UBC_TEST_S3_ENDPOINT)"),
    }
}

/// An S3 server and an etcd (`UBC_TEST_ETCD` as well).
pub struct SharedEnv {
    pub s3: String,
    pub bucket: String,
    pub etcd: String,
}

impl SharedEnv {
    /// Both servers, or `None` (skipped; a failure under `UBC_TEST_ETCD_REQUIRED=1`).
    pub fn get(test: &str) -> Option<SharedEnv> {
        match (
            std::env::var("UBC_TEST_S3_ENDPOINT"),
            std::env::var("UBC_TEST_S3_BUCKET"),
            std::env::var("UBC_TEST_ETCD"),
        ) {
            (Ok(s3), Ok(bucket), Ok(etcd)) => Some(SharedEnv { s3, bucket, etcd }),
            _ => missing(test, "UBC_TEST_ETCD_REQUIRED", "S3 server or etcd (UBC_TEST_S3_ENDPOINT, UBC_TEST_ETCD)"),
        }
    }

    /// The spec of one shared file system (64 KiB chunks); `etcd` may be a proxy's URL.
    pub fn spec(&self, prefix: &str, etcd: &str, extra: &str) -> String {
        format!("s3:{}/{prefix}?endpoint={}&chunk=64K&etcd={etcd}{extra}", self.bucket, self.s3)
    }
}

/// A key prefix no other test (or earlier run) uses.
pub fn fresh_prefix(test: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{test}-{}-{t}-{}", std::process::id(), N.fetch_add(1, Relaxed))
}

/// `len` random bytes from `seed`, none of them zero (so a hole read back shows).
pub fn nonzero_data(seed: u64, len: usize) -> Vec<u8> {
    let mut r = StdRng::seed_from_u64(seed);
    (0..len).map(|_| r.random::<u8>() | 1).collect()
}

/// Equal, or a failure naming the first differing byte (not megabytes of both).
#[track_caller]
pub fn same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("{what}: first difference at byte {i}: got {:#04x}, want {:#04x}", got[i], want[i]);
    }
}

//! Mach's pager-to-cache requests (`Pager::init` hands a pager its `PagerRequest`):
//! `pager_clean_request` writes the cached changes back, `pager_flush_request` destroys the
//! cached copy (mappings included) so the next access asks the pager — what a pager needs
//! when another party changes or needs its data. A real host file under a pager that only
//! keeps the request it was given.

#[macro_use]
mod common;
use common::*;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, OnceLock};
use ubc::pager::FilePager;
use ubc::{Access, Cache, Pager, PagerRequest, Sharing};

/// A host file's pager that keeps the request the cache hands it.
struct Keeping {
    inner: FilePager,
    request: OnceLock<PagerRequest>,
}

impl Pager for Keeping {
    forward_to!(inner: get_pages, put_pages, len, set_len, sync);
    fn init(&self, request: PagerRequest) {
        self.request.set(request).expect("init once per object");
    }
    fn is_writable(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        "keeping its request".into()
    }
}

fn keeping(path: &std::path::Path) -> Arc<Keeping> {
    Arc::new(Keeping { inner: FilePager::open(path, Access::ReadWrite).unwrap(), request: OnceLock::new() })
}

#[test]
fn a_flush_request_drops_the_cached_copy_and_mappings_read_the_store_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    std::fs::write(&path, pattern(1, 0, 64 << 10)).unwrap();
    let cache = Cache::new(16 << 20).unwrap();
    let p = keeping(&path);
    let f = cache.open(p.clone(), Access::ReadWrite).unwrap();
    let req = p.request.get().expect("the cache called init").clone();
    let m = f.map(0..64 << 10, Access::ReadOnly, Sharing::Shared).unwrap();
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, 8192).unwrap();
    assert_eq!(m[8192], byte_at(1, 8192));
    // Another party changes the stored bytes: the cache does not know.
    let host = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    host.write_all_at(b"changed!", 8192).unwrap();
    f.read_exact_at(&mut b, 8192).unwrap();
    assert_eq!(b, pattern(1, 8192, 8)[..], "the cache kept its copy");
    // The pager tells the cache.
    req.flush(0..64 << 10).unwrap();
    f.read_exact_at(&mut b, 8192).unwrap();
    assert_eq!(&b, b"changed!", "a read after the flush request");
    assert_eq!(&m[8192..8200], b"changed!", "the mapping after the flush request");
}

#[test]
fn a_clean_request_writes_the_changes_back_and_keeps_the_pages() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    std::fs::write(&path, vec![0u8; 64 << 10]).unwrap();
    let cache = Cache::new(16 << 20).unwrap();
    let p = keeping(&path);
    let f = cache.open(p.clone(), Access::ReadWrite).unwrap();
    let req = p.request.get().unwrap().clone();
    f.write_at(b"written", 100).unwrap();
    assert!(f.stats().dirty_bytes > 0);
    req.clean(0..4096).unwrap();
    assert_eq!(&std::fs::read(&path).unwrap()[100..107], b"written");
    let st = f.stats();
    assert_eq!(st.dirty_bytes, 0);
    assert!(st.resident_bytes >= 4096, "a clean request keeps the pages: {st:?}");
    // Once the cache lets the object go, requests do nothing.
    assert!(req.is_cached());
    f.close().unwrap();
    drop(f);
    cache.evict_all().unwrap();
    drop(cache);
    assert!(!req.is_cached());
    req.clean(0..4096).unwrap();
    req.flush_reload(0..4096).unwrap();
}

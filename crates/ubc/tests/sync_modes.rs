//! `fdatasync` and `fsync` (`File::sync`, `File::sync_all`), and `O_DSYNC`/`O_SYNC` writes
//! (`File::set_write_sync`, TLPI 13.3): what each makes durable, checked in the host file
//! and at the pager (its syncs counted and failed on cue by the fault injector).

mod common;
use common::*;
use std::sync::Arc;
use ubc::pager::{FilePager, InjectingPager};
use ubc::{Access, Cache, WriteSync};

/// A host file at `path` behind a fault injector (which counts the pager's syncs).
fn injected_host_file(cache: &Cache, path: &std::path::Path) -> (ubc::File, Arc<InjectingPager>) {
    std::fs::write(path, b"").unwrap();
    let host = FilePager::open(path, Access::ReadWrite).unwrap();
    let fault = Arc::new(InjectingPager::new(Arc::new(host)));
    (cache.open(fault.clone(), Access::ReadWrite).unwrap(), fault)
}

#[test]
fn a_dsync_write_is_in_the_host_file_and_synced_when_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let cache = Cache::new(16 << 20).unwrap();
    let (f, fault) = injected_host_file(&cache, &path);
    f.set_write_sync(WriteSync::Data).unwrap();
    let data = pattern(1, 0, 100_000);
    let syncs = fault.injector().counts().syncs;
    f.write_at(&data, 5000).unwrap();
    assert_eq!(f.stats().dirty_bytes, 0, "an O_DSYNC write left dirty pages");
    assert!(fault.injector().counts().syncs > syncs, "an O_DSYNC write did not sync the pager");
    let host = std::fs::read(&path).unwrap();
    assert_eq!(host.len(), 105_000, "the length is part of the data's integrity");
    assert_same(&host[5000..], &data, "host file after an O_DSYNC write");
    // Another handle of the file writes as before: into the cache only.
    let g = f.try_clone().unwrap();
    g.write_at(b"cached", 0).unwrap();
    assert!(f.stats().dirty_bytes > 0, "a plain handle's write was synced");
}

#[test]
fn a_failed_sync_write_returns_the_error_and_keeps_the_bytes_dirty() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let cache = Cache::new(16 << 20).unwrap();
    let (f, fault) = injected_host_file(&cache, &path);
    f.set_write_sync(WriteSync::All).unwrap();
    fault.injector().fail_writes(Some(libc::ENOSPC));
    let e = f.write_at(b"no room", 0).expect_err("an O_SYNC write whose writeback fails");
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
    let mut b = [0u8; 7];
    f.read_exact_at(&mut b, 0).unwrap();
    assert_eq!(&b, b"no room", "the bytes are in the cache");
    assert!(f.stats().dirty_bytes > 0, "and dirty");
    fault.injector().heal();
    // The handle heard of the failure from its write: its sync is not told again.
    f.sync().unwrap();
    assert_eq!(&std::fs::read(&path).unwrap()[..], b"no room");
}

#[test]
fn a_dsync_write_whose_sync_fails_is_told_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let cache = Cache::new(16 << 20).unwrap();
    let (f, fault) = injected_host_file(&cache, &path);
    let other = f.try_clone().unwrap();
    f.set_write_sync(WriteSync::Data).unwrap();
    fault.injector().fail_syncs(Some(libc::EIO));
    assert!(f.write_at(b"maybe lost", 0).is_err(), "the O_DSYNC write's failed sync is its error");
    fault.injector().heal();
    f.sync().expect("the writer was told already");
    // Another handle hears of the lost sync once — here from a synchronous write of its own,
    // as Linux's `generic_write_sync` reports it.
    other.set_write_sync(WriteSync::Data).unwrap();
    assert!(other.write_at(b"later", 100).is_err(), "another handle hears of the lost sync");
    other.write_at(b"later", 100).unwrap();
    other.sync().unwrap();
}

#[test]
fn sync_all_also_syncs_the_metadata_and_sync_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let cache = Cache::new(16 << 20).unwrap();
    let (f, fault) = injected_host_file(&cache, &path);
    f.write_at(b"data", 0).unwrap();
    f.sync().unwrap();
    // Nothing new: `sync` has nothing to do, `sync_all` still asks for the metadata.
    let before = fault.injector().counts().syncs;
    f.sync().unwrap();
    assert_eq!(fault.injector().counts().syncs, before, "a sync of an unchanged file reached the pager");
    f.sync_all().unwrap();
    assert_eq!(fault.injector().counts().syncs, before + 1, "sync_all did not sync the metadata");
    // A failing metadata sync is an error (every handle hears of it, as of a failed sync).
    fault.injector().fail_syncs(Some(libc::EIO));
    assert!(f.sync_all().is_err());
    fault.injector().heal();
    f.write_at(b"DATA", 0).unwrap();
    f.sync_all().unwrap();
    assert_eq!(&std::fs::read(&path).unwrap()[..], b"DATA");
}

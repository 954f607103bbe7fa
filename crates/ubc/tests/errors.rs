//! Errors reach the caller with their cause; a failed writeback never drops data.

#[macro_use]
mod common;
use common::*;
use std::sync::Arc;
use ubc::pager::{InjectingPager, MemPager};
use ubc::{Access, Cache, Error, Pager, PagerOp};

#[test]
fn read_error_reaches_read_at_and_leaves_nothing_behind() {
    let cache = small_cache(1 << 20);
    let (f, fault, mem) = injected_file(&cache);
    mem.put_pages(0, &pattern(1, 0, 65536)).unwrap();
    // The object was opened when the store was empty: reopen to see the length.
    drop(f);
    let f = cache.open(fault.clone(), Access::ReadWrite).unwrap();
    assert_eq!(f.len().unwrap(), 65536);
    fault.fail_reads(Some(libc::EIO));
    let mut buf = vec![0u8; 8192];
    let err = f.read_at(&mut buf, 4096).unwrap_err();
    match &err {
        Error::Io { op: PagerOp::GetPages, offset: 4096, source, .. } => {
            assert_eq!(source.raw_os_error(), Some(libc::EIO))
        }
        e => panic!("unexpected error {e:?}"),
    }
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    assert!(err.to_string().contains("reading pages at offset 4096"), "{err}");
    assert_eq!(f.stats().resident_bytes, 0, "failed fill leaves no page behind");
    assert_eq!(cache.stats().allocated_bytes, 0, "and no memory");
    // Partial-page write needs a read-modify-write: it fails the same way.
    assert!(matches!(f.write_at(b"x", 10), Err(Error::Io { op: PagerOp::GetPages, .. })));
    // Healed: the same read succeeds.
    fault.heal();
    f.read_exact_at(&mut buf, 4096).unwrap();
    assert_same(&buf, &pattern(1, 4096, 8192), "after healing");
}

#[test]
fn failed_writeback_keeps_pages_dirty_until_the_pager_recovers() {
    let cache = small_cache(1 << 20);
    let (f, fault, mem) = injected_file(&cache);
    let data = pattern(7, 0, 40_000);
    f.write_at(&data, 0).unwrap();
    fault.fail_writes(Some(libc::ENOSPC));
    let err = f.sync().unwrap_err();
    assert!(matches!(&err, Error::Io { op: PagerOp::PutPages, .. }), "{err:?}");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
    assert_eq!(f.stats().dirty_bytes, 40_000u64.div_ceil(4096) * 4096, "every page still dirty");
    assert_eq!(mem.stored_bytes(), 0, "nothing reached the store");
    // Eviction cannot drop dirty pages it cannot write: evict_all reports the error.
    assert!(cache.evict_all().is_err());
    let mut back = vec![0u8; 40_000];
    f.read_at(&mut back, 0).unwrap();
    assert_same(&back, &data, "data still in the cache");
    // Recovery: the next sync writes everything.
    fault.heal();
    f.sync().unwrap();
    assert_eq!(f.stats().dirty_bytes, 0);
    assert_same(&store_contents(&*mem), &data, "store after recovery");
}

#[test]
fn writeback_error_under_memory_pressure_loses_nothing() {
    // A budget far smaller than the data: reclaim must write back to make room, and the
    // pager fails transiently. Every byte must still arrive.
    let cache = Cache::builder().budget(64 << 10).reserve_timeout(std::time::Duration::from_secs(2)).build().unwrap();
    let (f, fault, mem) = injected_file(&cache);
    fault.fail_writes(Some(libc::EIO));
    fault.fail_only_next(3);
    let data = pattern(11, 0, 1 << 20);
    let mut off = 0;
    while off < data.len() {
        // A write may be cut short by the error that kept reclaim from making room.
        match f.write_at(&data[off..(off + 50_000).min(data.len())], off as u64) {
            Ok(n) => off += n,
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}"),
        }
    }
    f.sync().unwrap();
    assert!(fault.counts().failures >= 3);
    assert_same(&store_contents(&*mem), &data, "store");
    assert!(f.stats().writeback_errors >= 1);
}

#[test]
fn sync_error_is_reported_and_retried() {
    let cache = small_cache(1 << 20);
    let (f, fault, _mem) = injected_file(&cache);
    f.write_at(b"abc", 0).unwrap();
    fault.fail_syncs(Some(libc::EIO));
    assert!(matches!(f.sync(), Err(Error::Io { op: PagerOp::Sync, .. })));
    fault.heal();
    f.sync().unwrap();
}

#[test]
fn set_len_error_is_reported() {
    let cache = small_cache(1 << 20);
    let (f, fault, _mem) = injected_file(&cache);
    fault.fail_set_len(Some(libc::EIO));
    assert!(matches!(f.set_len(100), Err(Error::Io { op: PagerOp::SetLen, offset: 100, .. })));
    fault.heal();
    // sync reconciles the stored length.
    f.sync().unwrap();
}

#[test]
fn argument_and_handle_errors_are_typed() {
    let cache = small_cache(1 << 20);
    let f = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    let mut b = [0u8; 10];
    let max = (i64::MAX as u64) & !0xffff; // the largest supported length: 2^63 - 64 KiB
    assert!(matches!(f.read_at(&mut b, max), Err(Error::OffsetOverflow { .. })));
    assert!(matches!(f.read_at(&mut b, 1 << 63), Err(Error::OffsetOverflow { .. })));
    assert!(matches!(f.write_at(b"x", max), Err(Error::OffsetOverflow { .. })));
    assert!(matches!(f.write_at(b"x", u64::MAX), Err(Error::OffsetOverflow { .. })));
    assert!(matches!(f.set_len(max + 1), Err(Error::OffsetOverflow { .. })));
    assert!(matches!(f.window(u64::MAX - 1, 10), Err(Error::OffsetOverflow { .. })));
    // The last byte before 2^63 - 1 is fine.
    f.write_at(b"z", max - 1).unwrap();
    assert_eq!(f.len().unwrap(), max);
    let mut z = [0u8; 1];
    f.read_exact_at(&mut z, max - 1).unwrap();
    assert_eq!(&z, b"z");

    let ro = cache.open(Arc::new(MemPager::new()), Access::ReadOnly).unwrap();
    assert!(matches!(ro.write_at(b"x", 0), Err(Error::ReadOnly)));
    assert!(matches!(ro.set_len(0), Err(Error::ReadOnly)));
    assert!(matches!(ro.window_mut(0, 1), Err(Error::ReadOnly)));

    let g = f.try_clone().unwrap();
    g.close().unwrap();
    assert!(matches!(g.read_at(&mut b, 0), Err(Error::Closed)));
    assert!(matches!(g.write_at(b"x", 0), Err(Error::Closed)));
    assert!(matches!(g.sync(), Err(Error::Closed)));
    assert!(matches!(g.len(), Err(Error::Closed)));
    assert!(matches!(g.close(), Err(Error::Closed)));
    // The other handle is unaffected.
    f.read_exact_at(&mut z, max - 1).unwrap();

    // io adapters carry the error through std::io::Error.
    let ioe: std::io::Error = Error::ReadOnly.into();
    assert_eq!(ioe.kind(), std::io::ErrorKind::PermissionDenied);
    assert!(ioe.get_ref().unwrap().downcast_ref::<Error>().is_some());
}

#[test]
fn bad_configuration_is_rejected() {
    for b in [
        Cache::builder().budget(4096),
        Cache::builder().budget(0),
        Cache::builder().page_size(0),
        Cache::builder().page_size(3000),
        Cache::builder().page_size(2048),
        Cache::builder().window_size(4096 * 3),
        Cache::builder().page_size(1 << 16).window_size(1 << 15),
    ] {
        assert!(matches!(b.build(), Err(Error::InvalidArgument(_))));
    }
    let e = Cache::builder().budget(100).build().err().unwrap();
    assert!(e.to_string().contains("smaller than two pages"), "{e}");
}

#[test]
fn opening_a_missing_file_names_it() {
    let cache = small_cache(1 << 20);
    let e = cache.open_path("/nonexistent/ubc-test", Access::ReadOnly).unwrap_err();
    assert!(matches!(e, Error::Open { .. }));
    assert!(e.to_string().contains("/nonexistent/ubc-test"), "{e}");
    assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
}

#[test]
fn window_larger_than_budget_is_an_error_not_a_hang() {
    let cache = Cache::builder().budget(8 * 4096).window_size(1 << 20).build().unwrap();
    let f = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    f.set_len(1 << 20).unwrap();
    let e = f.window(0, 1 << 20).err().unwrap();
    assert!(matches!(e, Error::BudgetExceeded { .. }), "{e:?}");
}

/// A truncation while the store fails and the cache is at its dirty limit still zeroes the
/// tail of the last page and truncates the store: the old bytes past the new end never come
/// back when the file grows again. (Before: zeroing the tail waited for a dirty slot, got
/// the store's error, and `set_len` returned before truncating the store.)
#[test]
fn truncate_at_the_dirty_limit_with_a_failing_store_loses_no_zeroing() {
    let cache = Cache::builder().budget(8 * 4096).daemon(false).build().unwrap();
    let mem = Arc::new(MemPager::new());
    let fault = Arc::new(ubc::pager::InjectingPager::new(mem.clone()));
    let f = cache.open(fault.clone(), Access::ReadWrite).unwrap();
    f.write_at(&[0xAA; 3 * 4096], 0).unwrap();
    f.sync().unwrap();
    fault.fail_writes(Some(libc::EIO));
    // Fill the dirty limit (2 pages for an 8-page budget) with pages that cannot be cleaned.
    f.write_at(&[0xBB; 2 * 4096], 0).unwrap();
    let cut = 2 * 4096 + 100;
    let r = f.set_len(cut);
    // However set_len reports, the length is cut and the bytes past it are gone.
    assert_eq!(f.len().unwrap(), cut);
    assert!(mem.len().unwrap() <= 3 * 4096);
    fault.heal();
    let _ = r;
    f.write_at(b"end", 5 * 4096).unwrap();
    f.sync().unwrap();
    let mut tail = vec![0xFFu8; 5 * 4096 - cut as usize];
    f.read_exact_at(&mut tail, cut).unwrap();
    assert!(tail.iter().all(|&b| b == 0), "old bytes past the cut came back");
    let mut stored = vec![0u8; 5 * 4096 + 3];
    mem.get_pages(0, &mut stored[..5 * 4096]).unwrap();
    assert!(stored[cut as usize..5 * 4096].iter().all(|&b| b == 0), "old bytes past the cut in the store");
}

/// A fill that finds the budget full of one file's dirty pages, whose writeback fails for a
/// moment, and pages pinned by another, waits for room instead of failing: a read of a third
/// file, which has no error of its own, succeeds once the store recovers. (Before, the first
/// failed writeback in reclaim failed the fill at once: the read got EIO, and a store
/// through a mapping that needed the page got SIGBUS — `tests/stats.rs` died of it in CI.)
#[test]
fn a_fill_waits_out_another_files_transient_writeback_failure() {
    let cache = Cache::builder()
        .budget(16 * 4096)
        .reserve_timeout(std::time::Duration::from_secs(1))
        .daemon(false)
        .build()
        .unwrap();
    let (a, fault, _) = injected_file(&cache);
    fault.fail_writes(Some(libc::EIO));
    // A's dirty pages up to the dirty limit, none of which can leave.
    let mut dirty = 0;
    while a.write_at(&[1u8; 4096], dirty * 4096).is_ok() {
        dirty += 1;
        assert!(dirty < 16, "the dirty limit stops a writer whose pages cannot be written");
    }
    assert!(dirty > 0);
    // B's pinned pages take the rest; the window that finds no room fails with A's error.
    let b_store = Arc::new(MemPager::new());
    b_store.put_pages(0, &[2u8; 16 * 4096]).unwrap();
    let b = cache.open(b_store, Access::ReadOnly).unwrap();
    let mut windows = Vec::new();
    let e = loop {
        match b.window(windows.len() as u64 * 4096, 4096) {
            Ok(w) => windows.push(w),
            Err(e) => break e,
        }
    };
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "after the timeout, the error that kept pages: {e:?}");
    // C needs a page; A's store recovers while C waits.
    let c_store = Arc::new(MemPager::new());
    c_store.put_pages(0, &pattern(3, 0, 4096)).unwrap();
    let c = cache.open(c_store, Access::ReadOnly).unwrap();
    let healer = std::thread::spawn({
        let fault = fault.clone();
        move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            fault.heal();
        }
    });
    let mut buf = vec![0u8; 4096];
    let r = c.read_at(&mut buf, 0);
    healer.join().unwrap();
    assert_eq!(r.unwrap(), 4096, "the read waited for room");
    assert_same(&buf, &pattern(3, 0, 4096), "C's page");
    drop(windows);
    a.sync().unwrap();
}

// ---- every handle hears of a writeback failure (errseq, "fsyncgate") ----

fn is_lost(r: ubc::Result<()>, errno: i32) -> bool {
    matches!(&r, Err(e @ Error::WritebackFailed { lost: true, .. }) if e.raw_os_error() == Some(errno))
}

#[test]
fn a_failed_pager_sync_reaches_every_handle_once() {
    // The PostgreSQL 2018 case: one fsync fails, the kernel forgets, the next fsync
    // succeeds. Every handle that may have data in the file must hear of it.
    let cache = small_cache(1 << 20);
    let (a, fault, _mem) = injected_file(&cache);
    let b = a.try_clone().unwrap();
    let c = a.reopen(Access::ReadOnly).unwrap();
    a.write_at(b"first", 0).unwrap();
    b.write_at(b"second", 4096).unwrap();
    fault.fail_syncs(Some(libc::EIO));
    fault.fail_only_next(1);
    assert!(matches!(a.sync(), Err(Error::Io { op: PagerOp::Sync, .. })), "the caller gets the error itself");
    assert_eq!(fault.counts().failures, 1);
    // The pager's sync works again, but b and c were not told: each hears once.
    let e = b.sync().unwrap_err();
    assert!(matches!(e, Error::WritebackFailed { lost: true, op: PagerOp::Sync, .. }), "{e:?}");
    assert!(e.to_string().contains("data may be lost"), "{e}");
    b.sync().unwrap();
    assert!(is_lost(c.close(), libc::EIO), "a read-only handle hears of it at close");
    a.sync().unwrap();
    // Everyone was told: a new handle starts clean.
    let d = a.try_clone().unwrap();
    d.sync().unwrap();
    d.close().unwrap();
}

#[test]
fn a_failed_sync_nobody_was_told_of_reaches_the_next_opener() {
    let cache = small_cache(1 << 20);
    let (a, fault, _mem) = injected_file(&cache);
    a.write_at(b"data", 0).unwrap();
    // A cache-wide sync fails: no handle got that error.
    fault.fail_syncs(Some(libc::EIO));
    fault.fail_only_next(1);
    assert!(cache.sync_all().is_err());
    let b = a.try_clone().unwrap();
    assert!(is_lost(b.sync(), libc::EIO), "the first handle to look is told");
    assert!(is_lost(a.sync(), libc::EIO), "and every handle open at the time");
    let c = a.try_clone().unwrap();
    c.sync().unwrap();
}

#[test]
fn a_background_writeback_failure_is_reported_at_close_while_the_data_is_still_dirty() {
    let cache = small_cache(1 << 20);
    let (writer, fault, mem) = injected_file(&cache);
    let other = writer.try_clone().unwrap();
    let reader = writer.reopen(Access::ReadOnly).unwrap();
    writer.write_at(&pattern(3, 0, 8192), 0).unwrap();
    fault.fail_writes(Some(libc::ENOSPC));
    // Someone else's writeback fails (as the flusher's would): the writer was not there.
    assert!(matches!(other.clean(0..8192), Err(Error::Io { op: PagerOp::PutPages, .. })));
    assert_eq!(writer.stats().dirty_bytes, 8192, "pages stay dirty");
    let e = writer.close().unwrap_err();
    assert!(matches!(e, Error::WritebackFailed { lost: false, op: PagerOp::PutPages, .. }), "{e:?}");
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
    assert!(matches!(writer.read_at(&mut [0u8; 1], 0), Err(Error::Closed)), "closed anyway");
    // A read-only handle cannot have data in the pages: its close is clean.
    reader.close().unwrap();
    // Nothing was lost: the disk gets space, a sync writes the pages.
    fault.heal();
    other.sync().unwrap();
    assert_same(&store_contents(&*mem)[..8192], &pattern(3, 0, 8192), "store after recovery");
}

#[test]
fn a_writeback_failure_later_retried_successfully_is_not_an_error() {
    let cache = small_cache(1 << 20);
    let (a, fault, mem) = injected_file(&cache);
    let b = a.try_clone().unwrap();
    a.write_at(&pattern(4, 0, 4096), 0).unwrap();
    fault.fail_writes(Some(libc::EIO));
    fault.fail_only_next(1);
    assert!(b.clean(0..4096).is_err());
    // a's sync retries the page and succeeds: nothing was lost, nothing to report.
    a.sync().unwrap();
    assert_same(&store_contents(&*mem)[..4096], &pattern(4, 0, 4096), "store");
    a.close().unwrap();
    b.close().unwrap();
}

/// Under `ulimit -f` (a finite `RLIMIT_FSIZE`), ubc sized its memfds to 2^63 anyway and the
/// kernel killed the process with SIGXFSZ at its first file. The limit now bounds the file
/// offsets ubc accepts: below it everything works (writes, new pages filled with `pwrite`,
/// mappings, sync to a real file), at or past it calls fail with `OffsetOverflow` (EFBIG).
/// Runs in a child process with the limit set before `exec` (the limit is read once).
#[test]
fn a_file_size_limit_is_an_error_past_it_not_a_signal() {
    const LIMIT: u64 = 4 << 20;
    if is_child("fsize") {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::builder().budget(8 << 20).build().unwrap();
        let f = cache.create_path(dir.path().join("f")).unwrap();
        let data = vec![0x5au8; 1 << 20];
        f.write_at(&data, 0).unwrap();
        f.write_at(&data, LIMIT - (1 << 20)).unwrap(); // up to the limit exactly
        let past = f.write_at(b"x", LIMIT).unwrap_err();
        assert!(
            matches!(past, ubc::Error::OffsetOverflow { .. }) && past.raw_os_error() == Some(libc::EFBIG),
            "{past}"
        );
        assert!(matches!(f.set_len(LIMIT + 1), Err(ubc::Error::OffsetOverflow { .. })));
        let m = f.map(0..LIMIT, Access::ReadOnly, ubc::Sharing::Shared).unwrap();
        assert_eq!(m[LIMIT as usize - 1], 0x5a);
        assert_eq!(m[2 << 20], 0);
        drop(m);
        f.sync().unwrap();
        assert_eq!(std::fs::metadata(dir.path().join("f")).unwrap().len(), LIMIT);
        let mut back = vec![0u8; 1 << 20];
        f.read_exact_at(&mut back, LIMIT - (1 << 20)).unwrap();
        assert_eq!(back, data);
        return;
    }
    in_child_with_limit(
        "a_file_size_limit_is_an_error_past_it_not_a_signal",
        "fsize",
        libc::RLIMIT_FSIZE,
        LIMIT,
        libc::RLIM_INFINITY,
    );
}

/// A short file read with `read_exact_at` is an end-of-file error naming where the file
/// ends, not a pager failure: nothing went wrong with the store.
#[test]
fn read_exact_past_the_end_is_unexpected_eof_not_a_pager_error() {
    let cache = small_cache(1 << 20);
    let f = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    f.write_at(&pattern(3, 0, 5000), 0).unwrap();
    let mut buf = vec![0u8; 4096];
    f.read_exact_at(&mut buf, 0).unwrap();
    let err = f.read_exact_at(&mut buf, 2000).unwrap_err();
    assert!(matches!(err, Error::UnexpectedEof { offset: 5000, .. }), "{err:?}");
    assert_eq!(err.raw_os_error(), None, "no OS error behind it");
    assert_eq!(std::io::Error::from(err).kind(), std::io::ErrorKind::UnexpectedEof);
    // The bytes that were there were read.
    assert_eq!(&buf[..3000], &pattern(3, 2000, 3000)[..]);
}

/// Memory underneath, in a "file system" shared with other instances: `sync_fs` syncs the
/// file system (`fs`: counted, failing on cue), `sync` this store alone (`store`: the same).
/// Both are fault injectors over memory.
struct OnSharedFs {
    mem: Arc<MemPager>,
    store: InjectingPager,
    fs: Arc<InjectingPager>,
}

impl Pager for OnSharedFs {
    forward_to!(store: get_pages, put_pages, len, set_len, sync);
    fn sync_domain(&self) -> Option<u64> {
        Some(7)
    }
    fn sync_fs(&self) -> std::io::Result<()> {
        self.fs.sync()
    }
    fn domain_syncer(&self) -> Option<ubc::pager::DomainSyncer> {
        let fs = self.fs.clone();
        Some(Arc::new(move || fs.sync()))
    }
    fn describe(&self) -> String {
        "memory on a shared file system".into()
    }
}

fn files_on_one_fs(cache: &Cache, n: usize) -> (Vec<ubc::File>, Vec<Arc<OnSharedFs>>, Arc<InjectingPager>) {
    let fs = Arc::new(InjectingPager::new(Arc::new(MemPager::new())));
    let pagers: Vec<Arc<OnSharedFs>> = (0..n)
        .map(|_| {
            let mem = Arc::new(MemPager::new());
            Arc::new(OnSharedFs { store: InjectingPager::new(mem.clone()), mem, fs: fs.clone() })
        })
        .collect();
    let files = pagers.iter().map(|p| cache.open(p.clone(), Access::ReadWrite).unwrap()).collect();
    (files, pagers, fs)
}

#[test]
fn sync_all_syncs_a_file_system_once_and_finds_out_whose_data_a_failed_syncfs_was() {
    let cache = small_cache(8 << 20);
    let (files, pagers, fs) = files_on_one_fs(&cache, 40);
    for (i, f) in files.iter().enumerate() {
        f.write_at(&pattern(i as u64, 0, 5000), 0).unwrap();
    }
    cache.sync_all().unwrap();
    assert_eq!(fs.counts().syncs, 1, "one syncfs for the 40 files of one file system");
    assert!(pagers.iter().all(|p| p.store.counts().syncs == 0), "and no sync of each");
    for (i, p) in pagers.iter().enumerate() {
        assert_same(&store_contents(&*p.mem), &pattern(i as u64, 0, 5000), "a store after sync_all");
    }

    // The syncfs fails, and so does the sync of file 3 alone: sync_all fails, every pager is
    // then synced on its own, and only file 3's handles hear of a lost write.
    for (i, f) in files.iter().enumerate() {
        f.write_at(&pattern(100 + i as u64, 0, 100), 8192).unwrap();
    }
    fs.fail_syncs(Some(libc::EIO));
    pagers[3].store.fail_syncs(Some(libc::EIO));
    assert!(cache.sync_all().is_err());
    assert_eq!(fs.counts().syncs, 2);
    assert!(pagers.iter().all(|p| p.store.counts().syncs == 1), "each pager synced on its own after the failed syncfs");
    fs.fail_syncs(None);
    pagers[3].store.fail_syncs(None);
    assert!(is_lost(files[3].sync(), libc::EIO), "file 3's handle is told");
    for (i, f) in files.iter().enumerate().filter(|&(i, _)| i != 3) {
        f.sync().unwrap_or_else(|e| panic!("file {i} was not the one whose sync failed: {e}"));
    }
}

#[test]
fn sync_all_syncs_a_few_files_of_a_file_system_each_on_its_own() {
    let cache = small_cache(8 << 20);
    let (files, pagers, fs) = files_on_one_fs(&cache, 5);
    for f in &files {
        f.write_at(b"x", 0).unwrap();
    }
    cache.sync_all().unwrap();
    assert_eq!(fs.counts().syncs, 0, "a syncfs writes everything dirty on the file system: not for 5 files");
    assert!(pagers.iter().all(|p| p.store.counts().syncs == 1));
}

/// A file written back and dropped from the cache before any sync — its pages written and
/// evicted, its last handle closed, so the cache forgets it — is still made durable by the
/// next `sync_all`: its file system is synced (as the kernel's `sync` reaches an inode whose
/// pages it already dropped). Before, that `sync_all` did not know the file any more and
/// synced nothing. A failed sync keeps it for the next; a sync after it has nothing left.
#[test]
fn sync_all_syncs_the_file_system_of_a_file_forgotten_before_its_sync() {
    let cache = small_cache(8 << 20);
    let (files, pagers, fs) = files_on_one_fs(&cache, 1);
    let f = files.into_iter().next().unwrap();
    f.write_at(&pattern(9, 0, 3 * 4096), 0).unwrap();
    f.clean(0..u64::MAX).unwrap();
    assert_eq!(f.drop_clean(0..u64::MAX).unwrap(), 3, "every page written back and dropped");
    f.close().unwrap();
    assert_eq!(cache.stats().objects, 0, "the cache forgot the file");
    assert_same(&store_contents(&*pagers[0].mem), &pattern(9, 0, 3 * 4096), "the store");
    fs.fail_syncs(Some(libc::EIO));
    assert!(cache.sync_all().is_err(), "the file system's sync failed: sync_all says so");
    assert_eq!(fs.counts().syncs, 1);
    fs.fail_syncs(None);
    cache.sync_all().unwrap();
    assert_eq!(fs.counts().syncs, 2, "the failed sync was tried again");
    cache.sync_all().unwrap();
    assert_eq!(fs.counts().syncs, 2, "nothing left to sync");
    assert_eq!(pagers[0].store.counts().syncs, 0, "the file's own store was not synced");
    drop(f);
    assert_eq!(Arc::strong_count(&pagers[0]), 1, "nor kept: the test holds the only reference to its pager");
}

/// A file on a shared file system that takes unstable writes as a host file does through
/// the kernel's page cache: `put_pages_unstable` changes what readers of the store see at
/// once, but it becomes durable only at the next `sync_fs` (or `sync`); a `sync_fs` that
/// fails loses it — the store reads back what was durable — and the file's own next
/// `sync` reports that once (the kernel's per-file writeback error, `errseq`).
struct PageCacheModel {
    /// What readers of the store see.
    visible: MemPager,
    /// What a crash would leave.
    durable: parking_lot::Mutex<Vec<u8>>,
    /// Unstable writes not yet made durable, and a lost one not yet reported.
    pending: std::sync::atomic::AtomicBool,
    lost: std::sync::atomic::AtomicBool,
    committed: std::sync::atomic::AtomicU64,
    fs: Arc<ModelFs>,
}

/// The file system of [`PageCacheModel`] files: its `syncfs` fails on cue, and can be held
/// (it waits at `gate` twice: once when it starts, once before it returns).
#[derive(Default)]
struct ModelFs {
    files: parking_lot::Mutex<Vec<std::sync::Weak<PageCacheModel>>>,
    fail: std::sync::atomic::AtomicBool,
    syncs: std::sync::atomic::AtomicU64,
    /// Writes of its files' pages, unstable or not.
    puts: std::sync::atomic::AtomicU64,
    gate: parking_lot::Mutex<Option<Arc<std::sync::Barrier>>>,
}

impl ModelFs {
    fn syncfs(&self) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        self.syncs.fetch_add(1, SeqCst);
        let gate = self.gate.lock().clone();
        if let Some(g) = &gate {
            g.wait();
            g.wait();
        }
        let fail = self.fail.load(SeqCst);
        for f in self.files.lock().iter().filter_map(|f| f.upgrade()) {
            f.settle(fail);
        }
        if fail { Err(std::io::Error::from_raw_os_error(libc::EIO)) } else { Ok(()) }
    }
}

impl PageCacheModel {
    fn new(fs: &Arc<ModelFs>) -> Arc<PageCacheModel> {
        let f = Arc::new(PageCacheModel {
            visible: MemPager::new(),
            durable: Default::default(),
            pending: false.into(),
            lost: false.into(),
            committed: 0.into(),
            fs: fs.clone(),
        });
        fs.files.lock().push(Arc::downgrade(&f));
        f
    }

    /// Write back: the pending writes become durable, or are lost (and remembered as lost).
    fn settle(&self, fail: bool) {
        use std::sync::atomic::Ordering::SeqCst;
        if !self.pending.swap(false, SeqCst) {
            return;
        }
        let mut durable = self.durable.lock();
        if fail {
            self.visible.set_len(0).unwrap();
            self.visible.put_pages(0, &durable).unwrap();
            self.lost.store(true, SeqCst);
        } else {
            *durable = store_contents(&self.visible);
        }
    }
}

impl Pager for PageCacheModel {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<ubc::Fill> {
        self.visible.get_pages(offset, buf)
    }
    fn put_pages(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.visible.put_pages(offset, data)?;
        self.pending.store(true, std::sync::atomic::Ordering::SeqCst);
        self.fs.puts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn put_pages_unstable(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.put_pages(offset, data)
    }
    fn committed(&self) {
        self.committed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    fn len(&self) -> std::io::Result<u64> {
        self.visible.len()
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.visible.set_len(len)?;
        self.pending.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn sync(&self) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.lost.swap(false, SeqCst) {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        self.settle(false);
        Ok(())
    }
    fn sync_domain(&self) -> Option<u64> {
        Some(11)
    }
    fn sync_fs(&self) -> std::io::Result<()> {
        self.fs.syncfs()
    }
    fn describe(&self) -> String {
        "a file written through a modelled page cache".into()
    }
}

fn model_files(cache: &Cache, n: usize) -> (Vec<ubc::File>, Vec<Arc<PageCacheModel>>, Arc<ModelFs>) {
    let fs = Arc::new(ModelFs::default());
    let pagers: Vec<Arc<PageCacheModel>> = (0..n).map(|_| PageCacheModel::new(&fs)).collect();
    let files = pagers.iter().map(|p| cache.open(p.clone(), Access::ReadWrite).unwrap()).collect();
    (files, pagers, fs)
}

/// `Cache::sync_all` writes small files of one file system with unstable writes and one
/// `syncfs` (`writeback.rs`, "Unstable writes"). A `syncfs` that fails may have lost them:
/// the files whose data was lost hear of it, their pages are dirty again, and the next
/// `sync_all` stores and commits them — nothing is lost. (Without the pages made dirty
/// again, the second `sync_all` found nothing to write and the durable copy kept the old
/// bytes.)
#[test]
fn sync_all_writes_again_what_a_failed_syncfs_lost_of_its_unstable_writes() {
    let cache = small_cache(8 << 20);
    let (files, pagers, fs) = model_files(&cache, 20);
    for (i, f) in files.iter().enumerate() {
        f.write_at(&pattern(i as u64, 0, 5000), 0).unwrap();
    }
    cache.sync_all().unwrap();
    assert_eq!(fs.syncs.load(std::sync::atomic::Ordering::SeqCst), 1, "one syncfs for 20 files");
    for (i, p) in pagers.iter().enumerate() {
        assert_same(&p.durable.lock(), &pattern(i as u64, 0, 5000), "durable after sync_all");
        assert_eq!(p.committed.load(std::sync::atomic::Ordering::SeqCst), 1, "file {i} was told of its commit");
    }

    for (i, f) in files.iter().enumerate() {
        f.write_at(&pattern(50 + i as u64, 0, 3000), 1000).unwrap();
    }
    fs.fail.store(true, std::sync::atomic::Ordering::SeqCst);
    let err = cache.sync_all().unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    fs.fail.store(false, std::sync::atomic::Ordering::SeqCst);
    for (i, p) in pagers.iter().enumerate() {
        assert_eq!(p.committed.load(std::sync::atomic::Ordering::SeqCst), 1, "file {i}: nothing committed");
    }
    let want = |i: usize| {
        let mut w = pattern(i as u64, 0, 5000);
        w[1000..4000].copy_from_slice(&pattern(50 + i as u64, 0, 3000));
        w
    };
    for (i, f) in files.iter().enumerate() {
        let mut back = vec![0u8; 5000];
        f.read_exact_at(&mut back, 0).unwrap();
        assert_same(&back, &want(i), "the cache still holds what was written");
    }
    // The next sync_all writes everything again (unstable, and commits it).
    cache.sync_all().unwrap();
    for (i, p) in pagers.iter().enumerate() {
        assert_same(&p.durable.lock(), &want(i), "durable after the failed sync_all and the next");
        assert_eq!(p.committed.load(std::sync::atomic::Ordering::SeqCst), 2, "file {i} committed again");
    }
    // Each file's handles hear of the failed sync once, as after any failed pager sync.
    for f in &files {
        assert!(is_lost(f.sync(), libc::EIO), "the failed sync is reported to the file's handles");
        f.sync().unwrap();
    }
}

/// While a `sync_all`'s unstable writes wait for their `syncfs`, the pages they stored are
/// clean but may still be lost: eviction must keep them. Here the `syncfs` is held while
/// the files' clean pages are dropped, then fails: had the pages gone, they would be read
/// back from the store — the old bytes — and the new ones lost for good.
#[test]
fn pages_written_unstable_are_not_evicted_before_their_syncfs() {
    let cache = small_cache(8 << 20);
    let (files, pagers, fs) = model_files(&cache, 20);
    for (i, f) in files.iter().enumerate() {
        f.write_at(&pattern(i as u64, 0, 9000), 0).unwrap();
    }
    cache.sync_all().unwrap();
    for (i, f) in files.iter().enumerate() {
        f.write_at(&pattern(70 + i as u64, 0, 9000), 0).unwrap();
    }
    let gate = Arc::new(std::sync::Barrier::new(2));
    *fs.gate.lock() = Some(gate.clone());
    fs.fail.store(true, std::sync::atomic::Ordering::SeqCst);
    std::thread::scope(|s| {
        let syncer = s.spawn(|| cache.sync_all());
        gate.wait(); // the syncfs started: every file was written back, unstable
        for f in &files {
            f.drop_clean(0..u64::MAX).unwrap();
        }
        gate.wait();
        assert!(syncer.join().unwrap().is_err(), "the syncfs failed");
    });
    *fs.gate.lock() = None;
    fs.fail.store(false, std::sync::atomic::Ordering::SeqCst);
    for (i, f) in files.iter().enumerate() {
        let mut back = vec![0u8; 9000];
        f.read_exact_at(&mut back, 0).unwrap();
        assert_same(&back, &pattern(70 + i as u64, 0, 9000), "read back after the failed syncfs");
    }
    cache.sync_all().unwrap();
    for (i, p) in pagers.iter().enumerate() {
        assert_same(&p.durable.lock(), &pattern(70 + i as u64, 0, 9000), "durable at last");
    }
}

/// A layer over a file of the same cache (as every layer of a stack is): its writeback
/// writes its lower file, which needs memory of the cache. Its first `put_pages` waits
/// until `files` pages of `fs` were written, so that it needs that memory after the small
/// files of `fs` were written unstable in the same `sync_all`.
struct LayerAfter {
    lower: ubc::File,
    fs: Arc<ModelFs>,
    files: u64,
}

impl Pager for LayerAfter {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<ubc::Fill> {
        let n = self.lower.read_at(buf, offset)?;
        buf[n..].fill(0);
        Ok(ubc::Fill::Data)
    }
    fn put_pages(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let t = std::time::Instant::now();
        while self.fs.puts.load(std::sync::atomic::Ordering::SeqCst) < self.files
            && t.elapsed() < std::time::Duration::from_secs(10)
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(self.lower.write_at(data, offset).map(|_| ())?)
    }
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.lower.len()?)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        Ok(self.lower.set_len(len)?)
    }
    fn sync(&self) -> std::io::Result<()> {
        Ok(self.lower.sync()?)
    }
    fn describe(&self) -> String {
        "a layer".into()
    }
    fn depth(&self) -> u32 {
        self.lower.depth() + 1
    }
}

/// Pages kept for unstable writes until their commit cannot be evicted, and the commit
/// comes only after every object of the `sync_all` is written back — including a layer,
/// whose writeback needs memory for its lower file. With the budget full of kept pages
/// that layer waited for memory that only the commit would free, and the commit waited for
/// the layer: the mount's unmount (`dir | aead | zstd`, 2,000 small files, 16 MiB) hung
/// so. The pages kept are bounded (an eighth of the budget); past the bound files are
/// written with direct writes, evictable at once.
#[test]
fn unstable_writes_keep_too_few_pages_to_starve_a_layer_synced_with_them() {
    const FILES: usize = 200;
    let cache = Cache::builder()
        .budget(256 * 4096)
        .dirty_ratios(88, 90)
        .writeback(std::time::Duration::from_secs(3600), std::time::Duration::from_secs(3600))
        .reserve_timeout(std::time::Duration::from_secs(5))
        .build()
        .unwrap();
    let (files, pagers, fs) = model_files(&cache, FILES);
    for (i, f) in files.iter().enumerate() {
        f.write_at(&pattern(i as u64, 0, 4096), 0).unwrap();
    }
    let lower = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    let layer =
        cache.open(Arc::new(LayerAfter { lower, fs: fs.clone(), files: FILES as u64 }), Access::ReadWrite).unwrap();
    layer.write_at(&pattern(999, 0, 40 * 4096), 0).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let c = cache.clone();
    std::thread::spawn(move || tx.send(c.sync_all()));
    match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(r) => r.unwrap(),
        Err(_) => panic!("sync_all did not return in 60 s (the layer starved of memory?)"),
    }
    for (i, p) in pagers.iter().enumerate() {
        assert_same(&p.durable.lock(), &pattern(i as u64, 0, 4096), "a small file, durable");
    }
    let mut back = vec![0u8; 40 * 4096];
    layer.read_exact_at(&mut back, 0).unwrap();
    assert_same(&back, &pattern(999, 0, 40 * 4096), "the layer");
}

//! The pre-writeback hook (`File::set_writeback_hook`): the write-ahead rule of a database's
//! buffer pool. Each test uses a real host file and checks the host file itself: at the
//! moment the hook is called, the bytes it is told of are not in the host file yet; a hook
//! that waits holds the write back; a hook that fails keeps the pages dirty; and the bytes
//! stored are the ones the file held when the hook was called, even with a mapping storing
//! into the page meanwhile.

#[macro_use]
mod common;
use common::*;
use parking_lot::Mutex;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;
use ubc::{Access, Cache, Sharing};

/// Ranges the hook was called with, and whether the host file already held the new bytes of
/// each at that moment (it must not).
type Calls = Arc<Mutex<Vec<(std::ops::Range<u64>, bool)>>>;

/// A hook that records each call and checks the host file at `path` against `new` (the
/// bytes the cache is about to write) over the range it is told of.
fn recording_hook(path: &Path, new: Arc<Vec<u8>>) -> (ubc::WritebackHook, Calls) {
    let calls: Calls = Arc::default();
    let (c, path) = (calls.clone(), path.to_path_buf());
    let hook: ubc::WritebackHook = Arc::new(move |r: std::ops::Range<u64>| {
        let host = std::fs::read(&path).unwrap_or_default();
        let (a, b) = (r.start as usize, (r.end as usize).min(new.len()));
        let already = host.len() >= b && host[a..b] == new[a..b];
        c.lock().push((r, already));
        Ok(())
    });
    (hook, calls)
}

/// Every byte of `0..len` is in some range the hook was told of, and no call found its
/// bytes in the host file already.
fn assert_covered_before(calls: &Calls, len: u64) {
    let calls = calls.lock();
    assert!(!calls.is_empty(), "the hook was never called");
    for (r, already) in calls.iter() {
        assert!(!already, "the host file held bytes {r:?} before the hook was called for them");
    }
    let mut rs: Vec<_> = calls.iter().map(|(r, _)| r.clone()).collect();
    rs.sort_by_key(|r| r.start);
    let mut end = 0;
    for r in rs {
        assert!(r.start <= end, "bytes {end}..{} written without the hook", r.start);
        end = end.max(r.end);
    }
    assert!(end >= len, "bytes {end}..{len} written without the hook");
}

#[test]
fn sync_calls_the_hook_before_the_bytes_reach_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let cache = Cache::new(16 << 20).unwrap();
    let f = cache.create_path(&path).unwrap();
    let new = Arc::new(pattern(1, 0, 3 << 20));
    let (hook, calls) = recording_hook(&path, new.clone());
    f.set_writeback_hook(Some(hook)).unwrap();
    f.write_at(&new, 0).unwrap();
    f.sync().unwrap();
    assert_covered_before(&calls, new.len() as u64);
    assert_same(&std::fs::read(&path).unwrap(), &new, "host file after sync");
}

#[test]
fn a_hook_that_waits_holds_the_write_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    std::fs::write(&path, vec![0u8; 64 << 10]).unwrap();
    let cache = Cache::new(16 << 20).unwrap();
    let f = Arc::new(cache.open_path(&path, Access::ReadWrite).unwrap());
    let (entered_tx, entered) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    f.set_writeback_hook(Some(Arc::new(move |r| {
        entered_tx.send(r).unwrap();
        go_rx.lock().recv().unwrap();
        Ok(())
    })))
    .unwrap();
    let new = pattern(2, 0, 64 << 10);
    f.write_at(&new, 0).unwrap();
    let g = f.clone();
    let syncer = std::thread::spawn(move || g.sync());
    let r = entered.recv_timeout(Duration::from_secs(20)).expect("the sync called the hook");
    assert_eq!(r, 0..64 << 10);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!syncer.is_finished(), "sync returned while the hook held the write back");
    assert_eq!(std::fs::read(&path).unwrap(), vec![0u8; 64 << 10], "the host file changed while the hook waited");
    go.send(()).unwrap();
    syncer.join().unwrap().unwrap();
    assert_same(&std::fs::read(&path).unwrap(), &new, "host file after the hook let the write go");
}

#[test]
fn a_failing_hook_keeps_the_pages_dirty_and_sync_reports_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let cache = Cache::new(16 << 20).unwrap();
    let f = cache.create_path(&path).unwrap();
    f.set_writeback_hook(Some(Arc::new(|_| Err(std::io::Error::other("log device full"))))).unwrap();
    let new = pattern(3, 0, 256 << 10);
    f.write_at(&new, 0).unwrap();
    let e = f.sync().expect_err("sync with a failing hook");
    assert!(format!("{e}").contains("log device full"), "the hook's error is reported: {e}");
    assert!(f.stats().dirty_bytes > 0, "pages stay dirty after the hook failed");
    assert!(
        std::fs::read(&path).unwrap().iter().all(|&b| b == 0),
        "nothing of the data reached the host file past a failing hook"
    );
    // The log recovers: the next sync writes everything.
    f.set_writeback_hook(Some(Arc::new(|_| Ok(())))).unwrap();
    f.sync().unwrap();
    assert_eq!(f.stats().dirty_bytes, 0);
    assert_same(&std::fs::read(&path).unwrap(), &new, "host file after the hook recovered");
}

#[test]
fn the_flusher_and_reclaim_call_the_hook_too() {
    let dir = tempfile::tempdir().unwrap();
    // The flusher: expired dirty data written without any sync.
    let path = dir.path().join("aged");
    let cache = Cache::builder()
        .budget(16 << 20)
        .writeback(Duration::from_millis(20), Duration::from_millis(50))
        .build()
        .unwrap();
    let f = cache.create_path(&path).unwrap();
    let new = Arc::new(pattern(4, 0, 512 << 10));
    let (hook, calls) = recording_hook(&path, new.clone());
    f.set_writeback_hook(Some(hook)).unwrap();
    f.write_at(&new, 0).unwrap();
    // (`dirty_bytes` falls as a writeback begins; `written_bytes` counts what was stored.)
    eventually("the flusher writes the file back", || f.stats().written_bytes >= new.len() as u64);
    assert_covered_before(&calls, new.len() as u64);
    assert_same(&std::fs::read(&path).unwrap(), &new, "host file after the flusher");

    // Reclaim: a file 8x the budget, written without sync, reaches the store through the hook.
    let path = dir.path().join("big");
    let cache = small_cache(1 << 20);
    let f = cache.create_path(&path).unwrap();
    let new = Arc::new(pattern(5, 0, 8 << 20));
    let (hook, calls) = recording_hook(&path, new.clone());
    f.set_writeback_hook(Some(hook)).unwrap();
    for (i, c) in new.chunks(64 << 10).enumerate() {
        f.write_at(c, (i as u64) << 16).unwrap();
    }
    assert!(!calls.lock().is_empty(), "8 MiB went through a 1 MiB cache without the hook");
    f.sync().unwrap();
    assert_covered_before(&calls, new.len() as u64);
    assert_same(&std::fs::read(&path).unwrap(), &new, "host file after reclaim and sync");
}

#[test]
fn a_mapping_flush_calls_the_hook_for_the_pages_stored_through_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    let cache = Cache::new(16 << 20).unwrap();
    let f = cache.open_path(&path, Access::ReadWrite).unwrap();
    let mut want = vec![0u8; 1 << 20];
    want[300_000..300_010].copy_from_slice(b"0123456789");
    let (hook, calls) = recording_hook(&path, Arc::new(want.clone()));
    f.set_writeback_hook(Some(hook)).unwrap();
    let mut m = f.map(0..1 << 20, Access::ReadWrite, Sharing::Shared).unwrap();
    // SAFETY: in bounds of the mapping, which lives past the store.
    unsafe { std::ptr::copy_nonoverlapping(b"0123456789".as_ptr(), m.as_mut_ptr().add(300_000), 10) };
    m.flush().unwrap();
    let calls = calls.lock().clone();
    assert!(
        calls.iter().any(|(r, already)| r.contains(&300_000) && r.contains(&300_009) && !already),
        "no hook call before the stored page was written: {calls:?}"
    );
    assert_same(&std::fs::read(&path).unwrap(), &want, "host file after the mapping's flush");
}

/// The bytes written are those of the moment the hook was called: a store through a mapping
/// made while the hook runs (after it decided the log covers the page) is not written with
/// them — it is found dirty and written by the next writeback, through the hook again.
#[test]
fn a_store_through_a_mapping_while_the_hook_runs_is_left_for_the_next_writeback() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    // Larger than a chunk of pages: a small file's pages are copied out anyway.
    std::fs::write(&path, vec![0u8; 8 << 20]).unwrap();
    let cache = Cache::new(16 << 20).unwrap();
    let f = Arc::new(cache.open_path(&path, Access::ReadWrite).unwrap());
    let mut m = f.map(0..8 << 20, Access::ReadWrite, Sharing::Shared).unwrap();
    let at = (4 << 20) + 8192usize;
    // SAFETY (both stores): in bounds of the mapping, which outlives them.
    unsafe { std::ptr::copy_nonoverlapping(b"first".as_ptr(), m.as_mut_ptr().add(at), 5) };
    let (entered_tx, entered) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    f.set_writeback_hook(Some(Arc::new(move |r| {
        entered_tx.send(r).unwrap();
        go_rx.lock().recv_timeout(Duration::from_secs(20)).unwrap();
        Ok(())
    })))
    .unwrap();
    let g = f.clone();
    let syncer = std::thread::spawn(move || g.sync());
    let r = entered.recv_timeout(Duration::from_secs(20)).expect("the sync called the hook");
    assert!(r.contains(&(at as u64)), "hook range {r:?}");
    unsafe { std::ptr::copy_nonoverlapping(b"after".as_ptr(), m.as_mut_ptr().add(at), 5) };
    go.send(()).unwrap();
    syncer.join().unwrap().unwrap();
    let host = std::fs::File::open(&path).unwrap();
    let mut got = [0u8; 5];
    host.read_exact_at(&mut got, at as u64).unwrap();
    assert_eq!(&got, b"first", "the write carried a store made after the hook was called");
    // The later store is dirty, and the next sync writes it (through the hook again).
    let (entered_tx2, entered2) = mpsc::channel();
    f.set_writeback_hook(Some(Arc::new(move |r| {
        entered_tx2.send(r).unwrap();
        Ok(())
    })))
    .unwrap();
    f.sync().unwrap();
    assert!(entered2.try_iter().any(|r| r.contains(&(at as u64))), "the later store went without the hook");
    host.read_exact_at(&mut got, at as u64).unwrap();
    assert_eq!(&got, b"after");
    drop(m);
}

#[test]
fn the_hook_stays_with_the_file_after_its_last_close_and_can_be_removed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let cache = Cache::new(16 << 20).unwrap();
    let f = cache.create_path(&path).unwrap();
    let new = Arc::new(pattern(6, 0, 128 << 10));
    let (hook, calls) = recording_hook(&path, new.clone());
    f.set_writeback_hook(Some(hook)).unwrap();
    f.write_at(&new, 0).unwrap();
    drop(f);
    cache.sync_all().unwrap();
    assert_covered_before(&calls, new.len() as u64);
    // Removed: writes go without it.
    let f = cache.open_path(&path, Access::ReadWrite).unwrap();
    f.set_writeback_hook(None).unwrap();
    let n = calls.lock().len();
    f.write_at(b"x", 0).unwrap();
    f.sync().unwrap();
    assert_eq!(calls.lock().len(), n, "a removed hook was called");
    f.close().unwrap();
    assert!(matches!(f.set_writeback_hook(None), Err(ubc::Error::Closed)));
}

#[test]
fn a_hook_that_panics_fails_the_writeback_instead_of_hanging_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let cache = Cache::new(16 << 20).unwrap();
    let f = cache.create_path(&path).unwrap();
    f.set_writeback_hook(Some(Arc::new(|_| panic!("a bug in the log")))).unwrap();
    let new = pattern(7, 0, 4 << 20);
    f.write_at(&new, 0).unwrap();
    let e = f.sync().expect_err("sync with a panicking hook");
    assert!(format!("{e}").contains("panicked"), "{e}");
    assert!(f.stats().dirty_bytes > 0, "pages stay dirty");
    // The pages are not left under writeback: a write, a sync and the file's drop proceed.
    f.set_writeback_hook(None).unwrap();
    f.write_at(b"later", 0).unwrap();
    f.sync().unwrap();
    let mut want = new.clone();
    want[..5].copy_from_slice(b"later");
    assert_same(&std::fs::read(&path).unwrap(), &want, "host file");
}

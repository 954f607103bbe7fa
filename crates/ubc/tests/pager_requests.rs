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

/// A host file's pager that write-locks ranges through its request and answers the cache's
/// unlock requests (Mach's `pager_data_lock` / `pager_data_unlock`): it records each one,
/// and refuses while `refuse` is set.
struct Locking {
    inner: FilePager,
    request: OnceLock<PagerRequest>,
    asked: std::sync::Mutex<Vec<std::ops::Range<u64>>>,
    refuse: std::sync::atomic::AtomicBool,
}

impl Pager for Locking {
    forward_to!(inner: get_pages, put_pages, len, set_len, sync);
    fn init(&self, request: PagerRequest) {
        self.request.set(request).expect("init once per object");
    }
    fn unlock_request(&self, range: std::ops::Range<u64>) -> std::io::Result<()> {
        self.asked.lock().unwrap().push(range);
        if self.refuse.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, "no write token"));
        }
        Ok(())
    }
    fn is_writable(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        "locking".into()
    }
}

impl Locking {
    fn asked(&self) -> Vec<std::ops::Range<u64>> {
        std::mem::take(&mut *self.asked.lock().unwrap())
    }
    fn refuse(&self, on: bool) {
        self.refuse.store(on, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A 64 KiB host file (`pattern(5, ..)`) under a `Locking` pager, open in a cache of its own.
struct LockedFile {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    p: Arc<Locking>,
    cache: Cache,
    f: ubc::File,
    req: PagerRequest,
}

fn locked_file() -> LockedFile {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    std::fs::write(&path, pattern(5, 0, 64 << 10)).unwrap();
    let p = Arc::new(Locking {
        inner: FilePager::open(&path, Access::ReadWrite).unwrap(),
        request: OnceLock::new(),
        asked: Default::default(),
        refuse: Default::default(),
    });
    let cache = Cache::new(16 << 20).unwrap();
    let f = cache.open(p.clone(), Access::ReadWrite).unwrap();
    let req = p.request.get().unwrap().clone();
    LockedFile { _dir: dir, path, p, cache, f, req }
}

#[test]
fn a_locked_range_is_read_freely_and_each_change_asks_the_pager_first() {
    let LockedFile { _dir, path, p, cache, f, req } = locked_file();
    req.lock(8192..16384).unwrap();
    assert_eq!(cache.stats().locked_bytes, 8192);
    let mut b = vec![0u8; 64 << 10];
    f.read_exact_at(&mut b, 0).unwrap();
    f.write_at(b"outside", 100).unwrap();
    assert_eq!(p.asked(), vec![], "reads and writes outside the lock ask nothing");

    // A write asks for the locked pages it touches; afterwards they are unlocked.
    f.write_at(b"inside", 9000).unwrap();
    assert_eq!(p.asked(), vec![8192..12288]);
    f.write_at(b"again", 9100).unwrap();
    assert_eq!(p.asked(), vec![], "allowed once, unlocked");
    // A writable window over the rest of the lock.
    {
        let mut w = f.window_mut(16000, 100).unwrap();
        w.fill(0xEE);
    }
    assert_eq!(p.asked(), vec![12288..16384]);
    assert_eq!(cache.stats().locked_bytes, 0);

    // A truncation and an extension ask for the bytes between the two ends.
    req.lock(0..64 << 10).unwrap();
    f.set_len(20_000).unwrap();
    assert_eq!(p.asked(), vec![16384..65536]);
    f.set_len(30_000).unwrap();
    assert_eq!(p.asked(), vec![], "the pages past the old end were unlocked by the truncation");
    req.lock(0..64 << 10).unwrap();
    f.set_len(40_000).unwrap();
    assert_eq!(p.asked(), vec![28672..40960]);

    // A refusal is the change's error; the lock and the bytes stay.
    p.refuse(true);
    let e = f.write_at(b"refused", 0).unwrap_err();
    assert!(matches!(&e, ubc::Error::Io { op: ubc::PagerOp::Unlock, .. }), "{e:?}");
    assert!(e.to_string().contains("no write token"), "{e}");
    assert!(f.set_len(10).is_err());
    assert!(f.window_mut(0, 10).is_err());
    f.read_exact_at(&mut b[..7], 100).unwrap();
    assert_eq!(&b[..7], b"outside");
    assert_eq!(f.len().unwrap(), 40_000);
    assert_eq!(p.asked().len(), 3);
    let st = cache.stats();
    assert_eq!(st.unlock_refusals, 3, "{st}");
    // An unlock given without being asked.
    req.unlock(0..8192);
    f.write_at(b"given", 0).unwrap();
    assert_eq!(p.asked(), vec![]);
    p.refuse(false);
    f.sync().unwrap();
    let stored = std::fs::read(&path).unwrap();
    assert_eq!(stored.len(), 40_000);
    assert_eq!(&stored[..5], b"given");
    assert_eq!(&stored[9000..9006], b"inside");
}

/// A shared writable mapping: a lock finds the stores made before it (they are written back
/// by a clean after it), and a later access to a locked page faults and asks the pager —
/// a read too (its stores could not be seen one by one). A read-only mapping asks nothing.
#[test]
fn a_lock_traps_a_shared_writable_mapping_and_finds_its_stores() {
    const NAME: &str = "a_lock_traps_a_shared_writable_mapping_and_finds_its_stores";
    let LockedFile { _dir, path, p, cache: _cache, f, req } = locked_file();
    let mut m = f.map(0..64 << 10, Access::ReadWrite, Sharing::Shared).unwrap();
    let ro = f.map(0..64 << 10, Access::ReadOnly, Sharing::Shared).unwrap();
    m[5000] = 0xAA; // before the lock
    req.lock(0..64 << 10).unwrap();
    req.clean(0..64 << 10).unwrap();
    assert_eq!(std::fs::read(&path).unwrap()[5000], 0xAA, "the store before the lock was found and written back");
    assert_eq!(p.asked(), vec![]);

    assert_eq!(ro[20_000], byte_at(5, 20_000));
    assert_eq!(p.asked(), vec![], "a read-only mapping reads a locked page freely");
    assert_eq!(m[20_000], byte_at(5, 20_000));
    let asked = p.asked();
    assert!(
        asked.len() == 1 && asked[0].contains(&20_000),
        "a read through the writable mapping asked for its page: {asked:?}"
    );
    m[40_000] = 0xBB;
    let asked = p.asked();
    assert!(asked.len() == 1 && asked[0].contains(&40_000), "a store asked: {asked:?}");
    f.sync().unwrap();
    assert_eq!(std::fs::read(&path).unwrap()[40_000], 0xBB);

    // Refused: the access gets SIGBUS, as for a page the pager cannot give.
    req.lock(0..64 << 10).unwrap();
    p.refuse(true);
    if std::env::var("UBC_CHILD").is_ok_and(|v| v == NAME) {
        m[60_000] = 1;
        std::process::exit(0);
    }
    use std::os::unix::process::ExitStatusExt;
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env("UBC_CHILD", NAME)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGBUS), "stderr: {stderr}");
    assert!(stderr.contains("no write token"), "the cause is told: {stderr}");
    drop((m, ro));
}

/// A lock waits for the writes in progress, and the writes after it ask: three writers
/// racing a loop of locks, and a page that changed after a lock returned was always asked
/// for since.
#[test]
fn writes_racing_locks_each_ask_or_miss_the_lock_entirely() {
    let LockedFile { _dir, p, cache, f, req, .. } = locked_file();
    let f = Arc::new(f);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..3u64)
        .map(|t| {
            let (f, stop) = (f.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let at = ((n * 7 + t * 3) % 16) * 4096;
                    f.write_at(&[t as u8; 100], at).unwrap();
                    n += 1;
                }
                n
            })
        })
        .collect();
    let t0 = std::time::Instant::now();
    let mut locks = 0;
    while t0.elapsed() < std::time::Duration::from_millis(1500) {
        p.asked(); // asks from here on are for this lock (or come after it)
        req.lock(0..64 << 10).unwrap();
        // Every page was locked and no write was in progress: a page that changes from
        // here on was asked for since the lock.
        let before = {
            let mut b = vec![0u8; 64 << 10];
            f.read_exact_at(&mut b, 0).unwrap();
            b
        };
        std::thread::sleep(std::time::Duration::from_micros(300));
        // Read, then take the asks: a change the read saw was asked for before it was made.
        let mut after = vec![0u8; 64 << 10];
        f.read_exact_at(&mut after, 0).unwrap();
        let asked = p.asked();
        for pg in 0..16u64 {
            let r = (pg * 4096) as usize..((pg + 1) * 4096) as usize;
            if before[r.clone()] != after[r.clone()] {
                assert!(
                    asked.iter().any(|a| a.start <= pg * 4096 && pg * 4096 < a.end),
                    "page {pg} changed under a lock without an unlock request"
                );
            }
        }
        locks += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes: u64 = writers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(locks > 10 && writes > 100, "locks {locks}, writes {writes}");
    assert!(cache.stats().unlock_requests > 10);
}

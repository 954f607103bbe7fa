//! Host descriptors live in a bounded pool (`pager/host_fds.rs`): file pagers beyond the
//! limit have their descriptors closed and reopened by file handle when next used. Files
//! renamed meanwhile are found; files removed through `keep_open` keep working; a file
//! unlinked behind the pool's back is an error, not garbage.
//!
//! The pool is the process's, so these tests run one at a time (`SERIAL`) and each sets the
//! limit it needs. They need `open_by_handle_at` (CAP_DAC_READ_SEARCH: root here, as in CI);
//! where it is refused every file is pinned, which the first test reports as a failure with
//! the reason rather than passing vacuously.

#[macro_use]
mod common;
use common::*;
use std::sync::Mutex;
use ubc::pager::host_fds;
use ubc::{Cache, Error};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Create, write and sync `n` small files named `{prefix}{i}`: each takes the pool's
/// descriptor in turn.
fn churn(cache: &Cache, dir: &std::path::Path, prefix: &str, n: usize) {
    for i in 0..n {
        let c = cache.create_path(dir.join(format!("{prefix}{i}"))).unwrap();
        c.write_at(prefix.as_bytes(), 0).unwrap();
        c.sync().unwrap();
    }
}

/// What this process's open descriptors of removed files under `dir` point to.
fn open_removed_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.starts_with(dir) && l.to_string_lossy().ends_with("(deleted)"))
        .collect()
}

fn cache() -> Cache {
    // No read-ahead: each test's reads are the pager calls it counts on.
    Cache::builder().budget(64 << 20).max_cached_files(100_000).readahead(0, 0).build().unwrap()
}

/// 300 host files open at once through a pool of 16 descriptors: written, synced, evicted,
/// read back and checked on disk, with the process's descriptors bounded all along.
#[test]
fn three_hundred_open_files_through_sixteen_descriptors() {
    let _s = serial();
    host_fds::set_limit(16);
    let dir = tempfile::tempdir().unwrap();
    let cache = cache();
    let base = open_fds();
    let s0 = host_fds::stats();
    let mut files = Vec::new();
    for i in 0..300u64 {
        let f = cache.create_path(dir.path().join(format!("f{i}"))).unwrap();
        f.write_at(&pattern(i, 0, 10_000), 0).unwrap();
        files.push(f);
        let now = open_fds();
        // The pool's 16, the arena's memfds (made at the first cached page) and a margin.
        let bound = base + 16 + 4 + cache.stats().shared_memfds;
        assert!(now <= bound, "{now} descriptors with {} files open (base {base}, bound {bound})", i + 1);
    }
    let s = host_fds::stats();
    assert!(s.parks - s0.parks >= 284, "descriptors were not parked (open_by_handle_at refused?): {s:?}");
    assert!(s.open <= 16 && s.files >= 300, "{s:?}");
    for f in &files {
        f.sync().unwrap();
    }
    cache.evict_all().unwrap();
    for (i, f) in files.iter().enumerate() {
        let mut b = vec![0u8; 10_000];
        f.read_exact_at(&mut b, 0).unwrap();
        assert_same(&b, &pattern(i as u64, 0, 10_000), &format!("f{i} read back"));
        assert_eq!(f.len().unwrap(), 10_000);
    }
    assert!(host_fds::stats().reopens - s0.reopens >= 284, "{:?}", host_fds::stats());
    for i in (0..300u64).step_by(7) {
        let on_disk = std::fs::read(dir.path().join(format!("f{i}"))).unwrap();
        assert_same(&on_disk, &pattern(i, 0, 10_000), &format!("f{i} on disk"));
    }
    let now = open_fds();
    let bound = base + 16 + 4 + cache.stats().shared_memfds;
    assert!(now <= bound, "{now} descriptors at the end (base {base}, bound {bound})");
    drop(files);
    drop(cache);
    assert!(open_fds() <= base + 4);
}

/// A file renamed while its descriptor is parked is reopened where it is now (by handle,
/// not by name); a new file created under its old name is not touched.
#[test]
fn a_parked_file_renamed_is_found_by_handle() {
    let _s = serial();
    host_fds::set_limit(1);
    let dir = tempfile::tempdir().unwrap();
    let cache = cache();
    let a = cache.create_path(dir.path().join("a")).unwrap();
    a.write_at(b"first", 0).unwrap();
    a.sync().unwrap();
    // Another file takes the one descriptor: a's is parked.
    let b = cache.create_path(dir.path().join("b")).unwrap();
    b.write_at(b"other", 0).unwrap();
    b.sync().unwrap();
    std::fs::rename(dir.path().join("a"), dir.path().join("a2")).unwrap();
    std::fs::write(dir.path().join("a"), b"impostor").unwrap();
    cache.evict_all().unwrap();
    let mut got = [0u8; 5];
    a.read_exact_at(&mut got, 0).unwrap();
    assert_eq!(&got, b"first");
    a.write_at(b"again", 5).unwrap();
    a.sync().unwrap();
    assert_eq!(std::fs::read(dir.path().join("a2")).unwrap(), b"firstagain");
    assert_eq!(std::fs::read(dir.path().join("a")).unwrap(), b"impostor");
}

/// `keep_open` before an unlink (what a stack's `dir` layer does): the open handle keeps
/// working on the removed file, parked or not before, and leaves no descriptor behind when
/// closed. A file unlinked with its descriptor open is never parked (its data lives only
/// while a descriptor does).
#[test]
fn removed_files_keep_working_through_their_handles() {
    let _s = serial();
    host_fds::set_limit(1);
    let dir = tempfile::tempdir().unwrap();
    let cache = cache();
    let deleted = || open_removed_under(dir.path()).len();
    // Parked, then kept open (reopened by handle) and removed.
    let a = cache.create_path(dir.path().join("a")).unwrap();
    a.write_at(&pattern(1, 0, 50_000), 0).unwrap();
    a.sync().unwrap();
    let b = cache.create_path(dir.path().join("b")).unwrap();
    b.write_at(b"b", 0).unwrap();
    let st = std::fs::metadata(dir.path().join("a")).unwrap();
    use std::os::unix::fs::MetadataExt;
    host_fds::keep_open(st.dev(), st.ino());
    std::fs::remove_file(dir.path().join("a")).unwrap();
    // Still open: other files come and go through the one pooled descriptor.
    churn(&cache, dir.path(), "c", 5);
    cache.evict_all().unwrap();
    let mut got = vec![0u8; 50_000];
    a.read_exact_at(&mut got, 0).unwrap();
    assert_same(&got, &pattern(1, 0, 50_000), "removed file read back");
    a.write_at(b"still here", 0).unwrap();
    a.sync().unwrap();
    assert_eq!(deleted(), 1);
    assert!(host_fds::stats().pinned >= 1);

    // Unlinked behind the pool's back while its descriptor is open: never parked.
    let d = cache.create_path(dir.path().join("d")).unwrap();
    d.write_at(&pattern(2, 0, 20_000), 0).unwrap();
    d.sync().unwrap();
    std::fs::remove_file(dir.path().join("d")).unwrap();
    churn(&cache, dir.path(), "e", 5);
    cache.evict_all().unwrap();
    let mut got = vec![0u8; 20_000];
    d.read_exact_at(&mut got, 0).unwrap();
    assert_same(&got, &pattern(2, 0, 20_000), "file unlinked with an open descriptor");

    // Out of the cache (pages dropped, then the last close): nothing of them stays open.
    for f in [a, d] {
        f.sync().unwrap();
        f.invalidate(0..u64::MAX, ubc::Length::Keep).unwrap();
        f.close_and_wait();
    }
    assert_eq!(deleted(), 0, "a removed file's descriptor outlived its last close");
}

/// The case the pool cannot cover: another process unlinks a file whose descriptor is
/// parked. Its inode is freed; the next pager call fails with ESTALE — a typed I/O error,
/// with dirty pages kept dirty and reported by `sync` — never wrong bytes.
#[test]
fn a_parked_file_unlinked_behind_its_back_is_an_error_not_garbage() {
    let _s = serial();
    host_fds::set_limit(1);
    let dir = tempfile::tempdir().unwrap();
    let cache = cache();
    let a = cache.create_path(dir.path().join("a")).unwrap();
    a.write_at(&pattern(3, 0, 8192), 0).unwrap();
    a.sync().unwrap();
    let b = cache.create_path(dir.path().join("b")).unwrap();
    b.write_at(b"b", 0).unwrap();
    b.sync().unwrap();
    cache.evict_all().unwrap();
    // evict_all synced both, in either order: a write-back of b now reopens b if it was
    // parked, and with a limit of 1 that parks a.
    b.write_at(b"c", 1).unwrap();
    b.sync().unwrap();
    assert_eq!(host_fds::stats().open, 1);
    std::fs::remove_file(dir.path().join("a")).unwrap();
    let mut got = [0u8; 16];
    match a.read_at(&mut got, 0) {
        Err(e @ Error::Io { .. }) => assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}"),
        other => panic!("expected ESTALE, got {other:?}"),
    }
    a.write_at(b"lost?", 8192).unwrap();
    let e = a.sync().unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
    assert!(a.stats().dirty_bytes > 0, "the page stays dirty");
}

/// 10,000 host files open at once under an open-file limit of 256 (each held a descriptor:
/// the 250th failed with EMFILE). Runs in a child process with the limit set before `exec`
/// (the pool reads it at first use: a quarter, 64 descriptors).
#[test]
fn ten_thousand_open_host_files_under_a_256_descriptor_limit() {
    const FILES: usize = 10_000;
    if is_child("nofile") {
        let dir = tempfile::tempdir().unwrap();
        let cache = cache();
        let mut files = Vec::with_capacity(FILES);
        for i in 0..FILES {
            let f = cache.create_path(dir.path().join(format!("f{i}"))).unwrap();
            f.write_at(format!("file {i}").as_bytes(), 0).unwrap();
            files.push(f);
        }
        for f in &files {
            f.sync().unwrap();
        }
        cache.evict_all().unwrap();
        for (i, f) in files.iter().enumerate() {
            let want = format!("file {i}");
            let mut got = vec![0u8; want.len()];
            f.read_exact_at(&mut got, 0).unwrap();
            assert_eq!(got, want.as_bytes());
        }
        let s = host_fds::stats();
        assert_eq!(s.limit, 64, "{s:?}");
        assert!(s.open <= 64 && s.files == FILES, "{s:?}");
        return;
    }
    in_child_with_limit(
        "ten_thousand_open_host_files_under_a_256_descriptor_limit",
        "nofile",
        libc::RLIMIT_NOFILE,
        256,
        256,
    );
}

/// A host file written, written back and dropped from the cache before any sync (its pages
/// evicted, its last handle closed: the cache forgets it) leaves its file system to the next
/// `sync_all` — through a directory of that file system, not the file: removed, the file
/// keeps no descriptor open (the mount's `a_file_removed_or_renamed_over_while_open_...`
/// caught a first version that kept the file's pager for it).
#[test]
fn a_forgotten_unsynced_file_keeps_no_descriptor_and_is_synced_by_its_file_system() {
    let _s = serial();
    host_fds::set_limit(64);
    let dir = tempfile::tempdir().unwrap();
    let cache = cache();
    let path = dir.path().join("gone");
    let f = cache.create_path(&path).unwrap();
    f.write_at(&pattern(4, 0, 20_000), 0).unwrap();
    f.clean(0..u64::MAX).unwrap();
    assert!(f.drop_clean(0..u64::MAX).unwrap() > 0);
    f.close().unwrap();
    drop(f);
    assert_eq!(cache.stats().objects, 0, "the cache forgot the file");
    assert_eq!(std::fs::read(&path).unwrap(), pattern(4, 0, 20_000), "its bytes are in the file");
    std::fs::remove_file(&path).unwrap();
    let open = open_removed_under(dir.path());
    assert!(open.is_empty(), "a descriptor of the removed file is still open: {open:?}");
    cache.sync_all().unwrap();
}

//! Open descriptors stay bounded however many files go through a stack: closed files are
//! kept open in a bounded pool of idle files, released beyond it — and a released file,
//! opened again, sees what was written meanwhile through another layer.
//!
//! The tests count this process's descriptors (`/proc/self/fd`), so they run one at a time
//! (`SERIAL`): another test's files would blur the count.

mod common;

use std::sync::Mutex;
use ubc_stack::{OpenOptions, Stack};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Descriptors this process holds now.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Descriptors a file of `dir | aead | zstd` holds: the host file's (its pages, in every
/// domain, are slices of the cache's shared memfds; a memfd each made the count 4).
const PER_FILE: usize = 1;
/// Closed objects the cache keeps (`max_cached_files`), at most one descriptor each.
const CACHED: usize = 32;
const POOL: usize = 16;

fn cache() -> ubc::Cache {
    ubc::Cache::builder().budget(16 << 20).max_cached_files(CACHED).build().unwrap()
}

/// Bytes of file `i`: distinct, and compressible enough for zstd to have work.
fn content(i: usize) -> Vec<u8> {
    format!("file {i}: ").repeat(50 + i % 200).into_bytes()
}

/// Write `n` files through the top of `stack`, then read them all back twice, checking the
/// process never holds more than the pool's and the cache's share of descriptors (plus a
/// margin for the cache's own: threads' eventfds, the fault service).
fn many_files_stay_bounded(stack: &Stack, n: usize) {
    stack.set_idle_files(POOL);
    let top = stack.top();
    // Start the cache's machinery (threads, I/O pools) before the baseline.
    drop(top.create("warmup").unwrap());
    let base = open_fds();
    let bound = base + POOL * PER_FILE + CACHED + 16;
    let mut peak = 0;
    for i in 0..n {
        let f = top.create(&format!("f{i}")).unwrap();
        f.write_at(&content(i), 0).unwrap();
        drop(f);
        peak = peak.max(open_fds());
        assert!(peak <= bound, "{peak} descriptors open after {} files (bound {bound})", i + 1);
    }
    for round in 0..2 {
        for i in 0..n {
            let f = top.open(&format!("f{i}")).unwrap();
            let want = content(i);
            assert_eq!(f.len().unwrap(), want.len() as u64, "round {round}, f{i}");
            let mut got = vec![0; want.len()];
            f.read_exact_at(&mut got, 0).unwrap();
            assert!(got == want, "round {round}: f{i} reads wrong bytes");
            drop(f);
            peak = peak.max(open_fds());
            assert!(peak <= bound, "{peak} descriptors open while reading (bound {bound})");
        }
    }
    let (used, idle, detached) = stack.open_files();
    assert_eq!((used, detached), (0, 0));
    assert!(idle <= POOL, "{idle} idle files, pool {POOL}");
    // The name caches hold the names of open and idle files only (one per layer each, and
    // the warm-up file's), not of every file ever opened.
    let names = stack.cached_names();
    assert!(names <= (POOL + 1) * stack.depth(), "{names} names cached for {idle} idle files of {n}");
    stack.sync_all().unwrap();
}

#[test]
fn many_files_through_dir_aead_zstd_keep_descriptors_bounded() {
    let _s = serial();
    let tmp = tempfile::tempdir().unwrap();
    let spec = common::layered_spec(tmp.path(), "aead | zstd");
    {
        let stack = Stack::open(&spec, cache()).unwrap();
        many_files_stay_bounded(&stack, 300);
    }
    // And on disk, through a fresh stack.
    let stack = Stack::open(&spec, cache()).unwrap();
    for i in (0..300).step_by(37) {
        let f = stack.top().open(&format!("f{i}")).unwrap();
        let mut got = vec![0; f.len().unwrap() as usize];
        f.read_exact_at(&mut got, 0).unwrap();
        assert!(got == content(i), "f{i} on disk");
    }
}

#[test]
fn many_files_through_a_union_keep_descriptors_bounded() {
    let _s = serial();
    let tmp = tempfile::tempdir().unwrap();
    let upper = tmp.path().join("upper");
    std::fs::create_dir(&upper).unwrap();
    let spec = common::layered_spec(tmp.path(), &format!("union:upper={} | aead | zstd", upper.display()));
    let stack = Stack::open(&spec, cache()).unwrap();
    many_files_stay_bounded(&stack, 200);
}

/// A file released from the pool, then written through the bottom layer, then opened
/// again at the top: the top reads the new bytes, not pages cached before the write.
#[test]
fn a_released_file_reopened_after_a_write_below_reads_the_new_bytes() {
    let _s = serial();
    let tmp = tempfile::tempdir().unwrap();
    let spec = common::layered_spec(tmp.path(), "aead | zstd");
    // No read-ahead: a read-ahead job that has just filled its pages still holds its object
    // (and its pager's descriptors) for a moment after the release, which would blur the count taken at once.
    let cache = ubc::Cache::builder().budget(16 << 20).max_cached_files(CACHED).readahead(0, 0).build().unwrap();
    let stack = Stack::open(&spec, cache).unwrap();
    stack.set_idle_files(0);
    let top = stack.top();
    // Start what the cache starts on first use (I/O threads of every depth) before counting.
    let w = top.create("warmup").unwrap();
    w.write_at(&content(0), 0).unwrap();
    w.sync().unwrap();
    w.read_exact_at(&mut [0; 8], 0).unwrap();
    drop(w);
    let base = open_fds();
    let (old, new) = (content(1), content(2));
    for (name, bytes) in [("a", &old), ("b", &new)] {
        let f = top.create(name).unwrap();
        f.write_at(bytes, 0).unwrap();
        f.sync().unwrap();
    }
    // Read `a` through the top (its upper domains cache its pages), then close it.
    let f = top.open("a").unwrap();
    let mut got = vec![0; old.len()];
    f.read_exact_at(&mut got, 0).unwrap();
    assert!(got == old);
    drop(f);
    // Released: only the stored files' objects may stay cached (the host file's descriptor
    // each; their pages in the shared memfd), not the upper domains'.
    let after = open_fds();
    assert!(after <= base + 2, "{after} descriptors with a and b closed, {base} before they were made");
    assert_eq!(stack.open_files(), (0, 0, 0));

    // Through the bottom layer: b's stored bytes (header, file id and all) replace a's.
    let bottom = stack.layer(0).unwrap();
    let src = bottom.open("b").unwrap();
    let mut stored = vec![0; src.len().unwrap() as usize];
    src.read_exact_at(&mut stored, 0).unwrap();
    drop(src);
    let dst = bottom.open_with("a", OpenOptions::new().write(true)).unwrap();
    dst.set_len(0).unwrap();
    dst.write_at(&stored, 0).unwrap();
    dst.sync().unwrap();
    drop(dst);

    let f = top.open("a").unwrap();
    let mut got = vec![0; f.len().unwrap() as usize];
    f.read_exact_at(&mut got, 0).unwrap();
    assert!(got == new, "a reads {} bytes, not b's {} written below", got.len(), new.len());
}

/// A file removed while open keeps working through its handle, and at its last close no
/// descriptor of it is left (the host file is deleted: its data is freed).
#[test]
fn a_file_removed_while_open_works_until_its_last_close_then_leaves_no_descriptor() {
    let _s = serial();
    let tmp = tempfile::tempdir().unwrap();
    let spec = common::layered_spec(tmp.path(), "aead | zstd");
    let stack = Stack::open(&spec, cache()).unwrap();
    let top = stack.top();
    drop(top.create("warmup").unwrap());
    let deleted = || {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l.to_string_lossy().contains(tmp.path().to_str().unwrap()))
            .filter(|l| l.to_string_lossy().ends_with("(deleted)"))
            .count()
    };
    let f = top.create("doomed").unwrap();
    f.write_at(&content(3), 0).unwrap();
    f.sync().unwrap();
    top.remove("doomed").unwrap();
    assert!(!tmp.path().join("data/doomed").exists());
    let more = content(4);
    f.write_at(&more, 0).unwrap();
    f.set_len(more.len() as u64 + 10).unwrap();
    assert_eq!(f.len().unwrap(), more.len() as u64 + 10);
    let mut got = vec![0; more.len()];
    f.read_exact_at(&mut got, 0).unwrap();
    assert!(got == more);
    f.sync().unwrap();
    // Mapped: the mapping sees the bytes, and keeps the file (in use) after `f` is closed.
    let mut m = f.map(0..more.len() as u64, ubc::Access::ReadWrite, ubc::Sharing::Shared).unwrap();
    assert!(m[..] == more[..]);
    m[..4].copy_from_slice(b"MAPD");
    m.flush().unwrap();
    let mut head = [0; 4];
    f.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(&head, b"MAPD");
    assert!(deleted() > 0, "the open file holds its deleted host file");
    drop(f);
    assert!(deleted() > 0, "the mapping holds the deleted file");
    assert_eq!(stack.open_files(), (0, 1, 1), "in use by the mapping, detached");
    drop(m);
    assert_eq!(deleted(), 0, "a descriptor of the deleted file outlived its last close");
    // Only `warmup` is left, idle in the pool.
    assert_eq!(stack.open_files(), (0, 1, 0));
    // A new file of the name starts empty.
    assert_eq!(top.create("doomed").unwrap().len().unwrap(), 0);
}

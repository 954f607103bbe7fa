//! Its own test binary (process): it counts the cache's threads.

mod common;

use ubc_stack::Stack;

fn cache_threads() -> usize {
    common::threads_named("ubc-")
}

/// Dropping the stack and its files shuts the cache down — writing back what was not
/// synced, through every layer — even though the layers' pagers hold files of that cache.
#[test]
fn dropping_the_stack_writes_back_and_shuts_the_cache_down() {
    let tmp = tempfile::tempdir().unwrap();
    let key = tmp.path().join("key");
    ubc_stack::encrypt::Key::generate().write_file(&key).unwrap();
    let spec = format!("dir:{} | zstd | aead:keyfile={}", tmp.path().display(), key.display());
    {
        let s = Stack::open(&spec, ubc::Cache::new(64 << 20).unwrap()).unwrap();
        let f = s.top().create("late.txt").unwrap();
        f.write_at(b"written, never synced", 0).unwrap();
        // Start an I/O pool (one per depth, started on first use) with another file's
        // writeback — of two runs: a writeback writes its last run itself and gives the
        // others to the pool; `late.txt` stays unsynced.
        let g = s.top().create("synced.txt").unwrap();
        g.write_at(b"synced", 0).unwrap();
        g.write_at(b"synced", 1 << 20).unwrap();
        g.sync().unwrap();
        // Threads name themselves once running: poll.
        let mut up = 0;
        for _ in 0..200 {
            up = cache_threads();
            if up >= 3 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(up >= 3, "the cache runs its threads ({up} seen)");
    }
    let mut n = cache_threads();
    for _ in 0..200 {
        if n == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        n = cache_threads();
    }
    assert_eq!(n, 0, "cache threads still running after the stack was dropped");
    let s = Stack::open(&spec, ubc::Cache::new(64 << 20).unwrap()).unwrap();
    let mut b = vec![0u8; 21];
    s.top().open("late.txt").unwrap().read_exact_at(&mut b, 0).unwrap();
    assert_eq!(&b, b"written, never synced");
}

//! Windows (ubc_alloc / ubc_release): zero-copy loans of cached pages (copy on write:
//! tests/loans.rs).

mod common;
use common::*;
use std::sync::Arc;
use ubc::pager::MemPager;
use ubc::{Access, Cache};

#[test]
fn window_is_clipped_at_eof_and_window_boundary() {
    let cache = Cache::builder().budget(4 << 20).window_size(64 << 10).build().unwrap();
    let f = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    f.write_at(&vec![1u8; 200_000], 0).unwrap();
    let w = f.window(60_000, 100_000).unwrap();
    assert_eq!(w.len(), 65536 - 60_000, "ends at the window boundary, like ubc_alloc");
    drop(w);
    let w = f.window(199_000, 5000).unwrap();
    assert_eq!(w.len(), 1000, "ends at EOF");
    drop(w);
    assert_eq!(f.window(300_000, 10).unwrap().len(), 0, "past EOF: empty");
}

#[test]
fn writable_window_marks_dirty_extends_and_reaches_the_pager() {
    let cache = small_cache(1 << 20);
    let mem = Arc::new(MemPager::new());
    let f = cache.open(mem.clone(), Access::ReadWrite).unwrap();
    f.write_at(b"0123456789", 0).unwrap();
    f.sync().unwrap();
    {
        let mut w = f.window_mut(5, 10).unwrap();
        assert_eq!(w.len(), 10);
        assert_eq!(&w[..5], b"56789", "existing bytes are read in first");
        assert_eq!(&w[5..], &[0; 5], "bytes past EOF are zero");
        w.copy_from_slice(b"abcdefghij");
    }
    assert_eq!(f.len().unwrap(), 15);
    assert_eq!(f.stats().dirty_bytes, 4096);
    let mut b = [0u8; 15];
    f.read_at(&mut b, 0).unwrap();
    assert_eq!(&b, b"01234abcdefghij");
    f.sync().unwrap();
    assert_eq!(store_contents(&*mem), b"01234abcdefghij");
}

#[test]
fn pinned_pages_survive_pressure() {
    // Hold a window while streaming 20x the budget through the cache: the pinned pages
    // must stay resident and unchanged, and the budget must still hold.
    let budget = 256 << 10;
    let cache = small_cache(budget);
    let f = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    f.write_at(&pattern(5, 0, 8192), 0).unwrap();
    let w = f.window(0, 8192).unwrap();
    let ptr = w.as_ptr();
    let g = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    let chunk = pattern(6, 0, 64 << 10);
    for i in 0..80u64 {
        g.write_at(&chunk, i * chunk.len() as u64).unwrap();
        assert!(cache.stats().totals.resident_bytes <= budget);
    }
    assert_eq!(w.as_ptr(), ptr);
    assert_same(&w, &pattern(5, 0, 8192), "pinned window after pressure");
    assert!(f.stats().resident_bytes >= 8192, "pinned pages were not evicted");
    assert!(cache.stats().totals.evictions > 0);
    drop(w);
}

#[test]
fn windows_are_bounded_and_recycled() {
    // Many more chunks than windows: mappings are retired and remade, contents stay right.
    // No read-ahead and nothing left to write back while reading: read-ahead jobs and
    // write-back batches hold the pages of many chunks at once (up to `readahead_max` and
    // `max_put`, 32 and 16 chunks of 64 KiB here), each chunk needing its window, which
    // pushed the table past a bound of 16 now and then (2 to 3 runs in 30 failed at 17).
    let cache = Cache::builder().budget(8 << 20).window_size(64 << 10).max_windows(8).readahead(0, 0).build().unwrap();
    let f = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    let data = pattern(8, 0, 4 << 20); // 64 chunks
    f.write_at(&data, 0).unwrap();
    f.sync().unwrap();
    let mut back = vec![0u8; data.len()];
    for _ in 0..3 {
        f.read_at(&mut back, 0).unwrap();
        assert_same(&back, &data, "read through recycled windows");
    }
    // A soft bound: exceeded only while more chunks than that are held at once (one reader
    // holds one chunk at a time), and pulled back by the next mappings.
    let st = cache.stats();
    assert!(st.windows <= 9, "live windows {} above max 8", st.windows);
    assert!(st.window_retires > 100, "windows recycled: {}", st.window_retires);
    // Quiet now: a few single-page reads of unmapped chunks bring it back under the bound.
    let mut b = [0u8; 1];
    for i in 0..4u64 {
        f.read_at(&mut b, i * (64 << 10) + 7).unwrap();
    }
    assert!(cache.stats().windows <= 8, "live windows {} stayed above max 8", cache.stats().windows);
}

#[test]
fn writable_window_shows_existing_data_of_non_resident_pages() {
    let cache = small_cache(1 << 20);
    let mem = Arc::new(MemPager::new());
    ubc::Pager::put_pages(&*mem, 0, &pattern(4, 0, 8192)).unwrap();
    let f = cache.open(mem.clone(), Access::ReadWrite).unwrap();
    let mut w = f.window_mut(0, 8192).unwrap();
    assert_same(&w, &pattern(4, 0, 8192), "whole-page writable window over existing data");
    w[0] = 0;
    drop(w);
    f.sync().unwrap();
    let mut want = pattern(4, 0, 8192);
    want[0] = 0;
    assert_same(&store_contents(&*mem), &want, "only the changed byte changed");
}

/// Small files are copied to and from the cache with `pread`/`pwrite` on the memfd, not
/// through a window (mapping one, faulting its pages in and unmapping it — a TLB shootdown
/// on every CPU of the process — would be most of the cost of touching a small file a few
/// times), until one is copied often enough to be hot; a file larger than a window keeps
/// windows; a `Window` guard maps one for a small file too, and copies then go through it.
/// The bytes are the same either way.
#[test]
fn small_files_are_copied_without_windows() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::builder().budget(8 << 20).window_size(256 << 10).build().unwrap();
    let maps = |c: &Cache| c.stats().window_maps;
    for i in 0..200u64 {
        let p = dir.path().join(format!("f{i}"));
        let f = cache.open(Arc::new(ubc::pager::FilePager::create(&p).unwrap()), Access::ReadWrite).unwrap();
        f.write_at(&pattern(i, 0, 10_000), 0).unwrap();
        f.set_len(9_000).unwrap();
        f.sync().unwrap();
        cache.evict_all().unwrap();
        let mut b = vec![0u8; 9_000];
        f.read_exact_at(&mut b, 0).unwrap();
        assert!(b == pattern(i, 0, 9_000), "f{i} read back");
    }
    for i in 0..200u64 {
        assert!(std::fs::read(dir.path().join(format!("f{i}"))).unwrap() == pattern(i, 0, 9_000), "f{i} stored");
    }
    assert_eq!(maps(&cache), 0, "no window for files of one chunk");

    // A small file copied many times (1-byte reads) is hot: it gets its window.
    let hot = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    hot.write_at(&pattern(5, 0, 3000), 0).unwrap();
    let mut got = Vec::new();
    for i in 0..3000u64 {
        let mut b = [0u8; 1];
        hot.read_exact_at(&mut b, i).unwrap();
        got.push(b[0]);
    }
    assert!(got == pattern(5, 0, 3000), "1-byte reads");
    assert_eq!(maps(&cache), 1, "a small file copied again and again gets a window");
    drop(hot);

    // A window guard maps one; later copies of that chunk use it and see its stores.
    let f = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    f.write_at(&pattern(7, 0, 5000), 0).unwrap();
    let mut w = f.window_mut(100, 50).unwrap();
    w.copy_from_slice(&[0xAB; 50]);
    drop(w);
    assert_eq!(maps(&cache), 2);
    let mut b = vec![0u8; 5000];
    f.read_exact_at(&mut b, 0).unwrap();
    let mut want = pattern(7, 0, 5000);
    want[100..150].fill(0xAB);
    assert!(b == want, "a store through the window and the copies agree");

    // Larger than a window: copies map windows.
    let before = maps(&cache);
    let big = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    big.write_at(&pattern(9, 0, 600_000), 0).unwrap();
    let mut b = vec![0u8; 600_000];
    big.read_exact_at(&mut b, 0).unwrap();
    assert!(b == pattern(9, 0, 600_000));
    assert!(maps(&cache) > before, "a file of several chunks is copied through windows");
}

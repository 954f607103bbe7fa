//! Page loanout with copy-on-write (issue 20, item 2): a read window lends the cache's own
//! pages and keeps showing the bytes it was taken with, whatever changes them later.

mod common;
use common::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::time::{Duration, Instant};
use ubc::pager::{FilePager, MemPager};
use ubc::{Access, Cache, Sharing};

const PS: usize = 4096;

/// Whether the page at `addr` of this process is a file page (the kernel's pagemap bit 61,
/// readable without privileges): a window's page is the cache's memfd page until a write
/// copies it, then an anonymous copy.
fn is_file_page(addr: *const u8) -> bool {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open("/proc/self/pagemap").unwrap();
    let mut e = [0u8; 8];
    f.read_exact_at(&mut e, (addr as u64 / PS as u64) * 8).unwrap();
    let e = u64::from_le_bytes(e);
    assert!(e & (1 << 63) != 0, "page at {addr:p} not present");
    e & (1 << 61) != 0
}

/// Touch every page of `w` (so that the pagemap shows them) and return a copy.
fn snapshot(w: &[u8]) -> Vec<u8> {
    w.to_vec()
}

#[test]
fn a_window_reads_the_cached_pages_until_a_write_copies_them() {
    let cache = small_cache(1 << 20);
    let f = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    f.write_at(&pattern(1, 0, 100_000), 0).unwrap();
    let a = f.window(5000, 3000).unwrap();
    let b = f.window(5000, 3000).unwrap();
    assert_eq!(a.len(), 3000);
    assert_same(&a, &pattern(1, 5000, 3000), "window contents");
    assert_same(&b, &pattern(1, 5000, 3000), "second window contents");
    assert!(is_file_page(a.as_ptr()) && is_file_page(b.as_ptr()), "a window is the cache's page, not a copy");
    let st = cache.stats();
    assert_eq!((st.loans, st.loans_taken, st.loan_copies), (2, 2, 0), "{st}");

    f.write_at(b"XYZ", 5010).unwrap();
    assert_same(&a, &pattern(1, 5000, 3000), "a window after a write of its page");
    assert_same(&b, &pattern(1, 5000, 3000), "the other window after the write");
    assert!(!is_file_page(a.as_ptr()) && !is_file_page(b.as_ptr()), "each window holds a copy now");
    let mut back = [0u8; 3];
    f.read_exact_at(&mut back, 5010).unwrap();
    assert_eq!(&back, b"XYZ", "the cache took the write");
    let st = cache.stats();
    assert_eq!(a.as_ptr(), b.as_ptr(), "the two windows share their chunk's view");
    assert_eq!((st.loan_copies, st.loan_copy_bytes, st.loan_views), (1, PS as u64, 1), "one copy for both: {st}");

    // A second write of the same page copies nothing more.
    f.write_at(b"UVW", 5020).unwrap();
    assert_eq!(cache.stats().loan_copies, 1);
    assert_same(&a, &pattern(1, 5000, 3000), "after a second write");

    // A window taken now shows the cache's bytes as they are now.
    let c = f.window(5000, 3000).unwrap();
    let mut want = pattern(1, 5000, 3000);
    want[10..13].copy_from_slice(b"XYZ");
    want[20..23].copy_from_slice(b"UVW");
    assert_same(&c, &want, "a window taken after the writes");
    assert!(is_file_page(c.as_ptr()));
    assert_eq!(cache.stats().loan_views, 2, "a fresh view: the first one holds a copy");
    drop((a, b, c));
    let st = cache.stats();
    assert_eq!((st.loans, st.loan_copy_bytes), (0, 0), "copies go with their windows: {st}");
    // An intact view is kept for the next window of its chunk.
    let d = f.window(5000, 100).unwrap();
    assert_same(&d, &want[..100], "a window through a kept view");
    assert_eq!(cache.stats().loan_views, 2, "no new view");
}

/// Every way a page can change gives a window that lent it its copy first: `write_at`
/// through another handle, a writable window, a truncation into the page, a store through a
/// shared writable mapping made before or after the window, and a write of the window's
/// own bytes back at their own offset.
#[test]
fn every_path_that_changes_a_lent_page_copies_it_first() {
    let dir = tempfile::tempdir().unwrap();
    let cache = small_cache(4 << 20);
    let path = dir.path().join("f");
    let f = cache.open(Arc::new(FilePager::create(&path).unwrap()), Access::ReadWrite).unwrap();
    let len = 16 * PS;
    f.write_at(&pattern(2, 0, len), 0).unwrap();
    let g = cache.open_path(&path, Access::ReadWrite).unwrap(); // the same object, another handle
    let mut expect = pattern(2, 0, len);

    // write_at through the other handle.
    let w = f.window(0, 2 * PS).unwrap();
    g.write_at(&[0xA1; 100], 50).unwrap();
    assert_same(&w, &pattern(2, 0, 2 * PS), "after write_at through another handle");
    expect[50..150].fill(0xA1);
    drop(w);

    // A writable window over the lent page.
    let w = f.window(PS as u64, PS).unwrap();
    let before = snapshot(&w);
    {
        let mut m = g.window_mut(PS as u64 + 7, 9).unwrap();
        m.copy_from_slice(&[0xB2; 9]);
    }
    expect[PS + 7..PS + 16].fill(0xB2);
    assert_same(&w, &before, "after a writable window's stores");
    drop(w);

    // A store through a shared writable mapping made before the window.
    let mut map = g.map(0..len as u64, Access::ReadWrite, Sharing::Shared).unwrap();
    let w = f.window(2 * PS as u64, PS).unwrap();
    let before = snapshot(&w);
    // SAFETY: within the mapping.
    unsafe { map.as_mut_ptr().add(2 * PS + 1).write_volatile(0xC3) };
    expect[2 * PS + 1] = 0xC3;
    assert_same(&w, &before, "after a store through an older mapping");
    drop(w);
    drop(map);

    // ... and through one made after the window.
    let w = f.window(3 * PS as u64, PS).unwrap();
    let before = snapshot(&w);
    let mut map = g.map(0..len as u64, Access::ReadWrite, Sharing::Shared).unwrap();
    // SAFETY: within the mapping.
    unsafe { map.as_mut_ptr().add(3 * PS + 2).write_volatile(0xD4) };
    expect[3 * PS + 2] = 0xD4;
    assert_same(&w, &before, "after a store through a newer mapping");
    drop(w);
    drop(map);

    // The window's own bytes written back at their own offset (a copy between two views
    // of one page until the write copies it for the window).
    let w = f.window(4 * PS as u64 + 100, 200).unwrap();
    let before = snapshot(&w);
    assert_eq!(f.write_at(&w, 4 * PS as u64 + 100).unwrap(), 200);
    assert_same(&w, &before, "after writing the window onto itself");
    drop(w);
    // ... and shifted by one byte.
    let w = f.window(4 * PS as u64 + 100, 200).unwrap();
    assert_eq!(f.write_at(&w, 4 * PS as u64 + 101).unwrap(), 200);
    let shifted = expect[4 * PS + 100..4 * PS + 300].to_vec();
    expect[4 * PS + 101..4 * PS + 301].copy_from_slice(&shifted);
    assert_same(&w, &shifted, "after writing the window one byte further on");
    drop(w);

    // A truncation into the lent page zeroes the cache's copy, not the window's.
    let w = f.window(15 * PS as u64, PS).unwrap();
    let before = snapshot(&w);
    f.set_len(15 * PS as u64 + 10).unwrap();
    expect.truncate(15 * PS + 10);
    assert_same(&w, &before, "after a truncation into the page");
    drop(w);
    f.set_len(16 * PS as u64).unwrap();
    expect.resize(16 * PS, 0);

    let mut back = vec![0u8; len];
    f.read_exact_at(&mut back, 0).unwrap();
    assert_same(&back, &expect, "the file took every change");
    f.sync().unwrap();
    assert_same(&std::fs::read(&path).unwrap(), &expect, "and stored them");
    let st = cache.stats();
    assert_eq!(st.loans, 0);
    assert!(st.loan_copies >= 6, "each path copied its page: {st}");
}

/// Windows taken and read while writers rewrite their pages (whole pages of one value each
/// through `write_at`, single bytes through a shared mapping): a window never changes
/// after it was taken, and a page written only with `write_at` shows one write's value
/// (a write in progress when the window is taken is waited for).
#[test]
fn windows_taken_under_contention_never_change() {
    let cache = Cache::builder().budget(8 << 20).build().unwrap();
    let pages = 32usize;
    let copied = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    copied.write_at(&vec![0u8; pages * PS], 0).unwrap();
    let mapped = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    mapped.write_at(&vec![0u8; pages * PS], 0).unwrap();
    let copied = Arc::new(copied);
    let mapped = Arc::new(mapped);
    let stop = Arc::new(AtomicBool::new(false));
    let checked = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for t in 0..2u64 {
        let (f, stop) = (copied.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut v = 1 + t as u8 * 100;
            let mut i = t as usize;
            while !stop.load(Relaxed) {
                f.write_at(&vec![v; PS], ((i * 7) % pages * PS) as u64).unwrap();
                v = if v == 99 + t as u8 * 100 { 1 + t as u8 * 100 } else { v + 1 };
                i += 1;
            }
        }));
    }
    {
        let (f, stop) = (mapped.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut m = f.map(0..(pages * PS) as u64, Access::ReadWrite, Sharing::Shared).unwrap();
            let mut i = 0usize;
            while !stop.load(Relaxed) {
                // SAFETY: within the mapping.
                unsafe { m.as_mut_ptr().add((i * 4099) % (pages * PS)).write_volatile(i as u8) };
                i += 1;
                if i.is_multiple_of(1000) {
                    std::thread::yield_now();
                }
            }
        }));
    }
    for r in 0..2u64 {
        let (copied, mapped, stop, checked) = (copied.clone(), mapped.clone(), stop.clone(), checked.clone());
        threads.push(std::thread::spawn(move || {
            let mut i = r as usize;
            while !stop.load(Relaxed) {
                let first = (i * 5) % (pages - 3);
                let n = 1 + i % 3;
                for (f, whole) in [(&copied, true), (&mapped, false)] {
                    let w = f.window((first * PS) as u64, n * PS).unwrap();
                    let seen = w.to_vec();
                    if whole {
                        for p in 0..n {
                            let pg = &seen[p * PS..(p + 1) * PS];
                            assert!(pg.iter().all(|&b| b == pg[0]), "page {} of a window is torn", first + p);
                        }
                    }
                    std::thread::sleep(Duration::from_micros(200));
                    assert!(w[..] == seen[..], "a window changed after it was taken (page {first}, {n} pages)");
                    checked.fetch_add(1, Relaxed);
                }
                i += 1;
            }
        }));
    }
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(50));
        if threads.iter().any(|t| t.is_finished()) {
            break;
        }
    }
    stop.store(true, Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    let st = cache.stats();
    assert!(checked.load(Relaxed) > 100, "windows checked: {}", checked.load(Relaxed));
    assert!(st.loan_copies > 0, "writes met lent pages: {st}");
    assert_eq!((st.loans, st.loan_copy_bytes), (0, 0));
}

/// A truncation or an invalidation of lent pages does not wait for the windows (which
/// the same thread holds here: waiting would never end): each window keeps a copy and lets
/// go of its page (UVM's owner freeing a loaned page), and the cache drops it.
#[test]
fn truncation_and_invalidation_take_lent_pages_back_without_waiting() {
    guarded("truncate and invalidate beside windows", 60, || {
        let cache = small_cache(4 << 20);
        let mem = Arc::new(MemPager::new());
        let f = cache.open(mem.clone(), Access::ReadWrite).unwrap();
        f.write_at(&pattern(3, 0, 16 * PS), 0).unwrap();
        f.sync().unwrap();

        // Invalidation: the store changed underneath; the window keeps what it was lent.
        let w = f.window(2 * PS as u64, 2 * PS).unwrap();
        ubc::Pager::put_pages(&*mem, 0, &pattern(4, 0, 16 * PS)).unwrap();
        f.invalidate(0..16 * PS as u64, ubc::Length::Keep).unwrap();
        assert_same(&w, &pattern(3, 2 * PS as u64, 2 * PS), "a window after an invalidation");
        let mut back = vec![0u8; 2 * PS];
        f.read_exact_at(&mut back, 2 * PS as u64).unwrap();
        assert_same(&back, &pattern(4, 2 * PS as u64, 2 * PS), "the cache reads the store again");
        let st = cache.stats();
        assert_eq!(st.loan_pages_handed_back, 2, "{st}");
        drop(w);

        // Truncation below the window, with a second window of the same pages.
        let a = f.window(PS as u64, 3 * PS).unwrap();
        let b = f.window(2 * PS as u64, PS).unwrap();
        f.set_len(100).unwrap();
        assert_same(&a, &pattern(4, PS as u64, 3 * PS), "a window after a truncation below it");
        assert_same(&b, &pattern(4, 2 * PS as u64, PS), "the second window");
        assert_eq!(f.len().unwrap(), 100);
        assert_eq!(cache.stats().loan_pages_handed_back, 2 + 4);
        // The file grows again: zeros, whatever the windows hold.
        f.set_len(4 * PS as u64).unwrap();
        let mut back = vec![1u8; 3 * PS];
        f.read_exact_at(&mut back, PS as u64).unwrap();
        assert!(back.iter().all(|&x| x == 0), "bytes past the truncation read as zeros");
        drop((a, b));
        let st = cache.stats();
        assert_eq!((st.loans, st.loan_copy_bytes), (0, 0), "{st}");
        assert!(st.totals.resident_bytes <= 4 * PS as u64, "no page is left pinned: {st}");
    });
}

/// A window waits for a `WindowMut` of its pages held by another thread (and then shows its
/// bytes whole); one held by the same thread would wait for itself, and is refused.
#[test]
fn a_window_waits_for_another_threads_writable_window_and_refuses_its_own() {
    guarded("windows beside writable windows", 60, || {
        let cache = small_cache(4 << 20);
        let f = Arc::new(cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap());
        f.write_at(&pattern(6, 0, 4 * PS), 0).unwrap();
        {
            let mut m = f.window_mut(100, 50).unwrap();
            m.fill(0xCC);
            let e = f.window(0, PS).err().expect("a window of pages this thread writes is refused");
            assert!(matches!(e, ubc::Error::InvalidArgument(_)), "{e:?}");
            assert_eq!(f.window(2 * PS as u64, PS).unwrap().len(), PS, "other pages are lent");
            let (tx, rx) = std::sync::mpsc::channel();
            let g = f.clone();
            let t = std::thread::spawn(move || {
                let w = g.window(0, 200).unwrap();
                tx.send(w.to_vec()).unwrap();
            });
            assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "another thread's window waits");
            drop(m);
            let seen = rx.recv_timeout(Duration::from_secs(10)).expect("the window after the writer");
            t.join().unwrap();
            let mut want = pattern(6, 0, 200);
            want[100..150].fill(0xCC);
            assert_same(&seen, &want, "the window shows the writable window's bytes whole");
        }
        assert_eq!(f.window(0, 10).unwrap().len(), 10, "lent again once the writable window is gone");
    });
}

//! Every public call of the core with bad arguments: a typed error, never a panic, an abort
//! or a hang. This file is the complete list (some cases are also in `errors.rs` and
//! `file_semantics.rs`, next to the behaviour they belong to). Each case runs on a watchdog
//! thread, so a hang fails it instead of blocking the suite.

#[macro_use]
mod common;
use common::*;
use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::Arc;
use std::time::Duration;
use ubc::pager::MemPager;
use ubc::{Access, Cache, Error, Pager, Sharing};

/// Largest file length ubc supports: 2^63 - 64 KiB.
const MAX: u64 = (i64::MAX as u64) & !0xffff;

fn overflow<T: std::fmt::Debug>(r: ubc::Result<T>, what: &str) {
    match r {
        Err(Error::OffsetOverflow { .. }) => {}
        other => panic!("{what}: expected OffsetOverflow, got {other:?}"),
    }
}

fn mem_file(cache: &Cache) -> ubc::File {
    cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap()
}

/// A memory pager that refuses writes (`is_writable` false).
struct ReadOnlyPager(MemPager);

impl Pager for ReadOnlyPager {
    forward_to!(0: get_pages, len, sync);
    fn put_pages(&self, _: u64, _: &[u8]) -> std::io::Result<()> {
        Err(std::io::ErrorKind::PermissionDenied.into())
    }
    fn set_len(&self, _: u64) -> std::io::Result<()> {
        Err(std::io::ErrorKind::PermissionDenied.into())
    }
    fn is_writable(&self) -> bool {
        false
    }
    fn describe(&self) -> String {
        "read-only memory".into()
    }
}

// ------------------------------------------------------------------ offsets and lengths

#[test]
fn offsets_past_2_63_and_overflowing_ends() {
    guarded("offsets", 60, || {
        let cache = small_cache(4 << 20);
        let f = mem_file(&cache);
        let mut b = [0u8; 10];
        for off in [MAX, MAX + 1, 1 << 63, u64::MAX - 9, u64::MAX - 1, u64::MAX] {
            overflow(f.read_at(&mut b, off), &format!("read_at {off}"));
            overflow(f.read_exact_at(&mut b, off), &format!("read_exact_at {off}"));
            overflow(f.write_at(&b, off), &format!("write_at {off}"));
            overflow(f.window(off, 10).map(|w| w.len()), &format!("window {off}"));
            overflow(f.window_mut(off, 10).map(|w| w.len()), &format!("window_mut {off}"));
        }
        // offset + len past the end, offset itself fine.
        overflow(f.read_at(&mut b, MAX - 5), "read_at straddling the end");
        overflow(f.write_at(&b, MAX - 5), "write_at straddling the end");
        overflow(f.window(0, usize::MAX).map(|w| w.len()), "window of usize::MAX bytes");
        overflow(f.window_mut(1, usize::MAX).map(|w| w.len()), "window_mut of usize::MAX bytes");
        // Empty buffers at huge offsets: still checked (the offset itself is out of range).
        overflow(f.read_at(&mut [], u64::MAX), "empty read_at at u64::MAX");
        overflow(f.write_at(&[], u64::MAX), "empty write_at at u64::MAX");
        for len in [MAX + 1, 1 << 63, u64::MAX] {
            overflow(f.set_len(len), &format!("set_len {len}"));
        }
        assert_eq!(f.len().unwrap(), 0, "nothing changed the length");
        // The largest length itself is fine (a sparse file), and the last byte before it.
        f.set_len(MAX).unwrap();
        f.write_at(b"z", MAX - 1).unwrap();
        let mut z = [0u8; 1];
        f.read_exact_at(&mut z, MAX - 1).unwrap();
        assert_eq!(&z, b"z");
        // Reads past the end of the file (but in range) are short, not errors.
        f.set_len(100).unwrap();
        assert_eq!(f.read_at(&mut b, 1 << 40).unwrap(), 0);
        assert_eq!(f.window(1 << 40, 10).unwrap().len(), 0);
    });
}

/// A growth the pager refuses (a layer's own limit, an I/O error) leaves the length as it
/// was. (Published first, the file would claim a length its store never took, and every
/// later sync would fail trying to reconcile it.)
#[test]
fn a_refused_growth_leaves_the_length() {
    guarded("refused growth", 60, || {
        let cache = small_cache(4 << 20);
        let (f, fault, mem) = injected_file(&cache);
        f.write_at(b"abc", 0).unwrap();
        f.sync().unwrap();
        fault.fail_set_len(Some(libc::EINVAL));
        assert!(matches!(f.set_len(1 << 40), Err(Error::Io { op: ubc::PagerOp::SetLen, .. })));
        assert_eq!(f.len().unwrap(), 3);
        f.sync().unwrap();
        assert_eq!(mem.len().unwrap(), 3);
        fault.heal();
        f.set_len(10).unwrap();
        assert_eq!(f.len().unwrap(), 10);
        f.sync().unwrap();
        assert_eq!(mem.len().unwrap(), 10);
    });
}

#[test]
fn clean_and_invalidate_take_any_range() {
    guarded("clean/invalidate", 60, || {
        let cache = small_cache(4 << 20);
        let f = mem_file(&cache);
        f.write_at(&pattern(1, 0, 50_000), 0).unwrap();
        #[allow(clippy::reversed_empty_ranges)]
        let ranges =
            [0..u64::MAX, u64::MAX - 1..u64::MAX, 1 << 63..u64::MAX, MAX..MAX + 1, 100..5, u64::MAX..0, 7..7, 0..1];
        for r in ranges {
            // Ranges are clipped to the file: nothing to do past its end, no error needed.
            f.clean(r.clone()).unwrap_or_else(|e| panic!("clean {r:?}: {e}"));
            f.invalidate(r.clone(), ubc::Length::Keep).unwrap_or_else(|e| panic!("invalidate {r:?}: {e}"));
            f.invalidate(r.clone(), ubc::Length::Reload).unwrap_or_else(|e| panic!("invalidate+reload {r:?}: {e}"));
        }
        let mut back = vec![0u8; 50_000];
        f.read_exact_at(&mut back, 0).unwrap();
        assert_same(&back, &pattern(1, 0, 50_000), "data survives every clean/invalidate");
    });
}

#[test]
fn map_ranges_empty_reversed_huge_and_past_2_63() {
    guarded("map ranges", 60, || {
        let cache = small_cache(4 << 20);
        let f = mem_file(&cache);
        f.write_at(b"hello", 0).unwrap();
        #[allow(clippy::reversed_empty_ranges)]
        let empty = [5..5, 10..5, 0..0, u64::MAX..u64::MAX, u64::MAX..0];
        for r in empty {
            match f.map(r.clone(), Access::ReadOnly, Sharing::Shared) {
                Err(Error::InvalidArgument(_)) => {}
                other => panic!("map {r:?}: expected InvalidArgument, got {:?}", other.map(|m| m.len())),
            }
        }
        for r in [MAX..MAX + 4096, 1 << 63..(1 << 63) + 1, u64::MAX - 4096..u64::MAX, 0..u64::MAX, 0..MAX + 1] {
            match f.map(r.clone(), Access::ReadOnly, Sharing::Shared) {
                Err(Error::OffsetOverflow { .. }) | Err(Error::InvalidArgument(_)) => {}
                other => panic!("map {r:?}: expected an argument error, got {:?}", other.map(|m| m.len())),
            }
        }
        // Huge but inside the supported range: more address space than there is, or allowed
        // (nothing is touched); either way a typed answer.
        for r in [0..1u64 << 47, 0..MAX, MAX - 4096..MAX] {
            match f.map(r.clone(), Access::ReadOnly, Sharing::Private) {
                Ok(m) => drop(m),
                Err(Error::Os { .. }) | Err(Error::InvalidArgument(_)) | Err(Error::BudgetExceeded { .. }) => {}
                Err(e) => panic!("map {r:?}: unexpected error {e:?}"),
            }
        }
        // And the file still maps normally.
        let m = f.map(0..5, Access::ReadOnly, Sharing::Shared).unwrap();
        assert_eq!(&m[..], b"hello");
    });
}

#[test]
fn seek_and_io_adapters_with_bad_positions() {
    guarded("seek", 60, || {
        let cache = small_cache(4 << 20);
        let mut f = mem_file(&cache);
        f.write_at(b"abc", 0).unwrap();
        for pos in [SeekFrom::End(-4), SeekFrom::End(i64::MIN), SeekFrom::Current(-1), SeekFrom::Current(i64::MIN)] {
            assert_eq!(f.seek(pos).unwrap_err().kind(), std::io::ErrorKind::InvalidInput, "{pos:?}");
        }
        f.seek(SeekFrom::Start(i64::MAX as u64)).unwrap();
        assert_eq!(f.seek(SeekFrom::Current(1)).unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
        assert_eq!(f.seek(SeekFrom::End(i64::MAX)).unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
        // A position past the supported range: reads and writes fail with FileTooLarge.
        f.seek(SeekFrom::Start(u64::MAX)).unwrap();
        let mut b = [0u8; 4];
        assert_eq!(f.read(&mut b).unwrap_err().kind(), std::io::ErrorKind::FileTooLarge);
        assert_eq!(f.write(b"x").unwrap_err().kind(), std::io::ErrorKind::FileTooLarge);
        let e = f.write(b"x").unwrap_err();
        assert!(
            matches!(e.get_ref().and_then(|i| i.downcast_ref::<Error>()), Some(Error::OffsetOverflow { .. })),
            "{e:?}"
        );
    });
}

// ------------------------------------------------------------------ the cache builder

/// Build with `b`; it must be refused with `InvalidArgument`, or work (a small workload).
fn build_or_refuse(what: String, b: ubc::CacheBuilder) -> Option<String> {
    guarded(&what.clone(), 60, move || match b.build() {
        Err(Error::InvalidArgument(m)) => Some(m),
        Err(e) => panic!("{what}: expected InvalidArgument, got {e:?}"),
        Ok(c) => {
            let f = mem_file(&c);
            let data = pattern(3, 0, 100_000);
            f.write_at(&data, 0).unwrap_or_else(|e| panic!("{what}: write: {e}"));
            let mut back = vec![0u8; data.len()];
            f.read_exact_at(&mut back, 0).unwrap_or_else(|e| panic!("{what}: read: {e}"));
            assert_same(&back, &data, &what);
            f.sync().unwrap_or_else(|e| panic!("{what}: sync: {e}"));
            drop(f.window(0, 4096).unwrap_or_else(|e| panic!("{what}: window: {e}")));
            c.evict_all().unwrap_or_else(|e| panic!("{what}: evict_all: {e}"));
            f.read_exact_at(&mut back, 0).unwrap_or_else(|e| panic!("{what}: read after eviction: {e}"));
            assert_same(&back, &data, &what);
            None
        }
    })
}

#[test]
fn builder_page_sizes() {
    for ps in [0usize, 1, 3, 2048, 4095, 4097, 3 * 4096, 6000, usize::MAX, 1 << 62, 1usize << 63] {
        let m = build_or_refuse(format!("page_size {ps}"), Cache::builder().page_size(ps));
        assert!(m.is_some(), "page size {ps} was accepted");
    }
    // Powers of two from the system page up are fine (with a budget of a few pages).
    for ps in [4096usize, 8192, 1 << 16] {
        assert!(
            build_or_refuse(format!("page_size {ps}"), Cache::builder().page_size(ps).budget(64 * ps as u64)).is_none()
        );
    }
}

#[test]
fn builder_budgets() {
    // Smaller than two pages: refused.
    for b in [0u64, 1, 4095, 4096, 8191] {
        let m = build_or_refuse(format!("budget {b}"), Cache::builder().budget(b));
        assert!(m.is_some_and(|m| m.contains("budget")), "budget {b}");
    }
    // Larger than the machine could ever hold: refused, not an abort while sizing tables.
    for b in [u64::MAX, 1 << 63, 1 << 60, u64::MAX / 2 + 1] {
        let m = build_or_refuse(format!("budget {b}"), Cache::builder().budget(b));
        assert!(m.is_some_and(|m| m.contains("budget")), "budget {b}");
    }
    // Tiny but valid budgets work (reads and writes larger than the budget included).
    for b in [8192u64, 3 * 4096, 16 * 4096] {
        assert!(build_or_refuse(format!("budget {b}"), Cache::builder().budget(b)).is_none(), "budget {b}");
    }
}

#[test]
fn builder_other_settings() {
    let cases: Vec<(String, ubc::CacheBuilder)> = vec![
        ("window_size 0".into(), Cache::builder().window_size(0)),
        ("window_size 3".into(), Cache::builder().window_size(3)),
        ("window_size 2048".into(), Cache::builder().window_size(2048)),
        ("window_size 2^63".into(), Cache::builder().window_size(1 << 63)),
        ("window_size usize::MAX".into(), Cache::builder().window_size(usize::MAX)),
        ("max_windows 0".into(), Cache::builder().budget(1 << 20).max_windows(0)),
        ("max_windows 1".into(), Cache::builder().budget(1 << 20).max_windows(1)),
        ("max_windows usize::MAX".into(), Cache::builder().budget(1 << 20).max_windows(usize::MAX)),
        ("max_fill 0".into(), Cache::builder().budget(1 << 20).max_fill(0)),
        ("max_fill usize::MAX".into(), Cache::builder().budget(1 << 20).max_fill(usize::MAX)),
        ("max_put 0".into(), Cache::builder().budget(1 << 20).max_put(0)),
        ("max_put usize::MAX".into(), Cache::builder().budget(1 << 20).max_put(usize::MAX)),
        ("watermarks 0 0".into(), Cache::builder().budget(1 << 20).watermarks(0, 0)),
        ("watermarks max".into(), Cache::builder().budget(1 << 20).watermarks(u64::MAX, u64::MAX)),
        ("watermarks high < low".into(), Cache::builder().budget(1 << 20).watermarks(1 << 19, 4096)),
        ("reserve_timeout 0".into(), Cache::builder().budget(1 << 20).reserve_timeout(Duration::ZERO)),
        ("reserve_timeout max".into(), Cache::builder().budget(1 << 20).reserve_timeout(Duration::MAX)),
        ("max_cached_files 0".into(), Cache::builder().budget(1 << 20).max_cached_files(0)),
        ("max_cached_files max".into(), Cache::builder().budget(1 << 20).max_cached_files(usize::MAX)),
        ("readahead 0 0".into(), Cache::builder().budget(1 << 20).readahead(0, 0)),
        ("readahead init > max".into(), Cache::builder().budget(1 << 20).readahead(1 << 20, 4096)),
        ("readahead max".into(), Cache::builder().budget(1 << 20).readahead(usize::MAX, usize::MAX)),
        ("io_threads 0".into(), Cache::builder().budget(1 << 20).io_threads(0)),
        ("writeback 0 0".into(), Cache::builder().budget(1 << 20).writeback(Duration::ZERO, Duration::ZERO)),
        ("writeback max".into(), Cache::builder().budget(1 << 20).writeback(Duration::MAX, Duration::MAX)),
        ("dirty_ratios 0 0".into(), Cache::builder().dirty_ratios(0, 0)),
        ("dirty_ratios 50 40".into(), Cache::builder().dirty_ratios(50, 40)),
        ("dirty_ratios 10 100".into(), Cache::builder().dirty_ratios(10, 100)),
        ("dirty_ratios max".into(), Cache::builder().dirty_ratios(u64::MAX, u64::MAX)),
        ("dirty_ratios 0 1".into(), Cache::builder().budget(1 << 20).dirty_ratios(0, 1)),
        ("fault_threads 0".into(), Cache::builder().budget(1 << 20).fault_threads(0)),
    ];
    let mut refused = Vec::new();
    for (what, b) in cases {
        if let Some(m) = build_or_refuse(what.clone(), b) {
            refused.push(format!("{what}: {m}"));
        }
    }
    // The settings that cannot work are among the refused (the rest must have worked above).
    for must in [
        "window_size 0",
        "window_size 3",
        "window_size 2048",
        "dirty_ratios 0 0",
        "dirty_ratios 50 40",
        "dirty_ratios 10 100",
        "dirty_ratios max",
    ] {
        assert!(refused.iter().any(|r| r.starts_with(&format!("{must}:"))), "{must} accepted; refused: {refused:#?}");
    }
}

// ------------------------------------------------------------------ handles

#[test]
fn every_call_on_a_closed_handle_is_closed() {
    guarded("closed handle", 60, || {
        let cache = small_cache(4 << 20);
        let f = mem_file(&cache);
        f.write_at(b"data", 0).unwrap();
        let mut g = f.try_clone().unwrap();
        g.close().unwrap();
        let mut b = [0u8; 4];
        let closed = |r: ubc::Result<()>, what: &str| match r {
            Err(Error::Closed) => {}
            other => panic!("{what} on a closed handle: {other:?}"),
        };
        closed(g.read_at(&mut b, 0).map(drop), "read_at");
        closed(g.read_exact_at(&mut b, 0), "read_exact_at");
        closed(g.write_at(b"x", 0).map(drop), "write_at");
        closed(g.len().map(drop), "len");
        closed(g.is_empty().map(drop), "is_empty");
        closed(g.set_len(0), "set_len");
        closed(g.sync(), "sync");
        closed(g.clean(0..10), "clean");
        closed(g.invalidate(0..10, ubc::Length::Reload), "invalidate");
        closed(g.try_clone().map(drop), "try_clone");
        closed(g.reopen(Access::ReadOnly).map(drop), "reopen");
        closed(g.window(0, 4).map(drop), "window");
        closed(g.window_mut(0, 4).map(drop), "window_mut");
        closed(g.map(0..4, Access::ReadOnly, Sharing::Shared).map(drop), "map");
        closed(g.map(0..4, Access::ReadWrite, Sharing::Private).map(drop), "map private");
        closed(g.close(), "close");
        // Bad arguments on a closed handle: closed wins (or the argument error), no panic.
        assert!(matches!(g.read_at(&mut b, u64::MAX), Err(Error::Closed) | Err(Error::OffsetOverflow { .. })));
        // The io adapters carry Closed through io::Error.
        for e in [
            g.read(&mut b).unwrap_err(),
            g.write(b"x").unwrap_err(),
            g.flush().unwrap_err(),
            g.seek(SeekFrom::End(0)).unwrap_err(),
        ] {
            assert!(matches!(e.get_ref().and_then(|i| i.downcast_ref::<Error>()), Some(Error::Closed)), "{e:?}");
        }
        // Per-handle: the original is untouched, and metadata calls still answer.
        let _ = (g.stats(), g.identity(), g.is_writable(), g.cache().page_size());
        f.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(&b, b"data");
        // Closing twice through clones of the object does not underflow anything.
        let h = f.try_clone().unwrap();
        h.close().unwrap();
        assert!(matches!(h.close(), Err(Error::Closed)));
        drop(h);
        f.read_exact_at(&mut b, 0).unwrap();
    });
}

#[test]
fn writes_through_read_only_handles_and_pagers() {
    guarded("read-only", 60, || {
        let cache = small_cache(4 << 20);
        let mem = MemPager::new();
        mem.put_pages(0, &[7u8; 4096]).unwrap();
        let ro_pager: Arc<dyn Pager> = Arc::new(ReadOnlyPager(mem));
        // A writable handle on a read-only pager: refused at open and at reopen.
        assert!(matches!(cache.open(ro_pager.clone(), Access::ReadWrite), Err(Error::ReadOnly)));
        let f = cache.open(ro_pager, Access::ReadOnly).unwrap();
        assert!(matches!(f.reopen(Access::ReadWrite), Err(Error::ReadOnly)));
        let ro = |r: ubc::Result<()>, what: &str| match r {
            Err(Error::ReadOnly) => {}
            other => panic!("{what} on a read-only handle: {other:?}"),
        };
        ro(f.write_at(b"x", 0).map(drop), "write_at");
        ro(f.write_at(&[], 0).map(drop), "empty write_at");
        ro(f.set_len(0), "set_len");
        ro(f.set_len(u64::MAX), "set_len u64::MAX");
        ro(f.window_mut(0, 1).map(drop), "window_mut");
        ro(f.map(0..4096, Access::ReadWrite, Sharing::Shared).map(drop), "shared writable map");
        let mut w = f.try_clone().unwrap();
        assert_eq!(w.write(b"x").unwrap_err().kind(), std::io::ErrorKind::PermissionDenied);
        // What a read-only handle may do still works.
        let mut b = [0u8; 4];
        f.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(b, [7; 4]);
        let mut p = f.map(0..4096, Access::ReadWrite, Sharing::Private).unwrap();
        p[0] = 1; // a private copy: never reaches the file
        drop(p);
        f.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(b, [7; 4]);
        f.sync().unwrap();
        f.clean(0..4096).unwrap();
        f.invalidate(0..4096, ubc::Length::Reload).unwrap();
        // A read-only handle on a writable pager is read-only too.
        let rw = mem_file(&cache);
        let r = rw.reopen(Access::ReadOnly).unwrap();
        ro(r.write_at(b"x", 0).map(drop), "write_at via reopen(ReadOnly)");
        ro(r.set_len(1), "set_len via reopen(ReadOnly)");
    });
}

#[test]
fn opening_bad_host_paths_is_an_open_error() {
    guarded("host paths", 60, || {
        let cache = small_cache(4 << 20);
        let dir = tempfile::tempdir().unwrap();
        for p in [
            std::path::PathBuf::from("/nonexistent/ubc-bad-args"),
            std::path::PathBuf::from("bad\0name"),
            dir.path().to_path_buf(),
            std::path::PathBuf::from(""),
            dir.path().join("x".repeat(300)),
        ] {
            for r in
                [cache.open_path(&p, Access::ReadOnly), cache.open_path(&p, Access::ReadWrite), cache.create_path(&p)]
            {
                match r {
                    Err(Error::Open { .. }) => {}
                    other => panic!("{p:?}: expected an Open error, got {other:?}"),
                }
            }
        }
    });
}

//! Errors injected at every level of a stack: errors reach the caller of
//! `read_at`, `sync`, `Mapping::flush` and `close`; a failed writeback keeps the data and
//! is retried; every handle hears of a lost sync; the cache keeps serving other files;
//! torn transfers and hangs leave no garbage behind.

use std::sync::Arc;
use std::time::{Duration, Instant};
use ubc::pager::Injector;
use ubc_stack::compress::CompressOptions;
use ubc_stack::encrypt::Key;
use ubc_stack::layer::{
    Layer,
    dir::Dir,
    general::{Aead, Zstd},
    inject::Inject,
};
use ubc_stack::{OpenOptions, Stack};

/// Where the inject layer sits in `dir | zstd | aead`.
#[derive(Clone, Copy, Debug)]
enum At {
    /// The host files themselves fail.
    Store,
    /// Between dir and zstd: the zstd layer's pager sees its lower file fail.
    AboveDir,
    /// Between zstd and aead.
    AboveZstd,
    /// Over aead: the top file's own pager fails.
    Top,
}
const ALL: [At; 4] = [At::Store, At::AboveDir, At::AboveZstd, At::Top];

struct Fx {
    _tmp: tempfile::TempDir,
    data: std::path::PathBuf,
    key: Arc<Key>,
}

fn fx() -> Fx {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    Fx { data, key: Arc::new(Key::generate()), _tmp: tmp }
}

fn stack(fx: &Fx, at: At, faults: &Arc<Injector>, cache: ubc::Cache) -> Stack {
    let f = faults.clone();
    let fault_over = |l: Arc<dyn Layer>| -> Arc<dyn Layer> { Arc::new(Inject::over(l, f.clone())) };
    let mut b = Stack::builder(cache);
    b = match at {
        At::Store => b.push(|_| Ok(Arc::new(Inject::dir(&fx.data, faults.clone())?))).unwrap(),
        _ => b.push(|_| Ok(Arc::new(Dir::new(&fx.data)?))).unwrap(),
    };
    if let At::AboveDir = at {
        b = b.push(|l| Ok(fault_over(l.unwrap()))).unwrap();
    }
    b = b
        .push(|l| {
            Ok(Arc::new(Zstd::new(l.unwrap(), CompressOptions::default().with_chunk_size(16 << 10).with_level(1))))
        })
        .unwrap();
    if let At::AboveZstd = at {
        b = b.push(|l| Ok(fault_over(l.unwrap()))).unwrap();
    }
    b = b.push(|l| Ok(Arc::new(Aead::new(l.unwrap(), fx.key.clone(), "test".into())))).unwrap();
    if let At::Top = at {
        b = b.push(|l| Ok(fault_over(l.unwrap()))).unwrap();
    }
    b.build().unwrap()
}

fn rw() -> OpenOptions {
    OpenOptions::new().write(true)
}

fn cache() -> ubc::Cache {
    ubc::Cache::new(32 << 20).unwrap()
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The errno somewhere in an error's chain of causes.
fn errno_in(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut cur = Some(e);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(n) = io.raw_os_error()
        {
            return Some(n);
        }
        if let Some(u) = e.downcast_ref::<ubc::Error>()
            && let Some(n) = u.raw_os_error().filter(|_| !matches!(u, ubc::Error::InvalidArgument(_)))
        {
            return Some(n);
        }
        cur = e.source();
    }
    None
}

fn has_errno(e: &ubc_stack::Error, errno: i32) -> bool {
    errno_in(e) == Some(errno)
}

/// Read a file through the top of a fresh stack (fresh cache): what is stored.
fn stored(fx: &Fx, name: &str) -> Vec<u8> {
    let s = stack(fx, At::Top, &Injector::new(), cache());
    let f = s.top().open(name).unwrap();
    let mut v = vec![0u8; f.len().unwrap() as usize];
    f.read_exact_at(&mut v, 0).unwrap();
    v
}

#[test]
fn a_write_error_at_any_level_reaches_sync_and_the_data_survives_it() {
    for at in ALL {
        for errno in [libc::ENOSPC, libc::EIO] {
            let fx = fx();
            let faults = Injector::new();
            let s = stack(&fx, at, &faults, cache());
            let f = s.top().create("f").unwrap();
            let data = pattern(errno as u64, 200_000);
            f.write_at(&data, 0).unwrap();
            faults.fail_writes(Some(errno));
            let e = f.sync().unwrap_err();
            assert!(has_errno(&e, errno), "{at:?}: sync error carries errno {errno}: {e} / {e:?}");
            assert!(faults.counts().failures > 0, "{at:?}: the fault fired");
            // Still readable from the cache while the store refuses it.
            let mut back = vec![0u8; data.len()];
            f.read_exact_at(&mut back, 0).unwrap();
            assert!(back == data, "{at:?}: cached data intact");
            // Recovery: the same handle's sync writes everything.
            faults.heal();
            f.sync().unwrap();
            drop(f);
            drop(s);
            assert!(stored(&fx, "f") == data, "{at:?}/{errno}: data stored after recovery");
        }
    }
}

#[test]
fn a_read_error_at_any_level_reaches_read_at_and_leaves_nothing_behind() {
    for at in ALL {
        let fx = fx();
        // Large enough that opening the stack (headers, index, read-ahead) leaves the end
        // of it uncached at every level.
        let data = pattern(7, 3 << 20);
        {
            let s = stack(&fx, at, &Injector::new(), cache());
            let f = s.top().create("f").unwrap();
            f.write_at(&data, 0).unwrap();
            f.sync().unwrap();
        }
        for torn in [false, true] {
            let faults = Injector::new();
            let s = stack(&fx, at, &faults, cache());
            let f = s.top().open("f").unwrap();
            faults.tear(torn);
            faults.fail_reads(Some(libc::EIO));
            let mut tail = vec![0u8; 64 << 10];
            let at_end = (data.len() - tail.len()) as u64;
            let e = f.read_exact_at(&mut tail, at_end).unwrap_err();
            assert!(has_errno(&e, libc::EIO), "{at:?} torn={torn}: {e} / {e:?}");
            faults.heal();
            let mut buf = vec![0u8; data.len()];
            f.read_exact_at(&mut buf, 0).unwrap();
            assert!(buf == data, "{at:?} torn={torn}: no scribbled page was kept");
        }
    }
}

#[test]
fn a_torn_write_is_rewritten_whole() {
    for at in ALL {
        let fx = fx();
        let faults = Injector::new();
        let s = stack(&fx, at, &faults, cache());
        let f = s.top().create("f").unwrap();
        let old = pattern(1, 150_000);
        f.write_at(&old, 0).unwrap();
        f.sync().unwrap();
        let new = pattern(2, 150_000);
        f.write_at(&new, 0).unwrap();
        faults.tear(true);
        faults.fail_writes(Some(libc::EIO));
        faults.fail_only_next(1);
        assert!(f.sync().is_err(), "{at:?}: the torn write is an error");
        f.sync().unwrap();
        drop(f);
        drop(s);
        assert!(stored(&fx, "f") == new, "{at:?}: the retry stored the whole new data");
    }
}

#[test]
fn every_handle_hears_of_a_failed_sync_at_any_level() {
    for at in ALL {
        let fx = fx();
        let faults = Injector::new();
        let s = stack(&fx, at, &faults, cache());
        let a = s.top().create("f").unwrap();
        let b = s.top().open_with("f", rw()).unwrap();
        a.write_at(b"written through a", 0).unwrap();
        b.write_at(b"and through b", 100).unwrap();
        faults.fail_syncs(Some(libc::EIO));
        faults.fail_only_next(1);
        let e = a.sync().unwrap_err();
        assert!(has_errno(&e, libc::EIO), "{at:?}: {e:?}");
        // The store syncs again, but b has not been told that data may be lost.
        let e = b.sync().unwrap_err();
        assert!(
            matches!(&e, ubc_stack::Error::Cache(ubc::Error::WritebackFailed { lost: true, .. })),
            "{at:?}: b hears of it: {e:?}"
        );
        b.sync().unwrap();
        a.sync().unwrap();
    }
}

#[test]
fn mapping_flush_and_close_report_write_errors() {
    let fx = fx();
    let faults = Injector::new();
    // The fault layer is the top: a mapping's flush writes into its pager.
    let s = stack(&fx, At::Top, &faults, cache());
    let f = s.top().create("f").unwrap();
    f.set_len(64 << 10).unwrap();
    let mut m = f.map(0..64 << 10, ubc::Access::ReadWrite, ubc::Sharing::Shared).unwrap();
    m[..5].copy_from_slice(b"hello");
    faults.fail_writes(Some(libc::ENOSPC));
    let e = m.flush().unwrap_err();
    assert!(has_errno(&e, libc::ENOSPC), "{e:?}");
    // Another handle's close, after a writeback it did not see failed and with the data
    // still dirty, reports it.
    let other = s.top().open_with("f", rw()).unwrap();
    other.write_at(b"x", 10).unwrap();
    assert!(f.sync().is_err());
    let e = other.close().unwrap_err();
    assert!(matches!(&e, ubc_stack::Error::Cache(ubc::Error::WritebackFailed { lost: false, .. })), "{e:?}");
    assert!(has_errno(&e, libc::ENOSPC));
    faults.heal();
    m.flush().unwrap();
    f.sync().unwrap();
    drop(m);
    drop(f);
    drop(s);
    let v = stored(&fx, "f");
    assert_eq!(&v[..5], b"hello");
    assert_eq!(v[10], b'x');
}

#[test]
fn a_failing_or_hung_stack_does_not_stop_the_cache_serving_other_files() {
    let fx = fx();
    let healthy = fx_second(&fx);
    let faults = Injector::new();
    let cache = cache();
    let bad = stack(&fx, At::Store, &faults, cache.clone());
    let good = Stack::open(&format!("dir:{}", healthy.display()), cache.clone()).unwrap();
    let g = good.top().create("g").unwrap();
    let gdata = pattern(9, 1 << 20);
    g.write_at(&gdata, 0).unwrap();
    g.sync().unwrap();

    let f = bad.top().create("f").unwrap();
    f.write_at(&pattern(3, 300_000), 0).unwrap();
    // Permanent failure: the bad file's sync fails every time; the good one works.
    faults.fail_writes(Some(libc::EIO));
    for _ in 0..3 {
        assert!(f.sync().is_err());
        g.write_at(b"fine", 0).unwrap();
        g.sync().unwrap();
    }
    faults.heal();
    f.sync().unwrap();

    // A hang: the bad store blocks (until healed); the good file keeps being served
    // meanwhile. No timing is assumed: the hang lasts until we end it.
    f.write_at(&pattern(4, 300_000), 0).unwrap();
    faults.hang_for(Duration::from_secs(600));
    let bad_sync = std::thread::spawn(move || f.sync().is_ok());
    let t0 = Instant::now();
    while faults.counts().hung == 0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "the bad sync never reached its store");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut buf = vec![0u8; 4096];
    for _ in 0..200 {
        g.read_exact_at(&mut buf, 8192).unwrap();
        g.write_at(&buf, 12288).unwrap();
    }
    g.sync().unwrap();
    assert!(!bad_sync.is_finished(), "the bad sync was still hung while the good file was served");
    faults.heal();
    assert!(bad_sync.join().unwrap(), "the hung sync completes once the store recovers");
}

fn fx_second(fx: &Fx) -> std::path::PathBuf {
    let p = fx.data.parent().unwrap().join("healthy");
    std::fs::create_dir(&p).unwrap();
    p
}

//! Host files served in place (XIP: files on tmpfs) hold a descriptor each apart from the
//! pool (`host_fds`); they are bounded by the pool's limit, past which files on tmpfs are
//! cached as copies with pooled descriptors. Alone in its binary: it sets the process's
//! pool limit and counts descriptors.

mod common;
use common::*;
use ubc::pager::host_fds;
use ubc::{Access, Cache};

#[test]
fn files_served_in_place_are_bounded_by_the_descriptor_pool() {
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("no /dev/shm: skipped");
        return;
    };
    const LIMIT: usize = 8;
    const FILES: usize = 40;
    host_fds::set_limit(LIMIT);
    let cache = Cache::builder().budget(4 << 20).max_cached_files(1000).build().unwrap();
    let mut open = Vec::new();
    for i in 0..FILES {
        let p = dir.path().join(format!("f{i}"));
        std::fs::write(&p, pattern(i as u64, 0, 10_000)).unwrap();
        let f = cache.open_path(&p, Access::ReadWrite).unwrap();
        let mut b = vec![0u8; 10_000];
        f.read_exact_at(&mut b, 0).unwrap();
        assert_same(&b, &pattern(i as u64, 0, 10_000), "read");
        f.write_at(b"new", 5).unwrap();
        open.push(f);
    }
    let s = host_fds::stats();
    assert_eq!(s.in_place, LIMIT, "{s:?}");
    let in_place = open.iter().filter(|f| f.stats().xip_bytes > 0).count();
    let copied = open.iter().filter(|f| f.stats().resident_bytes > 0).count();
    assert_eq!((in_place, copied), (LIMIT, FILES - LIMIT));
    // Open descriptors: the pool's and the in-place files', within a few of both limits.
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    assert!(fds < 2 * LIMIT + 40, "{fds} descriptors open");
    for (i, f) in open.iter().enumerate() {
        f.sync().unwrap();
        let mut want = pattern(i as u64, 0, 10_000);
        want[5..8].copy_from_slice(b"new");
        assert_same(&std::fs::read(dir.path().join(format!("f{i}"))).unwrap(), &want, "host file after sync");
    }
    drop(open);
    drop(cache);
    assert_eq!(host_fds::stats().in_place, 0, "every in-place descriptor closed with its file");
}

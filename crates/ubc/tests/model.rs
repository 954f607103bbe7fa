//! Property test: random operation sequences on one file against a `Vec<u8>` model, under
//! budgets from 2 pages up, with eviction, sync, truncation, windows and reopen mixed in,
//! and failing writebacks that must lose nothing; stores and loads through a shared mapping
//! (faulted in by the cache, evicted under it) are part of the same sequence.

mod common;
use common::*;
use proptest::prelude::*;
use std::sync::Arc;
use ubc::pager::{InjectingPager, MemPager};
use ubc::{Access, Cache, Mapping, Pager, Sharing};

#[derive(Debug, Clone)]
enum Op {
    Write {
        off: u64,
        len: usize,
        seed: u8,
    },
    Read {
        off: u64,
        len: usize,
    },
    SetLen(u64),
    /// Punch a hole (`fallocate(PUNCH_HOLE | KEEP_SIZE)`), then check `seek_data` and
    /// `seek_hole` from its start against the model.
    Punch {
        off: u64,
        len: u64,
    },
    Sync,
    EvictAll,
    WindowMut {
        off: u64,
        len: usize,
        seed: u8,
    },
    Window {
        off: u64,
        len: usize,
    },
    /// Take a window through a second handle and keep it (replacing the one kept): after
    /// every later operation it must still show the bytes it was taken with (page loanout,
    /// copy-on-write). Only in runs with `keep_windows`.
    KeepWindow {
        off: u64,
        len: usize,
    },
    DropWindow,
    FailWrites(bool),
    Reopen,
    /// Map (or re-map) `0..MAP_SPAN` shared and writable.
    Map,
    Unmap,
    /// Store through the mapping (clipped to the file: past it is SIGBUS).
    MapWrite {
        off: u64,
        len: usize,
        seed: u8,
    },
    MapRead {
        off: u64,
        len: usize,
    },
}

const MAP_SPAN: u64 = SPAN + 32 * 1024;

const SPAN: u64 = 96 * 1024;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..SPAN, 1..20_000usize, any::<u8>()).prop_map(|(off, len, seed)| Op::Write { off, len, seed }),
        4 => (0..SPAN + 5000, 0..20_000usize).prop_map(|(off, len)| Op::Read { off, len }),
        1 => (0..SPAN).prop_map(Op::SetLen),
        1 => (0..SPAN, 1..40_000u64).prop_map(|(off, len)| Op::Punch { off, len }),
        1 => Just(Op::Sync),
        1 => Just(Op::EvictAll),
        1 => (0..SPAN, 1..9000usize, any::<u8>()).prop_map(|(off, len, seed)| Op::WindowMut { off, len, seed }),
        1 => (0..SPAN, 1..9000usize).prop_map(|(off, len)| Op::Window { off, len }),
        2 => (0..SPAN, 1..6000usize).prop_map(|(off, len)| Op::KeepWindow { off, len }),
        1 => Just(Op::DropWindow),
        1 => any::<bool>().prop_map(Op::FailWrites),
        1 => Just(Op::Reopen),
        1 => Just(Op::Map),
        1 => Just(Op::Unmap),
        3 => (0..SPAN, 1..20_000usize, any::<u8>()).prop_map(|(off, len, seed)| Op::MapWrite { off, len, seed }),
        3 => (0..SPAN, 1..20_000usize).prop_map(|(off, len)| Op::MapRead { off, len }),
    ]
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i % 251) as u8) | 1).collect()
}

/// Fails the whole test binary (printing the case) if one case runs past a minute: a hang
/// must fail CI with the operations that caused it, not stall it.
struct Watchdog(std::sync::mpsc::Sender<()>);

impl Watchdog {
    fn arm(case: String) -> Watchdog {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(std::time::Duration::from_secs(60))
            {
                // Straight to fd 2: the test harness captures `eprintln!`, and we abort.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "model case hung for 60 s: {case}");
                std::process::abort();
            }
        });
        Watchdog(tx)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

fn run(ops: Vec<Op>, budget_pages: u64, window: usize) {
    run_with(ops, budget_pages, window, false)
}

/// `keep_windows`: a second handle keeps windows across operations (`KeepWindow`), which
/// also keeps the object open across `Reopen`.
fn run_with(ops: Vec<Op>, budget_pages: u64, window: usize, keep_windows: bool) {
    let _watchdog =
        Watchdog::arm(format!("budget_pages={budget_pages} window={window} keep_windows={keep_windows} ops={ops:?}"));
    let cache =
        Cache::builder().budget(budget_pages * 4096).window_size(window).daemon(budget_pages > 4).build().unwrap();
    let mem = Arc::new(MemPager::new());
    let fault = Arc::new(InjectingPager::new(mem.clone()));
    let mut f = cache.open(fault.clone(), Access::ReadWrite).unwrap();
    let lender = keep_windows.then(|| f.try_clone().unwrap());
    let mut kept: Option<(ubc::Window<'_>, Vec<u8>)> = None;
    let mut model: Vec<u8> = Vec::new();
    let mut failing = false;
    let mut map: Option<Mapping> = None;
    for op in ops {
        match op {
            Op::Write { off, len, seed } => {
                let data = bytes(seed, len);
                match f.write_at(&data, off) {
                    Ok(n) => {
                        let end = off as usize + n;
                        if model.len() < end {
                            model.resize(end, 0);
                        }
                        model[off as usize..end].copy_from_slice(&data[..n]);
                    }
                    // Only a failing pager may stop a write (no room: dirty pages cannot leave).
                    Err(e) => assert!(failing, "write failed with a healthy pager: {e}"),
                }
            }
            Op::Read { off, len } => {
                let mut buf = vec![0xeeu8; len];
                let n = f.read_at(&mut buf, off).unwrap_or_else(|e| {
                    // A read miss needs room; with every page dirty and the pager failing,
                    // that may be impossible. Never otherwise.
                    assert!(failing, "read failed with a healthy pager: {e}");
                    usize::MAX
                });
                if n == usize::MAX {
                    continue;
                }
                let want = model.get(off as usize..(off as usize + len).min(model.len())).unwrap_or(&[]);
                assert_same(&buf[..n], want, "read");
            }
            Op::SetLen(l) => {
                if f.set_len(l).is_ok() {
                    model.resize(l as usize, 0);
                } else {
                    assert!(failing);
                    model.resize(l as usize, 0); // the cache's length changed anyway
                }
            }
            Op::Punch { off, len } => {
                // With writes failing, a punch may stop half-way (it falls back to writing
                // zeros): only a healthy pager's punch is checked.
                if failing {
                    continue;
                }
                f.punch_hole(off..off + len).unwrap();
                let end = ((off + len) as usize).min(model.len());
                if (off as usize) < end {
                    model[off as usize..end].fill(0);
                }
                let n = model.len() as u64;
                match f.seek_data(off).unwrap() {
                    None => assert!(off >= n || model[off as usize..].iter().all(|&b| b == 0), "no data after {off}"),
                    Some(d) => assert!(
                        d >= off && d < n && model[off as usize..d as usize].iter().all(|&b| b == 0),
                        "seek_data({off}) = {d} skipped data"
                    ),
                }
                match f.seek_hole(off).unwrap() {
                    None => assert!(off >= n, "seek_hole({off}) = None inside the file ({n})"),
                    Some(h) => assert!(h >= off && (h == n || model[h as usize] == 0), "seek_hole({off}) = {h}"),
                }
            }
            Op::Sync => {
                // (Not "dirty > 0 after a failed sync": the page daemon may be writing the
                // re-dirtied pages back right now, and pages under writeback are not dirty.)
                match f.sync() {
                    Ok(()) => assert_eq!(f.stats().dirty_bytes, 0, "sync succeeded with dirty pages left"),
                    Err(e) => assert!(failing, "sync failed with a healthy pager: {e}"),
                }
            }
            Op::EvictAll => {
                let r = cache.evict_all();
                if !failing {
                    r.unwrap();
                    assert_eq!(f.stats().dirty_bytes, 0);
                }
            }
            Op::WindowMut { off, len, seed } => {
                let data = bytes(seed, len);
                let Ok(mut w) = f.window_mut(off, len) else {
                    assert!(failing);
                    continue;
                };
                let n = w.len();
                w.copy_from_slice(&data[..n]);
                drop(w);
                let end = off as usize + n;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&data[..n]);
            }
            Op::Window { off, len } => {
                let Ok(w) = f.window(off, len) else {
                    assert!(failing);
                    continue;
                };
                let want = model.get(off as usize..(off as usize + w.len())).unwrap_or(&[]);
                assert_same(&w, want, "window");
            }
            Op::KeepWindow { off, len } => {
                kept = None;
                if let Some(l) = lender.as_ref() {
                    match l.window(off, len) {
                        Ok(w) => {
                            let want = model.get(off as usize..(off as usize + w.len())).unwrap_or(&[]).to_vec();
                            assert_same(&w, &want, "kept window when taken");
                            kept = Some((w, want));
                        }
                        Err(e) => assert!(failing, "window failed with a healthy pager: {e}"),
                    }
                }
            }
            Op::DropWindow => kept = None,
            Op::FailWrites(on) => {
                failing = on;
                fault.fail_writes(on.then_some(libc::EIO));
            }
            Op::Reopen => {
                drop(f);
                f = cache.open(fault.clone(), Access::ReadWrite).unwrap();
            }
            Op::Map => {
                drop(map.take()); // unmap the old one first
                map = Some(f.map(0..MAP_SPAN, Access::ReadWrite, Sharing::Shared).unwrap());
            }
            Op::Unmap => map = None,
            // A touch of a page that is not resident needs room in the cache; with every
            // page dirty and the store failing there may be none, and the access would get
            // SIGBUS (the documented outcome). So touches happen only with a healthy store.
            Op::MapWrite { off, len, seed } if !failing => {
                if let Some(m) = map.as_mut() {
                    let end = (off as usize + len).min(model.len());
                    if (off as usize) < end {
                        let data = bytes(seed, end - off as usize);
                        m[off as usize..end].copy_from_slice(&data);
                        model[off as usize..end].copy_from_slice(&data);
                    }
                }
            }
            Op::MapRead { off, len } if !failing => {
                if let Some(m) = map.as_ref() {
                    let end = (off as usize + len).min(model.len());
                    if (off as usize) < end {
                        assert_same(&m[off as usize..end], &model[off as usize..end], "mapping");
                    }
                }
            }
            Op::MapWrite { .. } | Op::MapRead { .. } => {}
        }
        assert_eq!(f.len().unwrap(), model.len() as u64, "length");
        assert!(cache.stats().totals.resident_bytes <= budget_pages * 4096);
        if let Some((w, snap)) = &kept {
            assert_same(w, snap, "a kept window after a later operation");
        }
    }
    drop(kept);
    // Heal and check that everything written arrives in the store: nothing was dropped.
    fault.heal();
    drop(map);
    f.sync().unwrap();
    assert_same(&store_contents(&*mem), &model, "store after final sync");
    assert_eq!(mem.len().unwrap(), model.len() as u64);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_ops_match_the_model(ops in proptest::collection::vec(op(), 1..60),
                                  budget_pages in prop_oneof![Just(8u64), Just(16), Just(64), Just(1024)],
                                  window in prop_oneof![Just(16384usize), Just(65536), Just(2 << 20)],
                                  keep_windows in any::<bool>()) {
        // Kept windows pin up to three pages: only where that leaves room to work.
        run_with(ops, budget_pages, window, keep_windows && budget_pages >= 16);
    }
}

#[test]
fn regression_window_mut_after_failed_writes() {
    use Op::*;
    run(
        vec![
            WindowMut { off: 31899, len: 870, seed: 0 },
            Sync,
            Write { off: 61213, len: 16612, seed: 0 },
            FailWrites(true),
            Write { off: 40960, len: 12289, seed: 0 },
            Write { off: 12288, len: 12289, seed: 0 },
            WindowMut { off: 28943, len: 7922, seed: 0 },
        ],
        16,
        65536,
    );
}

#[test]
fn regression_failing_writes_under_tiny_budget() {
    use Op::*;
    run(
        vec![
            Write { off: 73331, len: 17720, seed: 158 },
            Write { off: 17448, len: 14106, seed: 149 },
            SetLen(33640),
            Window { off: 92297, len: 4299 },
            EvictAll,
            Write { off: 46211, len: 17975, seed: 242 },
            Read { off: 102250, len: 7118 },
            Reopen,
            Window { off: 81605, len: 5747 },
            WindowMut { off: 1964, len: 8188, seed: 171 },
            EvictAll,
            FailWrites(true),
            SetLen(51892),
            Write { off: 10282, len: 16035, seed: 125 },
            WindowMut { off: 26605, len: 2219, seed: 92 },
            Sync,
            WindowMut { off: 65555, len: 6198, seed: 105 },
            Window { off: 84853, len: 5441 },
            WindowMut { off: 76839, len: 5724, seed: 21 },
            Write { off: 22165, len: 1406, seed: 106 },
            FailWrites(true),
            Write { off: 3795, len: 18202, seed: 171 },
            Write { off: 760, len: 15022, seed: 97 },
        ],
        8,
        2 << 20,
    );
}

/// A writable window over pages that are already dirty, at the dirty limit, with the store
/// failing: the window's own dirty pages are the only unclean ones and nobody can clean them
/// while it holds them, so waiting for writeback would never end. (It hung: held dirty pages
/// were counted as cleanable.) Run under a watchdog so a regression fails instead of hanging.
#[test]
fn regression_window_over_own_dirty_pages_at_the_dirty_limit() {
    use Op::*;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        run(
            vec![
                Write { off: 0, len: 8192, seed: 1 },
                FailWrites(true),
                WindowMut { off: 0, len: 12288, seed: 2 },
                Write { off: 4096, len: 12288, seed: 3 },
                WindowMut { off: 100, len: 16000, seed: 4 },
            ],
            8,
            16384,
        );
        tx.send(()).unwrap();
    });
    match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("writer stuck at the dirty limit"),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("the run panicked (see above)"),
    }
}

/// A case the 4000-case release run hung on (budget 8 pages, 64 KiB windows): replayed
/// under the watchdog so a regression fails instead of hanging.
#[test]
fn regression_hang_found_by_the_long_run() {
    run(
        vec![
            Op::MapWrite { off: 9135, len: 10822, seed: 55 },
            Op::MapRead { off: 95911, len: 499 },
            Op::WindowMut { off: 31171, len: 3704, seed: 42 },
            Op::Write { off: 97922, len: 2354, seed: 244 },
            Op::MapWrite { off: 43200, len: 7350, seed: 244 },
            Op::Write { off: 44172, len: 11360, seed: 202 },
            Op::MapWrite { off: 74304, len: 16121, seed: 164 },
            Op::Reopen,
            Op::Unmap,
            Op::MapWrite { off: 88538, len: 11304, seed: 31 },
            Op::Unmap,
            Op::Write { off: 69814, len: 7674, seed: 42 },
            Op::MapWrite { off: 79338, len: 16416, seed: 6 },
            Op::Reopen,
            Op::MapRead { off: 23874, len: 1173 },
            Op::Read { off: 27838, len: 13272 },
            Op::WindowMut { off: 68659, len: 1026, seed: 103 },
            Op::Write { off: 35828, len: 19932, seed: 225 },
            Op::MapWrite { off: 35061, len: 13062, seed: 84 },
            Op::Read { off: 81044, len: 4590 },
            Op::Read { off: 39076, len: 14024 },
            Op::MapRead { off: 52993, len: 3646 },
            Op::Unmap,
            Op::WindowMut { off: 11201, len: 6400, seed: 224 },
            Op::Read { off: 76979, len: 10581 },
            Op::Read { off: 92942, len: 2535 },
            Op::Write { off: 95875, len: 7288, seed: 98 },
            Op::EvictAll,
            Op::MapRead { off: 91441, len: 17850 },
            Op::Write { off: 4408, len: 15296, seed: 71 },
            Op::MapWrite { off: 27193, len: 3329, seed: 116 },
            Op::Sync,
            Op::Map,
            Op::Read { off: 34334, len: 16677 },
            Op::Read { off: 102754, len: 4619 },
            Op::SetLen(67451),
            Op::Read { off: 54384, len: 17293 },
            Op::Read { off: 30095, len: 2178 },
            Op::Write { off: 53169, len: 7893, seed: 5 },
            Op::Write { off: 21508, len: 10133, seed: 94 },
            Op::Write { off: 35203, len: 7060, seed: 98 },
            Op::Sync,
            Op::MapWrite { off: 71025, len: 8736, seed: 90 },
            Op::MapWrite { off: 70825, len: 8040, seed: 7 },
            Op::EvictAll,
            Op::Window { off: 4773, len: 7480 },
            Op::Sync,
            Op::Write { off: 10611, len: 696, seed: 47 },
            Op::MapRead { off: 1302, len: 5149 },
            Op::MapRead { off: 19793, len: 18908 },
            Op::MapWrite { off: 59602, len: 5494, seed: 202 },
            Op::Write { off: 56592, len: 17645, seed: 80 },
            Op::Write { off: 94419, len: 10729, seed: 41 },
            Op::Sync,
            Op::EvictAll,
            Op::MapRead { off: 6917, len: 13672 },
            Op::Write { off: 21565, len: 9025, seed: 159 },
            Op::Map,
            Op::Read { off: 87550, len: 12160 },
        ],
        8,
        65536,
    );
}

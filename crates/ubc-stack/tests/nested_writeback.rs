//! Stacked writeback under sustained random writes (docs/design.md "Locks and
//! their order").
//!
//! 4 KiB random writes from four threads into a file eight times the budget, through two
//! general layers: every write past the budget makes the cache clean upper pages, whose
//! layer (zstd read-modify-write of a chunk, aead sealing of a block) reads and writes the
//! layer below through the same cache, while that layer's pages are being filled by
//! read-ahead, written back, or held by other writers. This is the load that hung the mount
//! within a minute (every I/O thread in zstd `put_pages` waiting for aead pages whose fills
//! were queued behind them). The file is then synced and read back through a fresh cache
//! and compared with a model; a watchdog turns a hang into a failure with every stack.
//! The lock-order checker (debug builds) panics on any out-of-order wait on the way.

mod common;

use rand::{RngExt, SeedableRng};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::time::Duration;
use ubc_stack::Stack;

const BLOCK: usize = 4096;

/// The bytes of block `b` as written for the `generation`-th time: distinct per block and write,
/// half compressible so zstd both compresses and falls back.
fn block(b: u64, generation: u32) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK];
    let mut x = b.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (generation as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    for (i, c) in v.chunks_mut(8).enumerate() {
        if i < BLOCK / 16 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes());
        } else {
            c.copy_from_slice(&(b ^ ((generation as u64) << 40)).to_le_bytes());
        }
    }
    v
}

/// Four writers (or three and one thread calling `sync` in a loop, with `syncer`) of random
/// 4 KiB blocks into a file 8x `budget` through `layers`; then a final sync and every block
/// read back through a fresh cache. With `one_thread_per_depth`, the cache has one I/O thread
/// per pager depth and the run fails if more than three are ever alive.
fn run(layers: &str, budget: u64, writes_per_thread: usize, seed: u64, syncer: bool, one_thread_per_depth: bool) {
    // One run at a time in this process: the I/O-thread bound counts threads by name, and a
    // cache of a test running alongside would add its own.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let spec = common::layered_spec(tmp.path(), layers);
    let threads = if syncer { 3u64 } else { 4u64 };
    let blocks = 8 * budget / BLOCK as u64;
    let what = format!("{layers} at {} MiB", budget >> 20);
    let _dog = common::Watchdog::new(&what, Duration::from_secs(240));
    // Thread t owns the blocks b with b % threads == t, so the model needs no ordering
    // between threads; the blocks share zstd chunks and aead pages across threads.
    let mut gens = vec![0u32; blocks as usize];
    {
        let io = if one_thread_per_depth { 1 } else { 4 };
        let cache = ubc::Cache::builder().budget(budget).io_threads(io).build().unwrap();
        let stack = Stack::open(&spec, cache.clone()).unwrap();
        let f = stack.top().create("f").unwrap();
        f.set_len(blocks * BLOCK as u64).unwrap();
        let done = AtomicBool::new(false);
        let (per_thread, most, syncs) = std::thread::scope(|s| {
            // The most I/O threads seen alive at once.
            let sampler = s.spawn(|| {
                let mut most = 0;
                while !done.load(SeqCst) {
                    most = most.max(common::threads_named("ubc-io"));
                    std::thread::sleep(Duration::from_millis(5));
                }
                most
            });
            // What the mount does when one process closes a file others still write.
            let syncer = syncer.then(|| {
                s.spawn(|| {
                    let mut n = 0;
                    while !done.load(SeqCst) {
                        f.sync().unwrap();
                        n += 1;
                    }
                    n
                })
            });
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let f = &f;
                    s.spawn(move || {
                        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ t.wrapping_mul(0x2545_f491_4f6c_dd1d));
                        let mut last = std::collections::HashMap::new();
                        for _ in 0..writes_per_thread {
                            let b = rng.random_range(0..blocks / threads) * threads + t;
                            let g = last.get(&b).map_or(1, |g| g + 1);
                            f.write_at(&block(b, g), b * BLOCK as u64).unwrap();
                            last.insert(b, g);
                        }
                        last.into_iter().collect::<Vec<(u64, u32)>>()
                    })
                })
                .collect();
            // Set on the way out, also when a writer or the sync panics: the sampler and the
            // syncer loop until it is, and the scope would wait for them forever.
            struct Done<'a>(&'a AtomicBool);
            impl Drop for Done<'_> {
                fn drop(&mut self) {
                    self.0.store(true, SeqCst);
                }
            }
            let finished = Done(&done);
            let per_thread: Vec<Vec<(u64, u32)>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
            f.sync().unwrap();
            drop(finished);
            (per_thread, sampler.join().unwrap(), syncer.map(|h| h.join().unwrap()))
        });
        for (b, g) in per_thread.into_iter().flatten() {
            gens[b as usize] = g;
        }
        if one_thread_per_depth {
            assert!(most <= 3, "{what}: {most} I/O threads at once, more than one per depth");
        }
        let st = cache.stats();
        assert!(st.totals.evictions + st.daemon_evictions > 0, "{what}: nothing was evicted: {st:?}");
        println!(
            "{what}: {} writes, {} syncs meanwhile, evictions {}, throttled {} ms",
            threads as usize * writes_per_thread,
            syncs.unwrap_or(0),
            st.totals.evictions + st.daemon_evictions,
            st.throttled_ms
        );
    }
    // A fresh cache: what reached the directory is what counts.
    let cache = ubc::Cache::builder().budget(budget).build().unwrap();
    let stack = Stack::open(&spec, cache).unwrap();
    let f = stack.top().open("f").unwrap();
    let mut buf = vec![0u8; BLOCK];
    let mut wrong = 0;
    for b in 0..blocks {
        f.read_exact_at(&mut buf, b * BLOCK as u64).unwrap_or_else(|e| panic!("{what}: block {b}: {e}"));
        let g = gens[b as usize];
        let ok = if g == 0 { buf.iter().all(|&x| x == 0) } else { buf == block(b, g) };
        if !ok {
            wrong += 1;
        }
    }
    assert_eq!(wrong, 0, "{what}: {wrong} of {blocks} blocks read back wrong after a fresh open");
}

fn writes(default: usize) -> usize {
    std::env::var("UBC_NESTED_WRITES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// `dir | aead | zstd` and `dir | zstd | aead` at 2 MiB: a 16 MiB file, 4 x 400 random
/// 4 KiB writes, one I/O thread per depth. At length: `UBC_NESTED_WRITES=50000 cargo test
/// --release -p ubc-stack --test nested_writeback -- --nocapture`.
#[test]
fn random_4k_writes_through_two_general_layers_past_the_budget() {
    let seed = common::seed("UBC_NESTED_SEED");
    for layers in ["aead | zstd", "zstd | aead"] {
        run(layers, 2 << 20, writes(400), seed, false, true);
    }
}

/// A zstd file synced (commit, compaction, tail truncation) from one thread while three
/// others write it — what the mount does when one process closes a file others still
/// write. Every block read back through a fresh cache must be the last one written.
///
/// `sync` must set the store's length from a length read under the size lock held exclusive:
/// read under the shared lock, it could cut off extents other threads had just written, and
/// chunks would fail their checksum (docs/guarantees.md). At length:
/// `UBC_NESTED_WRITES=5000 cargo test --release -p ubc-stack --test nested_writeback syncs`.
#[test]
fn syncs_while_other_threads_write_keep_every_chunk_intact() {
    let seed = common::seed("UBC_NESTED_SEED");
    for layers in ["zstd", "aead | zstd"] {
        run(layers, 2 << 20, writes(400), seed, true, false);
    }
}

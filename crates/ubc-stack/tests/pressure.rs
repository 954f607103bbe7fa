//! Writeback through layers when memory is short (docs/guarantees.md).
//!
//! A layer's writeback needs memory: compressing or sealing an upper page writes pages of
//! the lower file, in the same cache. With a budget much smaller than what is written, the
//! cache is full of the upper files' pages, and cleaning them is the only way to free
//! memory — so the lower writes that cleaning needs must always find memory (Linux keeps
//! reserves for exactly this, `PF_MEMALLOC`), and reclaim done inside a layer's pager call
//! must not recurse into writing back the layer above. Several writers, several files,
//! every stack order, small budgets; each file is read back and compared, and a watchdog
//! turns a hang into a failure with every thread's stack.

mod common;

use rand::{RngExt, SeedableRng};
use std::time::Duration;
use ubc_stack::Stack;

/// Bytes of a file: runs of compressible text and of random bytes, so both zstd's
/// compressed extents and its incompressible fallback are exercised.
fn content(rng: &mut rand::rngs::StdRng, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        let run = rng.random_range(1..32 << 10).min(len - v.len());
        if rng.random_bool(0.5) {
            v.extend((0..run).map(|i| b"the quick brown fox "[i % 20]));
        } else {
            v.extend((0..run).map(|_| rng.random::<u8>()));
        }
    }
    v
}

fn run(layers: &str, budget: u64, writers: usize, file_len: usize, seed: u64) {
    let tmp = tempfile::tempdir().unwrap();
    let spec = common::layered_spec(tmp.path(), layers);
    let cache = ubc::Cache::builder().budget(budget).build().unwrap();
    let stack = Stack::open(&spec, cache.clone()).unwrap();
    let _dog = common::Watchdog::new(&format!("{layers} at {} KiB", budget >> 10), Duration::from_secs(120));
    let expect: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..writers)
            .map(|w| {
                let stack = &stack;
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (w as u64 * 0x9e37_79b9));
                    let f = stack.top().create(&format!("f{w}")).unwrap();
                    let mut model = content(&mut rng, file_len);
                    // Written front to back in pieces, then parts rewritten (read-modify-write
                    // of compressed chunks and sealed blocks while the cache is full).
                    let mut pos = 0;
                    while pos < model.len() {
                        let n = rng.random_range(1..256 << 10).min(model.len() - pos);
                        f.write_at(&model[pos..pos + n], pos as u64).unwrap();
                        pos += n;
                    }
                    for _ in 0..16 {
                        let at = rng.random_range(0..model.len());
                        let n = rng.random_range(1..64 << 10).min(model.len() - at);
                        let new = content(&mut rng, n);
                        model[at..at + n].copy_from_slice(&new);
                        f.write_at(&new, at as u64).unwrap();
                    }
                    f.sync().unwrap();
                    model
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (w, model) in expect.iter().enumerate() {
        let f = stack.top().open(&format!("f{w}")).unwrap();
        let mut back = vec![0u8; model.len()];
        f.read_exact_at(&mut back, 0).unwrap();
        assert!(back == *model, "{layers} at {} KiB: file f{w} reads back wrong", budget >> 10);
    }
    let st = cache.stats();
    assert!(st.totals.evictions + st.daemon_evictions > 0, "the budget was too large to press anything: {st:?}");
    println!(
        "{layers} at {} KiB: {writers} writers x {} KiB, evictions {}, throttled {} ms",
        budget >> 10,
        file_len >> 10,
        st.totals.evictions + st.daemon_evictions,
        st.throttled_ms
    );
}

/// A 1 MiB budget (256 pages) for up to three layers of four 2 MiB files. At length:
/// `UBC_PRESSURE_ROUNDS=20 cargo test --release -p ubc-stack --test pressure -- --nocapture`
/// (each round also at 2 MiB).
#[test]
fn layered_writeback_completes_when_memory_is_short() {
    let seed = common::seed("UBC_PRESSURE_SEED");
    let rounds: Option<usize> = std::env::var("UBC_PRESSURE_ROUNDS").ok().and_then(|s| s.parse().ok());
    let budgets: &[u64] = if rounds.is_some() { &[1 << 20, 2 << 20] } else { &[1 << 20] };
    for round in 0..rounds.unwrap_or(1) {
        for layers in ["zstd:chunk=16K | aead", "aead | zstd:chunk=16K", "zstd", "aead | null"] {
            for &budget in budgets {
                run(layers, budget, 4, 2 << 20, seed.wrapping_add(round as u64));
            }
        }
    }
}

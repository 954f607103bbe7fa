//! Stacked layers (`ubc-stack`): the cost of keeping views through different layers
//! coherent, and what the stack's shared cache gains.
//!
//! Rows (every pair runs in the same process, alternating, `runs` times, medians):
//!
//! * `fig11_random_update` / `fig11_sequential_update`: Heidemann & Popek (SOSP'95),
//!   Figure 11. A 1,024,000-byte file on `dir | null | null`, mapped writable and shared at
//!   layer 2. One op = store one byte into a page (random / sequential order) through the
//!   mapping, then read that byte back with `read_at`: through layer 2 itself (one-layer,
//!   the baseline) or through layer 1 (two-layer, "ubc"). ratio = one-layer time /
//!   two-layer time (1.0 = no interference). Every read is checked to see the stored byte.
//! * `fig11_random_update_general`: the same random update across a general layer: `dir |
//!   aead`. One-layer = mapping store + 1-byte `read_at` at layer 1 (cleartext); two-layer =
//!   mapping store at layer 1 + `read_at` of that page's stored (ciphertext) block at layer 0,
//!   which forces the page to be encrypted and written down every op.
//! * `coherence_overhead`: random 4 KiB `read_at` + `write_at` at the top of `dir | null`,
//!   `Stack::open` ("ubc") vs `Stack::open_without_coherence` (baseline); ratio = on/off
//!   throughput = off time / on time.
//! * `stack_cached_reread`: cached re-read (1 MiB `read_at`) of a file at the top of
//!   `dir | zstd | aead` ("ubc") vs a plain cached `ubc::Cache::create_path` file
//!   (baseline). The note has the cost of re-decoding on every read (a stack with a tiny
//!   cache budget) and the gain of caching the decoded pages.
//! * `stack_randwrite_4k` (its own benchmark, `--only stack_randwrite`, so it can run
//!   alone): random 4 KiB `write_at`s of incompressible data at the top of `dir | aead |
//!   zstd` ("ubc") vs the same writes at the top of `dir` alone (baseline), each stack on its
//!   own 64 MiB cache and a 256 MiB file (4x the budget), every sample ending with the
//!   file's `sync` inside the timing (writes/s counts data written down through every layer).
//!   ratio = stack writes/s / dir writes/s.

use super::Ctx;
use crate::report::{Better, Record};
use crate::util::*;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use ubc::{Access, Cache, Sharing};
use ubc_stack::encrypt::{HEADER_LEN, Key, STORED_BLOCK};
use ubc_stack::{File, Stack};

const PAGE: u64 = 4096;
/// Figure 11's file size.
const FIG11_LEN: u64 = 1_024_000;
const BUDGET: u64 = 512 * MIB;
const CHUNK: usize = 1 << 20;

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let base = std::fs::canonicalize(&ctx.dir).unwrap_or_else(|_| ctx.dir.clone()).join("stack");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("stack scratch dir");
    let key = base.join("key");
    Key::generate().write_file(&key).expect("write key");
    let out = vec![
        fig11(ctx, &base, Order::Random),
        fig11(ctx, &base, Order::Sequential),
        fig11_general(ctx, &base, &key),
        coherence_overhead(ctx, &base),
        cached_reread(ctx, &base, &key),
    ];
    let _ = std::fs::remove_dir_all(&base);
    out
}

/// The `stack_randwrite` benchmark: one row, `stack_randwrite_4k`.
pub fn run_randwrite(ctx: &Ctx) -> Vec<Record> {
    let base = std::fs::canonicalize(&ctx.dir).unwrap_or_else(|_| ctx.dir.clone()).join("stack_randwrite");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("stack scratch dir");
    let key = base.join("key");
    Key::generate().write_file(&key).expect("write key");
    let out = vec![randwrite(ctx, &base, &key)];
    let _ = std::fs::remove_dir_all(&base);
    out
}

fn fresh_dir(base: &Path, name: &str) -> PathBuf {
    let d = base.join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("mkdir");
    d
}

fn cache(budget: u64) -> Cache {
    Cache::builder().budget(budget).build().expect("ubc cache")
}

fn reread_cache(budget: u64) -> Cache {
    cache(budget)
}

/// Write `len` bytes of non-zero data to `f` in 1 MiB chunks.
fn fill(f: &File, len: u64) {
    let buf = AlignedBuf::new(CHUNK);
    let mut off = 0;
    while off < len {
        let n = (len - off).min(CHUNK as u64) as usize;
        f.write_at(&buf[..n], off).expect("stack write_at");
        off += n as u64;
    }
}

/// Read all of `f` with 1 MiB `read_at`s; bytes read.
fn read_all(f: &File, buf: &mut [u8]) -> u64 {
    let mut off = 0;
    loop {
        let n = f.read_at(buf, off).expect("stack read_at");
        if n == 0 {
            return off;
        }
        off += n as u64;
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Order {
    Random,
    Sequential,
}

fn pages(order: Order, n: usize, seed: u64) -> Vec<u64> {
    let npages = FIG11_LEN / PAGE;
    match order {
        Order::Random => random_offsets(n, FIG11_LEN, PAGE, seed).into_iter().map(|o| o / PAGE).collect(),
        Order::Sequential => (0..n as u64).map(|i| i % npages).collect(),
    }
}

/// One update run: for each page, store a byte through `m`, then read through `reader`
/// (`read_off(page)` gives offset and length). Returns (seconds, mismatches seen when
/// `verify`: the byte read back is not the byte stored).
fn updates(
    m: &mut ubc_stack::Mapping,
    reader: &File,
    pages: &[u64],
    read_off: impl Fn(u64) -> (u64, usize),
    verify: bool,
    salt: u8,
) -> (f64, u64) {
    let p = m.as_mut_ptr();
    let mut buf = vec![0u8; STORED_BLOCK as usize];
    let mut bad = 0u64;
    let (secs, ()) = time(|| {
        for (i, &pg) in pages.iter().enumerate() {
            let v = (i as u8).wrapping_add(salt) | 1;
            // SAFETY: `pg * PAGE` is inside the live writable mapping of FIG11_LEN bytes.
            unsafe { std::ptr::write_volatile(p.add((pg * PAGE) as usize), v) };
            let (off, len) = read_off(pg);
            let n = reader.read_at(&mut buf[..len], off).expect("read_at");
            if verify && (n != len || buf[0] != v) {
                bad += 1;
            }
            black_box(&buf);
        }
    });
    (secs, bad)
}

fn fig11(ctx: &Ctx, base: &Path, order: Order) -> Record {
    let (name, paper, target) = match order {
        Order::Random => {
            ("fig11_random_update", "paper 23.9x slowdown (ratio 1/23.9)", "target <= 1.2x slowdown (ratio >= 0.83)")
        }
        Order::Sequential => {
            ("fig11_sequential_update", "paper 1.006x slowdown", "target <= 1.05x slowdown (ratio >= 0.95)")
        }
    };
    let d = fresh_dir(base, name);
    let stack = Stack::open(&format!("dir:{} | null | null", d.display()), cache(BUDGET)).expect("open stack");
    let top = stack.layer(2).expect("layer 2");
    let f = top.create("f11").expect("create");
    fill(&f, FIG11_LEN);
    f.sync().expect("sync");
    let same = top.open("f11").expect("open layer 2");
    let other = stack.layer(1).expect("layer 1").open("f11").expect("open layer 1");
    let mut m = f.map(0..FIG11_LEN, Access::ReadWrite, Sharing::Shared).expect("map layer 2");
    let ops = ctx.scale(200_000, 30_000) as usize;
    let byte = |pg: u64| (pg * PAGE, 1usize);
    // Warm-up (untimed): every page faulted in both views.
    let all = pages(Order::Sequential, (FIG11_LEN / PAGE) as usize, 0);
    let (_, bad_warm1) = updates(&mut m, &same, &all, byte, true, 0);
    let (_, bad_warm2) = updates(&mut m, &other, &all, byte, true, 1);
    let s0 = stack.coherence_stats();
    let (mut one, mut two, mut bad) = (vec![], vec![], bad_warm1 + bad_warm2);
    for r in 0..ctx.runs {
        let ps = pages(order, ops, 11 + r as u64);
        let (t, b) = updates(&mut m, &same, &ps, byte, true, 2 * r as u8);
        one.push(t / ops as f64 * 1e6);
        bad += b;
        let (t, b) = updates(&mut m, &other, &ps, byte, true, 2 * r as u8 + 1);
        two.push(t / ops as f64 * 1e6);
        bad += b;
    }
    let s1 = stack.coherence_stats();
    drop(m);
    Record::from_samples(
        name,
        "us/op",
        Better::Lower,
        &two,
        &one,
        "one layer (store + read both at layer 2)",
        &format!(
            "dir | null | null, 1,024,000-byte file mapped RW shared at layer 2, {ops} ops/sample \
             (store 1 byte + 1-byte read_at); ubc = two-layer (read at layer 1); ratio = one/two; \
             {paper}; {target}; coherence during timing: flushes {}, invalidations {}, slow path {}; \
             read-back mismatches {bad}",
            s1.flushes - s0.flushes,
            s1.invalidations - s0.invalidations,
            s1.slow_path - s0.slow_path
        ),
    )
}

fn fig11_general(ctx: &Ctx, base: &Path, key: &Path) -> Record {
    let name = "fig11_random_update_general";
    let d = fresh_dir(base, name);
    let stack = Stack::open(&format!("dir:{} | aead:keyfile={}", d.display(), key.display()), cache(BUDGET))
        .expect("open stack");
    let top = stack.layer(1).expect("layer 1");
    let f = top.create("f11").expect("create");
    fill(&f, FIG11_LEN);
    f.sync().expect("sync");
    let same = top.open("f11").expect("open layer 1");
    let lower = stack.layer(0).expect("layer 0").open("f11").expect("open layer 0");
    let mut m = f.map(0..FIG11_LEN, Access::ReadWrite, Sharing::Shared).expect("map layer 1");
    let ops = ctx.scale(10_000, 1_500) as usize;
    let byte = |pg: u64| (pg * PAGE, 1usize);
    let block = |pg: u64| (HEADER_LEN + pg * STORED_BLOCK, STORED_BLOCK as usize);
    let all = pages(Order::Sequential, (FIG11_LEN / PAGE) as usize, 0);
    let (_, mut bad) = updates(&mut m, &same, &all, byte, true, 0);
    updates(&mut m, &lower, &all, block, false, 1);
    let s0 = stack.coherence_stats();
    let (mut one, mut two) = (vec![], vec![]);
    for r in 0..ctx.runs {
        let ps = pages(Order::Random, ops, 23 + r as u64);
        let (t, b) = updates(&mut m, &same, &ps, byte, true, 2 * r as u8);
        one.push(t / ops as f64 * 1e6);
        bad += b;
        let (t, _) = updates(&mut m, &lower, &ps, block, false, 2 * r as u8 + 1);
        two.push(t / ops as f64 * 1e6);
    }
    let s1 = stack.coherence_stats();
    drop(m);
    // After the last store: the stored file must decrypt to what the mapping holds.
    f.sync().expect("sync");
    Record::from_samples(
        name,
        "us/op",
        Better::Lower,
        &two,
        &one,
        "one layer (store + read both at aead layer 1)",
        &format!(
            "dir | aead, 1,024,000-byte file mapped RW shared at layer 1, {ops} random ops/sample; \
             one-layer = store + 1-byte read_at at layer 1; ubc = two-layer: store at layer 1 + read_at of \
             the page's {STORED_BLOCK}-byte ciphertext block at layer 0 (each op re-encrypts and writes the \
             page down); ratio = one/two; coherence during timing: flushes {}, invalidations {}, slow path {}; \
             cleartext read-back mismatches {bad}",
            s1.flushes - s0.flushes,
            s1.invalidations - s0.invalidations,
            s1.slow_path - s0.slow_path
        ),
    )
}

fn coherence_overhead(ctx: &Ctx, base: &Path) -> Record {
    let len = ctx.scale(64 * MIB, 16 * MIB);
    let ops = ctx.scale(200_000, 30_000) as usize;
    let mk = |coherent: bool| {
        let d = fresh_dir(base, if coherent { "coh_on" } else { "coh_off" });
        let spec = format!("dir:{} | null", d.display());
        let s = if coherent {
            Stack::open(&spec, cache(BUDGET))
        } else {
            Stack::open_without_coherence(&spec, cache(BUDGET))
        }
        .expect("open stack");
        let f = s.top().create("data").expect("create");
        fill(&f, len);
        f.sync().expect("sync");
        let mut buf = vec![0u8; CHUNK];
        assert_eq!(read_all(&f, &mut buf), len);
        (s, f)
    };
    let (on_s, on) = mk(true);
    let (_off_s, off) = mk(false);
    let offsets = random_offsets(ops, len, PAGE, 5);
    let work = |f: &File| {
        let mut b = [0u8; PAGE as usize];
        time(|| {
            for (i, &o) in offsets.iter().enumerate() {
                f.read_at(&mut b, o).expect("read_at");
                b[0] = i as u8;
                f.write_at(&b, o).expect("write_at");
            }
        })
        .0
    };
    work(&on);
    work(&off);
    let (mut u, mut k) = (vec![], vec![]);
    for _ in 0..ctx.runs {
        u.push(ops as f64 / work(&on));
        k.push(ops as f64 / work(&off));
    }
    let st = on_s.coherence_stats();
    Record::from_samples(
        "coherence_overhead",
        "ops/s",
        Better::Higher,
        &u,
        &k,
        "Stack::open_without_coherence",
        &format!(
            "dir | null, {} MiB file at the top, resident, {ops} ops/sample of random 4 KiB read_at + write_at; \
             ubc = coherence on; ratio = off time / on time; coherence counters (on): slow-path registrations {} (every other op used a held token); target >= 0.97",
            len >> 20,
            st.slow_path
        ),
    )
}

fn cached_reread(ctx: &Ctx, base: &Path, key: &Path) -> Record {
    let len = ctx.scale(64 * MIB, 32 * MIB);
    let gb = len as f64 / 1e9;
    let d = fresh_dir(base, "reread");
    let spec = format!("dir:{} | zstd | aead:keyfile={}", d.display(), key.display());
    {
        let s = Stack::open(&spec, reread_cache(BUDGET)).expect("open stack");
        let f = s.top().create("data").expect("create");
        fill(&f, len);
        f.sync().expect("sync");
    }
    let mut buf = AlignedBuf::new(CHUNK);
    // The stack, fresh cache: first pass decodes, later passes are cached.
    let stack = Stack::open(&spec, reread_cache(BUDGET)).expect("reopen stack");
    let sf = stack.top().open("data").expect("open");
    let (first, n) = time(|| read_all(&sf, &mut buf));
    assert_eq!(n, len, "stack file length");
    // Plain ubc file of the same size, resident.
    let pc = cache(BUDGET);
    let pf = pc.create_path(base.join("reread_plain.dat")).expect("create_path");
    {
        let mut off = 0;
        while off < len {
            let n = (len - off).min(CHUNK as u64) as usize;
            pf.write_at(&buf[..n], off).expect("write_at");
            off += n as u64;
        }
        pf.sync().expect("sync");
    }
    assert_eq!(ubc_read_all(&pf, &mut buf), len);
    // Tiny budget: every read re-decrypts and re-decompresses.
    let tiny_budget = 16 * MIB;
    let tiny = Stack::open(&spec, reread_cache(tiny_budget)).expect("open tiny stack");
    let tf = tiny.top().open("data").expect("open tiny");
    let (mut u, mut k, mut t) = (vec![], vec![], vec![]);
    for _ in 0..ctx.runs {
        let (s, n) = time(|| read_all(&sf, &mut buf));
        assert_eq!(n, len);
        u.push(gb / s);
        let (s, n) = time(|| ubc_read_all(&pf, &mut buf));
        assert_eq!(n, len);
        k.push(gb / s);
        let (s, n) = time(|| read_all(&tf, &mut buf));
        assert_eq!(n, len);
        t.push(gb / s);
    }
    let tiny_gbs = crate::report::median(&t);
    let cached_gbs = crate::report::median(&u);
    Record::from_samples(
        "stack_cached_reread",
        "GB/s",
        Better::Higher,
        &u,
        &k,
        "plain ubc Cache::create_path file (cached)",
        &format!(
            "{} MiB file at the top of dir | zstd | aead (incompressible data), 1 MiB read_at, all pages cached; \
             ratio = plain time / stack time; first pass on a fresh {} MiB cache {:.3} GB/s; re-decoding every \
             read (stack with a {} MiB budget) {:.3} GB/s, caching gains {:.1}x; target >= 0.8",
            len >> 20,
            BUDGET >> 20,
            gb / first,
            tiny_budget >> 20,
            tiny_gbs,
            cached_gbs / tiny_gbs,
        ),
    )
}

const RANDWRITE_BUDGET: u64 = 64 * MIB;

fn randwrite(ctx: &Ctx, base: &Path, key: &Path) -> Record {
    let len = 256 * MIB;
    let ops = ctx.scale(60_000, 15_000) as usize;
    let mk = |name: &str, upper: &str| {
        let d = fresh_dir(base, name);
        let stack = Stack::open(&format!("dir:{}{upper}", d.display()), cache(RANDWRITE_BUDGET)).expect("open stack");
        let f = stack.top().create("data").expect("create");
        fill(&f, len);
        f.sync().expect("sync");
        (stack, f)
    };
    let (layered_stack, layered) = mk("randwrite_layered", &format!(" | aead:keyfile={} | zstd", key.display()));
    let (_plain_stack, plain) = mk("randwrite_dir", "");
    let src = AlignedBuf::new(CHUNK);
    let work = |f: &File, n: usize, seed: u64| {
        let offsets = random_offsets(n, len, PAGE, seed);
        let (secs, ()) = time(|| {
            for (i, &o) in offsets.iter().enumerate() {
                let s = (i * 7 * PAGE as usize) % CHUNK;
                f.write_at(&src[s..s + PAGE as usize], o).expect("stack write_at");
            }
            f.sync().expect("stack sync");
        });
        n as f64 / secs
    };
    // Warm-up (untimed): both caches hold a mix of clean and written pages.
    work(&layered, ops / 4, 1);
    work(&plain, ops / 4, 1);
    let c0 = layered_stack.cache().stats();
    let (mut u, mut k) = (vec![], vec![]);
    for r in 0..ctx.runs {
        u.push(work(&layered, ops, 100 + r as u64));
        k.push(work(&plain, ops, 100 + r as u64));
    }
    let c1 = layered_stack.cache().stats();
    Record::from_samples(
        "stack_randwrite_4k",
        "writes/s",
        Better::Higher,
        &u,
        &k,
        "the same writes at the top of dir alone",
        &format!(
            "{ops} random 4 KiB write_at of incompressible data/sample + sync (timed) into a {} MiB file at the top of \
             dir | aead | zstd, {} MiB budget per stack; ratio = stack writes/s / dir writes/s; stack cache during timing: \
             pages written back {}, writers throttled {} ms, evictions {}",
            len >> 20,
            RANDWRITE_BUDGET >> 20,
            c1.totals.writebacks - c0.totals.writebacks,
            c1.throttled_ms - c0.throttled_ms,
            c1.totals.evictions - c0.totals.evictions,
        ),
    )
}

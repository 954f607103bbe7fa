//! `ubc tour`: the main job, shown on a stack `dir | aead | zstd` with a sample data set.
//! Specs list layers bottom first, so data written at the top is compressed by zstd, then
//! encrypted by aead, then stored by dir: ciphertext is random and would not compress.
//! Every number printed is measured while the tour runs.

use crate::error::{Ctx, EX_CANTCREAT, EX_SOFTWARE, Fail, Result};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use ubc::{Access, Cache, Sharing};
use ubc_stack::{Stack, encrypt::Key};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Directory to work in (a fresh subdirectory is made and removed); default: a temporary directory
    #[arg(long, value_name = "D")]
    dir: Option<PathBuf>,
    /// Budget of the main cache, in MiB
    #[arg(long, value_name = "MiB", default_value_t = 64)]
    budget: u64,
}

const MIB: u64 = 1 << 20;

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / MIB as f64)
}

/// Turn a library error into a tour failure (the tour is the library's job: any error is ours).
fn bug<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> Fail + '_ {
    move |e| Fail::new(EX_SOFTWARE, what, e.to_string())
}

fn check(ok: bool, what: &str) -> Result<()> {
    if ok { Ok(()) } else { Err(Fail::new(EX_SOFTWARE, "tour", format!("check failed: {what}"))) }
}

pub fn run(a: Args) -> Result<()> {
    if a.budget < 16 {
        return Err(Fail::usage("--budget", "the tour needs at least 16 MiB"));
    }
    let tmp = match &a.dir {
        Some(d) => tempfile::Builder::new().prefix("ubc-tour-").tempdir_in(d),
        None => tempfile::Builder::new().prefix("ubc-tour-").tempdir(),
    }
    .map_err(|e| {
        Fail::io(crate::error::Side::Output, &a.dir.as_deref().unwrap_or(Path::new("$TMPDIR")).display().to_string(), e)
    })?;
    let root = tmp.path();
    let data = root.join("data");
    std::fs::create_dir(&data).output(&data.display().to_string())?;
    let key = root.join("key");
    Key::generate().write_file(&key).output(&key.display().to_string())?;
    let spec = format!("dir:{} | aead:keyfile={} | zstd:level=3", data.display(), key.display());
    let t0 = Instant::now();

    // Write-behind: the flusher wakes every 100 ms and writes back data dirty for 300 ms.
    let cache = Cache::builder()
        .budget(a.budget * MIB)
        .writeback(Duration::from_millis(100), Duration::from_millis(300))
        .build()
        .map_err(bug("cache"))?;
    let stack = Stack::open(&spec, cache.clone()).input(&spec)?;
    let top = stack.top();
    let bottom = stack.layer(0).input(&spec)?;
    println!(
        "ubc tour — stack `dir | aead | zstd:level=3` in {}, cache budget {} MiB, page {} B",
        root.display(),
        a.budget,
        cache.page_size()
    );

    // The sample data set, written at the top (cleartext), synced down to the directory.
    let files: [(&str, u64); 4] = [
        ("notes.txt", 24 << 10),
        ("logs/day-1.log", 2 * MIB),
        ("logs/day-2.log", 2 * MIB),
        ("big/archive.txt", 16 * MIB),
    ];
    top.mkdir("logs").output("logs")?;
    top.mkdir("big").output("big")?;
    let t = Instant::now();
    for (i, (name, size)) in files.iter().enumerate() {
        let f = top.create(name).output(name)?;
        let text = sample_text(*size as usize, i as u64 + 1);
        f.write_at(&text, 0).output(name)?;
    }
    stack.sync_all().output(&spec)?;
    let clear: u64 = files.iter().map(|f| f.1).sum();
    let stored: u64 = files.iter().map(|(n, _)| std::fs::metadata(data.join(n)).map(|m| m.len()).unwrap_or(0)).sum();
    println!(
        "\nsample data: {} files, {} of text written at the top and synced in {:.2} s; the directory stores {} (compression ratio {:.2})",
        files.len(),
        mib(clear),
        t.elapsed().as_secs_f64(),
        mib(stored),
        clear as f64 / stored.max(1) as f64
    );
    println!(
        "  (zstd sits above aead: it compresses the cleartext, then aead encrypts; ciphertext is random and would not compress)"
    );

    one_copy(&stack, &cache)?;
    store_then_read(&stack)?;
    top_and_bottom(&stack, &spec, &data)?;
    eviction(&spec)?;
    readahead_writebehind(&stack, &cache, &spec)?;

    // (f) Statistics.
    stack.sync_all().output(&spec)?;
    let c = stack.coherence_stats();
    let (hits, inval) = stack.name_cache_stats();
    println!("\n(f) statistics of the main cache:\n{}", cache.stats());
    println!(
        "coherence     {:>10}       slow-path ops, {} flushes down, {} invalidations; name cache {} hits, {} invalidations",
        c.slow_path, c.flushes, c.invalidations, hits, inval
    );
    println!("\ntour done in {:.2} s", t0.elapsed().as_secs_f64());
    drop(bottom);
    Ok(())
}

/// (a) A file read with `read_at` and then mapped: the mapping is served from the same
/// cached pages, so the cache's resident bytes do not grow.
fn one_copy(stack: &Stack, cache: &Cache) -> Result<()> {
    let name = "logs/day-1.log";
    let f = stack.top().open(name).input(name)?;
    let len = f.len().input(name)?;
    let mut buf = vec![0u8; len as usize];
    f.read_exact_at(&mut buf, 0).input(name)?;
    let before = cache.stats().totals.resident_bytes;
    let m = f.map(0..len, Access::ReadOnly, Sharing::Shared).input(name)?;
    let page = cache.page_size();
    let mut touched = 0u64;
    let mut sum = 0u64;
    for off in (0..len as usize).step_by(page) {
        sum = sum.wrapping_add(m[off] as u64);
        touched += 1;
    }
    let same = m[..] == buf[..];
    let after = cache.stats().totals.resident_bytes;
    let st = cache.stats();
    println!("\n(a) one copy for read and map — {name}, {}", mib(len));
    println!("    read_at of all of it, then mmap and a load from each of its {touched} pages (checksum {sum}):");
    println!(
        "    cache resident before the map {}, after {} (+{} B; a second copy would add {})",
        mib(before),
        mib(after),
        after as i64 - before as i64,
        mib(len)
    );
    println!(
        "    mapping == read_at bytes: {same}; faults the cache resolved for it: {} (map mode {})",
        st.map_faults, st.map_mode
    );
    check(same, "mapped bytes equal read bytes")?;
    check(after < before + len / 2, "resident bytes do not double")?;
    Ok(())
}

/// (b) A store through a shared mapping is what `read_at` returns next, with no msync.
fn store_then_read(stack: &Stack) -> Result<()> {
    let name = "notes.txt";
    let f = stack.top().open_with(name, ubc_stack::OpenOptions::new().write(true)).input(name)?;
    let mut m = f.map(0..4096, Access::ReadWrite, Sharing::Shared).input(name)?;
    let mut old = [0u8; 16];
    f.read_exact_at(&mut old, 0).input(name)?;
    m[..16].copy_from_slice(b"STORED BY MMAP! ");
    let reader = stack.top().open(name).input(name)?;
    let mut seen = [0u8; 16];
    reader.read_exact_at(&mut seen, 0).input(name)?;
    println!("\n(b) a store through a mapping is seen by read_at — {name}");
    println!("    read_at(0..16) before: {:?}", String::from_utf8_lossy(&old));
    println!("    store into the mapping, then read_at(0..16) on another handle: {:?}", String::from_utf8_lossy(&seen));
    check(&seen == b"STORED BY MMAP! ", "read_at sees the store")?;
    drop(m);
    Ok(())
}

/// (c) Cleartext written at the top while the bottom's bytes are read: ciphertext of the
/// compressed text, current without a sync; a fresh stack decrypts them to the new text.
fn top_and_bottom(stack: &Stack, spec: &str, data: &Path) -> Result<()> {
    let name = "notes.txt";
    let secret = b"meet at noon by the old mill; bring the maps. ";
    let text: Vec<u8> = secret.iter().copied().cycle().take(secret.len() * 400).collect();
    let f = stack.top().create(name).output(name)?;
    f.write_at(&text, 0).output(name)?; // no sync
    let disk = stack.layer(0).input(name)?.open(name).input(name)?;
    let mut stored = vec![0u8; disk.len().input(name)? as usize];
    disk.read_exact_at(&mut stored, 0).input(name)?;
    let leaks = stored.windows(4).filter(|w| *w == b"noon").count();
    let host_before = std::fs::metadata(data.join(name)).map(|m| m.len()).unwrap_or(0);
    println!("\n(c) cleartext at the top, ciphertext at the bottom — {name}, no sync");
    println!(
        "    wrote {} B of cleartext at the top; layer 0 reads {} B: {:02x?}…",
        text.len(),
        stored.len(),
        &stored[..12.min(stored.len())]
    );
    println!(
        "    occurrences of \"noon\": {} in the cleartext, {leaks} in the stored bytes",
        text.windows(4).filter(|w| *w == b"noon").count()
    );
    check(leaks == 0 && stored.len() != text.len(), "no cleartext below, size differs")?;
    stack.sync_all().output(name)?;
    let host_after = std::fs::metadata(data.join(name)).map(|m| m.len()).unwrap_or(0);
    let fresh = Stack::open(spec, Cache::new(16 * MIB).map_err(bug("cache"))?).input(spec)?;
    let g = fresh.top().open(name).input(name)?;
    let mut back = vec![0u8; g.len().input(name)? as usize];
    g.read_exact_at(&mut back, 0).input(name)?;
    println!(
        "    host file {} B before sync, {} B after; a fresh stack (new cache) decrypts it to {} B: {:?}…",
        host_before,
        host_after,
        back.len(),
        String::from_utf8_lossy(&back[..28.min(back.len())])
    );
    check(back == text, "fresh stack reads the new cleartext")?;
    Ok(())
}

/// (d) A second cache with a 4 MiB budget reads a 16 MiB file through the whole stack.
fn eviction(spec: &str) -> Result<()> {
    let name = "big/archive.txt";
    let budget = 4 * MIB;
    let small = Cache::builder().budget(budget).build().map_err(bug("cache"))?;
    let stack = Stack::open(spec, small.clone()).input(spec)?;
    let f = stack.top().open(name).input(name)?;
    let len = f.len().input(name)?;
    let mut buf = vec![0u8; 256 << 10];
    let (mut off, mut peak) = (0u64, 0u64);
    let t = Instant::now();
    while off < len {
        let n = f.read_at(&mut buf, off).input(name)?;
        if n == 0 {
            break;
        }
        off += n as u64;
        peak = peak.max(small.stats().totals.resident_bytes);
    }
    let st = small.stats();
    println!(
        "\n(d) eviction under a small budget — a second cache of {} reads {name} ({}) through all three layers",
        mib(budget),
        mib(len)
    );
    println!(
        "    read {} in {:.2} s; pages evicted {}; resident at most {} during the read, {} now (budget {})",
        mib(off),
        t.elapsed().as_secs_f64(),
        st.totals.evictions,
        mib(peak),
        mib(st.totals.resident_bytes),
        mib(st.budget_bytes)
    );
    check(st.totals.evictions > 0 && peak <= budget, "evictions > 0 and resident <= budget")?;
    Ok(())
}

/// (e) Read-ahead on a sequential read; write-behind: dirty after writes, clean after the
/// flusher's interval without any sync.
fn readahead_writebehind(stack: &Stack, cache: &Cache, spec: &str) -> Result<()> {
    // Read-ahead: a fresh cache (nothing resident) reading day-2.log sequentially in 64 KiB reads.
    let name = "logs/day-2.log";
    let fresh = Stack::open(spec, Cache::new(32 * MIB).map_err(bug("cache"))?).input(spec)?;
    let f = fresh.top().open(name).input(name)?;
    let mut buf = vec![0u8; 64 << 10];
    let mut off = 0;
    while let n @ 1.. = f.read_at(&mut buf, off).input(name)? {
        off += n as u64;
    }
    let st = fresh.cache().stats().totals;
    println!("\n(e) read-ahead and write-behind");
    println!(
        "    sequential read of {name} ({}) in 64 KiB reads on a cold cache: {} pages read ahead, {} of them then hit; {} misses, {} hits",
        mib(off),
        st.readahead_pages,
        st.readahead_hits,
        st.misses,
        st.hits
    );
    drop(f);
    drop(fresh);

    let name = "logs/day-3.log";
    stack.sync_all().output(spec)?;
    let wb0 = cache.stats().totals.writebacks;
    let f = stack.top().create(name).output(name)?;
    let text = sample_text(2 * MIB as usize, 9);
    let t = Instant::now();
    for (i, chunk) in text.chunks(256 << 10).enumerate() {
        f.write_at(chunk, (i * (256 << 10)) as u64).output(name)?;
    }
    let write_ms = t.elapsed().as_secs_f64() * 1e3;
    let cs = cache.stats();
    let dirty = cs.totals.dirty_bytes;
    let host = |p: &str| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let host_path = spec
        .split('|')
        .next()
        .and_then(|d| d.trim().strip_prefix("dir:"))
        .map(|d| format!("{d}/{name}"))
        .ok_or_else(|| Fail::new(EX_CANTCREAT, spec, "no dir layer"))?;
    println!(
        "    wrote {} at the top in {write_ms:.1} ms, no sync: {} dirty in the cache ({} unclean), host file {} B",
        mib(text.len() as u64),
        mib(dirty),
        mib(cs.unclean_bytes),
        host(&host_path)
    );
    // The flusher writes the top's (zstd) pages into the aead layer's, those into the directory's:
    // wait until nothing is unclean (dirty, under writeback or reserved) any more.
    let t = Instant::now();
    let mut cs = cache.stats();
    while (cs.unclean_bytes > 0 || cs.totals.writebacks == wb0) && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
        cs = cache.stats();
    }
    println!(
        "    {} ms later, with no sync: {} dirty, {} unclean, {} pages written back by the flusher ({} rounds so far), host file {} B",
        t.elapsed().as_millis(),
        mib(cs.totals.dirty_bytes),
        mib(cs.unclean_bytes),
        cs.totals.writebacks - wb0,
        cs.flusher_runs,
        host(&host_path)
    );
    f.sync().output(name)?;
    println!("    after sync: {} dirty, host file {} B", mib(cache.stats().totals.dirty_bytes), host(&host_path));
    Ok(())
}

/// Semi-compressible text: lines of words from a small vocabulary, with numbers.
fn sample_text(len: usize, seed: u64) -> Vec<u8> {
    const WORDS: &[&str] = &[
        "cache", "page", "buffer", "unified", "layer", "stack", "mapping", "fault", "evict", "dirty", "clean", "flush",
        "read", "write", "ahead", "behind", "budget", "memory", "disk", "block", "cipher", "zstd", "chunk", "header",
        "vnode", "pager", "window", "daemon", "policy", "clock", "sieve", "queue", "the", "a", "of", "to", "and", "in",
        "is", "on",
    ];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::with_capacity(len + 64);
    let mut line = 0u64;
    while out.len() < len {
        line += 1;
        out.extend_from_slice(format!("{line:08} t={} ", next() % 100_000).as_bytes());
        for _ in 0..(6 + next() % 8) {
            out.extend_from_slice(WORDS[(next() % WORDS.len() as u64) as usize].as_bytes());
            out.push(b' ');
        }
        out.push(b'\n');
    }
    out.truncate(len);
    out
}

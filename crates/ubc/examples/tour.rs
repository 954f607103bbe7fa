//! A short tour of the ubc core, on a built-in default: a temporary directory and a cache
//! budget of 8 MiB. Writes a file larger than the budget, reads it back, shows that two
//! handles share one copy, lends pages zero-copy, syncs, and prints the statistics.
//! Every number printed is measured, not written in.
//!
//!     cargo run --release -p ubc --example tour [-- DIR [BUDGET_MIB]]

use std::time::Instant;
use ubc::{Access, Cache};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let tmp = tempfile::tempdir()?;
    let dir = args.get(1).map(std::path::PathBuf::from).unwrap_or_else(|| tmp.path().to_path_buf());
    let budget_mib: u64 = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(8);
    let cache = Cache::builder().budget(budget_mib << 20).build()?;
    let path = dir.join("tour.dat");
    println!("ubc tour: cache budget {budget_mib} MiB, file {}", path.display());

    // 1. Write 4x the budget: pages are written back and evicted to stay within budget.
    let size = 4 * (budget_mib << 20);
    let f = cache.create_path(&path)?;
    let block: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
    let t = Instant::now();
    for off in (0..size).step_by(block.len()) {
        f.write_at(&block, off)?;
    }
    f.sync()?;
    let secs = t.elapsed().as_secs_f64();
    let st = cache.stats();
    println!(
        "1. wrote {} MiB in {:.2} s ({:.0} MiB/s) incl. sync; {} pages evicted, {} written back in {} clustered put_pages calls; resident {:.1} MiB <= budget",
        size >> 20,
        secs,
        (size >> 20) as f64 / secs,
        st.totals.evictions,
        st.totals.writebacks,
        st.totals.put_calls,
        st.totals.resident_bytes as f64 / (1 << 20) as f64
    );
    assert!(st.totals.resident_bytes <= st.budget_bytes);

    // 2. Read it back and check every byte; the host file agrees byte for byte.
    let mut buf = vec![0u8; 1 << 20];
    let mut bad = 0u64;
    for off in (0..size).step_by(buf.len()) {
        f.read_exact_at(&mut buf, off)?;
        bad += buf.iter().zip(&block).filter(|(a, b)| a != b).count() as u64;
    }
    let on_disk = std::fs::metadata(&path)?.len();
    println!("2. read back {} MiB: {bad} bytes differ; host file is {} MiB", size >> 20, on_disk >> 20);

    // 3. Re-read the first MiB twice (evicted long ago): the first pass misses and fills
    //    from the host file, the second is served from the cache.
    let before = f.stats();
    f.read_exact_at(&mut buf, 0)?;
    let mid = f.stats();
    f.read_exact_at(&mut buf, 0)?;
    let after = f.stats();
    println!(
        "3. first MiB read twice: first pass {} hits / {} misses, second pass {} hits / {} misses",
        mid.hits - before.hits,
        mid.misses - before.misses,
        after.hits - mid.hits,
        after.misses - mid.misses
    );

    // 4. A second handle on the same file shares the cached pages: one copy.
    let resident_before = cache.stats().totals.resident_bytes;
    let g = cache.open_path(&path, Access::ReadOnly)?;
    g.read_exact_at(&mut buf, size - (1 << 20))?;
    f.write_at(b"written through f", size - (1 << 20))?;
    let mut seen = [0u8; 17];
    g.read_exact_at(&mut seen, size - (1 << 20))?;
    println!(
        "4. second handle: {} objects cached, resident {} -> {} bytes; g sees f's write: {:?}",
        cache.stats().objects,
        resident_before,
        cache.stats().totals.resident_bytes,
        String::from_utf8_lossy(&seen)
    );

    // 5. A window lends the cached bytes themselves (no copy).
    let w = f.window(size - (1 << 20), 17)?;
    println!("5. window at {:p} holds {:?} (the cached page, not a copy)", w.as_ptr(), String::from_utf8_lossy(&w));
    drop(w);

    f.sync()?;
    println!("\nstatistics:\n{}", cache.stats());
    Ok(())
}

//! A key-value store with a write-ahead log on a file mapped through ubc (`kv.rs`), crashed
//! and recovered: on a built-in default (a temporary directory, 16,384 keys in a 136 KiB
//! data file, a cache budget of 64 KiB so that pages are written back all the time), it
//! runs the store in a child process, kills it with SIGKILL after a while, recovers, and
//! checks that the store holds exactly the puts of some prefix containing every
//! acknowledged one — `ROUNDS` times (default 5).
//!
//!     cargo run --release -p ubc --example walkv [-- ROUNDS [DIR]]
//!
//! `walkv --no-hook` runs the same without the writeback hook, to show what it prevents:
//! pages reach the disk before their log records, and recovery finds puts that a crash
//! separated from the ones before them.

mod kv;

use std::time::Duration;

const KEYS: u64 = 16_384;
const BUDGET: u64 = 64 << 10;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        let (dir, seed, hooked) = (&args[2], args[3].parse()?, args[4] == "hooked");
        kv::run_child(std::path::Path::new(dir), seed, KEYS, BUDGET, hooked);
    }
    let hooked = !args.iter().any(|a| a == "--no-hook");
    let rest: Vec<&String> = args[1..].iter().filter(|a| *a != "--no-hook").collect();
    let rounds: u64 = rest.first().map(|s| s.parse()).transpose()?.unwrap_or(5);
    let tmp = tempfile::tempdir()?;
    let base = rest.get(1).map(std::path::PathBuf::from).unwrap_or_else(|| tmp.path().to_path_buf());
    println!(
        "walkv: {KEYS} keys, cache budget {} KiB, writeback hook {}",
        BUDGET >> 10,
        if hooked { "on" } else { "OFF" }
    );
    let mut failed = 0;
    let (dir, seed) = (base.join("store"), 0x1234_5678);
    std::fs::create_dir_all(&dir)?;
    for round in 0..rounds {
        // Crashes of the same store: each child starts from the state the last recovery
        // left and continues the sequence of puts where the recovered prefix ends.
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.args(["child", &dir.to_string_lossy(), &seed.to_string(), if hooked { "hooked" } else { "plain" }]);
        let after = Duration::from_millis(200 + 150 * (round % 4));
        let acked = kv::crash_child(cmd, after);
        match kv::recover_and_check(&dir, seed, KEYS, acked) {
            Ok(r) => println!(
                "round {round}: killed after {} ms, {} puts acknowledged, recovered the first {} ({} replayed from the log): ok",
                after.as_millis(),
                r.acked,
                r.prefix,
                r.replayed
            ),
            Err(e) => {
                failed += 1;
                println!("round {round}: killed after {} ms: FAILED: {e}", after.as_millis());
            }
        }
    }
    if failed > 0 {
        return Err(format!("{failed} of {rounds} rounds recovered a state no prefix of the puts has").into());
    }
    Ok(())
}

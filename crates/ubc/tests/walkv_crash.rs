//! The write-ahead log example (`examples/walkv`) under the crash harness: its store runs in
//! a child process (this test binary, re-executed), is killed with SIGKILL at a random time
//! while the cache writes its pages back under a budget a quarter of the data file, and is
//! recovered in a fresh cache: every time, the store must hold exactly the puts of some
//! prefix of the sequence that contains every acknowledged put. The writeback hook is what
//! makes that hold (`walkv --no-hook` shows states no prefix has, in about one crash in
//! four); the child continues the sequence after each recovery, so recovery of a recovered
//! store is tested too. `UBC_WALKV_ROUNDS` (default 6) sets the crashes.

#[path = "../examples/walkv/kv.rs"]
mod kv;

use std::time::Duration;

const KEYS: u64 = 16_384;
const BUDGET: u64 = 64 << 10;
const CHILD: &str = "UBC_WALKV_CHILD";

#[test]
fn a_killed_store_recovers_a_prefix_of_its_puts_holding_every_acknowledged_one() {
    if let Ok(v) = std::env::var(CHILD) {
        let (dir, seed) = v.split_once(':').unwrap();
        kv::run_child(std::path::Path::new(dir), seed.parse().unwrap(), KEYS, BUDGET, true);
    }
    let rounds: u64 = std::env::var("UBC_WALKV_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(6);
    let tmp = tempfile::tempdir().unwrap();
    let seed: u64 = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut last = 0;
    for round in 0..rounds {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "a_killed_store_recovers_a_prefix_of_its_puts_holding_every_acknowledged_one",
            "--nocapture",
        ])
        .env(CHILD, format!("{}:{seed}", tmp.path().display()));
        // 100..600 ms: some kills land in the child's own recovery and first checkpoint.
        let after = Duration::from_millis(100 + kv::op(seed, round, 500).0);
        let acked = kv::crash_child(cmd, after);
        let r = kv::recover_and_check(tmp.path(), seed, KEYS, acked)
            .unwrap_or_else(|e| panic!("seed {seed}, crash {round} after {} ms: {e}", after.as_millis()));
        eprintln!(
            "crash {round} after {} ms: {} puts acknowledged, the first {} recovered ({} replayed from the log)",
            after.as_millis(),
            r.acked,
            r.prefix,
            r.replayed
        );
        assert!(r.prefix >= last, "the store lost puts it had recovered before ({} < {last})", r.prefix);
        last = r.prefix;
    }
    assert!(last > 0, "no put in {rounds} runs");
}

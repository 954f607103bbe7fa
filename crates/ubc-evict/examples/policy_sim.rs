//! Hit ratios of LRU, CLOCK, SIEVE and S3-FIFO on the simulator's standard workloads.
//!
//! `cargo run -p ubc-evict --release --example policy_sim [-- --json] [--capacity N]
//! [--accesses N] [--seed N]`
//!
//! Prints a markdown table (one row per workload, one column per policy, best in bold), or
//! with `--json` one JSON record per line: `{"bench":"policy_<workload>","policy":..,
//! "hit_ratio":..}`. Defaults (8192-page cache, 2M accesses per workload) run in a few
//! seconds in release mode.

use std::io::Write;
use std::time::Instant;

use ubc_evict::PolicyKind;
use ubc_evict::sim::{Model, standard_workloads};

/// Command-line options.
struct Options {
    json: bool,
    capacity: usize,
    accesses: usize,
    seed: u64,
}

/// Parse the command line; exits with a usage message on anything unknown.
fn parse_args() -> Options {
    let mut o = Options { json: false, capacity: 8192, accesses: 2_000_000, seed: 42 };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> u64 {
            args.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
                eprintln!("{name} needs a number");
                std::process::exit(2)
            })
        };
        match a.as_str() {
            "--json" => o.json = true,
            "--capacity" => o.capacity = num("--capacity").max(1) as usize,
            "--accesses" => o.accesses = num("--accesses") as usize,
            "--seed" => o.seed = num("--seed"),
            _ => {
                eprintln!("usage: policy_sim [--json] [--capacity PAGES] [--accesses N] [--seed N]");
                std::process::exit(2)
            }
        }
    }
    o
}

/// Print one line to stdout; exit quietly when the reader went away (`| head`).
macro_rules! out {
    ($($arg:tt)*) => {
        if writeln!(std::io::stdout().lock(), $($arg)*).is_err() {
            std::process::exit(0);
        }
    };
}

/// Run every workload against every model and print the results.
fn main() {
    let o = parse_args();
    let start = Instant::now();
    let workloads = standard_workloads(o.capacity, o.accesses, o.seed);
    if !o.json {
        out!(
            "Hit ratio, cache = {} pages, {} accesses per workload, seed {} (default policy: {})\n",
            o.capacity,
            o.accesses,
            o.seed,
            PolicyKind::default()
        );
        let names: Vec<&str> = Model::ALL.iter().map(|m| m.name()).collect();
        out!("| workload | {} |", names.join(" | "));
        out!("|---|{}", "---:|".repeat(names.len()));
    }
    for w in &workloads {
        let ratios: Vec<f64> = Model::ALL.iter().map(|m| m.simulate(w.capacity, &w.trace).hit_ratio()).collect();
        if o.json {
            for (m, r) in Model::ALL.iter().zip(&ratios) {
                out!("{{\"bench\":\"policy_{}\",\"policy\":\"{}\",\"hit_ratio\":{:.6}}}", w.name, m.name(), r);
            }
        } else {
            let best = ratios.iter().cloned().fold(f64::MIN, f64::max);
            let cells: Vec<String> = ratios
                .iter()
                .map(|&r| {
                    let cell = format!("{:.2}%", 100.0 * r);
                    if r == best { format!("**{cell}**") } else { cell }
                })
                .collect();
            out!("| {} | {} |", w.name, cells.join(" | "));
        }
    }
    if !o.json {
        out!("\n({:.1} s)", start.elapsed().as_secs_f64());
    }
}

//! `ubc-bench`: runs every benchmark — ubc and its baseline in the same run, several
//! repetitions, medians — and writes `target/bench/report.{json,md}`.

mod benches;
mod floor;
mod report;
mod util;

use clap::Parser;
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "ubc benchmarks: ubc vs. the kernel page cache, ratios > 1 mean ubc is better")]
struct Args {
    /// Smaller data sets and fewer repetitions (finishes in a few minutes).
    #[arg(long)]
    quick: bool,
    /// Run only benchmarks whose name contains one of these (comma separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Repetitions per benchmark (medians are reported). Default 5, 3 with --quick.
    #[arg(long)]
    runs: Option<usize>,
    /// Scratch directory for test files (default: target/bench/scratch).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Where to write report.json and report.md.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| s.lines().next().map(|l| l.split_whitespace().nth(1).unwrap_or("0").parse::<u64>().unwrap_or(0)))
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("Machine: {cpu}, {cores} cores, {} GiB RAM, Linux {}", mem >> 20, kernel.trim())
}

/// The 1-minute load average (other work on the machine skews the timings).
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(String::from))
        .unwrap_or_default()
}

fn main() {
    // The memory-limited kernel baseline of `zipf_mixed` runs in a child process.
    if let Ok(spec) = std::env::var(benches::zipf::CHILD_ENV) {
        benches::zipf::child_main(&spec);
        return;
    }
    let args = Args::parse();
    let runs = args.runs.unwrap_or(if args.quick { 3 } else { 5 });
    let dir = args.dir.unwrap_or_else(|| args.out.join("scratch"));
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let ctx = benches::Ctx { dir: dir.clone(), quick: args.quick, runs };
    let load_start = loadavg();
    let mut records = vec![];
    for (name, f) in benches::all() {
        if !args.only.is_empty() && !args.only.iter().any(|o| name.contains(o.as_str())) {
            continue;
        }
        eprintln!("== {name}");
        let t = std::time::Instant::now();
        for r in f(&ctx) {
            eprintln!(
                "   {:<28} ubc {:>12.4} vs {:>12.4} {:<10} ratio {:>6.2}x  ({})",
                r.bench, r.ubc, r.baseline, r.metric, r.ratio, r.note
            );
            records.push(r);
        }
        eprintln!("   ({:.1} s)", t.elapsed().as_secs_f64());
    }
    let m = format!(
        "{}; scratch files on {} ({}); load average {} at the start, {} at the end{}",
        machine(),
        util::file_system(&dir),
        dir.display(),
        load_start,
        loadavg(),
        if args.quick { "; --quick" } else { "" }
    );
    report::write(&args.out, &records, &m).expect("write report");
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("wrote {}/report.json and report.md", args.out.display());
}

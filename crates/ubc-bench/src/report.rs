//! Benchmark records and the report files: `target/bench/report.json` (a list of records,
//! `ratio > 1` always means ubc is better) and `target/bench/report.md` (a table).

use serde::Serialize;
use std::path::Path;

/// Whether a bigger number is better for this metric (throughput) or a smaller one (time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Better {
    Higher,
    Lower,
}

#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub bench: String,
    pub metric: String,
    pub ubc: f64,
    pub baseline: f64,
    pub baseline_name: String,
    pub ratio: f64,
    /// Repetitions the medians were taken over.
    pub runs: usize,
    /// Free-form detail (sizes, thread counts, target).
    pub note: String,
}

impl Record {
    /// A record from the medians of `ubc` and `baseline` samples.
    pub fn from_samples(
        bench: &str,
        metric: &str,
        better: Better,
        ubc: &[f64],
        baseline: &[f64],
        baseline_name: &str,
        note: &str,
    ) -> Record {
        let (u, b) = (median(ubc), median(baseline));
        let ratio = match better {
            Better::Higher => u / b,
            Better::Lower => b / u,
        };
        Record {
            bench: bench.into(),
            metric: metric.into(),
            ubc: u,
            baseline: b,
            baseline_name: baseline_name.into(),
            ratio,
            runs: ubc.len().min(baseline.len()),
            note: note.into(),
        }
    }
}

pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if s.is_empty() {
        return f64::NAN;
    }
    if s.len() % 2 == 1 { s[s.len() / 2] } else { (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0 }
}

fn fmt_num(x: f64) -> String {
    if x.abs() >= 1e6 {
        format!("{:.3e}", x)
    } else if x.abs() >= 100.0 {
        format!("{:.1}", x)
    } else {
        format!("{:.4}", x)
    }
}

/// Write both report files.
pub fn write(dir: &Path, records: &[Record], machine: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("report.json"), serde_json::to_string_pretty(records).unwrap())?;
    let mut md = String::from("# ubc benchmark report\n\n");
    md += &format!("{machine}\n\nRatios > 1 mean ubc is better (medians of `runs` repetitions).\n\n");
    md += "| bench | metric | ubc | baseline | baseline name | ratio | runs | note |\n";
    md += "|---|---|---:|---:|---|---:|---:|---|\n";
    for r in records {
        md += &format!(
            "| {} | {} | {} | {} | {} | **{:.2}x** | {} | {} |\n",
            r.bench,
            r.metric,
            fmt_num(r.ubc),
            fmt_num(r.baseline),
            r.baseline_name,
            r.ratio,
            r.runs,
            r.note
        );
    }
    std::fs::write(dir.join("report.md"), md)
}

//! Trace-driven replacement-policy comparison, the measurement behind the default policy.
//! Not a timing: `ubc` is the default policy's miss ratio, `baseline` exact LRU's, so
//! ratio = LRU misses / default misses (> 1: the default beats LRU). Every policy's hit
//! ratio is in the note.

use super::Ctx;
use crate::report::Record;
use ubc::evict::PolicyKind;
use ubc::evict::sim::{Model, standard_workloads};

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let cap = 8192;
    let accesses = ctx.scale(2_000_000, 400_000) as usize;
    let default = PolicyKind::default();
    let mut out = vec![];
    for w in standard_workloads(cap, accesses, 42) {
        let results: Vec<(String, f64)> =
            Model::ALL.iter().map(|m| (m.name().to_string(), m.simulate(cap, &w.trace).hit_ratio())).collect();
        let get = |n: &str| results.iter().find(|(m, _)| m == n).map(|r| r.1).unwrap();
        let (d, lru) = (get(default.name()), get("lru"));
        let best = results.iter().map(|r| r.1).fold(0.0, f64::max);
        let note = results.iter().map(|(m, h)| format!("{m} {:.2}%", 100.0 * h)).collect::<Vec<_>>().join(", ");
        out.push(Record {
            bench: format!("policy_{}", w.name),
            metric: "miss ratio".into(),
            ubc: 1.0 - d,
            baseline: 1.0 - lru,
            baseline_name: "exact LRU".into(),
            ratio: (1.0 - lru) / (1.0 - d).max(1e-9),
            runs: 1,
            note: format!("{} pages, default {}; {note}; best {:.2}%", cap, default.name(), 100.0 * best),
        });
    }
    out
}

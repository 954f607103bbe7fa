//! The benchmarks. Each runs ubc and its baseline in the same process, in alternation,
//! `runs` times, and reports medians.

pub mod cached;
#[cfg(feature = "etcd")]
pub mod dist;
pub mod mach61;
pub mod map;
pub mod mount;
pub mod policy;
pub mod s3;
pub mod seq;
pub mod small;
pub mod stack;
pub mod table1;
pub mod tlpi;
pub mod ws;
pub mod xip;
pub mod zipf;

use crate::report::Record;
use std::path::PathBuf;

/// What every benchmark gets.
pub struct Ctx {
    /// Scratch directory on the file system under test.
    pub dir: PathBuf,
    pub quick: bool,
    pub runs: usize,
}

impl Ctx {
    pub fn scale(&self, full: u64, quick: u64) -> u64 {
        if self.quick { quick } else { full }
    }
}

pub type BenchFn = fn(&Ctx) -> Vec<Record>;

/// Every benchmark, by name.
pub fn all() -> Vec<(&'static str, BenchFn)> {
    vec![
        ("cached", cached::run as BenchFn),
        ("cached_seq", seq::run as BenchFn),
        ("table1", table1::run as BenchFn),
        ("tlpi", tlpi::run as BenchFn),
        ("zipf", zipf::run as BenchFn),
        ("policy", policy::run as BenchFn),
        ("map", map::run as BenchFn),
        ("stack", stack::run as BenchFn),
        ("stack_randwrite", stack::run_randwrite as BenchFn),
        ("mach61", mach61::run as BenchFn),
        ("ws", ws::run as BenchFn),
        ("small", small::run as BenchFn),
        ("mount", mount::run as BenchFn),
        ("xip", xip::run as BenchFn),
        ("s3", s3::run as BenchFn),
        #[cfg(feature = "etcd")]
        ("dist", dist::run as BenchFn),
    ]
}

//! Differential tests: each policy, run by the simulator, must hit exactly as often as a
//! naive, obviously-correct (O(n) per operation) transcription of its paper's pseudocode.
//!
//! In the naive models a hit sets the page's bit / bumps its frequency directly, as in the
//! papers; the real policies only see the cache's 2-bit counter through `take_accesses` when
//! they look at a page. The two must agree decision for decision, which checks both the
//! O(1) list plumbing and that reading counters lazily is equivalent to per-hit updates.

use std::collections::VecDeque;

use ubc_evict::sim::{Model, SplitMix64, loop_scan, scan_mix, shifting, zipf};
use ubc_evict::{PageKey, PolicyKind};

/// Naive CLOCK: a deque whose front is the hand; a referenced front page goes to the back.
fn naive_clock(capacity: usize, trace: &[PageKey]) -> u64 {
    let mut q: VecDeque<(PageKey, bool)> = VecDeque::new();
    let mut hits = 0;
    for &key in trace {
        if let Some(e) = q.iter_mut().find(|e| e.0 == key) {
            e.1 = true;
            hits += 1;
            continue;
        }
        if q.len() == capacity {
            loop {
                let (k, referenced) = q.pop_front().unwrap();
                if !referenced {
                    break;
                }
                q.push_back((k, false));
            }
        }
        q.push_back((key, false));
    }
    hits
}

/// Naive SIEVE (NSDI'24, Figure/Algorithm 1): index 0 is the tail (oldest); the hand moves
/// towards higher indexes (newer) and wraps to 0; survivors are never moved.
fn naive_sieve(capacity: usize, trace: &[PageKey]) -> u64 {
    let mut q: Vec<(PageKey, bool)> = Vec::new();
    let mut hand: Option<usize> = None;
    let mut hits = 0;
    for &key in trace {
        if let Some(e) = q.iter_mut().find(|e| e.0 == key) {
            e.1 = true;
            hits += 1;
            continue;
        }
        if q.len() == capacity {
            let mut i = hand.unwrap_or(0);
            while q[i].1 {
                q[i].1 = false;
                i = if i + 1 < q.len() { i + 1 } else { 0 };
            }
            q.remove(i);
            // The hand stops at the evicted page's newer neighbour, now at index i.
            hand = (i < q.len()).then_some(i);
        }
        q.push((key, false));
    }
    hits
}

/// Naive S3-FIFO (SOSP'23 Algorithm 1 with the crate's documented choices: S's share is
/// 10% of the resident pages, promotion after one access clears freq, ghost = 90% of
/// capacity, M may overshoot after a promotion).
fn naive_s3fifo(capacity: usize, trace: &[PageKey]) -> u64 {
    let ghost_cap = (capacity * 90 / 100).max(1);
    let mut small: VecDeque<(PageKey, u8)> = VecDeque::new();
    let mut main: VecDeque<(PageKey, u8)> = VecDeque::new();
    let mut ghost: VecDeque<PageKey> = VecDeque::new();
    let mut hits = 0;
    for &key in trace {
        if let Some(e) = small.iter_mut().chain(main.iter_mut()).find(|e| e.0 == key) {
            e.1 = (e.1 + 1).min(3);
            hits += 1;
            continue;
        }
        if small.len() + main.len() == capacity {
            loop {
                let len = small.len() + main.len();
                let from_small = !small.is_empty() && (main.is_empty() || small.len() * 100 >= len * 10);
                if from_small {
                    let (k, f) = small.pop_front().unwrap();
                    if f >= 1 {
                        main.push_back((k, 0));
                    } else {
                        if ghost.len() >= ghost_cap {
                            ghost.pop_front();
                        }
                        ghost.push_back(k);
                        break;
                    }
                } else {
                    let (k, f) = main.pop_front().unwrap();
                    if f > 0 {
                        main.push_back((k, f - 1));
                    } else {
                        break;
                    }
                }
            }
        }
        if let Some(pos) = ghost.iter().position(|&g| g == key) {
            ghost.remove(pos);
            main.push_back((key, 0));
        } else {
            small.push_back((key, 0));
        }
    }
    hits
}

/// A few small traces of different shapes (random, looping, scans, shifting).
fn traces(seed: u64) -> Vec<Vec<PageKey>> {
    let mut rng = SplitMix64::new(seed);
    let uniform: Vec<PageKey> = (0..3000).map(|_| PageKey { object: 0, index: rng.below(90) }).collect();
    vec![
        uniform,
        zipf(400, 0.9, 3000, seed),
        loop_scan(48, 3000),
        scan_mix(20, 0.9, 100, 60, 4, 3000, seed),
        shifting(60, 0.9, 15, 300, 3000, seed),
    ]
}

/// Run `naive` and the simulator on every trace and capacity; hit counts must be equal.
fn check(kind: PolicyKind, naive: fn(usize, &[PageKey]) -> u64) {
    for seed in 0..6 {
        for trace in traces(seed) {
            for capacity in [1, 2, 3, 7, 10, 32] {
                let ours = Model::Policy(kind).simulate(capacity, &trace).hits;
                assert_eq!(ours, naive(capacity, &trace), "{kind} seed {seed} capacity {capacity}");
            }
        }
    }
}

#[test]
fn clock_matches_naive_clock() {
    check(PolicyKind::Clock, naive_clock);
}

#[test]
fn sieve_matches_naive_sieve() {
    check(PolicyKind::Sieve, naive_sieve);
}

#[test]
fn s3fifo_matches_naive_s3fifo() {
    check(PolicyKind::S3Fifo, naive_s3fifo);
}

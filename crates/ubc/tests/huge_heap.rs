//! A cache with 2 MiB pages keeps glibc from hoarding page-sized buffers (`huge.rs`,
//! `return_page_buffers`): layers and pagers allocate and free buffers of a page on many
//! threads, and with glibc's dynamic mmap threshold those came from per-thread arenas that
//! kept them (a stacked mount on huge pages held 629 MiB of heap for a 64 MiB budget).
//! Alone in its binary: it measures the process's anonymous memory.

use ubc::Cache;

fn rss_anon() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let l = s.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() << 10
}

/// Eight threads, each allocating, touching and freeing buffers of 1–3 MiB while holding a
/// few, as fills and writebacks through general layers do — and, between them, small
/// allocations that live on (a cache's metadata does), returned to the caller. Those pin
/// the arena's memory above them: freed buffers below them cannot be given back by a trim.
#[allow(clippy::vec_box)] // each small allocation its own, on purpose
fn churn() -> Vec<Vec<Box<[u8; 64]>>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..8usize)
            .map(|t| {
                s.spawn(move || {
                    let mut held: Vec<Vec<u8>> = Vec::new();
                    let mut small = Vec::new();
                    for i in 0..200usize {
                        let n = (1 << 20) + ((i * 7919 + t * 104_729) % (2 << 20));
                        held.push(vec![(i as u8) | 1; n]);
                        small.push(Box::new([i as u8; 64]));
                        if held.len() > 3 {
                            held.remove(i % 3);
                        }
                    }
                    small
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_huge_page_cache_does_not_let_page_buffers_pile_up_in_the_heap() {
    let _c = Cache::builder().budget(16 << 20).page_size(2 << 20).window_size(32 << 20).build().unwrap();
    let before = rss_anon();
    let small = churn();
    let grew = rss_anon().saturating_sub(before);
    drop(small);
    // 8 threads × 4 buffers of up to 3 MiB were live at the peak; all are freed now.
    assert!(grew < 16 << 20, "the heap kept {} MiB of freed page-sized buffers", grew >> 20);
}

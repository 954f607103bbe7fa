//! Free space of the data region: a best-fit allocator over `[DATA_START, end)`.
//!
//! Free space is not stored on disk: it is the complement of the extents the committed index
//! references, recomputed at open. Blocks freed at the end of the region lower `end` at once,
//! so the lower file can be truncated there at the next commit.

use super::format::ALIGN;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Default)]
pub(crate) struct Alloc {
    /// Free blocks: offset → length.
    by_off: BTreeMap<u64, u64>,
    /// The same blocks by (length, offset), for best fit.
    by_size: BTreeSet<(u64, u64)>,
    /// End of the allocated region (everything at or past it is free).
    end: u64,
    free_bytes: u64,
}

impl Alloc {
    /// The allocator for a region starting at `start` whose used blocks are `used`
    /// (offset, length), in any order and non-overlapping.
    pub fn from_used(start: u64, mut used: Vec<(u64, u64)>) -> Alloc {
        used.sort_unstable();
        let mut a = Alloc { end: start, ..Default::default() };
        for (off, len) in used {
            if off > a.end {
                a.insert(a.end, off - a.end);
            }
            a.end = a.end.max(off + len);
        }
        a
    }

    pub fn end(&self) -> u64 {
        self.end
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    fn insert(&mut self, off: u64, len: u64) {
        self.by_off.insert(off, len);
        self.by_size.insert((len, off));
        self.free_bytes += len;
    }

    fn remove(&mut self, off: u64, len: u64) {
        self.by_off.remove(&off);
        self.by_size.remove(&(len, off));
        self.free_bytes -= len;
    }

    /// Allocate `len` bytes (a multiple of `ALIGN`) at a multiple of `grain` (a power of two,
    /// at least `ALIGN`) such that the `grain`-sized blocks it touches hold nothing else:
    /// the smallest free block with room for that, else at the end. With `grain == ALIGN`
    /// this is plain best fit. (A lower file that rewrites whole blocks — aead — must never
    /// rewrite a block holding committed extents for a new one: see `CompressPager::grain`.)
    pub fn alloc(&mut self, len: u64, grain: u64) -> u64 {
        debug_assert!(len > 0 && len.is_multiple_of(ALIGN) && grain.is_power_of_two() && grain >= ALIGN);
        let span = len.next_multiple_of(grain);
        // Smallest first; a block misaligned for `grain` may not fit, so look a little further.
        let fit = self
            .by_size
            .range((len, 0)..)
            .take(64)
            .map(|&(blen, off)| (off, blen, off.next_multiple_of(grain)))
            .find(|&(off, blen, at)| at + span <= off + blen);
        if let Some((off, blen, at)) = fit {
            self.take(off, blen, at, len);
            return at;
        }
        let at = self.end.next_multiple_of(grain);
        if at > self.end {
            self.insert(self.end, at - self.end);
        }
        self.end = at + len;
        at
    }

    /// Allocate `len` bytes at a multiple of `grain`, its `grain`-sized blocks ending at or
    /// below `limit` and holding nothing else, in the lowest free block that has room
    /// (relocation towards the start of the file), if there is one.
    pub fn alloc_below(&mut self, len: u64, limit: u64, grain: u64) -> Option<u64> {
        let span = len.next_multiple_of(grain);
        let (off, blen, at) = self
            .by_off
            .range(..limit)
            .map(|(&o, &l)| (o, l, o.next_multiple_of(grain)))
            .find(|&(o, l, at)| at + span <= (o + l).min(limit))?;
        self.take(off, blen, at, len);
        Some(at)
    }

    /// Take `at..at+len` out of the free block `off..off+blen`, keeping the rest free.
    fn take(&mut self, off: u64, blen: u64, at: u64, len: u64) {
        self.remove(off, blen);
        if at > off {
            self.insert(off, at - off);
        }
        if off + blen > at + len {
            self.insert(at + len, off + blen - (at + len));
        }
    }

    /// Return a block to free space, merging it with free neighbours.
    pub fn free(&mut self, mut off: u64, mut len: u64) {
        debug_assert!(off + len <= self.end);
        if let Some((&poff, &plen)) = self.by_off.range(..off).next_back() {
            debug_assert!(poff + plen <= off, "double free");
            if poff + plen == off {
                self.remove(poff, plen);
                off = poff;
                len += plen;
            }
        }
        if let Some((&noff, &nlen)) = self.by_off.range(off + len..).next()
            && noff == off + len
        {
            self.remove(noff, nlen);
            len += nlen;
        }
        if off + len == self.end {
            self.end = off;
        } else {
            self.insert(off, len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_merge_and_tail() {
        let mut a = Alloc::from_used(8192, vec![(8192, 512), (9216, 1024)]);
        assert_eq!(a.end(), 10240);
        assert_eq!(a.free_bytes(), 512);
        assert_eq!(a.alloc(512, ALIGN), 8704);
        assert_eq!(a.alloc(1024, ALIGN), 10240);
        a.free(9216, 1024);
        a.free(8704, 512);
        assert_eq!(a.free_bytes(), 1536);
        a.free(10240, 1024);
        // Everything after 8704 is free: the end came down.
        assert_eq!(a.end(), 8704);
        assert_eq!(a.free_bytes(), 0);
    }

    #[test]
    fn grain_keeps_new_blocks_apart_from_used_ones() {
        // Used: 8192..8704 and 12800..13312 (512-aligned, as an older writer placed them).
        let mut a = Alloc::from_used(8192, vec![(8192, 512), (12800, 512)]);
        // 8704..12800 is free but shares 4 KiB blocks with both: not usable at grain 4096.
        assert_eq!(a.alloc(512, 4096), 16384);
        assert_eq!(a.end(), 16896);
        // The next one starts on the next block, the slack stays free.
        assert_eq!(a.alloc(1024, 4096), 20480);
        a.free(16384, 512);
        // A whole free block is reused; the slack after an extent is never handed out.
        assert_eq!(a.alloc(512, 4096), 16384);
        assert_eq!(a.alloc_below(512, 20480, 4096), None);
        assert_eq!(a.alloc_below(512, 8704, ALIGN), None);
        assert_eq!(a.alloc_below(512, 9216, ALIGN), Some(8704));
    }

    /// Random allocations, placements below a limit and frees against a model of the live
    /// extents: no two live extents overlap or share a grain block, no live extent overlaps
    /// free space, and the free byte count is what the free list holds (an extent handed
    /// out twice would corrupt a zstd chunk).
    #[test]
    fn random_operations_never_hand_out_used_space() {
        let grain = 4096u64;
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for round in 0..200 {
            let mut a = Alloc::from_used(8192, vec![]);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for step in 0..400 {
                match rnd(3) {
                    0 => {
                        let len = (1 + rnd(40)) * ALIGN;
                        let at = a.alloc(len, grain);
                        live.push((at, len));
                    }
                    1 if !live.is_empty() => {
                        let i = rnd(live.len() as u64) as usize;
                        let (off, len) = live[i];
                        if let Some(at) = a.alloc_below(len, off, grain) {
                            live.push((at, len));
                            if rnd(2) == 0 {
                                // A move: the old place goes back (as after a commit).
                                live.swap_remove(i);
                                a.free(off, len);
                            }
                        }
                    }
                    _ if !live.is_empty() => {
                        let i = rnd(live.len() as u64) as usize;
                        let (off, len) = live.swap_remove(i);
                        a.free(off, len);
                    }
                    _ => {}
                }
                let mut sorted = live.clone();
                sorted.sort_unstable();
                for w in sorted.windows(2) {
                    let ((o1, l1), (o2, _)) = (w[0], w[1]);
                    assert!(o1 + l1 <= o2, "round {round} step {step}: live extents overlap: {w:?}");
                    assert!(
                        (o1 + l1 - 1) / grain < o2 / grain,
                        "round {round} step {step}: extents share a grain block: {w:?}"
                    );
                }
                for &(o, l) in &live {
                    assert!(o + l <= a.end(), "round {round} step {step}: live extent past the end");
                    if let Some((&fo, &fl)) = a.by_off.range(..o + l).next_back() {
                        assert!(
                            fo + fl <= o || fo >= o + l,
                            "round {round} step {step}: free block {fo}+{fl} overlaps live {o}+{l}"
                        );
                    }
                }
                assert_eq!(a.free_bytes, a.by_off.values().sum::<u64>(), "round {round} step {step}");
                assert_eq!(a.by_off.len(), a.by_size.len());
            }
        }
    }
}

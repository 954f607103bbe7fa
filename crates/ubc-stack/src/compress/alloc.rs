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

    /// Allocate `len` bytes (a multiple of `ALIGN`): the smallest free block that fits, else
    /// at the end.
    pub fn alloc(&mut self, len: u64) -> u64 {
        debug_assert!(len > 0 && len.is_multiple_of(ALIGN));
        if let Some(&(blen, off)) = self.by_size.range((len, 0)..).next() {
            self.remove(off, blen);
            if blen > len {
                self.insert(off + len, blen - len);
            }
            return off;
        }
        let off = self.end;
        self.end += len;
        off
    }

    /// Allocate `len` bytes in the lowest free block that ends at or below `limit`
    /// (relocation towards the start of the file), if there is one.
    pub fn alloc_below(&mut self, len: u64, limit: u64) -> Option<u64> {
        let (off, blen) = self
            .by_off
            .range(..limit)
            .map(|(&o, &l)| (o, l))
            .find(|&(o, l)| l >= len && o + len <= limit)?;
        self.remove(off, blen);
        if blen > len {
            self.insert(off + len, blen - len);
        }
        Some(off)
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
        assert_eq!(a.alloc(512), 8704);
        assert_eq!(a.alloc(1024), 10240);
        a.free(9216, 1024);
        a.free(8704, 512);
        assert_eq!(a.free_bytes(), 1536);
        a.free(10240, 1024);
        // Everything after 8704 is free: the end came down.
        assert_eq!(a.end(), 8704);
        assert_eq!(a.free_bytes(), 0);
    }
}

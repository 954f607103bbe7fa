//! Holes and space: punching a hole (`fallocate(PUNCH_HOLE)`), reserving space
//! (`fallocate`), and finding data and holes (`lseek(SEEK_DATA / SEEK_HOLE)`), over the
//! cache's view of a file — its dirty and cached pages — and the store's own holes.

use super::*;
use crate::pager::Seek;

/// Zeros written at a time where a hole cannot be punched.
const ZEROS: usize = 1 << 20;

impl Object {
    /// Make bytes `from..to` (clipped at the length, which does not change) read as zeros.
    /// Whole pages among them are dropped from the cache and from every mapping and
    /// deallocated in the store ([`Pager::punch`]); the partial pages at the edges are
    /// zeroed by writes, and so is everything if the store cannot punch (or failed to: the
    /// zeros then reach it by writeback, where an error surfaces at `sync`).
    pub(crate) fn punch_hole(&self, from: u64, to: u64) -> Result<()> {
        let to = to.min(self.len());
        if from >= to {
            return Ok(());
        }
        let ps = self.ps();
        let (first, last) = (from.div_ceil(1 << ps), to >> ps); // the whole pages
        if first >= last || !self.pager().can_punch() {
            return self.write_zeros(from, to);
        }
        self.write_zeros(from, first << ps)?;
        self.write_zeros(last << ps, to)?;
        let punched = {
            // Writers wait. Drop first, waiting for writebacks in flight (none may store old
            // bytes after the punch); punch; drop again — a fill (a read, read-ahead, a
            // mapping's fault) that read the store between the two got old bytes. Dirty
            // pages are dropped unwritten: their bytes are to become zeros anyway.
            let _size = self.size_exclusive();
            self.unlock_for_change(first << ps, last << ps)?;
            self.drop_pages(first, last)?;
            let r = self.call_pager(PagerOp::Punch, first << ps, |p| p.punch(first << ps, (last - first) << ps));
            self.drop_pages(first, last)?;
            r
        };
        match punched {
            Ok(true) => Ok(()),
            // Rare (the store said it could): a reader between the drop and these zeros may
            // have seen the store's bytes from before the dropped dirty pages.
            Ok(false) | Err(_) => self.write_zeros(first << ps, last << ps),
        }
    }

    /// Write zeros over `from..to`. => no size lock held.
    fn write_zeros(&self, from: u64, to: u64) -> Result<()> {
        let zeros = vec![0u8; (to.saturating_sub(from)).min(ZEROS as u64) as usize];
        let mut at = from;
        while at < to {
            let n = (to - at).min(ZEROS as u64) as usize;
            self.write(&zeros[..n], at)?;
            at += n as u64;
        }
        Ok(())
    }

    /// Reserve the store's space for `from..to` ([`Pager::allocate`]); the length is the
    /// caller's to change.
    pub(crate) fn allocate(&self, from: u64, to: u64) -> Result<()> {
        if from >= to {
            return Ok(());
        }
        self.call_pager(PagerOp::Allocate, from, |p| p.allocate(from, to - from))
    }

    /// `lseek(SEEK_DATA / SEEK_HOLE)` from `offset`: `None` if `offset` is at or past the
    /// end (`ENXIO`), or, for data, if none follows. A byte is data if the store holds data
    /// there or its page's cached contents may differ from the store's (see
    /// [`Object::unstored`]); anything else before the end is a hole — a clean cached page
    /// is the store's bytes, holes included. Not atomic with concurrent writes, as on any
    /// file system.
    pub(crate) fn seek(&self, offset: u64, what: Seek) -> Result<Option<u64>> {
        let len = self.len();
        if offset >= len {
            return Ok(None);
        }
        let ps = self.ps();
        // Stores made through mappings since their last scan count as dirty pages.
        self.harvest(0, u64::MAX, super::Harvest::Explicit);
        match what {
            Seek::Data => {
                let cached = self.next_unstored(offset >> ps, len.div_ceil(1 << ps)).map(|p| (p << ps).max(offset));
                let stored =
                    self.call_pager(PagerOp::Seek, offset, |p| p.seek(offset, Seek::Data))?.filter(|&d| d < len);
                Ok(match (cached, stored) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                })
            }
            Seek::Hole => {
                let mut pos = offset;
                while pos < len {
                    let page = pos >> ps;
                    if self.unstored(page) {
                        pos = (page + 1) << ps;
                        continue;
                    }
                    let hole = self.call_pager(PagerOp::Seek, pos, |p| p.seek(pos, Seek::Hole))?.unwrap_or(pos);
                    if hole <= pos {
                        return Ok(Some(pos)); // a hole in the store, and nothing cached there
                    }
                    pos = hole; // data in the store up to there
                }
                Ok(Some(len))
            }
        }
    }

    /// Whether page `page`'s cached contents may differ from the store's: dirty (stores
    /// through mappings included, once harvested), being written back, or held by a writer
    /// (or anyone: a cheap over-approximation). Such a page is data whatever the store says.
    fn unstored(&self, page: u64) -> bool {
        let (ci, slot) = self.locate(page);
        self.table.get(ci).is_some_and(|c| self.unstored_state(c.pages.snapshot(slot)))
    }

    fn unstored_state(&self, s: crate::page::state::Snapshot) -> bool {
        s.unclean() || (s.cached() && s.held())
    }

    /// The first page in `from..to` whose contents may differ from the store's, if any.
    fn next_unstored(&self, from: u64, to: u64) -> Option<u64> {
        let cs = self.res.geo.chunk_shift;
        let mut found = None;
        self.table.for_each(from >> cs, (to >> cs).saturating_add(1), |chunk| {
            if found.is_some() {
                return;
            }
            let base = chunk.index << cs;
            for p in from.max(base)..to.min(base + (1 << cs)) {
                if self.unstored_state(chunk.pages.snapshot((p - base) as usize)) {
                    found = Some(p);
                    return;
                }
            }
        });
        found
    }
}

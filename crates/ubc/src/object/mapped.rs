//! Support for memory mappings (`crate::map`): stores found through mappings become dirty
//! pages, faults pin and fill pages, resident pages are installed into new mappings.

use super::*;

/// Why stores made through mappings are looked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Harvest {
    /// A sync or flush: in populate mode, where stores cannot be seen, every page of a
    /// writable shared mapping counts as written.
    Explicit,
    /// The flusher's periodic look: finds nothing in populate mode.
    Periodic,
}

impl Object {
    /// Mark the valid pages in `found` dirty (stores found through mappings) and count the
    /// ones that were clean. They took no unclean slot: the stores happened already, so the
    /// dirty limit cannot hold them back; the flusher is kicked if they pass the threshold.
    pub(super) fn mark_found_dirty(&self, found: &[u64]) -> u64 {
        let n = self.redirty(found);
        if n > 0
            && let Some(svc) = self.res.maps.get()
        {
            svc.scan_dirty.fetch_add(n, Relaxed);
        }
        n
    }

    /// Mark the clean pages among `found` dirty, counted as `mark_found_dirty` says (also
    /// for pages whose stored copy was lost: `end_unstable`). Returns how many this made
    /// dirty.
    pub(super) fn redirty(&self, found: &[u64]) -> u64 {
        // Counted dirty and unclean before they are marked: from `mark_dirty` on, a
        // writeback may clean them and count them out (see `dirty`). Pages dirty already
        // need nothing (the store happened before this look, so their coming writeback
        // copies it); pages that became dirty or were dropped by the time we mark them give
        // their counts back.
        let clean: Vec<&state::PageState> =
            found.iter().filter_map(|&p| self.page_state(p)).filter(|st| st.snapshot().clean()).collect();
        let k = clean.len() as u64;
        if k == 0 {
            return 0;
        }
        self.res.dirty.add_unclean(k);
        self.note_dirtied(k);
        let n = clean.iter().filter(|st| st.mark_dirty()).count() as u64;
        if n < k {
            self.dirty.fetch_sub(k - n, Relaxed);
            // Out of the published unclean count without counting as cleaned (which would
            // tell waiting writers that writeback made progress): as slots a writer took and
            // gave back unused.
            self.res.dirty.hold(k - n);
            for _ in n..k {
                self.res.dirty.unreserve();
            }
        }
        n
    }

    /// Find stores made through this object's mappings to pages `[a, b)` since the last
    /// scan, and mark those pages dirty (see [`Harvest`] for `why`). Returns pages newly
    /// dirty.
    pub(crate) fn harvest(&self, a: u64, b: u64, why: Harvest) -> u64 {
        let explicit = why == Harvest::Explicit;
        if self.nmaps.load(SeqCst) == 0 {
            return 0;
        }
        let Some(svc) = self.res.maps.get() else { return 0 };
        let ps = self.ps();
        let _g = self.scan_lock.lock();
        let mut found = Vec::new();
        for m in self.maps.read().iter().filter(|m| m.tracked) {
            if svc.kernel.is_some() {
                svc.take_written(m, a, b, ps, &mut found);
            } else if explicit {
                let r = m.pages(ps);
                let end = self.len().div_ceil(1 << ps);
                found.extend(r.start.max(a)..r.end.min(b).min(end));
            }
        }
        crate::map::dedup_pages(&mut found);
        if let (Some(lo), Some(hi)) = (found.iter().min(), found.iter().max()) {
            self.changed(lo << ps..(hi + 1) << ps, true);
        }
        self.mark_found_dirty(&found)
    }

    /// Pin the valid pages from `page` up to `last` (within one chunk), filling `page` (and
    /// a cluster after it) if needed, for the fault handler. Returns the chunk and how many
    /// pages are pinned (at least one). Read-ahead runs as for a read of `page..=last`: a
    /// sequential miss opens a window beyond the cluster, a marked page queues the next one.
    /// `pattern`: the mapping's advice (`Mapping::advise`). => `page` lies within the file.
    pub(crate) fn pin_for_fault(&self, page: u64, last: u64, pattern: Advice) -> Result<(&Chunk, u64)> {
        let (ci, _) = self.locate(page);
        let chunk = self.table.get_or_create(ci);
        let chunk_last = ((ci + 1) << self.res.geo.chunk_shift) - 1;
        let last = last.min(chunk_last);
        let n = self.pin_run(chunk, page, last, Some(last), pattern)?;
        Ok((chunk, n))
    }

    pub(crate) fn unpin_fault(&self, chunk: &Chunk, page: u64, n: u64) {
        self.unpin_run(chunk, page, n);
    }

    /// Map every page of `[a, b)` resident now into the new mapping `m` (so resident pages
    /// never trap). Pages being filled are waited for; their filler may map them first.
    pub(crate) fn map_resident(&self, svc: &crate::map::MapService, m: &UserMap, a: u64, b: u64) {
        let cs = self.res.geo.chunk_shift;
        self.table.for_each(a >> cs, (b >> cs).saturating_add(1), |chunk| {
            let base = chunk.index << cs;
            let (lo, hi) = (a.max(base), b.min(base + (1 << cs)));
            let mut p = lo;
            while p < hi {
                let mut n = 0;
                while p + n < hi {
                    let Some(st) = chunk.pages.get((p + n - base) as usize) else { break };
                    if !st.snapshot().cached() || !matches!(st.pin(), Pin::Pinned { .. }) {
                        break;
                    }
                    n += 1;
                }
                if n > 0 {
                    svc.map_pages(self, m, p, p + n, Holes::Allocate);
                    self.unpin_run(chunk, p, n);
                }
                p += n + 1;
            }
        });
    }

    /// Populate mode (no userfaultfd): pin every page of `[a, b)` within the file, filling
    /// them, for the life of a mapping. Returns the pinned runs (chunk index, first, last).
    pub(crate) fn pin_all(&self, a: u64, b: u64) -> Result<Vec<(u64, u64, u64)>> {
        let cs = self.res.geo.chunk_shift;
        let b = b.min(self.len().div_ceil(1 << self.ps()));
        if b.saturating_sub(a) > self.res.geo.budget_pages / 2 {
            return Err(Error::BudgetExceeded {
                needed: (b - a) << self.ps(),
                budget: self.res.geo.budget_pages << self.ps(),
            });
        }
        let mut runs = Vec::new();
        let mut p = a;
        while p < b {
            let ci = p >> cs;
            let last = (b - 1).min(((ci + 1) << cs) - 1);
            let chunk = self.table.get_or_create(ci);
            if let Err(e) = self.pin_pages(chunk, p, last) {
                self.unpin_all(&runs);
                return Err(e);
            }
            runs.push((ci, p, last));
            p = last + 1;
        }
        Ok(runs)
    }

    pub(crate) fn unpin_all(&self, runs: &[(u64, u64, u64)]) {
        for &(ci, first, last) in runs {
            if let Some(chunk) = self.table.get(ci) {
                self.unpin_range(chunk, first, last);
            }
        }
    }
}

impl crate::map::Mapped for Object {
    fn page_shift(&self) -> u32 {
        Object::page_shift(self)
    }
    fn len(&self) -> u64 {
        Object::len(self)
    }
    fn page_state(&self, page: u64) -> Option<&state::PageState> {
        Object::page_state(self, page)
    }
    fn materialize(&self, offset: u64, len: u64) {
        Object::materialize(self, offset, len)
    }
    fn pin_for_fault(&self, page: u64, last: u64, pattern: Advice) -> Result<(&Chunk, u64)> {
        Object::pin_for_fault(self, page, last, pattern)
    }
    fn before_writable_map(&self, a: u64, b: u64) {
        self.break_loans(a, b - 1);
    }
    fn store_locked(&self, page: u64) -> bool {
        Object::store_locked(self, page)
    }
    fn begin_writable_map(&self) -> usize {
        self.res.locks.begin_writable_map()
    }
    fn end_writable_map(&self, token: usize) {
        self.res.locks.end_writable_map(token)
    }
    fn allow_stores(&self, a: u64, b: u64) -> Result<()> {
        let ps = self.ps();
        self.unlock_for_change(a << ps, b << ps)
    }
    fn fault_guard(&self, page: u64, store: bool) -> Result<Option<crate::pager::FaultGuard>> {
        let ps = self.ps();
        self.guard_fault(page << ps..(page + 1) << ps, store)
    }

    fn unpin_fault(&self, chunk: &Chunk, page: u64, n: u64) {
        Object::unpin_fault(self, chunk, page, n)
    }
}

impl Object {
    /// `Pager::fault_guard` for bytes `range`. Not in a pager scope (`call_pager`): the
    /// thread holds nothing of this object, and the pager may make requests of it here
    /// (taking a token reloads the cache). => nothing of this object held.
    pub(crate) fn guard_fault(
        &self,
        range: std::ops::Range<u64>,
        store: bool,
    ) -> Result<Option<crate::pager::FaultGuard>> {
        let at = range.start;
        self.pager().fault_guard(range, store).map_err(|e| self.io_err(PagerOp::Fault, at, e))
    }
}

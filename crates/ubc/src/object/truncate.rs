//! Changing the length (`set_len`), dropping cached pages (truncation, teardown) and
//! invalidation (Mach's `pager_flush_request`; Linux `truncate_pagecache`).

use super::*;

impl Object {
    /// `set_len`: truncate (dropping cached pages past the end and zeroing the tail of the
    /// last page) or extend; then tell the pager.
    pub(crate) fn set_len(&self, new: u64) -> Result<()> {
        if new > max_end() {
            return Err(Error::OffsetOverflow { offset: new, len: 0 });
        }
        let _size = self.size_exclusive();
        let old = self.len();
        let ps = self.ps();
        // The bytes between the old and the new end change (dropped, or zeros appear).
        self.unlock_for_change(old.min(new), old.max(new))?;
        if new < old {
            // Order matters: publish the new length first (writebacks and read-ahead that
            // start from now on clip to it), then drop pages (waiting for writebacks in
            // flight), then truncate the pager, so no writeback can re-extend the stored
            // file, then zero the last page's tail.
            self.len.store(new, SeqCst);
            let dropped = self.drop_pages(new.div_ceil(1 << ps), u64::MAX);
            // The store is truncated whatever happened above: its bytes past the new end
            // must not come back when the file grows again.
            self.call_pager(PagerOp::SetLen, new, |p| p.set_len(new))?;
            dropped?;
            // Zero the cached last page's tail only now: a fill of that page in flight
            // (read-ahead) may have read the store before it was truncated; `zero_tail`
            // waits for it, and fills that start later read the truncated store.
            // (An XIP store zeroed it in its own `set_len`, and a write there now would extend
            // a store's own file again.)
            return if !new.is_multiple_of(1 << ps) && !self.xip() { self.zero_tail(new) } else { Ok(()) };
        } else {
            // Growing: the pager first, so that a refusal (a layer's own limit, an I/O
            // error) leaves the file as it was instead of longer than its store can be.
            if new > old {
                self.call_pager(PagerOp::SetLen, new, |p| p.set_len(new))?;
            }
            self.len.store(new, SeqCst);
            if new > old && self.nmaps.load(SeqCst) > 0 {
                // Touches past the old end were answered with SIGBUS markers: clear them.
                if let Some(svc) = self.res.maps.get() {
                    for m in self.maps.read().iter() {
                        svc.unpoison(m, old.div_ceil(1 << ps), new.div_ceil(1 << ps), ps);
                    }
                }
            }
        }
        Ok(())
    }

    /// Zero the bytes of the last page past `new_len` if it is cached. => size_lock held.
    fn zero_tail(&self, new_len: u64) -> Result<()> {
        let ps = self.ps();
        let page = new_len >> ps;
        let (ci, slot) = self.locate(page);
        let Some(chunk) = self.table.get(ci) else { return Ok(()) };
        let Some(st) = chunk.pages.get(slot) else { return Ok(()) };
        if !st.snapshot().cached() {
            return Ok(()); // not cached, no fill in flight
        }
        // Waits for a fill in flight (BUSY) to finish.
        match st.begin_write() {
            WriteLock::Resident => {
                // Dirty without waiting at the dirty limit: a truncation must not stop
                // half-way (its length is published already) because other pages cannot be
                // written back — that would leave old bytes past the new end, in the cache and
                // in the store, to reappear when the file grows again. One page over the
                // limit, like a store found through a mapping.
                if st.snapshot().dirty() {
                    self.res.dirty.hold(1);
                } else if st.mark_dirty() {
                    self.res.dirty.add_unclean(1);
                    self.note_dirtied(1);
                    self.res.dirty.hold(1);
                } else {
                    self.res.dirty.hold(1); // a found store dirtied it meanwhile
                }
                // Page held WRITING; a window lent it keeps the bytes before the zeroing.
                self.break_loans(page, page);
                let zeros = vec![0u8; (((page + 1) << ps) - new_len) as usize];
                let r = self.copy_in(chunk, new_len, &zeros);
                self.release_written(Held::Writing(st));
                r
            }
            // Evicted meanwhile: nothing cached to zero.
            WriteLock::Empty => {
                st.release_empty();
                Ok(())
            }
        }
    }

    /// Drop every cached page with index in `from..to`, dirty or not (truncation,
    /// invalidation). Waits for pins, writers and writebacks on those pages.
    pub(crate) fn drop_pages(&self, from: u64, to: u64) -> Result<()> {
        self.drop_pages_punching(from, to, true)
    }

    /// As `drop_pages`, and `punch`: whether to free the pages' memory now. Teardown does
    /// not: the object's `Memory`, dropped right after, punches its whole slice (every offset
    /// ever written, allocated or mapped) and closes its own memfd, so a punch per page
    /// first was a second `fallocate` of the same range — a tenth of opening, reading and
    /// dropping a small cold file (`open_read_small`).
    pub(crate) fn drop_pages_punching(&self, from: u64, to: u64, punch: bool) -> Result<()> {
        let _pages = crate::order::hold(crate::order::Rank::page(self.depth()));
        let cs = self.res.geo.chunk_shift;
        let ps = self.ps();
        let mut err = Ok(());
        self.table.for_each(from >> cs, (to >> cs).saturating_add(1), |chunk| {
            let base = chunk.index << cs;
            let lo = from.max(base);
            let hi = to.min(base + chunk.pages.made_end() as u64);
            if lo >= hi {
                return;
            }
            let mut dropped = Vec::new();
            for p in lo..hi {
                let Some(st) = chunk.pages.get((p - base) as usize).filter(|st| st.snapshot().cached()) else {
                    continue;
                };
                self.hand_back_loans(chunk, p);
                let prior = st.lock_for_drop();
                if !prior.valid() {
                    st.release_empty(); // was empty by the time we got it
                    continue;
                }
                if st.clear_dirty_locked() {
                    self.dirty.fetch_sub(1, Relaxed);
                    self.res.dirty.cleaned(1);
                }
                dropped.push(p);
            }
            if dropped.is_empty() {
                return;
            }
            {
                let mut pol = self.res.policy.lock();
                for &p in &dropped {
                    self.policy_forget(pol.as_mut(), chunk, p);
                }
            }
            if punch {
                for (a, b) in runs(&dropped) {
                    if let Err(e) = self.free_memory(a << ps, (b - a) << ps) {
                        err = Err(e);
                    }
                }
            }
            let mut late_dirty = 0;
            for &p in &dropped {
                // A store through a mapping found at the last moment dirtied it: dropped too.
                late_dirty += u64::from(chunk.pages[(p - base) as usize].release_empty().dirty());
            }
            if late_dirty > 0 {
                self.dirty.fetch_sub(late_dirty, Relaxed);
                self.res.dirty.cleaned(late_dirty);
            }
            let n = dropped.len() as u64;
            self.resident.fetch_sub(n, Relaxed);
            self.uncharge(n);
        });
        err
    }

    /// Mach's `pager_flush_request`: clean bytes `from..to`, then drop their cached pages
    /// from the cache and from every mapping (a mapping re-faults them from the pager).
    /// With `Length::Reload`, the length is then taken from the pager again (the stored data
    /// changed underneath: a restore through a lower layer). Writers on this object wait.
    /// A store through a mapping that lands between the clean and the drop is lost: the
    /// caller (the cache manager) invalidates only ranges another domain is about to
    /// overwrite or has overwritten.
    pub(crate) fn invalidate(&self, from: u64, to: u64, length: Length) -> Result<()> {
        self.clean(from, to)?;
        let _size = self.size_exclusive();
        let ps = self.ps();
        let pages = self.pages_of(from, to);
        self.drop_pages(pages.start, pages.end)?;
        if length == Length::Reload {
            let old = self.len();
            let new = self.call_pager(PagerOp::Len, 0, |p| p.len())?;
            if new != old {
                self.len.store(new, SeqCst);
                if new < old {
                    // Pages past the new end read as SIGBUS in mappings, as after set_len.
                    self.drop_pages(new.div_ceil(1 << ps), u64::MAX)?;
                } else if self.nmaps.load(SeqCst) > 0
                    && let Some(svc) = self.res.maps.get()
                {
                    for m in self.maps.read().iter() {
                        svc.unpoison(m, old.div_ceil(1 << ps), new.div_ceil(1 << ps), ps);
                    }
                }
            }
        }
        Ok(())
    }
}

/// What [`File::invalidate`](crate::File::invalidate) does with the file's length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Length {
    /// Keep the length the cache knows (only the bytes changed underneath).
    Keep,
    /// Read it from the pager again (the stored file was replaced or resized underneath).
    Reload,
}

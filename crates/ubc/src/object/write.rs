//! The write path: pages taken WRITING (or BUSY when new) in ascending order with lock
//! coupling, dirtied from the start of the copy, published at the end (Linux
//! `generic_perform_write`); writable windows hold a chunk the same way.

use super::*;

/// A page a writer holds between copying into it and publishing it (lock coupling).
pub(super) enum Held<'a> {
    /// A resident page in WRITING state, marked DIRTY when it was taken. Like every held
    /// page, its unclean slot is counted *held*, not published, until the writer lets it go
    /// (see `dirty_held`).
    Writing(&'a state::PageState),
    /// A page taken empty, still BUSY: (chunk, page index, fresh). Filled from the pager
    /// unless the writer covers it whole or it lies past the end; `fresh` says it was not,
    /// so the memfd holds no memory for it yet.
    Filled(&'a Chunk, u64, bool),
}

/// Whether a page taken for writing must hold the file's bytes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Old {
    /// Fill it unless the write covers the whole page (`write`: every byte is copied in).
    UnlessCovered,
    /// Always fill it (a writable window shows the file's current bytes).
    Always,
}

impl Object {
    /// Take page `page` for writing bytes `from..to` of the file (within that page): a
    /// resident page becomes WRITING; an empty one is filled first unless it lies past the
    /// end of the file, or (with [`Old::UnlessCovered`]) the caller will write every byte of
    /// `from..to` and that range covers the page. => caller holds `size_lock` shared.
    fn lock_page_for_write<'a>(&self, chunk: &'a Chunk, page: u64, from: u64, to: u64, old: Old) -> Result<Held<'a>> {
        let overwrite = old == Old::UnlessCovered;
        let (_, slot) = self.locate(page);
        let st = &chunk.pages[slot];
        match st.begin_write() {
            WriteLock::Resident => {
                self.counters.hit(1);
                // A lent page gets its copy before anything changes it (page loanout).
                self.break_loans(page, page);
                if let Err(e) = self.dirty_held(st) {
                    st.abort_write();
                    return Err(e);
                }
                Ok(Held::Writing(st))
            }
            WriteLock::Empty => {
                bump(&self.counters.mine().misses, 1);
                if let Err(e) = self.charge(1) {
                    st.release_empty();
                    return Err(e);
                }
                if let Err(e) = self.res.reserve_dirty(self, None) {
                    self.uncharge(1);
                    st.release_empty();
                    return Err(e);
                }
                let page_off = page << self.ps();
                let covers = overwrite && from == page_off && to == page_off + (1 << self.ps());
                let fresh = covers || page_off >= self.len();
                if !fresh && let Err(e) = self.fill_locked(chunk, page, 1) {
                    self.uncharge(1);
                    self.res.unreserve_dirty();
                    st.release_empty();
                    return Err(e);
                }
                Ok(Held::Filled(chunk, page, fresh))
            }
        }
    }

    /// Mark a page the caller holds WRITING dirty before changing it, taking an unclean slot
    /// (the dirty limit) if it was clean. Dirty from the start of the write, not its end: a
    /// store through a mapping found meanwhile (which also sets DIRTY) then needs no
    /// reconciling with the writer's reservation.
    /// The page's unclean slot is *held* by the caller until it lets the page go
    /// (`release_written` / `abort_held` publish it): a page held WRITING cannot be cleaned,
    /// so a writer waiting at the dirty limit must not count it as something writeback
    /// could clean. An already dirty page's published slot moves to held.
    fn dirty_held(&self, st: &state::PageState) -> Result<()> {
        // Nobody else clears DIRTY while we hold the page WRITING (writeback cannot begin).
        if st.snapshot().dirty() {
            self.res.dirty.hold(1);
            return Ok(());
        }
        if !self.res.reserve_dirty(self, Some(st))? {
            // A store through a mapping dirtied it while we waited and published its slot.
            self.res.dirty.hold(1);
            return Ok(());
        }
        if st.mark_dirty() {
            self.note_dirtied(1);
        } else {
            // A store found through a mapping dirtied it first and published its slot.
            self.res.unreserve_dirty();
            self.res.dirty.hold(1);
        }
        Ok(())
    }

    /// Give back a page a writer held without having written it: a resident page stays (it
    /// may stay marked dirty: a needless writeback, never a lost one); a new one is
    /// discarded (its contents may never have been produced).
    fn abort_held(&self, h: Held<'_>) {
        match h {
            Held::Writing(st) => {
                // The page stays dirty (marked when taken): its slot becomes a published one,
                // before the page is let go (a writeback may clean it at once; see `dirty`).
                self.res.dirty.publish(1);
                st.abort_write();
            }
            Held::Filled(chunk, page, _) => {
                let _ = self.free_memory(page << self.ps(), 1 << self.ps());
                self.uncharge(1);
                self.res.unreserve_dirty();
                chunk.pages[self.locate(page).1].release_empty();
            }
        }
    }

    /// Publish a page a writer held: it is now valid and dirty.
    pub(super) fn release_written(&self, h: Held<'_>) {
        match h {
            Held::Writing(st) => {
                // Published before the page is let go: a writeback may clean it (and count
                // its slot out) as soon as it is (see `dirty`).
                self.res.dirty.publish(1);
                let was_clean = st.end_write();
                debug_assert!(!was_clean, "a held page is dirty from the start of the write");
            }
            Held::Filled(chunk, page, _) => {
                self.publish_filled(chunk, page, 1, Publish::Dirty, Admission::Demand, None)
            }
        }
    }

    /// `write_at`: copy `buf` into the file at `offset`, extending it if needed.
    /// Writers take pages in ascending order with lock coupling (the next page is taken
    /// before the previous is released), so overlapping writes are applied in one order
    /// on every page they share.
    pub(crate) fn write(&self, buf: &[u8], offset: u64) -> Result<usize> {
        let end = checked_end(offset, buf.len())?;
        if buf.is_empty() {
            return Ok(0);
        }
        if self.res.maps.get().is_some_and(|svc| svc.overlaps(buf.as_ptr() as usize, buf.len())) {
            return self.write_bounced(buf, offset);
        }
        let ps = self.ps();
        // Smooth dirty throttling happens here, before any page is held.
        self.res.balance_dirty(((end - 1) >> ps) - (offset >> ps) + 1);
        let _size = self.size_shared();
        // A range the pager locked: ask it first (nothing held but the size lock).
        self.unlock_for_change(offset, end)?;
        self.xip_extend(end)?;
        // Pages are held from here on (lock coupling), each taken in ascending order.
        let _pages = crate::order::hold(crate::order::Rank::page(self.depth()));
        let mut held: Option<Held<'_>> = None;
        let mut pos = offset;
        let mut result = Ok(());
        while pos < end {
            let page = pos >> ps;
            let to = end.min((page + 1) << ps);
            let (ci, _) = self.locate(page);
            let chunk = self.table.get_or_create(ci);
            let h = match self.lock_page_for_write(chunk, page, pos, to, Old::UnlessCovered) {
                Ok(h) => h,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            if let Some(prev) = held.take() {
                self.release_written(prev);
            }
            let src = &buf[(pos - offset) as usize..(to - offset) as usize];
            let copied = match (matches!(h, Held::Filled(_, _, true)), self.memory()) {
                // A page with no memory yet: `pwrite` into the memfd allocates it in the
                // kernel without zeroing it first and without a page fault on the window
                // (measured in docs/bench.md, table1 writes). The page is BUSY: no mapping
                // maps it (they are registered MINOR), no reader reads it. `checked_end`
                // kept the write below the memfd's size, so below any RLIMIT_FSIZE.
                (true, Ok(m)) if !m.is_hugetlb() => m.write_at(src, pos),
                // hugetlbfs has no `write`: the page is allocated (an empty pool is this
                // write's error, not a SIGBUS in the copy), then copied into as any other.
                (true, Ok(m)) => m.allocate(page << ps, 1 << ps).and_then(|()| self.copy_in(chunk, pos, src)),
                // We hold the page (WRITING or BUSY): no other writer, no eviction.
                (false, Ok(_)) => self.copy_in(chunk, pos, src),
                (_, Err(e)) => Err(e),
            };
            match copied {
                Ok(()) => {}
                Err(e) => {
                    // Nothing was copied into this page: give it back untouched.
                    self.abort_held(h);
                    result = Err(e);
                    break;
                }
            }
            // Extend the file before the page is published (released): once published it
            // may be written back and evicted, and writeback clips at the length.
            self.grow_to(to);
            held = Some(h);
            pos = to;
        }
        if let Some(h) = held.take() {
            self.release_written(h);
        }
        match result {
            Ok(()) => Ok(buf.len()),
            Err(_) if pos > offset => Ok((pos - offset) as usize),
            Err(e) => Err(e),
        }
    }

    /// `write` from a buffer that lies in a user mapping of this cache (UBC's deadlock: the
    /// copy could fault on a page we hold). Copy it out first, a piece at a time, while
    /// holding nothing, so its faults are resolved like any other.
    fn write_bounced(&self, buf: &[u8], offset: u64) -> Result<usize> {
        const PIECE: usize = 1 << 20;
        let mut bounce = vec![0u8; PIECE.min(buf.len())];
        let mut done = 0;
        for piece in buf.chunks(PIECE) {
            let b = &mut bounce[..piece.len()];
            b.copy_from_slice(piece);
            match self.write(b, offset + done as u64) {
                Ok(n) if n == piece.len() => done += n,
                Ok(n) => return Ok(done + n),
                Err(_) if done > 0 => return Ok(done),
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    /// Take every page of `first..=last` (one chunk) for writing, filling partial ones, for
    /// a writable window over bytes `from..to`. Returns the chunk's window address.
    /// => caller holds `size_lock` shared until `unlock_range_written`.
    pub(crate) fn lock_range_for_write(&self, chunk: &Chunk, from: u64, to: u64) -> Result<*mut u8> {
        let ps = self.ps();
        let (first, last) = (from >> ps, (to - 1) >> ps);
        // XIP: the window is the store's memory, which reaches `to` before it is handed out.
        self.xip_extend(to)?;
        let mut helds = Vec::with_capacity((last + 1 - first) as usize);
        let _pages = crate::order::hold(crate::order::Rank::page(self.depth()));
        for page in first..=last {
            let a = from.max(page << ps);
            let b = to.min((page + 1) << ps);
            // A window shows the file's current bytes, so every page is read in.
            match self.lock_page_for_write(chunk, page, a, b, Old::Always) {
                Ok(h) => helds.push(h),
                Err(e) => {
                    helds.into_iter().for_each(|h| self.abort_held(h));
                    return Err(e);
                }
            }
        }
        match self.memory().and_then(|m| self.res.windows.address(chunk, m)) {
            Ok(w) => Ok(w),
            Err(e) => {
                helds.into_iter().for_each(|h| self.abort_held(h));
                Err(e)
            }
        }
    }

    /// Publish the pages of a writable window and extend the file to `to`.
    pub(crate) fn unlock_range_written(&self, chunk: &Chunk, from: u64, to: u64) {
        let ps = self.ps();
        self.grow_to(to);
        for page in from >> ps..=(to - 1) >> ps {
            let (_, slot) = self.locate(page);
            let st = &chunk.pages[slot];
            if st.snapshot().valid() {
                self.release_written(Held::Writing(st));
            } else {
                self.release_written(Held::Filled(chunk, page, false));
            }
        }
    }
}

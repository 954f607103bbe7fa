//! Lending an object's pages to a read-only window, and breaking the loan before a page
//! changes (the registry and the copying are `resources/loans.rs`).

use super::*;

thread_local! {
    /// The `WindowMut`s this thread holds: (object, first page, last page). A window of
    /// those pages taken by the same thread would wait for itself (`lend` waits for writers).
    static WRITING_WINDOWS: std::cell::RefCell<Vec<(u64, u64, u64)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A loan made by [`Object::lend`]: `view` shows its first page.
pub(crate) struct Lent {
    pub(crate) id: u64,
    pub(crate) view: *const u8,
}

impl Object {
    /// Lend pages `first..=last` of `chunk` for reading: fill and pin them, give them a
    /// view (the chunk's, shared with its other loans while intact), and wait for writers
    /// already copying into them, so that the view shows one version of each page and keeps
    /// showing it (see `resources/loans.rs`). Undo with [`Object::end_loan`].
    pub(crate) fn lend(&self, chunk: &Chunk, first: u64, last: u64) -> Result<Lent> {
        let key = self.id;
        if WRITING_WINDOWS.with(|w| w.borrow().iter().any(|&(o, a, b)| o == key && a <= last && first <= b)) {
            return Err(Error::InvalidArgument(
                "a window of pages this thread holds in a WindowMut would wait for itself: drop the WindowMut first"
                    .into(),
            ));
        }
        let loans = &self.res.loans;
        // Registered before the pages are pinned and waited on: a writer that takes a page
        // after the wait below finds the loan (see the registry's ordering note).
        let id = loans.register(self.id, first, last);
        if let Err(e) = self.pin_pages(chunk, first, last) {
            // Nothing pinned (`pin_pages` let go of what it had), no view.
            let _ = loans.unregister(id);
            return Err(e);
        }
        let ps = self.ps();
        let cs = self.res.geo.chunk_shift;
        let chunk_first = chunk.index << cs;
        let view = match loans.attach_view(id, chunk_first, 1 << cs, || {
            self.memory().and_then(|m| m.map_view(chunk_first << ps, 1 << (cs + ps))).map(|p| p as usize)
        }) {
            Ok(v) => v,
            Err(e) => {
                self.end_loan(chunk, &Lent { id, view: std::ptr::null() });
                return Err(e);
            }
        };
        {
            let _pages = crate::order::hold(crate::order::Rank::page(self.depth()));
            for p in first..=last {
                let st = &chunk.pages[self.locate(p).1];
                if st.has_writer() {
                    crate::order::check_wait(crate::order::Rank::page(self.depth()));
                    st.wait_no_writer();
                }
            }
        }
        loans.settle(id);
        // A shared writable mapping may store into these pages at any time, with no fault
        // for the cache to see: its pages are copied for the loan now. (A mapping made
        // later maps each page through `before_writable_map`, which breaks the loan.)
        if self.nmaps.load(SeqCst) > 0 {
            let overlaps = self.maps.read().iter().any(|m| {
                let r = m.pages(ps);
                m.tracked && r.start <= last && first < r.end
            });
            if overlaps {
                loans.break_range(self.id, first, last, ps);
            }
        }
        Ok(Lent { id, view: (view + (((first - chunk_first) as usize) << ps)) as *const u8 })
    }

    /// End a loan made by [`Object::lend`] of pages of `chunk`: unpin what it still pins,
    /// unmap the views no loan needs any more.
    pub(crate) fn end_loan(&self, chunk: &Chunk, lent: &Lent) {
        let (pinned, unmap) = self.res.loans.unregister(lent.id);
        self.unmap_views(unmap);
        for p in pinned {
            chunk.pages[self.locate(p).1].unpin();
        }
    }

    /// This thread took a `WindowMut` of bytes `from..to` (`File::window_mut`).
    pub(crate) fn note_writing_window(&self, from: u64, to: u64) {
        let ps = self.ps();
        WRITING_WINDOWS.with(|w| w.borrow_mut().push((self.id, from >> ps, (to - 1) >> ps)));
    }

    /// This thread let go of the `WindowMut` of bytes `from..to`.
    pub(crate) fn forget_writing_window(&self, from: u64, to: u64) {
        let ps = self.ps();
        let me = (self.id, from >> ps, (to - 1) >> ps);
        WRITING_WINDOWS.with(|w| {
            let mut w = w.borrow_mut();
            if let Some(i) = w.iter().position(|&x| x == me) {
                w.swap_remove(i);
            }
        });
    }

    /// Unmap views the loan registry let go of (`(address, pages)`).
    fn unmap_views(&self, views: Vec<(usize, usize)>) {
        for (addr, pages) in views {
            // SAFETY: the registry no longer lists the view, and no loan reads through it.
            unsafe { crate::memfd::unmap(addr as *mut u8, pages << self.ps()) };
        }
    }

    /// Teardown: unmap the views kept for this object's chunks.
    pub(super) fn forget_loans(&self) {
        let views = self.res.loans.forget(self.id);
        self.unmap_views(views);
    }

    /// A truncation or invalidation is about to take page `page` of `chunk` for dropping:
    /// windows that lent it keep copies and let go of their pins, so the drop does not wait
    /// for them (`Loans::hand_back`). => the caller takes the page next with `lock_for_drop`.
    /// A writer that holds the page (none does beside a dropper, which holds the size lock
    /// exclusively) broke the settled loans before changing a byte, so the copy is never
    /// half a write.
    pub(super) fn hand_back_loans(&self, chunk: &Chunk, page: u64) {
        if self.res.loans.any() {
            let st = &chunk.pages[self.locate(page).1];
            self.res.loans.hand_back(self.id, page, self.ps(), &mut || st.unpin());
        }
    }

    /// Give every loan of pages `a..=b` its copy before those pages change.
    /// => the caller holds the pages (WRITING, or about to map them writable while it holds
    /// them): their bytes are still the lent ones.
    #[inline]
    pub(crate) fn break_loans(&self, a: u64, b: u64) {
        if self.res.loans.any() {
            self.res.loans.break_range(self.id, a, b, self.ps());
        }
    }
}

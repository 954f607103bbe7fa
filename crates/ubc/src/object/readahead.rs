//! On-demand read-ahead, after Linux's `mm/readahead.c`.
//!
//! The contract:
//! * A demand miss at page `p` by a read of `req` pages is *sequential* if `p` is the start
//!   of the file, the request is at least a full window, or the pages just before `p` are
//!   cached in a run longer than the request (the trace a sequential stream leaves behind —
//!   Linux's context read-ahead). Anything else is a standalone random read: it is filled as
//!   asked and nothing more.
//! * A sequential miss opens a window of `init`..`max` pages at `p`: the reader fills its own
//!   request synchronously; the rest of the window is queued to the I/O pool, and the first
//!   page after the request carries the RA_MARK (Linux's `PG_readahead`).
//! * When a reader reaches a marked page, the next window — twice the size, up to `max` —
//!   is queued asynchronously and its first page is marked, so a steady reader stays one
//!   window ahead and never waits.
//! * Window sizes live in a small side table keyed by marker page, not in the file handle:
//!   two interleaved streams on one file (one handle or several) each find their own marker
//!   and ramp independently, and the cache-hit path touches no per-stream state.
//! * Read-ahead pages are admitted as [`Admission::ReadAhead`] (worth less than used pages)
//!   and marked SPECULATIVE until first used; statistics count pages read ahead, those used
//!   (hits) and those evicted unused (waste). Read-ahead never waits for memory: if the
//!   budget has no room without waiting for pinned pages, it gives up.

use super::*;

/// Most windows remembered per object (interleaved streams); beyond it the table is reset.
const MAX_WINDOWS: usize = 64;

impl Object {
    /// A demand miss at `page` by a read whose last page is `req_last`: if sequential, queue
    /// the rest of the read-ahead window beyond the request.
    pub(crate) fn readahead_on_miss(&self, page: u64, req_last: u64) {
        let g = &self.res.geo;
        let max = g.ra_max_pages;
        if max == 0 {
            return;
        }
        let Some(eof) = self.last_page() else { return };
        if page > eof {
            return; // truncated under us
        }
        let req = req_last.min(eof) - page + 1;
        let size = if page == 0 || req >= max {
            initial_size(req, g.ra_init_pages, max)
        } else {
            let contig = self.cached_run_before(page, max.min(page));
            if contig <= req {
                return; // standalone random read
            }
            // Cached from the start of the file: a strong sign of a whole-file read. No floor
            // at `init`: a short history (perhaps two random reads that happened to be
            // adjacent) only earns a short window.
            let c = if contig == page { contig * 2 } else { contig };
            (c + req).min(max)
        };
        let start = page + req;
        let end = (page + size).min(eof + 1);
        if start < end {
            self.readahead_submit(start, end, size);
        }
    }

    /// A reader reached the marked page `mark`: queue the next window.
    pub(crate) fn readahead_on_mark(&self, mark: u64) {
        let g = &self.res.geo;
        let max = g.ra_max_pages;
        let Some(eof) = self.last_page() else { return };
        let known = self.ra_windows.lock().remove(&mark);
        // The next window starts where the cached run after the marker ends.
        let start = mark + 1 + self.cached_run_after(mark + 1, max);
        let ramp = known.unwrap_or_else(|| (start - mark).max(g.ra_init_pages));
        let size = (ramp * 2).min(max);
        let end = (start + size).min(eof + 1);
        if start < end {
            self.readahead_submit(start, end, size);
        }
    }

    /// Queue pages `start..end` for asynchronous filling, marking `start`. The empty pages
    /// are taken BUSY here, before the I/O is queued (as Linux adds read-ahead pages to the
    /// page cache locked before submitting): a reader that catches up with a window still
    /// in the queue waits for that read instead of issuing its own.
    fn readahead_submit(&self, start: u64, end: u64, size: u64) {
        let Some(me) = self.me.upgrade() else { return };
        {
            let mut w = self.ra_windows.lock();
            if w.len() >= MAX_WINDOWS {
                w.clear();
            }
            w.insert(start, size);
        }
        let cs = self.res.geo.chunk_shift;
        let piece = self.res.geo.max_fill_pages;
        let depth = self.depth();
        // The pages taken BUSY below are this thread's until their job is queued: reclaim
        // (in `try_reserve`) must not call a pager above, which could wait for them.
        let _pages = crate::order::hold(crate::order::Rank::page(depth));
        let mut p = start;
        while p < end {
            let (ci, _) = self.locate(p);
            let chunk = self.table.get_or_create(ci);
            let base = ci << cs;
            let st = &chunk.pages[(p - base) as usize];
            if !st.try_lock_empty() {
                if p == start {
                    st.set_ra_mark();
                }
                p += 1;
                continue;
            }
            // A run of empty pages, ending at the chunk boundary (one window per fill) and
            // at max_fill.
            let stop = end.min((ci + 1) << cs).min(p + piece);
            let mut n = 1;
            while p + n < stop && chunk.pages[(p + n - base) as usize].try_lock_empty() {
                n += 1;
            }
            if self.res.try_reserve(n).is_err() {
                chunk.pages[(p - base) as usize..(p + n - base) as usize].iter().for_each(|s| {
                    s.release_empty();
                });
                return; // no room without waiting: read-ahead is optional
            }
            let obj: Arc<Object> = me.clone();
            let mark = (p == start).then_some(start);
            let first = p;
            self.res.io.submit(depth, move || obj.readahead_fill(ci, first, n, mark));
            p += n;
        }
    }

    /// Fill pages `first..first+n` of chunk `ci`, taken BUSY with budget reserved by
    /// `readahead_submit`, as read-ahead; runs on an I/O thread.
    fn readahead_fill(&self, ci: u64, first: u64, n: u64, mark: Option<u64>) {
        let chunk = self.table.get(ci).expect("chunk of pages taken for read-ahead");
        let _pages = crate::order::hold(crate::order::Rank::page(self.depth()));
        let base = ci << self.res.geo.chunk_shift;
        if self.fill_locked(chunk, first, n).is_err() {
            // A read error is reported to whoever reads the page on demand.
            self.res.unreserve(n);
            chunk.pages[(first - base) as usize..(first + n - base) as usize].iter().for_each(|s| {
                s.release_empty();
            });
            return;
        }
        self.publish_filled(chunk, first, n, Publish::Clean, Admission::ReadAhead, mark);
        bump(&self.counters.mine().readahead_pages, n);
    }

    /// Index of the last page of the file, if it is not empty.
    fn last_page(&self) -> Option<u64> {
        let len = self.len();
        (len > 0).then(|| (len - 1) >> self.res.geo.page_shift)
    }

    /// How many pages right before `page` are valid, looking back at most `max`.
    fn cached_run_before(&self, page: u64, max: u64) -> u64 {
        let mut n = 0;
        while n < max && self.page_state(page - n - 1).is_some_and(|s| s.is_valid()) {
            n += 1;
        }
        n
    }

    /// How many pages from `page` on are valid or being filled, looking at most `max`.
    fn cached_run_after(&self, page: u64, max: u64) -> u64 {
        let mut n = 0;
        while n < max && self.page_state(page + n).is_some_and(|s| !s.is_empty()) {
            n += 1;
        }
        n
    }
}

/// Linux's `get_init_ra_size`: small requests get 4x, medium 2x, large the maximum;
/// never below `init`.
fn initial_size(req: u64, init: u64, max: u64) -> u64 {
    let s = if req <= max / 32 {
        req * 4
    } else if req <= max / 4 {
        req * 2
    } else {
        max
    };
    s.clamp(init.min(max), max)
}

#[cfg(test)]
mod tests {
    use super::initial_size;

    #[test]
    fn initial_window_sizes() {
        assert_eq!(initial_size(1, 32, 512), 32);
        assert_eq!(initial_size(16, 32, 512), 64);
        assert_eq!(initial_size(100, 32, 512), 200);
        assert_eq!(initial_size(300, 32, 512), 512);
        assert_eq!(initial_size(1, 32, 16), 16, "init above max is clipped");
    }
}

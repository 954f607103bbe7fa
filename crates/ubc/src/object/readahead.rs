//! On-demand read-ahead, after Linux's `mm/readahead.c`, with the streams kept per object.
//!
//! The contract:
//! * A demand miss at page `p` by a read of `req` pages is *sequential* if `p` is the start
//!   of the file, the request is at least a full window, or `p` continues a stream the object
//!   remembers (it lies right after a read seen before, or inside a stream's last window).
//!   Anything else is a standalone random read: it is filled as asked and nothing more, and
//!   it is remembered as a *candidate* stream (Linux's `prev_pos`), so the next read right
//!   after it starts a stream.
//! * A sequential miss opens a window of `init`..`max` pages at `p`: the reader fills its own
//!   request synchronously; the rest of the window is queued to the I/O pool, and the first
//!   page after the request carries the RA_MARK (Linux's `PG_readahead`).
//! * When a reader reaches a marked page, the next window — twice the size, up to `max` —
//!   is queued asynchronously and its first page is marked, so a steady reader stays one
//!   window ahead and never waits.
//! * Streams live in a small table per object ([`Streams`]), not in the file handle: two
//!   interleaved streams on one file (one handle or several) each find their own entry and
//!   ramp independently. The table is touched on misses and marked pages only: the cache-hit
//!   path touches no per-stream state.
//! * Unlike Linux, there is no *context* read-ahead (a miss preceded by a run of cached pages
//!   taken for a stream): on a file mostly resident — the normal case once a cache is full —
//!   a uniform random miss almost always finds cached pages before it, and would read a
//!   window for one page used (issue 19 measured 5.5 pages read per random miss). The stream
//!   table detects interleaved streams, which is what context read-ahead was for.
//! * Read-ahead pages are admitted as [`Admission::ReadAhead`] (worth less than used pages)
//!   and marked SPECULATIVE until first used; statistics count pages read ahead, those used
//!   (hits) and those evicted unused (waste). Read-ahead never waits for memory: if the
//!   budget has no room without waiting for pinned pages, it gives up.

use super::*;

/// Streams remembered per object (confirmed ones and candidates).
const STREAMS: usize = 8;

/// Table lookups (misses and marked pages of the object) after which a stream not used is
/// over for misses (a marked page still finds it).
const STALE: u64 = 256;

/// One stream of an object: where it goes next and its last window.
#[derive(Clone, Copy, Debug, Default)]
struct Stream {
    /// A demand miss at a page in `lo..=hi` continues this stream.
    lo: u64,
    hi: u64,
    /// The marked page of the last window queued (`u64::MAX`: none yet).
    mark: u64,
    /// That window's size in pages; 0 for a candidate (one read seen, no window yet).
    size: u64,
    /// Last use, for replacing the least recently used entry.
    used: u64,
    live: bool,
}

/// The per-object stream table (Linux keeps one `file_ra_state` per open file; a cache
/// object shared by many handles and mappings keeps a few streams instead). Small and
/// searched linearly; guarded by the object's `ra_streams` mutex, a leaf lock held for a
/// lookup only (never across I/O, reservation or another lock).
#[derive(Debug, Default)]
pub(crate) struct Streams {
    s: [Stream; STREAMS],
    clock: u64,
}

impl Streams {
    /// The stream a miss at `page` continues, if any. A stream not used for `STALE` table
    /// lookups is over: its window no longer says where a reader is (the last window of a
    /// finished sequential pass would otherwise catch random misses for ever after).
    fn continuing(&mut self, page: u64) -> Option<&mut Stream> {
        self.clock += 1;
        let now = self.clock;
        let st = self
            .s
            .iter_mut()
            .filter(|s| s.live && now - s.used <= STALE && s.lo <= page && page <= s.hi)
            .max_by_key(|s| s.size)?;
        st.used = now;
        Some(st)
    }

    /// The stream whose last window is marked at `mark`, if any.
    fn marked(&mut self, mark: u64) -> Option<&mut Stream> {
        self.clock += 1;
        let now = self.clock;
        let st = self.s.iter_mut().find(|s| s.live && s.mark == mark)?;
        st.used = now;
        Some(st)
    }

    /// Remember a stream: in a free entry, else over the least recently used candidate (so a
    /// burst of random misses does not push out the streams being read), else over the least
    /// recently used stream.
    fn insert(&mut self, new: Stream) {
        self.clock += 1;
        let lru = |it: &mut dyn Iterator<Item = (usize, &Stream)>| it.min_by_key(|(_, s)| s.used).map(|(i, _)| i);
        let i = self
            .s
            .iter()
            .position(|s| !s.live)
            .or_else(|| lru(&mut self.s.iter().enumerate().filter(|(_, s)| s.size == 0)))
            .or_else(|| lru(&mut self.s.iter().enumerate()))
            .expect("STREAMS > 0");
        self.s[i] = Stream { used: self.clock, live: true, ..new };
    }
}

impl Object {
    /// A demand miss at `page` by a read whose last page is `req_last`: if sequential, queue
    /// the rest of the read-ahead window beyond the request; if not, remember the read as a
    /// candidate stream and read nothing more.
    ///
    /// Linux's `page_cache_sync_ra` (mm/readahead.c) decides the same way:
    /// ```text
    ///     /*
    ///      * A start of file, oversized read, or sequential cache miss:
    ///      * trivial case: (index - prev_index) == 1
    ///      * unaligned reads: (index - prev_index) == 0
    ///      */
    ///     if (!index || req_count > max_pages || index - prev_index <= 1UL) {
    ///         ra->start = index;
    ///         ra->size = get_init_ra_size(req_count, max_pages);
    ///         ra->async_size = ra->size > req_count ? ra->size - req_count : ...
    /// ```
    /// with `prev_index` one per open file; here each stream of the table has its own, and a
    /// miss inside a stream's last window (read-ahead gave up for memory) continues it too.
    ///
    /// `sequential`: the reader said so (`Advice::Sequential`): the miss opens a window as a
    /// stream's would, whatever the table knows, and windows grow to twice the maximum.
    pub(crate) fn readahead_on_miss(&self, page: u64, req_last: u64, sequential: bool) {
        let g = &self.res.geo;
        let max = if sequential { g.ra_max_pages * 2 } else { g.ra_max_pages };
        if max == 0 {
            return;
        }
        let Some(eof) = self.last_page() else { return };
        if page > eof {
            return; // truncated under us
        }
        // A read of the whole file from its start (most reads of a small file) has no
        // window to open and no stream worth remembering: the table (392 bytes, kept until
        // the last close) is not made for it.
        if page == 0 && req_last >= eof && self.ra_streams.lock().is_none() {
            return;
        }
        let req = req_last.min(eof) - page + 1;
        let size = {
            let mut t = self.ra_streams.lock();
            let t = t.get_or_insert_with(Default::default);
            let known = t.continuing(page).map(|s| s.size);
            let size = match known {
                _ if sequential => initial_size(req, g.ra_init_pages, max),
                // Continues one read seen before (a candidate): start small, as Linux's
                // `get_init_ra_size` does — a coincidence costs a few pages, a stream
                // doubles from there.
                Some(0) if page != 0 && req < max => initial_size(req, 1, max),
                // The start of the file, a large request, or a miss inside a stream's
                // window (read-ahead gave up for memory).
                Some(_) => initial_size(req, g.ra_init_pages, max),
                None if page == 0 || req >= max => initial_size(req, g.ra_init_pages, max),
                None => {
                    // "standalone, small random read / Read as is, and do not pollute the
                    // readahead state" — but remember the page after it (Linux's
                    // `prev_pos`): a read there continues it.
                    let next = page + req;
                    t.insert(Stream { lo: next, hi: next, mark: u64::MAX, size: 0, ..Default::default() });
                    return;
                }
            };
            let start = page + req;
            // The stream: a miss anywhere up to the window's end continues it.
            let st = Stream { lo: page, hi: page + size, mark: start, size, ..Default::default() };
            match t.continuing(page) {
                Some(s) => *s = Stream { used: s.used, live: true, ..st },
                None => t.insert(st),
            }
            size
        };
        let start = page + req;
        let end = (page + size).min(eof + 1);
        if start < end {
            self.readahead_submit(start, end, true);
        }
    }

    /// A reader reached the marked page `mark`: queue the next window.
    ///
    /// Linux's `page_cache_async_ra`: the next window starts at the first page not cached
    /// after the marker, and grows (`get_next_ra_size`: ×2, ×4 while small) up to the
    /// maximum:
    /// ```text
    ///     start = page_cache_next_miss(ractl->mapping, index + 1, max_pages);
    ///     if (!start || start - index > max_pages)
    ///         return;
    ///     ra->start = start;
    ///     ra->size = start - index;    /* old async_size */
    ///     ra->size += req_count;
    ///     ra->size = get_next_ra_size(ra, max_pages);
    /// ```
    pub(crate) fn readahead_on_mark(&self, mark: u64, sequential: bool) {
        let g = &self.res.geo;
        let max = if sequential { g.ra_max_pages * 2 } else { g.ra_max_pages };
        let Some(eof) = self.last_page() else { return };
        // The next window starts where the cached run after the marker ends.
        let start = mark + 1 + self.cached_run_after(mark + 1, max);
        let size = {
            let mut t = self.ra_streams.lock();
            let t = t.get_or_insert_with(Default::default);
            let known = t.marked(mark).map(|s| s.size);
            let ramp = known.unwrap_or_else(|| (start - mark).max(g.ra_init_pages));
            let size = (ramp * 2).min(max);
            let st = Stream { lo: mark, hi: start + size, mark: start, size, ..Default::default() };
            match t.marked(mark) {
                Some(s) => *s = Stream { used: s.used, live: true, ..st },
                None => t.insert(st),
            }
            size
        };
        let end = (start + size).min(eof + 1);
        if start < end {
            self.readahead_submit(start, end, true);
        }
    }

    /// Queue pages `start..end` for asynchronous filling, marking `start` if `mark` (a
    /// window of a stream; not for a program's `WillNeed`, which asks for the range only). The empty pages
    /// are taken BUSY here (their budget is reserved by the I/O job), before the I/O is queued (as Linux adds read-ahead pages to the
    /// page cache locked before submitting): a reader that catches up with a window still
    /// in the queue waits for that read instead of issuing its own.
    pub(crate) fn readahead_submit(&self, start: u64, end: u64, mark: bool) {
        // Each job holds the object counted (`holders.rs`): a last close that unlists it
        // waits for the job. `_alive` keeps it alive meanwhile.
        let Some(_alive) = WorkHold::of(&self.me) else { return };
        // A window ends on a fill granule (a compressed chunk): one cut in the middle would
        // have the chunk fetched and decoded again for the rest.
        let g = self.granule_pages();
        let end = match self.last_page() {
            Some(last) if g > 1 => end.next_multiple_of(g).min(last + 1).max(end),
            _ => end,
        };
        let cs = self.res.geo.chunk_shift;
        let piece = self.res.geo.max_fill_pages;
        let depth = self.depth();
        // The pages taken BUSY below are this thread's until their job is queued (and the
        // job's, reserving and reclaiming, after): no pager above may be called meanwhile.
        let _pages = crate::order::hold(crate::order::Rank::page(depth));
        let mut p = start;
        while p < end {
            let (ci, _) = self.locate(p);
            let chunk = self.table.get_or_create(ci);
            let base = ci << cs;
            let st = &chunk.pages[(p - base) as usize];
            if !st.try_lock_empty() {
                if p == start && mark {
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
            let obj = WorkHold::of(&self.me).expect("alive: `_alive` holds it");
            let mark = (mark && p == start).then_some(start);
            let first = p;
            self.res.io.submit(depth, move || obj.readahead_fill(ci, first, n, mark));
            p += n;
        }
    }

    /// Fill pages `first..first+n` of chunk `ci`, taken BUSY by `readahead_submit`, as
    /// read-ahead; runs on an I/O thread. The budget is reserved here, not by the reader who
    /// queued the window: reclaim for a 2 MiB window is work the reader should not wait for
    /// (issue 19 keeps eviction off the reading thread). => holds those pages BUSY; no
    /// memory is allocated for them before the reservation (`fill_locked` is the first
    /// touch), so the budget still bounds memory.
    fn readahead_fill(&self, ci: u64, first: u64, n: u64, mark: Option<u64>) {
        let chunk = self.table.get(ci).expect("chunk of pages taken for read-ahead");
        // The pages held BUSY are this thread's: reclaim (in `try_reserve`) must not call a
        // pager above, which could wait for them.
        let _pages = crate::order::hold(crate::order::Rank::page(self.depth()));
        let base = ci << self.res.geo.chunk_shift;
        if self.try_charge(n).is_err() {
            // No room without waiting: read-ahead is optional.
            (first - base..first + n - base).for_each(|i| {
                chunk.pages[i as usize].release_empty();
            });
            return;
        }
        if self.fill_locked(chunk, first, n).is_err() {
            // A read error is reported to whoever reads the page on demand.
            self.uncharge(n);
            (first - base..first + n - base).for_each(|i| {
                chunk.pages[i as usize].release_empty();
            });
            return;
        }
        // Counted before the pages are visible: a reader that used them and then reads the
        // statistics must find them counted.
        bump(&self.counters.mine().readahead_pages, n);
        self.publish_filled(chunk, first, n, Publish::Clean, Admission::ReadAhead, mark);
    }

    /// Index of the last page of the file, if it is not empty.
    pub(crate) fn last_page(&self) -> Option<u64> {
        let len = self.len();
        (len > 0).then(|| (len - 1) >> self.res.geo.page_shift)
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
/// never below `init` (1 for a stream found by its second read).
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

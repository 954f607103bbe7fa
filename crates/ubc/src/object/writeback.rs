//! Writing an object's dirty pages to its pager: clustered runs over the I/O pool, `clean`
//! (Mach's `pager_clean_request`) and `sync`. *When* to write back (dirty limits, age, the
//! flusher) is decided cache-wide: `resources/dirty.rs` (limits) and `cache/flusher.rs`.

use super::*;

/// How a writeback pass treats pages others hold, and where its runs are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    /// `clean`, `sync`: also wait for pages being written or written back by others (and
    /// retry those whose writeback failed); runs are spread over the I/O pool (several
    /// requests in flight), the last one written on this thread, and waited for — except
    /// on an I/O thread, which must not wait for the pool and writes them all itself.
    Wait,
    /// The flusher: skip busy pages; runs over the I/O pool (the last on this thread),
    /// waited for.
    Background,
    /// Reclaim and the dirty throttle: skip busy pages; runs written on this thread.
    Inline,
    /// `Cache::sync_all`'s pass over a small file of a file system it syncs at once: as
    /// `Wait`, but the runs are written on this thread with `Pager::put_pages_unstable` (see
    /// "Unstable writes" below).
    Unstable,
}

/// The largest file `Cache::sync_all` writes with unstable writes: the kernel's copy it
/// leaves until the `syncfs` is at most this much per file, and a failed `syncfs` makes
/// the file's cached pages dirty again, which only a small file can afford.
const UNSTABLE_MAX: u64 = 64 << 10;

/// Call a file's writeback hook (`File::set_writeback_hook`) for bytes `range`. A hook that
/// panics fails the writeback like an error (the pages stay dirty): unwinding out of it
/// would leave the pages under writeback for ever, and every later writer, sync and
/// eviction of them waiting.
fn run_hook(hook: &crate::WritebackHook, range: std::ops::Range<u64>) -> std::io::Result<()> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(range.clone()))).unwrap_or_else(|_| {
        Err(std::io::Error::other(format!("the writeback hook panicked for bytes {}..{}", range.start, range.end)))
    })
}

impl Object {
    /// Mach's `pager_clean_request`: write back the dirty pages in bytes `from..to`
    /// (stores through mappings included) and wait for writebacks in flight there. On error
    /// the pages stay dirty and the first error is returned.
    pub(crate) fn clean(&self, from: u64, to: u64) -> Result<()> {
        let pages = self.pages_of(from, to);
        self.harvest(pages.start, pages.end, Harvest::Explicit);
        self.writeback(pages.start, pages.end, Pass::Wait)
    }

    /// Write back dirty pages with index in `from..to`, clustered into contiguous runs of at
    /// most `max_put_pages`, as `pass` says (see [`Pass`]). Failed runs stay dirty; the first
    /// error is returned after trying every run.
    pub(crate) fn writeback(&self, from: u64, to: u64, pass: Pass) -> Result<()> {
        let wait = matches!(pass, Pass::Wait | Pass::Unstable);
        let parallel = matches!(pass, Pass::Wait | Pass::Background);
        let unstable = pass == Pass::Unstable;
        if self.dirty_pages() == 0 && !wait {
            return Ok(());
        }
        let depth = self.depth();
        if wait {
            crate::order::check_wait(crate::order::Rank::page(depth));
        }
        // This thread holds the pages it takes WRITEBACK until it hands them to a job or
        // has written them itself.
        let _pages = crate::order::hold(crate::order::Rank::page(depth));
        // Jobs hold the object counted (`holders.rs`): a last close that unlists it waits
        // for them, not only for their results.
        let me = if parallel && !crate::io::on_io_thread() { WorkHold::of(&self.me) } else { None };
        let batch = crate::io::Batch::default();
        let cs = self.res.geo.chunk_shift;
        // A pager that stores whole units (a compressed chunk: `Pager::fill_granule`) pays a
        // read-modify-write of the unit for each call that covers part of it: runs are cut
        // on unit boundaries (below), and their length is a whole number of units.
        let g = if pass == Pass::Background { self.granule_pages() } else { 1 };
        let max_put = match self.res.geo.max_put_pages {
            m if g > 1 && m >= g => m / g * g,
            m => m,
        };
        // No page past the length is dirty (a writer extends the file before it publishes
        // a page, and `write_run` clips at the length): the scan stops there, which for a
        // small file is the first few slots of its chunk instead of all of them.
        // (The unit cut below still looks past it: a writer extends the file only once it
        // has copied a page.)
        let scan_to = to.min(self.len().div_ceil(1 << self.ps()));
        let mut first_err: Option<Error> = None;
        // The newest run found is held back and the one before it submitted: the last run
        // is written on this thread, which would only wait for the pool otherwise — a file
        // of one run (a small file at close) costs no hand-off between threads. A held run
        // is never kept across a wait for a busy page: it is submitted first, so this
        // thread holds no page WRITEBACK while it sleeps (as without holding back).
        let mut held: Option<(u64, u64, u64)> = None;
        let submit = |run: (u64, u64, u64)| {
            assert!(me.is_some(), "runs are held back only with an I/O pool");
            let obj = WorkHold::of(&self.me).expect("alive: `me` holds it");
            let ((ci, first, n), ticket) = (run, batch.ticket());
            self.res.io.submit(depth, move || {
                let chunk = obj.table.get(ci).expect("chunk of pages under writeback");
                let _pages = crate::order::hold(crate::order::Rank::page(depth));
                ticket.done(obj.write_run(chunk, first, n, false));
            });
        };
        self.table.for_each(from >> cs, (scan_to >> cs).saturating_add(1), |chunk| {
            let base = chunk.index << cs;
            let lo = from.max(base);
            let hi = scan_to.min(base + chunk.pages.made_end() as u64);
            let unit_hi = to.min(base + (1 << cs));
            let mut p = lo;
            while p < hi {
                let Some(st) = chunk.pages.get((p - base) as usize).filter(|st| st.snapshot().unclean()) else {
                    p += 1;
                    continue;
                };
                let begun = st.begin_writeback(IfHeld::Skip)
                    || wait && {
                        if let Some(run) = held.take() {
                            submit(run);
                        }
                        st.begin_writeback(IfHeld::Wait)
                    };
                if !begun {
                    p += 1;
                    continue;
                }
                let mut n = 1;
                while p + n < hi
                    && n < max_put
                    && chunk.pages.get((p + n - base) as usize).is_some_and(|s| s.begin_writeback(IfHeld::Skip))
                {
                    n += 1;
                }
                // The run stops inside a unit whose next page is being written or is dirty
                // but busy (a writer still copying into the unit — the kernel's write-back
                // of a sequential write arrives a request at a time): the unit is not
                // complete yet. The flusher (`Pass::Background`) leaves its pages dirty for
                // a later pass, which takes the unit whole, instead of storing it twice. A
                // unit that stays partial (a random write: the next page is clean or
                // absent) is written as it is; `sync` and `clean` write everything, and so
                // do reclaim and a throttled writer (`Pass::Inline`), which must make
                // progress — the writer may be the one holding the unit's next page.
                //
                // The rest of such a unit is skipped in this pass too: resumed at `q`, the
                // scan would find the unit's later pages published by then (the writer moves
                // on while we look) and start a run in the middle of the unit — which stored
                // its second part alone and the first part later (`tests/writeback.rs`,
                // `the_flusher_writes_whole_units_behind_a_sequential_writer`).
                let q = p + n;
                let mut resume = None;
                if g > 1 && !q.is_multiple_of(g) && q < unit_hi {
                    let next = chunk.pages.snapshot((q - base) as usize);
                    if next.unclean() || next.held() {
                        let cut = (q / g * g).max(p);
                        self.abort_run(chunk, cut, q - cut);
                        n = cut - p;
                        let unit_end = (q / g + 1) * g;
                        if n == 0 {
                            p = unit_end;
                            continue;
                        }
                        resume = Some(unit_end);
                    }
                }
                if me.is_some() {
                    if let Some(run) = held.replace((chunk.index, p, n)) {
                        submit(run);
                    }
                } else if let Err(e) = self.write_run(chunk, p, n, unstable) {
                    first_err.get_or_insert(e);
                }
                p = resume.unwrap_or(p + n);
            }
        });
        if let Some((ci, first, n)) = held {
            let chunk = self.table.get(ci).expect("chunk of pages under writeback");
            if let Err(e) = self.write_run(chunk, first, n, false) {
                first_err.get_or_insert(e);
            }
        }
        let r = batch.wait(depth);
        match first_err {
            Some(e) => Err(e),
            None => r,
        }
    }

    /// Give back pages `first..first+n`, taken WRITEBACK by the caller and not written:
    /// dirty again, counted once (a page found dirty again meanwhile — a store through a
    /// mapping — was counted when found, and its count from before goes).
    fn abort_run(&self, chunk: &Chunk, first: u64, n: u64) {
        let base = chunk.index << self.res.geo.chunk_shift;
        let mut redirtied = 0;
        for p in first..first + n {
            redirtied += chunk.pages[(p - base) as usize].end_writeback(Written::Failed) as u64;
        }
        if redirtied > 0 {
            self.dirty.fetch_sub(redirtied, Relaxed);
            self.res.dirty.cleaned(redirtied);
        }
    }

    /// Write pages `first..first+n` (WRITEBACK, taken by the caller) to the pager, with
    /// `Pager::put_pages_unstable` if `unstable` (the caller counted itself in
    /// `uncommitted` first: `begin_unstable`).
    fn write_run(&self, chunk: &Chunk, first: u64, n: u64, unstable: bool) -> Result<()> {
        let ps = self.ps();
        let base = chunk.index << self.res.geo.chunk_shift;
        // begin_writeback cleared DIRTY; the pages stay unclean until they are written.
        // Marked unsynced before they stop counting dirty: a sync that finds neither skips.
        self.mark_unsynced();
        self.dirty.fetch_sub(n, SeqCst);
        let offset = first << ps;
        // Clip at the end of the file: the store must not grow past the length we know.
        let bytes = ((n << ps).min(self.len().saturating_sub(offset))) as usize;
        let sh = self.counters.cold();
        let r = if bytes == 0 {
            Ok(())
        } else {
            // A small file's pages go through a buffer and `pread` (see `by_syscall`), and so
            // do a hooked file's: its hook must see the bytes that will be stored, and stores
            // through a mapping may change a page under writeback (see `set_writeback_hook`).
            // XIP pages are in the store already ("Execute in place"): nothing is read or put,
            // and the hook still hears of them, in order, though it cannot hold them back.
            let hook = self.writeback_hook();
            let mut bounce = Vec::new();
            let data = if self.xip() {
                Ok(None)
            } else if hook.is_some() || self.by_syscall(chunk) {
                bounce.resize(bytes, 0u8);
                self.memory().and_then(|m| m.read_at(&mut bounce, offset)).map(|()| Some(&bounce[..]))
            } else {
                self.memory().and_then(|m| self.window_at(chunk, m, offset)).map(|at| {
                    // SAFETY: pages held WRITEBACK (stable: no writer, no eviction, no
                    // retirement).
                    Some(unsafe { std::slice::from_raw_parts(at, bytes) })
                })
            };
            data.and_then(|data| {
                if data.is_some() {
                    bump(&sh.put_calls, 1);
                }
                self.call_pager(PagerOp::PutPages, offset, |p| {
                    // In the pager's scope: what the hook writes into the cache (a log) does
                    // not wait at the dirty limit nor reclaim by writing back this object,
                    // whose hook may be the one running.
                    if let Some(hook) = &hook {
                        run_hook(hook, offset..offset + bytes as u64)
                            .inspect_err(|e| self.wb_errors.retained(PagerOp::PutPages, e))?;
                    }
                    let Some(data) = data else { return Ok(()) };
                    let r = if unstable { p.put_pages_unstable(offset, data) } else { p.put_pages(offset, data) };
                    r.inspect_err(|e| self.wb_errors.retained(PagerOp::PutPages, e))
                })
            })
        };
        let ok = r.is_ok();
        if !ok {
            // Dirty again: counted before `end_writeback` sets DIRTY, since another writeback
            // may take the pages (and count them out) at once (see `dirty`).
            self.note_dirtied(n);
        }
        let mut redirtied = 0;
        for p in first..first + n {
            redirtied +=
                chunk.pages[(p - base) as usize].end_writeback(if ok { Written::Stored } else { Written::Failed })
                    as u64;
        }
        if ok {
            if !self.xip() {
                bump(&sh.written_bytes, bytes as u64);
            }
            bump(&sh.writebacks, n);
            self.res.dirty.cleaned(n);
        } else {
            // Each page is dirty again, counted once: pages re-dirtied meanwhile (by a store
            // found through a mapping) were counted dirty and unclean when found, so the
            // count just made for them and their writeback's unclean slot go.
            if redirtied > 0 {
                self.dirty.fetch_sub(redirtied, Relaxed);
                self.res.dirty.cleaned(redirtied);
            }
            bump(&sh.writeback_errors, 1);
        }
        r
    }

    /// `sync`: every dirty page reaches the pager, the stored length matches, then the
    /// pager's own sync. On error the pages stay dirty and the error is returned. Nothing
    /// at all if nothing changed since the last sync that succeeded ([`Object::needs_sync`]).
    pub(crate) fn sync(&self) -> Result<()> {
        if !self.needs_sync() {
            return Ok(());
        }
        self.sync_up_to_pager()?;
        self.begin_pager_sync();
        self.pager_sync()
    }

    /// Whether a sync has anything to do. Syncing what changed: an object whose store
    /// holds nothing its last successful sync did not cover — no page dirty or being
    /// written back, the store neither written nor resized since (`unsynced`), no mapping
    /// whose stores are yet to be found — needs no write-back, no length check and no
    /// `fdatasync` (a cache of many files written once and synced, dropped, syncs each
    /// again at the drop otherwise: a `statx` each and a `syncfs`). A write or a writeback
    /// in progress as this is read is not one that returned before the sync began.
    ///
    /// Why it cannot miss a change: a page is counted dirty before it is seen dirty, and
    /// the object is marked unsynced before a writeback counts its pages out (`write_run`)
    /// and after any call that changes the store (`call_pager`); the mark is
    /// cleared ([`Object::begin_pager_sync`]) only once everything stored so far is in the
    /// store, just before the pager's sync, and set again if that sync fails.
    pub(crate) fn needs_sync(&self) -> bool {
        // `dirty` first: a writeback marks before it counts its pages out, so a count seen
        // fallen is followed by the mark seen set (all SeqCst). Read the other way round, the
        // mark could be read clear just before the writeback set it, and the count just after
        // it fell — a sync skipped while the page it should write was still on its way
        // (`a_sync_racing_the_flusher_misses_no_write` caught it, 3 runs in 27 under load).
        self.dirty.load(SeqCst) > 0 || self.unsynced.load(SeqCst) || self.nmaps.load(SeqCst) > 0
    }

    /// Mark the store changed since the last sync (see [`Object::needs_sync`]). A mark
    /// seen set may be cleared by a sync right after: that sync's pager sync then covers
    /// the change, which the caller made before marking or marks again after making.
    pub(crate) fn mark_unsynced(&self) {
        if !self.unsynced.load(SeqCst) {
            self.unsynced.store(true, SeqCst);
        }
    }

    /// A write extends the file to `to` if it ends past it; a length the store has not
    /// seen is news to the next sync (marked unconditionally: see `mark_unsynced`).
    pub(crate) fn grow_to(&self, to: u64) {
        if self.len.fetch_max(to, SeqCst) < to {
            self.unsynced.store(true, SeqCst);
        }
    }

    /// Everything of this object is in the store and its pager's sync comes next: clear
    /// the mark ([`Object::pager_sync`] sets it again on failure; a grouped `syncfs` that
    /// fails falls back to it).
    pub(crate) fn begin_pager_sync(&self) {
        self.unsynced.store(false, SeqCst);
    }

    /// `sync` without durability: every dirty page written back, the stored length ours,
    /// then the pager's `write_through` (see [`crate::Pager::write_through`]).
    pub(crate) fn write_through(&self) -> Result<()> {
        self.sync_up_to_pager()?;
        self.call_pager(PagerOp::WriteThrough, 0, |p| p.write_through())
    }

    /// `sync` without the pager's own sync: every dirty page written back, the stored length
    /// ours. [`crate::Cache::sync_all`] then syncs many pagers at once (`Pager::sync_fs`).
    pub(crate) fn sync_up_to_pager(&self) -> Result<()> {
        self.harvest(0, u64::MAX, Harvest::Explicit);
        self.writeback(0, u64::MAX, Pass::Wait)?;
        self.fix_stored_len()
    }

    // Unstable writes (NFS's `UNSTABLE` write and `COMMIT`, RFC 1813, 3.3.7 and 3.3.21).
    // `Cache::sync_all` syncs the host files of one file system with one `syncfs`; writing
    // each small file's pages with `O_DIRECT` first cost one request to the device per file
    // (a 4 KiB write into a new file: its block allocated, the request issued and waited
    // for alone), where the kernel's own `syncfs` of files written into its page cache
    // allocates them together and merges their blocks into a few large requests — the
    // batched sync ran at 0.37x of `std::fs` writes and `syncfs`. So a file of at most
    // `UNSTABLE_MAX` is stored with `Pager::put_pages_unstable` (into the kernel's page
    // cache, not waited for), and the `syncfs` does the rest. Until that `syncfs` returns,
    // the store may lose what it was given (a failed writeback in the kernel leaves its
    // pages clean and their data gone), so the cache keeps its own copy as NFS's client
    // keeps a page until its `COMMIT`: `begin_unstable` counts the pass in `uncommitted`
    // before any page is stored (and so before any turns clean), eviction keeps the
    // object's first `UNSTABLE_MAX` bytes of pages while the count is above zero
    // (`release_evicted`; a pass writes no page past them), and `end_unstable` marks those
    // pages dirty again if the commit failed — or tells the pager it was committed —
    // before it counts the pass out. Kept pages are bounded cache-wide
    // (`Resources::take_uncommitted`): a thread that needs memory while they are kept may
    // be one the commit waits for (a layer's sync, writing its lower file in the same
    // `sync_all`: the mount's unmount hung so, its budget full of kept pages, before the
    // bound), so past the bound a file is written with direct writes as before.

    /// If `Cache::sync_all` may write this object with unstable writes (see above): the
    /// pass counted in, and the pages it may keep taken from the cache's bound — returned,
    /// for `sync_up_to_pager_unstable` and `end_unstable`, which follows once.
    pub(crate) fn begin_unstable(&self) -> Option<u64> {
        let len = self.len();
        if len > UNSTABLE_MAX {
            return None;
        }
        let pages = len.div_ceil(1 << self.ps()).max(1);
        if !self.res.take_uncommitted(pages) {
            return None;
        }
        self.uncommitted.fetch_add(1, SeqCst);
        Some(pages)
    }

    /// Eviction must keep this object's pages below the returned index: those a pass of
    /// unstable writes waiting for its commit may have stored (0 while none waits).
    pub(crate) fn kept_uncommitted_below(&self) -> u64 {
        if self.uncommitted.load(SeqCst) > 0 { UNSTABLE_MAX >> self.ps() } else { 0 }
    }

    /// `sync_up_to_pager` with unstable writes, of the first `pages` pages (those that
    /// `begin_unstable` took; a page a writer adds past them meanwhile is left dirty, for
    /// a later sync: its write did not return before this sync began).
    pub(crate) fn sync_up_to_pager_unstable(&self, pages: u64) -> Result<()> {
        self.harvest(0, u64::MAX, Harvest::Explicit);
        self.writeback(0, pages, Pass::Unstable)?;
        self.fix_stored_len()
    }

    /// End a pass of unstable writes begun by `begin_unstable` (which returned `pages`):
    /// `committed` — the sync that covers them returned `Ok` — tells the pager; otherwise
    /// the pages it may have stored that are clean are made dirty again (what the store
    /// was given may be lost; a page rewritten meanwhile is dirty already). Then the pass
    /// is counted out, and eviction may take the pages again.
    pub(crate) fn end_unstable(&self, committed: bool, pages: u64) {
        if committed {
            self.pager().committed();
        } else {
            // `redirty` takes the clean ones (at most `UNSTABLE_MAX` worth of pages).
            self.redirty(&(0..pages).collect::<Vec<u64>>());
        }
        self.uncommitted.fetch_sub(1, SeqCst);
        self.res.give_uncommitted(pages);
    }

    /// The stored length matches ours, then the pager's own sync (the durable half of
    /// `sync`). => dirty pages were written back.
    pub(crate) fn sync_pager(&self) -> Result<()> {
        self.fix_stored_len()?;
        self.pager_sync()
    }

    /// The pager's `sync`; a failure is recorded for every handle (`wb_errors`).
    pub(crate) fn pager_sync(&self) -> Result<()> {
        self.call_pager(PagerOp::Sync, 0, |p| {
            p.sync().inspect_err(|e| {
                self.mark_unsynced();
                self.wb_errors.lost(PagerOp::Sync, e)
            })
        })
    }

    /// The pager's `sync_metadata` (after a sync: `File::sync_all`); a failure is recorded
    /// for every handle, as a failed sync is.
    pub(crate) fn pager_sync_metadata(&self) -> Result<()> {
        self.call_pager(PagerOp::Sync, 0, |p| {
            p.sync_metadata().inspect_err(|e| {
                self.mark_unsynced();
                self.wb_errors.lost(PagerOp::Sync, e)
            })
        })
    }

    /// The pager's file system (`Pager::sync_domain`), if many of its files can be synced
    /// at once.
    pub(crate) fn sync_domain(&self) -> Option<u64> {
        self.pager().sync_domain()
    }

    /// `Pager::sync_fs`: everything written back into this pager's file system so far made
    /// durable. A failure is not recorded for the handles: the caller falls back to each
    /// object's [`Object::pager_sync`], which finds out whose data it was.
    pub(crate) fn pager_sync_fs(&self) -> Result<()> {
        self.call_pager(PagerOp::Sync, 0, |p| p.sync_fs())
    }

    /// Make the pager's length ours if it differs. => dirty pages were written back.
    fn fix_stored_len(&self) -> Result<()> {
        let stored = self.call_pager(PagerOp::Len, 0, |p| p.len())?;
        if stored != self.len() && self.pager().is_writable() {
            // Exclusive, and both lengths read again under it: with writers running (they
            // hold the lock shared), the length read before could be stale by the time the
            // pager is told, and a writer's page past it could already be written back —
            // `set_len` to the stale length would cut that page off the store while the cache
            // keeps it clean, and it would read back as zeros after eviction (a layer that
            // syncs its lower file while other threads write it, as zstd's commit does, would
            // lose data). Held exclusive, the length cannot move and writebacks in flight are
            // clipped to it, so the store cannot pass it meanwhile.
            let _size = self.size_exclusive();
            let len = self.len();
            let stored = self.call_pager(PagerOp::Len, 0, |p| p.len())?;
            if stored != len {
                self.call_pager(PagerOp::SetLen, len, |p| p.set_len(len))?;
            }
        }
        Ok(())
    }
}

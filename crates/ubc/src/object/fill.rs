//! Fill and the read path: pages come in from the pager in clusters (`fill_run`), and
//! `read` copies out of resident pages, pinning each run while it copies (NetBSD
//! `uvm_bio.c` `ubc_uiomove`, Linux `filemap_read`).

use super::*;
use crate::pager::AlignedBuf;

/// What filled pages become when they are published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Publish {
    /// Clean, not held (read-ahead).
    Clean,
    /// Clean, and pinned for the caller, who copies out of them (a read).
    Pinned,
    /// Dirty: a writer filled the page it is writing.
    Dirty,
}

impl Object {
    /// Fill pages `first..=last` of `chunk` (a cluster) from the pager; they come back
    /// valid and pinned. Returns how many pages were filled starting at `first`
    /// (fewer than asked if a later page was not empty), or 0 if `first` itself was taken
    /// by someone else (the caller retries its pin, which waits for that filler).
    ///
    /// With a fill granule (`Pager::fill_granule`: a pager that decodes whole units), the
    /// run grows to the granules it touches — empty pages only, inside the chunk and
    /// `max_fill_pages` — so that one pager call makes the whole unit; the pages outside
    /// `first..=last` are published clean and unpinned, as read-ahead.
    fn fill_run(&self, chunk: &Chunk, first: u64, last: u64, admission: Admission) -> Result<u64> {
        let base = chunk.index << self.res.geo.chunk_shift;
        let chunk_end = base + (1 << self.res.geo.chunk_shift); // exclusive
        let max = self.res.geo.max_fill_pages;
        let g = self.granule_pages();
        let at = |p: u64| &chunk.pages[(p - base) as usize];
        // The run wanted: from `first` on while empty, to `last` or (granule) the end of
        // the granule holding `last`; and back from `first` to its granule's start.
        // (Not past the last page: pages past the end are holes, nothing to read.)
        let eof = self.len().div_ceil(1 << self.ps());
        let end = if g > 1 { ((last | (g - 1)) + 1).min(chunk_end).min(eof.max(last + 1)) } else { last + 1 };
        let mut ahead = 0u64;
        while first + ahead < end && ahead < max && at(first + ahead).is_empty() {
            ahead += 1;
        }
        if ahead == 0 {
            return Ok(0);
        }
        let start = if g > 1 { (first & !(g - 1)).max(base) } else { first };
        #[cfg(feature = "testing")]
        crate::testing::reached(crate::testing::Point::FillPlanned);
        let mut behind = 0u64;
        while first - behind > start && ahead + behind < max && at(first - behind - 1).is_empty() {
            behind += 1;
        }
        // Memory first, pages second (Linux allocates a page before it adds it locked to
        // the page cache): reserving may reclaim, and reclaim may write back any file —
        // which it could not do while this thread held pages BUSY (`order.rs`: a pager
        // above could be waiting for them).
        self.charge(ahead + behind)?;
        let _pages = crate::order::hold(crate::order::Rank::page(self.depth()));
        if !at(first).try_lock_empty() {
            self.uncharge(ahead + behind);
            return Ok(0);
        }
        let mut n = 1u64;
        while n < ahead && at(first + n).try_lock_empty() {
            n += 1;
        }
        // Taking pages is never a wait (a try), so taking these after `first` cannot
        // deadlock with a filler going the other way.
        let mut b = 0u64;
        while b < behind && at(first - b - 1).try_lock_empty() {
            b += 1;
        }
        self.uncharge(ahead - n + behind - b);
        let lo = first - b;
        if let Err(e) = self.fill_locked(chunk, lo, b + n) {
            self.uncharge(b + n);
            (lo..first + n).for_each(|p| {
                at(p).release_empty();
            });
            return Err(e);
        }
        // Asked for: pinned for the caller; the rest of the granules: clean, as read-ahead.
        let asked = n.min(last + 1 - first);
        if b + n > asked {
            bump(&self.counters.mine().readahead_pages, b + n - asked);
        }
        if b > 0 {
            self.publish_filled(chunk, lo, b, Publish::Clean, Admission::ReadAhead, None);
        }
        self.publish_filled(chunk, first, asked, Publish::Pinned, admission, None);
        if n > asked {
            self.publish_filled(chunk, first + asked, n - asked, Publish::Clean, Admission::ReadAhead, None);
        }
        bump(&self.counters.mine().misses, asked);
        Ok(asked)
    }

    /// The pager's fill granule in pages (1: none; see `Pager::fill_granule`).
    pub(crate) fn granule_pages(&self) -> u64 {
        let g = self.pager.read().fill_granule();
        if g.is_power_of_two() { (g >> self.ps()).max(1) } else { 1 }
    }

    /// Read pages `first..first+n` of `chunk` from the pager into the cache.
    /// => caller holds those pages BUSY and has reserved budget for them.
    pub(crate) fn fill_locked(&self, chunk: &Chunk, first: u64, n: u64) -> Result<()> {
        if self.xip() {
            // The pages are the store's: nothing to read (see "Execute in place").
            return Ok(());
        }
        let offset = first << self.ps();
        // Read once, after the caller took the pages: a truncation that publishes a shorter
        // length later finds them BUSY and drops them after this fill; one that published it
        // before may have dropped this range before the pages were taken, and the store may
        // still hold the old bytes (it is truncated after the drop) — so whatever the pager
        // returns past this length is zeroed below. Without it a fill running into a
        // concurrent truncation cached old bytes past the new end, which a later growth
        // showed (`ubc-fsx --other`, seed 99: after a shrink and a growth, old bytes where
        // zeros belong).
        let len = self.len();
        let bytes = (n << self.ps()) as usize;
        let memfd = self.memory()?;
        let hugetlb = memfd.is_hugetlb();
        if hugetlb {
            // Pool pages are taken here, before the pager or a window touches them: a pool
            // emptied by another process is this fill's `ENOSPC`, not a SIGBUS (huge.rs).
            memfd.allocate(offset, bytes as u64)?;
        }
        if offset >= len {
            // Entirely past the end of the file: a hole, zero-filled by the memfd.
            return Ok(());
        }
        // Where the pager puts the bytes. A pager that reads with `O_DIRECT`, and a small
        // file (see `by_syscall`), fill this thread's page-aligned bounce buffer (made once,
        // reused), which is then `pwrite`n into the memfd. Read straight into the window,
        // the device's DMA needed the memfd's pages first: a fault per page, each a fresh
        // shmem page zeroed (`clear_page`) and pinned (`get_user_pages`) for the transfer,
        // and page-table entries that eviction must later zap on every CPU; a `pwrite`
        // allocates the page without zeroing it and maps nothing, and its copy costs less
        // (a one-thread C check on this host: 0.78–1.14 GB/s against 0.71–0.73 GB/s).
        thread_local! {
            static BOUNCE: std::cell::Cell<Option<AlignedBuf>> = const { std::cell::Cell::new(None) };
        }
        let direct = self.pager.read().io_mode() == crate::pager::IoMode::Direct;
        let mut bounce = None;
        // hugetlb pages are allocated already (above) and cannot be `pwrite`n: always the
        // window, where a direct read lands in one pinned huge page.
        let bounced = !hugetlb && (direct || self.by_syscall(chunk));
        let buf = if bounced {
            // Taken out while in use: a pager that reads through this cache re-enters here
            // on the same thread, and gets a buffer of its own.
            let fresh = || AlignedBuf::new(bytes, self.res.geo.page_size);
            let b = bounce.insert(BOUNCE.take().filter(|b| b.len() >= bytes).unwrap_or_else(fresh));
            &mut b.as_mut()[..bytes]
        } else {
            let at = self.window_at(chunk, memfd, offset)?;
            // SAFETY: the caller holds these pages BUSY, so no one else reads or writes these
            // bytes, and the window cannot be retired.
            unsafe { std::slice::from_raw_parts_mut(at, bytes) }
        };
        let sh = self.counters.mine();
        bump(&sh.get_calls, 1);
        let r = match self.call_pager(PagerOp::GetPages, offset, |p| p.get_pages(offset, buf)) {
            Ok(Fill::Data) => {
                bump(&sh.read_bytes, bytes as u64);
                if offset + bytes as u64 > len {
                    buf[(len - offset) as usize..].fill(0);
                }
                if bounced { memfd.write_at(buf, offset) } else { Ok(()) }
            }
            // Nothing stored there: the memfd's hole reads as zeros.
            Ok(Fill::Hole) => Ok(()),
            Err(e) => Err(e),
        };
        if r.is_err() {
            // The pager (or the `pwrite`) may have filled part of the memfd: free it.
            let _ = self.free_memory(offset, bytes as u64);
        }
        if let Some(b) = bounce {
            BOUNCE.set(Some(b));
        }
        r
    }

    /// Make filled BUSY pages valid (as `publish` says) and hand them to the replacement
    /// policy; `mark` puts the read-ahead trigger on one of them.
    pub(crate) fn publish_filled(
        &self,
        chunk: &Chunk,
        first: u64,
        n: u64,
        publish: Publish,
        admission: Admission,
        mark: Option<u64>,
    ) {
        let (dirty, pin) = (publish == Publish::Dirty, publish == Publish::Pinned);
        let base = chunk.index << self.res.geo.chunk_shift;
        // Into the policy before the pages become visible as valid, if its lock is free;
        // if the page daemon (or another fill) holds it, the pages are staged instead and
        // admitted by the next holder, after they are valid (`resources/policy.rs`: a fill
        // never sleeps on the lock that eviction holds). Their slots say "not in the policy"
        // meanwhile; the pages are still BUSY, so nobody else reads or sets them.
        // XIP pages are not the cache's to evict: the policy never hears of them (their slots
        // stay "not in the policy", and nothing is staged).
        let xip = self.xip();
        let staged = match if xip { None } else { self.res.policy.lock_or_stage() } {
            Some(mut pol) => {
                for p in first..first + n {
                    self.policy_admit(pol.as_mut(), chunk, p, admission);
                }
                false
            }
            None => {
                for p in first..first + n {
                    chunk.pages.slot_at((p - base) as usize).store(NO_SLOT, Relaxed);
                }
                !xip
            }
        };
        // Valid first, then mapped into every user mapping, held by a pin meanwhile (a page
        // reaches a user page table only while held: it cannot be evicted in between).
        // Mapped while still BUSY, a store through the mapping could land before the page is
        // valid; a scan (the flusher's harvest) finding it could not mark a page that is not
        // valid yet dirty and would re-protect it: the store would be lost. The contents are
        // final at `finish_fill`, so no mapping sees a half-made page either way. Resident
        // pages never trap, except the read-ahead marker, which `map_pages` leaves out.
        let svc = if self.nmaps.load(SeqCst) > 0 { self.res.maps.get() } else { None };
        let pins = u32::from(pin) + u32::from(svc.is_some());
        // Counted before they are valid (and dirty): from `finish_fill` on, an eviction or a
        // writeback may count them out (see `dirty`).
        self.resident.fetch_add(n, Relaxed);
        if dirty {
            self.publish_dirtied(n);
        }
        for p in first..first + n {
            chunk.pages[(p - base) as usize].finish_fill(Filled {
                dirty,
                pins,
                // Read ahead and not used yet; a page a reader asked for (pinned for it,
                // admitted as read-ahead's only for a `NoReuse` read) is used already.
                speculative: admission == Admission::ReadAhead && !pin,
                ra_mark: mark == Some(p),
            });
        }
        if staged {
            self.res.policy.stage(self.me.clone() as Weak<dyn crate::resources::AdmitStaged>, first, n, admission);
            #[cfg(feature = "testing")]
            crate::testing::reached(crate::testing::Point::FillStaged);
        }
        if let Some(svc) = svc {
            for m in self.maps.read().iter() {
                svc.map_pages(self, m, first, first + n, Holes::Skip);
            }
            self.unpin_run(chunk, first, n);
        }
    }

    // ---------------------------------------------------------------- read

    /// Pin a run of valid pages `first..=last` of `chunk`, filling the first one if needed.
    /// Returns the number pinned (at least 1). `req_last` is the last page of the whole read
    /// (for read-ahead decisions); `None` for accesses that get no read-ahead (windows).
    /// `pattern`: the reader's advice (`Advice::is_pattern`), which steers read-ahead and
    /// the admission of the pages it fills.
    pub(super) fn pin_run(
        &self,
        chunk: &Chunk,
        first: u64,
        last: u64,
        req_last: Option<u64>,
        pattern: Advice,
    ) -> Result<u64> {
        // No read-ahead for XIP pages: there is nothing to read.
        let req_last = req_last.filter(|_| pattern != Advice::Random && !self.xip());
        let sequential = pattern == Advice::Sequential;
        // A pin waits while the page is BUSY (a fill, perhaps a queued read-ahead job).
        crate::order::check_wait(crate::order::Rank::page(self.depth()));
        let base = chunk.index << self.res.geo.chunk_shift;
        let mut n = 0;
        loop {
            let p = first + n;
            if p > last {
                break;
            }
            match chunk.pages[(p - base) as usize].pin() {
                Pin::Pinned { ra_mark, first_use } => {
                    n += 1;
                    if first_use {
                        bump(&self.counters.cold().readahead_hits, 1);
                    }
                    if ra_mark && req_last.is_some() {
                        self.readahead_on_mark(p, sequential);
                    }
                }
                Pin::Invalid if n > 0 => break,
                Pin::Invalid => {
                    if let Some(rl) = req_last {
                        self.readahead_on_miss(p, rl, sequential);
                    }
                    let admit = if pattern == Advice::NoReuse { Admission::ReadAhead } else { Admission::Demand };
                    let got = self.fill_run(chunk, p, last, admit)?;
                    if got > 0 {
                        return Ok(got);
                    }
                    // Someone else is filling it; pin() will wait for them.
                }
            }
        }
        self.counters.hit(n);
        Ok(n)
    }

    pub(super) fn unpin_run(&self, chunk: &Chunk, first: u64, n: u64) {
        let base = chunk.index << self.res.geo.chunk_shift;
        for p in first..first + n {
            chunk.pages[(p - base) as usize].unpin();
        }
    }

    /// `read_at`: copy `buf.len()` bytes at `offset` (fewer at end of file), read-ahead and
    /// admission as `pattern` says (`Advice::Random`: no read-ahead).
    pub(crate) fn read(&self, buf: &mut [u8], offset: u64, pattern: Advice) -> Result<usize> {
        checked_end(offset, buf.len())?;
        let mut end = offset.saturating_add(buf.len() as u64).min(self.len());
        let ps = self.ps();
        let mut pos = offset;
        while pos < end {
            let page = pos >> ps;
            let (ci, _) = self.locate(page);
            let chunk = self.table.get_or_create(ci);
            let chunk_last = ((ci + 1) << self.res.geo.chunk_shift) - 1;
            let req_last = (end - 1) >> ps;
            let last = req_last.min(chunk_last);
            let n = self.pin_run(chunk, page, last, Some(req_last), pattern)?;
            // A truncation may have raced with us; pinned pages are stable, but do not
            // return bytes past the current end.
            end = end.min(self.len());
            let to = end.min((page + n) << ps);
            if pos < to {
                // Pages page..page+n are pinned: valid, not evicted.
                let dst = &mut buf[(pos - offset) as usize..(to - offset) as usize];
                if let Err(e) = self.copy_out(chunk, pos, dst) {
                    self.unpin_run(chunk, page, n);
                    return Err(e);
                }
            }
            self.unpin_run(chunk, page, n);
            pos = to.max(pos);
            if pos >= end {
                break;
            }
        }
        Ok((pos.max(offset) - offset) as usize)
    }

    /// Pin pages `first..=last` of `chunk`, filling those that are not resident. On an
    /// error none stays pinned.
    pub(crate) fn pin_pages(&self, chunk: &Chunk, first: u64, last: u64) -> Result<()> {
        let mut p = first;
        while p <= last {
            match self.pin_run(chunk, p, last, None, Advice::Normal) {
                Ok(n) => p += n,
                Err(e) => {
                    self.unpin_run(chunk, first, p - first);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    pub(crate) fn unpin_range(&self, chunk: &Chunk, first: u64, last: u64) {
        self.unpin_run(chunk, first, last + 1 - first);
    }
}

//! The page state word: the single authority on one cached page.
//!
//! Every cached page has one `AtomicU32`. All transitions are compare-and-swap on that word,
//! so the hit path takes no lock: a reader pins a valid page with one CAS and unpins it with
//! one atomic subtract. Threads that must wait (a page being filled, or under writeback
//! while they want to write) sleep on the word itself with a futex.
//!
//! ```text
//!  bits 0-1  ACCESS     accesses since the replacement policy last looked (saturates at 3)
//!  bit  2    VALID      contents are the file's data and may be read through a window
//!  bit  3    DIRTY      contents differ from the pager's copy
//!  bit  4    BUSY       exclusively owned: being filled, evicted or truncated; unreadable
//!  bit  5    WRITEBACK  contents are being written to the pager; readable, not writable
//!  bit  6    WRITING    a writer is copying into it; excludes writers, writeback, eviction
//!  bit  7    WAITERS    someone sleeps on this word; whoever changes it must wake them
//!  bit  8    RA_MARK    reaching this page triggers the next read-ahead (Linux PG_readahead)
//!  bit  9    SPECULATIVE filled by read-ahead and not used yet
//!  bits 16-31 PINS      short- and long-term readers (windows, copies in progress)
//! ```
//!
//! Life of a page (all other combinations are unreachable):
//!
//! ```text
//!  empty ──try_lock_empty──► BUSY ──finish_fill──► VALID ──lock_for_evict──► BUSY ──release_empty──► empty
//!                             │                    │  ▲
//!                             └──abort_fill──►empty │  └─ end_write (DIRTY) / end_writeback
//!                                                   └─ begin_write (WRITING) / begin_writeback (WRITEBACK)
//! ```
//!
//! Memory ordering: every transition is SeqCst. The window reclaimer relies on it (a
//! Dekker-style handshake between "pin the page, then read the window address" and "retire
//! the window address, then check for pins"; see `window.rs`).

use super::sync::{AtomicU32, wait, wake_all};
use std::sync::atomic::Ordering::SeqCst;

pub(super) const ACCESS_MASK: u32 = 0b11;
pub(super) const VALID: u32 = 1 << 2;
pub(super) const DIRTY: u32 = 1 << 3;
pub(super) const BUSY: u32 = 1 << 4;
pub(super) const WRITEBACK: u32 = 1 << 5;
pub(super) const WRITING: u32 = 1 << 6;
pub(super) const WAITERS: u32 = 1 << 7;
pub(super) const RA_MARK: u32 = 1 << 8;
pub(super) const SPECULATIVE: u32 = 1 << 9;
const PIN_SHIFT: u32 = 16;
const PIN_ONE: u32 = 1 << PIN_SHIFT;
const PIN_MAX: u32 = 0xffff;

/// What a reader found when it tried to pin a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pin {
    /// Pinned; `ra_mark` if the page carried the read-ahead trigger (now cleared),
    /// `first_use` if it was a speculative (read-ahead) page used for the first time.
    Pinned { ra_mark: bool, first_use: bool },
    /// Not valid: the caller must fill it (or wait for whoever is filling it).
    Invalid,
}

/// How a writer got a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteLock {
    /// The page is valid and now WRITING: copy into it, then `end_write`.
    Resident,
    /// The page was empty and is now BUSY: fill (or fully overwrite) it, then `finish_fill`.
    Empty,
}

/// One page's state word.
#[repr(transparent)]
#[derive(Default)]
pub(crate) struct PageState(AtomicU32);

impl PageState {
    /// An EMPTY page (no bits, no pins): what `Default` makes.
    pub(crate) const fn empty() -> PageState {
        PageState(AtomicU32::new(0))
    }
}

#[inline]
pub(crate) fn pins(s: u32) -> u32 {
    s >> PIN_SHIFT
}

/// How a filled page is published (`PageState::finish_fill`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Filled {
    /// A writer filled it: it is dirty from the start.
    pub(crate) dirty: bool,
    /// Pins handed to the caller (and to the mapping service while it maps the page).
    pub(crate) pins: u32,
    /// Read ahead, not asked for yet.
    pub(crate) speculative: bool,
    /// Carries the read-ahead trigger.
    pub(crate) ra_mark: bool,
}

/// What `PageState::begin_writeback` does with a page a writer or another writeback holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IfHeld {
    /// Sleep until it is free (`sync`, `clean`).
    Wait,
    /// Give up on it (background writeback, reclaim).
    Skip,
}

/// How a writeback ended (`PageState::end_writeback`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Written {
    /// The pager stored it: the page is clean unless written meanwhile.
    Stored,
    /// The pager failed: the page is dirty again.
    Failed,
}

/// A page's state word as read once, for decisions made outside `page/`: the bits and their
/// combinations are this module's business, callers ask what they mean.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Snapshot(u32);

impl Snapshot {
    /// Valid, or being filled (BUSY): something is or will be cached here.
    #[inline]
    pub(crate) fn cached(self) -> bool {
        self.0 & (VALID | BUSY) != 0
    }
    /// Valid contents.
    #[inline]
    pub(crate) fn valid(self) -> bool {
        self.0 & VALID != 0
    }
    /// Changed since it was last written back.
    #[inline]
    pub(crate) fn dirty(self) -> bool {
        self.0 & DIRTY != 0
    }
    /// Valid and not dirty.
    #[inline]
    pub(crate) fn clean(self) -> bool {
        self.0 & (VALID | DIRTY) == VALID
    }
    /// Dirty, or being written back: a writeback pass has something to do or wait for.
    #[inline]
    pub(crate) fn unclean(self) -> bool {
        self.0 & (DIRTY | WRITEBACK) != 0
    }
    /// Dirty and not being written back: a writeback would clean it.
    #[inline]
    pub(crate) fn writeback_due(self) -> bool {
        self.0 & (DIRTY | WRITEBACK) == DIRTY
    }
    /// Read ahead and not touched since.
    #[inline]
    pub(crate) fn speculative(self) -> bool {
        self.0 & SPECULATIVE != 0
    }
    /// Owned by one thread: being filled, or taken for eviction or truncation.
    #[inline]
    pub(crate) fn busy(self) -> bool {
        self.0 & BUSY != 0
    }
    /// Pinned, being filled, written or written back: its memory is in use.
    #[inline]
    pub(crate) fn held(self) -> bool {
        pins(self.0) > 0 || self.0 & (BUSY | WRITING | WRITEBACK) != 0
    }
}

impl Snapshot {
    /// The raw word (the randomized-schedule tests).
    #[cfg(all(test, feature = "shuttle"))]
    pub(super) fn bits(self) -> u32 {
        self.0
    }
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl PageState {
    #[inline]
    pub(crate) fn load(&self) -> u32 {
        self.0.load(SeqCst)
    }

    /// The state word now, for a decision outside `page/`.
    #[inline]
    pub(crate) fn snapshot(&self) -> Snapshot {
        Snapshot(self.load())
    }

    /// May be mapped into a user mapping: valid, and not carrying the read-ahead mark (its
    /// first touch through a mapping must trap, so that the fault handler queues the next
    /// window; whoever pins the page clears the mark).
    #[inline]
    pub(crate) fn is_mappable(&self) -> bool {
        self.load() & (VALID | RA_MARK) == VALID
    }

    /// Neither valid nor being filled.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.load() & (VALID | BUSY) == 0
    }

    /// Put the read-ahead trigger on a valid page (a window whose first page was cached).
    pub(crate) fn set_ra_mark(&self) {
        let mut s = self.load();
        while s & VALID != 0 && s & RA_MARK == 0 {
            match self.0.compare_exchange_weak(s, s | RA_MARK, SeqCst, SeqCst) {
                Ok(_) => return,
                Err(c) => s = c,
            }
        }
    }

    /// Sleep until `done(state)` holds. Sets WAITERS so the next transition wakes us.
    pub(crate) fn wait_until(&self, done: impl Fn(u32) -> bool) -> u32 {
        loop {
            let s = self.load();
            if done(s) {
                return s;
            }
            if s & WAITERS == 0 && self.0.compare_exchange(s, s | WAITERS, SeqCst, SeqCst).is_err() {
                continue;
            }
            // Whoever waits here checked the lock order first (`order::check_wait` with the
            // object's `Page` rank, at the call site: the word does not know its depth).
            wait(&self.0, s | WAITERS);
        }
    }

    /// Wake sleepers if the transition from `old` had any.
    #[inline]
    fn wake_if(&self, old: u32) {
        if old & WAITERS != 0 {
            self.0.fetch_and(!WAITERS, SeqCst);
            wake_all(&self.0);
        }
    }

    /// The cache-hit path: pin a valid page for reading and count the access.
    /// Waits while the page is BUSY (being filled or evicted).
    #[inline]
    pub(crate) fn pin(&self) -> Pin {
        let mut s = self.0.load(SeqCst);
        loop {
            if s & BUSY != 0 || pins(s) == PIN_MAX {
                s = self.wait_until(|s| s & BUSY == 0 && pins(s) < PIN_MAX);
                continue;
            }
            if s & VALID == 0 {
                return Pin::Invalid;
            }
            let first_use = s & SPECULATIVE != 0;
            // Every access counts, a read-ahead page's first use included: the replacement
            // policy knows which pages were admitted by read-ahead and discounts that use
            // (so a sequential scan through read-ahead pages does not look hot).
            let access = ((s & ACCESS_MASK) + 1).min(3);
            let new = ((s & !(ACCESS_MASK | RA_MARK | SPECULATIVE)) | access) + PIN_ONE;
            match self.0.compare_exchange_weak(s, new, SeqCst, SeqCst) {
                Ok(_) => return Pin::Pinned { ra_mark: s & RA_MARK != 0, first_use },
                Err(cur) => s = cur,
            }
        }
    }

    /// Drop one pin. => caller holds a pin.
    #[inline]
    pub(crate) fn unpin(&self) {
        let old = self.0.fetch_sub(PIN_ONE, SeqCst);
        debug_assert!(pins(old) > 0);
        self.wake_if(old);
    }

    /// Whether a writer is copying into the page (WRITING).
    #[inline]
    pub(crate) fn has_writer(&self) -> bool {
        self.load() & WRITING != 0
    }

    /// Sleep until no writer is copying into the page. => the caller pins it (a lent page:
    /// `Object::lend`) and checked the wait order.
    pub(crate) fn wait_no_writer(&self) {
        self.wait_until(|s| s & WRITING == 0);
    }

    /// Take an empty page for filling (BUSY). False if someone else has it or it is valid.
    #[inline]
    pub(crate) fn try_lock_empty(&self) -> bool {
        let s = self.0.load(SeqCst);
        s & (VALID | BUSY) == 0
            && pins(s) == 0
            && self.0.compare_exchange(s, (s & WAITERS) | BUSY, SeqCst, SeqCst).is_ok()
    }

    /// Publish a filled page: BUSY → VALID, as `how` says (dirty, pins, read-ahead flags).
    /// => caller holds the page BUSY; `how.pins` is small (0–2).
    pub(crate) fn finish_fill(&self, how: Filled) {
        let Filled { dirty, pins, speculative, ra_mark } = how;
        let mut new = VALID;
        if dirty {
            new |= DIRTY;
        }
        new += pins * PIN_ONE;
        if speculative {
            new |= SPECULATIVE;
        }
        if ra_mark {
            new |= RA_MARK;
        }
        let old = self.0.swap(new, SeqCst);
        debug_assert!(old & BUSY != 0 && old & VALID == 0, "finish_fill on {old:#x}");
        self.wake_if(old);
    }

    /// Give up a BUSY page: it becomes empty again (failed fill, eviction, truncation).
    /// => caller holds the page BUSY.
    /// Returns the prior state (DIRTY tells a caller dropping data whether a store found
    /// through a mapping dirtied it at the last moment).
    pub(crate) fn release_empty(&self) -> Snapshot {
        let old = self.0.swap(0, SeqCst);
        debug_assert!(old & BUSY != 0, "release_empty on {old:#x}");
        self.wake_if(old);
        Snapshot(old)
    }

    /// Take a valid, clean, unpinned, idle page for eviction (VALID|BUSY).
    pub(crate) fn try_lock_for_evict(&self) -> bool {
        let s = self.0.load(SeqCst);
        s & VALID != 0
            && s & (DIRTY | BUSY | WRITEBACK | WRITING) == 0
            && pins(s) == 0
            && self.0.compare_exchange(s, s | BUSY, SeqCst, SeqCst).is_ok()
    }

    /// Read and clear the access counter (for the replacement policy).
    pub(crate) fn take_accesses(&self) -> u8 {
        let old = self.0.fetch_and(!ACCESS_MASK, SeqCst);
        (old & ACCESS_MASK) as u8
    }

    /// A writer takes the page: a valid page becomes WRITING, an empty one BUSY. Waits while
    /// someone else fills, evicts, writes or writes back the page (stable pages: a page under
    /// writeback is not modified, so the pager sees one consistent version).
    pub(crate) fn begin_write(&self) -> WriteLock {
        loop {
            let s = self.wait_until(|s| s & (BUSY | WRITING | WRITEBACK) == 0);
            if s & VALID != 0 {
                if self.0.compare_exchange(s, s | WRITING, SeqCst, SeqCst).is_ok() {
                    return WriteLock::Resident;
                }
            } else if pins(s) == 0 && self.0.compare_exchange(s, (s & WAITERS) | BUSY, SeqCst, SeqCst).is_ok() {
                return WriteLock::Empty;
            }
        }
    }

    /// End a write begun with `WriteLock::Resident`: the page is DIRTY. Returns true if it
    /// was clean before (the caller counts a newly dirty page). => caller holds WRITING.
    pub(crate) fn end_write(&self) -> bool {
        let mut s = self.0.load(SeqCst);
        loop {
            debug_assert!(s & WRITING != 0);
            let new = (s & !(WRITING | WAITERS | SPECULATIVE | RA_MARK)) | DIRTY;
            match self.0.compare_exchange_weak(s, new, SeqCst, SeqCst) {
                Ok(_) => {
                    if s & WAITERS != 0 {
                        wake_all(&self.0);
                    }
                    return s & DIRTY == 0;
                }
                Err(cur) => s = cur,
            }
        }
    }

    /// Give up a write begun with `WriteLock::Resident` without having changed the page.
    /// => caller holds WRITING.
    pub(crate) fn abort_write(&self) {
        let old = self.0.fetch_and(!(WRITING | WAITERS), SeqCst);
        debug_assert!(old & WRITING != 0);
        if old & WAITERS != 0 {
            wake_all(&self.0);
        }
    }

    /// Start writing back a dirty page: DIRTY → WRITEBACK. With [`IfHeld::Wait`], sleeps
    /// while a writer or another writeback holds it; with `Skip`, gives up. False if the page
    /// is not dirty.
    pub(crate) fn begin_writeback(&self, if_held: IfHeld) -> bool {
        let wait = if_held == IfHeld::Wait;
        loop {
            let s = self.0.load(SeqCst);
            if s & VALID == 0 || s & DIRTY == 0 && s & WRITEBACK == 0 {
                return false;
            }
            if s & (BUSY | WRITING | WRITEBACK) != 0 {
                if !wait {
                    return false;
                }
                self.wait_until(|s| s & (BUSY | WRITING | WRITEBACK) == 0);
                continue;
            }
            if self.0.compare_exchange(s, (s & !DIRTY) | WRITEBACK, SeqCst, SeqCst).is_ok() {
                return true;
            }
        }
    }

    /// Finish a writeback. On failure the page is dirty again (nothing is dropped).
    /// => caller started the writeback.
    /// Returns whether the page was dirty again already (a store through a mapping was found
    /// while it was written): such a page was counted dirty anew when it was found, so on
    /// failure the caller must not count it a second time.
    pub(crate) fn end_writeback(&self, outcome: Written) -> bool {
        let ok = outcome == Written::Stored;
        let mut s = self.0.load(SeqCst);
        loop {
            debug_assert!(s & WRITEBACK != 0);
            let mut new = s & !(WRITEBACK | WAITERS);
            if !ok {
                new |= DIRTY;
            }
            match self.0.compare_exchange_weak(s, new, SeqCst, SeqCst) {
                Ok(_) => {
                    if s & WAITERS != 0 {
                        wake_all(&self.0);
                    }
                    return s & DIRTY != 0;
                }
                Err(cur) => s = cur,
            }
        }
    }

    /// Take a page for truncation or invalidation, whatever its state: waits until nobody
    /// pins, fills, writes or writes it back, then makes it BUSY. Returns the prior state.
    pub(crate) fn lock_for_drop(&self) -> Snapshot {
        loop {
            let s = self.wait_until(|s| s & (BUSY | WRITING | WRITEBACK) == 0 && pins(s) == 0);
            // Keep the other bits: the caller inspects VALID and DIRTY while it holds BUSY.
            if self.0.compare_exchange(s, s | BUSY, SeqCst, SeqCst).is_ok() {
                return Snapshot(s);
            }
        }
    }

    /// Set DIRTY on a valid page, whatever else holds it: a store found through a user
    /// mapping, or a writer holding WRITING. Returns whether this call set it (the caller
    /// counts one more dirty page). A page under WRITEBACK ends up dirty again.
    pub(crate) fn mark_dirty(&self) -> bool {
        let mut s = self.0.load(SeqCst);
        loop {
            if s & VALID == 0 || s & DIRTY != 0 {
                return false;
            }
            match self.0.compare_exchange_weak(s, s | DIRTY, SeqCst, SeqCst) {
                Ok(_) => return true,
                Err(cur) => s = cur,
            }
        }
    }

    /// Give back a page taken with `try_lock_for_evict` without evicting it (a store through
    /// a mapping was found): VALID stays, and DIRTY if it was set meanwhile.
    /// => caller holds the page BUSY from `try_lock_for_evict`.
    pub(crate) fn cancel_evict(&self) {
        let old = self.0.fetch_and(!(BUSY | WAITERS), SeqCst);
        debug_assert!(old & (BUSY | VALID) == BUSY | VALID, "cancel_evict on {old:#x}");
        if old & WAITERS != 0 {
            wake_all(&self.0);
        }
    }

    /// Clear the DIRTY bit of a page the caller holds BUSY (its data was dropped or is
    /// being dropped). Returns whether it was dirty.
    pub(crate) fn clear_dirty_locked(&self) -> bool {
        self.0.fetch_and(!DIRTY, SeqCst) & DIRTY != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn fill_pin_evict_cycle() {
        let p = PageState::default();
        assert_eq!(p.pin(), Pin::Invalid);
        assert!(p.try_lock_empty());
        assert!(!p.try_lock_empty(), "BUSY page cannot be taken twice");
        p.finish_fill(Filled { dirty: false, pins: 0, speculative: true, ra_mark: true });
        assert_eq!(p.pin(), Pin::Pinned { ra_mark: true, first_use: true });
        assert_eq!(p.take_accesses(), 1, "every use is reported; the policy discounts read-ahead");
        assert!(!p.try_lock_for_evict(), "pinned page is not evictable");
        p.unpin();
        assert_eq!(p.pin(), Pin::Pinned { ra_mark: false, first_use: false });
        p.unpin();
        assert_eq!(p.take_accesses(), 1);
        assert!(p.try_lock_for_evict());
        p.release_empty();
        assert_eq!(p.load() & (VALID | BUSY), 0);
    }

    #[test]
    fn dirty_pages_are_not_evictable_and_failed_writeback_redirties() {
        let p = PageState::default();
        assert!(p.try_lock_empty());
        p.finish_fill(Filled { dirty: true, pins: 0, speculative: false, ra_mark: false });
        assert!(!p.try_lock_for_evict());
        assert!(p.begin_writeback(IfHeld::Skip));
        assert!(!p.try_lock_for_evict(), "page under writeback is not evictable");
        p.end_writeback(Written::Failed);
        assert_ne!(p.load() & DIRTY, 0, "failed writeback keeps the page dirty");
        assert!(p.begin_writeback(IfHeld::Skip));
        p.end_writeback(Written::Stored);
        assert_eq!(p.load() & (DIRTY | WRITEBACK), 0);
        assert!(p.try_lock_for_evict());
    }

    #[test]
    fn writer_waits_for_writeback_then_redirties() {
        let p = Arc::new(PageState::default());
        assert!(p.try_lock_empty());
        p.finish_fill(Filled { dirty: true, pins: 0, speculative: false, ra_mark: false });
        assert!(p.begin_writeback(IfHeld::Skip));
        let p2 = p.clone();
        let t = std::thread::spawn(move || {
            assert_eq!(p2.begin_write(), WriteLock::Resident);
            assert!(p2.end_write(), "page was clean after writeback, now dirty again");
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(p.load() & WRITING, 0, "writer must not enter during writeback");
        p.end_writeback(Written::Stored);
        t.join().unwrap();
        assert_ne!(p.load() & DIRTY, 0);
    }

    #[test]
    fn concurrent_misses_one_filler() {
        // Many threads race for one empty page: exactly one fills, all read the valid page.
        for _ in 0..50 {
            let p = Arc::new(PageState::default());
            let fills = Arc::new(AtomicUsize::new(0));
            let threads: Vec<_> = (0..8)
                .map(|_| {
                    let (p, fills) = (p.clone(), fills.clone());
                    std::thread::spawn(move || {
                        loop {
                            match p.pin() {
                                Pin::Pinned { .. } => {
                                    p.unpin();
                                    return;
                                }
                                Pin::Invalid => {
                                    if p.try_lock_empty() {
                                        fills.fetch_add(1, SeqCst);
                                        std::thread::yield_now();
                                        p.finish_fill(Filled {
                                            dirty: false,
                                            pins: 0,
                                            speculative: false,
                                            ra_mark: false,
                                        });
                                    }
                                }
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(fills.load(SeqCst), 1);
        }
    }
}

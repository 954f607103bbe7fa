//! Write locks a pager put on ranges of its object (Mach's `pager_data_lock`, Tevanian et
//! al., "A Unix Interface for Shared Memory and Memory Mapped Files Under Mach", the pager
//! interface: "pager_data_lock … restricts cache access to the specified data"; a client's
//! access beyond the lock sends `pager_data_unlock` to the pager). The cache keeps and reads
//! locked pages; before it changes one it asks the pager (`Pager::unlock_request`) and, once
//! allowed, forgets the lock on what it asked for. `object/datalock.rs` applies them.
//!
//! One registry per cache, keyed by object id, as the loans are (`loans.rs`): a writer pays an
//! atomic load when no object of the cache is locked, and objects pay no memory for it.

use parking_lot::Mutex;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::*};

/// One `PagerRequest::lock`: pages of an object, numbered in the order locks were made. An
/// unlock request answered for the locks a change saw lifts only those
/// (`unlock_seen`): a lock made while the pager was answering stays.
struct Lock {
    obj: u64,
    pages: Range<u64>,
    generation: u64,
}

#[derive(Default)]
pub(crate) struct Locks {
    /// Locked ranges listed (all objects).
    active: AtomicU64,
    /// Locks listed, unordered; one object's may overlap (a newer lock over an older one).
    list: Mutex<Vec<Lock>>,
    /// The last lock's number.
    generation: AtomicU64,
    /// Unlock requests made of pagers, and refused (`CacheStats::unlock_requests`).
    pub(crate) requests: AtomicU64,
    pub(crate) refused: AtomicU64,
    /// Pages being mapped into shared writable mappings now, by epoch parity (an SRCU-like
    /// pair: `begin_writable_map`), and the epoch; lockers flip it one at a time.
    mapping: [AtomicU64; 2],
    epoch: AtomicU64,
    lockers: Mutex<()>,
}

impl Locks {
    /// Whether any range of any object is locked: the writers' fast path.
    #[inline]
    pub(crate) fn any(&self) -> bool {
        self.active.load(SeqCst) != 0
    }

    /// Lock pages `pages` of object `obj`.
    pub(crate) fn lock(&self, obj: u64, pages: Range<u64>) {
        if pages.is_empty() {
            return;
        }
        let mut list = self.list.lock();
        let generation = self.generation.fetch_add(1, Relaxed) + 1;
        // Older locks within the new one say nothing more.
        list.retain(|l| !(l.obj == obj && pages.start <= l.pages.start && l.pages.end <= pages.end));
        list.push(Lock { obj, pages, generation });
        self.active.store(list.len() as u64, SeqCst);
    }

    /// Unlock pages `pages` of object `obj`: of every lock if `seen` is `None` (the pager's
    /// own `unlock`), else of the locks numbered `seen` or lower (the ones a change asked
    /// about). Locked parts around `pages` stay locked.
    pub(crate) fn unlock(&self, obj: u64, pages: Range<u64>, seen: Option<u64>) {
        if !self.any() || pages.is_empty() {
            return;
        }
        let mut list = self.list.lock();
        let mut kept = Vec::with_capacity(list.len() + 1);
        for l in list.drain(..) {
            let older = seen.is_none_or(|g| l.generation <= g);
            if l.obj != obj || !older || l.pages.end <= pages.start || pages.end <= l.pages.start {
                kept.push(l);
                continue;
            }
            if l.pages.start < pages.start {
                kept.push(Lock { obj, pages: l.pages.start..pages.start, generation: l.generation });
            }
            if pages.end < l.pages.end {
                kept.push(Lock { obj, pages: pages.end..l.pages.end, generation: l.generation });
            }
        }
        *list = kept;
        self.active.store(list.len() as u64, SeqCst);
    }

    /// The locked pages of object `obj` within `pages`, as the smallest range covering them,
    /// and the newest lock's number among them (`None`: none is locked).
    pub(crate) fn locked(&self, obj: u64, pages: Range<u64>) -> Option<(Range<u64>, u64)> {
        if !self.any() {
            return None;
        }
        let list = self.list.lock();
        let mut hull: Option<(Range<u64>, u64)> = None;
        for l in list.iter().filter(|l| l.obj == obj && l.pages.start < pages.end && pages.start < l.pages.end) {
            let part = l.pages.start.max(pages.start)..l.pages.end.min(pages.end);
            hull = Some(match hull {
                Some((h, g)) => (h.start.min(part.start)..h.end.max(part.end), g.max(l.generation)),
                None => (part, l.generation),
            });
        }
        hull
    }

    /// Forget every lock of object `obj` (its id; it is being dropped).
    pub(crate) fn forget(&self, obj: u64) {
        if !self.any() {
            return;
        }
        let mut list = self.list.lock();
        list.retain(|l| l.obj != obj);
        self.active.store(list.len() as u64, SeqCst);
    }

    /// A thread is about to map pages into a shared writable mapping, having checked (or
    /// about to check) their locks: returns the token for `end_writable_map`.
    #[inline]
    pub(crate) fn begin_writable_map(&self) -> usize {
        let e = (self.epoch.load(SeqCst) & 1) as usize;
        self.mapping[e].fetch_add(1, SeqCst);
        e
    }

    #[inline]
    pub(crate) fn end_writable_map(&self, token: usize) {
        self.mapping[token].fetch_sub(1, SeqCst);
    }

    /// After a lock was registered: wait until every mapping of pages begun before it is
    /// done (those begun after see the lock). Lockers go one at a time, so one flip of the
    /// epoch suffices: readers of the other parity began after the previous locker's flip,
    /// which it waited for, or after this one's.
    pub(crate) fn wait_for_writable_maps(&self) {
        let _one = self.lockers.lock();
        let old = (self.epoch.fetch_add(1, SeqCst) & 1) as usize;
        let mut spins = 0u32;
        while self.mapping[old].load(SeqCst) != 0 {
            spins += 1;
            if spins < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// Pages locked now, over all objects (overlapping locks of one object counted once
    /// per lock: an upper bound).
    pub(crate) fn locked_pages(&self) -> u64 {
        self.list.lock().iter().map(|l| l.pages.end - l.pages.start).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locks_split_belong_to_their_object_and_outlive_older_answers() {
        let l = Locks::default();
        assert!(!l.any());
        l.lock(1, 10..20);
        l.lock(1, 20..25);
        l.lock(2, 0..100);
        assert_eq!(l.locked(1, 0..100).map(|x| x.0), Some(10..25));
        assert_eq!(l.locked(1, 0..10), None);
        assert_eq!(l.locked(1, 24..30).map(|x| x.0), Some(24..25));
        l.unlock(1, 12..14, None);
        assert_eq!(l.locked(1, 11..15).map(|x| x.0), Some(11..15), "the hull of 11..12 and 14..15");
        assert_eq!(l.locked(1, 12..14), None);
        // An answer to a request made before a newer lock lifts only the older locks.
        let (_, seen) = l.locked(1, 10..12).unwrap();
        l.lock(1, 10..11);
        l.unlock(1, 10..12, Some(seen));
        assert_eq!(l.locked(1, 10..12).map(|x| x.0), Some(10..11), "the newer lock stays");
        l.unlock(1, 0..1000, None);
        assert_eq!(l.locked(1, 0..1000), None);
        assert_eq!(l.locked(2, 50..51).map(|x| x.0), Some(50..51), "another object's lock stays");
        assert_eq!(l.locked_pages(), 100);
        l.forget(2);
        assert!(!l.any());
    }
}

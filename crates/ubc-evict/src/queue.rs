//! One queue of pages, each marked while it came in by read-ahead and is still unused: the
//! state CLOCK and SIEVE both keep (they differ only in how their hand walks it).

use crate::list::{Arena, List};
use crate::{Admission, PageKey, Slot};

/// Per-page state: only whether the page came in by read-ahead and is still unused.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Meta {
    readahead_unused: bool,
}

/// The pages in arrival order (front = oldest).
#[derive(Debug)]
pub(crate) struct MarkedQueue {
    arena: Arena<Meta>,
    list: List,
}

impl MarkedQueue {
    /// An empty queue sized for about `capacity_pages` pages.
    pub fn new(capacity_pages: usize) -> Self {
        MarkedQueue { arena: Arena::with_capacity(capacity_pages), list: List::new() }
    }

    /// Append a newly filled page at the back; returns its slot.
    pub fn insert(&mut self, key: PageKey, admission: Admission) -> Slot {
        let slot = self.arena.alloc(key, Meta { readahead_unused: admission == Admission::ReadAhead });
        self.arena.push_back(&mut self.list, slot);
        slot
    }

    /// Number of pages tracked.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// The oldest page's slot.
    pub fn front(&self) -> Option<u32> {
        self.list.front()
    }

    /// The slot after `slot` towards the back. Precondition: `slot` is linked.
    pub fn newer(&self, slot: u32) -> Option<u32> {
        self.arena.newer(slot)
    }

    /// Move the page in `slot` to the back. Precondition: `slot` is linked.
    pub fn move_to_back(&mut self, slot: u32) {
        self.arena.move_to_back(&mut self.list, slot);
    }

    /// Keys from oldest to newest (tests only).
    #[cfg(test)]
    pub fn keys(&self) -> Vec<PageKey> {
        self.arena.keys(&self.list)
    }

    /// True when `slot` is live and holds `key` (a slot handed back by the cache).
    pub fn holds(&self, slot: Slot, key: PageKey) -> bool {
        self.arena.holds(slot, key)
    }

    /// The key in `slot`. Precondition: `slot` is live.
    pub fn key(&self, slot: u32) -> PageKey {
        self.arena.get(slot).key
    }

    /// Drop the node in `slot` from the queue and the index. Precondition: `slot` is live.
    pub fn forget(&mut self, slot: u32) {
        self.arena.unlink(&mut self.list, slot);
        self.arena.free(slot);
    }

    /// Accesses that count as re-references: a read-ahead page's first access is the use it
    /// was read for, not a second one. Precondition: `slot` is live.
    pub fn absorb(&mut self, slot: u32, accesses: u8) -> u8 {
        let meta = &mut self.arena.get_mut(slot).data;
        if meta.readahead_unused && accesses > 0 {
            meta.readahead_unused = false;
            accesses - 1
        } else {
            accesses
        }
    }
}

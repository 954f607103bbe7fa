//! A hand-driven [`PageProbe`] for unit tests: pages can be touched, pinned and dropped.

use std::collections::HashMap;

use crate::{EvictAttempt, PageKey, PageProbe};

/// Shorthand for page `i` of object 0.
pub(crate) fn k(i: u64) -> PageKey {
    PageKey { object: 0, index: i }
}

/// Per-page state the test controls.
#[derive(Default, Clone, Copy, Debug)]
struct State {
    accesses: u8,
    pinned: bool,
}

/// A fake cache: resident pages with access counters and pins.
#[derive(Default, Debug)]
pub(crate) struct TestProbe {
    pages: HashMap<PageKey, State>,
}

impl TestProbe {
    /// Make `key` resident with no accesses.
    pub fn add(&mut self, key: PageKey) {
        self.pages.insert(key, State::default());
    }

    /// Record one hit on `key` (saturating at 3, like the cache's 2-bit counter).
    pub fn touch(&mut self, key: PageKey) {
        let s = self.pages.get_mut(&key).expect("touch of a non-resident page");
        s.accesses = (s.accesses + 1).min(3);
    }

    /// Make `key` unavailable for eviction.
    pub fn pin(&mut self, key: PageKey) {
        self.pages.get_mut(&key).expect("pin of a non-resident page").pinned = true;
    }

    /// Make `key` available for eviction again.
    pub fn unpin(&mut self, key: PageKey) {
        self.pages.get_mut(&key).expect("unpin of a non-resident page").pinned = false;
    }

    /// Drop `key` from the fake cache without telling the policy (a truncation race).
    pub fn drop_page(&mut self, key: PageKey) {
        self.pages.remove(&key);
    }
}

impl PageProbe for TestProbe {
    /// Return and clear the counter; `None` for non-resident pages.
    fn take_accesses(&mut self, key: PageKey) -> Option<u8> {
        self.pages.get_mut(&key).map(|s| std::mem::take(&mut s.accesses))
    }

    /// Taken (and dropped from the fake cache) unless pinned or absent.
    fn try_evict(&mut self, key: PageKey) -> EvictAttempt {
        match self.pages.get(&key) {
            None => EvictAttempt::Gone,
            Some(s) if s.pinned => EvictAttempt::Unavailable,
            Some(_) => {
                self.pages.remove(&key);
                EvictAttempt::Taken
            }
        }
    }
}

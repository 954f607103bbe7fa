//! Shared plumbing for the policies: an arena of nodes threaded on intrusive doubly linked
//! lists, and a fast hash for [`PageKey`]s.
//!
//! Every policy in this crate is a set of FIFO queues with "move to the back" and "unlink from
//! the middle" (for `remove`). Keeping the nodes in one `Vec` and linking them by `u32` slot
//! numbers makes all of those O(1) without `unsafe` and without per-node allocations; freed
//! slots are chained on a free list and reused, so memory is bounded by the high-water mark of
//! tracked pages, never by the number of operations. The policies keep no index from key to
//! slot: the cache keeps each page's slot next to the page's state (as Linux's `struct page`
//! carries its own LRU links) and hands it back with the key, which the arena checks.
//!
//! Orientation used by every list here: `front` is the oldest node (the next to leave),
//! `back` the newest. `older` links point towards the front, `newer` links towards the back.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

use crate::PageKey;

/// Sentinel slot number meaning "no node".
pub(crate) const NIL: u32 = u32::MAX;
/// The `older` link of a slot on the free list: tells a freed slot from a live one, so a
/// stale slot handed back by the cache is recognised (see [`Arena::holds`]).
const FREE: u32 = u32::MAX - 1;

/// A hasher for `PageKey` (two `u64` writes), much cheaper than SipHash.
///
/// Keys are page numbers, not attacker-chosen strings, and a lookup happens on every miss
/// (the simulator's resident set, S3-FIFO's ghost fingerprints), so a multiply-rotate mix
/// (FxHash style) plus a final avalanche is the right trade.
/// The final avalanche matters: hashbrown takes the bucket from the low bits and the tag from
/// the top 7 bits, and sequential page indexes would otherwise cluster.
#[derive(Default, Clone, Copy)]
pub(crate) struct KeyHasher {
    state: u64,
}

impl Hasher for KeyHasher {
    /// Mix one word into the state (the path `PageKey`'s derived `Hash` takes).
    #[inline]
    fn write_u64(&mut self, word: u64) {
        self.state = (self.state.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    /// Byte-wise fallback; unused by `PageKey` but required by the trait.
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    /// Finish with the murmur3/splitmix finaliser so every output bit depends on every input.
    #[inline]
    fn finish(&self) -> u64 {
        let mut z = self.state;
        z = (z ^ (z >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
        z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        z ^ (z >> 33)
    }
}

/// Map from page key to whatever a policy stores per key (usually an arena slot).
pub(crate) type KeyMap<V> = HashMap<PageKey, V, BuildHasherDefault<KeyHasher>>;

/// Create an empty [`KeyMap`] with room for `capacity` entries.
pub(crate) fn key_map<V>(capacity: usize) -> KeyMap<V> {
    HashMap::with_capacity_and_hasher(capacity, BuildHasherDefault::default())
}

/// A 64-bit hash of `key`: the one a [`KeyMap`] uses.
pub(crate) fn key_hash(key: PageKey) -> u64 {
    BuildHasherDefault::<KeyHasher>::default().hash_one(key)
}

/// One arena slot: the page key, its list links and the policy's per-page data.
#[derive(Clone, Debug)]
pub(crate) struct Node<T> {
    pub key: PageKey,
    older: u32,
    newer: u32,
    pub data: T,
}

/// Head, tail and length of one intrusive list living in an [`Arena`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct List {
    front: u32,
    back: u32,
    len: usize,
}

impl List {
    /// An empty list.
    pub const fn new() -> Self {
        List { front: NIL, back: NIL, len: 0 }
    }

    /// Number of nodes linked on this list (exact, maintained on every link/unlink).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the list has no nodes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Slot of the oldest node, if any.
    pub fn front(&self) -> Option<u32> {
        (self.front != NIL).then_some(self.front)
    }
}

/// Slab of nodes with a free list; the lists themselves are `List` values owned by the policy.
///
/// A node must be on exactly one list while allocated (or on none, transiently, between
/// `unlink` and the next `push_back`/`free`); the arena does not check which list a node is on,
/// so callers pass the right one — each policy records the queue in the node's data.
#[derive(Clone, Debug)]
pub(crate) struct Arena<T> {
    nodes: Vec<Node<T>>,
    /// Head of the chain of free slots (linked through `newer`).
    free: u32,
    live: usize,
}

impl<T> Arena<T> {
    /// An empty arena with room for `capacity` nodes before it reallocates.
    pub fn with_capacity(capacity: usize) -> Self {
        Arena { nodes: Vec::with_capacity(capacity), free: NIL, live: 0 }
    }

    /// Number of allocated (live) nodes.
    #[cfg(test)]
    pub fn live(&self) -> usize {
        self.live
    }

    /// Allocate a node for `key` (not yet on any list) and return its slot.
    pub fn alloc(&mut self, key: PageKey, data: T) -> u32 {
        self.live += 1;
        let node = Node { key, older: NIL, newer: NIL, data };
        if self.free != NIL {
            let slot = self.free;
            self.free = self.nodes[slot as usize].newer;
            self.nodes[slot as usize] = node;
            slot
        } else {
            let slot = u32::try_from(self.nodes.len()).expect("more than 2^32-2 tracked pages");
            assert!(slot < FREE, "more than 2^32-2 tracked pages");
            self.nodes.push(node);
            slot
        }
    }

    /// Return an unlinked slot to the free list. Precondition: `slot` is live and on no list.
    pub fn free(&mut self, slot: u32) {
        self.live -= 1;
        let node = &mut self.nodes[slot as usize];
        node.older = FREE;
        node.newer = self.free;
        self.free = slot;
    }

    /// True when `slot` is live and holds `key`: the check that makes a slot kept by the
    /// cache safe to hand back after the policy may have dropped (and reused) it.
    #[inline]
    pub fn holds(&self, slot: u32, key: PageKey) -> bool {
        self.nodes.get(slot as usize).is_some_and(|n| n.older != FREE && n.key == key)
    }

    /// The node in `slot`. Precondition: `slot` is live.
    #[inline]
    pub fn get(&self, slot: u32) -> &Node<T> {
        &self.nodes[slot as usize]
    }

    /// The node in `slot`, mutably. Precondition: `slot` is live.
    #[inline]
    pub fn get_mut(&mut self, slot: u32) -> &mut Node<T> {
        &mut self.nodes[slot as usize]
    }

    /// The next newer node after `slot` on its list, if any. Precondition: `slot` is linked.
    #[inline]
    pub fn newer(&self, slot: u32) -> Option<u32> {
        let n = self.nodes[slot as usize].newer;
        (n != NIL).then_some(n)
    }

    /// Link `slot` as the newest node of `list`. Precondition: `slot` is live and unlinked.
    pub fn push_back(&mut self, list: &mut List, slot: u32) {
        let old_back = list.back;
        {
            let node = &mut self.nodes[slot as usize];
            node.older = old_back;
            node.newer = NIL;
        }
        if old_back == NIL {
            list.front = slot;
        } else {
            self.nodes[old_back as usize].newer = slot;
        }
        list.back = slot;
        list.len += 1;
    }

    /// Unlink `slot` from `list`. Precondition: `slot` is currently linked on `list`.
    pub fn unlink(&mut self, list: &mut List, slot: u32) {
        let (older, newer) = {
            let node = &self.nodes[slot as usize];
            (node.older, node.newer)
        };
        if older == NIL {
            debug_assert_eq!(list.front, slot, "unlinking a node that is not on this list");
            list.front = newer;
        } else {
            self.nodes[older as usize].newer = newer;
        }
        if newer == NIL {
            debug_assert_eq!(list.back, slot, "unlinking a node that is not on this list");
            list.back = older;
        } else {
            self.nodes[newer as usize].older = older;
        }
        let node = &mut self.nodes[slot as usize];
        node.older = NIL;
        node.newer = NIL;
        list.len -= 1;
    }

    /// Move `slot` to the back (newest end) of `list`. Precondition: `slot` is on `list`.
    pub fn move_to_back(&mut self, list: &mut List, slot: u32) {
        if list.back != slot {
            self.unlink(list, slot);
            self.push_back(list, slot);
        }
    }

    /// Keys of `list` from oldest to newest (tests and debugging only; O(n)).
    #[cfg(test)]
    pub fn keys(&self, list: &List) -> Vec<PageKey> {
        let mut out = Vec::with_capacity(list.len);
        let mut cur = list.front;
        while cur != NIL {
            out.push(self.nodes[cur as usize].key);
            cur = self.nodes[cur as usize].newer;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shorthand for a key in object 0.
    fn k(i: u64) -> PageKey {
        PageKey { object: 0, index: i }
    }

    #[test]
    fn push_unlink_reuse() {
        let mut a: Arena<()> = Arena::with_capacity(4);
        let mut l = List::new();
        let s: Vec<u32> = (0..4).map(|i| a.alloc(k(i), ())).collect();
        for &x in &s {
            a.push_back(&mut l, x);
        }
        assert_eq!(a.keys(&l), vec![k(0), k(1), k(2), k(3)]);
        a.unlink(&mut l, s[1]);
        a.free(s[1]);
        a.move_to_back(&mut l, s[0]);
        assert_eq!(a.keys(&l), vec![k(2), k(3), k(0)]);
        assert_eq!(l.len(), 3);
        // The freed slot is reused rather than growing the arena.
        let again = a.alloc(k(9), ());
        assert_eq!(again, s[1]);
        assert_eq!(a.live(), 4);
        a.unlink(&mut l, s[2]);
        a.unlink(&mut l, s[3]);
        a.unlink(&mut l, s[0]);
        assert!(l.is_empty());
        assert_eq!(l.front(), None);
    }
}

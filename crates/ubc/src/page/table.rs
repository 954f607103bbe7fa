//! The per-object page table: a radix tree from chunk index to [`Chunk`].
//!
//! A chunk is the unit of window mapping (see `window.rs`): `pages_per_chunk` consecutive
//! pages whose state words live together, plus the address of the window that currently maps
//! them, if any. The tree grows in height on demand like Linux's xarray (64-way nodes), so a
//! small file costs one node and a sparse 1 TiB file costs a few nodes per populated chunk.
//!
//! Lookups take no lock: nodes and chunks are published with a CAS and are never freed
//! while the table lives, so a reference obtained from `get` stays valid for `&self`'s
//! lifetime. Memory is bounded by the number of chunks ever touched (two 4-byte words per
//! page — its state and its policy slot — plus ~70 bytes per chunk): 0.2% of the touched
//! file size with 4 KiB pages.

use super::state::PageState;
use parking_lot::Mutex;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicUsize, Ordering::*};

const SHIFT: u32 = 6;
const FANOUT: usize = 1 << SHIFT;

/// No window maps this chunk.
pub(crate) const WIN_NONE: usize = 0;
/// The window of this chunk is being retired (see `window.rs`).
pub(crate) const WIN_RETIRING: usize = 1;

/// The pages of one window-sized stretch of a file.
pub(crate) struct Chunk {
    /// Chunk index within the object (offset / window size).
    pub(crate) index: u64,
    pub(crate) pages: Box<[PageState]>,
    /// Where the replacement policy keeps each page ([`ubc_evict::Slot`], `NO_SLOT` when it
    /// does not): read and written only under the policy lock, so `Relaxed` suffices. The
    /// cache carries the slot as `struct page` carries its LRU links, so the policy needs no
    /// index from key to page.
    pub(crate) policy_slots: Box<[AtomicU32]>,
    /// Address of the window mapping these pages, or `WIN_NONE` / `WIN_RETIRING`.
    pub(crate) window: AtomicUsize,
    /// Slot of that window in the cache's window table.
    pub(crate) window_slot: AtomicU32,
    /// Window used since the window clock last looked.
    pub(crate) window_ref: AtomicBool,
    /// Copies made without a window (`Object::by_syscall`): past a few, the chunk is hot
    /// and gets one.
    pub(crate) cold_copies: AtomicU32,
}

impl Chunk {
    fn new(index: u64, pages: usize) -> Chunk {
        Chunk {
            index,
            pages: (0..pages).map(|_| PageState::default()).collect(),
            policy_slots: (0..pages).map(|_| AtomicU32::new(ubc_evict::NO_SLOT)).collect(),
            window: AtomicUsize::new(WIN_NONE),
            window_slot: AtomicU32::new(0),
            window_ref: AtomicBool::new(false),
            cold_copies: AtomicU32::new(0),
        }
    }
}

struct Node {
    /// Children: `Node`s above level 1, `Chunk`s at level 1.
    slots: [AtomicPtr<()>; FANOUT],
}

impl Node {
    fn new() -> *mut Node {
        Box::into_raw(Box::new(Node { slots: std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())) }))
    }
}

/// An immutable description of the tree's top: replaced as a whole when the tree grows.
struct Root {
    /// Level of `node`: it covers chunk indexes below 64^height.
    height: u32,
    node: *mut Node,
}

pub(crate) struct PageTable {
    root: AtomicPtr<Root>,
    pages_per_chunk: usize,
    /// Roots replaced by growth; readers may still hold them, so they live until drop.
    retired: Mutex<Vec<*mut Root>>,
}

// SAFETY: all shared state is reached through atomics; nodes, chunks and roots are only
// freed in `Drop`, which has exclusive access.
unsafe impl Send for PageTable {}
unsafe impl Sync for PageTable {}

impl PageTable {
    pub(crate) fn new(pages_per_chunk: usize) -> PageTable {
        let root = Box::into_raw(Box::new(Root { height: 1, node: Node::new() }));
        PageTable { root: AtomicPtr::new(root), pages_per_chunk, retired: Mutex::new(Vec::new()) }
    }

    fn root(&self) -> &Root {
        // SAFETY: roots are never freed before the table.
        unsafe { &*self.root.load(Acquire) }
    }

    /// The chunk with index `ci`, if it was ever created.
    #[inline]
    pub(crate) fn get(&self, ci: u64) -> Option<&Chunk> {
        let root = self.root();
        if root.height * SHIFT < 64 && ci >> (root.height * SHIFT) != 0 {
            return None;
        }
        let mut node = root.node;
        let mut level = root.height;
        loop {
            let slot = ((ci >> ((level - 1) * SHIFT)) as usize) & (FANOUT - 1);
            // SAFETY: `node` is a live node of this table.
            let child = unsafe { (*node).slots[slot].load(Acquire) };
            if child.is_null() {
                return None;
            }
            if level == 1 {
                // SAFETY: level-1 children are chunks, never freed before the table.
                return Some(unsafe { &*(child as *const Chunk) });
            }
            node = child as *mut Node;
            level -= 1;
        }
    }

    /// The chunk with index `ci`, created if needed.
    pub(crate) fn get_or_create(&self, ci: u64) -> &Chunk {
        if let Some(c) = self.get(ci) {
            return c;
        }
        self.grow_to(ci);
        let root = self.root();
        let mut node = root.node;
        let mut level = root.height;
        loop {
            let slot = ((ci >> ((level - 1) * SHIFT)) as usize) & (FANOUT - 1);
            // SAFETY: `node` is a live node of this table.
            let at = unsafe { &(*node).slots[slot] };
            let mut child = at.load(Acquire);
            if child.is_null() {
                let fresh: *mut () = if level == 1 {
                    Box::into_raw(Box::new(Chunk::new(ci, self.pages_per_chunk))) as *mut ()
                } else {
                    Node::new() as *mut ()
                };
                match at.compare_exchange(ptr::null_mut(), fresh, AcqRel, Acquire) {
                    Ok(_) => child = fresh,
                    Err(winner) => {
                        // SAFETY: `fresh` was never published.
                        unsafe { free_child(fresh, level) };
                        child = winner;
                    }
                }
            }
            if level == 1 {
                // SAFETY: as in `get`.
                return unsafe { &*(child as *const Chunk) };
            }
            node = child as *mut Node;
            level -= 1;
        }
    }

    /// Make the tree tall enough to hold chunk index `ci`.
    fn grow_to(&self, ci: u64) {
        loop {
            let cur = self.root.load(Acquire);
            // SAFETY: roots live until drop.
            let root = unsafe { &*cur };
            if root.height * SHIFT >= 64 || ci >> (root.height * SHIFT) == 0 {
                return;
            }
            let top = Node::new();
            // SAFETY: `top` is fresh and unshared.
            unsafe { (*top).slots[0].store(root.node as *mut (), Release) };
            let new = Box::into_raw(Box::new(Root { height: root.height + 1, node: top }));
            match self.root.compare_exchange(cur, new, AcqRel, Acquire) {
                Ok(_) => self.retired.lock().push(cur),
                Err(_) => {
                    // SAFETY: neither was published.
                    unsafe {
                        drop(Box::from_raw(top));
                        drop(Box::from_raw(new));
                    }
                }
            }
        }
    }

    /// Call `f` on every existing chunk with index in `from..to`, in ascending order.
    pub(crate) fn for_each(&self, from: u64, to: u64, mut f: impl FnMut(&Chunk)) {
        let root = self.root();
        visit(root.node, root.height, 0, from, to, &mut f);
    }
}

fn visit(node: *mut Node, level: u32, base: u64, from: u64, to: u64, f: &mut dyn FnMut(&Chunk)) {
    let span_shift = (level - 1) * SHIFT; // chunks covered by one slot = 1 << span_shift
    for slot in 0..FANOUT {
        let lo = base + ((slot as u64) << span_shift);
        let hi = lo.saturating_add(1u64 << span_shift);
        if hi <= from || lo >= to {
            continue;
        }
        // SAFETY: live node.
        let child = unsafe { (*node).slots[slot].load(Acquire) };
        if child.is_null() {
            continue;
        }
        if level == 1 {
            // SAFETY: level-1 children are chunks.
            f(unsafe { &*(child as *const Chunk) });
        } else {
            visit(child as *mut Node, level - 1, lo, from, to, f);
        }
    }
}

/// Free a subtree. => exclusive access.
unsafe fn free_child(child: *mut (), level: u32) {
    // SAFETY: `child` came from `Box::into_raw` of a `Chunk` (level 1) or a `Node` (above),
    // as the tree stores them, and the caller's exclusive access means nothing else frees or
    // reads it.
    unsafe {
        if level == 1 {
            drop(Box::from_raw(child as *mut Chunk));
        } else {
            let node = Box::from_raw(child as *mut Node);
            for s in &node.slots {
                let c = s.load(Relaxed);
                if !c.is_null() {
                    free_child(c, level - 1);
                }
            }
        }
    }
}

impl Drop for PageTable {
    fn drop(&mut self) {
        let root = self.root.load(Relaxed);
        // SAFETY: exclusive access in drop; retired roots share nodes with the live root, so
        // only the Root descriptors are freed for them.
        unsafe {
            let r = Box::from_raw(root);
            free_child(r.node as *mut (), r.height + 1);
            for old in self.retired.get_mut().drain(..) {
                drop(Box::from_raw(old));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_indexes_and_growth() {
        let t = PageTable::new(4);
        assert!(t.get(0).is_none());
        let ids = [0u64, 1, 63, 64, 4095, 1 << 20, (1 << 42) + 5, u64::MAX >> 21];
        for &i in &ids {
            let c = t.get_or_create(i);
            assert_eq!(c.index, i);
            assert_eq!(c.pages.len(), 4);
        }
        for &i in &ids {
            assert_eq!(t.get(i).unwrap().index, i);
        }
        assert!(t.get(2).is_none());
        let mut seen = vec![];
        t.for_each(0, u64::MAX, |c| seen.push(c.index));
        assert_eq!(seen, ids);
        let mut some = vec![];
        t.for_each(64, 1 << 21, |c| some.push(c.index));
        assert_eq!(some, vec![64, 4095, 1 << 20]);
    }

    #[test]
    fn concurrent_create_returns_one_chunk() {
        let t = std::sync::Arc::new(PageTable::new(8));
        let hs: Vec<_> = (0..4)
            .map(|k| {
                let t = t.clone();
                std::thread::spawn(move || {
                    let mut seen = std::collections::HashMap::new();
                    for i in 0..2000u64 {
                        let ci = (i * 7919 + k) % 3000;
                        seen.insert(ci, t.get_or_create(ci) as *const Chunk as usize);
                    }
                    seen
                })
            })
            .collect();
        // Every thread that asked for a chunk got the one the table keeps.
        for h in hs {
            for (ci, chunk) in h.join().unwrap() {
                assert_eq!(t.get(ci).map(|c| c as *const Chunk as usize), Some(chunk), "chunk {ci}");
            }
        }
        let mut n = 0;
        t.for_each(0, u64::MAX, |_| n += 1);
        assert_eq!(n, 3000);
    }
}

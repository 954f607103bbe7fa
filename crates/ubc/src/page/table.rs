//! The per-object page table: a radix tree from chunk index to [`Chunk`].
//!
//! A chunk is the unit of window mapping (see `window.rs`): `pages_per_chunk` consecutive
//! pages whose state words live together, plus the address of the window that currently maps
//! them, if any. The tree grows in height on demand like Linux's xarray (64-way nodes), so a
//! small file costs one node and a sparse 1 TiB file costs a few nodes per populated chunk.
//!
//! Lookups take no lock: nodes and chunks are published with a CAS and are never freed
//! while the table lives, so a reference obtained from `get` stays valid for `&self`'s
//! lifetime. Memory is bounded by the groups of pages ever taken (two 4-byte words per
//! page — its state and its policy slot — in groups of 32, see [`Pages`]) plus ~200 bytes
//! per chunk: 0.2% of the touched file size with 4 KiB pages.

use super::state::PageState;
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
    /// Each page's state word and policy slot, in groups made on first use.
    pub(crate) pages: Pages,
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
            pages: Pages::new(pages),
            window: AtomicUsize::new(WIN_NONE),
            window_slot: AtomicU32::new(0),
            window_ref: AtomicBool::new(false),
            cold_copies: AtomicU32::new(0),
        }
    }
}

/// Pages per group of state words allocated together, past the chunk's first 32 pages.
const GROUP: usize = 32;
/// The chunk's first group is smaller (`HEAD` pages, then `GROUP - HEAD` in the second): a
/// file of a page or two is most cached files, and a 32-page group is 256 bytes.
const HEAD: usize = 8;

/// The state words and policy slots of `N` consecutive pages (8 bytes a page).
struct Group<const N: usize> {
    states: [PageState; N],
    /// Where the replacement policy keeps each page ([`ubc_evict::Slot`], `NO_SLOT` when it
    /// does not): read and written only under the policy lock, so `Relaxed` suffices. The
    /// cache carries the slot as `struct page` carries its LRU links, so the policy needs no
    /// index from key to page.
    slots: [AtomicU32; N],
}

impl<const N: usize> Group<N> {
    /// The group `p` points to, if it was made.
    #[inline]
    fn loaded(p: &AtomicPtr<Group<N>>) -> Option<&Group<N>> {
        let g = p.load(Acquire);
        // SAFETY: published groups live until the chunk is dropped.
        (!g.is_null()).then(|| unsafe { &*g })
    }

    /// A group of EMPTY pages with no slots.
    fn empty() -> Group<N> {
        Group {
            states: std::array::from_fn(|_| PageState::default()),
            slots: std::array::from_fn(|_| AtomicU32::new(ubc_evict::NO_SLOT)),
        }
    }

    /// The group `p` points to, made if it was not (concurrent makers agree on one).
    #[cold]
    fn made(p: &AtomicPtr<Group<N>>) -> &Group<N> {
        let fresh = Box::into_raw(Box::new(Group::<N>::empty()));
        let g = match p.compare_exchange(ptr::null_mut(), fresh, AcqRel, Acquire) {
            Ok(_) => fresh,
            Err(winner) => {
                // SAFETY: `fresh` was never published.
                unsafe { drop(Box::from_raw(fresh)) };
                winner
            }
        };
        // SAFETY: as in `loaded`.
        unsafe { &*g }
    }

    /// Free the group `p` points to, if any. Precondition: exclusive access (drop).
    fn free(p: &mut AtomicPtr<Group<N>>) {
        let g = *p.get_mut();
        if !g.is_null() {
            // SAFETY: exclusive access; published groups came from Box::into_raw.
            unsafe { drop(Box::from_raw(g)) };
        }
    }

    /// Whether `f` holds for one of the group's pages.
    fn any(p: &AtomicPtr<Group<N>>, f: &mut impl FnMut(&PageState) -> bool) -> bool {
        Self::loaded(p).is_some_and(|g| g.states.iter().any(f))
    }
}

/// A chunk's pages: state words and policy slots in groups (of 8 and 24 pages for its first
/// 32 pages, of 32 past them). The first group is part of the chunk; the others are each
/// allocated when one of their pages is first taken (filled, written, reserved). A page of a
/// group never made is EMPTY with no slot. Before, every chunk touched carried words for
/// all its pages (512 with 2 MiB windows: 4 KiB), so a cached 4 KiB file cost 4 KiB of
/// page table; then 128 bytes of group pointers and a 256-byte group; then a 64-byte chunk
/// and a 64-byte group, two allocations (160 bytes of heap with malloc's headers); now one
/// 120-byte chunk holding its first 8 pages' words (128 bytes of heap). The pointer to the
/// second group is in the chunk; the array of the others', 120 bytes with 2 MiB windows, is
/// made with the first of them. Groups are never freed before the chunk, so a reference to
/// a state word stays valid like the chunk itself.
pub(crate) struct Pages {
    /// Pages `0..HEAD` (words past `len` unused).
    head: Group<HEAD>,
    /// Pages `HEAD..GROUP`.
    second: AtomicPtr<Group<{ GROUP - HEAD }>>,
    /// Pointers to the groups of 32 pages from page `GROUP` on (`rest_len()` of them), made
    /// when the first of those groups is (null before); never freed before the chunk.
    rest: AtomicPtr<AtomicPtr<Group<GROUP>>>,
    len: usize,
}

/// The state of a page whose group was never made (read through `Pages::snapshot`).
static NEVER_TAKEN: PageState = PageState::empty();

impl Pages {
    fn new(len: usize) -> Pages {
        Pages {
            head: Group::empty(),
            second: AtomicPtr::new(ptr::null_mut()),
            rest: AtomicPtr::new(ptr::null_mut()),
            len,
        }
    }

    /// Groups of 32 from page `GROUP` on (the length of `rest` once made).
    fn rest_len(&self) -> usize {
        self.len.saturating_sub(GROUP).div_ceil(GROUP)
    }

    /// The pointer to rest group `gi`, or `None` if `rest` is not made.
    #[inline]
    fn rest_slot(&self, gi: usize) -> Option<&AtomicPtr<Group<GROUP>>> {
        let r = self.rest.load(Acquire);
        debug_assert!(gi < self.rest_len());
        // SAFETY: a published `rest` holds `rest_len()` pointers and lives until drop.
        (!r.is_null()).then(|| unsafe { &*r.add(gi) })
    }

    /// The pointer to rest group `gi`, `rest` made if needed.
    #[cold]
    fn rest_slot_made(&self, gi: usize) -> &AtomicPtr<Group<GROUP>> {
        if let Some(s) = self.rest_slot(gi) {
            return s;
        }
        let fresh: Box<[AtomicPtr<Group<GROUP>>]> =
            (0..self.rest_len()).map(|_| AtomicPtr::new(ptr::null_mut())).collect();
        let fresh = Box::into_raw(fresh) as *mut AtomicPtr<Group<GROUP>>;
        if let Err(_winner) = self.rest.compare_exchange(ptr::null_mut(), fresh, AcqRel, Acquire) {
            // SAFETY: `fresh` was never published; it came from a boxed slice of this length.
            unsafe { drop(Box::from_raw(ptr::slice_from_raw_parts_mut(fresh, self.rest_len()))) };
        }
        self.rest_slot(gi).expect("rest made")
    }

    /// The rest groups' pointers made so far (none before `rest` is).
    fn rest_slots(&self) -> impl Iterator<Item = &AtomicPtr<Group<GROUP>>> {
        (0..self.rest_len()).map_while(|gi| self.rest_slot(gi))
    }

    /// Pages in the chunk (for tests: scans stop at `made_end`).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    /// One past the last page whose group is made: the pages from there on are EMPTY, and
    /// a scan of the chunk stops there (a one-page file's chunk has 512 slots; looking at
    /// each was a visible share of creating and dropping a small file). A group made after
    /// this is read is one a scan reaching it a little later could have found absent too.
    pub(crate) fn made_end(&self) -> usize {
        if !self.rest.load(Acquire).is_null() {
            self.len
        } else if Group::loaded(&self.second).is_some() {
            self.len.min(GROUP)
        } else {
            self.len.min(HEAD)
        }
    }

    /// Page `i`'s state word and policy slot; its group made if `make`, else `None` when
    /// the group was never made.
    #[inline]
    fn words(&self, i: usize, make: bool) -> Option<(&PageState, &AtomicU32)> {
        assert!(i < self.len, "page {i} of a chunk of {}", self.len);
        if i < HEAD {
            return Some((&self.head.states[i], &self.head.slots[i]));
        }
        if i < GROUP {
            let (g, o) = (&self.second, i - HEAD);
            let g = if make { Group::loaded(g).unwrap_or_else(|| Group::made(g)) } else { Group::loaded(g)? };
            return Some((&g.states[o], &g.slots[o]));
        }
        let (gi, o) = ((i - GROUP) / GROUP, (i - GROUP) % GROUP);
        let g = if make {
            let p = match self.rest_slot(gi) {
                Some(p) => p,
                None => self.rest_slot_made(gi),
            };
            Group::loaded(p).unwrap_or_else(|| Group::made(p))
        } else {
            Group::loaded(self.rest_slot(gi)?)?
        };
        Some((&g.states[o], &g.slots[o]))
    }

    /// Page `i`'s state word, its group made if needed: for whoever may take the page.
    #[inline]
    pub(crate) fn at(&self, i: usize) -> &PageState {
        self.words(i, true).expect("made").0
    }

    /// Page `i`'s state word if its group exists (else the page is EMPTY): for scans, which
    /// must not make groups.
    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<&PageState> {
        self.words(i, false).map(|w| w.0)
    }

    /// Page `i`'s state now (EMPTY if its group was never made).
    #[inline]
    pub(crate) fn snapshot(&self, i: usize) -> super::state::Snapshot {
        self.get(i).unwrap_or(&NEVER_TAKEN).snapshot()
    }

    /// Page `i`'s policy slot, its group made if needed.
    pub(crate) fn slot_at(&self, i: usize) -> &AtomicU32 {
        self.words(i, true).expect("made").1
    }

    /// Whether `f` holds for a page of a group that exists.
    pub(crate) fn any(&self, mut f: impl FnMut(&PageState) -> bool) -> bool {
        self.head.states[..self.len.min(HEAD)].iter().any(&mut f)
            || Group::any(&self.second, &mut f)
            || self.rest_slots().any(|p| Group::any(p, &mut f))
    }

    /// Groups made so far (for tests).
    #[cfg(test)]
    fn groups_made(&self) -> usize {
        1 + usize::from(Group::loaded(&self.second).is_some())
            + self.rest_slots().filter(|p| Group::loaded(p).is_some()).count()
    }
}

impl std::ops::Index<usize> for Pages {
    type Output = PageState;

    /// Page `i`'s state word, its group made if needed (`Pages::at`).
    #[inline]
    fn index(&self, i: usize) -> &PageState {
        self.at(i)
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        Group::free(&mut self.second);
        let r = *self.rest.get_mut();
        if !r.is_null() {
            // SAFETY: exclusive access; `rest` came from a boxed slice of `rest_len()` pointers.
            let mut rest = unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(r, self.rest_len())) };
            for p in rest.iter_mut() {
                Group::free(p);
            }
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
    /// The root this one replaced (null for the first): readers may still hold it, so the
    /// replaced roots live, chained here, until the table is dropped.
    prev: *mut Root,
}

pub(crate) struct PageTable {
    /// Chunk 0, kept apart from the tree: most files are one chunk (2 MiB with the default
    /// window), and for them the tree's 64-way root node (512 bytes) was most of the table.
    first: AtomicPtr<Chunk>,
    /// The tree of the other chunks, made when the first of them is (null before). Its slot
    /// for chunk 0 stays empty.
    root: AtomicPtr<Root>,
    pages_per_chunk: usize,
}

// SAFETY: all shared state is reached through atomics; nodes, chunks and roots are only
// freed in `Drop`, which has exclusive access.
unsafe impl Send for PageTable {}
unsafe impl Sync for PageTable {}

impl PageTable {
    pub(crate) fn new(pages_per_chunk: usize) -> PageTable {
        PageTable { first: AtomicPtr::new(ptr::null_mut()), root: AtomicPtr::new(ptr::null_mut()), pages_per_chunk }
    }

    fn root(&self) -> Option<&Root> {
        let r = self.root.load(Acquire);
        // SAFETY: roots are never freed before the table.
        (!r.is_null()).then(|| unsafe { &*r })
    }

    /// The chunk with index `ci`, if it was ever created.
    #[inline]
    pub(crate) fn get(&self, ci: u64) -> Option<&Chunk> {
        if ci == 0 {
            let c = self.first.load(Acquire);
            // SAFETY: chunks are never freed before the table.
            return (!c.is_null()).then(|| unsafe { &*c });
        }
        let root = self.root()?;
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
        if ci == 0 {
            let fresh = Box::into_raw(Box::new(Chunk::new(0, self.pages_per_chunk)));
            let c = match self.first.compare_exchange(ptr::null_mut(), fresh, AcqRel, Acquire) {
                Ok(_) => fresh,
                Err(winner) => {
                    // SAFETY: `fresh` was never published.
                    unsafe { drop(Box::from_raw(fresh)) };
                    winner
                }
            };
            // SAFETY: as in `get`.
            return unsafe { &*c };
        }
        if self.root.load(Acquire).is_null() {
            let fresh = Box::into_raw(Box::new(Root { height: 1, node: Node::new(), prev: ptr::null_mut() }));
            if self.root.compare_exchange(ptr::null_mut(), fresh, AcqRel, Acquire).is_err() {
                // SAFETY: neither was published.
                unsafe {
                    drop(Box::from_raw((*fresh).node));
                    drop(Box::from_raw(fresh));
                }
            }
        }
        self.grow_to(ci);
        let root = self.root().expect("made above");
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
    /// => the tree exists (`root` is not null).
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
            let new = Box::into_raw(Box::new(Root { height: root.height + 1, node: top, prev: cur }));
            match self.root.compare_exchange(cur, new, AcqRel, Acquire) {
                Ok(_) => {}
                Err(_) => {
                    // SAFETY: neither was published (`new.prev` is not ours to free).
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
        if from == 0
            && to > 0
            && let Some(c) = self.get(0)
        {
            f(c);
        }
        if let Some(root) = self.root() {
            visit(root.node, root.height, 0, from.max(1), to, &mut f);
        }
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
        let first = self.first.load(Relaxed);
        if !first.is_null() {
            // SAFETY: exclusive access in drop; published by `get_or_create` from a Box.
            unsafe { drop(Box::from_raw(first)) };
        }
        let root = self.root.load(Relaxed);
        if root.is_null() {
            return;
        }
        // SAFETY: exclusive access in drop; replaced roots share nodes with the live root, so
        // only the Root descriptors are freed for them.
        unsafe {
            let r = Box::from_raw(root);
            free_child(r.node as *mut (), r.height + 1);
            let mut old = r.prev;
            while !old.is_null() {
                let o = Box::from_raw(old);
                old = o.prev;
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
    fn page_groups_are_made_on_first_take_only() {
        let t = PageTable::new(512);
        let c = t.get_or_create(0);
        assert_eq!(c.pages.groups_made(), 1, "the first 8 pages' words are the chunk's");
        // The first 32 pages come in groups of 8 and 24.
        let small = PageTable::new(512);
        let s = small.get_or_create(0);
        assert!(s.pages.at(0).try_lock_empty());
        assert_eq!(s.pages.groups_made(), 1);
        assert!(s.pages.get(7).is_some() && s.pages.get(8).is_none());
        s.pages.slot_at(31).store(3, Relaxed);
        assert_eq!(s.pages.groups_made(), 2);
        assert!(s.pages.get(8).is_some() && s.pages.get(32).is_none());
        assert_eq!(s.pages.slot_at(31).load(Relaxed), 3);
        assert_eq!(s.pages.slot_at(30).load(Relaxed), ubc_evict::NO_SLOT);
        assert!(s.pages.any(|p| p.snapshot().held()));
        // Scans make nothing; an absent page reads EMPTY.
        assert!(c.pages.get(100).is_none());
        assert!(!c.pages.snapshot(511).cached());
        assert!(!c.pages.any(|p| !p.is_empty()));
        // A take makes its group only.
        assert!(c.pages.at(33).try_lock_empty());
        assert_eq!(c.pages.groups_made(), 2);
        assert!(c.pages.get(32).is_some() && c.pages.get(64).is_none());
        assert!(c.pages.snapshot(33).held());
        assert!(c.pages.any(|p| p.snapshot().held()));
        c.pages.slot_at(511).store(7, Relaxed);
        assert_eq!(c.pages.groups_made(), 3);
        assert_eq!(c.pages.slot_at(510).load(Relaxed), ubc_evict::NO_SLOT);
        // Concurrent first takes of one group agree on it.
        let t = std::sync::Arc::new(PageTable::new(512));
        let hs: Vec<_> = (0..4)
            .map(|k| {
                let t = t.clone();
                std::thread::spawn(move || t.get_or_create(0).pages.at(200 + k) as *const PageState as usize)
            })
            .collect();
        let addrs: Vec<usize> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        for (k, a) in addrs.iter().enumerate() {
            assert_eq!(*a, t.get(0).unwrap().pages.get(200 + k).unwrap() as *const PageState as usize);
        }
        assert_eq!(t.get(0).unwrap().pages.groups_made(), 2);
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

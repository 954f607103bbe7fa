//! The lock and wait order of the whole stack, and its checker.
//!
//! A layered file is a chain of cache objects, each with a pager *depth*: a host file's is
//! 0, and a layer's pager (compression, encryption) over a file of depth `d` has `d + 1`.
//! A pager only ever reaches *down* (it reads and writes its lower file), never up and never
//! sideways into its own object. Everything a thread can hold or wait for therefore gets a
//! [`Rank`]: depth first, higher depths first, and within one depth a [`Level`]:
//!
//! ```text
//!   Append                    a file's append mutex (ubc-stack `File::append`): taken
//!                             first, held around one length read and write; nothing
//!                             below ever takes it
//!   Stack                     cache-manager file lock and range tokens (ubc-stack)
//!   ── depth D (top) ──
//!   Size(D)                   Object::size_lock (truncate vs. writers: Linux's i_rwsem)
//!   Page(D)                   holding or waiting for pages of an object of depth D
//!                             (BUSY fill/evict/drop, WRITING, WRITEBACK, pin of a BUSY page)
//!   Io(D)                     waiting for I/O jobs of depth D (a writeback batch)
//!   Pager(D)                  inside D's pager: the layer's own locks (aead state, zstd index)
//!   ── depth D-1 ──
//!   Size(D-1) … Pager(D-1)
//!   …
//!   ── depth 0 ──             host files: their pager waits for nothing in the cache
//! ```
//!
//! **The rule**: a thread acquires or waits for ranks in strictly increasing order, except
//! that `Page` and `Pager` may repeat at the same rank (a writer couples pages of one object
//! in ascending order; a layer nests its scopes). Consequences, each used by the code:
//!
//! * A pager call of depth `d` may wait for pages of depth `< d` only — never for its own
//!   object's pages, nor for a page of a layer above (which may be waiting for it).
//! * Whoever holds pages of depth `d` may call pagers (fill, write back, reclaim by writeback)
//!   of depth `<= d` only: a pager above could wait for the very pages held. Reclaim and the
//!   dirty throttle's self-help ask [`may_call_pager`] and skip other files.
//! * I/O jobs run in one pool per depth (`io.rs`). A job of depth `d` waits only for ranks
//!   below `Pager(d)`, i.e. for work of depth `< d`; the pool of depth 0 waits for nothing
//!   in the cache. By induction on depth every job finishes with a fixed number of threads:
//!   no job ever waits for a job of its own pool.
//! * The two budget waits — memory (`Resources::reserve`) and dirty pages
//!   (`Resources::reserve_dirty`) — are bounded polls, not ranks: they never sleep longer than
//!   their deadline, and what they do to make progress themselves (reclaim, writeback) obeys
//!   the rule above. A writer inside a pager call is never throttled (`PagerScope`).
//!
//! Leaf mutexes are not ranked: held for a lookup or an update, with nothing acquired or
//! waited for under them, they cannot close a cycle. Such are an object's read-ahead stream
//! table (`Object::ra_streams`: taken on a miss or a marked page, released before any
//! read-ahead is queued, reserved or reclaimed) and the wake-up mutexes.
//!
//! In debug builds (tests) every acquisition and wait is checked against a per-thread stack
//! of held ranks, and an out-of-order one panics with both ranks: the checker turns a
//! deadlock that needs an unlucky schedule into a failure on the first run that takes the
//! wrong order. Release builds keep the stack too (a short vector per thread), because
//! [`may_call_pager`] decides behaviour from it; only the panics are compiled out.

use std::cell::RefCell;

/// Position within one depth, in acquisition order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Level {
    /// `Object::size_lock`.
    Size = 1,
    /// Holding or waiting for pages of an object.
    Page = 2,
    /// Waiting for a batch of I/O jobs of this depth.
    Io = 3,
    /// Inside a pager of this depth (its layer's own locks).
    Pager = 4,
}

/// Deepest pager depth the order distinguishes; deeper stacks share the last rank (and
/// the last I/O pool), which only makes the checker coarser.
pub const MAX_DEPTH: u32 = 1000;

/// A point in the order. Smaller ranks are taken first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rank(u32);

impl Rank {
    /// The cache manager's locks (file lock, range tokens): taken before any cache work.
    pub const STACK: Rank = Rank(0);

    /// `level` of an object or pager of `depth`.
    pub fn new(depth: u32, level: Level) -> Rank {
        Rank(((MAX_DEPTH - depth.min(MAX_DEPTH) + 1) << 3) | level as u32)
    }
    pub(crate) fn page(depth: u32) -> Rank {
        Rank::new(depth, Level::Page)
    }
    pub(crate) fn size(depth: u32) -> Rank {
        Rank::new(depth, Level::Size)
    }
    pub(crate) fn io(depth: u32) -> Rank {
        Rank::new(depth, Level::Io)
    }
    pub(crate) fn pager(depth: u32) -> Rank {
        Rank::new(depth, Level::Pager)
    }

    fn level(self) -> u32 {
        self.0 & 7
    }

    /// May be taken again at the same rank (see the module docs).
    fn repeatable(self) -> bool {
        self.level() == Level::Page as u32 || self.level() == Level::Pager as u32
    }
}

impl std::fmt::Display for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Rank::STACK {
            return f.write_str("Stack");
        }
        let depth = MAX_DEPTH + 1 - (self.0 >> 3);
        let level = match self.level() {
            1 => "Size",
            2 => "Page",
            3 => "Io",
            _ => "Pager",
        };
        write!(f, "{level}(depth {depth})")
    }
}

thread_local! {
    /// The ranks this thread holds, in acquisition order (a handful at most).
    static HELD: RefCell<Vec<Rank>> = const { RefCell::new(Vec::new()) };
}

/// The highest rank this thread holds, if any.
fn top() -> Option<Rank> {
    HELD.with(|h| h.borrow().iter().copied().max())
}

#[inline]
fn check(rank: Rank, what: &str) {
    if cfg!(debug_assertions)
        && let Some(t) = top()
        && (rank < t || (rank == t && !rank.repeatable()))
    {
        panic!(
            "lock order violated: {what} {rank} while holding {t} (see crates/ubc/src/order.rs); held: {}",
            held_list()
        );
    }
}

fn held_list() -> String {
    HELD.with(|h| h.borrow().iter().map(|r| r.to_string()).collect::<Vec<_>>().join(" → "))
}

/// Check that this thread may wait for `rank` now (debug builds panic if not).
#[inline]
pub fn check_wait(rank: Rank) {
    check(rank, "waiting for");
}

/// Record that this thread holds `rank` until the guard drops (debug builds check the
/// order first).
#[inline]
pub fn hold(rank: Rank) -> Hold {
    check(rank, "acquiring");
    HELD.with(|h| h.borrow_mut().push(rank));
    Hold { rank, _not_send: std::marker::PhantomData }
}

/// Whether this thread may call a pager of `depth` now (fill or write back a file of that
/// depth): nothing it holds ranks after `Page(depth)`, so neither the file's pages nor its
/// pager's waits (all of depth `< depth`) can be waiting for what this thread holds. Reclaim and the dirty throttle skip files for which this is false.
pub fn may_call_pager(depth: u32) -> bool {
    // Calling it means holding that file's pages (writeback, fill), then its pager.
    top().is_none_or(|t| Rank::page(depth) >= t)
}

/// Whether this thread holds no rank at all (no pages, no pager call, no size lock): the
/// last hold of an object may be dropped here, which tears it down (taking its pages).
pub(crate) fn holds_nothing() -> bool {
    top().is_none()
}

/// Whether this thread is inside a pager call (of any depth).
pub(crate) fn in_pager() -> bool {
    HELD.with(|h| h.borrow().iter().any(|r| r.level() == Level::Pager as u32))
}

/// A held rank; dropping it releases the rank. Not `Send`: the stack is per thread.
#[must_use = "the rank is released when this is dropped"]
pub struct Hold {
    rank: Rank,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        HELD.with(|h| {
            // Guards may drop out of order: remove the latest entry of this rank.
            let mut h = h.borrow_mut();
            if let Some(i) = h.iter().rposition(|r| *r == self.rank) {
                h.remove(i);
            }
        });
    }
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hold({})", self.rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_order_depth_first_then_level() {
        assert!(Rank::STACK < Rank::size(5));
        assert!(Rank::pager(2) < Rank::size(1), "a pager reaches down");
        assert!(Rank::size(1) < Rank::page(1) && Rank::page(1) < Rank::io(1) && Rank::io(1) < Rank::pager(1));
        assert_eq!(Rank::pager(3).to_string(), "Pager(depth 3)");
    }

    #[test]
    fn a_pager_may_wait_for_pages_below_it() {
        let _p = hold(Rank::pager(2));
        check_wait(Rank::page(1));
        let _q = hold(Rank::page(1));
        check_wait(Rank::page(1)); // lock coupling in the object below
        assert!(may_call_pager(1) && may_call_pager(0));
        assert!(!may_call_pager(2), "the pager's own file");
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "lock order violated: waiting for Page(depth 2) while holding Pager(depth 2)")]
    fn a_pager_waiting_for_its_own_depth_panics() {
        let _p = hold(Rank::pager(2));
        check_wait(Rank::page(2));
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "lock order violated")]
    fn waiting_upward_panics() {
        let _p = hold(Rank::page(0));
        check_wait(Rank::page(1));
    }

    #[test]
    fn holding_pages_restricts_which_pagers_may_be_called() {
        let _p = hold(Rank::page(1));
        assert!(may_call_pager(1), "its own object's pager writes below it");
        assert!(may_call_pager(0));
        assert!(!may_call_pager(2), "a pager above may wait for the held page");
    }

    #[test]
    fn guards_release_out_of_order() {
        let a = hold(Rank::size(1));
        let b = hold(Rank::page(1));
        drop(a);
        assert_eq!(top(), Some(Rank::page(1)));
        drop(b);
        assert_eq!(top(), None);
    }
}

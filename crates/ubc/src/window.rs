//! Windows: bounded, reusable mappings of parts of objects' memfds (UBC's `ubc_alloc` /
//! `ubc_release`). `read_at`, `write_at`, pagers and [`Window`](crate::Window) guards reach
//! cached pages through them.
//!
//! A window maps one chunk (`window_size` bytes, aligned) of one object. Each chunk has at
//! most one window, found through `Chunk::window`, so the hit path is: pin the page, load
//! the chunk's window address, copy. The number of windows is bounded (`max_windows`) so that
//! many thousands of cached files stay within `vm.max_map_count`; when the table is full, a
//! CLOCK hand retires a window nobody uses.
//!
//! Retiring must not pull a mapping out from under a thread that is copying through it, and
//! the hit path must not take a lock. Users never touch a page through a window without
//! holding the page (pinned, BUSY, WRITING or WRITEBACK), so a Dekker-style handshake on
//! sequentially consistent atomics suffices:
//!
//! ```text
//!   user:    hold page (RMW on its state)      retirer: window := RETIRING
//!            addr := load window                        scan the chunk's page states
//!            if addr is RETIRING: slow path             if any page is held: restore, skip
//!                                                       else: munmap, window := NONE
//! ```
//!
//! Either the retirer's scan sees the hold (and backs off), or the user's load comes after
//! the store of RETIRING (and it takes the slow path, which waits on the table lock).

use crate::error::Result;
use crate::memfd::{self, Memory};

use crate::page::table::{Chunk, WIN_NONE, WIN_RETIRING};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::*};

pub(crate) struct Windows {
    /// Bytes per window (= bytes per chunk).
    size: usize,
    max: usize,
    slots: Mutex<Slots>,
    maps: AtomicU64,
    retires: AtomicU64,
}

struct Slots {
    slots: Vec<Option<Slot>>,
    free: Vec<u32>,
    hand: usize,
    live: usize,
}

struct Slot {
    addr: usize,
    len: usize,
    /// The chunk this window maps. Valid while the slot is occupied: an object releases its
    /// windows (`release_all`) before its page table is freed.
    chunk: *const Chunk,
}

// SAFETY: the raw chunk pointers are only dereferenced under the slots lock, and chunks
// outlive their slots (see `Slot::chunk`).
unsafe impl Send for Slots {}

/// Counters for statistics.
pub(crate) struct WindowStats {
    pub(crate) live: usize,
    pub(crate) maps: u64,
    pub(crate) retires: u64,
}

impl Windows {
    pub(crate) fn new(size: usize, max: usize) -> Windows {
        Windows {
            size,
            max: max.max(1),
            slots: Mutex::new(Slots { slots: Vec::new(), free: Vec::new(), hand: 0, live: 0 }),
            maps: AtomicU64::new(0),
            retires: AtomicU64::new(0),
        }
    }

    /// The address of the window mapping `chunk`, mapping one if needed.
    /// => caller holds at least one page of `chunk` (pin, BUSY, WRITING or WRITEBACK), and
    ///    touches only pages it holds.
    #[inline]
    pub(crate) fn address(&self, chunk: &Chunk, memory: &Memory) -> Result<*mut u8> {
        let a = chunk.window.load(SeqCst);
        if a > WIN_RETIRING {
            if !chunk.window_ref.load(Relaxed) {
                chunk.window_ref.store(true, Relaxed);
            }
            return Ok(a as *mut u8);
        }
        self.map_slow(chunk, memory)
    }

    #[cold]
    fn map_slow(&self, chunk: &Chunk, memory: &Memory) -> Result<*mut u8> {
        let mut s = self.slots.lock();
        // Retirement happens under this lock, so here the window is either mapped (someone
        // else mapped it while we waited) or NONE.
        let a = chunk.window.load(SeqCst);
        if a > WIN_RETIRING {
            return Ok(a as *mut u8);
        }
        // At (or, after a burst, above) the bound: retire an idle window first, so the
        // table converges back under `max`. Below it: a free slot, or a new one.
        let slot = if s.live >= self.max {
            match self.retire_one(&mut s) {
                Some(i) => i,
                // Every window is held right now: exceed the bound rather than fail or wait
                // (a soft limit: holders release soon, and later maps retire the excess).
                None => s.free.pop().map(|i| i as usize).unwrap_or_else(|| {
                    s.slots.push(None);
                    s.slots.len() - 1
                }),
            }
        } else {
            match s.free.pop() {
                Some(i) => i as usize,
                None => match s.slots.iter().position(|x| x.is_none()) {
                    Some(i) => i,
                    None => {
                        s.slots.push(None);
                        s.slots.len() - 1
                    }
                },
            }
        };
        let addr = match memory.map(chunk.index * self.size as u64, self.map_len(chunk)) {
            Ok(p) => p,
            Err(e) => {
                s.free.push(slot as u32);
                return Err(e);
            }
        };
        self.maps.fetch_add(1, Relaxed);
        s.slots[slot] = Some(Slot { addr: addr as usize, len: self.map_len(chunk), chunk });
        s.live += 1;
        chunk.window_slot.store(slot as u32, SeqCst);
        chunk.window_ref.store(true, Relaxed);
        chunk.window.store(addr as usize, SeqCst);
        // Over the bound after a burst of held windows: retire idle ones now, so the excess
        // does not outlive the burst. The window just made is safe from this: the caller
        // holds a page of its chunk, so `try_retire` refuses it.
        while s.live > self.max {
            match self.retire_one(&mut s) {
                Some(i) => s.free.push(i as u32),
                None => break,
            }
        }
        Ok(addr)
    }

    /// Run the CLOCK hand until a window can be retired; returns its (now empty) slot.
    fn retire_one(&self, s: &mut Slots) -> Option<usize> {
        let n = s.slots.len();
        for _ in 0..2 * n {
            let i = s.hand;
            s.hand = (s.hand + 1) % n;
            let Some(slot) = &s.slots[i] else { continue };
            // SAFETY: occupied slots point at live chunks (see `Slot::chunk`).
            let chunk = unsafe { &*slot.chunk };
            if chunk.window_ref.swap(false, Relaxed) {
                continue;
            }
            if try_retire(chunk) {
                // SAFETY: retired: no holder can be using the address (handshake above).
                unsafe { memfd::unmap(slot.addr as *mut u8, slot.len) };
                s.slots[i] = None;
                s.live -= 1;
                self.retires.fetch_add(1, Relaxed);
                return Some(i);
            }
        }
        None
    }

    /// Unmap every window of the chunks `for_each` yields (object teardown).
    /// => no page of those chunks is held by anyone.
    pub(crate) fn release_all(&self, for_each: impl FnOnce(&mut dyn FnMut(&Chunk))) {
        let mut s = self.slots.lock();
        for_each(&mut |chunk: &Chunk| {
            let a = chunk.window.swap(WIN_NONE, SeqCst);
            if a > WIN_RETIRING {
                let i = chunk.window_slot.load(SeqCst) as usize;
                // SAFETY: per the precondition nobody uses the address.
                unsafe { memfd::unmap(a as *mut u8, self.map_len(chunk)) };
                s.slots[i] = None;
                s.free.push(i as u32);
                s.live -= 1;
            }
        });
    }

    /// Bytes mapped for `chunk`: the window size, except for the last chunk below the memfd's
    /// maximum size (mmap refuses to reach past `MAX_LFS_FILESIZE`).
    fn map_len(&self, chunk: &Chunk) -> usize {
        let off = chunk.index * self.size as u64;
        (self.size as u64).min(memfd::max_size().saturating_sub(off)) as usize
    }

    pub(crate) fn stats(&self) -> WindowStats {
        WindowStats { live: self.slots.lock().live, maps: self.maps.load(Relaxed), retires: self.retires.load(Relaxed) }
    }
}

impl Drop for Windows {
    fn drop(&mut self) {
        // Objects release their windows when they are dropped, so normally nothing is left.
        for slot in self.slots.get_mut().slots.drain(..).flatten() {
            // SAFETY: the cache is gone; nobody can hold a page.
            unsafe { memfd::unmap(slot.addr as *mut u8, slot.len) };
        }
    }
}

/// The retirer's half of the handshake. => caller holds the slots lock.
fn try_retire(chunk: &Chunk) -> bool {
    let a = chunk.window.swap(WIN_RETIRING, SeqCst);
    debug_assert!(a > WIN_RETIRING);
    let held = chunk.pages.any(|p| p.snapshot().held());
    if held {
        chunk.window.store(a, SeqCst);
        false
    } else {
        chunk.window.store(WIN_NONE, SeqCst);
        true
    }
}

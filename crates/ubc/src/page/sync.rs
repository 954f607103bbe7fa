//! The primitives of the page state word, swappable for model checking.
//!
//! Normal builds use `std`'s `AtomicU32` and the futex of `atomic-wait` directly (the
//! functions are `#[inline]` re-exports: no cost over calling them in `state.rs`).
//!
//! With the `shuttle` feature (tests only: `cargo test -p ubc --features shuttle --lib
//! schedules`) the word is a shuttle atomic — every operation on it is a point where the
//! scheduler may switch threads — and the futex is modelled faithfully rather than by
//! "yield and re-check": `wait` sleeps on a condition variable after checking the word under
//! a mutex that `wake_all` also takes, so a waiter either sees the changed word or is asleep
//! before the wake. A transition that forgets to wake a sleeper therefore leaves it asleep
//! for good, and shuttle reports the deadlock (a polling model would hide a lost wakeup).
//! All addresses share one condition variable: a wake for another page is a spurious
//! wakeup, which futex callers tolerate anyway (every waiter re-checks its word in a loop).

#[cfg(not(feature = "shuttle"))]
pub(crate) use std::sync::atomic::AtomicU32;

#[cfg(not(feature = "shuttle"))]
#[inline]
pub(crate) fn wait(word: &AtomicU32, expected: u32) {
    atomic_wait::wait(word, expected)
}

#[cfg(not(feature = "shuttle"))]
#[inline]
pub(crate) fn wake_all(word: &AtomicU32) {
    atomic_wait::wake_all(word)
}

#[cfg(feature = "shuttle")]
pub(crate) use shuttle::sync::atomic::AtomicU32;

#[cfg(feature = "shuttle")]
shuttle::lazy_static! {
    // Per execution (shuttle drops lazy statics at the end of each one).
    static ref FUTEX: (shuttle::sync::Mutex<()>, shuttle::sync::Condvar) =
        (shuttle::sync::Mutex::new(()), shuttle::sync::Condvar::new());
}

/// Sleep while `word == expected` (until a `wake_all` after it changed).
#[cfg(feature = "shuttle")]
pub(crate) fn wait(word: &AtomicU32, expected: u32) {
    let g = FUTEX.0.lock().unwrap();
    if word.load(std::sync::atomic::Ordering::SeqCst) == expected {
        drop(FUTEX.1.wait(g).unwrap());
    }
}

/// Wake every sleeper (on any word: the others see a spurious wakeup).
#[cfg(feature = "shuttle")]
pub(crate) fn wake_all(_word: &AtomicU32) {
    let _g = FUTEX.0.lock().unwrap();
    FUTEX.1.notify_all();
}

//! The cache manager's locks, swappable for model checking.
//!
//! Normal builds use `parking_lot` (plain re-exports: exactly what `coherence.rs` used before
//! this module existed). With the `shuttle` feature (tests only: `cargo test -p ubc-stack
//! --features shuttle --lib schedules`) they are built on shuttle's locks — each acquisition
//! a point where the scheduler may switch threads, and a cycle of waiters a reported
//! deadlock — behind parking_lot's interface (no poisoning, `Condvar::wait(&mut guard)`,
//! `RwLockWriteGuard::downgrade`). The model `RwLock` is task-fair like parking_lot's: a
//! reader waits while a writer waits, so a thread taking a read lock it already holds can
//! deadlock here as it can in production.

#[cfg(not(feature = "shuttle"))]
pub(crate) use parking_lot::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

#[cfg(feature = "shuttle")]
pub(crate) use model::*;

#[cfg(feature = "shuttle")]
mod model {
    use std::ops::{Deref, DerefMut};

    use std::cell::UnsafeCell;

    #[derive(Default)]
    pub(crate) struct Mutex<T>(shuttle::sync::Mutex<T>);

    /// `None` only inside `Condvar::wait`.
    pub(crate) struct MutexGuard<'a, T>(Option<shuttle::sync::MutexGuard<'a, T>>);

    impl<T> Mutex<T> {
        pub(crate) fn new(v: T) -> Self {
            Mutex(shuttle::sync::Mutex::new(v))
        }
        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            MutexGuard(Some(self.0.lock().unwrap_or_else(|e| e.into_inner())))
        }
    }

    impl<T> Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            self.0.as_ref().expect("guard held")
        }
    }

    impl<T> DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            self.0.as_mut().expect("guard held")
        }
    }

    /// Readers, writer, writers waiting.
    #[derive(Default)]
    struct RwState {
        readers: usize,
        writer: bool,
        waiting: usize,
    }

    pub(crate) struct RwLock<T> {
        state: shuttle::sync::Mutex<RwState>,
        cv: shuttle::sync::Condvar,
        data: UnsafeCell<T>,
    }

    // SAFETY: as std's RwLock: the state admits one writer or shared readers at a time.
    unsafe impl<T: Send> Send for RwLock<T> {}
    unsafe impl<T: Send + Sync> Sync for RwLock<T> {}

    pub(crate) struct RwLockReadGuard<'a, T>(&'a RwLock<T>);
    pub(crate) struct RwLockWriteGuard<'a, T>(&'a RwLock<T>);

    impl<T> RwLock<T> {
        pub(crate) fn new(v: T) -> Self {
            RwLock { state: Default::default(), cv: Default::default(), data: UnsafeCell::new(v) }
        }
        fn state(&self) -> shuttle::sync::MutexGuard<'_, RwState> {
            self.state.lock().unwrap_or_else(|e| e.into_inner())
        }
        fn wait<'a>(&self, g: shuttle::sync::MutexGuard<'a, RwState>) -> shuttle::sync::MutexGuard<'a, RwState> {
            self.cv.wait(g).unwrap_or_else(|e| e.into_inner())
        }
        pub(crate) fn read(&self) -> RwLockReadGuard<'_, T> {
            let mut s = self.state();
            while s.writer || s.waiting > 0 {
                s = self.wait(s);
            }
            s.readers += 1;
            RwLockReadGuard(self)
        }
        pub(crate) fn write(&self) -> RwLockWriteGuard<'_, T> {
            let mut s = self.state();
            s.waiting += 1;
            while s.writer || s.readers > 0 {
                s = self.wait(s);
            }
            s.waiting -= 1;
            s.writer = true;
            RwLockWriteGuard(self)
        }
    }

    impl<'a, T> RwLockWriteGuard<'a, T> {
        /// Turn a write lock into a read lock without letting go of it.
        pub(crate) fn downgrade(g: Self) -> RwLockReadGuard<'a, T> {
            let lock = g.0;
            std::mem::forget(g);
            let mut s = lock.state();
            s.writer = false;
            s.readers += 1;
            lock.cv.notify_all();
            RwLockReadGuard(lock)
        }
    }

    impl<T> Drop for RwLockReadGuard<'_, T> {
        fn drop(&mut self) {
            let mut s = self.0.state();
            s.readers -= 1;
            if s.readers == 0 {
                self.0.cv.notify_all();
            }
        }
    }

    impl<T> Drop for RwLockWriteGuard<'_, T> {
        fn drop(&mut self) {
            self.0.state().writer = false;
            self.0.cv.notify_all();
        }
    }

    impl<T> Deref for RwLockReadGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            // SAFETY: a read lock is held.
            unsafe { &*self.0.data.get() }
        }
    }

    impl<T> Deref for RwLockWriteGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            // SAFETY: the write lock is held.
            unsafe { &*self.0.data.get() }
        }
    }

    impl<T> DerefMut for RwLockWriteGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            // SAFETY: the write lock is held.
            unsafe { &mut *self.0.data.get() }
        }
    }

    #[derive(Default)]
    pub(crate) struct Condvar(shuttle::sync::Condvar);

    impl Condvar {
        pub(crate) fn new() -> Self {
            Condvar(shuttle::sync::Condvar::new())
        }
        pub(crate) fn wait<T>(&self, g: &mut MutexGuard<'_, T>) {
            let inner = g.0.take().expect("guard held");
            g.0 = Some(self.0.wait(inner).unwrap_or_else(|e| e.into_inner()));
        }
        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }
}

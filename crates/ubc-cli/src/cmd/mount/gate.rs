//! The gate every change (write, create, rename, …) passes through, which the shutdown
//! closes: from then on changes fail with EROFS, and the shutdown knows when those already
//! in flight are done, so that every change that returned Ok is in the cache before the
//! final sync.
//!
//! A mount with the kernel's write-back cache holds bytes that programs wrote but the
//! kernel has not sent yet. Its write-back (`FUSE_WRITE_CACHE` writes, and the times it
//! flushes with them) is not a new change: it is admitted after the gate closed, while the
//! shutdown pulls those bytes out of the kernels, until the gate is sealed just before the
//! final sync.

use fuser::Errno;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

#[derive(Default)]
pub(super) struct Gate {
    state: Mutex<State>,
    drained: Condvar,
}

#[derive(Default)]
struct State {
    closed: bool,
    /// Closed to the kernels' write-back too.
    sealed: bool,
    /// Changes in flight (live `Pass`es).
    busy: usize,
}

/// A change in flight: hold it until the change is in the cache.
pub(super) struct Pass<'a>(&'a Gate);

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock().unwrap();
        s.busy -= 1;
        if s.busy == 0 {
            self.0.drained.notify_all();
        }
    }
}

impl Gate {
    /// Admit a change, or EROFS once the gate is closed.
    pub(super) fn enter(&self) -> Result<Pass<'_>, Errno> {
        self.admit(|s| s.closed)
    }

    /// A pass unless `refused` says the state refuses it (EROFS).
    fn admit(&self, refused: impl Fn(&State) -> bool) -> Result<Pass<'_>, Errno> {
        let mut s = self.state.lock().unwrap();
        if refused(&s) {
            return Err(Errno::EROFS);
        }
        s.busy += 1;
        Ok(Pass(self))
    }

    /// New changes are refused.
    pub(super) fn closed(&self) -> bool {
        self.state.lock().unwrap().closed
    }

    /// Admit the write-back of bytes a kernel already holds (a program's write that
    /// returned), also after the gate closed; EROFS once it is sealed.
    pub(super) fn enter_write_back(&self) -> Result<Pass<'_>, Errno> {
        self.admit(|s| s.sealed)
    }

    /// Refuse the kernels' write-back too, and wait, until `deadline`, for what is in
    /// flight; false if some is still running then.
    pub(super) fn seal(&self, deadline: Instant) -> bool {
        self.state.lock().unwrap().sealed = true;
        self.close(deadline)
    }

    /// Refuse new changes and wait, until `deadline`, for those in flight; false if some
    /// are still running then.
    pub(super) fn close(&self, deadline: Instant) -> bool {
        let mut s = self.state.lock().unwrap();
        s.closed = true;
        while s.busy > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            s = self.drained.wait_timeout(s, left).unwrap().0;
        }
        true
    }
}

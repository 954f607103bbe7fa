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
    /// When a kernel last got the attributes for a write into its write-back cache
    /// (`licensed_write`).
    licensed: Option<Instant>,
}

/// How long a `write(2)` that got its attributes may take to copy its bytes into the
/// kernel's cache, as the shutdown assumes (`settle`): its thread is runnable from the
/// answer on, and this covers being preempted for a few scheduler slices on a loaded
/// machine. A writer held off the CPU for longer still escapes the last pull.
const LICENSE_SETTLE: std::time::Duration = std::time::Duration::from_millis(100);

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

    /// A kernel asked for the attributes of a file open for writing through its write-back
    /// cache, and got them: with stale attributes that is what a `write(2)` asks before it
    /// copies into the cache (`fuse_cache_write_iter`), and once answered the write goes
    /// on without the daemon — after the gate closed too, if its thread runs late. The
    /// shutdown waits for it (`settle`).
    pub(super) fn licensed_write(&self) {
        self.state.lock().unwrap().licensed = Some(Instant::now());
    }

    /// Sleep until writes licensed before the gate closed have had `LICENSE_SETTLE` to copy
    /// their bytes (at most that long; not at all if none was licensed lately). => the gate
    /// is closed, so no new license is given.
    pub(super) fn settle(&self) {
        let last = self.state.lock().unwrap().licensed;
        if let Some(t) = last {
            let left = (t + LICENSE_SETTLE).saturating_duration_since(Instant::now());
            if !left.is_zero() {
                std::thread::sleep(left);
            }
        }
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

//! Writeback errors reported to every handle, once each — Linux's `errseq_t` (2017–18, after
//! PostgreSQL's "fsyncgate"): a failure that happened in the background, or that another
//! handle's `sync` already returned, must still reach every handle that could have data in
//! the file, instead of being cleared by the first caller who looks.
//!
//! Two kinds of failure, because ubc keeps more than the kernel does:
//!
//! * **retained** — a `put_pages` failed. The pages stay dirty in the cache and are retried;
//!   nothing is lost yet. The next `sync` retries them and returns the error only if the
//!   retry fails too. `close` of a writable handle reports it while the file still has dirty
//!   pages (the data is not on its way), since `close` does not write back.
//! * **lost** — the pager's own `sync` failed (`fsync` → EIO). The store accepted the pages
//!   earlier, so ubc's copies were clean and may have been evicted: whether the data is
//!   durable is unknown, and a later `fsync` of the same host file may well succeed (the
//!   kernel reports an fsync error once per open file description). Every handle — those
//!   open at the time and the first one opened afterwards if nobody had seen it — gets this
//!   error from its next `sync` or `close`, even when that `sync` itself succeeds.

use crate::error::{Error, PagerOp};
use parking_lot::Mutex;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::*};

#[derive(Clone)]
struct Record {
    op: PagerOp,
    errno: Option<i32>,
    kind: io::ErrorKind,
    message: String,
}

impl Record {
    fn to_error(&self, object: String, lost: bool) -> Error {
        let source = match self.errno {
            Some(e) => io::Error::from_raw_os_error(e),
            None => io::Error::new(self.kind, self.message.clone()),
        };
        Error::WritebackFailed { op: self.op, object, source, lost }
    }
}

#[derive(Default)]
struct State {
    /// Failures of each kind so far (sequence numbers; 0 = none).
    retained_seq: u64,
    lost_seq: u64,
    /// The highest lost sequence some handle has been told about.
    lost_reported: u64,
    /// Boxed: most objects never fail, and every cached object carries this state.
    last_retained: Option<Box<Record>>,
    last_lost: Option<Box<Record>>,
}

/// The failures of one cached object. The state is made at the first failure: until then
/// every sequence number is 0, and nearly every cached object never fails (16 bytes in
/// each object instead of 48).
#[derive(Default)]
pub(crate) struct WbErrors {
    state: Mutex<Option<Box<State>>>,
}

/// What one handle has been told (see [`WbErrors::cursor`]).
pub(crate) struct Cursor {
    retained: AtomicU64,
    lost: AtomicU64,
}

impl WbErrors {
    /// Record a failed `put_pages` (pages kept dirty).
    pub(crate) fn retained(&self, op: PagerOp, e: &io::Error) {
        let mut g = self.state.lock();
        let s = g.get_or_insert_with(Default::default);
        s.retained_seq += 1;
        s.last_retained =
            Some(Box::new(Record { op, errno: e.raw_os_error(), kind: e.kind(), message: e.to_string() }));
    }

    /// Record a failed pager `sync`: data the store accepted may be lost.
    pub(crate) fn lost(&self, op: PagerOp, e: &io::Error) {
        let mut g = self.state.lock();
        let s = g.get_or_insert_with(Default::default);
        s.lost_seq += 1;
        s.last_lost = Some(Box::new(Record { op, errno: e.raw_os_error(), kind: e.kind(), message: e.to_string() }));
    }

    /// A new handle's cursor: it will hear of lost data nobody has been told about yet (as
    /// Linux reports an unseen error to the next opener), and of later failures.
    pub(crate) fn cursor(&self) -> Cursor {
        let g = self.state.lock();
        let (retained, lost) = g.as_ref().map_or((0, 0), |s| (s.retained_seq, s.lost_reported));
        Cursor { retained: AtomicU64::new(retained), lost: AtomicU64::new(lost) }
    }

    /// A lost-data failure this handle has not been told about; marks it told. `object`
    /// names the object in the error (made only when there is one).
    pub(crate) fn take_lost(&self, c: &Cursor, object: impl FnOnce() -> String) -> Option<Error> {
        let mut g = self.state.lock();
        // No failure yet: the cursor is at 0 too.
        let s = g.as_mut()?;
        let seen = c.lost.swap(s.lost_seq, SeqCst);
        if s.lost_seq > seen {
            s.lost_reported = s.lost_seq;
            return s.last_lost.as_ref().map(|r| r.to_error(object(), true));
        }
        None
    }

    /// A failed writeback since this handle last looked (marks it told).
    pub(crate) fn take_retained(&self, c: &Cursor, object: impl FnOnce() -> String) -> Option<Error> {
        let g = self.state.lock();
        let s = g.as_ref()?;
        let seen = c.retained.swap(s.retained_seq, SeqCst);
        if s.retained_seq > seen {
            return s.last_retained.as_ref().map(|r| r.to_error(object(), false));
        }
        None
    }
}

//! Lock requests that wait (`F_SETLKW`, a blocking `flock`): each waits on a thread of its
//! own, so the mount goes on serving — the unlock that ends the wait may come through it —
//! until the lock is granted, the handle is released, or the kernel interrupts the request
//! (the waiting process got a signal: `flock -w`'s timer, a `SIGALRM` around `F_SETLKW`),
//! which ends it with `EINTR` as on a local file system.

use super::handles::Handles;
use fuser::{Errno, ReplyEmpty};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often a waiting request tries again.
const POLL: Duration = Duration::from_millis(5);
/// Interrupts of requests that never waited (a slow read, a request already answered) are
/// forgotten after this long.
const KEEP: Duration = Duration::from_secs(60);

/// The requests the kernel interrupted (by unique id), of one mount. An interrupt may come
/// before the request it names is served, so it is kept until the request looks or `KEEP`
/// passes.
#[derive(Default)]
pub(super) struct Interrupts(Mutex<HashMap<u64, Instant>>);

impl Interrupts {
    pub(super) fn note(&self, unique: u64) {
        let mut m = self.0.lock().unwrap();
        m.insert(unique, Instant::now());
        if m.len() > 256 {
            m.retain(|_, at| at.elapsed() < KEEP);
        }
    }

    /// Whether request `unique` was interrupted (the mark is used up).
    fn take(&self, unique: u64) -> bool {
        self.0.lock().unwrap().remove(&unique).is_some()
    }
}

/// Answer request `unique` (on handle `fh`) when `try_take` succeeds, on a thread of its
/// own: `Ok` when granted, `EINTR` when the handle is released or the request interrupted.
/// => `try_take` failed once already.
pub(super) fn wait_for(
    handles: Arc<Handles>,
    interrupts: Arc<Interrupts>,
    fh: u64,
    unique: u64,
    mut try_take: impl FnMut() -> bool + Send + 'static,
    reply: ReplyEmpty,
) {
    std::thread::spawn(move || {
        loop {
            if handles.get(fh).is_none() || interrupts.take(unique) {
                return reply.error(Errno::EINTR);
            }
            if try_take() {
                return reply.ok();
            }
            std::thread::sleep(POLL);
        }
    });
}

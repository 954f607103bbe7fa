//! Interleaving points for tests (feature `testing`, never in a production build): a test
//! installs a hook that runs when a thread reaches one of these points inside the cache,
//! so that it can stop that thread there and run another operation in the window — a
//! race made to happen on every run instead of once in thousands.

use std::sync::{Arc, RwLock};

/// Where a thread is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Point {
    /// A fill has chosen its run of pages (reading the file's length to clip it) and has
    /// not taken them yet.
    FillPlanned,
    /// Work on a file apart from its handles (an I/O job: read-ahead, a run of a
    /// write-back) is done — a write-back job has told its caller — and is about to let go
    /// of the file.
    WorkDone,
    /// A fill found the replacement policy's lock taken and left its pages for the next
    /// holder to admit (`resources/policy.rs`); they are valid already.
    FillStaged,
}

type Hook = Arc<dyn Fn(Point) + Send + Sync>;

static HOOK: RwLock<Option<Hook>> = RwLock::new(None);

/// Run `hook` on every thread reaching a point until the returned guard is dropped. Tests
/// of one binary run in parallel: a hook should act only on threads it knows (by name).
pub fn hook(hook: impl Fn(Point) + Send + Sync + 'static) -> HookGuard {
    *HOOK.write().unwrap() = Some(Arc::new(hook));
    HookGuard(())
}

/// Removes the hook when dropped.
pub struct HookGuard(());

impl Drop for HookGuard {
    fn drop(&mut self) {
        *HOOK.write().unwrap() = None;
    }
}

/// Called by the cache at `point`.
pub(crate) fn reached(point: Point) {
    let h = HOOK.read().unwrap().clone();
    if let Some(h) = h {
        h(point);
    }
}

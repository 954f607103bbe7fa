//! Work on an object that runs apart from its handles — I/O jobs (read-ahead, parallel
//! write-back), the flusher, reclaim, `sync_all`, statistics — holds it through a
//! [`WorkHold`], counted, so that whoever closes the last handle of a file that left the
//! cache can wait for that work to let go ([`crate::File::close_and_wait`]). Without the
//! wait the object — its pager, and the descriptors the pager holds — is freed later, on
//! whichever thread lets go last: a removed file's blocks stay allocated meanwhile, and a
//! file the stack closed has its pager (whose drop may still write) outlive the start of
//! the file's next open. Linux's `evict()` waits the same way before an inode is freed
//! (`inode_wait_for_writeback`, then `truncate_inode_pages_final`, which waits for pages
//! under I/O).
//!
//! An object is *unlisted* when it leaves the registry (no handle, no page: nothing can reach
//! it anew). Work that found it through the registry earlier holds an [`ObjectRef`] (no
//! strong reference) and takes a hold only when it comes to the object; once unlisted, that
//! is refused — the work had nothing to do there. Work started through a handle (an I/O
//! job a reader or writer queues) is always counted: its object cannot be unlisted yet.

use super::Object;
use parking_lot::{Condvar, Mutex};
use std::sync::{Arc, Weak};

/// The holds on one object. `st` is a leaf lock.
#[derive(Default)]
pub(crate) struct Holders {
    st: Mutex<State>,
    idle: Condvar,
}

#[derive(Default)]
struct State {
    /// Holds taken and not yet let go. (32 bits: with the flag, 8 bytes, so that the
    /// holds of every cached object take 40 bytes of heap, not 48.)
    n: u32,
    /// The object left the registry: holds through an `ObjectRef` are refused.
    unlisted: bool,
}

impl Holders {
    /// Count a hold; refused (false) on an unlisted object unless `always`.
    fn enter(&self, always: bool) -> bool {
        let mut st = self.st.lock();
        if st.unlisted && !always {
            return false;
        }
        st.n += 1;
        true
    }

    fn exit(&self) {
        let mut st = self.st.lock();
        st.n -= 1;
        if st.n == 0 {
            self.idle.notify_all();
        }
    }

    /// The object left the registry. => called under the registry's write lock.
    pub(crate) fn unlist(&self) {
        self.st.lock().unlisted = true;
    }

    /// If the object is unlisted, wait until no hold is left on it. => the caller holds
    /// no page (a holder may be waiting for one) and no cache lock: checked against the
    /// object's page rank.
    pub(crate) fn wait_if_unlisted(&self, depth: u32) {
        let mut st = self.st.lock();
        if !st.unlisted {
            return;
        }
        if st.n > 0 {
            crate::order::check_wait(crate::order::Rank::page(depth));
        }
        while st.n > 0 {
            self.idle.wait(&mut st);
        }
    }
}

/// A counted strong reference to an object, for work apart from its handles. The
/// reference is dropped before the count: when the count reaches zero, the holder no
/// longer keeps the object alive.
pub(crate) struct WorkHold {
    obj: Option<Arc<Object>>,
    holders: Arc<Holders>,
}

impl WorkHold {
    /// A hold on `obj`, counted even if it is unlisted. => the caller has a handle of the
    /// object, or a hold on it, or it is being dropped (`obj` is then not upgradable).
    pub(crate) fn of(obj: &Weak<Object>) -> Option<WorkHold> {
        let obj = obj.upgrade()?;
        let holders = obj.holders.clone();
        holders.enter(true);
        Some(WorkHold { obj: Some(obj), holders })
    }
}

impl std::ops::Deref for WorkHold {
    type Target = Arc<Object>;
    fn deref(&self) -> &Arc<Object> {
        self.obj.as_ref().expect("held until dropped")
    }
}

impl Drop for WorkHold {
    fn drop(&mut self) {
        #[cfg(feature = "testing")]
        crate::testing::reached(crate::testing::Point::WorkDone);
        // Maybe the last reference: the object (and its pager) goes here, before the count
        // tells a closer waiting in `wait_if_unlisted` that it is gone.
        drop(self.obj.take());
        self.holders.exit();
    }
}

/// An object found through the registry, not kept alive: [`ObjectRef::hold`] when the work
/// comes to it.
#[derive(Clone)]
pub(crate) struct ObjectRef {
    obj: Weak<Object>,
    holders: Arc<Holders>,
}

impl ObjectRef {
    pub(crate) fn of(obj: &Arc<Object>) -> ObjectRef {
        ObjectRef { obj: Arc::downgrade(obj), holders: obj.holders.clone() }
    }

    /// A hold on the object, unless it was unlisted (or is gone) since it was found.
    pub(crate) fn hold(&self) -> Option<WorkHold> {
        if !self.holders.enter(false) {
            return None;
        }
        match self.obj.upgrade() {
            Some(obj) => Some(WorkHold { obj: Some(obj), holders: self.holders.clone() }),
            None => {
                self.holders.exit();
                None
            }
        }
    }
}

/// A pager's requests reach the object through a reference that does not keep it: once the
/// cache lets it go (unlisted or dropped), they do nothing.
impl crate::pager::RequestTarget for ObjectRef {
    fn clean(&self, from: u64, to: u64) -> crate::Result<()> {
        self.hold().map_or(Ok(()), |o| o.clean(from, to))
    }
    fn flush(&self, from: u64, to: u64, reload: bool) -> crate::Result<()> {
        let length = if reload { super::Length::Reload } else { super::Length::Keep };
        self.hold().map_or(Ok(()), |o| o.invalidate(from, to, length))
    }
    fn cached(&self) -> bool {
        self.hold().is_some()
    }
    fn lock(&self, from: u64, to: u64) -> crate::Result<()> {
        self.hold().map_or(Ok(()), |o| o.data_lock(from, to))
    }
    fn unlock(&self, from: u64, to: u64) {
        if let Some(o) = self.hold() {
            o.data_unlock(from, to);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_unlisted_count_refuses_new_holds_and_wakes_the_waiter_at_zero() {
        let h = Arc::new(Holders::default());
        assert!(h.enter(false));
        h.unlist();
        assert!(!h.enter(false), "unlisted: a hold through a reference is refused");
        assert!(h.enter(true), "a hold through a handle is counted");
        let h2 = h.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            h2.exit();
            std::thread::sleep(Duration::from_millis(50));
            h2.exit();
        });
        h.wait_if_unlisted(0);
        assert_eq!(h.st.lock().n, 0, "returned before both holds ended");
        t.join().unwrap();
    }
}

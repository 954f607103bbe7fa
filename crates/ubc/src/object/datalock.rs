//! Write locks a pager puts on its object (Mach's `pager_data_lock` / `pager_data_unlock`;
//! the registry is `resources/locks.rs`). Every change of the file's bytes asks first:
//! `write_at` and `WindowMut` ([`Object::unlock_for_change`] under the size lock shared),
//! `set_len` and hole punching (under it exclusive), and a shared writable mapping — whose
//! stores the cache cannot see one by one — before a locked page is mapped into it (its
//! fault asks; fills and new mappings leave locked pages unmapped there).

use super::*;

impl Object {
    /// `PagerRequest::lock`: write-lock bytes `from..to` (whole pages). Returns once no
    /// write begun before is still copying (the size lock, taken exclusively once, waits for
    /// them; writes that start later see the lock) and stores made through shared writable
    /// mappings are found and the locked pages zapped from those mappings (a later access
    /// faults and asks). => the caller is not inside a call of this object's (pager request
    /// precondition).
    pub(crate) fn data_lock(&self, from: u64, to: u64) -> Result<()> {
        let pages = self.pages_of(from, to);
        if pages.is_empty() {
            return Ok(());
        }
        self.res.locks.lock(self.id, pages.clone());
        drop(self.size_exclusive());
        // Pages being mapped into shared writable mappings by threads that looked before
        // the lock was listed: wait for them, then zap what they mapped.
        self.res.locks.wait_for_writable_maps();
        if self.nmaps.load(SeqCst) > 0
            && let Some(svc) = self.res.maps.get()
        {
            // As eviction does: zap, then look for the stores made before (the written state
            // survives the zap), under the scan lock.
            let _scan = self.scan_lock.lock();
            let mut found = Vec::new();
            for m in self.maps.read().iter().filter(|m| m.tracked) {
                svc.zap_taking_written(m, pages.start, pages.end, self.ps(), &mut found);
            }
            crate::map::dedup_pages(&mut found);
            if let (Some(lo), Some(hi)) = (found.first(), found.last()) {
                self.changed(lo << self.ps()..(hi + 1) << self.ps(), true);
            }
            self.mark_found_dirty(&found);
        }
        Ok(())
    }

    /// `PagerRequest::unlock`: lift the lock on bytes `from..to` (whole pages).
    pub(crate) fn data_unlock(&self, from: u64, to: u64) {
        self.res.locks.unlock(self.id, self.pages_of(from, to), None);
    }

    /// Whether page `page` is write-locked (a shared writable mapping must not map it).
    pub(crate) fn store_locked(&self, page: u64) -> bool {
        self.res.locks.locked(self.id, page..page + 1).is_some()
    }

    /// Before bytes `from..to` change: if the pager locked any of their pages, ask it
    /// (`Pager::unlock_request`) and, once it allows, forget those locks; its refusal is the
    /// change's error. => the caller holds the size lock (a write: shared) or nothing of
    /// this object's; no page held.
    pub(crate) fn unlock_for_change(&self, from: u64, to: u64) -> Result<()> {
        if !self.res.locks.any() || from >= to {
            return Ok(());
        }
        let Some((locked, seen)) = self.res.locks.locked(self.id, self.pages_of(from, to)) else {
            return Ok(());
        };
        let ps = self.ps();
        let range = (locked.start << ps)..(locked.end << ps);
        self.res.locks.requests.fetch_add(1, Relaxed);
        match self.call_pager(PagerOp::Unlock, range.start, |p| p.unlock_request(range.clone())) {
            Ok(()) => {
                // Only the locks the pager was asked about: one it made while answering
                // stays (its `lock` waits for this change, which then goes ahead).
                self.res.locks.unlock(self.id, locked, Some(seen));
                Ok(())
            }
            Err(e) => {
                self.res.locks.refused.fetch_add(1, Relaxed);
                Err(e)
            }
        }
    }

    /// Forget this object's locks (teardown).
    pub(super) fn forget_locks(&self) {
        self.res.locks.forget(self.id);
    }
}

//! Advice (`posix_fadvise`, TLPI 13.5): how a program says it will use a file. The access
//! pattern (`Normal`, `Sequential`, `Random`, `NoReuse`) is kept per handle, as Linux keeps
//! it per open file description, and steers the handle's reads: read-ahead off for
//! `Random` (Linux's `FMODE_RANDOM`), believed at the first miss and allowed twice the
//! window for `Sequential` (Linux doubles `ra_pages`), and pages filled for a `NoReuse`
//! read admitted as use-once, like read-ahead's (no promotion on a ghost hit, the use they
//! were read for not counted: Linux's `FMODE_NOREUSE` skips the activation). `WillNeed`
//! queues an asynchronous fill of the range (here); `DontNeed` is a `clean` of the range
//! then a `drop_clean` (`File::advise`).

use super::*;

impl Object {
    /// `WillNeed` of bytes `from..to`: queue the fill of its pages not cached, as
    /// read-ahead (asynchronous; pages admitted as read-ahead). At most half the budget is
    /// queued, from `from`: more would evict the start of the range to fill its end.
    pub(crate) fn will_need(&self, from: u64, to: u64) {
        let ps = self.ps();
        let Some(last) = self.last_page() else { return };
        let first = from >> ps;
        let end = to.div_ceil(1 << ps).min(last + 1).min(first.saturating_add((self.res.geo.budget_pages / 2).max(1)));
        if first < end {
            self.readahead_submit(first, end, false);
        }
    }
}

//! The object's side of eviction: freeing the pages the replacement policy took (after
//! zapping them from mappings and looking for stores made through them), and evicting
//! every clean page of a closed object.

use super::*;

impl Object {
    /// The state word of a cached page, if its chunk exists.
    pub(crate) fn page_state(&self, page: u64) -> Option<&state::PageState> {
        self.chunk_of(page).and_then(|c| c.pages.get(self.locate(page).1))
    }

    /// The chunk holding `page`, if it exists.
    pub(crate) fn chunk_of(&self, page: u64) -> Option<&Chunk> {
        self.table.get(self.locate(page).0)
    }

    /// Free pages the replacement policy took for eviction (each held VALID|BUSY, already
    /// forgotten by the policy). `pages` sorted ascending.
    pub(crate) fn release_evicted(&self, pages: &[u64]) {
        let ps = self.ps();
        // Pages that may be mapped: zap them out of the tracked mappings first (a store now
        // traps and waits for us), then look for stores made before; a page found written
        // stays, dirty. The scan lock keeps another scan from taking those stores meanwhile.
        let _scan = (self.nmaps.load(SeqCst) > 0).then(|| self.scan_lock.lock());
        if _scan.is_some() {
            let mut found = Vec::new();
            if let Some(svc) = self.res.maps.get() {
                for m in self.maps.read().iter().filter(|m| m.tracked) {
                    for (a, b) in runs(pages) {
                        svc.zap_taking_written(m, a, b, ps, &mut found);
                    }
                }
            }
            crate::map::dedup_pages(&mut found);
            self.mark_found_dirty(&found);
        }
        // A page dirtied while we held it stays, dirty: by a store found just above, or by
        // the last scan of a mapping dropped since the policy took the page — that scan
        // (`Mapping`'s drop) marks it dirty, then the mapping is gone and `nmaps` may read 0
        // above; punched, the page would be refilled from the pager and the store lost.
        // Checked whatever `nmaps` said. And while a pass of unstable writes waits for its
        // commit, the pages it may have stored stay: the store may lose what it was given
        // (see `writeback.rs`, "Unstable writes"). Read after the pages were taken: a page
        // the pass made clean was counted in before it turned clean.
        let kept_below = self.kept_uncommitted_below();
        let is_dirty = |p: &u64| *p < kept_below || self.page_state(*p).is_some_and(|st| st.snapshot().dirty());
        let kept_back;
        let pages = if pages.iter().any(is_dirty) {
            let (keep, go): (Vec<u64>, Vec<u64>) = pages.iter().partition(|p| is_dirty(p));
            {
                let mut pol = self.res.policy.lock();
                for &p in keep.iter().filter(|_| !self.xip()) {
                    let chunk = self.chunk_of(p).expect("a page held for eviction has its chunk");
                    self.policy_admit(pol.as_mut(), chunk, p, Admission::Demand);
                }
            }
            for &p in &keep {
                if let Some(st) = self.page_state(p) {
                    st.cancel_evict();
                }
            }
            kept_back = go;
            &kept_back[..]
        } else {
            pages
        };
        for (a, b) in runs(pages) {
            // A failed punch would leave memory allocated that we no longer account; it
            // cannot fail for a valid range of a memfd, so there is nothing to undo.
            let _ = self.free_memory(a << ps, (b - a) << ps);
        }
        let mut waste = 0;
        for &p in pages {
            if let Some(st) = self.page_state(p) {
                waste += u64::from(st.snapshot().speculative());
                st.release_empty();
            }
        }
        let n = pages.len() as u64;
        self.resident.fetch_sub(n, Relaxed);
        self.uncharge(n);
        let sh = self.counters.cold();
        bump(&sh.evictions, n);
        bump(&sh.readahead_waste, waste);
    }

    /// Evict every clean, unheld page (deactivation of a closed object). Returns pages freed.
    pub(crate) fn evict_clean(&self) -> u64 {
        self.evict_clean_pages(0, u64::MAX)
    }

    /// Evict the clean, unheld pages among pages `[from, to)`. Returns pages freed.
    /// `File::drop_clean`: evict the clean pages wholly inside bytes `from..to` (and the last
    /// page of the file, if the range reaches its end) that nobody holds. Returns the pages
    /// dropped.
    pub(crate) fn drop_clean(&self, from: u64, to: u64) -> u64 {
        let ps = self.ps();
        let len = self.len();
        let last = if to >= len { len.div_ceil(1 << ps) } else { to >> ps };
        self.evict_clean_pages(from.div_ceil(1 << ps), last)
    }

    fn evict_clean_pages(&self, from: u64, to: u64) -> u64 {
        let cs = self.res.geo.chunk_shift;
        let mut freed = 0;
        if from >= to {
            return 0;
        }
        self.table.for_each(from >> cs, ((to - 1) >> cs) + 1, |chunk| {
            let base = chunk.index << cs;
            let taken: Vec<u64> = (0..chunk.pages.made_end())
                .filter(|&i| {
                    (from..to).contains(&(base + i as u64))
                        && chunk.pages.get(i).is_some_and(|s| s.try_lock_for_evict())
                })
                .map(|i| base + i as u64)
                .collect();
            if taken.is_empty() {
                return;
            }
            {
                let mut pol = self.res.policy.lock();
                for &p in &taken {
                    self.policy_forget(pol.as_mut(), chunk, p);
                }
            }
            self.release_evicted(&taken);
            freed += taken.len() as u64;
        });
        freed
    }
}

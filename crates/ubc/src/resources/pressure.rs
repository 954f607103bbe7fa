//! Giving memory back under pressure (issue 20, item 5; UBC's balance between the file cache
//! and process memory). The cache's pages live in memfds, which the kernel cannot reclaim
//! without swap: in a memory-limited cgroup, a cache holding its whole budget next to a
//! program that allocates would have the program (or the cache's process) killed by the
//! cgroup's OOM killer. So the page daemon watches the limit of the cgroup it runs in
//! (v2 `memory.max`/`memory.current`, v1 `memory.limit_in_bytes`/`memory.usage_in_bytes`,
//! the lowest limit up the hierarchy) and keeps a headroom (an eighth of the limit, at least
//! 16 MiB) free under it. The memory reclaim cannot take back is the cgroup's usage less its
//! file LRU pages (clean page cache the kernel can drop; shmem, which is the cache's memfds,
//! is on the anon LRU); less the cache's own pages, it is what everything else holds. The
//! cache may have what the limit leaves after that and the headroom; the rest of its budget
//! is *withheld* (evicted at once), down to a floor (a sixteenth of the budget, at least two
//! of the largest fills), and handed back an eighth at a time once a second has passed
//! without a rise. (A first version added
//! the shortfall to what was withheld, round by round: the cache's own evictions then looked
//! like pressure ending, it handed pages back and refilled them, and the program it
//! competed with was killed in 2 runs of 5; computed from the others' usage, 0 in 6.)
//!
//! Why polling and not PSI triggers: a trigger says that tasks stalled, i.e. after reclaim
//! already failed to find memory — and with no swap the next step in a limited cgroup is the
//! OOM killer, milliseconds later. The counters let the cache act before anybody stalls; the
//! page daemon reads them every round (50 ms while a limit applies), and so does a thread
//! that reserves pages for a fill, at most every 10 ms: the page daemon runs at a lower
//! priority and, with the reader and the allocating program busy on every core, measured
//! late by a round or two — the thread asking for memory looks itself (Linux's direct
//! reclaim). A program that allocates faster than the headroom per 10 ms can still meet the
//! limit first.

use std::path::{Path, PathBuf};

/// The memory cgroup this process runs in, if it has a limit.
pub(crate) struct MemCgroup {
    /// The cgroup's directory and its ancestors' up to the mount, innermost first.
    dirs: Vec<PathBuf>,
    v2: bool,
}

/// What the cgroup holds now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MemState {
    /// The lowest limit on the path, in bytes.
    pub(crate) limit: u64,
    /// Usage that reclaim cannot take back: usage less file LRU pages.
    pub(crate) pinned: u64,
}

/// Limits at or above this are "no limit" (v1 writes 2^63 rounded down to a page).
const NO_LIMIT: u64 = 1 << 62;

impl MemCgroup {
    /// The cgroup of this process, from `/proc/self/cgroup`, if a memory controller is
    /// mounted where the usual places say and some directory on its path has a limit.
    pub(crate) fn of_self() -> Option<MemCgroup> {
        let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        Self::parse(&text).filter(|c| c.state().is_some())
    }

    fn parse(text: &str) -> Option<MemCgroup> {
        // v1: "4:memory:/path" (the controller may share a line: "4:cpu,memory:/path").
        for line in text.lines() {
            let mut f = line.splitn(3, ':');
            let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
            if ctrl.split(',').any(|c| c == "memory") {
                let root = Path::new("/sys/fs/cgroup/memory");
                return Some(MemCgroup { dirs: ancestors(root, path), v2: false });
            }
        }
        // v2: "0::/path", with the memory controller enabled there.
        let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
        let root = Path::new("/sys/fs/cgroup");
        root.join("cgroup.controllers").exists().then(|| MemCgroup { dirs: ancestors(root, path), v2: true })
    }

    /// The limit and the memory reclaim cannot take back, or `None` without a limit.
    pub(crate) fn state(&self) -> Option<MemState> {
        let (limit_file, usage_file) =
            if self.v2 { ("memory.max", "memory.current") } else { ("memory.limit_in_bytes", "memory.usage_in_bytes") };
        let limit = self.dirs.iter().filter_map(|d| read_u64(&d.join(limit_file))).filter(|&l| l < NO_LIMIT).min()?;
        let dir = self.dirs.first()?;
        let usage = read_u64(&dir.join(usage_file))?;
        let stat = std::fs::read_to_string(dir.join("memory.stat")).ok()?;
        // v1 reports its own pages as `active_file`, its subtree's as `total_active_file`;
        // the usage counts the subtree, so the subtree's file pages are what to subtract.
        let (active, inactive) =
            if self.v2 { ("active_file", "inactive_file") } else { ("total_active_file", "total_inactive_file") };
        let file: u64 = stat
            .lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(k, _)| *k == active || *k == inactive)
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .sum();
        Some(MemState { limit, pinned: usage.saturating_sub(file) })
    }
}

fn ancestors(root: &Path, path: &str) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut p = Path::new(path.trim_start_matches('/'));
    loop {
        dirs.push(root.join(p));
        match p.parent() {
            Some(q) => p = q,
            None => break,
        }
    }
    dirs.retain(|d| d.is_dir());
    dirs
}

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// The pages to withhold from the budget next. The room the cache may have is what the
/// limit leaves after everything else in the cgroup (`pinned` less the cache's own pages,
/// `ours` bytes) and the headroom; what the budget holds beyond that room is withheld — at
/// once when that is more than now (computed from the others' usage, not from the last
/// step, so the cache's own evictions do not make it hand pages back), and handed back an
/// eighth at a time, only when `calm` (no increase for a while). `max`: the most that may
/// be withheld (the budget less its floor).
#[allow(clippy::too_many_arguments)]
pub(crate) fn next_withheld(
    st: MemState,
    ours: u64,
    budget_pages: u64,
    withheld: u64,
    page: u64,
    headroom: u64,
    max: u64,
    calm: bool,
) -> u64 {
    let others = st.pinned.saturating_sub(ours);
    let room = st.limit.saturating_sub(headroom).saturating_sub(others) / page;
    let want = budget_pages.saturating_sub(room).min(max);
    if want > withheld {
        want
    } else if calm && want < withheld {
        withheld - ((withheld - want) / 8).max(1)
    } else {
        withheld
    }
}

/// The headroom kept free under a `limit`: an eighth of it, at least 16 MiB.
pub(crate) fn headroom(limit: u64) -> u64 {
    (limit / 8).max(16 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_v1_and_v2_lines() {
        let v1 = MemCgroup::parse("5:devices:/\n4:memory:/a/b\n0::/\n").unwrap();
        assert!(!v1.v2);
        let v1b = MemCgroup::parse("3:cpu,memory:/x\n").unwrap();
        assert!(!v1b.v2);
        assert!(MemCgroup::parse("2:cpu:/\n").is_none() || Path::new("/sys/fs/cgroup/cgroup.controllers").exists());
    }

    #[test]
    fn withholds_what_the_others_leave_no_room_for_and_hands_back_slowly() {
        let (page, mib) = (4096u64, 1u64 << 20);
        let limit = 256 * mib;
        let h = headroom(limit);
        assert_eq!(h, 32 * mib);
        let budget = 160 * mib / page;
        let max = budget - budget / 16;
        // The cache holds 160 MiB, the others 20: room for 204, nothing withheld.
        let st = MemState { limit, pinned: 180 * mib };
        assert_eq!(next_withheld(st, 160 * mib, budget, 0, page, h, max, true), 0);
        // The others take 140 MiB more: room for 64 MiB, so 96 of the 160 are withheld at once.
        let st = MemState { limit, pinned: 320 * mib };
        assert_eq!(next_withheld(st, 160 * mib, budget, 0, page, h, max, false), 96 * mib / page);
        // The cache evicted down to 64 MiB: the room is the same, nothing handed back.
        let st = MemState { limit, pinned: 224 * mib };
        assert_eq!(next_withheld(st, 64 * mib, budget, 96 * mib / page, page, h, max, true), 96 * mib / page);
        // The others let go: an eighth of the difference back per calm round, none otherwise.
        let st = MemState { limit, pinned: 84 * mib };
        let w = 96 * mib / page;
        assert_eq!(next_withheld(st, 64 * mib, budget, w, page, h, max, false), w);
        assert_eq!(next_withheld(st, 64 * mib, budget, w, page, h, max, true), w - w / 8);
        // Never past the most that may be withheld.
        let st = MemState { limit, pinned: 2 * limit };
        assert_eq!(next_withheld(st, 0, budget, 0, page, h, max, true), max);
    }
}

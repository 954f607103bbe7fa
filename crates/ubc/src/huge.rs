//! Huge pages (issue 20, item 4): which memory a cache's pages live in, chosen once when the
//! cache is built, from what was asked ([`HugePages`]) and what the host offers.
//!
//! * **hugetlb** (`memfd_create(MFD_HUGETLB)`): 2 MiB pages from the host's reserved pool
//!   (`/proc/sys/vm/nr_hugepages`), the way databases take their buffer pools with
//!   PostgreSQL's `huge_pages = try`. Userfaultfd resolves minor faults on them a whole huge
//!   page at a time (`UFFDIO_CONTINUE` installs one PMD), write protection and
//!   `PAGEMAP_SCAN` work per huge page, and the kernel's TLB holds one entry per 2 MiB: the
//!   path that makes mappings fast. Cache pages are then 2 MiB each.
//! * **shmem THP**: where the host lets tmpfs allocate transparent huge pages on writes
//!   (`/sys/kernel/mm/transparent_hugepage/shmem_enabled` is `always`, `within_size` or
//!   `force`), the ordinary memfd's pages come in 2 MiB folios when cache pages are 2 MiB.
//!   Userfaultfd still maps them one 4 KiB PTE at a time (its `UFFDIO_CONTINUE` on shmem
//!   installs PTEs only), so mappings gain the single-call mapping of a whole cache page and
//!   contiguous memory, not the PMD.
//! * **shmem**, 4 KiB pages (or the page size asked for): everything else.
//!
//! With huge pages the pool is the host's, shared with every other process: a cache takes
//! the hugetlb path only if the pool's free pages hold its whole budget when it is built,
//! and allocates each page (`fallocate`) before anything touches it, so a pool emptied
//! later by someone else makes a fill fail with `ENOSPC` (a typed error; SIGBUS for a
//! mapping's fault) instead of killing the process with a SIGBUS inside the cache.
//! `Sharing::Private` mappings of a hugetlb cache are refused: hugetlbfs drops a private
//! mapping's copy of a page when a hole is punched in it, and eviction punches.

use crate::error::{Error, Result};

/// Whether a cache's pages may be huge pages ([`crate::CacheBuilder::huge_pages`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HugePages {
    /// Ordinary shmem pages of the configured page size (the default).
    #[default]
    Never,
    /// 2 MiB pages from the hugetlb pool if its free pages hold the whole budget, else shmem
    /// transparent huge pages if the host enables them for tmpfs, else ordinary pages;
    /// `CacheStats::page_memory` says which, and why.
    Try,
    /// As `Try`, but building the cache fails (`InvalidArgument`, saying why) when neither
    /// huge-page path is available.
    Require,
}

/// `never`, `try`, `require` (the spelling of the command line and of the C and Python
/// APIs).
impl std::str::FromStr for HugePages {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<HugePages, String> {
        match s {
            "never" => Ok(HugePages::Never),
            "try" => Ok(HugePages::Try),
            "require" => Ok(HugePages::Require),
            _ => Err(format!("'{s}': expected never, try or require")),
        }
    }
}

/// The memory a cache's pages live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PageMemory {
    /// Ordinary memfds (tmpfs): pages of any size, THP folios where the host makes them.
    Shmem,
    /// `MFD_HUGETLB` memfds of this page size (bytes).
    Hugetlb(u64),
}

impl PageMemory {
    /// The unit of mapping and allocation: the huge page for hugetlb, else the system page.
    pub(crate) fn granule(self) -> usize {
        match self {
            PageMemory::Hugetlb(h) => h as usize,
            PageMemory::Shmem => rustix::param::page_size(),
        }
    }
}

/// What the host offers, read from sysfs.
#[derive(Debug, Clone, Default)]
pub(crate) struct Host {
    /// The PMD-sized huge page (`hpage_pmd_size`), 0 if the host has no THP support.
    pub(crate) pmd: u64,
    /// The hugetlb pool of that size: free and total pages.
    pub(crate) free: u64,
    pub(crate) total: u64,
    /// `shmem_enabled`'s selected value (`never`, `always`, …), empty if unknown.
    pub(crate) shmem_thp: String,
}

/// "4 KiB", "2 MiB", "1 GiB".
fn size_name(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}

fn read_sys(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// The bracketed choice of a sysfs setting such as `always within_size [never] deny force`.
fn selected(s: &str) -> String {
    s.split_whitespace().find(|w| w.starts_with('[')).map_or(s, |w| w.trim_matches(['[', ']'])).to_string()
}

impl Host {
    pub(crate) fn read() -> Host {
        let thp = "/sys/kernel/mm/transparent_hugepage";
        let pmd = read_sys(&format!("{thp}/hpage_pmd_size")).and_then(|s| s.parse().ok()).unwrap_or(2 << 20);
        let pool = format!("/sys/kernel/mm/hugepages/hugepages-{}kB", pmd >> 10);
        let num = |f: &str| read_sys(&format!("{pool}/{f}")).and_then(|s| s.parse().ok()).unwrap_or(0);
        Host {
            pmd,
            free: num("free_hugepages"),
            total: num("nr_hugepages"),
            shmem_thp: read_sys(&format!("{thp}/shmem_enabled")).map(|s| selected(&s)).unwrap_or_default(),
        }
    }

    /// Whether tmpfs allocates THP folios for pages written with `pwrite` (no VMA advice).
    fn shmem_thp_on_write(&self) -> bool {
        matches!(self.shmem_thp.as_str(), "always" | "within_size" | "force")
    }
}

/// The cache's page memory and page size, and the sentence `CacheStats::page_memory` shows.
#[derive(Debug, Clone)]
pub(crate) struct Choice {
    pub(crate) memory: PageMemory,
    pub(crate) page_size: usize,
    pub(crate) report: String,
}

/// Choose, for a cache asked for `ask` with `page_size` (`page_size_set`: the caller chose it)
/// and `budget` bytes. `hugetlb_faults`: `None` if mappings will not use userfaultfd, else
/// whether its minor and missing faults work on hugetlb (without them the hugetlb path
/// would leave mappings unable to fault).
pub(crate) fn choose(
    ask: HugePages,
    page_size: usize,
    page_size_set: bool,
    budget: u64,
    hugetlb_faults: Option<bool>,
    host: &Host,
) -> Result<Choice> {
    let mib = |b: u64| b >> 20;
    let plain = |why: String| Choice {
        memory: PageMemory::Shmem,
        page_size,
        report: format!("shmem, {} pages ({why})", size_name(page_size as u64)),
    };
    if ask == HugePages::Never {
        return Ok(plain("huge pages not asked for".into()));
    }
    let pmd = host.pmd;
    if page_size_set && page_size as u64 != pmd {
        return Err(Error::InvalidArgument(format!(
            "huge pages need the page size left at its default or set to the huge page size ({} KiB), not {} KiB",
            pmd >> 10,
            page_size >> 10
        )));
    }
    let need = budget.div_ceil(pmd);
    let hugetlb_no = if host.total == 0 {
        format!("no {} MiB hugetlb pages are reserved (/proc/sys/vm/nr_hugepages is 0)", mib(pmd))
    } else if host.free < need {
        format!(
            "{} of {} reserved {} MiB hugetlb pages are free, the budget needs {need}",
            host.free,
            host.total,
            mib(pmd)
        )
    } else if hugetlb_faults == Some(false) {
        "userfaultfd cannot resolve faults on hugetlb memory (no MINOR_HUGETLBFS/MISSING_HUGETLBFS)".into()
    } else {
        return Ok(Choice {
            memory: PageMemory::Hugetlb(pmd),
            page_size: pmd as usize,
            report: format!(
                "hugetlb, {} MiB pages ({} of {} pool pages free at build, the budget takes {need})",
                mib(pmd),
                host.free,
                host.total
            ),
        });
    };
    if host.shmem_thp_on_write() {
        return Ok(Choice {
            memory: PageMemory::Shmem,
            page_size: pmd as usize,
            report: format!(
                "shmem THP, {} MiB pages mapped in 4 KiB PTEs (shmem_enabled is {}; not hugetlb: {hugetlb_no})",
                mib(pmd),
                host.shmem_thp
            ),
        });
    }
    let thp_no = format!(
        "shmem THP is '{}' (ubc writes pages with pwrite, which takes huge folios only with always, within_size or force)",
        if host.shmem_thp.is_empty() { "unknown" } else { &host.shmem_thp }
    );
    if ask == HugePages::Require {
        return Err(Error::InvalidArgument(format!("huge pages required but unavailable: {hugetlb_no}; {thp_no}")));
    }
    Ok(plain(format!("huge pages tried: {hugetlb_no}; {thp_no}")))
}

/// Keep glibc from holding on to page-sized buffers, for a cache of `page_size` pages. A
/// page is what the layers transform and the pagers move in one piece, so with 2 MiB pages
/// every fill and writeback through a general layer allocates and frees 2 MiB buffers on
/// many threads. glibc's dynamic mmap threshold rises to the largest such buffer freed, after
/// which they come from per-thread arenas that keep the memory: a `dir | aead | zstd` mount
/// with a 64 MiB budget on huge pages held 629 MiB of heap after 45 s of 4 KiB random
/// writes (31 MiB on 4 KiB pages), 35 MiB with the threshold fixed at 1 MiB — where buffers
/// of a megabyte or more are mapped and unmapped whole. So a cache with pages of 1 MiB or
/// more fixes the threshold there (process-wide, as `mallopt` is), unless the program set
/// `MALLOC_MMAP_THRESHOLD_` itself.
pub(crate) fn return_page_buffers(page_size: usize) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if page_size >= 1 << 20 && std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        // SAFETY: mallopt only changes an allocator tunable; any value is accepted or refused.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = page_size;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(free: u64, total: u64, thp: &str) -> Host {
        Host { pmd: 2 << 20, free, total, shmem_thp: thp.into() }
    }

    #[test]
    fn choices_follow_the_pool_and_the_thp_setting() {
        let mib = 1u64 << 20;
        let c = choose(HugePages::Try, 4096, false, 64 * mib, Some(true), &host(32, 40, "never")).unwrap();
        assert_eq!(c.memory, PageMemory::Hugetlb(2 * mib));
        assert_eq!(c.page_size, 2 << 20);
        // One page short of the budget: not hugetlb; THP off: ordinary pages, saying why.
        let c = choose(HugePages::Try, 4096, false, 64 * mib, Some(true), &host(31, 40, "never")).unwrap();
        assert_eq!((c.memory, c.page_size), (PageMemory::Shmem, 4096));
        assert!(c.report.contains("31 of 40") && c.report.contains("needs 32"), "{}", c.report);
        let c = choose(HugePages::Try, 4096, false, 64 * mib, Some(true), &host(0, 0, "within_size")).unwrap();
        assert_eq!((c.memory, c.page_size), (PageMemory::Shmem, 2 << 20));
        assert!(c.report.starts_with("shmem THP"), "{}", c.report);
        // Faults that cannot work on hugetlb rule it out.
        let c = choose(HugePages::Try, 4096, false, 8 * mib, Some(false), &host(32, 40, "advise")).unwrap();
        assert_eq!(c.memory, PageMemory::Shmem);
        assert!(c.report.contains("MINOR_HUGETLBFS"), "{}", c.report);
        // Populate mode (no userfaultfd) has no such need.
        let c = choose(HugePages::Try, 4096, false, 8 * mib, None, &host(32, 40, "never")).unwrap();
        assert_eq!(c.memory, PageMemory::Hugetlb(2 * mib));
        // Require: an error saying both reasons.
        let e = choose(HugePages::Require, 4096, false, 8 * mib, Some(true), &host(0, 0, "never")).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("nr_hugepages is 0") && m.contains("'never'")),
            "{e}"
        );
        // A page size that is not the huge page size.
        assert!(choose(HugePages::Try, 65536, true, 8 * mib, Some(true), &host(32, 40, "never")).is_err());
        let c = choose(HugePages::Never, 65536, true, 8 * mib, Some(true), &host(32, 40, "always")).unwrap();
        assert_eq!((c.memory, c.page_size), (PageMemory::Shmem, 65536));
    }

    #[test]
    fn sysfs_choices_are_read_from_their_brackets() {
        assert_eq!(selected("always within_size advise [never] deny force"), "never");
        assert_eq!(selected("[always] madvise never"), "always");
        assert_eq!(selected("never"), "never");
    }
}

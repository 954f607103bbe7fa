//! The cache: the registry of objects, and the threads and decisions that walk it — reclaim
//! and the page daemon (`cache/pdaemon.rs`), the flusher (`cache/flusher.rs`), keeping closed
//! files cached up to a limit, statistics and shutdown. The budget, policy, windows and
//! write-behind accounting every object draws on are the [`Resources`] below the objects;
//! the cache builds them and installs itself as their [`Reclaim`].
//!
//! Page daemon (NetBSD `uvm_pdaemon.c`, Linux `kswapd`). A background thread keeps free space
//! between a low and a high watermark, so foreground fills rarely have to reclaim themselves.
//! Reclaim asks the policy for victims; a victim the policy wants but which is dirty is
//! written back (clustered) and taken on the next round.

use crate::error::{Error, Result};
use crate::evict::PolicyKind;
use crate::huge::HugePages;
use crate::map::Serve;
use crate::object::{Object, ObjectKey, ObjectRef, WorkHold};
use crate::pager::{Identity, Pager};
use crate::resources::{DirtyAccount, Geometry, Parts, Reclaim, Resources};
use crate::stats::CacheStats;
use crate::window::Windows;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::thread::JoinHandle;
use std::time::Duration;

mod flusher;
mod pdaemon;

/// Largest window size the builder accepts (1 GiB).
const MAX_WINDOW: usize = 1 << 30;
/// Threads syncing objects at once in [`Cache::sync_all`] (the caller and helpers).
const SYNC_WORKERS: usize = 16;
/// Fewest pagers of one file system that [`Cache::sync_all`] syncs with one `syncfs`.
const SYNC_FS_MIN: usize = 16;

/// Call `f(i)` for every `i` in `0..n`, on this thread and on up to `SYNC_WORKERS - 1`
/// helpers (fewer for fewer items), each taking the next index until none is left; returns
/// when every call has. A helper that cannot be started is done without.
fn run_workers(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || {
        loop {
            let i = next.fetch_add(1, Relaxed);
            if i >= n {
                break;
            }
            f(i);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..SYNC_WORKERS.min(n) {
            let _ = std::thread::Builder::new().name("ubc-sync".into()).spawn_scoped(s, work);
        }
        work();
    });
}

/// Physical memory plus swap, in bytes (`u64::MAX` if the host does not say).
fn machine_memory() -> u64 {
    // SAFETY: sysinfo only writes the struct we pass.
    let mut si: libc::sysinfo = unsafe { std::mem::zeroed() };
    if unsafe { libc::sysinfo(&mut si) } != 0 {
        return u64::MAX;
    }
    (si.totalram as u64).saturating_add(si.totalswap as u64).saturating_mul(si.mem_unit.max(1) as u64)
}

/// How a cache is set up. Build with [`Cache::builder`].
#[derive(Debug, Clone)]
pub struct CacheBuilder {
    budget: u64,
    page_size: usize,
    /// Whether `page_size` was set (huge pages then keep it only if it is the huge size).
    page_size_set: bool,
    huge_pages: HugePages,
    window_size: usize,
    max_windows: Option<usize>,
    policy: PolicyKind,
    max_fill: usize,
    max_put: usize,
    daemon: bool,
    low_watermark: Option<u64>,
    high_watermark: Option<u64>,
    reserve_timeout: Duration,
    max_objects: Option<usize>,
    readahead_init: usize,
    readahead_max: usize,
    io_threads: usize,
    writeback_interval: Duration,
    dirty_expire: Duration,
    dirty_background_percent: u64,
    dirty_limit_percent: u64,
    userfaultfd: bool,
    fault_threads: usize,
    watch_pressure: bool,
    xip: bool,
}

impl Default for CacheBuilder {
    fn default() -> Self {
        CacheBuilder {
            budget: 256 << 20,
            page_size: 4096,
            page_size_set: false,
            huge_pages: HugePages::Never,
            window_size: 2 << 20,
            max_windows: None,
            policy: PolicyKind::default(),
            max_fill: 256 << 10,
            max_put: 1 << 20,
            daemon: true,
            low_watermark: None,
            high_watermark: None,
            reserve_timeout: Duration::from_secs(10),
            max_objects: None,
            readahead_init: 128 << 10,
            readahead_max: 2 << 20,
            io_threads: 4,
            writeback_interval: Duration::from_secs(5),
            dirty_expire: Duration::from_secs(30),
            dirty_background_percent: 10,
            dirty_limit_percent: 30,
            userfaultfd: true,
            fault_threads: 2,
            watch_pressure: true,
            xip: true,
        }
    }
}

impl CacheBuilder {
    /// Memory budget in bytes for all cached pages (default 256 MiB): at least two pages,
    /// at most the machine's memory and swap.
    pub fn budget(mut self, bytes: u64) -> Self {
        self.budget = bytes;
        self
    }
    /// Page size: a power of two, at least the system page size (default 4 KiB).
    pub fn page_size(mut self, bytes: usize) -> Self {
        self.page_size = bytes;
        self.page_size_set = true;
        self
    }
    /// Huge pages for the cache's memory (default `Never`; see [`HugePages`]). With `Try` or
    /// `Require` the page size is the huge page size (2 MiB on x86-64) when a huge-page path
    /// is taken; leave [`CacheBuilder::page_size`] unset or set it to that size.
    /// `CacheStats::page_memory` says which memory the cache got, and why.
    pub fn huge_pages(mut self, h: HugePages) -> Self {
        self.huge_pages = h;
        self
    }
    /// UBC's execute-in-place (default on): a file whose store keeps its bytes in shared
    /// memory and offers it ([`Pager::memory`](crate::Pager::memory): files of the `mem`
    /// layer, [`ShmPager`](crate::pager::ShmPager), host files on tmpfs and memfds) is read,
    /// written and mapped in the store's own pages, with no copy in the cache and nothing
    /// charged to the budget. Off, such files are cached like any other. Always off for a
    /// cache of hugetlb pages (the stores' pages are shmem pages).
    pub fn xip(mut self, on: bool) -> Self {
        self.xip = on;
        self
    }
    /// Bytes mapped by one window: a power of two, a multiple of the page size, at most
    /// 1 GiB (default 2 MiB).
    pub fn window_size(mut self, bytes: usize) -> Self {
        self.window_size = bytes;
        self
    }
    /// Most window mappings alive at once (default: enough for eight times the budget,
    /// 64..=4096).
    pub fn max_windows(mut self, n: usize) -> Self {
        self.max_windows = Some(n);
        self
    }
    /// Replacement policy (default: [`PolicyKind::default`]).
    pub fn policy(mut self, policy: PolicyKind) -> Self {
        self.policy = policy;
        self
    }
    /// Largest cluster read by one `get_pages` call on a miss (default 256 KiB).
    pub fn max_fill(mut self, bytes: usize) -> Self {
        self.max_fill = bytes;
        self
    }
    /// Largest cluster written by one `put_pages` call (default 1 MiB).
    pub fn max_put(mut self, bytes: usize) -> Self {
        self.max_put = bytes;
        self
    }
    /// Run the background page daemon (default true). Without it, all reclaim is direct.
    pub fn daemon(mut self, on: bool) -> Self {
        self.daemon = on;
        self
    }
    /// Free bytes below which the page daemon wakes, and up to which it frees
    /// (defaults: 1/256 and 1/128 of the budget, at least 8 and 16 pages).
    pub fn watermarks(mut self, low: u64, high: u64) -> Self {
        self.low_watermark = Some(low);
        self.high_watermark = Some(high);
        self
    }
    /// How long a fill may wait for room (pinned pages to be released, dirty pages whose
    /// writeback fails to be written) before it fails (default 10 s): with the writeback
    /// error if one kept pages from leaving, else [`Error::BudgetExceeded`].
    pub fn reserve_timeout(mut self, t: Duration) -> Self {
        self.reserve_timeout = t;
        self
    }

    /// Most files kept cached after their last handle is closed (like NetBSD's
    /// `maxvnodes`). Each usually holds the pager's file descriptor (its pages are a slice of
    /// a memfd the cache's objects share); beyond this,
    /// the least recently closed are written back and dropped. Default: a quarter of the
    /// open-file limit, 64..=16384.
    pub fn max_cached_files(mut self, n: usize) -> Self {
        self.max_objects = Some(n);
        self
    }

    /// Read-ahead window: first window `init` bytes, doubling per window up to `max`
    /// (defaults 128 KiB and 2 MiB). `max` 0 turns read-ahead off.
    pub fn readahead(mut self, init: usize, max: usize) -> Self {
        self.readahead_init = init;
        self.readahead_max = max;
        self
    }

    /// Threads doing background I/O (read-ahead, writeback) per pager depth; default 4. A
    /// stack of layers gets one pool per depth (started on first use), so that a layer's
    /// background I/O never waits for a thread that is itself waiting for it (`io.rs`).
    pub fn io_threads(mut self, n: usize) -> Self {
        self.io_threads = n;
        self
    }

    /// Write-behind timing: the flusher wakes every `interval` and writes back files dirty
    /// for longer than `expire` (defaults 5 s and 30 s, as Linux).
    pub fn writeback(mut self, interval: Duration, expire: Duration) -> Self {
        self.writeback_interval = interval;
        self.dirty_expire = expire;
        self
    }

    /// Dirty memory thresholds, in percent of the budget: above `background` the flusher
    /// writes back in the background; writers are slowed smoothly above the midpoint and
    /// never let dirty (and in-writeback) memory pass `limit` (defaults 10 and 30).
    pub fn dirty_ratios(mut self, background: u64, limit: u64) -> Self {
        self.dirty_background_percent = background;
        self.dirty_limit_percent = limit;
        self
    }

    /// Serve memory mappings with userfaultfd (default) or, with `false`, by populating and
    /// pinning each mapping's pages (the fallback used when userfaultfd is missing).
    pub fn userfaultfd(mut self, on: bool) -> Self {
        self.userfaultfd = on;
        self
    }

    /// Give memory back under pressure (default on): in a memory-limited cgroup the page
    /// daemon keeps a headroom free under the limit by withholding part of the budget (down
    /// to a floor: a sixteenth of it, at least two of the largest fills), and hands it back when the pressure ends. `CacheStats::
    /// withheld_bytes` shows how much is withheld.
    pub fn memory_pressure(mut self, on: bool) -> Self {
        self.watch_pressure = on;
        self
    }

    /// Threads resolving faults on mappings (default 2; started on the first `map`).
    pub fn fault_threads(mut self, n: usize) -> Self {
        self.fault_threads = n.max(1);
        self
    }

    /// Check the settings and start the cache (and its page daemon).
    pub fn build(mut self) -> Result<Cache> {
        let sys_page = rustix::param::page_size();
        let hugetlb_faults = self.userfaultfd.then(crate::map::hugetlb_faults);
        let choice = crate::huge::choose(
            self.huge_pages,
            self.page_size,
            self.page_size_set,
            self.budget,
            hugetlb_faults,
            &crate::huge::Host::read(),
        )?;
        if choice.page_size != self.page_size {
            // Huge pages chose the page size. A chunk (a window's worth of pages) bounds a
            // fault's cluster and a read-ahead fill: at one 2 MiB page per chunk, every
            // sequential fault read its page alone and synchronously. 16 pages per window.
            self.page_size = choice.page_size;
            self.window_size = self.window_size.max(16 * self.page_size);
            // Read-ahead in pages: a window of one 2 MiB page has nothing to run ahead with
            // (the default 2 MiB maximum is one page), so streams read each page when
            // touched. Two pages to start, eight at most.
            self.readahead_init = self.readahead_init.max(2 * self.page_size);
            self.readahead_max = self.readahead_max.max(8 * self.page_size);
        }
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if !self.page_size.is_power_of_two() || self.page_size < sys_page {
            return bad(format!("page size {} must be a power of two >= {sys_page}", self.page_size));
        }
        // Each chunk keeps a state word per page of its window: a giant window would make
        // the first access allocate a giant table.
        if !self.window_size.is_power_of_two() || self.window_size < self.page_size || self.window_size > MAX_WINDOW {
            return bad(format!(
                "window size {} must be a power of two from the page size to {MAX_WINDOW}",
                self.window_size
            ));
        }
        let budget_pages = self.budget / self.page_size as u64;
        if budget_pages < 2 {
            return bad(format!("budget {} B is smaller than two pages of {} B", self.budget, self.page_size));
        }
        // The replacement policy sizes its tables by the budget: a budget no machine could
        // hold would abort on allocation (or overflow) instead of being refused.
        let memory = machine_memory();
        if self.budget > memory {
            return bad(format!("budget {} B is more than the machine's memory and swap ({memory} B)", self.budget));
        }
        crate::huge::return_page_buffers(self.page_size);
        let page_shift = self.page_size.trailing_zeros();
        let chunk_shift = (self.window_size / self.page_size).trailing_zeros();
        let pages = |b: usize| ((b / self.page_size).max(1)) as u64;
        let max_windows = self
            .max_windows
            // Eight times the budget: pages spread by random access over a file several times
            // the budget sit in that many chunks, and a window retired and remade on a miss
            // (munmap, mmap, a page-table fault per page touched) cost ~17 µs per miss at 4x
            // (issue 19). A window costs a VMA and a page-table page.
            .unwrap_or_else(|| ((self.budget.saturating_mul(8) / self.window_size as u64) as usize).clamp(64, 4096));
        // Small watermarks (Linux's are a fraction of a percent of memory): the free pages
        // between them are budget a full cache does not use. 1/256 and 1/128 keep ≥ 99 % of
        // the budget resident and are still hundreds of misses ahead of demand at 64 MiB.
        let low = self.low_watermark.map_or((budget_pages / 256).max(8), |b| b / self.page_size as u64);
        let high = self.high_watermark.map_or((budget_pages / 128).max(16), |b| b / self.page_size as u64);
        let max_objects = self.max_objects.unwrap_or_else(|| {
            let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(1024);
            (nofile as usize / 4).clamp(64, 16384)
        });
        if self.dirty_limit_percent == 0
            || self.dirty_limit_percent > 90
            || self.dirty_background_percent >= self.dirty_limit_percent
        {
            return bad(format!(
                "dirty ratios must satisfy 0 <= background ({}) < limit ({}) <= 90",
                self.dirty_background_percent, self.dirty_limit_percent
            ));
        }
        let ra_max = (self.readahead_max / self.page_size) as u64;
        let geo = Geometry {
            ra_max_pages: ra_max.min(budget_pages / 8),
            ra_init_pages: ((self.readahead_init / self.page_size) as u64).clamp(1, ra_max.max(1)),
            page_shift,
            page_size: self.page_size,
            chunk_shift,
            budget_pages,
            // A fill never takes more than a quarter of the budget, so one request cannot
            // starve everyone else of memory.
            max_fill_pages: pages(self.max_fill).min(1 << chunk_shift).min((budget_pages / 4).max(1)),
            max_put_pages: pages(self.max_put).min(1 << chunk_shift),
            low_free: low.min(budget_pages / 2),
            // 1/16 of the budget, at most 16 MiB of 4 KiB pages; none for toy budgets
            // (tests of a few pages), where it would be most of the cache.
            reserve_pages: if budget_pages < 64 { 0 } else { (budget_pages / 16).min(4096) },
            high_free: high.max(low).min(budget_pages / 2),
            reserve_timeout: self.reserve_timeout,
        };
        let res = Arc::new(Resources::new(
            geo,
            Parts {
                dirty: DirtyAccount::new(
                    budget_pages * self.dirty_background_percent / 100,
                    (budget_pages * self.dirty_limit_percent / 100).max(2),
                ),
                io: crate::io::IoPool::new(self.io_threads),
                serve: if self.userfaultfd { Serve::Userfaultfd } else { Serve::Populate },
                fault_threads: self.fault_threads,
                policy_name: self.policy.to_string(),
                policy: self.policy.build(budget_pages as usize),
                windows: Windows::new(self.window_size, max_windows),
                page_memory: choice,
                watch_pressure: self.watch_pressure,
                xip: self.xip,
            },
        ));
        let core = Arc::new(CacheCore {
            res: res.clone(),
            max_objects,
            flusher: flusher::Flusher::new(self.writeback_interval, self.dirty_expire),
            registry: RwLock::new(Registry::default()),
            daemon_thread: Mutex::new(None),
            next_id: AtomicU64::new(1),
            daemon_runs: AtomicU64::new(0),
            daemon_evictions: AtomicU64::new(0),
            unsynced_domains: Mutex::new(Vec::new()),
        });
        let up: std::sync::Weak<dyn Reclaim> = Arc::downgrade(&core) as _;
        res.install(up);
        if self.daemon {
            CacheCore::start_daemon(&core)?;
        }
        core.flusher.start(core.clone());
        Ok(Cache { core: core.clone(), _handle: Some(Arc::new(Handle { core })) })
    }
}

#[derive(Default)]
pub(crate) struct Registry {
    pub(crate) by_id: ById,
    by_identity: Identities,
    /// Objects in the order their last handle was closed (may hold stale ids: an object
    /// reopened or already forgotten is skipped when popped).
    closed: std::collections::VecDeque<u64>,
}

/// The listed objects, by id: the objects themselves in a table hashed by their ids (a
/// `HashMap<u64, Arc<Object>>` held each id twice: 17 bytes a slot where this takes 9).
#[derive(Default)]
pub(crate) struct ById {
    table: hashbrown::HashTable<Arc<Object>>,
    hasher: std::hash::RandomState,
}

impl ById {
    fn hash(&self, id: u64) -> u64 {
        self.hasher.hash_one(id)
    }

    pub(crate) fn get(&self, id: u64) -> Option<&Arc<Object>> {
        self.table.find(self.hash(id), |o| o.id == id)
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &Arc<Object>> {
        self.table.iter()
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    fn contains(&self, id: u64) -> bool {
        self.get(id).is_some()
    }

    /// List `o`. Precondition: no listed object has its id (ids are never reused).
    fn insert(&mut self, o: Arc<Object>) {
        let hasher = &self.hasher;
        self.table.insert_unique(hasher.hash_one(o.id), o, |x| hasher.hash_one(x.id));
    }

    fn remove(&mut self, id: u64) -> Option<Arc<Object>> {
        self.table.find_entry(self.hash(id), |o| o.id == id).ok().map(|e| e.remove().0)
    }

    fn drain(&mut self) -> impl Iterator<Item = Arc<Object>> + '_ {
        self.table.drain()
    }
}

/// Which listed object is the current one for each key (an object that was forgotten, see
/// [`Cache::forget`], stays listed without being current): the objects' ids in a table
/// hashed by their keys, which live in the objects — a map from key to id held every key
/// twice (an `ObjectKey` is 40 bytes, and a host file's path-named key more) and took 49
/// bytes a slot where this takes 9.
///
/// Invariant: every id in the table is listed in `by_id` (ids leave the table before or
/// with the object's entry), so the table's rehash can find each id's key.
#[derive(Default)]
struct Identities {
    table: hashbrown::HashTable<u64>,
    hasher: std::hash::RandomState,
}

impl Identities {
    fn hash(&self, key: &ObjectKey) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The current object's id for `key`.
    fn get(&self, key: &ObjectKey, by_id: &ById) -> Option<u64> {
        self.table.find(self.hash(key), |&id| by_id.get(id).is_some_and(|o| o.key == *key)).copied()
    }

    /// Make listed object `id` the current one for its key. Precondition: `id` is in
    /// `by_id`, and its key has no current object (`get` said so under the same lock).
    fn insert(&mut self, id: u64, by_id: &ById) {
        let key = |id: u64| &by_id.get(id).expect("listed (the table's invariant)").key;
        let h = self.hash(key(id));
        let hasher = &self.hasher;
        self.table.insert_unique(h, id, |&id| hasher.hash_one(key(id)));
    }

    /// `id` is no longer current for `key` (its object's key), if it was.
    fn remove_id(&mut self, key: &ObjectKey, id: u64) {
        if let Ok(e) = self.table.find_entry(self.hash(key), |&x| x == id) {
            e.remove();
        }
    }

    /// `key` has no current object any more.
    fn remove_key(&mut self, key: &ObjectKey, by_id: &ById) {
        let h = self.hash(key);
        if let Ok(e) = self.table.find_entry(h, |&id| by_id.get(id).is_some_and(|o| o.key == *key)) {
            e.remove();
        }
    }

    fn clear(&mut self) {
        self.table.clear();
    }
}

pub(crate) struct CacheCore {
    /// What objects draw on: budget, policy, windows, I/O, mappings, dirty accounting.
    pub(crate) res: Arc<Resources>,
    max_objects: usize,
    /// The flusher thread and its timing.
    flusher: flusher::Flusher,
    pub(crate) registry: RwLock<Registry>,
    daemon_thread: Mutex<Option<JoinHandle<()>>>,
    next_id: AtomicU64,
    daemon_runs: AtomicU64,
    daemon_evictions: AtomicU64,
    /// File systems that stores of forgotten objects wrote to since their last sync, each
    /// with a way to sync it that holds none of those stores (`Pager::domain_syncer`; see
    /// `CacheCore::remember_unsynced`). A leaf lock.
    unsynced_domains: Mutex<Vec<(u64, crate::pager::DomainSyncer)>>,
}

impl CacheCore {
    /// A hold on the listed object `id`, for work apart from its handles (`holders.rs`).
    pub(crate) fn hold(&self, id: u64) -> Option<WorkHold> {
        self.registry.read().by_id.get(id).and_then(|o| WorkHold::of(&o.me))
    }

    /// References to the listed objects `keep` accepts, not keeping them alive: work on
    /// many objects takes a hold on each when it comes to it (`holders.rs`), so that it
    /// never delays the last close of another.
    pub(crate) fn listed(&self, keep: impl Fn(&Object) -> bool) -> Vec<ObjectRef> {
        self.registry.read().by_id.values().filter(|o| keep(o)).map(ObjectRef::of).collect()
    }

    /// The last handle of `obj` was closed, or its last page evicted (`why`): forget it if
    /// it holds no pages, else remember when it was closed; then keep the number of cached
    /// closed objects within `max_objects`.
    pub(crate) fn object_idle(&self, obj: &Object, why: Idle) {
        let closed_now = why == Idle::Closed;
        if obj.handles.load(SeqCst) != 0 {
            return;
        }
        if closed_now {
            // Read-ahead state is for readers; a file reopened starts its streams afresh.
            *obj.ra_streams.lock() = None;
        }
        let mut reg = self.registry.write();
        // Re-check under the lock: `open` takes handles under it.
        if obj.handles.load(SeqCst) != 0 {
            return;
        }
        if obj.resident_pages() == 0 {
            let gone = Self::forget_locked(&mut reg, obj.id);
            drop(reg);
            self.remember_unsynced(gone.as_deref());
            drop(gone); // may run Object::drop, which takes other locks
            return;
        }
        if closed_now {
            reg.closed.push_back(obj.id);
        }
        let excess = reg.by_id.len().saturating_sub(self.max_objects);
        let mut victims = Vec::new();
        while victims.len() < excess {
            let Some(id) = reg.closed.pop_front() else { break };
            if let Some(o) = reg.by_id.get(id)
                && o.handles.load(SeqCst) == 0
                && !victims.iter().any(|v: &Arc<Object>| v.id == id)
            {
                victims.push(o.clone());
            }
        }
        // Bound the queue of stale ids too.
        if reg.closed.len() > self.max_objects.saturating_mul(2).saturating_add(64) {
            let Registry { by_id, closed, .. } = &mut *reg;
            closed.retain(|&id| by_id.contains(id));
        }
        drop(reg);
        for v in victims {
            self.deactivate(&v);
        }
    }

    /// Write back and evict every page of a closed object, then forget it. Runs without the
    /// registry lock (lock order is policy → registry), so a concurrent open may attach:
    /// only clean, unheld pages are evicted, and the object is forgotten only if it is still
    /// closed and empty. An object whose writeback fails keeps its dirty pages and stays.
    fn deactivate(&self, obj: &Arc<Object>) {
        // Inside a pager call this writeback could need the locks the caller holds (see
        // `PagerScope`): leave it to the next close or reclaim outside one.
        if obj.dirty_pages() > 0 && !crate::order::may_call_pager(obj.depth()) {
            self.registry.write().closed.push_back(obj.id);
            return;
        }
        if obj.writeback(0, u64::MAX, crate::object::Pass::Wait).is_err() {
            self.registry.write().closed.push_back(obj.id);
            return;
        }
        obj.evict_clean();
        let mut reg = self.registry.write();
        if obj.handles.load(SeqCst) == 0 && obj.resident_pages() == 0 {
            let gone = Self::forget_locked(&mut reg, obj.id);
            drop(reg);
            self.remember_unsynced(gone.as_deref());
            drop(gone);
        }
    }

    fn forget_locked(reg: &mut Registry, id: u64) -> Option<Arc<Object>> {
        let o = reg.by_id.remove(id)?;
        o.holders.unlist();
        reg.by_identity.remove_id(&o.key, id);
        Some(o)
    }

    /// `o` was just forgotten (no handle, no page). A store it changed since its last sync
    /// — pages written back by reclaim, then the last page evicted, all before any sync —
    /// would be out of reach of the next `sync_all`, which syncs the objects it knows: for
    /// a host file written with direct I/O its data is on the device but its size and new
    /// blocks are not committed. So its file system is remembered, with a way to sync it
    /// that holds no file open (`Pager::domain_syncer`: for a host file, a directory of its
    /// file system), and the next `sync_all` syncs it — as the kernel's `sync` reaches an
    /// inode whose pages it already dropped. A store that offers none (a layer, memory, a
    /// file system where ubc knows no directory) is not followed: a layer's data lives in
    /// the files below, whose objects are followed in turn. => called without the
    /// registry's lock (the pager may take the descriptor pool's).
    fn remember_unsynced(&self, o: Option<&Object>) {
        let Some(o) = o.filter(|o| o.needs_sync()) else { return };
        let Some(d) = o.sync_domain() else { return };
        if self.unsynced_domains.lock().iter().any(|(x, _)| *x == d) {
            return;
        }
        if let Some(syncer) = o.pager().domain_syncer() {
            let mut u = self.unsynced_domains.lock();
            if !u.iter().any(|(x, _)| *x == d) {
                u.push((d, syncer));
            }
        }
    }

    fn stats(&self) -> CacheStats {
        let res = &*self.res;
        let mut totals = res.retired();
        let mut allocated = 0;
        let objects = self.listed(|_| true);
        for o in objects.iter().filter_map(ObjectRef::hold) {
            totals.add(&o.stats());
            allocated += o.own_allocated_bytes();
        }
        // The cache-wide resident count is the reservation counter, not the sum over objects:
        // the sum is read object by object while pages move between them, so it can count a
        // page twice. The counter includes pages being filled (their memory is committed).
        allocated += res.arena.allocated_bytes();
        let g = &res.geo;
        totals.resident_bytes = res.resident.load(SeqCst) << g.page_shift;
        let w = res.windows.stats();
        let maps = res.maps.get();
        let (loans, loans_taken, loan_copies, loan_pages_handed_back, loan_views) = res.loans.counts();
        CacheStats {
            totals,
            budget_bytes: g.budget_pages << g.page_shift,
            allocated_bytes: allocated,
            shared_memfds: res.arena.memfds(),
            page_size: g.page_size,
            objects: objects.len(),
            windows: w.live,
            window_maps: w.maps,
            window_retires: w.retires,
            daemon_runs: self.daemon_runs.load(Relaxed),
            daemon_evictions: self.daemon_evictions.load(Relaxed),
            policy: leak_name(&res.policy_name),
            policy_pages: res.policy.lock().len() as u64,
            unclean_bytes: res.dirty.unclean() << g.page_shift,
            dirty_limit_bytes: res.dirty.limit << g.page_shift,
            throttled_ms: res.dirty.throttled_us.load(Relaxed) / 1000,
            flusher_runs: self.flusher.runs.load(Relaxed),
            page_memory: res.page_memory.clone(),
            map_mode: maps.map_or_else(|| "none yet".to_string(), |m| m.mode.clone()),
            mappings: maps.map_or(0, |m| m.live()),
            map_faults: maps.map_or(0, |m| m.faults.load(Relaxed)),
            map_fault_pages: maps.map_or(0, |m| m.fault_pages.load(Relaxed)),
            map_sigbus: maps.map_or(0, |m| m.sigbus.load(Relaxed)),
            map_dirty_found: maps.map_or(0, |m| m.scan_dirty.load(Relaxed)),
            withheld_bytes: res.withheld_pages.load(Relaxed) << g.page_shift,
            private_copy_bytes: {
                res.count_private_copies();
                res.private_pages.load(Relaxed) << g.page_shift
            },
            loans,
            loans_taken,
            loan_copies,
            loan_pages_handed_back,
            loan_views,
            locked_bytes: res.locks.locked_pages() << g.page_shift,
            unlock_requests: res.locks.requests.load(Relaxed),
            unlock_refusals: res.locks.refused.load(Relaxed),
            loan_copy_bytes: res.loans.copied_now() << g.page_shift,
        }
    }

    /// Write back every dirty page of every object and sync its pager; the first error is
    /// returned.
    ///
    /// A small file's sync is two waits for the device — its write, then the pager's
    /// `fdatasync` (a flush of the device's cache) — and one thread syncing files in turn
    /// pays both for each (231-241 µs per 4 KiB file here, against 28 µs for `std::fs`
    /// writes and one `syncfs`). So: objects are written back by up to [`SYNC_WORKERS`]
    /// threads at once (the device queues their writes), and the pagers of one file
    /// system that can be synced together ([`Pager::sync_domain`]: host files written with
    /// direct I/O) get one [`Pager::sync_fs`] (`syncfs(2)`) once all of them are written
    /// back, when there are at least [`SYNC_FS_MIN`] of them — a `syncfs` also writes
    /// whatever else is dirty on that file system, which a few files are not worth. Every
    /// other pager is synced on its own by the worker that wrote it back. If the `syncfs`
    /// fails, each of its pagers is synced on its own, so that the error reaches the
    /// handles of the file it belongs to. Workers sync whole objects as a thread calling
    /// [`crate::File::sync`] does, in no particular order between objects (a layer's object
    /// and the one below it), as before.
    fn sync_all(&self) -> Result<()> {
        // Only those with something to sync (`Object::needs_sync`): a cache of files synced
        // before (or never written) neither starts helpers nor syncs a file system. Held one
        // at a time, as each is worked on (`holders.rs`).
        let objects = self.listed(|o| o.needs_sync());
        if objects.is_empty() && self.unsynced_domains.lock().is_empty() {
            return Ok(());
        }
        // Group by file system first: a domain with too few members is synced per object.
        let mut domains: HashMap<u64, Vec<usize>> = HashMap::new();
        for (i, o) in objects.iter().enumerate() {
            if let Some(d) = o.hold().and_then(|o| o.sync_domain()) {
                domains.entry(d).or_default().push(i);
            }
        }
        domains.retain(|_, v| v.len() >= SYNC_FS_MIN);
        let mut grouped = vec![false; objects.len()];
        for &i in domains.values().flatten() {
            grouped[i] = true;
        }
        let first: Mutex<Option<Error>> = Mutex::new(None);
        let note = |r: Result<()>| {
            if let Err(e) = r {
                first.lock().get_or_insert(e);
            }
        };
        // Objects whose write-back failed: their error is reported already (as `File::sync`
        // reports it, without the pager's sync); they do not lead the syncfs below, nor
        // are they synced again if it fails.
        let failed: Vec<std::sync::atomic::AtomicBool> = objects.iter().map(|_| false.into()).collect();
        // A grouped small file is written with unstable writes (`writeback.rs`, "Unstable
        // writes"): its hold is kept here until the `syncfs` that commits them has returned.
        let unstable: Vec<Mutex<Option<(WorkHold, u64)>>> = objects.iter().map(|_| Mutex::new(None)).collect();
        run_workers(objects.len(), &|i| {
            let Some(o) = objects[i].hold() else { return };
            if !grouped[i] {
                note(o.sync());
            } else if let Some(pages) = o.begin_unstable() {
                match o.sync_up_to_pager_unstable(pages) {
                    Ok(()) => *unstable[i].lock() = Some((o, pages)),
                    Err(e) => {
                        o.end_unstable(false, pages);
                        failed[i].store(true, Relaxed);
                        note(Err(e));
                    }
                }
            } else if let Err(e) = o.sync_up_to_pager() {
                failed[i].store(true, Relaxed);
                note(Err(e));
            }
        });
        let ok = |i: usize| !failed[i].load(Relaxed);
        let mut synced_fs = Vec::new();
        for (&d, members) in &domains {
            // Each member's mark cleared just before the `syncfs` that covers it (its
            // pager's sync), and the first still cached leads. A member forgotten before its
            // mark is cleared keeps it, so its file system is among the forgotten ones below.
            // A member with unstable writes is held since its writeback (never forgotten).
            // (`Some(pages)` for those: see `Object::begin_unstable`.)
            let mut held: Vec<(WorkHold, Option<u64>)> = Vec::with_capacity(members.len());
            for &i in members.iter().filter(|&&i| ok(i)) {
                let (o, u) = match unstable[i].lock().take() {
                    Some((o, pages)) => (Some(o), Some(pages)),
                    None => (objects[i].hold(), None),
                };
                if let Some(o) = o {
                    o.begin_pager_sync();
                    held.push((o, u));
                }
            }
            let Some((lead, _)) = held.first() else { continue };
            if lead.pager_sync_fs().is_ok() {
                synced_fs.push(d);
                run_workers(held.len(), &|k| {
                    if let (o, Some(pages)) = &held[k] {
                        o.end_unstable(true, *pages);
                    }
                });
            } else {
                // Find out whose data it was: each pager's own sync records its error, and
                // an unstable write that it does not make durable is written again.
                run_workers(held.len(), &|k| {
                    let (o, u) = &held[k];
                    let r = o.pager_sync();
                    if let Some(pages) = u {
                        o.end_unstable(r.is_ok(), *pages);
                    }
                    note(r);
                });
            }
        }
        // File systems that forgotten objects' stores changed (`remember_unsynced`): a `syncfs`
        // each, unless one was synced above; kept for the next sync if it fails. Taken only
        // now, after the members' marks were cleared: a member forgotten before that is here.
        let forgotten = std::mem::take(&mut *self.unsynced_domains.lock());
        for (d, syncer) in forgotten {
            if synced_fs.contains(&d) {
                continue;
            }
            if let Err(e) = syncer() {
                let object = format!("the file system (device {d:#x}) of files written and forgotten before a sync");
                note(Err(Error::Io { op: crate::error::PagerOp::Sync, offset: 0, object, source: e }));
                let mut u = self.unsynced_domains.lock();
                if !u.iter().any(|(x, _)| *x == d) {
                    u.push((d, syncer));
                }
            }
        }
        match first.into_inner() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Last handle gone: stop the daemon, write back what we can, drop every object.
    fn shutdown(&self) {
        self.stop_daemon();
        self.flusher.stop(&self.res.dirty);
        if let Some(m) = self.res.maps.get() {
            // No mapping is left: each holds a file handle, so the cache outlives them.
            m.stop();
        }
        // Write back before stopping the I/O threads (writeback uses them). Best effort:
        // errors here have no caller left to receive them; `sync` before dropping the last
        // handle is how to learn about them.
        let _ = self.sync_all();
        self.res.io.shutdown();
        self.res.arena.retire();
        let objects: Vec<Arc<Object>> = {
            let mut reg = self.registry.write();
            reg.by_identity.clear();
            reg.by_id.drain().collect()
        };
        drop(objects);
    }
}

impl Reclaim for CacheCore {
    fn reclaim(&self, want: u64) -> Result<u64> {
        CacheCore::reclaim(self, want)
    }

    fn clean_others(&self, except: u64) -> Result<()> {
        self.write_back_others(except)
    }
}

/// Why an object may have become idle (see `CacheCore::object_idle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Idle {
    /// Its last handle was closed just now.
    Closed,
    /// Its last page was evicted.
    Emptied,
}

/// Policy names are a few static strings; keep `CacheStats` `Copy`-friendly.
fn leak_name(name: &str) -> &'static str {
    match name {
        "s3fifo" => "s3fifo",
        "sieve" => "sieve",
        "clock" => "clock",
        _ => "custom",
    }
}

/// Shuts the core down when the last user handle (a `Cache` or a `File`) goes away.
struct Handle {
    core: Arc<CacheCore>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // The last handle can go away on one of the cache's own threads (a layer's pager
        // owns a file of this cache, and an I/O job dropped the last reference to it):
        // shutdown joins those threads, so it must run elsewhere.
        let own = std::thread::current().name().is_some_and(|n| n.starts_with("ubc-"));
        if own {
            let core = self.core.clone();
            let _ = std::thread::Builder::new().name("cache-shutdown".into()).spawn(move || core.shutdown());
        } else {
            self.core.shutdown();
        }
    }
}

/// A unified buffer cache: one budget of memory holding pages of any number of files,
/// shared by `read_at`/`write_at`, windows and (later) mappings.
///
/// Cheap to clone (all clones are the same cache). Files keep the cache alive; when the
/// last `Cache` and `File` handle are dropped, dirty pages are written back (best effort:
/// call [`File::sync`](crate::File::sync) or [`Cache::sync_all`] to see errors) and memory is released.
#[derive(Clone)]
pub struct Cache {
    core: Arc<CacheCore>,
    /// `None` for an internal reference (see [`File::internal`](crate::File::internal)):
    /// it does not keep the cache running.
    _handle: Option<Arc<Handle>>,
}

impl Cache {
    /// A cache with a budget of `budget_bytes` and default settings.
    pub fn new(budget_bytes: u64) -> Result<Cache> {
        Cache::builder().budget(budget_bytes).build()
    }

    /// Settings for a new cache.
    pub fn builder() -> CacheBuilder {
        CacheBuilder::default()
    }

    pub(crate) fn core(&self) -> &Arc<CacheCore> {
        &self.core
    }

    /// The cached object `pager` serves, made if there is none, with one more handle
    /// counted on it: the cache's half of opening a file (see `Cache::open`).
    /// `len`: the store's length, if the caller just learned it (a new object then does
    /// not ask the pager).
    pub(crate) fn attach(&self, pager: Arc<dyn Pager>, len: Option<u64>) -> Result<Arc<Object>> {
        let core = self.core();
        let key = ObjectKey::of(&pager);
        // Look for a cached object with the same key first; create a new one outside the
        // registry lock (creating asks the pager for its length, which may do I/O or, for a
        // layered pager, go through this very cache).
        if let Some(o) = self.attach_existing(&key, &pager) {
            return Ok(o);
        }
        let id = core.next_id.fetch_add(1, Relaxed);
        let fresh = Object::new(id, core.res.clone(), pager.clone(), key.clone(), len)?;
        let mut reg = core.registry.write();
        let existing = reg.by_identity.get(&key, &reg.by_id);
        Ok(match existing.and_then(|id| reg.by_id.get(id).cloned()) {
            // Lost a race with another open of the same data: use theirs.
            Some(o) => {
                o.upgrade_pager(pager);
                o.handles.fetch_add(1, SeqCst);
                o
            }
            None => {
                fresh.handles.fetch_add(1, SeqCst);
                let Registry { by_id, by_identity, .. } = &mut *reg;
                by_id.insert(fresh.clone());
                by_identity.insert(id, by_id);
                drop(reg);
                // Mach's `pager_init`: the pager gets its way back into the cache, outside
                // the registry lock (it may use it at once, from another thread).
                pager.init(crate::pager::PagerRequest::new(Arc::new(crate::object::ObjectRef::of(&fresh))));
                fresh
            }
        })
    }

    /// Take a new handle on the cached object with this identity, if there is one.
    fn attach_existing(&self, key: &ObjectKey, pager: &Arc<dyn Pager>) -> Option<Arc<Object>> {
        let reg = self.core().registry.read();
        let o = reg.by_id.get(reg.by_identity.get(key, &reg.by_id)?)?.clone();
        // Under the registry lock, so `object_idle` cannot drop it between check and use.
        o.handles.fetch_add(1, SeqCst);
        drop(reg);
        o.upgrade_pager(pager.clone());
        Some(o)
    }

    /// Statistics for the whole cache.
    pub fn stats(&self) -> CacheStats {
        self.core().stats()
    }

    /// Write back every dirty page of every cached file and sync their pagers. Files are
    /// written back by several threads at once, and 16 or more host files of one file
    /// system are made durable by one `syncfs(2)` of it (which also writes whatever else is
    /// dirty there) instead of an `fdatasync` each; see [`Pager::sync_domain`].
    pub fn sync_all(&self) -> Result<()> {
        self.core().sync_all()
    }

    /// The same cache, as a reference that does not keep it running. => crate-internal.
    pub(crate) fn internal(&self) -> Cache {
        Cache { core: self.core.clone(), _handle: None }
    }

    /// Forget the cached object of the data with `identity`: later opens of that identity
    /// get a new object (handles already open keep theirs). For a store whose identities
    /// are reused — a host file was removed and its inode number may be given to a new
    /// file — so that the new file never sees the old one's pages.
    pub fn forget(&self, identity: &Identity) {
        let mut reg = self.core().registry.write();
        let Registry { by_id, by_identity, .. } = &mut *reg;
        by_identity.remove_key(&ObjectKey::data(identity.clone()), by_id);
    }

    /// The length of the cached object of the data with `identity` if it holds dirty pages
    /// (bytes written that its pager has not been given yet: its length may be past the
    /// store's). `None` if there is no such object or nothing of it is unwritten — the
    /// store's length is then the file's. Takes no handle on the object.
    pub fn unwritten_len(&self, identity: &Identity) -> Option<u64> {
        let key = ObjectKey::data(identity.clone());
        let reg = self.core().registry.read();
        let o = reg.by_id.get(reg.by_identity.get(&key, &reg.by_id)?)?;
        (o.dirty_pages() > 0).then(|| o.len())
    }

    /// Write back and evict everything that is not in use; returns bytes freed.
    /// (For tests and benchmarks that need a cold cache.)
    pub fn evict_all(&self) -> Result<u64> {
        let core = self.core();
        core.sync_all()?;
        let mut freed = 0;
        loop {
            let n = core.reclaim(core.res.geo.budget_pages)?;
            freed += n;
            if n == 0 {
                break;
            }
        }
        Ok(freed << core.res.geo.page_shift)
    }

    /// The page size in bytes.
    pub fn page_size(&self) -> usize {
        self.core().res.geo.page_size
    }

    /// The budget in bytes.
    pub fn budget(&self) -> u64 {
        let g = &self.core().res.geo;
        g.budget_pages << g.page_shift
    }
}

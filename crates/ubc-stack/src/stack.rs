//! Stacks: an ordered set of layers over one cache, every layer reachable, every file kept
//! coherent across layers by the cache manager ([`crate::coherence`]).
//!
//! ## Open files and the pool of idle files
//!
//! A file reached through the stack has a coherence group (its domains: one cache object
//! per layer that names the bytes its own way). The group holds a read-only handle on each
//! domain's object; the objects' pages are slices of the cache's shared memfds, so a group
//! holds one descriptor: the stored file's (a memfd per domain made it 4 for
//! `dir | aead | zstd`). A group is *in use* while an open [`File`], a [`Mapping`] or an
//! operation in progress holds it. When the last one lets go, the group stays open in a
//! bounded LRU **pool of idle files**, so that reopening a recently closed file costs no
//! open of every layer. The pool holds at most [`Stack::idle_files`] groups: by default a
//! quarter of the soft `RLIMIT_NOFILE` divided by the descriptors a group holds (at least
//! 16), settable with [`Stack::set_idle_files`] (`ubc mount --idle-files`).
//!
//! A group leaving the pool is **released**: what its upper domains hold that is not below
//! yet is flushed down (`Group::flush_dirty_above`: dirty pages and layer metadata — an
//! aead header, a zstd commit — reach the stored bytes; a file synced at its close, as the
//! mount does, has nothing to flush), then its domains are closed top first, each upper
//! one emptied of its cached pages and its object forgotten ([`ubc::Cache::forget`]). The
//! upper objects, empty, are freed by the cache with their pagers' handles on the layers
//! below; the stored file's object (domain 0) stays cached like any
//! closed file, within the cache's `max_cached_files` (written back and dropped beyond
//! it). Opens of a file whose group is being released wait until it is done, and so does
//! [`Stack::sync_all`]. If the flush fails, nothing is dropped: the group goes back to the
//! pool with its dirty data, for a later sync to write or report (data is never dropped
//! to respect the limit). A read-ahead job finishing just then holds its object until it
//! returns.
//!
//! Why it stays coherent: domain 0 is the stored bytes and every write, through any layer,
//! goes down through its one cache object, so a cached domain-0 object is never stale. An
//! upper domain's pages are only valid while its group's tokens track them; the release
//! drops them and forgets the objects, so a group made later for the same file starts its
//! upper domains from the current stored bytes — never from pages cached before a write
//! made through another layer in between.
//!
//! A file removed (or renamed over) while open is *detached*: its group leaves the table,
//! its open handles keep working (read, write, length, truncate, map) on the unlinked
//! data, and at the last close every domain's pages are dropped and the group closed at
//! once (no pool), so no descriptor of the deleted file outlives its last close.

use crate::coherence::{ALL, CoherenceStats, Counters, Flush, Group, Mode, Remote};
pub use crate::coherence::{Coherence, LockConflict, LockKind, LockWait};
use crate::error::{Error, Result};
use crate::layer::{Attr, Below, DirEntry, Kind, Layer, Opened, Rename, SetAttr, norm};
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};

/// Threads pushing files down in [`Stack::sync_all`] (the caller and helpers).
const SYNC_WORKERS: usize = 8;

/// What identifies a file's group: the bottom store's identity (the file token).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum GroupKey {
    Data(ubc::Identity),
    /// A store without identity: by layer and path.
    Path(usize, String),
}

/// A layer's name cache: the file a path names, once opened through the stack — its group's
/// key and its domain, whose cached object knows the length as this layer sees it. It
/// spares a `getattr` of a general layer (whose size is the cleartext length) from opening
/// the file again while its group is open (in use or in the pool); the key does not keep
/// the group open. Attributes themselves are read from the layer every time (the
/// often-changing group — size, times — is most of them); entries are dropped, in every
/// layer at once, when a name is removed, renamed, created or changed (the paper's
/// tag-and-broadcast).
type Named = (GroupKey, usize);

/// A group in the table, and who holds it.
struct Slot {
    group: Arc<Group>,
    /// [`Use`]s of it: open files, mappings, operations in progress.
    users: usize,
    /// Its place in [`Groups::idle`] while nobody uses it.
    idle: Option<u64>,
    /// The layer and path the stored file was opened at, if it was (for [`Known::stamp`]).
    origin: Option<(usize, String)>,
}

/// The stack's open groups (see the module docs: the pool of idle files).
#[derive(Default)]
struct Groups {
    /// Every open group of a file that has a name, by the file's key: in use or idle.
    live: HashMap<GroupKey, Slot>,
    /// Groups of files removed or renamed over while in use, by the group's address: they
    /// are closed at their last use.
    detached: HashMap<usize, Slot>,
    /// The idle groups of `live`, least recently used first (by stamp).
    idle: BTreeMap<u64, GroupKey>,
    next_stamp: u64,
    /// Keys whose group is being released: opens of them wait until it is closed.
    releasing: HashSet<GroupKey>,
    /// What released groups knew of their files' lengths, by key: entries exist only while
    /// no group of the file is open (see [`Known`]).
    known: HashMap<GroupKey, Known>,
}

/// Most files whose lengths [`Groups::known`] remembers (about 100 bytes each).
const MAX_KNOWN: usize = 1 << 16;

/// What a released group knew of its file: each domain's length (index: the domain; 0, the
/// stored length, is never kept — the store tells it) and the group's modification time.
/// A general layer keeps a file's length inside the file (an aead header, a zstd index),
/// so without this a `getattr` of a file whose group left the pool of idle files opens
/// every layer of it (~200 µs for `dir | aead | zstd` on tmpfs, against ~20 µs) — what a
/// `stat` of each of thousands of files just written costs (`mount_smallfiles`, `tree`).
///
/// Why it is never stale for changes made through the stack: every change to a file —
/// a write, a resize, a rename or removal, a copy-up — holds a group of it, and
/// [`Inner::take`] drops the entry when a group is taken; the entry is made when the last
/// group is released, after its upper domains were flushed down (so the lengths are those
/// any later open reads from the stored bytes), under the same lock that lets the next
/// group of the file be taken. Changes behind the stack's back (another process writing
/// or replacing the stored file, or a writer through [`LayerRef::open_host`]) are caught by the stored file's attributes: `stamp` is
/// its size, mtime and ctime at the release, and any difference drops the entry — also
/// the cache's own later write-back of data flushed into the stored file's object but not
/// yet to the store (then the next `getattr` just opens the file). What it cannot see is a
/// foreign change within the store's timestamp granularity that keeps the size — as an
/// idle group in the pool, which never reads its file again, cannot either.
struct Known {
    lengths: Vec<Option<u64>>,
    modified: Option<std::time::SystemTime>,
    stamp: (u64, std::time::SystemTime, std::time::SystemTime),
}

impl Groups {
    /// Remember `known` for `key` (at a release), forgetting an arbitrary entry when full.
    fn remember(&mut self, key: GroupKey, known: Known) {
        if self.known.len() >= MAX_KNOWN
            && !self.known.contains_key(&key)
            && let Some(k) = self.known.keys().next().cloned()
        {
            self.known.remove(&k);
        }
        self.known.insert(key, known);
    }
}

struct Inner {
    cache: ubc::Cache,
    layers: Vec<Arc<dyn Layer>>,
    /// The bottom layer is a host directory: a file's attributes at any layer name its
    /// stored file, (dev, ino), the key of its group (see `host_identity`).
    host_files: bool,
    /// Lock order: taken with no other lock of the stack, the cache or a group held, and
    /// nothing is waited for under it but `released` (which gives it up while waiting).
    groups: Mutex<Groups>,
    /// Notified when a group's release ends (its key leaves `Groups::releasing`).
    released: Condvar,
    /// Most idle groups kept open (see the module docs).
    idle_files: AtomicUsize,
    counters: Arc<Counters>,
    coherence: Coherence,
    /// Per layer: path → the opened file (see [`Named`]).
    /// Ordered, so that the names under a directory are one range (`invalidate_names`).
    names: Vec<Mutex<BTreeMap<String, Named>>>,
    name_hits: AtomicU64,
    name_invalidations: AtomicU64,
    /// `getattr`s answered from [`Groups::known`].
    known_hits: AtomicU64,
    next_owner: AtomicU64,
    /// Told of every change to a file's bytes in any domain ([`Stack::watch`]).
    watcher: std::sync::OnceLock<ChangeWatcher>,
}

/// A change to the bytes of a file in one domain of the stack (see [`Stack::watch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Change {
    /// The stored file, as its store names it ([`Attr::dev`] and [`Attr::ino`] of the file
    /// at every layer of a host directory's stack).
    pub file: ubc::Identity,
    /// The domain whose bytes changed: 0 for the stored bytes, one more for each general
    /// layer (compression, encryption) up to it; see [`LayerRef::domain`].
    pub domain: usize,
    /// The bytes that changed, in the domain's own naming; reaching `u64::MAX`: the length
    /// changed too.
    pub range: Range<u64>,
    /// Made *in* this domain — a write, resize or punch through a layer of it, or stores
    /// through a mapping of it — so the layers above show new bytes too. Otherwise it is
    /// data (or a general layer's metadata) written back into it from the domain above:
    /// what the layers above show did not change.
    pub direct: bool,
    /// The file's (device, inode number) as the layers' attributes give them ([`Attr::dev`],
    /// [`Attr::ino`]), where known: a host file's are its identity's; a named store's, its
    /// layer's ([`crate::Layer`]'s `attr_key`).
    pub key: Option<(u64, u64)>,
    /// Another machine may change the file from now on (its store is shared, `s3` with
    /// `etcd=`, and this machine gave its token up or lost it): every cached byte of it,
    /// in every domain, must be dropped before the token goes — this machine's cache has
    /// dropped its own. Told with `range` all of domain 0, `direct`, on a thread holding no
    /// lock of the stack or the cache, which waits for the watcher: unlike other changes, a
    /// watcher may wait here (bounded) until caches of its own have dropped the file.
    pub remote: bool,
}

thread_local! {
    /// The domain a stack `File` operation in progress on this thread changes directly,
    /// so that the watcher can tell it from the write-back it may cause below.
    static DIRECT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Marks the thread as changing domain `d` directly until dropped (see [`Change::direct`]).
struct Direct(Option<usize>);

impl Direct {
    fn enter(d: usize) -> Direct {
        Direct(DIRECT.with(|c| c.replace(Some(d))))
    }
}

impl Drop for Direct {
    fn drop(&mut self) {
        DIRECT.with(|c| c.set(self.0));
    }
}

/// What [`Stack::watch`] calls.
pub type ChangeWatcher = Arc<dyn Fn(&Change) + Send + Sync>;

/// The default size of the pool of idle files: a quarter of the soft open-file limit (a
/// group holds one descriptor, the stored file's), at least 16. The cache drops closed
/// objects while it holds more than a quarter of the limit in objects, open or closed
/// (`max_cached_files`'s default; the pool's stored files among them), and a closed one
/// holds at most one descriptor: idle files then hold at most a quarter of the limit, and
/// the rest stays for open files and everything else. (A file past 1 TiB also holds a
/// memfd per domain for its pages there.)
fn default_idle_files() -> usize {
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(1024);
    (nofile as usize / 4).max(16)
}

/// A stack of layers over one cache. Cheap to clone (shared).
#[derive(Clone)]
pub struct Stack {
    inner: Arc<Inner>,
}

/// Builds a [`Stack`] bottom-up.
pub struct StackBuilder {
    cache: ubc::Cache,
    layers: Vec<Arc<dyn Layer>>,
    coherence: Coherence,
}

impl StackBuilder {
    /// Add a layer on top; `make` gets the current top (None for the bottom).
    pub fn push(mut self, make: impl FnOnce(Option<Arc<dyn Layer>>) -> Result<Arc<dyn Layer>>) -> Result<Self> {
        let l = make(self.layers.last().cloned())?;
        self.layers.push(l);
        Ok(self)
    }

    /// Turn the cache manager off: every layer caches on its own, as in a stack without
    /// coherence. Only for measuring the manager's overhead — data through different
    /// layers is then *not* coherent.
    pub fn without_coherence(mut self) -> Self {
        self.coherence = Coherence::Off;
        self
    }

    pub fn build(self) -> Result<Stack> {
        Stack::from_layers(self.cache, self.layers, self.coherence)
    }
}

/// Options for [`LayerRef::open_with`], built as `OpenOptions::new().write(true).create(true)`
/// (fields may be added: build it with the methods, read its fields).
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct OpenOptions {
    pub write: bool,
    /// Create the file if it does not exist (`O_CREAT`).
    pub create: bool,
    pub truncate: bool,
    /// With `create`: fail with [`Error::Exists`] if the name exists (`O_EXCL`), decided by
    /// the store in one step.
    pub exclusive: bool,
    /// With `create`: the new file's permission bits (default `0o644`), set as it is made.
    pub mode: Option<u32>,
    /// `O_DSYNC`/`O_SYNC`: writes through this handle return once durable
    /// ([`ubc::File::set_write_sync`]).
    pub write_sync: ubc::WriteSync,
}

impl OpenOptions {
    /// Read-only, no creation: what [`LayerRef::open`] uses.
    pub fn new() -> OpenOptions {
        OpenOptions::default()
    }
    pub fn write(mut self, on: bool) -> OpenOptions {
        self.write = on;
        self
    }
    pub fn create(mut self, on: bool) -> OpenOptions {
        self.create = on;
        self
    }
    pub fn truncate(mut self, on: bool) -> OpenOptions {
        self.truncate = on;
        self
    }
    pub fn exclusive(mut self, on: bool) -> OpenOptions {
        self.exclusive = on;
        self
    }
    /// The permission bits of a file this open creates.
    pub fn mode(mut self, mode: u32) -> OpenOptions {
        self.mode = Some(mode);
        self
    }
    /// Synchronous writes (`O_DSYNC`: `WriteSync::Data`, `O_SYNC`: `WriteSync::All`).
    pub fn write_sync(mut self, mode: ubc::WriteSync) -> OpenOptions {
        self.write_sync = mode;
        self
    }
}

impl Stack {
    /// Build a stack from a spec: layers bottom first, separated by `|`:
    ///
    /// * `dir:PATH` — a host directory; `mem` — an in-memory tree
    /// * `null` — pass-through
    /// * `zstd[:level=N][,chunk=BYTES]` — compression (level 1, 64 KiB chunks by default)
    /// * `aead:keyfile=PATH` or `aead:passphrase-file=PATH,salt=HEX32` — encryption
    /// * `union:upper=PATH` — a writable host directory over the layers below
    ///
    /// e.g. `dir:/data | zstd:level=3 | aead:keyfile=/etc/k`.
    pub fn open(spec: &str, cache: ubc::Cache) -> Result<Stack> {
        let layers = crate::spec::parse(spec)?;
        Stack::from_layers(cache, layers, Coherence::Kept)
    }

    /// [`Stack::open`] with the cache manager off: each domain caches on its own and views
    /// through different layers are *not* coherent. A baseline for measuring the manager
    /// (`coherence_overhead`) and for showing what it prevents; not for real use.
    pub fn open_without_coherence(spec: &str, cache: ubc::Cache) -> Result<Stack> {
        let layers = crate::spec::parse(spec)?;
        Stack::from_layers(cache, layers, Coherence::Off)
    }

    /// A builder for stacks made in code.
    pub fn builder(cache: ubc::Cache) -> StackBuilder {
        StackBuilder { cache, layers: Vec::new(), coherence: Coherence::Kept }
    }

    /// A stack of `layers` (bottom first; each layer's `lower()` must be the one before).
    pub fn from_layers(cache: ubc::Cache, layers: Vec<Arc<dyn Layer>>, coherence: Coherence) -> Result<Stack> {
        if layers.is_empty() {
            return Err(Error::Spec("a stack needs at least one layer".into()));
        }
        for (i, l) in layers.iter().enumerate() {
            let ok = match (i, l.lower()) {
                (0, None) => true,
                (0, Some(_)) => false,
                (_, Some(lo)) => Arc::ptr_eq(lo, &layers[i - 1]),
                (_, None) => false,
            };
            if !ok {
                return Err(Error::Spec(format!(
                    "layer {i} ({}) is not stacked on layer {}",
                    l.spec(),
                    i.saturating_sub(1)
                )));
            }
        }
        let names = layers.iter().map(|_| Mutex::new(BTreeMap::new())).collect();
        let idle_files = AtomicUsize::new(default_idle_files());
        Ok(Stack {
            inner: Arc::new(Inner {
                cache,
                host_files: layers[0].host_root().is_some(),
                layers,
                groups: Mutex::new(Groups::default()),
                released: Condvar::new(),
                idle_files,
                counters: Arc::new(Counters::default()),
                coherence,
                names,
                name_hits: AtomicU64::new(0),
                name_invalidations: AtomicU64::new(0),
                known_hits: AtomicU64::new(0),
                next_owner: AtomicU64::new(1),
                watcher: std::sync::OnceLock::new(),
            }),
        })
    }

    /// Have `watcher` told of every change to a stored file's bytes or length in any domain
    /// of this stack: writes, resizes and punched holes through any layer — the writing
    /// layer's domain, then each domain below as the data is written back into it — and
    /// stores through mappings when found (see [`ubc::File::watch`]). A change in domain
    /// `d` changes what every layer whose domain is above `d` shows too (whole files: a
    /// general layer may rename every byte); it is told once, for `d`. Files of stores
    /// without an identity (memory) are not told. The watcher runs on the changing thread,
    /// maybe with cache locks held: it must queue the news and return, never call the stack
    /// or the cache. One per stack; false if one is set already (it stays).
    pub fn watch(&self, watcher: ChangeWatcher) -> bool {
        self.inner.watcher.set(watcher).is_ok()
    }

    /// Number of layers.
    pub fn depth(&self) -> usize {
        self.inner.layers.len()
    }

    /// Layer `i` (0 is the bottom).
    pub fn layer(&self, i: usize) -> Result<LayerRef> {
        if i >= self.depth() {
            return Err(Error::Invalid(format!("layer {i}: the stack has {} layers", self.depth())));
        }
        Ok(LayerRef { stack: self.clone(), level: i })
    }

    /// The top layer.
    pub fn top(&self) -> LayerRef {
        LayerRef { stack: self.clone(), level: self.depth() - 1 }
    }

    /// The spec of this stack (keys are named by where they come from, never shown).
    pub fn spec(&self) -> String {
        self.inner.layers.iter().map(|l| l.spec()).collect::<Vec<_>>().join(" | ")
    }

    pub fn cache(&self) -> &ubc::Cache {
        &self.inner.cache
    }

    /// Coherence statistics.
    pub fn coherence_stats(&self) -> CoherenceStats {
        let c = &self.inner.counters;
        CoherenceStats {
            slow_path: c.slow.load(Relaxed),
            flushes: c.flushes.load(Relaxed),
            invalidations: c.invalidations.load(Relaxed),
        }
    }

    /// Name-cache statistics: (hits, invalidations broadcast).
    pub fn name_cache_stats(&self) -> (u64, u64) {
        (self.inner.name_hits.load(Relaxed), self.inner.name_invalidations.load(Relaxed))
    }

    /// Lengths of released files: (`getattr`s answered without opening the file, files
    /// remembered). For diagnostics and tests (see `LayerRef::getattr`).
    pub fn known_length_stats(&self) -> (u64, usize) {
        (self.inner.known_hits.load(Relaxed), self.inner.groups.lock().known.len())
    }

    /// Names cached, summed over the layers: those of files open or idle in the pool
    /// (see `Named`). For diagnostics and tests.
    pub fn cached_names(&self) -> usize {
        self.inner.names.iter().map(|m| m.lock().len()).sum()
    }

    /// Write every dirty page of every file down through the stack and sync the stores.
    /// Releases of idle files in progress are waited for first (they flush their files).
    ///
    /// Each file's layers are pushed down in order first (top first: a zstd commit must see
    /// everything written above it), by up to eight threads, files in any order
    /// among themselves as concurrent closes would be; only files with something above the
    /// bottom not below yet are pushed (a push through zstd is a commit and a sync of every
    /// store below, which every file in the pool paid before, read or written). Then the
    /// cache syncs every object ([`ubc::Cache::sync_all`]). A failure is
    /// returned after every other file was pushed. (2,000 files of 5,000 bytes written
    /// through `dir | aead | zstd`: 510–549 ms pushed by one thread, 192–224 ms by eight.)
    pub fn sync_all(&self) -> Result<()> {
        let groups: Vec<Arc<Group>> = {
            let mut g = self.inner.groups.lock();
            while !g.releasing.is_empty() {
                ubc::order::check_wait(ubc::order::Rank::STACK);
                self.inner.released.wait(&mut g);
            }
            g.live.values().map(|s| s.group.clone()).collect()
        };
        let first: Mutex<Option<Error>> = Mutex::new(None);
        let next = AtomicUsize::new(0);
        let work = || {
            while let Some(g) = groups.get(next.fetch_add(1, Relaxed)) {
                if let Err(e) = g.flush_dirty_above(0, Flush::ForSync) {
                    first.lock().get_or_insert(e);
                }
            }
        };
        std::thread::scope(|s| {
            for _ in 1..SYNC_WORKERS.min(groups.len()) {
                let _ = std::thread::Builder::new().name("ubc-sync".into()).spawn_scoped(s, work);
            }
            work();
        });
        if let Some(e) = first.into_inner() {
            return Err(e);
        }
        self.inner.cache.sync_all()?;
        for l in &self.inner.layers {
            l.sync_all()?;
        }
        Ok(())
    }

    /// Most idle files (closed, neither open nor mapped) kept open in the pool: see the
    /// module docs.
    pub fn idle_files(&self) -> usize {
        self.inner.idle_files.load(Relaxed)
    }

    /// Set the size of the pool of idle files (at least 0: then every file is released at
    /// its last close). Files beyond it are released at the next close.
    pub fn set_idle_files(&self, n: usize) {
        self.inner.idle_files.store(n, Relaxed);
    }

    /// Open groups: (in use, idle in the pool, detached and still in use). For diagnostics
    /// and tests.
    pub fn open_files(&self) -> (usize, usize, usize) {
        let g = self.inner.groups.lock();
        (g.live.len() - g.idle.len(), g.idle.len(), g.detached.len())
    }
}

/// Closing the stack closes its files: every group's domains are pushed down top first —
/// dirty pages, an aead header, a zstd commit of all of it — as `sync_all` does, without its
/// final sync, while the cache still runs. Left to the cache's own shutdown, which writes
/// objects back in no particular order, a zstd layer could commit with only part of what the
/// layers above had (an aead header moved by `set_len`, not yet the blocks written before
/// it), and a crash during the close would leave that mix on disk (tests/crash.rs). Best
/// effort: errors have nobody to go to.
impl Drop for Inner {
    fn drop(&mut self) {
        let groups: Vec<Arc<Group>> = self.groups.get_mut().live.values().map(|s| s.group.clone()).collect();
        for g in groups {
            let _ = g.flush_above(0);
        }
    }
}

/// A hold on a group (an open file, a mapping, an operation in progress): while one exists
/// the group is in use and stays open; the last one's drop puts it in the pool of idle
/// files (or closes it, if the file was removed). Derefs to the group.
struct Use {
    inner: Weak<Inner>,
    key: GroupKey,
    group: Arc<Group>,
}

impl std::ops::Deref for Use {
    type Target = Group;
    fn deref(&self) -> &Group {
        &self.group
    }
}

impl Use {
    /// Another hold on the same group. => `self` holds it (so its slot exists).
    fn again(&self) -> Use {
        if let Some(inner) = self.inner.upgrade() {
            let mut g = inner.groups.lock();
            if let Some(s) = Groups::slot_of(&mut g, &self.key, &self.group) {
                s.users += 1;
            }
        }
        Use { inner: self.inner.clone(), key: self.key.clone(), group: self.group.clone() }
    }
}

impl Drop for Use {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            inner.put(&self.key, &self.group);
        }
    }
}

impl Groups {
    /// The slot of `group` (under `key`, or detached).
    fn slot_of<'a>(g: &'a mut Groups, key: &GroupKey, group: &Arc<Group>) -> Option<&'a mut Slot> {
        let addr = Arc::as_ptr(group) as usize;
        match g.live.get_mut(key) {
            Some(s) if Arc::ptr_eq(&s.group, group) => Some(s),
            _ => g.detached.get_mut(&addr),
        }
    }
}

impl Inner {
    /// A hold on the group of the file `key` names, made if there is none. Waits while a
    /// previous group of the file is being released (it must be flushed and closed before
    /// a new one opens upper domains of the file). => no lock held (see `groups`).
    fn take(self: &Arc<Self>, key: GroupKey, origin: Option<(usize, &str)>) -> Use {
        let mut g = self.groups.lock();
        while g.releasing.contains(&key) {
            // The release works on the cache (`ubc::order`: the stack's rank).
            ubc::order::check_wait(ubc::order::Rank::STACK);
            self.released.wait(&mut g);
        }
        let g = &mut *g;
        // A group of the file is open from now on: what a released one knew may change.
        g.known.remove(&key);
        let slot = g.live.entry(key.clone()).or_insert_with(|| Slot {
            group: Arc::new(Group::new(self.counters.clone(), self.coherence)),
            users: 0,
            idle: None,
            origin: None,
        });
        if slot.origin.is_none() {
            slot.origin = origin.map(|(l, p)| (l, p.to_string()));
        }
        if let Some(stamp) = slot.idle.take() {
            g.idle.remove(&stamp);
        }
        slot.users += 1;
        Use { inner: Arc::downgrade(self), key, group: slot.group.clone() }
    }

    /// A hold on the group of `key` if it is open and not being released (the name cache:
    /// a miss just opens the file).
    fn take_open(self: &Arc<Self>, key: &GroupKey) -> Option<Use> {
        let mut g = self.groups.lock();
        let g = &mut *g;
        let slot = g.live.get_mut(key)?;
        if let Some(stamp) = slot.idle.take() {
            g.idle.remove(&stamp);
        }
        slot.users += 1;
        Some(Use { inner: Arc::downgrade(self), key: key.clone(), group: slot.group.clone() })
    }

    /// A hold on `group` ends: at its last, the group goes to the pool (and the least
    /// recently used beyond the pool's size are released), or, detached, is closed.
    fn put(&self, key: &GroupKey, group: &Arc<Group>) {
        let mut victims = Vec::new();
        let mut gone = None;
        {
            let mut g = self.groups.lock();
            let g = &mut *g;
            let Some(slot) = Groups::slot_of(g, key, group) else { return };
            slot.users -= 1;
            if slot.users > 0 {
                return;
            }
            if g.live.get(key).is_some_and(|s| Arc::ptr_eq(&s.group, group)) {
                let stamp = g.next_stamp;
                g.next_stamp += 1;
                g.live.get_mut(key).expect("just found").idle = Some(stamp);
                g.idle.insert(stamp, key.clone());
                let max = self.idle_files.load(Relaxed);
                while g.idle.len() > max {
                    let (_, k) = g.idle.pop_first().expect("not empty");
                    let s = g.live.remove(&k).expect("idle groups are live");
                    g.releasing.insert(k.clone());
                    victims.push((k, s.group, s.origin));
                }
            } else {
                gone = g.detached.remove(&(Arc::as_ptr(group) as usize));
            }
        }
        for (k, grp, origin) in victims {
            self.release(k, grp, origin);
        }
        if let Some(s) = gone {
            self.close_detached(s.group);
        }
    }

    /// Release an idle group that left the pool: flush its upper domains down, drop and
    /// forget their objects (see the module docs for why), close its handles. On a flush
    /// error nothing is dropped: the group goes back to the pool (its dirty data stays for
    /// a later sync to write or report). => `key` is in `releasing`; no lock held.
    fn release(&self, key: GroupKey, group: Arc<Group>, origin: Option<(usize, String)>) {
        // Flushing works on the cache: no cache lock may be held here (`ubc::order`).
        ubc::order::check_wait(ubc::order::Rank::STACK);
        let flushed = match self.coherence {
            Coherence::Off => (1..group.depth())
                .rev()
                .try_for_each(|d| group.domain(d).map_or(Ok(()), |dom| dom.file.sync()).map_err(Error::from)),
            _ => group.flush_dirty_above(0, Flush::Publish),
        };
        if flushed.is_err() {
            let mut g = self.groups.lock();
            let g = &mut *g;
            let stamp = g.next_stamp;
            g.next_stamp += 1;
            g.idle.insert(stamp, key.clone());
            g.live.insert(key.clone(), Slot { group, users: 0, idle: Some(stamp), origin });
            g.releasing.remove(&key);
            self.released.notify_all();
            return;
        }
        // Flushed: each upper domain's length is what an open would read from the stored
        // bytes now. Kept for `getattr` (see `Known`) with the stored file's attributes —
        // if its name still names it: a store without identity, or a file renamed since it
        // was opened, is not remembered.
        let known = match (&key, &origin) {
            (GroupKey::Data(ubc::Identity::HostFile { dev, ino }), Some((level, path))) => {
                let lengths: Vec<Option<u64>> = (0..group.depth())
                    .map(|d| if d == 0 { None } else { group.domain(d).and_then(|dom| dom.file.len().ok()) })
                    .collect();
                let stored = self.layers[*level].getattr(path).ok().filter(|a| a.dev == *dev && a.ino == *ino);
                match stored {
                    Some(a) if lengths.iter().any(Option::is_some) => {
                        Some(Known { lengths, modified: group.modified(), stamp: (a.size, a.mtime, a.ctime) })
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        self.drop_domains(&group, 1);
        // Closed before the key is free again, so that no pager of it (whose drop may still
        // write) outlives the start of a new group of the file.
        drop(group);
        // Its names no longer lead to an open group: forgotten, so the name caches hold the
        // files open or idle, not every file ever opened. (Layers name a file alike: no
        // layer renames paths.)
        if let Some((_, path)) = &origin {
            for m in &self.names {
                let mut m = m.lock();
                if m.get(path).is_some_and(|(k, _)| *k == key) {
                    m.remove(path);
                }
            }
        }
        let mut g = self.groups.lock();
        if let Some(k) = known {
            g.remember(key.clone(), k);
        }
        g.releasing.remove(&key);
        drop(g);
        self.released.notify_all();
    }

    /// The length of the file `a` describes (its attributes at some layer of a host
    /// directory's stack) in domain `domain`, and its group's modification time, if a
    /// released group of it said and the stored file has not changed since (see `Known`).
    fn known_length(&self, a: &Attr, domain: usize) -> Option<(u64, Option<std::time::SystemTime>)> {
        let key = GroupKey::Data(self.host_identity(a)?);
        let mut g = self.groups.lock();
        let k = g.known.get_mut(&key)?;
        if k.stamp != (a.size, a.mtime, a.ctime) {
            g.known.remove(&key);
            return None;
        }
        let len = k.lengths.get(domain).copied().flatten()?;
        let m = k.modified;
        drop(g);
        self.known_hits.fetch_add(1, Relaxed);
        Some((len, m))
    }

    /// Close the group of a removed file at its last use: its data is gone, so every
    /// domain's pages are dropped, the stored file's included, and their objects freed
    /// with their descriptors as the group's handles close.
    fn close_detached(&self, group: Arc<Group>) {
        ubc::order::check_wait(ubc::order::Rank::STACK);
        self.drop_domains(&group, 0);
    }

    /// Close the domains of `group`, top first, dropping the cached pages of domains
    /// `from..` and forgetting their objects: empty and unreachable, each is freed as its
    /// last handle closes. Each domain is closed before the one below it is emptied: closing
    /// it may drop its layer's pager, whose last reads (or a read-ahead it started) may
    /// still fill pages below — emptied next, so nothing of a closed file stays cached
    /// above domain `from`. Best effort: an object that keeps pages (a failed write-back)
    /// stays cached, forgotten, until the cache drops it (`max_cached_files`). => nobody
    /// uses the group; its data is below domain `from` (flushed) or not wanted (removed).
    fn drop_domains(&self, group: &Group, from: usize) {
        let mut doms = group.take_domains();
        while doms.len() > from {
            let dom = doms.pop().expect("not empty");
            let _ = dom.file.invalidate(ALL, ubc::Length::Keep);
            if let Some(id) = dom.file.identity() {
                self.cache.forget(&id);
            }
            // The group held the last handle on it (its files and the pager above are gone):
            // closed here, once the cache's own work on it (a read-ahead, a write-back job
            // that signalled its caller and has not yet let go) is done, so that the pager
            // above the next domain — and, at domain 0, the stored file's descriptor — is
            // closed before the next domain is emptied, and before this returns.
            dom.close_and_wait();
        }
    }

    /// Open the data of `path` at `level`: the file's group, its domain there, and a handle.
    /// The name cache of `level` and of every level below that the open passed through
    /// learns the file, so that a `getattr` at any of them reads the cached length.
    fn open_node(self: &Arc<Self>, level: usize, path: &str, writable: bool) -> Result<Node> {
        let node = self.open_node_at(level, path, writable)?;
        self.names[level].lock().insert(path.to_string(), (node.group.key.clone(), node.domain));
        Ok(node)
    }

    /// The open of a file whose bytes `level` stores (`pager`); `remote` is its token
    /// between machines when other machines share the store.
    fn open_store(
        self: &Arc<Self>,
        level: usize,
        path: &str,
        access: ubc::Access,
        pager: Arc<dyn ubc::Pager>,
        remote: Option<Arc<dyn Remote>>,
    ) -> Result<Node> {
        if matches!(access, ubc::Access::ReadWrite) && !pager.is_writable() {
            return Err(Error::ReadOnly(path.into()));
        }
        let file = self.cache.open(pager, access)?;
        let key = match file.identity() {
            Some(i) => GroupKey::Data(i),
            None => GroupKey::Path(level, path.to_string()),
        };
        let group = self.take(key, Some((level, path)));
        if let (Some(r), GroupKey::Data(id)) = (remote, &group.key) {
            group.group.set_remote(r, self.remote_dropped(id.clone()));
        }
        let dom = group.add_domain(0, || Ok((file.reopen(ubc::Access::ReadOnly)?, None)))?;
        self.watch_domain(&group.key, &dom.file, 0);
        Ok(Node { file, group, domain: 0 })
    }

    fn open_node_at(self: &Arc<Self>, level: usize, path: &str, writable: bool) -> Result<Node> {
        let access = if writable { ubc::Access::ReadWrite } else { ubc::Access::ReadOnly };
        let below = BelowImpl { inner: self, level };
        match self.layers[level].open(path, access, &below)? {
            Opened::Store(pager) => self.open_store(level, path, access, pager, None),
            Opened::Shared { pager, remote } => self.open_store(level, path, access, pager, Some(remote)),
            Opened::Lower => {
                if level == 0 {
                    return Err(Error::Invalid(format!("bottom layer {} has no lower layer", self.layers[0].spec())));
                }
                self.open_node(level - 1, path, writable)
            }
            Opened::Wrap => {
                if level == 0 {
                    return Err(Error::Invalid(format!("bottom layer {} has no lower layer", self.layers[0].spec())));
                }
                // The domain's pager writes through a writable lower handle when the lower
                // store allows it, whoever opens first.
                let lower = match self.open_node(level - 1, path, true) {
                    Ok(n) => n,
                    Err(Error::ReadOnly(_)) | Err(Error::Cache(ubc::Error::ReadOnly)) if !writable => {
                        self.open_node(level - 1, path, false)?
                    }
                    Err(e) => return Err(e),
                };
                let idx = lower.domain + 1;
                let layer = self.layers[level].clone();
                let cache = self.cache.clone();
                let lower_file = lower.file;
                let named = path.to_string();
                let writes = lower.group.lower_writes.clone();
                let dom = lower.group.add_domain(idx, move || {
                    let lw = lower_file.is_writable();
                    // Internal: the pager's lower file must not keep the cache running.
                    let (pager, xlate) = layer.wrap(&named, lower_file.internal(), &writes)?;
                    let acc = if lw { ubc::Access::ReadWrite } else { ubc::Access::ReadOnly };
                    Ok((cache.open(pager, acc)?, Some(xlate)))
                })?;
                self.watch_domain(&lower.group.key, &dom.file, idx);
                let file = dom.file.reopen(access).map_err(|e| match e {
                    ubc::Error::ReadOnly => Error::ReadOnly(path.into()),
                    e => e.into(),
                })?;
                Ok(Node { file, group: lower.group, domain: idx })
            }
        }
    }

    /// Have the stack's watcher, once set, told of changes to `file`, domain `domain` of
    /// the group `key` (its stored file's identity names it). Does nothing if the file is watched
    /// already (it was opened before: same file, same domain) or its store has no identity.
    fn watch_domain(self: &Arc<Self>, key: &GroupKey, file: &ubc::File, domain: usize) {
        let GroupKey::Data(id) = key else { return };
        let id = id.clone();
        let key = self.attr_key(&id);
        let inner = Arc::downgrade(self);
        file.watch(Arc::new(move |range, mapped| {
            if let Some(i) = inner.upgrade()
                && let Some(w) = i.watcher.get()
            {
                let direct = mapped || DIRECT.with(|c| c.get()) == Some(domain);
                w(&Change { file: id.clone(), domain, range, direct, key, remote: false });
            }
        }));
    }

    /// [`Change::key`] of the file `id`.
    fn attr_key(&self, id: &ubc::Identity) -> Option<(u64, u64)> {
        match id {
            ubc::Identity::HostFile { dev, ino } => Some((*dev, *ino)),
            other => self.layers[0].attr_key(other),
        }
    }

    /// What the token of the file `id` calls when it drops the file's pages (see
    /// [`Change::remote`]).
    fn remote_dropped(self: &Arc<Self>, id: ubc::Identity) -> crate::coherence::RemoteDropped {
        let key = self.attr_key(&id);
        let inner = Arc::downgrade(self);
        Box::new(move || {
            if let Some(i) = inner.upgrade()
                && let Some(w) = i.watcher.get()
            {
                w(&Change { file: id.clone(), domain: 0, range: ALL, direct: true, key, remote: true });
            }
        })
    }

    /// Forget `path` and every name under it (a directory's) in every layer's name cache.
    /// The names under `path` are the keys from `path/` on that start with it: one range,
    /// so a file's create or removal costs a lookup per layer, not a scan of every name
    /// cached (a scan made `create` and `unlink` grow with the number of files opened —
    /// 140 µs each at 2,000 files, 240 µs at 10,000 through `dir | aead | zstd`).
    fn invalidate_names(&self, path: &str) {
        self.name_invalidations.fetch_add(1, Relaxed);
        let prefix = format!("{path}/");
        for m in &self.names {
            let mut m = m.lock();
            m.remove(path);
            let under: Vec<String> = m
                .range::<str, _>((std::ops::Bound::Included(prefix.as_str()), std::ops::Bound::Unbounded))
                .take_while(|(p, _)| p.starts_with(&prefix))
                .map(|(p, _)| p.clone())
                .collect();
            for p in under {
                m.remove(&p);
            }
        }
    }

    /// The file token of `path` as seen at `level`, if it is a regular file whose only name
    /// this is (its data goes with the name), and the identity of a cache object of it to
    /// forget with the group's. Over a host directory the token is found by the stored
    /// file's key — (dev, ino), which `getattr` shows at every layer — without opening the
    /// file: the group in use or idle, else a new empty one (nothing open, so nothing to
    /// detach but the stored bytes' closed object, which the cache may keep; upper domains'
    /// objects go when a group closes). Opening only to forget cost an open of every layer —
    /// a header read through aead — per `unlink`. Other stores (memory) are opened to find
    /// their key; never a FIFO, which would wait for a writer.
    fn group_of(self: &Arc<Self>, level: usize, path: &str) -> Option<(Use, Option<ubc::Identity>)> {
        let a = self.layers[level].getattr(path).ok()?;
        if a.kind != Kind::File || a.nlink > 1 {
            return None;
        }
        if let Some(id) = self.host_identity(&a) {
            return Some((self.take(GroupKey::Data(id.clone()), None), Some(id)));
        }
        let node = self.open_node(level, path, false).ok()?;
        let id = node.file.identity();
        Some((node.group, id))
    }

    /// The identity of the stored file `a` (attributes at any layer) describes, when the
    /// stack's files are host files: the key of its group, found without opening it.
    fn host_identity(&self, a: &Attr) -> Option<ubc::Identity> {
        self.host_files.then_some(ubc::Identity::HostFile { dev: a.dev, ino: a.ino })
    }
}

struct Node {
    file: ubc::File,
    group: Use,
    domain: usize,
}

struct BelowImpl<'a> {
    inner: &'a Arc<Inner>,
    level: usize,
}

impl Below for BelowImpl<'_> {
    fn open_lower(&self, path: &str, access: ubc::Access) -> Result<ubc::File> {
        if self.level == 0 {
            return Err(Error::Invalid("the bottom layer has nothing below".into()));
        }
        // Through the stack's File (not the raw node) so the read is coherent with layers above.
        let f = LayerRef { stack: Stack { inner: self.inner.clone() }, level: self.level - 1 }
            .open_with(path, OpenOptions { write: access == ubc::Access::ReadWrite, ..Default::default() })?;
        // Make layers above flush first: the copy must see their data.
        f.group.flush_above(f.domain)?;
        Ok(f.inner.reopen(access)?)
    }
}

/// Refuse the root of a layer (`""` after [`norm`]): removing or renaming it would act on
/// the host directory a `dir` or `union` layer is rooted at.
fn not_root(p: String, what: &str) -> Result<String> {
    if p.is_empty() {
        return Err(Error::Invalid(format!("cannot {what} the root of a layer")));
    }
    Ok(p)
}

/// One layer of a stack: namespace operations and opens at that layer.
#[derive(Clone)]
pub struct LayerRef {
    stack: Stack,
    level: usize,
}

impl LayerRef {
    /// Index of this layer (0 is the bottom).
    pub fn index(&self) -> usize {
        self.level
    }

    /// The domain this layer's files live in: the number of general layers (compression,
    /// encryption) from the bottom up to this one; a simply named layer (null, union) shares
    /// the one below. What [`Change::domain`] counts.
    pub fn domain(&self) -> usize {
        self.stack.inner.layers[1..=self.level].iter().filter(|l| l.is_general()).count()
    }

    /// This layer's spec.
    pub fn spec(&self) -> String {
        self.layer().spec()
    }

    /// Whether other machines use this layer's store at once (`s3:…?etcd=…` at the bottom,
    /// under any layers): what they change reaches the stack's caches, but no cache in
    /// front of the stack (a kernel's).
    pub fn is_shared(&self) -> bool {
        self.layer().is_shared()
    }

    /// The host directory whose files are this layer's files (a `dir` layer), if it is one.
    pub fn host_root(&self) -> Option<std::path::PathBuf> {
        self.layer().host_root().map(|p| p.to_path_buf())
    }

    fn layer(&self) -> &Arc<dyn Layer> {
        &self.stack.inner.layers[self.level]
    }

    fn inner(&self) -> &Arc<Inner> {
        &self.stack.inner
    }

    /// Attributes of `path` as this layer shows them (a general layer shows its own size).
    pub fn getattr(&self, path: &str) -> Result<Attr> {
        let p = norm(path)?;
        let mut a = self.layer().getattr(&p)?;
        if a.kind != Kind::File {
            return Ok(a);
        }
        // The length is the cache's when the file is cached (dirty pages and pending
        // truncates count, and a write through another layer is pushed down first); a
        // general layer's length exists only in the opened file. The name cache names the
        // group; a group released since is not reopened for a store layer (the store's
        // size is then the truth: nothing of it is cached above).
        let named = self.inner().names[self.level].lock().get(&p).cloned();
        // A store whose names other machines change (s3 with etcd) may have given the name
        // to another file since it was cached here: only the same file's group counts.
        let bottom = &self.inner().layers[0];
        let named = named.filter(|(k, _)| match (k, bottom.file_identity(&a)) {
            (GroupKey::Data(id), Some(want)) => *id == want,
            _ => true,
        });
        let held = named.and_then(|(k, d)| Some((self.inner().take_open(&k)?, d)));
        // Data written but not yet written back has moved the times already (POSIX), though
        // the store's own clock moves only at writeback: the group knows when.
        let modified = match held.and_then(|(g, d)| Some((g.domain(d)?, g, d))) {
            Some((dom, g, d)) => {
                self.inner().name_hits.fetch_add(1, Relaxed);
                let _r = g.pin_remote(Mode::Read)?;
                let _p = g.acquire(&dom, d, ALL, Mode::Read)?;
                a.size = dom.file.len()?;
                g.modified()
            }
            None if self.layer().is_general() || self.level_is_above_general() => {
                match self.inner().known_length(&a, self.domain()) {
                    Some((len, m)) => {
                        a.size = len;
                        m
                    }
                    None => {
                        let f = self.open_with(&p, OpenOptions::default())?;
                        a.size = f.len()?;
                        f.group.modified()
                    }
                }
            }
            // A store's file closed everywhere whose pages the cache still holds dirty (not
            // yet written back after its last close): their length is the file's. Before,
            // `stat` after a close showed the store's older size until the flusher ran
            // (up to ~5 s through an s3 layer with no idle-file pool).
            None if self.level == 0 => {
                if let Some(len) = bottom.file_identity(&a).and_then(|id| self.inner().cache.unwritten_len(&id)) {
                    a.size = len;
                }
                None
            }
            None => None,
        };
        if let Some(m) = modified {
            (a.mtime, a.ctime) = (a.mtime.max(m), a.ctime.max(m));
        }
        Ok(a)
    }

    /// Whether a general layer lies below this one (sizes then come from the open file).
    fn level_is_above_general(&self) -> bool {
        self.inner().layers[..self.level].iter().any(|l| l.is_general())
    }

    /// Change attributes. A size change goes through the cache (and the layers below).
    pub fn setattr(&self, path: &str, set: &SetAttr) -> Result<()> {
        let p = norm(path)?;
        if let Some(size) = set.size {
            self.open_with(&p, OpenOptions { write: true, ..Default::default() })?.set_len(size)?;
        }
        let rest = SetAttr { size: None, ..set.clone() };
        if rest.changes_metadata() {
            self.with_copy_up(&p, || self.layer().setattr(&p, &rest))?;
        }
        if rest.mtime.is_some() {
            let named = self.inner().names[self.level].lock().get(&p).cloned();
            if let Some(g) = named.and_then(|(k, _)| self.inner().take_open(&k)) {
                g.forget_modified();
            }
        }
        // The name still names the same file: the name caches stay.
        Ok(())
    }

    /// The host file behind `path` at this layer, opened with open(2) `flags` (`mode` for
    /// `O_CREAT`; never following a symbolic link, never leaving the layer's directory), or
    /// `None` where the layer's files are not host files (only `dir`'s are). A name it
    /// creates is news to the stack's name caches.
    ///
    /// What is done through the host file bypasses the cache and its coherence: the caller
    /// must be the only user of the file in the stack — nothing opened, mapped or cached
    /// through [`LayerRef::open_with`] meanwhile, and nothing through a layer above — as a
    /// mount that is the stack's one way in and hands every regular file to the kernel
    /// itself (FUSE passthrough, `ubc mount --cache passthrough`) is.
    pub fn open_host(&self, path: &str, flags: i32, mode: u32) -> Result<Option<std::fs::File>> {
        let p = norm(path)?;
        let Some(r) = self.layer().host_file(&p, flags, mode) else { return Ok(None) };
        let f = r?;
        if flags & libc::O_CREAT != 0 {
            self.inner().invalidate_names(&p);
        }
        Ok(Some(f))
    }

    /// Attributes of an open host file ([`LayerRef::open_host`]), as [`LayerRef::getattr`]
    /// shows them by name: what `fstat` shows once the name is gone.
    pub fn host_attr(f: &std::fs::File) -> Result<Attr> {
        let st = rustix::fs::fstat(f).map_err(|e| Error::io("<open file>", std::io::Error::from(e)))?;
        Ok(crate::layer::dir::attr_of(&st))
    }

    pub fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.layer().readdir(&norm(path)?)
    }

    pub fn mkdir(&self, path: &str) -> Result<()> {
        let p = norm(path)?;
        self.layer().mkdir(&p, 0o755)?;
        self.inner().invalidate_names(&p);
        Ok(())
    }

    /// `op` on this layer; when the layer answers that the regular file `p` must first be
    /// copied up (a union: `ReadOnly` from a metadata change of a lower file, `CrossDevice`
    /// from a link or rename of one), the file is copied up by opening it for writing — its
    /// data comes through the stack, current in every layer — and `op` runs again. On a
    /// layer that is really read-only the open fails the same way.
    fn with_copy_up<T>(&self, p: &str, op: impl Fn() -> Result<T>) -> Result<T> {
        match op() {
            Err(Error::ReadOnly(_) | Error::CrossDevice(_)) if self.layer().getattr(p)?.kind == Kind::File => {
                drop(self.open_with(p, OpenOptions::new().write(true))?);
                op()
            }
            r => r,
        }
    }

    /// Remove a file. Cached lookups of it in every layer go at once, and its cached data
    /// (in every domain) is dropped: a new file that reuses the inode starts clean.
    pub fn remove(&self, path: &str) -> Result<()> {
        let p = not_root(norm(path)?, "remove")?;
        let doomed = self.inner().group_of(self.level, &p);
        self.layer().remove(&p)?;
        self.inner().invalidate_names(&p);
        if let Some((g, id)) = doomed {
            // Still reachable? (a union remove may leave nothing but a whiteout — the lower
            // file lives on.) Only forget the data when the store's file is gone.
            if self.layer().getattr(&p).is_err() {
                self.forget_group(&g, id);
            }
        }
        Ok(())
    }

    /// Make the entries of directory `path` durable (`fsync` of a directory).
    pub fn sync_dir(&self, path: &str) -> Result<()> {
        self.layer().sync_dir(&norm(path)?)
    }

    /// Make `path` a symbolic link to `target`.
    pub fn symlink(&self, target: &str, path: &str) -> Result<()> {
        let p = not_root(norm(path)?, "replace")?;
        if target.is_empty() || target.len() > crate::layer::PATH_MAX || target.contains('\0') {
            return Err(Error::Invalid(format!("{p}: a link target of {} bytes", target.len())));
        }
        self.layer().symlink(target, &p)?;
        self.inner().invalidate_names(&p);
        Ok(())
    }

    /// The target of the symbolic link `path`.
    pub fn readlink(&self, path: &str) -> Result<String> {
        self.layer().readlink(&norm(path)?)
    }

    /// Give the file `from` the second name `to`. A union's lower file is copied up first.
    pub fn link(&self, from: &str, to: &str) -> Result<()> {
        let (f, t) = (not_root(norm(from)?, "link")?, not_root(norm(to)?, "replace")?);
        self.with_copy_up(&f, || self.layer().link(&f, &t))?;
        self.inner().invalidate_names(&t);
        Ok(())
    }

    /// Make a special file: a FIFO, a socket's name or a device node.
    pub fn mknod(&self, path: &str, kind: Kind, mode: u32, rdev: u64) -> Result<()> {
        let p = not_root(norm(path)?, "replace")?;
        self.layer().mknod(&p, kind, mode & 0o7777, rdev)?;
        self.inner().invalidate_names(&p);
        Ok(())
    }

    pub fn getxattr(&self, path: &str, name: &str) -> Result<Vec<u8>> {
        self.layer().getxattr(&norm(path)?, name)
    }

    pub fn setxattr(&self, path: &str, name: &str, value: &[u8], flags: i32) -> Result<()> {
        let p = norm(path)?;
        self.with_copy_up(&p, || self.layer().setxattr(&p, name, value, flags))
    }

    pub fn listxattr(&self, path: &str) -> Result<Vec<String>> {
        self.layer().listxattr(&norm(path)?)
    }

    pub fn removexattr(&self, path: &str, name: &str) -> Result<()> {
        self.layer().removexattr(&norm(path)?, name)
    }

    /// The file of `g` is gone (removed, or renamed over): detach its group from the key —
    /// a new file reusing the identity gets a new group — and forget its objects; the
    /// group is closed at its last use. => `g` holds the group.
    fn forget_group(&self, g: &Use, id: Option<ubc::Identity>) {
        let mut groups = self.inner().groups.lock();
        if groups.live.get(&g.key).is_some_and(|s| Arc::ptr_eq(&s.group, &g.group)) {
            let slot = groups.live.remove(&g.key).expect("just found");
            debug_assert!(slot.idle.is_none(), "g holds it");
            groups.detached.insert(Arc::as_ptr(&g.group) as usize, slot);
        }
        drop(groups);
        for d in 0..g.depth() {
            if let Some(dom) = g.domain(d)
                && let Some(i) = dom.file.identity()
            {
                self.inner().cache.forget(&i);
            }
        }
        if let Some(i) = id {
            self.inner().cache.forget(&i);
        }
    }

    pub fn rmdir(&self, path: &str) -> Result<()> {
        let p = not_root(norm(path)?, "remove")?;
        self.layer().rmdir(&p)?;
        self.inner().invalidate_names(&p);
        Ok(())
    }

    /// Rename `from` to `to` (replacing a file at `to`). Lookups of both names, and of
    /// everything under them, are invalidated in every layer.
    pub fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.rename_with(from, to, Rename::Replace)
    }

    /// [`LayerRef::rename`] with `renameat2(2)`'s modes ([`Rename`]).
    pub fn rename_with(&self, from: &str, to: &str, how: Rename) -> Result<()> {
        let (f, t) = (not_root(norm(from)?, "rename")?, not_root(norm(to)?, "replace")?);
        // Exchanged or kept, the file at `to` lives on under a name: only a replaced one goes.
        let replaced = if how == Rename::Replace { self.inner().group_of(self.level, &t) } else { None };
        self.with_copy_up(&f, || self.layer().rename_with(&f, &t, how))?;
        self.inner().invalidate_names(&f);
        self.inner().invalidate_names(&t);
        if let Some((g, id)) = replaced {
            self.forget_group(&g, id);
        }
        Ok(())
    }

    /// Open an existing file read-only.
    pub fn open(&self, path: &str) -> Result<File> {
        self.open_with(path, OpenOptions::default())
    }

    /// Create (or truncate) a file and open it read-write.
    pub fn create(&self, path: &str) -> Result<File> {
        self.open_with(path, OpenOptions { write: true, create: true, truncate: true, ..Default::default() })
    }

    pub fn open_with(&self, path: &str, opts: OpenOptions) -> Result<File> {
        let p = norm(path)?;
        if opts.create {
            // Create first and let the store say whether the name existed: a check before
            // the create could race with another creator.
            match self.layer().create(&p, opts.mode.unwrap_or(0o644) & 0o7777) {
                Ok(()) => self.inner().invalidate_names(&p),
                Err(e) if e.errno() == libc::EEXIST && !opts.exclusive => {}
                Err(e) if e.errno() == libc::EEXIST => return Err(Error::Exists(p)),
                Err(e) => return Err(e),
            }
        }
        match self.layer().getattr(&p)?.kind {
            Kind::File => {}
            Kind::Dir => return Err(Error::IsDir(p)),
            // Opening a FIFO would wait for a writer; links are not followed.
            k => return Err(Error::Invalid(format!("{p}: not a regular file ({k:?})"))),
        }
        let node = self.inner().open_node(self.level, &p, opts.write)?;
        let dom = node.group.domain(node.domain).expect("opened domain");
        let f = File {
            inner: node.file,
            dom,
            domain: node.domain,
            owner: self.inner().next_owner.fetch_add(1, Relaxed),
            path: p,
            level: self.level,
            group: node.group,
        };
        if opts.truncate && opts.write {
            f.set_len(0)?;
        }
        if opts.write_sync != ubc::WriteSync::None {
            f.inner.set_write_sync(opts.write_sync)?;
        }
        Ok(f)
    }
}

/// Who holds a byte-range lock taken with [`File::lock_as`]: a process or an open file
/// description, named by the caller (a FUSE request's lock owner). Kept apart from the
/// owners of [`File::lock`], which are file handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LockOwner(pub u64);

impl LockOwner {
    /// The group's owner key: handle owners count up from 1, so these take the top bit.
    fn key(self) -> u64 {
        self.0 | 1 << 63
    }
}

/// A file opened at one layer of a stack. Positional calls are thread-safe and coherent
/// with every other layer's view of the same file, mappings included. It keeps working
/// after its name is removed (or renamed over); its data goes at its last close.
pub struct File {
    inner: ubc::File,
    dom: Arc<crate::coherence::Domain>,
    domain: usize,
    owner: u64,
    path: String,
    level: usize,
    /// Last: dropped after the handles above, so that a release at this last use finds
    /// them closed and the objects are freed with the group.
    group: Use,
}

fn span(offset: u64, len: usize) -> Result<Range<u64>> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= i64::MAX as u64 => Ok(offset..end.max(offset + 1)),
        _ => Err(Error::Cache(ubc::Error::OffsetOverflow { offset, len: len as u64 })),
    }
}

impl File {
    /// The path this file was opened by.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The layer this file was opened at.
    pub fn layer_index(&self) -> usize {
        self.level
    }

    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let _r = self.group.pin_remote(Mode::Read)?;
        let _p = self.group.acquire(&self.dom, self.domain, span(offset, buf.len())?, Mode::Read)?;
        Ok(self.inner.read_at(buf, offset)?)
    }

    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let _r = self.group.pin_remote(Mode::Read)?;
        let _p = self.group.acquire(&self.dom, self.domain, span(offset, buf.len())?, Mode::Read)?;
        Ok(self.inner.read_exact_at(buf, offset)?)
    }

    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<usize> {
        let _r = self.group.pin_remote(Mode::Write)?;
        let _p = self.group.acquire(&self.dom, self.domain, span(offset, buf.len())?, Mode::Write)?;
        let _d = Direct::enter(self.domain);
        let r = self.inner.write_at(buf, offset);
        self.group.note_modified();
        Ok(r?)
    }

    /// Write `buf` at the end of the file (`O_APPEND`): the end is read and written at in
    /// one step with respect to every other append to the file, through any layer. Returns
    /// the offset written at and the bytes written. (A positional write racing with the
    /// append may still land in between, as the cache orders only appends among themselves.)
    pub fn append(&self, buf: &[u8]) -> Result<(u64, usize)> {
        let _one = self.group.appending.lock();
        let at = self.len()?;
        Ok((at, self.write_at(buf, at)?))
    }

    /// Length as this layer sees it (data written through layers above included).
    pub fn len(&self) -> Result<u64> {
        let _r = self.group.pin_remote(Mode::Read)?;
        let _p = self.group.acquire(&self.dom, self.domain, ALL, Mode::Read)?;
        Ok(self.inner.len()?)
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    pub fn set_len(&self, len: u64) -> Result<()> {
        let cur = self.inner.len()?;
        let _r = self.group.pin_remote(Mode::Write)?;
        let _p = self.group.acquire(&self.dom, self.domain, cur.min(len)..u64::MAX, Mode::Write)?;
        let _d = Direct::enter(self.domain);
        let r = self.inner.set_len(len);
        self.group.note_modified();
        Ok(r?)
    }

    /// Make bytes `range` read as zeros, keeping the length (`fallocate(PUNCH_HOLE)`):
    /// deallocated in the store where this layer's bytes are the stored ones (`dir`, and
    /// layers sharing its file), zeros written elsewhere (see [`ubc::File::punch_hole`]).
    /// Every other layer sees it as a write.
    pub fn punch_hole(&self, range: Range<u64>) -> Result<()> {
        let _r = self.group.pin_remote(Mode::Write)?;
        let _p = self.group.acquire(&self.dom, self.domain, range.clone(), Mode::Write)?;
        let _d = Direct::enter(self.domain);
        let r = self.inner.punch_hole(range);
        self.group.note_modified();
        Ok(r?)
    }

    /// Reserve the store's space for bytes `range` where this layer's bytes are the stored
    /// ones (`fallocate` without changing the length; see [`ubc::File::allocate`]). A
    /// general layer's store is reserved by its own writes, not ahead.
    pub fn allocate(&self, range: Range<u64>) -> Result<()> {
        Ok(self.inner.allocate(range)?)
    }

    /// `lseek(SEEK_DATA)` in this layer's bytes (see [`ubc::File::seek_data`]); data
    /// written through other layers counts.
    pub fn seek_data(&self, offset: u64) -> Result<Option<u64>> {
        let _r = self.group.pin_remote(Mode::Read)?;
        let _p = self.group.acquire(&self.dom, self.domain, ALL, Mode::Read)?;
        Ok(self.inner.seek_data(offset)?)
    }

    /// `lseek(SEEK_HOLE)` in this layer's bytes (see [`ubc::File::seek_hole`]).
    pub fn seek_hole(&self, offset: u64) -> Result<Option<u64>> {
        let _r = self.group.pin_remote(Mode::Read)?;
        let _p = self.group.acquire(&self.dom, self.domain, ALL, Mode::Read)?;
        Ok(self.inner.seek_hole(offset)?)
    }

    /// `posix_fadvise` for this file at its layer ([`ubc::File::advise`]): a pattern for
    /// this handle's reads, or `WillNeed`/`DontNeed` on the range of this layer's pages
    /// (`DontNeed` writes them back into the layer below, as the flusher would, then drops
    /// the clean ones; the layers below keep theirs).
    pub fn advise(&self, range: Range<u64>, advice: ubc::Advice) -> Result<()> {
        Ok(self.inner.advise(range, advice)?)
    }

    /// Have `hook` called before this file's bytes, at this layer, are written back into
    /// the layer below (or the store, at the bottom), with their byte range; the write waits
    /// until it returns. See [`ubc::File::set_writeback_hook`] for when it is called, what
    /// it may do and what an error does. The layers below receive nothing of a range before
    /// its hook returned, so nothing of it reaches the store earlier either.
    pub fn set_writeback_hook(&self, hook: Option<ubc::WritebackHook>) -> Result<()> {
        Ok(self.inner.set_writeback_hook(hook)?)
    }

    /// Data written through layers above this one is pushed down, then everything reaches
    /// the store and is made durable (through every layer below): `fdatasync(2)`.
    pub fn sync(&self) -> Result<()> {
        let _r = match self.group.pin_remote_for_sync()? {
            Some(None) => return Ok(()),
            pin => pin,
        };
        self.group.flush_above(self.domain)?;
        Ok(self.inner.sync()?)
    }

    /// `fsync(2)`: [`File::sync`], then the store's other metadata (times) made durable too
    /// ([`ubc::File::sync_all`]).
    pub fn sync_all(&self) -> Result<()> {
        let _r = match self.group.pin_remote_for_sync()? {
            Some(None) => return Ok(()),
            pin => pin,
        };
        self.group.flush_above(self.domain)?;
        Ok(self.inner.sync_all()?)
    }

    /// `O_DSYNC`/`O_SYNC` for this handle's writes from now on ([`ubc::File::set_write_sync`]).
    pub fn set_write_sync(&self, mode: ubc::WriteSync) -> Result<()> {
        Ok(self.inner.set_write_sync(mode)?)
    }

    /// Write the file's dirty data — through every layer — back into the store and wait
    /// for it, without the store's own `sync` where the layers allow: what `close(2)` does
    /// on a host file system that reports write-back errors at close (NFS). A failed write
    /// into the store (`ENOSPC`, `EIO`) is returned, and the pages stay dirty. Every domain
    /// holding dirty data is pushed down, top first, as for a read at the bottom; a zstd
    /// layer publishes a commit as it is pushed (written through to the store, not waited
    /// for: [`crate::compress::CompressPager::publish`]). Then the stored bytes' pages are
    /// written. Durable only after [`File::sync`].
    pub fn write_back(&self) -> Result<()> {
        let _r = match self.group.pin_remote_for_sync()? {
            Some(None) => return Ok(()),
            pin => pin,
        };
        self.group.flush_dirty_above(0, Flush::Publish)?;
        match self.group.domain(0) {
            Some(d) => Ok(d.file.clean(0..u64::MAX)?),
            None => Ok(()),
        }
    }

    /// Close the handle (see [`ubc::File::close`]): later calls fail, its byte-range locks
    /// are released, and a writeback failure of the file this handle has not been told
    /// about is returned (the handle is closed either way).
    pub fn close(&self) -> Result<()> {
        self.group.unlock_all(self.owner);
        Ok(self.inner.close()?)
    }

    /// Map bytes `range` (see [`ubc::File::map`]). The mapping is coherent with every
    /// layer: writes through another layer invalidate its pages (they re-fault), and its
    /// stores are written down before another layer reads those bytes.
    pub fn map(&self, range: Range<u64>, access: ubc::Access, sharing: ubc::Sharing) -> Result<Mapping> {
        let write = access == ubc::Access::ReadWrite && sharing == ubc::Sharing::Shared;
        let mode = if write { Mode::Write } else { Mode::Read };
        // Between machines a mapping is coherent as of its faults: the token is pinned while
        // it is made, each fault takes it again (`Pager::fault_guard` of the stored file),
        // and giving it up drops the mapped pages (they re-fault).
        let _r = self.group.pin_remote(mode)?;
        // Registered first, so that conflicting operations in other domains see it from
        // the moment pages can be faulted.
        let id = self.group.map(self.domain, range.clone(), write);
        let m = self
            .group
            .acquire(&self.dom, self.domain, range.clone(), mode)
            .and_then(|_p| self.inner.map(range.clone(), access, sharing));
        match m {
            Ok(m) => Ok(Mapping { inner: Some(m), group: self.group.again(), domain: self.domain, id }),
            Err(e) => {
                self.group.unmap(self.domain, id);
                Err(e.into())
            }
        }
    }

    /// Take an advisory byte-range lock (like `fcntl(F_SETLK)`, or `F_SETLKW` with
    /// [`LockWait::Block`]) on bytes `range`. Locks hold across layers: they are compared in
    /// the stored bytes of the bottom layer. Returns whether the lock was taken (always
    /// true with `Block`).
    pub fn lock(&self, range: Range<u64>, kind: LockKind, wait: LockWait) -> bool {
        self.group.lock(self.owner, 0, self.domain, range, kind, wait)
    }

    /// [`File::lock`] for the lock owner `owner` (a process, or an open file description,
    /// as a FUSE request names it) rather than this handle: POSIX record locks belong to
    /// the process, whichever descriptor took them. `pid` is shown by [`File::test_lock`].
    /// The owner's locks go with [`File::unlock_owner`], not with this handle.
    pub fn lock_as(&self, owner: LockOwner, pid: u32, range: Range<u64>, kind: LockKind, wait: LockWait) -> bool {
        self.group.lock(owner.key(), pid, self.domain, range, kind, wait)
    }

    /// The lock of another owner that a `kind` lock on `range` by `owner` would conflict
    /// with (`F_GETLK`).
    pub fn test_lock(&self, owner: LockOwner, range: Range<u64>, kind: LockKind) -> Option<LockConflict> {
        self.group.test_lock(owner.key(), self.domain, range, kind)
    }

    /// Release `owner`'s locks on `range` (`F_UNLCK`), splitting those it cuts.
    pub fn unlock_as(&self, owner: LockOwner, range: Range<u64>) {
        self.group.unlock(owner.key(), self.domain, range)
    }

    /// Release every lock of `owner` on this file (the process closed a descriptor of it).
    pub fn unlock_owner(&self, owner: LockOwner) {
        self.group.unlock_all(owner.key())
    }

    /// Take or convert a BSD `flock(2)` lock on the whole file for `owner` (an open file
    /// description, as a FUSE request names it). It holds against the `flock` locks of
    /// every layer's handles of the file, and never against record locks ([`File::lock`],
    /// [`File::lock_as`]): on Linux the two kinds do not interact. Returns whether the lock
    /// was taken (always true with `Block`); a held lock is converted, not stacked.
    pub fn flock_as(&self, owner: LockOwner, kind: LockKind, wait: LockWait) -> bool {
        self.group.flock(owner.key(), kind, wait)
    }

    /// Release `owner`'s `flock(2)` lock on this file (`LOCK_UN`, or the open file
    /// description closed).
    pub fn funlock_as(&self, owner: LockOwner) {
        self.group.funlock(owner.key())
    }

    /// Release this handle's locks overlapping `range`.
    pub fn unlock(&self, range: Range<u64>) {
        self.group.unlock(self.owner, self.domain, range)
    }

    /// Statistics of this layer's cached object for the file.
    pub fn stats(&self) -> ubc::Stats {
        self.inner.stats()
    }

    /// Drop this layer's clean cached pages in `range`: the caller keeps a copy (see
    /// [`ubc::File::drop_clean`]). The domains below keep theirs (a general layer's lower
    /// bytes are not what the caller holds). Returns the pages dropped.
    pub fn drop_clean(&self, range: Range<u64>) -> Result<u64> {
        Ok(self.inner.drop_clean(range)?)
    }

    /// The cache-level handle (no coherence: for diagnostics and tests).
    pub fn cache_file(&self) -> &ubc::File {
        &self.inner
    }
}

impl Drop for File {
    fn drop(&mut self) {
        self.group.unlock_all(self.owner);
    }
}

impl std::fmt::Debug for File {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("File")
            .field("path", &self.path)
            .field("layer", &self.level)
            .field("domain", &self.domain)
            .finish()
    }
}

/// A memory mapping of a stack file (see [`File::map`]).
pub struct Mapping {
    inner: Option<ubc::Mapping>,
    /// Keeps the group in use while mapped (dropped after the unmap).
    group: Use,
    domain: usize,
    id: u64,
}

impl Mapping {
    /// `msync`: write the mapping's stores to the layer's store, then sync it. At a general
    /// layer (zstd, aead) that sync commits below — a zstd commit, an aead header and the
    /// sync of its lower file — so there the whole file of the layer is synced, which first
    /// waits for every write-back of it in flight. A flush of the mapped range alone would let
    /// the commit below catch a block the flusher is writing at that moment half-written (the
    /// writer releases page k before filling page k+1): in `dir | zstd | aead` that aead block
    /// would fail authentication after a crash (tests/crash.rs).
    pub fn flush(&self) -> Result<()> {
        let m = self.inner.as_ref().expect("live");
        match self.group.domain(self.domain) {
            Some(d) if self.domain > 0 => Ok(d.file.sync()?),
            _ => Ok(m.flush()?),
        }
    }
}

impl std::ops::Deref for Mapping {
    type Target = ubc::Mapping;
    fn deref(&self) -> &ubc::Mapping {
        self.inner.as_ref().expect("live")
    }
}

impl std::ops::DerefMut for Mapping {
    fn deref_mut(&mut self) -> &mut ubc::Mapping {
        self.inner.as_mut().expect("live")
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        drop(self.inner.take());
        self.group.unmap(self.domain, self.id);
    }
}

// Stacks and files are shared across threads.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Stack>();
    send_sync::<File>();
};

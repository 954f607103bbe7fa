//! Stacks: an ordered set of layers over one cache, every layer reachable, every file kept
//! coherent across layers by the cache manager ([`crate::coherence`]).

use crate::coherence::{ALL, CoherenceStats, Counters, Group, Mode};
pub use crate::coherence::{Coherence, LockConflict, LockKind, LockWait};
use crate::error::{Error, Result};
use crate::layer::{Attr, Below, DirEntry, Kind, Layer, Opened, Rename, SetAttr, norm};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// What identifies a file's group: the bottom store's identity (the file token).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum GroupKey {
    Data(ubc::Identity),
    /// A store without identity: by layer and path.
    Path(usize, String),
}

/// A layer's name cache: the file a path names, once opened through the stack — its group
/// and domain, whose cached object knows the length as this layer sees it. It spares a
/// `getattr` of a general layer (whose size is the cleartext length) from opening the file
/// again. Attributes themselves are read from the layer every time (the often-changing
/// group — size, times — is most of them); entries are dropped, in every layer at once, when
/// a name is removed, renamed, created or changed (the paper's tag-and-broadcast).
type Named = (Arc<Group>, usize);

struct Inner {
    cache: ubc::Cache,
    layers: Vec<Arc<dyn Layer>>,
    groups: Mutex<HashMap<GroupKey, Arc<Group>>>,
    counters: Arc<Counters>,
    coherence: Coherence,
    /// Per layer: path → the opened file (see [`Named`]).
    names: Vec<Mutex<HashMap<String, Named>>>,
    name_hits: AtomicU64,
    name_invalidations: AtomicU64,
    next_owner: AtomicU64,
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
}

impl Stack {
    /// Build a stack from a spec: layers bottom first, separated by `|`:
    ///
    /// * `dir:PATH` — a host directory; `mem` — an in-memory tree
    /// * `null` — pass-through
    /// * `zstd[:level=N][,chunk=BYTES]` — compression (level 3, 64 KiB chunks by default)
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
        let names = layers.iter().map(|_| Mutex::new(HashMap::new())).collect();
        Ok(Stack {
            inner: Arc::new(Inner {
                cache,
                layers,
                groups: Mutex::new(HashMap::new()),
                counters: Arc::new(Counters::default()),
                coherence,
                names,
                name_hits: AtomicU64::new(0),
                name_invalidations: AtomicU64::new(0),
                next_owner: AtomicU64::new(1),
            }),
        })
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

    /// Write every dirty page of every file down through the stack and sync the stores.
    pub fn sync_all(&self) -> Result<()> {
        let groups: Vec<Arc<Group>> = self.inner.groups.lock().values().cloned().collect();
        for g in groups {
            g.flush_above(0)?;
        }
        Ok(self.inner.cache.sync_all()?)
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
        let groups: Vec<Arc<Group>> = self.groups.lock().values().cloned().collect();
        for g in groups {
            let _ = g.flush_above(0);
        }
    }
}

impl Inner {
    /// Open the data of `path` at `level`: the file's group, its domain there, and a handle.
    /// The name cache of `level` and of every level below that the open passed through
    /// learns the file, so that a `getattr` at any of them reads the cached length.
    fn open_node(self: &Arc<Self>, level: usize, path: &str, writable: bool) -> Result<Node> {
        let node = self.open_node_at(level, path, writable)?;
        self.names[level].lock().insert(path.to_string(), (node.group.clone(), node.domain));
        Ok(node)
    }

    fn open_node_at(self: &Arc<Self>, level: usize, path: &str, writable: bool) -> Result<Node> {
        let access = if writable { ubc::Access::ReadWrite } else { ubc::Access::ReadOnly };
        let below = BelowImpl { inner: self, level };
        match self.layers[level].open(path, access, &below)? {
            Opened::Store(pager) => {
                if writable && !pager.is_writable() {
                    return Err(Error::ReadOnly(path.into()));
                }
                let file = self.cache.open(pager, access)?;
                let key = match file.identity() {
                    Some(i) => GroupKey::Data(i),
                    None => GroupKey::Path(level, path.to_string()),
                };
                let group = self
                    .groups
                    .lock()
                    .entry(key)
                    .or_insert_with(|| Arc::new(Group::new(self.counters.clone(), self.coherence)))
                    .clone();
                group.add_domain(0, || Ok((file.reopen(ubc::Access::ReadOnly)?, None)))?;
                Ok(Node { file, group, domain: 0 })
            }
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
                let dom = lower.group.add_domain(idx, move || {
                    let lw = lower_file.is_writable();
                    // Internal: the pager's lower file must not keep the cache running.
                    let (pager, xlate) = layer.wrap(&named, lower_file.internal())?;
                    let acc = if lw { ubc::Access::ReadWrite } else { ubc::Access::ReadOnly };
                    Ok((cache.open(pager, acc)?, Some(xlate)))
                })?;
                let file = dom.file.reopen(access).map_err(|e| match e {
                    ubc::Error::ReadOnly => Error::ReadOnly(path.into()),
                    e => e.into(),
                })?;
                Ok(Node { file, group: lower.group, domain: idx })
            }
        }
    }

    fn invalidate_names(&self, path: &str) {
        self.name_invalidations.fetch_add(1, Relaxed);
        let prefix = format!("{path}/");
        for m in &self.names {
            m.lock().retain(|p, _| p != path && !p.starts_with(&prefix));
        }
    }

    /// The file token of `path` as seen at `level`, if it is a regular file whose only name
    /// this is (its data goes with the name). Opens it: never a FIFO, which would wait for
    /// a writer.
    fn group_of(self: &Arc<Self>, level: usize, path: &str) -> Option<(Arc<Group>, Option<ubc::Identity>)> {
        let a = self.layers[level].getattr(path).ok()?;
        if a.kind != Kind::File || a.nlink > 1 {
            return None;
        }
        let node = self.open_node(level, path, false).ok()?;
        Some((node.group.clone(), node.file.identity()))
    }
}

struct Node {
    file: ubc::File,
    group: Arc<Group>,
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

    /// This layer's spec.
    pub fn spec(&self) -> String {
        self.layer().spec()
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
        // general layer's length exists only in the opened file.
        let named = self.inner().names[self.level].lock().get(&p).cloned();
        let group = match named.and_then(|(g, d)| Some((g.domain(d)?, g, d))) {
            Some((dom, g, d)) => {
                self.inner().name_hits.fetch_add(1, Relaxed);
                a.size = {
                    let _p = g.acquire(&dom, d, ALL, Mode::Read)?;
                    dom.file.len()?
                };
                Some(g)
            }
            None if self.layer().is_general() || self.level_is_above_general() => {
                let f = self.open_with(&p, OpenOptions::default())?;
                a.size = f.len()?;
                Some(f.group.clone())
            }
            None => None,
        };
        // Data written but not yet written back has moved the times already (POSIX), though
        // the store's own clock moves only at writeback.
        if let Some(m) = group.and_then(|g| g.modified()) {
            a.mtime = a.mtime.max(m);
            a.ctime = a.ctime.max(m);
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
            match self.layer().setattr(&p, &rest) {
                // A union's lower file: copied up by opening it for writing, then changed.
                Err(Error::ReadOnly(_)) if self.layer().getattr(&p)?.kind == Kind::File => {
                    drop(self.open_with(&p, OpenOptions { write: true, ..Default::default() })?);
                    self.layer().setattr(&p, &rest)?;
                }
                r => r?,
            }
        }
        if rest.mtime.is_some()
            && let Some((g, _)) = self.inner().names[self.level].lock().get(&p)
        {
            g.forget_modified();
        }
        // The name still names the same file: the name caches stay.
        Ok(())
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
        match self.layer().link(&f, &t) {
            Err(Error::CrossDevice(_)) if self.layer().getattr(&f)?.kind == Kind::File => {
                drop(self.open_with(&f, OpenOptions { write: true, ..Default::default() })?);
                self.layer().link(&f, &t)?;
            }
            r => r?,
        }
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
        match self.layer().setxattr(&p, name, value, flags) {
            // A union's lower file: copied up by opening it for writing, then changed.
            Err(Error::ReadOnly(_)) if self.layer().getattr(&p)?.kind == Kind::File => {
                drop(self.open_with(&p, OpenOptions { write: true, ..Default::default() })?);
                self.layer().setxattr(&p, name, value, flags)
            }
            r => r,
        }
    }

    pub fn listxattr(&self, path: &str) -> Result<Vec<String>> {
        self.layer().listxattr(&norm(path)?)
    }

    pub fn removexattr(&self, path: &str, name: &str) -> Result<()> {
        self.layer().removexattr(&norm(path)?, name)
    }

    fn forget_group(&self, g: &Arc<Group>, id: Option<ubc::Identity>) {
        let mut groups = self.inner().groups.lock();
        groups.retain(|_, x| !Arc::ptr_eq(x, g));
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
        if self.layer().spec().starts_with("union:")
            && let Ok(a) = self.layer().getattr(&f)
            && a.kind == Kind::File
        {
            // Copy a lower file up first: the union renames only upper files.
            drop(self.open_with(&f, OpenOptions { write: true, ..Default::default() })?);
        }
        // Exchanged or kept, the file at `to` lives on under a name: only a replaced one goes.
        let replaced = if how == Rename::Replace { self.inner().group_of(self.level, &t) } else { None };
        self.layer().rename_with(&f, &t, how)?;
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
            group: node.group,
            domain: node.domain,
            owner: self.inner().next_owner.fetch_add(1, Relaxed),
            path: p,
            level: self.level,
        };
        if opts.truncate && opts.write {
            f.set_len(0)?;
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
/// with every other layer's view of the same file, mappings included.
pub struct File {
    inner: ubc::File,
    group: Arc<Group>,
    dom: Arc<crate::coherence::Domain>,
    domain: usize,
    owner: u64,
    path: String,
    level: usize,
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
        let _p = self.group.acquire(&self.dom, self.domain, span(offset, buf.len())?, Mode::Read)?;
        Ok(self.inner.read_at(buf, offset)?)
    }

    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let _p = self.group.acquire(&self.dom, self.domain, span(offset, buf.len())?, Mode::Read)?;
        Ok(self.inner.read_exact_at(buf, offset)?)
    }

    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<usize> {
        let _p = self.group.acquire(&self.dom, self.domain, span(offset, buf.len())?, Mode::Write)?;
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
        let mut n = 0;
        while n < buf.len() {
            match self.write_at(&buf[n..], at + n as u64)? {
                0 => break,
                k => n += k,
            }
        }
        Ok((at, n))
    }

    /// Length as this layer sees it (data written through layers above included).
    pub fn len(&self) -> Result<u64> {
        let _p = self.group.acquire(&self.dom, self.domain, ALL, Mode::Read)?;
        Ok(self.inner.len()?)
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    pub fn set_len(&self, len: u64) -> Result<()> {
        let cur = self.inner.len()?;
        let _p = self.group.acquire(&self.dom, self.domain, cur.min(len)..u64::MAX, Mode::Write)?;
        let r = self.inner.set_len(len);
        self.group.note_modified();
        Ok(r?)
    }

    /// Data written through layers above this one is pushed down, then everything reaches
    /// the store and is made durable (through every layer below).
    pub fn sync(&self) -> Result<()> {
        self.group.flush_above(self.domain)?;
        Ok(self.inner.sync()?)
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
        // Registered first, so that conflicting operations in other domains see it from
        // the moment pages can be faulted.
        let id = self.group.map(self.domain, range.clone(), write);
        let m = self
            .group
            .acquire(&self.dom, self.domain, range.clone(), mode)
            .and_then(|_p| self.inner.map(range.clone(), access, sharing));
        match m {
            Ok(m) => Ok(Mapping { inner: Some(m), group: self.group.clone(), domain: self.domain, id }),
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

    /// Release this handle's locks overlapping `range`.
    pub fn unlock(&self, range: Range<u64>) {
        self.group.unlock(self.owner, self.domain, range)
    }

    /// Statistics of this layer's cached object for the file.
    pub fn stats(&self) -> ubc::Stats {
        self.inner.stats()
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
    group: Arc<Group>,
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

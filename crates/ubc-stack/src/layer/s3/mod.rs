//! `s3`: a bottom layer in an S3 bucket (issue 21, first part), through the `object_store`
//! crate. Spec: `s3:BUCKET[/PREFIX][?endpoint=URL&region=R&chunk=SIZE]`; credentials the
//! standard way (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
//! `AWS_REGION`, `AWS_ENDPOINT`, instance metadata), as every AWS client takes them.
//!
//! # How files are stored (docs/formats.md, "The s3 layer", has the bytes)
//!
//! The designs S3 file systems use, and why this one:
//! * *an object per file, named by its path* (s3fs, goofys, mountpoint-s3): a random write
//!   rewrites the whole object (or is refused), a rename copies every byte;
//! * *chunks and a metadata engine* (JuiceFS, S3QL): a file is a list of immutable chunk
//!   objects named by inode, versioned; names, sizes and chunk lists live in a database. A
//!   random write uploads one chunk (S3QL's blocks) or only the bytes written (JuiceFS's
//!   slices, compacted later); a rename changes metadata only.
//!
//! ubc takes the second, with the metadata kept in the bucket itself (a separate database is
//! issue 21's coherence part, through etcd): chunk objects `PREFIX/ubc-s3/c/<ino>/<index>.
//! <version>` (16 hex digits each), immutable — a changed chunk is uploaded as a new
//! version, or only the bytes written as a *patch* laid over it (JuiceFS's slices: a random
//! 4 KiB write uploads 4 KiB; a chunk whose patches grow past 16 or a quarter of the chunk
//! is stored whole again) — and a *tree* object per commit, `PREFIX/ubc-s3/tree/<seq>`, holding every name
//! with its attributes, size and chunk list. A commit uploads the staged chunks, then PUTs
//! the next tree (a PUT is atomic, and an opening reads the highest number: it finds the old
//! tree or the new one, never a mix — and a PUT delayed in the network, arriving after a
//! newer commit, only adds an older tree that nobody reads), then deletes the versions the
//! new tree no longer names and the trees before the previous one. So after a crash
//! the bucket holds the last committed tree, every chunk it names, and perhaps garbage
//! (objects of a commit that did not finish), which the next open sweeps away.
//!
//! Commits happen at a file's `sync` (`fsync`), a directory's `sync_dir`, `Stack::sync_all`,
//! every 5 seconds while something changed (the background committer) and when the layer is
//! dropped. The tree costs O(names) per commit: fine to ~10⁵ names.
//!
//! Several machines (processes) may use one prefix at once when the spec names an etcd
//! (`etcd=`): names and records then live there and tokens guard each machine's cache
//! (`shared.rs`, `crate::dist`); without it, one process per prefix (the open sweep and the
//! single tree assume one writer). Chunks of 8 MiB and more are uploaded in parts, in
//! parallel (`file.rs`, `MULTIPART_MIN`).

mod file;
pub(crate) mod format;
#[cfg(feature = "etcd")]
pub(crate) mod meta_etcd;
#[cfg(feature = "etcd")]
mod shared;

use super::tree::{Node, Tree};
use super::{Attr, Below, DirEntry, Kind, Layer, Opened, Rename, SetAttr};
use crate::error::{Error, Result};
use file::S3File;
use format::{Chunk, StoredNode, StoredTree};
use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How long the background committer waits between looks.
const COMMIT_EVERY: Duration = Duration::from_secs(5);

/// How long a sync, or the layer's drop, waits for the deletions of objects nothing names
/// any more ([`Shared::settle`]).
const SETTLE_WAIT: Duration = Duration::from_secs(5);

/// Where and how: parsed from the spec.
#[derive(Clone, Debug)]
pub struct S3Options {
    pub bucket: String,
    /// Object name prefix (no leading or trailing `/`; empty for the bucket's root).
    pub prefix: String,
    /// The service's URL (`http://127.0.0.1:9000`); `None`: AWS (or `AWS_ENDPOINT`).
    pub endpoint: Option<String>,
    pub region: Option<String>,
    /// Bytes per chunk object: a power of two from 64 KiB to 16 MiB (default 1 MiB). A
    /// random write uploads the bytes written at the next commit (a patch of the chunk); a
    /// read fetches whole chunks.
    pub chunk_size: u64,
    /// How long a request is retried (with exponential backoff) before it fails (default
    /// 120 s).
    pub retry_timeout: Duration,
    /// How long one attempt may take before it is abandoned (and retried): default 30 s.
    pub timeout: Duration,
    /// etcd's client URLs (comma-separated): names, records and tokens live there, and
    /// several machines may use the file system at once (`etcd=`; feature `etcd`).
    pub etcd: Option<String>,
    /// The TTL of this machine's etcd lease (`lease=`, seconds, default 10): how long
    /// another machine waits at most for a token this one held when it vanished, and how
    /// stale a partitioned machine's cache may be.
    pub lease: Duration,
}

impl S3Options {
    /// Parse `BUCKET[/PREFIX][?endpoint=URL&region=R&chunk=SIZE]`.
    pub fn parse(s: &str) -> Result<S3Options> {
        let (loc, query) = s.split_once('?').unwrap_or((s, ""));
        let loc = loc.trim_matches('/');
        let (bucket, prefix) = loc.split_once('/').unwrap_or((loc, ""));
        if bucket.is_empty() {
            return Err(Error::Spec("s3: needs a bucket (s3:BUCKET/PREFIX?endpoint=URL)".into()));
        }
        let mut o = S3Options {
            bucket: bucket.into(),
            prefix: prefix.trim_matches('/').into(),
            endpoint: None,
            region: None,
            chunk_size: 1 << 20,
            retry_timeout: Duration::from_secs(120),
            timeout: Duration::from_secs(30),
            etcd: None,
            lease: Duration::from_secs(10),
        };
        for kv in query.split('&').filter(|x| !x.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| Error::Spec(format!("s3: `{kv}` is not key=value")))?;
            match k {
                "endpoint" => o.endpoint = Some(v.into()),
                "region" => o.region = Some(v.into()),
                "chunk" => {
                    let n = crate::spec::size("s3", "chunk", v)? as u64;
                    if !n.is_power_of_two() || !(64 << 10..=16 << 20).contains(&n) {
                        return Err(Error::Spec(format!("s3: chunk={v} must be a power of two from 64K to 16M")));
                    }
                    o.chunk_size = n;
                }
                "etcd" => o.etcd = Some(v.into()),
                "lease" => {
                    let secs: u64 = v
                        .parse()
                        .ok()
                        .filter(|s| (2..=3600).contains(s))
                        .ok_or_else(|| Error::Spec(format!("s3: lease={v} is not 2..=3600 seconds")))?;
                    o.lease = Duration::from_secs(secs);
                }
                "retry_timeout" | "timeout" => {
                    let secs: f64 = v
                        .parse()
                        .ok()
                        .filter(|s: &f64| s.is_finite() && *s >= 0.0 && *s <= 3600.0)
                        .ok_or_else(|| Error::Spec(format!("s3: {k}={v} is not 0..=3600 seconds")))?;
                    if k == "timeout" {
                        if secs == 0.0 {
                            return Err(Error::Spec("s3: timeout=0 would fail every request".into()));
                        }
                        o.timeout = Duration::from_secs_f64(secs);
                    } else {
                        o.retry_timeout = Duration::from_secs_f64(secs);
                    }
                }
                _ => {
                    return Err(Error::Spec(format!(
                        "s3: unknown option `{k}` (known: endpoint, region, chunk, retry_timeout, timeout, etcd, lease)"
                    )));
                }
            }
        }
        Ok(o)
    }
}

/// Requests and bytes moved to and from the store (for tests and benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct S3Stats {
    pub gets: u64,
    pub get_bytes: u64,
    pub puts: u64,
    pub put_bytes: u64,
    /// Objects deleted (requested: in batches of up to 1,000 a request).
    pub deletes: u64,
    pub commits: u64,
    /// Objects uploaded in parts (chunks of at least 8 MiB), among `puts`.
    pub multipart: u64,
}

/// GET requests and bytes.
#[derive(Default)]
pub(crate) struct GetCounts {
    n: AtomicU64,
    bytes: AtomicU64,
}

impl GetCounts {
    pub(crate) fn count(&self, bytes: usize) {
        self.n.fetch_add(1, Relaxed);
        self.bytes.fetch_add(bytes as u64, Relaxed);
    }
}

/// What the layer and its files share.
pub(crate) struct Shared {
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) rt: tokio::runtime::Runtime,
    /// `PREFIX/ubc-s3/` (or `ubc-s3/`).
    root: String,
    pub(crate) chunk: u64,
    /// `endpoint/bucket/prefix`, naming the store in identities and messages.
    pub(crate) id: String,
    next_version: AtomicU64,
    /// Chunk objects no committed tree will name once the next commit is done — versions
    /// replaced, and every object of files unlinked and closed: deleted after it.
    pub(crate) garbage: Mutex<Vec<ObjPath>>,
    /// GETs and their bytes: shared with the fetch tasks on the runtime, which must not
    /// hold the layer (a task holding the last reference would drop the runtime inside
    /// itself, which tokio refuses with a panic).
    pub(crate) gets: Arc<GetCounts>,
    puts: AtomicU64,
    put_bytes: AtomicU64,
    /// Counted by the deletion tasks (which must not hold the layer, as for `gets`).
    deletes: Arc<AtomicU64>,
    /// Deletions under way on the runtime ([`Shared::delete_later`]), for [`Shared::settle`].
    deleting: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    commits: AtomicU64,
    multipart: AtomicU64,
}

impl Shared {
    pub(crate) fn chunk_path(&self, ino: u64, idx: u64, version: u64) -> ObjPath {
        ObjPath::from(format!("{}c/{ino:016x}/{idx:016x}.{version:016x}", self.root))
    }

    /// Every object of chunk `idx` of inode `ino` as `c` names them: its base and patches.
    pub(crate) fn chunk_objects<'a>(&'a self, ino: u64, idx: u64, c: &'a Chunk) -> impl Iterator<Item = ObjPath> + 'a {
        c.objects().map(move |v| self.chunk_path(ino, idx, v))
    }

    /// The tree of commit `seq`.
    fn tree_path(&self, seq: u64) -> ObjPath {
        ObjPath::from(format!("{}tree/{seq:016x}", self.root))
    }

    /// The committed trees' sequence numbers, ascending.
    fn tree_seqs(&self) -> io::Result<Vec<u64>> {
        let mut seqs: Vec<u64> = self
            .list("tree/")?
            .iter()
            .filter_map(|m| m.location.filename().and_then(|f| u64::from_str_radix(f, 16).ok()))
            .collect();
        seqs.sort_unstable();
        Ok(seqs)
    }

    /// Take the garbage of file `ino` out of the list (its own commit deletes it).
    #[cfg(feature = "etcd")]
    fn take_garbage_of(&self, ino: u64) -> Vec<ObjPath> {
        let mine = format!("{}c/{ino:016x}/", self.root);
        let mut g = self.garbage.lock();
        let (of, rest): (Vec<ObjPath>, Vec<ObjPath>) = g.drain(..).partition(|p| p.as_ref().starts_with(&mine));
        *g = rest;
        of
    }

    pub(crate) fn new_version(&self) -> u64 {
        self.next_version.fetch_add(1, Relaxed)
    }

    pub(crate) fn counted_put(&self, bytes: usize) {
        self.puts.fetch_add(1, Relaxed);
        self.put_bytes.fetch_add(bytes as u64, Relaxed);
    }

    /// Delete `paths` (in parallel); a failure leaves garbage, not an error of the caller's.
    fn delete_all(&self, paths: Vec<ObjPath>) {
        if paths.is_empty() {
            return;
        }
        self.rt.block_on(delete_each(self.store.clone(), paths, self.deletes.clone()));
    }

    /// Delete `paths`, and every object of the files `inos` (a shared file system, where
    /// other machines may have uploaded versions this one never heard of: listed), in the
    /// background: nothing names them any more (a commit replaced or dropped them), so
    /// nothing need wait — not a file's `sync`, not the close of a removed file (a listing
    /// and a round trip per object were in both: a SQLite transaction, which syncs twice and
    /// removes its journal, took ~250 ms). [`Shared::settle`] waits for what was started, for
    /// a while; a failure, or a deletion still under way when the layer is dropped, leaves
    /// garbage for the sweep.
    pub(crate) fn delete_later(&self, paths: Vec<ObjPath>, inos: Vec<u64>) {
        if paths.is_empty() && inos.is_empty() {
            return;
        }
        let (store, deletes, root) = (self.store.clone(), self.deletes.clone(), self.root.clone());
        let task = self.rt.spawn(async move {
            let mut all = paths;
            for ino in inos {
                let prefix = ObjPath::from(format!("{root}c/{ino:016x}/"));
                let mut s = store.list(Some(&prefix));
                while let Some(Ok(m)) = s.next().await {
                    all.push(m.location);
                }
            }
            delete_each(store, all, deletes).await;
        });
        let mut d = self.deleting.lock();
        d.retain(|t| !t.is_finished());
        d.push(task);
    }

    /// Wait up to `limit` for the deletions [`Shared::delete_later`] started so far (a whole
    /// sync, the layer's drop); those still under way then go on in the background. Returns
    /// how many are. Bounded because they are garbage collection, not durability: a store
    /// slow to list or delete (s3s-fs walks the whole bucket for every listing) must not
    /// hold a sync or a daemon's shutdown (it held one for its 60 s deadline after an
    /// `rm -rf` of ~300 files). => not called on a thread of the runtime.
    pub(crate) fn settle(&self, limit: Duration) -> usize {
        let tasks = std::mem::take(&mut *self.deleting.lock());
        if tasks.is_empty() {
            return 0;
        }
        let left = self.rt.block_on(async move {
            let deadline = tokio::time::Instant::now() + limit;
            let mut left = Vec::new();
            for mut t in tasks {
                if left.is_empty() && tokio::time::timeout_at(deadline, &mut t).await.is_ok() {
                    continue;
                }
                if !t.is_finished() {
                    left.push(t);
                }
            }
            left
        });
        let n = left.len();
        self.deleting.lock().extend(left);
        n
    }

    /// Every object under `sub` of the layer's root.
    fn list(&self, sub: &str) -> io::Result<Vec<object_store::ObjectMeta>> {
        let prefix = ObjPath::from(format!("{}{sub}", self.root));
        let store = self.store.clone();
        self.rt.block_on(async move {
            let mut out = Vec::new();
            let mut s = store.list(Some(&prefix));
            while let Some(m) = s.next().await {
                out.push(m.map_err(io_err)?);
            }
            Ok(out)
        })
    }
}

/// Delete `paths` from `store` — S3's batch deletion, up to 1,000 objects a request
/// (object_store's `delete_stream`; one request per object was one round trip each) —
/// counting them in `deletes`; a failure leaves garbage (for the sweep), not an error.
async fn delete_each(store: Arc<dyn ObjectStore>, paths: Vec<ObjPath>, deletes: Arc<AtomicU64>) {
    let n = paths.len() as u64;
    store.delete_stream(futures::stream::iter(paths.into_iter().map(Ok)).boxed()).for_each(|_| async {}).await;
    deletes.fetch_add(n, Relaxed);
}

/// An object store error as an I/O error (not found stays `NotFound`).
pub(crate) fn io_err(e: object_store::Error) -> io::Error {
    match e {
        object_store::Error::NotFound { .. } => io::Error::new(io::ErrorKind::NotFound, e),
        e => io::Error::other(e),
    }
}

pub(crate) struct Inner {
    /// Shared with other machines (`etcd=`): names, records and tokens in etcd; `tree` is
    /// then unused. First, so that it is dropped before `shared`: leaving (the lease's
    /// revocation) runs on the runtime `shared` may be the last to hold.
    #[cfg(feature = "etcd")]
    dist: Option<Arc<shared::SharedFs>>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) tree: Tree<S3File>,
    /// Serializes commits; holds the sequence number of the last tree committed (0: none).
    commit_lock: Mutex<u64>,
    /// Set when the layer is dropped: the committer stops.
    closing: AtomicBool,
}

impl Inner {
    /// Upload every staged chunk, PUT the next tree, then delete what it no longer names.
    pub(crate) fn commit(&self) -> io::Result<()> {
        #[cfg(feature = "etcd")]
        if let Some(fs) = &self.dist {
            return fs.commit_all(&self.shared);
        }
        let mut seq = self.commit_lock.lock();
        let files: Vec<Arc<S3File>> = self.tree.nodes.lock().values().filter_map(|n| n.data.clone()).collect();
        for f in &files {
            f.flush()?;
        }
        self.tree.changed.store(false, Relaxed);
        let (bytes, garbage) = {
            let nodes = self.tree.nodes.lock();
            // Taken under the tree's lock, before the files' states are read: a version
            // listed here was replaced in its file's state before it was listed.
            let garbage = std::mem::take(&mut *self.shared.garbage.lock());
            let stored = nodes
                .iter()
                .map(|(p, n)| {
                    let (size, chunks) = match &n.data {
                        Some(f) => {
                            let st = f.state.lock();
                            (st.size, st.chunks.clone())
                        }
                        None => (0, BTreeMap::new()),
                    };
                    let node = StoredNode {
                        kind: n.kind,
                        ino: n.ino,
                        mode: n.mode,
                        uid: n.uid,
                        gid: n.gid,
                        rdev: n.rdev,
                        mtime: n.mtime,
                        atime: n.atime,
                        ctime: n.ctime,
                        target: n.target.clone(),
                        size,
                        chunks,
                    };
                    (p.clone(), node)
                })
                .collect();
            let t = StoredTree {
                next_ino: self.tree.next_ino.load(Relaxed),
                next_version: self.shared.next_version.load(Relaxed),
                chunk_size: self.shared.chunk as u32,
                nodes: stored,
            };
            (t.encode(), garbage)
        };
        let store = self.shared.store.clone();
        let path = self.shared.tree_path(*seq + 1);
        let n = bytes.len();
        let r = self.shared.rt.block_on(async move { store.put(&path, bytes::Bytes::from(bytes).into()).await });
        if let Err(e) = r {
            // Not committed: what was to go stays listed for the next commit.
            self.shared.garbage.lock().extend(garbage);
            self.tree.changed.store(true, Relaxed);
            return Err(io_err(e));
        }
        self.shared.counted_put(n);
        self.shared.commits.fetch_add(1, Relaxed);
        *seq += 1;
        // The tree before this one is kept (a reader that listed before this commit reads
        // it); older ones go.
        let mut stale = garbage;
        if *seq >= 3 {
            stale.push(self.shared.tree_path(*seq - 2));
        }
        self.shared.delete_later(stale, Vec::new());
        Ok(())
    }

    /// Whether the file system is shared with other machines (`etcd=`).
    fn is_shared(&self) -> bool {
        #[cfg(feature = "etcd")]
        return self.dist.is_some();
        #[cfg(not(feature = "etcd"))]
        false
    }

    /// Delete chunk objects the committed tree does not name and that are older than
    /// `SWEEP_AGE` (left by a commit that did not finish: a crash). Run once, when the layer
    /// is opened, before anything of this layer's own is uploaded. Younger ones may be a
    /// live writer's uploads not committed yet — another process over the same prefix, or
    /// an instance of this layer not dropped yet — and stay for a later sweep.
    fn sweep(&self) -> io::Result<u64> {
        let named: std::collections::HashSet<ObjPath> = {
            let nodes = self.tree.nodes.lock();
            nodes
                .values()
                .filter_map(|n| n.data.as_ref())
                .flat_map(|f| {
                    let st = f.state.lock();
                    st.chunks.iter().flat_map(|(&i, c)| self.shared.chunk_objects(f.ino, i, c)).collect::<Vec<_>>()
                })
                .collect()
        };
        let old = chrono_now_minus(SWEEP_AGE);
        let stale: Vec<ObjPath> = self
            .shared
            .list("c/")?
            .into_iter()
            .filter(|m| !named.contains(&m.location) && m.last_modified < old)
            .map(|m| m.location)
            .collect();
        let n = stale.len() as u64;
        self.shared.delete_all(stale);
        Ok(n)
    }
}

/// A random, non-zero 32-bit number for this opening's chunk versions.
fn epoch() -> u64 {
    let mut b = [0u8; 4];
    let _ = getrandom::fill(&mut b);
    u64::from(u32::from_le_bytes(b)).max(1)
}

/// How old an unnamed chunk object must be before a sweep takes it for a crash's leftover.
const SWEEP_AGE: Duration = Duration::from_secs(15 * 60);

/// Now minus `d`, in the time type object listings carry.
fn chrono_now_minus(d: Duration) -> chrono::DateTime<chrono::Utc> {
    chrono::Utc::now() - chrono::TimeDelta::from_std(d).unwrap_or_default()
}

/// The `s3` layer.
pub struct S3 {
    inner: Arc<Inner>,
    spec: String,
}

impl S3 {
    /// Open (or start) the file system at `o`: its tree is read from the bucket.
    pub fn open(o: &S3Options) -> Result<S3> {
        let mut query = Vec::new();
        if let Some(e) = &o.endpoint {
            query.push(format!("endpoint={e}"));
        }
        if let Some(r) = &o.region {
            query.push(format!("region={r}"));
        }
        if o.chunk_size != 1 << 20 {
            query.push(format!("chunk={}K", o.chunk_size >> 10));
        }
        if o.retry_timeout != Duration::from_secs(120) {
            query.push(format!("retry_timeout={}", o.retry_timeout.as_secs_f64()));
        }
        if o.timeout != Duration::from_secs(30) {
            query.push(format!("timeout={}", o.timeout.as_secs_f64()));
        }
        if let Some(e) = &o.etcd {
            query.push(format!("etcd={e}"));
        }
        if o.lease != Duration::from_secs(10) {
            query.push(format!("lease={}", o.lease.as_secs()));
        }
        let spec = format!(
            "s3:{}{}{}{}",
            o.bucket,
            if o.prefix.is_empty() { String::new() } else { format!("/{}", o.prefix) },
            if query.is_empty() { "" } else { "?" },
            query.join("&")
        );
        let bad = |e: &dyn std::fmt::Display| Error::Spec(format!("{spec}: {e}"));
        // Client options first: they carry `allow_http`, which a later `with_client_options`
        // would reset.
        let client = object_store::ClientOptions::new()
            .with_timeout(o.timeout)
            .with_connect_timeout(o.timeout.min(Duration::from_secs(5)));
        let mut b =
            object_store::aws::AmazonS3Builder::from_env().with_client_options(client).with_bucket_name(&o.bucket);
        if let Some(r) = o.region.clone().or_else(|| std::env::var("AWS_REGION").ok()) {
            b = b.with_region(r);
        } else {
            b = b.with_region("us-east-1");
        }
        if let Some(e) = &o.endpoint {
            b = b.with_endpoint(e).with_allow_http(e.starts_with("http://")).with_virtual_hosted_style_request(false);
        }
        let retry = object_store::RetryConfig {
            backoff: object_store::BackoffConfig::default(),
            max_retries: 10,
            retry_timeout: o.retry_timeout,
        };
        let store: Arc<dyn ObjectStore> = Arc::new(b.with_retry(retry).build().map_err(|e| bad(&e))?);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .thread_name("ubc-s3")
            .enable_all()
            .build()
            .map_err(|e| bad(&e))?;
        let root = if o.prefix.is_empty() { "ubc-s3/".to_string() } else { format!("{}/ubc-s3/", o.prefix) };
        let id = format!("{}/{}/{}", o.endpoint.as_deref().unwrap_or("aws"), o.bucket, o.prefix);
        let shared = Arc::new(Shared {
            store,
            rt,
            root,
            chunk: o.chunk_size,
            id: id.clone(),
            // Versions carry this opening's epoch in their high 32 bits (random), so two
            // instances over one prefix — a process and its successor still committing, or
            // two processes — never upload to the same object name.
            next_version: AtomicU64::new(epoch() << 32),
            garbage: Mutex::new(Vec::new()),
            gets: Arc::new(GetCounts::default()),
            puts: AtomicU64::new(0),
            put_bytes: AtomicU64::new(0),
            deletes: Arc::new(AtomicU64::new(0)),
            deleting: Mutex::new(Vec::new()),
            commits: AtomicU64::new(0),
            multipart: AtomicU64::new(0),
        });
        let dev = {
            use std::hash::{BuildHasher, BuildHasherDefault};
            BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(&id)
        };
        if let Some(endpoints) = &o.etcd {
            #[cfg(not(feature = "etcd"))]
            {
                let _ = endpoints;
                return Err(bad(&"etcd= needs ubc built with the `etcd` feature"));
            }
            #[cfg(feature = "etcd")]
            {
                // Shared with other machines: nothing of the bucket is read here — names and
                // records are in etcd, under a prefix naming the bucket and the prefix.
                let prefix = format!("/ubc/{}/{}", o.bucket, shared.root);
                let h = shared.rt.handle().clone();
                let meta = meta_etcd::EtcdMeta::open(h.clone(), endpoints, prefix.clone(), dev)?;
                let machine =
                    crate::dist::Machine::join(h, meta.client(), prefix.clone(), o.lease).map_err(|e| bad(&e))?;
                let fs = Arc::new(shared::SharedFs::new(meta, machine, prefix));
                let inner = Arc::new(Inner {
                    shared,
                    tree: Tree::empty(dev),
                    dist: Some(fs),
                    commit_lock: Mutex::new(0),
                    closing: AtomicBool::new(false),
                });
                let weak = Arc::downgrade(&inner);
                std::thread::Builder::new()
                    .name("ubc-s3-commit".into())
                    .spawn(move || committer(weak))
                    .map_err(|e| bad(&e))?;
                return Ok(S3 { inner, spec });
            }
        }
        // The last committed tree (the highest sequence number), or none yet (a new file
        // system). Trees are never overwritten, so a PUT delayed in the network (a request
        // its client gave up on, arriving after a newer commit) adds an older tree, which is
        // never read — where one mutable tree object would have been rolled back by it.
        let seqs = shared.tree_seqs().map_err(|e| bad(&e))?;
        let last_seq = seqs.last().copied().unwrap_or(0);
        let stored = if last_seq == 0 {
            None
        } else {
            let store = shared.store.clone();
            let path = shared.tree_path(last_seq);
            let b = shared.rt.block_on(async move { store.get(&path).await?.bytes().await }).map_err(|e| bad(&e))?;
            Some(StoredTree::decode(&b).map_err(|e| bad(&format!("tree {last_seq:016x}: {e}")))?)
        };
        // Trees older than the one before the last: leftovers (such a delayed PUT).
        let stale: Vec<ObjPath> = seqs.iter().filter(|&&s| s + 1 < last_seq).map(|&s| shared.tree_path(s)).collect();
        shared.delete_all(stale);
        if let Some(t) = &stored
            && t.chunk_size as u64 != o.chunk_size
        {
            return Err(bad(&format!(
                "stored with chunk={} (the chunk size of a file system cannot change)",
                t.chunk_size
            )));
        }
        let inner = Arc::new_cyclic(|weak: &Weak<Inner>| {
            let tree = match stored {
                None => Tree::empty(dev),
                Some(t) => {
                    let nodes = t
                        .nodes
                        .into_iter()
                        .map(|(p, n)| {
                            let data = (n.kind == Kind::File)
                                .then(|| Arc::new(S3File::new(shared.clone(), weak.clone(), n.ino, n.size, n.chunks)));
                            let node = Node {
                                kind: n.kind,
                                ino: n.ino,
                                mode: n.mode,
                                uid: n.uid,
                                gid: n.gid,
                                mtime: n.mtime,
                                atime: n.atime,
                                ctime: n.ctime,
                                data,
                                target: n.target,
                                rdev: n.rdev,
                            };
                            (p, node)
                        })
                        .collect();
                    Tree::with(nodes, dev, t.next_ino)
                }
            };
            Inner {
                shared: shared.clone(),
                tree,
                #[cfg(feature = "etcd")]
                dist: None,
                commit_lock: Mutex::new(last_seq),
                closing: AtomicBool::new(false),
            }
        });
        inner.sweep().map_err(|e| bad(&e))?;
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new().name("ubc-s3-commit".into()).spawn(move || committer(weak)).map_err(|e| bad(&e))?;
        Ok(S3 { inner, spec })
    }

    /// Requests and bytes moved so far.
    pub fn stats(&self) -> S3Stats {
        let s = &self.inner.shared;
        S3Stats {
            gets: s.gets.n.load(Relaxed),
            get_bytes: s.gets.bytes.load(Relaxed),
            puts: s.puts.load(Relaxed),
            put_bytes: s.put_bytes.load(Relaxed),
            deletes: s.deletes.load(Relaxed),
            commits: s.commits.load(Relaxed),
            multipart: s.multipart.load(Relaxed),
        }
    }

    /// Tokens between machines acquired, requested and given up (`etcd=`; `None` for a
    /// file system of one machine).
    #[cfg(feature = "etcd")]
    pub fn dist_stats(&self) -> Option<crate::DistStats> {
        self.inner.dist.as_ref().map(|fs| crate::DistStats { meta_requests: fs.meta.requests(), ..fs.machine.stats() })
    }

    /// Delete the chunk objects a crash left behind now, and say how many: in the tree mode
    /// those the last tree does not name, older than 15 minutes (the open does this too); on
    /// a file system shared through etcd those no record names, of files no machine holds
    /// a token of (the layer's committer does this once after the open).
    pub fn sweep(&self) -> Result<u64> {
        #[cfg(feature = "etcd")]
        if let Some(fs) = &self.inner.dist {
            return fs.sweep(&self.inner.shared).map_err(|e| Error::io(&self.spec, e));
        }
        self.inner.sweep().map_err(|e| Error::io(&self.spec, e))
    }

    /// Commit now (what `sync_dir` and a file's `sync` do).
    pub fn commit(&self) -> Result<()> {
        let r = self.inner.commit().map_err(|e| Error::io(&self.spec, e));
        self.inner.shared.settle(SETTLE_WAIT);
        r
    }

    fn add(&self, path: &str, kind: Kind, mode: u32) -> Result<()> {
        let (shared, weak) = (self.inner.shared.clone(), Arc::downgrade(&self.inner));
        let file = |ino| Arc::new(S3File::new(shared, weak, ino, 0, BTreeMap::new()));
        self.inner.tree.add(path, kind, mode, file).map(drop)
    }

    /// A node that lost its last name: its file's objects go once it is closed.
    fn unlinked(node: Option<Node<S3File>>) {
        if let Some(f) = node.and_then(|n| n.data) {
            f.unlinked.store(true, Relaxed);
        }
    }
}

/// The background committer: commits every `COMMIT_EVERY` while something changed, until
/// the layer is dropped.
fn committer(weak: Weak<Inner>) {
    // Shared: the leftovers of crashed machines, swept once in the background (a listing of
    // every chunk object; the tree mode sweeps at open instead, before it uploads anything).
    #[cfg(feature = "etcd")]
    if let Some(inner) = weak.upgrade()
        && let Some(fs) = &inner.dist
    {
        let _ = fs.sweep(&inner.shared);
    }
    loop {
        std::thread::sleep(COMMIT_EVERY);
        let Some(inner) = weak.upgrade() else { return };
        if inner.closing.load(Relaxed) {
            return;
        }
        if inner.tree.changed.load(Relaxed) || inner.is_shared() {
            let _ = inner.commit();
        }
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        self.inner.closing.store(true, Relaxed);
        if self.inner.tree.changed.load(Relaxed) || self.inner.is_shared() {
            let _ = self.inner.commit();
        }
        let left = self.inner.shared.settle(SETTLE_WAIT);
        if left > 0 {
            eprintln!(
                "ubc: {}: {left} batches of deletions of replaced or removed objects not finished in {SETTLE_WAIT:?}; the objects stay for the next sweep",
                self.spec
            );
        }
    }
}

/// Dispatch to the shared file system's operation when there is one (`etcd=`).
macro_rules! shared_or {
    ($self:ident, $fs:ident => $shared:expr) => {
        #[cfg(feature = "etcd")]
        if let Some($fs) = &$self.inner.dist {
            return $shared;
        }
    };
}

impl Layer for S3 {
    fn spec(&self) -> String {
        self.spec.clone()
    }
    fn lower(&self) -> Option<&Arc<dyn Layer>> {
        None
    }
    fn getattr(&self, path: &str) -> Result<Attr> {
        shared_or!(self, fs => fs.getattr(&self.inner.shared, path));
        self.inner.tree.getattr(path)
    }
    fn setattr(&self, path: &str, set: &SetAttr) -> Result<()> {
        shared_or!(self, fs => fs.meta.setattr(path, set));
        self.inner.tree.setattr(path, set)
    }
    fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        shared_or!(self, fs => fs.meta.readdir(path));
        self.inner.tree.readdir(path)
    }
    fn create(&self, path: &str, mode: u32) -> Result<()> {
        shared_or!(self, fs => fs.create(&self.inner.shared, path, mode));
        self.add(path, Kind::File, mode)
    }
    fn mkdir(&self, path: &str, mode: u32) -> Result<()> {
        shared_or!(self, fs => fs.meta.add(path, Kind::Dir, mode, 0, None).map(drop));
        self.add(path, Kind::Dir, mode)
    }
    fn remove(&self, path: &str) -> Result<()> {
        shared_or!(self, fs => fs.remove(&self.inner.shared, path));
        S3::unlinked(Some(self.inner.tree.remove(path)?));
        Ok(())
    }
    fn rmdir(&self, path: &str) -> Result<()> {
        shared_or!(self, fs => fs.meta.rmdir(path));
        self.inner.tree.rmdir(path)
    }
    fn rename(&self, from: &str, to: &str) -> Result<()> {
        shared_or!(self, fs => fs.rename(&self.inner.shared, from, to, Rename::Replace));
        S3::unlinked(self.inner.tree.rename(from, to)?);
        Ok(())
    }
    fn rename_with(&self, from: &str, to: &str, how: Rename) -> Result<()> {
        shared_or!(self, fs => fs.rename(&self.inner.shared, from, to, how));
        match how {
            Rename::Replace => self.rename(from, to),
            _ => self.inner.tree.rename_with(from, to, how, "an s3 tree"),
        }
    }
    fn sync_dir(&self, _path: &str) -> Result<()> {
        // Shared: every change of a name is in etcd (durable) when it returns.
        shared_or!(self, _fs => Ok(()));
        // The names are durable with the tree: no wait for the deletions it lets go.
        self.inner.commit().map_err(|e| Error::io(&self.spec, e))
    }
    fn symlink(&self, target: &str, path: &str) -> Result<()> {
        shared_or!(self, fs => fs.meta.add(path, Kind::Symlink, 0o777, 0, Some(target.to_string())).map(drop));
        self.inner.tree.symlink(target, path)
    }
    fn readlink(&self, path: &str) -> Result<String> {
        shared_or!(self, fs => fs.meta.readlink(path));
        self.inner.tree.readlink(path)
    }
    fn link(&self, _from: &str, to: &str) -> Result<()> {
        Err(Error::NotSupported(format!("{to}: hard links in an s3 tree")))
    }
    fn mknod(&self, path: &str, kind: Kind, mode: u32, rdev: u64) -> Result<()> {
        #[cfg(feature = "etcd")]
        if let Some(fs) = &self.inner.dist {
            if matches!(kind, Kind::File | Kind::Dir | Kind::Symlink) {
                return Err(Error::Invalid(format!("{path}: mknod makes special files only")));
            }
            return fs.meta.add(path, kind, mode, rdev, None).map(drop);
        }
        self.inner.tree.mknod(path, kind, mode, rdev)
    }
    fn getxattr(&self, path: &str, _name: &str) -> Result<Vec<u8>> {
        Err(Error::NotSupported(format!("{path}: extended attributes in an s3 tree")))
    }
    fn setxattr(&self, path: &str, _name: &str, _value: &[u8], _flags: i32) -> Result<()> {
        Err(Error::NotSupported(format!("{path}: extended attributes in an s3 tree")))
    }
    fn listxattr(&self, path: &str) -> Result<Vec<String>> {
        Err(Error::NotSupported(format!("{path}: extended attributes in an s3 tree")))
    }
    fn removexattr(&self, path: &str, _name: &str) -> Result<()> {
        Err(Error::NotSupported(format!("{path}: extended attributes in an s3 tree")))
    }
    fn open(&self, path: &str, _access: ubc::Access, _below: &dyn Below) -> Result<Opened> {
        shared_or!(self, fs => fs.open(&self.inner.shared, path));
        Ok(Opened::Store(self.inner.tree.data(path)?))
    }
    fn is_shared(&self) -> bool {
        self.inner.is_shared()
    }
    fn file_identity(&self, a: &Attr) -> Option<ubc::Identity> {
        shared_or!(self, _fs => Some(file::identity(&self.inner.shared, a.ino)));
        let _ = a;
        None
    }
    fn attr_key(&self, id: &ubc::Identity) -> Option<(u64, u64)> {
        file::ino_of(&self.inner.shared, id).map(|ino| (self.inner.tree.dev, ino))
    }
    fn sync_all(&self) -> Result<()> {
        self.commit()
    }
}

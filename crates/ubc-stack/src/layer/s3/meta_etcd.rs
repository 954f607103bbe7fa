//! The `s3` layer's names and per-file records kept in etcd (the `etcd=` option), so that
//! several machines share one file system coherently: the alternative to the in-memory tree
//! (`layer/tree.rs`) that one process commits to the bucket as one object.
//!
//! # Why this schema
//!
//! The model is JuiceFS's metadata engine over a transactional key-value store (etcd,
//! TiKV): names and attributes live in the KV store, one key per name and one per inode,
//! and every namespace operation is one transaction; the file's bytes live in objects
//! (chunks named by inode, as the bucket-only layer already stores them). A transaction
//! changes only the few keys an operation concerns, so machines working in different
//! directories do not contend, and a rename is a change of names only.
//!
//! # Keys (all under `prefix`, which ends in `/`; docs/formats.md, "Records in etcd")
//!
//! * `{prefix}n/{path}` — the name `path` (no leading `/`): 9 bytes, inode u64 LE | kind
//!   code u8 (format.rs's codes). The root has no name key: it is implicitly inode 1, a
//!   directory.
//! * `{prefix}i/{ino:016x}` — inode `ino`'s record: [`StoredNode::encode`] (attributes,
//!   size, chunk list, symlink target). The root's record (inode 1) is made by
//!   [`EtcdMeta::open`] if absent (created only if its `create_revision` is 0, so two
//!   machines opening at once do not clash).
//! * `{prefix}e/{dir:016x}/{name}` — entry `name` of directory inode `dir`: the same 9
//!   bytes as its name key. Written with every change of the directory's entries, when the
//!   directory's record counts its subdirectories (not `SUBDIRS_UNKNOWN`).
//! * `{prefix}next_ino` — u64 LE, the next inode number no machine has taken (absent: 2),
//!   taken by a compare-and-swap transaction in batches of `INO_BATCH` (64).
//!
//! # How operations are made race-free
//!
//! Each attempt of an operation reads at one etcd revision (the first read's, later reads
//! pinned to it: a snapshot), and commits in one transaction that compares every key it
//! read point-wise: `mod_revision == seen`, or `create_revision == 0` for a key seen absent.
//! A failed compare means another machine changed something read: the attempt is retried
//! from a fresh snapshot, after a random pause growing to 32 ms (`backoff`), until it
//! commits — or, after `GIVE_UP` (30 s) of conflicts, fails with an `Io` error
//! "contended". A conflict means another attempt committed, so the namespace always makes
//! progress; the deadline only bounds how long one caller can lose (a count of attempts
//! did not: eight threads racing on one directory of a loaded 2-core machine lost 100 in a
//! row).
//!
//! Ranges (a directory's entries) cannot be compared that way, so **a directory's record
//! serializes its entries**: every change of a directory's entries (add, remove, a rename
//! into or out of it) rewrites its record (mtime and ctime = now, as POSIX does) in the
//! same transaction. Hence "remove a directory only if empty" (`rmdir` reads the children
//! range and compares the directory's record) and "create only if absent, in a directory
//! that still exists" (create compares the parent's name and record and its own name's
//! `create_revision == 0`) cannot interleave wrongly across machines; a directory rename
//! compares the records of the moved directory and of every directory below it (read at
//! the snapshot), so no entry is added or removed under it unseen.
//!
//! # Limits
//!
//! * Names are keyed by path, so the names under a directory are its whole subtree. A
//!   directory's listing and link count are not read from them: each directory has an
//!   index of its entries (`e/{ino}/{name}`, kept in the transaction that changes them)
//!   and its record counts its subdirectories (`size`), from `UBCS3N03` on — a directory
//!   of an older record is listed and counted from the subtree, O(subtree).
//! * A directory rename moves every name under it in one transaction: refused with
//!   `NotSupported` beyond 9000 names under it (etcd started with `--max-txn-ops 10000`;
//!   the default 128 refuses much smaller ones) or ~1.4 MB of keys (etcd's default
//!   `--max-request-bytes`, 1.5 MiB).
//! * No hard links: a name is its inode; removing a name removes its record.
//! * Every change of a directory's entries rewrites that directory's record, so creates in
//!   one directory from many machines are serialized on it (retried on conflict).
//!
//! The API is synchronous: each call runs on the caller's thread with
//! [`Handle::block_on`] (never call it inside the runtime; a multi-thread runtime drives
//! the connection).

// Used by the s3 layer's `etcd=` option, which is being wired in; until then only the
// tests below call it.

use super::format::{SUBDIRS_UNKNOWN, StoredNode, kind_code, kind_of};
use crate::error::{Error, Result};
use crate::layer::{Attr, DirEntry, Kind, Rename, SetAttr, parent};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, KeyValue, KvClient, ResponseHeader, Txn,
    TxnOp, TxnOpResponse,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, SystemTime};
use tokio::runtime::Handle;

/// How long a namespace operation or a record update may keep losing to others before it
/// fails as contended.
const GIVE_UP: Duration = Duration::from_secs(30);

/// An operation's attempts, until `GIVE_UP` has passed since the first (at least three),
/// each after its `backoff` pause (none before the first).
pub(crate) fn attempts() -> impl Iterator<Item = u32> {
    let start = std::time::Instant::now();
    (0..).take_while(move |&i| i < 3 || start.elapsed() < GIVE_UP).inspect(|&i| backoff(i))
}
/// Most names a rename may move (etcd of ours runs with `--max-txn-ops 10000`).
const MAX_MOVE: usize = 9000;
/// Most bytes of keys and values in one transaction (etcd's default request limit: 1.5 MiB).
const MAX_TXN_BYTES: usize = 1_400_000;
/// Keys per page of a range read.
const PAGE: i64 = 1000;
/// Reads per read-only transaction (etcd's default `--max-txn-ops` is 128).
const READ_BATCH: usize = 100;
/// The root's inode number.
const ROOT_INO: u64 = 1;

/// Names and records of an `s3` file system in etcd (module documentation).
pub(crate) struct EtcdMeta {
    client: Client,
    rt: Handle,
    prefix: String,
    dev: u64,
    /// Inode numbers this machine took from `next_ino` and has not given yet.
    inos: parking_lot::Mutex<std::ops::Range<u64>>,
    /// The inode each name had when last read here (at most `HINTS` names): a guess that
    /// lets a name, its record and its tokens be read in one round trip (`Snap::prefetch`).
    /// Never trusted: the name is read with them, and a guess found wrong costs a second.
    hints: parking_lot::Mutex<HashMap<String, u64>>,
    /// Requests sent to etcd by the namespace (reads and transactions), for the tests and
    /// `DistStats::meta_requests`.
    requests: AtomicU64,
}

/// Names whose inode a machine remembers as a guess (`EtcdMeta::hints`); past it they are
/// all forgotten at once (a guess is only a saving).
const HINTS: usize = 1 << 16;

/// A name, its inode's record and the keys under a prefix of that inode's (its tokens),
/// read at one revision ([`EtcdMeta::entry`]).
pub(crate) struct Entry {
    pub(crate) attr: Attr,
    pub(crate) node: StoredNode,
    pub(crate) also: Vec<KeyValue>,
}

/// Inode numbers a machine takes from `next_ino` at once: a create then rarely pays a
/// transaction of its own for its number — each is an fsync of etcd's log (JuiceFS takes
/// inode numbers in batches for the same reason). Numbers of a batch not given when the
/// machine leaves are never given.
const INO_BATCH: u64 = 64;

/// A name's value: its inode and kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Name {
    ino: u64,
    kind: Kind,
}

fn encode_name(n: Name) -> Vec<u8> {
    let mut v = n.ino.to_le_bytes().to_vec();
    v.push(kind_code(n.kind));
    v
}

fn decode_name(path: &str, v: &[u8]) -> Result<Name> {
    let kind = (v.len() == 9).then(|| kind_of(v[8])).flatten();
    match kind {
        Some(kind) => Ok(Name { ino: u64::from_le_bytes(v[..8].try_into().expect("8 bytes")), kind }),
        None => Err(Error::io(
            path,
            io::Error::new(io::ErrorKind::InvalidData, "etcd name value: not 9 bytes of inode and kind"),
        )),
    }
}

/// The first key after every key that starts with `prefix` (etcd's prefix range end).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut e = prefix.to_vec();
    while let Some(&last) = e.last() {
        if last < 0xff {
            *e.last_mut().expect("non-empty") += 1;
            return e;
        }
        e.pop();
    }
    vec![0]
}

/// Whether `p` is strictly below directory `dir` (`dir` not the root).
fn is_under(p: &str, dir: &str) -> bool {
    p.len() > dir.len() && p.starts_with(dir) && p.as_bytes()[dir.len()] == b'/'
}

/// Directory record `n` after a change of its entries: times now, and `subdirs` more
/// subdirectories (fewer if negative) when it keeps their count.
fn touched(mut n: StoredNode, subdirs: i64) -> StoredNode {
    let now = SystemTime::now();
    (n.mtime, n.ctime) = (now, now);
    if n.kind == Kind::Dir && n.size != SUBDIRS_UNKNOWN {
        n.size = n.size.saturating_add_signed(subdirs);
    }
    n
}

/// Whether directory record `n` keeps its entries' index (`e/{ino}/`) and its
/// subdirectories' count: every directory but those of records before `UBCS3N03`.
fn indexed(n: &StoredNode) -> bool {
    n.kind == Kind::Dir && n.size != SUBDIRS_UNKNOWN
}

/// The last component of `path`.
fn base(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// 1 for a directory, else 0: what a name of `kind` adds to its parent's subdirectories.
fn subdir(kind: Kind) -> i64 {
    i64::from(kind == Kind::Dir)
}

fn contended(path: &str) -> Error {
    let p = if path.is_empty() { "/" } else { path };
    Error::Io {
        path: p.into(),
        source: io::Error::other(format!(
            "etcd namespace contended: gave up after {GIVE_UP:?} of conflicting attempts"
        )),
    }
}

/// Wait before attempt `i` (none before the first): a random pause growing to 32 ms, so
/// that contenders spread out. A blocking sleep: callers are plain threads in `block_on`.
fn backoff(i: u32) {
    if i == 0 {
        return;
    }
    let cap_us = 1000u64 << i.min(5);
    let r = getrandom::u64().unwrap_or(u64::from(i) * 7919);
    std::thread::sleep(Duration::from_micros(r % cap_us));
}

/// One attempt's reads: all at one revision, and each key read remembered with the
/// `mod_revision` seen (0: absent) for the commit's compares.
struct Snap<'m> {
    m: &'m EtcdMeta,
    kv: KvClient,
    /// The path errors name.
    path: String,
    /// The revision read at (0 until the first read).
    rev: i64,
    seen: BTreeMap<Vec<u8>, i64>,
    /// Keys read ahead at the snapshot ([`Snap::prefetch`]), until asked for.
    ahead: HashMap<String, Option<KeyValue>>,
    /// The same for every key under a prefix.
    ahead_under: HashMap<String, Vec<KeyValue>>,
}

impl Snap<'_> {
    fn err(&self, e: etcd_client::Error) -> Error {
        Error::io(&self.path, io::Error::other(e))
    }

    fn opts(&self) -> GetOptions {
        if self.rev > 0 { GetOptions::new().with_revision(self.rev) } else { GetOptions::new() }
    }

    fn pin(&mut self, h: Option<&ResponseHeader>) {
        if self.rev == 0
            && let Some(h) = h
        {
            self.rev = h.revision();
        }
    }

    /// Read the names `paths` and the records of the inodes they had when last read here
    /// (`EtcdMeta::hints`; the root's is known) — with the keys under `also(ino)` of each —
    /// in one round trip, at the snapshot, for the [`Snap::name`], [`Snap::record`] and
    /// [`Snap::range_ahead`] calls of the operation that follow, which otherwise make one
    /// round trip each, in turn (a create read four keys so, a rename six). A guess found
    /// wrong only costs the read it would have saved.
    async fn prefetch(&mut self, paths: &[&str], also: Option<&dyn Fn(u64) -> String>) -> Result<()> {
        let (mut keys, mut prefixes) = (Vec::with_capacity(paths.len() * 2), Vec::new());
        for &p in paths {
            let guess = if p.is_empty() { Some(ROOT_INO) } else { self.m.hints.lock().get(p).copied() };
            if !p.is_empty() {
                keys.push(self.m.name_key(p));
            }
            if let Some(g) = guess {
                keys.push(self.m.rec_key(g));
                prefixes.extend(also.map(|a| a(g)));
            }
        }
        self.read_ahead(keys, prefixes).await
    }

    /// Read the keys `keys` and every key under each of `prefixes` in one transaction at
    /// the snapshot (those read already skipped), for later reads to take.
    async fn read_ahead(&mut self, mut keys: Vec<String>, mut prefixes: Vec<String>) -> Result<()> {
        keys.sort_unstable();
        keys.dedup();
        keys.retain(|k| !self.seen.contains_key(k.as_bytes()) && !self.ahead.contains_key(k));
        prefixes.retain(|p| !self.ahead_under.contains_key(p));
        if keys.is_empty() && prefixes.is_empty() {
            return Ok(());
        }
        let ops: Vec<TxnOp> = keys
            .iter()
            .map(|k| TxnOp::get(k.clone(), Some(self.opts())))
            .chain(prefixes.iter().map(|p| TxnOp::get(p.clone(), Some(self.opts().with_prefix()))))
            .collect();
        self.m.count_request();
        let r = self.kv.txn(Txn::new().and_then(ops)).await;
        let r = r.map_err(|e| self.err(e))?;
        self.pin(r.header());
        let mut got = r.op_responses().into_iter().map(|x| match x {
            TxnOpResponse::Get(g) => g.kvs().to_vec(),
            _ => Vec::new(),
        });
        for k in keys {
            self.ahead.insert(k, got.next().unwrap_or_default().into_iter().next());
        }
        for p in prefixes {
            self.ahead_under.insert(p, got.next().unwrap_or_default());
        }
        Ok(())
    }

    /// Every key under `prefix` at the snapshot: read ahead, or read now.
    async fn range_ahead(&mut self, prefix: &str) -> Result<Vec<KeyValue>> {
        match self.ahead_under.remove(prefix) {
            Some(kvs) => Ok(kvs),
            None => self.range(prefix, None, false).await,
        }
    }

    /// Read `key`, remembering it for the compares.
    async fn get(&mut self, key: String) -> Result<Option<KeyValue>> {
        if let Some(kv) = self.ahead.remove(&key) {
            self.seen.insert(key.into_bytes(), kv.as_ref().map_or(0, |k| k.mod_revision()));
            return Ok(kv);
        }
        let opts = self.opts();
        self.m.count_request();
        let r = self.kv.get(key.clone(), Some(opts)).await;
        let mut r = r.map_err(|e| self.err(e))?;
        self.pin(r.header());
        let kv = r.take_kvs().into_iter().next();
        self.seen.insert(key.into_bytes(), kv.as_ref().map_or(0, |k| k.mod_revision()));
        Ok(kv)
    }

    /// The name `path` (the root is implicit and not read).
    async fn name(&mut self, path: &str) -> Result<Option<Name>> {
        if path.is_empty() {
            return Ok(Some(Name { ino: ROOT_INO, kind: Kind::Dir }));
        }
        match self.get(self.m.name_key(path)).await? {
            Some(kv) => {
                let n = decode_name(path, kv.value())?;
                self.m.hint(path, Some(n.ino));
                Ok(Some(n))
            }
            None => {
                self.m.hint(path, None);
                Ok(None)
            }
        }
    }

    /// Inode `ino`'s record.
    async fn record(&mut self, ino: u64) -> Result<Option<StoredNode>> {
        match self.get(self.m.rec_key(ino)).await? {
            Some(kv) => StoredNode::decode(kv.value()).map(Some).map_err(|e| Error::io(&self.path, e)),
            None => Ok(None),
        }
    }

    /// Remember the records of `inos` (their `mod_revision`s at the snapshot) for the
    /// compares, without decoding them.
    async fn track_records(&mut self, inos: &[u64]) -> Result<()> {
        for batch in inos.chunks(READ_BATCH) {
            let keys: Vec<String> = batch.iter().map(|&i| self.m.rec_key(i)).collect();
            let ops: Vec<TxnOp> =
                keys.iter().map(|k| TxnOp::get(k.clone(), Some(self.opts().with_keys_only()))).collect();
            self.m.count_request();
            let r = self.kv.txn(Txn::new().and_then(ops)).await;
            let r = r.map_err(|e| self.err(e))?;
            self.pin(r.header());
            for (k, resp) in keys.into_iter().zip(r.op_responses()) {
                if let TxnOpResponse::Get(g) = resp {
                    self.seen.insert(k.into_bytes(), g.kvs().first().map_or(0, |x| x.mod_revision()));
                }
            }
        }
        Ok(())
    }

    /// Every key starting with `prefix` (at most `limit`), in key order, at the snapshot;
    /// not remembered for the compares (a directory's record stands for its entries).
    async fn range(&mut self, prefix: &str, limit: Option<usize>, keys_only: bool) -> Result<Vec<KeyValue>> {
        let end = prefix_end(prefix.as_bytes());
        let mut start = prefix.as_bytes().to_vec();
        let mut out: Vec<KeyValue> = Vec::new();
        loop {
            let want = limit.map_or(PAGE, |l| ((l - out.len()) as i64).min(PAGE));
            let mut o = self.opts().with_range(end.clone()).with_limit(want);
            if keys_only {
                o = o.with_keys_only();
            }
            self.m.count_request();
            let r = self.kv.get(start.clone(), Some(o)).await;
            let mut r = r.map_err(|e| self.err(e))?;
            self.pin(r.header());
            let more = r.more();
            let kvs = r.take_kvs();
            if let Some(last) = kvs.last() {
                start = last.key().to_vec();
                start.push(0);
            }
            let empty = kvs.is_empty();
            out.extend(kvs);
            if !more || empty || limit.is_some_and(|l| out.len() >= l) {
                return Ok(out);
            }
        }
    }

    /// How many keys start with `prefix`, at the snapshot.
    async fn count(&mut self, prefix: &str) -> Result<usize> {
        let o = self.opts().with_range(prefix_end(prefix.as_bytes())).with_count_only();
        self.m.count_request();
        let r = self.kv.get(prefix, Some(o)).await;
        let r = r.map_err(|e| self.err(e))?;
        self.pin(r.header());
        Ok(r.count().max(0) as usize)
    }

    /// Whether directory `path` has an entry.
    async fn has_children(&mut self, path: &str) -> Result<bool> {
        let p = self.m.children_prefix(path);
        Ok(!self.range(&p, Some(1), true).await?.is_empty())
    }

    /// Every name under directory `path`: (the rest of its path after `path`, with its
    /// leading '/'; its value).
    async fn subtree(&mut self, path: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let base = self.m.name_key(path);
        let p = self.m.children_prefix(path);
        let kvs = self.range(&p, None, false).await?;
        let mut out = Vec::with_capacity(kvs.len());
        for kv in kvs {
            let (k, v) = kv.into_key_value();
            let k = String::from_utf8(k).map_err(|_| {
                Error::io(path, io::Error::new(io::ErrorKind::InvalidData, "etcd name key is not UTF-8"))
            })?;
            out.push((k[base.len()..].to_string(), v));
        }
        Ok(out)
    }

    /// The entries of directory `dir` by its index (`e/{dir}/`), at the snapshot.
    async fn entries(&mut self, dir: u64) -> Result<Vec<DirEntry>> {
        let p = self.m.entry_key(dir, "");
        let mut out = Vec::new();
        for kv in self.range(&p, None, false).await? {
            let key = kv.key_str().map_err(|e| self.err(e))?;
            let name = key[p.len()..].to_string();
            let n = decode_name(&name, kv.value())?;
            out.push(DirEntry { name, kind: n.kind, ino: n.ino });
        }
        Ok(out)
    }

    /// The entries of directory `path` (its direct children), from the names under it.
    async fn children(&mut self, path: &str) -> Result<Vec<DirEntry>> {
        let mut out = Vec::new();
        for (rest, v) in self.subtree(path).await? {
            let name = rest.strip_prefix('/').unwrap_or(&rest);
            if name.contains('/') {
                continue;
            }
            let n = decode_name(path, &v)?;
            out.push(DirEntry { name: name.to_string(), kind: n.kind, ino: n.ino });
        }
        Ok(out)
    }

    fn compares(&self) -> Vec<Compare> {
        self.seen
            .iter()
            .map(|(k, &r)| {
                if r == 0 {
                    Compare::create_revision(k.clone(), CompareOp::Equal, 0)
                } else {
                    Compare::mod_revision(k.clone(), CompareOp::Equal, r)
                }
            })
            .collect()
    }

    /// Commit `ops` if nothing read has changed; false: retry.
    async fn commit(&mut self, ops: Vec<TxnOp>) -> Result<bool> {
        let txn = Txn::new().when(self.compares()).and_then(ops);
        self.m.count_request();
        let r = self.kv.txn(txn).await;
        Ok(r.map_err(|e| self.err(e))?.succeeded())
    }
}

fn owner() -> (u32, u32) {
    // SAFETY: geteuid and getegid take no arguments and always succeed.
    unsafe { (libc::geteuid(), libc::getegid()) }
}

impl EtcdMeta {
    /// Connect to `endpoints` (comma-separated URLs in one string, e.g.
    /// "http://127.0.0.1:2379") on runtime `rt`; make the root record if absent.
    pub(crate) fn open(rt: Handle, endpoints: &str, prefix: String, dev: u64) -> Result<EtcdMeta> {
        if !prefix.ends_with('/') {
            return Err(Error::Invalid(format!("etcd key prefix {prefix:?} must end with '/'")));
        }
        let eps: Vec<&str> = endpoints.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        if eps.is_empty() {
            return Err(Error::Invalid(format!("etcd endpoints {endpoints:?}: none given")));
        }
        let what = format!("etcd {endpoints}");
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(10))
            .with_timeout(Duration::from_secs(30))
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(10));
        let client =
            rt.block_on(Client::connect(eps, Some(opts))).map_err(|e| Error::io(&what, io::Error::other(e)))?;
        let m = EtcdMeta {
            client,
            rt,
            prefix,
            dev,
            inos: parking_lot::Mutex::new(0..0),
            hints: parking_lot::Mutex::new(HashMap::new()),
            requests: AtomicU64::new(0),
        };
        let now = SystemTime::now();
        let (uid, gid) = owner();
        let root = StoredNode {
            kind: Kind::Dir,
            ino: ROOT_INO,
            mode: 0o755,
            uid,
            gid,
            rdev: 0,
            mtime: now,
            atime: now,
            ctime: now,
            target: None,
            size: 0,
            chunks: BTreeMap::new(),
        };
        let key = m.rec_key(ROOT_INO);
        let txn = Txn::new().when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)]).and_then([TxnOp::put(
            key,
            root.encode(),
            None,
        )]);
        let mut kv = m.kv();
        m.rt.block_on(kv.txn(txn)).map_err(|e| Error::io(&what, io::Error::other(e)))?;
        Ok(m)
    }

    /// The client (a clone), for the token service.
    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }

    fn kv(&self) -> KvClient {
        self.client.kv_client().max_decoding_message_size(64 << 20)
    }

    fn snap(&self, path: &str) -> Snap<'_> {
        Snap {
            m: self,
            kv: self.kv(),
            path: path.to_string(),
            rev: 0,
            seen: BTreeMap::new(),
            ahead: HashMap::new(),
            ahead_under: HashMap::new(),
        }
    }

    /// The removal of `path` from its parent directory: the rewrite of the parent's record
    /// (times now; `subdirs` more subdirectories), read in `s` (so compared at the commit) —
    /// every change of a directory's entries carries it — and the deletion of its entry
    /// from the parent's index.
    async fn unlink_from_parent(&self, s: &mut Snap<'_>, path: &str, subdirs: i64) -> Result<Vec<TxnOp>> {
        let pp = parent(path);
        let p = s.name(pp).await?.ok_or_else(|| Error::NotFound(pp.into()))?;
        let prec = s.record(p.ino).await?.ok_or_else(|| Error::NotFound(pp.into()))?;
        let mut ops = Vec::with_capacity(2);
        if indexed(&prec) {
            ops.push(TxnOp::delete(self.entry_key(p.ino, base(path)), None));
        }
        ops.push(TxnOp::put(self.rec_key(p.ino), touched(prec, subdirs).encode(), None));
        Ok(ops)
    }

    fn name_key(&self, path: &str) -> String {
        format!("{}n/{path}", self.prefix)
    }

    /// The prefix of the names of directory `path`'s entries (and everything below).
    fn children_prefix(&self, path: &str) -> String {
        if path.is_empty() { format!("{}n/", self.prefix) } else { format!("{}n/{path}/", self.prefix) }
    }

    fn rec_key(&self, ino: u64) -> String {
        format!("{}i/{ino:016x}", self.prefix)
    }

    /// The key of `name`'s entry in the index of directory `dir`.
    fn entry_key(&self, dir: u64, name: &str) -> String {
        format!("{}e/{dir:016x}/{name}", self.prefix)
    }

    fn next_key(&self) -> String {
        format!("{}next_ino", self.prefix)
    }

    fn etcd_err(path: &str, e: etcd_client::Error) -> Error {
        Error::io(path, io::Error::other(e))
    }

    /// Take an inode number: the next of this machine's batch, or the first of a new batch
    /// of `INO_BATCH` taken from `next_ino` by a compare-and-swap.
    async fn alloc_ino(&self, path: &str) -> Result<u64> {
        if let Some(ino) = self.inos.lock().next() {
            return Ok(ino);
        }
        let first = self.take_batch(path).await?;
        let mut inos = self.inos.lock();
        if inos.is_empty() {
            *inos = first + 1..first + INO_BATCH;
        }
        // (Else another create of this machine took a batch meanwhile: the rest of this
        // one is never given — numbers are plentiful.)
        Ok(first)
    }

    /// Take `INO_BATCH` inode numbers from `next_ino` (compare-and-swap); returns the first.
    async fn take_batch(&self, path: &str) -> Result<u64> {
        let key = self.next_key();
        let mut kv = self.kv();
        for _ in attempts() {
            let r = kv.get(key.clone(), None).await.map_err(|e| Self::etcd_err(path, e))?;
            let (cur, cmp) = match r.kvs().first() {
                Some(x) => {
                    let v: [u8; 8] = x.value().try_into().map_err(|_| {
                        Error::io(path, io::Error::new(io::ErrorKind::InvalidData, "etcd next_ino: not 8 bytes"))
                    })?;
                    (u64::from_le_bytes(v), Compare::mod_revision(key.clone(), CompareOp::Equal, x.mod_revision()))
                }
                None => (2, Compare::create_revision(key.clone(), CompareOp::Equal, 0)),
            };
            let txn = Txn::new().when([cmp]).and_then([TxnOp::put(key.clone(), (cur + INO_BATCH).to_le_bytes(), None)]);
            if kv.txn(txn).await.map_err(|e| Self::etcd_err(path, e))?.succeeded() {
                return Ok(cur);
            }
        }
        Err(contended(path))
    }

    /// The inode and kind `path` names.
    #[cfg(test)]
    pub(crate) fn lookup(&self, path: &str) -> Result<(u64, Kind)> {
        self.rt.block_on(async {
            let mut s = self.snap(path);
            s.name(path).await?.map(|n| (n.ino, n.kind)).ok_or_else(|| Error::NotFound(path.into()))
        })
    }

    /// Inode `ino`'s record and its `mod_revision`.
    pub(crate) fn record(&self, ino: u64) -> Result<Option<(StoredNode, i64)>> {
        let what = format!("inode {ino}");
        self.rt.block_on(async {
            self.count_request();
            let r = self.kv().get(self.rec_key(ino), None).await.map_err(|e| Self::etcd_err(&what, e))?;
            match r.kvs().first() {
                Some(x) => {
                    Ok(Some((StoredNode::decode(x.value()).map_err(|e| Error::io(&what, e))?, x.mod_revision())))
                }
                None => Ok(None),
            }
        })
    }

    #[cfg(test)]
    pub(crate) fn getattr(&self, path: &str) -> Result<Attr> {
        self.entry(path, None).map(|e| e.attr)
    }

    /// `path`'s attributes, its record and the keys under `also(ino)` (a file's tokens,
    /// for the caller to tell whether the record's size is current), at one revision; one
    /// round trip for a name read here before and not changed since (a directory also
    /// counts its entries for its `nlink`).
    pub(crate) fn entry(&self, path: &str, also: Option<&dyn Fn(u64) -> String>) -> Result<Entry> {
        self.rt.block_on(async {
            let mut s = self.snap(path);
            s.prefetch(&[path], also).await?;
            let n = s.name(path).await?.ok_or_else(|| Error::NotFound(path.into()))?;
            // The guess was wrong or missing: the record (and the keys under `also`) now.
            let under = also.map(|a| a(n.ino));
            s.read_ahead(vec![self.rec_key(n.ino)], under.iter().cloned().collect()).await?;
            let x = s.record(n.ino).await?.ok_or_else(|| Error::NotFound(path.into()))?;
            let also = match &under {
                Some(p) => s.range_ahead(p).await?,
                None => Vec::new(),
            };
            let nlink = match x.kind {
                Kind::Dir if x.size != SUBDIRS_UNKNOWN => 2 + x.size as u32,
                // A directory of a record before UBCS3N03: its entries are counted.
                Kind::Dir => 2 + s.children(path).await?.iter().filter(|e| e.kind == Kind::Dir).count() as u32,
                _ => 1,
            };
            Ok(Entry { attr: self.attr_of(&x, nlink), node: x, also })
        })
    }

    /// Remember that `path` names `ino` (`None`: nothing), as last read.
    fn hint(&self, path: &str, ino: Option<u64>) {
        if path.is_empty() {
            return;
        }
        let mut hints = self.hints.lock();
        match ino {
            Some(ino) if hints.get(path) != Some(&ino) => {
                if hints.len() >= HINTS {
                    hints.clear();
                }
                hints.insert(path.to_string(), ino);
            }
            Some(_) => {}
            None => drop(hints.remove(path)),
        }
    }

    fn attr_of(&self, x: &StoredNode, nlink: u32) -> Attr {
        Attr {
            kind: x.kind,
            ino: x.ino,
            mode: x.mode,
            size: if x.kind == Kind::Dir { 0 } else { x.size },
            mtime: x.mtime,
            atime: x.atime,
            ctime: x.ctime,
            uid: x.uid,
            gid: x.gid,
            nlink,
            blocks: if x.kind == Kind::Dir { 0 } else { x.size.div_ceil(512) },
            rdev: x.rdev,
            dev: self.dev,
        }
    }

    /// Requests sent to etcd so far by the namespace.
    pub(crate) fn requests(&self) -> u64 {
        self.requests.load(Relaxed)
    }

    fn count_request(&self) {
        self.requests.fetch_add(1, Relaxed);
    }

    /// Change mode (`& 0o7777`), owner, mtime, atime; ctime = now. Not the size (the
    /// caller changes it through the open file): `set.size` is ignored.
    pub(crate) fn setattr(&self, path: &str, set: &SetAttr) -> Result<()> {
        self.rt.block_on(async {
            for _ in attempts() {
                let mut s = self.snap(path);
                s.prefetch(&[path], None).await?;
                let n = s.name(path).await?.ok_or_else(|| Error::NotFound(path.into()))?;
                let mut x = s.record(n.ino).await?.ok_or_else(|| Error::NotFound(path.into()))?;
                set.apply(&mut x.mode, &mut x.uid, &mut x.gid, &mut x.mtime, &mut x.atime);
                x.ctime = SystemTime::now();
                if s.commit(vec![TxnOp::put(self.rec_key(n.ino), x.encode(), None)]).await? {
                    return Ok(());
                }
            }
            Err(contended(path))
        })
    }

    /// The entries of directory `path`: its index, O(entries) — or, for a directory of a
    /// record before `UBCS3N03`, everything under it, O(subtree).
    pub(crate) fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.rt.block_on(async {
            let mut s = self.snap(path);
            s.prefetch(&[path], None).await?;
            let n = match s.name(path).await? {
                Some(n) if n.kind == Kind::Dir => n,
                Some(_) => return Err(Error::NotDir(path.into())),
                None => return Err(Error::NotFound(path.into())),
            };
            match s.record(n.ino).await? {
                Some(rec) if indexed(&rec) => s.entries(n.ino).await,
                _ => s.children(path).await,
            }
        })
    }

    /// Add `path` of `kind` (a symbolic link with `target`, a device with `rdev`); returns
    /// its new inode number. Owned by this process's user and group, times now, size 0.
    pub(crate) fn add(&self, path: &str, kind: Kind, mode: u32, rdev: u64, target: Option<String>) -> Result<u64> {
        self.add_with(path, kind, mode, rdev, target, None)
    }

    /// [`EtcdMeta::add`], with `extra(ino)` — an operation on the new inode's keys (its
    /// creator's token) — in the same transaction.
    pub(crate) fn add_with(
        &self,
        path: &str,
        kind: Kind,
        mode: u32,
        rdev: u64,
        target: Option<String>,
        extra: Option<&dyn Fn(u64) -> TxnOp>,
    ) -> Result<u64> {
        let target = (kind == Kind::Symlink).then(|| target.unwrap_or_default());
        self.rt.block_on(async {
            let mut ino = None;
            for _ in attempts() {
                let mut s = self.snap(path);
                s.prefetch(&[path, parent(path)], None).await?;
                if s.name(path).await?.is_some() {
                    return Err(Error::Exists(path.into()));
                }
                let pp = parent(path);
                let p = match s.name(pp).await? {
                    Some(p) if p.kind == Kind::Dir => p,
                    Some(_) => return Err(Error::NotDir(pp.into())),
                    None => return Err(Error::NotFound(pp.into())),
                };
                let prec = s.record(p.ino).await?.ok_or_else(|| Error::NotFound(pp.into()))?;
                let ino = match ino {
                    Some(x) => x,
                    None => *ino.insert(self.alloc_ino(path).await?),
                };
                let now = SystemTime::now();
                let (uid, gid) = owner();
                let node = StoredNode {
                    kind,
                    ino,
                    mode,
                    uid,
                    gid,
                    rdev,
                    mtime: now,
                    atime: now,
                    ctime: now,
                    target: target.clone(),
                    size: 0,
                    chunks: BTreeMap::new(),
                };
                let mut ops = vec![
                    TxnOp::put(self.name_key(path), encode_name(Name { ino, kind }), None),
                    TxnOp::put(self.rec_key(ino), node.encode(), None),
                ];
                if indexed(&prec) {
                    ops.push(TxnOp::put(self.entry_key(p.ino, base(path)), encode_name(Name { ino, kind }), None));
                }
                ops.push(TxnOp::put(self.rec_key(p.ino), touched(prec, subdir(kind)).encode(), None));
                ops.extend(extra.map(|x| x(ino)));
                if s.commit(ops).await? {
                    return Ok(ino);
                }
            }
            Err(contended(path))
        })
    }

    /// Remove the file, symbolic link or special file `path` (a directory: `IsDir`) with its
    /// record; returns the record (the caller frees the file's data objects).
    pub(crate) fn remove(&self, path: &str) -> Result<StoredNode> {
        self.rt.block_on(async {
            for _ in attempts() {
                let mut s = self.snap(path);
                s.prefetch(&[path, parent(path)], None).await?;
                let n = match s.name(path).await? {
                    Some(n) if n.kind == Kind::Dir => return Err(Error::IsDir(path.into())),
                    Some(n) => n,
                    None => return Err(Error::NotFound(path.into())),
                };
                let rec = s.record(n.ino).await?;
                let mut ops = vec![TxnOp::delete(self.name_key(path), None), TxnOp::delete(self.rec_key(n.ino), None)];
                ops.extend(self.unlink_from_parent(&mut s, path, 0).await?);
                if s.commit(ops).await? {
                    // A name without a record (damage) is removed too; its node is made up.
                    return Ok(rec.unwrap_or_else(|| {
                        let t = SystemTime::UNIX_EPOCH;
                        StoredNode {
                            kind: n.kind,
                            ino: n.ino,
                            mode: 0,
                            uid: 0,
                            gid: 0,
                            rdev: 0,
                            mtime: t,
                            atime: t,
                            ctime: t,
                            target: None,
                            size: 0,
                            chunks: BTreeMap::new(),
                        }
                    }));
                }
            }
            Err(contended(path))
        })
    }

    /// Remove the empty directory `path`.
    pub(crate) fn rmdir(&self, path: &str) -> Result<()> {
        self.rt.block_on(async {
            for _ in attempts() {
                let mut s = self.snap(path);
                s.prefetch(&[path, parent(path)], None).await?;
                let n = match s.name(path).await? {
                    Some(n) if n.kind != Kind::Dir => return Err(Error::NotDir(path.into())),
                    None => return Err(Error::NotFound(path.into())),
                    _ if path.is_empty() => return Err(Error::Invalid("cannot remove the root".into())),
                    Some(n) => n,
                };
                // Compared: a child added or removed since rewrites it.
                s.record(n.ino).await?;
                if s.has_children(path).await? {
                    return Err(Error::NotEmpty(path.into()));
                }
                let mut ops = vec![TxnOp::delete(self.name_key(path), None), TxnOp::delete(self.rec_key(n.ino), None)];
                ops.extend(self.unlink_from_parent(&mut s, path, -1).await?);
                if s.commit(ops).await? {
                    return Ok(());
                }
            }
            Err(contended(path))
        })
    }

    /// Move `from` (and everything under it) to `to`, as `rename(2)`/`renameat2(2)` with
    /// `how`; returns the record `to` named before if it was replaced (the caller frees its
    /// data). One transaction (module documentation for its limits).
    pub(crate) fn rename(&self, from: &str, to: &str, how: Rename) -> Result<Option<StoredNode>> {
        self.rt.block_on(async {
            for _ in attempts() {
                if let Some(done) = self.rename_attempt(from, to, how).await? {
                    return Ok(done);
                }
            }
            Err(contended(from))
        })
    }

    /// One attempt of [`EtcdMeta::rename`]: `None` if a compare failed.
    async fn rename_attempt(&self, from: &str, to: &str, how: Rename) -> Result<Option<Option<StoredNode>>> {
        let mut s = self.snap(from);
        s.prefetch(&[from, to, parent(from), parent(to)], None).await?;
        let tn = s.name(to).await?;
        if how == Rename::NoReplace && tn.is_some() {
            return Err(Error::Exists(to.into()));
        }
        let f = s.name(from).await?.ok_or_else(|| Error::NotFound(from.into()))?;
        if is_under(to, from) {
            return Err(Error::Invalid(format!("cannot move {from} into itself")));
        }
        if (from.is_empty() || to.is_empty()) && from != to {
            return Err(Error::Invalid("cannot rename the root".into()));
        }
        let tp = parent(to);
        let tpn = match s.name(tp).await? {
            Some(p) if p.kind == Kind::Dir => p,
            Some(_) => return Err(Error::NotDir(tp.into())),
            None => return Err(Error::NotFound(tp.into())),
        };
        if from == to {
            return Ok(Some(None));
        }
        let exchange = how == Rename::Exchange;
        let mut replaced = None;
        match tn {
            None if exchange => return Err(Error::NotFound(to.into())),
            Some(_) if exchange && is_under(from, to) => {
                return Err(Error::Invalid(format!("cannot move {to} into itself")));
            }
            Some(t) if !exchange => {
                if f.kind == Kind::Dir && t.kind != Kind::Dir {
                    return Err(Error::NotDir(to.into()));
                }
                if f.kind != Kind::Dir && t.kind == Kind::Dir {
                    return Err(Error::IsDir(to.into()));
                }
                // Read (and so compared) before the emptiness check: an entry added
                // since rewrites it.
                replaced = s.record(t.ino).await?;
                if t.kind == Kind::Dir && s.has_children(to).await? {
                    return Err(Error::NotEmpty(to.into()));
                }
            }
            _ => {}
        }
        let fp = parent(from);
        let fpn = s.name(fp).await?.ok_or_else(|| Error::NotFound(fp.into()))?;
        let fprec = s.record(fpn.ino).await?.ok_or_else(|| Error::NotFound(fp.into()))?;
        let tprec = match tpn.ino == fpn.ino {
            true => None,
            false => Some(s.record(tpn.ino).await?.ok_or_else(|| Error::NotFound(tp.into()))?),
        };

        // The names to write (path → value) and, for an exchange, the old names to delete.
        let mut puts: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        let mut old: BTreeSet<String> = BTreeSet::new();
        let mut dirs: Vec<u64> = Vec::new();
        let mut sides = vec![(from, f, to)];
        if exchange {
            sides.push((to, tn.expect("checked"), from));
        }
        let mut under = 0;
        for &(src, n, _) in &sides {
            if n.kind == Kind::Dir {
                under += s.count(&self.children_prefix(src)).await?;
            }
        }
        let too_many = || {
            Error::NotSupported(format!(
                "{from}: a rename moving {under} names under it in one etcd transaction (at most {MAX_MOVE})"
            ))
        };
        if under > MAX_MOVE {
            return Err(too_many());
        }
        for &(src, n, dst) in &sides {
            puts.insert(dst.to_string(), encode_name(n));
            old.insert(src.to_string());
            if n.kind != Kind::Dir {
                continue;
            }
            dirs.push(n.ino);
            for (rest, v) in s.subtree(src).await? {
                let x = decode_name(src, &v)?;
                if x.kind == Kind::Dir {
                    dirs.push(x.ino);
                }
                old.insert(format!("{src}{rest}"));
                puts.insert(format!("{dst}{rest}"), v);
            }
        }
        // The moved directories' records: an entry added or removed below since the
        // snapshot rewrote one of them.
        s.track_records(&dirs).await?;

        let mut ops: Vec<TxnOp> = Vec::new();
        let mut bytes = 0;
        for (p, v) in &puts {
            let k = self.name_key(p);
            bytes += k.len() + v.len() + 16;
            ops.push(TxnOp::put(k, v.clone(), None));
        }
        if exchange {
            for p in old.iter().filter(|p| !puts.contains_key(*p)) {
                let k = self.name_key(p);
                bytes += k.len() + 16;
                ops.push(TxnOp::delete(k, None));
            }
        } else {
            ops.push(TxnOp::delete(self.name_key(from), None));
            if f.kind == Kind::Dir {
                let p = self.children_prefix(from);
                ops.push(TxnOp::delete(p.clone(), Some(DeleteOptions::new().with_range(prefix_end(p.as_bytes())))));
            }
        }
        if ops.len() > MAX_MOVE + 4 {
            return Err(too_many());
        }
        if let Some(r) = &replaced {
            ops.push(TxnOp::delete(self.rec_key(r.ino), None));
        }
        // Subdirectories each parent loses and gains: `from`'s leaves its parent and
        // lands in `to`'s, whose old entry — replaced, or sent back the other way by an
        // exchange — leaves it.
        // The parents' indexes: `from`'s entry goes (or becomes `to`'s old one, exchanged),
        // `to`'s becomes `from`'s.
        let (fp_indexed, tp_indexed) = (indexed(&fprec), tprec.as_ref().map_or(indexed(&fprec), indexed));
        if fp_indexed {
            let k = self.entry_key(fpn.ino, base(from));
            ops.push(match tn {
                Some(t) if exchange => TxnOp::put(k, encode_name(t), None),
                _ => TxnOp::delete(k, None),
            });
        }
        if tp_indexed {
            ops.push(TxnOp::put(self.entry_key(tpn.ino, base(to)), encode_name(f), None));
        }
        let t_dirs = tn.map_or(0, |t| subdir(t.kind));
        let (from_side, to_side) = (subdir(f.kind), t_dirs);
        let fp_delta = -from_side + if exchange { to_side } else { 0 };
        let tp_delta = from_side - to_side;
        match tprec {
            Some(r) => {
                ops.push(TxnOp::put(self.rec_key(fpn.ino), touched(fprec, fp_delta).encode(), None));
                ops.push(TxnOp::put(self.rec_key(tpn.ino), touched(r, tp_delta).encode(), None));
            }
            None => ops.push(TxnOp::put(self.rec_key(fpn.ino), touched(fprec, fp_delta + tp_delta).encode(), None)),
        }
        bytes += s.seen.keys().map(|k| k.len() + 16).sum::<usize>();
        if bytes > MAX_TXN_BYTES {
            return Err(Error::NotSupported(format!(
                "{from}: a rename whose etcd transaction would be {bytes} bytes (at most {MAX_TXN_BYTES})"
            )));
        }
        Ok(s.commit(ops).await?.then_some(replaced))
    }

    /// The target of symbolic link `path`.
    pub(crate) fn readlink(&self, path: &str) -> Result<String> {
        self.rt.block_on(async {
            let mut s = self.snap(path);
            s.prefetch(&[path], None).await?;
            let n = s.name(path).await?.ok_or_else(|| Error::NotFound(path.into()))?;
            let x = s.record(n.ino).await?.ok_or_else(|| Error::NotFound(path.into()))?;
            x.target.ok_or_else(|| Error::Invalid(format!("{path}: not a symbolic link")))
        })
    }

    /// Read-modify-write `ino`'s record with compare-and-swap, retried on conflict; `f` may
    /// be called several times. `NotFound` if the record is gone. (A file's own commit
    /// rewrites its record fenced by its write token: `shared.rs`.)
    #[cfg(test)]
    pub(crate) fn update_record(&self, ino: u64, f: impl FnMut(&mut StoredNode)) -> Result<()> {
        self.update(ino, &format!("inode {ino}"), f)
    }

    #[cfg(test)]
    fn update(&self, ino: u64, path: &str, mut f: impl FnMut(&mut StoredNode)) -> Result<()> {
        self.rt.block_on(async {
            for _ in attempts() {
                let mut s = self.snap(path);
                let mut x = s.record(ino).await?.ok_or_else(|| Error::NotFound(path.into()))?;
                f(&mut x);
                if s.commit(vec![TxnOp::put(self.rec_key(ino), x.encode(), None)]).await? {
                    return Ok(());
                }
            }
            Err(contended(path))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::tree::Tree;
    use rand::{RngExt, SeedableRng, rngs::StdRng};
    use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
    use std::sync::{Arc, Mutex};
    use ubc::pager::ShmPager;

    /// A real etcd (`UBC_TEST_ETCD`) and a prefix of this test's own, deleted at the end.
    struct Env {
        rt: tokio::runtime::Runtime,
        url: String,
        prefix: String,
    }

    fn env(name: &str) -> Option<Env> {
        let url = match std::env::var("UBC_TEST_ETCD") {
            Ok(u) if !u.is_empty() => u,
            _ => {
                assert!(
                    std::env::var("UBC_TEST_ETCD_REQUIRED").as_deref() != Ok("1"),
                    "UBC_TEST_ETCD is unset but UBC_TEST_ETCD_REQUIRED=1"
                );
                eprintln!("skipping {name}: set UBC_TEST_ETCD=http://HOST:PORT to run it against a real etcd");
                return None;
            }
        };
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let prefix = format!("/ubc-test/{name}-{:016x}/", getrandom::u64().unwrap());
        Some(Env { rt, url, prefix })
    }

    impl Env {
        /// One "machine": a client of its own.
        fn open(&self) -> EtcdMeta {
            EtcdMeta::open(self.rt.handle().clone(), &self.url, self.prefix.clone(), 7).unwrap()
        }
    }

    impl Drop for Env {
        fn drop(&mut self) {
            let url = self.url.clone();
            let prefix = self.prefix.clone();
            let _ = self.rt.block_on(async move {
                let mut c = Client::connect([url], None).await?;
                c.delete(prefix, Some(DeleteOptions::new().with_prefix())).await
            });
        }
    }

    fn mem_file(_: u64) -> Arc<ShmPager> {
        Arc::new(ShmPager::new())
    }

    fn under(p: &str, dir: &str) -> bool {
        p == dir || is_under(p, dir)
    }

    /// The rename the etcd namespace must match: the tree's, with rename(2)'s checks the
    /// tree leaves out (kinds of the two names, the parent of `to` not a directory, a
    /// rename onto itself) and an exchange.
    fn tree_rename(t: &Tree<ShmPager>, from: &str, to: &str, how: Rename) -> Result<Option<u64>> {
        let (kf, kt) = {
            let n = t.nodes.lock();
            (n.get(from).map(|x| x.kind), n.get(to).map(|x| x.kind))
        };
        if how == Rename::NoReplace && kt.is_some() {
            return Err(Error::Exists(to.into()));
        }
        let Some(kf) = kf else { return Err(Error::NotFound(from.into())) };
        if is_under(to, from) {
            return Err(Error::Invalid(format!("cannot move {from} into itself")));
        }
        let tp = parent(to);
        match t.nodes.lock().get(tp).map(|x| x.kind) {
            Some(Kind::Dir) => {}
            Some(_) => return Err(Error::NotDir(tp.into())),
            None => return Err(Error::NotFound(tp.into())),
        }
        if from == to {
            return Ok(None);
        }
        if how == Rename::Exchange {
            if kt.is_none() {
                return Err(Error::NotFound(to.into()));
            }
            if is_under(from, to) {
                return Err(Error::Invalid(format!("cannot move {to} into itself")));
            }
            let mut n = t.nodes.lock();
            let keys: Vec<String> = n.keys().filter(|p| under(p, from) || under(p, to)).cloned().collect();
            let moved: Vec<_> = keys.into_iter().map(|p| (p.clone(), n.remove(&p).unwrap())).collect();
            for (p, node) in moved {
                let np = match under(&p, from) {
                    true => format!("{to}{}", &p[from.len()..]),
                    false => format!("{from}{}", &p[to.len()..]),
                };
                n.insert(np, node);
            }
            return Ok(None);
        }
        if let Some(kt) = kt {
            if kf == Kind::Dir && kt != Kind::Dir {
                return Err(Error::NotDir(to.into()));
            }
            if kf != Kind::Dir && kt == Kind::Dir {
                return Err(Error::IsDir(to.into()));
            }
        }
        t.rename(from, to).map(|r| r.map(|x| x.ino))
    }

    fn show<T: std::fmt::Debug>(r: Result<T>) -> String {
        match r {
            Ok(x) => format!("Ok({x:?})"),
            Err(e) => format!("Err({e:?})"),
        }
    }

    /// Every name under `prefix` in etcd with its value, and every record's inode.
    fn dump(env: &Env, m: &EtcdMeta) -> (BTreeMap<String, Name>, BTreeSet<u64>) {
        env.rt.block_on(async {
            let mut s = m.snap("");
            let names = s
                .subtree("")
                .await
                .unwrap()
                .into_iter()
                .map(|(p, v)| (p.clone(), decode_name(&p, &v).unwrap()))
                .collect();
            let rp = format!("{}i/", m.prefix);
            let recs = s
                .range(&rp, None, true)
                .await
                .unwrap()
                .iter()
                .map(|kv| u64::from_str_radix(&kv.key_str().unwrap()[rp.len()..], 16).unwrap())
                .collect();
            (names, recs)
        })
    }

    /// The namespace is whole: every name's parent is a directory, every name has its
    /// record and every record (but the root's) its one name.
    fn check_whole(env: &Env, m: &EtcdMeta) -> BTreeMap<String, Name> {
        let (names, recs) = dump(env, m);
        for (p, n) in &names {
            let pp = parent(p);
            assert!(pp.is_empty() || names.get(pp).is_some_and(|x| x.kind == Kind::Dir), "{p}: parent {pp} gone");
            let (rec, _) = m.record(n.ino).unwrap().unwrap_or_else(|| panic!("{p}: no record of inode {}", n.ino));
            assert_eq!((rec.ino, rec.kind), (n.ino, n.kind), "{p}");
        }
        let mut named: BTreeSet<u64> = names.values().map(|n| n.ino).collect();
        assert_eq!(named.len(), names.len(), "an inode with two names");
        named.insert(ROOT_INO);
        assert_eq!(named, recs, "records without names or names without records");
        // Each indexed directory's index holds exactly its entries.
        let ino_of = |p: &str| if p.is_empty() { ROOT_INO } else { names[p].ino };
        let want: BTreeMap<(u64, String), Name> = names
            .iter()
            .filter(|(p, _)| indexed(&m.record(ino_of(parent(p))).unwrap().unwrap().0))
            .map(|(p, n)| ((ino_of(parent(p)), base(p).to_string()), *n))
            .collect();
        let ep = format!("{}e/", m.prefix);
        let got: BTreeMap<(u64, String), Name> = env
            .rt
            .block_on(async {
                let mut s = m.snap("");
                s.range(&ep, None, false).await.unwrap()
            })
            .iter()
            .map(|kv| {
                let k = &kv.key_str().unwrap()[ep.len()..];
                let (dir, name) = k.split_once('/').unwrap();
                ((u64::from_str_radix(dir, 16).unwrap(), name.to_string()), decode_name(k, kv.value()).unwrap())
            })
            .collect();
        let got: BTreeMap<(u64, String), Name> =
            got.into_iter().filter(|((dir, _), _)| m.record(*dir).unwrap().is_none_or(|(r, _)| indexed(&r))).collect();
        assert_eq!(got, want, "the directories' indexes");
        names
    }

    fn same_namespace(env: &Env, t: &Tree<ShmPager>, m: &EtcdMeta) {
        let names = check_whole(env, m);
        let tree: BTreeMap<String, (u64, Kind)> =
            t.nodes.lock().iter().filter(|(p, _)| !p.is_empty()).map(|(p, x)| (p.clone(), (x.ino, x.kind))).collect();
        let etcd: BTreeMap<String, (u64, Kind)> = names.iter().map(|(p, n)| (p.clone(), (n.ino, n.kind))).collect();
        assert_eq!(tree, etcd);
        let dirs =
            std::iter::once(String::new()).chain(tree.iter().filter(|x| x.1.1 == Kind::Dir).map(|x| x.0.clone()));
        for d in dirs {
            assert_eq!(show(t.readdir(&d)), show(m.readdir(&d)), "readdir {d}");
            let (a, b) = (t.getattr(&d).unwrap(), m.getattr(&d).unwrap());
            assert_eq!((a.ino, a.kind, a.mode, a.nlink), (b.ino, b.kind, b.mode, b.nlink), "getattr {d}");
        }
    }

    #[test]
    fn random_ops_match_the_tree() {
        let Some(env) = env("random") else { return };
        let m = env.open();
        let t: Tree<ShmPager> = Tree::empty(7);
        let seed: u64 = std::env::var("UBC_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed);
        eprintln!("seed {seed}");
        let mut rng = StdRng::seed_from_u64(seed);
        let names = ["a", "b", "c", "d"];
        // Mostly a name in a directory that exists, so that the tree grows and shrinks.
        let path = |rng: &mut StdRng, t: &Tree<ShmPager>| {
            let name = names[rng.random_range(0..names.len())];
            if rng.random_bool(0.8) {
                let dirs: Vec<String> =
                    t.nodes.lock().iter().filter(|x| x.1.kind == Kind::Dir).map(|x| x.0.clone()).collect();
                let d = &dirs[rng.random_range(0..dirs.len())];
                return if d.is_empty() { name.to_string() } else { format!("{d}/{name}") };
            }
            let depth = rng.random_range(1..=3);
            (0..depth).map(|_| names[rng.random_range(0..names.len())]).collect::<Vec<_>>().join("/")
        };
        let mut counts = BTreeMap::<&str, (u32, u32)>::new();
        for step in 0..600 {
            let op = rng.random_range(0..14);
            let (mut p, mut q) = (path(&mut rng, &t), path(&mut rng, &t));
            // Removes, renames and attribute changes mostly of names that exist.
            if matches!(op, 6..=11 | 13) && rng.random_bool(0.7) {
                let all: Vec<String> = t.nodes.lock().keys().filter(|k| !k.is_empty()).cloned().collect();
                // rmdir: mostly of an empty directory
                let empty: Vec<&String> = all
                    .iter()
                    .filter(|d| t.nodes.lock()[*d].kind == Kind::Dir && !all.iter().any(|x| parent(x) == d.as_str()))
                    .collect();
                if op == 7 && !empty.is_empty() {
                    p = empty[rng.random_range(0..empty.len())].clone();
                } else if !all.is_empty() {
                    p = all[rng.random_range(0..all.len())].clone();
                }
            }
            let (what, a, b) = match op {
                0 | 1 => (
                    "create",
                    show(t.add(&p, Kind::File, 0o644, mem_file)),
                    show(m.add(&p, Kind::File, 0o644, 0, None)),
                ),
                2 | 3 => {
                    ("mkdir", show(t.add(&p, Kind::Dir, 0o755, mem_file)), show(m.add(&p, Kind::Dir, 0o755, 0, None)))
                }
                4 => {
                    let a = t.symlink(&q, &p).map(|()| t.getattr(&p).unwrap().ino);
                    ("symlink", show(a), show(m.add(&p, Kind::Symlink, 0o777, 0, Some(q.clone()))))
                }
                5 => {
                    let a = t.mknod(&p, Kind::Fifo, 0o600, 0).map(|()| t.getattr(&p).unwrap().ino);
                    ("mknod", show(a), show(m.add(&p, Kind::Fifo, 0o600, 0, None)))
                }
                6 => {
                    ("remove", show(t.remove(&p).map(|x| (x.ino, x.kind))), show(m.remove(&p).map(|x| (x.ino, x.kind))))
                }
                7 => ("rmdir", show(t.rmdir(&p)), show(m.rmdir(&p))),
                8..=10 => {
                    let how = [Rename::Replace, Rename::NoReplace, Rename::Exchange][op - 8];
                    // Sometimes within one directory, sometimes onto itself or into itself.
                    q = match rng.random_range(0..6) {
                        0 => p.clone(),
                        1 => format!("{p}/{}", names[0]),
                        2 => format!("{}{}", parent(&p), if parent(&p).is_empty() { "c" } else { "/c" }),
                        _ => q.clone(),
                    };
                    let a = show(tree_rename(&t, &p, &q, how));
                    let b = show(m.rename(&p, &q, how).map(|r| r.map(|x| x.ino)));
                    (["rename", "rename-noreplace", "rename-exchange"][op - 8], a, b)
                }
                11 => {
                    let set = SetAttr::new().with_mode(rng.random_range(0..0o10000));
                    ("setattr", show(t.setattr(&p, &set)), show(m.setattr(&p, &set)))
                }
                12 => {
                    let norm = |r: Result<Vec<DirEntry>>| {
                        r.map(|v| v.into_iter().map(|e| (e.name, kind_code(e.kind), e.ino)).collect::<BTreeSet<_>>())
                    };
                    let d = if rng.random_bool(0.3) { String::new() } else { p.clone() };
                    ("readdir", show(norm(t.readdir(&d))), show(norm(m.readdir(&d))))
                }
                _ => {
                    let f = |a: Attr| (a.kind, a.ino, a.mode, a.nlink, a.size, a.rdev, a.uid, a.gid, a.dev);
                    let x = ("getattr", show(t.getattr(&p).map(f)), show(m.getattr(&p).map(f)));
                    assert_eq!(show(t.readlink(&p)), show(m.readlink(&p)), "step {step}: readlink {p}");
                    x
                }
            };
            assert_eq!(a, b, "step {step}: {what} {p} {q}");
            let c = counts.entry(what).or_default();
            if a.starts_with("Ok") {
                c.0 += 1
            } else {
                c.1 += 1
            }
            if step % 50 == 49 {
                same_namespace(&env, &t, &m);
            }
        }
        same_namespace(&env, &t, &m);
        eprintln!("(ok, err) per op: {counts:?}");
        for what in ["create", "mkdir", "remove", "rmdir", "rename", "rename-noreplace", "rename-exchange"] {
            assert!(counts.get(what).is_some_and(|c| c.0 > 0), "no successful {what}: {counts:?}");
        }
    }

    /// A directory keeps its subdirectories' count in its record, so a `stat` of it reads
    /// one record, not every name under it; a directory whose record comes from before
    /// the count (`UBCS3N02`) is counted from its entries, and stays right as it changes.
    #[test]
    fn a_directory_s_link_count_is_in_its_record_and_old_records_are_counted() {
        let Some(env) = env("nlink") else { return };
        let m = env.open();
        for d in ["d", "d/a", "d/b", "d/a/x", "d/f"] {
            let kind = if d == "d/f" { Kind::File } else { Kind::Dir };
            m.add(d, kind, 0o755, 0, None).unwrap();
        }
        let nlink = |p: &str| m.getattr(p).unwrap().nlink;
        assert_eq!((nlink(""), nlink("d"), nlink("d/a"), nlink("d/b")), (3, 4, 3, 2));
        let (d, _) = m.lookup("d").unwrap();
        let (rec, _) = m.record(d).unwrap().unwrap();
        assert_eq!(rec.size, 2, "d's record counts its subdirectories");
        assert_eq!(m.getattr("d").unwrap().size, 0, "and its size is still 0");
        // The same record as the second format wrote it: no count.
        let mut old = rec.encode();
        old.truncate(old.len() - 4);
        old[..8].copy_from_slice(b"UBCS3N02");
        old[8 + 1 + 8 + 4 + 4 + 4 + 8 + 24 + 2..][..8].copy_from_slice(&0u64.to_le_bytes());
        let crc = crc32fast::hash(&old);
        old.extend_from_slice(&crc.to_le_bytes());
        env.rt.block_on(m.kv().put(m.rec_key(d), old, None)).unwrap();
        assert_eq!(m.record(d).unwrap().unwrap().0.size, SUBDIRS_UNKNOWN);
        assert_eq!(nlink("d"), 4, "an old record's directory is counted");
        m.add("d/c", Kind::Dir, 0o755, 0, None).unwrap();
        m.rename("d/a", "e", Rename::Replace).unwrap();
        m.rmdir("d/b").unwrap();
        assert_eq!((nlink(""), nlink("d"), nlink("e")), (4, 3, 3));
        m.rename("e", "d/c", Rename::Exchange).unwrap(); // two directories: no count moves
        assert_eq!((nlink(""), nlink("d"), nlink("e"), nlink("d/c")), (4, 3, 2, 3));
        m.rename("d/f", "e", Rename::Exchange).unwrap(); // a file for a directory
        assert_eq!((nlink(""), nlink("d"), nlink("d/f")), (3, 4, 2));
        check_whole(&env, &m);
    }

    #[test]
    fn the_root_and_times() {
        let Some(env) = env("root") else { return };
        let m = env.open();
        let m2 = env.open(); // a second opening keeps the root record
        let root = m.getattr("").unwrap();
        assert_eq!((root.kind, root.ino, root.mode, root.nlink, root.dev), (Kind::Dir, 1, 0o755, 2, 7));
        assert!(matches!(m.rmdir(""), Err(Error::Invalid(_))));
        assert!(matches!(m.remove(""), Err(Error::IsDir(_))));
        assert!(matches!(m.add("", Kind::Dir, 0o755, 0, None), Err(Error::Exists(_))));
        m.add("d", Kind::Dir, 0o700, 0, None).unwrap();
        assert!(matches!(m.rename("", "x", Rename::Replace), Err(Error::Invalid(_))));
        assert!(matches!(m.rename("d", "", Rename::Replace), Err(Error::Invalid(_))));
        let before = m2.getattr("d").unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let ino = m2.add("d/f", Kind::File, 0o644, 0, None).unwrap();
        let after = m.getattr("d").unwrap();
        assert!(after.mtime > before.mtime && after.ctime > before.ctime, "creating in d changes its times");
        assert_eq!(m.getattr("").unwrap().nlink, 3);
        m.update_record(ino, |x| x.size = 1000).unwrap();
        let a = m.getattr("d/f").unwrap();
        assert_eq!((a.size, a.blocks, a.nlink), (1000, 2, 1));
        m2.setattr("d/f", &SetAttr::new().with_mode(0o104_755).with_size(5)).unwrap();
        let a = m.getattr("d/f").unwrap();
        assert_eq!((a.mode, a.size), (0o4755, 1000), "mode masked, size not set here");
        m.add("d/l", Kind::Symlink, 0o777, 0, Some("../t".into())).unwrap();
        assert_eq!(m2.readlink("d/l").unwrap(), "../t");
        let gone = m.remove("d/f").unwrap();
        assert_eq!((gone.ino, gone.size), (ino, 1000));
        assert!(m.record(ino).unwrap().is_none());
        assert!(matches!(m.update_record(ino, |_| ()), Err(Error::NotFound(_))));
        check_whole(&env, &m);
        // The client handed to the token service talks to the same etcd.
        let r = env.rt.block_on(m.client().get(m.rec_key(ROOT_INO), None)).unwrap();
        assert_eq!(StoredNode::decode(r.kvs()[0].value()).unwrap().ino, ROOT_INO);
    }

    #[test]
    fn renames_of_big_directories() {
        let Some(env) = env("big") else { return };
        let m = env.open();
        let big = m.add("big", Kind::Dir, 0o755, 0, None).unwrap();
        m.add("mid", Kind::Dir, 0o755, 0, None).unwrap();
        let sub = m.add("mid/sub", Kind::Dir, 0o755, 0, None).unwrap();
        // Names and their index entries put directly (no records: a rename reads only the
        // directories' records).
        let put = |dir: &str, dir_ino: u64, n: usize, ino0: u64| {
            env.rt.block_on(async {
                let mut kv = m.kv();
                let ops: Vec<TxnOp> = (0..n)
                    .flat_map(|i| {
                        let v = encode_name(Name { ino: ino0 + i as u64, kind: Kind::File });
                        [
                            TxnOp::put(m.name_key(&format!("{dir}/f{i:05}")), v.clone(), None),
                            TxnOp::put(m.entry_key(dir_ino, &format!("f{i:05}")), v, None),
                        ]
                    })
                    .collect();
                for c in ops.chunks(1000) {
                    kv.txn(Txn::new().and_then(c.to_vec())).await.unwrap();
                }
            })
        };
        put("big", big, MAX_MOVE + 1, 1 << 40);
        put("mid/sub", sub, 2500, 1 << 41);
        let e = m.rename("big", "big2", Rename::Replace).unwrap_err();
        assert!(matches!(e, Error::NotSupported(_)), "{e:?}");
        assert!(m.lookup("big").is_ok());
        m.rename("mid", "moved", Rename::NoReplace).unwrap();
        assert!(matches!(m.lookup("mid"), Err(Error::NotFound(_))));
        assert_eq!(m.lookup("moved/sub").unwrap(), (sub, Kind::Dir));
        let d = m.readdir("moved/sub").unwrap();
        assert_eq!(d.len(), 2500);
        assert_eq!(d[17].name, "f00017");
        assert_eq!(d[17].ino, (1 << 41) + 17);
        assert!(!env.rt.block_on(m.snap("").has_children("mid")).unwrap());
        // The root's listing reads its own index — its record, then its two entries — not
        // the 12,500 names under it (a page of 1,000 keys a request).
        let before = m.requests();
        let root: Vec<String> = m.readdir("").unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(root, ["big", "moved"]);
        assert_eq!(m.requests() - before, 2, "requests to list the root");
    }

    /// Run `f(machine, thread)` on 2 machines × 4 threads at once.
    fn race(env: &Env, f: impl Fn(&EtcdMeta, usize) + Sync) {
        let machines = [env.open(), env.open()];
        std::thread::scope(|s| {
            for (mi, m) in machines.iter().enumerate() {
                for t in 0..4 {
                    let f = &f;
                    s.spawn(move || f(m, mi * 4 + t));
                }
            }
        });
    }

    /// A machine takes inode numbers 64 at a time: 100 creates move `next_ino` twice, and
    /// another machine's numbers come after both batches — never one of them.
    #[test]
    fn inode_numbers_are_taken_in_batches_and_never_twice() {
        let Some(env) = env("inobatch") else { return };
        let (a, b) = (env.open(), env.open());
        let next = |m: &EtcdMeta| {
            let r = env.rt.block_on(m.kv().get(m.next_key(), None)).unwrap();
            let kv = r.kvs().first().expect("next_ino is there");
            (u64::from_le_bytes(kv.value().try_into().unwrap()), kv.version())
        };
        let mut inos = BTreeSet::new();
        for i in 0..100 {
            assert!(inos.insert(a.add(&format!("a{i}"), Kind::File, 0o644, 0, None).unwrap()));
        }
        let (n, puts) = next(&a);
        assert_eq!((n, puts), (2 + 2 * INO_BATCH, 2), "100 creates on one machine: two batches");
        for i in 0..10 {
            let ino = b.add(&format!("b{i}"), Kind::File, 0o644, 0, None).unwrap();
            assert!(ino >= 2 + 2 * INO_BATCH && inos.insert(ino), "b's inode {ino} is one of a's batches");
        }
        // a's second batch goes on where it stopped.
        let ino = a.add("a100", Kind::File, 0o644, 0, None).unwrap();
        assert_eq!(ino, 2 + 100, "a's next number");
    }

    #[test]
    fn two_machines_create_each_name_once() {
        let Some(env) = env("create") else { return };
        let won = Mutex::new(Vec::new());
        let lost = AtomicU32::new(0);
        race(&env, |m, t| {
            let mut order: Vec<usize> = (0..50).collect();
            let mut rng = StdRng::seed_from_u64(t as u64);
            for i in (1..order.len()).rev() {
                order.swap(i, rng.random_range(0..=i));
            }
            for i in order {
                let p = format!("f{i:02}");
                match m.add(&p, Kind::File, 0o644, 0, None) {
                    Ok(ino) => won.lock().unwrap().push((p, ino)),
                    Err(Error::Exists(_)) => _ = lost.fetch_add(1, Relaxed),
                    Err(e) => panic!("{p}: {e}"),
                }
            }
        });
        let won = won.into_inner().unwrap();
        eprintln!("{} creates won, {} found the name taken", won.len(), lost.load(Relaxed));
        assert_eq!(won.len(), 50, "exactly one create per name");
        assert_eq!(lost.load(Relaxed), 8 * 50 - 50);
        let m = env.open();
        let names = check_whole(&env, &m);
        let got: BTreeSet<(String, u64)> = names.into_iter().map(|(p, n)| (p, n.ino)).collect();
        assert_eq!(got, won.into_iter().collect());
    }

    #[test]
    fn rmdir_never_removes_a_non_empty_directory() {
        let Some(env) = env("rmdir") else { return };
        let created = AtomicU32::new(0);
        let removed_dirs = AtomicU32::new(0);
        let moved = AtomicU32::new(0);
        race(&env, |m, t| {
            let ok = |r: Result<()>, p: &str| match r {
                Ok(()) => true,
                Err(Error::NotFound(_) | Error::Exists(_) | Error::NotEmpty(_) | Error::NotDir(_)) => false,
                Err(e) => panic!("{p}: {e}"),
            };
            let add = |p: &str, kind| m.add(p, kind, 0o755, 0, None).map(drop);
            for i in 0..30 {
                match t % 4 {
                    // mkdir d; create d/x; remove d/x; rmdir d
                    0 | 1 => {
                        ok(add("d", Kind::Dir), "d");
                        let x = format!("d/x{t}");
                        ok(add(&x, Kind::File), &x);
                        ok(m.remove(&x).map(drop), &x);
                        if ok(m.rmdir("d"), "d") {
                            removed_dirs.fetch_add(1, Relaxed);
                        }
                    }
                    // create d/y, remove it
                    2 => {
                        let y = format!("d/y{t}-{i}");
                        if ok(add(&y, Kind::File), &y) {
                            created.fetch_add(1, Relaxed);
                            ok(m.remove(&y).map(drop), &y);
                        }
                    }
                    // a subdirectory filled while d moves away and back, then emptied
                    _ => {
                        let (a, b) = if i % 2 == 0 { ("d", "e") } else { ("e", "d") };
                        ok(add(&format!("{a}/s"), Kind::Dir), a);
                        let z = format!("{a}/s/z{t}-{i}");
                        ok(add(&z, Kind::File), &z);
                        if ok(m.rename(a, b, Rename::NoReplace).map(drop), a) {
                            moved.fetch_add(1, Relaxed);
                        }
                        for d in [a, b] {
                            ok(m.remove(&format!("{d}/s/z{t}-{i}")).map(drop), d);
                            ok(m.rmdir(&format!("{d}/s")), d);
                        }
                        if i % 3 == 0 && ok(m.rmdir("e"), "e") {
                            removed_dirs.fetch_add(1, Relaxed);
                        }
                    }
                }
            }
        });
        eprintln!(
            "{} d/y created, {} rmdirs of d, {} renames of d/e",
            created.load(Relaxed),
            removed_dirs.load(Relaxed),
            moved.load(Relaxed)
        );
        let m = env.open();
        let names = check_whole(&env, &m);
        eprintln!("{} names left", names.len());
        assert!(created.load(Relaxed) > 0 && removed_dirs.load(Relaxed) + moved.load(Relaxed) > 0);
    }

    #[test]
    fn concurrent_record_updates_all_count() {
        let Some(env) = env("counter") else { return };
        let ino = env.open().add("counter", Kind::File, 0o644, 0, None).unwrap();
        race(&env, |m, _| {
            for _ in 0..50 {
                m.update_record(ino, |x| x.size += 1).unwrap();
            }
        });
        let m = env.open();
        assert_eq!(m.record(ino).unwrap().unwrap().0.size, 2 * 4 * 50);
        assert_eq!(m.getattr("counter").unwrap().size, 400);
    }
}

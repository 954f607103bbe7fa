//! The `s3` layer shared by several machines (`etcd=`, issue 21): names and per-file records
//! in etcd (`meta_etcd.rs`), each file's cached state guarded by a token between machines
//! (`crate::dist`). Data stays in chunk objects as for one machine; what changes is where a
//! file's record lives (one etcd key per file, rewritten at the file's commit, instead of
//! one tree object per commit of everything) and who may cache what.
//!
//! A file's commit (its `sync`, the committer every 5 s, giving its write token to another
//! machine, its last close) uploads its staged chunks, then rewrites its record in an etcd
//! transaction that also checks that this machine still holds the file's write token — a
//! fence: a machine that lost its lease (a partition) cannot overwrite what the next holder
//! committed, it gets `ESTALE` instead.

use super::super::{Attr, Kind, Opened, Rename};
use super::Shared;
use super::file::S3File;
use super::format::StoredNode;
use super::meta_etcd::EtcdMeta;
use crate::coherence::{Mode, Remote};
use crate::dist::{Machine, Writer};
use crate::error::{Error, Result};
use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
use object_store::path::Path as ObjPath;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::collections::HashSet;
use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::SystemTime;

/// What the machines share, and this machine's files.
pub(crate) struct SharedFs {
    pub(crate) meta: EtcdMeta,
    pub(crate) machine: Machine,
    /// `K`: the etcd key prefix of this file system.
    pub(crate) prefix: String,
    /// Files of this machine by inode (one `S3File`, hence one token, per file). An entry
    /// that no longer upgrades is a file being dropped (storing its changes, giving its
    /// token up): it leaves the map when that is done (`forget`), and a new `S3File` of the
    /// inode is made only then — one made earlier would have read the record before those
    /// changes were stored, and could write over them.
    files: Mutex<HashMap<u64, Weak<S3File>>>,
    /// Signalled when a dropped file has left `files`.
    forgotten: parking_lot::Condvar,
    /// Bumped when a dropped file has left `files` (after storing its changes): a record
    /// read before a bump may predate such a store, and does not make a file (`file`).
    forgets: std::sync::atomic::AtomicU64,
    /// Tokens of files closed everywhere on this machine, kept (their keys stay in etcd)
    /// for the next open, `stat` or write here: the most recently closed `KEPT_TOKENS`.
    /// Each is still served to other machines that ask (with nothing to store: the file's
    /// changes were stored at its close); one pushed out is given up. A file removed here is
    /// opened by the removal (the stack drops its cached data), which takes its token over
    /// and gives it up when that last handle goes (`S3File::unlinked`). Frangipani's and
    /// GPFS's clients cache tokens the same way.
    kept: Mutex<std::collections::VecDeque<Arc<crate::dist::Token>>>,
}

/// Tokens of closed files a machine keeps (`SharedFs::kept`). Before, each last close gave
/// the token up (an etcd write) and the next open took it again (one or two): a file
/// created, closed, then opened and written cost six writes to etcd, three of them for
/// the token.
const KEPT_TOKENS: usize = 256;

/// An etcd error as an I/O error.
pub(crate) fn etcd_io(e: etcd_client::Error) -> io::Error {
    io::Error::other(format!("etcd: {e}"))
}

impl SharedFs {
    pub(crate) fn new(meta: EtcdMeta, machine: Machine, prefix: String) -> SharedFs {
        SharedFs {
            meta,
            machine,
            prefix,
            files: Mutex::new(HashMap::new()),
            forgotten: parking_lot::Condvar::new(),
            forgets: std::sync::atomic::AtomicU64::new(0),
            kept: Mutex::new(std::collections::VecDeque::new()),
        }
    }

    fn record_key(&self, ino: u64) -> String {
        format!("{}i/{ino:016x}", self.prefix)
    }

    /// The file `ino` of this machine, made if there is none — from `read` (a record read
    /// before, when `forgets` was `read.0`) if no file of this machine stored its changes
    /// and left since, else from the record read now; without a token either way: the
    /// first pin reloads it unless this machine kept the token. => `read`'s record is
    /// `ino`'s.
    fn file(
        self: &Arc<Self>,
        shared: &Arc<Shared>,
        ino: u64,
        read: Option<(u64, &StoredNode)>,
    ) -> io::Result<Arc<S3File>> {
        let mut files = self.files.lock();
        while let Some(w) = files.get(&ino) {
            match w.upgrade() {
                Some(f) => return Ok(f),
                // Being dropped: wait until it has stored its changes and left.
                None => self.forgotten.wait(&mut files),
            }
        }
        let (size, chunks) = match read {
            Some((forgets, n)) if forgets == self.forgets.load(Relaxed) => (n.size, n.chunks.clone()),
            _ => match self.meta.record(ino).map_err(io::Error::other)? {
                Some((n, _)) => (n.size, n.chunks),
                None => return Err(io::Error::new(io::ErrorKind::NotFound, format!("inode {ino}: no record"))),
            },
        };
        let f = S3File::shared_file(shared.clone(), Arc::downgrade(self), ino, size, chunks);
        files.insert(ino, Arc::downgrade(&f));
        Ok(f)
    }

    /// The dropped file `f` (at `ptr`) is done: it leaves the map.
    pub(crate) fn forget(&self, ino: u64, ptr: *const S3File) {
        let mut files = self.files.lock();
        if files.get(&ino).is_some_and(|w| std::ptr::eq(w.as_ptr(), ptr)) {
            files.remove(&ino);
            self.forgets.fetch_add(1, Relaxed);
        }
        drop(files);
        self.forgotten.notify_all();
    }

    /// Keep the token of a file closed everywhere on this machine (its changes stored);
    /// the oldest kept past `KEPT_TOKENS` is given up.
    pub(crate) fn keep_token(&self, t: Arc<crate::dist::Token>) {
        let mut k = self.kept.lock();
        k.retain(|x| !Arc::ptr_eq(x, &t));
        k.push_back(t);
        let old = (k.len() > KEPT_TOKENS).then(|| k.pop_front()).flatten();
        drop(k);
        if let Some(old) = old {
            old.leave();
        }
    }

    /// This machine's file `ino`, if it has one.
    pub(crate) fn open_file(&self, ino: u64) -> Option<Arc<S3File>> {
        self.files.lock().get(&ino).and_then(Weak::upgrade)
    }

    /// Every file of this machine.
    fn all_files(&self) -> Vec<Arc<S3File>> {
        self.files.lock().values().filter_map(Weak::upgrade).collect()
    }

    /// Re-read `f`'s record (its token was got back: another machine may have changed it).
    pub(crate) fn reload(&self, f: &S3File) -> io::Result<()> {
        let (node, _) = self
            .meta
            .record(f.ino)
            .map_err(io::Error::other)?
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("inode {}: removed", f.ino)))?;
        f.replace_state(node.size, node.chunks);
        Ok(())
    }

    /// Commit `f`: upload its staged chunks, then rewrite its record — only while this
    /// machine holds its write token (the fence) — then delete the versions it replaced.
    pub(crate) fn commit(&self, shared: &Shared, f: &S3File) -> io::Result<()> {
        let _one = f.one_commit();
        if f.take_lost_changes() {
            return Err(io::Error::from_raw_os_error(libc::ESTALE));
        }
        if !f.take_changed() {
            return Ok(());
        }
        let r = self.commit_changed(shared, f);
        if r.is_err() {
            f.mark_changed();
        }
        r
    }

    fn commit_changed(&self, shared: &Shared, f: &S3File) -> io::Result<()> {
        let (size, chunks) = f.flush_for_record()?;
        let key = self.record_key(f.ino);
        let fence = self.machine.write_fence(f.ino);
        let mut c = self.meta.client();
        for _ in super::meta_etcd::attempts() {
            let (mut node, rev): (StoredNode, i64) = self
                .meta
                .record(f.ino)
                .map_err(io::Error::other)?
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("inode {}: removed", f.ino)))?;
            node.size = size;
            node.chunks = chunks.clone();
            let now = SystemTime::now();
            (node.mtime, node.ctime) = (now, now);
            let txn = Txn::new()
                .when([Compare::mod_revision(key.as_str(), CompareOp::Equal, rev), fence.clone()])
                .and_then([TxnOp::put(key.as_str(), node.encode(), None)])
                .or_else([self.machine.fence_probe(f.ino)]);
            let resp = shared.rt.block_on(c.txn(txn)).map_err(etcd_io)?;
            if resp.succeeded() {
                shared.commits.fetch_add(1, Relaxed);
                shared.delete_later(shared.take_garbage_of(f.ino), Vec::new());
                return Ok(());
            }
            if self.machine.fenced_off(f.ino, &resp) {
                // The write token is gone from etcd (another machine may have stored since):
                // the record is not this machine's to write. Nor are the objects this
                // machine's uploads replaced its to delete: the record another machine
                // stored may name them still (its patch laid over this machine's base).
                // What this machine uploaded is left for the sweep.
                drop(shared.take_garbage_of(f.ino));
                return Err(io::Error::from_raw_os_error(libc::ESTALE));
            }
            // The record changed (an attribute set by another machine): merge again.
        }
        Err(io::Error::other(format!("inode {}: record contended (30 s of conflicting attempts)", f.ino)))
    }

    /// Commit every changed file of this machine (`Stack::sync_all`, the committer, drop).
    pub(crate) fn commit_all(&self, shared: &Shared) -> io::Result<()> {
        let mut first = None;
        for f in self.all_files() {
            if let Err(e) = self.commit(shared, &f) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Delete the chunk objects nothing can reach: named by no record, of a file no machine
    /// holds a token of. They are left by a machine that crashed or lost its lease between
    /// an upload and its commit, or between a commit and its deletion of the versions it
    /// replaced (issue 21: the tree mode's sweep goes by age; here the tokens tell). A
    /// machine holding a file's write token may have uploaded versions it has not committed
    /// yet, and one holding any token may have the file open after its last name went, so
    /// such files are left alone. The objects are listed *before* etcd is read, in one
    /// revision: an object listed was uploaded under a write token held then, which either
    /// is held still at the read, or was given up after a commit that named the object or
    /// replaced it (garbage). Returns the objects deleted.
    pub(crate) fn sweep(&self, shared: &Shared) -> io::Result<u64> {
        let objects = shared.list("c/")?;
        if objects.is_empty() {
            return Ok(0);
        }
        let (records, tokens) = (format!("{}i/", self.prefix), format!("{}t/", self.prefix));
        let txn = Txn::new().and_then([
            TxnOp::get(records.as_str(), Some(GetOptions::new().with_prefix())),
            TxnOp::get(tokens.as_str(), Some(GetOptions::new().with_prefix().with_keys_only())),
        ]);
        let mut kv = self.meta.client().kv_client().max_decoding_message_size(256 << 20);
        let resp = shared.rt.block_on(kv.txn(txn)).map_err(etcd_io)?;
        let mut named = HashSet::new();
        let mut held = HashSet::new();
        for (i, r) in resp.op_responses().into_iter().enumerate() {
            let TxnOpResponse::Get(g) = r else { continue };
            for kv in g.kvs() {
                if i == 0 {
                    let n = StoredNode::decode(kv.value()).map_err(io::Error::other)?;
                    named.extend(n.chunks.iter().flat_map(|(&idx, c)| shared.chunk_objects(n.ino, idx, c)));
                } else if let Some(ino) = kv
                    .key_str()
                    .ok()
                    .and_then(|k| k.strip_prefix(tokens.as_str()))
                    .and_then(|k| k.split('/').next())
                    .and_then(|h| u64::from_str_radix(h, 16).ok())
                {
                    held.insert(ino);
                }
            }
        }
        let chunks = format!("{}c/", shared.root);
        let ino_of = |p: &ObjPath| {
            let rest = p.as_ref().strip_prefix(chunks.as_str())?;
            u64::from_str_radix(rest.split('/').next()?, 16).ok()
        };
        let unreachable: Vec<ObjPath> = objects
            .into_iter()
            .map(|m| m.location)
            .filter(|p| !named.contains(p) && ino_of(p).is_some_and(|ino| !held.contains(&ino)))
            .collect();
        let n = unreachable.len() as u64;
        shared.delete_all(unreachable);
        Ok(n)
    }

    /// Delete every object of file `ino` (its last name is gone and nothing here has it
    /// open).
    pub(crate) fn delete_objects(&self, shared: &Shared, ino: u64) {
        shared.delete_later(Vec::new(), vec![ino]);
    }
}

/// The layer's operations on a shared file system (`mod.rs` dispatches here).
impl SharedFs {
    /// Attributes. A regular file's size is the record's when no machine holds its write
    /// token (read with the record, at one revision: the record then has every write that
    /// returned — a holder stores before it gives the token up); while another machine
    /// holds it, it is read under this machine's read token (that machine stores its
    /// changes first); while this machine holds it, it is this machine's own. So a `stat`
    /// of a file nobody writes is one etcd read and takes no token.
    pub(crate) fn getattr(self: &Arc<Self>, shared: &Arc<Shared>, path: &str) -> Result<Attr> {
        let forgets = self.forgets.load(Relaxed);
        let tokens = |ino| self.machine.token_prefix(ino);
        let e = self.meta.entry(path, Some(&tokens))?;
        let mut a = e.attr;
        if a.kind == Kind::File && self.machine.writer(&e.also) != Writer::Nobody {
            let f = self.file(shared, a.ino, Some((forgets, &e.node))).map_err(|e| Error::io(path, e))?;
            let token = f.token().expect("a shared file has a token");
            let _pin = Remote::pin(token, Mode::Read).map_err(|e| Error::io(path, e))?;
            a.size = f.stored_state().0;
            a.blocks = a.size.div_ceil(512);
        }
        Ok(a)
    }

    /// Create the regular file `path`, with this machine's write token put in the same
    /// etcd transaction as its name and record (a separate acquisition was one more
    /// transaction, and an fsync of etcd's log, per file created). The file is made here
    /// and closed at once: its token is kept for the open that follows.
    pub(crate) fn create(self: &Arc<Self>, shared: &Arc<Shared>, path: &str, mode: u32) -> Result<()> {
        let lease = self.machine.lease().map_err(|e| Error::io(path, e))?;
        let token = |ino| self.machine.created_token(ino, lease);
        let ino = self.meta.add_with(path, Kind::File, mode, 0, None, Some(&token))?;
        // A new inode: no file of this machine has it yet.
        let f = S3File::shared_file(shared.clone(), Arc::downgrade(self), ino, 0, Default::default());
        self.files.lock().insert(ino, Arc::downgrade(&f));
        f.token().expect("a shared file has a token").created(lease);
        Ok(())
    }

    pub(crate) fn open(self: &Arc<Self>, shared: &Arc<Shared>, path: &str) -> Result<Opened> {
        let forgets = self.forgets.load(Relaxed);
        let e = self.meta.entry(path, None)?;
        if e.attr.kind != Kind::File {
            return Err(Error::IsDir(path.into()));
        }
        let file = self.file(shared, e.attr.ino, Some((forgets, &e.node))).map_err(|e| Error::io(path, e))?;
        let remote: Arc<dyn Remote> = file.token().expect("a shared file has a token");
        Ok(Opened::Shared { pager: file, remote })
    }

    pub(crate) fn remove(&self, shared: &Shared, path: &str) -> Result<()> {
        let node = self.meta.remove(path)?;
        self.freed(shared, &node);
        Ok(())
    }

    pub(crate) fn rename(&self, shared: &Shared, from: &str, to: &str, how: Rename) -> Result<()> {
        if let Some(node) = self.meta.rename(from, to, how)? {
            self.freed(shared, &node);
        }
        Ok(())
    }

    /// A file lost its last name: its objects go now, or at its last close here. (Another
    /// machine that has it open loses it at once: names are shared, open files are not.)
    fn freed(&self, shared: &Shared, node: &StoredNode) {
        if node.kind != Kind::File {
            return;
        }
        match self.open_file(node.ino) {
            Some(f) => f.unlinked.store(true, Relaxed),
            None => self.delete_objects(shared, node.ino),
        }
    }
}

//! A namespace held in process memory, keyed by path: the `mem` layer's whole tree, and the
//! `s3` layer's working copy of the tree it stores as one object. Each regular file carries
//! its store (`P`, a pager); the rest of a node is its attributes.

use super::{Attr, DirEntry, Kind, Rename, SetAttr, parent};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::SystemTime;

/// One name of the tree.
#[derive(Clone)]
pub(crate) struct Node<P> {
    pub(crate) kind: Kind,
    pub(crate) ino: u64,
    pub(crate) mode: u32,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) mtime: SystemTime,
    pub(crate) atime: SystemTime,
    pub(crate) ctime: SystemTime,
    /// A regular file's store.
    pub(crate) data: Option<Arc<P>>,
    /// A symbolic link's target.
    pub(crate) target: Option<String>,
    pub(crate) rdev: u64,
}

impl<P> Node<P> {
    pub(crate) fn new(kind: Kind, ino: u64, mode: u32, data: Option<Arc<P>>) -> Node<P> {
        let now = SystemTime::now();
        // SAFETY: geteuid and getegid take no arguments and always succeed.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        Node { kind, ino, mode, uid, gid, mtime: now, atime: now, ctime: now, data, target: None, rdev: 0 }
    }
}

/// The tree: every path ("" is the root) and its node.
pub(crate) struct Tree<P> {
    pub(crate) nodes: Mutex<BTreeMap<String, Node<P>>>,
    /// The store's number (`Attr::dev`).
    pub(crate) dev: u64,
    /// The next inode number to give.
    pub(crate) next_ino: AtomicU64,
    /// Set by every change of a name or an attribute (not of a file's bytes), for a store
    /// that writes the tree out.
    pub(crate) changed: AtomicBool,
}

fn is_child(parent: &str, p: &str) -> bool {
    !p.is_empty() && super::parent(p) == parent
}

impl<P: ubc::Pager> Tree<P> {
    /// A tree of `nodes` (the root included), numbering new nodes from `next_ino`.
    pub(crate) fn with(nodes: BTreeMap<String, Node<P>>, dev: u64, next_ino: u64) -> Tree<P> {
        Tree { nodes: Mutex::new(nodes), dev, next_ino: AtomicU64::new(next_ino), changed: AtomicBool::new(false) }
    }

    /// An empty tree: its root directory alone (inode 1).
    pub(crate) fn empty(dev: u64) -> Tree<P> {
        let mut nodes = BTreeMap::new();
        nodes.insert(String::new(), Node::new(Kind::Dir, 1, 0o755, None));
        Tree::with(nodes, dev, 2)
    }

    fn touch(&self) {
        self.changed.store(true, Relaxed);
    }

    /// Add `path` of `kind`; a file gets the store `make(ino)` makes.
    pub(crate) fn add(&self, path: &str, kind: Kind, mode: u32, make: impl FnOnce(u64) -> Arc<P>) -> Result<u64> {
        let mut n = self.nodes.lock();
        if n.contains_key(path) {
            return Err(Error::Exists(path.into()));
        }
        match n.get(parent(path)) {
            Some(p) if p.kind == Kind::Dir => {}
            Some(_) => return Err(Error::NotDir(parent(path).into())),
            None => return Err(Error::NotFound(parent(path).into())),
        }
        let ino = self.next_ino.fetch_add(1, Relaxed);
        let data = (kind == Kind::File).then(|| make(ino));
        n.insert(path.into(), Node::new(kind, ino, mode, data));
        self.touch();
        Ok(ino)
    }

    pub(crate) fn getattr(&self, path: &str) -> Result<Attr> {
        let n = self.nodes.lock();
        let x = n.get(path).ok_or_else(|| Error::NotFound(path.into()))?;
        let size = x.data.as_ref().map_or(0, |d| d.len().unwrap_or(0));
        let nlink = match x.kind {
            Kind::Dir => 2 + n.iter().filter(|(p, c)| c.kind == Kind::Dir && is_child(path, p)).count() as u32,
            _ => 1,
        };
        Ok(Attr {
            kind: x.kind,
            ino: x.ino,
            mode: x.mode,
            size,
            mtime: x.mtime,
            atime: x.atime,
            ctime: x.ctime,
            uid: x.uid,
            gid: x.gid,
            nlink,
            blocks: size.div_ceil(512),
            rdev: x.rdev,
            dev: self.dev,
        })
    }

    pub(crate) fn setattr(&self, path: &str, set: &SetAttr) -> Result<()> {
        let mut n = self.nodes.lock();
        let x = n.get_mut(path).ok_or_else(|| Error::NotFound(path.into()))?;
        set.apply(&mut x.mode, &mut x.uid, &mut x.gid, &mut x.mtime, &mut x.atime);
        if let (Some(s), Some(d)) = (set.size, &x.data) {
            d.set_len(s).map_err(|e| Error::io(path, e))?;
        }
        x.ctime = SystemTime::now();
        self.touch();
        Ok(())
    }

    pub(crate) fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        let n = self.nodes.lock();
        match n.get(path) {
            Some(x) if x.kind == Kind::Dir => {}
            Some(_) => return Err(Error::NotDir(path.into())),
            None => return Err(Error::NotFound(path.into())),
        }
        Ok(n.iter()
            .filter(|(p, _)| is_child(path, p))
            .map(|(p, x)| DirEntry { name: p.rsplit('/').next().unwrap_or(p).to_string(), kind: x.kind, ino: x.ino })
            .collect())
    }

    pub(crate) fn rename_with(&self, from: &str, to: &str, how: Rename, what: &str) -> Result<()> {
        match how {
            Rename::Replace => self.rename(from, to).map(drop),
            // Checked and renamed under one hold of the tree lock would need the rename's
            // body here; a tree in memory is one process's, so check-then-rename is enough.
            Rename::NoReplace if self.nodes.lock().contains_key(to) => Err(Error::Exists(to.into())),
            Rename::NoReplace => self.rename(from, to).map(drop),
            Rename::Exchange => Err(Error::NotSupported(format!("{to}: exchanging names in {what}"))),
        }
    }

    pub(crate) fn symlink(&self, target: &str, path: &str) -> Result<()> {
        self.add(path, Kind::Symlink, 0o777, |_| unreachable!("not a file"))?;
        if let Some(x) = self.nodes.lock().get_mut(path) {
            x.target = Some(target.to_string());
        }
        Ok(())
    }

    pub(crate) fn readlink(&self, path: &str) -> Result<String> {
        let n = self.nodes.lock();
        let x = n.get(path).ok_or_else(|| Error::NotFound(path.into()))?;
        x.target.clone().ok_or_else(|| Error::Invalid(format!("{path}: not a symbolic link")))
    }

    pub(crate) fn mknod(&self, path: &str, kind: Kind, mode: u32, rdev: u64) -> Result<()> {
        if matches!(kind, Kind::File | Kind::Dir | Kind::Symlink) {
            return Err(Error::Invalid(format!("{path}: mknod makes special files only")));
        }
        self.add(path, kind, mode, |_| unreachable!("not a file"))?;
        if let Some(x) = self.nodes.lock().get_mut(path) {
            x.rdev = rdev;
        }
        Ok(())
    }

    /// Remove the file `path`; returns its node (the caller may free its store).
    pub(crate) fn remove(&self, path: &str) -> Result<Node<P>> {
        let mut n = self.nodes.lock();
        match n.get(path) {
            Some(x) if x.kind == Kind::Dir => Err(Error::IsDir(path.into())),
            Some(_) => {
                self.touch();
                Ok(n.remove(path).expect("present"))
            }
            None => Err(Error::NotFound(path.into())),
        }
    }

    pub(crate) fn rmdir(&self, path: &str) -> Result<()> {
        let mut n = self.nodes.lock();
        match n.get(path) {
            Some(x) if x.kind != Kind::Dir => return Err(Error::NotDir(path.into())),
            None => return Err(Error::NotFound(path.into())),
            _ if path.is_empty() => return Err(Error::Invalid("cannot remove the root".into())),
            _ => {}
        }
        if n.keys().any(|p| is_child(path, p)) {
            return Err(Error::NotEmpty(path.into()));
        }
        n.remove(path);
        self.touch();
        Ok(())
    }

    /// Move `from` (and everything under it) to `to`; returns the node `to` named before,
    /// if any (the caller may free its store).
    pub(crate) fn rename(&self, from: &str, to: &str) -> Result<Option<Node<P>>> {
        let mut n = self.nodes.lock();
        if !n.contains_key(from) {
            return Err(Error::NotFound(from.into()));
        }
        if to.starts_with(&format!("{from}/")) {
            return Err(Error::Invalid(format!("cannot move {from} into itself")));
        }
        match n.get(parent(to)) {
            Some(p) if p.kind == Kind::Dir => {}
            _ => return Err(Error::NotFound(parent(to).into())),
        }
        if let Some(t) = n.get(to)
            && t.kind == Kind::Dir
            && n.keys().any(|p| is_child(to, p))
        {
            return Err(Error::NotEmpty(to.into()));
        }
        if from == to {
            return Ok(None);
        }
        let moved: Vec<String> =
            n.keys().filter(|p| *p == from || p.starts_with(&format!("{from}/"))).cloned().collect();
        let replaced = n.remove(to);
        for p in moved {
            let node = n.remove(&p).expect("listed");
            let np = format!("{to}{}", &p[from.len()..]);
            n.insert(np, node);
        }
        self.touch();
        Ok(replaced)
    }

    /// The store of regular file `path`.
    pub(crate) fn data(&self, path: &str) -> Result<Arc<P>> {
        let n = self.nodes.lock();
        let x = n.get(path).ok_or_else(|| Error::NotFound(path.into()))?;
        x.data.clone().ok_or_else(|| Error::IsDir(path.into()))
    }
}

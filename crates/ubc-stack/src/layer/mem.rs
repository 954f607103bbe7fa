//! `mem`: an in-memory tree (Mach's default pager for every file). Nothing persists past
//! the process; useful for tests, scratch stacks and as the bottom of benchmarks.
//!
//! A file's bytes live in shared memory (`ubc::pager::ShmPager`), which the cache serves in
//! place (UBC's execute-in-place, `CacheBuilder::xip`): a `mem` file is held once, in its
//! store, not copied into the cache, and costs the cache's budget nothing.

use super::{Attr, Below, DirEntry, Kind, Layer, Opened, Rename, SetAttr, parent};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::SystemTime;

static NEXT_TREE: AtomicU64 = AtomicU64::new(1);

/// A file's store: a shared-memory pager with an identity, so every open shares one object.
struct MemFile {
    pager: ubc::pager::ShmPager,
    id: String,
}

impl ubc::Pager for MemFile {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<ubc::Fill> {
        self.pager.get_pages(offset, buf)
    }
    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.pager.put_pages(offset, data)
    }
    fn len(&self) -> io::Result<u64> {
        self.pager.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.pager.set_len(len)
    }
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
    fn identity(&self) -> Option<ubc::Identity> {
        Some(ubc::Identity::Named { kind: "mem", name: self.id.clone() })
    }
    fn describe(&self) -> String {
        format!("memory file {}", self.id)
    }
    fn io_mode(&self) -> ubc::IoMode {
        ubc::IoMode::Memory
    }
    fn memory(&self) -> Option<ubc::pager::StoreMemory> {
        self.pager.memory()
    }
    fn can_punch(&self) -> bool {
        true
    }
    fn punch(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.pager.punch(offset, len)
    }
    fn seek(&self, offset: u64, what: ubc::pager::Seek) -> io::Result<Option<u64>> {
        self.pager.seek(offset, what)
    }
}

struct Node {
    kind: Kind,
    ino: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: SystemTime,
    atime: SystemTime,
    ctime: SystemTime,
    data: Option<Arc<MemFile>>,
    /// A symbolic link's target.
    target: Option<String>,
    rdev: u64,
}

impl Node {
    fn new(kind: Kind, ino: u64, mode: u32, data: Option<Arc<MemFile>>) -> Node {
        let now = SystemTime::now();
        // SAFETY: geteuid and getegid take no arguments and always succeed.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        Node { kind, ino, mode, uid, gid, mtime: now, atime: now, ctime: now, data, target: None, rdev: 0 }
    }
}

/// An in-memory tree.
pub struct Mem {
    tree: u64,
    nodes: Mutex<BTreeMap<String, Node>>,
    next_ino: AtomicU64,
}

impl Default for Mem {
    fn default() -> Self {
        Mem::new()
    }
}

impl Mem {
    pub fn new() -> Mem {
        let mut nodes = BTreeMap::new();
        nodes.insert(String::new(), Node::new(Kind::Dir, 1, 0o755, None));
        Mem { tree: NEXT_TREE.fetch_add(1, Relaxed), nodes: Mutex::new(nodes), next_ino: AtomicU64::new(2) }
    }

    fn add(&self, path: &str, kind: Kind, mode: u32) -> Result<()> {
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
        let data = (kind == Kind::File)
            .then(|| Arc::new(MemFile { pager: ubc::pager::ShmPager::new(), id: format!("{}:{ino}", self.tree) }));
        n.insert(path.into(), Node::new(kind, ino, mode, data));
        Ok(())
    }
}

fn is_child(parent: &str, p: &str) -> bool {
    !p.is_empty() && super::parent(p) == parent
}

impl Layer for Mem {
    fn spec(&self) -> String {
        "mem".into()
    }
    fn lower(&self) -> Option<&Arc<dyn Layer>> {
        None
    }
    fn getattr(&self, path: &str) -> Result<Attr> {
        let n = self.nodes.lock();
        let x = n.get(path).ok_or_else(|| Error::NotFound(path.into()))?;
        let size = x.data.as_ref().map_or(0, |d| ubc::Pager::len(&**d).unwrap_or(0));
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
            dev: self.tree,
        })
    }
    fn setattr(&self, path: &str, set: &SetAttr) -> Result<()> {
        let mut n = self.nodes.lock();
        let x = n.get_mut(path).ok_or_else(|| Error::NotFound(path.into()))?;
        if let Some(m) = set.mode {
            x.mode = m & 0o7777;
        }
        if let Some(u) = set.uid {
            x.uid = u;
        }
        if let Some(g) = set.gid {
            x.gid = g;
        }
        if let Some(t) = set.mtime {
            x.mtime = t;
        }
        if let Some(t) = set.atime {
            x.atime = t;
        }
        if let (Some(s), Some(d)) = (set.size, &x.data) {
            ubc::Pager::set_len(&**d, s).map_err(|e| Error::io(path, e))?;
        }
        x.ctime = SystemTime::now();
        Ok(())
    }
    fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
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
    fn create(&self, path: &str, mode: u32) -> Result<()> {
        self.add(path, Kind::File, mode)
    }
    fn rename_with(&self, from: &str, to: &str, how: Rename) -> Result<()> {
        match how {
            Rename::Replace => self.rename(from, to),
            // Checked and renamed under one hold of the tree lock would need the rename's
            // body here; a memory tree is one process's, so check-then-rename is enough.
            Rename::NoReplace if self.nodes.lock().contains_key(to) => Err(Error::Exists(to.into())),
            Rename::NoReplace => self.rename(from, to),
            Rename::Exchange => Err(Error::NotSupported(format!("{to}: exchanging names in a memory tree"))),
        }
    }
    fn sync_dir(&self, _path: &str) -> Result<()> {
        Ok(()) // nothing persists
    }
    fn symlink(&self, target: &str, path: &str) -> Result<()> {
        self.add(path, Kind::Symlink, 0o777)?;
        let mut n = self.nodes.lock();
        let x = n.get_mut(path).expect("just added");
        x.target = Some(target.to_string());
        Ok(())
    }
    fn readlink(&self, path: &str) -> Result<String> {
        let n = self.nodes.lock();
        let x = n.get(path).ok_or_else(|| Error::NotFound(path.into()))?;
        x.target.clone().ok_or_else(|| Error::Invalid(format!("{path}: not a symbolic link")))
    }
    fn link(&self, _from: &str, to: &str) -> Result<()> {
        Err(Error::NotSupported(format!("{to}: hard links in a memory tree")))
    }
    fn mknod(&self, path: &str, kind: Kind, mode: u32, rdev: u64) -> Result<()> {
        if matches!(kind, Kind::File | Kind::Dir | Kind::Symlink) {
            return Err(Error::Invalid(format!("{path}: mknod makes special files only")));
        }
        self.add(path, kind, mode)?;
        self.nodes.lock().get_mut(path).expect("just added").rdev = rdev;
        Ok(())
    }
    fn getxattr(&self, path: &str, _name: &str) -> Result<Vec<u8>> {
        Err(Error::NotSupported(format!("{path}: extended attributes in a memory tree")))
    }
    fn setxattr(&self, path: &str, _name: &str, _value: &[u8], _flags: i32) -> Result<()> {
        Err(Error::NotSupported(format!("{path}: extended attributes in a memory tree")))
    }
    fn listxattr(&self, path: &str) -> Result<Vec<String>> {
        Err(Error::NotSupported(format!("{path}: extended attributes in a memory tree")))
    }
    fn removexattr(&self, path: &str, _name: &str) -> Result<()> {
        Err(Error::NotSupported(format!("{path}: extended attributes in a memory tree")))
    }
    fn mkdir(&self, path: &str, mode: u32) -> Result<()> {
        self.add(path, Kind::Dir, mode)
    }
    fn remove(&self, path: &str) -> Result<()> {
        let mut n = self.nodes.lock();
        match n.get(path) {
            Some(x) if x.kind == Kind::Dir => Err(Error::IsDir(path.into())),
            Some(_) => {
                n.remove(path);
                Ok(())
            }
            None => Err(Error::NotFound(path.into())),
        }
    }
    fn rmdir(&self, path: &str) -> Result<()> {
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
        Ok(())
    }
    fn rename(&self, from: &str, to: &str) -> Result<()> {
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
        let moved: Vec<String> =
            n.keys().filter(|p| *p == from || p.starts_with(&format!("{from}/"))).cloned().collect();
        n.remove(to);
        for p in moved {
            let node = n.remove(&p).expect("listed");
            let np = format!("{to}{}", &p[from.len()..]);
            n.insert(np, node);
        }
        Ok(())
    }
    fn open(&self, path: &str, _access: ubc::Access, _below: &dyn Below) -> Result<Opened> {
        let n = self.nodes.lock();
        let x = n.get(path).ok_or_else(|| Error::NotFound(path.into()))?;
        match &x.data {
            Some(d) => Ok(Opened::Store(d.clone())),
            None => Err(Error::IsDir(path.into())),
        }
    }
}

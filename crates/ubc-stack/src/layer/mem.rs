//! `mem`: an in-memory tree (Mach's default pager for every file). Nothing persists past
//! the process; useful for tests, scratch stacks and as the bottom of benchmarks.
//!
//! A file's bytes live in shared memory (`ubc::pager::ShmPager`), which the cache serves in
//! place (UBC's execute-in-place, `CacheBuilder::xip`): a `mem` file is held once, in its
//! store, not copied into the cache, and costs the cache's budget nothing.

use super::tree::Tree;
use super::{Attr, Below, DirEntry, Kind, Layer, Opened, Rename, SetAttr};
use crate::error::{Error, Result};
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

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

/// An in-memory tree.
pub struct Mem {
    tree: Tree<MemFile>,
}

impl Default for Mem {
    fn default() -> Self {
        Mem::new()
    }
}

impl Mem {
    pub fn new() -> Mem {
        Mem { tree: Tree::empty(NEXT_TREE.fetch_add(1, Relaxed)) }
    }

    fn add(&self, path: &str, kind: Kind, mode: u32) -> Result<()> {
        let dev = self.tree.dev;
        let file = |ino| Arc::new(MemFile { pager: ubc::pager::ShmPager::new(), id: format!("{dev}:{ino}") });
        self.tree.add(path, kind, mode, file).map(drop)
    }
}

impl Layer for Mem {
    fn spec(&self) -> String {
        "mem".into()
    }
    fn lower(&self) -> Option<&Arc<dyn Layer>> {
        None
    }
    fn getattr(&self, path: &str) -> Result<Attr> {
        self.tree.getattr(path)
    }
    fn setattr(&self, path: &str, set: &SetAttr) -> Result<()> {
        self.tree.setattr(path, set)
    }
    fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        self.tree.readdir(path)
    }
    fn create(&self, path: &str, mode: u32) -> Result<()> {
        self.add(path, Kind::File, mode)
    }
    fn rename_with(&self, from: &str, to: &str, how: Rename) -> Result<()> {
        self.tree.rename_with(from, to, how, "a memory tree")
    }
    fn sync_dir(&self, _path: &str) -> Result<()> {
        Ok(()) // nothing persists
    }
    fn symlink(&self, target: &str, path: &str) -> Result<()> {
        self.tree.symlink(target, path)
    }
    fn readlink(&self, path: &str) -> Result<String> {
        self.tree.readlink(path)
    }
    fn link(&self, _from: &str, to: &str) -> Result<()> {
        Err(Error::NotSupported(format!("{to}: hard links in a memory tree")))
    }
    fn mknod(&self, path: &str, kind: Kind, mode: u32, rdev: u64) -> Result<()> {
        self.tree.mknod(path, kind, mode, rdev)
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
        self.tree.remove(path).map(drop)
    }
    fn rmdir(&self, path: &str) -> Result<()> {
        self.tree.rmdir(path)
    }
    fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.tree.rename(from, to).map(drop)
    }
    fn open(&self, path: &str, _access: ubc::Access, _below: &dyn Below) -> Result<Opened> {
        Ok(Opened::Store(self.tree.data(path)?))
    }
}

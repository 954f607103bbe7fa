//! `union`: a writable upper directory over the read-only layer below (union mounts,
//! overlayfs). Names in the upper hide the same names below; the first write to a lower
//! file copies it up; removing a lower name leaves a *whiteout* (`.wh.<name>` in the upper
//! directory); a directory made where a lower one was removed is *opaque* (`.wh..opq`).
//! Listings merge both, upper first.
//!
//! Files in the upper directory are stores of their own (a new file token). Files only
//! below are the lower layer's files (simply named: same cache object). A handle opened
//! read-only *before* a copy-up keeps reading the lower file (as overlayfs did before
//! Linux 4.19); handles opened after see the upper copy.

use super::dir::Dir;
use super::{Attr, Below, DirEntry, Kind, Layer, Opened, Rename, SetAttr, parent};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;

const WH: &str = ".wh.";
const OPAQUE: &str = ".wh..opq";

/// A union of a writable host directory over the layer below.
pub struct Union {
    lower: Arc<dyn Layer>,
    upper: Dir,
}

fn name_of(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() { name.to_string() } else { format!("{dir}/{name}") }
}

fn whiteout_of(path: &str) -> String {
    join(parent(path), &format!("{WH}{}", name_of(path)))
}

impl Union {
    pub fn new(lower: Arc<dyn Layer>, upper: Dir) -> Union {
        Union { lower, upper }
    }

    fn in_upper(&self, path: &str) -> Option<Attr> {
        self.upper.getattr(path).ok()
    }

    /// Whether `path` or one of its ancestors is hidden by a whiteout or an opaque directory.
    fn hidden(&self, path: &str) -> bool {
        let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
        let mut cur = String::new();
        for c in comps {
            if self.in_upper(&join(&cur, &format!("{WH}{c}"))).is_some() {
                return true;
            }
            if !cur.is_empty()
                && self.in_upper(&join(&cur, OPAQUE)).is_some()
                && self.in_upper(&join(&cur, c)).is_none()
            {
                return true;
            }
            cur = join(&cur, c);
        }
        false
    }

    fn in_lower(&self, path: &str) -> Option<Attr> {
        if self.hidden(path) {
            return None;
        }
        self.lower.getattr(path).ok()
    }

    /// Make the directories of `path`'s parent exist in the upper directory.
    fn upper_parents(&self, path: &str) -> Result<()> {
        let mut cur = String::new();
        let p = parent(path);
        if p.is_empty() {
            return Ok(());
        }
        for c in p.split('/') {
            cur = join(&cur, c);
            if self.in_upper(&cur).is_none() {
                let mode = self.lower.getattr(&cur).map(|a| a.mode).unwrap_or(0o755);
                self.upper.mkdir(&cur, mode)?;
            }
        }
        Ok(())
    }

    fn clear_whiteout(&self, path: &str) -> Result<bool> {
        let wh = whiteout_of(path);
        if self.in_upper(&wh).is_some() {
            self.upper.remove(&wh)?;
            return Ok(true);
        }
        Ok(false)
    }

    fn make_whiteout(&self, path: &str) -> Result<()> {
        self.upper_parents(path)?;
        let wh = whiteout_of(path);
        if self.in_upper(&wh).is_none() {
            self.upper.create(&wh, 0o600)?;
        }
        Ok(())
    }

    /// Copy `path`'s extended attributes from the layer below to `to` in the upper
    /// directory: a copy-up keeps them, as overlayfs's does (through an aead layer below,
    /// they arrive decrypted, like the data). A lower layer without extended attributes
    /// has none to copy; one the upper directory refuses this process (`EOPNOTSUPP`,
    /// `EPERM`: a namespace it does not store or a privilege it lacks) stays behind, as an
    /// owner does; one that fails below (an aead authentication error) fails the copy-up.
    /// => `to` exists in the upper directory and this process may write it.
    fn copy_up_xattrs(&self, path: &str, to: &str) -> Result<()> {
        let names = match self.lower.listxattr(path) {
            Ok(n) => n,
            Err(Error::NotSupported(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        for n in names {
            let v = match self.lower.getxattr(path, &n) {
                Ok(v) => v,
                // Removed since the listing: nothing to copy.
                Err(e) if e.errno() == libc::ENODATA => continue,
                Err(e) => return Err(e),
            };
            match self.upper.setxattr(to, &n, &v, 0) {
                Ok(()) => {}
                Err(e) if matches!(e.errno(), libc::EOPNOTSUPP | libc::EPERM) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Copy up what has no data: a lower directory (made in the upper directory, not its
    /// entries: the two merge), symbolic link, FIFO, socket or device node, with its mode,
    /// times, extended attributes and (where this process may) owner. A regular file needs its data copied
    /// through the stack (`copy_up`): refused here with [`Error::ReadOnly`], which the stack
    /// answers by opening the file for writing.
    fn copy_up_meta(&self, path: &str) -> Result<()> {
        if self.in_upper(path).is_some() {
            return Ok(());
        }
        let a = self.in_lower(path).ok_or_else(|| Error::NotFound(path.into()))?;
        self.upper_parents(path)?;
        match a.kind {
            Kind::File => return Err(Error::ReadOnly(format!("{path} (copy it up by opening it for writing first)"))),
            // Owner-writable until its attributes are copied; the mode is set just after.
            Kind::Dir => self.upper.mkdir(path, 0o700)?,
            Kind::Symlink => self.upper.symlink(&self.lower.readlink(path)?, path)?,
            k => self.upper.mknod(path, k, a.mode, a.rdev)?,
        }
        self.copy_up_xattrs(path, path)?;
        let times = SetAttr { atime: Some(a.atime), mtime: Some(a.mtime), ..Default::default() };
        if a.kind != Kind::Symlink {
            self.upper.setattr(path, &SetAttr { mode: Some(a.mode), ..times })?;
        }
        match self.upper.setattr(path, &SetAttr { uid: Some(a.uid), gid: Some(a.gid), ..Default::default() }) {
            Ok(()) => Ok(()),
            Err(Error::Io { source, .. }) if source.raw_os_error() == Some(libc::EPERM) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Copy a lower file up (data read through the stack below, so it is current).
    fn copy_up(&self, path: &str, below: &dyn Below) -> Result<()> {
        let attr = self.lower.getattr(path)?;
        if attr.kind != Kind::File {
            return Err(Error::Invalid(format!("{path}: only regular files are copied up")));
        }
        self.upper_parents(path)?;
        let src = below.open_lower(path, ubc::Access::ReadOnly)?;
        let tmp = join(parent(path), &format!(".ubc-copyup.{}", name_of(path)));
        // A stale temporary (or a link planted under its name) goes; the new one is created
        // exclusively beneath the upper root, following no link (the parent may itself be a
        // link someone planted in the upper directory: that is refused, not followed).
        match self.upper.remove(&tmp) {
            Ok(()) | Err(Error::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
        let mut out = self.upper.open_beneath(&tmp, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o600)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        loop {
            let n = src.read_at(&mut buf, off)?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n]).map_err(|e| Error::io(path, e))?;
            off += n as u64;
        }
        // Before the mode (a read-only lower file's copy must still take them) and the sync
        // (one sync makes data and attributes durable).
        self.copy_up_xattrs(path, &tmp)?;
        out.sync_all().map_err(|e| Error::io(path, e))?;
        drop(out);
        self.upper.setattr(
            &tmp,
            &SetAttr { mode: Some(attr.mode), atime: Some(attr.atime), mtime: Some(attr.mtime), ..Default::default() },
        )?;
        // The owner too, where this process may give files away (root); a rootless union's
        // copies belong to whoever runs it, as with overlayfs mounted by a user.
        let owner = SetAttr { uid: Some(attr.uid), gid: Some(attr.gid), ..Default::default() };
        match self.upper.setattr(&tmp, &owner) {
            Ok(()) => {}
            Err(Error::Io { source, .. }) if source.raw_os_error() == Some(libc::EPERM) => {}
            Err(e) => return Err(e),
        }
        self.upper.rename(&tmp, path)
    }
}

impl Layer for Union {
    fn spec(&self) -> String {
        format!("union:upper={}", self.upper.root().display())
    }
    fn lower(&self) -> Option<&Arc<dyn Layer>> {
        Some(&self.lower)
    }
    fn getattr(&self, path: &str) -> Result<Attr> {
        if let Some(a) = self.in_upper(path) {
            return Ok(a);
        }
        self.in_lower(path).ok_or_else(|| Error::NotFound(path.into()))
    }
    fn setattr(&self, path: &str, set: &SetAttr) -> Result<()> {
        self.copy_up_meta(path)?;
        self.upper.setattr(path, set)
    }
    fn readdir(&self, path: &str) -> Result<Vec<DirEntry>> {
        let mut out: BTreeMap<String, DirEntry> = BTreeMap::new();
        let up = self.in_upper(path);
        let mut whiteouts = Vec::new();
        if let Some(a) = &up {
            if a.kind != Kind::Dir {
                return Err(Error::NotDir(path.into()));
            }
            for e in self.upper.readdir(path)? {
                if let Some(n) = e.name.strip_prefix(WH) {
                    whiteouts.push(n.to_string());
                } else if !e.name.starts_with(".ubc-copyup.") {
                    out.insert(e.name.clone(), e);
                }
            }
        }
        let opaque = up.is_some() && self.in_upper(&join(path, OPAQUE)).is_some();
        if !opaque {
            if let Some(a) = self.in_lower(path) {
                if a.kind == Kind::Dir {
                    for e in self.lower.readdir(path)? {
                        if !whiteouts.contains(&e.name) && !out.contains_key(&e.name) {
                            out.insert(e.name.clone(), e);
                        }
                    }
                }
            } else if up.is_none() {
                return Err(Error::NotFound(path.into()));
            }
        }
        Ok(out.into_values().collect())
    }
    fn create(&self, path: &str, mode: u32) -> Result<()> {
        if self.getattr(path).is_ok() {
            return Err(Error::Exists(path.into()));
        }
        self.upper_parents(path)?;
        self.clear_whiteout(path)?;
        self.upper.create(path, mode)
    }
    /// `NoReplace` is checked, then renamed (the union is not one store, so not in one
    /// step). `Exchange` swaps two names that only the upper directory holds (in one step
    /// there); names with a lower part would need whiteouts moved too: not supported.
    fn rename_with(&self, from: &str, to: &str, how: Rename) -> Result<()> {
        match how {
            Rename::Replace => self.rename(from, to),
            Rename::NoReplace if self.getattr(to).is_ok() => Err(Error::Exists(to.into())),
            Rename::NoReplace => self.rename(from, to),
            Rename::Exchange => {
                self.getattr(from)?;
                self.getattr(to)?;
                if self.in_lower(from).is_some() || self.in_lower(to).is_some() {
                    return Err(Error::NotSupported(format!("{to}: exchanging names with a lower part")));
                }
                self.upper.rename_with(from, to, Rename::Exchange)
            }
        }
    }
    /// Changes are made in the upper directory only.
    fn sync_dir(&self, path: &str) -> Result<()> {
        if self.in_upper(path).is_some() { self.upper.sync_dir(path) } else { Ok(()) }
    }
    fn symlink(&self, target: &str, path: &str) -> Result<()> {
        if self.getattr(path).is_ok() {
            return Err(Error::Exists(path.into()));
        }
        self.upper_parents(path)?;
        self.clear_whiteout(path)?;
        self.upper.symlink(target, path)
    }
    fn mknod(&self, path: &str, kind: Kind, mode: u32, rdev: u64) -> Result<()> {
        if self.getattr(path).is_ok() {
            return Err(Error::Exists(path.into()));
        }
        self.upper_parents(path)?;
        self.clear_whiteout(path)?;
        self.upper.mknod(path, kind, mode, rdev)
    }
    fn readlink(&self, path: &str) -> Result<String> {
        if self.in_upper(path).is_some() {
            return self.upper.readlink(path);
        }
        if self.in_lower(path).is_none() {
            return Err(Error::NotFound(path.into()));
        }
        self.lower.readlink(path)
    }
    /// Links are made in the upper directory: a lower file is copied up first (the stack
    /// does this, as for a rename), so both names reach the one upper copy.
    fn link(&self, from: &str, to: &str) -> Result<()> {
        if self.getattr(to).is_ok() {
            return Err(Error::Exists(to.into()));
        }
        match self.copy_up_meta(from) {
            Err(Error::ReadOnly(_)) => {
                return Err(Error::CrossDevice(format!("{from}: a lower file must be copied up before a link")));
            }
            r => r?,
        }
        self.upper_parents(to)?;
        self.clear_whiteout(to)?;
        self.upper.link(from, to)
    }
    fn getxattr(&self, path: &str, name: &str) -> Result<Vec<u8>> {
        if self.in_upper(path).is_some() {
            return self.upper.getxattr(path, name);
        }
        if self.in_lower(path).is_none() {
            return Err(Error::NotFound(path.into()));
        }
        self.lower.getxattr(path, name)
    }
    fn listxattr(&self, path: &str) -> Result<Vec<String>> {
        if self.in_upper(path).is_some() {
            return self.upper.listxattr(path);
        }
        if self.in_lower(path).is_none() {
            return Err(Error::NotFound(path.into()));
        }
        self.lower.listxattr(path)
    }
    fn setxattr(&self, path: &str, name: &str, value: &[u8], flags: i32) -> Result<()> {
        self.copy_up_meta(path)?;
        self.upper.setxattr(path, name, value, flags)
    }
    fn removexattr(&self, path: &str, name: &str) -> Result<()> {
        self.copy_up_meta(path)?;
        self.upper.removexattr(path, name)
    }
    fn mkdir(&self, path: &str, mode: u32) -> Result<()> {
        if self.getattr(path).is_ok() {
            return Err(Error::Exists(path.into()));
        }
        self.upper_parents(path)?;
        let was_removed = self.clear_whiteout(path)?;
        self.upper.mkdir(path, mode)?;
        if was_removed {
            self.upper.create(&join(path, OPAQUE), 0o600)?;
        }
        Ok(())
    }
    fn remove(&self, path: &str) -> Result<()> {
        let a = self.getattr(path)?;
        if a.kind == Kind::Dir {
            return Err(Error::IsDir(path.into()));
        }
        if self.in_upper(path).is_some() {
            self.upper.remove(path)?;
        }
        if self.in_lower(path).is_some() {
            self.make_whiteout(path)?;
        }
        Ok(())
    }
    fn rmdir(&self, path: &str) -> Result<()> {
        let a = self.getattr(path)?;
        if a.kind != Kind::Dir {
            return Err(Error::NotDir(path.into()));
        }
        if !self.readdir(path)?.is_empty() {
            return Err(Error::NotEmpty(path.into()));
        }
        if self.in_upper(path).is_some() {
            for e in self.upper.readdir(path)? {
                self.upper.remove(&join(path, &e.name))?; // whiteouts and the opaque marker
            }
            self.upper.rmdir(path)?;
        }
        if self.in_lower(path).is_some() {
            self.make_whiteout(path)?;
        }
        Ok(())
    }
    fn rename(&self, from: &str, to: &str) -> Result<()> {
        let a = self.getattr(from)?;
        if self.in_upper(from).is_none() {
            match a.kind {
                Kind::Dir => return Err(Error::CrossDevice(format!("{from}: renaming a lower directory"))),
                // Its data comes up through the stack (which answers CrossDevice so).
                Kind::File => return Err(Error::CrossDevice(format!("{from}: a lower file must be copied up first"))),
                // A link or special file: copied up as it is (it has no data).
                _ => self.copy_up_meta(from)?,
            }
        }
        if a.kind == Kind::Dir && self.in_lower(from).is_some() {
            return Err(Error::CrossDevice(format!("{from}: renaming a merged directory")));
        }
        self.upper_parents(to)?;
        self.clear_whiteout(to)?;
        self.upper.rename(from, to)?;
        if self.in_lower(from).is_some() {
            self.make_whiteout(from)?;
        }
        Ok(())
    }
    fn open(&self, path: &str, access: ubc::Access, below: &dyn Below) -> Result<Opened> {
        if self.in_upper(path).is_some() {
            return self.upper.open(path, access, below);
        }
        if self.in_lower(path).is_none() {
            return Err(Error::NotFound(path.into()));
        }
        if access == ubc::Access::ReadWrite {
            self.copy_up(path, below)?;
            return self.upper.open(path, access, below);
        }
        Ok(Opened::Lower)
    }
}

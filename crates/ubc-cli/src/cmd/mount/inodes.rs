//! The inode table of one mount: inode numbers ↔ paths in the layer.
//!
//! Numbers are handed out as paths are first looked up and never reused; a path keeps its
//! number until it is removed or renamed over. The root ("") is inode 1, as FUSE requires.

use std::collections::HashMap;

pub(super) struct Inodes {
    by_ino: HashMap<u64, String>,
    by_path: HashMap<String, u64>,
    next: u64,
}

impl Inodes {
    pub(super) fn new() -> Inodes {
        let mut i = Inodes { by_ino: HashMap::new(), by_path: HashMap::new(), next: 2 };
        i.by_ino.insert(1, String::new());
        i.by_path.insert(String::new(), 1);
        i
    }

    /// The number of `path`, given one now if it has none.
    pub(super) fn ino(&mut self, path: &str) -> u64 {
        if let Some(&i) = self.by_path.get(path) {
            return i;
        }
        let i = self.next;
        self.next += 1;
        self.by_ino.insert(i, path.to_string());
        self.by_path.insert(path.to_string(), i);
        i
    }

    pub(super) fn path(&self, ino: u64) -> Option<String> {
        self.by_ino.get(&ino).cloned()
    }

    /// Forget `path` and everything under it.
    pub(super) fn remove(&mut self, path: &str) {
        for (p, i) in self.at_or_under(path) {
            self.by_path.remove(&p);
            self.by_ino.remove(&i);
        }
    }

    /// `from` (and everything under it) is now `to`; what was at `to` is forgotten.
    pub(super) fn rename(&mut self, from: &str, to: &str) {
        self.remove(to);
        for (p, i) in self.at_or_under(from) {
            let np = format!("{to}{}", &p[from.len()..]);
            self.by_path.remove(&p);
            self.by_path.insert(np.clone(), i);
            self.by_ino.insert(i, np);
        }
    }

    /// `path` and the paths under it, with their numbers.
    fn at_or_under(&self, path: &str) -> Vec<(String, u64)> {
        let prefix = format!("{path}/");
        self.by_path
            .iter()
            .filter(|(p, _)| p.as_str() == path || p.starts_with(&prefix))
            .map(|(p, i)| (p.clone(), *i))
            .collect()
    }
}

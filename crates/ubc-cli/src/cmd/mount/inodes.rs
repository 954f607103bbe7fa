//! The inode table of one mount: FUSE node ids ↔ the files the layer shows, and their names.
//!
//! A file is known by its store key — the store's device and inode number ([`Attr::dev`],
//! [`Attr::ino`]) — so that its node id is the same under every name (hard links), after a
//! rename and across remounts: the node id *is* the store's inode number unless another file
//! already holds that number here (a union shows two stores; a number the host reused while
//! the kernel still holds the old file), then a number from a private range above 2^56.
//! The root is node 1, as FUSE requires.
//!
//! Lifetime follows the FUSE protocol: every reply that hands the kernel a node (lookup,
//! create, mkdir, mknod, symlink, link) counts one reference; `FORGET` gives them back. A
//! node is dropped when the kernel holds no reference and no name leads to it; a node whose
//! names are all gone but which the kernel still holds (an open, unlinked file) stays, with
//! no path.
//!
//! [`Attr::dev`]: ubc_stack::Attr::dev
//! [`Attr::ino`]: ubc_stack::Attr::ino

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;

/// First node id of the private range (numbers a store's own would not reach).
const PRIVATE: u64 = 1 << 56;

/// A store's name for a file: (device, inode number).
type Key = (u64, u64);

struct Node {
    key: Option<Key>,
    /// Names that lead to the file (several for hard links; none once unlinked).
    paths: Vec<String>,
    /// References the kernel holds (lookups not yet forgotten).
    lookups: u64,
}

pub(super) struct Inodes {
    nodes: HashMap<u64, Node>,
    /// Ordered, so that the names under a directory are one range (`at_or_under`): a
    /// removal or rename looks at the names it changes, not at every name known (a scan of
    /// all of them made each `unlink` and each lookup of a missing name O(files), which took
    /// 13 % of the daemon's CPU at 2,000 files).
    by_path: BTreeMap<String, u64>,
    by_key: HashMap<Key, u64>,
    next_private: u64,
}

impl Inodes {
    pub(super) fn new() -> Inodes {
        let mut i =
            Inodes { nodes: HashMap::new(), by_path: BTreeMap::new(), by_key: HashMap::new(), next_private: PRIVATE };
        i.nodes.insert(1, Node { key: None, paths: vec![String::new()], lookups: 1 });
        i.by_path.insert(String::new(), 1);
        i
    }

    /// The node id of the file `key` at `path`, learning the name; `counted`: the reply
    /// hands the node to the kernel (one more reference).
    pub(super) fn node(&mut self, path: &str, key: Key, counted: bool) -> u64 {
        if path.is_empty() {
            return 1;
        }
        let id = match self.by_path.get(path).copied() {
            Some(id) if self.nodes.get(&id).is_some_and(|n| n.key == Some(key)) => id,
            stale => {
                // The name leads to another file now (replaced behind this mount's back).
                if let Some(old) = stale {
                    self.unbind(path, old);
                }
                let id = match self.by_key.get(&key).copied() {
                    Some(id) => id,
                    None => {
                        let id = if key.1 > 1 && key.1 < PRIVATE && !self.nodes.contains_key(&key.1) {
                            key.1
                        } else {
                            self.next_private += 1;
                            self.next_private - 1
                        };
                        self.nodes.insert(id, Node { key: Some(key), paths: Vec::new(), lookups: 0 });
                        self.by_key.insert(key, id);
                        id
                    }
                };
                // The newest name first: another mount of the stack may have renamed the
                // file, and the name just looked up is the one known to exist.
                let n = self.nodes.get_mut(&id).expect("bound");
                n.paths.insert(0, path.to_string());
                self.by_path.insert(path.to_string(), id);
                id
            }
        };
        if counted {
            self.nodes.get_mut(&id).expect("bound").lookups += 1;
        }
        id
    }

    /// The node id of `path` if the table knows it as the file `key` already: what
    /// `node(path, key, false)` returns without changing anything (a read lock suffices).
    pub(super) fn current(&self, path: &str, key: Key) -> Option<u64> {
        if path.is_empty() {
            return Some(1);
        }
        let id = self.by_path.get(path).copied()?;
        self.nodes.get(&id).is_some_and(|n| n.key == Some(key)).then_some(id)
    }

    /// The node id `path` has now, if the table knows it (no reference counted).
    pub(super) fn known(&self, path: &str) -> Option<u64> {
        self.by_path.get(path).copied()
    }

    /// The node id of the file the store knows as `key`, if the kernel may hold it.
    pub(super) fn of_key(&self, key: Key) -> Option<u64> {
        self.by_key.get(&key).copied()
    }

    /// A path of node `id` (any of its names), if it has one.
    pub(super) fn path(&self, id: u64) -> Option<String> {
        self.nodes.get(&id).and_then(|n| n.paths.first().cloned())
    }

    /// Every known name of node `id`, the newest first.
    pub(super) fn paths(&self, id: u64) -> Vec<String> {
        self.nodes.get(&id).map(|n| n.paths.clone()).unwrap_or_default()
    }

    /// The kernel gave back `n` references to node `id`.
    pub(super) fn forget(&mut self, id: u64, n: u64) {
        if id == 1 {
            return;
        }
        if let Some(node) = self.nodes.get_mut(&id) {
            node.lookups = node.lookups.saturating_sub(n);
        }
        self.drop_if_unused(id);
    }

    /// The name `path` (and every name under it) is gone.
    pub(super) fn remove(&mut self, path: &str) {
        for (p, id) in self.at_or_under(path) {
            self.unbind(&p, id);
        }
    }

    /// `from` (and everything under it) is now `to`; the name `to` no longer leads to what
    /// it led to.
    pub(super) fn rename(&mut self, from: &str, to: &str) {
        self.remove(to);
        self.move_names(from, to);
    }

    /// Every name at or under `from` now starts with `to` instead.
    fn move_names(&mut self, from: &str, to: &str) {
        for (p, id) in self.at_or_under(from) {
            let np = format!("{to}{}", &p[from.len()..]);
            self.by_path.remove(&p);
            self.by_path.insert(np.clone(), id);
            if let Some(n) = self.nodes.get_mut(&id) {
                for q in n.paths.iter_mut().filter(|q| **q == p) {
                    *q = np.clone();
                }
            }
        }
    }

    /// The names `a` and `b` (and everything under them) swapped places.
    pub(super) fn exchange(&mut self, a: &str, b: &str) {
        // Through a name no path can have (stack paths hold no NUL).
        let tmp = format!("\0{a}");
        self.move_names(a, &tmp);
        self.move_names(b, a);
        self.move_names(&tmp, b);
    }

    /// Number of nodes the table holds (the root included).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.nodes.len()
    }

    fn unbind(&mut self, path: &str, id: u64) {
        self.by_path.remove(path);
        if let Some(n) = self.nodes.get_mut(&id) {
            n.paths.retain(|p| p != path);
            // No name left: the store may give the number to a new file while the kernel
            // still holds this one (open and unlinked), and the two must not share a node.
            if n.paths.is_empty()
                && let Some(k) = n.key
                && self.by_key.get(&k) == Some(&id)
            {
                self.by_key.remove(&k);
            }
        }
        self.drop_if_unused(id);
    }

    fn drop_if_unused(&mut self, id: u64) {
        if id == 1 {
            return;
        }
        if let Some(n) = self.nodes.get(&id)
            && n.lookups == 0
            && n.paths.is_empty()
        {
            if let Some(k) = n.key
                && self.by_key.get(&k) == Some(&id)
            {
                self.by_key.remove(&k);
            }
            self.nodes.remove(&id);
        }
    }

    /// `path` and the paths under it, with their node ids: the names from `path/` up to (not
    /// including) `path0` (`'0'` follows `'/'`) are exactly those starting with `path/`.
    fn at_or_under(&self, path: &str) -> Vec<(String, u64)> {
        let (from, to) = (format!("{path}/"), format!("{path}0"));
        self.by_path
            .get_key_value(path)
            .into_iter()
            .chain(self.by_path.range::<str, _>((Bound::Included(from.as_str()), Bound::Excluded(to.as_str()))))
            .map(|(p, i)| (p.clone(), *i))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_number_is_the_node_id_under_every_name_and_after_a_rename() {
        let mut t = Inodes::new();
        let a = t.node("a", (7, 100), true);
        assert_eq!(a, 100);
        assert_eq!(t.node("b", (7, 100), true), 100, "a hard link is the same node");
        t.rename("a", "dir/c");
        assert_eq!(t.node("dir/c", (7, 100), true), 100);
        assert_eq!(t.path(100).as_deref().map(|p| p == "b" || p == "dir/c"), Some(true));
    }

    #[test]
    fn colliding_numbers_of_two_stores_get_distinct_nodes() {
        let mut t = Inodes::new();
        let up = t.node("x", (1, 50), true);
        let low = t.node("y", (2, 50), true);
        assert_ne!(up, low);
        assert!(low >= PRIVATE);
        assert_eq!(t.node("y", (2, 50), false), low);
    }

    #[test]
    fn an_unlinked_node_the_kernel_holds_stays_until_forgotten_and_its_number_is_not_reused() {
        let mut t = Inodes::new();
        let a = t.node("f", (1, 9), true);
        t.remove("f");
        assert_eq!(t.path(a), None, "no name leads to it");
        assert_eq!(t.len(), 2, "still held by the kernel");
        // The host reuses inode 9 for a new file while the kernel still holds the old one.
        let b = t.node("g", (1, 9), true);
        assert!(b != a && b >= PRIVATE, "a new file under a reused number gets its own node");
        let c = t.node("h", (1, 10), true);
        t.forget(c, 1);
        assert_eq!(t.known("h"), Some(c), "named nodes stay after FORGET");
        t.remove("h");
        assert_eq!(t.len(), 3, "h forgotten and unnamed: dropped (root, a, b left)");
        t.forget(a, 1);
        assert_eq!(t.len(), 2, "the unlinked node is gone once forgotten; g is named");
        t.forget(b, 1);
        t.remove("g");
        assert_eq!(t.len(), 1, "only the root is left");
    }

    #[test]
    fn exchanged_names_swap_their_nodes_and_everything_under_them() {
        let mut t = Inodes::new();
        let (a, a1) = (t.node("a", (1, 10), true), t.node("a/x", (1, 11), true));
        let b = t.node("b", (1, 20), true);
        t.exchange("a", "b");
        assert_eq!((t.known("a"), t.known("b"), t.known("b/x")), (Some(b), Some(a), Some(a1)));
        assert_eq!(t.known("a/x"), None);
        assert_eq!(t.path(a1).as_deref(), Some("b/x"));
    }

    #[test]
    fn removing_or_renaming_a_directory_takes_exactly_the_names_under_it() {
        let mut t = Inodes::new();
        // Names that sort between "d/" and "d0" and around them: "d-x" and "d.x" sort
        // before "d/", "d0" and "dz" after, "d" itself is the directory.
        let names = ["d", "d/a", "d/b/c", "d-x", "d.x", "d0", "dz", "e/d/a"];
        for (i, n) in names.iter().enumerate() {
            t.node(n, (1, 10 + i as u64), true);
        }
        let mut under: Vec<String> = t.at_or_under("d").into_iter().map(|(p, _)| p).collect();
        under.sort();
        assert_eq!(under, ["d", "d/a", "d/b/c"]);
        t.rename("d", "n");
        for (old, new) in [("d", "n"), ("d/a", "n/a"), ("d/b/c", "n/b/c")] {
            assert_eq!(t.known(old), None, "{old}");
            assert!(t.known(new).is_some(), "{new}");
        }
        for kept in ["d-x", "d.x", "d0", "dz", "e/d/a"] {
            assert!(t.known(kept).is_some(), "{kept} stays");
        }
        t.remove("n");
        assert_eq!((t.known("n"), t.known("n/a"), t.known("n/b/c")), (None, None, None));
        assert!(t.known("dz").is_some() && t.known("e/d/a").is_some());
    }

    #[test]
    fn a_name_that_leads_elsewhere_now_is_rebound() {
        let mut t = Inodes::new();
        let a = t.node("f", (1, 9), false);
        let b = t.node("f", (1, 11), false);
        assert_ne!(a, b);
        assert_eq!(t.path(b).as_deref(), Some("f"));
        assert_eq!(t.len(), 2, "the old node had no reference and no name: dropped");
    }
}

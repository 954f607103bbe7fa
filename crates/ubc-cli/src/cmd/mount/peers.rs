//! The other mounts of the stack, as kernel caches to keep coherent. Each mount's kernel
//! keeps its own copy of a mapped file's pages (files are opened `FOPEN_DIRECT_IO`, so only
//! mappings are cached); a change made through one mount — a write, a truncation, an
//! `fallocate`, a `copy_file_range`, or a mapping's stores written back — is told to every
//! other mount that knows the file with `FUSE_NOTIFY_INVAL_INODE`, so its mappings fault
//! the new bytes in at their next touch: the cache manager's callback, with the kernel as
//! one more cache (the seeds' "cache manager", issue 18).
//!
//! What this does not give: memory shared between processes through a mapped file on two
//! mounts (SQLite's `-shm`). A store through one mount's mapping reaches the stack, and so
//! the other mounts, only when that kernel writes the page back (`msync`, or its own
//! writeback); until then the two mappings differ.
//!
//! Notifications go out from a thread of their own, never from a request handler: the
//! kernel may write a mapping's dirty pages back (a WRITE request to this daemon) before it
//! answers the notification, and a handler waiting for that answer could hold up the very
//! request thread the WRITE needs. No lock is held while a notification is sent.

use super::inodes::{Inodes, Key};
use fuser::{INodeNo, Notifier};
use std::collections::HashSet;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, RwLock};

/// One mount, as the others see it.
struct Peer {
    inodes: Arc<Mutex<Inodes>>,
    notifier: Notifier,
}

/// Every mount of the daemon, by the index it was given at `register`.
pub(super) struct Peers {
    mounts: RwLock<Vec<Option<Peer>>>,
    tx: Mutex<Sender<(usize, Key)>>,
}

impl Peers {
    /// No mounts yet; starts the thread that sends the notifications.
    pub(super) fn new() -> Arc<Peers> {
        let (tx, rx) = channel();
        let peers = Arc::new(Peers { mounts: RwLock::new(Vec::new()), tx: Mutex::new(tx) });
        let weak = Arc::downgrade(&peers);
        std::thread::Builder::new()
            .name("ubc-invalidate".into())
            .spawn(move || notify_loop(rx, weak))
            .expect("spawn the invalidation thread");
        peers
    }

    /// Mount `me` (its inode table and the notifier of its FUSE session).
    pub(super) fn register(&self, me: usize, inodes: Arc<Mutex<Inodes>>, notifier: Notifier) {
        let mut m = self.mounts.write().unwrap();
        if m.len() <= me {
            m.resize_with(me + 1, || None);
        }
        m[me] = Some(Peer { inodes, notifier });
    }

    /// The file `key` changed through mount `me`: the others drop their cached pages of it.
    pub(super) fn changed(&self, me: usize, key: Key) {
        if self.mounts.read().unwrap().iter().flatten().count() > 1 {
            let _ = self.tx.lock().unwrap().send((me, key));
        }
    }
}

fn notify_loop(rx: Receiver<(usize, Key)>, peers: std::sync::Weak<Peers>) {
    while let Ok(first) = rx.recv() {
        // A burst of writes to one file makes one notification per other mount.
        let mut batch: HashSet<(usize, Key)> = HashSet::from([first]);
        batch.extend(rx.try_iter());
        let Some(peers) = peers.upgrade() else { return };
        let targets: Vec<(Notifier, u64)> = {
            let mounts = peers.mounts.read().unwrap();
            batch
                .iter()
                .flat_map(|&(me, key)| {
                    mounts.iter().enumerate().filter(move |(i, _)| *i != me).filter_map(move |(_, p)| {
                        let p = p.as_ref()?;
                        let node = p.inodes.lock().unwrap().node_of(key)?;
                        Some((p.notifier.clone(), node))
                    })
                })
                .collect()
        };
        for (notifier, node) in targets {
            // Offset 0, length 0: every page of the file, and its attributes. ENOENT (the
            // kernel does not hold the node) and ENOTCONN (unmounted) are nothing to do.
            let _ = notifier.inval_inode(INodeNo(node), 0, 0);
        }
    }
}

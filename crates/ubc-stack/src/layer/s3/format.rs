//! The `s3` layer's tree object, byte by byte (documented in `docs/formats.md`, "The s3
//! layer"). All integers little-endian.
//!
//! ```text
//! header   magic "UBCS3T01" (8) | next_ino u64 | next_version u64 | chunk_size u32 | nodes u32
//! node     path_len u16 | path (UTF-8, no leading '/'; "" is the root)
//!          kind u8 | ino u64 | mode u32 | uid u32 | gid u32 | rdev u64
//!          mtime i64 | atime i64 | ctime i64          (ns since the Unix epoch)
//!          target_len u16 | target                   (symbolic links; 0 otherwise)
//!          size u64 | chunks u32                      (regular files; both 0 otherwise)
//!          chunks × (index u64 | version u64 | len u32)
//! trailer  crc32 u32 of everything before it
//! ```
//!
//! One node alone, as a record in etcd (`StoredNode::encode`, the `etcd=` option's
//! per-inode record): the node above without its path.
//!
//! ```text
//! record   magic "UBCS3N01" (8) | node without path_len and path | crc32 u32
//! ```

use super::super::Kind;
use std::collections::BTreeMap;
use std::io;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub(crate) const MAGIC: &[u8; 8] = b"UBCS3T01";
/// Magic of one node stored alone ([`StoredNode::encode`]).
#[cfg_attr(not(feature = "etcd"), allow(dead_code))] // records are etcd's (the tree has its own header)
pub(crate) const NODE_MAGIC: &[u8; 8] = b"UBCS3N01";

/// One stored chunk of a file: its version (part of its object's name) and how many bytes
/// the object holds (the rest of the chunk, up to the file's size, reads as zeros).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub(crate) version: u64,
    pub(crate) len: u32,
}

/// A node as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoredNode {
    pub(crate) kind: Kind,
    pub(crate) ino: u64,
    pub(crate) mode: u32,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) rdev: u64,
    pub(crate) mtime: SystemTime,
    pub(crate) atime: SystemTime,
    pub(crate) ctime: SystemTime,
    pub(crate) target: Option<String>,
    pub(crate) size: u64,
    pub(crate) chunks: BTreeMap<u64, Chunk>,
}

/// A whole tree as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoredTree {
    pub(crate) next_ino: u64,
    pub(crate) next_version: u64,
    pub(crate) chunk_size: u32,
    pub(crate) nodes: BTreeMap<String, StoredNode>,
}

pub(crate) fn kind_code(k: Kind) -> u8 {
    match k {
        Kind::File => 1,
        Kind::Dir => 2,
        Kind::Symlink => 3,
        Kind::Fifo => 4,
        Kind::Socket => 5,
        Kind::CharDevice => 6,
        Kind::BlockDevice => 7,
    }
}

pub(crate) fn kind_of(c: u8) -> Option<Kind> {
    Some(match c {
        1 => Kind::File,
        2 => Kind::Dir,
        3 => Kind::Symlink,
        4 => Kind::Fifo,
        5 => Kind::Socket,
        6 => Kind::CharDevice,
        7 => Kind::BlockDevice,
        _ => return None,
    })
}

fn ns(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos().min(i64::MAX as u128) as i64,
        Err(e) => -(e.duration().as_nanos().min(i64::MAX as u128) as i64),
    }
}

fn time(ns: i64) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}

impl StoredTree {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.nodes.len() * 96);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&self.next_ino.to_le_bytes());
        b.extend_from_slice(&self.next_version.to_le_bytes());
        b.extend_from_slice(&self.chunk_size.to_le_bytes());
        b.extend_from_slice(&(self.nodes.len() as u32).to_le_bytes());
        for (path, n) in &self.nodes {
            b.extend_from_slice(&(path.len() as u16).to_le_bytes());
            b.extend_from_slice(path.as_bytes());
            n.put_body(&mut b);
        }
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8]) -> io::Result<StoredTree> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("s3 tree object: {what}"));
        if b.len() < 36 || &b[..8] != MAGIC {
            return Err(bad("not a ubc s3 tree (bad magic)"));
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(bad("checksum mismatch"));
        }
        let mut r = Reader { b: body, at: 8, what: "s3 tree object" };
        let next_ino = r.u64()?;
        let next_version = r.u64()?;
        let chunk_size = r.u32()?;
        let count = r.u32()?;
        let mut nodes = BTreeMap::new();
        for _ in 0..count {
            let plen = r.u16()? as usize;
            let path = String::from_utf8(r.bytes(plen)?.to_vec()).map_err(|_| bad("a path is not UTF-8"))?;
            nodes.insert(path, StoredNode::read_body(&mut r)?);
        }
        if r.at != body.len() {
            return Err(bad("trailing bytes"));
        }
        if !nodes.get("").is_some_and(|n| n.kind == Kind::Dir) {
            return Err(bad("no root directory"));
        }
        Ok(StoredTree { next_ino, next_version, chunk_size, nodes })
    }
}

impl StoredNode {
    /// The node's fields after the path, as both the tree and the record store them.
    fn put_body(&self, b: &mut Vec<u8>) {
        b.push(kind_code(self.kind));
        b.extend_from_slice(&self.ino.to_le_bytes());
        b.extend_from_slice(&self.mode.to_le_bytes());
        b.extend_from_slice(&self.uid.to_le_bytes());
        b.extend_from_slice(&self.gid.to_le_bytes());
        b.extend_from_slice(&self.rdev.to_le_bytes());
        for t in [self.mtime, self.atime, self.ctime] {
            b.extend_from_slice(&ns(t).to_le_bytes());
        }
        let target = self.target.as_deref().unwrap_or("");
        b.extend_from_slice(&(target.len() as u16).to_le_bytes());
        b.extend_from_slice(target.as_bytes());
        b.extend_from_slice(&self.size.to_le_bytes());
        b.extend_from_slice(&(self.chunks.len() as u32).to_le_bytes());
        for (i, c) in &self.chunks {
            b.extend_from_slice(&i.to_le_bytes());
            b.extend_from_slice(&c.version.to_le_bytes());
            b.extend_from_slice(&c.len.to_le_bytes());
        }
    }

    /// Read what [`StoredNode::put_body`] wrote.
    fn read_body(r: &mut Reader<'_>) -> io::Result<StoredNode> {
        let kind = kind_of(r.u8()?).ok_or_else(|| r.bad("unknown kind"))?;
        let (ino, mode, uid, gid, rdev) = (r.u64()?, r.u32()?, r.u32()?, r.u32()?, r.u64()?);
        let (mtime, atime, ctime) = (time(r.i64()?), time(r.i64()?), time(r.i64()?));
        let tlen = r.u16()? as usize;
        let target = String::from_utf8(r.bytes(tlen)?.to_vec()).map_err(|_| r.bad("a target is not UTF-8"))?;
        let size = r.u64()?;
        let nchunks = r.u32()?;
        let mut chunks = BTreeMap::new();
        for _ in 0..nchunks {
            let i = r.u64()?;
            chunks.insert(i, Chunk { version: r.u64()?, len: r.u32()? });
        }
        let target = (kind == Kind::Symlink).then_some(target);
        Ok(StoredNode { kind, ino, mode, uid, gid, rdev, mtime, atime, ctime, target, size, chunks })
    }

    /// This node alone, as a standalone record (etcd's per-inode record): magic
    /// `UBCS3N01`, the node as in a tree but without its path, CRC-32 of all before.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(96 + self.chunks.len() * 20);
        b.extend_from_slice(NODE_MAGIC);
        self.put_body(&mut b);
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Read a record [`StoredNode::encode`] wrote; a damaged or truncated one is refused.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn decode(b: &[u8]) -> io::Result<StoredNode> {
        let what = "s3 node record";
        let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, format!("{what}: {m}"));
        // magic, the smallest node (no target, no chunks), crc
        if b.len() < 8 + 67 + 4 || &b[..8] != NODE_MAGIC {
            return Err(bad("not a ubc s3 node record (bad magic or too short)"));
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(bad("checksum mismatch"));
        }
        let mut r = Reader { b: body, at: 8, what };
        let n = StoredNode::read_body(&mut r)?;
        if r.at != body.len() {
            return Err(bad("trailing bytes"));
        }
        Ok(n)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    /// What is read, for errors.
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn bad(&self, m: &str) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, format!("{}: {m}", self.what))
    }
    fn bytes(&mut self, n: usize) -> io::Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| self.bad("truncated"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.bytes(1)?[0])
    }
    fn u16(&mut self) -> io::Result<u16> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().expect("2 bytes")))
    }
    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8 bytes")))
    }
    fn i64(&mut self) -> io::Result<i64> {
        Ok(i64::from_le_bytes(self.bytes(8)?.try_into().expect("8 bytes")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_round_trips_and_damage_is_refused() {
        let mut nodes = BTreeMap::new();
        let t0 = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let node = |kind, ino| StoredNode {
            kind,
            ino,
            mode: 0o644,
            uid: 1000,
            gid: 100,
            rdev: 0,
            mtime: t0,
            atime: t0,
            ctime: t0,
            target: None,
            size: 0,
            chunks: BTreeMap::new(),
        };
        nodes.insert(String::new(), node(Kind::Dir, 1));
        let mut f = node(Kind::File, 7);
        f.size = 3 << 20;
        f.chunks.insert(0, Chunk { version: 9, len: 1 << 20 });
        f.chunks.insert(2, Chunk { version: 12, len: 77 });
        nodes.insert("d/f".into(), f);
        let mut l = node(Kind::Symlink, 8);
        l.target = Some("../x".into());
        nodes.insert("d/l".into(), l);
        nodes.insert("d".into(), node(Kind::Dir, 6));
        let t = StoredTree { next_ino: 9, next_version: 13, chunk_size: 1 << 20, nodes };
        let b = t.encode();
        assert_eq!(StoredTree::decode(&b).unwrap(), t);
        for at in [0, 9, 40, b.len() / 2, b.len() - 1] {
            let mut d = b.clone();
            d[at] ^= 0x40;
            assert!(StoredTree::decode(&d).is_err(), "damage at {at} accepted");
        }
        assert!(StoredTree::decode(&b[..b.len() - 5]).is_err());
    }

    #[test]
    fn a_node_record_round_trips_and_damage_is_refused() {
        let t0 = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let before = UNIX_EPOCH - Duration::from_nanos(5_000_000_007);
        let mut f = StoredNode {
            kind: Kind::File,
            ino: 7,
            mode: 0o4755,
            uid: 1000,
            gid: 100,
            rdev: 0,
            mtime: t0,
            atime: before,
            ctime: t0,
            target: None,
            size: 3 << 20,
            chunks: BTreeMap::new(),
        };
        f.chunks.insert(0, Chunk { version: 9, len: 1 << 20 });
        f.chunks.insert(2, Chunk { version: 12, len: 77 });
        let mut l = f.clone();
        (l.kind, l.ino, l.target, l.size, l.chunks) = (Kind::Symlink, 8, Some("../x".into()), 0, BTreeMap::new());
        let mut d = f.clone();
        (d.kind, d.ino, d.rdev, d.size, d.chunks) = (Kind::CharDevice, 9, 0x0103, 0, BTreeMap::new());
        for n in [f, l, d] {
            let b = n.encode();
            assert_eq!(&b[..8], NODE_MAGIC);
            assert_eq!(StoredNode::decode(&b).unwrap(), n);
            for at in [0, 8, 9, 40, b.len() / 2, b.len() - 5, b.len() - 1] {
                let mut x = b.clone();
                x[at] ^= 0x40;
                assert!(StoredNode::decode(&x).is_err(), "damage at {at} accepted");
            }
            assert!(StoredNode::decode(&b[..b.len() - 1]).is_err());
            assert!(StoredNode::decode(&b[..b.len() - 5]).is_err());
            // A body that is whole but followed by extra bytes (with a valid CRC) is refused.
            let mut long = b[..b.len() - 4].to_vec();
            long.push(0);
            let crc = crc32fast::hash(&long);
            long.extend_from_slice(&crc.to_le_bytes());
            assert!(StoredNode::decode(&long).is_err());
        }
        // A tree is not a record.
        let t = StoredTree { next_ino: 2, next_version: 1, chunk_size: 1 << 20, nodes: BTreeMap::new() };
        assert!(StoredNode::decode(&t.encode()).is_err());
    }
}

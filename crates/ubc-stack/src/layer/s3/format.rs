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

use super::super::Kind;
use std::collections::BTreeMap;
use std::io;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub(crate) const MAGIC: &[u8; 8] = b"UBCS3T01";

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

fn kind_code(k: Kind) -> u8 {
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

fn kind_of(c: u8) -> Option<Kind> {
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
            b.push(kind_code(n.kind));
            b.extend_from_slice(&n.ino.to_le_bytes());
            b.extend_from_slice(&n.mode.to_le_bytes());
            b.extend_from_slice(&n.uid.to_le_bytes());
            b.extend_from_slice(&n.gid.to_le_bytes());
            b.extend_from_slice(&n.rdev.to_le_bytes());
            for t in [n.mtime, n.atime, n.ctime] {
                b.extend_from_slice(&ns(t).to_le_bytes());
            }
            let target = n.target.as_deref().unwrap_or("");
            b.extend_from_slice(&(target.len() as u16).to_le_bytes());
            b.extend_from_slice(target.as_bytes());
            b.extend_from_slice(&n.size.to_le_bytes());
            b.extend_from_slice(&(n.chunks.len() as u32).to_le_bytes());
            for (i, c) in &n.chunks {
                b.extend_from_slice(&i.to_le_bytes());
                b.extend_from_slice(&c.version.to_le_bytes());
                b.extend_from_slice(&c.len.to_le_bytes());
            }
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
        let mut r = Reader { b: body, at: 8 };
        let next_ino = r.u64()?;
        let next_version = r.u64()?;
        let chunk_size = r.u32()?;
        let count = r.u32()?;
        let mut nodes = BTreeMap::new();
        for _ in 0..count {
            let plen = r.u16()? as usize;
            let path = String::from_utf8(r.bytes(plen)?.to_vec()).map_err(|_| bad("a path is not UTF-8"))?;
            let kind = kind_of(r.u8()?).ok_or_else(|| bad("unknown kind"))?;
            let (ino, mode, uid, gid, rdev) = (r.u64()?, r.u32()?, r.u32()?, r.u32()?, r.u64()?);
            let (mtime, atime, ctime) = (time(r.i64()?), time(r.i64()?), time(r.i64()?));
            let tlen = r.u16()? as usize;
            let target = String::from_utf8(r.bytes(tlen)?.to_vec()).map_err(|_| bad("a target is not UTF-8"))?;
            let size = r.u64()?;
            let nchunks = r.u32()?;
            let mut chunks = BTreeMap::new();
            for _ in 0..nchunks {
                let i = r.u64()?;
                chunks.insert(i, Chunk { version: r.u64()?, len: r.u32()? });
            }
            let target = (kind == Kind::Symlink).then_some(target);
            nodes.insert(
                path,
                StoredNode { kind, ino, mode, uid, gid, rdev, mtime, atime, ctime, target, size, chunks },
            );
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

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> io::Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "s3 tree object: truncated"))?;
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
}

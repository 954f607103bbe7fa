//! The `s3` layer's tree object, byte by byte (documented in `docs/formats.md`, "The s3
//! layer"). All integers little-endian.
//!
//! ```text
//! header   magic "UBCS3T02" (8) | next_ino u64 | next_version u64 | chunk_size u32 | nodes u32
//! node     path_len u16 | path (UTF-8, no leading '/'; "" is the root)
//!          kind u8 | ino u64 | mode u32 | uid u32 | gid u32 | rdev u64
//!          mtime i64 | atime i64 | ctime i64          (ns since the Unix epoch)
//!          target_len u16 | target                   (symbolic links; 0 otherwise)
//!          size u64 | chunks u32                      (regular files; both 0 otherwise)
//!          chunks × chunk entry
//! chunk    index u64 | version u64 | base_len u32 | len u32 | patches u16
//!          patches × (version u64 | extents u16 | extents × (offset u32 | len u32))
//! trailer  crc32 u32 of everything before it
//! ```
//!
//! One node alone, as a record in etcd (`StoredNode::encode`, the `etcd=` option's
//! per-inode record): the node above without its path.
//!
//! ```text
//! record   magic "UBCS3N02" (8) | node without path_len and path | crc32 u32
//! ```
//!
//! The first format (`UBCS3T01`, `UBCS3N01`: a chunk entry was `index u64 | version u64 |
//! len u32`, a base object and no patches) is still read; only the second is written.

use super::super::Kind;
use std::collections::BTreeMap;
use std::io;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub(crate) const MAGIC: &[u8; 8] = b"UBCS3T02";
/// The first format's tree (read, never written): chunk entries without patches.
const MAGIC_V1: &[u8; 8] = b"UBCS3T01";
/// Magic of one node stored alone ([`StoredNode::encode`]).
#[cfg_attr(not(feature = "etcd"), allow(dead_code))] // records are etcd's (the tree has its own header)
pub(crate) const NODE_MAGIC: &[u8; 8] = b"UBCS3N03";
/// The second format's record: a directory's `size` is 0, not its subdirectories' count.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
const NODE_MAGIC_V2: &[u8; 8] = b"UBCS3N02";
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
const NODE_MAGIC_V1: &[u8; 8] = b"UBCS3N01";
/// A directory record's `size` when the number of its subdirectories is not known (a
/// record of the formats before `UBCS3N03`): its link count is counted from its entries.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub(crate) const SUBDIRS_UNKNOWN: u64 = u64::MAX;

/// One stored chunk of a file: its version (part of its object's name) and how many bytes
/// the object holds (the rest of the chunk, up to the file's size, reads as zeros).
/// `len` bytes at `offset` of a chunk, stored in a patch object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Extent {
    pub(crate) offset: u32,
    pub(crate) len: u32,
}

/// Bytes written into a chunk after its base was stored, uploaded as one small object (its
/// extents' bytes one after another) instead of a new version of the whole chunk — JuiceFS's
/// slices: a random 4 KiB write uploads 4 KiB, not its chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Patch {
    pub(crate) version: u64,
    pub(crate) extents: Vec<Extent>,
}

impl Patch {
    /// Bytes of the patch object.
    pub(crate) fn bytes(&self) -> u64 {
        self.extents.iter().map(|e| e.len as u64).sum()
    }
}

/// A stored chunk: a base object (or none) and the patches laid over it, in order. Its bytes:
/// zeros of `len`, the base's `base_len` bytes at its start, then each patch's extents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// The base object's version; 0: no base object (zeros under the patches).
    pub(crate) version: u64,
    /// Bytes of the base object (0 without one).
    pub(crate) base_len: u32,
    /// Bytes the chunk defines from its start (≥ `base_len` and every extent's end); past
    /// them, zeros up to the file's size.
    pub(crate) len: u32,
    pub(crate) patches: Vec<Patch>,
}

impl Chunk {
    /// A chunk stored as one object of `len` bytes.
    pub(crate) fn whole(version: u64, len: u32) -> Chunk {
        Chunk { version, base_len: len, len, patches: Vec::new() }
    }

    /// The versions of the chunk's objects: its base (if any), then its patches.
    pub(crate) fn objects(&self) -> impl Iterator<Item = u64> + '_ {
        (self.version != 0).then_some(self.version).into_iter().chain(self.patches.iter().map(|p| p.version))
    }

    /// The version naming these bytes (the newest object's): a chunk's bytes change only
    /// with a new object.
    pub(crate) fn newest(&self) -> u64 {
        self.patches.last().map_or(self.version, |p| p.version)
    }

    /// Bytes of its patch objects.
    pub(crate) fn patch_bytes(&self) -> u64 {
        self.patches.iter().map(Patch::bytes).sum()
    }
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
        if b.len() < 36 || (&b[..8] != MAGIC && &b[..8] != MAGIC_V1) {
            return Err(bad("not a ubc s3 tree (bad magic)"));
        }
        let v1 = &b[..8] == MAGIC_V1;
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
            nodes.insert(path, StoredNode::read_body(&mut r, v1)?);
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
            b.extend_from_slice(&c.base_len.to_le_bytes());
            b.extend_from_slice(&c.len.to_le_bytes());
            b.extend_from_slice(&(c.patches.len() as u16).to_le_bytes());
            for p in &c.patches {
                b.extend_from_slice(&p.version.to_le_bytes());
                b.extend_from_slice(&(p.extents.len() as u16).to_le_bytes());
                for e in &p.extents {
                    b.extend_from_slice(&e.offset.to_le_bytes());
                    b.extend_from_slice(&e.len.to_le_bytes());
                }
            }
        }
    }

    /// Read what [`StoredNode::put_body`] wrote.
    /// `v1`: the first format's chunk entries (a base object, no patches).
    fn read_body(r: &mut Reader<'_>, v1: bool) -> io::Result<StoredNode> {
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
            let c = if v1 { Chunk::whole(r.u64()?, r.u32()?) } else { read_chunk(r)? };
            chunks.insert(i, c);
        }
        let target = (kind == Kind::Symlink).then_some(target);
        Ok(StoredNode { kind, ino, mode, uid, gid, rdev, mtime, atime, ctime, target, size, chunks })
    }

    /// This node alone, as a standalone record (etcd's per-inode record): magic
    /// `UBCS3N03`, the node as in a tree but without its path (a directory's `size` is
    /// the number of its subdirectories, or `SUBDIRS_UNKNOWN`), CRC-32 of all before.
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
        let magic = &b[..8.min(b.len())];
        if b.len() < 8 + 67 + 4 || (magic != NODE_MAGIC && magic != NODE_MAGIC_V2 && magic != NODE_MAGIC_V1) {
            return Err(bad("not a ubc s3 node record (bad magic or too short)"));
        }
        let v1 = magic == NODE_MAGIC_V1;
        let counted = magic == NODE_MAGIC;
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(bad("checksum mismatch"));
        }
        let mut r = Reader { b: body, at: 8, what };
        let mut n = StoredNode::read_body(&mut r, v1)?;
        if r.at != body.len() {
            return Err(bad("trailing bytes"));
        }
        if n.kind == Kind::Dir && !counted {
            n.size = SUBDIRS_UNKNOWN;
        }
        Ok(n)
    }
}

/// A chunk entry after its index. Refused: a base length without a base, a length short of
/// the base or of an extent's end, an empty extent.
fn read_chunk(r: &mut Reader<'_>) -> io::Result<Chunk> {
    let (version, base_len, len) = (r.u64()?, r.u32()?, r.u32()?);
    if (version == 0 && base_len != 0) || base_len > len {
        return Err(r.bad("a chunk's base is longer than the chunk, or has no object"));
    }
    let n = r.u16()?;
    let mut patches = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let pv = r.u64()?;
        let ne = r.u16()?;
        let mut extents = Vec::with_capacity(ne as usize);
        for _ in 0..ne {
            let (offset, elen) = (r.u32()?, r.u32()?);
            if elen == 0 || offset.checked_add(elen).is_none_or(|e| e > len) {
                return Err(r.bad("a patch's extent is empty or past its chunk"));
            }
            extents.push(Extent { offset, len: elen });
        }
        patches.push(Patch { version: pv, extents });
    }
    Ok(Chunk { version, base_len, len, patches })
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
        f.chunks.insert(0, Chunk::whole(9, 1 << 20));
        f.chunks.insert(2, Chunk::whole(12, 77));
        f.chunks.insert(
            3,
            Chunk {
                version: 0,
                base_len: 0,
                len: 9000,
                patches: vec![Patch { version: 13, extents: vec![Extent { offset: 4096, len: 4904 }] }],
            },
        );
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
        f.chunks.insert(0, Chunk::whole(9, 1 << 20));
        f.chunks.insert(
            2,
            Chunk {
                version: 12,
                base_len: 77,
                len: 8192,
                patches: vec![
                    Patch {
                        version: 14,
                        extents: vec![Extent { offset: 0, len: 10 }, Extent { offset: 4096, len: 4096 }],
                    },
                    Patch { version: 15, extents: vec![Extent { offset: 5, len: 1 }] },
                ],
            },
        );
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

    /// A record of the first format (chunk entries `index | version | len`), as a bucket or
    /// an etcd written before patches holds them, reads as chunks with a base and no patch.
    #[test]
    fn records_and_trees_of_the_first_format_are_read() {
        let t0 = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let mut body = vec![1u8]; // a file
        body.extend_from_slice(&7u64.to_le_bytes());
        for v in [0o644u32, 1000, 100] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        body.extend_from_slice(&0u64.to_le_bytes()); // rdev
        for _ in 0..3 {
            body.extend_from_slice(&ns(t0).to_le_bytes());
        }
        body.extend_from_slice(&0u16.to_le_bytes()); // no target
        body.extend_from_slice(&(70_000u64).to_le_bytes());
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(&1u64.to_le_bytes()); // index 1
        body.extend_from_slice(&0x55u64.to_le_bytes()); // version
        body.extend_from_slice(&4464u32.to_le_bytes()); // len
        let mut rec = NODE_MAGIC_V1.to_vec();
        rec.extend_from_slice(&body);
        let crc = crc32fast::hash(&rec);
        rec.extend_from_slice(&crc.to_le_bytes());
        let n = StoredNode::decode(&rec).unwrap();
        assert_eq!((n.ino, n.size), (7, 70_000));
        assert_eq!(n.chunks.get(&1), Some(&Chunk::whole(0x55, 4464)));
        // The same node in a tree of the first format.
        let mut tree = MAGIC_V1.to_vec();
        for v in [3u64, 0x56] {
            tree.extend_from_slice(&v.to_le_bytes());
        }
        tree.extend_from_slice(&(64u32 << 10).to_le_bytes());
        tree.extend_from_slice(&2u32.to_le_bytes());
        let root = StoredNode { kind: Kind::Dir, ino: 1, size: 0, chunks: BTreeMap::new(), ..n.clone() };
        tree.extend_from_slice(&0u16.to_le_bytes());
        let mut rb = Vec::new();
        root.put_body(&mut rb); // a directory's body is the same in both formats
        tree.extend_from_slice(&rb);
        tree.extend_from_slice(&1u16.to_le_bytes());
        tree.push(b'f');
        tree.extend_from_slice(&body);
        let crc = crc32fast::hash(&tree);
        tree.extend_from_slice(&crc.to_le_bytes());
        let t = StoredTree::decode(&tree).unwrap();
        assert_eq!(t.nodes.get("f"), Some(&n));
        // Written again, it is the second format.
        assert_eq!(&n.encode()[..8], NODE_MAGIC);
    }

    /// A chunk entry whose lengths contradict each other is refused, not read as zeros.
    #[test]
    fn a_chunk_entry_that_contradicts_itself_is_refused() {
        let t0 = UNIX_EPOCH;
        let node = |c: Chunk| {
            let mut chunks = BTreeMap::new();
            chunks.insert(0, c);
            StoredNode {
                kind: Kind::File,
                ino: 2,
                mode: 0o600,
                uid: 0,
                gid: 0,
                rdev: 0,
                mtime: t0,
                atime: t0,
                ctime: t0,
                target: None,
                size: 1 << 20,
                chunks,
            }
        };
        let patch = |offset, len| vec![Patch { version: 3, extents: vec![Extent { offset, len }] }];
        for (what, c) in [
            ("a base length without a base", Chunk { version: 0, base_len: 5, len: 5, patches: vec![] }),
            ("a base past the chunk's length", Chunk { version: 2, base_len: 9, len: 5, patches: vec![] }),
            ("an extent past the chunk's length", Chunk { version: 2, base_len: 5, len: 5, patches: patch(4, 2) }),
            ("an empty extent", Chunk { version: 2, base_len: 5, len: 5, patches: patch(1, 0) }),
            ("an extent whose end overflows", Chunk { version: 2, base_len: 5, len: 5, patches: patch(u32::MAX, 2) }),
        ] {
            assert!(StoredNode::decode(&node(c).encode()).is_err(), "{what} accepted");
        }
        let good = Chunk { version: 2, base_len: 5, len: 6, patches: patch(4, 2) };
        assert!(StoredNode::decode(&node(good).encode()).is_ok());
    }
}

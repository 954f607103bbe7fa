//! The on-disk format of the zstd layer: superblock slots and the index (see
//! `docs/formats.md`, "zstd layer", for the byte-by-byte description). Pure encode/decode and
//! validation; no I/O happens here, so every check is testable on plain byte slices.
//!
//! Decoding never trusts a field before it is checked: every length and offset read from the
//! lower file is bounded against the lower file's length and against each other before it is
//! used to size a buffer or index a slice, so malformed input is an `InvalidData` error and
//! never a panic or a huge allocation.

use std::io;

/// Size of one superblock slot. Two slots, at 0 and `SLOT_SIZE`.
pub(crate) const SLOT_SIZE: u64 = 4096;
/// First byte of the data region (after both slots).
pub(crate) const DATA_START: u64 = 2 * SLOT_SIZE;
/// Allocation granularity in the data region: every extent starts on a multiple of this.
pub(crate) const ALIGN: u64 = 512;
pub(crate) const SB_MAGIC: [u8; 8] = *b"UBCZSTD1";
pub(crate) const IDX_MAGIC: [u8; 8] = *b"UBCZIDX1";
pub(crate) const VERSION: u32 = 1;
/// Bytes of a slot covered by the superblock checksum (the checksum itself follows).
pub(crate) const SB_BODY: usize = 64;
/// Encoded superblock length (body + crc).
pub(crate) const SB_LEN: usize = SB_BODY + 4;
pub(crate) const IDX_HEADER: usize = 24;
pub(crate) const IDX_ENTRY: usize = 32;
/// Index entry flag: the chunk is stored uncompressed.
pub(crate) const FLAG_RAW: u32 = 1;
/// Superblock flag: a *published* commit, written without waiting for the device (at a
/// close): its index and extents may not all have reached it. The other slot then holds the
/// last durable commit, whose extents are kept until the next durable one, and a reader
/// that finds this commit's index damaged uses that one.
pub(crate) const SB_FLAG_PUBLISHED: u32 = 1;
pub(crate) const MIN_CHUNK_SHIFT: u32 = 12;
pub(crate) const MAX_CHUNK_SHIFT: u32 = 24;
/// Largest logical length accepted (the cache's offsets stay far below this).
pub(crate) const MAX_LOGICAL: u64 = 1 << 62;

/// Where one chunk's stored bytes are in the lower file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Extent {
    /// Offset in the lower file (a multiple of [`ALIGN`], >= [`DATA_START`]).
    pub off: u64,
    /// Stored (compressed or raw) byte count.
    pub stored: u32,
    /// Uncompressed byte count: the chunk's bytes past it are zero.
    pub data_len: u32,
    /// CRC-32 (IEEE) of the stored bytes.
    pub crc: u32,
    /// Stored uncompressed (`stored == data_len`).
    pub raw: bool,
}

impl Extent {
    /// Bytes the extent occupies in the lower file (rounded up to [`ALIGN`]).
    pub fn alloc_len(&self) -> u64 {
        align_up(self.stored as u64)
    }
}

pub(crate) fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

/// One committed superblock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Superblock {
    pub chunk_shift: u32,
    pub generation: u64,
    pub logical_len: u64,
    pub index_off: u64,
    pub index_len: u64,
    pub index_crc: u32,
    /// Written without waiting for the device ([`SB_FLAG_PUBLISHED`]).
    pub published: bool,
}

/// What a superblock slot holds.
#[derive(Debug)]
pub(crate) enum Slot {
    /// All zero: never written.
    Empty,
    Valid(Superblock),
    /// Written but unusable (the reason).
    Bad(String),
}

pub(crate) fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("zstd layer: {}", msg.into()))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Encode a superblock into a whole slot (`SLOT_SIZE` bytes, zero padded).
pub(crate) fn encode_superblock(sb: &Superblock) -> Vec<u8> {
    let mut b = vec![0u8; SLOT_SIZE as usize];
    b[0..8].copy_from_slice(&SB_MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&sb.chunk_shift.to_le_bytes());
    b[16..24].copy_from_slice(&sb.generation.to_le_bytes());
    b[24..32].copy_from_slice(&sb.logical_len.to_le_bytes());
    b[32..40].copy_from_slice(&sb.index_off.to_le_bytes());
    b[40..48].copy_from_slice(&sb.index_len.to_le_bytes());
    b[48..52].copy_from_slice(&sb.index_crc.to_le_bytes());
    b[52..56].copy_from_slice(&(if sb.published { SB_FLAG_PUBLISHED } else { 0 }).to_le_bytes());
    // 56..64 reserved (0).
    let crc = crc32fast::hash(&b[..SB_BODY]);
    b[SB_BODY..SB_LEN].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Decode slot `slot` (0 or 1) from its first `SB_LEN` bytes (zero padded if the lower file
/// is shorter).
pub(crate) fn decode_superblock(b: &[u8], slot: u64) -> Slot {
    let b = &b[..SB_LEN];
    if b.iter().all(|&x| x == 0) {
        return Slot::Empty;
    }
    if b[0..8] != SB_MAGIC {
        return Slot::Bad("bad magic (not a zstd layer file)".into());
    }
    let crc = u32_at(b, SB_BODY);
    if crc32fast::hash(&b[..SB_BODY]) != crc {
        return Slot::Bad("checksum mismatch".into());
    }
    let version = u32_at(b, 8);
    if version != VERSION {
        return Slot::Bad(format!("unsupported version {version}"));
    }
    let sb = Superblock {
        chunk_shift: u32_at(b, 12),
        generation: u64_at(b, 16),
        logical_len: u64_at(b, 24),
        index_off: u64_at(b, 32),
        index_len: u64_at(b, 40),
        index_crc: u32_at(b, 48),
        published: u32_at(b, 52) & SB_FLAG_PUBLISHED != 0,
    };
    let (flags, reserved) = (u32_at(b, 52), u64_at(b, 56));
    if flags & !SB_FLAG_PUBLISHED != 0 || reserved != 0 {
        return Slot::Bad(format!("unknown flags {flags:#x} / reserved {reserved:#x}"));
    }
    if !(MIN_CHUNK_SHIFT..=MAX_CHUNK_SHIFT).contains(&sb.chunk_shift) {
        return Slot::Bad(format!("chunk shift {} out of range {MIN_CHUNK_SHIFT}..={MAX_CHUNK_SHIFT}", sb.chunk_shift));
    }
    if sb.generation == 0 || sb.generation % 2 != slot {
        return Slot::Bad(format!("generation {} does not belong in slot {slot}", sb.generation));
    }
    if sb.logical_len > MAX_LOGICAL {
        return Slot::Bad(format!("logical length {} too large", sb.logical_len));
    }
    if sb.index_off < DATA_START || !sb.index_off.is_multiple_of(ALIGN) {
        return Slot::Bad(format!("index offset {} not an aligned offset in the data region", sb.index_off));
    }
    let body = sb.index_len.checked_sub(IDX_HEADER as u64);
    if body.is_none_or(|n| !n.is_multiple_of(IDX_ENTRY as u64)) || sb.index_off.checked_add(sb.index_len).is_none() {
        return Slot::Bad(format!("index length {} malformed", sb.index_len));
    }
    Slot::Valid(sb)
}

/// The valid superblocks of both slots, newest first: the first is the one to use, the
/// second the one to fall back to (see `CompressPager::load`). Empty: never committed (both
/// slots empty). A bad slot next to a valid one is ignored (a torn write of the newer slot:
/// the older is the last commit); both bad, or one bad and one empty, is an error.
pub(crate) fn superblocks(header: &[u8]) -> io::Result<Vec<Superblock>> {
    let a = decode_superblock(&header[0..SB_LEN], 0);
    let b = decode_superblock(&header[SLOT_SIZE as usize..SLOT_SIZE as usize + SB_LEN], 1);
    match (&a, &b) {
        (Slot::Valid(x), Slot::Valid(y)) => Ok(if x.generation > y.generation { vec![*x, *y] } else { vec![*y, *x] }),
        (Slot::Valid(x), _) | (_, Slot::Valid(x)) => Ok(vec![*x]),
        (Slot::Empty, Slot::Empty) => Ok(Vec::new()),
        _ => {
            let d = |s: &Slot| match s {
                Slot::Empty => "empty".to_string(),
                Slot::Bad(why) => why.clone(),
                Slot::Valid(_) => unreachable!(),
            };
            Err(invalid(format!(
                "no valid superblock: slot 0 (offset 0): {}; slot 1 (offset {SLOT_SIZE}): {}",
                d(&a),
                d(&b)
            )))
        }
    }
}

/// Encode the index for `generation`: header then entries in ascending chunk order.
pub(crate) fn encode_index<'a>(generation: u64, entries: impl ExactSizeIterator<Item = (u64, &'a Extent)>) -> Vec<u8> {
    let mut b = Vec::with_capacity(IDX_HEADER + entries.len() * IDX_ENTRY);
    b.extend_from_slice(&IDX_MAGIC);
    b.extend_from_slice(&generation.to_le_bytes());
    b.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for (chunk, e) in entries {
        b.extend_from_slice(&chunk.to_le_bytes());
        b.extend_from_slice(&e.off.to_le_bytes());
        b.extend_from_slice(&e.stored.to_le_bytes());
        b.extend_from_slice(&e.data_len.to_le_bytes());
        b.extend_from_slice(&e.crc.to_le_bytes());
        b.extend_from_slice(&(if e.raw { FLAG_RAW } else { 0 }).to_le_bytes());
    }
    b
}

/// Decodes and validates an index as it is read, piece by piece (see [`decode_index`] for
/// the checks). Nothing is trusted before it is checked: the header's magic, generation and
/// count come first, then each entry as it arrives, then the checksum over everything and
/// the overlap check. So a superblock claiming a giant index (a sparse lower file, a
/// forged checksum) fails at the first entry that is not one, after reading a few bytes,
/// and memory grows only with entries that passed their checks — never with a length
/// read from the file.
pub(crate) struct IndexReader<'a> {
    sb: &'a Superblock,
    lower_len: u64,
    crc: crc32fast::Hasher,
    /// Entries the header announces, and how many were decoded so far.
    count: u64,
    seen: u64,
    prev: Option<u64>,
    nchunks: u64,
    max_stored: u64,
    out: Vec<(u64, Extent)>,
}

impl<'a> IndexReader<'a> {
    /// Check the index header (its first [`IDX_HEADER`] bytes).
    pub fn new(header: &[u8], sb: &'a Superblock, lower_len: u64) -> io::Result<IndexReader<'a>> {
        let at = sb.index_off;
        let b = &header[..IDX_HEADER];
        if b[0..8] != IDX_MAGIC {
            return Err(invalid(format!("index at lower offset {at}: bad magic")));
        }
        let generation = u64_at(b, 8);
        if generation != sb.generation {
            return Err(invalid(format!(
                "index at lower offset {at}: generation {generation}, superblock says {}",
                sb.generation
            )));
        }
        let count = u64_at(b, 16);
        let n = (sb.index_len - IDX_HEADER as u64) / IDX_ENTRY as u64;
        if count != n {
            return Err(invalid(format!("index at lower offset {at}: count {count} but room for {n} entries")));
        }
        let mut crc = crc32fast::Hasher::new();
        crc.update(b);
        let cs = 1u64 << sb.chunk_shift;
        Ok(IndexReader {
            sb,
            lower_len,
            crc,
            count,
            seen: 0,
            prev: None,
            nchunks: sb.logical_len.div_ceil(cs),
            max_stored: zstd::zstd_safe::compress_bound(cs as usize) as u64,
            out: Vec::new(),
        })
    }

    /// Entries still to come.
    pub fn remaining(&self) -> u64 {
        self.count - self.seen
    }

    /// Decode and check the next entries: `b` holds whole entries, at most `remaining()`.
    pub fn entries(&mut self, b: &[u8]) -> io::Result<()> {
        debug_assert!(b.len().is_multiple_of(IDX_ENTRY) && (b.len() / IDX_ENTRY) as u64 <= self.remaining());
        self.crc.update(b);
        let (sb, at) = (self.sb, self.sb.index_off);
        let cs = 1u64 << sb.chunk_shift;
        for e in b.chunks_exact(IDX_ENTRY) {
            let i = self.seen;
            self.seen += 1;
            let chunk = u64_at(e, 0);
            let ext = Extent {
                off: u64_at(e, 8),
                stored: u32_at(e, 16),
                data_len: u32_at(e, 20),
                crc: u32_at(e, 24),
                raw: u32_at(e, 28) & FLAG_RAW != 0,
            };
            let flags = u32_at(e, 28);
            let where_ = format!(
                "index at lower offset {at}: entry {i} (lower offset {}) for chunk {chunk}",
                at + IDX_HEADER as u64 + i * IDX_ENTRY as u64
            );
            if self.prev.is_some_and(|q| chunk <= q) {
                return Err(invalid(format!("{where_}: chunks not in ascending order")));
            }
            self.prev = Some(chunk);
            if chunk >= self.nchunks {
                return Err(invalid(format!("{where_}: past the logical end ({} bytes)", sb.logical_len)));
            }
            if flags & !FLAG_RAW != 0 {
                return Err(invalid(format!("{where_}: unknown flags {flags:#x}")));
            }
            let room = (sb.logical_len - chunk * cs).min(cs);
            if ext.data_len == 0 || ext.data_len as u64 > room {
                return Err(invalid(format!("{where_}: data length {} outside 1..={room}", ext.data_len)));
            }
            if ext.stored == 0
                || (ext.raw && ext.stored != ext.data_len)
                || (!ext.raw && ext.stored as u64 > self.max_stored)
            {
                return Err(invalid(format!("{where_}: stored length {} invalid", ext.stored)));
            }
            if ext.off < DATA_START
                || !ext.off.is_multiple_of(ALIGN)
                || ext.off.saturating_add(ext.stored as u64) > self.lower_len
            {
                return Err(invalid(format!(
                    "{where_}: extent at lower offset {} (len {}) outside the data region 0x{DATA_START:x}..{}",
                    ext.off, ext.stored, self.lower_len
                )));
            }
            self.out.push((chunk, ext));
        }
        Ok(())
    }

    /// After every entry: the checksum over the whole index, then no two extents (nor the
    /// index) may share bytes. Returns the entries in chunk order.
    pub fn finish(self) -> io::Result<Vec<(u64, Extent)>> {
        let at = self.sb.index_off;
        debug_assert_eq!(self.remaining(), 0);
        if self.crc.finalize() != self.sb.index_crc {
            return Err(invalid(format!("index at lower offset {at} (len {}): checksum mismatch", self.sb.index_len)));
        }
        let mut spans: Vec<(u64, u64)> = self.out.iter().map(|(_, e)| (e.off, e.alloc_len())).collect();
        spans.push((at, align_up(self.sb.index_len)));
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(invalid(format!(
                    "index at lower offset {at}: extents at lower offsets {} and {} overlap",
                    w[0].0, w[1].0
                )));
            }
        }
        Ok(self.out)
    }
}

/// Decode and validate the index `b` read at `sb.index_off` (exactly `sb.index_len` bytes).
/// Checks: magic, generation, count; per entry: ascending chunk numbers below the chunk
/// count of `sb.logical_len`, lengths within the chunk and the file, known flags, and every
/// extent inside `DATA_START..lower_len` and aligned; then the checksum, and that no two
/// extents (nor the index) overlap. Returns the entries in chunk order. (The pager reads
/// indexes in pieces through [`IndexReader`]; this is the same on one buffer, for tests.)
#[cfg(test)]
pub(crate) fn decode_index(b: &[u8], sb: &Superblock, lower_len: u64) -> io::Result<Vec<(u64, Extent)>> {
    if b.len() < IDX_HEADER || b.len() as u64 != sb.index_len {
        return Err(invalid(format!(
            "index at lower offset {}: {} bytes, superblock says {}",
            sb.index_off,
            b.len(),
            sb.index_len
        )));
    }
    let mut r = IndexReader::new(&b[..IDX_HEADER], sb, lower_len)?;
    r.entries(&b[IDX_HEADER..])?;
    r.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superblock_round_trip() {
        let sb = Superblock {
            chunk_shift: 16,
            generation: 3,
            logical_len: 12345,
            index_off: DATA_START,
            index_len: IDX_HEADER as u64,
            index_crc: 7,
            published: false,
        };
        let b = encode_superblock(&sb);
        assert!(matches!(decode_superblock(&b, 1), Slot::Valid(x) if x == sb));
        let p = Superblock { published: true, ..sb };
        let pb = encode_superblock(&p);
        assert_eq!(u32::from_le_bytes(pb[52..56].try_into().unwrap()), SB_FLAG_PUBLISHED);
        assert!(matches!(decode_superblock(&pb, 1), Slot::Valid(x) if x == p));
        // An unknown flag bit (checksum fixed up) makes the slot unusable.
        let mut u = pb.clone();
        u[52] |= 2;
        let crc = crc32fast::hash(&u[..SB_BODY]);
        u[SB_BODY..SB_LEN].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(decode_superblock(&u, 1), Slot::Bad(_)));
        assert!(matches!(decode_superblock(&b, 0), Slot::Bad(_)));
        let mut c = b.clone();
        c[20] ^= 1;
        assert!(matches!(decode_superblock(&c, 1), Slot::Bad(_)));
        assert!(matches!(decode_superblock(&[0u8; SB_LEN], 0), Slot::Empty));
    }

    #[test]
    fn index_round_trip_and_early_rejection() {
        let ext = Extent { off: DATA_START, stored: 100, data_len: 300, crc: 5, raw: false };
        let b = encode_index(4, [(2u64, &ext)].into_iter());
        let sb = Superblock {
            chunk_shift: 12,
            generation: 4,
            logical_len: 3 * 4096,
            index_off: DATA_START + 512,
            index_len: b.len() as u64,
            index_crc: crc32fast::hash(&b),
            published: false,
        };
        assert_eq!(decode_index(&b, &sb, 1 << 20).unwrap(), vec![(2, ext)]);
        let mut c = b.clone();
        c[48] ^= 1; // the entry's chunk checksum: only the index checksum sees it
        assert!(decode_index(&c, &sb, 1 << 20).unwrap_err().to_string().contains("checksum"));
        // A header announcing a giant index over zeros (a sparse lower file): the first
        // entry is refused, whatever the checksum, before anything else is read.
        let giant = Superblock { index_len: 24 + 32 * (1 << 30), ..sb };
        let mut h = b[..IDX_HEADER].to_vec();
        h[16..24].copy_from_slice(&(1u64 << 30).to_le_bytes());
        let mut r = IndexReader::new(&h, &giant, 1 << 40).unwrap();
        assert_eq!(r.remaining(), 1 << 30);
        let e = r.entries(&[0u8; 64]).unwrap_err();
        assert!(e.to_string().contains("entry 0"), "{e}");
    }
}

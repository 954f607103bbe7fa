//! The memory pager: Mach's default pager for anonymous memory. Data that was never
//! written is a hole and reads as zeros without I/O; written data is kept in memory.

use super::{Fill, IoMode, Pager, Seek};
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::io;

const BLOCK: u64 = 4096;

/// An anonymous, zero-filled store held in process memory.
#[derive(Debug, Default)]
pub struct MemPager {
    inner: RwLock<MemStore>,
}

#[derive(Debug, Default)]
struct MemStore {
    len: u64,
    /// Written blocks, keyed by block index (offset / BLOCK). Absent blocks are holes.
    blocks: BTreeMap<u64, Box<[u8; BLOCK as usize]>>,
}

impl MemPager {
    /// An empty store of length 0.
    pub fn new() -> MemPager {
        MemPager::default()
    }

    /// Bytes of memory holding written blocks (holes cost nothing).
    pub fn stored_bytes(&self) -> u64 {
        self.inner.read().blocks.len() as u64 * BLOCK
    }
}

impl Pager for MemPager {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        let store = self.inner.read();
        let end = offset.saturating_add(buf.len() as u64);
        let first = offset / BLOCK;
        let last = end.div_ceil(BLOCK);
        if store.blocks.range(first..last).next().is_none() {
            return Ok(Fill::Hole);
        }
        buf.fill(0);
        for (&b, data) in store.blocks.range(first..last) {
            let bstart = b * BLOCK;
            let from = bstart.max(offset);
            let to = (bstart + BLOCK).min(end);
            let src = &data[(from - bstart) as usize..(to - bstart) as usize];
            buf[(from - offset) as usize..(to - offset) as usize].copy_from_slice(src);
        }
        Ok(Fill::Data)
    }

    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut store = self.inner.write();
        let end = offset.checked_add(data.len() as u64).ok_or_else(|| io::Error::from_raw_os_error(libc::EFBIG))?;
        let mut pos = offset;
        while pos < end {
            let b = pos / BLOCK;
            let bstart = b * BLOCK;
            let to = (bstart + BLOCK).min(end);
            let block = store.blocks.entry(b).or_insert_with(|| Box::new([0; BLOCK as usize]));
            block[(pos - bstart) as usize..(to - bstart) as usize]
                .copy_from_slice(&data[(pos - offset) as usize..(to - offset) as usize]);
            pos = to;
        }
        store.len = store.len.max(end);
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.inner.read().len)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut store = self.inner.write();
        if len < store.len {
            let keep = len.div_ceil(BLOCK);
            let _dropped = store.blocks.split_off(&keep);
            if !len.is_multiple_of(BLOCK)
                && let Some(block) = store.blocks.get_mut(&(len / BLOCK))
            {
                block[(len % BLOCK) as usize..].fill(0);
            }
        }
        store.len = len;
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        Ok(())
    }

    fn describe(&self) -> String {
        "memory".to_string()
    }

    fn can_punch(&self) -> bool {
        true
    }

    /// Whole blocks in the range become holes again; partial blocks at its edges are
    /// zeroed.
    fn punch(&self, offset: u64, len: u64) -> io::Result<bool> {
        let mut store = self.inner.write();
        let end = offset.saturating_add(len);
        let (first, last) = (offset.div_ceil(BLOCK), end / BLOCK);
        for (&b, block) in store.blocks.range_mut(offset / BLOCK..end.div_ceil(BLOCK)) {
            let (bstart, bend) = (b * BLOCK, (b + 1) * BLOCK);
            if b < first || b >= last {
                let (from, to) = (offset.max(bstart), end.min(bend));
                block[(from - bstart) as usize..(to - bstart) as usize].fill(0);
            }
        }
        if first < last {
            let tail = store.blocks.split_off(&last);
            store.blocks.split_off(&first);
            store.blocks.extend(tail);
        }
        Ok(true)
    }

    /// Holes are the blocks never written (or punched), and everything past the end.
    fn seek(&self, offset: u64, what: Seek) -> io::Result<Option<u64>> {
        let store = self.inner.read();
        let present = store.blocks.range(offset / BLOCK..).map(|(&b, _)| b);
        Ok(super::seek_blocks(present, BLOCK.trailing_zeros(), store.len, offset, what))
    }

    fn io_mode(&self) -> IoMode {
        IoMode::Memory
    }
}

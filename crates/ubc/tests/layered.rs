//! A pager whose store is another file of the same cache (what every layer of `ubc-stack`
//! is): its writeback needs memory of the cache it is cleaning. Reclaim on such a call's
//! thread must not write back the layer's own file (its pager is this very call, holding
//! its lock: a self-deadlock, e.g. in an aead `put_pages`), and
//! the cache full of the layer's dirty pages must not keep the lower writes from memory.

use parking_lot::Mutex;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::time::Duration;
use ubc::pager::MemPager;
use ubc::{Access, Cache, Fill, Pager};

const PAGE: u64 = 4096;
/// Where the layer keeps its "metadata" in the lower file (each upper page written adds
/// `amplify` pages there, like an aead gap fill or a zstd index).
const META: u64 = 64 << 20;

/// A layer holding its lock through `put_pages` while it writes its lower file, as the
/// aead and zstd layers do. A re-entered `put_pages` (reclaim on the same thread writing
/// this file back) finds the lock taken: recorded and failed instead of deadlocking.
struct Layer {
    lower: ubc::File,
    lock: Mutex<()>,
    amplify: u64,
    reentered: AtomicBool,
    puts: AtomicU64,
}

impl Pager for Layer {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        let n = self.lower.read_at(buf, offset)?;
        buf[n..].fill(0);
        Ok(Fill::Data)
    }
    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let Some(_g) = self.lock.try_lock() else {
            self.reentered.store(true, SeqCst);
            return Err(io::Error::other("put_pages re-entered on a thread that holds the layer's lock"));
        };
        self.puts.fetch_add(1, SeqCst);
        self.lower.write_at(data, offset)?;
        let pages = data.len() as u64 / PAGE * self.amplify;
        let meta = vec![0xa5u8; (pages * PAGE) as usize];
        self.lower.write_at(&meta, META + offset * self.amplify)?;
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.lower.len()?.min(META))
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        let _g = self.lock.lock();
        let _scope = ubc::pager::PagerScope::enter(self.depth());
        Ok(self.lower.set_len(len.max(self.lower.len()?))?)
    }
    fn sync(&self) -> io::Result<()> {
        Ok(self.lower.sync()?)
    }
    fn describe(&self) -> String {
        "test layer".into()
    }
    fn depth(&self) -> u32 {
        self.lower.depth() + 1
    }
}

#[test]
fn a_layers_writeback_reclaims_without_writing_back_itself_and_finds_memory() {
    // 64 pages; dirty limit near the budget and no page daemon, so the cache can be made
    // almost all dirty pages of the layer and every reclaim is direct, on the writer's thread.
    let cache = Cache::builder()
        .budget(64 * PAGE)
        .daemon(false)
        .dirty_ratios(88, 90)
        .writeback(Duration::from_secs(3600), Duration::from_secs(3600))
        .reserve_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let lower = cache.open(Arc::new(MemPager::new()), Access::ReadWrite).unwrap();
    let layer = Arc::new(Layer {
        lower,
        lock: Mutex::new(()),
        amplify: 16,
        reentered: AtomicBool::new(false),
        puts: AtomicU64::new(0),
    });
    let upper = cache.open(layer.clone(), Access::ReadWrite).unwrap();
    assert_eq!(upper.depth(), 1);
    // 56 dirty pages of the layer, oldest first in the replacement order.
    let data: Vec<u8> = (0..56 * PAGE).map(|i| (i / PAGE) as u8 ^ 0x3c).collect();
    upper.write_at(&data, 0).unwrap();
    // Cleaning one page writes 17 into the lower file: more than is free, so its reclaim
    // runs inside the layer's put_pages, with the layer's other dirty pages the oldest.
    upper.clean(0..PAGE).unwrap();
    assert!(!layer.reentered.load(SeqCst), "reclaim inside the layer's put_pages wrote the layer back");
    upper.sync().unwrap();
    assert!(!layer.reentered.load(SeqCst), "reclaim inside the layer's put_pages wrote the layer back");
    let mut back = vec![0u8; data.len()];
    cache.evict_all().unwrap();
    upper.read_exact_at(&mut back, 0).unwrap();
    assert!(back == data, "the layer's file reads back wrong");
    let st = cache.stats();
    assert!(st.totals.resident_bytes <= 64 * PAGE);
}

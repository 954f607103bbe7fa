//! A page-based key-value store on a file mapped through ubc, with a write-ahead log kept
//! durable by the file's writeback hook (`ubc::File::set_writeback_hook`) — the reason
//! databases keep their own buffer pools (Mach's pager that orders its own writes; the
//! ARIES rule "the log up to a page's LSN is durable before the page is written").
//!
//! Layout. The data file `kv.db` is `1 + pages` pages of 4 KiB. Page 0 holds a magic
//! number. Key `k` (`0 <= k < keys`) lives in page `1 + k / SLOTS`, slot `k % SLOTS`; a page
//! is its LSN (u64, the newest change in it) then 8 reserved bytes then `SLOTS` values
//! (u64 each, 0 = absent). The log `kv.wal` is a plain host file (outside the cache, as the
//! hook requires) of 32-byte records: LSN, key, value, and a check word (FNV-1a of the
//! first 24 bytes): a torn last record fails its check and ends the log.
//!
//! Protocol. A put appends its record to the log buffer in memory *first*, then stores the
//! value and the page LSN through the mapping. A commit writes the buffer to the log file and
//! `fdatasync`s it; the puts it covers are acknowledged. The hook does the same before any
//! page is written back, so a page on disk never holds a change its log lacks, whenever the
//! cache chooses to write it (reclaim under a budget far smaller than the file, the flusher,
//! `sync`). A checkpoint syncs the data file (through the hook) and empties the log.
//! Recovery replays the log onto the data file, each record only onto a page older than it
//! (page LSN < record LSN), then checkpoints. The state recovered is the state after some
//! prefix of the puts that contains every acknowledged one.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::Path;
use std::sync::Arc;
use ubc::{Access, Cache, Sharing};

pub const PAGE: u64 = 4096;
/// Values per page (after the 16-byte page header).
pub const SLOTS: u64 = (PAGE - 16) / 8;
const MAGIC: u64 = 0x766b_6c61_7762_7563; // "ucbwalkv"
const REC: usize = 32;

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x100_0000_01b3))
}

/// The log: records appended in memory, made durable by `flush`.
pub struct Wal {
    file: parking_lot::Mutex<std::fs::File>,
    buf: parking_lot::Mutex<Vec<u8>>,
}

impl Wal {
    fn append(&self, lsn: u64, key: u64, value: u64) {
        let mut r = [0u8; REC];
        r[0..8].copy_from_slice(&lsn.to_le_bytes());
        r[8..16].copy_from_slice(&key.to_le_bytes());
        r[16..24].copy_from_slice(&value.to_le_bytes());
        let check = fnv(&r[..24]);
        r[24..32].copy_from_slice(&check.to_le_bytes());
        self.buf.lock().extend_from_slice(&r);
    }

    /// Make every record appended so far durable. Precondition: the caller holds no lock of
    /// the store that a thread appending records needs (the hook calls this).
    pub fn flush(&self) -> io::Result<()> {
        let mut f = self.file.lock();
        let pending = std::mem::take(&mut *self.buf.lock());
        if pending.is_empty() {
            return Ok(());
        }
        f.write_all(&pending)?;
        f.sync_data()
    }

    /// Empty the log (after the data file was synced: nothing in it is needed any more).
    fn truncate(&self) -> io::Result<()> {
        let f = self.file.lock();
        assert!(self.buf.lock().is_empty(), "a checkpoint with records not flushed");
        f.set_len(0)?;
        f.sync_data()
    }

    /// The records of a log file, up to the first torn or damaged one.
    fn records(path: &Path) -> io::Result<Vec<(u64, u64, u64)>> {
        let b = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(e),
        };
        let word = |r: &[u8], i: usize| u64::from_le_bytes(r[i..i + 8].try_into().unwrap());
        Ok(b.chunks_exact(REC)
            .take_while(|r| fnv(&r[..24]) == word(r, 24))
            .map(|r| (word(r, 0), word(r, 8), word(r, 16)))
            .collect())
    }
}

pub struct Kv {
    data: ubc::File,
    map: ubc::Mapping,
    pub wal: Arc<Wal>,
    keys: u64,
    next_lsn: u64,
    /// Records replayed at open.
    pub replayed: u64,
}

impl Kv {
    /// Open (creating) the store in `dir` for `keys` keys, recovering from its log.
    /// `hooked`: keep the write-ahead rule with the writeback hook (false only to show
    /// what goes wrong without it).
    pub fn open(cache: &Cache, dir: &Path, keys: u64, hooked: bool) -> io::Result<Kv> {
        let pages = keys.div_ceil(SLOTS);
        let size = (1 + pages) * PAGE;
        let data =
            cache.open_path(dir.join("kv.db"), Access::ReadWrite).or_else(|_| cache.create_path(dir.join("kv.db")))?;
        if data.len()? < size {
            data.set_len(size)?;
        }
        let wal_path = dir.join("kv.wal");
        let records = Wal::records(&wal_path)?;
        let file = OpenOptions::new().create(true).append(true).open(&wal_path)?;
        // Cut a torn tail off, so that new records follow the last good one.
        file.set_len((records.len() * REC) as u64)?;
        let wal = Arc::new(Wal { file: parking_lot::Mutex::new(file), buf: Default::default() });
        if hooked {
            let w = wal.clone();
            data.set_writeback_hook(Some(Arc::new(move |_range| w.flush())))?;
        }
        let map = data.map(0..size, Access::ReadWrite, Sharing::Shared)?;
        let mut kv = Kv { data, map, wal, keys, next_lsn: 1, replayed: 0 };
        if kv.word(0) == 0 {
            kv.set_word(0, MAGIC);
        } else if kv.word(0) != MAGIC {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "kv.db: bad magic"));
        }
        let mut max_lsn = (1..=pages).map(|p| kv.word(p * PAGE)).max().unwrap_or(0);
        for &(lsn, key, value) in &records {
            if key >= keys {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("kv.wal: key {key} out of range")));
            }
            let page = 1 + key / SLOTS;
            if kv.word(page * PAGE) < lsn {
                kv.set_word(page * PAGE + 16 + key % SLOTS * 8, value);
                kv.set_word(page * PAGE, lsn);
                kv.replayed += 1;
            }
            max_lsn = max_lsn.max(lsn);
        }
        kv.next_lsn = max_lsn + 1;
        kv.checkpoint()?;
        Ok(kv)
    }

    fn word(&self, at: u64) -> u64 {
        // SAFETY: `at` is a multiple of 8 inside the mapping (the callers' page arithmetic),
        // which lives as long as `self`; the page is read through the cache's fault handler.
        unsafe { (self.map.as_ptr().add(at as usize) as *const u64).read_volatile() }
    }

    fn set_word(&mut self, at: u64, v: u64) {
        // SAFETY: as in `word`; a shared writable mapping.
        unsafe { (self.map.as_mut_ptr().add(at as usize) as *mut u64).write_volatile(v) }
    }

    pub fn get(&self, key: u64) -> u64 {
        assert!(key < self.keys);
        self.word((1 + key / SLOTS) * PAGE + 16 + key % SLOTS * 8)
    }

    /// Set `key` to `value` (not 0): the log record first, then the page.
    pub fn put(&mut self, key: u64, value: u64) {
        assert!(key < self.keys && value != 0);
        let lsn = self.next_lsn;
        self.next_lsn += 1;
        self.wal.append(lsn, key, value);
        let page = 1 + key / SLOTS;
        self.set_word(page * PAGE + 16 + key % SLOTS * 8, value);
        self.set_word(page * PAGE, lsn);
    }

    /// Make every put so far durable (acknowledge them).
    pub fn commit(&self) -> io::Result<()> {
        self.wal.flush()
    }

    /// Sync the data file (its pages through the hook), then empty the log.
    pub fn checkpoint(&mut self) -> io::Result<()> {
        self.wal.flush()?;
        self.map.flush()?;
        self.data.sync()?;
        self.wal.truncate()
    }
}

/// Put number `i` (from 0) of the sequence `seed` makes: (key, value = i + 1).
pub fn op(seed: u64, i: u64, keys: u64) -> (u64, u64) {
    let mut z = seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) % keys, i + 1)
}

/// The crash harness's child: puts forever, committing every few puts and printing
/// `acked N` (N puts acknowledged) after each commit returns, checkpointing now and then.
/// Never returns; the parent kills it.
pub fn run_child(dir: &Path, seed: u64, keys: u64, budget: u64, hooked: bool) -> ! {
    let cache = Cache::builder()
        .budget(budget)
        .writeback(std::time::Duration::from_millis(5), std::time::Duration::from_millis(10))
        .build()
        .expect("cache");
    let mut kv = Kv::open(&cache, dir, keys, hooked).expect("open the store");
    let mut out = io::stdout().lock();
    // After a crash the store holds the first `i` puts (what recovery checks): go on from
    // there, so that the puts of every run are one sequence.
    let mut i = (0..keys).map(|k| kv.get(k)).max().unwrap_or(0);
    loop {
        let group = 1 + op(seed ^ 0x5eed, i, 64).0;
        for _ in 0..group {
            let (k, v) = op(seed, i, keys);
            kv.put(k, v);
            i += 1;
        }
        kv.commit().expect("commit");
        writeln!(out, "acked {i}").and_then(|()| out.flush()).expect("stdout");
        if i % 4096 < group {
            kv.checkpoint().expect("checkpoint");
        }
    }
}

/// What a crash left: puts acknowledged before the kill, and the prefix recovered.
#[derive(Debug)]
pub struct Recovered {
    pub acked: u64,
    pub prefix: u64,
    pub replayed: u64,
}

/// Recover the store in `dir` (in a fresh cache) after its child was killed having
/// acknowledged `acked` puts of sequence `seed`, and check it: the state must be exactly
/// the one after the first `prefix` puts for some `prefix >= acked`. Err says what differs.
pub fn recover_and_check(dir: &Path, seed: u64, keys: u64, acked: u64) -> Result<Recovered, String> {
    let cache = Cache::new(16 << 20).map_err(|e| e.to_string())?;
    let kv = Kv::open(&cache, dir, keys, true).map_err(|e| format!("recovery failed: {e}"))?;
    let values: Vec<u64> = (0..keys).map(|k| kv.get(k)).collect();
    // The newest put present names the prefix; every key must then hold its last value
    // within that prefix.
    let prefix = values.iter().copied().max().unwrap_or(0);
    if prefix < acked {
        return Err(format!("{acked} puts acknowledged, but the newest put recovered is number {prefix}"));
    }
    let mut want = vec![0u64; keys as usize];
    for i in 0..prefix {
        let (k, v) = op(seed, i, keys);
        want[k as usize] = v;
    }
    let wrong: Vec<u64> = (0..keys).filter(|&k| values[k as usize] != want[k as usize]).collect();
    if !wrong.is_empty() {
        let k = wrong[0];
        return Err(format!(
            "not the state after any prefix of the puts: put {prefix} is there, but {} keys differ from the state after it \
             (key {k}: {} recovered, {} expected; {acked} puts acknowledged)",
            wrong.len(),
            values[k as usize],
            want[k as usize]
        ));
    }
    let replayed = kv.replayed;
    drop(kv);
    cache.sync_all().map_err(|e| e.to_string())?;
    Ok(Recovered { acked, prefix, replayed })
}

/// Run `cmd` (a child that calls [`run_child`] on `dir`), kill it with SIGKILL after
/// `after`, and return how many puts it acknowledged.
pub fn crash_child(mut cmd: std::process::Command, after: std::time::Duration) -> u64 {
    use std::io::BufRead;
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().expect("spawn the child");
    let stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut acked = 0;
        for line in io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(n) = line.strip_prefix("acked ").and_then(|n| n.parse().ok()) {
                acked = n;
            }
        }
        acked
    });
    std::thread::sleep(after);
    child.kill().expect("SIGKILL the child");
    let status = child.wait().unwrap();
    let acked = reader.join().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9 /* SIGKILL */), "the child ended before it was killed: {status:?}");
    acked
}

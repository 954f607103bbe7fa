//! One file of the `s3` layer: its pager. The file's bytes are chunks of `chunk_size`,
//! each an immutable base object `c/<ino>/<index>.<version>` with small *patch* objects laid
//! over it (same naming; `format::Patch`). Bytes written since the last upload are *staged*
//! in memory — the whole chunk, or only the written extents — and uploaded at the next
//! commit (or when the file's staged bytes pass `STAGE_MAX`): a whole chunk as a new base,
//! a few extents as a patch, and a chunk whose patches grew past `MAX_PATCHES` or
//! `chunk / PATCH_SHARE` as a new base again (compaction). A read fetches the bytes a fill
//! asks for: a random miss (the cache fills `RANDOM_FILL` around it) GETs that range of the
//! base and of the patches laid over it (`compose`); a sequential reader — a run of fills
//! each at or just after the last, `SEQUENTIAL_RUN` bytes in all — gets whole chunks and the
//! next few ahead of it, in parallel (mountpoint-s3's prefetcher also starts small and
//! streams once reads are sequential).

use super::format::{Chunk, Extent, Patch};
use super::{Inner, Shared};
use object_store::ObjectStoreExt;
use object_store::path::Path as ObjPath;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Weak};

/// Bytes a sequential reader's pager keeps in flight ahead of the chunk asked for, in
/// parallel requests: what keeps a stream of requests, each paying the store's latency,
/// ahead of the reader (8 MiB: 8 chunks of 1 MiB, 64 of 128 KiB).
const AHEAD_BYTES: u64 = 8 << 20;

/// Chunks fetched ahead, for chunks of `chunk` bytes: 8 to 64.
fn ahead_chunks(chunk: u64) -> u64 {
    (AHEAD_BYTES / chunk).clamp(8, 64)
}

type BoxFuture<'a, T> = futures::future::BoxFuture<'a, T>;

/// A whole chunk being fetched or fetched (shared by every fill that wants part of it).
type Fetch = futures::future::Shared<futures::future::BoxFuture<'static, Result<bytes::Bytes, Arc<io::Error>>>>;

/// Whole chunks fetched for a sequential reader (one GET serves every fill of a chunk, and
/// the chunks ahead of the reader are fetched before it asks), and where the last fill
/// ended. Keyed by (index, version): a replaced chunk's old bytes are never used.
#[derive(Default)]
struct Ahead {
    chunks: std::collections::HashMap<(u64, u64), Fetch>,
    order: std::collections::VecDeque<(u64, u64)>,
    /// The last fill that fetched something, and the bytes of the run of fills it ends.
    last: std::ops::Range<u64>,
    run_bytes: u64,
}

/// What a random miss fetches at least: the cache fills this aligned block around the page
/// missed (`Pager::fill_granule`), and the pager GETs just those bytes. A GET's cost is
/// mostly the store's latency (S3: tens of milliseconds to the first byte, then ~1 ms per
/// 64 KiB), so a 64 KiB block costs about what 4 KiB do, and a reader that comes back
/// near a page it missed (a database's neighbouring rows, `fio --verify` reading back every
/// block in random order) finds it cached: 16 times fewer GETs than page by page, 16 times
/// fewer bytes than the chunk. Measured both ways on this host (docs/bench.md): a 4 KiB
/// granule fetched 1 byte per byte read but read a 32 MiB file back in random order at
/// 58 reads/s, the whole chunk (1 MiB) 209 bytes per byte read.
const RANDOM_FILL: u64 = 64 << 10;

/// A run of fills of this many bytes, each starting inside the one before or after a gap no
/// larger than one of them, is a sequential reader's, and is served whole chunks, fetched
/// ahead of it; a shorter one is served the bytes it asks for (an unaligned read across two
/// blocks fills them one by one: not a stream). The cache's own read-ahead sends a stream's fills in windows that soon pass
/// this, from several threads, so a little out of order: a fill behind the last one is
/// never taken for a new stream (it would fetch again, ahead, what was fetched already).
const SEQUENTIAL_RUN: u64 = 4 * RANDOM_FILL;

/// Staged bytes of one file past which its staged chunks are uploaded at once (the tree is
/// committed later): bounds the memory a writer holds outside the cache.
const STAGE_MAX: usize = 16 << 20;

/// Patches a chunk may have before its next change stores it whole again: a read of the
/// chunk costs one GET per object.
const MAX_PATCHES: usize = 16;

/// A chunk's patches may hold up to `chunk / PATCH_SHARE` bytes before its next change stores
/// it whole again: a read fetches at most a quarter more than the chunk.
const PATCH_SHARE: u64 = 4;

/// A chunk changed since its upload.
enum Staged {
    /// Every byte of it (`chunk_size` bytes, zeros past the size): uploaded as a new base.
    Whole(Vec<u8>),
    /// Only the bytes written, by offset in the chunk (extents that neither overlap nor
    /// touch); the rest is the stored chunk's. Uploaded as a patch, or laid over the stored
    /// chunk and uploaded whole (compaction).
    Sparse(BTreeMap<u32, Vec<u8>>),
}

impl Staged {
    /// Bytes it holds.
    fn bytes(&self) -> usize {
        match self {
            Staged::Whole(b) => b.len(),
            Staged::Sparse(m) => m.values().map(Vec::len).sum(),
        }
    }
}

/// Write `data` at `off` into the extents `m`, merging every extent it overlaps or touches
/// into one.
fn write_extent(m: &mut BTreeMap<u32, Vec<u8>>, off: u32, data: &[u8]) {
    let end = off + data.len() as u32;
    // Extents starting at or before `end` whose end reaches `off`.
    let hit: Vec<u32> =
        m.range(..=end).rev().take_while(|(s, v)| **s + v.len() as u32 >= off).map(|(s, _)| *s).collect();
    let start = hit.iter().copied().fold(off, u32::min);
    let stop = hit.iter().map(|s| s + m[s].len() as u32).fold(end, u32::max);
    let mut buf = vec![0u8; (stop - start) as usize];
    for s in hit {
        let v = m.remove(&s).expect("listed");
        buf[(s - start) as usize..(s - start) as usize + v.len()].copy_from_slice(&v);
    }
    buf[(off - start) as usize..(end - start) as usize].copy_from_slice(data);
    m.insert(start, buf);
}

/// `len` bytes of a chunk: `base` (zeros past it), with the extents `m` laid over it
/// (clipped to `len`).
fn laid(base: &[u8], len: usize, m: &BTreeMap<u32, Vec<u8>>) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    let n = base.len().min(len);
    buf[..n].copy_from_slice(&base[..n]);
    for (&s, v) in m {
        let s = s as usize;
        if s < len {
            let n = v.len().min(len - s);
            buf[s..s + n].copy_from_slice(&v[..n]);
        }
    }
    buf
}

/// A shared fetch's error as the caller's own.
fn unshared(e: Arc<io::Error>) -> io::Error {
    io::Error::new(e.kind(), e.to_string())
}

/// What is known of a file's bytes.
#[derive(Default)]
pub(crate) struct FileState {
    pub(crate) size: u64,
    /// Uploaded chunks by index (absent: a hole).
    pub(crate) chunks: BTreeMap<u64, Chunk>,
    /// Chunks changed since their upload.
    staged: BTreeMap<u64, Staged>,
}

impl FileState {
    fn staged_bytes(&self) -> usize {
        self.staged.values().map(Staged::bytes).sum()
    }
}

pub(crate) struct S3File {
    pub(crate) shared: Arc<Shared>,
    /// The layer, for a commit at `sync` (weak: the layer's tree holds this file).
    inner: Weak<Inner>,
    /// Shared with other machines (`etcd=`): the file's own record and token.
    #[cfg(feature = "etcd")]
    dist: Option<Dist>,
    pub(crate) ino: u64,
    pub(crate) state: Mutex<FileState>,
    ahead: Mutex<Ahead>,
    /// Its last name is gone: when the file is dropped (no open handle left), its objects
    /// are deleted after the next commit.
    pub(crate) unlinked: AtomicBool,
}

/// A file shared with other machines: its token, and whether it changed since its commit.
#[cfg(feature = "etcd")]
struct Dist {
    fs: Weak<super::shared::SharedFs>,
    token: Arc<crate::dist::Token>,
    changed: AtomicBool,
    /// Serializes the file's commits: one that finds nothing changed must not return while
    /// another (the committer's) is still storing what changed — a token given up then
    /// would let another machine read the record before that commit rewrote it.
    commits: Mutex<()>,
    /// The requests this file may make of its cache object (Mach's pager request port,
    /// from `Pager::init`; the object made last). The token acts on the object through
    /// them too, not only through the stack's groups: a file closed everywhere stays cached,
    /// dirty pages included, with no group left to write it back.
    cache: Mutex<Option<ubc::pager::PagerRequest>>,
    /// The token is being lost: pages written back are dropped (`TokenHolder::discarding`).
    discarding: AtomicBool,
}

impl S3File {
    pub(crate) fn new(
        shared: Arc<Shared>,
        inner: Weak<Inner>,
        ino: u64,
        size: u64,
        chunks: BTreeMap<u64, Chunk>,
    ) -> S3File {
        S3File {
            shared,
            inner,
            ino,
            state: Mutex::new(FileState { size, chunks, staged: BTreeMap::new() }),
            ahead: Mutex::new(Ahead::default()),
            unlinked: AtomicBool::new(false),
            #[cfg(feature = "etcd")]
            dist: None,
        }
    }

    /// A file of a file system shared with other machines (`fs`), with its token.
    #[cfg(feature = "etcd")]
    pub(crate) fn shared_file(
        shared: Arc<Shared>,
        fs: Weak<super::shared::SharedFs>,
        ino: u64,
        size: u64,
        chunks: BTreeMap<u64, Chunk>,
    ) -> Arc<S3File> {
        Arc::new_cyclic(|me: &Weak<S3File>| {
            let holder: Weak<dyn crate::dist::TokenHolder> = me.clone();
            let token = fs.upgrade().expect("called by the file system").machine.token(ino, holder);
            let mut f = S3File::new(shared, Weak::new(), ino, size, chunks);
            f.dist = Some(Dist {
                fs,
                token,
                changed: AtomicBool::new(false),
                commits: Mutex::new(()),
                cache: Mutex::new(None),
                discarding: AtomicBool::new(false),
            });
            f
        })
    }

    /// Whether the file is shared with other machines (`etcd=`).
    fn is_shared(&self) -> bool {
        #[cfg(feature = "etcd")]
        return self.dist.is_some();
        #[cfg(not(feature = "etcd"))]
        false
    }

    /// The token between machines of a shared file.
    #[cfg(feature = "etcd")]
    pub(crate) fn token(&self) -> Option<Arc<crate::dist::Token>> {
        self.dist.as_ref().map(|d| d.token.clone())
    }

    /// Replace what is known of the stored file (its record was read again). => nothing is
    /// staged (a shared file stages only under its write token, and stores or discards
    /// before giving it up).
    #[cfg(feature = "etcd")]
    pub(crate) fn replace_state(&self, size: u64, chunks: BTreeMap<u64, Chunk>) {
        let mut st = self.state.lock();
        debug_assert!(st.staged.is_empty(), "a reload with staged chunks");
        st.staged.clear();
        (st.size, st.chunks) = (size, chunks);
    }

    /// The size and uploaded chunks, for a record.
    #[cfg(feature = "etcd")]
    pub(crate) fn stored_state(&self) -> (u64, BTreeMap<u64, Chunk>) {
        let st = self.state.lock();
        (st.size, st.chunks.clone())
    }

    /// Upload the staged chunks and return the size and chunks then, under one hold of the
    /// state: a write staged meanwhile is not half in the record (its size without its bytes).
    #[cfg(feature = "etcd")]
    pub(crate) fn flush_for_record(&self) -> io::Result<(u64, BTreeMap<u64, Chunk>)> {
        let mut st = self.state.lock();
        self.upload(&mut st)?;
        Ok((st.size, st.chunks.clone()))
    }

    /// Hold off the shared file's other commits (see `Dist::commits`).
    #[cfg(feature = "etcd")]
    pub(crate) fn one_commit(&self) -> Option<parking_lot::MutexGuard<'_, ()>> {
        self.dist.as_ref().map(|d| d.commits.lock())
    }

    /// The request port of the file's cache object, if it is cached.
    #[cfg(feature = "etcd")]
    fn cache_port(&self) -> Option<ubc::pager::PagerRequest> {
        self.dist.as_ref()?.cache.lock().clone().filter(|r| r.is_cached())
    }

    /// Whether a shared file changed since its last commit (and forget it).
    #[cfg(feature = "etcd")]
    pub(crate) fn take_changed(&self) -> bool {
        self.dist.as_ref().is_some_and(|d| d.changed.swap(false, Relaxed))
    }

    /// Whether a shared file lost changes with its token (and forget it).
    #[cfg(feature = "etcd")]
    pub(crate) fn take_lost_changes(&self) -> bool {
        self.dist.as_ref().is_some_and(|d| d.token.take_lost_changes())
    }

    fn chunk(&self) -> u64 {
        self.shared.chunk
    }

    /// The fetch of stored chunk `idx` (version `c`), started now on the runtime unless one
    /// is under way or done. => `ahead` is this file's, locked. (Lock order: a file's state,
    /// then its `ahead`; never the other way.)
    fn fetch_whole(&self, ahead: &mut Ahead, idx: u64, c: &Chunk) -> Fetch {
        use futures::FutureExt;
        let key = (idx, c.newest());
        // A version's bytes never change: a fetch done or under way serves every later ask —
        // unless it failed (a network error is not the chunk's last word: fetch again).
        if let Some(f) = ahead.chunks.get(&key)
            && !matches!(f.peek(), Some(Err(_)))
        {
            return f.clone();
        }
        // The chunk as it was a few patches ago, if its bytes are here (fetched, or kept
        // after an upload): only the patches since are fetched — another machine's small
        // write costs this one a GET of those bytes, not of the chunk.
        let known = Self::known_before(ahead, idx, c);
        let bytes = self.compose(idx, c, known, 0..c.len as u64);
        let f: Fetch = bytes.map(|r| r.map_err(Arc::new)).boxed().shared();
        self.remember(ahead, key, f.clone());
        f
    }

    /// Chunk `idx` (`c`) as it was a few patches ago, if its bytes are here (fetched, or
    /// kept after an upload): how many of its patches they include, and the bytes.
    fn known_before(ahead: &Ahead, idx: u64, c: &Chunk) -> Option<(usize, bytes::Bytes)> {
        (0..c.patches.len()).rev().find_map(|k| {
            let v = if k == 0 { c.version } else { c.patches[k - 1].version };
            match ahead.chunks.get(&(idx, v)).and_then(|f| f.peek()) {
                Some(Ok(b)) if v != 0 => Some((k, b.clone())),
                _ => None,
            }
        })
    }

    /// Keep `f` for chunk version `key`: bounded, the oldest are forgotten (a fetch still
    /// running finishes on its own).
    fn remember(&self, ahead: &mut Ahead, key: (u64, u64), f: Fetch) {
        if ahead.chunks.insert(key, f).is_none() {
            ahead.order.push_back(key);
        }
        while ahead.order.len() as u64 > ahead_chunks(self.chunk()) + 4 {
            if let Some(old) = ahead.order.pop_front() {
                ahead.chunks.remove(&old);
            }
        }
    }

    /// The stored bytes of chunk `idx` (`c`): fetched, or taken from a fetch ahead.
    fn stored_bytes(&self, idx: u64, c: &Chunk) -> io::Result<bytes::Bytes> {
        let fetch = self.fetch_whole(&mut self.ahead.lock(), idx, c);
        self.shared.rt.block_on(fetch).map_err(unshared)
    }

    /// The fetch of bytes `r` of stored chunk `idx` (`c`), started now on the runtime: the
    /// chunk's patches laid in order over the base — over `known` instead if given (the
    /// chunk's bytes with its first `skip` patches, which are then not fetched), else over
    /// a ranged GET of the base object (zeros where there is none) — each patch whose
    /// extents meet `r` one ranged GET of the part of its object that holds them. Returns
    /// exactly `r.len()` bytes. => `r` lies inside the chunk's `len`.
    fn compose(
        &self,
        idx: u64,
        c: &Chunk,
        known: Option<(usize, bytes::Bytes)>,
        r: std::ops::Range<u64>,
    ) -> BoxFuture<'static, io::Result<bytes::Bytes>> {
        use futures::FutureExt;
        let (s, e) = (r.start, r.end);
        // What the patches are laid over: the known bytes, else the base object's.
        let (skip, known) = match known {
            Some((skip, b)) => (skip, Some(b.slice(s.min(b.len() as u64) as usize..e.min(b.len() as u64) as usize))),
            None => (0, None),
        };
        let base = (known.is_none() && c.version != 0 && s < c.base_len as u64)
            .then(|| (self.shared.chunk_path(self.ino, idx, c.version), s..e.min(c.base_len as u64)));
        // Per patch meeting `r`: its object's span holding those extents' bytes, and for
        // each extent the part laid (offset in the span, offset in `r`, length).
        let mut patches = Vec::new();
        for p in &c.patches[skip..] {
            let (mut at, mut lays) = (0u64, Vec::new());
            for x in &p.extents {
                let (xs, xe) = (x.offset as u64, x.offset as u64 + x.len as u64);
                let (a, b) = (xs.max(s), xe.min(e));
                if a < b {
                    lays.push((at + (a - xs), a - s, b - a));
                }
                at += x.len as u64;
            }
            let lo = lays.iter().map(|l| l.0).min();
            let hi = lays.iter().map(|l| l.0 + l.2).max();
            if let (Some(lo), Some(hi)) = (lo, hi) {
                patches.push((self.shared.chunk_path(self.ino, idx, p.version), lo..hi, lays));
            }
        }
        let (store, gets, ino) = (self.shared.store.clone(), self.shared.gets.clone(), self.ino);
        let task = self.shared.rt.spawn(async move {
            let get = |path: object_store::path::Path, r: std::ops::Range<u64>| {
                let (store, gets) = (store.clone(), gets.clone());
                async move {
                    let want = r.end - r.start;
                    let b = store.get_range(&path, r).await.map_err(super::io_err)?;
                    gets.count(b.len());
                    if b.len() as u64 != want {
                        let m =
                            format!("an object of inode {ino}'s chunk {idx} is short: {} bytes, not {want}", b.len());
                        return Err(io::Error::new(io::ErrorKind::InvalidData, m));
                    }
                    Ok(b)
                }
            };
            let base = async {
                match base {
                    Some((path, r)) => get(path, r).await.map(Some),
                    None => Ok(known),
                }
            };
            let pgets =
                futures::future::join_all(patches.iter().map(|(path, span, _)| get(path.clone(), span.clone())));
            let (base, pbytes) = futures::join!(base, pgets);
            let base = base?;
            if patches.is_empty()
                && let Some(b) = &base
                && b.len() as u64 == e - s
            {
                return Ok(b.clone());
            }
            let mut out = vec![0u8; (e - s) as usize];
            if let Some(b) = base {
                out[..b.len()].copy_from_slice(&b);
            }
            for ((_, span, lays), b) in patches.iter().zip(pbytes) {
                let b = b?;
                for &(from, to, n) in lays {
                    let from = (from - span.start) as usize;
                    out[to as usize..(to + n) as usize].copy_from_slice(&b[from..from + n as usize]);
                }
            }
            Ok(bytes::Bytes::from(out))
        });
        async move { task.await.unwrap_or_else(|e| Err(io::Error::other(e))) }.boxed()
    }

    /// The whole chunk `idx` as it stands: the stored chunk's bytes (fetched) with the
    /// extents `m` staged over them, `chunk_size` bytes. => `st` is this file's state, locked.
    fn overlaid(&self, st: &FileState, idx: u64, m: &BTreeMap<u32, Vec<u8>>) -> io::Result<Vec<u8>> {
        let stored = match st.chunks.get(&idx) {
            Some(c) => self.stored_bytes(idx, c)?,
            None => bytes::Bytes::new(),
        };
        Ok(laid(&stored, self.chunk() as usize, m))
    }

    /// Stage chunk `idx` whole with its current bytes: the stored chunk's (fetched), with
    /// what is staged of it laid over them. => `st` is this file's state, locked.
    fn stage_whole<'a>(&self, st: &'a mut FileState, idx: u64) -> io::Result<&'a mut Vec<u8>> {
        if !matches!(st.staged.get(&idx), Some(Staged::Whole(_))) {
            let buf = match st.staged.get(&idx) {
                Some(Staged::Sparse(m)) => self.overlaid(st, idx, m)?,
                _ => self.overlaid(st, idx, &BTreeMap::new())?,
            };
            st.staged.insert(idx, Staged::Whole(buf));
        }
        match st.staged.get_mut(&idx) {
            Some(Staged::Whole(buf)) => Ok(buf),
            _ => unreachable!("staged whole above"),
        }
    }

    /// What one staged chunk becomes in the store: the object to PUT and the chunk entry
    /// naming it, or `None` when nothing of it is inside the file. A sparse chunk becomes a
    /// patch, unless its extents cover the stored bytes (a new base, nothing to fetch) or its
    /// patches would pass `MAX_PATCHES` or `chunk / PATCH_SHARE` (a new base laid over the
    /// stored one: compaction, which fetches the stored chunk). => `st` is this file's
    /// state, locked.
    fn prepare(&self, st: &FileState, idx: u64) -> io::Result<Option<(Chunk, bytes::Bytes)>> {
        let chunk = self.chunk();
        let start = idx * chunk;
        if start >= st.size {
            return Ok(None);
        }
        let limit = (st.size - start).min(chunk) as usize;
        let stored = st.chunks.get(&idx);
        let whole = |buf: &[u8], len: usize| {
            let version = self.shared.new_version();
            Some((Chunk::whole(version, len as u32), bytes::Bytes::copy_from_slice(&buf[..len])))
        };
        let m = match st.staged.get(&idx) {
            None => return Ok(None),
            Some(Staged::Whole(buf)) => return Ok(whole(buf, limit)),
            Some(Staged::Sparse(m)) => m,
        };
        // The extents inside the file (a truncation may have cut them since).
        let extents: Vec<(u32, &[u8])> = m
            .iter()
            .filter(|&(&s, _)| (s as usize) < limit)
            .map(|(&s, v)| (s, &v[..v.len().min(limit - s as usize)]))
            .collect();
        let Some(&(last, lv)) = extents.last() else { return Ok(None) };
        let end = last as usize + lv.len();
        let stored_len = stored.map_or(0, |c| c.len as usize);
        let new_bytes: u64 = extents.iter().map(|(_, v)| v.len() as u64).sum();
        if extents.len() == 1 && extents[0].0 == 0 && end >= stored_len {
            // Every stored byte is written over: the extent is the chunk.
            return Ok(whole(extents[0].1, end));
        }
        let compact = stored
            .is_some_and(|c| c.patches.len() >= MAX_PATCHES || c.patch_bytes() + new_bytes > chunk / PATCH_SHARE)
            || new_bytes > chunk / PATCH_SHARE
            || extents.len() > u16::MAX as usize;
        if compact {
            return Ok(whole(&self.overlaid(st, idx, m)?, stored_len.max(end).min(limit)));
        }
        let mut body = Vec::with_capacity(new_bytes as usize);
        let mut patch = Patch { version: self.shared.new_version(), extents: Vec::with_capacity(extents.len()) };
        for (s, v) in &extents {
            body.extend_from_slice(v);
            patch.extents.push(Extent { offset: *s, len: v.len() as u32 });
        }
        let mut c = stored.cloned().unwrap_or(Chunk { version: 0, base_len: 0, len: 0, patches: Vec::new() });
        c.len = c.len.max(end as u32);
        c.patches.push(patch);
        Ok(Some((c, bytes::Bytes::from(body))))
    }

    /// Upload every staged chunk (in parallel): as a new base version, whose replaced objects
    /// become garbage, or as a patch of its stored chunk. => `st` is this file's state,
    /// locked. On error the chunks stay staged.
    fn upload(&self, st: &mut FileState) -> io::Result<()> {
        if st.staged.is_empty() {
            return Ok(());
        }
        let mut first_err = None;
        let mut puts = Vec::new();
        let staged: Vec<u64> = st.staged.keys().copied().collect();
        for idx in staged {
            match self.prepare(st, idx) {
                Ok(Some((c, body))) => {
                    let path = self.shared.chunk_path(self.ino, idx, c.newest());
                    puts.push((idx, c, path, body));
                }
                Ok(None) => {
                    st.staged.remove(&idx);
                }
                Err(e) => {
                    first_err.get_or_insert(self.chunk_gone(e, true));
                }
            }
        }
        let store = self.shared.store.clone();
        let jobs: Vec<_> = puts.iter().map(|(_, _, p, b)| (p.clone(), b.clone())).collect();
        let results = self.shared.rt.block_on(async move {
            let futs = jobs.into_iter().map(|(p, b)| {
                let store = store.clone();
                async move { put_object(&*store, &p, b).await }
            });
            futures::future::join_all(futs).await
        });
        for ((idx, c, path, b), r) in puts.into_iter().zip(results) {
            match r {
                Ok(_) => {
                    self.shared.counted_put(b.len());
                    if b.len() >= MULTIPART_MIN {
                        self.shared.multipart.fetch_add(1, Relaxed);
                    }
                    let sparse = st.staged.remove(&idx);
                    let old = st.chunks.get(&idx).cloned();
                    // The bytes just stored are the chunk's now: the next write into it (a
                    // database's next transaction) or a read stages from them, not from a GET
                    // of what was just PUT (a round trip to the store per commit).
                    {
                        use futures::FutureExt;
                        let mut ahead = self.ahead.lock();
                        let now = if c.patches.is_empty() {
                            Some(b.clone())
                        } else {
                            // A patch: the chunk's bytes are known if the old ones were.
                            old.as_ref().and_then(|o| ahead.chunks.get(&(idx, o.newest()))).and_then(|f| {
                                match (f.peek(), &sparse) {
                                    (Some(Ok(ob)), Some(Staged::Sparse(m))) => {
                                        Some(bytes::Bytes::from(laid(ob, c.len as usize, m)))
                                    }
                                    _ => None,
                                }
                            })
                        };
                        if let Some(now) = now {
                            let f: Fetch = futures::future::ready(Ok(now)).boxed().shared();
                            // Polled once, so that `peek` sees its bytes (the next patch's
                            // upload lays itself over them).
                            let _ = f.clone().now_or_never();
                            self.remember(&mut ahead, (idx, c.newest()), f);
                        }
                    }
                    // A new base replaces every object of the old chunk. Listed under this
                    // lock, after the state names the new one: a commit that takes the
                    // garbage then reads the new chunk.
                    let replaced = c.patches.is_empty();
                    st.chunks.insert(idx, c);
                    if replaced && let Some(old) = old {
                        self.shared.garbage.lock().extend(self.shared.chunk_objects(self.ino, idx, &old));
                    }
                }
                Err(e) => {
                    // A failed PUT may have stored the object anyway: it is garbage.
                    self.shared.garbage.lock().push(path);
                    first_err.get_or_insert(super::io_err(e));
                }
            }
        }
        // Staged chunks wholly past the size hold nothing.
        let chunk = self.chunk();
        let size = st.size;
        st.staged.retain(|&idx, _| idx * chunk < size);
        // The tree names chunk versions: it must be committed again. (A shared file's own
        // record is rewritten by the commit that uploads, or was marked by the write.)
        if !self.is_shared() {
            self.mark_changed();
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Upload this file's staged chunks (a commit does, for every file).
    pub(crate) fn flush(&self) -> io::Result<()> {
        let mut st = self.state.lock();
        self.upload(&mut st)
    }

    pub(crate) fn mark_changed(&self) {
        #[cfg(feature = "etcd")]
        if let Some(d) = &self.dist {
            d.changed.store(true, Relaxed);
            return;
        }
        if let Some(inner) = self.inner.upgrade() {
            inner.tree.changed.store(true, Relaxed);
        }
    }

    /// `e`, a failed fetch of a chunk this file's state names. Not found, on a shared file
    /// system: another machine replaced the chunk, so this machine's token must have been
    /// taken from it unnoticed — checked in etcd (and lost if so: `Token::check_fence`),
    /// and said as `ESTALE`, not as a missing object. Alone, a chunk the state names is
    /// deleted only after a commit replaced it here, which a fetch retries for.
    /// `writing_back`: the fetch was a write-back's (whose error its file's next `sync`
    /// reports), not a read's or a truncation's (whose error tells nothing of changes lost
    /// with the token: the loss notes them for the next `sync`).
    fn chunk_gone(&self, e: io::Error, writing_back: bool) -> io::Error {
        #[cfg(feature = "etcd")]
        if let Some(d) = &self.dist
            && e.kind() == io::ErrorKind::NotFound
        {
            d.token.check_fence(!writing_back);
            return io::Error::from_raw_os_error(libc::ESTALE);
        }
        let _ = writing_back;
        e
    }

    /// One attempt of `get_pages`: `Err(NotFound)` if a chunk's version was replaced (and
    /// deleted) between reading the state and the fetch.
    fn read_once(&self, offset: u64, buf: &mut [u8]) -> io::Result<ubc::Fill> {
        let chunk = self.chunk();
        buf.fill(0);
        let end = offset + buf.len() as u64;
        let mut remote = Vec::new();
        // Staged extents of chunks also fetched (laid over them after), copied out.
        let mut over: Vec<(u64, Vec<u8>)> = Vec::new();
        // Stored chunks past the asked ones, for a sequential reader: read under the same
        // hold of the state (the `ahead` lock is taken after it, never inside it).
        let mut next = Vec::new();
        let mut any = false;
        {
            let st = self.state.lock();
            let stop = end.min(st.size);
            if offset >= stop {
                return Ok(ubc::Fill::Hole);
            }
            for idx in offset / chunk..stop.div_ceil(chunk) {
                let cstart = idx * chunk;
                let (a, b) = (offset.max(cstart), stop.min(cstart + chunk));
                if let Some(Staged::Whole(s)) = st.staged.get(&idx) {
                    buf[(a - offset) as usize..(b - offset) as usize]
                        .copy_from_slice(&s[(a - cstart) as usize..(b - cstart) as usize]);
                    any = true;
                    continue;
                }
                if let Some(Staged::Sparse(m)) = st.staged.get(&idx) {
                    for (&s, v) in m {
                        let (es, ee) = (cstart + s as u64, cstart + s as u64 + v.len() as u64);
                        let (x, y) = (es.max(a), ee.min(b));
                        if x < y {
                            over.push((x, v[(x - es) as usize..(y - es) as usize].to_vec()));
                            any = true;
                        }
                    }
                }
                if let Some(c) = st.chunks.get(&idx) {
                    let b = b.min(cstart + c.len as u64);
                    if a < b {
                        remote.push((idx, c.clone(), a - cstart..b - cstart));
                    }
                }
            }
            if let Some(&(last, _, _)) = remote.last() {
                next.extend((last + 1..=last + ahead_chunks(chunk)).filter_map(|idx| {
                    st.chunks.get(&idx).filter(|_| !st.staged.contains_key(&idx)).map(|c| (idx, c.clone()))
                }));
            }
        }
        let lay = |buf: &mut [u8]| {
            for (at, v) in &over {
                let at = (at - offset) as usize;
                buf[at..at + v.len()].copy_from_slice(v);
            }
        };
        if remote.is_empty() {
            lay(buf);
            return Ok(if any { ubc::Fill::Data } else { ubc::Fill::Hole });
        }
        // A sequential reader — a run of fills, each at or just after the last, of at least
        // `SEQUENTIAL_RUN` bytes — gets whole chunks (each fetched once for all the fills of
        // its parts), and the next `ahead_chunks` stored chunks are fetched too, in
        // parallel; a random miss gets the bytes it asked for, unless its chunk is being
        // fetched whole anyway.
        let parts: Vec<BoxFuture<'static, io::Result<bytes::Bytes>>> = {
            use futures::FutureExt;
            let mut ahead = self.ahead.lock();
            let last = ahead.last.clone();
            let behind = !last.is_empty() && offset < last.start;
            let gap = (end - offset).max(last.end - last.start);
            let continues = !last.is_empty() && !behind && offset <= last.end + gap;
            let run_bytes = (end - offset) + if continues { ahead.run_bytes } else { 0 };
            (ahead.last, ahead.run_bytes) = (offset..end, run_bytes);
            let sequential = !behind && run_bytes >= SEQUENTIAL_RUN;
            let mut parts = Vec::with_capacity(remote.len());
            for (idx, c, r) in &remote {
                // Being fetched whole, or known as it was a few patches ago (only the patches
                // since are fetched: another machine's small write costs a GET of its bytes):
                // whole, whatever the fill.
                let fetching = ahead.chunks.get(&(*idx, c.newest())).is_some_and(|f| !matches!(f.peek(), Some(Err(_))))
                    || Self::known_before(&ahead, *idx, c).is_some();
                if !(sequential || fetching) {
                    parts.push(self.compose(*idx, c, None, r.clone()));
                    continue;
                }
                let whole = self.fetch_whole(&mut ahead, *idx, c);
                let (idx, r, ino) = (*idx, r.clone(), self.ino);
                parts.push(
                    async move {
                        let whole = whole.await.map_err(unshared)?;
                        if (whole.len() as u64) < r.end {
                            let m = format!("chunk {idx} of inode {ino} is short");
                            return Err(io::Error::new(io::ErrorKind::InvalidData, m));
                        }
                        Ok(whole.slice(r.start as usize..r.end as usize))
                    }
                    .boxed(),
                );
            }
            if sequential {
                for (idx, c) in next {
                    // Started on the runtime: it runs whether or not anyone waits.
                    drop(self.fetch_whole(&mut ahead, idx, &c));
                }
            }
            parts
        };
        let got = self.shared.rt.block_on(futures::future::join_all(parts));
        for ((idx, _, r), part) in remote.into_iter().zip(got) {
            let part = part?;
            let at = (idx * chunk + r.start - offset) as usize;
            buf[at..at + part.len()].copy_from_slice(&part);
        }
        lay(buf);
        Ok(ubc::Fill::Data)
    }
}

impl Drop for S3File {
    fn drop(&mut self) {
        #[cfg(feature = "etcd")]
        if let Some(d) = &self.dist {
            // Closed everywhere on this machine: store what changed; keep the token for the
            // next use here (`SharedFs::kept`), or give it up (the file is gone, or its
            // changes could not be stored: the next holder reads the record afresh).
            let fs = d.fs.upgrade();
            let mut keep = false;
            if let Some(fs) = &fs {
                if self.unlinked.load(Relaxed) {
                    fs.delete_objects(&self.shared, self.ino);
                } else {
                    match fs.commit(&self.shared, self) {
                        Ok(()) => keep = true,
                        Err(e) => eprintln!("ubc: s3 inode {}: changes not stored at close: {e}", self.ino),
                    }
                }
            }
            match &fs {
                Some(fs) if keep => fs.keep_token(d.token.clone()),
                _ => d.token.leave(),
            }
            if let Some(fs) = fs {
                fs.forget(self.ino, self as *const S3File);
            }
            return;
        }
        if self.unlinked.load(Relaxed) {
            // One file system's writer (the tree mode): every object of this file is named
            // in its state (versions it replaced are in the garbage already), so none need
            // be listed — a listing per removed file is a request each, and on a store that
            // lists by walking the bucket (s3s-fs) a walk each.
            let st = self.state.lock();
            let objects: Vec<ObjPath> =
                st.chunks.iter().flat_map(|(&idx, c)| self.shared.chunk_objects(self.ino, idx, c)).collect();
            drop(st);
            self.shared.garbage.lock().extend(objects);
        }
    }
}

/// Objects of at least this many bytes are uploaded in parts, in parallel (a multipart
/// upload): a 16 MiB chunk as two parts of 8 MiB on two connections, where one PUT streams on
/// one. Smaller ones are one PUT (S3's parts are at least 5 MiB, but for the last).
pub(crate) const MULTIPART_MIN: usize = 8 << 20;

/// The size of each part of a multipart upload.
const PART: usize = 5 << 20;

/// PUT `bytes` at `path`: one request, or a multipart upload from `MULTIPART_MIN` bytes on
/// (aborted on failure, so that no parts stay behind).
async fn put_object(
    store: &dyn object_store::ObjectStore,
    path: &object_store::path::Path,
    bytes: bytes::Bytes,
) -> object_store::Result<()> {
    if bytes.len() < MULTIPART_MIN {
        return store.put(path, bytes.into()).await.map(drop);
    }
    let upload = store.put_multipart(path).await?;
    let mut w = object_store::WriteMultipart::new_with_chunk_size(upload, PART);
    w.write(&bytes);
    // `finish` aborts the upload itself when a part (or the completion) fails.
    w.finish().await.map(drop)
}

/// The identity of file `ino` of the store `shared` is (its cache object's key).
pub(crate) fn identity(shared: &Shared, ino: u64) -> ubc::Identity {
    ubc::Identity::Named { kind: "s3", name: format!("{}#{ino}", shared.id) }
}

/// The file of the store `shared` that [`identity`] gave `id`, if it did.
pub(crate) fn ino_of(shared: &Shared, id: &ubc::Identity) -> Option<u64> {
    let ubc::Identity::Named { kind: "s3", name } = id else { return None };
    let (store, ino) = name.rsplit_once('#')?;
    if store != shared.id {
        return None;
    }
    ino.parse().ok()
}

impl ubc::Pager for S3File {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<ubc::Fill> {
        let mut tries = 0;
        loop {
            match self.read_once(offset, buf) {
                // A flush replaced a chunk and a commit deleted the old version between the
                // look at the state and the fetch: look again.
                Err(e) if e.kind() == io::ErrorKind::NotFound && tries < 3 => tries += 1,
                Err(e) => return Err(self.chunk_gone(e, false)),
                r => return r,
            }
        }
    }

    /// A mapping's fault, shared between machines: served under the file's token — the
    /// write token for a shared writable mapping (stores through it will not be seen one by
    /// one), else the read token — held until the fault is resolved. Without it a fault
    /// after the token went elsewhere read the chunks of a record another machine had
    /// replaced (`ESTALE`, so `SIGBUS`), or stale bytes.
    fn fault_guard(&self, _range: std::ops::Range<u64>, store: bool) -> io::Result<Option<ubc::FaultGuard>> {
        #[cfg(feature = "etcd")]
        if let Some(d) = &self.dist {
            let mode = if store { crate::coherence::Mode::Write } else { crate::coherence::Mode::Read };
            let pin = d.token.pin_fault(mode)?;
            return Ok(Some(ubc::FaultGuard::new(pin)));
        }
        let _ = store;
        Ok(None)
    }

    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        #[cfg(feature = "etcd")]
        if self.dist.as_ref().is_some_and(|d| d.discarding.load(Relaxed)) {
            return Ok(());
        }
        let chunk = self.chunk();
        let end = offset.checked_add(data.len() as u64).ok_or_else(|| io::Error::from_raw_os_error(libc::EFBIG))?;
        let mut st = self.state.lock();
        let mut pos = offset;
        while pos < end {
            let idx = pos / chunk;
            let cstart = idx * chunk;
            let to = end.min(cstart + chunk);
            let part = &data[(pos - offset) as usize..(to - offset) as usize];
            let at = (pos - cstart) as u32;
            if !st.staged.contains_key(&idx) {
                // Written from the chunk's start over every stored byte: the chunk is new
                // whole, nothing of the old to read. Otherwise only the bytes written are
                // kept (no read of the old chunk: a patch, or laid over it later).
                let stored = st.chunks.get(&idx).map_or(0, |c| c.len as u64);
                let fresh = if at == 0 && to - cstart >= stored {
                    Staged::Whole(vec![0u8; chunk as usize])
                } else {
                    Staged::Sparse(BTreeMap::new())
                };
                st.staged.insert(idx, fresh);
            }
            match st.staged.get_mut(&idx).expect("staged above") {
                Staged::Whole(buf) => buf[at as usize..at as usize + part.len()].copy_from_slice(part),
                Staged::Sparse(m) => write_extent(m, at, part),
            }
            pos = to;
        }
        st.size = st.size.max(end);
        self.mark_changed();
        if st.staged_bytes() > STAGE_MAX {
            self.upload(&mut st)?;
        }
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.state.lock().size)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let chunk = self.chunk();
        let mut st = self.state.lock();
        if len == st.size {
            // Nothing changes (a layer above setting the length it has): nothing to commit —
            // for a file only read here, which another machine may even have removed since.
            return Ok(());
        }
        if len < st.size {
            let keep = len.div_ceil(chunk);
            let cut: Vec<u64> = st.chunks.range(keep..).map(|(&i, _)| i).collect();
            for idx in cut {
                let c = st.chunks.remove(&idx).expect("listed");
                self.shared.garbage.lock().extend(self.shared.chunk_objects(self.ino, idx, &c));
            }
            st.staged.retain(|&i, _| i < keep);
            let tail = len % chunk;
            if tail != 0 {
                let idx = len / chunk;
                let stored_past = st.chunks.get(&idx).is_some_and(|c| c.len as u64 > tail);
                if st.staged.contains_key(&idx) || stored_past {
                    let buf = self.stage_whole(&mut st, idx).map_err(|e| self.chunk_gone(e, false))?;
                    buf[tail as usize..].fill(0);
                }
            }
        }
        st.size = len;
        self.mark_changed();
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        #[cfg(feature = "etcd")]
        if let Some(d) = &self.dist {
            return match d.fs.upgrade() {
                Some(fs) => fs.commit(&self.shared, self),
                None => Err(io::Error::other("the s3 layer is gone")),
            };
        }
        match self.inner.upgrade() {
            Some(inner) => inner.commit(),
            None => Err(io::Error::other("the s3 layer is gone")),
        }
    }

    fn identity(&self) -> Option<ubc::Identity> {
        Some(identity(&self.shared, self.ino))
    }

    fn init(&self, request: ubc::pager::PagerRequest) {
        #[cfg(feature = "etcd")]
        if let Some(d) = &self.dist {
            *d.cache.lock() = Some(request);
        }
        #[cfg(not(feature = "etcd"))]
        let _ = request;
    }

    fn describe(&self) -> String {
        format!("s3 {} inode {}", self.shared.id, self.ino)
    }

    fn fill_granule(&self) -> u64 {
        RANDOM_FILL.min(self.chunk())
    }
}

#[cfg(feature = "etcd")]
impl crate::dist::TokenHolder for S3File {
    fn reload(&self) -> io::Result<()> {
        match self.dist.as_ref().and_then(|d| d.fs.upgrade()) {
            Some(fs) => fs.reload(self)?,
            None => return Ok(()),
        }
        // The cached object's pages and length too (the stack's groups reload theirs after).
        if let Some(port) = self.cache_port() {
            port.flush_reload(0..u64::MAX).map_err(io::Error::other)?;
        }
        Ok(())
    }

    fn store(&self) -> io::Result<()> {
        // What the cached object holds dirty (written back by no group: a closed file).
        if let Some(port) = self.cache_port() {
            port.clean(0..u64::MAX).map_err(io::Error::other)?;
        }
        match self.dist.as_ref().and_then(|d| d.fs.upgrade()) {
            Some(fs) => fs.commit(&self.shared, self),
            None => Err(io::Error::other("the s3 layer is gone")),
        }
    }

    fn drop_cached(&self) -> io::Result<()> {
        match self.cache_port() {
            Some(port) => port.flush(0..u64::MAX).map_err(io::Error::other),
            None => Ok(()),
        }
    }

    fn discarding(&self, on: bool) {
        let mut st = self.state.lock();
        st.staged.clear();
        // What this machine's uncommitted uploads replaced is not garbage: the record
        // another machine stores next may still name it (a patch over this machine's base),
        // so it is not deleted here; the uploads themselves are left for the sweep.
        drop(self.shared.take_garbage_of(self.ino));
        if let Some(d) = &self.dist {
            d.changed.store(false, Relaxed);
            d.discarding.store(on, Relaxed);
        }
    }
}

//! The cache manager: one coherent truth for a file used through several layers at once.
//!
//! This is the coherence framework of Heidemann & Popek, "Performance of Cache Coherence in
//! Stackable Filing" (SOSP '95), with two changes the paper could not make on SunOS:
//! simply-named layers *share* their lower file's cache object (page sharing — "we were
//! unable to explore this optimization"), and tokens have reader and
//! writer modes ("Reader/writer tokens allow multiple read-only copies of pages to exist in
//! the stack concurrently … We chose not to implement this optimization").
//!
//! ## Model
//!
//! A file reached through a stack has one `Group` (the paper's *file token*, issued by the
//! bottom layer and inherited by simply-named layers). Its cached data lives in a chain of
//! *domains*: domain 0 is the stored file (bytes as the bottom layer keeps them); each
//! general layer above (compression, encryption) adds a domain with its own naming of the
//! bytes (cleartext). Each domain is one `ubc` cache object; a general layer's pager reads
//! and writes the domain below *through the cache* (raw, without tokens).
//!
//! Because every write goes down through the caches below it, a lower domain's cache is
//! never stale: it is only *behind* while an upper domain holds dirty pages. An upper
//! domain's cache goes stale when a lower domain is written. So there are two actions:
//!
//! * **flush** (Mach `pager_clean_request`): push an upper domain's dirty pages (stores
//!   through mappings included) down, domain by domain, before anyone below reads or writes
//!   the same bytes;
//! * **invalidate** (Mach `pager_flush_request`): drop an upper domain's cached pages —
//!   from every mapping too, which re-faults them — when a domain below writes those bytes.
//!
//! Tokens say when an action is needed, so that an operation whose domain already holds a
//! token for its range (the common case: one layer in use) does nothing extra (Figure 6b,
//! step 1). A **read** token on a range lets a domain use cached pages there; a **write**
//! token also lets it dirty them. Writers exclude everyone else; readers share. Granting:
//!
//! | request in `d` | holder `e` above `d` | holder `e` below `d` |
//! |---|---|---|
//! | read  | `e` writes: flush `e` down to `d`; `e` keeps a read token | `e` writes: `e` keeps a read token |
//! | write | flush `e` if it writes, invalidate `e`; `e` loses its tokens | `e` loses its tokens |
//!
//! Uncontended requests get the whole file ("the cache manager grants ownership of the
//! entire file immediately"); contended ones get the requested range.
//!
//! Memory mappings are *sticky* holders: pages are faulted and stored without asking the
//! manager, so a mapping's token cannot be taken away. An operation conflicting with one
//! runs under the file lock with the actions done before and, for invalidations, again after
//! it (a mapping may re-fault meanwhile), and gets no token to keep.
//!
//! Ranges move between domains through each general layer's [`Translate`]. A layer that
//! cannot say which bytes map where (compression) answers "the whole file".
//!
//! Locking: `Group::lock` (the paper's whole-file stack lock) serializes slow paths and
//! actions. An operation holds its domain's token lock shared for its duration; actions on
//! a domain take it exclusively, so no operation on that domain is in flight. Operations
//! never take the file lock while holding a token lock; pagers never take either.
//! The stack's table of groups (`stack.rs`, `Inner::groups`) is taken with none of these
//! held and nothing is taken under it; waiting for a group's release (an open of a file
//! whose previous group is being closed, or `sync_all`) holds no lock either: the release
//! flushes that group, so it ranks like the file lock (`ubc::order::Rank::STACK`).

use crate::sync::{Condvar, Mutex, RwLock, RwLockWriteGuard};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed, Ordering::SeqCst};

/// The whole file, as a range.
pub(crate) const ALL: Range<u64> = 0..u64::MAX;

/// How a general layer maps byte ranges between its domain (upper) and the one below.
pub trait Translate: Send + Sync {
    /// Bytes of the lower domain that upper bytes `upper` depend on: where they are
    /// stored, and the metadata needed to read or write them (a header with the length).
    fn down(&self, upper: Range<u64>) -> Vec<Range<u64>>;
    /// Upper bytes whose data lies in lower bytes `lower`; `None` if they touch metadata
    /// (the whole upper file must be treated as changed and its state reloaded).
    fn up(&self, lower: Range<u64>) -> Option<Range<u64>>;
    /// Re-read in-memory state (index, header) after the lower domain changed underneath.
    fn reload(&self) -> std::io::Result<()>;
    /// Write in-memory metadata (a header's length, an index) into the lower domain without
    /// making it durable, so that the lower bytes are a complete file for a reader there.
    /// `for_sync`: a `sync` of this file follows at once, so a layer whose metadata has a
    /// cheaper durable form than "written, then synced" (zstd: one durable commit instead of
    /// a published one and then a durable one) may answer `false`. Returns `false` if the
    /// manager must `sync` the layer's file instead (the default).
    fn flush_metadata(&self, for_sync: bool) -> std::io::Result<bool> {
        let _ = for_sync;
        Ok(false)
    }
}

/// A token between machines on a file (issue 21; `dist.rs` implements it over etcd): the
/// bottom layer gives one for a file whose store other machines share, and every operation
/// on the file through the stack pins it first — before any lock of the stack or the cache
/// is taken, since pinning may wait for other machines.
pub trait Remote: Send + Sync {
    /// Pin the token in `mode` for one operation (acquiring it first if this machine does
    /// not hold it so; a token got back after a time without it reloads every attached
    /// cache before this returns). Unpinned when the pin is dropped.
    fn pin(self: Arc<Self>, mode: Mode) -> std::io::Result<RemotePin>;
    /// For `sync`, which stores what this machine changed under its write token and must
    /// not lose that token halfway — nor take it from others: pin the write token if this
    /// machine holds it (`Some`); `None` if it does not (nothing of this machine's is
    /// unstored: it stored everything when it gave the token up); an error if changes
    /// were lost with the token (its lease expired), once.
    fn pin_for_sync(self: Arc<Self>) -> std::io::Result<Option<RemotePin>>;
    /// Attach a cache of the file's pages (a stack's group), for the token to write back,
    /// drop and reload when it is given up or got back.
    fn attach(&self, cache: std::sync::Weak<dyn RemoteCache>);
    /// Advisory locks between machines: record locks, or `flock` locks if `flock` (the two
    /// kinds never conflict). If another machine holds a lock of that kind conflicting with
    /// one of `want`, returns it and records nothing; else, if `held` is given, makes it
    /// this machine's set of such locks on the file (as one step against other machines'
    /// changes) and returns `None`. `want` empty: only records `held` (a release).
    /// `may_lag`: a lock asked again after a refusal ([`LockWait::Retry`]) — the last
    /// refusal may be given again while no change of other machines' locks was heard.
    fn locks(
        &self,
        flock: bool,
        held: Option<&[RemoteLock]>,
        want: &[RemoteLock],
        may_lag: bool,
    ) -> std::io::Result<Option<RemoteLock>>;
    /// Wait until other machines' locks of the kind (`flock`) may have changed since the
    /// last refusal by [`Remote::locks`], at most `timeout`: what a refused lock waits for
    /// before it asks again.
    fn await_locks(&self, flock: bool, timeout: std::time::Duration) {
        let _ = flock;
        std::thread::sleep(timeout.min(std::time::Duration::from_millis(20)));
    }
}

/// A lock as other machines see it: bytes of the stored file (domain 0; a `flock` lock
/// covers them all), its kind and the process holding it (0 if not known).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteLock {
    pub range: Range<u64>,
    pub exclusive: bool,
    pub pid: u32,
}

impl RemoteLock {
    /// Whether `self` and `other` (held by different machines) exclude each other.
    pub fn conflicts(&self, other: &RemoteLock) -> bool {
        (self.exclusive || other.exclusive) && overlaps(&self.range, &other.range)
    }
}

/// How long at most a lock that waits (`LockWait::Block`) for another machine's waits
/// before it asks again; it asks at once when their locks change ([`Remote::await_locks`]).
const REMOTE_LOCK_POLL: std::time::Duration = std::time::Duration::from_secs(1);

/// A pinned [`Remote`] token; dropping it ends the pin.
pub struct RemotePin(#[allow(dead_code)] Box<dyn Send>);

impl RemotePin {
    pub fn new(pin: Box<dyn Send>) -> RemotePin {
        RemotePin(pin)
    }
}

/// What a [`Remote`] token asks of a cache of its file (Mach's `pager_clean_request` and
/// `pager_flush_request`, made by another machine's need). Called with no pin of the file
/// in flight on this machine.
pub trait RemoteCache: Send + Sync {
    /// Push every layer's dirty data down into the stored file and write it into the
    /// bottom layer's pager.
    fn write_back(&self) -> std::io::Result<()>;
    /// Drop every layer's cached pages (after [`RemoteCache::write_back`]).
    fn drop_cached(&self) -> std::io::Result<()>;
    /// The stored file may have changed: drop every layer's pages and reload each layer's
    /// state and length, bottom first.
    fn reload(&self) -> std::io::Result<()>;
    /// Whether a layer of the file is mapped shared and writable: its stores are not seen
    /// one by one, so giving up the write token must take its pages out of the mapping (the
    /// next access faults, and the fault asks for the token again), not keep them.
    fn has_writable_mappings(&self) -> bool;
}

/// Token modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Read,
    Write,
}

/// A set of disjoint, sorted, non-adjacent half-open ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RangeSet(Vec<(u64, u64)>);

impl RangeSet {
    pub(crate) fn insert(&mut self, r: Range<u64>) {
        if r.start >= r.end {
            return;
        }
        let (mut a, mut b) = (r.start, r.end);
        let mut out = Vec::with_capacity(self.0.len() + 1);
        let mut placed = false;
        for &(s, e) in &self.0 {
            if e < a {
                out.push((s, e));
            } else if s > b {
                if !placed {
                    out.push((a, b));
                    placed = true;
                }
                out.push((s, e));
            } else {
                a = a.min(s);
                b = b.max(e);
            }
        }
        if !placed {
            out.push((a, b));
        }
        self.0 = out;
    }

    pub(crate) fn remove(&mut self, r: Range<u64>) {
        if r.start >= r.end {
            return;
        }
        let mut out = Vec::with_capacity(self.0.len() + 1);
        for &(s, e) in &self.0 {
            if e <= r.start || s >= r.end {
                out.push((s, e));
                continue;
            }
            if s < r.start {
                out.push((s, r.start));
            }
            if e > r.end {
                out.push((r.end, e));
            }
        }
        self.0 = out;
    }

    pub(crate) fn covers(&self, r: &Range<u64>) -> bool {
        r.start >= r.end || self.0.iter().any(|&(s, e)| s <= r.start && r.end <= e)
    }

    pub(crate) fn overlaps(&self, r: &Range<u64>) -> bool {
        r.start < r.end && self.0.iter().any(|&(s, e)| s < r.end && r.start < e)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A mapping's hold on a range of its domain (see the module docs: sticky).
#[derive(Clone, Debug)]
struct Sticky {
    id: u64,
    range: Range<u64>,
    write: bool,
}

#[derive(Default, Debug)]
pub(crate) struct Tokens {
    read: RangeSet,
    /// Subset of `read`.
    write: RangeSet,
    /// Where this domain may hold data the domains below have not seen (it wrote there,
    /// or dirty data was flushed into it from above): readers below flush it first.
    /// Superset of `write`, and kept when a reader above takes the write token away (the
    /// data is still not below; two meanings in one set lost it — schedules tests).
    dirty: RangeSet,
    /// Where this domain may hold pages although it holds no read token there: an
    /// operation that ran beside a mapping (no token can be granted then), or dirty data
    /// flushed through it from above. A write below must invalidate these pages as it
    /// does a reader's, or such pages outlive later writes (`schedules_mappings` checks
    /// it). Cleared where the domain is invalidated.
    cached: RangeSet,
    sticky: Vec<Sticky>,
}

impl Tokens {
    fn allows(&self, mode: Mode, r: &Range<u64>) -> bool {
        match mode {
            // A read also reads ahead, past `r` (ubc's read-ahead): the pages it may make
            // there must be on record (a token or `cached`), or a write below would not
            // find them (tests/stack.rs: a_write_below_finds_pages_read_ahead_past_a_token).
            Mode::Read => self.read.covers(r) && self.recorded_from(r.start),
            Mode::Write => self.write.covers(r),
        }
    }
    /// Every byte from `start` on is covered by a read token or a `cached` record.
    fn recorded_from(&self, start: u64) -> bool {
        let mut at = start;
        loop {
            let next = [&self.read, &self.cached]
                .iter()
                .flat_map(|s| s.0.iter())
                .filter(|&&(a, b)| a <= at && at < b)
                .map(|&(_, b)| b)
                .max();
            match next {
                Some(u64::MAX) => return true,
                Some(b) => at = b,
                None => return false,
            }
        }
    }
    fn sticky_overlaps(&self, r: &Range<u64>, write_only: bool) -> bool {
        self.sticky.iter().any(|s| (s.write || !write_only) && s.range.start < r.end && r.start < s.range.end)
    }
    /// This domain may hold pages in `r` (a token, a mapping, or pages cached without one).
    fn may_cache(&self, r: &Range<u64>) -> bool {
        self.read.overlaps(r) || self.cached.overlaps(r) || self.sticky_overlaps(r, false)
    }
    /// Its pages in `r` were dropped: it holds nothing there any more but what a mapping
    /// re-faults (the mapping itself is still recorded).
    fn forget(&mut self, r: &Range<u64>) {
        self.read.remove(r.clone());
        self.write.remove(r.clone());
        self.dirty.remove(r.clone());
        self.cached.remove(r.clone());
    }
}

/// What the manager does to a domain's cache object: `ubc::File`'s own methods. A trait so
/// that the protocol can be driven by a model whose actions record what they did (the
/// `schedules` tests); production code only ever uses `ubc::File` (monomorphized: no cost).
pub(crate) trait Actions {
    /// Write back the dirty pages in byte range `r` ([`ubc::File::clean`]).
    fn clean(&self, r: Range<u64>) -> ubc::Result<()>;
    /// Write back everything and make it durable ([`ubc::File::sync`]).
    fn sync(&self) -> ubc::Result<()>;
    /// Clean, then drop, the pages in `r` ([`ubc::File::invalidate`]).
    fn invalidate(&self, r: Range<u64>, length: ubc::Length) -> ubc::Result<()>;
}

impl Actions for ubc::File {
    #[inline]
    fn clean(&self, r: Range<u64>) -> ubc::Result<()> {
        ubc::File::clean(self, r)
    }
    #[inline]
    fn sync(&self) -> ubc::Result<()> {
        ubc::File::sync(self)
    }
    #[inline]
    fn invalidate(&self, r: Range<u64>, length: ubc::Length) -> ubc::Result<()> {
        ubc::File::invalidate(self, r, length)
    }
}

/// One domain of a file: a cache object and how to reach the domain below it.
pub(crate) struct Domain<F = ubc::File> {
    /// `None` for domain 0 (the stored bytes). Declared before `file` so that it is dropped
    /// first: it holds the layer's pager too, and a pager's drop may still write (an aead
    /// header, a zstd commit) — which must happen while the file handle keeps the cache
    /// running. Dropped after it, the pager outlived the cache's last handle and its shutdown
    /// (final write-back), and the write would be lost: a closed aead file would lose its
    /// extended length (tests/crash.rs).
    pub(crate) xlate: Option<Arc<dyn Translate>>,
    pub(crate) file: F,
    tokens: RwLock<Tokens>,
}

fn layer_err(action: &'static str, source: std::io::Error) -> ubc::Error {
    ubc::Error::LayerMetadata { action, source }
}

impl Domain<ubc::File> {
    /// Close a domain nobody else uses: its layer's pager first (see `xlate`), then its
    /// file, waiting for the cache's work on the file to let go ([`ubc::File::close_and_wait`]),
    /// so that a file that left the cache has its pager — and what that holds open — closed
    /// on return. A domain still shared is just dropped. => no lock of the stack or the
    /// cache held.
    pub(crate) fn close_and_wait(self: Arc<Self>) {
        match Arc::try_unwrap(self) {
            Ok(Domain { xlate, file, tokens }) => {
                drop((xlate, tokens));
                file.close_and_wait();
            }
            Err(shared) => drop(shared),
        }
    }
}

impl<F: Actions> Domain<F> {
    /// Push this domain's dirty pages in `ranges` (stores through mappings included) and
    /// its layer's metadata (a length only in memory) into the domain below, so that the
    /// bytes below are a complete, current file. A layer that cannot write its metadata
    /// short of a full `sync` is synced (see [`Translate::flush_metadata`]; `flush` says
    /// whether a sync follows).
    fn push_down(&self, ranges: &[Range<u64>], flush: Flush) -> ubc::Result<()> {
        for r in ranges {
            self.file.clean(r.clone())?;
        }
        if let Some(x) = &self.xlate
            && !x.flush_metadata(flush == Flush::ForSync).map_err(|e| layer_err("writing", e))?
        {
            self.file.sync()?;
        }
        Ok(())
    }
}

/// Why data is pushed down: for readers below (a close, another layer's access) — layers
/// publish their metadata the cheap way — or for a `sync` that follows at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flush {
    Publish,
    ForSync,
}

/// Writes through the stack into a file's domains, as a general layer's pager above them
/// must know of them. A mapping's fault fills its pages from the domain below without the
/// file lock (a fault cannot wait for the manager: the writer's invalidations wait for the
/// pages being filled), so a fill may read stored bytes while a write into them is half
/// done — part old, part new — or after it but before the layers above have reloaded their
/// metadata (a header's length, a zstd index) from the new bytes. The write's post-actions
/// (`Permit::Once`) drop whatever such a fill made; the fill need only not *fail*. A
/// layer that authenticates or decodes what it reads does fail on the mix (an
/// authentication error for `aead`; a checksum or an end of file for `zstd`), and the
/// mapping's reader died of SIGBUS (the two `a_mapping_…_as_one_version_or_the_other`
/// tests in tests/stack.rs). Such a pager reads through
/// [`LowerWrites::settled`]. The counts are a seqcount for many writers: `begun` read after
/// a read equal to `done` read before it says that no write overlapped the read.
#[derive(Default, Debug)]
pub struct LowerWrites {
    begun: AtomicU64,
    done: AtomicU64,
}

/// The error of a read that kept failing while writes ran beside it: the read's own error
/// (an [`AuthError`](crate::encrypt::AuthError) stays findable through it) as the source.
#[derive(Debug)]
struct TornRead(std::io::Error);

impl std::fmt::Display for TornRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "read while the file below was being rewritten through the stack (ask again): {}", self.0)
    }
}

impl std::error::Error for TornRead {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// One write in flight, from its permit to the end of its post-actions (see
/// [`LowerWrites`]); counted done when dropped.
pub(crate) struct LowerWrite<'a>(&'a LowerWrites);

impl Drop for LowerWrite<'_> {
    fn drop(&mut self) {
        self.0.done.fetch_add(1, SeqCst);
    }
}

impl LowerWrites {
    /// Tries of a failing read while writes run beside it before it is given up as
    /// interrupted: together about half a millisecond, longer than most writes of a few
    /// pages, short for a writer waiting to invalidate the pages the caller is filling.
    const TRIES: u32 = 8;

    pub(crate) fn begin(&self) -> LowerWrite<'_> {
        self.begun.fetch_add(1, SeqCst);
        LowerWrite(self)
    }

    /// Run `read` (a pager's read and decoding of the domain below) and return what it
    /// returns, unless it failed while a write through the stack was in flight: then run it
    /// again a little later, until it succeeds or fails with no write beside it (a real
    /// error: returned as it is). If writes are still in flight after `TRIES` tries, the
    /// error is returned as [`std::io::ErrorKind::Interrupted`]: the stored bytes are
    /// changing, ask again — the cache then faults the mapping's access again instead of
    /// raising SIGBUS, after the caller has let go of the pages it was filling (which the
    /// writer's invalidations wait for). A fill never waits for the writer itself.
    pub fn settled<T>(&self, mut read: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
        let mut tries = 0;
        loop {
            let before = self.done.load(SeqCst);
            let r = read();
            let Err(e) = r else { return r };
            if self.begun.load(SeqCst) == before {
                return Err(e);
            }
            tries += 1;
            if tries >= Self::TRIES {
                return Err(std::io::Error::new(std::io::ErrorKind::Interrupted, TornRead(e)));
            }
            if tries < 4 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(20 << tries));
            }
        }
    }
}

/// Counters of coherence work, for statistics and benchmarks.
#[derive(Default, Debug)]
pub(crate) struct Counters {
    pub(crate) slow: AtomicU64,
    pub(crate) flushes: AtomicU64,
    pub(crate) invalidations: AtomicU64,
}

/// Coherence statistics of a stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CoherenceStats {
    /// Operations that registered with the manager.
    pub slow_path: u64,
    /// Flush actions (dirty data pushed down for another domain).
    pub flushes: u64,
    /// Invalidate actions (cached pages dropped because a lower domain wrote).
    pub invalidations: u64,
}

/// A file of the stack: its token ("file token"), whole-file lock and domains.
pub(crate) struct Group<F = ubc::File> {
    /// Whole-file stack lock, around every coherence action.
    lock: Mutex<()>,
    domains: RwLock<Vec<Arc<Domain<F>>>>,
    next_sticky: AtomicU64,
    counters: Arc<Counters>,
    /// Coherence off (benchmark baseline only): every domain acts alone, as in a stack
    /// without a manager.
    disabled: bool,
    /// Advisory byte-range locks, in domain-0 bytes.
    locks: Mutex<Vec<RangeLock>>,
    locks_cv: Condvar,
    /// BSD `flock(2)` locks: `(owner, exclusive)`, each on the whole file in every layer at
    /// once, held by an open file description. Apart from the record locks above: on Linux
    /// the two kinds never conflict with each other.
    flocks: Mutex<Vec<(u64, bool)>>,
    flocks_cv: Condvar,
    /// When the file's data last changed through the stack (the attribute group's often
    /// changing part). POSIX moves `mtime` and `ctime` at the write; a store moves its own
    /// only when the cache writes back, later. `None` after a time was set explicitly.
    modified: Mutex<Option<std::time::SystemTime>>,
    /// Held from reading the length to the end of the write by an append, so that
    /// concurrent appenders (any layer, any mount) never write at the same end.
    pub(crate) appending: Mutex<()>,
    /// Writes in flight into the domains, for the general layers' pagers above them.
    pub(crate) lower_writes: Arc<LowerWrites>,
    /// The file's token between machines, for a store other machines share (issue 21).
    remote: std::sync::OnceLock<Arc<dyn Remote>>,
    /// Told when the token made this group drop its pages ([`RemoteCache::drop_cached`]):
    /// another machine may change the file now, so caches outside the stack (a mount's
    /// kernel) must drop theirs too.
    remote_dropped: std::sync::OnceLock<RemoteDropped>,
}

/// What [`Group::set_remote`] is given to call after the token dropped the group's pages:
/// on the token's thread, holding no lock of the stack or the cache, before the token goes
/// to the other machine.
pub(crate) type RemoteDropped = Box<dyn Fn() + Send + Sync>;

/// One owner's lock on bytes `range` of `domain`, as POSIX record locks keep them: an
/// owner's later lock or unlock over part of it replaces or splits it.
#[derive(Clone, Debug)]
struct RangeLock {
    owner: u64,
    /// The process shown by `F_GETLK` (0 when the taker gave none).
    pid: u32,
    domain: usize,
    range: Range<u64>,
    /// `range` in domain-0 bytes, where every layer's locks meet (conflicts are decided
    /// there). A piece left by a split keeps its whole lock's ranges above domain 0: a
    /// superset, which may conflict more than needed but never less.
    lower: Vec<Range<u64>>,
    exclusive: bool,
}

/// A lock that conflicts with one asked for (`F_GETLK`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockConflict {
    /// The conflicting lock's bytes, in the asker's layer when it was taken there, else the
    /// asked range.
    pub range: Range<u64>,
    pub kind: LockKind,
    pub pid: u32,
}

impl RangeLock {
    /// Whether this lock keeps `owner` from a lock (`exclusive` or shared) on bytes `r` of
    /// domain `d` (`lower`: `r` in domain-0 bytes): another owner's, overlapping, and one of
    /// the two exclusive.
    fn blocks(&self, owner: u64, exclusive: bool, d: usize, r: &Range<u64>, lower: &[Range<u64>]) -> bool {
        self.owner != owner && (self.exclusive || exclusive) && self.meets(d, r, lower)
    }

    /// Whether this lock covers any of bytes `r` of domain `d` (`lower`: `r` in domain-0
    /// bytes). Locks of one layer compare in its own bytes, exactly; across layers they
    /// compare in the stored bytes, where a general layer's range grows to whole blocks
    /// or chunks.
    fn meets(&self, d: usize, r: &Range<u64>, lower: &[Range<u64>]) -> bool {
        if self.domain == d {
            overlaps(&self.range, r)
        } else {
            self.lower.iter().any(|a| lower.iter().any(|b| overlaps(a, b)))
        }
    }
}

fn overlaps(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

/// Remove `owner`'s hold on bytes `r` of domain `d` from `locks`, splitting the locks it
/// cuts (POSIX: an unlock, or a new lock replacing an old one's type, over part of it).
fn carve(locks: &mut Vec<RangeLock>, owner: u64, d: usize, r: &Range<u64>) {
    let mut kept = Vec::with_capacity(locks.len());
    for x in locks.drain(..) {
        if x.owner != owner || x.domain != d || !overlaps(&x.range, r) {
            kept.push(x);
            continue;
        }
        for piece in [x.range.start..r.start.max(x.range.start), r.end.min(x.range.end)..x.range.end] {
            if piece.start < piece.end {
                let lower = if d == 0 { vec![piece.clone()] } else { x.lower.clone() };
                kept.push(RangeLock { range: piece, lower, ..x.clone() });
            }
        }
    }
    *locks = kept;
}

/// What an operation that conflicted with a mapping does once it is done (see `revoke`).
#[derive(Debug)]
pub(crate) enum PostAction {
    /// Invalidate domain `.0` over ranges `.1` (reloading its state if `.2`): a mapping at
    /// or above it may have re-faulted pages from before the write.
    Invalidate(usize, Vec<Range<u64>>, bool),
    /// Push what domain `from` wrote over its bytes `range` down, domain by domain, to
    /// domain `to`, where a mapping is: the mapping sees the write at once, and no domain
    /// above the mapping keeps data newer than the mapped pages (its unmap could not tell
    /// which is newer).
    PushDown { from: usize, to: usize, range: Range<u64> },
}

/// An operation's permission: keep it alive for the duration of the operation.
pub(crate) enum Permit<'a, F: Actions = ubc::File> {
    /// The domain holds a token: its lock is held shared.
    Token(#[allow(dead_code)] crate::sync::RwLockReadGuard<'a, Tokens>),
    /// A conflict with a mapping: the file lock is held; invalidations run again on drop,
    /// and a write's `writing` ends after them (the layers above have reloaded by then).
    Once {
        group: &'a Group<F>,
        _lock: crate::sync::MutexGuard<'a, ()>,
        post: Vec<PostAction>,
        writing: Option<LowerWrite<'a>>,
    },
    /// Coherence is off.
    Off,
}

impl<F: Actions> Drop for Permit<'_, F> {
    fn drop(&mut self) {
        if let Permit::Once { group, post, writing, .. } = self {
            let doms = group.domains.read().clone();
            for action in post.drain(..) {
                // Best effort: an error here (a failing writeback of a mapping's stores, or
                // of the data pushed down) stays with the pages, which remain dirty and
                // marked so; it is reported at sync.
                match action {
                    PostAction::Invalidate(e, ranges, reload) => {
                        let mut t = doms[e].tokens.write();
                        if group.invalidate_locked(&doms[e], &ranges, reload, false).is_ok() {
                            for x in &ranges {
                                t.cached.remove(x.clone());
                            }
                        }
                    }
                    PostAction::PushDown { from, to, range } => {
                        let _ = group.push_down_to(&doms, from, to, range);
                    }
                }
            }
            // Every domain above is current again: fills interrupted meanwhile succeed now.
            writing.take();
        }
    }
}

impl Group {
    pub(crate) fn new(counters: Arc<Counters>, coherence: Coherence) -> Group {
        Group::with_actions(counters, coherence)
    }
}

impl Group {
    /// Make `remote` this file's token between machines and attach the group to it;
    /// `dropped` is called each time the token drops the group's pages.
    pub(crate) fn set_remote(self: &Arc<Self>, remote: Arc<dyn Remote>, dropped: RemoteDropped) {
        let _ = self.remote_dropped.set(dropped);
        if self.remote.set(remote.clone()).is_ok() {
            let me: Arc<dyn RemoteCache> = self.clone();
            remote.attach(Arc::downgrade(&me));
        }
    }
}

impl RemoteCache for Group {
    fn write_back(&self) -> std::io::Result<()> {
        self.flush_dirty_above(0, Flush::Publish).map_err(std::io::Error::other)?;
        if let Some(d) = self.domain(0) {
            d.file.clean(ALL)?;
        }
        Ok(())
    }

    fn drop_cached(&self) -> std::io::Result<()> {
        {
            let _g = self.lock.lock();
            let doms = self.domains.read().clone();
            for e in doms.iter().rev() {
                let mut t = e.tokens.write();
                e.file.invalidate(ALL, ubc::Length::Keep)?;
                t.forget(&ALL);
            }
        }
        if let Some(f) = self.remote_dropped.get() {
            f();
        }
        Ok(())
    }

    fn has_writable_mappings(&self) -> bool {
        self.domains.read().iter().any(|e| e.tokens.read().sticky.iter().any(|s| s.write))
    }

    fn reload(&self) -> std::io::Result<()> {
        let _g = self.lock.lock();
        let doms = self.domains.read().clone();
        // Bottom first: each layer reloads from the bytes below it, reloaded already.
        for e in doms.iter() {
            let mut t = e.tokens.write();
            self.invalidate_locked(e, &[ALL], true, false)?;
            t.forget(&ALL);
        }
        Ok(())
    }
}

impl<F: Actions> Group<F> {
    /// A group whose domains' cache objects are `F`s (`ubc::File` but in the model tests).
    pub(crate) fn with_actions(counters: Arc<Counters>, coherence: Coherence) -> Group<F> {
        let disabled = coherence == Coherence::Off;
        Group {
            lock: Mutex::new(()),
            domains: RwLock::new(Vec::new()),
            next_sticky: AtomicU64::new(1),
            counters,
            disabled,
            locks: Mutex::new(Vec::new()),
            locks_cv: Condvar::new(),
            flocks: Mutex::new(Vec::new()),
            flocks_cv: Condvar::new(),
            modified: Mutex::new(None),
            appending: Mutex::new(()),
            lower_writes: Arc::new(LowerWrites::default()),
            remote: std::sync::OnceLock::new(),
            remote_dropped: std::sync::OnceLock::new(),
        }
    }

    /// For a `sync` (see [`Remote::pin_for_sync`]): `Ok(None)` if the file is not shared
    /// with other machines (sync as usual), `Ok(Some(Some(pin)))` if this machine holds the
    /// write token (sync under the pin), `Ok(Some(None))` if there is nothing of this
    /// machine's to sync.
    pub(crate) fn pin_remote_for_sync(&self) -> ubc::Result<Option<Option<RemotePin>>> {
        let Some(r) = self.remote.get() else { return Ok(None) };
        ubc::order::check_wait(ubc::order::Rank::STACK);
        r.clone().pin_for_sync().map(Some).map_err(|e| layer_err("syncing", e))
    }

    /// Pin the file's token between machines for one operation in `mode`, if the store is
    /// shared with other machines (`None` otherwise). => nothing of the stack or the cache
    /// held (pinning may wait for other machines, and reloads this group).
    pub(crate) fn pin_remote(&self, mode: Mode) -> ubc::Result<Option<RemotePin>> {
        match self.remote.get() {
            None => Ok(None),
            Some(r) => {
                ubc::order::check_wait(ubc::order::Rank::STACK);
                r.clone().pin(mode).map(Some).map_err(|e| layer_err("taking the token of", e))
            }
        }
    }

    /// Note that the data changed now (a write or a resize through any domain).
    pub(crate) fn note_modified(&self) {
        *self.modified.lock() = Some(std::time::SystemTime::now());
    }

    /// When the data last changed through the stack, unless a time was set since.
    pub(crate) fn modified(&self) -> Option<std::time::SystemTime> {
        *self.modified.lock()
    }

    /// A modification time was set explicitly (`utimensat`): the store's is the truth now.
    pub(crate) fn forget_modified(&self) {
        *self.modified.lock() = None;
    }

    /// The domain at `index`, if opened.
    pub(crate) fn domain(&self, index: usize) -> Option<Arc<Domain<F>>> {
        self.domains.read().get(index).cloned()
    }

    pub(crate) fn depth(&self) -> usize {
        self.domains.read().len()
    }

    /// Take the domains out, bottom first, leaving none: for closing the group, whose
    /// closer drops them top first (see `stack.rs`, `Inner::drop_domains`). => nobody uses
    /// the group any more.
    pub(crate) fn take_domains(&self) -> Vec<Arc<Domain<F>>> {
        std::mem::take(&mut *self.domains.write())
    }

    /// Add the domain at `index` (domains are added bottom-up, each once) and return it, or
    /// the one already there. => domain `index - 1` exists.
    pub(crate) fn add_domain(
        &self,
        index: usize,
        make: impl FnOnce() -> crate::error::Result<(F, Option<Arc<dyn Translate>>)>,
    ) -> crate::error::Result<Arc<Domain<F>>> {
        if let Some(d) = self.domain(index) {
            return Ok(d);
        }
        let _g = self.lock.lock();
        if let Some(d) = self.domain(index) {
            return Ok(d);
        }
        let (file, xlate) = make()?;
        let d = Arc::new(Domain { file, xlate, tokens: RwLock::new(Tokens::default()) });
        let mut v = self.domains.write();
        assert_eq!(v.len(), index, "domains are added bottom-up");
        v.push(d.clone());
        Ok(d)
    }

    /// Translate `r` from domain `from` to domain `to`. The flag says the translation lost
    /// precision going up ("whole file": the layers there must reload their state).
    fn translate(doms: &[Arc<Domain<F>>], from: usize, to: usize, r: Range<u64>) -> (Vec<Range<u64>>, bool) {
        let mut cur = vec![r];
        let mut reload = false;
        if to < from {
            for k in (to + 1..=from).rev() {
                let x = doms[k].xlate.as_ref().expect("an upper domain translates");
                cur = cur.into_iter().flat_map(|r| x.down(r)).collect();
            }
        } else {
            for dom in &doms[from + 1..=to] {
                let x = dom.xlate.as_ref().expect("an upper domain translates");
                let mut next = Vec::new();
                for r in cur {
                    match x.up(r) {
                        Some(u) => next.push(u),
                        None => {
                            next = vec![ALL];
                            reload = true;
                            break;
                        }
                    }
                }
                cur = next;
                if reload {
                    // Everything above is whole-file too.
                    cur = vec![ALL];
                }
            }
        }
        (cur, reload)
    }

    /// Permission for an operation in domain `d` on bytes `r` (in `d`'s naming).
    /// Figure 6b: use the token if held; else register, revoking conflicting holders.
    pub(crate) fn acquire<'a>(
        &'a self,
        dom: &'a Domain<F>,
        d: usize,
        r: Range<u64>,
        mode: Mode,
    ) -> ubc::Result<Permit<'a, F>> {
        if self.disabled {
            return Ok(Permit::Off);
        }
        // The cache manager's locks come before any cache work (`ubc::order`): a pager, or
        // anyone holding pages, must never enter the protocol (its revocations flush and
        // invalidate files that may be waiting for what the caller holds).
        ubc::order::check_wait(ubc::order::Rank::STACK);
        // The fast path: one shared lock and a range check, nothing counted (a shared
        // counter here would cost more than the rest).
        let t = dom.tokens.read();
        if t.allows(mode, &r) {
            return Ok(Permit::Token(t));
        }
        drop(t);
        self.counters.slow.fetch_add(1, Relaxed);
        let g = self.lock.lock();
        // From here to the end of the write (the permit's): the revocation's flushes write
        // below too.
        let writing = (mode == Mode::Write).then(|| self.lower_writes.begin());
        let doms = self.domains.read().clone();
        debug_assert!(std::ptr::eq(dom, &*doms[d]), "acquire: dom is domain d");
        let (sticky_post, inherit_write) = self.revoke(&doms, d, r.clone(), mode)?;
        match sticky_post {
            None => {
                // Grant: the whole file if nobody else holds anything, else the range.
                let alone = doms.iter().enumerate().all(|(e, x)| {
                    e == d || {
                        let t = x.tokens.read();
                        // `cached` too: a whole-file write token would let later writes
                        // skip the pages held there (schedules_mappings).
                        t.read.is_empty() && t.sticky.is_empty() && t.cached.is_empty()
                    }
                });
                let grant = if alone { ALL } else { r.clone() };
                let mut t = dom.tokens.write();
                t.read.insert(grant.clone());
                if mode == Mode::Read && !alone {
                    // Its read-ahead (see `Tokens::allows`).
                    t.cached.insert(r.start..ALL.end);
                }
                if mode == Mode::Write || inherit_write {
                    t.dirty.insert(grant.clone());
                }
                if mode == Mode::Write {
                    t.write.insert(grant);
                }
                // Keep the token from the grant on, without a moment unlocked: released and
                // taken again after the file lock, it could be revoked in between, and two
                // domains could revoke each other's fresh tokens forever (a livelock the
                // schedules tests found).
                let t = RwLockWriteGuard::downgrade(t);
                // No mapping above shares these bytes: no fill beside the write.
                drop(writing);
                drop(g);
                Ok(Permit::Token(t))
            }
            Some(post) => {
                // No token, but what this operation writes (or received from above) is
                // still not below: readers there must flush it (schedules tests: they did
                // not, and read old data).
                let mut t = dom.tokens.write();
                if mode == Mode::Write || inherit_write {
                    t.dirty.insert(r.clone());
                }
                // It fills pages here without a token — a read, read-ahead past `r` too: a
                // later write below must find them.
                t.cached.insert(if mode == Mode::Read { r.start..ALL.end } else { r });
                drop(t);
                Ok(Permit::Once { group: self, _lock: g, post, writing })
            }
        }
    }

    /// Revoke what conflicts with (`d`, `r`, `mode`). Returns `Some(post-actions)` when a
    /// mapping conflicts (no token may be granted), else `None`. => file lock held.
    ///
    /// The `bool` says whether d must be marked dirty although it asked to read: dirty data
    /// was flushed into it from above, and the domains below have not seen it — they must
    /// flush d before they read, as if d had written. (It gets no write token: its own
    /// writes must still revoke the readers above.)
    fn revoke(
        &self,
        doms: &[Arc<Domain<F>>],
        d: usize,
        r: Range<u64>,
        mode: Mode,
    ) -> ubc::Result<(Option<Vec<PostAction>>, bool)> {
        let n = doms.len();
        let write = mode == Mode::Write;
        let mut sticky = false;
        let mut post = Vec::new();

        // Mappings above d conflict with a write there, and writable ones with anything.
        for e in d + 1..n {
            let (re, _) = Self::translate(doms, d, e, r.clone());
            let t = doms[e].tokens.read();
            sticky |= re.iter().any(|x| t.sticky_overlaps(x, true) || write && t.sticky_overlaps(x, false));
        }

        // 1. Domains above d holding dirty data (`dirty`, or a writable mapping) push
        //    it down, top first, to d.
        let flushed = self.flush_down_to(doms, d, &r)?;

        // Dirty data now in d (not the store domain) is news to the domains below.
        let inherit_write = !write && flushed && d > 0;
        let write_below = write || inherit_write;

        // 2. A write in d makes the domains above stale where it writes: drop their pages
        //    and tokens. Mappings there are invalidated again after the write (they may
        //    re-fault meanwhile), from d + 1 up to the highest one, bottom first; and so is
        //    every layer above that one which reloads its state (a zstd index, an aead
        //    length): it reloaded just now, from the bytes before the write, and no token
        //    below is left to make its next operation reload (it read the old version:
        //    tests/stack.rs, a_restore_at_the_bottom_beside_a_middle_mapping_…).
        if write && let Some(top) = self.invalidate_above(doms, d, &r)? {
            for e in d + 1..doms.len() {
                let (re, reload) = Self::translate(doms, d, e, r.clone());
                if e <= top || reload {
                    post.push(PostAction::Invalidate(e, re, reload));
                }
            }
        }

        // 3. Domains below d lose what conflicts (no data action: their caches are updated
        //    in place when d's data comes down; what they hold dirty stays marked so, for
        //    readers below them). If one of them *wrote* there (a write token or a
        //    writable mapping), every domain from it up to d may cache bytes — or metadata
        //    — from before that write: invalidate them, bottom first.
        //    A write in d over bytes mapped below (the lowest such mapping at `mapped_below`)
        //    is pushed down to that mapping once done, so that its loads see the write at once.
        let mut stale_from: Option<(usize, Vec<Range<u64>>)> = None;
        let mut mapped_below: Option<usize> = None;
        for e in 0..d {
            let (re, _) = Self::translate(doms, d, e, r.clone());
            let mut t = doms[e].tokens.write();
            let wrote = re.iter().any(|x| t.write.overlaps(x));
            let maps_w = re.iter().any(|x| t.sticky_overlaps(x, true));
            if write && mapped_below.is_none() && re.iter().any(|x| t.sticky_overlaps(x, false)) {
                mapped_below = Some(e);
            }
            for x in &re {
                if write_below {
                    t.read.remove(x.clone());
                }
                t.write.remove(x.clone());
            }
            drop(t);
            sticky |= maps_w;
            if (wrote || maps_w) && stale_from.is_none() {
                stale_from = Some((e, re));
            }
        }
        if let Some(m) = mapped_below {
            sticky = true;
            post.insert(0, PostAction::PushDown { from: d, to: m, range: r.clone() });
        }
        if let Some((e, re)) = stale_from {
            for k in e + 1..=d {
                let mut reload = false;
                let mut rk = Vec::new();
                for x in &re {
                    let (v, rl) = Self::translate(doms, e, k, x.clone());
                    reload |= rl;
                    rk.extend(v);
                }
                let mut t = doms[k].tokens.write();
                // k's own dirty data is newer than what is below — the "write" below may be
                // data k itself flushed down — so it goes down first.
                let newer = rk.iter().any(|x| t.dirty.overlaps(x));
                self.invalidate_locked(&doms[k], &rk, reload, newer)?;
                if k < d {
                    // `dirty` stays: the invalidation cleaned k's dirty pages into k-1, which
                    // was invalidated before (bottom first), and readers below must still
                    // flush them on from there (a flush from k passes through k-1).
                    for x in &rk {
                        t.read.remove(x.clone());
                        t.write.remove(x.clone());
                        t.cached.remove(x.clone());
                    }
                }
            }
        }
        if sticky {
            return Ok((Some(post), inherit_write));
        }
        Ok((None, inherit_write))
    }

    /// Push the dirty data of domains above `d` over `r` (in d's bytes) — `dirty` records
    /// and writable mappings' stores — down into d, top first: flushing e puts its data
    /// into e-1, flushed next, and so on to d. A general layer's flush includes its
    /// metadata (header, index), or the bytes below would not be a complete file. Returns
    /// whether anything was flushed. => file lock held.
    fn flush_down_to(&self, doms: &[Arc<Domain<F>>], d: usize, r: &Range<u64>) -> ubc::Result<bool> {
        let top = (d + 1..doms.len()).rev().find(|&e| {
            let (re, _) = Self::translate(doms, d, e, r.clone());
            let t = doms[e].tokens.read();
            re.iter().any(|x| t.dirty.overlaps(x) || t.sticky_overlaps(x, true))
        });
        let Some(top) = top else { return Ok(false) };
        self.push_chain(doms, d, d, top, r)?;
        Ok(true)
    }

    /// Push domains `top` down to `low + 1` down, top first, over bytes `r` of domain
    /// `base`: each one's data goes into the domain below it. Readers below now see the
    /// data: each keeps only a read token (if it had one: a domain the push passed through,
    /// or a mapping's, holds pages without one — recorded as `cached`, so that a write below
    /// drops them). => file lock held.
    fn push_chain(
        &self,
        doms: &[Arc<Domain<F>>],
        base: usize,
        low: usize,
        top: usize,
        r: &Range<u64>,
    ) -> ubc::Result<()> {
        for e in (low + 1..=top).rev() {
            let (re, _) = Self::translate(doms, base, e, r.clone());
            let mut t = doms[e].tokens.write();
            doms[e].push_down(&re, Flush::Publish)?;
            for x in &re {
                t.write.remove(x.clone());
                t.dirty.remove(x.clone());
                t.cached.insert(x.clone());
            }
            self.counters.flushes.fetch_add(1, Relaxed);
        }
        Ok(())
    }

    /// Bytes `r` of domain `d` are (about to be) written: drop every page of the domains
    /// above that may hold them, with their tokens. A domain caches pages where it holds a
    /// token or `cached` record, and also where a domain above it does (that one's reads
    /// fill the caches below it, raw), so every domain up to the highest holder may be
    /// stale (schedules tests). They are quiesced top first, holding them all (an operation
    /// in flight above a domain would fill it again: a fill racing its invalidation kept an
    /// old page), then invalidated bottom first (a layer reloading its metadata reads a
    /// lower domain that is already current). Returns the highest domain with a mapping
    /// there, if any. => file lock held; nothing above d is dirty there (flushed first).
    fn invalidate_above(&self, doms: &[Arc<Domain<F>>], d: usize, r: &Range<u64>) -> ubc::Result<Option<usize>> {
        let n = doms.len();
        let top_holder = (d + 1..n).rev().find(|&e| {
            let (re, _) = Self::translate(doms, d, e, r.clone());
            let t = doms[e].tokens.read();
            re.iter().any(|x| t.may_cache(x))
        });
        let mut post_top = None;
        let mut held = Vec::new();
        for e in (d + 1..n).rev() {
            let (re, reload) = Self::translate(doms, d, e, r.clone());
            let t = doms[e].tokens.read();
            let mapped = re.iter().any(|x| t.sticky_overlaps(x, false));
            drop(t);
            if mapped && post_top.is_none() {
                post_top = Some(e);
            }
            if top_holder.is_some_and(|h| e <= h) || reload {
                held.push((e, re, reload, doms[e].tokens.write()));
            }
        }
        while let Some((e, re, reload, mut t)) = held.pop() {
            self.invalidate_locked(&doms[e], &re, reload, false)?;
            for x in &re {
                t.forget(x);
            }
        }
        Ok(post_top)
    }

    /// Push what domain `from` wrote over its bytes `r` down to domain `to` (a mapping
    /// there sees it), domain by domain. => file lock held.
    fn push_down_to(&self, doms: &[Arc<Domain<F>>], from: usize, to: usize, r: Range<u64>) -> ubc::Result<()> {
        self.push_chain(doms, from, to, from, &r)?;
        if to > 0 {
            // The data is in `to` now, not below it yet: readers below flush it.
            let (rt, _) = Self::translate(doms, from, to, r);
            let mut t = doms[to].tokens.write();
            for x in rt {
                t.dirty.insert(x);
            }
        }
        Ok(())
    }

    /// Drop domain `e`'s cached pages in `ranges` (after cleaning them). With `reload`, the
    /// layer re-reads its state and the length. => file lock held, `e`'s tokens held.
    ///
    /// `flush_first`: e holds data newer than the domain below (its own writes): clean it
    /// and write its metadata down before reloading. Without it, a reload trusts the
    /// domain below — which was just changed underneath — and e's in-memory state is
    /// dropped (flushing it would overwrite the new bytes below with stale metadata).
    fn invalidate_locked(
        &self,
        e: &Domain<F>,
        ranges: &[Range<u64>],
        reload: bool,
        flush_first: bool,
    ) -> ubc::Result<()> {
        self.counters.invalidations.fetch_add(1, Relaxed);
        if reload {
            if flush_first {
                // What this domain holds that is not below yet goes down first: the
                // reload would otherwise forget it.
                e.push_down(&[ALL], Flush::Publish)?;
            }
            e.file.invalidate(ALL, ubc::Length::Keep)?;
            if let Some(x) = &e.xlate {
                x.reload().map_err(|err| layer_err("reloading", err))?;
            }
            // Pages a mapping re-faulted with the old state in between go too.
            return e.file.invalidate(ALL, ubc::Length::Reload);
        }
        for r in ranges {
            e.file.invalidate(r.clone(), ubc::Length::Keep)?;
        }
        Ok(())
    }

    /// Register a mapping of `r` in domain `d` (after acquiring a token for it). Returns
    /// the id to give to [`Group::unmap`].
    pub(crate) fn map(&self, d: usize, r: Range<u64>, write: bool) -> u64 {
        let id = self.next_sticky.fetch_add(1, Relaxed);
        if !self.disabled {
            let dom = self.domain(d).expect("domain open");
            // Under the file lock: a revocation decides from the mappings it sees first
            // whether its operation may have a token, and acts on the ones it sees later;
            // one registered in between got no post-action invalidation, and kept a page
            // from before the write (schedules_mappings_concurrent).
            let _g = self.lock.lock();
            dom.tokens.write().sticky.push(Sticky { id, range: r, write });
        }
        id
    }

    /// Remove mapping `id` of domain `d`. => the mapping is already unmapped (its stores
    /// found and marked dirty).
    ///
    /// A writable mapping's stores stay behind as dirty pages of d, newer than anything
    /// above it: operations above ran beside the mapping without tokens (their writes were
    /// pushed down at once) and may have cached pages from before its last stores. Those
    /// pages are dropped now — the same invalidation a write in d does — and d gets what it
    /// would hold after such a write: a write token where no other domain holds a token or
    /// mapping (so that its next operations take the fast path, and a reader elsewhere
    /// flushes or invalidates as for any write), else just the record that its data is not
    /// below yet. (A write token given at unmap alone would let d's next read skip data
    /// written above meanwhile, and pages above would outlive the mapping's stores:
    /// `schedules_mappings` checks both.) A read-only mapping's hold ends; the pages it faulted are
    /// recorded as cached (without a token they were invisible to later writes below). Errors (a failing
    /// write-back while invalidating) stay with the pages, which remain dirty.
    pub(crate) fn unmap(&self, d: usize, id: u64) {
        let Some(dom) = self.domain(d) else { return };
        let _g = self.lock.lock();
        let s = {
            let mut t = dom.tokens.write();
            let Some(i) = t.sticky.iter().position(|s| s.id == id) else { return };
            let s = t.sticky.remove(i);
            // The pages it faulted stay cached, token or not: a write below must find them.
            t.cached.insert(s.range.clone());
            s
        };
        if !s.write {
            return;
        }
        let doms = self.domains.read().clone();
        let r = s.range;
        // Another writable mapping above stores concurrently (no order between the two);
        // its stores come down first so that invalidating its pages loses none.
        let _ = self.flush_down_to(&doms, d, &r);
        let _ = self.invalidate_above(&doms, d, &r);
        let alone = doms.iter().enumerate().all(|(e, x)| {
            e == d || {
                let (re, _) = Self::translate(&doms, d, e, r.clone());
                let t = x.tokens.read();
                !re.iter().any(|y| t.read.overlaps(y) || t.sticky_overlaps(y, false))
            }
        });
        let mut t = dom.tokens.write();
        t.dirty.insert(r.clone());
        if alone {
            t.read.insert(r.clone());
            t.write.insert(r);
        } else {
            t.cached.insert(r);
        }
    }

    /// Flush every domain above `d` down to it (for `sync` at `d`: data written through
    /// upper layers is part of the file at `d`). => no permit held by the caller.
    pub(crate) fn flush_above(&self, d: usize) -> crate::error::Result<()> {
        self.flush_above_as(d, false, Flush::ForSync)
    }

    /// [`Group::flush_above`] of only what is not below yet: domains above `d` with nothing
    /// dirty (nor a writable mapping) — and nothing pushed into them from above — are not
    /// pushed (a zstd push is a commit written through every store below). For closing a
    /// group, or before syncing every file: its state is then the same as after a
    /// `flush_above`. `flush`: for a close (`Publish`: in the store below, not durable) or
    /// for a sync that follows (`ForSync`). => no permit held by the caller.
    pub(crate) fn flush_dirty_above(&self, d: usize, flush: Flush) -> crate::error::Result<()> {
        self.flush_above_as(d, true, flush)
    }

    fn flush_above_as(&self, d: usize, only_dirty: bool, flush: Flush) -> crate::error::Result<()> {
        if self.disabled {
            return Ok(());
        }
        let _g = self.lock.lock();
        let doms = self.domains.read().clone();
        let mut pushed = false;
        for e in (d + 1..doms.len()).rev() {
            let mut t = doms[e].tokens.write();
            pushed |= !t.dirty.is_empty() || t.sticky.iter().any(|s| s.write);
            if only_dirty && !pushed {
                // Nothing here, nor above (pushed into here), that the domain below lacks.
                continue;
            }
            // Metadata too: syncing d must make what was written above part of the file
            // at d (an aead length only in memory would otherwise be missing).
            doms[e].push_down(&[ALL], flush)?;
            t.write = RangeSet::default();
            t.dirty = RangeSet::default();
        }
        if pushed && d > 0 {
            // That data is in d now, not below it yet: readers below flush d first.
            doms[d].tokens.write().dirty.insert(ALL);
        }
        Ok(())
    }

    // ------------------------------------------------------------ byte-range locks

    /// Translate `r` in domain `d` down to domain 0 (where all layers' locks meet).
    fn lock_range(&self, d: usize, r: Range<u64>) -> Vec<Range<u64>> {
        if d == 0 {
            return vec![r];
        }
        let doms = self.domains.read().clone();
        Self::translate(&doms, d, 0, r).0
    }

    /// This machine's record locks `l` as other machines see them.
    fn remote_record_locks(l: &[RangeLock]) -> Vec<RemoteLock> {
        l.iter()
            .flat_map(|x| x.lower.iter().map(|r| RemoteLock { range: r.clone(), exclusive: x.exclusive, pid: x.pid }))
            .collect()
    }

    /// This machine's `flock` locks `l` as other machines see them.
    fn remote_flocks(l: &[(u64, bool)]) -> Vec<RemoteLock> {
        l.iter().map(|&(_, exclusive)| RemoteLock { range: 0..u64::MAX, exclusive, pid: 0 }).collect()
    }

    /// Between machines (a shared store): whether no other machine holds a lock conflicting
    /// with `want` — and if so, `held` (this machine's locks of that kind with the new one)
    /// recorded for them. Without a store shared with other machines: true. An error
    /// reaching the other machines (etcd) counts as a conflict, noted on stderr.
    /// => called holding the kind's lock table (its changes are recorded in order).
    fn remote_grant(&self, flock: bool, held: &[RemoteLock], want: &[RemoteLock], may_lag: bool) -> bool {
        let Some(r) = self.remote.get() else { return true };
        match r.locks(flock, Some(held), want, may_lag) {
            Ok(None) => true,
            Ok(Some(_)) => false,
            Err(e) => {
                eprintln!("ubc: a lock between machines could not be taken: {e}");
                false
            }
        }
    }

    /// Record this machine's locks of a kind after a release, if they changed (`before`):
    /// best effort — an error leaves the old set to other machines until the next change or
    /// the lease's end (noted on stderr). => called holding the kind's lock table.
    fn remote_release(&self, flock: bool, before: &[RemoteLock], after: &[RemoteLock]) {
        let Some(r) = self.remote.get() else { return };
        if before == after {
            return;
        }
        if let Err(e) = r.locks(flock, Some(after), &[], false) {
            eprintln!("ubc: a lock released here stays held for other machines until the next change: {e}");
        }
    }

    /// Take an advisory lock (fcntl `F_SETLK(W)`-style) on bytes `r` of domain `d` for
    /// `owner` (process `pid`, for `F_GETLK`). Locks of different owners conflict if they
    /// overlap in the stored bytes and one is exclusive; an owner's own locks never conflict,
    /// and its new lock replaces what it held over `r` (an upgrade or a downgrade). With
    /// [`LockWait::Block`], blocks until granted; else returns `false` on conflict. For a
    /// store shared with other machines, their locks count too (asked after this machine's
    /// own table has no conflict; a wait for them asks again when theirs change).
    pub(crate) fn lock(&self, owner: u64, pid: u32, d: usize, r: Range<u64>, kind: LockKind, wait: LockWait) -> bool {
        let (exclusive, mut may_lag) = (kind == LockKind::Exclusive, wait == LockWait::Retry);
        let wait = wait == LockWait::Block;
        let lower = self.lock_range(d, r.clone());
        let mut l = self.locks.lock();
        loop {
            let conflict = l.iter().any(|x| x.blocks(owner, exclusive, d, &r, &lower));
            if !conflict {
                let new = RangeLock { owner, pid, domain: d, range: r.clone(), lower: lower.clone(), exclusive };
                if self.remote.get().is_some() {
                    let mut next = l.clone();
                    carve(&mut next, owner, d, &r);
                    next.push(new.clone());
                    let want = Self::remote_record_locks(std::slice::from_ref(&new));
                    if !self.remote_grant(false, &Self::remote_record_locks(&next), &want, may_lag) {
                        if !wait {
                            return false;
                        }
                        drop(l);
                        if let Some(r) = self.remote.get() {
                            r.await_locks(false, REMOTE_LOCK_POLL);
                        }
                        may_lag = true; // asked again: as `LockWait::Retry`
                        l = self.locks.lock();
                        continue;
                    }
                }
                carve(&mut l, owner, d, &r);
                l.push(new);
                // A downgrade may let shared waiters in.
                self.locks_cv.notify_all();
                return true;
            }
            if !wait {
                return false;
            }
            self.locks_cv.wait(&mut l);
        }
    }

    /// The first lock of another owner that a `kind` lock by `owner` on bytes `r` of domain
    /// `d` would conflict with (`F_GETLK`), if any — another machine's too (its process id,
    /// the bytes asked for).
    pub(crate) fn test_lock(&self, owner: u64, d: usize, r: Range<u64>, kind: LockKind) -> Option<LockConflict> {
        let exclusive = kind == LockKind::Exclusive;
        let lower = self.lock_range(d, r.clone());
        let l = self.locks.lock();
        let local = l.iter().find(|x| x.blocks(owner, exclusive, d, &r, &lower)).map(|x| LockConflict {
            range: if x.domain == d { x.range.clone() } else { r.clone() },
            kind: if x.exclusive { LockKind::Exclusive } else { LockKind::Shared },
            pid: x.pid,
        });
        drop(l);
        local.or_else(|| {
            let remote = self.remote.get()?;
            let want: Vec<RemoteLock> =
                lower.iter().map(|x| RemoteLock { range: x.clone(), exclusive, pid: 0 }).collect();
            let theirs = remote.locks(false, None, &want, false).ok()??;
            Some(LockConflict {
                range: if d == 0 { theirs.range } else { r },
                kind: if theirs.exclusive { LockKind::Exclusive } else { LockKind::Shared },
                pid: theirs.pid,
            })
        })
    }

    /// Release `owner`'s hold on bytes `r` of domain `d`, splitting locks it cuts.
    pub(crate) fn unlock(&self, owner: u64, d: usize, r: Range<u64>) {
        let mut l = self.locks.lock();
        let before = self.remote.get().map(|_| Self::remote_record_locks(&l));
        carve(&mut l, owner, d, &r);
        if let Some(before) = before {
            self.remote_release(false, &before, &Self::remote_record_locks(&l));
        }
        self.locks_cv.notify_all();
    }

    /// Release every lock of `owner` (its file handle closed).
    pub(crate) fn unlock_all(&self, owner: u64) {
        let mut l = self.locks.lock();
        let before = self.remote.get().map(|_| Self::remote_record_locks(&l));
        l.retain(|x| x.owner != owner);
        if let Some(before) = before {
            self.remote_release(false, &before, &Self::remote_record_locks(&l));
        }
        self.locks_cv.notify_all();
    }

    /// Take or convert `owner`'s `flock(2)` lock on the whole file: shared locks of any
    /// number of owners, or one exclusive. A conversion replaces the owner's lock (as on
    /// Linux, where it is not atomic: another waiter may get in between). With
    /// [`LockWait::Block`], blocks until granted; else returns `false` on conflict. Other
    /// machines' `flock` locks count too, as for [`Group::lock`].
    pub(crate) fn flock(&self, owner: u64, kind: LockKind, wait: LockWait) -> bool {
        let (exclusive, mut may_lag) = (kind == LockKind::Exclusive, wait == LockWait::Retry);
        let mut l = self.flocks.lock();
        // Converting releases the old lock first (flock(2): "may be ... not atomic").
        if l.iter().any(|&(o, _)| o == owner) {
            let before = Self::remote_flocks(&l);
            l.retain(|&(o, _)| o != owner);
            self.remote_release(true, &before, &Self::remote_flocks(&l));
            self.flocks_cv.notify_all();
        }
        loop {
            if !l.iter().any(|&(_, x)| x || exclusive) {
                if self.remote.get().is_some() {
                    let mut next = l.clone();
                    next.push((owner, exclusive));
                    let want = Self::remote_flocks(&[(owner, exclusive)]);
                    if !self.remote_grant(true, &Self::remote_flocks(&next), &want, may_lag) {
                        if wait != LockWait::Block {
                            return false;
                        }
                        drop(l);
                        if let Some(r) = self.remote.get() {
                            r.await_locks(true, REMOTE_LOCK_POLL);
                        }
                        may_lag = true; // asked again: as `LockWait::Retry`
                        l = self.flocks.lock();
                        continue;
                    }
                }
                l.push((owner, exclusive));
                return true;
            }
            if wait != LockWait::Block {
                return false;
            }
            self.flocks_cv.wait(&mut l);
        }
    }

    /// Release `owner`'s `flock(2)` lock, if it holds one (`LOCK_UN`, or its open file
    /// description closed).
    pub(crate) fn funlock(&self, owner: u64) {
        let mut l = self.flocks.lock();
        let before = self.remote.get().map(|_| Self::remote_flocks(&l));
        l.retain(|&(o, _)| o != owner);
        if let Some(before) = before {
            self.remote_release(true, &before, &Self::remote_flocks(&l));
        }
        self.flocks_cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `settled`: a failure with no write beside it is returned at once; one while a write
    /// is in flight, or after a write began and ended during the read, is read again; a
    /// read that keeps failing under a write is given up as interrupted, its own error kept
    /// as the source.
    #[test]
    fn settled_reads_again_only_what_a_write_may_have_torn() {
        let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad tag");
        let w = LowerWrites::default();
        let mut calls = 0;
        let r: std::io::Result<()> = w.settled(|| {
            calls += 1;
            Err(bad())
        });
        assert_eq!((r.unwrap_err().kind(), calls), (std::io::ErrorKind::InvalidData, 1), "no write: no retry");

        let mut calls = 0;
        let r = {
            let _writing = w.begin();
            w.settled(|| {
                calls += 1;
                if calls < 3 { Err(bad()) } else { Ok(7) }
            })
        };
        assert_eq!((r.unwrap(), calls), (7, 3), "a write in flight: read again until it succeeds");

        let mut calls = 0;
        let r: std::io::Result<()> = w.settled(|| {
            calls += 1;
            if calls == 1 {
                drop(w.begin()); // a whole write during the read
            }
            Err(bad())
        });
        assert_eq!((r.unwrap_err().kind(), calls), (std::io::ErrorKind::InvalidData, 2), "a write during the read");

        let mut calls = 0;
        let writing = w.begin();
        let r: std::io::Result<()> = w.settled(|| {
            calls += 1;
            Err(bad())
        });
        drop(writing);
        let e = r.unwrap_err();
        assert_eq!((e.kind(), calls), (std::io::ErrorKind::Interrupted, LowerWrites::TRIES), "given up");
        let inner = e.get_ref().and_then(|t| t.source()).and_then(|s| s.downcast_ref::<std::io::Error>());
        assert_eq!(inner.map(|i| i.to_string()), Some("bad tag".to_string()), "the read's own error is the source");
    }

    #[test]
    fn record_locks_split_replace_and_conflict_as_posix_says() {
        let g = Group::new(Arc::new(Counters::default()), Coherence::Kept);
        let (a, b) = (1, 2);
        assert!(g.lock(a, 7, 0, 0..100, LockKind::Exclusive, LockWait::Try));
        g.unlock(a, 0, 40..60);
        assert!(g.lock(b, 0, 0, 45..50, LockKind::Exclusive, LockWait::Try), "the unlocked middle is free");
        assert!(!g.lock(b, 0, 0, 30..35, LockKind::Shared, LockWait::Try), "the left piece stays");
        assert!(!g.lock(b, 0, 0, 90..95, LockKind::Shared, LockWait::Try), "the right piece stays");
        // Downgrade the right piece: b may share it now, not the left one.
        assert!(g.lock(a, 7, 0, 60..100, LockKind::Shared, LockWait::Try));
        assert!(g.lock(b, 0, 0, 90..95, LockKind::Shared, LockWait::Try));
        let c = g.test_lock(b, 0, 10..20, LockKind::Shared).expect("conflict");
        assert_eq!((c.range, c.kind, c.pid), (0..40, LockKind::Exclusive, 7));
        assert_eq!(g.test_lock(a, 0, 10..20, LockKind::Exclusive), None, "an owner never conflicts with itself");
        g.unlock_all(a);
        assert!(g.lock(b, 0, 0, 0..40, LockKind::Exclusive, LockWait::Try));
    }

    #[test]
    fn flock_locks_share_exclude_convert_and_ignore_record_locks() {
        let g = Group::new(Arc::new(Counters::default()), Coherence::Kept);
        let (a, b, c) = (1, 2, 3);
        assert!(g.flock(a, LockKind::Shared, LockWait::Try));
        assert!(g.flock(b, LockKind::Shared, LockWait::Try), "shared locks share");
        assert!(!g.flock(c, LockKind::Exclusive, LockWait::Try), "an exclusive one waits for both");
        assert!(!g.flock(a, LockKind::Exclusive, LockWait::Try), "a conversion waits for the other sharer");
        // The failed conversion let go of a's shared lock (Linux converts by unlocking first).
        g.funlock(b);
        assert!(g.flock(c, LockKind::Exclusive, LockWait::Try));
        // Record locks and flock locks never conflict (Linux).
        assert!(g.lock(a, 1, 0, 0..u64::MAX, LockKind::Exclusive, LockWait::Try));
        assert!(!g.flock(a, LockKind::Shared, LockWait::Try), "c's exclusive flock still holds");
        g.funlock(c);
        assert!(g.flock(b, LockKind::Exclusive, LockWait::Try), "a record lock does not block a flock");
        g.unlock_all(b);
        assert!(!g.flock(a, LockKind::Shared, LockWait::Try), "dropping b's record locks keeps its flock");
        // A blocked waiter is woken by the release.
        let g = Arc::new(g);
        let g2 = g.clone();
        let t = std::thread::spawn(move || g2.flock(a, LockKind::Shared, LockWait::Block));
        std::thread::sleep(std::time::Duration::from_millis(20));
        g.funlock(b);
        assert!(t.join().unwrap());
    }

    #[test]
    fn range_set_merges_splits_and_covers() {
        let mut s = RangeSet::default();
        s.insert(10..20);
        s.insert(30..40);
        s.insert(20..30);
        assert_eq!(s.0, vec![(10, 40)]);
        s.remove(15..25);
        assert_eq!(s.0, vec![(10, 15), (25, 40)]);
        assert!(s.covers(&(25..40)) && !s.covers(&(14..26)));
        assert!(s.overlaps(&(14..16)) && !s.overlaps(&(15..25)));
        s.insert(0..100);
        assert_eq!(s.0, vec![(0, 100)]);
        s.remove(ALL);
        assert!(s.is_empty());
    }
}

/// Randomized-schedule tests of the protocol (`--features shuttle`).
#[cfg(all(test, feature = "shuttle"))]
mod schedules;

/// Whether a stack keeps its layers coherent (the cache manager).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Coherence {
    /// Data and mappings through every layer stay coherent (the default).
    Kept,
    /// Every layer caches on its own: only for measuring the manager's overhead.
    Off,
}

/// Kind of an advisory byte-range lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockKind {
    Shared,
    Exclusive,
}

/// What `File::lock` does when the range is locked by another owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockWait {
    /// Wait until it can be taken (`F_SETLKW`).
    Block,
    /// Give up at once (`F_SETLK`).
    Try,
    /// Give up at once, as `Try`, for a lock being waited for — asked again after it was
    /// refused (a mount's `F_SETLKW` tries every few milliseconds). Another machine's locks
    /// may be taken as they stood at the last refusal while this machine has heard of no
    /// change to them since: free of cost until one lets go, and behind a release there by
    /// the time the change takes to reach this machine (its watch of the lock keys). Locks
    /// of this machine are seen at once, as with `Try`.
    Retry,
}

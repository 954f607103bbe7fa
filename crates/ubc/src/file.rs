//! Files: handles on cached objects. Positional `read_at`/`write_at` (thread-safe), the
//! `std::io` adapters, and windows — guards lending cached pages for zero-copy access
//! (UBC's `ubc_alloc`/`ubc_release`; "page loanout").

use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::object::{Length, Object, checked_end};
use crate::page::table::Chunk;
use crate::pager::{Access, FilePager, Pager};
use crate::stats::Stats;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::*};

/// An open file in the cache.
///
/// Positional calls (`read_at`, `write_at`, `window`, …) take `&self` and may be used from
/// many threads at once. The `Read`/`Write`/`Seek` adapters use the handle's own position;
/// [`File::try_clone`] gives another handle (with its own position) on the same file.
pub struct File {
    pub(crate) obj: Arc<Object>,
    cache: Cache,
    writable: bool,
    closed: AtomicBool,
    /// This handle's access pattern (`File::advise`), an `Advice` as u8.
    pattern: AtomicU8,
    /// `O_DSYNC`/`O_SYNC` for this handle's writes (`File::set_write_sync`), a `WriteSync`.
    write_sync: AtomicU8,
    pos: u64,
    /// Which writeback failures of the file this handle has been told about.
    errors: crate::errseq::Cursor,
}

/// Synchronous writes for a handle ([`File::set_write_sync`]): `open(2)`'s `O_DSYNC` and
/// `O_SYNC`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum WriteSync {
    /// Writes return once in the cache (the default); `sync` makes them durable.
    #[default]
    None = 0,
    /// `O_DSYNC`: each write returns once its bytes, and what reading them back needs, are
    /// durable (as if followed by `fdatasync` of its range).
    Data = 1,
    /// `O_SYNC`: as `Data`, and the file's other metadata too (as `fsync`).
    All = 2,
}

impl Cache {
    /// Open a file served by `pager`. Two pagers with the same [`Identity`](crate::Identity) share one cached
    /// object (one copy of each page); so do two opens of the same pager instance. The handle is writable if `access` asks for it; a
    /// read-only pager makes that an error.
    pub fn open(&self, pager: Arc<dyn Pager>, access: Access) -> Result<File> {
        self.open_with_len(pager, access, None)
    }

    /// `open`, with the store's length if the caller just learned it.
    fn open_with_len(&self, pager: Arc<dyn Pager>, access: Access, len: Option<u64>) -> Result<File> {
        if access == Access::ReadWrite && !pager.is_writable() {
            return Err(Error::ReadOnly);
        }
        let obj = self.attach(pager, len)?;
        Ok(File::new(obj, self.clone(), access))
    }

    /// Open an existing host file through a [`FilePager`].
    pub fn open_path(&self, path: impl AsRef<Path>, access: Access) -> Result<File> {
        let path = path.as_ref();
        let (pager, len) =
            FilePager::open_by_name(path, access, rustix::fs::OFlags::empty()).map_err(|e| open_err(path, e))?;
        self.open_with_len(Arc::new(pager), access, len)
    }

    /// Open a host file read-write, creating it if needed.
    pub fn create_path(&self, path: impl AsRef<Path>) -> Result<File> {
        let path = path.as_ref();
        let (pager, len) = FilePager::open_by_name(path, Access::ReadWrite, rustix::fs::OFlags::CREATE)
            .map_err(|e| open_err(path, e))?;
        self.open_with_len(Arc::new(pager), Access::ReadWrite, len)
    }
}

fn open_err(path: &Path, e: std::io::Error) -> Error {
    Error::Open { path: path.to_path_buf(), source: e }
}

impl File {
    pub(crate) fn new(obj: Arc<Object>, cache: Cache, access: Access) -> File {
        let errors = obj.wb_errors.cursor();
        let writable = access == Access::ReadWrite;
        File {
            obj,
            cache,
            writable,
            closed: AtomicBool::new(false),
            pattern: AtomicU8::new(0),
            write_sync: AtomicU8::new(WriteSync::None as u8),
            pos: 0,
            errors,
        }
    }

    #[inline]
    pub(crate) fn live(&self) -> Result<&Object> {
        if self.closed.load(Relaxed) {
            return Err(Error::Closed);
        }
        Ok(&self.obj)
    }

    pub(crate) fn live_writable(&self) -> Result<&Object> {
        let o = self.live()?;
        if !self.writable {
            return Err(Error::ReadOnly);
        }
        Ok(o)
    }

    /// Read up to `buf.len()` bytes at `offset`; fewer only at the end of the file.
    /// Holes read as zeros.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.live()?.read(buf, offset, crate::Advice::from_u8(self.pattern.load(Relaxed)))
    }

    /// `read_at` without read-ahead, for a pager above that fills its own pages from this
    /// file (a general layer reading the stored bytes of the pages it decodes). That layer
    /// reads ahead in its own domain and asks here for exactly the bytes it needs, in the
    /// order its pages are filled — by several threads, out of order, and (compressed
    /// extents) not in file order: read-ahead here guesses streams that are not there and
    /// reads pages twice (measured through `dir | aead | zstd`: 203 MiB read from the store
    /// for a 130 MiB file, 129 MiB without).
    pub fn read_at_no_readahead(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.live()?.read(buf, offset, crate::Advice::Random)
    }

    /// `posix_fadvise(2)`: say how this file, or bytes `range` of it, will be used.
    /// `Normal`, `Random`, `Sequential` and `NoReuse` set this handle's access pattern for
    /// its reads from now on (the range is not looked at: Linux too applies them to the
    /// whole open file); other handles of the file keep theirs. `WillNeed` queues the fill
    /// of the range's pages that are not cached and returns (at most half the budget, from
    /// the range's start); `DontNeed` writes the range's dirty pages back, waits, and drops
    /// its clean pages that no window or mapping holds — a writeback error is returned
    /// (those pages stay dirty). A range reaching `u64::MAX` means to the end of the file.
    /// Mappings of the file fault as before (their read-ahead is the file's).
    pub fn advise(&self, range: std::ops::Range<u64>, advice: crate::Advice) -> Result<()> {
        let o = self.live()?;
        if range.start > range.end {
            return Err(Error::InvalidArgument(format!("advise: range {}..{} is reversed", range.start, range.end)));
        }
        match advice {
            a if a.is_pattern() => self.pattern.store(a as u8, Relaxed),
            crate::Advice::WillNeed => o.will_need(range.start, range.end),
            _ => {
                // Written back, then dropped as `drop_clean` drops; a writeback error after.
                let written = o.clean(range.start, range.end);
                o.drop_clean(range.start, range.end);
                written?;
            }
        }
        Ok(())
    }

    /// Read exactly `buf.len()` bytes at `offset`, or fail with `UnexpectedEof`.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = self.read_at(buf, offset)?;
        if n < buf.len() {
            return Err(Error::UnexpectedEof { object: self.obj.describe(), offset: offset + n as u64 });
        }
        Ok(())
    }

    /// Write all of `buf` at `offset`, extending the file if it ends before. Returns
    /// `buf.len()`, or fewer bytes if an error stopped it after some were written.
    ///
    /// With [`File::set_write_sync`] it returns only once the bytes written (and, for
    /// `WriteSync::All`, the file's metadata) are durable; an error there is returned
    /// although the bytes are in the cache (they stay dirty: a later sync retries them).
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<usize> {
        let o = self.live_writable()?;
        let r = o.write(buf, offset);
        // Told on failure too: some bytes may have gone in.
        o.changed(offset..offset.saturating_add(buf.len() as u64), false);
        let n = r?;
        match self.write_sync.load(Relaxed) {
            s if s == WriteSync::None as u8 || n == 0 => {}
            s => {
                // O_DSYNC: the range written, its length, then the pager's sync (TLPI 13.3:
                // "synchronized I/O data integrity completion"); O_SYNC adds the metadata.
                let r = o
                    .clean(offset, offset + n as u64)
                    .and_then(|()| o.sync_pager())
                    .and_then(|()| if s == WriteSync::All as u8 { o.pager_sync_metadata() } else { Ok(()) });
                // As Linux's `generic_write_sync`: a failed sync since this handle's last one
                // is this write's error too; a failure of its own is heard now, not again.
                let failed = r.is_err();
                self.told(o, r, failed)?;
            }
        }
        Ok(n)
    }

    /// Make this handle's writes synchronous, as `open(2)`'s `O_DSYNC` (`WriteSync::Data`)
    /// or `O_SYNC` (`WriteSync::All`) do: each `write_at` (and `Write::write`) returns once
    /// what it wrote is durable. Other handles of the file keep their own setting. Writes
    /// through a window or a mapping are not covered (`Mapping::flush` is their `msync`).
    pub fn set_write_sync(&self, mode: WriteSync) -> Result<()> {
        self.live()?;
        self.write_sync.store(mode as u8, Relaxed);
        Ok(())
    }

    /// Length of the file in bytes.
    pub fn len(&self) -> Result<u64> {
        Ok(self.live()?.len())
    }

    /// True if the file is empty.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Truncate or extend. Cached pages past the new end are dropped and the tail of the
    /// last page is zeroed, so a later extension reads zeros. Waits for anyone holding a
    /// window on the dropped pages — do not truncate under your own window.
    pub fn set_len(&self, len: u64) -> Result<()> {
        let o = self.live_writable()?;
        let old = o.len();
        let r = o.set_len(len);
        o.changed(old.min(len)..u64::MAX, false);
        r
    }

    /// Make bytes `range` read as zeros, keeping the length (`fallocate(PUNCH_HOLE |
    /// KEEP_SIZE)`): their whole pages leave the cache and every mapping and are
    /// deallocated in the store where the pager can ([`Pager::punch`](crate::Pager::punch));
    /// else, and at the partial pages of the edges, zeros are written.
    pub fn punch_hole(&self, range: std::ops::Range<u64>) -> Result<()> {
        let o = self.live_writable()?;
        let r = o.punch_hole(range.start, range.end);
        o.changed(range, false);
        r
    }

    /// Reserve the store's space for bytes `range`, so that writing them back cannot fail
    /// for want of space where the store can promise that ([`Pager::allocate`](crate::Pager::allocate));
    /// the length does not change (`fallocate(KEEP_SIZE)`; extend with [`File::set_len`]).
    pub fn allocate(&self, range: std::ops::Range<u64>) -> Result<()> {
        self.live_writable()?.allocate(range.start, range.end)
    }

    /// `lseek(SEEK_DATA)` from `offset`: the next byte of data, or `None` (`ENXIO`) if
    /// `offset` is at or past the end or no data follows it. Cached pages that differ from
    /// the store (dirty ones) are data; holes come from the store
    /// ([`Pager::seek`](crate::Pager::seek)) — a store that knows none makes every byte data.
    pub fn seek_data(&self, offset: u64) -> Result<Option<u64>> {
        self.live()?.seek(offset, crate::Seek::Data)
    }

    /// `lseek(SEEK_HOLE)` from `offset`: the next byte in a hole, the end of the file being
    /// one; `None` (`ENXIO`) if `offset` is at or past the end. See [`File::seek_data`].
    pub fn seek_hole(&self, offset: u64) -> Result<Option<u64>> {
        self.live()?.seek(offset, crate::Seek::Hole)
    }

    /// Write every dirty page to the pager, then make it durable (the pager's sync). On error
    /// the pages stay dirty (a later `sync` retries) and the error is returned.
    ///
    /// Also fails with [`Error::WritebackFailed`] (`lost: true`) if the pager's sync failed
    /// since this handle last synced — for whoever called it — even when this sync succeeds:
    /// data written before that failure may not be durable, and every handle hears of it
    /// once (Linux's errseq after "fsyncgate"). A failed background writeback whose pages
    /// this sync wrote successfully is not an error: nothing was lost.
    pub fn sync(&self) -> Result<()> {
        let o = self.live()?;
        self.told(o, o.sync(), true)
    }

    /// `r`, the outcome of a sync (or a synchronous write) through this handle, with what
    /// the handle has yet to hear: a pager sync that failed since its last one, whoever's
    /// it was (Linux's errseq after "fsyncgate"); heard once. `retried_all`: every dirty
    /// page was written again, so earlier put failures are settled by `r` (a sync; a
    /// synchronous write that failed, whose caller hears it now).
    fn told(&self, o: &Object, r: Result<()>, retried_all: bool) -> Result<()> {
        let lost = o.wb_errors.take_lost(&self.errors, || o.describe());
        if retried_all {
            let _ = o.wb_errors.take_retained(&self.errors, || o.describe());
        }
        r?;
        lost.map_or(Ok(()), Err)
    }

    /// `fsync(2)`: [`File::sync`] (which is `fdatasync(2)`: the data and what reading it
    /// back needs), then the rest of the store's metadata made durable too — its times, for
    /// a host file ([`crate::Pager::sync_metadata`]).
    pub fn sync_all(&self) -> Result<()> {
        self.sync()?;
        let o = self.live()?;
        self.told(o, o.pager_sync_metadata(), true)
    }

    /// Write back every dirty page and have the pager push what it holds through to its
    /// store ([`crate::Pager::write_through`]), without making anything durable: a reader of the
    /// store — another process, or this one restarted after being killed — then sees it, as
    /// after `write(2)` without `fsync`. A layer stacked on this cache uses it to publish a
    /// file to the layers below at close; `sync` is the durable version.
    pub fn write_through(&self) -> Result<()> {
        self.live()?.write_through()
    }

    /// [`crate::Pager::fault_guard`] of this file's pager: for a layer's pager whose own
    /// mapping faulted — its pages are made of this file's bytes, so what this file's pager
    /// needs held for a fault it needs held for that one too. => the calling thread holds
    /// nothing of this file (a fault guard's precondition).
    pub fn fault_guard(&self, range: std::ops::Range<u64>, store: bool) -> Result<Option<crate::pager::FaultGuard>> {
        self.live()?.guard_fault(range, store)
    }

    /// Write back the dirty pages in byte `range` — stores through mappings included — and
    /// wait for them (Mach's `pager_clean_request`; `msync(MS_SYNC)` without the pager's
    /// sync). On error the pages stay dirty.
    pub fn clean(&self, range: std::ops::Range<u64>) -> Result<()> {
        self.live()?.clean(range.start, range.end)
    }

    /// Clean byte `range`, then drop its pages from the cache and from every mapping of the
    /// file, so the next access reads the pager again (Mach's `pager_flush_request`;
    /// `msync(MS_INVALIDATE)`). Used when the stored data changed underneath the cache —
    /// by the stack's cache manager when another layer wrote the same file. With
    /// [`Length::Reload`] the file's length is re-read from the pager too. A store through a
    /// mapping racing the drop may be lost; writers through this cache wait.
    pub fn invalidate(&self, range: std::ops::Range<u64>, length: Length) -> Result<()> {
        self.live()?.invalidate(range.start, range.end, length)
    }

    /// Drop the clean pages wholly inside bytes `range` (and the last page of the file, if
    /// the range reaches the end) that nobody holds: the caller keeps a copy of them — the
    /// kernel's page cache, which a FUSE read through a cached file just filled — so the
    /// cache need not (exclusive caching: one copy in memory, not two). Dirty and held
    /// pages stay; mapped ones leave the mappings as on eviction (they fault back in). A
    /// later read fills dropped pages from the pager again. Returns the pages dropped.
    pub fn drop_clean(&self, range: std::ops::Range<u64>) -> Result<u64> {
        Ok(self.live()?.drop_clean(range.start, range.end))
    }

    /// Have `watcher` told of every change to this file's bytes or length, through any
    /// handle of it: a write or window store (its byte range), a resize (from the shorter
    /// length to `u64::MAX`), a punched hole, stores through a mapping (the pages found
    /// written, when a scan finds them: a sync, a clean, the flusher, an unmap). It is
    /// called after the change, on the changing thread, possibly with the file's locks
    /// held: it must return quickly and never call into the cache (queue the news for
    /// another thread). It is not told of invalidations ([`File::invalidate`]: the pager's
    /// data changed underneath, which its owner knows). One watcher per file, for as long
    /// as the cache keeps the file; returns false if one is set already (it stays).
    pub fn watch(&self, watcher: crate::Watcher) -> bool {
        self.obj.set_watcher(watcher)
    }

    /// Have `hook` called before any of this file's bytes are written back to its pager —
    /// by the flusher, the page daemon or reclaim, [`File::sync`], [`File::clean`],
    /// [`File::write_through`], [`Cache::sync_all`], [`crate::Mapping::flush`] or an unmap —
    /// with the byte range about to be written; the write waits until the hook returns.
    /// This is the write-ahead rule of a database's buffer pool (Mach's pager orders its
    /// own writes; ARIES: "flush the log up to the page's LSN before the page"): the
    /// hook makes the log durable, then the pages may go. An error from the hook fails that
    /// writeback as a pager error would: the pages stay dirty, and `sync` returns it.
    ///
    /// The bytes written are the ones the file held when the hook was called: writers of
    /// those pages wait until the write is done, and a store through a mapping after the
    /// call is not in it (the cache copies a hooked file's pages before calling the hook,
    /// and finds such a store dirty again later). So a program that appends each change to
    /// its log *before* making it (in memory or through a mapping) and makes its whole log
    /// durable in the hook never has a change on disk that its log lacks.
    ///
    /// Preconditions of the hook: it runs on whichever thread writes the pages back,
    /// holding them and inside the cache (at the pager's rank in the lock order, `order`
    /// in the crate docs): it must not call into this cache — keep the log out of it, in a
    /// host file written with `write(2)` and `fdatasync`, as databases do — and must not wait
    /// for a thread that writes this file (that writer may be waiting for the pages held).
    /// One hook per file, shared by its handles, kept while the cache keeps the file (also
    /// after the last close: its dirty pages are still written back through it); setting
    /// another replaces it, `None` removes it.
    pub fn set_writeback_hook(&self, hook: Option<crate::WritebackHook>) -> Result<()> {
        self.live()?.set_writeback_hook(hook);
        Ok(())
    }

    /// Close the handle: later calls on it fail with [`Error::Closed`]. Like `close(2)`,
    /// it does not sync; cached data stays in the cache for other handles and later opens.
    ///
    /// The handle is closed either way, but `close` reports, like `close(2)` on NFS, a
    /// writeback failure this handle has not been told about ([`Error::WritebackFailed`]):
    /// a failed pager sync (data may be lost), or — for a writable handle while the file
    /// still has dirty pages — a failed writeback (the data is not on its way; the pages are
    /// retried by the flusher and by any `sync`).
    pub fn close(&self) -> Result<()> {
        if self.closed.swap(true, SeqCst) {
            return Err(Error::Closed);
        }
        let o = &self.obj;
        let lost = o.wb_errors.take_lost(&self.errors, || o.describe());
        let retained = o.wb_errors.take_retained(&self.errors, || o.describe());
        let pending = self.writable && o.dirty_pages() > 0;
        self.release_handle();
        match (lost, retained) {
            (Some(e), _) => Err(e),
            (None, Some(e)) if pending => Err(e),
            _ => Ok(()),
        }
    }

    /// Drop the handle; if it was the file's last and the file left the cache with it (no
    /// page of it was cached: [`File::invalidate`] drops them), wait until the cache's own
    /// work on the file — read-ahead and write-back jobs, the flusher, reclaim — has let go
    /// of it too, so that its pager, and whatever the pager holds open (a host file's
    /// descriptor, a lower layer's file), is closed when this returns. A plain drop leaves
    /// that to whichever thread lets go last, a moment later: a removed file's blocks stay
    /// allocated meanwhile. => the caller holds no page or lock of the cache (the work it
    /// waits for may need them).
    pub fn close_and_wait(self) {
        let obj = self.obj.clone();
        drop(self);
        obj.holders.wait_if_unlisted(obj.depth());
        // `obj` is dropped here: the last reference, unless a mapping or a pager above
        // still holds the file.
    }

    fn release_handle(&self) {
        if self.obj.handles.fetch_sub(1, SeqCst) == 1 {
            self.cache.core().object_idle(&self.obj, crate::cache::Idle::Closed);
        }
    }

    /// Another handle on the same file, with its own position.
    pub fn try_clone(&self) -> Result<File> {
        let o = self.live()?;
        o.handles.fetch_add(1, SeqCst);
        Ok(File::new(self.obj.clone(), self.cache.clone(), self.access()))
    }

    /// This handle, made *internal*: it no longer keeps the cache running. For a file that
    /// a pager of the same cache owns (a layer's lower file): otherwise the cache would
    /// hold its objects, which hold their pagers, which hold the cache — and never shut
    /// down. When the last user handle goes, the cache shuts down (writing back every
    /// object, this file's included) and drops its objects, and with them this handle;
    /// using it after that is not supported.
    pub fn internal(self) -> File {
        let mut f = self;
        f.cache = f.cache.internal();
        f
    }

    /// Another handle on the same file with `access`:
    /// Another handle on the same file with `access`: a writable handle from a read-only
    /// one if the file's pager can write ([`Error::ReadOnly`] otherwise).
    pub fn reopen(&self, access: Access) -> Result<File> {
        let o = self.live()?;
        if access == Access::ReadWrite && !o.pager().is_writable() {
            return Err(Error::ReadOnly);
        }
        o.handles.fetch_add(1, SeqCst);
        Ok(File::new(self.obj.clone(), self.cache.clone(), access))
    }

    /// Statistics of this file's cached object (shared by all its handles).
    pub fn stats(&self) -> Stats {
        self.obj.stats()
    }

    /// Identity of the stored data (from the pager), if it has one: two opens with the same
    /// identity share one cached object.
    pub fn identity(&self) -> Option<crate::pager::Identity> {
        self.obj.pager().identity()
    }

    /// How many pagers of this cache lie below this file's: what a layer over this file
    /// reports, plus one, as its [`Pager::depth`](crate::Pager::depth).
    pub fn depth(&self) -> u32 {
        self.obj.depth()
    }

    /// Whether this handle may modify the file.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    fn access(&self) -> Access {
        if self.writable { Access::ReadWrite } else { Access::ReadOnly }
    }

    /// The cache this file lives in.
    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// The chunk holding `offset` and the end of the window-able range from `offset`:
    /// clipped to the chunk (a window is one mapping) and to `limit`. A window may pin at
    /// most half the budget: more would starve every other reader.
    fn window_span(&self, obj: &Object, offset: u64, len: usize, limit: u64) -> Result<(u64, u64)> {
        let g = &obj.res.geo;
        let chunk_bytes = (g.page_size as u64) << g.chunk_shift;
        let chunk_end = (offset / chunk_bytes + 1) * chunk_bytes;
        let end = offset.saturating_add(len as u64).min(chunk_end).min(limit);
        if end > offset {
            let pages = ((end - 1) >> g.page_shift) - (offset >> g.page_shift) + 1;
            if pages > g.budget_pages / 2 {
                return Err(Error::BudgetExceeded {
                    needed: pages << g.page_shift,
                    budget: g.budget_pages << g.page_shift,
                });
            }
        }
        Ok((offset / chunk_bytes, end))
    }

    /// Lend the cached bytes at `offset` for reading, without copying (`ubc_alloc`; UBC's
    /// page loanout). The window may be shorter than `len`: it ends at the end of the file
    /// and at a window boundary (`window_size`), like `ubc_alloc` shrinking its length;
    /// call again for the rest.
    ///
    /// The window shows the bytes as they were when it was taken, for as long as it lives:
    /// a later change of its pages through any path (`write_at`, a writable window, a
    /// truncation, a store through a shared writable mapping) first copies the page for the
    /// window — the cache keeps the page and takes the change, the window keeps the old
    /// bytes. Until then it reads the cache's own pages (no copy). Copies count against the
    /// budget while the window lives (`CacheStats::loan_copies`). A write in progress when
    /// the window is taken is waited for, so the window shows it whole or not at all.
    ///
    /// Windows read through a private view of their chunk, shared by the chunk's windows and
    /// kept for the next ones until a write copies pages into it (then the next window of
    /// the chunk maps a fresh view).
    ///
    /// Pages stay pinned in the cache until the guard is dropped, so eviction passes them
    /// by; a truncation or invalidation of them takes them back instead of waiting (the
    /// window keeps a copy, `CacheStats::loan_pages_handed_back`). A window of pages this
    /// thread holds in a [`WindowMut`] would wait for itself, and is refused with
    /// [`Error::InvalidArgument`].
    pub fn window(&self, offset: u64, len: usize) -> Result<Window<'_>> {
        let obj = self.live()?;
        checked_end(offset, len)?;
        let (ci, end) = self.window_span(obj, offset, len, obj.len())?;
        if end <= offset {
            return Ok(Window { obj, chunk: None, ptr: std::ptr::null(), len: 0, lent: None });
        }
        let chunk = obj.table.get_or_create(ci);
        let ps = obj.res.geo.page_shift;
        let (first, last) = (offset >> ps, (end - 1) >> ps);
        let lent = obj.lend(chunk, first, last)?;
        // SAFETY: pointer into the loan's view, which maps pages `first..=last`.
        let ptr = unsafe { lent.view.add((offset - (first << ps)) as usize) };
        Ok(Window { obj, chunk: Some(chunk), ptr, len: (end - offset) as usize, lent: Some(lent) })
    }

    /// Lend the cached bytes at `offset` for writing in place. Like [`File::window`], the
    /// window may be shorter than `len` (window boundary), but it extends the file: after
    /// the guard is dropped the file is at least `offset + window.len()` long. Existing
    /// data is read in first, so the window shows the file's current bytes. Pages are
    /// marked dirty when the guard is dropped.
    ///
    /// While the guard lives, other writers of these pages wait, readers may see the bytes
    /// as they are being written, and `set_len` on this file waits.
    pub fn window_mut(&self, offset: u64, len: usize) -> Result<WindowMut<'_>> {
        let obj = self.live_writable()?;
        checked_end(offset, len)?;
        let (ci, end) = self.window_span(obj, offset, len, u64::MAX)?;
        if end <= offset {
            return Ok(WindowMut { obj, chunk: None, ptr: std::ptr::null_mut(), len: 0, offset, size: None });
        }
        let size = obj.size_lock.read();
        obj.unlock_for_change(offset, end)?;
        let chunk = obj.table.get_or_create(ci);
        let win = obj.lock_range_for_write(chunk, offset, end)?;
        obj.note_writing_window(offset, end);
        let chunk_off = ci * ((obj.res.geo.page_size as u64) << obj.res.geo.chunk_shift);
        // SAFETY: pointer into the chunk's window, within the pages we hold.
        let ptr = unsafe { win.add((offset - chunk_off) as usize) };
        Ok(WindowMut { obj, chunk: Some(chunk), ptr, len: (end - offset) as usize, offset, size: Some(size) })
    }
}

impl Drop for File {
    fn drop(&mut self) {
        if !self.closed.swap(true, SeqCst) {
            self.release_handle();
        }
    }
}

impl std::fmt::Debug for File {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("File").field("object", &self.obj.describe()).field("writable", &self.writable).finish()
    }
}

/// A read-only loan of cached bytes (see [`File::window`]). Derefs to `&[u8]`: the bytes
/// as they were when the window was taken.
pub struct Window<'a> {
    obj: &'a Object,
    chunk: Option<&'a Chunk>,
    ptr: *const u8,
    len: usize,
    lent: Option<crate::object::Lent>,
}

impl std::ops::Deref for Window<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the loan's view maps these bytes for the guard's lifetime, and nothing
        // changes them: a change of a lent page copies it into the view first.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Window<'_> {
    fn drop(&mut self) {
        if let (Some(c), Some(lent)) = (self.chunk, &self.lent) {
            self.obj.end_loan(c, lent);
        }
    }
}

/// A writable loan of cached bytes (see [`File::window_mut`]). Derefs to `&mut [u8]`.
pub struct WindowMut<'a> {
    obj: &'a Object,
    chunk: Option<&'a Chunk>,
    ptr: *mut u8,
    len: usize,
    offset: u64,
    size: Option<parking_lot::RwLockReadGuard<'a, ()>>,
}

impl std::ops::Deref for WindowMut<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: we hold the pages for writing.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for WindowMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: we hold the pages for writing; no other writer exists.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for WindowMut<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.chunk {
            self.obj.forget_writing_window(self.offset, self.offset + self.len as u64);
            self.obj.unlock_range_written(c, self.offset, self.offset + self.len as u64);
            self.obj.changed(self.offset..self.offset + self.len as u64, false);
        }
        self.size.take();
    }
}

impl Read for File {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Write for File {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.write_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }

    /// Data written is in the cache (visible to every reader) once `write` returns; `flush`
    /// has nothing to do. Use [`File::sync`] for durability.
    fn flush(&mut self) -> io::Result<()> {
        self.live()?;
        Ok(())
    }
}

impl Seek for File {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        let base = match pos {
            SeekFrom::Start(o) => {
                self.pos = o;
                return Ok(o);
            }
            SeekFrom::End(d) => (self.len()? as i128, d),
            SeekFrom::Current(d) => (self.pos as i128, d),
        };
        let new = base.0 + base.1 as i128;
        if new < 0 || new > i64::MAX as i128 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "seek to a negative or overflowing position"));
        }
        self.pos = new as u64;
        Ok(self.pos)
    }
}

#[cfg(test)]
mod tests {
    /// A read of a whole small file from its start makes no stream table (392 bytes that
    /// each open of a small file allocated and its close freed, leaving a hole among the
    /// objects that stay: `open_handles_max` measured 1,586 bytes of memory per idle cached
    /// file with it, 1,192 without); a partial read of a larger one still starts a stream.
    #[test]
    fn a_whole_small_file_read_makes_no_stream_table() {
        use crate::pager::{MemPager, Pager};
        use crate::{Access, Cache};
        use std::sync::Arc;
        let cache = Cache::builder().budget(4 << 20).build().unwrap();
        let file = |len: usize| {
            let mem = Arc::new(MemPager::new());
            mem.put_pages(0, &vec![7u8; len]).unwrap();
            cache.open(mem, Access::ReadOnly).unwrap()
        };
        let mut b = vec![0u8; 8192];
        let small = file(100);
        assert_eq!(small.read_at(&mut b, 0).unwrap(), 100);
        assert!(small.obj.ra_streams.lock().is_none(), "a whole read of a one-page file");
        let two = file(6000);
        assert_eq!(two.read_at(&mut b, 0).unwrap(), 6000);
        assert!(two.obj.ra_streams.lock().is_none(), "a whole read of a two-page file");
        let big = file(1 << 20);
        assert_eq!(big.read_at(&mut b[..4096], 0).unwrap(), 4096);
        assert!(big.obj.ra_streams.lock().is_some(), "the start of a stream is remembered");
    }
}

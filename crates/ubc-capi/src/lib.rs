//! C API of ubc: caches, stacks, files (`pread`/`pwrite`), mappings, and a stdio-style
//! buffered API modelled on Mach's mapped stdio (`fopen` maps the file; `fmap` hands out
//! a pointer to the whole file's data). The C declarations are in `include/ubc.h`.
//!
//! Every `extern "C"` function catches panics and checks its pointers: failures return
//! -1/NULL and set `errno`, and a message (path and cause) is kept per thread for
//! `ubc_last_error`.

#![allow(clippy::missing_safety_doc)]
#![allow(non_camel_case_types)]

mod stdio;

use ::ubc_stack::{File, Mapping, OpenOptions, Stack};
use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

pub use stdio::UbcStdio;

/// A failure: errno and message.
pub(crate) struct Fail(pub c_int, pub String);

pub(crate) type R<T> = std::result::Result<T, Fail>;

impl Fail {
    pub(crate) fn inval(msg: impl Into<String>) -> Fail {
        Fail(libc::EINVAL, msg.into())
    }
    /// A stack error, with `ctx` (call and path) in front.
    pub(crate) fn stack(ctx: &str, e: ::ubc_stack::Error) -> Fail {
        Fail(e.errno(), format!("{ctx}: {e}"))
    }
}

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(c"no error".to_owned());
}

fn set_errno(e: c_int) {
    // SAFETY: errno is thread-local; the location is always valid.
    unsafe { *libc::__errno_location() = e };
}

pub(crate) fn record(f: Fail) {
    let msg = CString::new(f.1.replace('\0', "\\0")).unwrap_or_else(|_| c"error".to_owned());
    LAST.with(|l| *l.borrow_mut() = msg);
    set_errno(f.0);
}

/// Run `body`, turning an error or a panic into `fail` with errno set.
pub(crate) fn guard<T>(fail: T, body: impl FnOnce() -> R<T>) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => v,
        Ok(Err(f)) => {
            record(f);
            fail
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown".into());
            record(Fail(libc::EIO, format!("internal error (panic): {what}")));
            fail
        }
    }
}

/// A C string argument as `&str` (EINVAL for NULL or non-UTF-8).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string that stays valid and unchanged for `'a` (the
/// header's "Pointer arguments").
pub(crate) unsafe fn cstr<'a>(p: *const c_char, what: &str) -> R<&'a str> {
    if p.is_null() {
        return Err(Fail::inval(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL, so by this function's contract a NUL-terminated string valid for 'a.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| Fail::inval(format!("{what} is not UTF-8")))
}

/// A shared reference to a thread-safe handle (cache, stack, file, map): several threads
/// may use one at once, so no `&mut` is ever made of it. EINVAL for NULL.
///
/// # Safety
/// `p` is NULL or a live handle of type `T` from this library, not freed during `'a` (the
/// header's "Handles and lifetimes" and "Pointer arguments").
pub(crate) unsafe fn handle<'a, T>(p: *const T, what: &str) -> R<&'a T> {
    // SAFETY: by this function's contract a non-NULL `p` points to a live `T` (a `Box`
    // this library leaked) that outlives 'a; only shared references are made of it.
    unsafe { p.as_ref() }.ok_or_else(|| Fail::inval(format!("{what} handle is NULL")))
}

/// An exclusive reference to a handle only one thread uses at a time (a stdio stream).
/// EINVAL for NULL.
///
/// # Safety
/// As [`handle`], and no other reference to `*p` is used during `'a` (the header: a
/// UBC_FILE is used by one thread at a time).
pub(crate) unsafe fn handle_mut<'a, T>(p: *mut T, what: &str) -> R<&'a mut T> {
    // SAFETY: by this function's contract a non-NULL `p` points to a live `T` that outlives
    // 'a and that nothing else uses meanwhile.
    unsafe { p.as_mut() }.ok_or_else(|| Fail::inval(format!("{what} handle is NULL")))
}

pub(crate) fn offset(off: libc::off_t, len: usize) -> R<u64> {
    if off < 0 {
        return Err(Fail::inval(format!("negative offset {off}")));
    }
    if len > isize::MAX as usize {
        return Err(Fail::inval(format!("length {len} is larger than SSIZE_MAX")));
    }
    match (off as u64).checked_add(len as u64) {
        Some(end) if end <= i64::MAX as u64 => Ok(off as u64),
        _ => Err(Fail(libc::EFBIG, format!("offset {off} + length {len} is past 2^63-1"))),
    }
}

// ---- errors ------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn ubc_strerror(err: c_int) -> *const c_char {
    let s: &'static CStr = match err {
        0 => c"Success",
        libc::EPERM => c"Operation not permitted",
        libc::ENOENT => c"No such file or directory",
        libc::EIO => c"Input/output error",
        libc::EBADF => c"Bad file descriptor (handle not open for this access)",
        libc::ENOMEM => c"Cannot allocate memory (cache budget exceeded)",
        libc::EACCES => c"Permission denied",
        libc::EEXIST => c"File exists",
        libc::ENOTDIR => c"Not a directory",
        libc::EISDIR => c"Is a directory",
        libc::EINVAL => c"Invalid argument",
        libc::EFBIG => c"File too large (offset past 2^63-1)",
        libc::ENOSPC => c"No space left on device",
        libc::EROFS => c"Read-only file system (read-only layer)",
        libc::ENOTEMPTY => c"Directory not empty",
        libc::EOVERFLOW => c"Value too large for defined data type",
        libc::EBADMSG => c"Bad message (authentication failed)",
        libc::ENAMETOOLONG => c"File name too long",
        _ => c"Unknown error",
    };
    s.as_ptr()
}

#[unsafe(no_mangle)]
pub extern "C" fn ubc_last_error() -> *const c_char {
    // The CString lives in the thread-local until the next failure on this thread.
    LAST.with(|l| l.borrow().as_ptr())
}

// ---- caches and stacks -----------------------------------------------------------

pub struct ubc_cache {
    cache: ubc::Cache,
}

pub struct ubc_stack {
    stack: Stack,
}

#[unsafe(no_mangle)]
pub extern "C" fn ubc_cache_new(budget: usize) -> *mut ubc_cache {
    guard(std::ptr::null_mut(), || new_cache(budget, ubc::HugePages::Never))
}

/// A cache handle, or the error as errno and message.
fn new_cache(budget: usize, huge: ubc::HugePages) -> R<*mut ubc_cache> {
    let cache = ubc::Cache::builder().budget(budget as u64).huge_pages(huge).build().map_err(|e| {
        let msg = format!("cache of {budget} bytes: {e}");
        let errno = match &e {
            ubc::Error::InvalidArgument(_) => libc::EINVAL,
            _ => ::ubc_stack::Error::from(e).errno(),
        };
        Fail(errno, msg)
    })?;
    Ok(Box::into_raw(Box::new(ubc_cache { cache })))
}

/// `ubc_cache_new` with huge pages: `huge` is `UBC_HUGE_NEVER` (0), `UBC_HUGE_TRY` (1) or
/// `UBC_HUGE_REQUIRE` (2), as `ubc::HugePages`.
#[unsafe(no_mangle)]
pub extern "C" fn ubc_cache_new_huge(budget: usize, huge: c_int) -> *mut ubc_cache {
    guard(std::ptr::null_mut(), || {
        let h = match huge {
            0 => ubc::HugePages::Never,
            1 => ubc::HugePages::Try,
            2 => ubc::HugePages::Require,
            _ => {
                return Err(Fail(
                    libc::EINVAL,
                    format!("huge pages {huge}: expected UBC_HUGE_NEVER, _TRY or _REQUIRE"),
                ));
            }
        };
        new_cache(budget, h)
    })
}

/// Which memory the cache's pages live in, and why (`CacheStats::page_memory`), copied into
/// `buf` (at most `len - 1` bytes and a NUL); returns its whole length, or -1.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_cache_page_memory(cache: *const ubc_cache, buf: *mut c_char, len: usize) -> isize {
    guard(-1, || {
        // SAFETY: the caller passes a live cache handle or NULL (ubc.h, "Pointer arguments").
        let c = unsafe { handle(cache as *mut ubc_cache, "cache") }?;
        let s = c.cache.stats().page_memory;
        if !buf.is_null() && len > 0 {
            let n = s.len().min(len - 1);
            // SAFETY: the caller's buffer holds `len` bytes; we write `n + 1 <= len`.
            unsafe {
                std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, n);
                *buf.add(n) = 0;
            }
        }
        Ok(s.len() as isize)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_cache_free(cache: *mut ubc_cache) {
    guard((), || {
        if !cache.is_null() {
            // SAFETY: non-NULL, so a `Box` leaked by ubc_cache_new; the caller frees each
            // handle once and uses it no more (ubc.h, "Handles and lifetimes").
            drop(unsafe { Box::from_raw(cache) });
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_stack_open(cache: *mut ubc_cache, spec: *const c_char) -> *mut ubc_stack {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live cache handle or NULL, and a NUL-terminated spec or
        // NULL (ubc.h, "Pointer arguments").
        let c = unsafe { handle(cache, "cache") }?;
        // SAFETY: as above.
        let spec = unsafe { cstr(spec, "spec") }?;
        let stack = Stack::open(spec, c.cache.clone()).map_err(|e| Fail::stack(&format!("stack {spec:?}"), e))?;
        Ok(Box::into_raw(Box::new(ubc_stack { stack })))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_stack_depth(stack: *const ubc_stack) -> c_int {
    // SAFETY: the caller passes a live stack handle or NULL (ubc.h, "Pointer arguments").
    guard(-1, || Ok(unsafe { handle(stack, "stack") }?.stack.depth() as c_int))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_stack_close(stack: *mut ubc_stack) {
    guard((), || {
        if !stack.is_null() {
            // SAFETY: non-NULL, so a `Box` leaked by ubc_stack_open; the caller closes each
            // handle once and uses it no more (ubc.h, "Handles and lifetimes").
            drop(unsafe { Box::from_raw(stack) });
        }
        Ok(())
    })
}

// ---- files ---------------------------------------------------------------------------

pub const UBC_RDONLY: c_int = 0;
pub const UBC_RDWR: c_int = 2;
pub const UBC_CREAT: c_int = 0x40;
pub const UBC_TRUNC: c_int = 0x200;
pub const UBC_DSYNC: c_int = 0x1000;
pub const UBC_SYNC: c_int = 0x101000;
pub const UBC_PROT_READ: c_int = 1;
pub const UBC_PROT_WRITE: c_int = 2;

pub struct ubc_file {
    file: File,
}

pub(crate) fn open_file(stack: &Stack, layer: c_int, path: &str, opts: OpenOptions) -> R<File> {
    let l = if layer == -1 {
        stack.top()
    } else if layer < 0 {
        return Err(Fail::inval(format!("open {path}: layer {layer} (use -1 for the top)")));
    } else {
        stack.layer(layer as usize).map_err(|e| Fail::stack(&format!("open {path}"), e))?
    };
    l.open_with(path, opts).map_err(|e| Fail::stack(&format!("open {path} at layer {}", l.index()), e))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_open(
    stack: *mut ubc_stack,
    layer: c_int,
    path: *const c_char,
    flags: c_int,
) -> *mut ubc_file {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live stack handle or NULL, and a NUL-terminated path or
        // NULL (ubc.h, "Pointer arguments").
        let s = unsafe { handle(stack, "stack") }?;
        // SAFETY: as above.
        let path = unsafe { cstr(path, "path") }?;
        if flags & !(UBC_RDWR | UBC_CREAT | UBC_TRUNC | UBC_SYNC) != 0 {
            return Err(Fail::inval(format!("open {path}: unknown flags {flags:#x}")));
        }
        let write = flags & UBC_RDWR != 0;
        let truncate = flags & UBC_TRUNC != 0;
        if truncate && !write {
            return Err(Fail::inval(format!("open {path}: UBC_TRUNC needs UBC_RDWR")));
        }
        let file = open_file(
            &s.stack,
            layer,
            path,
            OpenOptions::new().write(write).create(flags & UBC_CREAT != 0).truncate(truncate).write_sync(
                match flags & UBC_SYNC {
                    UBC_SYNC => ubc::WriteSync::All,
                    UBC_DSYNC => ubc::WriteSync::Data,
                    _ => ubc::WriteSync::None,
                },
            ),
        )?;
        Ok(Box::into_raw(Box::new(ubc_file { file })))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_close(file: *mut ubc_file) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live file handle or NULL (ubc.h, "Pointer arguments").
        unsafe { handle(file, "file") }?;
        // SAFETY: non-NULL (checked just above), so a `Box` leaked by ubc_open; the caller
        // closes each handle once and uses it no more (ubc.h, "Handles and lifetimes").
        drop(unsafe { Box::from_raw(file) });
        Ok(0)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_pread(file: *mut ubc_file, buf: *mut c_void, len: usize, off: libc::off_t) -> isize {
    guard(-1, || {
        // SAFETY: the caller passes a live file handle or NULL (ubc.h, "Pointer arguments").
        let f = unsafe { handle(file, "file") }?;
        let o = offset(off, len)?;
        if len == 0 {
            return Ok(0);
        }
        if buf.is_null() {
            return Err(Fail::inval("pread: buffer is NULL"));
        }
        // SAFETY: `buf` is non-NULL and `len` > 0, so the caller promises `len` writable bytes
        // there that no one else touches during the call (ubc.h, "Pointer arguments").
        let b = unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, len) };
        let n = f.file.read_at(b, o).map_err(|e| Fail::stack(&format!("pread {} at {o}", f.file.path()), e))?;
        Ok(n as isize)
    })
}

pub(crate) fn write_all(f: &File, mut b: &[u8], mut o: u64) -> R<()> {
    while !b.is_empty() {
        let n = f.write_at(b, o).map_err(|e| Fail::stack(&format!("write {} at {o}", f.path()), e))?;
        if n == 0 {
            return Err(Fail(libc::EIO, format!("write {} at {o}: wrote nothing", f.path())));
        }
        b = &b[n..];
        o += n as u64;
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_pwrite(file: *mut ubc_file, buf: *const c_void, len: usize, off: libc::off_t) -> isize {
    guard(-1, || {
        // SAFETY: the caller passes a live file handle or NULL (ubc.h, "Pointer arguments").
        let f = unsafe { handle(file, "file") }?;
        let o = offset(off, len)?;
        if len == 0 {
            return Ok(0);
        }
        if buf.is_null() {
            return Err(Fail::inval("pwrite: buffer is NULL"));
        }
        // SAFETY: `buf` is non-NULL and `len` > 0, so the caller promises `len` readable bytes
        // there, unchanged during the call (ubc.h, "Pointer arguments").
        let b = unsafe { std::slice::from_raw_parts(buf as *const u8, len) };
        write_all(&f.file, b, o)?;
        Ok(len as isize)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fsync(file: *mut ubc_file) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live file handle or NULL (ubc.h, "Pointer arguments").
        let f = unsafe { handle(file, "file") }?;
        f.file.sync_all().map_err(|e| Fail::stack(&format!("fsync {}", f.file.path()), e))?;
        Ok(0)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fdatasync(file: *mut ubc_file) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live file handle or NULL (ubc.h, "Pointer arguments").
        let f = unsafe { handle(file, "file") }?;
        f.file.sync().map_err(|e| Fail::stack(&format!("fdatasync {}", f.file.path()), e))?;
        Ok(0)
    })
}

pub const UBC_FADV_NORMAL: c_int = 0;
pub const UBC_FADV_RANDOM: c_int = 1;
pub const UBC_FADV_SEQUENTIAL: c_int = 2;
pub const UBC_FADV_WILLNEED: c_int = 3;
pub const UBC_FADV_DONTNEED: c_int = 4;
pub const UBC_FADV_NOREUSE: c_int = 5;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fadvise(file: *mut ubc_file, off: libc::off_t, len: libc::off_t, advice: c_int) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live file handle or NULL (ubc.h, "Pointer arguments").
        let f = unsafe { handle(file, "file") }?;
        if off < 0 || len < 0 {
            return Err(Fail::inval(format!("fadvise: negative offset {off} or length {len}")));
        }
        let a =
            ubc::Advice::from_posix(advice).ok_or_else(|| Fail::inval(format!("fadvise: unknown advice {advice}")))?;
        // posix_fadvise: a length of 0 means to the end of the file.
        let end = if len == 0 { u64::MAX } else { (off as u64).saturating_add(len as u64) };
        f.file.advise(off as u64..end, a).map_err(|e| Fail::stack(&format!("fadvise {}", f.file.path()), e))?;
        Ok(0)
    })
}

/// A C writeback hook: returns 0 to let the write go, or an errno value to fail it.
pub type ubc_writeback_hook = Option<unsafe extern "C" fn(ctx: *mut c_void, offset: u64, len: u64) -> c_int>;

/// The hook's context pointer, handed back to it on any thread (ubc.h: the caller makes
/// what it points to safe to use from the cache's threads).
struct HookCtx(*mut c_void);
// SAFETY: the pointer is only passed back to the caller's hook, whose contract (ubc.h,
// ubc_set_writeback_hook) is to be callable from any thread with it.
unsafe impl Send for HookCtx {}
// SAFETY: as above.
unsafe impl Sync for HookCtx {}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_set_writeback_hook(
    file: *mut ubc_file,
    hook: ubc_writeback_hook,
    ctx: *mut c_void,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live file handle or NULL (ubc.h, "Pointer arguments").
        let f = unsafe { handle(file, "file") }?;
        let hook: Option<ubc::WritebackHook> = hook.map(|h| {
            let ctx = HookCtx(ctx);
            std::sync::Arc::new(move |r: std::ops::Range<u64>| {
                let ctx = &ctx;
                // SAFETY: the caller's hook, called as ubc.h says: with its context, from
                // any thread, with a range of the file.
                match unsafe { h(ctx.0, r.start, r.end - r.start) } {
                    0 => Ok(()),
                    e if e > 0 => Err(std::io::Error::from_raw_os_error(e)),
                    e => Err(std::io::Error::other(format!("writeback hook returned {e}"))),
                }
            }) as ubc::WritebackHook
        });
        f.file
            .set_writeback_hook(hook)
            .map_err(|e| Fail::stack(&format!("set_writeback_hook {}", f.file.path()), e))?;
        Ok(0)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_size(file: *mut ubc_file) -> libc::off_t {
    guard(-1, || {
        // SAFETY: the caller passes a live file handle or NULL (ubc.h, "Pointer arguments").
        let f = unsafe { handle(file, "file") }?;
        let n = f.file.len().map_err(|e| Fail::stack(&format!("size {}", f.file.path()), e))?;
        Ok(n as libc::off_t)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_truncate(file: *mut ubc_file, len: libc::off_t) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live file handle or NULL (ubc.h, "Pointer arguments").
        let f = unsafe { handle(file, "file") }?;
        let l = offset(len, 0)?;
        f.file.set_len(l).map_err(|e| Fail::stack(&format!("truncate {} to {l}", f.file.path()), e))?;
        Ok(0)
    })
}

// ---- mappings ------------------------------------------------------------------------

pub struct ubc_map {
    map: Mapping,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_map(
    file: *mut ubc_file,
    off: libc::off_t,
    len: usize,
    prot: c_int,
    addr_out: *mut *mut c_void,
) -> *mut ubc_map {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live file handle or NULL (ubc.h, "Pointer arguments").
        let f = unsafe { handle(file, "file") }?;
        if addr_out.is_null() {
            return Err(Fail::inval("map: addr_out is NULL"));
        }
        if prot & !(UBC_PROT_READ | UBC_PROT_WRITE) != 0 || prot == 0 {
            return Err(Fail::inval(format!("map {}: bad prot {prot:#x}", f.file.path())));
        }
        if len == 0 {
            return Err(Fail::inval(format!("map {}: empty range", f.file.path())));
        }
        let o = offset(off, len)?;
        let write = prot & UBC_PROT_WRITE != 0;
        if write && !f.file.cache_file().is_writable() {
            return Err(Fail(libc::EBADF, format!("map {}: writable mapping of a read-only handle", f.file.path())));
        }
        let access = if write { ubc::Access::ReadWrite } else { ubc::Access::ReadOnly };
        let map = f
            .file
            .map(o..o + len as u64, access, ubc::Sharing::Shared)
            .map_err(|e| Fail::stack(&format!("map {} [{o}, +{len})", f.file.path()), e))?;
        // SAFETY: checked non-NULL above; the caller promises it points to a writable
        // `void *` (ubc.h, "Pointer arguments").
        unsafe { *addr_out = map.as_ptr() as *mut c_void };
        Ok(Box::into_raw(Box::new(ubc_map { map })))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_msync(map: *mut ubc_map) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live map handle or NULL (ubc.h, "Pointer arguments").
        let m = unsafe { handle(map, "map") }?;
        m.map.flush().map_err(|e| Fail::stack("msync", e))?;
        Ok(0)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_madvise(map: *mut ubc_map, advice: c_int) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live map handle or NULL (ubc.h, "Pointer arguments").
        let m = unsafe { handle(map, "map") }?;
        let a =
            ubc::Advice::from_posix(advice).ok_or_else(|| Fail::inval(format!("madvise: unknown advice {advice}")))?;
        m.map.advise(a).map_err(|e| Fail::stack("madvise", e.into()))?;
        Ok(0)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_unmap(map: *mut ubc_map) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live map handle or NULL (ubc.h, "Pointer arguments").
        unsafe { handle(map, "map") }?;
        // SAFETY: non-NULL (checked just above), so a `Box` leaked by ubc_map; the caller
        // unmaps each mapping once and uses it no more (ubc.h, "Handles and lifetimes").
        drop(unsafe { Box::from_raw(map) });
        Ok(0)
    })
}

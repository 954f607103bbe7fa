//! Stdio-style streams modelled on Mach's mapped stdio (Rashid et al., section 6.2).
//!
//! A stream reading a file uses, as its buffer, the whole file mapped from the cache
//! (one read-only shared mapping; the stdio buffer "enlarged to the size of the file"),
//! so the inline `ubc_fgetc` in `ubc.h` is a compare and a load until end of file. When
//! the mapping cannot be made (e.g. no userfaultfd and a file larger than the budget can
//! pin), reads fall back to a heap buffer filled with `read_at`. Writes go through a heap
//! buffer pushed with `write_at` — the cache is unified, so pushed bytes are at once what
//! the read mapping, `pread` and every layer see. `ubc_fmap` hands out a mapping of the
//! whole file, kept until `ubc_fclose`.

use crate::{Fail, R, guard, open_file, write_all};
use ::ubc_stack::{File, Mapping, OpenOptions};
use std::ffi::{c_char, c_int, c_void};

const BUFSZ: usize = 64 << 10;
const EOF: c_int = -1;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Idle,
    Read,
    Write,
}

/// A stream. The first three fields are the public prefix (`UBC_FILE` in `ubc.h`).
#[repr(C)]
pub struct UbcStdio {
    ptr: *mut u8,
    rend: *mut u8,
    wend: *mut u8,
    // ---- private ----
    /// File offset of `base`.
    off: u64,
    base: *mut u8,
    mode: Mode,
    heap: Box<[u8]>,
    /// The read window: a read-only mapping of the whole file (as long as it was then).
    window: Option<Mapping>,
    /// Mapping the window failed once: use the heap buffer for reads.
    no_window: bool,
    /// Mappings handed out by `ubc_fmap`, valid until fclose.
    fmaps: Vec<Mapping>,
    /// The length of the last mapping `ubc_fmap` handed out (Mach's `fbufsize`).
    bufsize: usize,
    readable: bool,
    writable: bool,
    append: bool,
    update: bool,
    eof: bool,
    err: bool,
    file: File,
}

static EMPTY: u8 = 0;

impl UbcStdio {
    fn pos(&self) -> u64 {
        self.off + (self.ptr as usize - self.base as usize) as u64
    }

    fn set_idle(&mut self, pos: u64) {
        self.base = self.heap.as_mut_ptr();
        self.ptr = self.base;
        self.rend = self.base;
        self.wend = self.base;
        self.off = pos;
        self.mode = Mode::Idle;
    }

    fn fail(&mut self, f: Fail) -> Fail {
        if f.0 != libc::EINVAL {
            self.err = true;
        }
        f
    }

    /// Push the write buffer into the cache (stays in write mode, buffer empty).
    fn push(&mut self) -> R<()> {
        if self.mode != Mode::Write {
            return Ok(());
        }
        let n = self.ptr as usize - self.base as usize;
        if n > 0 {
            let at = if self.append {
                self.file.len().map_err(|e| Fail::stack(&format!("append {}", self.file.path()), e))?
            } else {
                self.off
            };
            // SAFETY: in write mode base is the heap buffer's start and base <= ptr <= wend =
            // its end (enter_write, putc, write), so base..ptr is its filled part.
            let data = unsafe { std::slice::from_raw_parts(self.base, n) };
            if let Err(f) = write_all(&self.file, data, at) {
                // Drop the buffered bytes: they cannot be written (as stdio does).
                self.ptr = self.base;
                return Err(self.fail(f));
            }
            self.off = at + n as u64;
            self.ptr = self.base;
        }
        Ok(())
    }

    /// Leave write or read mode at the current position.
    fn settle(&mut self) -> R<()> {
        // After a push the buffer is empty: pos() is where the next byte goes.
        self.push()?;
        let p = self.pos();
        self.set_idle(p);
        Ok(())
    }

    fn enter_write(&mut self) -> R<()> {
        if !self.writable {
            return Err(Fail(libc::EBADF, format!("write {}: stream not open for writing", self.file.path())));
        }
        if self.mode == Mode::Write {
            return Ok(());
        }
        let p = self.pos();
        self.set_idle(p);
        self.rend = self.base;
        self.wend = self.base.wrapping_add(self.heap.len());
        self.mode = Mode::Write;
        Ok(())
    }

    /// Make bytes available at the current position. Ok(false) at end of file.
    fn refill(&mut self) -> R<bool> {
        if !self.readable {
            return Err(Fail(libc::EBADF, format!("read {}: stream not open for reading", self.file.path())));
        }
        if self.mode == Mode::Write {
            self.settle()?;
        }
        let p = self.pos();
        let len = self.file.len().map_err(|e| self.fail(Fail::stack(&format!("read {}", self.file.path()), e)))?;
        if p >= len {
            self.set_idle(p);
            self.eof = true;
            return Ok(false);
        }
        if !self.no_window {
            let covers = self.window.as_ref().is_some_and(|w| w.offset() <= p && p < w.offset() + w.len() as u64);
            if !covers {
                self.window = None;
                match self.file.map(0..len, ubc::Access::ReadOnly, ubc::Sharing::Shared) {
                    Ok(m) => self.window = Some(m),
                    Err(_) => self.no_window = true,
                }
            }
            if let Some(w) = &self.window {
                let end = (w.offset() + w.len() as u64).min(len);
                self.base = w.as_ptr() as *mut u8;
                self.off = w.offset();
                self.ptr = self.base.wrapping_add((p - self.off) as usize);
                self.rend = self.base.wrapping_add((end - self.off) as usize);
                self.wend = self.base;
                self.mode = Mode::Read;
                return Ok(true);
            }
        }
        let n = self
            .file
            .read_at(&mut self.heap, p)
            .map_err(|e| self.fail(Fail::stack(&format!("read {} at {p}", self.file.path()), e)))?;
        self.set_idle(p);
        if n == 0 {
            self.eof = true;
            return Ok(false);
        }
        self.rend = self.base.wrapping_add(n);
        self.mode = Mode::Read;
        Ok(true)
    }

    fn getc(&mut self) -> R<c_int> {
        if self.ptr < self.rend {
            // SAFETY: ptr < rend, and base..rend lies in the heap buffer (filled by read_at) or
            // in the read window, a mapping `self.window` keeps alive while it is the buffer.
            let c = unsafe { *self.ptr };
            self.ptr = self.ptr.wrapping_add(1);
            return Ok(c as c_int);
        }
        if !self.refill()? {
            return Ok(EOF);
        }
        self.getc()
    }

    fn putc(&mut self, c: c_int) -> R<c_int> {
        self.enter_write()?;
        if self.ptr >= self.wend {
            self.push()?;
        }
        // SAFETY: enter_write made this write mode (base..wend is the heap buffer) and the
        // push above emptied a full buffer, so ptr < wend.
        unsafe { *self.ptr = c as u8 };
        self.ptr = self.ptr.wrapping_add(1);
        Ok(c as u8 as c_int)
    }

    fn read(&mut self, out: &mut [u8]) -> R<usize> {
        let mut done = 0;
        while done < out.len() {
            let avail = if self.mode == Mode::Read { self.rend as usize - self.ptr as usize } else { 0 };
            if avail == 0 {
                if !self.refill()? {
                    break;
                }
                continue;
            }
            let n = avail.min(out.len() - done);
            // SAFETY: read mode and n <= rend - ptr: the bytes lie in the heap buffer or the
            // read window mapping, which `self.window` keeps alive.
            out[done..done + n].copy_from_slice(unsafe { std::slice::from_raw_parts(self.ptr, n) });
            self.ptr = self.ptr.wrapping_add(n);
            done += n;
        }
        Ok(done)
    }

    fn write(&mut self, mut data: &[u8]) -> R<usize> {
        self.enter_write()?;
        let total = data.len();
        while !data.is_empty() {
            if self.ptr == self.base && data.len() >= self.heap.len() {
                // Large write: straight into the cache.
                let at = if self.append {
                    self.file.len().map_err(|e| self.fail(Fail::stack(&format!("append {}", self.file.path()), e)))?
                } else {
                    self.off
                };
                write_all(&self.file, data, at).map_err(|f| self.fail(f))?;
                self.off = at + data.len() as u64;
                return Ok(total);
            }
            let space = self.wend as usize - self.ptr as usize;
            if space == 0 {
                self.push()?;
                continue;
            }
            let n = space.min(data.len());
            // SAFETY: write mode (enter_write): ptr..wend is free room in the heap buffer and
            // n <= wend - ptr; `data` is a separate slice, so the ranges do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr, n) };
            self.ptr = self.ptr.wrapping_add(n);
            data = &data[n..];
        }
        Ok(total)
    }

    fn seek(&mut self, offset: i64, whence: c_int) -> R<()> {
        self.push()?;
        let cur = self.pos();
        let baseline: i128 = match whence {
            libc::SEEK_SET => 0,
            libc::SEEK_CUR => cur as i128,
            libc::SEEK_END => {
                self.file.len().map_err(|e| self.fail(Fail::stack(&format!("seek {}", self.file.path()), e)))? as i128
            }
            w => return Err(Fail::inval(format!("seek {}: bad whence {w}", self.file.path()))),
        };
        let target = baseline + offset as i128;
        if target < 0 || target > i64::MAX as i128 {
            return Err(Fail::inval(format!("seek {}: position {target} out of range", self.file.path())));
        }
        let target = target as u64;
        self.eof = false;
        if self.mode == Mode::Read {
            let hi = self.off + (self.rend as usize - self.base as usize) as u64;
            if self.off <= target && target <= hi {
                self.ptr = self.base.wrapping_add((target - self.off) as usize);
                return Ok(());
            }
        }
        self.set_idle(target);
        Ok(())
    }

    fn flush(&mut self, sync: bool) -> R<()> {
        self.push()?;
        if sync && self.writable {
            self.file.sync().map_err(|e| self.fail(Fail::stack(&format!("fflush {}", self.file.path()), e)))?;
        }
        Ok(())
    }

    /// Mach's `fmap(stream, size)`: `size` 0 maps the whole file as it is (writable only
    /// for an update stream); a larger `size` on a writable stream first extends the file
    /// to it with zeros ("initially, the buffer will be zero-filled") and maps it writable —
    /// a write map, as Mach's `fopen(…, "w")` then `fmap` gives.
    fn fmap(&mut self, size: u64) -> R<(*const u8, usize)> {
        self.settle()?;
        let mut len = self.file.len().map_err(|e| self.fail(Fail::stack(&format!("fmap {}", self.file.path()), e)))?;
        let grow = size > len && self.writable;
        if grow {
            self.file.set_len(size).map_err(|e| self.fail(Fail::stack(&format!("fmap {}", self.file.path()), e)))?;
            len = size;
        }
        if len == 0 {
            self.bufsize = 0;
            return Ok((&EMPTY as *const u8, 0));
        }
        let n = usize::try_from(len)
            .map_err(|_| Fail(libc::EFBIG, format!("fmap {}: file larger than the address space", self.file.path())))?;
        let access =
            if self.update || (size > 0 && self.writable) { ubc::Access::ReadWrite } else { ubc::Access::ReadOnly };
        let m = self
            .file
            .map(0..len, access, ubc::Sharing::Shared)
            .map_err(|e| self.fail(Fail::stack(&format!("fmap {}", self.file.path()), e)))?;
        let p = m.as_ptr();
        self.fmaps.push(m);
        self.bufsize = n;
        Ok((p, n))
    }
}

/// The stream behind a `UBC_FILE *` (EINVAL for NULL).
///
/// # Safety
/// `f` is NULL or a live stream from `ubc_fopen`, used by no other thread during `'a`
/// (ubc.h: a UBC_FILE is not thread-safe, one thread at a time).
unsafe fn stream<'a>(f: *mut UbcStdio) -> R<&'a mut UbcStdio> {
    // SAFETY: this function's contract is `handle_mut`'s.
    unsafe { crate::handle_mut(f, "stream") }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fopen(
    stack: *mut crate::ubc_stack,
    path: *const c_char,
    mode: *const c_char,
) -> *mut UbcStdio {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a live stack handle or NULL, and NUL-terminated path and
        // mode strings or NULL (ubc.h, "Pointer arguments").
        let s = unsafe { crate::handle(stack, "stack") }?;
        // SAFETY: as above.
        let path = unsafe { crate::cstr(path, "path") }?;
        // SAFETY: as above.
        let mode = unsafe { crate::cstr(mode, "mode") }?;
        let m: String = mode.chars().filter(|&c| c != 'b').collect();
        let (readable, writable, create, truncate, append, update) = match m.as_str() {
            "r" => (true, false, false, false, false, false),
            "r+" => (true, true, false, false, false, true),
            "w" => (false, true, true, true, false, false),
            "w+" => (true, true, true, true, false, true),
            "a" => (false, true, true, false, true, false),
            "a+" => (true, true, true, false, true, true),
            _ => return Err(Fail::inval(format!("fopen {path}: bad mode {mode:?}"))),
        };
        let file = open_file(&s.stack, -1, path, OpenOptions::new().write(writable).create(create).truncate(truncate))?;
        let mut st = Box::new(UbcStdio {
            ptr: std::ptr::null_mut(),
            rend: std::ptr::null_mut(),
            wend: std::ptr::null_mut(),
            off: 0,
            base: std::ptr::null_mut(),
            mode: Mode::Idle,
            heap: vec![0u8; BUFSZ].into_boxed_slice(),
            window: None,
            no_window: false,
            fmaps: Vec::new(),
            bufsize: 0,
            readable,
            writable,
            append,
            update,
            eof: false,
            err: false,
            file,
        });
        st.set_idle(0);
        Ok(Box::into_raw(st))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fclose(f: *mut UbcStdio) -> c_int {
    guard(EOF, || {
        // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
        unsafe { stream(f) }?;
        // SAFETY: non-NULL (checked just above), so a `Box` leaked by ubc_fopen; the caller
        // closes each stream once and uses it no more (ubc.h, "Handles and lifetimes").
        let mut st = unsafe { Box::from_raw(f) };
        let r = st.flush(true);
        st.window = None;
        st.fmaps.clear();
        drop(st);
        r.map(|_| 0)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fflush(f: *mut UbcStdio) -> c_int {
    // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
    guard(EOF, || unsafe { stream(f) }?.flush(true).map(|_| 0))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fread(ptr: *mut c_void, size: usize, nmemb: usize, f: *mut UbcStdio) -> usize {
    guard(0, || {
        // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
        let st = unsafe { stream(f) }?;
        let total = size.checked_mul(nmemb).ok_or_else(|| Fail::inval("fread: size * nmemb overflows"))?;
        if total == 0 {
            return Ok(0);
        }
        if ptr.is_null() {
            return Err(Fail::inval("fread: buffer is NULL"));
        }
        // SAFETY: `ptr` is non-NULL and `total` > 0, so the caller promises `total` writable
        // bytes there that no one else touches during the call (ubc.h, "Pointer arguments").
        let out = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, total) };
        Ok(st.read(out)? / size)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fwrite(ptr: *const c_void, size: usize, nmemb: usize, f: *mut UbcStdio) -> usize {
    guard(0, || {
        // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
        let st = unsafe { stream(f) }?;
        let total = size.checked_mul(nmemb).ok_or_else(|| Fail::inval("fwrite: size * nmemb overflows"))?;
        if total == 0 {
            return Ok(0);
        }
        if ptr.is_null() {
            return Err(Fail::inval("fwrite: buffer is NULL"));
        }
        // SAFETY: `ptr` is non-NULL and `total` > 0, so the caller promises `total` readable
        // bytes there, unchanged during the call (ubc.h, "Pointer arguments").
        let data = unsafe { std::slice::from_raw_parts(ptr as *const u8, total) };
        Ok(st.write(data)? / size)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc__fgetc_slow(f: *mut UbcStdio) -> c_int {
    // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
    guard(EOF, || unsafe { stream(f) }?.getc())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc__fputc_slow(c: c_int, f: *mut UbcStdio) -> c_int {
    // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
    guard(EOF, || unsafe { stream(f) }?.putc(c))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fgetc_func(f: *mut UbcStdio) -> c_int {
    // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
    guard(EOF, || unsafe { stream(f) }?.getc())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fputc_func(c: c_int, f: *mut UbcStdio) -> c_int {
    // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
    guard(EOF, || unsafe { stream(f) }?.putc(c))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fseek(f: *mut UbcStdio, offset: libc::off_t, whence: c_int) -> c_int {
    // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
    guard(-1, || unsafe { stream(f) }?.seek(offset, whence).map(|_| 0))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_ftell(f: *mut UbcStdio) -> libc::off_t {
    guard(-1, || {
        // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
        let st = unsafe { stream(f) }?;
        // In append mode buffered bytes go to the end: report where they will land.
        if st.append && st.mode == Mode::Write {
            st.push()?;
            return Ok(st.off as libc::off_t);
        }
        Ok(st.pos() as libc::off_t)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_rewind(f: *mut UbcStdio) {
    guard((), || {
        // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
        let st = unsafe { stream(f) }?;
        let r = st.seek(0, libc::SEEK_SET);
        st.err = false;
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_feof(f: *mut UbcStdio) -> c_int {
    // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
    guard(0, || Ok(unsafe { stream(f) }?.eof as c_int))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_ferror(f: *mut UbcStdio) -> c_int {
    // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
    guard(0, || Ok(unsafe { stream(f) }?.err as c_int))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_clearerr(f: *mut UbcStdio) {
    guard((), || {
        // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
        let st = unsafe { stream(f) }?;
        st.eof = false;
        st.err = false;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fmap(f: *mut UbcStdio, len_out: *mut usize) -> *const c_void {
    // SAFETY: as ubc_fmap_size's.
    unsafe { ubc_fmap_size(f, 0, len_out) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fbufsize(f: *mut UbcStdio) -> usize {
    guard(0, || {
        // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
        Ok(unsafe { stream(f) }?.bufsize)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ubc_fmap_size(f: *mut UbcStdio, size: usize, len_out: *mut usize) -> *const c_void {
    guard(std::ptr::null(), || {
        // SAFETY: the caller passes a live stream or NULL, used by this thread only (ubc.h).
        let st = unsafe { stream(f) }?;
        let (p, n) = st.fmap(size as u64)?;
        if !len_out.is_null() {
            // SAFETY: non-NULL, so the caller promises a writable `size_t` there (ubc.h,
            // "Pointer arguments").
            unsafe { *len_out = n };
        }
        Ok(p as *const c_void)
    })
}

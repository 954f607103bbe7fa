//! Python bindings for ubc stacks: the native half of the `ubc` package (`ubc._ubc`).
//!
//! The Python half (`python/ubc/__init__.py`) wraps these classes in `io` objects; this
//! module keeps to positional I/O (`read_into`/`write_at`), namespace operations, mappings
//! with the buffer protocol, and statistics. Every call that can touch a store runs with
//! the GIL released.

use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyBufferError, PyOSError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::os::raw::{c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

create_exception!(
    _ubc,
    AuthenticationError,
    PyOSError,
    "Data read through an encryption layer failed authentication (tampered, truncated, \
     reordered or swapped ciphertext, or the wrong key)."
);

/// A stack error as the matching Python exception: `OSError(errno, message)` (which
/// Python turns into `FileNotFoundError`, `PermissionError`, `IsADirectoryError`, … by
/// errno), or `AuthenticationError` for authentication failures.
fn err(e: ubc_stack::Error) -> PyErr {
    let msg = e.to_string();
    if e.is_auth() {
        return AuthenticationError::new_err((libc::EBADMSG, msg));
    }
    PyOSError::new_err((e.errno(), msg))
}

fn cache_err(e: ubc::Error) -> PyErr {
    err(ubc_stack::Error::Cache(e))
}

fn secs(t: SystemTime) -> f64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

fn kind_name(k: ubc_stack::Kind) -> &'static str {
    match k {
        ubc_stack::Kind::File => "file",
        ubc_stack::Kind::Dir => "dir",
        ubc_stack::Kind::Symlink => "symlink",
        ubc_stack::Kind::Fifo => "fifo",
        ubc_stack::Kind::Socket => "socket",
        ubc_stack::Kind::CharDevice => "chardev",
        ubc_stack::Kind::BlockDevice => "blockdev",
        _ => "unknown",
    }
}

/// A memory budget shared by stacks: `Cache(budget=256 << 20)` (bytes).
/// `huge_pages="try"` (or `"require"`) gives it 2 MiB pages where the host allows (see
/// `stats()["page_memory"]`); the default is `"never"`. Files of memory-backed stores (the
/// `mem` layer, host files on tmpfs) are served in place from the store's own pages
/// (`stats()["xip_bytes"]`), unless `xip=False`.
#[pyclass(module = "ubc", frozen)]
struct Cache {
    inner: ubc::Cache,
}

#[pymethods]
impl Cache {
    #[new]
    #[pyo3(signature = (budget = 256 << 20, huge_pages = "never", xip = true))]
    fn new(budget: u64, huge_pages: &str, xip: bool) -> PyResult<Self> {
        let huge: ubc::HugePages =
            huge_pages.parse().map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("huge_pages={e}")))?;
        let inner = ubc::Cache::builder().budget(budget).huge_pages(huge).xip(xip).build().map_err(cache_err)?;
        Ok(Cache { inner })
    }

    /// Whole-cache statistics as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.inner.stats());
        cache_stats(py, &s)
    }

    /// Write every dirty page back and sync the stores.
    fn sync_all(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.sync_all()).map_err(cache_err)
    }

    fn __repr__(&self) -> String {
        format!("ubc.Cache(budget={})", self.inner.stats().budget_bytes)
    }
}

fn cache_stats<'py>(py: Python<'py>, s: &ubc::CacheStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let t = &s.totals;
    d.set_item("hits", t.hits)?;
    d.set_item("misses", t.misses)?;
    d.set_item("hit_ratio", t.hit_ratio())?;
    d.set_item("read_bytes", t.read_bytes)?;
    d.set_item("written_bytes", t.written_bytes)?;
    d.set_item("get_calls", t.get_calls)?;
    d.set_item("put_calls", t.put_calls)?;
    d.set_item("evictions", t.evictions)?;
    d.set_item("writebacks", t.writebacks)?;
    d.set_item("writeback_errors", t.writeback_errors)?;
    d.set_item("readahead_pages", t.readahead_pages)?;
    d.set_item("readahead_hits", t.readahead_hits)?;
    d.set_item("readahead_waste", t.readahead_waste)?;
    d.set_item("resident_bytes", t.resident_bytes)?;
    d.set_item("dirty_bytes", t.dirty_bytes)?;
    d.set_item("xip_bytes", t.xip_bytes)?;
    d.set_item("budget_bytes", s.budget_bytes)?;
    d.set_item("allocated_bytes", s.allocated_bytes)?;
    d.set_item("page_size", s.page_size)?;
    d.set_item("page_memory", &s.page_memory)?;
    d.set_item("objects", s.objects)?;
    d.set_item("windows", s.windows)?;
    d.set_item("window_maps", s.window_maps)?;
    d.set_item("window_retires", s.window_retires)?;
    d.set_item("daemon_runs", s.daemon_runs)?;
    d.set_item("daemon_evictions", s.daemon_evictions)?;
    d.set_item("policy", s.policy)?;
    d.set_item("policy_pages", s.policy_pages)?;
    d.set_item("shared_memfds", s.shared_memfds)?;
    d.set_item("unclean_bytes", s.unclean_bytes)?;
    d.set_item("dirty_limit_bytes", s.dirty_limit_bytes)?;
    d.set_item("throttled_ms", s.throttled_ms)?;
    d.set_item("flusher_runs", s.flusher_runs)?;
    d.set_item("map_mode", &s.map_mode)?;
    d.set_item("mappings", s.mappings)?;
    d.set_item("map_faults", s.map_faults)?;
    d.set_item("map_fault_pages", s.map_fault_pages)?;
    d.set_item("map_sigbus", s.map_sigbus)?;
    d.set_item("map_dirty_found", s.map_dirty_found)?;
    Ok(d)
}

/// Statistics of a cache as a dict (`ubc.stats(cache)`).
#[pyfunction]
fn stats<'py>(py: Python<'py>, cache: &Cache) -> PyResult<Bound<'py, PyDict>> {
    cache.stats(py)
}

/// Write a fresh random 256-bit key to `path` (mode 0600; refuses to overwrite), for
/// `aead:keyfile=PATH`.
#[pyfunction]
fn generate_key(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    py.detach(|| ubc_stack::encrypt::Key::generate().write_file(&path))
        .map_err(|e| err(ubc_stack::Error::io(&path.display().to_string(), e)))
}

/// The native stack (see `ubc.Stack`).
#[pyclass(module = "ubc._ubc", frozen)]
struct RawStack {
    inner: ubc_stack::Stack,
}

#[pymethods]
impl RawStack {
    #[new]
    fn new(py: Python<'_>, spec: String, cache: &Cache) -> PyResult<Self> {
        let c = cache.inner.clone();
        let inner = py.detach(|| ubc_stack::Stack::open(&spec, c)).map_err(err)?;
        Ok(RawStack { inner })
    }

    #[getter]
    fn depth(&self) -> usize {
        self.inner.depth()
    }

    #[getter]
    fn spec(&self) -> String {
        self.inner.spec()
    }

    fn layer(&self, i: usize) -> PyResult<RawLayer> {
        Ok(RawLayer { inner: self.inner.layer(i).map_err(err)? })
    }

    fn cache(&self) -> Cache {
        Cache { inner: self.inner.cache().clone() }
    }

    fn sync_all(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.sync_all()).map_err(err)
    }

    /// Cache statistics plus the stack's coherence and name-cache counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.inner.cache().stats());
        let d = cache_stats(py, &s)?;
        let c = self.inner.coherence_stats();
        d.set_item("coherence_slow_path", c.slow_path)?;
        d.set_item("coherence_flushes", c.flushes)?;
        d.set_item("coherence_invalidations", c.invalidations)?;
        let (hits, inv) = self.inner.name_cache_stats();
        d.set_item("name_cache_hits", hits)?;
        d.set_item("name_cache_invalidations", inv)?;
        Ok(d)
    }
}

/// File attributes as one layer shows them.
#[pyclass(module = "ubc", frozen, get_all)]
struct StatResult {
    /// Bytes, as this layer sees them.
    size: u64,
    /// Permission bits.
    mode: u32,
    /// "file", "dir" or "symlink".
    kind: &'static str,
    /// Seconds since the epoch.
    mtime: f64,
    atime: f64,
    ino: u64,
}

#[pymethods]
impl StatResult {
    fn __repr__(&self) -> String {
        format!(
            "ubc.StatResult(kind={:?}, size={}, mode=0o{:o}, mtime={}, ino={})",
            self.kind, self.size, self.mode, self.mtime, self.ino
        )
    }
}

/// The native layer (see `ubc.Layer`).
#[pyclass(module = "ubc._ubc", frozen)]
struct RawLayer {
    inner: ubc_stack::LayerRef,
}

#[pymethods]
impl RawLayer {
    #[getter]
    fn index(&self) -> usize {
        self.inner.index()
    }

    #[getter]
    fn spec(&self) -> String {
        self.inner.spec()
    }

    #[pyo3(signature = (path, write = false, create = false, truncate = false))]
    fn open(&self, py: Python<'_>, path: String, write: bool, create: bool, truncate: bool) -> PyResult<NativeFile> {
        let opts = ubc_stack::OpenOptions::new().write(write).create(create).truncate(truncate);
        let l = self.inner.clone();
        let f = py.detach(|| l.open_with(&path, opts)).map_err(err)?;
        Ok(NativeFile { inner: Mutex::new(Some(Arc::new(f))), writable: write })
    }

    fn stat(&self, py: Python<'_>, path: String) -> PyResult<StatResult> {
        let l = self.inner.clone();
        let a = py.detach(|| l.getattr(&path)).map_err(err)?;
        Ok(StatResult {
            size: a.size,
            mode: a.mode,
            kind: kind_name(a.kind),
            mtime: secs(a.mtime),
            atime: secs(a.atime),
            ino: a.ino,
        })
    }

    /// (name, kind) pairs.
    #[pyo3(signature = (path = String::new()))]
    fn listdir(&self, py: Python<'_>, path: String) -> PyResult<Vec<(String, &'static str)>> {
        let l = self.inner.clone();
        let v = py.detach(|| l.readdir(&path)).map_err(err)?;
        Ok(v.into_iter().map(|e| (e.name, kind_name(e.kind))).collect())
    }

    fn mkdir(&self, py: Python<'_>, path: String) -> PyResult<()> {
        let l = self.inner.clone();
        py.detach(|| l.mkdir(&path)).map_err(err)
    }

    fn rmdir(&self, py: Python<'_>, path: String) -> PyResult<()> {
        let l = self.inner.clone();
        py.detach(|| l.rmdir(&path)).map_err(err)
    }

    fn remove(&self, py: Python<'_>, path: String) -> PyResult<()> {
        let l = self.inner.clone();
        py.detach(|| l.remove(&path)).map_err(err)
    }

    fn rename(&self, py: Python<'_>, src: String, dst: String) -> PyResult<()> {
        let l = self.inner.clone();
        py.detach(|| l.rename(&src, &dst)).map_err(err)
    }
}

/// A file opened at one layer: positional I/O (the `io` wrapper keeps the position).
#[pyclass(module = "ubc._ubc", frozen)]
struct NativeFile {
    inner: Mutex<Option<Arc<ubc_stack::File>>>,
    writable: bool,
}

impl NativeFile {
    fn get(&self) -> PyResult<Arc<ubc_stack::File>> {
        self.inner.lock().unwrap().clone().ok_or_else(|| PyValueError::new_err("I/O operation on closed file"))
    }
}

/// Read-write flag check and raw pointer of a contiguous byte buffer.
fn raw_buf(b: &PyBuffer<u8>, need_writable: bool) -> PyResult<(usize, usize)> {
    if need_writable && b.readonly() {
        return Err(PyBufferError::new_err("buffer is read-only"));
    }
    if !b.is_c_contiguous() {
        return Err(PyBufferError::new_err("buffer is not contiguous"));
    }
    Ok((b.buf_ptr() as usize, b.len_bytes()))
}

#[pymethods]
impl NativeFile {
    /// Read into `buf` (a writable bytes-like object) from `offset`; returns the bytes
    /// read (0 at end of file).
    fn read_into(&self, py: Python<'_>, buf: PyBuffer<u8>, offset: u64) -> PyResult<usize> {
        let f = self.get()?;
        let (ptr, len) = raw_buf(&buf, true)?;
        if len == 0 {
            return Ok(0);
        }
        // SAFETY: `buf` holds the exporter's buffer (and keeps it from resizing) until it is
        // dropped after this call; it is writable and contiguous.
        let r = py.detach(move || f.read_at(unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }, offset));
        drop(buf);
        r.map_err(err)
    }

    /// Write `data` (a bytes-like object) at `offset`; returns the bytes written.
    fn write_at(&self, py: Python<'_>, data: PyBuffer<u8>, offset: u64) -> PyResult<usize> {
        let f = self.get()?;
        let (ptr, len) = raw_buf(&data, false)?;
        if len == 0 {
            return Ok(0);
        }
        // SAFETY: as in `read_into`; only read.
        let r = py.detach(move || f.write_at(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }, offset));
        drop(data);
        r.map_err(err)
    }

    /// Length as this layer sees it.
    fn len(&self, py: Python<'_>) -> PyResult<u64> {
        let f = self.get()?;
        py.detach(move || f.len()).map_err(err)
    }

    fn set_len(&self, py: Python<'_>, len: u64) -> PyResult<()> {
        let f = self.get()?;
        py.detach(move || f.set_len(len)).map_err(err)
    }

    /// Push data down through the layers below and make it durable, with the store's
    /// metadata (`fsync`); `data_only`: only what reading the data back needs (`fdatasync`).
    #[pyo3(signature = (data_only = false))]
    fn sync(&self, py: Python<'_>, data_only: bool) -> PyResult<()> {
        let f = self.get()?;
        py.detach(move || if data_only { f.sync() } else { f.sync_all() }).map_err(err)
    }

    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.lock().unwrap().is_none()
    }

    #[getter]
    fn path(&self) -> PyResult<String> {
        Ok(self.get()?.path().to_string())
    }

    #[getter]
    fn layer_index(&self) -> PyResult<usize> {
        Ok(self.get()?.layer_index())
    }

    fn close(&self) {
        self.inner.lock().unwrap().take();
    }

    /// `os.posix_fadvise` for this file at its layer: `advice` is one of `os.POSIX_FADV_*`
    /// (`ubc::File::advise`); a `length` of 0 means to the end of the file.
    fn advise(&self, py: Python<'_>, offset: u64, length: u64, advice: i32) -> PyResult<()> {
        let f = self.get()?;
        let a =
            ubc::Advice::from_posix(advice).ok_or_else(|| PyValueError::new_err(format!("unknown advice {advice}")))?;
        let end = if length == 0 { u64::MAX } else { offset.saturating_add(length) };
        py.detach(move || f.advise(offset..end, a)).map_err(err)
    }

    /// Have `hook(offset, length)` called before any of this file's bytes at this layer are
    /// written back (`ubc::File::set_writeback_hook`); None removes it. An exception from
    /// it fails that write: the pages stay dirty and `sync` raises (an `OSError`'s errno is
    /// kept).
    #[pyo3(signature = (hook))]
    fn set_writeback_hook(&self, py: Python<'_>, hook: Option<Py<PyAny>>) -> PyResult<()> {
        let f = self.get()?;
        let hook: Option<ubc::WritebackHook> = hook.map(|h| {
            Arc::new(move |r: std::ops::Range<u64>| {
                Python::attach(|py| {
                    h.call1(py, (r.start, r.end - r.start)).map(drop).map_err(|e| {
                        let errno =
                            e.value(py).getattr("errno").ok().and_then(|v| v.extract::<i32>().ok()).filter(|&n| n > 0);
                        match errno {
                            Some(n) => std::io::Error::from_raw_os_error(n),
                            None => std::io::Error::other(format!("writeback hook raised {e}")),
                        }
                    })
                })
            }) as ubc::WritebackHook
        });
        py.detach(move || f.set_writeback_hook(hook)).map_err(err)
    }

    /// Map `length` bytes from `offset` (to the end of the file if None). Writable
    /// mappings are shared: their stores reach the file.
    #[pyo3(signature = (offset = 0, length = None, writable = false))]
    fn map(&self, py: Python<'_>, offset: u64, length: Option<u64>, writable: bool) -> PyResult<Mapping> {
        let f = self.get()?;
        if writable && !self.writable {
            return Err(PyOSError::new_err((libc::EACCES, "a writable mapping needs a file opened for writing")));
        }
        let m = py.detach(move || -> ubc_stack::Result<Option<ubc_stack::Mapping>> {
            let len = match length {
                Some(l) => l,
                None => f.len()?.saturating_sub(offset),
            };
            if len == 0 {
                return Ok(None);
            }
            let end =
                offset.checked_add(len).ok_or_else(|| ubc_stack::Error::Invalid("mapping range overflows".into()))?;
            let access = if writable { ubc::Access::ReadWrite } else { ubc::Access::ReadOnly };
            f.map(offset..end, access, ubc::Sharing::Shared).map(Some)
        });
        let m = m.map_err(err)?;
        let (ptr, len) = match &m {
            Some(m) => (m.as_ptr() as usize, m.len()),
            None => (std::ptr::NonNull::<u8>::dangling().as_ptr() as usize, 0),
        };
        Ok(Mapping { inner: Mutex::new(m), ptr, len, offset, writable, exports: AtomicUsize::new(0) })
    }
}

/// A memory mapping of a stack file, exporting the buffer protocol (zero copy:
/// `memoryview(m)`, `numpy.frombuffer(m)`). Read-only unless mapped writable. The mapping
/// lives while any buffer exported from it does; `close()` refuses while one is exported.
#[pyclass(module = "ubc", frozen)]
struct Mapping {
    inner: Mutex<Option<ubc_stack::Mapping>>,
    ptr: usize,
    len: usize,
    offset: u64,
    writable: bool,
    exports: AtomicUsize,
}

#[pymethods]
impl Mapping {
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let me = slf.get();
        if view.is_null() {
            return Err(PyBufferError::new_err("view is null"));
        }
        if (flags & ffi::PyBUF_WRITABLE) == ffi::PyBUF_WRITABLE && !me.writable {
            return Err(PyBufferError::new_err("mapping is read-only"));
        }
        let guard = me.inner.lock().unwrap();
        if guard.is_none() && me.len != 0 {
            return Err(PyValueError::new_err("mapping closed"));
        }
        me.exports.fetch_add(1, Ordering::SeqCst);
        drop(guard);
        // SAFETY: `view` is the caller's Py_buffer; the pointer stays mapped while `obj`
        // (a strong reference to this object) keeps the mapping (close refuses while
        // exported).
        unsafe {
            (*view).obj = slf.clone().into_any().into_ptr();
            (*view).buf = me.ptr as *mut c_void;
            (*view).len = me.len as isize;
            (*view).readonly = if me.writable { 0 } else { 1 };
            (*view).itemsize = 1;
            (*view).format = if (flags & ffi::PyBUF_FORMAT) == ffi::PyBUF_FORMAT {
                c"B".as_ptr() as *mut _
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape =
                if (flags & ffi::PyBUF_ND) == ffi::PyBUF_ND { &mut (*view).len } else { std::ptr::null_mut() };
            (*view).strides = if (flags & ffi::PyBUF_STRIDES) == ffi::PyBUF_STRIDES {
                &mut (*view).itemsize
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.fetch_sub(1, Ordering::SeqCst);
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// File offset of the first mapped byte.
    #[getter]
    fn offset(&self) -> u64 {
        self.offset
    }

    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }

    #[getter]
    fn closed(&self) -> bool {
        self.len != 0 && self.inner.lock().unwrap().is_none()
    }

    /// `mmap.madvise` for this mapping: `advice` is one of `mmap.MADV_NORMAL`, `MADV_RANDOM`,
    /// `MADV_SEQUENTIAL`, `MADV_WILLNEED`, `MADV_DONTNEED` (`ubc::Mapping::advise`).
    fn madvise(&self, py: Python<'_>, advice: i32) -> PyResult<()> {
        let a = ubc::Advice::from_posix(advice)
            .filter(|a| *a != ubc::Advice::NoReuse)
            .ok_or_else(|| PyValueError::new_err(format!("unknown advice {advice}")))?;
        let g = self.inner.lock().unwrap();
        match g.as_ref() {
            Some(m) => py.detach(|| m.advise(a)).map_err(|e| err(e.into())),
            None if self.len == 0 => Ok(()),
            None => Err(PyValueError::new_err("mapping closed")),
        }
    }

    /// Write the mapping's stores to the layer's store (`msync`).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let g = self.inner.lock().unwrap();
        match g.as_ref() {
            Some(m) => py.detach(|| m.flush()).map_err(err),
            None if self.len == 0 => Ok(()),
            None => Err(PyValueError::new_err("mapping closed")),
        }
    }

    /// Unmap. Raises BufferError while buffers (memoryviews, numpy arrays) still use it.
    fn close(&self) -> PyResult<()> {
        let mut g = self.inner.lock().unwrap();
        if self.exports.load(Ordering::SeqCst) != 0 {
            return Err(PyBufferError::new_err("cannot close a mapping with exported buffers"));
        }
        let m = g.take();
        drop(g);
        drop(m);
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, _t: Py<PyAny>, _v: Py<PyAny>, _tb: Py<PyAny>) -> PyResult<bool> {
        self.close()?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "ubc.Mapping(offset={}, len={}, writable={})",
            self.offset,
            self.len,
            if self.writable { "True" } else { "False" }
        )
    }
}

#[pymodule]
fn _ubc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Cache>()?;
    m.add_class::<RawStack>()?;
    m.add_class::<RawLayer>()?;
    m.add_class::<NativeFile>()?;
    m.add_class::<Mapping>()?;
    m.add_class::<StatResult>()?;
    m.add("AuthenticationError", m.py().get_type::<AuthenticationError>())?;
    m.add_function(wrap_pyfunction!(stats, m)?)?;
    m.add_function(wrap_pyfunction!(generate_key, m)?)?;
    Ok(())
}

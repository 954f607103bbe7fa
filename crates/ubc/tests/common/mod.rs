#![allow(dead_code)]
//! Helpers shared by the integration tests.

use std::sync::Arc;
use ubc::pager::{InjectingPager, MemPager};
use ubc::{Access, Cache, File};

/// `Pager` methods a test pager passes straight on to the store in its field `$f`, by
/// name (`get_pages`, `put_pages`, `len`, `set_len`, `sync`):
/// `impl Pager for P { forward_to!(inner: get_pages, len); fn put_pages(…) { … } … }`.
/// Test files that use it declare `#[macro_use] mod common;`.
macro_rules! forward_to {
    ($f:tt: $($m:ident),+ $(,)?) => { $( forward_to!(@one $f $m); )+ };
    (@one $f:tt get_pages) => {
        fn get_pages(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<ubc::Fill> {
            #[allow(unused_imports)]
            use ubc::Pager as _;
            self.$f.get_pages(offset, buf)
        }
    };
    (@one $f:tt put_pages) => {
        fn put_pages(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            #[allow(unused_imports)]
            use ubc::Pager as _;
            self.$f.put_pages(offset, data)
        }
    };
    (@one $f:tt len) => {
        fn len(&self) -> std::io::Result<u64> {
            #[allow(unused_imports)]
            use ubc::Pager as _;
            self.$f.len()
        }
    };
    (@one $f:tt set_len) => {
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            #[allow(unused_imports)]
            use ubc::Pager as _;
            self.$f.set_len(len)
        }
    };
    (@one $f:tt sync) => {
        fn sync(&self) -> std::io::Result<()> {
            #[allow(unused_imports)]
            use ubc::Pager as _;
            self.$f.sync()
        }
    };
}

/// Deterministic test data: byte `i` of stream `seed`.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| byte_at(seed, offset + i)).collect()
}

pub fn byte_at(seed: u64, pos: u64) -> u8 {
    let x = (pos ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (x >> 56) as u8 | 1 // never 0, so lost data (zeros) is always visible
}

pub fn small_cache(budget: u64) -> Cache {
    Cache::builder().budget(budget).build().unwrap()
}

/// A file on a memory pager behind a fault injector; returns both.
pub fn injected_file(cache: &Cache) -> (File, Arc<InjectingPager>, Arc<MemPager>) {
    let mem = Arc::new(MemPager::new());
    let fault = Arc::new(InjectingPager::new(mem.clone()));
    let f = cache.open(fault.clone(), Access::ReadWrite).unwrap();
    (f, fault, mem)
}

/// Read the whole store behind a pager, bypassing the cache.
pub fn store_contents(p: &dyn ubc::Pager) -> Vec<u8> {
    let len = p.len().unwrap() as usize;
    let mut v = vec![0u8; len.next_multiple_of(4096)];
    if len > 0 {
        p.get_pages(0, &mut v).unwrap();
    }
    v.truncate(len);
    v
}

/// First differing byte, for readable failures.
pub fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("{what}: first difference at byte {i}: got {:#04x}, want {:#04x}", got[i], want[i]);
    }
}

/// A pager that records every get_pages request (offset, length) and can be slowed down.
pub struct RecordingPager {
    pub inner: Arc<MemPager>,
    pub gets: parking_lot::Mutex<Vec<(u64, usize)>>,
    pub delay: std::time::Duration,
}

impl RecordingPager {
    pub fn with_data(len: usize, seed: u64) -> Arc<RecordingPager> {
        let inner = Arc::new(MemPager::new());
        ubc::Pager::put_pages(&*inner, 0, &pattern(seed, 0, len)).unwrap();
        Arc::new(RecordingPager { inner, gets: Default::default(), delay: std::time::Duration::ZERO })
    }
    pub fn requests(&self) -> Vec<(u64, usize)> {
        let mut v = self.gets.lock().clone();
        v.sort();
        v
    }
    pub fn bytes_requested(&self) -> u64 {
        self.gets.lock().iter().map(|r| r.1 as u64).sum()
    }
}

impl ubc::Pager for RecordingPager {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<ubc::Fill> {
        self.gets.lock().push((offset, buf.len()));
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        self.inner.get_pages(offset, buf)
    }
    forward_to!(inner: put_pages, len, set_len, sync);
    fn describe(&self) -> String {
        "recording".into()
    }
}

/// A one-shot gate between threads: `wait_open` blocks until `open` was called.
#[derive(Default)]
pub struct Gate(std::sync::Mutex<bool>, std::sync::Condvar);

impl Gate {
    pub fn open(&self) {
        *self.0.lock().unwrap() = true;
        self.1.notify_all();
    }

    pub fn wait_open(&self) {
        let mut g = self.0.lock().unwrap();
        while !*g {
            g = self.1.wait(g).unwrap();
        }
    }

    /// `wait_open` for at most `d`; whether the gate opened.
    pub fn wait_open_for(&self, d: std::time::Duration) -> bool {
        let g = self.0.lock().unwrap();
        *self.1.wait_timeout_while(g, d, |open| !*open).unwrap().0
    }
}

/// Wait (bounded, generous: 20 s) until `cond` holds; panics with `what` otherwise.
pub fn eventually(what: &str, cond: impl Fn() -> bool) {
    let t = std::time::Instant::now();
    while !cond() {
        assert!(t.elapsed() < std::time::Duration::from_secs(20), "timed out waiting for: {what}");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Run `f` on its own thread; fail if it panics or runs longer than `secs`.
pub fn guarded<T: Send + 'static>(what: &str, secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let _ = tx.send(r);
    });
    match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("{what}: no answer after {secs} s (hang)"),
    }
}

/// Whether this process is the child `in_child` or `in_child_with_limit` started for `tag`.
pub fn is_child(tag: &str) -> bool {
    std::env::var("UBC_CHILD").is_ok_and(|v| v == tag)
}

/// The command that runs test `test` of this binary again, alone, in a child process that
/// sees `is_child(tag)`.
fn child_command(test: &str, tag: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]).env("UBC_CHILD", tag);
    cmd
}

/// Run `cmd` to the end; panics with its output (`what` saying which child) if it fails.
fn expect_child_success(mut cmd: std::process::Command, what: &str) {
    use std::os::unix::process::ExitStatusExt;
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{what}: {:?} (signal {:?})\n{}\n{}",
        out.status,
        out.status.signal(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Run test `test` of this binary again in a child process (no other test's threads
/// allocating or opening files beside it); the child sees `is_child(tag)`. Panics with the
/// child's output if it fails.
pub fn in_child(test: &str, tag: &str) {
    expect_child_success(child_command(test, tag), &format!("child {tag}"));
}

/// Run test `test` of this binary again in a child process whose `resource` limit is
/// `cur` (soft) and `max` (hard), set before `exec` (ubc reads some limits once, at first
/// use); the child sees `is_child(tag)`. Panics with the child's output if it fails.
pub fn in_child_with_limit(test: &str, tag: &str, resource: libc::__rlimit_resource_t, cur: u64, max: u64) {
    use std::os::unix::process::CommandExt;
    let mut cmd = child_command(test, tag);
    // SAFETY: setrlimit is async-signal-safe; it only changes the child's limit.
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::rlimit { rlim_cur: cur, rlim_max: max };
            if libc::setrlimit(resource, &r) == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
        });
    }
    expect_child_success(cmd, &format!("child under limit {resource} = {cur}"));
}

/// Descriptors this process holds now.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

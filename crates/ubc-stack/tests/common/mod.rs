//! Helpers shared by the integration tests of this crate (each test file that needs them
//! says `mod common;`).
#![allow(dead_code)]

pub mod data;
pub mod servers;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::time::{Duration, Instant};

/// Print every thread's stack (to stderr): a hang is only useful with the stacks that show
/// it. Each thread is signalled and prints its own backtrace from the handler (not
/// async-signal-safe — acceptable on the way to `abort`). gdb cannot be used: reading a
/// process's memory can fault on a userfaultfd-registered page whose handler thread gdb
/// has stopped.
pub fn dump_threads() {
    extern "C" fn on_signal(_: libc::c_int) {
        let bt = std::backtrace::Backtrace::force_capture();
        // SAFETY: gettid takes no arguments and cannot fail.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) };
        let name = std::thread::current().name().unwrap_or("?").to_string();
        let text = format!("---- thread {tid} ({name}) ----\n{bt}\n");
        // One write per thread, so the dumps do not interleave.
        // SAFETY: `text` is a live buffer of `text.len()` bytes; fd 2 is stderr.
        unsafe { libc::write(2, text.as_ptr().cast(), text.len()) };
    }
    // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value; the handler is an
    // `extern "C" fn(c_int)`, as SA_SIGINFO is not set.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut());
    }
    // SAFETY: gettid takes no arguments and cannot fail.
    let me = unsafe { libc::syscall(libc::SYS_gettid) };
    for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let tid: i64 = e.file_name().to_string_lossy().parse().unwrap_or(0);
        if tid != 0 && tid != me {
            // SAFETY: signals a thread of this process; the handler was installed above.
            unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, libc::SIGUSR2) };
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    std::thread::sleep(Duration::from_secs(2));
}

/// Aborts the process with every thread's stack if it is not dropped within `limit`: a
/// test that can hang fails instead, with the evidence.
pub struct Watchdog {
    done: Arc<AtomicBool>,
}

impl Watchdog {
    pub fn new(what: &str, limit: Duration) -> Watchdog {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let what = what.to_string();
        std::thread::spawn(move || {
            let start = Instant::now();
            while !d.load(SeqCst) {
                if start.elapsed() > limit {
                    eprintln!("watchdog: {what} still running after {limit:?}: every thread's stack follows");
                    dump_threads();
                    std::process::abort();
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Watchdog { done }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, SeqCst);
    }
}

/// A stack spec of `dir:<tmp>/data | layers`, with a fresh key at `<tmp>/key` for every
/// `aead` in `layers` (e.g. "zstd | aead" becomes "dir:/t/data | zstd | aead:keyfile=/t/key").
pub fn layered_spec(tmp: &std::path::Path, layers: &str) -> String {
    let data = tmp.join("data");
    std::fs::create_dir(&data).unwrap();
    let key = tmp.join("key");
    ubc_stack::encrypt::Key::generate().write_file(&key).unwrap();
    format!("dir:{} | {}", data.display(), layers.replace("aead", &format!("aead:keyfile={}", key.display())))
}

/// Threads of this process whose name starts with `prefix` (the cache names its own:
/// `ubc-io…`, `ubc-flusher`, …).
pub fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|n| n.starts_with(prefix))
        .count()
}

/// The seed in environment variable `var`, else a random one (printed, to replay).
pub fn seed(var: &str) -> u64 {
    let seed = std::env::var(var).ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    println!("seed {seed} ({var} to replay)");
    seed
}

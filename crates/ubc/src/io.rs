//! The I/O pool: a few threads that run pager calls in the background so read-ahead and
//! writeback keep several requests in flight (issue: one reader must reach device bandwidth,
//! and a writer must not wait for its data to reach the disk).
//!
//! Threads, not io_uring: pagers are arbitrary user code (a host file today; a layer or an
//! object store tomorrow) behind a synchronous trait, so a pool is the only mechanism that
//! works for all of them. Jobs are closures; a [`Batch`] lets a caller wait for a group of
//! jobs and collect the first error.
//!
//! The pool grows when it would otherwise deadlock: when every thread is *blocked* (waiting
//! for a page, see [`blocking`]) and jobs are queued, an extra thread is started (up to
//! [`MAX_EXTRA`]); extra threads leave after [`EXTRA_IDLE`] without work. Busy threads do not
//! count — a burst of writeback just queues. Not every wait can be marked: a layer's pager
//! may wait for its own lock, held by a thread that waits for a page whose writeback is a
//! job queued behind it (found by tests/stress.rs: every I/O thread in an aead `put_pages`
//! waiting for the state lock). So a monitor also watches for *starvation*, as .NET's
//! thread pool does: jobs queued, no thread idle, and no job started for [`STARVED_AFTER`]
//! — then it adds a thread, whatever the threads are waiting for. Layers need this: a layer's pager (compression, encryption) reads its lower file through
//! this same cache from an I/O thread, and that read may wait for a lower page whose fill
//! is a job still queued — with a fixed pool, jobs that wait for queued jobs can fill every
//! thread and deadlock (found by the stack benchmarks: four zstd read-ahead fills waiting
//! for the dir layer's read-ahead queued behind them).

use crate::error::Error;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send>;

/// Most extra threads started on demand beyond the base pool.
pub(crate) const MAX_EXTRA: usize = 64;
/// How long an extra thread waits for work before it exits.
const EXTRA_IDLE: std::time::Duration = std::time::Duration::from_secs(2);
/// Jobs queued and none started for this long, with no thread idle: the pool is starved.
/// (Long enough that a slow store keeping every thread busy rarely looks starved; a pool
/// that grows anyway only costs threads, which leave after [`EXTRA_IDLE`].)
const STARVED_AFTER: std::time::Duration = std::time::Duration::from_millis(50);

pub(crate) struct IoPool {
    shared: Arc<Shared>,
}

struct Shared {
    queue: Mutex<Queue>,
    cv: Condvar,
    /// Wakes the starvation monitor when work is queued (it sleeps while the queue is empty).
    monitor_cv: Condvar,
    /// Every thread of the pool (base and extra), joined at shutdown.
    threads: Mutex<Vec<JoinHandle<()>>>,
}

struct Queue {
    jobs: VecDeque<Job>,
    shutdown: bool,
    /// Threads waiting for a job.
    idle: usize,
    /// Threads running a job that is waiting for something (a page another job fills).
    blocked: usize,
    /// Threads alive, and how many of them are extra.
    threads: usize,
    extra: usize,
    /// Jobs taken off the queue so far (the monitor's sign of progress).
    started: u64,
}

impl Queue {
    /// Every thread waits while work is queued: only a new thread can make progress.
    fn stuck(&self) -> bool {
        self.starved() && self.blocked >= self.threads
    }
    /// Work waits and no thread is free to take it (a new thread would help if this lasts).
    fn starved(&self) -> bool {
        !self.jobs.is_empty() && self.idle == 0 && self.extra < MAX_EXTRA && !self.shutdown
    }
}

impl IoPool {
    /// Start `n` I/O threads (at least one).
    pub(crate) fn new(n: usize) -> IoPool {
        let n = n.max(1);
        let queue = Queue { jobs: VecDeque::new(), shutdown: false, idle: 0, blocked: 0, threads: n, extra: 0, started: 0 };
        let shared = Arc::new(Shared {
            queue: Mutex::new(queue),
            cv: Condvar::new(),
            monitor_cv: Condvar::new(),
            threads: Mutex::new(Vec::new()),
        });
        for i in 0..n {
            let s = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("ubc-io-{i}"))
                .spawn(move || worker(s, false))
                .expect("spawn ubc I/O thread");
            shared.threads.lock().push(h);
        }
        let s = shared.clone();
        let h = std::thread::Builder::new()
            .name("ubc-io-monitor".into())
            .spawn(move || monitor(s))
            .expect("spawn ubc I/O monitor");
        shared.threads.lock().push(h);
        IoPool { shared }
    }

    /// Queue a job.
    pub(crate) fn submit(&self, job: impl FnOnce() + Send + 'static) {
        let mut q = self.shared.queue.lock();
        if q.shutdown {
            // Shutting down: run it here rather than drop work (writeback must not be lost).
            drop(q);
            job();
            return;
        }
        q.jobs.push_back(Box::new(job));
        if q.stuck() {
            grow(&self.shared, &mut q);
        }
        let first = q.jobs.len() == 1;
        drop(q);
        self.shared.cv.notify_one();
        if first {
            self.shared.monitor_cv.notify_one();
        }
    }

    /// Finish queued jobs and stop the threads. => not called from an I/O thread.
    pub(crate) fn shutdown(&self) {
        self.shared.queue.lock().shutdown = true;
        self.shared.cv.notify_all();
        self.shared.monitor_cv.notify_all();
        let threads: Vec<JoinHandle<()>> = self.shared.threads.lock().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

/// Start an extra thread. => `q` is `s.queue`, locked, and `q.starved()`.
fn grow(s: &Arc<Shared>, q: &mut Queue) {
    let s2 = s.clone();
    if let Ok(h) = std::thread::Builder::new().name("ubc-io-x".into()).spawn(move || worker(s2, true)) {
        q.extra += 1;
        q.threads += 1;
        let mut t = s.threads.lock();
        t.retain(|h| !h.is_finished());
        t.push(h);
    }
    // No thread to be had: the others get to the job when they stop waiting.
}

/// The starvation monitor: while jobs are queued, checks every [`STARVED_AFTER`] that one
/// was started; if none was and no thread is idle, adds a thread. Sleeps while the queue is
/// empty, so an idle cache costs nothing.
fn monitor(s: Arc<Shared>) {
    let mut q = s.queue.lock();
    let mut seen = q.started;
    loop {
        if q.shutdown {
            return;
        }
        if q.jobs.is_empty() {
            s.monitor_cv.wait(&mut q);
            seen = q.started;
            continue;
        }
        s.monitor_cv.wait_for(&mut q, STARVED_AFTER);
        if q.started == seen && q.starved() {
            grow(&s, &mut q);
            drop(q);
            s.cv.notify_one();
            q = s.queue.lock();
        }
        seen = q.started;
    }
}

thread_local! {
    /// The pool of the I/O thread this is, if it is one.
    static IO_POOL: std::cell::RefCell<Option<Arc<Shared>>> = const { std::cell::RefCell::new(None) };
}

/// True on a pool thread (which must never wait for other pool jobs: deadlock).
pub(crate) fn on_io_thread() -> bool {
    IO_POOL.with(|p| p.borrow().is_some())
}

/// Run `wait`, a wait for something another job may have to do (a page being filled).
/// On an I/O thread, counts the thread blocked meanwhile, so that the pool grows if every
/// thread is blocked with jobs queued. Elsewhere just runs `wait`.
pub(crate) fn blocking<R>(wait: impl FnOnce() -> R) -> R {
    let Some(s) = IO_POOL.with(|p| p.borrow().clone()) else { return wait() };
    {
        let mut q = s.queue.lock();
        q.blocked += 1;
        if q.stuck() {
            grow(&s, &mut q);
            drop(q);
            s.cv.notify_one();
        }
    }
    let r = wait();
    s.queue.lock().blocked -= 1;
    r
}

fn worker(s: Arc<Shared>, extra: bool) {
    IO_POOL.with(|p| *p.borrow_mut() = Some(s.clone()));
    loop {
        let job = {
            let mut q = s.queue.lock();
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    q.started += 1;
                    break j;
                }
                if q.shutdown {
                    q.threads -= 1;
                    if extra {
                        q.extra -= 1;
                    }
                    return;
                }
                q.idle += 1;
                let timed_out = if extra {
                    s.cv.wait_for(&mut q, EXTRA_IDLE).timed_out()
                } else {
                    s.cv.wait(&mut q);
                    false
                };
                q.idle -= 1;
                if timed_out && q.jobs.is_empty() {
                    q.extra -= 1;
                    q.threads -= 1;
                    return;
                }
            }
        };
        // A panicking job (a pager is user code) must not take the thread with it: the pool
        // would shrink to nothing and every later batch would wait forever. The job's batch
        // ticket reports the panic as an error when it unwinds.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
    }
}

/// A group of jobs a caller waits for; remembers the first error.
#[derive(Clone, Default)]
pub(crate) struct Batch {
    inner: Arc<(Mutex<BatchState>, Condvar)>,
}

#[derive(Default)]
struct BatchState {
    pending: usize,
    first_err: Option<Error>,
}

/// One job's membership in a [`Batch`]: finishing it, or dropping it unfinished (the job
/// panicked), counts the job done.
pub(crate) struct Ticket {
    batch: Option<Batch>,
}

impl Ticket {
    /// The job finished with `r`.
    pub(crate) fn done(mut self, r: Result<(), Error>) {
        if let Some(b) = self.batch.take() {
            b.finish(r);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(b) = self.batch.take() {
            b.finish(Err(Error::Os { call: "I/O job", source: std::io::Error::other("pager panicked") }));
        }
    }
}

impl Batch {
    /// Count one more job in this batch; the job must consume the ticket. Call before
    /// submitting the job.
    pub(crate) fn ticket(&self) -> Ticket {
        self.inner.0.lock().pending += 1;
        Ticket { batch: Some(self.clone()) }
    }

    fn finish(&self, r: Result<(), Error>) {
        let mut st = self.inner.0.lock();
        st.pending -= 1;
        if let Err(e) = r {
            st.first_err.get_or_insert(e);
        }
        if st.pending == 0 {
            self.inner.1.notify_all();
        }
    }

    /// Wait for every job; the first error, if any.
    pub(crate) fn wait(&self) -> Result<(), Error> {
        let mut st = self.inner.0.lock();
        while st.pending > 0 {
            self.inner.1.wait(&mut st);
        }
        st.first_err.take().map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A job that waits for a later job without saying so (a lock, a channel: not
    /// `blocking`) must not hang a pool whose every thread does that: the monitor adds one.
    #[test]
    fn a_job_waiting_unmarked_for_a_queued_job_gets_a_thread() {
        let pool = IoPool::new(1);
        let (tx, rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        pool.submit(move || {
            rx.recv().unwrap();
            done_tx.send(()).unwrap();
        });
        pool.submit(move || tx.send(()).unwrap());
        done_rx.recv_timeout(Duration::from_secs(20)).expect("the waiting job finished: a thread was added");
        assert!(pool.shared.queue.lock().extra >= 1);
        pool.shutdown();
    }

    /// Jobs that only keep the threads busy (no one waits for a queued job) do not make the
    /// pool grow while jobs keep starting.
    #[test]
    fn a_busy_pool_that_makes_progress_does_not_grow() {
        let pool = IoPool::new(2);
        let batch = Batch::default();
        for _ in 0..100 {
            let t = batch.ticket();
            pool.submit(move || {
                std::thread::sleep(Duration::from_millis(2));
                t.done(Ok(()));
            });
        }
        batch.wait().unwrap();
        assert_eq!(pool.shared.queue.lock().extra, 0);
        pool.shutdown();
    }
}

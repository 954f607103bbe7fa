//! The I/O pools: a few threads per pager depth that run pager calls in the background, so
//! read-ahead and writeback keep several requests in flight (issue: one reader must reach
//! device bandwidth, and a writer must not wait for its data to reach the disk).
//!
//! Threads, not io_uring: pagers are arbitrary user code (a host file today; a layer or an
//! object store tomorrow) behind a synchronous trait, so threads are the only mechanism that
//! works for all of them. Jobs are closures; a [`Batch`] lets a caller wait for a group of
//! jobs and collect the first error.
//!
//! **One pool per pager depth, a fixed number of threads each.** A layer's pager
//! (compression, encryption) reads and writes its lower file through this same cache, from
//! an I/O thread, and may wait there for a lower page whose fill or writeback is itself a
//! queued job. With one shared pool, jobs that wait for queued jobs can occupy every thread
//! (all in zstd `put_pages`, waiting for aead pages whose fills are queued behind them), and
//! growing the pool on starvation only postpones that. Instead, a job for an object of depth `d` runs in pool
//! `d`, and by the lock order (`order.rs`) a job of depth `d` only waits for work of depth
//! `< d`: pool 0 (host files) waits for nothing in the cache, so its jobs finish; then those
//! of pool 1 do, and so on. No job waits for a job of its own pool, so each pool's size is a
//! throughput setting, not a liveness one. Pools are started on first use; a cache of host
//! files has one.

use crate::error::Error;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send>;

/// Pools for depths `0..MAX_POOLS`; deeper pagers share the last one (still ordered: a
/// stack that deep would need its own pools to be sure; `order.rs` flags its waits).
pub(crate) const MAX_POOLS: usize = 16;

pub(crate) struct IoPool {
    threads_per_depth: usize,
    pools: [OnceLock<Arc<Shared>>; MAX_POOLS],
}

struct Shared {
    depth: u32,
    queue: Mutex<Queue>,
    cv: Condvar,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

struct Queue {
    jobs: VecDeque<Job>,
    shutdown: bool,
}

impl IoPool {
    /// `n` I/O threads (at least one) per pager depth, started when a depth is first used.
    pub(crate) fn new(n: usize) -> IoPool {
        IoPool { threads_per_depth: n.max(1), pools: std::array::from_fn(|_| OnceLock::new()) }
    }

    fn pool(&self, depth: u32) -> &Arc<Shared> {
        let i = (depth as usize).min(MAX_POOLS - 1);
        self.pools[i].get_or_init(|| {
            let shared = Arc::new(Shared {
                depth: i as u32,
                queue: Mutex::new(Queue { jobs: VecDeque::new(), shutdown: false }),
                cv: Condvar::new(),
                threads: Mutex::new(Vec::new()),
            });
            for t in 0..self.threads_per_depth {
                let s = shared.clone();
                let h = std::thread::Builder::new()
                    .name(format!("ubc-io{i}-{t}"))
                    .spawn(move || worker(s))
                    .expect("spawn ubc I/O thread");
                shared.threads.lock().push(h);
            }
            shared
        })
    }

    /// Queue a job that calls the pager of an object of `depth` (a fill or a writeback of
    /// that object). => the job waits only for work of lower depth (`order.rs`).
    pub(crate) fn submit(&self, depth: u32, job: impl FnOnce() + Send + 'static) {
        let pool = self.pool(depth);
        let mut q = pool.queue.lock();
        if q.shutdown {
            // Shutting down: run it here rather than drop work (writeback must not be lost).
            drop(q);
            job();
            return;
        }
        q.jobs.push_back(Box::new(job));
        drop(q);
        pool.cv.notify_one();
    }

    /// Threads started so far, all pools (for tests and statistics).
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.pools.iter().filter_map(|p| p.get()).map(|p| p.threads.lock().len()).sum()
    }

    /// Finish queued jobs and stop the threads, top depth first (its jobs may still queue
    /// work below). => not called from an I/O thread.
    pub(crate) fn shutdown(&self) {
        for p in self.pools.iter().rev().filter_map(|p| p.get()) {
            p.queue.lock().shutdown = true;
            p.cv.notify_all();
            let threads: Vec<JoinHandle<()>> = p.threads.lock().drain(..).collect();
            for t in threads {
                let _ = t.join();
            }
        }
    }
}

thread_local! {
    /// The depth of the pool of the I/O thread this is, if it is one.
    static IO_DEPTH: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

/// True on a pool thread (which runs writeback of the file it is given inline rather than
/// wait for other jobs).
pub(crate) fn on_io_thread() -> bool {
    IO_DEPTH.with(|d| d.get().is_some())
}

fn worker(s: Arc<Shared>) {
    IO_DEPTH.with(|d| d.set(Some(s.depth)));
    loop {
        let job = {
            let mut q = s.queue.lock();
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if q.shutdown {
                    return;
                }
                s.cv.wait(&mut q);
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

    /// Wait for every job (of pools of `depth` and below); the first error, if any.
    pub(crate) fn wait(&self, depth: u32) -> Result<(), Error> {
        crate::order::check_wait(crate::order::Rank::io(depth));
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

    /// A job of depth 1 waiting for a job of depth 0 queued after it finishes with one
    /// thread per pool: the waits go down, and pool 0 is never occupied by waiters. (With
    /// one shared pool of one thread this hangs: the waiting job holds the only thread.)
    #[test]
    fn a_job_waiting_for_a_lower_job_finishes_with_one_thread_per_depth() {
        let pool = Arc::new(IoPool::new(1));
        let (done_tx, done_rx) = mpsc::channel::<()>();
        for _ in 0..8 {
            let (tx, rx) = mpsc::channel::<()>();
            let done = done_tx.clone();
            pool.submit(1, move || {
                rx.recv().unwrap();
                done.send(()).unwrap();
            });
            pool.submit(0, move || tx.send(()).unwrap());
        }
        for _ in 0..8 {
            done_rx.recv_timeout(Duration::from_secs(20)).expect("the upper job finished");
        }
        assert_eq!(pool.threads(), 2, "one thread per depth used, none added");
        pool.shutdown();
    }

    /// Jobs that only keep the threads busy run on the pool's fixed threads.
    #[test]
    fn a_busy_pool_keeps_its_size() {
        let pool = IoPool::new(2);
        let batch = Batch::default();
        for _ in 0..100 {
            let t = batch.ticket();
            pool.submit(0, move || {
                std::thread::sleep(Duration::from_millis(1));
                t.done(Ok(()));
            });
        }
        batch.wait(0).unwrap();
        assert_eq!(pool.threads(), 2);
        pool.shutdown();
    }

    /// Deep pagers share the last pool rather than index out of bounds.
    #[test]
    fn deep_pagers_share_the_last_pool() {
        let pool = IoPool::new(1);
        let (tx, rx) = mpsc::channel::<u32>();
        pool.submit(u32::MAX, move || tx.send(IO_DEPTH.with(|d| d.get().unwrap())).unwrap());
        assert_eq!(rx.recv_timeout(Duration::from_secs(20)).unwrap(), (MAX_POOLS - 1) as u32);
        pool.shutdown();
    }
}

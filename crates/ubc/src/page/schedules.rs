//! Randomized-schedule tests of the page state machine, run by shuttle on the real
//! [`PageState`] (its word is a shuttle atomic and its futex a faithful model under the
//! `shuttle` feature: see `sync.rs`).
//!
//! ```text
//! cargo test -p ubc --features shuttle --lib schedules                  # ./scripts/test
//! UBC_SCHEDULES=200000 cargo test --release -p ubc --features shuttle --lib schedules
//! ```
//!
//! `UBC_SCHEDULES` is the number of schedules per scenario and scheduler (random, and PCT at
//! depth 3). Threads play
//! readers (pin/unpin, filling an empty page, sometimes failing the fill), writers
//! (begin_write/end_write, or a full overwrite of an empty page), a flusher
//! (begin_writeback/end_writeback, succeeding or failing, waiting or not), stores through a
//! mapping (mark_dirty), an evictor (try_lock_for_evict, release_empty or cancel_evict) and a
//! truncator (lock_for_drop). Next to the state word the test keeps *ghost* state in plain
//! `std` atomics — not scheduling points, so a ghost update right after a state-word
//! operation is atomic with it — and checks against it:
//!
//! * a reader pins only a VALID page nobody holds BUSY, and never sees a fill in progress;
//! * writer, writeback, eviction/truncation and fills exclude each other as documented
//!   (nobody writes under writeback; no writeback under a writer; eviction and truncation
//!   never take a pinned, dirty, written or written-back page);
//! * a clean page holds what the pager has: a page written (or stored to through a mapping)
//!   during writeback ends dirty, a failed writeback leaves it dirty, eviction never drops
//!   data the pager lacks;
//! * at the end nobody holds the page (no BUSY/WRITING/WRITEBACK) and the pin count is 0;
//! * no lost wakeup: a sleeper nobody wakes stays asleep, which shuttle reports as a
//!   deadlock once every other thread is done.
//!
//! A last scenario plays the page-loanout protocol (a window lent while writers rewrite the
//! page: `LoanModel`) and checks that a window never shows a write half done and never
//! changes once lent.

use super::state::*;
use shuttle::rand::{Rng, thread_rng};
use shuttle::thread;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::SeqCst};

/// Ghost contents of a page nobody filled.
const EMPTY: u64 = 0;
/// Ghost contents while a filler copies into the page.
const FILLING: u64 = u64::MAX;

/// Schedules per scenario and scheduler.
fn schedules() -> usize {
    std::env::var("UBC_SCHEDULES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000)
}

fn config() -> shuttle::Config {
    let mut c = shuttle::Config::new();
    // The futex model's lazy static is dropped after each execution; that is intended.
    c.silence_warnings = true;
    c
}

/// Run `f` under `scheduler`; returns the number of executions.
fn run_with(scheduler: impl shuttle::scheduler::Scheduler + 'static, f: impl Fn() + Send + Sync + 'static) -> usize {
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    shuttle::Runner::new(scheduler, config()).run(move || {
        c.fetch_add(1, SeqCst);
        f()
    });
    count.load(SeqCst)
}

/// Run `f` under the random scheduler and under PCT (depth 3).
fn explore(name: &str, f: impl Fn() + Send + Sync + Clone + 'static) {
    let n = schedules();
    let random = run_with(shuttle::scheduler::RandomScheduler::new(n), f.clone());
    let pct = run_with(shuttle::scheduler::PctScheduler::new(3, n), f);
    eprintln!("page schedules: {name}: {random} random + {pct} PCT schedules passed");
}

/// One page and its ghost state.
struct Page {
    st: PageState,
    /// What the page holds (a version; `EMPTY`, or `FILLING` while being filled).
    data: AtomicU64,
    /// What the pager holds.
    disk: AtomicU64,
    /// Readers (and mapping stores) between pin and unpin.
    pins: AtomicU32,
    writing: AtomicBool,
    writeback: AtomicBool,
    /// Someone holds the page BUSY (fill, eviction, truncation).
    busy: AtomicBool,
    /// Stores through a mapping not yet marked dirty.
    storing: AtomicU32,
    /// Last version handed out.
    version: AtomicU64,
}

impl Page {
    /// An empty page whose pager holds version 1.
    fn empty() -> Arc<Page> {
        Arc::new(Page {
            st: PageState::default(),
            data: AtomicU64::new(EMPTY),
            disk: AtomicU64::new(1),
            pins: AtomicU32::new(0),
            writing: AtomicBool::new(false),
            writeback: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            storing: AtomicU32::new(0),
            version: AtomicU64::new(1),
        })
    }

    /// A valid page, dirty (holding version 2 the pager lacks) if `dirty`.
    fn valid(dirty: bool) -> Arc<Page> {
        let p = Page::empty();
        assert!(p.st.try_lock_empty());
        if dirty {
            p.version.store(2, SeqCst);
            p.data.store(2, SeqCst);
        } else {
            p.data.store(1, SeqCst);
        }
        p.st.finish_fill(Filled { dirty, pins: 0, speculative: false, ra_mark: false });
        p
    }

    fn next_version(&self) -> u64 {
        self.version.fetch_add(1, SeqCst) + 1
    }

    /// Right after taking the page BUSY: nobody else may hold it in any way.
    fn took_busy(&self, what: &str) {
        assert!(!self.busy.swap(true, SeqCst), "{what}: page already BUSY");
        assert_eq!(self.pins.load(SeqCst), 0, "{what}: page is pinned");
        assert!(!self.writing.load(SeqCst), "{what}: page is being written");
        assert!(!self.writeback.load(SeqCst), "{what}: page is under writeback");
    }

    /// Fill an empty page from the pager (or give up: a failed read). Returns whether this
    /// thread did it (false: someone else holds the page or it is valid already).
    fn fill(&self, fail: bool, pinned: bool) -> bool {
        if !self.st.try_lock_empty() {
            return false;
        }
        self.took_busy("fill");
        assert_eq!(self.data.load(SeqCst), EMPTY, "an empty page held data");
        self.data.store(FILLING, SeqCst);
        thread::yield_now(); // the pager copies
        if fail {
            self.data.store(EMPTY, SeqCst);
            self.busy.store(false, SeqCst);
            let old = self.st.release_empty().bits();
            assert_eq!(old & (VALID | DIRTY), 0);
        } else {
            self.data.store(self.disk.load(SeqCst), SeqCst);
            self.busy.store(false, SeqCst);
            if pinned {
                self.pins.fetch_add(1, SeqCst);
            }
            let spec = thread_rng().gen_bool(0.5);
            self.st.finish_fill(Filled { dirty: false, pins: u32::from(pinned), speculative: spec, ra_mark: !spec });
            if pinned {
                self.read_pinned();
            }
        }
        true
    }

    /// The page is pinned (ghost pin counted): check and read it, then unpin.
    fn read_pinned(&self) -> u64 {
        let s = self.st.load();
        assert!(s & VALID != 0 && s & BUSY == 0, "pinned page in state {s:#x}");
        assert!(pins(s) > 0, "pinned page with no pins: {s:#x}");
        assert!(!self.busy.load(SeqCst), "pinned a page someone holds BUSY");
        let v = self.data.load(SeqCst);
        assert!(v != EMPTY && v != FILLING, "read a page that is not filled ({v:#x})");
        thread::yield_now(); // the copy out
        assert_ne!(self.data.load(SeqCst), FILLING, "a fill began under a pin");
        self.pins.fetch_sub(1, SeqCst);
        self.st.unpin();
        v
    }

    /// A read: pin (filling the page if it is empty; the first attempt fails if `fail`).
    fn read(&self, mut fail: bool) -> u64 {
        loop {
            match self.st.pin() {
                Pin::Pinned { .. } => {
                    self.pins.fetch_add(1, SeqCst);
                    let v = self.read_pinned();
                    self.observe();
                    return v;
                }
                Pin::Invalid => {
                    let s = self.st.load();
                    assert!(s & DIRTY == 0 || s & VALID != 0, "invalid page is dirty: {s:#x}");
                    if self.fill(fail, false) {
                        fail = false;
                    }
                }
            }
        }
    }

    /// A write of a whole page (`write_at`): a new version.
    fn write(&self) {
        match self.st.begin_write() {
            WriteLock::Resident => {
                assert!(!self.writing.swap(true, SeqCst), "two writers at once");
                assert!(!self.writeback.load(SeqCst), "writer during writeback");
                assert!(!self.busy.load(SeqCst), "writer on a BUSY page");
                assert!(self.st.load() & VALID != 0);
                self.data.store(self.next_version(), SeqCst);
                thread::yield_now(); // the copy in
                self.writing.store(false, SeqCst);
                self.st.end_write();
            }
            WriteLock::Empty => {
                self.took_busy("write of an empty page");
                self.data.store(FILLING, SeqCst);
                thread::yield_now();
                self.data.store(self.next_version(), SeqCst);
                self.busy.store(false, SeqCst);
                self.st.finish_fill(Filled { dirty: true, pins: 0, speculative: false, ra_mark: false });
            }
        }
        self.observe();
    }

    /// A store through a mapping: the page stays mapped (modelled by a pin) while the store
    /// is found and the page marked dirty.
    fn store_through_mapping(&self) {
        if let Pin::Pinned { .. } = self.st.pin() {
            self.pins.fetch_add(1, SeqCst);
            self.storing.fetch_add(1, SeqCst);
            self.data.store(self.next_version(), SeqCst);
            self.st.mark_dirty();
            self.storing.fetch_sub(1, SeqCst);
            self.pins.fetch_sub(1, SeqCst);
            self.st.unpin();
        }
        self.observe();
    }

    /// Whenever nobody holds the page and no store through a mapping is pending, a clean
    /// valid page holds what the pager has. (The state load is the only scheduling point:
    /// the ghost reads after it are atomic with it.)
    fn observe(&self) {
        let s = self.st.load();
        if s & (VALID | DIRTY | BUSY | WRITING | WRITEBACK) == VALID && self.storing.load(SeqCst) == 0 {
            assert_eq!(
                self.data.load(SeqCst),
                self.disk.load(SeqCst),
                "a clean idle page differs from the pager ({s:#x})"
            );
        }
    }

    /// Write the page back (if dirty); the pager's write succeeds if `ok`.
    fn writeback(&self, ok: bool, wait: bool) -> bool {
        if !self.st.begin_writeback(if wait { IfHeld::Wait } else { IfHeld::Skip }) {
            return false;
        }
        assert!(!self.writeback.swap(true, SeqCst), "two writebacks at once");
        assert!(!self.writing.load(SeqCst), "writeback during a write");
        assert!(!self.busy.load(SeqCst), "writeback of a BUSY page");
        let s = self.st.load();
        assert!(s & VALID != 0 && s & WRITEBACK != 0);
        let snapshot = self.data.load(SeqCst);
        thread::yield_now(); // the pager writes
        if ok {
            self.disk.store(snapshot, SeqCst);
        }
        self.writeback.store(false, SeqCst);
        self.st.end_writeback(if ok { Written::Stored } else { Written::Failed });
        self.observe();
        true
    }

    /// Evict the page if it is clean and idle (or take it and give it back: a store
    /// through a mapping was found at the last moment).
    fn evict(&self, cancel: bool) -> bool {
        if !self.st.try_lock_for_evict() {
            return false;
        }
        self.took_busy("eviction");
        let s = self.st.load();
        assert!(s & VALID != 0 && s & DIRTY == 0, "evicting a page in state {s:#x}");
        assert_eq!(self.data.load(SeqCst), self.disk.load(SeqCst), "eviction drops data the pager lacks");
        thread::yield_now(); // unmapping the window
        self.busy.store(false, SeqCst);
        if cancel {
            self.st.cancel_evict();
        } else {
            self.data.store(EMPTY, SeqCst);
            let old = self.st.release_empty().bits();
            assert_eq!(old & DIRTY, 0);
        }
        self.observe();
        true
    }

    /// Truncate the page away: the file's bytes there become a new version (zeros).
    fn truncate(&self) {
        let old = self.st.lock_for_drop().bits();
        assert_eq!(old & (BUSY | WRITING | WRITEBACK), 0);
        assert_eq!(pins(old), 0);
        self.took_busy("truncation");
        thread::yield_now();
        self.disk.store(self.next_version(), SeqCst);
        self.data.store(EMPTY, SeqCst);
        self.st.clear_dirty_locked();
        self.busy.store(false, SeqCst);
        self.st.release_empty();
        self.observe();
    }

    /// Checks once every thread is done.
    fn check_quiescent(&self) {
        let s = self.st.load();
        assert_eq!(s & (BUSY | WRITING | WRITEBACK), 0, "page still held: {s:#x}");
        assert_eq!(pins(s), 0, "pins left: {s:#x}");
        assert_eq!(self.pins.load(SeqCst), 0);
        let data = self.data.load(SeqCst);
        if s & VALID == 0 {
            assert_eq!(s & DIRTY, 0, "an invalid page is dirty: {s:#x}");
            assert_eq!(data, EMPTY);
        } else if s & DIRTY == 0 {
            assert_eq!(data, self.disk.load(SeqCst), "a clean page differs from the pager (state {s:#x})");
        } else {
            // Dirty: a writeback must be able to start, and clean it.
            assert!(self.writeback(true, false));
            assert_eq!(self.st.load() & (DIRTY | WRITEBACK), 0);
            assert_eq!(self.data.load(SeqCst), self.disk.load(SeqCst));
        }
    }
}

/// Spawn one thread per role, join them, check the end state.
fn run(page: Arc<Page>, roles: &[fn(&Page)]) {
    let hs: Vec<_> = roles
        .iter()
        .map(|&role| {
            let p = page.clone();
            thread::spawn(move || role(&p))
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    page.check_quiescent();
}

#[test]
fn schedules_fill_race() {
    // Three readers miss on an empty page: one fills (the first fill fails), all read the
    // pager's data, nobody reads a fill in progress, the filler's pin is counted.
    explore("fill race", || {
        run(
            Page::empty(),
            &[
                |p| assert_eq!(p.read(true), 1),
                |p| assert_eq!(p.read(false), 1),
                |p| {
                    if !p.fill(false, true) {
                        assert_eq!(p.read(false), 1);
                    }
                },
            ],
        )
    });
}

#[test]
fn schedules_write_during_writeback() {
    // A dirty page: writers and a mapping store race a flusher whose first writeback fails.
    // Whatever the order, a clean page ends up equal to the pager's copy.
    explore("write during writeback", || {
        run(
            Page::valid(true),
            &[
                |p| {
                    p.writeback(false, true);
                    p.writeback(true, true);
                },
                |p| p.write(),
                |p| p.store_through_mapping(),
                |p| {
                    p.write();
                    p.read(false);
                },
            ],
        )
    });
}

#[test]
fn schedules_store_during_writeback() {
    // A store through a mapping while the page is written back: the page ends dirty (or
    // the writeback wrote the store), never clean and different from the pager.
    explore("store during writeback", || {
        run(
            Page::valid(true),
            &[
                |p| {
                    p.writeback(true, true);
                },
                |p| p.store_through_mapping(),
                |p| {
                    p.read(false);
                },
            ],
        )
    });
}

#[test]
fn schedules_everything() {
    // Every transition at once on one page: reads with fills, a write, writebacks (one
    // failing, one not waiting), eviction (once given back), truncation.
    explore("everything", || {
        run(
            Page::empty(),
            &[
                |p| {
                    p.read(true);
                    p.read(false);
                },
                |p| p.write(),
                |p| {
                    p.writeback(true, false);
                    p.writeback(false, true);
                    p.writeback(true, true);
                },
                |p| {
                    p.evict(true);
                    p.evict(false);
                },
                |p| {
                    p.truncate();
                    p.store_through_mapping();
                },
            ],
        )
    });
}

#[test]
fn schedules_wakeups() {
    // Sleepers of every kind on one page at once: readers wait for a fill, a writer and a
    // truncation wait for a writeback and for pins. Nobody may sleep forever.
    explore("wakeups", || {
        let p = Page::valid(true);
        assert!(p.st.begin_writeback(IfHeld::Skip));
        p.writeback.store(true, SeqCst);
        let q = p.clone();
        let flusher = thread::spawn(move || {
            thread::yield_now();
            q.disk.store(2, SeqCst);
            q.writeback.store(false, SeqCst);
            q.st.end_writeback(Written::Stored);
        });
        run(
            p,
            &[
                |p| p.write(),
                |p| p.truncate(),
                |p| {
                    p.read(false);
                },
                |p| {
                    p.read(false);
                },
            ],
        );
        flusher.join().unwrap();
    });
}

/// The loan protocol (`object/loan.rs`, `resources/loans.rs`) on one page: the registry's
/// count and its lock as scheduling points, the page's state word real. `copy` is the
/// borrower's copy once a writer broke the loan; until then the borrower's view shows the
/// page itself.
#[derive(Default)]
struct LoanModel {
    active: shuttle::sync::atomic::AtomicU32,
    /// (view published, the borrower's copy, the loan still pins the page, the loan waited
    /// for the writers it found: `Loans::settle`).
    view: shuttle::sync::Mutex<(bool, Option<u64>, bool, bool)>,
}

/// Ghost contents while a writer is half-way through its copy.
const TORN: u64 = u64::MAX - 1;

impl LoanModel {
    /// What the borrower reads now.
    fn visible(&self, p: &Page) -> u64 {
        let v = self.view.lock().unwrap();
        v.1.unwrap_or_else(|| p.data.load(SeqCst))
    }

    /// `Object::lend` then reading the window twice, then `end_loan`.
    fn lend_and_read(&self, p: &Page) {
        self.active.fetch_add(1, SeqCst);
        loop {
            match p.st.pin() {
                Pin::Pinned { .. } => break,
                Pin::Invalid => {
                    p.fill(false, false);
                }
            }
        }
        p.pins.fetch_add(1, SeqCst);
        {
            let mut v = self.view.lock().unwrap();
            v.0 = true;
            v.2 = true;
        }
        if p.st.has_writer() {
            p.st.wait_no_writer();
        }
        self.view.lock().unwrap().3 = true;
        let first = self.visible(p);
        assert!(first != TORN && first != FILLING && first != EMPTY, "a window was lent a page mid-write ({first:#x})");
        thread::yield_now();
        let second = self.visible(p);
        assert_eq!(first, second, "a lent page changed under its window");
        let pinned = std::mem::take(&mut *self.view.lock().unwrap()).2;
        self.active.fetch_sub(1, SeqCst);
        if pinned {
            p.pins.fetch_sub(1, SeqCst);
            p.st.unpin();
        }
    }

    /// A truncation of the lent page (`drop_pages`): `hand_back` (copy for a settled loan,
    /// take its pin back) before `lock_for_drop`, which otherwise would wait for the window.
    /// No size lock here, unlike the real droppers: a writer may run beside it.
    fn truncate(&self, p: &Page) {
        if self.active.load(SeqCst) > 0 {
            let mut v = self.view.lock().unwrap();
            // Only a settled loan: one still waiting for a writer keeps its pin (the
            // dropper waits for it as for any pin) — copied now, it could catch that write
            // half done.
            if v.3 {
                if v.1.is_none() {
                    v.1 = Some(p.data.load(SeqCst));
                }
                if v.2 {
                    v.2 = false;
                    p.pins.fetch_sub(1, SeqCst);
                    p.st.unpin();
                }
            }
        }
        p.truncate();
    }

    /// `write_at` of the whole page (`lock_page_for_write` + `break_loans`), copying in two
    /// steps (the page is torn between them).
    fn write(&self, p: &Page) {
        match p.st.begin_write() {
            WriteLock::Resident => {
                assert!(!p.writing.swap(true, SeqCst), "two writers at once");
                if self.active.load(SeqCst) > 0 {
                    let mut v = self.view.lock().unwrap();
                    if v.0 && v.1.is_none() {
                        v.1 = Some(p.data.load(SeqCst));
                    }
                }
                p.data.store(TORN, SeqCst);
                thread::yield_now();
                p.data.store(p.next_version(), SeqCst);
                p.writing.store(false, SeqCst);
                p.st.end_write();
            }
            WriteLock::Empty => {
                // Evicted meanwhile (not in this scenario): write it whole.
                p.took_busy("write of an empty page");
                p.data.store(p.next_version(), SeqCst);
                p.busy.store(false, SeqCst);
                p.st.finish_fill(Filled { dirty: true, pins: 0, speculative: false, ra_mark: false });
            }
        }
    }
}

#[test]
fn schedules_loan_against_truncation() {
    // A window lent while the page is written and truncated (and read again): the window
    // keeps its bytes, the truncation does not wait for it, no pin is dropped twice.
    explore("loan against truncation", || {
        run_lent(&[
            |l, p| l.lend_and_read(p),
            |l, p| l.write(p),
            |l, p| {
                l.truncate(p);
                p.read(false);
            },
        ])
    });
}

#[test]
fn schedules_loan_against_writers() {
    // A window lent while two writers rewrite the page (and a reader comes and goes): the
    // window never shows a write half done, and never changes once lent.
    explore("loan against writers", || {
        run_lent(&[
            |l, p| l.lend_and_read(p),
            |l, p| {
                l.write(p);
                l.write(p);
            },
            |l, p| {
                l.write(p);
                p.read(false);
            },
        ])
    });
}

/// `run` for the loan scenarios: each role gets the loan model and the page (valid, clean).
fn run_lent(roles: &[fn(&LoanModel, &Page)]) {
    let p = Page::valid(false);
    let loan = Arc::new(LoanModel::default());
    let hs: Vec<_> = roles
        .iter()
        .map(|&role| {
            let (p, loan) = (p.clone(), loan.clone());
            thread::spawn(move || role(&loan, &p))
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    p.check_quiescent();
}

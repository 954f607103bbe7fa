//! Coherence between machines (issue 21): tokens on files, held under etcd leases.
//!
//! The stack paper's division of labour: each machine's cache manager (`coherence.rs`) keeps
//! the layers of *its* stack coherent, and a distributed-protocol layer between machines
//! keeps their caches coherent — here a token service on etcd, the role Mach gave a network
//! memory server ("the pager … may request that the kernel flush, clean or lock data", Mach
//! external pager interface). A machine may cache a file's pages, its length and its record
//! only while it holds the file's token:
//!
//! * **read** (shared by any number of machines): cached pages may be used;
//! * **write** (one machine, no reader elsewhere): pages may also be dirtied.
//!
//! Tokens are whole-file: the unit of a remote revocation is the file (its record — size,
//! chunk list — changes with any write, so a range token would still serialize on it).
//!
//! # In etcd (keys under the layer's prefix `K`)
//!
//! * `K t/<ino>/<machine>` = `r` | `w`: machine `<machine>` holds the token, attached to
//!   that machine's lease. A machine that stops renewing its lease (a crash, a partition)
//!   loses its keys when the lease expires: nobody waits longer than the TTL for it.
//! * `K q/<holder>/<ino>/<requester>` = `r` | `w`: a request that `<holder>` give way, put
//!   by the requester under its own lease; each machine watches `K q/<itself>/`.
//!
//! A machine creating a file puts its write token's key in the create's own transaction
//! (the inode is new: nobody else can hold or want it). Otherwise, to acquire, a machine
//! reads `K t/<ino>/` at revision `R`; if no other holder conflicts it
//! puts its key in a transaction that succeeds only if no key of the file was changed after
//! `R` (a range compare: two machines cannot both win); else it puts a request to each
//! conflicting holder and waits on a watch of `K t/<ino>/` until they change, then tries
//! again. A holder told to give way waits for its operations in flight on the file
//! (pins), writes back what it dirtied through every layer, stores it (the layer's
//! commit: chunks uploaded, record rewritten), drops its cached pages unless it may keep a
//! read token, and only then rewrites or deletes its key — so the requester's next look
//! at the store sees everything the holder wrote.
//!
//! # Rules that keep it free of deadlock
//!
//! * A token is *pinned* for each operation, from before the operation takes any lock of
//!   the stack or the cache to its end; waiting for other machines happens only while
//!   pinning, holding nothing. A holder giving way waits only for pins, which never wait
//!   for another machine.
//! * A machine acquiring a token it must upgrade (read → write) is not an obstacle to
//!   others: a request that reaches it meanwhile is served at once (it gives up its read
//!   token); its own acquisition then finds the file changed and reloads.
//!
//! # Losing the lease
//!
//! A machine whose lease could not be renewed for its TTL takes every token as lost
//! (another machine may hold it now): cached pages are dropped, changes not yet stored are
//! dropped too and the next `sync` of such a file fails (`ESTALE`, as NFS reports lost
//! locks), and it takes a new lease before it serves anything again.

use crate::coherence::{Mode, Remote, RemoteCache, RemoteLock, RemotePin};
use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse,
    WatchOptions,
};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// What a token protects and how to give it up: the bottom layer's file (its record and
/// staged changes; the caches of every stack that has the file open are attached to the
/// token separately).
pub(crate) trait TokenHolder: Send + Sync {
    /// The token was granted after a time without one: re-read what is stored (the record).
    fn reload(&self) -> io::Result<()>;
    /// Store what was changed under the write token (called after the caches above wrote
    /// back into the holder; the holder's own cache object, if no group has it open, is
    /// the holder's to write back).
    fn store(&self) -> io::Result<()>;
    /// Drop the holder's own cached pages (after the groups dropped theirs).
    fn drop_cached(&self) -> io::Result<()>;
    /// The token is being lost (the lease expired, or the fence found it gone): while `on`,
    /// what the caches write back into the holder is dropped, not stored or staged (it may
    /// not be storable: another machine may have replaced the chunks it would merge with);
    /// switching on and off each forget every change not stored.
    fn discarding(&self, on: bool);
}

/// How long an acquisition waits for other machines before it fails (`TimedOut`).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(120);

/// How long one wait on a watch lasts before the holders are read again (a lost watch
/// event costs this much, never a hang).
const WATCH_SLICE: Duration = Duration::from_millis(500);

/// After giving a token up to a request, how long this machine waits for the requester to
/// take it before taking it back in a conflicting mode itself (see [`Yielded`]).
const YIELD_GRACE: Duration = Duration::from_millis(500);

/// This machine gave its token up to machine `to`, which asked for `mode`, at etcd revision
/// `rev`. Without waiting for `to` to take it, a machine whose own threads want the token
/// back at once (a loop of writes, or of reads) takes it back first, every time — the
/// requester starves (measured: one read in 3 s against 680,000 writes, and the reverse).
/// So a conflicting acquisition of this machine's waits until `to`'s key has been put
/// since `rev`, or `YIELD_GRACE` has passed (the requester gave up or died): requests are
/// served in turn, as Frangipani's and GPFS's token managers do.
#[derive(Clone, Copy, Debug)]
struct Yielded {
    to: u64,
    mode: Mode,
    rev: i64,
    at: Instant,
}

/// What [`claim`] found.
enum Claim<X> {
    /// No other machine's key conflicted, and the change was made (if one was asked).
    Won,
    /// A key under the prefix changed between the read and the transaction: look again.
    Raced,
    /// Other machines' keys conflict (what `conflict` made of them), read at that revision.
    Refused(Vec<X>, i64),
}

/// The step tokens and locks are both taken by: read every key under `prefix` at revision
/// `R`; if `conflict` finds nothing in other machines' keys (every key but `mine`), apply
/// `op` to `mine` in a transaction that succeeds only if no key under `prefix` changed
/// after `R` (a range compare) — two machines cannot both win.
async fn claim<X>(
    c: &mut Client,
    prefix: &str,
    mine: &str,
    op: Option<TxnOp>,
    conflict: impl Fn(&KeyValue) -> Option<X>,
) -> Result<Claim<X>, etcd_client::Error> {
    let got = c.get(prefix, Some(GetOptions::new().with_prefix())).await?;
    let rev = got.header().map_or(0, |h| h.revision());
    let found: Vec<X> = got.kvs().iter().filter(|kv| kv.key() != mine.as_bytes()).filter_map(conflict).collect();
    if !found.is_empty() {
        return Ok(Claim::Refused(found, rev));
    }
    let Some(op) = op else { return Ok(Claim::Won) };
    let txn = Txn::new().when([Compare::mod_revision(prefix, CompareOp::Less, rev + 1).with_prefix()]).and_then([op]);
    Ok(if c.txn(txn).await?.succeeded() { Claim::Won } else { Claim::Raced })
}

fn etcd_err(e: etcd_client::Error) -> io::Error {
    io::Error::other(format!("etcd: {e}"))
}

fn mode_byte(m: Mode) -> &'static [u8] {
    match m {
        Mode::Read => b"r",
        Mode::Write => b"w",
    }
}

fn mode_of(b: &[u8]) -> Option<Mode> {
    match b {
        b"r" => Some(Mode::Read),
        b"w" => Some(Mode::Write),
        _ => None,
    }
}

fn covers(held: Option<Mode>, want: Mode) -> bool {
    matches!((held, want), (Some(Mode::Write), _) | (Some(Mode::Read), Mode::Read))
}

/// Counters, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DistStats {
    /// Tokens acquired from etcd (a transaction won).
    pub acquired: u64,
    /// Requests this machine put to other holders.
    pub requested: u64,
    /// Tokens this machine gave up or downgraded for others.
    pub revoked: u64,
    /// Times the lease was lost.
    pub leases_lost: u64,
    /// Commits refused by the fence: this machine's write token was gone from etcd before
    /// it noticed (each such token is then lost here too).
    pub fenced: u64,
    /// Acquisitions that waited the whole grace (`YIELD_GRACE`, 500 ms) for a machine this
    /// one had yielded to: it neither took the token nor finished its request in time (it
    /// gave up, died or was slow). Each is half a second of a writer's time.
    pub turns_waited_out: u64,
    /// Advisory locks asked of etcd (a lock refused before, asked again with no lock key
    /// changed since, is refused without asking).
    pub lock_asks: u64,
    /// Files created here with their write token put in the create's own transaction
    /// (not counted in `acquired`).
    pub created: u64,
    /// Requests the namespace sent to etcd (names, records, directories; not tokens or
    /// locks): a `stat` of a name read here before is one.
    pub meta_requests: u64,
}

/// Who holds a file's write token ([`Machine::writer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Writer {
    Nobody,
    /// This machine: its own state of the file is newer than the record.
    Here,
    /// Another machine: the record may lack what it wrote.
    Elsewhere,
}

/// One machine's membership: its lease, its tokens, the watch on requests to it.
pub(crate) struct Machine {
    inner: Arc<MachineInner>,
}

struct MachineInner {
    rt: tokio::runtime::Handle,
    client: Client,
    /// `K`: ends with `/`.
    prefix: String,
    id: u64,
    ttl: Duration,
    /// The current lease (0: none, being taken again).
    lease: AtomicI64,
    lease_cv: (Mutex<()>, Condvar),
    tokens: Mutex<HashMap<u64, Weak<Token>>>,
    closing: AtomicBool,
    acquired: AtomicU64,
    requested: AtomicU64,
    revoked: AtomicU64,
    leases_lost: AtomicU64,
    fenced: AtomicU64,
    turns_waited_out: AtomicU64,
    /// What the watch of every file's lock keys (`K l/`) has heard, for lock waits.
    locks_heard: Mutex<LocksHeard>,
    locks_cv: Condvar,
    lock_asks: AtomicU64,
    created: AtomicU64,
}

/// The lock watch's state ([`watch_locks`]). A refusal read from etcd stays true until a
/// lock key of some file changes: while the watch is live, a lock *asked again* with
/// nothing heard since its refusal (`LockWait::Retry`, and a blocking lock's later asks)
/// is refused again without asking etcd — a waiting lock (the mount tries every few
/// milliseconds; a library wait wakes on `locks_cv`) costs etcd nothing until a holder
/// lets go, and is tried again as soon as the watch hears it. A first ask always asks: a
/// lock tried after another machine's unlock returned must see it.
#[derive(Default)]
struct LocksHeard {
    /// The watch is running and caught up since it was (re)made.
    live: bool,
    /// Bumped for every change of a lock key heard, and when the watch is made or lost.
    changes: u64,
    /// By (inode, `flock`): the last refusal.
    refused: HashMap<(u64, bool), Refusal>,
}

/// A lock refused by another machine's, as read from etcd.
struct Refusal {
    want: Vec<RemoteLock>,
    theirs: RemoteLock,
    /// `LocksHeard::changes` when it was read.
    heard: u64,
    /// When: it is given again for `REFUSAL_KEPT` at most (a watch that stopped hearing
    /// without an error costs a waiter that long, not its lock).
    at: Instant,
}

impl Refusal {
    /// Whether it still stands for `want`, with `changes` heard so far.
    fn stands(&self, changes: u64) -> bool {
        self.heard == changes && self.at.elapsed() < REFUSAL_KEPT
    }
}

/// How long a refusal is given again without asking etcd (see `LocksHeard::refused`).
const REFUSAL_KEPT: Duration = Duration::from_secs(2);

impl Machine {
    /// Join: take a lease of `ttl` (kept alive by a thread of its own) and watch for
    /// requests. => not called on a thread of `rt`.
    pub(crate) fn join(
        rt: tokio::runtime::Handle,
        client: Client,
        prefix: String,
        ttl: Duration,
    ) -> io::Result<Machine> {
        let id = {
            let mut b = [0u8; 8];
            getrandom::fill(&mut b).map_err(|e| io::Error::other(e.to_string()))?;
            u64::from_le_bytes(b) | 1
        };
        let inner = Arc::new(MachineInner {
            rt,
            client,
            prefix,
            id,
            ttl: ttl.max(Duration::from_secs(1)),
            lease: AtomicI64::new(0),
            lease_cv: (Mutex::new(()), Condvar::new()),
            tokens: Mutex::new(HashMap::new()),
            closing: AtomicBool::new(false),
            acquired: AtomicU64::new(0),
            requested: AtomicU64::new(0),
            revoked: AtomicU64::new(0),
            leases_lost: AtomicU64::new(0),
            fenced: AtomicU64::new(0),
            turns_waited_out: AtomicU64::new(0),
            locks_heard: Mutex::new(LocksHeard::default()),
            locks_cv: Condvar::new(),
            lock_asks: AtomicU64::new(0),
            created: AtomicU64::new(0),
        });
        let lease = inner.grant()?;
        inner.lease.store(lease, SeqCst);
        let w = Arc::downgrade(&inner);
        std::thread::Builder::new().name("ubc-dist-lease".into()).spawn(move || keep_alive(w))?;
        let w = Arc::downgrade(&inner);
        std::thread::Builder::new().name("ubc-dist-requests".into()).spawn(move || watch_requests(w))?;
        let w = Arc::downgrade(&inner);
        std::thread::Builder::new().name("ubc-dist-locks".into()).spawn(move || watch_locks(w))?;
        Ok(Machine { inner })
    }

    /// The token of file `ino`, protecting `holder`'s data (one per file and machine). A
    /// token may outlive its holder (a group of the file still being closed holds it): the
    /// file's new holder takes it over — else a reload or a store would reach nobody, and
    /// the new holder's changes would never be stored before the token went elsewhere.
    pub(crate) fn token(&self, ino: u64, holder: Weak<dyn TokenHolder>) -> Arc<Token> {
        let mut t = self.inner.tokens.lock();
        if let Some(x) = t.get(&ino).and_then(Weak::upgrade) {
            let mut h = x.holder.lock();
            if h.strong_count() == 0 {
                *h = holder;
            }
            drop(h);
            return x;
        }
        let x = Arc::new(Token {
            machine: Arc::downgrade(&self.inner),
            ino,
            holder: Mutex::new(holder),
            st: Mutex::new(TokState::default()),
            cv: Condvar::new(),
            caches: Mutex::new(Vec::new()),
        });
        t.insert(ino, Arc::downgrade(&x));
        t.retain(|_, w| w.strong_count() > 0);
        x
    }

    /// The lease this machine's keys are put under now (waiting, bounded, while it is
    /// being taken again), for [`Machine::created_token`].
    pub(crate) fn lease(&self) -> io::Result<i64> {
        self.inner.lease(Instant::now() + ACQUIRE_TIMEOUT)
    }

    /// The put of this machine's write token of file `ino` under `lease`, for the
    /// transaction that creates the file: a new inode, whose token no machine can hold or
    /// be asking for, so no claim is needed (the create's compares make it one of a kind).
    /// After it commits, [`Token::created`] says so to the file's token here.
    pub(crate) fn created_token(&self, ino: u64, lease: i64) -> TxnOp {
        TxnOp::put(
            self.inner.tkey(ino, self.inner.id),
            mode_byte(Mode::Write),
            Some(PutOptions::new().with_lease(lease)),
        )
    }

    /// The prefix of `ino`'s token keys (one per holder), to be read with its record.
    pub(crate) fn token_prefix(&self, ino: u64) -> String {
        self.inner.tprefix(ino)
    }

    /// Who holds the write token, by the token keys `keys` read under
    /// [`Machine::token_prefix`] (at the revision the file's record was read at).
    pub(crate) fn writer(&self, keys: &[KeyValue]) -> Writer {
        let mine = format!("/{:016x}", self.inner.id);
        let mut w = Writer::Nobody;
        for kv in keys.iter().filter(|kv| mode_of(kv.value()) == Some(Mode::Write)) {
            if kv.key().ends_with(mine.as_bytes()) {
                w = Writer::Here;
            } else {
                return Writer::Elsewhere;
            }
        }
        w
    }

    /// A transaction condition that holds only while this machine holds `ino`'s write
    /// token in etcd (a commit's fence).
    pub(crate) fn write_fence(&self, ino: u64) -> Compare {
        Compare::value(self.inner.tkey(ino, self.inner.id), CompareOp::Equal, mode_byte(Mode::Write))
    }

    /// The operation to run when a fenced transaction fails: it reads this machine's key of
    /// `ino`, for [`Machine::fenced_off`].
    pub(crate) fn fence_probe(&self, ino: u64) -> TxnOp {
        TxnOp::get(self.inner.tkey(ino, self.inner.id), None)
    }

    /// Whether a transaction fenced by [`Machine::write_fence`] that did not succeed failed
    /// on the fence (`resp` ran [`Machine::fence_probe`] as its else branch): this machine's
    /// key of `ino` does not say `w`. Either it holds only the read token (stores through a
    /// mapping made after it gave the write token up: refused, see docs/guarantees.md), or
    /// the token is gone from etcd though this machine has not noticed (an operator
    /// deleted the key; the lease was revoked, or expired while a renewal was on its way) —
    /// then the token is lost here too, as at the end of a lease: once the caller's pins
    /// are gone, on a thread of its own, since the caller holds one.
    pub(crate) fn fenced_off(&self, ino: u64, resp: &TxnResponse) -> bool {
        let stored: Option<Vec<u8>> = resp.op_responses().iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        if stored.as_deref() == Some(mode_byte(Mode::Write)) {
            return false;
        }
        // The commit's caller is told (`ESTALE`): the loss notes nothing more.
        self.inner.check_key(ino, stored.as_deref(), false);
        true
    }

    pub(crate) fn stats(&self) -> DistStats {
        let m = &self.inner;
        DistStats {
            acquired: m.acquired.load(Relaxed),
            requested: m.requested.load(Relaxed),
            revoked: m.revoked.load(Relaxed),
            leases_lost: m.leases_lost.load(Relaxed),
            fenced: m.fenced.load(Relaxed),
            turns_waited_out: m.turns_waited_out.load(Relaxed),
            lock_asks: m.lock_asks.load(Relaxed),
            created: m.created.load(Relaxed),
            meta_requests: 0,
        }
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        // Leave: the lease's revocation deletes every key of this machine at once.
        self.inner.closing.store(true, SeqCst);
        let lease = self.inner.lease.swap(0, SeqCst);
        if lease != 0 {
            let mut c = self.inner.client.clone();
            let _ = self
                .inner
                .rt
                .block_on(async move { tokio::time::timeout(Duration::from_secs(2), c.lease_revoke(lease)).await });
        }
    }
}

impl MachineInner {
    fn grant(&self) -> io::Result<i64> {
        let mut c = self.client.clone();
        let ttl = self.ttl.as_secs().max(1) as i64;
        let r = self.rt.block_on(async move { c.lease_grant(ttl, None).await }).map_err(etcd_err)?;
        Ok(r.id())
    }

    /// The current lease, waiting (bounded) while it is being taken again.
    fn lease(&self, deadline: Instant) -> io::Result<i64> {
        loop {
            let l = self.lease.load(SeqCst);
            if l != 0 {
                return Ok(l);
            }
            if self.closing.load(SeqCst) {
                return Err(io::Error::other("the layer is closing"));
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no etcd lease (etcd unreachable?)"));
            }
            let mut g = self.lease_cv.0.lock();
            self.lease_cv.1.wait_for(&mut g, Duration::from_millis(100));
        }
    }

    fn tkey(&self, ino: u64, machine: u64) -> String {
        format!("{}t/{ino:016x}/{machine:016x}", self.prefix)
    }

    fn tprefix(&self, ino: u64) -> String {
        format!("{}t/{ino:016x}/", self.prefix)
    }

    fn qkey(&self, holder: u64, ino: u64, requester: u64) -> String {
        format!("{}q/{holder:016x}/{ino:016x}/{requester:016x}", self.prefix)
    }

    /// Make this machine a holder of `ino`'s token in `mode` in etcd: wait (asking them)
    /// until no other machine's token conflicts, then put the key in a transaction no
    /// concurrent change of the file's holders lets through. => called holding nothing.
    /// `defer`: this machine gave the token up to another one lately (see [`Yielded`]).
    fn acquire(&self, ino: u64, mode: Mode, defer: Option<Yielded>) -> io::Result<()> {
        let deadline = Instant::now() + ACQUIRE_TIMEOUT;
        let me = self.id;
        let tprefix = self.tprefix(ino);
        let mykey = self.tkey(ino, me);
        let mut asked: Vec<String> = Vec::new();
        if let Some(y) = defer {
            self.await_turn(ino, y);
        }
        let r = loop {
            let lease = self.lease(deadline)?;
            let mut c = self.client.clone();
            let (tp, mk) = (tprefix.clone(), mykey.clone());
            let step = self.rt.block_on(async move {
                let op = TxnOp::put(mk.as_str(), mode_byte(mode), Some(PutOptions::new().with_lease(lease)));
                claim(&mut c, &tp, &mk, Some(op), |kv| {
                    let holder = kv
                        .key_str()
                        .ok()
                        .and_then(|k| k.rsplit('/').next())
                        .and_then(|h| u64::from_str_radix(h, 16).ok())?;
                    let m = mode_of(kv.value());
                    (mode == Mode::Write || m == Some(Mode::Write) || m.is_none()).then_some(holder)
                })
                .await
            });
            let (won, conflicting, rev) = match step {
                Ok(Claim::Won) => (true, Vec::new(), 0),
                Ok(Claim::Raced) => (false, Vec::new(), 0),
                Ok(Claim::Refused(holders, rev)) => (false, holders, rev),
                Err(e) if Instant::now() < deadline => {
                    // etcd unreachable for a moment: try again (bounded by the deadline).
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
                Err(e) => break Err(etcd_err(e)),
            };
            if won {
                self.acquired.fetch_add(1, Relaxed);
                break Ok(());
            }
            if Instant::now() >= deadline {
                break Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("inode {ino}: another machine kept its {mode:?}-conflicting token for {ACQUIRE_TIMEOUT:?}"),
                ));
            }
            if conflicting.is_empty() {
                continue; // lost a race: look again at once
            }
            // Ask each conflicting holder to give way, then wait for a change of the holders.
            let mut c = self.client.clone();
            let keys: Vec<String> = conflicting.iter().map(|&h| self.qkey(h, ino, me)).collect();
            for k in &keys {
                if !asked.contains(k) {
                    asked.push(k.clone());
                }
            }
            self.requested.fetch_add(keys.len() as u64, Relaxed);
            let tp = tprefix.clone();
            let _ = self.rt.block_on(async move {
                // The watch first: made before the requests' puts move etcd's revision past
                // `rev`, it is in step with etcd and hears a change at once; made after, it
                // starts in the past, and etcd catches such watches up only every 100 ms
                // (its watchable store's resync), which each turn paid.
                let mut ws = c.watch(tp, Some(WatchOptions::new().with_prefix().with_start_revision(rev + 1))).await?;
                for k in keys {
                    c.put(k, mode_byte(mode), Some(PutOptions::new().with_lease(lease))).await?;
                }
                // Until a holder changes (the first answer only says the watch was made:
                // looking again at it would poll etcd while the holder works).
                let _ = tokio::time::timeout(WATCH_SLICE, async {
                    while let Ok(Some(resp)) = ws.message().await {
                        if !resp.events().is_empty() || resp.canceled() {
                            break;
                        }
                    }
                })
                .await;
                Ok::<_, etcd_client::Error>(())
            });
        };
        if !asked.is_empty() {
            let mut c = self.client.clone();
            self.rt.block_on(async move {
                for k in asked {
                    let _ = c.delete(k, None).await;
                }
            });
        }
        r
    }

    fn lprefix(&self, ino: u64, flock: bool) -> String {
        format!("{}l/{ino:016x}/{}/", self.prefix, if flock { "f" } else { "r" })
    }

    /// [`Remote::locks`] for file `ino`: read every machine's locks of the kind at revision
    /// `R`; if none of another machine's conflicts with `want`, put this machine's (`held`,
    /// under its lease: a machine that dies or is cut off loses its locks with its lease)
    /// in a transaction that succeeds only if no lock of the file changed after `R` — two
    /// machines cannot both take conflicting locks. A release (`want` empty) is put as it is.
    fn locks(
        &self,
        ino: u64,
        flock: bool,
        held: Option<&[RemoteLock]>,
        want: &[RemoteLock],
        may_lag: bool,
    ) -> io::Result<Option<RemoteLock>> {
        // Asked again after a refusal, and no lock key changed since: refused still (see
        // `LocksHeard`).
        let heard = {
            let h = self.locks_heard.lock();
            if may_lag
                && !want.is_empty()
                && h.live
                && let Some(r) = h.refused.get(&(ino, flock))
                && r.stands(h.changes)
                && r.want.as_slice() == want
            {
                return Ok(Some(r.theirs.clone()));
            }
            // Read before etcd is: a change after the read below is heard after this.
            h.live.then_some(h.changes)
        };
        self.lock_asks.fetch_add(1, Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        let prefix = self.lprefix(ino, flock);
        let mine = format!("{prefix}{:016x}", self.id);
        let value = held.map(encode_locks);
        loop {
            let lease = self.lease(deadline)?;
            let mut c = self.client.clone();
            let (p, k, v) = (prefix.clone(), mine.clone(), value.clone());
            let step = self.rt.block_on(async move {
                let op = v.map(|v| match v.is_empty() {
                    true => TxnOp::delete(k.as_str(), None),
                    false => TxnOp::put(k.as_str(), v, Some(PutOptions::new().with_lease(lease))),
                });
                if want.is_empty() {
                    if let Some(op) = op {
                        c.txn(Txn::new().and_then([op])).await?;
                    }
                    return Ok(Claim::Won);
                }
                claim(&mut c, &p, &k, op, |kv| {
                    decode_locks(kv.value()).into_iter().find(|x| want.iter().any(|w| w.conflicts(x)))
                })
                .await
            });
            match step {
                Ok(Claim::Won) => {
                    self.locks_heard.lock().refused.remove(&(ino, flock));
                    return Ok(None);
                }
                Ok(Claim::Refused(mut theirs, _)) => {
                    let theirs = theirs.swap_remove(0);
                    let mut h = self.locks_heard.lock();
                    match heard {
                        Some(at) => {
                            // Refusals read before the last change are stale: forgotten.
                            let now = h.changes;
                            h.refused.retain(|_, r| r.heard == now);
                            let r =
                                Refusal { want: want.to_vec(), theirs: theirs.clone(), heard: at, at: Instant::now() };
                            h.refused.insert((ino, flock), r);
                        }
                        None => {
                            h.refused.remove(&(ino, flock));
                        }
                    }
                    return Ok(Some(theirs));
                }
                Ok(Claim::Raced) => continue, // another machine's locks changed meanwhile: look again
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
                Err(e) => return Err(etcd_err(e)),
            }
        }
    }

    /// Wait for the machine this one yielded to (`y`) to take its turn: until its key of
    /// file `ino` has been put since `y.rev`, or until `YIELD_GRACE` after
    /// the yield (the requester gave up or died; or etcd failed: the acquisition then goes
    /// ahead as without a yield).
    fn await_turn(&self, ino: u64, y: Yielded) {
        let left = YIELD_GRACE.saturating_sub(y.at.elapsed());
        if left.is_zero() {
            return;
        }
        let mut c = self.client.clone();
        let theirs = self.tkey(ino, y.to);
        let request = self.qkey(self.id, ino, y.to);
        let tp = self.tprefix(ino);
        self.rt.block_on(async move {
            // Put since the yield already (the usual case)? Then no watch: one made from a
            // past revision is served by etcd's 100 ms resync, not at once.
            let Ok(now) = c.get(theirs.as_str(), None).await else { return };
            if now.kvs().first().is_some_and(|kv| kv.mod_revision() > y.rev) {
                return;
            }
            // No key of theirs, and their request gone: they took their turn and left
            // already (a token taken for an open and given up at its close), or gave up —
            // a requester deletes its requests only when its acquisition is over. Waiting
            // for a key that will not come cost the whole grace (a first write after
            // another machine's open: 500 ms).
            if now.kvs().is_empty() && c.get(request.as_str(), None).await.map_or(true, |q| q.kvs().is_empty()) {
                return;
            }
            let from = now.header().map_or(y.rev, |h| h.revision());
            let Ok(mut ws) = c.watch(tp, Some(WatchOptions::new().with_prefix().with_start_revision(from + 1))).await
            else {
                return;
            };
            let waited = tokio::time::timeout(left, async {
                while let Ok(Some(resp)) = ws.message().await {
                    let put = resp.events().iter().any(|ev| {
                        ev.event_type() == EventType::Put && ev.kv().is_some_and(|kv| kv.key() == theirs.as_bytes())
                    });
                    if put || resp.canceled() {
                        return;
                    }
                }
            })
            .await;
            if waited.is_err() {
                self.turns_waited_out.fetch_add(1, Relaxed);
            }
        });
    }

    /// Rewrite this machine's key of `ino` from `from` to `to` (`None`: delete it) — only
    /// if it still says `from`: an acquisition of this machine's may have changed it since.
    /// Returns the etcd revision after it.
    fn set_key(&self, ino: u64, from: Mode, to: Option<Mode>) -> io::Result<i64> {
        let key = self.tkey(ino, self.id);
        let lease = self.lease.load(SeqCst);
        let mut c = self.client.clone();
        let op = match to {
            Some(m) => TxnOp::put(key.as_str(), mode_byte(m), Some(PutOptions::new().with_lease(lease))),
            None => TxnOp::delete(key.as_str(), None),
        };
        let txn = Txn::new().when([Compare::value(key.as_str(), CompareOp::Equal, mode_byte(from))]).and_then([op]);
        let r = self.rt.block_on(async move { c.txn(txn).await }).map_err(etcd_err)?;
        Ok(r.header().map_or(0, |h| h.revision()))
    }

    /// Delete this machine's key of `ino`, whatever it says.
    fn delete_key(&self, ino: u64) -> io::Result<()> {
        let mut c = self.client.clone();
        let k = self.tkey(ino, self.id);
        self.rt.block_on(async move { c.delete(k, None).await }).map_err(etcd_err)?;
        Ok(())
    }

    /// The fence: `stored` is what etcd holds under this machine's key of `ino`. If it is
    /// not the mode this machine holds, the token is gone from etcd though this machine
    /// did not know, and is lost here too (`fenced_off`). `note`: see [`Token::lose`].
    fn check_key(&self, ino: u64, stored: Option<&[u8]>, note: bool) {
        let held = self.tokens.lock().get(&ino).and_then(Weak::upgrade).and_then(|t| t.st.lock().held);
        if stored.is_none() || stored != held.map(mode_byte) {
            self.fenced_off(ino, note);
        }
    }

    /// This machine's token of `ino` is gone from etcd though it did not know: it is lost
    /// here too, as at the end of a lease — on a thread of its own, since the caller may
    /// hold a pin on it (the loss waits for pins). `note`: see [`Token::lose`].
    fn fenced_off(&self, ino: u64, note: bool) {
        self.fenced.fetch_add(1, Relaxed);
        if let Some(t) = self.tokens.lock().get(&ino).and_then(Weak::upgrade) {
            let _ = std::thread::Builder::new().name("ubc-dist-fenced".into()).spawn(move || t.lose(note));
        }
    }

    /// Every token of this machine is lost (the lease expired).
    fn lose_all(&self) {
        self.leases_lost.fetch_add(1, Relaxed);
        let tokens: Vec<Arc<Token>> = self.tokens.lock().values().filter_map(Weak::upgrade).collect();
        for t in tokens {
            t.lose(true);
        }
    }
}

/// Keep the lease alive (a renewal every fifth of its TTL). The lease counts as lost three
/// quarters of a TTL after the *sending* of the last renewal etcd answered — before etcd
/// itself can expire it (etcd counts from the renewal's arrival, later), so that this
/// machine has stopped using its tokens by the time another machine can be granted them.
/// Then every token is lost and a new lease is taken.
fn keep_alive(w: Weak<MachineInner>) {
    let mut renewed = Instant::now();
    let mut stream: Option<(etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream)> = None;
    loop {
        let Some(m) = w.upgrade() else { return };
        if m.closing.load(SeqCst) {
            return;
        }
        let period = m.ttl / 5;
        let lease = m.lease.load(SeqCst);
        let sent = Instant::now();
        let mut gone = false;
        let ok = lease != 0 && {
            let mut c = m.client.clone();
            let mut s = stream.take();
            let (ok, s) = m.rt.block_on(async move {
                let r = tokio::time::timeout(period, async {
                    if s.as_ref().is_none_or(|(k, _)| k.id() != lease) {
                        s = Some(c.lease_keep_alive(lease).await?);
                    }
                    let (keeper, st) = s.as_mut().expect("made");
                    keeper.keep_alive().await?;
                    st.message().await
                })
                .await;
                match r {
                    Ok(Ok(Some(resp))) if resp.ttl() > 0 => (Some(true), s),
                    // etcd answered that the lease is gone (revoked, or expired already).
                    Ok(Ok(Some(_))) => (Some(false), None),
                    _ => (None, None),
                }
            });
            stream = s;
            gone = ok == Some(false);
            ok == Some(true)
        };
        if ok {
            renewed = sent;
        } else if lease == 0 || gone || renewed.elapsed() >= m.ttl * 3 / 4 {
            // What was held may be another machine's soon (or already, if etcd said so).
            if lease != 0 {
                m.lease.store(0, SeqCst);
                m.lose_all();
            }
            if let Ok(l) = m.grant() {
                m.lease.store(l, SeqCst);
                m.lease_cv.1.notify_all();
                renewed = Instant::now();
            }
        }
        drop(m);
        std::thread::sleep(period.saturating_sub(sent.elapsed()));
    }
}

impl MachineInner {
    /// Wait while the last refusal of a lock of file `ino` (`flock`: of that kind) still
    /// stands — until a lock key changes, the watch is made or lost, or `timeout` passes:
    /// what a refused lock waits for before it asks again. Without a live watch (nothing
    /// known to stand), waits 20 ms.
    fn await_locks(&self, ino: u64, flock: bool, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut h = self.locks_heard.lock();
        while h.live && h.refused.get(&(ino, flock)).is_some_and(|r| r.stands(h.changes)) {
            if self.locks_cv.wait_until(&mut h, deadline).timed_out() {
                return;
            }
        }
        if !h.live {
            drop(h);
            std::thread::sleep(timeout.min(Duration::from_millis(20)));
        }
    }
}

/// Follow the watch `ws` until it ends (cancelled, closed, an error) or the machine closes
/// (looked at every second), handing `on` each answer that carries events.
async fn follow(
    ws: &mut etcd_client::WatchStream,
    closing: &AtomicBool,
    mut on: impl FnMut(&etcd_client::WatchResponse),
) -> Result<(), etcd_client::Error> {
    while !closing.load(SeqCst) {
        match tokio::time::timeout(Duration::from_secs(1), ws.message()).await {
            Err(_) => {}
            Ok(Ok(Some(resp))) if resp.canceled() => return Ok(()),
            Ok(Ok(Some(resp))) if !resp.events().is_empty() => on(&resp),
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => return Ok(()),
            Ok(Err(e)) => return Err(e),
        }
    }
    Ok(())
}

/// Watch every file's lock keys (`K l/`): each change bumps `LocksHeard::changes` and wakes
/// the lock waits. Made again after a moment when it ends (etcd restarted, a network error);
/// meanwhile nothing is taken as unchanged.
fn watch_locks(w: Weak<MachineInner>) {
    let heard = |m: &MachineInner, live: bool| {
        let mut h = m.locks_heard.lock();
        h.live = live;
        h.changes += 1;
        if !live {
            h.refused.clear();
        }
        m.locks_cv.notify_all();
    };
    loop {
        let Some(m) = w.upgrade() else { return };
        if m.closing.load(SeqCst) {
            return;
        }
        let prefix = format!("{}l/", m.prefix);
        let mut c = m.client.clone();
        let closing = &m.closing;
        let r: Result<(), etcd_client::Error> = m.rt.block_on(async {
            // Made from the revision etcd is at: every change after it is heard, and every
            // refusal read after `live` is set was read at or after it.
            let rev =
                c.get(prefix.as_str(), Some(GetOptions::new().with_prefix().with_keys_only().with_limit(1))).await?;
            let rev = rev.header().map_or(0, |h| h.revision());
            let mut ws =
                c.watch(prefix.as_str(), Some(WatchOptions::new().with_prefix().with_start_revision(rev + 1))).await?;
            heard(&m, true);
            follow(&mut ws, closing, |_| heard(&m, true)).await
        });
        heard(&m, false);
        let _ = r;
        drop(m);
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Watch `K q/<me>/` and serve each request on a thread of its own.
fn watch_requests(w: Weak<MachineInner>) {
    loop {
        let Some(m) = w.upgrade() else { return };
        if m.closing.load(SeqCst) {
            return;
        }
        let prefix = format!("{}q/{:016x}/", m.prefix, m.id);
        let mut c = m.client.clone();
        let (tx, rx) = std::sync::mpsc::channel::<(u64, Mode, String)>();
        let parse = |key: &str, value: &[u8]| -> Option<(u64, Mode, String)> {
            let rest = key.strip_prefix(prefix.as_str())?;
            let ino = u64::from_str_radix(rest.split('/').next()?, 16).ok()?;
            Some((ino, mode_of(value)?, key.to_string()))
        };
        let weak = w.clone();
        // Requests are served off the watch's thread: giving way may take long (a store).
        let server = std::thread::spawn(move || {
            for (ino, want, key) in rx {
                let weak = weak.clone();
                let _ = std::thread::Builder::new().name("ubc-dist-revoke".into()).spawn(move || {
                    if let Some(m) = weak.upgrade() {
                        serve_request(&m, ino, want, &key);
                    }
                });
            }
        });
        let closing = &m.closing;
        let r: Result<(), etcd_client::Error> = m.rt.block_on(async {
            let got = c.get(prefix.as_str(), Some(GetOptions::new().with_prefix())).await?;
            let rev = got.header().map_or(0, |h| h.revision());
            for kv in got.kvs() {
                if let Some(x) = kv.key_str().ok().and_then(|k| parse(k, kv.value())) {
                    let _ = tx.send(x);
                }
            }
            let mut ws =
                c.watch(prefix.as_str(), Some(WatchOptions::new().with_prefix().with_start_revision(rev + 1))).await?;
            follow(&mut ws, closing, |resp| {
                for ev in resp.events().iter().filter(|ev| ev.event_type() == EventType::Put) {
                    if let Some(kv) = ev.kv()
                        && let Some(x) = kv.key_str().ok().and_then(|k| parse(k, kv.value()))
                    {
                        let _ = tx.send(x);
                    }
                }
            })
            .await
        });
        drop(tx);
        let _ = server.join();
        let _ = r;
        drop(m);
        // The watch ended (etcd restarted, a network error): look again after a moment.
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Serve one request to give way on `ino` (then delete it, unless the requester did).
fn serve_request(m: &MachineInner, ino: u64, want: Mode, key: &str) {
    let token = m.tokens.lock().get(&ino).and_then(Weak::upgrade);
    match token {
        Some(t) => {
            // Retried while storing fails (the object store down): the requester waits, and
            // times out if it lasts; nothing written here is dropped.
            let mut delay = Duration::from_millis(100);
            let requester = key.rsplit('/').next().and_then(|h| u64::from_str_radix(h, 16).ok());
            while let Err(e) = t.give_way(want, requester) {
                if m.closing.load(SeqCst) {
                    return;
                }
                eprintln!("ubc: giving up the token of inode {ino} failed ({e}); retrying");
                std::thread::sleep(delay);
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
        None => {
            // Nothing of the file is held here any more; a key left behind goes.
            let _ = m.delete_key(ino);
        }
    }
    let mut c = m.client.clone();
    let k = key.to_string();
    let _ = m.rt.block_on(async move { c.delete(k, None).await });
}

#[derive(Default)]
struct TokState {
    held: Option<Mode>,
    /// Operations in flight under the token.
    pins: usize,
    /// A thread of this machine is acquiring it (others wait for it).
    acquiring: bool,
    /// It is being given up (new pins wait).
    revoking: bool,
    /// Bumped each time the token is given up entirely or lost: an acquisition that began
    /// holding a read token finds out whether it kept it throughout.
    epoch: u64,
    /// It was lost with changes not stored: the next `sync` says so.
    lost_changes: bool,
    /// The last time it was given up to a request (fairness: [`Yielded`]).
    yielded: Option<Yielded>,
}

/// One file's token on one machine.
pub(crate) struct Token {
    machine: Weak<MachineInner>,
    ino: u64,
    /// The file's data on this machine (taken over by a new one: `Machine::token`).
    holder: Mutex<Weak<dyn TokenHolder>>,
    st: Mutex<TokState>,
    cv: Condvar,
    caches: Mutex<Vec<Weak<dyn RemoteCache>>>,
}

/// A token's holder and caches, upgraded for one action (see `Token::pin_arc`).
struct Parties {
    holder: Option<Arc<dyn TokenHolder>>,
    caches: Vec<Arc<dyn RemoteCache>>,
}

impl Parties {
    /// Reload the holder's record, then every cache (bottom layer first within each).
    fn refresh(&self) -> io::Result<()> {
        if let Some(h) = &self.holder {
            h.reload()?;
        }
        for c in &self.caches {
            c.reload()?;
        }
        Ok(())
    }
}

/// A pin on a token: the operation it covers may use what the token allows.
struct Pinned(Arc<Token>);

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut st = self.0.st.lock();
        st.pins -= 1;
        if st.pins == 0 {
            self.0.cv.notify_all();
        }
    }
}

impl Token {
    fn caches(&self) -> Vec<Arc<dyn RemoteCache>> {
        let mut c = self.caches.lock();
        c.retain(|w| w.strong_count() > 0);
        c.iter().filter_map(Weak::upgrade).collect()
    }

    fn holder(&self) -> Option<Arc<dyn TokenHolder>> {
        self.holder.lock().upgrade()
    }

    /// A chunk this machine's record of the file names is gone from the store: another
    /// machine's commit replaced it, which it could do only holding the write token — so
    /// this machine's token must be gone from etcd (an operator deleted the key, or the
    /// lease ran out before this machine noticed). Check its key in etcd, and if it does
    /// not say what this machine holds, lose the token (the fence, as at a commit).
    /// `note`: see [`Token::lose`].
    pub(crate) fn check_fence(&self, note: bool) {
        if self.st.lock().held.is_none() {
            return;
        }
        let Some(m) = self.machine.upgrade() else { return };
        let mut c = m.client.clone();
        let key = m.tkey(self.ino, m.id);
        let Ok(r) = m.rt.block_on(async move { c.get(key, None).await }) else { return };
        m.check_key(self.ino, r.kvs().first().map(|kv| kv.value()), note);
    }

    /// Take the note of changes lost with the lease (once).
    pub(crate) fn take_lost_changes(&self) -> bool {
        std::mem::take(&mut self.st.lock().lost_changes)
    }

    /// A pin for a mapping's fault (`Pager::fault_guard`): as [`Token::pin_arc`], but a
    /// revocation still waiting for pins does not hold it up when the token covers `mode`
    /// and some pin is held — that pin may be the faulting thread's own (a write whose bytes
    /// come from a mapping of the same file faults inside its pinned copy: it would wait
    /// for itself), and the revocation cannot go on before every pin is gone anyway. Once
    /// it goes on, no pin is held, so none is added this way.
    pub(crate) fn pin_fault(self: &Arc<Self>, mode: Mode) -> io::Result<RemotePin> {
        let mut st = self.st.lock();
        if st.pins > 0 && !st.acquiring && covers(st.held, mode) {
            st.pins += 1;
        } else {
            drop(st);
            self.pin_arc(mode)?;
        }
        Ok(RemotePin::new(Box::new(Pinned(self.clone()))))
    }

    /// The file was created with this machine's write token in the same transaction
    /// ([`Machine::created_token`], under `lease`): the token is held — unless that lease
    /// is gone already (the key went with it; the first pin acquires as usual). A lease
    /// lost after this check finds the token among this machine's and loses it (the lease
    /// is cleared before `lose_all` runs).
    pub(crate) fn created(&self, lease: i64) {
        let Some(m) = self.machine.upgrade() else { return };
        let mut st = self.st.lock();
        if st.held.is_none() && !st.acquiring && !st.revoking && m.lease.load(SeqCst) == lease {
            st.held = Some(Mode::Write);
            m.created.fetch_add(1, Relaxed);
        }
    }

    /// Pin in `mode`, acquiring from etcd first if needed. => the caller holds no lock of
    /// the stack or the cache.
    pub(crate) fn pin_arc(self: &Arc<Self>, mode: Mode) -> io::Result<()> {
        let mut st = self.st.lock();
        loop {
            if !st.revoking && !st.acquiring && covers(st.held, mode) {
                st.pins += 1;
                return Ok(());
            }
            if st.revoking || st.acquiring {
                self.cv.wait(&mut st);
                continue;
            }
            st.acquiring = true;
            let (was, epoch) = (st.held, st.epoch);
            let defer = st
                .yielded
                .take()
                .filter(|y| (mode == Mode::Write || y.mode == Mode::Write) && y.at.elapsed() < YIELD_GRACE);
            drop(st);
            // Kept until the flags are cleared: dropping the last reference to a holder or a
            // cache here would close the file, whose `leave` waits for these flags.
            let parties = self.parties();
            let mut r = match self.machine.upgrade() {
                Some(m) => m.acquire(self.ino, mode, defer),
                None => Err(io::Error::other("the layer is gone")),
            };
            st = self.st.lock();
            // Kept a read token throughout: nothing changed elsewhere, nothing to reload.
            let unchanged = was.is_some() && st.epoch == epoch && st.held.is_some();
            if r.is_ok() {
                st.held = Some(if covers(st.held, mode) { st.held.expect("held") } else { mode });
            }
            if r.is_ok() && !unchanged {
                // Another machine may have changed the file: reload before anyone uses it.
                drop(st);
                r = parties.refresh();
                st = self.st.lock();
                if r.is_err() {
                    st.held = None;
                    st.epoch += 1;
                }
            }
            st.acquiring = false;
            self.cv.notify_all();
            drop(st);
            drop(parties);
            r?;
            st = self.st.lock();
        }
    }

    /// The file's holder and caches on this machine, held for one action.
    fn parties(&self) -> Parties {
        Parties { holder: self.holder(), caches: self.caches() }
    }

    /// Give way to a request for `want`: wait for the pins, push what is dirty through
    /// every cache into the holder, store it, drop cached pages unless a read token may be
    /// kept, then rewrite the key. Requests arrive more than once (a requester repeats its
    /// request while it waits): one finding nothing to give is a no-op. Errors (the store
    /// failing) leave the token as it was.
    fn give_way(&self, want: Mode, requester: Option<u64>) -> io::Result<()> {
        let mut st = self.st.lock();
        while st.revoking {
            self.cv.wait(&mut st);
        }
        let held = match st.held {
            None if st.acquiring => return Ok(()),
            None => {
                // Holding nothing here, yet asked: a key of this machine's left behind (a
                // failed reload, a failed delete) — it goes, or the requester waits for it.
                drop(st);
                return self.machine.upgrade().map_or(Ok(()), |m| m.delete_key(self.ino));
            }
            Some(Mode::Read) if want == Mode::Read => return Ok(()),
            Some(h) => h,
        };
        st.revoking = true;
        while st.pins > 0 {
            self.cv.wait(&mut st);
        }
        drop(st);
        let parties = self.parties();
        let keep = (want == Mode::Read).then_some(Mode::Read);
        let r = self.release(&parties, held, keep);
        let mut st = self.st.lock();
        if let (Ok(rev), Some(to)) = (&r, requester) {
            st.yielded = Some(Yielded { to, mode: want, rev: *rev, at: Instant::now() });
        }
        if r.is_ok() {
            // An acquisition of this machine's that finished meanwhile (a read token being
            // upgraded) holds what it got: its key is in etcd, and the epoch told it to reload.
            if st.held == Some(held) {
                st.held = keep;
            }
            if let Some(m) = self.machine.upgrade() {
                m.revoked.fetch_add(1, Relaxed);
            }
        }
        st.revoking = false;
        self.cv.notify_all();
        drop(st);
        drop(parties);
        r.map(drop)
    }

    /// Give the token up (to `keep`, or entirely): returns the etcd revision of the key's
    /// rewrite.
    fn release(&self, parties: &Parties, held: Mode, keep: Option<Mode>) -> io::Result<i64> {
        if held == Mode::Write {
            for c in &parties.caches {
                c.write_back()?;
            }
            if let Some(h) = &parties.holder {
                h.store()?;
            }
        }
        // A shared writable mapping keeps no page through a downgrade either: a store through
        // it must fault, and the fault take the write token back (`Pager::fault_guard`).
        let mapped = held == Mode::Write && parties.caches.iter().any(|c| c.has_writable_mappings());
        if keep.is_none() || mapped {
            for c in &parties.caches {
                c.drop_cached()?;
            }
        }
        if keep.is_none() {
            if let Some(h) = &parties.holder {
                h.drop_cached()?;
            }
            // Before the key goes: from the moment another machine may take the token, an
            // acquisition of this machine's must reload.
            self.st.lock().epoch += 1;
        }
        let m = self.machine.upgrade().ok_or_else(|| io::Error::other("the layer is gone"))?;
        m.set_key(self.ino, held, keep)
    }

    /// The lease expired (or the fence found the token gone): the token is another
    /// machine's to take. Cached pages go, changes not stored go too — noted for the next
    /// `sync` if `note` (not when whoever found the loss was told already: a commit or a
    /// write-back that failed with `ESTALE`, which its `sync` reports).
    fn lose(&self, note: bool) {
        let mut st = self.st.lock();
        while st.revoking {
            self.cv.wait(&mut st);
        }
        // (Looked at after the wait: a loss that ran meanwhile may have taken it.)
        let Some(held) = st.held else { return };
        st.revoking = true;
        while st.pins > 0 {
            self.cv.wait(&mut st);
        }
        drop(st);
        let parties = self.parties();
        if let Some(h) = &parties.holder {
            h.discarding(true);
        }
        for c in &parties.caches {
            // Dirty pages are written back into the holder, which drops them, so that the
            // caches can drop every page (a dirty page would stay, and be written back
            // under the next token over what another machine stored).
            let _ = c.write_back();
        }
        for c in &parties.caches {
            let _ = c.drop_cached();
        }
        if let Some(h) = &parties.holder {
            // Its own cached object's pages too (a closed file's, with no group).
            let _ = h.drop_cached();
            h.discarding(false);
        }
        let mut st = self.st.lock();
        st.held = None;
        st.epoch += 1;
        st.lost_changes |= note && held == Mode::Write;
        st.revoking = false;
        self.cv.notify_all();
        drop(st);
        drop(parties);
    }

    /// Give the token up (the file is closed everywhere on this machine: its holder is
    /// being dropped, after storing its changes, or was dropped and the token kept for a
    /// while: `SharedFs::kept`) — unless a new holder of the file took the token over
    /// meanwhile. Best effort: a failure leaves the key to the lease.
    pub(crate) fn leave(&self) {
        let mut st = self.st.lock();
        while st.revoking || st.acquiring {
            self.cv.wait(&mut st);
        }
        // (Counted, not upgraded: a reference dropped here could be that holder's last.)
        if self.holder.lock().strong_count() > 0 {
            return;
        }
        let Some(held) = st.held.take() else { return };
        // Pins wait until the key is gone: a new holder's acquisition must not put its key
        // before this deletes (it would delete that one).
        st.revoking = true;
        drop(st);
        if let Some(m) = self.machine.upgrade() {
            let _ = m.set_key(self.ino, held, None);
        }
        let mut st = self.st.lock();
        st.epoch += 1;
        st.revoking = false;
        self.cv.notify_all();
    }
}

impl Remote for Token {
    fn pin(self: Arc<Self>, mode: Mode) -> io::Result<RemotePin> {
        self.pin_arc(mode)?;
        Ok(RemotePin::new(Box::new(Pinned(self))))
    }

    fn pin_for_sync(self: Arc<Self>) -> io::Result<Option<RemotePin>> {
        let mut st = self.st.lock();
        while st.revoking || st.acquiring {
            self.cv.wait(&mut st);
        }
        if std::mem::take(&mut st.lost_changes) {
            // ESTALE, as NFS reports state lost with a server's lease: another machine may
            // have the file now, and what this one had not stored is gone.
            return Err(io::Error::from_raw_os_error(libc::ESTALE));
        }
        if st.held != Some(Mode::Write) {
            return Ok(None);
        }
        st.pins += 1;
        drop(st);
        Ok(Some(RemotePin::new(Box::new(Pinned(self)))))
    }

    fn attach(&self, cache: Weak<dyn RemoteCache>) {
        self.caches.lock().push(cache);
    }

    fn locks(
        &self,
        flock: bool,
        held: Option<&[RemoteLock]>,
        want: &[RemoteLock],
        may_lag: bool,
    ) -> io::Result<Option<RemoteLock>> {
        let m = self.machine.upgrade().ok_or_else(|| io::Error::other("the layer is gone"))?;
        m.locks(self.ino, flock, held, want, may_lag)
    }

    fn await_locks(&self, flock: bool, timeout: Duration) {
        match self.machine.upgrade() {
            Some(m) => m.await_locks(self.ino, flock, timeout),
            None => std::thread::sleep(timeout.min(Duration::from_millis(20))),
        }
    }
}

/// `K l/<ino>/<kind>/<machine>`'s value: one line per lock, `x|s START END PID` (exclusive or
/// shared; END exclusive, decimal).
fn encode_locks(l: &[RemoteLock]) -> String {
    l.iter()
        .map(|x| format!("{} {} {} {}\n", if x.exclusive { 'x' } else { 's' }, x.range.start, x.range.end, x.pid))
        .collect()
}

/// The locks of a value [`encode_locks`] made; a line it cannot read counts as an exclusive
/// lock of every byte (never fewer conflicts than meant).
fn decode_locks(v: &[u8]) -> Vec<RemoteLock> {
    let all = RemoteLock { range: 0..u64::MAX, exclusive: true, pid: 0 };
    String::from_utf8_lossy(v)
        .lines()
        .filter(|l| !l.is_empty())
        .map(|line| {
            let f: Vec<&str> = line.split(' ').collect();
            let n = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok());
            match (f.first().copied(), n(1), n(2), n(3)) {
                (Some(k @ ("x" | "s")), Some(a), Some(b), Some(pid)) if a < b => {
                    RemoteLock { range: a..b, exclusive: k == "x", pid: pid as u32 }
                }
                _ => all.clone(),
            }
        })
        .collect()
}

//! ubc — a user-space unified buffer cache.
//!
//! File data from any backing store ([`Pager`]) is cached once, in one pool of pages under
//! one memory budget ([`Cache`]), and that copy serves `read_at`/`write_at`, zero-copy
//! [`Window`]s and memory [`Mapping`]s ([`File::map`]: faults resolved by the cache through
//! userfaultfd). See `docs/design.md` for the architecture and the
//! sources each mechanism comes from (NetBSD UBC, Mach external pagers, Linux `mm/`).
//!
//! ```no_run
//! use ubc::{Cache, Access};
//! let cache = Cache::new(64 << 20)?;                 // 64 MiB for every file
//! let f = cache.create_path("/tmp/example.dat")?;
//! f.write_at(b"hello, unified cache", 0)?;
//! let mut buf = [0u8; 5];
//! f.read_at(&mut buf, 0)?;
//! assert_eq!(&buf, b"hello");
//! f.sync()?;                                          // durable on the host file
//! println!("{}", cache.stats());
//! # Ok::<(), ubc::Error>(())
//! ```

mod advice;
mod cache;
mod error;
mod errseq;
mod file;
mod huge;
mod io;
mod map;
mod mapping;
mod memfd;
mod object;
pub mod order;
mod page;
pub mod pager;
mod resources;
mod stats;
#[cfg(feature = "testing")]
pub mod testing;
mod window;

/// Page replacement policies (the `ubc-evict` crate): what a cache is configured with and
/// what a policy of one's own implements. The simulator and its workload generators are
/// test tooling (feature `testing`).
pub mod evict {
    #[cfg(feature = "testing")]
    pub use ubc_evict::sim;
    pub use ubc_evict::{
        Admission, Clock, EvictAttempt, EvictionPolicy, NO_SLOT, PageKey, PageProbe, PolicyKind, S3Fifo, S3FifoParams,
        Sieve, Slot, UnknownPolicy,
    };
}

pub use advice::Advice;
pub use cache::{Cache, CacheBuilder};
pub use error::{Error, PagerOp, Result};
pub use file::{File, Window, WindowMut, WriteSync};
pub use huge::HugePages;
pub use mapping::Mapping;
pub use memfd::Sharing;
pub use object::{Length, Watcher, WritebackHook};
pub use pager::file::Access;
pub use pager::{FaultGuard, Fill, Identity, IoMode, Pager, PagerRequest, Seek};
pub use stats::{CacheStats, Stats};

/// The README's examples are compiled and run as doctests.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

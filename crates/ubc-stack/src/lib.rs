//! Stackable layers over the ubc cache, kept coherent by one cache manager.
//!
//! A [`Stack`] is built from layers (`dir | aead | zstd`, see [`Stack::open`]); every layer
//! stays reachable ([`Stack::layer`]) and a file can be used through any number of them at
//! once — cleartext written at the top is the ciphertext read at the bottom, a restore at
//! the bottom is what the top reads next, mappings included — because all layers share one
//! cache and the cache manager ([`coherence`]) keeps their views coherent.
//!
//! ```
//! use ubc_stack::{encrypt::Key, Stack};
//! # let tmp = tempfile::tempdir().unwrap();
//! # let dir = tmp.path();
//! # let data = dir.join("data");
//! # std::fs::create_dir(&data).unwrap();
//! Key::generate().write_file(&dir.join("key"))?;
//! let spec = format!("dir:{} | aead:keyfile={} | zstd:level=3", data.display(), dir.join("key").display());
//! let stack = Stack::open(&spec, ubc::Cache::new(256 << 20)?)?;
//! let top = stack.top().create("notes.txt")?;          // cleartext at the top
//! top.write_at(b"meet at noon", 0)?;                     // no sync
//! let disk = stack.layer(0)?.open("notes.txt")?;         // the bytes the dir layer stores
//! let mut stored = vec![0u8; disk.len()? as usize];
//! disk.read_exact_at(&mut stored, 0)?;                   // current ciphertext of the compressed
//!                                                        // text (compress, then encrypt)
//! assert!(!stored.windows(4).any(|w| w == b"noon"));     // and no cleartext reaches the disk
//! # assert!(stored.len() > 12);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod coherence;
pub mod compress;
#[cfg(feature = "etcd")]
pub(crate) mod dist;
pub mod encrypt;
mod error;
pub mod layer;
mod spec;
mod stack;
mod sync;

pub use coherence::{CoherenceStats, LowerWrites, Translate};
#[cfg(feature = "etcd")]
pub use dist::DistStats;
pub use error::{Error, Result};
pub use layer::{Attr, DirEntry, Kind, Layer, Rename, SetAttr};
pub use spec::s3_layers;
pub use stack::{
    Change, ChangeWatcher, Coherence, File, LayerRef, LockConflict, LockKind, LockOwner, LockWait, Mapping,
    OpenOptions, Stack, StackBuilder,
};

//! Stackable layers over the ubc cache, kept coherent by one cache manager.
//!
//! A [`Stack`] is built from layers (`dir | zstd | aead`, see [`Stack::open`]); every layer
//! stays reachable ([`Stack::layer`]) and a file can be used through any number of them at
//! once — cleartext written at the top is the ciphertext read at the bottom, a restore at
//! the bottom is what the top reads next, mappings included — because all layers share one
//! cache and the cache manager ([`coherence`]) keeps their views coherent.
//!
//! ```no_run
//! use ubc_stack::Stack;
//! let cache = ubc::Cache::new(256 << 20)?;
//! let stack = Stack::open("dir:/tmp/data | zstd | aead:keyfile=/tmp/key", cache)?;
//! let f = stack.top().create("notes.txt")?;
//! f.write_at(b"secret", 0)?;
//! f.sync()?;
//! let stored = stack.layer(0)?.open("notes.txt")?; // the ciphertext, current
//! # Ok::<(), ubc_stack::Error>(())
//! ```

pub mod coherence;
pub mod compress;
pub mod encrypt;
mod error;
pub mod layer;
mod spec;
mod stack;

pub use coherence::{CoherenceStats, Translate};
pub use error::{Error, Result};
pub use layer::{Attr, DirEntry, Kind, Layer, SetAttr};
pub use stack::{File, LayerRef, LockKind, Mapping, OpenOptions, Stack, StackBuilder};

//! Typed errors. Every failure a caller can act on has its own variant; I/O errors from a
//! pager keep the operation and offset they happened at.

use std::io;

/// What went wrong in a ubc operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The pager (backing store) failed while reading, writing, resizing or syncing.
    #[error("{op} at offset {offset} of {object}: {source}")]
    Io {
        op: PagerOp,
        offset: u64,
        object: String,
        #[source]
        source: io::Error,
    },
    /// An earlier writeback of the file failed — in the background, or reported to another
    /// handle — and this handle had not been told yet (see `errseq.rs`). `lost`: the
    /// pager's sync failed, so data written before it may not be durable (retrying the sync
    /// is not enough: write it again). Otherwise the pages are still dirty in the cache and
    /// will be retried; `sync` to know whether they reach the store.
    #[error("{object}: {}{op} failed earlier: {source}", if *lost { "data may be lost: " } else { "dirty pages not written back: " })]
    WritebackFailed {
        op: PagerOp,
        object: String,
        #[source]
        source: io::Error,
        lost: bool,
    },
    /// The file ends at `offset`, before all the bytes asked for (`read_exact_at`).
    #[error("{object}: unexpected end of file at offset {offset}")]
    UnexpectedEof { object: String, offset: u64 },
    /// A layer's own metadata (an aead header, a zstd index) could not be written or read
    /// back while the stack kept its layers coherent; `action` says which.
    #[error("{action} a layer's metadata: {source}")]
    LayerMetadata {
        action: &'static str,
        #[source]
        source: io::Error,
    },
    /// Opening a host file failed.
    #[error("open {path}: {source}")]
    Open {
        path: std::path::PathBuf,
        #[source]
        source: io::Error,
    },
    /// `offset + len` is past the largest file offset ubc supports (2^63 - 64 KiB, or the
    /// process's `RLIMIT_FSIZE` if that is lower).
    #[error(
        "offset {offset} + length {len} is past the largest supported file offset (2^63 - 64 KiB, or the process's RLIMIT_FSIZE)"
    )]
    OffsetOverflow { offset: u64, len: u64 },
    /// The file handle was closed with [`File::close`](crate::File::close).
    #[error("file handle is closed")]
    Closed,
    /// A write, resize or writable window on a file opened read-only.
    #[error("file is read-only")]
    ReadOnly,
    /// The request needs more pages pinned at once than the budget holds.
    #[error("request needs {needed} bytes resident at once but the cache budget is {budget} bytes")]
    BudgetExceeded { needed: u64, budget: u64 },
    /// A bad argument or configuration value.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The host refused a resource ubc needs (memfd, mapping); carries the call that failed.
    #[error("{call}: {source}")]
    Os {
        call: &'static str,
        #[source]
        source: io::Error,
    },
}

/// The pager call an [`Error::Io`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PagerOp {
    GetPages,
    PutPages,
    Len,
    SetLen,
    Sync,
    WriteThrough,
    Punch,
    Allocate,
    Seek,
    /// Asking the pager for leave to change a range it locked (`Pager::unlock_request`).
    Unlock,
    /// Asking the pager for what a mapping's fault needs first (`Pager::fault_guard`).
    Fault,
}

impl PagerOp {
    /// Whether the call changes the store (what a later sync must make durable).
    pub(crate) fn changes_store(self) -> bool {
        matches!(self, PagerOp::PutPages | PagerOp::SetLen | PagerOp::WriteThrough | PagerOp::Punch | PagerOp::Allocate)
    }
}

impl std::fmt::Display for PagerOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PagerOp::GetPages => "reading pages",
            PagerOp::PutPages => "writing back pages",
            PagerOp::Len => "getting length",
            PagerOp::SetLen => "setting length",
            PagerOp::Sync => "syncing",
            PagerOp::WriteThrough => "writing through to the store",
            PagerOp::Punch => "punching a hole",
            PagerOp::Allocate => "reserving space",
            PagerOp::Seek => "seeking data or holes",
            PagerOp::Unlock => "asking the pager to unlock a range",
            PagerOp::Fault => "preparing a mapping's fault",
        })
    }
}

impl Error {
    /// The OS error number behind this error, if there is one (EIO, ENOSPC, ...).
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. }
            | Error::Os { source, .. }
            | Error::Open { source, .. }
            | Error::WritebackFailed { source, .. }
            | Error::LayerMetadata { source, .. } => source.raw_os_error(),
            Error::UnexpectedEof { .. } => None,
            Error::OffsetOverflow { .. } => Some(libc::EFBIG),
            Error::Closed => Some(libc::EBADF),
            Error::ReadOnly => Some(libc::EBADF),
            Error::BudgetExceeded { .. } => Some(libc::ENOMEM),
            Error::InvalidArgument(_) => Some(libc::EINVAL),
        }
    }

    /// A pager's read failed as interrupted: the bytes were changing underneath, ask again
    /// (see [`Pager::get_pages`](crate::Pager::get_pages)).
    pub(crate) fn is_interrupted(&self) -> bool {
        matches!(self, Error::Io { source, .. } if source.kind() == io::ErrorKind::Interrupted)
    }

    pub(crate) fn os(call: &'static str, e: impl Into<io::Error>) -> Error {
        Error::Os { call, source: e.into() }
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        let kind = match &e {
            Error::Io { source, .. }
            | Error::Os { source, .. }
            | Error::Open { source, .. }
            | Error::WritebackFailed { source, .. }
            | Error::LayerMetadata { source, .. } => source.kind(),
            Error::UnexpectedEof { .. } => io::ErrorKind::UnexpectedEof,
            Error::OffsetOverflow { .. } => io::ErrorKind::FileTooLarge,
            Error::Closed => io::ErrorKind::Other,
            Error::ReadOnly => io::ErrorKind::PermissionDenied,
            Error::BudgetExceeded { .. } => io::ErrorKind::OutOfMemory,
            Error::InvalidArgument(_) => io::ErrorKind::InvalidInput,
        };
        // Keep ubc's context in the message; callers that need the errno can downcast
        // (`io_err.get_ref().and_then(|e| e.downcast_ref::<ubc::Error>())`).
        io::Error::new(kind, e)
    }
}

/// Result type of ubc operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

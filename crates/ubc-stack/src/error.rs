//! Errors of stacks and layers: typed, with the path and the layer they concern.

use std::io;

/// A stack operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O error from a layer's store, with the path it concerns.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
    /// The cache failed (pager error, budget, closed handle, …); for data read through an
    /// encryption layer, an authentication failure arrives here as an `Io` error of kind
    /// `InvalidData` (see [`Error::is_auth`]).
    #[error(transparent)]
    Cache(#[from] ubc::Error),
    #[error("{0}: no such file or directory")]
    NotFound(String),
    #[error("{0}: file exists")]
    Exists(String),
    #[error("{0}: not a directory")]
    NotDir(String),
    #[error("{0}: is a directory")]
    IsDir(String),
    #[error("{0}: directory not empty")]
    NotEmpty(String),
    #[error("{0}: read-only layer")]
    ReadOnly(String),
    /// The layer cannot do this (a hard link in a memory tree, a `system.*` extended
    /// attribute such as an ACL through an encryption layer, which the kernel could not
    /// enforce from an encrypted value).
    #[error("{0}: not supported by this layer")]
    NotSupported(String),
    /// A move the layer cannot make in one step (a union's lower directory): callers copy.
    #[error("{0}: cannot be moved in one step")]
    CrossDevice(String),
    /// A name longer than `NAME_MAX` or a path longer than `PATH_MAX`.
    #[error("{0}")]
    NameTooLong(String),
    /// A bad argument or spec.
    #[error("{0}")]
    Invalid(String),
    /// A stack spec string could not be parsed.
    #[error("stack spec: {0}")]
    Spec(String),
}

/// Result of stack operations.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wrap an I/O error from `path`, mapping the common kinds to typed variants.
    pub fn io(path: &str, source: io::Error) -> Error {
        let p = if path.is_empty() { "/".to_string() } else { path.to_string() };
        match source.kind() {
            io::ErrorKind::NotFound => Error::NotFound(p),
            io::ErrorKind::AlreadyExists => Error::Exists(p),
            io::ErrorKind::NotADirectory => Error::NotDir(p),
            io::ErrorKind::IsADirectory => Error::IsDir(p),
            io::ErrorKind::DirectoryNotEmpty => Error::NotEmpty(p),
            _ => Error::Io { path: p, source },
        }
    }

    /// Whether this is an authentication failure (tampered, truncated, reordered or
    /// swapped ciphertext; wrong key) from an encryption layer.
    pub fn is_auth(&self) -> bool {
        let mut e: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(x) = e {
            if x.is::<crate::encrypt::AuthError>() {
                return true;
            }
            if let Some(io) = x.downcast_ref::<io::Error>()
                && io.get_ref().is_some_and(|i| i.is::<crate::encrypt::AuthError>())
            {
                return true;
            }
            e = x.source();
        }
        false
    }

    /// The errno closest to this error (for FUSE and the C API).
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            // The store's own errno where there is one (ENOSPC at writeback stays ENOSPC);
            // EIO for failures without one (authentication, an early end of file).
            Error::Cache(e) => e.raw_os_error().unwrap_or(libc::EIO),
            Error::NotFound(_) => libc::ENOENT,
            Error::Exists(_) => libc::EEXIST,
            Error::NotDir(_) => libc::ENOTDIR,
            Error::IsDir(_) => libc::EISDIR,
            Error::NotEmpty(_) => libc::ENOTEMPTY,
            Error::ReadOnly(_) => libc::EROFS,
            Error::NameTooLong(_) => libc::ENAMETOOLONG,
            Error::NotSupported(_) => libc::EOPNOTSUPP,
            Error::CrossDevice(_) => libc::EXDEV,
            Error::Invalid(_) | Error::Spec(_) => libc::EINVAL,
        }
    }
}

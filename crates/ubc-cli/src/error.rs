//! The command's one error type: a one-line message (`ubc: <path>: <cause>`) and an exit
//! status from `sysexits.h`.

use std::fmt;
use ubc_stack::Error;

/// Exit statuses (sysexits.h).
pub const EX_USAGE: i32 = 64;
pub const EX_DATAERR: i32 = 65;
pub const EX_NOINPUT: i32 = 66;
pub const EX_UNAVAILABLE: i32 = 69;
pub const EX_SOFTWARE: i32 = 70;
pub const EX_CANTCREAT: i32 = 73;
pub const EX_IOERR: i32 = 74;

/// A failed command: what to print and how to exit.
#[derive(Debug)]
pub struct Fail {
    pub code: i32,
    pub path: String,
    pub cause: String,
}

pub type Result<T, E = Fail> = std::result::Result<T, E>;

/// Which side of an operation a path is on: it decides between EX_NOINPUT and EX_CANTCREAT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Input,
    Output,
}

impl Fail {
    pub fn new(code: i32, path: impl Into<String>, cause: impl Into<String>) -> Fail {
        Fail { code, path: path.into(), cause: cause.into() }
    }

    pub fn usage(path: impl Into<String>, cause: impl Into<String>) -> Fail {
        Fail::new(EX_USAGE, path, cause)
    }

    /// A stack error about `path` (as the user named it).
    pub fn stack(side: Side, path: &str, e: Error) -> Fail {
        if let Some(a) = ubc_stack::encrypt::AuthError::find(&e) {
            return Fail::new(EX_DATAERR, path, format!("authentication failed ({a})"));
        }
        let (code, cause) = match &e {
            Error::NotFound(_) | Error::NotDir(_) => (side.missing(), e_cause(&e)),
            Error::Exists(_) | Error::IsDir(_) | Error::NotEmpty(_) => (side.missing(), e_cause(&e)),
            Error::ReadOnly(_) => (EX_CANTCREAT, e_cause(&e)),
            Error::Spec(s) => (EX_USAGE, format!("bad stack spec: {s}")),
            Error::Invalid(s) => (EX_USAGE, s.clone()),
            Error::Io { source, .. } => (io_code(side, source), source.to_string()),
            Error::Cache(
                ubc::Error::Io { .. }
                | ubc::Error::Open { .. }
                | ubc::Error::Os { .. }
                | ubc::Error::WritebackFailed { .. },
            ) => (EX_IOERR, e.to_string()),
            Error::Cache(c) => (EX_SOFTWARE, c.to_string()),
            _ => (EX_SOFTWARE, e.to_string()),
        };
        Fail::new(code, path, cause)
    }

    /// A host I/O error about `path`.
    pub fn io(side: Side, path: &str, e: std::io::Error) -> Fail {
        Fail::new(io_code(side, &e), path, io_cause(&e))
    }
}

impl Side {
    fn missing(self) -> i32 {
        match self {
            Side::Input => EX_NOINPUT,
            Side::Output => EX_CANTCREAT,
        }
    }
}

fn io_code(side: Side, e: &std::io::Error) -> i32 {
    use std::io::ErrorKind::*;
    match e.kind() {
        NotFound | NotADirectory | IsADirectory | PermissionDenied | AlreadyExists | ReadOnlyFilesystem => {
            side.missing()
        }
        _ => EX_IOERR,
    }
}

/// The path a stack error carries, if any.
pub fn error_path(e: &Error) -> Option<&str> {
    match e {
        Error::NotFound(p)
        | Error::Exists(p)
        | Error::NotDir(p)
        | Error::IsDir(p)
        | Error::NotEmpty(p)
        | Error::ReadOnly(p) => Some(p),
        Error::Io { path, .. } => Some(path),
        _ => None,
    }
}

/// The cause of a typed stack error without the path it carries (the message names the
/// path as the user wrote it).
fn e_cause(e: &Error) -> String {
    match e {
        Error::NotFound(_) => "no such file or directory".into(),
        Error::Exists(_) => "file exists".into(),
        Error::NotDir(_) => "not a directory".into(),
        Error::IsDir(_) => "is a directory".into(),
        Error::NotEmpty(_) => "directory not empty".into(),
        Error::ReadOnly(_) => "read-only layer".into(),
        e => e.to_string(),
    }
}

/// `std::io::Error`'s text without the " (os error N)" suffix, lower-cased like the rest.
pub fn io_cause(e: &std::io::Error) -> String {
    let s = e.to_string();
    let s = match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    };
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_lowercase().chain(c).collect(),
        None => s,
    }
}

impl fmt::Display for Fail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // One line, always.
        let cause = self.cause.replace('\n', " ");
        if self.path.is_empty() { write!(f, "{cause}") } else { write!(f, "{}: {cause}", self.path) }
    }
}

/// Attach a path to stack results.
pub trait Ctx<T> {
    fn input(self, path: &str) -> Result<T>;
    fn output(self, path: &str) -> Result<T>;
}

impl<T> Ctx<T> for ubc_stack::Result<T> {
    fn input(self, path: &str) -> Result<T> {
        self.map_err(|e| Fail::stack(Side::Input, path, e))
    }
    fn output(self, path: &str) -> Result<T> {
        self.map_err(|e| Fail::stack(Side::Output, path, e))
    }
}

impl<T> Ctx<T> for std::io::Result<T> {
    fn input(self, path: &str) -> Result<T> {
        self.map_err(|e| Fail::io(Side::Input, path, e))
    }
    fn output(self, path: &str) -> Result<T> {
        self.map_err(|e| Fail::io(Side::Output, path, e))
    }
}

impl<T> Ctx<T> for ubc::Result<T> {
    fn input(self, path: &str) -> Result<T> {
        self.map_err(|e| Fail::stack(Side::Input, path, e.into()))
    }
    fn output(self, path: &str) -> Result<T> {
        self.map_err(|e| Fail::stack(Side::Output, path, e.into()))
    }
}

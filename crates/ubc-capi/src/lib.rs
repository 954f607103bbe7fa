//! C API (in progress).

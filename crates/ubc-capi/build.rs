//! The shared library's SONAME: `libubc.so.MAJOR`, the name `scripts/install-c` installs it
//! under (with `libubc.so.MAJOR.MINOR.PATCH` the file and `libubc.so` the link-time name), so
//! that programs linked against it load the installed file whatever cargo called it.
//! Programs linked against the build tree's `libubc_capi.so` need a `libubc.so.MAJOR` link to
//! it beside them (see `tests/c.rs`).

fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").expect("cargo sets CARGO_PKG_VERSION_MAJOR");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libubc.so.{major}");
    println!("cargo:rerun-if-changed=build.rs");
}

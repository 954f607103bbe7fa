//! Compiles the C programs in `tests/c/` (and `examples/c/wc.c`) with the system `cc`
//! against the cdylib `cargo test -p ubc-capi` builds (`target/<profile>/deps/libubc_capi.so`,
//! the crate being a cdylib too), and runs them (loading it by its SONAME, `libubc.so.0`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `target/<profile>/deps`, where the test binary lives: `cargo test` builds the cdylib there
/// (it copies it up to `target/<profile>` only on `cargo build`, so that copy may be stale).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().to_path_buf();
    assert!(dir.join("libubc_capi.so").exists(), "{} has no libubc_capi.so", dir.display());
    dir
}

/// Compile `src` to `out/name`; returns the executable. The library's SONAME is the
/// installed name (`libubc.so.0`, see `build.rs`): the program finds it through a link of that
/// name to the build tree's `libubc_capi.so`, made in `out`.
fn compile(src: &Path, out: &Path, name: &str, opt: &str) -> PathBuf {
    let exe = out.join(name);
    let lib = lib_dir();
    let soname = out.join(format!("libubc.so.{}", env!("CARGO_PKG_VERSION_MAJOR")));
    if !soname.exists() {
        std::os::unix::fs::symlink(lib.join("libubc_capi.so"), &soname).unwrap();
    }
    let o = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", opt])
        .arg("-I")
        .arg(crate_dir().join("include"))
        .arg("-I")
        .arg(crate_dir().join("tests/c"))
        .arg(src)
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib)
        .arg("-lubc_capi")
        .arg(format!("-Wl,-rpath,{}", out.display()))
        .output()
        .expect("run cc");
    assert!(o.status.success(), "cc {} failed:\n{}", src.display(), String::from_utf8_lossy(&o.stderr));
    exe
}

fn run(exe: &Path, args: &[&Path]) -> String {
    let o = Command::new(exe).args(args).output().expect("run test program");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{} failed ({}):\nstdout:\n{out}\nstderr:\n{}",
        exe.display(),
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

#[test]
fn basic() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let key = tmp.path().join("key");
    ubc_stack::encrypt::Key::generate().write_file(&key).unwrap();
    let exe = compile(&crate_dir().join("tests/c/basic.c"), tmp.path(), "basic", "-O1");
    let out = run(&exe, &[&data, &key]);
    assert!(out.contains("basic ok"), "{out}");
    // Nothing readable reached the disk.
    let stored = std::fs::read(data.join("hello.txt")).unwrap();
    assert!(!stored.windows(4).any(|w| w == b"meet"));
}

#[test]
fn stdio() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let exe = compile(&crate_dir().join("tests/c/stdio.c"), tmp.path(), "stdio", "-O1");
    let out = run(&exe, &[&data]);
    assert!(out.contains("stdio ok"), "{out}");
}

#[test]
fn table_6_1() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    // 8 MiB of text-like bytes.
    let mut x: u32 = 0x1234_5678;
    let bytes: Vec<u8> = (0..8 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            b"abcdefgh ijklmnop\nqrstuvwxyz 0123"[(x % 32) as usize]
        })
        .collect();
    std::fs::write(data.join("big.txt"), &bytes).unwrap();
    let exe = compile(&crate_dir().join("tests/c/table61.c"), tmp.path(), "table61", "-O2");
    let out = run(&exe, &[&data, Path::new("big.txt")]);
    println!("{out}");
    assert!(out.contains("checksums agree"), "{out}");
    let sums: Vec<&str> = out.lines().filter_map(|l| l.split("checksum ").nth(1)).collect();
    assert_eq!(sums.len(), 6);
    assert!(sums.iter().all(|s| *s == sums[0]), "{out}");
}

#[test]
fn wc_example() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("t.txt"), "one two  three\nfour\n\n five six\nseven").unwrap();
    let src = crate_dir().join("../../examples/c/wc.c");
    let exe = compile(&src, tmp.path(), "wc", "-O2");
    let spec = format!("dir:{}", data.display());
    for extra in [None, Some("--fmap")] {
        let mut c = Command::new(&exe);
        c.arg(&spec).arg("t.txt");
        if let Some(e) = extra {
            c.arg(e);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(String::from_utf8_lossy(&o.stdout), "4 7 36 t.txt\n");
    }
    // A missing file: exit 1 and the path in the message.
    let o = Command::new(&exe).arg(&spec).arg("missing.txt").output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("missing.txt") && err.contains("No such file"), "{err}");
}

/// The README's C example (the block after its `<!-- readme-example: c -->` marker, the one
/// `scripts/test-install` builds against an installed library), compiled and run as written.
#[test]
fn readme_example() {
    let readme = std::fs::read_to_string(crate_dir().join("../../README.md")).unwrap();
    let marker = readme.find("<!-- readme-example: c -->").expect("the C example's marker in the README");
    let start = marker + readme[marker..].find("```c\n").expect("a ```c block after the marker") + 5;
    let end = start + readme[start..].find("```").unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("readme.c");
    std::fs::write(&src, &readme[start..end]).unwrap();
    let exe = compile(&src, tmp.path(), "readme", "-O1");
    run(&exe, &[]);
}

#[test]
fn writeback_hook() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let exe = compile(&crate_dir().join("tests/c/hook.c"), tmp.path(), "hook", "-O1");
    let out = run(&exe, &[&data]);
    assert!(out.contains("hook ok"), "{out}");
}

#[test]
fn fadvise() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let exe = compile(&crate_dir().join("tests/c/advise.c"), tmp.path(), "advise", "-O1");
    let out = run(&exe, &[&data]);
    assert!(out.contains("advise ok"), "{out}");
}

/// The S3 server `./scripts/test` starts (`UBC_TEST_S3_ENDPOINT`, `UBC_TEST_S3_BUCKET`), as
/// a spec prefix `s3:BUCKET/PREFIX?endpoint=URL`, or `None` (the test skips, unless
/// `UBC_TEST_S3_REQUIRED=1`).
fn s3_spec(test: &str) -> Option<String> {
    match (std::env::var("UBC_TEST_S3_ENDPOINT"), std::env::var("UBC_TEST_S3_BUCKET")) {
        (Ok(e), Ok(b)) => {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
            Some(format!("s3:{b}/capi-{test}-{}-{t}?endpoint={e}&chunk=64K", std::process::id()))
        }
        _ => {
            assert!(
                std::env::var("UBC_TEST_S3_REQUIRED").as_deref() != Ok("1"),
                "{test}: UBC_TEST_S3_REQUIRED=1 but no S3 server"
            );
            eprintln!("SKIP {test}: no S3 server (run ./scripts/test, which starts one)");
            None
        }
    }
}

#[test]
fn s3_through_the_c_api() {
    let Some(spec) = s3_spec("plain") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile(&crate_dir().join("tests/c/s3.c"), tmp.path(), "s3", "-O1");
    let o = Command::new(&exe).args([spec.as_str(), "plain"]).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("s3 plain ok"), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
}

/// Two caches of one process, each with its own stack over one `s3:…?etcd=…` file system
/// (two machines), through the C API.
#[cfg(feature = "etcd")]
#[test]
fn s3_shared_between_machines_through_the_c_api() {
    let Some(spec) = s3_spec("shared") else { return };
    let Ok(etcd) = std::env::var("UBC_TEST_ETCD") else {
        assert!(std::env::var("UBC_TEST_ETCD_REQUIRED").as_deref() != Ok("1"), "UBC_TEST_ETCD_REQUIRED=1 but no etcd");
        eprintln!("SKIP s3_shared_between_machines_through_the_c_api: no etcd (UBC_TEST_ETCD)");
        return;
    };
    let spec = format!("{spec}&etcd={etcd}");
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile(&crate_dir().join("tests/c/s3.c"), tmp.path(), "s3", "-O1");
    let o = Command::new(&exe).args([spec.as_str(), "shared"]).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("s3 shared ok"), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
}

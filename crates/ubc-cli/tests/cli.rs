//! The real `ubc` binary on real temporary directories.

use assert_cmd::Command;
use predicates::prelude::*;
use std::path::Path;

fn ubc() -> Command {
    Command::cargo_bin("ubc").unwrap()
}

/// A temp dir with `data/` and a key, and the spec `dir | zstd | aead` over them.
fn setup() -> (tempfile::TempDir, String) {
    let t = tempfile::tempdir().unwrap();
    std::fs::create_dir(t.path().join("data")).unwrap();
    ubc().arg("keygen").arg(t.path().join("key")).assert().success();
    let spec =
        format!("dir:{} | zstd | aead:keyfile={}", t.path().join("data").display(), t.path().join("key").display());
    (t, spec)
}

fn sample(len: usize) -> Vec<u8> {
    (0..).flat_map(|i: u32| format!("line {i}: the quick brown fox\n").into_bytes()).take(len).collect()
}

fn host(p: &Path) -> String {
    format!("host:{}", p.display())
}

#[test]
fn tour_prints_measured_sections() {
    let t = tempfile::tempdir().unwrap();
    let out = ubc().args(["tour", "--dir"]).arg(t.path()).assert().success().get_output().stdout.clone();
    let out = String::from_utf8(out).unwrap();
    for s in [
        "(a) one copy",
        "(b) a store through a mapping",
        "(c) cleartext at the top",
        "(d) eviction",
        "(e) read-ahead",
        "(f) statistics",
        "coherence",
        "STORED BY MMAP!",
    ] {
        assert!(out.contains(s), "missing {s:?} in:\n{out}");
    }
    // The work directory is cleaned up.
    assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 0);
}

#[test]
fn cp_round_trip_through_the_stack() {
    let (t, spec) = setup();
    let clear = sample(300_000);
    let src = t.path().join("in.txt");
    std::fs::write(&src, &clear).unwrap();
    ubc().args(["cp", "--stack", &spec, &host(&src), "f.txt"]).assert().success();
    let stored = std::fs::read(t.path().join("data/f.txt")).unwrap();
    assert_ne!(stored, clear);
    assert!(!stored.windows(15).any(|w| w == b"the quick brown"), "cleartext reached the disk");
    // stack → stack, then stack → host
    ubc().args(["cp", "--stack", &spec, "f.txt", "g.txt"]).assert().success();
    let back = t.path().join("back.txt");
    ubc().args(["cp", "--stack", &spec, "g.txt", &host(&back)]).assert().success();
    assert_eq!(std::fs::read(&back).unwrap(), clear);
}

#[test]
fn cp_recursive_and_ls() {
    let (t, spec) = setup();
    let tree = t.path().join("tree");
    std::fs::create_dir_all(tree.join("sub")).unwrap();
    std::fs::write(tree.join("a.txt"), b"alpha").unwrap();
    std::fs::write(tree.join("sub/b.txt"), b"beta").unwrap();
    ubc().args(["cp", "--stack", &spec, &host(&tree), "t"]).assert().success();
    ubc().args(["ls", "--stack", &spec]).assert().success().stdout("t/\n");
    ubc().args(["ls", "--stack", &spec, "t"]).assert().success().stdout("a.txt\nsub/\n");
    let out = t.path().join("out");
    ubc().args(["cp", "--stack", &spec, "t", &host(&out)]).assert().success();
    assert_eq!(std::fs::read(out.join("sub/b.txt")).unwrap(), b"beta");
    assert_eq!(std::fs::read(out.join("a.txt")).unwrap(), b"alpha");
}

#[test]
fn cat_prints_the_cleartext() {
    let (t, spec) = setup();
    let src = t.path().join("note");
    std::fs::write(&src, b"meet at noon\n").unwrap();
    ubc().args(["cp", "--stack", &spec, &host(&src), "note"]).assert().success();
    ubc().args(["cat", "--stack", &spec, "note"]).assert().success().stdout("meet at noon\n");
}

fn stat_size(spec: &str, layer: Option<&str>, path: &str) -> u64 {
    let mut c = ubc();
    c.args(["stat", "--stack", spec]);
    if let Some(l) = layer {
        c.args(["--layer", l]);
    }
    let out = String::from_utf8(c.arg(path).assert().success().get_output().stdout.clone()).unwrap();
    assert!(out.contains("kind: file") && out.contains("mode: 0644") && out.contains("mtime: "), "{out}");
    let line = out.lines().find(|l| l.trim_start().starts_with("size:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// `ubc stat` says which memory the cache's pages got: with `--huge-pages try`, hugetlb
/// where the test script reserved a pool, and the reason otherwise; `require` without any
/// huge-page path is a usage error.
#[test]
fn stat_reports_the_page_memory() {
    let (t, spec) = setup();
    let src = t.path().join("h");
    std::fs::write(&src, b"huge\n").unwrap();
    ubc().args(["cp", "--stack", &spec, &host(&src), "h"]).assert().success();
    let run = |huge: &str| {
        let o = ubc().args(["stat", "--stack", &spec, "--budget", "8", "--huge-pages", huge, "h"]).output().unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).to_string(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (ok, out, err) = run("never");
    assert!(ok, "{err}");
    assert!(out.contains(" pages: shmem, 4 KiB pages (huge pages not asked for)"), "{out}");
    let (ok, out, err) = run("try");
    assert!(ok, "{err}");
    let line = out.lines().find(|l| l.trim_start().starts_with("pages:")).unwrap();
    if std::env::var("UBC_TEST_HUGETLB").is_ok_and(|v| v == "1") {
        assert!(line.contains("hugetlb, 2 MiB pages"), "{line}");
    } else {
        assert!(line.contains("hugetlb"), "says why not hugetlb: {line}");
    }
    let (ok, _, err) = run("sometimes");
    assert!(!ok && err.contains("expected never, try or require"), "{err}");
}

#[test]
fn stat_top_is_cleartext_size_bottom_is_stored_size() {
    let (t, spec) = setup();
    let clear = sample(100_000);
    let src = t.path().join("in");
    std::fs::write(&src, &clear).unwrap();
    ubc().args(["cp", "--stack", &spec, &host(&src), "f"]).assert().success();
    assert_eq!(stat_size(&spec, None, "f"), clear.len() as u64);
    let stored = std::fs::metadata(t.path().join("data/f")).unwrap().len();
    assert_eq!(stat_size(&spec, Some("0"), "f"), stored);
    assert_ne!(stored, clear.len() as u64);
}

#[test]
fn missing_file_is_noinput() {
    let (_t, spec) = setup();
    ubc().args(["cat", "--stack", &spec, "no/such/file"]).assert().code(66).stdout("").stderr(
        predicate::str::starts_with("ubc: no/such/file: ")
            .and(predicate::str::ends_with("\n"))
            .and(predicate::function(|s: &str| s.lines().count() == 1)),
    );
    ubc()
        .args(["cp", "--stack", &spec, "host:/no/such/host/file", "x"])
        .assert()
        .code(66)
        .stderr(predicate::str::contains("/no/such/host/file"));
}

#[test]
fn bad_spec_is_usage() {
    ubc().args(["ls", "--stack", "dir:/tmp | frobnicate"]).assert().code(64).stderr(
        predicate::str::starts_with("ubc: ")
            .and(predicate::str::contains("frobnicate"))
            .and(predicate::function(|s: &str| s.lines().count() == 1)),
    );
    // clap's own usage errors use the same status.
    ubc().args(["cat"]).assert().code(64);
    ubc().args(["ls", "--stack", "dir:/tmp", "--layer", "5"]).assert().code(64);
}

#[test]
fn corrupted_ciphertext_is_dataerr() {
    // No zstd under the aead layer: the flipped byte is in the ciphertext itself.
    let t = tempfile::tempdir().unwrap();
    std::fs::create_dir(t.path().join("data")).unwrap();
    ubc().arg("keygen").arg(t.path().join("key")).assert().success();
    let spec = format!("dir:{} | aead:keyfile={}", t.path().join("data").display(), t.path().join("key").display());
    let src = t.path().join("in");
    std::fs::write(&src, sample(50_000)).unwrap();
    ubc().args(["cp", "--stack", &spec, &host(&src), "f"]).assert().success();
    ubc().args(["cat", "--stack", &spec, "f"]).assert().success();
    let stored = t.path().join("data/f");
    let mut b = std::fs::read(&stored).unwrap();
    let mid = b.len() / 2;
    b[mid] ^= 0x40;
    std::fs::write(&stored, &b).unwrap();
    ubc().args(["cat", "--stack", &spec, "f"]).assert().code(65).stderr(
        predicate::str::starts_with("ubc: f: authentication failed")
            .and(predicate::function(|s: &str| s.lines().count() == 1)),
    );
}

#[test]
fn unwritable_destination_is_cantcreat() {
    let (t, spec) = setup();
    let src = t.path().join("in");
    std::fs::write(&src, b"x").unwrap();
    ubc().args(["cp", "--stack", &spec, &host(&src), "no/dir/here"]).assert().code(73);
}

//! Differential POSIX conformance: the scripted operations of `tests/posix/conform.py`, with
//! their error cases, run as root and as an unprivileged user (uid 65534) on a directory of
//! the host's own file system and on a `ubc mount` of each stack; every case's observations
//! (return values, errno names, stat fields, time and inode relations) must be the host's.
//!
//! Cases the mount does not get right yet are listed in `tests/posix/expected-failures`
//! (`STACK CASE` per line): the test fails on a failure not listed *and* on a listed case
//! that now passes, so the list stays the truth. It prints the per-stack pass counts
//! (`docs/guarantees.md` quotes them).
//!
//! Needs root (to act as another user with `setpriv` and to give files away), `/dev/fuse`
//! and `fusermount3`, and a `python3` that uid 65534 may run; skips, saying so, without them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use ubc_cli::mounts::is_mounted;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/posix/conform.py");
const EXPECTED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/posix/expected-failures");

/// The stacks served, by name: the spec after `dir:DATA` (KEY: a key file, UPPER: a union's
/// upper directory).
const STACKS: &[(&str, &str)] = &[
    ("dir", ""),
    ("dir|zstd", " | zstd"),
    ("dir|aead", " | aead:keyfile=KEY"),
    ("dir|aead|zstd", " | aead:keyfile=KEY | zstd"),
    ("dir|union", " | union:upper=UPPER"),
];

/// A python3 that every user may run (a root-only pyenv shim is not one).
fn shared_python() -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let dirs = std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default();
    let cands = ["/usr/bin/python3", "/usr/local/bin/python3"].into_iter().map(PathBuf::from);
    cands.chain(dirs.into_iter().map(|d| d.join("python3"))).find(|p| {
        std::fs::metadata(p).is_ok_and(|m| m.permissions().mode() & 0o001 != 0)
            && !p.to_string_lossy().contains("/root/")
    })
}

fn can_run() -> Option<PathBuf> {
    // SAFETY: geteuid takes no arguments and always succeeds.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: the conformance test needs root (to run cases as another user)");
        return None;
    }
    if !Path::new("/dev/fuse").exists() || Command::new("fusermount3").arg("-V").output().is_err() {
        eprintln!("SKIP: /dev/fuse or fusermount3 is missing");
        return None;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("SKIP: setpriv is missing");
        return None;
    }
    let py = shared_python();
    if py.is_none() {
        eprintln!("SKIP: no python3 that uid 65534 may run");
    }
    py
}

/// Run the script's `phase` in `root` (as uid 65534 for "user"): case → observations.
fn run_phase(py: &Path, root: &Path, phase: &str) -> BTreeMap<String, String> {
    let mut cmd = if phase == "user" {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"]).arg(py);
        c
    } else {
        Command::new(py)
    };
    let out = cmd.arg(SCRIPT).arg(root).arg(phase).output().unwrap();
    assert!(out.status.success(), "conform.py {phase} in {}: {}", root.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (case, obs) = l.split_once('\t').expect("case\\tobservations");
            (case.to_string(), obs.to_string())
        })
        .collect()
}

/// Both phases in `root`.
fn run_all(py: &Path, root: &Path) -> BTreeMap<String, String> {
    let mut all = run_phase(py, root, "root");
    all.extend(run_phase(py, root, "user"));
    all
}

struct Mount {
    child: Child,
    mp: PathBuf,
    err: PathBuf,
}

impl Mount {
    fn start(spec: &str, layer: usize, mp: &Path, err: &Path) -> Mount {
        let child = Command::new(env!("CARGO_BIN_EXE_ubc"))
            .args(["mount", "--stack", spec, "--budget", "8", "--allow-other", "--at"])
            .arg(format!("{layer}:{}", mp.display()))
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(err).unwrap())
            .spawn()
            .unwrap();
        let mut m = Mount { child, mp: mp.to_path_buf(), err: err.to_path_buf() };
        let start = Instant::now();
        while !is_mounted(mp) {
            if let Some(st) = m.child.try_wait().unwrap() {
                panic!("ubc mount exited early: {st}: {}", std::fs::read_to_string(err).unwrap_or_default());
            }
            assert!(start.elapsed() < Duration::from_secs(20), "the mount did not appear");
            std::thread::sleep(Duration::from_millis(20));
        }
        m
    }

    /// Unmount; the daemon must exit 0.
    fn finish(mut self) {
        let st = Command::new("fusermount3").arg("-u").arg(&self.mp).status().unwrap();
        assert!(st.success(), "fusermount3 -u {}", self.mp.display());
        let start = Instant::now();
        let code = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st.code();
            }
            assert!(start.elapsed() < Duration::from_secs(30), "ubc mount did not exit");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(code, Some(0), "ubc mount exit status; stderr:\n{}", std::fs::read_to_string(&self.err).unwrap());
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if is_mounted(&self.mp) {
            let _ = Command::new("fusermount3").args(["-u", "-z", "-q"]).arg(&self.mp).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn expected_failures() -> BTreeSet<(String, String)> {
    std::fs::read_to_string(EXPECTED)
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (s, c) = l.split_once(char::is_whitespace).expect("STACK CASE");
            (s.to_string(), c.trim().to_string())
        })
        .collect()
}

#[test]
fn the_mount_answers_posix_calls_as_the_host_file_system_does() {
    let Some(py) = can_run() else { return };
    let t = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    // uid 65534 must reach the directories below.
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let host = t.path().join("host");
    std::fs::create_dir(&host).unwrap();
    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o755)).unwrap();
    let want = run_all(&py, &host);
    assert!(want.len() > 25, "the script ran only {} cases", want.len());
    let key = t.path().join("key");
    let st = Command::new(env!("CARGO_BIN_EXE_ubc")).arg("keygen").arg(&key).status().unwrap();
    assert!(st.success());

    let expected = expected_failures();
    let mut unexpected_failures = Vec::new();
    let mut unexpected_passes = Vec::new();
    let mut table = Vec::new();
    for (name, tail) in STACKS {
        let base = t.path().join(name.replace('|', "-"));
        let (data, upper, mp) = (base.join("data"), base.join("upper"), base.join("mnt"));
        for d in [&base, &data, &upper, &mp] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let spec = format!(
            "dir:{}{}",
            data.display(),
            tail.replace("KEY", &key.display().to_string()).replace("UPPER", &upper.display().to_string())
        );
        let m = Mount::start(&spec, name.matches('|').count(), &mp, &base.join("err"));
        let got = run_all(&py, &mp);
        m.finish();
        let mut passed = 0;
        for (case, obs) in &want {
            let ok = got.get(case) == Some(obs);
            let listed = expected.contains(&(name.to_string(), case.clone()));
            if ok {
                passed += 1;
            }
            match (ok, listed) {
                (false, false) => unexpected_failures.push(format!(
                    "{name} {case}\n    host: {obs}\n    ubc:  {}",
                    got.get(case).map_or("(not run)", String::as_str)
                )),
                (true, true) => unexpected_passes.push(format!("{name} {case}")),
                _ => {}
            }
        }
        table.push(format!("{name:>14}: {passed}/{} cases as on the host", want.len()));
    }
    println!("conformance (host: {} cases, every one passing by definition)", want.len());
    for row in &table {
        println!("{row}");
    }
    assert!(
        unexpected_failures.is_empty() && unexpected_passes.is_empty(),
        "failures not in tests/posix/expected-failures:\n{}\n\nlisted as failing but passing now (remove them):\n{}",
        unexpected_failures.join("\n"),
        unexpected_passes.join("\n")
    );
}

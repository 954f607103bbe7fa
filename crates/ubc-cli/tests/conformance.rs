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
//! A second test runs pjdfstest, an independent POSIX suite, the same way: every case the host
//! passes must pass on every stack.
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
            // A pool of 4 host descriptors: files' descriptors are closed and reopened by
            // handle all the time, so the cases run through that path too.
            .args(["mount", "--stack", spec, "--budget", "8", "--host-fds", "4", "--allow-other", "--at"])
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

    /// Mount the top of stack `name` (`tail` from [`STACKS`]) over `base/data` (union upper
    /// `base/upper`, key file `key`) at `base/mnt`, every directory open to uid 65534.
    fn stack(base: &Path, name: &str, tail: &str, key: &Path) -> (Mount, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let (data, upper, mp) = (base.join("data"), base.join("upper"), base.join("mnt"));
        for d in [base, &data, &upper, &mp] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let spec = format!(
            "dir:{}{}",
            data.display(),
            tail.replace("KEY", &key.display().to_string()).replace("UPPER", &upper.display().to_string())
        );
        (Mount::start(&spec, name.matches('|').count(), &mp, &base.join("err")), mp)
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
        let (m, mp) = Mount::stack(&t.path().join(name.replace('|', "-")), name, tail, &key);
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

/// The pjdfstest binary (`cargo install pjdfstest`, which `./scripts/test` does): on PATH or
/// in cargo's bin directory.
fn pjdfstest() -> Option<PathBuf> {
    let dirs = std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default();
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin"));
    dirs.into_iter().chain(home).map(|d| d.join("pjdfstest")).find(|p| p.is_file())
}

/// The name of `user`'s primary group, if the user exists.
fn primary_group(user: &str) -> Option<String> {
    let out = Command::new("id").args(["-gn", user]).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// pjdfstest's verdict per test case in `root`: "ok", "FAILED" or "skipped".
fn run_pjdfstest(bin: &Path, config: &Path, root: &Path, secondary: &Path) -> BTreeMap<String, String> {
    let out = Command::new(bin)
        .arg("-c")
        .arg(config)
        .arg("-p")
        .arg(root)
        .arg("-s")
        .arg(secondary)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let verdicts: BTreeMap<String, String> = text
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (name, verdict) = (w.next()?, w.next()?);
            (w.next().is_none() && name.contains("::") && matches!(verdict, "ok" | "FAILED" | "skipped"))
                .then(|| (name.to_string(), verdict.to_string()))
        })
        .collect();
    assert!(verdicts.len() > 300, "pjdfstest in {} reported {} cases:\n{text}", root.display(), verdicts.len());
    verdicts
}

/// Cases the host passes that a FUSE mount cannot run, whatever the file system behind it.
const PJDFSTEST_NOT_ON_FUSE: &[(&str, &str)] = &[(
    "link::link_count_max",
    "glibc's pathconf(_PC_LINK_MAX) knows no limit for FUSE's file system type, so the case skips itself",
)];

#[test]
fn pjdfstest_passes_on_every_stack_what_it_passes_on_the_host() {
    // An independent POSIX suite (pjdfstest, the Rust rewrite of the FreeBSD/Linux file
    // system test suite: ~400 cases of chmod, chown, link, mkdir, mkfifo, mknod, open,
    // rename, rmdir, symlink, truncate, unlink, utimensat, posix_fallocate with their
    // errors), run on a directory of the host's file system and on a mount of every stack.
    if can_run().is_none() {
        return;
    }
    let Some(bin) = pjdfstest() else {
        eprintln!("SKIP: pjdfstest is not installed (cargo install pjdfstest; ./scripts/test does)");
        return;
    };
    // Two users to switch to; ./scripts/test adds the second.
    let second = std::env::var("UBC_PJDFSTEST_USER").unwrap_or_else(|_| "ubc-pjd".into());
    let (Some(g1), Some(g2)) = (primary_group("nobody"), primary_group(&second)) else {
        eprintln!("SKIP: pjdfstest needs the users nobody and {second} (./scripts/test adds {second})");
        return;
    };
    let t = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = t.path().join("pjdfstest.toml");
    std::fs::write(
        &config,
        format!(
            "[features]\nposix_fallocate = {{}}\nutime_now = {{}}\nutimensat = {{}}\nrename_ctime = {{}}\n\n\
             [settings]\nnaptime = 0.01\nallow_remount = false\n\n\
             [dummy_auth]\nentries = [[\"nobody\", \"{g1}\"], [\"{second}\", \"{g2}\"]]\n"
        ),
    )
    .unwrap();
    // A second file system for the EXDEV cases: a directory on another device.
    let secondary = tempfile::tempdir_in(if Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/run" }).unwrap();
    let host = t.path().join("host");
    std::fs::create_dir(&host).unwrap();
    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o755)).unwrap();
    let want = run_pjdfstest(&bin, &config, &host, secondary.path());
    let host_ok: BTreeSet<&String> = want.iter().filter(|(_, v)| *v == "ok").map(|(k, _)| k).collect();
    let key = t.path().join("key");
    assert!(Command::new(env!("CARGO_BIN_EXE_ubc")).arg("keygen").arg(&key).status().unwrap().success());

    let mut table = Vec::new();
    let mut wrong = Vec::new();
    for (name, tail) in STACKS {
        let (m, mp) = Mount::stack(&t.path().join(format!("pjd-{}", name.replace('|', "-"))), name, tail, &key);
        let got = run_pjdfstest(&bin, &config, &mp, secondary.path());
        m.finish();
        let mut passed = 0;
        for case in &host_ok {
            match got.get(*case).map(String::as_str) {
                Some("ok") => passed += 1,
                _ if PJDFSTEST_NOT_ON_FUSE.iter().any(|(c, _)| c == case) => {}
                v => wrong.push(format!("{name}: {case}: {}", v.unwrap_or("not run"))),
            }
        }
        let failed = got.values().filter(|v| *v == "FAILED").count();
        table.push(format!("{name:>14}: {passed}/{} of the host's passes, {failed} failed", host_ok.len()));
    }
    println!(
        "pjdfstest (host: {} passed, {} skipped; {} cannot run on FUSE)",
        host_ok.len(),
        want.values().filter(|v| *v == "skipped").count(),
        PJDFSTEST_NOT_ON_FUSE.len()
    );
    for row in &table {
        println!("{row}");
    }
    assert!(wrong.is_empty(), "cases the host passes and a stack does not:\n{}", wrong.join("\n"));
}

//! `ubc mount`: the real binary serving two layers of one stack through FUSE, used with
//! ordinary tools. Skipped (with a message) when `/dev/fuse` or `fusermount3` is missing.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn fuse_available() -> bool {
    if !Path::new("/dev/fuse").exists() {
        eprintln!("SKIP: /dev/fuse is missing");
        return false;
    }
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("fusermount3").exists()))
        .unwrap_or(false);
    if !found {
        eprintln!("SKIP: fusermount3 is missing (apt-get install -y fuse3)");
        return false;
    }
    true
}

fn ubc() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ubc"))
}

fn is_mounted(mp: &Path) -> bool {
    let m = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mp = mp.canonicalize().unwrap_or(mp.to_path_buf());
    m.lines().any(|l| l.split(' ').nth(4) == Some(mp.to_str().unwrap()))
}

/// The stack `dir:data | zstd | aead:keyfile=key`, layer 2 at `clear/` and 0 at `stored/`.
struct Mounted {
    t: tempfile::TempDir,
    spec: String,
    child: Option<Child>,
    clear: PathBuf,
    stored: PathBuf,
}

impl Mounted {
    fn start(extra: &[&str]) -> Mounted {
        let t = tempfile::tempdir().unwrap();
        for d in ["data", "clear", "stored"] {
            std::fs::create_dir(t.path().join(d)).unwrap();
        }
        let st = ubc().arg("keygen").arg(t.path().join("key")).status().unwrap();
        assert!(st.success());
        let spec = format!("dir:{} | zstd | aead:keyfile={}", t.path().join("data").display(), t.path().join("key").display());
        let clear = t.path().join("clear");
        let stored = t.path().join("stored");
        let child = ubc()
            .args(["mount", "--stack", &spec, "--at"])
            .arg(format!("2:{}", clear.display()))
            .arg("--at")
            .arg(format!("0:{}", stored.display()))
            .args(extra)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let mut m = Mounted { t, spec, child: Some(child), clear, stored };
        let start = Instant::now();
        while !(is_mounted(&m.clear) && is_mounted(&m.stored)) {
            if let Some(st) = m.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("ubc mount exited early: {st}");
            }
            assert!(start.elapsed() < Duration::from_secs(20), "mounts did not appear");
            std::thread::sleep(Duration::from_millis(50));
        }
        m
    }

    /// `fusermount3 -u` both; the process must exit 0.
    fn unmount(&mut self) {
        for mp in [&self.clear, &self.stored] {
            let st = Command::new("fusermount3").arg("-u").arg(mp).status().unwrap();
            assert!(st.success(), "fusermount3 -u {}", mp.display());
        }
        let mut child = self.child.take().unwrap();
        let start = Instant::now();
        let st = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            assert!(start.elapsed() < Duration::from_secs(20), "ubc mount did not exit");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(st.code(), Some(0), "ubc mount exit status");
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            for mp in [&self.clear, &self.stored] {
                let _ = Command::new("fusermount3").args(["-u", "-z"]).arg(mp).status();
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn sample(len: usize) -> Vec<u8> {
    (0..).flat_map(|i: u32| format!("line {i}: the quick brown fox\n").into_bytes()).take(len).collect()
}

fn run(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn two_mounts_of_one_stack_with_ordinary_tools() {
    if !fuse_available() {
        return;
    }
    let mut m = Mounted::start(&[]);
    let (clear, stored) = (m.clear.clone(), m.stored.clone());
    let data = sample(300_000);
    let host = m.t.path().join("host.txt");
    std::fs::write(&host, &data).unwrap();

    // Write through the cleartext mount (cp and std::fs), read back (cat and std::fs).
    run(Command::new("cp").arg(&host).arg(clear.join("a.txt")));
    assert_eq!(std::fs::read(clear.join("a.txt")).unwrap(), data);
    assert_eq!(run(Command::new("cat").arg(clear.join("a.txt"))), data);
    assert_eq!(std::fs::metadata(clear.join("a.txt")).unwrap().len(), data.len() as u64);
    std::fs::create_dir(clear.join("sub")).unwrap();
    std::fs::write(clear.join("sub/b.txt"), b"hello through fuse").unwrap();

    // The stored file, through the layer-0 mount: there, no cleartext, another size.
    let raw = std::fs::read(stored.join("a.txt")).unwrap();
    assert_ne!(raw.len(), data.len());
    assert!(!contains(&raw, b"the quick brown fox"));
    assert!(stored.join("sub/b.txt").exists());
    let mut names: Vec<String> = std::fs::read_dir(&stored).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["a.txt", "sub"]);

    // dd: overwrite a block in the middle without truncating.
    run(Command::new("dd")
        .arg(format!("if={}", host.display()))
        .arg(format!("of={}", clear.join("a.txt").display()))
        .args(["bs=4096", "count=2", "seek=10", "skip=3", "conv=notrunc", "status=none"]));
    let mut expect = data.clone();
    expect.copy_within(3 * 4096..5 * 4096, 10 * 4096);
    assert_eq!(std::fs::read(clear.join("a.txt")).unwrap(), expect);

    // Rename through one mount, seen through the other; and the other way round.
    std::fs::rename(clear.join("a.txt"), clear.join("sub/renamed.txt")).unwrap();
    assert!(!stored.join("a.txt").exists());
    assert!(stored.join("sub/renamed.txt").exists());
    std::fs::rename(stored.join("sub/b.txt"), stored.join("b2.txt")).unwrap();
    assert_eq!(std::fs::read(clear.join("b2.txt")).unwrap(), b"hello through fuse");
    assert!(!clear.join("sub/b.txt").exists());

    // Remove through one, gone in the other.
    std::fs::write(clear.join("doomed"), b"x").unwrap();
    assert!(stored.join("doomed").exists());
    std::fs::remove_file(stored.join("doomed")).unwrap();
    assert!(!clear.join("doomed").exists());

    // Truncate (shrink and grow) through the cleartext mount.
    let f = std::fs::OpenOptions::new().write(true).open(clear.join("sub/renamed.txt")).unwrap();
    f.set_len(5000).unwrap();
    drop(f);
    assert_eq!(std::fs::read(clear.join("sub/renamed.txt")).unwrap(), &expect[..5000]);
    run(Command::new("truncate").args(["-s", "6000"]).arg(clear.join("sub/renamed.txt")));
    let got = std::fs::read(clear.join("sub/renamed.txt")).unwrap();
    assert_eq!(&got[..5000], &expect[..5000]);
    assert!(got[5000..].iter().all(|&b| b == 0) && got.len() == 6000);
    assert_eq!(std::fs::metadata(clear.join("sub/renamed.txt")).unwrap().len(), 6000);

    // chmod through the mount.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(clear.join("b2.txt"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(std::fs::metadata(clear.join("b2.txt")).unwrap().permissions().mode() & 0o777, 0o600);

    // mmap (shared, read-only) of a direct-I/O file: FUSE_DIRECT_IO_ALLOW_MMAP (Linux >= 6.6).
    // On older kernels the documented failure is ENODEV for MAP_SHARED.
    if Command::new("python3").arg("--version").output().is_ok() {
        let script = "import mmap,sys\nf=open(sys.argv[1],'rb')\ntry:\n m=mmap.mmap(f.fileno(),0,access=mmap.ACCESS_READ)\n sys.stdout.buffer.write(m[:])\nexcept OSError as e:\n print('ERRNO',e.errno);sys.exit(3)\n";
        let out = Command::new("python3").args(["-c", script]).arg(clear.join("b2.txt")).output().unwrap();
        if out.status.code() == Some(3) {
            assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("ERRNO {}", libc_enodev()));
            eprintln!("note: shared mmap of direct-I/O files is refused by this kernel (ENODEV)");
        } else {
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            assert_eq!(out.stdout, b"hello through fuse");
        }
    } else {
        eprintln!("note: python3 missing, mmap check skipped");
    }

    // rmdir, and a directory listing through the cleartext mount.
    std::fs::create_dir(clear.join("empty")).unwrap();
    std::fs::remove_dir(stored.join("empty")).unwrap();
    assert!(!clear.join("empty").exists());

    m.unmount();

    // The data is on disk: re-open the stack in-process.
    let cache = ubc::Cache::new(16 << 20).unwrap();
    let stack = ubc_stack::Stack::open(&m.spec, cache).unwrap();
    let top = stack.top();
    let read_all = |p: &str| {
        let f = top.open(p).unwrap();
        let mut v = vec![0u8; f.len().unwrap() as usize];
        f.read_exact_at(&mut v, 0).unwrap();
        v
    };
    assert_eq!(read_all("sub/renamed.txt"), got);
    assert_eq!(read_all("b2.txt"), b"hello through fuse");
    assert!(top.getattr("doomed").is_err());
    assert!(top.getattr("a.txt").is_err());
    // And on the host, stored (not clear).
    let host_raw = std::fs::read(m.t.path().join("data/b2.txt")).unwrap();
    assert!(!contains(&host_raw, b"hello through fuse"));
}

fn libc_enodev() -> i32 {
    19
}

#[test]
fn sigterm_unmounts_and_exits_zero() {
    if !fuse_available() {
        return;
    }
    let mut m = Mounted::start(&[]);
    std::fs::write(m.clear.join("f"), b"kept after SIGTERM").unwrap();
    // The child stays in `m` until it has exited, so a failure still unmounts (Drop).
    let child = m.child.as_mut().unwrap();
    let st = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let start = Instant::now();
    let st = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "ubc mount did not exit on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!is_mounted(&m.clear) && !is_mounted(&m.stored));
    m.child = None;
    assert_eq!(st.code(), Some(0));
    let stack = ubc_stack::Stack::open(&m.spec, ubc::Cache::new(16 << 20).unwrap()).unwrap();
    let f = stack.top().open("f").unwrap();
    let mut v = vec![0u8; f.len().unwrap() as usize];
    f.read_exact_at(&mut v, 0).unwrap();
    assert_eq!(v, b"kept after SIGTERM");
}

/// A tiny deterministic PRNG (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn fsx_random_ops_match_a_model() {
    if !fuse_available() {
        return;
    }
    let mut m = Mounted::start(&[]);
    let path = m.clear.join("fsx");
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    let mut model: Vec<u8> = Vec::new();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    const MAX: u64 = 300_000;
    for op in 0..400 {
        match rng.below(10) {
            0..=4 => {
                let off = rng.below(MAX);
                let len = 1 + rng.below(20_000) as usize;
                let byte = (op % 251) as u8;
                let buf: Vec<u8> = (0..len).map(|i| byte.wrapping_add(i as u8)).collect();
                f.write_all_at(&buf, off).unwrap();
                let end = off as usize + len;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&buf);
            }
            5..=7 => {
                let off = rng.below(MAX);
                let len = 1 + rng.below(30_000) as usize;
                let mut buf = vec![0u8; len];
                let n = read_full(&f, &mut buf, off);
                let lo = (off as usize).min(model.len());
                let hi = (off as usize + len).min(model.len());
                assert_eq!(n, hi - lo, "op {op}: read length at {off}+{len}");
                assert!(buf[..n] == model[lo..hi], "op {op}: read data at {off}+{len}");
            }
            _ => {
                let len = rng.below(MAX);
                f.set_len(len).unwrap();
                model.resize(len as usize, 0);
            }
        }
        if op % 50 == 0 {
            assert_eq!(f.metadata().unwrap().len(), model.len() as u64, "op {op}: size");
            // Through the other mount: the stored file exists and holds no model bytes in clear.
            assert!(m.stored.join("fsx").exists());
        }
    }
    drop(f);
    assert_eq!(std::fs::read(&path).unwrap(), model);
    m.unmount();
    let stack = ubc_stack::Stack::open(&m.spec, ubc::Cache::new(16 << 20).unwrap()).unwrap();
    let g = stack.top().open("fsx").unwrap();
    let mut v = vec![0u8; g.len().unwrap() as usize];
    g.read_exact_at(&mut v, 0).unwrap();
    assert!(v == model, "on disk after unmount");
}

fn read_full(f: &std::fs::File, buf: &mut [u8], off: u64) -> usize {
    let mut n = 0;
    while n < buf.len() {
        let k = f.read_at(&mut buf[n..], off + n as u64).unwrap();
        if k == 0 {
            break;
        }
        n += k;
    }
    n
}

#[test]
fn kernel_cache_mode_round_trips() {
    if !fuse_available() {
        return;
    }
    let mut m = Mounted::start(&["--kernel-cache"]);
    let data = sample(100_000);
    std::fs::write(m.clear.join("k"), &data).unwrap();
    assert_eq!(std::fs::read(m.clear.join("k")).unwrap(), data);
    // A re-open through the other mount sees the stored file (close-to-open).
    assert!(!contains(&std::fs::read(m.stored.join("k")).unwrap(), b"the quick brown fox"));
    m.unmount();
}

/// `cmd` run as user nobody (65534): (exit ok, stdout, stderr).
fn as_nobody(args: &[&str]) -> (bool, Vec<u8>, String) {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(args)
        .output()
        .unwrap();
    (out.status.success(), out.stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn only_the_owner_gets_in_unless_allow_other_and_then_modes_hold() {
    if !fuse_available() {
        return;
    }
    let setpriv = Command::new("setpriv").arg("--version").output().map(|o| o.status.success()).unwrap_or(false);
    if unsafe { libc::geteuid() } != 0 || !setpriv {
        eprintln!("SKIP: needs root and setpriv to act as another user");
        return;
    }
    for allow_other in [false, true] {
        let mut m = Mounted::start(if allow_other { &["--allow-other"] } else { &[] });
        use std::os::unix::fs::PermissionsExt;
        // Let nobody reach the mount points themselves (tempdirs are 0700).
        std::fs::set_permissions(m.t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let public = m.clear.join("public.txt");
        let private = m.clear.join("private.txt");
        std::fs::write(&public, b"for everyone\n").unwrap();
        std::fs::write(&private, b"owner only\n").unwrap();
        std::fs::set_permissions(&public, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
        let (p, s) = (public.to_str().unwrap(), private.to_str().unwrap());

        let (ok, out, err) = as_nobody(&["cat", p]);
        if allow_other {
            assert!(ok, "allow_other: nobody reads a 0644 file: {err}");
            assert_eq!(out, b"for everyone\n");
        } else {
            assert!(!ok && err.contains("Permission denied"), "owner-only mount let nobody read: {err}");
            let (ok, _, err) = as_nobody(&["ls", m.stored.to_str().unwrap()]);
            assert!(!ok && err.contains("Permission denied"), "owner-only mount let nobody list: {err}");
        }
        // Modes hold either way: no reading 0600, no writing 0644.
        let (ok, _, err) = as_nobody(&["cat", s]);
        assert!(!ok && err.contains("Permission denied"), "allow_other={allow_other}: nobody read a 0600 file: {err}");
        let (ok, _, err) = as_nobody(&["sh", "-c", &format!("echo x >> {p}")]);
        assert!(!ok, "allow_other={allow_other}: nobody appended to a 0644 file: {err}");
        assert_eq!(std::fs::read(&public).unwrap(), b"for everyone\n");
        m.unmount();
    }
}

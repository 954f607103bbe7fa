//! A budget that gives memory back under pressure (`CacheBuilder::memory_pressure`): a cache
//! process reading a file larger than its budget and a program allocating memory share a
//! memory-limited cgroup whose limit cannot hold both; neither is killed, the cache shrinks
//! while the program holds its memory and grows back once it lets go. Needs root and a
//! writable memory cgroup (v1 `memory` hierarchy or v2 with the memory controller); skipped
//! with a message otherwise.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD: &str = "UBC_PRESSURE_CHILD";
const MIB: u64 = 1 << 20;
const LIMIT: u64 = 256 * MIB;
const BUDGET: u64 = 160 * MIB;
const HOG: u64 = 140 * MIB;

/// A memory cgroup made for the test, removed on drop.
struct Cgroup {
    dir: PathBuf,
    v2: bool,
}

impl Cgroup {
    fn make() -> Result<Cgroup, String> {
        let name = format!("ubc-pressure-{}", std::process::id());
        let v1 = Path::new("/sys/fs/cgroup/memory");
        let (dir, v2, limit_file) = if v1.join("memory.limit_in_bytes").exists() {
            (v1.join(&name), false, "memory.limit_in_bytes")
        } else if std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers").is_ok_and(|c| c.contains("memory")) {
            let _ = std::fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+memory");
            (Path::new("/sys/fs/cgroup").join(&name), true, "memory.max")
        } else {
            return Err("no memory cgroup controller here".into());
        };
        std::fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        let cg = Cgroup { dir, v2 };
        std::fs::write(cg.dir.join(limit_file), LIMIT.to_string()).map_err(|e| format!("set the limit: {e}"))?;
        if v2 {
            // No swap for the test's cgroup: memfd pages could otherwise be swapped out.
            let _ = std::fs::write(cg.dir.join("memory.swap.max"), "0");
        }
        Ok(cg)
    }

    /// OOM kills in the cgroup so far.
    fn oom_kills(&self) -> u64 {
        let (file, key) = if self.v2 { ("memory.events", "oom_kill ") } else { ("memory.oom_control", "oom_kill ") };
        std::fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn join(cgroup: &Path) {
    std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string()).expect("join the cgroup");
}

/// The cache: read `file` over and over for `secs` through a cache of `BUDGET`, printing
/// "resident R withheld W" every 100 ms.
fn cache_child(cgroup: &Path, file: &Path, secs: u64) {
    join(cgroup);
    let cache = ubc::Cache::builder().budget(BUDGET).build().unwrap();
    let f = cache.open_path(file, ubc::Access::ReadOnly).unwrap();
    let len = f.len().unwrap();
    let mut buf = vec![0u8; MIB as usize];
    let (start, mut told, mut at) = (Instant::now(), Instant::now(), 0u64);
    let mut out = std::io::stdout().lock();
    while start.elapsed() < Duration::from_secs(secs) {
        f.read_exact_at(&mut buf, at).unwrap();
        assert_eq!(buf[0], (at / MIB) as u8, "read back what the file holds");
        at = (at + MIB) % len;
        if told.elapsed() >= Duration::from_millis(100) {
            let st = cache.stats();
            writeln!(out, "resident {} withheld {}", st.totals.resident_bytes, st.withheld_bytes).unwrap();
            out.flush().unwrap();
            told = Instant::now();
        }
    }
}

/// The program: allocate `HOG` in 8 MiB steps, 50 ms apart, touching every page; hold it for
/// 3 s; free it and wait 1 s.
fn hog_child(cgroup: &Path) {
    join(cgroup);
    let mut held: Vec<Vec<u8>> = Vec::new();
    while (held.len() as u64) * 8 * MIB < HOG {
        held.push(vec![0x5a; (8 * MIB) as usize]);
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("holding {} MiB", held.len() * 8);
    std::thread::sleep(Duration::from_secs(3));
    drop(held);
    println!("freed");
    std::thread::sleep(Duration::from_secs(1));
}

#[test]
fn a_cache_in_a_limited_cgroup_shrinks_for_a_program_that_allocates_and_grows_back() {
    if let Ok(v) = std::env::var(CHILD) {
        let mut it = v.split('|');
        match (it.next(), it.next(), it.next()) {
            (Some("cache"), Some(cg), Some(file)) => cache_child(Path::new(cg), Path::new(file), 10),
            (Some("hog"), Some(cg), _) => hog_child(Path::new(cg)),
            _ => panic!("bad {CHILD}: {v}"),
        }
        return;
    }
    let cg = match Cgroup::make() {
        Ok(c) => c,
        Err(why) => {
            eprintln!("skipped: {why} (needs root and a writable memory cgroup)");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data");
    {
        let mut w = std::io::BufWriter::new(std::fs::File::create(&file).unwrap());
        for i in 0..256u64 {
            w.write_all(&vec![i as u8; MIB as usize]).unwrap();
        }
    }
    let exe = std::env::current_exe().unwrap();
    let spawn = |what: &str| {
        Command::new(&exe)
            .args([
                "--exact",
                "a_cache_in_a_limited_cgroup_shrinks_for_a_program_that_allocates_and_grows_back",
                "--nocapture",
            ])
            .env(CHILD, format!("{what}|{}|{}", cg.dir.display(), file.display()))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut cache = spawn("cache");
    let lines = BufReader::new(cache.stdout.take().unwrap()).lines();
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, u64, u64)>();
    let reader = std::thread::spawn(move || {
        for l in lines.map_while(Result::ok) {
            let w: Vec<&str> = l.split_whitespace().collect();
            if let ["resident", r, "withheld", h] = w[..] {
                let _ = tx.send((Instant::now(), r.parse().unwrap(), h.parse().unwrap()));
            }
        }
    });
    // Let the cache fill, then start the program.
    let t0 = Instant::now();
    let mut samples = Vec::new();
    while let Ok(s) = rx.recv_timeout(Duration::from_secs(20)) {
        samples.push(s);
        if s.1 >= BUDGET * 9 / 10 || t0.elapsed() > Duration::from_secs(5) {
            break;
        }
    }
    let filled = samples.last().map_or(0, |s| s.1);
    let hog_start = Instant::now();
    let hog = spawn("hog").wait_with_output().unwrap();
    let hog_end = Instant::now();
    let cache_status = cache.wait().unwrap();
    reader.join().unwrap();
    samples.extend(rx.try_iter());
    let kills = cg.oom_kills();
    let trace: Vec<String> = samples
        .iter()
        .map(|s| format!("{:.1}s:{}/{}", s.0.duration_since(t0).as_secs_f64(), s.1 / MIB, s.2 / MIB))
        .collect();
    eprintln!(
        "program ran {:.1}..{:.1} s; resident/withheld MiB: {}",
        hog_start.duration_since(t0).as_secs_f64(),
        hog_end.duration_since(t0).as_secs_f64(),
        trace.join(" ")
    );
    assert!(hog.status.success(), "the program was killed or failed: {:?} (OOM kills {kills})", hog.status);
    assert!(cache_status.success(), "the cache process was killed or failed: {cache_status:?} (OOM kills {kills})");
    assert_eq!(kills, 0, "OOM kills in the cgroup");
    assert!(filled >= BUDGET / 2, "the cache never filled ({} MiB)", filled / MIB);
    // While the program held its memory (its last 3 s), the cache kept within what was left.
    let during: Vec<_> = samples
        .iter()
        .filter(|s| s.0 > hog_start + Duration::from_secs(2) && s.0 < hog_end - Duration::from_secs(1))
        .collect();
    let peak = during.iter().map(|s| s.1).max().unwrap_or(u64::MAX);
    let withheld = during.iter().map(|s| s.2).max().unwrap_or(0);
    eprintln!(
        "filled {} MiB; while the program held {} MiB: resident at most {} MiB, withheld up to {} MiB; at the end {} MiB",
        filled / MIB,
        HOG / MIB,
        peak / MIB,
        withheld / MIB,
        samples.last().map_or(0, |s| s.1) / MIB
    );
    assert!(!during.is_empty(), "no sample while the program held its memory");
    assert!(withheld > 0, "nothing was withheld");
    assert!(
        peak <= LIMIT - HOG - 16 * MIB,
        "the cache kept {} MiB while the program held {} MiB",
        peak / MIB,
        HOG / MIB
    );
    // After it let go, the cache grew back.
    let after: Vec<_> = samples.iter().filter(|s| s.0 > hog_end + Duration::from_secs(1)).collect();
    let regrown = after.iter().map(|s| s.1).max().unwrap_or(0);
    assert!(regrown >= BUDGET / 2, "the cache did not grow back ({} MiB)", regrown / MIB);
}

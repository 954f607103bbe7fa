//! `ubc-fsx`: a random-operation file exerciser (after fsx, the exerciser of BSD and
//! xfstests) for any file system path — a ubc mount or the host's own directory.
//!
//! One file is driven with writes, stores through a shared mapping, truncations, hole
//! punches, `copy_file_range` from a second file, reads, loads through a mapping, `fsync`,
//! close-and-reopen and `stat` (with `SEEK_DATA`/`SEEK_HOLE`), chosen at random from a seed; every result is checked
//! against an in-memory model of what the file must hold: the size after every operation,
//! the bytes an operation touched right after it, the whole file every `--full-every`
//! operations and at the end. With `--other PATH` (the same file reached through another
//! mount, e.g. another layer of one stack that shows the same bytes), each operation goes
//! through one of the two paths at random, and is checked through the other: the two views
//! must never differ.
//!
//!   ubc-fsx --file PATH [--other PATH] [--ops N] [--seed S] [--max-size BYTES]
//!
//! Exits 0 with a summary line, or 1 naming the first operation whose result differed (with
//! the seed and operation number, so the run can be repeated).

use clap::Parser;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Instant;
use ubc_evict::sim::SplitMix64 as Rng;

#[derive(Parser)]
#[command(about = "random file operations checked against a model")]
struct Args {
    /// The file to exercise (created or truncated).
    #[arg(long)]
    file: PathBuf,
    /// The same file through another path (another mount of the stack).
    #[arg(long)]
    other: Option<PathBuf>,
    #[arg(long, default_value_t = 10_000)]
    ops: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Largest offset an operation reaches.
    #[arg(long, default_value_t = 256 * 1024)]
    max_size: u64,
    /// Check the whole file every this many operations.
    #[arg(long, default_value_t = 500)]
    full_every: u64,
}

/// Which operation, for the counts in the summary.
const NAMES: [&str; 10] =
    ["write", "map-write", "truncate", "punch", "copy-range", "read", "map-read", "fsync", "reopen", "stat"];

struct Fsx {
    paths: Vec<PathBuf>,
    files: Vec<File>,
    model: Vec<u8>,
    /// The source of `copy_file_range`, and its bytes.
    src: File,
    src_bytes: Vec<u8>,
    rng: Rng,
    max: u64,
    op: u64,
    seed: u64,
}

type R<T> = Result<T, String>;

impl Fsx {
    fn fail<T>(&self, what: String) -> R<T> {
        Err(format!("op {} (seed {}): {what}", self.op, self.seed))
    }

    fn open(p: &PathBuf) -> R<File> {
        OpenOptions::new().read(true).write(true).open(p).map_err(|e| format!("open {}: {e}", p.display()))
    }

    /// Read `len` bytes at `off` through file `i` (short only at the end).
    fn read(&self, i: usize, off: u64, len: usize) -> R<Vec<u8>> {
        let mut buf = vec![0u8; len];
        let mut n = 0;
        while n < len {
            match self.files[i].read_at(&mut buf[n..], off + n as u64) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) => return self.fail(format!("read {off}+{len} via {}: {e}", self.paths[i].display())),
            }
        }
        buf.truncate(n);
        Ok(buf)
    }

    /// The size through file `i` and the bytes `range` through it equal the model's.
    fn check(&self, i: usize, off: u64, len: u64) -> R<()> {
        let size = self.files[i].metadata().map_err(|e| format!("fstat: {e}"))?.len();
        if size != self.model.len() as u64 {
            return self.fail(format!("size {size} via {}, model {}", self.paths[i].display(), self.model.len()));
        }
        let (lo, hi) = ((off as usize).min(self.model.len()), ((off + len) as usize).min(self.model.len()));
        let got = self.read(i, lo as u64, hi - lo)?;
        if got.len() != hi - lo {
            return self.fail(format!("read {} bytes at {lo}, the model has {}", got.len(), hi - lo));
        }
        if let Some(k) = (0..got.len()).find(|&k| got[k] != self.model[lo + k]) {
            return self.fail(format!(
                "byte {} via {}: {:#04x}, model {:#04x} (range {lo}..{hi})",
                lo + k,
                self.paths[i].display(),
                got[k],
                self.model[lo + k]
            ));
        }
        Ok(())
    }

    /// `lseek(SEEK_DATA)` and `lseek(SEEK_HOLE)` from `off` agree with the model: bytes
    /// skipped to reach data are zeros, and none is nonzero if no data follows; a hole
    /// starts with a zero byte (or at the end); at or past the end both are ENXIO. (A file
    /// system may call zeros data: only what the model rules out is an error.)
    fn check_seek(&self, fd: i32, off: u64) -> R<()> {
        let n = self.model.len() as u64;
        let seek = |whence| {
            // SAFETY: lseek takes the descriptor and integers.
            let r = unsafe { libc::lseek(fd, off as i64, whence) };
            if r < 0 { Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)) } else { Ok(r as u64) }
        };
        let (data, hole) = (seek(libc::SEEK_DATA), seek(libc::SEEK_HOLE));
        if off >= n {
            if data != Err(libc::ENXIO) || hole != Err(libc::ENXIO) {
                return self.fail(format!("seek at {off} past the end {n}: data {data:?}, hole {hole:?} (ENXIO due)"));
            }
            return Ok(());
        }
        let zeros = |a: u64, b: u64| self.model[a as usize..b as usize].iter().all(|&x| x == 0);
        match data {
            Err(libc::ENXIO) if zeros(off, n) => {}
            Ok(d) if d >= off && d < n && zeros(off, d) => {}
            r => return self.fail(format!("SEEK_DATA from {off} gave {r:?}: skipped nonzero bytes (size {n})")),
        }
        match hole {
            Ok(h) if h >= off && (h == n || (h < n && self.model[h as usize] == 0)) => Ok(()),
            r => self.fail(format!("SEEK_HOLE from {off} gave {r:?}: not a zero byte nor the end (size {n})")),
        }
    }

    fn grow(&mut self, end: usize) {
        if self.model.len() < end {
            self.model.resize(end, 0);
        }
    }

    /// One random operation through file `i`; the range it touched.
    fn step(&mut self, i: usize, kind: usize) -> R<(u64, u64)> {
        let fd = self.files[i].as_raw_fd();
        let off = self.rng.below(self.max);
        let len = 1 + self.rng.below(self.max / 8).min(self.max - off - 1);
        let fill = (self.op as u8).wrapping_mul(31) | 1;
        match kind {
            0 => {
                let buf: Vec<u8> = (0..len).map(|k| fill.wrapping_add(k as u8)).collect();
                self.files[i].write_all_at(&buf, off).map_err(|e| format!("write {off}+{len}: {e}"))?;
                self.grow((off + len) as usize);
                self.model[off as usize..(off + len) as usize].copy_from_slice(&buf);
                Ok((off, len))
            }
            1 => {
                // A store through a shared mapping of bytes already in the file, then msync.
                let size = self.model.len() as u64;
                if size == 0 {
                    return Ok((0, 0));
                }
                let off = self.rng.below(size);
                let len = 1 + self.rng.below((size - off).min(self.max / 8));
                let page = 4096u64;
                let (base, end) = (off / page * page, off + len);
                let maplen = (end - base) as usize;
                // SAFETY: a fresh shared mapping of the file's bytes base..end (inside the
                // file), used only in this block and unmapped at its end.
                unsafe {
                    let p = libc::mmap(
                        std::ptr::null_mut(),
                        maplen,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED,
                        fd,
                        base as i64,
                    );
                    if p == libc::MAP_FAILED {
                        return Err(format!("mmap {base}+{maplen}: {}", std::io::Error::last_os_error()));
                    }
                    let dst = (p as *mut u8).add((off - base) as usize);
                    for k in 0..len as usize {
                        *dst.add(k) = fill ^ (k as u8);
                    }
                    let r = libc::msync(p, maplen, libc::MS_SYNC);
                    let err = std::io::Error::last_os_error();
                    libc::munmap(p, maplen);
                    if r != 0 {
                        return Err(format!("msync {base}+{maplen}: {err}"));
                    }
                }
                for k in 0..len as usize {
                    self.model[off as usize + k] = fill ^ (k as u8);
                }
                Ok((off, len))
            }
            2 => {
                let to = self.rng.below(self.max);
                self.files[i].set_len(to).map_err(|e| format!("truncate to {to}: {e}"))?;
                let from = self.model.len() as u64;
                self.model.resize(to as usize, 0);
                Ok((to.min(from), from.max(to) - to.min(from) + 1))
            }
            3 => {
                // SAFETY: fallocate takes the descriptor and integers.
                let r = unsafe {
                    libc::fallocate(fd, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off as i64, len as i64)
                };
                if r != 0 {
                    return Err(format!("punch {off}+{len}: {}", std::io::Error::last_os_error()));
                }
                let end = ((off + len) as usize).min(self.model.len());
                if (off as usize) < end {
                    self.model[off as usize..end].fill(0);
                }
                Ok((off, len))
            }
            4 => {
                let from = self.rng.below(self.src_bytes.len() as u64);
                let want = len.min(self.src_bytes.len() as u64 - from);
                let (mut fi, mut fo) = (from as i64, off as i64);
                let mut done = 0u64;
                while done < want {
                    // SAFETY: the offsets are locals that live across the call.
                    let n = unsafe {
                        libc::copy_file_range(self.src.as_raw_fd(), &mut fi, fd, &mut fo, (want - done) as usize, 0)
                    };
                    if n < 0 {
                        return Err(format!(
                            "copy_file_range {from}+{want} → {off}: {}",
                            std::io::Error::last_os_error()
                        ));
                    }
                    if n == 0 {
                        return self.fail(format!("copy_file_range returned 0 after {done} of {want} bytes"));
                    }
                    done += n as u64;
                }
                self.grow((off + want) as usize);
                let src = self.src_bytes[from as usize..(from + want) as usize].to_vec();
                self.model[off as usize..(off + want) as usize].copy_from_slice(&src);
                Ok((off, want))
            }
            5 => {
                let got = self.read(i, off, len as usize)?;
                let lo = (off as usize).min(self.model.len());
                let hi = ((off + len) as usize).min(self.model.len());
                if got != self.model[lo..hi] {
                    return self.fail(format!("read {off}+{len} differs from the model"));
                }
                Ok((off, len))
            }
            6 => {
                let size = self.model.len() as u64;
                if size == 0 {
                    return Ok((0, 0));
                }
                let off = self.rng.below(size);
                let len = 1 + self.rng.below((size - off).min(self.max / 8));
                let base = off / 4096 * 4096;
                let maplen = (off + len - base) as usize;
                // SAFETY: a fresh read-only shared mapping of bytes inside the file, read and
                // unmapped in this block.
                let got = unsafe {
                    let p =
                        libc::mmap(std::ptr::null_mut(), maplen, libc::PROT_READ, libc::MAP_SHARED, fd, base as i64);
                    if p == libc::MAP_FAILED {
                        return Err(format!("mmap {base}+{maplen}: {}", std::io::Error::last_os_error()));
                    }
                    let v =
                        std::slice::from_raw_parts((p as *const u8).add((off - base) as usize), len as usize).to_vec();
                    libc::munmap(p, maplen);
                    v
                };
                if got != self.model[off as usize..(off + len) as usize] {
                    return self.fail(format!("mapped read {off}+{len} differs from the model"));
                }
                Ok((off, len))
            }
            7 => {
                self.files[i].sync_all().map_err(|e| format!("fsync: {e}"))?;
                Ok((0, 0))
            }
            8 => {
                let p = self.paths[i].clone();
                self.files[i] = Self::open(&p)?;
                Ok((off, len))
            }
            _ => {
                let size = std::fs::metadata(&self.paths[i]).map_err(|e| format!("stat: {e}"))?.len();
                if size != self.model.len() as u64 {
                    return self.fail(format!("stat size {size}, model {}", self.model.len()));
                }
                // With the stat, SEEK_DATA and SEEK_HOLE from an offset drawn without the
                // generator (recorded seeds replay the same operations).
                self.check_seek(fd, self.op.wrapping_mul(7919) % (size + 2048))?;
                Ok((0, 0))
            }
        }
    }
}

fn run(a: Args) -> R<String> {
    if a.max_size < 4096 || a.full_every == 0 {
        return Err("--max-size must be at least 4096 and --full-every at least 1".into());
    }
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&a.file)
        .map_err(|e| format!("create {}: {e}", a.file.display()))?;
    let mut paths = vec![a.file.clone()];
    let mut files = vec![f];
    if let Some(o) = &a.other {
        // The other view must show the file (another mount of the stack).
        let start = Instant::now();
        loop {
            match Fsx::open(o) {
                Ok(g) => {
                    files.push(g);
                    break;
                }
                Err(e) if start.elapsed().as_secs() > 5 => return Err(e),
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        }
        paths.push(o.clone());
    }
    let src_path = a.file.with_extension("fsx-src");
    let mut rng = Rng::new(a.seed ^ 0x5eed);
    let src_bytes: Vec<u8> = (0..a.max_size / 2).map(|_| rng.next_u64() as u8).collect();
    std::fs::write(&src_path, &src_bytes).map_err(|e| format!("write {}: {e}", src_path.display()))?;
    let src = File::open(&src_path).map_err(|e| format!("open {}: {e}", src_path.display()))?;
    let mut x = Fsx {
        paths,
        files,
        model: Vec::new(),
        src,
        src_bytes,
        rng: Rng::new(a.seed),
        max: a.max_size,
        op: 0,
        seed: a.seed,
    };
    let mut counts = [0u64; NAMES.len()];
    let started = Instant::now();
    for op in 0..a.ops {
        x.op = op;
        let n = x.files.len();
        let i = x.rng.below(n as u64) as usize;
        let kind = x.rng.below(NAMES.len() as u64) as usize;
        let (off, len) = x.step(i, kind).map_err(|e| format!("op {op} ({}) seed {}: {e}", NAMES[kind], a.seed))?;
        counts[kind] += 1;
        // Checked through the other view when there is one, else through the same file.
        let j = (i + 1) % n;
        x.check(j, off, len).map_err(|e| format!("after {}: {e}", NAMES[kind]))?;
        if (op + 1) % a.full_every == 0 {
            for k in 0..n {
                x.check(k, 0, x.model.len() as u64)?;
            }
        }
    }
    for k in 0..x.files.len() {
        x.check(k, 0, x.model.len() as u64)?;
    }
    let _ = std::fs::remove_file(&src_path);
    let per: Vec<String> = NAMES.iter().zip(counts).map(|(n, c)| format!("{n} {c}")).collect();
    let secs = started.elapsed().as_secs_f64();
    Ok(format!(
        "fsx: {} ops in {secs:.1} s ({:.0}/s), seed {}, {} view(s), final size {}: {}",
        a.ops,
        a.ops as f64 / secs,
        a.seed,
        x.files.len(),
        x.model.len(),
        per.join(", ")
    ))
}

fn main() {
    match run(Args::parse()) {
        Ok(s) => println!("{s}"),
        Err(e) => {
            eprintln!("ubc-fsx: FAILED: {e}");
            std::process::exit(1);
        }
    }
}

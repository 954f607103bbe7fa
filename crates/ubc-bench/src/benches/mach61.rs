//! Mach's Table 6-1 (Tevanian, Rashid et al., "A Unix Interface for Shared Memory and Memory
//! Mapped Files Under Mach", 1987, §6.2, mapped stdio): read a file
//! byte by byte three ways — libc `fopen` + `getc` (the baseline), `ubc_fopen` + the inline
//! `ubc_fgetc` of the C library (its buffer is the cached file itself), and `ubc_fmap` + an
//! array loop. The C program is `crates/ubc-capi/tests/c/table61.c`, compiled here with the
//! system `cc` against `target/release/libubc_capi.so` (`scripts/bench` builds it). Times
//! are from the program's second round (warm: both the kernel's and ubc's caches hold the
//! file), medians over `runs` runs.

use super::Ctx;
use crate::report::{Better, Record};
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Parse `"<name> … <ms> ms"` lines of round 2.
fn times(out: &str) -> Option<(f64, f64, f64)> {
    let round2 = &out[out.find("round 2")?..];
    let ms = |key: &str| -> Option<f64> {
        let line = round2.lines().find(|l| l.starts_with(key))?;
        let before = line.split(" ms").next()?;
        before.split_whitespace().last()?.parse().ok()
    };
    Some((ms("old_read")?, ms("new_read")?, ms("map_read")?))
}

pub fn run(ctx: &Ctx) -> Vec<Record> {
    let lib = repo().join("target/release");
    if !lib.join("libubc_capi.so").exists() {
        eprintln!("mach61: skipped: {} has no libubc_capi.so (cargo build --release -p ubc-capi)", lib.display());
        return Vec::new();
    }
    let dir = ctx.dir.join("mach61");
    let _ = std::fs::create_dir_all(&dir);
    let exe = dir.join("table61");
    // The library's SONAME is the installed name (crates/ubc-capi/build.rs): the program
    // loads it through a link of that name beside it.
    let soname = dir.join("libubc.so.0");
    let _ = std::fs::remove_file(&soname);
    if let Err(e) = std::os::unix::fs::symlink(lib.join("libubc_capi.so"), &soname) {
        eprintln!("mach61: skipped: cannot link {}: {e}", soname.display());
        return Vec::new();
    }
    let cc = Command::new("cc")
        .args(["-std=c11", "-O2"])
        .arg("-I")
        .arg(repo().join("crates/ubc-capi/include"))
        .arg("-I")
        .arg(repo().join("crates/ubc-capi/tests/c"))
        .arg(repo().join("crates/ubc-capi/tests/c/table61.c"))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib)
        .arg("-lubc_capi")
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .output();
    match cc {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            eprintln!("mach61: skipped: cc failed: {}", String::from_utf8_lossy(&o.stderr));
            return Vec::new();
        }
        Err(e) => {
            eprintln!("mach61: skipped: no cc: {e}");
            return Vec::new();
        }
    }
    let size = ctx.scale(32 << 20, 8 << 20) as usize;
    let mut x: u32 = 0x1234_5678;
    let text: Vec<u8> = (0..size)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            b"abcdefgh ijklmnop\nqrstuvwxyz 0123"[(x % 32) as usize]
        })
        .collect();
    std::fs::write(dir.join("big.txt"), &text).expect("write the Table 6-1 file");
    let (mut old, mut getc, mut fmap) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ctx.runs {
        let o = Command::new(&exe).arg(&dir).arg(Path::new("big.txt")).output().expect("run table61");
        let out = String::from_utf8_lossy(&o.stdout);
        let Some((a, b, c)) = times(&out).filter(|_| o.status.success() && out.contains("checksums agree")) else {
            eprintln!("mach61: the program failed: {out}\n{}", String::from_utf8_lossy(&o.stderr));
            return Vec::new();
        };
        old.push(a);
        getc.push(b);
        fmap.push(c);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let note = format!(
        "{} MiB file, warm round; the C program crates/ubc-capi/tests/c/table61.c; checksums of all three agree; \
         Mach's Table 6-1 reported mapped stdio and array reference as faster than read-based stdio",
        size >> 20
    );
    vec![
        Record::from_samples(
            "mach61_fgetc",
            "ms",
            Better::Lower,
            &getc,
            &old,
            "libc fopen + getc",
            &format!("ubc_fopen + inline ubc_fgetc; {note}"),
        ),
        Record::from_samples(
            "mach61_fmap",
            "ms",
            Better::Lower,
            &fmap,
            &old,
            "libc fopen + getc",
            &format!("ubc_fmap + array loop; {note}"),
        ),
    ]
}

//! Security of the layers: no cleartext below the encryption layer, keys
//! wiped on drop, and no way out of a `dir` or `union` directory through `..` or symbolic
//! links — by reading, writing, copy-up, chmod, truncation, rename or listing.

mod common;

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use ubc_stack::encrypt::Key;
use ubc_stack::{OpenOptions, SetAttr, Stack};

fn cache() -> ubc::Cache {
    ubc::Cache::new(32 << 20).unwrap()
}

/// Every byte of every host file under `dir`.
fn host_files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let ft = e.file_type().unwrap();
        if ft.is_dir() {
            out.extend(host_files(&e.path()));
        } else if ft.is_file() {
            out.push((e.path(), std::fs::read(e.path()).unwrap()));
        }
    }
    out
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn no_cleartext_reaches_any_layer_below_the_encryption_layer() {
    // Written every way the top can be written: write_at, a shared mapping, growth by
    // set_len then write, a small budget so write-behind and eviction push pages down
    // before any sync, a rename. Then every layer below aead, and every host file, is
    // scanned for the secret — before and after sync.
    const SECRET: &[u8] = b"ATTACK AT DAWN: the password is hunter2";
    for order in ["zstd:chunk=16K | aead", "aead | zstd:chunk=16K"] {
        let tmp = tempfile::tempdir().unwrap();
        let spec = common::layered_spec(tmp.path(), order);
        let data = tmp.path().join("data");
        // 2 MiB for three layers of a 5 MiB file (15 MiB): write-behind and eviction
        // push pages down before any sync (checked below), so writeback through the layers
        // needs memory of the cache it is cleaning and must not hang (docs/guarantees.md).
        let s = Stack::open(&spec, ubc::Cache::new(2 << 20).unwrap()).unwrap();
        let evictions_before = s.cache().stats().daemon_evictions + s.cache().stats().totals.evictions;
        let aead_at = spec.split('|').position(|p| p.trim().starts_with("aead")).unwrap();
        let top = s.top().create("plans.txt").unwrap();
        let mut text = Vec::new();
        while text.len() < 3 << 20 {
            text.extend_from_slice(SECRET);
            text.push(b'\n');
        }
        top.write_at(&text, 0).unwrap();
        {
            let mut m = top.map(0..1 << 20, ubc::Access::ReadWrite, ubc::Sharing::Shared).unwrap();
            m[4096..4096 + SECRET.len()].copy_from_slice(SECRET);
            m.flush().unwrap();
        }
        top.set_len(5 << 20).unwrap();
        top.write_at(SECRET, (4 << 20) + 17).unwrap();
        s.top().rename("plans.txt", "renamed.txt").unwrap();
        let st = s.cache().stats();
        assert!(
            st.daemon_evictions + st.totals.evictions > evictions_before,
            "pages were evicted before any sync: {st:?}"
        );
        for phase in ["before sync", "after sync"] {
            for level in 0..aead_at {
                let f = s.layer(level).unwrap().open("renamed.txt").unwrap();
                let mut v = vec![0u8; f.len().unwrap() as usize];
                f.read_exact_at(&mut v, 0).unwrap();
                assert!(!contains(&v, &SECRET[..12]), "{order}: layer {level} holds cleartext {phase}");
            }
            for (p, bytes) in host_files(&data) {
                assert!(!contains(&bytes, &SECRET[..12]), "{order}: host file {} holds cleartext {phase}", p.display());
            }
            top.sync().unwrap();
        }
        // And the top still reads it all.
        let mut back = vec![0u8; SECRET.len()];
        top.read_exact_at(&mut back, (4 << 20) + 17).unwrap();
        assert_eq!(back, SECRET);
    }
}

#[test]
fn keys_are_wiped_when_dropped() {
    fn zeroize_on_drop<T: zeroize::ZeroizeOnDrop>() {}
    zeroize_on_drop::<Key>();
    let mut slot = std::mem::MaybeUninit::new(Key::from_bytes([0x5a; 32]));
    // SAFETY: the key is initialized; after drop_in_place its bytes are only inspected as
    // plain bytes of memory we still own, never used as a Key.
    let after = unsafe {
        std::ptr::drop_in_place(slot.as_mut_ptr());
        std::slice::from_raw_parts(slot.as_ptr() as *const u8, std::mem::size_of::<Key>()).to_vec()
    };
    assert!(after.iter().all(|&b| b == 0), "key bytes left in memory after drop: {after:02x?}");
    // Debug never shows key bytes.
    assert!(!format!("{:?}", Key::from_bytes([0xab; 32])).to_lowercase().contains("ab"));
}

/// An outside directory with a secret, a lower and an upper directory full of traps.
struct Trap {
    _tmp: tempfile::TempDir,
    outside: PathBuf,
    lower: PathBuf,
    upper: PathBuf,
}

const OUTSIDE_SECRET: &[u8] = b"outside the stack\n";

fn trap() -> Trap {
    let tmp = tempfile::tempdir().unwrap();
    let [outside, lower, upper] = ["outside", "lower", "upper"].map(|d| tmp.path().join(d));
    for d in [&outside, &lower, &upper] {
        std::fs::create_dir(d).unwrap();
    }
    std::fs::write(outside.join("secret"), OUTSIDE_SECRET).unwrap();
    // Links to the outside in both branches: to the directory and to the file.
    for d in [&lower, &upper] {
        symlink(&outside, d.join("dirlink")).unwrap();
        symlink(outside.join("secret"), d.join("filelink")).unwrap();
        symlink("../outside/secret", d.join("rellink")).unwrap();
    }
    // A lower directory the upper shadows with a link (copy-up must not follow it), and a
    // lower file whose copy-up temporary name is a planted link.
    std::fs::create_dir(lower.join("d")).unwrap();
    std::fs::write(lower.join("d/f"), b"lower d/f\n").unwrap();
    symlink(&outside, upper.join("d")).unwrap();
    std::fs::write(lower.join("g"), b"lower g\n").unwrap();
    symlink(outside.join("secret"), upper.join(".ubc-copyup.g")).unwrap();
    Trap { _tmp: tmp, outside, lower, upper }
}

fn outside_untouched(t: &Trap, what: &str) {
    let names: Vec<_> = std::fs::read_dir(&t.outside).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("secret")], "{what}: a file appeared outside");
    assert_eq!(std::fs::read(t.outside.join("secret")).unwrap(), OUTSIDE_SECRET, "{what}: the outside file changed");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(t.outside.join("secret")).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644, "{what}: the outside file's mode changed");
}

#[test]
fn neither_dir_nor_union_can_be_led_outside_their_directories() {
    let t = trap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(t.outside.join("secret"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let specs = [
        format!("dir:{}", t.upper.display()),
        format!("dir:{} | union:upper={}", t.lower.display(), t.upper.display()),
    ];
    for spec in &specs {
        let s = Stack::open(spec, cache()).unwrap();
        let top = s.top();
        let rw = OpenOptions::new().write(true);
        let rwc = OpenOptions::new().write(true).create(true);
        let paths = [
            "../outside/secret",
            "d/../../outside/secret",
            "/../outside/secret",
            "dirlink/secret",
            "filelink",
            "rellink",
            "d/f",
            "d/new",
            "dirlink/new",
        ];
        for p in paths {
            let what = format!("{spec}: {p}");
            if let Ok(f) = top.open(p) {
                let mut v = vec![0u8; 64];
                let n = f.read_at(&mut v, 0).unwrap_or(0);
                assert!(!contains(&v[..n], b"outside the stack"), "{what}: read the outside file");
            }
            if let Ok(f) = top.open_with(p, rw) {
                let _ = f.write_at(b"PWNED", 0);
                let _ = f.sync();
            }
            if let Ok(f) = top.open_with(p, rwc) {
                let _ = f.write_at(b"PWNED", 0);
                let _ = f.sync();
            }
            let _ = top.create(p);
            let _ = top.setattr(p, &SetAttr::new().with_mode(0o666));
            let _ = top.setattr(p, &SetAttr::new().with_size(0));
            let _ = top.mkdir(&format!("{p}x"));
            if let Ok(list) = top.readdir(p) {
                assert!(!list.iter().any(|e| e.name == "secret"), "{what}: listed the outside directory");
            }
            outside_untouched(&t, &what);
        }
        // Renames into and out of a link to the outside.
        let _ = top.create("mine");
        let _ = top.rename("mine", "dirlink/mine");
        let _ = top.rename("dirlink/secret", "stolen");
        let _ = top.remove("dirlink/secret");
        // A writable open of a lower file copies it up: through a planted temporary link
        // it must not write the outside file.
        if let Ok(f) = top.open_with("g", rw) {
            let _ = f.write_at(b"PWNED", 0);
            let _ = f.sync();
        }
        outside_untouched(&t, &format!("{spec}: renames and copy-up"));
    }
}

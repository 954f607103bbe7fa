//! Extended attributes through the aead layer: stored encrypted under keyed-hash names in
//! the layer below, authenticated on every read (docs/formats.md, "Extended attributes below
//! the encryption layer").

use std::path::{Path, PathBuf};
use ubc_stack::encrypt::xattr::STORED_PREFIX;
use ubc_stack::encrypt::{AuthError, Failure, Key};
use ubc_stack::{Error, Stack};

struct Fixture {
    _tmp: tempfile::TempDir,
    data: PathBuf,
    keyfile: PathBuf,
    other_key: PathBuf,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let keyfile = tmp.path().join("key");
    Key::generate().write_file(&keyfile).unwrap();
    let other_key = tmp.path().join("other");
    Key::generate().write_file(&other_key).unwrap();
    Fixture { _tmp: tmp, data, keyfile, other_key }
}

/// The stacks under test, as spec tails after `dir:DATA | aead:keyfile=KEY`.
const TAILS: [&str; 2] = ["", " | zstd"];

fn stack(fx: &Fixture, key: &Path, tail: &str) -> Stack {
    let spec = format!("dir:{} | aead:keyfile={}{tail}", fx.data.display(), key.display());
    Stack::open(&spec, ubc::Cache::new(16 << 20).unwrap()).unwrap()
}

/// A file `name` with some data, written through the stack.
fn file(s: &Stack, name: &str) {
    let f = s.top().create(name).unwrap();
    f.write_at(b"data", 0).unwrap();
    f.sync().unwrap();
}

/// The host's raw extended attributes of `path` (no link followed): (name, value).
fn raw(path: &Path) -> Vec<(String, Vec<u8>)> {
    let mut names = vec![0u8; 64 << 10];
    let n = rustix::fs::llistxattr(path, &mut names[..]).unwrap();
    names[..n]
        .split(|&b| b == 0)
        .filter(|x| !x.is_empty())
        .map(|x| {
            let name = String::from_utf8(x.to_vec()).unwrap();
            let mut v = vec![0u8; 64 << 10];
            let m = rustix::fs::lgetxattr(path, name.as_str(), &mut v[..]).unwrap();
            v.truncate(m);
            (name, v)
        })
        .collect()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// The AuthError inside a stack error (after checking it maps to EIO).
fn auth_of(e: &Error) -> AuthError {
    assert!(e.is_auth(), "not an authentication error: {e}");
    assert_eq!(e.errno(), libc::EIO, "{e}");
    let Error::Io { source, .. } = e else { panic!("not an Io error: {e:?}") };
    source.get_ref().and_then(|i| i.downcast_ref::<AuthError>()).unwrap().clone()
}

const BIG: usize = 3000;

fn big() -> Vec<u8> {
    (0..BIG).map(|i| (i * 7 % 251) as u8).collect()
}

#[test]
fn set_get_list_remove_through_every_aead_stack() {
    for tail in TAILS {
        let fx = fixture();
        let s = stack(&fx, &fx.keyfile, tail);
        let top = s.top();
        file(&s, "f");
        top.mkdir("d").unwrap();
        top.setxattr("f", "user.greeting", b"hello", 0).unwrap();
        top.setxattr("f", "user.empty", b"", 0).unwrap();
        top.setxattr("f", "user.big", &big(), 0).unwrap();
        top.setxattr("d", "user.on-a-dir", b"dirvalue", 0).unwrap();
        assert_eq!(top.getxattr("f", "user.greeting").unwrap(), b"hello", "{tail}");
        assert_eq!(top.getxattr("f", "user.empty").unwrap(), b"", "{tail}");
        assert_eq!(top.getxattr("f", "user.big").unwrap(), big(), "{tail}");
        assert_eq!(top.getxattr("d", "user.on-a-dir").unwrap(), b"dirvalue", "{tail}");
        assert_eq!(sorted(top.listxattr("f").unwrap()), ["user.big", "user.empty", "user.greeting"], "{tail}");
        assert_eq!(top.listxattr("d").unwrap(), ["user.on-a-dir"], "{tail}");
        // Replacing changes the value; the data is untouched.
        top.setxattr("f", "user.greeting", b"bye", 0).unwrap();
        assert_eq!(top.getxattr("f", "user.greeting").unwrap(), b"bye", "{tail}");
        let mut buf = [0u8; 4];
        top.open("f").unwrap().read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"data");
        // Removed: ENODATA on get and on a second remove, as on the host.
        top.removexattr("f", "user.greeting").unwrap();
        assert_eq!(top.getxattr("f", "user.greeting").unwrap_err().errno(), libc::ENODATA, "{tail}");
        assert_eq!(top.removexattr("f", "user.greeting").unwrap_err().errno(), libc::ENODATA, "{tail}");
        assert_eq!(top.getxattr("f", "user.never").unwrap_err().errno(), libc::ENODATA, "{tail}");
        assert_eq!(sorted(top.listxattr("f").unwrap()), ["user.big", "user.empty"], "{tail}");
        // An empty file (no aead header on the store) and a hard link (one stored file).
        top.create("empty").unwrap();
        top.setxattr("empty", "user.x", b"1", 0).unwrap();
        assert_eq!(std::fs::metadata(fx.data.join("empty")).unwrap().len(), 0, "no header written");
        top.link("empty", "link").unwrap();
        assert_eq!(top.getxattr("link", "user.x").unwrap(), b"1", "{tail}");
        top.setxattr("link", "user.y", b"2", 0).unwrap();
        assert_eq!(sorted(top.listxattr("empty").unwrap()), ["user.x", "user.y"], "{tail}");
        // Renamed: the attributes go with the file (nothing is bound to the path).
        top.rename("f", "g").unwrap();
        assert_eq!(top.getxattr("g", "user.big").unwrap(), big(), "{tail}");
    }
}

#[test]
fn no_cleartext_name_or_value_reaches_the_store() {
    for tail in TAILS {
        let fx = fixture();
        let s = stack(&fx, &fx.keyfile, tail);
        file(&s, "f");
        s.top().setxattr("f", "user.secretname", b"secretvalue", 0).unwrap();
        s.top().setxattr("f", "trusted.othersecret", b"anothervalue", 0).unwrap();
        s.top().setxattr("f", "user.big", &big(), 0).unwrap();
        let stored = raw(&fx.data.join("f"));
        assert_eq!(stored.len(), 3, "{tail}: one stored attribute per cleartext one");
        for (name, value) in &stored {
            // All in the user namespace, named by a 32-hex-digit hash.
            let hash = name.strip_prefix(STORED_PREFIX).unwrap_or_else(|| panic!("{name}"));
            assert!(hash.len() == 32 && hash.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
            for secret in [&b"secret"[..], b"anothervalue", b"othersecret", b"trusted", &big()[..64]] {
                assert!(!contains(name.as_bytes(), secret), "{tail}: {name}");
                assert!(!contains(value, secret), "{tail}: the value of {name}");
            }
        }
        // The store's own view through the stack (layer 0) is the same.
        let below = sorted(s.layer(0).unwrap().listxattr("f").unwrap());
        assert_eq!(below, sorted(stored.iter().map(|(n, _)| n.clone()).collect()));
    }
}

#[test]
fn a_tampered_or_moved_value_is_an_authentication_error() {
    for tail in TAILS {
        let fx = fixture();
        let s = stack(&fx, &fx.keyfile, tail);
        let top = s.top();
        file(&s, "f");
        file(&s, "g");
        let host = fx.data.join("f");
        top.setxattr("f", "user.a", b"value a", 0).unwrap();
        let (na, va) = raw(&host).remove(0);
        top.setxattr("f", "user.b", b"value b", 0).unwrap();
        let (nb, vb) = raw(&host).into_iter().find(|(n, _)| *n != na).unwrap();
        let set =
            |p: &Path, n: &str, v: &[u8]| rustix::fs::lsetxattr(p, n, v, rustix::fs::XattrFlags::empty()).unwrap();
        let bad_tag = |e: &Error| matches!(auth_of(e), AuthError::Xattr { failure: Failure::BadTag });
        // Every byte of a stored value matters: nonce, sealed name and value, tag.
        for i in 0..va.len() {
            let mut t = va.clone();
            t[i] ^= 0x40;
            set(&host, &na, &t);
            assert!(bad_tag(&top.getxattr("f", "user.a").unwrap_err()), "{tail}: byte {i}");
            // A listing does not pass over it either: hiding it would hide the tampering.
            assert!(bad_tag(&top.listxattr("f").unwrap_err()), "{tail}: byte {i}");
        }
        // The other attribute still reads.
        assert_eq!(top.getxattr("f", "user.b").unwrap(), b"value b");
        // Cut shorter than nonce, name length and tag.
        set(&host, &na, &va[..20]);
        let e = top.getxattr("f", "user.a").unwrap_err();
        assert!(matches!(auth_of(&e), AuthError::Xattr { failure: Failure::Truncated }), "{tail}");
        // Values swapped between the two stored names: both fail (the AAD holds the name).
        set(&host, &na, &vb);
        set(&host, &nb, &va);
        assert!(bad_tag(&top.getxattr("f", "user.a").unwrap_err()), "{tail}");
        assert!(bad_tag(&top.getxattr("f", "user.b").unwrap_err()), "{tail}");
        // Restored, they read again.
        set(&host, &na, &va);
        set(&host, &nb, &vb);
        assert_eq!(top.getxattr("f", "user.a").unwrap(), b"value a");
        assert_eq!(top.getxattr("f", "user.b").unwrap(), b"value b");
        // A documented limit: a stored attribute copied to another file authenticates there
        // (values are not bound to the file: directories and empty files have no file id).
        set(&fx.data.join("g"), &na, &va);
        assert_eq!(top.getxattr("g", "user.a").unwrap(), b"value a");
    }
}

#[test]
fn create_and_replace_flags_keep_their_meaning() {
    for tail in TAILS {
        let fx = fixture();
        let s = stack(&fx, &fx.keyfile, tail);
        let top = s.top();
        file(&s, "f");
        assert_eq!(top.setxattr("f", "user.k", b"v", libc::XATTR_REPLACE).unwrap_err().errno(), libc::ENODATA);
        top.setxattr("f", "user.k", b"v1", libc::XATTR_CREATE).unwrap();
        assert_eq!(top.setxattr("f", "user.k", b"v2", libc::XATTR_CREATE).unwrap_err().errno(), libc::EEXIST);
        assert_eq!(top.getxattr("f", "user.k").unwrap(), b"v1", "{tail}");
        top.setxattr("f", "user.k", b"v3", libc::XATTR_REPLACE).unwrap();
        assert_eq!(top.getxattr("f", "user.k").unwrap(), b"v3", "{tail}");
    }
}

#[test]
fn names_the_layer_does_not_store_and_sizes_the_store_refuses() {
    for tail in TAILS {
        let fx = fixture();
        let s = stack(&fx, &fx.keyfile, tail);
        let top = s.top();
        file(&s, "f");
        // ACLs are interpreted by the kernel: refused, never stored as opaque data.
        for name in ["system.posix_acl_access", "system.posix_acl_default", "nonamespace", "user."] {
            assert_eq!(top.setxattr("f", name, b"x", 0).unwrap_err().errno(), libc::EOPNOTSUPP, "{name}");
            assert_eq!(top.getxattr("f", name).unwrap_err().errno(), libc::EOPNOTSUPP, "{name}");
            assert_eq!(top.removexattr("f", name).unwrap_err().errno(), libc::EOPNOTSUPP, "{name}");
        }
        // Longer than XATTR_NAME_MAX: ERANGE, as the kernel answers.
        let long = format!("user.{}", "n".repeat(251));
        assert_eq!(top.setxattr("f", &long, b"x", 0).unwrap_err().errno(), libc::ERANGE);
        let longest = format!("user.{}", "n".repeat(250));
        top.setxattr("f", &longest, b"x", 0).unwrap();
        assert_eq!(top.getxattr("f", &longest).unwrap(), b"x");
        // A value whose stored form the store cannot hold: the store's error.
        let e = top.setxattr("f", "user.huge", &vec![1u8; 65536], 0).unwrap_err();
        assert!([libc::E2BIG, libc::ENOSPC].contains(&e.errno()), "{tail}: {e}");
        // Attributes of the store without the prefix are not this layer's: not shown, and
        // a cleartext name of the same spelling does not reach them.
        rustix::fs::lsetxattr(fx.data.join("f"), "user.plain", b"p", rustix::fs::XattrFlags::empty()).unwrap();
        assert_eq!(top.listxattr("f").unwrap(), vec![longest.clone()], "{tail}");
        assert_eq!(top.getxattr("f", "user.plain").unwrap_err().errno(), libc::ENODATA);
    }
}

#[test]
fn another_stack_with_the_key_reads_them_and_another_key_fails() {
    for tail in TAILS {
        let fx = fixture();
        {
            let s = stack(&fx, &fx.keyfile, tail);
            file(&s, "f");
            s.top().setxattr("f", "user.kept", b"across opens", 0).unwrap();
            s.top().setxattr("f", "security.label", &big(), 0).unwrap();
        }
        let again = stack(&fx, &fx.keyfile, tail);
        assert_eq!(again.top().getxattr("f", "user.kept").unwrap(), b"across opens", "{tail}");
        assert_eq!(again.top().getxattr("f", "security.label").unwrap(), big(), "{tail}");
        assert_eq!(sorted(again.top().listxattr("f").unwrap()), ["security.label", "user.kept"]);
        // Another key hashes names differently (the name is not found: ENODATA), and a
        // listing opens every stored value (each fails authentication).
        let wrong = stack(&fx, &fx.other_key, tail);
        assert_eq!(wrong.top().getxattr("f", "user.kept").unwrap_err().errno(), libc::ENODATA, "{tail}");
        let e = wrong.top().listxattr("f").unwrap_err();
        assert!(matches!(auth_of(&e), AuthError::Xattr { failure: Failure::BadTag }), "{tail}");
    }
}

#[test]
fn a_union_over_aead_shows_the_lower_attributes_and_copies_them_up() {
    let fx = fixture();
    let upper = fx._tmp.path().join("upper");
    std::fs::create_dir(&upper).unwrap();
    {
        let s = stack(&fx, &fx.keyfile, "");
        for f in ["f", "g"] {
            file(&s, f);
            s.top().setxattr(f, "user.low", b"from below", 0).unwrap();
        }
        s.top().mkdir("d").unwrap();
        s.top().setxattr("d", "user.dirlow", b"dir below", 0).unwrap();
        s.top().setattr("g", &ubc_stack::SetAttr::new().with_mode(0o444)).unwrap();
    }
    let s = stack(&fx, &fx.keyfile, &format!(" | union:upper={}", upper.display()));
    let top = s.top();
    assert_eq!(top.getxattr("f", "user.low").unwrap(), b"from below");
    assert_eq!(top.listxattr("f").unwrap(), ["user.low"]);
    // Copied up by an attribute change: the lower attributes come along, decrypted (the
    // upper directory is the union's cleartext store).
    top.setxattr("f", "user.up", b"new", 0).unwrap();
    assert_eq!(sorted(top.listxattr("f").unwrap()), ["user.low", "user.up"]);
    assert_eq!(top.getxattr("f", "user.low").unwrap(), b"from below");
    assert_eq!(raw(&upper.join("f")).len(), 2);
    // Copied up by a write, read-only mode and all; and a directory by a chmod.
    let h = s.top().open_with("g", ubc_stack::OpenOptions::new().write(true)).unwrap();
    h.write_at(b"D", 0).unwrap();
    h.sync().unwrap();
    drop(h);
    assert!(upper.join("g").exists());
    assert_eq!(top.getxattr("g", "user.low").unwrap(), b"from below");
    top.setattr("d", &ubc_stack::SetAttr::new().with_mode(0o555)).unwrap();
    assert!(upper.join("d").exists());
    assert_eq!(top.getxattr("d", "user.dirlow").unwrap(), b"dir below");
    assert_eq!(top.getattr("d").unwrap().mode, 0o555);
}

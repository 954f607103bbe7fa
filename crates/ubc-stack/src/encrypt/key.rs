//! Master keys: generation, key files and passphrase derivation.
//!
//! A [`Key`] is the one secret of the aead layer. It lives in memory only as long as the
//! value does and is wiped on drop ([`ZeroizeOnDrop`]); its `Debug` form prints no key
//! bytes, so a key can never reach a log through `{:?}`. Every temporary copy made here
//! (hex text, Argon2 output) is wiped as well.

use std::io::{self, Read, Write};
use std::path::Path;
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

/// Argon2id memory cost in KiB (64 MiB): RFC 9106's second recommended option.
pub const ARGON2_M_COST_KIB: u32 = 64 * 1024;
/// Argon2id passes over memory.
pub const ARGON2_T_COST: u32 = 3;
/// Argon2id lanes (computed sequentially here; the value is part of the derivation).
pub const ARGON2_P_COST: u32 = 4;

/// Largest key file we read: 64 hex characters and a line ending, with room to report
/// "too long" instead of reading an arbitrary file into memory.
const KEY_FILE_MAX: u64 = 256;

/// A 256-bit master key. Zeroized on drop; `Debug` prints no key bytes.
#[derive(Clone, Zeroize, ZeroizeOnDrop)]
pub struct Key([u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(<redacted>)")
    }
}

impl Key {
    /// A fresh random key from the operating system's CSPRNG.
    ///
    /// # Panics
    /// If the OS random source fails (no usable `getrandom`/`/dev/urandom`): there is no
    /// safe fallback for key material.
    pub fn generate() -> Key {
        let mut k = Key([0u8; 32]);
        getrandom::fill(&mut k.0).expect("OS random number generator failed");
        k
    }

    /// A key from raw bytes. The caller should wipe its own copy of `b`.
    pub fn from_bytes(b: [u8; 32]) -> Key {
        Key(b)
    }

    /// The raw key bytes (for building a cipher). Never print them.
    pub(crate) fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Read a key file: exactly 64 hex characters (either case), optionally followed by one
    /// `\n` (or `\r\n`). Anything else is an `InvalidData` error that names the file and the
    /// problem but never echoes the content.
    pub fn from_file(path: &Path) -> io::Result<Key> {
        let bad = |what: &str| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "key file {}: {what}; expected 64 hex characters and an optional trailing newline",
                    path.display()
                ),
            )
        };
        let f = std::fs::File::open(path)
            .map_err(|e| io::Error::new(e.kind(), format!("key file {}: {e}", path.display())))?;
        let mut text = Zeroizing::new(Vec::with_capacity(KEY_FILE_MAX as usize));
        f.take(KEY_FILE_MAX).read_to_end(&mut text)?;
        let mut body: &[u8] = &text;
        if let Some(b) = body.strip_suffix(b"\n") {
            body = b.strip_suffix(b"\r").unwrap_or(b);
        }
        if body.len() != 64 {
            return Err(bad(&format!("{} characters", body.len())));
        }
        let mut k = Key([0u8; 32]);
        for (i, pair) in body.chunks_exact(2).enumerate() {
            match (hex_val(pair[0]), hex_val(pair[1])) {
                (Some(h), Some(l)) => k.0[i] = (h << 4) | l,
                _ => return Err(bad("a character that is not a hex digit")),
            }
        }
        Ok(k)
    }

    /// Write the key as 64 lowercase hex characters and a newline to a **new** file created
    /// with mode 0600, then fsync it. Refuses (`AlreadyExists`) to overwrite an existing
    /// file: replacing a key file loses every file encrypted under the old key.
    pub fn write_file(&self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| io::Error::new(e.kind(), format!("key file {}: {e}", path.display())))?;
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut text = Zeroizing::new([0u8; 65]);
        for (i, b) in self.0.iter().enumerate() {
            text[2 * i] = HEX[(b >> 4) as usize];
            text[2 * i + 1] = HEX[(b & 15) as usize];
        }
        text[64] = b'\n';
        f.write_all(&text[..])?;
        f.sync_all()
    }

    /// Derive a key from a passphrase with Argon2id (version 0x13, m = 64 MiB, t = 3, p = 4,
    /// 32-byte output; see [`ARGON2_M_COST_KIB`] and friends) and the 16-byte `salt`.
    /// Deterministic for the same passphrase and salt. Takes a fraction of a second in a
    /// release build (much longer in debug) and 64 MiB of memory, which is wiped after.
    pub fn from_passphrase(pass: &[u8], salt: &[u8; 16]) -> io::Result<Key> {
        let params = argon2::Params::new(ARGON2_M_COST_KIB, ARGON2_T_COST, ARGON2_P_COST, Some(32))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("argon2 parameters: {e}")))?;
        let a = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
        let mut k = Key([0u8; 32]);
        a.hash_password_into(pass, salt, &mut k.0)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("argon2: {e}")))?;
        Ok(k)
    }
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

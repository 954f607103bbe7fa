//! Extended attributes through the aead layer: each cleartext attribute is stored as one
//! attribute of the lower file whose name is a keyed hash of the cleartext name and whose
//! value is the cleartext name and value sealed with XChaCha20-Poly1305.
//!
//! # Why this shape
//!
//! * **One stored attribute per cleartext attribute, named by a keyed hash.** get, set and
//!   remove find the stored attribute from the cleartext name alone (one lower call, no
//!   listing), and `XATTR_CREATE`/`XATTR_REPLACE` keep their meaning because they apply to
//!   the stored name one to one. The hash is keyed (BLAKE2b with a key derived from the
//!   master key), so a guessed name cannot be confirmed without the key.
//! * **The stored name is in the `user.` namespace whatever the cleartext namespace.** It
//!   reveals nothing about the namespace, and the daemon needs no privilege on the store
//!   (`trusted.*` below would need `CAP_SYS_ADMIN` in the daemon). The kernel checks the
//!   caller's right to a `trusted.`/`security.` name before the request reaches the mount.
//! * **The cleartext name is inside the sealed value.** `listxattr` can answer from the
//!   stored attributes alone (a hash cannot be inverted), and `getxattr` checks that the
//!   value it opened is the one for the name asked.
//! * **AAD = label ‖ stored name.** A value moved to another stored name fails
//!   authentication. It is *not* bound to the file (directories and empty files have no
//!   aead header, hence no file id): a value copied to another file by someone with store
//!   access authenticates there (documented in docs/formats.md).
//!
//! The exact bytes are in `docs/formats.md`, "Extended attributes below the encryption
//! layer".

use super::{AuthError, Failure, Key, NONCE_LEN, TAG_LEN, random};
use blake2::Blake2bMac;
use blake2::digest::consts::{U16, U32};
use blake2::digest::{FixedOutput, Update};
use chacha20poly1305::{AeadInOut, KeyInit, Tag, XChaCha20Poly1305, XNonce};
use std::io;
use std::sync::Arc;
use zeroize::Zeroize;

/// Every stored name starts with this; lower attributes without it are not the layer's.
pub const STORED_PREFIX: &str = "user.ubc-aead.";
/// Bytes of the keyed name hash (shown as twice as many lowercase hex digits).
pub const NAME_HASH_LEN: usize = 16;
/// Bytes a stored value adds to the cleartext name and value: nonce, name length, tag.
pub const OVERHEAD: usize = NONCE_LEN + 2 + TAG_LEN;
/// Longest cleartext name (Linux `XATTR_NAME_MAX`).
pub const NAME_MAX: usize = 255;
/// BLAKE2b personalization of the name hash (16 bytes).
const NAME_PERSONA: &[u8; 16] = b"ubc-aead1 xname\0";
/// BLAKE2b personalization of the value key derivation (16 bytes).
const KEY_PERSONA: &[u8; 16] = b"ubc-aead1 xkey\0\0";
/// First part of every value's AAD (16 bytes); the stored name follows.
const VALUE_DOMAIN: &[u8; 16] = b"ubc-aead1 xattr\0";

/// The namespaces stored through aead. `system.*` (POSIX ACLs, …) is refused: the kernel
/// interprets those values itself and cannot be given an encrypted one, and storing them
/// as opaque user data would silently drop what they enforce.
const STORED_NAMESPACES: [&str; 3] = ["user.", "trusted.", "security."];

/// Whether the cleartext `name` may be stored through aead (its namespace is one of
/// `user.`, `trusted.`, `security.`, with a non-empty rest).
pub fn storable(name: &str) -> bool {
    STORED_NAMESPACES.iter().any(|ns| name.len() > ns.len() && name.starts_with(ns))
}

/// The keys of one aead layer's extended attributes: the master key (for the name hash)
/// and the value cipher under a key derived from it.
pub struct XattrCrypt {
    key: Arc<Key>,
    cipher: XChaCha20Poly1305,
}

impl XattrCrypt {
    /// Value key = BLAKE2b-256(key = master key, personalization `"ubc-aead1 xkey"`, empty
    /// message): independent of the data key (the master key itself) and of the name hash.
    pub fn new(key: Arc<Key>) -> XattrCrypt {
        let mut mac = Blake2bMac::<U32>::new_with_salt_and_personal(Some(key.bytes()), &[], KEY_PERSONA)
            .expect("32-byte key and 16-byte personalization are valid BLAKE2b parameters");
        mac.update(&[]);
        let mut k = mac.finalize_fixed();
        let cipher = XChaCha20Poly1305::new_from_slice(&k).expect("32-byte key");
        k.as_mut_slice().zeroize();
        XattrCrypt { key, cipher }
    }

    /// The stored name of cleartext `name`: `user.ubc-aead.` ‖ lowercase hex of
    /// BLAKE2b-128(key = master key, personalization `"ubc-aead1 xname"`, message = name).
    pub fn stored_name(&self, name: &str) -> String {
        let mut mac = Blake2bMac::<U16>::new_with_salt_and_personal(Some(self.key.bytes()), &[], NAME_PERSONA)
            .expect("32-byte key and 16-byte personalization are valid BLAKE2b parameters");
        mac.update(name.as_bytes());
        let h = mac.finalize_fixed();
        let mut s = String::with_capacity(STORED_PREFIX.len() + 2 * NAME_HASH_LEN);
        s.push_str(STORED_PREFIX);
        for b in h.iter() {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    /// The stored value of (`name`, `value`) under `stored` (= `self.stored_name(name)`):
    /// nonce ‖ ciphertext of (u16 LE name length ‖ name ‖ value) ‖ tag.
    /// => `name.len() <= NAME_MAX`.
    pub fn seal(&self, stored: &str, name: &str, value: &[u8]) -> io::Result<Vec<u8>> {
        debug_assert!(name.len() <= NAME_MAX);
        let mut out = vec![0u8; OVERHEAD + name.len() + value.len()];
        random(&mut out[..NONCE_LEN])?;
        let nonce = XNonce::try_from(&out[..NONCE_LEN]).expect("24 bytes");
        let body_end = out.len() - TAG_LEN;
        let body = &mut out[NONCE_LEN..body_end];
        body[..2].copy_from_slice(&(name.len() as u16).to_le_bytes());
        body[2..2 + name.len()].copy_from_slice(name.as_bytes());
        body[2 + name.len()..].copy_from_slice(value);
        let tag = self
            .cipher
            .encrypt_inout_detached(&nonce, &aad(stored), body.into())
            .map_err(|_| io::Error::other("aead: sealing an extended attribute failed"))?;
        out[body_end..].copy_from_slice(&tag);
        Ok(out)
    }

    /// Authenticate and decrypt the value `sealed` stored under `stored`: the cleartext name
    /// and value, or an [`AuthError::Xattr`] (`Truncated`: shorter than the overhead;
    /// `BadTag`: modified, moved from another stored name, or a wrong key; `BadVersion`: an
    /// authentic value whose name length or name does not parse — not written by this
    /// format).
    pub fn open(&self, stored: &str, sealed: &[u8]) -> Result<(String, Vec<u8>), AuthError> {
        let fail = |failure| AuthError::Xattr { failure };
        if sealed.len() < OVERHEAD {
            return Err(fail(Failure::Truncated));
        }
        let nonce = XNonce::try_from(&sealed[..NONCE_LEN]).expect("24 bytes");
        let tag = Tag::try_from(&sealed[sealed.len() - TAG_LEN..]).expect("16 bytes");
        let mut body = sealed[NONCE_LEN..sealed.len() - TAG_LEN].to_vec();
        if self.cipher.decrypt_inout_detached(&nonce, &aad(stored), (&mut body[..]).into(), &tag).is_err() {
            body.zeroize();
            return Err(fail(Failure::BadTag));
        }
        let n = u16::from_le_bytes([body[0], body[1]]) as usize;
        if 2 + n > body.len() {
            body.zeroize();
            return Err(fail(Failure::BadVersion));
        }
        let Ok(name) = String::from_utf8(body[2..2 + n].to_vec()) else {
            body.zeroize();
            return Err(fail(Failure::BadVersion));
        };
        let value = body[2 + n..].to_vec();
        body.zeroize();
        Ok((name, value))
    }
}

/// AAD of a stored value: `"ubc-aead1 xattr\0"` ‖ the stored name.
fn aad(stored: &str) -> Vec<u8> {
    let mut a = Vec::with_capacity(VALUE_DOMAIN.len() + stored.len());
    a.extend_from_slice(VALUE_DOMAIN);
    a.extend_from_slice(stored.as_bytes());
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crypt(b: u8) -> XattrCrypt {
        XattrCrypt::new(Arc::new(Key::from_bytes([b; 32])))
    }

    #[test]
    fn round_trip_and_failures() {
        let x = crypt(1);
        let s = x.stored_name("user.a");
        assert!(s.starts_with(STORED_PREFIX) && s.len() == STORED_PREFIX.len() + 32);
        assert_eq!(s, x.stored_name("user.a"), "deterministic");
        assert_ne!(s, x.stored_name("user.b"));
        assert_ne!(s, crypt(2).stored_name("user.a"), "keyed");
        for v in [&b""[..], b"hello", &[7u8; 5000][..]] {
            let sealed = x.seal(&s, "user.a", v).unwrap();
            assert_eq!(sealed.len(), OVERHEAD + 6 + v.len());
            assert_eq!(x.open(&s, &sealed).unwrap(), ("user.a".to_string(), v.to_vec()));
            // Every byte matters: nonce, name length, name, value, tag.
            for i in 0..sealed.len() {
                let mut t = sealed.clone();
                t[i] ^= 1;
                assert!(matches!(x.open(&s, &t), Err(AuthError::Xattr { failure: Failure::BadTag })), "byte {i}");
            }
            let other = x.stored_name("user.b");
            assert!(matches!(x.open(&other, &sealed), Err(AuthError::Xattr { failure: Failure::BadTag })));
            assert!(matches!(crypt(2).open(&s, &sealed), Err(AuthError::Xattr { failure: Failure::BadTag })));
            assert!(matches!(
                x.open(&s, &sealed[..OVERHEAD - 1]),
                Err(AuthError::Xattr { failure: Failure::Truncated })
            ));
        }
        // Fresh nonce per seal.
        assert_ne!(x.seal(&s, "user.a", b"v").unwrap(), x.seal(&s, "user.a", b"v").unwrap());
    }

    #[test]
    fn value_key_is_not_the_data_key() {
        // The same plaintext sealed with the master key directly (as blocks are) must not
        // open: the value key is derived, not the data key.
        let key = Key::from_bytes([3; 32]);
        let data = XChaCha20Poly1305::new_from_slice(key.bytes()).unwrap();
        let x = XattrCrypt::new(Arc::new(key));
        let s = x.stored_name("user.a");
        let mut sealed = vec![0u8; OVERHEAD + 7];
        let end = sealed.len() - TAG_LEN;
        sealed[NONCE_LEN..NONCE_LEN + 2].copy_from_slice(&6u16.to_le_bytes());
        sealed[NONCE_LEN + 2..end].copy_from_slice(b"user.av");
        let nonce = XNonce::try_from(&sealed[..NONCE_LEN]).unwrap();
        let tag = data.encrypt_inout_detached(&nonce, &aad(&s), (&mut sealed[NONCE_LEN..end]).into()).unwrap();
        sealed[end..].copy_from_slice(&tag);
        assert!(matches!(x.open(&s, &sealed), Err(AuthError::Xattr { failure: Failure::BadTag })));
    }

    #[test]
    fn namespaces() {
        for ok in ["user.a", "trusted.x", "security.capability"] {
            assert!(storable(ok), "{ok}");
        }
        for no in ["system.posix_acl_access", "user.", "a", "", "osx.x"] {
            assert!(!storable(no), "{no}");
        }
    }
}

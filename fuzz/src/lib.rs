//! The fuzz cases, shared by the libFuzzer targets (`fuzz_targets/`) and the seed corpus
//! generator. Each takes arbitrary bytes and must never panic, hang or abort; wrong answers
//! that the formats promise not to give are turned into panics (crashes) here.
//!
//! Inputs:
//! * `zstd_case`: byte 0 picks the chunk size (4 KiB << (b % 5)), byte 1 holds flags (bit 0:
//!   write, sync and reopen after reading; bit 1: fix the superblock and index checksums
//!   first, so the fuzzer gets past them), the rest is the stored file.
//! * `aead_case`: byte 0 holds flags (bit 0: write, sync and reopen; bit 1: re-seal the
//!   header with the fuzz key, so its fields are explored), the rest is the stored file.
//! * `spec_case`: the bytes as a spec string.
//!
//! The stored bytes live in a memory pager under one long-lived cache (fast: no threads
//! started per input).

use chacha20poly1305::{AeadInOut, KeyInit, XChaCha20Poly1305, XNonce};
use std::sync::{Arc, OnceLock};
use ubc::pager::MemPager;
use ubc::{Access, Cache, Pager};
use ubc_stack::compress::{CompressOptions, CompressPager};
use ubc_stack::encrypt::{AuthError, EncryptPager, Key};

/// The key every aead input is read with (seeds are made with it).
pub const KEY: [u8; 32] = [0x42; 32];

pub fn cache() -> &'static Cache {
    static C: OnceLock<Cache> = OnceLock::new();
    C.get_or_init(|| Cache::builder().budget(64 << 20).build().expect("cache"))
}

/// A lower file holding `bytes`, in memory.
pub fn lower_with(bytes: &[u8]) -> ubc::File {
    let f = cache().open(Arc::new(MemPager::new()), Access::ReadWrite).expect("open");
    if !bytes.is_empty() {
        f.write_at(bytes, 0).expect("write");
    }
    f
}

fn u64le(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Recompute the index checksum (if the index lies inside the file) and the superblock
/// checksum of every slot that has the magic.
pub fn fix_zstd_crcs(b: &mut [u8]) {
    for s in [0usize, 4096] {
        if b.len() < s + 68 || &b[s..s + 8] != b"UBCZSTD1" {
            continue;
        }
        let (off, len) = (u64le(b, s + 32), u64le(b, s + 40));
        if let Some(end) = off.checked_add(len)
            && end <= b.len() as u64
        {
            let crc = crc32fast::hash(&b[off as usize..end as usize]);
            b[s + 48..s + 52].copy_from_slice(&crc.to_le_bytes());
        }
        let crc = crc32fast::hash(&b[s..s + 64]);
        b[s + 64..s + 68].copy_from_slice(&crc.to_le_bytes());
    }
}

/// Check a pager error: `InvalidData` from the zstd layer, or an I/O error passed up.
fn zstd_error_ok(e: &std::io::Error) {
    assert!(
        e.kind() == std::io::ErrorKind::InvalidData && e.to_string().contains("zstd layer"),
        "untyped zstd error: {e:?}"
    );
}

/// `get_pages` as the cache sees it: a hole is zeros (the pager leaves `buf` alone).
fn get(p: &dyn Pager, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
    if let ubc::Fill::Hole = p.get_pages(off, buf)? {
        buf.fill(0);
    }
    Ok(())
}

/// Read chunks of `p` (the first 64, some partial pages, the last); returns chunk 0 if read.
fn read_zstd(p: &CompressPager) -> Option<Vec<u8>> {
    let len = p.len().unwrap();
    let cs = p.stored_stats().chunk_size as u64;
    let mut buf = vec![0u8; cs as usize];
    let mut first = None;
    let last = len.saturating_sub(1) / cs * cs;
    for off in (0..len.min(64 * cs)).step_by(cs as usize).chain([last]) {
        match get(p, off, &mut buf) {
            Ok(_) if off == 0 => first = Some(buf.clone()),
            Ok(_) => {}
            Err(e) => zstd_error_ok(&e),
        }
        // A page in the middle of the chunk: a partial-chunk decode.
        let mut page = [0u8; 4096];
        match get(p, off + cs / 2, &mut page) {
            Ok(_) => {}
            Err(e) => zstd_error_ok(&e),
        }
    }
    first
}

pub fn zstd_case(data: &[u8]) {
    if data.len() < 2 {
        return;
    }
    let opts = CompressOptions::default().with_chunk_size(4096 << (data[0] % 5)).with_level(1);
    let flags = data[1];
    let mut stored = data[2..].to_vec();
    if flags & 2 != 0 {
        fix_zstd_crcs(&mut stored);
    }
    let lower = lower_with(&stored);
    let _ = CompressPager::logical_len(&lower);
    let p = match CompressPager::open(lower.try_clone().unwrap(), opts) {
        Ok(p) => p,
        Err(e) => return zstd_error_ok(&e),
    };
    let before = read_zstd(&p);
    if flags & 1 == 0 {
        return;
    }
    // Write a whole chunk (needs no old bytes), commit, reopen: it must read back, and a
    // chunk that read before must read the same.
    let cs = p.stored_stats().chunk_size;
    let len = p.len().unwrap();
    if len > 1 << 40 {
        return;
    }
    let k = (len / cs as u64 + 1) * cs as u64; // past the end: leaves chunk 0 alone
    let chunk = vec![0x5a; cs];
    if p.put_pages(k, &chunk).is_err() || p.sync().is_err() {
        return;
    }
    drop(p);
    let p = CompressPager::open(lower, opts).expect("reopen after a successful commit");
    let mut buf = vec![0u8; cs];
    get(&p, k, &mut buf).expect("read back after a commit");
    assert!(buf == chunk, "written chunk reads back wrong");
    if let Some(b) = before {
        get(&p, 0, &mut buf).expect("chunk 0 read before the commit");
        assert!(buf == b, "chunk 0 changed across a commit");
    }
}

fn aead_error_ok(e: &std::io::Error) {
    assert!(
        e.kind() == std::io::ErrorKind::InvalidData && AuthError::find(e).is_some(),
        "not an authentication error: {e:?}"
    );
}

/// Seal the header's fields (bytes 0..40 as given, nonce 40..64 as given) with the key.
pub fn reseal_aead_header(b: &mut [u8]) {
    let cipher = XChaCha20Poly1305::new(&KEY.into());
    let mut aad = [0u8; 56];
    aad[..16].copy_from_slice(b"ubc-aead1 header");
    aad[16..].copy_from_slice(&b[..40]);
    let nonce = XNonce::try_from(&b[40..64]).unwrap();
    let tag = cipher.encrypt_inout_detached(&nonce, &aad, (&mut [][..]).into()).unwrap();
    b[64..80].copy_from_slice(&tag);
}

pub fn aead_case(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else { return };
    let mut stored = rest.to_vec();
    if flags & 2 != 0 && stored.len() >= 80 {
        reseal_aead_header(&mut stored);
    }
    let key = Arc::new(Key::from_bytes(KEY));
    let lower = lower_with(&stored);
    let _ = EncryptPager::logical_len(&lower, &key);
    let p = match EncryptPager::open(lower.try_clone().unwrap(), key.clone()) {
        Ok(p) => p,
        Err(e) => return aead_error_ok(&e),
    };
    let len = p.len().unwrap();
    let mut block = [0u8; 4096];
    for i in 0..len.div_ceil(4096).min(64) {
        if let Err(e) = get(&p, i * 4096, &mut block) {
            aead_error_ok(&e);
        }
    }
    let mut two = [0u8; 8192];
    if let Err(e) = get(&p, len.saturating_sub(1) / 4096 * 4096, &mut two) {
        aead_error_ok(&e);
    }
    if flags & 1 == 0 || len > 1 << 40 {
        return;
    }
    // Overwrite block 0, sync, reopen: it must read back.
    let data = [0x5au8; 4096];
    if p.put_pages(0, &data).is_err() || p.sync().is_err() {
        return;
    }
    get(&p, 0, &mut block).expect("read back");
    assert!(block == data, "block 0 reads back wrong");
    drop(p);
    let p = EncryptPager::open(lower, key).expect("reopen after a sync");
    get(&p, 0, &mut block).expect("read back after reopen");
    assert!(block == data, "block 0 reads back wrong after reopen");
}

pub fn spec_case(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else { return };
    // An `s3` layer would reach the network: only its options are parsed.
    let s3 = ubc_stack::s3_layers(s);
    if !s3.is_empty() {
        for o in s3 {
            let _ = ubc_stack::layer::s3::S3Options::parse(o);
        }
        return;
    }
    if let Ok(st) = ubc_stack::Stack::open(s, cache().clone()) {
        let _ = st.spec();
        let _ = st.top().getattr("");
        let _ = st.top().open("no-such-file");
    }
}

// ------------------------------------------------------------------ seeds

/// Deterministic bytes: 0 random, 1 text, 2 zeros (the integration tests' generator).
#[path = "../../crates/ubc-stack/tests/common/data.rs"]
mod data;
pub use data::gen_data;

/// A valid compressed file: `writes` (offset, len, seed, kind) with a sync after each
/// group, through a cache file over the pager.
pub fn zstd_image(chunk_shift: u32, groups: &[&[(u64, usize, u64, u8)]]) -> Vec<u8> {
    let lower = lower_with(&[]);
    let opts = CompressOptions::default().with_chunk_size(1 << chunk_shift).with_level(3);
    let p = Arc::new(CompressPager::open(lower.try_clone().unwrap(), opts).unwrap());
    for g in groups {
        for &(off, len, seed, kind) in *g {
            let d = gen_data(seed, len, kind);
            // Whole chunks through the pager (it is not behind a cache here).
            let cs = 1u64 << chunk_shift;
            let (a, b) = (off / cs * cs, (off + len as u64).div_ceil(cs) * cs);
            let mut buf = vec![0u8; (b - a) as usize];
            let _ = p.get_pages(a, &mut buf);
            buf[(off - a) as usize..(off - a) as usize + len].copy_from_slice(&d);
            p.put_pages(a, &buf).unwrap();
        }
        p.sync().unwrap();
    }
    drop(p);
    let mut v = vec![0u8; lower.len().unwrap() as usize];
    lower.read_exact_at(&mut v, 0).unwrap();
    v
}

/// A valid encrypted file with the fuzz key.
pub fn aead_file(content: &[u8]) -> Vec<u8> {
    let lower = lower_with(&[]);
    let p = EncryptPager::open(lower.try_clone().unwrap(), Arc::new(Key::from_bytes(KEY))).unwrap();
    let mut padded = content.to_vec();
    padded.resize(content.len().div_ceil(4096) * 4096, 0);
    if !padded.is_empty() {
        p.put_pages(0, &padded).unwrap();
    }
    p.set_len(content.len() as u64).unwrap();
    p.sync().unwrap();
    drop(p);
    let mut v = vec![0u8; lower.len().unwrap() as usize];
    lower.read_exact_at(&mut v, 0).unwrap();
    v
}

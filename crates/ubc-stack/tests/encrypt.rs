//! The aead layer through a real ubc cache over real host files.

use proptest::prelude::*;
use std::path::Path;
use std::sync::Arc;
use ubc::{Access, Cache, File, Pager};
use ubc_stack::encrypt::{AuthError, BLOCK, EncryptPager, Failure, HEADER_LEN, Key, STORED_BLOCK};

const B: u64 = BLOCK;

fn cache() -> Cache {
    Cache::new(64 << 20).unwrap()
}

/// Open (creating) `path` as the lower file and the encrypted upper file over it.
fn open(cache: &Cache, path: &Path, key: &Arc<Key>) -> std::io::Result<(File, File)> {
    let lower = cache.create_path(path)?;
    let pager = EncryptPager::open(lower.try_clone()?, key.clone())?;
    let upper = cache.open(Arc::new(pager), Access::ReadWrite)?;
    Ok((lower, upper))
}

/// Deterministic, non-repeating test data.
fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn read_all(f: &File) -> Vec<u8> {
    let len = f.len().unwrap() as usize;
    let mut v = vec![0u8; len];
    f.read_exact_at(&mut v, 0).unwrap();
    v
}

fn stored_len(len: u64) -> u64 {
    // A file never made non-empty stores nothing, not even a header.
    if len == 0 { 0 } else { HEADER_LEN + len.div_ceil(B) * STORED_BLOCK }
}

/// Write `content` as a new encrypted file at `path`, sync, and drop the cache.
fn make_file(path: &Path, key: &Arc<Key>, content: &[u8]) {
    let c = cache();
    let (_lower, upper) = open(&c, path, key).unwrap();
    upper.write_at(content, 0).unwrap();
    upper.sync().unwrap();
}

/// The AuthError in a ubc error, after checking it is an I/O error of kind InvalidData.
fn auth_of(e: &ubc::Error) -> AuthError {
    match e {
        ubc::Error::Io { source, .. } => {
            assert_eq!(source.kind(), std::io::ErrorKind::InvalidData, "{e}");
            let inner = source.get_ref().expect("inner error").downcast_ref::<AuthError>().expect("AuthError inside");
            // The generic helper finds it too.
            assert!(AuthError::find(e).is_some());
            inner.clone()
        }
        other => panic!("expected an I/O error, got {other:?}"),
    }
}

fn auth_of_io(e: &std::io::Error) -> AuthError {
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    AuthError::find(e).unwrap_or_else(|| panic!("no AuthError in {e:?}")).clone()
}

/// Read block `i` alone through a fresh cache.
fn read_block(upper: &File, i: u64) -> ubc::Result<Vec<u8>> {
    let len = upper.len()?;
    let n = (len - i * B).min(B) as usize;
    let mut buf = vec![0u8; n];
    upper.read_exact_at(&mut buf, i * B)?;
    Ok(buf)
}

fn tamper(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    std::fs::write(path, &bytes).unwrap();
}

fn key() -> Arc<Key> {
    Arc::new(Key::generate())
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn round_trip_various_sizes_and_reopen() {
    let dir = tmp();
    let key = key();
    let sizes = [0usize, 1, 100, 4095, 4096, 4097, 8191, 8192, 12345, (1 << 20) + 17, 5 << 20];
    for (n, &size) in sizes.iter().enumerate() {
        let path = dir.path().join(format!("f{n}.enc"));
        let content = data(size, n as u64);
        {
            let c = cache();
            let (lower, upper) = open(&c, &path, &key).unwrap();
            upper.write_at(&content, 0).unwrap();
            assert_eq!(read_all(&upper), content, "size {size} before sync");
            upper.sync().unwrap();
            assert_eq!(lower.len().unwrap(), stored_len(size as u64), "stored size for {size}");
            assert_eq!(EncryptPager::logical_len(&lower, &key).unwrap(), size as u64);
        }
        let c = cache();
        let (_lower, upper) = open(&c, &path, &key).unwrap();
        assert_eq!(upper.len().unwrap(), size as u64);
        assert_eq!(read_all(&upper), content, "size {size} after reopen");
        // Straddling reads.
        if size > 5000 {
            let mut buf = vec![0u8; 3000];
            upper.read_exact_at(&mut buf, 3000).unwrap();
            assert_eq!(&buf[..], &content[3000..6000]);
        }
    }
}

#[test]
fn block_straddling_writes_and_overwrites() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let mut model = vec![0u8; 0];
    {
        let c = cache();
        let (_l, upper) = open(&c, &path, &key).unwrap();
        for (i, (off, len)) in
            [(0usize, 10000usize), (4000, 200), (8190, 10), (20000, 3), (12288, 4096), (1, 1)].into_iter().enumerate()
        {
            let d = data(len, 100 + i as u64);
            upper.write_at(&d, off as u64).unwrap();
            if model.len() < off + len {
                model.resize(off + len, 0);
            }
            model[off..off + len].copy_from_slice(&d);
            upper.sync().unwrap();
        }
        assert_eq!(read_all(&upper), model);
    }
    let c = cache();
    let (_l, upper) = open(&c, &path, &key).unwrap();
    assert_eq!(read_all(&upper), model);
}

#[test]
fn empty_lower_is_empty_file_and_a_sync_of_it_writes_nothing() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let c = cache();
    let lower = c.create_path(&path).unwrap();
    let pager = EncryptPager::open(lower.try_clone().unwrap(), key.clone()).unwrap();
    assert_eq!(pager.len().unwrap(), 0);
    assert_eq!(lower.len().unwrap(), 0, "opening writes nothing");
    pager.sync().unwrap();
    assert_eq!(lower.len().unwrap(), 0, "a sync of a file never written writes nothing");
    assert_eq!(EncryptPager::logical_len(&lower, &key).unwrap(), 0);
    // The first growth writes the header, and a shrink back to 0 keeps it.
    pager.set_len(10).unwrap();
    pager.set_len(0).unwrap();
    pager.sync().unwrap();
    assert_eq!(lower.len().unwrap(), HEADER_LEN);
    assert_eq!(EncryptPager::logical_len(&lower, &key).unwrap(), 0);
}

#[test]
fn wrong_key_is_auth_error() {
    let dir = tmp();
    let path = dir.path().join("f.enc");
    make_file(&path, &key(), b"secret data");
    let c = cache();
    let lower = c.create_path(&path).unwrap();
    let e = EncryptPager::open(lower.try_clone().unwrap(), key()).unwrap_err();
    assert!(matches!(auth_of_io(&e), AuthError::Header(Failure::BadTag)), "{e}");
    let e = EncryptPager::logical_len(&lower, &Key::generate()).unwrap_err();
    assert!(matches!(auth_of_io(&e), AuthError::Header(Failure::BadTag)));
}

#[test]
fn every_header_byte_flip_is_auth_error() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    make_file(&path, &key, &data(9000, 1));
    let orig = std::fs::read(&path).unwrap();
    for i in 0..HEADER_LEN as usize {
        for bit in [0x01u8, 0x80] {
            let mut b = orig.clone();
            b[i] ^= bit;
            std::fs::write(&path, &b).unwrap();
            let c = cache();
            let lower = c.create_path(&path).unwrap();
            let e = EncryptPager::open(lower, key.clone()).unwrap_err();
            let a = auth_of_io(&e);
            assert!(matches!(a, AuthError::Header(_)), "byte {i}: {a}");
        }
    }
    // A truncated header.
    std::fs::write(&path, &orig[..40]).unwrap();
    let c = cache();
    let e = EncryptPager::open(c.create_path(&path).unwrap(), key.clone()).unwrap_err();
    assert!(matches!(auth_of_io(&e), AuthError::Header(Failure::Truncated)));
}

/// Byte offsets in the stored file of block `i`'s nonce, ciphertext and tag.
fn parts(i: u64) -> [(&'static str, usize); 5] {
    let s = (HEADER_LEN + i * STORED_BLOCK) as usize;
    [
        ("nonce first", s),
        ("nonce last", s + 23),
        ("ciphertext", s + 24 + 1234),
        ("ciphertext last", s + 24 + 4095),
        ("tag", s + 24 + 4096 + 7),
    ]
}

#[test]
fn flipping_a_byte_of_a_block_fails_that_block_only() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let content = data(4 * B as usize - 100, 2); // 4 blocks, the last partial (padded)
    make_file(&path, &key, &content);
    let orig = std::fs::read(&path).unwrap();
    for bad in [1u64, 3] {
        for (what, at) in parts(bad) {
            let mut b = orig.clone();
            b[at] ^= 0x10;
            std::fs::write(&path, &b).unwrap();
            let c = cache();
            let (_l, upper) = open(&c, &path, &key).unwrap();
            for i in 0..4u64 {
                let r = read_block(&upper, i);
                if i == bad {
                    let e = r.expect_err(what);
                    let a = auth_of(&e);
                    assert!(
                        matches!(a, AuthError::Block { index, failure: Failure::BadTag } if index == bad),
                        "{what}: {a}"
                    );
                } else {
                    let got = r.unwrap_or_else(|e| panic!("block {i} with {what} of block {bad} flipped: {e}"));
                    assert_eq!(&got[..], &content[(i * B) as usize..((i * B) as usize + got.len())]);
                }
            }
            // A whole-file read fails too.
            let mut all = vec![0u8; content.len()];
            assert!(upper.read_exact_at(&mut all, 0).is_err());
        }
    }
}

#[test]
fn plain_source_chain_shows_whether_auth_error_is_reachable() {
    // Documents (for the report) how the error reaches callers: ubc::Error::Io's source is
    // our io::Error, whose own `source()` skips its payload, so walking `source()` alone
    // does not reach the AuthError; `io::Error::get_ref` (or AuthError::find) does.
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    make_file(&path, &key, &data(8192, 3));
    tamper(&path, |b| b[HEADER_LEN as usize + 100] ^= 1);
    let c = cache();
    let (_l, upper) = open(&c, &path, &key).unwrap();
    let e = read_block(&upper, 0).unwrap_err();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    let mut via_source = false;
    while let Some(x) = cur {
        via_source |= x.downcast_ref::<AuthError>().is_some();
        cur = x.source();
    }
    eprintln!("AuthError reachable by source() alone: {via_source}; message: {e}");
    assert!(AuthError::find(&e).is_some());
    // Through the std::io adapter (ubc::Error -> io::Error) too.
    let io: std::io::Error = e.into();
    assert_eq!(io.kind(), std::io::ErrorKind::InvalidData);
    assert!(AuthError::find(&io).is_some());
}

#[test]
fn swapped_blocks_fail() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let content = data(4 * B as usize, 4);
    make_file(&path, &key, &content);
    let (s1, s2) = ((HEADER_LEN + STORED_BLOCK) as usize, (HEADER_LEN + 2 * STORED_BLOCK) as usize);
    let n = STORED_BLOCK as usize;
    tamper(&path, |b| {
        let one = b[s1..s1 + n].to_vec();
        b.copy_within(s2..s2 + n, s1);
        b[s2..s2 + n].copy_from_slice(&one);
    });
    let c = cache();
    let (_l, upper) = open(&c, &path, &key).unwrap();
    assert_eq!(read_block(&upper, 0).unwrap(), &content[..B as usize]);
    for i in [1, 2] {
        let a = auth_of(&read_block(&upper, i).unwrap_err());
        assert!(matches!(a, AuthError::Block { index, failure: Failure::BadTag } if index == i), "{a}");
    }
    assert_eq!(read_block(&upper, 3).unwrap(), &content[3 * B as usize..]);
}

#[test]
fn block_from_another_file_fails() {
    let dir = tmp();
    let key = key();
    let (pa, pb) = (dir.path().join("a.enc"), dir.path().join("b.enc"));
    make_file(&pa, &key, &data(3 * B as usize, 5));
    make_file(&pb, &key, &data(3 * B as usize, 6));
    let other = std::fs::read(&pb).unwrap();
    let s = (HEADER_LEN + STORED_BLOCK) as usize;
    tamper(&pa, |b| b[s..s + STORED_BLOCK as usize].copy_from_slice(&other[s..s + STORED_BLOCK as usize]));
    let c = cache();
    let (_l, upper) = open(&c, &pa, &key).unwrap();
    let a = auth_of(&read_block(&upper, 1).unwrap_err());
    assert!(matches!(a, AuthError::Block { index: 1, failure: Failure::BadTag }), "{a}");
    assert!(read_block(&upper, 0).is_ok() && read_block(&upper, 2).is_ok());
}

#[test]
fn truncated_store_fails_on_missing_blocks() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let content = data(5 * B as usize + 10, 7);
    make_file(&path, &key, &content);
    let full = std::fs::read(&path).unwrap();
    // Cut a whole block, then cut in the middle of a block, then cut to the header.
    for cut in [
        full.len() - STORED_BLOCK as usize,
        full.len() - STORED_BLOCK as usize - 100,
        (HEADER_LEN + 3 * STORED_BLOCK + 5) as usize,
        HEADER_LEN as usize,
    ] {
        std::fs::write(&path, &full[..cut]).unwrap();
        let c = cache();
        let (_l, upper) = open(&c, &path, &key).unwrap();
        assert_eq!(upper.len().unwrap(), content.len() as u64, "the length comes from the header");
        let whole = (cut as u64).saturating_sub(HEADER_LEN) / STORED_BLOCK;
        for i in 0..6u64 {
            let r = read_block(&upper, i);
            if i < whole {
                assert_eq!(r.unwrap(), &content[(i * B) as usize..((i + 1) * B).min(content.len() as u64) as usize]);
            } else {
                let a = auth_of(&r.unwrap_err());
                assert!(
                    matches!(a, AuthError::Block { index, failure: Failure::Truncated } if index == i),
                    "cut {cut} block {i}: {a}"
                );
            }
        }
    }
}

#[test]
fn zeroed_block_and_holes_fail() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let content = data(3 * B as usize, 8);
    make_file(&path, &key, &content);
    let s = (HEADER_LEN + STORED_BLOCK) as usize;
    tamper(&path, |b| b[s..s + STORED_BLOCK as usize].fill(0));
    let c = cache();
    let (_l, upper) = open(&c, &path, &key).unwrap();
    let a = auth_of(&read_block(&upper, 1).unwrap_err());
    assert!(matches!(a, AuthError::Block { index: 1, failure: Failure::Zeroed }), "{a}");
    assert!(read_block(&upper, 0).is_ok() && read_block(&upper, 2).is_ok());
}

#[test]
fn gaps_are_encrypted_zeros() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    {
        let c = cache();
        let (lower, upper) = open(&c, &path, &key).unwrap();
        upper.write_at(b"head", 0).unwrap();
        upper.sync().unwrap();
        upper.write_at(b"far", 100_000).unwrap(); // a gap of blocks 1..24
        upper.sync().unwrap();
        assert_eq!(lower.len().unwrap(), stored_len(100_003));
        upper.set_len(200_000).unwrap(); // grow: zeros
        upper.set_len(150_001).unwrap(); // shrink mid-block
        upper.set_len(160_000).unwrap(); // grow again: the old tail must read zero
        upper.sync().unwrap();
    }
    let c = cache();
    let (_l, upper) = open(&c, &path, &key).unwrap();
    let all = read_all(&upper);
    assert_eq!(all.len(), 160_000);
    assert_eq!(&all[..4], b"head");
    assert_eq!(&all[100_000..100_003], b"far");
    assert!(all[4..100_000].iter().all(|&b| b == 0));
    assert!(all[100_003..].iter().all(|&b| b == 0));
    drop((upper, c));
    // Zeroing a gap block in the store is detected: a hole is not zeros.
    let s = (HEADER_LEN + 10 * STORED_BLOCK) as usize;
    tamper(&path, |b| b[s..s + STORED_BLOCK as usize].fill(0));
    let c = cache();
    let (_l, upper) = open(&c, &path, &key).unwrap();
    assert!(matches!(
        auth_of(&read_block(&upper, 10).unwrap_err()),
        AuthError::Block { index: 10, failure: Failure::Zeroed }
    ));
}

/// Puts arriving out of order, as the cache's writeback threads deliver them, leave a gap of
/// promised zeros instead of zero blocks the next put would overwrite: nothing is written
/// into the gap until a put fills it or the header is brought up to date; the gap reads as
/// zeros meanwhile; the stored header never covers a block not stored; a sync stores the rest
/// of the gap as encrypted zeros.
#[test]
fn a_put_past_the_end_leaves_promised_zeros_until_the_header_is_written() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let c = cache();
    let lower = c.create_path(&path).unwrap();
    let p = EncryptPager::open(lower.try_clone().unwrap(), key.clone()).unwrap();
    let slot = |i: u64| (HEADER_LEN + i * STORED_BLOCK) as usize;
    p.put_pages(0, &data(B as usize, 1)).unwrap();
    p.sync().unwrap();
    p.put_pages(20 * B, &data(B as usize, 2)).unwrap(); // blocks 1..20: a gap
    let s = read_all(&lower);
    assert_eq!(s.len(), slot(21));
    assert!(s[slot(1)..slot(20)].iter().all(|&b| b == 0), "nothing written into the gap yet");
    let mut buf = vec![0xFFu8; 3 * B as usize];
    p.get_pages(18 * B, &mut buf).unwrap(); // blocks 18, 19 (gap) and 20 (stored)
    assert!(buf[..2 * B as usize].iter().all(|&b| b == 0), "the gap reads as zeros");
    assert_eq!(&buf[2 * B as usize..], &data(B as usize, 2)[..]);
    assert_eq!(EncryptPager::logical_len(&lower, &key).unwrap(), B, "the header still says one block");
    // A put into the gap stores its blocks, once.
    p.put_pages(5 * B, &data(2 * B as usize, 3)).unwrap();
    let s = read_all(&lower);
    assert!(s[slot(1)..slot(5)].iter().all(|&b| b == 0) && s[slot(7)..slot(20)].iter().all(|&b| b == 0));
    assert!(s[slot(5)..slot(7)].iter().any(|&b| b != 0));
    // A sync stores the rest of the gap (sealed zeros, never zero bytes) and the header.
    p.sync().unwrap();
    let s = read_all(&lower);
    for i in (1..5).chain(7..20) {
        assert!(s[slot(i)..slot(i + 1)].iter().any(|&b| b != 0), "block {i} stored as sealed zeros");
    }
    assert_eq!(EncryptPager::logical_len(&lower, &key).unwrap(), 21 * B);
    drop(p);
    let p = EncryptPager::open(lower.try_clone().unwrap(), key.clone()).unwrap();
    let mut all = vec![0u8; 21 * B as usize];
    p.get_pages(0, &mut all).unwrap();
    let mut want = vec![0u8; 21 * B as usize];
    want[..B as usize].copy_from_slice(&data(B as usize, 1));
    want[5 * B as usize..7 * B as usize].copy_from_slice(&data(2 * B as usize, 3));
    want[20 * B as usize..].copy_from_slice(&data(B as usize, 2));
    assert!(all == want, "contents after the reopen");
    // A header written while a gap exists (a publish or flush for a reader below fills it
    // first; here the length is cut to the middle of a new gap, then grown) never covers
    // an unstored block: the cut-off gap is forgotten, the rest filled.
    p.put_pages(30 * B, &data(B as usize, 4)).unwrap(); // gap 21..30
    p.set_len(25 * B + 100).unwrap(); // cut inside the gap
    let s = read_all(&lower);
    assert_eq!(s.len(), slot(26));
    for i in 21..26 {
        assert!(s[slot(i)..slot(i + 1)].iter().any(|&b| b != 0), "block {i} stored before the header covers it");
    }
    assert_eq!(EncryptPager::logical_len(&lower, &key).unwrap(), 25 * B + 100);
    let mut tail = vec![0xFFu8; 5 * B as usize];
    p.get_pages(21 * B, &mut tail).unwrap();
    assert!(tail.iter().all(|&b| b == 0));
}

#[test]
fn shrink_then_grow_reads_zeros_without_sync() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let c = cache();
    let (_l, upper) = open(&c, &path, &key).unwrap();
    upper.write_at(&[0xAAu8; 10000], 0).unwrap();
    upper.sync().unwrap();
    upper.set_len(5000).unwrap();
    upper.set_len(9000).unwrap();
    c.evict_all().unwrap();
    let all = read_all(&upper);
    assert!(all[..5000].iter().all(|&b| b == 0xAA));
    assert!(all[5000..].iter().all(|&b| b == 0));
}

#[test]
fn nonces_change_on_every_rewrite() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let c = cache();
    let (lower, upper) = open(&c, &path, &key).unwrap();
    let block = vec![7u8; B as usize];
    let mut seen = std::collections::HashSet::new();
    let mut cts = std::collections::HashSet::new();
    for _ in 0..20 {
        upper.write_at(&block, B).unwrap(); // same cleartext, same block
        upper.sync().unwrap();
        let mut s = vec![0u8; STORED_BLOCK as usize];
        lower.read_exact_at(&mut s, HEADER_LEN + STORED_BLOCK).unwrap();
        assert!(seen.insert(s[..24].to_vec()), "nonce repeated");
        assert!(cts.insert(s[24..].to_vec()), "ciphertext repeated");
    }
}

#[test]
fn no_cleartext_in_store() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let phrase = b"ATTACK AT DAWN -- the quick brown fox jumps over the lazy dog. ";
    let content: Vec<u8> = phrase.iter().copied().cycle().take(300_000).collect();
    make_file(&path, &key, &content);
    let stored = std::fs::read(&path).unwrap();
    for w in [&phrase[..12], &phrase[20..32], b"ATTACK"] {
        assert!(
            !stored.windows(w.len()).any(|x| x == w),
            "cleartext {:?} found in the store",
            String::from_utf8_lossy(w)
        );
    }
    // Long runs of identical bytes would betray structure: there are none.
    assert!(stored[HEADER_LEN as usize..].windows(16).all(|x| x.iter().any(|&b| b != x[0])));
}

#[test]
fn concurrent_writers_and_readers() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let chunk = 64 * 1024;
    let n = 32usize;
    {
        let c = cache();
        let (_l, upper) = open(&c, &path, &key).unwrap();
        let upper = Arc::new(upper);
        // Disjoint chunks in a scrambled order, so some writes land past the end.
        let order: Vec<usize> = (0..n).map(|i| (i * 13) % n).collect();
        std::thread::scope(|s| {
            for t in 0..4 {
                let upper = upper.clone();
                let order = &order;
                s.spawn(move || {
                    for &i in order.iter().skip(t).step_by(4) {
                        upper.write_at(&data(chunk, i as u64), (i * chunk) as u64).unwrap();
                        if i % 3 == 0 {
                            upper.sync().unwrap();
                        }
                    }
                });
            }
        });
        upper.sync().unwrap();
        c.evict_all().unwrap();
        std::thread::scope(|s| {
            for t in 0..4 {
                let upper = upper.clone();
                s.spawn(move || {
                    for i in (t..n).step_by(4) {
                        let mut buf = vec![0u8; chunk];
                        upper.read_exact_at(&mut buf, (i * chunk) as u64).unwrap();
                        assert_eq!(buf, data(chunk, i as u64));
                    }
                });
            }
        });
    }
    let c = cache();
    let (_l, upper) = open(&c, &path, &key).unwrap();
    let all = read_all(&upper);
    for i in 0..n {
        assert_eq!(&all[i * chunk..(i + 1) * chunk], &data(chunk, i as u64)[..], "chunk {i}");
    }
}

#[test]
fn read_only_lower() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let content = data(10_000, 9);
    make_file(&path, &key, &content);
    let c = cache();
    let lower = c.open_path(&path, Access::ReadOnly).unwrap();
    let pager = EncryptPager::open(lower, key.clone()).unwrap();
    assert!(!pager.is_writable());
    assert!(pager.put_pages(0, &[0u8; 4096]).is_err());
    let pager = Arc::new(pager);
    assert!(c.open(pager.clone(), Access::ReadWrite).is_err());
    let upper = c.open(pager, Access::ReadOnly).unwrap();
    assert_eq!(read_all(&upper), content);
}

#[test]
fn reload_sees_restored_ciphertext() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let old = data(10_000, 10);
    make_file(&path, &key, &old);
    let saved = std::fs::read(&path).unwrap();
    let c = cache();
    let lower = c.create_path(&path).unwrap();
    let pager = Arc::new(EncryptPager::open(lower.try_clone().unwrap(), key.clone()).unwrap());
    let upper = c.open(pager.clone(), Access::ReadWrite).unwrap();
    upper.write_at(&data(20_000, 11), 0).unwrap();
    upper.sync().unwrap();
    // Restore the old ciphertext underneath (whole-file rollback is accepted by design).
    lower.set_len(0).unwrap();
    lower.write_at(&saved, 0).unwrap();
    pager.reload().unwrap();
    upper.invalidate(0..u64::MAX, ubc::Length::Reload).unwrap();
    assert_eq!(upper.len().unwrap(), 10_000);
    assert_eq!(read_all(&upper), old);
}

#[test]
fn ranges_and_identity() {
    let dir = tmp();
    let key = key();
    let c = cache();
    let lower = c.create_path(dir.path().join("f.enc")).unwrap();
    let p = EncryptPager::open(lower.try_clone().unwrap(), key).unwrap();
    let (h, s) = (HEADER_LEN, STORED_BLOCK);
    assert_eq!(p.lower_range(0..1), h..h + s);
    assert_eq!(p.lower_range(0..4096), h..h + s);
    assert_eq!(p.lower_range(4096..8193), h + s..h + 3 * s);
    assert_eq!(p.upper_range(0..10), None);
    assert_eq!(p.upper_range(h..h + 1), Some(0..4096));
    assert_eq!(p.upper_range(h + s - 1..h + s + 1), Some(0..8192));
    assert_eq!(p.upper_range(h + 2 * s..h + 3 * s), Some(8192..12288));
    match p.identity() {
        Some(ubc::Identity::Named { kind: "aead", name }) => assert_eq!(name, format!("{:?}", lower.identity())),
        other => panic!("{other:?}"),
    }
    assert!(!format!("{:?}", Key::from_bytes([0x41; 32])).contains("41"));
}

#[test]
fn random_lower_bytes_give_errors_not_panics() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    for (i, size) in [1usize, 7, 8, 79, 80, 81, 4000, 4176, 10_000, 100_000].into_iter().enumerate() {
        let mut b = vec![0u8; size];
        rand::fill(&mut b[..]);
        if i % 2 == 1 && size >= 8 {
            b[..8].copy_from_slice(b"UBC-AEAD"); // get past the magic
        }
        std::fs::write(&path, &b).unwrap();
        let c = cache();
        let lower = c.create_path(&path).unwrap();
        assert!(EncryptPager::open(lower.try_clone().unwrap(), key.clone()).is_err(), "size {size}");
        assert!(EncryptPager::logical_len(&lower, &key).is_err());
    }
    // A valid header over random blocks: reads fail, nothing panics.
    std::fs::remove_file(&path).unwrap();
    make_file(&path, &key, &data(50_000, 12));
    tamper(&path, |b| rand::fill(&mut b[HEADER_LEN as usize..]));
    let c = cache();
    let (_l, upper) = open(&c, &path, &key).unwrap();
    for i in 0..13 {
        assert!(read_block(&upper, i).is_err());
    }
}

#[test]
fn key_files() {
    let dir = tmp();
    let p = dir.path().join("key");
    let k = Key::generate();
    k.write_file(&p).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
    let text = std::fs::read_to_string(&p).unwrap();
    assert_eq!(text.len(), 65);
    assert!(text.ends_with('\n'));
    // Round trip: the key read back decrypts a file made with the original.
    let fpath = dir.path().join("f.enc");
    make_file(&fpath, &Arc::new(k.clone()), b"hello");
    let k2 = Arc::new(Key::from_file(&p).unwrap());
    let c = cache();
    let (_l, upper) = open(&c, &fpath, &k2).unwrap();
    assert_eq!(read_all(&upper), b"hello");
    // Refuses to overwrite.
    assert_eq!(k.write_file(&p).unwrap_err().kind(), std::io::ErrorKind::AlreadyExists);
    // Without a newline, and upper case, are fine.
    let q = dir.path().join("k2");
    std::fs::write(&q, text.trim_end().to_uppercase()).unwrap();
    Key::from_file(&q).unwrap();
    std::fs::write(&q, format!("{}\r\n", text.trim_end())).unwrap();
    Key::from_file(&q).unwrap();
    // Bad ones.
    let bad: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"\n".to_vec(),
        text.as_bytes()[..63].to_vec(),
        format!("{}0\n", text.trim_end()).into_bytes(),
        format!("{}\n\n", text.trim_end()).into_bytes(),
        format!(" {}", text.trim_end()).into_bytes(),
        format!("{}g", &text[..63]).into_bytes(),
        vec![b'a'; 100_000],
    ];
    for b in bad {
        std::fs::write(&q, &b).unwrap();
        let e = Key::from_file(&q).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert!(e.to_string().contains("64 hex"), "{e}");
        assert!(!e.to_string().contains(&text.trim_end()[..16]), "error echoes key bytes");
    }
    assert_eq!(Key::from_file(&dir.path().join("missing")).unwrap_err().kind(), std::io::ErrorKind::NotFound);
}

fn key_hex(k: &Key) -> String {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("k");
    k.write_file(&p).unwrap();
    std::fs::read_to_string(p).unwrap()
}

#[test]
fn passphrase_derivation() {
    let s1 = [1u8; 16];
    let s2 = [2u8; 16];
    let a = key_hex(&Key::from_passphrase(b"correct horse", &s1).unwrap());
    let b = key_hex(&Key::from_passphrase(b"correct horse", &s1).unwrap());
    let c = key_hex(&Key::from_passphrase(b"correct horse", &s2).unwrap());
    let d = key_hex(&Key::from_passphrase(b"correct horsf", &s1).unwrap());
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_ne!(a, d);
}

// ------------------------------------------------------------------ model-based

#[derive(Debug, Clone)]
enum Op {
    Write { off: u64, len: usize, seed: u64 },
    SetLen(u64),
    Sync,
    Reopen,
    Evict,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u64..60_000, 1usize..20_000, any::<u64>()).prop_map(|(off, len, seed)| Op::Write { off, len, seed }),
        2 => (0u64..70_000).prop_map(Op::SetLen),
        1 => Just(Op::Sync),
        1 => Just(Op::Reopen),
        1 => Just(Op::Evict),
    ]
}

struct Open {
    cache: Cache,
    _lower: File,
    upper: File,
}

fn reopen(path: &Path, key: &Arc<Key>) -> Open {
    let cache = Cache::builder().budget(16 << 20).io_threads(1).build().unwrap();
    let (_lower, upper) = open(&cache, path, key).unwrap();
    Open { cache, _lower, upper }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]
    #[test]
    fn model(ops in proptest::collection::vec(op(), 1..25)) {
        let dir = tmp();
        let key = key();
        let path = dir.path().join("f.enc");
        let mut model: Vec<u8> = Vec::new();
        let mut f = reopen(&path, &key);
        for op in ops {
            match op {
                Op::Write { off, len, seed } => {
                    let d = data(len, seed);
                    f.upper.write_at(&d, off).unwrap();
                    let end = off as usize + len;
                    if model.len() < end { model.resize(end, 0); }
                    model[off as usize..end].copy_from_slice(&d);
                }
                Op::SetLen(n) => {
                    f.upper.set_len(n).unwrap();
                    model.resize(n as usize, 0);
                }
                Op::Sync => f.upper.sync().unwrap(),
                Op::Reopen => {
                    f.upper.sync().unwrap();
                    drop(f);
                    f = reopen(&path, &key);
                }
                Op::Evict => { f.cache.evict_all().unwrap(); }
            }
            prop_assert_eq!(f.upper.len().unwrap(), model.len() as u64);
        }
        prop_assert_eq!(read_all(&f.upper), model.clone());
        f.upper.sync().unwrap();
        drop(f);
        let f = reopen(&path, &key);
        prop_assert_eq!(read_all(&f.upper), model);
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..20_000), magic in any::<bool>()) {
        let dir = tmp();
        let key = key();
        let path = dir.path().join("f.enc");
        let mut bytes = bytes;
        if magic && bytes.len() >= 8 { bytes[..8].copy_from_slice(b"UBC-AEAD"); }
        std::fs::write(&path, &bytes).unwrap();
        let c = Cache::builder().budget(8 << 20).io_threads(1).build().unwrap();
        let lower = c.create_path(&path).unwrap();
        match EncryptPager::open(lower, key) {
            Ok(p) => prop_assert!(bytes.is_empty() && p.len().unwrap() == 0),
            Err(e) => prop_assert_eq!(e.kind(), std::io::ErrorKind::InvalidData),
        }
    }
}

// ------------------------------------------------------------------ throughput

/// `cargo test --release -p ubc-stack --test encrypt -- --ignored --nocapture throughput`
#[test]
#[ignore]
fn throughput() {
    let dir = tmp();
    let key = key();
    let path = dir.path().join("f.enc");
    let size = 256usize << 20;
    let chunk = data(1 << 20, 1);
    let threads = std::env::var("IO_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let c = Cache::builder().budget(1 << 30).io_threads(threads).build().unwrap();
    let (_l, upper) = open(&c, &path, &key).unwrap();
    let t = std::time::Instant::now();
    for i in 0..size >> 20 {
        upper.write_at(&chunk, (i << 20) as u64).unwrap();
    }
    upper.sync().unwrap();
    let w = t.elapsed();
    drop((upper, _l));
    // Cold read in a new cache: every page is read from the host file and decrypted.
    let c2 = Cache::new(1 << 30).unwrap();
    let (_l2, upper) = open(&c2, &path, &key).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let t = std::time::Instant::now();
    for i in 0..size >> 20 {
        upper.read_exact_at(&mut buf, (i << 20) as u64).unwrap();
    }
    let r = t.elapsed();
    let mb = (size >> 20) as f64;
    eprintln!(
        "aead write+sync: {:.0} MiB/s, cold read: {:.0} MiB/s ({} MiB)",
        mb / w.as_secs_f64(),
        mb / r.as_secs_f64(),
        size >> 20
    );
    let _ = c;
    // Baseline: the same through a plain host file.
    let c3 = Cache::new(1 << 30).unwrap();
    let plain = c3.create_path(dir.path().join("plain")).unwrap();
    let t = std::time::Instant::now();
    for i in 0..size >> 20 {
        plain.write_at(&chunk, (i << 20) as u64).unwrap();
    }
    plain.sync().unwrap();
    let pw = t.elapsed();
    drop(plain);
    let c4 = Cache::new(1 << 30).unwrap();
    let plain = c4.open_path(dir.path().join("plain"), Access::ReadOnly).unwrap();
    let t = std::time::Instant::now();
    for i in 0..size >> 20 {
        plain.read_exact_at(&mut buf, (i << 20) as u64).unwrap();
    }
    let pr = t.elapsed();
    eprintln!("plain write+sync: {:.0} MiB/s, cold read: {:.0} MiB/s", mb / pw.as_secs_f64(), mb / pr.as_secs_f64());
    // The pager alone over a memory lower file, one thread: put (seal) and get (open) 1 MiB.
    let c5 = Cache::new(1 << 30).unwrap();
    let mem = c5.open(Arc::new(ubc::pager::MemPager::new()), Access::ReadWrite).unwrap();
    let p = EncryptPager::open(mem, key.clone()).unwrap();
    let t = std::time::Instant::now();
    for i in 0..size >> 20 {
        p.put_pages((i << 20) as u64, &chunk).unwrap();
    }
    let sw = t.elapsed();
    let t = std::time::Instant::now();
    for i in 0..size >> 20 {
        p.get_pages((i << 20) as u64, &mut buf).unwrap();
    }
    let sr = t.elapsed();
    eprintln!(
        "pager over memory, one thread: put {:.0} MiB/s, get {:.0} MiB/s",
        mb / sw.as_secs_f64(),
        mb / sr.as_secs_f64()
    );
}

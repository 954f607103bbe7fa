//! Deterministic test data, shared by the integration tests (through `common`) and by the
//! fuzz crate's seed corpora (`fuzz/src/lib.rs` includes this file by path): one generator,
//! so every test means the same by "random", "compressible" and "zeros".

/// `len` bytes from `seed`: kind 0 random (incompressible), 1 compressible (text-like: words
/// of a small vocabulary with a few numbers), anything else zeros.
pub fn gen_data(seed: u64, len: usize, kind: u8) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match kind {
        0 => (0..len).map(|_| (next() >> 24) as u8).collect(),
        1 => {
            let words: [&[u8]; 8] = [b"cache ", b"page ", b"zstd ", b"chunk ", b"index ", b"layer ", b"the ", b"of "];
            let mut v = Vec::with_capacity(len + 8);
            while v.len() < len {
                let r = next();
                v.extend_from_slice(words[(r % 8) as usize]);
                if r % 17 == 0 {
                    v.extend_from_slice(format!("{} ", r % 1000).as_bytes());
                }
            }
            v.truncate(len);
            v
        }
        _ => vec![0; len],
    }
}

//! Write seed corpora: valid stored files (with the input prefixes the targets expect) and
//! valid specs. `seed_corpus DIR` writes DIR/{zstd_format,aead_format,spec}/seed-*.

use ubc_fuzz::*;

fn main() {
    let root = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "corpus".into()));
    let put = |target: &str, name: String, bytes: &[u8]| {
        let d = root.join(target);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(name), bytes).unwrap();
    };
    let images: Vec<(u32, Vec<u8>)> = vec![
        (12, zstd_image(12, &[&[(0, 10_000, 1, 1)]])),
        (12, zstd_image(12, &[&[(0, 9_000, 2, 0)], &[(4096, 100, 3, 1), (20_000, 5000, 4, 1)]])),
        (13, zstd_image(13, &[&[(0, 30_000, 5, 1)], &[(8192, 8192, 6, 2)]])),
        (14, zstd_image(14, &[&[(100, 3, 7, 0), (50_000, 20, 8, 1)]])),
        (12, zstd_image(12, &[&[(0, 40_000, 9, 1)], &[(0, 40_000, 10, 1)], &[(0, 4096, 11, 0)]])),
    ];
    for (i, (shift, img)) in images.iter().enumerate() {
        for flags in [0u8, 1, 2, 3] {
            let mut v = vec![(shift - 12) as u8, flags];
            v.extend_from_slice(img);
            put("zstd_format", format!("seed-{i}-{flags}"), &v);
        }
    }
    for (i, len) in [0usize, 1, 100, 4096, 5000, 20_000].into_iter().enumerate() {
        let f = aead_file(&gen_data(i as u64, len, 0));
        for flags in [0u8, 1, 2, 3] {
            let mut v = vec![flags];
            v.extend_from_slice(&f);
            put("aead_format", format!("seed-{i}-{flags}"), &v);
        }
    }
    for (i, s) in [
        "mem",
        "mem | zstd",
        "mem | zstd:level=3,chunk=64K | null",
        "mem | aead:keyfile=/nonexistent",
        "mem | aead:passphrase-file=/nonexistent,salt=00112233445566778899aabbccddeeff",
        "dir:/tmp | union:upper=/tmp",
        "mem | null | zstd:chunk=4k",
    ]
    .into_iter()
    .enumerate()
    {
        put("spec", format!("seed-{i}"), s.as_bytes());
    }
    println!("seed corpora written under {}", root.display());
}

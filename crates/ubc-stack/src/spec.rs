//! The stack spec language: layers bottom first, separated by `|`; each layer is
//! `name[:options]`, options `key=value` separated by commas (`dir:` takes a path).

use crate::compress::CompressOptions;
use crate::encrypt::Key;
use crate::error::{Error, Result};
use crate::layer::{
    Layer,
    dir::Dir,
    general::{Aead, Zstd},
    mem::Mem,
    null::Null,
    union::Union,
};
use std::collections::HashMap;
use std::sync::Arc;

fn options(layer: &str, s: &str) -> Result<HashMap<String, String>> {
    let mut m = HashMap::new();
    for kv in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let (k, v) =
            kv.split_once('=').ok_or_else(|| Error::Spec(format!("{layer}: option `{kv}` is not key=value")))?;
        if m.insert(k.trim().to_string(), v.trim().to_string()).is_some() {
            return Err(Error::Spec(format!("{layer}: option `{k}` given twice")));
        }
    }
    Ok(m)
}

pub(crate) fn size(layer: &str, key: &str, v: &str) -> Result<usize> {
    let (num, mult) = match v.strip_suffix(['k', 'K']) {
        Some(n) => (n, 1024),
        None => match v.strip_suffix(['m', 'M']) {
            Some(n) => (n, 1 << 20),
            None => (v, 1),
        },
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| Error::Spec(format!("{layer}: {key}={v} is not a size")))
}

fn hex16(v: &str) -> Result<[u8; 16]> {
    if v.len() != 32 || !v.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Error::Spec("aead: salt must be 32 hex digits".into()));
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&v[2 * i..2 * i + 2], 16).expect("checked hex");
    }
    Ok(out)
}

/// Longest passphrase file read: a passphrase, not a file of any size (`/dev/zero` must not
/// be read until memory runs out).
const PASSPHRASE_MAX: u64 = 64 << 10;

fn read_passphrase(p: &str) -> Result<zeroize::Zeroizing<Vec<u8>>> {
    use std::io::Read;
    let bad = |e: &dyn std::fmt::Display| Error::Spec(format!("aead: passphrase-file {p}: {e}"));
    let f = std::fs::File::open(p).map_err(|e| bad(&e))?;
    let mut pass = zeroize::Zeroizing::new(Vec::new());
    f.take(PASSPHRASE_MAX + 1).read_to_end(&mut pass).map_err(|e| bad(&e))?;
    if pass.len() as u64 > PASSPHRASE_MAX {
        return Err(bad(&format!("longer than {PASSPHRASE_MAX} bytes")));
    }
    Ok(pass)
}

fn unknown(layer: &str, m: &HashMap<String, String>, known: &[&str]) -> Result<()> {
    if let Some(k) = m.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(Error::Spec(format!("{layer}: unknown option `{k}` (known: {})", known.join(", "))));
    }
    Ok(())
}

/// The options of every `s3` layer in `spec` (what follows `s3:`), in order: a stack with any
/// would reach the network when opened (AWS itself, without an `endpoint=`). For callers that
/// must not — the spec fuzzers parse these options instead of opening the stack.
pub fn s3_layers(spec: &str) -> Vec<&str> {
    spec.split('|')
        .map(str::trim)
        .filter_map(|part| {
            let (name, rest) = part.split_once(':').map_or((part, ""), |(a, b)| (a.trim(), b.trim()));
            (name == "s3").then_some(rest)
        })
        .collect()
}

/// Parse `spec` into layers, bottom first.
pub fn parse(spec: &str) -> Result<Vec<Arc<dyn Layer>>> {
    let mut layers: Vec<Arc<dyn Layer>> = Vec::new();
    for (i, part) in spec.split('|').map(str::trim).enumerate() {
        if part.is_empty() {
            return Err(Error::Spec(format!("layer {i} is empty")));
        }
        let (name, rest) = part.split_once(':').map_or((part, ""), |(a, b)| (a.trim(), b.trim()));
        let lower = layers.last().cloned();
        let need_lower = |lower: Option<Arc<dyn Layer>>| {
            lower.ok_or_else(|| Error::Spec(format!("`{name}` needs a layer below it")))
        };
        let l: Arc<dyn Layer> = match name {
            "dir" => {
                if lower.is_some() {
                    return Err(Error::Spec(
                        "`dir` must be the bottom layer (use union:upper=… to stack directories)".into(),
                    ));
                }
                if rest.is_empty() {
                    return Err(Error::Spec("dir: needs a path (dir:/data)".into()));
                }
                Arc::new(Dir::new(rest)?)
            }
            "mem" => {
                if lower.is_some() {
                    return Err(Error::Spec("`mem` must be the bottom layer".into()));
                }
                if !rest.is_empty() {
                    return Err(Error::Spec("mem: takes no options".into()));
                }
                Arc::new(Mem::new())
            }
            #[cfg(feature = "s3")]
            "s3" => {
                if lower.is_some() {
                    return Err(Error::Spec("`s3` must be the bottom layer".into()));
                }
                Arc::new(crate::layer::s3::S3::open(&crate::layer::s3::S3Options::parse(rest)?)?)
            }
            "null" => {
                if !rest.is_empty() {
                    return Err(Error::Spec("null: takes no options".into()));
                }
                Arc::new(Null::new(need_lower(lower)?))
            }
            "zstd" => {
                let m = options(name, rest)?;
                unknown(name, &m, &["level", "chunk"])?;
                let mut o = CompressOptions::default();
                if let Some(v) = m.get("level") {
                    o.level = v.parse().map_err(|_| Error::Spec(format!("zstd: level={v} is not a number")))?;
                    if !(1..=22).contains(&o.level) {
                        return Err(Error::Spec(format!("zstd: level={v} is outside 1..=22")));
                    }
                }
                if let Some(v) = m.get("chunk") {
                    o.chunk_size = size(name, "chunk", v)?;
                    if !o.chunk_size.is_power_of_two() || o.chunk_size < 4096 || o.chunk_size > 16 << 20 {
                        return Err(Error::Spec(format!("zstd: chunk={v} must be a power of two from 4K to 16M")));
                    }
                }
                Arc::new(Zstd::new(need_lower(lower)?, o))
            }
            "aead" => {
                let m = options(name, rest)?;
                unknown(name, &m, &["keyfile", "passphrase-file", "salt"])?;
                let (key, source) = match (m.get("keyfile"), m.get("passphrase-file")) {
                    (Some(k), None) => (
                        Key::from_file(std::path::Path::new(k))
                            .map_err(|e| Error::Spec(format!("aead: keyfile {k}: {e}")))?,
                        format!("keyfile={k}"),
                    ),
                    (None, Some(p)) => {
                        let salt =
                            hex16(m.get("salt").ok_or_else(|| {
                                Error::Spec("aead: passphrase-file needs salt=<32 hex digits>".into())
                            })?)?;
                        let pass = read_passphrase(p)?;
                        let pass = pass.strip_suffix(b"\n").unwrap_or(&pass);
                        let salt_hex = m["salt"].clone();
                        (
                            Key::from_passphrase(pass, &salt).map_err(|e| Error::Spec(format!("aead: {e}")))?,
                            format!("passphrase-file={p},salt={salt_hex}"),
                        )
                    }
                    _ => {
                        return Err(Error::Spec(
                            "aead: give exactly one of keyfile=PATH or passphrase-file=PATH,salt=HEX".into(),
                        ));
                    }
                };
                Arc::new(Aead::new(need_lower(lower)?, Arc::new(key), source))
            }
            "union" => {
                let m = options(name, rest)?;
                unknown(name, &m, &["upper"])?;
                let up = m.get("upper").ok_or_else(|| Error::Spec("union: needs upper=PATH".into()))?;
                Arc::new(Union::new(need_lower(lower)?, Dir::new(up)?))
            }
            other => {
                return Err(Error::Spec(format!("unknown layer `{other}` (known: dir, mem, null, zstd, aead, union)")));
            }
        };
        layers.push(l);
    }
    Ok(layers)
}

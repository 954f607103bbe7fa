//! Imports inside `ubc` run one way: a module uses modules of its own rank or below, never
//! one above (`docs/architecture.md`, "Which module may use which"). The test reads the
//! sources, collects every `crate::X` path per top-level module (following `lib.rs`
//! re-exports such as `crate::Access` to the module defining the item) and names each file
//! and import that breaks the order.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Top-level modules of `src/`, highest first. A module may use its own rank and below.
const RANKS: &[(&str, u32)] = &[
    // Handles: what the public API hands out.
    ("mapping", 7),
    ("file", 7),
    // The registry of objects and the threads that walk it (reclaim, page daemon, flusher).
    ("cache", 6),
    // One cached file and its data paths.
    ("object", 5),
    // What objects draw on: budget and reservations, policy, windows, I/O pools, the mapping
    // service, dirty accounting. Calls up only through the `Reclaim` trait.
    ("resources", 4),
    // Kernel-facing layers.
    ("map", 3),
    ("window", 3),
    ("io", 3),
    ("memfd", 2),
    ("page", 2),
    ("pager", 2),
    ("stats", 2),
    // Leaves.
    ("advice", 1),
    ("huge", 1),
    ("order", 1),
    ("error", 1),
    ("errseq", 1),
    // Interleaving points for tests (feature `testing`).
    ("testing", 1),
    // The ubc-evict crate, re-exported by `lib.rs`.
    ("evict", 0),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rank(module: &str) -> Option<u32> {
    RANKS.iter().find(|(m, _)| *m == module).map(|&(_, r)| r)
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file belongs to (`cache/flusher.rs` → `cache`); `None` for `lib.rs`.
fn module_of(file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src()).unwrap();
    let first = rel.components().next()?.as_os_str().to_str().unwrap();
    if rel.components().count() == 1 {
        let stem = first.strip_suffix(".rs").unwrap();
        return (stem != "lib").then(|| stem.to_string());
    }
    Some(first.to_string())
}

/// The code of a file with `//` comments (doc comments included) removed: intra-doc links
/// name items for the reader, not imports. Block comments are not used in the crate.
fn code(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let mut in_str = false;
        let mut prev = ' ';
        let mut end = line.len();
        for (i, c) in line.char_indices() {
            if c == '"' && prev != '\\' {
                in_str = !in_str;
            }
            if !in_str && c == '/' && prev == '/' {
                end = i - 1;
                break;
            }
            prev = c;
        }
        out.push_str(&line[..end]);
        out.push('\n');
    }
    out
}

fn ident_at(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The first name of every path that starts with `crate::` (`crate::{a::X, b}` gives `a`
/// and `b`), with the line it is on.
fn crate_paths(code: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = code[from..].find("crate::") {
        let at = from + i;
        from = at + "crate::".len();
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let line = code[..at].matches('\n').count() + 1;
        let rest = &code[from..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group: the first name after `{` and after each `,` at
            // depth 1.
            let mut depth = 1;
            let mut start = true;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => start = true,
                    c if start && depth == 1 && (c.is_alphabetic() || c == '_') => {
                        out.push((line, ident_at(&group[j..]).to_string()));
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.push((line, ident_at(rest).to_string()));
        }
    }
    out
}

/// Names `lib.rs` re-exports at the crate root, mapped to the module they come from
/// (`pub use file::{File, Window}` gives `File` → `file`).
fn reexports() -> HashMap<String, String> {
    let lib = code(&std::fs::read_to_string(src().join("lib.rs")).unwrap());
    let mut map = HashMap::new();
    // Top-level statements only (`pub mod evict { pub use ubc_evict::… }` is a module).
    for (at, _) in lib.match_indices("\npub use ") {
        let stmt = &lib[at + "\npub use ".len()..];
        let rest: String = stmt[..stmt.find(';').unwrap()].split_whitespace().collect();
        let module = ident_at(&rest).to_string();
        let tail = match rest.find('{') {
            Some(b) => rest[b + 1..].trim_end_matches('}').to_string(),
            None => rest.rsplit("::").next().unwrap().to_string(),
        };
        for item in tail.split(',').filter(|s| !s.is_empty()) {
            let name = item.rsplit("::").next().unwrap();
            let name = name.rsplit(" as ").next().unwrap();
            map.insert(name.to_string(), module.clone());
        }
    }
    map
}

/// Every import that breaks the order, as `file:line: module (rank) uses crate::X → module
/// (rank)`, and every module or name the ranks do not cover.
fn violations() -> Vec<String> {
    let reexports = reexports();
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut bad = Vec::new();
    for file in files {
        let Some(module) = module_of(&file) else { continue };
        let shown = file.strip_prefix(src()).unwrap().display().to_string();
        let Some(own) = rank(&module) else {
            bad.push(format!("src/{shown}: module `{module}` has no rank in tests/layering.rs"));
            continue;
        };
        let code = code(&std::fs::read_to_string(&file).unwrap());
        if let Some(i) = code.find("super::super::") {
            let line = code[..i].matches('\n').count() + 1;
            bad.push(format!("src/{shown}:{line}: `super::super::` climbs out of `{module}`: write `crate::`"));
        }
        for (line, name) in crate_paths(&code) {
            let target = if rank(&name).is_some() { Some(name.clone()) } else { reexports.get(&name).cloned() };
            let Some(target) = target else {
                bad.push(format!("src/{shown}:{line}: `crate::{name}` is neither a ranked module nor a re-export"));
                continue;
            };
            let Some(theirs) = rank(&target) else {
                bad.push(format!("src/{shown}:{line}: `crate::{name}` comes from unranked module `{target}`"));
                continue;
            };
            if theirs > own {
                bad.push(format!(
                    "src/{shown}:{line}: `{module}` (rank {own}) uses `crate::{name}` from `{target}` (rank {theirs})"
                ));
            }
        }
    }
    bad
}

#[test]
fn imports_run_downward() {
    let bad = violations();
    assert!(bad.is_empty(), "imports against the layering of docs/architecture.md:\n  {}", bad.join("\n  "));
}

/// The scanner itself finds what it must: a grouped import, a re-exported name, a path in
/// an expression; and not a doc link or `pub(crate)`.
#[test]
fn scanner_sees_paths() {
    let text = "use crate::{cache::{Cache, Idle}, error::Result};\n\
                /// [`File`](crate::File::sync)\n\
                pub(crate) fn f() { crate::order::hold(x); let a: crate::Access; } // crate::mapping\n";
    let found: Vec<String> = crate_paths(&code(text)).into_iter().map(|(_, n)| n).collect();
    assert_eq!(found, ["cache", "error", "order", "Access"]);
    let r = reexports();
    assert_eq!(r.get("Access").map(String::as_str), Some("pager"));
    assert_eq!(r.get("Cache").map(String::as_str), Some("cache"));
    assert_eq!(r.get("Length").map(String::as_str), Some("object"));
}

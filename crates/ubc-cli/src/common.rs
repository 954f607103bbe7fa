//! What the stack commands share: the `--stack/--layer/--budget` options and paths that
//! are either in the stack or (with `host:`) on the host.

use crate::error::{Ctx, Fail, Result, Side};
use clap::Args;
use std::path::PathBuf;
use ubc_stack::{LayerRef, Stack};

#[derive(Args, Debug, Clone)]
pub struct StackArgs {
    /// The stack, bottom layer first, e.g. 'dir:/data | aead:keyfile=/etc/k | zstd'
    #[arg(long, short = 's', value_name = "SPEC")]
    pub stack: String,
    /// Layer to work at (0 is the bottom; default: the top)
    #[arg(long, short = 'l', value_name = "N")]
    pub layer: Option<usize>,
    /// Cache budget in MiB
    #[arg(long, value_name = "MiB", default_value_t = 64)]
    pub budget: u64,
    /// Huge pages for the cache: never, try (2 MiB hugetlb pages if the host's pool holds
    /// the budget, else shmem THP if tmpfs allocates it, else ordinary pages) or require
    #[arg(long, value_name = "WHEN", default_value = "never")]
    pub huge_pages: ubc::HugePages,
    /// Cache files of memory-backed stores (the `mem` layer, host files on tmpfs) as copies,
    /// instead of serving them in place from the store's own pages (execute-in-place)
    #[arg(long)]
    pub no_xip: bool,
}

impl StackArgs {
    /// Open the stack and pick the layer.
    pub fn open(&self) -> Result<(Stack, LayerRef)> {
        self.open_caching(None)
    }

    /// [`StackArgs::open`] with a cache keeping at most `cached_files` closed files (see
    /// `ubc::CacheBuilder::max_cached_files`; None: its default).
    pub fn open_caching(&self, cached_files: Option<usize>) -> Result<(Stack, LayerRef)> {
        let mut b = ubc::Cache::builder().budget(self.budget << 20).huge_pages(self.huge_pages).xip(!self.no_xip);
        if let Some(n) = cached_files {
            b = b.max_cached_files(n);
        }
        let cache = b.build().map_err(|e| Fail::usage("--budget/--huge-pages", e.to_string()))?;
        let stack = Stack::open(&self.stack, cache).map_err(|e| {
            // A missing directory or key file is named by the error; anything else by the spec.
            let path = crate::error::error_path(&e).unwrap_or(&self.stack).to_string();
            Fail::stack(Side::Input, &path, e)
        })?;
        let layer = match self.layer {
            None => stack.top(),
            Some(n) => stack.layer(n).map_err(|_| {
                Fail::usage(
                    format!("--layer {n}"),
                    format!("the stack has {} layers (0..={})", stack.depth(), stack.depth() - 1),
                )
            })?,
        };
        Ok((stack, layer))
    }
}

/// One end of a copy: a path in the stack, or `host:PATH` on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Loc {
    Stack(String),
    Host(PathBuf),
}

impl Loc {
    pub fn parse(s: &str) -> Loc {
        match s.strip_prefix("host:") {
            Some(h) => Loc::Host(PathBuf::from(h)),
            None => Loc::Stack(s.to_string()),
        }
    }

    /// How the user would write it.
    pub fn show(&self) -> String {
        match self {
            Loc::Stack(p) => p.clone(),
            Loc::Host(h) => format!("host:{}", h.display()),
        }
    }

    /// `self/name`.
    pub fn join(&self, name: &str) -> Loc {
        match self {
            Loc::Stack(p) if p.is_empty() || p == "/" => Loc::Stack(name.to_string()),
            Loc::Stack(p) => Loc::Stack(format!("{}/{name}", p.trim_end_matches('/'))),
            Loc::Host(h) => Loc::Host(h.join(name)),
        }
    }

    /// The last component (for copying into a directory).
    pub fn file_name(&self) -> Option<String> {
        match self {
            Loc::Stack(p) => p.trim_end_matches('/').rsplit('/').next().filter(|s| !s.is_empty()).map(str::to_string),
            Loc::Host(h) => h.file_name().map(|n| n.to_string_lossy().into_owned()),
        }
    }

    /// Whether it is a directory (`None`: it does not exist).
    pub fn is_dir(&self, layer: &LayerRef) -> Result<Option<bool>> {
        match self {
            Loc::Stack(p) => match layer.getattr(p) {
                Ok(a) => Ok(Some(a.kind == ubc_stack::Kind::Dir)),
                Err(ubc_stack::Error::NotFound(_)) => Ok(None),
                Err(e) => Err(e).input(p),
            },
            Loc::Host(h) => match std::fs::metadata(h) {
                Ok(m) => Ok(Some(m.is_dir())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(e).input(&self.show()),
            },
        }
    }
}

/// Whether progress bars and the like should be drawn.
pub fn stderr_is_terminal() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

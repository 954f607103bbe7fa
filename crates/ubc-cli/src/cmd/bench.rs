//! `ubc bench`: run the repository's benchmark suite (`scripts/bench`).

use crate::error::{EX_UNAVAILABLE, Fail, Result};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Arguments for scripts/bench (e.g. --quick, --only NAME)
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

/// `scripts/bench` in the current directory or one above it, else in the source tree this
/// binary was built from.
fn find() -> Option<PathBuf> {
    let cwd = std::env::current_dir().ok();
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    cwd.iter()
        .flat_map(|d| d.ancestors())
        .map(|d| d.to_path_buf())
        .chain(std::iter::once(built))
        .map(|d| d.join("scripts/bench"))
        .find(|p| p.is_file())
}

pub fn run(a: Args) -> Result<()> {
    let Some(script) = find() else {
        return Err(Fail::new(
            EX_UNAVAILABLE,
            "scripts/bench",
            "not found: run `ubc bench` inside a clone of the ubc repository (or run ./scripts/bench there)",
        ));
    };
    // Replaces this process: the script's output and exit status are the command's.
    let e = std::process::Command::new(&script).args(&a.args).exec();
    Err(Fail::io(crate::error::Side::Input, &script.display().to_string(), e))
}

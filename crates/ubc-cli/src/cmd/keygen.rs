//! `ubc keygen`: a new random key file for `aead:keyfile=PATH`.

use crate::error::{Ctx, Result};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Where to write the key (64 hex digits, mode 0600; an existing file is not replaced)
    path: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    ubc_stack::encrypt::Key::generate().write_file(&a.path).output(&a.path.display().to_string())
}

//! `ubc cat`: a file as one layer of the stack sees it, to stdout.

use crate::common::StackArgs;
use crate::error::{Ctx, EX_IOERR, Fail, Result};
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    stack: StackArgs,
    /// Path in the stack
    path: String,
}

pub fn run(a: Args) -> Result<()> {
    let (_stack, layer) = a.stack.open()?;
    let f = layer.open(&a.path).input(&a.path)?;
    let mut out = std::io::stdout().lock();
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0u64;
    loop {
        let n = f.read_at(&mut buf, off).input(&a.path)?;
        if n == 0 {
            break;
        }
        match out.write_all(&buf[..n]) {
            Ok(()) => {}
            // `ubc cat … | head` is not an error.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            Err(e) => return Err(Fail::new(EX_IOERR, "<stdout>", crate::error::io_cause(&e))),
        }
        off += n as u64;
    }
    match out.flush() {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(Fail::new(EX_IOERR, "<stdout>", crate::error::io_cause(&e)))
        }
        _ => Ok(()),
    }
}

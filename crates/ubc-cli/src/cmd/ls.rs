//! `ubc ls`: a directory of one layer (names, or with `-l` kind, mode and size).

use crate::common::StackArgs;
use crate::error::{Ctx, Result};
use ubc_stack::Kind;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    stack: StackArgs,
    /// Long listing: kind, mode, size as this layer sees it, name
    #[arg(short = 'L', long)]
    long: bool,
    /// Directory (or file) in the stack; default the root
    #[arg(default_value = "")]
    path: String,
}

pub fn run(a: Args) -> Result<()> {
    let (_stack, layer) = a.stack.open()?;
    let shown = if a.path.is_empty() { "/" } else { a.path.as_str() };
    let at = layer.getattr(&a.path).input(shown)?;
    let entries: Vec<(String, String, Kind)> = if at.kind == Kind::Dir {
        let mut es = layer.readdir(&a.path).input(shown)?;
        es.sort_by(|x, y| x.name.cmp(&y.name));
        es.into_iter().map(|e| (join(&a.path, &e.name), e.name, e.kind)).collect()
    } else {
        vec![(a.path.clone(), a.path.clone(), at.kind)]
    };
    for (full, name, kind) in entries {
        if a.long {
            let at = layer.getattr(&full).input(&full)?;
            let k = match at.kind {
                Kind::Dir => 'd',
                Kind::File => '-',
                Kind::Symlink => 'l',
                Kind::Fifo => 'p',
                Kind::Socket => 's',
                Kind::CharDevice => 'c',
                Kind::BlockDevice => 'b',
                _ => '?',
            };
            println!("{k} {:04o} {:>12} {name}", at.mode & 0o7777, at.size);
        } else {
            println!("{name}{}", if kind == Kind::Dir { "/" } else { "" });
        }
    }
    Ok(())
}

fn join(dir: &str, name: &str) -> String {
    let d = dir.trim_matches('/');
    if d.is_empty() { name.to_string() } else { format!("{d}/{name}") }
}

//! `ubc cp`: copy files and directories (recursively) within the stack, or between the
//! stack and the host (`host:PATH`), with a progress bar when stderr is a terminal.

use crate::common::{Loc, StackArgs, stderr_is_terminal};
use crate::error::{Ctx, EX_CANTCREAT, EX_NOINPUT, EX_USAGE, Fail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::os::unix::fs::FileExt;
use ubc_stack::{Kind, LayerRef};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    stack: StackArgs,
    /// Source: a path in the stack, or host:PATH
    src: String,
    /// Destination: a path in the stack, or host:PATH (an existing directory receives SRC's name)
    dst: String,
}

/// One step of a copy.
enum Step {
    Mkdir(Loc),
    File { src: Loc, dst: Loc, size: u64 },
}

pub fn run(a: Args) -> Result<()> {
    let (stack, layer) = a.stack.open()?;
    let (src, dst) = (Loc::parse(&a.src), Loc::parse(&a.dst));
    if matches!((&src, &dst), (Loc::Host(_), Loc::Host(_))) {
        return Err(Fail::new(EX_USAGE, &a.dst, "host to host: one side must be in the stack (no host: prefix)"));
    }
    let src_dir = src.is_dir(&layer)?.ok_or_else(|| Fail::new(EX_NOINPUT, src.show(), "no such file or directory"))?;
    let target = match dst.is_dir(&layer)? {
        Some(true) => match src.file_name() {
            Some(n) => dst.join(&n),
            None => dst,
        },
        Some(false) if src_dir => return Err(Fail::new(EX_CANTCREAT, dst.show(), "not a directory")),
        _ => dst,
    };
    if src == target {
        return Err(Fail::new(EX_USAGE, target.show(), "source and destination are the same"));
    }
    let mut plan = Vec::new();
    walk(&layer, &src, &target, src_dir, &mut plan)?;
    let total: u64 = plan.iter().map(|s| if let Step::File { size, .. } = s { *size } else { 0 }).sum();

    let bar = if stderr_is_terminal() {
        let b = ProgressBar::new(total);
        b.set_style(
            ProgressStyle::with_template("{spinner} {elapsed_precise} [{wide_bar}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {msg}")
                .expect("static template")
                .progress_chars("=> "),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    let mut buf = vec![0u8; 1 << 20];
    for step in &plan {
        match step {
            Step::Mkdir(d) => mkdir(&layer, d)?,
            Step::File { src, dst, .. } => {
                bar.set_message(src.file_name().unwrap_or_default());
                copy_file(&layer, src, dst, &mut buf, &bar)?;
            }
        }
    }
    // Everything written into the stack reaches its store before we exit.
    if !matches!(target, Loc::Host(_)) {
        stack.sync_all().output(&target.show())?;
    }
    bar.finish_and_clear();
    Ok(())
}

/// The steps copying `src` to `dst`, parents before children.
fn walk(layer: &LayerRef, src: &Loc, dst: &Loc, is_dir: bool, plan: &mut Vec<Step>) -> Result<()> {
    if !is_dir {
        let size = match src {
            Loc::Stack(p) => layer.getattr(p).input(p)?.size,
            Loc::Host(h) => std::fs::metadata(h).input(&src.show())?.len(),
        };
        plan.push(Step::File { src: src.clone(), dst: dst.clone(), size });
        return Ok(());
    }
    plan.push(Step::Mkdir(dst.clone()));
    let mut children: Vec<(String, bool)> = match src {
        Loc::Stack(p) => layer
            .readdir(p)
            .input(p)?
            .into_iter()
            .filter_map(|e| match e.kind {
                Kind::Dir => Some((e.name, true)),
                Kind::File => Some((e.name, false)),
                k => {
                    eprintln!("ubc: {}: {} not copied", src.join(&e.name).show(), crate::cmd::stat::kind_name(k));
                    None
                }
            })
            .collect(),
        Loc::Host(h) => {
            let mut v = Vec::new();
            for e in std::fs::read_dir(h).input(&src.show())? {
                let e = e.input(&src.show())?;
                let name = e.file_name().to_string_lossy().into_owned();
                let md = std::fs::metadata(e.path()).input(&src.join(&name).show())?;
                if md.is_dir() || md.is_file() {
                    v.push((name, md.is_dir()));
                } else {
                    eprintln!("ubc: {}: not a regular file, not copied", src.join(&name).show());
                }
            }
            v
        }
    };
    children.sort();
    for (name, d) in children {
        walk(layer, &src.join(&name), &dst.join(&name), d, plan)?;
    }
    Ok(())
}

fn mkdir(layer: &LayerRef, d: &Loc) -> Result<()> {
    if d.is_dir(layer)? == Some(true) {
        return Ok(());
    }
    match d {
        Loc::Stack(p) => layer.mkdir(p).output(p),
        Loc::Host(h) => std::fs::create_dir(h).output(&d.show()),
    }
}

enum Reader {
    Stack(ubc_stack::File),
    Host(std::fs::File),
}

enum Writer {
    Stack(ubc_stack::File),
    Host(std::fs::File),
}

fn copy_file(layer: &LayerRef, src: &Loc, dst: &Loc, buf: &mut [u8], bar: &ProgressBar) -> Result<()> {
    let (sname, dname) = (src.show(), dst.show());
    let r = match src {
        Loc::Stack(p) => Reader::Stack(layer.open(p).input(&sname)?),
        Loc::Host(h) => Reader::Host(std::fs::File::open(h).input(&sname)?),
    };
    let w = match dst {
        Loc::Stack(p) => Writer::Stack(layer.create(p).output(&dname)?),
        Loc::Host(h) => Writer::Host(std::fs::File::create(h).output(&dname)?),
    };
    let mut off = 0u64;
    loop {
        let n = match &r {
            Reader::Stack(f) => f.read_at(buf, off).input(&sname)?,
            Reader::Host(f) => f.read_at(buf, off).input(&sname)?,
        };
        if n == 0 {
            break;
        }
        match &w {
            Writer::Stack(f) => write_all(|b, o| f.write_at(b, o).output(&dname), &buf[..n], off, &dname)?,
            Writer::Host(f) => f.write_all_at(&buf[..n], off).output(&dname)?,
        }
        off += n as u64;
        bar.inc(n as u64);
    }
    Ok(())
}

fn write_all(mut write: impl FnMut(&[u8], u64) -> Result<usize>, mut b: &[u8], mut off: u64, name: &str) -> Result<()> {
    while !b.is_empty() {
        let n = write(b, off)?;
        if n == 0 {
            return Err(Fail::new(crate::error::EX_IOERR, name, "short write"));
        }
        b = &b[n..];
        off += n as u64;
    }
    Ok(())
}

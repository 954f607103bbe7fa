//! `ubc`: the main-job tour, and cat/cp/stat/ls over any layer of a stack.
//!
//! Errors are one line on stderr, `ubc: <path>: <cause>`, and the exit status follows
//! sysexits(3): 64 bad arguments or stack spec (command-line usage errors included),
//! 65 authentication failure (tampered or wrong-key ciphertext), 66 missing input,
//! 69 the benchmark script is not found or a FUSE mount failed, 73 cannot create the output, 74 I/O error,
//! 70 anything else.

mod cmd;
mod common;
mod error;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "ubc",
    version,
    about = "A user-space unified buffer cache: tour, and files through any layer of a stack"
)]
#[command(after_help = "Exit status: 0 ok, 64 usage or bad stack spec, 65 authentication failure, \
66 missing input, 69 benchmark script not found or mount failed, 70 internal error, 73 cannot create output, 74 I/O error.")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The main job: one copy for read and map, coherent layers, eviction, read-ahead, write-behind
    Tour(cmd::tour::Args),
    /// Write a file, as a layer of the stack sees it, to stdout
    Cat(cmd::cat::Args),
    /// Copy files or directories (recursively) between the stack and the host (`host:PATH`)
    Cp(cmd::cp::Args),
    /// Show a file's kind, size (as the layer sees it), mode and modification time
    Stat(cmd::stat::Args),
    /// List a directory of a layer
    Ls(cmd::ls::Args),
    /// Write a new random key file for `aead:keyfile=PATH`
    Keygen(cmd::keygen::Args),
    /// Run the benchmark suite (./scripts/bench of the repository) with these arguments
    Bench(cmd::bench::Args),
    /// Serve layers of one stack through FUSE (one mount per --at, all coherent)
    Mount(cmd::mount::Args),
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // Help and version go to stdout with status 0; usage errors are EX_USAGE.
            let _ = e.print();
            std::process::exit(if e.use_stderr() { error::EX_USAGE } else { 0 });
        }
    };
    let r = match cli.cmd {
        Cmd::Tour(a) => cmd::tour::run(a),
        Cmd::Cat(a) => cmd::cat::run(a),
        Cmd::Cp(a) => cmd::cp::run(a),
        Cmd::Stat(a) => cmd::stat::run(a),
        Cmd::Ls(a) => cmd::ls::run(a),
        Cmd::Keygen(a) => cmd::keygen::run(a),
        Cmd::Bench(a) => cmd::bench::run(a),
        Cmd::Mount(a) => cmd::mount::run(a),
    };
    if let Err(f) = r {
        eprintln!("ubc: {f}");
        std::process::exit(f.code);
    }
}

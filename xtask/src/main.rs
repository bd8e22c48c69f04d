//! `cargo xtask`: the project's tasks, as a small Rust program (no make, no shell).
//!
//! ```text
//! cargo xtask setup                 install libtorch 2.11.0 once (cached), link it for cargo
//! cargo xtask demo                  setup, then run the main job (examples/demo.rs)
//! cargo xtask test                  setup, then the CPU test matrix
//! cargo xtask test --record-minimums
//!                                   the matrix, then each step's and test binary's
//!                                   passed tests recorded as their minimums
//! cargo xtask test-gpu              the GPU bundle built and run here; fails without a GPU
//! cargo xtask test-gpu --bundle DIR the GPU tests, demo, trainer, CLI, bench + run.sh in DIR
//! cargo xtask bench                 run the benchmarks, print one table
//! cargo xtask man [DIR]             torchtools' man pages in DIR (default target/man)
//! cargo xtask picture [STATE]       the README's picture of the page (from a saved state)
//! cargo xtask mutants [CRATE..] [--shard K/N | --full] [--again]
//!                                   mutation testing of the libtorch-free crates
//! ```

mod bench;
mod docs;
mod downstream;
mod gpu;
mod minimums;
mod mutants;
mod picture;
mod setup;
mod steps;
mod test;
mod wheel;

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <setup [--print-env] | demo | test [--record-minimums [--lower NAME]..] | downstream | wheel [--dev | --test] | man [DIR] | picture [STATE] | test-gpu [--bundle DIR] | bench | \
                     mutants [CRATE..] [--shard K/N | --full] [--again]>";

/// The names of `--lower NAME --lower NAME ...`; `None` for anything else.
fn lowered(args: &[&str]) -> Option<Vec<String>> {
    args.chunks(2)
        .map(|pair| match pair {
            ["--lower", name] => Some((*name).to_owned()),
            _ => None,
        })
        .collect()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match args.as_slice() {
        ["setup"] => setup::setup().map(|_| ()),
        ["setup", "--print-env"] => setup::print_env(),
        ["demo"] => demo(),
        ["test"] => test::cpu_matrix(false, &[]),
        ["test", "--record-minimums", lower @ ..] => match lowered(lower) {
            Some(names) => test::cpu_matrix(true, &names),
            None => {
                eprintln!("xtask: --record-minimums takes `--lower NAME` pairs only\n{USAGE}");
                return ExitCode::from(2);
            }
        },
        ["wheel"] => wheel::run(false),
        ["wheel", "--dev"] => wheel::run(true),
        ["wheel", "--test"] => wheel::install_and_run(),
        ["downstream"] => downstream::build_and_run(),
        ["man"] => wheel::man(None),
        ["man", dir] => wheel::man(Some(std::path::Path::new(dir))),
        ["picture"] => picture::run(None),
        ["picture", state] => picture::run(Some(std::path::Path::new(state))),
        ["test-gpu"] => gpu::run_gpu_tests(),
        ["test-gpu", "--bundle", dir] => gpu::bundle(&PathBuf::from(dir)),
        ["bench"] => bench::run(),
        ["mutants", rest @ ..] => mutants::run(rest),
        ["help" | "--help" | "-h"] | [] => {
            println!("{USAGE}");
            return if args.is_empty() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
        _ => {
            eprintln!("xtask: unknown arguments {args:?}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("\nxtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root.
fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

fn demo() -> anyhow::Result<()> {
    setup::setup()?;
    let out = root().join("target/demo");
    let mut cmd = steps::cargo(&["run", "--quiet", "--example", "demo", "--", "--out"]);
    cmd.arg(&out);
    steps::run("demo", cmd)
}

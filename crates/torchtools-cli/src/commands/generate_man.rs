//! `torchtools generate-man DIR` (internal, run by `cargo xtask man` and the wheel's
//! build): a man page for `torchtools` and one for each of its commands and
//! subcommands (`torchtools-reserve.1`, `torchtools-jobs-wait.1`), from the same
//! definitions as `--help` (clap_mangen).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::CommandFactory;

/// (Internal) write the man pages of torchtools and its commands into DIR.
#[derive(clap::Args)]
#[command(hide = true)]
pub(crate) struct Args {
    /// Where the pages go (created if missing).
    pub(crate) dir: PathBuf,
}

/// Writes the pages; prints each file written.
pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let cli = crate::Cli::command();
    write_pages(&cli, &["torchtools"], &args.dir)?;
    Ok(ExitCode::SUCCESS)
}

/// The page of `cmd` (its words from the top: `["torchtools", "jobs", "wait"]`) and
/// of each visible subcommand under it.
fn write_pages(cmd: &clap::Command, words: &[&str], dir: &Path) -> Result<()> {
    // clap names a command with a `&'static str` (without its `string` feature): a few
    // dozen names, for the life of this one-shot command.
    let name: &'static str = Box::leak(words.join("-").into_boxed_str());
    let page = cmd
        .clone()
        .name(name)
        .bin_name(words.join(" "))
        .version(env!("CARGO_PKG_VERSION"));
    let mut text = Vec::new();
    clap_mangen::Man::new(page)
        .render(&mut text)
        .with_context(|| format!("rendering {name}'s man page"))?;
    let path = dir.join(format!("{name}.1"));
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    println!("{}", path.display());
    for sub in cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
    {
        let mut sub_words = words.to_vec();
        sub_words.push(sub.get_name());
        write_pages(sub, &sub_words, dir)?;
    }
    Ok(())
}

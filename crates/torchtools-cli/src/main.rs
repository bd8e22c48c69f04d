//! `torchtools`: the command-line face of torchtools, built on its libtorch-free
//! cores so that it starts in milliseconds and serves Python users as well.

//!
//! One module per command, each holding its arguments (`Args`, clap's derive) and its
//! `run`; this file is the table of commands and their dispatch.

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{CommandFactory, Parser};

use commands::{
    devices, launch, locks, metrics, policy, probe, queue, reserve, serve, top, track, usage,
    Command,
};

mod arg_groups;
mod args;
mod child;
mod commands;
mod complete;
mod config;
mod exit;
mod hook;
mod http;
mod ignored;
mod jobs;
mod limit;
mod peers;
mod preempt;
mod process;
mod snapshot;
mod submit;

#[derive(Parser)]
#[command(name = "torchtools", version, about = "Tools for training on shared GPU machines", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The log filter: `TORCHTOOLS_LOG` (`RUST_LOG` syntax), else warnings and errors.
fn log_filter() -> Result<tracing_subscriber::EnvFilter, tt_device::LogFilterError> {
    tt_device::log_filter("warn", |v| {
        tracing_subscriber::EnvFilter::builder().parse(v)
    })
}

fn main() -> ExitCode {
    // The variables every command depends on, checked before any work.
    let filter = match (log_filter(), tt_device::omp_num_threads()) {
        (Ok(filter), Ok(_)) => filter,
        (Err(e), _) => {
            eprintln!("torchtools: error: {e}");
            return ExitCode::from(exit::USAGE);
        }
        (_, Err(e)) => {
            eprintln!("torchtools: error: {e}");
            return ExitCode::from(exit::USAGE);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    // `COMPLETE=bash torchtools` prints the shell's completion script; the shell then
    // asks again with the words typed (clap_complete's convention, as uv's).
    clap_complete::CompleteEnv::with_factory(Cli::command).complete();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => ExitCode::from(failed(&e)),
    }
}

/// Says a command's error and gives its exit status: its own (`exit::Exit`), else 1.
fn failed(e: &anyhow::Error) -> u8 {
    eprintln!("torchtools: error: {e:#}");
    match e.downcast_ref::<exit::Exit>() {
        Some(exit) => exit.code,
        None => exit::FAILURE,
    }
}

/// For the commands that only print (devices, locks, queue, top --once / --json):
/// a closed pipe (`torchtools locks | head -1`) ends the process quietly, as it ends
/// `ls`, instead of a panic. Commands that run another command keep ignoring SIGPIPE,
/// so that a closed terminal never takes their reservation away from the command.
fn quiet_on_closed_pipe() {
    // SAFETY: restoring the default disposition of a signal has no preconditions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    if cli.command.only_prints() {
        quiet_on_closed_pipe();
    }
    // `--on-end`'s command out of this process's arguments, which anyone can read.
    if cli.command.hook().is_some_and(|h| h.on_end.is_some()) {
        hook::hide_from_argv(cli.command.command_len())?;
    }
    // The hook (an option, or the config's default), checked before any work.
    let hook = match cli.command.hook() {
        Some(args) => args.resolve()?,
        None => None,
    };
    if let Some((detach, command)) = cli.command.detached() {
        let argv: Vec<OsString> = std::env::args_os().collect();
        if detach.to_slurm()? {
            return submit::run(&cli.command, &detach, &argv, command, hook.is_some());
        }
        return jobs::keeper::detach(&detach, &argv, command, hook.as_ref());
    }
    // The command line as the hook shows it: without the hook's own options.
    let argv: Vec<OsString> = std::env::args_os().skip(1).collect();
    let line = jobs::keeper::without_detach(&argv, cli.command.command_len());
    let hook = hook.map(|h| (h, line));
    match cli.command {
        Command::Devices(args) => devices::run(&args),
        Command::Reserve(args) => attached(hook, || reserve::run(&args)),
        Command::Track(args) => track::run(&args),
        Command::Probe(args) => probe::run(&args),
        Command::Run(args) => attached(hook, || commands::run::run(&args)),
        Command::Launch(args) => attached(hook, || launch::run(&args)),
        Command::Locks(args) => locks::run(&args),
        Command::Policy(args) => policy::run(&args),
        Command::Jobs(args) => commands::jobs::run(&args),
        Command::Logs(args) => commands::logs::run(&args),
        Command::Stop(args) => commands::stop::run(&args),
        Command::JobRun(args) => commands::job_run::run(&args),
        Command::JobHook(args) => commands::job_hook::run(&args),
        Command::GenerateMan(args) => commands::generate_man::run(&args),
        Command::Usage(args) => usage::run(&args),
        Command::Queue(args) => queue::run(&args),
        Command::Metrics(args) => metrics::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Top(args) => top::run(&args),
    }
}

/// Runs a command that runs the user's (`reserve`, `run`, `launch`) in this process,
/// with its `--on-end` hook: the hook's guardian starts first, and runs the hook with
/// the exit status this process ends with (after saying its error), or as lost if
/// this process is killed first.
fn attached(
    hook: Option<(hook::Hook, Vec<OsString>)>,
    job: impl FnOnce() -> anyhow::Result<u8>,
) -> anyhow::Result<ExitCode> {
    let Some((hook, line)) = hook else {
        return job().map(ExitCode::from);
    };
    let command = std::iter::once("torchtools".to_owned())
        .chain(line.iter().map(|a| a.to_string_lossy().into_owned()))
        .collect();
    let mut guardian = hook::Guardian::start(&hook, "", command, None, tt_device::now_unix())?;
    guardian.pid(std::process::id());
    let result = job();
    let code = match &result {
        Ok(code) => *code,
        // Said before the hook runs, as it happened; then not again.
        Err(e) => failed(e),
    };
    guardian.ended(i32::from(code));
    Ok(ExitCode::from(code))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every command's and subcommand's summary, as `torchtools --help` (and each
    /// `CMD --help`) lists it, with its path.
    fn summaries(cmd: &clap::Command, path: &str, out: &mut Vec<(String, String)>) {
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            let path = format!("{path} {}", sub.get_name());
            let about = sub.get_about().map(ToString::to_string).unwrap_or_default();
            out.push((path.clone(), about));
            summaries(sub, &path, out);
        }
    }

    #[test]
    fn every_summary_fits_on_a_line_and_the_help_on_a_screen() {
        let mut all = Vec::new();
        summaries(&Cli::command(), "torchtools", &mut all);
        assert!(all.len() > 20, "{all:?}");
        for (path, about) in &all {
            assert!(
                !about.is_empty() && about.chars().count() < 60 && !about.contains('\n'),
                "`{path}`: its summary must be one line under 60 characters (the rest of \
                 its doc comment goes after a blank line): {about:?}"
            );
        }
        let help = Cli::command().term_width(100).render_help().to_string();
        let lines: Vec<&str> = help.lines().collect();
        assert!(lines.len() <= 30, "{} lines:\n{help}", lines.len());
        for line in &lines {
            assert!(line.chars().count() <= 100, "{line:?}");
        }
        // `CMD --help` keeps the detail: the long help is longer than the summary.
        let mut reserve = Cli::command();
        let reserve = reserve.find_subcommand_mut("reserve").unwrap();
        let long = reserve.render_long_help().to_string();
        assert!(long.contains("The command inherits the locks"), "{long}");
    }
}

//! `torchtools`: the command-line face of torchtools, built on its libtorch-free
//! cores so that it starts in milliseconds and serves Python users as well.

//!
//! One module per command, each holding its arguments (`Args`, clap's derive) and its
//! `run`; this file is the table of commands and their dispatch.

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod arg_groups;
mod args;
mod child;
mod devices;
mod exit;
mod hook;
mod ignored;
mod jobs;
mod launch;
mod limit;
mod locks;
mod metrics;
mod policy;
mod preempt;
mod probe;
mod queue;
mod reserve;
mod run;
mod serve;
mod snapshot;
mod subtrack;
mod top;
mod track;
mod usage;

/// Exit status for a bad variable or an impossible device request.
pub(crate) const EXIT_BAD_ENV: u8 = 2;

#[derive(Parser)]
#[command(name = "torchtools", version, about = "Tools for training on shared GPU machines", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the GPUs (NVML) and show which device TORCHTOOLS_DEVICE, LOCAL_RANK and
    /// CUDA_VISIBLE_DEVICES select.
    ///
    /// Exits with 2 when a variable is invalid or asks for a device that is not
    /// there, after printing the report.
    Devices(devices::Args),
    /// Reserve GPU(s), then run a command on them: take each GPU's lock (waiting for
    /// it), raise a memory fence that leaves --bytes free for the command, run it with
    /// CUDA_VISIBLE_DEVICES set to the GPUs' UUIDs, and release everything when it ends.
    ///
    /// The command inherits the locks: they are held as long as it or torchtools lives.
    /// Exit status: the command's (128+N when killed by signal N); 75 when the GPUs stay
    /// locked past --timeout; 127 when the command is not found; 2 for bad arguments.
    #[command(arg_required_else_help = true)]
    // --bytes or --no-fence is required (checked where the request is made, whose
    // message says why: a fence leaves free what --bytes says); the usage says so.
    #[command(
        override_usage = "torchtools reserve (--bytes <BYTES> | --no-fence) [OPTIONS] -- <CMD>..."
    )]
    Reserve(reserve::Args),
    /// Track a command's resources: RAM of it and its descendants (total, private,
    /// shared), GPU RAM, CPU and GPU use, energy, time, as gpu_tracker does, with exact
    /// kernel peaks.
    ///
    /// The report goes to stdout (or --output), as gpu_tracker's; messages go to
    /// stderr. The exit status is the command's (128+N when killed by signal N; 127
    /// when not found; 2 for bad arguments or output paths, checked before the
    /// command starts). gpu_tracker's options work too (-e, --st, --ru, --gru, --tu,
    /// --nec, --guuids, --gb, --tf, --disable-logs, --tconfig): put `torchtools track`
    /// in front of a `gpu-tracker` line. `track compare A.json B.json` compares reports
    /// written with --format json; `track sub-track analyze|combine|compare` are
    /// gpu_tracker's sub-tracking commands.
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Track(Box<track::Args>),
    /// Probe a command's peak memory: run it with TORCHTOOLS_PROBE=1 and
    /// TORCHTOOLS_PROBE_STEPS=N (so a script can opt into a short run) until it exits or
    /// the timeout, sampling its whole process tree (NVML GPU memory, else RSS), and print
    /// the peak and the bytes to reserve.
    Probe(probe::Args),
    /// Probe, reserve, run: probe CMD in probe mode (as `probe` does) or take --bytes,
    /// reserve GPU(s) leaving that much free (as `reserve` does), then run CMD for real.
    #[command(group(clap::ArgGroup::new("size").required(true).args(["bytes", "probe"])))]
    Run(run::Args),
    /// Launch N processes of CMD with torchrun's variables and command line: a drop-in
    /// for `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
    /// ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*; OMP_NUM_THREADS=1 when unset and
    /// N > 1), each output line prefixed with its rank as it is printed
    /// (PYTHONUNBUFFERED=1 when unset, so that Python's print reaches you at once).
    ///
    /// torchrun's options work as torchrun spells them (`--nproc_per_node=2` and
    /// `--nproc-per-node 2`, `--standalone`, `--rdzv-endpoint`, `-m`, `--no-python`,
    /// `--run-path`), and a script path runs with Python: `torchtools launch
    /// --nproc_per_node=4 train.py --lr 3e-4`. Without torchrun's forms: `launch
    /// --nproc-per-node 2 -- ./my_rust_binary`.
    ///
    /// When a rank fails, the others get SIGTERM, then SIGKILL after 10 s, and
    /// torchtools exits with the failed rank's status, naming it and the exception
    /// it recorded (PyTorch's `@record`).
    Launch(Box<launch::LaunchArgs>),
    /// Show every GPU's lock: free, or held by whom, since when, reserving how much,
    /// and how many requests wait for it.
    Locks(locks::Args),
    /// Your detached jobs (`--detach` on reserve, run, launch): id, state (waiting,
    /// running, finished or failed with its status, lost when the machine rebooted),
    /// how long, the command and its log.
    Jobs(jobs::JobsArgs),
    /// A detached job's log (its id, a unique prefix of it, or `last`).
    Logs(jobs::LogsArgs),
    /// Stop a detached job: SIGTERM to it (a torchtools trainer then checkpoints and
    /// exits 75), SIGKILL to all of it after --grace.
    Stop(jobs::StopArgs),
    /// (Internal) the keeper of a detached job.
    #[command(hide = true)]
    JobRun(jobs::JobRunArgs),
    /// (Internal) the guardian that runs a job's `--on-end` hook.
    #[command(hide = true)]
    JobHook(hook::GuardianArgs),
    /// Who used the GPUs, and how much: GPU-hours and reserved GiB-hours per user (or
    /// per GPU) from the lock directory's usage log, which every reservation writes
    /// (`reserve`, `run`, `launch --gpu`, the API). A holder that died holding its GPU
    /// is counted until the GPU's next holder took it (or until now), marked lost.
    Usage(usage::Args),
    /// The GPUs, reservations, queue, users and jobs as OpenMetrics text for Prometheus:
    /// printed once, served at http://ADDR/metrics (--listen ADDR), or written for
    /// node_exporter's textfile collector (--textfile DIR).
    ///
    /// Per GPU: memory used and total, use, fenced bytes, who reserved how much (holder
    /// or sharers), waiters and the oldest wait; per user: GPU-seconds and reserved
    /// byte-seconds (the usage records), queued requests, running and waiting jobs; per
    /// running job: its GPUs and budget. Labels: gpu, uuid, user, job_id.
    Metrics(metrics::Args),
    /// The whole server on one page, in a browser: every GPU's memory, holder or
    /// sharers, the queue in serving order and why, jobs, each user's use over the
    /// last day and week, each GPU's memory over the last hour; live, read-only.
    ///
    /// Serves the page at http://ADDR/, its data as JSON at /api/state, and /metrics
    /// (as `metrics --listen`), until stopped. What it shows is what `locks`, `queue`,
    /// `jobs --all` and `usage` show every user of the machine.
    Serve(serve::Args),
    /// Show the requests waiting for GPUs, in the order they will be served (first
    /// come, first served, or by the machine's fair-share policy with each request's
    /// priority and why): user, pid, how long, GPUs asked, bytes, command.
    Queue(queue::Args),
    /// Show the machine's queueing policy (/etc/torchtools/policy.toml, or the file
    /// TORCHTOOLS_POLICY names) and why it is in force or ignored, and each user's
    /// recent use, GPUs held and requests waiting under it.
    ///
    /// Exits with 1 when a policy file is there but ignored: not owned by root (or,
    /// for TORCHTOOLS_POLICY's file, by the lock directory's owner), writable by
    /// others, or not valid (the message names the key).
    Policy(policy::Args),
    /// A live view of the GPUs, refreshed every second: memory used, free and fenced,
    /// use, the lock's holder and the requests waiting, and the processes on each GPU
    /// (marked when they run outside the holder's reservation).
    ///
    /// Keys: q quits, the arrow keys select a GPU, c toggles a compact view for narrow
    /// terminals. Without NVML it shows the locks and the queue and says why the GPU
    /// columns are empty.
    Top(top::Args),
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
            return ExitCode::from(EXIT_BAD_ENV);
        }
        (_, Err(e)) => {
            eprintln!("torchtools: error: {e}");
            return ExitCode::from(EXIT_BAD_ENV);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
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
        Some(exit::Exit(code, _)) => *code,
        None => 1,
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

impl Command {
    /// `--detach` (with its `--log-dir`) and how many of the command line's last words
    /// are the user's command, for the commands that run one: decided once, from the
    /// parsed arguments, before any command runs.
    fn detached(&self) -> Option<(arg_groups::DetachArgs, usize)> {
        let mut detach = match self {
            Command::Reserve(a) if a.detach.detach => a.detach.clone(),
            Command::Run(a) if a.detach.detach => a.detach.clone(),
            Command::Launch(a) => a.detached()?,
            _ => return None,
        };
        // A preempted job goes back into the queue.
        detach.requeue |= match self {
            Command::Reserve(a) => a.reservation.time.preemptible,
            Command::Run(a) => a.reservation.time.preemptible,
            Command::Launch(a) => a.preemptible(),
            _ => false,
        };
        Some((detach, self.command_len()))
    }

    /// How many of the command line's last words are the user's command.
    fn command_len(&self) -> usize {
        match self {
            Command::Reserve(a) => a.command.len(),
            Command::Run(a) => a.command.len(),
            Command::Launch(a) => a.command_len(),
            _ => 0,
        }
    }

    /// The `--on-end` options of the commands that run one.
    fn hook(&self) -> Option<&arg_groups::HookArgs> {
        match self {
            Command::Reserve(a) => Some(&a.hook),
            Command::Run(a) => Some(&a.hook),
            Command::Launch(a) => Some(&a.hook),
            _ => None,
        }
    }

    /// Whether it only prints (a closed pipe may end it quietly).
    fn only_prints(&self) -> bool {
        match self {
            Command::Devices(_)
            | Command::Locks(_)
            | Command::Queue(_)
            | Command::Policy(_)
            | Command::Usage(_) => true,
            Command::Top(a) => a.once || a.json,
            Command::Metrics(a) => a.listen.is_none() && a.textfile.is_none(),
            _ => false,
        }
    }
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
        return jobs::detach(&detach, &argv, command, hook.as_ref());
    }
    // The command line as the hook shows it: without the hook's own options.
    let argv: Vec<OsString> = std::env::args_os().skip(1).collect();
    let line = jobs::without_detach(&argv, cli.command.command_len());
    let hook = hook.map(|h| (h, line));
    match cli.command {
        Command::Devices(args) => devices::run(args),
        Command::Reserve(args) => attached(hook, || reserve::run(args)),
        Command::Track(args) => track::run(*args),
        Command::Probe(args) => probe::run(args),
        Command::Run(args) => attached(hook, || run::run(args)),
        Command::Launch(args) => attached(hook, || launch::launch(*args)),
        Command::Locks(args) => locks::run(args),
        Command::Policy(args) => policy::run(args),
        Command::Jobs(args) => jobs::run(args),
        Command::Logs(args) => jobs::logs(&args.job, args.follow),
        Command::Stop(args) => jobs::stop(&args.job, args.grace),
        Command::JobRun(args) => jobs::keep(&args.id, &args.command),
        Command::JobHook(args) => hook::guard(&args),
        Command::Usage(args) => usage::run(args),
        Command::Queue(args) => queue::run(args),
        Command::Metrics(args) => metrics::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Top(args) => top::run(args),
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

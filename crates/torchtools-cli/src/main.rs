//! `torchtools`: the command-line face of torchtools, built on its libtorch-free
//! cores so that it starts in milliseconds and serves Python users as well.

use std::process::ExitCode;

use std::ffi::OsString;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tt_device::Bytes;
use tt_lock::GpuSpec;

mod args;
mod child;
mod ignored;
mod jobs;
mod launch;
mod probe;
mod reserve;
mod subtrack;
mod top;
mod track;
mod usage;

/// Exit status for a bad variable or an impossible device request.
const EXIT_BAD_ENV: u8 = 2;

#[derive(Parser)]
#[command(name = "torchtools", version, about = "Tools for training on shared GPU machines", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// `probe --max-batch` and its options.
#[derive(clap::Args)]
struct MaxBatchArgs {
    /// Predict the largest batch that fits instead: probe the command at up to three
    /// batch sizes (TORCHTOOLS_PROBE_BATCH), fit memory as a line in the batch, and
    /// solve it for --capacity, leaving a reservation's headroom (3% + 32 MiB).
    #[arg(long)]
    max_batch: bool,
    /// The first probe's batch (the second runs at twice it).
    #[arg(long, default_value_t = 2, requires = "max_batch", value_parser = clap::value_parser!(u64).range(1..))]
    batch_start: u64,
    /// Never predict more than this batch (e.g. the dataset's size).
    #[arg(long, requires = "max_batch", value_parser = clap::value_parser!(u64).range(1..))]
    batch_limit: Option<u64>,
    /// The memory the run may use (default: the probed GPU's free memory now; without
    /// a GPU, the system's available memory).
    #[arg(long, requires = "max_batch", value_parser = args::size)]
    capacity: Option<Bytes>,
}

#[derive(Subcommand)]
enum Command {
    /// List the GPUs (NVML) and show which device TORCHTOOLS_DEVICE, LOCAL_RANK and
    /// CUDA_VISIBLE_DEVICES select.
    ///
    /// Exits with 2 when a variable is invalid or asks for a device that is not
    /// there, after printing the report.
    Devices {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
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
    Reserve {
        /// Memory the command needs on each GPU: the fence leaves this much (plus
        /// --margin) free. Sizes: 6GiB, 512MiB, 6G, 1.5GB, bytes.
        #[arg(long, value_parser = args::size)]
        bytes: Option<Bytes>,
        #[command(flatten)]
        reservation: ReserveArgs,
        #[command(flatten)]
        detach: jobs::DetachArgs,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true, value_name = "CMD")]
        command: Vec<OsString>,
    },
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
    Track {
        #[command(subcommand)]
        compare: Option<Box<TrackCommand>>,
        /// Time between samples (gpu_tracker's --st, in seconds): 100ms by default,
        /// at least 10ms. gpu_tracker samples every second; our peaks are exact
        /// whatever the interval (the kernel's high-water marks), the interval only
        /// sets how fine the timeline is.
        #[arg(long, visible_alias = "st", value_parser = args::duration, allow_hyphen_values = true)]
        interval: Option<Duration>,
        /// Unit of RAM: bytes, kilobytes, megabytes, gigabytes (default), terabytes
        /// (decimal).
        #[arg(long, visible_alias = "ru")]
        ram_unit: Option<tt_tracker::RamUnit>,
        /// Unit of GPU RAM (default gigabytes).
        #[arg(long, visible_alias = "gru")]
        gpu_ram_unit: Option<tt_tracker::RamUnit>,
        /// Unit of time: seconds, minutes, hours (default), days.
        #[arg(long, visible_alias = "tu")]
        time_unit: Option<tt_tracker::TimeUnit>,
        /// Report format: text (default) or json.
        #[arg(short, long, value_parser = ["text", "json"])]
        format: Option<String>,
        /// Write the report to this file instead of stdout (replaced if it exists).
        #[arg(short, long)]
        output: Option<std::path::PathBuf>,
        /// Write every sample to this file: .csv, .jsonl or .sqlite (gpu_tracker's --tf).
        #[arg(long, visible_alias = "tf")]
        timeline: Option<std::path::PathBuf>,
        /// Replace an existing --timeline file.
        #[arg(long)]
        overwrite: bool,
        /// Draw RAM, GPU RAM and CPU over time into this SVG file.
        #[arg(long)]
        plot: Option<std::path::PathBuf>,
        /// Cores the command is expected to use (denominator of hardware percentages).
        #[arg(long, visible_alias = "nec", value_parser = clap::value_parser!(u32).range(1..))]
        n_expected_cores: Option<u32>,
        /// GPUs (UUIDs, comma-separated) whose utilisation and energy count.
        #[arg(long, visible_alias = "guuids", value_delimiter = ',')]
        gpu_uuids: Option<Vec<String>>,
        /// gpu_tracker's GPU brand: nvidia (the one torchtools reads, through NVML).
        #[arg(long = "gb", value_name = "BRAND", value_parser = ["nvidia", "amd"])]
        gpu_brand: Option<String>,
        /// Do not print the tracker's warnings (they stay in the report).
        #[arg(long)]
        disable_logs: bool,
        /// Do not watch the command's exit with ptrace. By default its own peak RSS is
        /// read as it exits (exact, without the children it reaped); meanwhile a
        /// debugger or py-spy cannot attach to it. With this, its peak is the sampled
        /// high-water mark.
        #[arg(long)]
        no_ptrace: bool,
        /// gpu_tracker's JSON file of Tracker arguments (sleep_time, ram_unit,
        /// gpu_ram_unit, time_unit, n_expected_cores, gpu_uuids, disable_logs,
        /// gpu_brand, tracking_file, overwrite); options on the command line win.
        #[arg(long, value_name = "FILE")]
        tconfig: Option<std::path::PathBuf>,
        /// gpu_tracker's -e: the command and its arguments in one string, split on
        /// whitespace as gpu_tracker splits it (no quoting). Prefer `-- CMD ARGS`,
        /// which passes arguments as they are.
        #[arg(short = 'e', long, value_name = "COMMAND", conflicts_with = "command")]
        execute: Option<String>,
        /// The command and its arguments, after `--`, passed as they are.
        #[arg(last = true, required_unless_present = "execute", value_name = "CMD")]
        command: Vec<OsString>,
    },
    /// Probe a command's peak memory: run it with TORCHTOOLS_PROBE=1 and
    /// TORCHTOOLS_PROBE_STEPS=N (so a script can opt into a short run) until it exits or
    /// the timeout, sampling its whole process tree (NVML GPU memory, else RSS), and print
    /// the peak and the bytes to reserve.
    Probe {
        /// Run it on this GPU only (index as nvidia-smi shows it, or UUID).
        #[arg(long, value_parser = gpu_spec)]
        gpu: Option<GpuSpec>,
        /// Stop it after this long (its peak so far is reported): 30s, 5m.
        #[arg(long, value_parser = args::duration, default_value = "60s")]
        timeout: Duration,
        /// Steps the command is asked to run (TORCHTOOLS_PROBE_STEPS).
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
        steps: u64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        max_batch: MaxBatchArgs,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true, value_name = "CMD")]
        command: Vec<OsString>,
    },
    /// Probe, reserve, run: probe CMD in probe mode (as `probe` does) or take --bytes,
    /// reserve GPU(s) leaving that much free (as `reserve` does), then run CMD for real.
    #[command(group(clap::ArgGroup::new("size").required(true).args(["bytes", "probe"])))]
    Run {
        /// Memory the command needs, instead of probing it.
        #[arg(long, value_parser = args::size)]
        bytes: Option<Bytes>,
        /// Probe the command first and reserve the estimate.
        #[arg(long)]
        probe: bool,
        /// Steps of the probe run.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
        probe_steps: u64,
        /// Time limit of the probe run.
        #[arg(long, value_parser = args::duration, default_value = "60s")]
        probe_timeout: Duration,
        #[command(flatten)]
        reservation: ReserveArgs,
        #[command(flatten)]
        detach: jobs::DetachArgs,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true, value_name = "CMD")]
        command: Vec<OsString>,
    },
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
    Locks {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Your detached jobs (`--detach` on reserve, run, launch): id, state (waiting,
    /// running, finished or failed with its status, lost when the machine rebooted),
    /// how long, the command and its log.
    Jobs {
        /// Everyone's jobs, not only yours.
        #[arg(long)]
        all: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// A detached job's log (its id, a unique prefix of it, or `last`).
    Logs {
        /// The job.
        job: String,
        /// Follow the log while the job runs; end when it ends.
        #[arg(short, long)]
        follow: bool,
    },
    /// Stop a detached job: SIGTERM to it (a torchtools trainer then checkpoints and
    /// exits 75), SIGKILL to all of it after --grace.
    Stop {
        /// The job.
        job: String,
        /// How long it has to end after SIGTERM.
        #[arg(long, value_parser = args::duration, default_value = "10s")]
        grace: Duration,
    },
    /// (Internal) the keeper of a detached job.
    #[command(hide = true)]
    JobRun {
        id: String,
        #[arg(last = true)]
        command: Vec<OsString>,
    },
    /// Who used the GPUs, and how much: GPU-hours and reserved GiB-hours per user (or
    /// per GPU) from the lock directory's usage log, which every reservation writes
    /// (`reserve`, `run`, `launch --gpu`, the API). A holder that died holding its GPU
    /// is counted until the GPU's next holder took it (or until now), marked lost.
    Usage {
        /// Only reservations that ended in this last while (or still run): 7d, 24h, 30m.
        #[arg(long, value_parser = args::duration)]
        since: Option<Duration>,
        /// Group by user (default) or by GPU.
        #[arg(long, value_enum, default_value_t = usage::By::User)]
        by: usage::By,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show the requests waiting for GPUs, in the order they will be served (first
    /// come, first served): user, pid, how long, GPUs asked, bytes, command.
    Queue {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// A live view of the GPUs, refreshed every second: memory used, free and fenced,
    /// use, the lock's holder and the requests waiting, and the processes on each GPU
    /// (marked when they run outside the holder's reservation).
    ///
    /// Keys: q quits, the arrow keys select a GPU, c toggles a compact view for narrow
    /// terminals. Without NVML it shows the locks and the queue and says why the GPU
    /// columns are empty.
    Top {
        /// Print one frame as text and exit (for scripts; width from COLUMNS).
        #[arg(long, conflicts_with = "json")]
        once: bool,
        /// Print one snapshot as JSON and exit.
        #[arg(long)]
        json: bool,
        /// Start in the compact view.
        #[arg(long)]
        compact: bool,
    },
}

/// How `reserve` and `run` reserve: everything but the bytes and the command.
#[derive(clap::Args)]
struct ReserveArgs {
    /// The GPU(s): an index as nvidia-smi shows it, a UUID (GPU-..., a prefix is
    /// enough), or auto (the free GPU(s) with the most free memory). Repeat or
    /// separate with commas for several.
    #[arg(long, value_delimiter = ',', default_value = "auto", value_parser = gpu_spec)]
    gpu: Vec<GpuSpec>,
    /// How many GPUs --gpu auto takes.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    count: Option<u32>,
    /// Extra memory left free on top of the bytes.
    #[arg(long, value_parser = args::size, default_value = reserve::DEFAULT_MARGIN)]
    margin: Bytes,
    /// Take the lock alone, without a memory fence (works without a GPU).
    #[arg(long)]
    no_fence: bool,
    /// Share one GPU with other jobs by memory budget instead of taking it alone:
    /// --bytes is this job's budget, granted (in the same queue) when it fits beside the
    /// other sharers' budgets within the GPU's memory; a job that asks for the GPU
    /// alone waits for every sharer to leave. The memory no sharer budgeted is fenced
    /// (--no-fence: not); PyTorch's allocator in the command is capped at the budget
    /// (PYTORCH_CUDA_ALLOC_CONF).
    #[arg(long)]
    share: bool,
    /// With --share: leave PYTORCH_CUDA_ALLOC_CONF alone (for a PyTorch too old to know
    /// its per_process_memory_fraction option, which it refuses); the command reads its
    /// share from TORCHTOOLS_SHARE_FRACTION instead.
    #[arg(long, requires = "share")]
    no_cap: bool,
    /// Give up (exit 75) when the GPUs are still locked after this long: 30s, 10m,
    /// 1h. Default: wait as long as it takes.
    #[arg(long, value_parser = args::duration)]
    timeout: Option<Duration>,
}

impl ReserveArgs {
    fn request(self, bytes: Option<Bytes>, command: Vec<OsString>) -> reserve::Request {
        reserve::Request {
            gpus: self.gpu,
            count: self.count.map(|c| c as usize),
            bytes,
            margin: self.margin,
            fence: !self.no_fence,
            share: self.share,
            cap: !self.no_cap,
            timeout: self.timeout,
            command,
        }
    }
}

#[derive(Subcommand)]
enum TrackCommand {
    /// Compare tracking sessions from their JSON reports (`--format json`).
    Compare {
        /// Two or more reports.
        #[arg(required = true, num_args = 2..)]
        files: Vec<std::path::PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// gpu_tracker's sub-tracking commands, with its options and outputs, on both tools'
    /// files: per code block statistics, sub-tracking files combined, sessions compared.
    #[command(name = "sub-track", subcommand)]
    SubTrack(SubTrackCommand),
}

/// `--format` of the sub-tracking commands (pickle is refused with the fix).
const SUB_TRACK_FORMATS: [&str; 3] = ["text", "json", "pickle"];

#[derive(Subcommand)]
enum SubTrackCommand {
    /// Statistics of every measure over all samples and over each code block's calls,
    /// and each block's call times (gpu_tracker's `sub-track analyze`).
    ///
    /// The tracking file: `torchtools track --timeline` or gpu_tracker's tracking_file
    /// (.csv, .sqlite; ours also .jsonl). The sub-tracking file: written by
    /// gpu_tracker's SubTracker in a tracked Python program, or beside our timeline
    /// (NAME.blocks.csv / NAME.blocks.sqlite; a .jsonl timeline holds its blocks).
    Analyze {
        /// The tracking file.
        #[arg(long = "tf", value_name = "TRACKING_FILE")]
        tracking_file: std::path::PathBuf,
        /// The sub-tracking file.
        #[arg(long = "stf", value_name = "SUB_TRACKING_FILE")]
        sub_tracking_file: std::path::PathBuf,
        /// Write the results here instead of stdout.
        #[arg(short, long)]
        output: Option<std::path::PathBuf>,
        /// text (gpu_tracker's layout) or json (read by `sub-track compare`).
        #[arg(short, long, default_value = "text", value_parser = SUB_TRACK_FORMATS)]
        format: String,
    },
    /// Merge the sub-tracking files of several processes into one (gpu_tracker's
    /// `sub-track combine`); never replaces an existing file.
    Combine {
        /// The combined file to create (.csv or .sqlite).
        #[arg(long = "stf", value_name = "SUB_TRACKING_FILE")]
        output: std::path::PathBuf,
        /// The files to combine (CSV, SQLite or JSON Lines, mixed if need be), or one
        /// directory: its files with the output's extension, in name order.
        #[arg(short = 'p', required = true, num_args = 1.., action = clap::ArgAction::Append, value_name = "FILE")]
        files: Vec<std::path::PathBuf>,
    },
    /// Compare sessions' analyses measure by measure and block by block (gpu_tracker's
    /// `sub-track compare`), from the JSON of `sub-track analyze --format json`
    /// written by torchtools or gpu-tracker (pickles are not read: loading one can run
    /// any code).
    Compare {
        /// A session: its name and its analysis (repeat, or list several after -m).
        #[arg(short = 'm', num_args = 1.., action = clap::ArgAction::Append, value_name = "NAME=FILE")]
        sessions: Vec<String>,
        /// gpu_tracker's JSON config: {"file_path_map": {NAME: FILE}, "statistic": S};
        /// -m adds sessions to it, --stat overrides its statistic.
        #[arg(long, value_name = "FILE")]
        cconfig: Option<std::path::PathBuf>,
        /// The statistic compared: min, max, mean (default) or std.
        #[arg(long, value_parser = ["min", "max", "mean", "std"])]
        stat: Option<String>,
        /// Write the comparison here instead of stdout.
        #[arg(short, long)]
        output: Option<std::path::PathBuf>,
        /// text (gpu_tracker's layout) or json.
        #[arg(short, long, default_value = "text", value_parser = SUB_TRACK_FORMATS)]
        format: String,
    },
}

fn gpu_spec(text: &str) -> Result<GpuSpec, String> {
    text.parse().map_err(|e: tt_lock::Error| e.to_string())
}

/// The log filter: `TORCHTOOLS_LOG` (`RUST_LOG` syntax), else warnings and errors.
fn log_filter() -> Result<tracing_subscriber::EnvFilter, String> {
    match std::env::var("TORCHTOOLS_LOG") {
        Err(_) => Ok(tracing_subscriber::EnvFilter::new("warn")),
        Ok(value) => tracing_subscriber::EnvFilter::builder()
            .parse(&value)
            .map_err(|e| {
                format!(
                    "TORCHTOOLS_LOG={value:?} is not a log filter ({e}): give a level (error, \
                     warn, info, debug, trace) or RUST_LOG's directives (tt_lock=debug,warn), \
                     or unset it"
                )
            }),
    }
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
        Err(e) => {
            eprintln!("torchtools: error: {e:#}");
            match e.downcast_ref::<child::Exit>() {
                Some(child::Exit(code, _)) => ExitCode::from(*code),
                None => ExitCode::FAILURE,
            }
        }
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
    if matches!(
        cli.command,
        Command::Devices { .. }
            | Command::Locks { .. }
            | Command::Queue { .. }
            | Command::Usage { .. }
    ) || matches!(cli.command, Command::Top { once, json, .. } if once || json)
    {
        quiet_on_closed_pipe();
    }
    match cli.command {
        Command::Devices { json } => {
            let report = tt_device::DeviceReport::nvml_view();
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!("{report}");
            }
            if let Some(error) = &report.error {
                eprintln!("torchtools: error: {error}");
                return Ok(ExitCode::from(EXIT_BAD_ENV));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Reserve {
            bytes,
            reservation,
            detach,
            command,
        } => {
            if detach.detach {
                return jobs::detach(
                    &detach,
                    &std::env::args_os().collect::<Vec<_>>(),
                    command.len(),
                );
            }
            reserve::reserve(reservation.request(bytes, command))
        }
        Command::Jobs { all, json } => jobs::jobs(json, all),
        Command::Logs { job, follow } => jobs::logs(&job, follow),
        Command::Stop { job, grace } => jobs::stop(&job, grace),
        Command::JobRun { id, command } => jobs::keep(&id, &command),
        Command::Locks { json } => reserve::locks(json),
        Command::Queue { json } => reserve::queue(json),
        Command::Usage { since, by, json } => usage::usage(since, by, json),
        Command::Top {
            once,
            json,
            compact,
        } => top::top(once, json, compact),
        Command::Launch(args) => {
            if let Some(detach) = args.detached() {
                let argv: Vec<OsString> = std::env::args_os().collect();
                return jobs::detach(&detach, &argv, args.command_len());
            }
            launch::launch(*args)
        }
        Command::Probe {
            gpu,
            timeout,
            steps,
            json,
            max_batch,
            command,
        } => {
            if max_batch.max_batch {
                probe::max_batch(gpu, timeout, steps, json, &max_batch, command)
            } else {
                probe::probe(gpu, timeout, steps, json, command)
            }
        }
        Command::Run {
            bytes,
            probe: _,
            probe_steps,
            probe_timeout,
            reservation,
            detach,
            command,
        } => {
            if detach.detach {
                return jobs::detach(
                    &detach,
                    &std::env::args_os().collect::<Vec<_>>(),
                    command.len(),
                );
            }
            let bytes = match bytes {
                Some(b) => b,
                None => {
                    probe::estimate_for_run(&reservation.gpu, probe_timeout, probe_steps, &command)?
                }
            };
            reserve::reserve(reservation.request(Some(bytes), command))
        }
        Command::Track {
            compare: Some(sub), ..
        } => match *sub {
            TrackCommand::Compare { files, json } => track::compare(&files, json),
            TrackCommand::SubTrack(SubTrackCommand::Analyze {
                tracking_file,
                sub_tracking_file,
                output,
                format,
            }) => subtrack::analyze(
                &tracking_file,
                &sub_tracking_file,
                output.as_deref(),
                &format,
            ),
            TrackCommand::SubTrack(SubTrackCommand::Combine { output, files }) => {
                subtrack::combine(&output, &files)
            }
            TrackCommand::SubTrack(SubTrackCommand::Compare {
                sessions,
                cconfig,
                stat,
                output,
                format,
            }) => subtrack::compare(
                &sessions,
                cconfig.as_deref(),
                stat.as_deref(),
                output.as_deref(),
                &format,
            ),
        },
        Command::Track {
            compare: None,
            interval,
            ram_unit,
            gpu_ram_unit,
            time_unit,
            format,
            output,
            timeline,
            overwrite,
            plot,
            n_expected_cores,
            gpu_uuids,
            gpu_brand,
            disable_logs,
            no_ptrace,
            tconfig,
            execute,
            command,
        } => {
            let given = track::Given {
                interval,
                ram_unit,
                gpu_ram_unit,
                time_unit,
                n_expected_cores,
                gpu_uuids,
                gpu_brand,
                disable_logs,
                timeline,
                overwrite,
            };
            let mut request = track::request(
                given,
                tconfig.as_deref(),
                format.as_deref() == Some("json"),
                output,
                plot,
                execute,
                command,
            )?;
            request.no_ptrace = no_ptrace;
            track::track(request)
        }
    }
}

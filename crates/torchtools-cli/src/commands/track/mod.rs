//! `torchtools track -- CMD` and `torchtools track compare A.json B.json`
//! (`track sub-track ...` is in `sub.rs`).

use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use anyhow::Result;
use tt_tracker::{RamUnit, Target, TimeUnit, Tracker, TrackerConfig};

use crate::child;
use crate::exit::Exit;

mod sub;

/// Track a command's memory, CPU, GPU and energy use.
///
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
#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub(crate) struct Args {
    #[command(subcommand)]
    pub(crate) compare: Option<Box<crate::commands::track::TrackCommand>>,
    /// Time between samples (gpu_tracker's --st, in seconds): 100ms by default,
    /// at least 10ms. gpu_tracker samples every second; our peaks are exact
    /// whatever the interval (the kernel's high-water marks), the interval only
    /// sets how fine the timeline is.
    #[arg(long, visible_alias = "st", value_parser = crate::args::duration, allow_hyphen_values = true)]
    pub(crate) interval: Option<std::time::Duration>,
    /// Unit of RAM: bytes, kilobytes, megabytes, gigabytes (default), terabytes
    /// (decimal).
    #[arg(long, visible_alias = "ru")]
    pub(crate) ram_unit: Option<tt_tracker::RamUnit>,
    /// Unit of GPU RAM (default gigabytes).
    #[arg(long, visible_alias = "gru")]
    pub(crate) gpu_ram_unit: Option<tt_tracker::RamUnit>,
    /// Unit of time: seconds, minutes, hours (default), days.
    #[arg(long, visible_alias = "tu")]
    pub(crate) time_unit: Option<tt_tracker::TimeUnit>,
    /// Report format: text (default) or json.
    #[arg(short, long, value_parser = ["text", "json"])]
    pub(crate) format: Option<String>,
    /// Write the report to this file instead of stdout (replaced if it exists).
    #[arg(short, long)]
    pub(crate) output: Option<std::path::PathBuf>,
    /// Write every sample to this file: .csv, .jsonl or .sqlite (gpu_tracker's --tf).
    #[arg(long, visible_alias = "tf")]
    pub(crate) timeline: Option<std::path::PathBuf>,
    /// Replace an existing --timeline file.
    #[arg(long)]
    pub(crate) overwrite: bool,
    /// Draw RAM, GPU RAM and CPU over time into this SVG file.
    #[arg(long)]
    pub(crate) plot: Option<std::path::PathBuf>,
    /// Cores the command is expected to use (denominator of hardware percentages):
    /// by default every core, inside a Slurm job the job's (SLURM_CPUS_PER_TASK, else
    /// SLURM_CPUS_ON_NODE).
    #[arg(long, visible_alias = "nec", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) n_expected_cores: Option<u32>,
    /// GPUs (UUIDs, comma-separated) whose utilisation and energy count: by default
    /// every GPU, inside a Slurm job the job's (SLURM_STEP_GPUS, else SLURM_JOB_GPUS).
    #[arg(long, visible_alias = "guuids", value_delimiter = ',')]
    pub(crate) gpu_uuids: Option<Vec<String>>,
    /// gpu_tracker's GPU brand: nvidia (the one torchtools reads, through NVML).
    #[arg(long = "gb", value_name = "BRAND", value_parser = ["nvidia", "amd"])]
    pub(crate) gpu_brand: Option<String>,
    /// Do not print the tracker's warnings (they stay in the report).
    #[arg(long)]
    pub(crate) disable_logs: bool,
    /// Do not watch the command's exit with ptrace. By default its own peak RSS is
    /// read as it exits (exact, without the children it reaped); meanwhile a
    /// debugger or py-spy cannot attach to it. With this, its peak is the sampled
    /// high-water mark.
    #[arg(long)]
    pub(crate) no_ptrace: bool,
    /// gpu_tracker's JSON file of Tracker arguments (sleep_time, ram_unit,
    /// gpu_ram_unit, time_unit, n_expected_cores, gpu_uuids, disable_logs,
    /// gpu_brand, tracking_file, overwrite); options on the command line win.
    #[arg(long, value_name = "FILE")]
    pub(crate) tconfig: Option<std::path::PathBuf>,
    /// gpu_tracker's -e: the command and its arguments in one string, split on
    /// whitespace as gpu_tracker splits it (no quoting). Prefer `-- CMD ARGS`,
    /// which passes arguments as they are.
    #[arg(short = 'e', long, value_name = "COMMAND", conflicts_with = "command")]
    pub(crate) execute: Option<String>,
    /// The command and its arguments, after `--`, passed as they are.
    #[arg(last = true, required_unless_present = "execute", value_name = "CMD")]
    pub(crate) command: Vec<std::ffi::OsString>,
}

#[derive(clap::Subcommand)]
pub(crate) enum TrackCommand {
    /// Compare tracking sessions' JSON reports.
    ///
    /// Compare tracking sessions from their JSON reports (`--format json`).
    Compare {
        /// Two or more reports.
        #[arg(required = true, num_args = 2..)]
        files: Vec<std::path::PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// gpu_tracker's sub-tracking commands.
    ///
    /// gpu_tracker's sub-tracking commands, with its options and outputs, on both tools'
    /// files: per code block statistics, sub-tracking files combined, sessions compared.
    #[command(name = "sub-track", subcommand)]
    SubTrack(sub::SubTrackCommand),
}

/// `torchtools track`, `track compare` and `track sub-track ...`.
pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    match args.compare.as_deref() {
        Some(TrackCommand::Compare { files, json }) => compare(files, *json),
        Some(TrackCommand::SubTrack(command)) => sub::run(command),
        None => {
            let given = Given {
                interval: args.interval,
                ram_unit: args.ram_unit,
                gpu_ram_unit: args.gpu_ram_unit,
                time_unit: args.time_unit,
                n_expected_cores: args.n_expected_cores,
                gpu_uuids: args.gpu_uuids.clone(),
                gpu_brand: args.gpu_brand.clone(),
                disable_logs: args.disable_logs,
                timeline: args.timeline.clone(),
                overwrite: args.overwrite,
            };
            let mut req = request(
                given,
                args.tconfig.as_deref(),
                args.format.as_deref() == Some("json"),
                args.output.clone(),
                args.plot.clone(),
                args.execute.clone(),
                args.command.clone(),
            )?;
            req.no_ptrace = args.no_ptrace;
            track(req)
        }
    }
}

/// The tracker options as typed (absent when not given): the command line wins
/// over `--tconfig`, which wins over the defaults.
pub(crate) struct Given {
    pub(crate) interval: Option<Duration>,
    pub(crate) ram_unit: Option<RamUnit>,
    pub(crate) gpu_ram_unit: Option<RamUnit>,
    pub(crate) time_unit: Option<TimeUnit>,
    pub(crate) n_expected_cores: Option<u32>,
    pub(crate) gpu_uuids: Option<Vec<String>>,
    pub(crate) gpu_brand: Option<String>,
    pub(crate) disable_logs: bool,
    pub(crate) timeline: Option<PathBuf>,
    pub(crate) overwrite: bool,
}

fn bad(message: String) -> anyhow::Error {
    Exit::usage(message).into()
}

/// gpu_tracker's `--tconfig`: a JSON object of `Tracker` arguments, read into the
/// options the command line left unset.
fn apply_tconfig(given: &mut Given, path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad(format!("--tconfig {}: {e}", path.display())))?;
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).map_err(|e| {
            bad(format!(
                "--tconfig {}: not a JSON object: {e}",
                path.display()
            ))
        })?;
    let wrong = |key: &str, want: &str| {
        bad(format!(
            "--tconfig {}: {key:?} must be {want}",
            path.display()
        ))
    };
    for (key, value) in map {
        let text = value.as_str();
        match key.as_str() {
            "sleep_time" => {
                let secs = value
                    .as_f64()
                    .ok_or_else(|| wrong(&key, "a number of seconds"))?;
                let d = Duration::try_from_secs_f64(secs)
                    .map_err(|_| wrong(&key, "a positive number of seconds"))?;
                given.interval.get_or_insert(d);
            }
            "ram_unit" | "gpu_ram_unit" => {
                let unit: RamUnit = text.and_then(|t| t.parse().ok()).ok_or_else(|| {
                    wrong(&key, "bytes, kilobytes, megabytes, gigabytes or terabytes")
                })?;
                let slot = if key == "ram_unit" {
                    &mut given.ram_unit
                } else {
                    &mut given.gpu_ram_unit
                };
                slot.get_or_insert(unit);
            }
            "time_unit" => {
                let unit: TimeUnit = text
                    .and_then(|t| t.parse().ok())
                    .ok_or_else(|| wrong(&key, "seconds, minutes, hours or days"))?;
                given.time_unit.get_or_insert(unit);
            }
            "n_expected_cores" => {
                let n = value
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .filter(|n| *n > 0)
                    .ok_or_else(|| wrong(&key, "a positive integer"))?;
                given.n_expected_cores.get_or_insert(n);
            }
            "gpu_uuids" => {
                let uuids: Vec<String> = value
                    .as_array()
                    .and_then(|a| a.iter().map(|v| v.as_str().map(str::to_owned)).collect())
                    .ok_or_else(|| wrong(&key, "a list of GPU UUIDs"))?;
                given.gpu_uuids.get_or_insert(uuids);
            }
            "gpu_brand" => {
                let brand = text.ok_or_else(|| wrong(&key, "\"nvidia\" or \"amd\""))?;
                given.gpu_brand.get_or_insert(brand.to_owned());
            }
            "tracking_file" => {
                let file = text.ok_or_else(|| wrong(&key, "a file path"))?;
                given.timeline.get_or_insert(PathBuf::from(file));
            }
            "disable_logs" | "overwrite" => {
                let on = value
                    .as_bool()
                    .ok_or_else(|| wrong(&key, "true or false"))?;
                let slot = if key == "overwrite" {
                    &mut given.overwrite
                } else {
                    &mut given.disable_logs
                };
                *slot |= on;
            }
            other => {
                return Err(bad(format!(
                    "--tconfig {}: unknown key {other:?}; known: sleep_time, ram_unit, \
                     gpu_ram_unit, time_unit, n_expected_cores, gpu_uuids, disable_logs, \
                     gpu_brand, tracking_file, overwrite",
                    path.display()
                )))
            }
        }
    }
    Ok(())
}

/// Everything `track` needs, every value checked: nothing runs before this is `Ok`.
pub(crate) fn request(
    mut given: Given,
    tconfig: Option<&Path>,
    json: bool,
    output: Option<PathBuf>,
    plot: Option<PathBuf>,
    execute: Option<String>,
    command: Vec<OsString>,
) -> Result<Request> {
    if let Some(path) = tconfig {
        apply_tconfig(&mut given, path)?;
    }
    let interval = given
        .interval
        .unwrap_or(tt_tracker::TrackerConfig::default().interval);
    if interval < tt_tracker::MIN_INTERVAL {
        return Err(bad(format!(
            "--interval {interval:?} is below the 10ms minimum: use e.g. --interval 100ms \
             (or --st 0.1)"
        )));
    }
    if given.gpu_brand.as_deref() == Some("amd") {
        return Err(bad(
            "--gb amd: torchtools reads NVIDIA GPUs only (through NVML); leave --gb out, or \
             use --gb nvidia"
                .into(),
        ));
    }
    if let Some(path) = &given.timeline {
        tt_tracker::check_timeline_path(path, given.overwrite).map_err(|e| match e {
            tt_tracker::Error::TimelineExists { path } => bad(format!(
                "--timeline {} already exists: add --overwrite to replace it, or choose \
                 another path",
                path.display()
            )),
            other => bad(format!("--timeline: {other}")),
        })?;
    }
    if let Some(path) = &output {
        crate::args::check_output("--output", path)?;
    }
    if let Some(path) = &plot {
        crate::args::check_output("--plot", path)?;
    }
    let command = match execute {
        Some(line) => {
            let words: Vec<OsString> = line.split_whitespace().map(OsString::from).collect();
            if words.is_empty() {
                return Err(bad("-e/--execute is empty: give the command to run".into()));
            }
            eprintln!(
                "torchtools track: -e splits the command on whitespace as gpu_tracker does \
                 (no quoting); `torchtools track -- CMD ARGS` passes arguments as they are"
            );
            words
        }
        None => command,
    };
    Ok(Request {
        interval,
        ram_unit: given.ram_unit.unwrap_or_default(),
        gpu_ram_unit: given.gpu_ram_unit.unwrap_or_default(),
        time_unit: given.time_unit.unwrap_or_default(),
        json,
        output,
        timeline: given.timeline,
        overwrite: given.overwrite,
        plot,
        n_expected_cores: given.n_expected_cores.map(|n| n as usize),
        gpu_uuids: given.gpu_uuids,
        disable_logs: given.disable_logs,
        no_ptrace: false,
        command,
    })
}

/// What `track` was asked for.
pub(crate) struct Request {
    pub(crate) interval: Duration,
    pub(crate) ram_unit: RamUnit,
    pub(crate) gpu_ram_unit: RamUnit,
    pub(crate) time_unit: TimeUnit,
    pub(crate) json: bool,
    pub(crate) output: Option<PathBuf>,
    pub(crate) timeline: Option<PathBuf>,
    pub(crate) overwrite: bool,
    pub(crate) plot: Option<PathBuf>,
    pub(crate) n_expected_cores: Option<usize>,
    pub(crate) gpu_uuids: Option<Vec<String>>,
    pub(crate) disable_logs: bool,
    /// Do not watch the command's exit with ptrace (`--no-ptrace`).
    pub(crate) no_ptrace: bool,
    pub(crate) command: Vec<OsString>,
}

/// A memory cgroup made for the command, where this machine lets us: its peak counts
/// the whole tree, exited processes included. Removed on drop.
struct Cgroup {
    dir: PathBuf,
    procs: File,
}

impl Cgroup {
    /// Under this process's own memory cgroup: v1 (`N:memory:/path`) or v2 (`0::/path`
    /// with the memory controller enabled for children).
    fn create() -> Option<Cgroup> {
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let name = format!("torchtools-track-{}", std::process::id());
        let mut candidates = Vec::new();
        for line in own.lines() {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            let rel = path.trim_start_matches('/');
            if controllers.split(',').any(|c| c == "memory") {
                candidates.push((
                    Path::new("/sys/fs/cgroup/memory").join(rel),
                    "memory.max_usage_in_bytes",
                ));
            } else if controllers.is_empty() {
                candidates.push((Path::new("/sys/fs/cgroup").join(rel), "memory.peak"));
            }
        }
        for (parent, peak_file) in candidates {
            let dir = parent.join(&name);
            if std::fs::create_dir(&dir).is_err() {
                continue;
            }
            let usable = dir.join(peak_file).exists();
            match (
                usable,
                File::options().write(true).open(dir.join("cgroup.procs")),
            ) {
                (true, Ok(procs)) => return Some(Cgroup { dir, procs }),
                _ => {
                    let _ = std::fs::remove_dir(&dir);
                }
            }
        }
        None
    }

    /// Moves the child into the cgroup between fork and exec.
    fn enter_on_exec(&self, cmd: &mut Command) {
        let fd = self.procs.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and only calls
        // write(2), which is async-signal-safe; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                // "0" is the writing process itself.
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Fails while a descendant still lives in it: the kernel then keeps it until
        // its owner (us, next time, or the machine's cleaner) removes it.
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            tracing::debug!("cannot remove {}: {e}", self.dir.display());
        }
    }
}

pub(crate) fn track(req: Request) -> Result<ExitCode> {
    let name = req.command[0].to_string_lossy().into_owned();
    let mut cmd = Command::new(&req.command[0]);
    cmd.args(&req.command[1..]);
    let cgroup = Cgroup::create();
    if let Some(cg) = &cgroup {
        cg.enter_on_exec(&mut cmd);
    }
    let mut running = child::spawn(&mut cmd, &name)?;
    // Its own peak, read as it exits (wait4's ru_maxrss would include its children).
    if !req.no_ptrace && !running.watch_exit() {
        tracing::debug!("ptrace is not allowed here: the command's peak is the sampled one");
    }
    let tracker = Tracker::start(TrackerConfig {
        interval: req.interval,
        ram_unit: req.ram_unit,
        gpu_ram_unit: req.gpu_ram_unit,
        time_unit: req.time_unit,
        n_expected_cores: req.n_expected_cores,
        gpu_uuids: req.gpu_uuids.clone(),
        target: Target::Pid(running.pid()),
        timeline: req.timeline.clone(),
        overwrite: req.overwrite,
        keep_series: req.plot.is_some(),
        cgroup: cgroup.as_ref().map(|c| c.dir.clone()),
    });
    // Whatever happens to the tracker, the command runs to its end and is reaped, and
    // its exit status is ours: a tracking or writing failure is said, never swapped in.
    let ended = running.wait()?;
    let status = ExitCode::from(ended.code);
    let tracker = match tracker {
        Ok(t) => t,
        Err(e) => {
            eprintln!("torchtools track: the tracker did not start, nothing was tracked: {e}");
            return Ok(status);
        }
    };
    tracker.target_exited_with_peak(ended.own_peak, ended.max_rss, i32::from(ended.code));
    let (usage, series) = match tracker.stop_with_series() {
        Ok(done) => done,
        Err(e) => {
            eprintln!("torchtools track: tracking failed: {e}");
            return Ok(status);
        }
    };
    drop(cgroup);
    if !req.disable_logs {
        for w in &usage.torchtools.warnings {
            eprintln!("torchtools track: warning: {w}");
        }
    }
    // As gpu_tracker: the status line on stdout, the report after it or in --output.
    // With JSON the line goes to stderr, so that stdout parses as JSON.
    let done = format!(
        "Resource tracking complete. Process completed with status code: {}",
        ended.code
    );
    let text = if req.json {
        eprintln!("{done}");
        serde_json::to_string_pretty(&usage)? + "\n"
    } else {
        println!("{done}");
        format!("{usage}")
    };
    let written = match &req.output {
        Some(path) => File::create(path)
            .and_then(|mut f| f.write_all(text.as_bytes()).and_then(|()| f.sync_all()))
            .map_err(|e| (path, e)),
        None => {
            print!("{text}");
            Ok(())
        }
    };
    if let Err((path, e)) = written {
        eprintln!(
            "torchtools track: could not write the report to {} ({e}); here it is:",
            path.display()
        );
        print!("{text}");
    }
    if let Some(path) = &req.plot {
        if let Err(e) = tt_tracker::plot(path, &series) {
            eprintln!(
                "torchtools track: could not draw the plot {}: {e}",
                path.display()
            );
        }
    }
    Ok(status)
}

pub(crate) fn compare(files: &[PathBuf], json: bool) -> Result<ExitCode> {
    if files.len() < 2 {
        return Err(Exit::usage("give at least two JSON reports to compare".into()).into());
    }
    // A missing or unreadable report is bad input (exit 2), as for `sub-track compare`.
    let sessions = files
        .iter()
        .map(|f| tt_tracker::compare::load(f))
        .collect::<tt_tracker::Result<Vec<_>>>()
        .map_err(|e| Exit::usage(e.to_string()))?;
    let comparison = tt_tracker::compare::Comparison::new(sessions);
    if json {
        println!("{}", serde_json::to_string_pretty(&comparison)?);
    } else {
        print!("{comparison}");
    }
    Ok(ExitCode::SUCCESS)
}

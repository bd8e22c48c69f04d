//! `torchtools track -- CMD` and `torchtools track compare A.json B.json`.

use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use anyhow::{Context, Result};
use tt_tracker::{RamUnit, Target, TimeUnit, Tracker, TrackerConfig};

use crate::child::{self, Exit};

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
    let running = child::spawn(&mut cmd, &name)?;
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
    // Whatever happens to the tracker, the command runs to its end and is reaped.
    let ended = running.wait()?;
    let tracker = tracker.context("starting the tracker")?;
    tracker.target_exited(ended.max_rss, i32::from(ended.code));
    let (usage, series) = tracker.stop_with_series().context("tracking")?;
    drop(cgroup);
    let text = if req.json {
        serde_json::to_string_pretty(&usage)? + "\n"
    } else {
        format!(
            "Resource tracking complete. Process completed with status code: {}\n{usage}",
            ended.code
        )
    };
    match &req.output {
        Some(path) => File::create(path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .with_context(|| format!("writing the report to {}", path.display()))?,
        None => eprint!("{text}"),
    }
    if let Some(path) = &req.plot {
        tt_tracker::plot(path, &series)?;
    }
    Ok(ExitCode::from(ended.code))
}

pub(crate) fn compare(files: &[PathBuf], json: bool) -> Result<ExitCode> {
    if files.len() < 2 {
        return Err(Exit(2, "give at least two JSON reports to compare".into()).into());
    }
    let sessions = files
        .iter()
        .map(|f| tt_tracker::compare::load(f))
        .collect::<tt_tracker::Result<Vec<_>>>()?;
    let comparison = tt_tracker::compare::Comparison::new(sessions);
    if json {
        println!("{}", serde_json::to_string_pretty(&comparison)?);
    } else {
        print!("{comparison}");
    }
    Ok(ExitCode::SUCCESS)
}

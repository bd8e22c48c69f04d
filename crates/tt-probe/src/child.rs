//! Running a probe child: its own process group, stderr's tail kept, an optional report
//! pipe, NVML/RSS tracking of its tree, and a deadline after which the whole group is
//! killed. Always reaped: never a hang, never a zombie.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tt_tracker::{process, RamUnit, ResourceUsage, Target, Tracker, TrackerConfig};

use crate::{ProbeError, Result};

/// The variable naming the report pipe's descriptor in a Rust probe child.
pub(crate) const REPORT_FD_ENV: &str = "TORCHTOOLS_PROBE_FD";

/// Bytes of stderr kept.
const TAIL: usize = 8 * 1024;

pub(crate) struct Ended {
    /// Exit code, or `None` when killed by a signal.
    pub(crate) code: Option<i32>,
    pub(crate) signal: Option<i32>,
    pub(crate) timed_out: bool,
    pub(crate) stderr_tail: String,
    /// What a Rust probe sent through the report pipe.
    #[cfg_attr(not(feature = "tch"), allow(dead_code))]
    pub(crate) report: Vec<u8>,
    pub(crate) elapsed: Duration,
    pub(crate) usage: Option<ResourceUsage>,
}

pub(crate) struct Options {
    pub(crate) timeout: Duration,
    pub(crate) report_pipe: bool,
    pub(crate) echo_stderr: bool,
    pub(crate) quiet_stdout: bool,
}

fn tail_of(bytes: &[u8]) -> String {
    let start = bytes.len().saturating_sub(TAIL);
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

/// A pipe for the probe's report: its read end, and its write end, which `cmd`'s
/// child inherits (its number in [`REPORT_FD_ENV`]).
fn report_pipe(cmd: &mut Command) -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fresh descriptors that nothing else owns.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let w_fd = w.as_raw_fd();
    cmd.env(REPORT_FD_ENV, w_fd.to_string());
    // SAFETY: runs in the forked child before exec; fcntl is async-signal-safe and
    // the closure allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(w_fd, libc::F_SETFD, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok((r, w))
}

/// Threads reading the probe's stderr (its tail kept, echoed if asked: sent as `0`)
/// and its report pipe (sent as `1`); how many will send.
fn read_outputs(
    stderr: Option<std::process::ChildStderr>,
    report: Option<OwnedFd>,
    echo: bool,
) -> (mpsc::Receiver<(u8, Vec<u8>)>, usize) {
    let (tx, rx) = mpsc::channel::<(u8, Vec<u8>)>();
    let mut readers = 1;
    if let Some(mut err) = stderr {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if echo {
                    use std::io::Write;
                    let _ = std::io::stderr().write_all(&buf[..n]);
                }
                kept.extend_from_slice(&buf[..n]);
                if kept.len() > 2 * TAIL {
                    kept.drain(..kept.len() - TAIL);
                }
            }
            let _ = tx.send((0, kept));
        });
    }
    if let Some(r) = report {
        readers += 1;
        std::thread::spawn(move || {
            let mut file = std::fs::File::from(r);
            let mut report = Vec::new();
            let _ = file.read_to_end(&mut report);
            let _ = tx.send((1, report));
        });
    }
    (rx, readers)
}

/// The probe's stderr and report from [`read_outputs`]; leftovers of the probe that
/// keep them open are killed (its process group `pid`) after a grace second.
fn collect(
    rx: &mpsc::Receiver<(u8, Vec<u8>)>,
    mut readers: usize,
    pid: u32,
    mut killed_group: bool,
) -> (Vec<u8>, Vec<u8>) {
    let mut stderr = Vec::new();
    let mut report = Vec::new();
    while readers > 0 {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok((0, bytes)) => {
                stderr = bytes;
                readers -= 1;
            }
            Ok((_, bytes)) => {
                report = bytes;
                readers -= 1;
            }
            Err(mpsc::RecvTimeoutError::Timeout) if !killed_group => {
                // SAFETY: kill(2) of the probe's process group.
                unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
                killed_group = true;
            }
            Err(_) => break,
        }
    }
    (stderr, report)
}

pub(crate) fn run(mut cmd: Command, what: &str, opts: &Options) -> Result<Ended> {
    let spawn_err = |reason: String| ProbeError::Spawn {
        what: what.to_owned(),
        reason,
    };
    let (pipe_read, mut pipe_write) = match opts.report_pipe {
        true => {
            let (r, w) = report_pipe(&mut cmd).map_err(|e| spawn_err(e.to_string()))?;
            // The write end is open until the spawn; the parent's copy is closed right
            // after it.
            (Some(r), Some(w))
        }
        false => (None, None),
    };
    cmd.stdin(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0);
    if opts.quiet_stdout {
        cmd.stdout(Stdio::null());
    }
    let start = Instant::now();
    let spawned = cmd.spawn();
    // Close the parent's copy of the write end, so that the reader sees EOF when the
    // child (and anything it started) is gone.
    drop(pipe_write.take());
    let mut child = spawned.map_err(|e| spawn_err(e.to_string()))?;
    let pid = child.id();
    let tracker = Tracker::start(TrackerConfig {
        interval: Duration::from_millis(20),
        ram_unit: RamUnit::Bytes,
        gpu_ram_unit: RamUnit::Bytes,
        target: Target::Pid(pid),
        ..TrackerConfig::default()
    })
    .ok();

    let (rx, readers) = read_outputs(child.stderr.take(), pipe_read, opts.echo_stderr);

    // Wait (without reaping) until the child ends or the deadline passes; then reap.
    let wait_err = |e: std::io::Error| ProbeError::Spawn {
        what: what.to_owned(),
        reason: format!("waiting for it: {e}"),
    };
    let exited = process::wait_for_exit(pid, Some(start + opts.timeout)).map_err(wait_err)?;
    let timed_out = !exited;
    if timed_out {
        // SAFETY: kill(2) of our child's process group.
        unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
    }
    let reaped = process::reap(pid).map_err(wait_err)?;
    drop(child);
    let elapsed = start.elapsed();
    let (code, signal) = (reaped.code(), reaped.signal());
    let usage = tracker.and_then(|t| {
        t.target_exited(reaped.max_rss, reaped.exit_code());
        t.stop().ok()
    });

    let (stderr, report) = collect(&rx, readers, pid, timed_out);
    Ok(Ended {
        code,
        signal,
        timed_out,
        stderr_tail: tail_of(&stderr),
        report,
        elapsed,
        usage,
    })
}

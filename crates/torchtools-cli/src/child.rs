//! Running the user's command: spawned with the arguments as given (no shell), signals
//! sent to `torchtools` by other processes forwarded to it (Ctrl-C from the terminal
//! already reaches it), its exit status and peak RSS (`wait4`) collected.

use std::io;
use std::process::{Child, Command};
use std::thread::JoinHandle;

use anyhow::Result;
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::{Handle, SignalsInfo};
use signal_hook::low_level::siginfo::Cause;

use crate::exit::{Exit, CANNOT_RUN, FAILURE, NOT_FOUND};

/// A command that could not be started, with a shell's exit status: 127 when it is not
/// found, 126 when it cannot be executed, 1 otherwise.
pub(crate) fn spawn_failure(name: &str, e: &io::Error) -> Exit {
    let (code, hint) = match e.kind() {
        io::ErrorKind::NotFound if name.ends_with(".py") => (
            NOT_FOUND,
            format!(" (a Python script: run it as `python {name}`)"),
        ),
        io::ErrorKind::NotFound => (NOT_FOUND, " (not found on PATH)".into()),
        io::ErrorKind::PermissionDenied => (CANNOT_RUN, " (not executable)".into()),
        _ => (FAILURE, String::new()),
    };
    Exit::new(code, format!("cannot run {name:?}: {e}{hint}"))
}

/// The command, running.
pub(crate) struct Running {
    child: Child,
    handle: Handle,
    forwarder: JoinHandle<()>,
    /// Watched with ptrace for its own peak at exit ([`Running::watch_exit`]).
    watched: bool,
    /// Its time limit's clock, when it has one ([`Running::limit`]).
    timer: Option<crate::limit::Beside>,
    /// The watch of a preemptible job ([`Running::preemptible`]).
    preempt: Option<crate::limit::Beside>,
}

/// How the command ended.
pub(crate) struct Ended {
    /// The status to exit with: its code, or 128 + the signal that killed it.
    pub(crate) code: u8,
    /// Its peak resident memory (and that of the descendants it reaped), in bytes.
    pub(crate) max_rss: u64,
    /// Its own peak resident memory, read as it exited, when it was watched.
    pub(crate) own_peak: Option<u64>,
    /// Whether its time limit was reached (it got SIGTERM from `--time`).
    pub(crate) timed_out: bool,
    /// Whether the machine's policy preempted it (`--preemptible`).
    pub(crate) preempted: bool,
}

/// Spawns `cmd` (whose program is `name`, for messages). Handlers are installed
/// first, so that no signal between spawn and wait kills `torchtools` alone.
pub(crate) fn spawn(cmd: &mut Command, name: &str) -> Result<Running> {
    let mut signals =
        SignalsInfo::<WithOrigin>::new([SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2])
            .map_err(|e| anyhow::anyhow!("cannot install signal handlers: {e}"))?;
    let child = cmd.spawn().map_err(|e| spawn_failure(name, &e))?;
    let pid = child.id();
    let handle = signals.handle();
    let forwarder = std::thread::spawn(move || {
        for origin in signals.forever() {
            if !matches!(origin.cause, Cause::Kernel) {
                // SAFETY: kill(2) has no memory-safety preconditions; the pid is our
                // child's, not reaped until this thread has stopped (see `wait`).
                unsafe { libc::kill(pid as libc::pid_t, origin.signal) };
            }
        }
    });
    Ok(Running {
        child,
        handle,
        forwarder,
        watched: false,
        timer: None,
        preempt: None,
    })
}

impl Running {
    /// The command's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Watches the command's exit with ptrace, to read its own peak RSS then (call
    /// from the thread that will `wait`); `false` where ptrace is not allowed.
    pub(crate) fn watch_exit(&mut self) -> bool {
        self.watched = tt_tracker::process::watch_exit(self.child.id());
        self.watched
    }

    /// Starts the command's time limit now: SIGUSR1, SIGTERM and SIGKILL reach it when
    /// due (see [`crate::limit`]).
    pub(crate) fn limit(&mut self, limit: crate::limit::TimeLimit) {
        let pid = self.child.id();
        self.timer = Some(crate::limit::timer(limit, move |signal| {
            // SAFETY: kill(2) has no memory-safety preconditions; the pid is our child's,
            // not reaped until the timer has stopped (see `wait`).
            unsafe { libc::kill(pid as libc::pid_t, signal) };
        }));
    }

    /// Lets the machine's policy preempt the command, which holds `gpus` (see
    /// [`crate::preempt`]).
    pub(crate) fn preemptible(&mut self, dir: tt_lock::LockDir, gpus: Vec<tt_lock::GpuKey>) {
        let pid = self.child.id();
        self.preempt = Some(crate::preempt::watch(dir, gpus, move |signal| {
            // SAFETY: as in `limit`: our child, not reaped before the watch stopped.
            unsafe { libc::kill(pid as libc::pid_t, signal) };
        }));
    }

    /// Waits for the command to end. It is reaped only after the forwarder stopped,
    /// so that its pid cannot be reused while a signal may still be sent to it.
    pub(crate) fn wait(mut self) -> Result<Ended> {
        let pid = self.child.id();
        let own_peak = if self.watched {
            tt_tracker::process::wait_for_exit_with_peak(pid)
        } else {
            tt_tracker::process::wait_for_exit(pid, None).map(|_| None)
        }
        .map_err(|e| anyhow::anyhow!("waiting for the command: {e}"))?;
        let timed_out = self.timer.take().is_some_and(crate::limit::Beside::finish);
        let preempted = self
            .preempt
            .take()
            .is_some_and(crate::limit::Beside::finish);
        self.handle.close();
        let _ = self.forwarder.join();
        let reaped = tt_tracker::process::reap(pid)
            .map_err(|e| anyhow::anyhow!("waiting for the command: {e}"))?;
        // Dropping a Child neither waits for nor signals it.
        drop(self.child);
        Ok(Ended {
            code: u8::try_from(reaped.exit_code()).unwrap_or(u8::MAX),
            max_rss: reaped.max_rss,
            own_peak,
            timed_out,
            preempted,
        })
    }
}

//! Processes as the commands see them: the kernel's boot, a process's user and command
//! line, the members of a session, and the one way torchtools ends a process it runs
//! (SIGTERM, then SIGKILL when it is still there after a grace).

use std::fs;
use std::time::Duration;

use nix::sys::signal::Signal;

/// Sends `signal` to `pid` (a process of a job, found in its record).
pub(crate) fn signal(pid: u32, signal: Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal);
}

/// The processes of session `sid` (field 6 of `/proc/PID/stat`).
pub(crate) fn session_members(sid: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| tt_device::procfs::stat(pid).is_some_and(|s| s.session == sid))
        .collect()
}

/// A process's command line as the views show it (`?` when it cannot be read).
pub(crate) fn command_of(pid: u32) -> String {
    match tt_device::procfs::cmdline(pid) {
        Some(args) if !args.is_empty() => crate::args::shown(&args),
        _ => "?".to_owned(),
    }
}

/// A process's user's name (its uid when the name is unknown; `?` when it is gone).
pub(crate) fn user_of(pid: u32) -> String {
    match tt_device::procfs::uid(pid) {
        Some(uid) => tt_lock::user_name_of(uid).unwrap_or_else(|| uid.to_string()),
        None => "?".to_owned(),
    }
}

/// SIGTERM now (through `send`), then SIGKILL when the target is still there after
/// `grace`: `gone_within(grace)` waits at most `grace` and says whether it went (or the
/// watch was stopped); `still_there` is said before SIGKILL.
pub(crate) fn terminate(
    send: impl Fn(Signal),
    grace: Duration,
    gone_within: impl FnOnce(Duration) -> bool,
    still_there: impl FnOnce(),
) {
    send(Signal::SIGTERM);
    if !gone_within(grace) {
        still_there();
        send(Signal::SIGKILL);
    }
}

/// How often a wait for a child or a record looks again.
pub(crate) const LOOK_EVERY: Duration = Duration::from_millis(20);

/// `child`'s exit status if it exits within `limit` (`None`: still running then, or
/// it cannot be waited for).
pub(crate) fn wait_at_most(
    child: &mut std::process::Child,
    limit: Duration,
) -> Option<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(LOOK_EVERY),
            _ => return None,
        }
    }
}

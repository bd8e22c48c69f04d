//! How a rank ended, as a number and in words: the exit status a launch passes on
//! (128 + a signal's number, as shells say it) and the sentence that names it.

use std::process::ExitStatus;

/// Exit status of a rank that stopped because it was preempted (SIGTERM from a
/// scheduler) after writing its checkpoint: sysexits' `EX_TEMPFAIL` (75), "try again".
/// The launcher neither counts it as a failure (no other rank is killed, no restart)
/// nor hides it: it becomes the launch's status, so a scheduler can requeue the job.
pub const EXIT_PREEMPTED: i32 = tt_device::EX_TEMPFAIL;

/// How a preempted rank is said.
pub(crate) const PREEMPTED: &str = "was preempted (checkpoint written)";

/// A rank's end as the launch's exit status (128 + the signal when killed) and in words.
pub(crate) fn describe(status: ExitStatus) -> (i32, String) {
    use std::os::unix::process::ExitStatusExt;
    let code = tt_device::shell_status(status.code(), status.signal());
    match (status.code(), status.signal()) {
        (Some(c), _) => (code, format!("exited with status {c}")),
        (None, Some(s)) => (code, format!("was {}", signal_words(s))),
        _ => (code, "ended abnormally".into()),
    }
}

/// How a process ended by signal `s` is said: Ctrl-C is an interruption, not a kill.
fn signal_words(s: i32) -> String {
    match s {
        libc::SIGINT => "interrupted (SIGINT, Ctrl-C)".into(),
        libc::SIGTERM => "terminated (SIGTERM)".into(),
        libc::SIGKILL => "killed (SIGKILL)".into(),
        libc::SIGHUP => "hung up (SIGHUP: its terminal closed)".into(),
        libc::SIGSEGV => "killed by a segmentation fault (SIGSEGV)".into(),
        libc::SIGABRT => "aborted (SIGABRT)".into(),
        s => format!("killed by signal {s}"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_signal_is_said_in_words_and_its_status_is_128_plus_it() {
        use std::os::unix::process::ExitStatusExt;
        let by = |s: i32| super::describe(std::process::ExitStatus::from_raw(s));
        assert_eq!(
            by(libc::SIGINT),
            (130, "was interrupted (SIGINT, Ctrl-C)".into())
        );
        assert_eq!(by(libc::SIGKILL), (137, "was killed (SIGKILL)".into()));
        assert_eq!(
            by(libc::SIGUSR1),
            (
                128 + libc::SIGUSR1,
                format!("was killed by signal {}", libc::SIGUSR1)
            )
        );
        assert_eq!(
            super::describe(std::process::ExitStatus::from_raw(3 << 8)),
            (3, "exited with status 3".into())
        );
    }
}

//! Time limits: `--time`, `--grace` and `--signal-before` on `reserve`, `run` and
//! `launch`, with the machine policy's default and maximum. The limit runs from the
//! command's start (once the GPUs are held): then SIGTERM (a torchtools trainer, from
//! Rust or Python, checkpoints and exits 75), SIGKILL after the grace; SIGUSR1
//! `--signal-before` ahead of the limit, for scripts that checkpoint on their own signal.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::arg_groups::TimeArgs;
use crate::exit::Exit;

/// From the limit's SIGTERM to SIGKILL when `--grace` is not given.
pub(crate) const DEFAULT_GRACE: Duration = Duration::from_secs(60);

/// The machine's policy ([`crate::config::policy_in_force`]), for a time limit: says
/// on stderr when `TORCHTOOLS_POLICY` is not read because the machine has a policy of
/// its own.
pub(crate) fn machine_policy() -> Result<&'static tt_lock::PolicyInForce> {
    let in_force = crate::config::policy_in_force()?;
    if let Some(named) = &in_force.variable_ignored {
        eprintln!(
            "torchtools: {}={} is not read: the machine's policy {} is the policy",
            tt_lock::POLICY_ENV,
            tt_device::printable(&named.display().to_string()),
            in_force.path.display()
        );
    }
    Ok(in_force)
}

/// A time limit in force.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TimeLimit {
    pub(crate) time: Duration,
    pub(crate) grace: Duration,
    pub(crate) signal_before: Option<Duration>,
}

impl TimeArgs {
    /// The limit these options and the machine's policy give, checked before anything
    /// starts: `None` without a limit.
    pub(crate) fn resolve(&self, policy: &tt_lock::PolicyInForce) -> Result<Option<TimeLimit>> {
        let limits = &policy.policy.limits;
        let bad = |why: String| Exit::usage(why);
        let time = match (self.time, limits.time_default) {
            (Some(t), _) => t,
            (None, Some(t)) => t,
            (None, None) => {
                for (given, name) in [
                    (self.grace, "--grace"),
                    (self.signal_before, "--signal-before"),
                ] {
                    if given.is_some() {
                        return Err(bad(format!(
                            "{name} applies to a time limit: give --time too"
                        ))
                        .into());
                    }
                }
                return Ok(None);
            }
        };
        let show = tt_device::format_duration;
        if time.is_zero() {
            return Err(bad(
                "--time 0 would end the command at once: give a duration, e.g. --time 8h".into(),
            )
            .into());
        }
        if let Some(max) = limits.time_max {
            if time > max {
                return Err(bad(format!(
                    "--time {} is longer than the machine's policy allows ({}: time_max = \
                     {}): ask for at most {}, and checkpoint to go on in a next job \
                     (--requeue)",
                    show(time),
                    policy.path.display(),
                    show(max),
                    show(max)
                ))
                .into());
            }
        }
        if let Some(before) = self.signal_before {
            if before >= time {
                return Err(bad(format!(
                    "--signal-before {} is not shorter than --time {}: SIGUSR1 would come \
                     before the command starts",
                    show(before),
                    show(time)
                ))
                .into());
            }
        }
        Ok(Some(TimeLimit {
            time,
            grace: self.grace.unwrap_or(DEFAULT_GRACE),
            signal_before: self.signal_before,
        }))
    }
}

/// A thread beside a running command that acts on it (its time limit, a preemption
/// watch) until [`Beside::finish`] stops it.
pub(crate) struct Beside {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<bool>,
}

impl Beside {
    /// Runs `body` on a thread of its own. `body` sleeps with the function it is given,
    /// which returns `false` (at once) when the thread is stopped; its own result says
    /// whether it acted on the command.
    pub(crate) fn start(
        body: impl FnOnce(&dyn Fn(Duration) -> bool) -> bool + Send + 'static,
    ) -> Beside {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let sleep =
                |d: Duration| matches!(stopped.recv_timeout(d), Err(RecvTimeoutError::Timeout));
            body(&sleep)
        });
        Beside { stop, thread }
    }

    /// Stops the thread (the command has ended; call before it is reaped, so that no
    /// signal reaches a reused pid): whether it acted on the command.
    pub(crate) fn finish(self) -> bool {
        let _ = self.stop.send(());
        self.thread.join().unwrap_or(false)
    }
}

/// Starts the clock of a running command's time limit now: `send(signal)` delivers
/// SIGUSR1, SIGTERM and SIGKILL when they are due; [`Beside::finish`] says whether the
/// limit was reached.
pub(crate) fn timer(limit: TimeLimit, send: impl Fn(i32) + Send + 'static) -> Beside {
    let start = Instant::now();
    Beside::start(move |sleep| {
        // Sleeps until `at` from the start; false when stopped first.
        let until = |at: Duration| sleep(at.saturating_sub(start.elapsed()));
        let show = tt_device::format_duration;
        if let Some(before) = limit.signal_before {
            if !until(limit.time - before) {
                return false;
            }
            eprintln!(
                "torchtools: the time limit ({}) is {} away: SIGUSR1 sent to the command",
                show(limit.time),
                show(before)
            );
            send(libc::SIGUSR1);
        }
        if !until(limit.time) {
            return false;
        }
        eprintln!(
            "torchtools: time limit ({}) reached: SIGTERM sent to the command (SIGKILL \
             in {})",
            show(limit.time),
            show(limit.grace)
        );
        crate::process::terminate(
            |s| send(s as i32),
            limit.grace,
            |grace| !until(limit.time + grace),
            || {
                eprintln!(
                    "torchtools: the command still runs {} after the time limit's \
                     SIGTERM: SIGKILL",
                    show(limit.grace)
                )
            },
        );
        true
    })
}

/// Says that the command ended by its time limit, and marks its job so (when it runs
/// as a detached job: `jobs` then says `timeout`).
pub(crate) fn ended_by_limit(code: u8) {
    eprintln!(
        "torchtools: the command was ended by its time limit ({})",
        crate::jobs::store::status_text(i32::from(code))
    );
    crate::jobs::store::mark_timed_out();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn in_force(text: &str) -> tt_lock::PolicyInForce {
        tt_lock::PolicyInForce {
            path: "/etc/torchtools/policy.toml".into(),
            status: tt_lock::PolicyStatus::InForce,
            policy: tt_lock::Policy::parse(text).unwrap_or_default(),
            variable_ignored: None,
        }
    }

    #[test]
    fn the_policy_gives_the_default_and_the_maximum() {
        let policy = in_force("[limits]\ntime_default = \"8h\"\ntime_max = \"24h\"\n");
        let none = TimeArgs::default();
        let limit = none.resolve(&policy).ok().flatten();
        assert_eq!(limit.map(|l| l.time), Some(Duration::from_secs(8 * 3600)));
        assert_eq!(limit.map(|l| l.grace), Some(DEFAULT_GRACE));
        let long = TimeArgs {
            time: Some(Duration::from_secs(2 * 86_400)),
            ..TimeArgs::default()
        };
        let e = long
            .resolve(&policy)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("--time 2d is longer") && e.contains("time_max = 1d"),
            "{e}"
        );
        assert_eq!(none.resolve(&in_force("")).ok().flatten(), None);
        let early = TimeArgs {
            time: Some(Duration::from_secs(60)),
            signal_before: Some(Duration::from_secs(60)),
            ..TimeArgs::default()
        };
        assert!(early.resolve(&policy).is_err());
        let orphan = TimeArgs {
            grace: Some(Duration::from_secs(5)),
            ..TimeArgs::default()
        };
        assert!(orphan.resolve(&in_force("")).is_err());
    }

    #[test]
    fn the_timer_sends_usr1_term_then_kill_in_order_and_nothing_once_finished() {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&sent);
        let limit = TimeLimit {
            time: Duration::from_millis(40),
            grace: Duration::from_millis(40),
            signal_before: Some(Duration::from_millis(20)),
        };
        let clock = timer(limit, move |s| {
            log.lock().unwrap_or_else(|e| e.into_inner()).push(s)
        });
        // Waited for by event (all three sent), with a bound for a busy machine.
        let start = Instant::now();
        while sent.lock().unwrap_or_else(|e| e.into_inner()).len() < 3
            && start.elapsed() < Duration::from_secs(60)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(clock.finish());
        let got = sent.lock().unwrap_or_else(|e| e.into_inner()).clone();
        assert_eq!(got, [libc::SIGUSR1, libc::SIGTERM, libc::SIGKILL]);
        // Finished before its first signal is due (in a second): none comes, then or
        // ever (a finish that left the clock running would see SIGTERM and SIGKILL
        // sent a second later; the wait is twice that).
        let quiet = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&quiet);
        let quiet_clock = timer(
            TimeLimit {
                time: Duration::from_secs(1),
                grace: Duration::from_millis(50),
                signal_before: None,
            },
            move |s| log.lock().unwrap_or_else(|e| e.into_inner()).push(s),
        );
        assert!(!quiet_clock.finish());
        std::thread::sleep(Duration::from_secs(2));
        assert!(quiet.lock().unwrap_or_else(|e| e.into_inner()).is_empty());
    }
}

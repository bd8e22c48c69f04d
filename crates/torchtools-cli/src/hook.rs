//! `--on-end CMD`: a command run once when a job ends, however it ends (exit, signal,
//! `stop`, cancelled, or lost when torchtools or a detached job's keeper is killed), with
//! the job's facts in `TORCHTOOLS_JOB_*` variables and the end of its log on standard
//! input; a user's default in `$XDG_CONFIG_HOME/torchtools/config.toml`.
//!
//! The hook is run by a guardian (`torchtools job-hook`), a process in a session of its
//! own started when the job starts, so that neither the terminal's signals nor `stop`'s
//! SIGKILL of the job's session reach it. The job's torchtools (attached) or keeper
//! (detached) tells it what happens on a pipe, one JSON line per event; the guardian
//! runs the hook when the pipe closes: with the job's status when one was said, as
//! "lost" when its writer died without saying one. One guardian, one end of the pipe:
//! the hook runs exactly once. Its secret (a webhook's URL) is never in a file or a
//! command line others can read: it travels in the guardian's environment.

use std::fs::File;
use std::io::{BufRead, Read, Seek, SeekFrom, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::arg_groups::HookArgs;
use crate::exit::Exit;
use crate::jobs::store::{JOB_ID_ENV, JOB_LOG_ENV};

/// The hook of a detached job, from its starter to its keeper and from an owner to its
/// guardian: in the environment, readable by the user alone (`/proc/PID/environ`).
const HOOK_ENV: &str = "TORCHTOOLS_JOB_ON_END";

/// Its time limit, in seconds, beside it.
const TIMEOUT_ENV: &str = "TORCHTOOLS_JOB_ON_END_TIMEOUT";

/// A hook's time limit when neither `--on-end-timeout` nor the config gives one.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How many of the log's last lines the hook reads on standard input (at most 64 KiB).
const TAIL_LINES: usize = 50;

const TAIL_BYTES: u64 = 64 * 1024;

/// A hook to run when a job ends.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Hook {
    /// Run with `sh -c`.
    pub(crate) command: String,
    /// Killed (its whole process group) after this long.
    pub(crate) timeout: Duration,
}

/// The user's default hook, from their config file (none when there is no file); an
/// error that names the file and what is wrong in it.
fn config_hook() -> Result<Option<Hook>> {
    match crate::config::user()? {
        Some(user) => hook_in(user),
        None => Ok(None),
    }
}

/// The hook a config file gives (`[on_end]`), checked.
fn hook_in(user: &crate::config::UserConfig) -> Result<Option<Hook>> {
    let Some(on_end) = &user.config.on_end else {
        return Ok(None);
    };
    let bad = |why: String| crate::config::bad(&user.path, &why);
    if on_end.command.trim().is_empty() {
        return Err(bad("[on_end] command is empty".into()).into());
    }
    let timeout = match &on_end.timeout {
        None => DEFAULT_TIMEOUT,
        Some(t) => crate::args::duration(t).map_err(|e| bad(format!("[on_end] timeout: {e}")))?,
    };
    Ok(Some(Hook {
        command: on_end.command.clone(),
        timeout,
    }))
}

/// Where `--on-end`'s command goes when this program re-executes itself without it
/// ([`hide_from_argv`]): the environment, which only the same user (and root) can read.
const GIVEN_ENV: &str = "TORCHTOOLS_ON_END_GIVEN";

/// Re-executes this program (same pid) with `--on-end CMD` taken out of its arguments
/// and handed over in its environment instead, when the arguments hold one: every user
/// of the machine can read a process's arguments (`/proc/PID/cmdline`, `ps`) for as
/// long as it runs, and a hook's command may hold a token or a webhook's secret. Only
/// the options before the user's command (its last `command_len` words, or after `--`)
/// are looked at. Returns only when there is nothing to hide (or an error).
pub(crate) fn hide_from_argv(command_len: usize) -> Result<()> {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let head = argv.len().saturating_sub(command_len);
    let (mut kept, mut given) = (Vec::new(), None);
    let mut i = 1;
    let mut options = true;
    while i < argv.len() {
        let a = &argv[i];
        options &= i < head && a != "--";
        if options && a == "--on-end" && i + 1 < head {
            given = Some(argv[i + 1].clone());
            i += 2;
            continue;
        }
        if let Some(value) = a.to_str().and_then(|a| a.strip_prefix("--on-end=")) {
            if options {
                given = Some(value.into());
                i += 1;
                continue;
            }
        }
        kept.push(a.clone());
        i += 1;
    }
    let Some(given) = given else {
        return Ok(());
    };
    let e = Command::new("/proc/self/exe")
        .arg0(&argv[0])
        .args(&kept)
        .env(GIVEN_ENV, given)
        .exec();
    Err(anyhow::anyhow!(
        "cannot re-run torchtools to take --on-end's command out of its arguments \
         (which every user can read): {e}; give the hook in \
         $XDG_CONFIG_HOME/torchtools/config.toml instead"
    ))
}

/// The `--on-end` command [`hide_from_argv`] handed over, taken out of the environment
/// (so that nothing this program starts inherits it).
fn take_given() -> Option<String> {
    let given = std::env::var(GIVEN_ENV).ok()?;
    // SAFETY: called while the program checks its options, before it starts any thread.
    unsafe { std::env::remove_var(GIVEN_ENV) };
    Some(given)
}

impl HookArgs {
    /// The hook this job runs: `--on-end`, else the config's (not inside a detached
    /// job, whose keeper runs the job's hook), else none. The config is read and
    /// checked here, before any work.
    pub(crate) fn resolve(&self) -> Result<Option<Hook>> {
        let on_end = self.on_end.clone().or_else(take_given);
        if self.no_on_end {
            return Ok(None);
        }
        let configured = match (&on_end, std::env::var_os(JOB_ID_ENV)) {
            (None, None) => config_hook()?,
            _ => None,
        };
        Ok(match (&on_end, configured) {
            (Some(command), _) => Some(Hook {
                command: command.clone(),
                timeout: self.on_end_timeout.unwrap_or(DEFAULT_TIMEOUT),
            }),
            (None, Some(mut hook)) => {
                hook.timeout = self.on_end_timeout.unwrap_or(hook.timeout);
                Some(hook)
            }
            (None, None) => None,
        })
    }
}

impl Hook {
    /// Hands the hook to a process started by `cmd` (a keeper, a guardian), or makes
    /// sure none is inherited.
    pub(crate) fn pass(hook: Option<&Hook>, cmd: &mut Command) {
        match hook {
            Some(h) => cmd
                .env(HOOK_ENV, &h.command)
                .env(TIMEOUT_ENV, h.timeout.as_secs_f64().to_string()),
            None => cmd.env_remove(HOOK_ENV).env_remove(TIMEOUT_ENV),
        };
    }

    /// The hook handed to this process by [`Hook::pass`], taken out of its environment
    /// (so that what it starts does not inherit it).
    pub(crate) fn take_passed() -> Option<Hook> {
        let command = std::env::var(HOOK_ENV).ok()?;
        let timeout = std::env::var(TIMEOUT_ENV)
            .ok()
            .and_then(|t| t.parse::<f64>().ok())
            .and_then(|t| Duration::try_from_secs_f64(t).ok())
            .unwrap_or(DEFAULT_TIMEOUT);
        // SAFETY: called at the start of a keeper or guardian, before it starts any
        // thread that could read the environment.
        unsafe {
            std::env::remove_var(HOOK_ENV);
            std::env::remove_var(TIMEOUT_ENV);
        }
        Some(Hook { command, timeout })
    }
}

/// What a job's owner tells its guardian, one JSON line each.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "event", rename_all = "snake_case")]
enum Event {
    /// The job: its id (empty when attached), command line, log, start.
    Job {
        id: String,
        command: Vec<String>,
        log: Option<PathBuf>,
        started: f64,
    },
    /// The process that reserves the job's GPUs (its torchtools).
    Pid { pid: u32 },
    /// It ended with this status (128 + N when killed by signal N).
    Ended { status: i32 },
    /// It ended without running.
    Cancelled { why: String },
}

/// A running guardian, and the pipe to it.
pub(crate) struct Guardian {
    child: Child,
    pipe: Option<File>,
    timeout: Duration,
}

impl Guardian {
    /// Starts the guardian of the job `id` (empty: an attached job) that runs `hook`
    /// when the job ends.
    pub(crate) fn start(
        hook: &Hook,
        id: &str,
        command: Vec<String>,
        log: Option<PathBuf>,
        started: f64,
    ) -> Result<Guardian> {
        // Close-on-exec: the job's command never holds the pipe open.
        let (reader, writer) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("making the hook's pipe")?;
        let exe = std::env::current_exe().context("finding this program")?;
        let mut cmd = Command::new(exe);
        cmd.arg("job-hook")
            .arg(if id.is_empty() { "attached" } else { id })
            .stdin(reader)
            .stdout(Stdio::null());
        Hook::pass(Some(hook), &mut cmd);
        // SAFETY: setsid is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setsid()
                    .map(drop)
                    .map_err(std::io::Error::from)
            });
        }
        let child = cmd
            .spawn()
            .context("starting the --on-end hook's guardian")?;
        let mut guardian = Guardian {
            child,
            pipe: Some(File::from(writer)),
            timeout: hook.timeout,
        };
        guardian.say(&Event::Job {
            id: id.to_owned(),
            command,
            log,
            started,
        });
        Ok(guardian)
    }

    fn say(&mut self, event: &Event) {
        let Some(pipe) = self.pipe.as_mut() else {
            return;
        };
        let line = serde_json::to_string(event).unwrap_or_default() + "\n";
        if let Err(e) = pipe.write_all(line.as_bytes()) {
            tracing::warn!("cannot reach the --on-end hook's guardian: {e}");
        }
    }

    /// The process whose reservations are the job's GPUs.
    pub(crate) fn pid(&mut self, pid: u32) {
        self.say(&Event::Pid { pid });
    }

    /// The job ended with `status`: the hook runs now; returns when it has ended (or
    /// overran its time limit).
    pub(crate) fn ended(mut self, status: i32) {
        self.say(&Event::Ended { status });
        self.finish();
    }

    /// The job ended without running.
    pub(crate) fn cancelled(mut self, why: &str) {
        self.say(&Event::Cancelled {
            why: why.to_owned(),
        });
        self.finish();
    }

    /// Closes the pipe and waits for the guardian, a little longer than the hook may
    /// run; a guardian that takes longer is left to finish on its own.
    fn finish(&mut self) {
        drop(self.pipe.take());
        let _ =
            crate::process::wait_at_most(&mut self.child, self.timeout + Duration::from_secs(10));
    }
}

/// The guardian: reads the owner's events until the pipe closes, then runs the hook.
pub(crate) fn guard() -> Result<std::process::ExitCode> {
    let Some(hook) = Hook::take_passed() else {
        return Err(Exit::usage("job-hook is internal: use --on-end".into()).into());
    };
    let mut job = None;
    let mut pid = None;
    let mut end = None;
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        match serde_json::from_str::<Event>(&line) {
            Ok(e @ Event::Job { .. }) => job = Some(e),
            Ok(Event::Pid { pid: p }) => pid = Some(p),
            Ok(e @ (Event::Ended { .. } | Event::Cancelled { .. })) => end = Some(e),
            Err(_) => {}
        }
    }
    let ended = tt_device::now_unix();
    let Some(Event::Job {
        id,
        command,
        log,
        started,
    }) = job
    else {
        return Ok(std::process::ExitCode::FAILURE);
    };
    let (status, state) = match end {
        Some(Event::Ended { status }) => {
            (status.to_string(), crate::jobs::store::status_text(status))
        }
        Some(Event::Cancelled { why }) => (String::new(), format!("cancelled: {why}")),
        _ if id.is_empty() => (String::new(), "lost (torchtools was killed)".into()),
        _ => (String::new(), "lost (its keeper was killed)".into()),
    };
    let me = tt_lock::Holder::current();
    let gpus = pid.map_or_else(String::new, |pid| gpus_of(pid, &me.who.host, started));
    let vars: Vec<(&str, String)> = vec![
        (JOB_ID_ENV, id),
        ("TORCHTOOLS_JOB_COMMAND", shell_words(&command)),
        ("TORCHTOOLS_JOB_USER", me.who.user),
        ("TORCHTOOLS_JOB_HOST", me.who.host),
        ("TORCHTOOLS_JOB_GPUS", gpus),
        ("TORCHTOOLS_JOB_STATUS", status),
        ("TORCHTOOLS_JOB_STATE", state),
        ("TORCHTOOLS_JOB_STARTED", format!("{}", started as u64)),
        ("TORCHTOOLS_JOB_ENDED", format!("{}", ended as u64)),
        (
            "TORCHTOOLS_JOB_SECONDS",
            format!("{:.0}", (ended - started).max(0.0)),
        ),
        (
            JOB_LOG_ENV,
            log.as_ref()
                .map_or(String::new(), |l| l.display().to_string()),
        ),
    ];
    let tail = log.as_deref().map(tail).unwrap_or_default();
    run_hook(&hook, &vars, tail);
    Ok(std::process::ExitCode::SUCCESS)
}

/// The GPUs process `pid` of this host reserved since `started`, as its
/// CUDA_VISIBLE_DEVICES named them: from the usage records, where every reservation is.
fn gpus_of(pid: u32, host: &str, started: f64) -> String {
    let mut gpus: Vec<String> = Vec::new();
    // This user's own logs only, a line at a time: a hook runs at every job's end.
    let read = tt_lock::LockDir::from_env().and_then(|d| {
        d.each_own_start(|r| {
            if r.pid == pid
                && r.host == host
                && r.since_unix >= started - 1.0
                && !gpus.contains(&r.gpu)
            {
                gpus.push(r.gpu.clone());
            }
        })
    });
    if read.is_err() {
        return String::new();
    }
    gpus.join(",")
}

/// The last lines of `log` (at most [`TAIL_LINES`] and [`TAIL_BYTES`]).
fn tail(log: &Path) -> Vec<u8> {
    let Ok(mut file) = crate::jobs::store::open_log(log) else {
        return Vec::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let from = len.saturating_sub(TAIL_BYTES);
    let mut text = Vec::new();
    if file.seek(SeekFrom::Start(from)).is_err() || file.read_to_end(&mut text).is_err() {
        return Vec::new();
    }
    // Whole lines only: a cut first line is dropped.
    if from > 0 {
        let cut = text.iter().position(|b| *b == b'\n').map_or(0, |i| i + 1);
        text.drain(..cut);
    }
    let lines = text.iter().filter(|b| **b == b'\n').count()
        + usize::from(!text.is_empty() && !text.ends_with(b"\n"));
    let mut skip = lines.saturating_sub(TAIL_LINES);
    let mut start = 0;
    while skip > 0 {
        match text[start..].iter().position(|b| *b == b'\n') {
            Some(i) => start += i + 1,
            None => break,
        }
        skip -= 1;
    }
    text.split_off(start)
}

/// Runs the hook with the variables `vars` and `stdin` on its standard input,
/// its output on our standard error (the job's log, or the terminal), in a process
/// group of its own that is killed whole past the time limit. A failure is a warning.
fn run_hook(hook: &Hook, vars: &[(&str, String)], stdin: Vec<u8>) {
    let warn = |what: String| {
        let _ = writeln!(
            std::io::stderr(),
            "torchtools: warning: the --on-end hook {what}; the job's status is unchanged"
        );
    };
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(&hook.command)
        .stdin(Stdio::piped())
        .process_group(0);
    // Its standard output goes where our standard error goes: never into the job's
    // own output.
    {
        use std::os::fd::AsFd;
        match std::io::stderr().as_fd().try_clone_to_owned() {
            Ok(err) => cmd.stdout(err),
            Err(_) => cmd.stdout(Stdio::null()),
        };
    }
    for (name, value) in vars {
        cmd.env(name, value);
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return warn(format!("could not start (sh: {e})")),
    };
    if let Some(mut input) = child.stdin.take() {
        // A hook that does not read its input must not block us.
        std::thread::spawn(move || {
            let _ = input.write_all(&stdin);
        });
    }
    if let Some(status) = crate::process::wait_at_most(&mut child, hook.timeout) {
        use std::os::unix::process::ExitStatusExt;
        if !status.success() {
            let code = tt_device::shell_status(status.code(), status.signal());
            warn(format!("`{}` failed (exit {code})", hook.command));
        }
        return;
    }
    // Over its time: the hook and everything it started.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = child.wait();
    warn(format!(
        "`{}` still ran after {:?}: killed (--on-end-timeout)",
        hook.command, hook.timeout
    ));
}

/// A command line as a shell would read it back: words quoted where they need it.
pub(crate) fn shell_words(words: &[String]) -> String {
    let safe = |w: &str| {
        !w.is_empty()
            && w.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_@%+=:,./-".contains(&b))
    };
    words
        .iter()
        .map(|w| match safe(w) {
            true => w.clone(),
            false => format!("'{}'", w.replace('\'', r"'\''")),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_quoted_as_a_shell_reads_them() {
        let words = ["sh", "-c", "echo it's", "--lr=3e-4", ""].map(String::from);
        assert_eq!(shell_words(&words), r"sh -c 'echo it'\''s' --lr=3e-4 ''");
    }

    #[test]
    fn the_tail_is_the_last_lines() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let log = tmp.path().join("log");
        let text: String = (0..80).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&log, text).unwrap_or_else(|e| panic!("{e}"));
        let got = String::from_utf8(tail(&log)).unwrap_or_default();
        assert!(
            got.starts_with("line 30\n") && got.ends_with("line 79\n"),
            "{got}"
        );
        std::fs::write(&log, "one\ntwo").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(tail(&log), b"one\ntwo");
    }

    /// The hook of the config file at `path`.
    fn config_hook(path: &Path) -> Result<Option<Hook>> {
        match crate::config::read(path)? {
            Some(user) => hook_in(&user),
            None => Ok(None),
        }
    }

    #[test]
    fn the_config_gives_a_default_hook_and_names_itself_when_wrong() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = tmp.path().join("config.toml");
        assert_eq!(config_hook(&path).ok(), Some(None));
        std::fs::write(
            &path,
            "[on_end]\ncommand = \"echo done\"\ntimeout = \"5s\"\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            config_hook(&path).ok(),
            Some(Some(Hook {
                command: "echo done".into(),
                timeout: Duration::from_secs(5)
            }))
        );
        for bad in [
            "[on_end]\ncomand = \"x\"\n",
            "[on_end]\ncommand = \"x\"\ntimeout = \"soon\"\n",
            "[on_end]\ncommand = \"\"\n",
            "on_end = 3\n",
        ] {
            std::fs::write(&path, bad).unwrap_or_else(|e| panic!("{e}"));
            let e = config_hook(&path).err().map(|e| e.to_string());
            assert!(
                e.as_deref()
                    .is_some_and(|e| e.contains("config.toml") && e.contains("[on_end]")),
                "{bad:?}: {e:?}"
            );
        }
    }

    #[test]
    fn a_config_others_can_write_or_that_is_not_ones_own_is_not_read() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = tmp.path().join("config.toml");
        std::fs::write(&path, "[on_end]\ncommand = \"echo done\"\n")
            .unwrap_or_else(|e| panic!("{e}"));
        let refused = |path: &Path| config_hook(path).err().map(|e| e.to_string());
        for mode in [0o666, 0o620] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                .unwrap_or_else(|e| panic!("{e}"));
            let e = refused(&path);
            assert!(
                e.as_deref().is_some_and(|e| e.contains("config.toml")
                    && e.contains("other users can write it")
                    && e.contains("chmod go-w")),
                "{mode:o}: {e:?}"
            );
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(config_hook(&path).is_ok_and(|h| h.is_some()));
        // Another user's file (root can give one away; as anyone else, say so).
        if tt_lock::euid() == 0 {
            let nobody = Some(nix::unistd::Uid::from_raw(65_534));
            nix::unistd::chown(&path, nobody, None).unwrap_or_else(|e| panic!("{e}"));
            let e = refused(&path);
            assert!(
                e.as_deref()
                    .is_some_and(|e| e.contains("belongs to nobody") && e.contains("not read")),
                "{e:?}"
            );
        } else {
            tt_testkit::skip_knowingly(
                "giving a config file to another user needs root",
                "giving a config file to another user needs root: run as root",
            );
        }
    }
}

//! The user's defaults: `$XDG_CONFIG_HOME/torchtools/config.toml` (else
//! `~/.config/torchtools/config.toml`), believed only when it is theirs (or root's) and
//! nobody else can write it. It holds `[on_end]`, the hook run when a job ends
//! (`hook.rs`), and `[detach]`, where `--detach` sends a job:
//!
//! ```toml
//! [on_end]
//! command = "notify-send \"job $TORCHTOOLS_JOB_ID: $TORCHTOOLS_JOB_STATUS\""
//! timeout = "60s"
//!
//! [detach]
//! to = "slurm"    # or "torchtools" (the default): --slurm and --no-slurm say otherwise
//! ```

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::Result;
use serde::Deserialize;

use crate::exit::Exit;

/// `config.toml`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Config {
    pub(crate) on_end: Option<OnEndConfig>,
    pub(crate) detach: Option<DetachConfig>,
}

/// `[on_end]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct OnEndConfig {
    pub(crate) command: String,
    pub(crate) timeout: Option<String>,
}

/// `[detach]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DetachConfig {
    /// Where `--detach` sends a job when neither `--slurm` nor `--no-slurm` says.
    pub(crate) to: tt_lock::Scheduler,
}

/// What the file takes, for an error about it.
const TAKES: &str = "it takes `[on_end]` with `command = \"...\"` and an optional \
                     `timeout = \"60s\"`, and `[detach]` with `to = \"slurm\"` or \
                     `to = \"torchtools\"` (or move the file away)";

/// The user's config file; `None` without `XDG_CONFIG_HOME` or `HOME`.
pub(crate) fn path() -> Option<PathBuf> {
    Some(tt_device::user_dir("XDG_CONFIG_HOME", ".config")?.join("torchtools/config.toml"))
}

/// The error for what is wrong in the file at `path`: its name, `why`, and what it
/// takes.
pub(crate) fn bad(path: &Path, why: &str) -> Exit {
    Exit::usage(format!("{}: {why}; {TAKES}", path.display()))
}

/// The config at `path` (`None` when there is no file); an error naming the file and
/// what is wrong in it, or why it is not believed.
pub(crate) fn read(path: &Path) -> std::result::Result<Option<UserConfig>, Exit> {
    let text = match read_own(path) {
        Ok(Some(text)) => text,
        Ok(None) => return Ok(None),
        Err(why) => return Err(Exit::usage(format!("{}: {why}", path.display()))),
    };
    let config: Config = toml::from_str(&text).map_err(|e| bad(path, e.message()))?;
    Ok(Some(UserConfig {
        path: path.to_owned(),
        config,
    }))
}

/// The user's config and the file it was read from.
#[derive(Debug)]
pub(crate) struct UserConfig {
    pub(crate) path: PathBuf,
    pub(crate) config: Config,
}

/// The user's config (`None` when there is none), read once, when first asked for:
/// every part of a command (its hook, where `--detach` goes) sees the same file.
pub(crate) fn user() -> Result<Option<&'static UserConfig>> {
    static USER: OnceLock<std::result::Result<Option<UserConfig>, String>> = OnceLock::new();
    let read = USER.get_or_init(|| {
        let Some(path) = path() else {
            return Ok(None);
        };
        read(&path).map_err(|e| e.message)
    });
    match read {
        Ok(user) => Ok(user.as_ref()),
        Err(message) => Err(Exit::usage(message.clone()).into()),
    }
}

/// The machine's policy for the lock directory `TORCHTOOLS_LOCK_DIR` names (or the
/// default), read once per command without opening the directory: a check made before
/// anything starts, and where `--detach` sends a job ([`detach_to`]).
/// The variable is checked by the lock directory's own rule ([`tt_lock::path_from_env`]:
/// empty or relative is an error here too).
pub(crate) fn policy_in_force() -> Result<&'static tt_lock::PolicyInForce> {
    static IN_FORCE: OnceLock<std::result::Result<tt_lock::PolicyInForce, String>> =
        OnceLock::new();
    IN_FORCE
        .get_or_init(|| {
            let dir =
                tt_lock::path_from_env().map_err(|e| format!("{:#}", anyhow::Error::from(e)))?;
            Ok(tt_lock::policy_for(&dir))
        })
        .as_ref()
        .map_err(|message| anyhow::anyhow!("{message}"))
}

/// Where `--detach` sends a job when neither `--slurm` nor `--no-slurm` says: the
/// user's config's `[detach] to`, else the machine policy's (`[detach] to` in
/// /etc/torchtools/policy.toml), else torchtools' own queue; with the file that said,
/// when one did.
pub(crate) fn detach_to() -> Result<(tt_lock::Scheduler, Option<PathBuf>)> {
    if let Some(user) = user()? {
        if let Some(detach) = &user.config.detach {
            return Ok((detach.to, Some(user.path.clone())));
        }
    }
    let machine = policy_in_force()?;
    Ok(match machine.policy.detach {
        Some(to) => (to, Some(machine.path.clone())),
        None => (tt_lock::Scheduler::Torchtools, None),
    })
}

/// The config file's text, believed only when it is this user's (or root's) and no
/// other user can write it: its hook runs as this user, so a file another user can
/// change would run their commands. `None` when there is none; the refusal names the
/// owner or mode and the fix. Read with a bound (a config is small).
fn read_own(path: &Path) -> std::result::Result<Option<String>, String> {
    use tt_lock::Untrusted;
    const MAX: u64 = 1 << 20;
    let me = tt_lock::euid();
    tt_lock::trusted_text(path, &[me, 0], MAX).map_err(|why| match why {
        Untrusted::NotRegular => "it is not a regular file; move it away".into(),
        Untrusted::Owner(uid) => format!(
            "it belongs to {} (uid {uid}), not to you: its hook would run their command as \
             you, so it is not read; remove it, or `cp` it to a file of your own",
            tt_lock::name_of_uid(uid),
        ),
        Untrusted::Writable(mode) => format!(
            "other users can write it (mode {mode:o}): its hook would run their command as \
             you, so it is not read; run `chmod go-w {}`",
            path.display()
        ),
        Untrusted::TooLarge(max) => {
            format!("it is larger than {max} bytes; a config is a few lines")
        }
        Untrusted::Io(e) => format!("cannot read it: {e}"),
    })
}

//! The machine's queueing policy: a TOML file that root writes, by default
//! [`DEFAULT_POLICY`] ([`POLICY_ENV`] names another). Without one (or with one that is
//! not believed) the queue is first come, first served.
//!
//! A policy file is believed only when no ordinary user could have written it: owned by
//! root (or, for a path other than the default, by the lock directory's owner) and not
//! writable by its group or others. Every process that reads the queue reads the same
//! file and so computes the same serving order.

use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tt_device::Bytes;

use crate::LockDir;

/// The variable that names another policy file than [`DEFAULT_POLICY`] (for tests, and
/// for a lock directory of one's own): the file is then believed when it belongs to
/// root or to the lock directory's owner.
pub const POLICY_ENV: &str = "TORCHTOOLS_POLICY";

/// The machine's policy file, written by root.
pub const DEFAULT_POLICY: &str = "/etc/torchtools/policy.toml";

/// The largest policy file read (a policy is a few lines).
const MAX_POLICY_BYTES: u64 = 64 << 10;

/// How long a request waits before it goes ahead of every later request whatever its
/// user's recent use, when `[fair_share] aging` is not given.
pub const DEFAULT_AGING: Duration = Duration::from_secs(3600);

/// A queueing policy, as read from its file; `Policy::default()` is first come, first
/// served with no limits.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Policy {
    /// Fair share by recent use; `None`: first come, first served.
    pub fair_share: Option<FairShare>,
    /// Per-user limits.
    pub limits: Limits,
    /// Preemption of `--preemptible` jobs; `None`: none.
    pub preemption: Option<Preemption>,
    /// `[detach] to`: where `--detach` sends a job when neither the command line
    /// (`--slurm`, `--no-slurm`) nor the user's own config says; `None`: torchtools'
    /// queue. A default, not a rule: Slurm itself keeps users off its nodes.
    pub detach: Option<Scheduler>,
}

/// Whose queue a detached job goes to (`[detach] to` in the machine's policy or in a
/// user's config.toml).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheduler {
    /// This machine's own queue (`torchtools jobs`).
    Torchtools,
    /// Slurm's, with `sbatch` (`--slurm`).
    Slurm,
}

/// `[fair_share]`: who is served first among the requests waiting.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FairShare {
    /// Each user's use counts half as much this long after it happened.
    pub half_life: Duration,
    /// A request that has waited this long goes ahead of every request that arrived
    /// later, whatever the users' use: the bound on how long a later arrival can
    /// overtake it (no request starves).
    pub aging: Duration,
}

/// `[limits]`: what each user may have at once.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Limits {
    /// GPUs held at once (exclusively).
    pub gpus: Option<usize>,
    /// Bytes of shared GPUs' memory budgeted at once.
    pub share: Option<Bytes>,
    /// Requests waiting in the queue at once; one more is refused.
    pub queued: Option<usize>,
    /// The longest `--time` a job may ask for.
    pub time_max: Option<Duration>,
    /// A job's time limit when it gives no `--time`.
    pub time_default: Option<Duration>,
}

/// `[preemption]`: when a waiting request may stop a `--preemptible` job.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Preemption {
    /// A request that has waited longer may preempt a preemptible job of a user above
    /// their fair share.
    pub after: Duration,
    /// From the preempted job's SIGTERM to its SIGKILL.
    pub grace: Duration,
}

impl Policy {
    /// Whether the queue is served in another order than first come, first served, or
    /// holds requests back: whether a waiter must look at more than ticket numbers.
    pub fn orders_the_queue(&self) -> bool {
        self.fair_share.is_some() || self.limits.gpus.is_some() || self.limits.share.is_some()
    }

    /// Whether per-user holding limits apply (a request may be held back even when
    /// nobody else waits).
    pub fn limits_apply(&self) -> bool {
        self.limits.gpus.is_some() || self.limits.share.is_some()
    }

    /// Parses a policy file's text; the error names the key and what it takes.
    pub fn parse(text: &str) -> Result<Policy, String> {
        let raw: RawPolicy = toml::from_str(text).map_err(|e| {
            // The line the error is on, which names the key (`gpus = -1`).
            let at = e.span().map_or(0, |s| s.start).min(text.len());
            let line_no = text[..at].matches('\n').count() + 1;
            let line = text.lines().nth(line_no - 1).unwrap_or("").trim();
            format!("line {line_no} (`{line}`): {}", e.message().trim())
        })?;
        let duration = |key: &str, value: Option<&String>| -> Result<Option<Duration>, String> {
            value
                .map(|v| match tt_device::parse_duration(v) {
                    Ok(d) if d.is_zero() => Err(format!("{key}: must be more than 0")),
                    Ok(d) => Ok(d),
                    Err(e) => Err(format!("{key}: {e}")),
                })
                .transpose()
        };
        let fair_share = match raw.fair_share {
            None => None,
            Some(f) => Some(FairShare {
                half_life: duration("[fair_share] half_life", f.half_life.as_ref())?
                    .ok_or("[fair_share] needs half_life, e.g. half_life = \"7d\"")?,
                aging: duration("[fair_share] aging", f.aging.as_ref())?.unwrap_or(DEFAULT_AGING),
            }),
        };
        let l = raw.limits.unwrap_or_default();
        let share = l
            .share
            .map(|s| {
                s.parse::<Bytes>()
                    .map_err(|e| format!("[limits] share: {e}"))
            })
            .transpose()?;
        let limits = Limits {
            gpus: l.gpus,
            share,
            queued: l.queued,
            time_max: duration("[limits] time_max", l.time_max.as_ref())?,
            time_default: duration("[limits] time_default", l.time_default.as_ref())?,
        };
        for (key, zero) in [
            ("gpus", limits.gpus == Some(0)),
            ("queued", limits.queued == Some(0)),
            ("share", limits.share == Some(Bytes(0))),
        ] {
            if zero {
                return Err(format!(
                    "[limits] {key} = 0 would refuse everyone: leave it out for no limit"
                ));
            }
        }
        if let (Some(default), Some(max)) = (limits.time_default, limits.time_max) {
            if default > max {
                return Err(format!(
                    "[limits] time_default ({}) is longer than time_max ({})",
                    tt_device::format_duration(default),
                    tt_device::format_duration(max)
                ));
            }
        }
        let preemption = match raw.preemption {
            None => None,
            Some(p) => Some(Preemption {
                after: duration("[preemption] after", p.after.as_ref())?
                    .ok_or("[preemption] needs after, e.g. after = \"30m\"")?,
                grace: duration("[preemption] grace", p.grace.as_ref())?
                    .unwrap_or(Duration::from_secs(120)),
            }),
        };
        Ok(Policy {
            fair_share,
            limits,
            preemption,
            detach: raw.detach.map(|d| d.to),
        })
    }
}

/// The file's form: every key optional, any other key an error.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    fair_share: Option<RawFairShare>,
    limits: Option<RawLimits>,
    preemption: Option<RawPreemption>,
    detach: Option<RawDetach>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDetach {
    to: Scheduler,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFairShare {
    half_life: Option<String>,
    aging: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    gpus: Option<usize>,
    share: Option<String>,
    queued: Option<usize>,
    time_max: Option<String>,
    time_default: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPreemption {
    after: Option<String>,
    grace: Option<String>,
}

/// The policy in force in a lock directory, where it came from and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyInForce {
    /// The file looked at.
    pub path: PathBuf,
    /// What it is: absent, believed, not believed, or not valid.
    pub status: PolicyStatus,
    /// The policy applied: the file's when believed, else first come, first served.
    pub policy: Policy,
    /// The file [`POLICY_ENV`] named and that was not read because the machine has a
    /// policy of its own ([`DEFAULT_POLICY`] exists): no variable replaces it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub variable_ignored: Option<PathBuf>,
}

/// Whether a policy file is in force, and why not.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "status", content = "why")]
pub enum PolicyStatus {
    /// No file: first come, first served.
    Absent,
    /// The file is in force.
    InForce,
    /// The file is there but not believed (its owner or mode), or not valid (a key
    /// unknown, a value wrong): first come, first served, and every view says why.
    Ignored(String),
}

impl PolicyInForce {
    /// The policy's state as one line for users: what is in force and why.
    pub fn summary(&self) -> String {
        let path = self.path.display();
        let summary = match &self.status {
            PolicyStatus::Absent => {
                format!("no policy ({path} does not exist): served first come, first served")
            }
            PolicyStatus::InForce => format!("policy {path}: {}", self.policy),
            PolicyStatus::Ignored(why) => {
                format!("the policy {path} is ignored: {why}; served first come, first served")
            }
        };
        match &self.variable_ignored {
            Some(named) => format!(
                "{summary} ({POLICY_ENV}={} is not read: the machine's policy {path} \
                 is the policy)",
                named.display()
            ),
            None => summary,
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = |d: Duration| tt_device::format_duration(d);
        let mut parts = Vec::new();
        match &self.fair_share {
            Some(fs) => parts.push(format!(
                "fair share by use decayed with a half-life of {}, a request waiting {} \
                 goes ahead of every later one",
                d(fs.half_life),
                d(fs.aging)
            )),
            None => parts.push("first come, first served".into()),
        }
        let l = &self.limits;
        let mut limits = Vec::new();
        if let Some(n) = l.gpus {
            limits.push(format!("{n} GPU(s)"));
        }
        if let Some(b) = l.share {
            limits.push(format!("{b} shared"));
        }
        if let Some(n) = l.queued {
            limits.push(format!("{n} request(s) waiting"));
        }
        if let Some(t) = l.time_max {
            limits.push(format!("--time at most {}", d(t)));
        }
        if let Some(t) = l.time_default {
            limits.push(format!("--time {} when not given", d(t)));
        }
        if !limits.is_empty() {
            parts.push(format!("per user at once: {}", limits.join(", ")));
        }
        if let Some(p) = &self.preemption {
            parts.push(format!(
                "a request waiting {} may preempt a --preemptible job above its user's \
                 share ({} from SIGTERM to SIGKILL)",
                d(p.after),
                d(p.grace)
            ));
        }
        if self.detach == Some(Scheduler::Slurm) {
            parts.push(
                "--detach submits to Slurm (`sbatch`) unless --no-slurm or the user's \
                 config.toml says otherwise"
                    .into(),
            );
        }
        f.write_str(&parts.join("; "))
    }
}

impl LockDir {
    /// The policy in force for this lock directory: [`DEFAULT_POLICY`] where it exists
    /// (no variable replaces the machine's policy), else [`POLICY_ENV`]'s file when
    /// given; believed only when it belongs to root (or, for a file named by
    /// the variable, to this directory's owner) and nobody else can write it. A file not
    /// believed or not valid is ignored, with the reason in [`PolicyInForce::status`].
    pub fn policy(&self) -> PolicyInForce {
        policy_for(self.path())
    }
}

/// [`LockDir::policy`] for the lock directory at `dir`, without opening (or creating)
/// it: for a check made before anything starts.
pub fn policy_for(dir: &Path) -> PolicyInForce {
    let named = std::env::var_os(POLICY_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    policy_at(dir, Path::new(DEFAULT_POLICY), named)
}

/// [`policy_for`] with the machine's policy file at `machine` and `named` the file
/// [`POLICY_ENV`] names.
fn policy_at(dir: &Path, machine: &Path, named: Option<PathBuf>) -> PolicyInForce {
    // The machine's file, whatever it holds (even one not believed), is the policy
    // where it exists: a variable that any user sets never leaves it behind.
    let machine_has_one = std::fs::symlink_metadata(machine).is_ok();
    let (path, given, variable_ignored) = match named {
        Some(p) if machine_has_one && p != machine => (machine.to_owned(), false, Some(p)),
        Some(p) => (p, true, None),
        None => (machine.to_owned(), false, None),
    };
    let dir_owner = std::fs::metadata(dir).ok().map(|m| m.uid());
    let trusted: &[u32] = match (given, dir_owner) {
        (true, Some(owner)) => &[0, owner],
        _ => &[0],
    };
    let (status, policy) = match read_trusted(&path, trusted) {
        Ok(None) => (PolicyStatus::Absent, Policy::default()),
        Ok(Some(text)) => match Policy::parse(&text) {
            Ok(policy) => (PolicyStatus::InForce, policy),
            Err(why) => (PolicyStatus::Ignored(why), Policy::default()),
        },
        Err(why) => (PolicyStatus::Ignored(why), Policy::default()),
    };
    PolicyInForce {
        path,
        status,
        policy,
        variable_ignored,
    }
}

/// A policy file's text when one of `trusted` owns it and no other user can write it;
/// `None` when there is none.
fn read_trusted(path: &Path, trusted: &[u32]) -> Result<Option<String>, String> {
    use crate::Untrusted;
    crate::trusted_text(path, trusted, MAX_POLICY_BYTES).map_err(|why| match why {
        Untrusted::NotRegular => "it is not a regular file".into(),
        Untrusted::Owner(uid) => {
            let owners: Vec<String> = trusted.iter().map(|&u| crate::name_of_uid(u)).collect();
            format!(
                "it belongs to {} (uid {uid}), not to {}: any user could have written it",
                crate::name_of_uid(uid),
                owners.join(" or ")
            )
        }
        Untrusted::Writable(mode) => format!(
            "other users can write it (mode {mode:o}); its owner should run `chmod go-w {}`",
            path.display()
        ),
        Untrusted::TooLarge(max) => {
            format!("it is larger than {max} bytes; a policy is a few lines")
        }
        Untrusted::Io(e) => format!("it cannot be read ({e})"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_issue_example_parses_into_its_values() {
        let policy = Policy::parse(
            r#"
            [fair_share]
            half_life = "7d"
            [limits]
            gpus = 2
            share = "80GiB"
            queued = 20
            time_max = "24h"
            time_default = "8h"
            [preemption]
            after = "30m"
            grace = "2m"
            [detach]
            to = "slurm"
            "#,
        )
        .unwrap();
        let fs = policy.fair_share.as_ref().unwrap();
        assert_eq!(fs.half_life, Duration::from_secs(7 * 86_400));
        assert_eq!(fs.aging, DEFAULT_AGING);
        assert_eq!(policy.limits.gpus, Some(2));
        assert_eq!(policy.limits.share, Some(Bytes::gib(80)));
        assert_eq!(policy.limits.queued, Some(20));
        assert_eq!(policy.limits.time_max, Some(Duration::from_secs(86_400)));
        assert_eq!(
            policy.limits.time_default,
            Some(Duration::from_secs(8 * 3600))
        );
        let p = policy.preemption.as_ref().unwrap();
        assert_eq!(
            (p.after, p.grace),
            (Duration::from_secs(1800), Duration::from_secs(120))
        );
        assert_eq!(policy.detach, Some(Scheduler::Slurm));
        assert!(policy.to_string().contains("--detach submits to Slurm"));
        assert!(policy.orders_the_queue());
        assert!(!Policy::parse("").unwrap().orders_the_queue());
        assert_eq!(Policy::parse("").unwrap().detach, None);
    }

    #[test]
    fn no_variable_replaces_the_machines_policy() {
        let tmp = tempfile::tempdir().unwrap();
        let machine = tmp.path().join("machine.toml");
        let other = tmp.path().join("other.toml");
        std::fs::write(&other, "[limits]\ngpus = 3\n").unwrap();
        let without = policy_at(tmp.path(), &machine, Some(other.clone()));
        std::fs::write(&machine, "[limits]\ngpus = 1\n").unwrap();
        let with = policy_at(tmp.path(), &machine, Some(other.clone()));
        assert_eq!(
            (without.path.as_path(), without.policy.limits.gpus),
            (other.as_path(), Some(3))
        );
        assert_eq!(without.variable_ignored, None);
        assert_eq!(
            (with.path.as_path(), with.policy.limits.gpus),
            (machine.as_path(), Some(1)),
            "{with:?}"
        );
        assert_eq!(with.variable_ignored.as_deref(), Some(other.as_path()));
        assert!(with.summary().contains("is not read"), "{}", with.summary());
    }

    #[test]
    fn a_wrong_key_or_value_is_named() {
        for (text, names) in [
            ("[limits]\ngpu = 2\n", "gpu"),
            ("[fairshare]\n", "fairshare"),
            ("[fair_share]\nhalf_life = \"7 days\"\n", "half_life"),
            ("[fair_share]\naging = \"1h\"\n", "needs half_life"),
            ("[limits]\ngpus = 0\n", "gpus = 0"),
            ("[limits]\nshare = \"lots\"\n", "share"),
            (
                "[limits]\ntime_default = \"2d\"\ntime_max = \"1d\"\n",
                "time_default",
            ),
            ("[preemption]\ngrace = \"1m\"\n", "needs after"),
            ("[limits]\ngpus = -1\n", "gpus"),
            ("[detach]\nto = \"slrum\"\n", "`slurm`"),
            ("[detach]\n", "to"),
        ] {
            let e = Policy::parse(text).err().unwrap_or_default();
            assert!(e.contains(names), "{text:?}: {e}");
        }
    }
}

//! `torchtools policy`: the machine's queueing policy in force and why, and each user's
//! standing under it.

use std::process::ExitCode;

use anyhow::Result;
use tt_lock::{LockDir, PolicyInForce, PolicyStatus, Standing};

/// Show the queueing policy and each user's standing.
///
/// Show the machine's queueing policy (/etc/torchtools/policy.toml; where the
/// machine has none, the file TORCHTOOLS_POLICY names) and why it is in force or ignored, and each user's
/// recent use, GPUs held and requests waiting under it.
///
/// Exits with 1 when a policy file is there but ignored: not owned by root (or,
/// for TORCHTOOLS_POLICY's file, by the lock directory's owner), writable by
/// others, or not valid (the message names the key).
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Prints the policy and the users' standings; exits 1 when a policy file is there but
/// ignored (not believed, or not valid), so that root can check a file it wrote.
pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let dir = LockDir::from_env()?;
    let in_force = dir.policy();
    let queue = dir.queue()?;
    let mut standings: Vec<Standing> = dir
        .standings(&in_force.policy, &queue)?
        .into_values()
        .collect();
    // The heaviest first: a user whose log is not read stands as the heaviest.
    standings.sort_by(|a, b| {
        (b.fraction, b.use_gpu_s)
            .partial_cmp(&(a.fraction, a.use_gpu_s))
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.user.cmp(&b.user))
    });
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "lock_dir": dir.path(),
                "policy": in_force,
                "summary": in_force.summary(),
                "users": standings,
            }))?
        );
    } else {
        print!("{}", policy_text(&in_force, &standings));
    }
    Ok(match in_force.status {
        PolicyStatus::Ignored(_) => ExitCode::FAILURE,
        _ => ExitCode::SUCCESS,
    })
}

/// The policy as users read it, then one line per user with use, holdings and requests.
fn policy_text(in_force: &PolicyInForce, standings: &[Standing]) -> String {
    let mut out = format!("{}\n", tt_device::printable(&in_force.summary()));
    if standings.is_empty() {
        return out;
    }
    let fair = in_force.policy.fair_share.as_ref();
    out.push_str(&match fair {
        Some(fs) => format!(
            "Users (recent use: GPU-hours, each hour counting half after {}):\n",
            tt_device::format_duration(fs.half_life)
        ),
        None => "Users:\n".to_owned(),
    });
    let width = standings
        .iter()
        .map(|s| s.user.chars().count())
        .max()
        .unwrap_or(4)
        .max(4);
    out.push_str(&format!(
        "  {:<width$}  {:>10}  {:>6}  {:>4}  {:>10}  {:>7}\n",
        "user", "use GPU-h", "share", "GPUs", "shared", "waiting"
    ));
    for s in standings {
        out.push_str(&format!(
            "  {:<width$}  {:>10}  {:>5.0}%  {:>4}  {:>10}  {:>7}\n",
            tt_device::printable(&s.user),
            if s.unread.is_some() {
                "not read".to_owned()
            } else {
                format!("{:.1}", s.use_gpu_s / 3600.0)
            },
            s.fraction * 100.0,
            s.gpus,
            if s.shared.0 == 0 {
                "-".to_owned()
            } else {
                s.shared.to_string()
            },
            s.waiting
        ));
    }
    for line in crate::snapshot::over_limit_lines(standings) {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// The lines every view prints under its listing: that a policy file is there but
/// ignored (requests are then served first come, first served), and each user over the
/// policy's limits ([`over_limits`]); none otherwise.
pub(crate) fn say_notes(dir: &LockDir) {
    let in_force = dir.policy();
    if let PolicyStatus::Ignored(_) = in_force.status {
        println!("{}", tt_device::printable(&in_force.summary()));
    }
    for line in over_limits(dir, &in_force) {
        println!("{line}");
    }
}

/// A line for each user who holds more than the policy in force lets one user have at
/// once (`over the policy: tt2 holds 2 GPU(s), over the policy's limit of 1 (pids 7,
/// 8)`), whatever their processes believed the policy was; none without limits.
pub(crate) fn over_limits(dir: &LockDir, in_force: &PolicyInForce) -> Vec<String> {
    if !matches!(in_force.status, PolicyStatus::InForce) || !in_force.policy.limits_apply() {
        return Vec::new();
    }
    let Ok(standings) = dir
        .queue()
        .and_then(|queue| dir.standings(&in_force.policy, &queue))
    else {
        return Vec::new();
    };
    crate::snapshot::over_limit_lines(standings.values())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tt_lock::Policy;

    #[test]
    fn the_text_names_the_file_the_policy_and_each_users_use() {
        let policy = Policy::parse("[fair_share]\nhalf_life = \"7d\"\n[limits]\ngpus = 2\n")
            .unwrap_or_default();
        let in_force = PolicyInForce {
            path: "/etc/torchtools/policy.toml".into(),
            status: PolicyStatus::InForce,
            policy,
            variable_ignored: None,
        };
        let tt2 = Standing {
            user: "tt2".into(),
            use_gpu_s: 1440.0,
            fraction: 0.25,
            gpus: 1,
            waiting: 3,
            ..Standing::default()
        };
        let text = policy_text(&in_force, &[tt2]);
        assert!(
            text.starts_with("policy /etc/torchtools/policy.toml: fair share"),
            "{text}"
        );
        assert!(text.contains("per user at once: 2 GPU(s)"), "{text}");
        assert!(text.contains("after 7d"), "{text}");
        let row = text.lines().last().unwrap_or_default();
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>(),
            ["tt2", "0.4", "25%", "1", "-", "3"]
        );
    }
}

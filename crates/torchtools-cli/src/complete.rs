//! What the shell completes beyond the command line's own words (clap_complete's
//! dynamic completion, `COMPLETE=bash torchtools`): job ids for `logs`, `stop`, `jobs
//! wait`, `--after` and `--after-ok` (this user's jobs first, newest first, then the
//! others'), and GPUs for `--gpu` (nvidia-smi's indices, or the lock files' without
//! NVML, then `auto`). Each is read from the machine when the shell asks; nothing that
//! fails to read is an error there: it completes nothing.

use std::ffi::OsStr;

use clap_complete::engine::{ArgValueCompleter, CompletionCandidate};

/// The completer of an argument naming jobs.
pub(crate) fn jobs() -> ArgValueCompleter {
    ArgValueCompleter::new(job_ids)
}

/// The completer of `--gpu`.
pub(crate) fn gpus() -> ArgValueCompleter {
    ArgValueCompleter::new(gpu_names)
}

/// The job ids that start with `current`: this user's first (newest first, those not
/// ended before those ended), then the other users', and `last`.
fn job_ids(current: &OsStr) -> Vec<CompletionCandidate> {
    let Some(typed) = current.to_str() else {
        return Vec::new();
    };
    let Ok(mut jobs) = crate::jobs::store::records_dir()
        .and_then(|records| crate::jobs::store::all_jobs(&records))
    else {
        return Vec::new();
    };
    let me = tt_lock::euid();
    jobs.retain(|j| j.id.starts_with(typed));
    jobs.sort_by(|a, b| {
        (a.uid != me, a.ended())
            .cmp(&(b.uid != me, b.ended()))
            .then(b.since.0.total_cmp(&a.since.0))
    });
    let mut out: Vec<CompletionCandidate> = jobs
        .iter()
        .map(|j| {
            let help = format!("{} {}", j.user, j.command.join(" "));
            CompletionCandidate::new(j.id.clone())
                .help(Some(tt_device::printable(&help).into_owned().into()))
                .display_order(Some(if j.uid == me { 0 } else { 1 }))
        })
        .collect();
    if "last".starts_with(typed) {
        out.push(
            CompletionCandidate::new("last")
                .help(Some("your newest job".into()))
                .display_order(Some(2)),
        );
    }
    out
}

/// The GPUs `--gpu` takes that start with `current`: nvidia-smi's indices (or, without
/// NVML, those of the lock directory's lock files), then `auto`.
fn gpu_names(current: &OsStr) -> Vec<CompletionCandidate> {
    let Some(typed) = current.to_str() else {
        return Vec::new();
    };
    // After a comma, the next GPU of the list.
    let (done, last) = typed.rsplit_once(',').map_or(("", typed), |(d, l)| (d, l));
    let prefix = if done.is_empty() {
        String::new()
    } else {
        format!("{done},")
    };
    let inventory = tt_device::Inventory::query();
    let mut names: Vec<(String, String)> = inventory
        .gpus
        .iter()
        .map(|g| (g.nvml_index.to_string(), g.name.clone()))
        .collect();
    if names.is_empty() {
        if let Ok(dir) = tt_lock::LockDir::from_env() {
            if let Ok(states) = dir.list() {
                names = states
                    .iter()
                    .filter_map(|s| match &s.gpu {
                        tt_lock::GpuKey::Index(i) => Some((i.to_string(), "lock file".into())),
                        tt_lock::GpuKey::Uuid(_) => None,
                    })
                    .collect();
            }
        }
    }
    names.sort_by_key(|(n, _)| n.parse::<u32>().unwrap_or(u32::MAX));
    names.dedup();
    names.push((
        "auto".into(),
        "the free GPU(s) with the most free memory".into(),
    ));
    names
        .into_iter()
        .filter(|(n, _)| n.starts_with(last))
        .map(|(n, help)| CompletionCandidate::new(format!("{prefix}{n}")).help(Some(help.into())))
        .collect()
}

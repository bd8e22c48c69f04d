//! `--preemptible`: a job that yields its GPUs under the machine's `[preemption]`
//! policy. No daemon decides it, and no user can signal another's processes: the job's
//! own `torchtools` watches the queue and, when a request of a user below their fair
//! share has waited longer than the policy's `after` for one of its GPUs
//! ([`tt_lock::preemptor`], which every reader computes alike), sends its command
//! SIGTERM (a torchtools trainer checkpoints and exits 75, and a `--requeue`d job goes
//! back into the queue), then SIGKILL after the policy's `grace`.

use std::time::Duration;

use tt_lock::{GpuKey, LockDir};

use crate::limit::Beside;

/// How often a preemptible job looks at the queue.
const LOOK_EVERY: Duration = Duration::from_millis(500);

/// Watches the queue for requests that preempt this job, which holds `gpus`;
/// `send(signal)` delivers SIGTERM, then SIGKILL, to its command. [`Beside::finish`]
/// says whether the job was preempted.
pub(crate) fn watch(
    dir: LockDir,
    gpus: Vec<GpuKey>,
    send: impl Fn(i32) + Send + 'static,
) -> Beside {
    let user = tt_lock::Holder::current().who.user;
    Beside::start(move |sleep| loop {
        if !sleep(LOOK_EVERY) {
            return false;
        }
        let Some((why, grace)) = decision(&dir, &user, &gpus) else {
            continue;
        };
        eprintln!(
            "torchtools: preempted: {why}: SIGTERM sent to the command (SIGKILL in {})",
            tt_device::format_duration(grace)
        );
        crate::process::terminate(
            |s| send(s as i32),
            grace,
            |grace| !sleep(grace),
            || {
                eprintln!(
                    "torchtools: the preempted command still runs {} after SIGTERM: SIGKILL",
                    tt_device::format_duration(grace)
                )
            },
        );
        return true;
    })
}

/// Why this job must yield now, and the grace the policy gives it; `None` when it may
/// go on (no `[preemption]` in force, or no request that preempts it).
fn decision(dir: &LockDir, user: &str, gpus: &[GpuKey]) -> Option<(String, Duration)> {
    let in_force = dir.policy();
    let grace = in_force.policy.preemption.as_ref()?.grace;
    let queue = dir.queue().ok()?;
    if queue.is_empty() {
        return None;
    }
    let standings = dir.standings(&in_force.policy, &queue).ok()?;
    let states = dir.list().ok()?;
    let now = tt_device::now_unix_secs();
    tt_lock::preemptor(
        &in_force.policy,
        &queue,
        &standings,
        user,
        gpus,
        &states,
        now,
    )
    .map(|(_, why)| (why, grace))
}

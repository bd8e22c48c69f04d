//! The machine's state at one moment: every GPU's memory, use, lock holder, sharers
//! and processes, the queue in serving order, the policy and each user's standing, and
//! the records not believed. Every view of the machine reads it: `locks` and `queue`
//! (once), `top` (each frame), `metrics` (each scrape) and `serve` (every half second);
//! `top --json` prints it, `serve`'s `/api/state` holds it. The detached jobs are read
//! through it too ([`Snapshot::job_rows`]), beside the locks and the queue it read.

use std::path::PathBuf;

use anyhow::Result;
use serde::Serialize;
use tt_device::{descends_from, Bytes, GpuBackend, NvmlBackend, NvmlStatus};
use tt_lock::{GpuKey, Holder, LockDir, Waiter};

use crate::jobs::store::{LiveJob, Row, Scan};

/// Everything one frame shows.
#[derive(Debug, Serialize)]
pub(crate) struct Snapshot {
    /// The lock directory.
    pub(crate) lock_dir: PathBuf,
    /// When it was taken, in seconds since the Unix epoch.
    pub(crate) time_unix: u64,
    /// Whether NVML could be read, and why not.
    pub(crate) nvml: NvmlStatus,
    /// NVML's GPUs in its order, then lock files of GPUs NVML does not list.
    pub(crate) gpus: Vec<GpuView>,
    /// The requests waiting, first served first.
    pub(crate) queue: Vec<Waiter>,
    /// The queueing policy in force, as one line (`torchtools policy`).
    pub(crate) policy: String,
    /// Whether the policy orders the queue (fair share or per-user limits).
    pub(crate) policy_orders: bool,
    /// Whether a policy file is there but ignored (said under the title).
    pub(crate) policy_ignored: bool,
    /// Each user's standing under the policy (recent use, GPUs held, requests
    /// waiting), most recent use first; empty without a policy that orders the queue.
    pub(crate) users: Vec<tt_lock::Standing>,
    /// Records in the lock directory not believed: each names another user than its
    /// file's owner.
    pub(crate) ignored: Vec<tt_lock::Ignored>,
    /// Every GPU's lock as `torchtools locks` lists it (`gpus` is made from them).
    #[serde(skip)]
    pub(crate) locks: Vec<tt_lock::LockState>,
    /// The policy in force, whole (`policy` is its one line).
    #[serde(skip)]
    pub(crate) policy_in_force: tt_lock::PolicyInForce,
}

/// One GPU: NVML's view of it and its lock.
#[derive(Debug, Serialize)]
pub(crate) struct GpuView {
    pub(crate) key: GpuKey,
    /// NVML's index, when NVML lists it.
    pub(crate) index: Option<u32>,
    pub(crate) name: Option<String>,
    pub(crate) total: Option<Bytes>,
    pub(crate) used: Option<Bytes>,
    pub(crate) free: Option<Bytes>,
    /// Percent of time a kernel ran over the driver's last sample period.
    pub(crate) utilization: Option<u32>,
    /// The lock's holder, when held.
    pub(crate) holder: Option<Holder>,
    /// The jobs sharing it by memory budget (`reserve --share`), oldest first.
    pub(crate) shares: Vec<Holder>,
    /// Processes holding its lock with no reservation record (a bare `flock` on the
    /// lock file): no request for the whole GPU is granted while they do.
    pub(crate) unrecorded: Vec<tt_lock::Locker>,
    /// Queue positions of the requests waiting for this GPU.
    pub(crate) waiting: Vec<usize>,
    pub(crate) processes: Vec<ProcessView>,
}

/// A process using a GPU, as NVML lists it.
#[derive(Debug, Serialize)]
pub(crate) struct ProcessView {
    pub(crate) pid: u32,
    pub(crate) user: String,
    /// Its GPU memory, when the driver can say.
    pub(crate) used: Option<Bytes>,
    pub(crate) command: String,
    /// Whether it is the holder of this GPU's lock or runs under it (or under a job
    /// sharing the GPU).
    pub(crate) in_reservation: bool,
    /// The budget of the sharing job it runs under, if it does.
    pub(crate) share: Option<Bytes>,
    /// Whether that job's processes use more GPU memory than its budget.
    pub(crate) over_share: bool,
}

/// The GPUs, from NVML opened once for the whole session (a test may give any
/// backend).
pub(crate) struct Gpus {
    backend: Box<dyn GpuBackend>,
}

impl Gpus {
    pub(crate) fn open() -> Gpus {
        Gpus::with_backend(Box::new(NvmlBackend::open()))
    }

    /// The GPUs as `backend` answers (a test's injected driver answer).
    pub(crate) fn with_backend(backend: Box<dyn GpuBackend>) -> Gpus {
        Gpus { backend }
    }
}

impl Snapshot {
    /// One frame: the lock directory's view of every GPU (`LockDir::status`: NVML's
    /// GPUs in its order, then lock files of GPUs NVML does not list) with each GPU's
    /// memory, use and processes from the same inventory, and the queue.
    pub(crate) fn take(dir: &LockDir, gpus: &Gpus) -> Result<Snapshot> {
        let inventory = gpus.backend.inventory();
        let queue = dir.queue()?;
        let policy = dir.policy();
        let policy_orders = matches!(policy.status, tt_lock::PolicyStatus::InForce)
            && policy.policy.orders_the_queue();
        let mut users: Vec<tt_lock::Standing> = if policy_orders {
            dir.standings(&policy.policy, &queue)?
                .into_values()
                .collect()
        } else {
            Vec::new()
        };
        users.sort_by(|a, b| {
            b.use_gpu_s
                .total_cmp(&a.use_gpu_s)
                .then(a.user.cmp(&b.user))
        });
        let locks = dir.status(&inventory)?;
        let views = locks
            .iter()
            .cloned()
            .map(|state| {
                let gpu = inventory
                    .gpus
                    .iter()
                    .find(|g| GpuKey::of_uuid(&g.uuid) == state.gpu);
                let holder = state.holder.filter(|_| state.held);
                let roots_of = |h: &Holder| -> Vec<u32> {
                    std::iter::once(h.who.pid).chain(h.command_pid).collect()
                };
                let roots: Vec<u32> = holder.iter().flat_map(roots_of).collect();
                let on_gpu = gpu.map(|g| g.processes.as_slice()).unwrap_or_default();
                // Which sharing job each process runs under, if any (one walk of its
                // ancestry per process).
                let owners: Vec<Option<usize>> = on_gpu
                    .iter()
                    .map(|p| {
                        state
                            .shares
                            .iter()
                            .position(|h| descends_from(p.pid, &roots_of(h)))
                    })
                    .collect();
                let processes: Vec<ProcessView> = on_gpu
                    .iter()
                    .zip(&owners)
                    .map(|(p, &sharer)| ProcessView {
                        pid: p.pid,
                        user: crate::process::user_of(p.pid),
                        used: p.used,
                        command: crate::process::command_of(p.pid),
                        in_reservation: sharer.is_some() || descends_from(p.pid, &roots),
                        share: sharer.and_then(|i| state.shares[i].share),
                        over_share: false,
                    })
                    .collect();
                let processes = flag_over_share(processes, &owners, &state.shares);
                GpuView {
                    waiting: queue
                        .iter()
                        .filter(|w| w.wants.gpus().contains(&state.gpu))
                        .map(|w| w.position)
                        .collect(),
                    key: state.gpu,
                    index: state.nvml_index,
                    name: state.name,
                    total: gpu.map(|g| g.total),
                    used: gpu.map(|g| g.used),
                    free: gpu.map(|g| g.free),
                    utilization: gpu.and_then(|g| g.utilization),
                    processes,
                    holder,
                    shares: state.shares,
                    unrecorded: state.unrecorded,
                }
            })
            .collect();
        Ok(Snapshot {
            lock_dir: dir.path().to_owned(),
            time_unix: tt_device::now_unix_secs(),
            nvml: inventory.nvml,
            gpus: views,
            queue,
            policy: policy.summary(),
            policy_orders,
            policy_ignored: matches!(policy.status, tt_lock::PolicyStatus::Ignored(_)),
            users,
            ignored: dir.ignored()?,
            locks,
            policy_in_force: policy,
        })
    }

    /// The NVML index of the GPU `key` names, when NVML lists it.
    pub(crate) fn nvml_index(&self, key: &GpuKey) -> Option<u32> {
        self.gpus
            .iter()
            .find(|g| g.key == *key)
            .and_then(|g| g.index)
    }

    /// A line for each user who holds more than the policy's limits let one user have
    /// (`over the policy: tt2 holds 2 GPU(s), ...`); none without limits.
    pub(crate) fn over_limits(&self) -> Vec<String> {
        over_limit_lines(&self.users)
    }

    /// Every user's detached jobs as rows (`jobs --all --json`'s), their states read
    /// beside this snapshot's locks and queue, with the records not believed and those
    /// damaged.
    pub(crate) fn job_rows(&self) -> Result<(Vec<Row>, Scan)> {
        let waiting: Vec<u32> = self.queue.iter().map(|w| w.who.pid).collect();
        crate::jobs::store::all_rows(&self.lock_dir, &waiting, &self.locks)
    }

    /// The detached jobs that have not ended, as `metrics` counts them.
    pub(crate) fn live_jobs(&self) -> Result<Vec<LiveJob>> {
        Ok(self.job_rows()?.0.iter().filter_map(LiveJob::of).collect())
    }
}

/// The line of each user in `standings` over the policy's limits (`over the policy:
/// tt2 holds 2 GPU(s), over the policy's limit of 1 (pids 7, 8)`), and of each whose
/// usage log is not read (`not counted: tt2's usage log ... not read: ...`), sorted.
pub(crate) fn over_limit_lines<'a>(
    standings: impl IntoIterator<Item = &'a tt_lock::Standing>,
) -> Vec<String> {
    let mut lines: Vec<String> = standings
        .into_iter()
        .flat_map(|s| {
            let over = s.over_text().map(|t| ("over the policy", t));
            let unread = s.unread_text().map(|t| ("not counted", t));
            over.into_iter().chain(unread)
        })
        .map(|(what, t)| format!("{what}: {}", tt_device::printable(&t)))
        .collect();
    lines.sort();
    lines
}

/// Marks the processes of every sharing job whose processes together use more GPU
/// memory than its budget (`owners[k]`: the job process `k` runs under, if any).
fn flag_over_share(
    mut processes: Vec<ProcessView>,
    owners: &[Option<usize>],
    shares: &[Holder],
) -> Vec<ProcessView> {
    for (i, h) in shares.iter().enumerate() {
        let used: u64 = processes
            .iter()
            .zip(owners)
            .filter(|(_, o)| **o == Some(i))
            .filter_map(|(p, _)| p.used)
            .map(|b| b.0)
            .sum();
        if h.share.is_some_and(|budget| used > budget.0) {
            for (p, o) in processes.iter_mut().zip(owners) {
                if *o == Some(i) {
                    p.over_share = true;
                }
            }
        }
    }
    processes
}

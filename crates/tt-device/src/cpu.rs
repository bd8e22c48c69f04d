//! The CPUs this process may really use: its affinity mask, its cgroup's CPU quota, and
//! `OMP_NUM_THREADS`; and the intra-op thread count for libtorch that follows.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

/// The CPUs a process may use, and the libtorch intra-op thread count that follows.
///
/// libtorch starts one intra-op thread per core it detects, whatever a container's or
/// Slurm's CPU quota says and whatever other users run: on a shared machine its threads
/// then wait for each other (measured in the README: the demo's MLP loop, 2 cores with
/// one busy). [`CpuBudget::threads`] is what this process is allowed:
/// `OMP_NUM_THREADS` when set (your decision wins), else the CPUs of the affinity mask
/// (`taskset`, cpusets, Slurm's binding), capped by the cgroup quota rounded up
/// (`cpu.max`, or `cpu.cfs_quota_us` / `cpu.cfs_period_us` on cgroup v1).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CpuBudget {
    /// CPUs online on the machine.
    pub online: usize,
    /// CPUs in this process's affinity mask, when it can be read.
    pub affinity: Option<usize>,
    /// CPUs' worth of time the cgroup's quota allows (1.5 = 150 ms per 100 ms), when
    /// there is a quota.
    pub quota: Option<f64>,
    /// `OMP_NUM_THREADS`, when set.
    pub omp_num_threads: Option<String>,
    /// The intra-op thread count this process should use.
    pub threads: usize,
    /// Why `threads` is that.
    pub reason: String,
}

impl CpuBudget {
    /// This process's budget, read from the kernel (`sched_getaffinity`, the cgroup
    /// files under `/sys/fs/cgroup`) and the environment.
    pub fn query() -> CpuBudget {
        // SAFETY: sysconf has no preconditions.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        CpuBudget::from_parts(
            usize::try_from(online).unwrap_or(1).max(1),
            affinity_count(),
            cgroup_quota(Path::new("/proc/self/cgroup"), Path::new("/sys/fs/cgroup")),
            std::env::var("OMP_NUM_THREADS").ok(),
        )
    }

    /// The rule, over given readings.
    pub fn from_parts(
        online: usize,
        affinity: Option<usize>,
        quota: Option<f64>,
        omp_num_threads: Option<String>,
    ) -> CpuBudget {
        let mask = affinity.unwrap_or(online).max(1);
        let by_quota = quota.map(|q| (q.ceil() as usize).max(1));
        let omp = omp_num_threads.as_deref().and_then(parse_omp);
        let (threads, reason) = match (omp, by_quota) {
            (Some(n), _) => (
                n,
                format!("OMP_NUM_THREADS={n} (set in the environment, so it is kept)"),
            ),
            (None, Some(q)) if q < mask => (
                q,
                format!(
                    "the cgroup's CPU quota allows {} CPU(s) of the {mask} this process may \
                     run on",
                    quota.map_or_else(String::new, |q| format!("{q:.2}"))
                ),
            ),
            (None, _) => match affinity {
                Some(a) if a < online => (
                    mask,
                    format!("{a} CPU(s) in this process's affinity mask, of {online} online"),
                ),
                _ => (
                    mask,
                    format!("{mask} CPU(s) online, no affinity mask or quota"),
                ),
            },
        };
        if omp_num_threads.is_some() && omp.is_none() {
            // A malformed value is ignored by libtorch too; say so rather than fail.
            tracing::warn!(
                "OMP_NUM_THREADS={:?} is not a positive integer: ignored",
                omp_num_threads.as_deref().unwrap_or_default()
            );
        }
        CpuBudget {
            online,
            affinity,
            quota,
            omp_num_threads,
            threads,
            reason,
        }
    }
}

/// `OMP_NUM_THREADS` from the environment: `None` when unset, an error naming it when
/// it is not a positive integer (libtorch would ignore such a value silently).
pub fn omp_num_threads() -> crate::Result<Option<usize>> {
    match std::env::var("OMP_NUM_THREADS") {
        Err(_) => Ok(None),
        Ok(value) => parse_omp(&value)
            .map(Some)
            .ok_or(crate::Error::InvalidOmpNumThreads { value }),
    }
}

fn parse_omp(value: &str) -> Option<usize> {
    value.trim().parse::<usize>().ok().filter(|&n| n > 0)
}

impl fmt::Display for CpuBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} thread(s): {}", self.threads, self.reason)
    }
}

fn affinity_count() -> Option<usize> {
    // SAFETY: an all-zero cpu_set_t is a valid (empty) set for the kernel to fill.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: set is writable for its size; pid 0 is this thread.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return None;
    }
    // SAFETY: set was filled by the kernel.
    let n = unsafe { libc::CPU_COUNT(&set) };
    usize::try_from(n).ok().filter(|&n| n > 0)
}

/// The smallest CPU quota on this process's cgroup path (a parent's limit binds its
/// children), from `cgroup_file` (`/proc/self/cgroup`) under `root` (`/sys/fs/cgroup`).
pub(crate) fn cgroup_quota(cgroup_file: &Path, root: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(cgroup_file).ok()?;
    let mut best: Option<f64> = None;
    let mut take = |q: Option<f64>| {
        if let Some(q) = q {
            best = Some(best.map_or(q, |b| b.min(q)));
        }
    };
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if controllers.is_empty() {
            // cgroup v2: cpu.max in the process's group and each parent.
            for dir in ancestors(&root.join(path.trim_start_matches('/')), root) {
                take(read_cpu_max(&dir.join("cpu.max")));
            }
        } else if controllers.split(',').any(|c| c == "cpu") {
            // cgroup v1: the cpu controller's hierarchy, mounted as cpu or cpu,cpuacct.
            for mount in ["cpu", "cpu,cpuacct", "cpuacct,cpu"] {
                let base = root.join(mount);
                if !base.is_dir() {
                    continue;
                }
                for dir in ancestors(&base.join(path.trim_start_matches('/')), &base) {
                    take(read_cfs(&dir));
                }
                break;
            }
        }
    }
    best
}

/// `dir` and its parents up to `root`, included.
fn ancestors(dir: &Path, root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut here = Some(dir);
    while let Some(d) = here {
        out.push(d.to_owned());
        if d == root {
            break;
        }
        here = d.parent().filter(|p| p.starts_with(root));
    }
    out
}

/// `cpu.max`: `max 100000` (no quota) or `150000 100000` (1.5 CPUs).
fn read_cpu_max(path: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut fields = text.split_whitespace();
    let quota = fields.next()?;
    let period: f64 = fields.next()?.parse().ok()?;
    if quota == "max" || period <= 0.0 {
        return None;
    }
    let quota: f64 = quota.parse().ok()?;
    (quota > 0.0).then_some(quota / period)
}

/// cgroup v1: `cpu.cfs_quota_us` (-1: none) over `cpu.cfs_period_us`.
fn read_cfs(dir: &Path) -> Option<f64> {
    let read = |name: &str| -> Option<f64> {
        std::fs::read_to_string(dir.join(name))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let quota = read("cpu.cfs_quota_us")?;
    let period = read("cpu.cfs_period_us")?;
    (quota > 0.0 && period > 0.0).then_some(quota / period)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_count_follows_the_environment_then_the_quota_then_the_mask() {
        let b = CpuBudget::from_parts(8, Some(8), None, None);
        assert_eq!(b.threads, 8);
        assert!(b.reason.contains("8 CPU(s) online"), "{}", b.reason);
        let b = CpuBudget::from_parts(64, Some(4), None, None);
        assert_eq!(b.threads, 4);
        assert!(
            b.reason
                .contains("4 CPU(s) in this process's affinity mask, of 64"),
            "{b}"
        );
        let b = CpuBudget::from_parts(64, Some(8), Some(1.5), None);
        assert_eq!(b.threads, 2, "1.5 CPUs of quota: 2 threads");
        assert!(
            b.reason.contains("quota allows 1.50 CPU(s) of the 8"),
            "{b}"
        );
        // A quota larger than the mask does not raise the count.
        assert_eq!(
            CpuBudget::from_parts(64, Some(4), Some(16.0), None).threads,
            4
        );
        // OMP_NUM_THREADS wins; a malformed one is ignored.
        let b = CpuBudget::from_parts(64, Some(4), Some(1.0), Some("3".into()));
        assert_eq!(b.threads, 3);
        assert!(
            b.to_string().starts_with("3 thread(s): OMP_NUM_THREADS=3"),
            "{b}"
        );
        assert_eq!(
            CpuBudget::from_parts(2, None, None, Some("two".into())).threads,
            2
        );
        assert_eq!(CpuBudget::from_parts(2, None, Some(0.2), None).threads, 1);
    }

    #[test]
    fn cgroup_quotas_are_read_from_v2_and_v1_files_and_the_smallest_wins() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let root = tmp.path();
        let write = |rel: &str, text: &str| {
            let p = root.join(rel);
            std::fs::create_dir_all(p.parent().unwrap_or(root)).unwrap_or_else(|e| panic!("{e}"));
            std::fs::write(p, text).unwrap_or_else(|e| panic!("{e}"));
        };
        // v2: the job's group has no quota, its parent (a Slurm job, a container) 2.5.
        write("user.slice/job/cpu.max", "max 100000\n");
        write("user.slice/cpu.max", "250000 100000\n");
        write("cgroup", "0::/user.slice/job\n");
        let q = cgroup_quota(&root.join("cgroup"), root);
        assert_eq!(q, Some(2.5));
        // No quota anywhere.
        write("other/cpu.max", "max 100000\n");
        write("cgroup2", "0::/other\n");
        assert_eq!(cgroup_quota(&root.join("cgroup2"), root), None);
        // v1: the cpu controller's hierarchy.
        write("cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n");
        write("cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
        write(
            "cgroup1",
            "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
        );
        assert_eq!(cgroup_quota(&root.join("cgroup1"), root), Some(0.5));
        assert_eq!(cgroup_quota(&root.join("missing"), root), None);
    }

    #[test]
    fn this_process_budget_agrees_with_the_kernel() {
        let b = CpuBudget::query();
        let mask = affinity_count();
        assert!(mask.is_some());
        assert!(b.threads >= 1 && b.threads <= b.online.max(1) || b.omp_num_threads.is_some());
        // nproc prints the CPUs this process may run on: the affinity mask.
        let nproc = std::process::Command::new("nproc")
            .env_remove("OMP_NUM_THREADS")
            .env_remove("OMP_THREAD_LIMIT")
            .output()
            .unwrap_or_else(|e| panic!("nproc (coreutils): {e}"));
        let n: usize = String::from_utf8_lossy(&nproc.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("nproc printed {:?}: {e}", nproc.stdout));
        assert_eq!(mask, Some(n));
    }
}

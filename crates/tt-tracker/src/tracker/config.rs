//! How to track: the target process and the tracker's settings (and, inside, the
//! facts of the machine fixed with them at the start).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::{RamUnit, TimeUnit};

/// The shortest sampling interval accepted.
pub const MIN_INTERVAL: Duration = Duration::from_millis(10);

/// Which process to track, with its descendants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Target {
    /// This process.
    #[default]
    Current,
    /// Another process.
    Pid(u32),
}

/// How to track.
#[derive(Debug, Clone, PartialEq)]
pub struct TrackerConfig {
    /// Time between samples: default 100 ms, at least [`MIN_INTERVAL`] (10 ms).
    pub interval: Duration,
    /// Unit of RAM figures (default gigabytes, as gpu_tracker).
    pub ram_unit: RamUnit,
    /// Unit of GPU RAM figures (default gigabytes).
    pub gpu_ram_unit: RamUnit,
    /// Unit of the compute time (default hours).
    pub time_unit: TimeUnit,
    /// Cores the job is expected to use: the denominator of the hardware percentages
    /// (default: every core; inside a Slurm job, the job's: `SLURM_CPUS_PER_TASK`, else
    /// `SLURM_CPUS_ON_NODE`).
    pub n_expected_cores: Option<usize>,
    /// GPUs whose utilisation and energy count (default: all; inside a Slurm job, the
    /// job's, by the node's indices: `SLURM_STEP_GPUS`, else `SLURM_JOB_GPUS`).
    pub gpu_uuids: Option<Vec<String>>,
    /// The process to track.
    pub target: Target,
    /// Write every sample here (`.csv`, `.jsonl`; `.sqlite` with the `sqlite` feature).
    pub timeline: Option<PathBuf>,
    /// Replace an existing timeline file.
    pub overwrite: bool,
    /// Keep a decimated series of (time, RAM, GPU RAM, CPU%) for `plot` (feature `plot`).
    pub keep_series: bool,
    /// A memory cgroup directory holding only the tracked tree (`torchtools track`
    /// makes one where it may): its peak is reported beside the RSS peaks.
    pub cgroup: Option<PathBuf>,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        TrackerConfig {
            interval: Duration::from_millis(100),
            ram_unit: RamUnit::Gigabytes,
            gpu_ram_unit: RamUnit::Gigabytes,
            time_unit: TimeUnit::Hours,
            n_expected_cores: None,
            gpu_uuids: None,
            target: Target::Current,
            timeline: None,
            overwrite: false,
            keep_series: false,
            cgroup: None,
        }
    }
}

/// A tracker's configuration with the machine's facts, fixed at the start: what the
/// sampler reads with and the report speaks of.
pub(super) struct Setting {
    pub(super) config: TrackerConfig,
    /// The tracked process.
    pub(super) main: u32,
    pub(super) start: Instant,
    pub(super) cores: usize,
    pub(super) expected_cores: usize,
    /// System RAM, bytes.
    pub(super) system_capacity: u64,
}

/// Inside a Slurm job, the job's part of the node, where the configuration leaves it
/// open: the cores expected (`n_expected_cores` not given) and the GPUs tracked
/// (`gpu_uuids` not given), with the note the report keeps of it.
#[derive(Debug, Default, PartialEq)]
pub(super) struct SlurmShare {
    pub(super) cores: Option<usize>,
    /// The node's indices.
    pub(super) gpus: Option<Vec<u32>>,
    pub(super) note: Option<String>,
}

impl SlurmShare {
    /// Read through `get` (the environment); an error for a variable that does not
    /// say what Slurm writes.
    pub(super) fn read(
        config: &TrackerConfig,
        get: impl Fn(&str) -> Option<String>,
    ) -> crate::Result<SlurmShare> {
        // The GPU variables are read only where `gpu_uuids` leaves the GPUs to them.
        let gpu_var = |name: &str| {
            config.gpu_uuids.is_some()
                && (name == tt_device::SLURM_STEP_GPUS || name == tt_device::SLURM_JOB_GPUS)
        };
        let Some(job) =
            tt_device::SlurmJob::from_lookup(|name| get(name).filter(|_| !gpu_var(name)))?
        else {
            return Ok(SlurmShare::default());
        };
        let mut said = Vec::new();
        let cores = match config.n_expected_cores {
            Some(_) => None,
            None => tt_device::slurm_cpus(&get)?.map(|(n, from)| {
                said.push(format!("its {n} CPU(s) expected ({from}={n})"));
                n
            }),
        };
        let gpus = match (&config.gpu_uuids, job.gpus) {
            (None, Some(gpus)) => {
                said.push(format!("its GPUs tracked ({})", gpus.said()));
                Some(gpus.indices)
            }
            _ => None,
        };
        let note = (!said.is_empty()).then(|| {
            format!(
                "inside Slurm job {}: {} (n_expected_cores and gpu_uuids say otherwise)",
                job.id,
                said.join(", ")
            )
        });
        Ok(SlurmShare { cores, gpus, note })
    }
}

#[cfg(test)]
mod slurm_tests {
    use super::*;

    fn read(config: &TrackerConfig, vars: &[(&str, &str)]) -> crate::Result<SlurmShare> {
        SlurmShare::read(config, |name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn inside_a_slurm_job_the_defaults_are_the_jobs_cpus_and_gpus() {
        let job = [
            ("SLURM_JOB_ID", "41"),
            ("SLURM_CPUS_ON_NODE", "8"),
            ("SLURM_CPUS_PER_TASK", "2"),
            ("SLURM_STEP_GPUS", "1,3"),
        ];
        let share = read(&TrackerConfig::default(), &job).unwrap();
        assert_eq!(
            (share.cores, share.gpus.as_deref()),
            (Some(2), Some(&[1, 3][..]))
        );
        let note = share.note.unwrap_or_default();
        assert!(
            note.contains("Slurm job 41")
                && note.contains("SLURM_CPUS_PER_TASK=2")
                && note.contains("SLURM_STEP_GPUS=1,3"),
            "{note}"
        );
        // What the configuration gives wins; outside Slurm nothing changes.
        let given = TrackerConfig {
            n_expected_cores: Some(4),
            gpu_uuids: Some(vec!["GPU-x".into()]),
            ..TrackerConfig::default()
        };
        assert_eq!(read(&given, &job).unwrap(), SlurmShare::default());
        // A GPU variable the configuration overrides is not read, junk or not.
        let junk_gpus = [("SLURM_JOB_ID", "41"), ("SLURM_STEP_GPUS", "all")];
        assert_eq!(read(&given, &junk_gpus).unwrap(), SlurmShare::default());
        let e = read(&TrackerConfig::default(), &junk_gpus)
            .unwrap_err()
            .to_string();
        assert!(e.contains("SLURM_STEP_GPUS=\"all\""), "{e}");
        assert_eq!(
            read(&TrackerConfig::default(), &job[1..]).unwrap(),
            SlurmShare::default()
        );
        let batch = [("SLURM_JOB_ID", "41"), ("SLURM_CPUS_ON_NODE", "8")];
        assert_eq!(
            read(&TrackerConfig::default(), &batch).unwrap().cores,
            Some(8)
        );
        // A count that is not one: refused, naming the variable.
        let junk = [("SLURM_JOB_ID", "41"), ("SLURM_CPUS_ON_NODE", "all")];
        let e = read(&TrackerConfig::default(), &junk)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("SLURM_CPUS_ON_NODE=\"all\"") && e.contains("number of CPUs"),
            "{e}"
        );
    }
}

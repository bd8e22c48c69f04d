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
    /// (default: every core).
    pub n_expected_cores: Option<usize>,
    /// GPUs whose utilisation and energy count (default: all).
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

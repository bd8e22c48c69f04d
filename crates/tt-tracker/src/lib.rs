//! Track what a process tree uses — RAM (the process and its descendants; total,
//! private and shared RSS), GPU RAM, CPU and GPU utilisation, GPU energy, wall time —
//! with gpu_tracker 5's report (same fields, units, JSON keys and text layout), exact
//! peaks where the kernel keeps them, and a fraction of its cost. No libtorch.
//!
//! - **Exact peaks.** A sampler misses what happens between two samples (gpu_tracker at
//!   its default 1 s reported a 512 MiB, 100 ms spike as 6.8 MB). The kernel keeps
//!   high-water marks: each process's `VmHWM` (reset at the start of tracking through
//!   `clear_refs`), the `ru_maxrss` of a reaped command (`wait4`), and a cgroup's peak.
//!   The report says which method gave each figure
//!   ([`ResourceUsage::torchtools`]`.peak_methods`). Sampling remains for sums across
//!   processes, private/shared RSS, CPU and GPU.
//! - **Cheap sampling.** A sampling thread (not a process), reading per tick only
//!   `/proc/PID/stat` and `status` of each process and the `children` lists of its
//!   threads (no scan of `/proc`); `smaps_rollup` at most once a second per process.
//!   Default interval 100 ms, down to 10 ms.
//! - **GPU** through NVML in process (loaded at run time): per-process memory of the
//!   tree, per-GPU memory and utilisation, energy. No NVML: zeros and one warning.
//! - **Timeline** of every sample ([`TrackerConfig::timeline`]: CSV, JSON Lines,
//!   SQLite), **blocks** ([`Tracker::block`]) summarised in the report, a **plot**
//!   ([`plot`]), and a **comparison** of sessions ([`compare`]).
//! - [`subtrack`]: gpu_tracker's sub-tracking analysis (`sub-track analyze`, `combine`,
//!   `compare`) on both tools' tracking and sub-tracking files, without Python.
//! - [`process`]: the kernel's exact figures for one child — wait for its end without
//!   reaping it, reap it with `wait4`'s peak RSS, read and reset its high-water mark —
//!   shared by `torchtools track` / `reserve` and tt-probe.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tt_tracker::{RamUnit, Tracker, TrackerConfig};
//!
//! let tracker = Tracker::start(TrackerConfig {
//!     interval: Duration::from_millis(20),
//!     ram_unit: RamUnit::Megabytes,
//!     ..TrackerConfig::default()
//! })?;
//! {
//!     let _b = tracker.block("allocate");
//!     let v = vec![1u8; 64 << 20]; // 64 MiB, touched
//!     std::hint::black_box(&v);
//! }
//! let usage = tracker.stop()?;
//! assert!(usage.max_ram.main.total_rss >= 64.0 * 1.048576); // MB
//! println!("{usage}"); // gpu_tracker's text layout
//! let json = serde_json::to_value(&usage)?; // gpu_tracker's keys
//! assert!(json["max_ram"]["main"]["total_rss"].as_f64().is_some());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod compare;
mod error;
mod gpu;
#[cfg(feature = "plot")]
mod plot;
pub mod process;
mod procfs;
pub mod subtrack;
mod timeline;
mod tracker;
mod units;
mod usage;

pub use error::{Error, Result};
#[cfg(feature = "plot")]
pub use plot::plot;
pub use timeline::{check_timeline_path, Sample};
pub use tracker::{Block, SeriesPoint, Target, Tracker, TrackerConfig, MIN_INTERVAL};
pub use units::{RamUnit, TimeUnit};
pub use usage::{
    Additions, BlockSummary, ComputeTime, CpuUtilization, GpuEnergy, GpuUtilization, MaxGpuRam,
    MaxRam, PeakMethods, ProcessingUnitPercentages, ResourceUsage, RssValues, Stat,
};

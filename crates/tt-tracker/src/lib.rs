#![doc = include_str!("../README.md")]
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

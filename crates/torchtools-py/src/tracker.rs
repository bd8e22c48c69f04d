//! gpu_tracker's `Tracker`: tt-tracker sampling this process (or another) on a thread
//! of its own, with exact peaks (the kernel's high-water marks), and its report as
//! gpu_tracker 5 writes it (text and JSON).

use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use tt_tracker::{RamUnit, Target, TimeUnit, TrackerConfig};

use crate::errors::BadRequestError;

/// A tracker, not yet started, running, or stopped with its report.
#[pyclass(module = "torchtools._native")]
pub(crate) struct Tracker {
    config: TrackerConfig,
    state: Mutex<State>,
}

enum State {
    Ready,
    Running(tt_tracker::Tracker),
    Stopped(Box<tt_tracker::ResourceUsage>),
}

fn unit<T: FromStr>(name: &str, value: &str, accepted: &str) -> PyResult<T> {
    value
        .parse()
        .map_err(|_| BadRequestError::new_err(format!("{name}={value:?}: give one of {accepted}")))
}

#[pymethods]
impl Tracker {
    /// gpu_tracker 5's options: `sleep_time` seconds between samples, the units, the
    /// expected cores, the GPUs that count, the process (default this one), a
    /// tracking file (`.csv`, `.sqlite`, `.jsonl`) and whether it may be replaced.
    #[new]
    #[pyo3(signature = (sleep_time, ram_unit, gpu_ram_unit, time_unit, n_expected_cores, gpu_uuids, process_id, tracking_file, overwrite))]
    #[allow(clippy::too_many_arguments)] // gpu_tracker's keyword arguments, one each
    fn new(
        sleep_time: f64,
        ram_unit: &str,
        gpu_ram_unit: &str,
        time_unit: &str,
        n_expected_cores: Option<usize>,
        gpu_uuids: Option<Vec<String>>,
        process_id: Option<u32>,
        tracking_file: Option<std::path::PathBuf>,
        overwrite: bool,
    ) -> PyResult<Tracker> {
        let rams = "bytes, kilobytes, megabytes, gigabytes, terabytes";
        let interval = Duration::try_from_secs_f64(sleep_time)
            .ok()
            .filter(|d| *d >= tt_tracker::MIN_INTERVAL)
            .ok_or_else(|| {
                BadRequestError::new_err(format!(
                    "sleep_time={sleep_time}: give seconds, at least {:?}",
                    tt_tracker::MIN_INTERVAL
                ))
            })?;
        if let Some(path) = &tracking_file {
            tt_tracker::check_timeline_path(path, overwrite)
                .map_err(|e| BadRequestError::new_err(e.to_string()))?;
        }
        let config = TrackerConfig {
            interval,
            ram_unit: unit::<RamUnit>("ram_unit", ram_unit, rams)?,
            gpu_ram_unit: unit::<RamUnit>("gpu_ram_unit", gpu_ram_unit, rams)?,
            time_unit: unit::<TimeUnit>("time_unit", time_unit, "seconds, minutes, hours, days")?,
            n_expected_cores,
            gpu_uuids,
            target: process_id.map_or(Target::Current, Target::Pid),
            timeline: tracking_file,
            overwrite,
            ..TrackerConfig::default()
        };
        Ok(Tracker {
            config,
            state: Mutex::new(State::Ready),
        })
    }

    /// Starts sampling (what it cannot read, NVML say, is in the report's warnings).
    fn start(&self) -> PyResult<()> {
        let mut state = self.lock()?;
        if !matches!(*state, State::Ready) {
            return Err(crate::errors::error(
                "this tracker was started already: make a new one",
            ));
        }
        let tracker =
            tt_tracker::Tracker::start(self.config.clone()).map_err(crate::errors::error)?;
        *state = State::Running(tracker);
        Ok(())
    }

    /// Stops sampling and keeps the report.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let mut state = self.lock()?;
        let tracker = match std::mem::replace(&mut *state, State::Ready) {
            State::Running(t) => t,
            other => {
                *state = other;
                return Err(crate::errors::error(
                    "this tracker is not running: start() it first",
                ));
            }
        };
        let usage = py.detach(|| tracker.stop()).map_err(crate::errors::error)?;
        *state = State::Stopped(Box::new(usage));
        Ok(())
    }

    /// The report as gpu_tracker's text.
    fn text(&self) -> PyResult<String> {
        self.with_report(|u| u.to_string())
    }

    /// The report as gpu_tracker's JSON (its keys and units; torchtools' additions
    /// under `torchtools`).
    fn json(&self) -> PyResult<String> {
        self.with_report(|u| serde_json::to_string(u).unwrap_or_default())
    }
}

impl Tracker {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| crate::errors::error("the tracker was poisoned by a panic"))
    }

    fn with_report<T>(&self, f: impl FnOnce(&tt_tracker::ResourceUsage) -> T) -> PyResult<T> {
        match &*self.lock()? {
            State::Stopped(usage) => Ok(f(usage)),
            _ => Err(crate::errors::error(
                "no report yet: the tracker reports once stopped",
            )),
        }
    }
}

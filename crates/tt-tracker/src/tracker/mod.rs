//! The tracker: [`Tracker`] starts a sampling thread over a process tree and stops it
//! for the report. Inside, one way down: the configuration (`config`), the sampler
//! thread (`sampler`), which folds samples into the accumulators (`peaks`) and, at the
//! stop, hands them to the report (`report`).

mod config;
mod peaks;
mod report;
mod sampler;

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

pub use config::{Target, TrackerConfig, MIN_INTERVAL};
pub use peaks::SeriesPoint;
use report::Finished;
use sampler::{Control, Sampler, Shared};

use crate::timeline::BlockEvent;
use crate::usage::ResourceUsage;
use crate::{procfs, Error, Result};
use tt_device::now_unix;

/// A running tracker: a thread sampling the target's process tree. [`Tracker::stop`]
/// returns the [`ResourceUsage`]; dropping it stops it too (discarding the report).
#[must_use = "dropping the tracker stops it and discards the report: keep it and call stop()"]
pub struct Tracker {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<Result<Finished>>>,
}

/// A named code block being tracked; ends when dropped. See [`Tracker::block`].
#[must_use = "the block ends when it is dropped: bind it (`let _block = ...`) for the code to track"]
pub struct Block {
    shared: Arc<Shared>,
    name: String,
}

/// Queues a block's start (`position` 0) or stop (1) for the sampler.
fn push_event(shared: &Shared, name: &str, position: u8) {
    let mut c = shared.control.lock().unwrap_or_else(|e| e.into_inner());
    c.events.push(BlockEvent {
        process_id: std::process::id(),
        code_block_name: name.to_owned(),
        position,
        timestamp: now_unix(),
    });
}

impl Drop for Block {
    fn drop(&mut self) {
        push_event(&self.shared, &self.name, 1);
    }
}

impl Tracker {
    /// Starts tracking. The first sample is taken before this returns, so that a
    /// target that dies at once is still seen.
    pub fn start(config: TrackerConfig) -> Result<Tracker> {
        if config.interval < MIN_INTERVAL {
            return Err(Error::IntervalTooShort {
                given: config.interval,
            });
        }
        let pid = match config.target {
            Target::Current => std::process::id(),
            Target::Pid(pid) => pid,
        };
        let mut buf = String::new();
        if procfs::stat(pid, &mut buf).is_none() {
            return Err(Error::NoSuchProcess { pid });
        }
        let mut sampler = Sampler::new(config, pid)?;
        sampler.tick()?;
        let shared = Arc::new(Shared {
            control: Mutex::new(Control::default()),
            wake: Condvar::new(),
            samples: std::sync::atomic::AtomicU64::new(0),
        });
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("tt-tracker".into())
            .spawn(move || sampler.run(&thread_shared))
            .map_err(|e| Error::Sampler {
                reason: e.to_string(),
            })?;
        Ok(Tracker {
            shared,
            thread: Some(thread),
        })
    }

    /// Tracks `work` from start to end; returns its result and the usage.
    pub fn run<R>(config: TrackerConfig, work: impl FnOnce() -> R) -> Result<(R, ResourceUsage)> {
        let tracker = Tracker::start(config)?;
        let result = work();
        Ok((result, tracker.stop()?))
    }

    /// Samples recorded so far (the first read is a baseline, not a sample): a way to
    /// show progress, or to wait until the tracker has looked at something.
    pub fn samples(&self) -> u64 {
        self.shared
            .samples
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Marks a named code block from now until the guard drops: its start and stop go
    /// to the timeline, and the report summarises its samples (gpu_tracker's
    /// sub-tracking).
    pub fn block(&self, name: impl Into<String>) -> Block {
        let name = name.into();
        push_event(&self.shared, &name, 0);
        Block {
            shared: Arc::clone(&self.shared),
            name,
        }
    }

    /// Tells the tracker that the tracked command was reaped, with `ru_maxrss` (bytes)
    /// from `wait4` and its exit status: the kernel's exact peak of the command (see
    /// the report's `peak_methods`).
    pub fn target_exited(&self, max_rss_bytes: u64, status: i32) {
        self.target_exited_with_peak(None, max_rss_bytes, status);
    }

    /// [`target_exited`](Self::target_exited) with the command's own high-water mark
    /// read as it exited ([`crate::process::wait_for_exit_with_peak`]): its exact peak,
    /// without the children it reaped (which `ru_maxrss` includes: then the largest
    /// of them, a descendant's peak).
    pub fn target_exited_with_peak(&self, own_peak: Option<u64>, max_rss_bytes: u64, status: i32) {
        let mut c = self
            .shared
            .control
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        c.exit_max_rss = Some(max_rss_bytes);
        c.exit_own_peak = own_peak;
        c.exit_status = Some(status);
    }

    /// Stops tracking (after one last sample) and returns the report.
    pub fn stop(mut self) -> Result<ResourceUsage> {
        self.finish().map(|(usage, _)| usage)
    }

    /// Stops tracking and returns the report and the series kept for plotting
    /// (`keep_series`).
    pub fn stop_with_series(mut self) -> Result<Finished> {
        self.finish()
    }

    fn finish(&mut self) -> Result<Finished> {
        {
            let mut c = self
                .shared
                .control
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            c.stop = true;
        }
        self.shared.wake.notify_all();
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| Error::Sampler {
                reason: "it panicked".into(),
            })?,
            None => Err(Error::Sampler {
                reason: "already stopped".into(),
            }),
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.finish();
        }
    }
}

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::gpu::Gpus;
use crate::procfs::{self, Rollup};
use crate::timeline::{BlockEvent, Sample, StaticData, Timeline};
use crate::usage::{
    Additions, BlockSummary, ComputeTime, CpuUtilization, GpuUtilization, MaxGpuRam, MaxRam,
    PeakMethods, ProcessingUnitPercentages, ResourceUsage, RssValues, Stat,
};
use crate::{Error, RamUnit, Result, TimeUnit};

/// The shortest sampling interval accepted.
pub const MIN_INTERVAL: Duration = Duration::from_millis(10);

/// `smaps_rollup` (private / shared RSS) is read at most this often per process.
const ROLLUP_EVERY: Duration = Duration::from_secs(1);

/// A process's `smaps_rollup` read that took the tracker `cost` of CPU stands for at
/// least `cost` times this: the reads of one process take at most 0.2% of a core. The
/// kernel walks every mapping for it: 8 ms for a Python process with torch imported,
/// whose shared RSS is then read every 4 s instead of every second.
const ROLLUP_COST_FACTOR: u32 = 500;

/// System RAM and CPU (`/proc/meminfo`, `/proc/stat`) are read at most this often.
const SYSTEM_EVERY: Duration = Duration::from_millis(100);

/// The shortest time a process's CPU percent is measured over (the kernel's clock
/// ticks would make shorter ones coarse).
const CPU_WINDOW: Duration = Duration::from_millis(100);

/// Points kept for a plot; neighbours are merged (keeping maxima) beyond it.
const SERIES_POINTS: usize = 4096;

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
    /// Keep a decimated series of (time, RAM, GPU RAM, CPU%) for [`crate::plot`].
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

/// One point of the plotted series: seconds since start, RAM and GPU RAM (bytes,
/// combined), CPU percent (combined sum).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeriesPoint {
    /// Seconds since the start of tracking.
    pub t: f64,
    /// Combined RAM, bytes.
    pub ram: f64,
    /// Combined GPU RAM, bytes.
    pub gpu_ram: f64,
    /// Combined CPU, percent of one core.
    pub cpu: f64,
}

#[derive(Default)]
struct Control {
    stop: bool,
    events: Vec<BlockEvent>,
    exit_max_rss: Option<u64>,
    /// The command's own high-water mark read as it exited (`process::wait_for_exit_with_peak`).
    exit_own_peak: Option<u64>,
    exit_status: Option<i32>,
}

struct Shared {
    control: Mutex<Control>,
    wake: Condvar,
    /// Samples recorded so far (read by [`Tracker::samples`]).
    samples: std::sync::atomic::AtomicU64,
}

/// A running tracker: a thread sampling the target's process tree. [`Tracker::stop`]
/// returns the [`ResourceUsage`]; dropping it stops it too (discarding the report).
#[must_use = "dropping the tracker stops it and discards the report: keep it and call stop()"]
pub struct Tracker {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<Result<Finished>>>,
}

/// What the sampling thread hands back.
type Finished = (ResourceUsage, Vec<SeriesPoint>);

/// The previous sample's time and per-process CPU ticks.
/// The CPU ticks of recent samples, oldest first: one at least [`CPU_WINDOW`] old and
/// those since, so that a percentage is taken over a window, not over one interval
/// (clock ticks count 10 ms: over a 20 ms interval a busy thread reads 50 to 150%).
#[derive(Default)]
struct TickHistory(VecDeque<(Instant, HashMap<u32, u64>)>);

impl TickHistory {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds the readings of `now`, dropping those no longer needed.
    fn push(&mut self, now: Instant, ticks: HashMap<u32, u64>) {
        self.0.push_back((now, ticks));
        while self
            .0
            .get(1)
            .is_some_and(|(at, _)| now.duration_since(*at) >= CPU_WINDOW)
        {
            self.0.pop_front();
        }
    }

    /// The percent of one core `pid` used, from its newest reading at least a window
    /// old (else its oldest) to `ticks` now; `None` before any reading of it.
    fn percent(&self, now: Instant, pid: u32, ticks: u64, per_second: f64) -> Option<f64> {
        let mut reference = None;
        for (at, map) in &self.0 {
            if let Some(p) = map.get(&pid) {
                if reference.is_none() || now.duration_since(*at) >= CPU_WINDOW {
                    reference = Some((*at, *p));
                }
            }
        }
        let (at, p) = reference?;
        let dt = now.duration_since(at).as_secs_f64().max(1e-9);
        Some(ticks.saturating_sub(p) as f64 / per_second / dt * 100.0)
    }
}

/// System-wide figures read at most every [`SYSTEM_EVERY`]: per-core (busy, total)
/// jiffies, the CPU percent over the last window, RAM used.
struct SystemReads {
    at: Instant,
    times: Vec<(u64, u64)>,
    pct: f64,
    used: u64,
}

/// A named code block being tracked; ends when dropped. See [`Tracker::block`].
#[must_use = "the block ends when it is dropped: bind it (`let _block = ...`) for the code to track"]
pub struct Block {
    shared: Arc<Shared>,
    name: String,
}

use tt_device::now_unix;

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
            .map_err(|e| Error::Sampler(e.to_string()))?;
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
            Some(t) => t.join().map_err(|_| Error::Sampler("it panicked".into()))?,
            None => Err(Error::Sampler("already stopped".into())),
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

/// Running min / max / mean / spread of one measure (Welford's update).
#[derive(Clone, Copy)]
struct Running {
    min: f64,
    max: f64,
    n: u64,
    mean: f64,
    /// Sum of squared differences from the mean.
    m2: f64,
}

impl Default for Running {
    fn default() -> Self {
        Running {
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
            n: 0,
            mean: 0.0,
            m2: 0.0,
        }
    }
}

impl Running {
    fn add(&mut self, v: f64) {
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        self.n += 1;
        let delta = v - self.mean;
        self.mean += delta / self.n as f64;
        self.m2 += delta * (v - self.mean);
    }

    /// gpu_tracker's statistics: the population standard deviation (`ddof=0`).
    fn stat(&self) -> Stat {
        Stat {
            min: self.min,
            max: self.max,
            mean: self.mean,
            std: (self.m2 / self.n.max(1) as f64).max(0.0).sqrt(),
        }
    }
}

/// Each measure's running statistics inside a block.
#[derive(Default)]
struct BlockAcc {
    calls: u64,
    seconds: f64,
    samples: u64,
    stats: Vec<Running>,
    open: Vec<f64>,
}

/// The plotted series, at most [`SERIES_POINTS`] points: beyond, neighbours merge
/// (every point then stands for twice as many samples), keeping maxima, so that the
/// plotted peaks are the real ones.
#[derive(Debug)]
struct Decimated {
    points: Vec<SeriesPoint>,
    /// Samples per point.
    stride: usize,
    /// Samples still to merge into the last point.
    pending: usize,
}

impl Default for Decimated {
    fn default() -> Self {
        Decimated {
            points: Vec::new(),
            stride: 1,
            pending: 0,
        }
    }
}

impl Decimated {
    fn push(&mut self, p: SeriesPoint) {
        if self.pending > 0 {
            if let Some(last) = self.points.last_mut() {
                last.ram = last.ram.max(p.ram);
                last.gpu_ram = last.gpu_ram.max(p.gpu_ram);
                last.cpu = last.cpu.max(p.cpu);
            }
            self.pending -= 1;
            return;
        }
        self.points.push(p);
        self.pending = self.stride - 1;
        if self.points.len() >= SERIES_POINTS {
            let merged: Vec<SeriesPoint> = self
                .points
                .chunks(2)
                .map(|c| {
                    let mut m = c[0];
                    for q in &c[1..] {
                        m.ram = m.ram.max(q.ram);
                        m.gpu_ram = m.gpu_ram.max(q.gpu_ram);
                        m.cpu = m.cpu.max(q.cpu);
                    }
                    m
                })
                .collect();
            self.points = merged;
            // The last point now stands for twice as many samples; it still owes the
            // ones its newest half was waiting for (`pending`, unchanged).
            self.stride *= 2;
        }
    }
}

/// Peak and mean of a percentage series.
#[derive(Default, Clone)]
struct Pct {
    max_sum: f64,
    max_hw: f64,
    sum_sum: f64,
    sum_hw: f64,
    n: u64,
}

impl Pct {
    fn add(&mut self, sum: f64, units: usize) -> f64 {
        let hw = sum / units.max(1) as f64;
        self.max_sum = self.max_sum.max(sum);
        self.max_hw = self.max_hw.max(hw);
        self.sum_sum += sum;
        self.sum_hw += hw;
        self.n += 1;
        hw
    }

    fn report(&self) -> ProcessingUnitPercentages {
        let n = self.n.max(1) as f64;
        ProcessingUnitPercentages {
            max_sum_percent: self.max_sum,
            max_hardware_percent: self.max_hw,
            mean_sum_percent: self.sum_sum / n,
            mean_hardware_percent: self.sum_hw / n,
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Rss {
    total: u64,
    private: u64,
    shared: u64,
}

impl Rss {
    fn max(&mut self, other: Rss) {
        self.total = self.total.max(other.total);
        self.private = self.private.max(other.private);
        self.shared = self.shared.max(other.shared);
    }
}

/// Thread counts of the tree (one sample, or the peaks).
#[derive(Default, Clone, Copy)]
struct Threads {
    main: u64,
    descendants: u64,
    combined: u64,
}

impl Threads {
    fn max(&mut self, other: Threads) {
        self.main = self.main.max(other.main);
        self.descendants = self.descendants.max(other.descendants);
        self.combined = self.combined.max(other.combined);
    }
}

/// GPU memory peaks, in bytes.
#[derive(Default, Clone, Copy)]
struct GpuPeaks {
    main: u64,
    descendants: u64,
    combined: u64,
    system: u64,
}

/// CPU utilisation of one sample, as gpu_tracker's sums of per-core percentages.
#[derive(Default, Clone, Copy)]
struct CpuSample {
    system: f64,
    main: f64,
    descendants: f64,
    combined: f64,
}

/// The CPU utilisation series: peaks and means of each.
#[derive(Default, Clone)]
struct CpuSeries {
    system: Pct,
    main: Pct,
    descendants: Pct,
    combined: Pct,
}

/// The process tree at one moment.
/// What the tracked command's end told: `wait4`'s `ru_maxrss`, its own high-water mark
/// read as it exited, its status.
struct Exit {
    max_rss: Option<u64>,
    own_peak: Option<u64>,
    status: Option<i32>,
}

struct TreeReading {
    cpu_ticks: HashMap<u32, u64>,
    main: Rss,
    descendants: Rss,
    combined: Rss,
    threads: Threads,
    alive_descendants: HashSet<u32>,
}

struct Sampler {
    config: TrackerConfig,
    main: u32,
    buf: String,
    tck: f64,
    start: Instant,
    cores: usize,
    expected_cores: usize,
    /// The CPU ticks of recent samples.
    history: TickHistory,
    system: Option<SystemReads>,
    stopping: bool,
    /// Per process: when its `smaps_rollup` was read, its RSS then, what it said, and
    /// the CPU the read took.
    rollups: HashMap<u32, (Instant, u64, Rollup, Duration)>,
    files: HashMap<u32, procfs::ProcFiles>,
    last_full_walk: Option<Instant>,
    /// Highest VmHWM seen per pid, and whether it counts from the start of tracking.
    hwm: HashMap<u32, u64>,
    hwm_reset_failed: HashSet<u32>,
    seen: HashSet<u32>,
    max_main: Rss,
    max_desc: Rss,
    max_comb: Rss,
    max_system: u64,
    system_capacity: u64,
    max_gpu: GpuPeaks,
    threads: Threads,
    cpu: CpuSeries,
    gpu_pct: Pct,
    gpus: Gpus,
    warnings: Vec<String>,
    /// A PID NVML listed that this PID namespace cannot see, the first seen.
    invisible_gpu_pid: Option<u32>,
    timeline: Option<Timeline>,
    /// Samples recorded (live process, real CPU interval).
    samples: u64,
    blocks: BTreeMap<String, BlockAcc>,
    series: Decimated,
}

impl Sampler {
    fn new(config: TrackerConfig, main: u32) -> Result<Sampler> {
        let mut buf = String::new();
        let cores = procfs::cpu_times(&mut buf).len().max(1);
        let (system_capacity, _) = procfs::meminfo(&mut buf);
        let (gpus, gpu_warning) = Gpus::open(config.gpu_uuids.as_deref());
        let expected_cores = config.n_expected_cores.unwrap_or(cores).max(1);
        let (gpu_count, tracked_gpus) = gpus.counts();
        let timeline = match &config.timeline {
            Some(path) => Some(Timeline::create(
                path,
                config.overwrite,
                &StaticData {
                    ram_unit: config.ram_unit.to_string(),
                    gpu_ram_unit: config.gpu_ram_unit.to_string(),
                    time_unit: config.time_unit.to_string(),
                    ram_system_capacity: config.ram_unit.of(system_capacity as f64),
                    gpu_ram_system_capacity: config.gpu_ram_unit.of(gpus.capacity as f64),
                    system_core_count: cores,
                    n_expected_cores: expected_cores,
                    system_gpu_count: gpu_count,
                    n_expected_gpus: tracked_gpus,
                },
            )?),
            None => None,
        };
        let mut hwm_reset_failed = HashSet::new();
        if !procfs::reset_hwm(main) {
            hwm_reset_failed.insert(main);
        }
        Ok(Sampler {
            config,
            main,
            buf,
            tck: procfs::clock_ticks(),
            start: Instant::now(),
            cores,
            expected_cores,
            history: TickHistory::default(),
            system: None,
            stopping: false,
            rollups: HashMap::new(),
            files: HashMap::new(),
            last_full_walk: None,
            hwm: HashMap::new(),
            hwm_reset_failed,
            seen: HashSet::new(),
            max_main: Rss::default(),
            max_desc: Rss::default(),
            max_comb: Rss::default(),
            max_system: 0,
            system_capacity,
            max_gpu: GpuPeaks::default(),
            threads: Threads::default(),
            cpu: CpuSeries::default(),
            gpu_pct: Pct::default(),
            gpus,
            warnings: gpu_warning.into_iter().collect(),
            invisible_gpu_pid: None,
            timeline,
            samples: 0,
            blocks: BTreeMap::new(),
            series: Decimated::default(),
        })
    }

    fn run(mut self, shared: &Shared) -> Result<Finished> {
        let mut next = Instant::now() + self.config.interval;
        loop {
            let (stop, events) = {
                let mut c = shared.control.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    let now = Instant::now();
                    if c.stop || now >= next {
                        break;
                    }
                    c = shared
                        .wake
                        .wait_timeout(c, next - now)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|e| e.into_inner().0);
                }
                (c.stop, std::mem::take(&mut c.events))
            };
            self.events(events)?;
            self.stopping = stop;
            self.tick()?;
            shared
                .samples
                .store(self.samples, std::sync::atomic::Ordering::Release);
            if stop {
                let c = shared.control.lock().unwrap_or_else(|e| e.into_inner());
                let exit = Exit {
                    max_rss: c.exit_max_rss,
                    own_peak: c.exit_own_peak,
                    status: c.exit_status,
                };
                let events = c.events.clone();
                drop(c);
                self.events(events)?;
                return self.report(exit);
            }
            next = next_tick(next, self.config.interval, Instant::now());
        }
    }
}

/// Whether a process's `smaps_rollup` read `age` ago, when its RSS was `rss_moved` bytes
/// away from now's, at a CPU `cost`, still stands: for [`ROLLUP_EVERY`] (or
/// [`ROLLUP_COST_FACTOR`] times its cost, if longer) whatever happens, then for up to
/// ten times that while the RSS stays within 1 MiB of it.
fn rollup_still_stands(age: Duration, rss_moved: u64, cost: Duration) -> bool {
    let every = ROLLUP_EVERY.max(cost.saturating_mul(ROLLUP_COST_FACTOR));
    age < every || (rss_moved < 1 << 20 && age < every.saturating_mul(10))
}

/// The CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec it is given; this clock always exists
    // on Linux.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Which figure the tracked command's peak RSS is: its kernel high-water mark, the
/// largest sampled RSS, or both (the same bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MainPeak {
    HighWaterMark,
    Both,
    Sampled,
}

/// The command's peak from its high-water mark `hwm` (0 when unknown) and its largest
/// sampled RSS. A mark below the sampled peak was read before the RSS grew further, so
/// the sampled figure stands alone then.
fn main_peak(hwm: u64, sampled: u64) -> MainPeak {
    match hwm.cmp(&sampled) {
        std::cmp::Ordering::Greater => MainPeak::HighWaterMark,
        std::cmp::Ordering::Equal if hwm > 0 => MainPeak::Both,
        _ => MainPeak::Sampled,
    }
}

/// Whether the system-wide files are read again at this sample: at the first, at the
/// last (`stopping`), and when [`SYSTEM_EVERY`] has passed since the last read.
fn system_due(last_read: Option<Instant>, now: Instant, stopping: bool) -> bool {
    stopping || last_read.is_none_or(|at| now.duration_since(at) >= SYSTEM_EVERY)
}

/// The system's CPU use between two reads of per-core (busy, total) jiffies, in percent
/// of one core (as psutil's `cpu_percent(percpu=True)` summed, the figure gpu_tracker
/// reports): 2 cores half busy make 100. A core without ticks in between adds 0.
fn system_cpu_percent(before: &[(u64, u64)], after: &[(u64, u64)]) -> f64 {
    after
        .iter()
        .zip(before)
        .map(|((busy, total), (pb, pt))| {
            let dt = total.saturating_sub(*pt);
            if dt == 0 {
                0.0
            } else {
                busy.saturating_sub(*pb) as f64 / dt as f64 * 100.0
            }
        })
        .sum()
}

/// When the sample after the one planned for `planned` is due: one interval later, or,
/// when the sampler fell behind (a busy machine), one interval from `now`: no burst of
/// catch-up samples.
fn next_tick(planned: Instant, interval: Duration, now: Instant) -> Instant {
    let next = planned + interval;
    if next < now {
        now + interval
    } else {
        next
    }
}

impl Sampler {
    /// Block starts and stops: to the timeline, and into the open/closed bookkeeping.
    fn events(&mut self, events: Vec<BlockEvent>) -> Result<()> {
        for e in events {
            if let Some(t) = &mut self.timeline {
                t.block(&e)?;
            }
            let acc = self.blocks.entry(e.code_block_name.clone()).or_default();
            if e.position == 0 {
                acc.open.push(e.timestamp);
            } else if let Some(start) = acc.open.pop() {
                acc.calls += 1;
                acc.seconds += (e.timestamp - start).max(0.0);
            }
        }
        Ok(())
    }

    /// One sample of the whole tree.
    /// One sample: read the tree, the system and the GPUs, fold them into the peaks,
    /// and record the sample (timeline, open blocks, plot series).
    fn tick(&mut self) -> Result<()> {
        let now = Instant::now();
        // The first read is the baseline (no previous CPU ticks yet).
        let first = self.history.is_empty();
        let tree = self.read_tree(now, first);
        self.max_main.max(tree.main);
        self.max_desc.max(tree.descendants);
        self.max_comb.max(tree.combined);
        self.threads.max(tree.threads);
        let (system_used, system_pct) = self.read_system(now);
        self.max_system = self.max_system.max(system_used);
        let cpu = self.cpu_percents(now, &tree.cpu_ticks, system_pct);
        // A sample is recorded only for a live process, and only with CPU figures
        // from a real interval: the first read is the baseline (gpu_tracker's readers
        // would otherwise see a minimum of 0 for CPU, and for RAM and threads after
        // the command exited).
        let emit = !first && tree.cpu_ticks.contains_key(&self.main);
        let hw = if emit {
            CpuSample {
                system: self.cpu.system.add(cpu.system, self.cores),
                main: self.cpu.main.add(cpu.main, self.expected_cores),
                descendants: self
                    .cpu
                    .descendants
                    .add(cpu.descendants, self.expected_cores),
                combined: self.cpu.combined.add(cpu.combined, self.expected_cores),
            }
        } else {
            CpuSample::default()
        };
        let g = self.gpus.sample(self.main, &tree.alive_descendants);
        let (_, tracked) = self.gpus.counts();
        let gpu_hw = if self.gpus.available() && emit {
            self.gpu_pct.add(g.util_sum, tracked)
        } else {
            0.0
        };
        if let Some(pid) = g.invisible {
            self.invisible_gpu_pid.get_or_insert(pid);
        }
        let peaks = &mut self.max_gpu;
        peaks.main = peaks.main.max(g.main);
        peaks.descendants = peaks.descendants.max(g.descendants);
        peaks.combined = peaks.combined.max(g.main + g.descendants);
        peaks.system = peaks.system.max(g.system);
        let TreeReading {
            cpu_ticks,
            main,
            descendants,
            combined,
            threads,
            ..
        } = tree;
        self.history.push(now, cpu_ticks);
        if !emit {
            return Ok(());
        }
        let ram = |b: u64| self.config.ram_unit.of(b as f64);
        let gram = |b: u64| self.config.gpu_ram_unit.of(b as f64);
        let sample = Sample {
            main_ram: ram(main.total),
            descendants_ram: ram(descendants.total),
            combined_ram: ram(combined.total),
            system_ram: ram(system_used),
            main_gpu_ram: gram(g.main),
            descendants_gpu_ram: gram(g.descendants),
            combined_gpu_ram: gram(g.main + g.descendants),
            system_gpu_ram: gram(g.system),
            gpu_sum_utilization_percent: g.util_sum,
            gpu_hardware_utilization_percent: gpu_hw,
            main_n_threads: threads.main,
            descendants_n_threads: threads.descendants,
            combined_n_threads: threads.combined,
            cpu_system_sum_utilization_percent: cpu.system,
            cpu_system_hardware_utilization_percent: hw.system,
            cpu_main_sum_utilization_percent: cpu.main,
            cpu_main_hardware_utilization_percent: hw.main,
            cpu_descendants_sum_utilization_percent: cpu.descendants,
            cpu_descendants_hardware_utilization_percent: hw.descendants,
            cpu_combined_sum_utilization_percent: cpu.combined,
            cpu_combined_hardware_utilization_percent: hw.combined,
            timestamp: now_unix(),
        };
        self.record(&sample)?;
        if self.config.keep_series {
            self.series.push(SeriesPoint {
                t: now.duration_since(self.start).as_secs_f64(),
                ram: combined.total as f64,
                gpu_ram: (g.main + g.descendants) as f64,
                cpu: cpu.combined,
            });
        }
        Ok(())
    }

    /// The tracked process and its descendants: RSS (private / shared), threads and
    /// CPU ticks of each live one; the expensive reads (children of every thread,
    /// `smaps_rollup`, VmHWM) at most about once a second.
    fn read_tree(&mut self, now: Instant, first: bool) -> TreeReading {
        let main = self.main;
        // Children of every thread about once a second; of main threads in between.
        let full_walk = self
            .last_full_walk
            .is_none_or(|at| now.duration_since(at) >= ROLLUP_EVERY);
        if full_walk {
            self.last_full_walk = Some(now);
        }
        let mut descendants = procfs::descendants(main, &mut self.buf, full_walk, &self.files);
        if !full_walk {
            // Keep descendants found by the last full walk (forked by other threads).
            for pid in self.files.keys() {
                if *pid != main && !descendants.contains(pid) {
                    descendants.push(*pid);
                }
            }
        }
        let mut cpu_ticks: HashMap<u32, u64> = HashMap::with_capacity(descendants.len() + 1);
        let mut main_rss = Rss::default();
        let mut desc_rss = Rss::default();
        let mut threads = Threads::default();
        let mut alive_descendants = HashSet::with_capacity(descendants.len());
        for (i, &pid) in std::iter::once(&main).chain(&descendants).enumerate() {
            let is_main = i == 0;
            if let std::collections::hash_map::Entry::Vacant(slot) = self.files.entry(pid) {
                match procfs::ProcFiles::open(pid) {
                    Some(f) => {
                        slot.insert(f);
                    }
                    None => continue, // exited between listing and reading
                }
            }
            // VmHWM (from `status`, the costliest of the small reads): about once a second,
            // and at the last sample. A high-water mark loses nothing while its process
            // lives; the tracked command's is then exact from wait4, this process's from
            // the last sample.
            let want_hwm = full_walk || self.stopping || first;
            let Some((stat, status)) = self
                .files
                .get(&pid)
                .and_then(|f| f.read(&mut self.buf, want_hwm))
            else {
                self.files.remove(&pid); // exited
                continue;
            };
            if stat.exited {
                // A zombie: its memory and threads are gone, and a sample of it would
                // give gpu_tracker's readers a minimum of 0 RAM and one thread.
                self.files.remove(&pid);
                continue;
            }
            if !is_main {
                alive_descendants.insert(pid);
            }
            // A descendant that existed before tracking: its high-water mark (just read)
            // may predate the tracking. It is reset now, and counts from its RSS of now;
            // where it cannot be reset, it is not used.
            let mut peak = status.hwm;
            if self.seen.insert(pid) && !is_main && first {
                if procfs::reset_hwm(pid) {
                    peak = status.rss;
                } else {
                    self.hwm_reset_failed.insert(pid);
                }
            }
            let hwm = self.hwm.entry(pid).or_default();
            *hwm = (*hwm).max(peak);
            cpu_ticks.insert(pid, stat.cpu_ticks);
            let shared = self.shared_rss(pid, now, status.rss);
            let private = status.rss - shared;
            if is_main {
                main_rss = Rss {
                    total: status.rss,
                    private,
                    shared,
                };
                threads.main = stat.threads;
            } else {
                desc_rss.private += private;
                // Pages shared inside the tree are counted once: the largest share.
                desc_rss.shared = desc_rss.shared.max(shared);
                threads.descendants += stat.threads;
            }
        }
        self.rollups.retain(|pid, _| cpu_ticks.contains_key(pid));
        self.files.retain(|pid, _| cpu_ticks.contains_key(pid));
        desc_rss.total = desc_rss.private + desc_rss.shared;
        threads.combined = threads.main + threads.descendants;
        let comb_shared = main_rss.shared.max(desc_rss.shared);
        TreeReading {
            cpu_ticks,
            main: main_rss,
            descendants: desc_rss,
            combined: Rss {
                total: main_rss.private + desc_rss.private + comb_shared,
                private: main_rss.private + desc_rss.private,
                shared: comb_shared,
            },
            threads,
            alive_descendants,
        }
    }

    /// A process's shared RSS, from `smaps_rollup`: the expensive read, at most once a
    /// second, and only when its RSS moved by 1 MiB since (or every 10 s regardless).
    fn shared_rss(&mut self, pid: u32, now: Instant, rss: u64) -> u64 {
        let rollup = match self.rollups.get(&pid) {
            Some((at, last_rss, r, cost))
                if rollup_still_stands(now.duration_since(*at), rss.abs_diff(*last_rss), *cost) =>
            {
                *r
            }
            _ => {
                let before = thread_cpu();
                let r = procfs::smaps_rollup(pid, &mut self.buf).unwrap_or_default();
                let cost = thread_cpu().saturating_sub(before);
                self.rollups.insert(pid, (now, rss, r, cost));
                r
            }
        };
        rollup.shared.min(rss)
    }

    /// System-wide RAM used and CPU percent: kernel-generated files that cost more than
    /// a process's, read at most every SYSTEM_EVERY (and at the last sample).
    fn read_system(&mut self, now: Instant) -> (u64, f64) {
        if system_due(self.system.as_ref().map(|s| s.at), now, self.stopping) {
            let (_, used) = procfs::meminfo(&mut self.buf);
            let times = procfs::cpu_times(&mut self.buf);
            let pct = self
                .system
                .as_ref()
                .map_or(0.0, |prev| system_cpu_percent(&prev.times, &times));
            self.system = Some(SystemReads {
                at: now,
                times,
                pct,
                used,
            });
        }
        self.system.as_ref().map_or((0, 0.0), |s| (s.used, s.pct))
    }

    /// CPU percents of the tree (zero at the baseline read), each process's over the
    /// last [`CPU_WINDOW`] at least: the kernel counts CPU time in clock ticks (10 ms
    /// at 100 Hz), so over one 20 ms interval a single thread could read 50% or 150%.
    fn cpu_percents(&self, now: Instant, ticks: &HashMap<u32, u64>, system: f64) -> CpuSample {
        let mut cpu = CpuSample::default();
        for (pid, t) in ticks {
            if let Some(pct) = self.history.percent(now, *pid, *t, self.tck) {
                if *pid == self.main {
                    cpu.main += pct;
                } else {
                    cpu.descendants += pct;
                }
            }
        }
        cpu.combined = cpu.main + cpu.descendants;
        cpu.system = system;
        cpu
    }

    /// A recorded sample: into the timeline and the statistics of the open blocks.
    fn record(&mut self, sample: &Sample) -> Result<()> {
        self.samples += 1;
        if let Some(t) = &mut self.timeline {
            t.sample(sample)?;
        }
        let measures = sample.measures();
        for acc in self.blocks.values_mut().filter(|a| !a.open.is_empty()) {
            if acc.stats.is_empty() {
                acc.stats = vec![Running::default(); measures.len()];
            }
            for (s, (_, v)) in acc.stats.iter_mut().zip(measures.iter()) {
                s.add(*v);
            }
            acc.samples += 1;
        }
        Ok(())
    }

    fn report(mut self, exit: Exit) -> Result<Finished> {
        let methods = self.final_peaks(&exit);
        if let Some(t) = self.timeline.take() {
            t.finish()?;
        }
        let usage = self.usage(methods, exit.status);
        Ok((usage, std::mem::take(&mut self.series.points)))
    }

    /// The peaks' last figures, from the kernel's high-water marks and the command's
    /// end where they say more than the samples did; how each was measured (main,
    /// descendants, combined).
    fn final_peaks(&mut self, exit: &Exit) -> (String, String, String) {
        let interval = format!("sampled every {:?}", self.config.interval);
        // Main: its kernel high-water mark, when it counts from the start of tracking.
        let mut main_method = interval.clone();
        let main_hwm = if self.hwm_reset_failed.contains(&self.main) {
            0
        } else {
            self.hwm.get(&self.main).copied().unwrap_or(0)
        };
        match main_peak(main_hwm, self.max_main.total) {
            MainPeak::HighWaterMark => {
                self.max_main.total = main_hwm;
                main_method = "VmHWM (the kernel's high-water mark, reset at start)".into();
            }
            MainPeak::Both => {
                main_method =
                    "VmHWM (the kernel's high-water mark, reset at start) = sampled".into();
            }
            MainPeak::Sampled => {}
        }
        let desc_hwm = self
            .hwm
            .iter()
            .filter(|(pid, _)| **pid != self.main && !self.hwm_reset_failed.contains(pid))
            .map(|(_, h)| *h)
            .max()
            .unwrap_or(0);
        let mut desc_method = format!("{interval} (sum over descendants)");
        if desc_hwm > self.max_desc.total {
            self.max_desc.total = desc_hwm;
            desc_method = format!("{interval}, raised to the largest descendant's VmHWM");
        }
        // wait4's ru_maxrss is the largest of the command (with the image it had before
        // exec), and the descendants it reaped.
        let had_descendants = self.seen.iter().any(|p| *p != self.main);
        match (exit.own_peak, exit.max_rss) {
            (Some(own), max_rss) => {
                if own >= self.max_main.total {
                    self.max_main.total = own;
                    main_method = "VmHWM read as it exited (ptrace's exit stop): its own".into();
                }
                // Above its own peak, ru_maxrss is a descendant's.
                if let Some(m) = max_rss.filter(|m| *m > own && *m > self.max_desc.total) {
                    self.max_desc.total = m;
                    desc_method =
                        "wait4 ru_maxrss (the largest descendant the command reaped)".into();
                }
            }
            (None, Some(max_rss)) if !had_descendants && max_rss > self.max_main.total => {
                self.max_main.total = max_rss;
                main_method = "wait4 ru_maxrss (the kernel's peak of the reaped command)".into();
            }
            _ => {}
        }
        let mut comb_method = format!("{interval} (per-sample sum, shared pages once)");
        let floor = self.max_main.total.max(self.max_desc.total);
        if floor > self.max_comb.total {
            self.max_comb.total = floor;
            comb_method = format!("{interval}, raised to the main / descendants peak");
        }
        (main_method, desc_method, comb_method)
    }

    /// The report: every figure in the configuration's units, with how the peaks were
    /// measured.
    fn usage(
        &mut self,
        (main_method, desc_method, comb_method): (String, String, String),
        exit_status: Option<i32>,
    ) -> ResourceUsage {
        let interval = format!("sampled every {:?}", self.config.interval);
        let cgroup_peak = self.config.cgroup.as_ref().and_then(|dir| {
            ["memory.peak", "memory.max_usage_in_bytes"]
                .iter()
                .find_map(|f| std::fs::read_to_string(dir.join(f)).ok())
                .and_then(|t| t.trim().parse::<u64>().ok())
        });
        let elapsed = self.start.elapsed().as_secs_f64();
        let ram = |b: u64| self.config.ram_unit.of(b as f64);
        let gram = |b: u64| self.config.gpu_ram_unit.of(b as f64);
        let rss = |r: Rss| RssValues {
            total_rss: ram(r.total),
            private_rss: ram(r.private),
            shared_rss: ram(r.shared),
        };
        let (gpu_count, tracked) = self.gpus.counts();
        let names: Vec<&'static str> = Sample::default().measures().iter().map(|m| m.0).collect();
        let blocks = std::mem::take(&mut self.blocks)
            .into_iter()
            .map(|(name, acc)| BlockSummary {
                name,
                calls: acc.calls,
                seconds: acc.seconds,
                samples: acc.samples,
                measures: acc
                    .stats
                    .iter()
                    .zip(&names)
                    .map(|(running, n)| ((*n).to_owned(), running.stat()))
                    .collect(),
            })
            .collect();
        let usage = ResourceUsage {
            max_ram: MaxRam {
                unit: self.config.ram_unit,
                system_capacity: ram(self.system_capacity),
                system: ram(self.max_system),
                main: rss(self.max_main),
                descendants: rss(self.max_desc),
                combined: rss(self.max_comb),
            },
            max_gpu_ram: MaxGpuRam {
                unit: self.config.gpu_ram_unit,
                system_capacity: gram(self.gpus.capacity),
                system: gram(self.max_gpu.system),
                main: gram(self.max_gpu.main),
                descendants: gram(self.max_gpu.descendants),
                combined: gram(self.max_gpu.combined),
            },
            cpu_utilization: CpuUtilization {
                system_core_count: self.cores,
                n_expected_cores: self.expected_cores,
                system: self.cpu.system.report(),
                main: self.cpu.main.report(),
                descendants: self.cpu.descendants.report(),
                combined: self.cpu.combined.report(),
                main_n_threads: self.threads.main,
                descendants_n_threads: self.threads.descendants,
                combined_n_threads: self.threads.combined,
            },
            gpu_utilization: GpuUtilization {
                system_gpu_count: gpu_count,
                n_expected_gpus: tracked,
                gpu_percentages: self.gpu_pct.report(),
            },
            compute_time: ComputeTime {
                unit: self.config.time_unit,
                time: self.config.time_unit.of(elapsed),
            },
            torchtools: Additions {
                peak_methods: PeakMethods {
                    main: main_method,
                    descendants: desc_method,
                    combined: comb_method,
                    gpu: if self.gpus.available() {
                        format!("NVML per-process memory, {interval}")
                    } else {
                        "no NVML: 0".into()
                    },
                },
                samples: self.samples,
                interval_seconds: self.config.interval.as_secs_f64(),
                energy: self.gpus.energy(),
                cgroup_peak: cgroup_peak.map(ram),
                exit_status,
                blocks,
                warnings: {
                    let mut warnings = std::mem::take(&mut self.warnings);
                    let attributed = self.max_gpu.main + self.max_gpu.descendants;
                    warnings.extend(
                        self.invisible_gpu_pid
                            .and_then(|pid| crate::gpu::invisible_pid_note(pid, attributed)),
                    );
                    warnings
                },
            },
        };
        usage
    }
}

#[cfg(test)]
mod running_tests {
    use super::{
        next_tick, rollup_still_stands, system_cpu_percent, system_due, thread_cpu, Decimated,
        Running, SeriesPoint, TickHistory, ROLLUP_EVERY, SERIES_POINTS, SYSTEM_EVERY,
    };
    use std::collections::HashMap;
    use std::time::{Duration, Instant};

    #[test]
    fn samples_keep_their_schedule_and_a_late_one_does_not_cause_a_burst() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // On time, or due exactly now: the next one interval after the planned one.
        assert_eq!(next_tick(t0, ms(100), t0 + ms(30)), t0 + ms(100));
        assert_eq!(next_tick(t0, ms(100), t0 + ms(100)), t0 + ms(100));
        // Fell behind past the next one: one interval from now, not at once.
        assert_eq!(next_tick(t0, ms(100), t0 + ms(250)), t0 + ms(350));
    }

    #[test]
    fn the_commands_peak_is_credited_to_the_figure_that_holds_it() {
        use super::{main_peak, MainPeak};
        assert_eq!(main_peak(5 << 20, 4 << 20), MainPeak::HighWaterMark);
        assert_eq!(main_peak(5 << 20, 0), MainPeak::HighWaterMark);
        assert_eq!(main_peak(4 << 20, 4 << 20), MainPeak::Both);
        // A mark read before the RSS grew further is not the peak, and no mark is none.
        assert_eq!(main_peak(3 << 20, 4 << 20), MainPeak::Sampled);
        assert_eq!(main_peak(0, 4 << 20), MainPeak::Sampled);
        assert_eq!(main_peak(0, 0), MainPeak::Sampled);
    }

    #[test]
    fn a_shared_memory_reading_stands_a_second_then_while_the_rss_holds_for_ten() {
        let mib = 1u64 << 20;
        let ms = Duration::from_millis;
        let cheap = Duration::from_micros(100);
        // Within the first second: whatever the RSS did.
        assert!(rollup_still_stands(ms(0), 100 * mib, cheap));
        assert!(rollup_still_stands(ROLLUP_EVERY - ms(1), mib, cheap));
        // From one second on: only while the RSS stayed within 1 MiB.
        assert!(!rollup_still_stands(ROLLUP_EVERY, mib, cheap));
        assert!(rollup_still_stands(ROLLUP_EVERY, mib - 1, cheap));
        assert!(rollup_still_stands(ROLLUP_EVERY, 0, cheap));
        assert!(!rollup_still_stands(ROLLUP_EVERY * 5, 2 * mib, cheap));
        // And never past ten seconds.
        assert!(rollup_still_stands(ROLLUP_EVERY * 10 - ms(1), 0, cheap));
        assert!(!rollup_still_stands(ROLLUP_EVERY * 10, 0, cheap));
    }

    #[test]
    fn a_costly_shared_memory_reading_stands_longer() {
        let mib = 1u64 << 20;
        let ms = Duration::from_millis;
        // 8 ms of CPU (a Python process with torch imported): 4 s whatever the RSS did, and
        // up to 40 s while it holds; 0.2% of a core.
        let costly = ms(8);
        assert!(rollup_still_stands(ms(3999), 100 * mib, costly));
        assert!(!rollup_still_stands(ms(4000), mib, costly));
        assert!(rollup_still_stands(ms(39_999), 0, costly));
        assert!(!rollup_still_stands(ms(40_000), 0, costly));
        // The reads' share of a core stays within 0.2%.
        let share = costly.as_secs_f64() / ms(4000).as_secs_f64();
        assert!(share <= 0.002, "{share}");
    }

    #[test]
    fn this_thread_s_cpu_time_counts_its_work_only() {
        let before = thread_cpu();
        std::thread::sleep(Duration::from_millis(50));
        let asleep = thread_cpu() - before;
        let before = thread_cpu();
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < Duration::from_millis(50) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let busy = thread_cpu() - before;
        assert!(asleep < Duration::from_millis(20), "{asleep:?} asleep");
        assert!(busy > asleep, "{busy:?} busy, {asleep:?} asleep");
    }

    #[test]
    fn the_system_files_are_read_first_last_and_once_per_period_between() {
        let t0 = Instant::now();
        assert!(system_due(None, t0, false), "the first sample reads them");
        let soon = t0 + SYSTEM_EVERY / 2;
        assert!(!system_due(Some(t0), soon, false), "kept within the period");
        assert!(
            system_due(Some(t0), soon, true),
            "the last sample reads them"
        );
        assert!(
            system_due(Some(t0), t0 + SYSTEM_EVERY, false),
            "due at the period"
        );
        assert!(system_due(Some(t0), t0 + SYSTEM_EVERY * 3, false));
    }

    #[test]
    fn the_system_cpu_percent_is_per_core_busy_over_elapsed_summed() {
        // Core 0: 30 of 40 ticks busy (75%); core 1: 10 of 40 (25%); core 2: no tick
        // elapsed (0, not NaN).
        let before = [(100, 1000), (50, 500), (7, 70)];
        let after = [(130, 1040), (60, 540), (7, 70)];
        assert_eq!(system_cpu_percent(&before, &after), 100.0);
        // All cores idle in between: 0; no earlier read to compare with: 0.
        assert_eq!(system_cpu_percent(&after, &after), 0.0);
        assert_eq!(system_cpu_percent(&[], &after), 0.0);
        // A counter that went back (a core brought back online) counts as no time.
        assert_eq!(system_cpu_percent(&after, &before[..1]), 0.0);
    }

    #[test]
    fn the_plotted_series_stays_small_evenly_spaced_and_keeps_the_peaks() {
        let mut d = Decimated::default();
        let n = 10_000;
        for i in 0..n {
            d.push(SeriesPoint {
                t: i as f64,
                ram: (i % 97) as f64,
                gpu_ram: i as f64,
                cpu: if i == 6_001 { 500.0 } else { 1.0 },
            });
        }
        let p = &d.points;
        assert!(
            p.len() < SERIES_POINTS && p.len() >= SERIES_POINTS / 4,
            "{}",
            p.len()
        );
        assert_eq!(p[0].t, 0.0);
        // Every point stands for `stride` samples: the first sample's time, spaced evenly.
        let stride = d.stride as f64;
        assert!(d.stride > 1 && d.stride.is_power_of_two(), "{}", d.stride);
        for w in p.windows(2) {
            assert_eq!(w[1].t - w[0].t, stride, "{w:?}");
        }
        let last = p[p.len() - 1];
        assert!(
            last.t <= (n - 1) as f64 && last.t + stride > (n - 1) as f64,
            "{last:?}"
        );
        // The peaks survive the merging.
        let max = |f: fn(&SeriesPoint) -> f64| p.iter().map(f).fold(f64::MIN, f64::max);
        assert_eq!(max(|q| q.cpu), 500.0);
        assert_eq!(max(|q| q.ram), 96.0);
        assert_eq!(max(|q| q.gpu_ram), (n - 1) as f64);
    }

    #[test]
    fn cpu_percentages_are_taken_over_a_window_not_one_interval() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut h = TickHistory::default();
        assert!(h.is_empty());
        assert_eq!(h.percent(at(0), 7, 0, 100.0), None);
        // Samples every 20 ms; process 7 idle, then 5 ticks (50 ms of CPU) at 200 ms.
        for ms in (0..=180).step_by(20) {
            h.push(at(ms), HashMap::from([(7, 0)]));
        }
        let pct = h.percent(at(200), 7, 5, 100.0).unwrap_or(f64::NAN);
        // Over the window (the reading at 100 ms): 50 ms in 100 ms. Over the last
        // interval alone it would read 250%.
        assert!((pct - 50.0).abs() < 1e-9, "{pct}");
        // Only one reading older than the window is kept.
        h.push(at(200), HashMap::from([(7, 5)]));
        assert_eq!(h.0.len(), 6, "the readings at 100..=200 ms");
        // A process first seen within the window: from its oldest reading.
        h.push(at(220), HashMap::from([(7, 5), (8, 10)]));
        let pct = h.percent(at(240), 8, 12, 100.0).unwrap_or(f64::NAN);
        assert!((pct - 100.0).abs() < 1e-9, "{pct}");
    }

    #[test]
    fn block_statistics_are_gpu_trackers() {
        let mut r = Running::default();
        for v in [1.0, 2.0, 3.0, 4.0, 1e9] {
            r.add(v);
        }
        let s = r.stat();
        // numpy: np.std([1, 2, 3, 4, 1e9]) (ddof=0, as gpu_tracker's analysis).
        let mean = (10.0 + 1e9) / 5.0;
        let var = [1.0, 2.0, 3.0, 4.0, 1e9]
            .iter()
            .map(|v: &f64| (v - mean).powi(2))
            .sum::<f64>()
            / 5.0;
        assert_eq!((s.min, s.max), (1.0, 1e9));
        assert!((s.mean - mean).abs() < 1e-6);
        assert!(
            (s.std - var.sqrt()).abs() / var.sqrt() < 1e-12,
            "{} vs {}",
            s.std,
            var.sqrt()
        );
    }
}

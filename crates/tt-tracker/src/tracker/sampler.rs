//! The sampling thread: reads the tracked process tree, the system and the GPUs at
//! each interval, folds them into the [`Peaks`] and records each sample (timeline,
//! blocks, plot); at the stop, hands them to the report.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use tt_device::now_unix;

use super::config::{Setting, SlurmShare, TrackerConfig};
use super::peaks::{CpuSample, Peaks, Rss, Running, SeriesPoint, Threads};
use super::report::{self, Exit, Finished};
use crate::gpu::Gpus;
use crate::procfs::{self, Rollup};
use crate::timeline::{BlockEvent, Sample, StaticData, Timeline};
use crate::Result;

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

#[derive(Default)]
pub(super) struct Control {
    pub(super) stop: bool,
    pub(super) events: Vec<BlockEvent>,
    pub(super) exit_max_rss: Option<u64>,
    /// The command's own high-water mark read as it exited (`process::wait_for_exit_with_peak`).
    pub(super) exit_own_peak: Option<u64>,
    pub(super) exit_status: Option<i32>,
}

pub(super) struct Shared {
    pub(super) control: Mutex<Control>,
    pub(super) wake: Condvar,
    /// Samples recorded so far (read by [`Tracker::samples`]).
    pub(super) samples: std::sync::atomic::AtomicU64,
}

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

/// The process tree at one moment: each live process's CPU ticks, the RSS of the
/// tracked process, of its descendants and of both, their threads.
struct TreeReading {
    cpu_ticks: HashMap<u32, u64>,
    main: Rss,
    descendants: Rss,
    combined: Rss,
    threads: Threads,
    alive_descendants: HashSet<u32>,
}

/// The sampling thread's state: what it reads with, and the [`Peaks`] it folds into.
pub(super) struct Sampler {
    /// The settings and facts the report needs too.
    setting: Setting,
    buf: String,
    tck: f64,
    /// The CPU ticks of recent samples.
    history: TickHistory,
    system: Option<SystemReads>,
    stopping: bool,
    /// Per process: when its `smaps_rollup` was read, its RSS then, what it said, and
    /// the CPU the read took.
    rollups: HashMap<u32, (Instant, u64, Rollup, Duration)>,
    files: HashMap<u32, procfs::ProcFiles>,
    last_full_walk: Option<Instant>,
    gpus: Gpus,
    warnings: Vec<String>,
    timeline: Option<Timeline>,
    peaks: Peaks,
}

impl Sampler {
    pub(super) fn new(config: TrackerConfig, main: u32) -> Result<Sampler> {
        let mut buf = String::new();
        let cores = procfs::cpu_times(&mut buf).len().max(1);
        let (system_capacity, _) = procfs::meminfo(&mut buf);
        let slurm = SlurmShare::read(&config, |name| std::env::var(name).ok())?;
        let (gpus, gpu_warning) = Gpus::open(config.gpu_uuids.as_deref(), slurm.gpus.as_deref());
        let expected_cores = config
            .n_expected_cores
            .or(slurm.cores)
            .unwrap_or(cores)
            .max(1);
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
        let mut peaks = Peaks::default();
        if !procfs::reset_hwm(main) {
            peaks.hwm_reset_failed.insert(main);
        }
        Ok(Sampler {
            setting: Setting {
                config,
                main,
                start: Instant::now(),
                cores,
                expected_cores,
                system_capacity,
            },
            buf,
            tck: procfs::clock_ticks(),
            history: TickHistory::default(),
            system: None,
            stopping: false,
            rollups: HashMap::new(),
            files: HashMap::new(),
            last_full_walk: None,
            gpus,
            warnings: slurm.note.into_iter().chain(gpu_warning).collect(),
            timeline,
            peaks,
        })
    }

    /// The sampling thread's loop: a sample every interval (and at once when woken
    /// to stop), block events as they come; at the stop, the report.
    pub(super) fn run(mut self, shared: &Shared) -> Result<Finished> {
        let mut next = Instant::now() + self.setting.config.interval;
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
                .store(self.peaks.samples, std::sync::atomic::Ordering::Release);
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
                if let Some(t) = self.timeline.take() {
                    t.finish()?;
                }
                return Ok(report::finish(
                    self.setting,
                    self.peaks,
                    &self.gpus,
                    self.warnings,
                    exit,
                ));
            }
            next = next_tick(next, self.setting.config.interval, Instant::now());
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
            let acc = self
                .peaks
                .blocks
                .entry(e.code_block_name.clone())
                .or_default();
            if e.position == 0 {
                acc.open.push(e.timestamp);
            } else if let Some(start) = acc.open.pop() {
                acc.calls += 1;
                acc.seconds += (e.timestamp - start).max(0.0);
            }
        }
        Ok(())
    }

    /// One sample: read the tree, the system and the GPUs, fold them into the peaks,
    /// and record the sample (timeline, open blocks, plot series).
    pub(super) fn tick(&mut self) -> Result<()> {
        let now = Instant::now();
        // The first read is the baseline (no previous CPU ticks yet).
        let first = self.history.is_empty();
        let tree = self.read_tree(now, first);
        self.peaks.main.max(tree.main);
        self.peaks.descendants.max(tree.descendants);
        self.peaks.combined.max(tree.combined);
        self.peaks.threads.max(tree.threads);
        let (system_used, system_pct) = self.read_system(now);
        self.peaks.system = self.peaks.system.max(system_used);
        let cpu = self.cpu_percents(now, &tree.cpu_ticks, system_pct);
        // A sample is recorded only for a live process, and only with CPU figures
        // from a real interval: the first read is the baseline (gpu_tracker's readers
        // would otherwise see a minimum of 0 for CPU, and for RAM and threads after
        // the command exited).
        let emit = !first && tree.cpu_ticks.contains_key(&self.setting.main);
        let hw = if emit {
            self.peaks
                .cpu
                .add(cpu, self.setting.cores, self.setting.expected_cores)
        } else {
            CpuSample::default()
        };
        let g = self.gpus.sample(self.setting.main, &tree.alive_descendants);
        let (_, tracked) = self.gpus.counts();
        let gpu_hw = if self.gpus.available() && emit {
            self.peaks.gpu_pct.add(g.util_sum, tracked)
        } else {
            0.0
        };
        if let Some(pid) = g.invisible {
            self.peaks.invisible_gpu_pid.get_or_insert(pid);
        }
        self.peaks.gpu.max(g.main, g.descendants, g.system);
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
        let ram = |b: u64| self.setting.config.ram_unit.of(b as f64);
        let gram = |b: u64| self.setting.config.gpu_ram_unit.of(b as f64);
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
        if self.setting.config.keep_series {
            self.peaks.series.push(SeriesPoint {
                t: now.duration_since(self.setting.start).as_secs_f64(),
                ram: combined.total as f64,
                gpu_ram: (g.main + g.descendants) as f64,
                cpu: cpu.combined,
            });
        }
        Ok(())
    }

    /// The tracked process's descendants, and whether this was a full walk: children of
    /// every thread about once a second, of main threads in between (keeping those the
    /// last full walk found, forked by other threads).
    fn descendants(&mut self, now: Instant) -> (Vec<u32>, bool) {
        let main = self.setting.main;
        let full_walk = self
            .last_full_walk
            .is_none_or(|at| now.duration_since(at) >= ROLLUP_EVERY);
        if full_walk {
            self.last_full_walk = Some(now);
        }
        let mut descendants = procfs::descendants(main, &mut self.buf, full_walk, &self.files);
        if !full_walk {
            for pid in self.files.keys() {
                if *pid != main && !descendants.contains(pid) {
                    descendants.push(*pid);
                }
            }
        }
        (descendants, full_walk)
    }

    /// The tracked process and its descendants: RSS (private / shared), threads and
    /// CPU ticks of each live one; the expensive reads (children of every thread,
    /// `smaps_rollup`, VmHWM) at most about once a second.
    fn read_tree(&mut self, now: Instant, first: bool) -> TreeReading {
        let main = self.setting.main;
        let (descendants, full_walk) = self.descendants(now);
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
            if self.peaks.seen.insert(pid) && !is_main && first {
                if procfs::reset_hwm(pid) {
                    peak = status.rss;
                } else {
                    self.peaks.hwm_reset_failed.insert(pid);
                }
            }
            let hwm = self.peaks.hwm.entry(pid).or_default();
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
                if *pid == self.setting.main {
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
        self.peaks.samples += 1;
        if let Some(t) = &mut self.timeline {
            t.sample(sample)?;
        }
        let measures = sample.measures();
        for acc in self
            .peaks
            .blocks
            .values_mut()
            .filter(|a| !a.open.is_empty())
        {
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
}

#[cfg(test)]
mod tests {
    use super::{
        next_tick, rollup_still_stands, system_cpu_percent, system_due, thread_cpu, TickHistory,
        ROLLUP_EVERY, SYSTEM_EVERY,
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
}

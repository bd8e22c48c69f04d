//! What the samples fold into: peaks, running statistics, the plotted series. Plain
//! accumulators, fed by the sampler and read by the report.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::usage::{ProcessingUnitPercentages, Stat};

/// Points kept for a plot; neighbours are merged (keeping maxima) beyond it.
pub(super) const SERIES_POINTS: usize = 4096;

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

/// Running min / max / mean / spread of one measure (Welford's update).
#[derive(Clone, Copy)]
pub(super) struct Running {
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
    pub(super) fn add(&mut self, v: f64) {
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        self.n += 1;
        let delta = v - self.mean;
        self.mean += delta / self.n as f64;
        self.m2 += delta * (v - self.mean);
    }

    /// gpu_tracker's statistics: the population standard deviation (`ddof=0`).
    pub(super) fn stat(&self) -> Stat {
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
pub(super) struct BlockAcc {
    pub(super) calls: u64,
    pub(super) seconds: f64,
    pub(super) samples: u64,
    pub(super) stats: Vec<Running>,
    pub(super) open: Vec<f64>,
}

/// The plotted series, at most [`SERIES_POINTS`] points: beyond, neighbours merge
/// (every point then stands for twice as many samples), keeping maxima, so that the
/// plotted peaks are the real ones.
#[derive(Debug)]
pub(super) struct Decimated {
    pub(super) points: Vec<SeriesPoint>,
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
    pub(super) fn push(&mut self, p: SeriesPoint) {
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
pub(super) struct Pct {
    pub(super) max_sum: f64,
    pub(super) max_hw: f64,
    pub(super) sum_sum: f64,
    pub(super) sum_hw: f64,
    pub(super) n: u64,
}

impl Pct {
    pub(super) fn add(&mut self, sum: f64, units: usize) -> f64 {
        let hw = sum / units.max(1) as f64;
        self.max_sum = self.max_sum.max(sum);
        self.max_hw = self.max_hw.max(hw);
        self.sum_sum += sum;
        self.sum_hw += hw;
        self.n += 1;
        hw
    }

    pub(super) fn report(&self) -> ProcessingUnitPercentages {
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
pub(super) struct Rss {
    pub(super) total: u64,
    pub(super) private: u64,
    pub(super) shared: u64,
}

impl Rss {
    pub(super) fn max(&mut self, other: Rss) {
        self.total = self.total.max(other.total);
        self.private = self.private.max(other.private);
        self.shared = self.shared.max(other.shared);
    }
}

/// Thread counts of the tree (one sample, or the peaks).
#[derive(Default, Clone, Copy)]
pub(super) struct Threads {
    pub(super) main: u64,
    pub(super) descendants: u64,
    pub(super) combined: u64,
}

impl Threads {
    pub(super) fn max(&mut self, other: Threads) {
        self.main = self.main.max(other.main);
        self.descendants = self.descendants.max(other.descendants);
        self.combined = self.combined.max(other.combined);
    }
}

/// GPU memory peaks, in bytes.
#[derive(Default, Clone, Copy)]
pub(super) struct GpuPeaks {
    pub(super) main: u64,
    pub(super) descendants: u64,
    pub(super) combined: u64,
    pub(super) system: u64,
}

impl GpuPeaks {
    /// Raises each peak to one sample's figures (bytes).
    pub(super) fn max(&mut self, main: u64, descendants: u64, system: u64) {
        self.main = self.main.max(main);
        self.descendants = self.descendants.max(descendants);
        self.combined = self.combined.max(main + descendants);
        self.system = self.system.max(system);
    }
}

/// CPU utilisation of one sample, as gpu_tracker's sums of per-core percentages.
#[derive(Default, Clone, Copy)]
pub(super) struct CpuSample {
    pub(super) system: f64,
    pub(super) main: f64,
    pub(super) descendants: f64,
    pub(super) combined: f64,
}

/// The CPU utilisation series: peaks and means of each.
#[derive(Default, Clone)]
pub(super) struct CpuSeries {
    pub(super) system: Pct,
    pub(super) main: Pct,
    pub(super) descendants: Pct,
    pub(super) combined: Pct,
}

impl CpuSeries {
    /// Adds one sample's sums of per-core percentages; returns its hardware
    /// percentages: the system's of all `cores`, the tree's of the `expected_cores`.
    pub(super) fn add(&mut self, sum: CpuSample, cores: usize, expected_cores: usize) -> CpuSample {
        CpuSample {
            system: self.system.add(sum.system, cores),
            main: self.main.add(sum.main, expected_cores),
            descendants: self.descendants.add(sum.descendants, expected_cores),
            combined: self.combined.add(sum.combined, expected_cores),
        }
    }
}

/// Everything the samples have folded in so far: the peaks of each measure, the
/// kernel's high-water marks per process, the CPU and GPU series, the blocks, the plot.
#[derive(Default)]
pub(super) struct Peaks {
    pub(super) main: Rss,
    pub(super) descendants: Rss,
    pub(super) combined: Rss,
    pub(super) system: u64,
    pub(super) gpu: GpuPeaks,
    pub(super) threads: Threads,
    pub(super) cpu: CpuSeries,
    pub(super) gpu_pct: Pct,
    /// Highest VmHWM seen per pid, and whether it counts from the start of tracking.
    pub(super) hwm: HashMap<u32, u64>,
    pub(super) hwm_reset_failed: HashSet<u32>,
    /// Every process of the tree seen so far.
    pub(super) seen: HashSet<u32>,
    /// A PID NVML listed that this PID namespace cannot see, the first seen.
    pub(super) invisible_gpu_pid: Option<u32>,
    /// Samples recorded (live process, real CPU interval).
    pub(super) samples: u64,
    pub(super) blocks: BTreeMap<String, BlockAcc>,
    pub(super) series: Decimated,
}

#[cfg(test)]
mod tests {
    use super::{Decimated, Running, SeriesPoint, SERIES_POINTS};

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

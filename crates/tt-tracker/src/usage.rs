//! The report: gpu_tracker 5's `ResourceUsage`, key for key, plus torchtools' additions
//! under the `torchtools` key.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{RamUnit, TimeUnit};

/// Resident memory of one or more processes, in the report's RAM unit.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RssValues {
    /// Private + shared (shared counted once).
    pub total_rss: f64,
    /// Memory only these processes use (private clean + dirty).
    pub private_rss: f64,
    /// Memory shared with other processes (shared clean + dirty).
    pub shared_rss: f64,
}

/// Peak RAM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MaxRam {
    /// The unit of every figure here.
    pub unit: RamUnit,
    /// The machine's RAM.
    pub system_capacity: f64,
    /// Peak used by the whole system (total − available).
    pub system: f64,
    /// The tracked process.
    pub main: RssValues,
    /// Its descendants, summed per sample (`descendents` in gpu_tracker before 5).
    #[serde(alias = "descendents")]
    pub descendants: RssValues,
    /// Both, summed per sample (never above main + descendants).
    pub combined: RssValues,
}

/// Peak GPU RAM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MaxGpuRam {
    /// The unit of every figure here.
    pub unit: RamUnit,
    /// Memory of every GPU in the system.
    #[serde(default)]
    pub system_capacity: f64,
    /// Peak used on all GPUs by every process.
    #[serde(default)]
    pub system: f64,
    /// The tracked process.
    pub main: f64,
    /// Its descendants.
    #[serde(alias = "descendents")]
    pub descendants: f64,
    /// Both.
    pub combined: f64,
}

/// Utilisation of processing units (cores or GPUs), in percent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessingUnitPercentages {
    /// Peak of the sum over units (100 per fully used unit).
    pub max_sum_percent: f64,
    /// Peak of the sum divided by the number of units.
    pub max_hardware_percent: f64,
    /// Mean of the sum.
    pub mean_sum_percent: f64,
    /// Mean of the sum divided by the number of units.
    pub mean_hardware_percent: f64,
}

/// CPU use.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuUtilization {
    /// Cores of the machine.
    pub system_core_count: usize,
    /// Cores the job was expected to use (hardware percentages divide by it).
    pub n_expected_cores: usize,
    /// Every core of the machine.
    pub system: ProcessingUnitPercentages,
    /// The tracked process.
    pub main: ProcessingUnitPercentages,
    /// Its descendants.
    #[serde(alias = "descendents")]
    pub descendants: ProcessingUnitPercentages,
    /// Both.
    pub combined: ProcessingUnitPercentages,
    /// Peak threads of the tracked process.
    pub main_n_threads: u64,
    /// Peak sum of the descendants' threads.
    #[serde(alias = "descendents_n_threads")]
    pub descendants_n_threads: u64,
    /// Peak sum of both.
    pub combined_n_threads: u64,
}

/// GPU use.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuUtilization {
    /// GPUs of the machine.
    pub system_gpu_count: usize,
    /// GPUs tracked.
    pub n_expected_gpus: usize,
    /// Their utilisation.
    pub gpu_percentages: ProcessingUnitPercentages,
}

/// Wall time of the tracking.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ComputeTime {
    /// Its unit.
    pub unit: TimeUnit,
    /// How long.
    pub time: f64,
}

/// How each peak was obtained.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeakMethods {
    /// For `max_ram.main.total_rss`.
    pub main: String,
    /// For `max_ram.descendants.total_rss`.
    pub descendants: String,
    /// For `max_ram.combined.total_rss`.
    pub combined: String,
    /// For `max_gpu_ram`.
    pub gpu: String,
}

/// Energy a GPU used while tracked (NVML's total energy counter).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuEnergy {
    /// The GPU.
    pub uuid: String,
    /// Joules.
    pub joules: f64,
}

/// Min / max / mean / standard deviation of one measure over a block's samples, the
/// statistics of gpu_tracker's sub-tracking analysis.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
    /// Mean.
    pub mean: f64,
    /// Population standard deviation (gpu_tracker's `std(ddof=0)`); 0 in reports
    /// written before it was recorded.
    #[serde(default)]
    pub std: f64,
}

/// A named code block (`Tracker::block`): how often, how long, and its measures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockSummary {
    /// The block's name.
    pub name: String,
    /// Times it ran.
    pub calls: u64,
    /// Total seconds inside it.
    pub seconds: f64,
    /// Samples taken inside it.
    pub samples: u64,
    /// Each timeline measure (same names and units as the timeline) over those samples.
    pub measures: BTreeMap<String, Stat>,
}

/// What torchtools adds to gpu_tracker's report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Additions {
    /// How each peak was obtained.
    pub peak_methods: PeakMethods,
    /// Samples taken.
    pub samples: u64,
    /// The sampling interval, in seconds.
    pub interval_seconds: f64,
    /// Energy per tracked GPU.
    pub energy: Vec<GpuEnergy>,
    /// Peak memory of the tracked command's own cgroup (includes page cache), in the
    /// RAM unit, where the machine allowed one.
    pub cgroup_peak: Option<f64>,
    /// The tracked command's exit status (`torchtools track`).
    pub exit_status: Option<i32>,
    /// Named code blocks.
    pub blocks: Vec<BlockSummary>,
    /// What could not be measured, once each.
    pub warnings: Vec<String>,
}

/// Everything a tracking session measured: gpu_tracker 5's `ResourceUsage` (same keys,
/// same units), plus [`Additions`] under `torchtools`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[must_use]
pub struct ResourceUsage {
    /// Peak RAM.
    pub max_ram: MaxRam,
    /// Peak GPU RAM.
    pub max_gpu_ram: MaxGpuRam,
    /// CPU use (absent from gpu_tracker's reports before version 5: read as zeros,
    /// and `compare` shows it as unknown).
    #[serde(default)]
    pub cpu_utilization: CpuUtilization,
    /// GPU use (as `cpu_utilization`).
    #[serde(default)]
    pub gpu_utilization: GpuUtilization,
    /// Wall time.
    pub compute_time: ComputeTime,
    /// torchtools' additions.
    #[serde(default)]
    pub torchtools: Additions,
}

fn r3(x: f64) -> f64 {
    format!("{x:.3}").parse().unwrap_or(x)
}

impl RssValues {
    fn rounded(&self) -> RssValues {
        RssValues {
            total_rss: r3(self.total_rss),
            private_rss: r3(self.private_rss),
            shared_rss: r3(self.shared_rss),
        }
    }
}

impl ProcessingUnitPercentages {
    fn rounded(&self) -> ProcessingUnitPercentages {
        ProcessingUnitPercentages {
            max_sum_percent: r3(self.max_sum_percent),
            max_hardware_percent: r3(self.max_hardware_percent),
            mean_sum_percent: r3(self.mean_sum_percent),
            mean_hardware_percent: r3(self.mean_hardware_percent),
        }
    }
}

/// gpu_tracker's five sections with every float rounded to 3 decimals, as its text
/// report shows them.
#[derive(Serialize)]
struct Rounded {
    max_ram: MaxRam,
    max_gpu_ram: MaxGpuRam,
    cpu_utilization: CpuUtilization,
    gpu_utilization: GpuUtilization,
    compute_time: ComputeTime,
}

impl ResourceUsage {
    fn rounded(&self) -> Rounded {
        let (r, g, c, u) = (
            &self.max_ram,
            &self.max_gpu_ram,
            &self.cpu_utilization,
            &self.gpu_utilization,
        );
        Rounded {
            max_ram: MaxRam {
                unit: r.unit,
                system_capacity: r3(r.system_capacity),
                system: r3(r.system),
                main: r.main.rounded(),
                descendants: r.descendants.rounded(),
                combined: r.combined.rounded(),
            },
            max_gpu_ram: MaxGpuRam {
                unit: g.unit,
                system_capacity: r3(g.system_capacity),
                system: r3(g.system),
                main: r3(g.main),
                descendants: r3(g.descendants),
                combined: r3(g.combined),
            },
            cpu_utilization: CpuUtilization {
                system: c.system.rounded(),
                main: c.main.rounded(),
                descendants: c.descendants.rounded(),
                combined: c.combined.rounded(),
                ..c.clone()
            },
            gpu_utilization: GpuUtilization {
                gpu_percentages: u.gpu_percentages.rounded(),
                ..u.clone()
            },
            compute_time: ComputeTime {
                unit: self.compute_time.unit,
                time: r3(self.compute_time.time),
            },
        }
    }
}

/// gpu_tracker's text layout: its JSON indented by 3, braces and quotes dropped,
/// words capitalised by the same replacements, in the same order.
fn gpu_tracker_text(value: &impl Serialize) -> String {
    let mut buf = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(
        &mut buf,
        serde_json::ser::PrettyFormatter::with_indent(b"   "),
    );
    if value.serialize(&mut ser).is_err() {
        return String::new();
    }
    let json = String::from_utf8_lossy(&buf);
    let mut text = json
        .lines()
        .filter(|l| !matches!(l.trim(), "{" | "}" | "},"))
        .map(|l| l.get(3..).unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    for (from, to) in [
        (": {", ":"),
        ("{", ""),
        ("}", ""),
        ("_", " "),
        ("\"", ""),
        (",", ""),
        ("max", "Max"),
        ("ram", "RAM"),
        ("unit", "Unit"),
        ("system", "System"),
        ("compute", "Compute"),
        ("time: ", "Time: "),
        ("rss", "RSS"),
        ("total", "Total"),
        ("private", "Private"),
        ("shared", "Shared"),
        ("main", "Main"),
        ("descendants", "Descendants"),
        ("combined", "Combined"),
        ("gpu", "GPU"),
        ("mean", "Mean"),
        ("cpu", "CPU"),
        ("n threads", "number of threads"),
        ("n expected", "Number of expected"),
    ] {
        text = text.replace(from, to);
    }
    text
}

impl fmt::Display for ResourceUsage {
    /// gpu_tracker's text report, then torchtools' additions.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", gpu_tracker_text(&self.rounded()))?;
        let t = &self.torchtools;
        writeln!(f, "torchtools:")?;
        writeln!(
            f,
            "   Samples: {} every {:.3} s",
            t.samples, t.interval_seconds
        )?;
        writeln!(f, "   Peak methods:")?;
        writeln!(f, "      Main: {}", t.peak_methods.main)?;
        writeln!(f, "      Descendants: {}", t.peak_methods.descendants)?;
        writeln!(f, "      Combined: {}", t.peak_methods.combined)?;
        writeln!(f, "      GPU: {}", t.peak_methods.gpu)?;
        if let Some(peak) = t.cgroup_peak {
            writeln!(
                f,
                "   Cgroup peak (incl. page cache): {peak:.3} {}",
                self.max_ram.unit
            )?;
        }
        for e in &t.energy {
            writeln!(f, "   Energy {}: {:.1} J", e.uuid, e.joules)?;
        }
        if let Some(code) = t.exit_status {
            writeln!(f, "   Exit status: {code}")?;
        }
        for b in &t.blocks {
            writeln!(
                f,
                "   Block {:?}: {} call(s), {:.3} s, {} sample(s)",
                b.name, b.calls, b.seconds, b.samples
            )?;
            for (measure, s) in &b.measures {
                writeln!(
                    f,
                    "      {measure}: min {:.3} max {:.3} mean {:.3} std {:.3}",
                    s.min, s.max, s.mean, s.std
                )?;
            }
        }
        for w in &t.warnings {
            writeln!(f, "   Warning: {w}")?;
        }
        Ok(())
    }
}

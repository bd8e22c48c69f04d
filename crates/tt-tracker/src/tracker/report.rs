//! The report at the stop: the peaks' last figures (the kernel's high-water marks and
//! the command's end where they say more than the samples did), then every figure in
//! the configuration's units, with how each peak was measured.

use std::time::Duration;

use super::config::Setting;
use super::peaks::{Peaks, Rss, SeriesPoint};
use crate::gpu::Gpus;
use crate::timeline::Sample;
use crate::usage::{
    Additions, BlockSummary, ComputeTime, CpuUtilization, GpuUtilization, MaxGpuRam, MaxRam,
    PeakMethods, ResourceUsage, RssValues,
};

/// What the tracker hands back: the report and the plotted series.
pub(super) type Finished = (ResourceUsage, Vec<SeriesPoint>);

/// What the tracked command's end told: `wait4`'s `ru_maxrss`, its own high-water mark
/// read as it exited, its status.
pub(super) struct Exit {
    pub(super) max_rss: Option<u64>,
    pub(super) own_peak: Option<u64>,
    pub(super) status: Option<i32>,
}

/// How each RSS peak was measured, in the report's words.
struct Methods {
    main: String,
    descendants: String,
    combined: String,
}

/// The report of a stopped tracker, with the plotted series.
pub(super) fn finish(
    setting: Setting,
    mut peaks: Peaks,
    gpus: &Gpus,
    warnings: Vec<String>,
    exit: Exit,
) -> Finished {
    let methods = final_peaks(&mut peaks, setting.main, setting.config.interval, &exit);
    let series = std::mem::take(&mut peaks.series.points);
    let usage = usage(&setting, peaks, gpus, warnings, methods, exit.status);
    (usage, series)
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

/// The peaks' last figures, from the kernel's high-water marks and the command's
/// end where they say more than the samples did; how each was measured (main,
/// descendants, combined).
fn final_peaks(peaks: &mut Peaks, main: u32, interval: Duration, exit: &Exit) -> Methods {
    let interval = format!("sampled every {interval:?}");
    // Main: its kernel high-water mark, when it counts from the start of tracking.
    let mut main_method = interval.clone();
    let main_hwm = if peaks.hwm_reset_failed.contains(&main) {
        0
    } else {
        peaks.hwm.get(&main).copied().unwrap_or(0)
    };
    match main_peak(main_hwm, peaks.main.total) {
        MainPeak::HighWaterMark => {
            peaks.main.total = main_hwm;
            main_method = "VmHWM (the kernel's high-water mark, reset at start)".into();
        }
        MainPeak::Both => {
            main_method = "VmHWM (the kernel's high-water mark, reset at start) = sampled".into();
        }
        MainPeak::Sampled => {}
    }
    let desc_hwm = peaks
        .hwm
        .iter()
        .filter(|(pid, _)| **pid != main && !peaks.hwm_reset_failed.contains(pid))
        .map(|(_, h)| *h)
        .max()
        .unwrap_or(0);
    let mut desc_method = format!("{interval} (sum over descendants)");
    if desc_hwm > peaks.descendants.total {
        peaks.descendants.total = desc_hwm;
        desc_method = format!("{interval}, raised to the largest descendant's VmHWM");
    }
    // wait4's ru_maxrss is the largest of the command (with the image it had before
    // exec), and the descendants it reaped.
    let had_descendants = peaks.seen.iter().any(|p| *p != main);
    match (exit.own_peak, exit.max_rss) {
        (Some(own), max_rss) => {
            if own >= peaks.main.total {
                peaks.main.total = own;
                main_method = "VmHWM read as it exited (ptrace's exit stop): its own".into();
            }
            // Above its own peak, ru_maxrss is a descendant's.
            if let Some(m) = max_rss.filter(|m| *m > own && *m > peaks.descendants.total) {
                peaks.descendants.total = m;
                desc_method = "wait4 ru_maxrss (the largest descendant the command reaped)".into();
            }
        }
        (None, Some(max_rss)) if !had_descendants && max_rss > peaks.main.total => {
            peaks.main.total = max_rss;
            main_method = "wait4 ru_maxrss (the kernel's peak of the reaped command)".into();
        }
        _ => {}
    }
    let mut comb_method = format!("{interval} (per-sample sum, shared pages once)");
    let floor = peaks.main.total.max(peaks.descendants.total);
    if floor > peaks.combined.total {
        peaks.combined.total = floor;
        comb_method = format!("{interval}, raised to the main / descendants peak");
    }
    Methods {
        main: main_method,
        descendants: desc_method,
        combined: comb_method,
    }
}

/// The report: every figure in the configuration's units, with how the peaks were
/// measured.
fn usage(
    setting: &Setting,
    peaks: Peaks,
    gpus: &Gpus,
    warnings: Vec<String>,
    methods: Methods,
    exit_status: Option<i32>,
) -> ResourceUsage {
    let config = &setting.config;
    let ram = |b: u64| config.ram_unit.of(b as f64);
    let gram = |b: u64| config.gpu_ram_unit.of(b as f64);
    let rss = |r: Rss| RssValues {
        total_rss: ram(r.total),
        private_rss: ram(r.private),
        shared_rss: ram(r.shared),
    };
    let (gpu_count, tracked) = gpus.counts();
    let elapsed = setting.start.elapsed().as_secs_f64();
    let warnings = with_gpu_note(warnings, &peaks);
    ResourceUsage {
        max_ram: MaxRam {
            unit: config.ram_unit,
            system_capacity: ram(setting.system_capacity),
            system: ram(peaks.system),
            main: rss(peaks.main),
            descendants: rss(peaks.descendants),
            combined: rss(peaks.combined),
        },
        max_gpu_ram: MaxGpuRam {
            unit: config.gpu_ram_unit,
            system_capacity: gram(gpus.capacity),
            system: gram(peaks.gpu.system),
            main: gram(peaks.gpu.main),
            descendants: gram(peaks.gpu.descendants),
            combined: gram(peaks.gpu.combined),
        },
        cpu_utilization: CpuUtilization {
            system_core_count: setting.cores,
            n_expected_cores: setting.expected_cores,
            system: peaks.cpu.system.report(),
            main: peaks.cpu.main.report(),
            descendants: peaks.cpu.descendants.report(),
            combined: peaks.cpu.combined.report(),
            main_n_threads: peaks.threads.main,
            descendants_n_threads: peaks.threads.descendants,
            combined_n_threads: peaks.threads.combined,
        },
        gpu_utilization: GpuUtilization {
            system_gpu_count: gpu_count,
            n_expected_gpus: tracked,
            gpu_percentages: peaks.gpu_pct.report(),
        },
        compute_time: ComputeTime {
            unit: config.time_unit,
            time: config.time_unit.of(elapsed),
        },
        torchtools: Additions {
            peak_methods: PeakMethods {
                main: methods.main,
                descendants: methods.descendants,
                combined: methods.combined,
                gpu: if gpus.available() {
                    format!(
                        "NVML per-process memory, sampled every {:?}",
                        config.interval
                    )
                } else {
                    "no NVML: 0".into()
                },
            },
            samples: peaks.samples,
            interval_seconds: config.interval.as_secs_f64(),
            energy: gpus.energy(),
            cgroup_peak: config.cgroup.as_deref().and_then(cgroup_peak).map(ram),
            exit_status,
            blocks: block_summaries(peaks),
            warnings,
        },
    }
}

/// The peak of a memory cgroup directory (v2's `memory.peak`, v1's
/// `memory.max_usage_in_bytes`), bytes.
fn cgroup_peak(dir: &std::path::Path) -> Option<u64> {
    ["memory.peak", "memory.max_usage_in_bytes"]
        .iter()
        .find_map(|f| std::fs::read_to_string(dir.join(f)).ok())
        .and_then(|t| t.trim().parse::<u64>().ok())
}

/// Each block's calls, time, samples and the statistics of every measure inside it.
fn block_summaries(peaks: Peaks) -> Vec<BlockSummary> {
    let names: Vec<&'static str> = Sample::default().measures().iter().map(|m| m.0).collect();
    peaks
        .blocks
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
        .collect()
}

/// The warnings, with a note when NVML listed a process this PID namespace cannot see
/// (its memory then counts for nobody in the tree).
fn with_gpu_note(mut warnings: Vec<String>, peaks: &Peaks) -> Vec<String> {
    let attributed = peaks.gpu.main + peaks.gpu.descendants;
    warnings.extend(
        peaks
            .invisible_gpu_pid
            .and_then(|pid| crate::gpu::invisible_pid_note(pid, attributed)),
    );
    warnings
}

#[cfg(test)]
mod tests {
    use super::{main_peak, MainPeak};

    #[test]
    fn the_commands_peak_is_credited_to_the_figure_that_holds_it() {
        assert_eq!(main_peak(5 << 20, 4 << 20), MainPeak::HighWaterMark);
        assert_eq!(main_peak(5 << 20, 0), MainPeak::HighWaterMark);
        assert_eq!(main_peak(4 << 20, 4 << 20), MainPeak::Both);
        // A mark read before the RSS grew further is not the peak, and no mark is none.
        assert_eq!(main_peak(3 << 20, 4 << 20), MainPeak::Sampled);
        assert_eq!(main_peak(0, 4 << 20), MainPeak::Sampled);
        assert_eq!(main_peak(0, 0), MainPeak::Sampled);
    }
}

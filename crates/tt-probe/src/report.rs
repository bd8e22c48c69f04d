use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tt_device::Bytes;

/// Which memory a probe measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    /// GPU memory: the caching allocator's peaks and NVML's per-process peak.
    Gpu,
    /// CPU memory (no usable GPU): the peak RSS growth from the kernel's high-water mark.
    Cpu,
}

/// What a probe measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[must_use]
pub struct ProbeReport {
    /// GPU or CPU memory.
    pub memory: MemoryKind,
    /// The device the probe ran on (`cuda:0 (GPU-...)`, `cpu`).
    pub device: String,
    /// Peak bytes in tensors (caching allocator), for Rust probes on CUDA.
    pub peak_allocated: Option<Bytes>,
    /// Peak bytes the caching allocator held from the driver, for Rust probes on CUDA.
    pub peak_reserved: Option<Bytes>,
    /// Peak GPU memory NVML saw for the child's process tree: includes the CUDA context,
    /// library workspaces and the allocator's reserve.
    pub nvml_peak: Option<Bytes>,
    /// CPU: peak RSS (growth over the probe's start for Rust probes; the whole tree's
    /// peak for commands).
    pub rss_peak: Option<Bytes>,
    /// Steps run.
    pub steps: u64,
    /// Wall time of the probe's work (Rust probes) or of the command; in JSON, seconds
    /// as a number (`"duration": 0.137`).
    #[serde(with = "seconds")]
    pub duration: Duration,
    /// A command probe ended by its timeout (its peak so far is reported): the
    /// command does not answer the probe (it did not stop after `steps` steps).
    #[serde(default)]
    pub ended_by_timeout: bool,
    /// A command probe: `steps` is what the command was asked to run
    /// (`TORCHTOOLS_PROBE_STEPS`), not a count it reported; a Rust probe ran exactly
    /// `steps`.
    #[serde(default)]
    pub command: bool,
}

/// How a peak becomes a reservation: `peak × (1 + fraction) + margin`, rounded up to
/// `granularity`.
///
/// Defaults: `fraction` 3%, `margin` 32 MiB, `granularity` 2 MiB. The peak used is the
/// larger of the allocator's peak reserved and NVML's per-process peak, and NVML's
/// already counts the CUDA context (~0.5 GiB), cuBLAS/cuDNN workspaces and the
/// allocator's cache — what the Python original missed by reporting
/// `max_memory_allocated` alone. What remains between a short probe and the real run is
/// fragmentation and algorithm choices that differ slightly from run to run: a few
/// percent. 2 MiB is the caching allocator's large-block rounding.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EstimatePolicy {
    /// Relative headroom.
    pub fraction: f64,
    /// Absolute headroom.
    pub margin: Bytes,
    /// Round up to a multiple of this.
    pub granularity: Bytes,
}

impl Default for EstimatePolicy {
    fn default() -> Self {
        EstimatePolicy {
            fraction: 0.03,
            margin: Bytes::mib(32),
            granularity: Bytes::mib(2),
        }
    }
}

impl EstimatePolicy {
    /// Bytes to reserve for a run whose peak is `peak`.
    pub fn reserve_for(&self, peak: Bytes) -> Bytes {
        let raw = peak.0 as f64 * (1.0 + self.fraction.max(0.0)) + self.margin.0 as f64;
        let g = self.granularity.0.max(1);
        let raw = raw.ceil() as u64;
        Bytes(raw.div_ceil(g) * g)
    }
}

impl ProbeReport {
    /// A report of a peak measured elsewhere (your own probe, an earlier run): GPU
    /// memory as NVML's per-process peak, CPU memory as the RSS peak; no steps, no time.
    pub fn from_peak(memory: MemoryKind, peak: Bytes) -> ProbeReport {
        let gpu = memory == MemoryKind::Gpu;
        ProbeReport {
            memory,
            device: if gpu { "cuda" } else { "cpu" }.to_owned(),
            peak_allocated: None,
            peak_reserved: None,
            nvml_peak: gpu.then_some(peak),
            rss_peak: (!gpu).then_some(peak),
            steps: 0,
            duration: Duration::ZERO,
            ended_by_timeout: false,
            command: false,
        }
    }

    /// The peak the estimate starts from: the larger of peak reserved and NVML's peak
    /// (GPU), or the RSS peak (CPU).
    pub fn peak(&self) -> Bytes {
        match self.memory {
            MemoryKind::Gpu => self.peak_reserved.max(self.nvml_peak).unwrap_or_default(),
            MemoryKind::Cpu => self.rss_peak.unwrap_or_default(),
        }
    }

    /// Bytes to reserve for the real run.
    pub fn estimate(&self, policy: &EstimatePolicy) -> Bytes {
        policy.reserve_for(self.peak())
    }
}

impl fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.memory {
            MemoryKind::Gpu => "GPU memory",
            MemoryKind::Cpu => "CPU memory (no GPU was used)",
        };
        write!(f, "probe on {}: {kind}, peak {}", self.device, self.peak())?;
        if let Some(b) = self.peak_reserved {
            write!(f, "; allocator peak reserved {b}")?;
        }
        if let Some(b) = self.peak_allocated {
            write!(f, ", allocated {b}")?;
        }
        if let Some(b) = self.nvml_peak {
            write!(f, "; NVML per-process peak {b}")?;
        }
        if self.ended_by_timeout {
            write!(
                f,
                "; the command does not answer the probe: measured its first {:.2?} (asked \
                 for {} step(s) with TORCHTOOLS_PROBE_STEPS, it ran until the timeout)",
                self.duration, self.steps
            )
        } else if self.command {
            write!(
                f,
                "; asked for {} step(s) (TORCHTOOLS_PROBE_STEPS), it exited after {:.2?}",
                self.steps, self.duration
            )
        } else {
            write!(f, "; {} step(s) in {:.2?}", self.steps, self.duration)
        }
    }
}

/// A `Duration` in JSON as seconds (a number), as scripts and Python read it; the
/// `{"secs": .., "nanos": ..}` form of older reports is read too.
mod seconds {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Seconds(f64),
        Parts { secs: u64, nanos: u32 },
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        match Either::deserialize(d)? {
            Either::Seconds(s) => Duration::try_from_secs_f64(s).map_err(|e| {
                serde::de::Error::custom(format!("{s} is not a duration in seconds: {e}"))
            }),
            Either::Parts { secs, nanos } => Ok(Duration::new(secs, nanos)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(memory: MemoryKind) -> ProbeReport {
        ProbeReport {
            memory,
            device: "cuda:0".into(),
            peak_allocated: Some(Bytes::mib(800)),
            peak_reserved: Some(Bytes::mib(1000)),
            nvml_peak: Some(Bytes::mib(1500)),
            rss_peak: Some(Bytes::mib(300)),
            steps: 5,
            duration: Duration::from_secs(1),
            ended_by_timeout: false,
            command: false,
        }
    }

    #[test]
    fn a_command_is_never_said_to_have_run_steps_it_did_not_report() {
        let mut r = report(MemoryKind::Cpu);
        assert!(r.to_string().contains("; 5 step(s) in 1.00s"), "{r}");
        r.command = true;
        assert!(r.to_string().contains("asked for 5 step(s)"), "{r}");
        assert!(!r.to_string().contains("; 5 step(s)"), "{r}");
        r.ended_by_timeout = true;
        assert!(
            r.to_string()
                .contains("does not answer the probe: measured its first"),
            "{r}"
        );
    }

    #[test]
    fn the_estimate_starts_from_the_larger_gpu_peak_and_rounds_up() {
        let r = report(MemoryKind::Gpu);
        assert_eq!(r.peak(), Bytes::mib(1500));
        let e = r.estimate(&EstimatePolicy::default());
        // 1500 MiB * 1.03 + 32 MiB = 1577 MiB, rounded up to 2 MiB: 1578 MiB.
        assert_eq!(e, Bytes::mib(1578));
        assert_eq!(e.0 % (2 << 20), 0);
        let cpu = report(MemoryKind::Cpu);
        assert_eq!(cpu.peak(), Bytes::mib(300));
        assert!(cpu.to_string().contains("CPU memory"), "{cpu}");
    }

    #[test]
    fn json_durations_are_seconds_and_old_reports_still_read() {
        let mut r = report(MemoryKind::Gpu);
        r.duration = Duration::from_millis(1_250);
        let json = serde_json::to_value(&r).unwrap_or_default();
        assert_eq!(json["duration"], serde_json::json!(1.25));
        let back: ProbeReport = serde_json::from_value(json).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, r);
        let mut old = serde_json::to_value(&r).unwrap_or_default();
        old["duration"] = serde_json::json!({"secs": 3, "nanos": 760_042_752});
        let back: ProbeReport = serde_json::from_value(old).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back.duration, Duration::new(3, 760_042_752));
        let mut bad = serde_json::to_value(&r).unwrap_or_default();
        bad["duration"] = serde_json::json!(-1.0);
        let e = serde_json::from_value::<ProbeReport>(bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a duration in seconds"), "{e}");
    }
}

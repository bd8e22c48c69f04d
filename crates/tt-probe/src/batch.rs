//! The largest batch that fits: a line through the peaks of at most three probes at
//! growing batch sizes, solved for the memory there is.

use std::fmt;

use serde::{Deserialize, Serialize};
use tt_device::Bytes;

use crate::{EstimatePolicy, ProbeError, ProbeReport, Result};

/// The variable that tells a probed command (or a Rust probe) the batch size to use.
pub const PROBE_BATCH_ENV: &str = "TORCHTOOLS_PROBE_BATCH";

/// Peak memory as a line in the batch size: `fixed + per_sample × batch` bytes.
///
/// Activations grow linearly with the batch in transformers and conv nets; parameters,
/// gradients, optimizer state, the CUDA context and library workspaces do not.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MemoryLine {
    /// Bytes that do not depend on the batch.
    pub fixed: f64,
    /// Bytes per sample of the batch.
    pub per_sample: f64,
}

impl MemoryLine {
    /// The line through two probes' peaks (`(batch, peak)`), the larger batch second.
    ///
    /// An error when the batches are equal or memory did not grow with the batch (the
    /// command does not read [`PROBE_BATCH_ENV`]).
    pub fn through(a: (u64, Bytes), b: (u64, Bytes)) -> Result<MemoryLine> {
        let (b0, m0) = (a.0 as f64, a.1 .0 as f64);
        let (b1, m1) = (b.0 as f64, b.1 .0 as f64);
        if b.0 <= a.0 {
            return Err(ProbeError::NoBatchGrowth {
                reason: format!(
                    "probes at batches {} and {} cannot make a line: the second must be larger",
                    a.0, b.0
                ),
            });
        }
        let per_sample = (m1 - m0) / (b1 - b0);
        // Growth below 1% of the peak is measurement noise (an interpreter's RSS from
        // run to run), not a slope: real models grow by more than 10% from the first
        // probe to the second.
        if m1 - m0 <= 0.01 * m1.max(m0) {
            return Err(ProbeError::NoBatchGrowth {
                reason: format!(
                    "peak memory did not grow measurably from batch {} ({}) to batch {} ({}): \
                 does the command read its batch size from {PROBE_BATCH_ENV}? If it does, \
                 start at a larger batch (--batch-start)",
                    a.0, a.1, b.0, b.1
                ),
            });
        }
        Ok(MemoryLine {
            fixed: m0 - per_sample * b0,
            per_sample,
        })
    }

    /// The peak the line predicts at `batch`.
    pub fn at(&self, batch: u64) -> Bytes {
        Bytes(
            (self.fixed + self.per_sample * batch as f64)
                .max(0.0)
                .ceil() as u64,
        )
    }

    /// The largest batch whose reservation (`policy` applied to the predicted peak)
    /// fits in `capacity`; `None` when not even a batch of 1 does.
    pub fn largest_batch(&self, capacity: Bytes, policy: &EstimatePolicy) -> Option<u64> {
        let fits = |b: u64| estimate(self.at(b), policy) <= capacity;
        // Solve the line, then step over the rounding the policy adds.
        let usable =
            (capacity.0 as f64 - policy.margin.0 as f64) / (1.0 + policy.fraction.max(0.0));
        let guess = ((usable - self.fixed) / self.per_sample).floor();
        let mut b = if guess.is_finite() && guess >= 1.0 {
            guess.min(u64::MAX as f64 / 2.0) as u64
        } else {
            1
        };
        while b > 1 && !fits(b) {
            b -= 1;
        }
        while fits(b + 1) {
            b += 1;
        }
        fits(b).then_some(b)
    }
}

/// What a probe says its step needs: with the caching allocator's statistics (Rust
/// probes), NVML's peak less the cache the allocator held beyond its tensors (peak
/// reserved − peak allocated), which it gives back and retries with when memory runs
/// short, so a run near the limit does not need it; else the report's peak.
fn needed(report: &ProbeReport) -> Bytes {
    match (
        report.nvml_peak,
        report.peak_reserved,
        report.peak_allocated,
    ) {
        (Some(nvml), Some(reserved), Some(allocated)) if nvml >= reserved => {
            Bytes(nvml.0 - reserved.0.saturating_sub(allocated.0))
        }
        _ => report.peak(),
    }
}

fn estimate(peak: Bytes, policy: &EstimatePolicy) -> Bytes {
    policy.reserve_for(peak)
}

impl fmt::Display for MemoryLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} + {} per sample",
            Bytes(self.fixed.max(0.0) as u64),
            Bytes(self.per_sample as u64)
        )
    }
}

/// How to look for the largest batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchSearch {
    /// The memory the run may use (a GPU's free memory, or a reservation's bytes).
    pub capacity: Bytes,
    /// The first probe's batch (default 2); the second runs at twice it.
    pub start: u64,
    /// How a peak becomes a reservation: the prediction leaves this headroom.
    pub policy: EstimatePolicy,
    /// Never predict more than this (e.g. the dataset's size).
    pub limit: Option<u64>,
}

impl BatchSearch {
    /// A search for `capacity`, starting at batch 2, with the default policy.
    pub fn new(capacity: Bytes) -> BatchSearch {
        BatchSearch {
            capacity,
            start: 2,
            policy: EstimatePolicy::default(),
            limit: None,
        }
    }
}

/// The largest batch that fits, and how it was found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[must_use]
pub struct MaxBatch {
    /// The largest batch whose reservation fits in the capacity.
    pub batch: u64,
    /// The capacity searched for.
    pub capacity: Bytes,
    /// The predicted peak at that batch (for Rust probes on CUDA, without the
    /// allocator's spare cache: see [`max_batch`]).
    pub peak: Bytes,
    /// The reservation at that batch (the policy applied to the peak).
    pub reserve: Bytes,
    /// The line the prediction comes from (through the two largest probes).
    pub line: MemoryLine,
    /// The probes run, in order: batch and report.
    pub probes: Vec<(u64, ProbeReport)>,
}

impl fmt::Display for MaxBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let batches: Vec<String> = self.probes.iter().map(|(b, _)| b.to_string()).collect();
        write!(
            f,
            "largest batch {} (peak {}, reserve {} of {}); memory = {}, from probes at batches {}",
            self.batch,
            self.peak,
            self.reserve,
            self.capacity,
            self.line,
            batches.join(", ")
        )
    }
}

/// Predicts the largest batch that fits in `search.capacity` from at most three probes:
/// `probe(batch)` runs one (a command with [`PROBE_BATCH_ENV`] set, or a Rust probe)
/// and returns its report.
///
/// The first two probes, at `start` and `2 × start`, give a first line; the third runs
/// where that line reaches half the capacity, so that the line the prediction comes
/// from (through the second and third) is measured near the batches it predicts, away
/// from the small batches where fixed workspaces and algorithm choices dominate. The
/// prediction leaves the policy's headroom (3% + 32 MiB by default), as a reservation
/// made from it would. A probe that reports the caching allocator's statistics (a Rust
/// probe on CUDA) is measured without the cache the allocator held beyond its tensors
/// (peak reserved − peak allocated): near the limit the allocator gives that back and
/// retries, so the run does not need it.
///
/// ```
/// use tt_device::Bytes;
/// use tt_probe::{max_batch, BatchSearch, MemoryKind, ProbeReport};
///
/// // A fake probe for the example: 1 GiB fixed + 64 MiB per sample.
/// let probe = |batch: u64| -> tt_probe::Result<ProbeReport> {
///     Ok(ProbeReport::from_peak(MemoryKind::Gpu, Bytes(Bytes::gib(1).0 + Bytes::mib(64 * batch).0)))
/// };
/// let found = max_batch(&BatchSearch::new(Bytes::gib(16)), probe)?;
/// assert_eq!(found.probes.len(), 3);
/// assert!((230..=240).contains(&found.batch), "{found}");
/// # Ok::<(), tt_probe::ProbeError>(())
/// ```
pub fn max_batch(
    search: &BatchSearch,
    mut probe: impl FnMut(u64) -> Result<ProbeReport>,
) -> Result<MaxBatch> {
    let start = search.start.max(1);
    let limit = search.limit.unwrap_or(u64::MAX).max(1);
    let mut probes = Vec::with_capacity(3);
    let mut run = |batch: u64, probes: &mut Vec<(u64, ProbeReport)>| -> Result<Bytes> {
        let report = probe(batch)?;
        if report.ended_by_timeout {
            return Err(ProbeError::NoBatchGrowth {
                reason: format!(
                    "the probe at batch {batch} was ended by its timeout: the command does not \
                 answer the probe (run TORCHTOOLS_PROBE_STEPS steps, then exit)"
                ),
            });
        }
        let peak = needed(&report);
        probes.push((batch, report));
        Ok(peak)
    };
    let first = (start, run(start, &mut probes)?);
    let second_batch = start.saturating_mul(2);
    let second = (second_batch, run(second_batch, &mut probes)?);
    let mut line = MemoryLine::through(first, second)?;
    // The third probe where the first line reaches half the capacity, at least twice the
    // second batch, at most the first prediction (never beyond what fits).
    let first_guess = line.largest_batch(search.capacity, &search.policy);
    if let Some(guess) = first_guess.filter(|&g| g > second_batch) {
        let half = (search.capacity.0 as f64 / 2.0 - line.fixed) / line.per_sample;
        let third_batch = (half.floor().max(0.0) as u64)
            .max(second_batch.saturating_mul(2))
            .min(guess)
            .min(limit);
        if third_batch > second_batch {
            let third = (third_batch, run(third_batch, &mut probes)?);
            line = MemoryLine::through(second, third)?;
        }
    }
    let batch = line
        .largest_batch(search.capacity, &search.policy)
        .map(|b| b.min(limit))
        .ok_or_else(|| ProbeError::NoBatchGrowth {
            reason: format!(
                "not even a batch of 1 fits in {}: memory = {line}",
                search.capacity
            ),
        })?;
    let peak = line.at(batch);
    Ok(MaxBatch {
        batch,
        capacity: search.capacity,
        peak,
        reserve: estimate(peak, &search.policy),
        line,
        probes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryKind;

    fn report(peak: Bytes) -> ProbeReport {
        ProbeReport::from_peak(MemoryKind::Gpu, peak)
    }

    #[test]
    fn the_line_through_two_points_and_its_largest_batch() {
        let line = MemoryLine::through((4, Bytes::mib(1024 + 4 * 10)), (8, Bytes::mib(1024 + 80)))
            .unwrap();
        assert!((line.per_sample - Bytes::mib(10).0 as f64).abs() < 1.0);
        assert!((line.fixed - Bytes::mib(1024).0 as f64).abs() < 1.0);
        let policy = EstimatePolicy::default();
        let capacity = Bytes::gib(4);
        let b = line.largest_batch(capacity, &policy).unwrap();
        assert!(estimate(line.at(b), &policy) <= capacity);
        assert!(estimate(line.at(b + 1), &policy) > capacity);
        // Nothing fits below the fixed part.
        assert_eq!(line.largest_batch(Bytes::mib(512), &policy), None);
    }

    #[test]
    fn memory_that_does_not_grow_is_refused_with_the_variable_named() {
        let e = MemoryLine::through((2, Bytes::mib(100)), (4, Bytes::mib(100))).unwrap_err();
        assert!(e.to_string().contains(PROBE_BATCH_ENV), "{e}");
        assert!(MemoryLine::through((4, Bytes::mib(1)), (4, Bytes::mib(2))).is_err());
    }

    #[test]
    fn three_probes_predict_a_nonlinear_small_batch_model_from_the_large_end() {
        // A workspace that appears above batch 8 (as cuDNN's can): the line through the
        // two smallest probes misses it, the third probe's line catches it.
        let truth = |b: u64| Bytes::mib(2048 + 50 * b + if b > 8 { 300 } else { 0 });
        let mut asked = Vec::new();
        let found = max_batch(&BatchSearch::new(Bytes::gib(40)), |b| {
            asked.push(b);
            Ok(report(truth(b)))
        })
        .unwrap();
        assert_eq!(asked.len(), 3, "{asked:?}");
        assert_eq!(&asked[..2], &[2, 4]);
        let policy = EstimatePolicy::default();
        let capacity = Bytes::gib(40);
        let fits = |b: u64| estimate(truth(b), &policy) <= capacity;
        let best = (1..2000u64).rev().find(|&b| fits(b)).unwrap();
        assert!(fits(found.batch), "{found} does not fit");
        assert!(
            found.batch as f64 >= 0.98 * best as f64,
            "{found}; best {best}"
        );
        // The line through the two small probes alone predicts a batch that does not fit.
        let small = MemoryLine::through((2, truth(2)), (4, truth(4))).unwrap();
        assert!(!fits(small.largest_batch(capacity, &policy).unwrap()));
    }

    #[test]
    fn a_limit_caps_the_prediction_and_a_timeout_is_not_a_measurement() {
        let mut search = BatchSearch::new(Bytes::gib(40));
        search.limit = Some(100);
        let found = max_batch(&search, |b| Ok(report(Bytes::mib(1000 + 10 * b)))).unwrap();
        assert_eq!(found.batch, 100);
        let e = max_batch(&BatchSearch::new(Bytes::gib(40)), |b| {
            let mut r = report(Bytes::mib(1000 + 10 * b));
            r.ended_by_timeout = true;
            Ok(r)
        })
        .unwrap_err();
        assert!(e.to_string().contains("does not answer the probe"), "{e}");
    }
}

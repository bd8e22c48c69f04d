use std::fmt;

use serde::{Serialize, Serializer};

use crate::env::{DeviceRequest, EnvConfig};
use crate::{Bytes, Error, Result};

/// A device, independent of libtorch (`tch::Device` with the `tch` feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// The CPU.
    Cpu,
    /// CUDA device with this logical index (after `CUDA_VISIBLE_DEVICES`).
    Cuda(usize),
    /// Apple's Metal backend.
    Mps,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::Mps => f.write_str("mps"),
        }
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A CUDA device that can be chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CudaCandidate {
    /// Logical index (`cuda:N`).
    pub index: usize,
    /// Free memory, when known (NVML).
    pub free: Option<Bytes>,
}

/// What this process can use, with the reason when a backend is not usable.
/// Built from libtorch (feature `tch`) or NVML alone (the CLI), or by hand in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Availability {
    /// The visible CUDA devices (never empty when `Ok`), or why there are none.
    pub cuda: std::result::Result<Vec<CudaCandidate>, String>,
    /// `Ok` when MPS is usable, or why not.
    pub mps: std::result::Result<(), String>,
}

/// The chosen device and why it was chosen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Selection {
    /// The device.
    pub device: Device,
    /// Why, in one sentence.
    pub reason: String,
}

/// Chooses the device for `env` among what `avail` offers. Pure: no I/O.
///
/// - `cpu`: the CPU. `mps`: MPS, or an error saying why not.
/// - `cuda:N`: that device, if `N` is visible.
/// - `cuda`, and `auto` when CUDA is usable: `cuda:LOCAL_RANK` under a launcher
///   (with exactly one visible device, every local rank uses it: per-rank GPU
///   isolation); otherwise the device with the most free memory, `cuda:0` on a tie
///   or when free memory is unknown.
/// - `auto` without CUDA: MPS when usable, else the CPU.
pub fn select_with(env: &EnvConfig, avail: &Availability) -> Result<Selection> {
    let requested = || {
        env.raw
            .torchtools_device
            .clone()
            .unwrap_or_else(|| env.request.to_string())
    };
    match env.request {
        DeviceRequest::Cpu => Ok(Selection {
            device: Device::Cpu,
            reason: "TORCHTOOLS_DEVICE=cpu".into(),
        }),
        DeviceRequest::Mps => match &avail.mps {
            Ok(()) => Ok(Selection {
                device: Device::Mps,
                reason: "TORCHTOOLS_DEVICE=mps".into(),
            }),
            Err(reason) => Err(Error::MpsUnavailable {
                reason: reason.clone(),
            }),
        },
        DeviceRequest::Cuda(index) => {
            let gpus = avail
                .cuda
                .as_ref()
                .map_err(|reason| Error::CudaUnavailable {
                    requested: requested(),
                    reason: reason.clone(),
                })?;
            match index {
                Some(n) if n < gpus.len() => Ok(Selection {
                    device: Device::Cuda(n),
                    reason: format!("TORCHTOOLS_DEVICE=cuda:{n}"),
                }),
                Some(_) => Err(Error::CudaIndexOutOfRange {
                    requested: requested(),
                    count: gpus.len(),
                    visible: env.raw.visible_for_message(),
                    fix: match gpus.len() {
                        1 => "use cuda:0 or `cuda`, or change CUDA_VISIBLE_DEVICES".to_owned(),
                        n => format!(
                            "use cuda:0 to cuda:{} or `cuda`, or change CUDA_VISIBLE_DEVICES",
                            n - 1
                        ),
                    },
                }),
                None => pick_cuda(env, gpus, "TORCHTOOLS_DEVICE=cuda"),
            }
        }
        DeviceRequest::Auto => {
            let why = match &avail.cuda {
                Ok(gpus) => return pick_cuda(env, gpus, "auto: CUDA is usable"),
                Err(reason) => reason,
            };
            match &avail.mps {
                Ok(()) => Ok(Selection {
                    device: Device::Mps,
                    reason: format!("auto: CUDA is not usable ({why}); MPS is"),
                }),
                Err(mps_why) => Ok(Selection {
                    device: Device::Cpu,
                    reason: format!(
                        "auto: CUDA is not usable ({why}); MPS is not usable ({mps_why})"
                    ),
                }),
            }
        }
    }
}

fn pick_cuda(env: &EnvConfig, gpus: &[CudaCandidate], why: &str) -> Result<Selection> {
    if let Some(rank) = env.local_rank {
        return match gpus.len() {
            1 => Ok(Selection {
                device: Device::Cuda(0),
                reason: format!(
                    "{why}; LOCAL_RANK={rank} and exactly one GPU is visible (per-rank isolation)"
                ),
            }),
            n if rank < n => Ok(Selection {
                device: Device::Cuda(rank),
                reason: format!("{why}; LOCAL_RANK={rank}"),
            }),
            count => Err(Error::LocalRankOutOfRange {
                local_rank: rank,
                count,
                visible: env.raw.visible_for_message(),
            }),
        };
    }
    if gpus.len() == 1 {
        return Ok(Selection {
            device: Device::Cuda(0),
            reason: format!("{why}; one GPU is visible"),
        });
    }
    // Most free memory; the lowest index wins ties and unknowns.
    let best = gpus
        .iter()
        .max_by(|a, b| a.free.cmp(&b.free).then(b.index.cmp(&a.index)))
        .copied()
        .unwrap_or(CudaCandidate {
            index: 0,
            free: None,
        });
    let reason = match best.free {
        Some(free) => format!(
            "{why}; {} GPUs are visible and cuda:{} has the most free memory ({free})",
            gpus.len(),
            best.index
        ),
        None => format!(
            "{why}; {} GPUs are visible, free memory unknown (no NVML): the first",
            gpus.len()
        ),
    };
    Ok(Selection {
        device: Device::Cuda(best.index),
        reason,
    })
}

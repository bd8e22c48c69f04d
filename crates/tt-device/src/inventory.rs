use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;
use serde::Serialize;

use crate::env::{CudaVisibleDevices, VisibleEntry};
use crate::Bytes;

/// A process using a GPU, as NVML lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuProcess {
    /// Process id (in NVML's pid namespace: the host's).
    pub pid: u32,
    /// GPU memory it uses, when the driver can say.
    pub used: Option<Bytes>,
}

/// One physical GPU, as NVML sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuInfo {
    /// NVML's index: the one `nvidia-smi` shows.
    pub nvml_index: u32,
    /// `GPU-...` UUID: the stable name of this physical GPU.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Memory on the device.
    pub total: Bytes,
    /// Memory free for every process.
    pub free: Bytes,
    /// Memory in use by every process.
    pub used: Bytes,
    /// Compute processes on it.
    pub processes: Vec<GpuProcess>,
}

/// Whether NVML could be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum NvmlStatus {
    /// NVML is loaded.
    Available {
        /// The NVIDIA driver's version.
        driver_version: String,
    },
    /// NVML is absent or failed; a normal condition on machines without NVIDIA GPUs.
    Unavailable {
        /// Why.
        reason: String,
    },
}

/// Every GPU on the machine (all of them, whatever `CUDA_VISIBLE_DEVICES` says).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Inventory {
    /// NVML's state.
    pub nvml: NvmlStatus,
    /// GPUs in NVML order.
    pub gpus: Vec<GpuInfo>,
    /// GPUs NVML listed but could not describe, with the reason.
    pub errors: Vec<String>,
}

/// A GPU visible to this process, with its logical CUDA index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VisibleGpu {
    /// `cuda:N` inside this process.
    pub index: usize,
    /// The physical GPU.
    pub gpu: GpuInfo,
}

impl Inventory {
    /// Queries NVML, loaded at run time. Without NVML (no NVIDIA driver) the
    /// inventory is empty and [`Inventory::nvml`] says why; this never fails.
    pub fn query() -> Inventory {
        let nvml = match Nvml::init() {
            Ok(nvml) => nvml,
            Err(e) => {
                return Inventory {
                    nvml: NvmlStatus::Unavailable {
                        reason: nvml_reason(&e),
                    },
                    gpus: Vec::new(),
                    errors: Vec::new(),
                }
            }
        };
        let driver_version = nvml
            .sys_driver_version()
            .unwrap_or_else(|e| format!("unknown ({e})"));
        let mut inventory = Inventory {
            nvml: NvmlStatus::Available { driver_version },
            gpus: Vec::new(),
            errors: Vec::new(),
        };
        let count = match nvml.device_count() {
            Ok(n) => n,
            Err(e) => {
                inventory
                    .errors
                    .push(format!("NVML could not count devices: {e}"));
                0
            }
        };
        for index in 0..count {
            match describe(&nvml, index) {
                Ok(gpu) => inventory.gpus.push(gpu),
                Err(e) => inventory.errors.push(format!("NVML device {index}: {e}")),
            }
        }
        inventory
    }

    /// The GPUs of CUDA's logical devices `cuda:0`, `cuda:1`, ..., given their UUIDs as
    /// the CUDA driver reports them ([`CudaDriver::uuids`](crate::CudaDriver::uuids)):
    /// the exact mapping, whatever `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER` say.
    /// `None` for a device NVML does not list under that UUID (a MIG instance).
    pub fn in_cuda_order(&self, uuids: &[String]) -> Vec<Option<&GpuInfo>> {
        uuids
            .iter()
            .map(|u| self.gpus.iter().find(|g| g.uuid.eq_ignore_ascii_case(u)))
            .collect()
    }

    /// The GPUs this process sees, in CUDA's logical order, after `visible`.
    ///
    /// Indices in `CUDA_VISIBLE_DEVICES` are taken as NVML's (true with
    /// `CUDA_DEVICE_ORDER=PCI_BUS_ID`, which torchtools recommends on machines
    /// with mixed GPU models); UUIDs, full or abbreviated, match exactly. As in
    /// CUDA, the list ends at the first entry that names no GPU. MIG instances
    /// are not resolved here and end the list too.
    pub fn visible(&self, visible: &CudaVisibleDevices) -> Vec<VisibleGpu> {
        let entries = match visible {
            CudaVisibleDevices::Unset => {
                return self
                    .gpus
                    .iter()
                    .cloned()
                    .enumerate()
                    .map(|(index, gpu)| VisibleGpu { index, gpu })
                    .collect()
            }
            CudaVisibleDevices::List(entries) => entries,
        };
        let mut out: Vec<VisibleGpu> = Vec::new();
        for entry in entries {
            let found = match entry {
                VisibleEntry::Index(i) => self.gpus.iter().find(|g| g.nvml_index == *i),
                VisibleEntry::Uuid(prefix) => {
                    let mut matches = self
                        .gpus
                        .iter()
                        .filter(|g| g.uuid.starts_with(prefix.as_str()));
                    match (matches.next(), matches.next()) {
                        (Some(g), None) => Some(g),
                        _ => None, // unknown or ambiguous prefix: CUDA stops here too
                    }
                }
                VisibleEntry::Mig(_) => None,
            };
            match found {
                // A device listed twice makes CUDA stop as well.
                Some(gpu) if !out.iter().any(|v| v.gpu.uuid == gpu.uuid) => out.push(VisibleGpu {
                    index: out.len(),
                    gpu: gpu.clone(),
                }),
                _ => break,
            }
        }
        out
    }
}

/// A short reason for `Nvml::init()` failing: usually no NVIDIA driver.
fn nvml_reason(e: &nvml_wrapper::error::NvmlError) -> String {
    let text = e.to_string();
    match text.strip_prefix("a libloading error occurred: ") {
        Some(why) => format!("no NVIDIA driver (NVML: {why})"),
        None => format!("NVML failed to start: {text}"),
    }
}

fn describe(nvml: &Nvml, index: u32) -> Result<GpuInfo, nvml_wrapper::error::NvmlError> {
    let device = nvml.device_by_index(index)?;
    let memory = device.memory_info()?;
    let processes = device
        .running_compute_processes()
        .unwrap_or_default()
        .into_iter()
        .map(|p| GpuProcess {
            pid: p.pid,
            used: match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(Bytes(b)),
                UsedGpuMemory::Unavailable => None,
            },
        })
        .collect();
    Ok(GpuInfo {
        nvml_index: index,
        uuid: device.uuid()?,
        name: device.name()?,
        total: Bytes(memory.total),
        free: Bytes(memory.free),
        used: Bytes(memory.used),
        processes,
    })
}

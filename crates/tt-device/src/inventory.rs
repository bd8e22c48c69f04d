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
    /// Percent of time a kernel ran over the driver's last sample period, when it can say.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub utilization: Option<u32>,
    /// The processes on it (compute, then graphics).
    pub processes: Vec<GpuProcess>,
    /// Its MIG instances, when MIG mode is on (empty otherwise). CUDA names a MIG
    /// instance by the instance's UUID, never the GPU's: [`Inventory::gpu_of`] maps one
    /// back to this GPU, so that locks stay one per physical GPU.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub mig: Vec<MigInstance>,
}

/// A MIG (Multi-Instance GPU) instance of a GPU, as NVML lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MigInstance {
    /// `MIG-...` UUID: what `CUDA_VISIBLE_DEVICES` and the CUDA driver name it by (the
    /// driver's 16 bytes are this UUID's).
    pub uuid: String,
}

/// The hex digits of a `GPU-`/`MIG-` UUID, lowercase: the CUDA driver's bytes of a MIG
/// instance are NVML's `MIG-` UUID, but formatted as every CUDA UUID is (`GPU-`).
fn uuid_digits(uuid: &str) -> String {
    let rest = match uuid.get(..4) {
        Some(p) if p.eq_ignore_ascii_case("GPU-") || p.eq_ignore_ascii_case("MIG-") => &uuid[4..],
        _ => uuid,
    };
    rest.to_ascii_lowercase()
}

/// Where the GPUs are read from: NVML on a real machine ([`NvmlBackend`]); a fixed
/// [`Inventory`] (which is a backend too) in tests, or another source of GPUs. Every
/// torchtools part that needs the GPUs of the machine takes one, so none of them opens
/// NVML on its own.
pub trait GpuBackend: Send + Sync {
    /// The machine's GPUs now, or why there are none.
    fn inventory(&self) -> Inventory;
}

/// A fixed inventory: what it holds, every time (a test double, or a snapshot).
impl GpuBackend for Inventory {
    fn inventory(&self) -> Inventory {
        self.clone()
    }
}

/// NVML, loaded at run time and opened once: each [`GpuBackend::inventory`] asks it
/// again (memory, processes and use change; the GPUs do not).
pub struct NvmlBackend {
    nvml: Result<Nvml, String>,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.nvml {
            Ok(_) => f.write_str("NvmlBackend(open)"),
            Err(why) => write!(f, "NvmlBackend(unavailable: {why})"),
        }
    }
}

impl NvmlBackend {
    /// Opens NVML; without it (no NVIDIA driver) every inventory is empty and says why.
    pub fn open() -> NvmlBackend {
        NvmlBackend {
            nvml: Nvml::init().map_err(|e| nvml_reason(&e)),
        }
    }
}

impl GpuBackend for NvmlBackend {
    fn inventory(&self) -> Inventory {
        let nvml = match &self.nvml {
            Ok(nvml) => nvml,
            Err(reason) => {
                return Inventory {
                    nvml: NvmlStatus::Unavailable {
                        reason: reason.clone(),
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
            match describe(nvml, index) {
                Ok(gpu) => inventory.gpus.push(gpu),
                Err(e) => inventory.errors.push(format!("NVML device {index}: {e}")),
            }
        }
        inventory
    }
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
    /// inventory is empty and [`Inventory::nvml`] says why; this never fails. (A
    /// program that asks again and again, such as a live view, keeps one
    /// [`NvmlBackend`] open instead.)
    pub fn query() -> Inventory {
        NvmlBackend::open().inventory()
    }

    /// The GPUs of CUDA's logical devices `cuda:0`, `cuda:1`, ..., given their UUIDs as
    /// the CUDA driver reports them ([`CudaDriver::uuids`](crate::CudaDriver::uuids)):
    /// the exact mapping, whatever `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER` say.
    /// `None` for a device NVML does not list under that UUID (a MIG instance).
    pub fn in_cuda_order(&self, uuids: &[String]) -> Vec<Option<&GpuInfo>> {
        uuids.iter().map(|u| self.gpu_of(u)).collect()
    }

    /// The physical GPU of a CUDA device, given the UUID the CUDA driver reports for it
    /// (`cuDeviceGetUuid`): the GPU with that UUID, or the GPU of which it is a MIG
    /// instance. `None` when NVML lists neither.
    pub fn gpu_of(&self, cuda_uuid: &str) -> Option<&GpuInfo> {
        let digits = uuid_digits(cuda_uuid);
        self.gpus
            .iter()
            .find(|g| g.uuid.eq_ignore_ascii_case(cuda_uuid))
            .or_else(|| {
                self.gpus
                    .iter()
                    .find(|g| g.mig.iter().any(|m| uuid_digits(&m.uuid) == digits))
            })
    }

    /// The CUDA ordinal (`cuda:N`) of the physical GPU `gpu_uuid` among the devices the
    /// CUDA driver lists (`uuids`, in CUDA's order): the first device that is that GPU or
    /// one of its MIG instances.
    pub fn cuda_ordinal_of(&self, gpu_uuid: &str, uuids: &[String]) -> Option<usize> {
        uuids.iter().position(|u| {
            self.gpu_of(u)
                .map_or(u.eq_ignore_ascii_case(gpu_uuid), |g| {
                    g.uuid.eq_ignore_ascii_case(gpu_uuid)
                })
        })
    }

    /// The GPUs this process sees, in CUDA's logical order, after `visible`.
    ///
    /// Indices in `CUDA_VISIBLE_DEVICES` are taken as NVML's (true with
    /// `CUDA_DEVICE_ORDER=PCI_BUS_ID`, which torchtools recommends on machines
    /// with mixed GPU models); UUIDs, full or abbreviated, match exactly. As in
    /// CUDA, the list ends at the first entry that names no GPU. A MIG instance
    /// (`MIG-...`) stands for the GPU it is part of.
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
                VisibleEntry::Mig(prefix) => {
                    let digits = uuid_digits(prefix);
                    let mut matches = self.gpus.iter().filter(|g| {
                        g.mig
                            .iter()
                            .any(|m| uuid_digits(&m.uuid).starts_with(&digits))
                    });
                    match (matches.next(), matches.next()) {
                        (Some(g), None) => Some(g),
                        _ => None,
                    }
                }
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
    // Compute processes, then graphics ones not already listed (a process doing both
    // shows once).
    let mut processes: Vec<GpuProcess> = Vec::new();
    let compute = device.running_compute_processes().unwrap_or_default();
    let graphics = device.running_graphics_processes().unwrap_or_default();
    for p in compute.into_iter().chain(graphics) {
        if processes.iter().any(|q| q.pid == p.pid) {
            continue;
        }
        processes.push(GpuProcess {
            pid: p.pid,
            used: match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(Bytes(b)),
                UsedGpuMemory::Unavailable => None,
            },
        });
    }
    Ok(GpuInfo {
        nvml_index: index,
        uuid: device.uuid()?,
        name: device.name()?,
        total: Bytes(memory.total),
        free: Bytes(memory.free),
        used: Bytes(memory.used),
        utilization: device.utilization_rates().ok().map(|u| u.gpu),
        processes,
        mig: mig_instances(&device),
    })
}

/// The MIG instances of a GPU in MIG mode; none otherwise (or when NVML cannot say).
fn mig_instances(device: &nvml_wrapper::Device<'_>) -> Vec<MigInstance> {
    let on = device.mig_mode().is_ok_and(|m| m.current == 1);
    if !on {
        return Vec::new();
    }
    let count = device.mig_device_count().unwrap_or(0);
    (0..count)
        .filter_map(|i| device.mig_device_by_index(i).ok())
        .filter_map(|m| m.uuid().ok())
        .map(|uuid| MigInstance { uuid })
        .collect()
}

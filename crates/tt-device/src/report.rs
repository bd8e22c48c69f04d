use std::fmt;

use serde::Serialize;

use crate::env::{CudaVisibleDevices, EnvConfig, RawEnv};
use crate::inventory::{Inventory, NvmlStatus, VisibleGpu};
use crate::select::{select_with, Availability, CudaCandidate, Selection};
use crate::{CpuBudget, Result};

/// Whose view a report gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum View {
    /// libtorch's own (feature `tch`): what a training process will get.
    Libtorch,
    /// NVML's alone (the libtorch-free CLI): what libtorch will see if it has CUDA.
    Nvml,
}

/// The libtorch in use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LibtorchInfo {
    /// Version, e.g. `2.11.0`.
    pub version: String,
    /// Directory of the loaded libraries.
    pub lib_dir: Option<String>,
    /// CUDA runtime it was built with (`13.0`), when `libtorch_cuda` is loaded.
    pub cuda_runtime: Option<String>,
    /// The intra-op threads libtorch uses now (`at::get_num_threads`).
    pub intra_op_threads: Option<usize>,
}

/// One backend and whether it can be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Backend {
    /// `cuda`, `mps` or `cpu`.
    pub name: &'static str,
    /// Usable in this process.
    pub available: bool,
    /// The devices, or why not.
    pub detail: String,
}

/// Everything about devices in one place: text through `Display`, JSON through serde.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceReport {
    /// Whose view this is.
    pub view: View,
    /// The libtorch in use (`None` in the NVML view).
    pub libtorch: Option<LibtorchInfo>,
    /// CUDA, MPS, CPU.
    pub backends: Vec<Backend>,
    /// NVML's state.
    pub nvml: NvmlStatus,
    /// GPUs visible to this process, with logical indices.
    pub gpus: Vec<VisibleGpu>,
    /// GPUs on the machine that `CUDA_VISIBLE_DEVICES` hides.
    pub hidden_gpus: usize,
    /// The variables read.
    pub env: RawEnv,
    /// The chosen device.
    pub selected: Option<Selection>,
    /// Why no device could be chosen (bad variable, device not usable).
    pub error: Option<String>,
    /// The CPUs this process may use and the thread count that follows (read from the
    /// kernel in a real process; `None` in a report assembled from given parts).
    pub cpu: Option<CpuBudget>,
}

impl Availability {
    /// What NVML alone says (no libtorch): CUDA devices are the GPUs visible
    /// after `CUDA_VISIBLE_DEVICES`; MPS is never known here.
    pub fn from_nvml(
        inventory: &Inventory,
        visible: &CudaVisibleDevices,
        raw: &RawEnv,
    ) -> Availability {
        let gpus = inventory.visible(visible);
        let cuda = if !gpus.is_empty() {
            Ok(gpus
                .iter()
                .map(|v| CudaCandidate {
                    index: v.index,
                    free: Some(v.gpu.free),
                })
                .collect())
        } else {
            Err(match &inventory.nvml {
                NvmlStatus::Unavailable { reason } => reason.clone(),
                NvmlStatus::Available { .. } if inventory.gpus.is_empty() => {
                    "NVML lists no GPU".to_owned()
                }
                NvmlStatus::Available { .. } => format!(
                    "CUDA_VISIBLE_DEVICES={} hides all {} GPU(s)",
                    raw.visible_for_message(),
                    inventory.gpus.len()
                ),
            })
        };
        Availability {
            cuda,
            mps: Err(mps_unknown()),
        }
    }
}

fn mps_unknown() -> String {
    if cfg!(target_os = "macos") {
        "not known without libtorch".to_owned()
    } else {
        "MPS exists only on macOS with Apple silicon".to_owned()
    }
}

impl DeviceReport {
    /// Assembles a report; `env` is the parsed environment or the error it gave.
    pub fn assemble(
        view: View,
        env: Result<EnvConfig>,
        raw: RawEnv,
        inventory: &Inventory,
        avail: &Availability,
        libtorch: Option<LibtorchInfo>,
    ) -> DeviceReport {
        let visible = match &env {
            Ok(env) => env.visible.clone(),
            Err(_) => CudaVisibleDevices::Unset,
        };
        let gpus = inventory.visible(&visible);
        let (selected, error) = match env.and_then(|env| select_with(&env, avail)) {
            Ok(s) => (Some(s), None),
            Err(e) => (None, Some(e.to_string())),
        };
        let backend = |name, r: &std::result::Result<String, String>| match r {
            Ok(d) => Backend {
                name,
                available: true,
                detail: d.clone(),
            },
            Err(d) => Backend {
                name,
                available: false,
                detail: d.clone(),
            },
        };
        let cuda = avail
            .cuda
            .as_ref()
            .map(|c| format!("{} device(s)", c.len()))
            .map_err(Clone::clone);
        let mps = avail
            .mps
            .as_ref()
            .map(|()| "available".to_owned())
            .map_err(Clone::clone);
        DeviceReport {
            view,
            libtorch,
            backends: vec![
                backend("cuda", &cuda),
                backend("mps", &mps),
                backend("cpu", &Ok("always".into())),
            ],
            nvml: inventory.nvml.clone(),
            hidden_gpus: inventory.gpus.len().saturating_sub(gpus.len()),
            gpus,
            env: raw,
            selected,
            error,
            cpu: None,
        }
    }

    /// The NVML view, from the process environment: no libtorch needed.
    pub fn nvml_view() -> DeviceReport {
        DeviceReport::from_process(View::Nvml, None, |inventory, visible, raw| {
            Availability::from_nvml(inventory, visible, raw)
        })
    }

    /// Reads the environment and NVML, asks `availability` what can be used, and
    /// assembles the report. A bad variable lands in [`DeviceReport::error`].
    pub(crate) fn from_process(
        view: View,
        libtorch: Option<LibtorchInfo>,
        availability: impl FnOnce(&Inventory, &CudaVisibleDevices, &RawEnv) -> Availability,
    ) -> DeviceReport {
        let raw = RawEnv::from_env();
        let env = EnvConfig::from_raw(raw.clone());
        let inventory = Inventory::query();
        let visible = env
            .as_ref()
            .map(|e| e.visible.clone())
            .unwrap_or(CudaVisibleDevices::Unset);
        let avail = availability(&inventory, &visible, &raw);
        let mut report = DeviceReport::assemble(view, env, raw, &inventory, &avail, libtorch);
        report.cpu = Some(CpuBudget::query());
        report
    }
}

impl fmt::Display for DeviceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let view = match self.view {
            View::Libtorch => "libtorch's view",
            View::Nvml => "NVML's view, without libtorch",
        };
        writeln!(f, "torchtools device report ({view})")?;
        match &self.libtorch {
            Some(lt) => {
                let cuda = lt
                    .cuda_runtime
                    .as_deref()
                    .map(|v| format!(", CUDA runtime {v}"))
                    .unwrap_or_default();
                writeln!(f, "  libtorch     {}{cuda}", lt.version)?;
                if let Some(dir) = &lt.lib_dir {
                    writeln!(f, "               {dir}")?;
                }
            }
            None => writeln!(f, "  libtorch     not loaded (this view does not need it)")?,
        }
        for (i, b) in self.backends.iter().enumerate() {
            let head = if i == 0 {
                "  backends     "
            } else {
                "               "
            };
            let state = if b.available { "yes" } else { "no " };
            writeln!(f, "{head}{:<5}{state}  {}", b.name, b.detail)?;
        }
        match &self.nvml {
            NvmlStatus::Available { driver_version } => {
                writeln!(f, "  NVML         driver {driver_version}")?
            }
            NvmlStatus::Unavailable { reason } => {
                writeln!(f, "  NVML         unavailable: {reason}")?
            }
        }
        self.fmt_gpus(f)?;
        let show = |v: &Option<String>| {
            v.as_ref()
                .map(|v| format!("{v:?}"))
                .unwrap_or_else(|| "<unset>".into())
        };
        writeln!(
            f,
            "  environment  TORCHTOOLS_DEVICE={}  LOCAL_RANK={}  CUDA_VISIBLE_DEVICES={}",
            show(&self.env.torchtools_device),
            show(&self.env.local_rank),
            show(&self.env.cuda_visible_devices)
        )?;
        self.fmt_threads(f)?;
        match (&self.selected, &self.error) {
            (Some(s), _) => write!(f, "  selected     {} ({})", s.device, s.reason),
            (None, Some(e)) => write!(f, "  selected     none: {e}"),
            (None, None) => write!(f, "  selected     none"),
        }
    }
}

impl DeviceReport {
    /// The GPUs lines: each visible GPU, its MIG instances, the hidden ones.
    fn fmt_gpus(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.gpus.is_empty() {
            writeln!(f, "  GPUs         none visible")?;
        }
        for (i, v) in self.gpus.iter().enumerate() {
            let head = if i == 0 {
                "  GPUs         "
            } else {
                "               "
            };
            let g = &v.gpu;
            writeln!(
                f,
                "{head}cuda:{:<2} nvml {:<2} {}  {}  {} total, {} free, {} process(es)",
                v.index,
                g.nvml_index,
                g.uuid,
                g.name,
                g.total,
                g.free,
                g.processes.len()
            )?;
            if !g.mig.is_empty() {
                let names: Vec<&str> = g.mig.iter().map(|m| m.uuid.as_str()).collect();
                writeln!(
                    f,
                    "               MIG mode: {} instance(s), locked as this one GPU: {}",
                    names.len(),
                    names.join(", ")
                )?;
            }
        }
        if self.hidden_gpus > 0 {
            writeln!(
                f,
                "               ({} more hidden by CUDA_VISIBLE_DEVICES)",
                self.hidden_gpus
            )?;
        }
        Ok(())
    }

    /// The threads line: the CPU budget, and what libtorch uses when it is loaded.
    fn fmt_threads(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(cpu) = &self.cpu {
            let now = self
                .libtorch
                .as_ref()
                .and_then(|lt| lt.intra_op_threads)
                .map(|n| {
                    if n == cpu.threads {
                        format!("; libtorch uses {n}")
                    } else {
                        format!(
                            "; libtorch uses {n} now (torchtools::use_allowed_threads() sets {})",
                            cpu.threads
                        )
                    }
                })
                .unwrap_or_default();
            writeln!(f, "  threads      {cpu}{now}")?;
        }
        Ok(())
    }
}

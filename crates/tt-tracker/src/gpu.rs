//! GPU figures through NVML, in process (loaded at run time): per-process memory of the
//! tracked tree, per-GPU memory and utilisation, and the energy counter.

use std::collections::HashSet;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;

use crate::usage::GpuEnergy;

/// One tick's GPU figures, in bytes and percent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct GpuSample {
    pub(crate) main: u64,
    pub(crate) descendants: u64,
    pub(crate) system: u64,
    /// Sum of the tracked GPUs' utilisation.
    pub(crate) util_sum: f64,
    /// A PID NVML lists that names no process of this PID namespace (see
    /// [`invisible_pid_note`]), if any.
    pub(crate) invisible: Option<u32>,
}

pub(crate) struct Gpus {
    nvml: Option<Nvml>,
    /// (NVML index, UUID, tracked for utilisation)
    devices: Vec<(u32, String, bool)>,
    energy_start: Vec<Option<u64>>,
    pub(crate) capacity: u64,
}

// Left out of mutation testing: NVML readings of a real GPU, which the GPU tests
// cover (`cargo xtask test-gpu`).
#[cfg_attr(mutants, mutants::skip)]
impl Gpus {
    /// Opens NVML. Without it: no GPUs and one warning. `only` restricts utilisation
    /// and energy to these UUIDs (an unknown UUID is returned as an error message);
    /// without it, `indices` (a Slurm job's GPUs, by the node's indices) does.
    pub(crate) fn open(only: Option<&[String]>, indices: Option<&[u32]>) -> (Gpus, Option<String>) {
        let empty = |warning: String| {
            (
                Gpus {
                    nvml: None,
                    devices: Vec::new(),
                    energy_start: Vec::new(),
                    capacity: 0,
                },
                Some(warning),
            )
        };
        let nvml = match Nvml::init() {
            Ok(n) => n,
            Err(e) => {
                return empty(format!(
                    "NVML is unavailable ({e}): GPU RAM, utilisation and energy stay 0"
                ))
            }
        };
        let count = nvml.device_count().unwrap_or(0);
        let mut devices = Vec::new();
        let mut capacity = 0;
        let mut energy_start = Vec::new();
        for index in 0..count {
            let Ok(device) = nvml.device_by_index(index) else {
                continue;
            };
            let uuid = device.uuid().unwrap_or_default();
            let tracked = match (only, indices) {
                (Some(u), _) => u.iter().any(|x| x.eq_ignore_ascii_case(&uuid)),
                (None, Some(indices)) => indices.contains(&index),
                (None, None) => true,
            };
            capacity += device.memory_info().map(|m| m.total).unwrap_or(0);
            energy_start.push(if tracked {
                device.total_energy_consumption().ok()
            } else {
                None
            });
            devices.push((index, uuid, tracked));
        }
        let mut warning = None;
        if let Some(only) = only {
            let unknown: Vec<&String> = only
                .iter()
                .filter(|u| !devices.iter().any(|(_, d, _)| d.eq_ignore_ascii_case(u)))
                .collect();
            if !unknown.is_empty() {
                warning = Some(format!(
                    "GPU UUID(s) {unknown:?} are not on this machine; known: {:?}",
                    devices.iter().map(|(_, u, _)| u).collect::<Vec<_>>()
                ));
            }
        }
        (
            Gpus {
                nvml: Some(nvml),
                devices,
                energy_start,
                capacity,
            },
            warning,
        )
    }

    /// GPUs in the system, and those tracked.
    pub(crate) fn counts(&self) -> (usize, usize) {
        (
            self.devices.len(),
            self.devices.iter().filter(|d| d.2).count(),
        )
    }

    pub(crate) fn available(&self) -> bool {
        self.nvml.is_some()
    }

    pub(crate) fn sample(&self, main: u32, descendants: &HashSet<u32>) -> GpuSample {
        let mut s = GpuSample::default();
        let Some(nvml) = &self.nvml else { return s };
        for (index, _, tracked) in &self.devices {
            let Ok(device) = nvml.device_by_index(*index) else {
                continue;
            };
            if let Ok(m) = device.memory_info() {
                s.system += m.used;
            }
            if *tracked {
                if let Ok(u) = device.utilization_rates() {
                    s.util_sum += f64::from(u.gpu);
                }
            }
            for p in device.running_compute_processes().unwrap_or_default() {
                let used = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => b,
                    UsedGpuMemory::Unavailable => 0,
                };
                if p.pid == main {
                    s.main += used;
                } else if descendants.contains(&p.pid) {
                    s.descendants += used;
                } else if s.invisible.is_none()
                    && !std::path::Path::new(&format!("/proc/{}", p.pid)).exists()
                {
                    s.invisible = Some(p.pid);
                }
            }
        }
        s
    }

    /// Energy since `open`, per tracked GPU.
    pub(crate) fn energy(&self) -> Vec<GpuEnergy> {
        let Some(nvml) = &self.nvml else {
            return Vec::new();
        };
        self.devices
            .iter()
            .zip(&self.energy_start)
            .filter_map(|((index, uuid, _), start)| {
                let start = (*start)?;
                let now = nvml
                    .device_by_index(*index)
                    .ok()?
                    .total_energy_consumption()
                    .ok()?;
                Some(GpuEnergy {
                    uuid: uuid.clone(),
                    joules: now.saturating_sub(start) as f64 / 1e3,
                })
            })
            .collect()
    }
}

/// The report's note when the tracked processes' GPU memory read 0 while NVML listed a
/// process (`pid`) this namespace cannot see, inside a container: a driver that lists
/// host PIDs there makes the memory impossible to attribute (NVIDIA's driver 580
/// translates them into the container's namespace, and the figures are exact). `None`
/// outside containers, or when memory was attributed.
pub(crate) fn invisible_pid_note(pid: u32, attributed: u64) -> Option<String> {
    (attributed == 0 && tt_device::in_a_pid_namespace()).then(|| {
        format!(
            "the tracked processes' GPU RAM reads 0, and NVML listed a GPU process (pid \
             {pid}) that this PID namespace (a container) cannot see: if the command used \
             the GPU, this NVIDIA driver reports PIDs of another namespace and its memory \
             cannot be attributed here (the system's GPU RAM is exact); track from the host \
             or run the container with --pid=host"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::invisible_pid_note;

    #[test]
    fn the_note_speaks_only_for_unattributed_memory_inside_a_container() {
        assert_eq!(invisible_pid_note(7, 1 << 30), None);
        let own = std::fs::read_link("/proc/self/ns/pid").unwrap();
        let in_container = own.to_string_lossy() != "pid:[4026531836]";
        let note = invisible_pid_note(7, 0);
        assert_eq!(note.is_some(), in_container, "{note:?}");
    }
}

//! libtorch's view of the devices (feature `tch`).

use crate::env::{CudaVisibleDevices, EnvConfig};
use crate::inventory::Inventory;
use crate::report::{DeviceReport, LibtorchInfo, View};
use crate::select::{select_with, Availability, CudaCandidate, Device, Selection};
use crate::Result;

impl From<Device> for tch::Device {
    fn from(d: Device) -> tch::Device {
        match d {
            Device::Cpu => tch::Device::Cpu,
            Device::Cuda(n) => tch::Device::Cuda(n),
            Device::Mps => tch::Device::Mps,
        }
    }
}

/// What libtorch can use in this process. Loads `libtorch_cuda.so` (through
/// [`tt_sys::ensure_cuda_loaded`]) so that a GPU is never missed; free memory per
/// device comes from `inventory` (NVML) when its visible GPUs match libtorch's count.
pub fn availability(visible: &CudaVisibleDevices, inventory: &Inventory) -> Availability {
    let cuda = match tt_sys::ensure_cuda_loaded() {
        Ok(info) => {
            // The driver's UUIDs tie each ordinal to its GPU; without them,
            // CUDA_VISIBLE_DEVICES read as NVML indices (true with PCI_BUS_ID order).
            let by_uuid = crate::CudaDriver::init()
                .and_then(|d| d.uuids())
                .ok()
                .filter(|u| u.len() == info.device_count)
                .map(|u| {
                    inventory
                        .in_cuda_order(&u)
                        .into_iter()
                        .map(|g| g.map(|g| g.free))
                        .collect::<Vec<_>>()
                });
            let free = by_uuid.unwrap_or_else(|| {
                let visible = inventory.visible(visible);
                let known = visible.len() == info.device_count;
                (0..info.device_count)
                    .map(|i| known.then(|| visible[i].gpu.free))
                    .collect()
            });
            Ok(free
                .into_iter()
                .enumerate()
                .map(|(index, free)| CudaCandidate { index, free })
                .collect())
        }
        Err(why) => Err(why.to_string()),
    };
    let mps = if tch::utils::has_mps() {
        Ok(())
    } else {
        Err("this libtorch has no usable MPS backend (MPS needs macOS on Apple silicon)".to_owned())
    };
    Availability { cuda, mps }
}

/// Chooses the device from `TORCHTOOLS_DEVICE`, `LOCAL_RANK`,
/// `CUDA_VISIBLE_DEVICES` and what libtorch can use, with the reason.
pub fn select_device() -> Result<Selection> {
    let env = EnvConfig::from_env()?;
    if env.request == crate::DeviceRequest::Cpu {
        // Nothing to probe: loading libtorch_cuda (~0.3 s) and NVML would only cost time.
        return select_with(
            &env,
            &Availability {
                cuda: Err("not probed: the CPU was asked for".into()),
                mps: Err("not probed: the CPU was asked for".into()),
            },
        );
    }
    let inventory = Inventory::query();
    select_with(&env, &availability(&env.visible, &inventory))
}

/// Like [`select_device`], as a `tch::Device`. Unlike `Device::cuda_if_available()`,
/// it never falls back silently: asking for CUDA where it is unusable is an error
/// that says why.
pub fn select() -> Result<tch::Device> {
    select_device().map(|s| s.device.into())
}

/// The full report in libtorch's view. Never fails: a bad variable is reported in
/// [`DeviceReport::error`].
pub fn report() -> DeviceReport {
    let cuda_runtime = tt_sys::ensure_cuda_loaded().ok().map(|i| {
        format!(
            "{}.{}",
            i.runtime_version / 1000,
            (i.runtime_version % 1000) / 10
        )
    });
    let libtorch = LibtorchInfo {
        version: tt_sys::libtorch_version().to_owned(),
        lib_dir: tt_sys::libtorch_lib_dir()
            .ok()
            .map(|d| d.display().to_string()),
        cuda_runtime,
        intra_op_threads: usize::try_from(tch::get_num_threads()).ok(),
    };
    DeviceReport::from_process(View::Libtorch, Some(libtorch), |inventory, visible, _| {
        availability(visible, inventory)
    })
}

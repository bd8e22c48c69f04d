#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
mod fence;
mod keeper;
mod options;
mod reservation;
mod take;

use tt_device::{GpuBackend, NvmlBackend};

pub use error::Error;
pub use options::ReserveOptions;
pub use reservation::{fence_release_hook, Reservation, ReservedGpu, Waiting, SHARE_FRACTION_ENV};
pub use take::within_slurm_job;

/// Reserves GPU(s) for a training job: takes the lock of each (waiting as `options`
/// say), then raises a fence leaving `training_reserved_bytes + safety_margin_bytes`
/// free for the job. Hold the returned [`Reservation`] while training. Waiting for a
/// GPU someone else holds is logged (`tracing`, level info); [`reserve_with`] lets you
/// show it yourself.
pub fn reserve(options: ReserveOptions) -> Result<Reservation, Error> {
    reserve_with(options, |w| tracing::info!("{w}"))
}

/// [`reserve`], calling `on_wait` once when a GPU is held by someone else and the
/// options say to wait.
pub fn reserve_with(
    options: ReserveOptions,
    on_wait: impl FnOnce(&Waiting),
) -> Result<Reservation, Error> {
    reserve_on(&NvmlBackend::open(), options, on_wait)
}

/// [`reserve_with`] on the GPUs `machine` lists (NVML's through [`NvmlBackend`] in
/// [`reserve`]; another backend, such as a fixed inventory, chooses among its GPUs).
/// The request is checked, then the locks taken, then the fences raised.
pub fn reserve_on(
    machine: &dyn GpuBackend,
    options: ReserveOptions,
    on_wait: impl FnOnce(&Waiting),
) -> Result<Reservation, Error> {
    let request = options.check()?;
    match take::take_locks(machine, &options, request, on_wait)? {
        Some(taken) => fence::fence(machine, &options, taken),
        None => Ok(Reservation::new(Vec::new(), Vec::new(), None)),
    }
}

#[cfg(test)]
mod tests {
    use crate::reservation::alloc_conf_with_fraction;
    use crate::take::usable;
    use tt_device::{Bytes, GpuInfo, Inventory, NvmlStatus};

    #[test]
    fn auto_chooses_among_the_gpus_cuda_visible_devices_leaves() {
        let gpu = |i: u32, free: u64| GpuInfo {
            nvml_index: i,
            uuid: format!("GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-0000-0000-000000000000"),
            name: "NVIDIA H100".into(),
            total: Bytes::gib(80),
            free: Bytes::gib(free),
            used: Bytes::gib(80 - free),
            utilization: None,
            processes: vec![],
            mig: vec![],
        };
        let machine = Inventory {
            nvml: NvmlStatus::Available {
                driver_version: "580.00".into(),
            },
            gpus: vec![gpu(0, 70), gpu(1, 10), gpu(2, 40)],
            errors: vec![],
        };
        let indices = |v: Option<&str>| -> Vec<u32> {
            let visible = match v {
                None => tt_device::CudaVisibleDevices::Unset,
                Some(v) => tt_device::CudaVisibleDevices::parse(v).unwrap(),
            };
            usable(&machine, &visible)
                .gpus
                .iter()
                .map(|g| g.nvml_index)
                .collect()
        };
        assert_eq!(indices(None), [0, 1, 2]);
        // GPU 0 has the most free memory, but this process may not use it.
        assert_eq!(indices(Some("1,2")), [1, 2]);
        assert_eq!(indices(Some("GPU-2222")), [2]);
        assert_eq!(indices(Some("")), Vec::<u32>::new());
    }

    #[test]
    fn a_share_caps_pytorchs_allocator_and_keeps_the_users_other_options() {
        assert_eq!(
            alloc_conf_with_fraction(None, 0.25),
            "per_process_memory_fraction:0.250000"
        );
        assert_eq!(
            alloc_conf_with_fraction(
                Some("expandable_segments:True, per_process_memory_fraction:0.9"),
                0.5
            ),
            "expandable_segments:True,per_process_memory_fraction:0.500000"
        );
    }
}

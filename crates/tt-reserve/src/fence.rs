//! The fences of a reservation whose locks are taken: one per GPU leaving the job's
//! bytes free, or a shared GPU's keeper following the sharers' ledger.

use tt_device::{Bytes, CudaDriver, GpuBackend};
use tt_fence::{Fence, FenceOptions};
use tt_lock::GpuKey;

use crate::error::Error;
use crate::keeper;
use crate::options::ReserveOptions;
use crate::reservation::{Reservation, ReservedGpu};
use crate::take::Taken;

/// The reservation of `taken`'s locks, its fences raised as `options` ask (on error
/// the reservation so far is dropped: fences lowered, locks released).
pub(crate) fn fence(
    machine: &dyn GpuBackend,
    options: &ReserveOptions,
    taken: Taken,
) -> Result<Reservation, Error> {
    let Taken {
        dir,
        inventory,
        shared,
        locks,
    } = taken;
    // CUDA's devices by the driver's UUIDs: a locked GPU's ordinal is the first device
    // that is that GPU, or one of its MIG instances.
    let cuda_uuids = CudaDriver::init().and_then(|d| d.uuids()).ok();
    let gpus = locks
        .iter()
        .map(|lock| ReservedGpu {
            key: lock.key().clone(),
            ordinal: match (lock.key(), &cuda_uuids) {
                (GpuKey::Uuid(uuid), Some(uuids)) => inventory.cuda_ordinal_of(uuid, uuids),
                _ => None,
            },
            fenced: Bytes(0),
        })
        .collect();
    let share_fraction = shared
        .as_ref()
        .map(|(_, capacity)| options.training_reserved_bytes.0 as f64 / capacity.0 as f64);
    let mut reservation = Reservation::new(gpus, locks, share_fraction);
    if let (true, Some((GpuKey::Uuid(uuid), _)), Some(gpu), Some(lock)) = (
        options.fence,
        &shared,
        reservation.gpus.first(),
        reservation.locks.first(),
    ) {
        // The fence of a shared GPU follows the ledger (see `keeper`); this job's
        // budget is freed for it before its command starts.
        reservation.keeper = Some(keeper::Keeper::start(
            dir.clone(),
            keeper::Target {
                key: gpu.key.clone(),
                uuid: uuid.clone(),
                ordinal: gpu.ordinal,
                margin: options.safety_margin_bytes,
            },
            lock.holder().clone(),
        ));
        let room = Bytes(options.training_reserved_bytes.0 + options.safety_margin_bytes.0);
        if !keeper::wait_for_room(machine, uuid, room) {
            tracing::warn!(
                "{room} not free on {uuid} after {:?} (memory used outside the sharers' \
                 budgets): starting anyway",
                keeper::ADMISSION_WAIT
            );
        }
    }
    if options.fence && !options.share {
        let fence_options = FenceOptions {
            safety_margin: options.safety_margin_bytes,
            ..FenceOptions::keep_free(options.training_reserved_bytes)
        };
        for gpu in &mut reservation.gpus {
            let GpuKey::Uuid(uuid) = &gpu.key else {
                return Err(Error::FenceWithoutNvml {
                    gpu: gpu.key.clone(),
                });
            };
            // By ordinal where known: a GPU in MIG mode is reached through its instance.
            let fence = match gpu.ordinal {
                Some(ordinal) => Fence::raise(ordinal, &fence_options)?,
                None => Fence::raise_on_uuid(uuid, &fence_options)?,
            };
            gpu.fenced = fence.fenced();
            reservation.fences.push(fence);
        }
        reservation.record_fences();
    }
    Ok(reservation)
}

//! Copies between CUDA tensors and pinned host memory that do not stop the caller: what a
//! checkpoint of GPU state needs to be taken while training goes on
//! ([`HostCopies`]), and to be loaded onto the GPU at the speed of pinned memory
//! ([`DeviceUploads`]).

use std::ffi::c_void;
use std::ptr::NonNull;

use tch::{Device, Tensor};

use crate::error::{Error, Result};
use crate::ffi::{self, check};

/// Host copies of CUDA tensors, queued on the device's current stream; their bytes are
/// readable once [`wait`](HostCopies::wait) returns.
///
/// The copies run after the work already queued that produces the tensors and before
/// any work queued later (an optimizer step that changes them), so what they hold is
/// the tensors' value at the call, whatever the caller does next. The caller's thread
/// only queues them; the GPU spends the copy's time on the stream (about 20 ms per GiB
/// on a PCIe 5 H100). The host memory is pinned, from libtorch's caching host
/// allocator: the blocks of one checkpoint are reused by the next.
#[derive(Debug)]
pub struct HostCopies {
    tensors: Vec<Tensor>,
    event: Option<Event>,
}

#[derive(Debug)]
struct Event(NonNull<c_void>);

// SAFETY: a c10::Event may be waited for and destroyed from any thread (CUDA events
// are not tied to the thread that recorded them); the pointer is owned by this value.
unsafe impl Send for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the pointer came from tt_copy_to_host_async or tt_copy_to_device_async
        // and is freed once.
        unsafe { ffi::tt_event_free(self.0.as_ptr()) }
    }
}

impl Event {
    /// Waits until the work recorded before the event has run; `op` names it in an
    /// error.
    fn synchronize(&self, op: &'static str) -> Result<()> {
        // SAFETY: a live event from the shim, owned by `self`.
        unsafe { check(ffi::tt_event_synchronize(self.0.as_ptr())) }.map_err(|message| {
            Error::Torch {
                op,
                reason: message,
            }
        })
    }
}

impl HostCopies {
    /// Queues copies of `tensors` (all on CUDA device `device`) into pinned host memory
    /// and returns at once. On a CPU tensor list (no CUDA), returns the tensors as they
    /// are (already host memory; nothing to wait for).
    ///
    /// ```
    /// use tch::{Device, Kind, Tensor};
    /// // On a CPU the tensors are already in host memory: nothing is copied.
    /// let t = Tensor::arange(4, (Kind::Float, Device::Cpu));
    /// let copies = tt_sys::HostCopies::start(&[t.shallow_clone()])?;
    /// assert!(copies.wait()?[0].equal(&t));
    /// # Ok::<(), tt_sys::Error>(())
    /// ```
    pub fn start(tensors: &[Tensor]) -> Result<HostCopies> {
        let device = match tensors.first().map(Tensor::device) {
            Some(Device::Cuda(i)) => i,
            _ => {
                if let Some(t) = tensors.iter().find(|t| t.device() != Device::Cpu) {
                    return Err(Error::Torch {
                        op: "copy_to_host_async",
                        reason: format!("the tensors are on several devices ({:?})", t.device()),
                    });
                }
                return Ok(HostCopies {
                    tensors: tensors.iter().map(Tensor::shallow_clone).collect(),
                    event: None,
                });
            }
        };
        let src: Vec<*mut c_void> = tensors.iter().map(|t| t.as_ptr() as *mut c_void).collect();
        let mut out: Vec<*mut c_void> = vec![std::ptr::null_mut(); src.len()];
        let mut event: *mut c_void = std::ptr::null_mut();
        let device = i32::try_from(device).map_err(|_| Error::Torch {
            op: "copy_to_host_async",
            reason: format!("device index {device} is out of range"),
        })?;
        // SAFETY: the pointers are live tensors borrowed for the call; `out` has one
        // slot per tensor; the shim catches every C++ exception and writes the outputs
        // only on success.
        unsafe {
            check(ffi::tt_copy_to_host_async(
                src.as_ptr(),
                src.len(),
                device,
                out.as_mut_ptr(),
                &mut event,
            ))
        }
        .map_err(|message| Error::Torch {
            op: "copy_to_host_async",
            reason: message,
        })?;
        let tensors = out
            .into_iter()
            // SAFETY: each is a new `at::Tensor*` the shim allocated for us to own,
            // which is what tch's C_tensor is.
            .map(|p| unsafe { Tensor::from_ptr(p.cast()) })
            .collect();
        Ok(HostCopies {
            tensors,
            event: NonNull::new(event).map(Event),
        })
    }

    /// Waits until every copy has landed (at once when they have).
    pub fn synchronize(&self) -> Result<()> {
        match &self.event {
            Some(event) => event.synchronize("copy_to_host_async (waiting)"),
            None => Ok(()),
        }
    }

    /// The host tensors, in the order given: their bytes are the copies' only after
    /// [`synchronize`](Self::synchronize).
    pub fn host_tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// Waits until every copy has landed and returns the host tensors, in the order
    /// given.
    pub fn wait(mut self) -> Result<Vec<Tensor>> {
        self.synchronize()?;
        Ok(std::mem::take(&mut self.tensors))
    }
}

/// Host bytes copied into CUDA tensors through a few pinned buffers: what loads a
/// checkpoint onto the GPU (PyTorch's `pin_memory()` then `.to("cuda",
/// non_blocking=True)`, done piece by piece so that a few buffers serve any size).
///
/// Each piece of at most [`CHUNK`](Self::CHUNK) bytes is copied (by up to four threads)
/// into the next of [`DEPTH`](Self::DEPTH) pinned buffers, and its transfer is queued
/// on the device's current stream while the next piece is copied: the host's copy and
/// the transfer overlap, and the transfer runs at pinned memory's speed instead of
/// through the driver's pageable staging, which a plain `to_device` of host memory
/// waits for, tensor by tensor. A buffer is written again only after its last transfer
/// has landed. The transfers are queued before any work queued later on that stream,
/// so kernels launched after [`copy_into`](Self::copy_into) see the values;
/// [`finish`](Self::finish) waits until every transfer has landed. The buffers come
/// from libtorch's caching host allocator: the next `DeviceUploads` reuses them (and
/// the blocks a GPU checkpoint's [`HostCopies`] used).
#[derive(Debug)]
pub struct DeviceUploads {
    device: usize,
    slots: Vec<Slot>,
    next: usize,
}

#[derive(Debug)]
struct Slot {
    buffer: Tensor,
    pending: Option<Event>,
}

impl DeviceUploads {
    /// The largest piece one transfer carries (16 MiB).
    pub const CHUNK: usize = 16 << 20;
    /// How many pinned buffers of [`CHUNK`](Self::CHUNK) bytes take turns (4: 64 MiB
    /// of pinned host memory at most).
    pub const DEPTH: usize = 4;

    /// Uploads to `device`, which must be a CUDA device. Allocates nothing yet.
    ///
    /// ```
    /// // The host is not a target: a CPU tensor needs no upload.
    /// let err = tt_sys::DeviceUploads::new(tch::Device::Cpu).unwrap_err();
    /// assert!(err.to_string().contains("not a CUDA device"));
    /// ```
    pub fn new(device: Device) -> Result<DeviceUploads> {
        match device {
            Device::Cuda(device) => Ok(DeviceUploads {
                device,
                slots: Vec::new(),
                next: 0,
            }),
            other => Err(Error::Torch {
                op: "upload",
                reason: format!(
                    "the target {other:?} is not a CUDA device: host memory needs no upload \
                     (build a CPU tensor from the bytes instead)"
                ),
            }),
        }
    }

    /// Queues the copy of `bytes` into `dst`, a contiguous tensor on this uploader's
    /// device whose size in bytes is `bytes.len()` (its dtype's native byte order, as a
    /// safetensors file stores it). Returns once the bytes are in pinned buffers and
    /// their transfers queued: `bytes` may be dropped, `dst` holds them for every
    /// kernel queued after this on the device's current stream. A variable that
    /// requires grad may be the target (no graph is recorded).
    pub fn copy_into(&mut self, dst: &Tensor, bytes: &[u8]) -> Result<()> {
        let err = |message: String| Error::Torch {
            op: "upload",
            reason: message,
        };
        if dst.device() != Device::Cuda(self.device) {
            return Err(err(format!(
                "the target tensor is on {:?}, not on cuda:{}",
                dst.device(),
                self.device
            )));
        }
        if !dst.is_contiguous() {
            return Err(err(
                "the target tensor is not contiguous: upload into a contiguous tensor \
                 and copy it into the strided one on the GPU"
                    .into(),
            ));
        }
        let size = dst.numel() * dst.kind().elt_size_in_bytes();
        if size != bytes.len() {
            return Err(err(format!(
                "the target tensor ({:?}, {:?}) holds {size} bytes, the source has {}",
                dst.kind(),
                dst.size(),
                bytes.len()
            )));
        }
        if size == 0 {
            return Ok(());
        }
        let torch = |e: tch::TchError| err(e.to_string());
        // A variable that requires grad may be the target: a load is not a step.
        let flat =
            tch::no_grad(|| dst.f_reshape([-1])?.f_view_dtype(tch::Kind::Uint8)).map_err(torch)?;
        for (k, piece) in bytes.chunks(Self::CHUNK).enumerate() {
            let slot = self.next_slot()?;
            let len = piece.len();
            // SAFETY: the buffer is a live pinned uint8 tensor of CHUNK bytes owned by
            // the slot, and no transfer reads it now (its last one was waited for).
            let host =
                unsafe { std::slice::from_raw_parts_mut(slot.buffer.data_ptr().cast::<u8>(), len) };
            copy_bytes(host, piece);
            let src = slot.buffer.f_narrow(0, 0, len as i64).map_err(torch)?;
            let dst_piece = flat
                .f_narrow(0, (k * Self::CHUNK) as i64, len as i64)
                .map_err(torch)?;
            let mut event: *mut c_void = std::ptr::null_mut();
            // SAFETY: both are live tensors borrowed for the call; the shim catches every
            // C++ exception and writes the event only on success.
            unsafe {
                check(ffi::tt_copy_to_device_async(
                    dst_piece.as_ptr() as *mut c_void,
                    src.as_ptr() as *mut c_void,
                    &mut event,
                ))
            }
            .map_err(err)?;
            slot.pending = NonNull::new(event).map(Event);
        }
        Ok(())
    }

    /// Waits until every transfer has landed.
    pub fn finish(mut self) -> Result<()> {
        for slot in &mut self.slots {
            if let Some(event) = slot.pending.take() {
                event.synchronize("upload (waiting)")?;
            }
        }
        Ok(())
    }

    /// The next buffer in turn, allocated on first use, its last transfer waited for.
    fn next_slot(&mut self) -> Result<&mut Slot> {
        let k = self.next;
        self.next = (k + 1) % Self::DEPTH;
        if k == self.slots.len() {
            let mut out: *mut c_void = std::ptr::null_mut();
            // SAFETY: the shim writes a new `at::Tensor*` for us to own only on success.
            unsafe { check(ffi::tt_empty_pinned(Self::CHUNK as i64, &mut out)) }.map_err(
                |message| Error::Torch {
                    op: "upload (pinned buffer)",
                    reason: message,
                },
            )?;
            self.slots.push(Slot {
                // SAFETY: an `at::Tensor*` the shim allocated, which is tch's C_tensor.
                buffer: unsafe { Tensor::from_ptr(out.cast()) },
                pending: None,
            });
        }
        let slot = &mut self.slots[k];
        if let Some(event) = slot.pending.take() {
            event.synchronize("upload (waiting for a buffer)")?;
        }
        Ok(slot)
    }
}

impl Drop for DeviceUploads {
    fn drop(&mut self) {
        // Not finished (an error on the way): the buffers go back to the caching host
        // allocator, which reuses a block only after its recorded transfers; waiting
        // here too keeps a later writer of the same memory out of any doubt.
        for slot in &mut self.slots {
            if let Some(event) = slot.pending.take() {
                let _ = event.synchronize("upload (dropped)");
            }
        }
    }
}

/// Copies `src` into `dst` (equal lengths), split over up to four threads for a large
/// piece: one thread copies about 6-10 GB/s, under what a pinned transfer carries.
fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    const PER_THREAD: usize = 2 << 20;
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(4)
        .min(src.len() / PER_THREAD)
        .max(1);
    if threads == 1 {
        dst.copy_from_slice(src);
        return;
    }
    let part = src.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for (d, s) in dst.chunks_mut(part).zip(src.chunks(part)) {
            scope.spawn(move || d.copy_from_slice(s));
        }
    });
}

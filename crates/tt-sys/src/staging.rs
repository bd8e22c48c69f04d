//! Copies of CUDA tensors into pinned host memory that do not stop the caller: what a
//! checkpoint of GPU state needs to be taken while training goes on.

use std::ffi::c_void;
use std::ptr::NonNull;

use tch::{Device, Tensor};

use crate::cuda::{Error, Result};
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
        // SAFETY: the pointer came from tt_copy_to_host_async and is freed once.
        unsafe { ffi::tt_event_free(self.0.as_ptr()) }
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
                        message: format!("the tensors are on several devices ({:?})", t.device()),
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
            message: format!("device index {device} is out of range"),
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
            message,
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
        if let Some(event) = &self.event {
            // SAFETY: a live event from tt_copy_to_host_async.
            unsafe { check(ffi::tt_event_synchronize(event.0.as_ptr())) }.map_err(|message| {
                Error::Torch {
                    op: "copy_to_host_async (waiting)",
                    message,
                }
            })?;
        }
        Ok(())
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

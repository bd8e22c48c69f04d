//! What a reservation asks for ([`ReserveOptions`]), checked before anything is taken.

use std::time::Duration;

use tt_device::Bytes;
use tt_fence::DEFAULT_SAFETY_MARGIN;
use tt_lock::{GpuSpec, Holder};

use crate::error::Error;

/// What to reserve, and how long to wait. The fields and defaults follow the Python
/// torchtools' `reserve_gpu_for_training(gpu=None, training_reserved_bytes=0,
/// safety_margin_bytes=50 MiB, blocking=True, timeout=None, fence=True)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveOptions {
    /// Which GPUs: NVML indices, UUIDs, `cuda:N` of this process, or one
    /// [`GpuSpec::Auto`] (default: the free GPU(s) with the most free memory).
    pub gpus: Vec<GpuSpec>,
    /// How many GPUs `Auto` takes (`None`: 1). With named GPUs it may only repeat
    /// their number.
    pub count: Option<usize>,
    /// Memory the training job needs: the fence leaves this much free.
    pub training_reserved_bytes: Bytes,
    /// Left free on top of `training_reserved_bytes` (default 50 MiB, as in Python).
    pub safety_margin_bytes: Bytes,
    /// Wait for a GPU someone else holds (default); `false` fails at once.
    pub blocking: bool,
    /// With `blocking`, give up after this long (default: wait as long as it takes).
    pub timeout: Option<Duration>,
    /// Raise a memory fence (default); `false` takes the lock alone.
    pub fence: bool,
    /// The holder record every user sees (default: this process, with
    /// `training_reserved_bytes` as the reserved bytes).
    pub holder: Option<Holder>,
    /// Share one GPU with other jobs by memory budget instead of taking it alone:
    /// `training_reserved_bytes` is the budget, granted when it fits beside the other
    /// sharers' within the GPU's memory (in the same first-come-first-served queue; see
    /// [`LockDir::lock_shared`](tt_lock::LockDir::lock_shared)). With `fence`, the memory no sharer budgeted (or
    /// budgeted and took) is fenced, by the oldest sharer's reservation, following the
    /// sharers as they come and go; the command it prepares gets PyTorch's allocator
    /// capped at the budget (`PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:F`).
    /// Default `false`.
    pub share: bool,
}

impl Default for ReserveOptions {
    fn default() -> Self {
        ReserveOptions {
            gpus: vec![GpuSpec::Auto],
            count: None,
            training_reserved_bytes: Bytes(0),
            safety_margin_bytes: DEFAULT_SAFETY_MARGIN,
            blocking: true,
            timeout: None,
            fence: true,
            holder: None,
            share: false,
        }
    }
}

impl ReserveOptions {
    /// The defaults on one named GPU (`"3"`, a UUID, `"cuda:1"`, or `Auto`).
    pub fn on(gpu: GpuSpec) -> Self {
        ReserveOptions {
            gpus: vec![gpu],
            ..ReserveOptions::default()
        }
    }
}

/// A request that passed [`ReserveOptions::check`]: whether it is `auto`, and how many
/// GPUs it takes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request {
    pub(crate) auto: bool,
    pub(crate) count: usize,
}

impl ReserveOptions {
    /// The options' own mistakes, found before anything is looked at or taken.
    pub(crate) fn check(&self) -> Result<Request, Error> {
        let auto = self.gpus.contains(&GpuSpec::Auto);
        if self.gpus.is_empty() {
            return Err(Error::Options {
                reason: "no GPU named: give one or more, or GpuSpec::Auto".into(),
            });
        }
        if auto && self.gpus.len() > 1 {
            return Err(Error::Options {
                reason: "auto cannot be combined with named GPUs".into(),
            });
        }
        let count = match self.count {
            Some(0) => {
                return Err(Error::Options {
                    reason: "a count of 0 reserves nothing: ask for 1 or more".into(),
                })
            }
            Some(n) if !auto && n != self.gpus.len() => {
                return Err(Error::Options {
                    reason: format!(
                        "a count of {n} but {} GPU(s) named: give a count only with auto",
                        self.gpus.len()
                    ),
                })
            }
            Some(n) => n,
            None => 1,
        };
        if self.share && (count != 1 || self.gpus.len() != 1) {
            return Err(Error::Options {
                reason: "a shared reservation takes one GPU: name one, or auto with a count of 1"
                    .into(),
            });
        }
        if self.share && self.training_reserved_bytes.0 == 0 {
            return Err(Error::Options {
                reason: "a shared reservation needs its budget, the bytes the job needs: --share \
                 --bytes 20GiB, or --bytes auto to measure it with a probe run (the API: \
                 training_reserved_bytes); sharers are admitted while their budgets fit in \
                 the GPU's memory"
                    .into(),
            });
        }
        Ok(Request { auto, count })
    }
}

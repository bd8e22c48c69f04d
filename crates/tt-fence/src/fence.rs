use std::fmt;

use cudarc::driver::{result, sys};
use serde::Serialize;
use tt_device::{Bytes, CudaDriver};

use crate::{Error, Result};

/// Memory left free on top of `keep_free`, as the Python torchtools' `safety_margin_bytes`: room for
/// the driver's and other small allocations, so the job does not start at the edge.
pub const DEFAULT_SAFETY_MARGIN: Bytes = Bytes::mib(50);

/// The smallest chunk the fence tries before giving up on the rest.
pub const MIN_CHUNK: Bytes = Bytes::mib(2);

/// How much to leave free, and how to allocate the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceOptions {
    /// Memory the training job needs: left free.
    pub keep_free: Bytes,
    /// Left free on top of `keep_free` ([`DEFAULT_SAFETY_MARGIN`]).
    pub safety_margin: Bytes,
    /// Largest single allocation (1 GiB): also the granularity of [`Fence::shrink`].
    pub max_chunk: Bytes,
}

impl FenceOptions {
    /// Leave `bytes` (plus the default margin) free; fence the rest.
    pub fn keep_free(bytes: Bytes) -> FenceOptions {
        FenceOptions {
            keep_free: bytes,
            safety_margin: DEFAULT_SAFETY_MARGIN,
            max_chunk: Bytes::gib(1),
        }
    }
}

/// What a fence holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[must_use]
pub struct FenceReport {
    /// Logical CUDA device in this process.
    pub ordinal: usize,
    /// The GPU's UUID.
    pub uuid: String,
    /// Device memory.
    pub total: Bytes,
    /// Free before the fence was raised (after this process's context was created).
    pub free_before: Bytes,
    /// What it tried to fence: `free_before - keep_free - safety_margin`.
    pub target: Bytes,
    /// What it holds now.
    pub fenced: Bytes,
    /// In how many allocations.
    pub chunks: usize,
    /// Allocations refused while raising it (each retried smaller).
    pub refused: usize,
}

impl fmt::Display for FenceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fence on cuda:{} ({}): {} held in {} chunk(s) of {} targeted; {} of {} was free",
            self.ordinal,
            self.uuid,
            self.fenced,
            self.chunks,
            self.target,
            self.free_before,
            self.total
        )?;
        if self.refused > 0 {
            write!(
                f,
                "; {} allocation(s) refused and retried smaller",
                self.refused
            )?;
        }
        Ok(())
    }
}

/// GPU memory held so that other processes cannot take it. Freed on [`Fence::lower`]
/// or drop; the memory goes back to the driver (`cuMemFree`), not into a cache.
#[must_use = "the fence is lowered when it is dropped: hold it while the GPU is reserved"]
pub struct Fence {
    ordinal: usize,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    chunks: Vec<(sys::CUdeviceptr, usize)>,
    report: FenceReport,
}

// SAFETY: a CUDA context may be used from any thread once made current there; every
// driver call of a Fence first pushes its context on the calling thread (`Current`),
// and `&mut self` serialises them.
unsafe impl Send for Fence {}

impl fmt::Debug for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fence")
            .field("report", &self.report)
            .finish()
    }
}

/// The fence's context made current on this thread, popped on drop (so that a
/// libtorch context current on the same thread is left as it was).
struct Current;

impl Current {
    fn push(ctx: sys::CUcontext, ordinal: usize) -> Result<Current> {
        // SAFETY: ctx is a retained primary context, valid until released in Fence::drop.
        unsafe { sys::cuCtxPushCurrent_v2(ctx) }
            .result()
            .map_err(|e| driver("cuCtxPushCurrent", ordinal, e))?;
        Ok(Current)
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context pushed by Current::push on this thread.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}

fn driver(call: &'static str, ordinal: usize, e: result::DriverError) -> Error {
    Error::Driver {
        call,
        ordinal,
        reason: e.to_string(),
    }
}

impl Fence {
    /// Raises a fence on logical device `ordinal` (`cuda:N` in this process, after
    /// `CUDA_VISIBLE_DEVICES`), leaving `keep_free + safety_margin` free.
    pub fn raise(ordinal: usize, options: &FenceOptions) -> Result<Fence> {
        let cuda = CudaDriver::init().map_err(|e| Error::NoDriver {
            reason: e.to_string(),
        })?;
        let uuid = cuda.uuid(ordinal).map_err(|e| Error::NoSuchGpu {
            gpu: format!("cuda:{ordinal}"),
            reason: e.to_string(),
        })?;
        let device =
            result::device::get(ordinal as i32).map_err(|e| driver("cuDeviceGet", ordinal, e))?;
        // SAFETY: `device` came from cuDeviceGet; the reference is released in drop.
        let ctx = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| driver("cuDevicePrimaryCtxRetain", ordinal, e))?;
        let mut fence = Fence {
            ordinal,
            device,
            ctx,
            chunks: Vec::new(),
            report: FenceReport {
                ordinal,
                uuid,
                total: Bytes(0),
                free_before: Bytes(0),
                target: Bytes(0),
                fenced: Bytes(0),
                chunks: 0,
                refused: 0,
            },
        };
        fence.fill(options)?;
        tracing::info!("{}", fence.report);
        Ok(fence)
    }

    /// Raises a fence on the GPU with this UUID (`GPU-...`), which must be visible to
    /// this process.
    pub fn raise_on_uuid(uuid: &str, options: &FenceOptions) -> Result<Fence> {
        let cuda = CudaDriver::init().map_err(|e| Error::NoDriver {
            reason: e.to_string(),
        })?;
        let ordinal = cuda
            .ordinal_of(uuid)
            .map_err(|e| Error::NoSuchGpu {
                gpu: uuid.to_owned(),
                reason: e.to_string(),
            })?
            .ok_or_else(|| Error::NoSuchGpu {
                gpu: uuid.to_owned(),
                reason: format!(
                    "this process does not see it (CUDA_VISIBLE_DEVICES={})",
                    std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into())
                ),
            })?;
        Fence::raise(ordinal, options)
    }

    fn fill(&mut self, options: &FenceOptions) -> Result<()> {
        let ordinal = self.ordinal;
        let _current = Current::push(self.ctx, ordinal)?;
        let (free, total) =
            result::mem_get_info().map_err(|e| driver("cuMemGetInfo", ordinal, e))?;
        let target = (free as u64)
            .saturating_sub(options.keep_free.0)
            .saturating_sub(options.safety_margin.0);
        self.report.total = Bytes(total as u64);
        self.report.free_before = Bytes(free as u64);
        self.report.target = Bytes(target);
        let mut remaining = target;
        let mut chunk = options.max_chunk.0.max(MIN_CHUNK.0);
        while remaining >= MIN_CHUNK.0 {
            let size = chunk.min(remaining) as usize;
            // SAFETY: the context is current; the memory is only written by memset below.
            match unsafe { result::malloc_sync(size) } {
                Ok(ptr) => {
                    // Touch it, so that the driver really backs it with device memory.
                    // SAFETY: ptr is a live allocation of `size` bytes.
                    if let Err(e) = unsafe { result::memset_d8_sync(ptr, 0, size) } {
                        // SAFETY: ptr was allocated above and is freed once.
                        let _ = unsafe { result::free_sync(ptr) };
                        return Err(driver("cuMemsetD8", ordinal, e));
                    }
                    self.chunks.push((ptr, size));
                    remaining -= size as u64;
                }
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                    self.report.refused += 1;
                    if chunk <= MIN_CHUNK.0 {
                        break;
                    }
                    chunk /= 2;
                }
                Err(e) => return Err(driver("cuMemAlloc", ordinal, e)),
            }
        }
        self.update();
        Ok(())
    }

    fn update(&mut self) {
        self.report.fenced = Bytes(self.chunks.iter().map(|&(_, n)| n as u64).sum());
        self.report.chunks = self.chunks.len();
    }

    /// What the fence holds now.
    pub fn fenced(&self) -> Bytes {
        self.report.fenced
    }

    /// What the fence did and holds.
    pub fn report(&self) -> &FenceReport {
        &self.report
    }

    /// Frees at least `bytes` of the fence (whole chunks, the last ones first), or all
    /// of it if it holds less; returns what was freed. In a process running libtorch,
    /// its caching allocator can use that memory at once.
    pub fn shrink(&mut self, bytes: Bytes) -> Result<Bytes> {
        self.free_while(|freed| freed < bytes.0)
    }

    /// Frees the whole fence (idempotent); returns what was freed.
    pub fn lower(&mut self) -> Result<Bytes> {
        self.free_while(|_| true)
    }

    fn free_while(&mut self, mut more: impl FnMut(u64) -> bool) -> Result<Bytes> {
        if self.chunks.is_empty() {
            return Ok(Bytes(0));
        }
        let _current = Current::push(self.ctx, self.ordinal)?;
        let mut freed = 0u64;
        while more(freed) {
            let Some((ptr, size)) = self.chunks.pop() else {
                break;
            };
            // SAFETY: ptr is a live allocation of this fence, removed from the list so
            // it is freed once; the memset that touched it was synchronous.
            if let Err(e) = unsafe { result::free_sync(ptr) } {
                self.update();
                return Err(driver("cuMemFree", self.ordinal, e));
            }
            freed += size as u64;
        }
        self.update();
        Ok(Bytes(freed))
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        if let Err(e) = self.lower() {
            tracing::warn!("lowering the fence on cuda:{}: {e}", self.ordinal);
        }
        // SAFETY: releases the reference retained in Fence::raise, once.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

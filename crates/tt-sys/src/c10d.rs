//! libtorch's distributed engine, c10d: [`Store`] (TCPStore, PrefixStore), [`Backend`]
//! (ProcessGroupGloo, ProcessGroupNCCL) and its collectives, each returning a [`Work`]
//! to wait on. This is the raw engine, one call per c10d call; tt-dist builds process
//! groups, DDP and the trainer on it.

use std::ffi::CString;
use std::os::raw::c_char;
use std::ptr::NonNull;
use std::time::Duration;

use tch::Tensor;

use crate::error::{Error, Result};
use crate::ffi::check;

#[allow(non_camel_case_types)]
mod raw {
    use std::os::raw::c_char;

    #[repr(C)]
    pub(crate) struct tt_store {
        _private: [u8; 0],
    }
    #[repr(C)]
    pub(crate) struct tt_backend {
        _private: [u8; 0],
    }
    #[repr(C)]
    pub(crate) struct tt_work {
        _private: [u8; 0],
    }
    #[repr(C)]
    pub(crate) struct tt_reducer {
        _private: [u8; 0],
    }
    type Tensor = *mut std::ffi::c_void;

    extern "C" {
        pub(crate) fn tt_tcpstore_new(
            host: *const c_char,
            port: u16,
            world_size: i32,
            is_master: bool,
            timeout_ms: i64,
            wait_workers: bool,
            out: *mut *mut tt_store,
        ) -> *mut c_char;
        pub(crate) fn tt_store_port(s: *mut tt_store, out: *mut u16) -> *mut c_char;
        pub(crate) fn tt_prefixstore_new(
            prefix: *const c_char,
            base: *mut tt_store,
            out: *mut *mut tt_store,
        ) -> *mut c_char;
        pub(crate) fn tt_store_set(
            s: *mut tt_store,
            key: *const c_char,
            data: *const u8,
            len: usize,
        ) -> *mut c_char;
        pub(crate) fn tt_store_get(
            s: *mut tt_store,
            key: *const c_char,
            data: *mut *mut u8,
            len: *mut usize,
        ) -> *mut c_char;
        pub(crate) fn tt_store_add(
            s: *mut tt_store,
            key: *const c_char,
            delta: i64,
            out: *mut i64,
        ) -> *mut c_char;
        pub(crate) fn tt_store_set_timeout(s: *mut tt_store, timeout_ms: i64) -> *mut c_char;
        pub(crate) fn tt_store_free(s: *mut tt_store);
        pub(crate) fn tt_gloo_new(
            s: *mut tt_store,
            rank: i32,
            size: i32,
            timeout_ms: i64,
            interfaces: *const c_char,
            out: *mut *mut tt_backend,
        ) -> *mut c_char;
        pub(crate) fn tt_nccl_new(
            s: *mut tt_store,
            rank: i32,
            size: i32,
            timeout_ms: i64,
            device: i32,
            out: *mut *mut tt_backend,
        ) -> *mut c_char;
        pub(crate) fn tt_nccl_built() -> bool;
        pub(crate) fn tt_backend_free(b: *mut tt_backend);
        pub(crate) fn tt_allreduce(
            b: *mut tt_backend,
            t: Tensor,
            op: i32,
            out: *mut *mut tt_work,
        ) -> *mut c_char;
        pub(crate) fn tt_broadcast(
            b: *mut tt_backend,
            t: Tensor,
            root: i32,
            out: *mut *mut tt_work,
        ) -> *mut c_char;
        pub(crate) fn tt_allgather(
            b: *mut tt_backend,
            outputs: *const Tensor,
            n_out: usize,
            input: Tensor,
            out: *mut *mut tt_work,
        ) -> *mut c_char;
        pub(crate) fn tt_reduce_scatter(
            b: *mut tt_backend,
            output: Tensor,
            inputs: *const Tensor,
            n_in: usize,
            op: i32,
            out: *mut *mut tt_work,
        ) -> *mut c_char;
        pub(crate) fn tt_barrier(b: *mut tt_backend, out: *mut *mut tt_work) -> *mut c_char;
        pub(crate) fn tt_work_wait(w: *mut tt_work, timeout_ms: i64) -> *mut c_char;
        pub(crate) fn tt_work_is_completed(w: *mut tt_work) -> bool;
        pub(crate) fn tt_work_free(w: *mut tt_work);
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn tt_reducer_new(
            b: *mut tt_backend,
            params: *const Tensor,
            names: *const *const c_char,
            n_params: usize,
            buffers: *const Tensor,
            n_buffers: usize,
            broadcast_bytes: usize,
            bucket_bytes: i64,
            first_bucket_bytes: i64,
            find_unused: bool,
            gradient_as_bucket_view: bool,
            out: *mut *mut tt_reducer,
        ) -> *mut c_char;
        pub(crate) fn tt_reducer_prepare(
            r: *mut tt_reducer,
            outputs: *const Tensor,
            n_outputs: usize,
        ) -> *mut c_char;
        pub(crate) fn tt_reducer_buckets(
            r: *mut tt_reducer,
            sizes: *mut usize,
            cap: usize,
            n_buckets: *mut usize,
        ) -> *mut c_char;
        pub(crate) fn tt_reducer_free(r: *mut tt_reducer);
        pub(crate) fn tt_broadcast_coalesced(
            b: *mut tt_backend,
            tensors: *const Tensor,
            n: usize,
            buffer_bytes: usize,
            root: i32,
        ) -> *mut c_char;
    }
}

fn torch_err(op: &'static str) -> impl Fn(String) -> Error {
    move |message| Error::Torch {
        op,
        reason: message,
    }
}

fn c_string(what: &'static str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Torch {
        op: what,
        reason: format!("{s:?} contains a NUL byte"),
    })
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

fn int(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Torch {
        op: what,
        reason: format!("{v} does not fit a c10d rank (i32)"),
    })
}

fn tensor_ptr(t: &Tensor) -> *mut std::ffi::c_void {
    // torch-sys's C_tensor is an `at::Tensor*`: the shim reads it as one.
    t.as_ptr() as *mut std::ffi::c_void
}

/// A reduction, as c10d's `ReduceOp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean (NCCL only in c10d; tt-dist emulates it on Gloo).
    Avg,
    /// Element-wise product.
    Product,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
}

impl ReduceOp {
    fn code(self) -> i32 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Product => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
        }
    }
}

/// A c10d key-value store: a `TCPStore`, or a `PrefixStore` view of one.
///
/// Stores are shared by every rank's rendezvous; c10d makes them thread-safe.
#[derive(Debug)]
pub struct Store {
    raw: NonNull<raw::tt_store>,
}

// SAFETY: c10d stores synchronise internally (TCPStore holds a mutex around its socket;
// PrefixStore forwards); the handle is an owned intrusive_ptr box.
unsafe impl Send for Store {}
// SAFETY: as above; every method takes `&self` and c10d's are thread-safe.
unsafe impl Sync for Store {}

impl Store {
    /// A `TCPStore` at `host:port`. The master (`is_master`) serves it, on `port` (0: a
    /// free one, see [`Store::port`]); the others connect, retrying until `timeout`.
    /// With `world_size` and `wait_workers`, the master waits for that many clients
    /// (itself included), as Python's `TCPStore(world_size=..)` does.
    pub fn tcp(
        host: &str,
        port: u16,
        world_size: Option<usize>,
        is_master: bool,
        timeout: Duration,
        wait_workers: bool,
    ) -> Result<Store> {
        let host_c = c_string("TCPStore", host)?;
        let ws = match world_size {
            Some(n) => int("TCPStore", n)?,
            None => -1,
        };
        let mut out = std::ptr::null_mut();
        // SAFETY: valid C string and out-pointer; errors are owned strings.
        unsafe {
            check(raw::tt_tcpstore_new(
                host_c.as_ptr(),
                port,
                ws,
                is_master,
                millis(timeout),
                wait_workers,
                &mut out,
            ))
        }
        .map_err(torch_err("TCPStore"))?;
        Ok(Store::own(out))
    }

    fn own(ptr: *mut raw::tt_store) -> Store {
        Store {
            raw: NonNull::new(ptr).expect("the shim returned a null store on success"),
        }
    }

    /// The port of a `TCPStore` (the one picked when created with port 0).
    pub fn port(&self) -> Result<u16> {
        let mut port = 0;
        // SAFETY: live handle, valid out-pointer.
        unsafe { check(raw::tt_store_port(self.raw.as_ptr(), &mut port)) }
            .map_err(torch_err("Store::port"))?;
        Ok(port)
    }

    /// A view whose keys are `"{prefix}/{key}"` (c10d's `PrefixStore`, which is how
    /// torch.distributed namespaces groups); it shares this store's connection.
    pub fn prefixed(&self, prefix: &str) -> Result<Store> {
        let p = c_string("PrefixStore", prefix)?;
        let mut out = std::ptr::null_mut();
        // SAFETY: live handle; the new store holds its own reference to the base.
        unsafe {
            check(raw::tt_prefixstore_new(
                p.as_ptr(),
                self.raw.as_ptr(),
                &mut out,
            ))
        }
        .map_err(torch_err("PrefixStore"))?;
        Ok(Store::own(out))
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = c_string("Store::set", key)?;
        // SAFETY: live handle; data/len describe `value`.
        unsafe {
            check(raw::tt_store_set(
                self.raw.as_ptr(),
                k.as_ptr(),
                value.as_ptr(),
                value.len(),
            ))
        }
        .map_err(torch_err("Store::set"))
    }

    /// The value of `key`, waiting for it up to the store's timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let k = c_string("Store::get", key)?;
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live handle, valid out-pointers.
        unsafe {
            check(raw::tt_store_get(
                self.raw.as_ptr(),
                k.as_ptr(),
                &mut data,
                &mut len,
            ))
        }
        .map_err(torch_err("Store::get"))?;
        // SAFETY: on success `data` is a malloc'd buffer of `len` bytes (plus one).
        let out = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        // SAFETY: malloc'd by the shim, freed once with its free.
        unsafe { crate::ffi::tt_free_error(data.cast::<c_char>()) };
        Ok(out)
    }

    /// Adds `delta` to the integer at `key` (created at 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let k = c_string("Store::add", key)?;
        let mut out = 0;
        // SAFETY: live handle, valid out-pointer.
        unsafe {
            check(raw::tt_store_add(
                self.raw.as_ptr(),
                k.as_ptr(),
                delta,
                &mut out,
            ))
        }
        .map_err(torch_err("Store::add"))?;
        Ok(out)
    }

    /// How long `get` waits for a key that is not there yet.
    pub fn set_timeout(&self, timeout: Duration) -> Result<()> {
        // SAFETY: live handle.
        unsafe {
            check(raw::tt_store_set_timeout(
                self.raw.as_ptr(),
                millis(timeout),
            ))
        }
        .map_err(torch_err("Store::set_timeout"))
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once.
        unsafe { raw::tt_store_free(self.raw.as_ptr()) }
    }
}

/// Whether this build has `ProcessGroupNCCL` (tt-sys's `nccl` feature).
pub fn nccl_built() -> bool {
    // SAFETY: no arguments, no state.
    unsafe { raw::tt_nccl_built() }
}

/// Which c10d backend a [`Backend`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendKind {
    /// `ProcessGroupGloo`: TCP; CPU tensors, and CUDA tensors staged through host
    /// memory (several ranks sharing one GPU use it).
    Gloo,
    /// `ProcessGroupNCCL`: CUDA tensors.
    Nccl,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Gloo => "gloo",
            BackendKind::Nccl => "nccl",
        })
    }
}

/// A c10d backend (`ProcessGroupGloo` / `ProcessGroupNCCL`) of `size` ranks.
///
/// Collectives are asynchronous: each returns a [`Work`]; the tensors it names must
/// not be touched until [`Work::wait`] returns. Every rank must issue the same
/// collectives in the same order.
#[derive(Debug)]
pub struct Backend {
    raw: NonNull<raw::tt_backend>,
    kind: BackendKind,
    rank: usize,
    size: usize,
}

// SAFETY: c10d backends are used from many threads by torch.distributed; their queues
// are locked internally. The handle is an owned intrusive_ptr box.
unsafe impl Send for Backend {}
// SAFETY: as above.
unsafe impl Sync for Backend {}

impl Backend {
    /// A `ProcessGroupGloo` on `store` (torch.distributed's device choice:
    /// `GLOO_SOCKET_IFNAME`, else the host name's address). Blocks until every rank
    /// has connected, or `timeout` (also each collective's timeout) passes.
    pub fn gloo(store: &Store, rank: usize, size: usize, timeout: Duration) -> Result<Backend> {
        Backend::gloo_on(store, rank, size, timeout, None)
    }

    /// [`Backend::gloo`] on the named network interfaces (comma-separated, as
    /// `GLOO_SOCKET_IFNAME` takes them); `None`: as [`Backend::gloo`] chooses.
    pub fn gloo_on(
        store: &Store,
        rank: usize,
        size: usize,
        timeout: Duration,
        interfaces: Option<&str>,
    ) -> Result<Backend> {
        let interfaces = interfaces
            .map(|i| {
                std::ffi::CString::new(i).map_err(|_| Error::Torch {
                    op: "ProcessGroupGloo",
                    reason: format!("the interface list {i:?} holds a NUL byte"),
                })
            })
            .transpose()?;
        Backend::new(
            store,
            rank,
            size,
            timeout,
            BackendKind::Gloo,
            0,
            interfaces.as_deref(),
        )
    }

    /// A `ProcessGroupNCCL` on `store`, bound to CUDA device `device` (this rank's GPU)
    /// and connected before it returns; an error unless [`nccl_built`].
    ///
    /// A peer that hangs is not an error here: NCCL's watchdog aborts the process
    /// after `timeout` (c10d's `TORCH_NCCL_ASYNC_ERROR_HANDLING`), and the launcher
    /// then ends the other ranks. A peer that dies is seen by the others at their
    /// next collective, the same way.
    pub fn nccl(
        store: &Store,
        rank: usize,
        size: usize,
        timeout: Duration,
        device: usize,
    ) -> Result<Backend> {
        Backend::new(store, rank, size, timeout, BackendKind::Nccl, device, None)
    }

    fn new(
        store: &Store,
        rank: usize,
        size: usize,
        timeout: Duration,
        kind: BackendKind,
        device: usize,
        interfaces: Option<&std::ffi::CStr>,
    ) -> Result<Backend> {
        if size == 0 || rank >= size {
            return Err(Error::Torch {
                op: "ProcessGroup",
                reason: format!("rank {rank} is not in a group of {size}"),
            });
        }
        let (r, s) = (int("ProcessGroup", rank)?, int("ProcessGroup", size)?);
        let mut out = std::ptr::null_mut();
        let d = int("ProcessGroupNCCL device", device)?;
        let (raw_store, ms) = (store.raw.as_ptr(), millis(timeout));
        // SAFETY: live store; the backend keeps its own reference to it.
        let err = unsafe {
            match kind {
                BackendKind::Gloo => raw::tt_gloo_new(
                    raw_store,
                    r,
                    s,
                    ms,
                    interfaces.map_or(std::ptr::null(), std::ffi::CStr::as_ptr),
                    &mut out,
                ),
                BackendKind::Nccl => raw::tt_nccl_new(raw_store, r, s, ms, d, &mut out),
            }
        };
        // SAFETY: the shim's error pointer, owned by us from here.
        unsafe { check(err) }.map_err(torch_err(match kind {
            BackendKind::Gloo => "ProcessGroupGloo",
            BackendKind::Nccl => "ProcessGroupNCCL",
        }))?;
        Ok(Backend {
            raw: NonNull::new(out).expect("the shim returned a null backend on success"),
            kind,
            rank,
            size,
        })
    }

    /// Gloo or NCCL.
    pub fn kind(&self) -> BackendKind {
        self.kind
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    fn work(
        &self,
        op: &'static str,
        keep: Vec<Tensor>,
        call: impl FnOnce(*mut *mut raw::tt_work) -> *mut c_char,
    ) -> Result<Work> {
        let mut out = std::ptr::null_mut();
        // SAFETY: `call` passes live handles and tensors (kept alive in `keep`).
        unsafe { check(call(&mut out)) }.map_err(torch_err(op))?;
        Ok(Work {
            raw: NonNull::new(out).expect("the shim returned null work on success"),
            _tensors: keep,
            op,
        })
    }

    /// Reduces `tensor` over all ranks, in place.
    pub fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let t = tensor_ptr(tensor);
        self.work("allreduce", vec![tensor.shallow_clone()], |out| {
            // SAFETY: live backend and tensor.
            unsafe { raw::tt_allreduce(self.raw.as_ptr(), t, op.code(), out) }
        })
    }

    /// Copies `tensor` from rank `root` into every rank's `tensor`.
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        let t = tensor_ptr(tensor);
        let root = int("broadcast", root)?;
        self.work("broadcast", vec![tensor.shallow_clone()], |out| {
            // SAFETY: live backend and tensor.
            unsafe { raw::tt_broadcast(self.raw.as_ptr(), t, root, out) }
        })
    }

    /// Gathers every rank's `input` into `outputs[rank]` (one tensor per rank, shaped
    /// like `input`).
    pub fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work> {
        let outs: Vec<_> = outputs.iter().map(tensor_ptr).collect();
        let inp = tensor_ptr(input);
        let mut keep: Vec<Tensor> = outputs.iter().map(Tensor::shallow_clone).collect();
        keep.push(input.shallow_clone());
        self.work("allgather", keep, |out| {
            // SAFETY: live backend and tensors; `outs` outlives the call.
            unsafe { raw::tt_allgather(self.raw.as_ptr(), outs.as_ptr(), outs.len(), inp, out) }
        })
    }

    /// Reduces `inputs[r]` over all ranks into rank `r`'s `output`.
    pub fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        let ins: Vec<_> = inputs.iter().map(tensor_ptr).collect();
        let outp = tensor_ptr(output);
        let mut keep: Vec<Tensor> = inputs.iter().map(Tensor::shallow_clone).collect();
        keep.push(output.shallow_clone());
        self.work("reduce_scatter", keep, |out| {
            // SAFETY: live backend and tensors; `ins` outlives the call.
            unsafe {
                raw::tt_reduce_scatter(
                    self.raw.as_ptr(),
                    outp,
                    ins.as_ptr(),
                    ins.len(),
                    op.code(),
                    out,
                )
            }
        })
    }

    /// Waits until every rank has reached the barrier (when waited on).
    pub fn barrier(&self) -> Result<Work> {
        self.work("barrier", Vec::new(), |out| {
            // SAFETY: live backend.
            unsafe { raw::tt_barrier(self.raw.as_ptr(), out) }
        })
    }

    /// Copies `tensors` from rank `root` into every rank's, flattened into buffers of up
    /// to `buffer_bytes` (c10d's `broadcast_coalesced`, which DDP uses for parameters).
    /// Returns when done.
    pub fn broadcast_coalesced(
        &self,
        tensors: &[Tensor],
        buffer_bytes: usize,
        root: usize,
    ) -> Result<()> {
        let ts: Vec<_> = tensors.iter().map(tensor_ptr).collect();
        let root = int("broadcast_coalesced", root)?;
        // SAFETY: live backend and tensors; `ts` outlives the synchronous call.
        unsafe {
            check(raw::tt_broadcast_coalesced(
                self.raw.as_ptr(),
                ts.as_ptr(),
                ts.len(),
                buffer_bytes,
                root,
            ))
        }
        .map_err(torch_err("broadcast_coalesced"))
    }
}

/// How [`Reducer::new`] sets up DDP: the arguments of PyTorch's
/// `DistributedDataParallel` that shape its reduction.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReducerOptions {
    /// Bucket size (`bucket_cap_mb`; PyTorch's default 25 MiB).
    pub bucket_bytes: usize,
    /// The first bucket's size, for the gradients ready last (PyTorch's 1 MiB).
    pub first_bucket_bytes: usize,
    /// Walk the autograd graph each step to find parameters that get no gradient
    /// (`find_unused_parameters`; costs one graph walk and one small all-reduce a step).
    pub find_unused_parameters: bool,
    /// Gradients are views into the buckets (`gradient_as_bucket_view`: saves one copy
    /// of the gradients' memory).
    pub gradient_as_bucket_view: bool,
}

/// PyTorch's `DistributedDataParallel` default bucket size.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;
/// PyTorch's default size of DDP's first bucket (`dist._DEFAULT_FIRST_BUCKET_BYTES`).
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1 << 20;
/// What `DistributedDataParallel` broadcasts parameters and buffers in (its
/// `broadcast_bucket_size`, 250 MiB).
pub const BROADCAST_BUCKET_BYTES: usize = 250 << 20;

impl ReducerOptions {
    /// The bucket and first-bucket sizes as c10d takes them; an error naming the size
    /// when one is 0 (or beyond `i64`).
    pub fn sizes(&self) -> Result<(i64, i64)> {
        let bytes = |what: &str, v: usize| {
            i64::try_from(v)
                .ok()
                .filter(|&b| b > 0)
                .ok_or_else(|| Error::Torch {
                    op: "Reducer",
                    reason: format!(
                        "DDP {what} of {v} bytes: give at least one element's worth \
                         (defaults: 25 MiB, 1 MiB)"
                    ),
                })
        };
        Ok((
            bytes("bucket size", self.bucket_bytes)?,
            bytes("first bucket size", self.first_bucket_bytes)?,
        ))
    }

    /// With buckets of about `bytes` (`bucket_cap_mb`), the first one included, as
    /// PyTorch does when `bucket_cap_mb` is given (set [`Self::first_bucket_bytes`]
    /// after this to differ).
    pub fn bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self.first_bucket_bytes = bytes;
        self
    }

    /// With a first bucket of about `bytes`.
    pub fn first_bucket_bytes(mut self, bytes: usize) -> Self {
        self.first_bucket_bytes = bytes;
        self
    }

    /// Whether to look for parameters that get no gradient, each step.
    pub fn find_unused_parameters(mut self, on: bool) -> Self {
        self.find_unused_parameters = on;
        self
    }

    /// Whether gradients are views into the buckets.
    pub fn gradient_as_bucket_view(mut self, on: bool) -> Self {
        self.gradient_as_bucket_view = on;
        self
    }
}

impl Default for ReducerOptions {
    fn default() -> Self {
        ReducerOptions {
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            first_bucket_bytes: DEFAULT_FIRST_BUCKET_BYTES,
            find_unused_parameters: false,
            gradient_as_bucket_view: false,
        }
    }
}

/// PyTorch's DDP engine, `c10d::Reducer`, on a [`Backend`]: autograd hooks on every
/// parameter launch a bucket's all-reduce as soon as its gradients are ready, so
/// communication overlaps the rest of the backward pass; when `backward()` returns, the
/// gradients are averaged over the ranks.
///
/// Built as `DistributedDataParallel.__init__` builds it (parameters checked equal across
/// ranks, rank 0's parameters and buffers broadcast, buckets assigned by size in reverse
/// order, one bucket until the first backward has shown the order in which gradients
/// become ready), and stepped as its forward steps it ([`Reducer::prepare_for_backward`]),
/// so Rust and Python DDP ranks issue the same collectives and can train one model.
#[derive(Debug)]
pub struct Reducer<'b> {
    raw: NonNull<raw::tt_reducer>,
    _params: Vec<Tensor>,
    _backend: std::marker::PhantomData<&'b Backend>,
}

impl<'b> Reducer<'b> {
    /// A reducer for `params` (leaf tensors that require a gradient, in the order of the
    /// model's definition: PyTorch's `named_parameters()` order), named for errors, with
    /// `buffers` (non-trainable state) broadcast from rank 0 too. Every rank must call it
    /// with the same shapes and dtypes (else an error naming the difference, on every
    /// rank).
    pub fn new(
        backend: &'b Backend,
        params: &[(String, Tensor)],
        buffers: &[Tensor],
        opts: &ReducerOptions,
    ) -> Result<Reducer<'b>> {
        let (bucket, first) = opts.sizes()?;
        let names = params
            .iter()
            .map(|(n, _)| c_string("Reducer parameter name", n))
            .collect::<Result<Vec<_>>>()?;
        let name_ptrs: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
        let ps: Vec<_> = params.iter().map(|(_, t)| tensor_ptr(t)).collect();
        let bs: Vec<_> = buffers.iter().map(tensor_ptr).collect();
        let mut out = std::ptr::null_mut();
        // SAFETY: live backend and tensors; the arrays outlive the synchronous call; the
        // reducer keeps its own references to the tensors and the backend.
        let err = unsafe {
            raw::tt_reducer_new(
                backend.raw.as_ptr(),
                ps.as_ptr(),
                name_ptrs.as_ptr(),
                ps.len(),
                bs.as_ptr(),
                bs.len(),
                BROADCAST_BUCKET_BYTES,
                bucket,
                first,
                opts.find_unused_parameters,
                opts.gradient_as_bucket_view,
                &mut out,
            )
        };
        // SAFETY: the shim's error pointer, owned by us from here.
        unsafe { check(err) }.map_err(torch_err("Reducer"))?;
        Ok(Reducer {
            raw: NonNull::new(out).expect("the shim returned a null reducer on success"),
            _params: params.iter().map(|(_, t)| t.shallow_clone()).collect(),
            _backend: std::marker::PhantomData,
        })
    }

    /// Arms the reducer for the next backward pass (what DDP's forward does when
    /// gradients are to be averaged): counts the iteration, rebuilds the buckets in
    /// gradient-ready order once (a collective, after the first backward), and with
    /// `find_unused_parameters` marks the parameters `outputs` do not depend on. Skip it
    /// for a backward that should only accumulate locally (`no_sync`).
    pub fn prepare_for_backward(&self, outputs: &[&Tensor]) -> Result<()> {
        let outs: Vec<_> = outputs.iter().map(|t| tensor_ptr(t)).collect();
        // SAFETY: live reducer and tensors; `outs` outlives the synchronous call.
        unsafe {
            check(raw::tt_reducer_prepare(
                self.raw.as_ptr(),
                outs.as_ptr(),
                outs.len(),
            ))
        }
        .map_err(torch_err("Reducer::prepare_for_backward"))
    }

    /// The number of parameters in each bucket, in the order buckets are reduced.
    pub fn bucket_sizes(&self) -> Result<Vec<usize>> {
        let mut sizes = vec![0usize; self._params.len().max(1)];
        let mut n = 0usize;
        // SAFETY: live reducer; `sizes` holds `cap` elements.
        unsafe {
            check(raw::tt_reducer_buckets(
                self.raw.as_ptr(),
                sizes.as_mut_ptr(),
                sizes.len(),
                &mut n,
            ))
        }
        .map_err(torch_err("Reducer::buckets"))?;
        sizes.truncate(n);
        Ok(sizes)
    }
}

impl Drop for Reducer<'_> {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once; the shim removes the autograd hooks.
        unsafe { raw::tt_reducer_free(self.raw.as_ptr()) }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once; c10d drains its queue first.
        unsafe { raw::tt_backend_free(self.raw.as_ptr()) }
    }
}

/// A collective in flight. Dropping it without waiting is allowed (the collective
/// still completes), but its result and errors are then lost.
#[derive(Debug)]
pub struct Work {
    raw: NonNull<raw::tt_work>,
    // The tensors the collective reads and writes, alive until it is done.
    _tensors: Vec<Tensor>,
    op: &'static str,
}

// SAFETY: c10d work objects are waited on from any thread (torch.distributed does).
unsafe impl Send for Work {}

impl Work {
    /// Waits for completion: `None` waits as long as the backend's timeout allows.
    /// An error when the collective failed (a peer died, the timeout passed, bad
    /// tensors); the process group should then be dropped.
    pub fn wait(self, timeout: Option<Duration>) -> Result<()> {
        let ms = timeout.map_or(0, millis);
        // SAFETY: live handle.
        unsafe { check(raw::tt_work_wait(self.raw.as_ptr(), ms)) }.map_err(|message| Error::Torch {
            op: self.op,
            reason: message,
        })
    }

    /// Whether it has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        // SAFETY: live handle.
        unsafe { raw::tt_work_is_completed(self.raw.as_ptr()) }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once.
        unsafe { raw::tt_work_free(self.raw.as_ptr()) }
    }
}

//! Data-parallel training over a tch `VarStore`: PyTorch's `DistributedDataParallel`
//! semantics on c10d collectives.

use std::cell::Cell;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::group::{ProcessGroup, ReduceOp};
use crate::{Error, Result};

/// PyTorch DDP's default bucket size.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

struct Slot {
    param: Tensor,
    offset: i64,
    numel: i64,
}

struct Bucket {
    slots: Vec<Slot>,
    flat: Tensor,
}

/// Keeps one model's replicas identical across a [`ProcessGroup`], like PyTorch's
/// `DistributedDataParallel`:
///
/// - at creation, every trainable variable is broadcast from rank 0, so all ranks start
///   from the same parameters whatever their seeds;
/// - [`Ddp::backward`] runs the backward pass, then averages the gradients over the
///   ranks, flattened into buckets of about 25 MiB (PyTorch's default) that are
///   all-reduced concurrently;
/// - [`Ddp::no_sync`] skips the averaging for gradient accumulation: the next synced
///   backward averages everything accumulated, as PyTorch's `no_sync()` does.
///
/// With equal per-rank batch sizes, training on `N` ranks with a batch of `B` each
/// gives the parameters of one process training on `N * B` (to float rounding).
///
/// What differs from PyTorch: tch has no autograd hooks, so communication starts after
/// the whole backward pass instead of overlapping it (the cost is measured in
/// `cargo xtask bench`). Variables that received no gradient on a rank count as zeros
/// there; a variable with no gradient anywhere keeps none.
///
/// # Example
///
/// ```no_run
/// use tch::nn::{self, Module, OptimizerConfig};
/// use tt_dist::{Ddp, ProcessGroup};
///
/// let pg = ProcessGroup::from_env()?; // a group of one without torchrun's variables
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let model = nn::linear(vs.root(), 4, 1, Default::default());
/// let ddp = Ddp::new(&pg, &vs)?;
/// let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
/// let (x, y) = (tch::Tensor::ones([8, 4], tch::kind::FLOAT_CPU), tch::Tensor::zeros([8, 1], tch::kind::FLOAT_CPU));
/// opt.zero_grad();
/// ddp.backward(&model.forward(&x).mse_loss(&y, tch::Reduction::Mean))?;
/// opt.step();
/// # Ok::<(), tt_dist::Error>(())
/// ```
pub struct Ddp<'g> {
    pg: &'g ProcessGroup,
    buckets: Vec<Bucket>,
    skip_sync: Cell<bool>,
}

impl std::fmt::Debug for Ddp<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ddp")
            .field("rank", &self.pg.rank())
            .field("buckets", &self.buckets.len())
            .finish()
    }
}

fn tch_err(e: tch::TchError) -> Error {
    Error::Tensor(e.to_string())
}

impl<'g> Ddp<'g> {
    /// Wraps the trainable variables of `vs` with PyTorch's 25 MiB buckets, and
    /// broadcasts them from rank 0. Every rank must call it with the same model.
    pub fn new(pg: &'g ProcessGroup, vs: &VarStore) -> Result<Ddp<'g>> {
        Ddp::with_bucket_bytes(pg, vs, DEFAULT_BUCKET_BYTES)
    }

    /// As [`Ddp::new`] with buckets of about `bucket_bytes` (a variable larger than that
    /// gets a bucket of its own).
    pub fn with_bucket_bytes(
        pg: &'g ProcessGroup,
        vs: &VarStore,
        bucket_bytes: usize,
    ) -> Result<Ddp<'g>> {
        if bucket_bytes == 0 {
            return Err(Error::Tensor(
                "DDP bucket size of 0 bytes: give at least one element's worth (default 25 MiB)"
                    .into(),
            ));
        }
        // Name order: the same on every rank, whatever order the HashMap has.
        let mut vars: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut current: Vec<Slot> = Vec::new();
        let mut key: Option<(Kind, Device)> = None;
        let mut bytes = 0usize;
        let flush = |slots: &mut Vec<Slot>, key: Option<(Kind, Device)>, out: &mut Vec<Bucket>| {
            if let (false, Some((kind, device))) = (slots.is_empty(), key) {
                let total: i64 = slots.iter().map(|s| s.numel).sum();
                out.push(Bucket {
                    slots: std::mem::take(slots),
                    flat: Tensor::zeros([total], (kind, device)),
                });
            }
        };
        for (_, param) in vars {
            let k = (param.kind(), param.device());
            let numel = i64::try_from(param.numel()).unwrap_or(i64::MAX);
            let size = param.numel() * k.0.elt_size_in_bytes();
            if key != Some(k) || (bytes > 0 && bytes + size > bucket_bytes) {
                flush(&mut current, key, &mut buckets);
                bytes = 0;
                key = Some(k);
            }
            let offset = current.last().map_or(0, |s| s.offset + s.numel);
            current.push(Slot {
                param,
                offset,
                numel,
            });
            bytes += size;
        }
        flush(&mut current, key, &mut buckets);
        let ddp = Ddp {
            pg,
            buckets,
            skip_sync: Cell::new(false),
        };
        ddp.broadcast_parameters()?;
        Ok(ddp)
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        self.pg
    }

    /// Number of gradient buckets.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// Copies rank 0's parameters to every rank (done by [`Ddp::new`]; call it again
    /// after loading a checkpoint on rank 0 only).
    pub fn broadcast_parameters(&self) -> Result<()> {
        if self.pg.world_size() == 1 {
            return Ok(());
        }
        let _guard = tch::no_grad_guard();
        for bucket in &self.buckets {
            let flat = &bucket.flat;
            for s in &bucket.slots {
                flat.narrow(0, s.offset, s.numel)
                    .f_copy_(&s.param.view([-1]))
                    .map_err(tch_err)?;
            }
            self.pg.broadcast(&bucket.flat, 0)?;
            for s in &bucket.slots {
                s.param
                    .shallow_clone()
                    .f_copy_(&flat.narrow(0, s.offset, s.numel).view_as(&s.param))
                    .map_err(tch_err)?;
            }
        }
        Ok(())
    }

    /// `loss.backward()`, then the gradient average over the ranks (unless inside
    /// [`Ddp::no_sync`]).
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        loss.f_backward().map_err(tch_err)?;
        if !self.skip_sync.get() {
            self.sync_gradients()?;
        }
        Ok(())
    }

    /// Runs `f` (forward and [`Ddp::backward`] of micro-batches) without averaging
    /// gradients; they accumulate locally until the next synced backward.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        let before = self.skip_sync.replace(true);
        let out = f();
        self.skip_sync.set(before);
        out
    }

    /// Averages every variable's gradient over the ranks now (what [`Ddp::backward`]
    /// does after the backward pass). Every rank must call it the same number of times.
    pub fn sync_gradients(&self) -> Result<()> {
        if self.pg.world_size() == 1 {
            return Ok(());
        }
        let _guard = tch::no_grad_guard();
        let mut pending = Vec::with_capacity(self.buckets.len());
        // Fill and launch each bucket; Gloo's threads reduce one while the next fills.
        for bucket in &self.buckets {
            for s in &bucket.slots {
                let mut dst = bucket.flat.narrow(0, s.offset, s.numel);
                let grad = s.param.grad();
                if grad.defined() {
                    dst.f_copy_(&grad.view([-1])).map_err(tch_err)?;
                } else {
                    let _ = dst.f_zero_().map_err(tch_err)?;
                }
            }
            pending.push(self.pg.all_reduce_async(&bucket.flat, ReduceOp::Avg)?);
        }
        for (bucket, work) in self.buckets.iter().zip(pending) {
            work.wait()?;
            for s in &bucket.slots {
                let mut grad = s.param.grad();
                if grad.defined() {
                    grad.f_copy_(&bucket.flat.narrow(0, s.offset, s.numel).view_as(&grad))
                        .map_err(tch_err)?;
                }
            }
        }
        Ok(())
    }
}

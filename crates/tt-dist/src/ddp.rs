//! Data-parallel training over a tch `VarStore` on PyTorch's own DDP engine,
//! `c10d::Reducer`.

use std::cell::Cell;

use tch::nn::VarStore;
use tch::Tensor;
use tt_sys::c10d::{Reducer, BROADCAST_BUCKET_BYTES};
pub use tt_sys::c10d::{
    ReducerOptions as DdpOptions, DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES,
};

use crate::group::ProcessGroup;
use crate::{Error, Result};

/// Keeps one model's replicas identical across a [`ProcessGroup`]: PyTorch's
/// `DistributedDataParallel`, on its own engine (`c10d::Reducer`, the C++ half of DDP),
/// driven as PyTorch's Python half drives it.
///
/// - At creation, every rank's parameters are checked to have the same shapes and dtypes
///   (an error naming the difference otherwise), and rank 0's parameters and buffers are
///   broadcast, so all ranks start equal whatever their seeds.
/// - [`Ddp::backward`] runs the backward pass; the Reducer's autograd hooks put each
///   gradient into its bucket as soon as it is computed and start that bucket's
///   all-reduce at once, so communication overlaps the rest of the backward pass. When
///   it returns, every gradient is the average over the ranks.
/// - Buckets are PyTorch's: 25 MiB, assigned in reverse definition order, a 1 MiB first
///   bucket, and rebuilt once, after the first step, in the order gradients became ready.
/// - [`Ddp::no_sync`] skips the averaging for gradient accumulation: the next synced
///   backward averages everything accumulated.
/// - [`DdpOptions::find_unused_parameters`]: parameters the loss does not depend on (a
///   branch not taken this step) are found by walking the autograd graph; without it
///   such a parameter makes the next step fail with the Reducer's explanation.
///
/// Because the collectives are DDP's own, a Rust rank and a Python rank running
/// `torch.nn.parallel.DistributedDataParallel` on the same model (parameters defined in
/// the same order) can train together in one group.
///
/// With equal per-rank batch sizes, training on `N` ranks with a batch of `B` each
/// gives the parameters of one process training on `N * B` (to float rounding).
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
    /// `None` in the networkless group of one, where gradients are already the average.
    reducer: Option<Reducer<'g>>,
    params: Vec<(String, Tensor)>,
    buffers: Vec<Tensor>,
    skip_sync: Cell<bool>,
}

impl std::fmt::Debug for Ddp<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ddp")
            .field("rank", &self.pg.rank())
            .field("parameters", &self.params.len())
            .finish()
    }
}

fn tch_err(e: tch::TchError) -> Error {
    Error::Tensor {
        reason: e.to_string(),
    }
}

/// The trainable variables of `vs` in the order of PyTorch's `named_parameters()` for
/// the same model, with their names; then the other variables (buffers), by name.
///
/// That order is the one DDP's buckets and broadcasts follow, so it must be the same in
/// every rank, Rust or Python: layers in the order they were created, and within a
/// layer its weights before its biases (tch creates a linear or convolution's bias
/// first; PyTorch registers the weight first).
fn parameters_and_buffers(vs: &VarStore) -> (Vec<(String, Tensor)>, Vec<Tensor>) {
    let named = vs.variables();
    let name_of = |t: &Tensor| {
        named
            .iter()
            .find(|(_, v)| v.data_ptr() == t.data_ptr() && v.size() == t.size())
            .map(|(n, _)| n.clone())
    };
    let created: Vec<(String, Tensor)> = vs
        .trainable_variables()
        .into_iter()
        .filter(Tensor::requires_grad)
        .enumerate()
        .map(|(i, t)| (name_of(&t).unwrap_or_else(|| format!("parameter {i}")), t))
        .collect();
    let params = pytorch_order(created);
    let mut buffers: Vec<(String, Tensor)> = named
        .into_iter()
        .filter(|(n, _)| !params.iter().any(|(p, _)| p == n))
        .collect();
    buffers.sort_by(|a, b| a.0.cmp(&b.0));
    (params, buffers.into_iter().map(|(_, t)| t).collect())
}

/// Reorders variables given in creation order as PyTorch registers them: grouped by
/// layer (the name up to its last `.`) in the order layers first appear, and within a
/// layer `weight*` before other names before `bias*`, otherwise as created.
fn pytorch_order<T>(created: Vec<(String, T)>) -> Vec<(String, T)> {
    let layer = |name: &str| name.rsplit_once('.').map_or("", |(l, _)| l).to_owned();
    let kind = |name: &str| {
        let leaf = name.rsplit_once('.').map_or(name, |(_, n)| n);
        if leaf.starts_with("weight") {
            0
        } else if leaf.starts_with("bias") {
            2
        } else {
            1
        }
    };
    // Layers numbered in the order they first appear.
    let mut layers: Vec<String> = Vec::new();
    let mut keyed: Vec<(usize, u8, usize, (String, T))> = created
        .into_iter()
        .enumerate()
        .map(|(i, (name, t))| {
            let l = layer(&name);
            let group = layers.iter().position(|f| *f == l).unwrap_or_else(|| {
                layers.push(l);
                layers.len() - 1
            });
            (group, kind(&name), i, (name, t))
        })
        .collect();
    keyed.sort_by_key(|(g, k, i, _)| (*g, *k, *i));
    keyed.into_iter().map(|(_, _, _, v)| v).collect()
}

impl<'g> Ddp<'g> {
    /// Wraps the trainable variables of `vs` with PyTorch's defaults, and broadcasts the
    /// variables from rank 0. Every rank must call it with the same model.
    pub fn new(pg: &'g ProcessGroup, vs: &VarStore) -> Result<Ddp<'g>> {
        Ddp::with_options(pg, vs, &DdpOptions::default())
    }

    /// As [`Ddp::new`] with buckets of about `bucket_bytes` (PyTorch's `bucket_cap_mb`).
    pub fn with_bucket_bytes(
        pg: &'g ProcessGroup,
        vs: &VarStore,
        bucket_bytes: usize,
    ) -> Result<Ddp<'g>> {
        Ddp::with_options(pg, vs, &DdpOptions::default().bucket_bytes(bucket_bytes))
    }

    /// As [`Ddp::new`] with `opts` (bucket sizes, `find_unused_parameters`,
    /// `gradient_as_bucket_view`).
    pub fn with_options(pg: &'g ProcessGroup, vs: &VarStore, opts: &DdpOptions) -> Result<Ddp<'g>> {
        // Checked here too for the group of one, which builds no Reducer.
        opts.sizes().map_err(|e| match e {
            tt_sys::Error::Torch {
                reason: message, ..
            } => Error::Tensor { reason: message },
            other => Error::Tensor {
                reason: other.to_string(),
            },
        })?;
        let (params, buffers) = parameters_and_buffers(vs);
        if params.is_empty() {
            return Err(Error::Tensor { reason: "DDP over a VarStore with no trainable variable: build the model in the VarStore \
                 first (or unfreeze it)"
                    .into() });
        }
        let reducer = match pg.raw_backend() {
            Some(backend) => Some(
                Reducer::new(backend, &params, &buffers, opts)
                    .map_err(|e| pg.error_of("DistributedDataParallel", e))?,
            ),
            None => None,
        };
        Ok(Ddp {
            pg,
            reducer,
            params,
            buffers,
            skip_sync: Cell::new(false),
        })
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        self.pg
    }

    /// Number of gradient buckets (1 in the group of one).
    pub fn bucket_count(&self) -> usize {
        self.bucket_sizes().len()
    }

    /// The number of parameters in each bucket, in the order buckets are reduced
    /// (`[all]` in the group of one).
    pub fn bucket_sizes(&self) -> Vec<usize> {
        match &self.reducer {
            Some(r) => r.bucket_sizes().unwrap_or_default(),
            None => vec![self.params.len()],
        }
    }

    /// Copies rank 0's parameters and buffers to every rank (done by [`Ddp::new`]; call
    /// it again after loading a checkpoint on rank 0 only).
    pub fn broadcast_parameters(&self) -> Result<()> {
        let Some(backend) = self.pg.raw_backend() else {
            return Ok(());
        };
        let _guard = tch::no_grad_guard();
        let mut states: Vec<Tensor> = self.params.iter().map(|(_, t)| t.detach()).collect();
        states.extend(self.buffers.iter().map(Tensor::detach));
        backend
            .broadcast_coalesced(&states, BROADCAST_BUCKET_BYTES, 0)
            .map_err(|e| self.pg.error_of("broadcast", e))
    }

    /// `loss.backward()`, with the gradients averaged over the ranks as they are
    /// computed (unless inside [`Ddp::no_sync`]). Every rank must call it the same number
    /// of times.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        if let (Some(reducer), false) = (&self.reducer, self.skip_sync.get()) {
            reducer
                .prepare_for_backward(&[loss])
                .map_err(|e| explain(self.pg.error_of("DistributedDataParallel", e)))?;
        }
        loss.f_backward().map_err(|e| explain(tch_err(e)))
    }

    /// Runs `f` (forward and [`Ddp::backward`] of micro-batches) without averaging
    /// gradients; they accumulate locally until the next synced backward, as inside
    /// PyTorch's `no_sync()`.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        let before = self.skip_sync.replace(true);
        let out = f();
        self.skip_sync.set(before);
        out
    }
}

/// The Reducer's messages name PyTorch's Python arguments; add ours.
fn explain(e: Error) -> Error {
    let text = e.to_string();
    if text.contains("find_unused_parameters") {
        Error::Tensor { reason: format!(
            "{text}\n(in torchtools: Ddp::with_options(.., &DdpOptions::default().find_unused_parameters(true)))"
        ) }
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::pytorch_order;

    #[test]
    fn parameters_are_in_pytorchs_registration_order() {
        // tch's creation order for l1 = linear, l2 = linear, lstm, then a lone scale.
        let created = [
            "l1.bias",
            "l1.weight",
            "l2.bias",
            "l2.weight",
            "rnn.weight_ih_l0",
            "rnn.weight_hh_l0",
            "rnn.bias_ih_l0",
            "rnn.bias_hh_l0",
            "scale",
        ];
        let order: Vec<String> =
            pytorch_order(created.iter().map(|n| (n.to_string(), ())).collect())
                .into_iter()
                .map(|(n, ())| n)
                .collect();
        assert_eq!(
            order,
            [
                "l1.weight",
                "l1.bias",
                "l2.weight",
                "l2.bias",
                "rnn.weight_ih_l0",
                "rnn.weight_hh_l0",
                "rnn.bias_ih_l0",
                "rnn.bias_hh_l0",
                "scale",
            ]
        );
    }
}

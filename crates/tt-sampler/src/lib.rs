#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod batch;
mod error;
mod mt19937;
mod randperm;
mod sampler;

pub use batch::BatchSampler;
pub use error::{Error, Result};
pub use randperm::LARGE_RANDPERM;
pub use sampler::{DistributedSampler, Reshard, SamplerState};

/// `torch.randperm(n)` from a generator seeded with `seed`, as `u64`s: the
/// permutation [`DistributedSampler`] uses (exposed for checks and other samplers).
pub fn randperm(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = Vec::new();
    randperm::randperm_into(n, seed, &mut v);
    v
}

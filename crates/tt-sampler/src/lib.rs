//! An interruptible distributed sampler with exactly torch's order.
//!
//! [`DistributedSampler`] yields, for each rank, the same indices as
//! `torch.utils.data.DistributedSampler` with the same arguments: it reproduces
//! libtorch's CPU generator (MT19937) and `torch.randperm` in pure Rust, both of
//! randperm's algorithms (the 64-bit one torch uses from
//! [`LARGE_RANDPERM`] samples on). No libtorch is needed.
//!
//! It is also interruptible, like cycling_utils' `InterruptableDistributedSampler`
//! but without its traps: iterating counts what it yields (no manual `advance`),
//! [`remaining`](DistributedSampler::remaining) is what is left, `set_epoch` of a new
//! epoch reshuffles while `set_epoch` of the resumed epoch keeps its progress (so
//! torch's usual loop resumes exactly), a [`SamplerState`] (serde) resumes exactly,
//! at the cost of one permutation wherever in the epoch it was saved, `advance` past
//! the end is an error instead of a silent stop, and a state from another world size
//! is refused unless re-sharding is asked for ([`Reshard::Allow`]); one from another
//! dataset length is refused unless restarting the epoch is asked for
//! ([`Reshard::RestartEpoch`]).
//!
//! # Example
//!
//! ```
//! use tt_sampler::{DistributedSampler, Reshard};
//!
//! // Rank 1 of 4 over 10 samples: torch gives [1, 5, 9] for epoch 0, no shuffle...
//! let plain = DistributedSampler::new(10, 4, 1)?.with_shuffle(false);
//! assert_eq!(plain.collect::<Vec<_>>(), [1, 5, 9]);
//!
//! // ...and with shuffle, the rank's share of torch.randperm(10, seed 0 + epoch).
//! let mut sampler = DistributedSampler::new(10, 4, 1)?;
//! sampler.set_epoch(3);
//! let first = sampler.next_index()?;          // consumed and counted
//! let saved = serde_json::to_string(&sampler.state())?; // into the checkpoint
//!
//! // After a restart: the rest, exactly.
//! let mut resumed = DistributedSampler::new(10, 4, 1)?;
//! resumed.load_state(&serde_json::from_str(&saved)?, Reshard::Refuse)?;
//! assert_eq!(resumed.remaining(), 2);
//! let rest: Vec<u64> = resumed.collect();
//! let mut whole = DistributedSampler::new(10, 4, 1)?;
//! whole.set_epoch(3);
//! assert_eq!([vec![first.unwrap()], rest].concat(), whole.collect::<Vec<_>>());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
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

use serde::{Deserialize, Serialize};

use crate::randperm::{randperm_into, PermIndex};
use crate::{Error, Result};

/// Where a sampler is: everything needed to resume it exactly (serde).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// The epoch being iterated.
    pub epoch: u64,
    /// Samples this rank has consumed in this epoch.
    pub progress: u64,
    /// The shuffle seed (the permutation of epoch `e` is seeded with `seed + e`).
    pub seed: u64,
    /// Dataset length.
    pub len: u64,
    /// Number of replicas (world size).
    pub num_replicas: u64,
    /// Whether the tail is dropped instead of padded.
    pub drop_last: bool,
    /// Whether indices are shuffled.
    pub shuffle: bool,
    /// Positions of this epoch's order skipped by every rank after a re-shard (0
    /// unless a state was loaded with [`Reshard::Allow`] into another shape).
    #[serde(default)]
    pub offset: u64,
}

/// What [`DistributedSampler::load_state`] does with a state saved by a sampler of
/// another shape (another number of replicas, or another dataset length). A state of
/// the same shape always resumes exactly, whatever the choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reshard {
    /// A state of another shape is an error (the default choice).
    Refuse,
    /// Another number of replicas (world size) continues the saved epoch from what
    /// the whole job had consumed: the first `progress × saved num_replicas`
    /// positions of the epoch's order are skipped and the rest is split among the
    /// current replicas, so nothing is seen twice or skipped. Another dataset length
    /// is still an error ([`Error::LengthChanged`]): the epoch's order depends on the
    /// length, so no position in the new order corresponds to the old progress.
    Allow,
    /// Any change of shape (dataset length or replicas) restarts the saved epoch from
    /// its beginning over the new shape: the samples seen before the interruption
    /// are seen again in this epoch. Only when asked: use it after the dataset
    /// changed on purpose.
    RestartEpoch,
}

#[derive(Debug, Clone)]
enum Order {
    /// Not computed yet for this epoch.
    Pending,
    /// `0..len` (no shuffle).
    Identity,
    /// This rank's share of the permutation, in the smallest storage that holds it.
    Small(Vec<u32>),
    Large(Vec<u64>),
}

/// torch's `num_samples`: what each of `replicas` ranks gets from `span` positions.
fn epoch_samples(span: u64, replicas: u64, drop_last: bool) -> u64 {
    if drop_last && span % replicas != 0 {
        span / replicas
    } else {
        span.div_ceil(replicas)
    }
}

/// torch's `DistributedSampler`, with the same order, made interruptible.
///
/// For the same `len`, `num_replicas`, `rank`, `shuffle`, `seed`, `drop_last` and
/// epoch, it yields exactly the indices of `torch.utils.data.DistributedSampler`
/// (whose permutation is `torch.randperm(len)` from a generator seeded with
/// `seed + epoch`; the list is padded by repeating from the start, or truncated with
/// `drop_last`, then each rank takes every `num_replicas`-th entry from `rank`).
///
/// Unlike torch's, it counts what it yields: [`state`](Self::state) at any point,
/// saved and given to [`load_state`](Self::load_state), resumes with exactly the
/// remaining indices, at the cost of one permutation whatever the position.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    len: u64,
    num_replicas: u64,
    rank: u64,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
    progress: u64,
    offset: u64,
    /// `num_samples()` for the current epoch, kept up to date (it divides).
    num_samples: u64,
    order: Order,
}

impl DistributedSampler {
    /// A sampler over `len` samples for `rank` of `num_replicas`, with torch's
    /// defaults: shuffled, seed 0, padded (not `drop_last`), epoch 0.
    pub fn new(len: u64, num_replicas: u64, rank: u64) -> Result<Self> {
        if num_replicas == 0 {
            return Err(Error::NoReplicas);
        }
        if rank >= num_replicas {
            return Err(Error::RankOutOfRange { rank, num_replicas });
        }
        Ok(DistributedSampler {
            len,
            num_replicas,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: 0,
            progress: 0,
            offset: 0,
            num_samples: 0,
            order: Order::Pending,
        }
        .with_epoch_reset())
    }

    fn with_epoch_reset(mut self) -> Self {
        self.restart_epoch();
        self
    }

    /// Like [`new`](Self::new), with `num_replicas` and `rank` from the launcher's
    /// variables: torchrun's `WORLD_SIZE` and `RANK`, else Slurm's `SLURM_NTASKS` and
    /// `SLURM_PROCID`; a single process (1, 0) when none is set. This is
    /// [`tt_dist::Place`], the rule every torchtools crate follows (so a checkpoint's
    /// writer and the sampler agree on who rank 0 is). A bad or partial value is
    /// [`Error::Environment`], naming the variable.
    pub fn from_env(len: u64) -> Result<Self> {
        Self::from_place(
            len,
            tt_dist::Place::from_env().map_err(|e| Error::Environment {
                reason: e.to_string(),
            })?,
        )
    }

    /// Like [`new`](Self::new), with `num_replicas` and `rank` of `place`.
    pub fn from_place(len: u64, place: tt_dist::Place) -> Result<Self> {
        Self::new(len, place.world_size as u64, place.rank as u64)
    }

    /// Shuffles or not (default: shuffled). Restarts the current epoch.
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self.restart_epoch();
        self
    }

    /// Sets the seed (default 0). Restarts the current epoch.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self.restart_epoch();
        self
    }

    /// Drops the tail that does not divide evenly (default: pads by repeating
    /// indices from the start). Restarts the current epoch.
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self.restart_epoch();
        self
    }

    fn set_offset(&mut self, offset: u64) {
        self.offset = offset;
        self.num_samples = epoch_samples(self.span(), self.num_replicas, self.drop_last);
    }

    /// Moves to epoch `epoch`: another epoch starts from its beginning, with a new
    /// shuffle (seed + epoch); the epoch the sampler is already in keeps its
    /// progress.
    ///
    /// So the usual torch loop resumes exactly after [`load_state`](Self::load_state):
    /// `for e in state.epoch.. { sampler.set_epoch(e); for i in &mut sampler { .. } }`
    /// yields the rest of the resumed epoch, then whole epochs. Calling it with the
    /// current epoch after finishing that epoch yields nothing more: to go through
    /// the same epoch again, call [`restart_epoch`](Self::restart_epoch).
    pub fn set_epoch(&mut self, epoch: u64) {
        if epoch != self.epoch {
            self.epoch = epoch;
            self.restart_epoch();
        }
    }

    /// Starts the current epoch again from its beginning (same order), dropping its
    /// progress and any re-shard offset.
    pub fn restart_epoch(&mut self) {
        self.progress = 0;
        self.set_offset(0);
        self.order = Order::Pending;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// This process's rank.
    pub fn rank(&self) -> u64 {
        self.rank
    }

    /// Number of replicas.
    pub fn num_replicas(&self) -> u64 {
        self.num_replicas
    }

    /// Dataset length.
    pub fn dataset_len(&self) -> u64 {
        self.len
    }

    /// Positions of the epoch's order that this epoch covers (after a re-shard,
    /// fewer than `len`).
    fn span(&self) -> u64 {
        self.len - self.offset
    }

    /// Samples this rank gets in a whole epoch (torch's `num_samples`).
    pub fn num_samples(&self) -> u64 {
        self.num_samples
    }

    /// Samples consumed by this rank in this epoch.
    pub fn progress(&self) -> u64 {
        self.progress
    }

    /// Samples this rank has left in this epoch (what `len()` of the iterator says).
    pub fn remaining(&self) -> u64 {
        self.num_samples() - self.progress
    }

    /// Marks `n` more samples as consumed (e.g. skipped). Iterating already counts
    /// what it yields: call this only for samples taken some other way.
    ///
    /// Advancing past the end of the epoch is [`Error::AdvancePastEnd`], which says
    /// how many samples were left, and changes nothing (the state stays valid and
    /// loadable). cycling_utils' pattern, iterate and then `advance(batch_len)`,
    /// counts every sample twice: it fails here instead of silently seeing half the
    /// epoch.
    pub fn advance(&mut self, n: u64) -> Result<()> {
        let remaining = self.remaining();
        if n > remaining {
            return Err(Error::AdvancePastEnd {
                n,
                remaining,
                num_samples: self.num_samples,
            });
        }
        self.progress += n;
        Ok(())
    }

    /// The state to save in a checkpoint.
    pub fn state(&self) -> SamplerState {
        SamplerState {
            epoch: self.epoch,
            progress: self.progress,
            seed: self.seed,
            len: self.len,
            num_replicas: self.num_replicas,
            drop_last: self.drop_last,
            shuffle: self.shuffle,
            offset: self.offset,
        }
    }

    /// Resumes from `state`: the epoch, the seed, shuffle and drop_last it was saved
    /// with (the run's truth), and exactly the indices this rank had not consumed.
    /// Its cost is one permutation, wherever in the epoch the state was taken.
    ///
    /// A state saved with another `num_replicas` is refused unless `reshard` is
    /// [`Reshard::Allow`] (continue the epoch) or [`Reshard::RestartEpoch`]; one saved
    /// with another dataset `len` is refused unless it is `RestartEpoch`. On an error
    /// the sampler is unchanged.
    pub fn load_state(&mut self, state: &SamplerState, reshard: Reshard) -> Result<()> {
        let same_shape = state.len == self.len && state.num_replicas == self.num_replicas;
        if state.num_replicas == 0 {
            return Err(Error::NoReplicas);
        }
        match reshard {
            _ if same_shape => {}
            Reshard::Refuse => {
                return Err(Error::ShapeMismatch {
                    state_len: state.len,
                    state_replicas: state.num_replicas,
                    len: self.len,
                    replicas: self.num_replicas,
                })
            }
            Reshard::Allow if state.len != self.len => {
                return Err(Error::LengthChanged {
                    state_len: state.len,
                    len: self.len,
                })
            }
            Reshard::Allow | Reshard::RestartEpoch => {}
        }
        // The saved sampler's own epoch length, to validate its progress.
        let saved_offset = state.offset.min(state.len);
        let saved_samples = epoch_samples(
            state.len - saved_offset,
            state.num_replicas,
            state.drop_last,
        );
        if state.progress > saved_samples {
            return Err(Error::ProgressPastEnd {
                progress: state.progress,
                num_samples: saved_samples,
            });
        }
        state
            .seed
            .checked_add(state.epoch)
            .ok_or(Error::SeedOverflow {
                seed: state.seed,
                epoch: state.epoch,
            })?;
        self.seed = state.seed;
        self.shuffle = state.shuffle;
        self.drop_last = state.drop_last;
        self.epoch = state.epoch;
        self.restart_epoch();
        if reshard == Reshard::RestartEpoch && !same_shape {
            // Already at the epoch's beginning over the new shape.
        } else if same_shape {
            self.set_offset(saved_offset);
            self.progress = state.progress;
        } else {
            // Every rank of the saved job consumed `progress` samples in lockstep.
            let consumed =
                saved_offset.saturating_add(state.progress.saturating_mul(state.num_replicas));
            self.set_offset(consumed.min(self.len));
            self.progress = 0;
        }
        Ok(())
    }

    /// Computes the epoch's order once (the one costly step: kept out of line).
    #[inline(never)]
    fn ensure_order(&mut self) -> Result<()> {
        if !matches!(self.order, Order::Pending) {
            return Ok(());
        }
        if !self.shuffle {
            self.order = Order::Identity;
            return Ok(());
        }
        let seed = self
            .seed
            .checked_add(self.epoch)
            .ok_or(Error::SeedOverflow {
                seed: self.seed,
                epoch: self.epoch,
            })?;
        self.order = if self.len <= u32::MAX as u64 + 1 {
            Order::Small(self.rank_share::<u32>(seed))
        } else {
            Order::Large(self.rank_share::<u64>(seed))
        };
        Ok(())
    }

    /// Generates the epoch's permutation and keeps only this rank's share, in
    /// order: iteration is then a sequential read, and the permutation's memory
    /// (`len` entries) is released at once.
    fn rank_share<T: PermIndex>(&self, seed: u64) -> Vec<T> {
        let mut perm: Vec<T> = Vec::new();
        randperm_into::<T>(self.len, seed, &mut perm);
        (0..self.num_samples)
            .map(|k| perm[self.position(k) as usize])
            .collect()
    }

    /// Where this rank's sample `k` sits in the epoch's order (padding wraps).
    #[inline]
    fn position(&self, k: u64) -> u64 {
        let m = self.span();
        let g = self.rank + k * self.num_replicas;
        // Only the padding (past the end) wraps: no division for the rest.
        self.offset + if g < m { g } else { g % m }
    }

    /// The index at this rank's sample `k` of the epoch (the order must be ready).
    #[inline]
    fn index_at(&self, k: u64) -> u64 {
        match &self.order {
            Order::Identity | Order::Pending => self.position(k),
            Order::Small(share) => share[k as usize].to_u64(),
            Order::Large(share) => share[k as usize].to_u64(),
        }
    }

    /// The next index of this rank, counted as consumed; `None` at the end of the
    /// epoch. Errors only if `seed + epoch` overflows.
    pub fn next_index(&mut self) -> Result<Option<u64>> {
        if self.progress >= self.num_samples {
            return Ok(None);
        }
        if matches!(self.order, Order::Pending) {
            self.ensure_order()?;
        }
        Ok(Some(self.take_one()))
    }

    /// Yields sample `progress` (the order must be ready).
    #[inline(always)]
    fn take_one(&mut self) -> u64 {
        let index = self.index_at(self.progress);
        self.progress += 1;
        index
    }

    /// Up to `n` next indices of this rank into `out` (cleared first), counted as
    /// consumed. Returns how many were written (0 at the end of the epoch).
    pub fn next_chunk(&mut self, n: usize, out: &mut Vec<u64>) -> Result<usize> {
        out.clear();
        let take = (n as u64).min(self.remaining());
        if take == 0 {
            return Ok(0);
        }
        self.ensure_order()?;
        out.extend((self.progress..self.progress + take).map(|k| self.index_at(k)));
        self.progress += take;
        Ok(take as usize)
    }

    /// All indices this rank has left in this epoch, without consuming them.
    pub fn peek_remaining(&mut self) -> Result<Vec<u64>> {
        self.ensure_order()?;
        Ok((self.progress..self.num_samples())
            .map(|k| self.index_at(k))
            .collect())
    }
}

/// Iterating yields this rank's remaining indices of the epoch, counting each.
/// (A `seed + epoch` that overflows 64 bits ends the iteration; [`next_index`]
/// reports it as an error.)
///
/// [`next_index`]: DistributedSampler::next_index
impl Iterator for DistributedSampler {
    type Item = u64;

    #[inline]
    fn next(&mut self) -> Option<u64> {
        if self.progress >= self.num_samples {
            return None;
        }
        if matches!(self.order, Order::Pending) && self.ensure_order().is_err() {
            return None;
        }
        Some(self.take_one())
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = usize::try_from(self.remaining()).unwrap_or(usize::MAX);
        (n, Some(n))
    }
}

//! Batches across epochs: the `for epoch in ..: sampler.set_epoch(epoch); for batch in
//! loader` loop of a PyTorch script, as one iterator that resumes mid-epoch.

use tt_sampler::{BatchSampler, DistributedSampler, SamplerState};

/// One batch: this rank's sample indices, and where it falls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The epoch it belongs to.
    pub epoch: u64,
    /// This rank's sample indices.
    pub indices: Vec<u64>,
}

/// This rank's batches over `epochs` epochs, in torch's `DistributedSampler` order
/// (a new shuffle each epoch, seed + epoch), moving to the next epoch by itself.
///
/// Its [`state`](Self::state) saved in a checkpoint and loaded back
/// ([`load_state`](Self::load_state)) resumes at the next unseen batch of the same
/// epoch, so an interrupted run sees every sample of every epoch exactly once.
///
/// ```
/// use tt_sampler::DistributedSampler;
/// use tt_train::EpochBatches;
///
/// // 10 samples, 2 ranks, this is rank 0; batches of 2 over 3 epochs.
/// let sampler = DistributedSampler::new(10, 2, 0)?.with_seed(7);
/// let mut batches = EpochBatches::new(sampler, 2, 3)?;
/// let first: Vec<_> = (&mut batches).take(4).collect::<Result<_, _>>()?;
/// assert_eq!(first.iter().map(|b| b.epoch).collect::<Vec<_>>(), [0, 0, 0, 1]);
/// let saved = batches.state();
/// assert_eq!(batches.remaining_batches(), 5);
/// let rest = batches.count();
/// assert_eq!(4 + rest, 9); // 3 batches (2 + 2 + 1 samples) per epoch
///
/// let mut resumed = EpochBatches::new(DistributedSampler::new(10, 2, 0)?.with_seed(7), 2, 3)?;
/// resumed.load_state(&saved, tt_sampler::Reshard::Refuse)?;
/// assert_eq!(resumed.count(), rest);
/// # Ok::<(), tt_sampler::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct EpochBatches {
    batches: BatchSampler,
    epochs: u64,
}

impl EpochBatches {
    /// Batches of `batch_size` (the last one of an epoch may be smaller) over `epochs`
    /// epochs, starting where `sampler` is.
    pub fn new(
        sampler: DistributedSampler,
        batch_size: usize,
        epochs: u64,
    ) -> Result<Self, tt_sampler::Error> {
        Ok(EpochBatches {
            batches: BatchSampler::new(sampler, batch_size, false)?,
            epochs,
        })
    }

    /// The next batch, moving to the next epoch at the end of one; `None` after the
    /// last epoch.
    pub fn next_batch(&mut self) -> Result<Option<Batch>, tt_sampler::Error> {
        loop {
            let epoch = self.batches.sampler().epoch();
            if epoch >= self.epochs {
                return Ok(None);
            }
            match self.batches.next_batch()? {
                Some(indices) => return Ok(Some(Batch { epoch, indices })),
                None => self.batches.sampler_mut().set_epoch(epoch + 1),
            }
        }
    }

    /// The epoch the next batch comes from (`epochs` once finished).
    pub fn epoch(&self) -> u64 {
        self.batches.sampler().epoch().min(self.epochs)
    }

    /// Batches left in all: the rest of this epoch and every later one (what a
    /// progress bar counts down).
    pub fn remaining_batches(&self) -> u64 {
        let epoch = self.batches.sampler().epoch();
        if epoch >= self.epochs {
            return 0;
        }
        let mut whole = self.batches.clone();
        whole.sampler_mut().restart_epoch();
        self.batches.remaining_batches() + (self.epochs - epoch - 1) * whole.remaining_batches()
    }

    /// The epochs in all.
    pub fn epochs(&self) -> u64 {
        self.epochs
    }

    /// The state to save (epoch and samples consumed in it).
    pub fn state(&self) -> SamplerState {
        self.batches.state()
    }

    /// Continues from a saved state; see [`tt_sampler::Reshard`] for states saved by
    /// another world size.
    pub fn load_state(
        &mut self,
        state: &SamplerState,
        reshard: tt_sampler::Reshard,
    ) -> Result<(), tt_sampler::Error> {
        self.batches.sampler_mut().load_state(state, reshard)
    }

    /// The sampler underneath.
    pub fn sampler(&self) -> &DistributedSampler {
        self.batches.sampler()
    }
}

impl Iterator for EpochBatches {
    type Item = Result<Batch, tt_sampler::Error>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch().transpose()
    }
}

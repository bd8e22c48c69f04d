use crate::{DistributedSampler, Error, Result, SamplerState};

/// Batches of indices on top of a [`DistributedSampler`], like torch's
/// `BatchSampler`. Progress is counted in samples, so a state saved between
/// batches resumes at the next batch, and one saved with another batch size still
/// resumes at the right sample.
#[derive(Debug, Clone)]
pub struct BatchSampler {
    sampler: DistributedSampler,
    batch_size: usize,
    drop_last: bool,
}

impl BatchSampler {
    /// Batches of `batch_size`; the last, smaller batch is kept unless `drop_last`.
    pub fn new(sampler: DistributedSampler, batch_size: usize, drop_last: bool) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::ZeroBatchSize);
        }
        Ok(BatchSampler {
            sampler,
            batch_size,
            drop_last,
        })
    }

    /// The next batch of this rank, counted as consumed; `None` at the end of the
    /// epoch (or before a short last batch, with `drop_last`).
    pub fn next_batch(&mut self) -> Result<Option<Vec<u64>>> {
        if self.drop_last && self.sampler.remaining() < self.batch_size as u64 {
            return Ok(None);
        }
        let mut batch = Vec::with_capacity(self.batch_size);
        match self.sampler.next_chunk(self.batch_size, &mut batch)? {
            0 => Ok(None),
            _ => Ok(Some(batch)),
        }
    }

    /// Batches left in this epoch.
    pub fn remaining_batches(&self) -> u64 {
        let (left, bs) = (self.sampler.remaining(), self.batch_size as u64);
        if self.drop_last {
            left / bs
        } else {
            left.div_ceil(bs)
        }
    }

    /// The underlying sampler (for `set_epoch`, `state`, `load_state`).
    pub fn sampler(&self) -> &DistributedSampler {
        &self.sampler
    }

    /// The underlying sampler, mutably.
    pub fn sampler_mut(&mut self) -> &mut DistributedSampler {
        &mut self.sampler
    }

    /// The state to save: the sampler's, progress in samples.
    pub fn state(&self) -> SamplerState {
        self.sampler.state()
    }
}

impl Iterator for BatchSampler {
    type Item = Vec<u64>;

    fn next(&mut self) -> Option<Vec<u64>> {
        self.next_batch().ok().flatten()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = usize::try_from(self.remaining_batches()).unwrap_or(usize::MAX);
        (n, Some(n))
    }
}

//! `InterruptableDistributedSampler`'s order: tt-sampler's `DistributedSampler`, bit
//! for bit torch's (its permutation is torch's `randperm` on a CPU generator seeded
//! with `seed + epoch`), with the progress that resumes an epoch mid-way.

use std::sync::Mutex;

use pyo3::prelude::*;
use tt_sampler::{DistributedSampler, Reshard, SamplerState};

/// One rank's sampler over `len` samples.
#[pyclass(module = "torchtools._native")]
pub(crate) struct Sampler {
    inner: Mutex<DistributedSampler>,
}

/// A state as Python gets it: epoch, progress, seed, length, replicas, drop_last,
/// shuffle, offset.
type State = (u64, u64, u64, u64, u64, bool, bool, u64);

fn err(e: tt_sampler::Error) -> PyErr {
    crate::errors::BadRequestError::new_err(e.to_string())
}

impl Sampler {
    fn with<T>(&self, f: impl FnOnce(&mut DistributedSampler) -> T) -> PyResult<T> {
        let mut inner = self
            .inner
            .lock()
            .map_err(|_| crate::errors::error("the sampler was poisoned by a panic"))?;
        Ok(f(&mut inner))
    }
}

#[pymethods]
impl Sampler {
    #[new]
    #[pyo3(signature = (len, num_replicas, rank, shuffle, seed, drop_last))]
    fn new(
        len: u64,
        num_replicas: u64,
        rank: u64,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
    ) -> PyResult<Sampler> {
        let inner = DistributedSampler::new(len, num_replicas, rank)
            .map_err(err)?
            .with_shuffle(shuffle)
            .with_seed(seed)
            .with_drop_last(drop_last);
        Ok(Sampler {
            inner: Mutex::new(inner),
        })
    }

    /// Starts epoch `epoch` from its beginning.
    fn set_epoch(&self, epoch: u64) -> PyResult<()> {
        self.with(|s| s.set_epoch(epoch))
    }

    /// Marks `n` more samples of this epoch as consumed.
    fn advance(&self, n: u64) -> PyResult<()> {
        self.with(|s| s.advance(n))?.map_err(err)
    }

    /// This rank's samples per epoch.
    #[getter]
    fn num_samples(&self) -> PyResult<u64> {
        self.with(|s| s.num_samples())
    }

    /// Samples consumed in this epoch.
    #[getter]
    fn progress(&self) -> PyResult<u64> {
        self.with(|s| s.progress())
    }

    /// The epoch.
    #[getter]
    fn epoch(&self) -> PyResult<u64> {
        self.with(|s| s.epoch())
    }

    /// The indices this rank has still to see in this epoch, in order.
    fn remaining(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let mut copy = self.with(|s| s.clone())?;
        py.detach(move || {
            let mut out = Vec::with_capacity(copy.remaining() as usize);
            while let Some(i) = copy.next_index()? {
                out.push(i);
            }
            Ok(out)
        })
        .map_err(err)
    }

    /// Epoch and progress (cycling_utils' keys), and what they mean (seed, length,
    /// replicas...), so that a resume into another dataset or world is caught.
    fn state(&self) -> PyResult<State> {
        let s = self.with(|s| s.state())?;
        Ok((
            s.epoch,
            s.progress,
            s.seed,
            s.len,
            s.num_replicas,
            s.drop_last,
            s.shuffle,
            s.offset,
        ))
    }

    /// Resumes from a state (`state`'s tuple); `reshard`: a state of another world
    /// size continues its epoch over the new ranks instead of being refused.
    #[pyo3(signature = (epoch, progress, seed, len, num_replicas, drop_last, shuffle, offset, reshard))]
    #[allow(clippy::too_many_arguments)] // a state's fields, one each
    fn load_state(
        &self,
        epoch: u64,
        progress: u64,
        seed: u64,
        len: u64,
        num_replicas: u64,
        drop_last: bool,
        shuffle: bool,
        offset: u64,
        reshard: bool,
    ) -> PyResult<()> {
        let state = SamplerState {
            epoch,
            progress,
            seed,
            len,
            num_replicas,
            drop_last,
            shuffle,
            offset,
        };
        let how = if reshard {
            Reshard::Allow
        } else {
            Reshard::Refuse
        };
        self.with(|s| s.load_state(&state, how))?.map_err(err)
    }
}

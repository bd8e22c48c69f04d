//! Feature `tch`: `chunked` over tensors.

use std::panic::Location;

use crate::adaptive::Site;
use crate::{Adaptive, AdaptiveError, OomClassify};

impl Adaptive {
    /// Calls `f(chunk, from, to)` on `tensor.narrow(dim, from, to - from)` (a view: in-place
    /// operations on it write into `tensor`, as toma's `chunked` fills its output) over the
    /// whole dimension, in steps of `initial_step` (or the remembered step), lowering
    /// the step on out-of-memory and continuing where it failed (toma's `chunked`).
    /// Write results into an output the closure captures. Use tch's `f_` methods inside,
    /// which return errors; the plain ones panic (see [`Adaptive::catch_oom_panics`]).
    ///
    /// ```
    /// use tch::{Kind, Tensor};
    /// let data = Tensor::arange(100, (Kind::Float, tch::Device::Cpu));
    /// let out = Tensor::zeros([100], (Kind::Float, tch::Device::Cpu));
    /// tt_adaptive::Adaptive::new().chunked(&data, 0, 32, |chunk, from, to| {
    ///     out.f_narrow(0, from as i64, (to - from) as i64)?.f_copy_(&chunk.f_mul_scalar(2)?)
    /// })?;
    /// assert_eq!(out.sum(Kind::Float).double_value(&[]), 9900.0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[track_caller]
    pub fn chunked<E: OomClassify + From<tch::TchError>>(
        &self,
        tensor: &tch::Tensor,
        dim: i64,
        initial_step: usize,
        f: impl FnMut(&mut tch::Tensor, usize, usize) -> Result<(), E>,
    ) -> Result<(), AdaptiveError<E>> {
        self.chunked_at(
            Site::Caller(Location::caller()),
            tensor,
            dim,
            initial_step,
            f,
        )
    }

    /// [`chunked`](Self::chunked) with the cache entry named by `key` instead of the
    /// call site (see [`batch_keyed`](Self::batch_keyed)).
    pub fn chunked_keyed<E: OomClassify + From<tch::TchError>>(
        &self,
        key: impl AsRef<str>,
        tensor: &tch::Tensor,
        dim: i64,
        initial_step: usize,
        f: impl FnMut(&mut tch::Tensor, usize, usize) -> Result<(), E>,
    ) -> Result<(), AdaptiveError<E>> {
        let site = Site::Named(std::sync::Arc::from(key.as_ref()));
        self.chunked_at(site, tensor, dim, initial_step, f)
    }

    fn chunked_at<E: OomClassify + From<tch::TchError>>(
        &self,
        site: Site,
        tensor: &tch::Tensor,
        dim: i64,
        initial_step: usize,
        mut f: impl FnMut(&mut tch::Tensor, usize, usize) -> Result<(), E>,
    ) -> Result<(), AdaptiveError<E>> {
        let len = tensor
            .size()
            .get(usize::try_from(dim).unwrap_or(usize::MAX))
            .copied()
            .ok_or_else(|| {
                AdaptiveError::Failed(E::from(tch::TchError::Shape(format!(
                    "chunked: dimension {dim} does not exist in a tensor of shape {:?}",
                    tensor.size()
                ))))
            })?;
        self.range_at(site, 0, len.max(0) as usize, initial_step, |from, to| {
            let mut chunk = tensor.f_narrow(dim, from as i64, (to - from) as i64)?;
            f(&mut chunk, from, to)
        })
    }
}

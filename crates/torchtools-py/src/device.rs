//! `get_device_from_env`'s decision: tt-device's rule (`TORCHTOOLS_DEVICE`,
//! `LOCAL_RANK`, the free memory of each GPU), on what the user's torch can use.

use pyo3::prelude::*;
use tt_device::{select_with, Availability, Bytes, CudaCandidate, EnvConfig};

/// Chooses the device: `cuda` is `Ok` with each visible CUDA device's free bytes (None
/// when unknown), or `Err` with why CUDA is not usable; `mps` likewise. Returns the
/// device's name (`cuda:1`, `cpu`, `mps`) and why it was chosen; a bad variable is a
/// `TorchtoolsError` naming it.
#[pyfunction]
#[pyo3(signature = (cuda_free, cuda_unusable, mps_unusable))]
pub(crate) fn select_device(
    cuda_free: Vec<Option<u64>>,
    cuda_unusable: Option<String>,
    mps_unusable: Option<String>,
) -> PyResult<(String, String)> {
    let env = EnvConfig::from_env().map_err(crate::errors::error)?;
    let cuda = match cuda_unusable {
        Some(why) => Err(why),
        None if cuda_free.is_empty() => Err("torch sees no CUDA device".to_owned()),
        None => Ok(cuda_free
            .into_iter()
            .enumerate()
            .map(|(index, free)| CudaCandidate {
                index,
                free: free.map(Bytes),
            })
            .collect()),
    };
    let avail = Availability {
        cuda,
        mps: match mps_unusable {
            Some(why) => Err(why),
            None => Ok(()),
        },
    };
    let selection = select_with(&env, &avail).map_err(crate::errors::error)?;
    Ok((selection.device.to_string(), selection.reason))
}

/// Seconds in a duration as the `torchtools` command takes them (`90`, `30s`, `10m`,
/// `1.5h`); a `BadRequestError` saying what is accepted otherwise.
#[pyfunction]
pub(crate) fn parse_duration(text: &str) -> PyResult<f64> {
    tt_device::parse_duration(text)
        .map(|d| d.as_secs_f64())
        .map_err(crate::errors::BadRequestError::new_err)
}

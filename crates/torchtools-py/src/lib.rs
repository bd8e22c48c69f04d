//! `torchtools._native`: the Rust side of the Python package `torchtools` (its Python
//! side is in `python/torchtools`). Thin: each function hands Python's arguments to a
//! torchtools crate and its errors back as Python exceptions carrying our messages.
//! No libtorch is linked; where tensors are involved, the user's torch does the work
//! in Python (`torch.save` into the file this module makes atomic).

use pyo3::prelude::*;

mod adaptive;
mod ckpt;
mod device;
mod errors;
mod reserve;
mod sampler;
mod slurm;
mod tracker;

/// The module `torchtools._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The margin a fence leaves free on top of the job's bytes: tt-fence's, so the
    // Python default and the Rust one are one number.
    m.add(
        "DEFAULT_SAFETY_MARGIN_BYTES",
        tt_reserve::ReserveOptions::default().safety_margin_bytes.0,
    )?;
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(device::select_device, m)?)?;
    m.add_function(wrap_pyfunction!(device::parse_duration, m)?)?;
    m.add_class::<reserve::Reservation>()?;
    m.add_class::<adaptive::Adaptive>()?;
    m.add_function(wrap_pyfunction!(adaptive::oom_kind, m)?)?;
    m.add_class::<ckpt::AtomicWriter>()?;
    m.add_class::<ckpt::PendingSave>()?;
    m.add_function(wrap_pyfunction!(ckpt::save_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(ckpt::save_checkpoint_async, m)?)?;
    m.add_function(wrap_pyfunction!(ckpt::load_checkpoint, m)?)?;
    m.add_class::<sampler::Sampler>()?;
    m.add_class::<tracker::Tracker>()?;
    m.add_function(wrap_pyfunction!(slurm::slurm_job, m)?)?;
    m.add_function(wrap_pyfunction!(slurm::slurm_restart_count, m)?)?;
    m.add_function(wrap_pyfunction!(slurm::slurm_requeue_self, m)?)?;
    Ok(())
}

//! The exceptions Python sees: every one a `TorchtoolsError` (a `RuntimeError`), with
//! our message (the cause said once, inside it).

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

create_exception!(
    _native,
    TorchtoolsError,
    PyRuntimeError,
    "An error of torchtools, with its message."
);
create_exception!(
    _native,
    GpuBusyError,
    TorchtoolsError,
    "The GPUs stayed held by others past the timeout (or at once with blocking=False)."
);
create_exception!(
    _native,
    BadRequestError,
    TorchtoolsError,
    "The request itself is wrong (an unknown GPU, contradicting options): fix the arguments."
);
create_exception!(
    _native,
    FenceError,
    TorchtoolsError,
    "The memory fence could not be raised (no NVML, no CUDA driver, or no memory); the \
     locks were released."
);

/// Adds the exceptions to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TorchtoolsError", py.get_type::<TorchtoolsError>())?;
    m.add("GpuBusyError", py.get_type::<GpuBusyError>())?;
    m.add("BadRequestError", py.get_type::<BadRequestError>())?;
    m.add("FenceError", py.get_type::<FenceError>())?;
    Ok(())
}

/// A reservation's failure as the exception that says what to do about it.
pub(crate) fn reserve_error(e: tt_reserve::Error) -> PyErr {
    let message = e.to_string();
    if e.is_busy() {
        GpuBusyError::new_err(message)
    } else if e.is_bad_request() {
        BadRequestError::new_err(message)
    } else if matches!(
        e,
        tt_reserve::Error::Fence(_) | tt_reserve::Error::FenceWithoutNvml { .. }
    ) {
        FenceError::new_err(message)
    } else {
        TorchtoolsError::new_err(message)
    }
}

/// Any other error of ours.
pub(crate) fn error(e: impl std::fmt::Display) -> PyErr {
    TorchtoolsError::new_err(e.to_string())
}

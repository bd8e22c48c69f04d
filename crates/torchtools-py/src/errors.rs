//! The exceptions Python sees: every one a `TorchtoolsError` (a `RuntimeError`), with
//! our message (the cause said once, inside it); `BadRequestError` a `ValueError` too.

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

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
    FenceError,
    TorchtoolsError,
    "The memory fence could not be raised (no NVML, no CUDA driver, or no memory); the \
     locks were released."
);

/// `BadRequestError`: a `TorchtoolsError` and a `ValueError` both (what Python code
/// expects of a wrong argument), made once at import by `type(...)`, as Python makes a
/// class with two bases (PyO3's exceptions have one).
static BAD_REQUEST: PyOnceLock<Py<PyType>> = PyOnceLock::new();

const BAD_REQUEST_DOC: &str =
    "The request itself is wrong (an unknown GPU, contradicting options): fix the arguments. \
     A TorchtoolsError and a ValueError.";

/// The request itself is wrong: raised as `torchtools.BadRequestError`.
pub(crate) struct BadRequestError;

impl BadRequestError {
    /// The exception, with `args` as its message.
    pub(crate) fn new_err<A>(args: A) -> PyErr
    where
        A: pyo3::PyErrArguments + Send + Sync + 'static,
    {
        Python::attach(|py| match BAD_REQUEST.get(py) {
            Some(ty) => PyErr::from_type(ty.bind(py).clone(), args),
            // Only before the module is imported, which no caller can be.
            None => TorchtoolsError::new_err(args),
        })
    }
}

fn bad_request_type(py: Python<'_>) -> PyResult<&Py<PyType>> {
    BAD_REQUEST.get_or_try_init(py, || {
        let bases = PyTuple::new(
            py,
            [
                py.get_type::<TorchtoolsError>().into_any(),
                py.get_type::<PyValueError>().into_any(),
            ],
        )?;
        let namespace = PyDict::new(py);
        namespace.set_item("__module__", "torchtools._native")?;
        namespace.set_item("__doc__", BAD_REQUEST_DOC)?;
        let made = py
            .get_type::<PyType>()
            .call1(("BadRequestError", bases, namespace))?;
        Ok(made.cast_into::<PyType>()?.unbind())
    })
}

/// Adds the exceptions to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TorchtoolsError", py.get_type::<TorchtoolsError>())?;
    m.add("GpuBusyError", py.get_type::<GpuBusyError>())?;
    m.add("BadRequestError", bad_request_type(py)?.bind(py))?;
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

//! toma's `batch`, `range` and `chunked`: tt-adaptive's engine, driving Python
//! callables. Which exception is an out-of-memory is tt-adaptive's classifier's answer
//! (`oom_kind`, which the Python side asks of an exception's message); Python frees
//! memory after one; the engine decides the next size and remembers it per key.

use pyo3::prelude::*;
use tt_adaptive::{Adaptive as Engine, AdaptiveError, Cache, OomClassify, OomKind, Policy};

/// The kind of out-of-memory `message` reports, by tt-adaptive's one classifier
/// (`tt_adaptive::classify_message`): `"cuda"`, `"cudnn"`, `"cublas"`, `"cpu"`, `"mps"`,
/// or `None` for any other message.
#[pyfunction]
pub(crate) fn oom_kind(message: &str) -> Option<&'static str> {
    tt_adaptive::classify_message(message).map(|kind| match kind {
        OomKind::Cuda => "cuda",
        OomKind::Cudnn => "cudnn",
        OomKind::Cublas => "cublas",
        OomKind::Cpu => "cpu",
        OomKind::Mps => "mps",
    })
}

/// How one attempt failed: an out-of-memory (the exception, retried smaller), or any
/// other exception (raised as it is).
enum Failure {
    Oom(PyErr),
    Raised(PyErr),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Oom(e) | Failure::Raised(e) => e.fmt(f),
        }
    }
}

impl OomClassify for Failure {
    fn oom_kind(&self) -> Option<OomKind> {
        match self {
            Failure::Oom(_) => Some(OomKind::Cuda),
            Failure::Raised(_) => None,
        }
    }
}

/// An attempt's answer: `(True, value)`, or `(False, exception)` for an out-of-memory;
/// anything it raises is another failure.
fn answer(py: Python<'_>, result: PyResult<Py<PyAny>>) -> Result<Py<PyAny>, Failure> {
    let pair = result.map_err(Failure::Raised)?;
    let (ok, value): (bool, Py<PyAny>) = pair.extract(py).map_err(Failure::Raised)?;
    if ok {
        Ok(value)
    } else {
        Err(Failure::Oom(PyErr::from_value(value.into_bound(py))))
    }
}

/// The exception an adaptive call ends with: another failure as it was raised; when
/// even size 1 ran out of memory, the last out-of-memory exception (as toma raises it).
fn raise(e: AdaptiveError<Failure>) -> PyErr {
    match e {
        AdaptiveError::Failed(Failure::Raised(e) | Failure::Oom(e)) => e,
        AdaptiveError::NoFit {
            cause: Some(Failure::Oom(e) | Failure::Raised(e)),
            ..
        } => e,
        e @ AdaptiveError::NoFit { .. } => crate::errors::error(e),
    }
}

/// One engine: its policy and cache, and the sizes it remembers per key.
#[pyclass(module = "torchtools._native")]
pub(crate) struct Adaptive {
    engine: Engine,
}

#[pymethods]
impl Adaptive {
    /// `policy`: "search" (back up toward the largest size that fits) or "halve"
    /// (toma's); `remember`: False for toma's `NoBatchsizeCache`.
    #[new]
    #[pyo3(signature = (policy = "search", remember = true))]
    fn new(policy: &str, remember: bool) -> PyResult<Adaptive> {
        let policy = match policy {
            "search" => Policy::Search,
            "halve" => Policy::Halve,
            other => {
                return Err(crate::errors::BadRequestError::new_err(format!(
                    "policy={other:?}: give \"search\" or \"halve\""
                )))
            }
        };
        let cache = if remember { Cache::Global } else { Cache::None };
        Ok(Adaptive {
            engine: Engine::new().policy(policy).cache(cache).min(1),
        })
    }

    /// Calls `attempt(size)` from `initial` (or the size remembered for `key`),
    /// smaller after each out-of-memory, and returns its value.
    fn batch(
        &self,
        py: Python<'_>,
        key: &str,
        initial: usize,
        attempt: Py<PyAny>,
    ) -> PyResult<Py<PyAny>> {
        check_size("initial_batchsize", initial)?;
        self.engine
            .batch_keyed(key, initial, |size| answer(py, attempt.call1(py, (size,))))
            .map_err(raise)
    }

    /// Calls `attempt(from, to)` over `start..end` in steps of `initial_step` (or the
    /// step remembered for `key`), lowering the step after an out-of-memory and going
    /// on from where it failed: every index exactly once.
    fn range(
        &self,
        py: Python<'_>,
        key: &str,
        start: usize,
        end: usize,
        initial_step: usize,
        attempt: Py<PyAny>,
    ) -> PyResult<()> {
        check_size("initial_step", initial_step)?;
        self.engine
            .range_keyed(key, start, end, initial_step, |from, to| {
                answer(py, attempt.call1(py, (from, to))).map(drop)
            })
            .map_err(raise)
    }

    /// Per key: calls, attempts, out-of-memory errors, the remembered size.
    fn stats(&self) -> Vec<(String, u64, u64, u64, usize)> {
        self.engine
            .stats()
            .into_iter()
            .map(|s| (s.site, s.calls, s.attempts, s.ooms, s.size))
            .collect()
    }
}

fn check_size(name: &str, size: usize) -> PyResult<()> {
    if size == 0 {
        return Err(crate::errors::BadRequestError::new_err(format!(
            "{name}=0: give a size of 1 or more"
        )));
    }
    Ok(())
}

//! `atomic_torch_save`'s file: tt-ckpt's durable, atomic replacement, written by the
//! user's `torch.save` through its path (no copy of the bytes through Rust).

use std::sync::Mutex;

use pyo3::prelude::*;

/// A temp file beside `path`, published over it by `commit` (fsync, rename, fsync of
/// the directory); `abort`, or the object collected, removes it and leaves `path` as
/// it was.
#[pyclass(module = "torchtools._native")]
pub(crate) struct AtomicWriter {
    file: Mutex<Option<tt_ckpt::AtomicFile>>,
    temp: String,
}

#[pymethods]
impl AtomicWriter {
    #[new]
    fn new(path: std::path::PathBuf) -> PyResult<AtomicWriter> {
        let file = tt_ckpt::AtomicFile::new(&path).map_err(crate::errors::error)?;
        Ok(AtomicWriter {
            temp: file.path().display().to_string(),
            file: Mutex::new(Some(file)),
        })
    }

    /// Where to write.
    #[getter]
    fn temp_path(&self) -> String {
        self.temp.clone()
    }

    /// Publishes what was written: after it returns, the target holds it even across a
    /// crash; before, the target holds what it held.
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        let file = self
            .file
            .lock()
            .ok()
            .and_then(|mut f| f.take())
            .ok_or_else(|| crate::errors::error("this file was committed or aborted already"))?;
        py.detach(|| file.commit()).map_err(crate::errors::error)
    }

    /// Removes the temp file; the target is untouched.
    fn abort(&self) {
        if let Ok(mut f) = self.file.lock() {
            drop(f.take());
        }
    }
}

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

/// A tensor as Python hands it over: name, dtype (torch's name), shape, and where its
/// bytes are (a contiguous CPU tensor's `data_ptr()` and size), kept alive by Python.
type RawTensor = (String, String, Vec<usize>, usize, usize);

fn dtype_of(name: &str) -> PyResult<tt_ckpt::Dtype> {
    use tt_ckpt::Dtype::*;
    Ok(match name {
        "float32" => F32,
        "float64" => F64,
        "float16" => F16,
        "bfloat16" => BF16,
        "int64" => I64,
        "int32" => I32,
        "int16" => I16,
        "int8" => I8,
        "uint8" => U8,
        "bool" => BOOL,
        other => {
            return Err(crate::errors::BadRequestError::new_err(format!(
                "a tensor of dtype {other}: checkpoints take float64/32/16, bfloat16, \
                 int64/32/16/8, uint8 and bool"
            )))
        }
    })
}

fn dtype_name(dtype: tt_ckpt::Dtype) -> PyResult<&'static str> {
    use tt_ckpt::Dtype::*;
    Ok(match dtype {
        F32 => "float32",
        F64 => "float64",
        F16 => "float16",
        BF16 => "bfloat16",
        I64 => "int64",
        I32 => "int32",
        I16 => "int16",
        I8 => "int8",
        U8 => "uint8",
        BOOL => "bool",
        other => {
            return Err(crate::errors::error(format!(
                "a tensor of dtype {other:?} in the file: not one torchtools writes"
            )))
        }
    })
}

/// Writes a checkpoint of `tensors` (see [`RawTensor`]) and JSON `values` at `step`.
///
/// # Safety (upheld by the Python side)
/// Every pointer is a contiguous CPU tensor's storage of `len` bytes, kept alive and
/// unchanged until this returns.
unsafe fn write(
    path: &std::path::Path,
    step: u64,
    tensors: &[RawTensor],
    values: &str,
) -> PyResult<()> {
    let mut ckpt = tt_ckpt::Checkpoint::new(step);
    let values: serde_json::Value = serde_json::from_str(values)
        .map_err(|e| crate::errors::BadRequestError::new_err(format!("values: {e}")))?;
    ckpt.set_value("python", &values)
        .map_err(crate::errors::error)?;
    for (name, dtype, shape, ptr, len) in tensors {
        let bytes: &[u8] = if *len == 0 {
            &[]
        } else {
            // SAFETY: the function's contract; a non-empty tensor's pointer is not null.
            unsafe { std::slice::from_raw_parts(*ptr as *const u8, *len) }
        };
        let data = tt_ckpt::TensorData::new(dtype_of(dtype)?, shape.clone(), bytes)
            .map_err(|e| crate::errors::BadRequestError::new_err(format!("{name}: {e}")))?;
        ckpt.add_tensor(name, data).map_err(crate::errors::error)?;
    }
    ckpt.write_to(path).map_err(crate::errors::error)
}

/// Saves a checkpoint now (internal: `torchtools.checkpoint` passes the pointers of
/// tensors it holds for the call).
#[pyfunction]
pub(crate) fn save_checkpoint(
    path: std::path::PathBuf,
    step: u64,
    tensors: Vec<RawTensor>,
    values: &str,
) -> PyResult<()> {
    // SAFETY: the caller (torchtools.checkpoint) holds every tensor, contiguous on the
    // CPU, for this call, and the GIL is kept: no Python thread changes them meanwhile.
    unsafe { write(&path, step, &tensors, values) }
}

/// A checkpoint being written on a thread of its own; the tensors it reads (Python's
/// `keep`) stay alive until it is done, whatever Python does with this object.
#[pyclass(module = "torchtools._native")]
pub(crate) struct PendingSave {
    thread: Mutex<Option<std::thread::JoinHandle<PyResult<()>>>>,
    _keep: Py<PyAny>,
}

#[pymethods]
impl PendingSave {
    /// Waits until the file is durable; raises what the write failed with.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        match thread {
            None => Ok(()),
            Some(t) => py
                .detach(|| t.join())
                .map_err(|_| crate::errors::error("the checkpoint's writer panicked"))?,
        }
    }

    /// Whether the write has finished.
    #[getter]
    fn done(&self) -> bool {
        self.thread
            .lock()
            .map(|t| t.as_ref().is_none_or(|t| t.is_finished()))
            .unwrap_or(true)
    }
}

impl Drop for PendingSave {
    fn drop(&mut self) {
        // The tensors must outlive the write: join it before `_keep` lets them go.
        if let Some(t) = self.thread.get_mut().ok().and_then(|t| t.take()) {
            let _ = t.join();
        }
    }
}

/// Starts writing a checkpoint in the background; `keep` holds the tensors the
/// pointers point into (host copies made for this save).
#[pyfunction]
pub(crate) fn save_checkpoint_async(
    path: std::path::PathBuf,
    step: u64,
    tensors: Vec<RawTensor>,
    values: String,
    keep: Py<PyAny>,
) -> PendingSave {
    // SAFETY: `keep` holds the tensors (host copies made for this save, which nothing
    // else writes) and is released only after the thread is joined (`Drop`).
    let thread = std::thread::spawn(move || unsafe { write(&path, step, &tensors, &values) });
    PendingSave {
        thread: Mutex::new(Some(thread)),
        _keep: keep,
    }
}

/// Reads and verifies a checkpoint: its step, its JSON values, and each tensor's name,
/// dtype, shape and bytes. A damaged file raises `TorchtoolsError` saying what.
#[pyfunction]
#[allow(clippy::type_complexity)] // the four parts Python rebuilds the state from
pub(crate) fn load_checkpoint(
    py: Python<'_>,
    path: std::path::PathBuf,
) -> PyResult<(
    u64,
    String,
    Vec<(String, String, Vec<usize>, Py<pyo3::types::PyByteArray>)>,
)> {
    let loaded = py
        .detach(|| tt_ckpt::LoadedCheckpoint::read(&path))
        .map_err(crate::errors::error)?;
    let values: serde_json::Value = loaded.value("python").unwrap_or(serde_json::Value::Null);
    let mut tensors = Vec::new();
    for name in loaded.tensors().names() {
        let view = loaded.tensor(&name).map_err(crate::errors::error)?;
        tensors.push((
            name,
            dtype_name(view.dtype())?.to_owned(),
            view.shape().to_vec(),
            // One copy, into a buffer torch takes as it is (`torch.frombuffer`).
            pyo3::types::PyByteArray::new(py, view.data()).unbind(),
        ));
    }
    Ok((loaded.step(), values.to_string(), tensors))
}

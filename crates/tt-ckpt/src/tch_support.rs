//! tch tensors and VarStores in checkpoints (feature `tch`).
// Left out of mutation testing: libtorch tensors behind the `tch` feature, not in
// the core that is measured.
#![cfg_attr(mutants, mutants::skip)]

use std::collections::BTreeMap;

use tch::{Device, Kind, Tensor};

use crate::{
    Checkpoint, Dtype, Error, LoadedCheckpoint, Result, TensorData, TensorFile, TensorView,
};

fn torch_err(what: String) -> impl FnOnce(tch::TchError) -> Error {
    move |e| Error::Tensors {
        reason: format!("{what}: {e}"),
    }
}

fn read_err(what: String) -> impl FnOnce(tch::TchError) -> Error {
    move |e| Error::Unreadable {
        reason: format!("{what}: {e}"),
    }
}

/// The safetensors dtype of a tch kind.
pub fn dtype_of(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        Kind::Float8e5m2 => Dtype::F8_E5M2,
        Kind::Float8e4m3fn => Dtype::F8_E4M3,
        Kind::ComplexFloat => Dtype::C64,
        other => {
            return Err(Error::Tensors {
                reason: format!(
                    "tch kind {other:?} has no safetensors dtype (convert it, e.g. with to_kind, \
                 before saving)"
                ),
            })
        }
    })
}

/// The tch kind of a safetensors dtype. A dtype tch 0.24 has no kind for (unsigned
/// 16-, 32- and 64-bit integers, F8_E8M0, F4, F6) is [`Error::Unreadable`].
pub fn kind_of(dtype: Dtype) -> Result<Kind> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        Dtype::F8_E5M2 => Kind::Float8e5m2,
        Dtype::F8_E4M3 => Kind::Float8e4m3fn,
        Dtype::C64 => Kind::ComplexFloat,
        other => {
            return Err(Error::Unreadable {
                reason: format!(
                    "safetensors dtype {other:?} has no tch kind (tch 0.24 has none for it): \
                 convert the tensor in Python before saving, or read its bytes with \
                 TensorFile::tensor"
                ),
            })
        }
    })
}

impl TensorData<'static> {
    /// The bytes of `tensor` (copied to host memory, contiguous), with its dtype and shape.
    pub fn from_tch(tensor: &Tensor) -> Result<Self> {
        Self::from_tch_into(tensor, Vec::with_capacity)
    }

    /// `tensor` copied into `buffer(len)` (an empty vector with room for `len` bytes)
    /// by libtorch's own copy: from any device and any strides, on libtorch's
    /// intra-op threads, so a new buffer's pages are first touched by all of them
    /// (with 2 threads, 50 MB of fresh host memory filled in 15 ms rather than 27).
    fn from_tch_into(tensor: &Tensor, buffer: impl FnOnce(usize) -> Vec<u8>) -> Result<Self> {
        let kind = tensor.kind();
        let dtype = dtype_of(kind)?;
        let size = tensor.size();
        let shape: Vec<usize> = size.iter().map(|&d| d as usize).collect();
        let len = shape.iter().product::<usize>() * kind.elt_size_in_bytes();
        let mut bytes = buffer(len);
        bytes.clear();
        bytes.reserve_exact(len);
        if len > 0 {
            // SAFETY: the blob is `bytes`' allocation, with room for `len` bytes: a
            // contiguous CPU tensor of `size` and `kind` (exactly `len` bytes) that
            // does not own it and is dropped before `bytes` is touched again.
            let mut host =
                unsafe { Tensor::f_from_blob(bytes.as_mut_ptr(), &size, &[], kind, Device::Cpu) }
                    .map_err(torch_err("copy to host".into()))?;
            // Without autograd: a copy of a trainable variable records no graph.
            tch::no_grad(|| host.f_copy_(tensor)).map_err(torch_err("copy to host".into()))?;
            drop(host);
            // SAFETY: the copy wrote every element of the contiguous blob, so the
            // first `len` bytes are initialised (within the capacity reserved above).
            unsafe { bytes.set_len(len) };
        }
        TensorData::new(dtype, shape, bytes)
    }
}

impl Checkpoint<'_> {
    /// Adds `tensor` (any device) under `name`, copied to host memory: a CPU tensor
    /// into a recycled buffer when the checkpoint came from
    /// `CheckpointDir::checkpoint`; a CUDA tensor as [`add_tch_many`](Self::add_tch_many)
    /// does, without waiting.
    pub fn add_tch(&mut self, name: &str, tensor: &Tensor) -> Result<()> {
        if tensor.device().is_cuda() {
            return self.add_tch_many(&[(name.to_owned(), tensor.shallow_clone())]);
        }
        let data = TensorData::from_tch_into(tensor, |len| self.buffer(len))?;
        self.add_tensor(name, data)
    }

    /// Adds named tensors. CUDA tensors are copied into pinned host memory on their
    /// device's current stream without waiting (`tt_sys::HostCopies`): the call returns
    /// once the copies are queued, training goes on, and whatever it queues next (the
    /// optimizer changing the parameters) runs after the copies, so the checkpoint
    /// holds the values of this call. Writing it (`save`, `save_async`, `write_to`)
    /// waits for the copies first. The pinned blocks are libtorch's cached ones: the
    /// next checkpoint reuses them.
    pub fn add_tch_many(&mut self, tensors: &[(String, Tensor)]) -> Result<()> {
        let (cuda, host): (Vec<_>, Vec<_>) =
            tensors.iter().partition(|(_, t)| t.device().is_cuda());
        for (name, t) in host {
            self.add_tch(name, t)?;
        }
        // One batch of copies (and one event) per device.
        let mut devices: Vec<Device> = cuda.iter().map(|(_, t)| t.device()).collect();
        devices.sort_by_key(|d| format!("{d:?}"));
        devices.dedup();
        for device in devices {
            let batch: Vec<&(String, Tensor)> = cuda
                .iter()
                .copied()
                .filter(|(_, t)| t.device() == device)
                .collect();
            let dtypes = batch
                .iter()
                .map(|(_, t)| dtype_of(t.kind()))
                .collect::<Result<Vec<_>>>()?;
            let src: Vec<Tensor> = batch.iter().map(|(_, t)| t.shallow_clone()).collect();
            let copies = tt_sys::HostCopies::start(&src).map_err(|e| Error::Tensors {
                reason: format!("copy to host: {e}"),
            })?;
            for (((name, _), dtype), host) in batch.iter().zip(dtypes).zip(copies.host_tensors()) {
                let shape: Vec<usize> = host.size().iter().map(|&d| d as usize).collect();
                let len = host.numel() * host.kind().elt_size_in_bytes();
                let bytes: &'static [u8] = if len == 0 {
                    &[]
                } else {
                    // SAFETY: `host` is a contiguous pinned CPU tensor of `len` bytes,
                    // kept alive by `copies`, which this checkpoint holds as long as
                    // its tensors (they never leave it as borrowed data); its bytes are
                    // read only after the copies are waited for (every write path).
                    unsafe { std::slice::from_raw_parts(host.data_ptr() as *const u8, len) }
                };
                self.add_tensor(name, TensorData::new(dtype, shape, bytes)?)?;
            }
            self.keep_staged(std::sync::Arc::new(std::sync::Mutex::new(copies)));
        }
        Ok(())
    }

    /// Adds every variable of `vs` under its name (`layer1.weight`, ...); on CUDA
    /// without waiting, as [`add_tch_many`](Self::add_tch_many).
    pub fn add_var_store(&mut self, vs: &tch::nn::VarStore) -> Result<()> {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        self.add_tch_many(&vars)
    }
}

/// The pinned uploads of one load, one per CUDA device it writes to.
#[derive(Default)]
struct Uploads(Vec<(usize, tt_sys::DeviceUploads)>);

impl Uploads {
    /// Queues `bytes` into `dst` (contiguous, on a CUDA device).
    fn copy_into(&mut self, dst: &Tensor, bytes: &[u8], name: &str) -> Result<()> {
        let err = |e: tt_sys::Error| Error::Unreadable {
            reason: format!("tensor {name:?}: {e}"),
        };
        let Device::Cuda(index) = dst.device() else {
            return Err(Error::Unreadable {
                reason: format!("tensor {name:?}: an upload to {:?}, not CUDA", dst.device()),
            });
        };
        let at = match self.0.iter().position(|(i, _)| *i == index) {
            Some(at) => at,
            None => {
                let uploads = tt_sys::DeviceUploads::new(dst.device()).map_err(err)?;
                self.0.push((index, uploads));
                self.0.len() - 1
            }
        };
        self.0[at].1.copy_into(dst, bytes).map_err(err)
    }

    /// Waits until every upload has landed.
    fn finish(self) -> Result<()> {
        for (_, uploads) in self.0 {
            uploads.finish().map_err(|e| Error::Unreadable {
                reason: format!("loading onto the GPU: {e}"),
            })?;
        }
        Ok(())
    }
}

/// The file's tensor `view` (named `name`, of tch kind `kind`) as a new tensor on
/// `device`; onto a CUDA device its upload is queued in `uploads`.
fn on_device(
    view: &TensorView<'_>,
    kind: Kind,
    name: &str,
    device: Device,
    uploads: &mut Uploads,
) -> Result<Tensor> {
    let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
    if let Device::Cuda(_) = device {
        let t = Tensor::f_empty(&shape, (kind, device))
            .map_err(read_err(format!("tensor {name:?} on {device:?}")))?;
        uploads.copy_into(&t, view.data(), name)?;
        return Ok(t);
    }
    Tensor::f_from_data_size(view.data(), &shape, kind)
        .and_then(|t| t.f_to_device(device))
        .map_err(read_err(format!("tensor {name:?} to {device:?}")))
}

impl TensorFile {
    /// Tensor `name` as a tch tensor on `device`, with its dtype. Onto a CUDA device
    /// the bytes go through pinned buffers ([`tt_sys::DeviceUploads`]), not through
    /// a pageable host tensor.
    pub fn tch(&self, name: &str, device: Device) -> Result<Tensor> {
        let mut uploads = Uploads::default();
        let t = self.tch_with(name, device, &mut uploads)?;
        uploads.finish()?;
        Ok(t)
    }

    /// Every tensor of the file on `device`, by name in sorted order: PyTorch's
    /// `safetensors.torch.load_file(path, device=..)`, or `torch.load(path,
    /// map_location=..)` of a state dict. Onto a CUDA device the bytes go through a
    /// few pinned buffers whose transfers overlap the host's copies
    /// ([`tt_sys::DeviceUploads`]); the tensors are ready when this returns.
    ///
    /// ```no_run
    /// use tch::Device;
    /// let file = tt_ckpt::TensorFile::read("model.safetensors")?;
    /// for (name, t) in file.tch_all(Device::Cuda(0))? {
    ///     println!("{name}: {:?}", t.size());
    /// }
    /// # Ok::<(), tt_ckpt::Error>(())
    /// ```
    pub fn tch_all(&self, device: Device) -> Result<Vec<(String, Tensor)>> {
        let mut uploads = Uploads::default();
        let tensors = self
            .names()
            .into_iter()
            .map(|name| {
                let t = self.tch_with(&name, device, &mut uploads)?;
                Ok((name, t))
            })
            .collect::<Result<Vec<_>>>()?;
        uploads.finish()?;
        Ok(tensors)
    }

    /// [`tch`](Self::tch), its upload queued in `uploads` for a CUDA device.
    fn tch_with(&self, name: &str, device: Device, uploads: &mut Uploads) -> Result<Tensor> {
        let view = self.tensor(name)?;
        let kind = kind_of(view.dtype()).map_err(|e| match e {
            Error::Unreadable { reason: why } => Error::Unreadable {
                reason: format!("tensor {name:?}: {why}"),
            },
            other => other,
        })?;
        on_device(&view, kind, name, device, uploads)
    }

    /// Loads this file's tensors into the variables of `vs` by name, with torch's
    /// `load_state_dict` rules: the way to use weights trained in PyTorch (a file
    /// from `safetensors.torch.save_file(model.state_dict(), ..)`, or any published
    /// safetensors model) or any safetensors file, ours included.
    ///
    /// - Strict by default: a variable with no tensor of its name (missing), or a
    ///   tensor with no variable (unexpected), is an error listing every such name;
    ///   [`LoadOptions::non_strict`] loads what matches and reports the rest.
    /// - A shape that differs is an error in both modes (as in torch).
    /// - A dtype that differs is an error unless [`LoadOptions::convert_dtype`] is
    ///   asked (torch converts silently).
    ///
    /// Everything is checked before anything is copied: on an error `vs` is
    /// unchanged. Values land on each variable's device; variables stay trainable.
    ///
    /// ```no_run
    /// use tch::{nn, Device};
    /// use tt_ckpt::{LoadOptions, TensorFile};
    ///
    /// let mut vs = nn::VarStore::new(Device::Cpu);
    /// let _l1 = nn::linear(vs.root() / "l1", 4, 8, Default::default());
    /// // Saved in Python: safetensors.torch.save_file(model.state_dict(), "model.safetensors")
    /// let report = TensorFile::read("model.safetensors")?.load_var_store(&mut vs, LoadOptions::default())?;
    /// assert!(report.missing.is_empty() && report.unexpected.is_empty());
    /// # Ok::<(), tt_ckpt::Error>(())
    /// ```
    pub fn load_var_store(
        &self,
        vs: &mut tch::nn::VarStore,
        options: LoadOptions,
    ) -> Result<LoadReport> {
        // By name, sorted: reports and errors list names in order.
        let vars: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
        let mut report = LoadReport {
            unexpected: self
                .names()
                .into_iter()
                .filter(|n| !vars.contains_key(n))
                .collect(),
            ..LoadReport::default()
        };
        let mut mismatched = Vec::new();
        let mut plan = Vec::new();
        for (name, var) in vars {
            let Ok(view) = self.tensor(&name) else {
                report.missing.push(name);
                continue;
            };
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            if shape != var.size() {
                mismatched.push(format!(
                    "{name:?} has shape {:?} in the VarStore but {shape:?} in the file",
                    var.size()
                ));
                continue;
            }
            let kind = match kind_of(view.dtype()) {
                Ok(kind) => kind,
                Err(e) => {
                    mismatched.push(format!("{name:?}: {e}"));
                    continue;
                }
            };
            if kind != var.kind() && !options.convert_dtype {
                mismatched.push(format!(
                    "{name:?} is {:?} in the VarStore but {kind:?} in the file \
                     (LoadOptions::convert_dtype(true) converts it)",
                    var.kind()
                ));
                continue;
            }
            plan.push((name, var, view, kind));
        }
        let strict_failure =
            options.strict && !(report.missing.is_empty() && report.unexpected.is_empty());
        if !mismatched.is_empty() || strict_failure {
            return Err(Error::StateDict {
                path: self.path().to_path_buf(),
                missing: report.missing,
                unexpected: report.unexpected,
                mismatched,
                strict: options.strict,
            });
        }
        let mut uploads = Uploads::default();
        for (name, mut var, view, kind) in plan {
            if kind == var.kind() && var.is_contiguous() && matches!(var.device(), Device::Cuda(_))
            {
                // Straight from the file's bytes into the variable's GPU memory.
                uploads.copy_into(&var, view.data(), &name)?;
            } else {
                let saved = on_device(&view, kind, &name, var.device(), &mut uploads)?;
                tch::no_grad(|| var.f_copy_(&saved))
                    .map_err(read_err(format!("load variable {name:?}")))?;
            }
            report.loaded.push(name);
        }
        uploads.finish()?;
        Ok(report)
    }
}

/// How [`TensorFile::load_var_store`] matches a file's tensors to a VarStore's
/// variables. The default is torch's `load_state_dict(strict=True)` without its
/// silent dtype conversion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    strict: bool,
    convert_dtype: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            strict: true,
            convert_dtype: false,
        }
    }
}

impl LoadOptions {
    /// Missing and unexpected names are errors (the default, torch's `strict=True`).
    pub fn strict() -> Self {
        LoadOptions::default()
    }

    /// Missing and unexpected names are reported in the [`LoadReport`], not errors
    /// (torch's `strict=False`): fine-tuning a model whose head differs, say.
    pub fn non_strict() -> Self {
        LoadOptions {
            strict: false,
            ..LoadOptions::default()
        }
    }

    /// Converts a tensor whose dtype differs from its variable's (an f64 or bf16 file
    /// into f32 variables, say) instead of refusing it.
    pub fn convert_dtype(mut self, convert: bool) -> Self {
        self.convert_dtype = convert;
        self
    }
}

/// What [`TensorFile::load_var_store`] did (torch's `_IncompatibleKeys`, plus what
/// was loaded). Names are sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[must_use = "in non-strict mode the missing and unexpected names are only reported here"]
pub struct LoadReport {
    /// Variables given the file's values.
    pub loaded: Vec<String>,
    /// Variables with no tensor of their name in the file (left as they were).
    pub missing: Vec<String>,
    /// Tensors of the file with no variable of their name.
    pub unexpected: Vec<String>,
}

impl LoadedCheckpoint {
    /// Tensor `name` as a tch tensor on `device`, with its dtype
    /// ([`TensorFile::tch`]).
    pub fn tch(&self, name: &str, device: Device) -> Result<Tensor> {
        self.tensors().tch(name, device)
    }

    /// Every tensor of the checkpoint on `device`, by name in sorted order
    /// ([`TensorFile::tch_all`]: through pinned buffers onto a CUDA device).
    pub fn tch_all(&self, device: Device) -> Result<Vec<(String, Tensor)>> {
        self.tensors().tch_all(device)
    }

    /// Copies the saved values into every variable of `vs` (on its device). A
    /// variable missing from the checkpoint, or of another shape or dtype, is
    /// [`Error::StateDict`] naming every such variable, and nothing is copied;
    /// extra tensors in the checkpoint are ignored (optimizer state, say). For
    /// torch's strict rules on any safetensors file, see
    /// [`TensorFile::load_var_store`].
    pub fn load_var_store(&self, vs: &mut tch::nn::VarStore) -> Result<()> {
        let mut missing: Vec<String> = vs
            .variables()
            .into_keys()
            .filter(|name| self.tensors().tensor(name).is_err())
            .collect();
        if !missing.is_empty() {
            missing.sort();
            return Err(Error::StateDict {
                path: self.path().to_path_buf(),
                missing,
                unexpected: Vec::new(),
                mismatched: Vec::new(),
                strict: true,
            });
        }
        self.tensors()
            .load_var_store(vs, LoadOptions::non_strict())
            .map(drop)
    }
}

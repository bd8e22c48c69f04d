//! tch tensors and VarStores in checkpoints (feature `tch`).

use tch::{Device, Kind, Tensor};

use crate::{Checkpoint, Dtype, Error, LoadedCheckpoint, Result, TensorData, TensorFile};

fn torch_err(what: String) -> impl FnOnce(tch::TchError) -> Error {
    move |e| Error::Tensors(format!("{what}: {e}"))
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
        other => {
            return Err(Error::Tensors(format!(
                "tch kind {other:?} has no safetensors dtype"
            )))
        }
    })
}

/// The tch kind of a safetensors dtype.
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
        other => {
            return Err(Error::Tensors(format!(
                "safetensors dtype {other:?} has no tch kind"
            )))
        }
    })
}

impl TensorData<'static> {
    /// The bytes of `tensor` (copied to host memory, contiguous), with its dtype and shape.
    pub fn from_tch(tensor: &Tensor) -> Result<Self> {
        Self::from_tch_into(tensor, |len| vec![0u8; len])
    }

    fn from_tch_into(tensor: &Tensor, buffer: impl FnOnce(usize) -> Vec<u8>) -> Result<Self> {
        let dtype = dtype_of(tensor.kind())?;
        let host = tensor
            .f_to_device(Device::Cpu)
            .and_then(|t| t.f_contiguous())
            .map_err(torch_err("copy to host".into()))?;
        let shape: Vec<usize> = host.size().iter().map(|&d| d as usize).collect();
        let numel: usize = shape.iter().product();
        let mut bytes = buffer(numel * host.kind().elt_size_in_bytes());
        host.f_copy_data_u8(&mut bytes, numel)
            .map_err(torch_err("read the tensor".into()))?;
        TensorData::new(dtype, shape, bytes)
    }
}

impl Checkpoint<'_> {
    /// Adds `tensor` (any device) under `name`, copied to host memory (into a
    /// recycled buffer when the checkpoint came from `CheckpointDir::checkpoint`).
    pub fn add_tch(&mut self, name: &str, tensor: &Tensor) -> Result<()> {
        let data = TensorData::from_tch_into(tensor, |len| self.buffer(len))?;
        self.add_tensor(name, data)
    }

    /// Adds every variable of `vs` under its name (`layer1.weight`, ...).
    pub fn add_var_store(&mut self, vs: &tch::nn::VarStore) -> Result<()> {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, t) in vars {
            self.add_tch(&name, &t)?;
        }
        Ok(())
    }
}

impl TensorFile {
    /// Tensor `name` as a tch tensor on `device`, with its dtype.
    pub fn tch(&self, name: &str, device: Device) -> Result<Tensor> {
        let view = self.tensor(name)?;
        let kind = kind_of(view.dtype())?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        Tensor::f_from_data_size(view.data(), &shape, kind)
            .and_then(|t| t.f_to_device(device))
            .map_err(torch_err(format!("tensor {name:?} to {device:?}")))
    }
}

impl LoadedCheckpoint {
    /// Tensor `name` as a tch tensor on `device`, with its dtype.
    pub fn tch(&self, name: &str, device: Device) -> Result<Tensor> {
        self.tensors().tch(name, device)
    }

    /// Copies the saved values into every variable of `vs` (on its device). A
    /// variable missing from the checkpoint, or of another shape or dtype, is an
    /// error and nothing after it is copied; extra tensors in the checkpoint are
    /// ignored (optimizer state, say).
    pub fn load_var_store(&self, vs: &mut tch::nn::VarStore) -> Result<()> {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, mut var) in vars {
            let saved = self.tch(&name, var.device())?;
            if saved.size() != var.size() || saved.kind() != var.kind() {
                return Err(Error::Tensors(format!(
                    "variable {name:?} is {:?} {:?} but the checkpoint has {:?} {:?}",
                    var.kind(),
                    var.size(),
                    saved.kind(),
                    saved.size()
                )));
            }
            tch::no_grad(|| var.f_copy_(&saved))
                .map_err(torch_err(format!("load variable {name:?}")))?;
        }
        Ok(())
    }
}

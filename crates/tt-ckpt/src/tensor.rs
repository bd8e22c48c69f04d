//! One tensor's bytes with its dtype and shape, as a checkpoint holds it (no libtorch).

use std::borrow::Cow;

use safetensors::{Dtype, View};

use crate::{Error, Result};

/// One tensor's bytes, little-endian as safetensors stores them.
#[derive(Debug, Clone)]
pub struct TensorData<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Cow<'a, [u8]>,
}

impl<'a> TensorData<'a> {
    /// A tensor of `dtype` and `shape` over `data`; the length must match.
    pub fn new(dtype: Dtype, shape: Vec<usize>, data: impl Into<Cow<'a, [u8]>>) -> Result<Self> {
        let data = data.into();
        let elements: usize = shape.iter().product();
        let expected = elements * dtype.bitsize() / 8;
        if data.len() != expected {
            return Err(Error::Tensors {
                reason: format!(
                    "{dtype:?} tensor of shape {shape:?} needs {expected} bytes, got {}",
                    data.len()
                ),
            });
        }
        Ok(TensorData { dtype, shape, data })
    }

    /// An `f32` tensor from values.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<TensorData<'static>> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        TensorData::new(Dtype::F32, shape, bytes)
    }
}

impl TensorData<'_> {
    /// The dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The bytes, little-endian.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// The number of bytes.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Its buffer when it owns one (for the next checkpoint to reuse), else `None`.
    pub(crate) fn into_owned_bytes(self) -> Option<Vec<u8>> {
        match self.data {
            Cow::Owned(v) => Some(v),
            Cow::Borrowed(_) => None,
        }
    }

    /// Whether it holds no bytes (a tensor with a zero dimension).
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

impl View for &TensorData<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

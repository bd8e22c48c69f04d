//! The checkpoint file: safetensors, with torchtools' metadata in its header.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::{SafeTensors, TensorView};
use safetensors::{Dtype, View};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::atomic::AtomicFile;
use crate::error::io;
use crate::{Error, Result};

/// The header key under which torchtools keeps its metadata (a JSON string).
pub const METADATA_KEY: &str = "torchtools";
const FORMAT: u32 = 1;

/// torchtools' metadata of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Format version of this metadata.
    pub format: u32,
    /// Training step.
    pub step: u64,
    /// Epoch, when given.
    pub epoch: Option<u64>,
    /// User values (sampler state, optimizer hyper-parameters, ...), as JSON.
    pub values: BTreeMap<String, serde_json::Value>,
    /// Library versions that wrote it (`torchtools`, and what the caller adds).
    pub versions: BTreeMap<String, String>,
    /// `xxh3:<hex>` of each tensor's bytes, by name.
    pub checksums: BTreeMap<String, String>,
}

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
            return Err(Error::Tensors(format!(
                "{dtype:?} tensor of shape {shape:?} needs {expected} bytes, got {}",
                data.len()
            )));
        }
        Ok(TensorData { dtype, shape, data })
    }

    /// An `f32` tensor from values.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<TensorData<'static>> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        TensorData::new(Dtype::F32, shape, bytes)
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

fn checksum(bytes: &[u8]) -> String {
    format!("xxh3:{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// A checkpoint to write: a step, optional epoch, serde values and named tensors.
#[derive(Debug, Clone)]
pub struct Checkpoint<'a> {
    meta: Meta,
    tensors: BTreeMap<String, TensorData<'a>>,
    /// Host buffers of an earlier checkpoint, reused by host copies (see
    /// `CheckpointDir::checkpoint`): no page faults for memory already touched.
    spare: Vec<Vec<u8>>,
}

impl<'a> Checkpoint<'a> {
    /// An empty checkpoint of `step`.
    pub fn new(step: u64) -> Self {
        let mut versions = BTreeMap::new();
        versions.insert(
            "torchtools".to_owned(),
            env!("CARGO_PKG_VERSION").to_owned(),
        );
        Checkpoint {
            meta: Meta {
                format: FORMAT,
                step,
                epoch: None,
                values: BTreeMap::new(),
                versions,
                checksums: BTreeMap::new(),
            },
            tensors: BTreeMap::new(),
            spare: Vec::new(),
        }
    }

    /// Gives this checkpoint host buffers to reuse for its copies.
    pub(crate) fn with_spare(mut self, spare: Vec<Vec<u8>>) -> Self {
        self.spare = spare;
        self
    }

    /// A zeroed buffer of `len` bytes: a spare one that is large enough, else new.
    #[cfg(feature = "tch")]
    pub(crate) fn buffer(&mut self, len: usize) -> Vec<u8> {
        match self.spare.iter().position(|b| b.capacity() >= len) {
            Some(i) => {
                let mut b = self.spare.swap_remove(i);
                b.clear();
                b.resize(len, 0);
                b
            }
            None => vec![0u8; len],
        }
    }

    /// The owned host buffers of this checkpoint, for the next one to reuse.
    pub(crate) fn into_buffers(self) -> Vec<Vec<u8>> {
        let mut out = self.spare;
        out.extend(self.tensors.into_values().filter_map(|t| match t.data {
            Cow::Owned(v) => Some(v),
            Cow::Borrowed(_) => None,
        }));
        out
    }

    /// The step.
    pub fn step(&self) -> u64 {
        self.meta.step
    }

    /// Sets the epoch.
    pub fn with_epoch(mut self, epoch: u64) -> Self {
        self.meta.epoch = Some(epoch);
        self
    }

    /// Stores `value` (anything serde can write as JSON) under `key`.
    pub fn set_value(&mut self, key: &str, value: &impl Serialize) -> Result<()> {
        let json = serde_json::to_value(value).map_err(|source| Error::Value {
            key: key.to_owned(),
            source,
        })?;
        self.meta.values.insert(key.to_owned(), json);
        Ok(())
    }

    /// Records a library version (e.g. `("libtorch", "2.11.0")`).
    pub fn set_version(&mut self, name: &str, version: &str) {
        self.meta
            .versions
            .insert(name.to_owned(), version.to_owned());
    }

    /// Adds a tensor; names are unique (a second one replaces the first).
    pub fn add_tensor(&mut self, name: &str, tensor: TensorData<'a>) -> Result<()> {
        if name.is_empty() || name == "__metadata__" {
            return Err(Error::BadName(name.to_owned()));
        }
        self.tensors.insert(name.to_owned(), tensor);
        Ok(())
    }

    /// Writes the checkpoint to `path` with [`atomic_write`](crate::atomic_write)'s
    /// guarantees (unique temp file, fsync, rename, fsync of the directory).
    pub fn write_to(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let mut meta = self.meta.clone();
        meta.checksums = self
            .tensors
            .iter()
            .map(|(n, t)| (n.clone(), checksum(&t.data)))
            .collect();
        let json = serde_json::to_string(&meta).map_err(|source| Error::Value {
            key: METADATA_KEY.into(),
            source,
        })?;
        let header = HashMap::from([(METADATA_KEY.to_owned(), json)]);
        let file = AtomicFile::new(path)?;
        safetensors::serialize_to_file(
            self.tensors.iter().map(|(n, t)| (n.as_str(), t)),
            Some(header),
            file.path(),
        )
        .map_err(|e| match e {
            safetensors::SafeTensorError::IoError(source) => Error::Io {
                op: "write",
                path: file.path().to_path_buf(),
                source,
            },
            other => Error::Tensors(other.to_string()),
        })?;
        file.commit()
    }
}

/// Any safetensors file (ours or one Python wrote), read into memory.
#[derive(Debug)]
pub struct TensorFile {
    path: PathBuf,
    bytes: Vec<u8>,
    /// The parsed header and where the data section starts in `bytes`.
    header: safetensors::tensor::Metadata,
    data_start: usize,
    metadata: BTreeMap<String, String>,
}

impl TensorFile {
    /// Reads and parses `path`; a malformed file is [`Error::Corrupt`].
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let bytes = std::fs::read(&path).map_err(io("read", &path))?;
        Self::from_bytes(path, bytes)
    }

    /// Parses a file's bytes (`path` names it in errors); never panics, whatever
    /// the bytes (the header parser is fuzzed).
    pub fn from_bytes(path: PathBuf, bytes: Vec<u8>) -> Result<Self> {
        let corrupt = |reason: String| Error::Corrupt {
            path: path.clone(),
            reason,
        };
        let (header_len, header) =
            SafeTensors::read_metadata(&bytes).map_err(|e| corrupt(format!("header: {e}")))?;
        let metadata = header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        // Validates the layout once (offsets cover the data section exactly); the
        // parsed header is kept, so looking a tensor up never parses it again.
        SafeTensors::deserialize(&bytes).map_err(|e| corrupt(format!("layout: {e}")))?;
        Ok(TensorFile {
            path,
            data_start: 8 + header_len,
            bytes,
            header,
            metadata,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.header.tensors().into_keys().collect();
        names.sort();
        names
    }

    /// A tensor by name: dtype, shape and bytes (little-endian).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let missing = || Error::Missing {
            what: "tensor",
            name: name.to_owned(),
        };
        let info = self.header.info(name).ok_or_else(missing)?;
        let (begin, end) = info.data_offsets;
        // In range: the layout was validated when the file was parsed.
        let data = self
            .bytes
            .get(self.data_start + begin..self.data_start + end)
            .ok_or_else(missing)?;
        TensorView::new(info.dtype, info.shape.clone(), data).map_err(|e| Error::Corrupt {
            path: self.path.clone(),
            reason: format!("tensor {name:?}: {e}"),
        })
    }

    /// The header's free-form metadata (`__metadata__`).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }
}

/// A checkpoint written by torchtools, read and verified.
#[derive(Debug)]
pub struct LoadedCheckpoint {
    file: TensorFile,
    meta: Meta,
}

impl LoadedCheckpoint {
    /// Reads `path` and verifies it: the header parses, our metadata is there, and
    /// every tensor's checksum matches (so a flipped byte anywhere in the data, or a
    /// truncated file, is an [`Error::Corrupt`]).
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        Self::verify(TensorFile::read(path)?)
    }

    /// [`read`](Self::read) for bytes already in memory (`path` names them in errors).
    pub fn from_bytes(path: PathBuf, bytes: Vec<u8>) -> Result<Self> {
        Self::verify(TensorFile::from_bytes(path, bytes)?)
    }

    fn verify(file: TensorFile) -> Result<Self> {
        let corrupt = |reason: String| Error::Corrupt {
            path: file.path.clone(),
            reason,
        };
        let json = file.metadata.get(METADATA_KEY).ok_or_else(|| {
            corrupt(format!(
                "no {METADATA_KEY:?} metadata (not written by torchtools)"
            ))
        })?;
        let meta: Meta =
            serde_json::from_str(json).map_err(|e| corrupt(format!("metadata: {e}")))?;
        let names = file.names();
        let expected: Vec<&String> = meta.checksums.keys().collect();
        if names.iter().collect::<Vec<_>>() != expected {
            return Err(corrupt(format!(
                "tensors {names:?} but checksums for {expected:?}"
            )));
        }
        for (name, sum) in &meta.checksums {
            let view = file.tensor(name).map_err(|e| corrupt(e.to_string()))?;
            if checksum(view.data()) != *sum {
                return Err(corrupt(format!(
                    "tensor {name:?} does not match its checksum"
                )));
            }
        }
        Ok(LoadedCheckpoint { file, meta })
    }

    /// The step it was saved at.
    pub fn step(&self) -> u64 {
        self.meta.step
    }

    /// The epoch, when it was saved with one.
    pub fn epoch(&self) -> Option<u64> {
        self.meta.epoch
    }

    /// The value stored under `key`, as `T`.
    pub fn value<T: DeserializeOwned>(&self, key: &str) -> Result<T> {
        let v = self.meta.values.get(key).ok_or_else(|| Error::Missing {
            what: "value",
            name: key.to_owned(),
        })?;
        T::deserialize(v).map_err(|source| Error::Value {
            key: key.to_owned(),
            source,
        })
    }

    /// All metadata.
    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// The tensors.
    pub fn tensors(&self) -> &TensorFile {
        &self.file
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.file.tensor(name)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        self.file.path()
    }
}

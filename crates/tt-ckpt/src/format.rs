//! The checkpoint file: safetensors, with torchtools' metadata in its header.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{SafeTensors, TensorView};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::atomic::AtomicFile;
use crate::error::io;
use crate::reader::Front;
use crate::tensor::TensorData;
use crate::writer;
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

/// A checkpoint to write: a step, optional epoch, serde values and named tensors.
#[derive(Debug, Clone)]
pub struct Checkpoint<'a> {
    meta: Meta,
    tensors: BTreeMap<String, TensorData<'a>>,
    /// Host buffers of an earlier checkpoint, reused by host copies (see
    /// `CheckpointDir::checkpoint`): no page faults for memory already touched.
    spare: Vec<Vec<u8>>,
    /// Copies of CUDA tensors into pinned host memory, still landing: those tensors'
    /// bytes are borrowed from them (kept alive here), and writing waits for them.
    #[cfg(feature = "tch")]
    staged: Vec<std::sync::Arc<std::sync::Mutex<tt_sys::HostCopies>>>,
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
            #[cfg(feature = "tch")]
            staged: Vec::new(),
        }
    }

    /// Keeps host copies alive with this checkpoint; writing waits for them.
    #[cfg(feature = "tch")]
    pub(crate) fn keep_staged(
        &mut self,
        copies: std::sync::Arc<std::sync::Mutex<tt_sys::HostCopies>>,
    ) {
        self.staged.push(copies);
    }

    /// Waits for the host copies of CUDA tensors still landing.
    fn wait_staged(&self) -> Result<()> {
        #[cfg(feature = "tch")]
        for copies in &self.staged {
            copies
                .lock()
                .map_err(|_| Error::SaveThread {
                    reason: "a thread panicked while copying tensors".into(),
                })?
                .synchronize()
                .map_err(|e| Error::Tensors {
                    reason: format!("copying CUDA tensors to host memory: {e}"),
                })?;
        }
        Ok(())
    }

    /// Gives this checkpoint host buffers to reuse for its copies.
    pub(crate) fn with_spare(mut self, spare: Vec<Vec<u8>>) -> Self {
        self.spare = spare;
        self
    }

    /// An empty buffer with room for `len` bytes: the smallest spare one that is large
    /// enough, else a new one. Not zeroed: the copy that takes it writes every byte
    /// (zeroing 50 MB of optimizer state first cost a third of the training stall).
    #[cfg(feature = "tch")]
    // Left out of mutation testing: host buffers for libtorch tensors, behind the `tch`
    // feature.
    #[cfg_attr(mutants, mutants::skip)]
    pub(crate) fn buffer(&mut self, len: usize) -> Vec<u8> {
        let best = (self.spare.iter().enumerate())
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => {
                let mut b = self.spare.swap_remove(i);
                b.clear();
                b
            }
            None => Vec::with_capacity(len),
        }
    }

    /// The owned host buffers of this checkpoint, for the next one to reuse.
    // Left out of mutation testing: hands those buffers back for the next checkpoint's
    // `add_tch` copies (behind the `tch` feature); without `tch` no save takes one.
    #[cfg_attr(mutants, mutants::skip)]
    pub(crate) fn into_buffers(self) -> Vec<Vec<u8>> {
        let mut out = self.spare;
        out.extend(
            self.tensors
                .into_values()
                .filter_map(TensorData::into_owned_bytes),
        );
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
        let json = serde_json::to_value(value).map_err(|cause| Error::Value {
            key: key.to_owned(),
            cause,
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
            return Err(Error::BadName {
                name: name.to_owned(),
            });
        }
        self.tensors.insert(name.to_owned(), tensor);
        Ok(())
    }

    /// Writes the checkpoint to `path` with [`atomic_write`](crate::atomic_write)'s
    /// guarantees (unique temp file, fsync, rename, fsync of the directory). The
    /// tensors' bytes go to the disk in chunks (`O_DIRECT` where the filesystem takes
    /// it) while their checksums are computed on another core, so the disk is busy
    /// from the start.
    pub fn write_to(&self, path: impl AsRef<Path>) -> Result<()> {
        self.wait_staged()?;
        let path = path.as_ref();
        let mut file = AtomicFile::new(path)?;
        let temp_path = file.path().to_path_buf();
        let plan = writer::Plan {
            order: writer::file_order(&self.tensors),
            metadata_key: METADATA_KEY,
            metadata: |sums: &BTreeMap<String, String>| {
                let mut meta = self.meta.clone();
                meta.checksums = sums.clone();
                serde_json::to_string(&meta).map_err(|cause| Error::Value {
                    key: METADATA_KEY.into(),
                    cause,
                })
            },
        };
        writer::write(file.file(), &temp_path, plan)?;
        file.commit()
    }
}

/// A file's bytes: mapped from the file, or owned.
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Bytes::Mapped(_) => "mapped",
            Bytes::Owned(_) => "owned",
        };
        write!(f, "{} bytes ({kind})", self.len())
    }
}

/// Any safetensors file (ours or one Python wrote).
///
/// [`read`](Self::read) maps the file into memory rather than copying it: loading
/// costs no second copy of the file (the page cache holds its pages, reclaimable),
/// and only the tensors you convert are copied, once. A checkpoint file is never
/// written in place (saves replace it by a rename), so the mapping stays valid; do
/// not truncate or rewrite a file in place while it is loaded.
#[derive(Debug)]
pub struct TensorFile {
    path: PathBuf,
    bytes: Bytes,
    /// The parsed header and where the data section starts in `bytes`.
    header: safetensors::tensor::Metadata,
    data_start: usize,
    metadata: BTreeMap<String, String>,
}

impl TensorFile {
    /// Maps and parses `path` (read into memory where it cannot be mapped); a
    /// malformed file is [`Error::Corrupt`].
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        Self::read_hashing(path.as_ref(), false).map(|(file, _)| file)
    }

    /// [`read`](Self::read), and where `hash`, the tensors' checksums computed while
    /// the file's pages arrive (`None` where they could not be: the file was read
    /// another way, or its header is not one).
    fn read_hashing(path: &Path, hash: bool) -> Result<(Self, Option<Sums>)> {
        let path = path.to_path_buf();
        let file = std::fs::File::open(&path).map_err(io("open", &path))?;
        let len = file.metadata().map_err(io("stat", &path))?.len();
        // Mapped, its pages read in by several requests at once (the disk's speed, see
        // `reader`); where that fails, read(2) says why.
        let during =
            |bytes: &[u8], front: &Front| hash.then(|| sums_while_reading(bytes, front)).flatten();
        if let Some((map, read)) = crate::reader::map_populated(&file, len, during) {
            // The header the hashing parsed is the file's: it is not parsed again.
            let (header, sums) = read.unzip();
            return Ok((Self::parse(path, Bytes::Mapped(map), header)?, sums));
        }
        let bytes = std::fs::read(&path).map_err(io("read", &path))?;
        Ok((Self::from_bytes(path, bytes)?, None))
    }

    /// Parses a file's bytes (`path` names it in errors); never panics, whatever
    /// the bytes (the header parser is fuzzed).
    pub fn from_bytes(path: PathBuf, bytes: Vec<u8>) -> Result<Self> {
        Self::parse(path, Bytes::Owned(bytes), None)
    }

    /// `bytes` as a file, with its header where it was parsed already.
    fn parse(path: PathBuf, bytes: Bytes, parsed: Option<Header>) -> Result<Self> {
        let corrupt = |reason: String| Error::Corrupt {
            path: path.clone(),
            reason,
        };
        // `read_metadata` validates the whole layout: the offsets cover the data
        // section exactly, and the file ends where the data does. The parsed header is
        // kept, so looking a tensor up never parses it again.
        let (header_len, header) = match parsed {
            Some(parsed) => parsed,
            None => {
                SafeTensors::read_metadata(&bytes).map_err(|e| corrupt(format!("header: {e}")))?
            }
        };
        let metadata = header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
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

/// Tensors' checksums, by name.
type Sums = BTreeMap<String, String>;

/// A parsed safetensors header: its length in bytes, and what it says.
type Header = (usize, safetensors::tensor::Metadata);

/// The header of a safetensors file and its tensors' checksums, each piece hashed once
/// `front` says it is in: the hashing follows the disk instead of waiting for the whole
/// file. `None` where the header is not one or the reading failed (then the file is
/// parsed and checked later, or not mapped at all).
fn sums_while_reading(bytes: &[u8], front: &Front) -> Option<(Header, Sums)> {
    let start = bytes.as_ptr() as usize;
    let len_bytes: [u8; 8] = bytes.get(..8)?.try_into().ok()?;
    let header_end = usize::try_from(u64::from_le_bytes(len_bytes))
        .ok()?
        .checked_add(8)?;
    if !front.wait(header_end) {
        return None;
    }
    // Reads the header only (offsets are checked against the length, no data read).
    let (header_len, header) = SafeTensors::read_metadata(bytes).ok()?;
    let data = bytes.get(8 + header_len..)?;
    let mut views = Vec::new();
    for (name, info) in header.tensors() {
        let (begin, end) = info.data_offsets;
        views.push((name, data.get(begin..end)?));
    }
    let sums = crate::checksum::checksums_gated(
        views.iter().map(|(name, bytes)| (name.as_str(), *bytes)),
        |piece| front.wait(piece.as_ptr() as usize - start + piece.len()),
    )?;
    Some(((header_len, header), sums))
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
        let (file, sums) = TensorFile::read_hashing(path.as_ref(), true)?;
        Self::verify(file, sums)
    }

    /// [`read`](Self::read) for bytes already in memory (`path` names them in errors).
    pub fn from_bytes(path: PathBuf, bytes: Vec<u8>) -> Result<Self> {
        Self::verify(TensorFile::from_bytes(path, bytes)?, None)
    }

    /// Checks `file` against its metadata's checksums; `sums` are its tensors' own,
    /// where they were computed as it was read.
    fn verify(file: TensorFile, sums: Option<Sums>) -> Result<Self> {
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
        let sums = match sums {
            Some(sums) => sums,
            None => {
                let mut views = Vec::with_capacity(names.len());
                for name in &names {
                    let view = file.tensor(name).map_err(|e| corrupt(e.to_string()))?;
                    views.push((name.as_str(), view.data()));
                }
                // On all cores: verifying is reading every byte.
                crate::checksum::checksums_parallel(views.into_iter())
            }
        };
        for (name, sum) in &meta.checksums {
            if sums.get(name) != Some(sum) {
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
        T::deserialize(v).map_err(|cause| Error::Value {
            key: key.to_owned(),
            cause,
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

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::Dtype;

    #[test]
    fn tensor_data_checks_its_length_and_says_whether_it_is_empty() {
        let t = TensorData::from_f32(vec![2, 3], &[0.0; 6]).unwrap();
        assert_eq!((t.len(), t.is_empty()), (24, false));
        let empty = TensorData::new(Dtype::F32, vec![4, 0], Vec::new()).unwrap();
        assert_eq!((empty.len(), empty.is_empty()), (0, true));
        let short = TensorData::new(Dtype::F32, vec![2, 3], vec![0u8; 20]).unwrap_err();
        assert!(
            short.to_string().contains("needs 24 bytes, got 20"),
            "{short}"
        );
    }

    #[test]
    fn the_checksums_computed_while_the_file_arrives_are_the_stored_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt.safetensors");
        let mut ckpt = Checkpoint::new(3);
        let big: Vec<f32> = (0..(5 << 20)).map(|i| i as f32).collect();
        ckpt.add_tensor("big", TensorData::from_f32(vec![5 << 20], &big).unwrap())
            .unwrap();
        ckpt.add_tensor("small", TensorData::from_f32(vec![3], &[1.0; 3]).unwrap())
            .unwrap();
        ckpt.write_to(&path).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let len = file.metadata().unwrap().len();
        let (_, read) = crate::reader::map_populated(&file, len, sums_while_reading).unwrap();
        let ((header_len, header), sums) = read.unwrap();
        let stored = LoadedCheckpoint::read(&path)
            .unwrap()
            .meta()
            .checksums
            .clone();
        assert_eq!(sums, stored);
        // The header it parsed on the way, which the file keeps, is the file's.
        let bytes = std::fs::read(&path).unwrap();
        let (len_again, again) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(header_len, len_again);
        for name in ["big", "small"] {
            let (ours, theirs) = (header.info(name).unwrap(), again.info(name).unwrap());
            assert_eq!(ours.data_offsets, theirs.data_offsets);
            assert_eq!(ours.shape, theirs.shape);
        }
        // Not a safetensors header: no checksums (the file is then refused by parsing).
        std::fs::write(&path, [0xffu8; 64]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let (_, read) = crate::reader::map_populated(&file, 64, sums_while_reading).unwrap();
        assert!(read.is_none());
    }

    #[test]
    fn versions_are_kept_and_a_read_file_is_mapped_not_printed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt.safetensors");
        let mut ckpt = Checkpoint::new(7);
        ckpt.set_version("libtorch", "2.11.0");
        ckpt.add_tensor("w", TensorData::from_f32(vec![256], &[1.0; 256]).unwrap())
            .unwrap();
        ckpt.write_to(&path).unwrap();
        let loaded = LoadedCheckpoint::read(&path).unwrap();
        let versions = &loaded.meta().versions;
        assert_eq!(versions.get("libtorch").map(String::as_str), Some("2.11.0"));
        assert!(versions.contains_key("torchtools"), "{versions:?}");
        // The file is mapped (no copy), and its Debug names its size, not its bytes.
        let shown = format!("{:?}", loaded.tensors());
        let len = std::fs::metadata(&path).unwrap().len();
        assert!(
            shown.contains(&format!("bytes: {len} bytes (mapped)")),
            "{shown}"
        );
    }
}

//! Writing a checkpoint at the disk's speed: safetensors' layout (an 8-byte header
//! length, the JSON header, then the tensors' bytes) while a second thread computes
//! the checksums; the header, which holds the checksums, is written last into the
//! space reserved for it (every checksum has the same width, so its length is known
//! first).
//!
//! The data goes out in 8 MiB chunks with `O_DIRECT` (copied into two aligned,
//! reused buffers: one copy, as the page cache would make, but no page-cache pages).
//! Where a filesystem refuses `O_DIRECT`, the chunks are written from the tensors'
//! memory through the page cache, and the kernel is asked to start writing each
//! chunk back at once (`sync_file_range`), waiting for the chunk written a window
//! earlier: the disk is busy from the first chunk, the writer is never throttled by
//! dirty-page balancing, and the final `fsync` has little left to do.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use tt_device::spawn_scoped;

use crate::checksum::checksum;
use crate::tensor::TensorData;
use crate::{Error, Result};

/// Bytes per write (and per writeback request).
const CHUNK: usize = 8 << 20;

/// The placeholder checksum, of the same width as every real one.
fn placeholder() -> String {
    crate::checksum::stored(0)
}

/// Tensors in file order: safetensors' own (descending dtype alignment, then name),
/// so that every tensor starts aligned as its readers expect.
pub(crate) fn file_order<'a, 't>(
    tensors: &'a BTreeMap<String, TensorData<'t>>,
) -> Vec<(&'a str, &'a TensorData<'t>)> {
    let mut order: Vec<(&str, &TensorData<'t>)> =
        tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    order.sort_by(|(ln, l), (rn, r)| r.dtype().cmp(&l.dtype()).then(ln.cmp(rn)));
    order
}

/// The file's first bytes: the header's length (u64, little-endian) and the JSON
/// header, padded with spaces to a multiple of 8 as safetensors pads it.
pub(crate) fn header(
    order: &[(&str, &TensorData<'_>)],
    metadata_key: &str,
    metadata_json: &str,
) -> Result<Vec<u8>> {
    let json_err = |cause| Error::Value {
        key: metadata_key.to_owned(),
        cause,
    };
    let mut map = serde_json::Map::new();
    map.insert(
        "__metadata__".to_owned(),
        serde_json::json!({ metadata_key: metadata_json }),
    );
    let mut offset = 0usize;
    for (name, t) in order {
        let end = offset + t.len();
        let dtype: serde_json::Value = serde_json::to_value(t.dtype()).map_err(json_err)?;
        map.insert(
            (*name).to_owned(),
            serde_json::json!({ "dtype": dtype, "shape": t.shape(), "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut json = serde_json::to_vec(&map).map_err(json_err)?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// What [`write`] needs from the checkpoint: its tensors in file order and a way to
/// build the metadata JSON from the checksums.
pub(crate) struct Plan<'a, 't, F> {
    pub(crate) order: Vec<(&'a str, &'a TensorData<'t>)>,
    pub(crate) metadata_key: &'a str,
    /// The metadata JSON for the given checksums (by tensor name).
    pub(crate) metadata: F,
}

/// Writes the whole file into `file` (empty, just created; `path` names it in errors):
/// data first, checksummed on a second thread meanwhile, then the header at offset 0.
/// The caller fsyncs.
///
/// The data goes through `O_DIRECT` where the filesystem takes it (a second
/// descriptor on the same file): straight from a small reused buffer to the disk,
/// without filling the page cache. On a VM whose fresh page-cache pages each cost a
/// fault in the host, this is what makes a save run at the disk's speed (measured
/// here: buffered writes of 1 GiB took 0.3 to 3 s depending on which pages the
/// kernel handed out; `O_DIRECT` 0.75 to 0.85 s every time). Elsewhere (tmpfs,
/// some network filesystems) the buffered path with early writeback is used.
pub(crate) fn write<F>(file: &File, path: &Path, plan: Plan<'_, '_, F>) -> Result<()>
where
    F: Fn(&BTreeMap<String, String>) -> Result<String>,
{
    write_with(file, path, plan, true)
}

/// [`write`], with `O_DIRECT` tried or not.
fn write_with<F>(file: &File, path: &Path, plan: Plan<'_, '_, F>, try_direct: bool) -> Result<()>
where
    F: Fn(&BTreeMap<String, String>) -> Result<String>,
{
    let Plan {
        order,
        metadata_key,
        metadata,
    } = plan;
    let io_err = |cause| Error::Io {
        op: "write",
        path: path.to_path_buf(),
        cause,
    };
    // The header's length with placeholder checksums is the final one.
    let placeholders: BTreeMap<String, String> = order
        .iter()
        .map(|(n, _)| ((*n).to_owned(), placeholder()))
        .collect();
    let reserved = header(&order, metadata_key, &metadata(&placeholders)?)?.len();
    let stream = Stream::new(reserved, &order);
    let direct = if try_direct { open_direct(path) } else { None };
    let (sums, head) = std::thread::scope(|scope| -> std::io::Result<_> {
        let hash = || {
            order
                .iter()
                .map(|(n, t)| ((*n).to_owned(), checksum(t.bytes())))
                .collect::<BTreeMap<String, String>>()
        };
        // Where no thread can be had (an address-space limit, a pids limit), the
        // checksums are computed after the write instead of beside it.
        let hasher = spawn_scoped(scope, "tt-ckpt-hash", hash).ok();
        let head = match &direct {
            Some(d) => write_direct_body(d, &stream)?,
            None => None,
        };
        if head.is_none() {
            write_buffered_body(file, &stream)?;
        }
        let sums = match hasher {
            Some(h) => h
                .join()
                .map_err(|_| std::io::Error::other("the checksum thread panicked"))?,
            None => hash(),
        };
        Ok((sums, head))
    })
    .map_err(io_err)?;
    let final_header = header(&order, metadata_key, &metadata(&sums)?)?;
    if final_header.len() != reserved {
        return Err(Error::Tensors {
            reason: format!(
            "the header changed length ({reserved} bytes reserved, {} written): please report this",
            final_header.len()
        ),
        });
    }
    match (&direct, head) {
        (Some(d), Some(head)) => {
            // The first aligned region: the header and the data's first bytes.
            let mut buf = AlignedBuf::new(head);
            stream.fill(buf.as_mut(), 0);
            buf.as_mut()[..reserved].copy_from_slice(&final_header);
            match d.write_all_at(buf.as_mut(), 0) {
                // Only a file small enough to be all head reaches here untried.
                Err(e) if refuses_direct_io(true, &e) => {
                    write_buffered_body(file, &stream).map_err(io_err)?;
                    file.write_all_at(&final_header, 0).map_err(io_err)?;
                }
                other => other.map_err(io_err)?,
            }
            // The last block was padded to the alignment: cut the file to its size.
            file.set_len(stream.total as u64).map_err(io_err)
        }
        _ => file.write_all_at(&final_header, 0).map_err(io_err),
    }
}

/// The file's bytes as one stream: the header (placeholders) then every tensor.
struct Stream<'a> {
    reserved: usize,
    /// Each tensor's bytes and where they start in the stream.
    parts: Vec<(usize, &'a [u8])>,
    total: usize,
}

impl<'a> Stream<'a> {
    fn new(reserved: usize, order: &[(&str, &'a TensorData<'_>)]) -> Self {
        let mut at = reserved;
        let parts = order
            .iter()
            .map(|(_, t)| {
                let part = (at, t.bytes());
                at += t.len();
                part
            })
            .collect();
        Stream {
            reserved,
            parts,
            total: at,
        }
    }

    /// Copies the stream's bytes from `offset` into `buf`; the header's bytes are
    /// left as they are (written last), and bytes past the end are zeros.
    fn fill(&self, buf: &mut [u8], offset: usize) {
        let end = offset + buf.len();
        if end > self.total {
            let from = self.total.saturating_sub(offset);
            buf[from..].fill(0);
        }
        for &(start, bytes) in &self.parts {
            let stop = start + bytes.len();
            if stop <= offset || start >= end {
                continue;
            }
            let (lo, hi) = (start.max(offset), stop.min(end));
            buf[lo - offset..hi - offset].copy_from_slice(&bytes[lo - start..hi - start]);
        }
    }
}

/// `O_DIRECT` alignment of buffers, offsets and lengths (covers 512- and 4096-byte
/// logical blocks).
const ALIGN: usize = 4096;

/// A zeroed buffer whose start is `ALIGN`-aligned.
struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let raw = vec![0u8; len + ALIGN];
        let start = raw.as_ptr().align_offset(ALIGN).min(ALIGN);
        AlignedBuf { raw, start, len }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

/// Two chunk buffers kept between saves (16 MiB): fresh memory costs page faults,
/// which on a VM are several times the copy itself.
static POOL: std::sync::Mutex<Vec<AlignedBuf>> = std::sync::Mutex::new(Vec::new());

// Left out of mutation testing: the two chunk buffers kept between saves; a fresh
// buffer holds the same bytes (the checkpoint benchmark measures the page faults the
// pool saves).
#[cfg_attr(mutants, mutants::skip)]
fn take_pooled() -> Option<AlignedBuf> {
    POOL.lock().ok()?.pop()
}

// Left out of mutation testing: the other half of that pool.
#[cfg_attr(mutants, mutants::skip)]
fn give_back(buf: AlignedBuf) {
    if let Ok(mut pool) = POOL.lock() {
        if pool.len() < 2 {
            pool.push(buf);
        }
    }
}

/// Whether a failed `O_DIRECT` write says that the filesystem takes no `O_DIRECT` (EINVAL
/// on the first write: nothing is written yet, so the save goes on through the page
/// cache) rather than that writing failed (any later error, or any other error).
fn refuses_direct_io(first: bool, e: &std::io::Error) -> bool {
    first && e.raw_os_error() == Some(libc::EINVAL)
}

fn open_direct(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()
}

/// Writes the stream past its first aligned region with `O_DIRECT`, in chunks, a
/// helper thread writing one buffer while this one fills the next. Returns the
/// first region's length, to be written once the header is final, or `None` when
/// the filesystem refused `O_DIRECT` before anything was written.
fn write_direct_body(direct: &File, stream: &Stream<'_>) -> std::io::Result<Option<usize>> {
    let round_up = |n: usize| n.div_ceil(ALIGN) * ALIGN;
    let padded = round_up(stream.total);
    let head = round_up(stream.reserved).min(padded);
    let chunk = CHUNK.min(padded.saturating_sub(head)).max(ALIGN);
    // Probe with the first write: EINVAL means this filesystem takes no O_DIRECT.
    let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<(AlignedBuf, usize, usize)>(1);
    let (empty_tx, empty_rx) = std::sync::mpsc::sync_channel::<AlignedBuf>(2);
    let pooled = chunk == CHUNK;
    for _ in 0..2 {
        let buf = if pooled { take_pooled() } else { None };
        let _ = empty_tx.send(buf.unwrap_or_else(|| AlignedBuf::new(chunk)));
    }
    std::thread::scope(|scope| {
        let writer = spawn_scoped(scope, "tt-ckpt-write", move || -> std::io::Result<bool> {
            let mut first = true;
            for (mut buf, offset, len) in full_rx {
                match direct.write_all_at(&buf.as_mut()[..len], offset as u64) {
                    Ok(()) => {}
                    Err(e) if refuses_direct_io(first, &e) => return Ok(false),
                    Err(e) => return Err(e),
                }
                first = false;
                // The filler may be done (it stops at the end): the buffer then
                // waits in the channel, drained into the pool after the join.
                let _ = empty_tx.send(buf);
            }
            Ok(true)
        });
        let Ok(writer) = writer else {
            // No thread to be had (an address-space or pids limit): nothing is
            // written yet, so the caller writes through the page cache instead.
            if pooled {
                while let Ok(buf) = empty_rx.try_recv() {
                    give_back(buf);
                }
            }
            return Ok(None);
        };
        let mut offset = head;
        while offset < padded {
            let Ok(mut buf) = empty_rx.recv() else { break };
            let len = chunk.min(padded - offset);
            stream.fill(&mut buf.as_mut()[..len], offset);
            if full_tx.send((buf, offset, len)).is_err() {
                break;
            }
            offset += len;
        }
        drop(full_tx);
        let accepted = writer
            .join()
            .map_err(|_| std::io::Error::other("the write thread panicked"))??;
        if pooled {
            // The buffers back to the pool for the next save: touched memory, no
            // page faults next time.
            while let Ok(buf) = empty_rx.try_recv() {
                give_back(buf);
            }
        }
        Ok(accepted.then_some(head))
    })
}

/// Writes the stream past the header through the page cache, starting writeback
/// chunk by chunk.
fn write_buffered_body(file: &File, stream: &Stream<'_>) -> std::io::Result<()> {
    let mut writeback = Writeback::new(file, stream.reserved as u64);
    for &(start, bytes) in &stream.parts {
        let mut at = start;
        for chunk in bytes.chunks(CHUNK) {
            file.write_all_at(chunk, at as u64)?;
            at += chunk.len();
            writeback.wrote(at as u64);
        }
    }
    Ok(())
}

/// Starts writeback of each range as it is written, and waits for the range a
/// 64 MiB window behind, so that dirty pages stay bounded and the disk stays busy.
struct Writeback {
    fd: i32,
    /// Start of the range not yet handed to writeback.
    started: u64,
    /// Start of the range not yet waited for.
    waited: u64,
}

impl Writeback {
    fn new(file: &File, from: u64) -> Self {
        Writeback {
            fd: file.as_raw_fd(),
            started: from,
            waited: from,
        }
    }

    /// Everything below `end` has been written.
    // Left out of mutation testing: `sync_file_range` hints pacing the kernel's
    // writeback; the fsync before the rename makes the file durable whatever they say.
    #[cfg_attr(mutants, mutants::skip)]
    fn wrote(&mut self, end: u64) {
        /// How far behind the newest chunk the writer waits for writeback to finish:
        /// what it keeps dirty or in flight at most.
        const WINDOW: u64 = 64 << 20;
        if end <= self.started {
            return;
        }
        sync_range(
            self.fd,
            self.started,
            end - self.started,
            libc::SYNC_FILE_RANGE_WRITE,
        );
        self.started = end;
        if end - self.waited > WINDOW {
            let upto = end - WINDOW;
            sync_range(
                self.fd,
                self.waited,
                upto - self.waited,
                libc::SYNC_FILE_RANGE_WAIT_BEFORE
                    | libc::SYNC_FILE_RANGE_WRITE
                    | libc::SYNC_FILE_RANGE_WAIT_AFTER,
            );
            self.waited = upto;
        }
    }
}

/// `sync_file_range`, a hint: an error here (a filesystem without it) changes nothing,
/// and a write error shows again at the `fsync` that follows every save.
// Left out of mutation testing: the hint itself (see `Writeback::wrote`).
#[cfg_attr(mutants, mutants::skip)]
fn sync_range(fd: i32, offset: u64, len: u64, flags: libc::c_uint) {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: a plain system call on a descriptor this process owns and keeps open
    // for the call's duration; it reads no memory of ours.
    let _ = unsafe { libc::sync_file_range(fd, offset, len, flags) };
}

/// The dtype's name in a header (`"F32"`, `"BF16"`, ...), for tests.
#[cfg(test)]
fn dtype_name(d: safetensors::Dtype) -> String {
    serde_json::to_value(d)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::{checksums_gated, checksums_parallel};
    use safetensors::Dtype;

    #[test]
    fn only_einval_on_the_first_direct_write_means_no_direct_io() {
        let einval = std::io::Error::from_raw_os_error(libc::EINVAL);
        let enospc = std::io::Error::from_raw_os_error(libc::ENOSPC);
        assert!(refuses_direct_io(true, &einval));
        // Bytes already written with O_DIRECT, or a full disk: a real error.
        assert!(!refuses_direct_io(false, &einval));
        assert!(!refuses_direct_io(true, &enospc));
        assert!(!refuses_direct_io(false, &enospc));
    }

    #[test]
    fn dtype_names_are_safetensors_own() {
        assert_eq!(dtype_name(Dtype::F32), "F32");
        assert_eq!(dtype_name(Dtype::BF16), "BF16");
        assert_eq!(dtype_name(Dtype::F8_E4M3), "F8_E4M3");
        assert_eq!(dtype_name(Dtype::BOOL), "BOOL");
    }

    #[test]
    fn the_file_is_what_safetensors_itself_writes() {
        let mut tensors = BTreeMap::new();
        let mut add = |name: &str, dtype, shape, bytes: Vec<u8>| {
            let t = TensorData::new(dtype, shape, bytes).unwrap();
            tensors.insert(name.to_owned(), t);
        };
        add("b", Dtype::F32, vec![3], (0..12).collect());
        add("a", Dtype::U8, vec![5], vec![2; 5]);
        add("c", Dtype::F64, vec![2], (100..116).collect());
        add("e", Dtype::BF16, vec![0], vec![]);
        add("big", Dtype::I32, vec![3 << 20], vec![7; 12 << 20]); // several chunks
        let root = tempfile::tempdir().unwrap();
        let write_file = |name: &str, try_direct: bool| {
            let path = root.path().join(name);
            let file = File::create(&path).unwrap();
            let metadata =
                |sums: &BTreeMap<String, String>| Ok(serde_json::to_string(sums).unwrap());
            let plan = Plan {
                order: file_order(&tensors),
                metadata_key: "k",
                metadata,
            };
            write_with(&file, &path, plan, try_direct).unwrap();
            std::fs::read(&path).unwrap()
        };
        let ours = write_file("direct.safetensors", true);
        assert_eq!(
            write_file("buffered.safetensors", false),
            ours,
            "the page-cache path writes the same bytes"
        );
        // Where no thread can be had (a container's limits), the same bytes, no panic.
        tt_device::refuse_threads(true);
        let alone = write_file("alone.safetensors", true);
        tt_device::refuse_threads(false);
        assert!(alone == ours, "without threads the file differs");
        let sums: BTreeMap<String, String> = tensors
            .iter()
            .map(|(n, t)| (n.clone(), checksum(t.bytes())))
            .collect();
        let info = std::collections::HashMap::from([(
            "k".to_owned(),
            serde_json::to_string(&sums).unwrap(),
        )]);
        let theirs =
            safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(info))
                .unwrap();
        let parse = |bytes: &[u8]| {
            let (n, meta) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
            let mut infos: Vec<String> = meta
                .tensors()
                .into_iter()
                .map(|(name, i)| format!("{name} {i:?}"))
                .collect();
            infos.sort();
            (n, infos, meta.metadata().clone())
        };
        let (our_len, our_infos, our_meta) = parse(&ours);
        let (their_len, their_infos, their_meta) = parse(&theirs);
        assert_eq!(our_infos, their_infos, "same dtypes, shapes and offsets");
        assert_eq!(our_meta, their_meta, "same metadata, real checksums");
        assert_eq!(
            our_len % 8,
            0,
            "the header is padded as safetensors pads it"
        );
        assert_eq!(ours[8 + our_len..], theirs[8 + their_len..], "same data");
        safetensors::SafeTensors::deserialize(&ours).unwrap();
    }

    #[test]
    fn checksums_read_piece_by_piece_equal_whole_ones_and_stop_when_told() {
        // Three pieces and a part, and a small tensor beside it.
        let big: Vec<u8> = (0..(3 << 23) + 5).map(|i: usize| (i % 253) as u8).collect();
        let small = [7u8; 100];
        let items = [("big", &big[..]), ("small", &small[..])];
        let pieces = std::sync::atomic::AtomicUsize::new(0);
        let gated = checksums_gated(items.iter().copied(), |piece| {
            pieces.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            !piece.is_empty()
        });
        let whole: BTreeMap<String, String> = items
            .iter()
            .map(|(n, bytes)| ((*n).to_owned(), checksum(bytes)))
            .collect();
        assert_eq!(gated, Some(whole));
        assert_eq!(pieces.into_inner(), 5);
        // A gate that says no: no checksums, and no wait.
        let refused = checksums_gated(items.iter().copied(), |piece| piece.len() < 100);
        assert_eq!(refused, None);
    }

    #[test]
    fn parallel_checksums_equal_sequential_ones() {
        let a = vec![1u8; 1000];
        let b = [2u8; 10];
        let c: Vec<u8> = (0..=255).collect();
        let items = [("a", &a[..]), ("b", &b[..]), ("c", &c[..])];
        let par = checksums_parallel(items.iter().copied());
        let seq: BTreeMap<String, String> = items
            .iter()
            .map(|(n, bytes)| ((*n).to_owned(), checksum(bytes)))
            .collect();
        assert_eq!(par, seq);
        tt_device::refuse_threads(true);
        let alone = checksums_parallel(items.iter().copied());
        tt_device::refuse_threads(false);
        assert_eq!(alone, seq, "without threads");
    }
}

//! TensorBoard event files: the scalars the trainer logs (loss, learning rate,
//! throughput, gradient norm, evaluations), in the format PyTorch's
//! `torch.utils.tensorboard.SummaryWriter` writes, so `tensorboard --logdir DIR` shows
//! them beside a Python run's.
//!
//! The format is small and stable: a file of TFRecord records (a little-endian length,
//! its masked CRC-32C, the bytes, their masked CRC-32C), each record one `Event`
//! protocol buffer: first the file version, then one `Summary` with one
//! `simple_value` per scalar. It is written here directly (about a hundred lines),
//! which keeps `protoc` and a protobuf runtime out of every build.
//!
//! ```
//! use tt_train::tensorboard::EventWriter;
//!
//! let dir = tempfile::tempdir()?;
//! let mut writer = EventWriter::create(dir.path())?;
//! writer.add_scalar("train/loss", 0.25, 10)?;
//! writer.flush()?;
//! assert!(writer.path().file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."));
//! # Ok::<(), std::io::Error>(())
//! ```

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// Appends scalars to a new event file in a log directory, as `SummaryWriter` does.
#[derive(Debug)]
pub struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// A new event file in `dir` (created if missing), named as TensorBoard expects
    /// (`events.out.tfevents.<seconds>.<host>.<pid>.0`), starting with the file-version
    /// record.
    pub fn create(dir: impl AsRef<Path>) -> io::Result<EventWriter> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot create the TensorBoard directory {}: {e}",
                    dir.display()
                ),
            )
        })?;
        let now = tt_device::now_unix();
        let host = tt_device::host_name_for_files();
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.0",
            now as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let file = File::create(&path).map_err(|e| {
            io::Error::new(e.kind(), format!("cannot create {}: {e}", path.display()))
        })?;
        let mut writer = EventWriter {
            file: BufWriter::new(file),
            path,
        };
        let mut event = Vec::new();
        put_double(&mut event, 1, now);
        put_bytes(&mut event, 3, b"brain.Event:2");
        writer.record(&event)?;
        writer.flush()?;
        Ok(writer)
    }

    /// The event file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One scalar at `step` (shown under `tag`, e.g. `train/loss`), stamped with the
    /// current time. Buffered: [`flush`](Self::flush) makes it visible.
    pub fn add_scalar(&mut self, tag: &str, value: f32, step: u64) -> io::Result<()> {
        self.add_scalars(&[(tag, value)], step)
    }

    /// Several scalars of one step in one event.
    pub fn add_scalars(&mut self, scalars: &[(&str, f32)], step: u64) -> io::Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::new();
            put_bytes(&mut v, 1, tag.as_bytes());
            // Summary.Value.simple_value: field 2, 32-bit.
            put_key(&mut v, 2, 5);
            v.extend_from_slice(&value.to_le_bytes());
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, tt_device::now_unix());
        put_key(&mut event, 2, 0);
        put_varint(&mut event, step);
        put_bytes(&mut event, 5, &summary);
        self.record(&event)
    }

    /// Writes what is buffered to the file.
    pub fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }

    /// One TFRecord: length, its masked CRC, the data, its masked CRC.
    fn record(&mut self, data: &[u8]) -> io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked_crc(&len).to_le_bytes())?;
        self.file.write_all(data)?;
        self.file.write_all(&masked_crc(data).to_le_bytes())
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        let _ = self.file.flush();
    }
}

/// A protobuf field key: field number and wire type.
fn put_key(out: &mut Vec<u8>, field: u64, wire_type: u64) {
    put_varint(out, (field << 3) | wire_type);
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_double(out: &mut Vec<u8>, field: u64, v: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

/// A length-delimited field (string, bytes, embedded message).
fn put_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// CRC-32C (Castagnoli), bit by bit over a 256-entry table built at compile time.
fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !data.iter().fold(!0u32, |crc, &b| {
        TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8)
    })
}

/// TFRecord's masked CRC (so that a CRC of CRCs is not trivially valid).
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_values() {
        // RFC 3720's check value and iSCSI test vectors.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn varints_and_keys_are_protobufs() {
        let mut v = Vec::new();
        put_varint(&mut v, 300);
        assert_eq!(v, [0xAC, 0x02]);
        let mut k = Vec::new();
        put_key(&mut k, 5, 2);
        assert_eq!(k, [0x2A]);
        let mut b = Vec::new();
        put_bytes(&mut b, 1, b"ab");
        assert_eq!(b, [0x0A, 2, b'a', b'b']);
    }

    #[test]
    fn records_are_framed_with_masked_crcs() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let mut w = EventWriter::create(dir.path())?;
        w.add_scalar("a", 1.5, 7)?;
        w.flush()?;
        let bytes = std::fs::read(w.path())?;
        let mut at = 0;
        let mut records = Vec::new();
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().map_err(io::Error::other)?) as usize;
            let crc = u32::from_le_bytes(
                bytes[at + 8..at + 12]
                    .try_into()
                    .map_err(io::Error::other)?,
            );
            assert_eq!(crc, masked_crc(len_bytes));
            let data = &bytes[at + 12..at + 12 + len];
            let dcrc = u32::from_le_bytes(
                bytes[at + 12 + len..at + 16 + len]
                    .try_into()
                    .map_err(io::Error::other)?,
            );
            assert_eq!(dcrc, masked_crc(data));
            records.push(data.to_vec());
            at += 16 + len;
        }
        assert_eq!(records.len(), 2);
        assert!(records[0].ends_with(b"brain.Event:2"));
        // The scalar: step 7 as a varint after key 0x10, the value's bytes after 0x15.
        let r = &records[1];
        assert!(r.windows(2).any(|w| w == [0x10, 7]));
        let value = 1.5f32.to_le_bytes();
        assert!(r.windows(5).any(|w| w[0] == 0x15 && w[1..] == value));
        Ok(())
    }
}

//! Durable, atomic replacement of a file.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::error::io;
use crate::{Error, Result};

/// Temp files are `.tt-tmp-<host>-<pid>-<random>` in the target's directory.
pub(crate) const TEMP_PREFIX: &str = ".tt-tmp-";
/// A temp file of another host is removed only when older than this.
const FOREIGN_TEMP_AGE: Duration = Duration::from_secs(24 * 3600);

fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// A file being written next to its target, published by [`AtomicFile::commit`]:
/// [`atomic_write`] for writers that need the file itself (a path another library
/// writes to, such as Python's `torch.save`). Dropped without commit (an error, a
/// panic), the temp file is removed and the target is untouched.
///
/// ```
/// use std::io::Write;
/// let dir = tempfile::tempdir()?;
/// let target = dir.path().join("model.pt");
/// let mut file = tt_ckpt::AtomicFile::new(&target)?;
/// std::fs::write(file.path(), b"weights")?; // written by name, as another library would
/// file.commit()?;
/// assert_eq!(std::fs::read(&target)?, b"weights");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct AtomicFile {
    temp: tempfile::NamedTempFile,
    target: PathBuf,
}

impl AtomicFile {
    /// A temp file beside `target` (`.tt-tmp-<host>-<pid>-...`), with the mode of the
    /// file it will replace (else 0644).
    pub fn new(target: &Path) -> Result<Self> {
        let dir = parent_of(target);
        let prefix = format!(
            "{TEMP_PREFIX}{}-{}-",
            tt_device::host_name_for_files(),
            std::process::id()
        );
        // tempfile makes files 0600; a checkpoint keeps the mode of the file it
        // replaces, or gets the usual 0644, so that teammates can read it.
        let mode = std::fs::metadata(target)
            .map(|m| m.permissions().mode() & 0o7777)
            .unwrap_or(0o644);
        let temp = tempfile::Builder::new()
            .prefix(&prefix)
            .permissions(std::fs::Permissions::from_mode(mode))
            .tempfile_in(&dir)
            .map_err(io("create a temp file in", &dir))?;
        Ok(AtomicFile {
            temp,
            target: target.to_path_buf(),
        })
    }

    /// The temp file's path.
    pub fn path(&self) -> &Path {
        self.temp.path()
    }

    /// The temp file, open for writing.
    pub fn file(&mut self) -> &mut File {
        self.temp.as_file_mut()
    }

    /// fsync the data, rename over the target, fsync the directory.
    pub fn commit(self) -> Result<()> {
        self.temp
            .as_file()
            .sync_all()
            .map_err(io("fsync", self.temp.path()))?;
        let target = self.target;
        self.temp.persist(&target).map_err(|e| Error::Io {
            op: "rename the temp file over",
            path: target.clone(),
            cause: e.error,
        })?;
        let dir = parent_of(&target);
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io("fsync the directory", &dir))
    }
}

/// Replaces `path` with what `write` writes, durably and atomically: a unique temp
/// file in the same directory, written, `fsync`ed, renamed over `path`, and the
/// directory `fsync`ed. After a crash at any point `path` holds either its old
/// content or the new one, never a mix or an empty file. If `write` fails, `path`
/// is untouched and the temp file is removed. Stale temp files of writers that died
/// are removed by [`clean_stale_temps`] (called by every checkpoint save).
///
/// ```
/// use std::io::Write;
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join("notes.json");
/// tt_ckpt::atomic_write(&path, |w| w.write_all(b"{\"step\": 3}"))?;
/// assert_eq!(std::fs::read(&path)?, b"{\"step\": 3}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn atomic_write(
    path: impl AsRef<Path>,
    write: impl FnOnce(&mut BufWriter<&mut File>) -> std::io::Result<()>,
) -> Result<()> {
    let path = path.as_ref();
    let mut file = AtomicFile::new(path)?;
    let temp_path = file.path().to_path_buf();
    {
        let mut w = BufWriter::with_capacity(1 << 20, file.file());
        write(&mut w).map_err(io("write", &temp_path))?;
        w.flush().map_err(io("write", &temp_path))?;
    }
    file.commit()
}

fn pid_alive(pid: u32) -> bool {
    // Linux: /proc/<pid> exists while the process (or a zombie) does.
    Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes temp files left in `dir` by writers that died: those of this host whose
/// process is gone, and those of other hosts (a shared filesystem) older than a day.
/// Returns how many were removed. Live writers' temp files are never touched.
pub fn clean_stale_temps(dir: impl AsRef<Path>) -> Result<usize> {
    let dir = dir.as_ref();
    let me = tt_device::host_name_for_files();
    let mut removed = 0;
    let entries = std::fs::read_dir(dir).map_err(io("list", dir))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(TEMP_PREFIX) else {
            continue;
        };
        // `<host>-<pid>-<random>`: the random part and the pid hold no `-`.
        let mut parts = rest.rsplitn(3, '-');
        let _random = parts.next();
        let pid = parts.next().and_then(|p| p.parse::<u32>().ok());
        let host = parts.next().unwrap_or("");
        let stale = if host == me {
            pid.is_some_and(|p| !pid_alive(p))
        } else {
            entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| SystemTime::now().duration_since(t).ok())
                .is_some_and(|age| age > FOREIGN_TEMP_AGE)
        };
        if stale && std::fs::remove_file(entry.path()).is_ok() {
            tracing::debug!(path = %entry.path().display(), "removed a stale temp file");
            removed += 1;
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_file_name_is_written_in_the_current_directory() {
        // `Path::parent` of a bare name is "", where no temp file can be created.
        assert_eq!(parent_of(Path::new("model.safetensors")), Path::new("."));
        assert_eq!(
            parent_of(Path::new("runs/model.safetensors")),
            Path::new("runs")
        );
        assert_eq!(parent_of(Path::new("/model.safetensors")), Path::new("/"));
    }
}

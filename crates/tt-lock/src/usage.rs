//! Who used which GPU for how long: every lock taken appends a record when it is
//! granted and one when it is released to the lock directory's `usage.jsonl`, which
//! every user can read and append to. A holder that died without releasing (`kill -9`,
//! a crash, a reboot) is closed when the log is next read: its lock is free (or held by
//! another), so it ended at the latest when the GPU's next holder took it, else when it
//! was found out.
//!
//! Each record is one line written by one `write` on a file opened for appending, so
//! records of several processes never interleave; a damaged line (a disk that filled up
//! in the middle of one) is skipped with a warning, never an error.

use std::collections::HashMap;
use std::fs::{File, OpenOptions, Permissions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::{Holder, LockDir, Result};

/// The log's file name in the lock directory.
pub const USAGE_FILE: &str = "usage.jsonl";

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum UsageEvent {
    /// A lock was granted.
    Start {
        /// The record's id (also in the lock file's holder record while it is held).
        id: String,
        /// Who: the user...
        user: String,
        /// ...on which host...
        host: String,
        /// ...as which process.
        pid: u32,
        /// The GPU: its UUID, or `index N` without NVML.
        gpu: String,
        /// The bytes the holder said its job needs, when it said.
        bytes: Option<u64>,
        /// Seconds since the Unix epoch.
        time: f64,
        /// The job's command line.
        command: Vec<String>,
    },
    /// It ended.
    End {
        /// The id of its `Start`.
        id: String,
        /// Seconds since the Unix epoch.
        time: f64,
        /// The job's exit status (128 + a signal's number when killed), when known.
        status: Option<i32>,
        /// The holder died holding it; `time` is the latest it can have ended.
        #[serde(default)]
        lost: bool,
    },
}

/// [`UsageEvent::Start`] as written: the same line, borrowing the holder's fields
/// instead of copying them (the start record is written at every lock).
#[derive(Serialize)]
#[serde(tag = "event", rename = "start")]
struct StartLine<'a> {
    id: &'a str,
    user: &'a str,
    host: &'a str,
    pid: u32,
    gpu: &'a str,
    bytes: Option<u64>,
    time: f64,
    command: &'a [String],
}

/// One reservation of one GPU, as the log tells it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Usage {
    /// The record's id.
    pub id: String,
    /// Who: the user...
    pub user: String,
    /// ...on which host...
    pub host: String,
    /// ...as which process.
    pub pid: u32,
    /// The GPU.
    pub gpu: String,
    /// Bytes reserved, when said.
    pub bytes: Option<u64>,
    /// The job's command line.
    pub command: Vec<String>,
    /// Start, in seconds since the Unix epoch.
    pub start: f64,
    /// End; `None` while it is held.
    pub end: Option<f64>,
    /// The job's exit status, when known.
    pub status: Option<i32>,
    /// The holder died holding it (see [`UsageEvent::End`]).
    pub lost: bool,
}

impl Usage {
    /// Seconds it lasted (until `now` while held).
    pub fn seconds(&self, now: f64) -> f64 {
        (self.end.unwrap_or(now) - self.start).max(0.0)
    }
}

/// The log, read whole.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct UsageLog {
    /// Every reservation, in the order they started.
    pub records: Vec<Usage>,
    /// Lines that could not be read (with their line numbers), skipped.
    pub skipped: Vec<String>,
}

pub(crate) fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A new record's id: host, PID namespace, pid, GPU and the nanosecond it started.
pub(crate) fn new_id(holder: &Holder) -> String {
    let ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{}/{}/{}/{}/{ns}",
        holder.host,
        holder.pid_ns.unwrap_or(0),
        holder.pid,
        holder.gpu
    )
}

impl LockDir {
    fn usage_path(&self) -> std::path::PathBuf {
        self.path().join(USAGE_FILE)
    }

    /// Appends `event` to the log, in one write. A log that cannot be written is a
    /// warning, never a reason to refuse or keep a lock.
    pub(crate) fn record(&self, event: &impl Serialize) {
        let log = self
            .usage_log
            .get_or_init(|| match open_log(&self.usage_path()) {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::warn!(
                        "cannot open the GPU usage log {}: {e}",
                        self.usage_path().display()
                    );
                    None
                }
            });
        let Some(log) = log else { return };
        if let Err(e) = write_line(log, event) {
            tracing::warn!(
                "cannot record GPU usage in {}: {e}",
                self.usage_path().display()
            );
        }
    }

    /// Records the start of `holder`'s use of its GPU.
    pub(crate) fn record_start(&self, holder: &Holder, id: &str) {
        self.record(&StartLine {
            id,
            user: &holder.user,
            host: &holder.host,
            pid: holder.pid,
            gpu: &holder.gpu,
            bytes: holder.reserved.map(|b| b.0),
            time: now_unix(),
            command: &holder.command,
        });
    }

    /// The usage log: every reservation of a GPU in this directory. Holders that died
    /// holding their GPU are closed first (see the module's documentation), once: the
    /// end record is appended to the log.
    pub fn usage(&self) -> Result<UsageLog> {
        let mut log = read(&self.usage_path())?;
        let now = now_unix();
        let states = self.list()?;
        let mut closed = Vec::new();
        for i in 0..log.records.len() {
            let r = &log.records[i];
            if r.end.is_some() {
                continue;
            }
            // Held by the process that started it: still running.
            let alive = states.iter().any(|s| {
                s.held && s.holder.as_ref().and_then(|h| h.usage.as_deref()) == Some(r.id.as_str())
            });
            if alive {
                continue;
            }
            // Ended at the latest when the next holder of the GPU took it.
            let next = log.records[i + 1..]
                .iter()
                .find(|n| n.gpu == r.gpu)
                .map(|n| n.start);
            let end = next.unwrap_or(now).min(now).max(r.start);
            closed.push((i, end));
        }
        for (i, end) in closed {
            let r = &mut log.records[i];
            r.end = Some(end);
            r.lost = true;
            self.record(&UsageEvent::End {
                id: r.id.clone(),
                time: end,
                status: None,
                lost: true,
            });
        }
        Ok(log)
    }
}

/// `event` as one line, in one `write` (a record is far below what one write of an
/// appending file takes whole).
fn write_line(file: &File, event: &impl Serialize) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(event).map_err(std::io::Error::other)?;
    line.push(b'\n');
    let n = (&*file).write(&line)?;
    if n != line.len() {
        return Err(std::io::Error::other(format!(
            "wrote {n} of the record's {} bytes",
            line.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
fn append(path: &Path, event: &UsageEvent) -> std::io::Result<()> {
    write_line(&open_log(path)?, event)
}

/// The log, opened for appending; created readable and appendable by every user (as
/// the lock files are), whatever the umask.
fn open_log(path: &Path) -> std::io::Result<File> {
    let open = |create: bool| {
        OpenOptions::new()
            .append(true)
            .create(create)
            .mode(0o666)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
    };
    // Without O_CREAT first: fs.protected_regular refuses O_CREAT on another user's
    // file in a sticky directory.
    match open(false) {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let f = open(true)?;
            let _ = f.set_permissions(Permissions::from_mode(0o666));
            Ok(f)
        }
        Err(e) => Err(e),
    }
}

/// Reads the log: starts matched with their ends, damaged lines skipped (and said).
fn read(path: &Path) -> Result<UsageLog> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(UsageLog::default()),
        Err(e) => {
            return Err(crate::Error::Io {
                op: "reading the usage log",
                path: path.to_owned(),
                cause: e,
            })
        }
    };
    let mut log = UsageLog::default();
    let mut by_id: HashMap<String, usize> = HashMap::new();
    for (n, line) in text.split(|b| *b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<UsageEvent>(line) {
            Ok(UsageEvent::Start {
                id,
                user,
                host,
                pid,
                gpu,
                bytes,
                time,
                command,
            }) => {
                by_id.insert(id.clone(), log.records.len());
                log.records.push(Usage {
                    id,
                    user,
                    host,
                    pid,
                    gpu,
                    bytes,
                    command,
                    start: time,
                    end: None,
                    status: None,
                    lost: false,
                });
            }
            Ok(UsageEvent::End {
                id,
                time,
                status,
                lost,
            }) => {
                // The first end of a record counts (a second reader may close a lost
                // holder too).
                if let Some(r) = by_id.get(&id).map(|i| &mut log.records[*i]) {
                    if r.end.is_none() {
                        r.end = Some(time);
                        r.status = status;
                        r.lost = lost;
                    }
                }
            }
            Err(e) => {
                let why = format!("{}: line {}: {e}", path.display(), n + 1);
                tracing::warn!("skipping a damaged usage record: {why}");
                log.skipped.push(why);
            }
        }
    }
    Ok(log)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_line_written_is_the_start_record_read() {
        let command = vec!["python".to_owned(), "train.py".to_owned()];
        let line = StartLine {
            id: "h/0/7/GPU-1/5",
            user: "ada",
            host: "h",
            pid: 7,
            gpu: "GPU-1",
            bytes: Some(1 << 30),
            time: 100.5,
            command: &command,
        };
        let read: UsageEvent = serde_json::from_slice(&serde_json::to_vec(&line).unwrap()).unwrap();
        let record = UsageEvent::Start {
            id: line.id.into(),
            user: "ada".into(),
            host: "h".into(),
            pid: 7,
            gpu: "GPU-1".into(),
            bytes: Some(1 << 30),
            time: 100.5,
            command: command.clone(),
        };
        assert_eq!(read, record);
        // Byte for byte the line the record itself writes.
        assert_eq!(
            serde_json::to_string(&line).unwrap(),
            serde_json::to_string(&record).unwrap()
        );
    }

    #[test]
    fn records_read_back_and_a_damaged_line_is_skipped() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(USAGE_FILE);
        let start = |id: &str, gpu: &str, time: f64| UsageEvent::Start {
            id: id.into(),
            user: "ada".into(),
            host: "h".into(),
            pid: 1,
            gpu: gpu.into(),
            bytes: Some(1 << 30),
            time,
            command: vec!["train".into()],
        };
        append(&path, &start("a", "GPU-1", 100.0)).unwrap();
        append(&path, &start("b", "GPU-2", 150.0)).unwrap();
        append(
            &path,
            &UsageEvent::End {
                id: "a".into(),
                time: 160.0,
                status: Some(0),
                lost: false,
            },
        )
        .unwrap();
        // A line cut short, as a full disk leaves it.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"event\":\"end\",\"id\":\"b\",\"ti")
            .unwrap();
        let log = read(&path).unwrap();
        assert_eq!(log.records.len(), 2);
        assert_eq!(log.records[0].end, Some(160.0));
        assert_eq!(log.records[0].status, Some(0));
        assert_eq!(log.records[0].seconds(1000.0), 60.0);
        assert_eq!(log.records[1].end, None);
        assert_eq!(log.records[1].seconds(200.0), 50.0);
        assert_eq!(log.skipped.len(), 1, "{:?}", log.skipped);
        assert!(log.skipped[0].contains("line 4"), "{:?}", log.skipped);
    }
}

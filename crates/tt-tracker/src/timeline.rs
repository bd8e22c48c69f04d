//! Every sample to a file, as gpu_tracker's `tracking_file`: CSV (static data in the
//! first two lines, then one row per sample, the layout gpu_tracker's analyzer reads),
//! JSON Lines, or SQLite (tables `static_data` and `data`). Block events go to a
//! sub-tracking file beside it, as gpu_tracker's `SubTracker` writes one:
//! `<name>.blocks.csv`, or `<name>.blocks.sqlite` with its table `data`; gpu_tracker's
//! `sub-track analyze --tf <name>.sqlite --stf <name>.blocks.sqlite` reads the pair.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
#[cfg(feature = "sqlite")]
use std::time::Instant;

use serde::Serialize;

use crate::{Error, Result};

/// gpu_tracker's `_StaticData`.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct StaticData {
    pub(crate) ram_unit: String,
    pub(crate) gpu_ram_unit: String,
    pub(crate) time_unit: String,
    pub(crate) ram_system_capacity: f64,
    pub(crate) gpu_ram_system_capacity: f64,
    pub(crate) system_core_count: usize,
    pub(crate) n_expected_cores: usize,
    pub(crate) system_gpu_count: usize,
    pub(crate) n_expected_gpus: usize,
}

/// One sample: gpu_tracker's `_TimepointUsage`, same names, same order, same units.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Sample {
    /// RAM of the tracked process.
    pub main_ram: f64,
    /// RAM of its descendants.
    pub descendants_ram: f64,
    /// Both.
    pub combined_ram: f64,
    /// RAM used by the system.
    pub system_ram: f64,
    /// GPU RAM of the tracked process.
    pub main_gpu_ram: f64,
    /// GPU RAM of its descendants.
    pub descendants_gpu_ram: f64,
    /// Both.
    pub combined_gpu_ram: f64,
    /// GPU RAM used on every GPU.
    pub system_gpu_ram: f64,
    /// Sum of the tracked GPUs' utilisation.
    pub gpu_sum_utilization_percent: f64,
    /// That sum over the number of tracked GPUs.
    pub gpu_hardware_utilization_percent: f64,
    /// Threads of the tracked process.
    pub main_n_threads: u64,
    /// Threads of its descendants.
    pub descendants_n_threads: u64,
    /// Both.
    pub combined_n_threads: u64,
    /// Sum over the machine's cores.
    pub cpu_system_sum_utilization_percent: f64,
    /// That sum over the core count.
    pub cpu_system_hardware_utilization_percent: f64,
    /// The tracked process's CPU.
    pub cpu_main_sum_utilization_percent: f64,
    /// Over the expected cores.
    pub cpu_main_hardware_utilization_percent: f64,
    /// Its descendants' CPU.
    pub cpu_descendants_sum_utilization_percent: f64,
    /// Over the expected cores.
    pub cpu_descendants_hardware_utilization_percent: f64,
    /// Both.
    pub cpu_combined_sum_utilization_percent: f64,
    /// Over the expected cores.
    pub cpu_combined_hardware_utilization_percent: f64,
    /// Seconds since the Unix epoch.
    pub timestamp: f64,
}

impl Sample {
    /// Every measure but the timestamp, by its timeline name.
    pub fn measures(&self) -> [(&'static str, f64); 21] {
        [
            ("main_ram", self.main_ram),
            ("descendants_ram", self.descendants_ram),
            ("combined_ram", self.combined_ram),
            ("system_ram", self.system_ram),
            ("main_gpu_ram", self.main_gpu_ram),
            ("descendants_gpu_ram", self.descendants_gpu_ram),
            ("combined_gpu_ram", self.combined_gpu_ram),
            ("system_gpu_ram", self.system_gpu_ram),
            (
                "gpu_sum_utilization_percent",
                self.gpu_sum_utilization_percent,
            ),
            (
                "gpu_hardware_utilization_percent",
                self.gpu_hardware_utilization_percent,
            ),
            ("main_n_threads", self.main_n_threads as f64),
            ("descendants_n_threads", self.descendants_n_threads as f64),
            ("combined_n_threads", self.combined_n_threads as f64),
            (
                "cpu_system_sum_utilization_percent",
                self.cpu_system_sum_utilization_percent,
            ),
            (
                "cpu_system_hardware_utilization_percent",
                self.cpu_system_hardware_utilization_percent,
            ),
            (
                "cpu_main_sum_utilization_percent",
                self.cpu_main_sum_utilization_percent,
            ),
            (
                "cpu_main_hardware_utilization_percent",
                self.cpu_main_hardware_utilization_percent,
            ),
            (
                "cpu_descendants_sum_utilization_percent",
                self.cpu_descendants_sum_utilization_percent,
            ),
            (
                "cpu_descendants_hardware_utilization_percent",
                self.cpu_descendants_hardware_utilization_percent,
            ),
            (
                "cpu_combined_sum_utilization_percent",
                self.cpu_combined_sum_utilization_percent,
            ),
            (
                "cpu_combined_hardware_utilization_percent",
                self.cpu_combined_hardware_utilization_percent,
            ),
        ]
    }
}

/// A block starting (position 0) or stopping (1): gpu_tracker's sub-tracking record.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct BlockEvent {
    pub(crate) process_id: u32,
    pub(crate) code_block_name: String,
    pub(crate) position: u8,
    pub(crate) timestamp: f64,
}

/// gpu_tracker's sub-tracking table.
#[cfg(feature = "sqlite")]
pub(crate) const BLOCKS_SCHEMA: &str = "CREATE TABLE data (process_id INTEGER, code_block_name \
                                        TEXT, position INTEGER, timestamp REAL);";

/// One value of a row.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Cell {
    Text(String),
    Real(f64),
    Int(i64),
}

/// A record with named values in a fixed order (serde_json's maps sort their keys).
pub(crate) trait Row {
    fn row(&self) -> Vec<(&'static str, Cell)>;
}

impl Row for StaticData {
    fn row(&self) -> Vec<(&'static str, Cell)> {
        vec![
            ("ram_unit", Cell::Text(self.ram_unit.clone())),
            ("gpu_ram_unit", Cell::Text(self.gpu_ram_unit.clone())),
            ("time_unit", Cell::Text(self.time_unit.clone())),
            ("ram_system_capacity", Cell::Real(self.ram_system_capacity)),
            (
                "gpu_ram_system_capacity",
                Cell::Real(self.gpu_ram_system_capacity),
            ),
            (
                "system_core_count",
                Cell::Int(self.system_core_count as i64),
            ),
            ("n_expected_cores", Cell::Int(self.n_expected_cores as i64)),
            ("system_gpu_count", Cell::Int(self.system_gpu_count as i64)),
            ("n_expected_gpus", Cell::Int(self.n_expected_gpus as i64)),
        ]
    }
}

impl Row for Sample {
    fn row(&self) -> Vec<(&'static str, Cell)> {
        let mut row: Vec<(&'static str, Cell)> = self
            .measures()
            .into_iter()
            .map(|(k, v)| {
                if k.ends_with("n_threads") {
                    (k, Cell::Int(v as i64))
                } else {
                    (k, Cell::Real(v))
                }
            })
            .collect();
        row.push(("timestamp", Cell::Real(self.timestamp)));
        row
    }
}

impl Row for BlockEvent {
    fn row(&self) -> Vec<(&'static str, Cell)> {
        vec![
            ("process_id", Cell::Int(i64::from(self.process_id))),
            ("code_block_name", Cell::Text(self.code_block_name.clone())),
            ("position", Cell::Int(i64::from(self.position))),
            ("timestamp", Cell::Real(self.timestamp)),
        ]
    }
}

fn csv_value(v: &Cell) -> String {
    match v {
        Cell::Text(s) if s.contains([',', '"', '\n', '\r']) => {
            format!("\"{}\"", s.replace('"', "\"\""))
        }
        Cell::Text(s) => s.clone(),
        // As gpu_tracker's files have them: Python's repr (always a dot or an
        // exponent, exponents from 1e16 and below 1e-4, `nan`, `inf`).
        Cell::Real(x) => crate::units::python_repr(*x),
        Cell::Int(i) => i.to_string(),
    }
}

pub(crate) fn csv_lines(value: &impl Row, header: bool) -> String {
    let f = value.row();
    let mut out = String::new();
    if header {
        out += &f.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(",");
        out.push('\n');
    }
    out += &f
        .iter()
        .map(|(_, v)| csv_value(v))
        .collect::<Vec<_>>()
        .join(",");
    out.push('\n');
    out
}

pub(crate) enum Timeline {
    Csv {
        path: PathBuf,
        data: BufWriter<File>,
        blocks_path: PathBuf,
        blocks: Option<BufWriter<File>>,
    },
    Jsonl {
        path: PathBuf,
        out: BufWriter<File>,
    },
    #[cfg(feature = "sqlite")]
    Sqlite {
        path: PathBuf,
        conn: Box<rusqlite::Connection>,
        last_commit: Instant,
        blocks_path: PathBuf,
        /// The sub-tracking database, created at the first block event.
        blocks: Option<Box<rusqlite::Connection>>,
    },
}

/// The timeline formats, by extension (lowercase).
fn format_of(path: &Path) -> Option<&'static str> {
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    match ext.as_str() {
        "csv" => Some("csv"),
        "jsonl" | "ndjson" => Some("jsonl"),
        "sqlite" | "db" | "sqlite3" => Some("sqlite"),
        _ => None,
    }
}

/// A `.sqlite` timeline in a build without SQLite: an error that says how to get it.
fn no_sqlite_here(path: &Path) -> Result<()> {
    if cfg!(feature = "sqlite") || format_of(path) != Some("sqlite") {
        return Ok(());
    }
    Err(Error::Timeline {
        path: path.to_owned(),
        reason: "this build has no SQLite: enable tt-tracker's `sqlite` feature (the \
                 `torchtools` command has it), or write .csv or .jsonl"
            .into(),
    })
}

/// Checks, before anything is tracked, that a timeline can be created at `path`: a
/// known extension, an existing directory, not a directory itself, and not an
/// existing file unless `overwrite`. The tracker creates the file at start; this
/// lets a command-line tool refuse a typo before it starts a long command.
pub fn check_timeline_path(path: &Path, overwrite: bool) -> Result<()> {
    let bad = |reason: String| Error::Timeline {
        path: path.to_owned(),
        reason,
    };
    if path.is_dir() {
        return Err(bad("it is a directory: give a file name in it".into()));
    }
    if format_of(path).is_none() {
        return Err(Error::TimelineFormat {
            path: path.to_owned(),
        });
    }
    no_sqlite_here(path)?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(bad(format!(
            "the directory {} does not exist: create it first, or choose another path",
            parent.display()
        )));
    }
    if path.exists() && !overwrite {
        return Err(Error::TimelineExists {
            path: path.to_owned(),
        });
    }
    Ok(())
}

fn create_file(path: &Path, overwrite: bool) -> Result<File> {
    let mut o = OpenOptions::new();
    o.write(true);
    if overwrite {
        o.create(true).truncate(true);
    } else {
        o.create_new(true);
    }
    o.open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            Error::TimelineExists {
                path: path.to_owned(),
            }
        } else {
            Error::Timeline {
                path: path.to_owned(),
                reason: e.to_string(),
            }
        }
    })
}

impl Timeline {
    pub(crate) fn create(
        path: &Path,
        overwrite: bool,
        static_data: &StaticData,
    ) -> Result<Timeline> {
        // Before anything is created, the path's every check (a missing directory is
        // named as such; a build without SQLite says how to get it).
        check_timeline_path(path, overwrite)?;
        let err = |e: &dyn std::fmt::Display| Error::Timeline {
            path: path.to_owned(),
            reason: e.to_string(),
        };
        match format_of(path) {
            Some("csv") => {
                let mut data = BufWriter::new(create_file(path, overwrite)?);
                data.write_all(csv_lines(static_data, true).as_bytes())
                    .map_err(|e| err(&e))?;
                let header = csv_lines(&Sample::default(), true);
                data.write_all(header.lines().next().unwrap_or("").as_bytes())
                    .and_then(|()| data.write_all(b"\n"))
                    .map_err(|e| err(&e))?;
                Ok(Timeline::Csv {
                    path: path.to_owned(),
                    data,
                    blocks_path: path.with_extension("blocks.csv"),
                    blocks: None,
                })
            }
            Some("jsonl") => {
                let mut out = BufWriter::new(create_file(path, overwrite)?);
                let line = serde_json::json!({ "static_data": static_data });
                writeln!(out, "{line}").map_err(|e| err(&e))?;
                Ok(Timeline::Jsonl {
                    path: path.to_owned(),
                    out,
                })
            }
            #[cfg(feature = "sqlite")]
            Some("sqlite") => {
                drop(create_file(path, overwrite)?);
                let conn = rusqlite::Connection::open(path).map_err(|e| err(&e))?;
                let columns = |v: &[(&'static str, Cell)]| {
                    v.iter()
                        .map(|(k, v)| {
                            let ty = match v {
                                Cell::Text(_) => "TEXT",
                                Cell::Real(_) => "REAL",
                                Cell::Int(_) => "INTEGER",
                            };
                            format!("{k} {ty}")
                        })
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                let stat = static_data.row();
                let sample = Sample::default().row();
                conn.execute_batch(&format!(
                    "CREATE TABLE static_data ({}); CREATE TABLE data ({});",
                    columns(&stat),
                    columns(&sample)
                ))
                .map_err(|e| err(&e))?;
                insert(&conn, "static_data", &stat).map_err(|e| err(&e))?;
                conn.execute_batch("BEGIN").map_err(|e| err(&e))?;
                Ok(Timeline::Sqlite {
                    path: path.to_owned(),
                    conn: Box::new(conn),
                    last_commit: Instant::now(),
                    blocks_path: path.with_extension("blocks.sqlite"),
                    blocks: None,
                })
            }
            _ => Err(Error::TimelineFormat {
                path: path.to_owned(),
            }),
        }
    }

    fn path(&self) -> &Path {
        match self {
            Timeline::Csv { path, .. } | Timeline::Jsonl { path, .. } => path,
            #[cfg(feature = "sqlite")]
            Timeline::Sqlite { path, .. } => path,
        }
    }

    fn error(&self, e: &dyn std::fmt::Display) -> Error {
        Error::Timeline {
            path: self.path().to_owned(),
            reason: e.to_string(),
        }
    }

    pub(crate) fn sample(&mut self, s: &Sample) -> Result<()> {
        let r: std::result::Result<(), String> = match self {
            Timeline::Csv { data, .. } => data
                .write_all(csv_lines(s, false).as_bytes())
                .map_err(|e| e.to_string()),
            Timeline::Jsonl { out, .. } => serde_json::to_string(s)
                .map_err(|e| e.to_string())
                .and_then(|l| writeln!(out, "{l}").map_err(|e| e.to_string())),
            #[cfg(feature = "sqlite")]
            Timeline::Sqlite {
                conn, last_commit, ..
            } => insert(conn, "data", &s.row())
                .and_then(|()| {
                    if commit_due(last_commit.elapsed()) {
                        *last_commit = Instant::now();
                        conn.execute_batch("COMMIT; BEGIN")
                    } else {
                        Ok(())
                    }
                })
                .map_err(|e| e.to_string()),
        };
        r.map_err(|e| self.error(&e))
    }

    pub(crate) fn block(&mut self, e: &BlockEvent) -> Result<()> {
        let r: std::result::Result<(), String> = match self {
            Timeline::Csv {
                blocks_path,
                blocks,
                ..
            } => {
                let header = blocks.is_none();
                if header {
                    match File::create(&*blocks_path) {
                        Ok(f) => *blocks = Some(BufWriter::new(f)),
                        Err(e) => return Err(self.error(&e)),
                    }
                }
                match blocks {
                    Some(w) => w
                        .write_all(csv_lines(e, header).as_bytes())
                        .map_err(|e| e.to_string()),
                    None => Ok(()),
                }
            }
            Timeline::Jsonl { out, .. } => {
                serde_json::to_string(&serde_json::json!({ "block": e }))
                    .map_err(|e| e.to_string())
                    .and_then(|l| writeln!(out, "{l}").map_err(|e| e.to_string()))
            }
            #[cfg(feature = "sqlite")]
            Timeline::Sqlite {
                blocks_path,
                blocks,
                ..
            } => {
                if blocks.is_none() {
                    // Replaced, as the CSV sub-tracking file is: it belongs to this timeline.
                    let _ = std::fs::remove_file(&*blocks_path);
                    let opened = rusqlite::Connection::open(&*blocks_path)
                        .and_then(|c| c.execute_batch(BLOCKS_SCHEMA).map(|()| c));
                    match opened {
                        Ok(c) => *blocks = Some(Box::new(c)),
                        Err(e) => return Err(self.error(&e)),
                    }
                }
                match blocks {
                    Some(c) => insert(c, "data", &e.row()).map_err(|e| e.to_string()),
                    None => Ok(()),
                }
            }
        };
        r.map_err(|e| self.error(&e))
    }

    pub(crate) fn finish(self) -> Result<()> {
        let path = self.path().to_owned();
        let err = |e: &dyn std::fmt::Display| Error::Timeline {
            path: path.clone(),
            reason: e.to_string(),
        };
        match self {
            Timeline::Csv {
                mut data, blocks, ..
            } => {
                data.flush().map_err(|e| err(&e))?;
                if let Some(mut b) = blocks {
                    b.flush().map_err(|e| err(&e))?;
                }
            }
            Timeline::Jsonl { mut out, .. } => out.flush().map_err(|e| err(&e))?,
            #[cfg(feature = "sqlite")]
            Timeline::Sqlite { conn, .. } => conn.execute_batch("COMMIT").map_err(|e| err(&e))?,
        }
        Ok(())
    }
}

#[cfg(feature = "sqlite")]
pub(crate) fn insert(
    conn: &rusqlite::Connection,
    table: &str,
    values: &[(&'static str, Cell)],
) -> rusqlite::Result<()> {
    let names: Vec<&str> = values.iter().map(|(k, _)| *k).collect();
    let marks = vec!["?"; values.len()].join(", ");
    let sql = format!(
        "INSERT INTO {table} ({}) VALUES ({marks})",
        names.join(", ")
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let params: Vec<rusqlite::types::Value> = values
        .iter()
        .map(|(_, v)| match v {
            Cell::Text(s) => rusqlite::types::Value::Text(s.clone()),
            Cell::Real(x) => rusqlite::types::Value::Real(*x),
            Cell::Int(i) => rusqlite::types::Value::Integer(*i),
        })
        .collect();
    stmt.execute(rusqlite::params_from_iter(params))?;
    Ok(())
}

/// How often an SQLite timeline's samples are committed: a crash loses at most the
/// last second, and one transaction a second keeps a 10 ms interval cheap.
#[cfg(feature = "sqlite")]
const SQLITE_COMMIT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether the samples of an SQLite timeline are committed now, `since_last` after the
/// last commit.
#[cfg(feature = "sqlite")]
fn commit_due(since_last: std::time::Duration) -> bool {
    since_last >= SQLITE_COMMIT_EVERY
}

#[cfg(test)]
mod tests {
    use super::{csv_value, Cell};

    #[cfg(feature = "sqlite")]
    #[test]
    fn an_sqlite_timeline_is_committed_once_a_second() {
        use super::commit_due;
        use std::time::Duration;
        assert!(!commit_due(Duration::ZERO));
        assert!(!commit_due(Duration::from_millis(999)));
        assert!(commit_due(Duration::from_secs(1)));
        assert!(commit_due(Duration::from_secs(30)));
    }

    #[test]
    fn csv_cells_are_written_as_python_writes_them() {
        let cells = [
            Cell::Real(3.0),
            Cell::Real(0.25),
            Cell::Real(1e16),
            Cell::Real(1.5e-5),
            Cell::Real(123_456_789.0),
            Cell::Real(f64::NAN),
            Cell::Int(-3),
            Cell::Text("a,b".into()),
            Cell::Text("say \"hi\"".into()),
            Cell::Text("plain".into()),
            Cell::Text("carriage\rreturn".into()),
        ];
        let ours: Vec<String> = cells.iter().map(csv_value).collect();
        // Python's csv module (its default dialect: quotes around a field with a
        // comma, a quote or either line-break character), on the same values.
        let script = "import csv, sys\n\
                      csv.writer(sys.stdout).writerow(\
                      [3.0, 0.25, 1e16, 1.5e-5, 123456789.0, float('nan'), -3, 'a,b', \
                      'say \"hi\"', 'plain', 'carriage\\rreturn'])";
        let theirs = tt_testkit::run_python(script, &[]);
        let theirs = theirs.strip_suffix("\r\n").unwrap_or(&theirs);
        assert_eq!(ours.join(","), theirs);
    }
}

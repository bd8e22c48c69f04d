//! Tracking and sub-tracking files of both tools, read; sub-tracking files combined.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::{error, Event, OrderedMap, Scalar, Timepoints};
use crate::timeline::{csv_lines, Cell, Row, StaticData};
use crate::Result;

// A build without SQLite: its files are refused, saying how to read them.
#[cfg(not(feature = "sqlite"))]
mod no_sqlite;
#[cfg(not(feature = "sqlite"))]
use no_sqlite::{sqlite_events, sqlite_timepoints, write_sqlite};

const EVENT_COLUMNS: [&str; 4] = ["process_id", "code_block_name", "position", "timestamp"];

#[derive(Clone, Copy, PartialEq)]
enum Format {
    Csv,
    Sqlite,
    Jsonl,
}

fn format_of(path: &Path, what: &str) -> Result<Format> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("csv") => Ok(Format::Csv),
        Some("sqlite") => Ok(Format::Sqlite),
        Some("jsonl" | "ndjson") => Ok(Format::Jsonl),
        _ => Err(error(
            path,
            format!("cannot tell the format of this {what}: name it *.csv, *.sqlite or *.jsonl"),
        )),
    }
}

/// RFC 4180 records (quoted fields may hold commas, quotes and line breaks); blank
/// lines skipped.
pub(crate) fn parse_csv(text: &str) -> Vec<Vec<String>> {
    let (mut rows, mut row, mut field) = (Vec::new(), Vec::new(), String::new());
    let (mut quoted, mut chars) = (false, text.chars().peekable());
    let mut end_row = |row: &mut Vec<String>, field: &mut String| {
        row.push(std::mem::take(field));
        let r = std::mem::take(row);
        if !(r.len() == 1 && r[0].is_empty()) {
            rows.push(r);
        }
    };
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            (true, '"') => quoted = false,
            (true, c) => field.push(c),
            (false, '"') => quoted = true,
            (false, ',') => row.push(std::mem::take(&mut field)),
            (false, '\n') => end_row(&mut row, &mut field),
            (false, '\r') => {}
            (false, c) => field.push(c),
        }
    }
    if !field.is_empty() || !row.is_empty() {
        end_row(&mut row, &mut field);
    }
    rows
}

fn number(path: &Path, column: &str, text: &str) -> Result<f64> {
    if text.is_empty() {
        return Ok(f64::NAN);
    }
    text.parse().map_err(|_| {
        error(
            path,
            format!("{column} holds {text:?}, which is not a number"),
        )
    })
}

fn column(path: &Path, header: &[String], name: &str) -> Result<usize> {
    header.iter().position(|h| h == name).ok_or_else(|| {
        error(
            path,
            format!(
                "no column {name:?} (the columns are {}): is this the right file?",
                header.join(", ")
            ),
        )
    })
}

/// Static data in gpu_tracker's field order (our JSON Lines files sort the keys): the
/// order our CSV and SQLite timelines write them in.
fn sorted_static(mut pairs: Vec<(String, Scalar)>) -> OrderedMap<Scalar> {
    let order: Vec<&str> = StaticData::default()
        .row()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    pairs.sort_by_key(|(k, _)| order.iter().position(|s| s == k).unwrap_or(order.len()));
    OrderedMap(pairs)
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .map_err(|e| error(path, e.to_string()))
}

/// The samples of a tracking file.
pub(crate) fn timepoints(path: &Path) -> Result<Timepoints> {
    match format_of(path, "tracking file")? {
        Format::Csv => csv_timepoints(path),
        Format::Sqlite => sqlite_timepoints(path),
        Format::Jsonl => jsonl_timepoints(path),
    }
}

/// Rows of named numbers (the timestamp last) from a header and records.
fn numeric_rows(
    path: &Path,
    header: &[String],
    records: &[Vec<String>],
) -> Result<(Vec<String>, Vec<Vec<f64>>)> {
    let ts = column(path, header, "timestamp")?;
    let order: Vec<usize> = (0..header.len()).filter(|&i| i != ts).chain([ts]).collect();
    let mut rows = Vec::with_capacity(records.len());
    for (n, r) in records.iter().enumerate() {
        if r.len() != header.len() {
            if n + 1 == records.len() {
                break; // a line still being written by a running tracker
            }
            return Err(error(
                path,
                format!(
                    "sample {} has {} values for {} columns",
                    n + 1,
                    r.len(),
                    header.len()
                ),
            ));
        }
        let row = order
            .iter()
            .map(|&i| number(path, &header[i], &r[i]))
            .collect::<Result<Vec<f64>>>()?;
        rows.push(row);
    }
    let measures = order[..order.len() - 1]
        .iter()
        .map(|&i| header[i].clone())
        .collect();
    Ok((measures, rows))
}

fn csv_timepoints(path: &Path) -> Result<Timepoints> {
    let records = parse_csv(&read_text(path)?);
    if records.len() < 3 {
        return Err(error(
            path,
            "a CSV tracking file starts with two lines of static data (units, capacities) \
             and the samples' header: this one is shorter; was it written by \
             `torchtools track --timeline` or gpu_tracker's tracking_file?",
        ));
    }
    let (names, values) = (&records[0], &records[1]);
    let static_data = OrderedMap(
        names
            .iter()
            .zip(values)
            .map(|(k, v)| (k.clone(), Scalar::parse(v)))
            .collect(),
    );
    let (measures, rows) = numeric_rows(path, &records[2], &records[3..])?;
    Ok(Timepoints {
        static_data,
        measures,
        rows,
        from_sqlite: false,
    })
}

fn jsonl_timepoints(path: &Path) -> Result<Timepoints> {
    let mut static_data = None;
    let mut header: Option<Vec<String>> = None;
    let mut records = Vec::new();
    for (n, line) in read_text(path)?.lines().enumerate() {
        let Ok(row) = serde_json::from_str::<OrderedMap<serde_json::Value>>(line) else {
            continue; // a line still being written
        };
        if let Some(s) = row.get("static_data").and_then(|s| s.as_object()) {
            static_data = Some(sorted_static(
                s.iter().map(|(k, v)| (k.clone(), json_scalar(v))).collect(),
            ));
        } else if row.get("timestamp").is_some() {
            let keys: Vec<String> = row.keys().map(str::to_owned).collect();
            match &header {
                Some(h) if *h != keys => {
                    return Err(error(
                        path,
                        format!("line {} has other fields than the samples before it", n + 1),
                    ))
                }
                Some(_) => {}
                None => header = Some(keys),
            }
            records.push(
                row.iter()
                    .map(|(_, v)| v.as_f64().map(|x| x.to_string()).unwrap_or_default())
                    .collect(),
            );
        }
    }
    let static_data = static_data.ok_or_else(|| {
        error(
            path,
            "no static data line: is this a timeline of `torchtools track --timeline`?",
        )
    })?;
    let (measures, rows) = match header {
        Some(h) => numeric_rows(path, &h, &records)?,
        None => (Vec::new(), Vec::new()),
    };
    Ok(Timepoints {
        static_data,
        measures,
        rows,
        from_sqlite: false,
    })
}

fn json_scalar(v: &serde_json::Value) -> Scalar {
    match v {
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => Scalar::Int(i),
            None => Scalar::Real(n.as_f64().unwrap_or(f64::NAN)),
        },
        serde_json::Value::String(s) => Scalar::Text(s.clone()),
        other => Scalar::Text(other.to_string()),
    }
}

/// The start/stop records of a sub-tracking file.
pub(crate) fn events(path: &Path) -> Result<Vec<Event>> {
    match format_of(path, "sub-tracking file")? {
        Format::Csv => {
            let records = parse_csv(&read_text(path)?);
            let Some((header, rows)) = records.split_first() else {
                return Err(error(path, "empty: no header, no code block"));
            };
            let idx = EVENT_COLUMNS
                .iter()
                .map(|c| column(path, header, c))
                .collect::<Result<Vec<usize>>>()?;
            rows.iter()
                .enumerate()
                .filter(|(_, r)| r.len() == header.len())
                .map(|(n, r)| {
                    let int = |i: usize| {
                        r[idx[i]].parse::<i64>().map_err(|_| {
                            error(
                                path,
                                format!(
                                    "line {}: {} holds {:?}, not an integer",
                                    n + 2,
                                    EVENT_COLUMNS[i],
                                    r[idx[i]]
                                ),
                            )
                        })
                    };
                    Ok(Event {
                        process_id: int(0)?,
                        code_block_name: r[idx[1]].clone(),
                        position: int(2)?,
                        timestamp: number(path, "timestamp", &r[idx[3]])?,
                    })
                })
                .collect()
        }
        Format::Sqlite => sqlite_events(path),
        Format::Jsonl => {
            let mut out = Vec::new();
            for line in read_text(path)?.lines() {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                    continue;
                };
                let Some(b) = v.get("block") else { continue };
                let int = |k: &str| b.get(k).and_then(serde_json::Value::as_i64);
                let (Some(pid), Some(name), Some(pos), Some(ts)) = (
                    int("process_id"),
                    b.get("code_block_name").and_then(|n| n.as_str()),
                    int("position"),
                    b.get("timestamp").and_then(serde_json::Value::as_f64),
                ) else {
                    return Err(error(path, format!("a malformed block line: {line}")));
                };
                out.push(Event {
                    process_id: pid,
                    code_block_name: name.to_owned(),
                    position: pos,
                    timestamp: ts,
                });
            }
            Ok(out)
        }
    }
}

#[cfg(feature = "sqlite")]
fn open_sqlite(path: &Path) -> Result<rusqlite::Connection> {
    if !path.is_file() {
        return Err(error(path, "no such file"));
    }
    rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .map_err(|e| error(path, e.to_string()))
}

/// Every row of `sql` as text cells, with the column names.
#[cfg(feature = "sqlite")]
fn sqlite_rows(
    path: &Path,
    conn: &rusqlite::Connection,
    sql: &str,
) -> Result<(Vec<String>, Vec<Vec<String>>)> {
    use rusqlite::types::ValueRef;
    let err = |e: rusqlite::Error| error(path, format!("{e} (running `{sql}`)"));
    let mut stmt = conn.prepare(sql).map_err(err)?;
    let names: Vec<String> = stmt.column_names().iter().map(|s| s.to_string()).collect();
    let n = names.len();
    let rows = stmt
        .query_map([], |r| {
            (0..n)
                .map(|i| {
                    Ok(match r.get_ref(i)? {
                        ValueRef::Null | ValueRef::Blob(_) => String::new(),
                        ValueRef::Integer(i) => i.to_string(),
                        ValueRef::Real(x) => csv_value_of_real(x),
                        ValueRef::Text(t) => String::from_utf8_lossy(t).into_owned(),
                    })
                })
                .collect::<rusqlite::Result<Vec<String>>>()
        })
        .map_err(err)?
        .collect::<rusqlite::Result<Vec<_>>>()
        .map_err(err)?;
    Ok((names, rows))
}

/// A real as text that reads back as the same real and as a real (`2.0`, not `2`).
#[cfg(feature = "sqlite")]
fn csv_value_of_real(x: f64) -> String {
    let s = x.to_string();
    if s.contains(['.', 'e', 'N', 'i']) {
        s
    } else {
        s + ".0"
    }
}

#[cfg(feature = "sqlite")]
fn sqlite_timepoints(path: &Path) -> Result<Timepoints> {
    let conn = open_sqlite(path)?;
    let (names, values) = sqlite_rows(path, &conn, "SELECT * FROM static_data LIMIT 1")?;
    let static_data = OrderedMap(
        names
            .into_iter()
            .zip(values.first().cloned().unwrap_or_default())
            .map(|(k, v)| (k, Scalar::parse(&v)))
            .collect(),
    );
    let (header, records) = sqlite_rows(path, &conn, "SELECT * FROM data")?;
    let (measures, rows) = numeric_rows(path, &header, &records)?;
    Ok(Timepoints {
        static_data,
        measures,
        rows,
        from_sqlite: true,
    })
}

#[cfg(feature = "sqlite")]
fn sqlite_events(path: &Path) -> Result<Vec<Event>> {
    let conn = open_sqlite(path)?;
    let sql = format!("SELECT {} FROM data", EVENT_COLUMNS.join(", "));
    let mut stmt = conn
        .prepare(&sql)
        .map_err(|e| error(path, format!("{e}: not a sub-tracking database")))?;
    let rows = stmt
        .query_map([], |r| {
            Ok(Event {
                process_id: r.get(0)?,
                code_block_name: r.get(1)?,
                position: r.get(2)?,
                timestamp: r.get(3)?,
            })
        })
        .and_then(|rows| rows.collect::<rusqlite::Result<Vec<Event>>>())
        .map_err(|e| error(path, e.to_string()))?;
    Ok(rows)
}

impl Row for Event {
    fn row(&self) -> Vec<(&'static str, Cell)> {
        vec![
            ("process_id", Cell::Int(self.process_id)),
            ("code_block_name", Cell::Text(self.code_block_name.clone())),
            ("position", Cell::Int(self.position)),
            ("timestamp", Cell::Real(self.timestamp)),
        ]
    }
}

/// gpu_tracker's `sub-track combine --stf OUTPUT -p FILE...`: the sub-tracking files of
/// several processes merged into one. `inputs` is the files, or one directory whose
/// files with the output's extension are taken in name order. Inputs may be CSV,
/// SQLite or JSON Lines timelines whatever the output's format (`.csv` or `.sqlite`).
/// An existing output is never replaced; the output appears whole or not at all.
/// Returns the files combined and the records written.
pub fn combine(output: &Path, inputs: &[PathBuf]) -> Result<(usize, usize)> {
    let format = format_of(output, "combined sub-tracking file")?;
    if format == Format::Jsonl {
        return Err(error(
            output,
            "a combined sub-tracking file is .csv or .sqlite (gpu_tracker's formats)",
        ));
    }
    if output.exists() {
        return Err(error(
            output,
            "already exists: combine never replaces a file; remove it or choose another name",
        ));
    }
    let files: Vec<PathBuf> = match inputs {
        [] => return Err(error(output, "no file to combine: give -p FILE...")),
        [dir] if dir.is_dir() => {
            let ext = output.extension();
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| error(dir, e.to_string()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && p.extension() == ext)
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(error(
                    dir,
                    format!(
                        "no *.{} file in this directory to combine",
                        ext.map(|e| e.to_string_lossy()).unwrap_or_default()
                    ),
                ));
            }
            files
        }
        files => files.to_vec(),
    };
    let mut all = Vec::new();
    for f in &files {
        all.extend(events(f)?);
    }
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmp = tempfile_in(parent, output)?;
    let written = match format {
        Format::Csv => write_csv(&tmp, &all),
        _ => write_sqlite(&tmp, &all),
    };
    let placed = written.and_then(|()| {
        // No replacing: hard-link the finished file into place, then drop the temporary.
        std::fs::hard_link(&tmp, output).map_err(|e| error(output, e.to_string()))
    });
    let _ = std::fs::remove_file(&tmp);
    placed.map(|()| (files.len(), all.len()))
}

fn tempfile_in(dir: &Path, output: &Path) -> Result<PathBuf> {
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    Ok(tmp)
}

fn write_csv(path: &Path, events: &[Event]) -> Result<()> {
    let mut text = EVENT_COLUMNS.join(",") + "\n";
    for e in events {
        text += &csv_lines(e, false);
    }
    std::fs::File::create_new(path)
        .and_then(|mut f| f.write_all(text.as_bytes()).and_then(|()| f.sync_all()))
        .map_err(|e| error(path, e.to_string()))
}

#[cfg(feature = "sqlite")]
fn write_sqlite(path: &Path, events: &[Event]) -> Result<()> {
    let err = |e: rusqlite::Error| error(path, e.to_string());
    let conn = rusqlite::Connection::open(path).map_err(err)?;
    conn.execute_batch(crate::timeline::BLOCKS_SCHEMA)
        .map_err(err)?;
    conn.execute_batch("BEGIN").map_err(err)?;
    for e in events {
        crate::timeline::insert(&conn, "data", &e.row()).map_err(err)?;
    }
    conn.execute_batch("COMMIT").map_err(err)
}

/// `NaN`, `Infinity` and `-Infinity` outside strings (Python's `json.dumps` writes
/// them; JSON has no such tokens) turned into `null`.
pub(crate) fn nan_to_null(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            rest = &rest[c.len_utf8()..];
            continue;
        }
        if let Some(token) = ["-Infinity", "Infinity", "NaN"]
            .into_iter()
            .find(|t| rest.starts_with(t))
        {
            out.push_str("null");
            rest = &rest[token.len()..];
            continue;
        }
        in_string = c == '"';
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_records_with_quotes_commas_and_line_breaks() {
        let rows = parse_csv("a,b\n1,\"x, \"\"y\"\"\nz\"\n\n2,w\r\n");
        assert_eq!(
            rows,
            vec![
                vec!["a".to_owned(), "b".to_owned()],
                vec!["1".to_owned(), "x, \"y\"\nz".to_owned()],
                vec!["2".to_owned(), "w".to_owned()],
            ]
        );
    }

    #[test]
    fn a_last_record_without_a_line_break_is_kept() {
        let rows = parse_csv;
        let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        // One column (the field alone is left), an empty last field (the row alone is
        // left), and both.
        assert_eq!(rows("a\nx"), vec![s(&["a"]), s(&["x"])]);
        assert_eq!(rows("a,b\n1,"), vec![s(&["a", "b"]), s(&["1", ""])]);
        assert_eq!(rows("a,b\n1,2"), vec![s(&["a", "b"]), s(&["1", "2"])]);
    }

    #[test]
    fn python_json_numbers_become_null_outside_strings_only() {
        assert_eq!(
            nan_to_null(r#"{"a": NaN, "b": [-Infinity, Infinity], "NaN": "x NaN \" NaN"}"#),
            r#"{"a": null, "b": [null, null], "NaN": "x NaN \" NaN"}"#
        );
        // A string ending in an escaped backslash ends at its quote.
        assert_eq!(
            nan_to_null(r#"{"path": "C:\\", "x": NaN}"#),
            r#"{"path": "C:\\", "x": null}"#
        );
    }
}

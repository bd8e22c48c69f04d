//! `torchtools track sub-track analyze | combine | compare`: gpu_tracker's sub-tracking
//! commands on both tools' files.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use tt_tracker::subtrack::{self, OrderedMap, Statistic, SubTrackingResults};

use crate::child::Exit;
use crate::track::check_output;

fn bad(message: impl Into<String>) -> anyhow::Error {
    Exit(2, message.into()).into()
}

/// A file we read: a bad one is a bad argument (exit 2), as gpu_tracker's users type
/// these paths by hand.
fn input(e: tt_tracker::Error) -> anyhow::Error {
    bad(e.to_string())
}

/// `--format` and `--output`, checked before any work: text or json (pickle is refused,
/// with the way out), and an output path that can be written. Whether JSON was asked.
fn checked_format(format: &str, output: Option<&Path>) -> Result<bool> {
    let json = match format {
        "json" => true,
        "text" => false,
        _ => {
            return Err(bad(
                "--format pickle: torchtools writes no pickles (loading one can run any \
                 code); use --format json: `torchtools track sub-track compare` reads the \
                 JSON of both tools",
            ))
        }
    };
    if let Some(o) = output {
        check_output("--output", o)?;
    }
    Ok(json)
}

/// The report to `output` as gpu_tracker writes it (JSON ending with a newline), or to
/// stdout as gpu_tracker prints it; when the file cannot be written the report goes to
/// stdout and the exit status is 1.
fn emit(text: &str, json: bool, output: Option<&Path>) -> ExitCode {
    let text = if json { text.trim_end() } else { text };
    match output {
        None => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Some(path) => match std::fs::write(
            path,
            if json {
                format!("{text}\n")
            } else {
                text.to_owned()
            },
        ) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!(
                    "torchtools track: could not write {} ({e}); here it is:",
                    path.display()
                );
                println!("{text}");
                ExitCode::FAILURE
            }
        },
    }
}

/// `sub-track analyze --tf FILE --stf FILE [-o FILE] [-f text|json]`.
pub(crate) fn analyze(
    tracking_file: &Path,
    sub_tracking_file: &Path,
    output: Option<&Path>,
    format: &str,
) -> Result<ExitCode> {
    let json = checked_format(format, output)?;
    let results = subtrack::analyze(tracking_file, sub_tracking_file).map_err(input)?;
    let text = if json {
        results.to_json()
    } else {
        results.to_string()
    };
    Ok(emit(&text, json, output))
}

/// `sub-track combine --stf OUTPUT -p FILE...` (or `-p DIRECTORY`).
pub(crate) fn combine(output: &Path, files: &[PathBuf]) -> Result<ExitCode> {
    check_output("--stf", output)?;
    let (n, records) = subtrack::combine(output, files).map_err(input)?;
    eprintln!(
        "torchtools track: combined {n} file(s), {records} record(s), into {}",
        output.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// `sub-track compare [-m NAME=FILE...] [--cconfig FILE] [--stat S] [-o FILE] [-f F]`.
pub(crate) fn compare(
    mappings: &[String],
    cconfig: Option<&Path>,
    stat: Option<&str>,
    output: Option<&Path>,
    format: &str,
) -> Result<ExitCode> {
    let json = checked_format(format, output)?;
    // A later session of the same name replaces the earlier, as in gpu_tracker.
    let mut sessions: OrderedMap<PathBuf> = OrderedMap::default();
    let mut statistic = None;
    if let Some(path) = cconfig {
        let shown = path.display();
        let text =
            std::fs::read_to_string(path).map_err(|e| bad(format!("--cconfig {shown}: {e}")))?;
        let config: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| bad(format!("--cconfig {shown}: not JSON: {e}")))?;
        let Some(config) = config.as_object() else {
            return Err(bad(format!(
                "--cconfig {shown}: expected an object with \"file_path_map\" and \"statistic\""
            )));
        };
        for key in config.keys() {
            if key != "file_path_map" && key != "statistic" {
                return Err(bad(format!(
                    "--cconfig {shown}: unknown key {key:?}; known: file_path_map, statistic"
                )));
            }
        }
        if let Some(map) = config.get("file_path_map") {
            let map = map.as_object().ok_or_else(|| {
                bad(format!(
                    "--cconfig {shown}: \"file_path_map\" must map session names to files"
                ))
            })?;
            // serde_json sorts keys; the order given is only kept on the command line.
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    bad(format!(
                        "--cconfig {shown}: the file of {name:?} must be a string"
                    ))
                })?;
                sessions.insert(name.clone(), PathBuf::from(file));
            }
        }
        if let Some(s) = config.get("statistic") {
            statistic = Some(
                s.as_str()
                    .ok_or_else(|| {
                        bad(format!("--cconfig {shown}: \"statistic\" must be a string"))
                    })?
                    .to_owned(),
            );
        }
    }
    for m in mappings {
        let Some((name, file)) = m.split_once('=') else {
            return Err(bad(format!(
                "-m {m}: write NAME=FILE, e.g. -m before=before.json"
            )));
        };
        if name.is_empty() || file.is_empty() {
            return Err(bad(format!("-m {m}: both NAME and FILE are needed")));
        }
        sessions.insert(name.to_owned(), PathBuf::from(file));
    }
    if sessions.is_empty() {
        return Err(bad(
            "no session to compare: give -m NAME=FILE.json for each (the JSON of \
             `sub-track analyze --format json`), or --cconfig FILE",
        ));
    }
    let statistic: Statistic = stat
        .map(str::to_owned)
        .or(statistic)
        .as_deref()
        .unwrap_or("mean")
        .parse()
        .map_err(input)?;
    let loaded = sessions
        .0
        .into_iter()
        .map(|(name, path)| SubTrackingResults::load(&path).map(|r| (name, r, path)))
        .collect::<tt_tracker::Result<Vec<_>>>()
        .map_err(input)?;
    let comparison = subtrack::compare(&loaded, statistic).map_err(input)?;
    let text = if json {
        comparison.to_json()
    } else {
        comparison.to_string()
    };
    Ok(emit(&text, json, output))
}

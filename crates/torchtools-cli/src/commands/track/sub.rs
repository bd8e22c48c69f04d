//! `torchtools track sub-track analyze | combine | compare`: gpu_tracker's sub-tracking
//! commands on both tools' files.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use tt_tracker::subtrack::{self, OrderedMap, Statistic, SubTrackingResults};

use crate::args::check_output;
use crate::exit::Exit;

#[derive(clap::Subcommand)]
pub(crate) enum SubTrackCommand {
    /// Statistics per measure and per code block.
    ///
    /// Statistics of every measure over all samples and over each code block's calls,
    /// and each block's call times (gpu_tracker's `sub-track analyze`).
    ///
    /// The tracking file: `torchtools track --timeline` or gpu_tracker's tracking_file
    /// (.csv, .sqlite; ours also .jsonl). The sub-tracking file: written by
    /// gpu_tracker's SubTracker in a tracked Python program, or beside our timeline
    /// (NAME.blocks.csv / NAME.blocks.sqlite; a .jsonl timeline holds its blocks).
    Analyze {
        /// The tracking file.
        #[arg(long = "tf", value_name = "TRACKING_FILE")]
        tracking_file: std::path::PathBuf,
        /// The sub-tracking file.
        #[arg(long = "stf", value_name = "SUB_TRACKING_FILE")]
        sub_tracking_file: std::path::PathBuf,
        /// Write the results here instead of stdout.
        #[arg(short, long)]
        output: Option<std::path::PathBuf>,
        /// text (gpu_tracker's layout) or json (read by `sub-track compare`).
        #[arg(short, long, default_value = "text", value_parser = SUB_TRACK_FORMATS)]
        format: String,
    },
    /// Merge several processes' sub-tracking files.
    ///
    /// Merge the sub-tracking files of several processes into one (gpu_tracker's
    /// `sub-track combine`); never replaces an existing file.
    Combine {
        /// The combined file to create (.csv or .sqlite).
        #[arg(long = "stf", value_name = "SUB_TRACKING_FILE")]
        output: std::path::PathBuf,
        /// The files to combine (CSV, SQLite or JSON Lines, mixed if need be), or one
        /// directory: its files with the output's extension, in name order.
        #[arg(short = 'p', required = true, num_args = 1.., action = clap::ArgAction::Append, value_name = "FILE")]
        files: Vec<std::path::PathBuf>,
    },
    /// Compare sessions' analyses, block by block.
    ///
    /// Compare sessions' analyses measure by measure and block by block (gpu_tracker's
    /// `sub-track compare`), from the JSON of `sub-track analyze --format json`
    /// written by torchtools or gpu-tracker (pickles are not read: loading one can run
    /// any code).
    Compare {
        /// A session: its name and its analysis (repeat, or list several after -m).
        #[arg(short = 'm', num_args = 1.., action = clap::ArgAction::Append, value_name = "NAME=FILE")]
        sessions: Vec<String>,
        /// gpu_tracker's JSON config: {"file_path_map": {NAME: FILE}, "statistic": S};
        /// -m adds sessions to it, --stat overrides its statistic.
        #[arg(long, value_name = "FILE")]
        cconfig: Option<std::path::PathBuf>,
        /// The statistic compared: min, max, mean (default) or std.
        #[arg(long, value_parser = ["min", "max", "mean", "std"])]
        stat: Option<String>,
        /// Write the comparison here instead of stdout.
        #[arg(short, long)]
        output: Option<std::path::PathBuf>,
        /// text (gpu_tracker's layout) or json.
        #[arg(short, long, default_value = "text", value_parser = SUB_TRACK_FORMATS)]
        format: String,
    },
}

/// `torchtools track sub-track ...`.
pub(crate) fn run(command: &SubTrackCommand) -> Result<ExitCode> {
    match command {
        SubTrackCommand::Analyze {
            tracking_file,
            sub_tracking_file,
            output,
            format,
        } => analyze(tracking_file, sub_tracking_file, output.as_deref(), format),
        SubTrackCommand::Combine { output, files } => combine(output, files),
        SubTrackCommand::Compare {
            sessions,
            cconfig,
            stat,
            output,
            format,
        } => compare(
            sessions,
            cconfig.as_deref(),
            stat.as_deref(),
            output.as_deref(),
            format,
        ),
    }
}

fn bad(message: impl Into<String>) -> anyhow::Error {
    Exit::usage(message.into()).into()
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

/// `--format` of the sub-tracking commands (pickle is refused with the fix).
pub(crate) const SUB_TRACK_FORMATS: [&str; 3] = ["text", "json", "pickle"];

//! Several tracking sessions side by side (gpu_tracker's `sub-track compare`), from
//! their JSON reports.

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

use serde::Serialize;

use crate::{Error, ResourceUsage, Result};

/// One session: its name and report.
#[derive(Debug, Clone, Serialize)]
pub struct Session {
    /// The name shown (the file's stem by default).
    pub name: String,
    /// Its report.
    pub usage: ResourceUsage,
    /// The report's sections its file did not hold (`cpu_utilization` and
    /// `gpu_utilization` in gpu_tracker's reports before version 5): shown as unknown.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub absent: Vec<String>,
}

/// The sections a report may lack (gpu_tracker before version 5 wrote none of them).
const OPTIONAL_SECTIONS: [&str; 2] = ["cpu_utilization", "gpu_utilization"];

/// Reads a JSON report written by `torchtools track --format json`, or by gpu_tracker:
/// version 5's keys are ours (the torchtools part is then empty); earlier versions'
/// `descendents` are read as `descendants`, and their missing CPU and GPU use is shown
/// as unknown.
pub fn load(path: &Path) -> Result<Session> {
    let err = |reason: String| Error::Report {
        path: path.to_owned(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let expected = "expected the JSON report of `torchtools track --format json` or gpu_tracker's";
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| err(format!("{e}; {expected}")))?;
    let absent = OPTIONAL_SECTIONS
        .iter()
        .filter(|k| value.get(**k).is_none())
        .map(|k| (*k).to_owned())
        .collect();
    let usage: ResourceUsage =
        serde_json::from_value(value).map_err(|e| err(format!("{e}; {expected}")))?;
    let name = path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    Ok(Session {
        name,
        usage,
        absent,
    })
}

/// The comparison: overall figures per session, then each block's mean of each
/// measure per session.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// The sessions, in the order given.
    pub sessions: Vec<Session>,
}

impl Comparison {
    /// Compares `sessions`.
    pub fn new(sessions: Vec<Session>) -> Comparison {
        Comparison { sessions }
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self
            .sessions
            .iter()
            .map(|s| s.name.len())
            .max()
            .unwrap_or(0)
            .max(10);
        let header = |f: &mut fmt::Formatter<'_>, title: &str| -> fmt::Result {
            write!(f, "{title:<44}")?;
            for s in &self.sessions {
                write!(f, " {:>width$}", s.name)?;
            }
            writeln!(f)
        };
        header(f, "overall")?;
        type Get = fn(&ResourceUsage) -> String;
        // (label, the report's section it reads, how)
        let rows: [(&str, &str, Get); 7] = [
            ("max RAM combined total RSS", "max_ram", |u| {
                format!("{:.3} {}", u.max_ram.combined.total_rss, u.max_ram.unit)
            }),
            ("max RAM main total RSS", "max_ram", |u| {
                format!("{:.3} {}", u.max_ram.main.total_rss, u.max_ram.unit)
            }),
            ("max GPU RAM combined", "max_gpu_ram", |u| {
                format!("{:.3} {}", u.max_gpu_ram.combined, u.max_gpu_ram.unit)
            }),
            ("CPU combined mean (sum %)", "cpu_utilization", |u| {
                format!("{:.1}", u.cpu_utilization.combined.mean_sum_percent)
            }),
            ("CPU combined max (sum %)", "cpu_utilization", |u| {
                format!("{:.1}", u.cpu_utilization.combined.max_sum_percent)
            }),
            ("GPU mean (sum %)", "gpu_utilization", |u| {
                format!("{:.1}", u.gpu_utilization.gpu_percentages.mean_sum_percent)
            }),
            ("compute time", "compute_time", |u| {
                format!("{:.3} {}", u.compute_time.time, u.compute_time.unit)
            }),
        ];
        for (label, section, get) in rows {
            write!(f, "  {label:<42}")?;
            for s in &self.sessions {
                let v = if s.absent.iter().any(|a| a == section) {
                    "-".to_owned()
                } else {
                    get(&s.usage)
                };
                write!(f, " {v:>width$}")?;
            }
            writeln!(f)?;
        }
        let names: BTreeSet<&str> = self
            .sessions
            .iter()
            .flat_map(|s| s.usage.torchtools.blocks.iter().map(|b| b.name.as_str()))
            .collect();
        for name in names {
            header(f, &format!("block {name:?} (mean)"))?;
            let measures: BTreeSet<&str> = self
                .sessions
                .iter()
                .flat_map(|s| s.usage.torchtools.blocks.iter())
                .filter(|b| b.name == name)
                .flat_map(|b| b.measures.keys().map(String::as_str))
                .collect();
            for m in measures {
                write!(f, "  {m:<42}")?;
                for s in &self.sessions {
                    let v = s
                        .usage
                        .torchtools
                        .blocks
                        .iter()
                        .find(|b| b.name == name)
                        .and_then(|b| b.measures.get(m))
                        .map_or("-".to_owned(), |st| format!("{:.3}", st.mean));
                    write!(f, " {v:>width$}")?;
                }
                writeln!(f)?;
            }
        }
        Ok(())
    }
}

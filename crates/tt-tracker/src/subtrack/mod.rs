//! gpu_tracker's sub-tracking analysis, without Python: per code block statistics of a
//! tracking file's samples ([`analyze`], gpu_tracker's `sub-track analyze` and
//! `SubTrackingAnalyzer`), sub-tracking files merged ([`combine`], `sub-track combine`),
//! and sessions compared ([`compare`], `sub-track compare` and `TrackingComparison`).
//!
//! It reads both tools' files: a tracking file written by `torchtools track --timeline`
//! or by gpu_tracker's `Tracker(tracking_file=...)` (CSV with the static data in its
//! first two lines, SQLite with tables `static_data` and `data`, or our JSON Lines), and
//! a sub-tracking file written by gpu_tracker's `SubTracker` or by our
//! [`Tracker::block`](crate::Tracker::block) (CSV or SQLite, columns `process_id`,
//! `code_block_name`, `position`, `timestamp`; a JSON Lines timeline holds its own
//! blocks). The results have gpu_tracker's JSON keys and text layout.
//!
//! Comparisons read results as JSON (`sub-track analyze --format json`, from either
//! tool). gpu_tracker's comparison reads pickles; a pickle can run arbitrary code when
//! loaded and holds pandas objects, so it is refused with the command that writes JSON.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let (tf, stf) = (dir.path().join("t.csv"), dir.path().join("blocks.csv"));
//! # std::fs::write(&tf, "ram_unit,gpu_ram_unit,time_unit\ngigabytes,gigabytes,hours\n\
//! #   main_ram,timestamp\n1.5,10.0\n2.5,11.0\n")?;
//! # std::fs::write(&stf, "process_id,code_block_name,position,timestamp\n7,load,0,10.5\n7,load,1,11.5\n")?;
//! use tt_tracker::subtrack;
//!
//! let results = subtrack::analyze(&tf, &stf)?;
//! let load = &results.code_block_results[0];
//! assert_eq!((load.name.as_str(), load.num_calls, load.num_timepoints), ("load", 1, 1));
//! assert_eq!(load.resource_usage.get("main_ram").map(|s| s.max), Some(2.5));
//! println!("{results}"); // gpu_tracker's text layout
//! # Ok(()) }
//! ```

mod read;
pub(crate) mod text;

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{Error, Result};

pub use read::combine;

fn error(path: &Path, reason: impl Into<String>) -> Error {
    Error::SubTracking {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// A map that keeps its keys in the order they were inserted or read (gpu_tracker's
/// pandas indexes keep theirs: measures in sampling order, sessions as given).
#[derive(Debug, Clone, PartialEq)]
pub struct OrderedMap<V>(pub Vec<(String, V)>);

impl<V> Default for OrderedMap<V> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<V> OrderedMap<V> {
    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&V> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The keys in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }

    /// Sets `key` (replaced in place if present, else appended).
    pub fn insert(&mut self, key: String, value: V) {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.0.push((key, value)),
        }
    }

    /// Entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No entries.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<V: Serialize> Serialize for OrderedMap<V> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for OrderedMap<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Ordered<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Ordered<V> {
            type Value = OrderedMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                let mut out = OrderedMap::default();
                while let Some((k, v)) = map.next_entry::<String, V>()? {
                    out.insert(k, v);
                }
                Ok(out)
            }
        }
        d.deserialize_map(Ordered(std::marker::PhantomData))
    }
}

/// A number that may be missing: gpu_tracker writes `NaN` (statistics of no samples),
/// which is read here as `null` and kept as NaN; NaN is written as `null`.
fn de_number<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// gpu_tracker's summary statistics of a measure: min, max, mean and the population
/// standard deviation (`std(ddof=0)`). NaN (JSON `null`) when there were no samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Smallest.
    #[serde(deserialize_with = "de_number")]
    pub min: f64,
    /// Largest.
    #[serde(deserialize_with = "de_number")]
    pub max: f64,
    /// Mean.
    #[serde(deserialize_with = "de_number")]
    pub mean: f64,
    /// Population standard deviation.
    #[serde(deserialize_with = "de_number")]
    pub std: f64,
}

impl Stats {
    /// The statistics of `values` (NaN skipped), computed as pandas computes them, to
    /// the last bit: NaN replaced by 0 in place, then numpy's pairwise sums, for the
    /// mean and for the squared deviations. (A sequential sum differs in the last bit
    /// from 8 values on, and a standard deviation of 1e-19 instead of 0 changes the
    /// order in which gpu_tracker's comparison lists sessions.)
    pub fn of(values: impl IntoIterator<Item = f64>) -> Stats {
        let mut xs: Vec<f64> = values.into_iter().collect();
        let count = xs.iter().filter(|x| !x.is_nan()).count();
        if count == 0 {
            return Stats {
                min: f64::NAN,
                max: f64::NAN,
                mean: f64::NAN,
                std: f64::NAN,
            };
        }
        let present: Vec<bool> = xs.iter().map(|x| !x.is_nan()).collect();
        let min = xs
            .iter()
            .copied()
            .filter(|x| !x.is_nan())
            .fold(f64::INFINITY, f64::min);
        let max = xs
            .iter()
            .copied()
            .filter(|x| !x.is_nan())
            .fold(f64::NEG_INFINITY, f64::max);
        for x in &mut xs {
            if x.is_nan() {
                *x = 0.0;
            }
        }
        let n = count as f64;
        let mean = pairwise_sum(&xs) / n;
        let squares: Vec<f64> = xs
            .iter()
            .zip(&present)
            .map(|(x, &p)| if p { (mean - x) * (mean - x) } else { 0.0 })
            .collect();
        let var = pairwise_sum(&squares) / n;
        Stats {
            min,
            max,
            mean,
            std: var.sqrt(),
        }
    }

    /// One statistic.
    pub fn get(&self, statistic: Statistic) -> f64 {
        match statistic {
            Statistic::Min => self.min,
            Statistic::Max => self.max,
            Statistic::Mean => self.mean,
            Statistic::Std => self.std,
        }
    }
}

/// numpy's `add.reduce` of a float64 array: the identity (0.0) plus numpy's pairwise
/// summation (eight running sums over blocks of up to 128 values, halves beyond).
fn pairwise_sum(a: &[f64]) -> f64 {
    const BLOCK: usize = 128;
    let n = a.len();
    if n < 8 {
        let mut res = 0.0;
        for &x in a {
            res += x;
        }
        res
    } else if n <= BLOCK {
        let mut r = [a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]];
        let whole = n - n % 8;
        let mut i = 8;
        while i < whole {
            for (j, acc) in r.iter_mut().enumerate() {
                *acc += a[i + j];
            }
            i += 8;
        }
        let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for &x in &a[whole..] {
            res += x;
        }
        res
    } else {
        let mut half = n / 2;
        half -= half % 8;
        pairwise_sum(&a[..half]) + pairwise_sum(&a[half..])
    }
}

/// A code block's times between its start and its stop: [`Stats`] and their total
/// (in JSON, gpu_tracker's flat `min`, `max`, `mean`, `std`, `total`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ComputeTimeStats {
    /// Shortest, longest and mean call, and their standard deviation.
    #[serde(flatten)]
    pub stats: Stats,
    /// All calls together.
    #[serde(deserialize_with = "de_number")]
    pub total: f64,
}

/// A static-data value as read: text, integer or real.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Scalar {
    /// An integer (core and GPU counts).
    Int(i64),
    /// A real number (capacities).
    Real(f64),
    /// Text (units).
    Text(String),
}

impl Scalar {
    /// Reads a CSV cell as pandas would type it: integer, else real, else text.
    pub(crate) fn parse(text: &str) -> Scalar {
        if let Ok(i) = text.parse::<i64>() {
            Scalar::Int(i)
        } else if let Ok(x) = text.parse::<f64>() {
            Scalar::Real(x)
        } else {
            Scalar::Text(text.to_owned())
        }
    }
}

/// One code block's results (gpu_tracker's `CodeBlockResults`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodeBlockResults {
    /// The block's name.
    pub name: String,
    /// Samples taken while the block ran (a sample counted once).
    pub num_timepoints: usize,
    /// Times the block ran (start/stop pairs).
    pub num_calls: usize,
    /// Calls during which at least one sample was taken.
    pub num_non_empty_calls: usize,
    /// Time per call.
    pub compute_time: ComputeTimeStats,
    /// Every measure's statistics over the block's samples.
    pub resource_usage: OrderedMap<Stats>,
}

/// A tracking session's analysis (gpu_tracker's `SubTrackingResults`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubTrackingResults {
    /// Every measure's statistics over all samples.
    pub overall: OrderedMap<Stats>,
    /// The tracking file's static data (units, capacities, counts).
    pub static_data: OrderedMap<Scalar>,
    /// Each code block, by name.
    pub code_block_results: Vec<CodeBlockResults>,
}

/// One start/stop record of a sub-tracking file.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Event {
    pub(crate) process_id: i64,
    pub(crate) code_block_name: String,
    pub(crate) position: i64,
    pub(crate) timestamp: f64,
}

/// A tracking file's samples.
pub(crate) struct Timepoints {
    pub(crate) static_data: OrderedMap<Scalar>,
    /// Measure names, in the file's order (timestamp excluded).
    pub(crate) measures: Vec<String>,
    /// Per sample: the measures in `measures` order, then the timestamp.
    pub(crate) rows: Vec<Vec<f64>>,
    /// Read from an SQLite database, whose overall statistics gpu_tracker has SQLite
    /// compute (`AVG`, `SQRT(AVG(diff * diff))`) instead of pandas.
    pub(crate) from_sqlite: bool,
}

impl Timepoints {
    fn stats(&self, rows: &[&Vec<f64>]) -> OrderedMap<Stats> {
        self.stats_with(rows, Stats::of)
    }

    /// The statistics over every sample, computed as gpu_tracker computes them for this
    /// kind of file.
    fn overall(&self) -> OrderedMap<Stats> {
        let all: Vec<&Vec<f64>> = self.rows.iter().collect();
        if self.from_sqlite {
            self.stats_with(&all, sqlite_stats)
        } else {
            self.stats_with(&all, Stats::of)
        }
    }

    fn stats_with(
        &self,
        rows: &[&Vec<f64>],
        stats: impl Fn(std::vec::IntoIter<f64>) -> Stats,
    ) -> OrderedMap<Stats> {
        OrderedMap(
            self.measures
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let column: Vec<f64> = rows.iter().map(|r| r[i]).collect();
                    (m.clone(), stats(column.into_iter()))
                })
                .collect(),
        )
    }
}

/// Statistics as SQLite computes gpu_tracker's query over a whole table: `AVG` is a
/// running double sum in row order over the non-NULL values, divided by their count
/// (SQLite 3.40, Python 3.11's; SQLite 3.43 and later add a compensated sum, which can
/// differ in the last bit), and the deviation is `SQRT(AVG(diff * diff))`.
fn sqlite_stats(values: impl IntoIterator<Item = f64>) -> Stats {
    let xs: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
    if xs.is_empty() {
        return Stats::of(xs);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().fold(0.0, |sum, x| sum + x) / n;
    let var = xs.iter().fold(0.0, |sum, x| sum + (x - mean) * (x - mean)) / n;
    Stats {
        min: xs.iter().copied().fold(f64::INFINITY, f64::min),
        max: xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        mean,
        std: var.sqrt(),
    }
}

/// The start/stop pairs of one block, as gpu_tracker pairs them: events sorted by
/// process, time and position; a start left open at a process's end (the block was
/// running when the file was read) dropped; then start, stop, start, stop...
fn timestamp_pairs(path: &Path, events: &[Event], name: &str) -> Result<Vec<(f64, f64)>> {
    let mut mine: Vec<&Event> = events
        .iter()
        .filter(|e| e.code_block_name == name)
        .collect();
    mine.sort_by(|a, b| {
        a.process_id
            .cmp(&b.process_id)
            .then(a.timestamp.total_cmp(&b.timestamp))
            .then(a.position.cmp(&b.position))
    });
    // A process's last event still open: drop it.
    let mut kept = Vec::with_capacity(mine.len());
    for (i, e) in mine.iter().enumerate() {
        let last_of_process = mine.get(i + 1).is_none_or(|n| n.process_id != e.process_id);
        if !(last_of_process && e.position == 0) {
            kept.push(*e);
        }
    }
    let mut pairs = Vec::with_capacity(kept.len() / 2);
    for pair in kept.chunks(2) {
        let [start, stop] = pair else {
            return Err(error(
                path,
                format!(
                    "code block {name:?} of process {} stops at {} without a start",
                    pair[0].process_id, pair[0].timestamp
                ),
            ));
        };
        if start.process_id != stop.process_id || start.position != 0 || stop.position != 1 {
            return Err(error(
                path,
                format!(
                    "code block {name:?}: the events at {} (process {}, position {}) and {} \
                     (process {}, position {}) do not form a start/stop pair; each call must \
                     write a start (0) then a stop (1) in its process",
                    start.timestamp,
                    start.process_id,
                    start.position,
                    stop.timestamp,
                    stop.process_id,
                    stop.position
                ),
            ));
        }
        pairs.push((start.timestamp, stop.timestamp));
    }
    Ok(pairs)
}

/// gpu_tracker's `sub-track analyze --tf TRACKING_FILE --stf SUB_TRACKING_FILE`: the
/// statistics of every measure over all samples, and per code block over the samples
/// taken while it ran (bounds included), with its call times.
pub fn analyze(tracking_file: &Path, sub_tracking_file: &Path) -> Result<SubTrackingResults> {
    let tp = read::timepoints(tracking_file)?;
    let events = read::events(sub_tracking_file)?;
    let ts = tp.measures.len();
    let names: BTreeSet<&str> = events.iter().map(|e| e.code_block_name.as_str()).collect();
    let mut code_block_results = Vec::with_capacity(names.len());
    for name in names {
        let pairs = timestamp_pairs(sub_tracking_file, &events, name)?;
        let within = |t: f64, &(a, b): &(f64, f64)| a <= t && t <= b;
        let rows: Vec<&Vec<f64>> = tp
            .rows
            .iter()
            .filter(|r| pairs.iter().any(|p| within(r[ts], p)))
            .collect();
        let non_empty = pairs
            .iter()
            .filter(|p| rows.iter().any(|r| within(r[ts], p)))
            .count();
        let durations: Vec<f64> = pairs.iter().map(|(a, b)| b - a).collect();
        code_block_results.push(CodeBlockResults {
            name: name.to_owned(),
            num_timepoints: rows.len(),
            num_calls: pairs.len(),
            num_non_empty_calls: non_empty,
            compute_time: ComputeTimeStats {
                stats: Stats::of(durations.iter().copied()),
                total: durations.iter().sum(),
            },
            resource_usage: tp.stats(&rows),
        });
    }
    Ok(SubTrackingResults {
        overall: tp.overall(),
        static_data: tp.static_data,
        code_block_results,
    })
}

/// The statistic a comparison shows (gpu_tracker's `--stat`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Statistic {
    /// Smallest.
    Min,
    /// Largest.
    Max,
    /// Mean (the default).
    #[default]
    Mean,
    /// Population standard deviation.
    Std,
}

impl FromStr for Statistic {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "min" => Ok(Statistic::Min),
            "max" => Ok(Statistic::Max),
            "mean" => Ok(Statistic::Mean),
            "std" => Ok(Statistic::Std),
            other => Err(Error::InvalidStatistic {
                value: other.to_owned(),
            }),
        }
    }
}

impl SubTrackingResults {
    /// Reads results written as JSON by `sub-track analyze --format json` (ours or
    /// gpu_tracker's, whose `NaN` is read as a missing number). A pickle is refused
    /// with the command that writes JSON instead.
    pub fn load(path: &Path) -> Result<SubTrackingResults> {
        let bytes = std::fs::read(path).map_err(|e| error(path, e.to_string()))?;
        let pickled = bytes.first() == Some(&0x80)
            || path
                .extension()
                .is_some_and(|e| e == "pkl" || e == "pickle");
        if pickled {
            return Err(error(
                path,
                "a pickle is not read (loading one can run any code, and gpu_tracker's holds \
                 pandas objects): write the analysis as JSON with `sub-track analyze ... \
                 --format json --output FILE.json` (gpu-tracker's or torchtools') and \
                 compare those",
            ));
        }
        let text = String::from_utf8_lossy(&bytes);
        serde_json::from_str(&read::nan_to_null(&text)).map_err(|e| {
            error(
                path,
                format!(
                    "{e}: expected the JSON of `sub-track analyze --format json` (torchtools' \
                     or gpu-tracker's)"
                ),
            )
        })
    }

    /// gpu_tracker's JSON (`json.dumps(indent=1)`), NaN written as `null`, ending with
    /// a newline.
    pub fn to_json(&self) -> String {
        text::pretty_json(self)
    }
}

/// Sessions compared (gpu_tracker's `ComparisonResults`): per measure, then per code
/// block, the chosen statistic of each session, smallest first.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    /// Measure -> session -> value.
    pub overall_resource_usage: OrderedMap<OrderedMap<f64>>,
    /// Measure -> code block -> session -> value.
    pub code_block_resource_usage: OrderedMap<OrderedMap<OrderedMap<f64>>>,
    /// Code block -> session -> compute time.
    pub code_block_compute_time: OrderedMap<OrderedMap<f64>>,
}

impl Comparison {
    /// gpu_tracker's JSON, NaN as `null`, ending with a newline.
    pub fn to_json(&self) -> String {
        text::pretty_json(self)
    }
}

/// A `path:line` block name (gpu_tracker's default names) split into its place and its
/// line number.
fn place_and_line(name: &str) -> Option<(&str, &str)> {
    let (place, line) = name.rsplit_once(':')?;
    line.parse::<i64>().ok().map(|_| (place, line))
}

/// Blocks in gpu_tracker's comparison order: by name, line numbers compared as numbers.
fn sorted_blocks(results: &SubTrackingResults) -> Vec<&CodeBlockResults> {
    let width = results
        .code_block_results
        .iter()
        .filter_map(|b| place_and_line(&b.name).map(|(_, line)| line.len()))
        .max()
        .unwrap_or(0);
    let key = |name: &str| match place_and_line(name) {
        Some((place, line)) => format!("{place}:{line:0>width$}"),
        None => name.to_owned(),
    };
    let mut blocks: Vec<&CodeBlockResults> = results.code_block_results.iter().collect();
    blocks.sort_by_cached_key(|b| key(&b.name));
    blocks
}

fn ascending(mut values: Vec<(String, f64)>) -> OrderedMap<f64> {
    // pandas' sort_values: NaN last.
    values.sort_by(|a, b| match (a.1.is_nan(), b.1.is_nan()) {
        (false, false) => a.1.total_cmp(&b.1),
        (x, y) => x.cmp(&y),
    });
    OrderedMap(values)
}

/// gpu_tracker's `sub-track compare -m NAME=FILE... --stat STATISTIC`: sessions (in the
/// order given, their names distinct: the command line lets a later `-m NAME=` replace
/// an earlier one) compared measure by measure and code block by code block. Blocks are matched by name in sorted order;
/// names that differ only in their line number (`train.py:12` and `train.py:14`) match,
/// with a warning, as in gpu_tracker. `paths` name the sessions' files in errors.
pub fn compare(
    sessions: &[(String, SubTrackingResults, PathBuf)],
    statistic: Statistic,
) -> Result<Comparison> {
    let Some((i1, first)) = sessions
        .iter()
        .enumerate()
        .min_by(|a, b| a.1 .0.cmp(&b.1 .0))
    else {
        return Err(error(
            Path::new("-m"),
            "no session to compare: give -m NAME=FILE.json (twice or more) or --cconfig",
        ));
    };
    let sorted: Vec<Vec<&CodeBlockResults>> =
        sessions.iter().map(|s| sorted_blocks(&s.1)).collect();
    let blocks1 = &sorted[i1];
    same_blocks(sessions, &sorted, i1)?;
    let mut overall = OrderedMap::default();
    let mut per_block = OrderedMap::default();
    for measure in first.1.overall.keys() {
        let mut values = Vec::with_capacity(sessions.len());
        for (name, results, path) in sessions {
            let stats = results.overall.get(measure).ok_or_else(|| {
                error(
                    path,
                    format!("session {name:?} has no overall {measure:?} to compare"),
                )
            })?;
            values.push((name.clone(), stats.get(statistic)));
        }
        overall.insert(measure.to_owned(), ascending(values));
        if !blocks1.is_empty() {
            let mut blocks = OrderedMap::default();
            for i in 0..blocks1.len() {
                let mut values = Vec::with_capacity(sessions.len());
                for ((name, _, path), sorted) in sessions.iter().zip(&sorted) {
                    let stats = sorted[i].resource_usage.get(measure).ok_or_else(|| {
                        error(
                            path,
                            format!(
                                "code block {:?} of session {name:?} has no {measure:?}",
                                sorted[i].name
                            ),
                        )
                    })?;
                    values.push((name.clone(), stats.get(statistic)));
                }
                blocks.insert(block_key(&sorted, i), ascending(values));
            }
            per_block.insert(measure.to_owned(), blocks);
        }
    }
    let mut times = OrderedMap::default();
    for i in 0..blocks1.len() {
        let values = sessions
            .iter()
            .zip(&sorted)
            .map(|((name, ..), sorted)| (name.clone(), sorted[i].compute_time.stats.get(statistic)))
            .collect();
        times.insert(block_key(&sorted, i), ascending(values));
    }
    Ok(Comparison {
        overall_resource_usage: overall,
        code_block_resource_usage: per_block,
        code_block_compute_time: times,
    })
}

/// Every session has the blocks of session `i1` (the first by name), in the same
/// order: named alike, or differing only by line number (then said in a warning).
fn same_blocks(
    sessions: &[(String, SubTrackingResults, PathBuf)],
    sorted: &[Vec<&CodeBlockResults>],
    i1: usize,
) -> Result<()> {
    let first = &sessions[i1];
    let blocks1 = &sorted[i1];
    for ((name, _, path), blocks) in sessions.iter().zip(sorted) {
        if blocks.len() != blocks1.len() {
            return Err(error(
                path,
                format!(
                    "session {name:?} has {} code blocks but {:?} has {}: every session must \
                     have the same code blocks",
                    blocks.len(),
                    first.0,
                    blocks1.len()
                ),
            ));
        }
        for (b1, b) in blocks1.iter().zip(blocks) {
            if b1.name == b.name {
                continue;
            }
            let same_place = match (place_and_line(&b1.name), place_and_line(&b.name)) {
                (Some((p1, _)), Some((p, _))) => p1 == p,
                _ => false,
            };
            if !same_place {
                return Err(error(
                    path,
                    format!(
                        "code block {:?} of session {:?} does not match code block {:?} of \
                         session {name:?}: name the blocks alike in every session",
                        b1.name, first.0, b.name
                    ),
                ));
            }
            tracing::warn!(
                "code block {:?} of session {:?} matched with {:?} of session {name:?}: they \
                 differ only by line number; if they are different blocks, name them",
                b1.name,
                first.0,
                b.name
            );
        }
    }
    Ok(())
}

/// The names of the i-th block of every session, distinct, sorted, joined by " -> ".
fn block_key(sorted: &[Vec<&CodeBlockResults>], i: usize) -> String {
    let names: BTreeSet<&str> = sorted.iter().map(|s| s[i].name.as_str()).collect();
    names.into_iter().collect::<Vec<_>>().join(" -> ")
}

impl fmt::Display for SubTrackingResults {
    /// gpu_tracker's text layout.
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(&text::results(self))
    }
}

impl fmt::Display for Comparison {
    /// gpu_tracker's text layout.
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(&text::comparison(self))
    }
}

#[cfg(test)]
mod tests {
    use super::{pairwise_sum, OrderedMap};

    /// Sub-tracking results read back from JSON keep their keys in file order; anything
    /// but an object where a map belongs is refused, saying what was expected.
    #[test]
    fn ordered_maps_read_back_in_file_order_and_refuse_non_objects() {
        let m: OrderedMap<f64> =
            serde_json::from_str(r#"{"z": 1.0, "a": 2.0}"#).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(m.0, [("z".to_owned(), 1.0), ("a".to_owned(), 2.0)]);
        let e = serde_json::from_str::<OrderedMap<f64>>("[1.0]")
            .map(|m| m.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected a JSON object"), "{e}");
    }

    #[test]
    fn sums_are_numpys_to_the_last_bit() {
        // Sizes around each branch (under 8, one block of 8..=128, halves beyond), in
        // patterns where the order of additions shows: 1e16 absorbs a lone 1.0 (its
        // neighbours are 2 apart), so sums of ones first keep them; and uneven values.
        let sizes = [
            1, 2, 7, 8, 9, 15, 16, 17, 127, 128, 129, 255, 256, 257, 1000,
        ];
        let value = |pattern: &str, i: usize| -> f64 {
            match pattern {
                "a" if i % 7 == 0 => 1e16,
                "a" => 1.0 + (i % 3) as f64 * 0.1,
                "c" => ((i * 7919) % 1009) as f64 / 7.0 * [1.0, 10.0, 100.0][i % 3],
                _ if i % 8 == 0 => 1e16,
                _ => 1.0,
            }
        };
        let cases: Vec<(&str, usize)> = ["a", "b", "c"]
            .iter()
            .flat_map(|p| sizes.iter().map(move |n| (*p, *n)))
            .collect();
        let script = "import numpy as np, sys\n\
                      def value(p, i):\n\
                      \x20   if p == 'a':\n\
                      \x20       return 1e16 if i % 7 == 0 else 1.0 + (i % 3) * 0.1\n\
                      \x20   if p == 'c':\n\
                      \x20       return (i * 7919 % 1009) / 7.0 * [1.0, 10.0, 100.0][i % 3]\n\
                      \x20   return 1e16 if i % 8 == 0 else 1.0\n\
                      for case in sys.argv[1:]:\n\
                      \x20   p, n = case.split(':')\n\
                      \x20   a = np.array([value(p, i) for i in range(int(n))], np.float64)\n\
                      \x20   print(repr(float(np.add.reduce(a))))";
        let args: Vec<String> = cases.iter().map(|(p, n)| format!("{p}:{n}")).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = tt_testkit::run_python(script, &args);
        let theirs: Vec<f64> = out
            .lines()
            .map(|l| l.parse().unwrap_or_else(|e| panic!("{l:?}: {e}")))
            .collect();
        assert_eq!(theirs.len(), cases.len(), "{out}");
        let mut order_shows = false;
        for ((p, n), want) in cases.iter().zip(theirs) {
            let v: Vec<f64> = (0..*n).map(|i| value(p, i)).collect();
            let ours = pairwise_sum(&v);
            assert_eq!(
                ours.to_bits(),
                want.to_bits(),
                "{p}:{n}: {ours} vs numpy {want}"
            );
            order_shows |= v.iter().fold(0.0, |a, x| a + x).to_bits() != ours.to_bits();
        }
        // A plain left-to-right sum differs for some case: the cases can tell.
        assert!(order_shows);
    }
}

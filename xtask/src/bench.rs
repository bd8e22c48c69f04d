//! `cargo xtask bench`: measured numbers, one table, ratios against named baselines.
//!
//! - `torchtools devices --json` (release build, no libtorch) against the Python
//!   torchtools way of choosing a device (`import torch; torch.cuda.is_available()`),
//!   in the venv of `cargo xtask setup`.
//! - A libtorch program's first lines (`examples/device_from_env`: the report, the
//!   selection and one tensor operation on the device) against the same Python
//!   baseline: the cost of choosing a device from Rust with libtorch loaded.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::setup::Libtorch;
use crate::steps::{self, cargo};

/// The crates' own benchmarks in the table: (crate, bench, the optional feature it
/// needs). Each crate's README shows its rows (the root package's, `torchtools`, are in
/// README.md's table alone).
pub(crate) const BENCHES: [(&str, &str, Option<&str>); 10] = [
    ("tt-sampler", "sampler", None),
    ("tt-ckpt", "ckpt", None),
    ("tt-lock", "lock", None),
    ("torchtools-cli", "serve", None),
    ("tt-tracker", "tracker", None),
    ("tt-adaptive", "adaptive", None),
    ("tt-probe", "probe", None),
    ("tt-dist", "dist", Some("c10d")),
    ("tt-train", "trainer", Some("dist")),
    // The two real models of `examples/models` on the CPU (the root package's bench).
    ("torchtools", "models", Some("dist")),
];

/// Median wall time of `runs` runs of `cmd` (after one warm-up run).
fn median_time(mut make: impl FnMut() -> Command, runs: usize) -> Result<Duration> {
    let mut times = Vec::with_capacity(runs);
    for i in 0..=runs {
        let mut cmd = make();
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
        let start = Instant::now();
        let status = cmd
            .status()
            .with_context(|| format!("cannot start {cmd:?}"))?;
        let t = start.elapsed();
        if !status.success() {
            bail!("{cmd:?} failed ({status})");
        }
        if i > 0 {
            times.push(t);
        }
    }
    Ok(tt_testkit::bench::median(times))
}

pub(crate) fn run() -> Result<()> {
    let libtorch = crate::setup::setup()?;
    let python = match &libtorch {
        Libtorch::Cached { venv } => venv.join("bin/python"),
        Libtorch::User => {
            PathBuf::from(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
        }
    };
    steps::run(
        "build the CLI (release)",
        cargo(&["build", "--release", "-p", "torchtools-cli"]),
    )?;
    steps::run(
        "build device_from_env (release)",
        cargo(&[
            "build",
            "--release",
            "-p",
            "torchtools",
            "--example",
            "device_from_env",
        ]),
    )?;
    // The tracker's baseline: in our venv already (setup), into a user's Python here.
    if matches!(libtorch, Libtorch::User) {
        steps::run("pip install gpu-tracker (tt-tracker's baseline)", {
            let mut c = Command::new(&python);
            c.args(["-m", "pip", "install", "--quiet", crate::setup::GPU_TRACKER]);
            c
        })?;
    }
    let root = crate::root();
    let cli = root.join("target/release/torchtools");
    let first_lines = root.join("target/release/examples/device_from_env");

    let baseline = median_time(
        || {
            let mut c = Command::new(&python);
            c.args([
                "-c",
                "import torch; torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
            ]);
            c
        },
        5,
    )?;
    let ours_cli = median_time(
        || {
            let mut c = Command::new(&cli);
            c.args(["devices", "--json"]);
            c
        },
        30,
    )?;
    let ours_demo = median_time(|| Command::new(&first_lines), 5)?;

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let python_name = "python: import torch + is_available";
    let mut rows = vec![
        Row::new(
            "torchtools-cli",
            "torchtools devices --json (CLI, no libtorch)",
            ms(ours_cli),
            python_name,
            ms(baseline),
            "ms",
            false,
        ),
        Row::new(
            "torchtools",
            "device_from_env: report + select + a tensor op",
            ms(ours_demo),
            python_name,
            ms(baseline),
            "ms",
            false,
        ),
    ];
    for (krate, bench, feature) in BENCHES {
        rows.extend(crate_rows(krate, bench, feature)?);
    }
    write_tables(&rows)
}

/// Prints the table, writes it as Markdown into `target/bench.md`, and into the
/// READMEs: the whole table into the workspace's, each crate's rows into its own.
fn write_tables(rows: &[Row]) -> Result<()> {
    let root = crate::root();
    println!("\nbenchmark table (medians; ratio > 1 means torchtools is better)");
    println!(
        "{:<50} {:>10} {:<36} {:>10} {:>6} {:>7}",
        "what", "ours", "baseline", "baseline", "unit", "ratio"
    );
    for r in rows {
        println!(
            "{:<50} {:>10.1} {:<36} {:>10.1} {:>6} {:>6.1}x",
            r.what,
            r.ours,
            r.baseline_name,
            r.baseline,
            r.unit,
            r.ratio()
        );
    }
    let (machine, date) = (machine(), today());
    let md = markdown(rows, &machine, &date);
    let path = root.join("target/bench.md");
    std::fs::write(&path, &md).with_context(|| format!("cannot write {}", path.display()))?;
    println!("\nthe same as Markdown: {}", path.display());
    // The READMEs' tables are this run's, written here: never edited by hand.
    let mut readmes = vec![(root.join("README.md"), md)];
    let mut krates: Vec<&str> = rows.iter().map(|r| r.krate.as_str()).collect();
    krates.dedup();
    for krate in krates.into_iter().filter(|k| *k != "torchtools") {
        let own: Vec<&Row> = rows.iter().filter(|r| r.krate == krate).collect();
        let path = root.join("crates").join(krate).join("README.md");
        readmes.push((path, markdown(own, &machine, &date)));
    }
    for (path, table) in readmes {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let text = replace_table(&text, &table)
            .with_context(|| format!("{}: where does the table go?", path.display()))?;
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
        println!("table written into {}", path.display());
    }
    Ok(())
}

/// The line before a README's benchmark table, which `cargo xtask bench` writes.
pub(crate) const TABLE_BEGIN: &str = "<!-- cargo xtask bench writes this table: do not edit -->";
/// The line after it.
pub(crate) const TABLE_END: &str = "<!-- end of cargo xtask bench's table -->";

/// `text` with the table between its markers replaced by `table`.
fn replace_table(text: &str, table: &str) -> Result<String> {
    let (Some(begin), Some(end)) = (text.find(TABLE_BEGIN), text.find(TABLE_END)) else {
        bail!("no lines {TABLE_BEGIN} and {TABLE_END} around its benchmark table");
    };
    if end < begin {
        bail!("{TABLE_END} comes before {TABLE_BEGIN}");
    }
    let from = begin + TABLE_BEGIN.len();
    Ok(format!("{}\n\n{}\n{}", &text[..from], table, &text[end..]))
}

/// The table as Markdown, headed by the machine and the date it was measured on.
fn markdown<'a>(rows: impl IntoIterator<Item = &'a Row>, machine: &str, date: &str) -> String {
    let mut out = format!(
        "`cargo xtask bench` on {machine}, {date} (medians; a ratio above 1 means \
         torchtools is better):\n\n\
         | what | torchtools | baseline | baseline value | unit | ratio |\n\
         |---|---|---|---|---|---|\n"
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {}x |\n",
            r.what.replace('|', "\\|"),
            figure(r.ours),
            r.baseline_name.replace('|', "\\|"),
            figure(r.baseline),
            r.unit,
            figure(r.ratio())
        ));
    }
    out
}

/// A figure with three significant digits (0.25 stays 0.25, 1494.1 is 1494): one
/// decimal place turned a goal of 0.25 s into "0.2".
fn figure(x: f64) -> String {
    if !x.is_finite() || x == 0.0 {
        return format!("{x}");
    }
    let digits = (2 - x.abs().log10().floor() as i32).max(0) as usize;
    format!("{x:.digits$}")
}

/// This machine in words: its CPU model, cores and memory (from /proc).
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpu
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("an unknown CPU", |(_, m)| m.trim())
        .to_owned();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(String::new(), |kb| {
            format!(", {} GiB", (kb + (1 << 19)) >> 20)
        });
    format!("{cores} cores of {model}{mem}")
}

/// Today's date (UTC), as `date -u +%F` prints it.
fn today() -> String {
    Command::new("date")
        .args(["-u", "+%F"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| "(date unknown)".into())
}

/// One line of the table.
struct Row {
    /// The package measured: its README shows the row too.
    krate: String,
    what: String,
    ours: f64,
    baseline_name: String,
    baseline: f64,
    unit: String,
    higher_is_better: bool,
}

impl Row {
    /// Ours against the baseline, oriented so that above 1 is better for us.
    fn ratio(&self) -> f64 {
        if self.higher_is_better {
            self.ours / self.baseline
        } else {
            self.baseline / self.ours
        }
    }

    fn new(
        krate: &str,
        what: &str,
        ours: f64,
        baseline_name: &str,
        baseline: f64,
        unit: &str,
        higher_is_better: bool,
    ) -> Row {
        Row {
            krate: krate.into(),
            what: what.into(),
            ours,
            baseline_name: baseline_name.into(),
            baseline,
            unit: unit.into(),
            higher_is_better,
        }
    }
}

/// Runs a crate's own benchmark, which prints `row|what|ours|baseline name|baseline|unit|higher|lower`.
fn crate_rows(krate: &str, bench: &str, feature: Option<&str>) -> Result<Vec<Row>> {
    let mut args = vec!["bench", "--quiet", "-p", krate, "--bench", bench];
    if let Some(feature) = feature {
        args.extend(["--features", feature]);
    }
    let out = cargo(&args)
        .stderr(Stdio::inherit())
        .output()
        .context("cargo bench did not start")?;
    if !out.status.success() {
        bail!("the {krate} benchmark failed");
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut rows = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split('|').collect();
        match f.as_slice() {
            ["row", what, ours, name, base, unit, better] => rows.push(Row::new(
                krate,
                what,
                ours.parse().context("benchmark row: ours")?,
                name,
                base.parse().context("benchmark row: baseline")?,
                unit,
                *better == "higher",
            )),
            _ => println!("{line}"),
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_markdown_table_names_the_machine_and_orients_ratios() {
        let rows = [
            Row::new("k", "a | b", 2.0, "base", 4.0, "ms", false),
            Row::new("k", "rate", 3.0, "theirs", 1.5, "GB/s", true),
        ];
        let md = markdown(&rows, "2 cores of X", "2026-11-26");
        assert!(
            md.starts_with("`cargo xtask bench` on 2 cores of X, 2026-11-26"),
            "{md}"
        );
        assert!(
            md.contains("| a \\| b | 2.00 | base | 4.00 | ms | 2.00x |"),
            "{md}"
        );
        assert!(
            md.contains("| rate | 3.00 | theirs | 1.50 | GB/s | 2.00x |"),
            "{md}"
        );
        assert_eq!(figure(0.25), "0.250");
        assert_eq!(figure(1494.1), "1494");
        assert_eq!(figure(18.34), "18.3");
        assert!(machine().contains("cores of"));
    }

    #[test]
    fn tables_are_written_between_their_markers_only() {
        let text = format!("# x\n\nbefore\n{TABLE_BEGIN}\n\nold | table\n\n{TABLE_END}\nafter\n");
        let new = replace_table(&text, "| new |\n").unwrap();
        assert_eq!(
            new,
            format!("# x\n\nbefore\n{TABLE_BEGIN}\n\n| new |\n\n{TABLE_END}\nafter\n")
        );
        assert_eq!(replace_table(&new, "| new |\n").unwrap(), new, "idempotent");
        assert!(replace_table("no markers", "t").is_err());
        assert!(replace_table(&format!("{TABLE_END} {TABLE_BEGIN}"), "t").is_err());
    }
}

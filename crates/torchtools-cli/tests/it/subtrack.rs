//! `torchtools track sub-track analyze | combine | compare` against gpu_tracker 5.0.1's
//! own commands on the same files: a tracked Python program (two processes) whose
//! code blocks are written by gpu_tracker's `SubTracker`, our CSV and SQLite timelines.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// A program sub-tracked by gpu_tracker's `SubTracker` in itself and in a child
/// process, each in its own file (`b<pid>.<ext>`). Blocks `work` (twice) and `hold`
/// last until the tracking file has grown by two samples, so each holds a sample
/// whatever the machine's load; `blink` is empty on CSV (statistics of no sample).
const PROGRAM: &str = r#"
import os, sys, time, sqlite3, subprocess
import gpu_tracker as gt
tf, ext = sys.argv[1], sys.argv[2]
child = len(sys.argv) > 3

def rows():
    if ext == 'csv':
        with open(tf) as f:
            return sum(1 for _ in f)
    for _ in range(10000):
        try:
            c = sqlite3.connect(f'file:{tf}?mode=ro', uri=True, timeout=5)
            n = c.execute('SELECT COUNT(*) FROM data').fetchone()[0]
            c.close()
            return n
        except sqlite3.OperationalError:
            time.sleep(0.01)
    sys.exit(f'cannot read {tf}')

def hold():
    start, deadline = rows(), time.time() + 300
    while rows() < start + 2:
        if time.time() > deadline:
            sys.exit('no sample recorded in 300 s')
        time.sleep(0.01)

stf = f'b{os.getpid()}.{ext}'
p = None if child else subprocess.Popen([sys.executable, __file__, tf, ext, 'child'])
for _ in range(2):
    with gt.SubTracker(code_block_name='work', sub_tracking_file=stf):
        x = bytearray(20_000_000)
        hold()
with gt.SubTracker(code_block_name='hold', sub_tracking_file=stf):
    hold()
with gt.SubTracker(code_block_name='blink', sub_tracking_file=stf):
    if ext == 'sqlite':
        hold()  # gpu_tracker's analysis fails on an SQLite block without samples
if p is not None:
    sys.exit(p.wait())
"#;

fn torchtools(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// `torchtools track sub-track ARGS` in `dir`.
fn sub_track(dir: &Path, args: &[&str]) -> Output {
    torchtools(dir, &[&["track", "sub-track"], args].concat())
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn refused(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(needle), "{needle}: {err}");
}

/// gpu_tracker's command line (`python -m gpu_tracker ARGS`), run in `dir`.
fn gpu_tracker(dir: &Path, args: &[&str]) -> String {
    let out = tt_testkit::python()
        .current_dir(dir)
        .args(["-W", "ignore", "-m", "gpu_tracker"])
        .args(args)
        .output()
        .unwrap();
    ok(&out)
}

/// Runs the program under `torchtools track` with a timeline `t.<ext>` in a fresh
/// directory; returns the directory and the two processes' sub-tracking files.
fn tracked_run(root: &Path, ext: &str) -> (PathBuf, Vec<PathBuf>) {
    let dir = root.join(ext);
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("program.py"), PROGRAM).unwrap();
    let tf = format!("t.{ext}");
    let out = torchtools(
        &dir,
        &[
            "track",
            "--interval",
            "20ms",
            "--timeline",
            &tf,
            "--",
            &tt_testkit::python_path(),
            "program.py",
            &tf,
            ext,
        ],
    );
    ok(&out);
    let mut blocks: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with('b') && name.ends_with(&format!(".{ext}"))
        })
        .collect();
    blocks.sort();
    assert_eq!(blocks.len(), 2, "one sub-tracking file per process");
    (dir, blocks)
}

/// The records of a CSV sub-tracking file, sorted (combining keeps every one).
fn records(path: &Path) -> Vec<String> {
    let mut lines: Vec<String> = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .skip(1)
        .map(str::to_owned)
        .collect();
    lines.sort();
    lines
}

/// Two JSON values equal, numbers within 1e-9 relative plus 1e-12 (the sums' order
/// differs: a standard deviation of equal values is 1e-16 on one side, 0 on the other).
fn same_json(a: &serde_json::Value, b: &serde_json::Value, path: &str) {
    use serde_json::Value::*;
    match (a, b) {
        (Object(x), Object(y)) => {
            let (mut kx, mut ky): (Vec<_>, Vec<_>) = (x.keys().collect(), y.keys().collect());
            kx.sort();
            ky.sort();
            assert_eq!(kx, ky, "keys of {path}");
            for k in x.keys() {
                same_json(&x[k], &y[k], &format!("{path}.{k}"));
            }
        }
        (Array(x), Array(y)) => {
            assert_eq!(x.len(), y.len(), "length of {path}");
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                same_json(p, q, &format!("{path}[{i}]"));
            }
        }
        (Number(p), Number(q)) => {
            let (p, q) = (p.as_f64().unwrap(), q.as_f64().unwrap());
            assert!(
                (p - q).abs() <= 1e-9 * p.abs().max(q.abs()) + 1e-12,
                "{path}: {p} vs {q}"
            );
        }
        _ => assert_eq!(a, b, "{path}"),
    }
}

/// gpu_tracker's JSON, its `NaN` read as null (as ours writes it).
fn python_json(text: &str) -> serde_json::Value {
    serde_json::from_str(&text.replace("NaN", "null")).unwrap()
}

#[test]
fn analyze_combine_and_compare_match_gpu_trackers_own_commands() {
    let tmp = tempfile::tempdir().unwrap();
    for ext in ["csv", "sqlite"] {
        let (dir, blocks) = tracked_run(tmp.path(), ext);
        let names: Vec<String> = blocks
            .iter()
            .map(|b| b.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        // combine: both tools, the same records; ours from a directory too.
        let theirs = format!("theirs.{ext}");
        let ours = format!("ours.{ext}");
        gpu_tracker(
            &dir,
            &[
                "sub-track",
                "combine",
                &format!("--stf={theirs}"),
                "-p",
                &names[0],
                "-p",
                &names[1],
            ],
        );
        ok(&sub_track(
            &dir,
            &["combine", "--stf", &ours, "-p", &names[0], &names[1]],
        ));
        let blocks_dir = dir.join("blocks");
        std::fs::create_dir(&blocks_dir).unwrap();
        for n in &names {
            std::fs::copy(dir.join(n), blocks_dir.join(n)).unwrap();
        }
        std::fs::write(blocks_dir.join("README"), "not a sub-tracking file").unwrap();
        let from_dir = format!("from_dir.{ext}");
        ok(&sub_track(
            &dir,
            &["combine", "--stf", &from_dir, "-p", "blocks"],
        ));
        // Combining never replaces a file.
        let again = sub_track(&dir, &["combine", "--stf", &ours, "-p", &names[0]]);
        refused(&again, "already exists");
        // analyze: the same text, line for line, and the same JSON, on either tool's
        // combined file.
        let tf = format!("--tf=t.{ext}");
        for stf in [&theirs, &ours, &from_dir] {
            let stf = format!("--stf={stf}");
            let their_text = gpu_tracker(&dir, &["sub-track", "analyze", &tf, &stf]);
            let our_text = ok(&sub_track(&dir, &["analyze", &tf, &stf]));
            assert_eq!(our_text, their_text, "{ext} {stf}: text");
            let their_json =
                gpu_tracker(&dir, &["sub-track", "analyze", &tf, &stf, "--format=json"]);
            let our_json = ok(&sub_track(&dir, &["analyze", &tf, &stf, "--format=json"]));
            same_json(
                &serde_json::from_str(&our_json).unwrap(),
                &python_json(&their_json),
                "",
            );
        }
        let ours_json: serde_json::Value = serde_json::from_str(&ok(&sub_track(
            &dir,
            &["analyze", &tf, &format!("--stf={ours}"), "-f", "json"],
        )))
        .unwrap();
        let results = ours_json["code_block_results"].as_array().unwrap();
        let work = results.iter().find(|b| b["name"] == "work").unwrap();
        assert_eq!(work["num_calls"], 4, "two calls in each process: {work}");
        assert_eq!(
            work["num_non_empty_calls"], 4,
            "each call held samples: {work}"
        );
        if ext == "csv" {
            assert_eq!(records(&dir.join(&ours)), records(&dir.join(&theirs)));
            let blink = results.iter().find(|b| b["name"] == "blink").unwrap();
            assert_eq!(blink["num_timepoints"], 0, "{blink}");
            assert!(blink["resource_usage"]["main_ram"]["mean"].is_null());
        }
        // Results for the comparison: gpu_tracker's pickle and JSON, and our JSON.
        for (tool, format) in [("gt", "pickle"), ("gt", "json"), ("tt", "json")] {
            let out = format!("--output=../{tool}_{ext}.{format}");
            let args = [
                "sub-track",
                "analyze",
                &tf,
                &format!("--stf={theirs}"),
                &out,
            ];
            let format = format!("--format={format}");
            if tool == "gt" {
                gpu_tracker(&dir, &[&args[..], &[&format]].concat());
            } else {
                ok(&torchtools(
                    &dir,
                    &[&["track"], &args[..], &[&format]].concat(),
                ));
            }
        }
    }
    // compare: gpu_tracker's on its pickles; ours on its JSON and ours mixed, the same
    // text and JSON, whatever the statistic.
    let root = tmp.path();
    for stat in ["mean", "max", "std"] {
        let stat = format!("--stat={stat}");
        let theirs = gpu_tracker(
            root,
            &[
                "sub-track",
                "compare",
                "-m",
                "a=gt_csv.pickle",
                "-m",
                "b=gt_sqlite.pickle",
                &stat,
            ],
        );
        for (a, b) in [
            ("gt_csv.json", "gt_sqlite.json"),
            ("gt_csv.json", "tt_sqlite.json"),
        ] {
            let (ma, mb) = (format!("a={a}"), format!("b={b}"));
            let args = ["compare", "-m", &ma, "-m", &mb, &stat];
            assert_eq!(ok(&sub_track(root, &args)), theirs, "{a} {b} {stat}");
        }
        let their_json = gpu_tracker(
            root,
            &[
                "sub-track",
                "compare",
                "-m",
                "a=gt_csv.pickle",
                "-m",
                "b=gt_sqlite.pickle",
                &stat,
                "-f",
                "json",
            ],
        );
        let our_json = ok(&sub_track(
            root,
            &[
                "compare",
                "-m",
                "a=gt_csv.json",
                "b=tt_sqlite.json",
                &stat,
                "-f",
                "json",
            ],
        ));
        same_json(
            &serde_json::from_str(&our_json).unwrap(),
            &python_json(&their_json),
            &stat,
        );
    }
    // --cconfig as gpu_tracker reads it; -m adds to it; --stat overrides it.
    std::fs::write(
        root.join("c.json"),
        r#"{"file_path_map": {"a": "gt_csv.json"}, "statistic": "max"}"#,
    )
    .unwrap();
    let with_config = ok(&sub_track(
        root,
        &["compare", "--cconfig", "c.json", "-m", "b=tt_sqlite.json"],
    ));
    let spelled_out = ok(&sub_track(
        root,
        &[
            "compare",
            "-m",
            "a=gt_csv.json",
            "b=tt_sqlite.json",
            "--stat",
            "max",
        ],
    ));
    assert_eq!(with_config, spelled_out);
    // A pickle is refused with the way to JSON; so is writing one; other bad input too.
    let compare = |args: &[&str]| sub_track(root, &[&["compare"], args].concat());
    refused(
        &compare(&["-m", "a=gt_csv.pickle", "-m", "b=tt_sqlite.json"]),
        "--format json",
    );
    refused(
        &compare(&["-m", "a=gt_csv.json", "-f", "pickle"]),
        "use --format json",
    );
    refused(&compare(&["-m", "gt_csv.json"]), "NAME=FILE");
    refused(&compare(&[]), "no session to compare");
    refused(&compare(&["-m", "a=missing.json"]), "missing.json");
    refused(
        &compare(&["-m", "a=gt_csv.json", "-o", "no/such/dir/c.txt"]),
        "does not exist",
    );
    let analyze = sub_track(
        root,
        &["analyze", "--tf", "csv/t.csv", "--stf", "csv/t.xlsx"],
    );
    refused(&analyze, "*.csv, *.sqlite or *.jsonl");
}

#[test]
fn our_own_blocks_and_jsonl_timelines_are_analysed_too() {
    // Blocks written by our tracker itself (Tracker::block) in a JSON Lines timeline,
    // which holds them: the analysis needs no second file.
    let tmp = tempfile::tempdir().unwrap();
    let tl = tmp.path().join("t.jsonl");
    let tracker = tt_tracker::Tracker::start(tt_tracker::TrackerConfig {
        interval: std::time::Duration::from_millis(10),
        timeline: Some(tl.clone()),
        ..Default::default()
    })
    .unwrap();
    for _ in 0..3 {
        let _b = tracker.block("step");
        let start = tracker.samples();
        while tracker.samples() < start + 2 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    let usage = tracker.stop().unwrap();
    let t = tl.to_str().unwrap();
    let out = ok(&sub_track(
        tmp.path(),
        &["analyze", "--tf", t, "--stf", t, "-f", "json"],
    ));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let step = &v["code_block_results"][0];
    assert_eq!(
        (step["name"].as_str(), step["num_calls"].as_u64()),
        (Some("step"), Some(3))
    );
    assert_eq!(step["num_non_empty_calls"], 3, "{step}");
    // The same statistics as the report's own block summary.
    let ours = &usage.torchtools.blocks[0];
    let main_ram = &step["resource_usage"]["main_ram"];
    assert_eq!(
        main_ram["max"].as_f64(),
        Some(ours.measures["main_ram"].max)
    );
    assert_eq!(step["num_timepoints"].as_u64(), Some(ours.samples));
    assert_eq!(v["static_data"]["ram_unit"], "gigabytes");
    assert_eq!(
        v["overall"].as_object().unwrap().len(),
        21,
        "every measure of a sample"
    );
}

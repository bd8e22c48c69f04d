//! gpu_tracker's sub-tracking analysis in Rust, on files with known contents (in both
//! tools' layouts), each figure checked by hand and against gpu_tracker 5.0.1 itself.

use std::path::{Path, PathBuf};

use tt_tracker::subtrack::{self, Statistic, Stats, SubTrackingResults};

const STATIC: &str = "ram_unit,gpu_ram_unit,time_unit,ram_system_capacity,\
                      gpu_ram_system_capacity,system_core_count,n_expected_cores,\
                      system_gpu_count,n_expected_gpus\n\
                      gigabytes,gigabytes,hours,25.5,0.0,2,2,0,0\n";

/// A tracking file in gpu_tracker's CSV layout: samples at t = 10, 11, ..., 15 with
/// main_ram = 1, 2, ..., 6 and main_n_threads = 1, 1, 2, 2, 3, 3.
fn tracking_csv(dir: &Path) -> PathBuf {
    let mut text = STATIC.to_owned();
    text += "main_ram,main_n_threads,timestamp\n";
    for i in 0..6 {
        text += &format!("{}.0,{},{}.0\n", i + 1, i / 2 + 1, 10 + i);
    }
    let path = dir.join("t.csv");
    std::fs::write(&path, text).unwrap();
    path
}

/// Blocks: `load` twice in process 7 ([10, 11.5] holding t = 10, 11; [13.25, 13.5]
/// holding none), `step` once in process 8 ([12, 15]: t = 12..15, bounds included),
/// and a `step` of process 9 still open (dropped, as gpu_tracker drops it).
fn blocks_csv(dir: &Path, name: &str) -> PathBuf {
    let text = "process_id,code_block_name,position,timestamp\n\
                7,load,0,10.0\n7,load,1,11.5\n8,step,0,12.0\n7,load,0,13.25\n\
                7,load,1,13.5\n8,step,1,15.0\n9,step,0,14.0\n";
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn analysis_figures_are_the_hand_computed_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let r = subtrack::analyze(&tracking_csv(tmp.path()), &blocks_csv(tmp.path(), "b.csv")).unwrap();
    // Overall: main_ram 1..=6.
    let ram = r.overall.get("main_ram").unwrap();
    let std = (17.5f64 / 6.0).sqrt(); // population std of 1..=6
    assert_eq!((ram.min, ram.max, ram.mean), (1.0, 6.0, 3.5));
    assert!(close(ram.std, std), "{ram:?}");
    assert_eq!(
        r.overall.keys().collect::<Vec<_>>(),
        ["main_ram", "main_n_threads"]
    );
    assert_eq!(r.overall.len(), 2);
    assert!(!r.overall.is_empty());
    assert!(subtrack::OrderedMap::<subtrack::Stats>::default().is_empty());
    // Static data typed as pandas types it.
    assert_eq!(
        r.static_data.get("system_core_count"),
        Some(&subtrack::Scalar::Int(2))
    );
    assert_eq!(
        r.static_data.get("ram_system_capacity"),
        Some(&subtrack::Scalar::Real(25.5))
    );
    // Blocks, sorted by name.
    let names: Vec<&str> = r
        .code_block_results
        .iter()
        .map(|b| b.name.as_str())
        .collect();
    assert_eq!(names, ["load", "step"]);
    let load = &r.code_block_results[0];
    assert_eq!(
        (
            load.num_calls,
            load.num_non_empty_calls,
            load.num_timepoints
        ),
        (2, 1, 2)
    );
    let (t, total) = (&load.compute_time.stats, load.compute_time.total);
    assert_eq!((t.min, t.max, t.mean, total), (0.25, 1.5, 0.875, 1.75));
    assert!(close(t.std, 0.625));
    let l = load.resource_usage.get("main_ram").unwrap();
    assert_eq!((l.min, l.max, l.mean, l.std), (1.0, 2.0, 1.5, 0.5));
    let step = &r.code_block_results[1];
    assert_eq!(
        (
            step.num_calls,
            step.num_non_empty_calls,
            step.num_timepoints
        ),
        (1, 1, 4),
        "process 9's open call dropped; 12 and 15 included"
    );
    let th = step.resource_usage.get("main_n_threads").unwrap();
    assert_eq!((th.min, th.max, th.mean), (2.0, 3.0, 2.5));
    assert_eq!(step.compute_time.stats.std, 0.0);
}

/// A tracking file with every measure gpu_tracker's analysis reads (its layout), each
/// with its own values.
fn full_tracking_csv(dir: &Path) -> PathBuf {
    let names: Vec<&str> = tt_tracker::Sample::default()
        .measures()
        .iter()
        .map(|(k, _)| *k)
        .collect();
    let mut text = STATIC.to_owned() + &names.join(",") + ",timestamp\n";
    for i in 0..6u32 {
        let row: Vec<String> = (0..names.len())
            .map(|m| {
                if names[m].ends_with("n_threads") {
                    (i / 2 + 1 + m as u32).to_string()
                } else {
                    format!("{:?}", f64::from(i * i) * 0.37 + m as f64)
                }
            })
            .collect();
        text += &format!("{},{}.0\n", row.join(","), 10 + i);
    }
    let path = dir.join("full.csv");
    std::fs::write(&path, text).unwrap();
    path
}

/// gpu_tracker's own `sub-track analyze --format=json` of these files, read back.
fn gpu_trackers_analysis(dir: &Path, tf: &Path, stf: &Path) -> SubTrackingResults {
    let json = tt_testkit::run_python_module(
        "gpu_tracker",
        &[
            "sub-track",
            "analyze",
            &format!("--tf={}", tf.display()),
            &format!("--stf={}", stf.display()),
            "--format=json",
        ],
    );
    let path = dir.join("theirs.json");
    std::fs::write(&path, &json).unwrap();
    SubTrackingResults::load(&path).unwrap()
}

#[test]
fn the_same_figures_as_gpu_trackers_own_analysis() {
    let tmp = tempfile::tempdir().unwrap();
    let (tf, stf) = (
        full_tracking_csv(tmp.path()),
        blocks_csv(tmp.path(), "b.csv"),
    );
    let ours = subtrack::analyze(&tf, &stf).unwrap();
    let theirs = gpu_trackers_analysis(tmp.path(), &tf, &stf);
    assert_eq!(
        theirs.code_block_results.len(),
        ours.code_block_results.len()
    );
    for (a, b) in ours
        .code_block_results
        .iter()
        .zip(&theirs.code_block_results)
    {
        assert_eq!(
            (
                &a.name,
                a.num_calls,
                a.num_non_empty_calls,
                a.num_timepoints
            ),
            (
                &b.name,
                b.num_calls,
                b.num_non_empty_calls,
                b.num_timepoints
            )
        );
        for (m, s) in a.resource_usage.iter() {
            let t = b.resource_usage.get(m).unwrap();
            for (x, y) in [
                (s.min, t.min),
                (s.max, t.max),
                (s.mean, t.mean),
                (s.std, t.std),
            ] {
                assert!(
                    close(x, y) || (x.is_nan() && y.is_nan()),
                    "{m}: {s:?} vs {t:?}"
                );
            }
        }
    }
    // And its text, line for line.
    let text = tt_testkit::run_python_module(
        "gpu_tracker",
        &[
            "sub-track",
            "analyze",
            &format!("--tf={}", tf.display()),
            &format!("--stf={}", stf.display()),
        ],
    );
    assert_eq!(format!("{ours}\n"), text);
}

#[test]
fn results_read_back_from_json_nan_included_and_pickles_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let r = subtrack::analyze(&tracking_csv(tmp.path()), &blocks_csv(tmp.path(), "b.csv")).unwrap();
    let path = tmp.path().join("r.json");
    std::fs::write(&path, r.to_json()).unwrap();
    assert_eq!(SubTrackingResults::load(&path).unwrap(), r);
    // gpu_tracker's NaN (JSON has none) is read as a missing number.
    let nan = r.to_json().replacen("\"std\": 0.0", "\"std\": NaN", 1);
    assert!(nan.contains("NaN"));
    std::fs::write(&path, nan).unwrap();
    let back = SubTrackingResults::load(&path).unwrap();
    let nans = back
        .code_block_results
        .iter()
        .flat_map(|b| {
            b.resource_usage
                .iter()
                .map(|(_, s)| s.std)
                .chain([b.compute_time.stats.std])
                .collect::<Vec<_>>()
        })
        .chain(back.overall.iter().map(|(_, s)| s.std))
        .filter(|x| x.is_nan())
        .count();
    assert_eq!(nans, 1);
    // A pickle by its name or by its first byte (protocol 2+ starts with 0x80).
    for (name, bytes) in [("r.pkl", &b"{}"[..]), ("r.bin", &[0x80, 4, 0x95][..])] {
        let pkl = tmp.path().join(name);
        std::fs::write(&pkl, bytes).unwrap();
        let e = SubTrackingResults::load(&pkl).unwrap_err().to_string();
        assert!(e.contains("a pickle is not read"), "{name}: {e}");
    }
    std::fs::write(&path, "{\"overall\": 3}").unwrap();
    let e = SubTrackingResults::load(&path).unwrap_err().to_string();
    assert!(e.contains("sub-track analyze --format json"), "{e}");
}

#[test]
fn statistics_are_population_statistics_and_skip_missing_values() {
    let s = Stats::of([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
    assert_eq!((s.min, s.max, s.mean, s.std), (2.0, 9.0, 5.0, 2.0));
    assert_eq!(s.get(Statistic::Max), 9.0);
    assert_eq!(s.get(Statistic::Min), 2.0);
    assert_eq!(s.get(Statistic::Std), 2.0);
    assert_eq!(s.get(Statistic::Mean), 5.0);
    assert_eq!(Stats::of([f64::NAN, 1.0, 3.0]).mean, 2.0);
    assert!(Stats::of([]).max.is_nan());
    for (text, stat) in [
        ("min", Statistic::Min),
        ("mean", Statistic::Mean),
        ("std", Statistic::Std),
    ] {
        assert_eq!(text.parse::<Statistic>().unwrap(), stat);
    }
    assert!("median"
        .parse::<Statistic>()
        .unwrap_err()
        .to_string()
        .contains("min, max, mean, std"));
}

fn session(
    dir: &Path,
    name: &str,
    scale: f64,
    block: &str,
) -> (String, SubTrackingResults, PathBuf) {
    let sub = dir.join(name);
    std::fs::create_dir_all(&sub).unwrap();
    let mut text = STATIC.to_owned() + "main_ram,timestamp\n";
    for i in 0..4 {
        text += &format!("{},{}.0\n", scale * f64::from(i + 1), 10 + i);
    }
    std::fs::write(sub.join("t.csv"), text).unwrap();
    std::fs::write(
        sub.join("b.csv"),
        format!(
            "process_id,code_block_name,position,timestamp\n1,{block},0,10.0\n1,{block},1,11.0\n"
        ),
    )
    .unwrap();
    let r = subtrack::analyze(&sub.join("t.csv"), &sub.join("b.csv")).unwrap();
    (name.to_owned(), r, sub.join("b.csv"))
}

#[test]
fn sessions_compare_measure_by_measure_smallest_first() {
    let tmp = tempfile::tempdir().unwrap();
    let big = session(tmp.path(), "big", 10.0, "train.py:12");
    let small = session(tmp.path(), "small", 1.0, "train.py:9");
    // Blocks differing only by line number match; the first session is "big".
    let c = subtrack::compare(&[big.clone(), small.clone()], Statistic::Max).unwrap();
    let ram = c.overall_resource_usage.get("main_ram").unwrap();
    assert_eq!(ram.0, [("small".to_owned(), 4.0), ("big".to_owned(), 40.0)]);
    let key = "train.py:12 -> train.py:9";
    let per_block = c.code_block_resource_usage.get("main_ram").unwrap();
    assert_eq!(per_block.keys().collect::<Vec<_>>(), [key]);
    assert_eq!(
        per_block.get(key).unwrap().0,
        [("small".to_owned(), 2.0), ("big".to_owned(), 20.0)]
    );
    assert_eq!(c.code_block_compute_time.get(key).unwrap().len(), 2);
    // gpu_tracker's JSON: the same nesting, in the same order.
    let json: serde_json::Value = serde_json::from_str(&c.to_json()).unwrap();
    assert_eq!(json["overall_resource_usage"]["main_ram"]["big"], 40.0);
    assert_eq!(
        json["code_block_resource_usage"]["main_ram"][key]["small"],
        2.0
    );
    let text = c.to_string();
    assert!(
        text.starts_with("Overall Resource Usage:\n\tMain Ram:\n"),
        "{text}"
    );
    assert!(
        text.contains(&format!("\t{key}:\n")),
        "block names as they are: {text}"
    );
    let mean = subtrack::compare(&[big.clone(), small.clone()], Statistic::Mean).unwrap();
    assert_eq!(
        mean.overall_resource_usage.get("main_ram").unwrap().0,
        [("small".to_owned(), 2.5), ("big".to_owned(), 25.0)]
    );
    // Other blocks do not match: a clear error naming both.
    let other = session(tmp.path(), "other", 1.0, "eval");
    let e = subtrack::compare(&[big, other], Statistic::Mean)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"train.py:12\"") && e.contains("\"eval\""),
        "{e}"
    );
    assert!(subtrack::compare(&[], Statistic::Mean).is_err());
}

#[test]
fn combine_merges_every_record_never_replacing_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let a = blocks_csv(tmp.path(), "a.csv");
    let b = tmp.path().join("b.csv");
    std::fs::write(
        &b,
        "process_id,code_block_name,position,timestamp\n3,\"x, y\",0,1.5\n3,\"x, y\",1,2.0\n",
    )
    .unwrap();
    let out = tmp.path().join("all.csv");
    assert_eq!(
        subtrack::combine(&out, &[a.clone(), b.clone()]).unwrap(),
        (2, 9)
    );
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.starts_with("process_id,code_block_name,position,timestamp\n"));
    assert!(text.contains("3,\"x, y\",0,1.5\n"), "quoted as CSV: {text}");
    assert_eq!(text.lines().count(), 10);
    let e = subtrack::combine(&out, std::slice::from_ref(&a))
        .unwrap_err()
        .to_string();
    assert!(e.contains("already exists"), "{e}");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), text, "untouched");
    // A directory: its files with the output's extension.
    let dir = tmp.path().join("blocks");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(&a, dir.join("1.csv")).unwrap();
    std::fs::write(dir.join("notes.txt"), "not a sub-tracking file").unwrap();
    let out2 = tmp.path().join("dir.csv");
    assert_eq!(subtrack::combine(&out2, &[dir]).unwrap(), (1, 7));
    let e = subtrack::combine(&tmp.path().join("x.json"), &[a])
        .unwrap_err()
        .to_string();
    assert!(e.contains("*.csv, *.sqlite or *.jsonl"), "{e}");
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite_blocks_give_the_same_analysis_as_csv_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let tf = tracking_csv(tmp.path());
    let csv = blocks_csv(tmp.path(), "b.csv");
    let db = tmp.path().join("b.sqlite");
    assert_eq!(
        subtrack::combine(&db, std::slice::from_ref(&csv)).unwrap(),
        (1, 7)
    );
    let (a, b) = (
        subtrack::analyze(&tf, &csv).unwrap(),
        subtrack::analyze(&tf, &db).unwrap(),
    );
    assert_eq!(a, b);
}

#[cfg(not(feature = "sqlite"))]
#[test]
fn sqlite_files_need_the_feature_and_say_so() {
    let tmp = tempfile::tempdir().unwrap();
    let db = tmp.path().join("b.sqlite");
    std::fs::write(&db, "").unwrap();
    let e = subtrack::analyze(&tracking_csv(tmp.path()), &db)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`sqlite` feature"), "{e}");
}

#[test]
fn statistics_are_pandas_to_the_last_bit() {
    // Constant values that binary floats cannot hold (a standard deviation of exactly
    // 0 or of 1e-17 decides gpu_tracker's order of sessions), a block of more than 128
    // values (numpy's pairwise halves), and missing values inside.
    let mut sets: Vec<Vec<f64>> = vec![vec![0.1; 9], vec![0.0103; 17], vec![1.0 / 3.0; 8]];
    sets.push(
        (0..300)
            .map(|i| f64::from(i).mul_add(0.37, 1.0 / 7.0).sin() * 3.3)
            .collect(),
    );
    // Long blocks of values of very different sizes: where numpy splits the sum decides
    // the last bits.
    for n in [1031, 4099] {
        sets.push(
            (0..n)
                .map(|i| (f64::from(i) * 0.731).sin() * 10f64.powi(i % 13 - 6))
                .collect(),
        );
    }
    let mut gaps: Vec<f64> = (0..40).map(|i| f64::from(i) * 0.1 + 0.05).collect();
    for i in [0, 5, 17, 39] {
        gaps[i] = f64::NAN;
    }
    sets.push(gaps);
    let json = serde_json::to_string(
        &sets
            .iter()
            .map(|s| {
                s.iter()
                    .map(|x| if x.is_nan() { None } else { Some(*x) })
                    .collect()
            })
            .collect::<Vec<Vec<Option<f64>>>>(),
    )
    .unwrap();
    let script = "import json, sys, pandas as pd\n\
                  for values in json.loads(sys.argv[1]):\n\
                  \x20   s = pd.Series([float('nan') if v is None else v for v in values])\n\
                  \x20   d = s.describe()\n\
                  \x20   print(repr(float(d['mean'])), repr(float(s.std(ddof=0))))\n";
    let out = tt_testkit::run_python(script, &[&json]);
    for (values, line) in sets.iter().zip(out.lines()) {
        let (mean, std) = line.split_once(' ').unwrap();
        let ours = Stats::of(values.iter().copied());
        let (mean, std): (f64, f64) = (mean.parse().unwrap(), std.parse().unwrap());
        assert_eq!(
            (ours.mean.to_bits(), ours.std.to_bits()),
            (mean.to_bits(), std.to_bits()),
            "{} values: ours {} {}, pandas {mean:?} {std:?}",
            values.len(),
            ours.mean,
            ours.std
        );
    }
    assert_eq!(out.lines().count(), sets.len());
}

/// gpu_tracker has SQLite itself compute the overall statistics of an SQLite tracking
/// file (its own query: a running sum, no pandas): the same figures to the last bit,
/// where pandas' pairwise sums differ.
#[cfg(feature = "sqlite")]
#[test]
fn overall_statistics_of_sqlite_files_are_sqlites_to_the_last_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let db = tmp.path().join("t.sqlite");
    // 40 samples of every measure gpu_tracker reads (thread counts as integers), in
    // its tables.
    let names: Vec<&str> = tt_tracker::Sample::default()
        .measures()
        .iter()
        .map(|(k, _)| *k)
        .collect();
    let script = "import json, sqlite3, sys\n\
                  names = json.loads(sys.argv[2])\n\
                  con = sqlite3.connect(sys.argv[1])\n\
                  con.execute('CREATE TABLE static_data (ram_unit TEXT, gpu_ram_unit TEXT, time_unit TEXT, ram_system_capacity REAL, gpu_ram_system_capacity REAL, system_core_count INTEGER, n_expected_cores INTEGER, system_gpu_count INTEGER, n_expected_gpus INTEGER)')\n\
                  con.execute(\"INSERT INTO static_data VALUES ('gigabytes','gigabytes','hours',25.5,0.0,2,2,0,0)\")\n\
                  cols = ', '.join(n + (' INTEGER' if n.endswith('n_threads') else ' REAL') for n in names)\n\
                  con.execute(f'CREATE TABLE data ({cols}, timestamp REAL)')\n\
                  rows = [[3 + (i + m) % 4 if n.endswith('n_threads') else 0.1 * ((i + m) % 7) + 1 / 3 for m, n in enumerate(names)] + [10.0 + i] for i in range(40)]\n\
                  con.executemany(f'INSERT INTO data VALUES ({\", \".join(\"?\" * (len(names) + 1))})', rows)\n\
                  con.commit()\n";
    let names_json = serde_json::to_string(&names).unwrap();
    tt_testkit::run_python(script, &[&db.display().to_string(), &names_json]);
    let blocks = tmp.path().join("b.sqlite");
    subtrack::combine(&blocks, &[blocks_csv(tmp.path(), "b.csv")]).unwrap();
    let ours = subtrack::analyze(&db, &blocks).unwrap();
    let theirs = gpu_trackers_analysis(tmp.path(), &db, &blocks);
    for measure in names {
        let (a, b) = (
            ours.overall.get(measure).unwrap(),
            theirs.overall.get(measure).unwrap(),
        );
        assert_eq!(
            [a.min, a.max, a.mean, a.std].map(f64::to_bits),
            [b.min, b.max, b.mean, b.std].map(f64::to_bits),
            "{measure}: ours {a:?}, gpu_tracker's {b:?}"
        );
    }
}

#[test]
fn blocks_that_do_not_pair_up_are_refused_with_the_events_named() {
    let tmp = tempfile::tempdir().unwrap();
    let analyze = |name: &str, events: &str| {
        let path = tmp.path().join(name);
        let text = format!("process_id,code_block_name,position,timestamp\n{events}");
        std::fs::write(&path, text).unwrap();
        subtrack::analyze(&tracking_csv(tmp.path()), &path).map_err(|e| e.to_string())
    };
    // Two starts, then two stops: a start paired with a start.
    let e = analyze(
        "nested.csv",
        "7,load,0,10.0\n7,load,0,11.0\n7,load,1,12.0\n7,load,1,13.0\n",
    )
    .unwrap_err();
    assert!(e.contains("do not form a start/stop pair"), "{e}");
    assert!(e.contains("position 0) and 11"), "names both events: {e}");
    // A stop first: a stop paired with the start after it.
    let e = analyze(
        "stop-first.csv",
        "7,load,1,10.0\n7,load,0,11.0\n7,load,1,12.0\n",
    )
    .unwrap_err();
    assert!(e.contains("do not form a start/stop pair"), "{e}");
    // A lone stop.
    let e = analyze("lone.csv", "7,load,1,10.0\n").unwrap_err();
    assert!(e.contains("stops at 10 without a start"), "{e}");
    // A start in one process (its second, still open, is dropped) and a stop in another:
    // positions 0 then 1, but not one call.
    let e = analyze(
        "two-processes.csv",
        "7,load,0,10.0\n7,load,0,11.0\n8,load,1,12.0\n",
    )
    .unwrap_err();
    assert!(e.contains("do not form a start/stop pair"), "{e}");
    assert!(
        e.contains("(process 7, position 0) and 12"),
        "names both events: {e}"
    );
    // Well-formed calls of two processes, the last one still open: accepted.
    let r = analyze(
        "good.csv",
        "7,load,0,10.0\n8,load,0,10.5\n7,load,1,11.0\n8,load,1,12.0\n8,load,0,14.0\n",
    );
    assert!(r.is_ok(), "{r:?}");
}

#[test]
fn json_lines_timelines_give_the_same_analysis_as_csv_ones() {
    // The CSV fixtures above as one JSON Lines timeline (`torchtools track --timeline
    // t.jsonl`): static data with sorted keys, samples, and block lines.
    let tmp = tempfile::tempdir().unwrap();
    let mut text = String::from(
        "{\"static_data\":{\"gpu_ram_system_capacity\":0.0,\"gpu_ram_unit\":\"gigabytes\",\
         \"n_expected_cores\":2,\"n_expected_gpus\":0,\"ram_system_capacity\":25.5,\
         \"ram_unit\":\"gigabytes\",\"system_core_count\":2,\"system_gpu_count\":0,\
         \"time_unit\":\"hours\"}}\n",
    );
    for i in 0..6 {
        text += &format!(
            "{{\"main_ram\":{}.0,\"main_n_threads\":{},\"timestamp\":{}.0}}\n",
            i + 1,
            i / 2 + 1,
            10 + i
        );
    }
    for (pid, name, position, t) in [
        (7, "load", 0, 10.0),
        (7, "load", 1, 11.5),
        (8, "step", 0, 12.0),
        (7, "load", 0, 13.25),
        (7, "load", 1, 13.5),
        (8, "step", 1, 15.0),
        (9, "step", 0, 14.0),
    ] {
        text += &format!(
            "{{\"block\":{{\"code_block_name\":\"{name}\",\"position\":{position},\
             \"process_id\":{pid},\"timestamp\":{t:?}}}}}\n"
        );
    }
    let jsonl = tmp.path().join("t.jsonl");
    std::fs::write(&jsonl, &text).unwrap();
    let ours = subtrack::analyze(&jsonl, &jsonl).unwrap();
    let csv =
        subtrack::analyze(&tracking_csv(tmp.path()), &blocks_csv(tmp.path(), "b.csv")).unwrap();
    // Static data in gpu_tracker's order, whatever order the file had.
    assert_eq!(
        ours.static_data.keys().collect::<Vec<_>>(),
        csv.static_data.keys().collect::<Vec<_>>()
    );
    assert_eq!(ours, csv);
    // A sample with other fields than those before it is an error naming its line.
    let bad = tmp.path().join("bad.jsonl");
    let extra = "{\"main_ram\":7.0,\"timestamp\":16.0}\n";
    std::fs::write(&bad, text.clone() + extra).unwrap();
    let e = subtrack::analyze(&bad, &jsonl).unwrap_err().to_string();
    assert!(e.contains("line 15 has other fields"), "{e}");
}

#[test]
fn a_tracking_files_last_line_may_be_cut_short_but_no_other() {
    let tmp = tempfile::tempdir().unwrap();
    let full = std::fs::read_to_string(tracking_csv(tmp.path())).unwrap();
    // A tracker still writing: the last line is cut. It is left out.
    let cut = tmp.path().join("cut.csv");
    std::fs::write(&cut, full.clone() + "7.0,4").unwrap();
    let blocks = blocks_csv(tmp.path(), "b.csv");
    let r = subtrack::analyze(&cut, &blocks).unwrap();
    assert_eq!(r.overall.get("main_ram").unwrap().max, 6.0);
    // A short line before others: an error naming the sample.
    let mut lines: Vec<&str> = full.lines().collect();
    lines[4] = "2.0";
    let broken = tmp.path().join("broken.csv");
    std::fs::write(&broken, lines.join("\n") + "\n").unwrap();
    let e = subtrack::analyze(&broken, &blocks).unwrap_err().to_string();
    assert!(e.contains("sample 2 has 1 values for 3 columns"), "{e}");
    // The static data and the header, no sample yet (a tracker that just started):
    // read: no figure (NaN, as pandas gives for no values), the blocks' calls counted.
    let started = tmp.path().join("started.csv");
    std::fs::write(
        &started,
        full.lines().take(3).collect::<Vec<_>>().join("\n") + "\n",
    )
    .unwrap();
    let r = subtrack::analyze(&started, &blocks).unwrap();
    assert!(r.overall.get("main_ram").unwrap().max.is_nan(), "{r:?}");
    let calls: Vec<usize> = r.code_block_results.iter().map(|b| b.num_calls).collect();
    assert_eq!(calls, [2, 1], "{r:?}");
    // Too short to hold the static data and a header: said so, for 0 to 2 lines.
    for n in 0..3 {
        let short = tmp.path().join(format!("short{n}.csv"));
        std::fs::write(&short, full.lines().take(n).collect::<Vec<_>>().join("\n")).unwrap();
        let e = subtrack::analyze(&short, &blocks).unwrap_err().to_string();
        assert!(e.contains("two lines of static data"), "{n} lines: {e}");
    }
}

#[test]
fn combine_writes_beside_the_output_whatever_its_filesystem() {
    // The combined file is written to a temporary file beside it, then hard-linked
    // into place (never replacing one): on another filesystem than the current
    // directory's (a tmpfs here), a temporary elsewhere could not be linked.
    let tmp = tempfile::tempdir().unwrap();
    let a = blocks_csv(tmp.path(), "a.csv");
    let mount = tmp.path().join("tmpfs");
    std::fs::create_dir(&mount).unwrap();
    let Some(_mounted) = tt_testkit::mount_or_skip(
        "combining onto another filesystem needs a tmpfs mount",
        &["-t", "tmpfs", "-o", "size=1m", "tmpfs"],
        &mount,
    ) else {
        return;
    };
    let out = mount.join("all.csv");
    assert_eq!(subtrack::combine(&out, &[a]).unwrap(), (1, 7));
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 8);
    let left: Vec<_> = std::fs::read_dir(&mount).unwrap().collect();
    assert_eq!(left.len(), 1, "only the combined file: {left:?}");
}

//! The report's layout, against a fixed `ResourceUsage`: gpu_tracker 5's JSON keys and
//! text layout (snapshots), our additions, units, and a reading by Python the way
//! gpu_tracker's users read its JSON.

use std::collections::BTreeMap;

use tt_tracker::*;

fn pct(a: f64) -> ProcessingUnitPercentages {
    ProcessingUnitPercentages {
        max_sum_percent: a,
        max_hardware_percent: a / 2.0,
        mean_sum_percent: a / 4.0,
        mean_hardware_percent: a / 8.0,
    }
}

fn usage() -> ResourceUsage {
    ResourceUsage {
        max_ram: MaxRam {
            unit: RamUnit::Gigabytes,
            system_capacity: 25.276502016,
            system: 3.1234567,
            main: RssValues {
                total_rss: 1.5,
                private_rss: 1.25,
                shared_rss: 0.25,
            },
            descendants: RssValues {
                total_rss: 0.5368709,
                private_rss: 0.5,
                shared_rss: 0.0368709,
            },
            combined: RssValues {
                total_rss: 2.0,
                private_rss: 1.75,
                shared_rss: 0.25,
            },
        },
        max_gpu_ram: MaxGpuRam {
            unit: RamUnit::Megabytes,
            system_capacity: 81559.0,
            system: 2200.0,
            main: 0.0,
            descendants: 2147.483648,
            combined: 2147.483648,
        },
        cpu_utilization: CpuUtilization {
            system_core_count: 16,
            n_expected_cores: 4,
            system: pct(400.0),
            main: pct(100.0),
            descendants: pct(250.0),
            combined: pct(350.0),
            main_n_threads: 12,
            descendants_n_threads: 30,
            combined_n_threads: 42,
        },
        gpu_utilization: GpuUtilization {
            system_gpu_count: 1,
            n_expected_gpus: 1,
            gpu_percentages: pct(90.0),
        },
        compute_time: ComputeTime {
            unit: TimeUnit::Hours,
            time: 0.0123456,
        },
        torchtools: Additions {
            peak_methods: PeakMethods {
                main: "VmHWM".into(),
                descendants: "sampled".into(),
                combined: "sampled".into(),
                gpu: "NVML".into(),
            },
            samples: 444,
            interval_seconds: 0.1,
            energy: vec![GpuEnergy {
                uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
                joules: 1234.5,
            }],
            cgroup_peak: Some(2.1),
            exit_status: Some(0),
            blocks: vec![BlockSummary {
                name: "epoch 1".into(),
                calls: 2,
                seconds: 10.5,
                samples: 105,
                measures: BTreeMap::from([(
                    "main_ram".to_owned(),
                    Stat {
                        min: 1.0,
                        max: 1.5,
                        mean: 1.25,
                        std: 0.25,
                    },
                )]),
            }],
            warnings: vec![],
        },
    }
}

#[test]
fn json_has_gpu_trackers_keys_and_ours_under_torchtools() {
    insta::assert_json_snapshot!(usage());
}

#[test]
fn text_is_gpu_trackers_layout_then_ours() {
    insta::assert_snapshot!(usage().to_string());
}

#[test]
fn json_round_trips_and_reads_gpu_tracker_reports() {
    let json = serde_json::to_string(&usage()).unwrap();
    let back: ResourceUsage = serde_json::from_str(&json).unwrap();
    assert_eq!(back, usage());
    // A report from gpu_tracker itself has no torchtools part: still readable.
    let mut value = serde_json::to_value(usage()).unwrap();
    value.as_object_mut().unwrap().remove("torchtools");
    let theirs: ResourceUsage = serde_json::from_value(value).unwrap();
    assert_eq!(theirs.torchtools, Additions::default());
}

#[test]
fn units_parse_and_convert() {
    assert_eq!("megabytes".parse::<RamUnit>().unwrap().of(2e6), 2.0);
    assert_eq!("terabytes".parse::<RamUnit>().unwrap().of(1e12), 1.0);
    assert_eq!("minutes".parse::<TimeUnit>().unwrap().of(90.0), 1.5);
    assert_eq!("days".parse::<TimeUnit>().unwrap().of(86_400.0), 1.0);
    let e = "MB".parse::<RamUnit>().unwrap_err().to_string();
    assert!(e.contains("megabytes"), "{e}");
    let e = "h".parse::<TimeUnit>().unwrap_err().to_string();
    assert!(e.contains("hours"), "{e}");
}

/// gpu_tracker users read `tracker.to_json()` by these keys; the venv's Python does the
/// same on our JSON. Fails, never skips, without that Python (`cargo xtask setup`).
#[test]
fn python_reads_our_json_with_gpu_trackers_keys() {
    let python = tt_testkit::python_path();
    let json = serde_json::to_string(&usage()).unwrap();
    let script = r#"
import json, sys
d = json.loads(sys.stdin.read())
expected = {
  "max_ram": {"unit", "system_capacity", "system", "main", "descendants", "combined"},
  "max_gpu_ram": {"unit", "system_capacity", "system", "main", "descendants", "combined"},
  "cpu_utilization": {"system_core_count", "n_expected_cores", "system", "main", "descendants",
                      "combined", "main_n_threads", "descendants_n_threads", "combined_n_threads"},
  "gpu_utilization": {"system_gpu_count", "n_expected_gpus", "gpu_percentages"},
  "compute_time": {"unit", "time"},
}
for k, keys in expected.items():
    assert set(d[k]) == keys, (k, set(d[k]) ^ keys)
for part in ("main", "descendants", "combined"):
    assert set(d["max_ram"][part]) == {"total_rss", "private_rss", "shared_rss"}
pct = {"max_sum_percent", "max_hardware_percent", "mean_sum_percent", "mean_hardware_percent"}
for part in ("system", "main", "descendants", "combined"):
    assert set(d["cpu_utilization"][part]) == pct
assert set(d["gpu_utilization"]["gpu_percentages"]) == pct
assert set(d) - set(expected) == {"torchtools"}
print(d["max_ram"]["combined"]["total_rss"], d["max_gpu_ram"]["unit"], d["compute_time"]["unit"])
"#;
    let mut child = std::process::Command::new(&python)
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), json.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "2.0 megabytes hours"
    );
}

/// `torchtools track compare`'s table: each session's figures in its own column, and
/// each block's means found by the block's name in every session ("-" where a session
/// has no such block).
#[test]
fn compare_puts_each_figure_in_its_sessions_column_and_block_means_by_name() {
    use tt_tracker::compare::{Comparison, Session};
    let block = |name: &str, measure: &str, mean: f64| BlockSummary {
        name: name.into(),
        calls: 1,
        seconds: 1.0,
        samples: 1,
        measures: BTreeMap::from([(
            measure.to_owned(),
            Stat {
                min: mean,
                max: mean,
                mean,
                std: 0.0,
            },
        )]),
    };
    let mut a = usage();
    a.torchtools.blocks = vec![
        block("epoch 1", "main_ram", 1.25),
        block("epoch 2", "main_ram", 7.75),
    ];
    let mut b = usage();
    b.max_ram.combined.total_rss = 9.5;
    b.compute_time.time = 0.5;
    // A block with a measure of its own: listed under that block only.
    b.torchtools.blocks = vec![
        block("epoch 2", "main_ram", 8.5),
        block("eval", "gpu_ram", 3.0),
    ];
    let sessions = [("run-a", a), ("run-b", b)].map(|(name, usage)| Session {
        name: name.into(),
        usage,
        absent: Vec::new(),
    });
    let text = Comparison::new(sessions.to_vec()).to_string();
    let lines: Vec<&str> = text.lines().collect();
    let tokens = |line: &str| -> Vec<String> {
        line.split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let row = |label: &str| -> Vec<String> {
        let line = lines
            .iter()
            .find(|l| l.trim_start().starts_with(label))
            .unwrap_or_else(|| panic!("no {label:?} row in\n{text}"));
        let all = tokens(line);
        all[label.split_whitespace().count()..].to_vec()
    };
    assert_eq!(tokens(lines[0]), ["overall", "run-a", "run-b"], "{text}");
    let combined = usage().max_ram.combined.total_rss;
    assert_eq!(
        row("max RAM combined total RSS"),
        [
            format!("{combined:.3}"),
            "gigabytes".into(),
            "9.500".into(),
            "gigabytes".into()
        ],
        "{text}"
    );
    assert_eq!(
        row("compute time"),
        ["0.012", "hours", "0.500", "hours"],
        "{text}"
    );
    // Every measure line of a block's section (up to the next header).
    let block_rows = |name: &str| -> Vec<Vec<String>> {
        let at = lines
            .iter()
            .position(|l| l.starts_with(&format!("block {name:?} (mean)")))
            .unwrap_or_else(|| panic!("no block {name:?} in\n{text}"));
        lines[at + 1..]
            .iter()
            .take_while(|l| l.starts_with(' '))
            .map(|l| tokens(l))
            .collect()
    };
    assert_eq!(
        block_rows("epoch 1"),
        [["main_ram", "1.250", "-"]],
        "{text}"
    );
    assert_eq!(
        block_rows("epoch 2"),
        [["main_ram", "7.750", "8.500"]],
        "{text}"
    );
    assert_eq!(block_rows("eval"), [["gpu_ram", "-", "3.000"]], "{text}");
}

/// gpu_tracker's text rounds every figure to three decimals; so does ours, for each
/// part of the report.
#[test]
fn text_rounds_every_figure_to_three_decimals() {
    let mut u = usage();
    let third = pct(400.0 / 3.0); // 133.333..., 66.666..., 33.333..., 16.666...
    let c = &mut u.cpu_utilization;
    for p in [
        &mut c.system,
        &mut c.main,
        &mut c.descendants,
        &mut c.combined,
    ] {
        *p = third.clone();
    }
    u.gpu_utilization.gpu_percentages = third.clone();
    let r = &mut u.max_ram;
    for v in [&mut r.main, &mut r.descendants, &mut r.combined] {
        *v = RssValues {
            total_rss: 2.0 / 3.0,
            private_rss: 1.0 / 3.0,
            shared_rss: 1.0 / 3.0,
        };
    }
    u.max_ram.system = 4.0 / 3.0;
    u.max_gpu_ram.combined = 5.0 / 3.0;
    u.compute_time.time = 7.0 / 3.0;
    let text = u.to_string();
    assert!(!text.contains("3333") && !text.contains("6666"), "{text}");
    for figure in [
        "133.333", "66.667", "33.333", "16.667", "0.667", "1.333", "1.667", "2.333",
    ] {
        assert!(text.contains(figure), "{figure} in\n{text}");
    }
}

/// A report of gpu_tracker before version 5 (the `-f json -o out.json` output printed in
/// gpu_tracker's own tutorial): `descendents` read as descendants, and the CPU and GPU
/// use it does not hold shown as unknown, never as 0.
#[test]
fn compare_reads_gpu_trackers_reports_before_version_5() {
    use tt_tracker::compare::{Comparison, Session};
    let old = std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/gpu_tracker-4-report.json"
    ));
    let session = tt_tracker::compare::load(old).unwrap();
    assert_eq!(session.usage.max_ram.descendants.total_rss, 0.830509056);
    assert_eq!(session.usage.max_gpu_ram.descendants, 0.314);
    assert_eq!(session.absent, ["cpu_utilization", "gpu_utilization"]);
    let mut new = usage();
    new.cpu_utilization.combined.mean_sum_percent = 42.0;
    let new = Session {
        name: "new".into(),
        usage: new,
        absent: Vec::new(),
    };
    let text = Comparison::new(vec![session, new]).to_string();
    let cpu = text
        .lines()
        .find(|l| l.trim_start().starts_with("CPU combined mean"))
        .unwrap_or_else(|| panic!("{text}"));
    assert_eq!(
        cpu.split_whitespace().rev().take(2).collect::<Vec<_>>(),
        ["42.0", "-"],
        "{text}"
    );
    let ram = text
        .lines()
        .find(|l| l.trim_start().starts_with("max RAM combined total RSS"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(ram.contains("0.832 gigabytes"), "{text}");
}

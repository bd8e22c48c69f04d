//! The directory's rules on real files.

use crate::common;
use common::temps;

use std::path::Path;

use tt_ckpt::{atomic_write, clean_stale_temps, Checkpoint, CheckpointDir, Error, TensorData};

fn ckpt(step: u64) -> Checkpoint<'static> {
    let mut c = Checkpoint::new(step).with_epoch(step / 10);
    c.set_value("note", &format!("step {step}")).unwrap();
    let values: Vec<f32> = (0..1000).map(|i| (i as u64 * step) as f32).collect();
    c.add_tensor(
        "weights",
        TensorData::from_f32(vec![10, 100], &values).unwrap(),
    )
    .unwrap();
    c.add_tensor(
        "bias",
        TensorData::from_f32(vec![3], &[step as f32; 3]).unwrap(),
    )
    .unwrap();
    c
}

fn flip_byte(path: &Path, from_end: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    let i = bytes.len() - from_end as usize;
    bytes[i] ^= 0x40;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn save_list_rotate_and_load() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path().join("a/b"))
        .unwrap()
        .keep_last(3);
    assert!(
        matches!(dir.load_latest(), Ok(None)),
        "an empty directory has none yet: not an error to test for"
    );
    for step in [5, 10, 15, 20, 25] {
        let path = dir.save(&ckpt(step)).unwrap().unwrap();
        assert!(path.ends_with(format!("ckpt-{step:08}.safetensors")));
    }
    assert_eq!(steps(&dir), [15, 20, 25]);
    let loaded = dir.load_latest().unwrap().unwrap();
    let c = &loaded.checkpoint;
    assert_eq!((c.step(), c.epoch()), (25, Some(2)));
    assert_eq!(c.value::<String>("note").unwrap(), "step 25");
    assert_eq!(c.tensors().names(), ["bias", "weights"]);
    let w = c.tensor("weights").unwrap();
    assert_eq!(w.shape(), [10, 100]);
    assert_eq!(&w.data()[4..8], 25f32.to_le_bytes());
    assert!(matches!(
        c.value::<u32>("missing"),
        Err(Error::Missing { .. })
    ));
    assert!(matches!(c.value::<u32>("note"), Err(Error::Value { .. })));
    assert_eq!(c.meta().versions["torchtools"], env!("CARGO_PKG_VERSION"));
    assert_eq!(temps(dir.path()), 0);
    // Rotated files leave the directory's view at once and are freed off the save's
    // path; what a process that exited left behind goes with the next save.
    let trash = |d: &Path| {
        std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".tt-trash-"))
            .count()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while trash(dir.path()) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "rotated files never freed"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::fs::write(
        dir.path().join(".tt-trash-ckpt-00000001.safetensors"),
        b"old",
    )
    .unwrap();
    dir.save(&ckpt(30)).unwrap();
    let leftover = dir.path().join(".tt-trash-ckpt-00000001.safetensors");
    assert!(!leftover.exists(), "the next save frees leftovers");
    assert_eq!(steps(&dir), [20, 25, 30]);
}

#[test]
fn a_flipped_byte_is_detected_and_the_previous_checkpoint_is_used() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path()).unwrap();
    for step in [1, 2, 3] {
        dir.save(&ckpt(step)).unwrap();
    }
    let newest = root.path().join("ckpt-00000003.safetensors");
    flip_byte(&newest, 100); // inside the data section
    let loaded = dir.load_latest().unwrap().unwrap();
    assert_eq!(loaded.checkpoint.step(), 2);
    assert_eq!(loaded.skipped.len(), 1);
    assert!(
        loaded.skipped[0].1.contains("does not match its checksum"),
        "{:?}",
        loaded.skipped
    );
    // A truncated file (a crash without fsync on another tool) is refused too.
    let second = root.path().join("ckpt-00000002.safetensors");
    let len = std::fs::metadata(&second).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&second)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let loaded = dir.load_latest().unwrap().unwrap();
    assert_eq!(loaded.checkpoint.step(), 1);
    assert_eq!(loaded.skipped.len(), 2);
    // Nothing valid left: the error lists every file and why.
    flip_byte(&root.path().join("ckpt-00000001.safetensors"), 1);
    let e = dir.load_latest().unwrap_err().to_string();
    assert!(e.starts_with("no valid checkpoint in "), "{e}");
    assert_eq!(e.matches(".safetensors").count(), 3, "{e}");
}

fn steps(dir: &CheckpointDir) -> Vec<u64> {
    dir.list().unwrap().iter().map(|e| e.step).collect()
}

fn latest(dir: &CheckpointDir) -> String {
    std::fs::read_to_string(dir.path().join("latest"))
        .unwrap()
        .trim()
        .to_owned()
}

/// A finished run's directory: steps 1000, 2000, 3000 (all kept).
fn finished_run(path: &Path) {
    let old = CheckpointDir::open(path).unwrap();
    for step in [1000, 2000, 3000] {
        old.save(&ckpt(step)).unwrap();
    }
}

/// The checkpoint files of the folders the directory moved aside, as steps.
fn moved_aside(path: &Path, folder: &str) -> Vec<u64> {
    let mut found = Vec::new();
    let mut stack = vec![path.join(folder)];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                // Each one still verifies: moved, not lost.
                let c = tt_ckpt::LoadedCheckpoint::read(e.path()).unwrap();
                found.push(c.step());
            }
        }
    }
    found.sort_unstable();
    found
}

#[test]
fn a_new_run_in_a_finished_runs_directory_is_refused_before_writing() {
    let root = tempfile::tempdir().unwrap();
    finished_run(root.path());
    // A new run (no resume) with rotation: step 100 would be the lowest step and be
    // rotated away at once, and a resume would pick the old run's 3000.
    let dir = CheckpointDir::open(root.path()).unwrap().keep_last(2);
    let e = dir.save(&ckpt(100)).unwrap_err();
    match &e {
        Error::NewerCheckpoints { step, newer, .. } => {
            assert_eq!(
                (*step, newer.as_slice()),
                (100, [1000, 2000, 3000].as_slice())
            )
        }
        other => panic!("{other}"),
    }
    let text = e.to_string();
    for hint in [
        "step 3000",
        "load_latest",
        ".supersede_newer()",
        "another directory",
    ] {
        assert!(text.contains(hint), "{hint}: {text}");
    }
    assert_eq!(
        steps(&dir),
        [1000, 2000, 3000],
        "nothing written or removed"
    );
    assert_eq!(latest(&dir), "ckpt-00003000.safetensors");
    // The same refusal from a background save, at once.
    assert!(matches!(
        dir.save_async(ckpt(100)),
        Err(Error::NewerCheckpoints { .. })
    ));
    // Asked for: the old run's steps move aside (kept), the new run is the timeline.
    let dir = CheckpointDir::open(root.path())
        .unwrap()
        .keep_last(2)
        .supersede_newer();
    let saved = dir.save(&ckpt(100)).unwrap().unwrap();
    assert!(saved.exists(), "the file just saved is there");
    assert_eq!(steps(&dir), [100]);
    assert_eq!(latest(&dir), "ckpt-00000100.safetensors");
    assert_eq!(dir.load_latest().unwrap().unwrap().checkpoint.step(), 100);
    assert_eq!(moved_aside(root.path(), "superseded"), [1000, 2000, 3000]);
    for step in [200, 300] {
        dir.save(&ckpt(step)).unwrap();
    }
    assert_eq!(steps(&dir), [200, 300], "rotation goes on in the new run");
}

#[test]
fn a_rolled_back_run_never_falls_back_to_the_abandoned_steps() {
    let root = tempfile::tempdir().unwrap();
    finished_run(root.path());
    // The run is rolled back to step 2000 (its loss diverged after it, say).
    let dir = CheckpointDir::open(root.path())
        .unwrap()
        .keep_last(2)
        .supersede_newer();
    let from = &dir.list().unwrap()[1];
    let resumed = tt_ckpt::LoadedCheckpoint::read(&from.path).unwrap();
    assert_eq!(resumed.step(), 2000);
    for step in [2100, 2200] {
        dir.save(&ckpt(step)).unwrap();
    }
    assert_eq!(steps(&dir), [2100, 2200]);
    assert_eq!(moved_aside(root.path(), "superseded"), [3000]);
    // If the newest is damaged, the fallback stays on this timeline.
    flip_byte(&root.path().join("ckpt-00002200.safetensors"), 100);
    assert_eq!(dir.load_latest().unwrap().unwrap().checkpoint.step(), 2100);
    // Without supersede_newer the roll-back is refused, naming the later step.
    let root = tempfile::tempdir().unwrap();
    finished_run(root.path());
    let dir = CheckpointDir::open(root.path()).unwrap();
    match dir.save(&ckpt(2100)) {
        Err(Error::NewerCheckpoints { newer, .. }) => assert_eq!(newer, [3000]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn after_falling_back_from_a_damaged_checkpoint_the_run_saves_past_it() {
    let root = tempfile::tempdir().unwrap();
    finished_run(root.path());
    let newest = root.path().join("ckpt-00003000.safetensors");
    flip_byte(&newest, 100);
    let dir = CheckpointDir::open(root.path()).unwrap().keep_last(2);
    let loaded = dir.load_latest().unwrap().unwrap();
    assert_eq!(loaded.checkpoint.step(), 2000);
    assert_eq!(loaded.skipped.len(), 1);
    // The run goes on from 2000: the damaged 3000 is no conflict, it moves to damaged/.
    let saved = dir.save(&ckpt(2100)).unwrap().unwrap();
    assert!(saved.exists());
    assert!(!newest.exists());
    assert_eq!(steps(&dir), [2000, 2100]);
    assert_eq!(latest(&dir), "ckpt-00002100.safetensors");
    assert_eq!(dir.load_latest().unwrap().unwrap().checkpoint.step(), 2100);
    let kept: Vec<_> = std::fs::read_dir(root.path().join("damaged"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(kept, ["ckpt-00003000.safetensors"], "kept for inspection");
    // A valid later step is still a conflict, even after a load.
    let root = tempfile::tempdir().unwrap();
    finished_run(root.path());
    let dir = CheckpointDir::open(root.path()).unwrap();
    assert_eq!(dir.load_latest().unwrap().unwrap().checkpoint.step(), 3000);
    assert!(matches!(
        dir.save(&ckpt(2500)),
        Err(Error::NewerCheckpoints { .. })
    ));
}

#[test]
fn a_step_damaged_again_and_again_keeps_every_damaged_copy() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path()).unwrap().keep_last(2);
    dir.save(&ckpt(1000)).unwrap();
    for round in 0..3 {
        // Step 3000 is written, damaged, skipped by the load; the run saves past it.
        dir.save(&ckpt(3000)).unwrap();
        flip_byte(&root.path().join("ckpt-00003000.safetensors"), 100);
        let loaded = dir.load_latest().unwrap().unwrap();
        assert_eq!(loaded.checkpoint.step(), 1000 + round);
        dir.save(&ckpt(1001 + round)).unwrap();
        assert_eq!(steps(&dir), [1000 + round, 1001 + round]);
    }
    let mut kept: Vec<_> = std::fs::read_dir(root.path().join("damaged"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(
        kept,
        [
            "ckpt-00003000.safetensors",
            "ckpt-00003000.safetensors.1",
            "ckpt-00003000.safetensors.2"
        ],
        "no damaged copy overwrites an earlier one"
    );
}

#[test]
fn a_crash_between_the_file_and_the_pointer_loads_the_newer_complete_file() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path()).unwrap();
    dir.save(&ckpt(20)).unwrap();
    dir.save(&ckpt(30)).unwrap();
    // As if the writer died after renaming step 30 into place, before `latest`.
    std::fs::write(root.path().join("latest"), "ckpt-00000020.safetensors\n").unwrap();
    assert_eq!(dir.load_latest().unwrap().unwrap().checkpoint.step(), 30);
    std::fs::write(root.path().join("latest"), "garbage\n").unwrap();
    assert_eq!(dir.load_latest().unwrap().unwrap().checkpoint.step(), 30);
    // Saving the same step again replaces it (a periodic and a final save, say).
    dir.save(&ckpt(30)).unwrap();
    assert_eq!(steps(&dir), [20, 30]);
}

#[test]
fn only_the_writer_writes() {
    let root = tempfile::tempdir().unwrap();
    let reader = CheckpointDir::open(root.path()).unwrap().writer(false);
    assert_eq!(reader.save(&ckpt(1)).unwrap(), None);
    assert!(reader.list().unwrap().is_empty());
}

#[test]
fn a_failed_write_leaves_the_old_file_and_no_temp() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("state.json");
    atomic_write(&path, |w| w.write_all(b"old")).unwrap();
    let e = atomic_write(&path, |w| {
        w.write_all(b"half of the new")?;
        Err(std::io::Error::other("disk on fire"))
    })
    .unwrap_err();
    assert!(e.to_string().contains("disk on fire"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), b"old");
    assert_eq!(temps(root.path()), 0);
    // A panic inside the writer: same.
    let result = std::panic::catch_unwind(|| atomic_write(&path, |_| panic!("boom")));
    assert!(result.is_err());
    assert_eq!(std::fs::read(&path).unwrap(), b"old");
    assert_eq!(temps(root.path()), 0);
    // A directory that does not exist is an error naming it.
    let e = atomic_write(root.path().join("nope/x"), |w| w.write_all(b"x"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope"), "{e}");
}

use std::io::Write;

#[test]
fn stale_temps_of_dead_writers_are_removed_live_ones_kept() {
    let root = tempfile::tempdir().unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .replace(['-', '/'], "_");
    // A process that has exited: its pid is free (reaped).
    let dead = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    let mut dead = dead;
    dead.wait().unwrap();
    let stale = root.path().join(format!(".tt-tmp-{host}-{dead_pid}-abc"));
    let live = root
        .path()
        .join(format!(".tt-tmp-{host}-{}-def", std::process::id()));
    let foreign = root.path().join(".tt-tmp-otherhost-1-ghi");
    for p in [&stale, &live, &foreign] {
        std::fs::write(p, b"partial").unwrap();
    }
    assert_eq!(clean_stale_temps(root.path()).unwrap(), 1);
    assert!(
        !stale.exists() && live.exists() && foreign.exists(),
        "a recent foreign temp may be a live writer"
    );
    // Another host's temp file: kept for a day (its writer may be alive there), then
    // removed.
    let aged = |hours: u64| {
        let when = std::time::SystemTime::now() - std::time::Duration::from_secs(hours * 3600);
        std::fs::File::options()
            .write(true)
            .open(&foreign)
            .unwrap()
            .set_modified(when)
            .unwrap();
    };
    aged(2);
    assert_eq!(clean_stale_temps(root.path()).unwrap(), 0);
    assert!(foreign.exists(), "2 hours old: kept");
    aged(25);
    assert_eq!(clean_stale_temps(root.path()).unwrap(), 1);
    assert!(!foreign.exists(), "25 hours old: removed");
}

#[test]
fn bad_tensors_are_refused_before_anything_is_written() {
    let e = TensorData::new(tt_ckpt::Dtype::F32, vec![3], vec![0u8; 8]).unwrap_err();
    assert!(e.to_string().contains("needs 12 bytes, got 8"), "{e}");
    let mut c = Checkpoint::new(1);
    assert!(matches!(
        c.add_tensor(
            "__metadata__",
            TensorData::from_f32(vec![1], &[1.0]).unwrap()
        ),
        Err(Error::BadName { .. })
    ));
}

#[test]
fn async_saves_finish_in_order_and_report_their_errors() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path().join("run"))
        .unwrap()
        .keep_last(2);
    for step in 1..=5 {
        dir.save_async(ckpt(step)).unwrap(); // returns before the write
    }
    let last = dir.wait().unwrap().unwrap();
    assert!(last.ends_with("ckpt-00000005.safetensors"));
    assert_eq!(dir.load_latest().unwrap().unwrap().checkpoint.step(), 5);
    assert_eq!(dir.list().unwrap().len(), 2);
    assert_eq!(dir.wait().unwrap(), None, "nothing pending any more");

    // The write fails on the background thread (`latest` cannot be replaced): the
    // error comes back with the next save, and from wait().
    let latest = root.path().join("run/latest");
    std::fs::remove_file(&latest).unwrap();
    std::fs::create_dir(&latest).unwrap();
    dir.save_async(ckpt(6)).unwrap();
    let e = dir.save(&ckpt(7)).unwrap_err();
    assert!(matches!(e, Error::PreviousSaveFailed(_)), "{e}");
    assert!(e.to_string().contains("Is a directory"), "{e}");
    dir.save_async(ckpt(8)).unwrap();
    assert!(dir.wait().is_err(), "wait() reports it too");
    // The directory vanished: a background save says so at once.
    std::fs::remove_dir_all(root.path().join("run")).unwrap();
    let e = dir.save_async(ckpt(9)).unwrap_err();
    assert!(e.to_string().contains("No such file or directory"), "{e}");
}

#[test]
fn poll_reports_a_background_save_once_it_is_durable_without_waiting() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path()).unwrap();
    assert_eq!(dir.poll().unwrap(), None, "nothing pending");
    dir.save_async(ckpt(3)).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let path = loop {
        if let Some(path) = dir.poll().unwrap() {
            break path;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the save never finished"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert!(path.ends_with("ckpt-00000003.safetensors") && path.exists());
    assert_eq!(dir.load_latest().unwrap().unwrap().checkpoint.step(), 3);
    assert_eq!(dir.poll().unwrap(), None, "reported once");
    assert_eq!(dir.wait().unwrap(), None, "nothing left to wait for");
}

#[test]
fn dropping_the_directory_finishes_a_pending_save() {
    let root = tempfile::tempdir().unwrap();
    {
        let dir = CheckpointDir::open(root.path()).unwrap();
        dir.save_async(ckpt(42)).unwrap();
    }
    let dir = CheckpointDir::open(root.path()).unwrap();
    assert_eq!(dir.load_latest().unwrap().unwrap().checkpoint.step(), 42);
}

#[test]
fn files_are_readable_by_others_and_keep_the_mode_they_replace() {
    use std::os::unix::fs::PermissionsExt;
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path()).unwrap();
    let path = dir.save(&ckpt(1)).unwrap().unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o644, "like torch.save under the usual umask");
    let notes = root.path().join("notes");
    std::fs::write(&notes, b"a").unwrap();
    std::fs::set_permissions(&notes, std::fs::Permissions::from_mode(0o600)).unwrap();
    atomic_write(&notes, |w| w.write_all(b"b")).unwrap();
    assert_eq!(mode(&notes), 0o600, "a replaced file keeps its mode");
}

/// The child side of the `RANK` test: opens the directory as a rank would, saves step
/// 1, and prints what `save` returned.
#[test]
#[ignore = "a child process's entry point, run by the RANK test"]
fn rank_child() {
    let Ok(path) = std::env::var("TT_CKPT_RANK_DIR") else {
        return;
    };
    match CheckpointDir::open(path) {
        Ok(dir) => {
            let saved = dir.save(&ckpt(1)).unwrap();
            println!("\n@@saved={}@@", saved.is_some());
        }
        Err(e) => println!("\n@@error={e}@@"),
    }
}

#[test]
fn only_rank_0_writes_under_torchrun_and_slurm_and_a_bad_rank_is_an_error() {
    // The launchers' variables, in real processes (a process's environment is its own).
    let torchrun = |rank| vec![("RANK", rank), ("WORLD_SIZE", "4")];
    let slurm = |procid| {
        vec![
            ("SLURM_PROCID", procid),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
        ]
    };
    for (vars, expect) in [
        (torchrun("1"), "@@saved=false@@"),
        (torchrun("3"), "@@saved=false@@"),
        (torchrun("0"), "@@saved=true@@"),
        (vec![], "@@saved=true@@"),
        // srun sets no RANK: only task 0 writes, not every task.
        (slurm("2"), "@@saved=false@@"),
        (slurm("0"), "@@saved=true@@"),
        // A typo is an error, not a silent non-writer.
        (
            torchrun("abc"),
            "@@error=which rank writes the checkpoints in ",
        ),
        (vec![("RANK", "0")], "WORLD_SIZE missing"),
    ] {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ckpt");
        let mut cmd = tt_testkit::rerun("rank_child");
        cmd.env("TT_CKPT_RANK_DIR", &dir);
        for v in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
        ] {
            cmd.env_remove(v);
        }
        let out = cmd.envs(vars.clone()).output().unwrap();
        tt_testkit::assert_ran_one(&out);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(expect), "{vars:?}: {text}");
        let writes = expect == "@@saved=true@@";
        let files = std::fs::read_dir(&dir).map_or(0, |d| d.count());
        assert_eq!(files > 0, writes, "{vars:?}: files written: {files}");
        if !expect.starts_with("@@saved") {
            assert!(!dir.exists(), "{vars:?}: created before the error: {text}");
        }
    }
}

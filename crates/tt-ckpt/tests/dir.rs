//! The directory's rules on real files.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

mod common;
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
        matches!(dir.load_latest(), Err(Error::NoCheckpoint { .. })),
        "an empty directory has none"
    );
    for step in [5, 10, 15, 20, 25] {
        let path = dir.save(&ckpt(step)).unwrap().unwrap();
        assert!(path.ends_with(format!("ckpt-{step:08}.safetensors")));
    }
    let steps: Vec<u64> = dir.list().unwrap().iter().map(|e| e.step).collect();
    assert_eq!(steps, [15, 20, 25]);
    let loaded = dir.load_latest().unwrap();
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
    let loaded = dir.load_latest().unwrap();
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
    let loaded = dir.load_latest().unwrap();
    assert_eq!(loaded.checkpoint.step(), 1);
    assert_eq!(loaded.skipped.len(), 2);
    // Nothing valid left: the error lists every file and why.
    flip_byte(&root.path().join("ckpt-00000001.safetensors"), 1);
    let e = dir.load_latest().unwrap_err().to_string();
    assert!(e.starts_with("no valid checkpoint in "), "{e}");
    assert_eq!(e.matches(".safetensors").count(), 3, "{e}");
}

#[test]
fn latest_is_followed_even_when_a_higher_step_exists() {
    // A run restarted from step 20 after a crash rewrites older steps: `latest` says
    // which file is current, not the highest number.
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path()).unwrap();
    dir.save(&ckpt(30)).unwrap();
    dir.save(&ckpt(20)).unwrap();
    assert_eq!(dir.load_latest().unwrap().checkpoint.step(), 20);
    std::fs::write(root.path().join("latest"), "garbage\n").unwrap();
    assert_eq!(
        dir.load_latest().unwrap().checkpoint.step(),
        30,
        "a bad pointer falls back to the newest"
    );
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
        Err(Error::BadName(_))
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
    assert_eq!(dir.load_latest().unwrap().checkpoint.step(), 5);
    assert_eq!(dir.list().unwrap().len(), 2);
    assert_eq!(dir.wait().unwrap(), None, "nothing pending any more");

    // The directory vanishes under a background save: the error comes back.
    std::fs::remove_dir_all(root.path().join("run")).unwrap();
    dir.save_async(ckpt(6)).unwrap();
    let e = dir.save(&ckpt(7)).unwrap_err();
    assert!(matches!(e, Error::PreviousSaveFailed(_)), "{e}");
    assert!(e.to_string().contains("No such file or directory"), "{e}");
    dir.save_async(ckpt(8)).unwrap();
    assert!(dir.wait().is_err(), "wait() reports it too");
}

#[test]
fn dropping_the_directory_finishes_a_pending_save() {
    let root = tempfile::tempdir().unwrap();
    {
        let dir = CheckpointDir::open(root.path()).unwrap();
        dir.save_async(ckpt(42)).unwrap();
    }
    let dir = CheckpointDir::open(root.path()).unwrap();
    assert_eq!(dir.load_latest().unwrap().checkpoint.step(), 42);
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

//! A save that cannot fit is an error, and the previous checkpoint is intact.

use std::path::Path;

use tt_ckpt::{Checkpoint, CheckpointDir, TensorData};

fn checkpoint(step: u64, floats: usize) -> Checkpoint<'static> {
    let mut c = Checkpoint::new(step);
    c.add_tensor(
        "x",
        TensorData::from_f32(vec![floats], &vec![step as f32; floats]).unwrap(),
    )
    .unwrap();
    c
}

/// Saves a small checkpoint, then one too large for `dir`; checks the aftermath.
fn scenario(dir: &Path) -> String {
    let ckpts = CheckpointDir::open(dir).unwrap();
    ckpts.save(&checkpoint(1, 1000)).unwrap();
    let err = ckpts.save(&checkpoint(2, 1 << 20)).unwrap_err().to_string(); // 4 MiB
    let loaded = ckpts.load_latest().unwrap().unwrap();
    assert_eq!(
        loaded.checkpoint.step(),
        1,
        "the previous checkpoint is the latest"
    );
    assert!(loaded.skipped.is_empty());
    let leftovers: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        leftovers.len(),
        2,
        "only ckpt-1 and latest remain: {leftovers:?}"
    );
    err
}

#[test]
#[ignore = "a child process's entry point, run by the file-size-limit test"]
fn rlimit_child() {
    let Ok(dir) = std::env::var("TT_CKPT_RLIMIT_DIR") else {
        return;
    };
    // SAFETY: plain syscalls on this process; SIGXFSZ ignored so that writes past the
    // limit fail with EFBIG instead of killing the process.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let limit = libc::rlimit {
            rlim_cur: 1 << 20,
            rlim_max: 1 << 20,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
    }
    let err = scenario(Path::new(&dir));
    assert!(err.contains("File too large"), "{err}");
}

#[test]
fn a_file_size_limit_fails_the_save_and_keeps_the_previous_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    let out = tt_testkit::rerun("rlimit_child")
        .env("TT_CKPT_RLIMIT_DIR", root.path())
        .output()
        .unwrap();
    tt_testkit::assert_ran_one(&out);
}

#[test]
fn a_full_tmpfs_fails_the_save_with_enospc_and_keeps_the_previous_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    let Some(_mounted) = tt_testkit::mount_or_skip(
        "a real ENOSPC needs a 1 MiB tmpfs mount",
        &["-t", "tmpfs", "-o", "size=1m", "tmpfs"],
        root.path(),
    ) else {
        return;
    };
    let err = scenario(root.path());
    assert!(err.contains("No space left on device"), "{err}");
}

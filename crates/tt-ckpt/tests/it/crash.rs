//! kill -9 at random moments: the directory always has a valid checkpoint whose
//! content is what was saved at its step, and temp files do not pile up.

use crate::common;
use common::temps;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use tt_ckpt::{Checkpoint, CheckpointDir, TensorData};

/// The content saved at `step`: 64 KiB of values derived from the step.
fn payload(step: u64) -> Vec<f32> {
    (0..16_384u64)
        .map(|i| ((i * 31 + step * 7919) % 100_003) as f32)
        .collect()
}

/// The child: save forever (each save a new step), as fast as it can.
#[test]
#[ignore = "a child process's entry point, run by the kill -9 test"]
fn crash_child() {
    let Ok(dir) = std::env::var("TT_CKPT_CRASH_DIR") else {
        return;
    };
    let dir = CheckpointDir::open(&dir).unwrap().keep_last(3);
    let start = dir
        .load_latest()
        .unwrap()
        .map_or(0, |l| l.checkpoint.step() + 1);
    // The kill delay counts from here, whatever the process's start-up cost.
    println!("ready");
    std::io::Write::flush(&mut std::io::stdout()).unwrap();
    for step in start.. {
        let mut c = Checkpoint::new(step);
        c.add_tensor(
            "payload",
            TensorData::from_f32(vec![16_384], &payload(step)).unwrap(),
        )
        .unwrap();
        c.set_value("step_again", &step).unwrap();
        dir.save(&c).unwrap();
        // The parent counts saves by these lines, never by time.
        println!("saved {step}");
        std::io::Write::flush(&mut std::io::stdout()).unwrap();
    }
}

#[test]
fn two_hundred_kill_9s_never_lose_the_latest_valid_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    // SplitMix64 for the kill delays: reproducible, spread over 0-25 ms.
    let mut seed = 42u64;
    let mut next = move || {
        seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let z = (seed ^ (seed >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb) ^ (z >> 31)
    };
    let mut last_step = None;
    let mut kills_with_checkpoint = 0;
    for round in 0..200 {
        let mut child = tt_testkit::rerun("crash_child")
            .env("TT_CKPT_CRASH_DIR", root.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert!(
            lines.any(|l| l.is_ok_and(|l| l.contains("ready"))),
            "round {round}: the child did not start"
        );
        // Driven by events: let the child report 1-3 saves of its own, then kill it at
        // a random moment of the saves that follow (whatever the machine's load).
        let saves = 1 + next() % 3;
        let mut seen = 0;
        while seen < saves {
            match lines.next() {
                Some(Ok(l)) if l.starts_with("saved ") => seen += 1,
                Some(Ok(_)) => {}
                other => panic!("round {round}: the child stopped before saving: {other:?}"),
            }
        }
        std::thread::sleep(Duration::from_micros(next() % 25_000));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        match CheckpointDir::open(root.path()).unwrap().load_latest() {
            Ok(Some(loaded)) => {
                let c = loaded.checkpoint;
                let step = c.step();
                assert_eq!(c.value::<u64>("step_again").unwrap(), step, "round {round}");
                let expected: Vec<u8> =
                    payload(step).iter().flat_map(|v| v.to_le_bytes()).collect();
                assert_eq!(
                    c.tensor("payload").unwrap().data(),
                    &expected[..],
                    "round {round}: content of step {step}"
                );
                assert!(
                    loaded.skipped.is_empty(),
                    "round {round}: a committed checkpoint was damaged: {:?}",
                    loaded.skipped
                );
                if let Some(prev) = last_step {
                    // This round's child reported at least one save past `prev`.
                    assert!(
                        step > prev,
                        "round {round}: step {step} after {prev}: a reported save was lost"
                    );
                }
                last_step = Some(step);
                kills_with_checkpoint += 1;
            }
            other => panic!("round {round}: no checkpoint after a reported save: {other:?}"),
        }
        // At most the killed writer's own temp file; the next save cleans it.
        assert!(
            temps(root.path()) <= 1,
            "round {round}: {} temp files",
            temps(root.path())
        );
    }
    assert_eq!(kills_with_checkpoint, 200);
    assert!(last_step.unwrap() >= 200, "every round saved at least once");
}

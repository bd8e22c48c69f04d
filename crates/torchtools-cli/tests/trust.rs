//! The command on a machine of many users: records another user forges are named in
//! `locks`, `queue` and `usage` as ignored, never taken for real, and a second user's
//! `reserve` still names the real holder. (tt-lock's `tests/trust.rs` tries every
//! record kind through the API; this is what users of the command see.)
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

mod common;
use common::torchtools;

#[test]
fn forged_records_are_said_by_every_view_and_reserve_names_the_real_holder() {
    let Some(tmp) = common::shared_dir_for_two_users() else {
        return;
    };
    let dir = tmp.path().join("locks");
    let as_nobody = |program: &str| {
        let mut c = Command::new("runuser");
        c.args(["-u", "nobody", "--", program])
            .env("TORCHTOOLS_LOCK_DIR", &dir)
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove("TORCHTOOLS_HELD_LOCKS")
            .stdin(Stdio::null());
        c
    };
    // Root holds GPU 0 under `umask 077`.
    let mut held = torchtools(&dir)
        .args(["reserve", "--gpu", "0", "--no-fence", "--"])
        .args(["sh", "-c", "umask 077; echo ready; exec sleep 600"])
        .process_group(0)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(held.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    let root_pid = held.id();
    // nobody plants a holder record and a queue ticket claiming root, each locked as a
    // live record is (a write lock on the open file, F_OFD_SETLK = 37 with F_WRLCK = 1,
    // through perl: it can, the files are its own), and a usage log of its own claiming
    // root.
    let forge = format!(
        "cd {dir} && printf '{{\"pid\":1,\"user\":\"root\",\"host\":\"h\",\"since_unix\":1}}\\n' \
         > held-gpu-0.1-0-1-0.json && printf '{{\"ticket\":9,\"pid\":1,\"user\":\"root\",\
         \"host\":\"h\",\"since_unix\":1,\"wants\":{{\"kind\":\"gpus\",\"gpus\":[{{\"index\":0}}]}}}}\\n' \
         > wait-00000000000000000009.json && printf '{{\"event\":\"start\",\"id\":\"f\",\
         \"user\":\"root\",\"host\":\"h\",\"pid\":1,\"gpu\":\"0\",\"bytes\":null,\"time\":1,\
         \"command\":[]}}\\n' > usage-65534.jsonl && echo forged && \
         exec perl -e 'for (@ARGV) {{ open(my $f, \"+<\", $_) or die; push @k, $f; \
         my $l = pack(\"s s x4 q q i x4\", 1, 0, 0, 0, 0); fcntl($f, 37, $l) or die \"$_: $!\" }} \
         sleep 600' held-gpu-0.1-0-1-0.json wait-00000000000000000009.json",
        dir = dir.display()
    );
    let mut forger = as_nobody("sh")
        .args(["-c", &forge])
        .process_group(0)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(forger.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "forged");
    let view = |args: &[&str]| {
        common::until("the forged records locked", || {
            let out = torchtools(&dir).arg("locks").output().unwrap();
            String::from_utf8_lossy(&out.stdout).contains("records ignored")
        });
        let out = torchtools(&dir).args(args).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let says = "written by uid 65534 (nobody), claims root";
    let locks = view(&["locks"]);
    assert!(
        locks.contains(&format!("held by pid {root_pid} (root@")),
        "{locks}"
    );
    assert!(
        locks.contains("2 records ignored:") && locks.contains(says),
        "{locks}"
    );
    let queue = view(&["queue"]);
    assert!(
        !queue.contains("#1"),
        "the forged ticket is no request: {queue}"
    );
    assert!(queue.contains(says), "{queue}");
    let usage = view(&["usage", "--by", "user"]);
    assert!(
        usage.contains("1 record ignored:") && usage.contains(says),
        "{usage}"
    );
    assert!(
        !usage
            .lines()
            .any(|l| l.starts_with("root") && l.contains("2 running")),
        "{usage}"
    );
    // nobody's own request meets the real holder.
    let out = as_nobody(env!("CARGO_BIN_EXE_torchtools"))
        .args([
            "reserve",
            "--gpu",
            "0",
            "--no-fence",
            "--timeout",
            "1s",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("pid {root_pid} (root@")), "{err}");
    // Each group whole (torchtools and its command; runuser and the forger's shell,
    // flocks and sleep): nothing of the test outlives it.
    for mut child in [held, forger] {
        // SAFETY: kill(2) of a process group this test started.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        let _ = child.wait();
    }
}

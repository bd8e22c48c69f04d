//! `torchtools top` as users see it: `--once` and `--json` as text, and the live view in
//! a real terminal (tmux: keys sent, the screen read back), on a scenario of real
//! locks and real waiting `torchtools reserve` processes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tt_lock::{GpuKey, GpuLock, Holder, LockDir, Wait};

use crate::common::{key0, pids_of, torchtools, until, PATIENCE};

fn run(dir: &Path, args: &[&str], columns: &str) -> Output {
    torchtools(dir)
        .args(args)
        .env("COLUMNS", columns)
        .output()
        .unwrap()
}

/// GPU 0 held by this process for a "training job", GPU index 9 held too (a second
/// row to select), and two `torchtools reserve` waiting for GPU 0.
struct Scenario {
    _tmp: tempfile::TempDir,
    dir: LockDir,
    _locks: Vec<GpuLock>,
    waiters: Vec<Child>,
}

impl Scenario {
    fn new() -> Scenario {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let job = Holder::current()
            .reserving(tt_device::Bytes::gib(3))
            .running(["python", "train.py", "--epochs", "3"]);
        let locks = vec![
            dir.lock(&key0(), Wait::Try, job.clone()).unwrap(),
            dir.lock(&GpuKey::Index(9), Wait::Try, job).unwrap(),
        ];
        let mut waiters = Vec::new();
        for timeout in [Some("5m"), None] {
            let mut cmd = torchtools(dir.path());
            cmd.args(["reserve", "--gpu", "0", "--no-fence", "--bytes", "1GiB"]);
            if let Some(t) = timeout {
                cmd.args(["--timeout", t]);
            }
            let child = cmd
                .args(["--", "sh", "-c", "exit 0"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let pid = child.id();
            until("a waiter in the queue", || {
                dir.queue().unwrap().iter().any(|w| w.who.pid == pid)
            });
            waiters.push(child);
        }
        Scenario {
            _tmp: tmp,
            dir,
            _locks: locks,
            waiters,
        }
    }

    fn pids(&self) -> Vec<u32> {
        self.waiters.iter().map(Child::id).collect()
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        for child in &mut self.waiters {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn nvml() -> bool {
    matches!(
        tt_device::Inventory::query().nvml,
        tt_device::NvmlStatus::Available { .. }
    )
}

#[test]
fn once_prints_the_holders_the_waiters_and_why_gpu_columns_are_empty() {
    let scene = Scenario::new();
    let out = run(scene.dir.path(), &["top", "--once"], "140");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("torchtools top  "), "{text}");
    assert!(
        text.contains(&scene.dir.path().display().to_string()),
        "{text}"
    );
    if !nvml() {
        assert!(
            text.contains("NVML unavailable (") && text.contains("locks and the queue are below"),
            "{text}"
        );
    }
    let me = std::process::id();
    // The selected GPU (the first) is held by this process's "training job", with
    // both waiters listed in their order.
    assert!(
        text.contains(&format!("held by pid {me} ("))
            && text.contains("python train.py --epochs 3"),
        "{text}"
    );
    assert!(text.contains("reserving 3.00 GiB"), "{text}");
    assert!(text.contains("2 waiting:"), "{text}");
    let pids = scene.pids();
    let first = text
        .find(&format!("#1 root pid {}", pids[0]))
        .or_else(|| text.find(&format!("pid {} for", pids[0])));
    let second = text.find(&format!("pid {} for", pids[1]));
    assert!(
        matches!((first, second), (Some(a), Some(b)) if a < b),
        "waiters in order: {text}"
    );
    // The queue table: position, pid, what each asks for, its bytes.
    let rows: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.split_whitespace().collect())
        .filter(|cells: &Vec<&str>| cells.len() > 4 && (cells[0] == "1" || cells[0] == "2"))
        .filter(|cells| pids.iter().any(|p| cells[2] == p.to_string()))
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    assert_eq!(rows[0][2], pids[0].to_string());
    assert_eq!(rows[1][2], pids[1].to_string());
    assert!(rows[0].contains(&"1.00"), "{text}");
    // The frame ends with the keys and a newline; a narrow frame stays inside its width.
    assert!(
        text.trim_end().ends_with("refreshes every second"),
        "{text}"
    );
    let narrow =
        String::from_utf8(run(scene.dir.path(), &["top", "--once", "--compact"], "60").stdout)
            .unwrap();
    assert!(narrow.lines().all(|l| l.chars().count() <= 60), "{narrow}");
    assert!(narrow.trim_end().ends_with("c full"), "{narrow}");
}

#[test]
fn json_is_one_snapshot_of_locks_queue_and_gpus() {
    let scene = Scenario::new();
    let out = run(scene.dir.path(), &["top", "--json"], "80");
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout.ends_with(b"}\n"), "one document and a newline");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let gpus = json["gpus"].as_array().unwrap();
    let key0 = serde_json::to_value(key0()).unwrap();
    let gpu0 = gpus.iter().find(|g| g["key"] == key0).unwrap();
    assert_eq!(gpu0["holder"]["pid"], std::process::id());
    assert_eq!(gpu0["holder"]["reserved"], 3u64 << 30);
    assert_eq!(gpu0["waiting"], serde_json::json!([1, 2]));
    let nine = gpus
        .iter()
        .find(|g| g["key"] == serde_json::json!({"index": 9}))
        .unwrap();
    assert_eq!(nine["waiting"], serde_json::json!([]));
    assert_eq!(pids_of(&json["queue"]), scene.pids());
    assert_eq!(
        json["nvml"]["status"],
        if nvml() { "available" } else { "unavailable" }
    );
}

#[test]
fn without_a_terminal_top_says_to_use_once_or_json() {
    let tmp = tempfile::tempdir().unwrap();
    let out = torchtools(&tmp.path().join("locks"))
        .arg("top")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs a terminal") && err.contains("--once"),
        "{err}"
    );
}

/// A tmux server of this test's own (its socket in the temporary directory).
struct Tmux {
    socket: PathBuf,
}

impl Tmux {
    fn cmd(&self, args: &[&str]) -> Output {
        let out = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "tmux cannot be run ({e}): the live-view test needs it; install it \
                     (Debian: apt-get install tmux)"
                )
            });
        assert!(out.status.success(), "tmux {args:?}: {out:?}");
        out
    }

    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.cmd(&["capture-pane", "-p", "-t", "top"]).stdout).into_owned()
    }

    /// Waits until the screen shows `what`; returns it.
    fn until_screen(&self, what: &str, check: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let screen = self.screen();
            if check(&screen) {
                return screen;
            }
            assert!(
                start.elapsed() < PATIENCE,
                "the screen never showed {what}:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .arg("kill-server")
            .output();
    }
}

#[test]
fn the_live_view_in_a_real_terminal_follows_keys_and_resizes() {
    let scene = Scenario::new();
    let tmp = tempfile::tempdir().unwrap();
    let status = tmp.path().join("status");
    let tmux = Tmux {
        socket: tmp.path().join("tmux.sock"),
    };
    let script = format!(
        "TORCHTOOLS_LOCK_DIR='{}' '{}' top; echo $? > '{}'; sleep 600",
        scene.dir.path().display(),
        env!("CARGO_BIN_EXE_torchtools"),
        status.display()
    );
    tmux.cmd(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "120",
        "-y",
        "40",
        "sh",
        "-c",
        &script,
    ]);
    let me = std::process::id().to_string();
    let pids = scene.pids();
    // The whole frame: a capture can come while the terminal is still drawing its
    // last lines (the footer, under load).
    let screen = tmux.until_screen("the holder and both waiters, and the footer", |s| {
        s.contains("torchtools top")
            && s.contains(&format!("held by pid {me} ("))
            && pids.iter().all(|p| s.contains(&p.to_string()))
            && s.contains("refreshes every second")
    });
    assert!(screen.contains("2 waiting:"), "{screen}");
    // The arrow keys select the next GPU: the panel follows. GPU index 9 is the last row,
    // after the GPUs NVML lists (none here, some on a GPU machine).
    let rows_before_nine = tt_device::Inventory::query().gpus.len().max(1);
    for _ in 0..rows_before_nine {
        tmux.cmd(&["send-keys", "-t", "top", "Down"]);
    }
    tmux.until_screen("GPU index 9 selected", |s| {
        s.contains("selected: GPU index 9") && s.contains("nobody waits for it")
    });
    for _ in 0..rows_before_nine {
        tmux.cmd(&["send-keys", "-t", "top", "Up"]);
    }
    tmux.until_screen("the first GPU selected again", |s| s.contains("2 waiting:"));
    // c: the compact view, and back.
    tmux.cmd(&["send-keys", "-t", "top", "c"]);
    tmux.until_screen("the compact view", |s| s.contains("c full"));
    tmux.cmd(&["send-keys", "-t", "top", "c"]);
    tmux.until_screen("the full view", |s| s.contains("c compact view"));
    // A narrow, short terminal: redrawn inside it, still running.
    tmux.cmd(&["resize-window", "-t", "top", "-x", "50", "-y", "15"]);
    let narrow = tmux.until_screen("a redraw at 50 columns", |s| {
        s.contains("torchtools top") && s.lines().all(|l| l.chars().count() <= 50)
    });
    assert!(!status.exists(), "top exited on a resize:\n{narrow}");
    tmux.cmd(&["resize-window", "-t", "top", "-x", "120", "-y", "40"]);
    // q quits with status 0.
    tmux.cmd(&["send-keys", "-t", "top", "q"]);
    let start = Instant::now();
    while std::fs::read_to_string(&status).map_or(true, |s| s.trim().is_empty()) {
        assert!(
            start.elapsed() < PATIENCE,
            "q did not quit:\n{}",
            tmux.screen()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(std::fs::read_to_string(&status).unwrap().trim(), "0");
}

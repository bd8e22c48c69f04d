//! Helpers shared by the command's test modules.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tt_lock::{GpuKey, GpuSpec};

/// The longest any awaited event may take on a busy machine.
pub(crate) const PATIENCE: Duration = Duration::from_secs(120);

/// The `torchtools` binary with `dir` as its lock directory, no inherited locks, no
/// `CUDA_VISIBLE_DEVICES`, stdin closed.
pub(crate) fn torchtools(dir: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_torchtools"));
    cmd.env("TORCHTOOLS_LOCK_DIR", dir)
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("TORCHTOOLS_HELD_LOCKS")
        .stdin(Stdio::null());
    cmd
}

/// `torchtools` for jobs: `dir/locks` its lock directory, `dir/state` the user's state
/// directory (where logs go), `dir/config` the user's config directory (no default hook
/// from the machine's user), not inside a job.
pub(crate) fn tt(dir: &Path) -> Command {
    let mut c = torchtools(&dir.join("locks"));
    c.env("XDG_STATE_HOME", dir.join("state"))
        .env("XDG_CONFIG_HOME", dir.join("config"))
        .env_remove("TORCHTOOLS_JOB_ID");
    c
}

/// A command's standard output, once it succeeded (its whole output said otherwise).
pub(crate) fn ok(out: std::process::Output) -> String {
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap_or_else(|e| panic!("{e}"))
}

/// Starts a detached job with [`tt`]: its id (the one line it prints).
pub(crate) fn detach(dir: &Path, args: &[&str]) -> String {
    let out = tt(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    ok(out).trim().to_owned()
}

/// The key `--gpu 0` takes on this machine (its UUID with NVML, else index 0).
pub(crate) fn key0() -> GpuKey {
    GpuSpec::Nvml(0)
        .resolve(&tt_device::Inventory::query())
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Polls `done` every 20 ms for up to [`PATIENCE`]; fails the test naming `what`.
pub(crate) fn until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < PATIENCE, "still waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The `pid` of every entry of a JSON list (`queue --json`'s waiters, `top --json`'s
/// queue), in order.
pub(crate) fn pids_of(list: &serde_json::Value) -> Vec<u32> {
    list.as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(|w| {
            w["pid"]
                .as_u64()
                .and_then(|p| u32::try_from(p).ok())
                .unwrap_or_else(|| panic!("no pid in {w}"))
        })
        .collect()
}

/// A scratch directory two Unix users can share (mode 01777, as `/tmp` is), for a test
/// that runs a second user (`nobody`, through `runuser`, which needs root). Without
/// root: `None` after a printed "SKIPPED" line where `TORCHTOOLS_TEST_NO_MOUNT` says
/// why, else the test fails.
pub(crate) fn shared_dir_for_two_users() -> Option<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tt_testkit::skip_knowingly(
            "a second user needs root (runuser)",
            "a second user needs root (runuser): run as root, or set \
             TORCHTOOLS_TEST_NO_MOUNT=<why> to skip this test knowingly",
        );
        return None;
    }
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    Some(tmp)
}

/// `torchtools ARGS` in a new PID namespace (as in a container sharing the lock
/// directory): `None` (printed, chosen) where namespaces need root and
/// TORCHTOOLS_TEST_NO_MOUNT says why; a failure otherwise.
pub(crate) fn in_container(dir: &Path) -> Option<Command> {
    let works = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !works {
        tt_testkit::skip_knowingly(
            "a PID namespace (unshare --pid needs root)",
            &format!(
                "`unshare --pid --fork --mount-proc` failed (it needs root): run as root, or \
                 set {}=<why> to skip this test knowingly",
                tt_testkit::NO_MOUNT_ENV
            ),
        );
        return None;
    }
    // --kill-child: killing `unshare` kills the namespace's first process, and with it
    // every process of the namespace, as stopping a container does.
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--pid",
        "--fork",
        "--mount-proc",
        "--kill-child",
        env!("CARGO_BIN_EXE_torchtools"),
    ])
    .env("TORCHTOOLS_LOCK_DIR", dir)
    .env_remove("CUDA_VISIBLE_DEVICES")
    .env_remove("TORCHTOOLS_HELD_LOCKS")
    .stdin(Stdio::null());
    Some(cmd)
}

/// Ends a child when the test ends, however it ends: SIGTERM (a `reserve` passes it to
/// its command and releases; a server stops), SIGKILL if it lingers past 30 s.
pub(crate) struct Killed(pub(crate) std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let Ok(pid) = i32::try_from(self.0.id()) else {
            return;
        };
        // SAFETY: kill(2) of our own child's pid, which we have not reaped yet.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Stops a detached job (`dir`, its id) when the test ends, however it ends.
pub(crate) struct Stopped<'a>(pub(crate) &'a Path, pub(crate) String);

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        let _ = tt(self.0).args(["stop", &self.1, "--grace", "1s"]).output();
    }
}

/// A TCP port free on loopback now.
pub(crate) use tt_testkit::free_port;

/// Sends `GET path` with a 64 KiB header to the server on `port` and checks it was
/// refused without being read whole: the answer is `431 Request Header Fields Too
/// Large` (or the connection is closed under the sender, before the answer is read),
/// and it comes at once, never after the read's 60 s bound (a server that read the
/// head whole and hung would end the read by its timeout).
pub(crate) fn refuses_a_64_kib_head(port: u16, path: &str) {
    use std::io::{ErrorKind, Read, Write};
    let mut big = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    big.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let header = "a".repeat(64 * 1024);
    let _ = write!(
        big,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: {header}\r\n\r\n"
    );
    let mut answer = Vec::new();
    let ended = big.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        !matches!(&ended, Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)),
        "no answer to a 64 KiB head in 60 s: {ended:?}"
    );
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 431 "),
        "a 64 KiB head answered {:?}",
        &answer[..answer.len().min(200)]
    );
}

//! tt-lock against real processes: contention, `kill -9`, timeouts, hostile paths,
//! permissions (as an unprivileged uid when the tests run as root).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tt_lock::{Error, GpuKey, Holder, LockDir, Wait};

use crate::common;
use common::PATIENCE;

const ROLE: &str = "TT_LOCK_TEST_ROLE";
const DIR: &str = "TT_LOCK_TEST_DIR";

/// The child side of every test: does nothing unless started by a test below with
/// `TT_LOCK_TEST_ROLE` set (the test binary re-executes itself with `--exact child`).
#[test]
#[ignore = "a child process's entry point, run by the cross-process lock tests"]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let dir_path = PathBuf::from(std::env::var(DIR).unwrap_or_default());
    match role.as_str() {
        // Take two locks in turn many times; log each hold's interval.
        "contend" => {
            let dir = LockDir::open(&dir_path).unwrap();
            let rounds: usize = std::env::var("ROUNDS").unwrap().parse().unwrap();
            let me: usize = std::env::var("ME").unwrap().parse().unwrap();
            let mut log = std::fs::OpenOptions::new()
                .append(true)
                .open(dir_path.join("intervals.log"))
                .unwrap();
            for round in 0..rounds {
                let key = GpuKey::Index(((me + round) % 2) as u32);
                let lock = dir.lock(&key, Wait::Block, Holder::current()).unwrap();
                let start = now_ns();
                std::thread::sleep(Duration::from_micros(300));
                let end = now_ns();
                drop(lock);
                // One write per line (O_APPEND): lines from processes never interleave.
                log.write_all(format!("{} {start} {end}\n", key.file_name()).as_bytes())
                    .unwrap();
            }
        }
        // Take a lock, say so, and hold it until killed.
        "hold" => {
            // Never outlive a test that failed before killing us.
            // SAFETY: prctl(PR_SET_PDEATHSIG) has no memory-safety preconditions.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
            let dir = LockDir::open(&dir_path).unwrap();
            let key = match std::env::var("UUID") {
                Ok(uuid) => GpuKey::Uuid(uuid),
                Err(_) => GpuKey::Index(std::env::var("GPU").unwrap().parse().unwrap()),
            };
            let _lock = dir.lock(&key, Wait::Block, Holder::current()).unwrap();
            println!("\n@@locked@@");
            std::io::stdout().flush().unwrap();
            std::thread::sleep(Duration::from_secs(600));
        }
        // Take GPU 4 (inherited from the parent, or not), record this pid as the
        // command's, try GPU 5, and let go.
        "inherit" => {
            let dir = LockDir::open(&dir_path).unwrap();
            match dir.lock(&GpuKey::Index(4), Wait::Try, Holder::current()) {
                Ok(mut lock) => {
                    let mut h = lock.holder().clone();
                    h.command_pid = Some(std::process::id());
                    lock.set_holder(h).unwrap();
                    println!("\n@@4: inherited={}@@", lock.is_inherited());
                }
                Err(e) => println!("\n@@4: {e}@@"),
            }
            let five = dir
                .lock(&GpuKey::Index(5), Wait::Try, Holder::current())
                .unwrap();
            println!("\n@@5: inherited={}@@", five.is_inherited());
        }
        // Wait for GPUs 3 and 4 together; say so once granted.
        "wait_set" => {
            // SAFETY: prctl(PR_SET_PDEATHSIG) has no memory-safety preconditions.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
            let dir = LockDir::open(&dir_path).unwrap();
            let keys = [GpuKey::Index(3), GpuKey::Index(4)];
            let locks = dir
                .lock_many(&keys, Wait::Block, Holder::current())
                .unwrap();
            println!("\n@@granted {}@@", locks.len());
        }
        // Two GPUs by `auto` (one of them inherited, or not); say how many of each.
        "inherit_auto" => {
            let dir = LockDir::open(&dir_path).unwrap();
            for count in [2, 1] {
                let locks = dir
                    .lock_auto(&three_gpus(), count, Wait::Try, Holder::current())
                    .unwrap();
                let inherited = locks.iter().filter(|l| l.is_inherited()).count();
                println!("\n@@auto: {} locks, {inherited} inherited@@", locks.len());
            }
        }
        // The directory TORCHTOOLS_LOCK_DIR names (the test sets it, or not).
        "from_env" => match LockDir::from_env() {
            Ok(d) => println!("\n@@dir={}@@", d.path().display()),
            Err(e) => println!("\n@@error={e}@@"),
        },
        // Try to use a directory; print the error.
        "open" => match LockDir::open(&dir_path).and_then(|d| {
            d.lock(&GpuKey::Index(0), Wait::Try, Holder::current())
                .map(drop)
        }) {
            Ok(()) => println!("\n@@OK@@"),
            Err(e) => println!("ERROR: {e}"),
        },
        other => panic!("unknown role {other}"),
    }
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

fn spawn(role: &str, dir: &Path, extra: &[(&str, String)]) -> Command {
    let mut cmd = tt_testkit::rerun("child");
    cmd.env(ROLE, role).env(DIR, dir).stdin(Stdio::null());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd
}

/// Starts a child that holds `gpu` and returns once it has it.
fn holder(dir: &Path, gpu: u32) -> Child {
    holder_of(dir, &[("GPU", gpu.to_string())])
}

/// Starts a child that holds the GPU of this UUID and returns once it has it.
fn holder_by_uuid(dir: &Path, uuid: &str) -> Child {
    holder_of(dir, &[("UUID", uuid.to_owned())])
}

/// A holder child killed (and reaped) when this is dropped, also while a failed
/// assertion unwinds: a request queued behind it is then served, and the test fails at
/// once instead of after the request's own timeout.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn holder_of(dir: &Path, which: &[(&str, String)]) -> Child {
    let mut child = spawn("hold", dir, which)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "holder exited early");
        if line.contains("@@locked@@") {
            break;
        }
    }
    child
}

/// What `list` says of one GPU's lock.
fn state_of(dir: &LockDir, gpu: &GpuKey) -> tt_lock::LockState {
    dir.list()
        .unwrap()
        .into_iter()
        .find(|s| s.gpu == *gpu)
        .unwrap_or_else(|| panic!("no lock file for {gpu}"))
}

fn lock_dir() -> (tempfile::TempDir, LockDir) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = LockDir::open(tmp.path().join("locks")).unwrap();
    (tmp, dir)
}

#[test]
fn sixteen_processes_never_hold_one_lock_at_once() {
    let (_tmp, dir) = lock_dir();
    std::fs::write(dir.path().join("intervals.log"), "").unwrap();
    let rounds = 25;
    let children: Vec<Child> = (0..16)
        .map(|me| {
            spawn(
                "contend",
                dir.path(),
                &[("ROUNDS", rounds.to_string()), ("ME", me.to_string())],
            )
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let log = std::fs::read_to_string(dir.path().join("intervals.log")).unwrap();
    let mut by_lock: std::collections::BTreeMap<String, Vec<(u128, u128)>> = Default::default();
    for line in log.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        by_lock
            .entry(f[0].to_owned())
            .or_default()
            .push((f[1].parse().unwrap(), f[2].parse().unwrap()));
    }
    assert_eq!(by_lock.len(), 2);
    let total: usize = by_lock.values().map(Vec::len).sum();
    assert_eq!(total, 16 * rounds, "every hold was logged");
    for (lock, mut intervals) in by_lock {
        intervals.sort();
        for pair in intervals.windows(2) {
            assert!(
                pair[0].1 <= pair[1].0,
                "two holders of {lock} overlap: {:?} and {:?}",
                pair[0],
                pair[1]
            );
        }
    }
}

#[test]
fn a_blocked_waiter_gets_the_lock_when_the_holder_is_killed() {
    let (_tmp, dir) = lock_dir();
    let mut child = holder(dir.path(), 0);
    let pid = child.id();
    let waiter = {
        let dir = dir.clone();
        std::thread::spawn(move || {
            let lock = dir.lock(&GpuKey::Index(0), Wait::Block, Holder::current());
            (lock.map(|l| l.holder().who.pid), Instant::now())
        })
    };
    // Queued (its ticket is in the queue), and still waiting for the holder.
    let start = Instant::now();
    while dir.queue().unwrap().is_empty() {
        assert!(start.elapsed() < PATIENCE, "the waiter never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!waiter.is_finished(), "the waiter must wait for the holder");
    let killing = Instant::now();
    // SAFETY: kill with a child's pid.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    child.wait().unwrap();
    let (got, when) = waiter.join().unwrap();
    assert_eq!(got.unwrap(), std::process::id());
    // Granted after the kill, never before (a wait that is not one would pass early).
    assert!(
        when > killing,
        "granted {:?} before the holder was killed",
        killing - when
    );
}

#[test]
fn timeout_and_try_name_the_holder_and_timeout_is_never_early() {
    let (_tmp, dir) = lock_dir();
    let mut child = holder(dir.path(), 1);
    let key = GpuKey::Index(1);

    match dir.lock(&key, Wait::Try, Holder::current()) {
        Err(Error::WouldBlock { gpu, holder, .. }) => {
            assert_eq!(gpu, key);
            assert_eq!(holder.unwrap().who.pid, child.id());
        }
        other => panic!("expected WouldBlock, got {other:?}"),
    }

    for limit in [
        Duration::ZERO,
        Duration::from_millis(10),
        Duration::from_millis(300),
    ] {
        let start = Instant::now();
        let result = dir.lock(&key, Wait::Timeout(limit), Holder::current());
        let took = start.elapsed();
        match result {
            Err(e @ Error::Timeout { .. }) => {
                let text = e.to_string();
                assert!(text.contains(&format!("pid {}", child.id())), "{text}");
                if let Error::Timeout { waited, .. } = e {
                    assert!(
                        waited >= limit,
                        "returned after {waited:?}, before {limit:?}"
                    );
                }
            }
            other => panic!("expected Timeout, got {other:?}"),
        }
        assert!(
            took >= limit,
            "returned after {took:?}, before the deadline {limit:?}"
        );
        // Not stuck: a bound far past the deadline, whatever the machine's load.
        assert!(took < limit + PATIENCE, "{took:?} for {limit:?}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
    // Free now: a lock that may not wait at all is granted.
    let lock = dir.lock(&key, Wait::Try, Holder::current());
    assert!(lock.is_ok(), "{lock:?}");
}

#[test]
fn list_shows_holders_and_a_dead_holders_record_as_free() {
    let (_tmp, dir) = lock_dir();
    let mut child = holder(dir.path(), 2);
    let held = dir.list().unwrap();
    assert_eq!(held.len(), 1);
    assert!(held[0].held);
    let record = held[0].holder.clone().unwrap();
    assert_eq!(record.who.pid, child.id());
    assert_eq!(record.gpu, "2");
    assert!(!record.who.command.is_empty());

    child.kill().unwrap(); // SIGKILL: no cleanup ran, the record file stays
    child.wait().unwrap();
    let text = std::fs::read_to_string(holder_record(dir.path(), "gpu-2")).unwrap();
    assert!(text.contains(&format!("\"pid\":{}", child.id())), "{text}");
    let after = dir.list().unwrap();
    assert!(!after[0].held, "the kernel released it: {after:?}");
    assert_eq!(after[0].holder, None);
}

#[test]
fn one_process_cannot_wait_for_itself() {
    let (_tmp, dir) = lock_dir();
    let key = GpuKey::Index(3);
    let lock = dir.lock(&key, Wait::Block, Holder::current()).unwrap();
    let again = dir.lock(&key, Wait::Block, Holder::current());
    assert!(matches!(again, Err(Error::AlreadyHeld { .. })), "{again:?}");
    drop(lock);
    assert!(dir.lock(&key, Wait::Try, Holder::current()).is_ok());
}

#[test]
fn sets_are_all_or_nothing() {
    let (_tmp, dir) = lock_dir();
    let mut child = holder(dir.path(), 5);
    let keys = [GpuKey::Index(6), GpuKey::Index(5), GpuKey::Index(4)];
    let r = dir.lock_many(&keys, Wait::Try, Holder::current());
    assert!(
        matches!(
            r,
            Err(Error::WouldBlock {
                gpu: GpuKey::Index(5),
                ..
            })
        ),
        "{r:?}"
    );
    // Nothing stayed locked by the failed attempt.
    assert!(dir
        .list()
        .unwrap()
        .iter()
        .all(|s| s.held == (s.gpu == GpuKey::Index(5))));
    child.kill().unwrap();
    child.wait().unwrap();
    let locks = dir.lock_many(&keys, Wait::Try, Holder::current()).unwrap();
    let got: Vec<_> = locks.iter().map(|l| l.key().clone()).collect();
    assert_eq!(got, [GpuKey::Index(4), GpuKey::Index(5), GpuKey::Index(6)]);
}

#[test]
fn a_planted_symlink_is_never_followed() {
    let (tmp, dir) = lock_dir();
    let target = tmp.path().join("victim");
    std::fs::write(&target, "precious").unwrap();
    symlink(&target, dir.path().join("gpu-0.lock")).unwrap();
    let e = dir
        .lock(&GpuKey::Index(0), Wait::Try, Holder::current())
        .unwrap_err();
    assert!(matches!(e, Error::Unsafe { .. }), "{e:?}");
    assert!(e.to_string().contains("symbolic link"), "{e}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious");
    // list() skips it too, without touching the target.
    assert!(dir.list().unwrap().is_empty());
}

#[test]
fn a_lock_path_that_is_not_a_regular_file_is_refused() {
    let (_tmp, dir) = lock_dir();
    std::fs::create_dir(dir.path().join("gpu-0.lock")).unwrap();
    let fifo = std::ffi::CString::new(
        dir.path()
            .join("gpu-1.lock")
            .into_os_string()
            .into_encoded_bytes(),
    )
    .unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o666) }, 0);
    for gpu in [0, 1] {
        let e = dir
            .lock(&GpuKey::Index(gpu), Wait::Try, Holder::current())
            .unwrap_err();
        assert!(e.to_string().contains("gpu-"), "{e}");
        // Refused by the check itself, naming the fix, not by a later write failing.
        assert!(matches!(e, Error::Unsafe { .. }), "gpu {gpu}: {e:?}");
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
}

#[test]
fn unsafe_directories_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // World-writable without the sticky bit.
    let open = tmp.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = LockDir::open(&open).unwrap_err();
    assert!(e.to_string().contains("chmod +t"), "{e}");
    // A symbolic link to a directory.
    let real = tmp.path().join("real");
    std::fs::create_dir(&real).unwrap();
    symlink(&real, tmp.path().join("link")).unwrap();
    let e = LockDir::open(tmp.path().join("link")).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    // A file.
    std::fs::write(tmp.path().join("file"), "").unwrap();
    let e = LockDir::open(tmp.path().join("file")).unwrap_err();
    assert!(e.to_string().contains("not a directory"), "{e}");
}

#[test]
fn a_new_directory_is_sticky_and_writable_by_all_and_files_are_0644_whatever_the_umask() {
    let tmp = tempfile::tempdir().unwrap();
    // SAFETY: umask has no preconditions; a restrictive umask must not matter.
    let old = unsafe { libc::umask(0o077) };
    let result = LockDir::open(tmp.path().join("a/b/locks")).and_then(|d| {
        let lock = d.lock(&GpuKey::Index(0), Wait::Try, Holder::current())?;
        Ok((d, lock))
    });
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let (dir, lock) = result.unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(dir.path()), 0o1777);
    // Every user reads the lock file (which is all a lock needs), the holder's record
    // and the usage log; only their owner writes them.
    assert_eq!(mode(lock.path()), 0o644);
    assert_eq!(mode(&holder_record(dir.path(), "gpu-0")), 0o644);
    // SAFETY: geteuid has no preconditions.
    assert_eq!(mode(&dir.usage_log_path(unsafe { libc::geteuid() })), 0o644);
}

/// Runs the `open` role on `dir` as an unprivileged user when this is root (root
/// can write anywhere), else as this user; returns what it printed.
fn open_as_unprivileged(dir: &Path) -> String {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    // The unprivileged user may not reach target/: it runs a copy.
    let copy = root.then(|| tt_testkit::users::RunnableCopy::new("tt-lock-test"));
    let program = match &copy {
        Some(copy) => copy.path().to_path_buf(),
        None => std::env::current_exe().unwrap(),
    };
    let mut cmd = Command::new(&program);
    cmd.args(tt_testkit::rerun_args("child"))
        .env(ROLE, "open")
        .env(DIR, dir)
        .current_dir("/");
    if root {
        use std::os::unix::process::CommandExt;
        cmd.uid(65534).gid(65534);
    }
    let out = tt_testkit::users::retry_while_busy(|| cmd.output()).unwrap();
    drop(copy);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn a_directory_this_user_cannot_write_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = tmp.path().join("locked-down");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = open_as_unprivileged(&dir);
    assert!(out.contains("ERROR: the GPU lock directory"), "{out}");
    assert!(out.contains("cannot create files in it"), "{out}");
    assert!(out.contains("TORCHTOOLS_LOCK_DIR"), "{out}");

    // And a lock file someone left unreadable by others.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
    std::fs::write(dir.join("gpu-0.lock"), "").unwrap();
    std::fs::set_permissions(
        dir.join("gpu-0.lock"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let out = open_as_unprivileged(&dir);
    assert!(out.contains("chmod 644"), "{out}");

    // A correctly shared directory works for that user: a lock needs no more than
    // reading the file.
    std::fs::set_permissions(
        dir.join("gpu-0.lock"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    assert!(open_as_unprivileged(&dir).contains("@@OK@@"));
}

/// A machine of three GPUs with 10, 70 and 40 GiB free (what NVML would say).
fn three_gpus() -> tt_device::Inventory {
    let free = [10, 70, 40];
    tt_device::Inventory {
        nvml: tt_device::NvmlStatus::Available {
            driver_version: "test".into(),
        },
        gpus: (0..3)
            .map(|i| tt_device::GpuInfo {
                nvml_index: i,
                uuid: uuid(i),
                name: "H100".into(),
                total: tt_device::Bytes::gib(80),
                free: tt_device::Bytes::gib(free[i as usize]),
                used: tt_device::Bytes::gib(80 - free[i as usize]),
                utilization: None,
                processes: vec![],
                mig: vec![],
            })
            .collect(),
        errors: vec![],
    }
}

fn uuid(i: u32) -> String {
    format!("GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-4000-8000-000000000000")
}

fn uuids(locks: &[tt_lock::GpuLock]) -> Vec<GpuKey> {
    locks.iter().map(|l| l.key().clone()).collect()
}

#[test]
fn auto_takes_the_free_gpus_with_the_most_free_memory_all_or_nothing() {
    let (_tmp, dir) = lock_dir();
    let inv = three_gpus();
    let me = Holder::current;
    let one = dir.lock_auto(&inv, 1, Wait::Try, me()).unwrap();
    assert_eq!(uuids(&one), [GpuKey::Uuid(uuid(1))], "70 GiB free");
    drop(one);
    let two = dir.lock_auto(&inv, 2, Wait::Try, me()).unwrap();
    assert_eq!(
        uuids(&two),
        [GpuKey::Uuid(uuid(1)), GpuKey::Uuid(uuid(2))],
        "70 then 40 GiB"
    );
    drop(two);
    // The best one held by another process: the next best.
    let mut child = holder_by_uuid(dir.path(), &uuid(1));
    let one = dir.lock_auto(&inv, 1, Wait::Try, me()).unwrap();
    assert_eq!(uuids(&one), [GpuKey::Uuid(uuid(2))]);
    drop(one);
    // Three asked, two free: none taken, and the busy one named.
    let r = dir.lock_auto(&inv, 3, Wait::Try, me());
    assert!(
        matches!(&r, Err(Error::WouldBlock { gpu: GpuKey::Uuid(u), .. }) if *u == uuid(1)),
        "{r:?}"
    );
    let held: Vec<GpuKey> = dir
        .list()
        .unwrap()
        .into_iter()
        .filter(|s| s.held)
        .map(|s| s.gpu)
        .collect();
    assert_eq!(
        held,
        [GpuKey::Uuid(uuid(1))],
        "nothing kept by the failed attempt"
    );
    // Waiting for all three: a timeout at its deadline, never before.
    let limit = Duration::from_millis(300);
    let start = Instant::now();
    let r = dir.lock_auto(&inv, 3, Wait::Timeout(limit), me());
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert!(start.elapsed() >= limit);
    // Once the holder is gone, all three.
    child.kill().unwrap();
    child.wait().unwrap();
    let all = dir.lock_auto(&inv, 3, Wait::Try, me()).unwrap();
    assert_eq!(all.len(), 3);
    drop(all);
    // A GPU this process holds is no candidate: it would wait for itself.
    let mine = dir.lock(&GpuKey::Uuid(uuid(1)), Wait::Try, me()).unwrap();
    let e = dir.lock_auto(&inv, 3, Wait::Try, me()).unwrap_err();
    assert!(
        e.to_string().contains("already holds 1 of the machine's 3"),
        "{e}"
    );
    let two = dir.lock_auto(&inv, 2, Wait::Try, me()).unwrap();
    assert_eq!(uuids(&two), [GpuKey::Uuid(uuid(2)), GpuKey::Uuid(uuid(0))]);
    drop((two, mine));
    // More than the machine has, or no NVML: a clear error, nothing waited for.
    let e = dir.lock_auto(&inv, 4, Wait::Block, me()).unwrap_err();
    assert!(e.to_string().contains("the machine has 3 GPU(s)"), "{e}");
    let no_nvml = tt_device::Inventory {
        nvml: tt_device::NvmlStatus::Unavailable {
            reason: "no driver".into(),
        },
        gpus: vec![],
        errors: vec![],
    };
    let e = dir.lock_auto(&no_nvml, 1, Wait::Block, me()).unwrap_err();
    assert!(e.to_string().contains("name them (--gpu 0)"), "{e}");
}

/// The lock files among the descriptors a child shell was started with.
fn inherited_lock_files(share: Option<&tt_lock::GpuLock>) -> String {
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        "for f in /proc/$$/fd/*; do readlink \"$f\"; done; true",
    ]);
    if let Some(lock) = share {
        tt_lock::share_with(&mut cmd, std::slice::from_ref(lock));
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.ends_with(".lock"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn lock_descriptors_are_close_on_exec_unless_shared() {
    let (_tmp, dir) = lock_dir();
    let lock = dir
        .lock(&GpuKey::Index(3), Wait::Try, Holder::current())
        .unwrap();
    let name = lock.path().to_string_lossy().into_owned();
    // A command started the usual way does not get the lock (it would keep the GPU
    // locked after we release it, for as long as it runs).
    assert_eq!(
        inherited_lock_files(None),
        "",
        "no lock descriptor inherited"
    );
    // Handed over on purpose, it does.
    assert_eq!(inherited_lock_files(Some(&lock)), name);
}

#[test]
fn a_lock_file_replaced_while_waiting_is_locked_anew() {
    // A /tmp cleaner deletes a held lock file; a waiter already blocked on it gets the
    // deleted file's lock when the holder goes. It must start over on the new file, or
    // it would hold a lock nobody else sees.
    let (_tmp, dir) = lock_dir();
    let mut child = holder(dir.path(), 7);
    let path = dir.path().join(GpuKey::Index(7).file_name());
    let waiter = {
        let dir = LockDir::open(dir.path()).unwrap();
        std::thread::spawn(move || dir.lock(&GpuKey::Index(7), Wait::Block, Holder::current()))
    };
    // Event: the waiter has the file open (then it blocks on it).
    let opened = |p: &Path| {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .any(|t| t == p)
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !opened(&path) {
        assert!(
            Instant::now() < deadline,
            "the waiter never opened {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::fs::remove_file(&path).unwrap();
    // Someone's next lock creates the file again, before the waiter looks: a file of
    // the same name on the same device, another inode.
    std::fs::File::create(&path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let lock = waiter.join().unwrap().unwrap();
    assert!(path.exists(), "a new lock file was created");
    let state = state_of(&dir, &GpuKey::Index(7));
    assert!(state.held, "the lock others see is held: {state:?}");
    drop(lock);
}

/// `LockDir::from_env()` in a child whose `TORCHTOOLS_LOCK_DIR` is `value` (unset for
/// `None`): what it printed.
fn from_env(value: Option<&str>) -> String {
    let mut cmd = tt_testkit::rerun("child");
    cmd.env(ROLE, "from_env").env_remove("TORCHTOOLS_LOCK_DIR");
    if let Some(v) = value {
        cmd.env("TORCHTOOLS_LOCK_DIR", v);
    }
    let out = cmd.output().unwrap();
    tt_testkit::assert_ran_one(&out);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_environment_names_the_directory_and_it_must_be_absolute() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("from-env");
    let text = from_env(Some(dir.to_str().unwrap()));
    assert!(
        text.contains(&format!("@@dir={}@@", dir.display())),
        "{text}"
    );
    assert!(dir.is_dir(), "created");
    for bad in ["relative/locks", "", "  "] {
        let text = from_env(Some(bad));
        assert!(
            text.contains("TORCHTOOLS_LOCK_DIR") && text.contains("it must be an absolute path"),
            "{bad:?}: {text}"
        );
    }
    let text = from_env(None);
    assert!(
        text.contains(&format!("@@dir={}@@", tt_lock::DEFAULT_LOCK_DIR))
            || text.contains("@@error="),
        "{text}"
    );
}

#[test]
fn a_directory_that_cannot_be_read_or_created_says_which() {
    let tmp = tempfile::tempdir().unwrap();
    // Under a regular file: the path cannot even be looked up.
    let file = tmp.path().join("file");
    std::fs::write(&file, "").unwrap();
    let e = LockDir::open(file.join("locks")).unwrap_err().to_string();
    assert!(e.contains("cannot read it"), "{e}");
    // Where nothing can be created (/proc): looked up fine, then creation fails.
    let e = LockDir::open("/proc/tt-lock-test/locks")
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot create it"), "{e}");
}

#[test]
fn a_shared_lock_is_inherited_by_the_command_which_cannot_release_it() {
    let (_tmp, dir) = lock_dir();
    let lock = dir
        .lock(&GpuKey::Index(4), Wait::Try, Holder::current())
        .unwrap();
    let five = dir
        .lock(&GpuKey::Index(5), Wait::Try, Holder::current())
        .unwrap();
    drop(five);
    let mut cmd = spawn("inherit", dir.path(), &[]);
    tt_lock::share_with(&mut cmd, std::slice::from_ref(&lock));
    let child = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let child_pid = child.id();
    let out = child.wait_with_output().unwrap();
    tt_testkit::assert_ran_one(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("@@4: inherited=true@@"), "{text}");
    assert!(
        text.contains("@@5: inherited=false@@"),
        "only what was shared: {text}"
    );
    // The command let go of its copy: the GPU is still ours, with the command's pid
    // recorded by set_holder.
    let state = state_of(&dir, &GpuKey::Index(4));
    assert!(state.held, "{state:?}");
    assert_eq!(state.holder.and_then(|h| h.command_pid), Some(child_pid));
    // A variable naming a descriptor that is not open, or not this lock file, is no
    // lock: the child has to wait like anyone else.
    let other = std::fs::File::open("/dev/null").unwrap();
    for value in [
        "gpu-4.lock=999".to_owned(),
        format!("gpu-4.lock={}", std::os::fd::AsRawFd::as_raw_fd(&other)),
    ] {
        let mut cmd = spawn("inherit", dir.path(), &[]);
        cmd.env("TORCHTOOLS_HELD_LOCKS", &value);
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("@@4: GPU index 4") && text.contains("is locked by"),
            "{value}: {text}"
        );
    }
    drop(lock);
}

#[test]
fn a_set_with_a_timeout_waits_for_it_then_gives_up_whole() {
    let (_tmp, dir) = lock_dir();
    let mut child = holder(dir.path(), 6);
    let keys = [GpuKey::Index(5), GpuKey::Index(6)];
    let limit = Duration::from_millis(300);
    let start = Instant::now();
    let r = dir.lock_many(&keys, Wait::Timeout(limit), Holder::current());
    assert!(
        matches!(
            r,
            Err(Error::Timeout {
                gpu: GpuKey::Index(6),
                ..
            })
        ),
        "{r:?}"
    );
    assert!(start.elapsed() >= limit, "waited {:?}", start.elapsed());
    assert!(
        dir.list()
            .unwrap()
            .iter()
            .all(|s| s.held == (s.gpu == GpuKey::Index(6))),
        "GPU 5 was let go"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let got = dir
        .lock_many(&keys, Wait::Timeout(limit), Holder::current())
        .unwrap();
    assert_eq!(got.len(), 2);
}

#[test]
fn dropping_a_lock_frees_the_gpu_even_while_a_command_keeps_a_copy_of_it() {
    // `share_with` hands the lock to a command; when this process lets go first (its
    // job done), the GPU is free, not held on by the command's copy of the descriptor.
    let (_tmp, dir) = lock_dir();
    let key = GpuKey::Index(7);
    let lock = dir.lock(&key, Wait::Try, Holder::current()).unwrap();
    let mut cmd = Command::new("sleep");
    cmd.arg("600");
    tt_lock::share_with(&mut cmd, std::slice::from_ref(&lock));
    let mut command = cmd.spawn().unwrap();
    drop(lock);
    let again = dir.lock(&key, Wait::Try, Holder::current());
    let _ = command.kill();
    let _ = command.wait();
    let again = again.unwrap_or_else(|e| panic!("the GPU stayed locked after drop: {e}"));
    assert!(!again.is_inherited());
}

#[test]
fn on_overlayfs_a_held_lock_is_listed_as_held() {
    // overlayfs records `flock` locks on the inode underneath, which `/proc/locks`
    // names: the list must not read that table for such a directory.
    let tmp = tempfile::tempdir().unwrap();
    let [lower, upper, work, merged] = ["lower", "upper", "work", "merged"].map(|d| {
        let p = tmp.path().join(d);
        std::fs::create_dir(&p).unwrap();
        p
    });
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    let Some(_mounted) = tt_testkit::mount_or_skip(
        "locks on overlayfs need an overlay mount",
        &["-t", "overlay", "overlay", "-o", &options],
        &merged,
    ) else {
        return;
    };
    let dir = LockDir::open(merged.join("locks")).unwrap();
    let key = GpuKey::Index(0);
    let lock = dir.lock(&key, Wait::Try, Holder::current()).unwrap();
    let state = state_of(&dir, &key);
    assert!(state.held, "{state:?}");
    assert_eq!(state.holder.map(|h| h.who.pid), Some(std::process::id()));
    drop(lock);
    assert!(!state_of(&dir, &key).held, "released");
}

/// Polls `done` until it holds, for at most a minute (a busy machine is slow, never
/// that slow).
fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_queue_ticket_deleted_by_a_tmp_cleaner_is_taken_again() {
    let (_tmp, dir) = lock_dir();
    let child = Killed(holder(dir.path(), 2));
    let key = GpuKey::Index(2);
    let tickets = |dir: &LockDir| -> Vec<u64> {
        dir.queue().unwrap().into_iter().map(|w| w.ticket).collect()
    };
    std::thread::scope(|s| {
        let child = child; // dropped (killed) before the scope waits for the waiter
        let waiter = s.spawn(|| {
            dir.lock(
                &key,
                Wait::Timeout(Duration::from_secs(120)),
                Holder::current(),
            )
        });
        eventually("the request queued", || tickets(&dir).len() == 1);
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let path = entry.unwrap().path();
            if path.to_string_lossy().ends_with(".json") {
                std::fs::remove_file(path).unwrap();
            }
        }
        // The waiter sees its ticket gone and queues again (at the end: here the queue
        // is empty, so the numbering starts again; every ticket there now is new).
        eventually("the request queued again", || tickets(&dir).len() == 1);
        drop(child);
        let lock = waiter.join().unwrap().unwrap();
        assert_eq!(lock.key(), &key);
    });
    assert!(tickets(&dir).is_empty(), "left the queue once served");
}

#[test]
fn auto_counts_an_inherited_lock_and_takes_only_the_rest() {
    let (_tmp, dir) = lock_dir();
    let lock = dir
        .lock(&GpuKey::of_uuid(&uuid(1)), Wait::Try, Holder::current())
        .unwrap();
    let mut cmd = spawn("inherit_auto", dir.path(), &[]);
    tt_lock::share_with(&mut cmd, std::slice::from_ref(&lock));
    let out = cmd.output().unwrap();
    tt_testkit::assert_ran_one(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("@@auto: 2 locks, 1 inherited@@"), "{text}");
    // One asked, one inherited: nothing else taken.
    assert!(text.contains("@@auto: 1 locks, 1 inherited@@"), "{text}");
    drop(lock);
}

#[test]
fn an_auto_request_that_waits_holds_none_of_the_free_gpus() {
    // All or nothing while it waits: the two free GPUs stay free for others.
    let (_tmp, dir) = lock_dir();
    let inv = three_gpus();
    let child = Killed(holder_by_uuid(dir.path(), &uuid(1)));
    let held = |dir: &LockDir| -> Vec<GpuKey> {
        dir.list()
            .unwrap()
            .into_iter()
            .filter(|s| s.held)
            .map(|s| s.gpu)
            .collect()
    };
    std::thread::scope(|s| {
        let child = child; // dropped (killed) before the scope waits for the waiter
        let waiter = s.spawn(|| {
            dir.lock_auto(
                &inv,
                3,
                Wait::Timeout(Duration::from_secs(120)),
                Holder::current(),
            )
        });
        eventually("the request queued", || dir.queue().unwrap().len() == 1);
        // (Each new attempt locks and unlocks them in a few microseconds.)
        eventually("only the child's GPU held", || {
            held(&dir) == [GpuKey::Uuid(uuid(1))]
        });
        drop(child);
        let all = waiter.join().unwrap().unwrap();
        assert_eq!(all.len(), 3);
    });
}

#[test]
fn try_on_a_free_gpu_that_a_queued_request_waits_for_names_no_holder() {
    let (_tmp, dir) = lock_dir();
    // GPU 3's file keeps the record of its last holder (this process) after it lets go.
    drop(
        dir.lock(&GpuKey::Index(3), Wait::Try, Holder::current())
            .unwrap(),
    );
    let mut child = holder(dir.path(), 4);
    let waiter = spawn("wait_set", dir.path(), &[])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    eventually("the set request queued", || dir.queue().unwrap().len() == 1);
    // GPU 3 is free but waited for: `Try` fails, naming the waiting request and no
    // holder (the record in the file is a past holder's). The waiter's own attempts
    // lock GPU 3 for a few microseconds now and then: ask again if one is caught.
    eventually("a WouldBlock naming no holder", || {
        match dir.lock(&GpuKey::Index(3), Wait::Try, Holder::current()) {
            Err(Error::WouldBlock {
                gpu,
                holder,
                waiting,
            }) => {
                assert_eq!((gpu, waiting), (GpuKey::Index(3), 1));
                holder.is_none()
            }
            other => panic!("expected WouldBlock, got {other:?}"),
        }
    });
    child.kill().unwrap();
    child.wait().unwrap();
    let out = waiter.wait_with_output().unwrap();
    tt_testkit::assert_ran_one(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("@@granted 2@@"));
}

/// A holder's record rewritten shorter leaves nothing of the longer one behind: the
/// file is one JSON line, as any reader of the whole file expects.
#[test]
fn a_shorter_record_replaces_a_longer_one_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = LockDir::open(tmp.path()).unwrap();
    let key = GpuKey::Index(0);
    let long = Holder::current().running(vec!["x".repeat(500)]);
    let mut lock = dir.lock(&key, Wait::Try, long).unwrap();
    lock.set_holder(Holder::current().running(vec!["y".to_owned()]))
        .unwrap();
    let text = std::fs::read_to_string(holder_record(dir.path(), "gpu-0")).unwrap();
    assert_eq!(text.lines().count(), 1, "{text}");
    let record: Holder = serde_json::from_str(text.trim_end()).unwrap();
    assert_eq!(record.who.command, ["y"]);
    assert!(!text.contains("xxx"), "{text}");
    // Nothing is written into the lock file itself.
    assert_eq!(std::fs::read_to_string(lock.path()).unwrap(), "");
}

/// The one holder record of the GPU whose lock file is `<stem>.lock` in `dir`.
fn holder_record(dir: &Path, stem: &str) -> std::path::PathBuf {
    let prefix = format!("held-{stem}.");
    let found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".json"))
        })
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    found[0].clone()
}

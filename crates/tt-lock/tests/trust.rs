//! A machine of many users: a second Unix user (`nobody`, run by this test as root)
//! cannot erase, rewrite or replace another user's holder record, share record, queue
//! ticket or usage log; records it writes claiming another user are ignored by every
//! reader and reported; under `umask 077` every user still reads every record, so a
//! share that does not fit beside another user's is refused and another user's waiting
//! ticket is seen. Runs under `umask 022` and `umask 077`.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use tt_device::Bytes;
use tt_lock::{GpuKey, Holder, LockDir, Wait};
use tt_testkit::users::TestUser;

const ROLE: &str = "TT_TRUST_TEST_ROLE";
const DIR: &str = "TT_TRUST_TEST_DIR";
const GIB: u64 = 1 << 30;
const CAPACITY: Bytes = Bytes(80 * GIB);
const NOBODY: u32 = 65_534;

/// The umask is the process's: the tests of this binary take turns.
static UMASK: Mutex<()> = Mutex::new(());

/// The child side, run as `nobody`.
#[test]
#[ignore = "a child process's entry point, run by the trust tests"]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    // SAFETY: prctl(PR_SET_PDEATHSIG) has no memory-safety preconditions.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    match role.as_str() {
        "share" => {
            let locks = LockDir::open(&dir).unwrap();
            let r = locks.lock_shared(
                &GpuKey::Index(1),
                Bytes(50 * GIB),
                CAPACITY,
                Wait::Try,
                Holder::current(),
            );
            match r {
                Ok(_) => println!("@@granted@@"),
                Err(e) => println!("@@refused: {e}@@"),
            }
        }
        "wait" => {
            let locks = LockDir::open(&dir).unwrap();
            let lock = locks.lock(
                &GpuKey::Index(0),
                Wait::Timeout(Duration::from_secs(120)),
                Holder::current(),
            );
            println!("@@{}@@", if lock.is_ok() { "granted" } else { "timeout" });
        }
        "vandal" => vandalize(&dir),
        // Who waits, as this user reads the queue.
        "see-queue" => {
            let queue = LockDir::open(&dir).unwrap().queue().unwrap();
            let users: Vec<&str> = queue.iter().map(|w| w.who.user.as_str()).collect();
            println!("@@queue: {}@@", users.join(" "));
        }
        // The queue as this user reads it, with each request's waiting start.
        "see-queue-since" => {
            let queue = LockDir::open(&dir).unwrap().queue().unwrap();
            let said: Vec<String> = queue
                .iter()
                .map(|w| format!("{}:{}", w.who.user, w.who.since_unix))
                .collect();
            println!("@@queue: {}@@", said.join(" "));
        }
        // GPU 3's sharers as this user reads them, oldest first, and what it ignores.
        "see-sharers3" => {
            let locks = LockDir::open(&dir).unwrap();
            let sharers = locks.sharers(&GpuKey::Index(3)).unwrap();
            let pids: Vec<String> = sharers.iter().map(|h| h.who.pid.to_string()).collect();
            for i in locks.ignored().unwrap() {
                println!("@@ignored: {i}@@");
            }
            println!("@@sharers: {}@@", pids.join(" "));
        }
        // The name root keeps its GPU 5 record under, taken first, claiming root.
        "squat" => {
            let mut claim = Holder::current();
            claim.who.user = "root".into();
            let path = dir.join("held-gpu-5.user-0.json");
            std::fs::write(&path, serde_json::to_string(&claim).unwrap() + "\n").unwrap();
            // Not locked: what keeps root out of it is the owner check alone.
            println!("@@squatted@@");
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
        }
        other => jam_role(other, &dir),
    }
}

/// Locks the file at `path` (of this process's user) as a live record is locked: an
/// open-file-description write lock, which needs the file open for writing, plus a
/// `flock` for good measure.
fn lock_as_live(path: &Path) -> std::fs::File {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    write_lock(&file).unwrap();
    // SAFETY: the fd is open for the call.
    let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) };
    assert_eq!(rc, 0);
    file
}

/// An open-file-description lock of `kind` on the whole of `file`, without waiting.
fn ofd_lock(file: &std::fs::File, kind: i32) -> std::io::Result<()> {
    // SAFETY: an all-zero flock is valid (the whole file from offset 0).
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: the fd is open and `lock` lives for the call.
    let rc = unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(file),
            libc::F_OFD_SETLK,
            &lock,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn write_lock(file: &std::fs::File) -> std::io::Result<()> {
    ofd_lock(file, libc::F_WRLCK)
}

/// What a second user tries on the first user's records, then the records it forges
/// in files of its own, claiming root; held until its standard input closes.
fn vandalize(dir: &Path) {
    let named = |prefix: &str| -> PathBuf {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix}* in {}", dir.display()))
    };
    let say = |what: &str, r: std::io::Result<()>| {
        println!("@@{what}: {}@@", if r.is_err() { "denied" } else { "DONE" });
    };
    let write = |path: &Path| {
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .and_then(|mut f| f.write_all(b"x"))
    };
    let truncate = |path: &Path| {
        std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(path)
            .map(drop)
    };
    let held = named("held-gpu-0.");
    let share = named("share-gpu-1.");
    let usage = dir.join("usage-0.jsonl");
    say("write the lock file", write(&dir.join("gpu-0.lock")));
    for (name, path) in [("holder", &held), ("share", &share), ("usage", &usage)] {
        say(&format!("truncate the {name} record"), truncate(path));
        say(&format!("write the {name} record"), write(path));
        say(
            &format!("remove the {name} record"),
            std::fs::remove_file(path),
        );
        let link = dir.join(format!("link-{name}"));
        std::os::unix::fs::symlink("/etc/passwd", &link).unwrap();
        say(
            &format!("replace the {name} record with a symlink"),
            std::fs::rename(&link, path),
        );
        let _ = std::fs::remove_file(&link);
    }
    // Forgeries: records of its own, claiming root, locked as live records are.
    let mut claim = Holder::current();
    claim.who.user = "root".into();
    claim.gpu = "0".into();
    let mut forged = Vec::new();
    let mut place = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text + "\n").unwrap();
        forged.push(lock_as_live(&path));
    };
    place(
        "held-gpu-0.1-0-1-0.json",
        serde_json::to_string(&claim).unwrap(),
    );
    let mut sharing = claim.clone();
    sharing.share = Some(Bytes(30 * GIB));
    place(
        "share-gpu-1.1-0-1-0.json",
        serde_json::to_string(&sharing).unwrap(),
    );
    place(
        "wait-00000000000000000099.json",
        serde_json::json!({
            "ticket": 99, "pid": 1, "user": "root", "host": "h", "since_unix": 1,
            "wants": {"kind": "gpus", "gpus": [{"index": 0}]}
        })
        .to_string(),
    );
    // A usage log of its own holding a reservation claiming root, and an end for
    // root's running reservation (its id read from root's log).
    let root_id = std::fs::read_to_string(&usage)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "start")
        .map(|v| v["id"].as_str().unwrap().to_owned())
        .unwrap();
    let start = serde_json::json!({"event": "start", "id": "forged", "user": "root",
        "host": "h", "pid": 1, "gpu": "0", "bytes": null, "time": 1.0, "command": []});
    let end = serde_json::json!({"event": "end", "id": root_id, "time": 2.0,
        "status": 9, "lost": true});
    std::fs::write(
        dir.join(format!("usage-{NOBODY}.jsonl")),
        format!("{start}\n{end}\n"),
    )
    .unwrap();
    println!("@@forged@@");
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(forged);
}

/// The roles of the tests on jams, dead records kept alive, forged numbers and planted
/// names: what each user does, saying each outcome as an `@@...@@` line.
fn jam_role(role: &str, dir: &Path) {
    let locks = LockDir::open(dir).unwrap();
    let hold_until_stdin_closes = || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
    };
    let said = |what: &str, r: Result<(), tt_lock::Error>| match r {
        Ok(()) => println!("@@{what}: granted@@"),
        Err(e) => println!("@@{what}: refused: {e}@@"),
    };
    match role {
        // The vandal locks the directory itself (as `flock -x DIR sleep` would).
        "flock-dir" => {
            let file = std::fs::File::open(dir).unwrap();
            // SAFETY: the fd is open for the call.
            let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) };
            assert_eq!(rc, 0);
            println!("@@locked@@");
            hold_until_stdin_closes();
        }
        "hold0" => {
            let lock = locks.lock(&GpuKey::Index(0), Wait::Try, Holder::current());
            let _lock = lock.unwrap();
            println!("@@held@@");
            hold_until_stdin_closes();
        }
        "timeout2" => {
            let r = locks.lock(
                &GpuKey::Index(0),
                Wait::Timeout(Duration::from_secs(2)),
                Holder::current(),
            );
            said("gpu0", r.map(drop));
            let r = locks.lock_shared(
                &GpuKey::Index(1),
                Bytes(10 * GIB),
                CAPACITY,
                Wait::Try,
                Holder::current(),
            );
            said("share", r.map(drop));
        }
        // A share of GPU 3, held until stdin closes.
        "share3" => {
            let share = locks.lock_shared(
                &GpuKey::Index(3),
                Bytes(10 * GIB),
                CAPACITY,
                Wait::Try,
                Holder::current(),
            );
            let _share = share.unwrap();
            println!("@@shared@@");
            hold_until_stdin_closes();
        }
        // A share of GPU 3 whose own record says it began at the epoch (the oldest
        // sharer) and that its command is init (another user's process), and one of
        // GPU 4 that says it begins in the far future.
        "share3-steering" => {
            let mut claim = Holder::current();
            claim.who.since_unix = 0;
            claim.command_pid = Some(1);
            let share =
                locks.lock_shared(&GpuKey::Index(3), Bytes(GIB), CAPACITY, Wait::Try, claim);
            let _share = share.unwrap();
            let mut later = Holder::current();
            later.who.since_unix = u64::MAX;
            let share =
                locks.lock_shared(&GpuKey::Index(4), Bytes(GIB), CAPACITY, Wait::Try, later);
            let _later = share.unwrap();
            println!("@@shared@@");
            hold_until_stdin_closes();
        }
        // A share of GPU 3 whose record names init (root's process) as its own: init
        // started at boot, so its age would make it the oldest sharer.
        "share3-as-init" => {
            let mut claim = Holder::current();
            claim.who.pid = 1;
            claim.who.since_unix = 0;
            let share = locks.lock_shared(&GpuKey::Index(3), Bytes(1), CAPACITY, Wait::Try, claim);
            let _share = share.unwrap();
            println!("@@shared@@");
            hold_until_stdin_closes();
        }
        // A live ticket for GPU 0 placed now, but numbered 0 and claiming to wait since
        // the epoch: first in every reader's order and preempting at once, if believed.
        "forge-first" => {
            let path = dir.join("wait-00000000000000000000.json");
            let ticket = serde_json::json!({
                "ticket": 0, "pid": std::process::id(), "user": "nobody",
                "host": tt_device::host_name(), "since_unix": 0,
                "wants": {"kind": "gpus", "gpus": [{"index": 0}]}
            });
            std::fs::write(&path, format!("{ticket}\n")).unwrap();
            let _live = lock_as_live(&path);
            println!("@@forged@@");
            hold_until_stdin_closes();
        }
        "share-then-queue" => {
            let share = locks.lock_shared(
                &GpuKey::Index(1),
                Bytes(50 * GIB),
                CAPACITY,
                Wait::Try,
                Holder::current(),
            );
            let _share = share.unwrap();
            println!("@@shared@@");
            // Waits for GPU 2 (held by the test) until killed.
            let _ = locks.lock(&GpuKey::Index(2), Wait::Block, Holder::current());
        }
        // The vandal locks every record it can read: a flock and a read lock each.
        "keep" => {
            let mut kept = Vec::new();
            for entry in std::fs::read_dir(dir).unwrap().flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if ["held-", "share-", "wait-"]
                    .iter()
                    .any(|p| name.starts_with(p))
                {
                    let file = std::fs::File::open(entry.path()).unwrap();
                    // SAFETY: the fd is open for the call.
                    let rc = unsafe {
                        libc::flock(
                            std::os::fd::AsRawFd::as_raw_fd(&file),
                            libc::LOCK_EX | libc::LOCK_NB,
                        )
                    };
                    // (A live record's write lock refuses the read lock.)
                    if rc == 0 && ofd_lock(&file, libc::F_RDLCK).is_ok() {
                        kept.push(file);
                    }
                }
            }
            println!("@@kept {}@@", kept.len());
            hold_until_stdin_closes();
        }
        "after-death" => {
            let r = locks.lock_shared(
                &GpuKey::Index(1),
                Bytes(50 * GIB),
                CAPACITY,
                Wait::Try,
                Holder::current(),
            );
            said("share", r.map(drop));
            let r = locks.lock(&GpuKey::Index(2), Wait::Try, Holder::current());
            said("gpu2", r.map(drop));
            for i in locks.ignored().unwrap() {
                println!("@@ignored: {i}@@");
            }
            println!("@@done@@");
        }
        // Tickets no real queue numbers: an empty file at u64::MAX, and a live, believed
        // ticket of the vandal's own just below it.
        "forge-numbers" => {
            std::fs::write(dir.join("wait-18446744073709551615.json"), "").unwrap();
            let path = dir.join("wait-18446744073709551614.json");
            let ticket = serde_json::json!({
                "ticket": 1, "pid": std::process::id(), "user": "nobody", "host": "h",
                "since_unix": 1, "wants": {"kind": "gpus", "gpus": [{"index": 7}]}
            });
            std::fs::write(&path, format!("{ticket}\n")).unwrap();
            let _live = lock_as_live(&path);
            println!("@@forged@@");
            hold_until_stdin_closes();
        }
        "wait0" => {
            let r = locks.lock(
                &GpuKey::Index(0),
                Wait::Timeout(Duration::from_secs(120)),
                Holder::current(),
            );
            said("gpu0", r.map(drop));
        }
        // Files under the names of both users' usage logs: a FIFO and a file of its own
        // that anyone may write.
        "plant-logs" => {
            let [a, b] = tt_testkit::users::two_users_known().unwrap();
            // The first user's log name and every name beside it that a log was once
            // tried under (`usage-<uid>.2.jsonl` to `.16.`), FIFOs all.
            let names = std::iter::once(format!("usage-{}.jsonl", a.uid))
                .chain((2..=16).map(|k| format!("usage-{}.{k}.jsonl", a.uid)));
            for name in names {
                let fifo =
                    std::ffi::CString::new(dir.join(name).into_os_string().into_encoded_bytes())
                        .unwrap();
                // SAFETY: the path is a NUL-terminated string alive for the call.
                assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o666) }, 0);
            }
            let file = dir.join(format!("usage-{}.jsonl", b.uid));
            std::fs::write(&file, "").unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
            println!("@@planted@@");
        }
        "use3" => {
            let lock = locks
                .lock(&GpuKey::Index(3), Wait::Try, Holder::current())
                .unwrap();
            drop(lock);
            let me = Holder::current().who.user;
            let usage = locks.usage().unwrap();
            let mine = usage
                .records
                .iter()
                .filter(|r| r.user == me && r.ended_unix.is_some())
                .count();
            println!("@@mine: {mine}@@");
            for i in &usage.ignored {
                println!("@@ignored: {i}@@");
            }
            println!("@@done@@");
        }
        other => panic!("unknown role {other}"),
    }
}

/// The two ordinary test users (created when run as root), or `None` where this test
/// cannot run them (a knowing skip, or a failure).
fn two_users() -> Option<[TestUser; 2]> {
    if !second_user_possible() {
        return None;
    }
    Some(tt_testkit::users::two_users().unwrap())
}

/// Ends children that hold what they took until their standard input closes: closes
/// it, and waits for each to exit.
fn end(children: impl IntoIterator<Item = Child>) {
    for mut child in children {
        drop(child.stdin.take());
        child.wait().unwrap();
    }
}

/// The queue once it lists a request (waiting up to two minutes for one).
fn queued(dir: &LockDir) -> Vec<tt_lock::Waiter> {
    let patience = std::time::Instant::now();
    loop {
        let queue = dir.queue().unwrap();
        if !queue.is_empty() {
            return queue;
        }
        assert!(
            patience.elapsed() < Duration::from_secs(120),
            "never queued"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills `child` when it has not ended within `limit`, so that a request that would
/// wait forever fails its test instead of hanging it.
fn watchdog(child: &Child, limit: Duration) -> std::sync::mpsc::Sender<()> {
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if rx.recv_timeout(limit) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    tx
}

/// One user's `flock` on the lock directory (what numbered tickets and admitted
/// shares before) stops nobody: a request for a held GPU ends at its timeout, naming
/// the holder, and a share is admitted.
#[test]
fn a_lock_on_the_directory_never_outlasts_a_requests_timeout_nor_stops_a_share() {
    let _turn = UMASK.lock().unwrap_or_else(|e| e.into_inner());
    let Some([a, b]) = two_users() else { return };
    let shared = Shared::new();
    let mut vandal = shared.as_nobody("flock-dir", 0o022);
    assert_eq!(lines_until(&mut vandal, "locked"), ["locked"]);
    let mut holder = shared.as_user(a, "hold0", 0o077);
    assert_eq!(lines_until(&mut holder, "held"), ["held"]);
    let mut waiter = shared.as_user(b, "timeout2", 0o077);
    // Two seconds of patience, and generous room for a busy machine: a request that
    // waits on the directory's lock is killed here and fails below.
    let _dog = watchdog(&waiter, Duration::from_secs(90));
    let said = lines_until(&mut waiter, "share");
    assert!(
        said[0].starts_with("gpu0: refused: timed out after") && said[0].contains("tt-test-a"),
        "{said:?}"
    );
    assert_eq!(said[1], "share: granted", "{said:?}");
    waiter.wait().unwrap();
    end([holder, vandal]);
}

/// A user's share and queue ticket, killed with SIGKILL, then kept locked by the vandal
/// (a `flock` and a read lock on each record): they count for nothing. The other user's
/// 50 GiB share fits, the free GPU is granted at once, and the kept records are reported
/// with who keeps them.
#[test]
fn records_of_a_killed_user_kept_locked_by_another_count_for_nothing_and_are_reported() {
    let _turn = UMASK.lock().unwrap_or_else(|e| e.into_inner());
    let Some([a, b]) = two_users() else { return };
    let shared = Shared::new();
    let gpu2 = shared
        .dir
        .lock(&GpuKey::Index(2), Wait::Try, Holder::current())
        .unwrap();
    let mut sharer = shared.as_user(a, "share-then-queue", 0o077);
    assert_eq!(lines_until(&mut sharer, "shared"), ["shared"]);
    queued(&shared.dir);
    sharer.kill().unwrap();
    sharer.wait().unwrap();
    let mut vandal = shared.as_nobody("keep", 0o022);
    let kept = lines_until(&mut vandal, "kept");
    assert_eq!(kept, ["kept 2"], "the share record and the ticket");
    drop(gpu2);
    let mut other = shared.as_user(b, "after-death", 0o077);
    let said = lines_until(&mut other, "done");
    assert_eq!(said[..2], ["share: granted", "gpu2: granted"], "{said:?}");
    let reports: Vec<_> = said
        .iter()
        .filter(|l| l.contains("keeps it locked"))
        .collect();
    assert_eq!(reports.len(), 2, "{said:?}");
    assert!(
        reports
            .iter()
            .all(|l| l.contains("user nobody") && l.contains("not counted")),
        "{said:?}"
    );
    other.wait().unwrap();
    end([vandal]);
}

/// Values in a user's own, believed share records never steer others: a `since_unix`
/// of 0 does not make it the oldest sharer (whose keeper alone fences), one in the far
/// future is read as now, and a `command_pid` naming another user's process (init) is
/// not believed.
#[test]
fn values_in_ones_own_records_neither_make_it_the_oldest_sharer_nor_claim_others_processes() {
    let _turn = UMASK.lock().unwrap_or_else(|e| e.into_inner());
    let Some([a, b]) = two_users() else { return };
    let shared = Shared::new();
    let mut first = shared.as_user(a, "share3", 0o077);
    assert_eq!(lines_until(&mut first, "shared"), ["shared"]);
    // The second sharer starts seconds later (records say whole seconds).
    let since = shared.dir.sharers(&GpuKey::Index(3)).unwrap()[0]
        .who
        .since_unix;
    while tt_device::now_unix_secs() < since + 3 {
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut steering = shared.as_user(b, "share3-steering", 0o077);
    assert_eq!(lines_until(&mut steering, "shared"), ["shared"]);
    let sharers = shared.dir.sharers(&GpuKey::Index(3)).unwrap();
    assert_eq!(sharers.len(), 2, "{sharers:?}");
    assert_eq!(
        sharers[0].who.pid,
        first.id(),
        "the first sharer stays first: {sharers:?}"
    );
    assert_eq!(sharers[1].who.pid, steering.id(), "{sharers:?}");
    assert!(
        sharers[1].who.since_unix >= sharers[0].who.since_unix,
        "{sharers:?}"
    );
    assert_eq!(
        sharers[1].command_pid, None,
        "init is not tt-test-b's: {sharers:?}"
    );
    let now = tt_device::now_unix_secs();
    let later = shared.dir.sharers(&GpuKey::Index(4)).unwrap();
    assert!(
        later.len() == 1 && later[0].who.since_unix <= now + 2,
        "{later:?}"
    );
    end([first, steering]);
}

/// A ticket numbered 0 that claims to wait since the epoch, placed after another
/// user's request, neither jumps the queue nor counts a long wait: every reader (here
/// the holder's user) orders the queue by when the kernel placed each ticket and
/// counts the wait from then, and the GPU goes to the request that came first.
#[test]
fn a_forged_number_or_waiting_time_neither_jumps_the_queue_nor_ages_a_ticket() {
    let _turn = UMASK.lock().unwrap_or_else(|e| e.into_inner());
    let Some([a, b]) = two_users() else { return };
    let shared = Shared::new();
    let mut holder = shared.as_user(a, "hold0", 0o077);
    assert_eq!(lines_until(&mut holder, "held"), ["held"]);
    let mut waiter = shared.as_user(b, "wait0", 0o077);
    let _dog = watchdog(&waiter, Duration::from_secs(150));
    let first = queued(&shared.dir);
    // Placed a second later, so that whole seconds tell the two apart: 0.2 s into the
    // next second, as the kernel stamps a file's times with a coarse clock, up to a
    // tick behind this one (placed at once, the ticket was stamped the same second
    // once in CI).
    let next = (first[0].who.since_unix + 1) as f64 + 0.2;
    while tt_device::now_unix() < next {
        std::thread::sleep(Duration::from_millis(20));
    }
    let before_forging = tt_device::now_unix_secs();
    let mut vandal = shared.as_nobody("forge-first", 0o022);
    assert_eq!(lines_until(&mut vandal, "forged"), ["forged"]);
    let mut reader = shared.as_user(a, "see-queue-since", 0o077);
    let said = lines_until(&mut reader, "queue");
    reader.wait().unwrap();
    let order: Vec<(&str, u64)> = said[0]
        .trim_start_matches("queue: ")
        .split(' ')
        .map(|w| {
            let (user, since) = w.split_once(':').unwrap();
            (user, since.parse().unwrap())
        })
        .collect();
    assert_eq!(
        order.iter().map(|(u, _)| *u).collect::<Vec<_>>(),
        ["tt-test-b", "nobody"],
        "{said:?}"
    );
    // Its wait counts from when it was placed, not from the epoch it claims: from the
    // second before it was forged at the earliest (a second of slack for the kernel's
    // coarse file clock and a boot time read in whole seconds), and not before the
    // honest request's.
    assert!(
        order[1].1 + 1 >= before_forging && order[1].1 >= order[0].1,
        "the forged ticket's wait starts when it was placed (forged at {before_forging}): \
         {said:?}"
    );
    end([holder]);
    assert_eq!(lines_until(&mut waiter, "gpu0"), ["gpu0: granted"]);
    waiter.wait().unwrap();
    end([vandal]);
}

/// A share record whose own process is said to be init (root's, started at boot) is
/// not believed: it is not the oldest sharer (whose keeper alone fences), every reader
/// reports it, and the honest sharer stays first.
#[test]
fn a_record_naming_another_users_process_is_not_believed() {
    let _turn = UMASK.lock().unwrap_or_else(|e| e.into_inner());
    let Some([a, b]) = two_users() else { return };
    let shared = Shared::new();
    let mut first = shared.as_user(a, "share3", 0o077);
    assert_eq!(lines_until(&mut first, "shared"), ["shared"]);
    let mut steering = shared.as_user(b, "share3-as-init", 0o077);
    assert_eq!(lines_until(&mut steering, "shared"), ["shared"]);
    let mut reader = shared.as_user(a, "see-sharers3", 0o077);
    let said = lines_until(&mut reader, "sharers");
    reader.wait().unwrap();
    assert_eq!(
        said.last().unwrap(),
        &format!("sharers: {}", first.id()),
        "{said:?}"
    );
    assert!(
        said.iter()
            .any(|l| l.starts_with("ignored:") && l.contains("names pid 1 ")),
        "{said:?}"
    );
    end([first, steering]);
}

/// Ticket numbers nobody's queue reaches (an empty file at `u64::MAX`, a live ticket of
/// the vandal's at `u64::MAX - 1`) neither crash another user's request nor push its
/// number: it queues, is numbered from the believed tickets, and is served.
#[test]
fn forged_ticket_numbers_neither_crash_nor_push_another_users_request() {
    let _turn = UMASK.lock().unwrap_or_else(|e| e.into_inner());
    let Some([a, b]) = two_users() else { return };
    let shared = Shared::new();
    let mut vandal = shared.as_nobody("forge-numbers", 0o022);
    assert_eq!(lines_until(&mut vandal, "forged"), ["forged"]);
    let mut holder = shared.as_user(a, "hold0", 0o022);
    assert_eq!(lines_until(&mut holder, "held"), ["held"]);
    let mut waiter = shared.as_user(b, "wait0", 0o022);
    let _dog = watchdog(&waiter, Duration::from_secs(150));
    let queue = queued(&shared.dir);
    assert_eq!(
        (queue.len(), queue[0].ticket, queue[0].who.user.as_str()),
        (1, 1, "tt-test-b"),
        "{queue:?}"
    );
    let ignored = shared.dir.ignored().unwrap();
    assert!(
        ignored
            .iter()
            .any(|i| i.to_string().contains("above any real queue")),
        "{ignored:?}"
    );
    end([holder]);
    assert_eq!(lines_until(&mut waiter, "gpu0"), ["gpu0: granted"]);
    waiter.wait().unwrap();
    end([vandal]);
}

/// Files the vandal put first under both users' usage logs' names (FIFOs under the
/// first user's name and the next 15 names beside it, a file anyone may write under the
/// second's) cost neither user their accounting: each records in a log of its own
/// beside it, under a name nobody could guess, reads its reservation back, and sees the
/// planted file reported.
#[test]
fn usage_log_names_planted_by_another_user_cost_no_accounting() {
    let _turn = UMASK.lock().unwrap_or_else(|e| e.into_inner());
    let Some(users) = two_users() else { return };
    let shared = Shared::new();
    let mut vandal = shared.as_nobody("plant-logs", 0o022);
    assert_eq!(lines_until(&mut vandal, "planted"), ["planted"]);
    vandal.wait().unwrap();
    for user in users {
        let mut child = shared.as_user(user, "use3", 0o077);
        let _dog = watchdog(&child, Duration::from_secs(90));
        let said = lines_until(&mut child, "done");
        assert_eq!(said[0], "mine: 1", "uid {}: {said:?}", user.uid);
        assert!(
            said.iter().any(|l| l.starts_with("ignored:")
                && l.contains(&format!("usage-{}.jsonl", user.uid))
                && l.contains("uid 65534")),
            "uid {}: {said:?} in {:?}",
            user.uid,
            std::fs::read_dir(&shared.path)
                .unwrap()
                .flatten()
                .map(|e| (e.file_name(), e.file_type().unwrap()))
                .collect::<Vec<_>>()
        );
        child.wait().unwrap();
    }
}

/// Whether this test can run a second user: as root, yes; otherwise skipped where
/// `TORCHTOOLS_TEST_NO_MOUNT` says why, else a failure.
fn second_user_possible() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    tt_testkit::skip_knowingly(
        "a second user needs root",
        &format!(
            "a second user needs root: run as root, or set {}=<why> to skip knowingly",
            tt_testkit::NO_MOUNT_ENV
        ),
    );
    false
}

/// A lock directory two users share, in a 0755 parent (as /tmp is reachable).
struct Shared {
    _tmp: tempfile::TempDir,
    program: tt_testkit::users::RunnableCopy,
    path: PathBuf,
    dir: LockDir,
}

impl Shared {
    fn new() -> Shared {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = tmp.path().join("locks");
        let dir = LockDir::open(&path).unwrap();
        // The test users and nobody may not reach target/: they run a copy.
        let program = tt_testkit::users::RunnableCopy::new("tt-lock-trust");
        Shared {
            _tmp: tmp,
            program,
            path,
            dir,
        }
    }

    /// `role` as nobody under `umask`, its output piped.
    fn as_nobody(&self, role: &str, umask: u32) -> Child {
        self.as_user(tt_testkit::users::VANDAL, role, umask)
    }

    /// `role` as `user` under `umask`, its output piped.
    fn as_user(&self, user: TestUser, role: &str, umask: u32) -> Child {
        let mut cmd = Command::new(self.program.path());
        cmd.args(tt_testkit::rerun_args("child"))
            .env(ROLE, role)
            .env(DIR, &self.path)
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .uid(user.uid)
            .gid(user.gid);
        // SAFETY: umask is async-signal-safe and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                libc::umask(umask);
                Ok(())
            });
        }
        tt_testkit::users::retry_while_busy(|| cmd.spawn()).unwrap()
    }
}

/// Reads the child's `@@...@@` lines up to (and with) the one that starts with `until`.
fn lines_until(child: &mut Child, until: &str) -> Vec<String> {
    let out = child.stdout.as_mut().unwrap();
    let mut reader = BufReader::new(out);
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 {
            panic!("the child ended before {until:?}: {lines:?}");
        }
        // (The first may follow the test harness's "test child ... " on its line.)
        let Some(said) = line
            .trim()
            .split_once("@@")
            .and_then(|(_, l)| l.strip_suffix("@@"))
        else {
            continue;
        };
        lines.push(said.to_owned());
        if said.starts_with(until) {
            return lines;
        }
    }
}

fn with_umask<T>(mask: u32, f: impl FnOnce() -> T) -> T {
    // SAFETY: umask has no preconditions.
    let old = unsafe { libc::umask(mask) };
    let out = f();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    out
}

#[test]
fn another_user_can_neither_erase_nor_forge_records_and_forgeries_are_reported() {
    if !second_user_possible() {
        return;
    }
    let _turn = UMASK.lock().unwrap_or_else(|e| e.into_inner());
    for mask in [0o022, 0o077] {
        let shared = Shared::new();
        let dir = &shared.dir;
        let (mut alone, shared_lock) = with_umask(mask, || {
            let alone = dir
                .lock(&GpuKey::Index(0), Wait::Try, Holder::current())
                .unwrap();
            let share = dir
                .lock_shared(
                    &GpuKey::Index(1),
                    Bytes(50 * GIB),
                    CAPACITY,
                    Wait::Try,
                    Holder::current(),
                )
                .unwrap();
            (alone, share)
        });
        let mut vandal = shared.as_nobody("vandal", mask);
        let said = lines_until(&mut vandal, "forged");
        let done: Vec<_> = said.iter().filter(|l| l.ends_with("DONE")).collect();
        assert!(done.is_empty(), "umask {mask:o}: {done:?} in {said:?}");
        assert_eq!(said.len(), 14, "umask {mask:o}: {said:?}");

        // The views name the real holder and sharer, and only them.
        let states = dir.list().unwrap();
        let gpu0 = states.iter().find(|s| s.gpu == GpuKey::Index(0)).unwrap();
        let holder = gpu0.holder.as_ref().unwrap();
        assert_eq!(
            (holder.who.pid, holder.who.user.as_str()),
            (std::process::id(), "root")
        );
        let gpu1 = states.iter().find(|s| s.gpu == GpuKey::Index(1)).unwrap();
        assert_eq!(gpu1.shares.len(), 1, "{gpu1:?}");
        assert_eq!(gpu1.shared_bytes(), Bytes(50 * GIB));
        assert!(
            dir.queue().unwrap().is_empty(),
            "the forged ticket is no request"
        );
        // Every forgery is reported, naming who wrote it and whom it claims.
        let ignored = dir.ignored().unwrap();
        assert_eq!(ignored.len(), 3, "{ignored:?}");
        for i in &ignored {
            assert_eq!((i.owner_uid, i.claims.as_str()), (NOBODY, "root"), "{i}");
            assert!(i
                .to_string()
                .contains("written by uid 65534 (nobody), claims root"));
        }
        // The usage of both reservations: running (the share too), not closed by the
        // forged end; the forged reservation ignored and reported.
        let usage = dir.usage().unwrap();
        assert_eq!(usage.records.len(), 2, "{usage:?}");
        assert!(
            usage
                .records
                .iter()
                .all(|r| r.ended_unix.is_none() && !r.lost),
            "{usage:?}"
        );
        assert_eq!(usage.ignored.len(), 1, "{usage:?}");
        assert_eq!(usage.ignored[0].claims, "root");

        alone.set_exit_status(3);
        drop((alone, shared_lock));
        let usage = dir.usage().unwrap();
        assert!(
            usage
                .records
                .iter()
                .all(|r| r.ended_unix.is_some() && !r.lost),
            "{usage:?}"
        );
        assert!(
            usage.records.iter().any(|r| r.status == Some(3)),
            "{usage:?}"
        );
        end([vandal]);
    }
}

#[test]
fn under_umask_077_a_share_beside_another_users_is_counted_and_a_ticket_is_seen() {
    let _turn = UMASK.lock().unwrap_or_else(|e| e.into_inner());
    let Some([_, b]) = two_users() else { return };
    let shared = Shared::new();
    let dir = &shared.dir;
    let (share, alone) = with_umask(0o077, || {
        (
            dir.lock_shared(
                &GpuKey::Index(1),
                Bytes(50 * GIB),
                CAPACITY,
                Wait::Try,
                Holder::current(),
            )
            .unwrap(),
            dir.lock(&GpuKey::Index(0), Wait::Try, Holder::current())
                .unwrap(),
        )
    });
    // 50 GiB more do not fit beside root's 50 GiB on 80: refused, not overbooked.
    let mut sharer = shared.as_nobody("share", 0o077);
    let said = lines_until(&mut sharer, "");
    // Refused for root's budget, which nobody read in root's umask-077 record.
    assert!(
        said[0].starts_with("refused")
            && said[0].contains("(root@")
            && said[0].contains("budget of 50.00 GiB"),
        "{said:?}"
    );
    sharer.wait().unwrap();
    // nobody's request for GPU 0 waits in the queue (a umask-077 ticket), which another
    // ordinary user sees...
    let mut waiter = shared.as_nobody("wait", 0o077);
    queued(dir);
    let mut reader = shared.as_user(b, "see-queue", 0o077);
    assert_eq!(lines_until(&mut reader, "queue"), ["queue: nobody"]);
    reader.wait().unwrap();
    // ...and is served when root lets go.
    drop(alone);
    assert_eq!(lines_until(&mut waiter, ""), ["granted"]);
    waiter.wait().unwrap();
    drop(share);
}

/// Another user who takes first the name under which root keeps its holder record for
/// a GPU (and locks it, as a live record is) changes nothing: root's lock writes a
/// record of its own, the views name root's process, and the squatted file is reported.
#[test]
fn a_record_name_taken_first_by_another_user_is_neither_used_nor_believed() {
    if !second_user_possible() {
        return;
    }
    let _turn = UMASK.lock().unwrap_or_else(|e| e.into_inner());
    let shared = Shared::new();
    let mut squatter = shared.as_nobody("squat", 0o022);
    assert_eq!(lines_until(&mut squatter, "squatted"), ["squatted"]);
    let lock = shared
        .dir
        .lock(&GpuKey::Index(5), Wait::Try, Holder::current())
        .unwrap();
    let states = shared.dir.list().unwrap();
    let holder = states[0].holder.as_ref().unwrap();
    assert_eq!(holder.who.pid, std::process::id(), "{states:?}");
    let ignored = shared.dir.ignored().unwrap();
    assert_eq!(ignored.len(), 1, "{ignored:?}");
    assert!(
        ignored[0].path.ends_with("held-gpu-5.user-0.json"),
        "{ignored:?}"
    );
    drop(lock);
    end([squatter]);
}

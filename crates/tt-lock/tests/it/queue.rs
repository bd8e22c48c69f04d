//! The first-come-first-served queue with real processes: arrival order across every
//! form of request (blocking, timed, several GPUs, auto), no starvation of a two-GPU
//! request, a `kill -9`'d waiter leaving by itself, `try` never queueing, a timeout
//! leaving at its deadline. Every step waits for an event (a waiter seen in the queue,
//! a grant written to the log), never for a fixed time.

use std::io::Write;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use tt_lock::{Error, GpuKey, Holder, LockDir, Wait, Wants};

use crate::common;
use common::{now_ns, Stage, PATIENCE};

const ROLE: &str = "TT_QUEUE_TEST_ROLE";

fn uuid(i: u32) -> String {
    format!("GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-4000-8000-000000000000")
}

fn key(i: u32) -> GpuKey {
    GpuKey::Uuid(uuid(i))
}

/// Two GPUs as NVML would list them (GPU 0 with the most free memory), for `auto`.
fn two_gpus() -> tt_device::Inventory {
    tt_device::Inventory {
        nvml: tt_device::NvmlStatus::Available {
            driver_version: "test".into(),
        },
        gpus: (0..2)
            .map(|i| tt_device::GpuInfo {
                nvml_index: i,
                uuid: uuid(i),
                name: "H100".into(),
                total: tt_device::Bytes::gib(80),
                free: tt_device::Bytes::gib(60 - 20 * u64::from(i)),
                used: tt_device::Bytes::gib(20 + 20 * u64::from(i)),
                utilization: None,
                processes: vec![],
                mig: vec![],
            })
            .collect(),
        errors: vec![],
    }
}

/// The child side: one request (`MODE`: block, timeout, many, auto, auto2), then on
/// grant one line `NAME GPU...` appended to `LOG`, a hold of `HOLD_MS`, and exit.
#[test]
#[ignore = "a child process's entry point, run by the queue tests"]
fn request() {
    let Ok(mode) = std::env::var(ROLE) else {
        return;
    };
    // SAFETY: prctl(PR_SET_PDEATHSIG) has no memory-safety preconditions.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let var = |name: &str| std::env::var(name).unwrap();
    let dir = LockDir::open(var("DIR")).unwrap();
    let gpus: Vec<GpuKey> = var("GPUS")
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| key(s.parse().unwrap()))
        .collect();
    let holder = Holder::current();
    let minute = Wait::Timeout(Duration::from_secs(600));
    let locks = match mode.as_str() {
        "block" => vec![dir.lock(&gpus[0], Wait::Block, holder).unwrap()],
        "timeout" => vec![dir.lock(&gpus[0], minute, holder).unwrap()],
        "many" => dir.lock_many(&gpus, Wait::Block, holder).unwrap(),
        "auto" => dir.lock_auto(&two_gpus(), 1, minute, holder).unwrap(),
        "auto2" => dir.lock_auto(&two_gpus(), 2, Wait::Block, holder).unwrap(),
        other => panic!("unknown mode {other}"),
    };
    let names: Vec<String> = locks
        .iter()
        .map(|l| match l.key() {
            GpuKey::Uuid(u) => u[4..5].to_owned(),
            GpuKey::Index(i) => i.to_string(),
        })
        .collect();
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(var("LOG"))
        .unwrap();
    let start = now_ns();
    std::thread::sleep(Duration::from_millis(var("HOLD_MS").parse().unwrap()));
    let end = now_ns();
    drop(locks);
    // One write per line (O_APPEND): lines from processes never interleave.
    log.write_all(format!("{} {} {start} {end}\n", var("NAME"), names.join(",")).as_bytes())
        .unwrap();
}

/// One request served: who, the GPUs it got, and when it held them.
#[derive(Debug)]
struct Grant {
    name: String,
    gpus: Vec<String>,
    start: u128,
    end: u128,
}

struct Scene {
    stage: Stage,
    children: Vec<Child>,
}

impl std::ops::Deref for Scene {
    type Target = Stage;
    fn deref(&self) -> &Stage {
        &self.stage
    }
}

impl Scene {
    fn new() -> Scene {
        Scene {
            stage: Stage::new(),
            children: Vec::new(),
        }
    }

    /// Starts a request and returns once it waits in the queue.
    fn arrive(&mut self, name: &str, mode: &str, gpus: &str, hold_ms: u64) -> u32 {
        let pid = self.start(name, mode, gpus, hold_ms);
        self.until(&format!("{name} (pid {pid}) queued"), |s| {
            s.dir.queue().unwrap().iter().any(|w| w.who.pid == pid)
        });
        pid
    }

    fn start(&mut self, name: &str, mode: &str, gpus: &str, hold_ms: u64) -> u32 {
        let child = tt_testkit::rerun("request")
            .env(ROLE, mode)
            .env("DIR", self.dir.path())
            .env("GPUS", gpus)
            .env("NAME", name)
            .env("LOG", &self.log)
            .env("HOLD_MS", hold_ms.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        self.children.push(child);
        pid
    }

    /// Waits (up to [`PATIENCE`]) until `done` says so.
    fn until(&self, what: &str, done: impl Fn(&Scene) -> bool) {
        let start = Instant::now();
        while !done(self) {
            assert!(
                start.elapsed() < PATIENCE,
                "still waiting for: {what}; granted so far: {:?}; queue: {:?}",
                self.granted(),
                self.dir.queue()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The grants so far, in order: `NAME GPUS`.
    fn granted(&self) -> Vec<String> {
        self.stage.lines()
    }

    /// The grants so far, in the order their holds began.
    fn grants(&self) -> Vec<Grant> {
        let mut grants: Vec<Grant> = self
            .granted()
            .iter()
            .map(|line| {
                let f: Vec<&str> = line.split(' ').collect();
                Grant {
                    name: f[0].to_owned(),
                    gpus: f[1].split(',').map(str::to_owned).collect(),
                    start: f[2].parse().unwrap(),
                    end: f[3].parse().unwrap(),
                }
            })
            .collect();
        grants.sort_by_key(|g| g.start);
        grants
    }

    /// Who was served, in the order their holds began.
    fn names_granted(&self) -> Vec<String> {
        self.grants().into_iter().map(|g| g.name).collect()
    }

    fn finish(&mut self) {
        for child in &mut self.children {
            let status = child.wait().unwrap();
            assert!(status.success() || status.code().is_none(), "{status:?}");
        }
        self.children.clear();
    }
}

impl Drop for Scene {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn hold(dir: &LockDir, gpus: &[u32]) -> Vec<tt_lock::GpuLock> {
    let keys: Vec<GpuKey> = gpus.iter().map(|&i| key(i)).collect();
    dir.lock_many(&keys, Wait::Try, Holder::current()).unwrap()
}

#[test]
fn mixed_requests_are_served_in_arrival_order_round_after_round() {
    // Every request below waits for GPU 0 or for something an earlier one waits for,
    // so the only fair order is the order of arrival, whatever the form.
    let arrivals = [
        ("r1", "block", "0"),
        ("r2", "timeout", "0"),
        ("r3", "many", "0,1"),
        ("r4", "auto", ""),
        ("r5", "block", "1"),
        ("r6", "timeout", "1"),
        ("r7", "auto2", ""),
        ("r8", "block", "0"),
    ];
    for round in 0..3 {
        let mut scene = Scene::new();
        let held = hold(&scene.dir, &[0, 1]);
        // Arrivals in a different order each round; waiting in a known order.
        let mut order: Vec<_> = arrivals.to_vec();
        order.rotate_left(round * 3);
        for (name, mode, gpus) in &order {
            scene.arrive(name, mode, gpus, 10);
        }
        let queue = scene.dir.queue().unwrap();
        assert_eq!(
            queue.iter().map(|w| w.position).collect::<Vec<_>>(),
            (1..=8).collect::<Vec<_>>()
        );
        drop(held);
        scene.until("all eight served", |s| s.granted().len() == 8);
        let arrival = |name: &str| order.iter().position(|(n, _, _)| *n == name).unwrap();
        let grants = scene.grants();
        // What each got: auto takes the most free memory (GPU 0) when both are free.
        for g in &grants {
            let want = match g.name.as_str() {
                "r3" | "r7" => "0,1",
                "r5" | "r6" => "1",
                _ => "0",
            };
            assert_eq!(g.gpus.join(","), want, "round {round}: {g:?} in {grants:?}");
        }
        // Two requests that got a GPU in common held it one after the other, in the
        // order they arrived.
        for a in &grants {
            for b in &grants {
                if arrival(&a.name) < arrival(&b.name) && a.gpus.iter().any(|g| b.gpus.contains(g))
                {
                    assert!(
                        a.end <= b.start,
                        "round {round}: {} arrived before {} but was served after it: {grants:?}",
                        a.name,
                        b.name
                    );
                }
            }
        }
        scene.finish();
        assert!(scene.dir.queue().unwrap().is_empty());
    }
}

#[test]
fn a_two_gpu_request_is_not_starved_by_one_gpu_requests() {
    let mut scene = Scene::new();
    // Held by another process (a process may go ahead of requests waiting for a GPU
    // it holds itself: they wait for it anyway).
    let zero = hold_in_child(&mut scene, 0);
    scene.arrive("pair", "many", "0,1", 10);
    // GPU 1 is free, but the pair waits for it: a stream of one-GPU requests for it
    // queues behind the pair instead of taking it.
    for i in 0..5 {
        scene.arrive(&format!("one{i}"), "block", "1", 1);
    }
    let states = scene.dir.list().unwrap();
    let one = states.iter().find(|s| s.gpu == key(1)).unwrap();
    assert!(!one.held, "nobody took GPU 1 past the pair: {states:?}");
    assert_eq!(one.waiting, 6, "{states:?}");
    assert!(scene.granted().is_empty(), "{:?}", scene.granted());
    // A try on GPU 1 does not go ahead either, and does not queue.
    match scene.dir.lock(&key(1), Wait::Try, Holder::current()) {
        Err(e @ Error::WouldBlock { waiting: 6, .. }) => {
            let text = e.to_string();
            assert!(text.contains("free, but 6 earlier request(s)"), "{text}");
        }
        other => panic!("expected WouldBlock behind 6 requests, got {other:?}"),
    }
    assert_eq!(scene.dir.queue().unwrap().len(), 6);
    // SAFETY: kill has no memory-safety preconditions; the holder is our child.
    unsafe { libc::kill(zero as i32, libc::SIGKILL) };
    scene.until("all six served", |s| s.granted().len() == 6);
    assert_eq!(
        scene.names_granted(),
        ["pair", "one0", "one1", "one2", "one3", "one4"]
    );
    scene.finish();
}

#[test]
fn a_later_request_goes_ahead_only_when_it_delays_nobody() {
    let mut scene = Scene::new();
    let zero = hold(&scene.dir, &[0]);
    scene.arrive("first", "block", "0", 10);
    // The second needs GPU 1 only, which nobody earlier waits for: served at once.
    scene.start("second", "block", "1", 10);
    scene.until("second served while GPU 0 is still held", |s| {
        s.names_granted() == ["second"]
    });
    drop(zero);
    scene.until("first served", |s| s.granted().len() == 2);
    scene.finish();
}

#[test]
fn a_waiter_killed_in_the_middle_leaves_the_queue_by_itself() {
    let mut scene = Scene::new();
    let zero = hold(&scene.dir, &[0]);
    scene.arrive("a", "block", "0", 10);
    let b = scene.arrive("b", "timeout", "0", 10);
    scene.arrive("c", "block", "0", 10);
    // SAFETY: kill has no memory-safety preconditions; b is our child.
    assert_eq!(unsafe { libc::kill(b as i32, libc::SIGKILL) }, 0);
    scene.until("b gone from the queue", |s| {
        let q = s.dir.queue().unwrap();
        q.len() == 2 && q.iter().all(|w| w.who.pid != b)
    });
    let queue = scene.dir.queue().unwrap();
    assert_eq!(queue.iter().map(|w| w.position).collect::<Vec<_>>(), [1, 2]);
    drop(zero);
    scene.until("a and c served", |s| s.granted().len() == 2);
    assert_eq!(scene.names_granted(), ["a", "c"]);
    scene.finish();
    // The dead ticket was this user's: removed, nothing left but the lock files, the
    // holder record this user keeps for the GPU, and the usage log.
    let left: Vec<String> = std::fs::read_dir(scene.dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".lock") && !n.starts_with(tt_lock::USAGE_PREFIX))
        .filter(|n| !(n.starts_with("held-") && n.contains(".user-")))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_timeout_leaves_the_queue_at_its_deadline_and_the_next_is_served() {
    let mut scene = Scene::new();
    // The holder is another process: this one could not wait for a lock it holds.
    let holder = hold_in_child(&mut scene, 0);
    let dir = scene.dir.clone();
    let limit = Duration::from_millis(400);
    let timed = std::thread::spawn(move || {
        let start = Instant::now();
        let r = dir.lock(&key(0), Wait::Timeout(limit), Holder::current());
        (start.elapsed(), r.map(drop))
    });
    scene.until("the timed request queued", |s| {
        s.dir
            .queue()
            .unwrap()
            .iter()
            .any(|w| w.who.pid == std::process::id())
    });
    scene.arrive("after", "block", "0", 10);
    let (waited, result) = timed.join().unwrap();
    assert!(waited >= limit, "returned early, after {waited:?}");
    match result {
        Err(Error::Timeout { waiting: 0, .. }) => {}
        other => panic!("expected a timeout with nobody ahead, got {other:?}"),
    }
    let queue = scene.dir.queue().unwrap();
    assert!(
        queue.iter().all(|w| w.who.pid != std::process::id()) && queue.len() == 1,
        "the timed request left the queue: {queue:?}"
    );
    // SAFETY: as above.
    unsafe { libc::kill(holder as i32, libc::SIGKILL) };
    scene.until("after served", |s| s.names_granted() == ["after"]);
}

/// Starts a child that holds GPU `i` (for as long as the test runs) and returns its pid
/// once it holds it.
fn hold_in_child(scene: &mut Scene, i: u32) -> u32 {
    let pid = scene.start(&format!("holder{i}"), "block", &i.to_string(), 600_000);
    scene.until("the holder holds", |s| {
        s.dir
            .list()
            .unwrap()
            .iter()
            .any(|l| l.gpu == key(i) && l.holder.as_ref().is_some_and(|h| h.who.pid == pid))
    });
    pid
}

#[test]
fn try_never_queues_and_the_queue_lists_who_waits_for_what() {
    let mut scene = Scene::new();
    let zero = hold_in_child(&mut scene, 0);
    let one = hold_in_child(&mut scene, 1);
    let pid = scene.arrive("pair", "many", "0,1", 10);
    let auto = scene.arrive("auto", "auto", "", 10);
    let queue = scene.dir.queue().unwrap();
    assert_eq!(queue.len(), 2);
    assert_eq!((queue[0].position, queue[0].who.pid), (1, pid));
    assert_eq!(
        queue[0].wants,
        Wants::Gpus {
            gpus: vec![key(0), key(1)]
        }
    );
    assert_eq!(queue[1].who.pid, auto);
    assert_eq!(
        queue[1].wants,
        Wants::Auto {
            count: 1,
            among: vec![key(0), key(1)]
        }
    );
    assert!(queue[0].who.since_unix <= queue[1].who.since_unix);
    assert!(!queue[0].who.user.is_empty() && !queue[0].who.command.is_empty());
    for _ in 0..3 {
        match scene.dir.lock(&key(0), Wait::Try, Holder::current()) {
            Err(Error::WouldBlock {
                waiting: 2,
                holder: Some(h),
                ..
            }) => {
                assert_eq!(h.who.pid, zero);
            }
            other => panic!("expected WouldBlock naming the holder, got {other:?}"),
        }
    }
    assert_eq!(scene.dir.queue().unwrap().len(), 2, "try never queues");
    let states = scene.dir.list().unwrap();
    assert!(
        states.iter().all(|s| s.held && s.waiting == 2),
        "{states:?}"
    );
    for holder in [zero, one] {
        // SAFETY: as above.
        unsafe { libc::kill(holder as i32, libc::SIGKILL) };
    }
    scene.until("both served", |s| s.granted().len() == 2);
    assert_eq!(scene.names_granted(), ["pair", "auto"]);
    scene.finish();
}

#[test]
fn a_request_that_found_the_queue_empty_sees_a_request_that_came_since() {
    // This process's directory found the queue empty at its last request, and knows
    // without listing the directory again that it still is until a name is added; a
    // request of another process that queues since must be seen all the same.
    let mut scene = Scene::new();
    let mine = LockDir::open(scene.dir.path()).unwrap();
    for _ in 0..3 {
        drop(mine.lock(&key(0), Wait::Try, Holder::current()).unwrap());
    }
    let holder = hold_in_child(&mut scene, 1);
    let pair = scene.arrive("pair", "many", "0,1", 10);
    // GPU 0 is free, but the pair waits for it: `try` is refused, naming the waiter.
    match mine.lock(&key(0), Wait::Try, Holder::current()) {
        Err(Error::WouldBlock { waiting: 1, .. }) => {}
        other => panic!("expected WouldBlock behind pid {pair}, got {other:?}"),
    }
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(holder as i32, libc::SIGKILL) };
    scene.until("the pair served", |s| s.granted().len() == 1);
    scene.finish();
    // Its ticket gone, the queue is empty again.
    drop(mine.lock(&key(0), Wait::Try, Holder::current()).unwrap());
}

#[test]
fn ticket_files_are_readable_by_all_and_never_followed() {
    let scene = Scene::new();
    let _zero = hold(&scene.dir, &[0]);
    let mut scene = scene;
    scene.arrive("w", "block", "0", 10);
    let ticket = std::fs::read_dir(scene.dir.path())
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("wait-"))
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    let mode = ticket.metadata().unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644, "{:?}", ticket.path());
    // A symbolic link planted with a ticket's name is not a request.
    let planted = scene.dir.path().join("wait-00000000000000000000.json");
    std::os::unix::fs::symlink(ticket.path(), &planted).unwrap();
    assert_eq!(scene.dir.queue().unwrap().len(), 1);
    assert!(Path::new(&planted).exists());
}

#[test]
fn a_process_holding_a_gpu_does_not_wait_behind_a_request_that_waits_for_it() {
    // This process holds GPU 0; an earlier request waits for GPUs 0 and 1. Waiting
    // behind it for GPU 1 would wait for ourselves: the request for GPU 1 is granted.
    let mut scene = Scene::new();
    let zero = hold(&scene.dir, &[0]);
    scene.arrive("pair", "many", "0,1", 10);
    let one = scene
        .dir
        .lock(&key(1), Wait::Timeout(PATIENCE), Holder::current())
        .unwrap();
    assert!(scene.granted().is_empty());
    drop((zero, one));
    scene.until("the pair served", |s| s.names_granted() == ["pair"]);
    scene.finish();
}

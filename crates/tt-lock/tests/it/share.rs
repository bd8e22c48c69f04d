//! Several jobs on one GPU by memory budget, with real processes: random schedules of
//! shared and exclusive requests on an 80 GiB GPU never put more than 80 GiB of budgets
//! on it at once, never let an exclusive holder meet anyone, serve every request in
//! arrival order, and never wedge after `kill -9`s of holders and waiters. Every step
//! waits for an event (a request seen in the queue, a grant in the log).

use std::io::Write;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use tt_device::Bytes;
use tt_lock::{Error, GpuKey, Holder, LockDir, UsageEvent, Wait};

use crate::common;
use common::{now_ns, Stage, PATIENCE};

const ROLE: &str = "TT_SHARE_TEST_ROLE";
const GIB: u64 = 1 << 30;
const CAPACITY: Bytes = Bytes(80 * GIB);

fn gpu() -> GpuKey {
    GpuKey::of_uuid("GPU-00000000-0000-4000-8000-000000000000")
}

/// The child side: `ROLE` = `share` (a budget of `GIB` GiB) or `alone`; on grant the
/// line `granted NAME T` is appended to `LOG`, then a hold of `HOLD_MS`, the line
/// `released NAME T`, and exit. A sharer also checks the ledger it joined.
#[test]
#[ignore = "a child process's entry point, run by the sharing tests"]
fn request() {
    let Ok(mode) = std::env::var(ROLE) else {
        return;
    };
    // SAFETY: prctl(PR_SET_PDEATHSIG) has no memory-safety preconditions.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let var = |name: &str| std::env::var(name).unwrap();
    let dir = LockDir::open(var("DIR")).unwrap();
    let holder = Holder::current();
    let lock = match mode.as_str() {
        "share" => {
            let bytes = Bytes(var("GIB").parse::<u64>().unwrap() * GIB);
            dir.lock_shared(&gpu(), bytes, CAPACITY, Wait::Block, holder)
                .unwrap()
        }
        "alone" => dir.lock(&gpu(), Wait::Block, holder).unwrap(),
        other => panic!("unknown mode {other}"),
    };
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(var("LOG"))
        .unwrap();
    // One write per line (O_APPEND): lines from processes never interleave.
    log.write_all(format!("granted {} {}\n", var("NAME"), now_ns()).as_bytes())
        .unwrap();
    if lock.share().is_some() {
        let budgets: u64 = dir
            .sharers(&gpu())
            .unwrap()
            .iter()
            .map(|h| h.share.unwrap().0)
            .sum();
        assert!(budgets <= CAPACITY.0, "{budgets} budgeted on 80 GiB");
    }
    std::thread::sleep(Duration::from_millis(var("HOLD_MS").parse().unwrap()));
    log.write_all(format!("released {} {}\n", var("NAME"), now_ns()).as_bytes())
        .unwrap();
    drop(lock);
}

/// splitmix64: a schedule is reproducible from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One request of a schedule.
struct Request {
    name: String,
    /// Its budget in GiB; `None` asks for the GPU alone.
    gib: Option<u64>,
    child: Child,
    /// When it was `kill -9`ed (just before the signal): its hold ended after.
    killed: Option<u128>,
}

struct Scene {
    stage: Stage,
    requests: Vec<Request>,
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
            requests: Vec::new(),
        }
    }

    /// Starts a request and returns once it is granted or waits in the queue.
    fn arrive(&mut self, name: &str, gib: Option<u64>, hold_ms: u64) {
        let mut cmd = tt_testkit::rerun("request");
        match gib {
            Some(g) => cmd.env(ROLE, "share").env("GIB", g.to_string()),
            None => cmd.env(ROLE, "alone"),
        };
        let child = cmd
            .env("DIR", self.dir.path())
            .env("NAME", name)
            .env("LOG", &self.log)
            .env("HOLD_MS", hold_ms.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        self.requests.push(Request {
            name: name.to_owned(),
            gib,
            child,
            killed: None,
        });
        let granted = format!("granted {name} ");
        self.until(&format!("{name} (pid {pid}) granted or queued"), |s| {
            s.lines().iter().any(|l| l.starts_with(&granted))
                || s.dir.queue().unwrap().iter().any(|w| w.who.pid == pid)
        });
    }

    fn until(&self, what: &str, done: impl Fn(&Scene) -> bool) {
        let start = Instant::now();
        while !done(self) {
            assert!(
                start.elapsed() < PATIENCE,
                "still waiting for: {what}; log: {:?}; queue: {:?}",
                self.lines(),
                self.dir.queue()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn kill(&mut self, i: usize) {
        let r = &mut self.requests[i];
        r.killed = Some(now_ns());
        let _ = r.child.kill();
    }

    /// Waits for every request to end (a wedge fails here, at PATIENCE).
    fn finish(&mut self) {
        let start = Instant::now();
        for r in &mut self.requests {
            loop {
                if let Some(status) = r.child.try_wait().unwrap() {
                    assert!(
                        status.success() || r.killed.is_some(),
                        "{} ended with {status:?}",
                        r.name
                    );
                    break;
                }
                assert!(
                    start.elapsed() < PATIENCE,
                    "{} never ended: wedged; log: {:?}; queue: {:?}",
                    r.name,
                    self.stage.lines(),
                    self.stage.dir.queue()
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// Each request's hold, as the log (and the kill) bound it: `(gib, start, end)`,
    /// `gib` 0 for the GPU alone. The interval is inside the real hold.
    fn holds(&self) -> Vec<(u64, u128, u128)> {
        let lines = self.lines();
        let at = |word: &str, name: &str| {
            lines.iter().find_map(|l| {
                let mut f = l.split(' ');
                (f.next() == Some(word) && f.next() == Some(name))
                    .then(|| f.next().unwrap().parse::<u128>().unwrap())
            })
        };
        self.requests
            .iter()
            .filter_map(|r| {
                let start = at("granted", &r.name)?;
                let end = at("released", &r.name).or(r.killed)?;
                Some((r.gib.unwrap_or(0), start, end.max(start)))
            })
            .collect()
    }

    /// The pids in the order the usage log recorded their grants.
    fn grant_order(&self) -> Vec<u32> {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        std::fs::read_to_string(self.dir.usage_log_path(uid))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| match serde_json::from_str::<UsageEvent>(l).ok()? {
                UsageEvent::Start { pid, .. } => Some(pid),
                _ => None,
            })
            .collect()
    }
}

impl Drop for Scene {
    fn drop(&mut self) {
        for r in &mut self.requests {
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    }
}

#[test]
fn random_schedules_never_overbook_the_gpu_keep_arrival_order_and_never_wedge() {
    for seed in 0..20u64 {
        let mut rng = Rng(seed);
        let mut scene = Scene::new();
        let n = 6;
        for i in 0..n {
            let gib = (rng.below(4) != 0).then(|| 10 * (1 + rng.below(6)));
            let hold = 20 + rng.below(120);
            scene.arrive(&format!("r{i}"), gib, hold);
            // Now and then a `kill -9` of a request, holding or waiting.
            if rng.below(5) == 0 {
                let victim = rng.below(i + 1) as usize;
                if scene.requests[victim].killed.is_none() {
                    scene.kill(victim);
                }
            }
        }
        scene.finish();
        let holds = scene.holds();
        // At every start, what holds the GPU then (including the one starting).
        for &(gib, start, _) in &holds {
            let during: Vec<&(u64, u128, u128)> = holds
                .iter()
                .filter(|h| h.1 <= start && start < h.2)
                .collect();
            let budgets: u64 = during.iter().map(|h| h.0).sum();
            assert!(
                budgets <= 80,
                "seed {seed}: {budgets} GiB of budgets on an 80 GiB GPU at once: {holds:?}"
            );
            if gib == 0 || during.iter().any(|h| h.0 == 0) {
                assert_eq!(
                    during.len(),
                    1,
                    "seed {seed}: the GPU held alone beside others: {holds:?}"
                );
            }
        }
        // First come, first served: every request wants the same GPU, so grants come
        // in arrival order (a request killed while waiting is never granted).
        let arrival: Vec<u32> = scene.requests.iter().map(|r| r.child.id()).collect();
        let order = scene.grant_order();
        let expected: Vec<u32> = arrival
            .iter()
            .copied()
            .filter(|p| order.contains(p))
            .collect();
        assert_eq!(order, expected, "seed {seed}: grants out of arrival order");
        let unkilled = scene.requests.iter().filter(|r| r.killed.is_none()).count();
        assert!(
            order.len() >= unkilled,
            "seed {seed}: {} grants for {unkilled} requests never killed",
            order.len()
        );
    }
}

#[test]
fn sharers_fit_side_by_side_a_whole_gpu_request_waits_for_all_and_kill_9_frees_a_budget() {
    let scene = Scene::new();
    let dir = &scene.dir;
    let a = dir
        .lock_shared(
            &gpu(),
            Bytes(30 * GIB),
            CAPACITY,
            Wait::Try,
            Holder::current(),
        )
        .unwrap();
    assert_eq!(a.share(), Some(Bytes(30 * GIB)));
    // A second share in this process would wait for itself.
    assert!(matches!(
        dir.lock_shared(&gpu(), Bytes(GIB), CAPACITY, Wait::Try, Holder::current()),
        Err(Error::AlreadyHeld { .. })
    ));
    // The views: not held alone, shared by one with its budget.
    let state = dir
        .list()
        .unwrap()
        .into_iter()
        .find(|s| s.gpu == gpu())
        .unwrap();
    assert!(!state.held, "{state:?}");
    assert_eq!(state.shares.len(), 1);
    assert_eq!(state.shared_bytes(), Bytes(30 * GIB));
    assert!(
        state.to_string().contains("shared by 1 job(s), 30.00 GiB"),
        "{state}"
    );

    // Another process: 40 GiB fit beside 30, 60 do not.
    let mut scene = scene;
    scene.arrive("b40", Some(40), 60_000);
    scene.until("b40 granted", |s| {
        s.lines().iter().any(|l| l.starts_with("granted b40 "))
    });
    let state = scene
        .dir
        .list()
        .unwrap()
        .into_iter()
        .find(|s| s.gpu == gpu())
        .unwrap();
    assert_eq!(state.shared_bytes(), Bytes(70 * GIB), "{state:?}");
    match scene.dir.lock(&gpu(), Wait::Try, Holder::current()) {
        Err(Error::AlreadyHeld { .. }) => {}
        other => panic!("this process shares the GPU; a whole lock is refused: {other:?}"),
    }
    drop(a);
    // The whole GPU waits for the other sharer; a `kill -9` of it lets the GPU go.
    let e = scene
        .dir
        .lock(&gpu(), Wait::Try, Holder::current())
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("sharing the GPU with a budget of 40.00 GiB"),
        "{text}"
    );
    scene.arrive("whole", None, 10);
    scene.arrive("c60", Some(60), 10);
    assert!(
        !scene
            .lines()
            .iter()
            .any(|l| l.starts_with("granted whole ")),
        "the whole GPU was granted beside a sharer"
    );
    scene.kill(0);
    scene.until("whole, then c60, granted", |s| {
        let lines = s.lines();
        lines.iter().any(|l| l.starts_with("granted c60 "))
    });
    let lines = scene.lines();
    let pos = |p: &str| lines.iter().position(|l| l.starts_with(p)).unwrap();
    assert!(pos("granted whole ") < pos("granted c60 "), "{lines:?}");
    scene.finish();
    // The dead sharer's record is gone from the ledger.
    assert!(scene.dir.sharers(&gpu()).unwrap().is_empty());
}

#[test]
fn a_share_that_can_never_fit_is_refused_at_once() {
    let scene = Scene::new();
    for (bytes, says) in [
        (Bytes(0), "0 bytes"),
        (Bytes(81 * GIB), "the GPU has 80.00 GiB"),
    ] {
        let e = scene
            .dir
            .lock_shared(&gpu(), bytes, CAPACITY, Wait::Block, Holder::current())
            .unwrap_err();
        assert!(matches!(e, Error::BadShare { .. }), "{e:?}");
        assert!(e.to_string().contains(says), "{e}");
    }
}

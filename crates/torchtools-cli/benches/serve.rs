//! `torchtools serve` under a lab's load: 16 GPUs held, 200 jobs and 100,000 usage
//! records; the page and `/api/state` timed per request, and requests per second with
//! 20 clients at once, on loopback. Rows for `cargo xtask bench`
//! (`row|what|ours|baseline name|baseline|unit|higher|lower`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tt_lock::{GpuKey, Holder, LockDir, Wait};

const GPUS: usize = 16;
const JOBS: usize = 200;
const USAGE_RECORDS: usize = 100_000;
const CLIENTS: usize = 20;
const REQUESTS_PER_CLIENT: usize = 50;
const SEQUENTIAL: usize = 100;

/// One GET on a new connection: the body's length.
fn get(port: u16, path: &str) -> usize {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read");
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out[..out.len().min(200)])
    );
    out.len()
}

/// The lab: 16 GPUs held by this process, 200 ended jobs, 100,000 usage records.
fn lab(path: &std::path::Path) -> Vec<tt_lock::GpuLock> {
    let dir = LockDir::open(path).expect("lock dir");
    let me = Holder::current();
    let uid = tt_lock::euid();
    let now = tt_device::now_unix();
    let mut log = String::with_capacity(USAGE_RECORDS * 300);
    for i in 0..USAGE_RECORDS {
        let start = now - 7.0 * 86_400.0 + i as f64 * 6.0;
        log.push_str(&format!(
            "{{\"event\":\"start\",\"id\":\"r{i}\",\"user\":\"{u}\",\"host\":\"h\",\"pid\":{i},\
             \"gpu\":\"index {g}\",\"bytes\":1073741824,\"time\":{start},\"command\":[\"python\",\"train.py\"]}}\n\
             {{\"event\":\"end\",\"id\":\"r{i}\",\"time\":{end},\"status\":0}}\n",
            u = me.who.user,
            g = i % GPUS,
            end = start + 5.0
        ));
    }
    std::fs::write(dir.usage_log_path(uid), log).expect("usage log");
    for j in 0..JOBS {
        let id = format!("1700000000-{j}");
        let record = serde_json::json!({
            "id": id, "user": me.who.user, "uid": uid, "host": me.who.host, "boot_id": "bench",
            "command": ["torchtools", "run", "--", "python", "train.py", format!("--seed={j}")],
            "log": format!("/tmp/bench-{j}.log"), "since_unix": now - 3600.0,
            "keeper_pid": 1, "pid": 1, "ended_unix": now - 60.0, "status": 0, "runs": 1,
        });
        std::fs::write(path.join(format!("job-{id}.json")), record.to_string())
            .expect("job record");
    }
    (0..GPUS)
        .map(|g| {
            let key = GpuKey::of_uuid(&format!("GPU-00000000-0000-4000-8000-{g:012}"));
            dir.lock(&key, Wait::Try, me.clone()).expect("a GPU's lock")
        })
        .collect()
}

fn main() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let locks = tmp.path().join("locks");
    let _held = lab(&locks);
    let mut server = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("TORCHTOOLS_LOCK_DIR", &locks)
        .stderr(Stdio::piped())
        .spawn()
        .expect("torchtools serve");
    let mut line = String::new();
    BufReader::new(server.stderr.take().expect("stderr"))
        .read_line(&mut line)
        .expect("its address");
    let port: u16 = line
        .trim()
        .strip_prefix("torchtools: serving the page at http://127.0.0.1:")
        .and_then(|r| r.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));

    // How long one read of the whole state takes (what the server does every 0.5 s),
    // as the three views a user runs today: top --json, jobs --all --json, usage --json.
    let views = || {
        let start = Instant::now();
        for args in [
            &["top", "--json"][..],
            &["jobs", "--all", "--json"],
            &["usage", "--json"],
        ] {
            let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
                .args(args)
                .env("TORCHTOOLS_LOCK_DIR", &locks)
                .output()
                .expect("a view");
            assert!(out.status.success(), "{out:?}");
        }
        start.elapsed().as_secs_f64() * 1e3
    };
    let views_ms = tt_testkit::bench::median((0..5).map(|_| views()).collect());

    let mut size = 0;
    let per_request = |path: &str, size: &mut usize| {
        tt_testkit::bench::median(
            (0..SEQUENTIAL)
                .map(|_| {
                    let start = Instant::now();
                    *size = get(port, path);
                    start.elapsed().as_secs_f64() * 1e3
                })
                .collect(),
        )
    };
    let state_ms = per_request("/api/state", &mut size);
    let state_bytes = size;
    let page_ms = per_request("/", &mut size);
    let metrics_ms = per_request("/metrics", &mut size);

    let concurrent = |path: &'static str| {
        let start = Instant::now();
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                std::thread::spawn(move || {
                    for _ in 0..REQUESTS_PER_CLIENT {
                        get(port, path);
                    }
                })
            })
            .collect();
        for c in clients {
            c.join().expect("a client");
        }
        (CLIENTS * REQUESTS_PER_CLIENT) as f64 / start.elapsed().as_secs_f64()
    };
    let state_rps = concurrent("/api/state");
    let metrics_rps = concurrent("/metrics");
    let _ = server.kill();
    let _ = server.wait();

    println!(
        "torchtools serve ({GPUS} GPUs held, {JOBS} jobs, {USAGE_RECORDS} usage records; \
         /api/state is {:.0} KiB)",
        state_bytes as f64 / 1024.0
    );
    println!(
        "  /api/state {state_ms:.2} ms, / {page_ms:.2} ms, /metrics {metrics_ms:.1} ms per request"
    );
    println!("  the same state by the CLI's three --json views: {views_ms:.0} ms");
    println!("  {CLIENTS} clients at once: /api/state {state_rps:.0} req/s, /metrics {metrics_rps:.0} req/s");
    println!("row|serve: /api/state, {GPUS} GPUs + {JOBS} jobs + {USAGE_RECORDS} usage records (ms per request)|{state_ms:.2}|top + jobs --all + usage --json (3 processes)|{views_ms:.1}|ms|lower");
    println!("row|serve: the page (ms per request)|{page_ms:.2}|goal|10.0|ms|lower");
    println!("row|serve: /api/state, {CLIENTS} clients at once (req/s)|{state_rps:.0}|/metrics on the same server|{metrics_rps:.0}|req/s|higher");
    println!("row|serve: /metrics, {GPUS} GPUs + {JOBS} jobs + {USAGE_RECORDS} usage records (ms per scrape)|{metrics_ms:.2}|goal|50.0|ms|lower");
}

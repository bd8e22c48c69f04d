//! `torchtools metrics` read by the real tools: a Prometheus server (Debian's package,
//! installed by `cargo xtask setup`) scrapes `--listen` while a detached job holds a GPU
//! and another waits for it, and the test reads the GPU, user, queue and job series
//! back through Prometheus's HTTP API; `--textfile`'s file passes `promtool check
//! metrics`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::{free_port, ok, tt, until, Killed, Stopped};

/// A GET of `path` on `127.0.0.1:port`: the body.
fn get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_owned())
}

/// A query's samples through Prometheus's HTTP API: each series' labels and value.
fn query(port: u16, promql: &str) -> Vec<(serde_json::Value, f64)> {
    let encoded: String = promql
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let Some(body) = get(port, &format!("/api/v1/query?query={encoded}")) else {
        return Vec::new();
    };
    let Ok(answer) = serde_json::from_str::<serde_json::Value>(&body) else {
        return Vec::new();
    };
    answer["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|r| {
            let value = r["value"][1].as_str().unwrap_or("nan").parse().unwrap();
            (r["metric"].clone(), value)
        })
        .collect()
}

#[test]
fn prometheus_scrapes_the_gpu_user_queue_and_job_series() {
    assert!(
        Command::new("prometheus").arg("--version").output().is_ok(),
        "Prometheus is not installed: `cargo xtask setup` installs Debian's prometheus \
         (or `apt-get install prometheus`)"
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let me = ok(Command::new("id").arg("-un").output().unwrap())
        .trim()
        .to_owned();

    // A detached job holds GPU 0 with 2 GiB reserved; another waits for it.
    let ready = dir.join("ready");
    let holder = ok(tt(dir)
        .args([
            "reserve",
            "--detach",
            "--gpu",
            "0",
            "--no-fence",
            "--bytes",
            "2GiB",
        ])
        .args(["--", "sh", "-c"])
        .arg(format!("touch {}; exec sleep 600", ready.display()))
        .output()
        .unwrap())
    .trim()
    .to_owned();
    let _stop_holder = Stopped(dir, holder.clone());
    until("the holder runs", || ready.exists());
    let waiter = ok(tt(dir)
        .args([
            "reserve",
            "--detach",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "true",
        ])
        .output()
        .unwrap())
    .trim()
    .to_owned();
    let _stop_waiter = Stopped(dir, waiter);
    until("the waiter queues", || {
        ok(tt(dir).args(["queue", "--json"]).output().unwrap()).contains("\"pid\"")
    });

    // The exporter, on a port of its choosing (it says which).
    let mut exporter = tt(dir)
        .args(["metrics", "--listen", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(exporter.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let exporter = Killed(exporter);
    let address = line
        .trim()
        .strip_prefix("torchtools: serving metrics at http://")
        .and_then(|a| a.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("{line}"))
        .to_owned();
    // What a plain scraper (no OpenMetrics in Accept) gets: the text format.
    let port: u16 = address.rsplit(':').next().unwrap().parse().unwrap();
    let body = get(port, "/metrics").unwrap();
    assert!(
        body.contains("# TYPE torchtools_user_gpu_seconds_total counter")
            && !body.contains("# EOF"),
        "{body}"
    );

    // Prometheus, scraping it every second.
    let web = free_port();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: torchtools\n    \
             static_configs:\n      - targets: ['{address}']\n"
        ),
    )
    .unwrap();
    let prometheus = Killed(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{web}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let value = |promql: &str| query(web, promql).first().map(|(_, v)| *v);
    until("Prometheus has scraped torchtools", || {
        value("up{job=\"torchtools\"}") == Some(1.0)
            && value("torchtools_gpu_locked{gpu=\"0\"}").is_some()
    });
    // The GPU: held alone, by me, 2 GiB reserved, one waiter.
    assert_eq!(value("torchtools_gpu_locked{gpu=\"0\"}"), Some(1.0));
    assert_eq!(
        value(&format!(
            "torchtools_gpu_reserved_bytes{{gpu=\"0\",user=\"{me}\"}}"
        )),
        Some(2_147_483_648.0)
    );
    assert_eq!(value("torchtools_gpu_waiters{gpu=\"0\"}"), Some(1.0));
    // The user: a request queued, GPU time counted, one job running and one waiting.
    assert_eq!(
        value(&format!("torchtools_queue_waiters{{user=\"{me}\"}}")),
        Some(1.0)
    );
    until("GPU-seconds grow", || {
        value(&format!(
            "torchtools_user_gpu_seconds_total{{user=\"{me}\"}}"
        ))
        .is_some_and(|s| s > 0.0)
    });
    for state in ["running", "waiting"] {
        assert_eq!(
            value(&format!(
                "torchtools_user_jobs{{user=\"{me}\",state=\"{state}\"}}"
            )),
            Some(1.0),
            "{state}"
        );
    }
    // The machine, by its own name (for a dashboard of several servers).
    let server = query(web, "torchtools_server");
    assert_eq!(server.len(), 1, "{server:?}");
    assert_eq!(
        server[0].0["host"],
        tt_device::host_name().as_str(),
        "{server:?}"
    );
    assert!(
        server[0].0["lock_dir"].as_str().unwrap().ends_with("locks"),
        "{server:?}"
    );
    // The running job: its GPU and budget.
    let job = query(web, "torchtools_job_reserved_bytes");
    assert_eq!(job.len(), 1, "{job:?}");
    assert_eq!(job[0].0["job_id"], holder.as_str());
    assert_eq!(job[0].0["gpu"], "0");
    assert_eq!(job[0].1, 2_147_483_648.0);
    drop(prometheus);
    drop(exporter);

    // --textfile: node_exporter's file, checked by Prometheus's own promtool.
    let out = dir.join("textfile");
    std::fs::create_dir(&out).unwrap();
    let writer = Killed(
        tt(dir)
            .args(["metrics", "--interval", "1s", "--textfile"])
            .arg(&out)
            .spawn()
            .unwrap(),
    );
    let file = out.join("torchtools.prom");
    until("the textfile is written", || file.exists());
    drop(writer);
    let check = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .unwrap();
    assert!(check.status.success(), "{check:?}");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.contains("torchtools_gpu_locked{gpu=\"0\",uuid=\"\"} 1"),
        "{text}"
    );
}

#[test]
fn bad_places_are_refused_before_anything_is_served() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tt(tmp.path())
        .args(["metrics", "--textfile"])
        .arg(tmp.path().join("missing"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a directory"));
    // A port already taken.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = tt(tmp.path())
        .args(["metrics", "--listen", &format!("127.0.0.1:{port}")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot listen there"));
    // Printed once: OpenMetrics, ending as the format says.
    let text = ok(tt(tmp.path()).arg("metrics").output().unwrap());
    assert!(text.ends_with("# EOF\n"), "{text}");
}

/// A raw request's status line (`head` is the request line and any headers).
fn status_of(port: u16, head: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let _ = write!(s, "{head}\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text.lines().next().unwrap_or_default().to_owned()
}

/// `metrics --listen` answers as `serve` does: a client that sends half a request holds
/// no scrape back, a request head past 16 KiB is refused without being read, and
/// anything but a GET is refused; scrapes go on.
#[test]
fn the_exporter_is_read_only_and_bounded_and_a_slow_client_holds_nobody() {
    let tmp = tempfile::tempdir().unwrap();
    let mut exporter = tt(tmp.path())
        .args(["metrics", "--listen", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(exporter.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _exporter = Killed(exporter);
    let port: u16 = line
        .trim()
        .strip_suffix("/metrics")
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    let mut slow = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(slow, "GET /metrics HTTP/1.1\r\nHost: 127.").unwrap();
    assert!(status_of(port, "GET /metrics HTTP/1.1").contains(" 200 "));
    drop(slow);
    crate::common::refuses_a_64_kib_head(port, "/metrics");
    let post = status_of(port, "POST /metrics HTTP/1.1\r\nContent-Length: 0");
    assert!(post.contains(" 405 "), "{post}");
    assert!(status_of(port, "GET /elsewhere HTTP/1.1").contains(" 404 "));
    assert!(get(port, "/metrics").is_some_and(|b| b.contains("torchtools_")));
}

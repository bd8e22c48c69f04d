//! `torchtools serve` in a real browser: Debian's Chromium, headless, driven through
//! WebDriver (chromedriver, installed by `cargo xtask setup`). A held GPU, a share, a
//! waiting request and a detached job appear on the page and leave it when they end,
//! read from the DOM; a job whose command holds markup shows it as text and adds no
//! element. `/api/state` holds what the command's own `--json` views hold.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};

use crate::common::{detach, free_port, ok, tt, until, Killed, Stopped};

/// How long the page may take to show a change: generous (the page itself is read
/// every 0.5 s and redrawn every 1 s; the latency seen is printed, not asserted).
const PAGE_PATIENCE: Duration = Duration::from_secs(60);

/// A request's status line and body.
fn request(port: u16, head: &str) -> (String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "{head}\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (headers, body) = text.split_once("\r\n\r\n").unwrap();
    (headers.lines().next().unwrap().to_owned(), body.to_owned())
}

fn state(port: u16) -> serde_json::Value {
    let (status, body) = request(port, "GET /api/state HTTP/1.1");
    assert!(status.contains(" 200 "), "{status}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// `torchtools serve` on a port of its choosing (it says which).
fn serve(dir: &Path) -> (Killed, u16) {
    serve_with(dir, &[])
}

/// `torchtools serve ARGS` on a port of its choosing, once it says which.
fn serve_with(dir: &Path, args: &[&str]) -> (Killed, u16) {
    let mut command = tt(dir);
    command
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args);
    serving(command)
}

/// The server `command` starts, on the port it says.
fn serving(mut command: Command) -> (Killed, u16) {
    let mut server = command.stderr(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(server.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let server = Killed(server);
    let port = line
        .split_once(" at http://127.0.0.1:")
        .and_then(|(_, rest)| rest.split('/').next())
        .unwrap_or_else(|| panic!("{line}"))
        .parse()
        .unwrap();
    (server, port)
}

/// A reservation held by a process of the test (`reserve ... -- sleep 600`), once its
/// command runs.
fn hold(dir: &Path, args: &[&str]) -> Killed {
    let ready = dir.join(format!("ready-{}", args.join("-")));
    let child = tt(dir)
        .arg("reserve")
        .args(args)
        .args(["--no-fence", "--", "sh", "-c"])
        .arg(format!("touch '{}'; exec sleep 600", ready.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let child = Killed(child);
    until("the reservation's command runs", || ready.exists());
    child
}

/// Whether a job of this test holds `gpu` (`jobs --json`'s `gpus`).
fn job_holds(dir: &Path, gpu: &str) -> bool {
    let rows: serde_json::Value =
        serde_json::from_str(&ok(tt(dir).args(["jobs", "--json"]).output().unwrap())).unwrap();
    rows.as_array()
        .unwrap()
        .iter()
        .any(|j| j["gpus"].as_array().unwrap().iter().any(|g| g == gpu))
}

/// A request for GPU 0 that waits (`reserve --gpu 0 -- true`), ended with the test.
fn wait_for_gpu_0(dir: &Path) -> Killed {
    Killed(
        tt(dir)
            .args(["reserve", "--gpu", "0", "--no-fence", "--", "true"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// The target directory (where the screenshot goes): this test binary's
/// `target/debug/deps/..`.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors().nth(3).unwrap().to_owned()
}

/// chromedriver and the Chromium it started, in a process group of their own, ended
/// together: a browser whose session was not closed (a failed assertion), or that
/// outlived its closed session, would otherwise run on after the test (one was found
/// half an hour after a CI run's page test).
struct Browser(Killed);

impl Drop for Browser {
    fn drop(&mut self) {
        if let Ok(group) = i32::try_from(self.0 .0.id()) {
            // SAFETY: kill(2) of the process group this test created for chromedriver
            // (its leader not reaped yet: the group id is still ours).
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
    }
}

/// Chromium headless through chromedriver (the flags a closed network needs).
async fn browser(dir: &Path) -> (Browser, Client) {
    assert!(
        Command::new("chromedriver")
            .arg("--version")
            .output()
            .is_ok()
            && Command::new("chromium").arg("--version").output().is_ok(),
        "Chromium and chromedriver are not installed: `cargo xtask setup` installs Debian's \
         chromium and chromium-driver (or `apt-get install chromium chromium-driver`)"
    );
    let port = free_port();
    let mut driver = Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(driver.stdout.take().unwrap());
    let driver = Browser(Killed(driver));
    let mut line = String::new();
    while !line.contains("started successfully") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "chromedriver ended");
    }
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    let profile = dir.join("chromium-profile");
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                "--window-size=1280,1000", format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let client = ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .unwrap();
    (driver, client)
}

/// Waits until the page has `css` (or, with `present == false`, no longer has it): the
/// time it took.
async fn page_shows(client: &Client, css: &str, present: bool) -> Duration {
    let start = Instant::now();
    loop {
        let found = !client.find_all(Locator::Css(css)).await.unwrap().is_empty();
        if found == present {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < PAGE_PATIENCE,
            "the page still {} {css}",
            if present { "lacks" } else { "shows" }
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The text `css` shows, read by one script in the page: the page re-renders as the
/// machine changes, so an element found by one WebDriver request may be gone by the
/// next (a "stale element" failed the test so once).
async fn text_of(client: &Client, css: &str) -> String {
    let text = client
        .execute(
            "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;",
            vec![serde_json::json!(css)],
        )
        .await
        .unwrap();
    match text.as_str() {
        Some(text) => text.to_owned(),
        None => panic!("the page has no {css}"),
    }
}

/// Every cell of every table on the page, read in the page: how many there are, and
/// each one that shows nothing or a value the page failed to format (`NaN`,
/// `undefined`, `null`, `[object ...]`), named by its section and column; and any
/// such word anywhere on the page.
async fn cells_not_shown(client: &Client) -> (u64, Vec<String>) {
    let found = client
        .execute(
            r#"const bad = []; let n = 0;
            const broken = /\bNaN\b|\bundefined\b|\bnull\b|\[object /;
            for (const t of document.querySelectorAll("table")) {
              const heads = [...t.querySelectorAll("th")].map((h) => h.innerText);
              const section = t.closest("section").querySelector("h2").innerText;
              for (const tr of t.querySelectorAll("tr")) {
                [...tr.querySelectorAll("td")].forEach((td, i) => {
                  n++;
                  const text = td.innerText.trim();
                  if (text === "" || broken.test(text)) bad.push(section + " / " + heads[i] + ": '" + text + "'");
                });
              }
            }
            for (const card of document.querySelectorAll("[data-gpu]")) {
              if (broken.test(card.innerText)) bad.push("GPU card: " + card.innerText);
            }
            return [n, bad];"#,
            vec![],
        )
        .await
        .unwrap();
    let n = found[0].as_u64().unwrap();
    let bad = found[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_str().unwrap().to_owned())
        .collect();
    (n, bad)
}

#[tokio::test]
async fn the_page_shows_holders_sharers_the_queue_and_jobs_live_and_markup_as_text() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (_server, port) = serve(dir);
    let (driver, client) = browser(dir).await;
    client
        .goto(&format!("http://127.0.0.1:{port}/"))
        .await
        .unwrap();
    page_shows(&client, "[data-gpu]", false).await;
    let mut seen = Vec::new();

    // A GPU held alone, a share of another, a request waiting behind the holder.
    let holder = hold(dir, &["--gpu", "0", "--bytes", "3GiB"]);
    let css = format!("[data-gpu='0'] [data-pid='{}']", holder.0.id());
    seen.push(("holder appears", page_shows(&client, &css, true).await));
    let card = text_of(&client, "[data-gpu='0']").await;
    assert!(
        card.contains("held by") && card.contains("3.0 GiB"),
        "{card}"
    );
    // (A share through tt-lock itself, held by this test's process: `reserve --share`
    // needs the GPU's memory from NVML, which this machine may lack.)
    let shared_gpu = "GPU-00000000-0000-4000-8000-0000000000aa";
    let sharer = tt_lock::LockDir::open(dir.join("locks"))
        .unwrap()
        .lock_shared(
            &tt_lock::GpuKey::of_uuid(shared_gpu),
            tt_device::Bytes(2 << 30),
            tt_device::Bytes(80 << 30),
            tt_lock::Wait::Try,
            tt_lock::Holder::current(),
        )
        .unwrap();
    let share_css = format!(
        "[data-gpu='{shared_gpu}'] [data-pid='{}']",
        std::process::id()
    );
    seen.push(("share appears", page_shows(&client, &share_css, true).await));
    let card = text_of(&client, &format!("[data-gpu='{shared_gpu}']")).await;
    assert!(
        card.contains("shared by") && card.contains("budget 2.0 GiB"),
        "{card}"
    );
    let waiter = wait_for_gpu_0(dir);
    let css = format!("#queue tr[data-pid='{}']", waiter.0.id());
    seen.push(("waiter appears", page_shows(&client, &css, true).await));
    assert!(text_of(&client, &css).await.contains("#1"));

    // A detached job whose command line holds markup: shown as text, no element added.
    let markup = "<b>x</b><script>document.title='pwned'</script><img src=x onerror=alert(1)>";
    let job = detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--gpu",
            "2",
            "--no-fence",
            "--",
            "sh",
            "-c",
            &format!("exec sleep 600 # {markup}"),
        ],
    );
    let _stop = Stopped(dir, job.clone());
    let row = format!("tr[data-job='{job}']");
    until("the job holds GPU 2", || job_holds(dir, "2"));
    seen.push(("job appears", page_shows(&client, &row, true).await));
    let text = text_of(&client, &row).await;
    assert!(text.contains(markup), "{text}");
    for tag in ["b", "script", "img"] {
        let inside = client
            .find_all(Locator::Css(&format!("{row} {tag}")))
            .await
            .unwrap();
        assert!(
            inside.is_empty(),
            "the job's command added a <{tag}> element"
        );
    }
    let scripts = client
        .execute("return document.scripts.length", vec![])
        .await
        .unwrap();
    assert_eq!(scripts, serde_json::json!(1), "only the page's own script");
    assert_eq!(client.title().await.unwrap(), "torchtools");
    page_shows(&client, "[data-gpu='2'] [data-pid]", true).await;
    // Every column of every table shows something, formatted.
    let (cells, bad) = cells_not_shown(&client).await;
    assert!(cells >= 12, "{cells} cells");
    assert!(bad.is_empty(), "cells the page failed to show: {bad:?}");

    let png = client.screenshot().await.unwrap();
    std::fs::write(target_dir().join("serve-page.png"), png).unwrap();
    // On a phone's width the page fits: no sideways scrolling of the whole page (a
    // wide table scrolls inside its own section).
    client.set_window_size(390, 844).await.unwrap();
    let fits = client
        .execute(
            "return document.documentElement.scrollWidth <= window.innerWidth",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(
        fits,
        serde_json::json!(true),
        "the page is wider than a phone"
    );
    let png = client.screenshot().await.unwrap();
    std::fs::write(target_dir().join("serve-page-phone.png"), png).unwrap();
    client.set_window_size(1280, 1000).await.unwrap();

    // Each leaves the page when it ends: the holder (the waiter then holds GPU 0 and
    // ends), the sharer, the job (its row says it ended).
    let holder_pid = holder.0.id();
    drop(holder);
    let css = format!("[data-gpu='0'] [data-pid='{holder_pid}']");
    seen.push(("holder leaves", page_shows(&client, &css, false).await));
    let css = format!("#queue tr[data-pid='{}']", waiter.0.id());
    seen.push(("waiter leaves", page_shows(&client, &css, false).await));
    drop(sharer);
    seen.push(("share leaves", page_shows(&client, &share_css, false).await));
    ok(tt(dir)
        .args(["stop", &job, "--grace", "1s"])
        .output()
        .unwrap());
    let start = Instant::now();
    while text_of(&client, &row).await.contains("running") {
        assert!(
            start.elapsed() < PAGE_PATIENCE,
            "the job still shows running"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    seen.push(("job shows ended", start.elapsed()));
    page_shows(&client, "[data-gpu='2'] [data-pid]", false).await;
    client.close().await.unwrap();
    // No browser process outlives the test.
    drop(driver);
    let profile = format!("--user-data-dir={}", dir.join("chromium-profile").display());
    until("Chromium's processes are gone", || {
        !std::fs::read_dir("/proc").unwrap().flatten().any(|p| {
            std::fs::read(p.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&profile))
        })
    });
    for (what, took) in seen {
        eprintln!("{what}: {:.2} s after it happened", took.as_secs_f64());
    }
}

/// The README's picture: the page serving the saved state of a busy server
/// (`docs/serve-state.json`, saved with `serve --save`, with the peers a `serve
/// --peer` page read: a second server and one that does not answer), every column of
/// every table showing what the state holds, the picture written to
/// `target/serve-page-readme.png`
/// (`cargo xtask picture` copies it to `docs/serve-page.png`).
#[tokio::test]
async fn the_readmes_picture_shows_a_saved_busy_server_every_column_filled() {
    let saved = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/serve-state.json");
    let text = std::fs::read_to_string(&saved).unwrap();
    let state: serde_json::Value = serde_json::from_str(&text).unwrap();
    // What the picture is for: a busy server under a fair-share policy.
    let holders: Vec<&serde_json::Value> = state["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| !g["holder"].is_null())
        .collect();
    assert!(holders.len() >= 2, "{} GPUs held", holders.len());
    let queue = state["queue"].as_array().unwrap();
    assert!(queue.len() >= 2 && state["policy_orders"] == true);
    assert!(queue.iter().all(|w| w["priority"].is_f64()));
    let users = |rows: &serde_json::Value, field: &str| -> std::collections::BTreeSet<String> {
        rows.as_array()
            .unwrap()
            .iter()
            .map(|r| r[field].as_str().unwrap().to_owned())
            .collect()
    };
    assert!(users(&state["jobs"], "user").len() >= 2);
    assert!(users(&state["usage"]["week"], "name").len() >= 2);

    let tmp = tempfile::tempdir().unwrap();
    let (_server, port) = serve_with(tmp.path(), &["--replay", saved.to_str().unwrap()]);
    let (status, body) = request(port, "GET /metrics HTTP/1.1");
    assert!(
        status.contains(" 404 ") && body.contains("saved state"),
        "{status}: {body}"
    );
    let (driver, client) = browser(tmp.path()).await;
    client
        .goto(&format!("http://127.0.0.1:{port}/"))
        .await
        .unwrap();
    page_shows(&client, "#queue tr[data-pid]", true).await;
    let header = text_of(&client, "header").await;
    assert!(
        header.contains("recorded") && header.contains("serve-state.json"),
        "{header}"
    );
    for g in &holders {
        let key = g["key"]["uuid"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| g["key"]["index"].to_string());
        let card = text_of(&client, &format!("[data-gpu='{key}']")).await;
        let user = g["holder"]["user"].as_str().unwrap();
        assert!(card.contains("held by") && card.contains(user), "{card}");
    }
    // The queue in the state's order, each with its priority and why.
    let rows = client
        .execute(
            "return [...document.querySelectorAll('#queue tr[data-pid]')].map((r) => r.innerText)",
            vec![],
        )
        .await
        .unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), queue.len());
    for (row, w) in rows.iter().zip(queue) {
        let row = row.as_str().unwrap();
        let priority = format!("{:.2}", w["priority"].as_f64().unwrap());
        assert!(row.contains(&priority), "{row} lacks {priority}");
        assert!(row.contains(w["why"].as_str().unwrap()), "{row}");
    }
    let jobs = client
        .find_all(Locator::Css("#jobs tr[data-job]"))
        .await
        .unwrap();
    assert_eq!(jobs.len(), state["jobs"].as_array().unwrap().len());
    // A second server under its name, with its holders, queue and jobs; a third that
    // does not answer, said so with why.
    let peers = state["peers"].as_array().unwrap();
    assert!(
        peers.iter().any(|p| !p["state"].is_null()) && peers.iter().any(|p| p["state"].is_null())
    );
    for peer in peers {
        let name = peer["name"].as_str().unwrap();
        let section = text_of(&client, &format!("[data-peer='{name}']")).await;
        match peer["state"].as_object() {
            Some(st) => {
                for g in st["gpus"].as_array().unwrap() {
                    if let Some(user) = g["holder"]["user"].as_str() {
                        assert!(section.contains(user), "{name}: {section} lacks {user}");
                    }
                }
                for job in st["jobs"].as_array().unwrap() {
                    let id = job["id"].as_str().unwrap();
                    assert!(section.contains(id), "{name}: {section} lacks job {id}");
                }
            }
            None => {
                let error = peer["error"].as_str().unwrap();
                assert!(
                    section.contains("does not answer") && section.contains(error),
                    "{name}: {section}"
                );
            }
        }
    }
    for name in users(&state["usage"]["week"], "name") {
        let row = text_of(&client, &format!("tr[data-user='{name}']")).await;
        assert!(row.contains("% of recent use"), "{row}");
    }
    let (cells, bad) = cells_not_shown(&client).await;
    assert!(cells >= 40, "{cells} cells");
    assert!(bad.is_empty(), "cells the page failed to show: {bad:?}");
    // The whole page in the picture.
    let height = client
        .execute("return document.documentElement.scrollHeight", vec![])
        .await
        .unwrap();
    let height = u32::try_from(height.as_u64().unwrap()).unwrap();
    client
        .set_window_size(1280, height.clamp(600, 3000) + 140)
        .await
        .unwrap();
    let png = client.screenshot().await.unwrap();
    std::fs::write(target_dir().join("serve-page-readme.png"), png).unwrap();
    client.close().await.unwrap();
    drop(driver);
}

/// `serve --save` writes the state a page would show; `serve --replay` serves it as it
/// was, marked; a file that is not a saved state is refused before anything is served,
/// with exit status 2 and how to make one.
#[test]
fn a_saved_state_is_served_as_it_was_and_a_bad_one_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let _holder = hold(dir, &["--gpu", "1", "--bytes", "1GiB"]);
    let saved = dir.join("state.json");
    ok(tt(dir)
        .args(["serve", "--save"])
        .arg(&saved)
        .output()
        .unwrap());
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    assert_eq!(written["gpus"][0]["key"]["index"], 1, "{written}");
    let (_server, port) = serve_with(dir, &["--replay", saved.to_str().unwrap()]);
    let mut served = state(port);
    assert_eq!(served["replayed_from"], "state.json");
    served.as_object_mut().unwrap().remove("replayed_from");
    assert_eq!(served, written);
    // Refused, each with its reason, before listening.
    std::fs::write(dir.join("old.json"), r#"{"schema": 0, "time_unix": 1}"#).unwrap();
    std::fs::write(dir.join("text.json"), "GPU 0: busy").unwrap();
    for (file, says) in [
        ("missing.json", "No such file"),
        ("old.json", "schema 0"),
        ("text.json", "not a saved state"),
    ] {
        let out = tt(dir)
            .args(["serve", "--listen", "127.0.0.1:0", "--replay"])
            .arg(dir.join(file))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{file}: {err}");
        assert!(err.contains(says) && err.contains("serve --save"), "{err}");
    }
    let out = tt(dir)
        .args(["serve", "--save"])
        .arg(dir.join("no-such-dir/state.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
}

#[test]
fn api_state_holds_what_the_commands_json_views_hold() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let _holder = hold(dir, &["--gpu", "0", "--bytes", "1GiB"]);
    let _waiter = wait_for_gpu_0(dir);
    until("the waiter queues", || {
        ok(tt(dir).args(["queue", "--json"]).output().unwrap()).contains("\"pid\"")
    });
    let job = detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--gpu",
            "1",
            "--no-fence",
            "--on-end",
            "echo hook-s3cret",
            "--",
            "sleep",
            "600",
        ],
    );
    let _stop = Stopped(dir, job.clone());
    until("the job holds GPU 1", || job_holds(dir, "1"));
    let (_server, port) = serve(dir);
    let json = |args: &[&str]| -> serde_json::Value {
        serde_json::from_str(&ok(tt(dir).args(args).output().unwrap())).unwrap()
    };
    // Read until both sides agree (the server reads every 0.5 s), then compare.
    let holders = |gpus: &serde_json::Value| -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = gpus
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|g| {
                let h = g.get("holder")?.as_object()?;
                Some((h["gpu"].as_str()?.to_owned(), h["pid"].as_u64()?))
            })
            .collect();
        v.sort();
        v
    };
    let pids = |queue: &serde_json::Value| -> Vec<u64> {
        queue
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["pid"].as_u64().unwrap())
            .collect()
    };
    let jobs = |rows: &serde_json::Value| -> Vec<(String, String)> {
        rows.as_array()
            .unwrap()
            .iter()
            .map(|j| {
                (
                    j["id"].as_str().unwrap().to_owned(),
                    j["state"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    };
    let locks = json(&["locks", "--json"]);
    let queue = json(&["queue", "--json"]);
    let all_jobs = json(&["jobs", "--all", "--json"]);
    let locks_holders = holders(&locks["locks"]);
    assert_eq!(locks_holders.len(), 2, "{locks}");
    // The server reads every 0.5 s: its copy may be older than the views' for a moment.
    let start = Instant::now();
    let mut served = state(port);
    while (
        holders(&served["gpus"]),
        pids(&served["queue"]),
        jobs(&served["jobs"]),
    ) != (
        locks_holders.clone(),
        pids(&queue["waiters"]),
        jobs(&all_jobs),
    ) && start.elapsed() < PAGE_PATIENCE
    {
        std::thread::sleep(Duration::from_millis(100));
        served = state(port);
    }
    assert_eq!(served["schema"], 1);
    assert_eq!(holders(&served["gpus"]), locks_holders);
    assert_eq!(pids(&served["queue"]), pids(&queue["waiters"]));
    assert_eq!(jobs(&served["jobs"]), jobs(&all_jobs));
    assert!(jobs(&served["jobs"]).contains(&(job, "running".to_owned())));
    // A job's hook command is nowhere in the page's data.
    assert!(!served.to_string().contains("hook-s3cret"), "{served}");

    // A client that sends half a request and waits holds nobody else.
    let mut slow = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(slow, "GET /api/state HTTP/1.1\r\nHost: 127.").unwrap();
    let (status, _) = request(port, "GET /api/state HTTP/1.1");
    assert!(status.contains(" 200 "), "{status}");
    drop(slow);
    // A request head past 16 KiB is refused, not read into memory; the server goes on.
    crate::common::refuses_a_64_kib_head(port, "/");
    assert!(request(port, "GET / HTTP/1.1").0.contains(" 200 "));

    // Read-only and bounded: anything but a GET is refused before any work.
    let (status, _) = request(port, "POST /api/state HTTP/1.1\r\nContent-Length: 0");
    assert!(status.contains(" 405 "), "{status}");
    let long = format!("GET /{} HTTP/1.1", "a".repeat(4096));
    assert!(request(port, &long).0.contains(" 414 "));
    let (status, page) = request(port, "GET / HTTP/1.1");
    assert!(
        status.contains(" 200 ") && page.contains("/api/state"),
        "{status}"
    );
    let (status, metrics) = request(port, "GET /metrics HTTP/1.1");
    assert!(
        status.contains(" 200 ") && metrics.contains("torchtools_gpu_locked"),
        "{status}"
    );
}

/// Whatever the live records hold (here 600 sharers of one GPU, each with a command
/// line of 60 KB: 36 MB of records), `/api/state` stays within its bound (each command
/// cut, the list cut and said), the page is served, and `top --json` still reads the
/// machine.
/// `n` live share records of GPU 0 saying `holder` (GPU 0's lock file made first), each
/// locked for writing by this process as a live record is: one process shares a GPU
/// once through the API, so the records are made by hand. Live while the files are.
fn live_shares(dir: &Path, holder: &tt_lock::Holder, n: usize) -> Vec<std::fs::File> {
    let locks = tt_lock::LockDir::open(dir.join("locks")).unwrap();
    drop(
        locks
            .lock(
                &tt_lock::GpuKey::Index(0),
                tt_lock::Wait::Try,
                tt_lock::Holder::current(),
            )
            .unwrap(),
    );
    let record = serde_json::to_string(holder).unwrap() + "\n";
    (0..n)
        .map(|i| {
            let path = dir.join(format!("locks/share-gpu-0.{i}.json"));
            std::fs::write(&path, &record).unwrap();
            locked_for_writing(&path)
        })
        .collect()
}

/// `path` opened and locked for writing, as a live record is (an open-file-description
/// write lock), while the file returned is open.
fn locked_for_writing(path: &Path) -> std::fs::File {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    // SAFETY: an all-zero flock is valid (the whole file from offset 0).
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = libc::F_WRLCK as libc::c_short;
    // SAFETY: the fd is open and `lock` lives for the call.
    let rc = unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&file),
            libc::F_OFD_SETLK,
            &lock,
        )
    };
    assert_eq!(rc, 0);
    file
}

#[test]
fn the_state_stays_bounded_whatever_the_records_hold() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut holder = tt_lock::Holder::current().running(["x".repeat(60_000)]);
    holder.share = Some(tt_device::Bytes(1));
    let shares = live_shares(dir, &holder, 600);
    let (_server, port) = serve(dir);
    let (status, body) = request(port, "GET /api/state HTTP/1.1");
    assert!(status.contains(" 200 "), "{status}");
    assert!(body.len() <= 4 << 20, "{} bytes", body.len());
    let state: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        state["truncated"].to_string().contains("of 600 shown"),
        "{}",
        state["truncated"]
    );
    let shown = &state["gpus"][0]["shares"][0]["command"][0];
    assert!(
        shown
            .as_str()
            .is_some_and(|c| c.len() < 60_000 && c.ends_with('…')),
        "{}",
        shown.to_string().len()
    );
    let (status, page) = request(port, "GET / HTTP/1.1");
    assert!(
        status.contains(" 200 ") && page.contains("/api/state"),
        "{status}"
    );
    let top = ok(tt(dir).args(["top", "--json"]).output().unwrap());
    let top: serde_json::Value = serde_json::from_str(&top).unwrap();
    assert_eq!(top["gpus"][0]["shares"].as_array().map(Vec::len), Some(600));
    drop(shares);
}

/// The page in Chromium while a user's own records hold the most hostile values they
/// can write (600 live records of 60 KB command lines, the largest numbers, markup and
/// terminal escapes in every text, usage times at the ends of the float range): every
/// table shows every cell formatted, nothing is added to the page, the state's cut is
/// said, and the page goes on following the machine.
#[tokio::test]
async fn the_page_stays_live_in_a_browser_while_records_hold_hostile_values() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let markup = "<img src=x onerror=\"document.title='pwned'\">\u{1b}[2J";
    let mut holder =
        tt_lock::Holder::current().running([format!("{markup}{}", "x".repeat(60_000))]);
    holder.share = Some(tt_device::Bytes(u64::MAX));
    holder.who.since_unix = u64::MAX;
    holder.who.reserved = Some(tt_device::Bytes(u64::MAX));
    holder.who.host = markup.repeat(20);
    holder.who.slurm_job = Some(markup.to_owned());
    holder.who.policy = Some(markup.to_owned());
    let mut shares = live_shares(dir, &holder, 600);
    // And one no reader can read (past 64 KiB): said, not shown.
    holder.who.host = markup.repeat(200);
    let unreadable = dir.join("locks/share-gpu-0.unreadable.json");
    std::fs::write(&unreadable, serde_json::to_string(&holder).unwrap()).unwrap();
    shares.push(locked_for_writing(&unreadable));
    // SAFETY: geteuid(2) cannot fail.
    let uid = unsafe { libc::geteuid() };
    let me = tt_lock::Holder::current().who.user;
    let usage: String = [(-1e308, 1e308), (1e308, -1e308), (f64::MIN_POSITIVE, 0.0)]
        .iter()
        .enumerate()
        .map(|(i, (start, end))| {
            format!(
                "{{\"event\":\"start\",\"id\":\"u{i}\",\"user\":\"{me}\",\"host\":\"h\",\
                 \"pid\":1,\"gpu\":\"index 0\",\"bytes\":18446744073709551615,\"time\":{start:e},\
                 \"command\":[]}}\n{{\"event\":\"end\",\"id\":\"u{i}\",\"time\":{end:e},\"status\":0}}\n"
            )
        })
        .collect();
    std::fs::write(dir.join(format!("locks/usage-{uid}.jsonl")), usage).unwrap();
    let (_server, port) = serve(dir);
    let (driver, client) = browser(dir).await;
    client
        .goto(&format!("http://127.0.0.1:{port}/"))
        .await
        .unwrap();
    page_shows(&client, "[data-gpu='0']", true).await;
    let whole = text_of(&client, "body").await;
    assert!(
        whole.contains("of 600 shown") && whole.contains("a live record that cannot be read"),
        "the cut or the unreadable record is not said: {}",
        &whole[..whole.len().min(3000)]
    );
    let (cells, bad) = cells_not_shown(&client).await;
    assert!(cells >= 4, "{cells} cells");
    assert!(bad.is_empty(), "cells the page failed to show: {bad:?}");
    let added = client
        .execute(
            "return document.querySelectorAll('img').length + document.scripts.length",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(
        added,
        serde_json::json!(1),
        "only the page's own script, no image"
    );
    assert_eq!(client.title().await.unwrap(), "torchtools");
    // Still following the machine: a holder of GPU 1 appears, and leaves.
    let held = hold(dir, &["--gpu", "1"]);
    let css = format!("[data-gpu='1'] [data-pid='{}']", held.0.id());
    page_shows(&client, &css, true).await;
    drop(held);
    page_shows(&client, &css, false).await;
    client.close().await.unwrap();
    drop(driver);
    drop(shares);
}

/// `serve` in a UTS namespace of its own named `host`, on a port of its choosing: a
/// second server, under its own name, on this machine.
fn serve_as_host(dir: &Path, host: &str) -> (Killed, u16) {
    let tt = tt(dir);
    let mut command = Command::new("unshare");
    command
        .args([
            "--uts",
            "sh",
            "-c",
            "hostname \"$1\" && exec \"$0\" serve --listen 127.0.0.1:0",
        ])
        .arg(tt.get_program())
        .arg(host);
    for (key, value) in tt.get_envs() {
        match value {
            Some(v) => command.env(key, v),
            None => command.env_remove(key),
        };
    }
    assert!(
        Command::new("unshare")
            .args(["--uts", "true"])
            .status()
            .is_ok_and(|s| s.success()),
        "a second server under its own name needs `unshare --uts` (root): run the tests as \
         root, as `cargo xtask test` does in CI"
    );
    serving(command)
}

#[tokio::test]
async fn one_page_shows_every_peer_under_its_name_and_one_that_does_not_answer() {
    let tmp = tempfile::tempdir().unwrap();
    let (here, there) = (tmp.path().join("here"), tmp.path().join("there"));
    // A peer that is not a server's URL, or a file of peers that is not there: refused
    // before anything is served.
    for (args, says) in [
        (&["--peer", "gpu2:9836"][..], "not an http:// URL"),
        (
            &["--peer", "http://gpu2:9836/api/state"][..],
            "without a path",
        ),
        (
            &["--peers", "/nonexistent/peers"][..],
            "--peers /nonexistent/peers",
        ),
    ] {
        let out = tt(&here).arg("serve").args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // The other server, "peer-b", with GPU 0 held; a port nobody listens on; a server
    // that takes the connection and never answers.
    let holder = hold(&there, &["--gpu", "0"]);
    let (peer, peer_port) = serve_as_host(&there, "peer-b");
    let dead = crate::common::free_port();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let held: Vec<_> = silent.incoming().collect();
        drop(held);
    });
    let url = |port: u16| format!("http://127.0.0.1:{port}");
    let (peer_url, dead_url, silent_url) = (url(peer_port), url(dead), url(silent_port));
    let (_server, port) = serve_with(
        &here,
        &[
            "--peer",
            &peer_url,
            "--peer",
            &dead_url,
            "--peer",
            &silent_url,
        ],
    );
    // /api/state: each peer under its name, the others with why they do not answer.
    until("every peer read", || {
        let peers = state(port)["peers"].as_array().cloned().unwrap_or_default();
        peers.len() == 3 && peers.iter().all(|p| p["error"] != "not read yet")
    });
    let peers = state(port)["peers"].clone();
    assert_eq!(peers[0]["name"], "peer-b", "{peers}");
    assert_eq!(peers[0]["url"], peer_url.as_str());
    let gpu = &peers[0]["state"]["gpus"][0];
    assert_eq!(gpu["holder"]["pid"], holder.0.id(), "{peers}");
    assert!(peers[0]["state"].get("peers").is_none());
    assert!(peers[1]["state"].is_null(), "{peers}");
    assert!(
        peers[1]["error"]
            .as_str()
            .unwrap()
            .contains("cannot connect"),
        "{peers}"
    );
    assert!(
        peers[2]["error"]
            .as_str()
            .unwrap()
            .contains("no whole answer"),
        "{peers}"
    );
    // The page: this server's GPUs section, the peer's held GPU under its name, the
    // two that do not answer said so; when the peer stops, it is said too.
    let (_driver, client) = browser(&here).await;
    client.goto(&format!("{}/", url(port))).await.unwrap();
    let css = format!(
        "[data-peer='peer-b'] [data-gpu='0'] [data-pid='{}']",
        holder.0.id()
    );
    page_shows(&client, &css, true).await;
    page_shows(&client, "#gpus", true).await;
    page_shows(&client, "[data-down='127.0.0.1']", true).await;
    let down = client
        .find_all(Locator::Css("[data-down]"))
        .await
        .unwrap()
        .len();
    assert_eq!(down, 2, "the port nobody listens on and the silent server");
    // The peer's queue as a table of its own, every cell shown.
    let waiter = wait_for_gpu_0(&there);
    let css = format!("[data-peer='peer-b'] tr[data-pid='{}']", waiter.0.id());
    page_shows(&client, &css, true).await;
    let (cells, bad) = cells_not_shown(&client).await;
    assert!(cells > 0 && bad.is_empty(), "{cells} cells: {bad:?}");
    drop(peer);
    page_shows(&client, "[data-down='peer-b']", true).await;
    let said = text_of(&client, "[data-down='peer-b']").await;
    assert!(
        said.contains("does not answer") && said.contains("last answered"),
        "{said}"
    );
    client.close().await.unwrap();
}

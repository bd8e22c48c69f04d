//! `torchtools serve`: the whole server on one page. The page at `/`, the machine's
//! state as JSON at `/api/state` (the data the page draws), and `/metrics` (as
//! `metrics --listen`), from one process a user or root starts; no daemon beside it.
//!
//! One thread reads the state every half second (the same readers as `top --json`,
//! `jobs --all --json` and `usage --json`; the usage log every 30 s) and keeps it as
//! JSON, with each GPU's memory over the last hour; requests are answered from that
//! copy by hyper's HTTP/1 server, each connection on its own task (a slow client never
//! holds another), its head bounded in size and time. Read-only: no request changes
//! anything.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;
use tt_lock::LockDir;

use crate::commands::usage::{By, Row};
use crate::http::{response, text, Get, Response};
use crate::snapshot::{Gpus, Snapshot};

/// Serve a live web page of the whole machine.
///
/// The whole server on one page, in a browser: every GPU's memory, holder or
/// sharers, the queue in serving order and why, jobs, each user's use over the
/// last day and week, each GPU's memory over the last hour; live, read-only.
///
/// Serves the page at http://ADDR/, its data as JSON at /api/state, and /metrics
/// (as `metrics --listen`), until stopped. What it shows is what `locks`, `queue`,
/// `jobs --all` and `usage` show every user of the machine.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Where to listen (0.0.0.0:PORT for every interface; what the page shows is what
    /// `locks`, `queue`, `jobs --all` and `usage` show every user of the machine).
    #[arg(long, value_name = "ADDR", default_value = DEFAULT_LISTEN)]
    pub(crate) listen: SocketAddr,
    /// Another name browsers reach this server by (repeatable): requests are answered
    /// only for its addresses, localhost, this machine's name and these.
    #[arg(long = "host", value_name = "NAME")]
    pub(crate) hosts: Vec<String>,
    /// Write the state the page would show to FILE (`-`: standard output) and exit: the
    /// machine as it is now, to look at later or to attach to a bug report (a running
    /// server's `/api/state` is the same, with each GPU's last hour).
    #[arg(long, value_name = "FILE", conflicts_with = "replay")]
    pub(crate) save: Option<PathBuf>,
    /// Serve a saved state (from `--save` or `/api/state`) instead of this machine's:
    /// the page shows it as recorded, saying so; `/metrics` is not served.
    #[arg(long, value_name = "FILE")]
    pub(crate) replay: Option<PathBuf>,
    /// Another server to show on this page (repeatable): its URL, http://HOST:PORT.
    /// Each server's GPUs, queue and jobs are shown under its name, and one that does
    /// not answer is shown as such.
    #[arg(long = "peer", value_name = "URL", value_parser = crate::peers::parse, conflicts_with_all = ["save", "replay"])]
    pub(crate) peers: Vec<crate::peers::Peer>,
    /// A file of peers: one URL per line (blank lines and `#` comments skipped).
    #[arg(long = "peers", value_name = "FILE", conflicts_with_all = ["save", "replay"])]
    pub(crate) peers_file: Option<PathBuf>,
}

/// `torchtools serve`.
pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let peers = crate::peers::all(&args.peers, args.peers_file.as_deref()).map_err(bad)?;
    // A saved state, checked before listening; else this machine's, read again and again.
    let (first, reader) = match &args.replay {
        Some(path) => {
            let json = replayed(path)?;
            (
                Read {
                    json,
                    metrics: None,
                },
                None,
            )
        }
        None => {
            let dir = LockDir::from_env()?;
            if let Some(path) = &args.save {
                return save(path, dir);
            }
            // NVML opened once, for the state's reader and `/metrics` both.
            let mut reader = Reader::new(dir, Arc::new(Gpus::open()));
            if !peers.is_empty() {
                let expect = crate::peers::Expect {
                    schema: SCHEMA,
                    max_bytes: MAX_STATE,
                };
                reader.peers = Some(crate::peers::watch(peers, expect)?);
            }
            (reader.read_all(), Some(reader))
        }
    };
    let listener = crate::http::bind(args.listen)?;
    let bound = listener.local_addr()?;
    let shared = Arc::new(Shared {
        latest: RwLock::new(Arc::new(first)),
    });
    if let Some(mut reader) = reader {
        let shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("state".into())
            .spawn(move || loop {
                std::thread::sleep(STATE_EVERY);
                let latest = Arc::new(reader.read_all());
                *shared.latest.write().unwrap_or_else(|e| e.into_inner()) = latest;
            })?;
    }
    match &args.replay {
        Some(path) => eprintln!(
            "torchtools: serving the state saved in {} at http://{bound}/",
            path.display()
        ),
        None => eprintln!(
            "torchtools: serving the page at http://{bound}/ (its data at /api/state, /metrics)"
        ),
    }
    let names = crate::http::Names::of(bound, &args.hosts);
    crate::http::run(listener, "torchtools serve", names, move |get| {
        answer(get, Arc::clone(&shared))
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The page: HTML, CSS and JavaScript in one file, embedded (no external asset).
const PAGE: &str = include_str!("serve.html");
/// The default address: loopback only (`--listen 0.0.0.0:9836` for every interface).
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:9836";
/// How often the state is read.
const STATE_EVERY: Duration = Duration::from_millis(500);
/// How often the usage log is read (it can be long).
const USAGE_EVERY: Duration = Duration::from_secs(30);

/// The longest window the page shows use over.
const WEEK: Duration = Duration::from_secs(7 * 86_400);
/// How often a point is added to each GPU's memory chart, and how long it reaches back.
const HISTORY_EVERY: Duration = Duration::from_secs(10);
const HISTORY_SPAN: Duration = Duration::from_secs(3600);
/// The version of `/api/state`'s schema (README: "The page and its API").
pub(crate) const SCHEMA: u32 = 1;

/// `/api/state`: everything the page shows.
#[derive(Serialize)]
pub(crate) struct State {
    /// [`SCHEMA`].
    pub(crate) schema: u32,
    /// This machine's name.
    pub(crate) host: String,
    /// The user serving the page (the page puts their jobs first unless `?user=`).
    pub(crate) served_by: String,
    /// `top --json`'s snapshot: GPUs with holders, sharers and processes, the queue in
    /// serving order, the policy, each user's standing, ignored records.
    #[serde(flatten)]
    pub(crate) snapshot: Snapshot,
    /// Every user's jobs (`jobs --all --json`'s rows), oldest first.
    pub(crate) jobs: Vec<crate::jobs::store::Row>,
    /// Job records not believed, and those that cannot be read.
    pub(crate) jobs_ignored: Vec<tt_lock::Ignored>,
    pub(crate) jobs_damaged: Vec<String>,
    /// Each user's use over the last day and week (`usage --since 1d/7d --json`'s rows).
    pub(crate) usage: UsageView,
    /// Each GPU's memory over the last hour, oldest first.
    pub(crate) history: Vec<History>,
    /// The other servers this page shows (`--peer`), each as it last answered.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) peers: Vec<crate::peers::PeerView>,
}

impl State {
    /// `/api/state`'s JSON: at most [`MAX_STATE`] bytes ([`bounded_json`]).
    fn json(&self) -> Result<String> {
        Ok(bounded_json(serde_json::to_value(self)?))
    }
}

/// Each user's use, as `usage --by user` counts it.
#[derive(Serialize, Clone, Default)]
pub(crate) struct UsageView {
    pub(crate) day: Vec<Row>,
    pub(crate) week: Vec<Row>,
    /// Damaged usage lines skipped.
    pub(crate) skipped: usize,
    /// When the log was read, in seconds since the Unix epoch.
    pub(crate) read_unix: f64,
}

/// One GPU's memory over time.
#[derive(Serialize, Clone)]
pub(crate) struct History {
    /// The GPU, keyed as in `gpus` (`{"uuid": ...}`, or `{"index": N}` without NVML).
    pub(crate) gpu: tt_lock::GpuKey,
    /// `[time_unix, used_bytes, total_bytes]`, oldest first.
    pub(crate) points: VecDeque<[u64; 3]>,
}

/// What every request reads: the state's latest JSON, and the metrics rendered from
/// the same state (a scrape reads nothing afresh).
struct Shared {
    latest: RwLock<Arc<Read>>,
}

/// One reading of the state: its JSON and its metrics (OpenMetrics text, or why they
/// could not be rendered; `None` for a saved state, which has none).
pub(crate) struct Read {
    pub(crate) json: String,
    pub(crate) metrics: Option<std::result::Result<String, String>>,
}

/// How to make a file `--replay` serves, for its errors.
const HOW_TO_SAVE: &str = "save one with `torchtools serve --save FILE`, or from a running \
                           server with `curl -s http://127.0.0.1:9836/api/state > FILE`";

/// A bad `--save` or `--replay` file: exit status 2, as for any bad argument.
fn bad(message: String) -> anyhow::Error {
    crate::exit::Exit::usage(message).into()
}

/// `--save PATH`: the state read once, written whole (to a file beside `PATH`, renamed
/// over it: an interrupted save leaves any earlier file as it was).
fn save(path: &Path, dir: LockDir) -> Result<ExitCode> {
    use std::io::Write;
    let stdout = path == Path::new("-");
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    if !stdout && !parent.is_dir() {
        return Err(bad(format!(
            "--save {}: the directory {} does not exist (create it, or name a file in an \
             existing directory; `-` writes to standard output)",
            path.display(),
            parent.display()
        )));
    }
    let mut json = Reader::new(dir, Arc::new(Gpus::open())).state()?.json()?;
    json.push('\n');
    if stdout {
        std::io::stdout().lock().write_all(json.as_bytes())?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut file = tempfile::NamedTempFile::new_in(&parent).map_err(|e| {
        bad(format!(
            "--save {}: cannot write in {}: {e}",
            path.display(),
            parent.display()
        ))
    })?;
    file.write_all(json.as_bytes())?;
    file.persist(path)
        .map_err(|e| bad(format!("--save {}: {}", path.display(), e.error)))?;
    eprintln!(
        "torchtools: saved the state in {} (serve it with `torchtools serve --replay {}`)",
        path.display(),
        path.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// The saved state at `path`, checked (JSON of this schema, at most [`MAX_STATE`]
/// bytes), marked as replayed for the page.
fn replayed(path: &Path) -> Result<String> {
    use std::io::Read as _;
    let file = std::fs::File::open(path)
        .map_err(|e| bad(format!("--replay {}: {e} ({HOW_TO_SAVE})", path.display())))?;
    let mut text = Vec::new();
    file.take(MAX_STATE as u64 + 1).read_to_end(&mut text)?;
    if text.len() > MAX_STATE {
        return Err(bad(format!(
            "--replay {}: larger than a saved state can be ({} MiB; {HOW_TO_SAVE})",
            path.display(),
            MAX_STATE >> 20
        )));
    }
    let mut state: serde_json::Value = serde_json::from_slice(&text).map_err(|e| {
        bad(format!(
            "--replay {}: not a saved state: {e} ({HOW_TO_SAVE})",
            path.display()
        ))
    })?;
    let schema = state.get("schema").and_then(serde_json::Value::as_u64);
    if schema != Some(u64::from(SCHEMA)) || state.get("time_unix").is_none() {
        return Err(bad(format!(
            "--replay {}: not a saved state of this version (schema {}, this torchtools reads \
             schema {SCHEMA}; {HOW_TO_SAVE})",
            path.display(),
            schema.map_or("missing".to_owned(), |s| s.to_string())
        )));
    }
    if let Some(map) = state.as_object_mut() {
        let name = path.file_name().unwrap_or(path.as_os_str());
        map.insert("replayed_from".into(), name.to_string_lossy().into());
    }
    Ok(state.to_string())
}

/// One request (checked by the server: `GET` or `HEAD`, no body, a short target): `/`,
/// `/api/state` or `/metrics`.
async fn answer(get: Get, shared: Arc<Shared>) -> Response {
    match get.path.as_str() {
        "/" | "/index.html" => response(200, "text/html; charset=utf-8", PAGE),
        "/api/state" => {
            let latest = Arc::clone(&shared.latest.read().unwrap_or_else(|e| e.into_inner()));
            response(200, "application/json", latest.json.as_bytes().to_vec())
        }
        "/metrics" => {
            let latest = Arc::clone(&shared.latest.read().unwrap_or_else(|e| e.into_inner()));
            match &latest.metrics {
                None => text(
                    404,
                    "torchtools serve",
                    "this page serves a saved state (--replay): it has no metrics",
                ),
                Some(Ok(text)) => {
                    let (kind, body) =
                        crate::commands::metrics::negotiate(text.clone(), get.accept.as_deref());
                    response(200, kind, body)
                }
                Some(Err(why)) => text(500, "torchtools serve", why),
            }
        }
        _ => text(
            404,
            "torchtools serve",
            "the page is at /, its data at /api/state, metrics at /metrics",
        ),
    }
}

/// The most bytes of `/api/state`: whatever the records hold (a record is at most 64
/// KiB, but a user may keep thousands live), the page's data stays this small.
pub(crate) const MAX_STATE: usize = 4 << 20;
/// The longest text of the state shown whole (a command line, a user or host name).
const MAX_TEXT: usize = 4096;
/// The most items of a list shown before the state is found too large (the hour of a
/// GPU's memory is 361 points).
const MAX_ITEMS: usize = 512;

/// `state` as JSON of at most [`MAX_STATE`] bytes: texts past [`MAX_TEXT`] bytes are
/// cut (ending `…`), lists past a bound keep their first items (halved until the whole
/// fits), and `truncated` says what was left out, for the page to say.
pub(crate) fn bounded_json(state: serde_json::Value) -> String {
    let mut items = MAX_ITEMS;
    loop {
        let mut value = state.clone();
        let mut cut = Vec::new();
        bound(&mut value, items, "", &mut cut);
        if !cut.is_empty() {
            if let Some(map) = value.as_object_mut() {
                cut.truncate(64);
                map.insert("truncated".into(), cut.into());
            }
        }
        let json = value.to_string();
        if json.len() <= MAX_STATE || items <= 1 {
            return json;
        }
        items /= 2;
    }
}

/// Cuts the texts and lists of `value` (at `path`) to their bounds, saying each list cut.
fn bound(value: &mut serde_json::Value, items: usize, path: &str, cut: &mut Vec<String>) {
    use serde_json::Value;
    match value {
        Value::String(text) if text.len() > MAX_TEXT => {
            let mut end = MAX_TEXT;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            text.push('…');
        }
        Value::Array(list) => {
            if list.len() > items {
                cut.push(format!("{path}: {items} of {} shown", list.len()));
                list.truncate(items);
            }
            for v in list {
                bound(v, items, path, cut);
            }
        }
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                bound(v, items, &format!("{path}/{key}"), cut);
            }
        }
        _ => {}
    }
}

/// Reads the state: the snapshot and jobs each time, the usage log every 30 s, a
/// history point per GPU every 10 s.
pub(crate) struct Reader {
    dir: LockDir,
    gpus: Arc<Gpus>,
    me: tt_lock::Holder,
    usage: UsageView,
    /// Each user's use over all the records, and the usage records not believed, from
    /// the same reading as `usage` (for the metrics).
    per_user: Vec<Row>,
    usage_ignored: Vec<tt_lock::Ignored>,
    usage_read: Option<Instant>,
    /// The usage logs as read so far: each reading reads what was appended since.
    usage_watch: tt_lock::UsageWatch,
    history: Vec<History>,
    history_added: Option<Instant>,
    /// The other servers shown (`--peer`), read on threads of their own.
    peers: Option<crate::peers::Views>,
}

impl Reader {
    pub(crate) fn new(dir: LockDir, gpus: Arc<Gpus>) -> Reader {
        Reader {
            dir,
            gpus,
            me: tt_lock::Holder::current(),
            usage: UsageView::default(),
            per_user: Vec::new(),
            usage_ignored: Vec::new(),
            usage_read: None,
            usage_watch: tt_lock::UsageWatch::new(WEEK),
            history: Vec::new(),
            history_added: None,
            peers: None,
        }
    }

    /// The state as JSON; a failure to read it is `{"schema", "error"}` (the page says it).
    #[cfg(test)]
    pub(crate) fn read(&mut self) -> String {
        self.read_all().json
    }

    /// The state as JSON (a failure to read it is `{"schema", "error"}`, which the page
    /// says) and its metrics, rendered from it.
    pub(crate) fn read_all(&mut self) -> Read {
        let state = self.state();
        let metrics = match &state {
            Ok(state) => {
                let jobs: Vec<_> = state
                    .jobs
                    .iter()
                    .filter_map(crate::jobs::store::LiveJob::of)
                    .collect();
                crate::commands::metrics::render_from(
                    &state.snapshot,
                    &self.per_user,
                    &self.usage_ignored,
                    &jobs,
                )
                .map_err(|e| format!("{e:#}"))
            }
            Err(e) => Err(format!("{e:#}")),
        };
        let json = state.and_then(|state| state.json()).unwrap_or_else(|e| {
            serde_json::json!({"schema": SCHEMA, "error": format!("{e:#}")}).to_string()
        });
        Read {
            json,
            metrics: Some(metrics),
        }
    }

    pub(crate) fn state(&mut self) -> Result<State> {
        let snapshot = Snapshot::take(&self.dir, &self.gpus)?;
        let (jobs, scan) = snapshot.job_rows()?;
        if self.usage_read.is_none_or(|t| t.elapsed() >= USAGE_EVERY) {
            self.read_usage()?;
            self.usage_read = Some(Instant::now());
        }
        if self
            .history_added
            .is_none_or(|t| t.elapsed() >= HISTORY_EVERY)
        {
            self.add_history(&snapshot);
            self.history_added = Some(Instant::now());
        }
        Ok(State {
            schema: SCHEMA,
            host: self.me.who.host.clone(),
            served_by: self.me.who.user.clone(),
            jobs,
            jobs_ignored: scan.ignored,
            jobs_damaged: scan.damaged,
            usage: self.usage.clone(),
            history: self.history.clone(),
            peers: self
                .peers
                .as_ref()
                .map(|p| p.lock().unwrap_or_else(|e| e.into_inner()).clone())
                .unwrap_or_default(),
            snapshot,
        })
    }

    /// Reads the usage logs: each user's use over the last day and week (the page), and
    /// over all the records (the metrics).
    fn read_usage(&mut self) -> Result<()> {
        let now = tt_device::now_unix();
        // All time first (the metrics' counters), then the page's day and week: read on
        // from the last reading.
        let log = self
            .usage_watch
            .read(&self.dir, &[Duration::from_secs(86_400), WEEK])?;
        let window = |i: usize| {
            log.windows
                .get(i)
                .map_or_else(Vec::new, |t| crate::commands::usage::rows(t, By::User))
        };
        self.usage = UsageView {
            day: window(1),
            week: window(2),
            skipped: log.skipped.len(),
            read_unix: now,
        };
        self.per_user = crate::commands::metrics::per_user_use(&log);
        self.usage_ignored = log.ignored;
        Ok(())
    }

    fn add_history(&mut self, snapshot: &Snapshot) {
        let now = snapshot.time_unix;
        for g in &snapshot.gpus {
            let (Some(used), Some(total)) = (g.used, g.total) else {
                continue;
            };
            let at = match self.history.iter().position(|h| h.gpu == g.key) {
                Some(at) => at,
                None => {
                    self.history.push(History {
                        gpu: g.key.clone(),
                        points: VecDeque::new(),
                    });
                    self.history.len() - 1
                }
            };
            let points = &mut self.history[at].points;
            points.push_back([now, used.0, total.0]);
            while points
                .front()
                .is_some_and(|p| p[0] + HISTORY_SPAN.as_secs() < now)
            {
                points.pop_front();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a panic is how a test reports
    use super::*;
    use tt_device::{Bytes, GpuInfo, Inventory, NvmlStatus};

    /// A GPU from an injected driver answer (this machine may have none): 20 of 80 GiB
    /// used.
    fn one_gpu() -> Gpus {
        Gpus::with_backend(Box::new(Inventory {
            nvml: NvmlStatus::Available {
                driver_version: "test".into(),
            },
            gpus: vec![GpuInfo {
                nvml_index: 0,
                uuid: "GPU-00000000-1111-2222-3333-444444444444".into(),
                name: "Test GPU".into(),
                total: Bytes::gib(80),
                free: Bytes::gib(60),
                used: Bytes::gib(20),
                utilization: Some(50),
                processes: Vec::new(),
                mig: Vec::new(),
            }],
            errors: Vec::new(),
        }))
    }

    #[test]
    fn each_gpus_memory_is_kept_for_an_hour_one_point_every_ten_seconds() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let mut reader = Reader::new(dir.clone(), Arc::new(one_gpu()));
        let state = reader.state().unwrap();
        assert_eq!(state.history.len(), 1);
        assert_eq!(state.history[0].gpu, state.snapshot.gpus[0].key);
        let first = state.history[0].points[0];
        assert_eq!(&first[1..], &[Bytes::gib(20).0, Bytes::gib(80).0]);
        // Read again at once: no second point before ten seconds.
        assert_eq!(reader.state().unwrap().history[0].points.len(), 1);
        // 400 points ten seconds apart: the last hour's are kept, the older dropped.
        let mut snapshot = Snapshot::take(&dir, &reader.gpus).unwrap();
        let base = snapshot.time_unix + 10;
        for step in 0..400 {
            snapshot.time_unix = base + step * 10;
            reader.add_history(&snapshot);
        }
        let points = &reader.history[0].points;
        assert_eq!(points.len(), 361);
        assert_eq!(points.front().unwrap()[0], base + 39 * 10);
        assert_eq!(points.back().unwrap()[0], base + 399 * 10);
        // The JSON the page reads: the same key object as the GPU's.
        let json: serde_json::Value = serde_json::from_str(&reader.read()).unwrap();
        assert_eq!(json["history"][0]["gpu"], json["gpus"][0]["key"]);
        assert_eq!(json["schema"], SCHEMA);
    }

    /// `metrics --listen` and `--textfile` render every scrape with one watch of the
    /// usage logs: a later scrape reads what was appended, and counts it.
    #[test]
    fn a_later_scrape_reads_on_and_counts_what_was_appended() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let gpus = one_gpu();
        let uid = tt_lock::euid();
        let me = tt_lock::Holder::current().who.user;
        let seconds = |text: &str| -> f64 {
            let series = format!("torchtools_user_gpu_seconds_total{{user=\"{me}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(series.as_str()))
                .map_or(0.0, |v| v.trim().parse().unwrap())
        };
        let append = |id: &str, start: f64| {
            use std::io::Write as _;
            let mut log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.usage_log_path(uid))
                .unwrap();
            writeln!(
                log,
                "{{\"event\":\"start\",\"id\":\"{id}\",\"user\":\"{me}\",\"host\":\"h\",\
                 \"pid\":1,\"gpu\":\"index 0\",\"bytes\":null,\"time\":{start},\"command\":[]}}\n\
                 {{\"event\":\"end\",\"id\":\"{id}\",\"time\":{}}}",
                start + 3600.0
            )
            .unwrap();
        };
        let now = tt_device::now_unix();
        append("first", now - 10_000.0);
        let mut watch = tt_lock::UsageWatch::new(std::time::Duration::ZERO);
        let first = crate::commands::metrics::render(&dir, &gpus, &mut watch).unwrap();
        assert!((seconds(&first) - 3600.0).abs() < 1e-6, "{first}");
        append("second", now - 5_000.0);
        let later = crate::commands::metrics::render(&dir, &gpus, &mut watch).unwrap();
        assert!((seconds(&later) - 7200.0).abs() < 1e-6, "{later}");
    }

    #[test]
    fn the_metrics_are_rendered_from_the_state_read_as_the_metrics_command_reads_them() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let gpus = Arc::new(one_gpu());
        let key = Snapshot::take(&dir, &gpus).unwrap().gpus[0].key.clone();
        let lock = dir
            .lock(&key, tt_lock::Wait::Try, tt_lock::Holder::current())
            .unwrap();
        let mut reader = Reader::new(dir.clone(), Arc::clone(&gpus));
        let read = reader.read_all();
        let served = read.metrics.unwrap().unwrap();
        let mut watch = tt_lock::UsageWatch::new(std::time::Duration::ZERO);
        let fresh = crate::commands::metrics::render(&dir, &gpus, &mut watch).unwrap();
        // The same series, and the same values but for the clock's (ages in seconds).
        let steady = |text: &str| -> Vec<String> {
            text.lines()
                .filter(|l| !l.contains("_seconds") && !l.contains("user_gpu"))
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(steady(&served), steady(&fresh));
        assert!(served.contains("torchtools_gpu_locked{"), "{served}");
        drop(lock);
        // Rendered from each reading: the next one shows the lock let go.
        let after = reader.read_all();
        assert_ne!(
            steady(&after.metrics.unwrap().unwrap()),
            steady(&served),
            "the reading after the lock was let go"
        );
    }

    #[test]
    fn the_state_stays_small_whatever_the_records_hold() {
        // Thousands of sharers, each with a command of 60 KiB: 240 MB as it is.
        let sharer =
            serde_json::json!({"user": "tt2", "pid": 7, "command": ["x".repeat(60 << 10)]});
        let state = serde_json::json!({
            "schema": SCHEMA,
            "gpus": [{"shares": vec![sharer; 4000], "history": vec![[1, 2, 3]; 361]}],
            "queue": [],
        });
        let json = bounded_json(state);
        assert!(json.len() <= MAX_STATE, "{}", json.len());
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        let shares = value["gpus"][0]["shares"].as_array().unwrap();
        assert!(
            !shares.is_empty() && shares.len() < 4000,
            "{}",
            shares.len()
        );
        let command = shares[0]["command"][0].as_str().unwrap();
        assert!(command.len() <= MAX_TEXT + 3 && command.ends_with('…'));
        let said = value["truncated"].to_string();
        assert!(
            said.contains("/gpus/shares: ") && said.contains("of 4000 shown"),
            "{said}"
        );
        // A state within the bounds is left whole, with nothing said.
        let small = serde_json::json!({"schema": SCHEMA, "queue": [1, 2, 3]});
        assert_eq!(bounded_json(small.clone()), small.to_string());
    }

    #[test]
    fn a_lock_directory_that_cannot_be_read_is_said_in_the_state() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let mut reader = Reader::new(dir, Arc::new(one_gpu()));
        std::fs::remove_dir_all(tmp.path().join("locks")).unwrap();
        let json: serde_json::Value = serde_json::from_str(&reader.read()).unwrap();
        assert!(
            json["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{json}"
        );
    }
}

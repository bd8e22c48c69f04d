//! `torchtools metrics`: the machine's GPUs, reservations, queue, users and jobs as
//! OpenMetrics text, for Prometheus: printed once, served at `/metrics` (`--listen`),
//! or written for node_exporter's textfile collector (`--textfile`). Read from the same
//! places as `top`, `usage` and `jobs` (the lock directory, NVML), with no daemon: each
//! scrape reads them afresh. Labels are bounded: `gpu`, `uuid`, `user`, `job_id` (not
//! `job`, which Prometheus gives every series it scrapes) and a `state` of two values;
//! never a command line or a pid.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use tt_lock::{GpuKey, LockDir};

use crate::exit::Exit;
use crate::http::Get;
use crate::snapshot::{Gpus, Snapshot};

/// Export the machine's metrics for Prometheus.
///
/// The GPUs, reservations, queue, users and jobs as OpenMetrics text for Prometheus:
/// printed once, served at http://ADDR/metrics (--listen ADDR), or written for
/// node_exporter's textfile collector (--textfile DIR).
///
/// Per GPU: memory used and total, use, fenced bytes, who reserved how much (holder
/// or sharers), waiters and the oldest wait; per user: GPU-seconds and reserved
/// byte-seconds (the usage records), queued requests, running and waiting jobs; per
/// running job: its GPUs and budget. Labels: gpu, uuid, user, job_id.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Serve the metrics at http://ADDR/metrics (e.g. 127.0.0.1:9835; 0.0.0.0:9835 for
    /// every interface), each scrape read afresh, until stopped.
    #[arg(long, value_name = "ADDR", conflicts_with = "textfile")]
    pub(crate) listen: Option<SocketAddr>,
    /// With --listen: another name scrapers reach this server by (repeatable):
    /// requests are answered only for its addresses, localhost, this machine's name
    /// and these.
    #[arg(long = "host", value_name = "NAME", requires = "listen")]
    pub(crate) hosts: Vec<String>,
    /// Write DIR/torchtools.prom for node_exporter's textfile collector
    /// (--collector.textfile.directory), atomically, every --interval, until stopped.
    #[arg(long, value_name = "DIR")]
    pub(crate) textfile: Option<PathBuf>,
    /// How often --textfile rewrites its file.
    #[arg(long, value_name = "TIME", value_parser = crate::args::duration, default_value = "15s", requires = "textfile")]
    pub(crate) interval: Duration,
}

/// `torchtools metrics`.
pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let dir = LockDir::from_env()?;
    let gpus = Gpus::open();
    match (args.listen, &args.textfile) {
        (Some(addr), _) => serve(dir, gpus, addr, &args.hosts),
        (None, Some(out)) => textfile(&dir, &gpus, out, args.interval),
        (None, None) => {
            let mut watch = tt_lock::UsageWatch::new(Duration::ZERO);
            print!("{}", render(&dir, &gpus, &mut watch)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// OpenMetrics' content type, which Prometheus asks for first.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Prometheus's text format, for clients that do not ask for OpenMetrics.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// The file `--textfile DIR` writes (node_exporter reads `*.prom`).
const TEXTFILE: &str = "torchtools.prom";

/// Serves `/metrics` at `addr` until stopped, each scrape on its own connection (a
/// slow scraper never holds up another), with `serve`'s bounds on requests.
fn serve(dir: LockDir, gpus: Gpus, addr: SocketAddr, hosts: &[String]) -> Result<ExitCode> {
    let listener = crate::http::bind(addr)?;
    let bound = listener.local_addr()?;
    eprintln!("torchtools: serving metrics at http://{bound}/metrics");
    let gpus = Arc::new(gpus);
    // The usage logs as the scrapes so far read them: each reads what was appended.
    let watch = Arc::new(std::sync::Mutex::new(tt_lock::UsageWatch::new(
        Duration::ZERO,
    )));
    let names = crate::http::Names::of(bound, hosts);
    crate::http::run(listener, "torchtools metrics", names, move |get: Get| {
        let (dir, gpus, watch) = (dir.clone(), Arc::clone(&gpus), Arc::clone(&watch));
        async move {
            match get.path.as_str() {
                "/metrics" => scrape(dir, gpus, watch, get.accept, "torchtools metrics").await,
                _ => crate::http::text(404, "torchtools", "the metrics are at /metrics"),
            }
        }
    })?;
    Ok(ExitCode::SUCCESS)
}

/// A scrape of `/metrics`: read afresh (the usage logs read on by `watch`), off the
/// threads that answer the others, in the format `accept` asks for.
async fn scrape(
    dir: LockDir,
    gpus: Arc<Gpus>,
    watch: Arc<std::sync::Mutex<tt_lock::UsageWatch>>,
    accept: Option<String>,
    who: &str,
) -> crate::http::Response {
    let read = move || {
        let mut watch = watch.lock().unwrap_or_else(|e| e.into_inner());
        render(&dir, &gpus, &mut watch)
    };
    match tokio::task::spawn_blocking(read).await {
        Ok(Ok(text)) => {
            let (kind, body) = negotiate(text, accept.as_deref());
            crate::http::response(200, kind, body)
        }
        Ok(Err(e)) => crate::http::text(500, who, &format!("{e:#}")),
        Err(e) => crate::http::text(500, who, &format!("reading the metrics: {e}")),
    }
}

/// The answer to a scrape, given its `Accept` header: OpenMetrics to those who ask for
/// it (Prometheus does), else the text format every scraper reads (`serve`'s
/// `/metrics` too). Its content type and body.
pub(crate) fn negotiate(openmetrics: String, accept: Option<&str>) -> (&'static str, String) {
    if accept.is_some_and(|a| a.contains("application/openmetrics-text")) {
        (OPENMETRICS, openmetrics)
    } else {
        (TEXT_FORMAT, text_format(&openmetrics))
    }
}

/// Writes `dir/torchtools.prom` every `interval`, each time whole (a temporary file
/// renamed over it), until killed.
fn textfile(dir: &LockDir, gpus: &Gpus, out: &Path, interval: Duration) -> Result<ExitCode> {
    if !out.is_dir() {
        return Err(Exit::usage(format!(
            "--textfile {}: not a directory: give node_exporter's \
                 --collector.textfile.directory",
            out.display()
        ))
        .into());
    }
    let path = out.join(TEXTFILE);
    // A name node_exporter does not read (`*.prom` only) while it is written.
    let temp = out.join(format!(".{TEXTFILE}.{}", std::process::id()));
    let mut watch = tt_lock::UsageWatch::new(Duration::ZERO);
    loop {
        // node_exporter reads Prometheus's text format.
        let text = text_format(&render(dir, gpus, &mut watch)?);
        let mut file = new_textfile(&temp).map_err(|e| {
            Exit::usage(format!(
                "--textfile {}: cannot create {} there: {e} (a file or link of that \
                     name is never followed nor overwritten: remove it, or give a \
                     directory only you and node_exporter write)",
                out.display(),
                temp.display()
            ))
        })?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temp, &path).with_context(|| format!("placing {}", path.display()))?;
        std::thread::sleep(interval);
    }
}

/// A new file at `temp`, mode 0644 whatever the umask (node_exporter's user reads it):
/// created with `O_EXCL | O_NOFOLLOW`, so that a link or file planted under the name
/// (another user who can write the directory) is never followed nor written; a stale
/// temporary file of this user's, left by a killed run with the same pid, is removed
/// first (only the owner's: `unlink` of another user's file in a sticky directory fails,
/// and the create then says why).
fn new_textfile(temp: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    if let Ok(meta) = std::fs::symlink_metadata(temp) {
        if meta.uid() == tt_lock::euid() && meta.is_file() {
            let _ = std::fs::remove_file(temp);
        }
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(temp)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
    Ok(file)
}

/// A label value from a record (another user's text): control characters made
/// visible, so that a dashboard or a terminal reading the scrape shows them as text (the
/// encoder escapes `\`, `"` and newlines as the format requires; this is for the rest).
fn label(text: &str) -> String {
    tt_device::printable(text).into_owned()
}

/// The encoder's OpenMetrics text in Prometheus's text format (0.0.4), which
/// node_exporter's textfile collector and older scrapers read: the same samples; a
/// counter's family is named as its `_total` samples are; no `# UNIT` or `# EOF`.
fn text_format(openmetrics: &str) -> String {
    let counters: Vec<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|tag| {
            let rest = line.strip_prefix(tag)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(&name)
                .then(|| format!("{tag}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
    uuid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuUserLabels {
    gpu: String,
    uuid: String,
    user: String,
    /// The Slurm job the reservation was made in (`1234`, an array's task `1234_7`);
    /// empty outside Slurm (Prometheus reads an empty label as none).
    slurm_job: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServerLabels {
    host: String,
    lock_dir: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UserLabels {
    user: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UserStateLabels {
    user: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabels {
    /// Not `job`: Prometheus sets `job` on every series it scrapes (the scrape job's
    /// name) and would rename ours `exported_job`.
    job_id: String,
    user: String,
    gpu: String,
}

type GaugeF = Gauge<f64, AtomicU64>;
type CounterF = Counter<f64, AtomicU64>;

/// A family of gauges registered in `registry`.
fn gauges<L>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    unit: Option<Unit>,
) -> Family<L, GaugeF>
where
    L: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
{
    let family = Family::<L, GaugeF>::default();
    match unit {
        Some(unit) => registry.register_with_unit(name, help, unit, family.clone()),
        None => registry.register(name, help, family.clone()),
    }
    family
}

/// The labels of a GPU: NVML's index when it lists it (else the lock's index), and its
/// UUID (empty for a GPU known by index only).
fn gpu_labels(key: &GpuKey, index: Option<u32>) -> GpuLabels {
    match key {
        GpuKey::Uuid(uuid) => GpuLabels {
            gpu: index.map_or_else(|| uuid.clone(), |i| i.to_string()),
            uuid: uuid.clone(),
        },
        GpuKey::Index(i) => GpuLabels {
            gpu: i.to_string(),
            uuid: String::new(),
        },
    }
}

/// Every metric, read now, as OpenMetrics text; the usage logs read on from where
/// `watch` (this process's earlier readings) stopped.
pub(crate) fn render(
    dir: &LockDir,
    gpus: &Gpus,
    watch: &mut tt_lock::UsageWatch,
) -> Result<String> {
    let snapshot = Snapshot::take(dir, gpus)?;
    let usage = watch.read(dir, &[])?;
    let jobs = snapshot.live_jobs()?;
    let per_user = per_user_use(&usage);
    render_from(&snapshot, &per_user, &usage.ignored, &jobs)
}

/// Each user's use over all the usage records (the `user_gpu` and `user_reserved`
/// counters): the first window of `usage`.
pub(crate) fn per_user_use(usage: &tt_lock::UsageSummed) -> Vec<crate::commands::usage::Row> {
    usage.windows.first().map_or_else(Vec::new, |all| {
        crate::commands::usage::rows(all, crate::commands::usage::By::User)
    })
}

/// Every metric as OpenMetrics text, from what was read: the snapshot, each user's use
/// ([`per_user_use`]), the usage records not believed and the jobs that have not ended
/// (`serve` renders its `/metrics` from the state it already holds).
pub(crate) fn render_from(
    snapshot: &Snapshot,
    per_user: &[crate::commands::usage::Row],
    usage_ignored: &[tt_lock::Ignored],
    jobs: &[crate::jobs::store::LiveJob],
) -> Result<String> {
    let mut registry = Registry::with_prefix("torchtools");
    server_series(&mut registry, snapshot);
    gpu_series(&mut registry, snapshot);
    queue_series(&mut registry, snapshot);
    fair_share_series(&mut registry, snapshot);
    outside_policy_series(&mut registry, snapshot);
    usage_series(&mut registry, per_user);
    job_series(&mut registry, jobs);
    ignored_series(&mut registry, snapshot, usage_ignored);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)
        .context("encoding the metrics")?;
    Ok(text)
}

/// The machine these series describe, for a dashboard of several servers (Prometheus's
/// `instance` is the address it scraped; this is the machine's own name).
fn server_series(registry: &mut Registry, snapshot: &Snapshot) {
    let server = gauges::<ServerLabels>(
        registry,
        "server",
        "1, labelled with the machine's host name and its lock directory",
        None,
    );
    server
        .get_or_create(&ServerLabels {
            host: label(&tt_lock::Holder::current().who.host),
            lock_dir: label(&snapshot.lock_dir.to_string_lossy()),
        })
        .set(1.0);
}

/// Per GPU: its memory and use, the fences, the lock, the reservations per user, the queue.
fn gpu_series(registry: &mut Registry, snapshot: &Snapshot) {
    gpu_memory_series(registry, snapshot);
    gpu_reservation_series(registry, snapshot);
}

/// Per GPU, what NVML and the fences say: memory, use, fenced bytes, whether it is held.
fn gpu_memory_series(registry: &mut Registry, snapshot: &Snapshot) {
    let total = gauges::<GpuLabels>(
        registry,
        "gpu_memory_total",
        "The GPU's memory (NVML)",
        Some(Unit::Bytes),
    );
    let used = gauges::<GpuLabels>(
        registry,
        "gpu_memory_used",
        "The GPU's memory in use (NVML)",
        Some(Unit::Bytes),
    );
    let utilization = gauges::<GpuLabels>(
        registry,
        "gpu_utilization",
        "The share of time a kernel ran over the driver's last sample period (NVML)",
        Some(Unit::Ratios),
    );
    let fenced = gauges::<GpuLabels>(
        registry,
        "gpu_fenced",
        "GPU memory held by torchtools' fences, so that no one else takes it",
        Some(Unit::Bytes),
    );
    let held = gauges::<GpuLabels>(
        registry,
        "gpu_locked",
        "1 while no request for the whole GPU is granted: a job holds it alone, or a \
         process holds its lock with no reservation record",
        None,
    );
    for g in &snapshot.gpus {
        let labels = gpu_labels(&g.key, g.index);
        if let Some(b) = g.total {
            total.get_or_create(&labels).set(b.0 as f64);
        }
        if let Some(b) = g.used {
            used.get_or_create(&labels).set(b.0 as f64);
        }
        if let Some(u) = g.utilization {
            utilization.get_or_create(&labels).set(f64::from(u) / 100.0);
        }
        let fences: u64 = g
            .holder
            .iter()
            .chain(&g.shares)
            .filter_map(|h| h.fenced)
            .map(|b| b.0)
            .sum();
        fenced.get_or_create(&labels).set(fences as f64);
        held.get_or_create(&labels).set(f64::from(u8::from(
            g.holder.is_some() || !g.unrecorded.is_empty(),
        )));
    }
}

/// Per GPU, who reserved it (per user) and who waits for it.
fn gpu_reservation_series(registry: &mut Registry, snapshot: &Snapshot) {
    let reserved = gauges::<GpuUserLabels>(
        registry,
        "gpu_reserved",
        "Bytes reserved on the GPU per user (and Slurm job): the holder's, or the sharers' \
         budgets (--share)",
        Some(Unit::Bytes),
    );
    let reservations = gauges::<GpuUserLabels>(
        registry,
        "gpu_reservations",
        "Reservations of the GPU per user (and Slurm job): 1 for the holder, one per \
         sharing job",
        None,
    );
    let waiters = gauges::<GpuLabels>(
        registry,
        "gpu_waiters",
        "Requests waiting in the queue for the GPU",
        None,
    );
    let oldest = gauges::<GpuLabels>(
        registry,
        "gpu_oldest_wait",
        "How long the oldest request for the GPU has waited",
        Some(Unit::Seconds),
    );
    for g in &snapshot.gpus {
        let labels = gpu_labels(&g.key, g.index);
        for (h, bytes) in g
            .holder
            .iter()
            .map(|h| (h, h.who.reserved))
            .chain(g.shares.iter().map(|h| (h, h.share)))
        {
            let user = GpuUserLabels {
                gpu: labels.gpu.clone(),
                uuid: labels.uuid.clone(),
                user: label(&h.who.user),
                slurm_job: label(h.who.slurm_job.as_deref().unwrap_or_default()),
            };
            reserved
                .get_or_create(&user)
                .inc_by(bytes.map_or(0.0, |b| b.0 as f64));
            reservations.get_or_create(&user).inc();
        }
        waiters.get_or_create(&labels).set(g.waiting.len() as f64);
        let since = snapshot
            .queue
            .iter()
            .filter(|w| g.waiting.contains(&w.position))
            .map(|w| w.who.since_unix)
            .min();
        oldest
            .get_or_create(&labels)
            .set(since.map_or(0.0, |s| snapshot.time_unix.saturating_sub(s) as f64));
    }
}

/// Per user: the requests in the GPU queue and the oldest one's wait.
/// Per user, the live requests (holders, sharers, waiters) made under another policy
/// file than the machine's.
fn outside_policy_series(registry: &mut Registry, snapshot: &Snapshot) {
    let outside = gauges::<UserLabels>(
        registry,
        "requests_outside_policy",
        "Live requests per user (held, shared or waiting) made under another policy file \
         than the machine's (TORCHTOOLS_POLICY on a machine without \
         /etc/torchtools/policy.toml)",
        None,
    );
    let holders = snapshot
        .gpus
        .iter()
        .flat_map(|g| g.holder.iter().chain(&g.shares))
        .map(|h| &h.who);
    for who in holders.chain(snapshot.queue.iter().map(|w| &w.who)) {
        if who.policy.is_some() {
            outside
                .get_or_create(&UserLabels {
                    user: label(&who.user),
                })
                .inc();
        }
    }
}

fn queue_series(registry: &mut Registry, snapshot: &Snapshot) {
    let queued = gauges::<UserLabels>(
        registry,
        "queue_waiters",
        "Requests waiting in the GPU queue, per user",
        None,
    );
    let queued_oldest = gauges::<UserLabels>(
        registry,
        "queue_oldest_wait",
        "How long each user's oldest request in the GPU queue has waited",
        Some(Unit::Seconds),
    );
    for w in &snapshot.queue {
        let user = UserLabels {
            user: label(&w.who.user),
        };
        queued.get_or_create(&user).inc();
        let waited = snapshot.time_unix.saturating_sub(w.who.since_unix) as f64;
        let oldest = queued_oldest.get_or_create(&user);
        if waited > oldest.get() {
            oldest.set(waited);
        }
    }
}

/// Per user, under a policy that orders the queue: recent use (decayed GPU-seconds),
/// its part of everyone's, and the GPUs held now.
fn fair_share_series(registry: &mut Registry, snapshot: &Snapshot) {
    let ignored = GaugeF::default();
    registry.register(
        "policy_ignored",
        "1 when the machine's queueing policy file is there but ignored (not root's, \
         writable by others, or not valid: `torchtools policy` says why); requests are \
         then served first come, first served",
        ignored.clone(),
    );
    ignored.set(if snapshot.policy_ignored { 1.0 } else { 0.0 });
    if !snapshot.policy_orders {
        return;
    }
    let used = gauges::<UserLabels>(
        registry,
        "fair_share_recent_use_gpu",
        "Each user's recent GPU use under the machine's fair-share policy: GPU-seconds, \
         each counting half after the policy's half-life",
        Some(Unit::Seconds),
    );
    let fraction = gauges::<UserLabels>(
        registry,
        "fair_share_fraction",
        "Each user's part of all users' recent GPU use (0 to 1); less is served first",
        None,
    );
    let held = gauges::<UserLabels>(
        registry,
        "fair_share_gpus_held",
        "GPUs each user holds now, counted against the policy's per-user limit",
        None,
    );
    let over = gauges::<UserLabels>(
        registry,
        "user_over_limit",
        "1 for each user who holds more than the policy's per-user limits let one user \
         have at once (GPUs or shared bytes), whatever their processes believed the \
         policy was",
        None,
    );
    let unread = gauges::<UserLabels>(
        registry,
        "user_usage_unread",
        "1 for each user with a usage log nobody reads (more than a MiB written past its \
         last summary): their recent use is unknown and they are served as the heaviest \
         user until their own next request summarizes it",
        None,
    );
    for u in &snapshot.users {
        let user = UserLabels {
            user: label(&u.user),
        };
        unread
            .get_or_create(&user)
            .set(if u.unread.is_some() { 1.0 } else { 0.0 });
        used.get_or_create(&user).set(u.use_gpu_s);
        fraction.get_or_create(&user).set(u.fraction);
        held.get_or_create(&user).set(u.gpus as f64);
        over.get_or_create(&user)
            .set(if u.over.is_some() { 1.0 } else { 0.0 });
    }
}

/// Per user: GPU-seconds and reserved byte-seconds from the usage records.
fn usage_series(registry: &mut Registry, per_user: &[crate::commands::usage::Row]) {
    let gpu_seconds = Family::<UserLabels, CounterF>::default();
    registry.register_with_unit(
        "user_gpu",
        "GPU time held per user, one GPU for one second being one (the usage records; a \
         holder that died holding its GPU counts until ten minutes after its last sign of life)",
        Unit::Seconds,
        gpu_seconds.clone(),
    );
    let byte_seconds = Family::<UserLabels, CounterF>::default();
    registry.register_with_unit(
        "user_reserved",
        "Reserved bytes held per user, integrated over time (byte-seconds)",
        Unit::Other("byte_seconds".into()),
        byte_seconds.clone(),
    );
    for row in per_user {
        let user = UserLabels {
            user: label(&row.name),
        };
        gpu_seconds
            .get_or_create(&user)
            .inc_by(row.gpu_hours * 3600.0);
        byte_seconds
            .get_or_create(&user)
            .inc_by(row.reserved_gib_hours * 3600.0 * (1u64 << 30) as f64);
    }
}

/// Per user, the detached jobs by state; per running job, its GPUs and bytes.
fn job_series(registry: &mut Registry, jobs: &[crate::jobs::store::LiveJob]) {
    let user_jobs = gauges::<UserStateLabels>(
        registry,
        "user_jobs",
        "Detached jobs per user that have not ended: running, or waiting (for jobs or GPUs)",
        None,
    );
    let job_reserved = gauges::<JobLabels>(
        registry,
        "job_reserved",
        "Each running detached job's GPUs, with the bytes reserved on each (0: the lock alone)",
        Some(Unit::Bytes),
    );
    for job in jobs {
        let state = if job.waiting { "waiting" } else { "running" };
        user_jobs
            .get_or_create(&UserStateLabels {
                user: label(&job.user),
                state: state.into(),
            })
            .inc();
        for gpu in &job.gpus {
            job_reserved
                .get_or_create(&JobLabels {
                    job_id: label(&job.id),
                    user: label(&job.user),
                    gpu: gpu.clone(),
                })
                .set(job.bytes.unwrap_or(0) as f64);
        }
    }
}

/// Per owner, the records of the lock directory not believed.
fn ignored_series(
    registry: &mut Registry,
    snapshot: &Snapshot,
    usage_ignored: &[tt_lock::Ignored],
) {
    let ignored = gauges::<UserLabels>(
        registry,
        "records_ignored",
        "Records in the lock directory not believed (they name another user than their \
         file's owner), per owner",
        None,
    );
    for why in snapshot.ignored.iter().chain(usage_ignored) {
        ignored
            .get_or_create(&UserLabels {
                user: why
                    .owner
                    .clone()
                    .unwrap_or_else(|| format!("uid {}", why.owner_uid)),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_format_names_counters_by_their_samples() {
        let om = "# HELP t_up Up.\n# TYPE t_up gauge\nt_up 1.0\n# HELP t_gpu Time.\n\
                  # TYPE t_gpu counter\n# UNIT t_gpu seconds\nt_gpu_total{user=\"a\"} 2.0\n# EOF\n";
        assert_eq!(
            text_format(om),
            "# HELP t_up Up.\n# TYPE t_up gauge\nt_up 1.0\n# HELP t_gpu_total Time.\n\
             # TYPE t_gpu_total counter\nt_gpu_total{user=\"a\"} 2.0\n"
        );
    }
}

//! A torchrun-style launcher: N local processes with torchrun's variables, each line of
//! their output prefixed with the rank, the group stopped when one rank fails, whole-group
//! restarts; across nodes, one fate for the job through node 0's launcher (`job`).

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::status::{describe, PREEMPTED};
use crate::{Error, Result, EXIT_PREEMPTED};

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Processes on this node.
    pub nproc_per_node: usize,
    /// Nodes in all.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Rank 0's host.
    pub master_addr: String,
    /// The rendezvous port; `None` picks a free one (single node only).
    pub master_port: Option<u16>,
    /// Restarts of the whole group after a failure, as torchrun's `--max-restarts`.
    pub max_restarts: u32,
    /// After one rank fails, the others get SIGTERM, then SIGKILL after this long.
    pub grace: Duration,
    /// The program.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// A signal number set here (by the caller's signal handler) is forwarded once to
    /// every rank. With it, each rank leads a process group of its own, which every
    /// signal reaches (what the rank started included), and the terminal's Ctrl-C
    /// reaches the ranks only through the caller, which must forward it, as `torchtools
    /// launch` does; without it the ranks stay in the caller's process group, where the
    /// terminal's signals reach them directly.
    pub forward: Option<Arc<AtomicI32>>,
    /// The job's id (`TORCHELASTIC_RUN_ID`, torchrun's `--rdzv-id`); `None`: `"none"`,
    /// as torchrun's default.
    pub run_id: Option<String>,
    /// More variables for every rank (after torchrun's), e.g. `CUDA_VISIBLE_DEVICES` of
    /// the GPUs reserved for the group.
    pub env: Vec<(OsString, OsString)>,
    /// Where in `args` each rank gets `--local-rank=LOCAL_RANK` (right after the script,
    /// before its own arguments), as `torch.distributed.launch` did without
    /// `--use-env`; `None` (torchrun's way): the local rank is in `LOCAL_RANK` only.
    pub local_rank_arg: Option<usize>,
    /// Descriptors every rank inherits (they stay open across its `exec`): the GPU
    /// locks of the group's reservation, so that the GPUs stay held while any rank
    /// runs, even when the launcher is killed (`tt_lock::inheritance` gives them).
    pub inherit_fds: Vec<std::os::fd::RawFd>,
}

impl LaunchConfig {
    /// `nproc` processes of `program args...` on this machine.
    pub fn local(nproc: usize, program: impl Into<OsString>, args: Vec<OsString>) -> LaunchConfig {
        LaunchConfig {
            nproc_per_node: nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            max_restarts: 0,
            grace: Duration::from_secs(10),
            program: program.into(),
            args,
            forward: None,
            run_id: None,
            env: Vec::new(),
            local_rank_arg: None,
            inherit_fds: Vec::new(),
        }
    }
}

/// How a launch ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchOutcome {
    /// 0 when every rank succeeded; else the failed rank's status (128 + signal when
    /// killed).
    pub code: i32,
    /// The first rank that failed (or, with [`EXIT_PREEMPTED`], was preempted), and how.
    pub failed: Option<(usize, String)>,
    /// Restarts made.
    pub restarts: u32,
    /// The port used.
    pub master_port: u16,
    /// What the failed rank wrote to its `TORCHELASTIC_ERROR_FILE` (PyTorch's
    /// `@record` writes the exception there): the exception and where it was raised.
    pub error: Option<String>,
}

/// Lets `cmd` inherit `fds`: their close-on-exec flag is cleared in the child.
fn inherit(cmd: &mut Command, fds: Vec<std::os::fd::RawFd>) {
    if fds.is_empty() {
        return;
    }
    // SAFETY: the closure runs in the forked child before exec and only calls fcntl,
    // which is async-signal-safe; it allocates nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, move || {
            for &fd in &fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// Copies a rank's output line by line, prefixed with `[rankN]: `.
fn prefix(
    reader: impl std::io::Read + Send + 'static,
    rank: usize,
    to_stderr: bool,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().spawn(move || {
        for line in BufReader::new(reader).split(b'\n') {
            let Ok(line) = line else { break };
            let mut out: Box<dyn Write> = if to_stderr {
                Box::new(std::io::stderr().lock())
            } else {
                Box::new(std::io::stdout().lock())
            };
            let _ = out.write_all(&prefixed(&line, rank));
        }
    })
}

/// `line` as the launcher prints it: `[rankN]: ` in front, unless the rank already put
/// exactly that there (PyTorch's distributed error reports prefix their own traceback
/// lines), and a newline.
fn prefixed(line: &[u8], rank: usize) -> Vec<u8> {
    let tag = format!("[rank{rank}]: ");
    let mut out = Vec::with_capacity(tag.len() + line.len() + 1);
    if !line.starts_with(tag.as_bytes()) {
        out.extend_from_slice(tag.as_bytes());
    }
    out.extend_from_slice(line);
    out.push(b'\n');
    out
}

/// The most ranks [`launch`] starts on one node: checked before anything starts (each
/// rank is a process and two reader threads).
pub const MAX_NPROC_PER_NODE: usize = 1024;

/// Launches the group, waits for it, restarts it on failure up to `max_restarts`.
pub fn launch(cfg: &LaunchConfig) -> Result<LaunchOutcome> {
    if cfg.nproc_per_node == 0 || cfg.nnodes == 0 {
        return Err(Error::Launch {
            reason: "--nproc-per-node and --nnodes must be at least 1".into(),
        });
    }
    if cfg.nproc_per_node > MAX_NPROC_PER_NODE {
        return Err(Error::Launch {
            reason: format!(
            "--nproc-per-node {}: at most {MAX_NPROC_PER_NODE} ranks per node (one per GPU, or a \
             few per CPU core, is the usual count)",
            cfg.nproc_per_node
        ),
        });
    }
    if cfg.node_rank >= cfg.nnodes {
        return Err(Error::Launch {
            reason: format!(
                "--node-rank {} but --nnodes {}: node ranks go from 0 to {}",
                cfg.node_rank,
                cfg.nnodes,
                cfg.nnodes - 1
            ),
        });
    }
    let port = match cfg.master_port {
        Some(p) => p,
        None if cfg.nnodes == 1 => crate::port::free_port(&cfg.master_addr)?,
        None => {
            return Err(Error::Launch {
                reason: "with several nodes every node needs the same --master-port".into(),
            })
        }
    };
    // Ranks on other hosts must reach ours: name the interface when the host's name
    // resolves to loopback (Gloo would offer 127.0.0.1 to its peers).
    let mut env = cfg.env.clone();
    if let Some(iface) = crate::socket_interface_for(&cfg.master_addr)? {
        let _ = writeln!(std::io::stderr(), "torchtools launch: {iface}");
        env.extend(iface.set.iter().map(|(k, v)| (k.into(), v.into())));
    }
    let errors = ErrorFiles::new()?;
    if cfg.nnodes > 1 {
        return launch_nodes(cfg, port, &env, &errors);
    }
    let mut restarts = 0;
    loop {
        let (mut ranks, readers) = start_ranks(cfg, port, restarts, &env, &errors)?;
        let ended = supervise(cfg, &mut ranks, &mut |_| {}, &mut || false);
        join_readers(readers);
        match ended.first {
            None => {
                return Ok(LaunchOutcome {
                    code: 0,
                    failed: None,
                    restarts,
                    master_port: port,
                    error: None,
                })
            }
            Some((rank, code, how)) => {
                // A preempted job is stopped on purpose: restarting it here would
                // fight the scheduler that asked it to go.
                if restarts < cfg.max_restarts && code != EXIT_PREEMPTED {
                    restarts += 1;
                    tracing::warn!(
                        "rank {rank} {how}: restarting the group ({restarts}/{})",
                        cfg.max_restarts
                    );
                    let _ = writeln!(std::io::stderr(), "torchtools launch: rank {rank} {how}; restarting the group ({restarts}/{})", cfg.max_restarts);
                    continue;
                }
                return Ok(LaunchOutcome {
                    code,
                    error: read_error_file(&errors.file(restarts, rank)),
                    failed: Some((rank, how)),
                    restarts,
                    master_port: port,
                });
            }
        }
    }
}

/// The threads copying the ranks' output.
type Readers = Vec<std::thread::JoinHandle<()>>;

/// The command of `rank` (`local` on this node) in attempt `attempt`: torchrun's
/// variables, the error file, the launcher's defaults (`OMP_NUM_THREADS`, unbuffered
/// Python, NCCL's async error handling) where the user set none, `env` on top.
fn rank_command(
    cfg: &LaunchConfig,
    port: u16,
    attempt: u32,
    env: &[(OsString, OsString)],
    errors: &ErrorFiles,
    rank: usize,
    local: usize,
) -> Result<Command> {
    let world = cfg.nnodes * cfg.nproc_per_node;
    let mut cmd = Command::new(&cfg.program);
    match cfg.local_rank_arg.map(|at| at.min(cfg.args.len())) {
        Some(at) => cmd
            .args(&cfg.args[..at])
            .arg(format!("--local-rank={local}"))
            .args(&cfg.args[at..]),
        None => cmd.args(&cfg.args),
    };
    cmd.env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", local.to_string())
        .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
        .env("GROUP_RANK", cfg.node_rank.to_string())
        .env("GROUP_WORLD_SIZE", cfg.nnodes.to_string())
        .env("ROLE_NAME", "default")
        .env("ROLE_RANK", rank.to_string())
        .env("ROLE_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", &cfg.master_addr)
        .env("MASTER_PORT", port.to_string())
        .env("TORCHELASTIC_RESTART_COUNT", attempt.to_string())
        .env("TORCHELASTIC_MAX_RESTARTS", cfg.max_restarts.to_string())
        .env(
            "TORCHELASTIC_RUN_ID",
            cfg.run_id.as_deref().unwrap_or("none"),
        )
        .env("TORCHELASTIC_ERROR_FILE", errors.prepare(attempt, rank)?)
        // The signals the launcher forwards to every rank.
        .env(
            "TORCHELASTIC_SIGNALS_TO_HANDLE",
            "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        )
        // Rank 0 serves the store (at MASTER_ADDR:MASTER_PORT): no launcher's.
        .env("TORCHELASTIC_USE_AGENT_STORE", "False")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Where the caller forwards signals, each rank leads a process group of its
    // own, so that stopping it stops what it started too (a shell's children, a
    // data loader's workers), whose open copies of the rank's output would
    // otherwise keep the launcher waiting.
    if cfg.forward.is_some() {
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    }
    if std::env::var_os("TORCH_NCCL_ASYNC_ERROR_HANDLING").is_none() {
        // As torchrun: a failed NCCL collective ends the rank, not hangs it.
        cmd.env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    inherit(&mut cmd, cfg.inherit_fds.clone());
    if cfg.nproc_per_node > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
        cmd.env("OMP_NUM_THREADS", "1");
    }
    // A rank writes into a pipe, where Python holds `print` back until its
    // buffer fills or it exits; under torchrun it writes to the terminal and
    // each line shows at once. Line by line here too, unless the user chose.
    if std::env::var_os("PYTHONUNBUFFERED").is_none() {
        cmd.env("PYTHONUNBUFFERED", "1");
    }
    Ok(cmd)
}

/// This node's ranks of attempt `attempt`, their store at `MASTER_ADDR:port`, each
/// with a reader thread per output stream.
fn start_ranks(
    cfg: &LaunchConfig,
    port: u16,
    attempt: u32,
    env: &[(OsString, OsString)],
    errors: &ErrorFiles,
) -> Result<(Vec<(usize, Child)>, Readers)> {
    let mut ranks: Vec<(usize, Child)> = Vec::with_capacity(cfg.nproc_per_node);
    let mut readers = Vec::new();
    let stop_started = |ranks: &mut Vec<(usize, Child)>| {
        for (_, c) in ranks.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    };
    for local in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local;
        let cmd = rank_command(cfg, port, attempt, env, errors, rank, local);
        let mut cmd = match cmd {
            Ok(c) => c,
            Err(e) => {
                stop_started(&mut ranks);
                return Err(e);
            }
        };
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => {
                stop_started(&mut ranks);
                return Err(Error::Spawn {
                    rank,
                    program: cfg.program.clone().into(),
                    cause: source,
                });
            }
        };
        let streams = [
            child.stdout.take().map(|o| prefix(o, rank, false)),
            child.stderr.take().map(|e| prefix(e, rank, true)),
        ];
        ranks.push((rank, child));
        for reader in streams.into_iter().flatten() {
            match reader {
                Ok(r) => readers.push(r),
                Err(source) => {
                    stop_started(&mut ranks);
                    return Err(Error::Io {
                        what: format!("starting the output reader of rank {rank}"),
                        cause: source,
                    });
                }
            }
        }
    }
    Ok((ranks, readers))
}

/// A job of several nodes: every node's launcher (this one too) joins node 0's, which
/// starts each attempt on every node and ends it on every node (see `job`).
fn launch_nodes(
    cfg: &LaunchConfig,
    port: u16,
    env: &[(OsString, OsString)],
    errors: &ErrorFiles,
) -> Result<LaunchOutcome> {
    use crate::job::{Coordinator, Down, Link, Up};
    let join = crate::env::dist_timeout(|k| std::env::var(k).ok())?;
    // Node 0's launcher runs the job; it ends (joined) after the last message.
    let coordinator = match cfg.node_rank {
        0 => Some(Coordinator::start(
            port,
            cfg.nnodes,
            cfg.max_restarts,
            join,
        )?),
        _ => None,
    };
    let addr = if cfg.node_rank == 0 {
        "127.0.0.1"
    } else {
        cfg.master_addr.as_str()
    };
    let link = Link::connect(addr, port, cfg.node_rank, join)?;
    // A message that came while the ranks ran and that the loop must still act on.
    let mut backlog: Option<Down> = None;
    loop {
        let message = match backlog.take() {
            Some(m) => m,
            None => match link.next(Duration::from_secs(1))? {
                Some(m) => m,
                None => continue,
            },
        };
        let (attempt, rank_port, after) = match message {
            Down::Start {
                attempt,
                port,
                after,
            } => (attempt, port, after),
            Down::Finish { end } => {
                // The coordinator has said its last word to every node.
                drop(coordinator);
                return job_outcome(end, port);
            }
            Down::Refused { reason } => return Err(Error::Launch { reason }),
            Down::Stop { .. } | Down::Alive => continue,
        };
        if let Some(after) = after {
            let _ = writeln!(
                std::io::stderr(),
                "torchtools launch: {after}; restarting the ranks of every node ({attempt}/{})",
                cfg.max_restarts
            );
        }
        let (mut ranks, readers) = start_ranks(cfg, rank_port, attempt, env, errors)?;
        let mut lost: Option<Error> = None;
        let mut told = false;
        let ended = {
            let mut on_first = |first: &(usize, i32, String)| {
                if first.1 != EXIT_PREEMPTED {
                    told = true;
                    let end = node_end(Some(first.clone()), errors, attempt, false);
                    let _ = link.send(&Up::Failing { attempt, end });
                }
            };
            let mut stop = || match link.next(Duration::ZERO) {
                Ok(Some(Down::Stop { attempt: a })) => a == attempt,
                Ok(Some(m @ Down::Finish { .. })) => {
                    backlog = Some(m);
                    true
                }
                Ok(_) => false,
                Err(e) => {
                    lost.get_or_insert(e);
                    true
                }
            };
            supervise(cfg, &mut ranks, &mut on_first, &mut stop)
        };
        join_readers(readers);
        if let Some(e) = lost {
            return Err(e);
        }
        // Ranks that failed because they were told to stop are not the cause.
        let stopped = ended.stopped && (ended.first.is_none() || !told);
        let end = node_end(ended.first, errors, attempt, stopped);
        link.send(&Up::Ended { attempt, end })?;
    }
}

/// The job's outcome as node 0's launcher announced it (`end`), on rendezvous `port`.
fn job_outcome(end: crate::job::JobEnd, port: u16) -> Result<LaunchOutcome> {
    match (end.code, end.rank) {
        (0, _) => Ok(LaunchOutcome {
            code: 0,
            failed: None,
            restarts: end.restarts,
            master_port: port,
            error: None,
        }),
        (code, Some(rank)) => Ok(LaunchOutcome {
            code,
            failed: Some((rank, end.how)),
            restarts: end.restarts,
            master_port: port,
            error: end.error,
        }),
        (_, None) => Err(Error::Job { reason: end.how }),
    }
}

/// How this node's ranks ended in `attempt`, for node 0's launcher: `first` is the rank
/// that failed (or was preempted) first, with its status and how, and the exception it
/// recorded in its error file.
fn node_end(
    first: Option<(usize, i32, String)>,
    errors: &ErrorFiles,
    attempt: u32,
    stopped: bool,
) -> crate::job::NodeEnd {
    match first {
        None => crate::job::NodeEnd {
            code: 0,
            rank: None,
            how: String::new(),
            error: None,
            stopped,
        },
        Some((rank, code, how)) => crate::job::NodeEnd {
            code,
            rank: Some(rank),
            how,
            error: read_error_file(&errors.file(attempt, rank)),
            stopped,
        },
    }
}

/// Where each rank's `TORCHELASTIC_ERROR_FILE` goes: `attempt_K/RANK/error.json` in a
/// private temporary directory, removed when the launch ends (torchrun's layout).
struct ErrorFiles {
    dir: tempfile::TempDir,
}

impl ErrorFiles {
    fn new() -> Result<ErrorFiles> {
        let dir = tempfile::Builder::new()
            .prefix("torchtools-launch-")
            .tempdir()
            .map_err(|source| Error::Io {
                what: "creating the directory of the ranks' error files".into(),
                cause: source,
            })?;
        Ok(ErrorFiles { dir })
    }

    fn file(&self, attempt: u32, rank: usize) -> std::path::PathBuf {
        self.dir
            .path()
            .join(format!("attempt_{attempt}"))
            .join(rank.to_string())
            .join("error.json")
    }

    /// The file's path, its directory created and no stale file in it.
    fn prepare(&self, attempt: u32, rank: usize) -> Result<std::path::PathBuf> {
        let file = self.file(attempt, rank);
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent).map_err(|source| Error::Io {
                what: format!("creating {}", parent.display()),
                cause: source,
            })?;
        }
        Ok(file)
    }
}

/// The exception a rank recorded in torchelastic's error-file format
/// (`{"message": {"message": "ValueError: ...", "extraInfo": {"py_callstack": ...}}}`),
/// with the file and line of its innermost frame: `ValueError: bad (train.py, line 12)`.
fn read_error_file(path: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    let message = &json["message"];
    let (what, stack) = match message {
        serde_json::Value::String(m) => (m.clone(), None),
        m => (
            m["message"].as_str()?.to_owned(),
            m["extraInfo"]["py_callstack"].as_str(),
        ),
    };
    // The last `File "...", line N, in f` of the traceback is where it was raised.
    let place = stack.and_then(|s| {
        s.lines().rev().find_map(|l| {
            let rest = l.trim_start().strip_prefix("File \"")?;
            let (file, rest) = rest.split_once('"')?;
            let line = rest.trim_start_matches(", line ").split(',').next()?;
            Some(format!("{file}, line {line}"))
        })
    });
    Some(match place {
        Some(p) => format!("{what} ({p})"),
        None => what,
    })
}

/// How this node's ranks ended.
struct Ended {
    /// The first rank that failed (else the first preempted), its status and how.
    first: Option<(usize, i32, String)>,
    /// The ranks were stopped because `stop` asked.
    stopped: bool,
}

/// Waits for every rank; on the first failure, or when `stop` says so (another node's
/// rank failed), stops the others (SIGTERM, SIGKILL after the grace period).
/// `on_first` hears of the first failure (or preemption) at once, before the others
/// are stopped.
fn supervise(
    cfg: &LaunchConfig,
    ranks: &mut [(usize, Child)],
    on_first: &mut dyn FnMut(&(usize, i32, String)),
    stop: &mut dyn FnMut() -> bool,
) -> Ended {
    let mut done = vec![false; ranks.len()];
    let mut failed: Option<(usize, i32, String)> = None;
    let mut preempted: Option<usize> = None;
    let mut stopped = false;
    let mut term_sent: Option<Instant> = None;
    let mut killed = false;
    let grouped = cfg.forward.is_some();
    loop {
        if let Some(flag) = &cfg.forward {
            let signal = flag.swap(0, Ordering::Relaxed);
            if signal != 0 {
                for ((_, c), d) in ranks.iter().zip(&done) {
                    if !d {
                        signal_rank(c, signal, grouped);
                    }
                }
            }
        }
        for (i, (rank, child)) in ranks.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            if let Ok(Some(status)) = child.try_wait() {
                done[i] = true;
                if status.code() == Some(EXIT_PREEMPTED) {
                    // Stopping with a checkpoint, as the other ranks are: let them.
                    if preempted.is_none() && failed.is_none() && !stopped {
                        on_first(&(*rank, EXIT_PREEMPTED, PREEMPTED.into()));
                    }
                    preempted.get_or_insert(*rank);
                } else if !status.success() && failed.is_none() {
                    let (code, how) = describe(status);
                    let first = (*rank, code, how);
                    if !stopped {
                        on_first(&first);
                    }
                    failed = Some(first);
                }
            }
        }
        if done.iter().all(|d| *d) {
            if grouped && (failed.is_some() || stopped) {
                // What the stopped ranks left behind goes with them (their groups; a
                // reaped rank's own pid is never signalled).
                for (_, c) in ranks.iter() {
                    signal_rank(c, libc::SIGKILL, true);
                }
            }
            let first =
                failed.or_else(|| preempted.map(|rank| (rank, EXIT_PREEMPTED, PREEMPTED.into())));
            return Ended { first, stopped };
        }
        if !stopped && failed.is_none() && stop() {
            stopped = true;
        }
        if failed.is_some() || stopped {
            match term_sent {
                None => {
                    for ((_, c), d) in ranks.iter().zip(&done) {
                        if !d {
                            signal_rank(c, libc::SIGTERM, grouped);
                        }
                    }
                    term_sent = Some(Instant::now());
                }
                Some(at) if !killed && at.elapsed() >= cfg.grace => {
                    for ((_, c), d) in ranks.iter_mut().zip(&done) {
                        if !d {
                            signal_rank(c, libc::SIGKILL, grouped);
                            let _ = c.kill();
                        }
                    }
                    killed = true;
                }
                _ => {}
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for the output readers of ranks that have all ended: each ends when every
/// process holding its pipe has closed it. A process a rank left running on its own (a
/// daemon it started, which the launcher does not stop when the rank succeeded) may
/// keep it open: after [`READERS_GRACE`] the launcher goes on without waiting for it.
fn join_readers(readers: Readers) {
    let deadline = Instant::now() + READERS_GRACE;
    for r in readers {
        while !r.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if r.is_finished() {
            let _ = r.join();
        }
    }
}

/// How long the launcher waits for the last output of ranks that have ended.
const READERS_GRACE: Duration = Duration::from_secs(2);

/// Sends `signal` to `rank`: to the process group it leads when `grouped` (the rank
/// and what it started), else to the rank alone.
fn signal_rank(rank: &Child, signal: i32, grouped: bool) {
    let pid = rank.id() as i32;
    // Our own child, or the group it leads: its pid is not reused while it is unreaped,
    // nor as a group id while a member of its group lives.
    let target = nix::unistd::Pid::from_raw(if grouped { -pid } else { pid });
    if let Ok(signal) = nix::sys::signal::Signal::try_from(signal) {
        let _ = nix::sys::signal::kill(target, signal);
    }
}

#[cfg(test)]
mod tests {
    use super::prefixed;

    #[test]
    fn each_line_is_prefixed_once() {
        let line = |l: &str, r| String::from_utf8(prefixed(l.as_bytes(), r)).unwrap_or_default();
        assert_eq!(line("loss 0.5", 3), "[rank3]: loss 0.5\n");
        assert_eq!(line("", 0), "[rank0]: \n");
        // PyTorch's own prefix for this rank is kept, not doubled.
        assert_eq!(line("[rank1]: Traceback", 1), "[rank1]: Traceback\n");
        // Another rank's tag, or one without the space, is text like any other.
        assert_eq!(line("[rank1]: x", 0), "[rank0]: [rank1]: x\n");
        assert_eq!(line("[rank1]:x", 1), "[rank1]: [rank1]:x\n");
    }
}

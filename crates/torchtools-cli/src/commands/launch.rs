//! `torchtools launch`: torchrun's command line, on tt-dist's launcher.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
use signal_hook::iterator::Signals;
use tt_dist::{launch as launch_group, LaunchConfig};

use crate::exit::Exit;

/// Run N ranks of a command, as torchrun does.
///
/// Launch N processes of CMD with torchrun's variables and command line: a drop-in
/// for `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
/// ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*; OMP_NUM_THREADS=1 when unset and
/// N > 1), each output line prefixed with its rank as it is printed
/// (PYTHONUNBUFFERED=1 when unset, so that Python's print reaches you at once).
///
/// torchrun's options work as torchrun spells them (`--nproc_per_node=2` and
/// `--nproc-per-node 2`, `--standalone`, `--rdzv-endpoint`, `-m`, `--no-python`,
/// `--run-path`), and a script path runs with Python: `torchtools launch
/// --nproc_per_node=4 train.py --lr 3e-4`. Without torchrun's forms: `launch
/// --nproc-per-node 2 -- ./my_rust_binary`.
///
/// When a rank fails, the others get SIGTERM, then SIGKILL after 10 s, and
/// torchtools exits with the failed rank's status, naming it and the exception
/// it recorded (PyTorch's `@record`).
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Start the launch in a session of its own, immune to the terminal's hang-up and
    /// to logging out, its ranks' prefixed output in a log file (in `--log-dir DIR`,
    /// default $XDG_STATE_HOME/torchtools/logs); print its job id at once (see
    /// `torchtools jobs`, `logs`, `stop`).
    #[arg(long)]
    detach: bool,
    /// With --detach: start only after these jobs have ended (see `reserve --after`).
    #[arg(long, value_name = "JOB", value_delimiter = ',', requires = "detach", add = crate::complete::jobs())]
    after: Vec<String>,
    /// With --detach: start only after these jobs have ended, and only if all succeeded
    /// (see `reserve --after-ok`).
    #[arg(long, value_name = "JOB", value_delimiter = ',', requires = "detach", add = crate::complete::jobs())]
    after_ok: Vec<String>,
    /// With --detach: run the group again when it exits 75 (see `reserve --requeue`).
    /// Inside a Slurm job (`sbatch --requeue`), without --detach: node 0's launcher
    /// requeues the job with `scontrol requeue` when the group exits 75.
    #[arg(long)]
    requeue: bool,
    /// With --detach: submit the launch to Slurm with `sbatch` (see `reserve --slurm`):
    /// --nnodes nodes, one launcher each under `srun`, --count GPUs each (--gpu auto).
    #[arg(long, requires = "detach", conflicts_with = "no_slurm")]
    slurm: bool,
    /// With --detach: to torchtools' own queue, whatever your config.toml's `[detach]
    /// to` says.
    #[arg(long, requires = "detach")]
    no_slurm: bool,
    /// With --slurm: print the `sbatch` script instead of submitting it.
    #[arg(long, requires = "detach")]
    dry_run: bool,
    /// With --detach: one launch per index, each with TORCHTOOLS_ARRAY_TASK_ID (see
    /// `reserve --array`).
    #[arg(long, value_name = "INDICES", value_parser = crate::args::array, requires = "detach")]
    array: Option<crate::args::ArraySpec>,
    #[command(flatten)]
    pub(crate) hook: crate::arg_groups::HookArgs,
    /// Processes on this node: a number, `gpu` (one per visible GPU), `cpu` (one per
    /// CPU) or `auto` (GPUs if there are any, else CPUs).
    #[arg(long = "nproc-per-node", visible_alias = "nproc_per_node", default_value = "1", value_parser = nproc)]
    nproc_per_node: Nproc,
    /// Nodes in all (`N`, or torchrun's `N:N`; default 1). Under `srun` with one task
    /// per node (`srun --ntasks-per-node=1 torchtools launch ...`), the step's nodes:
    /// SLURM_STEP_NUM_NODES, this node's SLURM_NODEID, the first of
    /// SLURM_STEP_NODELIST as rank 0's host, and a port from the job's id (MASTER_PORT
    /// or --master-port says otherwise).
    #[arg(long, value_parser = nnodes)]
    nnodes: Option<usize>,
    /// This node's index (default 0, or Slurm's SLURM_NODEID under `srun`).
    #[arg(long = "node-rank", visible_alias = "node_rank")]
    node_rank: Option<u32>,
    /// Rank 0's host.
    #[arg(long = "master-addr", visible_alias = "master_addr")]
    master_addr: Option<String>,
    /// The rendezvous port (default: a free one, on a single node).
    #[arg(long = "master-port", visible_alias = "master_port", value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,
    /// torchrun's `--rdzv-endpoint HOST[:PORT]` (c10d rendezvous): rank 0's host and
    /// port (default port 29400).
    #[arg(long = "rdzv-endpoint", visible_alias = "rdzv_endpoint", conflicts_with_all = ["master_addr", "master_port"])]
    rdzv_endpoint: Option<String>,
    /// torchrun's `--rdzv-backend`: `c10d` or `static` (both mean rank 0 serves the
    /// store at the endpoint).
    #[arg(long = "rdzv-backend", visible_alias = "rdzv_backend")]
    rdzv_backend: Option<String>,
    /// The job's id, for TORCHELASTIC_RUN_ID.
    #[arg(long = "rdzv-id", visible_alias = "rdzv_id")]
    rdzv_id: Option<String>,
    /// One node on this machine, a free port (torchrun's `--standalone`; the default).
    #[arg(long, conflicts_with_all = ["rdzv_endpoint", "master_addr"])]
    standalone: bool,
    /// Restart the whole group this many times after a failure.
    #[arg(
        long = "max-restarts",
        visible_alias = "max_restarts",
        default_value_t = 0
    )]
    max_restarts: u32,
    /// Run CMD as a program even when it is a `.py` script (torchrun's `--no-python`).
    #[arg(long = "no-python", visible_alias = "no_python", conflicts_with_all = ["module", "run_path"])]
    no_python: bool,
    /// CMD is a Python module: `python -m CMD` (torchrun's `-m`).
    #[arg(short = 'm', long = "module", conflicts_with = "run_path")]
    module: bool,
    /// Run the script through `runpy.run_path` (torchrun's `--run-path`).
    #[arg(long = "run-path", visible_alias = "run_path")]
    run_path: bool,
    /// Reserve GPUs for the group first, as `reserve` does (the same queue, all or
    /// nothing): an index, a UUID, or auto (the free GPUs with the most free memory).
    /// Each rank sees them all in CUDA_VISIBLE_DEVICES and uses cuda:LOCAL_RANK; they
    /// are released when the group ends.
    #[arg(long, value_delimiter = ',', value_parser = crate::args::gpu_spec, add = crate::complete::gpus())]
    gpu: Option<Vec<tt_lock::GpuSpec>>,
    /// How many GPUs --gpu auto takes (default: one per rank of this node).
    #[arg(long, requires = "gpu", value_parser = clap::value_parser!(u32).range(1..))]
    count: Option<u32>,
    /// Memory each rank needs on its GPU: the fence leaves this much free; auto: probe
    /// one rank first (a launch of one process, with TORCHTOOLS_PROBE=1, as `run
    /// --probe` does) and reserve what it used on each GPU.
    #[arg(long, requires = "gpu", value_parser = crate::args::budget)]
    bytes: Option<crate::args::Budget>,
    #[command(flatten)]
    probing: crate::arg_groups::ProbeArgs,
    /// Extra memory left free on top of --bytes.
    #[arg(long, requires = "gpu", value_parser = crate::args::size, default_value = crate::arg_groups::DEFAULT_MARGIN)]
    margin: tt_device::Bytes,
    /// Take the GPUs' locks alone, without a memory fence.
    #[arg(long, requires = "gpu", conflicts_with = "bytes")]
    no_fence: bool,
    /// Give up (exit 75) when the GPUs are still locked after this long.
    #[arg(long, requires = "gpu", value_parser = crate::args::duration)]
    timeout: Option<std::time::Duration>,
    #[command(flatten)]
    time: crate::arg_groups::TimeArgs,
    /// torch.distributed.launch's --use-env: the local rank in LOCAL_RANK only, which
    /// is always so here (as under torchrun); accepted so that its command lines run.
    #[arg(
        long = "use-env",
        visible_alias = "use_env",
        conflicts_with = "local_rank_arg"
    )]
    use_env: bool,
    /// Give each rank `--local-rank=N` after the script (before its own arguments), as
    /// torch.distributed.launch did without --use-env (`python -m torchtools.launch`
    /// sets it there).
    #[arg(long = "local-rank-arg")]
    local_rank_arg: bool,
    #[command(flatten)]
    unsupported: Unsupported,
    /// The command: a program and its arguments, or a Python script (`train.py ARGS`),
    /// with or without `--` before it.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    command: Vec<OsString>,
}

/// Returns the group's exit status: 0, or the failed rank's.
pub(crate) fn run(args: &Args) -> Result<u8> {
    if args.time.preemptible && args.gpu.is_none() {
        return Err(Exit::usage(
            "--preemptible yields the group's GPUs: reserve them with --gpu".into(),
        )
        .into());
    }
    let mut cfg = args.config()?;
    let slurm_requeue = args.slurm_requeue(&mut cfg)?;
    let limit = args.time.resolve(crate::limit::machine_policy()?)?;
    // The group's GPUs, reserved before any rank starts, held until the group ends.
    let mut reservation = match &args.gpu {
        None => None,
        Some(gpus) => Some(reserve_for(args, gpus, &mut cfg)?),
    };
    // Every signal we get goes to every rank: each rank leads a process group of its
    // own (so that stopping it stops what it started), out of the terminal's reach, so
    // the terminal's Ctrl-C reaches the ranks through us.
    let forward = Arc::new(AtomicI32::new(0));
    // SIGUSR1 too: Slurm's warning before a time limit (`--signal=USR1@90`).
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2])
        .map_err(|e| anyhow::anyhow!("cannot install signal handlers: {e}"))?;
    let handle = signals.handle();
    let flag = Arc::clone(&forward);
    let forwarder = std::thread::spawn(move || {
        for signal in signals.forever() {
            flag.store(signal, Ordering::Relaxed);
        }
    });
    // The time limit's signals go to every rank the same way, from the ranks' start.
    let timer = limit.map(|limit| {
        let flag = Arc::clone(&forward);
        crate::limit::timer(limit, move |signal| flag.store(signal, Ordering::Relaxed))
    });
    // A preemptible group's GPUs are watched the same way (see `crate::preempt`).
    let watcher = match (&reservation, args.time.preemptible) {
        (Some(r), true) if !r.is_empty() => {
            let flag = Arc::clone(&forward);
            let gpus = r.gpus().iter().map(|g| g.key.clone()).collect();
            Some(crate::preempt::watch(
                tt_lock::LockDir::from_env()?,
                gpus,
                move |signal| flag.store(signal, Ordering::Relaxed),
            ))
        }
        _ => None,
    };
    cfg.forward = Some(forward);
    let outcome = launch_group(&cfg).map_err(|e| match e {
        tt_dist::Error::Launch { reason: m } => anyhow::Error::from(Exit::usage(m)),
        tt_dist::Error::Job { reason: m } => {
            anyhow::Error::from(Exit::new(crate::exit::FAILURE, m))
        }
        tt_dist::Error::Spawn { program, cause, .. } => anyhow::Error::from(
            crate::child::spawn_failure(&program.to_string_lossy(), &cause),
        ),
        e => anyhow::Error::from(e),
    });
    handle.close();
    let _ = forwarder.join();
    if let Some(w) = watcher {
        w.finish();
    }
    if timer.is_some_and(crate::limit::Beside::finish) {
        let code = outcome.as_ref().map_or(1, |o| o.code);
        crate::limit::ended_by_limit(u8::try_from(code).unwrap_or(1));
    }
    // The GPUs go back as soon as every rank has ended.
    if let (Some(r), Ok(o)) = (reservation.as_mut(), outcome.as_ref()) {
        r.set_exit_status(o.code);
    }
    drop(reservation);
    let outcome = outcome?;
    if let Some(job) = &slurm_requeue {
        crate::commands::reserve::slurm_requeue_after(job, outcome.code);
    }
    match outcome.failed {
        None => Ok(0),
        Some((rank, how)) => {
            eprintln!(
                "torchtools launch: rank {rank} {how}{}{}; the other ranks were stopped",
                outcome
                    .error
                    .as_ref()
                    .map_or(String::new(), |e| format!(": {e}")),
                if outcome.restarts > 0 {
                    format!(" (after {} restart(s))", outcome.restarts)
                } else {
                    String::new()
                }
            );
            Ok(u8::try_from(outcome.code).unwrap_or(1).max(1))
        }
    }
}

/// How many ranks per node: a number, or torchrun's `auto`, `gpu`, `cpu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nproc {
    /// This many.
    Count(usize),
    /// One per visible GPU, else one per CPU.
    Auto,
    /// One per visible GPU (an error without any).
    Gpu,
    /// One per CPU.
    Cpu,
}

fn nproc(text: &str) -> std::result::Result<Nproc, String> {
    match text {
        "auto" => Ok(Nproc::Auto),
        "gpu" => Ok(Nproc::Gpu),
        "cpu" => Ok(Nproc::Cpu),
        n => match n.parse::<usize>() {
            Ok(0) | Err(_) => Err(format!(
                "{n:?} is not a count of processes: give a number from 1, or auto, gpu or cpu"
            )),
            Ok(n) => Ok(Nproc::Count(n)),
        },
    }
}

/// torchrun's `--nnodes`: `N`, or `MIN:MAX` with MIN = MAX (no elastic ranges).
fn nnodes(text: &str) -> std::result::Result<usize, String> {
    let count = |t: &str| match t.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{text:?} is not a number of nodes (1 or more)")),
    };
    match text.split_once(':') {
        None => count(text),
        Some((lo, hi)) => {
            let (lo, hi) = (count(lo)?, count(hi)?);
            if lo == hi {
                Ok(lo)
            } else {
                Err(format!(
                    "{text:?}: elastic ranges of nodes are not supported; give a fixed count \
                     (--nnodes {hi})"
                ))
            }
        }
    }
}

/// torchrun options with no equivalent here: each is refused, naming what to do.
#[derive(clap::Args)]
struct Unsupported {
    #[arg(long = "log-dir", alias = "log_dir", hide = true)]
    log_dir: Option<String>,
    #[arg(long, short = 'r', hide = true)]
    redirects: Option<String>,
    #[arg(long, short = 't', hide = true)]
    tee: Option<String>,
    #[arg(long = "local-ranks-filter", alias = "local_ranks_filter", hide = true)]
    local_ranks_filter: Option<String>,
    #[arg(long, hide = true)]
    role: Option<String>,
    #[arg(long = "rdzv-conf", alias = "rdzv_conf", hide = true)]
    rdzv_conf: Option<String>,
    #[arg(long = "start-method", alias = "start_method", hide = true)]
    start_method: Option<String>,
    #[arg(long = "monitor-interval", alias = "monitor_interval", hide = true)]
    monitor_interval: Option<String>,
    #[arg(long = "local-addr", alias = "local_addr", hide = true)]
    local_addr: Option<String>,
}

impl Unsupported {
    /// The first torchrun option given that has no equivalent, with what to do instead
    /// (`--log-dir` is the detached job's log directory with `--detach`).
    fn refusal(&self, detach: bool) -> Option<String> {
        let log_dir = if detach { &None } else { &self.log_dir };
        let said = [
            (log_dir, "--log-dir", "every rank's output comes to the terminal, each line prefixed with its rank: redirect it (`> run.log 2>&1`), or give --detach, whose job log goes into --log-dir"),
            (&self.redirects, "--redirects", "redirect the launcher's output instead (`> run.log 2>&1`)"),
            (&self.tee, "--tee", "pipe the launcher's output through `tee FILE`"),
            (&self.local_ranks_filter, "--local-ranks-filter", "every rank's lines carry `[rankN]: `: filter them with `grep '^\\[rank0\\]'`"),
            (&self.role, "--role", "every rank has the role `default` (ROLE_NAME)"),
            (&self.rdzv_conf, "--rdzv-conf", "rendezvous is c10d's store at --rdzv-endpoint, with TORCHTOOLS_DIST_TIMEOUT as its timeout"),
            (&self.start_method, "--start-method", "ranks are always separate processes (torchrun's default, spawn)"),
            (&self.monitor_interval, "--monitor-interval", "ranks are watched continuously"),
            (&self.local_addr, "--local-addr", "set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to choose the interface"),
        ];
        said.iter()
            .find(|(v, _, _)| v.is_some())
            .map(|(_, name, instead)| {
                format!("torchrun's {name} is not supported by torchtools launch: {instead}")
            })
    }
}

/// The Python that runs a script: the one installed beside this program (a venv's,
/// where the wheel put `torchtools`), else `python3` or `python` on PATH.
fn python() -> OsString {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
        .into_iter()
        .flat_map(|dir| [dir.join("python3"), dir.join("python")]);
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<PathBuf>>())
        .unwrap_or_default()
        .into_iter()
        .flat_map(|dir| [dir.join("python3"), dir.join("python")]);
    beside
        .chain(on_path)
        .find(|p| p.is_file())
        .map_or_else(|| "python3".into(), PathBuf::into_os_string)
}

impl Args {
    /// Whether the policy may preempt the group (`--preemptible`).
    pub(crate) fn preemptible(&self) -> bool {
        self.time.preemptible
    }

    /// `--detach` (and its `--log-dir`), when given.
    pub(crate) fn detached(&self) -> Option<crate::arg_groups::DetachArgs> {
        self.detach.then(|| crate::arg_groups::DetachArgs {
            detach: true,
            log_dir: self
                .unsupported
                .log_dir
                .as_ref()
                .map(std::path::PathBuf::from),
            after: self.after.clone(),
            after_ok: self.after_ok.clone(),
            requeue: self.requeue,
            array: self.array.clone(),
            slurm: self.slurm,
            no_slurm: self.no_slurm,
            dry_run: self.dry_run,
        })
    }

    /// With `--requeue` inside a Slurm job, on node 0 (which requeues it once; the
    /// others end with their ranks): the job, after saying which run this is. On every
    /// node the ranks are told (`TORCHTOOLS_REQUEUES_SLURM_JOB`) that torchtools
    /// requeues it, so that they only exit 75.
    fn slurm_requeue(&self, cfg: &mut LaunchConfig) -> Result<Option<String>> {
        let job = crate::arg_groups::DetachArgs {
            requeue: self.requeue,
            ..crate::arg_groups::DetachArgs::default()
        }
        .slurm_requeue()?;
        if let Some(job) = &job {
            cfg.env
                .push((tt_device::TORCHTOOLS_REQUEUES_SLURM_JOB.into(), job.into()));
        }
        let job = job.filter(|_| cfg.node_rank == 0);
        if let Some(job) = &job {
            crate::commands::reserve::slurm_run_said(job);
        }
        Ok(job)
    }

    /// The time options (`--time`, `--grace`, `--signal-before`, `--preemptible`).
    pub(crate) fn time(&self) -> &crate::arg_groups::TimeArgs {
        &self.time
    }

    /// What a Slurm submission (`--detach --slurm`) asks for: the GPUs (none without
    /// --gpu), how many on each node, and the nodes. Rendezvous options are refused:
    /// Slurm places the nodes, and each launcher reads them under `srun`.
    pub(crate) fn for_slurm(
        &self,
    ) -> std::result::Result<(Vec<tt_lock::GpuSpec>, Option<u32>, usize), Exit> {
        let placed = [
            (self.node_rank.is_some(), "--node-rank"),
            (self.master_addr.is_some(), "--master-addr"),
            (self.rdzv_endpoint.is_some(), "--rdzv-endpoint"),
            (self.standalone, "--standalone"),
        ];
        if let Some((_, option)) = placed.iter().find(|(given, _)| *given) {
            return Err(Exit::usage(format!(
                "--slurm: {option}: Slurm places a job's nodes, and each node's launcher \
                 reads them under srun; give --nnodes N only"
            )));
        }
        let gpus = self.gpu.clone().unwrap_or_default();
        let count = match (self.count, self.nproc_per_node) {
            _ if gpus.is_empty() => None,
            (Some(c), _) => Some(c),
            (None, Nproc::Count(n)) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
            (None, _) => {
                return Err(Exit::usage(
                    "--slurm --gpu: give --count N, the GPUs to ask Slurm for on each node \
                     (--nproc-per-node gpu counts the GPUs a node already has)"
                        .into(),
                ))
            }
        };
        Ok((gpus, count, self.nnodes.unwrap_or(1)))
    }

    /// How many of the command line's last words are the user's command (the program
    /// or script and its arguments).
    pub(crate) fn command_len(&self) -> usize {
        self.command.len()
    }

    /// The program and its arguments, as torchrun would run them; a script that is not
    /// there is refused before any rank starts (127, as a command not found).
    fn program(&self) -> std::result::Result<Vec<OsString>, Exit> {
        let command = self.command.clone();
        let is_script = Path::new(&command[0])
            .extension()
            .is_some_and(|e| e == "py");
        let with_python = self.run_path || (is_script && !self.no_python && !self.module);
        if with_python && !Path::new(&command[0]).is_file() {
            return Err(Exit::new(
                crate::exit::NOT_FOUND,
                format!(
                    "no such script: {} (from {})",
                    command[0].to_string_lossy(),
                    std::env::current_dir()
                        .map_or_else(|_| "here".into(), |d| d.display().to_string())
                ),
            ));
        }
        Ok(if self.module {
            [python(), "-m".into()].into_iter().chain(command).collect()
        } else if self.run_path {
            [
                python(),
                "-c".into(),
                "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
                    .into(),
            ]
            .into_iter()
            .chain(command)
            .collect()
        } else if is_script && !self.no_python {
            std::iter::once(python()).chain(command).collect()
        } else {
            command
        })
    }

    fn ranks(&self) -> std::result::Result<usize, Exit> {
        // A bad value is an error here as in the reservation, never "no GPU".
        let gpus = || -> std::result::Result<usize, Exit> {
            let visible = tt_device::CudaVisibleDevices::from_env()
                .map_err(|e| Exit::usage(e.to_string()))?;
            Ok(tt_device::Inventory::query().visible(&visible).len())
        };
        let cpus = || tt_device::CpuBudget::query().online.max(1);
        Ok(match self.nproc_per_node {
            Nproc::Count(n) => n,
            Nproc::Cpu => cpus(),
            Nproc::Auto => match gpus()? {
                0 => cpus(),
                n => n,
            },
            Nproc::Gpu => {
                match gpus()? {
                    0 => return Err(Exit::usage(
                        "--nproc-per-node gpu: no GPU is visible (NVML, CUDA_VISIBLE_DEVICES); \
                         give a number, or cpu"
                            .into(),
                    )),
                    n => n,
                }
            }
        })
    }

    /// The launcher's configuration, every option checked.
    fn config(&self) -> std::result::Result<LaunchConfig, Exit> {
        if let Some(refusal) = self.unsupported.refusal(self.detach) {
            return Err(Exit::usage(refusal));
        }
        if let Some(backend) = self.rdzv_backend.as_deref() {
            if !matches!(backend, "c10d" | "static") {
                return Err(Exit::usage(format!(
                    "--rdzv-backend {backend}: only c10d (and static) rendezvous is \
                         supported; give --rdzv-endpoint HOST:PORT of the first node"
                )));
            }
        }
        let step = self.slurm_step(|k| std::env::var(k).ok())?;
        if let Some(s) = &step {
            eprintln!(
                "torchtools launch: node {} of {} of Slurm's job step (SLURM_NODEID, \
                 SLURM_STEP_NUM_NODES), rank 0 at {}:{} (SLURM_STEP_NODELIST)",
                s.node_rank, s.nnodes, s.host, s.port
            );
        }
        let nnodes = step.as_ref().map_or(self.nnodes.unwrap_or(1), |s| s.nnodes);
        if self.standalone && nnodes > 1 {
            return Err(Exit::usage(format!(
                "--standalone is one node, but --nnodes {nnodes}"
            )));
        }
        let (master_addr, master_port) = match (&step, &self.rdzv_endpoint) {
            (Some(s), _) => (s.host.clone(), Some(s.port)),
            (None, Some(endpoint)) => match endpoint.rsplit_once(':') {
                Some((host, port)) => match port.parse::<u16>() {
                    Ok(p) if p > 0 => (host.to_owned(), Some(p)),
                    _ => {
                        return Err(Exit::usage(format!(
                            "--rdzv-endpoint {endpoint}: {port:?} is not a port (1-65535)"
                        )))
                    }
                },
                None => (endpoint.clone(), Some(29400)),
            },
            (None, None) => (
                self.master_addr
                    .clone()
                    .unwrap_or_else(|| "127.0.0.1".into()),
                self.master_port,
            ),
        };
        if self.local_rank_arg && (self.no_python || self.module) {
            return Err(Exit::usage(
                "--local-rank-arg gives a Python script --local-rank=N after its name: with \
                 --no-python or -m, read LOCAL_RANK instead (torch.distributed.launch too \
                 wants --use-env there)"
                    .into(),
            ));
        }
        let mut program = self.program()?;
        // After the program's own words (python, -u, the script): before the script's
        // arguments, as torch.distributed.launch put it.
        let local_rank_arg = self
            .local_rank_arg
            .then(|| (program.len() - 1).saturating_sub(self.command.len() - 1));
        Ok(LaunchConfig {
            nproc_per_node: self.ranks()?,
            nnodes,
            node_rank: step
                .as_ref()
                .map_or(self.node_rank.unwrap_or(0) as usize, |s| s.node_rank),
            master_addr,
            master_port,
            max_restarts: self.max_restarts,
            grace: std::time::Duration::from_secs(10),
            program: program.remove(0),
            args: program,
            forward: None,
            run_id: self.rdzv_id.clone(),
            env: Vec::new(),
            local_rank_arg,
            inherit_fds: Vec::new(),
        })
    }
}

/// The nodes of the Slurm job step this launcher is a task of (`srun torchtools launch`).
#[derive(Debug, PartialEq, Eq)]
struct SlurmStep {
    nnodes: usize,
    node_rank: usize,
    /// Rank 0's host: the step's first node.
    host: String,
    port: u16,
}

impl Args {
    /// Under `srun` across several nodes (SLURM_STEP_NUM_NODES > 1) and with no node
    /// option given: the step's nodes, read with `get`. Several launchers on one node
    /// (`srun --ntasks-per-node=2`) are refused: each would start its own ranks.
    fn slurm_step(
        &self,
        get: impl Fn(&str) -> Option<String>,
    ) -> std::result::Result<Option<SlurmStep>, Exit> {
        let chosen = self.nnodes.is_some()
            || self.node_rank.is_some()
            || self.master_addr.is_some()
            || self.rdzv_endpoint.is_some()
            || self.standalone;
        if chosen {
            return Ok(None);
        }
        let number = |name: &str| -> std::result::Result<Option<usize>, Exit> {
            get(name)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        Exit::usage(format!(
                            "{name}={v:?} (from Slurm) is not a number; give --nnodes, \
                             --node-rank and --master-addr instead"
                        ))
                    })
                })
                .transpose()
        };
        let Some(nodes) = number("SLURM_STEP_NUM_NODES")? else {
            return Ok(None);
        };
        if nodes < 2 {
            return Ok(None);
        }
        let tasks = number("SLURM_STEP_NUM_TASKS")?.unwrap_or(nodes);
        if tasks != nodes {
            return Err(Exit::usage(format!(
                "under srun with {tasks} tasks on {nodes} nodes: torchtools launch is one \
                 launcher per node, which starts the node's ranks: give srun \
                 --ntasks-per-node=1 (and launch --nproc-per-node N), or run the trainer \
                 itself as srun's tasks (it reads SLURM_PROCID)"
            )));
        }
        let node_rank = number("SLURM_NODEID")?.unwrap_or(0);
        let list = get("SLURM_STEP_NODELIST").unwrap_or_default();
        let host = tt_dist::first_host(&list).ok_or_else(|| {
            Exit::usage(format!(
                "SLURM_STEP_NODELIST={list:?} (from Slurm) names no node; give --master-addr"
            ))
        })?;
        // The same port on every node, different for jobs that share a first node.
        let port = match (self.master_port, get("MASTER_PORT")) {
            (Some(p), _) => p,
            (None, Some(p)) => p
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| Exit::usage(format!("MASTER_PORT={p:?} is not a port (1-65535)")))?,
            (None, None) => {
                let job = number("SLURM_JOB_ID")?.unwrap_or(0);
                let step = number("SLURM_STEP_ID")?.unwrap_or(0);
                20_000 + u16::try_from((job * 16 + step % 16) % 12_000).unwrap_or(0)
            }
        };
        Ok(Some(SlurmStep {
            nnodes: nodes,
            node_rank,
            host,
            port,
        }))
    }
}

/// The group's GPUs (`--gpu`), reserved before any rank starts, with the variables
/// every rank inherits them through (`CUDA_VISIBLE_DEVICES`, the held locks).
fn reserve_for(
    args: &Args,
    gpus: &[tt_lock::GpuSpec],
    cfg: &mut LaunchConfig,
) -> Result<tt_reserve::Reservation> {
    let auto = gpus.contains(&tt_lock::GpuSpec::Auto);
    // --bytes auto: one rank probed, through this launcher with one process,
    // so that it sees the variables it will run with.
    let probed: Vec<OsString> = match args.bytes {
        Some(crate::args::Budget::Auto) => {
            let exe = std::env::current_exe().context("finding this program")?;
            [exe.into(), "launch".into(), "--nproc-per-node".into()]
                .into_iter()
                .chain(["1".into(), "--".into(), cfg.program.clone()])
                .chain(cfg.args.iter().cloned())
                .collect()
        }
        _ => Vec::new(),
    };
    let bytes = crate::commands::reserve::budget(args.bytes, gpus, &args.probing, &probed)?;
    let request = crate::commands::reserve::Request {
        gpus: gpus.to_vec(),
        count: args
            .count
            .map(|c| c as usize)
            .or(auto.then_some(cfg.nproc_per_node)),
        bytes,
        margin: args.margin,
        fence: !args.no_fence,
        share: false,
        cap: false,
        timeout: args.timeout,
        limit: None, // the launcher's own (see `launch`)
        preemptible: args.time.preemptible,
        slurm_requeue: None,
        command: std::iter::once(cfg.program.clone())
            .chain(cfg.args.iter().cloned())
            .collect(),
    };
    let reservation = crate::commands::reserve::take(&request)?;
    if !reservation.is_empty() {
        cfg.env.push((
            "CUDA_VISIBLE_DEVICES".into(),
            reservation.cuda_visible_devices().into(),
        ));
    }
    // Every rank inherits the GPUs' locks (as `reserve`'s command does): they
    // stay held while any rank runs, even if this launcher is killed.
    let (value, fds) = tt_lock::inheritance(reservation.locks());
    cfg.env.push((tt_lock::HELD_LOCKS_ENV.into(), value.into()));
    cfg.inherit_fds = fds;
    Ok(reservation)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[derive(clap::Parser)]
    struct Line {
        #[command(flatten)]
        args: Args,
    }

    fn step(words: &[&str], vars: &[(&str, &str)]) -> std::result::Result<Option<SlurmStep>, Exit> {
        let line =
            Line::try_parse_from(["launch"].iter().chain(words).chain(&["--", "true"])).unwrap();
        line.args.slurm_step(|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn under_srun_the_nodes_are_the_steps() {
        let srun = [
            ("SLURM_STEP_NUM_NODES", "3"),
            ("SLURM_STEP_NUM_TASKS", "3"),
            ("SLURM_NODEID", "2"),
            ("SLURM_STEP_NODELIST", "gpu[07-08],cpu1"),
            ("SLURM_JOB_ID", "1234"),
            ("SLURM_STEP_ID", "1"),
        ];
        assert_eq!(
            step(&[], &srun).unwrap(),
            Some(SlurmStep {
                nnodes: 3,
                node_rank: 2,
                host: "gpu07".into(),
                port: 20_000 + (1234 * 16 + 1) % 12_000,
            })
        );
        let port = step(&["--master-port", "4242"], &srun).unwrap().unwrap();
        assert_eq!(port.port, 4242);
        let mut with_env = srun.to_vec();
        with_env.push(("MASTER_PORT", "5151"));
        assert_eq!(step(&[], &with_env).unwrap().unwrap().port, 5151);
        // The user's own node options win; one node, or no step, is not Slurm's.
        assert_eq!(
            step(&["--nnodes", "2", "--node-rank", "1"], &srun).unwrap(),
            None
        );
        assert_eq!(step(&["--standalone"], &srun).unwrap(), None);
        assert_eq!(step(&[], &srun[1..]).unwrap(), None);
        let one = [("SLURM_STEP_NUM_NODES", "1"), ("SLURM_STEP_NUM_TASKS", "1")];
        assert_eq!(step(&[], &one).unwrap(), None);
        // Two launchers a node, or a variable that is not a number: refused, saying why.
        let mut two_each = srun.to_vec();
        two_each[1] = ("SLURM_STEP_NUM_TASKS", "6");
        let e = step(&[], &two_each).unwrap_err();
        assert!(e.message.contains("--ntasks-per-node=1"), "{}", e.message);
        let mut junk = srun.to_vec();
        junk[2] = ("SLURM_NODEID", "x");
        let e = step(&[], &junk).unwrap_err();
        assert!(e.message.contains("SLURM_NODEID"), "{}", e.message);
        assert!(
            !e.message.contains("  "),
            "one space between words: {}",
            e.message
        );
        // A junk variable does not stand in the way of the user's own node options.
        let mut junk_nodes = srun.to_vec();
        junk_nodes[0] = ("SLURM_STEP_NUM_NODES", "2(x2)");
        assert!(step(&[], &junk_nodes).is_err());
        assert_eq!(
            step(&["--nnodes", "1", "--master-addr", "h"], &junk_nodes).unwrap(),
            None
        );
    }
}

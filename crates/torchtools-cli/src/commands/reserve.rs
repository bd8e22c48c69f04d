//! `torchtools reserve`, and the reservation `run` and `launch --gpu` take.

use std::ffi::OsString;
use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use tt_device::Bytes;
use tt_lock::{GpuSpec, Holder};
use tt_reserve::ReserveOptions;

use crate::arg_groups::{ReserveArgs, ReservingArgs};
use crate::child;
use crate::exit::Exit;

/// Reserve GPUs, then run a command on them.
///
/// Reserve GPU(s), then run a command on them: take each GPU's lock (waiting for
/// it), raise a memory fence that leaves --bytes free for the command, run it with
/// CUDA_VISIBLE_DEVICES set to the GPUs' UUIDs, and release everything when it ends.
///
/// The command inherits the locks: they are held as long as it or torchtools lives.
/// Exit status: the command's (128+N when killed by signal N); 75 when the GPUs stay
/// locked past --timeout; 127 when the command is not found; 2 for bad arguments.
#[derive(clap::Args)]
#[command(arg_required_else_help = true)]
// --bytes or --no-fence is required (checked where the request is made, whose
// message says why: a fence leaves free what --bytes says); the usage says so.
#[command(
    override_usage = "torchtools reserve (--bytes <BYTES> | --no-fence) [OPTIONS] -- <CMD>..."
)]
pub(crate) struct Args {
    /// Memory the command needs on each GPU: the fence leaves this much (plus
    /// --margin) free. Sizes: 6GiB, 512MiB, 6G, 1.5GB, bytes; or auto: probe the
    /// command first (it runs --probe-steps steps with TORCHTOOLS_PROBE=1, as `run
    /// --probe` does) and reserve what it used.
    #[arg(long, value_parser = crate::args::budget)]
    pub(crate) bytes: Option<crate::args::Budget>,
    #[command(flatten)]
    pub(crate) rest: ReservingArgs,
}

/// `torchtools reserve` (attached; `--detach` is decided before).
pub(crate) fn run(args: &Args) -> Result<u8> {
    let rest = &args.rest;
    let bytes = budget(
        args.bytes,
        &rest.reservation.gpu,
        &rest.probing,
        &rest.command,
    )?;
    reserve_for(rest, bytes)
}

/// Reserves what `args` ask for, leaving `bytes` free on each GPU, and runs the command
/// (attached): `reserve` and `run` once they know the bytes.
pub(crate) fn reserve_for(args: &ReservingArgs, bytes: Option<Bytes>) -> Result<u8> {
    let limit = args.reservation.time_limit()?;
    let slurm_requeue = args.detach.slurm_requeue()?;
    reserve(Request {
        slurm_requeue,
        ..args.reservation.request(bytes, args.command.clone(), limit)
    })
}

/// What `reserve` was asked for.
pub(crate) struct Request {
    pub(crate) gpus: Vec<GpuSpec>,
    pub(crate) count: Option<usize>,
    pub(crate) bytes: Option<Bytes>,
    pub(crate) margin: Bytes,
    pub(crate) fence: bool,
    pub(crate) share: bool,
    /// With `share`: cap the command's PyTorch allocator (`PYTORCH_CUDA_ALLOC_CONF`).
    pub(crate) cap: bool,
    pub(crate) timeout: Option<Duration>,
    /// The command's time limit (`--time`, or the policy's default).
    pub(crate) limit: Option<crate::limit::TimeLimit>,
    /// The policy may preempt it (`--preemptible`).
    pub(crate) preemptible: bool,
    /// The Slurm job to requeue when the command exits 75 (`--requeue` inside one).
    pub(crate) slurm_requeue: Option<String>,
    pub(crate) command: Vec<OsString>,
}

/// Returns the command's exit status (128 + N when killed by signal N).
pub(crate) fn reserve(req: Request) -> Result<u8> {
    let command_text: Vec<String> = req
        .command
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let mut reservation = take(&req)?;
    let mut cmd = Command::new(&req.command[0]);
    cmd.args(&req.command[1..]);
    reservation.prepare_with(&mut cmd, req.cap);
    if let Some(job) = &req.slurm_requeue {
        slurm_run_said(job);
        // The trainer only exits 75 (its `requeue_and_exit`): we requeue the job.
        cmd.env(tt_device::TORCHTOOLS_REQUEUES_SLURM_JOB, job);
    }
    let mut running = child::spawn(&mut cmd, &command_text[0])?;
    if let Err(e) = reservation.record_command_pid(running.pid()) {
        tracing::warn!("cannot record the command's pid: {e}");
    }
    if let Some(limit) = req.limit {
        running.limit(limit);
    }
    if req.preemptible && !reservation.is_empty() {
        let gpus = reservation.gpus().iter().map(|g| g.key.clone()).collect();
        running.preemptible(tt_lock::LockDir::from_env()?, gpus);
    }
    let ended = running.wait()?;
    if ended.timed_out {
        crate::limit::ended_by_limit(ended.code);
    }
    if ended.preempted {
        eprintln!(
            "torchtools: the command was preempted by the machine's policy ({})",
            crate::jobs::store::status_text(i32::from(ended.code))
        );
    }
    reservation.set_exit_status(i32::from(ended.code));
    // The reservation (fences, then locks) lives exactly as long as the command.
    drop(reservation);
    if let Some(job) = &req.slurm_requeue {
        slurm_requeue_after(job, i32::from(ended.code));
    }
    Ok(ended.code)
}

/// Says which run of the `--requeue`d Slurm job `job` this is, from its second on.
pub(crate) fn slurm_run_said(job: &str) {
    let restarts = tt_device::slurm_restart_count();
    if restarts > 0 {
        eprintln!(
            "torchtools: Slurm job {job}, run {} ({}={restarts})",
            restarts + 1,
            tt_device::SLURM_RESTART_COUNT
        );
    }
}

/// Requeues the Slurm job `job` when its command ended with `code` 75 (it can resume)
/// or died of SIGUSR1, Slurm's warning, before it could handle it (Python still
/// importing; its next run starts from its last checkpoint, if any): saying so first
/// (Slurm ends the job's processes as it requeues it), or saying why not.
pub(crate) fn slurm_requeue_after(job: &str, code: i32) {
    let why = if code == i32::from(crate::exit::TEMPFAIL) {
        "the command exited 75 (it can resume)"
    } else if code == 128 + libc::SIGUSR1 {
        "the command died of SIGUSR1 (Slurm's warning) before it could checkpoint"
    } else {
        return;
    };
    let said = tt_device::slurm_requeue_saying(job, || {
        eprintln!(
            "torchtools: {why}: {}",
            tt_device::slurm_requeuing_said(job)
        );
    });
    if let Err(e) = said {
        eprintln!("torchtools: {why}, but {e}");
    }
}

/// Takes the reservation `req` asks for (waiting in the queue), saying what it took;
/// the errors exit as `reserve` documents (75 still locked, 2 a bad request).
pub(crate) fn take(req: &Request) -> Result<tt_reserve::Reservation> {
    // (--share without --bytes: tt-reserve's own check says what to give.)
    if req.fence && !req.share && req.bytes.is_none() {
        return Err(Exit::usage(
            "a fence leaves free only what --bytes says the command needs: give --bytes \
             (e.g. --bytes 6GiB, or --bytes auto to measure it with a probe run), or \
             --no-fence to take the lock alone"
                .into(),
        )
        .into());
    }
    let command_text: Vec<String> = req
        .command
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let mut holder = Holder::current().running(command_text.clone());
    holder.preemptible = req.preemptible;
    if let Some(bytes) = req.bytes {
        holder = holder.reserving(bytes);
    }
    let options = ReserveOptions {
        gpus: req.gpus.clone(),
        count: req.count,
        training_reserved_bytes: req.bytes.unwrap_or_default(),
        safety_margin_bytes: req.margin,
        blocking: true,
        timeout: req.timeout,
        fence: req.fence,
        holder: Some(holder),
        share: req.share,
    };
    let reservation =
        tt_reserve::reserve_with(options, |w| eprintln!("torchtools: {w}")).map_err(|e| {
            if e.is_busy() {
                Exit::new(crate::exit::TEMPFAIL, e.to_string()).into()
            } else if e.is_bad_request() {
                // The options to look at, unless the message names them already.
                let said = e.to_string();
                let hint = match said.contains("--") {
                    true => "",
                    false => " (see --gpu and --count)",
                };
                Exit::usage(format!("{said}{hint}")).into()
            } else {
                anyhow::Error::from(e)
            }
        })?;
    if reservation.is_empty() {
        eprintln!("torchtools: no GPU on this machine: nothing reserved, running the command");
    } else if let (true, Some(bytes)) = (req.share, req.bytes) {
        for gpu in reservation.gpus() {
            eprintln!(
                "torchtools: sharing {} with a budget of {bytes} ({}; the command's PyTorch \
                 allocator {})",
                gpu.key,
                if req.fence {
                    "memory no sharer budgeted is fenced"
                } else {
                    "no fence"
                },
                if req.cap {
                    "is capped at it"
                } else {
                    "is not capped (--no-cap)"
                }
            );
        }
    } else {
        eprintln!(
            "torchtools: reserved {}",
            reservation
                .gpus()
                .iter()
                .map(|g| g.key.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    for fence in reservation.fences() {
        eprintln!("torchtools: {}", fence.report());
    }
    Ok(reservation)
}

impl ReserveArgs {
    /// The time limit these options and the machine's policy give (checked before
    /// anything starts).
    pub(crate) fn time_limit(&self) -> Result<Option<crate::limit::TimeLimit>> {
        self.time.resolve(crate::limit::machine_policy()?)
    }

    pub(crate) fn request(
        &self,
        bytes: Option<tt_device::Bytes>,
        command: Vec<std::ffi::OsString>,
        limit: Option<crate::limit::TimeLimit>,
    ) -> Request {
        Request {
            limit,
            preemptible: self.time.preemptible,
            gpus: self.gpu.clone(),
            count: self.count.map(|c| c as usize),
            bytes,
            margin: self.margin,
            fence: !self.no_fence,
            share: self.share,
            cap: !self.no_cap,
            timeout: self.timeout,
            slurm_requeue: None,
            command,
        }
    }
}

/// The bytes `--bytes` asks for: its size, or (`auto`) what a probe of `command` on
/// the first of `gpus` measured.
pub(crate) fn budget(
    bytes: Option<crate::args::Budget>,
    gpus: &[GpuSpec],
    probing: &crate::arg_groups::ProbeArgs,
    command: &[OsString],
) -> Result<Option<Bytes>> {
    Ok(match bytes {
        None => None,
        Some(crate::args::Budget::Size(b)) => Some(b),
        Some(crate::args::Budget::Auto) => Some(crate::commands::probe::estimate_for_run(
            gpus,
            probing,
            "--bytes auto",
            command,
        )?),
    })
}

//! The main job, run by `cargo xtask demo`: the whole toolkit on one small training job,
//! in six parts.
//!
//! 1. The device report: the device chosen, why, and the threads libtorch may use.
//! 2. A probe of the training step in a fresh process, and the reservation it leads to
//!    (a GPU lock and memory fence on a GPU; nothing to reserve on a CPU-only machine),
//!    shown as `torchtools locks` shows it.
//! 3. Training: a classifier on generated data (or MNIST's IDX files with `--idx DIR`)
//!    through the trainer with tt-optim's Adam, its out-of-memory-adaptive micro-batch with gradient
//!    accumulation (so the sampler's batches stay fixed; on the CPU under a memory limit
//!    small enough that the adaptation shows), a resource tracker around the run, and a
//!    checkpoint every few steps.
//! 4. An interruption: the training process is killed with SIGKILL mid-epoch, resumed
//!    from its latest checkpoint, and checked to end with the same parameters, bit for
//!    bit, as a run that was never interrupted.
//! 5. The same training as 2 DDP ranks under the launcher of `torchtools launch`,
//!    checked equal to one process training on the whole batch.
//! 6. A summary: the loss per step, the tracker's report, the checkpoints kept, and an
//!    SVG of the loss curve and the memory timeline.
//!
//! ```sh
//! cargo run --example demo -- [--quick] [--out DIR] [--idx DIR]
//! ```
//! `--quick` runs the same six parts on less data (what `cargo xtask test` runs);
//! `--out` (default `torchtools-demo` in the system's temporary directory) receives the
//! checkpoints, the tracker's timelines and the SVG. `TORCHTOOLS_DEVICE` picks the
//! device as everywhere in torchtools.

use std::error::Error;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use torchtools::adaptive::{address_space_in_use, set_cpu_memory_limit};
use torchtools::ckpt::CheckpointDir;
use torchtools::device::Bytes;
use torchtools::dist::{launch, LaunchConfig};
use torchtools::optim::{AdamConfig, Optimizer, SgdConfig};
use torchtools::probe::{BoxError, ProbeContext, ProbeOptions, Step};
use torchtools::reserve::Reservation;
use torchtools::tch::nn;
use torchtools::tch::{Device, Kind, Reduction, TchError, Tensor};
use torchtools::tracker::{RamUnit, Target, TimeUnit, Tracker, TrackerConfig};
use torchtools::train::{FitReport, LogRecord, RunStart, Steps, TrainConfig, Trainer};
use torchtools::{run_training_with_reservation, RunOptions};

type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

/// The features of a generated sample, the hidden width, the classes.
const FEATURES: i64 = 128;
const HIDDEN: i64 = 2048;
const CLASSES: i64 = 10;
/// Samples per optimizer step (the sampler's batch, split into micro-batches).
const BATCH: usize = 2048;

/// What the command line asked for.
#[derive(Debug, Clone)]
struct Args {
    quick: bool,
    out: PathBuf,
    idx: Option<PathBuf>,
    /// Internal: what a child process of the demo does (`train NAME`, `ddp`).
    role: Option<Vec<String>>,
    /// Internal: the micro-batch to start from (the reference run's).
    micro: Option<usize>,
}

impl Args {
    fn parse() -> Result<Args, String> {
        let usage = "usage: demo [--quick] [--out DIR] [--idx DIR]";
        let mut args = Args {
            quick: false,
            out: std::env::temp_dir().join("torchtools-demo"),
            idx: None,
            role: None,
            micro: None,
        };
        let mut it = std::env::args().skip(1);
        while let Some(a) = it.next() {
            let mut value = |name: &str| {
                it.next()
                    .ok_or_else(|| format!("{name} needs a value; {usage}"))
            };
            match a.as_str() {
                "--quick" => args.quick = true,
                "--out" => args.out = PathBuf::from(value("--out")?),
                "--idx" => args.idx = Some(PathBuf::from(value("--idx")?)),
                "--micro" => {
                    let v = value("--micro")?;
                    args.micro = Some(v.parse().map_err(|_| format!("--micro {v:?}"))?);
                }
                "--role" => {
                    let v = value("--role")?;
                    args.role = Some(v.split(':').map(str::to_owned).collect());
                }
                "-h" | "--help" => return Err(usage.into()),
                other => return Err(format!("unknown argument {other:?}; {usage}")),
            }
        }
        Ok(args)
    }

    /// Samples, epochs, checkpoint interval.
    fn size(&self) -> (u64, u64, u64) {
        if self.quick {
            (8192, 3, 3)
        } else {
            (16384, 3, 3)
        }
    }

    /// The arguments a child gets to see the same data.
    fn forward(&self) -> Vec<String> {
        let mut v = vec!["--out".into(), self.out.display().to_string()];
        if self.quick {
            v.push("--quick".into());
        }
        if let Some(idx) = &self.idx {
            v.extend(["--idx".into(), idx.display().to_string()]);
        }
        v
    }
}

fn main() -> ExitCode {
    // In the probe's child process this runs the probe and exits; here it returns.
    torchtools::probe::entry(&[("train_step", probe_step)]);
    // A bad TORCHTOOLS_LOG is an error before any work, as every other variable.
    if let Err(e) = torchtools::try_init_logging() {
        eprintln!("{}: {e}", env!("CARGO_CRATE_NAME"));
        std::process::exit(2);
    }
    let args = match Args::parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("demo: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match args
        .role
        .as_deref()
        .map(|r| r.iter().map(String::as_str).collect::<Vec<_>>())
    {
        None => main_job(&args),
        Some(role) => match role.as_slice() {
            ["train", name] => {
                // Only the training child sets a memory limit; nothing has started a
                // thread yet.
                exact_memory_accounting();
                train_child(&args, name)
            }
            ["ddp"] => ddp_child(&args),
            other => Err(format!("unknown role {other:?}").into()),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Makes the training's memory limit (`RLIMIT_AS`, below) count every allocation, so
/// that whether a micro-batch fits does not depend on timing. glibc's malloc otherwise
/// keeps slack the limit does not see: each thread's arena reserves 64 MiB of address
/// space up front, and an allocation the limit refuses is retried in such an arena,
/// where it may fit; and freed large blocks stay in the heap once the mmap threshold has
/// grown. One arena and a fixed threshold remove both. Called by the training child
/// before any thread exists.
fn exact_memory_accounting() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets malloc's parameters; no thread allocates yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
    }
}

// ---------------------------------------------------------------------------------------
// The data and the model, the same in every process.

/// The dataset: `(features, labels)`. Generated from fixed seeds (a random linear
/// teacher labels Gaussian samples), or read from MNIST's IDX files.
fn dataset(args: &Args, device: Device) -> Result<(Tensor, Tensor)> {
    let (samples, _, _) = args.size();
    let (x, y) = match &args.idx {
        Some(dir) => read_idx(dir, samples)?,
        None => {
            torchtools::tch::manual_seed(1234);
            let x = Tensor::randn([samples as i64, FEATURES], (Kind::Float, Device::Cpu));
            let teacher = Tensor::randn([FEATURES, CLASSES], (Kind::Float, Device::Cpu));
            let y = x.matmul(&teacher).argmax(1, false);
            (x, y)
        }
    };
    Ok((x.to_device(device), y.to_device(device)))
}

/// MNIST's `train-images-idx3-ubyte` and `train-labels-idx1-ubyte` from `dir`: the
/// first `samples` images, flattened and scaled to [0, 1], projected to `FEATURES`
/// by a fixed random matrix (so that the model is the same as for generated data).
fn read_idx(dir: &Path, samples: u64) -> Result<(Tensor, Tensor)> {
    let read = |name: &str, magic: u32| -> Result<(Vec<usize>, Vec<u8>)> {
        let path = dir.join(name);
        let bytes = std::fs::read(&path)
            .map_err(|e| format!("--idx: cannot read {}: {e}", path.display()))?;
        let word = |i: usize| -> Option<u32> {
            Some(u32::from_be_bytes(
                bytes.get(i * 4..i * 4 + 4)?.try_into().ok()?,
            ))
        };
        if word(0) != Some(magic) {
            return Err(
                format!("--idx: {} is not an IDX file of this kind", path.display()).into(),
            );
        }
        let dims = (magic & 0xff) as usize;
        let shape: Vec<usize> = (1..=dims)
            .map(|i| word(i).map(|d| d as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| format!("--idx: {} is truncated", path.display()))?;
        let data = bytes[(dims + 1) * 4..].to_vec();
        if data.len() != shape.iter().product::<usize>() {
            return Err(format!("--idx: {} is truncated", path.display()).into());
        }
        Ok((shape, data))
    };
    let (shape, images) = read("train-images-idx3-ubyte", 0x0803)?;
    let (_, labels) = read("train-labels-idx1-ubyte", 0x0801)?;
    let n = (samples as usize).min(shape[0]).min(labels.len());
    if n < BATCH {
        return Err(format!("--idx: {n} images, fewer than one batch of {BATCH}").into());
    }
    let pixels = shape[1] * shape[2];
    let x = Tensor::from_slice(&images[..n * pixels])
        .to_kind(Kind::Float)
        .view([n as i64, pixels as i64])
        / 255.0;
    torchtools::tch::manual_seed(1234);
    let projection = Tensor::randn([pixels as i64, FEATURES], (Kind::Float, Device::Cpu))
        / (pixels as f64).sqrt();
    let y = Tensor::from_slice(&labels[..n]).to_kind(Kind::Int64);
    Ok((x.matmul(&projection), y))
}

/// The classifier: FEATURES -> HIDDEN -> CLASSES.
struct Model {
    l1: nn::Linear,
    l2: nn::Linear,
}

impl Model {
    fn new(vs: &nn::VarStore) -> Model {
        torchtools::tch::manual_seed(0);
        let root = vs.root();
        Model {
            l1: nn::linear(&root / "l1", FEATURES, HIDDEN, Default::default()),
            l2: nn::linear(&root / "l2", HIDDEN, CLASSES, Default::default()),
        }
    }

    /// The summed loss of a chunk, with tch's fallible calls: an out-of-memory comes
    /// back as an error for tt-adaptive to retry smaller.
    fn loss_sum(&self, x: &Tensor, y: &Tensor) -> Result<Tensor, TchError> {
        x.f_linear(&self.l1.ws, self.l1.bs.as_ref())?
            .f_relu()?
            .f_linear(&self.l2.ws, self.l2.bs.as_ref())?
            .f_cross_entropy_loss::<Tensor>(y, None, Reduction::Sum, -100, 0.0)
    }
}

fn adam(vs: &nn::VarStore) -> Result<Optimizer> {
    Ok(Optimizer::adam(
        vs,
        AdamConfig {
            lr: 1e-3,
            ..AdamConfig::adam()
        },
    )?)
}

/// The probe: one training step of the real model at the real batch.
fn probe_step(ctx: &ProbeContext) -> Result<Step, BoxError> {
    let vs = nn::VarStore::new(ctx.device);
    let model = Model::new(&vs);
    let mut opt = adam(&vs).map_err(|e| e.to_string())?;
    let device = ctx.device;
    Ok(Box::new(move || {
        let x = Tensor::f_randn([BATCH as i64, FEATURES], (Kind::Float, device))?;
        let y = Tensor::f_randint(CLASSES, [BATCH as i64], (Kind::Int64, device))?;
        let loss = model.loss_sum(&x, &y)?;
        opt.zero_grad();
        loss.f_backward()?;
        opt.step().map_err(|e| e.to_string())?;
        Ok(())
    }))
}

/// A checksum of every parameter's bits, in name order.
fn checksum(vs: &nn::VarStore) -> Result<u64> {
    let mut named = vs.variables().into_iter().collect::<Vec<_>>();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut sum = 0u64;
    for (_, t) in named {
        for v in Vec::<f32>::try_from(t.to_device(Device::Cpu).flatten(0, -1))? {
            sum = sum.rotate_left(5) ^ u64::from(v.to_bits());
        }
    }
    Ok(sum)
}

// ---------------------------------------------------------------------------------------
// Part 3: the training process (run three times: killed, resumed, uninterrupted).

/// One training run in its own process, through the trainer: prints `micro-batch N`,
/// `saved step N` (once the checkpoint is durable), `loss STEP VALUE` and at the end
/// `checksum HEX`.
fn train_child(args: &Args, name: &str) -> Result<()> {
    torchtools::use_allowed_threads();
    let device = torchtools::device::select()?;
    let (_, epochs, every) = args.size();
    let (x, y) = dataset(args, device)?;
    let samples = x.size()[0] as u64;
    let dir = args.out.join(format!("checkpoints-{name}"));
    let resuming = !CheckpointDir::open(&dir)?.list()?.is_empty();
    // The micro-batch that fits is the trainer's to find, from the whole batch (or from
    // the one asked for), on the first step; a resumed run takes the checkpoint's, so
    // that it sums its gradients in the same order as the run it continues.
    let mut config = TrainConfig::new(samples, BATCH, epochs)
        .seed(7)
        .checkpoints(&dir, every)
        .keep_last(3)
        .log_every(1)
        .console(false)
        .adaptive_micro_batch(true);
    if let Some(m) = args.micro {
        config = config.accumulate(BATCH.div_ceil(m));
    }
    let mut trainer =
        Trainer::with_group(config, torchtools::dist::ProcessGroup::single(), device)?;
    let mut vs = nn::VarStore::new(device);
    let model = Model::new(&vs);
    let mut opt = adam(&vs)?;
    let tracker = Tracker::start(TrackerConfig {
        target: Target::Current,
        interval: Duration::from_millis(100),
        timeline: Some(args.out.join(format!("timeline-{name}.jsonl"))),
        overwrite: true,
        ram_unit: RamUnit::Megabytes,
        time_unit: TimeUnit::Seconds,
        ..TrackerConfig::default()
    })?;
    // Room for about half a batch's activations, not for a whole batch's, while the
    // micro-batch is searched (measured with the accounting of
    // `exact_memory_accounting`: a micro-batch of 2048 needs 48-56 MiB, 1024 needs
    // 28-32 MiB, 512 16-24 MiB, so the whole batch is refused by 16 MiB or more); 64 MiB
    // more once it is known, so that the allocator's later growth (checkpoint buffers, a
    // fragmented heap) does not fail a later step.
    const SEARCH_ROOM: u64 = 32 << 20;
    const KNOWN_ROOM: u64 = SEARCH_ROOM + (64 << 20);
    let mut relax = None;
    if device == Device::Cpu {
        // One small step first, so that libtorch's threads exist before the limit.
        let warm = model.loss_sum(&x.narrow(0, 0, 8), &y.narrow(0, 0, 8))?;
        warm.f_backward()?;
        opt.zero_grad();
        let base = address_space_in_use().ok_or("no VmSize in /proc/self/status")?;
        let known = resuming || args.micro.is_some();
        let room = if known { KNOWN_ROOM } else { SEARCH_ROOM };
        set_cpu_memory_limit(Some(base + room))?;
        println!(
            "memory limit: {} MiB above what the process maps (RLIMIT_AS)",
            room >> 20
        );
        relax = (!known).then_some(base + KNOWN_ROOM);
    }
    trainer.add_logger(Lines::new(resuming, relax));
    // A micro-batch's mean loss, every operation fallible: an out-of-memory comes back
    // as an error for the trainer to retry with a smaller micro-batch.
    let work = Steps::new(|ctx| -> Result<Tensor, TchError> {
        let idx: Vec<i64> = ctx.indices.iter().map(|&i| i as i64).collect();
        let idx = Tensor::from_slice(&idx).f_to_device(device)?;
        let (bx, by) = (x.f_index_select(0, &idx)?, y.f_index_select(0, &idx)?);
        model
            .loss_sum(&bx, &by)?
            .f_div_scalar(ctx.indices.len() as f64)
    });
    let report = trainer.fit(&mut vs, &mut opt, work);
    if device == Device::Cpu {
        set_cpu_memory_limit(None)?;
    }
    let report = report?;
    let usage = tracker.stop()?;
    std::fs::write(
        args.out.join(format!("tracker-{name}.txt")),
        usage.to_string(),
    )?;
    println!(
        "checksum {:016x} after {} steps",
        checksum(&vs)?,
        report.steps
    );
    Ok(())
}

/// The training child's lines for the parent, its progress bar, and the memory limit
/// raised once the micro-batch is known: a logger of the trainer.
struct Lines {
    resuming: bool,
    relax: Option<u64>,
    said_micro: bool,
    bar: Option<ProgressBar>,
}

impl Lines {
    fn new(resuming: bool, relax: Option<u64>) -> Lines {
        Lines {
            resuming,
            relax,
            said_micro: false,
            bar: None,
        }
    }
}

impl torchtools::train::Logger for Lines {
    fn on_start(&mut self, start: &RunStart) -> Result<(), BoxError> {
        if start.step > 0 {
            println!("resumed from the checkpoint of step {}", start.step);
        }
        let bar = ProgressBar::new(start.total_steps).with_position(start.step);
        bar.set_style(
            ProgressStyle::with_template("  training [{bar:30}] step {pos}/{len} {msg}")?
                .progress_chars("=> "),
        );
        self.bar = Some(bar);
        Ok(())
    }

    fn on_step(&mut self, _step: u64) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    fn on_log(&mut self, r: &LogRecord) -> Result<(), BoxError> {
        if let (Some(m), false) = (r.micro_batch, self.said_micro) {
            let whose = if self.resuming {
                "the checkpoint's"
            } else {
                "found by the trainer on the first step"
            };
            let per_step = BATCH.div_ceil(m);
            println!("micro-batch {m} ({whose}); {per_step} accumulated per step");
            self.said_micro = true;
        }
        if let Some(limit) = self.relax.take() {
            set_cpu_memory_limit(Some(limit))?;
        }
        println!("loss {} {}", r.step, r.loss);
        if let Some(bar) = &self.bar {
            let micro = r.micro_batch.map(|m| format!(", micro-batch {m}"));
            bar.set_message(format!("loss {:.4}{}", r.loss, micro.unwrap_or_default()));
        }
        std::io::stdout().flush()?;
        Ok(())
    }

    fn on_checkpoint(&mut self, step: u64, _path: &Path) -> Result<(), BoxError> {
        match &self.bar {
            Some(bar) => bar.suspend(|| println!("saved step {step}")),
            None => println!("saved step {step}"),
        }
        std::io::stdout().flush()?;
        Ok(())
    }

    fn on_finish(&mut self, _report: &FitReport) -> Result<(), BoxError> {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        Ok(())
    }
}

/// What a training child said.
#[derive(Default)]
struct Heard {
    losses: Vec<(u64, f64)>,
    checksum: Option<String>,
    micro: Option<usize>,
    killed_after: Option<u64>,
}

/// Runs the training child `name`; echoes its lines (but the losses), and kills it
/// with SIGKILL right after it reports the checkpoint of `kill_after_save` if given.
fn run_trainer(
    args: &Args,
    name: &str,
    micro: Option<usize>,
    kill_after_save: Option<u64>,
) -> Result<Heard> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(args.forward())
        .args(["--role", &format!("train:{name}")])
        .stdout(Stdio::piped());
    if let Some(m) = micro {
        cmd.args(["--micro", &m.to_string()]);
    }
    let mut child = cmd.spawn()?;
    let out = child.stdout.take().ok_or("no stdout")?;
    let mut heard = Heard::default();
    for line in BufReader::new(out).lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["loss", step, value] => {
                heard.losses.push((step.parse()?, value.parse()?));
                continue;
            }
            ["checksum", hex, ..] => heard.checksum = Some((*hex).to_owned()),
            ["micro-batch", m, ..] => heard.micro = m.parse().ok(),
            _ => {}
        }
        println!("    {line}");
        if let (["saved", "step", step], Some(at)) = (words.as_slice(), kill_after_save) {
            if step.parse::<u64>()? == at {
                child.kill()?; // SIGKILL
                heard.killed_after = Some(at);
                println!("    -- SIGKILL sent right after the checkpoint of step {at} --");
                break;
            }
        }
    }
    let status = child.wait()?;
    if heard.killed_after.is_some() {
        use std::os::unix::process::ExitStatusExt;
        if status.signal() != Some(9) {
            return Err(
                format!("the training was to die of SIGKILL, it ended with {status}").into(),
            );
        }
    } else if !status.success() {
        return Err(format!("the training run {name:?} failed ({status})").into());
    }
    Ok(heard)
}

// ---------------------------------------------------------------------------------------
// Part 5: the same training on 2 DDP ranks, and on one process.

/// One epoch with the unified trainer; the batch is split over the ranks. Rank 0
/// saves the parameters as `ddp-WORLD.safetensors`.
fn ddp_child(args: &Args) -> Result<()> {
    torchtools::use_allowed_threads();
    let world: usize = std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(1);
    let device = torchtools::device::select()?;
    let (x, y) = dataset(args, device)?;
    let samples = x.size()[0] as u64;
    let mut config = TrainConfig::new(samples, BATCH / world, 1).seed(7);
    config = config.log_every(1000);
    let mut trainer = Trainer::from_env(config)?;
    let mut vs = nn::VarStore::new(trainer.device());
    let model = Model::new(&vs);
    let (x, y) = (x.to_device(trainer.device()), y.to_device(trainer.device()));
    // SGD here: Adam's normalised steps would hide a wrongly averaged gradient (each
    // rank stepping on its own half moves the parameters almost as far).
    let mut opt = Optimizer::sgd(
        &vs,
        SgdConfig {
            lr: 0.02,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    let report = trainer.fit(
        &mut vs,
        &mut opt,
        Steps::new(|ctx| {
            let idx: Vec<i64> = ctx.indices.iter().map(|&i| i as i64).collect();
            let idx = Tensor::from_slice(&idx).to_device(ctx.device);
            let n = idx.size()[0] as f64;
            model
                .loss_sum(&x.index_select(0, &idx), &y.index_select(0, &idx))?
                .f_div_scalar(n)
        }),
    )?;
    if trainer.is_main() {
        vs.save(args.out.join(format!("ddp-{world}.safetensors")))?;
        println!(
            "{world} process(es): {} steps of {} samples each, last loss {:.4}",
            report.steps,
            BATCH / world,
            report.losses.last().map_or(f64::NAN, |l| l.1)
        );
    }
    Ok(())
}

/// The largest difference between the parameters two DDP runs saved.
fn largest_difference(a: &Path, b: &Path) -> Result<f64> {
    let a = Tensor::read_safetensors(a)?;
    let b: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(b)?.into_iter().collect();
    let mut largest = 0.0f64;
    for (name, t) in a {
        let other = b.get(&name).ok_or_else(|| format!("{name} missing"))?;
        largest = largest.max((&t - other).abs().max().double_value(&[]));
    }
    Ok(largest)
}

// ---------------------------------------------------------------------------------------
// The main job.

fn heading(n: u32, title: &str) {
    println!("\n== {n}. {title}");
}

fn main_job(args: &Args) -> Result<()> {
    heading(1, "the device");
    let budget = torchtools::use_allowed_threads();
    let report = torchtools::device::report();
    println!("{report}");
    println!("intra-op threads set to {budget}");
    let selection = report
        .selected
        .clone()
        .ok_or_else(|| report.error.clone().unwrap_or_else(|| "no device".into()))?;

    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("--out {}: cannot create it: {e}", args.out.display()))?;
    for stale in ["checkpoints-run", "checkpoints-reference"] {
        let dir = args.out.join(stale);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
    }

    heading(2, "probe and reservation");
    let options = RunOptions {
        probe: Some(("train_step".into(), ProbeOptions::default())),
        ..RunOptions::default()
    };
    run_training_with_reservation(
        |reservation, plan| -> Result<(), BoxError> {
            println!("probe of one training step (batch {BATCH}) in a fresh process, then: {plan}");
            let dir = torchtools::lock::LockDir::from_env().map_err(|e| e.to_string())?;
            let states = dir
                .status(&torchtools::device::Inventory::query())
                .map_err(|e| e.to_string())?;
            println!(
                "GPU locks in {} (as `torchtools locks` shows them):",
                dir.path().display()
            );
            if states.is_empty() {
                println!("  no GPU and no lock file: nothing to reserve on this machine");
            }
            for s in &states {
                println!("  {s}");
            }
            if !reservation.is_empty() {
                println!(
                    "reserved: {:?}, fenced {}",
                    reservation.gpus(),
                    reservation.fenced()
                );
                // The training processes below run on the reserved GPU, and only there
                // (on a machine of several GPUs, `auto` would pick the freest one:
                // never the one the fence fills).
                std::env::set_var("CUDA_VISIBLE_DEVICES", reservation.cuda_visible_devices());
            }
            let device = match selection.device {
                torchtools::device::Device::Cuda(_) if !reservation.is_empty() => "cuda:0".into(),
                other => other.to_string(),
            };
            training(args, &device, reservation, plan.reserved).map_err(|e| e.to_string().into())
        },
        options,
    )?;
    Ok(())
}

/// Parts 3 to 6, under the reservation (`reserved`: the bytes its fence leaves free,
/// when it holds a GPU).
fn training(
    args: &Args,
    device: &str,
    reservation: &mut Reservation,
    reserved: Option<Bytes>,
) -> Result<()> {
    let (samples, epochs, every) = args.size();
    let per_epoch = samples.div_ceil(BATCH as u64);
    // Killed in the second epoch, after a checkpoint, steps after it lost.
    let kill_at = (per_epoch + 1).div_ceil(every) * every;

    heading(3, "training");
    println!(
        "{samples} samples, batches of {BATCH}, {epochs} epochs on {device}; Adam (tt-optim); \
         checkpoint every {every} steps; tracker every 100 ms"
    );
    let first = run_trainer(args, "run", None, Some(kill_at))?;

    heading(4, "interruption and resume");
    println!("  killed after the checkpoint of step {kill_at} (epoch 2 of {epochs}); resuming");
    let resumed = run_trainer(args, "run", None, None)?;
    let micro = first.micro.or(resumed.micro);
    println!("  and a run that is never interrupted, for comparison:");
    let reference = run_trainer(args, "reference", micro, None)?;
    let (a, b) = (
        resumed
            .checksum
            .clone()
            .ok_or("the resumed run gave no checksum")?,
        reference
            .checksum
            .clone()
            .ok_or("the reference run gave no checksum")?,
    );
    if a != b {
        return Err(format!(
            "the resumed run ends with other parameters than the uninterrupted one ({a} vs {b})"
        )
        .into());
    }
    println!("  check: the resumed run's parameters are bit for bit the uninterrupted run's (checksum {a})");

    ddp(args, device, reservation, reserved)?;
    summary(args, &reference)
}

/// Part 5: the same training on 2 DDP ranks (Gloo, both on `device`), which must end
/// where one process does.
fn ddp(
    args: &Args,
    device: &str,
    reservation: &mut Reservation,
    reserved: Option<Bytes>,
) -> Result<()> {
    heading(5, "the same training on 2 DDP ranks");
    let exe = std::env::current_exe()?;
    let mut ddp_args: Vec<std::ffi::OsString> =
        args.forward().into_iter().map(Into::into).collect();
    ddp_args.extend(["--role".into(), "ddp".into()]);
    if let Some(bytes) = reserved {
        // The fence was sized for one training process; the second rank needs as much
        // again, so the reservation hands that much back (the Python torchtools'
        // release of reserved memory). Both ranks share the reserved GPU, with Gloo:
        // NCCL needs a GPU per rank.
        let freed = reservation.release_fence(bytes)?;
        println!(
            "  the fence hands back {freed} for the second rank; both ranks on {device} (Gloo)"
        );
    }
    let single = Command::new(&exe)
        .args(&ddp_args)
        .env_remove("WORLD_SIZE")
        .env_remove("RANK")
        .env_remove("LOCAL_RANK")
        .status()?;
    if !single.success() {
        return Err(format!("the one-process run failed ({single})").into());
    }
    let outcome = launch(&LaunchConfig::local(2, &exe, ddp_args))?;
    if outcome.code != 0 {
        return Err(format!("the 2-rank run failed (status {})", outcome.code).into());
    }
    let diff = largest_difference(
        &args.out.join("ddp-1.safetensors"),
        &args.out.join("ddp-2.safetensors"),
    )?;
    if diff > 1e-5 {
        return Err(format!("2 ranks end {diff:e} away from one process").into());
    }
    println!("  check: 2 ranks on {device} x {} samples end where 1 process x {BATCH} does (largest difference {diff:.1e})", BATCH / 2);

    Ok(())
}

/// Part 6: the uninterrupted run's losses, its tracker report, the checkpoints kept,
/// the loss curve and memory timeline.
fn summary(args: &Args, reference: &Heard) -> Result<()> {
    heading(6, "summary");
    let losses = &reference.losses;
    println!("loss per step (uninterrupted run; the interrupted one is the same):");
    for chunk in losses.chunks(6) {
        let cells: Vec<String> = chunk
            .iter()
            .map(|(s, l)| format!("{s:>3}: {l:.4}"))
            .collect();
        println!("  {}", cells.join("   "));
    }
    let report = args.out.join("tracker-reference.txt");
    println!(
        "\nthe tracker's report of that run ({}), its first lines:",
        report.display()
    );
    let text = std::fs::read_to_string(&report)?;
    for line in text.lines().take(12) {
        println!("  {line}");
    }
    let ckpts = args.out.join("checkpoints-run");
    let mut kept: Vec<String> = std::fs::read_dir(&ckpts)?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| {
            let size = e.metadata().map_or(0, |m| m.len());
            format!("{} ({} KiB)", e.file_name().to_string_lossy(), size >> 10)
        })
        .collect();
    kept.sort();
    println!(
        "\ncheckpoints kept in {}: {}",
        ckpts.display(),
        kept.join(", ")
    );
    let svg = args.out.join("demo.svg");
    std::fs::write(
        &svg,
        plot(
            losses,
            &memory_timeline(&args.out.join("timeline-reference.jsonl"))?,
        ),
    )?;
    println!("loss curve and memory timeline: {}", svg.display());
    Ok(())
}

/// (seconds since the start, RSS in megabytes: the tracker's unit here) from a
/// tracker timeline.
fn memory_timeline(path: &Path) -> Result<Vec<(f64, f64)>> {
    let mut points = Vec::new();
    let mut t0 = None;
    for line in std::fs::read_to_string(path)?.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(t), Some(ram)) = (v["timestamp"].as_f64(), v["main_ram"].as_f64()) else {
            continue;
        };
        let t0 = *t0.get_or_insert(t);
        points.push((t - t0, ram));
    }
    Ok(points)
}

/// Two panels: the loss per step, and the memory over time.
fn plot(losses: &[(u64, f64)], memory: &[(f64, f64)]) -> String {
    fn panel(x0: f64, title: &str, xlabel: &str, points: &[(f64, f64)], from_zero: bool) -> String {
        let (w, h) = (360.0, 220.0);
        let (xmin, xmax) = points
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let (ymin, ymax) = points
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
        let ymin = if from_zero { 0.0 } else { ymin };
        let sx = |x: f64| x0 + 50.0 + (x - xmin) / (xmax - xmin).max(1e-12) * w;
        let sy = |y: f64| 40.0 + h - (y - ymin) / (ymax - ymin).max(1e-12) * h;
        let path: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        format!(
            r##"<text x="{tx}" y="25" font-size="14">{title}</text>
<rect x="{rx}" y="40" width="{w}" height="{h}" fill="none" stroke="#999"/>
<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{pts}"/>
<text x="{rx}" y="{by}" font-size="11">{xmin:.0}</text><text x="{ex}" y="{by}" font-size="11" text-anchor="end">{xmax:.1} {xlabel}</text>
<text x="{lx}" y="45" font-size="11" text-anchor="end">{ymax:.2}</text><text x="{lx}" y="{bot}" font-size="11" text-anchor="end">{ymin:.2}</text>
"##,
            tx = x0 + 50.0,
            rx = x0 + 50.0,
            pts = path.join(" "),
            by = 40.0 + h + 15.0,
            ex = x0 + 50.0 + w,
            lx = x0 + 46.0,
            bot = 40.0 + h,
        )
    }
    let losses: Vec<(f64, f64)> = losses.iter().map(|&(s, l)| (s as f64, l)).collect();
    format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="860" height="290" font-family="sans-serif">
{}{}</svg>
"#,
        panel(0.0, "training loss per step", "step", &losses, false),
        panel(430.0, "RSS of the training process (MB)", "s", memory, true),
    )
}

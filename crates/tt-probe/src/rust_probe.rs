//! Feature `tch`: probes written in Rust, run in a re-executed child.

use std::error::Error as StdError;
use std::ffi::OsString;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::process::Command;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tch::nn;
use tch::{Device, Kind, Tensor};
use tt_device::Bytes;
use tt_optim::{AdamConfig, Algorithm, Optimizer, Schedule};

use crate::child::{self, Options, REPORT_FD_ENV};
use crate::command::{failure, PROBE_STEPS_ENV};
use crate::{MemoryKind, ProbeError, ProbeReport, Result};

/// The variable that makes a re-executed binary run a probe (its value: the name).
pub const PROBE_RUN_ENV: &str = "TORCHTOOLS_PROBE_RUN";

/// Exit status of a probe child whose probe ran out of memory.
const EXIT_OOM: i32 = 4;
/// Exit status of a probe child whose probe failed otherwise.
const EXIT_FAILED: i32 = 3;

/// A boxed error, as probes return them.
pub type BoxError = Box<dyn StdError + Send + Sync>;

/// One training step of a probe.
pub type Step = Box<dyn FnMut() -> std::result::Result<(), BoxError>>;

/// Sets a probe up on `ctx.device` (model, optimizer, data) and returns its step.
pub type ProbeFn = fn(&ProbeContext) -> std::result::Result<Step, BoxError>;

/// What a probe is given.
#[derive(Debug, Clone)]
pub struct ProbeContext {
    /// The device chosen by tt-device (`TORCHTOOLS_DEVICE`, `CUDA_VISIBLE_DEVICES`).
    pub device: Device,
    /// Steps that will be run.
    pub steps: u64,
    /// The batch size asked for ([`ProbeOptions::batch`], by [`crate::max_batch`]);
    /// `None`: the probe's own.
    pub batch: Option<u64>,
}

/// How to run a Rust probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeOptions {
    /// Steps (forward + backward + optimizer step each); default 5.
    pub steps: u64,
    /// The child is killed after this long (default 60 s, as the Python torchtools' probe).
    pub timeout: Duration,
    /// `TORCHTOOLS_DEVICE` for the child (default: inherited).
    pub device: Option<String>,
    /// The batch size the probe is asked to use (its [`ProbeContext::batch`]).
    pub batch: Option<u64>,
    /// Arguments of the re-executed binary: none for a program whose `main` calls
    /// [`entry`]; for a test, see [`ProbeOptions::in_test`].
    pub child_args: Vec<OsString>,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            steps: 5,
            timeout: Duration::from_secs(60),
            device: None,
            batch: None,
            child_args: Vec::new(),
        }
    }
}

impl ProbeOptions {
    /// Under `cargo test`, libtest owns `main`: the child re-runs the test binary with
    /// `--exact <test> --include-ignored`, and that test calls [`entry`] (which then
    /// never returns). Mark that test `#[ignore = "..."]` so that a normal run does
    /// not count it as a test that passed.
    pub fn in_test(test: &str) -> ProbeOptions {
        ProbeOptions {
            child_args: [
                "--exact",
                test,
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ]
            .iter()
            .map(OsString::from)
            .collect(),
            ..ProbeOptions::default()
        }
    }
}

/// What the child sends back.
#[derive(Serialize, Deserialize)]
struct ChildReport {
    memory: MemoryKind,
    device: String,
    peak_allocated: Option<Bytes>,
    peak_reserved: Option<Bytes>,
    rss_peak: Option<Bytes>,
    steps: u64,
    seconds: f64,
}

/// Call this first in `main` (and in the test named by [`ProbeOptions::in_test`]) with
/// every probe the program runs. In the probe child it runs the named probe, reports
/// to the parent and exits; anywhere else it returns at once.
///
/// ```no_run
/// fn tiny(ctx: &tt_probe::ProbeContext) -> Result<tt_probe::Step, tt_probe::BoxError> {
///     let device = ctx.device;
///     Ok(Box::new(move || {
///         let x = tch::Tensor::f_ones([1024, 1024], (tch::Kind::Float, device))?;
///         let _ = x.f_matmul(&x)?;
///         Ok(())
///     }))
/// }
///
/// fn main() -> Result<(), Box<dyn std::error::Error>> {
///     tt_probe::entry(&[("tiny", tiny)]);
///     let report = tt_probe::probe("tiny", &tt_probe::ProbeOptions::default())?;
///     println!("{report}; reserve {}", report.estimate(&Default::default()));
///     Ok(())
/// }
/// ```
pub fn entry(probes: &[(&str, ProbeFn)]) {
    let Ok(name) = std::env::var(PROBE_RUN_ENV) else {
        return;
    };
    let code = match run_in_child(&name, probes) {
        Ok(()) => 0,
        Err((code, message)) => {
            eprintln!("tt-probe: probe {name:?}: {message}");
            code
        }
    };
    let _ = std::io::stderr().flush();
    std::process::exit(code);
}

/// Runs `f`, its panic turned into an error carrying the panic's message: tch's plain
/// calls panic on any libtorch error, an out-of-memory included, which must then be
/// reported as one (by the classifier) and not as a crash.
fn unpanic<T>(
    f: impl FnOnce() -> std::result::Result<T, BoxError>,
) -> std::result::Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Err(format!("panicked: {message}"))
        }
    }
}

/// What the parent told the probe's child through its environment: the steps to run,
/// the report's descriptor, the batch size asked for.
fn child_env() -> std::result::Result<(u64, i32, Option<u64>), (i32, String)> {
    let steps: u64 = std::env::var(PROBE_STEPS_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let fd: i32 = std::env::var(REPORT_FD_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or((
            EXIT_FAILED,
            format!("{REPORT_FD_ENV} is not set: run probes through tt_probe::probe"),
        ))?;
    let batch = match std::env::var(crate::PROBE_BATCH_ENV) {
        Ok(text) => Some(text.parse::<u64>().map_err(|_| {
            (
                EXIT_FAILED,
                format!("{}={text:?} is not a batch size", crate::PROBE_BATCH_ENV),
            )
        })?),
        Err(_) => None,
    };
    Ok((steps, fd, batch))
}

fn run_in_child(name: &str, probes: &[(&str, ProbeFn)]) -> std::result::Result<(), (i32, String)> {
    let fail = |e: &dyn std::fmt::Display| {
        let text = e.to_string();
        let code = if tt_adaptive::classify_message(&text).is_some() {
            EXIT_OOM
        } else {
            EXIT_FAILED
        };
        (code, text)
    };
    let Some((_, f)) = probes.iter().find(|(n, _)| *n == name) else {
        let known: Vec<&str> = probes.iter().map(|(n, _)| *n).collect();
        return Err((
            EXIT_FAILED,
            format!("no probe of that name; known: {known:?}"),
        ));
    };
    let (steps, fd, batch) = child_env()?;
    let device = tt_device::select().map_err(|e| fail(&e))?;
    let cuda = match device {
        Device::Cuda(i) => Some(i),
        _ => None,
    };
    let me = std::process::id();
    let rss_before = tt_tracker::process::memory(me).map_or(0, |(rss, _)| rss);
    match cuda {
        Some(i) => tt_sys::reset_peak_stats(i).map_err(|e| fail(&e))?,
        None => {
            tt_tracker::process::reset_peak(me);
        }
    }
    let start = Instant::now();
    let ctx = ProbeContext {
        device,
        steps,
        batch,
    };
    let mut step = unpanic(|| f(&ctx)).map_err(|e| fail(&e))?;
    for _ in 0..steps {
        unpanic(&mut step).map_err(|e| fail(&e))?;
    }
    if let Some(i) = cuda {
        tch::Cuda::synchronize(i as i64);
    }
    let seconds = start.elapsed().as_secs_f64();
    let report = match cuda {
        Some(i) => {
            let stats = tt_sys::device_stats(i).map_err(|e| fail(&e))?;
            let uuid = tt_device::CudaDriver::init()
                .and_then(|d| d.uuid(i))
                .unwrap_or_default();
            ChildReport {
                memory: MemoryKind::Gpu,
                device: format!("cuda:{i} ({uuid})"),
                peak_allocated: Some(Bytes(stats.allocated_bytes.peak)),
                peak_reserved: Some(Bytes(stats.reserved_bytes.peak)),
                rss_peak: None,
                steps,
                seconds,
            }
        }
        None => ChildReport {
            memory: MemoryKind::Cpu,
            device: format!("{device:?}").to_lowercase(),
            peak_allocated: None,
            peak_reserved: None,
            rss_peak: Some(Bytes(
                tt_tracker::process::memory(me)
                    .map_or(0, |(_, hwm)| hwm)
                    .saturating_sub(rss_before),
            )),
            steps,
            seconds,
        },
    };
    let json = serde_json::to_vec(&report).map_err(|e| fail(&e))?;
    // SAFETY: the fd was inherited from the parent for exactly this; we own it now.
    let mut out = unsafe { std::fs::File::from_raw_fd(fd) };
    out.write_all(&json).map_err(|e| fail(&e))?;
    Ok(())
}

/// Runs the probe `name` (in the table given to [`entry`]) in a fresh child: this
/// binary re-executed, so that nothing of this process (its CUDA context, its cached
/// memory) is counted. Errors carry the child's exit status and the tail of its stderr;
/// the child is killed after the timeout.
pub fn probe(name: &str, opts: &ProbeOptions) -> Result<ProbeReport> {
    let exe = std::env::current_exe().map_err(|e| ProbeError::Spawn {
        what: name.to_owned(),
        reason: format!("cannot find this executable to re-run it: {e}"),
    })?;
    let mut cmd = Command::new(exe);
    cmd.args(&opts.child_args)
        .env(PROBE_RUN_ENV, name)
        .env(PROBE_STEPS_ENV, opts.steps.to_string());
    if let Some(d) = &opts.device {
        cmd.env("TORCHTOOLS_DEVICE", d);
    }
    if let Some(batch) = opts.batch {
        cmd.env(crate::PROBE_BATCH_ENV, batch.to_string());
    }
    let ended = child::run(
        cmd,
        name,
        &Options {
            timeout: opts.timeout,
            report_pipe: true,
            echo_stderr: false,
            quiet_stdout: true,
        },
    )?;
    if ended.timed_out {
        return Err(ProbeError::Timeout {
            limit: opts.timeout,
            stderr_tail: ended.stderr_tail,
        });
    }
    if ended.code == Some(EXIT_OOM) {
        let message = ended
            .stderr_tail
            .lines()
            .rev()
            .find(|l| l.starts_with("tt-probe:"))
            .unwrap_or("out of memory")
            .to_owned();
        return Err(ProbeError::OutOfMemory {
            reason: message,
            stderr_tail: ended.stderr_tail,
        });
    }
    if let Some(e) = failure(&ended) {
        return Err(e);
    }
    let child: ChildReport =
        serde_json::from_slice(&ended.report).map_err(|_| ProbeError::NoReport {
            hint: format!(
            "call tt_probe::entry(&[(\"{name}\", ...)]) first in main (under cargo test: in the \
             test that ProbeOptions::in_test names)"
        ),
            stderr_tail: ended.stderr_tail.clone(),
        })?;
    let nvml = ended.usage.as_ref().map_or(0.0, |u| u.max_gpu_ram.combined);
    Ok(ProbeReport {
        memory: child.memory,
        device: child.device,
        peak_allocated: child.peak_allocated,
        peak_reserved: child.peak_reserved,
        nvml_peak: (nvml > 0.0).then_some(Bytes(nvml as u64)),
        rss_peak: child.rss_peak,
        steps: child.steps,
        duration: Duration::from_secs_f64(child.seconds),
        ended_by_timeout: false,
        command: false,
    })
}

/// The loss of a [`ProbeSpec`].
#[derive(Debug, Clone, Copy)]
pub enum Loss {
    /// Cross-entropy over logits against class indices in `0..classes`.
    CrossEntropy {
        /// Number of classes.
        classes: i64,
    },
    /// Mean squared error against a target of the output's shape.
    Mse,
}

/// Builds a model's variables under a `VarStore` path.
type ModelFn = Box<dyn Fn(&nn::Path) -> Box<dyn nn::ModuleT>>;

/// A probe built from parts (the Python torchtools' `make_probe_fn`): a model on a `VarStore`, a
/// batch of a given shape (random inputs), a loss and an optimizer. Each step is
/// forward (train mode) + backward + optimizer step, so activations, gradients and
/// optimizer state are all counted — the Python original ran eval mode and never
/// stepped an optimizer.
pub struct ProbeSpec {
    model: ModelFn,
    input: Vec<i64>,
    loss: Loss,
    algorithm: Algorithm,
}

impl ProbeSpec {
    /// A probe of the model `build` makes (e.g. `|p| Box::new(nn::seq_t().add(...))`),
    /// on batches of shape `input` (first dimension: the batch size, replaced by
    /// [`ProbeContext::batch`] when the probe is asked for one), with
    /// cross-entropy over 10 classes and Adam (`AdamConfig::adam()`, lr 1e-3) until
    /// told otherwise.
    pub fn new(
        build: impl Fn(&nn::Path) -> Box<dyn nn::ModuleT> + 'static,
        input: impl Into<Vec<i64>>,
    ) -> ProbeSpec {
        ProbeSpec {
            model: Box::new(build),
            input: input.into(),
            loss: Loss::CrossEntropy { classes: 10 },
            algorithm: Algorithm::Adam(AdamConfig::adam()),
        }
    }

    /// The loss.
    pub fn loss(mut self, loss: Loss) -> ProbeSpec {
        self.loss = loss;
        self
    }

    /// The optimizer, as training configures it: tt-optim's [`Algorithm`] (SGD with
    /// momentum keeps one buffer per parameter, Adam / AdamW two, AMSGrad three), so
    /// the probe measures the state the training run will hold.
    pub fn optimizer(mut self, algorithm: Algorithm) -> ProbeSpec {
        self.algorithm = algorithm;
        self
    }

    /// Builds the model, the optimizer and a batch on `ctx.device`; returns the step.
    pub fn build(self, ctx: &ProbeContext) -> std::result::Result<Step, BoxError> {
        let device = ctx.device;
        let vs = nn::VarStore::new(device);
        let model = (self.model)(&vs.root());
        let mut opt = Optimizer::new(&vs, self.algorithm, Schedule::Constant)?;
        let mut input = self.input;
        if let (Some(b), Some(first)) = (ctx.batch, input.first_mut()) {
            *first = i64::try_from(b)?;
        }
        let x = Tensor::f_randn(input.as_slice(), (Kind::Float, device))?;
        let batch = input.first().copied().unwrap_or(1);
        let loss = self.loss;
        let mut target: Option<Tensor> = match loss {
            Loss::CrossEntropy { classes } => {
                Some(Tensor::f_randint(classes, [batch], (Kind::Int64, device))?)
            }
            Loss::Mse => None,
        };
        Ok(Box::new(move || {
            let _keep = &vs;
            opt.zero_grad();
            let out = model.forward_t(&x, true);
            let l = match loss {
                Loss::CrossEntropy { .. } => {
                    let t = target.as_ref().ok_or("no target")?;
                    out.f_cross_entropy_loss::<Tensor>(t, None, tch::Reduction::Mean, -100, 0.0)?
                }
                Loss::Mse => {
                    if target.is_none() {
                        target = Some(out.f_zeros_like()?);
                    }
                    let t = target.as_ref().ok_or("no target")?;
                    out.f_mse_loss(t, tch::Reduction::Mean)?
                }
            };
            opt.backward_step(&l)?;
            Ok(())
        }))
    }
}

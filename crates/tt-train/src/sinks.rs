//! Where a run's numbers go: the [`Logger`] trait and its implementations (the console
//! with its progress bar, JSON Lines, TensorBoard, the SVG loss curve).

use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::tensorboard::EventWriter;
use crate::work::BoxError;
use crate::{FitOutcome, FitReport};

/// The start of a run, as loggers see it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RunStart {
    /// Steps already done (the checkpoint's, when resumed; else 0).
    pub step: u64,
    /// Steps the run has in all, resumes included.
    pub total_steps: u64,
    /// Processes training together.
    pub world_size: usize,
}

/// The numbers of one log step (every [`TrainConfig::log_every`](crate::TrainConfig::log_every)
/// steps and when stopping).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct LogRecord {
    /// Steps finished.
    pub step: u64,
    /// The epoch.
    pub epoch: u64,
    /// The loss averaged over the ranks and the steps since the last record.
    pub loss: f64,
    /// The learning rate of the last step.
    pub lr: f64,
    /// The gradients' norm before clipping, when clipping.
    pub grad_norm: Option<f64>,
    /// Samples of all ranks per second since the last record.
    pub samples_per_s: f64,
    /// The micro-batch's samples, when the trainer found it
    /// ([`TrainConfig::adaptive_micro_batch`](crate::TrainConfig::adaptive_micro_batch)).
    pub micro_batch: Option<usize>,
}

/// The result of one evaluation.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct EvalRecord {
    /// Steps finished.
    pub step: u64,
    /// The epoch.
    pub epoch: u64,
    /// The metric averaged over every held-out sample of every rank.
    pub value: f64,
    /// Whether it is the best so far (its checkpoint is kept in `<dir>/best`).
    pub improved: bool,
}

/// Somewhere a run's numbers go, called on rank 0 (whose numbers are those of all
/// ranks: the loss and evaluations are averaged over them). An error is a warning that
/// names the logger: the training goes on.
///
/// The trainer's own loggers implement it ([`Console`], [`JsonLines`],
/// [`TensorBoard`], [`LossCurve`]: the configuration's options make them); add your
/// own with [`Trainer::add_logger`](crate::Trainer::add_logger):
///
/// ```
/// use tt_train::{BoxError, LogRecord, Logger};
///
/// /// Keeps the losses for a plot of its own.
/// #[derive(Default)]
/// struct Losses(Vec<(u64, f64)>);
///
/// impl Logger for Losses {
///     fn on_log(&mut self, record: &LogRecord) -> Result<(), BoxError> {
///         self.0.push((record.step, record.loss));
///         Ok(())
///     }
/// }
/// ```
pub trait Logger {
    /// The run starts (after the resume).
    fn on_start(&mut self, start: &RunStart) -> Result<(), BoxError> {
        let _ = start;
        Ok(())
    }

    /// A step finished (`step` steps done): keep it cheap, it runs every step.
    fn on_step(&mut self, step: u64) {
        let _ = step;
    }

    /// A log step's numbers.
    fn on_log(&mut self, record: &LogRecord) -> Result<(), BoxError>;

    /// An evaluation's result.
    fn on_eval(&mut self, record: &EvalRecord) -> Result<(), BoxError> {
        let _ = record;
        Ok(())
    }

    /// Checkpoint `step` is durable at `path` (periodic checkpoints are written in the
    /// background: each is reported when the trainer next waits for it, at the next
    /// checkpoint or the end).
    fn on_checkpoint(&mut self, step: u64, path: &Path) -> Result<(), BoxError> {
        let _ = (step, path);
        Ok(())
    }

    /// The run ended (finished or preempted; its last checkpoint written).
    fn on_finish(&mut self, report: &FitReport) -> Result<(), BoxError> {
        let _ = report;
        Ok(())
    }

    /// The logger's name in warnings.
    fn name(&self) -> String {
        std::any::type_name::<Self>().to_owned()
    }
}

/// The run's loggers: a failure is a warning naming the logger.
#[derive(Default)]
pub(crate) struct Sinks<'a> {
    loggers: Vec<Box<dyn Logger + Send>>,
    user: Option<&'a mut Vec<Box<dyn Logger + Send>>>,
}

impl<'a> Sinks<'a> {
    /// The trainer's own loggers as the configuration asks, then the user's.
    pub(crate) fn new(
        own: Vec<Box<dyn Logger + Send>>,
        user: &'a mut Vec<Box<dyn Logger + Send>>,
    ) -> Sinks<'a> {
        Sinks {
            loggers: own,
            user: Some(user),
        }
    }

    fn each(&mut self, what: &str, mut call: impl FnMut(&mut dyn Logger) -> Result<(), BoxError>) {
        let user = self.user.iter_mut().flat_map(|u| u.iter_mut());
        for logger in self.loggers.iter_mut().chain(user) {
            if let Err(e) = call(logger.as_mut()) {
                tracing::warn!("the logger {} failed {what}: {e}", logger.name());
            }
        }
    }

    pub(crate) fn start(&mut self, start: &RunStart) {
        self.each("at the start", |l| l.on_start(start));
    }

    pub(crate) fn step(&mut self, step: u64) {
        self.each("after a step", |l| {
            l.on_step(step);
            Ok(())
        });
    }

    pub(crate) fn log(&mut self, record: &LogRecord) {
        self.each("at a log step", |l| l.on_log(record));
    }

    pub(crate) fn eval(&mut self, record: &EvalRecord) {
        self.each("after an evaluation", |l| l.on_eval(record));
    }

    pub(crate) fn checkpoint(&mut self, step: u64, path: &Path) {
        self.each("after a checkpoint", |l| l.on_checkpoint(step, path));
    }

    pub(crate) fn finish(&mut self, report: &FitReport) {
        self.each("at the end", |l| l.on_finish(report));
    }
}

/// Log lines through `tracing` (`training`, `evaluation`) and, when standard error is
/// a terminal, a progress bar: steps done of all, the last loss and evaluation, speed
/// and time left (the lines print above it).
#[derive(Debug, Default)]
pub struct Console {
    bar: Option<ProgressBar>,
    progress: bool,
    loss: Option<f64>,
    eval: Option<f64>,
    epoch: u64,
}

impl Console {
    /// With a progress bar (`progress`) or the lines alone.
    pub fn new(progress: bool) -> Console {
        Console {
            progress,
            ..Console::default()
        }
    }

    /// A line, with the progress bar out of its way.
    fn say(&self, line: impl FnOnce()) {
        match &self.bar {
            Some(bar) => bar.suspend(line),
            None => line(),
        }
    }

    fn show(&self) {
        if let Some(bar) = &self.bar {
            let mut msg = format!("epoch {}", self.epoch);
            if let Some(loss) = self.loss {
                msg += &format!("  loss {loss:.4}");
            }
            if let Some(eval) = self.eval {
                msg += &format!("  eval {eval:.4}");
            }
            bar.set_message(msg);
        }
    }
}

impl Logger for Console {
    fn on_start(&mut self, start: &RunStart) -> Result<(), BoxError> {
        if self.progress {
            let bar = ProgressBar::with_draw_target(
                Some(start.total_steps),
                ProgressDrawTarget::stderr(),
            );
            let style = ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps  {msg}  {per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_position(start.step);
            self.bar = Some(bar);
        }
        Ok(())
    }

    fn on_step(&mut self, _step: u64) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    fn on_log(&mut self, r: &LogRecord) -> Result<(), BoxError> {
        self.say(|| {
            tracing::info!(
                step = r.step,
                epoch = r.epoch,
                loss = r.loss,
                lr = r.lr,
                grad_norm = r.grad_norm,
                throughput = r.samples_per_s,
                "training"
            );
        });
        (self.loss, self.epoch) = (Some(r.loss), r.epoch);
        self.show();
        Ok(())
    }

    fn on_eval(&mut self, r: &EvalRecord) -> Result<(), BoxError> {
        self.say(|| {
            tracing::info!(
                step = r.step,
                epoch = r.epoch,
                eval = r.value,
                improved = r.improved,
                "evaluation"
            );
        });
        (self.eval, self.epoch) = (Some(r.value), r.epoch);
        self.show();
        Ok(())
    }

    fn on_finish(&mut self, report: &FitReport) -> Result<(), BoxError> {
        if let Some(bar) = self.bar.take() {
            match report.outcome {
                FitOutcome::Finished => bar.finish(),
                FitOutcome::Preempted => bar.abandon_with_message("preempted"),
            }
        }
        if report.outcome == FitOutcome::Preempted {
            tracing::info!(
                step = report.steps,
                "preempted: checkpoint written, stopping"
            );
        }
        Ok(())
    }
}

/// One JSON object per line appended to a file: `{"step", "epoch", "loss", "lr",
/// "samples_per_s", "grad_norm"?}` at log steps, `{"step", "epoch", "eval"}` after
/// evaluations. A resumed run appends to the same file.
#[derive(Debug)]
pub struct JsonLines {
    file: std::fs::File,
}

impl JsonLines {
    /// Appends to `path` (created if missing).
    pub fn append(path: impl AsRef<Path>) -> std::io::Result<JsonLines> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(JsonLines { file })
    }

    fn write(&mut self, record: &serde_json::Value) -> Result<(), BoxError> {
        use std::io::Write;
        writeln!(self.file, "{record}")?;
        Ok(())
    }
}

impl Logger for JsonLines {
    fn on_log(&mut self, r: &LogRecord) -> Result<(), BoxError> {
        let mut record = serde_json::json!({
            "step": r.step,
            "epoch": r.epoch,
            "loss": r.loss,
            "lr": r.lr,
            "samples_per_s": r.samples_per_s,
        });
        if let Some(n) = r.grad_norm {
            record["grad_norm"] = serde_json::json!(n);
        }
        self.write(&record)
    }

    fn on_eval(&mut self, r: &EvalRecord) -> Result<(), BoxError> {
        self.write(&serde_json::json!({"step": r.step, "epoch": r.epoch, "eval": r.value}))
    }
}

/// TensorBoard scalars (`tensorboard --logdir DIR`): `train/loss`, `train/lr`,
/// `train/samples_per_s`, `train/grad_norm` and `eval/metric`, by step.
#[derive(Debug)]
pub struct TensorBoard {
    writer: EventWriter,
}

impl TensorBoard {
    /// A new event file in `dir` (created if missing), as PyTorch's `SummaryWriter`.
    pub fn create(dir: impl AsRef<Path>) -> std::io::Result<TensorBoard> {
        Ok(TensorBoard {
            writer: EventWriter::create(dir)?,
        })
    }

    fn scalars(&mut self, scalars: &[(&str, f64)], step: u64) -> Result<(), BoxError> {
        let scalars: Vec<(&str, f32)> = scalars.iter().map(|&(t, v)| (t, v as f32)).collect();
        self.writer.add_scalars(&scalars, step)?;
        self.writer.flush()?;
        Ok(())
    }
}

impl Logger for TensorBoard {
    fn on_log(&mut self, r: &LogRecord) -> Result<(), BoxError> {
        let mut scalars = vec![
            ("train/loss", r.loss),
            ("train/lr", r.lr),
            ("train/samples_per_s", r.samples_per_s),
        ];
        scalars.extend(r.grad_norm.map(|n| ("train/grad_norm", n)));
        self.scalars(&scalars, r.step)
    }

    fn on_eval(&mut self, r: &EvalRecord) -> Result<(), BoxError> {
        self.scalars(&[("eval/metric", r.value)], r.step)
    }
}

/// An SVG picture of the loss and evaluation curves ([`loss_curve_svg`](crate::loss_curve_svg)),
/// written when the run ends: the whole history of a JSON Lines metrics file when given
/// one (resumes included), else the run's own numbers.
#[derive(Debug)]
pub struct LossCurve {
    path: PathBuf,
    history: Option<PathBuf>,
}

impl LossCurve {
    /// The curve to `path`, from the metrics file `history` if any.
    pub fn new(path: impl Into<PathBuf>, history: Option<PathBuf>) -> LossCurve {
        LossCurve {
            path: path.into(),
            history,
        }
    }
}

impl Logger for LossCurve {
    fn on_log(&mut self, _record: &LogRecord) -> Result<(), BoxError> {
        Ok(())
    }

    fn on_finish(&mut self, report: &FitReport) -> Result<(), BoxError> {
        let history = self
            .history
            .as_deref()
            .and_then(|m| crate::curve::read_metrics(m).ok());
        let (losses, evals) =
            history.unwrap_or_else(|| (report.losses.clone(), report.evals.clone()));
        let svg = crate::loss_curve_svg(&losses, &evals);
        tt_ckpt::atomic_write(&self.path, |w| std::io::Write::write_all(w, svg.as_bytes()))?;
        Ok(())
    }
}

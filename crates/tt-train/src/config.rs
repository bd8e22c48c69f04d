//! What to train on and how: [`TrainConfig`], its options and their validation.

use std::path::{Path, PathBuf};

use crate::{Precision, TrainError};

/// What to train on and how often to checkpoint and log: every option has a builder
/// method, and [`Trainer::from_env`](crate::Trainer::from_env) checks them all before
/// any work starts (an error names the option and what to give instead).
///
/// ```
/// use tt_train::{Precision, TrainConfig};
///
/// let config = TrainConfig::new(50_000, 32, 3)
///     .seed(7)
///     .checkpoints("ckpt", 500)
///     .accumulate(4)
///     .clip_grad_norm(1.0)
///     .precision(Precision::Bf16)
///     .log_every(20);
/// assert_eq!(config.batch_size(), 32);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    pub(crate) dataset_len: u64,
    pub(crate) batch_size: usize,
    pub(crate) epochs: u64,
    pub(crate) seed: u64,
    pub(crate) shuffle: bool,
    pub(crate) checkpoint_dir: Option<PathBuf>,
    pub(crate) checkpoint_every: u64,
    pub(crate) keep_last: usize,
    pub(crate) log_every: u64,
    pub(crate) allow_reshard: bool,
    pub(crate) handle_signals: bool,
    pub(crate) keep_freed_memory: bool,
    pub(crate) accumulate: usize,
    pub(crate) clip_grad_norm: Option<f64>,
    pub(crate) seed_every_step: bool,
    pub(crate) metrics_file: Option<PathBuf>,
    pub(crate) precision: Precision,
    pub(crate) tensorboard_dir: Option<PathBuf>,
    pub(crate) loss_curve: Option<PathBuf>,
    pub(crate) progress: bool,
    pub(crate) prefetch: usize,
    pub(crate) adaptive_micro_batch: bool,
    pub(crate) console: bool,
}

impl TrainConfig {
    /// `epochs` over `dataset_len` samples (indices `0..dataset_len` are handed to the
    /// step), `batch_size` samples per step on each rank; seed 0, shuffled, no
    /// checkpoints, a log line every 50 steps, full precision.
    pub fn new(dataset_len: u64, batch_size: usize, epochs: u64) -> TrainConfig {
        TrainConfig {
            dataset_len,
            batch_size,
            epochs,
            seed: 0,
            shuffle: true,
            checkpoint_dir: None,
            checkpoint_every: 0,
            keep_last: 3,
            log_every: 50,
            allow_reshard: false,
            handle_signals: true,
            keep_freed_memory: true,
            accumulate: 1,
            clip_grad_norm: None,
            seed_every_step: true,
            metrics_file: None,
            precision: Precision::Full,
            tensorboard_dir: None,
            loss_curve: None,
            progress: true,
            prefetch: 2,
            adaptive_micro_batch: false,
            console: true,
        }
    }

    /// The shuffle seed (torch's `DistributedSampler` order for this seed; default 0).
    pub fn seed(mut self, seed: u64) -> TrainConfig {
        self.seed = seed;
        self
    }

    /// Shuffle each epoch (torch's default, `true`), or keep index order.
    pub fn shuffle(mut self, shuffle: bool) -> TrainConfig {
        self.shuffle = shuffle;
        self
    }

    /// Checkpoints in `dir` every `every` steps (0: only at the end and on
    /// preemption). Rank 0 writes; every rank resumes from the newest valid one.
    pub fn checkpoints(mut self, dir: impl Into<PathBuf>, every: u64) -> TrainConfig {
        self.checkpoint_dir = Some(dir.into());
        self.checkpoint_every = every;
        self
    }

    /// Checkpoints kept (default 3).
    pub fn keep_last(mut self, n: usize) -> TrainConfig {
        self.keep_last = n;
        self
    }

    /// Average the loss over the ranks and log it (rank 0) every this many steps
    /// (default 50).
    pub fn log_every(mut self, steps: u64) -> TrainConfig {
        self.log_every = steps;
        self
    }

    /// Resume a checkpoint written by another number of processes, continuing its
    /// epoch over this run's ranks (default `false`: refused with
    /// [`TrainError::WorldSizeChanged`], since it changes which samples each rank
    /// sees).
    pub fn allow_reshard(mut self, allow: bool) -> TrainConfig {
        self.allow_reshard = allow;
        self
    }

    /// Install the process's SIGTERM / SIGINT / SIGUSR1 handlers (default `true`, once per
    /// process: see [`install_signal_handlers`](crate::install_signal_handlers)).
    /// `false` leaves signals to you; [`Trainer::request_stop`](crate::Trainer::request_stop)
    /// still stops.
    pub fn handle_signals(mut self, handle: bool) -> TrainConfig {
        self.handle_signals = handle;
        self
    }

    /// Keep the memory a step frees for the next step (default `true`, once per process:
    /// see [`keep_freed_memory`](crate::keep_freed_memory); glibc's thresholds set in
    /// the environment, an address-space limit and an
    /// [`adaptive_micro_batch`](Self::adaptive_micro_batch) run leave the allocator
    /// alone). `false` leaves the allocator as it is: set it where your program calls
    /// `mallopt` itself.
    pub fn keep_freed_memory(mut self, keep: bool) -> TrainConfig {
        self.keep_freed_memory = keep;
        self
    }

    /// Micro-batches per step (default 1): each rank's batch is split into `k` parts,
    /// the step function runs on each, the gradients accumulate (synchronised across
    /// ranks only after the last part, DDP's `no_sync` before) and the optimizer steps
    /// once. Each part's loss is weighted by its share of the batch, so the step equals
    /// one on the whole batch; the sampler still advances one batch a step, so a resume
    /// stays exact.
    pub fn accumulate(mut self, k: usize) -> TrainConfig {
        self.accumulate = k;
        self
    }

    /// Clip the gradients to this global L2 norm before each optimizer step (PyTorch's
    /// `clip_grad_norm_`); under DDP the gradients are already averaged, so every rank
    /// clips by the same norm. The norm before clipping is logged.
    pub fn clip_grad_norm(mut self, max_norm: f64) -> TrainConfig {
        self.clip_grad_norm = Some(max_norm);
        self
    }

    /// Seed libtorch's generators at the start of every step from (seed, rank, step)
    /// (default `true`): dropout and other random draws in the step function are then
    /// the same in a resumed run as in an uninterrupted one, bit for bit for a fixed
    /// world size, and differ between ranks.
    pub fn seed_every_step(mut self, reseed: bool) -> TrainConfig {
        self.seed_every_step = reseed;
        self
    }

    /// Append one JSON line per log step and evaluation to this file (rank 0; step,
    /// epoch, loss, learning rate, gradient norm when clipping, samples per second):
    /// a [`JsonLines`](crate::JsonLines) logger.
    pub fn metrics(mut self, path: impl Into<PathBuf>) -> TrainConfig {
        self.metrics_file = Some(path.into());
        self
    }

    /// The arithmetic of the forward pass: [`Precision::Bf16`] or [`Precision::Fp16`]
    /// (with a [`GradScaler`](crate::GradScaler)); default full.
    pub fn precision(mut self, precision: Precision) -> TrainConfig {
        self.precision = precision;
        self
    }

    /// TensorBoard event files in this directory (rank 0; `tensorboard --logdir` on
    /// it): `train/loss`, `train/lr`, `train/samples_per_s` and `train/grad_norm` at
    /// every log step, `eval/metric` at every evaluation. A resumed run adds a new file
    /// to the same directory, as PyTorch's `SummaryWriter` does.
    pub fn tensorboard(mut self, dir: impl Into<PathBuf>) -> TrainConfig {
        self.tensorboard_dir = Some(dir.into());
        self
    }

    /// An SVG picture of the loss (and evaluation) curve, written by rank 0 when
    /// training ends or is preempted. With a [`metrics`](Self::metrics) file the curve
    /// covers the whole history in it (resumes included); otherwise this run's.
    pub fn loss_curve(mut self, path: impl Into<PathBuf>) -> TrainConfig {
        self.loss_curve = Some(path.into());
        self
    }

    /// A progress bar on rank 0 (default `true`): steps done of all, the last loss and
    /// evaluation, speed and time left; drawn only when standard error is a terminal
    /// (never in logs or pipes).
    pub fn progress(mut self, show: bool) -> TrainConfig {
        self.progress = show;
        self
    }

    /// The [`Console`](crate::Console) logger on rank 0 (default `true`): a `tracing`
    /// line at each log step and evaluation, and the progress bar. `false` for a program
    /// that says what it wants through a [`Logger`](crate::Logger) of its own.
    pub fn console(mut self, on: bool) -> TrainConfig {
        self.console = on;
        self
    }

    /// Micro-batches that a [`Steps::prefetched`](crate::Steps::prefetched) loader
    /// prepares ahead (default 2).
    pub fn prefetch(mut self, micro_batches: usize) -> TrainConfig {
        self.prefetch = micro_batches;
        self
    }

    /// Find the micro-batch that fits in memory on the first step, as the Python toma
    /// does for a batch, with the effective batch fixed (default `false`): each rank
    /// tries one micro-batch of `batch_size / accumulate` samples (its forward and
    /// backward, gradients not synchronised) and halves it on an out-of-memory error
    /// (CUDA, cuDNN, cuBLAS or the CPU allocator) until it fits; the ranks then take the
    /// smallest any found, and every step accumulates `ceil(batch_size / micro)`
    /// micro-batches of it. The size is written in each checkpoint and restored on
    /// resume without a search, so a resumed run sums its gradients in the order of the
    /// run it continues, bit for bit. With [`Steps::prefetched`](crate::Steps::prefetched),
    /// the tries' batches are loaded on the calling thread before the loader starts.
    pub fn adaptive_micro_batch(mut self, adaptive: bool) -> TrainConfig {
        self.adaptive_micro_batch = adaptive;
        self
    }

    /// Samples in the dataset.
    pub fn dataset_len(&self) -> u64 {
        self.dataset_len
    }

    /// Samples per step on each rank.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Epochs to train.
    pub fn epochs(&self) -> u64 {
        self.epochs
    }

    /// Where checkpoints go, if anywhere.
    pub fn checkpoint_dir(&self) -> Option<&Path> {
        self.checkpoint_dir.as_deref()
    }

    /// Micro-batches per step.
    pub fn micro_batches(&self) -> usize {
        self.accumulate
    }

    /// Every option checked, with an error that names the option and the fix.
    pub(crate) fn validate(&self) -> Result<(), TrainError> {
        let wrong = |what: String| Err(TrainError::Config { reason: what });
        if self.dataset_len == 0 {
            return wrong("dataset_len is 0: give the number of samples".into());
        }
        if self.batch_size == 0 {
            return wrong("batch_size is 0: give the samples per step on each rank".into());
        }
        if self.log_every == 0 {
            return wrong("log_every is 0: give a number of steps (e.g. 50)".into());
        }
        if self.keep_last == 0 {
            return wrong("keep_last is 0: keep at least one checkpoint".into());
        }
        if self.accumulate == 0 || self.accumulate > self.batch_size {
            return wrong(format!(
                "accumulate is {}: give 1 to {} micro-batches (each needs at least one of \
                 the batch's {} samples)",
                self.accumulate, self.batch_size, self.batch_size
            ));
        }
        if let Some(max) = self.clip_grad_norm {
            if !(max.is_finite() && max > 0.0) {
                return wrong(format!(
                    "clip_grad_norm is {max}: give a norm > 0 (e.g. 1.0)"
                ));
            }
        }
        for (what, path) in [
            ("metrics", &self.metrics_file),
            ("loss_curve", &self.loss_curve),
        ] {
            if let Some(path) = path {
                let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
                if path.is_dir() || parent.is_some_and(|p| !p.is_dir()) {
                    return wrong(format!(
                        "{what} {}: give a file in an existing directory",
                        path.display()
                    ));
                }
            }
        }
        if let Some(dir) = &self.tensorboard_dir {
            if dir.exists() && !dir.is_dir() {
                return wrong(format!(
                    "tensorboard {} is a file: give a directory (created if missing)",
                    dir.display()
                ));
            }
        }
        if self.prefetch == 0 {
            return wrong("prefetch is 0: give the micro-batches to prepare ahead (e.g. 2)".into());
        }
        Ok(())
    }
}

/// Errors of training: [`TrainState`](crate::TrainState) and the
/// [`Trainer`](crate::Trainer). Each says its cause once: in its message (and its
/// fields), or, for the crates' errors it wraps transparently, as theirs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A configuration value is unusable.
    #[error("trainer configuration: {reason}")]
    Config {
        /// Which value, and what to use instead.
        reason: String,
    },
    /// An operating-system error: opening the metrics file or the TensorBoard
    /// directory, starting the batch loader.
    #[error("{what}: {cause}")]
    Io {
        /// What was being done, naming the path.
        what: String,
        /// The OS error (in the message, not also the `source()`).
        cause: std::io::Error,
    },
    /// Forming the group or a collective failed.
    #[error(transparent)]
    Dist(#[from] tt_dist::Error),
    /// Choosing the device failed.
    #[error(transparent)]
    Device(#[from] tt_device::Error),
    /// Saving or loading a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] tt_ckpt::Error),
    /// The optimizer failed (or its saved state did not fit).
    #[error(transparent)]
    Optim(#[from] tt_optim::Error),
    /// The sampler refused a state or a shape.
    #[error(transparent)]
    Sampler(#[from] tt_sampler::Error),
    /// The checkpoint was written by a run with another number of processes: resuming
    /// would change which samples each rank sees.
    #[error(
        "the checkpoint at step {step} was written by a run of {saved} process(es), this run \
         has {now}: set `TrainConfig::allow_reshard` (or resume with `Reshard::Allow`) to \
         continue the epoch over {now}, skipping what the {saved} had seen, or start from \
         another checkpoint directory"
    )]
    WorldSizeChanged {
        /// The checkpoint's step.
        step: u64,
        /// The world size that wrote it.
        saved: u64,
        /// This run's world size.
        now: u64,
    },
    /// The step function failed at `step`, with its error (in the message, not also
    /// the `source()`: downcast `cause` to reach it).
    #[error("training step {step} failed: {cause}")]
    Step {
        /// The step (0-based count of finished steps before it).
        step: u64,
        /// Its error.
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The evaluation's metric function failed after step `step`, with its error (in
    /// the message, not also the `source()`: downcast `cause` to reach it).
    #[error("evaluation after step {step} failed: {cause}")]
    Eval {
        /// The steps finished before the evaluation.
        step: u64,
        /// The metric function's error.
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The micro-batch search (`TrainConfig::adaptive_micro_batch`) failed before step
    /// `step`: the step function's error that was no out-of-memory one, or, with
    /// `no_fit`, the last out-of-memory error when even a micro-batch of 1 did not fit
    /// (in the message, not also the `source()`: downcast `cause` to reach it).
    #[error("searching the micro-batch before step {step}: {}{cause}", no_fit_words(.no_fit))]
    MicroBatch {
        /// The steps finished before the search.
        step: u64,
        /// Even a micro-batch of 1 ran out of memory.
        no_fit: bool,
        /// The step function's error.
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Installing the SIGTERM / SIGINT / SIGUSR1 handlers failed.
    #[error("cannot install the preemption signal handler: {cause}")]
    Signal {
        /// The OS error (in the message, not also the `source()`).
        cause: std::io::Error,
    },
}

/// The words before a micro-batch search's cause when nothing fitted.
fn no_fit_words(no_fit: &bool) -> &'static str {
    if *no_fit {
        "out of memory even at a micro-batch of 1: "
    } else {
        ""
    }
}

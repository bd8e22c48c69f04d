/// Errors of training: [`TrainState`](crate::TrainState) and the
/// [`Trainer`](crate::Trainer). Each says its cause once: in its message (and its
/// fields), or, for the crates' errors it wraps transparently, as theirs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A configuration value is unusable.
    #[error("trainer configuration: {0}")]
    Config(String),
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
    /// Installing the SIGTERM / SIGINT handlers failed.
    #[error("cannot install the preemption signal handler: {0}")]
    Signal(std::io::Error),
}

/// Errors of tt-sampler: each says what was wrong and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `num_replicas` is zero.
    #[error("num_replicas is 0: a sampler needs at least one replica (WORLD_SIZE, when read from the environment)")]
    NoReplicas,
    /// `rank` is not below `num_replicas`.
    #[error("rank {rank} is out of range for {num_replicas} replica(s): ranks are 0 to {}", num_replicas - 1)]
    RankOutOfRange {
        /// The rank given.
        rank: u64,
        /// The number of replicas.
        num_replicas: u64,
    },
    /// The launcher's variables (torchrun's `RANK` / `WORLD_SIZE`, or Slurm's) are
    /// wrong: the message names the variable, its value and the fix.
    #[error("{reason}")]
    Environment {
        /// The variable, its value and the fix.
        reason: String,
    },
    /// A batch size of zero.
    #[error("batch_size is 0: give a positive batch size")]
    ZeroBatchSize,
    /// `seed + epoch` does not fit torch's 64-bit seed.
    #[error("seed {seed} + epoch {epoch} overflows a 64-bit seed; torch would refuse it too: use a smaller seed")]
    SeedOverflow {
        /// The seed.
        seed: u64,
        /// The epoch.
        epoch: u64,
    },
    /// A state from a sampler of another shape, without re-sharding asked for.
    #[error(
        "this state was saved by a sampler over {state_len} samples and {state_replicas} replica(s), \
         but this one has {len} samples and {replicas} replica(s); for another number of replicas, \
         load it with `Reshard::Allow` to continue the epoch from the samples already seen by the \
         whole job; for another dataset, `Reshard::RestartEpoch` starts the saved epoch again; or \
         start a new run"
    )]
    ShapeMismatch {
        /// `len` in the state.
        state_len: u64,
        /// `num_replicas` in the state.
        state_replicas: u64,
        /// This sampler's `len`.
        len: u64,
        /// This sampler's `num_replicas`.
        replicas: u64,
    },
    /// A state saved over another dataset length, loaded with [`Reshard::Allow`].
    ///
    /// [`Reshard::Allow`]: crate::Reshard::Allow
    #[error(
        "this state was saved by a sampler over {state_len} samples, but this one has {len}: \
         the epoch's order depends on the dataset length, so continuing it would repeat some \
         samples and skip others. Use the same dataset to resume, load the state with \
         `Reshard::RestartEpoch` to start the saved epoch again over the new dataset, or \
         start a new run"
    )]
    LengthChanged {
        /// `len` in the state.
        state_len: u64,
        /// This sampler's `len`.
        len: u64,
    },
    /// [`advance`](crate::DistributedSampler::advance) past the end of the epoch.
    #[error(
        "advance({n}) goes past the end of the epoch: this rank had {remaining} of its \
         {num_samples} samples left (nothing was changed). Iterating the sampler already \
         counts what it yields, so advance only by samples taken some other way"
    )]
    AdvancePastEnd {
        /// The samples asked to skip.
        n: u64,
        /// What was left of the epoch.
        remaining: u64,
        /// This rank's samples in the epoch.
        num_samples: u64,
    },
    /// A state whose progress is past the end of its epoch.
    #[error("this state's progress ({progress}) is past the {num_samples} samples of its epoch: the state is corrupt")]
    ProgressPastEnd {
        /// The progress in the state.
        progress: u64,
        /// Samples in that epoch for this rank.
        num_samples: u64,
    },
}

/// `Result` with tt-sampler's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

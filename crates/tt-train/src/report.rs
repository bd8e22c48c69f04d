//! What [`Trainer::fit`](crate::Trainer::fit) returns.

use std::path::PathBuf;

/// Why [`Trainer::fit`](crate::Trainer::fit) returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitOutcome {
    /// Every epoch is done.
    Finished,
    /// SIGTERM, SIGINT or SIGUSR1 (Slurm's warning) reached some rank: the step in flight finished, a
    /// checkpoint was written (when a directory is configured) and every rank
    /// stopped at the same step. Start the same command again to resume; exit with
    /// [`FitReport::exit_code`] ([`EXIT_PREEMPTED`](crate::EXIT_PREEMPTED)) so that a
    /// launcher or scheduler knows.
    Preempted,
}

/// What [`Trainer::fit`](crate::Trainer::fit) did.
#[derive(Debug, Clone, PartialEq)]
pub struct FitReport {
    /// Finished or preempted.
    pub outcome: FitOutcome,
    /// Steps finished in all (resumes included).
    pub steps: u64,
    /// The epoch it stopped in (or `epochs` when finished).
    pub epoch: u64,
    /// The checkpoint step it resumed from, if any.
    pub resumed_from: Option<u64>,
    /// `(step, loss averaged over the ranks)` every `log_every` steps and at the end.
    pub losses: Vec<(u64, f64)>,
    /// The last checkpoint written (rank 0 only; `None` elsewhere).
    pub checkpoint: Option<PathBuf>,
    /// `(step, evaluation averaged over every held-out sample)` at each evaluation of
    /// this run.
    pub evals: Vec<(u64, f64)>,
    /// The best evaluation in the metric's [`Direction`](crate::Direction), resumes
    /// included: `(step, value)`.
    pub best: Option<(u64, f64)>,
    /// Steps whose optimizer update was skipped because the gradients were not finite
    /// ([`Precision::Fp16`](crate::Precision::Fp16)), in this run.
    pub skipped_steps: u64,
    /// The loss scale at the end ([`Precision::Fp16`](crate::Precision::Fp16); `None`
    /// otherwise).
    pub loss_scale: Option<f64>,
    /// The micro-batch's samples the adaptive search found or the checkpoint restored
    /// ([`TrainConfig::adaptive_micro_batch`](crate::TrainConfig::adaptive_micro_batch);
    /// `None` otherwise).
    pub micro_batch: Option<usize>,
}

impl FitReport {
    /// The process's exit status for this outcome: success when finished,
    /// [`EXIT_PREEMPTED`](crate::EXIT_PREEMPTED) (75) when preempted, which
    /// `torchtools launch` passes on without restarting and a scheduler can requeue on.
    pub fn exit_code(&self) -> std::process::ExitCode {
        match self.outcome {
            FitOutcome::Finished => std::process::ExitCode::SUCCESS,
            FitOutcome::Preempted => std::process::ExitCode::from(crate::EXIT_PREEMPTED as u8),
        }
    }
}

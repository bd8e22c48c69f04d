//! SIGTERM / SIGINT / SIGUSR1 as a request to stop after the current step.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

/// Exit status of a training process stopped by preemption after checkpointing
/// (sysexits' `EX_TEMPFAIL`, 75): not a failure, start the same command again to
/// resume. `torchtools launch` passes it on without restarting the group; a scheduler
/// can requeue on it (Slurm: `--requeue` with an epilog testing for 75).
pub use tt_dist::EXIT_PREEMPTED;

static STOP: OnceLock<Result<Arc<AtomicBool>, String>> = OnceLock::new();

/// Installs this process's SIGTERM, SIGINT and SIGUSR1 handlers, once: the first
/// signal asks training to stop after the current step (checkpoint, then
/// [`EXIT_PREEMPTED`]); a second one exits at once with status 128 + signal, as an
/// impatient Ctrl-C expects. SIGUSR1 is the warning Slurm sends before a job's time
/// limit (`sbatch --signal=USR1@90`) and `torchtools reserve --signal-before` sends:
/// the trainer checkpoints on it as on SIGTERM, and `torchtools reserve --requeue`
/// inside a Slurm job then requeues the job. Later calls return the same flag.
///
/// [`Trainer::from_env`](crate::Trainer::from_env) calls it unless
/// `TrainConfig::handle_signals` is `false`; call it yourself for a loop of your own.
pub fn install_signal_handlers() -> std::io::Result<Arc<AtomicBool>> {
    let installed = STOP.get_or_init(|| {
        let stop = Arc::new(AtomicBool::new(false));
        for sig in [
            signal_hook::consts::SIGTERM,
            signal_hook::consts::SIGINT,
            signal_hook::consts::SIGUSR1,
        ] {
            // The conditional shutdown first: it fires only when the flag is already
            // set, i.e. on the second signal.
            signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, Arc::clone(&stop))
                .map_err(|e| e.to_string())?;
            signal_hook::flag::register(sig, Arc::clone(&stop)).map_err(|e| e.to_string())?;
        }
        Ok(stop)
    });
    match installed {
        Ok(stop) => Ok(Arc::clone(stop)),
        Err(e) => Err(std::io::Error::other(e.clone())),
    }
}

//! `torchtools launch`.

use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use anyhow::Result;
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::SignalsInfo;
use signal_hook::low_level::siginfo::Cause;
use tt_dist::{launch as launch_group, LaunchConfig};

use crate::child::Exit;

pub(crate) fn launch(mut cfg: LaunchConfig) -> Result<ExitCode> {
    // Signals a process sends us go to every rank; the terminal's reach them directly.
    let forward = Arc::new(AtomicI32::new(0));
    let mut signals = SignalsInfo::<WithOrigin>::new([SIGINT, SIGTERM, SIGHUP, SIGQUIT])
        .map_err(|e| anyhow::anyhow!("cannot install signal handlers: {e}"))?;
    let handle = signals.handle();
    let flag = Arc::clone(&forward);
    let forwarder = std::thread::spawn(move || {
        for origin in signals.forever() {
            if !matches!(origin.cause, Cause::Kernel) {
                flag.store(origin.signal, Ordering::Relaxed);
            }
        }
    });
    cfg.forward = Some(forward);
    let outcome = launch_group(&cfg).map_err(|e| match e {
        tt_dist::Error::Launch(m) => anyhow::Error::from(Exit(2, m)),
        tt_dist::Error::Spawn { program, cause, .. } => anyhow::Error::from(
            crate::child::spawn_failure(&program.to_string_lossy(), &cause),
        ),
        e => anyhow::Error::from(e),
    });
    handle.close();
    let _ = forwarder.join();
    let outcome = outcome?;
    match outcome.failed {
        None => Ok(ExitCode::SUCCESS),
        Some((rank, how)) => {
            eprintln!(
                "torchtools launch: rank {rank} {how}{}; the other ranks were stopped",
                if outcome.restarts > 0 {
                    format!(" (after {} restart(s))", outcome.restarts)
                } else {
                    String::new()
                }
            );
            Ok(ExitCode::from(
                u8::try_from(outcome.code).unwrap_or(1).max(1),
            ))
        }
    }
}

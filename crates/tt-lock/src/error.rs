use std::path::PathBuf;
use std::time::Duration;

use crate::{GpuKey, Holder, LOCK_DIR_ENV};

/// Errors of tt-lock. Each says what was wrong and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock directory cannot be created, opened or written.
    #[error(
        "the GPU lock directory {path} ({origin}) cannot be used: {reason}; \
         set {LOCK_DIR_ENV} to a directory that every user of the GPUs can write \
         (mode 1777, like /tmp), or fix this one"
    )]
    LockDir {
        /// The directory.
        path: PathBuf,
        /// Where the path came from: the variable, the default, or the program.
        origin: String,
        /// What went wrong.
        reason: String,
    },
    /// The lock directory or a lock file is not safe to use (a symbolic link, not a
    /// regular file, world-writable without the sticky bit).
    #[error("refusing {path}: {reason}")]
    Unsafe {
        /// The path refused.
        path: PathBuf,
        /// Why, and what to do.
        reason: String,
    },
    /// An I/O error on a lock file.
    #[error("{op} {path}: {cause}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error (in the message, so not also the `source()`).
        cause: std::io::Error,
    },
    /// `Wait::Try` and the GPU is locked by someone else.
    #[error("{gpu} is {}", busy_text(.holder, *.waiting))]
    WouldBlock {
        /// The GPU.
        gpu: GpuKey,
        /// Who holds it, when the lock file says.
        holder: Option<Box<Holder>>,
        /// How many earlier requests in the queue wait for it.
        waiting: usize,
    },
    /// `Wait::Timeout` ran out and the GPU is still locked.
    #[error("timed out after {waited:.1?} waiting for {gpu}, which is {}", busy_text(.holder, *.waiting))]
    Timeout {
        /// The GPU.
        gpu: GpuKey,
        /// How long it waited.
        waited: Duration,
        /// Who holds it, when the lock file says.
        holder: Option<Box<Holder>>,
        /// How many earlier requests in the queue still wait for it.
        waiting: usize,
    },
    /// This process already holds this GPU's lock through another guard.
    #[error(
        "{gpu} is already locked by this process (pid {}); use the lock you hold \
         instead of taking it again, which would wait for itself forever",
        std::process::id()
    )]
    AlreadyHeld {
        /// The GPU.
        gpu: GpuKey,
    },
    /// A GPU given by the user is not written as a GPU.
    #[error(
        "{value:?} is not a GPU: give an NVML index as nvidia-smi shows it (0, 1, ...), \
         a UUID (GPU-...; a unique prefix is enough), cuda:N for this process's N-th \
         visible device, or auto{hint}"
    )]
    InvalidGpu {
        /// The text given.
        value: String,
        /// More detail, starting with "; ".
        hint: String,
    },
    /// A GPU given by the user does not exist on this machine.
    #[error("{spec} is not a GPU of this machine: {known}")]
    UnknownGpu {
        /// The request.
        spec: String,
        /// What the machine has.
        known: String,
    },
    /// `auto` (or a count) and the machine has no or too few GPUs.
    #[error("cannot reserve {count} GPU(s) automatically: {reason}")]
    NotEnoughGpus {
        /// How many were asked for.
        count: usize,
        /// Why not.
        reason: String,
    },
    /// A shared request that can never be granted.
    #[error("cannot share {gpu}: {reason}")]
    BadShare {
        /// The GPU.
        gpu: GpuKey,
        /// Why, and what to do.
        reason: String,
    },
    /// The machine's policy ([`crate::LockDir::policy`]) refuses the request: it asks
    /// for more than one user may have, or its user has as many requests waiting as
    /// the policy allows.
    #[error("{reason} (the machine's policy {path}; `torchtools policy` shows it)")]
    Policy {
        /// The policy file.
        path: PathBuf,
        /// What it refuses and why.
        reason: String,
    },
    /// `Wait::Try`, or a `Wait::Timeout` that ran out, and the machine's policy holds
    /// the request back: its user holds as much as a per-user limit allows. Busy, like
    /// [`Error::WouldBlock`]: it is served once the user holds less.
    #[error(
        "{}{reason} (the machine's policy {path}; `torchtools policy` shows it)",
        .waited.map_or(String::new(), |w| format!("timed out after {w:.1?} waiting: "))
    )]
    Held {
        /// The policy file.
        path: PathBuf,
        /// Why: `held by policy: 2 of 2 GPU(s) held, 1 more asked`.
        reason: String,
        /// How long it waited, for a timeout.
        waited: Option<Duration>,
    },
    /// A logical CUDA index could not be mapped to a physical GPU.
    #[error("cannot tell which physical GPU {spec} is: {reason}")]
    Cuda {
        /// The request.
        spec: String,
        /// What the CUDA driver said.
        reason: String,
    },
}

/// Why a GPU cannot be had now: its holder, and the earlier requests waiting for it.
fn busy_text(holder: &Option<Box<Holder>>, waiting: usize) -> String {
    let queue = format!(
        "{waiting} earlier request(s) in the queue wait for it (`torchtools queue` lists them)"
    );
    match (holder, waiting) {
        (Some(h), 0) => format!("locked by {h}"),
        (Some(h), _) => format!("locked by {h}, and {queue}"),
        (None, 0) => "locked (its holder left no readable record)".to_owned(),
        (None, _) => format!("free, but {queue}"),
    }
}

/// `Result` with tt-lock's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

//! Cooperative GPU locks for machines shared by several users: one `flock(2)` lock per
//! physical GPU, so that jobs started through torchtools (Rust, or any program run by
//! `torchtools reserve`) take turns instead of running each other out of memory.
//!
//! - **One lock per physical GPU.** Locks are files `gpu-<UUID>.lock`: every way of
//!   naming a GPU ([`GpuSpec`]: NVML's index as `nvidia-smi` shows it, its UUID or a
//!   prefix, `cuda:N` inside a process, mapped through the CUDA driver) resolves to the
//!   same [`GpuKey`], whatever each user's `CUDA_VISIBLE_DEVICES`. Without NVML (no
//!   GPU) locks are keyed by the index given, and say so.
//! - **A shared, safe directory.** [`LockDir::from_env`]: `TORCHTOOLS_LOCK_DIR`, default
//!   [`DEFAULT_LOCK_DIR`] (fixed, not `$TMPDIR`, so every user meets the same locks),
//!   created mode 01777; symbolic links are never followed, non-regular files and
//!   world-writable directories without the sticky bit are refused.
//! - **Three ways to wait** ([`Wait`]): try (fails at once naming the holder), block,
//!   and a timeout that really ends: never early, within a few ms after the deadline.
//! - **First come, first served.** A request that waits, whatever its form (one GPU, a
//!   set, `auto`, blocking or timed), takes a place in the directory's queue and is
//!   granted when its GPUs are free and no earlier request waits for any of them; a
//!   killed waiter leaves the queue by itself (its ticket's `flock` dies with it).
//!   [`LockDir::queue`] lists the waiters.
//! - **A holder record** ([`Holder`]: pid, user, host, start, bytes, command, GPU) in the
//!   lock file; [`LockDir::list`] asks the kernel whether each lock is held, so a record
//!   left by a `kill -9`'d holder shows as free.
//! - **Sets of GPUs** all or nothing, in a fixed order ([`LockDir::lock_many`]), or the
//!   free ones with the most free memory ([`LockDir::lock_auto`]).
//! - Descriptors are close-on-exec; [`share_with`] hands locks to a child command
//!   deliberately, and a child that finds its GPU's lock inherited
//!   ([`HELD_LOCKS_ENV`]) uses it instead of waiting for its own parent.
//!
//! What it does not do: stop programs that do not take the lock. The GPU memory
//! "fence" of `tt-fence` covers those.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tt_lock::{GpuKey, Holder, LockDir, Wait};
//!
//! let dir = LockDir::open(std::env::temp_dir().join("tt-lock-doc-example"))?;
//! // `GpuSpec::resolve` gives the key of a GPU by index, UUID or cuda:N; on this
//! // example's machine, index 0 without NVML.
//! let gpu = GpuKey::Index(0);
//! let lock = dir.lock(&gpu, Wait::Timeout(Duration::from_secs(10)), Holder::current())?;
//! assert_eq!(lock.holder().pid, std::process::id());
//!
//! // Another process trying now is told who holds it.
//! assert!(dir.list()?.iter().any(|s| s.gpu == gpu && s.held));
//! drop(lock);
//! assert!(dir.list()?.iter().any(|s| s.gpu == gpu && !s.held));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

mod dir;
mod error;
mod gpu;
mod holder;
mod list;
mod lock;
mod queue;

pub use dir::{LockDir, DEFAULT_LOCK_DIR, LOCK_DIR_ENV};
pub use error::{Error, Result};
pub use gpu::{GpuKey, GpuSpec};
pub use holder::{own_pid_namespace, user_name_of, utc, Holder};
pub use list::LockState;
pub use lock::{share_with, GpuLock, Wait, HELD_LOCKS_ENV};
pub use queue::{Waiter, Wants};

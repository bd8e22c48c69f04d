//! torchtools: train with libtorch (through [`tch`]) on machines you share with others.
//!
//! This crate gathers the torchtools crates behind one name; each is also usable on
//! its own. What is here today:
//!
//! | module | crate | what it does |
//! |---|---|---|
//! | [`device`] | `tt-device` | pick CUDA / MPS / CPU from the environment and the build, say why; GPU inventory through NVML |
//! | [`sys`] (feature `tch`) | `tt-sys` | load CUDA so tch sees it; libtorch's caching-allocator statistics; rpath helper |
//! | [`lock`] | `tt-lock` | cooperative per-GPU locks (by UUID) with holder records, timeouts, sets |
//! | [`fence`] | `tt-fence` | hold a GPU's spare memory so others cannot take it; hand it back on demand |
//! | [`probe`] | `tt-probe` | a training step's peak memory, measured in a fresh child process (Rust probe or any command) |
//! | [`adaptive`] | `tt-adaptive` | OOM-adaptive batch / range / chunked (toma's features, searching back up) |
//! | [`tracker`] | `tt-tracker` | RAM / GPU RAM / CPU / GPU / energy of a process tree, gpu_tracker's report with exact peaks |
//! | [`sampler`] | `tt-sampler` | torch's `DistributedSampler` order, interruptible and resumable exactly |
//! | [`ckpt`] | `tt-ckpt` | atomic, verified, Python-readable checkpoints; a directory that survives `kill -9` |
//! | [`optim`] | `tt-optim` | SGD / Adam / AdamW with torch.optim's rules and LR schedules, state saved in checkpoints |
//! | [`dist`] | `tt-dist` | torchrun / Slurm environments, a torchrun-style launcher; with `dist`: c10d process groups (Gloo, NCCL), DDP |
//! | [`reserve`] | `tt-reserve` | lock + fence as one guard: the Python torchtools' `reserve_gpu_for_training` |
//! | [`train`] | `tt-train` | one training loop for one process or many (torchhandy's `Parallel_Trainer`), `TrainState` for loops of your own, batches across epochs |
//!
//! The flows that join them, re-exported here: [`reserve_gpu_for_training`] (lock +
//! fence as a guard), `run_training_with_reservation` (feature `tch`: probe → reserve
//! with the estimate → train, from `tt-probe`) and [`fence_release_hook`] (tt-adaptive
//! hands fence memory back before it lowers a batch size). [`init_logging`] shows what
//! they do (resumes, preemption, OOM retries) on stderr.
//!
//! Every crate's core builds without libtorch; libtorch comes in only with the `tch`
//! feature (on by default here). The `torchtools` command (crate `torchtools-cli`)
//! is built on the libtorch-free cores.
//!
//! # Example
//!
//! ```
//! # #[cfg(feature = "tch")] {
//! use tch::{Kind, Tensor};
//!
//! // TORCHTOOLS_DEVICE=auto|cpu|cuda|cuda:N|mps, LOCAL_RANK and CUDA_VISIBLE_DEVICES
//! // decide; asking for CUDA where it is unusable is an error that says why.
//! let device = torchtools::device::select()?;
//! let x = Tensor::ones([3], (Kind::Float, device));
//! assert_eq!(x.sum(Kind::Float).double_value(&[]), 3.0);
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A binary that uses the `tch` feature runs from any directory when its build script
//! calls [`tt_sys::build::link_libtorch_rpath`] (see that module).

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod prelude;

pub use tt_reserve::{
    fence_release_hook, reserve as reserve_gpu_for_training, Error as ReserveError, Reservation,
    ReserveOptions, ReservedGpu,
};

#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use tt_probe::{run_training_with_reservation, RunError, RunOptions, RunPlan};

#[doc(inline)]
pub use tt_reserve as reserve;

#[doc(inline)]
pub use tt_train as train;

/// Logs of every torchtools crate (resumes, preemption, OOM retries, waits for a
/// GPU) on stderr, through a `tracing` subscriber that honours `TORCHTOOLS_LOG`
/// (`RUST_LOG` syntax; default `info`). Call it first in `main`; it does nothing when
/// the program already installed a subscriber of its own.
///
/// A `TORCHTOOLS_LOG` that is not a filter is said on stderr, naming it, and `info` is
/// used: [`try_init_logging`] returns it as an error instead, for a program that
/// stops on bad variables.
pub fn init_logging() {
    if let Err(e) = try_init_logging() {
        eprintln!("torchtools: {e}; logging at info");
        install_logging(tracing_subscriber::EnvFilter::new("info"));
    }
}

/// [`init_logging`], with a bad `TORCHTOOLS_LOG` returned as an error (naming the
/// variable, its value and the fix) before anything is installed.
///
/// ```
/// // SAFETY: no other thread reads the environment in this example.
/// unsafe { std::env::set_var("TORCHTOOLS_LOG", "[[[") };
/// let e = torchtools::try_init_logging().unwrap_err();
/// assert!(e.to_string().contains("TORCHTOOLS_LOG=\"[[[\""));
/// ```
pub fn try_init_logging() -> Result<(), LogFilterError> {
    let filter = tt_device::log_filter("info", |v| {
        tracing_subscriber::EnvFilter::builder().parse(v)
    })?;
    install_logging(filter);
    Ok(())
}

fn install_logging(filter: tracing_subscriber::EnvFilter) {
    // An error means a subscriber is already installed: theirs wins.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

pub use tt_device::LogFilterError;

/// Sets libtorch's intra-op threads to what this process may really use, and returns
/// why ([`device::CpuBudget`]): `OMP_NUM_THREADS` when set, else the CPUs of its
/// affinity mask capped by its cgroup's CPU quota. libtorch's default (one thread per
/// core it detects) ignores quotas and other users' load; on a shared machine its
/// threads then wait for each other (the README has the numbers). Call it once, early
/// in `main`; `torchtools::device::report()` shows both counts.
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub fn use_allowed_threads() -> tt_device::CpuBudget {
    let budget = tt_device::CpuBudget::query();
    let before = tch::get_num_threads();
    let threads = i32::try_from(budget.threads).unwrap_or(i32::MAX);
    if before != threads {
        tch::set_num_threads(threads);
    }
    tracing::info!("libtorch intra-op threads: {before} -> {budget}");
    budget
}

#[doc(inline)]
pub use tt_device as device;

#[doc(inline)]
pub use tt_probe as probe;

#[doc(inline)]
pub use tt_lock as lock;

#[doc(inline)]
pub use tt_fence as fence;

#[doc(inline)]
pub use tt_adaptive as adaptive;

#[doc(inline)]
pub use tt_tracker as tracker;

#[doc(inline)]
pub use tt_ckpt as ckpt;

#[doc(inline)]
pub use tt_optim as optim;

#[doc(inline)]
pub use tt_sampler as sampler;

/// Distributed environment and launcher; with feature `dist`, process groups on
/// libtorch's c10d and DDP (crate `tt-dist`).
pub use tt_dist as dist;

#[cfg(feature = "tch")]
#[doc(inline)]
pub use tt_sys as sys;

#[cfg(feature = "tch")]
pub use tch;

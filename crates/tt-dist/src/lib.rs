//! Distributed training on libtorch's own engine. The libtorch-free core: the
//! distributed environment ([`DistEnv`]: torchrun's variables, else Slurm's, else one
//! process, with errors naming what is missing or inconsistent) and a torchrun-style
//! launcher ([`launch`]), which `torchtools launch` uses. With the `c10d` feature:
//! `ProcessGroup` (libtorch's TCPStore + ProcessGroupGloo / ProcessGroupNCCL, formed as
//! torch.distributed forms its default group, so Python ranks can join), its
//! collectives, and `Ddp` over a tch VarStore. No home-made collective layer.
//!
//! ```
//! # #[cfg(feature = "c10d")] {
//! use tt_dist::{ProcessGroup, ReduceOp};
//! // Without launcher variables: a group of one (with them, the real group).
//! let pg = ProcessGroup::single();
//! let t = tch::Tensor::from_slice(&[2.0f32]);
//! pg.all_reduce(&t, ReduceOp::Sum)?;
//! assert_eq!(pg.all_reduce_f64(1.5, ReduceOp::Avg)?, 1.5);
//! # }
//! # Ok::<(), tt_dist::Error>(())
//! ```
//!
//! # Example
//!
//! ```
//! use tt_dist::DistEnv;
//!
//! // What `torchtools launch --nproc-per-node 2` (or torchrun) gives rank 1.
//! let env = DistEnv::from_lookup(|k| match k {
//!     "RANK" | "LOCAL_RANK" => Some("1".into()),
//!     "WORLD_SIZE" | "LOCAL_WORLD_SIZE" => Some("2".into()),
//!     "MASTER_ADDR" => Some("127.0.0.1".into()),
//!     "MASTER_PORT" => Some("29500".into()),
//!     _ => None,
//! })?;
//! assert!(env.is_distributed() && !env.is_main());
//! // In a real process: DistEnv::from_env()?
//! # Ok::<(), tt_dist::Error>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "c10d")]
mod ddp;
mod env;
mod error;
#[cfg(feature = "c10d")]
mod group;
mod iface;
mod launch;

#[cfg(feature = "c10d")]
pub use ddp::{Ddp, DdpOptions, DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES};
#[cfg(feature = "c10d")]
pub use group::{BackendKind, GroupOptions, ProcessGroup, ReduceOp, Work, DEFAULT_TIMEOUT};

pub use env::{first_host, DistEnv, Place, Source, DEFAULT_PORT};
pub use error::{Error, Result};
pub use iface::{socket_interface_for, SocketInterface, SOCKET_IFNAME_VARS};
pub use launch::{
    free_port, launch, LaunchConfig, LaunchOutcome, EXIT_PREEMPTED, MAX_NPROC_PER_NODE,
};

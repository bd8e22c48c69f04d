#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "c10d")]
mod ddp;
mod env;
mod error;
#[cfg(feature = "c10d")]
mod group;
mod iface;
mod job;
mod launch;
mod port;
mod status;

#[cfg(feature = "c10d")]
pub use ddp::{Ddp, DdpOptions, DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES};
#[cfg(feature = "c10d")]
pub use group::{BackendKind, GroupOptions, ProcessGroup, ReduceOp, Work};

pub use env::{first_host, DistEnv, Place, Source, DEFAULT_PORT, DEFAULT_TIMEOUT};
pub use error::{Error, Result};
pub use iface::{socket_interface_for, SocketInterface, SOCKET_IFNAME_VARS};
pub use launch::{launch, LaunchConfig, LaunchOutcome, MAX_NPROC_PER_NODE};
pub use port::free_port;
pub use status::EXIT_PREEMPTED;

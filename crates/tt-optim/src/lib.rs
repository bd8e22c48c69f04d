#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod error;
#[cfg(feature = "tch")]
mod optimizer;
mod schedule;

pub use config::{AdamConfig, Algorithm, SgdConfig};
pub use error::{Error, Result};
#[cfg(feature = "tch")]
pub use optimizer::Optimizer;
pub use schedule::Schedule;

#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
mod fence;

pub use error::{Error, Result};
pub use fence::{Fence, FenceOptions, FenceReport, DEFAULT_SAFETY_MARGIN, MIN_CHUNK};

//! Optimizers whose state survives a checkpoint, with torch.optim's update rules.
//!
//! tch's optimizers are opaque: their momentum and Adam moments cannot be read, so a
//! run resumed from a checkpoint silently differs from an uninterrupted one. This
//! crate implements `torch.optim.SGD` (momentum, dampening, Nesterov, weight decay),
//! `Adam` (with AMSGrad) and `AdamW` over tch tensors, following torch's code paths
//! for CPU parameters operation by operation, with torch's defaults, plus
//! learning-rate [`Schedule`]s (step, cosine, linear warm-up), and an
//! [`Optimizer::save_into`] / [`Optimizer::load_from`] pair that carries everything
//! through a [`tt_ckpt`] checkpoint.
//!
//! Without the default `tch` feature only the schedules and the configurations
//! (serde) are compiled: no libtorch.
//!
//! # Example
//!
//! ```
//! # #[cfg(feature = "tch")] {
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//! use tt_optim::{AdamConfig, Algorithm, Optimizer, Schedule};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let net = nn::linear(vs.root(), 3, 1, Default::default());
//! let schedule = Schedule::WarmupCosine { warmup: 10, start_factor: 0.1, t_max: 90, eta_min: 0.0 };
//! let mut opt = Optimizer::new(&vs, Algorithm::AdamW(AdamConfig::adamw()), schedule)?;
//! let x = Tensor::randn([16, 3], (Kind::Float, Device::Cpu));
//! for _ in 0..5 {
//!     let loss = net.forward(&x).pow_tensor_scalar(2).mean(Kind::Float);
//!     opt.backward_step(&loss)?;
//! }
//! let mut ckpt = tt_ckpt::Checkpoint::new(opt.steps());
//! ckpt.add_var_store(&vs)?;
//! opt.save_into(&mut ckpt, "optim")?; // moments, steps, schedule: all of it
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
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

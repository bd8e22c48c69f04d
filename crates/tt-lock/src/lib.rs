#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod dir;
mod error;
mod fair;
mod file;
mod gpu;
mod holder;
mod list;
mod lock;
mod owner;
mod policy;
mod queue;
mod record;
mod share;
mod tally;
mod totals;
mod usage;
mod watch;

pub use dir::{path_from_env, LockDir, DEFAULT_LOCK_DIR, LOCK_DIR_ENV};
pub use error::{Error, Result};
pub use fair::{preemptor, Standing};
pub use gpu::{GpuKey, GpuSpec};
pub use holder::{own_pid_namespace, utc, Holder, Requester};
pub use list::{LockState, Locker};
pub use lock::{inheritance, share_with, GpuLock, Wait, HELD_LOCKS_ENV};
pub use owner::{
    check as check_owner, euid, name_of_uid, trusted_text, user_name_of, Ignored, Untrusted,
};
pub use policy::{
    policy_for, FairShare, Limits, Policy, PolicyInForce, PolicyStatus, Preemption, Scheduler,
    DEFAULT_AGING, DEFAULT_POLICY, POLICY_ENV,
};
pub use queue::{Waiter, Wants};
pub use totals::{UsageSummed, UsageTotal, UsageTotals, UsageWatch};
pub use usage::{Usage, UsageEvent, UsageLog, ALIVE_EVERY, USAGE_PREFIX};

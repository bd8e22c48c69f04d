#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod bytes;
mod cpu;
mod cuda;
mod duration;
mod env;
mod error;
mod inventory;
#[cfg(feature = "tch")]
mod libtorch;
mod process;
pub mod procfs;
mod report;
mod select;
mod slurm;
mod text;
mod thread;

pub use bytes::Bytes;
pub use cpu::{omp_num_threads, CpuBudget};
pub use cuda::{CudaDriver, CudaError};
pub use duration::{format_duration, parse_duration};
pub use env::{
    log_filter, user_dir, CudaVisibleDevices, DeviceRequest, EnvConfig, LogFilterError, RawEnv,
    VisibleEntry, CUDA_VISIBLE_DEVICES, LOCAL_RANK, TORCHTOOLS_DEVICE, TORCHTOOLS_LOG,
};
pub use error::{Error, Result};
pub use inventory::{
    GpuBackend, GpuInfo, GpuProcess, Inventory, MigInstance, NvmlBackend, NvmlStatus, VisibleGpu,
};
#[cfg(feature = "tch")]
pub use libtorch::{availability, report, select, select_device};
pub use process::{
    boot_id, descends_from, host_name, host_name_for_files, host_name_if_known, in_a_pid_namespace,
    now_unix, now_unix_secs, own_pid_namespace, parent_of, shell_status, EX_TEMPFAIL,
    INITIAL_PID_NAMESPACE,
};
pub use report::{Backend, DeviceReport, LibtorchInfo, View};
pub use select::{select_with, Availability, CudaCandidate, Device, Selection};
pub use slurm::{
    slurm_cpus, slurm_job_id, slurm_requeue, slurm_requeue_saying, slurm_requeue_self_saying,
    slurm_requeuing_said, slurm_restart_count, SelfRequeue, SlurmError, SlurmGpus, SlurmJob,
    SLURM_CPUS_ON_NODE, SLURM_CPUS_PER_TASK, SLURM_JOB_GPUS, SLURM_JOB_ID, SLURM_RESTART_COUNT,
    SLURM_STEP_GPUS, TORCHTOOLS_REQUEUES_SLURM_JOB,
};
pub use text::printable;
#[cfg(any(test, feature = "test-hooks"))]
pub use thread::refuse_threads;
pub use thread::spawn_scoped;

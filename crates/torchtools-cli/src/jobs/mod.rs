//! Runs that outlive the terminal: `--detach` on `reserve`, `run` and `launch` starts
//! the same command in a session of its own (a terminal's hang-up or the user logging
//! out does not reach it), its output in a log file, and prints a job id at once;
//! `jobs`, `logs` and `stop` find it again. The job's record and state are the store's;
//! starting and keeping a job is the keeper's; Slurm's jobs, on a Slurm cluster, are
//! read from Slurm.

pub(crate) mod keeper;
pub(crate) mod slurm;
pub(crate) mod store;

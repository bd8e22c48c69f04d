//! One module per command: its arguments (`Args`, with the command's help as their
//! doc comment) and its `run`. This file is the table of commands.

pub(crate) mod devices;
pub(crate) mod generate_man;
pub(crate) mod job_hook;
pub(crate) mod job_run;
pub(crate) mod jobs;
pub(crate) mod launch;
pub(crate) mod locks;
pub(crate) mod logs;
pub(crate) mod metrics;
pub(crate) mod policy;
pub(crate) mod probe;
pub(crate) mod queue;
pub(crate) mod reserve;
pub(crate) mod run;
pub(crate) mod serve;
pub(crate) mod stop;
pub(crate) mod top;
pub(crate) mod track;
pub(crate) mod usage;

use clap::Subcommand;

#[derive(Subcommand)]
pub(crate) enum Command {
    Devices(devices::Args),
    Reserve(reserve::Args),
    Track(Box<track::Args>),
    Probe(probe::Args),
    Run(run::Args),
    Launch(Box<launch::Args>),
    Locks(locks::Args),
    Jobs(jobs::Args),
    Logs(logs::Args),
    Stop(stop::Args),
    JobRun(job_run::Args),
    JobHook(job_hook::Args),
    GenerateMan(generate_man::Args),
    Usage(usage::Args),
    Metrics(metrics::Args),
    Serve(serve::Args),
    Queue(queue::Args),
    Policy(policy::Args),
    Top(top::Args),
}

impl Command {
    /// `--detach` (with its `--log-dir`) and how many of the command line's last words
    /// are the user's command, for the commands that run one: decided once, from the
    /// parsed arguments, before any command runs.
    pub(crate) fn detached(&self) -> Option<(crate::arg_groups::DetachArgs, usize)> {
        let mut detach = match self {
            Command::Launch(a) => a.detached()?,
            _ => match self.reserving() {
                Some(a) if a.detach.detach => a.detach.clone(),
                _ => return None,
            },
        };
        // A preempted job goes back into the queue.
        detach.requeue |= match self {
            Command::Launch(a) => a.preemptible(),
            _ => self
                .reserving()
                .is_some_and(|a| a.reservation.time.preemptible),
        };
        Some((detach, self.command_len()))
    }

    /// How many of the command line's last words are the user's command.
    pub(crate) fn command_len(&self) -> usize {
        match self {
            Command::Launch(a) => a.command_len(),
            _ => self.reserving().map_or(0, |a| a.command.len()),
        }
    }

    /// The `--on-end` options of the commands that run one.
    pub(crate) fn hook(&self) -> Option<&crate::arg_groups::HookArgs> {
        match self {
            Command::Launch(a) => Some(&a.hook),
            _ => self.reserving().map(|a| &a.hook),
        }
    }

    /// The options `reserve` and `run` share, for those two.
    pub(crate) fn reserving(&self) -> Option<&crate::arg_groups::ReservingArgs> {
        match self {
            Command::Reserve(a) => Some(&a.rest),
            Command::Run(a) => Some(&a.rest),
            _ => None,
        }
    }

    /// Whether it only prints (a closed pipe may end it quietly).
    pub(crate) fn only_prints(&self) -> bool {
        match self {
            Command::Devices(_)
            | Command::Locks(_)
            | Command::Queue(_)
            | Command::Policy(_)
            | Command::Usage(_) => true,
            Command::Top(a) => a.once || a.json,
            Command::Metrics(a) => a.listen.is_none() && a.textfile.is_none(),
            _ => false,
        }
    }
}

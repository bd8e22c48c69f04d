//! A failure that ends `torchtools` with an exit status of its own (a leaf: every
//! command's module returns one), and the statuses `torchtools` gives, named once.

/// A command failed (the default for an error without a status of its own).
pub(crate) const FAILURE: u8 = 1;
/// Bad arguments, variables or input files, found before anything started.
pub(crate) const USAGE: u8 = 2;
/// The GPUs were still locked when `--timeout` ran out, or the job was preempted or
/// reached its time limit and should run again (`EX_TEMPFAIL`).
pub(crate) const TEMPFAIL: u8 = tt_device::EX_TEMPFAIL as u8;
/// The command to run was not found (as shells say it).
pub(crate) const NOT_FOUND: u8 = 127;
/// The command to run was found but could not be run (as shells say it).
pub(crate) const CANNOT_RUN: u8 = 126;

/// A failure that has its own exit status.
#[derive(Debug)]
pub(crate) struct Exit {
    /// The exit status.
    pub(crate) code: u8,
    /// What failed and how to fix it (printed after `torchtools: error: `).
    pub(crate) message: String,
}

impl Exit {
    /// A failure with exit status `code`.
    pub(crate) fn new(code: u8, message: String) -> Exit {
        Exit { code, message }
    }

    /// Bad arguments ([`USAGE`]).
    pub(crate) fn usage(message: String) -> Exit {
        Exit::new(USAGE, message)
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Exit {}

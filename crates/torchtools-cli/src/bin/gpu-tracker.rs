//! `gpu-tracker`: gpu_tracker's command, so that scripts written for the Python
//! gpu_tracker (`gpu-tracker -e "python train.py" -o usage.json -f json`,
//! `gpu-tracker sub-track analyze ...`) run unchanged on `torchtools track`, which
//! takes the same options. It runs the `torchtools` installed beside it (the wheel and
//! `cargo install` put both in one directory) as `torchtools track ARGS...`, in its
//! place: the exit status, signals and output are `torchtools track`'s.

use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let torchtools = match std::env::current_exe() {
        Ok(me) => me.with_file_name("torchtools"),
        Err(e) => {
            eprintln!("gpu-tracker: error: cannot find where this program is: {e}");
            return ExitCode::from(1);
        }
    };
    let error = Command::new(&torchtools)
        .arg("track")
        .args(std::env::args_os().skip(1))
        .exec();
    eprintln!(
        "gpu-tracker: error: cannot run {}: {error}; it belongs beside gpu-tracker \
         (reinstall torchtools-cli)",
        torchtools.display()
    );
    ExitCode::from(127)
}

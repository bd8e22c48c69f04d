//! `torchtools`: the command-line face of torchtools, built on its libtorch-free
//! cores so that it starts in milliseconds and serves Python users as well.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit status for a bad variable or an impossible device request.
const EXIT_BAD_ENV: u8 = 2;

#[derive(Parser)]
#[command(name = "torchtools", version, about = "Tools for training on shared GPU machines", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the GPUs (NVML) and show which device TORCHTOOLS_DEVICE, LOCAL_RANK and
    /// CUDA_VISIBLE_DEVICES select.
    ///
    /// Exits with 2 when a variable is invalid or asks for a device that is not
    /// there, after printing the report.
    Devices {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("TORCHTOOLS_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("torchtools: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Devices { json } => {
            let report = tt_device::DeviceReport::nvml_view();
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!("{report}");
            }
            if let Some(error) = &report.error {
                eprintln!("torchtools: error: {error}");
                return Ok(ExitCode::from(EXIT_BAD_ENV));
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

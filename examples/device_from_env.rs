//! Device selection from the environment, as a launcher or a user sets it: prints the
//! report (libtorch, backends, GPUs, threads, what was chosen and why) and trains on
//! nothing: the first lines of every torchtools program.
//!
//! ```sh
//! cargo run --example device_from_env                          # auto: CUDA, else MPS, else CPU
//! TORCHTOOLS_DEVICE=cpu cargo run --example device_from_env
//! LOCAL_RANK=1 cargo run --example device_from_env             # a torchrun worker: cuda:1
//! TORCHTOOLS_DEVICE=cuda:9 cargo run --example device_from_env # an error that says why
//! ```

fn main() -> std::process::ExitCode {
    // A bad TORCHTOOLS_LOG is an error before any work, as every other variable.
    if let Err(e) = torchtools::try_init_logging() {
        eprintln!("{}: {e}", env!("CARGO_CRATE_NAME"));
        std::process::exit(2);
    }
    let report = torchtools::device::report();
    println!("{report}");
    // `select()` is the same decision as a `tch::Device`, or the error in the report.
    match torchtools::device::select() {
        Ok(device) => {
            let x = torchtools::tch::Tensor::ones([3], (torchtools::tch::Kind::Float, device));
            println!(
                "\nselected {device:?}; a tensor there sums to {}",
                x.sum(torchtools::tch::Kind::Float).double_value(&[])
            );
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

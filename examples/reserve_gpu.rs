//! Reserve a GPU by hand, as the Python torchtools' `reserve_gpu_for_training` does: the
//! GPU's lock (waiting in the machine's first-come-first-served queue, naming who holds
//! it) and a memory fence that leaves your job's bytes free; both released when the
//! guard is dropped, or by the kernel if the process dies.
//!
//! ```sh
//! cargo run --example reserve_gpu                 # auto: the free GPU with the most memory, 2 GiB
//! cargo run --example reserve_gpu -- 0 --no-fence # GPU 0's lock alone (works without a GPU)
//! ```
//! Run `torchtools locks` or `torchtools top` in another terminal while it holds.

use std::time::Duration;

use torchtools::device::Bytes;
use torchtools::lock::GpuSpec;
use torchtools::{reserve_gpu_for_training, ReserveOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A bad TORCHTOOLS_LOG is an error before any work, as every other variable.
    if let Err(e) = torchtools::try_init_logging() {
        eprintln!("{}: {e}", env!("CARGO_CRATE_NAME"));
        std::process::exit(2);
    }
    let mut args = std::env::args().skip(1);
    let gpu: GpuSpec = args.next().as_deref().unwrap_or("auto").parse()?;
    let fence = !args.any(|a| a == "--no-fence");
    let reservation = reserve_gpu_for_training(ReserveOptions {
        gpus: vec![gpu],
        training_reserved_bytes: Bytes::gib(2),
        fence,
        timeout: Some(Duration::from_secs(600)),
        ..ReserveOptions::default()
    })?;
    if reservation.gpus().is_empty() {
        println!("no GPU on this machine: nothing to reserve; train on the CPU");
        return Ok(());
    }
    for gpu in reservation.gpus() {
        println!("reserved {} (fence: {})", gpu.key, gpu.fenced);
    }
    // What everyone else sees, as `torchtools locks` shows it.
    let dir = torchtools::lock::LockDir::from_env()?;
    for state in dir.list()? {
        if let Some(holder) = state.holder.filter(|_| state.held) {
            println!("{}: held by {holder}", state.gpu);
        }
    }
    // ... train here (`reservation.device()` gives the tch::Device) ...
    drop(reservation);
    println!("released");
    Ok(())
}

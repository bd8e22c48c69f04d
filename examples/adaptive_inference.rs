//! Batch inference that adapts its batch size to the memory there is, as toma's
//! `@toma.batch(initial_batchsize=...)` does: the closure gets a batch size, and when it
//! runs out of memory tt-adaptive retries it smaller (and remembers, per call site and
//! free memory, what fitted). On the CPU a soft address-space limit makes the
//! out-of-memory real and visible; on a GPU the device's own memory does.
//!
//! ```sh
//! cargo run --example adaptive_inference
//! ```

use std::error::Error;

use torchtools::adaptive::{address_space_in_use, set_cpu_memory_limit, Adaptive};
use torchtools::tch::nn;
use torchtools::tch::{Device, Kind, TchError, Tensor};

const SAMPLES: i64 = 16_384;

fn main() -> Result<(), Box<dyn Error>> {
    // A bad TORCHTOOLS_LOG is an error before any work, as every other variable.
    if let Err(e) = torchtools::try_init_logging() {
        eprintln!("{}: {e}", env!("CARGO_CRATE_NAME"));
        std::process::exit(2);
    }
    torchtools::use_allowed_threads();
    let device = torchtools::device::select()?;
    torchtools::tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let l1 = nn::linear(vs.root() / "l1", 256, 4096, Default::default());
    let l2 = nn::linear(vs.root() / "l2", 4096, 10, Default::default());
    // The model's forward with tch's `f_` methods, which return out-of-memory as an
    // error for tt-adaptive to retry (the plain ones panic).
    let forward = |x: &Tensor| -> Result<Tensor, TchError> {
        x.f_linear(&l1.ws, l1.bs.as_ref())?
            .f_relu()?
            .f_linear(&l2.ws, l2.bs.as_ref())
    };
    let data = Tensor::randn([SAMPLES, 256], (Kind::Float, device));
    // The answer in small batches, before any limit: what the adaptive run must give.
    let expected = torchtools::tch::no_grad(|| {
        let parts: Result<Vec<Tensor>, TchError> =
            data.split(1024, 0).iter().map(forward).collect();
        parts.and_then(|p| Tensor::f_cat(&p, 0))
    })?;
    if device == Device::Cpu {
        // 256 MiB above what the process maps now: one batch of 16384 needs 256 MiB of
        // activations alone, so the first attempt runs out of memory.
        set_cpu_memory_limit(Some(
            address_space_in_use().ok_or("no VmSize in /proc/self/status")? + (256 << 20),
        ))?;
    }
    let adaptive = Adaptive::new();
    let mut tried = Vec::new();
    let outputs = adaptive.batch(SAMPLES as usize, |batch| {
        tried.push(batch);
        torchtools::tch::no_grad(|| -> Result<Tensor, TchError> {
            let mut parts = Vec::new();
            for chunk in data.f_split(batch as i64, 0)? {
                parts.push(forward(&chunk)?);
            }
            Tensor::f_cat(&parts, 0)
        })
    });
    if device == Device::Cpu {
        set_cpu_memory_limit(None)?;
    }
    let outputs = outputs?;
    let largest_error = (&outputs - &expected).abs().max().double_value(&[]);
    println!("batch sizes tried: {tried:?}");
    println!(
        "inference on {SAMPLES} samples with batches of {}; largest difference from small batches: {largest_error:.2e}",
        tried.last().copied().unwrap_or(0)
    );
    if largest_error > 1e-4 {
        return Err("the adaptive run's outputs differ from the reference".into());
    }
    Ok(())
}

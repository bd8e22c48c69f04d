//! A computation too large for memory in one piece, done in chunks whose size adapts,
//! as toma's `@toma.chunked(initial_step=...)` does: the squared distances from 8192
//! points to 2048 centres, written chunk by chunk into one output; a chunk that runs out
//! of memory is retried smaller and the loop goes on from where it was. On the CPU a
//! soft address-space limit makes the out-of-memory real.
//!
//! ```sh
//! cargo run --example adaptive_chunked
//! ```

use std::error::Error;

use torchtools::adaptive::{address_space_in_use, set_cpu_memory_limit, Adaptive};
use torchtools::tch::{Device, Kind, TchError, Tensor};

/// Squared distances between the rows of `a` (n x d) and of `b` (m x d): n x m.
fn distances(a: &Tensor, b: &Tensor) -> Result<Tensor, TchError> {
    let diff = a.f_unsqueeze(1)?.f_sub(&b.f_unsqueeze(0)?)?; // n x m x d: the big one
    diff.f_square()?.f_sum_dim_intlist(2, false, Kind::Float)
}

fn main() -> Result<(), Box<dyn Error>> {
    // A bad TORCHTOOLS_LOG is an error before any work, as every other variable.
    if let Err(e) = torchtools::try_init_logging() {
        eprintln!("{}: {e}", env!("CARGO_CRATE_NAME"));
        std::process::exit(2);
    }
    torchtools::use_allowed_threads();
    let device = torchtools::device::select()?;
    torchtools::tch::manual_seed(0);
    let points = Tensor::randn([8192, 32], (Kind::Float, device));
    let centres = Tensor::randn([2048, 32], (Kind::Float, device));
    let out = Tensor::zeros([8192, 2048], (Kind::Float, device));
    if device == Device::Cpu {
        // 512 MiB above what the process maps now: a chunk of 8192 points would need
        // 2 GiB for its n x m x d difference.
        set_cpu_memory_limit(Some(
            address_space_in_use().ok_or("no VmSize in /proc/self/status")? + (512 << 20),
        ))?;
    }
    let mut steps = Vec::new();
    let result = Adaptive::new().chunked(&points, 0, 8192, |chunk, from, to| {
        steps.push(to - from);
        out.f_narrow(0, from as i64, (to - from) as i64)?
            .f_copy_(&distances(chunk, &centres)?)
    });
    if device == Device::Cpu {
        set_cpu_memory_limit(None)?;
    }
    result?;
    // Checked against the same formula on a few rows, without the limit.
    let rows = Tensor::from_slice(&[0i64, 1, 4095, 8191]).to_device(device);
    let expected = distances(&points.index_select(0, &rows), &centres)?;
    let got = out.index_select(0, &rows);
    let largest_error = (&got - &expected).abs().max().double_value(&[]);
    let first = steps.first().copied().unwrap_or(0);
    println!(
        "{} chunks; first tried {first} rows, then {:?}; largest difference on checked rows: {largest_error:.2e}",
        steps.len(),
        steps.iter().skip(1).take(6).collect::<Vec<_>>()
    );
    if largest_error > 1e-3 {
        return Err("the chunked result differs from the direct computation".into());
    }
    Ok(())
}

//! Multi-tensor optimizer kernels (`torch._foreach_*`), which tch does not expose.

use tch::Tensor;

use crate::error::{Error, Result};
use crate::ffi::{self, check};

/// Adam's hyper-parameters for [`foreach_adam`], as torch.optim names them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    /// Learning rate of this step.
    pub lr: f64,
    /// Coefficients of the running averages of the gradient and its square.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// L2 penalty (Adam) or decoupled decay (AdamW, with `decoupled`).
    pub weight_decay: f64,
    /// AdamW's decoupled weight decay.
    pub decoupled: bool,
    /// Maximise instead of minimise.
    pub maximize: bool,
}

fn ptrs(ts: &[Tensor]) -> Vec<*mut std::ffi::c_void> {
    // torch-sys's C_tensor is an `at::Tensor*`: the shim reads it as one.
    ts.iter()
        .map(|t| t.as_ptr() as *mut std::ffi::c_void)
        .collect()
}

/// Sets the gradient of each tensor to undefined, as Python's `p.grad = None` (what
/// torch.optim's `zero_grad()` does by default): no kernel runs, and the next backward
/// writes fresh gradients instead of adding to zeros. tch's `zero_grad` fills them with
/// zeros instead, one kernel each.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
/// x.sum(Kind::Float).backward();
/// assert!(x.grad().defined());
/// tt_sys::set_grads_none(&[x.shallow_clone()])?;
/// assert!(!x.grad().defined());
/// # Ok::<(), tt_sys::Error>(())
/// ```
pub fn set_grads_none(tensors: &[Tensor]) -> Result<()> {
    let ps = ptrs(tensors);
    // SAFETY: every pointer is a live tensor borrowed for the call; the shim catches
    // every C++ exception.
    unsafe { check(ffi::tt_set_grads_none(ps.as_ptr(), ps.len())) }.map_err(|message| {
        Error::Torch {
            op: "set_grads_none",
            reason: message,
        }
    })
}

/// One Adam (or AdamW) step over many tensors at once, as torch.optim's default
/// multi-tensor implementation (`_multi_tensor_adam`, `foreach=True`) does it: a few
/// `_foreach_` kernels for all the tensors instead of several per tensor, which on a
/// GPU is what makes the step fast. `steps[i]` is tensor `i`'s step count after this
/// step (1 on the first); `exp_avgs` and `exp_avg_sqs` are updated in place, as are the
/// parameters. Every slice has one entry per tensor.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let p = Tensor::ones([4], (Kind::Float, Device::Cpu));
/// let g = Tensor::full([4], 0.5, (Kind::Float, Device::Cpu));
/// let (m, v) = (p.zeros_like(), p.zeros_like());
/// let step = tt_sys::AdamStep { lr: 0.1, betas: (0.9, 0.999), eps: 1e-8,
///     weight_decay: 0.0, decoupled: false, maximize: false };
/// tt_sys::foreach_adam(&[p.shallow_clone()], &[g], &[m], &[v], &[1], &step)?;
/// // Adam's first step moves every element by lr against the gradient's sign.
/// assert!((p.double_value(&[0]) - 0.9).abs() < 1e-6);
/// # Ok::<(), tt_sys::Error>(())
/// ```
pub fn foreach_adam(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    steps: &[u64],
    h: &AdamStep,
) -> Result<()> {
    let n = params.len();
    if [grads.len(), exp_avgs.len(), exp_avg_sqs.len(), steps.len()] != [n; 4] {
        return Err(Error::Torch {
            op: "foreach_adam",
            reason: format!(
                "{n} parameters but {} gradients, {} first moments, {} second moments and {} \
                 step counts: give one of each per parameter",
                grads.len(),
                exp_avgs.len(),
                exp_avg_sqs.len(),
                steps.len()
            ),
        });
    }
    if n == 0 {
        return Ok(());
    }
    let (beta1, beta2) = h.betas;
    let power = |b: f64, s: u64| b.powi(i32::try_from(s).unwrap_or(i32::MAX));
    let step_sizes: Vec<f64> = steps
        .iter()
        .map(|&s| -(h.lr / (1.0 - power(beta1, s))))
        .collect();
    let bc2: Vec<f64> = steps
        .iter()
        .map(|&s| (1.0 - power(beta2, s)).sqrt())
        .collect();
    let (p, g, m, v) = (ptrs(params), ptrs(grads), ptrs(exp_avgs), ptrs(exp_avg_sqs));
    // SAFETY: every pointer is a live tensor borrowed for the call, every array holds
    // `n` entries (checked above); the shim catches every C++ exception.
    unsafe {
        check(ffi::tt_foreach_adam(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            n,
            step_sizes.as_ptr(),
            bc2.as_ptr(),
            h.lr,
            beta1,
            beta2,
            h.weight_decay,
            h.eps,
            h.decoupled,
            h.maximize,
        ))
    }
    .map_err(|message| Error::Torch {
        op: "foreach_adam",
        reason: message,
    })
}

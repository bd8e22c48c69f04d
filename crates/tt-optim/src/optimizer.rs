//! The optimizers over tch tensors (feature `tch`).

use serde::{Deserialize, Serialize};
use tch::{nn::VarStore, Tensor};
use tt_ckpt::{Checkpoint, LoadedCheckpoint};

use crate::{AdamConfig, Algorithm, Error, Result, Schedule, SgdConfig};

/// Per-parameter state, as torch keeps it.
#[derive(Default)]
struct ParamState {
    /// Steps this parameter was updated (torch counts per parameter).
    step: u64,
    momentum_buffer: Option<Tensor>,
    exp_avg: Option<Tensor>,
    exp_avg_sq: Option<Tensor>,
    max_exp_avg_sq: Option<Tensor>,
}

impl ParamState {
    fn buffers(&self) -> [(&'static str, &Option<Tensor>); 4] {
        [
            ("momentum_buffer", &self.momentum_buffer),
            ("exp_avg", &self.exp_avg),
            ("exp_avg_sq", &self.exp_avg_sq),
            ("max_exp_avg_sq", &self.max_exp_avg_sq),
        ]
    }

    fn buffer_mut(&mut self, name: &str) -> Option<&mut Option<Tensor>> {
        match name {
            "momentum_buffer" => Some(&mut self.momentum_buffer),
            "exp_avg" => Some(&mut self.exp_avg),
            "exp_avg_sq" => Some(&mut self.exp_avg_sq),
            "max_exp_avg_sq" => Some(&mut self.max_exp_avg_sq),
            _ => None,
        }
    }
}

/// What is saved next to the buffers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SavedMeta {
    algorithm: Algorithm,
    schedule: Schedule,
    step: u64,
    params: Vec<String>,
    param_steps: Vec<u64>,
}

/// An optimizer over a VarStore's trainable variables with torch.optim's update
/// rules and a state that [`save_into`](Self::save_into) /
/// [`load_from`](Self::load_from) carry through a checkpoint, so that a resumed run
/// continues exactly like an uninterrupted one (tch's own optimizers are opaque).
pub struct Optimizer {
    algorithm: Algorithm,
    schedule: Schedule,
    params: Vec<(String, Tensor)>,
    state: Vec<ParamState>,
    step: u64,
}

fn torch(param: &str) -> impl Fn(tch::TchError) -> Error + '_ {
    move |e| Error::Torch {
        param: param.to_owned(),
        reason: e.to_string(),
    }
}

impl Optimizer {
    /// An optimizer over the trainable variables of `vs` (sorted by name).
    pub fn new(vs: &VarStore, algorithm: Algorithm, schedule: Schedule) -> Result<Self> {
        Self::with_params(vs, |_| true, algorithm, schedule)
    }

    /// An optimizer over the trainable variables of `vs` whose names `keep` accepts: a
    /// parameter group, as torch's optimizers take a subset of a model's parameters
    /// (`nn.VarStore` names are paths such as `"head.weight"`). With one optimizer per
    /// group, each group has its own algorithm and rate; an empty group is an error.
    ///
    /// ```
    /// use tch::nn;
    /// use tt_optim::{Algorithm, Optimizer, Schedule, SgdConfig};
    ///
    /// let vs = nn::VarStore::new(tch::Device::Cpu);
    /// let _body = nn::linear(vs.root() / "body", 8, 8, Default::default());
    /// let _head = nn::linear(vs.root() / "head", 8, 1, Default::default());
    /// let slow = SgdConfig { lr: 1e-3, ..Default::default() };
    /// let body = Optimizer::with_params(&vs, |n| n.starts_with("body."), Algorithm::Sgd(slow), Schedule::Constant)?;
    /// let head = Optimizer::with_params(&vs, |n| n.starts_with("head."), Algorithm::Sgd(SgdConfig::default()), Schedule::Constant)?;
    /// assert_eq!((body.params().len(), head.params().len()), (2, 2));
    /// # Ok::<(), tt_optim::Error>(())
    /// ```
    pub fn with_params(
        vs: &VarStore,
        keep: impl Fn(&str) -> bool,
        algorithm: Algorithm,
        schedule: Schedule,
    ) -> Result<Self> {
        algorithm.validate()?;
        let mut params: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .filter(|(n, t)| t.requires_grad() && keep(n))
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        if params.is_empty() && !vs.variables().is_empty() {
            let mut names: Vec<String> = vs.variables().into_keys().collect();
            names.sort();
            return Err(Error::InvalidConfig {
                reason: format!(
                    "no trainable variable of the VarStore is in this group (its variables: \
                 {names:?}): check the group's names"
                ),
            });
        }
        let state = params.iter().map(|_| ParamState::default()).collect();
        Ok(Optimizer {
            algorithm,
            schedule,
            params,
            state,
            step: 0,
        })
    }

    /// `torch.optim.SGD` with `config`, constant learning rate.
    pub fn sgd(vs: &VarStore, config: SgdConfig) -> Result<Self> {
        Self::new(vs, Algorithm::Sgd(config), Schedule::Constant)
    }

    /// `torch.optim.Adam` with `config`, constant learning rate.
    pub fn adam(vs: &VarStore, config: AdamConfig) -> Result<Self> {
        Self::new(vs, Algorithm::Adam(config), Schedule::Constant)
    }

    /// `torch.optim.AdamW` with `config`, constant learning rate.
    pub fn adamw(vs: &VarStore, config: AdamConfig) -> Result<Self> {
        Self::new(vs, Algorithm::AdamW(config), Schedule::Constant)
    }

    /// The parameters this optimizer updates, by name (sorted).
    pub fn params(&self) -> Vec<&str> {
        self.params.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The learning rate the next step uses: `schedule.lr(base, steps())`, as if
    /// torch's scheduler were stepped after every optimizer step.
    pub fn lr(&self) -> f64 {
        self.schedule.lr(self.algorithm.lr(), self.step)
    }

    /// Clears every gradient, as torch.optim's `zero_grad()` does by default
    /// (`set_to_none=True`): gradients become undefined, no kernel runs, and the next
    /// backward writes them afresh. A parameter the next loss does not reach keeps no
    /// gradient and is not updated by [`step`](Self::step), as in torch.
    /// [`zero_grad_to_zeros`](Self::zero_grad_to_zeros) fills them with zeros instead.
    pub fn zero_grad(&mut self) {
        let params: Vec<Tensor> = self.params.iter().map(|(_, p)| p.shallow_clone()).collect();
        if tt_sys::set_grads_none(&params).is_err() {
            // Only a broken libtorch would refuse; zeros keep the update right.
            self.zero_grad_to_zeros();
        }
    }

    /// Sets every gradient to zero (torch's `zero_grad(set_to_none=False)`): a
    /// parameter the next loss does not reach then has a zero gradient, and Adam still
    /// moves it by its momentum.
    pub fn zero_grad_to_zeros(&mut self) {
        for (_, p) in &mut self.params {
            p.zero_grad();
        }
    }

    /// `zero_grad`, `loss.backward()`, `step`.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        self.zero_grad();
        loss.f_backward().map_err(torch("loss"))?;
        self.step()
    }

    /// One update of every parameter that has a gradient (as torch, parameters
    /// without one are left alone, their own step count included).
    ///
    /// Adam and AdamW (without AMSGrad) on CUDA update every tensor at once with
    /// torch.optim's default multi-tensor kernels (`foreach=True`, its default on CUDA);
    /// elsewhere, and for SGD, one tensor at a time as torch.optim does on the CPU.
    pub fn step(&mut self) -> Result<()> {
        let lr = self.lr();
        let algorithm = self.algorithm;
        if self.foreach_step(lr)? {
            self.step += 1;
            return Ok(());
        }
        tch::no_grad(|| -> Result<()> {
            for ((name, param), state) in self.params.iter_mut().zip(self.state.iter_mut()) {
                let grad = param.grad();
                if !grad.defined() {
                    continue;
                }
                state.step += 1;
                match algorithm {
                    Algorithm::Sgd(c) => sgd(name, param, grad, state, &c, lr)?,
                    Algorithm::Adam(c) => adam(name, param, grad, state, &c, lr, false)?,
                    Algorithm::AdamW(c) => adam(name, param, grad, state, &c, lr, true)?,
                }
            }
            Ok(())
        })?;
        self.step += 1;
        Ok(())
    }

    /// torch.optim's multi-tensor Adam step, when it applies: Adam or AdamW without
    /// AMSGrad, and every parameter that has a gradient on CUDA. `false` when it does
    /// not apply (nothing was changed).
    fn foreach_step(&mut self, lr: f64) -> Result<bool> {
        let (c, decoupled) = match self.algorithm {
            Algorithm::Adam(c) => (c, false),
            Algorithm::AdamW(c) => (c, true),
            Algorithm::Sgd(_) => return Ok(false),
        };
        if c.amsgrad {
            return Ok(false);
        }
        let mut with_grad = Vec::new();
        for (i, (_, p)) in self.params.iter().enumerate() {
            let g = p.grad();
            if !g.defined() {
                continue;
            }
            if !matches!(p.device(), tch::Device::Cuda(_)) {
                return Ok(false);
            }
            with_grad.push((i, g));
        }
        if with_grad.is_empty() {
            return Ok(false);
        }
        let n = with_grad.len();
        let (mut params, mut grads, mut m, mut v, mut steps) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for (i, g) in with_grad {
            let (name, p) = &self.params[i];
            let s = &mut self.state[i];
            m.push(moment(&mut s.exp_avg, p).map_err(torch(name))?);
            v.push(moment(&mut s.exp_avg_sq, p).map_err(torch(name))?);
            s.step += 1;
            params.push(p.shallow_clone());
            grads.push(g);
            steps.push(s.step);
        }
        let step = tt_sys::AdamStep {
            lr,
            betas: c.betas,
            eps: c.eps,
            weight_decay: c.weight_decay,
            decoupled,
            maximize: c.maximize,
        };
        tt_sys::foreach_adam(&params, &grads, &m, &v, &steps, &step).map_err(|e| Error::Torch {
            param: format!("{n} parameters at once"),
            reason: e.to_string(),
        })?;
        Ok(true)
    }

    /// Adds this optimizer's state to `ckpt`: its hyper-parameters, schedule and
    /// step under the value `prefix`, its buffers as tensors `prefix.param.buffer`.
    pub fn save_into(&self, ckpt: &mut Checkpoint<'_>, prefix: &str) -> Result<()> {
        let meta = SavedMeta {
            algorithm: self.algorithm,
            schedule: self.schedule,
            step: self.step,
            params: self.params.iter().map(|(n, _)| n.clone()).collect(),
            param_steps: self.state.iter().map(|s| s.step).collect(),
        };
        ckpt.set_value(prefix, &meta)?;
        for ((name, _), state) in self.params.iter().zip(&self.state) {
            for (buffer, tensor) in state.buffers() {
                if let Some(t) = tensor {
                    ckpt.add_tch(&format!("{prefix}.{name}.{buffer}"), t)?;
                }
            }
        }
        Ok(())
    }

    /// Restores the state saved by [`save_into`](Self::save_into): the saved
    /// hyper-parameters, schedule and step (the run's truth) and every buffer, on
    /// each parameter's device. The parameters must be the same (names).
    pub fn load_from(&mut self, loaded: &LoadedCheckpoint, prefix: &str) -> Result<()> {
        let meta: SavedMeta = loaded.value(prefix)?;
        let names: Vec<&String> = self.params.iter().map(|(n, _)| n).collect();
        if meta.params.iter().collect::<Vec<_>>() != names || meta.param_steps.len() != names.len()
        {
            return Err(Error::StateMismatch {
                reason: format!(
                    "saved for parameters {:?}, this optimizer has {names:?}",
                    meta.params
                ),
            });
        }
        meta.algorithm.validate()?;
        let saved: std::collections::HashSet<String> =
            loaded.tensors().names().into_iter().collect();
        let mut state: Vec<ParamState> = Vec::with_capacity(names.len());
        for ((name, param), steps) in self.params.iter().zip(&meta.param_steps) {
            let mut s = ParamState {
                step: *steps,
                ..ParamState::default()
            };
            for buffer in ["momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"] {
                let key = format!("{prefix}.{name}.{buffer}");
                if saved.contains(&key) {
                    let t = loaded.tch(&key, param.device())?;
                    if t.size() != param.size() {
                        return Err(Error::StateMismatch {
                            reason: format!(
                                "{key} has shape {:?}, the parameter {:?}",
                                t.size(),
                                param.size()
                            ),
                        });
                    }
                    if let Some(slot) = s.buffer_mut(buffer) {
                        *slot = Some(t);
                    }
                }
            }
            state.push(s);
        }
        self.algorithm = meta.algorithm;
        self.schedule = meta.schedule;
        self.step = meta.step;
        self.state = state;
        Ok(())
    }
}

fn sgd(
    name: &str,
    p: &mut Tensor,
    grad: Tensor,
    s: &mut ParamState,
    c: &SgdConfig,
    lr: f64,
) -> Result<()> {
    let err = torch(name);
    let mut g = if c.maximize {
        grad.f_neg().map_err(&err)?
    } else {
        grad
    };
    if c.weight_decay != 0.0 {
        g = g
            .f_add(&p.f_mul_scalar(c.weight_decay).map_err(&err)?)
            .map_err(&err)?;
    }
    if c.momentum != 0.0 {
        let buf = match s.momentum_buffer.take() {
            None => g.f_detach_copy().map_err(&err)?,
            Some(mut buf) => {
                let _ = buf.f_mul_scalar_(c.momentum).map_err(&err)?;
                let _ = buf
                    .f_add_(&g.f_mul_scalar(1.0 - c.dampening).map_err(&err)?)
                    .map_err(&err)?;
                buf
            }
        };
        g = if c.nesterov {
            g.f_add(&buf.f_mul_scalar(c.momentum).map_err(&err)?)
                .map_err(&err)?
        } else {
            buf.shallow_clone()
        };
        s.momentum_buffer = Some(buf);
    }
    let _ = p.f_sub_(&g.f_mul_scalar(lr).map_err(&err)?).map_err(&err)?;
    Ok(())
}

fn adam(
    name: &str,
    p: &mut Tensor,
    grad: Tensor,
    s: &mut ParamState,
    c: &AdamConfig,
    lr: f64,
    decoupled: bool,
) -> Result<()> {
    let err = torch(name);
    let (beta1, beta2) = c.betas;
    let mut g = if c.maximize {
        grad.f_neg().map_err(&err)?
    } else {
        grad
    };
    if c.weight_decay != 0.0 {
        if decoupled {
            let _ = p.f_mul_scalar_(1.0 - lr * c.weight_decay).map_err(&err)?;
        } else {
            g = g
                .f_add(&p.f_mul_scalar(c.weight_decay).map_err(&err)?)
                .map_err(&err)?;
        }
    }
    // Views of the state's moments: the in-place updates below are the state's.
    let mut exp_avg = moment(&mut s.exp_avg, p).map_err(&err)?;
    let mut exp_avg_sq = moment(&mut s.exp_avg_sq, p).map_err(&err)?;
    // exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    let _ = exp_avg.f_lerp_(&g, 1.0 - beta1).map_err(&err)?;
    let _ = exp_avg_sq.f_mul_scalar_(beta2).map_err(&err)?;
    let _ = exp_avg_sq
        .f_add_(
            &g.f_mul_scalar(1.0 - beta2)
                .map_err(&err)?
                .f_mul(&g)
                .map_err(&err)?,
        )
        .map_err(&err)?;
    let step = s.step as i32;
    let bias_correction1 = 1.0 - beta1.powi(step);
    let bias_correction2 = 1.0 - beta2.powi(step);
    let step_size = lr / bias_correction1;
    let bias_correction2_sqrt = bias_correction2.sqrt();
    let second = if c.amsgrad {
        let max = match s.max_exp_avg_sq.take() {
            Some(m) => m.f_maximum(&exp_avg_sq).map_err(&err)?,
            None => exp_avg_sq.f_detach_copy().map_err(&err)?,
        };
        let out = max.shallow_clone();
        s.max_exp_avg_sq = Some(max);
        out
    } else {
        exp_avg_sq.shallow_clone()
    };
    let denom = second
        .f_sqrt()
        .and_then(|t| t.f_div_scalar(bias_correction2_sqrt))
        .and_then(|t| t.f_add_scalar(c.eps))
        .map_err(&err)?;
    // param.addcdiv_(exp_avg, denom, value=-step_size)
    let update = exp_avg
        .f_div(&denom)
        .and_then(|t| t.f_mul_scalar(-step_size))
        .map_err(&err)?;
    let _ = p.f_add_(&update).map_err(&err)?;
    Ok(())
}

/// Adam's moment buffer of `p` in `slot`, zeros (torch's initial state) on its first
/// step: a shallow clone, so that in-place updates of it update the state.
fn moment(slot: &mut Option<Tensor>, p: &Tensor) -> Result<Tensor, tch::TchError> {
    match slot {
        Some(t) => Ok(t.shallow_clone()),
        None => {
            let zeros = p.f_zeros_like()?;
            *slot = Some(zeros.shallow_clone());
            Ok(zeros)
        }
    }
}

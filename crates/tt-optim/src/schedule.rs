//! Learning-rate schedules as pure functions of the step (torch's closed forms).

use serde::{Deserialize, Serialize};

/// A learning-rate schedule: `lr(step) = base_lr × factor(step)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Schedule {
    /// The base learning rate throughout.
    Constant,
    /// `torch.optim.lr_scheduler.StepLR`: × `gamma` every `step_size` steps.
    Step {
        /// Steps between decays.
        step_size: u64,
        /// Decay factor.
        gamma: f64,
    },
    /// `CosineAnnealingLR`: from the base to `eta_min` over `t_max` steps
    /// (`eta_min + (base - eta_min)(1 + cos(π t / t_max)) / 2`). As in torch, it does
    /// not stop at `t_max`: past it the cosine climbs back (period `2 t_max`).
    Cosine {
        /// Length of the half period.
        t_max: u64,
        /// Learning rate at the end.
        eta_min: f64,
    },
    /// `LinearLR`: factor from `start_factor` to `end_factor` over `total_iters`.
    Linear {
        /// Factor at step 0.
        start_factor: f64,
        /// Factor from `total_iters` on.
        end_factor: f64,
        /// Length of the ramp.
        total_iters: u64,
    },
    /// Linear warm-up from `start_factor` over `warmup` steps, then cosine to
    /// `eta_min` over the following `t_max` steps (`SequentialLR` of `LinearLR` and
    /// `CosineAnnealingLR`, milestone `warmup`; periodic past `t_max` like torch's).
    WarmupCosine {
        /// Warm-up length.
        warmup: u64,
        /// Factor at step 0.
        start_factor: f64,
        /// Cosine length after the warm-up.
        t_max: u64,
        /// Learning rate at the end.
        eta_min: f64,
    },
}

impl Schedule {
    /// The learning rate at `step` (0-based) for `base_lr`.
    pub fn lr(&self, base_lr: f64, step: u64) -> f64 {
        match *self {
            Schedule::Constant => base_lr,
            Schedule::Step { step_size, gamma } => {
                base_lr * gamma.powi((step / step_size.max(1)) as i32)
            }
            Schedule::Cosine { t_max, eta_min } => cosine(base_lr, eta_min, step, t_max),
            Schedule::Linear {
                start_factor,
                end_factor,
                total_iters,
            } => {
                let t = step.min(total_iters) as f64 / total_iters.max(1) as f64;
                base_lr * (start_factor + (end_factor - start_factor) * t)
            }
            Schedule::WarmupCosine {
                warmup,
                start_factor,
                t_max,
                eta_min,
            } => {
                if step < warmup {
                    base_lr * (start_factor + (1.0 - start_factor) * step as f64 / warmup as f64)
                } else {
                    cosine(base_lr, eta_min, step - warmup, t_max)
                }
            }
        }
    }
}

fn cosine(base: f64, eta_min: f64, t: u64, t_max: u64) -> f64 {
    let t_max = t_max.max(1) as f64;
    eta_min + (base - eta_min) * (1.0 + (std::f64::consts::PI * t as f64 / t_max).cos()) / 2.0
}

#[cfg(test)]
mod tests {
    use super::Schedule;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn closed_forms() {
        assert_eq!(Schedule::Constant.lr(0.1, 1000), 0.1);
        let step = Schedule::Step {
            step_size: 10,
            gamma: 0.5,
        };
        assert_eq!(
            [0, 9, 10, 25].map(|s| step.lr(1.0, s)),
            [1.0, 1.0, 0.5, 0.25]
        );
        let cos = Schedule::Cosine {
            t_max: 10,
            eta_min: 0.0,
        };
        assert!(
            close(cos.lr(2.0, 0), 2.0) && close(cos.lr(2.0, 5), 1.0) && close(cos.lr(2.0, 10), 0.0)
        );
        assert!(
            close(cos.lr(2.0, 15), 1.0),
            "periodic past t_max, like torch"
        );
        let lin = Schedule::Linear {
            start_factor: 0.1,
            end_factor: 1.0,
            total_iters: 4,
        };
        assert!(
            close(lin.lr(1.0, 0), 0.1) && close(lin.lr(1.0, 2), 0.55) && close(lin.lr(1.0, 9), 1.0)
        );
        let wc = Schedule::WarmupCosine {
            warmup: 4,
            start_factor: 0.0,
            t_max: 8,
            eta_min: 0.0,
        };
        assert!(close(wc.lr(1.0, 0), 0.0) && close(wc.lr(1.0, 2), 0.5));
        assert!(
            close(wc.lr(1.0, 4), 1.0) && close(wc.lr(1.0, 8), 0.5) && close(wc.lr(1.0, 12), 0.0)
        );
        let json = serde_json::to_string(&wc).unwrap();
        assert_eq!(serde_json::from_str::<Schedule>(&json).unwrap(), wc);
    }
}

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// `torch.optim.SGD`'s hyper-parameters, with its defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Learning rate (torch's default 1e-3).
    pub lr: f64,
    /// Momentum factor.
    pub momentum: f64,
    /// Dampening for momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and no dampening).
    pub nesterov: bool,
    /// Maximise instead of minimise.
    pub maximize: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }
}

/// `torch.optim.Adam` / `AdamW`'s hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Coefficients of the running averages of the gradient and its square.
    pub betas: (f64, f64),
    /// Added to the denominator (default 1e-8).
    pub eps: f64,
    /// Adam: L2 penalty added to the gradient (default 0). AdamW: decoupled decay
    /// (default 1e-2).
    pub weight_decay: f64,
    /// The AMSGrad variant.
    pub amsgrad: bool,
    /// Maximise instead of minimise.
    pub maximize: bool,
}

impl AdamConfig {
    /// `torch.optim.Adam`'s defaults.
    pub fn adam() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
            maximize: false,
        }
    }

    /// `torch.optim.AdamW`'s defaults (weight decay 1e-2).
    pub fn adamw() -> Self {
        AdamConfig {
            weight_decay: 1e-2,
            ..AdamConfig::adam()
        }
    }
}

/// Which optimizer, with its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Algorithm {
    /// `torch.optim.SGD`.
    Sgd(SgdConfig),
    /// `torch.optim.Adam` (weight decay as L2 on the gradient).
    Adam(AdamConfig),
    /// `torch.optim.AdamW` (decoupled weight decay).
    AdamW(AdamConfig),
}

fn check(ok: bool, what: &str, value: f64) -> Result<()> {
    if ok && value.is_finite() {
        Ok(())
    } else {
        Err(Error::InvalidConfig {
            reason: format!("{what} = {value} is invalid"),
        })
    }
}

impl Algorithm {
    /// The base learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Algorithm::Sgd(c) => c.lr,
            Algorithm::Adam(c) | Algorithm::AdamW(c) => c.lr,
        }
    }

    /// Refuses what torch refuses (negative values, betas outside [0, 1), Nesterov
    /// without momentum or with dampening).
    pub fn validate(&self) -> Result<()> {
        match self {
            Algorithm::Sgd(c) => {
                check(c.lr >= 0.0, "lr (must be >= 0)", c.lr)?;
                check(c.momentum >= 0.0, "momentum (must be >= 0)", c.momentum)?;
                check(
                    c.weight_decay >= 0.0,
                    "weight_decay (must be >= 0)",
                    c.weight_decay,
                )?;
                check(c.dampening.is_finite(), "dampening", c.dampening)?;
                if c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0) {
                    return Err(Error::InvalidConfig {
                        reason:
                            "nesterov momentum needs momentum > 0 and dampening = 0 (as in torch)"
                                .into(),
                    });
                }
                Ok(())
            }
            Algorithm::Adam(c) | Algorithm::AdamW(c) => {
                check(c.lr >= 0.0, "lr (must be >= 0)", c.lr)?;
                check(c.eps >= 0.0, "eps (must be >= 0)", c.eps)?;
                check(
                    (0.0..1.0).contains(&c.betas.0),
                    "betas.0 (must be in [0, 1))",
                    c.betas.0,
                )?;
                check(
                    (0.0..1.0).contains(&c.betas.1),
                    "betas.1 (must be in [0, 1))",
                    c.betas.1,
                )?;
                check(
                    c.weight_decay >= 0.0,
                    "weight_decay (must be >= 0)",
                    c.weight_decay,
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_defaults_and_refusals() {
        assert_eq!(AdamConfig::adamw().weight_decay, 1e-2);
        assert_eq!(AdamConfig::adam().betas, (0.9, 0.999));
        assert!(Algorithm::Sgd(SgdConfig {
            momentum: 0.9,
            nesterov: true,
            ..Default::default()
        })
        .validate()
        .is_ok());
        let bad = [
            Algorithm::Sgd(SgdConfig {
                nesterov: true,
                momentum: 0.9,
                dampening: 0.1,
                ..Default::default()
            }),
            Algorithm::Sgd(SgdConfig {
                lr: f64::INFINITY,
                ..Default::default()
            }),
            Algorithm::Adam(AdamConfig {
                betas: (0.9, -0.1),
                ..AdamConfig::adam()
            }),
            Algorithm::AdamW(AdamConfig {
                weight_decay: -1.0,
                ..AdamConfig::adamw()
            }),
        ];
        for alg in bad {
            assert!(
                matches!(alg.validate(), Err(Error::InvalidConfig { .. })),
                "{alg:?}"
            );
        }
    }
}

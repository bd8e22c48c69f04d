//! The arithmetic of a run: [`Precision`], and float16's loss scaler
//! ([`GradScaler`]), a building block of its own for hand-written loops.

use tch::Tensor;

use crate::TrainError;

/// The arithmetic of the forward pass (`TrainConfig::precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Precision {
    /// float32 throughout (the default).
    #[default]
    Full,
    /// The step function runs under autocast to bfloat16 (`torch.autocast(dtype=
    /// torch.bfloat16)`) on the CPU or CUDA; gradients and parameters stay float32.
    Bf16,
    /// Autocast to float16 with dynamic loss scaling (`torch.amp.GradScaler`): the loss
    /// is multiplied by a scale before backward, the gradients divided after; a step
    /// whose gradients hold an inf or NaN is skipped and the scale halved, and the scale
    /// doubles after 2000 good steps. The scale is saved in checkpoints.
    Fp16,
}

impl Precision {
    /// The dtype the step function runs under autocast in, if any.
    pub(crate) fn autocast_kind(self) -> Option<tch::Kind> {
        match self {
            Precision::Full => None,
            Precision::Bf16 => Some(tch::Kind::BFloat16),
            Precision::Fp16 => Some(tch::Kind::Half),
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = TrainError;

    /// `full` (or `fp32`), `bf16` or `fp16`, as a command-line flag or variable says it.
    fn from_str(s: &str) -> Result<Precision, TrainError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "full" | "fp32" | "float32" => Ok(Precision::Full),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "fp16" | "float16" | "half" => Ok(Precision::Fp16),
            _ => Err(TrainError::Config {
                reason: format!("precision {s:?}: use full, bf16 or fp16"),
            }),
        }
    }
}

/// PyTorch's `torch.amp.GradScaler` for float16 training. The loss is multiplied by
/// [`scale`](Self::scale) before backward ([`scale_loss`](Self::scale_loss)), so that
/// small gradients survive float16; [`unscale`](Self::unscale) divides the gradients by
/// it again and says whether they are all finite; [`update`](Self::update) then skips a
/// step whose gradients are not (multiplying the scale by the backoff factor) and
/// multiplies the scale by the growth factor after `growth_interval` good steps in a row.
/// The defaults are PyTorch's: 65536, 2.0, 0.5, 2000. The trainer (`Trainer`) uses one
/// under [`Precision::Fp16`] and saves it in its checkpoints.
///
/// ```
/// use tt_train::GradScaler;
///
/// let mut scaler = GradScaler::default();
/// assert_eq!(scaler.scale(), 65536.0);
/// assert!(!scaler.update(false)); // gradients not finite: skip the step
/// assert_eq!(scaler.scale(), 32768.0);
/// let scaler = GradScaler::new(1024.0, 2.0, 0.5, 100).expect("valid factors");
/// assert_eq!(scaler.scale(), 1024.0);
/// assert!(GradScaler::new(1024.0, 0.5, 0.5, 100).is_err(), "growth must be above 1");
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScaler {
    scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u64,
    /// Good steps since the scale last changed.
    good_steps: u64,
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            good_steps: 0,
        }
    }
}

impl GradScaler {
    /// A scaler starting at `init_scale`, as `torch.amp.GradScaler(init_scale,
    /// growth_factor, backoff_factor, growth_interval)`. Refused, naming the value: a
    /// scale that is not a positive finite number, a growth factor not above 1, a
    /// backoff factor not between 0 and 1, an interval of 0.
    pub fn new(
        init_scale: f64,
        growth_factor: f64,
        backoff_factor: f64,
        growth_interval: u64,
    ) -> Result<GradScaler, TrainError> {
        let bad = |what: String| {
            Err(TrainError::Config {
                reason: format!("GradScaler: {what}"),
            })
        };
        if !(init_scale.is_finite() && init_scale > 0.0) {
            return bad(format!("init_scale {init_scale} must be a positive number"));
        }
        if !(growth_factor.is_finite() && growth_factor > 1.0) {
            return bad(format!("growth_factor {growth_factor} must be above 1"));
        }
        if !(backoff_factor > 0.0 && backoff_factor < 1.0) {
            return bad(format!(
                "backoff_factor {backoff_factor} must be between 0 and 1"
            ));
        }
        if growth_interval == 0 {
            return bad("growth_interval must be at least 1 step".into());
        }
        Ok(GradScaler {
            scale: init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            good_steps: 0,
        })
    }

    /// The scale now.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Good steps in a row since the scale last changed.
    pub fn good_steps(&self) -> u64 {
        self.good_steps
    }

    /// `loss` in float32 times the scale: what to call backward on.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor, tch::TchError> {
        loss.f_to_kind(tch::Kind::Float)?.f_mul_scalar(self.scale)
    }

    /// Divides every defined gradient of `params` by the scale (in place); whether all
    /// of them are finite. One host sync, as in PyTorch: whether the step is taken
    /// depends on it.
    pub fn unscale(&self, params: &[Tensor]) -> Result<bool, tch::TchError> {
        let _guard = tch::no_grad_guard();
        // Per gradient on its device, read once at the end.
        let mut finite: Option<Tensor> = None;
        for g in params.iter().map(Tensor::grad).filter(Tensor::defined) {
            let _ = g.shallow_clone().f_mul_scalar_(1.0 / self.scale)?;
            let this = g.f_isfinite()?.f_all()?;
            finite = Some(match finite {
                Some(f) => f.f_logical_and(&this)?,
                None => this,
            });
        }
        Ok(finite.is_none_or(|f| f.int64_value(&[]) != 0))
    }

    /// After [`unscale`](Self::unscale): with finite gradients, counts a good step
    /// (growing the scale after `growth_interval` of them) and returns `true`, take the
    /// optimizer's step; otherwise backs the scale off and returns `false`, skip it.
    pub fn update(&mut self, finite: bool) -> bool {
        if finite {
            self.good_steps += 1;
            if self.good_steps == self.growth_interval {
                self.scale *= self.growth_factor;
                self.good_steps = 0;
            }
        } else {
            self.scale *= self.backoff_factor;
            self.good_steps = 0;
        }
        finite
    }

    /// What a checkpoint keeps: the scale and the good steps since it changed.
    pub(crate) fn state(&self) -> (f64, u64) {
        (self.scale, self.good_steps)
    }

    /// The default scaler at a checkpoint's `state`.
    pub(crate) fn restored((scale, good_steps): (f64, u64)) -> GradScaler {
        GradScaler {
            scale,
            good_steps,
            ..GradScaler::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::GradScaler;
    use tch::{Kind, Tensor};

    #[test]
    fn the_scale_grows_after_the_interval_and_backs_off_on_a_bad_step() {
        let mut s = GradScaler::new(8.0, 2.0, 0.5, 3).unwrap_or_else(|e| panic!("{e}"));
        assert!(s.update(true) && s.update(true));
        assert_eq!((s.scale(), s.good_steps()), (8.0, 2));
        assert!(s.update(true));
        assert_eq!(
            (s.scale(), s.good_steps()),
            (16.0, 0),
            "grown after 3 good steps"
        );
        s.update(true);
        assert!(!s.update(false), "a bad step is skipped");
        assert_eq!(
            (s.scale(), s.good_steps()),
            (8.0, 0),
            "backed off, count reset"
        );
        let back = GradScaler::restored(s.state());
        assert_eq!(back.state(), s.state());
    }

    #[test]
    fn unscaling_divides_the_gradients_and_finds_an_infinity() {
        let s = GradScaler::new(4.0, 2.0, 0.5, 10).unwrap_or_else(|e| panic!("{e}"));
        let w = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let loss = (&w * &w).sum(Kind::Float);
        s.scale_loss(&loss)
            .unwrap_or_else(|e| panic!("{e}"))
            .backward();
        // d(4 * sum w^2)/dw = 8w; unscaled: 2w.
        assert!(s.unscale(&[w.shallow_clone()]).unwrap_or(false));
        assert_eq!(
            Vec::<f32>::try_from(&w.grad()).unwrap_or_default(),
            [2.0, 4.0]
        );
        let v = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        (&v * f64::INFINITY).sum(Kind::Float).backward();
        assert!(
            !s.unscale(&[w, v]).unwrap_or(true),
            "an inf gradient is found"
        );
    }

    #[test]
    fn bad_factors_are_refused_naming_the_value() {
        for (args, says) in [
            ((0.0, 2.0, 0.5, 1), "init_scale 0"),
            ((f64::NAN, 2.0, 0.5, 1), "init_scale NaN"),
            ((1.0, 1.0, 0.5, 1), "growth_factor 1"),
            ((1.0, 2.0, 1.0, 1), "backoff_factor 1"),
            ((1.0, 2.0, 0.5, 0), "growth_interval"),
        ] {
            let e = GradScaler::new(args.0, args.1, args.2, args.3)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains(says), "{args:?}: {e}");
        }
    }
}

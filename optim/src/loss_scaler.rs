//! Loss scaling, static or dynamic, with PyTorch `GradScaler`'s rule.

use serde::{Deserialize, Serialize};

/// How the loss is scaled before backward.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum LossScaling {
    /// No scaling (scale 1). Non-finite steps are still skipped.
    None,
    /// A fixed scale.
    Static {
        /// The scale.
        scale: f64,
    },
    /// PyTorch's `GradScaler`: grow by `growth_factor` after
    /// `growth_interval` good steps in a row, multiply by `backoff_factor`
    /// on a step with inf/NaN gradients.
    Dynamic {
        /// Initial scale (PyTorch: 2^16).
        init_scale: f64,
        /// Growth factor (2).
        growth_factor: f64,
        /// Backoff factor (0.5).
        backoff_factor: f64,
        /// Good steps between growths (2000).
        growth_interval: u32,
    },
}

impl LossScaling {
    /// Checks the ranges.
    ///
    /// # Errors
    /// [`Error::Config`](crate::error::Error::Config) naming the field.
    pub fn validate(&self) -> crate::error::Result<()> {
        let bad = |field, reason: String| Err(crate::error::Error::Config { field, reason });
        match *self {
            Self::None => Ok(()),
            Self::Static { scale } if !(scale > 0.0 && scale.is_finite()) => bad(
                "loss_scaling.static.scale",
                format!("{scale} must be finite and > 0"),
            ),
            Self::Static { .. } => Ok(()),
            Self::Dynamic {
                init_scale,
                growth_factor,
                backoff_factor,
                growth_interval,
            } => {
                if !(init_scale > 0.0 && init_scale.is_finite()) {
                    bad(
                        "loss_scaling.dynamic.init_scale",
                        format!("{init_scale} must be finite and > 0"),
                    )
                } else if !(growth_factor > 1.0 && growth_factor.is_finite()) {
                    bad(
                        "loss_scaling.dynamic.growth_factor",
                        format!("{growth_factor} must be > 1"),
                    )
                } else if !(backoff_factor > 0.0 && backoff_factor < 1.0) {
                    bad(
                        "loss_scaling.dynamic.backoff_factor",
                        format!("{backoff_factor} must be in (0, 1)"),
                    )
                } else if growth_interval == 0 {
                    bad(
                        "loss_scaling.dynamic.growth_interval",
                        "must be at least 1".into(),
                    )
                } else {
                    Ok(())
                }
            }
        }
    }

    /// PyTorch `GradScaler`'s defaults.
    pub fn dynamic() -> Self {
        Self::Dynamic {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// The state of loss scaling: the current scale and the run of good steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The rule.
    pub config: LossScaling,
    /// The current scale.
    pub scale: f64,
    /// Good steps since the last growth or backoff.
    pub growth_tracker: u32,
}

impl LossScaler {
    /// A scaler at its initial scale.
    pub fn new(config: LossScaling) -> Self {
        let scale = match config {
            LossScaling::None => 1.0,
            LossScaling::Static { scale } => scale,
            LossScaling::Dynamic { init_scale, .. } => init_scale,
        };
        Self {
            config,
            scale,
            growth_tracker: 0,
        }
    }

    /// Records a step's outcome: `found_inf` backs off (dynamic), a run of
    /// `growth_interval` good steps grows the scale (if the grown scale is
    /// finite), exactly as `torch._amp_update_scale_`.
    pub fn update(&mut self, found_inf: bool) {
        let LossScaling::Dynamic {
            growth_factor,
            backoff_factor,
            growth_interval,
            ..
        } = self.config
        else {
            return;
        };
        if found_inf {
            self.scale *= backoff_factor;
            self.growth_tracker = 0;
            return;
        }
        let good = self.growth_tracker + 1;
        if good >= growth_interval {
            let grown = self.scale * growth_factor;
            if grown.is_finite() {
                self.scale = grown;
            }
            self.growth_tracker = 0;
        } else {
            self.growth_tracker = good;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_and_backoff_hand_worked() {
        let mut s = LossScaler::new(LossScaling::Dynamic {
            init_scale: 8.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 3,
        });
        // good, good, good -> grow to 16; inf -> 8; good, good -> tracker 2; inf -> 4;
        // good x3 -> 8.
        let outcomes = [
            false, false, false, true, false, false, true, false, false, false,
        ];
        let mut trace = vec![];
        for inf in outcomes {
            s.update(inf);
            trace.push((s.scale, s.growth_tracker));
        }
        assert_eq!(
            trace,
            [
                (8.0, 1),
                (8.0, 2),
                (16.0, 0),
                (8.0, 0),
                (8.0, 1),
                (8.0, 2),
                (4.0, 0),
                (4.0, 1),
                (4.0, 2),
                (8.0, 0)
            ]
        );
    }

    #[test]
    fn pytorch_defaults_and_static_scales_never_move() {
        let mut d = LossScaler::new(LossScaling::dynamic());
        assert_eq!(d.scale, 65536.0);
        for _ in 0..1999 {
            d.update(false);
        }
        assert_eq!(d.scale, 65536.0);
        d.update(false);
        assert_eq!(d.scale, 131072.0);
        let mut s = LossScaler::new(LossScaling::Static { scale: 128.0 });
        s.update(true);
        s.update(false);
        assert_eq!(s.scale, 128.0);
        let mut n = LossScaler::new(LossScaling::None);
        n.update(true);
        assert_eq!(n.scale, 1.0);
    }

    #[test]
    fn growth_stops_short_of_infinity() {
        let mut s = LossScaler::new(LossScaling::Dynamic {
            init_scale: f64::MAX,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 1,
        });
        s.update(false);
        assert_eq!(s.scale, f64::MAX);
    }
}

//! Learning-rate schedules.

/// A learning rate as a function of the step (1-based: the step being taken).
pub trait LrSchedule: std::fmt::Debug + Send + Sync {
    /// The learning rate of `step`.
    fn lr(&self, step: u64) -> f64;
}

/// The same rate at every step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Constant(pub f64);

impl LrSchedule for Constant {
    fn lr(&self, _step: u64) -> f64 {
        self.0
    }
}

/// Linear warmup from 0 to `peak` over `warmup` steps, then cosine decay to
/// `min` at `total` steps, `min` after.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupCosine {
    /// Peak rate, reached at the end of warmup.
    pub peak: f64,
    /// Final rate.
    pub min: f64,
    /// Warmup steps.
    pub warmup: u64,
    /// Total steps (warmup included).
    pub total: u64,
}

impl LrSchedule for WarmupCosine {
    fn lr(&self, step: u64) -> f64 {
        if step <= self.warmup {
            return self.peak * step as f64 / self.warmup.max(1) as f64;
        }
        if step >= self.total {
            return self.min;
        }
        let progress = (step - self.warmup) as f64 / (self.total - self.warmup) as f64;
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = WarmupCosine {
            peak: 1.0,
            min: 0.1,
            warmup: 10,
            total: 110,
        };
        assert_eq!(s.lr(0), 0.0);
        assert_eq!(s.lr(5), 0.5);
        assert_eq!(s.lr(10), 1.0);
        assert!((s.lr(60) - 0.55).abs() < 1e-12); // halfway: min + (peak - min) / 2
        assert_eq!(s.lr(110), 0.1);
        assert_eq!(s.lr(1000), 0.1);
        assert!((1..110).all(|t| s.lr(t + 10) <= s.lr(t + 9) + 1e-15 || t + 9 < 10));
        assert_eq!(Constant(0.3).lr(7), 0.3);
    }
}

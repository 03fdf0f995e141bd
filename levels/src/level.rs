//! The optimization levels and the one table that says how each stores every
//! class of tensor (docs/ARCHITECTURE.md, "Levels"). Nothing else in the
//! crate names a level.

use amp_optim::StateFormat;
use serde::{Deserialize, Serialize};

/// An optimization level (MS-AMP's O1-O3 plus the O0 baseline).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Level {
    /// Everything F32 (the baseline).
    #[default]
    O0,
    /// FP16 scaled weights, FP8 weight gradients, F32 Adam moments.
    O1,
    /// O1 with an FP8 first and FP16 second moment.
    O2,
    /// FP8 weights with an FP16 master, sharded with the moments.
    O3,
}

/// How a Linear weight is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightStorage {
    /// F32 `Var`.
    F32,
    /// Scaled FP16; the copy is the master.
    F16,
    /// FP8 E4M3 working copy plus a scaled FP16 master.
    Fp8WithMaster,
}

/// How a Linear weight gradient is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradStorage {
    /// F32, in candle's `GradStore`.
    F32,
    /// FP8 E4M3, handed to a sink by the layer's backward.
    Fp8,
}

/// Storage of every tensor class at one level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Linear weights.
    pub linear_weight: WeightStorage,
    /// Linear weight gradients.
    pub linear_grad: GradStorage,
    /// Adam moments (m, v) of Linear weights.
    pub linear_moments: (StateFormat, StateFormat),
    /// Adam moments of every other parameter (embeddings, norms, biases),
    /// whose weights and gradients stay F32.
    pub other_moments: (StateFormat, StateFormat),
    /// Master weights and moments are sharded across ranks (ZeRO).
    pub sharded: bool,
}

const F32_MOMENTS: (StateFormat, StateFormat) = (StateFormat::F32, StateFormat::F32);
const LOW_BIT_MOMENTS: (StateFormat, StateFormat) = (StateFormat::E4M3, StateFormat::F16);

impl Level {
    /// The table (docs/ARCHITECTURE.md, "Levels").
    pub const fn policy(self) -> Policy {
        use GradStorage as G;
        use WeightStorage as W;
        let (linear_weight, linear_grad, linear_moments, other_moments, sharded) = match self {
            Self::O0 => (W::F32, G::F32, F32_MOMENTS, F32_MOMENTS, false),
            Self::O1 => (W::F16, G::Fp8, F32_MOMENTS, F32_MOMENTS, false),
            Self::O2 => (W::F16, G::Fp8, LOW_BIT_MOMENTS, LOW_BIT_MOMENTS, false),
            Self::O3 => (
                W::Fp8WithMaster,
                G::Fp8,
                LOW_BIT_MOMENTS,
                LOW_BIT_MOMENTS,
                true,
            ),
        };
        Policy {
            linear_weight,
            linear_grad,
            linear_moments,
            other_moments,
            sharded,
        }
    }

    /// Every level, in order.
    pub const ALL: [Level; 4] = [Level::O0, Level::O1, Level::O2, Level::O3];

    /// Persistent bytes per Linear parameter that the table predicts on
    /// `ranks` ranks, derived from the storages (scales not counted):
    /// O0 16, O1 11, O2 6, O3 2 + 5/N.
    pub fn predicted_bytes_per_linear_param(self, ranks: usize) -> f64 {
        self.policy().predicted_bytes_per_linear_param(ranks)
    }
}

impl Policy {
    /// This policy with the second Adam moment in FP8 wherever the first
    /// one is FP8 (`AmpConfig::fp8_moments`): E4M3 square roots
    /// ([`StateFormat::E4M3Sqrt`]) instead of FP16. F32 moments stay F32.
    pub const fn with_fp8_moments(mut self) -> Self {
        if matches!(self.linear_moments.0, StateFormat::E4M3) {
            self.linear_moments.1 = StateFormat::E4M3Sqrt;
        }
        if matches!(self.other_moments.0, StateFormat::E4M3) {
            self.other_moments.1 = StateFormat::E4M3Sqrt;
        }
        self
    }

    /// Persistent bytes per Linear parameter this policy predicts on
    /// `ranks` ranks, derived from the storages (scales not counted).
    pub fn predicted_bytes_per_linear_param(&self, ranks: usize) -> f64 {
        let p = self;
        let shard = if p.sharded {
            1.0 / ranks.max(1) as f64
        } else {
            1.0
        };
        let (working, master) = match p.linear_weight {
            WeightStorage::F32 => (4.0, 0.0),
            WeightStorage::F16 => (0.0, 2.0),
            WeightStorage::Fp8WithMaster => (1.0, 2.0),
        };
        let grad = match p.linear_grad {
            GradStorage::F32 => 4.0,
            GradStorage::Fp8 => 1.0,
        };
        let moments = state_bytes(p.linear_moments.0) + state_bytes(p.linear_moments.1);
        // At O1/O2 the FP16 weight is the master and is not sharded.
        let master_shard = if working > 0.0 { shard } else { 1.0 };
        working + grad + master * master_shard + moments * shard
    }
}

/// Bytes per element of a moment format.
pub fn state_bytes(f: StateFormat) -> f64 {
    match f {
        StateFormat::F32 => 4.0,
        StateFormat::F16 => 2.0,
        StateFormat::E4M3 | StateFormat::E5M2 | StateFormat::E4M3Sqrt => 1.0,
    }
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

impl std::str::FromStr for Level {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_uppercase().as_str() {
            "O0" => Ok(Self::O0),
            "O1" => Ok(Self::O1),
            "O2" => Ok(Self::O2),
            "O3" => Ok(Self::O3),
            _ => Err(format!("unknown level `{s}`: O0, O1, O2 or O3")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predictions_are_designs() {
        let p: Vec<f64> = Level::ALL
            .iter()
            .map(|l| l.predicted_bytes_per_linear_param(1))
            .collect();
        assert_eq!(p, [16.0, 11.0, 6.0, 7.0]);
        assert_eq!(Level::O3.predicted_bytes_per_linear_param(5), 3.0);
        assert_eq!(Level::O2.predicted_bytes_per_linear_param(5), 6.0);
    }
}

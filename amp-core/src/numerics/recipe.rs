//! Scaling recipes: MS-AMP's current scaling, Transformer Engine's
//! `DelayedScaling` and `Float8BlockScaling` with TE's field names and
//! defaults (but E4M3 gradients by default: [`DelayedScaling`]), torchao's
//! rowwise scaling; serde (JSON, TOML).
//!
//! ```
//! use amp_core::{DelayedScaling, Format, AmaxComputeAlgo};
//! let r = DelayedScaling::from_json(r#"{"margin": 1, "amax_history_len": 16}"#)?;
//! assert_eq!(r.margin, 1);
//! assert_eq!(r.fp8_format, Format::E4M3);                 // ours (TE: HYBRID)
//! assert_eq!(r.amax_compute_algo, AmaxComputeAlgo::Max);  // TE default
//! let e = DelayedScaling::from_toml("amax_history_len = 0").unwrap_err();
//! assert!(e.to_string().contains("amax_history_len"));
//! # Ok::<(), amp_core::Error>(())
//! ```

use crate::error::{Error, Result};
use crate::numerics::config::{self, Validate};
use crate::numerics::format::Fp8Format;
use crate::numerics::scale::{FromAmax, ScaleRule};
use serde::{Deserialize, Serialize};

/// Which FP8 format each pass uses (TE's `Format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Format {
    /// E4M3 in forward and backward.
    E4M3,
    /// E5M2 in forward and backward (TE refuses it for training; so do we).
    E5M2,
    /// E4M3 forward (activations, weights), E5M2 backward (gradients).
    #[default]
    #[serde(rename = "HYBRID")]
    Hybrid,
}

impl Format {
    /// The format of forward tensors (inputs, weights).
    pub fn forward(self) -> Fp8Format {
        match self {
            Self::E5M2 => Fp8Format::E5M2,
            Self::E4M3 | Self::Hybrid => Fp8Format::E4M3,
        }
    }

    /// The format of backward tensors (output gradients).
    pub fn backward(self) -> Fp8Format {
        match self {
            Self::E4M3 => Fp8Format::E4M3,
            Self::E5M2 | Self::Hybrid => Fp8Format::E5M2,
        }
    }
}

/// How delayed scaling reduces the amax history (TE's `amax_compute_algo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AmaxComputeAlgo {
    /// The maximum over the whole history.
    #[default]
    Max,
    /// The most recent amax only.
    MostRecent,
}

/// Which GEMMs of a Linear run in higher precision instead of FP8
/// (TE's `_OverrideLinearPrecision`). Accepts `{"fprop": .., "dgrad": ..,
/// "wgrad": ..}` or TE's tuple form `[fprop, dgrad, wgrad]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
pub struct OverrideLinearPrecision {
    /// Forward GEMM (input x weight).
    pub fprop: bool,
    /// Input-gradient GEMM (grad_output x weight).
    pub dgrad: bool,
    /// Weight-gradient GEMM (grad_output x input).
    pub wgrad: bool,
}

impl<'de> Deserialize<'de> for OverrideLinearPrecision {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::{Error as _, MapAccess, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OverrideLinearPrecision;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("[fprop, dgrad, wgrad] booleans or a table of fprop, dgrad, wgrad")
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                let mut flags = [false; 3];
                for (i, flag) in flags.iter_mut().enumerate() {
                    *flag = seq
                        .next_element()?
                        .ok_or_else(|| A::Error::invalid_length(i, &self))?;
                }
                if seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    return Err(A::Error::invalid_length(4, &self));
                }
                let [fprop, dgrad, wgrad] = flags;
                Ok(OverrideLinearPrecision {
                    fprop,
                    dgrad,
                    wgrad,
                })
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                let mut out = OverrideLinearPrecision::default();
                while let Some(key) = map.next_key::<String>()? {
                    let slot = match key.as_str() {
                        "fprop" => &mut out.fprop,
                        "dgrad" => &mut out.dgrad,
                        "wgrad" => &mut out.wgrad,
                        other => {
                            return Err(A::Error::unknown_field(
                                other,
                                &["fprop", "dgrad", "wgrad"],
                            ))
                        }
                    };
                    *slot = map.next_value()?;
                }
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }
}

/// Transformer Engine's `DelayedScaling` recipe: scales come from an amax
/// history, so a cast reads its input once.
///
/// Defaults are TE's (margin 0, interval 1, history 1024, `max`, no
/// override) but for two: `fp8_format` is **E4M3** (the gradients in E4M3
/// too) where TE's default is HYBRID (E5M2 gradients), and
/// `calibrate_first_step` (ours) is **true**: a tensor's first cast takes
/// its scale from its own amax, not TE's initial 1. Measured here
/// (BENCHMARKS.md, "loss parity of every level and FP8 path"): E4M3 trains
/// closer to O0 (+0.17% over 18 seeds of GPT-125M at O2 against HYBRID's
/// +2.3% over five, a loss in every seed, at a peak rate of 1e-3), and at
/// TE's initial scale of 1 the first step's E4M3 output gradients flush to
/// zero almost whole, which cost O2 0.50% of validation loss over ten
/// seeds (+0.51% from O0 against +0.00% calibrated, standard errors 0.12
/// and 0.15). A TE recipe
/// file that names its `fp8_format` means what it means there; one that
/// leaves it out gets E4M3 here; `fp8_format = "HYBRID"` and
/// `calibrate_first_step = false` are TE's behaviour. `reduce_amax` (TE:
/// all-reduce amaxes across data-parallel ranks) defaults to true.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DelayedScaling {
    /// The scale is divided by `2^margin` (headroom).
    pub margin: u32,
    /// Recompute the scale every `interval` steps (at least 1).
    pub interval: u32,
    /// FP8 formats of the forward and backward passes.
    pub fp8_format: Format,
    /// Length of the amax history (1 to [`MAX_AMAX_HISTORY_LEN`]).
    pub amax_history_len: usize,
    /// How the history becomes one amax.
    pub amax_compute_algo: AmaxComputeAlgo,
    /// GEMMs to run in higher precision.
    pub override_linear_precision: OverrideLinearPrecision,
    /// All-reduce amaxes across data-parallel ranks before the update.
    pub reduce_amax: bool,
    /// Not Transformer Engine's (true by default; false is TE's
    /// behaviour): the first cast of each tensor, which has no history
    /// yet, takes its scale from its own amax (as current scaling does,
    /// one pass more) instead of the initial scale of 1, at which a step's
    /// small output gradients flush to zero (in the tiny GPT's first step
    /// about half of them in E5M2, BENCHMARKS.md, "delayed scaling's casts
    /// under telemetry"; 97% of the first block's in E4M3, the default
    /// format, whose smallest subnormal is 2^-9). From the second step on
    /// the history sets the scale either way.
    pub calibrate_first_step: bool,
}

impl Default for DelayedScaling {
    fn default() -> Self {
        Self {
            margin: 0,
            interval: 1,
            fp8_format: Format::E4M3,
            amax_history_len: 1024,
            amax_compute_algo: AmaxComputeAlgo::Max,
            override_linear_precision: OverrideLinearPrecision::default(),
            reduce_amax: true,
            calibrate_first_step: true,
        }
    }
}

/// Largest margin accepted: past it every scale would underflow.
pub const MAX_MARGIN: u32 = 64;

/// Longest amax history accepted: 64 times Transformer Engine's default
/// (1024; TE itself sets no bound). Each scaled tensor keeps one F32 per
/// slot on its device and the delayed update reads them all every step, so
/// a history of millions would exhaust memory before training started.
pub const MAX_AMAX_HISTORY_LEN: usize = 65_536;

/// An amax history length in `1..=MAX_AMAX_HISTORY_LEN`.
pub(crate) fn check_history_len(len: usize) -> Result<()> {
    if len == 0 {
        return Err(Error::Config {
            field: "amax_history_len".into(),
            reason: "must be at least 1".into(),
        });
    }
    if len > MAX_AMAX_HISTORY_LEN {
        return Err(Error::Config {
            field: "amax_history_len".into(),
            reason: format!("{len} is longer than {MAX_AMAX_HISTORY_LEN}"),
        });
    }
    Ok(())
}

fn check_margin(margin: u32) -> Result<()> {
    if margin > MAX_MARGIN {
        return Err(Error::Config {
            field: "margin".into(),
            reason: format!("{margin} is larger than {MAX_MARGIN}"),
        });
    }
    Ok(())
}

impl Validate for DelayedScaling {
    fn validate(&self) -> Result<()> {
        check_margin(self.margin)?;
        if self.interval == 0 {
            return Err(Error::Config {
                field: "interval".into(),
                reason: "must be at least 1".into(),
            });
        }
        check_history_len(self.amax_history_len)?;
        if self.fp8_format == Format::E5M2 {
            return Err(Error::Config {
                field: "fp8_format".into(),
                reason: "E5M2 in the forward pass is not supported (as in TE): use HYBRID or E4M3"
                    .into(),
            });
        }
        Ok(())
    }
}

/// MS-AMP's current scaling: each cast takes its scale from the tensor's own
/// amax (two reads: amax, then cast).
///
/// Defaults: margin 0, E4M3 in both passes, power-of-two scales. MS-AMP
/// and Transformer Engine send the gradients as E5M2 (`HYBRID`); over
/// five seeds of GPT-125M on the GPU that cost 2.2% of validation loss
/// against O0 at O2, E4M3 gradients -0.23% over 18 seeds (within two
/// standard errors of O0), both at a peak rate of 1e-3; at 5e-4, where
/// O0's seeds agree to 0.2%, E4M3 lands +0.27% (s.e. 0.15) over ten
/// (BENCHMARKS.md, "loss parity of every level and FP8 path"). So this
/// recipe's default is E4M3; `fp8_format = "HYBRID"` is MS-AMP's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CurrentScaling {
    /// The scale is divided by `2^margin` (headroom).
    pub margin: u32,
    /// FP8 formats of the forward and backward passes.
    pub fp8_format: Format,
    /// How the scale follows from the amax (MS-AMP: power of two).
    pub scale_rule: ScaleRule,
}

impl Default for CurrentScaling {
    fn default() -> Self {
        Self {
            margin: 0,
            fp8_format: Format::E4M3,
            scale_rule: ScaleRule::PowerOfTwo,
        }
    }
}

impl Validate for CurrentScaling {
    fn validate(&self) -> Result<()> {
        check_margin(self.margin)?;
        if self.fp8_format == Format::E5M2 {
            return Err(Error::Config {
                field: "fp8_format".into(),
                reason: "E5M2 in the forward pass is not supported: use HYBRID or E4M3".into(),
            });
        }
        Ok(())
    }
}

/// Block scaling (Transformer Engine's `Float8BlockScaling`, DeepSeek-V3's
/// recipe): one scale per 1 x 128 tile (dimension 1) or 128 x 128 block
/// (dimension 2) of each GEMM operand, each from its own tile's amax.
///
/// ```
/// use amp_core::{Float8BlockScaling, Tiling};
/// let r = Float8BlockScaling::from_json(r#"{"fp8_format": "E4M3", "w_block_scaling_dim": 2}"#)?;
/// assert_eq!(r.weight_tiling(), Tiling::Blk128);
/// assert_eq!(r.input_tiling(), Tiling::Vec128);
/// let bad = Float8BlockScaling::from_json(r#"{"x_block_scaling_dim": 2}"#).unwrap_err();
/// assert!(bad.to_string().contains("x_block_scaling_dim"));
/// # Ok::<(), amp_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Float8BlockScaling {
    /// FP8 formats of the forward and backward passes (TE's default here:
    /// E4M3 both ways; HYBRID puts gradients in E5M2).
    pub fp8_format: Format,
    /// Tiles of the inputs: 1 (1 x 128 along the features). TE takes 1 or
    /// 2; a 128 x 128 input would meet a 128 x 128 weight in fprop, which
    /// Hopper's GEMM refuses, so 1 only.
    pub x_block_scaling_dim: u8,
    /// Tiles of the weights: 2 (128 x 128 blocks, the default) or 1.
    pub w_block_scaling_dim: u8,
    /// Tiles of the output gradients: 1 only (as for the inputs: dgrad
    /// meets the weight's blocks).
    pub grad_block_scaling_dim: u8,
    /// Power-of-two scales (TE's `power_2_scale`, the default: exact to
    /// invert); off takes `max / amax` itself.
    pub power_2_scale: bool,
}

impl Default for Float8BlockScaling {
    fn default() -> Self {
        Self {
            fp8_format: Format::E4M3,
            x_block_scaling_dim: 1,
            w_block_scaling_dim: 2,
            grad_block_scaling_dim: 1,
            power_2_scale: true,
        }
    }
}

impl Float8BlockScaling {
    fn tiling(dim: u8) -> crate::numerics::block::Tiling {
        if dim == 2 {
            crate::numerics::block::Tiling::Blk128
        } else {
            crate::numerics::block::Tiling::Vec128
        }
    }
    /// The inputs' tiles.
    pub fn input_tiling(&self) -> crate::numerics::block::Tiling {
        Self::tiling(self.x_block_scaling_dim)
    }
    /// The weights' tiles.
    pub fn weight_tiling(&self) -> crate::numerics::block::Tiling {
        Self::tiling(self.w_block_scaling_dim)
    }
    /// The output gradients' tiles.
    pub fn grad_tiling(&self) -> crate::numerics::block::Tiling {
        Self::tiling(self.grad_block_scaling_dim)
    }
    /// The scale rule `power_2_scale` names.
    pub fn scale_rule(&self) -> ScaleRule {
        if self.power_2_scale {
            ScaleRule::PowerOfTwo
        } else {
            ScaleRule::Te
        }
    }
}

impl Validate for Float8BlockScaling {
    fn validate(&self) -> Result<()> {
        let dim = |field: &str, v: u8, allowed: &[u8]| -> Result<()> {
            if allowed.contains(&v) {
                Ok(())
            } else {
                Err(Error::Config {
                    field: field.into(),
                    reason: format!(
                        "{v}: must be {} (128 x 128 blocks on both sides of a GEMM are not \
                         supported by Hopper's block-scaled GEMM)",
                        allowed
                            .iter()
                            .map(|a| a.to_string())
                            .collect::<Vec<_>>()
                            .join(" or ")
                    ),
                })
            }
        };
        dim("x_block_scaling_dim", self.x_block_scaling_dim, &[1])?;
        dim("w_block_scaling_dim", self.w_block_scaling_dim, &[1, 2])?;
        dim("grad_block_scaling_dim", self.grad_block_scaling_dim, &[1])?;
        if self.fp8_format == Format::E5M2 {
            return Err(Error::Config {
                field: "fp8_format".into(),
                reason: "E5M2 in the forward pass is not supported: use E4M3 or HYBRID".into(),
            });
        }
        Ok(())
    }
}

/// Rowwise scaling (torchao's `rowwise` recipe): one scale per row of each
/// GEMM operand along the dimension the GEMM reduces (a token's features,
/// a weight's output channel; in backward, per output feature and per
/// token), cuBLASLt's `OUTER_VEC_32F` scales on Hopper.
///
/// ```
/// use amp_core::{Float8RowwiseScaling, Format};
/// let r = Float8RowwiseScaling::from_toml("power_2_scale = true")?;
/// assert_eq!(r.fp8_format, Format::E4M3);
/// # Ok::<(), amp_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Float8RowwiseScaling {
    /// FP8 formats of the forward and backward passes (E4M3 both ways by
    /// default, as torchao's recipe; HYBRID puts gradients in E5M2).
    pub fp8_format: Format,
    /// Power-of-two scales (torchao's `round_scales_to_power_of_2`, the
    /// default); off takes `max / amax` itself.
    pub power_2_scale: bool,
}

impl Default for Float8RowwiseScaling {
    fn default() -> Self {
        Self {
            fp8_format: Format::E4M3,
            power_2_scale: true,
        }
    }
}

impl Validate for Float8RowwiseScaling {
    fn validate(&self) -> Result<()> {
        if self.fp8_format == Format::E5M2 {
            return Err(Error::Config {
                field: "fp8_format".into(),
                reason: "E5M2 in the forward pass is not supported: use E4M3 or HYBRID".into(),
            });
        }
        Ok(())
    }
}

/// The tiles each GEMM operand of a Linear is cast in, with the formats
/// and the scale rule: what the block recipes come to (`nn/linear/block.rs`
/// runs it).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TileRecipe {
    pub fp8_format: Format,
    pub rule: ScaleRule,
    /// fprop's input `x`.
    pub input: crate::numerics::block::Tiling,
    /// fprop's and dgrad's weight.
    pub weight: crate::numerics::block::Tiling,
    /// dgrad's output gradient `dy`.
    pub grad: crate::numerics::block::Tiling,
    /// wgrad's two operands, `dyᵀ` and `xᵀ` (tiled along the tokens).
    pub wgrad: crate::numerics::block::Tiling,
}

impl From<&Float8BlockScaling> for TileRecipe {
    fn from(r: &Float8BlockScaling) -> Self {
        Self {
            fp8_format: r.fp8_format,
            rule: r.scale_rule(),
            input: r.input_tiling(),
            weight: r.weight_tiling(),
            grad: r.grad_tiling(),
            wgrad: crate::numerics::block::Tiling::Vec128,
        }
    }
}

impl From<&Float8RowwiseScaling> for TileRecipe {
    fn from(r: &Float8RowwiseScaling) -> Self {
        use crate::numerics::block::Tiling::Row;
        Self {
            fp8_format: r.fp8_format,
            rule: if r.power_2_scale {
                ScaleRule::PowerOfTwo
            } else {
                ScaleRule::Te
            },
            input: Row,
            weight: Row,
            grad: Row,
            wgrad: Row,
        }
    }
}

macro_rules! config_io {
    ($t:ty) => {
        impl $t {
            /// Parses and validates JSON.
            ///
            /// # Errors
            /// [`Error::Config`] naming the field that is wrong.
            pub fn from_json(text: &str) -> Result<Self> {
                config::from_json(text)
            }
            /// Parses and validates TOML.
            ///
            /// # Errors
            /// [`Error::Config`] naming the field that is wrong.
            pub fn from_toml(text: &str) -> Result<Self> {
                config::from_toml(text)
            }
            /// Reads a `.json` or `.toml` file.
            ///
            /// # Errors
            /// [`Error::ConfigFile`] when it cannot be read, [`Error::Config`] when wrong.
            pub fn from_path(path: impl AsRef<std::path::Path>) -> Result<Self> {
                config::from_path(path.as_ref())
            }
            /// Pretty JSON.
            ///
            /// # Errors
            /// Never for these types; the signature leaves room.
            pub fn to_json(&self) -> Result<String> {
                config::to_json(self)
            }
            /// TOML.
            ///
            /// # Errors
            /// Never for these types; the signature leaves room.
            pub fn to_toml(&self) -> Result<String> {
                config::to_toml(self)
            }
        }
    };
}
config_io!(DelayedScaling);
config_io!(CurrentScaling);
config_io!(Float8BlockScaling);
config_io!(Float8RowwiseScaling);

impl FromAmax {
    /// Current scaling by `recipe`'s rule and margin.
    pub(crate) fn of(recipe: &CurrentScaling) -> Self {
        Self {
            rule: recipe.scale_rule,
            margin: recipe.margin,
            flag: false,
        }
    }

    /// [`of`](Self::of) with the scale_inv flagged by the amax.
    pub(crate) fn flagged(recipe: &CurrentScaling) -> Self {
        Self {
            flag: true,
            ..Self::of(recipe)
        }
    }
}

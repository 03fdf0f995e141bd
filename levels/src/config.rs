//! `AmpConfig`: level, compute mode with its recipe, loss scaling, clipping,
//! and per-name exclusions; serde (JSON, TOML) with errors naming the field.

use crate::level::Level;
use amp_core::config::Validate;
use amp_core::nn::ComputeMode;
use amp_core::{CurrentScaling, DelayedScaling, Float8BlockScaling, Float8RowwiseScaling};
use amp_optim::LossScaling;
use serde::{Deserialize, Serialize};

/// The compute path, orthogonal to the level.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case", deny_unknown_fields)]
pub enum Compute {
    /// Native precision (F32 on the CPU).
    #[default]
    Native,
    /// FP8 with current scaling (MS-AMP).
    Fp8Current {
        /// The recipe.
        #[serde(default)]
        recipe: CurrentScaling,
    },
    /// FP8 with delayed scaling (Transformer Engine).
    Fp8Delayed {
        /// The recipe.
        #[serde(default)]
        recipe: DelayedScaling,
    },
    /// FP8 with one scale per 1 x 128 tile or 128 x 128 block
    /// (Transformer Engine's `Float8BlockScaling`, DeepSeek-V3). The
    /// levels' own FP8 tensors stay per tensor under it: the weight
    /// gradients on the wire and in the optimizer, O3's stored FP8 weights
    /// (the block cast reads the FP16 master where a rank holds it whole,
    /// else the gathered FP8 weight, which recasts per block losslessly).
    /// This and [`Compute::Fp8Rowwise`] keep no scaling state in a
    /// checkpoint: a run resumes into any compute path, and one saved under
    /// delayed scaling resumes here only with its state converted away (as
    /// into fp8-current).
    Fp8Block {
        /// The recipe.
        #[serde(default)]
        recipe: Float8BlockScaling,
    },
    /// FP8 with one scale per row of each operand (torchao's `rowwise`
    /// recipe); the levels' own FP8 tensors stay per tensor, as under
    /// [`Compute::Fp8Block`].
    Fp8Rowwise {
        /// The recipe.
        #[serde(default)]
        recipe: Float8RowwiseScaling,
    },
}

impl Compute {
    /// The compute path a level means unless told otherwise: native at O0,
    /// FP8 with current scaling at O1-O3 (MS-AMP's levels always run FP8
    /// GEMMs).
    pub fn for_level(level: Level) -> Self {
        match level {
            Level::O0 => Self::Native,
            _ => Self::Fp8Current {
                recipe: CurrentScaling::default(),
            },
        }
    }

    /// The `amp::nn` mode to run forward passes in.
    pub fn mode(&self) -> ComputeMode {
        match self {
            Self::Native => ComputeMode::Native,
            Self::Fp8Current { recipe } => ComputeMode::Fp8Current(recipe.clone()),
            Self::Fp8Delayed { recipe } => ComputeMode::Fp8Delayed(recipe.clone()),
            Self::Fp8Block { recipe } => ComputeMode::Fp8Block(recipe.clone()),
            Self::Fp8Rowwise { recipe } => ComputeMode::Fp8Rowwise(recipe.clone()),
        }
    }
}

/// Everything `amp::initialize` needs besides the optimizer's
/// hyperparameters.
///
/// ```
/// use amp_levels::{AmpConfig, Level};
/// let c = AmpConfig::from_toml(r#"
///     level = "O2"
///     high_precision = ["head.*"]
///     [compute]
///     mode = "fp8_delayed"
///     recipe = { margin = 0, amax_history_len = 16 }
/// "#)?;
/// assert_eq!(c.level, Level::O2);
/// assert!(c.is_high_precision("head.weight"));
/// // without a compute path, a level's own: FP8 GEMMs at O1-O3
/// let c = AmpConfig::from_toml(r#"level = "O1""#)?;
/// assert_eq!(c.compute, amp_levels::Compute::for_level(Level::O1));
/// # Ok::<(), amp_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "AmpConfigFields")]
pub struct AmpConfig {
    /// The optimization level.
    pub level: Level,
    /// The compute path and its recipe.
    pub compute: Compute,
    /// Loss scaling.
    pub loss_scaling: LossScaling,
    /// Clip the global gradient norm to this.
    pub max_grad_norm: Option<f64>,
    /// Linear weights (name patterns, `*` matches any run) kept in F32 and
    /// computed natively at every level: e.g. the output head.
    pub high_precision: Vec<String>,
    /// Parameters (name patterns) whose Adam moments stay F32 at O2/O3.
    pub f32_moments: Vec<String>,
    /// Data parallelism: the gradients are reduced in buckets of at most
    /// this many MiB, counted as F32 (4 bytes an element, whatever goes on
    /// the wire), as PyTorch DDP's `bucket_cap_mb`; a tensor larger than
    /// that is a bucket of its own (docs/ARCHITECTURE.md, "Buckets").
    /// Default 100 (DDP's is 25; each of our buckets costs four
    /// collectives, and 100 MiB measured fastest, BENCHMARKS.md).
    pub bucket_mb: f64,
    /// Data parallelism: start reducing a bucket while the backward still
    /// runs, as soon as its gradients have arrived (from the second step
    /// on; docs/ARCHITECTURE.md, "Overlap with the backward"). Off: every
    /// bucket after the backward. The same values either way. Default on.
    pub overlap_backward: bool,
    /// Data parallelism: the F32 gradients (embeddings, norms, biases)
    /// travel as BF16, half the bytes: each rank's gradient rounded to
    /// BF16, the ranks' values summed in F32 in rank order and divided by
    /// the number of ranks, the mean rounded to BF16 again (as PyTorch's
    /// `bf16_compress_hook`, with F32 sums). Off (the default): F32 on the
    /// wire, the exact mean. FP8 gradients are unaffected.
    pub bf16_wire: bool,
    /// Each bucket of FP8 gradients reduced in one shot
    /// (`Fp8ReduceConfig::one_shot`): every rank's codes go whole to
    /// every rank, which sums the whole bucket itself, in one exchange
    /// instead of an exchange and an all-gather. The same bytes at two
    /// ranks (twice the decoding work a rank), more above; the same
    /// values. Default off.
    pub fp8_one_shot: bool,
    /// Data parallelism: an embedding table's gradient averaged from every
    /// rank's looked-up ids and row gradients (gathered) instead of an
    /// all-reduce of the whole table, where that sends fewer bytes
    /// (`N` ranks looking up `n` ids each, `N n < 2 rows`;
    /// docs/ARCHITECTURE.md, "Buckets"): the same mean, to the bit for `N`
    /// a power of two. Every rank must look up the same number of ids at
    /// every step (fixed batch shapes, as the examples' and a
    /// `DistributedSampler`'s with `drop_last`): the gather's sizes are not
    /// agreed, so ranks with different counts would gather mismatched
    /// buffers. Off (the default): the table is all-reduced, whatever each
    /// rank looks up.
    pub embedding_rows: bool,
    /// On a GPU, the optimizer reads the step's outcome before it updates
    /// (`LowBitAdamWConfig::lean_step`): no second copy of the weights and
    /// moments during the step, for one wait of the host a step. The same
    /// values either way. Default off.
    pub lean_step: bool,
    /// On a GPU, the step's outcome stays on the device
    /// (`LowBitAdamWConfig::defer_outcome`): [`AmpContext::step`] returns
    /// `StepOutcome::Pending` without waiting for the device, and the host
    /// queues the next forward while the device finishes the step; the
    /// next step (or [`AmpOptimizer::resolve`]) reads the outcome. The same
    /// values either way; checkpoints are saved from a resolved step. Not
    /// taken with dynamic loss scaling or `lean_step`. Default off.
    ///
    /// [`AmpContext::step`]: crate::AmpContext::step
    /// [`AmpOptimizer::resolve`]: crate::AmpOptimizer::resolve
    pub defer_outcome: bool,
    /// At O2 and O3, both Adam moments in FP8: the second one as the E4M3
    /// codes of its square root (`StateFormat::E4M3Sqrt`) instead of FP16,
    /// one byte a parameter less (O2 5 bytes a Linear parameter, O3
    /// 2 + 4/N; docs/ARCHITECTURE.md, "FP8 moments"). O0 and O1 keep F32
    /// moments: there it is a config error. Default off.
    pub fp8_moments: bool,
}

impl Default for AmpConfig {
    fn default() -> Self {
        Self {
            level: Level::O0,
            compute: Compute::Native,
            loss_scaling: LossScaling::None,
            max_grad_norm: None,
            high_precision: Vec::new(),
            f32_moments: Vec::new(),
            bucket_mb: DEFAULT_BUCKET_MB,
            overlap_backward: true,
            bf16_wire: false,
            fp8_one_shot: false,
            embedding_rows: false,
            lean_step: false,
            defer_outcome: false,
            fp8_moments: false,
        }
    }
}

/// What a serialized [`AmpConfig`] holds: its fields, the compute path
/// optional (absent: [`Compute::for_level`] of the level given).
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct AmpConfigFields {
    level: Level,
    compute: Option<Compute>,
    loss_scaling: LossScaling,
    max_grad_norm: Option<f64>,
    high_precision: Vec<String>,
    f32_moments: Vec<String>,
    bucket_mb: f64,
    overlap_backward: bool,
    bf16_wire: bool,
    fp8_one_shot: bool,
    embedding_rows: bool,
    lean_step: bool,
    defer_outcome: bool,
    fp8_moments: bool,
}

impl Default for AmpConfigFields {
    fn default() -> Self {
        let d = AmpConfig::default();
        Self {
            level: d.level,
            compute: None,
            loss_scaling: d.loss_scaling,
            max_grad_norm: d.max_grad_norm,
            high_precision: d.high_precision,
            f32_moments: d.f32_moments,
            bucket_mb: d.bucket_mb,
            overlap_backward: d.overlap_backward,
            bf16_wire: d.bf16_wire,
            fp8_one_shot: d.fp8_one_shot,
            embedding_rows: d.embedding_rows,
            lean_step: d.lean_step,
            defer_outcome: d.defer_outcome,
            fp8_moments: d.fp8_moments,
        }
    }
}

impl From<AmpConfigFields> for AmpConfig {
    fn from(f: AmpConfigFields) -> Self {
        Self {
            compute: f.compute.unwrap_or_else(|| Compute::for_level(f.level)),
            level: f.level,
            loss_scaling: f.loss_scaling,
            max_grad_norm: f.max_grad_norm,
            high_precision: f.high_precision,
            f32_moments: f.f32_moments,
            bucket_mb: f.bucket_mb,
            overlap_backward: f.overlap_backward,
            bf16_wire: f.bf16_wire,
            fp8_one_shot: f.fp8_one_shot,
            embedding_rows: f.embedding_rows,
            lean_step: f.lean_step,
            defer_outcome: f.defer_outcome,
            fp8_moments: f.fp8_moments,
        }
    }
}

/// [`AmpConfig::bucket_mb`]'s default (PyTorch DDP's is 25).
pub const DEFAULT_BUCKET_MB: f64 = 100.0;

/// [`AmpConfig::bucket_mb`]'s largest value (1 TiB).
pub const MAX_BUCKET_MB: f64 = 1_048_576.0;

/// `*`-wildcard match of a whole name.
pub fn matches(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for p in middle {
        match rest.find(p) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

impl AmpConfig {
    /// The defaults at `level`, with its compute path
    /// ([`Compute::for_level`]: FP8 GEMMs at O1-O3; native stays one
    /// explicit `compute: Compute::Native` away).
    pub fn level(level: Level) -> Self {
        Self {
            level,
            compute: Compute::for_level(level),
            ..Default::default()
        }
    }

    /// Whether a Linear weight is kept in high precision.
    pub fn is_high_precision(&self, name: &str) -> bool {
        self.high_precision.iter().any(|p| matches(p, name))
    }

    /// The storage of every tensor class: the level's table, with
    /// [`fp8_moments`](Self::fp8_moments) applied.
    pub fn policy(&self) -> crate::level::Policy {
        let p = self.level.policy();
        if self.fp8_moments {
            p.with_fp8_moments()
        } else {
            p
        }
    }

    /// Whether a parameter keeps F32 moments.
    pub fn keeps_f32_moments(&self, name: &str) -> bool {
        self.f32_moments.iter().any(|p| matches(p, name))
    }

    /// Parses and validates JSON.
    ///
    /// # Errors
    /// `amp_core::Error::Config` naming the field.
    pub fn from_json(text: &str) -> amp_core::Result<Self> {
        amp_core::config::from_json(text)
    }

    /// Parses and validates TOML.
    ///
    /// # Errors
    /// `amp_core::Error::Config` naming the field.
    pub fn from_toml(text: &str) -> amp_core::Result<Self> {
        amp_core::config::from_toml(text)
    }

    /// Reads a `.json` or `.toml` file.
    ///
    /// # Errors
    /// `amp_core::Error::ConfigFile` or `Config`.
    pub fn from_path(path: impl AsRef<std::path::Path>) -> amp_core::Result<Self> {
        amp_core::config::from_path(path.as_ref())
    }

    /// Pretty JSON.
    ///
    /// # Errors
    /// Not for plain configs.
    pub fn to_json(&self) -> amp_core::Result<String> {
        amp_core::config::to_json(self)
    }
}

impl Validate for AmpConfig {
    fn validate(&self) -> amp_core::Result<()> {
        let bad = |field: &str, reason: String| {
            Err(amp_core::Error::Config {
                field: field.into(),
                reason,
            })
        };
        match &self.compute {
            Compute::Native => {}
            Compute::Fp8Current { recipe } => recipe.validate()?,
            Compute::Fp8Delayed { recipe } => recipe.validate()?,
            Compute::Fp8Block { recipe } => recipe.validate()?,
            Compute::Fp8Rowwise { recipe } => recipe.validate()?,
        }
        if let Some(n) = self.max_grad_norm {
            if !(n > 0.0 && n.is_finite()) {
                return bad("max_grad_norm", format!("{n} must be finite and > 0"));
            }
        }
        if self.fp8_moments && matches!(self.level, Level::O0 | Level::O1) {
            return bad(
                "fp8_moments",
                format!(
                    "{} keeps F32 Adam moments: FP8 moments need O2 or O3",
                    self.level
                ),
            );
        }
        if !(self.bucket_mb > 0.0 && self.bucket_mb <= MAX_BUCKET_MB) {
            return bad(
                "bucket_mb",
                format!("{} must be > 0 and at most {MAX_BUCKET_MB}", self.bucket_mb),
            );
        }
        self.loss_scaling.validate().map_err(|e| match e {
            amp_optim::Error::Config { field, reason } => amp_core::Error::Config {
                field: field.into(),
                reason,
            },
            other => amp_core::Error::Config {
                field: "loss_scaling".into(),
                reason: other.to_string(),
            },
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards() {
        assert!(matches("head.weight", "head.weight"));
        assert!(!matches("head.weight", "head.weights"));
        assert!(matches("head.*", "head.weight"));
        assert!(matches("*.bias", "blocks.0.fc1.bias"));
        assert!(matches("blocks.*.attn.*", "blocks.3.attn.qkv.weight"));
        assert!(!matches("blocks.*.attn.*", "blocks.3.mlp.fc1.weight"));
        assert!(matches("*", "anything"));
        assert!(!matches("a*a", "a"));
    }

    #[test]
    fn bad_configs_name_the_field() {
        for (json, field) in [
            (r#"{"level": "O4"}"#, "level"),
            (
                r#"{"compute": {"mode": "fp8_delayed", "recipe": {"amax_history_len": 0}}}"#,
                "amax_history_len",
            ),
            (r#"{"compute": {"mode": "int4"}}"#, "compute"),
            (r#"{"max_grad_norm": -1.0}"#, "max_grad_norm"),
            (
                r#"{"loss_scaling": {"static": {"scale": 0.0}}}"#,
                "loss_scaling.static.scale",
            ),
            (r#"{"levle": "O1"}"#, "levle"),
        ] {
            let e = AmpConfig::from_json(json).unwrap_err().to_string();
            assert!(e.contains(field), "{json}: {e}");
        }
        let c =
            AmpConfig::from_json(r#"{"level": "O3", "compute": {"mode": "fp8_current"}}"#).unwrap();
        assert_eq!(c.level, Level::O3);
        assert_eq!(AmpConfig::from_json(&c.to_json().unwrap()).unwrap(), c);
    }

    #[test]
    fn a_level_brings_its_compute_path_unless_one_is_given() {
        let fp8 = Compute::Fp8Current {
            recipe: CurrentScaling::default(),
        };
        for level in Level::ALL {
            let want = if level == Level::O0 {
                Compute::Native
            } else {
                fp8.clone()
            };
            assert_eq!(AmpConfig::level(level).compute, want, "{level}");
            let json = format!(r#"{{"level": "{level}"}}"#);
            assert_eq!(
                AmpConfig::from_json(&json).unwrap().compute,
                want,
                "{level}"
            );
            let toml = format!(r#"level = "{level}""#);
            assert_eq!(
                AmpConfig::from_toml(&toml).unwrap().compute,
                want,
                "{level}"
            );
            // native stays one explicit setting away
            let json = format!(r#"{{"level": "{level}", "compute": {{"mode": "native"}}}}"#);
            assert_eq!(
                AmpConfig::from_json(&json).unwrap().compute,
                Compute::Native
            );
        }
        assert_eq!(AmpConfig::default().compute, Compute::Native);
    }
}

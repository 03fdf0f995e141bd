//! `--recompute`: which activations a model's blocks compute again in
//! backward instead of keeping (both architectures).

use amp::nn;
use candle_core::Tensor;

/// `amp::nn`'s results (the closure `amp::nn::recompute` keeps returns one).
pub type CoreResult<T> = std::result::Result<T, amp::CoreError>;

/// Which activations the blocks recompute in backward instead of keeping
/// (`--recompute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation backward needs.
    #[default]
    None,
    /// Keep what the products computed; cast the FP8 operands again in
    /// backward from tensors kept anyway, recompute materialized
    /// attention's probabilities (`amp::nn::selective`).
    Selective,
    /// Keep each block's input only; run the block's forward again in
    /// backward (`amp::nn::recompute`).
    Full,
}

impl Recompute {
    /// `forward(h)` of a block whose parameters are `vars` (what
    /// `amp::nn::recompute` needs told), recomputing as `self` says.
    ///
    /// # Errors
    /// The block's.
    pub fn run<F>(
        self,
        h: &Tensor,
        vars: impl FnOnce() -> CoreResult<Vec<Tensor>>,
        forward: F,
    ) -> CoreResult<Tensor>
    where
        F: Fn(&Tensor) -> CoreResult<Tensor> + Send + Sync + 'static,
    {
        match self {
            Self::None => forward(h),
            Self::Selective => nn::selective(|| forward(h)),
            Self::Full => nn::recompute(h, &vars()?, forward),
        }
    }
}

//! `--recompute`: which activations a model's blocks compute again in
//! backward instead of keeping (both architectures).

use amp::nn::{self, Stream};
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
    /// A block on the residual stream `h`, its parameters `vars` (what
    /// `amp::nn::recompute` needs told), recomputing as `self` says:
    /// `forward_stream` takes and gives the stream (handed from block to
    /// block where the blocks can), inside `amp::nn::selective` for
    /// `Selective`; with `Full`, the stream is a graph tensor at each
    /// block's boundary (what `amp::nn::recompute` keeps) and `forward`
    /// runs the block.
    ///
    /// # Errors
    /// The block's.
    pub fn run_stream<S, F>(
        self,
        h: Stream,
        vars: impl FnOnce() -> CoreResult<Vec<Tensor>>,
        forward_stream: S,
        forward: F,
    ) -> CoreResult<Stream>
    where
        S: FnOnce(Stream) -> CoreResult<Stream>,
        F: Fn(&Tensor) -> CoreResult<Tensor> + Send + Sync + 'static,
    {
        match self {
            Self::None => forward_stream(h),
            Self::Selective => nn::selective(|| forward_stream(h)),
            Self::Full => Ok(Stream::new(nn::recompute(
                &h.into_tensor()?,
                &vars()?,
                forward,
            )?)),
        }
    }
}

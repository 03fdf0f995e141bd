//! Building Linear layers from a `VarBuilder`, as `candle_nn::linear` does.

use super::linear::Linear;
use crate::error::Result;

/// A linear layer with bias from a `VarBuilder`, initialized as
/// `candle_nn::linear` (weight `<prefix>.weight`, bias `<prefix>.bias`).
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn linear(in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<Linear> {
    linear_b(in_dim, out_dim, true, vb)
}

/// [`linear`] without bias.
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<Linear> {
    linear_b(in_dim, out_dim, false, vb)
}

/// [`linear`] with or without bias.
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn linear_b(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: candle_nn::VarBuilder,
) -> Result<Linear> {
    let w = vb.get_with_hints(
        (out_dim, in_dim),
        "weight",
        candle_nn::init::DEFAULT_KAIMING_NORMAL,
    )?;
    let b = if bias {
        let bound = 1.0 / (in_dim as f64).sqrt();
        Some(vb.get_with_hints(
            out_dim,
            "bias",
            candle_nn::Init::Uniform {
                lo: -bound,
                up: bound,
            },
        )?)
    } else {
        None
    };
    let name = if vb.prefix().is_empty() {
        "weight".to_string()
    } else {
        format!("{}.weight", vb.prefix())
    };
    Linear::new(name, w, b)
}

//! A causal flash-attention problem's geometry: its sizes, its inputs' and
//! output's shapes and strides, and the softmax scale. The attention op
//! (`flash.rs`) builds it and the CUDA launcher (`cuda/flash.rs`) reads it.

use candle_core::Shape;

/// The head dimensions the kernels are built for (`flash.cu`'s
/// instantiations, one pair of kernels each).
pub(crate) const HEAD_DIMS: [usize; 4] = [64, 80, 96, 128];

/// A flash-attention problem: `b` x `heads` sequences of `t` rows of `hd`
/// (one of [`HEAD_DIMS`]); q, k, v packed side by side in one projection's
/// rows `[b, t, (heads + 2 kv_heads) * hd]`, or separate `[b, heads, t,
/// hd]` tensors (`kv_heads == heads`). With `kv_heads < heads` (packed
/// only) each key/value head serves `heads / kv_heads` query heads.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Flash {
    pub b: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub t: usize,
    pub hd: usize,
    pub packed: bool,
}

/// The kernels' arguments.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl Flash {
    /// Columns of q (and of the output) per row.
    pub(crate) fn width(&self) -> usize {
        self.heads * self.hd
    }

    /// Columns of a packed projection's row: q's, k's and v's heads.
    pub(crate) fn packed_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.hd
    }

    /// Query heads per key/value head.
    pub(crate) fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// Where k and v begin in a packed row (columns).
    pub(crate) fn kv_offsets(&self) -> (usize, usize) {
        (self.width(), (self.heads + self.kv_heads) * self.hd)
    }

    /// Rows of all (batch, head) sequences.
    pub(crate) fn rows(&self) -> usize {
        self.b * self.heads * self.t
    }

    /// `1 / sqrt(head_dim)`.
    pub(crate) fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }

    /// (batch, head, row) strides of q, k, v in elements.
    pub(crate) fn in_strides(&self) -> [i64; 3] {
        let (t, d) = (self.t as i64, self.hd as i64);
        if self.packed {
            let w = self.packed_width() as i64;
            [t * w, d, w]
        } else {
            [self.heads as i64 * t * d, t * d, d]
        }
    }

    /// (batch, head, row) strides of the output (and of its gradient).
    pub(crate) fn out_strides(&self) -> [i64; 3] {
        let (t, d) = (self.t as i64, self.hd as i64);
        if self.packed {
            [t * self.width() as i64, d, self.width() as i64]
        } else {
            [self.heads as i64 * t * d, t * d, d]
        }
    }

    /// The shape of the input (one packed, or each of q, k, v).
    pub(crate) fn in_shape(&self) -> Shape {
        if self.packed {
            Shape::from((self.b, self.t, self.packed_width()))
        } else {
            Shape::from((self.b, self.heads, self.t, self.hd))
        }
    }

    /// The shape of the output: rows `[b, t, heads * hd]` packed, heads
    /// otherwise.
    pub(crate) fn out_shape(&self) -> Shape {
        if self.packed {
            Shape::from((self.b, self.t, self.width()))
        } else {
            Shape::from((self.b, self.heads, self.t, self.hd))
        }
    }
}

//! Block-scaled casts as kernels: one scale per tile of a 2-D tensor instead
//! of one per tensor. Their f32 arithmetic is the definition the CUDA
//! kernels reproduce bit for bit.
//!
//! # Tiles
//! A `[rows, cols]` tensor is cut into tiles ([`Tiling`]):
//! - [`Tiling::Vec128`]: 1 x 128, along each row (`cols`, the GEMM's
//!   reduced dimension): activations and gradients in DeepSeek-V3's recipe
//!   and Transformer Engine's `Float8BlockScaling` (`x_block_scaling_dim =
//!   1`);
//! - [`Tiling::Blk128`]: 128 x 128 blocks: weights (`w_block_scaling_dim =
//!   2`);
//! - [`Tiling::Row`]: one tile per row (torchao's `rowwise` recipe).
//!
//! The last tile of a row (and the last block row) is shorter where `cols`
//! (`rows`) is not a multiple of 128: no padding is stored.
//!
//! # The scales' layout
//! `scale_inv`, one F32 per tile, is stored as cuBLASLt's block-scaled
//! GEMM reads it (Transformer Engine's "GEMM-ready" layout), so a GEMM
//! takes it without a copy ([`Tiling::scale_dims`], [`Tiling::scale_index`]):
//! - 1 x 128: `[tiles along a row][rows]`, the rows contiguous (cuBLASLt's
//!   `VEC128_32F`, "M-major");
//! - 128 x 128: `[block rows][tiles along a row, padded to a multiple of
//!   4]`, the padding holding 1 (`BLK128x128_32F`);
//! - rowwise: `[rows, 1]` (`OUTER_VEC_32F`).
//!
//! # Numerics, per tile
//! - `amax = max |x|` over the tile (NaN if it holds a NaN);
//! - `scale = rule.compute(amax, 1, max, margin)` ([`ScaleRule::compute`]):
//!   a zero amax keeps scale 1, as a per-tensor cast with no previous
//!   scale does. With [`ScaleRule::PowerOfTwo`] (the default, Transformer
//!   Engine's `power_2_scale`) decoding is exact;
//! - `code = encode(f32(x) * scale)`, `scale_inv = 1 / scale`;
//! - a tile whose amax is inf or NaN is encoded with scale 1 (inf saturates
//!   to the format's max) and stores `scale_inv` NaN
//!   ([`CANONICAL_NAN_BITS`](crate::numerics::format::CANONICAL_NAN_BITS)):
//!   the tile decodes to NaN, and every GEMM output it enters is NaN, so
//!   overflow is never turned into finite values. The other tiles keep the
//!   scales their own values give.

use crate::error::{Error, Result};
use crate::numerics::cast::{with_float, Float};
use crate::numerics::format::Fp8Format;
use crate::numerics::kernel::{arity, slice, Kernel};
use crate::numerics::qtype::QType;
use crate::numerics::scale::ScaleRule;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Shape};
use half::{bf16, f16};

/// The tile edge of the block recipes (DeepSeek-V3, Transformer Engine).
pub const TILE: usize = 128;

/// How a 2-D tensor is cut into tiles that share a scale (see the module
/// docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tiling {
    /// 1 x 128 tiles along each row.
    Vec128,
    /// 128 x 128 blocks.
    Blk128,
    /// One tile per row.
    Row,
}

impl Tiling {
    /// `(tile rows, tile cols)` of a tensor with `cols` columns.
    pub fn tile(self, cols: usize) -> (usize, usize) {
        match self {
            Self::Vec128 => (1, TILE),
            Self::Blk128 => (TILE, TILE),
            Self::Row => (1, cols.max(1)),
        }
    }

    /// The grid of tiles of a `[rows, cols]` tensor: `(down, across)` (a
    /// row always has its one tile under [`Tiling::Row`]).
    pub fn tiles(self, rows: usize, cols: usize) -> (usize, usize) {
        let (th, tw) = self.tile(cols);
        match self {
            Self::Row => (rows, 1),
            _ => (rows.div_ceil(th), cols.div_ceil(tw)),
        }
    }

    /// The shape of the stored scale tensor of a `[rows, cols]` tensor (see
    /// the module docs' layout).
    pub fn scale_dims(self, rows: usize, cols: usize) -> (usize, usize) {
        let (down, across) = self.tiles(rows, cols);
        match self {
            Self::Vec128 => (across, rows),
            Self::Blk128 => (down, across.div_ceil(4) * 4),
            Self::Row => (rows, 1),
        }
    }

    /// The strides `(down, across)` of the tile grid in the stored layout.
    pub fn scale_strides(self, rows: usize, cols: usize) -> (usize, usize) {
        match self {
            Self::Vec128 => (1, rows),
            Self::Blk128 => (self.scale_dims(rows, cols).1, 1),
            Self::Row => (1, 0),
        }
    }

    /// Where tile `(down, across)` of a `[rows, cols]` tensor keeps its
    /// scale in the stored layout.
    pub fn scale_index(self, rows: usize, cols: usize, down: usize, across: usize) -> usize {
        let (sd, sa) = self.scale_strides(rows, cols);
        down * sd + across * sa
    }
}

impl std::fmt::Display for Tiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Vec128 => "1x128",
            Self::Blk128 => "128x128",
            Self::Row => "rowwise",
        })
    }
}

/// The FP8 format of a block-scaled cast's target, or an error for FP16.
pub(crate) fn fp8_of(op: &'static str, qtype: QType) -> Result<Fp8Format> {
    qtype.fp8().ok_or_else(|| Error::Unsupported {
        op,
        what: format!("a block-scaled {qtype} cast (FP8 targets only)"),
    })
}

/// The `[rows, cols]` of a block cast's input, or [`Error::Rank`].
pub(crate) fn dims2(op: &'static str, shape: &Shape) -> Result<(usize, usize)> {
    match shape.dims() {
        [r, c] => Ok((*r, *c)),
        _ => Err(Error::Rank {
            op,
            expected: 2,
            got: shape.clone(),
        }),
    }
}

/// `(codes, scale_inv)` of a 2-D float tensor. Inputs: x.
pub(crate) struct BlockQuantize {
    pub qtype: QType,
    pub tiling: Tiling,
    pub rule: ScaleRule,
    pub margin: u32,
}

impl Kernel for BlockQuantize {
    const NAME: &'static str = "block_quantize";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(x, lx)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let format = fp8_of(Self::NAME, self.qtype)?;
        let (rows, cols) = dims2(Self::NAME, lx.shape())?;
        let (codes, scale_inv) = with_float!(Self::NAME, *x, |xs: T| {
            let xs = slice::<T>(Self::NAME, xs, lx)?;
            Ok::<_, Error>(quantize_tiles(self, format, xs, rows, cols))
        })?;
        let sd = self.tiling.scale_dims(rows, cols);
        Ok(vec![
            (CpuStorage::U8(codes), Shape::from((rows, cols))),
            (CpuStorage::F32(scale_inv), Shape::from(sd)),
        ])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::block_quantize(self, inputs)
    }
}

/// The tiles' amaxes (as bits: NaN orders above every number), the grid
/// of [`Tiling::tiles`] row-major.
fn tile_amax<T: Float>(tiling: Tiling, xs: &[T], rows: usize, cols: usize) -> Vec<u32> {
    let (th, tw) = tiling.tile(cols);
    let (sr, sc) = tiling.tiles(rows, cols);
    let mut amax = vec![0u32; sr * sc];
    for (r, row) in xs.chunks(cols.max(1)).take(rows).enumerate() {
        let out = &mut amax[(r / th) * sc..(r / th + 1) * sc];
        for (a, tile) in out.iter_mut().zip(row.chunks(tw)) {
            *a = tile
                .iter()
                .fold(*a, |m, &x| m.max(x.to_f32().to_bits() & 0x7FFF_FFFF));
        }
    }
    amax
}

/// Codes and the stored `scale_inv` of `xs` (`[rows, cols]`, row-major).
fn quantize_tiles<T: Float>(
    k: &BlockQuantize,
    format: Fp8Format,
    xs: &[T],
    rows: usize,
    cols: usize,
) -> (Vec<u8>, Vec<f32>) {
    let (th, tw) = k.tiling.tile(cols);
    let (_, sc) = k.tiling.tiles(rows, cols);
    let max = format.max();
    let amax = tile_amax(k.tiling, xs, rows, cols);
    let scales: Vec<f32> = amax
        .iter()
        .map(|&a| k.rule.compute(f32::from_bits(a), 1.0, max, k.margin))
        .collect();
    let mut codes = vec![0u8; xs.len()];
    let mut buf = vec![0f32; tw.min(cols)];
    for (r, (row, dst)) in xs
        .chunks(cols.max(1))
        .zip(codes.chunks_mut(cols.max(1)))
        .take(rows)
        .enumerate()
    {
        let s = &scales[(r / th) * sc..(r / th + 1) * sc];
        for ((tile, out), &scale) in row.chunks(tw).zip(dst.chunks_mut(tw)).zip(s) {
            let b = &mut buf[..tile.len()];
            for (v, &x) in b.iter_mut().zip(tile) {
                *v = x.to_f32();
            }
            // Lengths are equal by construction: the chunks pair up.
            let _ = format.encode_scaled_slice(b, scale, out);
        }
    }
    let (sd_r, sd_c) = k.tiling.scale_dims(rows, cols);
    let mut stored = vec![1f32; sd_r * sd_c];
    for (i, (s, a)) in scales.iter().zip(&amax).enumerate() {
        let inv = if *a >= 0x7F80_0000 {
            f32::from_bits(crate::numerics::format::CANONICAL_NAN_BITS)
        } else {
            1.0 / s
        };
        stored[k
            .tiling
            .scale_index(rows, cols, i / sc.max(1), i % sc.max(1))] = inv;
    }
    (codes, stored)
}

/// The casts of a 2-D float tensor `x` and of `xᵀ` in 1 x 128 tiles or by
/// rows (`tiling`: [`Tiling::Vec128`] or [`Tiling::Row`]) from one read of
/// `x` (two for rows: the amaxes of every row and column first), each
/// exactly [`BlockQuantize`] of its own source: outputs the requested ones
/// of `(codes, scale_inv)` (`rowwise`) and `(codes_t, scale_inv_t)`
/// (`transposed`), in that order. Inputs: x.
pub(crate) struct BlockQuantizePair {
    pub qtype: QType,
    pub tiling: Tiling,
    pub rule: ScaleRule,
    pub margin: u32,
    pub rowwise: bool,
    pub transposed: bool,
}

impl BlockQuantizePair {
    fn single(&self) -> BlockQuantize {
        BlockQuantize {
            qtype: self.qtype,
            tiling: self.tiling,
            rule: self.rule,
            margin: self.margin,
        }
    }

    /// 1 x 128 or rows: the pairs the kernels make.
    pub(crate) fn check(&self) -> Result<()> {
        if matches!(self.tiling, Tiling::Vec128 | Tiling::Row) {
            Ok(())
        } else {
            Err(Error::Unsupported {
                op: Self::NAME,
                what: format!("a {} pair (1x128 or rowwise only)", self.tiling),
            })
        }
    }
}

impl Kernel for BlockQuantizePair {
    const NAME: &'static str = "block_quantize_pair";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(x, lx)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let format = fp8_of(Self::NAME, self.qtype)?;
        self.check()?;
        let (rows, cols) = dims2(Self::NAME, lx.shape())?;
        let k = self.single();
        let mut out = Vec::new();
        with_float!(Self::NAME, *x, |xs: T| {
            let xs = slice::<T>(Self::NAME, xs, lx)?;
            if self.rowwise {
                let (codes, scales) = quantize_tiles(&k, format, xs, rows, cols);
                out.push((CpuStorage::U8(codes), Shape::from((rows, cols))));
                out.push((
                    CpuStorage::F32(scales),
                    Shape::from(self.tiling.scale_dims(rows, cols)),
                ));
            }
            if self.transposed {
                let xt: Vec<T> = (0..rows * cols)
                    .map(|i| xs[(i % rows) * cols + i / rows])
                    .collect();
                let (codes, scales) = quantize_tiles(&k, format, &xt, cols, rows);
                out.push((CpuStorage::U8(codes), Shape::from((cols, rows))));
                out.push((
                    CpuStorage::F32(scales),
                    Shape::from(self.tiling.scale_dims(cols, rows)),
                ));
            }
            Ok::<_, Error>(())
        })?;
        Ok(out)
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::block_quantize_pair(self, inputs)
    }
}

/// The casts of a scaled FP16 tensor's value in `dtype` (BF16 or F32:
/// `decode(code) * scale_inv` rounded once) and of its transpose from its
/// codes: the requested ones of `(codes, scale_inv)` (`rowwise`) and
/// `(codes_t, scale_inv_t)` (`transposed`), each exactly what the casts
/// of the decoded value make. `tiling`: [`Tiling::Blk128`], 128 x 128
/// blocks from one read, the transpose as
/// [`BlockTensor::t`](crate::scaling::block::BlockTensor::t) makes it (any
/// rule); [`Tiling::Row`], the rowwise pair of [`BlockQuantizePair`] from
/// two reads of the codes (the power-of-two rule only). CUDA only, for
/// whole 128 x 128 tiles; the CPU casts the decoded value itself. Inputs:
/// the FP16 codes, their `[1]` scale_inv.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA launch only
pub(crate) struct BlockQuantizeScaled {
    pub qtype: QType,
    pub tiling: Tiling,
    pub rule: ScaleRule,
    pub dtype: DType,
    pub rowwise: bool,
    pub transposed: bool,
}

impl Kernel for BlockQuantizeScaled {
    const NAME: &'static str = "block_quantize_scaled";
    fn cpu(&self, _: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        Err(Error::Unsupported {
            op: Self::NAME,
            what: "the CPU (it casts the decoded value: BlockTensor::quantize)".into(),
        })
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::block_quantize_scaled(self, inputs)
    }
}

/// `decode(code) * scale_inv[tile]` in `dtype`. Inputs: codes, scale_inv.
pub(crate) struct BlockDequantize {
    pub qtype: QType,
    pub tiling: Tiling,
    pub dtype: DType,
}

impl Kernel for BlockDequantize {
    const NAME: &'static str = "block_dequantize";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(q, lq), (s, ls)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let format = fp8_of(Self::NAME, self.qtype)?;
        let (rows, cols) = dims2(Self::NAME, lq.shape())?;
        check_scales(Self::NAME, self.tiling, rows, cols, ls.shape())?;
        let codes = slice::<u8>(Self::NAME, q, lq)?;
        let scale_inv = slice::<f32>(Self::NAME, s, ls)?;
        let (th, tw) = self.tiling.tile(cols);
        let mut values = vec![0f32; codes.len()];
        for (r, (row, dst)) in codes
            .chunks(cols.max(1))
            .zip(values.chunks_mut(cols.max(1)))
            .take(rows)
            .enumerate()
        {
            for (tc, (tile, out)) in row.chunks(tw).zip(dst.chunks_mut(tw)).enumerate() {
                let si = scale_inv[self.tiling.scale_index(rows, cols, r / th, tc)];
                format.decode_scaled_slice(tile, si, out)?;
            }
        }
        let shape = lq.shape().clone();
        let out = match self.dtype {
            DType::F32 => CpuStorage::F32(values),
            DType::F16 => CpuStorage::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            DType::BF16 => CpuStorage::BF16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
            got => {
                return Err(Error::DType {
                    op: Self::NAME,
                    expected: "F32, F16 or BF16",
                    got,
                })
            }
        };
        Ok(vec![(out, shape)])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::block_dequantize(self, inputs)
    }
}

/// A scale tensor must have the shape `tiling` gives `[rows, cols]`.
pub(crate) fn check_scales(
    op: &'static str,
    tiling: Tiling,
    rows: usize,
    cols: usize,
    got: &Shape,
) -> Result<()> {
    let want = tiling.scale_dims(rows, cols);
    if got.dims() != [want.0, want.1] {
        return Err(Error::Shape {
            op,
            lhs: got.clone(),
            rhs: Shape::from(want),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_every_tail() {
        assert_eq!(Tiling::Vec128.tiles(3, 128), (3, 1));
        assert_eq!(Tiling::Vec128.tiles(3, 129), (3, 2));
        assert_eq!(Tiling::Blk128.tiles(129, 300), (2, 3));
        assert_eq!(Tiling::Blk128.tiles(0, 5), (0, 1));
        assert_eq!(Tiling::Row.tiles(7, 1000), (7, 1));
        assert_eq!(Tiling::Row.tiles(7, 0), (7, 1));
    }

    #[test]
    fn stored_scales_are_cublaslt_layouts() {
        // 1 x 128: [tiles across][rows], rows contiguous
        assert_eq!(Tiling::Vec128.scale_dims(3, 129), (2, 3));
        assert_eq!(Tiling::Vec128.scale_index(3, 129, 2, 1), 5);
        // 128 x 128: [block rows][tiles across padded to 4]
        assert_eq!(Tiling::Blk128.scale_dims(129, 300), (2, 4));
        assert_eq!(Tiling::Blk128.scale_index(129, 300, 1, 2), 6);
        assert_eq!(Tiling::Row.scale_dims(7, 0), (7, 1));
        assert_eq!(Tiling::Row.scale_index(7, 10, 4, 0), 4);
    }
}

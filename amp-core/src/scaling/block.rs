//! `BlockTensor`: FP8 codes with one scale per tile (1 x 128, 128 x 128 or
//! one per row), the sibling of the per-tensor
//! [`ScalingTensor`](crate::ScalingTensor) for the block recipes.

use crate::error::{Error, Result};
use crate::numerics::block::Tiling;
use crate::numerics::block::{
    check_scales, dims2, fp8_of, BlockDequantize, BlockQuantize, BlockQuantizePair,
    BlockQuantizeScaled,
};
use crate::numerics::kernel::{arity, launch, Kernel};
use crate::numerics::qtype::QType;
use crate::numerics::scale::ScaleRule;
use crate::scaling::tensor::{check_float, ScalingTensor};
use candle_core::{DType, Device, Shape, Tensor};

/// A 2-D FP8 tensor scaled per tile: `data` holds the codes `[rows, cols]`
/// (U8), `scale_inv` one F32 per tile in the layout cuBLASLt's
/// block-scaled GEMM reads ([`Tiling::scale_dims`];
/// [`tile_scales`](Self::tile_scales) gives the plain grid). Its value is
/// `decode(code) * scale_inv[tile]`.
///
/// One outlier costs only its own tile's precision:
///
/// ```
/// use amp_core::{BlockTensor, QType, ScaleRule, Tiling};
/// use candle_core::{DType, Device, Tensor};
/// // two tiles of 128: the first holds 10^4, the second small values
/// let mut v = vec![0.01f32; 256];
/// v[0] = 1e4;
/// let x = Tensor::from_vec(v, (1, 256), &Device::Cpu)?;
/// let q = BlockTensor::quantize(&x, QType::E4M3, Tiling::Vec128, ScaleRule::PowerOfTwo)?;
/// assert_eq!(q.tile_scales()?.dims(), [1, 2]);
/// let y = q.dequantize(DType::F32)?.to_vec2::<f32>()?;
/// assert!((y[0][200] - 0.01).abs() < 0.01 * 0.0625); // E4M3's half ulp
/// # Ok::<(), amp_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct BlockTensor {
    data: Tensor,
    scale_inv: Tensor,
    qtype: QType,
    tiling: Tiling,
}

impl BlockTensor {
    /// Casts a 2-D float tensor (F32, F16, BF16) to `qtype` (E4M3 or E5M2)
    /// with one scale per tile, each from its tile's amax by `rule` (see
    /// `numerics/block.rs` for the arithmetic).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for an FP16 target, [`Error::Rank`] unless `x`
    /// is 2-D, [`Error::DType`] for a non-float `x`.
    pub fn quantize(x: &Tensor, qtype: QType, tiling: Tiling, rule: ScaleRule) -> Result<Self> {
        const OP: &str = BlockQuantize::NAME;
        fp8_of(OP, qtype)?;
        dims2(OP, x.shape())?;
        check_float(OP, x)?;
        let op = BlockQuantize {
            qtype,
            tiling,
            rule,
            margin: 0,
        };
        let [data, scale_inv] =
            <[Tensor; 2]>::try_from(launch(&op, &[x])?).map_err(|_| arity(BlockQuantize::NAME))?;
        Ok(Self {
            data,
            scale_inv,
            qtype,
            tiling,
        })
    }

    /// The casts of a scaled FP16 tensor's value in `dtype` and of its
    /// transpose (the `wanted` ones) from `w`'s codes, the same as casting
    /// `w.dequantize(dtype)`: a weight's forward and dgrad operands.
    /// `tiling` [`Tiling::Blk128`]: its 128 x 128 blocks and their
    /// [`t`](Self::t), from one read; [`Tiling::Row`]: its rowwise
    /// [`quantize_pair`](Self::quantize_pair), from two reads (the
    /// power-of-two rule). `None` where the kernels do not apply (not
    /// CUDA, not FP16, not whole 128 x 128 tiles, `dtype` neither BF16 nor
    /// F32, 1 x 128 tiles, rows under another rule): cast the decoded
    /// value then.
    ///
    /// # Errors
    /// A `qtype` that is not FP8; the kernel's.
    pub fn of_scaled(
        w: &ScalingTensor,
        dtype: DType,
        qtype: QType,
        tiling: Tiling,
        rule: ScaleRule,
        wanted: (bool, bool),
    ) -> Result<Option<(Option<Self>, Option<Self>)>> {
        const OP: &str = BlockQuantizeScaled::NAME;
        fp8_of(OP, qtype)?;
        let data = w.data();
        let whole = match data.dims() {
            [rows, cols] => rows % 128 == 0 && cols % 128 == 0 && *rows > 0 && *cols > 0,
            _ => false,
        };
        let contiguous = data.is_contiguous() && data.layout().start_offset() == 0;
        let kernels = match tiling {
            Tiling::Blk128 => true,
            Tiling::Row => rule == ScaleRule::PowerOfTwo,
            Tiling::Vec128 => false,
        };
        if !data.device().is_cuda()
            || w.qtype() != QType::F16
            || !whole
            || !contiguous
            || !kernels
            || !matches!(dtype, DType::BF16 | DType::F32)
        {
            return Ok(None);
        }
        let op = BlockQuantizeScaled {
            qtype,
            tiling,
            rule,
            dtype,
            rowwise: wanted.0,
            transposed: wanted.1,
        };
        let mut out = launch(&op, &[data, w.meta().scale_inv()])?.into_iter();
        let mut take = |on: bool| -> Result<Option<Self>> {
            if !on {
                return Ok(None);
            }
            match (out.next(), out.next()) {
                (Some(data), Some(scale_inv)) => Ok(Some(Self {
                    data,
                    scale_inv,
                    qtype,
                    tiling,
                })),
                _ => Err(arity(OP)),
            }
        };
        let a = take(wanted.0)?;
        let b = take(wanted.1)?;
        Ok(Some((a, b)))
    }

    /// The casts of `x` (`rowwise`) and of `xᵀ` (`transposed`, tiles along
    /// `x`'s rows: a GEMM reducing over them) in 1 x 128 tiles or by rows
    /// (`tiling`: [`Tiling::Vec128`] or [`Tiling::Row`]) from one read of
    /// `x` (two by rows); each equals [`quantize`](Self::quantize) of its
    /// own source. The wgrad operands of a Linear come from here.
    ///
    /// # Errors
    /// As [`quantize`](Self::quantize); [`Error::Unsupported`] for another
    /// tiling.
    pub fn quantize_pair(
        x: &Tensor,
        qtype: QType,
        tiling: Tiling,
        rule: ScaleRule,
        (rowwise, transposed): (bool, bool),
    ) -> Result<(Option<Self>, Option<Self>)> {
        const OP: &str = BlockQuantizePair::NAME;
        fp8_of(OP, qtype)?;
        dims2(OP, x.shape())?;
        check_float(OP, x)?;
        let op = BlockQuantizePair {
            qtype,
            tiling,
            rule,
            margin: 0,
            rowwise,
            transposed,
        };
        op.check()?;
        let mut out = launch(&op, &[x])?.into_iter();
        let mut take = |wanted: bool| -> Result<Option<Self>> {
            if !wanted {
                return Ok(None);
            }
            let (data, scale_inv) = (out.next(), out.next());
            let (Some(data), Some(scale_inv)) = (data, scale_inv) else {
                return Err(arity(OP));
            };
            Ok(Some(Self {
                data,
                scale_inv,
                qtype,
                tiling,
            }))
        };
        let a = take(rowwise)?;
        Ok((a, take(transposed)?))
    }

    /// Wraps codes and scales made elsewhere (a checkpoint, another
    /// device's kernel).
    ///
    /// # Errors
    /// [`Error::DType`] unless `data` is U8 and `scale_inv` F32,
    /// [`Error::Shape`] when `scale_inv`'s shape is not the one `tiling`
    /// gives `data`'s, [`Error::Device`] when they live apart,
    /// [`Error::Unsupported`] for an FP16 `qtype`.
    pub fn from_parts(
        data: Tensor,
        scale_inv: Tensor,
        qtype: QType,
        tiling: Tiling,
    ) -> Result<Self> {
        const OP: &str = "BlockTensor::from_parts";
        fp8_of(OP, qtype)?;
        for (t, want) in [(&data, DType::U8), (&scale_inv, DType::F32)] {
            if t.dtype() != want {
                return Err(Error::DType {
                    op: OP,
                    expected: if want == DType::U8 {
                        "U8 codes"
                    } else {
                        "F32 scales"
                    },
                    got: t.dtype(),
                });
            }
        }
        let (rows, cols) = dims2(OP, data.shape())?;
        check_scales(OP, tiling, rows, cols, scale_inv.shape())?;
        if !data.device().same_device(scale_inv.device()) {
            return Err(Error::Device {
                op: OP,
                lhs: data.device().location(),
                rhs: scale_inv.device().location(),
            });
        }
        Ok(Self {
            data,
            scale_inv,
            qtype,
            tiling,
        })
    }

    /// The value in `dtype` (F32, F16 or BF16).
    ///
    /// # Errors
    /// [`Error::DType`] for another `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let op = BlockDequantize {
            qtype: self.qtype,
            tiling: self.tiling,
            dtype,
        };
        let [y] = <[Tensor; 1]>::try_from(launch(&op, &[&self.data, &self.scale_inv])?)
            .map_err(|_| arity(BlockDequantize::NAME))?;
        Ok(y)
    }

    /// The transpose, exact for 128 x 128 blocks: the codes transposed and
    /// each block keeping its scale (the weight of a backward GEMM). A 1 x
    /// 128 tile transposed is a 128 x 1 tile, which no tiling here holds:
    /// quantize the transposed source instead.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for tilings other than [`Tiling::Blk128`].
    pub fn t(&self) -> Result<Self> {
        if self.tiling != Tiling::Blk128 {
            return Err(Error::Unsupported {
                op: "BlockTensor::t",
                what: format!(
                    "the transpose of {} tiles (only 128x128 blocks transpose exactly; quantize \
                     the transposed source)",
                    self.tiling
                ),
            });
        }
        // the grid [block rows, blocks across] transposed, padded to 4 again
        let grid = self.tile_scales()?.t()?;
        let (across, down) = grid.dims2()?;
        let padded = down.div_ceil(4) * 4;
        let scale_inv = if padded > down {
            let ones = Tensor::ones((across, padded - down), DType::F32, grid.device())?;
            Tensor::cat(&[&grid, &ones], 1)?
        } else {
            grid.contiguous()?
        };
        Ok(Self {
            data: crate::numerics::transpose::transpose_2d(&self.data)?,
            scale_inv,
            qtype: self.qtype,
            tiling: self.tiling,
        })
    }

    /// The tiles' `scale_inv` as their grid, `[tiles down, tiles across]`
    /// ([`Tiling::tiles`]), whatever the stored layout (a view where it can
    /// be one).
    ///
    /// # Errors
    /// candle's, for a scale tensor that lost its shape.
    pub fn tile_scales(&self) -> Result<Tensor> {
        let (rows, cols) = self.data.dims2()?;
        let (_, across) = self.tiling.tiles(rows, cols);
        Ok(match self.tiling {
            Tiling::Vec128 => self.scale_inv.t()?,
            Tiling::Blk128 => self.scale_inv.narrow(1, 0, across)?,
            Tiling::Row => self.scale_inv.clone(),
        })
    }

    /// The codes, `[rows, cols]` U8.
    pub fn data(&self) -> &Tensor {
        &self.data
    }
    /// The per-tile inverse scales, F32, in the stored (cuBLASLt) layout.
    pub fn scale_inv(&self) -> &Tensor {
        &self.scale_inv
    }
    /// The codes' format.
    pub fn qtype(&self) -> QType {
        self.qtype
    }
    /// How the tensor is cut into tiles.
    pub fn tiling(&self) -> Tiling {
        self.tiling
    }
    /// `[rows, cols]`.
    pub fn shape(&self) -> &Shape {
        self.data.shape()
    }
    /// Where the codes and scales live.
    pub fn device(&self) -> &Device {
        self.data.device()
    }
    /// Bytes held: the codes and the scales.
    pub fn nbytes(&self) -> usize {
        self.data.elem_count() + 4 * self.scale_inv.elem_count()
    }
}

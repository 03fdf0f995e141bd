//! Launches of the cast kernels: amax, quantize, dequantize, requantize.

use super::launch::{aligned, func, grid, scalar, view, Current};
use crate::error::{Error, Result};
use crate::numerics::kernel::arity;
use crate::numerics::qtype::QType;
use crate::numerics::scale::FromAmax;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::{DType, Layout, Shape};
use half::{bf16, f16};

type Outputs = Vec<(CudaStorage, Shape)>;

/// Elements per thread step of the vector paths (`VEC` in amp.cu).
const VEC: usize = 16;

/// The kernel-name spelling of a storage type.
fn qname(q: QType) -> &'static str {
    match q {
        QType::E4M3 => "e4m3",
        QType::E5M2 => "e5m2",
        QType::F16 => "f16",
    }
}

/// The kernel-name spelling of a float dtype.
fn dname(op: &'static str, d: DType, expected: &'static str) -> Result<&'static str> {
    match d {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        DType::F64 if expected.contains("F64") => Ok("f64"),
        got => Err(Error::DType { op, expected, got }),
    }
}

fn wrap<T: CudaDType>(s: CudaSlice<T>, dev: &CudaDevice, shape: Shape) -> (CudaStorage, Shape) {
    (CudaStorage::wrap_cuda_slice(s, dev.clone()), shape)
}

fn one() -> Shape {
    Shape::from(1usize)
}

/// The input `x` of a float dtype as a typed view, to `$body`.
macro_rules! with_float_view {
    ($op:expr, $x:expr, $l:expr, |$v:ident| $body:expr) => {
        match $x.dtype() {
            DType::F32 => {
                let $v = view::<f32>($op, $x, $l)?;
                $body
            }
            DType::BF16 => {
                let $v = view::<bf16>($op, $x, $l)?;
                $body
            }
            DType::F16 => {
                let $v = view::<f16>($op, $x, $l)?;
                $body
            }
            got => Err(Error::DType {
                op: $op,
                expected: "F32, F16 or BF16",
                got,
            }),
        }
    };
}

/// The codes of a storage type as a view, to `$body`.
macro_rules! with_code_view {
    ($op:expr, $q:expr, $qtype:expr, $l:expr, |$v:ident| $body:expr) => {
        match ($qtype, $q.dtype()) {
            (QType::E4M3 | QType::E5M2, DType::U8) => {
                let $v = view::<u8>($op, $q, $l)?;
                $body
            }
            (QType::F16, DType::F16) => {
                let $v = view::<f16>($op, $q, $l)?;
                $body
            }
            (qtype, got) => Err(Error::DType {
                op: $op,
                expected: if qtype == QType::F16 { "F16" } else { "U8" },
                got,
            }),
        }
    };
}

/// `max |x|` (bits, NaN-propagating) into a 1-element F32 tensor.
pub(crate) fn amax(inputs: &[(&CudaStorage, &Layout)]) -> Result<Outputs> {
    const OP: &str = "amax";
    let [(x, lx)] = inputs else {
        return Err(arity(OP));
    };
    let dev = x.device().clone();
    let n = lx.shape().elem_count();
    let mut out = dev.alloc_zeros::<f32>(1)?;
    let name = format!("amax_{}", dname(OP, x.dtype(), "F32, F16 or BF16")?);
    let f = func(&dev, &name)?;
    let stream = dev.cuda_stream();
    with_float_view!(OP, x, lx, |xv| {
        let vec = i32::from(aligned(&xv, &dev));
        let mut b = stream.launch_builder(&f);
        b.arg(&xv).arg(&n).arg(&vec).arg(&mut out);
        unsafe { b.launch(grid(&dev, items(n, vec))?) }.w()?;
        Ok::<_, Error>(())
    })?;
    Ok(vec![wrap(out, &dev, one())])
}

/// Output codes of `qtype` for `n` elements, and whether their address is
/// 16-byte aligned.
enum Codes {
    U8(CudaSlice<u8>),
    F16(CudaSlice<f16>),
}

impl Codes {
    fn alloc(dev: &CudaDevice, qtype: QType, n: usize) -> Result<Self> {
        // SAFETY (both): every element is written by the kernel launched next.
        Ok(match qtype {
            QType::F16 => Self::F16(unsafe { dev.alloc::<f16>(n)? }),
            _ => Self::U8(unsafe { dev.alloc::<u8>(n)? }),
        })
    }

    fn aligned(&self, dev: &CudaDevice) -> bool {
        match self {
            Self::U8(s) => aligned(&s.slice(..), dev),
            Self::F16(s) => aligned(&s.slice(..), dev),
        }
    }

    fn push<'a>(&'a mut self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>) {
        match self {
            Self::U8(s) => b.arg(s),
            Self::F16(s) => b.arg(s),
        };
    }

    fn wrap(self, dev: &CudaDevice, shape: Shape) -> (CudaStorage, Shape) {
        match self {
            Self::U8(s) => wrap(s, dev, shape),
            Self::F16(s) => wrap(s, dev, shape),
        }
    }
}

/// `(encode(x * scale), max |x|, [saturated, flushed])` in one pass; with
/// `from_amax` the second input is x's amax, the kernel computes the scale,
/// the amax is not returned again and two outputs follow: scale, scale_inv.
pub(crate) fn quantize(
    qtype: QType,
    from_amax: Option<FromAmax>,
    counted: bool,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Outputs> {
    const OP: &str = "quantize";
    let [(x, lx), (s, ls)] = inputs else {
        return Err(arity(OP));
    };
    let dev = x.device().clone();
    let n = lx.shape().elem_count();
    let input = scalar(OP, s, ls)?;
    let mut cur = Current::new(&dev, qtype, from_amax)?;
    let mut codes = Codes::alloc(&dev, qtype, n)?;
    // with the amax as input the kernel need not fold it again (null)
    let mut amax = match cur {
        Some(_) => None,
        None => Some(dev.alloc_zeros::<f32>(1)?),
    };
    let null = 0u64;
    let mut counts = counted.then(|| dev.alloc_zeros::<i64>(2)).transpose()?;
    let name = format!(
        "quantize_{}_{}",
        dname(OP, x.dtype(), "F32, F16 or BF16")?,
        qname(qtype)
    );
    let f = func(&dev, &name)?;
    let stream = dev.cuda_stream();
    let out_aligned = codes.aligned(&dev);
    with_float_view!(OP, x, lx, |xv| {
        let vec = i32::from(out_aligned && aligned(&xv, &dev));
        let mut b = stream.launch_builder(&f);
        b.arg(&xv);
        Current::push_scale(&cur, &mut b, &input);
        codes.push(&mut b);
        b.arg(&n).arg(&vec);
        match &mut amax {
            Some(a) => b.arg(a),
            None => b.arg(&null),
        };
        match &mut counts {
            Some(c) => b.arg(c),
            None => b.arg(&null),
        };
        Current::push_tail(&mut cur, &mut b, &input);
        unsafe { b.launch(grid(&dev, items(n, vec))?) }.w()?;
        Ok::<_, Error>(())
    })?;
    let mut out = vec![codes.wrap(&dev, lx.shape().clone())];
    out.extend(amax.map(|a| wrap(a, &dev, one())));
    out.extend(counts.map(|c| wrap(c, &dev, Shape::from(2usize))));
    out.extend(Current::outputs(cur, &dev));
    Ok(out)
}

fn launch_dequantize<O: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    name: &str,
    q: &impl PushArg,
    scale_inv: &CudaView<'_, f32>,
    n: usize,
    shape: Shape,
) -> Result<(CudaStorage, Shape)> {
    // SAFETY: every element is written by the kernel.
    let mut out = unsafe { dev.alloc::<O>(n)? };
    let vec = i32::from(q.aligned(dev) && aligned(&out.slice(..), dev));
    let f = func(dev, name)?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    q.push(&mut b);
    b.arg(scale_inv).arg(&mut out).arg(&n).arg(&vec);
    unsafe { b.launch(grid(dev, items(n, vec))?) }.w()?;
    Ok(wrap(out, dev, shape))
}

/// A kernel argument of either code type.
trait PushArg {
    fn push<'a>(&'a self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>);
    fn aligned(&self, dev: &CudaDevice) -> bool;
}
impl<T> PushArg for CudaView<'_, T> {
    fn push<'a>(&'a self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>) {
        b.arg(self);
    }
    fn aligned(&self, dev: &CudaDevice) -> bool {
        aligned(self, dev)
    }
}

/// Thread steps of a launch over `n` elements: `VEC` each on the vector path.
fn items(n: usize, vec: i32) -> usize {
    if vec != 0 {
        n.div_ceil(VEC)
    } else {
        n
    }
}

/// `decode(code) * scale_inv` as `dtype` (F32, F16, BF16, F64).
pub(crate) fn dequantize(
    qtype: QType,
    dtype: DType,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Outputs> {
    const OP: &str = "dequantize";
    let [(q, lq), (s, ls)] = inputs else {
        return Err(arity(OP));
    };
    let dev = q.device().clone();
    let n = lq.shape().elem_count();
    let scale_inv = scalar(OP, s, ls)?;
    let out = dname(OP, dtype, "F32, F16, BF16 or F64")?;
    let name = format!("dequantize_{}_{out}", qname(qtype));
    let shape = lq.shape().clone();
    let result = with_code_view!(OP, q, qtype, lq, |qv| match dtype {
        DType::F32 => launch_dequantize::<f32>(&dev, &name, &qv, &scale_inv, n, shape),
        DType::F16 => launch_dequantize::<f16>(&dev, &name, &qv, &scale_inv, n, shape),
        DType::BF16 => launch_dequantize::<bf16>(&dev, &name, &qv, &scale_inv, n, shape),
        _ => launch_dequantize::<f64>(&dev, &name, &qv, &scale_inv, n, shape),
    })?;
    Ok(vec![result])
}

/// `max |decode(code) * scale_inv|`: the first pass of requantize.
pub(crate) fn decoded_amax(qtype: QType, inputs: &[(&CudaStorage, &Layout)]) -> Result<Outputs> {
    const OP: &str = "decoded_amax";
    let [(q, lq), (s, ls)] = inputs else {
        return Err(arity(OP));
    };
    let dev = q.device().clone();
    let n = lq.shape().elem_count();
    let scale_inv = scalar(OP, s, ls)?;
    let mut amax = dev.alloc_zeros::<f32>(1)?;
    let f = func(&dev, &format!("decoded_amax_{}", qname(qtype)))?;
    let stream = dev.cuda_stream();
    with_code_view!(OP, q, qtype, lq, |qv| {
        let vec = i32::from(aligned(&qv, &dev));
        let mut b = stream.launch_builder(&f);
        b.arg(&qv).arg(&scale_inv).arg(&n).arg(&vec).arg(&mut amax);
        unsafe { b.launch(grid(&dev, items(n, vec))?) }.w()?;
        Ok::<_, Error>(())
    })?;
    Ok(vec![wrap(amax, &dev, one())])
}

/// `encode_to(decode_from(code) * scale_inv * scale)` with the decoded
/// values' amax and the counts: the second pass of requantize.
pub(crate) fn requantize(
    from: QType,
    to: QType,
    counted: bool,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Outputs> {
    const OP: &str = "requantize";
    let [(q, lq), (si, lsi), (s, ls)] = inputs else {
        return Err(arity(OP));
    };
    let dev = q.device().clone();
    let n = lq.shape().elem_count();
    let scale_inv = scalar(OP, si, lsi)?;
    let scale = scalar(OP, s, ls)?;
    let mut codes = Codes::alloc(&dev, to, n)?;
    let mut amax = dev.alloc_zeros::<f32>(1)?;
    let mut counts = counted.then(|| dev.alloc_zeros::<i64>(2)).transpose()?;
    let null = 0u64;
    let f = func(&dev, &format!("requantize_{}_{}", qname(from), qname(to)))?;
    let stream = dev.cuda_stream();
    let out_aligned = codes.aligned(&dev);
    with_code_view!(OP, q, from, lq, |qv| {
        let vec = i32::from(out_aligned && aligned(&qv, &dev));
        let mut b = stream.launch_builder(&f);
        b.arg(&qv).arg(&scale_inv).arg(&scale);
        codes.push(&mut b);
        b.arg(&n).arg(&vec).arg(&mut amax);
        match &mut counts {
            Some(c) => b.arg(c),
            None => b.arg(&null),
        };
        unsafe { b.launch(grid(&dev, items(n, vec))?) }.w()?;
        Ok::<_, Error>(())
    })?;
    let mut out = vec![
        codes.wrap(&dev, lq.shape().clone()),
        wrap(amax, &dev, one()),
    ];
    out.extend(counts.map(|c| wrap(c, &dev, Shape::from(2usize))));
    Ok(out)
}

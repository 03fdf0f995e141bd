//! Reading a checkpoint: every tensor checked for presence, dtype and
//! shape, and remembered, so that the caller can refuse extra tensors.

use super::{err, not_a_param, root_name};
use crate::error::Result;
use amp_core::{QType, ScalingMeta, ScalingTensor, Weight};
use amp_optim::State;
use candle_core::{DType, Device, Shape, Tensor};
use safetensors::tensor::{Dtype, SafeTensors};
use std::path::Path;

/// Reads and checks tensors from a checkpoint, remembering what it read.
pub(crate) struct Reader<'a> {
    pub(crate) st: &'a SafeTensors<'a>,
    pub(crate) path: &'a Path,
    pub(crate) seen: Vec<String>,
    pub(crate) device: Device,
}

impl<'a> Reader<'a> {
    /// A reader of `st`, read from `path`, making CPU tensors until
    /// `device` is set.
    pub(crate) fn new(st: &'a SafeTensors<'a>, path: &'a Path) -> Self {
        Self {
            st,
            path,
            seen: Vec::new(),
            device: Device::Cpu,
        }
    }

    pub(crate) fn view(&mut self, name: &str, dtype: Dtype, shape: &Shape) -> Result<Vec<u8>> {
        let v = self
            .st
            .tensor(name)
            .map_err(|_| err(self.path, format!("tensor `{name}` missing")))?;
        if v.dtype() != dtype {
            return Err(err(
                self.path,
                format!("tensor `{name}`: dtype {:?}, expected {dtype:?}", v.dtype()),
            ));
        }
        if v.shape() != shape.dims() {
            return Err(err(
                self.path,
                format!(
                    "tensor `{name}`: shape {:?}, expected {:?}",
                    v.shape(),
                    shape.dims()
                ),
            ));
        }
        self.seen.push(name.to_string());
        Ok(v.data().to_vec())
    }

    pub(crate) fn plain(&mut self, name: &str, shape: &Shape) -> Result<Tensor> {
        let b = self.view(name, Dtype::F32, shape)?;
        let v: Vec<f32> = b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Tensor::from_vec(v, shape, &self.device)?)
    }

    pub(crate) fn meta(&mut self, name: &str, qtype: QType) -> Result<ScalingMeta> {
        let one = Shape::from(1usize);
        let scale = self.plain(&format!("{name}.__scale"), &one)?;
        let scale_inv = self.plain(&format!("{name}.__scale_inv"), &one)?;
        let hist_name = format!("{name}.__amax_history");
        let len = self
            .st
            .tensor(&hist_name)
            .map(|v| v.shape().iter().product::<usize>())
            .unwrap_or(1);
        let history = self.plain(&hist_name, &Shape::from(len))?;
        for (what, t) in [("scale", &scale), ("scale_inv", &scale_inv)] {
            let v = t.to_vec1::<f32>()?[0];
            if !(v >= f32::MIN_POSITIVE && v.is_finite()) {
                return Err(err(
                    self.path,
                    format!("`{name}`: {what} {v} is not a finite positive number"),
                ));
            }
        }
        Ok(ScalingMeta::from_parts(qtype, scale, scale_inv, history)?)
    }

    pub(crate) fn scaled(&mut self, name: &str, like: &ScalingTensor) -> Result<ScalingTensor> {
        let qtype = like.qtype();
        let dtype = match qtype {
            QType::E4M3 => Dtype::F8_E4M3,
            QType::E5M2 => Dtype::F8_E5M2,
            QType::F16 => Dtype::F16,
        };
        let b = self.view(name, dtype, like.shape())?;
        let data = match qtype {
            QType::F16 => {
                let v: Vec<half::f16> = b
                    .chunks_exact(2)
                    .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect();
                Tensor::from_vec(v, like.shape(), &self.device)?
            }
            _ => Tensor::from_vec(b, like.shape(), &self.device)?,
        };
        let meta = self.meta(name, qtype)?;
        Ok(ScalingTensor::from_parts(data, meta)?)
    }

    /// Marks every tensor whose name starts with `prefix` as read.
    pub(crate) fn skip_prefix(&mut self, prefix: &str) {
        let names: Vec<String> = self
            .st
            .names()
            .into_iter()
            .filter(|n| n.starts_with(prefix))
            .map(String::from)
            .collect();
        self.seen.extend(names);
    }

    /// A stored tensor's value in F32, whatever its storage in the file.
    pub(crate) fn value(&mut self, name: &str, shape: &Shape) -> Result<Tensor> {
        let dtype = self
            .st
            .tensor(name)
            .map_err(|_| err(self.path, format!("tensor `{name}` missing")))?
            .dtype();
        let qtype = match dtype {
            Dtype::F32 => return self.plain(name, shape),
            Dtype::F16 => QType::F16,
            Dtype::F8_E4M3 => QType::E4M3,
            Dtype::F8_E5M2 => QType::E5M2,
            other => {
                return Err(err(
                    self.path,
                    format!("tensor `{name}`: unsupported dtype {other:?}"),
                ))
            }
        };
        let like = ScalingTensor::from_parts(
            Tensor::zeros(shape, qtype.storage_dtype(), &self.device)?,
            ScalingMeta::new(qtype, 1, &self.device)?,
        )?;
        Ok(self.scaled(name, &like)?.dequantize(DType::F32)?)
    }

    /// A parameter and its moments stored as this run stores them
    /// (same level, same sharding): read bit-exact.
    pub(crate) fn exact(
        &mut self,
        p: &amp_optim::ParamState,
        w: &Weight,
    ) -> Result<(Weight, State, State)> {
        let weight = match w {
            Weight::Fp8Gathered(_) => return Err(not_a_param("load")),
            Weight::F32(v) => Weight::F32(candle_core::Var::from_tensor(
                &self.plain(&p.name, v.shape())?,
            )?),
            Weight::F16(t) => Weight::F16(self.scaled(&p.name, t)?),
            Weight::Fp8 { weight, master } => Weight::Fp8 {
                weight: self.scaled(&p.name, weight)?,
                master: self.scaled(&format!("{}.__master", p.name), master)?,
            },
        };
        let m = self.state(&format!("{}.__exp_avg", p.name), &p.exp_avg)?;
        let v_name = format!("{}.__exp_avg_sq", p.name);
        let roots_stored = self.st.tensor(&root_name(&v_name)).is_ok();
        let v = match (&p.exp_avg_sq, roots_stored) {
            (State::Sqrt(t), true) => State::Sqrt(self.scaled(&root_name(&v_name), t)?),
            (State::Sqrt(_), false) | (_, true) => {
                // saved with FP16 (F32) v and read as roots, or the other way
                let v = self.second_moment(&v_name, p.exp_avg_sq.shape())?;
                State::encode(p.exp_avg_sq.format(), &v)?
            }
            (like, false) => self.state(&v_name, like)?,
        };
        Ok((weight, m, v))
    }

    /// A parameter and its moments from a checkpoint of another level,
    /// re-encoded in this parameter's storage and formats.
    pub(crate) fn converted(
        &mut self,
        p: &amp_optim::ParamState,
        w: &Weight,
    ) -> Result<(Weight, State, State)> {
        encode(p, w, self.values(&p.name, w.shape())?)
    }

    /// The F32 values of parameter `name` (its master where it has one)
    /// and of its two moments, whatever their storage in the file; `shape`
    /// is what the file holds (a ZeRO slice is flat).
    pub(crate) fn values(&mut self, name: &str, shape: &Shape) -> Result<[Tensor; 3]> {
        let master = format!("{name}.__master");
        let value = if self.st.tensor(&master).is_ok() {
            self.value(name, shape)?; // the FP8 working copy: superseded
            self.value(&master, shape)?
        } else {
            self.value(name, shape)?
        };
        let m = self.value(&format!("{name}.__exp_avg"), shape)?;
        let v = self.second_moment(&format!("{name}.__exp_avg_sq"), shape)?;
        Ok([value, m, v])
    }

    /// A second moment's F32 values, stored as values or as square roots
    /// (under [`root_name`]).
    fn second_moment(&mut self, name: &str, shape: &Shape) -> Result<Tensor> {
        let roots = root_name(name);
        if self.st.tensor(&roots).is_ok() {
            Ok(self.value(&roots, shape)?.sqr()?)
        } else {
            self.value(name, shape)
        }
    }

    /// Fails naming the first tensor of the file that nothing read.
    pub(crate) fn check_all_read(&self) -> Result<()> {
        let mut extra: Vec<&str> = self
            .st
            .names()
            .into_iter()
            .filter(|n| !self.seen.iter().any(|s| s == n))
            .collect();
        extra.sort_unstable();
        match extra.first() {
            Some(first) => Err(err(
                self.path,
                format!("{} unexpected tensor(s), e.g. `{first}`", extra.len()),
            )),
            None => Ok(()),
        }
    }

    pub(crate) fn state(&mut self, name: &str, like: &State) -> Result<State> {
        Ok(match like {
            State::F32(t) => State::F32(self.plain(name, t.shape())?),
            State::Scaled(t) => State::Scaled(self.scaled(name, t)?),
            State::Sqrt(t) => State::Sqrt(self.scaled(&root_name(name), t)?),
        })
    }
}

/// `[value, m, v]` (F32, in `w`'s shape) encoded as parameter `p` stores
/// them: its weight storage with fresh scales, its moments' formats.
pub(crate) fn encode(
    p: &amp_optim::ParamState,
    w: &Weight,
    [value, m, v]: [Tensor; 3],
) -> Result<(Weight, State, State)> {
    let q = |qtype| -> Result<ScalingTensor> {
        Ok(ScalingTensor::quantize(&value, qtype, &amp_core::CurrentScaling::default())?.0)
    };
    let weight = match w {
        Weight::Fp8Gathered(_) => return Err(not_a_param("load")),
        Weight::F32(_) => Weight::F32(candle_core::Var::from_tensor(&value)?),
        Weight::F16(_) => Weight::F16(q(QType::F16)?),
        Weight::Fp8 { .. } => Weight::Fp8 {
            weight: q(QType::E4M3)?,
            master: q(QType::F16)?,
        },
    };
    Ok((
        weight,
        State::encode(p.exp_avg.format(), &m)?,
        State::encode(p.exp_avg_sq.format(), &v)?,
    ))
}

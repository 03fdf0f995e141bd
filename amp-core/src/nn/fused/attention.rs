//! Causal self-attention as one autograd op: `softmax(q kᵀ / sqrt(d) +
//! mask) v` with the scale and the mask inside the softmax kernel, so the
//! graph keeps one matrix per layer (the probabilities) instead of the
//! scores, the masked scores and the probabilities, and backprop spends
//! no zero-fill and add on each of them. On CUDA with a head dimension of
//! 64, 80, 96 or 128 the body is flash attention instead ([`super::flash`]): no
//! probabilities at all, backward recomputes them.

use super::flash;
use super::flash_shape::Flash;
use super::handoff::{token_fwd, Handoff};
use super::heads::Qkv;
use super::ops::{CausalSoftmax, CausalSoftmaxBwd};
use crate::error::{Error, Result};
use crate::nn::precomputed::{precomputed_fwd, Precomputed};
use candle_core::{CustomOp1, CustomOp3, DType, Shape, Tensor};

/// Causal attention of `q`, `k`, `v` (`[batch, heads, seq, head_dim]`,
/// one float dtype, one device): `softmax(q kᵀ / sqrt(head_dim) + mask) v`,
/// where query `i` sees keys `0..=i`. The products run in BF16 on CUDA (as
/// PyTorch autocast) and in the inputs' dtype on the CPU, the softmax sums
/// in F32; the output and the gradients have the inputs' dtype.
///
/// Grouped-query attention (Llama's): `k` and `v` may have fewer heads
/// than `q`, a divisor of its count; query head `h` reads key/value head
/// `h / (heads / kv_heads)`. The key and value heads are repeated for the
/// products (each group's copy of the same values) and their gradients
/// summed over the group in head order.
///
/// # Errors
/// [`Error::Rank`], [`Error::Shape`], [`Error::DType`] or [`Error::Device`]
/// for inputs that do not fit; candle's.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    const OP: &str = "causal_attention";
    let (b, heads, t, d) = q.dims4().map_err(|_| Error::Rank {
        op: OP,
        expected: 4,
        got: q.shape().clone(),
    })?;
    if k.shape() != v.shape() {
        return Err(Error::Shape {
            op: OP,
            lhs: k.shape().clone(),
            rhs: v.shape().clone(),
        });
    }
    let kv_heads = match k.dims4() {
        Ok((kb, kh, kt, kd)) if (kb, kt, kd) == (b, t, d) && kh > 0 && heads % kh == 0 => kh,
        _ => {
            return Err(Error::Shape {
                op: OP,
                lhs: q.shape().clone(),
                rhs: k.shape().clone(),
            })
        }
    };
    for t in [k, v] {
        if t.dtype() != q.dtype() {
            return Err(Error::DType {
                op: OP,
                expected: "q, k and v of one dtype",
                got: t.dtype(),
            });
        }
        if !t.device().same_device(q.device()) {
            return Err(Error::Device {
                op: OP,
                lhs: q.device().location(),
                rhs: t.device().location(),
            });
        }
    }
    let compute = compute_dtype(OP, q)?;
    let scale = 1.0 / (d.max(1) as f32).sqrt();
    let group = heads / kv_heads;
    let (y, kept) = if group == 1 {
        attend_separate([q, k, v], compute, scale)?
    } else {
        let (ke, ve) = (repeat_heads(k, group)?, repeat_heads(v, group)?);
        attend_separate([q, &ke, &ve], compute, scale)?
    };
    let y = y.to_dtype(q.dtype())?;
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(y);
    }
    let op = CausalAttention {
        y: Precomputed::new(OP, y),
        kept,
        group,
    };
    Ok(q.apply_op3(k, v, op)?)
}

/// Each of `x`'s heads (`[b, kv_heads, t, d]`) `group` times in a row:
/// `[b, kv_heads * group, t, d]`, detached and contiguous.
pub(super) fn repeat_heads(x: &Tensor, group: usize) -> Result<Tensor> {
    let (b, kh, t, d) = x.dims4()?;
    Ok(x.detach()
        .unsqueeze(2)?
        .broadcast_as((b, kh, group, t, d))?
        .reshape((b, kh * group, t, d))?)
}

/// The gradient of [`repeat_heads`]' input: each group's heads summed.
pub(super) fn sum_groups(g: &Tensor, group: usize) -> candle_core::Result<Tensor> {
    if group == 1 {
        return Ok(g.clone());
    }
    let (b, h, t, d) = g.dims4()?;
    g.reshape((b, h / group, group, t, d))?.sum(2)
}

/// The autograd node: the forward's output, what backward needs.
struct CausalAttention {
    y: Precomputed,
    kept: Kept,
    /// Query heads per key/value head (1: plain multi-head attention).
    group: usize,
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "amp_causal_attention"
    }

    precomputed_fwd!(3);

    fn bwd(
        &self,
        q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = |t: &Tensor| t.to_dtype(q.dtype());
        let kv = |t: &Tensor| -> candle_core::Result<Tensor> {
            // the group's sum in F32 where the products were narrower
            let wide = match t.dtype() {
                DType::BF16 | DType::F16 if self.group > 1 => t.to_dtype(DType::F32)?,
                _ => t.clone(),
            };
            back(&sum_groups(&wide, self.group)?)
        };
        match &self.kept.grads(dy)?[..] {
            [dq, dk, dv] => Ok((Some(back(dq)?), Some(kv(dk)?), Some(kv(dv)?))),
            _ => candle_core::bail!("amp_causal_attention: three gradients expected"),
        }
    }
}

/// What backward keeps besides the op's inputs.
pub(super) enum Kept {
    /// q, k, v (heads, the compute dtype) and the probabilities (none
    /// under [`selective`](crate::nn::selective): backward computes them
    /// again from q and k, the same kernels on the same values).
    Probs {
        qkv: [Tensor; 3],
        p: Option<Tensor>,
        scale: f32,
    },
    /// The flash kernels' BF16 inputs (the packed projection, or q, k,
    /// v), the output and the rows' log-sum-exp.
    Flash {
        flash: Flash,
        inputs: Vec<Tensor>,
        o: Tensor,
        lse: Tensor,
    },
}

impl Kept {
    /// The gradients of what the forward took (dq, dk, dv as heads of the
    /// compute dtype; flash: of its inputs, BF16) from `dy` (heads; rows
    /// for a packed flash).
    pub(super) fn grads(&self, dy: &Tensor) -> candle_core::Result<Vec<Tensor>> {
        match self {
            Kept::Probs { qkv, p, scale } => {
                let dy = dy.detach().to_dtype(qkv[0].dtype())?.contiguous()?;
                let [q, k, v] = qkv;
                let p = match p {
                    Some(p) => p.clone(),
                    None => probs(q, k, *scale).map_err(candle_core::Error::wrap)?,
                };
                Ok(attend_bwd(&p, [q, k, v], &dy, *scale)?.to_vec())
            }
            Kept::Flash {
                flash,
                inputs,
                o,
                lse,
            } => flash
                .backward(inputs, o, dy, lse)
                .map_err(candle_core::Error::wrap),
        }
    }

    /// The packed projection's gradient (rows of `dtype`) from the
    /// output's, rows too.
    fn packed_grad(&self, s: Qkv, dy: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        match self {
            Kept::Probs { qkv, .. } => {
                let dy = s.heads(dy, qkv[0].dtype())?;
                s.rows(&self.grads(&dy)?, dtype)
            }
            Kept::Flash { .. } => match self.grads(dy)?.pop() {
                Some(g) => g.to_dtype(dtype),
                None => candle_core::bail!("amp_causal_attention_qkv: no gradient"),
            },
        }
    }
}

/// The output (compute dtype, heads) and what backward keeps, of
/// separate q, k, v.
pub(super) fn attend_separate(
    qkv: [&Tensor; 3],
    compute: DType,
    scale: f32,
) -> Result<(Tensor, Kept)> {
    if let Some(f) = Flash::separate(qkv[0]) {
        let inputs = qkv
            .iter()
            .map(|t| flash::input(t))
            .collect::<Result<Vec<_>>>()?;
        let (o, lse) = f.forward(&inputs)?;
        let kept = Kept::Flash {
            flash: f,
            inputs,
            o: o.clone(),
            lse,
        };
        return Ok((o, kept));
    }
    let cast = |t: &Tensor| -> Result<Tensor> { Ok(t.detach().to_dtype(compute)?.contiguous()?) };
    let qkv = [cast(qkv[0])?, cast(qkv[1])?, cast(qkv[2])?];
    let (p, y) = attend(&qkv[0], &qkv[1], &qkv[2], scale)?;
    let p = (!crate::nn::selective::active()).then_some(p);
    Ok((y, Kept::Probs { qkv, p, scale }))
}

/// The output (rows of the projection's dtype) and what backward keeps,
/// of a packed projection.
fn attend_packed(s: Qkv, qkv: &Tensor, compute: DType, scale: f32) -> Result<(Tensor, Kept)> {
    if let Some(f) = Flash::packed(qkv, (s.heads, s.heads), s.hd) {
        let inputs = vec![flash::input(qkv)?];
        let (o, lse) = f.forward(&inputs)?;
        let y = o.to_dtype(qkv.dtype())?;
        return Ok((
            y,
            Kept::Flash {
                flash: f,
                inputs,
                o,
                lse,
            },
        ));
    }
    let parts = s.split(qkv, compute)?;
    let (p, y) = attend(&parts[0], &parts[1], &parts[2], scale)?;
    let y = s.rows(&[y], qkv.dtype())?;
    let p = (!crate::nn::selective::active()).then_some(p);
    Ok((
        y,
        Kept::Probs {
            qkv: parts,
            p,
            scale,
        },
    ))
}

/// The products' dtype for a float input: BF16 on CUDA (as PyTorch
/// autocast), the input's own elsewhere.
pub(super) fn compute_dtype(op: &'static str, x: &Tensor) -> Result<DType> {
    if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::DType {
            op,
            expected: "F32, BF16 or F16",
            got: x.dtype(),
        });
    }
    Ok(if x.device().is_cuda() {
        DType::BF16
    } else {
        x.dtype()
    })
}

/// `(P, P v)` with `P = causal_softmax(q kᵀ * scale)`; contiguous
/// `[batch, heads, seq, head_dim]` inputs of the compute dtype.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<(Tensor, Tensor)> {
    let p = probs(q, k, scale)?;
    let y = p.matmul(v)?;
    Ok((p, y))
}

/// `causal_softmax(q kᵀ * scale)`, as [`attend`] computes it.
fn probs(q: &Tensor, k: &Tensor, scale: f32) -> Result<Tensor> {
    Ok(q.matmul(&k.t()?)?
        .apply_op1_no_bwd(&CausalSoftmax { scale })?)
}

/// `dP = dy vᵀ`, `dS = P (dP - rowsum(P dP)) * scale`, `dq = dS k`,
/// `dk = dSᵀ q`, `dv = Pᵀ dy`, in the compute dtype.
fn attend_bwd(
    p: &Tensor,
    [q, k, v]: [&Tensor; 3],
    dy: &Tensor,
    scale: f32,
) -> candle_core::Result<[Tensor; 3]> {
    let dp = dy.matmul(&v.t()?)?;
    let ds = p.apply_op2_no_bwd(&dp, &CausalSoftmaxBwd { scale })?;
    drop(dp);
    Ok([ds.matmul(k)?, ds.t()?.matmul(q)?, p.t()?.matmul(dy)?])
}

/// Causal attention straight from a fused projection: `qkv` `[batch, seq,
/// 3 * width]` (q, k, v side by side, each `heads` heads of `width /
/// heads`) to `[batch, seq, width]`. The same as splitting and calling
/// [`causal_attention`], but the split, the head transposes and their
/// gradients (candle's narrow backward pads with zeros, then adds) happen
/// inside one op, on the compute dtype's half-size copies.
///
/// # Errors
/// [`Error::Rank`] unless 3-D, [`Error::Shape`] when the last dimension is
/// not `3 * heads * head_dim`, [`Error::DType`] for a non-float input.
pub fn causal_attention_qkv(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    const OP: &str = "causal_attention_qkv";
    let (shape, compute, scale) = qkv_layout(OP, qkv, heads)?;
    let (y, kept) = attend_packed(shape, qkv, compute, scale)?;
    if !qkv.track_op() {
        return Ok(y);
    }
    let op = CausalAttentionQkv {
        y: Precomputed::new(OP, y),
        kept,
        shape,
    };
    Ok(qkv.apply_op1(op)?)
}

/// The autograd node of [`causal_attention_qkv`].
struct CausalAttentionQkv {
    y: Precomputed,
    kept: Kept,
    shape: Qkv,
}

impl CustomOp1 for CausalAttentionQkv {
    fn name(&self) -> &'static str {
        "amp_causal_attention_qkv"
    }

    precomputed_fwd!(1);

    fn bwd(&self, qkv: &Tensor, _res: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.kept.packed_grad(self.shape, dy, qkv.dtype())?))
    }
}

/// The layout, compute dtype and scale of a fused projection's output.
fn qkv_layout(op: &'static str, qkv: &Tensor, heads: usize) -> Result<(Qkv, DType, f32)> {
    let (b, t, three_d) = qkv.dims3().map_err(|_| Error::Rank {
        op,
        expected: 3,
        got: qkv.shape().clone(),
    })?;
    if heads == 0 || three_d % (3 * heads) != 0 || three_d == 0 {
        return Err(Error::Shape {
            op,
            lhs: qkv.shape().clone(),
            rhs: Shape::from((3, heads)),
        });
    }
    let compute = compute_dtype(op, qkv)?;
    let hd = three_d / 3 / heads;
    Ok((Qkv { b, t, heads, hd }, compute, 1.0 / (hd as f32).sqrt()))
}

/// [`causal_attention_qkv`] between two handoffs: `qkv` comes from the
/// previous op (`token` stands for it in the graph, `from` takes its
/// gradient) and the output is handed on: `(y, token, handoff, kept)`.
/// The op keeps q, k, v (compute dtype) and the probabilities for
/// backward, or flash attention's inputs and output: then `y` is that
/// output (`kept`), alive until the op's backward.
pub(crate) fn causal_attention_handed(
    qkv: &Tensor,
    token: &Tensor,
    from: &Handoff,
    heads: usize,
) -> Result<(Tensor, Tensor, Handoff, bool)> {
    const OP: &str = "causal_attention_qkv";
    let (shape, compute, scale) = qkv_layout(OP, qkv, heads)?;
    let (y, kept) = attend_packed(shape, qkv, compute, scale)?;
    let y_kept = matches!(&kept, Kept::Flash { o, .. } if o.dtype() == y.dtype());
    let to = Handoff::default();
    let op = AttentionHanded {
        kept,
        shape,
        dtype: qkv.dtype(),
        from: from.clone(),
        to: to.clone(),
    };
    let token = token.apply_op1(op)?;
    Ok((y, token, to, y_kept))
}

/// The graph node of [`causal_attention_handed`]: a token in, a token out.
struct AttentionHanded {
    kept: Kept,
    shape: Qkv,
    dtype: DType,
    from: Handoff,
    to: Handoff,
}

impl CustomOp1 for AttentionHanded {
    fn name(&self) -> &'static str {
        "amp_causal_attention_handed"
    }

    token_fwd!(1);

    /// As [`CausalAttentionQkv`]'s, from the handed gradient; qkv's
    /// gradient is handed back.
    fn bwd(
        &self,
        token: &Tensor,
        _res: &Tensor,
        _token_grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let wrap = candle_core::Error::wrap;
        let dy = self.to.take().map_err(wrap)?;
        let dqkv = self.kept.packed_grad(self.shape, &dy, self.dtype)?;
        self.from.put(dqkv).map_err(wrap)?;
        Ok(Some(Handoff::token_grad(token).map_err(wrap)?))
    }
}

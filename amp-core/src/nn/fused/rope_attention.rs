//! Llama's attention between its two projections as one op: a packed
//! projection's rows `[batch, seq, (heads + 2 kv_heads) * head_dim]` (q's
//! heads, then k's, then v's) to the attention's output rows `[batch, seq,
//! heads * head_dim]`, with rotary positions on q and k and grouped-query
//! attention. The split into heads, RoPE, the key/value heads' repetition,
//! the attention and the transposes back happen inside the op on detached
//! tensors, so candle's graph holds one node where the same parts as graph
//! ops held a dozen, each with a zero-filled gradient and an add in
//! backward (measured at Llama-3.2-1B's shape on an H100: a quarter of the
//! step's GPU time). Backward: the attention's gradients, the groups'
//! key/value gradients summed, RoPE's transpose (the rotation by `-sin`),
//! the packed rows.
//!
//! Where flash attention applies (CUDA, a head dimension it is built for)
//! the op makes no copy of heads at all: one pass turns the projection's q
//! and k heads in place of a copy of its rows (v's copied beside them),
//! the flash kernels read q, k and v from those rows, each group of query
//! heads its shared key/value head, and write the output rows; backward
//! writes dq, dk (summed over the group in the kernel) and dv into one
//! packed gradient, and one pass turns its q and k heads back. Elsewhere
//! the heads are split, turned, repeated for the groups and transposed
//! as separate tensors.

use super::attention::{attend_separate, compute_dtype, repeat_heads, sum_groups, Kept};
use super::flash;
use super::flash_shape::Flash;
use super::handoff::{token_fwd, Handoff};
use super::rope::{check_tables, rope, rope_rows};
use crate::error::{Error, Result};
use crate::nn::precomputed::{precomputed_fwd, Precomputed};
use candle_core::{CustomOp1, DType, Shape, Tensor};

/// The problem: shapes and the rotary tables (the first `t` positions).
#[derive(Clone)]
struct Problem {
    b: usize,
    t: usize,
    heads: usize,
    kv: usize,
    hd: usize,
    cos: Tensor,
    sin: Tensor,
    compute: DType,
}

impl Problem {
    fn new(
        op: &'static str,
        x: &Tensor,
        (heads, kv): (usize, usize),
        (cos, sin): (&Tensor, &Tensor),
    ) -> Result<Self> {
        let (b, t, width) = x.dims3().map_err(|_| Error::Rank {
            op,
            expected: 3,
            got: x.shape().clone(),
        })?;
        let parts = heads + 2 * kv;
        if kv == 0 || heads % kv != 0 || width % parts != 0 || (width / parts) % 2 != 0 {
            return Err(Error::Shape {
                op,
                lhs: x.shape().clone(),
                rhs: Shape::from((heads, kv)),
            });
        }
        if [cos, sin]
            .iter()
            .any(|z| z.dims2().map(|(n, _)| n < t).unwrap_or(true))
        {
            return Err(Error::Shape {
                op,
                lhs: x.shape().clone(),
                rhs: cos.shape().clone(),
            });
        }
        let hd = width / parts;
        let (cos, sin) = (cos.narrow(0, 0, t)?, sin.narrow(0, 0, t)?);
        check_tables(op, x, (t, hd), (&cos, &sin))?;
        Ok(Self {
            b,
            t,
            heads,
            kv,
            hd,
            cos,
            sin,
            compute: compute_dtype(op, x)?,
        })
    }

    /// The output rows (x's dtype) and what backward keeps.
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Kept)> {
        if let Some(f) = Flash::packed(x, (self.heads, self.kv), self.hd) {
            return self.forward_packed(f, x);
        }
        let (b, t, hd) = (self.b, self.t, self.hd);
        let x = x.detach();
        let part = |start: usize, n: usize| x.narrow(2, start * hd, n * hd)?.reshape((b, t, n, hd));
        let heads_first = |z: &Tensor| z.transpose(1, 2)?.contiguous();
        let q = heads_first(&rope(&part(0, self.heads)?, &self.cos, &self.sin)?)?;
        let k = heads_first(&rope(&part(self.heads, self.kv)?, &self.cos, &self.sin)?)?;
        let v = heads_first(&part(self.heads + self.kv, self.kv)?)?;
        let group = self.heads / self.kv;
        let scale = 1.0 / (hd as f32).sqrt();
        let (y, kept) = if group == 1 {
            attend_separate([&q, &k, &v], self.compute, scale)?
        } else {
            let (ke, ve) = (repeat_heads(&k, group)?, repeat_heads(&v, group)?);
            attend_separate([&q, &ke, &ve], self.compute, scale)?
        };
        let y = y
            .transpose(1, 2)?
            .reshape((b, t, self.heads * hd))?
            .to_dtype(x.dtype())?;
        Ok((y, kept))
    }

    /// Heads a position has in the packed rows: q's, k's and v's.
    fn parts(&self) -> usize {
        self.heads + 2 * self.kv
    }

    /// [`forward`](Self::forward) through the flash kernels on the packed
    /// rows (see the module docs): q and k turned in x's dtype (as the
    /// split path turns them), then BF16 for the kernels.
    fn forward_packed(&self, f: Flash, x: &Tensor) -> Result<(Tensor, Kept)> {
        let (b, t, hd, parts) = (self.b, self.t, self.hd, self.parts());
        let rows = x.detach().reshape((b, t, parts, hd))?;
        let turned = rope_rows(&rows, (&self.cos, &self.sin), self.heads + self.kv, 1.0)?;
        let r = flash::input(&turned.reshape((b, t, parts * hd))?)?;
        let (o, lse) = f.forward(std::slice::from_ref(&r))?;
        let y = o.to_dtype(x.dtype())?;
        let kept = Kept::Flash {
            flash: f,
            inputs: vec![r],
            o,
            lse,
        };
        Ok((y, kept))
    }

    /// The packed rows' gradient (`dtype`) from the output rows' `dy`.
    fn backward(&self, kept: &Kept, dy: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        let (b, t, hd) = (self.b, self.t, self.hd);
        if let Kept::Flash { flash, .. } = kept {
            if flash.packed {
                // dq, dk (the group's sum) and dv in one packed gradient,
                // then RoPE's transpose on its q and k heads.
                let Some(g) = kept.grads(dy)?.pop() else {
                    candle_core::bail!("amp_rope_attention: no gradient");
                };
                let parts = self.parts();
                let g = g.to_dtype(dtype)?.reshape((b, t, parts, hd))?;
                let dx = rope_rows(&g, (&self.cos, &self.sin), self.heads + self.kv, -1.0)?;
                return dx.reshape((b, t, parts * hd));
            }
        }
        let dy = dy
            .reshape((b, t, self.heads, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let grads = kept.grads(&dy)?;
        let [dq, dk, dv] = &grads[..] else {
            candle_core::bail!("amp_rope_attention: three gradients expected");
        };
        let group = self.heads / self.kv;
        let kv_sum = |g: &Tensor| -> candle_core::Result<Tensor> {
            let wide = match g.dtype() {
                DType::BF16 | DType::F16 if group > 1 => g.to_dtype(DType::F32)?,
                _ => g.clone(),
            };
            sum_groups(&wide, group)
        };
        let neg_sin = self.sin.neg()?;
        // RoPE's transpose: the same rotation by -sin, on rows [b, t, n, hd]
        let rows = |g: &Tensor, n: usize, rotate: bool| -> candle_core::Result<Tensor> {
            let g = g.to_dtype(dtype)?.transpose(1, 2)?;
            let g = if rotate {
                rope(&g, &self.cos, &neg_sin).map_err(candle_core::Error::wrap)?
            } else {
                g.contiguous()?
            };
            g.reshape((b, t, n * hd))
        };
        Tensor::cat(
            &[
                &rows(dq, self.heads, true)?,
                &rows(&kv_sum(dk)?, self.kv, true)?,
                &rows(&kv_sum(dv)?, self.kv, false)?,
            ],
            2,
        )
    }
}

/// Causal attention of a packed projection with rotary positions and
/// grouped-query attention: `qkv` `[batch, seq, (heads + 2 kv_heads) *
/// head_dim]` (q's heads, then k's, then v's) to `[batch, seq, heads *
/// head_dim]`; `cos`, `sin` as [`rope_tables`](super::rope_tables) makes
/// them (`[positions, head_dim / 2]`, the first `seq` rows used). The same
/// values as splitting, [`rope`] on q and k and [`causal_attention`](
/// super::causal_attention) on the heads, as one graph node.
///
/// # Errors
/// [`Error::Rank`] unless 3-D, [`Error::Shape`] when the width is not
/// `(heads + 2 kv_heads)` times an even head dimension, `kv_heads` does
/// not divide `heads` or the tables have fewer rows than `seq`;
/// [`Error::DType`] for a non-float input; candle's.
pub fn rope_attention_qkv(
    qkv: &Tensor,
    heads: (usize, usize),
    tables: (&Tensor, &Tensor),
) -> Result<Tensor> {
    const OP: &str = "rope_attention_qkv";
    let p = Problem::new(OP, qkv, heads, tables)?;
    let (y, kept) = p.forward(qkv)?;
    if !qkv.track_op() {
        return Ok(y);
    }
    let op = RopeAttention {
        y: Precomputed::new(OP, y),
        kept,
        p,
    };
    Ok(qkv.apply_op1(op)?)
}

/// The autograd node of [`rope_attention_qkv`].
struct RopeAttention {
    y: Precomputed,
    kept: Kept,
    p: Problem,
}

impl CustomOp1 for RopeAttention {
    fn name(&self) -> &'static str {
        "amp_rope_attention"
    }

    precomputed_fwd!(1);

    fn bwd(&self, qkv: &Tensor, _res: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.p.backward(&self.kept, dy, qkv.dtype())?))
    }
}

/// [`rope_attention_qkv`] between two handoffs: `qkv` comes from the
/// previous op (`token` stands for it in the graph, `from` takes its
/// gradient) and the output is handed on: `(y, token, handoff)`.
pub(crate) fn rope_attention_handed(
    qkv: &Tensor,
    token: &Tensor,
    from: &Handoff,
    heads: (usize, usize),
    tables: (&Tensor, &Tensor),
) -> Result<(Tensor, Tensor, Handoff)> {
    let p = Problem::new("rope_attention_qkv", qkv, heads, tables)?;
    let (y, kept) = p.forward(qkv)?;
    let to = Handoff::default();
    let op = RopeAttentionHanded {
        kept,
        p,
        dtype: qkv.dtype(),
        from: from.clone(),
        to: to.clone(),
    };
    let token = token.apply_op1(op)?;
    Ok((y, token, to))
}

/// The graph node of [`rope_attention_handed`]: a token in, a token out.
struct RopeAttentionHanded {
    kept: Kept,
    p: Problem,
    dtype: DType,
    from: Handoff,
    to: Handoff,
}

impl CustomOp1 for RopeAttentionHanded {
    fn name(&self) -> &'static str {
        "amp_rope_attention_handed"
    }

    token_fwd!(1);

    fn bwd(
        &self,
        token: &Tensor,
        _res: &Tensor,
        _token_grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let wrap = candle_core::Error::wrap;
        let dy = self.to.take().map_err(wrap)?;
        let dqkv = self.p.backward(&self.kept, &dy, self.dtype)?;
        self.from.put(dqkv).map_err(wrap)?;
        Ok(Some(Handoff::token_grad(token).map_err(wrap)?))
    }
}

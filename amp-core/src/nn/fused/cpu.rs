//! CPU bodies of the fused ops, on contiguous rows of f32 (the storage
//! conversions are in `ops.rs`). The same formulas as `kernels/nn.cu`, in
//! f32, summed in row order: the reference the CUDA kernels are checked
//! against.

/// `softmax(scale * s)` over each row of `cols`, row `r` being query
/// `r % cols`: entries above the diagonal are 0.
pub(crate) fn causal_softmax_fwd(s: &[f32], cols: usize, scale: f32) -> Vec<f32> {
    let mut out = vec![0f32; s.len()];
    for (r, (x, y)) in s.chunks(cols).zip(out.chunks_mut(cols)).enumerate() {
        let valid = r % cols + 1;
        let m = x[..valid]
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
        let mut sum = 0f32;
        for (o, &v) in y[..valid].iter_mut().zip(&x[..valid]) {
            *o = (v * scale - m).exp();
            sum += *o;
        }
        if x[..valid].iter().any(|v| v.is_nan()) {
            sum = f32::NAN;
        }
        let inv = 1.0 / sum;
        y[..valid].iter_mut().for_each(|o| *o *= inv);
    }
    out
}

/// Its backward: `scale * p * (dp - sum(p * dp))`, 0 above the diagonal.
pub(crate) fn causal_softmax_bwd(p: &[f32], dp: &[f32], cols: usize, scale: f32) -> Vec<f32> {
    let mut out = vec![0f32; p.len()];
    for (r, ((pr, gr), o)) in p
        .chunks(cols)
        .zip(dp.chunks(cols))
        .zip(out.chunks_mut(cols))
        .enumerate()
    {
        let valid = r % cols + 1;
        let dot: f32 = pr[..valid]
            .iter()
            .zip(&gr[..valid])
            .map(|(a, b)| a * b)
            .sum();
        for ((o, &a), &b) in o[..valid].iter_mut().zip(&pr[..valid]).zip(&gr[..valid]) {
            *o = scale * a * (b - dot);
        }
    }
    out
}

/// Per row `[lse - x[t], lse]`; a target outside the row gives NaN (the
/// op refuses those before calling this).
pub(crate) fn cross_entropy_fwd(x: &[f32], t: &[u32], cols: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(2 * t.len());
    for (row, &tr) in x.chunks(cols).zip(t) {
        let m = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut sum: f32 = if m == f32::NEG_INFINITY {
            0.0
        } else {
            row.iter().map(|&v| (v - m).exp()).sum()
        };
        if row.iter().any(|v| v.is_nan()) {
            sum = f32::NAN;
        }
        let lse = m + sum.ln();
        let target = row.get(tr as usize).copied().unwrap_or(f32::NAN);
        out.push(lse - target);
        out.push(lse);
    }
    out
}

/// `g * (softmax(x) - onehot(t))` per row, `gl` holding `[g, lse]` per row.
pub(crate) fn cross_entropy_bwd(x: &[f32], t: &[u32], gl: &[f32], cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (((row, o), &tr), g) in x
        .chunks(cols)
        .zip(out.chunks_mut(cols))
        .zip(t)
        .zip(gl.chunks(2))
    {
        let (g, lse) = (g[0], g[1]);
        for (j, (o, &v)) in o.iter_mut().zip(row).enumerate() {
            let hot = if j == tr as usize { 1.0 } else { 0.0 };
            *o = g * ((v - lse).exp() - hot);
        }
    }
    out
}

/// Mean and `1 / sqrt(var + eps)` of a row; `rms` (RMSNorm): the mean
/// taken as 0.
fn row_stats(x: &[f32], eps: f32, rms: bool) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = if rms { 0.0 } else { x.iter().sum::<f32>() / n };
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// LayerNorm: `(x - mean) * rstd * w + b` per row (`rms`: RMSNorm, mean 0).
pub(crate) fn layer_norm_fwd(x: &[f32], w: &[f32], b: &[f32], eps: f32, rms: bool) -> Vec<f32> {
    let cols = w.len();
    let mut out = vec![0f32; x.len()];
    for (row, o) in x.chunks(cols).zip(out.chunks_mut(cols)) {
        let (mean, rstd) = row_stats(row, eps, rms);
        for (((o, &v), &w), &b) in o.iter_mut().zip(row).zip(w).zip(b) {
            *o = (v - mean) * rstd * w + b;
        }
    }
    out
}

/// LayerNorm input gradient: `rstd * (w dy - mean(w dy) - xhat mean(w dy
/// xhat))`; RMSNorm (`rms`) has no `mean(w dy)` term.
pub(crate) fn layer_norm_dx(x: &[f32], w: &[f32], dy: &[f32], eps: f32, rms: bool) -> Vec<f32> {
    let cols = w.len();
    let n = cols as f32;
    let mut out = vec![0f32; x.len()];
    for ((row, g), o) in x
        .chunks(cols)
        .zip(dy.chunks(cols))
        .zip(out.chunks_mut(cols))
    {
        let (mean, rstd) = row_stats(row, eps, rms);
        let (mut s1, mut s2) = (0f32, 0f32);
        for ((&v, &g), &w) in row.iter().zip(g).zip(w) {
            let wg = w * g;
            s1 += wg;
            s2 += wg * ((v - mean) * rstd);
        }
        let (s1, s2) = (if rms { 0.0 } else { s1 / n }, s2 / n);
        for (((o, &v), &g), &w) in o.iter_mut().zip(row).zip(g).zip(w) {
            let xhat = (v - mean) * rstd;
            *o = rstd * (w * g - s1 - xhat * s2);
        }
    }
    out
}

/// LayerNorm weight and bias gradients: `[dw (cols), db (cols)]`.
pub(crate) fn layer_norm_dwdb(x: &[f32], dy: &[f32], cols: usize, eps: f32, rms: bool) -> Vec<f32> {
    let mut out = vec![0f32; 2 * cols];
    for (row, g) in x.chunks(cols).zip(dy.chunks(cols)) {
        let (mean, rstd) = row_stats(row, eps, rms);
        let (dw, db) = out.split_at_mut(cols);
        for (((dw, db), &v), &g) in dw.iter_mut().zip(db.iter_mut()).zip(row).zip(g) {
            *dw += g * ((v - mean) * rstd);
            *db += g;
        }
    }
    out
}

/// GELU, tanh form (candle's `gelu`).
pub(crate) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (0.797_884_6 * x * (1.0 + 0.044715 * x * x)).tanh())
}

/// The derivative of [`gelu`], as candle's backward computes it.
pub(crate) fn gelu_grad(x: f32) -> f32 {
    let x3 = x * x * x;
    let th = (0.035_677_4 * x3 + 0.797_885 * x).tanh();
    0.5 * th + (0.053_516_1 * x3 + 0.398_942 * x) * (1.0 - th * th) + 0.5
}

/// SwiGLU of one row of `2 f` (gate `a`, then up `b`): `silu(a) * b`, as
/// the CUDA kernel computes it.
pub(crate) fn swiglu(a: f32, b: f32) -> f32 {
    a * sigmoid(a) * b
}

/// SwiGLU's gradients `(da, db)` for `dy`, as the CUDA kernel computes them.
pub(crate) fn swiglu_grad(a: f32, b: f32, dy: f32) -> (f32, f32) {
    let s = sigmoid(a);
    (dy * b * (s * (1.0 + a * (1.0 - s))), dy * (a * s))
}

/// The logistic function, `1 / (1 + exp(-a))`.
fn sigmoid(a: f32) -> f32 {
    1.0 / (1.0 + (-a).exp())
}

/// Row chunks of the column sums (the bias gradient, the CUDA LayerNorm's
/// weight-gradient partials): `(chunks, rows per chunk)`, at most 128 chunks.
pub(crate) fn chunking(rows: usize) -> (usize, usize) {
    const CHUNKS: usize = 128;
    let chunks = CHUNKS.min(rows.max(1));
    let per_chunk = rows.div_ceil(chunks).max(1);
    (rows.div_ceil(per_chunk).max(1), per_chunk)
}

/// The sums over the rows of `x` (`cols` wide), in the CUDA kernels' order:
/// per chunk of rows (`chunking`), per column 8 lanes (rows `r0 + j`,
/// `r0 + j + 8`, ... in order), lanes 1..7 added to lane 0 in order; then
/// the chunks' sums added from 0 in order. So both devices give the same
/// bits.
pub(crate) fn col_sum(x: &[f32], cols: usize) -> Vec<f32> {
    let cols = cols.max(1);
    let rows = x.len() / cols;
    let (chunks, per) = chunking(rows);
    let mut out = vec![0f32; cols];
    for ch in 0..chunks {
        let (r0, r1) = (ch * per, rows.min((ch + 1) * per));
        for (c, o) in out.iter_mut().enumerate() {
            let mut lanes = [0f32; 8];
            for (j, lane) in lanes.iter_mut().enumerate() {
                let mut r = r0 + j;
                while r < r1 {
                    *lane += x[r * cols + c];
                    r += 8;
                }
            }
            let part = lanes[1..].iter().fold(lanes[0], |a, v| a + v);
            *o += part;
        }
    }
    out
}

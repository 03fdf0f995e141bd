// Rotary position embeddings (RoPE, Hugging Face Llama's rotate_half) of
// nn.cu, which includes this after its ld/st helpers.
#pragma once

// ---------------------------------------------------------------------------
// x [batch, seq, heads, 2 half] rows; pair p is (x[i], x[i + half]) of row
// p / half, i = p % half, at position t = (row / heads) % seq:
//   y[i]        = x[i] cos[t, i] - x[i + half] s
//   y[i + half] = x[i + half] cos[t, i] + x[i] s,    s = sign * sin[t, i]
// sign +1 is RoPE, -1 its transpose (the backward). Only the first `rot`
// heads of each position turn (a packed q, k, v projection's q and k
// heads); the others are copied. The roundings are
// explicit (no fused multiply-add): the CPU body's f32 expression, the
// same bits. One thread per pair, a grid-stride loop.

template <typename T>
__device__ void rope_impl(const T* __restrict__ x, const float* __restrict__ cos_t,
                          const float* __restrict__ sin_t, T* __restrict__ y, size_t pairs, size_t half,
                          size_t heads, size_t rot, size_t seq, float sign) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t p = (size_t)blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += stride) {
        const size_t row = p / half, i = p % half;
        const size_t t = (row / heads) % seq;
        const size_t j = row * 2 * half + i;
        const float a = ld(x, j), b = ld(x, j + half);
        if (row % heads >= rot) {
            st(y, j, a);
            st(y, j + half, b);
            continue;
        }
        const float c = cos_t[t * half + i], s = __fmul_rn(sign, sin_t[t * half + i]);
        st(y, j, __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
        st(y, j + half, __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
    }
}

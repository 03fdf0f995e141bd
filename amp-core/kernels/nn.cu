// Fused training ops of a transformer, forward and backward: the causal
// softmax of attention (scale and mask inside), cross-entropy over a
// vocabulary, LayerNorm and RMSNorm, GELU (tanh form), SwiGLU, RoPE. Each
// replaces a chain of
// candle's elementwise kernels (and the zero-fill + add that candle's
// backprop spends on every node's gradient) by one or two passes.
//
// Storage types: float and bf16 (`T`); every sum in f32. Rows are
// contiguous; a host flag `vec` says whether rows and bases allow 16-byte
// loads (row length a multiple of the pack and 16-byte-aligned bases).
// The CPU bodies (src/nn/fused/cpu.rs) compute the same formulas in the
// same precision; transcendental functions (expf, logf, tanhf) may differ
// from Rust's by an ulp, so the two agree to rounding, not bit for bit.

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

__device__ __forceinline__ float ld(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__nv_bfloat16* p, size_t i, float v) { p[i] = __float2bfloat16_rn(v); }
// v rounded to T's precision, as f32.
__device__ __forceinline__ float rounded(const float*, float v) { return v; }
__device__ __forceinline__ float rounded(const __nv_bfloat16*, float v) {
    return __bfloat162float(__float2bfloat16_rn(v));
}

// W elements at p[i..i+W]: one 16-byte load when W is the pack width.
template <typename T, int W>
__device__ __forceinline__ void load(const T* p, size_t i, float* out) {
    if constexpr (W * sizeof(T) == 16) {
        uint4 w = *reinterpret_cast<const uint4*>(p + i);
        const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
        for (int k = 0; k < W; ++k) out[k] = ld(e, k);
    } else {
#pragma unroll
        for (int k = 0; k < W; ++k) out[k] = ld(p, i + k);
    }
}

template <typename T, int W>
__device__ __forceinline__ void store(T* p, size_t i, const float* v) {
    if constexpr (W * sizeof(T) == 16) {
        uint4 w;
        T* e = reinterpret_cast<T*>(&w);
#pragma unroll
        for (int k = 0; k < W; ++k) st(e, k, v[k]);
        *reinterpret_cast<uint4*>(p + i) = w;
    } else {
#pragma unroll
        for (int k = 0; k < W; ++k) st(p, i + k, v[k]);
    }
}

template <typename T> struct Pack { static constexpr int N = 16 / sizeof(T); };

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Online softmax state (running max m, sum of exp(x - m)).
struct MaxSum {
    float m, s;
};

__device__ __forceinline__ void ms_add(MaxSum& a, float x) {
    if (x == -INFINITY) return;
    if (x > a.m) {
        a.s = a.s * expf(a.m - x) + 1.0f;
        a.m = x;
    } else {
        a.s += expf(x - a.m);  // NaN stays NaN
    }
}

__device__ __forceinline__ MaxSum ms_merge(MaxSum a, MaxSum b) {
    const bool nan = isnan(a.m) || isnan(b.m) || isnan(a.s) || isnan(b.s);
    const float m = fmaxf(a.m, b.m);
    float s = 0.0f;
    if (m != -INFINITY) {
        const float sa = a.m == -INFINITY ? 0.0f : a.s * expf(a.m - m);
        const float sb = b.m == -INFINITY ? 0.0f : b.s * expf(b.m - m);
        s = sa + sb;
    }
    return {m, nan ? NAN : s};
}

__device__ __forceinline__ MaxSum warp_ms(MaxSum v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        MaxSum w{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
        v = ms_merge(v, w);
    }
    return v;
}

// ---------------------------------------------------------------------------
// Causal softmax: rows of `cols` scores, row r is query r % cols; p[j] =
// softmax(scale * s[0..=q])[j] for j <= q, 0 above. One warp per row.

template <typename T, int W>
__device__ void causal_softmax_fwd_impl(const T* __restrict__ s, T* __restrict__ p, size_t rows,
                                        int cols, float scale) {
    const int lane = threadIdx.x & 31;
    const size_t row = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int q = (int)(row % (size_t)cols);
    const T* x = s + row * cols;
    T* y = p + row * cols;
    MaxSum a{-INFINITY, 0.0f};
    for (int j0 = lane * W; j0 <= q; j0 += 32 * W) {
        float v[W];
        load<T, W>(x, j0, v);
#pragma unroll
        for (int k = 0; k < W; ++k)
            if (j0 + k <= q) ms_add(a, v[k] * scale);
    }
    a = warp_ms(a);
    const float inv = 1.0f / a.s;
    for (int j0 = lane * W; j0 < cols; j0 += 32 * W) {
        float v[W];
        if (j0 <= q) load<T, W>(x, j0, v);
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] = j0 + k <= q ? expf(v[k] * scale - a.m) * inv : 0.0f;
        store<T, W>(y, j0, v);
    }
}

// ds = scale * p * (dp - sum_j p_j dp_j), 0 above the diagonal.
template <typename T, int W>
__device__ void causal_softmax_bwd_impl(const T* __restrict__ p, const T* __restrict__ dp,
                                        T* __restrict__ ds, size_t rows, int cols, float scale) {
    const int lane = threadIdx.x & 31;
    const size_t row = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int q = (int)(row % (size_t)cols);
    const size_t base = row * cols;
    float dot = 0.0f;
    for (int j0 = lane * W; j0 <= q; j0 += 32 * W) {
        float a[W], b[W];
        load<T, W>(p + base, j0, a);
        load<T, W>(dp + base, j0, b);
#pragma unroll
        for (int k = 0; k < W; ++k)
            if (j0 + k <= q) dot += a[k] * b[k];
    }
    dot = warp_sum(dot);
    for (int j0 = lane * W; j0 < cols; j0 += 32 * W) {
        float a[W], b[W], o[W];
        if (j0 <= q) {
            load<T, W>(p + base, j0, a);
            load<T, W>(dp + base, j0, b);
        }
#pragma unroll
        for (int k = 0; k < W; ++k) o[k] = j0 + k <= q ? scale * a[k] * (b[k] - dot) : 0.0f;
        store<T, W>(ds + base, j0, o);
    }
}

#include "nn_xent.cuh"

#include "nn_pointwise.cuh"

#include "nn_norm.cuh"

#include "nn_swiglu.cuh"

#include "nn_layout.cuh"

#include "nn_embedding.cuh"

#include "nn_rope.cuh"

// ---------------------------------------------------------------------------
// Entry points: `vec` picks the 16-byte path.

#define NN_KERNELS(TN, T)                                                                            \
    extern "C" __global__ void causal_softmax_fwd_##TN(const T* s, T* p, size_t rows, int cols,       \
                                                      float scale, int vec) {                        \
        if (vec) causal_softmax_fwd_impl<T, Pack<T>::N>(s, p, rows, cols, scale);                    \
        else causal_softmax_fwd_impl<T, 1>(s, p, rows, cols, scale);                                 \
    }                                                                                                \
    extern "C" __global__ void causal_softmax_bwd_##TN(const T* p, const T* dp, T* ds, size_t rows,  \
                                                      int cols, float scale, int vec) {              \
        if (vec) causal_softmax_bwd_impl<T, Pack<T>::N>(p, dp, ds, rows, cols, scale);               \
        else causal_softmax_bwd_impl<T, 1>(p, dp, ds, rows, cols, scale);                            \
    }                                                                                                \
    extern "C" __global__ void cross_entropy_fwd_##TN(const T* x, const uint32_t* t, float* out,     \
                                                     int cols, int vec) {                            \
        if (vec) cross_entropy_fwd_impl<T, Pack<T>::N>(x, t, out, cols);                             \
        else cross_entropy_fwd_impl<T, 1>(x, t, out, cols);                                          \
    }                                                                                                \
    extern "C" __global__ void cross_entropy_bwd_##TN(const T* x, const uint32_t* t, const float* gl, \
                                                     T* dx, int cols, int vec) {                     \
        if (vec) cross_entropy_bwd_impl<T, Pack<T>::N>(x, t, gl, dx, cols);                          \
        else cross_entropy_bwd_impl<T, 1>(x, t, gl, dx, cols);                                       \
    }                                                                                                \
    extern "C" __global__ void cross_entropy_fwd_bwd_##TN(const T* x, const uint32_t* t, float* out,  \
                                                         T* dx, int cols, int vec) {                 \
        if (vec) cross_entropy_fwd_bwd_impl<T, Pack<T>::N>(x, t, out, dx, cols);                     \
        else cross_entropy_fwd_bwd_impl<T, 1>(x, t, out, dx, cols);                                  \
    }                                                                                                \
    extern "C" __global__ void bias_add_##TN(const T* x, const float* b, T* y, size_t n, int cols,    \
                                            int vec) {                                               \
        if (vec) bias_add_impl<T, Pack<T>::N>(x, b, y, n, cols);                                     \
        else bias_add_impl<T, 1>(x, b, y, n, cols);                                                  \
    }                                                                                                \
    extern "C" __global__ void col_sum_part_##TN(const T* x, float* part, size_t rows, int cols,     \
                                                size_t rows_per_chunk) {                             \
        col_sum_part_impl<T, false>(x, part, rows, cols, rows_per_chunk, nullptr);                   \
    }                                                                                                \
    extern "C" __global__ void col_sum_part_v_##TN(const T* x, float* part, size_t rows, int cols,   \
                                                  size_t rows_per_chunk) {                           \
        col_sum_part_v_impl<T, false>(x, part, rows, cols, rows_per_chunk, nullptr);                 \
    }                                                                                                \
    extern "C" __global__ void col_sum_amax_part_##TN(const T* x, float* part, size_t rows,         \
                                                     int cols, size_t rows_per_chunk,                \
                                                     uint32_t* amax) {                               \
        col_sum_part_impl<T, true>(x, part, rows, cols, rows_per_chunk, amax);                       \
    }                                                                                                \
    extern "C" __global__ void col_sum_amax_part_v_##TN(const T* x, float* part, size_t rows,       \
                                                       int cols, size_t rows_per_chunk,              \
                                                       uint32_t* amax) {                             \
        col_sum_part_v_impl<T, true>(x, part, rows, cols, rows_per_chunk, amax);                     \
    }                                                                                                \
    extern "C" __global__ void gelu_bwd_col_sum_amax_part_v_##TN(                                  \
        const T* x, const T* dy, T* dx, float* part, size_t rows, int cols, size_t rows_per_chunk,   \
        uint32_t* amax) {                                                                            \
        col_sum_part_v_impl<T, true, true>(x, part, rows, cols, rows_per_chunk, amax, dy, dx);       \
    }                                                                                                \
    extern "C" __global__ void rows_to_heads_##TN(const T* src, __nv_bfloat16* dst, int B, int T_,   \
                                                 int S, int H, int D, int which, int vec) {          \
        if (vec) rows_to_heads_impl<T, 8>(src, dst, B, T_, S, H, D, which);                          \
        else rows_to_heads_impl<T, 1>(src, dst, B, T_, S, H, D, which);                              \
    }                                                                                                \
    extern "C" __global__ void heads_to_rows_##TN(const __nv_bfloat16* src, T* dst, int B, int T_,   \
                                                 int S, int H, int D, int which, int vec) {          \
        if (vec) heads_to_rows_impl<T, 8>(src, dst, B, T_, S, H, D, which);                          \
        else heads_to_rows_impl<T, 1>(src, dst, B, T_, S, H, D, which);                              \
    }                                                                                                \
    extern "C" __global__ void gelu_fwd_##TN(const T* x, T* y, size_t n, int vec) {                  \
        if (vec) gelu_fwd_impl<T, Pack<T>::N, false>(x, y, n, nullptr);                              \
        else gelu_fwd_impl<T, 1, false>(x, y, n, nullptr);                                           \
    }                                                                                                \
    extern "C" __global__ void gelu_fwd_amax_##TN(const T* x, T* y, size_t n, int vec,              \
                                                 uint32_t* amax) {                                   \
        if (vec) gelu_fwd_impl<T, Pack<T>::N, true>(x, y, n, amax);                                  \
        else gelu_fwd_impl<T, 1, true>(x, y, n, amax);                                               \
    }                                                                                                \
    extern "C" __global__ void gelu_bwd_##TN(const T* x, const T* dy, T* dx, size_t n, int vec) {    \
        if (vec) gelu_bwd_impl<T, Pack<T>::N>(x, dy, dx, n);                                         \
        else gelu_bwd_impl<T, 1>(x, dy, dx, n);                                                      \
    }                                                                                                \
    extern "C" __global__ void swiglu_fwd_##TN(const T* x, T* y, size_t rows, size_t f, int vec) {   \
        if (vec) swiglu_fwd_impl<T, Pack<T>::N>(x, y, rows, f);                                      \
        else swiglu_fwd_impl<T, 1>(x, y, rows, f);                                                   \
    }                                                                                                \
    extern "C" __global__ void swiglu_bwd_##TN(const T* x, const T* dy, T* dx, size_t rows,          \
                                              size_t f, int vec) {                                   \
        if (vec) swiglu_bwd_impl<T, Pack<T>::N>(x, dy, dx, rows, f);                                 \
        else swiglu_bwd_impl<T, 1>(x, dy, dx, rows, f);                                              \
    }                                                                                                \
    extern "C" __global__ void rope_##TN(const T* x, const float* cos_t, const float* sin_t, T* y,   \
                                        size_t pairs, size_t half, size_t heads, size_t rot,         \
                                        size_t seq, float sign) {                                    \
        rope_impl<T>(x, cos_t, sin_t, y, pairs, half, heads, rot, seq, sign);                        \
    }

NN_KERNELS(f32, float)
NN_KERNELS(bf16, __nv_bfloat16)
NORM_KERNELS(f32, float)
NORM_KERNELS(bf16, __nv_bfloat16)

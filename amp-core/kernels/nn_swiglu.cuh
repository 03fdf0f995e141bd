// SwiGLU of nn.cu, which includes this after its load/store helpers:
// rows of 2F (gate a, then up b, side by side as one fc1 produces them) to
// rows of F, y = silu(a) * b with silu(a) = a / (1 + exp(-a)); backward
// da = dy * b * s * (1 + a (1 - s)) with s = 1 / (1 + exp(-a)), db = dy *
// silu(a). The CPU bodies (`cpu::swiglu*`) compute the same expressions.
#pragma once

__device__ __forceinline__ float sigmoid_f(float a) { return 1.0f / (1.0f + expf(-a)); }

// W consecutive output elements a thread (16-byte loads and stores when W
// is the pack width: the host's `vec` says F is a multiple of it and the
// bases are aligned); the same expression per element as W = 1.
template <typename T, int W>
__device__ void swiglu_fwd_impl(const T* __restrict__ x, T* __restrict__ y, size_t rows, size_t f) {
    const size_t n = rows * f;
    const size_t stride = (size_t)gridDim.x * blockDim.x * W;
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * W; i < n; i += stride) {
        const size_t r = i / f, c = i - r * f;
        float a[W], b[W];
        load<T, W>(x, r * 2 * f + c, a);
        load<T, W>(x, r * 2 * f + f + c, b);
#pragma unroll
        for (int k = 0; k < W; ++k) a[k] = a[k] * sigmoid_f(a[k]) * b[k];
        store<T, W>(y, i, a);
    }
}

// dx[r, c] (gate) and dx[r, F + c] (up) of x and dy[r, c], W at a time.
template <typename T, int W>
__device__ void swiglu_bwd_impl(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                                size_t rows, size_t f) {
    const size_t n = rows * f;
    const size_t stride = (size_t)gridDim.x * blockDim.x * W;
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * W; i < n; i += stride) {
        const size_t r = i / f, c = i - r * f;
        float a[W], b[W], g[W], da[W], db[W];
        load<T, W>(x, r * 2 * f + c, a);
        load<T, W>(x, r * 2 * f + f + c, b);
        load<T, W>(dy, i, g);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float s = sigmoid_f(a[k]);
            da[k] = g[k] * b[k] * (s * (1.0f + a[k] * (1.0f - s)));
            db[k] = g[k] * (a[k] * s);
        }
        store<T, W>(dx, r * 2 * f + c, da);
        store<T, W>(dx, r * 2 * f + f + c, db);
    }
}

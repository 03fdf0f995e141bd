// SwiGLU of nn.cu, which includes this after its load/store helpers:
// rows of 2F (gate a, then up b, side by side as one fc1 produces them) to
// rows of F, y = silu(a) * b with silu(a) = a / (1 + exp(-a)); backward
// da = dy * b * s * (1 + a (1 - s)) with s = 1 / (1 + exp(-a)), db = dy *
// silu(a). The CPU bodies (`cpu::swiglu*`) compute the same expressions.
#pragma once

__device__ __forceinline__ float sigmoid_f(float a) { return 1.0f / (1.0f + expf(-a)); }

// One thread an output element: y[r, c] of x[r, c] and x[r, F + c].
template <typename T>
__device__ void swiglu_fwd_impl(const T* __restrict__ x, T* __restrict__ y, size_t rows, size_t f) {
    const size_t n = rows * f;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t r = i / f, c = i - r * f;
        const float a = ld(x, r * 2 * f + c), b = ld(x, r * 2 * f + f + c);
        st(y, i, a * sigmoid_f(a) * b);
    }
}

// dx[r, c] (gate) and dx[r, F + c] (up) of x and dy[r, c].
template <typename T>
__device__ void swiglu_bwd_impl(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                                size_t rows, size_t f) {
    const size_t n = rows * f;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t r = i / f, c = i - r * f;
        const float a = ld(x, r * 2 * f + c), b = ld(x, r * 2 * f + f + c);
        const float g = ld(dy, i);
        const float s = sigmoid_f(a);
        st(dx, r * 2 * f + c, g * b * (s * (1.0f + a * (1.0f - s))));
        st(dx, r * 2 * f + f + c, g * (a * s));
    }
}

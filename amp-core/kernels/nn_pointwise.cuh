// GELU and the bias (forward and backward) of nn.cu, which includes this
// after its load/store helpers.
#pragma once

// ---------------------------------------------------------------------------
// GELU, tanh form (candle's `gelu`): y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

__device__ __forceinline__ float gelu_f(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * x * (1.0f + 0.044715f * x * x)));
}

// candle's backward formula for its gelu.
__device__ __forceinline__ float gelu_grad(float x) {
    const float x3 = x * x * x;
    const float th = tanhf(0.0356774f * x3 + 0.797885f * x);
    return 0.5f * th + (0.0535161f * x3 + 0.398942f * x) * (1.0f - th * th) + 0.5f;
}

__device__ __forceinline__ uint32_t abs_bits_f(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

// The largest of a 1-D block's threads' `m` (|x|'s bits, as the amax
// kernels of amp.cu take them: NaN's above inf's) into *out, atomically.
__device__ __forceinline__ void block_amax_1d(uint32_t m, uint32_t* out) {
    __shared__ uint32_t s[32];
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) s[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < (int)(blockDim.x >> 5); ++k) m = max(m, s[k]);
        atomicMax(out, m);
    }
}

// GELU; with AMAX also max |y| of the stored (rounded) outputs into *amax.
template <typename T, int W, bool AMAX>
__device__ void gelu_fwd_impl(const T* __restrict__ x, T* __restrict__ y, size_t n, uint32_t* amax) {
    const size_t stride = (size_t)gridDim.x * blockDim.x * W;
    uint32_t m = 0;
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * W; i < n; i += stride) {
        float v[W];
        if (i + W <= n) {
            load<T, W>(x, i, v);
#pragma unroll
            for (int k = 0; k < W; ++k) {
                v[k] = gelu_f(v[k]);
                if (AMAX) m = max(m, abs_bits_f(rounded(y, v[k])));
            }
            store<T, W>(y, i, v);
        } else {
            for (size_t k = i; k < n; ++k) {
                const float g = gelu_f(ld(x, k));
                if (AMAX) m = max(m, abs_bits_f(rounded(y, g)));
                st(y, k, g);
            }
        }
    }
    if (AMAX) block_amax_1d(m, amax);
}

template <typename T, int W>
__device__ void gelu_bwd_impl(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                              size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x * W;
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * W; i < n; i += stride) {
        float v[W], g[W];
        if (i + W <= n) {
            load<T, W>(x, i, v);
            load<T, W>(dy, i, g);
#pragma unroll
            for (int k = 0; k < W; ++k) v[k] = g[k] * gelu_grad(v[k]);
            store<T, W>(dx, i, v);
        } else {
            for (size_t k = i; k < n; ++k) st(dx, k, ld(dy, k) * gelu_grad(ld(x, k)));
        }
    }
}

// ---------------------------------------------------------------------------
// Bias: y[r, c] = x[r, c] + b[c] (b F32), and its gradient, the column sums
// of dy: per-chunk partials (block (32, 8), grid (ceil(cols / 32), chunks)),
// then the chunks summed in order (deterministic).

template <typename T, int W>
__device__ void bias_add_impl(const T* __restrict__ x, const float* __restrict__ b, T* __restrict__ y,
                              size_t n, int cols) {
    const size_t stride = (size_t)gridDim.x * blockDim.x * W;
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * W; i < n; i += stride) {
        float v[W];
        if (i + W <= n) {
            load<T, W>(x, i, v);
            const int c = (int)(i % (size_t)cols);  // W divides cols on the vector path
#pragma unroll
            for (int k = 0; k < W; ++k) v[k] += b[c + k];
            store<T, W>(y, i, v);
        } else {
            for (size_t k = i; k < n; ++k) st(y, k, ld(x, k) + b[k % (size_t)cols]);
        }
    }
}

// The largest of a 32 x 8 block's threads' `m` (|x|'s bits, as the amax
// kernels of amp.cu take them: NaN's above inf's) into *out, atomically.
__device__ __forceinline__ void block_amax_32x8(uint32_t m, uint32_t* out) {
    __shared__ uint32_t s[8];
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if (threadIdx.x == 0) s[threadIdx.y] = m;
    __syncthreads();
    if (threadIdx.y == 0 && threadIdx.x == 0) {
        for (int k = 1; k < 8; ++k) m = max(m, s[k]);
        atomicMax(out, m);
    }
}

// The column sums' partials of a chunk of rows; with AMAX, also max |x| of
// the elements read (into *amax, atomically), as amax_<T> computes it.
template <typename T, bool AMAX>
__device__ void col_sum_part_impl(const T* __restrict__ x, float* __restrict__ part, size_t rows,
                                  int cols, size_t rows_per_chunk, uint32_t* amax) {
    __shared__ float sh[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const size_t r0 = (size_t)blockIdx.y * rows_per_chunk;
    const size_t r1 = min(rows, r0 + rows_per_chunk);
    float a = 0.0f;
    uint32_t m = 0;
    if (c < cols)
        for (size_t r = r0 + threadIdx.y; r < r1; r += 8) {
            const float v = ld(x, r * cols + c);
            a += v;
            if (AMAX) m = max(m, abs_bits_f(v));
        }
    sh[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        for (int k = 1; k < 8; ++k) a += sh[k][threadIdx.x];
        part[(size_t)blockIdx.y * cols + c] = a;
    }
    if (AMAX) block_amax_32x8(m, amax);
}

// col_sum_part_impl with 8 consecutive columns a thread (one 16-byte load
// of BF16, two of F32): a warp reads 32 x 8 columns of a row at once. The
// same sums in the same order (each column: rows r0 + ty, r0 + ty + 8, ...
// in its lane, then lanes 1..7 added to lane 0 in order), so the same bits.
// Needs cols % 8 == 0 and a 16-byte-aligned x. With GELU, x is GELU's
// input and `dy` its output's gradient: the pass computes dx = dy *
// gelu'(x) as gelu_bwd_impl does, stores it, and sums (and takes the amax
// of) the stored, rounded dx: gelu_bwd then col_sum_amax in one pass, the
// bits of both.
template <typename T, bool AMAX, bool GELU = false>
__device__ void col_sum_part_v_impl(const T* __restrict__ x, float* __restrict__ part, size_t rows,
                                    int cols, size_t rows_per_chunk, uint32_t* amax,
                                    const T* __restrict__ dy = nullptr, T* __restrict__ dx = nullptr) {
    __shared__ float sh[8][32][9];
    const int c = (blockIdx.x * 32 + threadIdx.x) * 8;
    const size_t r0 = (size_t)blockIdx.y * rows_per_chunk;
    const size_t r1 = min(rows, r0 + rows_per_chunk);
    float a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    uint32_t m = 0;
    if (c < cols) {
        for (size_t r = r0 + threadIdx.y; r < r1; r += 8) {
            float v[8];
            load<T, 8>(x, r * cols + c, v);
            if constexpr (GELU) {
                float g[8];
                load<T, 8>(dy, r * cols + c, g);
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = g[j] * gelu_grad(v[j]);
                store<T, 8>(dx, r * cols + c, v);
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = rounded(dx, v[j]);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                a[j] += v[j];
                if (AMAX) m = max(m, abs_bits_f(v[j]));
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) sh[threadIdx.y][threadIdx.x][j] = a[j];
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        for (int k = 1; k < 8; ++k) {
#pragma unroll
            for (int j = 0; j < 8; ++j) a[j] += sh[k][threadIdx.x][j];
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) part[(size_t)blockIdx.y * cols + c + j] = a[j];
    }
    if (AMAX) block_amax_32x8(m, amax);
}

extern "C" __global__ void col_sum_final(const float* __restrict__ part, float* __restrict__ out, int cols,
                                         int chunks) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        float a = 0.0f;
        for (int k = 0; k < chunks; ++k) a += part[(size_t)k * cols + c];
        out[c] = a;
    }
}


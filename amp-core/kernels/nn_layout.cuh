// The attention's layout kernels of nn.cu (rows to heads and back), which
// includes this after its load/store helpers.
#pragma once

// ---------------------------------------------------------------------------
// Attention layouts. Rows [B, T, S, H, D] (S = 3 for a fused q|k|v
// projection, 1 otherwise) and heads [B, H, T, D] (BF16, the products'
// operands): part `which` of the rows to heads, or heads into part `which`
// of the rows, with the dtype conversion in the same pass. `W` elements of
// D per thread step (16-byte BF16 stores when D % 8 == 0).

// The rows' offset of element `o` of the heads [B, H, T, D] (part `which`).
__device__ __forceinline__ size_t rows_offset(size_t o, int T_, int S, int H, int D, int which) {
    const int d = (int)(o % D);
    const size_t r = o / D;
    const int t = (int)(r % T_);
    const size_t bh = r / T_;
    const int h = (int)(bh % H);
    const size_t b = bh / H;
    return (((b * T_ + t) * S + which) * H + h) * (size_t)D + d;
}

template <typename T, int W>
__device__ void rows_to_heads_impl(const T* __restrict__ src, __nv_bfloat16* __restrict__ dst, int B,
                                   int T_, int S, int H, int D, int which) {
    const size_t n = (size_t)B * H * T_ * D / W;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t o = i * W;
        float v[W];
        load<T, W>(src, rows_offset(o, T_, S, H, D, which), v);
        store<__nv_bfloat16, W>(dst, o, v);
    }
}

template <typename T, int W>
__device__ void heads_to_rows_impl(const __nv_bfloat16* __restrict__ src, T* __restrict__ dst, int B,
                                   int T_, int S, int H, int D, int which) {
    const size_t n = (size_t)B * H * T_ * D / W;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t o = i * W;
        float v[W];
        load<__nv_bfloat16, W>(src, o, v);
        store<T, W>(dst, rows_offset(o, T_, S, H, D, which), v);
    }
}


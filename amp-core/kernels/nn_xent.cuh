// The cross-entropy kernels of nn.cu (forward and backward), which nn.cu includes after its helpers.
#pragma once

// ---------------------------------------------------------------------------
// Cross-entropy: rows of `cols` logits, targets t[r]; out[2r] = lse - x[t],
// out[2r + 1] = lse (kept for the backward). A target >= cols gives NaN.
// One block per row.

template <int THREADS>
__device__ MaxSum block_ms(MaxSum a) {
    __shared__ float sm[THREADS / 32], ss[THREADS / 32];
    a = warp_ms(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        sm[warp] = a.m;
        ss[warp] = a.s;
    }
    __syncthreads();
    MaxSum r{-INFINITY, 0.0f};
    if (warp == 0) {
        if (lane < THREADS / 32) r = MaxSum{sm[lane], ss[lane]};
        r = warp_ms(r);
        if (lane == 0) {
            sm[0] = r.m;
            ss[0] = r.s;
        }
    }
    __syncthreads();
    return MaxSum{sm[0], ss[0]};
}

constexpr int CE_THREADS = 256;

// The row's log-sum-exp over `cols` logits from xr, every thread's; thread
// 0 writes the pair (lse - x[t], lse) to out2 (NaN for a target >= cols).
template <typename T, int W>
__device__ float row_lse(const T* __restrict__ xr, uint32_t tr, float* __restrict__ out2, int cols) {
    MaxSum a{-INFINITY, 0.0f};
    for (int j0 = threadIdx.x * W; j0 < cols; j0 += CE_THREADS * W) {
        float v[W];
        load<T, W>(xr, j0, v);
#pragma unroll
        for (int k = 0; k < W; ++k) ms_add(a, v[k]);
    }
    a = block_ms<CE_THREADS>(a);
    const float lse = a.m + logf(a.s);
    if (threadIdx.x == 0) {
        out2[0] = tr < (uint32_t)cols ? lse - ld(xr, tr) : NAN;
        out2[1] = lse;
    }
    return lse;
}

// dx = g * (exp(x - lse) - (j == t)) over a row of `cols`.
template <typename T, int W>
__device__ void row_grad(const T* __restrict__ xr, T* __restrict__ dxr, float g, float lse, uint32_t tr, int cols) {
    for (int j0 = threadIdx.x * W; j0 < cols; j0 += CE_THREADS * W) {
        float v[W];
        load<T, W>(xr, j0, v);
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] = g * (expf(v[k] - lse) - ((uint32_t)(j0 + k) == tr ? 1.0f : 0.0f));
        store<T, W>(dxr, j0, v);
    }
}

template <typename T, int W>
__device__ void cross_entropy_fwd_impl(const T* __restrict__ x, const uint32_t* __restrict__ t,
                                       float* __restrict__ out, int cols) {
    const size_t row = blockIdx.x;
    row_lse<T, W>(x + row * cols, t[row], out + 2 * row, cols);
}

// dx[r, j] = g * (exp(x[r, j] - lse) - (j == t[r])), (g, lse) = gl[2r], gl[2r + 1].
template <typename T, int W>
__device__ void cross_entropy_bwd_impl(const T* __restrict__ x, const uint32_t* __restrict__ t,
                                       const float* __restrict__ gl, T* __restrict__ dx, int cols) {
    const size_t row = blockIdx.x;
    row_grad<T, W>(x + row * cols, dx + row * cols, gl[2 * row], gl[2 * row + 1], t[row], cols);
}

// Both at once where the gradient's g is 1 (the head's loss over chunks of
// rows, nn/linear/head_loss.rs): the forward's pair, then the backward from
// the same lse. Bit for bit the forward and then the backward with gl =
// [1, lse]: every thread takes the lse from the block's reduced (max, sum)
// as the forward's thread 0 does.
template <typename T, int W>
__device__ void cross_entropy_fwd_bwd_impl(const T* __restrict__ x, const uint32_t* __restrict__ t,
                                           float* __restrict__ out, T* __restrict__ dx, int cols) {
    const size_t row = blockIdx.x;
    const uint32_t tr = t[row];
    const float lse = row_lse<T, W>(x + row * cols, tr, out + 2 * row, cols);
    row_grad<T, W>(x + row * cols, dx + row * cols, 1.0f, lse, tr, cols);
}

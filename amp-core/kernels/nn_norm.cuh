// LayerNorm and RMSNorm, forward and backward (included by nn.cu, which
// defines ld/st, load/store, Pack and warp_sum; nn_pointwise.cuh the amax
// helpers).
//
// LayerNorm over rows of `cols`: y = (x - mean) * rstd * w + b, with
// rstd = 1 / sqrt(var + eps), var the mean of (x - mean)^2. One warp per row.
// Each kernel takes `rms`: RMSNorm, the same with the mean taken as 0 (the
// caller passes a zero b; its gradient is not used).

// With `rms` (RMSNorm) the mean is taken as 0: var is the mean of x^2.
template <typename T, int W>
__device__ __forceinline__ float2 row_stats(const T* x, int cols, float eps, int lane, int rms) {
    float s = 0.0f;
    if (!rms) {
        for (int j0 = lane * W; j0 < cols; j0 += 32 * W) {
            float v[W];
            load<T, W>(x, j0, v);
#pragma unroll
            for (int k = 0; k < W; ++k) s += v[k];
        }
    }
    const float mean = rms ? 0.0f : warp_sum(s) / (float)cols;
    float q = 0.0f;
    for (int j0 = lane * W; j0 < cols; j0 += 32 * W) {
        float v[W];
        load<T, W>(x, j0, v);
#pragma unroll
        for (int k = 0; k < W; ++k) q += (v[k] - mean) * (v[k] - mean);
    }
    const float var = warp_sum(q) / (float)cols;
    return make_float2(mean, 1.0f / sqrtf(var + eps));
}

template <typename T, int W>
__device__ void layer_norm_fwd_impl(const T* __restrict__ x, const float* __restrict__ w,
                                    const float* __restrict__ b, T* __restrict__ y, size_t rows,
                                    int cols, float eps, int rms) {
    const int lane = threadIdx.x & 31;
    const size_t row = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const T* xr = x + row * cols;
    const float2 st = row_stats<T, W>(xr, cols, eps, lane, rms);
    for (int j0 = lane * W; j0 < cols; j0 += 32 * W) {
        float v[W];
        load<T, W>(xr, j0, v);
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] = (v[k] - st.x) * st.y * w[j0 + k] + b[j0 + k];
        store<T, W>(y + row * cols, j0, v);
    }
}

// stats[2r], stats[2r + 1] = mean, rstd of row r (for the weight gradient).
template <typename T, int W>
__device__ void layer_norm_stats_impl(const T* __restrict__ x, float* __restrict__ stats, size_t rows,
                                      int cols, float eps, int rms) {
    const int lane = threadIdx.x & 31;
    const size_t row = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float2 st = row_stats<T, W>(x + row * cols, cols, eps, lane, rms);
    if (lane == 0) {
        stats[2 * row] = st.x;
        stats[2 * row + 1] = st.y;
    }
}

// dx = rstd * (w dy - mean(w dy) - xhat * mean(w dy xhat)); RMSNorm has no
// mean(w dy) term. Where `stats` is not null, each row's (mean, rstd) goes
// there too, as layer_norm_stats writes them (the weight gradient's).
template <typename T, int W>
__device__ void layer_norm_dx_impl(const T* __restrict__ x, const float* __restrict__ w,
                                   const T* __restrict__ dy, const T* __restrict__ res,
                                   T* __restrict__ dx, float* __restrict__ stats, size_t rows,
                                   int cols, float eps, int rms) {
    const int lane = threadIdx.x & 31;
    const size_t row = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const size_t base = row * cols;
    const float2 st = row_stats<T, W>(x + base, cols, eps, lane, rms);
    if (stats && lane == 0) {
        stats[2 * row] = st.x;
        stats[2 * row + 1] = st.y;
    }
    float s1 = 0.0f, s2 = 0.0f;
    for (int j0 = lane * W; j0 < cols; j0 += 32 * W) {
        float v[W], g[W];
        load<T, W>(x + base, j0, v);
        load<T, W>(dy + base, j0, g);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float wg = w[j0 + k] * g[k];
            s1 += wg;
            s2 += wg * ((v[k] - st.x) * st.y);
        }
    }
    s1 = rms ? 0.0f : warp_sum(s1) / (float)cols;
    s2 = warp_sum(s2) / (float)cols;
    for (int j0 = lane * W; j0 < cols; j0 += 32 * W) {
        float v[W], g[W];
        load<T, W>(x + base, j0, v);
        load<T, W>(dy + base, j0, g);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float xhat = (v[k] - st.x) * st.y;
            v[k] = st.y * (w[j0 + k] * g[k] - s1 - xhat * s2);
        }
        if (res) {
            // the gradient, then a residual's gradient added to it in T as
            // candle's add would (two values of T summed in f32, rounded)
            float r[W];
            load<T, W>(res + base, j0, r);
#pragma unroll
            for (int k = 0; k < W; ++k) v[k] = rounded(dx, v[k]) + r[k];
        }
        store<T, W>(dx + base, j0, v);
    }
}

// Partial sums of dw = sum_rows dy * xhat and db = sum_rows dy over the
// rows of one chunk: block (32, 8), grid (ceil(cols / 32), chunks);
// part[(2 * chunk) * cols + c] (dw) and part[(2 * chunk + 1) * cols + c] (db).
template <typename T>
__device__ void layer_norm_dwdb_part_impl(const T* __restrict__ x, const T* __restrict__ dy,
                                          const float* __restrict__ stats, float* __restrict__ part,
                                          size_t rows, int cols, size_t rows_per_chunk) {
    __shared__ float sw[8][33], sb[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const size_t r0 = (size_t)blockIdx.y * rows_per_chunk;
    const size_t r1 = min(rows, r0 + rows_per_chunk);
    float aw = 0.0f, ab = 0.0f;
    if (c < cols) {
        for (size_t r = r0 + threadIdx.y; r < r1; r += 8) {
            const float g = ld(dy, r * cols + c);
            aw += g * ((ld(x, r * cols + c) - stats[2 * r]) * stats[2 * r + 1]);
            ab += g;
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        for (int k = 1; k < 8; ++k) {
            aw += sw[k][threadIdx.x];
            ab += sb[k][threadIdx.x];
        }
        part[(2 * (size_t)blockIdx.y) * cols + c] = aw;
        part[(2 * (size_t)blockIdx.y + 1) * cols + c] = ab;
    }
}

// layer_norm_dwdb_part_impl with 8 consecutive columns a thread (16-byte
// loads of BF16 x and dy, two each of F32): a warp reads 32 x 8 columns
// of a row at once, where 32 columns of 2-byte loads used a quarter of
// each access. The same sums in the same order (each column: rows r0 +
// ty, r0 + ty + 8, ... in its lane, then lanes 1..7 added to lane 0 in
// order), each term the same expression, so the same bits. Needs cols % 8
// == 0 and 16-byte-aligned x and dy.
template <typename T>
__device__ void layer_norm_dwdb_part_v_impl(const T* __restrict__ x, const T* __restrict__ dy,
                                            const float* __restrict__ stats, float* __restrict__ part,
                                            size_t rows, int cols, size_t rows_per_chunk) {
    __shared__ float sw[8][32][9], sb[8][32][9];
    const int c = (blockIdx.x * 32 + threadIdx.x) * 8;
    const size_t r0 = (size_t)blockIdx.y * rows_per_chunk;
    const size_t r1 = min(rows, r0 + rows_per_chunk);
    float aw[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float ab[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (c < cols) {
        for (size_t r = r0 + threadIdx.y; r < r1; r += 8) {
            float g[8], v[8];
            load<T, 8>(dy, r * cols + c, g);
            load<T, 8>(x, r * cols + c, v);
            const float mean = stats[2 * r], rstd = stats[2 * r + 1];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                aw[j] += g[j] * ((v[j] - mean) * rstd);
                ab[j] += g[j];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        sw[threadIdx.y][threadIdx.x][j] = aw[j];
        sb[threadIdx.y][threadIdx.x][j] = ab[j];
    }
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        for (int k = 1; k < 8; ++k) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                aw[j] += sw[k][threadIdx.x][j];
                ab[j] += sb[k][threadIdx.x][j];
            }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            part[(2 * (size_t)blockIdx.y) * cols + c + j] = aw[j];
            part[(2 * (size_t)blockIdx.y + 1) * cols + c + j] = ab[j];
        }
    }
}

// out[0..cols] = dw, out[cols..2 cols] = db: the chunks' partials in order
// (loaded eight chunks at a time, added one by one).
extern "C" __global__ void layer_norm_dwdb_sum(const float* __restrict__ part, float* __restrict__ out,
                                               int cols, int chunks) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        float aw = 0.0f, ab = 0.0f;
        int k = 0;
        for (; k + 8 <= chunks; k += 8) {
            float pw[8], pb[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                pw[i] = part[(2 * (size_t)(k + i)) * cols + c];
                pb[i] = part[(2 * (size_t)(k + i) + 1) * cols + c];
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                aw += pw[i];
                ab += pb[i];
            }
        }
        for (; k < chunks; ++k) {
            aw += part[(2 * (size_t)k) * cols + c];
            ab += part[(2 * (size_t)k + 1) * cols + c];
        }
        out[c] = aw;
        out[cols + c] = ab;
    }
}

// ---------------------------------------------------------------------------
// The same kernels with the row held in registers: rows of at most 32 * W * P
// columns on the 16-byte path (P packs of W elements a lane, loaded once, all
// P loads in flight together) instead of read two or three times. Every sum
// runs in the order of the kernels above (a lane's packs in column order,
// then warp_sum), so the outputs and statistics are theirs bit for bit.

// Pack p of a lane's row: columns lane * W + p * 32 * W .. + W.
template <int W>
__device__ __forceinline__ int pack_col(int lane, int p) { return lane * W + p * 32 * W; }

template <typename T, int W, int P>
__device__ __forceinline__ void load_row(const T* __restrict__ row, int cols, int lane, uint4 (&raw)[P]) {
    static_assert(W * sizeof(T) == 16, "a pack is 16 bytes");
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const int j0 = pack_col<W>(lane, p);
        if (j0 < cols) raw[p] = *reinterpret_cast<const uint4*>(row + j0);
    }
}

template <typename T, int W>
__device__ __forceinline__ void unpack(const uint4& raw, float* out) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < W; ++k) out[k] = ld(e, k);
}

// W f32 values at p (16-byte aligned), four at a time.
template <int W>
__device__ __forceinline__ void load_f32(const float* __restrict__ p, float* out) {
#pragma unroll
    for (int k = 0; k < W; k += 4) {
        const float4 v = *reinterpret_cast<const float4*>(p + k);
        out[k] = v.x;
        out[k + 1] = v.y;
        out[k + 2] = v.z;
        out[k + 3] = v.w;
    }
}

// row_stats over a row in registers.
template <typename T, int W, int P>
__device__ __forceinline__ float2 reg_stats(const uint4 (&raw)[P], int cols, float eps, int lane,
                                            int rms) {
    float s = 0.0f;
    if (!rms) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (pack_col<W>(lane, p) >= cols) continue;
            float v[W];
            unpack<T, W>(raw[p], v);
#pragma unroll
            for (int k = 0; k < W; ++k) s += v[k];
        }
    }
    const float mean = rms ? 0.0f : warp_sum(s) / (float)cols;
    float q = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        if (pack_col<W>(lane, p) >= cols) continue;
        float v[W];
        unpack<T, W>(raw[p], v);
#pragma unroll
        for (int k = 0; k < W; ++k) q += (v[k] - mean) * (v[k] - mean);
    }
    const float var = warp_sum(q) / (float)cols;
    return make_float2(mean, 1.0f / sqrtf(var + eps));
}

// Returns max |y| of the lane's stored (rounded) outputs as bits (0 off the
// rows), for the amax entry point.
template <typename T, int P>
__device__ uint32_t layer_norm_fwd_reg_impl(const T* __restrict__ x, const float* __restrict__ w,
                                            const float* __restrict__ b, T* __restrict__ y,
                                            size_t rows, int cols, float eps, int rms) {
    constexpr int W = Pack<T>::N;
    const int lane = threadIdx.x & 31;
    const size_t row = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    uint32_t m = 0;
    if (row >= rows) return m;
    uint4 raw[P];
    load_row<T, W, P>(x + row * cols, cols, lane, raw);
    const float2 st = reg_stats<T, W, P>(raw, cols, eps, lane, rms);
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const int j0 = pack_col<W>(lane, p);
        if (j0 >= cols) continue;
        float v[W], wv[W], bv[W];
        unpack<T, W>(raw[p], v);
        load_f32<W>(w + j0, wv);
        load_f32<W>(b + j0, bv);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            v[k] = (v[k] - st.x) * st.y * wv[k] + bv[k];
            m = max(m, abs_bits_f(rounded(y, v[k])));
        }
        store<T, W>(y + row * cols, j0, v);
    }
    return m;
}

// Pack p's x and dy values and the weights of its columns.
template <typename T, int W>
__device__ __forceinline__ void unpack_xgw(const uint4& xp, const uint4& gp, const float* __restrict__ w,
                                           float* v, float* g, float* wv) {
    unpack<T, W>(xp, v);
    unpack<T, W>(gp, g);
    load_f32<W>(w, wv);
}

template <typename T, int P>
__device__ void layer_norm_dx_reg_impl(const T* __restrict__ x, const float* __restrict__ w,
                                       const T* __restrict__ dy, const T* __restrict__ res,
                                       T* __restrict__ dx, float* __restrict__ stats, size_t rows,
                                       int cols, float eps, int rms) {
    constexpr int W = Pack<T>::N;
    const int lane = threadIdx.x & 31;
    const size_t row = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const size_t base = row * cols;
    uint4 xr[P], gr[P];
    load_row<T, W, P>(x + base, cols, lane, xr);
    load_row<T, W, P>(dy + base, cols, lane, gr);
    const float2 st = reg_stats<T, W, P>(xr, cols, eps, lane, rms);
    if (stats && lane == 0) {
        stats[2 * row] = st.x;
        stats[2 * row + 1] = st.y;
    }
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const int j0 = pack_col<W>(lane, p);
        if (j0 >= cols) continue;
        float v[W], g[W], wv[W];
        unpack_xgw<T, W>(xr[p], gr[p], w + j0, v, g, wv);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float wg = wv[k] * g[k];
            s1 += wg;
            s2 += wg * ((v[k] - st.x) * st.y);
        }
    }
    s1 = rms ? 0.0f : warp_sum(s1) / (float)cols;
    s2 = warp_sum(s2) / (float)cols;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const int j0 = pack_col<W>(lane, p);
        if (j0 >= cols) continue;
        float v[W], g[W], wv[W];
        unpack_xgw<T, W>(xr[p], gr[p], w + j0, v, g, wv);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float xhat = (v[k] - st.x) * st.y;
            v[k] = st.y * (wv[k] * g[k] - s1 - xhat * s2);
        }
        if (res) {
            float r[W];
            load<T, W>(res + base, j0, r);
#pragma unroll
            for (int k = 0; k < W; ++k) v[k] = rounded(dx, v[k]) + r[k];
        }
        store<T, W>(dx + base, j0, v);
    }
}

// ---------------------------------------------------------------------------
// Entry points: `vec` picks the 16-byte path; the `_r{P}` kernels need it
// (and 16-byte-aligned w and b) and rows of at most 32 * P packs.

#define NORM_KERNELS(TN, T)                                                                          \
    extern "C" __global__ void layer_norm_fwd_##TN(const T* x, const float* w, const float* b, T* y, \
                                                  size_t rows, int cols, float eps, int vec,         \
                                                  int rms) {                                         \
        if (vec) layer_norm_fwd_impl<T, Pack<T>::N>(x, w, b, y, rows, cols, eps, rms);               \
        else layer_norm_fwd_impl<T, 1>(x, w, b, y, rows, cols, eps, rms);                            \
    }                                                                                                \
    extern "C" __global__ void layer_norm_dx_##TN(const T* x, const float* w, const T* dy,          \
                                                 const T* res, T* dx, float* stats, size_t rows,     \
                                                 int cols, float eps, int vec, int rms) {            \
        if (vec) layer_norm_dx_impl<T, Pack<T>::N>(x, w, dy, res, dx, stats, rows, cols, eps, rms);  \
        else layer_norm_dx_impl<T, 1>(x, w, dy, res, dx, stats, rows, cols, eps, rms);               \
    }                                                                                                \
    extern "C" __global__ void layer_norm_stats_##TN(const T* x, float* stats, size_t rows, int cols,\
                                                    float eps, int vec, int rms) {                   \
        if (vec) layer_norm_stats_impl<T, Pack<T>::N>(x, stats, rows, cols, eps, rms);               \
        else layer_norm_stats_impl<T, 1>(x, stats, rows, cols, eps, rms);                            \
    }                                                                                                \
    extern "C" __global__ void layer_norm_dwdb_part_##TN(const T* x, const T* dy, const float* stats,\
                                                        float* part, size_t rows, int cols,          \
                                                        size_t rows_per_chunk) {                     \
        layer_norm_dwdb_part_impl<T>(x, dy, stats, part, rows, cols, rows_per_chunk);                \
    }                                                                                                \
    extern "C" __global__ void layer_norm_dwdb_part_v_##TN(const T* x, const T* dy,                  \
                                                          const float* stats, float* part,           \
                                                          size_t rows, int cols,                     \
                                                          size_t rows_per_chunk) {                   \
        layer_norm_dwdb_part_v_impl<T>(x, dy, stats, part, rows, cols, rows_per_chunk);              \
    }                                                                                                \
    NORM_REG_KERNELS(TN, T, 1)                                                                       \
    NORM_REG_KERNELS(TN, T, 2)                                                                       \
    NORM_REG_KERNELS(TN, T, 4)                                                                       \
    NORM_REG_KERNELS(TN, T, 8)

#define NORM_REG_KERNELS(TN, T, P)                                                                   \
    extern "C" __global__ void layer_norm_fwd_r##P##_##TN(const T* x, const float* w, const float* b,\
                                                         T* y, size_t rows, int cols, float eps,     \
                                                         int rms) {                                  \
        layer_norm_fwd_reg_impl<T, P>(x, w, b, y, rows, cols, eps, rms);                             \
    }                                                                                                \
    extern "C" __global__ void layer_norm_fwd_amax_r##P##_##TN(const T* x, const float* w,           \
                                                              const float* b, T* y, size_t rows,     \
                                                              int cols, float eps, int rms,          \
                                                              uint32_t* amax) {                      \
        block_amax_1d(layer_norm_fwd_reg_impl<T, P>(x, w, b, y, rows, cols, eps, rms), amax);        \
    }                                                                                                \
    extern "C" __global__ void layer_norm_dx_r##P##_##TN(const T* x, const float* w, const T* dy,   \
                                                        const T* res, T* dx, float* stats,           \
                                                        size_t rows, int cols, float eps, int rms) { \
        layer_norm_dx_reg_impl<T, P>(x, w, dy, res, dx, stats, rows, cols, eps, rms);                \
    }

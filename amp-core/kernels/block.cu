// Block-scaled casts: FP8 codes with one scale per tile (numerics/block.rs
// holds the definition these reproduce bit for bit).
//
//   per tile: amax = max |x| (bits, NaN above inf), scale =
//   compute_scale(rule, amax, 1, max, margin), code = encode(f32(x) * scale),
//   scale_inv = 1 / scale (IEEE division, as the CPU's f32 `1.0 / s`).
//
// - 1 x 128 tiles and rows: the pair kernel below (a 128 x 128 tile of x
//   per block, the casts of x and of xᵀ from one read; rows after a pass
//   for every row's and column's amax).
// - 128 x 128 blocks: one block of 256 threads per tile, 64 values a thread
//   in registers: warp w holds rows w + 8 i, lane l columns l + 32 j.
//
// Outside the tensor (a short last tile) a value counts as 0 for the amax
// and is not stored. A tile whose amax is inf or NaN is encoded with scale
// 1 and stores scale_inv NaN (the canonical bits): it decodes to NaN, and
// so does every GEMM output it enters (tile_scale_inv).
// The scales go where cuBLASLt reads them (numerics/block.rs, "The scales'
// layout"): a 1 x 128 tile (r, tc) at tc * rows + r, a row's at r; a
// 128 x 128 block (tr, tc) at tr * ld + tc, ld the tiles across padded to
// 4, the padding written 1 by the block of column 0.
#include "cast.cuh"

// The stored scale_inv of a tile: 1 / s, NaN where the amax is not finite.
__device__ __forceinline__ float tile_scale_inv(uint32_t amax, float s) {
    return amax >= 0x7F800000u ? __uint_as_float(CANONICAL_NAN) : 1.0f / s;
}

// 4 codes of v[0..4) times s[0..4), packed (v[0] in the low byte), as
// Fmt::encode makes them one by one: pairs through the hardware conversion,
// NaN codes fixed on the word.
template <int FMT>
__device__ __forceinline__ uint32_t encode4(const float* v, const float* s) {
    const uint32_t w = (uint32_t)Fmt<FMT>::encode2_raw(v[0] * s[0], v[1] * s[1]) |
                       ((uint32_t)Fmt<FMT>::encode2_raw(v[2] * s[2], v[3] * s[3]) << 16);
    return Fmt<FMT>::nan_fix(w);
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

template <typename T, int FMT>
__device__ void quantize_blocks_impl(const T* __restrict__ x, uint8_t* __restrict__ codes,
                                     float* __restrict__ scale_inv, int rows, int cols, int ld, int rule, unsigned margin, float fmt_max) {
    __shared__ uint32_t s_amax[8];
    const int tc = blockIdx.x, tr = blockIdx.y;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int r0 = tr * 128 + w, c0 = tc * 128 + lane;
    float v[16][4];
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int r = r0 + 8 * i;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = c0 + 32 * j;
            v[i][j] = (r < rows && c < cols) ? to_f32(x[(size_t)r * cols + c]) : 0.0f;
            amax = max(amax, abs_bits(v[i][j]));
        }
    }
    amax = warp_max(amax);
    if (lane == 0) s_amax[w] = amax;
    __syncthreads();
    amax = lane < 8 ? s_amax[lane] : 0u;
    amax = warp_max(amax);
    const float s = compute_scale(rule, __uint_as_float(amax), 1.0f, fmt_max, margin);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int r = r0 + 8 * i;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = c0 + 32 * j;
            if (r < rows && c < cols) codes[(size_t)r * cols + c] = Fmt<FMT>::encode(v[i][j] * s);
        }
    }
    if (threadIdx.x == 0) scale_inv[(size_t)tr * ld + tc] = tile_scale_inv(amax, s);
    if (tc == 0 && threadIdx.x > 0 && (int)(gridDim.x + threadIdx.x - 1) < ld)
        scale_inv[(size_t)tr * ld + gridDim.x + threadIdx.x - 1] = 1.0f;
}

#define BLOCK_QUANTIZE(TN, T, FN, FMT)                                                                 \
    extern "C" __global__ void __launch_bounds__(256) block_quantize_blocks_##TN##_##FN(               \
        const T* x, uint8_t* codes, float* si, int rows, int cols, int ld, int rule,                   \
        unsigned margin, float fmt_max) {                                                              \
        quantize_blocks_impl<T, FMT>(x, codes, si, rows, cols, ld, rule, margin, fmt_max);             \
    }
BLOCK_QUANTIZE(f32, float, e4m3, 0)
BLOCK_QUANTIZE(f32, float, e5m2, 1)
BLOCK_QUANTIZE(bf16, __nv_bfloat16, e4m3, 0)
BLOCK_QUANTIZE(bf16, __nv_bfloat16, e5m2, 1)
BLOCK_QUANTIZE(f16, __half, e4m3, 0)
BLOCK_QUANTIZE(f16, __half, e5m2, 1)

// 1 x 128 casts (or, given row_amax and col_amax, whole-row casts: torchao's
// rowwise, the amaxes from block_rowcol_amax) of x [rows, cols] and of its
// transpose from one read of x: one
// block of PAIR_THREADS threads per 128 x 128 tile of x (512: 32 values a
// thread in registers, so that two blocks fit an SM and loads stay in
// flight while the other block computes). Each thread loads 16-byte
// vectors (V elements: 8 BF16/FP16, 4 F32) of LPR lanes per tile row; the
// rows' amaxes reduce over those lanes, the columns' over the thread's rows,
// the warp's row groups and the 8 warps (shared memory). Either output may
// be absent (null codes):
// - rowwise: codes [rows, cols], scale of (r, tile tc) at tc * rows + r;
// - transposed: codes_t [cols, rows] (xᵀ, tiles of 128 along x's rows),
//   scale of (c, tile tr) at tr * cols + c; the codes are staged in shared
//   memory and written out a row of xᵀ per warp, 4 bytes a lane.
// `vec`: x's address and cols allow 16-byte loads (else element loads);
// `vec_t`: codes_t's address and rows allow 4-byte stores.
#define PAIR_THREADS 512

// The tile's column amaxes: each thread's partials `cm` (its V columns over
// its rows) folded over the warp's row groups and the W warps; after the
// call, thread t < 128 reads column t's amax from `tile_col_amax`'s result.
template <int V, int LPR, int W>
__device__ __forceinline__ uint32_t tile_col_amax(uint32_t* cm, uint32_t (*s_col)[128], int w, int sub, int cl) {
#pragma unroll
    for (int j = 0; j < V; j++)
#pragma unroll
        for (int o = LPR; o < 32; o <<= 1) cm[j] = max(cm[j], __shfl_xor_sync(0xFFFFFFFFu, cm[j], o));
    if (sub == 0) {
#pragma unroll
        for (int j = 0; j < V; j++) s_col[w][cl + j] = cm[j];
    }
    __syncthreads();
    uint32_t m = 0;
    if (threadIdx.x < 128) {
#pragma unroll
        for (int k = 0; k < W; k++) m = max(m, s_col[k][threadIdx.x]);
    }
    return m;
}


// V = 16 / sizeof(T) elements of row r from column c0 as f32: one 16-byte
// load where `vec` and the row holds them all, else element by element;
// 0 outside the tensor.
template <typename T>
__device__ __forceinline__ void load_vec(const T* __restrict__ x, int r, int rows, int cols, int c0, int vec,
                                         float* out) {
    constexpr int V = 16 / sizeof(T);
    const T* src = x + (size_t)r * cols + c0;
    if (vec && r < rows && c0 + V <= cols) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
        const T* xs = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < V; j++) out[j] = to_f32(xs[j]);
    } else {
#pragma unroll
        for (int j = 0; j < V; j++) out[j] = (r < rows && c0 + j < cols) ? to_f32(src[j]) : 0.0f;
    }
}


template <typename T, int FMT>
__device__ void quantize_pair_impl(const T* __restrict__ x, int rows, int cols, uint8_t* __restrict__ codes,
                                   float* __restrict__ scale_inv, uint8_t* __restrict__ codes_t,
                                   float* __restrict__ scale_inv_t, const uint32_t* __restrict__ row_amax,
                                   const uint32_t* __restrict__ col_amax, int rule, unsigned margin,
                                   float fmt_max, int vec, int vec_t) {
    constexpr int V = 16 / sizeof(T);
    constexpr int LPR = 128 / V;
    constexpr int RPW = 32 / LPR;
    constexpr int W = PAIR_THREADS / 32;
    constexpr int STEPS = 128 / (W * RPW);
    constexpr int ST = 132;  // staging row stride: 33 words, odd
    __shared__ uint32_t s_col[W][128];
    __shared__ float s_scale_t[128];
    __shared__ __align__(16) uint8_t s_t[128 * ST];
    const int tc = blockIdx.x, tr = blockIdx.y;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int sub = lane / LPR, cl = (lane % LPR) * V;
    const int c0 = tc * 128 + cl;
    float v[STEPS][V];
    uint32_t cm[V];
#pragma unroll
    for (int j = 0; j < V; j++) cm[j] = 0;
#pragma unroll
    for (int i = 0; i < STEPS; i++) {
        const int rl = (i * W + w) * RPW + sub;
        const int r = tr * 128 + rl;
        load_vec<T>(x, r, rows, cols, c0, vec, v[i]);
        uint32_t m = 0;
#pragma unroll
        for (int j = 0; j < V; j++) {
            const uint32_t a = abs_bits(v[i][j]);
            m = max(m, a);
            cm[j] = max(cm[j], a);
        }
        if (codes) {
            if (row_amax) {
                m = r < rows ? row_amax[r] : 0u;
            } else {
#pragma unroll
                for (int o = LPR / 2; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
            }
            const float s = compute_scale(rule, __uint_as_float(m), 1.0f, fmt_max, margin);
            if (r < rows) {
                uint8_t* dst = codes + (size_t)r * cols + c0;
                if (vec && c0 + V <= cols) {
                    // V codes in V / 4 words, one store (dst is V-byte aligned)
                    const float ss[4] = {s, s, s, s};
                    uint32_t words[V / 4];
#pragma unroll
                    for (int k = 0; k < V / 4; k++) words[k] = encode4<FMT>(&v[i][4 * k], ss);
                    if constexpr (V == 8) {
                        *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
                    } else {
                        *reinterpret_cast<uint32_t*>(dst) = words[0];
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < V; j++)
                        if (c0 + j < cols) dst[j] = Fmt<FMT>::encode(v[i][j] * s);
                }
                if (cl == 0 && !row_amax) scale_inv[(size_t)tc * rows + r] = tile_scale_inv(m, s);
                if (cl == 0 && row_amax && tc == 0) scale_inv[r] = tile_scale_inv(m, s);
            }
        }
    }
    if (!codes_t) return;
    const uint32_t folded = tile_col_amax<V, LPR, W>(cm, s_col, w, sub, cl);
    if (threadIdx.x < 128) {
        const int c = tc * 128 + threadIdx.x;
        const uint32_t m = col_amax ? (c < cols ? col_amax[c] : 0u) : folded;
        const float s = compute_scale(rule, __uint_as_float(m), 1.0f, fmt_max, margin);
        s_scale_t[threadIdx.x] = s;
        if (c < cols && !col_amax) scale_inv_t[(size_t)tr * cols + c] = tile_scale_inv(m, s);
        if (c < cols && col_amax && tr == 0) scale_inv_t[c] = tile_scale_inv(m, s);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < STEPS; i++) {
        const int rl = (i * W + w) * RPW + sub;
#pragma unroll
        for (int k = 0; k < V / 4; k++) {
            const uint32_t word = encode4<FMT>(&v[i][4 * k], &s_scale_t[cl + 4 * k]);
#pragma unroll
            for (int b = 0; b < 4; b++) s_t[(cl + 4 * k + b) * ST + rl] = (uint8_t)(word >> (8 * b));
        }
    }
    __syncthreads();
    // row cc of the tile's xᵀ block: codes_t[tc * 128 + cc][tr * 128 ..]
    const int r0 = tr * 128;
    for (int q = threadIdx.x; q < 128 * 32; q += PAIR_THREADS) {
        const int cc = q >> 5, word = q & 31;
        const int c = tc * 128 + cc, rr = r0 + word * 4;
        if (c >= cols || rr >= rows) continue;
        uint8_t* dst = codes_t + (size_t)c * rows + rr;
        const uint8_t* from = s_t + cc * ST + word * 4;
        if (vec_t && rr + 4 <= rows) {
            *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(from);
        } else {
            for (int k = 0; k < 4 && rr + k < rows; k++) dst[k] = from[k];
        }
    }
}

#define BLOCK_QUANTIZE_PAIR(TN, T, FN, FMT)                                                            \
    extern "C" __global__ void __launch_bounds__(PAIR_THREADS) block_quantize_pair_##TN##_##FN(        \
        const T* x, int rows, int cols, uint8_t* codes, float* si, uint8_t* codes_t, float* si_t,      \
        const uint32_t* row_amax, const uint32_t* col_amax, int rule, unsigned margin, float fmt_max,  \
        int vec, int vec_t) {                                                                          \
        quantize_pair_impl<T, FMT>(x, rows, cols, codes, si, codes_t, si_t, row_amax, col_amax, rule,  \
                                   margin, fmt_max, vec, vec_t);                                       \
    }
BLOCK_QUANTIZE_PAIR(f32, float, e4m3, 0)
BLOCK_QUANTIZE_PAIR(f32, float, e5m2, 1)
BLOCK_QUANTIZE_PAIR(bf16, __nv_bfloat16, e4m3, 0)
BLOCK_QUANTIZE_PAIR(bf16, __nv_bfloat16, e5m2, 1)
BLOCK_QUANTIZE_PAIR(f16, __half, e4m3, 0)
BLOCK_QUANTIZE_PAIR(f16, __half, e5m2, 1)

// The amaxes of every row and every column of x [rows, cols] (bits, NaN
// above inf), for the rowwise pair: one block per 128 x 128 tile folds its
// part into row_amax and col_amax (zeroed) with one atomic max a row and a
// column.
template <typename T>
__device__ void rowcol_amax_impl(const T* __restrict__ x, int rows, int cols, uint32_t* __restrict__ row_amax,
                                 uint32_t* __restrict__ col_amax, int vec) {
    constexpr int V = 16 / sizeof(T);
    constexpr int LPR = 128 / V;
    constexpr int RPW = 32 / LPR;
    constexpr int W = PAIR_THREADS / 32;
    constexpr int STEPS = 128 / (W * RPW);
    __shared__ uint32_t s_col[W][128];
    const int tc = blockIdx.x, tr = blockIdx.y;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int sub = lane / LPR, cl = (lane % LPR) * V;
    const int c0 = tc * 128 + cl;
    uint32_t cm[V];
#pragma unroll
    for (int j = 0; j < V; j++) cm[j] = 0;
#pragma unroll
    for (int i = 0; i < STEPS; i++) {
        const int r = tr * 128 + (i * W + w) * RPW + sub;
        float v[V];
        load_vec<T>(x, r, rows, cols, c0, vec, v);
        uint32_t m = 0;
#pragma unroll
        for (int j = 0; j < V; j++) {
            const uint32_t a = abs_bits(v[j]);
            m = max(m, a);
            cm[j] = max(cm[j], a);
        }
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if (cl == 0 && r < rows) atomicMax(&row_amax[r], m);
    }
    const uint32_t m = tile_col_amax<V, LPR, W>(cm, s_col, w, sub, cl);
    const int c = tc * 128 + threadIdx.x;
    if (threadIdx.x < 128 && c < cols) atomicMax(&col_amax[c], m);
}

#define ROWCOL_AMAX(TN, T)                                                                             \
    extern "C" __global__ void __launch_bounds__(PAIR_THREADS)                                         \
        block_rowcol_amax_##TN(const T* x, int rows, int cols, uint32_t* row_amax, uint32_t* col_amax, \
                               int vec) {                                                              \
        rowcol_amax_impl<T>(x, rows, cols, row_amax, col_amax, vec);                                   \
    }
ROWCOL_AMAX(f32, float)
ROWCOL_AMAX(bf16, __nv_bfloat16)
ROWCOL_AMAX(f16, __half)

// decode(code) * scale_inv[tile], grid-stride over the elements; tile (down,
// across) keeps its scale at down * s_down + across * s_across.
template <int FMT, typename O>
__device__ void dequantize_tiles_impl(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv,
                                      O* __restrict__ out, size_t rows, size_t cols, size_t th,
                                      size_t tw, size_t s_down, size_t s_across) {
    const size_t n = rows * cols;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t r = i / cols, c = i % cols;
        store(out + i, Fmt<FMT>::decode(q[i]) * scale_inv[(r / th) * s_down + (c / tw) * s_across]);
    }
}

#define BLOCK_DEQUANTIZE(FN, FMT, ON, O)                                                               \
    extern "C" __global__ void block_dequantize_##FN##_##ON(const uint8_t* q, const float* si, O* out,  \
                                                            size_t rows, size_t cols, size_t th,      \
                                                            size_t tw, size_t sd, size_t sa) {        \
        dequantize_tiles_impl<FMT, O>(q, si, out, rows, cols, th, tw, sd, sa);                         \
    }
BLOCK_DEQUANTIZE(e4m3, 0, f32, float)
BLOCK_DEQUANTIZE(e4m3, 0, f16, __half)
BLOCK_DEQUANTIZE(e4m3, 0, bf16, __nv_bfloat16)
BLOCK_DEQUANTIZE(e5m2, 1, f32, float)
BLOCK_DEQUANTIZE(e5m2, 1, f16, __half)
BLOCK_DEQUANTIZE(e5m2, 1, bf16, __nv_bfloat16)

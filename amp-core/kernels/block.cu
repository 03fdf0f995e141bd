// Block-scaled casts: FP8 codes with one scale per tile (numerics/block.rs
// holds the definition these reproduce bit for bit).
//
//   per tile: amax = max |x| (bits, NaN above inf), scale =
//   compute_scale(rule, amax, 1, max, margin), code = encode(f32(x) * scale),
//   scale_inv = 1 / scale (IEEE division, as the CPU's f32 `1.0 / s`).
//
// - 1 x 128 tiles and rows: the pair kernel below (a 128 x 128 tile of x
//   per block, the casts of x and of xᵀ from one read; rows after a pass
//   for every row's and column's amax), or its rows-only form.
// - 128 x 128 blocks: one block of 256 threads per tile, 16-byte loads,
//   the tile held in registers as loaded (BF16: 8 vectors a thread).
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

// A 16-bit element's bits as f32 (to_f32), by its type.
__device__ __forceinline__ float bits16_f32(uint16_t h, const __half*) { return to_f32(__ushort_as_half(h)); }
__device__ __forceinline__ float bits16_f32(uint16_t h, const __nv_bfloat16*) {
    return to_f32(__ushort_as_bfloat16(h));
}

// The stored scale_inv of a tile: 1 / s, NaN where the amax is not finite.
__device__ __forceinline__ float tile_scale_inv(uint32_t amax, float s) {
    return amax >= 0x7F800000u ? __uint_as_float(CANONICAL_NAN) : 1.0f / s;
}

// 4 codes of v[0..4) times s, packed (v[0] in the low byte), as
// Fmt::encode makes them one by one: pairs through the hardware conversion,
// NaN codes fixed on the word unless the caller knows there are none (a
// tile with a finite amax: its products are finite and saturate).
template <int FMT>
__device__ __forceinline__ uint32_t encode4_raw(const float* v, float s) {
    return (uint32_t)Fmt<FMT>::encode2_raw(v[0] * s, v[1] * s) |
           ((uint32_t)Fmt<FMT>::encode2_raw(v[2] * s, v[3] * s) << 16);
}
template <int FMT>
__device__ __forceinline__ uint32_t encode4(const float* v, float s, bool finite) {
    const uint32_t w = encode4_raw<FMT>(v, s);
    return finite ? w : Fmt<FMT>::nan_fix(w);
}

// encode4 where the whole warp calls it together (the FAST kernels): the
// NaN fix only runs when some lane of the warp needs it.
template <int FMT>
__device__ __forceinline__ uint32_t encode4_warp(const float* v, float s, bool finite) {
    const uint32_t w = encode4_raw<FMT>(v, s);
    if (__any_sync(0xFFFFFFFFu, !finite)) return finite ? w : Fmt<FMT>::nan_fix(w);
    return w;
}

// The scale of a tile with amax bits `amax` (prev 1): compute_scale, with
// the power-of-two rule inline and branch-light (the same value).
__device__ __forceinline__ float pow2_tile_scale(uint32_t amax, float fmt_max, unsigned margin) {
    if (amax == 0u || amax >= 0x7F800000u || !(fmt_max > 0.0f && isfinite(fmt_max))) return 1.0f;
    return pow2_ratio_scale(fmt_max, __uint_as_float(amax), margin);
}
__device__ __forceinline__ float tile_scale(int rule, uint32_t amax, float fmt_max, unsigned margin) {
    if (rule != 1) return compute_scale(rule, __uint_as_float(amax), 1.0f, fmt_max, margin);
    return pow2_tile_scale(amax, fmt_max, margin);
}

// Packed amaxes: a load_raw word's absolute values (sign bits cleared; the
// bits order |x| with NaN above inf, per 16-bit half for BF16 and F16),
// their elementwise max, and one value's bits as f32 (to_f32's).
template <typename T>
__device__ __forceinline__ uint32_t abs_word(uint32_t w) {
    return sizeof(T) == 4 ? w & 0x7FFFFFFFu : w & 0x7FFF7FFFu;
}
template <typename T>
__device__ __forceinline__ uint32_t max_word(uint32_t a, uint32_t b) {
    if constexpr (sizeof(T) == 4) {
        return max(a, b);
    } else {
        return __vmaxu2(a, b);
    }
}
template <typename T>
__device__ __forceinline__ uint32_t f32_bits(uint32_t w, int half) {
    if constexpr (sizeof(T) == 4) {
        return w;
    } else {
        return __float_as_uint(bits16_f32((uint16_t)(w >> (16 * half)), (const T*)nullptr));
    }
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

// V = 16 / sizeof(T) elements of row r from column c0 as they are stored
// (16 bytes): one 16-byte load where `vec` and the row holds them all, else
// element by element; 0 outside the tensor. Kept packed until used, so a
// thread holds twice the loads in flight for its registers.
template <typename T>
__device__ __forceinline__ uint4 load_raw(const T* __restrict__ x, int r, int rows, int cols, int c0, int vec) {
    constexpr int V = 16 / sizeof(T);
    const T* src = x + (size_t)r * cols + c0;
    if (vec && r < rows && c0 + V <= cols) return __ldg(reinterpret_cast<const uint4*>(src));
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (r < rows) {
#pragma unroll
        for (int j = 0; j < V; j++) {
            if (c0 + j >= cols) break;
            uint32_t bits;
            if constexpr (sizeof(T) == 4) {
                bits = __float_as_uint(to_f32(src[j]));
            } else {
                bits = (uint32_t)(*reinterpret_cast<const uint16_t*>(&src[j]));
            }
            w[j * sizeof(T) / 4] |= bits << (8 * ((j * sizeof(T)) % 4));
        }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Element j of a load_raw vector as f32 (to_f32's bits).
template <typename T>
__device__ __forceinline__ float raw_f32(const uint4& raw, int j) {
    const uint32_t w = j * sizeof(T) / 4 == 0 ? raw.x : j * sizeof(T) / 4 == 1 ? raw.y : j * sizeof(T) / 4 == 2 ? raw.z : raw.w;
    if constexpr (sizeof(T) == 4) {
        return __uint_as_float(w);
    } else {
        return bits16_f32((uint16_t)(w >> (16 * (j & 1))), (const T*)nullptr);
    }
}

// A load_raw vector's V values as f32.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float* v) {
#pragma unroll
    for (int j = 0; j < 16 / (int)sizeof(T); j++) v[j] = raw_f32<T>(raw, j);
}

// V codes of v[0..V) * s at dst (columns c0.. of a row with `cols`): one
// store of V / 4 words where `vec` and the row holds them all (dst is then
// V-byte aligned), else byte by byte within the row.
// WARP: the whole warp stores full vectors together (encode4_warp).
template <int FMT, int V, bool WARP = false>
__device__ __forceinline__ void store_codes(uint8_t* dst, const float* v, float s, bool finite, int c0, int cols,
                                            int vec) {
    if (WARP || (vec && c0 + V <= cols)) {
        uint32_t words[V / 4];
#pragma unroll
        for (int k = 0; k < V / 4; k++)
            words[k] = WARP ? encode4_warp<FMT>(&v[4 * k], s, finite) : encode4<FMT>(&v[4 * k], s, finite);
        if constexpr (V == 8) {
            *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
        } else {
            *reinterpret_cast<uint32_t*>(dst) = words[0];
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; j++)
            if (c0 + j < cols) dst[j] = Fmt<FMT>::encode(v[j] * s);
    }
}

// A scaled FP16 source (an O1/O2 weight's codes and their scale_inv):
// element j's value decode(code) * si, rounded to BF16 where ROUND (what
// Weight::native decodes).
template <bool ROUND>
__device__ __forceinline__ float scaled_f16(const uint4& raw, int j, float si) {
    const uint32_t w = j / 2 == 0 ? raw.x : j / 2 == 1 ? raw.y : j / 2 == 2 ? raw.z : raw.w;
    const float v = Fmt<K_F16>::decode((uint16_t)(w >> (16 * (j & 1)))) * si;
    if constexpr (ROUND) {
        if (isnan(v)) return v;
        return __bfloat162float(__float2bfloat16_rn(v));
    }
    return v;
}

// Element j of a load_raw vector as f32 by source: SRC 0 the stored T
// (raw_f32), 1 a scaled FP16 source's F32 value, 2 its BF16 value.
template <typename T, int SRC>
__device__ __forceinline__ float src_f32(const uint4& raw, int j, float si) {
    if constexpr (SRC == 0) {
        return raw_f32<T>(raw, j);
    } else {
        return scaled_f16<SRC == 2>(raw, j, si);
    }
}

// A packed amax word's value `half` as f32 bits by source: for a scaled
// FP16 source the value of the largest |code| (decode, the scale and the
// rounding keep the order, NaN codes above inf's).
template <typename T, int SRC>
__device__ __forceinline__ uint32_t src_bits(uint32_t w, int half, float si) {
    if constexpr (SRC == 0) {
        return f32_bits<T>(w, half);
    } else {
        return __float_as_uint(fabsf(scaled_f16<SRC == 2>(make_uint4(w, 0u, 0u, 0u), half, si)));
    }
}

// 128 x 128 blocks: one block of BLK_THREADS threads per tile; each thread
// holds STEPS 16-byte vectors (BF16: 8 rows of 8 values), loaded before any
// is used; the tile's amax over the warps in shared memory.
#define BLK_THREADS 256
template <typename T, int FMT>
__device__ void quantize_blocks_impl(const T* __restrict__ x, uint8_t* __restrict__ codes,
                                     float* __restrict__ scale_inv, int rows, int cols, int ld, int rule,
                                     unsigned margin, float fmt_max, int vec) {
    constexpr int V = 16 / sizeof(T);
    constexpr int LPR = 128 / V;
    constexpr int RPW = 32 / LPR;
    constexpr int W = BLK_THREADS / 32;
    constexpr int STEPS = 128 / (W * RPW);
    __shared__ uint32_t s_amax[W];
    const int tc = blockIdx.x, tr = blockIdx.y;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int sub = lane / LPR, cl = (lane % LPR) * V;
    const int c0 = tc * 128 + cl;
    uint4 raw[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; i++) raw[i] = load_raw<T>(x, tr * 128 + (i * W + w) * RPW + sub, rows, cols, c0, vec);
    uint32_t pm = 0;  // packed
#pragma unroll
    for (int i = 0; i < STEPS; i++) {
        pm = max_word<T>(pm, max_word<T>(max_word<T>(abs_word<T>(raw[i].x), abs_word<T>(raw[i].y)),
                                         max_word<T>(abs_word<T>(raw[i].z), abs_word<T>(raw[i].w))));
    }
    uint32_t amax = sizeof(T) == 4 ? pm : f32_bits<T>(max(pm & 0xFFFFu, pm >> 16), 0);
    amax = warp_max(amax);
    if (lane == 0) s_amax[w] = amax;
    __syncthreads();
    amax = lane < W ? s_amax[lane] : 0u;
    amax = warp_max(amax);
    const float s = tile_scale(rule, amax, fmt_max, margin);
    const bool finite = amax < 0x7F800000u;
#pragma unroll
    for (int i = 0; i < STEPS; i++) {
        const int r = tr * 128 + (i * W + w) * RPW + sub;
        if (r >= rows) continue;
        float v[V];
        unpack<T>(raw[i], v);
        store_codes<FMT, V>(codes + (size_t)r * cols + c0, v, s, finite, c0, cols, vec);
    }
    if (threadIdx.x == 0) scale_inv[(size_t)tr * ld + tc] = tile_scale_inv(amax, s);
    if (tc == 0 && threadIdx.x > 0 && (int)(gridDim.x + threadIdx.x - 1) < ld)
        scale_inv[(size_t)tr * ld + gridDim.x + threadIdx.x - 1] = 1.0f;
}

#define BLOCK_QUANTIZE(TN, T, FN, FMT)                                                                 \
    extern "C" __global__ void __launch_bounds__(BLK_THREADS) block_quantize_blocks_##TN##_##FN(       \
        const T* x, uint8_t* codes, float* si, int rows, int cols, int ld, int rule,                   \
        unsigned margin, float fmt_max, int vec) {                                                     \
        quantize_blocks_impl<T, FMT>(x, codes, si, rows, cols, ld, rule, margin, fmt_max, vec);        \
    }
BLOCK_QUANTIZE(f32, float, e4m3, 0)
BLOCK_QUANTIZE(f32, float, e5m2, 1)
BLOCK_QUANTIZE(bf16, __nv_bfloat16, e4m3, 0)
BLOCK_QUANTIZE(bf16, __nv_bfloat16, e5m2, 1)
BLOCK_QUANTIZE(f16, __half, e4m3, 0)
BLOCK_QUANTIZE(f16, __half, e5m2, 1)

// 1 x 128 casts (or, given row_amax and col_amax, whole-row casts: torchao's
// rowwise, the amaxes from block_rowcol_amax) of x [rows, cols] and of its
// transpose from one read of x: one block of PAIR_THREADS threads per
// 128 x 128 tile of x. Each thread loads STEPS consecutive rows (BF16: 4,
// F32: 8) of V = 16 / sizeof(T) columns, 16 bytes a load, LPR lanes a tile
// row, all loads before any is used; the rows' amaxes reduce over those
// lanes, the columns' over the thread's rows, the warp's row groups and
// the W warps (shared memory). Either output may be absent (null codes):
// - rowwise: codes [rows, cols], scale of (r, tile tc) at tc * rows + r;
// - transposed (block_quantize_pair_*, TRANS): codes_t [cols, rows] (xᵀ,
//   tiles of 128 along x's rows), scale of (c, tile tr) at tr * cols + c.
//   A thread packs each of its columns' STEPS consecutive rows into
//   STEPS / 4 words of a shared 128 x 32-word tile of xᵀ (word p of row cc
//   stored at p ^ swz(cc), swz(cc) = (cc / V) * RPW: the warp's 32 stores
//   fall in 32 banks), then 8 lanes write a row of xᵀ, 16 bytes each.
// Without TRANS (block_quantize_rows_*) no shared memory and fewer
// registers: more blocks an SM.
// `vec`: x's address and cols allow 16-byte loads (else element loads);
// `vec_t`: rows allow 16-byte stores of codes_t (rows % 16 == 0).
#define PAIR_THREADS 512

template <typename T>
struct PairShape {
    static constexpr int V = 16 / sizeof(T);
    static constexpr int LPR = 128 / V;
    static constexpr int RPW = 32 / LPR;
    static constexpr int W = PAIR_THREADS / 32;
    static constexpr int STEPS = 128 / (W * RPW);
    static_assert(STEPS % 4 == 0, "a thread packs 4 rows a word");
};

// The tile's column amaxes: each thread's packed partials `cm` (its V
// columns over its rows, max_word) folded over the warp's row groups, then
// as f32 bits over the W warps; after the call, thread t < 128 holds
// column t's amax.
template <typename T, int SRC = 0>
__device__ __forceinline__ uint32_t tile_col_amax(uint32_t* cm, uint32_t (*s_col)[128], int w, int sub, int cl,
                                                  float si = 1.0f) {
    using S = PairShape<T>;
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int o = S::LPR; o < 32; o <<= 1) cm[k] = max_word<T>(cm[k], __shfl_xor_sync(0xFFFFFFFFu, cm[k], o));
    if (sub == 0) {
#pragma unroll
        for (int j = 0; j < S::V; j++) s_col[w][cl + j] = src_bits<T, SRC>(cm[j * sizeof(T) / 4], j & 1, si);
    }
    __syncthreads();
    uint32_t m = 0;
    if (threadIdx.x < 128) {
#pragma unroll
        for (int k = 0; k < S::W; k++) m = max(m, s_col[k][threadIdx.x]);
    }
    return m;
}

// Shared memory of the transposed half.
template <typename T>
struct PairSmem {
    uint32_t col[PairShape<T>::W][128];
    float scale_t[128];
    uint32_t t[128 * 32];  // xᵀ's codes, 32 words a row, swizzled
};

// The tile's xᵀ codes staged in `t` (128 rows of 32 words, word p of row
// cc at p ^ swz(cc), swz(cc) = (cc / V) * RPW) out to codes_t [cols, rows]:
// row cc to codes_t[tc * 128 + cc][tr * 128 ..], 8 lanes a row, 16 bytes
// (4 rows of x in each of 4 words) a lane; FAST: whole tiles, 16-byte
// stores, else bounds and byte stores where `vec_t` or the row end fails.
template <typename T, bool FAST>
__device__ __forceinline__ void store_tile_t(const uint32_t* t, uint8_t* __restrict__ codes_t, int rows, int cols,
                                             int vec_t) {
    using S = PairShape<T>;
    const int tc = blockIdx.x, tr = blockIdx.y;
#pragma unroll
    for (int it = 0; it < 128 * 8 / PAIR_THREADS; it++) {
        const int idx = threadIdx.x + it * PAIR_THREADS;
        const int cc = idx >> 3, pg = idx & 7;  // physical group of 4 words
        const int sw = (cc / S::V) * S::RPW;
        const int lg = pg ^ (sw >> 2);  // the logical group it holds
        const uint4 u = *reinterpret_cast<const uint4*>(&t[cc * 32 + pg * 4]);
        const uint32_t ph[4] = {u.x, u.y, u.z, u.w};
        uint32_t wd[4];
#pragma unroll
        for (int k = 0; k < 4; k++) wd[k] = ph[k ^ (sw & 3)];
        const int c = tc * 128 + cc, rr = tr * 128 + lg * 16;
        if (!FAST && (c >= cols || rr >= rows)) continue;
        uint8_t* dst = codes_t + (size_t)c * rows + rr;
        if (FAST || (vec_t && rr + 16 <= rows)) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(wd[0], wd[1], wd[2], wd[3]);
        } else {
            for (int k = 0; k < 16 && rr + k < rows; k++) dst[k] = (uint8_t)(wd[k >> 2] >> (8 * (k & 3)));
        }
    }
}

template <typename T, int FMT, bool TRANS, bool FAST, bool ROWS = false, int SRC = 0>
__device__ __forceinline__ void quantize_pair_impl(const T* __restrict__ x, int rows, int cols,
                                                   uint8_t* __restrict__ codes, float* __restrict__ scale_inv,
                                                   uint8_t* __restrict__ codes_t, float* __restrict__ scale_inv_t,
                                                   const uint32_t* __restrict__ row_amax,
                                                   const uint32_t* __restrict__ col_amax, int rule,
                                                   unsigned margin, float fmt_max, int vec, int vec_t,
                                                   PairSmem<T>* sm, float si = 1.0f) {
    using S = PairShape<T>;
    constexpr int V = S::V, LPR = S::LPR, RPW = S::RPW, STEPS = S::STEPS;
    const int tc = blockIdx.x, tr = blockIdx.y;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int sub = lane / LPR, q = lane % LPR, cl = q * V;
    const int c0 = tc * 128 + cl;
    const int g = w * RPW + sub;  // the thread's rows: g * STEPS .. + STEPS of the tile
    const int rl0 = g * STEPS;
    // whole-row scales from the amaxes given (rowwise): a compile-time fact
    // of the FAST kernels, the pointers' presence otherwise
    const bool rows_given = FAST ? ROWS : row_amax != nullptr;
    const bool cols_given = FAST ? ROWS : col_amax != nullptr;
    uint4 raw[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; i++) {
        if constexpr (FAST) {
            raw[i] = __ldg(reinterpret_cast<const uint4*>(x + (size_t)(tr * 128 + rl0 + i) * cols + c0));
        } else {
            raw[i] = load_raw<T>(x, tr * 128 + rl0 + i, rows, cols, c0, vec);
        }
    }
    uint32_t cm[4] = {0u, 0u, 0u, 0u};  // packed column partials, word k of the vectors
#pragma unroll
    for (int i = 0; i < STEPS; i++) {
        const int r = tr * 128 + rl0 + i;
        const uint32_t a[4] = {abs_word<T>(raw[i].x), abs_word<T>(raw[i].y), abs_word<T>(raw[i].z),
                               abs_word<T>(raw[i].w)};
        if constexpr (TRANS && !(FAST && ROWS)) {
#pragma unroll
            for (int k = 0; k < 4; k++) cm[k] = max_word<T>(cm[k], a[k]);
        }
        if (codes) {
            uint32_t m;
            if (rows_given) {
                m = (FAST || r < rows) ? row_amax[r] : 0u;
            } else {
                uint32_t p = max_word<T>(max_word<T>(a[0], a[1]), max_word<T>(a[2], a[3]));
                if constexpr (sizeof(T) == 2) p = max(p & 0xFFFFu, p >> 16);
#pragma unroll
                for (int o = LPR / 2; o > 0; o >>= 1) p = max(p, __shfl_xor_sync(0xFFFFFFFFu, p, o));
                m = src_bits<T, SRC>(p, 0, si);
            }
            const float s = FAST ? pow2_tile_scale(m, fmt_max, margin) : tile_scale(rule, m, fmt_max, margin);
            if (FAST || r < rows) {
                float v[V];
#pragma unroll
                for (int j = 0; j < V; j++) v[j] = src_f32<T, SRC>(raw[i], j, si);
                store_codes<FMT, V, FAST>(codes + (size_t)r * cols + c0, v, s, m < 0x7F800000u, c0, cols, vec);
                if (cl == 0 && !rows_given) scale_inv[(size_t)tc * rows + r] = tile_scale_inv(m, s);
                if (cl == 0 && rows_given && tc == 0) scale_inv[r] = tile_scale_inv(m, s);
            }
        }
    }
    if constexpr (TRANS) {
        if (!codes_t) return;
        uint32_t folded = 0;
        if constexpr (!(FAST && ROWS)) folded = tile_col_amax<T, SRC>(cm, sm->col, w, sub, cl, si);
        if (threadIdx.x < 128) {
            const int c = tc * 128 + threadIdx.x;
            const uint32_t m = cols_given ? ((FAST || c < cols) ? col_amax[c] : 0u) : folded;
            const float s = FAST ? pow2_tile_scale(m, fmt_max, margin) : tile_scale(rule, m, fmt_max, margin);
            sm->scale_t[threadIdx.x] = s;
            sm->col[0][threadIdx.x] = m;  // this thread's column only: read by all after the barrier
            if ((FAST || c < cols) && !cols_given) scale_inv_t[(size_t)tr * cols + c] = tile_scale_inv(m, s);
            if ((FAST || c < cols) && cols_given && tr == 0) scale_inv_t[c] = tile_scale_inv(m, s);
        }
        __syncthreads();
        const int swz = q * RPW;
#pragma unroll
        for (int j = 0; j < V; j++) {
            const float s = sm->scale_t[cl + j];
            const bool finite = sm->col[0][cl + j] < 0x7F800000u;
#pragma unroll
            for (int k = 0; k < STEPS / 4; k++) {
                const float col[4] = {src_f32<T, SRC>(raw[4 * k], j, si), src_f32<T, SRC>(raw[4 * k + 1], j, si),
                                      src_f32<T, SRC>(raw[4 * k + 2], j, si),
                                      src_f32<T, SRC>(raw[4 * k + 3], j, si)};
                sm->t[(cl + j) * 32 + ((g * (STEPS / 4) + k) ^ swz)] =
                    FAST ? encode4_warp<FMT>(col, s, finite) : encode4<FMT>(col, s, finite);
            }
        }
        __syncthreads();
        store_tile_t<T, FAST>(sm->t, codes_t, rows, cols, vec_t);
    }
}

// FAST (the `_fast` kernels): rows and cols multiples of 128, `vec` and
// `vec_t`, the power-of-two rule: no bounds and no fallbacks in the code
// (the training path's shapes); 1 x 128 tiles, or with ROWS (the
// `_fast_rows` kernels) whole rows from row_amax and col_amax.
#define PAIR_KERNELS(TN, T, FN, FMT, MINB, MINB_ROWS, SFX, FAST, ROWS)                                \
    extern "C" __global__ void __launch_bounds__(PAIR_THREADS, MINB) block_quantize_pair##SFX##_##TN##_##FN( \
        const T* x, int rows, int cols, uint8_t* codes, float* si, uint8_t* codes_t, float* si_t,      \
        const uint32_t* row_amax, const uint32_t* col_amax, int rule, unsigned margin, float fmt_max,  \
        int vec, int vec_t) {                                                                          \
        __shared__ __align__(16) PairSmem<T> sm;                                                       \
        quantize_pair_impl<T, FMT, true, FAST, ROWS>(x, rows, cols, codes, si, codes_t, si_t, row_amax, \
                                                     col_amax, rule, margin, fmt_max, vec, vec_t, &sm); \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(PAIR_THREADS, MINB_ROWS) block_quantize_rows##SFX##_##TN##_##FN( \
        const T* x, int rows, int cols, uint8_t* codes, float* si, uint8_t* codes_t, float* si_t,      \
        const uint32_t* row_amax, const uint32_t* col_amax, int rule, unsigned margin, float fmt_max,  \
        int vec, int vec_t) {                                                                          \
        quantize_pair_impl<T, FMT, false, FAST, ROWS>(x, rows, cols, codes, si, nullptr, nullptr,      \
                                                      row_amax, nullptr, rule, margin, fmt_max, vec,   \
                                                      vec_t, nullptr);                                 \
    }
#define BLOCK_QUANTIZE_PAIR(TN, T, FN, FMT, MINB, MINB_ROWS)                                           \
    PAIR_KERNELS(TN, T, FN, FMT, MINB, MINB_ROWS, , false, false)                                      \
    PAIR_KERNELS(TN, T, FN, FMT, MINB + 1, MINB_ROWS, _fast, true, false)                              \
    PAIR_KERNELS(TN, T, FN, FMT, MINB + 1, MINB_ROWS, _fast_rows, true, true)
BLOCK_QUANTIZE_PAIR(f32, float, e4m3, 0, 1, 2)
BLOCK_QUANTIZE_PAIR(f32, float, e5m2, 1, 1, 2)
BLOCK_QUANTIZE_PAIR(bf16, __nv_bfloat16, e4m3, 0, 2, 3)
BLOCK_QUANTIZE_PAIR(bf16, __nv_bfloat16, e5m2, 1, 2, 3)
BLOCK_QUANTIZE_PAIR(f16, __half, e4m3, 0, 2, 3)
BLOCK_QUANTIZE_PAIR(f16, __half, e5m2, 1, 2, 3)

// 128 x 128 blocks of a weight from its scaled FP16 copy (O1's and O2's
// master): value = decode(code) * scale_inv, rounded to BF16 where ROUND
// (Weight::native's value, the block casts' source), as
// block_quantize_blocks casts it, and the blocks of its transpose
// (BlockTensor::t: the codes transposed, each block keeping its scale),
// from one read. Whole tiles and 16-byte access only (rows and cols
// multiples of 128, aligned): the pair kernel's shape, one amax a tile.
// Scales: w's at tr * ld + tc (ld: the tiles across padded to 4), wᵀ's at
// tc * ld_t + tr (ld_t: the tiles down padded to 4), the padding 1.
// Either output may be absent (null codes).
template <int FMT, bool ROUND>
__device__ __forceinline__ void quantize_scaled_blocks_impl(const uint16_t* __restrict__ q,
                                                            const float* __restrict__ si_p, int rows, int cols,
                                                            uint8_t* __restrict__ codes, float* __restrict__ scale_inv,
                                                            int ld, uint8_t* __restrict__ codes_t,
                                                            float* __restrict__ scale_inv_t, int ld_t, int rule,
                                                            unsigned margin, float fmt_max, PairSmem<__half>* sm) {
    using S = PairShape<__half>;
    constexpr int V = S::V, LPR = S::LPR, RPW = S::RPW, W = S::W, STEPS = S::STEPS;
    const int tc = blockIdx.x, tr = blockIdx.y;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int sub = lane / LPR, ql = lane % LPR, cl = ql * V;
    const int c0 = tc * 128 + cl;
    const int g = w * RPW + sub;
    const int rl0 = g * STEPS;
    const float si = *si_p;
    uint4 raw[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; i++)
        raw[i] = __ldg(reinterpret_cast<const uint4*>(q + (size_t)(tr * 128 + rl0 + i) * cols + c0));
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < STEPS; i++)
#pragma unroll
        for (int j = 0; j < V; j++) amax = max(amax, abs_bits(scaled_f16<ROUND>(raw[i], j, si)));
    amax = warp_max(amax);
    if (lane == 0) sm->col[0][w] = amax;
    __syncthreads();
    amax = lane < W ? sm->col[0][lane] : 0u;
    amax = warp_max(amax);
    const float s = tile_scale(rule, amax, fmt_max, margin);
    const bool finite = amax < 0x7F800000u;
    if (codes) {
#pragma unroll
        for (int i = 0; i < STEPS; i++) {
            float v[V];
#pragma unroll
            for (int j = 0; j < V; j++) v[j] = scaled_f16<ROUND>(raw[i], j, si);
            store_codes<FMT, V, true>(codes + (size_t)(tr * 128 + rl0 + i) * cols + c0, v, s, finite, c0, cols, 1);
        }
        if (threadIdx.x == 0) scale_inv[(size_t)tr * ld + tc] = tile_scale_inv(amax, s);
        if (tc == 0 && threadIdx.x > 0 && (int)(gridDim.x + threadIdx.x - 1) < ld)
            scale_inv[(size_t)tr * ld + gridDim.x + threadIdx.x - 1] = 1.0f;
    }
    if (!codes_t) return;
    if (threadIdx.x == 0) scale_inv_t[(size_t)tc * ld_t + tr] = tile_scale_inv(amax, s);
    if (tr == 0 && threadIdx.x > 0 && (int)(gridDim.y + threadIdx.x - 1) < ld_t)
        scale_inv_t[(size_t)tc * ld_t + gridDim.y + threadIdx.x - 1] = 1.0f;
    const int swz = ql * RPW;
#pragma unroll
    for (int j = 0; j < V; j++) {
#pragma unroll
        for (int k = 0; k < STEPS / 4; k++) {
            const float col[4] = {scaled_f16<ROUND>(raw[4 * k], j, si), scaled_f16<ROUND>(raw[4 * k + 1], j, si),
                                  scaled_f16<ROUND>(raw[4 * k + 2], j, si), scaled_f16<ROUND>(raw[4 * k + 3], j, si)};
            sm->t[(cl + j) * 32 + ((g * (STEPS / 4) + k) ^ swz)] = encode4_warp<FMT>(col, s, finite);
        }
    }
    __syncthreads();
    store_tile_t<__half, true>(sm->t, codes_t, rows, cols, 1);
}

#define SCALED_BLOCKS(FN, FMT, RN, ROUND)                                                              \
    extern "C" __global__ void __launch_bounds__(PAIR_THREADS, 2) block_quantize_scaled_blocks_##FN##_##RN( \
        const uint16_t* q, const float* si, int rows, int cols, uint8_t* codes, float* scale_inv, int ld, \
        uint8_t* codes_t, float* scale_inv_t, int ld_t, int rule, unsigned margin, float fmt_max) {    \
        __shared__ __align__(16) PairSmem<__half> sm;                                                  \
        quantize_scaled_blocks_impl<FMT, ROUND>(q, si, rows, cols, codes, scale_inv, ld, codes_t,      \
                                                scale_inv_t, ld_t, rule, margin, fmt_max, &sm);        \
    }
SCALED_BLOCKS(e4m3, 0, bf16, true)
SCALED_BLOCKS(e4m3, 0, f32, false)
SCALED_BLOCKS(e5m2, 1, bf16, true)
SCALED_BLOCKS(e5m2, 1, f32, false)

// The amaxes of every row and every column of x [rows, cols] (bits, NaN
// above inf), for the rowwise pair: one block per 128 x 128 tile (the pair
// kernel's shape) folds its part into row_amax and col_amax (zeroed) with
// one atomic max a row and a column.
template <typename T, int SRC = 0>
__device__ void rowcol_amax_impl(const T* __restrict__ x, int rows, int cols, uint32_t* __restrict__ row_amax,
                                 uint32_t* __restrict__ col_amax, int vec, float si = 1.0f) {
    using S = PairShape<T>;
    constexpr int V = S::V, LPR = S::LPR, RPW = S::RPW, W = S::W, STEPS = S::STEPS;
    __shared__ uint32_t s_col[W][128];
    const int tc = blockIdx.x, tr = blockIdx.y;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int sub = lane / LPR, cl = (lane % LPR) * V;
    const int c0 = tc * 128 + cl;
    const int rl0 = (w * RPW + sub) * STEPS;
    uint4 raw[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; i++) raw[i] = load_raw<T>(x, tr * 128 + rl0 + i, rows, cols, c0, vec);
    uint32_t cm[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < STEPS; i++) {
        const int r = tr * 128 + rl0 + i;
        const uint32_t a[4] = {abs_word<T>(raw[i].x), abs_word<T>(raw[i].y), abs_word<T>(raw[i].z),
                               abs_word<T>(raw[i].w)};
#pragma unroll
        for (int k = 0; k < 4; k++) cm[k] = max_word<T>(cm[k], a[k]);
        uint32_t p = max_word<T>(max_word<T>(a[0], a[1]), max_word<T>(a[2], a[3]));
        if constexpr (sizeof(T) == 2) p = max(p & 0xFFFFu, p >> 16);
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1) p = max(p, __shfl_xor_sync(0xFFFFFFFFu, p, o));
        if (cl == 0 && r < rows) atomicMax(&row_amax[r], src_bits<T, SRC>(p, 0, si));
    }
    const uint32_t m = tile_col_amax<T, SRC>(cm, s_col, w, sub, cl, si);
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

// The rowwise pair of a scaled FP16 weight (O1's and O2's master) from its
// codes: the amaxes of its value's rows and columns (RN: bf16, the value
// rounded to BF16 as Weight::native makes it; f32, not rounded), then the
// _fast_rows pair of that value: the same codes and scales as decoding
// first, a decode pass fewer. Whole tiles, 16-byte access only.
#define SCALED_ROWS(RN, SRC)                                                                           \
    extern "C" __global__ void __launch_bounds__(PAIR_THREADS) block_rowcol_amax_scaled_##RN(          \
        const __half* q, const float* si, int rows, int cols, uint32_t* row_amax, uint32_t* col_amax) { \
        rowcol_amax_impl<__half, SRC>(q, rows, cols, row_amax, col_amax, 1, *si);                      \
    }
#define SCALED_ROWS_PAIR(RN, SRC, FN, FMT)                                                             \
    extern "C" __global__ void __launch_bounds__(PAIR_THREADS, 3) block_quantize_pair_scaled_##RN##_##FN( \
        const __half* q, const float* si, int rows, int cols, uint8_t* codes, float* sc, uint8_t* codes_t, \
        float* sc_t, const uint32_t* row_amax, const uint32_t* col_amax, float fmt_max) {              \
        __shared__ __align__(16) PairSmem<__half> sm;                                                  \
        quantize_pair_impl<__half, FMT, true, true, true, SRC>(q, rows, cols, codes, sc, codes_t, sc_t, \
                                                               row_amax, col_amax, 1, 0u, fmt_max, 1, 1, \
                                                               &sm, *si);                              \
    }
SCALED_ROWS(f32, 1)
SCALED_ROWS(bf16, 2)
SCALED_ROWS_PAIR(f32, 1, e4m3, 0)
SCALED_ROWS_PAIR(f32, 1, e5m2, 1)
SCALED_ROWS_PAIR(bf16, 2, e4m3, 0)
SCALED_ROWS_PAIR(bf16, 2, e5m2, 1)

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

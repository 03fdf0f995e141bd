// candle-amp CUDA kernels: the cast-transpose (Transformer Engine's
// cast_transpose). One pass over x [rows, cols] writes its FP8 codes both
// row-major and transposed ([cols, rows]: the K-major operand that
// Hopper's FP8 GEMM takes for wgrad and dgrad), with amax and counts as
// quantize in amp.cu. Every code comes from the same quantize step as
// amp.cu's, so both outputs are bit-identical to the CPU cast (and its
// transpose); amax and counts are order-independent folds.
#include "cast.cuh"

// Tile edge: a block of 256 threads casts a 64 x 64 tile.
#define TT 64
// Shared tile row stride in bytes: a multiple of 4 (word stores), not of 8,
// so that the transposed reads of the four row quarters spread over banks.
#define TS (TT + 4)

// Eight elements of x as f32 (16- or 32-byte aligned).
__device__ __forceinline__ void load8(const float* p, float* f) {
    const uint4 a = __ldcs(reinterpret_cast<const uint4*>(p));
    const uint4 b = __ldcs(reinterpret_cast<const uint4*>(p) + 1);
    f[0] = __uint_as_float(a.x); f[1] = __uint_as_float(a.y);
    f[2] = __uint_as_float(a.z); f[3] = __uint_as_float(a.w);
    f[4] = __uint_as_float(b.x); f[5] = __uint_as_float(b.y);
    f[6] = __uint_as_float(b.z); f[7] = __uint_as_float(b.w);
}
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* f) {
    uint4 a = __ldcs(reinterpret_cast<const uint4*>(p));
    const T* v = reinterpret_cast<const T*>(&a);
#pragma unroll
    for (int j = 0; j < 8; j++) f[j] = to_f32(v[j]);
}

// An element as f32. SCALED: x holds an FP16 tensor's codes, and the value
// is the dequantized one, decode(code) * pre (amp.cu's dequantize, NaN
// codes to the canonical NaN), one IEEE f32 product: bit for bit what a
// dequantize to F32 then a cast reads.
template <bool SCALED, typename T>
__device__ __forceinline__ float in_f32(T v, float pre) {
    if constexpr (SCALED) return Fmt<2>::decode(__half_as_ushort(v)) * pre;
    else return to_f32(v);
}

template <bool SCALED, typename T>
__device__ __forceinline__ void load8_in(const T* p, float* f, float pre) {
    if constexpr (SCALED) {
        uint4 a = __ldcs(reinterpret_cast<const uint4*>(p));
        const T* v = reinterpret_cast<const T*>(&a);
#pragma unroll
        for (int j = 0; j < 8; j++) f[j] = in_f32<true>(v[j], pre);
    } else {
        load8(p, f);
    }
}

// x [rows, cols] -> out [rows, cols], out_t [cols, rows], amax (u32 bits)
// and counts[2], both zeroed by the caller. Grid (ceil(cols / TT),
// ceil(rows / TT)). `vec`: cols % 8 == 0, rows % 16 == 0 and every pointer
// 16-byte aligned, so full tiles go through 16- and 8-byte accesses;
// partial tiles (and vec == 0) element by element. SCALED: see in_f32
// (`pre_p` is the FP16 tensor's scale_inv; null otherwise). The block casts
// tile (bx, by): the block's own index in quantize_t, its tile of one
// tensor in quantize_t_many.
template <typename T, int FMT, bool SCALED>
__device__ void quantize_t_impl(int bx, int by, const T* __restrict__ x, const float* __restrict__ pre_p,
                                const float* __restrict__ scale_p,
                                uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, int rows,
                                int cols, int vec, uint32_t* amax_out, unsigned long long* counts,
                                CUR_PARAMS) {
    __shared__ __align__(16) uint8_t tile[TT * TS];
    const float scale = cast_scale_at(bx == 0 && by == 0, scale_p, CUR_ARGS);
    const float pre = SCALED ? *pre_p : 1.0f;
    uint32_t amax = 0, sat = 0, flush = 0;
    const int r0 = by * TT, c0 = bx * TT, t = threadIdx.x;
    const bool full = vec && r0 + TT <= rows && c0 + TT <= cols;
    if (full) {
        // 8 column groups of 8 elements x 32 rows, twice
        const int cg = (t & 7) * 8;
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const int r = (t >> 3) + 32 * p;
            const size_t at = (size_t)(r0 + r) * cols + c0 + cg;
            float f[8];
            load8_in<SCALED>(x + at, f, pre);
            const uint32_t lo = quantize4<FMT>(f, scale, amax, sat, flush);
            const uint32_t hi = quantize4<FMT>(f + 4, scale, amax, sat, flush);
            __stcs(reinterpret_cast<uint2*>(out + at), make_uint2(lo, hi));
            *reinterpret_cast<uint32_t*>(tile + r * TS + cg) = lo;
            *reinterpret_cast<uint32_t*>(tile + r * TS + cg + 4) = hi;
        }
    } else {
        for (int i = t; i < TT * TT; i += blockDim.x) {
            const int r = i / TT, c = i % TT;
            if (r0 + r < rows && c0 + c < cols) {
                const size_t at = (size_t)(r0 + r) * cols + c0 + c;
                const uint8_t code = quantize_one<FMT>(in_f32<SCALED>(x[at], pre), scale, amax, sat, flush);
                out[at] = code;
                tile[r * TS + c] = code;
            }
        }
    }
    __syncthreads();
    if (full) {
        // out_t row c0 + c: 16 codes of rows r0 + q .. r0 + q + 16 per thread
        const int c = t >> 2, q = (t & 3) * 16;
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            uint32_t v = 0;
#pragma unroll
            for (int b = 0; b < 4; b++) v |= (uint32_t)tile[(q + 4 * j + b) * TS + c] << (8 * b);
            w[j] = v;
        }
        __stcs(reinterpret_cast<uint4*>(out_t + (size_t)(c0 + c) * rows + r0 + q),
               make_uint4(w[0], w[1], w[2], w[3]));
    } else {
        for (int i = t; i < TT * TT; i += blockDim.x) {
            const int c = i / TT, r = i % TT;
            if (r0 + r < rows && c0 + c < cols) out_t[(size_t)(c0 + c) * rows + r0 + r] = tile[r * TS + c];
        }
    }
    block_flush(amax, sat, flush, amax_out, counts);
}

#define QUANTIZE_T(TN, T, FN, FMT, SCALED)                                                             \
    extern "C" __global__ void __launch_bounds__(256) quantize_t_##TN##_##FN(                          \
        const T* x, const float* pre, const float* scale, uint8_t* out, uint8_t* out_t, int rows,      \
        int cols, int vec, uint32_t* amax, unsigned long long* counts, CUR_PARAMS) {                   \
        quantize_t_impl<T, FMT, SCALED>(blockIdx.x, blockIdx.y, x, pre, scale, out, out_t, rows, cols, \
                                        vec, amax, counts, CUR_ARGS);                                  \
    }
QUANTIZE_T(f32, float, e4m3, 0, false)
QUANTIZE_T(f32, float, e5m2, 1, false)
QUANTIZE_T(bf16, __nv_bfloat16, e4m3, 0, false)
QUANTIZE_T(bf16, __nv_bfloat16, e5m2, 1, false)
QUANTIZE_T(f16, __half, e4m3, 0, false)
QUANTIZE_T(f16, __half, e5m2, 1, false)
// an FP16 scaling tensor's codes, dequantized as read
QUANTIZE_T(f16s, __half, e4m3, 0, true)
QUANTIZE_T(f16s, __half, e5m2, 1, true)

// ---------------------------------------------------------------------------
// Many FP16 scaling tensors (a model's Linear weights) cast to FP8 with
// current scaling and transposed, in two launches for all of them instead
// of two per tensor (`requantize_t_many` of src/numerics/cuda/cast_t_many.rs):
// pass 1 folds each tensor's decoded amax, pass 2 casts each tensor's tiles
// with the scale from its amax. Each block finds its tensor (a binary
// search over the tensors' first blocks) and does what a block of that
// tensor's own launches does: the amax is a max of the same values, and
// every code, count and scale is quantize_t_f16s's, so the bits are those
// of the per-tensor casts (decoded_amax_f16 + quantize_t_f16s_*).

// One tensor (`ManyT` of cast_t_many.rs).
struct ManyT {
    const __half* x;              // the FP16 codes [rows, cols]
    const float* pre;             // their scale_inv
    uint32_t* amax;               // its amax bits (zeroed; pass 1 folds, pass 2 reads as f32)
    uint8_t* out;                 // codes [rows, cols]
    uint8_t* out_t;               // codes [cols, rows]
    unsigned long long* counts;   // saturated and flushed (zeroed), or null: not counted
    float* scale;                 // written by its first tile's block
    float* scale_inv;
    int rows, cols, vec, tiles_x; // vec: as quantize_t's; tiles_x = ceil(cols / TT)
    uint64_t block0;              // its first block of pass 2
    uint64_t ablock0;             // its first block of pass 1
    int avec;                     // x 16-byte aligned (pass 1's vector loads)
    int _pad;
};

// The last tensor whose first block (of pass 2, or with `amax` of pass 1)
// is at most b: the one block b belongs to.
__device__ __forceinline__ int many_t_find(const ManyT* d, int count, uint64_t b, bool amax) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if ((amax ? d[mid].ablock0 : d[mid].block0) <= b) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Pass 1: max |decode(code) * scale_inv| of each tensor (decoded_amax_f16's
// values), grid-stride over the tensor's own blocks, 8 codes a load.
extern "C" __global__ void __launch_bounds__(256) decoded_amax_many_f16(const ManyT* d, int count,
                                                                         uint64_t blocks) {
    const int i = many_t_find(d, count, blockIdx.x, true);
    const ManyT& t = d[i];
    const uint64_t end = i + 1 < count ? d[i + 1].ablock0 : blocks;
    const float pre = *t.pre;
    const size_t n = (size_t)t.rows * t.cols;
    const size_t tid = (blockIdx.x - t.ablock0) * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (end - t.ablock0) * (size_t)blockDim.x;
    uint32_t amax = 0;
    size_t done = 0;
    if (t.avec) {
        const size_t units = n / 8;
        for (size_t u = tid; u < units; u += stride) {
            float f[8];
            load8_in<true>(t.x + u * 8, f, pre);
#pragma unroll
            for (int j = 0; j < 8; j++) amax = max(amax, abs_bits(f[j]));
        }
        done = units * 8;
    }
    for (size_t k = done + tid; k < n; k += stride) amax = max(amax, abs_bits(in_f32<true>(t.x[k], pre)));
    block_flush(amax, 0, 0, t.amax, nullptr);
}

// Pass 2: each block one 64 x 64 tile of one tensor, the scale from its
// amax (rule, margin and max as quantize_t's current-scaling parameters).
#define QUANTIZE_T_MANY(FN, FMT)                                                                       \
    extern "C" __global__ void __launch_bounds__(256) quantize_t_many_f16s_##FN(                       \
        const ManyT* d, int count, int rule, unsigned margin, float max) {                             \
        const ManyT& t = d[many_t_find(d, count, blockIdx.x, false)];                                  \
        const uint64_t tile = blockIdx.x - t.block0;                                                   \
        quantize_t_impl<__half, FMT, true>((int)(tile % t.tiles_x), (int)(tile / t.tiles_x), t.x, t.pre, \
                                           nullptr,                                                    \
                                           t.out, t.out_t, t.rows, t.cols, t.vec, nullptr, t.counts,    \
                                           reinterpret_cast<const float*>(t.amax), rule, margin, max,  \
                                           t.scale, t.scale_inv);                                      \
    }
QUANTIZE_T_MANY(e4m3, 0)
QUANTIZE_T_MANY(e5m2, 1)

// ---------------------------------------------------------------------------
// 2-D transpose of 1- or 2-byte elements (FP8 codes, FP16 values): the GEMM
// operands of dgrad and wgrad. 32 x 32 tiles through shared memory, block
// (32, 8), grid (ceil(cols / 32), ceil(rows / 32)); src [rows, cols] to dst
// [cols, rows].

template <typename T>
__device__ void transpose_impl(const T* __restrict__ src, T* __restrict__ dst, int rows, int cols) {
    __shared__ T tile[32][33];
    const int bx = blockIdx.x * 32, by = blockIdx.y * 32;
    for (int j = threadIdx.y; j < 32; j += 8) {
        const int r = by + j, c = bx + threadIdx.x;
        if (r < rows && c < cols) tile[j][threadIdx.x] = src[(size_t)r * cols + c];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += 8) {
        const int r = bx + j, c = by + threadIdx.x;
        if (r < cols && c < rows) dst[(size_t)r * rows + c] = tile[threadIdx.x][j];
    }
}

extern "C" __global__ void transpose_u8(const uint8_t* src, uint8_t* dst, int rows, int cols) {
    transpose_impl(src, dst, rows, cols);
}

extern "C" __global__ void transpose_u16(const uint16_t* src, uint16_t* dst, int rows, int cols) {
    transpose_impl(src, dst, rows, cols);
}

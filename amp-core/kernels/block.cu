// Block-scaled casts: FP8 codes with one scale per tile (numerics/block.rs
// holds the definition these reproduce bit for bit).
//
//   per tile: amax = max |x| (bits, NaN above inf), scale =
//   compute_scale(rule, amax, 1, max, margin), code = encode(f32(x) * scale),
//   scale_inv = 1 / scale (IEEE division, as the CPU's f32 `1.0 / s`).
//
// - 1 x tw tiles (1 x 128, or one tile per row): one warp per tile. For 1 x
//   128 each lane keeps its four values in registers (elements lane + 32 j:
//   every load and store of the warp is coalesced), so the input is read
//   once; rows longer than 128 (rowwise) are read twice, the second time
//   mostly from L2.
// - 128 x 128 blocks: one block of 256 threads per tile, 64 values a thread
//   in registers: warp w holds rows w + 8 i, lane l columns l + 32 j.
//
// Outside the tensor (a short last tile) a value counts as 0 for the amax
// and is not stored. A tile whose amax is inf or NaN folds it into
// `nonfinite` (an atomic max of the bits, only then: zero stays zero).
// The scales go where cuBLASLt reads them (numerics/block.rs, "The scales' layout"): a 1 x tw tile (r, tc) at
// tc * rows + r; a 128 x 128 block (tr, tc) at tr * ld + tc, ld the tiles
// across padded to 4, the padding written 1 by the block of column 0.
#include "cast.cuh"

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

template <typename T, int FMT>
__device__ void quantize_rows_impl(const T* __restrict__ x, uint8_t* __restrict__ codes,
                                   float* __restrict__ scale_inv, uint32_t* __restrict__ nonfinite,
                                   int rows, int cols, int tw, int rule, unsigned margin, float max) {
    const int tiles_per_row = (cols + tw - 1) / tw;
    const long long tile = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (tile >= (long long)rows * tiles_per_row) return;  // the whole warp
    const int r = (int)(tile / tiles_per_row), tc = (int)(tile % tiles_per_row);
    const int c0 = tc * tw, len = min(tw, cols - c0);
    const T* src = x + (size_t)r * cols + c0;
    uint8_t* dst = codes + (size_t)r * cols + c0;
    uint32_t amax = 0;
    if (tw == 128) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = lane + 32 * j;
            v[j] = c < len ? to_f32(src[c]) : 0.0f;
            amax = max(amax, abs_bits(v[j]));
        }
        amax = warp_max(amax);
        if (lane == 0 && amax >= 0x7F800000u) atomicMax(nonfinite, amax);
        const float s = compute_scale(rule, __uint_as_float(amax), 1.0f, max, margin);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = lane + 32 * j;
            if (c < len) dst[c] = Fmt<FMT>::encode(v[j] * s);
        }
        if (lane == 0) scale_inv[(size_t)tc * rows + r] = 1.0f / s;
        return;
    }
    for (int c = lane; c < len; c += 32) amax = max(amax, abs_bits(to_f32(src[c])));
    amax = warp_max(amax);
    if (lane == 0 && amax >= 0x7F800000u) atomicMax(nonfinite, amax);
    const float s = compute_scale(rule, __uint_as_float(amax), 1.0f, max, margin);
    for (int c = lane; c < len; c += 32) dst[c] = Fmt<FMT>::encode(to_f32(src[c]) * s);
    if (lane == 0) scale_inv[(size_t)tc * rows + r] = 1.0f / s;
}

template <typename T, int FMT>
__device__ void quantize_blocks_impl(const T* __restrict__ x, uint8_t* __restrict__ codes,
                                     float* __restrict__ scale_inv, uint32_t* __restrict__ nonfinite,
                                     int rows, int cols, int ld, int rule, unsigned margin, float max) {
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
    if (threadIdx.x == 0 && amax >= 0x7F800000u) atomicMax(nonfinite, amax);
    const float s = compute_scale(rule, __uint_as_float(amax), 1.0f, max, margin);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int r = r0 + 8 * i;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = c0 + 32 * j;
            if (r < rows && c < cols) codes[(size_t)r * cols + c] = Fmt<FMT>::encode(v[i][j] * s);
        }
    }
    if (threadIdx.x == 0) scale_inv[(size_t)tr * ld + tc] = 1.0f / s;
    if (tc == 0 && threadIdx.x > 0 && (int)(gridDim.x + threadIdx.x - 1) < ld)
        scale_inv[(size_t)tr * ld + gridDim.x + threadIdx.x - 1] = 1.0f;
}

#define BLOCK_QUANTIZE(TN, T, FN, FMT)                                                                 \
    extern "C" __global__ void block_quantize_rows_##TN##_##FN(                                       \
        const T* x, uint8_t* codes, float* si, uint32_t* nf, int rows, int cols, int tw, int rule,     \
        unsigned margin, float max) {                                                                  \
        quantize_rows_impl<T, FMT>(x, codes, si, nf, rows, cols, tw, rule, margin, max);               \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) block_quantize_blocks_##TN##_##FN(               \
        const T* x, uint8_t* codes, float* si, uint32_t* nf, int rows, int cols, int ld, int rule,     \
        unsigned margin, float max) {                                                                  \
        quantize_blocks_impl<T, FMT>(x, codes, si, nf, rows, cols, ld, rule, margin, max);             \
    }
BLOCK_QUANTIZE(f32, float, e4m3, 0)
BLOCK_QUANTIZE(f32, float, e5m2, 1)
BLOCK_QUANTIZE(bf16, __nv_bfloat16, e4m3, 0)
BLOCK_QUANTIZE(bf16, __nv_bfloat16, e5m2, 1)
BLOCK_QUANTIZE(f16, __half, e4m3, 0)
BLOCK_QUANTIZE(f16, __half, e5m2, 1)

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

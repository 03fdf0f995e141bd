// Shared by amp.cu and cast_t.cu: the per-element quantize step with amax
// and counts, the input and output conversions with the CPU's NaN bits,
// the block reduction, the cast's scale. The formats' encode and decode
// and the scale rules are in codec.cuh (shared with the optimizer's
// kernels). The rules they reproduce are listed at the top of amp.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "codec.cuh"

// ----------------------------------------------------- input conversions --
// The CPU's `half` conversions: bf16 is a shift; an f16 NaN keeps its sign and
// payload and is quieted (what both half's software path and F16C do).
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) {
    return __uint_as_float(((uint32_t)__bfloat16_as_ushort(v)) << 16);
}
__device__ __forceinline__ float to_f32(__half v) {
    uint32_t h = __half_as_ushort(v);
    if ((h & 0x7FFF) > 0x7C00)
        return __uint_as_float(((h & 0x8000u) << 16) | 0x7FC00000u | ((h & 0x3FFu) << 13));
    return __half2float(v);
}

// Output conversions with the CPU's NaN bits (the only NaN here is the
// canonical f32 one, or a NaN product of it).
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(double* p, float v) {
    // x86 cvtss2sd of 0x7FFFFFFF
    if (isnan(v)) *p = __longlong_as_double(0x7FFFFFFFE0000000ll);
    else *p = (double)v;
}
__device__ __forceinline__ void store(__half* p, float v) {
    if (isnan(v)) *p = __ushort_as_half((uint16_t)(((__float_as_uint(v) >> 16) & 0x8000u) | F16_NAN));
    else *p = __float2half_rn(v);
}
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) {
    // half's bf16::from_f32 for NaN: (bits >> 16) | 0x40
    if (isnan(v)) *p = __ushort_as_bfloat16((uint16_t)((__float_as_uint(v) >> 16) | 0x40u));
    else *p = __float2bfloat16_rn(v);
}

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

// ------------------------------------------------------------ reductions --
// Folds a thread's amax bits and counts into the block, then one atomic each.
__device__ __forceinline__ void block_flush(uint32_t amax, unsigned long long sat,
                                            unsigned long long flush, uint32_t* amax_out,
                                            unsigned long long* counts) {
    __shared__ uint32_t s_amax[32];
    __shared__ unsigned long long s_sat[32], s_flush[32];
    for (int o = 16; o > 0; o >>= 1) {
        amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        sat += __shfl_xor_sync(0xFFFFFFFFu, sat, o);
        flush += __shfl_xor_sync(0xFFFFFFFFu, flush, o);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { s_amax[warp] = amax; s_sat[warp] = sat; s_flush[warp] = flush; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        amax = lane < nw ? s_amax[lane] : 0u;
        sat = lane < nw ? s_sat[lane] : 0ull;
        flush = lane < nw ? s_flush[lane] : 0ull;
        for (int o = 16; o > 0; o >>= 1) {
            amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
            sat += __shfl_xor_sync(0xFFFFFFFFu, sat, o);
            flush += __shfl_xor_sync(0xFFFFFFFFu, flush, o);
        }
        if (lane == 0) {
            if (amax_out) atomicMax(amax_out, amax);
            if (counts) {
                if (sat) atomicAdd(&counts[0], sat);
                if (flush) atomicAdd(&counts[1], flush);
            }
        }
    }
}

// Elements per thread per step of the vector path: 16-byte loads and stores.
#define VEC 16

template <typename T> struct Vec16;  // VEC inputs as 16-byte words
template <> struct Vec16<float> { uint4 w[4]; };
template <> struct Vec16<__half> { uint4 w[2]; };
template <> struct Vec16<__nv_bfloat16> { uint4 w[2]; };

// --------------------------------------------------------------- quantize --
// One element: encode, and fold amax and counts (32-bit per-thread counts:
// a thread sees far fewer than 2^32 elements; block_flush widens them).
template <int FMT>
__device__ __forceinline__ typename Fmt<FMT>::code_t quantize_one(float x, float scale, uint32_t& amax,
                                                                  uint32_t& sat, uint32_t& flush) {
    amax = max(amax, abs_bits(x));
    const float v = x * scale;
    const typename Fmt<FMT>::code_t c = Fmt<FMT>::encode(v);
    sat += fabsf(v) > Fmt<FMT>::MAX;
    // A NaN input encodes to NaN, never to zero: no NaN test needed.
    flush += (x != 0.0f) & Fmt<FMT>::is_zero(c);
    return c;
}

// Four FP8 codes of x[0..4) * scale packed in a word, amax and counts folded,
// without a branch: pairs through the hardware conversion, NaN codes fixed
// on the packed word, zero codes found on it.
template <int FMT>
__device__ __forceinline__ uint32_t quantize4(const float* x, float scale, uint32_t& amax, uint32_t& sat,
                                              uint32_t& flush) {
    float v[4];
    uint32_t nonzero = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint32_t a = abs_bits(x[j]);
        amax = max(amax, a);
        nonzero |= (uint32_t)(a != 0) << (8 * j + 7);
        v[j] = x[j] * scale;
        sat += fabsf(v[j]) > Fmt<FMT>::MAX;
    }
    uint32_t w = (uint32_t)Fmt<FMT>::encode2_raw(v[0], v[1]) | ((uint32_t)Fmt<FMT>::encode2_raw(v[2], v[3]) << 16);
    w = Fmt<FMT>::nan_fix(w);
    // bit 7 of a byte set where its magnitude is 0
    const uint32_t zero = (((w & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) & 0x80808080u) ^ 0x80808080u;
    flush += __popc(zero & nonzero);
    return w;
}

// ------------------------------------------------------------------ scale --
// The scale a cast applies: `*scale_p` (delayed scaling: the meta's), or
// with `amax_in` (current scaling) compute_scale(rule & 1, *amax_in, 1,
// max, margin), the scale_update of a one-slot history with no previous
// scale, which the first thread of the grid also writes out with its
// inverse; with bit 1 of `rule` set, the inverse times (amax * 0 + 1), as
// flag_scale_inv would make it (NaN where the amax is not finite).
// `first`: this block is the first of the tensor's grid (cast_scale: block
// (0, 0) of the launch; a batched launch names the tensor's first tile).
__device__ __forceinline__ float cast_scale_at(bool first, const float* scale_p, const float* amax_in,
                                               int rule, unsigned margin, float max, float* scale_out,
                                               float* scale_inv_out) {
    if (!amax_in) return *scale_p;
    const float amax = *amax_in;
    const float s = compute_scale(rule & 1, amax, 1.0f, max, margin);
    if (first && threadIdx.x == 0) {
        *scale_out = s;
        const float inv = 1.0f / s;
        *scale_inv_out = (rule & 2) ? __fmul_rn(inv, __fadd_rn(__fmul_rn(amax, 0.0f), 1.0f)) : inv;
    }
    return s;
}

__device__ __forceinline__ float cast_scale(const float* scale_p, const float* amax_in, int rule,
                                            unsigned margin, float max, float* scale_out,
                                            float* scale_inv_out) {
    return cast_scale_at(blockIdx.x == 0 && blockIdx.y == 0, scale_p, amax_in, rule, margin, max, scale_out,
                         scale_inv_out);
}

// The kernel parameters of cast_scale after the cast's own.
#define CUR_PARAMS const float *amax_in, int rule, unsigned margin, float max, float *scale_out, float *scale_inv_out
#define CUR_ARGS amax_in, rule, margin, max, scale_out, scale_inv_out

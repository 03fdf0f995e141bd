// candle-amp optimizer kernels: the fused low-bit AdamW step of one tensor
// (`LowBitStep` of optim/src/fused.rs) and the gradient sum of squares
// (`SumSq`), bit-identical to their CPU bodies for every finite result.
//
// Built by optim/build.rs with nvcc 13.0 (PTX ISA 9.0) and -fmad=false; every
// f32 operation of the update is also spelled as an IEEE round-to-nearest
// intrinsic (__fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn), which
// nvcc never contracts into an FMA: the CPU body (Rust, no contraction) does
// one rounding per operation in the same order, so the results agree bit for
// bit. Only NaN payloads may differ (x86 keeps an operand's payload, the GPU
// returns 0x7FFFFFFF); a step whose gradients hold inf/NaN is skipped before
// these kernels run.
//
// The step is two launches (justification in optim/src/cuda.rs):
//   lowbit_amax:  decode every stream, update in registers, fold the amax of
//                 the new weight, m and v (bits of |x|, NaN above inf, as the
//                 CPU's integer max); nothing is written but three atomics per
//                 block.
//   lowbit_write: the scales from those amaxes (ScaleRule::PowerOfTwo, the
//                 previous scale where the amax is 0 or not finite), then the
//                 same update recomputed (same instructions, same bits) and
//                 encoded; block 0 writes the new scales and amaxes.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#define CANONICAL_NAN 0x7FFFFFFFu
#define F16_NAN 0x7FFFu
#define F16_MAX 65504.0f
#define E4M3_MAX 448.0f
#define E5M2_MAX 57344.0f

// Stream kinds (StreamKind in optim/src/cuda.rs): the QType order, then F32.
#define K_E4M3 0
#define K_E5M2 1
#define K_F16 2
#define K_F32 3

__device__ __forceinline__ float decode_e4m3(uint8_t c) {
    if ((c & 0x7F) == 0x7F) return __uint_as_float(CANONICAL_NAN);
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3)));
}
__device__ __forceinline__ float decode_e5m2(uint8_t c) {
    if ((c & 0x7F) > 0x7C) return __uint_as_float(CANONICAL_NAN);
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E5M2)));
}
// half's f16 -> f32 (F16C): a NaN keeps sign and payload, quieted.
__device__ __forceinline__ float decode_f16(uint16_t h) {
    if ((h & 0x7FFF) > 0x7C00)
        return __uint_as_float(((h & 0x8000u) << 16) | 0x7FC00000u | ((h & 0x3FFu) << 13));
    return __half2float(__ushort_as_half(h));
}

// Element i of a stream as f32: decode(code) * scale_inv for a scaled
// stream (one f32 product), the value itself for F32 (the CPU copies it).
__device__ __forceinline__ float load(const void* p, int kind, float scale_inv, size_t i) {
    switch (kind) {
    case K_E4M3: return __fmul_rn(decode_e4m3(((const uint8_t*)p)[i]), scale_inv);
    case K_E5M2: return __fmul_rn(decode_e5m2(((const uint8_t*)p)[i]), scale_inv);
    case K_F16: return __fmul_rn(decode_f16(((const uint16_t*)p)[i]), scale_inv);
    default: return ((const float*)p)[i];
    }
}

// Element i of an output stream from its f32 value and scale: the scaled
// saturating casts of amp-core (RNE; FP8 NaN -> 0x7F, F16 NaN -> 0x7FFF).
__device__ __forceinline__ void store(void* p, int kind, float scale, size_t i, float x) {
    switch (kind) {
    case K_E4M3:
    case K_E5M2: {
        const float v = __fmul_rn(x, scale);
        ((uint8_t*)p)[i] = isnan(v) ? (uint8_t)0x7F
                                    : (uint8_t)__nv_cvt_float_to_fp8(
                                          v, __NV_SATFINITE, kind == K_E4M3 ? __NV_E4M3 : __NV_E5M2);
        break;
    }
    case K_F16: {
        const float v = __fmul_rn(x, scale);
        ((uint16_t*)p)[i] =
            isnan(v) ? (uint16_t)F16_NAN : __half_as_ushort(__float2half_rn(fminf(fmaxf(v, -F16_MAX), F16_MAX)));
        break;
    }
    default: ((float*)p)[i] = x;
    }
}

__device__ __forceinline__ float kind_max(int kind) {
    return kind == K_E4M3 ? E4M3_MAX : kind == K_E5M2 ? E5M2_MAX : F16_MAX;
}

__device__ __forceinline__ float pow2(int e) {
    if (e < -126) return 0.0f;
    if (e > 127) return __uint_as_float(0x7F800000u);
    return __uint_as_float((uint32_t)(e + 127) << 23);
}

// ScaleRule::PowerOfTwo.compute(amax, prev, max, 0) of amp-core's scale.rs.
__device__ float pow2_scale(float amax, float prev, float max) {
    if (!(amax > 0.0f && isfinite(amax) && max > 0.0f && isfinite(max))) return prev;
    const double q = __ddiv_rn((double)max, (double)amax);
    long long e = (long long)((__double_as_longlong(q) >> 52) & 0x7FF) - 1023;
    e = e < -126 ? -126 : (e > 127 ? 127 : e);
    const float s = pow2((int)e);
    return (s >= 1.17549435e-38f && isfinite(s)) ? s : prev;
}

// AdamStep of optim/src/adamw.rs (field order), plus the gradient multiplier.
struct Adam {
    float lr_wd, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, grad_mul;
};

// AdamStep::update for one element, operation by operation.
__device__ __forceinline__ void adam(const Adam& k, float& p, float g, float& m, float& v) {
    if (k.grad_mul != 1.0f) g = __fmul_rn(g, k.grad_mul);
    p = __fsub_rn(p, __fmul_rn(p, k.lr_wd));
    m = __fadd_rn(m, __fmul_rn(k.one_minus_beta1, __fsub_rn(g, m)));
    v = __fadd_rn(__fmul_rn(v, k.beta2), __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bc2_sqrt), k.eps);
    p = __fadd_rn(p, __fmul_rn(-k.step_size, __fdiv_rn(m, denom)));
}

struct Streams {
    const void *w, *g, *m, *v;
    const float *w_si, *g_si, *m_si, *v_si;
    int wk, gk, mk, vk;
};

__device__ __forceinline__ void element(const Streams& s, const Adam& k, float wsi, float gsi, float msi,
                                        float vsi, size_t i, float& p, float& m, float& v) {
    p = load(s.w, s.wk, wsi, i);
    const float g = load(s.g, s.gk, gsi, i);
    m = load(s.m, s.mk, msi, i);
    v = load(s.v, s.vk, vsi, i);
    adam(k, p, g, m, v);
}

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

// Pass 1: amax bits of the new weight, m and v into amax[0..3] (zeroed by
// the caller).
extern "C" __global__ void lowbit_amax(Streams s, Adam k, size_t n, uint32_t* amax) {
    const float wsi = *s.w_si, gsi = *s.g_si, msi = *s.m_si, vsi = *s.v_si;
    uint32_t wa = 0, ma = 0, va = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float p, m, v;
        element(s, k, wsi, gsi, msi, vsi, i, p, m, v);
        wa = max(wa, abs_bits(p));
        ma = max(ma, abs_bits(m));
        va = max(va, abs_bits(v));
    }
    for (int o = 16; o > 0; o >>= 1) {
        wa = max(wa, __shfl_xor_sync(0xFFFFFFFFu, wa, o));
        ma = max(ma, __shfl_xor_sync(0xFFFFFFFFu, ma, o));
        va = max(va, __shfl_xor_sync(0xFFFFFFFFu, va, o));
    }
    __shared__ uint32_t sh[3][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sh[0][warp] = wa; sh[1][warp] = ma; sh[2][warp] = va; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        wa = lane < nw ? sh[0][lane] : 0u;
        ma = lane < nw ? sh[1][lane] : 0u;
        va = lane < nw ? sh[2][lane] : 0u;
        for (int o = 16; o > 0; o >>= 1) {
            wa = max(wa, __shfl_xor_sync(0xFFFFFFFFu, wa, o));
            ma = max(ma, __shfl_xor_sync(0xFFFFFFFFu, ma, o));
            va = max(va, __shfl_xor_sync(0xFFFFFFFFu, va, o));
        }
        if (lane == 0) {
            if (wa) atomicMax(&amax[0], wa);
            if (ma) atomicMax(&amax[1], ma);
            if (va) atomicMax(&amax[2], va);
        }
    }
}

// The scale of an output stream: 1 for F32; from the amax otherwise, with
// the previous scale 1 / scale_inv (1 where scale_inv <= 0) as fallback.
__device__ __forceinline__ float out_scale(int kind, float amax, float prev_si) {
    if (kind == K_F32) return 1.0f;
    const float prev = prev_si > 0.0f ? __fdiv_rn(1.0f, prev_si) : 1.0f;
    return pow2_scale(amax, prev, kind_max(kind));
}

struct Outs {
    void *w, *m, *v;
    uint8_t* copy;  // E4M3 copy of the weight, or null
    // new scale and amax of each output (1 element each)
    float *w_scale, *w_amax, *m_scale, *m_amax, *v_scale, *v_amax, *copy_scale, *copy_amax;
};

// Pass 2: recompute the update and write every output.
extern "C" __global__ void lowbit_write(Streams s, Adam k, size_t n, const uint32_t* amax, Outs o) {
    const float wsi = *s.w_si, gsi = *s.g_si, msi = *s.m_si, vsi = *s.v_si;
    const float wa = __uint_as_float(amax[0]), ma = __uint_as_float(amax[1]), va = __uint_as_float(amax[2]);
    const float ws = out_scale(s.wk, wa, wsi), ms = out_scale(s.mk, ma, msi), vs = out_scale(s.vk, va, vsi);
    const float cs = pow2_scale(wa, 1.0f, E4M3_MAX);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *o.w_scale = ws; *o.w_amax = wa;
        *o.m_scale = ms; *o.m_amax = ma;
        *o.v_scale = vs; *o.v_amax = va;
        if (o.copy) { *o.copy_scale = cs; *o.copy_amax = wa; }
    }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float p, m, v;
        element(s, k, wsi, gsi, msi, vsi, i, p, m, v);
        store(o.w, s.wk, ws, i, p);
        store(o.m, s.mk, ms, i, m);
        store(o.v, s.vk, vs, i, v);
        if (o.copy) store(o.copy, K_E4M3, cs, i, p);
    }
}

// ------------------------------------------------------------- SumSq --
// The CPU body: blocks of 2048 elements; in each, 8 f32 lanes (lane j sums
// x*x of elements j, j+8, ... in order), the lanes summed in f64 in order;
// the blocks' sums added in f64 in order. Pass 1: one thread per (block,
// lane), one f64 per block into `partials`. Pass 2: one CUDA block adds the
// partials in order.
#define SUMSQ_BLOCK 2048

extern "C" __global__ void sumsq_partials(const void* g, int kind, const float* si_p, size_t n,
                                          double* partials) {
    const float si = *si_p;
    const size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t chunk = t >> 3, nchunks = (n + SUMSQ_BLOCK - 1) / SUMSQ_BLOCK;
    const int lane = (int)(t & 7);
    float acc = 0.0f;
    if (chunk < nchunks) {
        const size_t at = chunk * SUMSQ_BLOCK;
        const size_t len = min((size_t)SUMSQ_BLOCK, n - at);
        for (size_t i = lane; i < len; i += 8) {
            const float x = load(g, kind, si, at + i);
            acc = __fadd_rn(acc, __fmul_rn(x, x));
        }
    }
    // lanes of one chunk are 8 consecutive threads of a warp
    double lanes[8];
    const int base = (int)(threadIdx.x & 31) & ~7;
#pragma unroll
    for (int j = 0; j < 8; j++) lanes[j] = (double)__shfl_sync(0xFFFFFFFFu, acc, base + j);
    if (lane == 0 && chunk < nchunks) {
        double s = lanes[0];
        for (int j = 1; j < 8; j++) s = __dadd_rn(s, lanes[j]);
        partials[chunk] = s;
    }
}

// out[0] = partials[0] + partials[1] + ... in order (from 0.0). One block.
extern "C" __global__ void sumsq_total(const double* partials, size_t count, double* out) {
    __shared__ double tile[256];
    double total = 0.0;
    for (size_t at = 0; at < count; at += 256) {
        const size_t i = at + threadIdx.x;
        if (threadIdx.x < 256) tile[threadIdx.x] = i < count ? partials[i] : 0.0;
        __syncthreads();
        if (threadIdx.x == 0) {
            const size_t len = min((size_t)256, count - at);
            for (size_t j = 0; j < len; j++) total = __dadd_rn(total, tile[j]);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = total;
}

// The FP8 and FP16 codecs of every candle-amp kernel that encodes or
// decodes: the casts (amp.cu, cast_t.cu, through cast.cuh) and the
// optimizer step (the optim crate's kernels), with the scale rules both
// apply. One header, so the formats' conversions exist once; where the two
// kinds of kernel need different forms of a conversion, both are here
// under their own names, each bit-identical to amp-core's CPU casts
// (cast.rs, scale.rs) as documented at it.
//
//   formats and constants   the storage formats' ids, maxima and NaN codes
//   hardware decodes        decode_e4m3 / decode_e5m2 / decode_f16: the
//                           conversion alone (a NaN code gives some NaN)
//   cast codecs (Fmt<FMT>)  the casts' element and packed conversions: NaN
//                           codes decode to the canonical NaN, NaN encodes
//                           to 0x7F (FP8) / 0x7FFF (FP16)
//   step codecs             the optimizer's per-stream codecs: decodes
//                           multiplied by scale_inv at once (which makes any
//                           NaN the canonical one), packed encodes with the
//                           stream kind at run time (load, store, decode4,
//                           f16x2_sat, fp8x4_sat)
//   scale rules             ScaleRule::compute (compute_scale, the casts')
//                           and its PowerOfTwo form with margin 0
//                           (pow2_scale, the optimizer's)
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// -------------------------------------------------- formats, constants --
// Formats in the QType order (the casts' FMT template parameter); the
// optimizer's stream kinds (the optim crate's `kind`) add F32.
#define K_E4M3 0
#define K_E5M2 1
#define K_F16 2
#define K_F32 3

#define E4M3_MAX 448.0f
#define E5M2_MAX 57344.0f
#define F16_MAX 65504.0f
// The f32 NaN the GPU's arithmetic returns, and the one Rust's f32::NAN is.
#define CANONICAL_NAN 0x7FFFFFFFu
#define RUST_F32_NAN 0x7FC00000u
// The FP16 code of NaN (the FP8 one is 0x7F, the E4M3 NaN).
#define F16_NAN 0x7FFFu

// ----------------------------------------------------- hardware decodes --
__device__ __forceinline__ float decode_e4m3(uint8_t c) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3)));
}
__device__ __forceinline__ float decode_e5m2(uint8_t c) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E5M2)));
}
__device__ __forceinline__ float decode_f16(uint16_t h) { return __half2float(__ushort_as_half(h)); }

// Four FP8 codes packed in a word, in which every byte of NaN magnitude
// (only NaN inputs give one: satfinite never gives inf) becomes 0x7F, the
// CPU's NaN code. `add` carries a byte's magnitude into bit 7 exactly
// where it is NaN: 0x01 a byte for E4M3 (magnitude 0x7F), 0x03 for E5M2
// (above 0x7C).
__device__ __forceinline__ uint32_t fp8x4_nan_fix(uint32_t w, uint32_t add) {
    const uint32_t ones = (((w & 0x7F7F7F7Fu) + add) & 0x80808080u) >> 7;
    return (w & ~(ones * 0xFFu)) | (ones * 0x7Fu);
}
#define E4M3_NAN_ADD 0x01010101u
#define E5M2_NAN_ADD 0x03030303u

// ------------------------------------------------ cast codecs (Fmt<FMT>) --
// FMT: K_E4M3, K_E5M2, K_F16. `encode` saturates to +-MAX (inf too), rounds
// to nearest even, NaN to the NaN code; `decode` gives the canonical NaN
// for every NaN code.
template <int FMT> struct Fmt;
template <> struct Fmt<K_E4M3> {
    typedef uint8_t code_t;
    static constexpr float MAX = E4M3_MAX;
    static __device__ __forceinline__ uint8_t encode(float v) {
        if (isnan(v)) return 0x7F;
        return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    }
    // Branch-free (the conversion is inline asm: no branch around it).
    static __device__ __forceinline__ float decode(uint8_t c) {
        const float v = decode_e4m3(c);
        return (c & 0x7F) == 0x7F ? __uint_as_float(CANONICAL_NAN) : v;
    }
    static __device__ __forceinline__ bool is_zero(uint8_t c) { return (c & 0x7F) == 0; }
    // Two codes (x in the low byte) with no branch; NaN fixed afterwards
    // on packed words (nan_fix).
    static __device__ __forceinline__ uint16_t encode2_raw(float x, float y) {
        return __nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, __NV_E4M3);
    }
    static __device__ __forceinline__ uint32_t nan_fix(uint32_t w) { return fp8x4_nan_fix(w, E4M3_NAN_ADD); }
};
template <> struct Fmt<K_E5M2> {
    typedef uint8_t code_t;
    static constexpr float MAX = E5M2_MAX;
    static __device__ __forceinline__ uint8_t encode(float v) {
        if (isnan(v)) return 0x7F;
        return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
    }
    static __device__ __forceinline__ float decode(uint8_t c) {
        const float v = decode_e5m2(c);
        return (c & 0x7F) > 0x7C ? __uint_as_float(CANONICAL_NAN) : v;
    }
    static __device__ __forceinline__ bool is_zero(uint8_t c) { return (c & 0x7F) == 0; }
    static __device__ __forceinline__ uint16_t encode2_raw(float x, float y) {
        return __nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, __NV_E5M2);
    }
    static __device__ __forceinline__ uint32_t nan_fix(uint32_t w) { return fp8x4_nan_fix(w, E5M2_NAN_ADD); }
};
template <> struct Fmt<K_F16> {
    typedef uint16_t code_t;
    static constexpr float MAX = F16_MAX;
    static __device__ __forceinline__ uint16_t encode(float v) {
        if (isnan(v)) return F16_NAN;
        return __half_as_ushort(__float2half_rn(fminf(fmaxf(v, -F16_MAX), F16_MAX)));
    }
    static __device__ __forceinline__ float decode(uint16_t c) {
        const float v = decode_f16(c);
        return (c & 0x7FFF) > 0x7C00 ? __uint_as_float(CANONICAL_NAN) : v;
    }
    static __device__ __forceinline__ bool is_zero(uint16_t c) { return (c & 0x7FFF) == 0; }
};

// ----------------------------------------------------------- step codecs --
// The optimizer step's codecs of a stream of kind K_E4M3, K_E5M2, K_F16 or
// K_F32, the kind known at run time (it folds where the kernel fixes it).
//
// Decodes are the hardware conversions alone: a NaN code gives some NaN,
// and every decode is multiplied by its scale_inv at once (`load`,
// `decode4`, the optimizer's sum of squares), which returns the canonical NaN
// 0x7FFFFFFF for any NaN operand. So a NaN code needs no select of its own
// (nor an f16 NaN its payload kept, as F16C does: the product drops it on
// the GPU, and only NaN payloads may differ from the CPU).

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

// Four codes of a stream as `load` decodes each, two codes a conversion:
// FP8 from the bytes of w0 (w1 unused), F16 from the halves of w0 and w1.
__device__ __forceinline__ void decode4(uint32_t w0, uint32_t w1, int kind, float si, float x[4]) {
    float2 a, b;
    if (kind == K_F16) {
        a = __half22float2(*reinterpret_cast<const __half2*>(&w0));
        b = __half22float2(*reinterpret_cast<const __half2*>(&w1));
    } else {
        const __nv_fp8_interpretation_t f = kind == K_E4M3 ? __NV_E4M3 : __NV_E5M2;
        const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w0 & 0xFFFFu), f);
        const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w0 >> 16), f);
        a = __half22float2(__half2(lo));
        b = __half22float2(__half2(hi));
    }
    x[0] = __fmul_rn(a.x, si);
    x[1] = __fmul_rn(a.y, si);
    x[2] = __fmul_rn(b.x, si);
    x[3] = __fmul_rn(b.y, si);
}

// Two f32 values as F16 codes (lo in the low half): round to nearest even,
// finite values past 65504 saturated (clamp-then-round gives the same
// code: only values that round past 65504 are changed), NaN as the
// canonical 0x7FFF, so the CPU's clamp and F16 conversion with the
// codec's NaN rule.
__device__ __forceinline__ uint32_t f16x2_sat(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Four f32 values as FP8 codes of `kind` (x[0] in the low byte): the
// saturating conversion two at a time, then the NaN bytes fixed
// (fp8x4_nan_fix): Fmt's encode2_raw and nan_fix with the kind at run time.
__device__ __forceinline__ uint32_t fp8x4_sat(const float x[4], int kind) {
    const __nv_fp8_interpretation_t f = kind == K_E4M3 ? __NV_E4M3 : __NV_E5M2;
    const uint32_t w = (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(x[0], x[1]), __NV_SATFINITE, f) |
                       ((uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(x[2], x[3]), __NV_SATFINITE, f) << 16);
    return fp8x4_nan_fix(w, kind == K_E4M3 ? E4M3_NAN_ADD : E5M2_NAN_ADD);
}

// Element i of an output stream from its f32 value and scale: the scaled
// saturating casts of amp-core (RNE; FP8 NaN -> 0x7F, F16 NaN -> 0x7FFF),
// the same conversions as the packed ones.
__device__ __forceinline__ void store(void* p, int kind, float scale, size_t i, float x) {
    switch (kind) {
    case K_E4M3:
    case K_E5M2: {
        const float v[4] = {__fmul_rn(x, scale), 0.0f, 0.0f, 0.0f};
        ((uint8_t*)p)[i] = (uint8_t)fp8x4_sat(v, kind);
        break;
    }
    case K_F16: ((uint16_t*)p)[i] = (uint16_t)f16x2_sat(__fmul_rn(x, scale), 0.0f); break;
    default: ((float*)p)[i] = x;
    }
}

__device__ __forceinline__ float kind_max(int kind) {
    return kind == K_E4M3 ? E4M3_MAX : kind == K_E5M2 ? E5M2_MAX : F16_MAX;
}

// ----------------------------------------------------------- scale rules --
__device__ __forceinline__ float pow2(int e) {
    if (e < -126) return 0.0f;
    if (e > 127) return __uint_as_float(0x7F800000u);
    return __uint_as_float((uint32_t)(e + 127) << 23);
}

// x = 1.frac * 2^e for a positive finite x (a subnormal normalized): e,
// and frac's 23 bits in *frac.
__device__ __forceinline__ int exp_frac(float x, uint32_t* frac) {
    const uint32_t b = __float_as_uint(x);
    int e = (int)(b >> 23);
    uint32_t m = b & 0x7FFFFFu;
    if (e == 0) {
        const int sh = __clz(m) - 8;  // the leading 1 to bit 23
        m = (m << sh) & 0x7FFFFFu;
        e = 1 - sh;
    }
    *frac = m;
    return e - 127;
}

// The power-of-two scale of positive finite max and amax: 2^e, e =
// floor(log2(max / amax)) - margin clamped to the normal range, the
// exponent of scale.rs's rounded f64 quotient (never rounded across a
// power of two, as scale.rs says) from the two exponents and
// significands: no division. Always a normal float.
__device__ __forceinline__ float pow2_ratio_scale(float max, float amax, unsigned margin) {
    uint32_t fm, fa;
    const int em = exp_frac(max, &fm), ea = exp_frac(amax, &fa);
    long long e = (long long)(em - ea) - (fm < fa ? 1 : 0) - (long long)margin;
    e = e < -126 ? -126 : (e > 127 ? 127 : e);
    return __uint_as_float((uint32_t)(e + 127) << 23);
}

// ScaleRule::compute of scale.rs (the casts'). rule: 0 = Te, 1 = PowerOfTwo.
__device__ float compute_scale(int rule, float amax, float prev, float max, unsigned margin) {
    if (!(amax > 0.0f && isfinite(amax) && max > 0.0f && isfinite(max))) return prev;
    if (rule != 0) return pow2_ratio_scale(max, amax, margin);
    float s = (max / amax) / pow2((int)min(margin, 255u));
    if (isinf(s)) s = 3.40282347e+38f;
    return (s >= 1.17549435e-38f && isfinite(s)) ? s : prev;
}

// ScaleRule::PowerOfTwo.compute(amax, prev, max, 0) of scale.rs (the
// optimizer's; compute_scale(1, amax, prev, max, 0) computes the same).
__device__ float pow2_scale(float amax, float prev, float max) {
    if (!(amax > 0.0f && isfinite(amax) && max > 0.0f && isfinite(max))) return prev;
    const double q = __ddiv_rn((double)max, (double)amax);
    long long e = (long long)((__double_as_longlong(q) >> 52) & 0x7FF) - 1023;
    e = e < -126 ? -126 : (e > 127 ? 127 : e);
    const float s = pow2((int)e);
    return (s >= 1.17549435e-38f && isfinite(s)) ? s : prev;
}

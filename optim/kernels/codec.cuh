// Element codecs of the optimizer kernels (included by lowbit.cu, after
// its format constants): decode and encode of each stream kind with
// amp-core's saturating round-to-nearest-even casts, one element at a time
// and packed (the vector groups of the step), the amax fold, and the
// power-of-two scale rule (ScaleRule::PowerOfTwo of amp-core's scale.rs).
//
// Decodes are the hardware conversions alone: a NaN code gives some NaN,
// and every decode is multiplied by its scale_inv at once (`load`,
// `decode4`, sumsq's `decode_code`), which returns the canonical NaN
// 0x7FFFFFFF for any NaN operand. So a NaN code needs no select of its own
// (nor an f16 NaN its payload kept, as F16C does: the product drops it on
// the GPU, and only NaN payloads may differ from the CPU).

__device__ __forceinline__ float decode_e4m3(uint8_t c) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3)));
}
__device__ __forceinline__ float decode_e5m2(uint8_t c) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E5M2)));
}
__device__ __forceinline__ float decode_f16(uint16_t h) { return __half2float(__ushort_as_half(h)); }

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
// saturating conversion two at a time, then every byte of NaN magnitude
// (E4M3 0x7F; E5M2 above 0x7C: only NaN inputs give them, satfinite never
// gives inf) becomes 0x7F, the CPU's NaN code.
__device__ __forceinline__ uint32_t fp8x4_sat(const float x[4], int kind) {
    const __nv_fp8_interpretation_t f = kind == K_E4M3 ? __NV_E4M3 : __NV_E5M2;
    const uint32_t w = (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(x[0], x[1]), __NV_SATFINITE, f) |
                       ((uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(x[2], x[3]), __NV_SATFINITE, f) << 16);
    const uint32_t add = kind == K_E4M3 ? 0x01010101u : 0x03030303u;
    const uint32_t ones = (((w & 0x7F7F7F7Fu) + add) & 0x80808080u) >> 7;
    return (w & ~(ones * 0xFFu)) | (ones * 0x7Fu);
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

// The running amax as f32: max(a, |x|), NaN above everything (max.NaN
// returns the canonical NaN), so its bits are the CPU's integer max of
// |x|'s bits wherever no NaN payload differs.
__device__ __forceinline__ float amax_fold(float a, float x) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(fabsf(x)));
    return r;
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

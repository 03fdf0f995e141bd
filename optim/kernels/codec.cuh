// Element codecs of the optimizer kernels (included by lowbit.cu, after
// its format constants): decode and encode of one element of each stream
// kind with amp-core's saturating round-to-nearest-even casts, and the
// power-of-two scale rule (ScaleRule::PowerOfTwo of amp-core's scale.rs).

// Branch-free (a select, no branch around the conversion), so loads ahead
// of a decode are not held back by it.
__device__ __forceinline__ float decode_e4m3(uint8_t c) {
    const float v = __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3)));
    return (c & 0x7F) == 0x7F ? __uint_as_float(CANONICAL_NAN) : v;
}
__device__ __forceinline__ float decode_e5m2(uint8_t c) {
    const float v = __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E5M2)));
    return (c & 0x7F) > 0x7C ? __uint_as_float(CANONICAL_NAN) : v;
}
// half's f16 -> f32 (F16C): a NaN keeps sign and payload, quieted.
__device__ __forceinline__ float decode_f16(uint16_t h) {
    const uint32_t nan = ((h & 0x8000u) << 16) | 0x7FC00000u | ((h & 0x3FFu) << 13);
    const float v = __half2float(__ushort_as_half(h));
    return (h & 0x7FFF) > 0x7C00 ? __uint_as_float(nan) : v;
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

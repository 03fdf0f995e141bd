// The step kernels' vector groups (included by lowbit.cu after codec.cuh,
// amp-core's): a group's raw words of each stream kind, their decode and
// encode, in groups of 4 elements and, for streams of 1- and 2-byte codes
// only, of 8.
#pragma once

// ------------------------------------------------------- vector groups --
// G consecutive elements per thread and group: one 4-, 8- or 16-byte access
// per stream (E4M3/E5M2, F16, F32), so consecutive threads touch
// consecutive words and every warp-wide access is one contiguous span.
#define G 4

// Group gi of a stream as raw bits (the low bytes of the word).
__device__ __forceinline__ uint4 load_raw(const void* p, int kind, size_t gi) {
    uint4 r = make_uint4(0, 0, 0, 0);
    switch (kind) {
    case K_E4M3:
    case K_E5M2: r.x = ((const uint32_t*)p)[gi]; break;
    case K_F16: { const uint2 w = ((const uint2*)p)[gi]; r.x = w.x; r.y = w.y; break; }
    default: r = ((const uint4*)p)[gi];
    }
    return r;
}

// The G values of a raw group, as `load` decodes each.
__device__ __forceinline__ void decode_raw(uint4 r, int kind, float si, float x[G]) {
    if (kind == K_F32) {
        x[0] = __uint_as_float(r.x);
        x[1] = __uint_as_float(r.y);
        x[2] = __uint_as_float(r.z);
        x[3] = __uint_as_float(r.w);
    } else {
        decode4(r.x, r.y, kind, si, x);
    }
}

// Group gi of an output stream from G f32 values, as `store` encodes each.
__device__ __forceinline__ void store_group(void* p, int kind, float scale, size_t gi, const float x[G]) {
    if (kind == K_F32) {
        ((float4*)p)[gi] = make_float4(x[0], x[1], x[2], x[3]);
        return;
    }
    float v[G];
#pragma unroll
    for (int j = 0; j < G; j++) v[j] = __fmul_rn(x[j], scale);
    if (kind == K_F16) ((uint2*)p)[gi] = make_uint2(f16x2_sat(v[0], v[1]), f16x2_sat(v[2], v[3]));
    else ((uint32_t*)p)[gi] = fp8x4_sat(v, kind);
}

// Wide groups, 8 elements, for kernels whose streams are all 1- or 2-byte
// codes (the kinds fixed at compile time): one 8- or 16-byte access a
// stream, twice the bytes of one load or store instruction (and its
// address) of the 4-element groups.
__device__ __forceinline__ uint4 load_raw8(const void* p, int kind, size_t gi) {
    if (kind == K_F16) return ((const uint4*)p)[gi];
    const uint2 w = ((const uint2*)p)[gi];
    return make_uint4(w.x, w.y, 0, 0);
}
__device__ __forceinline__ void decode_raw8(uint4 r, int kind, float si, float x[8]) {
    if (kind == K_F16) {
        decode4(r.x, r.y, kind, si, x);
        decode4(r.z, r.w, kind, si, x + 4);
    } else {
        decode4(r.x, 0, kind, si, x);
        decode4(r.y, 0, kind, si, x + 4);
    }
}
__device__ __forceinline__ void store_group8(void* p, int kind, float scale, size_t gi, const float x[8]) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = __fmul_rn(x[j], scale);
    if (kind == K_F16)
        ((uint4*)p)[gi] = make_uint4(f16x2_sat(v[0], v[1]), f16x2_sat(v[2], v[3]), f16x2_sat(v[4], v[5]),
                                     f16x2_sat(v[6], v[7]));
    else ((uint2*)p)[gi] = make_uint2(fp8x4_sat(v, kind), fp8x4_sat(v + 4, kind));
}

// The step's codecs as kernels of their own (included by lowbit.cu after
// the vector-group helpers they use), for the checks.
#pragma once

// The step's codecs over a stream (`Codec` of optim/src/codec.rs, for the
// checks): x * scale to codes of `kind`, or codes * scale_inv to f32, in
// the step's vector groups (`vec`: both streams 16-byte aligned), the tail
// and unaligned streams one element at a time.
extern "C" __global__ void codec_encode(const float* x, size_t n, int kind, float scale, int vec, void* out) {
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    const size_t groups = vec ? n / G : 0;
    for (size_t gi = tid; gi < groups; gi += stride) {
        const float4 v = ((const float4*)x)[gi];
        const float xs[G] = {v.x, v.y, v.z, v.w};
        store_group(out, kind, scale, gi, xs);
    }
    for (size_t i = groups * G + tid; i < n; i += stride) store(out, kind, scale, i, x[i]);
}
extern "C" __global__ void codec_decode(const void* codes, size_t n, int kind, float scale_inv, int vec, float* out) {
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    const size_t groups = vec ? n / G : 0;
    for (size_t gi = tid; gi < groups; gi += stride) {
        float x[G];
        decode_raw(load_raw(codes, kind, gi), kind, scale_inv, x);
        ((float4*)out)[gi] = make_float4(x[0], x[1], x[2], x[3]);
    }
    for (size_t i = groups * G + tid; i < n; i += stride) out[i] = load(codes, kind, scale_inv, i);
}

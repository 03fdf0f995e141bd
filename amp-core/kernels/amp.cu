// candle-amp CUDA kernels: scaled FP8/FP16 casts with amax and counts,
// dequantize, amax, requantize, amax history and scale update.
//
// Every result is bit-identical to the CPU kernels of amp-core (cast.rs,
// meta.rs, scale.rs); the rules they must reproduce:
//   quantize:   code = encode(f32(x) * scale), one IEEE f32 product (no FMA
//               is possible: there is no add), encode = RNE, saturate to
//               +-max (inf too), NaN -> 0x7F (FP8) / 0x7FFF (FP16);
//               amax = max of |f32(x)| as bits (NaN propagates, its payload
//               included); saturated = |x*scale| > max; flushed = x != 0,
//               not NaN, encoded as (+-)0.
//   dequantize: y = out_dtype(decode(code) * scale_inv); NaN codes decode to
//               0x7FFFFFFF; NaN outputs take the CPU's bit patterns.
// Built by build.rs with nvcc 13.0 (PTX ISA 9.0, which the device's CUDA 13.0
// driver loads) without fast-math: IEEE division and no flush to zero.
#include "cast.cuh"

// x[n] -> codes[n], amax (as u32 bits, zeroed by the caller), counts[2]
// (zeroed by the caller). `vec`: both pointers 16-byte aligned, so the
// first n / VEC * VEC elements go through 16-byte accesses.
template <typename T, int FMT>
__device__ void quantize_impl(const T* __restrict__ x, const float* __restrict__ scale_p,
                              typename Fmt<FMT>::code_t* __restrict__ out, size_t n, int vec,
                              uint32_t* amax_out, unsigned long long* counts, CUR_PARAMS) {
    typedef typename Fmt<FMT>::code_t C;
    const float scale = cast_scale(scale_p, CUR_ARGS);
    uint32_t amax = 0, sat = 0, flush = 0;
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if (vec) {
        const size_t nv = n / VEC;
        for (size_t i = tid; i < nv; i += stride) {
            Vec16<T> in;
            const uint4* src = reinterpret_cast<const uint4*>(x + i * VEC);
#pragma unroll
            for (int j = 0; j < (int)(sizeof(in.w) / 16); j++) in.w[j] = __ldcs(src + j);
            const T* xs = reinterpret_cast<const T*>(in.w);
            float f[VEC];
#pragma unroll
            for (int j = 0; j < VEC; j++) f[j] = to_f32(xs[j]);
            uint4* dst = reinterpret_cast<uint4*>(out + i * VEC);
            if constexpr (FMT < 2) {
                uint4 o;
                o.x = quantize4<FMT>(f, scale, amax, sat, flush);
                o.y = quantize4<FMT>(f + 4, scale, amax, sat, flush);
                o.z = quantize4<FMT>(f + 8, scale, amax, sat, flush);
                o.w = quantize4<FMT>(f + 12, scale, amax, sat, flush);
                __stcs(dst, o);
            } else {
                __align__(16) C cs[VEC];
#pragma unroll
                for (int j = 0; j < VEC; j++) cs[j] = quantize_one<FMT>(f[j], scale, amax, sat, flush);
                const uint4* cw = reinterpret_cast<const uint4*>(cs);
#pragma unroll
                for (int j = 0; j < (int)(sizeof(cs) / 16); j++) __stcs(dst + j, cw[j]);
            }
        }
        done = nv * VEC;
    }
    for (size_t i = done + tid; i < n; i += stride) out[i] = quantize_one<FMT>(to_f32(x[i]), scale, amax, sat, flush);
    block_flush(amax, sat, flush, amax_out, counts);
}

#define QUANTIZE(TN, T, FN, FMT)                                                                       \
    extern "C" __global__ void quantize_##TN##_##FN(const T* x, const float* scale,                    \
                                                    Fmt<FMT>::code_t* out, size_t n, int vec,          \
                                                    uint32_t* amax, unsigned long long* counts,        \
                                                    CUR_PARAMS) {                                      \
        quantize_impl<T, FMT>(x, scale, out, n, vec, amax, counts, CUR_ARGS);                          \
    }
QUANTIZE(f32, float, e4m3, 0)
QUANTIZE(f32, float, e5m2, 1)
QUANTIZE(f32, float, f16, 2)
QUANTIZE(bf16, __nv_bfloat16, e4m3, 0)
QUANTIZE(bf16, __nv_bfloat16, e5m2, 1)
QUANTIZE(bf16, __nv_bfloat16, f16, 2)
QUANTIZE(f16, __half, e4m3, 0)
QUANTIZE(f16, __half, e5m2, 1)
QUANTIZE(f16, __half, f16, 2)

// ------------------------------------------------------------------- amax --
template <typename T>
__device__ void amax_impl(const T* __restrict__ x, size_t n, int vec, uint32_t* amax_out) {
    uint32_t amax = 0;
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if (vec) {
        const size_t nv = n / VEC;
        for (size_t i = tid; i < nv; i += stride) {
            Vec16<T> in;
            const uint4* src = reinterpret_cast<const uint4*>(x + i * VEC);
#pragma unroll
            for (int j = 0; j < (int)(sizeof(in.w) / 16); j++) in.w[j] = __ldg(src + j);
            const T* xs = reinterpret_cast<const T*>(in.w);
#pragma unroll
            for (int j = 0; j < VEC; j++) amax = max(amax, abs_bits(to_f32(xs[j])));
        }
        done = nv * VEC;
    }
    for (size_t i = done + tid; i < n; i += stride) amax = max(amax, abs_bits(to_f32(x[i])));
    block_flush(amax, 0, 0, amax_out, nullptr);
}

extern "C" __global__ void amax_f32(const float* x, size_t n, int vec, uint32_t* amax) { amax_impl(x, n, vec, amax); }
extern "C" __global__ void amax_bf16(const __nv_bfloat16* x, size_t n, int vec, uint32_t* amax) { amax_impl(x, n, vec, amax); }
extern "C" __global__ void amax_f16(const __half* x, size_t n, int vec, uint32_t* amax) { amax_impl(x, n, vec, amax); }

// --------------------------------------------------------- code loading --
// VEC codes as 16-byte words: one for FP8, two for FP16.
template <int FMT> struct Codes16 { uint4 w[FMT < 2 ? 1 : 2]; };

template <int FMT>
__device__ __forceinline__ void load_codes(const typename Fmt<FMT>::code_t* q, size_t i, Codes16<FMT>& in) {
    const uint4* src = reinterpret_cast<const uint4*>(q + i * VEC);
#pragma unroll
    for (int j = 0; j < (int)(sizeof(in.w) / 16); j++) in.w[j] = __ldcs(src + j);
}

// ------------------------------------------------------------- dequantize --
// The vector path moves one 16-byte output word per thread and unit: P
// outputs from P codes, so consecutive threads write consecutive words and
// read consecutive code words (each warp-wide load and store is one
// contiguous span: a thread writing 64 bytes as four strided 16-byte stores,
// as an earlier version did, leaves every store instruction a quarter of
// each sector and ran at half the copy bandwidth). U units are loaded
// before any is decoded, so U loads per thread are in flight.
template <int BYTES> struct Raw;
template <> struct Raw<2> { typedef unsigned short t; };
template <> struct Raw<4> { typedef unsigned int t; };
template <> struct Raw<8> { typedef uint2 t; };
template <> struct Raw<16> { typedef uint4 t; };

// P = 16 / sizeof(O) codes (one raw word) -> one 16-byte word of outputs.
template <int FMT, typename O, typename R>
__device__ __forceinline__ uint4 decode_word(R r, float scale_inv) {
    typedef typename Fmt<FMT>::code_t C;
    constexpr int P = 16 / sizeof(O);
    const C* cs = reinterpret_cast<const C*>(&r);
    __align__(16) O o[P];
#pragma unroll
    for (int j = 0; j < P; j++) store(o + j, Fmt<FMT>::decode(cs[j]) * scale_inv);
    return *reinterpret_cast<const uint4*>(o);
}

// `vec`: codes and output 16-byte aligned.
template <int FMT, typename O>
__device__ void dequantize_impl(const typename Fmt<FMT>::code_t* __restrict__ q,
                                const float* __restrict__ scale_inv_p, O* __restrict__ out, size_t n, int vec) {
    typedef typename Fmt<FMT>::code_t C;
    constexpr int P = 16 / sizeof(O);
    constexpr int U = 4;
    typedef typename Raw<P * sizeof(C)>::t R;
    const float scale_inv = *scale_inv_p;
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if (vec) {
        const size_t units = n / P;
        const R* src = reinterpret_cast<const R*>(q);
        uint4* dst = reinterpret_cast<uint4*>(out);
        size_t u = tid;
        for (; u + (U - 1) * stride < units; u += U * stride) {
            R r[U];
#pragma unroll
            for (int k = 0; k < U; k++) r[k] = __ldcs(src + u + k * stride);
#pragma unroll
            for (int k = 0; k < U; k++) __stcs(dst + u + k * stride, decode_word<FMT, O>(r[k], scale_inv));
        }
        for (; u < units; u += stride) __stcs(dst + u, decode_word<FMT, O>(__ldcs(src + u), scale_inv));
        done = units * P;
    }
    for (size_t i = done + tid; i < n; i += stride) store(out + i, Fmt<FMT>::decode(q[i]) * scale_inv);
}

#define DEQUANTIZE(FN, FMT, ON, O)                                                                     \
    extern "C" __global__ void dequantize_##FN##_##ON(const Fmt<FMT>::code_t* q, const float* scale_inv, \
                                                      O* out, size_t n, int vec) {                     \
        dequantize_impl<FMT, O>(q, scale_inv, out, n, vec);                                            \
    }
DEQUANTIZE(e4m3, 0, f32, float)
DEQUANTIZE(e4m3, 0, f16, __half)
DEQUANTIZE(e4m3, 0, bf16, __nv_bfloat16)
DEQUANTIZE(e4m3, 0, f64, double)
DEQUANTIZE(e5m2, 1, f32, float)
DEQUANTIZE(e5m2, 1, f16, __half)
DEQUANTIZE(e5m2, 1, bf16, __nv_bfloat16)
DEQUANTIZE(e5m2, 1, f64, double)
DEQUANTIZE(f16, 2, f32, float)
DEQUANTIZE(f16, 2, f16, __half)
DEQUANTIZE(f16, 2, bf16, __nv_bfloat16)
DEQUANTIZE(f16, 2, f64, double)

// ------------------------------------------------------------ requantize --
// Pass 1: amax of y = decode(q) * scale_inv. Pass 2 (after the scale update):
// codes of y * scale, with y's amax and counts: the same bits as quantizing
// the F32 dequantized tensor, without writing it.
template <int FMT>
__device__ void decoded_amax_impl(const typename Fmt<FMT>::code_t* __restrict__ q,
                                  const float* __restrict__ scale_inv_p, size_t n, int vec, uint32_t* amax_out) {
    typedef typename Fmt<FMT>::code_t C;
    const float scale_inv = *scale_inv_p;
    uint32_t amax = 0;
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if (vec) {
        const size_t nv = n / VEC;
        for (size_t i = tid; i < nv; i += stride) {
            Codes16<FMT> in;
            load_codes<FMT>(q, i, in);
            const C* cs = reinterpret_cast<const C*>(in.w);
#pragma unroll
            for (int j = 0; j < VEC; j++) amax = max(amax, abs_bits(Fmt<FMT>::decode(cs[j]) * scale_inv));
        }
        done = nv * VEC;
    }
    for (size_t i = done + tid; i < n; i += stride) amax = max(amax, abs_bits(Fmt<FMT>::decode(q[i]) * scale_inv));
    block_flush(amax, 0, 0, amax_out, nullptr);
}

// `vec`: input and output codes 16-byte aligned.
template <int FROM, int TO>
__device__ void requantize_impl(const typename Fmt<FROM>::code_t* __restrict__ q,
                                const float* __restrict__ scale_inv_p, const float* __restrict__ scale_p,
                                typename Fmt<TO>::code_t* __restrict__ out, size_t n, int vec, uint32_t* amax_out,
                                unsigned long long* counts) {
    typedef typename Fmt<FROM>::code_t C;
    typedef typename Fmt<TO>::code_t D;
    const float scale_inv = *scale_inv_p, scale = *scale_p;
    uint32_t amax = 0, sat = 0, flush = 0;
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if (vec) {
        const size_t nv = n / VEC;
        for (size_t i = tid; i < nv; i += stride) {
            Codes16<FROM> in;
            load_codes<FROM>(q, i, in);
            const C* cs = reinterpret_cast<const C*>(in.w);
            float f[VEC];
#pragma unroll
            for (int j = 0; j < VEC; j++) f[j] = Fmt<FROM>::decode(cs[j]) * scale_inv;
            uint4* dst = reinterpret_cast<uint4*>(out + i * VEC);
            if constexpr (TO < 2) {
                uint4 o;
                o.x = quantize4<TO>(f, scale, amax, sat, flush);
                o.y = quantize4<TO>(f + 4, scale, amax, sat, flush);
                o.z = quantize4<TO>(f + 8, scale, amax, sat, flush);
                o.w = quantize4<TO>(f + 12, scale, amax, sat, flush);
                __stcs(dst, o);
            } else {
                __align__(16) D ds[VEC];
#pragma unroll
                for (int j = 0; j < VEC; j++) ds[j] = quantize_one<TO>(f[j], scale, amax, sat, flush);
                const uint4* dw = reinterpret_cast<const uint4*>(ds);
#pragma unroll
                for (int j = 0; j < (int)(sizeof(ds) / 16); j++) __stcs(dst + j, dw[j]);
            }
        }
        done = nv * VEC;
    }
    for (size_t i = done + tid; i < n; i += stride)
        out[i] = quantize_one<TO>(Fmt<FROM>::decode(q[i]) * scale_inv, scale, amax, sat, flush);
    block_flush(amax, sat, flush, amax_out, counts);
}

#define DECODED_AMAX(FN, FMT)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 8) decoded_amax_##FN(const Fmt<FMT>::code_t* q, const float* scale_inv,    \
                                                 size_t n, int vec, uint32_t* amax) {                  \
        decoded_amax_impl<FMT>(q, scale_inv, n, vec, amax);                                            \
    }
DECODED_AMAX(e4m3, 0)
DECODED_AMAX(e5m2, 1)
DECODED_AMAX(f16, 2)

#define REQUANTIZE(FN, FROM, TN, TO)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, 8) requantize_##FN##_##TN(const Fmt<FROM>::code_t* q, const float* scale_inv, \
                                                      const float* scale, Fmt<TO>::code_t* out, size_t n, \
                                                      int vec, uint32_t* amax, unsigned long long* counts) { \
        requantize_impl<FROM, TO>(q, scale_inv, scale, out, n, vec, amax, counts);                     \
    }
REQUANTIZE(e4m3, 0, e4m3, 0)
REQUANTIZE(e4m3, 0, e5m2, 1)
REQUANTIZE(e4m3, 0, f16, 2)
REQUANTIZE(e5m2, 1, e4m3, 0)
REQUANTIZE(e5m2, 1, e5m2, 1)
REQUANTIZE(e5m2, 1, f16, 2)
REQUANTIZE(f16, 2, e4m3, 0)
REQUANTIZE(f16, 2, e5m2, 1)
REQUANTIZE(f16, 2, f16, 2)

// ------------------------------------------------ amax history and scale --
// pow2 and compute_scale (ScaleRule::compute) are in codec.cuh.

// history[0] = max(history[0], amax), NaN if either is NaN (Rust's f32::NAN).
extern "C" __global__ void record_amax(const float* hist, const float* amax, float* out, int len) {
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        float v = hist[i];
        if (i == 0) {
            const float a = *amax;
            v = (isnan(v) || isnan(a)) ? __uint_as_float(RUST_F32_NAN) : fmaxf(v, a);
        }
        out[i] = v;
    }
}

// max(a, b), NaN if either is NaN (Rust's f32::NAN): order-independent.
__device__ __forceinline__ float nan_max(float a, float b) {
    return (isnan(a) || isnan(b)) ? __uint_as_float(RUST_F32_NAN) : fmaxf(a, b);
}

// Reduce the history (algo 0 = max, 1 = most recent), roll it left by one with
// slot 0 zeroed, and derive the scale (and 1 / scale) from the reduced amax;
// `scale` is the previous scale, or null for 1.
// One block; the max over the history (TE's default length is 1024) is
// reduced by the whole block: NaN-absorbing max is order-independent, so
// the result is the CPU's sequential fold.
extern "C" __global__ void scale_update(const float* hist, const float* scale, float* out_hist,
                                        float* out_scale, float* out_scale_inv, int len, int algo,
                                        int rule, unsigned margin, float max) {
    __shared__ float s_warp[32];
    float amax = 0.0f;
    if (algo == 0) {
        for (int i = threadIdx.x; i < len; i += blockDim.x) amax = nan_max(amax, hist[i]);
        for (int o = 16; o > 0; o >>= 1) amax = nan_max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        if ((threadIdx.x & 31) == 0) s_warp[threadIdx.x >> 5] = amax;
        __syncthreads();
        if (threadIdx.x == 0) {
            amax = 0.0f;
            for (int w = 0; w < (int)(blockDim.x >> 5); w++) amax = nan_max(amax, s_warp[w]);
        }
    } else {
        amax = len > 0 ? hist[0] : 0.0f;
    }
    if (threadIdx.x == 0) {
        const float s = compute_scale(rule, amax, scale ? *scale : 1.0f, max, margin);
        *out_scale = s;
        *out_scale_inv = 1.0f / s;
    }
    // rotate_left(1), then slot 0 = 0
    for (int i = threadIdx.x; i < len; i += blockDim.x) out_hist[i] = i == 0 ? 0.0f : hist[(i + 1) % len];
}

// Up to GATHER_MAX one-element scalars, F32 or F64 (bit i of `f64_bits`
// set: pointer i is an F64), into out[0..n] as F64 (F32 widened exactly):
// many per-tensor results read to the host with one copy. The pointers
// travel as a by-value parameter (2 KiB), so nothing is copied to the
// device first.
#define GATHER_MAX 256
struct GatherPtrs {
    unsigned long long p[GATHER_MAX];
};
struct GatherBits {
    unsigned int w[GATHER_MAX / 32];
};
extern "C" __global__ void gather_scalars(GatherPtrs ptrs, GatherBits f64_bits, int n, double* out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const bool wide = (f64_bits.w[i >> 5] >> (i & 31)) & 1u;
    out[i] = wide ? *reinterpret_cast<const double*>(ptrs.p[i])
                  : (double)*reinterpret_cast<const float*>(ptrs.p[i]);
}

// scale_inv * (amax * 0 + 1): the scale_inv where the amax is finite, NaN
// where it is not (the FP8 Linear's non-finite flag, carried into a GEMM
// by its operand's scale_inv). One thread; the CPU's f32 operations.
extern "C" __global__ void flag_scale_inv(const float* scale_inv, const float* amax, float* out) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
        *out = __fmul_rn(*scale_inv, __fadd_rn(__fmul_rn(*amax, 0.0f), 1.0f));
}

// ------------------------------------------------------- decode and sum --
// The rank-order sum of up to SUM_MAX ranks' codes of one tensor's chunk,
// rank k's decoded with scale_inv[k * stride] (stride 0: one scale for
// all), then (with `average`) times inv_n plus 0:
// y = ((d0 * s0 + d1 * s1) + ..) * inv_n + 0, every product and sum one
// IEEE f32 operation in that order (no FMA): the CPU's dequantize, add and
// affine, bit for bit. y[n] and amax (bits, zeroed by the caller). The
// code pointers travel by value (512 bytes).
#define SUM_MAX 64
struct SumPtrs {
    unsigned long long p[SUM_MAX];
};
template <int FMT>
__device__ void decode_sum_impl(SumPtrs ptrs, int ranks, const float* __restrict__ scale_inv_p, int s_stride,
                                int average, float inv_n, float* __restrict__ out, size_t n, uint32_t* amax_out) {
    typedef typename Fmt<FMT>::code_t C;
    uint32_t amax = 0;
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = tid; i < n; i += stride) {
        float y = __fmul_rn(Fmt<FMT>::decode(reinterpret_cast<const C*>(ptrs.p[0])[i]), scale_inv_p[0]);
        for (int k = 1; k < ranks; k++)
            y = __fadd_rn(y, __fmul_rn(Fmt<FMT>::decode(reinterpret_cast<const C*>(ptrs.p[k])[i]),
                                       scale_inv_p[k * s_stride]));
        if (average) y = __fadd_rn(__fmul_rn(y, inv_n), 0.0f);
        out[i] = y;
        amax = max(amax, abs_bits(y));
    }
    block_flush(amax, 0, 0, amax_out, nullptr);
}
#define DECODE_SUM(FN, FMT)                                                                            \
    extern "C" __global__ void __launch_bounds__(256, 8) decode_sum_##FN(SumPtrs ptrs, int ranks,      \
            const float* scale_inv, int s_stride, int average, float inv_n, float* out, size_t n,      \
            uint32_t* amax) {                                                                          \
        decode_sum_impl<FMT>(ptrs, ranks, scale_inv, s_stride, average, inv_n, out, n, amax);          \
    }
DECODE_SUM(e4m3, 0)
DECODE_SUM(e5m2, 1)

// --------------------------------------------------- a bucket at a time --
// The per-tensor steps of a bucketed FP8 reduction for up to BUCKET_MAX
// items in one launch (blockIdx.y = the item), each bit for bit its
// one-tensor kernel: decoded amax, scale from amax, requantize, decode and
// sum, quantize. Items travel by value (BucketArgs, 2 KiB): input address,
// length, output offset, an extra address or offset, the item's tensor.
#define BUCKET_MAX 64
struct BucketArgs {
    unsigned long long src[BUCKET_MAX];
    unsigned long long len[BUCKET_MAX];
    unsigned long long out_off[BUCKET_MAX];
    unsigned long long aux[BUCKET_MAX];
    int t[BUCKET_MAX];
};
#define BUCKET_LOOP(a)                                                                                 \
    const int item = blockIdx.y;                                                                       \
    const size_t n = (size_t)(a).len[item];                                                            \
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;                                  \
    const size_t stride = (size_t)gridDim.x * blockDim.x;

// Each item's elements: a scalar head until the input is 16-byte aligned,
// units of VEC elements through 16-byte loads and stores (when the output
// is aligned there too), a scalar tail; all scalar when the two cannot be
// aligned together. `in_b`/`out_b`: bytes an element (out 0: no output).
struct Split {
    size_t head, units;
};
__device__ __forceinline__ Split split16(unsigned long long in, int in_b, unsigned long long out, int out_b,
                                         size_t n) {
    const Split scalar = {n, 0};
    if ((in & 15) % in_b) return scalar;
    const size_t head = ((16 - (in & 15)) & 15) / in_b;
    if (head >= n || ((out + head * out_b) & 15)) return scalar;
    return {head, (n - head) / VEC};
}
// VEC floats to VEC FP8 codes of TO as one 16-byte word (quantize4 four
// times: amax and counts as quantize_one).
template <int TO>
__device__ __forceinline__ uint4 quantize16(const float* f, float sc, uint32_t& amax, uint32_t& sat,
                                            uint32_t& flush) {
    uint4 w;
    w.x = quantize4<TO>(f, sc, amax, sat, flush);
    w.y = quantize4<TO>(f + 4, sc, amax, sat, flush);
    w.z = quantize4<TO>(f + 8, sc, amax, sat, flush);
    w.w = quantize4<TO>(f + 12, sc, amax, sat, flush);
    return w;
}

// u over an item's vector units, grid-stride.
#define UNITS(sp, u) for (size_t u = tid; u < (sp).units; u += stride)

// amax[t] = max |decode(q) * scale_inv| with NaN counted as inf (bits, the
// clamp commutes with the max). src: codes; aux: the scale_inv's address.
template <int FMT>
__device__ void bucket_amax_impl(BucketArgs a, uint32_t* amax_out) {
    typedef typename Fmt<FMT>::code_t C;
    BUCKET_LOOP(a)
    const C* q = reinterpret_cast<const C*>(a.src[item]);
    const float s = *reinterpret_cast<const float*>(a.aux[item]);
    uint32_t amax = 0;
    const Split sp = split16(a.src[item], sizeof(C), 0, 0, n);
    UNITS(sp, u) {
        Codes16<FMT> in;
        load_codes<FMT>(q + sp.head, u, in);
        const C* cs = reinterpret_cast<const C*>(in.w);
#pragma unroll
        for (int j = 0; j < VEC; j++) amax = max(amax, abs_bits(Fmt<FMT>::decode(cs[j]) * s));
    }
    const size_t tail = sp.head + sp.units * VEC;
    for (size_t i = tid; i < sp.head; i += stride) amax = max(amax, abs_bits(Fmt<FMT>::decode(q[i]) * s));
    for (size_t i = tail + tid; i < n; i += stride) amax = max(amax, abs_bits(Fmt<FMT>::decode(q[i]) * s));
    block_flush(min(amax, 0x7F800000u), 0, 0, amax_out + a.t[item], nullptr);
}

// out[off..] = encode(decode(q) * scale_inv * scale[t]), as requantize.
// src: codes; aux: the scale_inv's address. TO is an FP8 format.
template <int FROM, int TO>
__device__ void bucket_requantize_impl(BucketArgs a, const float* __restrict__ scale,
                                       typename Fmt<TO>::code_t* __restrict__ out) {
    typedef typename Fmt<FROM>::code_t C;
    BUCKET_LOOP(a)
    const C* q = reinterpret_cast<const C*>(a.src[item]);
    const float si = *reinterpret_cast<const float*>(a.aux[item]);
    const float sc = scale[a.t[item]];
    typename Fmt<TO>::code_t* o = out + a.out_off[item];
    uint32_t amax = 0, sat = 0, flush = 0;
    const Split sp = split16(a.src[item], sizeof(C), (unsigned long long)o, 1, n);
    UNITS(sp, u) {
        Codes16<FROM> in;
        load_codes<FROM>(q + sp.head, u, in);
        const C* cs = reinterpret_cast<const C*>(in.w);
        float f[VEC];
#pragma unroll
        for (int j = 0; j < VEC; j++) f[j] = Fmt<FROM>::decode(cs[j]) * si;
        __stcs(reinterpret_cast<uint4*>(o + sp.head) + u, quantize16<TO>(f, sc, amax, sat, flush));
    }
    const size_t tail = sp.head + sp.units * VEC;
    for (size_t i = tid; i < sp.head; i += stride) o[i] = quantize_one<TO>(Fmt<FROM>::decode(q[i]) * si, sc, amax, sat, flush);
    for (size_t i = tail + tid; i < n; i += stride) o[i] = quantize_one<TO>(Fmt<FROM>::decode(q[i]) * si, sc, amax, sat, flush);
}

// The rank-order sum of element i of the ranks' chunks, rank k's decoded
// with s[k * s_stride], times inv_n plus 0 with `average` (as decode_sum).
template <int FMT>
__device__ __forceinline__ float rank_sum(const SumPtrs& ptrs, int ranks, size_t at, const float* s,
                                          int s_stride, int average, float inv_n) {
    typedef typename Fmt<FMT>::code_t C;
    float y = __fmul_rn(Fmt<FMT>::decode(reinterpret_cast<const C*>(ptrs.p[0])[at]), s[0]);
    for (int k = 1; k < ranks; k++)
        y = __fadd_rn(y, __fmul_rn(Fmt<FMT>::decode(reinterpret_cast<const C*>(ptrs.p[k])[at]), s[k * s_stride]));
    if (average) y = __fadd_rn(__fmul_rn(y, inv_n), 0.0f);
    return y;
}

// The rank-order sum of `ranks` chunks' codes at aux.., rank k's decoded
// with scale_inv[k * s_stride + t] (s_stride 0: scale_inv[t] for every
// rank), times inv_n plus 0 with `average` (as decode_sum), and by
// MODE what becomes of it: DS_SUMS stores it at out[off..] (F32) and takes
// amax[t] of it, NaN counted as inf; DS_AMAX only takes amax[t]; DS_CODES
// stores encode(sum * scale[t]) at codes[off..] (as quantize of the stored
// sum: the same F32 value, so the same code) and takes no amax.
#define DS_SUMS 0
#define DS_AMAX 1
#define DS_CODES 2
template <int FMT, int MODE>
__device__ void bucket_decode_sum_impl(BucketArgs a, SumPtrs ptrs, int ranks, const float* __restrict__ scale_inv,
                                       int s_stride, int average, float inv_n, float* __restrict__ out,
                                       const float* __restrict__ scale, uint8_t* __restrict__ codes,
                                       uint32_t* amax_out) {
    typedef typename Fmt<FMT>::code_t C;
    BUCKET_LOOP(a)
    const float* s = scale_inv + a.t[item];
    const size_t at = (size_t)a.aux[item];
    float* o = MODE == DS_SUMS ? out + a.out_off[item] : nullptr;
    uint8_t* oc = MODE == DS_CODES ? codes + a.out_off[item] : nullptr;
    const float sc = MODE == DS_CODES ? scale[a.t[item]] : 1.0f;
    uint32_t amax = 0, qamax = 0, sat = 0, flush = 0;
    // Vector units only where every rank's chunk aligns with the first.
    Split sp = MODE == DS_SUMS   ? split16(ptrs.p[0] + at, 1, (unsigned long long)o, 4, n)
               : MODE == DS_CODES ? split16(ptrs.p[0] + at, 1, (unsigned long long)oc, 1, n)
                                  : split16(ptrs.p[0] + at, 1, 0, 0, n);
    for (int k = 1; k < ranks; k++)
        if ((ptrs.p[k] - ptrs.p[0]) & 15) sp = {n, 0};
    UNITS(sp, u) {
        const size_t base = at + sp.head + u * VEC;
        float y[VEC];
        {
            const uint4 w = __ldcs(reinterpret_cast<const uint4*>(ptrs.p[0] + base));
            const C* cs = reinterpret_cast<const C*>(&w);
#pragma unroll
            for (int j = 0; j < VEC; j++) y[j] = __fmul_rn(Fmt<FMT>::decode(cs[j]), s[0]);
        }
        for (int k = 1; k < ranks; k++) {
            const uint4 w = __ldcs(reinterpret_cast<const uint4*>(ptrs.p[k] + base));
            const C* cs = reinterpret_cast<const C*>(&w);
            const float sk = s[k * s_stride];
#pragma unroll
            for (int j = 0; j < VEC; j++) y[j] = __fadd_rn(y[j], __fmul_rn(Fmt<FMT>::decode(cs[j]), sk));
        }
        if (average) {
#pragma unroll
            for (int j = 0; j < VEC; j++) y[j] = __fadd_rn(__fmul_rn(y[j], inv_n), 0.0f);
        }
        if (MODE == DS_CODES) {
            __stcs(reinterpret_cast<uint4*>(oc + sp.head) + u, quantize16<FMT>(y, sc, qamax, sat, flush));
        } else {
#pragma unroll
            for (int j = 0; j < VEC; j++) amax = max(amax, abs_bits(y[j]));
        }
        if (MODE == DS_SUMS) {
            float4* dst = reinterpret_cast<float4*>(o + sp.head + u * VEC);
#pragma unroll
            for (int j = 0; j < VEC / 4; j++)
                __stcs(dst + j, make_float4(y[4 * j], y[4 * j + 1], y[4 * j + 2], y[4 * j + 3]));
        }
    }
    const size_t tail = sp.head + sp.units * VEC;
    for (size_t r = 0; r < 2; r++) {
        const size_t lo = r == 0 ? 0 : tail, hi = r == 0 ? sp.head : n;
        for (size_t i = lo + tid; i < hi; i += stride) {
            const float y = rank_sum<FMT>(ptrs, ranks, at + i, s, s_stride, average, inv_n);
            if (MODE == DS_SUMS) o[i] = y;
            if (MODE == DS_CODES) {
                oc[i] = quantize_one<FMT>(y, sc, qamax, sat, flush);
            } else {
                amax = max(amax, abs_bits(y));
            }
        }
    }
    if (MODE != DS_CODES) block_flush(min(amax, 0x7F800000u), 0, 0, amax_out + a.t[item], nullptr);
}

// out[off..] = encode(x * scale[t]), as quantize. src: F32 values.
template <int TO>
__device__ void bucket_quantize_impl(BucketArgs a, const float* __restrict__ scale,
                                     typename Fmt<TO>::code_t* __restrict__ out) {
    BUCKET_LOOP(a)
    const float* x = reinterpret_cast<const float*>(a.src[item]);
    const float sc = scale[a.t[item]];
    typename Fmt<TO>::code_t* o = out + a.out_off[item];
    uint32_t amax = 0, sat = 0, flush = 0;
    const Split sp = split16(a.src[item], 4, (unsigned long long)o, 1, n);
    UNITS(sp, u) {
        float f[VEC];
        const float4* src = reinterpret_cast<const float4*>(x + sp.head + u * VEC);
#pragma unroll
        for (int j = 0; j < VEC / 4; j++) {
            const float4 v = __ldcs(src + j);
            f[4 * j] = v.x;
            f[4 * j + 1] = v.y;
            f[4 * j + 2] = v.z;
            f[4 * j + 3] = v.w;
        }
        __stcs(reinterpret_cast<uint4*>(o + sp.head) + u, quantize16<TO>(f, sc, amax, sat, flush));
    }
    const size_t tail = sp.head + sp.units * VEC;
    for (size_t i = tid; i < sp.head; i += stride) o[i] = quantize_one<TO>(x[i], sc, amax, sat, flush);
    for (size_t i = tail + tid; i < n; i += stride) o[i] = quantize_one<TO>(x[i], sc, amax, sat, flush);
}

#define BUCKET_FMT(FN, FMT)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) bucket_amax_##FN(BucketArgs a, uint32_t* amax) {  \
        bucket_amax_impl<FMT>(a, amax);                                                                \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bucket_requantize_##FN(BucketArgs a,             \
            const float* scale, uint8_t* out) {                                                        \
        bucket_requantize_impl<FMT, FMT>(a, scale, out);                                               \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bucket_decode_sum_##FN(BucketArgs a, SumPtrs ptrs, \
            int ranks, const float* scale_inv, int s_stride, int average, float inv_n, float* out,     \
            uint32_t* amax) {                                                                          \
        bucket_decode_sum_impl<FMT, DS_SUMS>(a, ptrs, ranks, scale_inv, s_stride, average, inv_n, out, \
                                             nullptr, nullptr, amax);                                  \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bucket_decode_amax_##FN(BucketArgs a, SumPtrs ptrs, \
            int ranks, const float* scale_inv, int s_stride, int average, float inv_n, uint32_t* amax) { \
        bucket_decode_sum_impl<FMT, DS_AMAX>(a, ptrs, ranks, scale_inv, s_stride, average, inv_n,      \
                                             nullptr, nullptr, nullptr, amax);                         \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bucket_decode_quantize_##FN(BucketArgs a,        \
            SumPtrs ptrs, int ranks, const float* scale_inv, int s_stride, int average, float inv_n,   \
            const float* scale, uint8_t* out) {                                                        \
        bucket_decode_sum_impl<FMT, DS_CODES>(a, ptrs, ranks, scale_inv, s_stride, average, inv_n,     \
                                              nullptr, scale, out, nullptr);                           \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bucket_quantize_##FN(BucketArgs a,               \
            const float* scale, uint8_t* out) {                                                        \
        bucket_quantize_impl<FMT>(a, scale, out);                                                      \
    }
BUCKET_FMT(e4m3, 0)
BUCKET_FMT(e5m2, 1)

// scale[t], scale_inv[t] from amax[t] as scale_update with MostRecent and
// no previous scale (ScalingMeta::for_current_amax), for n tensors.
extern "C" __global__ void bucket_scales(const float* amax, float* scale, float* scale_inv, int n, int rule,
                                         unsigned margin, float max) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float s = compute_scale(rule, amax[i], 1.0f, max, margin);
    scale[i] = s;
    scale_inv[i] = 1.0f / s;
}

// out[t] = scale_inv_t * (amax_t * 0 + 1) for the `count` items of a
// launch (a.src: scale_inv, a.aux: amax, a.t: t; one element each): each
// tensor's scale_inv, NaN where its amax is not finite (flag_scale_inv a
// bucket at a time).
extern "C" __global__ void bucket_flag_scale_inv(BucketArgs a, int count, float* out) {
    const int i = threadIdx.x;
    if (i >= count) return;
    const float s = *reinterpret_cast<const float*>(a.src[i]);
    const float m = *reinterpret_cast<const float*>(a.aux[i]);
    out[a.t[i]] = __fmul_rn(s, __fadd_rn(__fmul_rn(m, 0.0f), 1.0f));
}

// out[c] = max over the rows r of m[r * cols + start + c], NaN counted as
// inf (values at least 0: amaxes), from 0 in row order (the CPU's fold).
extern "C" __global__ void bucket_column_max(const float* m, int rows, int cols, int start, int count,
                                             float* out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= count) return;
    float acc = 0.0f;
    for (int r = 0; r < rows; r++) {
        float x = m[(size_t)r * cols + start + c];
        if (x != x) x = __int_as_float(0x7f800000);
        if (x > acc) acc = x;
    }
    out[c] = acc;
}

// What a rank sends with its codes, for the `count` items of a launch
// (a.src: scale_inv, a.aux: amax, a.out_off: scale, one F32 each; a.t:
// the tensor): out[t] = scale_inv * (amax * 0 + 1), NaN where the amax
// is not finite; out[total + t] = decode(encode(amax * scale)) *
// scale_inv * (amax * 0 + 1), the largest decoded value of codes cast
// from values at most amax with that scale (as quantize_one casts them;
// NaN where the amax is not finite).
template <int FMT>
__device__ void scales_sent_impl(const BucketArgs& a, int count, int total, float* out) {
    const int i = threadIdx.x;
    if (i >= count) return;
    const float s = *reinterpret_cast<const float*>(a.src[i]);
    const float m = *reinterpret_cast<const float*>(a.aux[i]);
    const float sc = *reinterpret_cast<const float*>(a.out_off[i]);
    const float flag = __fadd_rn(__fmul_rn(m, 0.0f), 1.0f);
    const int t = a.t[i];
    out[t] = __fmul_rn(s, flag);
    const float v = m * sc;
    out[total + t] = __fmul_rn(__fmul_rn(Fmt<FMT>::decode(Fmt<FMT>::encode(v)), s), flag);
}
extern "C" __global__ void bucket_scales_sent_e4m3(BucketArgs a, int count, int total, float* out) {
    scales_sent_impl<0>(a, count, total, out);
}
extern "C" __global__ void bucket_scales_sent_e5m2(BucketArgs a, int count, int total, float* out) {
    scales_sent_impl<1>(a, count, total, out);
}
extern "C" __global__ void bucket_scales_sent_f16(BucketArgs a, int count, int total, float* out) {
    scales_sent_impl<2>(a, count, total, out);
}

// out[c] = (sum over the rows r of m[r * cols + start + c], NaN counted as
// inf, from 0 in row order) * factor, then with `average` times inv_n plus
// 0: a bound of the amax of the ranks' mean from their amaxes (one IEEE
// f32 operation at a time, as the CPU).
extern "C" __global__ void bucket_mean_bound(const float* m, int rows, int cols, int start, int count,
                                             float factor, int average, float inv_n, float* out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= count) return;
    float acc = 0.0f;
    for (int r = 0; r < rows; r++) {
        float x = m[(size_t)r * cols + start + c];
        if (x != x) x = __int_as_float(0x7f800000);
        acc = __fadd_rn(acc, x);
    }
    acc = __fmul_rn(acc, factor);
    if (average) acc = __fadd_rn(__fmul_rn(acc, inv_n), 0.0f);
    out[c] = acc;
}

// out[i] = max(a[i], b[i]) for two amax vectors without NaN (the CPU's
// `if b > a { b } else { a }`).
extern "C" __global__ void bucket_max(const float* a, const float* b, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = b[i] > a[i] ? b[i] : a[i];
}

// FP16 masters (ZeRO's slices) to the FP8 copy's codes: their amax, their
// re-cast to E4M3; and a bucket's bytes moved piece by piece (the gathered
// ranks' slices back into tensor order).
extern "C" __global__ void __launch_bounds__(256) bucket_amax_f16(BucketArgs a, uint32_t* amax) {
    bucket_amax_impl<2>(a, amax);
}
extern "C" __global__ void __launch_bounds__(256) bucket_requantize_f16_e4m3(BucketArgs a, const float* scale,
                                                                              uint8_t* out) {
    bucket_requantize_impl<2, 0>(a, scale, out);
}
// Each item's bytes to out + out_off: 16 a store where the two line up.
extern "C" __global__ void __launch_bounds__(256) bucket_copy_u8(BucketArgs a, uint8_t* out) {
    BUCKET_LOOP(a)
    const uint8_t* s = reinterpret_cast<const uint8_t*>(a.src[item]);
    uint8_t* o = out + a.out_off[item];
    const Split sp = split16(a.src[item], 1, reinterpret_cast<unsigned long long>(o), 1, n);
    const uint4* sv = reinterpret_cast<const uint4*>(s + sp.head);
    uint4* ov = reinterpret_cast<uint4*>(o + sp.head);
    UNITS(sp, u) ov[u] = sv[u];
    for (size_t i = tid; i < sp.head; i += stride) o[i] = s[i];
    for (size_t i = sp.head + sp.units * VEC + tid; i < n; i += stride) o[i] = s[i];
}

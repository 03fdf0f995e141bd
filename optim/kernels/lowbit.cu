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
// returns 0x7FFFFFFF). The gradient multiplier is read from the device
// (`gmul`, written by grad_clip of clip.cuh); where it is NaN the
// step is skipped and every kernel returns at once (a weight updated in
// place keeps its values; the host drops the other outputs).
//
// The step is two launches (justification in optim/src/cuda.rs), or both
// in one launch of one block for a small tensor (lowbit_one):
//   lowbit_step: decode every stream, update in registers, encode every
//                output with its *expected* scale (the previous one: 1 /
//                scale_inv of the input stream), and fold the amax of the
//                new weight, m and v (bits of |x|, NaN above inf, as the
//                CPU's integer max) into three atomics per block.
//   lowbit_fix:  the final scales from those amaxes (ScaleRule::PowerOfTwo,
//                the previous scale where the amax is 0 or not finite), as
//                the CPU takes them; block 0 writes them. Where a final
//                scale equals the expected one, pass 1 already wrote the
//                right codes and every block returns at once; otherwise the
//                same update is recomputed (same instructions, same bits)
//                and only the streams whose scale moved are rewritten.
// So the codes always come from the scale of the whole updated tensor's
// amax, as on the CPU, and a step whose scales stay put reads and writes
// each stream once.
//
// The element codecs (decode and encode of each stream kind K_E4M3, K_E5M2,
// K_F16, K_F32 (and K_E4M3_SQRT's roots, below, as K_E4M3) with amp-core's saturating round-to-nearest-even casts, one
// element at a time and packed), the format constants and the
// power-of-two scale rule are amp-core's, shared with the cast kernels.
#include "../../amp-core/kernels/codec.cuh"

// The running amax as f32: max(a, |x|), NaN above everything (max.NaN
// returns the canonical NaN), so its bits are the CPU's integer max of
// |x|'s bits wherever no NaN payload differs.
__device__ __forceinline__ float amax_fold(float a, float x) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(fabsf(x)));
    return r;
}

// AdamStep of optim/src/adamw.rs (field order), plus the gradient multiplier.
struct Adam {
    float lr_wd, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, grad_mul;
};

// AdamStep::update for one element, operation by operation: the moments
// (from the gradient and themselves only), then the weight (from itself
// and the new moments); the same operations as one sequence, so a pass
// that needs only the moments skips the weight's (its two divisions and
// square root). Where both run, adam_mv then adam_p. The CPU multiplies
// by grad_mul only where it is not 1; here always, one code path: x * 1 is
// x for every non-NaN x (and a NaN gradient skips the step).
__device__ __forceinline__ void adam_mv(const Adam& k, float g, float& m, float& v) {
    g = __fmul_rn(g, k.grad_mul);
    m = __fadd_rn(m, __fmul_rn(k.one_minus_beta1, __fsub_rn(g, m)));
    v = __fadd_rn(__fmul_rn(v, k.beta2), __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g));
}
// The weight's update from m and r = sqrt(v) (the square root the CPU's
// AdamStep::update takes, computed once: adam_p's bits).
__device__ __forceinline__ void adam_p_root(const Adam& k, float& p, float m, float r) {
    p = __fsub_rn(p, __fmul_rn(p, k.lr_wd));
    const float denom = __fadd_rn(__fdiv_rn(r, k.bc2_sqrt), k.eps);
    p = __fadd_rn(p, __fmul_rn(-k.step_size, __fdiv_rn(m, denom)));
}
__device__ __forceinline__ void adam_p(const Adam& k, float& p, float m, float v) {
    adam_p_root(k, p, m, __fsqrt_rn(v));
}

// A v stream of this kind holds the second moment's square roots as E4M3
// (StateFormat::E4M3Sqrt): decoded roots are squared before adam_mv, the
// new v's root is what the amax, the scale and the codes are taken from,
// rounded stochastically to the codes (a positive root never to zero).
// Its codec is K_E4M3's.
#define K_E4M3_SQRT 4
__device__ __forceinline__ int codec_kind(int kind) { return kind == K_E4M3_SQRT ? K_E4M3 : kind; }
// random_bits and stochastic_root of optim/src/state.rs, operation by
// operation: a root rounded stochastically to E4M3's grid at `scale`, at
// least the smallest code (exact results: the encode rounds nothing).
__device__ __forceinline__ uint32_t mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    return h ^ (h >> 16);
}
__device__ __forceinline__ uint32_t random_bits(size_t i, uint32_t salt) {
    return mix32((uint32_t)i ^ mix32((uint32_t)((unsigned long long)i >> 32) ^ mix32(salt)));
}
__device__ __forceinline__ float stochastic_root(float r, float scale, size_t i, uint32_t salt) {
    const float y = __fmul_rn(r, scale);
    if (!(y > 0.0f && y <= 3.402823466e38f)) return r;
    const uint32_t bits = random_bits(i, salt);
    float rounded;
    if (y < 1.0f / 64.0f) {
        const float t = __fmul_rn(y, 512.0f);
        const float u = __fmul_rn((float)(bits >> 8), 1.0f / 16777216.0f);
        rounded = __fdiv_rn(floorf(__fadd_rn(t, u)), 512.0f);
    } else {
        rounded = __uint_as_float((__float_as_uint(y) + (bits >> 12)) & ~0xFFFFFu);
    }
    // a positive root stays positive, whatever it rounded to
    return fmaxf(__fdiv_rn(rounded, scale), __fdiv_rn(1.0f / 512.0f, scale));
}

#include "groups.cuh"

// The blocks a tensor's sweep spreads over: the launch's grid, or one
// block of a launch over many tensors (`lowbit_multi`, a tensor a block).
struct Grid { size_t block, blocks; };
__device__ __forceinline__ Grid grid_of_launch() { return {blockIdx.x, gridDim.x}; }

// Raw groups of the four input streams.
struct Raw4 { uint4 w, g, m, v; };

struct Streams {
    const void *w, *g, *m, *v;
    const float *w_si, *g_si, *m_si, *v_si;
    int wk, gk, mk, vk;
    uint32_t salt;  // stochastic rounding of K_E4M3_SQRT roots
};

struct Outs {
    void *w, *m, *v;
    uint8_t* copy;  // E4M3 copy of the weight, or null
    // scale, scale_inv and amax after the step of w, m, v and the copy (1
    // element each; the copy's only with a copy)
    float* meta[12];
};

// The scale each output is encoded with, and which outputs to write.
struct Enc {
    float w, m, v, copy;
    bool ww, wm, wv, wc;
};

// The input streams a pass needs for the outputs `e` writes: the weight
// only where the weight or its copy is written; m and v for their own
// output and for the weight's (m and v do not depend on the weight or on
// each other). Pass 2 rewriting only m reads the gradient and m. A stream
// left out decodes as zeros, and nothing computed from it is stored.
struct Need { bool w, m, v; };
__device__ __forceinline__ Need needs(const Enc& e) {
    const bool w = e.ww || e.wc;
    return {w, w || e.wm, w || e.wv};
}

template <int GS>
__device__ __forceinline__ uint4 load_any(const void* p, int kind, size_t gi) {
    if constexpr (GS == 8) return load_raw8(p, kind, gi);
    else return load_raw(p, kind, gi);
}
template <int GS>
__device__ __forceinline__ Raw4 load_group(const Streams& s, size_t gi, Need nd) {
    const uint4 z = make_uint4(0, 0, 0, 0);
    return {nd.w ? load_any<GS>(s.w, s.wk, gi) : z, load_any<GS>(s.g, s.gk, gi),
            nd.m ? load_any<GS>(s.m, s.mk, gi) : z, nd.v ? load_any<GS>(s.v, codec_kind(s.vk), gi) : z};
}

// Update one group from its raw inputs; write the outputs `e` selects; fold
// the amaxes.
template <int GS>
__device__ __forceinline__ void decode_any(uint4 r, int kind, float si, float x[GS]) {
    if constexpr (GS == 8) decode_raw8(r, kind, si, x);
    else decode_raw(r, kind, si, x);
}
template <int GS>
__device__ __forceinline__ void store_any(void* p, int kind, float scale, size_t gi, const float x[GS]) {
    if constexpr (GS == 8) store_group8(p, kind, scale, gi, x);
    else store_group(p, kind, scale, gi, x);
}
template <int GS>
__device__ __forceinline__ void update_group(const Streams& s, const Adam& k, const float si[4], const Raw4& r,
                                             const Outs& o, const Enc& e, size_t gi, float& wa, float& ma,
                                             float& va) {
    float p[GS], g[GS], m[GS], v[GS];
    const bool sq = s.vk == K_E4M3_SQRT;
    decode_any<GS>(r.w, s.wk, si[0], p);
    decode_any<GS>(r.g, s.gk, si[1], g);
    decode_any<GS>(r.m, s.mk, si[2], m);
    decode_any<GS>(r.v, codec_kind(s.vk), si[3], v);
    const Need nd = needs(e);
#pragma unroll
    for (int j = 0; j < GS; j++) {
        if (sq) v[j] = __fmul_rn(v[j], v[j]);
        adam_mv(k, g[j], m[j], v[j]);
        if (sq) {
            v[j] = __fsqrt_rn(v[j]);
            if (nd.w) adam_p_root(k, p[j], m[j], v[j]);
        } else if (nd.w) {
            adam_p(k, p[j], m[j], v[j]);
        }
        wa = amax_fold(wa, p[j]);
        ma = amax_fold(ma, m[j]);
        va = amax_fold(va, v[j]);
    }
    if (e.ww) store_any<GS>(o.w, s.wk, e.w, gi, p);
    if (e.wm) store_any<GS>(o.m, s.mk, e.m, gi, m);
    if (e.wv) {
        if (sq) {
#pragma unroll
            for (int j = 0; j < GS; j++) v[j] = stochastic_root(v[j], e.v, gi * GS + j, s.salt);
        }
        store_any<GS>(o.v, codec_kind(s.vk), e.v, gi, v);
    }
    if (e.wc) store_any<GS>(o.copy, K_E4M3, e.copy, gi, p);
}

// Element i alone (the tail, and every element when a stream is not
// aligned for the group accesses).
__device__ __forceinline__ void update_one(const Streams& s, const Adam& k, const float si[4], const Outs& o,
                                           const Enc& e, size_t i, float& wa, float& ma, float& va) {
    const Need nd = needs(e);
    float p = nd.w ? load(s.w, s.wk, si[0], i) : 0.0f;
    const float g = load(s.g, s.gk, si[1], i);
    float m = nd.m ? load(s.m, s.mk, si[2], i) : 0.0f;
    const bool sq = s.vk == K_E4M3_SQRT;
    float v = nd.v ? load(s.v, codec_kind(s.vk), si[3], i) : 0.0f;
    if (sq) v = __fmul_rn(v, v);
    adam_mv(k, g, m, v);
    if (sq) {
        v = __fsqrt_rn(v);
        if (nd.w) adam_p_root(k, p, m, v);
    } else if (nd.w) {
        adam_p(k, p, m, v);
    }
    wa = amax_fold(wa, p);
    ma = amax_fold(ma, m);
    va = amax_fold(va, v);
    if (e.ww) store(o.w, s.wk, e.w, i, p);
    if (e.wm) store(o.m, s.mk, e.m, i, m);
    if (e.wv) store(o.v, codec_kind(s.vk), e.v, i, sq ? stochastic_root(v, e.v, i, s.salt) : v);
    if (e.wc) store(o.copy, K_E4M3, e.copy, i, p);
}

// Every element once, F groups of GS elements in flight per thread. `vec`:
// every stream 16-byte aligned.
template <int F, int GS>
__device__ __forceinline__ void sweep(const Streams& s, const Adam& k, size_t n, int vec, const Outs& o,
                                      const Enc& e, float& wa, float& ma, float& va, Grid gr) {
    const float si[4] = {*s.w_si, *s.g_si, *s.m_si, *s.v_si};
    const size_t tid = gr.block * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gr.blocks * blockDim.x;
    const Need nd = needs(e);
    const size_t groups = vec ? n / GS : 0;
    size_t gi = tid;
    for (; gi + (F - 1) * stride < groups; gi += F * stride) {
        Raw4 r[F];
#pragma unroll
        for (int f = 0; f < F; f++) r[f] = load_group<GS>(s, gi + f * stride, nd);
#pragma unroll
        for (int f = 0; f < F; f++) update_group<GS>(s, k, si, r[f], o, e, gi + f * stride, wa, ma, va);
    }
    for (; gi < groups; gi += stride) update_group<GS>(s, k, si, load_group<GS>(s, gi, nd), o, e, gi, wa, ma, va);
    for (size_t i = groups * GS + tid; i < n; i += stride) update_one(s, k, si, o, e, i, wa, ma, va);
}

// The stream kinds fixed at compile time (-1: the runtime kind), so the
// kind switches fold and a raw group holds only the bytes of its kind.
template <int WK, int GK, int MK, int VK>
__device__ __forceinline__ Streams fixed(Streams s) {
    if (WK >= 0) s.wk = WK;
    if (GK >= 0) s.gk = GK;
    if (MK >= 0) s.mk = MK;
    if (VK >= 0) s.vk = VK;
    return s;
}

// The scale of an output stream before the step: 1 for F32; 1 / scale_inv
// (1 where scale_inv <= 0) otherwise, the fallback of out_scale.
__device__ __forceinline__ float prev_scale(int kind, float si) {
    if (kind == K_F32) return 1.0f;
    return si > 0.0f ? __fdiv_rn(1.0f, si) : 1.0f;
}

// The scale of an output stream after the step, from its new amax.
__device__ __forceinline__ float out_scale(int kind, float amax, float prev_si) {
    if (kind == K_F32) return 1.0f;
    return pow2_scale(amax, prev_scale(kind, prev_si), kind_max(kind));
}

// Pass 1: encode with the expected scales, amax bits into amax[0..3]
// (zeroed by the caller). copy_si: the E4M3 copy's scale_inv before the
// step (only its expected scale; without a copy it is never read).
// Two groups in flight where the kinds are fixed; one for the runtime-kind
// kernel (whose raw groups are 16 bytes a stream: two would spill).
// Kernels whose kinds are fixed and none F32 take 8-element groups, one in
// flight (the same bytes as two groups of 4).
#define WIDE(WK, GK, MK, VK)                                                                               \
    ((WK) >= 0 && (GK) >= 0 && (MK) >= 0 && (VK) >= 0 && (WK) != K_F32 && (GK) != K_F32 && (MK) != K_F32 && \
     (VK) != K_F32)
#define INFLIGHT(WK, GK, MK, VK) (WIDE(WK, GK, MK, VK) ? 1 : (WK) >= 0 && (GK) >= 0 && (MK) >= 0 && (VK) >= 0 ? 2 : 1)
#define GROUP(WK, GK, MK, VK) (WIDE(WK, GK, MK, VK) ? 8 : G)

template <int WK, int GK, int MK, int VK>
__device__ void step_impl(Streams s0, Adam k, size_t n, int vec, const float* copy_si, Outs o, uint32_t* amax,
                          Grid gr) {
    if (isnan(k.grad_mul)) return;
    const Streams s = fixed<WK, GK, MK, VK>(s0);
    const Enc e = {prev_scale(s.wk, *s.w_si), prev_scale(s.mk, *s.m_si), prev_scale(codec_kind(s.vk), *s.v_si),
                   o.copy ? prev_scale(K_E4M3, *copy_si) : 1.0f, true, true, true, o.copy != nullptr};
    float fw = 0.0f, fm = 0.0f, fv = 0.0f;
    sweep<INFLIGHT(WK, GK, MK, VK), GROUP(WK, GK, MK, VK)>(s, k, n, vec, o, e, fw, fm, fv, gr);
    // non-negative f32 or the canonical NaN: their bits order as they do
    uint32_t wa = __float_as_uint(fw), ma = __float_as_uint(fm), va = __float_as_uint(fv);
    for (int off = 16; off > 0; off >>= 1) {
        wa = max(wa, __shfl_xor_sync(0xFFFFFFFFu, wa, off));
        ma = max(ma, __shfl_xor_sync(0xFFFFFFFFu, ma, off));
        va = max(va, __shfl_xor_sync(0xFFFFFFFFu, va, off));
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
        for (int off = 16; off > 0; off >>= 1) {
            wa = max(wa, __shfl_xor_sync(0xFFFFFFFFu, wa, off));
            ma = max(ma, __shfl_xor_sync(0xFFFFFFFFu, ma, off));
            va = max(va, __shfl_xor_sync(0xFFFFFFFFu, va, off));
        }
        if (lane == 0) {
            if (wa) atomicMax(&amax[0], wa);
            if (ma) atomicMax(&amax[1], ma);
            if (va) atomicMax(&amax[2], va);
        }
    }
}

// Pass 2: the final scales; rewrite the streams whose scale is not the one
// pass 1 used.
template <int WK, int GK, int MK, int VK>
__device__ void fix_impl(Streams s0, Adam k, size_t n, int vec, const float* copy_si, const uint32_t* amax, Outs o,
                         Grid gr) {
    if (isnan(k.grad_mul)) return;
    const Streams s = fixed<WK, GK, MK, VK>(s0);
    const float wsi = *s.w_si, msi = *s.m_si, vsi = *s.v_si;
    const float wa = __uint_as_float(amax[0]), ma = __uint_as_float(amax[1]), va = __uint_as_float(amax[2]);
    const int vc = codec_kind(s.vk);
    const float ws = out_scale(s.wk, wa, wsi), ms = out_scale(s.mk, ma, msi), vs = out_scale(vc, va, vsi);
    const float cs = pow2_scale(wa, 1.0f, E4M3_MAX);
    if (gr.block == 0 && threadIdx.x == 0) {
        const float scale[4] = {ws, ms, vs, cs}, amaxes[4] = {wa, ma, va, wa};
        for (int j = 0; j < (o.copy ? 4 : 3); j++) {
            *o.meta[3 * j] = scale[j];
            *o.meta[3 * j + 1] = __fdiv_rn(1.0f, scale[j]);
            *o.meta[3 * j + 2] = amaxes[j];
        }
    }
    const Enc e = {ws, ms, vs, cs, ws != prev_scale(s.wk, wsi), ms != prev_scale(s.mk, msi),
                   vs != prev_scale(vc, vsi), o.copy != nullptr && cs != prev_scale(K_E4M3, *copy_si)};
    if (!(e.ww || e.wm || e.wv || e.wc)) return;
    float a = 0.0f, b = 0.0f, c = 0.0f;
    sweep<INFLIGHT(WK, GK, MK, VK), GROUP(WK, GK, MK, VK)>(s, k, n, vec, o, e, a, b, c, gr);
}

// Both passes in one launch of one block, for a small tensor: the block's
// amax atomics are visible to all of its threads after the barrier, and
// each thread rewrites only the groups it wrote (the same sweep), so the
// result is the two launches' bit for bit.
template <int WK, int GK, int MK, int VK>
__device__ void one_impl(Streams s, Adam k, size_t n, int vec, const float* copy_si, Outs o, uint32_t* amax) {
    const Grid one = {0, 1};
    // the amax words start at zero here (the host zeroes them only for the
    // two-launch step)
    if (threadIdx.x < 3) amax[threadIdx.x] = 0u;
    __syncthreads();
    step_impl<WK, GK, MK, VK>(s, k, n, vec, copy_si, o, amax, one);
    __syncthreads();
    fix_impl<WK, GK, MK, VK>(s, k, n, vec, copy_si, amax, o, one);
}

// lowbit_step_NAME / lowbit_fix_NAME / lowbit_one_NAME (the same
// parameters, so the host launches them alike): NAME lists the kinds (w,
// g, m, v) of the combinations the levels use; `any` takes them at run
// time.
// `gmul`: the gradient multiplier (one f32 on the device), read into k.
// An F32 weight may be updated in place (o.w == s.w): each thread reads a
// group before writing it, and pass 2 never rewrites an F32 stream (its
// scale is always 1) while m and v do not depend on the weight.
#define LOWBIT(NAME, WK, GK, MK, VK)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, 4)                                               \
        lowbit_step_##NAME(Streams s, Adam k, const float* gmul, size_t n, int vec, const float* copy_si, \
                           Outs o, uint32_t* amax) {                                                    \
        k.grad_mul = *gmul;                                                                            \
        step_impl<WK, GK, MK, VK>(s, k, n, vec, copy_si, o, amax, grid_of_launch());                   \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 4)                                               \
        lowbit_fix_##NAME(Streams s, Adam k, const float* gmul, size_t n, int vec, const float* copy_si,  \
                          Outs o, uint32_t* amax) {                                                     \
        k.grad_mul = *gmul;                                                                            \
        fix_impl<WK, GK, MK, VK>(s, k, n, vec, copy_si, amax, o, grid_of_launch());                    \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 4)                                               \
        lowbit_one_##NAME(Streams s, Adam k, const float* gmul, size_t n, int vec, const float* copy_si,  \
                          Outs o, uint32_t* amax) {                                                     \
        k.grad_mul = *gmul;                                                                            \
        one_impl<WK, GK, MK, VK>(s, k, n, vec, copy_si, o, amax);                                      \
    }
LOWBIT(any, -1, -1, -1, -1)
LOWBIT(2002, K_F16, K_E4M3, K_E4M3, K_F16)
LOWBIT(2033, K_F16, K_E4M3, K_F32, K_F32)
LOWBIT(3302, K_F32, K_F32, K_E4M3, K_F16)
LOWBIT(3333, K_F32, K_F32, K_F32, K_F32)
LOWBIT(2004, K_F16, K_E4M3, K_E4M3, K_E4M3_SQRT)
LOWBIT(3304, K_F32, K_F32, K_E4M3, K_E4M3_SQRT)

#include "sumsq.cuh"
#include "sumsq_many.cuh"
#include "clip.cuh"
#include "restore.cuh"
#include "multi.cuh"
#include "codec_ops.cuh"

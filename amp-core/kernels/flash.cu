// Causal flash attention for BF16 q, k, v with a head dimension HD of 64,
// 80, 96 or 128 (kernels `..._hd64` etc., one instantiation each):
// softmax(scale * q kᵀ + mask) v, one (batch, head, 64-row tile) per block,
// the scores and probabilities never leave the registers (FlashAttention-2,
// Dao 2023). Forward writes the output and, per query row, the log-sum-exp
// in log2 units (`lse2 = m + log2(l)`, `m` the row max of `scale * log2(e)
// * s`); backward recomputes the probabilities from it.
//
// Layout: q, k, v (and dq, dk, dv) share strides (batch, head, row) in
// elements with the head dimension contiguous, so the same kernels read a
// fused projection's rows `[b, t, (heads + 2 kv_heads) * HD]` in place (q,
// k, v at column offsets 0, heads * HD, (heads + kv_heads) * HD) or
// separate `[b, heads, t, HD]` tensors; o and do share theirs. Every base
// and row must be 16-byte aligned (the host checks).
//
// Grouped-query attention: `group` query heads share a key/value head
// (query head h reads k, v head h / group; 1 for plain multi-head). In
// backward the key blocks of a group's first head accumulate dK, dV over
// all the group's query heads (in F32 registers, one rounding to BF16 at
// the end) and those of the group's other heads have nothing to do.
//
// Products: mma.sync m16n8k16 BF16 -> F32 from ldmatrix fragments; tiles
// of 64 rows x HD columns in shared memory (rows padded to 64 or 128
// elements) with the 16-byte chunks of row r XOR-swizzled by r % 8 (no
// bank conflicts for ldmatrix), in dynamic shared memory (the host sizes
// it: `flash_smem_bytes` below); the next key
// (or query) tile is fetched by cp.async while this one is used. Four
// warps, 16 rows each. Rows past the sequence read as zeros; the mask
// keeps them out of every valid row.
//
// Backward is one launch of two kinds of blocks: the first `tiles` blocks
// of x own a key tile and accumulate dK, dV over the query tiles at or
// below it; the others own a query tile and accumulate dQ over the key
// tiles at or above it (no atomics; the scores are computed twice). `D =
// rowsum(do * o)` comes first from `flash_bwd_dot`. Above HD 64 the
// backward's stationary tiles (k and v, or q and do) stay in shared memory
// and their A fragments are read from there at each use instead of held in
// registers, which would spill.
//
// Shared memory a block takes (bytes, the host's `smem_bytes` mirrors it):
// forward 5 tiles, backward 4 tiles (6 above HD 64), a tile 64 x ROW x 2.

#include "flash.cuh"

// ---------------------------------------------------------------------------
// Forward. Grid (tiles, heads, batch); block x takes query tile
// tiles - 1 - x (the longest first).

extern __shared__ __align__(128) unsigned char flash_smem[];

template <int HD>
__device__ __forceinline__ void flash_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                          const bf16* __restrict__ v, long long sb, long long sh, long long st,
                                          bf16* __restrict__ o, long long ob, long long oh, long long ot,
                                          float* __restrict__ lse2, int T, int group, float scale_log2) {
    using G = Geo<HD>;
    // q, then k and v double-buffered: k of buffer c at 1 + c, v at 3 + c
    bf16* sQ = reinterpret_cast<bf16*>(flash_smem);
    auto sK = [&](int c) { return sQ + (1 + c) * G::ELEMS; };
    auto sV = [&](int c) { return sQ + (3 + c) * G::ELEMS; };
    const int tiles = (T + TILE - 1) / TILE;
    const int qt = tiles - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const long long off = (long long)b * sb + (long long)h * sh;
    const long long koff = (long long)b * sb + (long long)(h / group) * sh;
    const bf16 *qg = q + off, *kg = k + koff, *vg = v + koff;
    const int q0 = qt * TILE;
    load_tile<HD>(sQ, qg, st, q0, T);
    load_tile<HD>(sK(0), kg, st, 0, T);
    load_tile<HD>(sV(0), vg, st, 0, T);
    cp_commit();

    float acc[G::NJ][4];
    zero(acc);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    uint32_t qa[G::KS][4];
    const int row = q0 + w * 16 + (lane >> 2);  // rows of c[.][0..1]; + 8 for c[.][2..3]
    for (int kt = 0; kt <= qt; ++kt) {
        const int cur = kt & 1;
        if (kt < qt) {
            load_tile<HD>(sK(cur ^ 1), kg, st, (kt + 1) * TILE, T);
            load_tile<HD>(sV(cur ^ 1), vg, st, (kt + 1) * TILE, T);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        if (kt == 0)
#pragma unroll
            for (int kk = 0; kk < G::KS; ++kk) frag_a<HD>(qa[kk], sQ, w * 16, kk, lane);
        float s[8][4];
        zero(s);
        mma_tile<HD, true, G::KS, 8>(s, qa, sK(cur), lane);
        const int key0 = kt * TILE + 2 * (lane & 3);
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[j][e] * scale_log2;
                if (kt == qt && key0 + 8 * j + (e & 1) > row + ((e >> 1) << 3)) x = -INFINITY;
                s[j][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            alpha[r] = exp2f(m[r] - mx[r]);
            m[r] = mx[r];
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[j][e] - m[e >> 1]);
                s[j][e] = p;
                l[e >> 1] += p;
            }
#pragma unroll
        for (int j = 0; j < G::NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] *= alpha[e >> 1];
        mma_acc_rows_k<HD>(acc, s, sV(cur), lane);
        __syncthreads();
    }
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv[r] = 1.0f / l[r];
    }
    store_rows(o + (long long)b * ob + (long long)h * oh, ot, row, T, acc, inv[0], inv[1], lane);
    if ((lane & 3) == 0) {
        float* lrow = lse2 + ((long long)b * H + h) * T;
        if (row < T) lrow[row] = m[0] + log2f(l[0]);
        if (row + 8 < T) lrow[row + 8] = m[1] + log2f(l[1]);
    }
}

// ---------------------------------------------------------------------------
// D = rowsum(do * o) per (batch, head, row), F32 [b, heads, T]; eight
// threads per row, 16-byte chunks ch, ch + 8, .. of its `chunks` (HD / 8)
// each.

extern "C" __global__ void flash_bwd_dot_bf16(const bf16* __restrict__ o, const bf16* __restrict__ dout,
                                              long long ob, long long oh, long long ot,
                                              float* __restrict__ dsum, int H, int T, long long rows,
                                              int chunks) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = i >> 3;
    float acc = 0.0f;
    for (int ch = (int)(i & 7); r < rows && ch < chunks; ch += 8) {
        const int t = (int)(r % T);
        const long long bh = r / T;
        const long long off = (bh / H) * ob + (bh % H) * oh + (long long)t * ot + ch * 8;
        const uint4 a = *reinterpret_cast<const uint4*>(o + off);
        const uint4 d = *reinterpret_cast<const uint4*>(dout + off);
        const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
        const __nv_bfloat162* pd = reinterpret_cast<const __nv_bfloat162*>(&d);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 x = __bfloat1622float2(pa[e]), y = __bfloat1622float2(pd[e]);
            acc += x.x * y.x + x.y * y.y;
        }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    acc += __shfl_xor_sync(0xffffffffu, acc, 4);
    if (r < rows && (i & 7) == 0) dsum[r] = acc;
}

// ---------------------------------------------------------------------------
// Backward. Grid (2 * tiles, heads, batch).

struct Bwd {
    const bf16 *q, *k, *v, *dout;
    const float *lse2, *dsum;  // rows of this (batch, query head)
    bf16 *dq, *dk, *dv;
    long long sh, st, oh, ot;  // head and row strides of q (dq), and of do
    int T, group;
    float scale_log2, scale;
};

// A backward block's tiles in shared memory: the moving ones (query or key
// tiles) double-buffered in a and b, and above HD 64 the stationary ones
// (this block's own tile of k and v, or of q and do) in x and y.
template <int HD>
struct Tiles {
    bf16* base;  // a[0], a[1], b[0], b[1], x, y, one tile each
    __device__ __forceinline__ bf16* a(int c) const { return base + c * Geo<HD>::ELEMS; }
    __device__ __forceinline__ bf16* b(int c) const { return base + (2 + c) * Geo<HD>::ELEMS; }
    __device__ __forceinline__ bf16* x() const { return base + 4 * Geo<HD>::ELEMS; }
    __device__ __forceinline__ bf16* y() const { return base + 5 * Geo<HD>::ELEMS; }
};

// A warp's 16 rows of a stationary tile as the A operand of scores: their
// fragments held in registers at HD 64, read from the tile in shared memory
// at each use above (holding them would spill).
template <int HD>
struct Fixed {
    static constexpr bool REG = HD == 64;
    uint32_t a[REG ? Geo<HD>::KS : 1][4];
    const bf16* tile;
    int m0;

    // acc (16 rows x the 64 rows of tile t) += these rows times tile t's rows.
    __device__ __forceinline__ void scores(float (&acc)[8][4], const bf16* t, int lane) const {
        if constexpr (REG)
            mma_tile<HD, true, Geo<HD>::KS, 8>(acc, a, t, lane);
        else
            mma_scores_smem<HD>(acc, tile, m0, t, lane);
    }
};

// Two stationary tiles loaded together (into s0, s1: a[0] and b[0], reused
// afterwards, at HD 64; x and y above) and made this warp's A operands.
template <int HD>
__device__ __forceinline__ void stage(Fixed<HD>& f0, Fixed<HD>& f1, const Tiles<HD>& sm, const bf16* g0, long long st0,
                                      const bf16* g1, long long st1, int row0, int T, int lane, int w) {
    bf16* s0 = Fixed<HD>::REG ? sm.a(0) : sm.x();
    bf16* s1 = Fixed<HD>::REG ? sm.b(0) : sm.y();
    load_tile<HD>(s0, g0, st0, row0, T);
    load_tile<HD>(s1, g1, st1, row0, T);
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    f0.tile = s0;
    f1.tile = s1;
    f0.m0 = f1.m0 = w * 16;
    if constexpr (Fixed<HD>::REG) {
#pragma unroll
        for (int kk = 0; kk < Geo<HD>::KS; ++kk) {
            frag_a<HD>(f0.a[kk], s0, w * 16, kk, lane);
            frag_a<HD>(f1.a[kk], s1, w * 16, kk, lane);
        }
        __syncthreads();
    }
}

// dK, dV of key tile kt: over query tiles kt .. tiles - 1.
template <int HD>
__device__ __forceinline__ void bwd_dkdv(const Bwd& p, int kt, const Tiles<HD>& sm, float (*sL)[TILE],
                                         float (*sD)[TILE]) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int tiles = (p.T + TILE - 1) / TILE;
    Fixed<HD> kf, vf;
    stage<HD>(kf, vf, sm, p.k, p.st, p.v, p.st, kt * TILE, p.T, lane, w);
    // Step i of the walk: query tile kt + i % n of the group's head i / n.
    const int n = tiles - kt, steps = n * p.group;
    auto fetch = [&](int i, int buf) {
        const int g = i / n, qt = kt + i % n;
        load_tile<HD>(sm.a(buf), p.q + g * p.sh, p.st, qt * TILE, p.T);
        load_tile<HD>(sm.b(buf), p.dout + g * p.oh, p.ot, qt * TILE, p.T);
        if (threadIdx.x < TILE) {
            const int r = qt * TILE + threadIdx.x;
            const long long rows = (long long)g * p.T;
            sL[buf][threadIdx.x] = r < p.T ? p.lse2[rows + r] : INFINITY;
            sD[buf][threadIdx.x] = r < p.T ? p.dsum[rows + r] : 0.0f;
        }
    };
    fetch(0, 0);
    cp_commit();
    float dk[Geo<HD>::NJ][4], dv[Geo<HD>::NJ][4];
    zero(dk);
    zero(dv);
    const int key = kt * TILE + w * 16 + (lane >> 2);  // keys of c[.][0..1]; + 8 for c[.][2..3]
    const int col = 2 * (lane & 3);
    for (int i = 0; i < steps; ++i) {
        const int qt = kt + i % n;
        const int cur = i & 1;
        if (i + 1 < steps) fetch(i + 1, cur ^ 1);
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        // Pᵀ (16 keys x 64 queries) from Sᵀ = K Qᵀ.
        float s[8][4];
        zero(s);
        kf.scores(s, sm.a(cur), lane);
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qi = 8 * j + col + (e & 1);
                float pr = exp2f(s[j][e] * p.scale_log2 - sL[cur][qi]);
                if (qt == kt && qt * TILE + qi < key + ((e >> 1) << 3)) pr = 0.0f;
                s[j][e] = pr;
            }
        mma_acc_rows_k<HD>(dv, s, sm.b(cur), lane);  // dV += Pᵀ dO
        float dp[8][4];
        zero(dp);
        vf.scores(dp, sm.b(cur), lane);  // dPᵀ = V dOᵀ
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] *= dp[j][e] - sD[cur][8 * j + col + (e & 1)];
        mma_acc_rows_k<HD>(dk, s, sm.a(cur), lane);  // dK += dSᵀ Q
        __syncthreads();
    }
    store_rows(p.dk, p.st, key, p.T, dk, p.scale, p.scale, lane);
    store_rows(p.dv, p.st, key, p.T, dv, 1.0f, 1.0f, lane);
}

// dQ of query tile qt: over key tiles 0 .. qt.
template <int HD>
__device__ __forceinline__ void bwd_dq(const Bwd& p, int qt, const Tiles<HD>& sm) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    Fixed<HD> qf, df;
    stage<HD>(qf, df, sm, p.q, p.st, p.dout, p.ot, qt * TILE, p.T, lane, w);
    const int row = qt * TILE + w * 16 + (lane >> 2);
    float lr[2], dr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = row + 8 * r;
        lr[r] = i < p.T ? p.lse2[i] : INFINITY;
        dr[r] = i < p.T ? p.dsum[i] : 0.0f;
    }
    load_tile<HD>(sm.a(0), p.k, p.st, 0, p.T);
    load_tile<HD>(sm.b(0), p.v, p.st, 0, p.T);
    cp_commit();
    float dq[Geo<HD>::NJ][4];
    zero(dq);
    const int key0 = 2 * (lane & 3);
    for (int kt = 0; kt <= qt; ++kt) {
        const int cur = kt & 1;
        if (kt < qt) {
            load_tile<HD>(sm.a(cur ^ 1), p.k, p.st, (kt + 1) * TILE, p.T);
            load_tile<HD>(sm.b(cur ^ 1), p.v, p.st, (kt + 1) * TILE, p.T);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        float s[8][4], dp[8][4];
        zero(s);
        zero(dp);
        qf.scores(s, sm.a(cur), lane);   // S = Q Kᵀ
        df.scores(dp, sm.b(cur), lane);  // dP = dO Vᵀ
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                float pr = exp2f(s[j][e] * p.scale_log2 - lr[r]);
                if (kt == qt && kt * TILE + key0 + 8 * j + (e & 1) > row + 8 * r) pr = 0.0f;
                s[j][e] = pr * (dp[j][e] - dr[r]);
            }
        mma_acc_rows_k<HD>(dq, s, sm.a(cur), lane);  // dQ += dS K
        __syncthreads();
    }
    store_rows(p.dq, p.st, row, p.T, dq, p.scale, p.scale, lane);
}

template <int HD>
__device__ __forceinline__ void flash_bwd(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                          const bf16* __restrict__ v, long long sb, long long sh, long long st,
                                          const bf16* __restrict__ dout, long long ob, long long oh, long long ot,
                                          const float* __restrict__ lse2, const float* __restrict__ dsum,
                                          bf16* __restrict__ dq, bf16* __restrict__ dk, bf16* __restrict__ dv, int T,
                                          int group, float scale_log2, float scale) {
    __shared__ float sL[2][TILE], sD[2][TILE];
    const Tiles<HD> sm{reinterpret_cast<bf16*>(flash_smem)};
    const int tiles = (T + TILE - 1) / TILE;
    const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
    const bool keys = (int)blockIdx.x < tiles;
    // A key block works for its group's first head only (all its heads).
    if (keys && h % group != 0) return;
    const long long off = (long long)b * sb + (long long)h * sh;
    const long long koff = (long long)b * sb + (long long)(h / group) * sh;
    const long long ooff = (long long)b * ob + (long long)h * oh;
    const long long row_off = ((long long)b * H + h) * T;
    const Bwd p{q + off,  k + koff,  v + koff,       dout + ooff, lse2 + row_off, dsum + row_off,
                dq + off, dk + koff, dv + koff,      sh,          st,             oh,
                ot,       T,         keys ? group : 1, scale_log2, scale};
    if (keys)
        bwd_dkdv<HD>(p, blockIdx.x, sm, sL, sD);
    else
        bwd_dq<HD>(p, 2 * tiles - 1 - blockIdx.x, sm);
}

// ---------------------------------------------------------------------------
// The kernels, one pair per head dimension.

#define FLASH_KERNELS(HD)                                                                                        \
    extern "C" __global__ void __launch_bounds__(NT) flash_fwd_bf16_hd##HD(                                   \
        const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, long long sb,       \
        long long sh, long long st, bf16* __restrict__ o, long long ob, long long oh, long long ot,             \
        float* __restrict__ lse2, int T, int group, float scale_log2) {                                         \
        flash_fwd<HD>(q, k, v, sb, sh, st, o, ob, oh, ot, lse2, T, group, scale_log2);                          \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) flash_bwd_bf16_hd##HD(                                   \
        const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, long long sb,       \
        long long sh, long long st, const bf16* __restrict__ dout, long long ob, long long oh, long long ot,     \
        const float* __restrict__ lse2, const float* __restrict__ dsum, bf16* __restrict__ dq,                 \
        bf16* __restrict__ dk, bf16* __restrict__ dv, int T, int group, float scale_log2, float scale) {        \
        flash_bwd<HD>(q, k, v, sb, sh, st, dout, ob, oh, ot, lse2, dsum, dq, dk, dv, T, group, scale_log2,      \
                      scale);                                                                                   \
    }

FLASH_KERNELS(64)
FLASH_KERNELS(80)
FLASH_KERNELS(96)
FLASH_KERNELS(128)

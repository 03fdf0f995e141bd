// Causal flash attention for BF16 q, k, v with a head dimension of 64:
// softmax(scale * q kᵀ + mask) v, one (batch, head, 64-row tile) per block,
// the scores and probabilities never leave the registers (FlashAttention-2,
// Dao 2023). Forward writes the output and, per query row, the log-sum-exp
// in log2 units (`lse2 = m + log2(l)`, `m` the row max of `scale * log2(e)
// * s`); backward recomputes the probabilities from it.
//
// Layout: q, k, v (and dq, dk, dv) share strides (batch, head, row) in
// elements with the head dimension contiguous, so the same kernels read a
// fused projection's rows `[b, t, 3 * heads * 64]` in place (q, k, v at
// column offsets 0, width, 2 * width) or separate `[b, heads, t, 64]`
// tensors; o and do share theirs. Every base and row must be 16-byte
// aligned (the host checks).
//
// Products: mma.sync m16n8k16 BF16 -> F32 from ldmatrix fragments; tiles
// of 64 rows x 64 columns in shared memory with the 16-byte chunks of row
// r XOR-swizzled by r % 8 (no bank conflicts for ldmatrix); the next key
// (or query) tile is fetched by cp.async while this one is used. Four
// warps, 16 rows each. Rows past the sequence read as zeros; the mask
// keeps them out of every valid row.
//
// Backward is one launch of two kinds of blocks: the first `tiles` blocks
// of x own a key tile and accumulate dK, dV over the query tiles at or
// below it; the others own a query tile and accumulate dQ over the key
// tiles at or above it (no atomics; the scores are computed twice). `D =
// rowsum(do * o)` comes first from `flash_bwd_dot`.

#include "flash.cuh"

// ---------------------------------------------------------------------------
// Forward. Grid (tiles, heads, batch); block x takes query tile
// tiles - 1 - x (the longest first).

extern "C" __global__ void __launch_bounds__(NT)
    flash_fwd_bf16(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                   long long sb, long long sh, long long st, bf16* __restrict__ o, long long ob, long long oh,
                   long long ot, float* __restrict__ lse2, int T, float scale_log2) {
    __shared__ __align__(128) bf16 sQ[TILE_ELEMS];
    __shared__ __align__(128) bf16 sK[2][TILE_ELEMS];
    __shared__ __align__(128) bf16 sV[2][TILE_ELEMS];
    const int tiles = (T + TILE - 1) / TILE;
    const int qt = tiles - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const long long off = (long long)b * sb + (long long)h * sh;
    const bf16 *qg = q + off, *kg = k + off, *vg = v + off;
    const int q0 = qt * TILE;
    load_tile(sQ, qg, st, q0, T);
    load_tile(sK[0], kg, st, 0, T);
    load_tile(sV[0], vg, st, 0, T);
    cp_commit();

    float acc[8][4];
    zero(acc);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    uint32_t qa[4][4];
    const int row = q0 + w * 16 + (lane >> 2);  // rows of c[.][0..1]; + 8 for c[.][2..3]
    for (int kt = 0; kt <= qt; ++kt) {
        const int cur = kt & 1;
        if (kt < qt) {
            load_tile(sK[cur ^ 1], kg, st, (kt + 1) * TILE, T);
            load_tile(sV[cur ^ 1], vg, st, (kt + 1) * TILE, T);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        if (kt == 0)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) frag_a(qa[kk], sQ, w * 16, kk, lane);
        float s[8][4];
        zero(s);
        mma_tile<true>(s, qa, sK[cur], lane);
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
                acc[j][e] *= alpha[e >> 1];
            }
        mma_acc_rows_k(acc, s, sV[cur], lane);
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
// threads per row, one 16-byte chunk each.

extern "C" __global__ void flash_bwd_dot_bf16(const bf16* __restrict__ o, const bf16* __restrict__ dout,
                                              long long ob, long long oh, long long ot,
                                              float* __restrict__ dsum, int H, int T, long long rows) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = i >> 3;
    const int ch = (int)(i & 7);
    float acc = 0.0f;
    if (r < rows) {
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
    if (r < rows && ch == 0) dsum[r] = acc;
}

// ---------------------------------------------------------------------------
// Backward. Grid (2 * tiles, heads, batch).

struct Bwd {
    const bf16 *q, *k, *v, *dout;
    const float *lse2, *dsum;  // rows of this (batch, head)
    bf16 *dq, *dk, *dv;
    long long st, ot;
    int T;
    float scale_log2, scale;
};

// The 16-row A fragments of this warp from two tiles loaded together.
__device__ __forceinline__ void stage(uint32_t (&a)[4][4], uint32_t (&c)[4][4], bf16* s0, bf16* s1,
                                      const bf16* g0, long long st0, const bf16* g1, long long st1, int row0,
                                      int T, int lane, int w) {
    load_tile(s0, g0, st0, row0, T);
    load_tile(s1, g1, st1, row0, T);
    cp_commit();
    cp_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        frag_a(a[kk], s0, w * 16, kk, lane);
        frag_a(c[kk], s1, w * 16, kk, lane);
    }
    __syncthreads();
}

// dK, dV of key tile kt: over query tiles kt .. tiles - 1.
__device__ void bwd_dkdv(const Bwd& p, int kt, bf16 (*sA)[TILE_ELEMS], bf16 (*sB)[TILE_ELEMS],
                         float (*sL)[TILE], float (*sD)[TILE]) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int tiles = (p.T + TILE - 1) / TILE;
    uint32_t ka[4][4], va[4][4];
    stage(ka, va, sA[0], sB[0], p.k, p.st, p.v, p.st, kt * TILE, p.T, lane, w);
    auto fetch = [&](int qt, int buf) {
        load_tile(sA[buf], p.q, p.st, qt * TILE, p.T);
        load_tile(sB[buf], p.dout, p.ot, qt * TILE, p.T);
        if (threadIdx.x < TILE) {
            const int r = qt * TILE + threadIdx.x;
            sL[buf][threadIdx.x] = r < p.T ? p.lse2[r] : INFINITY;
            sD[buf][threadIdx.x] = r < p.T ? p.dsum[r] : 0.0f;
        }
    };
    fetch(kt, 0);
    cp_commit();
    float dk[8][4], dv[8][4];
    zero(dk);
    zero(dv);
    const int key = kt * TILE + w * 16 + (lane >> 2);  // keys of c[.][0..1]; + 8 for c[.][2..3]
    const int col = 2 * (lane & 3);
    for (int qt = kt; qt < tiles; ++qt) {
        const int cur = (qt - kt) & 1;
        if (qt + 1 < tiles) fetch(qt + 1, cur ^ 1);
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        // Pᵀ (16 keys x 64 queries) from Sᵀ = K Qᵀ.
        float s[8][4];
        zero(s);
        mma_tile<true>(s, ka, sA[cur], lane);
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qi = 8 * j + col + (e & 1);
                float pr = exp2f(s[j][e] * p.scale_log2 - sL[cur][qi]);
                if (qt == kt && qt * TILE + qi < key + ((e >> 1) << 3)) pr = 0.0f;
                s[j][e] = pr;
            }
        mma_acc_rows_k(dv, s, sB[cur], lane);  // dV += Pᵀ dO
        float dp[8][4];
        zero(dp);
        mma_tile<true>(dp, va, sB[cur], lane);  // dPᵀ = V dOᵀ
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] *= dp[j][e] - sD[cur][8 * j + col + (e & 1)];
        mma_acc_rows_k(dk, s, sA[cur], lane);  // dK += dSᵀ Q
        __syncthreads();
    }
    store_rows(p.dk, p.st, key, p.T, dk, p.scale, p.scale, lane);
    store_rows(p.dv, p.st, key, p.T, dv, 1.0f, 1.0f, lane);
}

// dQ of query tile qt: over key tiles 0 .. qt.
__device__ void bwd_dq(const Bwd& p, int qt, bf16 (*sA)[TILE_ELEMS], bf16 (*sB)[TILE_ELEMS]) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    uint32_t qa[4][4], da[4][4];
    stage(qa, da, sA[0], sB[0], p.q, p.st, p.dout, p.ot, qt * TILE, p.T, lane, w);
    const int row = qt * TILE + w * 16 + (lane >> 2);
    float lr[2], dr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = row + 8 * r;
        lr[r] = i < p.T ? p.lse2[i] : INFINITY;
        dr[r] = i < p.T ? p.dsum[i] : 0.0f;
    }
    load_tile(sA[0], p.k, p.st, 0, p.T);
    load_tile(sB[0], p.v, p.st, 0, p.T);
    cp_commit();
    float dq[8][4];
    zero(dq);
    const int key0 = 2 * (lane & 3);
    for (int kt = 0; kt <= qt; ++kt) {
        const int cur = kt & 1;
        if (kt < qt) {
            load_tile(sA[cur ^ 1], p.k, p.st, (kt + 1) * TILE, p.T);
            load_tile(sB[cur ^ 1], p.v, p.st, (kt + 1) * TILE, p.T);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        float s[8][4], dp[8][4];
        zero(s);
        zero(dp);
        mma_tile<true>(s, qa, sA[cur], lane);   // S = Q Kᵀ
        mma_tile<true>(dp, da, sB[cur], lane);  // dP = dO Vᵀ
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                float pr = exp2f(s[j][e] * p.scale_log2 - lr[r]);
                if (kt == qt && kt * TILE + key0 + 8 * j + (e & 1) > row + 8 * r) pr = 0.0f;
                s[j][e] = pr * (dp[j][e] - dr[r]);
            }
        mma_acc_rows_k(dq, s, sA[cur], lane);  // dQ += dS K
        __syncthreads();
    }
    store_rows(p.dq, p.st, row, p.T, dq, p.scale, p.scale, lane);
}

extern "C" __global__ void __launch_bounds__(NT)
    flash_bwd_bf16(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                   long long sb, long long sh, long long st, const bf16* __restrict__ dout, long long ob,
                   long long oh, long long ot, const float* __restrict__ lse2, const float* __restrict__ dsum,
                   bf16* __restrict__ dq, bf16* __restrict__ dk, bf16* __restrict__ dv, int T, float scale_log2,
                   float scale) {
    __shared__ __align__(128) bf16 sA[2][TILE_ELEMS];
    __shared__ __align__(128) bf16 sB[2][TILE_ELEMS];
    __shared__ float sL[2][TILE], sD[2][TILE];
    const int tiles = (T + TILE - 1) / TILE;
    const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
    const long long off = (long long)b * sb + (long long)h * sh;
    const long long ooff = (long long)b * ob + (long long)h * oh;
    const long long row_off = ((long long)b * H + h) * T;
    const Bwd p{q + off,        k + off,         v + off,     dout + ooff, lse2 + row_off,
                dsum + row_off, dq + off,        dk + off,    dv + off,    st,
                ot,             T,               scale_log2,  scale};
    if ((int)blockIdx.x < tiles)
        bwd_dkdv(p, blockIdx.x, sA, sB, sL, sD);
    else
        bwd_dq(p, 2 * tiles - 1 - blockIdx.x, sA, sB);
}

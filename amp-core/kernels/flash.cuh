// The tile machinery of flash.cu, for a head dimension HD of 64, 80, 96 or
// 128 (a template parameter): 64-row BF16 tiles in XOR-swizzled shared
// memory filled by cp.async, ldmatrix fragments, mma.sync m16n8k16 (BF16
// in, F32 accumulate) over a warp's 16 rows, and the accumulator's store.
// Four warps per block.
#pragma once
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#define TILE 64  // rows of a q, k, v tile
#define WARPS 4
#define NT (WARPS * 32)

// A tile's geometry in shared memory for head dimension HD: rows of ROW
// elements (HD rounded up to a multiple of 64, so that the XOR of a 16-byte
// chunk's index with r % 8 stays inside the row), of which the first CH
// chunks hold data. Products over the head dimension take KS k-steps of 16;
// products into it NJ n-tiles of 8.
template <int HD>
struct Geo {
    static_assert(HD % 16 == 0 && HD >= 64 && HD <= 128, "head dimension 64, 80, 96, 112 or 128");
    static constexpr int ROW = (HD + 63) / 64 * 64;
    static constexpr int CH = HD / 8;
    static constexpr int ELEMS = TILE * ROW;
    static constexpr int KS = HD / 16;
    static constexpr int NJ = HD / 8;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// Element offset of (row, col) in a swizzled tile; col a multiple of 8.
template <int HD>
__device__ __forceinline__ int swz(int r, int c) {
    return r * Geo<HD>::ROW + ((((c >> 3) ^ (r & 7))) << 3);
}

__device__ __forceinline__ void cp16(bf16* dst, const bf16* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Rows row0 .. row0 + 63 of one head (`g` at its row 0, rows `st` apart)
// into a swizzled tile; rows at or past `T` as zeros.
template <int HD>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, long long st, int row0, int T) {
    constexpr int CH = Geo<HD>::CH;
    static_assert(TILE * CH % NT == 0, "whole chunks per thread");
#pragma unroll
    for (int i = 0; i < TILE * CH / NT; ++i) {
        const int idx = threadIdx.x + i * NT;
        const int r = idx / CH, ch = idx % CH;
        const bool ok = row0 + r < T;
        const bf16* src = ok ? g + (long long)(row0 + r) * st + ch * 8 : g;
        cp16(s + swz<HD>(r, ch * 8), src, ok);
    }
}

__device__ __forceinline__ void ldsm(uint32_t (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_t(uint32_t (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// c += a b for one m16n8k16 tile.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A fragment (rows m0..m0+15, columns 16kk..16kk+15) of a row-major tile.
template <int HD>
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const bf16* s, int m0, int kk, int lane) {
    const int mi = lane >> 3;
    ldsm(a, s + swz<HD>(m0 + (lane & 7) + ((mi & 1) << 3), kk * 16 + ((mi >> 1) << 3)));
}

// B fragments of n-tiles n0/8 and n0/8 + 1 at k-step kk, from a tile whose
// rows are n (b[k][n] = s[n][k]): {b0, b1} of the first, then the second.
template <int HD>
__device__ __forceinline__ void frag_b_rows_n(uint32_t (&b)[4], const bf16* s, int n0, int kk, int lane) {
    const int mi = lane >> 3;
    ldsm(b, s + swz<HD>(n0 + (lane & 7) + ((mi >> 1) << 3), kk * 16 + ((mi & 1) << 3)));
}

// The same from a tile whose rows are k (b[k][n] = s[k][n]).
template <int HD>
__device__ __forceinline__ void frag_b_rows_k(uint32_t (&b)[4], const bf16* s, int n0, int kk, int lane) {
    const int mi = lane >> 3;
    ldsm_t(b, s + swz<HD>(kk * 16 + (lane & 7) + ((mi & 1) << 3), n0 + ((mi >> 1) << 3)));
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// The A fragment at k-step kk of a 16 x 64 accumulator (its n-tiles 2kk and
// 2kk + 1), rounded to BF16.
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c)[8][4], int kk) {
    a[0] = pack(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// acc (16 x 8 NJ) += a (16 x 16 KS, as KS k-steps of A fragments) b, b read
// from tile `s` with rows n (ROWS_N) or rows k. Two kinds: scores (k the
// head dimension, KS = HD / 16; n the 64 rows of a tile, NJ = 8) and
// outputs (k the 64 rows of a tile, KS = 4; n the head dimension, NJ =
// HD / 8).
template <int HD, bool ROWS_N, int KS, int NJ>
__device__ __forceinline__ void mma_tile(float (&acc)[NJ][4], const uint32_t (&a)[KS][4], const bf16* s,
                                         int lane) {
    static_assert(NJ % 2 == 0, "n-tiles in pairs");
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
        for (int j = 0; j < NJ; j += 2) {
            uint32_t b[4];
            if (ROWS_N)
                frag_b_rows_n<HD>(b, s, 8 * j, kk, lane);
            else
                frag_b_rows_k<HD>(b, s, 8 * j, kk, lane);
            mma(acc[j], a[kk], b[0], b[1]);
            mma(acc[j + 1], a[kk], b[2], b[3]);
        }
    }
}

// Scores of 16 rows against a tile's 64 (s[8][4] += a bᵀ over the head
// dimension), the A fragments read from rows m0.. of tile `sa` one k-step
// at a time instead of held in registers (the backward at head dimensions
// above 64, where holding them would spill).
template <int HD>
__device__ __forceinline__ void mma_scores_smem(float (&acc)[8][4], const bf16* sa, int m0, const bf16* s,
                                                int lane) {
#pragma unroll
    for (int kk = 0; kk < Geo<HD>::KS; ++kk) {
        uint32_t a[4];
        frag_a<HD>(a, sa, m0, kk, lane);
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            uint32_t b[4];
            frag_b_rows_n<HD>(b, s, 8 * j, kk, lane);
            mma(acc[j], a, b[0], b[1]);
            mma(acc[j + 1], a, b[2], b[3]);
        }
    }
}

// acc (16 x HD) += c (16 x 64, an accumulator rounded to BF16 A fragments)
// times a tile `s` whose rows are k.
template <int HD>
__device__ __forceinline__ void mma_acc_rows_k(float (&acc)[Geo<HD>::NJ][4], const float (&c)[8][4],
                                               const bf16* s, int lane) {
    uint32_t a[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) acc_to_a(a[kk], c, kk);
    mma_tile<HD, false, 4, Geo<HD>::NJ>(acc, a, s, lane);
}

template <int N>
__device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[j][e] = 0.0f;
}

// Writes rows r, r + 8 of a warp's 16 x 8 NJ accumulator times `mul` (rows
// at or past T skipped); `g` is the head's row 0.
template <int NJ>
__device__ __forceinline__ void store_rows(bf16* g, long long st, int r, int T, const float (&c)[NJ][4],
                                           float mul0, float mul1, int lane) {
    const int col = 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        if (r < T) *reinterpret_cast<uint32_t*>(g + (long long)r * st + 8 * j + col) = pack(c[j][0] * mul0, c[j][1] * mul0);
        if (r + 8 < T)
            *reinterpret_cast<uint32_t*>(g + (long long)(r + 8) * st + 8 * j + col) = pack(c[j][2] * mul1, c[j][3] * mul1);
    }
}

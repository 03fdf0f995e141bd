// The embedding's gather and its deterministic backward (nn.cu), which nn.cu includes after its helpers.
#pragma once

// ---------------------------------------------------------------------------
// Embedding (F32 tables): out[i, :] = table[ids[i], :], a NaN row where
// ids[i] >= rows (no host read to refuse it; the CPU body refuses it). The
// backward dt[r, c] = the sum of g[i, c] * scale (each product rounded
// apart, no FMA: as the CPU body) over the tokens i with ids[i] == r,
// in token order from +0 (index_add's order: the same bits as candle's
// backward of index_select where the table gets no other gradient). Block (x, p) of the backward owns columns
// [256 x, 256 x + 256) of the rows r with r & mask == p (grid (.., mask + 1)):
// no atomics, each sum in one thread, in order. dt is zeroed by the caller.

extern "C" __global__ void embedding_fwd_f32(const uint32_t* __restrict__ ids, const float* __restrict__ table,
                                             float* __restrict__ out, size_t n, size_t rows, size_t cols) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n * cols; e += stride) {
        const size_t i = e / cols, c = e % cols;
        const uint32_t r = ids[i];
        out[e] = r < rows ? table[(size_t)r * cols + c] : __uint_as_float(0x7FC00000u);
    }
}

#define EMB_IDS 4096
extern "C" __global__ void embedding_bwd_f32(const uint32_t* __restrict__ ids, const float* __restrict__ g,
                                             float* __restrict__ dt, size_t n, size_t rows, size_t cols,
                                             uint32_t mask, float scale) {
    __shared__ uint32_t sid[EMB_IDS];
    const size_t c = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const uint32_t p = blockIdx.y;
    for (size_t at = 0; at < n; at += EMB_IDS) {
        const int len = (int)min((size_t)EMB_IDS, n - at);
        for (int j = threadIdx.x; j < len; j += blockDim.x) sid[j] = ids[at + j];
        __syncthreads();
        if (c < cols) {
#pragma unroll 4
            for (int j = 0; j < len; j++) {
                const uint32_t r = sid[j];
                if (r < rows && (r & mask) == p) dt[(size_t)r * cols + c] += __fmul_rn(g[(at + j) * cols + c], scale);
            }
        }
        __syncthreads();
    }
}


// The backward through a sort, for up to EMB_SORT_MAX ids (the kernel above
// has every block scan every id: tens of times the work of the sums for a
// GPT batch). Two launches:
//   embedding_sort: one block sorts the keys (row << log) | i (log:
//                   log2 of n rounded up to a power of two; an id past the
//                   table is row `rows`, after every real row) in shared
//                   memory (bitonic; the keys are distinct, so the order
//                   is the rows' and, within a row, the tokens'), and
//                   writes the n sorted keys.
//   embedding_bwd_sorted_f32: block (j, x) does nothing unless sorted key
//                   j starts a row's run; then it owns that row's columns
//                   [256 x, 256 x + 256) and adds the run's products in
//                   order (token order) from +0: each sum in one thread,
//                   in the order of the kernel above, so the same bits.
// The caller checks (rows + 1) << log <= 2^32 and zeroes dt (rows no id
// names stay +0).
#define EMB_SORT_MAX 16384
#define EMB_SORT_THREADS 1024
#define EMB_RUN 16
extern "C" __global__ void __launch_bounds__(EMB_SORT_THREADS)
    embedding_sort(const uint32_t* __restrict__ ids, size_t n, uint32_t rows, uint32_t log, uint32_t* __restrict__ sorted) {
    extern __shared__ uint32_t keys[];
    const uint32_t len = 1u << log;
    for (uint32_t i = threadIdx.x; i < len; i += blockDim.x) {
        if (i < n) {
            const uint32_t r = ids[i];
            keys[i] = ((r < rows ? r : rows) << log) | i;
        } else {
            keys[i] = 0xFFFFFFFFu;  // after every real key (see the caller's check)
        }
    }
    __syncthreads();
    for (uint32_t k = 2; k <= len; k <<= 1) {
        for (uint32_t j = k >> 1; j > 0; j >>= 1) {
            for (uint32_t i = threadIdx.x; i < len; i += blockDim.x) {
                const uint32_t l = i ^ j;
                if (l > i) {
                    const uint32_t a = keys[i], b = keys[l];
                    if ((a > b) == ((i & k) == 0)) {
                        keys[i] = b;
                        keys[l] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) sorted[i] = keys[i];
}

extern "C" __global__ void embedding_bwd_sorted_f32(const uint32_t* __restrict__ sorted, const float* __restrict__ g,
                                                    float* __restrict__ dt, size_t n, size_t cols, uint32_t rows,
                                                    uint32_t log, float scale) {
    const size_t j = blockIdx.x;
    const uint32_t r = sorted[j] >> log;
    if (r >= rows || (j > 0 && (sorted[j - 1] >> log) == r)) return;
    const size_t c = blockIdx.y * (size_t)blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const uint32_t mask = (1u << log) - 1u;
    float acc = 0.0f;
    // EMB_RUN keys, then their rows' loads, in flight at once (a frequent
    // token's run is thousands long); the adds stay in token order
    for (size_t k = j; k < n; k += EMB_RUN) {
        uint32_t key[EMB_RUN];
        float v[EMB_RUN];
#pragma unroll
        for (int u = 0; u < EMB_RUN; u++) key[u] = k + u < n ? sorted[k + u] : 0xFFFFFFFFu;
#pragma unroll
        for (int u = 0; u < EMB_RUN; u++) v[u] = (key[u] >> log) == r ? g[(size_t)(key[u] & mask) * cols + c] : 0.0f;
        // (the sentinel's row is past every real one: see the caller's check)
        bool more = true;
#pragma unroll
        for (int u = 0; u < EMB_RUN; u++) {
            more = more && (key[u] >> log) == r;
            if (more) acc = __fadd_rn(acc, __fmul_rn(v[u], scale));
        }
        if (!more) break;
    }
    dt[(size_t)r * cols + c] = acc;
}

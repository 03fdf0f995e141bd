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


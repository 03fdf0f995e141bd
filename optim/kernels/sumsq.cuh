// The gradient sum of squares (`SumSq` of optim/src/fused.rs), included by
// lowbit.cu after the decodes it shares with the fused step.
#pragma once

// ------------------------------------------------------------- SumSq --
// The CPU body: blocks of 2048 elements; in each, 8 f32 lanes (lane j sums
// x*x of elements j, j+8, ... in order), the lanes summed in f64 in order;
// groups of 256 blocks' sums added in f64 in order (from 0), and the group
// sums added in order (from 0). Two launches:
//   sumsq_partials: a warp (one CUDA block of 32 threads) per 4 element
//                   blocks: their codes come in as 16-byte words (coalesced,
//                   a batch of SUMSQ_BATCH words per thread in flight),
//                   stored as codes in a shared tile, then each thread, one
//                   (block, lane), decodes and adds its column in order
//                   (an FP8 tile is 8.3 KB: up to 27 warps an SM, where an
//                   f32 tile allowed 6 and left the pass latency-bound,
//                   70-78 us for 64M E4M3 values). Small blocks
//                   and whole element blocks per load round: a tensor of a
//                   few million elements spreads over hundreds of SMs'
//                   worth of warps, with two or four round trips to memory.
//                   A tensor of at most 4 element blocks is one CUDA
//                   block, which adds its partials as sumsq_groups would
//                   and writes the total.
//   sumsq_groups:   a CUDA block per group: its 256 partials into shared
//                   memory, thread 0 adds them in order; the last block to
//                   finish adds the group sums in order (a third launch
//                   did, sumsq_total).
// Elements past n decode as 0: x*x = +0 leaves a lane's sum as it is.
#define SUMSQ_BLOCK 2048
#define SUMSQ_GROUP 256
#define SUMSQ_CHUNKS 4   // element blocks per CUDA block (32 threads: 8 lanes each)
#define SUMSQ_BATCH 16   // 16-byte words in flight per thread

// Elements of a kind in a 16-byte word, and the type of one code.
template <int KIND> struct Word { static constexpr int N = KIND == K_F32 ? 4 : KIND == K_F16 ? 8 : 16; };
template <int KIND> struct Code { using T = uint8_t; };
template <> struct Code<K_F16> { using T = uint16_t; };
template <> struct Code<K_F32> { using T = float; };

// One code as `load` decodes it.
template <int KIND>
__device__ __forceinline__ float decode_code(typename Code<KIND>::T c, float si) {
    if constexpr (KIND == K_E4M3) return __fmul_rn(decode_e4m3(c), si);
    else if constexpr (KIND == K_E5M2) return __fmul_rn(decode_e5m2(c), si);
    else if constexpr (KIND == K_F16) return __fmul_rn(decode_f16(c), si);
    else return c;
}

// The tile holds the codes as they are (a quarter of the f32 bytes for FP8,
// so four times the warps an SM); each row is padded by 32 bytes, so row c
// starts at bank 8c and the 4 rows' 8 lanes fall on distinct banks for
// every code width.
template <int KIND>
__device__ void sumsq_partials_impl(const void* g, const float* si_p, size_t n, int vec, double* partials,
                                    uint32_t* counter, Grid gr) {
    // sumsq_groups' counter of finished groups starts at zero (the next
    // launch in the stream sees every write of this one)
    if (counter != nullptr && gr.block == 0 && threadIdx.x == 0) *counter = 0u;
    using T = typename Code<KIND>::T;
    constexpr int EPW = Word<KIND>::N;
    constexpr int WORDS = SUMSQ_CHUNKS * SUMSQ_BLOCK / EPW;  // words of this CUDA block
    constexpr int PITCH = SUMSQ_BLOCK + 32 / (int)sizeof(T);  // codes per tile row
    __shared__ __align__(16) T tile[SUMSQ_CHUNKS][PITCH];
    const float si = *si_p;
    const size_t first = gr.block * SUMSQ_CHUNKS;
    const size_t base = first * SUMSQ_BLOCK;
    const int t = threadIdx.x;
    for (int q0 = 0; q0 < WORDS; q0 += SUMSQ_BATCH * 32) {
        // all loads of the batch first (into registers: a load after a
        // shared store through the generic pointer would wait for it)
        uint4 raw[SUMSQ_BATCH];
#pragma unroll
        for (int k = 0; k < SUMSQ_BATCH; k++) {
            const size_t at = base + (size_t)(q0 + k * 32 + t) * EPW;
            raw[k] = (vec && at + EPW <= n) ? reinterpret_cast<const uint4*>(g)[at / EPW] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < SUMSQ_BATCH; k++) {
            const int q = q0 + k * 32 + t;
            const size_t at = base + (size_t)q * EPW;
            const int c = q * EPW / SUMSQ_BLOCK, e = q * EPW % SUMSQ_BLOCK;
            if (!(vec && at + EPW <= n)) {
                // the tail word, or a stream not 16-byte aligned: code by
                // code (past n: code 0, which decodes as +0)
                __align__(16) T codes[EPW];
#pragma unroll
                for (int j = 0; j < EPW; j++) codes[j] = at + j < n ? ((const T*)g)[at + j] : (T)0;
                raw[k] = *reinterpret_cast<const uint4*>(codes);
            }
            *reinterpret_cast<uint4*>(&tile[c][e]) = raw[k];
        }
    }
    __syncwarp();
    const int chunk = t >> 3, lane = t & 7;
    float acc = 0.0f;
#pragma unroll 8
    for (int r = 0; r < SUMSQ_BLOCK / 8; r++) {
        const float x = decode_code<KIND>(tile[chunk][r * 8 + lane], si);
        acc = __fadd_rn(acc, __fmul_rn(x, x));
    }
    // the 8 lanes of one element block are 8 consecutive threads
    double lanes[8];
    const int b0 = t & ~7;
#pragma unroll
    for (int j = 0; j < 8; j++) lanes[j] = (double)__shfl_sync(0xFFFFFFFFu, acc, b0 + j);
    const size_t nchunks = (n + SUMSQ_BLOCK - 1) / SUMSQ_BLOCK;
    double s = lanes[0];
    for (int j = 1; j < 8; j++) s = __dadd_rn(s, lanes[j]);
    if (gr.blocks == 1 && nchunks > 1) {
        // the whole tensor in this block: its total, as sumsq_groups adds
        // a group (from 0, in order), into partials[0] (the total)
        double part[SUMSQ_CHUNKS];
#pragma unroll
        for (int c = 0; c < SUMSQ_CHUNKS; c++) part[c] = __shfl_sync(0xFFFFFFFFu, s, c * 8);
        if (t == 0) {
            double total = 0.0;
#pragma unroll
            for (int c = 0; c < SUMSQ_CHUNKS; c++)
                if (c < (int)nchunks) total = __dadd_rn(total, part[c]);
            partials[0] = total;
        }
    } else if (lane == 0 && first + chunk < nchunks) {
        partials[first + chunk] = s;
    }
}

// One kernel per kind: each holds only its kind's registers.
#define SUMSQ_PARTIALS(NAME, KIND)                                                                     \
    extern "C" __global__ void __launch_bounds__(32)                                                   \
        sumsq_partials_##NAME(const void* g, const float* si, size_t n, int vec, double* partials,     \
                              uint32_t* counter) {                                                     \
        sumsq_partials_impl<KIND>(g, si, n, vec, partials, counter, grid_of_launch());                 \
    }
SUMSQ_PARTIALS(0, K_E4M3)
SUMSQ_PARTIALS(1, K_E5M2)
SUMSQ_PARTIALS(2, K_F16)
SUMSQ_PARTIALS(3, K_F32)

// groups[b] = partials[256 b] + ... in order (from 0). A block per group.
// With more than one group, the last block to finish (`counter`, zeroed by
// sumsq_partials) adds the groups' sums in order (from 0) into `total`, as
// a launch of its own did (sumsq_total): each block's thread 0 fences its
// sum before it counts, the last block fences again and reads the sums
// through L2 (__ldcg: no stale L1 line), 256 at a time into shared memory,
// and thread 0 adds them.
// One group's block (`block` of `blocks`, the tensor's groups) of
// sumsq_groups, a kernel of its own or a part of sumsq_groups_many.
__device__ void sumsq_groups_impl(const double* partials, size_t count, double* groups, double* total,
                                  uint32_t* counter, size_t block, size_t blocks) {
    __shared__ double tile[SUMSQ_GROUP];
    __shared__ bool last;
    const size_t at = block * SUMSQ_GROUP;
    const size_t len = min((size_t)SUMSQ_GROUP, count - at);
    if (threadIdx.x < len) tile[threadIdx.x] = partials[at + threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0.0;
        for (size_t j = 0; j < len; j++) s = __dadd_rn(s, tile[j]);
        groups[block] = s;
        if (blocks > 1) {
            __threadfence();
            last = atomicAdd(counter, 1u) == blocks - 1;
        }
    }
    if (blocks == 1) return;  // `groups` is the total itself
    __syncthreads();
    if (!last) return;
    __threadfence();
    double t = 0.0;
    for (size_t g0 = 0; g0 < blocks; g0 += SUMSQ_GROUP) {
        const size_t i = g0 + threadIdx.x;
        tile[threadIdx.x] = i < blocks ? __ldcg(&groups[i]) : 0.0;
        __syncthreads();
        if (threadIdx.x == 0) {
            const size_t n = min((size_t)SUMSQ_GROUP, blocks - g0);
            for (size_t j = 0; j < n; j++) t = __dadd_rn(t, tile[j]);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *total = t;
}

extern "C" __global__ void sumsq_groups(const double* partials, size_t count, double* groups, double* total,
                                        uint32_t* counter) {
    sumsq_groups_impl(partials, count, groups, total, counter, blockIdx.x, gridDim.x);
}

// The sums of squares of many gradients of one kind in two launches
// (`SumSqMany` of optim/src/sum_sq_many.rs; included by lowbit.cu after
// sumsq.cuh): the weight gradients of a GPT are about a hundred tensors of
// a few million elements, whose two launches each took 5-10 us of the GPU
// for 1-2 us of reading. Each CUDA block finds its tensor's descriptor (a
// binary search over the first blocks) and runs the single-tensor code as
// that block of the tensor's own grid, so every total has the bits of the
// per-tensor launches.

// One gradient (`ManyDesc` of optim/src/cuda_sum_sq_many.rs).
struct ManyDesc {
    const void* g;
    const float* si;
    size_t n;
    int vec;
    int _pad;
    double* partials;   // its element blocks' sums; its total where one CUDA block of partials covers it
    double* groups;     // its groups' sums (the total where it has one group)
    double* total;
    uint32_t* counter;  // null unless it has more than one group
    uint64_t block0;    // its first CUDA block of sumsq_partials_many
    uint64_t group0;    // its first CUDA block of sumsq_groups_many (its groups: none where one CUDA block of partials covers it)
};

// The last descriptor whose first block (`group` false) or first group
// (`group` true) is at most b: the one b belongs to (a descriptor without
// groups has the next one's first group, so it is never the last such).
__device__ __forceinline__ int many_find(const ManyDesc* d, int count, uint64_t b, bool group) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if ((group ? d[mid].group0 : d[mid].block0) <= b) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

#define SUMSQ_MANY(NAME, KIND)                                                                          \
    extern "C" __global__ void __launch_bounds__(32)                                                    \
        sumsq_partials_many_##NAME(const ManyDesc* d, int count, uint64_t blocks) {                     \
        const int i = many_find(d, count, blockIdx.x, false);                                           \
        const ManyDesc& t = d[i];                                                                       \
        const uint64_t end = i + 1 < count ? d[i + 1].block0 : blocks;                                  \
        sumsq_partials_impl<KIND>(t.g, t.si, t.n, t.vec, t.partials, t.counter,                         \
                                  Grid{blockIdx.x - t.block0, end - t.block0});                         \
    }
SUMSQ_MANY(0, K_E4M3)
SUMSQ_MANY(1, K_E5M2)
SUMSQ_MANY(2, K_F16)
SUMSQ_MANY(3, K_F32)

// sumsq_groups for every descriptor with groups: `groups` CUDA blocks in all.
extern "C" __global__ void sumsq_groups_many(const ManyDesc* d, int count, uint64_t groups) {
    const int i = many_find(d, count, blockIdx.x, true);
    const ManyDesc& t = d[i];
    const uint64_t end = i + 1 < count ? d[i + 1].group0 : groups;
    const size_t chunks = (t.n + SUMSQ_BLOCK - 1) / SUMSQ_BLOCK;
    sumsq_groups_impl(t.partials, chunks, t.groups, t.total, t.counter, blockIdx.x - t.group0, end - t.group0);
}

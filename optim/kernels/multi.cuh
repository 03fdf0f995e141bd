// One launch over many small tensors, a tensor a block (included by
// lowbit.cu after the kernels it reuses): the biases and LayerNorm
// parameters of a GPT are a few hundred tensors of at most 8192 elements,
// whose launches (two for the sum of squares and the step each) cost more
// than their work. Each block reads its tensor's descriptor and runs the
// single-tensor code as a grid of one block, so every result has the bits
// of the per-tensor launches.

// lowbit_one's arguments for one tensor (`OneDesc` of optim/src/multi.rs).
struct OneDesc {
    Streams s;
    Outs o;
    Adam k;
    size_t n;
    int vec;
    const float* copy_si;
    uint32_t* amax;
};

// A block a tensor, a few hundred blocks: occupancy does not matter, so
// the registers are not capped at 4 blocks an SM's 64 (the runtime-kind
// step spilled 120 bytes a thread under it).
extern "C" __global__ void __launch_bounds__(256, 2) lowbit_multi(const OneDesc* d, const float* gmul) {
    const OneDesc& t = d[blockIdx.x];
    Adam k = t.k;
    k.grad_mul = *gmul;
    one_impl<-1, -1, -1, -1>(t.s, k, t.n, t.vec, t.copy_si, t.o, t.amax);
}

// sumsq_partials_3's arguments for one F32 gradient of at most
// SUMSQ_CHUNKS element blocks (`SumDesc` of optim/src/multi.rs), whose one
// CUDA block writes the total.
struct SumDesc {
    const void* g;
    const float* si;
    size_t n;
    int vec;
    double* out;
};

extern "C" __global__ void __launch_bounds__(32) sumsq_multi_3(const SumDesc* d) {
    const SumDesc& t = d[blockIdx.x];
    sumsq_partials_impl<K_F32>(t.g, t.si, t.n, t.vec, t.out, nullptr, Grid{0, 1});
}

// Pass 2 of many tensors' steps in one launch (`flush_fixes` of
// optim/src/cuda_multi.rs), after every tensor's pass 1 (`lowbit_step_*`)
// has been launched: the grid loops over the tensors, each taken as its
// own lowbit_fix launch takes it (the same grid-stride sweep; its result
// does not depend on the grid). Where no scale moved (most steps) a
// tensor costs every block a few loads, where its own launch cost a few
// microseconds of an otherwise idle GPU.
#define LOWBIT_FIX_MANY(NAME, WK, GK, MK, VK)                                                          \
    extern "C" __global__ void __launch_bounds__(256, 4)                                               \
        lowbit_fix_many_##NAME(const OneDesc* d, int count, const float* gmul) {                      \
        const float gm = *gmul;                                                                        \
        for (int t = 0; t < count; t++) {                                                              \
            const OneDesc& x = d[t];                                                                   \
            Adam k = x.k;                                                                              \
            k.grad_mul = gm;                                                                           \
            fix_impl<WK, GK, MK, VK>(x.s, k, x.n, x.vec, x.copy_si, x.amax, x.o, grid_of_launch());     \
        }                                                                                              \
    }
LOWBIT_FIX_MANY(any, -1, -1, -1, -1)
LOWBIT_FIX_MANY(2002, K_F16, K_E4M3, K_E4M3, K_F16)
LOWBIT_FIX_MANY(2033, K_F16, K_E4M3, K_F32, K_F32)
LOWBIT_FIX_MANY(3302, K_F32, K_F32, K_E4M3, K_F16)
LOWBIT_FIX_MANY(3333, K_F32, K_F32, K_F32, K_F32)
LOWBIT_FIX_MANY(2004, K_F16, K_E4M3, K_E4M3, K_E4M3_SQRT)
LOWBIT_FIX_MANY(3304, K_F32, K_F32, K_E4M3, K_E4M3_SQRT)

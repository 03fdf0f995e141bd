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

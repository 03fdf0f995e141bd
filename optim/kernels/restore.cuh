// A skipped step's outputs put back on the device (`RestoreOnSkip` of
// optim/src/restore.rs): where the step's gradient multiplier is NaN (the
// skip decision of clip.cuh, which the lowbit kernels also read and then
// return at once, leaving their outputs unwritten), every descriptor's
// bytes are copied from the state before the step into the output that
// replaces it, so the new weight, moments and scales are the old ones bit
// for bit and the host need not learn the outcome before it goes on.
// Where the multiplier is a number, every block returns at once.
// A block a descriptor; 16-byte words where both ends are aligned and the
// length is a multiple of 16, bytes otherwise.

struct CopyDesc {
    unsigned char* dst;
    const unsigned char* src;
    size_t bytes;
};

extern "C" __global__ void __launch_bounds__(256) restore_on_skip(const CopyDesc* d, const float* gmul) {
    if (!isnan(*gmul)) return;
    const CopyDesc t = d[blockIdx.x];
    const bool wide = ((size_t)t.dst % 16 == 0) && ((size_t)t.src % 16 == 0) && (t.bytes % 16 == 0);
    if (wide) {
        uint4* dst = reinterpret_cast<uint4*>(t.dst);
        const uint4* src = reinterpret_cast<const uint4*>(t.src);
        for (size_t i = threadIdx.x; i < t.bytes / 16; i += blockDim.x) dst[i] = src[i];
    } else {
        for (size_t i = threadIdx.x; i < t.bytes; i += blockDim.x) t.dst[i] = t.src[i];
    }
}

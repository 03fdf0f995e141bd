// The step's global gradient norm, skip decision and gradient multiplier on
// the device (`ClipCoef` of optim/src/clip.rs), so that the host enqueues
// the update without waiting for the sums: `vals` holds every parameter's
// sum of squares (n_sums, in parameter order) and then the amax of every
// scaled gradient's source (NaN where a cast saw inf or NaN). One block;
// thread 0 adds in order, as the CPU body does, in f64 with one rounding
// per operation (-fmad=false and _rn intrinsics):
//   sum = sums[0] + sums[1] + ...;  inf where any amax is not finite
//   skip:    gmul = NaN (every lowbit kernel then returns at once)
//   applied: norm = sqrt(sum) * inv_scale
//            clip = max > 0 ? min(max / (norm + 1e-6), 1) : 1
//            gmul = (float)(inv_scale * clip)
// out: [sum, norm] (f64), gmul (f32).

#define CLIP_CHUNK 1024

extern "C" __global__ void grad_clip(const double* vals, unsigned n_sums, unsigned n, double inv_scale,
                                     double max_norm, double* out, float* gmul) {
    __shared__ double chunk[CLIP_CHUNK];
    double sum = 0.0;
    bool finite_amax = true;
    for (unsigned at = 0; at < n; at += CLIP_CHUNK) {
        const unsigned len = min(n - at, (unsigned)CLIP_CHUNK);
        for (unsigned i = threadIdx.x; i < len; i += blockDim.x) chunk[i] = vals[at + i];
        __syncthreads();
        if (threadIdx.x == 0) {
            for (unsigned i = 0; i < len; i++) {
                if (at + i < n_sums) sum = __dadd_rn(sum, chunk[i]);
                else if (!isfinite(chunk[i])) finite_amax = false;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    if (!finite_amax) sum = __longlong_as_double(0x7FF0000000000000LL);
    if (!isfinite(sum)) {
        out[0] = sum;
        out[1] = __longlong_as_double(0x7FF8000000000000LL);
        *gmul = __uint_as_float(0x7FC00000u);
        return;
    }
    const double norm = __dmul_rn(__dsqrt_rn(sum), inv_scale);
    double clip = 1.0;
    if (max_norm > 0.0) {
        const double c = __ddiv_rn(max_norm, __dadd_rn(norm, 1e-6));
        clip = c < 1.0 ? c : 1.0;
    }
    out[0] = sum;
    out[1] = norm;
    *gmul = __double2float_rn(__dmul_rn(inv_scale, clip));
}

// blockscale_probe.cu: cuBLASLt's own speed for the FP8 GEMMs candle-amp
// runs (BF16, per-tensor FP8, and the block-scaled modes: 1x128 x 128x128,
// 1x128 x 1x128, 128x128 x 1x128, rowwise), with nothing of ours around
// it: the floor our `block_gemm` is compared with (BENCHMARKS.md). Same
// timing as `cuda_check --block-only`: CUDA events around 30 back-to-back
// calls after 5, BF16 output, TN layout, no fast accumulation. The
// operands hold pseudo-random values (E4M3 codes of magnitude 1/4 to 4 with
// random signs; BF16 the same values): constant or zero data draws less
// power and runs the tensor cores faster than training data does. Scales
// are 1 (their values do not change the speed; `tests/gpu/block.rs` checks
// the layouts with scales that differ).
//
//   scripts/gpu/build-probe.sh          # here: nvcc 13.0, -lcublasLt
//   blockscale_probe                    # on the GPU: 8192^3 and the GPT shapes
//   blockscale_probe M K N              # one shape (m tokens, k in, n out)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>

#define CUDA_OK(x)                                                                      \
    do {                                                                                \
        cudaError_t err_ = (x);                                                         \
        if (err_ != cudaSuccess) {                                                      \
            fprintf(stderr, "CUDA error %s (line %d)\n", cudaGetErrorString(err_), __LINE__); \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

// A hash of the index: the same pseudo-random data on every run.
__device__ unsigned mix(size_t i, unsigned seed) {
    unsigned h = (unsigned)i * 0x9E3779B1u ^ seed;
    h ^= h >> 15;
    h *= 0x85EBCA77u;
    h ^= h >> 13;
    return h;
}

// E4M3 codes 0x28..0x47 (1/4 to 3.75) with a random sign bit.
__global__ void fill_codes(unsigned char* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const unsigned h = mix(i, seed);
        p[i] = (unsigned char)(0x28 + (h & 0x1F)) | (unsigned char)((h >> 8) & 0x80);
    }
}

// BF16 values of the same range: exponent -2..1, random mantissa and sign.
__global__ void fill_bf16(unsigned short* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const unsigned h = mix(i, seed);
        p[i] = (unsigned short)(((125u + (h & 3u)) << 7) | ((h >> 4) & 0x7Fu) | ((h >> 8) & 0x8000u));
    }
}

static cublasLtHandle_t handle;
static void* workspace;
static const size_t WORKSPACE = 32u << 20;

// One GEMM's milliseconds per call, or a negative number where cuBLASLt has
// no algorithm. Our layout: y [m, n] = a [m, k] . b [n, k]^T, which is
// cuBLASLt's D (n x m) = op(A) op(B) with A = b (transposed), B = a.
static double time_gemm(int m, int k, int n, cudaDataType_t in, const void* a, const void* b, void* d,
                        int mode_a, int mode_b, const float* scale_a, const float* scale_b) {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    if (cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return -1;
    cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt);
    if (in != CUDA_R_16BF) {
        // cuBLASLt's A is our b: its scales and mode are b's
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_b, sizeof scale_b);
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_a, sizeof scale_a);
        if (mode_a || mode_b) {
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_b, sizeof mode_b);
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_a, sizeof mode_a);
        }
    }
    cublasLtMatrixLayoutCreate(&la, in, k, n, k);
    cublasLtMatrixLayoutCreate(&lb, in, k, m, k);
    cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, n, m, n);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    size_t ws = WORKSPACE;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    double ms = -1;
    if (cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, 1, &heur, &found) ==
            CUBLAS_STATUS_SUCCESS && found > 0) {
        const float alpha = 1.0f, beta = 0.0f;
        bool ok = true;
        auto call = [&]() {
            ok &= cublasLtMatmul(handle, desc, &alpha, b, la, a, lb, &beta, d, ld, d, ld, &heur.algo, workspace,
                                 WORKSPACE, 0) == CUBLAS_STATUS_SUCCESS;
        };
        for (int i = 0; i < 5; i++) call();
        cudaEvent_t e0, e1;
        CUDA_OK(cudaEventCreate(&e0));
        CUDA_OK(cudaEventCreate(&e1));
        CUDA_OK(cudaEventRecord(e0));
        for (int i = 0; i < 30; i++) call();
        CUDA_OK(cudaEventRecord(e1));
        CUDA_OK(cudaEventSynchronize(e1));
        float total;
        CUDA_OK(cudaEventElapsedTime(&total, e0, e1));
        ms = ok ? total / 30.0 : -1;
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    return ms;
}

static void shape(const char* name, int m, int k, int n) {
    const size_t na = (size_t)m * k, nb = (size_t)n * k;
    void *a, *b, *a16, *b16, *d;
    float* ones;
    const size_t n_scales = (size_t)(m + n + 256) * (k / 128 + 8);
    CUDA_OK(cudaMalloc(&a, na));
    CUDA_OK(cudaMalloc(&b, nb));
    CUDA_OK(cudaMalloc(&a16, 2 * na));
    CUDA_OK(cudaMalloc(&b16, 2 * nb));
    CUDA_OK(cudaMalloc(&d, 2 * (size_t)m * n));
    CUDA_OK(cudaMalloc(&ones, 4 * n_scales));
    fill_codes<<<1024, 256>>>((unsigned char*)a, na, 1);
    fill_codes<<<1024, 256>>>((unsigned char*)b, nb, 2);
    fill_bf16<<<1024, 256>>>((unsigned short*)a16, na, 1);
    fill_bf16<<<1024, 256>>>((unsigned short*)b16, nb, 2);
    CUDA_OK(cudaGetLastError());
    float* host = (float*)malloc(4 * n_scales);
    for (size_t i = 0; i < n_scales; i++) host[i] = 1.0f;
    CUDA_OK(cudaMemcpy(ones, host, 4 * n_scales, cudaMemcpyHostToDevice));
    free(host);
    const double flop = 2.0 * m * (double)n * k;
    auto tf = [&](double ms) { return ms > 0 ? flop / (ms * 1e-3) / 1e12 : -1.0; };
    const int S = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, V = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
              B = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, O = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    const double bf16 = time_gemm(m, k, n, CUDA_R_16BF, a16, b16, d, S, S, nullptr, nullptr);
    const double pt = time_gemm(m, k, n, CUDA_R_8F_E4M3, a, b, d, S, S, ones, ones);
    printf("PROBE block_gemm shape=%s m=%d k=%d n=%d bf16_tflops=%.1f per_tensor_tflops=%.1f", name, m, k, n,
           tf(bf16), tf(pt));
    const struct {
        const char* label;
        int a, b;
    } modes[] = {{"1x128_128x128", V, B}, {"1x128_1x128", V, V}, {"128x128_1x128", B, V}, {"rowwise", O, O}};
    for (const auto& md : modes) {
        const double ms = time_gemm(m, k, n, CUDA_R_8F_E4M3, a, b, d, md.a, md.b, ones, ones);
        printf(" %s_tflops=%.1f", md.label, tf(ms));
    }
    printf("\n");
    cudaFree(a);
    cudaFree(b);
    cudaFree(a16);
    cudaFree(b16);
    cudaFree(d);
    cudaFree(ones);
}

int main(int argc, char** argv) {
    if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cublasLtCreate failed\n");
        return 1;
    }
    CUDA_OK(cudaMalloc(&workspace, WORKSPACE));
    if (argc == 4) {
        shape("custom", atoi(argv[1]), atoi(argv[2]), atoi(argv[3]));
        return 0;
    }
    const struct {
        const char* name;
        int m, k, n;
    } shapes[] = {{"8192^3", 8192, 8192, 8192},     {"350m.qkv", 8192, 1024, 3072}, {"350m.proj", 8192, 1024, 1024},
                  {"350m.fc1", 8192, 1024, 4096},   {"350m.fc2", 8192, 4096, 1024}, {"1.3b.qkv", 8192, 2048, 6144},
                  {"1.3b.proj", 8192, 2048, 2048}, {"1.3b.fc1", 8192, 2048, 8192}, {"1.3b.fc2", 8192, 8192, 2048}};
    for (const auto& s : shapes) shape(s.name, s.m, s.k, s.n);
    return 0;
}

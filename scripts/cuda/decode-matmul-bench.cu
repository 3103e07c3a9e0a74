// The decode matmul kernel (crates/kernels/cuda/matmul.cu) alone, on the 4B shape's decode-step
// matrices: 24 DeltaNet and 8 attention layers (every fourth) of in / out / gate-up / down
// projections and the 248K-row output head, 8.4 GB of random bf16 weights, launched back to back
// in a CUDA graph as programmatic dependents (as strata launches them). Prints the GPU's read
// bandwidth (one kernel reading the output head) and, per split (warps per weight row; strata
// gives all of these matrices 2) and input-row count, the whole step's matmul time and each
// shape's time per launch.
//
// Build (here, no GPU needed):
//   source scripts/cuda/env.sh
//   nvcc -O3 -std=c++17 -arch=sm_90a -o decode-matmul-bench scripts/cuda/decode-matmul-bench.cu -L"$CUDA_ROOT/lib"
// Run on the GPU machine: ./decode-matmul-bench
#include "../../crates/kernels/cuda/matmul.cu"
#include "bench-common.cuh"

struct Matrix {
    int n, k;
    bf16* w;
};

using Kernel = void (*)(const bf16*, long long, const bf16*, bf16*, int, int);

// `m` input rows against `mat`, `split` warps per weight row (2 or 4, the instances the kernel
// has; strata's launcher in crates/kernels/src/matmul.rs picks one by the row count).
static void launch(cudaStream_t stream, const Matrix& mat, const bf16* x, bf16* y, int m, int split) {
    const Kernel two[4] = {matmul_rows1_s2_bf16, matmul_rows2_s2_bf16, matmul_rows3_s2_bf16, matmul_rows4_s2_bf16};
    const Kernel four[4] = {matmul_rows1_s4_bf16, matmul_rows2_s4_bf16, matmul_rows3_s4_bf16, matmul_rows4_s4_bf16};
    const dim3 grid((mat.n * split + ROWS_WARPS - 1) / ROWS_WARPS), block(ROWS_WARPS * 32);
    dependent(stream, grid, block, split == 4 ? four[m - 1] : two[m - 1], x, (long long)mat.k, (const bf16*)mat.w, y,
              mat.k, mat.n);
}

int main() {
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::vector<Matrix> step;
    for (const Shape& shape : decode_step_shapes()) step.push_back({shape.n, shape.k, nullptr});
    double bytes = 0;
    for (Matrix& mat : step) {
        CHECK(cudaMalloc(&mat.w, (size_t)mat.n * mat.k * sizeof(bf16)));
        fill<<<1024, 256, 0, stream>>>(mat.w, (long long)mat.n * mat.k, mat.n ^ mat.k);
        bytes += 2.0 * mat.n * mat.k;
    }
    bf16 *x, *y;
    float* sink;
    CHECK(cudaMalloc(&x, MAX_INPUT_ROWS * 9216 * sizeof(bf16)));
    CHECK(cudaMalloc(&y, MAX_INPUT_ROWS * 248320 * sizeof(bf16)));
    CHECK(cudaMalloc(&sink, sizeof(float)));
    fill<<<16, 256, 0, stream>>>(x, MAX_INPUT_ROWS * 9216, 7);
    CHECK(cudaStreamSynchronize(stream));

    const Matrix& head = step.back();
    const double read_us = graph_us(stream, 30, [&] {
        read_all<<<prop.multiProcessorCount * 8, 256, 0, stream>>>(reinterpret_cast<const uint4*>(head.w),
                                                                    (long long)head.n * head.k / 8, sink);
    });
    std::printf("%s: %zu matrices, %.2f GB; one kernel reading the output head: %.0f GB/s\n", prop.name, step.size(),
                bytes / 1e9, 2.0 * head.n * head.k / read_us / 1e3);
    const char* names[4] = {"in (12352 or 10240 x 2560)", "out (2560 x 4096)", "gate-up (18432 x 2560)", "down (2560 x 9216)"};
    for (int split : {2, 4}) {
        for (int m = 1; m <= MAX_INPUT_ROWS; ++m) {
            const double us = graph_us(stream, 30, [&] {
                for (const Matrix& mat : step) launch(stream, mat, x, y, m, split);
            });
            std::printf("split %d, %d row(s): step %.1f us (%.0f GB/s); per launch:", split, m, us, bytes / us / 1e3);
            for (int shape = 0; shape < 4; ++shape) {
                const double t = graph_us(stream, 30, [&] {
                    for (size_t i = shape; i + 1 < step.size(); i += 4) launch(stream, step[i], x, y, m, split);
                });
                std::printf(" %s %.2f us,", names[shape], t / 32);
            }
            std::printf(" head %.1f us\n", graph_us(stream, 30, [&] { launch(stream, head, x, y, m, split); }));
        }
    }
    return 0;
}

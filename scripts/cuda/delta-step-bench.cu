// The gated delta step kernel (crates/kernels/cuda/recurrent.cu) alone, as a decode step of the 4B
// shape runs it: 24 DeltaNet layers (32 value heads, 16 key heads, 128 x 128 state per head), each
// with its own state pool read and written in place at the rows' slots, launched back to back in a
// CUDA graph as programmatic dependents. Prints, per state dtype, rows and tokens per row, the
// time per launch and the state bandwidth it reaches (bytes read and written / time), beside a
// device-to-device copy of one layer's state (the limit: the same bytes read and written).
//
// Build (here, no GPU needed):
//   source scripts/cuda/env.sh
//   nvcc -O3 -std=c++17 -arch=sm_90a -o delta-step-bench scripts/cuda/delta-step-bench.cu -L"$CUDA_ROOT/lib"
// Another version of the kernel: -DRECURRENT='"path/to/recurrent.cu"' with -DSTEPS_F32 and
// -DSTEPS_BF16 naming its kernels for f32 and bf16 states (bf16 inputs).
// Run on the GPU machine: ./delta-step-bench
#ifndef RECURRENT
#define RECURRENT "../../crates/kernels/cuda/recurrent.cu"
#endif
#ifndef STEPS_F32
#define STEPS_F32 gated_delta_steps_k128_bf16
#define STEPS_BF16 gated_delta_steps_bf16_state_k128_bf16
#endif
#include RECURRENT
#include "bench-common.cuh"

constexpr int LAYERS = 24, HK = 16, HV = 32, D = 128, MAX_ROWS = 256, MAX_TOKENS = 4;

__global__ void fill_f32(float* p, long long n, float range) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u;
        h ^= h >> 13;
        p[i] = ((h & 0xffff) / 65536.0f - 0.5f) * range;
    }
}

template <typename S>
using Steps = void (*)(const bf16*, const bf16*, const bf16*, long long, long long, long long, const bf16*, const bf16*,
                       long long, const float*, const float*, const S*, S*, const int*, float*, int, int, int, int, int,
                       int);

template <typename S>
static void run(cudaStream_t stream, Steps<S> kernel, const char* name) {
    const int conv = 2 * HK * D + HV * D;  // q, k, v of one token, as the model cuts them
    bf16 *mixed, *gates;
    float *a_log, *dt_bias, *out;
    int* slots;
    CHECK(cudaMalloc(&mixed, (size_t)MAX_ROWS * MAX_TOKENS * conv * sizeof(bf16)));
    CHECK(cudaMalloc(&gates, (size_t)MAX_ROWS * MAX_TOKENS * 2 * HV * sizeof(bf16)));
    CHECK(cudaMalloc(&a_log, HV * sizeof(float)));
    CHECK(cudaMalloc(&dt_bias, HV * sizeof(float)));
    CHECK(cudaMalloc(&out, (size_t)MAX_ROWS * MAX_TOKENS * HV * D * sizeof(float)));
    CHECK(cudaMalloc(&slots, MAX_ROWS * sizeof(int)));
    fill<<<256, 256, 0, stream>>>(mixed, (long long)MAX_ROWS * MAX_TOKENS * conv, 1, 2.0f);
    fill<<<256, 256, 0, stream>>>(gates, (long long)MAX_ROWS * MAX_TOKENS * 2 * HV, 2, 4.0f);
    fill_f32<<<1, 32, 0, stream>>>(a_log, HV, 1.0f);
    fill_f32<<<1, 32, 0, stream>>>(dt_bias, HV, 1.0f);
    std::vector<int> order(MAX_ROWS);
    for (int i = 0; i < MAX_ROWS; ++i) order[i] = (i * 37) % MAX_ROWS;  // slots out of row order
    CHECK(cudaMemcpy(slots, order.data(), MAX_ROWS * sizeof(int), cudaMemcpyHostToDevice));
    const size_t per_row = (size_t)HV * D * D;
    std::vector<S*> pools(LAYERS);
    for (S*& pool : pools) {
        CHECK(cudaMalloc(&pool, MAX_ROWS * per_row * sizeof(S)));
        CHECK(cudaMemsetAsync(pool, 0, MAX_ROWS * per_row * sizeof(S), stream));
    }
    S* copy;
    CHECK(cudaMalloc(&copy, MAX_ROWS * per_row * sizeof(S)));
    for (int tokens : {1, 4}) {
        for (int rows : {1, 8, 64, 128, 256}) {
            const long long stride = conv;  // between tokens
            const dim3 grid(rows * HV, D / BLOCK_ROWS), block(DELTA_WARPS * 32);
            const size_t shared = 2 * std::min(tokens, TOKEN_TILE) * D * sizeof(float);
            const double us = graph_us(stream, 20, [&] {
                for (S* pool : pools) {
                    dependent_shared(stream, grid, block, shared, kernel, (const bf16*)mixed, (const bf16*)(mixed + HK * D),
                                     (const bf16*)(mixed + 2 * HK * D), stride, stride, stride, (const bf16*)gates,
                                     (const bf16*)(gates + HV), (long long)(2 * HV), (const float*)a_log,
                                     (const float*)dt_bias, (const S*)pool, pool, (const int*)slots, out, rows, tokens,
                                     HK, HV, D, D);
                }
            }) / LAYERS;
            const double bytes = 2.0 * rows * per_row * sizeof(S);
            const double copy_us = time_us(stream, 20, [&] {
                CHECK(cudaMemcpyAsync(copy, pools[0], rows * per_row * sizeof(S), cudaMemcpyDeviceToDevice, stream));
            });
            std::printf("%-10s rows %3d tokens %d: %8.1f us a launch, %6.0f GB/s of state (copy of the same: %7.1f us, %6.0f GB/s)\n",
                        name, rows, tokens, us, bytes / us * 1e-3, copy_us, bytes / copy_us * 1e-3);
        }
    }
    for (S* pool : pools) CHECK(cudaFree(pool));
    free_all({copy, mixed, gates, out, a_log, dt_bias, slots});
}

int main() {
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    run<float>(stream, STEPS_F32, "f32 state");
    run<bf16>(stream, STEPS_BF16, "bf16 state");
    CHECK(cudaStreamSynchronize(stream));
    return 0;
}

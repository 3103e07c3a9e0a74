// A mixture of experts' decode pass alone (crates/kernels/cuda/experts.cu and matmul.cu's
// gathered matmul), on the 35B-A3B shape's experts: 256 of them a layer, 8 a token, gate-up
// [1024, 2048] and down [2048, 512] in bf16, over 8 layers of random weights (12.9 GB, so a
// step's experts come from memory, not the L2 cache). Per batch size (1, 8, 64 tokens) it prints
// a layer's time for the route, both gathered projections and the weighted sum, and the bytes of
// the distinct experts the batch reads over that time; for each projection, per warps a weight
// row (1, 2, 4; strata takes 4 below 2048 rows, else 2), the projection's own time and rate. The
// GPU's read bandwidth is measured first.
//
// Build (here, no GPU needed):
//   source scripts/cuda/env.sh
//   nvcc -O3 -std=c++17 -arch=sm_90a -o moe-matmul-bench scripts/cuda/moe-matmul-bench.cu -L"$CUDA_ROOT/lib"
// Run on the GPU machine: ./moe-matmul-bench
#include "../../crates/kernels/cuda/matmul.cu"
#undef INSTANTIATE
#include "../../crates/kernels/cuda/experts.cu"
#include "bench-common.cuh"

#include <set>

constexpr int EXPERTS = 256, PER_TOKEN = 8, HIDDEN = 2048, INTER = 512, LAYERS = 8;

// The gathered matmul with one warp a weight row, which strata has no instance of.
__global__ void __launch_bounds__(ROWS_WARPS * 32) matmul_gathered_s1_bf16(const bf16* x, long long x_stride, const bf16* w,
                                                                           bf16* y, int K, int N, int E, const unsigned* experts,
                                                                           const unsigned* order, int per_input) {
    matmul_gathered<bf16, 1>(x, x_stride, w, y, K, N, E, experts, order, per_input);
}

using Gathered = void (*)(const bf16*, long long, const bf16*, bf16*, int, int, int, const unsigned*, const unsigned*, int);

static Gathered gathered(int split) {
    return split == 1 ? matmul_gathered_s1_bf16 : split == 2 ? matmul_gathered_s2_bf16 : matmul_gathered_s4_bf16;
}

// `pairs` pairs of x's rows (pairs / per_input of them) against w [EXPERTS, n, k].
static void project(cudaStream_t stream, int split, const bf16* x, const bf16* w, bf16* y, int n, int k, int pairs,
                    const unsigned* experts, const unsigned* order, int per_input) {
    const dim3 grid((n * split + ROWS_WARPS - 1) / ROWS_WARPS, pairs), block(ROWS_WARPS * 32);
    dependent(stream, grid, block, gathered(split), x, (long long)k, w, y, k, n, EXPERTS, experts, order, per_input);
}

int main() {
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    const long long gate_up_size = (long long)EXPERTS * 2 * INTER * HIDDEN, down_size = (long long)EXPERTS * HIDDEN * INTER;
    std::vector<bf16*> gate_up(LAYERS), down(LAYERS);
    for (int l = 0; l < LAYERS; ++l) {
        CHECK(cudaMalloc(&gate_up[l], gate_up_size * sizeof(bf16)));
        CHECK(cudaMalloc(&down[l], down_size * sizeof(bf16)));
        fill<<<4096, 256, 0, stream>>>(gate_up[l], gate_up_size, 2 * l);
        fill<<<4096, 256, 0, stream>>>(down[l], down_size, 2 * l + 1);
    }
    constexpr int MAX_TOKENS = 64, MAX_PAIRS = MAX_TOKENS * PER_TOKEN;
    bf16 *logits, *x, *h, *act, *y, *out;
    unsigned *experts, *order;
    float *weights, *sink;
    CHECK(cudaMalloc(&logits, MAX_TOKENS * EXPERTS * sizeof(bf16)));
    CHECK(cudaMalloc(&x, MAX_TOKENS * HIDDEN * sizeof(bf16)));
    CHECK(cudaMalloc(&h, MAX_PAIRS * 2 * INTER * sizeof(bf16)));
    CHECK(cudaMalloc(&act, MAX_PAIRS * INTER * sizeof(bf16)));
    CHECK(cudaMalloc(&y, MAX_PAIRS * HIDDEN * sizeof(bf16)));
    CHECK(cudaMalloc(&out, MAX_TOKENS * HIDDEN * sizeof(bf16)));
    CHECK(cudaMalloc(&experts, MAX_PAIRS * sizeof(unsigned)));
    CHECK(cudaMalloc(&order, MAX_PAIRS * sizeof(unsigned)));
    CHECK(cudaMalloc(&weights, MAX_PAIRS * sizeof(float)));
    CHECK(cudaMalloc(&sink, sizeof(float)));
    fill<<<64, 256, 0, stream>>>(logits, MAX_TOKENS * EXPERTS, 99, 8.0f);
    fill<<<64, 256, 0, stream>>>(x, MAX_TOKENS * HIDDEN, 98, 2.0f);
    fill<<<64, 256, 0, stream>>>(act, MAX_PAIRS * INTER, 97, 2.0f);
    CHECK(cudaStreamSynchronize(stream));

    const double read_us = graph_us(stream, 20, [&] {
        read_all<<<prop.multiProcessorCount * 8, 256, 0, stream>>>(reinterpret_cast<const uint4*>(gate_up[0]),
                                                                    gate_up_size / 8, sink);
    });
    std::printf("%s: %d layers of %d experts (%.1f GB); one kernel reading a layer's gate-up: %.0f GB/s\n", prop.name, LAYERS,
                EXPERTS, LAYERS * 2.0 * (gate_up_size + down_size) / 1e9, 2.0 * gate_up_size / read_us / 1e3);
    const double expert_bytes = 2.0 * (2 * INTER * HIDDEN + HIDDEN * INTER);
    for (int tokens : {1, 8, 64}) {
        const int pairs = tokens * PER_TOKEN;
        const auto route = [&] {
            dependent(stream, dim3(1), dim3(ROUTE_THREADS), moe_route_bf16, (const bf16*)logits, tokens, EXPERTS, PER_TOKEN,
                      experts, weights, order);
        };
        route();
        std::vector<unsigned> picked(pairs);
        CHECK(cudaMemcpyAsync(picked.data(), experts, pairs * sizeof(unsigned), cudaMemcpyDeviceToHost, stream));
        CHECK(cudaStreamSynchronize(stream));
        const size_t distinct = std::set<unsigned>(picked.begin(), picked.end()).size();
        const double bytes = distinct * expert_bytes;
        const double route_us = graph_us(stream, 50, route);
        const double combine_us = graph_us(stream, 50, [&] {
            dependent(stream, dim3(tokens, (HIDDEN + 255) / 256), dim3(256), moe_combine_bf16, (const bf16*)y,
                      (const float*)weights, out, tokens, HIDDEN, PER_TOKEN);
        });
        std::printf("%d token(s), %d pairs, %zu distinct experts (%.1f MB a layer): route %.1f us, weighted sum %.1f us\n",
                    tokens, pairs, distinct, bytes / 1e6, route_us, combine_us);
        for (int split_gate_up : {1, 2, 4}) {
            for (int split_down : {1, 2, 4}) {
                const double us = graph_us(stream, 10, [&] {
                    for (int l = 0; l < LAYERS; ++l) {
                        route();
                        project(stream, split_gate_up, x, gate_up[l], h, 2 * INTER, HIDDEN, pairs, experts, order, PER_TOKEN);
                        project(stream, split_down, act, down[l], y, HIDDEN, INTER, pairs, experts, order, 1);
                        dependent(stream, dim3(tokens, (HIDDEN + 255) / 256), dim3(256), moe_combine_bf16, (const bf16*)y,
                                  (const float*)weights, out, tokens, HIDDEN, PER_TOKEN);
                    }
                }) / LAYERS;
                std::printf("  warps a row: gate-up %d, down %d: a layer %.1f us (%.0f GB/s of distinct experts)\n",
                            split_gate_up, split_down, us, bytes / us / 1e3);
            }
        }
        for (int split : {1, 2, 4}) {
            const double g = graph_us(stream, 10, [&] {
                for (int l = 0; l < LAYERS; ++l)
                    project(stream, split, x, gate_up[l], h, 2 * INTER, HIDDEN, pairs, experts, order, PER_TOKEN);
            }) / LAYERS;
            const double d = graph_us(stream, 10, [&] {
                for (int l = 0; l < LAYERS; ++l) project(stream, split, act, down[l], y, HIDDEN, INTER, pairs, experts, order, 1);
            }) / LAYERS;
            std::printf("  %d warp(s) a row alone: gate-up %.1f us (%.0f GB/s), down %.1f us (%.0f GB/s)\n", split, g,
                        distinct * 2.0 * 2 * INTER * HIDDEN / g / 1e3, d, distinct * 2.0 * HIDDEN * INTER / d / 1e3);
        }
    }
    for (int l = 0; l < LAYERS; ++l) free_all({gate_up[l], down[l]});
    free_all({logits, x, h, act, y, out, experts, order, weights, sink});
    return 0;
}

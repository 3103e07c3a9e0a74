// The split attention kernel (crates/kernels/cuda/attention.cu) alone, as a decode step of the 4B
// shape runs it at long context: 16 query heads over 4 KV heads of 256, one query per row, each
// row's keys and values in blocks of 16 positions of a paged pool (blocks dealt out of order),
// the grouped kernel (4 query heads a block) the model takes for wide grids, launched back to
// back in a CUDA graph as programmatic dependents (one launch per attention layer: 8). Prints, per
// KV format, rows and context, the time per launch and the KV bandwidth it reaches (bytes of
// keys and values read / time), beside a device-to-device copy moving as many bytes (the limit).
// Formats: bf16 KV, affine4 with groups of 64 (a group's bf16 scale and bias after the codes)
// and turbo4 (a bf16 norm after the codes). The pools hold hashed bytes: the kernels' speed does
// not depend on the values.
//
// Build (here, no GPU needed):
//   source scripts/cuda/env.sh
//   nvcc -O3 -std=c++17 -arch=sm_90a -o attention-split-bench scripts/cuda/attention-split-bench.cu -L"$CUDA_ROOT/lib"
// Another version of the kernels: -DATTENTION='"path/to/attention.cu"' (kernels of the same
// names and parameters).
// Run on the GPU machine: ./attention-split-bench
#ifndef ATTENTION
#define ATTENTION "../../crates/kernels/cuda/attention.cu"
#endif
#include ATTENTION
#include "bench-common.cuh"

constexpr int LAYERS = 8, HQ = 16, HKV = 4, D = 256, GROUP_HEADS = 4, BLOCK = 16, SHIFT = 4;
constexpr int MAX_ROWS = 32, MAX_CONTEXT = 32768;

// One KV format: bytes per stored vector (keys and values alike) and how to launch its kernel.
struct Format {
    const char* name;
    int width;  // bytes per head vector
    std::function<void(cudaStream_t, dim3, const bf16*, const uint8_t*, const uint8_t*, const int*, const int*, int, float*, int)>
        launch;
};

int main() {
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    const int max_blocks = MAX_CONTEXT / BLOCK;
    const long long pool_rows = (long long)MAX_ROWS * MAX_CONTEXT;
    bf16* q;
    float *partial, *centroids;
    int *tables, *lens;
    CHECK(cudaMalloc(&q, (size_t)MAX_ROWS * HQ * D * sizeof(bf16)));
    CHECK(cudaMalloc(&partial, (size_t)MAX_ROWS * HQ * (MAX_CONTEXT / SPLIT_KEYS) * (D + 2) * sizeof(float)));
    CHECK(cudaMalloc(&centroids, 16 * sizeof(float)));
    CHECK(cudaMalloc(&tables, (size_t)MAX_ROWS * max_blocks * sizeof(int)));
    CHECK(cudaMalloc(&lens, MAX_ROWS * sizeof(int)));
    fill<<<256, 256, 0, stream>>>(q, (long long)MAX_ROWS * HQ * D, 3, 2.0f);
    std::vector<float> levels(16);
    for (int i = 0; i < 16; ++i) levels[i] = (i - 7.5f) / 8.0f;
    CHECK(cudaMemcpy(centroids, levels.data(), 16 * sizeof(float), cudaMemcpyHostToDevice));
    // Every row's blocks dealt from one shuffled order of the pool's blocks.
    std::vector<int> table((size_t)MAX_ROWS * max_blocks);
    for (size_t i = 0; i < table.size(); ++i) table[i] = (int)((i * 7919) % table.size());
    CHECK(cudaMemcpy(tables, table.data(), table.size() * sizeof(int), cudaMemcpyHostToDevice));
    const float scale = 0.0625f;
    const int codes_width = D * 4 / 8;
    const Format formats[] = {
        {"bf16", D * 2,
         [&](cudaStream_t s, dim3 grid, const bf16* q, const uint8_t* k, const uint8_t* v, const int* tables, const int* lens,
             int max_blocks, float* partial, int splits) {
             dependent(s, grid, dim3(ATTN_WARPS * 32), attention_split_paged_g4_d256_bf16, q, (const bf16*)k, (const bf16*)v,
                       tables, lens, max_blocks, SHIFT, partial, HQ, HKV, 1, D, splits, scale, 0);
         }},
        {"affine4-g64", codes_width + 4 * (D / 64),
         [&](cudaStream_t s, dim3 grid, const bf16* q, const uint8_t* k, const uint8_t* v, const int* tables, const int* lens,
             int max_blocks, float* partial, int splits) {
             const int w = codes_width + 4 * (D / 64);
             dependent(s, grid, dim3(ATTN_WARPS * 32), attention_split_codes_g4_d256_bf16, q, k, v, tables, lens, max_blocks,
                       SHIFT, partial, HQ, HKV, 1, D, splits, scale, 0, 4, 64, w, (const float*)nullptr, 4, 64, w,
                       (const float*)nullptr);
         }},
        {"turbo4", codes_width + 2,
         [&](cudaStream_t s, dim3 grid, const bf16* q, const uint8_t* k, const uint8_t* v, const int* tables, const int* lens,
             int max_blocks, float* partial, int splits) {
             const int w = codes_width + 2;
             dependent(s, grid, dim3(ATTN_WARPS * 32), attention_split_codes_g4_d256_bf16, q, k, v, tables, lens, max_blocks,
                       SHIFT, partial, HQ, HKV, 1, D, splits, scale, 0, 4, 0, w, (const float*)centroids, 4, 0, w,
                       (const float*)centroids);
         }},
    };
    for (const Format& f : formats) {
        const size_t pool_bytes = (size_t)pool_rows * HKV * f.width;
        uint8_t *k, *v, *copy;
        CHECK(cudaMalloc(&k, pool_bytes));
        CHECK(cudaMalloc(&v, pool_bytes));
        CHECK(cudaMalloc(&copy, pool_bytes));
        fill_bytes<<<1024, 256, 0, stream>>>(k, (long long)pool_bytes, 5);
        fill_bytes<<<1024, 256, 0, stream>>>(v, (long long)pool_bytes, 7);
        if (f.width == D * 2) {  // bf16 values, not hashed bytes (which hold NaNs)
            fill<<<1024, 256, 0, stream>>>((bf16*)k, (long long)pool_bytes / 2, 5, 2.0f);
            fill<<<1024, 256, 0, stream>>>((bf16*)v, (long long)pool_bytes / 2, 7, 2.0f);
        }
        for (int context : {8192, 32768}) {
            for (int rows : {1, 8, 32}) {
                std::vector<int> len(MAX_ROWS, context);
                CHECK(cudaMemcpy(lens, len.data(), MAX_ROWS * sizeof(int), cudaMemcpyHostToDevice));
                const int splits = context / SPLIT_KEYS;
                const dim3 grid(HQ / GROUP_HEADS, rows, splits);
                const double us = graph_us(stream, 20, [&] {
                    for (int layer = 0; layer < LAYERS; ++layer) f.launch(stream, grid, q, k, v, tables, lens, max_blocks, partial, splits);
                }) / LAYERS;
                // Keys and values read; a copy of half as many bytes reads and writes as many.
                const size_t bytes = 2ull * rows * context * HKV * f.width;
                const double copy_us = time_us(stream, 10, [&] {
                    CHECK(cudaMemcpyAsync(copy, k, bytes / 2, cudaMemcpyDeviceToDevice, stream));
                });
                std::printf("%-12s rows %2d context %5d: %8.1f us a launch, %6.0f GB/s of KV (a copy moving as many bytes: %7.1f us)\n",
                            f.name, rows, context, us, bytes / us * 1e-3, copy_us);
            }
        }
        free_all({k, v, copy});
    }
    free_all({q, partial, centroids, tables, lens});
    CHECK(cudaStreamSynchronize(stream));
    return 0;
}

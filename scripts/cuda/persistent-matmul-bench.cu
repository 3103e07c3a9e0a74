// Would a persistent decode kernel shorten a step? The 4B shape's 129 decode-step matrices (as in
// decode-matmul-bench.cu) at one input row, three ways:
//  1. one launch per matrix of strata's decode matmul (cuda/matmul.cu), as programmatic
//     dependents in a CUDA graph — what a step does now (each matmul ~2.5-3 us above its bytes
//     at the GPU's read bandwidth, docs/benchmarks.md);
//  2. one cooperative launch that walks all 129 matrices, its blocks taking groups of 2 weight
//     rows in turn (the same per-group work: 4 warps, 2 per row, 4 loads in flight a lane) with
//     a grid-wide barrier between matrices — where a persistent decode kernel would wait for the
//     previous phase's output;
//  3. the same, each block loading its first weights of the next matrix before the barrier
//     (weights do not depend on the phase before, so the barrier's wait overlaps their loads);
// and the barriers alone (129 of them, no work). Each block writes its rows' dot products, so
// the outputs are comparable with the first way's (checked: the largest difference is printed).
//
// Build (here, no GPU needed):
//   source scripts/cuda/env.sh
//   nvcc -O3 -std=c++17 -arch=sm_90a -o persistent-matmul-bench scripts/cuda/persistent-matmul-bench.cu -L"$CUDA_ROOT/lib"
// Run on the GPU machine: ./persistent-matmul-bench
#include <algorithm>
#include <cmath>

#include "../../crates/kernels/cuda/matmul.cu"
#include "bench-common.cuh"

constexpr int SPLIT = 2, ROWS_PER_GROUP = ROWS_WARPS / SPLIT, VEC = 8;

struct Matrix {
    int n, k;
    const bf16* w;
    bf16* y;
};

// A grid-wide barrier for co-resident blocks (a cooperative launch guarantees it): the last
// block to arrive resets the count and advances the generation the others spin on.
__device__ unsigned int barrier_arrived;
__device__ volatile unsigned int barrier_generation;

__device__ void grid_barrier() {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int generation = barrier_generation;
        __threadfence();
        if (atomicAdd(&barrier_arrived, 1) == gridDim.x - 1) {
            barrier_arrived = 0;
            __threadfence();
            barrier_generation = generation + 1;
        } else {
            while (barrier_generation == generation) {}
        }
        __threadfence();
    }
    __syncthreads();
}

// This thread's part of weight row group `group` of `m`: its row, the first chunk it loads and
// whether its warp has a row at all.
struct Lane {
    const uint4* row;
    int n, first, chunks;
};

__device__ Lane lane_of(const Matrix& m, int group) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = group * ROWS_PER_GROUP + warp / SPLIT;
    return {reinterpret_cast<const uint4*>(m.w + (long long)min(n, m.n - 1) * m.k), n, (warp % SPLIT) * 32 + lane, m.k / VEC};
}

__device__ void load_first(const Lane& l, uint4 (&packed)[AHEAD]) {
#pragma unroll
    for (int u = 0; u < AHEAD; ++u)
        if (l.first + u * 32 * SPLIT < l.chunks) packed[u] = __ldg(l.row + l.first + u * 32 * SPLIT);
}

// One row group of `m` against x, its first loads already in `packed`: the decode matmul's
// per-block work for one input row.
__device__ void group_product(const Matrix& m, const Lane& l, uint4 (&packed)[AHEAD], const bf16* x) {
    __shared__ float partial[ROWS_WARPS];
    constexpr int stride = 32 * SPLIT;
    float acc = 0.0f;
    for (int c = l.first; c < l.chunks; c += AHEAD * stride) {
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            const int cu = c + u * stride;
            if (cu >= l.chunks) break;
            const bf16* we = reinterpret_cast<const bf16*>(&packed[u]);
            const uint4 xpacked = __ldg(reinterpret_cast<const uint4*>(x) + cu);
            const bf16* xe = reinterpret_cast<const bf16*>(&xpacked);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc += to_f32(we[e]) * to_f32(xe[e]);
            if (cu + AHEAD * stride < l.chunks) packed[u] = __ldg(l.row + cu + AHEAD * stride);
        }
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    acc = warp_sum(acc);
    __syncthreads();  // the previous group's readers of `partial` are done
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (warp % SPLIT == 0 && lane == 0 && l.n < m.n) m.y[l.n] = from_f32<bf16>(partial[warp] + partial[warp + 1]);
}

// Every matrix in turn, a barrier between them; with PRELOAD, a block's first loads of the next
// matrix go out before the barrier.
template <bool PRELOAD>
__global__ void __launch_bounds__(ROWS_WARPS * 32) persistent_chain(const Matrix* mats, int count, const bf16* x) {
    uint4 packed[AHEAD];
    Lane next = lane_of(mats[0], blockIdx.x);
    load_first(next, packed);
    for (int i = 0; i < count; ++i) {
        const Matrix m = mats[i];
        const int groups = (m.n + ROWS_PER_GROUP - 1) / ROWS_PER_GROUP;
        for (int g = blockIdx.x; g < groups; g += gridDim.x) {
            const Lane l = lane_of(m, g);
            if (g != blockIdx.x || (!PRELOAD && i > 0)) load_first(l, packed);
            group_product(m, l, packed, x);
        }
        if (PRELOAD && i + 1 < count) load_first(lane_of(mats[i + 1], blockIdx.x), packed);
        grid_barrier();
    }
}

__global__ void barriers_only(int count) {
    for (int i = 0; i < count; ++i) grid_barrier();
}

static float largest_difference(const std::vector<Matrix>& mats, const std::vector<bf16*>& reference) {
    float worst = 0.0f;
    for (size_t i = 0; i < mats.size(); ++i) {
        std::vector<bf16> a(mats[i].n), b(mats[i].n);
        CHECK(cudaMemcpy(a.data(), mats[i].y, a.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(b.data(), reference[i], b.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
        for (int j = 0; j < mats[i].n; ++j) worst = std::max(worst, std::abs(__bfloat162float(a[j]) - __bfloat162float(b[j])));
    }
    return worst;
}

int main() {
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::vector<Matrix> mats;
    std::vector<bf16*> reference;
    double bytes = 0;
    const auto add = [&](int n, int k) {
        bf16 *w, *y, *y_ref;
        CHECK(cudaMalloc(&w, (size_t)n * k * sizeof(bf16)));
        CHECK(cudaMalloc(&y, n * sizeof(bf16)));
        CHECK(cudaMalloc(&y_ref, n * sizeof(bf16)));
        fill<<<1024, 256, 0, stream>>>(w, (long long)n * k, n ^ k ^ (unsigned)mats.size());
        mats.push_back({n, k, w, y});
        reference.push_back(y_ref);
        bytes += 2.0 * n * k;
    };
    for (const Shape& shape : decode_step_shapes()) add(shape.n, shape.k);
    bf16* x;
    CHECK(cudaMalloc(&x, 9216 * sizeof(bf16)));
    fill<<<16, 256, 0, stream>>>(x, 9216, 7);
    Matrix* mats_dev;
    CHECK(cudaMalloc(&mats_dev, mats.size() * sizeof(Matrix)));
    CHECK(cudaMemcpy(mats_dev, mats.data(), mats.size() * sizeof(Matrix), cudaMemcpyHostToDevice));
    CHECK(cudaStreamSynchronize(stream));
    const int count = (int)mats.size();

    // 1. One launch per matrix, recorded as a graph.
    const double launches = graph_us(stream, 20, [&] {
        for (size_t i = 0; i < mats.size(); ++i) {
            const dim3 grid((mats[i].n * SPLIT + ROWS_WARPS - 1) / ROWS_WARPS), block(ROWS_WARPS * 32);
            dependent(stream, grid, block, matmul_rows1_s2_bf16, (const bf16*)x, 2560LL, mats[i].w, reference[i], mats[i].k,
                      mats[i].n);
        }
    });
    std::printf("%s: %d matrices, %.2f GB, one row\n", prop.name, count, bytes / 1e9);
    std::printf("one launch per matrix (graph, dependent launches): %.1f us (%.0f GB/s)\n", launches, bytes / launches / 1e3);

    // 2-4. One cooperative launch: as many blocks as the GPU holds at once, and 4 a
    // multiprocessor (fewer blocks arriving at each barrier, fewer loads in flight).
    const auto cooperative = [&](const void* kernel, void** args, int cap) {
        int per_sm = 0;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, ROWS_WARPS * 32, 0));
        const dim3 grid(std::min(per_sm, cap) * prop.multiProcessorCount), block(ROWS_WARPS * 32);
        return time_us(stream, 20, [&] { CHECK(cudaLaunchCooperativeKernel(kernel, grid, block, args, 0, stream)); });
    };
    void* chain_args[] = {&mats_dev, (void*)&count, &x};
    void* barrier_args[] = {(void*)&count};
    for (int cap : {1 << 30, 4}) {
        const char* blocks = cap > 64 ? "as many blocks as fit" : "4 blocks a multiprocessor";
        const double plain = cooperative((const void*)persistent_chain<false>, chain_args, cap);
        const float plain_diff = largest_difference(mats, reference);
        const double preload = cooperative((const void*)persistent_chain<true>, chain_args, cap);
        const float preload_diff = largest_difference(mats, reference);
        const double barriers = cooperative((const void*)barriers_only, barrier_args, cap);
        std::printf("one persistent launch, %s, a grid barrier between matrices: %.1f us (%.0f GB/s; largest difference "
                    "from the launches' outputs %g)\n", blocks, plain, bytes / plain / 1e3, plain_diff);
        std::printf("  with the next matrix's first loads before each barrier: %.1f us (%.0f GB/s; largest difference %g)\n",
                    preload, bytes / preload / 1e3, preload_diff);
        std::printf("  the %d barriers alone: %.1f us (%.2f us each)\n", count, barriers, barriers / count);
    }
    return 0;
}

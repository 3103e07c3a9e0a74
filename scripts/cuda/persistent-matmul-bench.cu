// Would a persistent decode kernel shorten a step? The 4B shape's 129 decode-step matrices (as in
// decode-matmul-bench.cu) at one input row, four ways:
//  1. one launch per matrix of strata's decode matmul (cuda/matmul.cu), as programmatic
//     dependents in a CUDA graph — what a step does now (each matmul ~2.5-3 us above its bytes
//     at the GPU's read bandwidth, docs/benchmarks.md);
//  2. one cooperative launch that walks all 129 matrices, its blocks taking groups of 2 weight
//     rows in turn (the same per-group work: 4 warps, 2 per row, 4 loads in flight a lane) with
//     a grid-wide barrier between matrices — where a persistent decode kernel would wait for the
//     previous phase's output;
//  3. the same, each block loading its first weights of the next matrix before the barrier
//     (weights do not depend on the phase before, so the barrier's wait overlaps their loads);
// and the barriers alone (129 of them, no work); and
//  4. a warp-specialised launch, one block a multiprocessor: a producer thread streams the
//     block's share of every matrix in turn (contiguous weight rows) through a ring of
//     shared-memory slots with bulk (TMA) copies, running ahead across matrix boundaries, while
//     eight consumer warps take the slots; before each matrix the consumers wait for every
//     block to have written the matrix before (a counter in memory per matrix), as a decode
//     step's next projection waits for its input, and read their input row then — the weights
//     keep arriving meanwhile, up to the ring's 192 KB a multiprocessor (~6 us of the GPU's
//     bandwidth). Also without the waits: the streaming alone.
// Each matrix's input row is the output of the matrix before it (the first's a fixed row), so a
// way that reads a row before every block has written it computes other outputs: each way's are
// compared with the first way's (the largest difference is printed; the ways sum in different
// orders, so they differ by rounding, growing along the chain).
//
// Build (here, no GPU needed):
//   source scripts/cuda/env.sh
//   nvcc -O3 -std=c++17 -arch=sm_90a -o persistent-matmul-bench scripts/cuda/persistent-matmul-bench.cu -L"$CUDA_ROOT/lib"
// Run on the GPU machine: ./persistent-matmul-bench
#include <algorithm>
#include <cmath>
#include <string>

#include "../../crates/kernels/cuda/matmul.cu"
#include "bench-common.cuh"

constexpr int SPLIT = 2, ROWS_PER_GROUP = ROWS_WARPS / SPLIT, VEC = 8;

// y = w x, x the previous matrix's y (the chain's input row for the first): a way that reads a
// row before its matrix is complete computes different outputs.
struct Matrix {
    int n, k;
    const bf16* w;
    const bf16* x;
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

// One row group of `m` against its input row, its first loads already in `packed`: the decode
// matmul's per-block work for one input row (the row read from L2: other blocks wrote it during
// this launch, which the non-coherent __ldg path may not see).
__device__ void group_product(const Matrix& m, const Lane& l, uint4 (&packed)[AHEAD]) {
    __shared__ float partial[ROWS_WARPS];
    constexpr int stride = 32 * SPLIT;
    float acc = 0.0f;
    for (int c = l.first; c < l.chunks; c += AHEAD * stride) {
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            const int cu = c + u * stride;
            if (cu >= l.chunks) break;
            const bf16* we = reinterpret_cast<const bf16*>(&packed[u]);
            const uint4 xpacked = __ldcg(reinterpret_cast<const uint4*>(m.x) + cu);
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
__global__ void __launch_bounds__(ROWS_WARPS * 32) persistent_chain(const Matrix* mats, int count) {
    uint4 packed[AHEAD];
    Lane next = lane_of(mats[0], blockIdx.x);
    load_first(next, packed);
    for (int i = 0; i < count; ++i) {
        const Matrix m = mats[i];
        const int groups = (m.n + ROWS_PER_GROUP - 1) / ROWS_PER_GROUP;
        for (int g = blockIdx.x; g < groups; g += gridDim.x) {
            const Lane l = lane_of(m, g);
            if (g != blockIdx.x || (!PRELOAD && i > 0)) load_first(l, packed);
            group_product(m, l, packed);
        }
        if (PRELOAD && i + 1 < count) load_first(lane_of(mats[i + 1], blockIdx.x), packed);
        grid_barrier();
    }
}

__global__ void barriers_only(int count) {
    for (int i = 0; i < count; ++i) grid_barrier();
}

// Way 4: the weights streamed through shared memory.
constexpr int CONSUMER_WARPS = 8;
constexpr int SLOT_BYTES = 16384, SLOTS = 12;  // the ring: 192 KB of the 227 KB a block may hold
constexpr int UNIT_BYTES = 512;                // what a consumer warp reads at once: 16 bytes a lane
constexpr int PIECE_BYTES = SLOT_BYTES / CONSUMER_WARPS;  // a warp's contiguous part of a slot
constexpr int MAX_K = 9216, MAX_BLOCK_ROWS = 2048, MAX_MATRICES = 256;
static_assert(PIECE_BYTES % UNIT_BYTES == 0, "a warp's piece is whole units");

// Per matrix, how many blocks have written their rows: launch `epoch` (1, 2, ...) waits for
// epoch × blocks, so every launch before it must have run to its end on the same grid (the
// launches of one stream do). Never reset, so a launch needs no memset before it.
__device__ unsigned int matrix_done[MAX_MATRICES];

__device__ __forceinline__ unsigned int smem(const void* p) { return (unsigned int)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(bar)) : "memory");
}

__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned int parity) {
    asm volatile(
        "{\n"
        ".reg .pred ready;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
        "@!ready bra WAIT;\n"
        "}\n" ::"r"(smem(bar)),
        "r"(parity)
        : "memory");
}

// `bytes` (a multiple of 16) from global `src` to shared `dst`, counted on `bar`'s transaction.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem(dst)),
                 "l"(src), "r"(bytes), "r"(smem(bar))
                 : "memory");
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMER_WARPS * 32) : "memory"); }

// This block's rows of `m`, as bytes of its weights: contiguous, since w is row-major.
struct Share {
    long long begin, end;
    int first_row;
};

__device__ Share share_of(const Matrix& m) {
    const long long first = (long long)m.n * blockIdx.x / gridDim.x, last = (long long)m.n * (blockIdx.x + 1) / gridDim.x;
    return {first * m.k * 2, last * m.k * 2, (int)first};
}

// Two bf16 packed in a word, as f32: a bf16 is the high half of its f32.
__device__ __forceinline__ float low_bf16(unsigned int v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float high_bf16(unsigned int v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    float acc = low_bf16(w.x) * low_bf16(x.x);
    acc += high_bf16(w.x) * high_bf16(x.x);
    acc += low_bf16(w.y) * low_bf16(x.y);
    acc += high_bf16(w.y) * high_bf16(x.y);
    acc += low_bf16(w.z) * low_bf16(x.z);
    acc += high_bf16(w.z) * high_bf16(x.z);
    acc += low_bf16(w.w) * low_bf16(x.w);
    acc += high_bf16(w.w) * high_bf16(x.w);
    return acc;
}

// Adds a warp's sum for one of the block's rows to the rows' sums in shared memory (summed in
// whatever order the warps come: this measures time, strata's kernels fix their order).
__device__ __forceinline__ void add_row(float* row_sum, int row, float acc) {
    acc = warp_sum(acc);
    if (row >= 0 && threadIdx.x % 32 == 0) atomicAdd(row_sum + row, acc);
}

// Matrix rows' byte widths are multiples of UNIT_BYTES (K a multiple of 256; the host checks), so
// a warp's unit never straddles two rows, and a block's share starts on a row. Without WAIT, a
// matrix may read its input row before it is complete: that way times the streaming alone.
template <bool WAIT>
__global__ void __launch_bounds__((CONSUMER_WARPS + 1) * 32, 1)
    streamed_chain(const Matrix* mats, int count, unsigned int epoch) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(16) bf16 xs[MAX_K];
    __shared__ float row_sum[MAX_BLOCK_ROWS];
    __shared__ unsigned long long full[SLOTS], empty[SLOTS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < SLOTS; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    for (int i = threadIdx.x; i < MAX_BLOCK_ROWS; i += blockDim.x) row_sum[i] = 0.0f;
    __syncthreads();

    if (warp == CONSUMER_WARPS) {
        // The producer: every slot of every matrix's share, in order, as soon as its slot is free
        // (a fresh barrier's phase before the first counts as complete: the first pass does not wait).
        if (lane != 0) return;
        unsigned int q = 0;
        for (int i = 0; i < count; ++i) {
            const Share share = share_of(mats[i]);
            const unsigned char* w = reinterpret_cast<const unsigned char*>(mats[i].w);
            for (long long at = share.begin; at < share.end; at += SLOT_BYTES, ++q) {
                const int s = q % SLOTS;
                mbarrier_wait(&empty[s], ((q / SLOTS) & 1) ^ 1);
                bulk_load(ring + s * SLOT_BYTES, w + at, (unsigned int)min((long long)SLOT_BYTES, share.end - at), &full[s]);
            }
        }
        return;
    }

    unsigned int q = 0;
    for (int i = 0; i < count; ++i) {
        const Matrix m = mats[i];
        const Share share = share_of(m);
        const int row_bytes = m.k * 2;
        if (WAIT && i > 0 && threadIdx.x == 0) {
            unsigned int done;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(done) : "l"(&matrix_done[i - 1]) : "memory");
            } while (done < epoch * gridDim.x);
        }
        consumers_sync();  // releases the consumers after thread 0's wait
        for (int c = threadIdx.x; c < m.k / 8; c += CONSUMER_WARPS * 32)
            reinterpret_cast<uint4*>(xs)[c] = __ldcg(reinterpret_cast<const uint4*>(m.x) + c);  // from L2: other blocks wrote it
        consumers_sync();

        int summed_row = -1;
        float acc = 0.0f;
        for (long long at = share.begin; at < share.end; at += SLOT_BYTES, ++q) {
            const int s = q % SLOTS, bytes = (int)min((long long)SLOT_BYTES, share.end - at);
            // Where this warp's piece of the slot starts in the block's rows.
            const int start = (int)(at - share.begin) + warp * PIECE_BYTES;
            int row = start / row_bytes, column = start % row_bytes;
            mbarrier_wait(&full[s], (q / SLOTS) & 1);
            const unsigned char* slot = ring + s * SLOT_BYTES;
            for (int u = warp * PIECE_BYTES; u < min(bytes, (warp + 1) * PIECE_BYTES); u += UNIT_BYTES) {
                if (row != summed_row) {
                    add_row(row_sum, summed_row, acc);
                    summed_row = row;
                    acc = 0.0f;
                }
                const uint4 wv = *reinterpret_cast<const uint4*>(slot + u + lane * 16);
                const uint4 xv = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(xs) + column + lane * 16);
                acc += dot8(wv, xv);
                column += UNIT_BYTES;
                if (column == row_bytes) column = 0, ++row;
            }
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&empty[s]);
        }
        add_row(row_sum, summed_row, acc);
        consumers_sync();
        const int rows = (int)((share.end - share.begin) / row_bytes);
        for (int r = threadIdx.x; r < rows; r += CONSUMER_WARPS * 32) {
            m.y[share.first_row + r] = from_f32<bf16>(row_sum[r]);
            row_sum[r] = 0.0f;
        }
        consumers_sync();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(&matrix_done[i], 1);
        }
    }
}

// Every output set to bf16 NaN, so that a row a way leaves unwritten cannot pass for the
// previous way's value.
static void poison(const std::vector<Matrix>& mats, cudaStream_t stream) {
    for (const Matrix& m : mats) CHECK(cudaMemsetAsync(m.y, 0xff, m.n * sizeof(bf16), stream));
}

// "largest difference D (outputs up to M)" of `mats`' outputs from `reference`'s (a NaN counts as
// an infinite difference).
static std::string compare(const std::vector<Matrix>& mats, const std::vector<Matrix>& reference) {
    float worst = 0.0f, largest = 0.0f;
    for (size_t i = 0; i < mats.size(); ++i) {
        std::vector<bf16> got(mats[i].n), want(mats[i].n);
        CHECK(cudaMemcpy(got.data(), mats[i].y, got.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(want.data(), reference[i].y, want.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
        for (int j = 0; j < mats[i].n; ++j) {
            const float d = std::abs(__bfloat162float(got[j]) - __bfloat162float(want[j]));
            worst = std::isnan(d) ? INFINITY : std::max(worst, d);
            largest = std::max(largest, std::abs(__bfloat162float(want[j])));
        }
    }
    char text[96];
    std::snprintf(text, sizeof text, "largest difference from the launches' outputs %g, outputs up to %g", worst, largest);
    return text;
}

int main() {
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    // The same chain twice, sharing the weights: the launches' outputs (the reference) and the
    // persistent ways'. Weights in [-r/2, r/2) with r = sqrt(12 / k) keep the chain's values
    // at the input row's scale, so 129 matrices neither overflow nor vanish.
    bf16* x;
    CHECK(cudaMalloc(&x, MAX_K * sizeof(bf16)));
    fill<<<16, 256, 0, stream>>>(x, MAX_K, 7);
    std::vector<Matrix> mats, reference;
    double bytes = 0;
    for (const Shape& shape : decode_step_shapes()) {
        const int n = shape.n, k = shape.k;
        bf16 *w, *y, *y_ref;
        CHECK(cudaMalloc(&w, (size_t)n * k * sizeof(bf16)));
        CHECK(cudaMalloc(&y, n * sizeof(bf16)));
        CHECK(cudaMalloc(&y_ref, n * sizeof(bf16)));
        fill<<<1024, 256, 0, stream>>>(w, (long long)n * k, n ^ k ^ (unsigned)mats.size(), std::sqrt(12.0f / k));
        mats.push_back({n, k, w, mats.empty() ? x : mats.back().y, y});
        reference.push_back({n, k, w, reference.empty() ? x : reference.back().y, y_ref});
        bytes += 2.0 * n * k;
    }
    Matrix* mats_dev;
    CHECK(cudaMalloc(&mats_dev, mats.size() * sizeof(Matrix)));
    CHECK(cudaMemcpy(mats_dev, mats.data(), mats.size() * sizeof(Matrix), cudaMemcpyHostToDevice));
    CHECK(cudaStreamSynchronize(stream));
    const int count = (int)mats.size();

    // 1. One launch per matrix, recorded as a graph.
    const double launches = graph_us(stream, 20, [&] {
        for (const Matrix& m : reference) {
            const dim3 grid((m.n * SPLIT + ROWS_WARPS - 1) / ROWS_WARPS), block(ROWS_WARPS * 32);
            dependent(stream, grid, block, matmul_rows1_s2_bf16, m.x, (long long)m.k, m.w, m.y, m.k, m.n);
        }
    });
    std::printf("%s: %d matrices, %.2f GB, one row\n", prop.name, count, bytes / 1e9);
    std::printf("one launch per matrix (graph, dependent launches): %.1f us (%.0f GB/s)\n", launches, bytes / launches / 1e3);

    // 2-3. One cooperative launch: as many blocks as the GPU holds at once, and 4 a
    // multiprocessor (fewer blocks arriving at each barrier, fewer loads in flight).
    const auto cooperative = [&](const void* kernel, void** args, int cap) {
        int per_sm = 0;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, ROWS_WARPS * 32, 0));
        const dim3 grid(std::min(per_sm, cap) * prop.multiProcessorCount), block(ROWS_WARPS * 32);
        return time_us(stream, 20, [&] { CHECK(cudaLaunchCooperativeKernel(kernel, grid, block, args, 0, stream)); });
    };
    void* chain_args[] = {&mats_dev, (void*)&count};
    void* barrier_args[] = {(void*)&count};
    for (int cap : {1 << 30, 4}) {
        const char* blocks = cap > 64 ? "as many blocks as fit" : "4 blocks a multiprocessor";
        poison(mats, stream);
        const double plain = cooperative((const void*)persistent_chain<false>, chain_args, cap);
        const std::string plain_check = compare(mats, reference);
        poison(mats, stream);
        const double preload = cooperative((const void*)persistent_chain<true>, chain_args, cap);
        const std::string preload_check = compare(mats, reference);
        const double barriers = cooperative((const void*)barriers_only, barrier_args, cap);
        std::printf("one persistent launch, %s, a grid barrier between matrices: %.1f us (%.0f GB/s; %s)\n", blocks, plain,
                    bytes / plain / 1e3, plain_check.c_str());
        std::printf("  with the next matrix's first loads before each barrier: %.1f us (%.0f GB/s; %s)\n", preload,
                    bytes / preload / 1e3, preload_check.c_str());
        std::printf("  the %d barriers alone: %.1f us (%.2f us each)\n", count, barriers, barriers / count);
    }

    // 4. The weights streamed through shared memory, one block a multiprocessor.
    if (count > MAX_MATRICES) {
        std::fprintf(stderr, "%d matrices: the streamed kernel counts at most %d\n", count, MAX_MATRICES);
        return 1;
    }
    for (const Matrix& m : mats) {
        if (m.k % 256 != 0 || m.k > MAX_K || (m.n + prop.multiProcessorCount - 1) / prop.multiProcessorCount > MAX_BLOCK_ROWS) {
            std::fprintf(stderr, "a %d x %d matrix does not fit the streamed kernel's limits\n", m.n, m.k);
            return 1;
        }
    }
    unsigned int epoch = 0;  // launches so far, waiting or not: each adds a count a block to every matrix
    for (const bool wait : {true, false}) {
        const void* kernel = wait ? (const void*)streamed_chain<true> : (const void*)streamed_chain<false>;
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SLOTS * SLOT_BYTES));
        void* args[] = {&mats_dev, (void*)&count, &epoch};
        poison(mats, stream);
        const double us = time_us(stream, 20, [&] {
            ++epoch;
            CHECK(cudaLaunchCooperativeKernel(kernel, dim3(prop.multiProcessorCount), dim3((CONSUMER_WARPS + 1) * 32), args,
                                              SLOTS * SLOT_BYTES, stream));
        });
        if (wait) {
            std::printf("weights streamed through shared memory, a block a multiprocessor, each matrix after every block "
                        "wrote the one before: %.1f us (%.0f GB/s; %s)\n",
                        us, bytes / us / 1e3, compare(mats, reference).c_str());
        } else {
            std::printf("  the same without the waits (inputs read unfinished, outputs not compared): %.1f us (%.0f GB/s)\n", us,
                        bytes / us / 1e3);
        }
    }
    return 0;
}

// Does anything of a decode matmul's start overlap the latency-bound kernel before it? strata's
// kernels are programmatic dependents of the one before (cuda/common.cuh), and the matmul loads
// its first weights before it waits (cuda/matmul.cu), so its start should hide behind a small
// kernel. Three measurements, each over 24 distinct matrices of one shape (weights not left in L2
// by the one before), recorded as a CUDA graph:
//  1. a one-block kernel spinning 5 or 10 us (a stand-in for the norms, conv, DeltaNet step),
//     then the matmul: the matmul's time after it, with the spin letting its dependents launch
//     at its start (as strata's kernels do) or at its end, with the matmul launched plainly, and
//     back to back with the matmul before;
//  2. the matmul's weights prefetched into L2 before the spin, by line prefetches from a full
//     grid or bulk (TMA) prefetches, or by spare blocks of the spin kernel itself;
//  3. when a dependent kernel's first instruction runs against the end of the kernel before
//     (%globaltimer), outside and inside a graph.
//
// Build (here, no GPU needed):
//   source scripts/cuda/env.sh
//   nvcc -O3 -std=c++17 -arch=sm_90a -o launch-overlap-bench scripts/cuda/launch-overlap-bench.cu -L"$CUDA_ROOT/lib"
// Run on the GPU machine: ./launch-overlap-bench
#include <utility>

#include "../../crates/kernels/cuda/matmul.cu"
#include "bench-common.cuh"

__device__ void spin_for(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}

// Waits for the kernel before and lets the next launch at its start, as strata's kernels do.
__global__ void spin(long long cycles) {
    await_previous_kernel();
    spin_for(cycles);
}

// Lets the next kernel launch only at its end.
__global__ void spin_late(long long cycles) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    spin_for(cycles);
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__global__ void prefetch_lines(const char* p, long long bytes) {
    await_previous_kernel();
    for (long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 128; i < bytes;
         i += (long long)gridDim.x * blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i));
}

__device__ void prefetch_bulk_from(const char* p, long long bytes, long long first, long long stride) {
    constexpr long long CHUNK = 65536;
    for (long long i = first * CHUNK; i < bytes; i += stride * CHUNK) {
        const unsigned size = (unsigned)min(CHUNK, bytes - i);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + i), "r"(size) : "memory");
    }
}

__global__ void prefetch_bulk(const char* p, long long bytes) {
    await_previous_kernel();
    prefetch_bulk_from(p, bytes, blockIdx.x * (long long)blockDim.x + threadIdx.x, (long long)gridDim.x * blockDim.x);
}

// Block 0 spins; the others prefetch.
__global__ void spin_and_prefetch(long long cycles, const char* p, long long bytes) {
    await_previous_kernel();
    if (blockIdx.x == 0) return spin_for(cycles);
    prefetch_bulk_from(p, bytes, (blockIdx.x - 1) * (long long)blockDim.x + threadIdx.x,
                       (long long)(gridDim.x - 1) * blockDim.x);
}

__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void stamp_end(unsigned long long* t) {
    await_previous_kernel();
    spin_for(20000);
    if (threadIdx.x == 0) t[0] = now_ns();
}

__global__ void stamp_start(unsigned long long* t) {
    if (threadIdx.x == 0) t[1] = now_ns();
    await_previous_kernel();
    if (threadIdx.x == 0) t[2] = now_ns();
}

struct Matrix {
    int n, k;
    bf16* w;
    long long bytes() const { return 2LL * n * k; }
};

static void matmul(cudaStream_t stream, const Matrix& m, const bf16* x, bf16* y, bool as_dependent = true) {
    const dim3 grid((m.n * 2 + ROWS_WARPS - 1) / ROWS_WARPS), block(ROWS_WARPS * 32);
    if (as_dependent) {
        dependent(stream, grid, block, matmul_rows1_s2_bf16, (const bf16*)x, (long long)m.k, (const bf16*)m.w, y, m.k, m.n);
    } else {
        matmul_rows1_s2_bf16<<<grid, block, 0, stream>>>(x, m.k, m.w, y, m.k, m.n);
    }
}

int main() {
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s, L2 %d MB\n", prop.name, prop.l2CacheSize >> 20);

    unsigned long long* t;
    CHECK(cudaMallocManaged(&t, 3 * sizeof(unsigned long long)));
    const auto pair = [&] {
        dependent(stream, 1, 32, stamp_end, t);
        dependent(stream, 1, 32, stamp_start, t);
    };
    for (int i = 0; i < 3; ++i) pair();  // loads the module and warms the launch path
    CHECK(cudaStreamSynchronize(stream));
    std::printf("stream: the dependent's first instruction %lld ns after the kernel before ended, its wait over %lld ns after\n",
                (long long)(t[1] - t[0]), (long long)(t[2] - t[0]));
    graph_us(stream, 20, pair);
    std::printf("graph:  the dependent's first instruction %lld ns after the kernel before ended, its wait over %lld ns after\n",
                (long long)(t[1] - t[0]), (long long)(t[2] - t[0]));

    bf16 *x, *y;
    CHECK(cudaMalloc(&x, 9216 * sizeof(bf16)));
    CHECK(cudaMalloc(&y, 20000 * sizeof(bf16)));
    fill<<<4, 256, 0, stream>>>(x, 9216, 7);
    for (auto [n, k] : std::vector<std::pair<int, int>>{{2560, 4096}, {2560, 9216}, {12352, 2560}}) {
        std::vector<Matrix> ms(24, Matrix{n, k, nullptr});
        for (Matrix& m : ms) {
            CHECK(cudaMalloc(&m.w, m.bytes()));
            fill<<<1024, 256, 0, stream>>>(m.w, m.bytes() / 2, n ^ k);
        }
        CHECK(cudaStreamSynchronize(stream));
        const auto per_matrix = [&](const std::function<void(const Matrix&)>& each) {
            return graph_us(stream, 20, [&] {
                for (const Matrix& m : ms) each(m);
            }) / ms.size();
        };
        const double back = per_matrix([&](const Matrix& m) { matmul(stream, m, x, y); });
        for (long long cycles : {10000LL, 20000LL}) {
            const double alone = per_matrix([&](const Matrix&) { dependent(stream, 1, 32, spin, cycles); });
            const auto after = [&](const std::function<void(const Matrix&)>& before, bool as_dependent = true) {
                return per_matrix([&](const Matrix& m) {
                    before(m);
                    matmul(stream, m, x, y, as_dependent);
                }) - alone;
            };
            const auto spun = [&](const Matrix&) { dependent(stream, 1, 32, spin, cycles); };
            const double early = after(spun);
            const double late = after([&](const Matrix&) { dependent(stream, 1, 32, spin_late, cycles); });
            const double plain = after(spun, false);
            const double lines = after([&](const Matrix& m) {
                dependent(stream, 132, 256, prefetch_lines, (const char*)m.w, m.bytes());
                spun(m);
            });
            const double bulk = after([&](const Matrix& m) {
                dependent(stream, 2, 128, prefetch_bulk, (const char*)m.w, m.bytes());
                spun(m);
            });
            const double folded = after([&](const Matrix& m) {
                dependent(stream, 3, 128, spin_and_prefetch, cycles, (const char*)m.w, m.bytes());
            });
            std::printf("%d x %d (%.1f MB), spin %.2f us: matmul after it %.2f us (dependents launched at the spin's end %.2f, "
                        "matmul launched plainly %.2f; back to back %.2f); after L2 line prefetches %.2f, bulk prefetches "
                        "%.2f, prefetches in the spin's spare blocks %.2f\n",
                        n, k, ms[0].bytes() / 1e6, alone, early, late, plain, back, lines, bulk, folded);
        }
        for (Matrix& m : ms) CHECK(cudaFree(m.w));
    }
    return 0;
}

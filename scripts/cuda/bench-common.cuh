// Shared by the CUDA microbenchmarks in scripts/cuda: error checks, random bf16 weights,
// launches as strata makes them (programmatic dependents), timing over replays, and the 4B
// shape's decode-step matrices.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <vector>

#define CHECK(call)                                                                          \
    do {                                                                                     \
        const cudaError_t e = (call);                                                        \
        if (e != cudaSuccess) {                                                              \
            std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
            std::exit(1);                                                                    \
        }                                                                                    \
    } while (0)

using bf16 = __nv_bfloat16;

// Element i's hash under `seed`, for the fills.
__device__ __forceinline__ unsigned hashed(long long i, unsigned seed) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    return h;
}

// Hashed values in [-range / 2, range / 2).
__global__ void fill(bf16* p, long long n, unsigned seed, float range = 0.1f) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        p[i] = __float2bfloat16(((hashed(i, seed) & 0xffff) / 65536.0f - 0.5f) * range);
    }
}

// Hashed bytes (any bit pattern: as codes they may read as NaN or infinity).
__global__ void fill_bytes(uint8_t* p, long long n, unsigned seed) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        p[i] = (uint8_t)(hashed(i, seed) >> 24);
    }
}

// Reads `n` 16-byte pieces from `p` (a grid-stride loop; `sink` keeps the loads): the GPU's read
// bandwidth, which the benchmarks set their kernels beside.
__global__ void read_all(const uint4* p, long long n, float* sink) {
    float a = 0.0f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = __ldg(p + i);
        a += __uint_as_float(v.x ^ v.y ^ v.z ^ v.w);
    }
    if (a == 1234.5f) *sink = a;
}

// Frees device buffers.
static void free_all(std::initializer_list<void*> buffers) {
    for (void* p : buffers) CHECK(cudaFree(p));
}

// `kernel` launched as a programmatic dependent of the launch before it, as strata launches its
// kernels (crates/kernels/src/cuda.rs), with `shared` bytes of dynamic shared memory.
template <typename... Params, typename... Args>
static void dependent_shared(cudaStream_t stream, dim3 grid, dim3 block, size_t shared, void (*kernel)(Params...),
                             Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = shared;
    cfg.stream = stream;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// `dependent_shared` without dynamic shared memory.
template <typename... Params, typename... Args>
static void dependent(cudaStream_t stream, dim3 grid, dim3 block, void (*kernel)(Params...), Args... args) {
    dependent_shared(stream, grid, block, 0, kernel, args...);
}

// Microseconds per run of `body`'s launches on `stream`, over `replays` runs after 3 warm-ups.
static double time_us(cudaStream_t stream, int replays, const std::function<void()>& body) {
    for (int i = 0; i < 3; ++i) body();
    cudaEvent_t start, end;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&end));
    CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < replays; ++i) body();
    CHECK(cudaEventRecord(end, stream));
    CHECK(cudaEventSynchronize(end));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, start, end));
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(end));
    return ms * 1e3 / replays;
}

// time_us of `body`'s launches recorded once as a CUDA graph and replayed.
static double graph_us(cudaStream_t stream, int replays, const std::function<void()>& body) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    body();
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    const double us = time_us(stream, replays, [&] { CHECK(cudaGraphLaunch(exec, stream)); });
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    return us;
}

// A weight matrix [n, k].
struct Shape {
    int n, k;
};

// The 4B shape's decode-step matrices, in step order: 24 DeltaNet and 8 attention layers (every
// fourth) of in / out / gate-up / down projections, then the 248K-row output head.
static std::vector<Shape> decode_step_shapes() {
    std::vector<Shape> step;
    for (int layer = 0; layer < 32; ++layer) {
        const bool attention = layer % 4 == 3;
        step.push_back({attention ? 10240 : 12352, 2560});  // qkv(+gate) or qkv·z·b·a
        step.push_back({2560, 4096});                         // o_proj / out_proj
        step.push_back({18432, 2560});                        // gate and up
        step.push_back({2560, 9216});                         // down
    }
    step.push_back({248320, 2560});  // output head
    return step;
}

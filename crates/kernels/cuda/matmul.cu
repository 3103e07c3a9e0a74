// `x W^T` for a decode batch: a few input rows against weights read once from memory. Each weight
// row is streamed in 16-byte loads by SPLIT warps of one block (interleaved 512-byte runs of the
// row), each lane keeping AHEAD loads in flight and a dot product per input row; the block adds
// the warps' partials in warp order. The order of every sum depends on K and the split (chosen
// from N) only, so a row's result does not depend on its batch (cuBLAS picks a different kernel
// per batch size, and its small-batch kernels reached well under half the copy bandwidth on an
// H200).
//
// A block per ROWS_WARPS / SPLIT weight rows, as many blocks as that takes: the GPU's block
// scheduler keeps every multiprocessor streaming to the end of the matrix. (A grid sized to what
// the GPU holds at once, each block looping over groups of rows, took 10% longer over the 4B
// shape's decode-step matmuls at one row and 31% at four, and it leaves the next kernel no room
// to start early; figures in commit 590ec36's message.) The weights do not depend on the kernel before, so a block loads its first
// pieces before waiting for that kernel; the input rows are read through the L1 cache, where
// every warp of a block finds them.
#include "common.cuh"

constexpr int ROWS_WARPS = 4;
constexpr int MAX_INPUT_ROWS = 4;
// 16-byte weight loads a lane has in flight (4 measured ahead of 6 and 8 at one and four rows:
// more raised the registers and lowered the blocks a multiprocessor holds; 590ec36's message).
constexpr int AHEAD = 4;

// y [M, N] = x [M, K] · w [N, K]^T: x's rows `x_stride` apart, w contiguous, K a multiple of
// 16 / sizeof(T), x's and w's rows 16-byte aligned (the caller checks); SPLIT divides
// ROWS_WARPS, and the grid has ceil(N · SPLIT / ROWS_WARPS) blocks.
template <typename T, int M, int SPLIT>
__device__ void matmul_rows(const T* x, long long x_stride, const T* w, T* y, int K, int N) {
    __shared__ float partial[ROWS_WARPS][M];
    constexpr int VEC = 16 / sizeof(T);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int part = warp % SPLIT, n = blockIdx.x * (ROWS_WARPS / SPLIT) + warp / SPLIT;
    const int chunks = K / VEC, first = part * 32 + lane;
    constexpr int stride = 32 * SPLIT;
    // A last block's rows past N read row N - 1 again and store nothing.
    const uint4* row = reinterpret_cast<const uint4*>(w + (long long)min(n, N - 1) * K);

    uint4 packed[AHEAD];
#pragma unroll
    for (int u = 0; u < AHEAD; ++u)
        if (first + u * stride < chunks) packed[u] = __ldg(row + first + u * stride);
    await_previous_kernel();

    float acc[M];
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r] = 0.0f;
    for (int c = first; c < chunks; c += AHEAD * stride) {
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            const int cu = c + u * stride;
            if (cu >= chunks) break;
            const T* we = reinterpret_cast<const T*>(&packed[u]);
            float wf[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) wf[e] = to_f32(we[e]);
#pragma unroll
            for (int r = 0; r < M; ++r) {
                const uint4 xpacked = __ldg(reinterpret_cast<const uint4*>(x + r * x_stride) + cu);
                const T* xe = reinterpret_cast<const T*>(&xpacked);
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[r] += wf[e] * to_f32(xe[e]);
            }
            if (cu + AHEAD * stride < chunks) packed[u] = __ldg(row + cu + AHEAD * stride);
        }
    }
#pragma unroll
    for (int r = 0; r < M; ++r) {
        const float sum = warp_sum(acc[r]);
        if (lane == 0) partial[warp][r] = sum;
    }
    __syncthreads();
    if (part == 0 && n < N && lane < M) {
        float sum = 0.0f;
        for (int p = 0; p < SPLIT; ++p) sum += partial[warp + p][lane];
        y[(long long)lane * N + n] = from_f32<T>(sum);
    }
}

// A mixture of experts' projection, y [P, N]: for each (token, expert) pair p, x's row p / per_input
// (the token's, or the pair's own) times its expert's matrix in w [E, N, K]. Pairs go along the
// grid's y dimension in `order` (grouped by expert: moe_route in experts.cu), so that the blocks
// of one expert's pairs run one after another and read its weights from the L2 cache after the
// first. Each pair is computed as one input row of matmul_rows, whose bits do not depend on the
// other rows: a token's result is the same in any batch, and equal to its expert's own matmul.
template <typename T, int SPLIT>
__device__ void matmul_gathered(const T* x, long long x_stride, const T* w, T* y, int K, int N, int E,
                                const unsigned* experts, const unsigned* order, int per_input) {
    // Which weights to read comes from the kernel before.
    await_previous_kernel();
    const unsigned pair = order[blockIdx.y];
    const unsigned expert = min(experts[pair], (unsigned)E - 1);
    matmul_rows<T, 1, SPLIT>(x + (long long)(pair / per_input) * x_stride, x_stride, w + (long long)expert * N * K,
                             y + (long long)pair * N, K, N);
}

// One kernel per row count and split, `matmul_rows{M}_s{SPLIT}_{dtype}`: as template parameters
// they leave a kernel the registers of its own case (with both known only at run time, a one-row
// block took the registers of four rows' sums and ran at half the occupancy).
#define INSTANTIATE_ROWS(T, NAME, M, SPLIT)                                                                   \
    extern "C" __global__ void __launch_bounds__(ROWS_WARPS * 32)                                             \
        matmul_rows##M##_s##SPLIT##_##NAME(const T* x, long long x_stride, const T* w, T* y, int K, int N) {   \
        matmul_rows<T, M, SPLIT>(x, x_stride, w, y, K, N);                                                     \
    }
#define INSTANTIATE_SPLIT(T, NAME, SPLIT)                                                                     \
    INSTANTIATE_ROWS(T, NAME, 1, SPLIT) INSTANTIATE_ROWS(T, NAME, 2, SPLIT) INSTANTIATE_ROWS(T, NAME, 3, SPLIT)  \
    INSTANTIATE_ROWS(T, NAME, 4, SPLIT)
#define INSTANTIATE_GATHERED(T, NAME, SPLIT)                                                                  \
    extern "C" __global__ void __launch_bounds__(ROWS_WARPS * 32) matmul_gathered_s##SPLIT##_##NAME(             \
        const T* x, long long x_stride, const T* w, T* y, int K, int N, int E, const unsigned* experts,          \
        const unsigned* order, int per_input) {                                                                  \
        matmul_gathered<T, SPLIT>(x, x_stride, w, y, K, N, E, experts, order, per_input);                         \
    }
#define INSTANTIATE(T, NAME)                                                                                   \
    static_assert(MAX_INPUT_ROWS == 4 && ROWS_WARPS == 4, "one instance below per row count and split");       \
    INSTANTIATE_SPLIT(T, NAME, 2) INSTANTIATE_SPLIT(T, NAME, 4)                                                 \
    INSTANTIATE_GATHERED(T, NAME, 2) INSTANTIATE_GATHERED(T, NAME, 4)
STRATA_FOR_DTYPES(INSTANTIATE)

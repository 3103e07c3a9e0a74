// `x W^T` for a decode batch: a few input rows against weights read once from memory. Each weight
// row is streamed in 16-byte loads by `split` warps of one block (interleaved 512-byte runs of
// the row), each keeping a dot product per input row; the block adds the warps' partials in warp
// order. Narrow matrices take more warps per row so that enough loads are in flight to reach the
// copy bandwidth. The order of every sum depends on K, N and the split (chosen from N) only, so
// a row's result does not depend on its batch (cuBLAS picks a different kernel per batch size,
// and its small-batch kernels reached well under half the copy bandwidth on an H200).
//
// The grid is as large as the GPU holds at once, the groups of weight rows spread evenly over
// it; each block copies the input rows into shared memory once and keeps the next AHEAD weight
// pieces of each lane in flight, a group's first ones loaded while the group before it sums up.
#include "common.cuh"

constexpr int ROWS_WARPS = 8;
constexpr int MAX_INPUT_ROWS = 4;
// 16-byte weight loads a lane has in flight.
constexpr int AHEAD = 4;

// y [M, N] = x [M, K] · w [N, K]^T: x's rows `x_stride` apart, w contiguous, K a multiple of
// 16 / sizeof(T), x's and w's rows 16-byte aligned (the caller checks); `split` divides
// ROWS_WARPS. The grid takes groups of ROWS_WARPS / split weight rows in turn from blockIdx.x;
// the dynamic shared memory holds the input rows (M · K elements).
template <typename T>
__device__ void matmul_rows(const T* x, long long x_stride, const T* w, T* y, int M, int K, int N, int split) {
    extern __shared__ uint4 shared_input[];
    T* xs = reinterpret_cast<T*>(shared_input);
    __shared__ float partial[ROWS_WARPS][MAX_INPUT_ROWS];
    constexpr int VEC = 16 / sizeof(T);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int part = warp % split, group_rows = ROWS_WARPS / split, groups = (N + group_rows - 1) / group_rows;
    const int chunks = K / VEC, stride = 32 * split, first = part * 32 + lane;
    const auto weight_row = [&](int n) { return reinterpret_cast<const uint4*>(w + (long long)n * K); };

    // A lane's next AHEAD pieces of weights, loaded one step before they are used.
    uint4 packed[AHEAD];
    const auto load = [&](int n, int c) {
#pragma unroll
        for (int u = 0; u < AHEAD; ++u)
            if (n < N && c + u * stride < chunks) packed[u] = __ldg(weight_row(n) + c + u * stride);
    };
    load(blockIdx.x * group_rows + warp / split, first);
    for (int i = threadIdx.x; i < M * chunks; i += blockDim.x)
        shared_input[i] = *reinterpret_cast<const uint4*>(x + (i / chunks) * x_stride + (i % chunks) * VEC);
    __syncthreads();

    for (int group = blockIdx.x; group < groups; group += gridDim.x) {
        const int n = group * group_rows + warp / split;
        float acc[MAX_INPUT_ROWS];
#pragma unroll
        for (int r = 0; r < MAX_INPUT_ROWS; ++r) acc[r] = 0.0f;
        if (n < N) {
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
                    for (int r = 0; r < MAX_INPUT_ROWS; ++r) {
                        if (r >= M) break;
                        const uint4 xpacked = reinterpret_cast<const uint4*>(xs + r * K)[cu];
                        const T* xe = reinterpret_cast<const T*>(&xpacked);
#pragma unroll
                        for (int e = 0; e < VEC; ++e) acc[r] += wf[e] * to_f32(xe[e]);
                    }
                }
                if (c + AHEAD * stride < chunks) load(n, c + AHEAD * stride);
            }
        }
        if (group + (int)gridDim.x < groups) load(n + gridDim.x * group_rows, first);
#pragma unroll
        for (int r = 0; r < MAX_INPUT_ROWS; ++r) {
            if (r >= M) break;
            const float sum = warp_sum(acc[r]);
            if (lane == 0) partial[warp][r] = sum;
        }
        __syncthreads();
        if (part == 0 && n < N && lane < M) {
            float sum = 0.0f;
            for (int p = 0; p < split; ++p) sum += partial[warp + p][lane];
            y[(long long)lane * N + n] = from_f32<T>(sum);
        }
        __syncthreads();  // `partial` is read before the next group writes it
    }
}

#define INSTANTIATE(T, NAME)                                                                                   \
    extern "C" __global__ void __launch_bounds__(ROWS_WARPS * 32)                                             \
        matmul_rows_##NAME(const T* x, long long x_stride, const T* w, T* y, int M, int K, int N, int split) { \
        matmul_rows<T>(x, x_stride, w, y, M, K, N, split);                                                     \
    }
STRATA_FOR_DTYPES(INSTANTIATE)

// `x W^T` for a decode batch: a few input rows against weights read once from memory. Each weight
// row is streamed in 16-byte loads by `split` warps of one block (interleaved 512-byte runs of
// the row), each keeping a dot product per input row; the block adds the warps' partials in warp
// order. Narrow matrices take more warps per row so that enough loads are in flight to reach the
// copy bandwidth. The order of every sum depends on K, N and the split (chosen from N) only, so
// a row's result does not depend on its batch (cuBLAS picks a different kernel per batch size,
// and its small-batch kernels reached well under half the copy bandwidth on an H200). Every
// weight element meets each input row, read from L1: past a few rows that traffic, not the
// weights', bounds it.
#include "common.cuh"

constexpr int ROWS_WARPS = 8;
constexpr int MAX_INPUT_ROWS = 4;

// x [M, K], w [N, K], y [M, N], all contiguous; K a multiple of 16 / sizeof(T), rows of x and w
// 16-byte aligned (the caller checks); `split` divides ROWS_WARPS.
template <typename T>
__device__ void matmul_rows(const T* x, const T* w, T* y, int M, int K, int N, int split) {
    __shared__ float partial[ROWS_WARPS][MAX_INPUT_ROWS];
    constexpr int VEC = 16 / sizeof(T);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int part = warp % split;
    const int n = blockIdx.x * (ROWS_WARPS / split) + warp / split;
    float acc[MAX_INPUT_ROWS];
#pragma unroll
    for (int r = 0; r < MAX_INPUT_ROWS; ++r) acc[r] = 0.0f;
    if (n < N) {
        const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)n * K);
        const int chunks = K / VEC, stride = 32 * split;
#pragma unroll 4
        for (int c = part * 32 + lane; c < chunks; c += stride) {
            const uint4 packed = __ldg(wr + c);
            const T* we = reinterpret_cast<const T*>(&packed);
            float wf[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) wf[e] = to_f32(we[e]);
#pragma unroll
            for (int r = 0; r < MAX_INPUT_ROWS; ++r) {
                if (r >= M) break;
                const uint4 xpacked = *reinterpret_cast<const uint4*>(x + (long long)r * K + (long long)c * VEC);
                const T* xe = reinterpret_cast<const T*>(&xpacked);
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[r] += wf[e] * to_f32(xe[e]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MAX_INPUT_ROWS; ++r) {
        if (r >= M) break;
        const float sum = warp_sum(acc[r]);
        if (lane == 0) partial[warp][r] = sum;
    }
    __syncthreads();
    if (part != 0 || n >= N || lane >= M) return;
    float sum = 0.0f;
    for (int p = 0; p < split; ++p) sum += partial[warp + p][lane];
    y[(long long)lane * N + n] = from_f32<T>(sum);
}

#define INSTANTIATE(T, NAME)                                                                                   \
    extern "C" __global__ void __launch_bounds__(ROWS_WARPS * 32)                                             \
        matmul_rows_##NAME(const T* x, const T* w, T* y, int M, int K, int N, int split) {                     \
        matmul_rows<T>(x, w, y, M, K, N, split);                                                               \
    }
STRATA_FOR_DTYPES(INSTANTIATE)

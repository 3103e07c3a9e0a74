// Normalisations and the SwiGLU product, each one launch where tensor ops take three to ten.
// Arithmetic is f32; intermediates are rounded to the model dtype T where transformers
// stores them in it. The model-width norms take one block per row (a decode step has one row
// per request, and a warp alone walks a 2560-wide row in ~80 dependent loads); the per-head
// norms one warp per row.
#include "common.cuh"

constexpr int NORM_WARPS = 4;
constexpr int MAX_ROW_ITEMS = 16;  // per thread of a row block: D <= 16 * blockDim.x

// Sum of squares of a row, the row read as f32 through `load`, one warp.
template <typename Load>
__device__ __forceinline__ float row_sum_sq(Load load, int D, int lane) {
    float acc = 0.0f;
    for (int d = lane; d < D; d += 32) {
        const float x = load(d);
        acc += x * x;
    }
    return warp_sum(acc);
}

// y = x rsqrt(mean(x^2) + eps) scale for the block's row of D, which its threads hold in
// registers between the sum and the scaling.
template <typename T>
__device__ __forceinline__ void rms_norm_block_row(float (&v)[MAX_ROW_ITEMS], const float* scale, T* y, int D,
                                                   float eps) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_ROW_ITEMS; ++i) acc += v[i] * v[i];
    const float inv = rsqrtf(block_sum(acc) / D + eps);
#pragma unroll
    for (int i = 0; i < MAX_ROW_ITEMS; ++i) {
        const int d = threadIdx.x + i * blockDim.x;
        if (d < D) y[d] = from_f32<T>(v[i] * inv * scale[d]);
    }
}

// y = x rsqrt(mean(x^2) + eps) scale, one block per row of D.
template <typename T>
__device__ void rms_norm(const T* x, const float* scale, T* y, int D, float eps) {
    const long long base = (long long)blockIdx.x * D;
    float v[MAX_ROW_ITEMS];
#pragma unroll
    for (int i = 0; i < MAX_ROW_ITEMS; ++i) {
        const int d = threadIdx.x + i * blockDim.x;
        v[i] = d < D ? to_f32(x[base + d]) : 0.0f;
    }
    rms_norm_block_row(v, scale, y + base, D, eps);
}

// sum = x + h (in T), y = rms_norm(sum): a residual add and the norm after it, one block per row.
template <typename T>
__device__ void add_rms_norm(const T* x, const T* h, const float* scale, T* sum, T* y, int D, float eps) {
    const long long base = (long long)blockIdx.x * D;
    float v[MAX_ROW_ITEMS];
#pragma unroll
    for (int i = 0; i < MAX_ROW_ITEMS; ++i) {
        const int d = threadIdx.x + i * blockDim.x;
        v[i] = 0.0f;
        if (d < D) {
            const T s = from_f32<T>(to_f32(x[base + d]) + to_f32(h[base + d]));
            sum[base + d] = s;
            v[i] = to_f32(s);
        }
    }
    rms_norm_block_row(v, scale, y + base, D, eps);
}

// The DeltaNet output norm: x (f32 [rows, D], rounded to T first) normalised, rounded to T,
// times weight (rounded to T, as transformers multiplies in the model dtype), times silu(gate),
// in T. Row r is head r mod H of token r / H; the gate's tokens
// lie `gate_stride` apart, its heads contiguous.
template <typename T>
__device__ void gated_rms_norm(const float* x, const T* gate, long long gate_stride, const float* weight, T* y, int rows,
                               int H, int D, float eps) {
    const int row = blockIdx.x * NORM_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const long long base = (long long)row * D;
    const T* g = gate + (long long)(row / H) * gate_stride + (long long)(row % H) * D;
    const float inv = rsqrtf(row_sum_sq([&](int d) { return round_to<T>(x[base + d]); }, D, lane) / D + eps);
    for (int d = lane; d < D; d += 32) {
        const float normed = round_to<T>(round_to<T>(x[base + d]) * inv);
        y[base + d] = from_f32<T>(round_to<T>(normed * weight[d]) * silu(to_f32(g[d])));
    }
}

// silu(gate) * up for [rows, cols] with the inputs' rows `gate_stride` / `up_stride` apart
// (halves of one projection's output, say); silu's result is rounded to T as a separate op
// would. y is contiguous. blockIdx.x is the row, blockIdx.y · blockDim.x + threadIdx.x the column.
template <typename T>
__device__ void silu_mul(const T* gate, long long gate_stride, const T* up, long long up_stride, T* y, int rows,
                         int cols) {
    const long long r = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (r >= rows || c >= cols) return;
    y[r * cols + c] = from_f32<T>(round_to<T>(silu(to_f32(gate[r * gate_stride + c]))) * to_f32(up[r * up_stride + c]));
}

#define INSTANTIATE(T, NAME)                                                                                   \
    extern "C" __global__ void rms_norm_##NAME(const T* x, const float* scale, T* y, int D, float eps) {      \
        rms_norm<T>(x, scale, y, D, eps);                                                                      \
    }                                                                                                          \
    extern "C" __global__ void add_rms_norm_##NAME(const T* x, const T* h, const float* scale, T* sum, T* y,  \
                                                   int D, float eps) {                                         \
        add_rms_norm<T>(x, h, scale, sum, y, D, eps);                                                          \
    }                                                                                                          \
    extern "C" __global__ void gated_rms_norm_##NAME(const float* x, const T* gate, long long gate_stride,    \
                                                     const float* weight, T* y, int rows, int H, int D,        \
                                                     float eps) {                                              \
        gated_rms_norm<T>(x, gate, gate_stride, weight, y, rows, H, D, eps);                                   \
    }                                                                                                          \
    extern "C" __global__ void silu_mul_##NAME(const T* gate, long long gate_stride, const T* up,             \
                                               long long up_stride, T* y, int rows, int cols) {                \
        silu_mul<T>(gate, gate_stride, up, up_stride, y, rows, cols);                                          \
    }
STRATA_FOR_DTYPES(INSTANTIATE)

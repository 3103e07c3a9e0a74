// Normalisations and the SwiGLU product, each one launch where tensor ops take three to ten.
// Arithmetic is f32; intermediates are rounded to the model dtype T where transformers
// stores them in it. The model-width norms take one block per row (a decode step has one row
// per request, and a warp alone walks a 2560-wide row in ~80 dependent loads); the per-head
// norms one warp per row.
#include "common.cuh"

constexpr int NORM_WARPS = 4;
constexpr int MAX_ROW_ITEMS = 16;  // per thread of a row block: D <= 16 * blockDim.x
constexpr int MAX_HEAD_ITEMS = 8;  // per lane of a per-head norm: D <= 8 * 32

// sum = x + h (in T), then y = x rsqrt(mean(sum^2) + eps) scale (RMSNorm) or, `centered`,
// y = (x - mean) rsqrt(mean((x - mean)^2) + eps) scale + bias (LayerNorm, bias optional): a
// residual add and the norm after it (without h, the norm of x alone and no sum), one block
// per row of D, whose threads hold the row in registers between the reductions and the
// scaling. The parameters P are f32 or T. With `pieces` (D a multiple of 16 bytes' worth, rows
// 16-byte aligned) each thread moves 16-byte pieces, else single elements.
template <typename T, typename P>
__device__ void add_norm(const T* x, const T* h, const P* scale, const P* bias, T* sum, T* y, int D, float eps,
                         int pieces, bool centered) {
    constexpr int VEC = 16 / sizeof(T), PIECES = MAX_ROW_ITEMS / VEC;
    const long long base = (long long)blockIdx.x * D;
    const auto stream = [&](T xv, T hv) { return h ? from_f32<T>(to_f32(xv) + to_f32(hv)) : xv; };
    // Where item i of this thread sits in the row.
    const auto column = [&](int i) { return pieces ? (threadIdx.x + i / VEC * blockDim.x) * VEC + i % VEC : threadIdx.x + i * blockDim.x; };
    float v[MAX_ROW_ITEMS];
    if (pieces) {
#pragma unroll
        for (int i = 0; i < PIECES; ++i) {
            const int d = (threadIdx.x + i * blockDim.x) * VEC;
#pragma unroll
            for (int e = 0; e < VEC; ++e) v[i * VEC + e] = 0.0f;
            if (d >= D) continue;
            const uint4 xv = *reinterpret_cast<const uint4*>(x + base + d);
            const uint4 hv = h ? *reinterpret_cast<const uint4*>(h + base + d) : xv;
            uint4 sv;
            const T *xe = reinterpret_cast<const T*>(&xv), *he = reinterpret_cast<const T*>(&hv);
            T* se = reinterpret_cast<T*>(&sv);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                se[e] = stream(xe[e], he[e]);
                v[i * VEC + e] = to_f32(se[e]);
            }
            if (sum) *reinterpret_cast<uint4*>(sum + base + d) = sv;
        }
    } else {
#pragma unroll
        for (int i = 0; i < MAX_ROW_ITEMS; ++i) {
            const int d = threadIdx.x + i * blockDim.x;
            v[i] = 0.0f;
            if (d < D) {
                const T s = stream(x[base + d], h ? h[base + d] : x[base + d]);
                if (sum) sum[base + d] = s;
                v[i] = to_f32(s);
            }
        }
    }
    if (centered) {
        float total = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_ROW_ITEMS; ++i) total += v[i];
        const float mean = block_sum(total) / D;
#pragma unroll
        for (int i = 0; i < MAX_ROW_ITEMS; ++i) v[i] = column(i) < D ? v[i] - mean : 0.0f;
    }
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_ROW_ITEMS; ++i) acc += v[i] * v[i];
    const float inv = rsqrtf(block_sum(acc) / D + eps);
    const auto out = [&](int i, int d) {
        const float r = v[i] * inv * to_f32(scale[d]);
        return from_f32<T>(bias ? r + to_f32(bias[d]) : r);
    };
    if (pieces) {
#pragma unroll
        for (int i = 0; i < PIECES; ++i) {
            const int d = (threadIdx.x + i * blockDim.x) * VEC;
            if (d >= D) continue;
            uint4 o;
            T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
            for (int e = 0; e < VEC; ++e) oe[e] = out(i * VEC + e, d + e);
            *reinterpret_cast<uint4*>(y + base + d) = o;
        }
    } else {
#pragma unroll
        for (int i = 0; i < MAX_ROW_ITEMS; ++i) {
            const int d = threadIdx.x + i * blockDim.x;
            if (d < D) y[base + d] = out(i, d);
        }
    }
}

// The DeltaNet output norm: x (f32 [rows, D], rounded to T first) normalised, rounded to T,
// times weight (rounded to T, as transformers multiplies in the model dtype), times silu(gate),
// in T. Row r is head r mod H of token r / H; the gate's tokens lie `gate_stride` apart, its
// heads contiguous. A warp per row holds its lanes' ITEMS (= ceil(D / 32)) x and gate elements
// in registers, all loaded before the sum of squares needs them: a second pass over x, and the
// gate loaded after the sum, left it at a third of the copy bandwidth in a prefill, and so did
// a fixed maximum of items whose unused ones still cost instructions.
template <typename T, int ITEMS>
__device__ void gated_rms_norm(const float* x, const T* gate, long long gate_stride, const float* weight, T* y, int rows,
                               int H, int D, float eps) {
    const int row = blockIdx.x * NORM_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const long long base = (long long)row * D;
    const T* g = gate + (long long)(row / H) * gate_stride + (long long)(row % H) * D;
    float v[ITEMS], gates[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int d = lane + 32 * i;
        v[i] = d < D ? round_to<T>(x[base + d]) : 0.0f;
        gates[i] = d < D ? to_f32(g[d]) : 0.0f;
    }
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) acc += v[i] * v[i];
    const float inv = rsqrtf(warp_sum(acc) / D + eps);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int d = lane + 32 * i;
        if (d < D) y[base + d] = from_f32<T>(round_to<T>(round_to<T>(v[i] * inv) * weight[d]) * silu(gates[i]));
    }
}

// gated_rms_norm with ITEMS chosen for D (at most MAX_HEAD_ITEMS · 32, which the caller checks).
template <typename T>
__device__ void gated_rms_norm_for(const float* x, const T* gate, long long gate_stride, const float* weight, T* y,
                                   int rows, int H, int D, float eps) {
    static_assert(MAX_HEAD_ITEMS == 8, "one case below per ITEMS up to MAX_HEAD_ITEMS");
    switch ((D + 31) / 32) {
#define ITEMS_CASE(N) \
    case N: return gated_rms_norm<T, N>(x, gate, gate_stride, weight, y, rows, H, D, eps);
        ITEMS_CASE(1) ITEMS_CASE(2) ITEMS_CASE(3) ITEMS_CASE(4) ITEMS_CASE(5) ITEMS_CASE(6) ITEMS_CASE(7) ITEMS_CASE(8)
#undef ITEMS_CASE
    }
}

// out[e] = op(a[e], b[e]) for the 16 bytes' worth of elements (VEC) at these addresses: one
// 16-byte load per input and one store where `whole` (a full piece, every address 16-byte
// aligned), else element by element, at most `left` of them.
template <typename T, typename Op>
__device__ __forceinline__ void piece_op(const T* a, const T* b, T* out, bool whole, int left, Op op) {
    constexpr int VEC = 16 / sizeof(T);
    if (whole) {
        const uint4 av = *reinterpret_cast<const uint4*>(a), bv = *reinterpret_cast<const uint4*>(b);
        uint4 ov;
        const T *ae = reinterpret_cast<const T*>(&av), *be = reinterpret_cast<const T*>(&bv);
        T* oe = reinterpret_cast<T*>(&ov);
#pragma unroll
        for (int e = 0; e < VEC; ++e) oe[e] = op(ae[e], be[e]);
        *reinterpret_cast<uint4*>(out) = ov;
    } else {
        for (int e = 0; e < VEC && e < left; ++e) out[e] = op(a[e], b[e]);
    }
}

// silu(gate) * up for [rows, cols] with the inputs' rows `gate_stride` / `up_stride` apart
// (halves of one projection's output, say); silu's result is rounded to T as a separate op
// would. y is contiguous. blockIdx.x is the row; each thread takes 16 bytes' worth of columns
// (blockIdx.y · blockDim.x + threadIdx.x counts those pieces), in one load per input where
// `pieces` says every row of both inputs and the output starts 16-byte aligned.
template <typename T>
__device__ void silu_mul(const T* gate, long long gate_stride, const T* up, long long up_stride, T* y, int rows,
                         int cols, int pieces) {
    constexpr int VEC = 16 / sizeof(T);
    const long long r = blockIdx.x;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (r >= rows || c >= cols) return;
    const T* g = gate + r * gate_stride + c;
    const T* u = up + r * up_stride + c;
    T* out = y + r * cols + c;
    const auto product = [](T g, T u) { return from_f32<T>(round_to<T>(silu(to_f32(g))) * to_f32(u)); };
    piece_op<T>(g, u, out, pieces && c + VEC <= cols, cols - c, product);
}

// y = act(x + bias) for x [rows, cols] contiguous and bias [cols]: the sum rounded to T (as a
// separate add stores it), the activation in f32 rounded to T once (as PyTorch computes a GELU
// on a 16-bit tensor). act: 0 none, 1 GELU (tanh approximation), 2 GELU (erf). Threads take
// 16-byte pieces of a row as silu_mul does.
template <typename T>
__device__ void bias_act(const T* x, const T* bias, T* y, int rows, int cols, int act, int pieces) {
    constexpr int VEC = 16 / sizeof(T);
    const long long r = blockIdx.x;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (r >= rows || c >= cols) return;
    const T* xr = x + r * cols + c;
    T* out = y + r * cols + c;
    const auto apply = [act](T xv, T bv) {
        const float s = round_to<T>(to_f32(xv) + to_f32(bv));
        switch (act) {
            case 1: return from_f32<T>(s / (1.0f + expf(-2.0f * 0.7978845608f * (s + 0.044715f * s * s * s))));
            case 2: return from_f32<T>(0.5f * s * (1.0f + erff(s * 0.7071067812f)));
            default: return from_f32<T>(s);
        }
    };
    piece_op<T>(xr, bias + c, out, pieces && c + VEC <= cols, cols - c, apply);
}

#define INSTANTIATE(T, NAME)                                                                                   \
    extern "C" __global__ void rms_norm_##NAME(const T* x, const T* h, const float* scale, T* sum, T* y, int D, \
                                               float eps, int pieces) {                                        \
        await_previous_kernel();                                                                               \
        add_norm<T, float>(x, h, scale, nullptr, sum, y, D, eps, pieces, false);                               \
    }                                                                                                          \
    extern "C" __global__ void layer_norm_##NAME(const T* x, const T* h, const T* weight, const T* bias,      \
                                                 T* sum, T* y, int D, float eps, int pieces) {                 \
        await_previous_kernel();                                                                               \
        add_norm<T, T>(x, h, weight, bias, sum, y, D, eps, pieces, true);                                      \
    }                                                                                                          \
    extern "C" __global__ void bias_act_##NAME(const T* x, const T* bias, T* y, int rows, int cols, int act,  \
                                               int pieces) {                                                   \
        await_previous_kernel();                                                                               \
        bias_act<T>(x, bias, y, rows, cols, act, pieces);                                                      \
    }                                                                                                          \
    extern "C" __global__ void gated_rms_norm_##NAME(const float* x, const T* gate, long long gate_stride,    \
                                                     const float* weight, T* y, int rows, int H, int D,        \
                                                     float eps) {                                              \
        await_previous_kernel();                                                                               \
        gated_rms_norm_for<T>(x, gate, gate_stride, weight, y, rows, H, D, eps);                               \
    }                                                                                                          \
    extern "C" __global__ void silu_mul_##NAME(const T* gate, long long gate_stride, const T* up,             \
                                               long long up_stride, T* y, int rows, int cols, int pieces) {    \
        await_previous_kernel();                                                                               \
        silu_mul<T>(gate, gate_stride, up, up_stride, y, rows, cols, pieces);                                  \
    }
STRATA_FOR_DTYPES(INSTANTIATE)

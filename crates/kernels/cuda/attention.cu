// Attention for a few queries over one row's KV history (decode steps, speculative verify
// blocks), and the per-head RMSNorm + partial rotary embedding applied to q and k before it.
#include "common.cuh"

constexpr int ATTN_WARPS = 4;
constexpr int MAX_HEAD_DIM = 512;
constexpr int MAX_PER_LANE = MAX_HEAD_DIM / 32;

// One block per (query head, query). q [Hq, T, D] contiguous; k, v [Hkv, L, D] with the given
// head strides (the KV store's capacity) and contiguous positions; out [Hq, T, D]. Query i sits
// at position L - T + i and sees keys first..=pos (first = 0, or the window's start). Each warp
// walks every ATTN_WARPS-th key with an online softmax in f32; the warps then merge. A query's
// result does not depend on how many queries share the call.
template <typename T>
__device__ void attention_few(const T* q, const T* k, const T* v, T* out, int Hq, int Hkv, int Tq, int L, int D,
                              long long k_head_stride, long long v_head_stride, float scale, int window) {
    __shared__ float warp_max[ATTN_WARPS], warp_sum_exp[ATTN_WARPS];
    __shared__ float warp_acc[ATTN_WARPS][MAX_HEAD_DIM];
    const int h = blockIdx.x / Tq, i = blockIdx.x % Tq, kvh = h / (Hq / Hkv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int pos = L - Tq + i, first = window > 0 ? max(0, pos + 1 - window) : 0;
    const T* qr = q + ((long long)h * Tq + i) * D;
    const T* kh = k + kvh * k_head_stride;
    const T* vh = v + kvh * v_head_stride;
    float qv[MAX_PER_LANE], acc[MAX_PER_LANE];
#pragma unroll
    for (int e = 0; e < MAX_PER_LANE; ++e) {
        const int d = lane + 32 * e;
        qv[e] = d < D ? to_f32(qr[d]) * scale : 0.0f;
        acc[e] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int j = first + warp; j <= pos; j += ATTN_WARPS) {
        const T* kj = kh + (long long)j * D;
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < MAX_PER_LANE; ++e) {
            const int d = lane + 32 * e;
            if (d < D) s += qv[e] * to_f32(kj[d]);
        }
        s = warp_sum(s);
        const float m_new = fmaxf(m, s), correction = expf(m - m_new), p = expf(s - m_new);
        l = l * correction + p;
        const T* vj = vh + (long long)j * D;
#pragma unroll
        for (int e = 0; e < MAX_PER_LANE; ++e) {
            const int d = lane + 32 * e;
            if (d < D) acc[e] = acc[e] * correction + p * to_f32(vj[d]);
        }
        m = m_new;
    }
    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum_exp[warp] = l;
    }
    __syncthreads();
    float total_max = -INFINITY;
    for (int w = 0; w < ATTN_WARPS; ++w) total_max = fmaxf(total_max, warp_max[w]);
    const float mine = m == -INFINITY ? 0.0f : expf(m - total_max);
#pragma unroll
    for (int e = 0; e < MAX_PER_LANE; ++e) {
        const int d = lane + 32 * e;
        if (d < D) warp_acc[warp][d] = acc[e] * mine;
    }
    __syncthreads();
    float total_sum = 0.0f;
    for (int w = 0; w < ATTN_WARPS; ++w) {
        if (warp_max[w] != -INFINITY) total_sum += warp_sum_exp[w] * expf(warp_max[w] - total_max);
    }
    T* o = out + ((long long)h * Tq + i) * D;
    for (int d = threadIdx.x; d < D; d += ATTN_WARPS * 32) {
        float x = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) x += warp_acc[w][d];
        o[d] = from_f32<T>(x / total_sum);
    }
}

// Per (row, token, head): RMSNorm with `scale` (f32, [D]) rounded to T, then the NeoX
// half-split rotary embedding on the first 2·half dims with cos / sin (f32 [B, T, half],
// rounded to T as transformers casts them), each product and sum rounded to T. x is
// [B, T, H, D] with the given token and head strides; out is [B, H, T, D] contiguous, the
// layout attention reads. One warp per head row.
template <typename T>
__device__ void norm_rope(const T* x, const float* scale, const float* cos, const float* sin, T* out, int B, int Tn,
                          int H, int D, int half, long long token_stride, long long head_stride, float eps) {
    const int row = blockIdx.x * ATTN_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= B * Tn * H) return;
    const int h = row % H, bt = row / H, t = bt % Tn, b = bt / Tn;
    const T* xr = x + (long long)bt * token_stride + (long long)h * head_stride;
    float ss = 0.0f;
    for (int d = lane; d < D; d += 32) {
        const float e = to_f32(xr[d]);
        ss += e * e;
    }
    const float inv = rsqrtf(warp_sum(ss) / D + eps);
    auto normed = [&](int d) { return round_to<T>(to_f32(xr[d]) * inv * scale[d]); };
    const float* c = cos + (long long)bt * half;
    const float* s = sin + (long long)bt * half;
    T* o = out + (((long long)b * H + h) * Tn + t) * D;
    for (int d = lane; d < D; d += 32) {
        float y;
        if (d < half) {
            y = round_to<T>(normed(d) * round_to<T>(c[d])) - round_to<T>(normed(d + half) * round_to<T>(s[d]));
        } else if (d < 2 * half) {
            const int f = d - half;
            y = round_to<T>(normed(d) * round_to<T>(c[f])) + round_to<T>(normed(f) * round_to<T>(s[f]));
        } else {
            y = normed(d);
        }
        o[d] = from_f32<T>(y);
    }
}

// A batch's rows each over their own KV history: blockIdx.y is the row, whose entry in `rows`
// holds its keys' and values' addresses, their head strides and its length L. q and out are
// [B, Hq, T, D].
struct KvRow {
    long long k, v, k_head_stride, v_head_stride, len;
};

template <typename T>
__device__ void attention_rows(const T* q, const KvRow* rows, T* out, int Hq, int Hkv, int Tq, int D, float scale,
                               int window) {
    const KvRow r = rows[blockIdx.y];
    const long long offset = (long long)blockIdx.y * Hq * Tq * D;
    attention_few<T>(q + offset, reinterpret_cast<const T*>(r.k), reinterpret_cast<const T*>(r.v), out + offset, Hq,
                     Hkv, Tq, (int)r.len, D, r.k_head_stride, r.v_head_stride, scale, window);
}

// Writes src [B, H, T, D] (strides in elements for b, h, t; d contiguous) into each row's
// buffer [H, capacity, D] at that row's position: `rows` holds, per row, the buffer's address,
// its head stride and the first position to write. One thread per element.
struct KvDestination {
    long long ptr, head_stride, position;
};

template <typename T>
__device__ void write_rows(const T* src, const KvDestination* rows, int B, int H, int Tn, int D, long long sb,
                           long long sh, long long st) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * H * Tn * D) return;
    const int d = idx % D, t = (idx / D) % Tn, h = (idx / ((long long)D * Tn)) % H, b = idx / ((long long)D * Tn * H);
    const KvDestination r = rows[b];
    T* dst = reinterpret_cast<T*>(r.ptr);
    dst[h * r.head_stride + (r.position + t) * D + d] = src[b * sb + h * sh + t * st + d];
}

#define INSTANTIATE(T, NAME)                                                                                   \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                                             \
        attention_few_##NAME(const T* q, const T* k, const T* v, T* out, int Hq, int Hkv, int Tq, int L, int D, \
                             long long k_head_stride, long long v_head_stride, float scale, int window) {      \
        attention_few<T>(q, k, v, out, Hq, Hkv, Tq, L, D, k_head_stride, v_head_stride, scale, window);       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                                             \
        attention_rows_##NAME(const T* q, const KvRow* rows, T* out, int Hq, int Hkv, int Tq, int D, float scale, \
                              int window) {                                                                    \
        attention_rows<T>(q, rows, out, Hq, Hkv, Tq, D, scale, window);                                        \
    }                                                                                                          \
    extern "C" __global__ void write_rows_##NAME(const T* src, const KvDestination* rows, int B, int H, int Tn, \
                                                 int D, long long sb, long long sh, long long st) {            \
        write_rows<T>(src, rows, B, H, Tn, D, sb, sh, st);                                                     \
    }                                                                                                          \
    extern "C" __global__ void norm_rope_##NAME(const T* x, const float* scale, const float* cos,             \
                                                const float* sin, T* out, int B, int Tn, int H, int D,         \
                                                int half, long long token_stride, long long head_stride,       \
                                                float eps) {                                                   \
        norm_rope<T>(x, scale, cos, sin, out, B, Tn, H, D, half, token_stride, head_stride, eps);             \
    }
STRATA_FOR_DTYPES(INSTANTIATE)

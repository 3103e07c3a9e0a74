// Attention for a few queries per row over each row's KV history (decode steps, speculative
// verify blocks; the history in the row's own buffers or in a paged pool) as flash-decoding, the
// batched KV append, and the per-head RMSNorm + partial rotary embedding applied to q and k before it.
#include "common.cuh"

// Warps per attention block. A decode step at batch 1 has one block per query head and split
// (16 blocks for the 4B shape's heads under 512 keys), so the block's warps are what walks the
// keys in parallel: 16 instead of 4 took the 4B shape's batch-1 decode on an H200 from 248.5 to
// 278.6 tok/s at 128-token prompts and from 189.5 to 261.7 at 2048 (8 warps: 268.1 / 233.5).
// norm_rope takes its rows in blocks of as many warps, one row per warp.
constexpr int ATTN_WARPS = 16;
static_assert(ATTN_WARPS * 32 <= 1024, "a block holds at most 1024 threads");
constexpr int MAX_HEAD_DIM = 512;
constexpr int MAX_PER_LANE = MAX_HEAD_DIM / 32;
// Keys per split: a query's visible keys are cut at fixed multiples of this, whatever the
// batch or block, so its result is the same bits alone or batched, decoded or verified.
constexpr int SPLIT_KEYS = 512;
constexpr int KEY_GROUP = 4;

// Per row of a batch: its keys' and values' addresses, their head strides (the KV store's
// capacity times D) and its length L. A captured decode step replays with other lengths, so the
// kernels take them from `lens` ([B] int, device) instead where it is given.
struct KvRow {
    long long k, v, k_head_stride, v_head_stride, len;
};

// Where attention_split finds a row's keys and values: the row's length, each KV head's first key
// and value, and `at(j)`, position j's offset from those in elements (the same for keys and
// values). The split kernel is generic over it so that contiguous rows and a paged pool run the
// same arithmetic in the same order: their results are the same bits.
template <typename T>
struct ContiguousRow {
    KvRow r;
    const int* lens;
    unsigned b;
    int D;
    __device__ __forceinline__ int len() const { return lens ? lens[b] : (int)r.len; }
    __device__ __forceinline__ const T* keys(int kvh) const {
        return reinterpret_cast<const T*>(r.k) + kvh * r.k_head_stride;
    }
    __device__ __forceinline__ const T* values(int kvh) const {
        return reinterpret_cast<const T*>(r.v) + kvh * r.v_head_stride;
    }
    __device__ __forceinline__ long long at(int j) const { return (long long)j * D; }
};

// Rows in their own buffers [Hkv, capacity, D], through a KvRow table.
template <typename T>
struct ContiguousKv {
    const KvRow* rows;
    const int* lens;
    __device__ __forceinline__ ContiguousRow<T> row(unsigned b, int D) const { return {rows[b], lens, b, D}; }
};

// Paged KV: every row's positions in blocks of 2^shift pool rows of one pool [rows, Hkv, D]
// (token-major), position p at pool row table[p >> shift] * 2^shift + p % 2^shift. A power of
// two so that finding a key's block is a shift, not a division, in the keys' inner loop.
template <typename T>
struct PagedRow {
    const T* k;
    const T* v;
    const int* table;
    int length, shift, D;
    long long row_stride;
    __device__ __forceinline__ int len() const { return length; }
    __device__ __forceinline__ const T* keys(int kvh) const { return k + (long long)kvh * D; }
    __device__ __forceinline__ const T* values(int kvh) const { return v + (long long)kvh * D; }
    __device__ __forceinline__ long long at(int j) const {
        const long long row = ((long long)table[j >> shift] << shift) | (j & ((1 << shift) - 1));
        return row * row_stride;
    }
};

// The pools and each row's block table (`tables` [B, max_blocks]) and length (`lens` [B]).
template <typename T>
struct PagedKv {
    const T* k;
    const T* v;
    const int* tables;
    const int* lens;
    int max_blocks, shift, Hkv;
    __device__ __forceinline__ PagedRow<T> row(unsigned b, int D) const {
        return {k, v, tables + (long long)b * max_blocks, lens[b], shift, D, (long long)Hkv * D};
    }
};

// Flash-decoding, first half: one block per (query head and query, row, split of SPLIT_KEYS
// keys). q [B, Hq, T, D]; query i of a row sits at position L - T + i and sees keys
// first..=pos (first = 0, or the window's start). The block's warps each walk every
// ATTN_WARPS-th group of KEY_GROUP keys of the split with an online softmax in f32, then merge; the block writes
// its partial (max, sum of exponentials, weighted sum of values [D]) to `partial`
// [B, Hq, T, splits, D + 2] — an empty one (max -inf) when it sees no key.
template <typename T, typename Kv>
__device__ void attention_split(const T* q, const Kv kv, float* partial, int Hq, int Hkv, int Tq, int D, int splits,
                                float scale, int window) {
    __shared__ float warp_max[ATTN_WARPS], warp_sum_exp[ATTN_WARPS];
    __shared__ float warp_acc[ATTN_WARPS][MAX_HEAD_DIM];
    const auto r = kv.row(blockIdx.y, D);
    const int h = blockIdx.x / Tq, i = blockIdx.x % Tq, kvh = h / (Hq / Hkv), split = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int len = r.len();
    const int pos = len - Tq + i, first = window > 0 ? max(0, pos + 1 - window) : 0;
    const int from = max(first, split * SPLIT_KEYS), to = min(pos, (split + 1) * SPLIT_KEYS - 1);
    const long long query = ((long long)blockIdx.y * Hq + h) * Tq + i;
    const T* qr = q + query * D;
    const T* kh = r.keys(kvh);
    const T* vh = r.values(kvh);
    float qv[MAX_PER_LANE], acc[MAX_PER_LANE];
#pragma unroll
    for (int e = 0; e < MAX_PER_LANE; ++e) {
        const int d = lane + 32 * e;
        qv[e] = d < D ? to_f32(qr[d]) * scale : 0.0f;
        acc[e] = 0.0f;
    }
    // Each warp takes KEY_GROUP consecutive keys at a time (every ATTN_WARPS-th group of the
    // split): their dot products and reductions are independent, so their memory and shuffle
    // latencies overlap instead of adding up key after key.
    float m = -INFINITY, l = 0.0f;
    for (int j0 = from + warp * KEY_GROUP; j0 <= to; j0 += ATTN_WARPS * KEY_GROUP) {
        // Each key's offset once: through a block table it is a load, which the value loop
        // below would otherwise repeat for every element a lane sums (measured on an H200 on
        // 2026-12-03 under ncu: the paged kernel took 22.4 µs where the contiguous one took 12.5,
        // for 8 rows of ~80 keys).
        long long offset[KEY_GROUP];
#pragma unroll
        for (int g = 0; g < KEY_GROUP; ++g) offset[g] = r.at(min(j0 + g, to));
        float s[KEY_GROUP];
#pragma unroll
        for (int g = 0; g < KEY_GROUP; ++g) {
            const T* kj = kh + offset[g];
            s[g] = 0.0f;
#pragma unroll
            for (int e = 0; e < MAX_PER_LANE; ++e) {
                const int d = lane + 32 * e;
                if (d < D) s[g] += qv[e] * to_f32(kj[d]);
            }
        }
        float m_new = m;
#pragma unroll
        for (int g = 0; g < KEY_GROUP; ++g) {
            s[g] = j0 + g <= to ? warp_sum(s[g]) : -INFINITY;
            m_new = fmaxf(m_new, s[g]);
        }
        const float correction = expf(m - m_new);
        float p[KEY_GROUP];
        l *= correction;
#pragma unroll
        for (int g = 0; g < KEY_GROUP; ++g) {
            p[g] = expf(s[g] - m_new);
            l += p[g];
        }
#pragma unroll
        for (int e = 0; e < MAX_PER_LANE; ++e) {
            const int d = lane + 32 * e;
            if (d >= D) continue;
            float x = acc[e] * correction;
#pragma unroll
            for (int g = 0; g < KEY_GROUP; ++g) {
                if (j0 + g <= to) x += p[g] * to_f32(vh[offset[g] + d]);
            }
            acc[e] = x;
        }
        m = m_new;
    }
    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum_exp[warp] = l;
    }
    __syncthreads();
    float block_max = -INFINITY;
    for (int w = 0; w < ATTN_WARPS; ++w) block_max = fmaxf(block_max, warp_max[w]);
    const float mine = m == -INFINITY ? 0.0f : expf(m - block_max);
#pragma unroll
    for (int e = 0; e < MAX_PER_LANE; ++e) {
        const int d = lane + 32 * e;
        if (d < D) warp_acc[warp][d] = acc[e] * mine;
    }
    __syncthreads();
    float* out = partial + (query * splits + split) * (D + 2);
    if (threadIdx.x == 0) {
        float block_sum = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) {
            if (warp_max[w] != -INFINITY) block_sum += warp_sum_exp[w] * expf(warp_max[w] - block_max);
        }
        out[0] = block_max;
        out[1] = block_sum;
    }
    for (int d = threadIdx.x; d < D; d += ATTN_WARPS * 32) {
        float x = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) x += warp_acc[w][d];
        out[2 + d] = x;
    }
}

// Flash-decoding, second half: per query, the non-empty partials merged in split order, in T,
// into out [B, Hq, T, D]. With `gate` (the output gate of a gated attention, [B, T, Hq, D] with
// its tokens `gate_token_stride` and heads `gate_head_stride` apart) the result is instead
// times sigmoid(gate), the two factors rounded to T as transformers multiplies them, into out
// [B, T, Hq, D] — what the output projection reads: the gate's three ops in this launch.
template <typename T>
__device__ void attention_combine(const float* partial, T* out, int queries, int splits, int D, const T* gate,
                                  long long gate_token_stride, long long gate_head_stride, int Hq, int Tq) {
    const long long query = blockIdx.x;
    if (query >= queries) return;
    const float* p = partial + query * splits * (D + 2);
    float total_max = -INFINITY;
    for (int s = 0; s < splits; ++s) total_max = fmaxf(total_max, p[s * (D + 2)]);
    float total_sum = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float m = p[s * (D + 2)];
        if (m != -INFINITY) total_sum += p[s * (D + 2) + 1] * expf(m - total_max);
    }
    // The query's token (row b, index i) and head h, for the gated layout.
    const long long b = query / ((long long)Hq * Tq), token = b * Tq + query % Tq;
    const int h = (query / Tq) % Hq;
    const T* g = gate ? gate + token * gate_token_stride + h * gate_head_stride : nullptr;
    T* o = gate ? out + (token * Hq + h) * D : out + query * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float x = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float m = p[s * (D + 2)];
            if (m != -INFINITY) x += p[s * (D + 2) + 2 + d] * expf(m - total_max);
        }
        x /= total_sum;
        if (g) x = round_to<T>(x) * round_to<T>(1.0f / (1.0f + expf(-to_f32(g[d]))));
        o[d] = from_f32<T>(x);
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

// The softmax of a prompt block's attention scores, causal mask included: scores and probs
// [R, L] with row r the query r mod T (rows run over heads, then the queries of a block of T
// at positions L - T ..); query i sees keys first..=pos. f32 inside, probabilities in T, 0 for
// masked keys. One block per row.
constexpr int SOFTMAX_THREADS = 256;

__device__ __forceinline__ float block_reduce(float x, bool is_max, float* scratch) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, x, offset);
        x = is_max ? fmaxf(x, other) : x + other;
    }
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = scratch[0];
    for (int w = 1; w < SOFTMAX_THREADS / 32; ++w) x = is_max ? fmaxf(x, scratch[w]) : x + scratch[w];
    return x;
}

template <typename T>
__device__ void causal_softmax(const T* scores, T* probs, int L, int Tq, float scale, int window) {
    __shared__ float scratch[SOFTMAX_THREADS / 32];
    const long long r = blockIdx.x;
    const int i = r % Tq, pos = L - Tq + i, first = window > 0 ? max(0, pos + 1 - window) : 0;
    const T* row = scores + r * L;
    T* out = probs + r * L;
    float m = -INFINITY;
    for (int j = first + threadIdx.x; j <= pos; j += SOFTMAX_THREADS) m = fmaxf(m, to_f32(row[j]) * scale);
    m = block_reduce(m, true, scratch);
    float sum = 0.0f;
    for (int j = first + threadIdx.x; j <= pos; j += SOFTMAX_THREADS) sum += expf(to_f32(row[j]) * scale - m);
    sum = block_reduce(sum, false, scratch);
    for (int j = threadIdx.x; j < L; j += SOFTMAX_THREADS) {
        out[j] = from_f32<T>(j >= first && j <= pos ? expf(to_f32(row[j]) * scale - m) / sum : 0.0f);
    }
}

// Writes src [B, H, T, D] (strides in elements for b, h, t; d contiguous) into each row's
// buffer [H, capacity, D] at that row's position: `rows` holds, per row, the buffer's address,
// its head stride and the first position to write (or, with `lens`, the row's length after the
// write less T). One thread per element.
struct KvDestination {
    long long ptr, head_stride, position;
};

template <typename T>
__device__ void write_rows(const T* src, const KvDestination* rows, const int* lens, int B, int H, int Tn, int D,
                           long long sb, long long sh, long long st) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * H * Tn * D) return;
    const int d = idx % D, t = (idx / D) % Tn, h = (idx / ((long long)D * Tn)) % H, b = idx / ((long long)D * Tn * H);
    const KvDestination r = rows[b];
    T* dst = reinterpret_cast<T*>(r.ptr);
    const long long position = lens ? lens[b] - Tn : r.position;
    dst[h * r.head_stride + (position + t) * D + d] = src[b * sb + h * sh + t * st + d];
}

// write_rows into a paged pool [rows, Hkv, D] (PagedKv's layout): position p of row b at pool row
// tables[b][p >> shift] * 2^shift + p % 2^shift, the positions lens[b] - T .. lens[b] - 1.
template <typename T>
__device__ void write_paged(const T* src, T* pool, const int* tables, const int* lens, int max_blocks, int shift, int B,
                            int H, int Tn, int D, long long sb, long long sh, long long st) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * H * Tn * D) return;
    const int d = idx % D, t = (idx / D) % Tn, h = (idx / ((long long)D * Tn)) % H, b = idx / ((long long)D * Tn * H);
    const int p = lens[b] - Tn + t;
    const long long block = tables[(long long)b * max_blocks + (p >> shift)];
    const long long row = (block << shift) | (p & ((1 << shift) - 1));
    pool[(row * H + h) * D + d] = src[b * sb + h * sh + t * st + d];
}

#define INSTANTIATE(T, NAME)                                                                                   \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                                             \
        attention_split_##NAME(const T* q, const KvRow* rows, const int* lens, float* partial, int Hq, int Hkv, \
                               int Tq, int D, int splits, float scale, int window) {                           \
        await_previous_kernel();                                                                               \
        attention_split<T>(q, ContiguousKv<T>{rows, lens}, partial, Hq, Hkv, Tq, D, splits, scale, window);    \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                                             \
        attention_split_paged_##NAME(const T* q, const T* k, const T* v, const int* tables, const int* lens,   \
                                     int max_blocks, int shift, float* partial, int Hq, int Hkv, int Tq, int D, \
                                     int splits, float scale, int window) {                                    \
        await_previous_kernel();                                                                               \
        attention_split<T>(q, PagedKv<T>{k, v, tables, lens, max_blocks, shift, Hkv}, partial, Hq, Hkv, Tq, D, \
                           splits, scale, window);                                                             \
    }                                                                                                          \
    extern "C" __global__ void attention_combine_##NAME(const float* partial, T* out, int queries, int splits,  \
                                                        int D, const T* gate, long long gate_token_stride,     \
                                                        long long gate_head_stride, int Hq, int Tq) {          \
        await_previous_kernel();                                                                               \
        attention_combine<T>(partial, out, queries, splits, D, gate, gate_token_stride, gate_head_stride, Hq, Tq); \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(SOFTMAX_THREADS)                                             \
        causal_softmax_##NAME(const T* scores, T* probs, int L, int Tq, float scale, int window) {             \
        await_previous_kernel();                                                                               \
        causal_softmax<T>(scores, probs, L, Tq, scale, window);                                                \
    }                                                                                                          \
    extern "C" __global__ void write_rows_##NAME(const T* src, const KvDestination* rows, const int* lens,     \
                                                 int B, int H, int Tn, int D, long long sb, long long sh,      \
                                                 long long st) {                                               \
        await_previous_kernel();                                                                               \
        write_rows<T>(src, rows, lens, B, H, Tn, D, sb, sh, st);                                               \
    }                                                                                                          \
    extern "C" __global__ void write_paged_##NAME(const T* src, T* pool, const int* tables, const int* lens,    \
                                                  int max_blocks, int shift, int B, int H, int Tn, int D,      \
                                                  long long sb, long long sh, long long st) {                  \
        await_previous_kernel();                                                                               \
        write_paged<T>(src, pool, tables, lens, max_blocks, shift, B, H, Tn, D, sb, sh, st);                   \
    }                                                                                                          \
    extern "C" __global__ void norm_rope_##NAME(const T* x, const float* scale, const float* cos,             \
                                                const float* sin, T* out, int B, int Tn, int H, int D,         \
                                                int half, long long token_stride, long long head_stride,       \
                                                float eps) {                                                   \
        await_previous_kernel();                                                                               \
        norm_rope<T>(x, scale, cos, sin, out, B, Tn, H, D, half, token_stride, head_stride, eps);             \
    }
STRATA_FOR_DTYPES(INSTANTIATE)

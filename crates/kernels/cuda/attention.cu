// Attention for a few queries per row over each row's KV history (decode steps, speculative
// verify blocks; the history in the row's own buffers or in a paged pool) as flash-decoding, the
// batched KV append, and the per-head RMSNorm + partial rotary embedding applied to q and k before it.
#include <type_traits>

#include "common.cuh"
#include "kv_codes.cuh"

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
// and value, `at(j)`, the index of position j's vector, and how far apart consecutive indices'
// keys and values lie (`key_stride`, `value_stride`, in stored elements). The split kernel is
// generic over it so that contiguous rows and a paged pool run the same arithmetic in the same
// order: their results are the same bits.
template <typename T>
struct ContiguousRow {
    KvRow r;
    const int* lens;
    unsigned b;
    int D;
    long long key_stride, value_stride;
    __device__ __forceinline__ int len() const { return lens ? lens[b] : (int)r.len; }
    __device__ __forceinline__ const T* keys(int kvh) const {
        return reinterpret_cast<const T*>(r.k) + kvh * r.k_head_stride;
    }
    __device__ __forceinline__ const T* values(int kvh) const {
        return reinterpret_cast<const T*>(r.v) + kvh * r.v_head_stride;
    }
    __device__ __forceinline__ long long at(int j) const { return j; }
};

// Rows in their own buffers [Hkv, capacity, D], through a KvRow table. `row` is called by every
// thread of a block, for the block's row and split.
template <typename T>
struct ContiguousKv {
    const KvRow* rows;
    const int* lens;
    __device__ __forceinline__ ContiguousRow<T> row(unsigned b, int D, int) const {
        return {rows[b], lens, b, D, D, D};
    }
};

// Paged KV: every row's positions in blocks of 2^shift pool rows of one pool [rows, Hkv, W]
// (token-major; W the head dim, or a code's bytes), position p at pool row
// table[p >> shift] * 2^shift + p % 2^shift. A power of two so that finding a key's block is a
// shift, not a division, in the keys' inner loop. The block-table entries of the split's keys
// are in shared memory (`blocks`, from table entry `first`): the keys' loop reads them there
// instead of waiting on a global load for each key.
template <typename S>
struct PagedRow {
    const S* k;
    const S* v;
    const int* blocks;
    int first, length, shift;
    int key_width, value_width;
    long long key_stride, value_stride;
    __device__ __forceinline__ int len() const { return length; }
    __device__ __forceinline__ const S* keys(int kvh) const { return k + (long long)kvh * key_width; }
    __device__ __forceinline__ const S* values(int kvh) const { return v + (long long)kvh * value_width; }
    __device__ __forceinline__ long long at(int j) const {
        return ((long long)blocks[(j >> shift) - first] << shift) | (j & ((1 << shift) - 1));
    }
};

static_assert((SPLIT_KEYS & (SPLIT_KEYS - 1)) == 0, "a split starts a block of keys or lies in one");

// The pools and each row's block table (`tables` [B, max_blocks]) and length (`lens` [B]); the
// pools' vectors are `key_width` and `value_width` stored elements wide (S: the compute dtype,
// or bytes of codes).
template <typename S>
struct PagedKv {
    const S* k;
    const S* v;
    const int* tables;
    const int* lens;
    int max_blocks, shift, Hkv, key_width, value_width;
    // Copies the table entries of split `split`'s keys into shared memory, all the block's
    // threads at once, where they take one load's latency together: keys split * SPLIT_KEYS ..
    // lie in SPLIT_KEYS >> shift blocks from entry (split * SPLIT_KEYS) >> shift, or in one
    // where a block is longer than a split (SPLIT_KEYS is a power of two), and entries past the
    // table's width belong to no split that has a key. Called after await_previous_kernel.
    __device__ __forceinline__ PagedRow<S> row(unsigned b, int, int split) const {
        __shared__ int staged[SPLIT_KEYS];
        const int* table = tables + (long long)b * max_blocks;
        const int first = (split * SPLIT_KEYS) >> shift;
        const int count = min(((SPLIT_KEYS - 1) >> shift) + 1, max_blocks - first);
        for (int e = threadIdx.x; e < count; e += blockDim.x) staged[e] = table[first + e];
        __syncthreads();
        return {k,     v, staged, first, lens[b], shift, key_width, value_width, (long long)Hkv * key_width,
                (long long)Hkv * value_width};
    }
};

// How the split kernel reads a key or value vector: a lane's PER_LANE coordinates, as f32, and
// which coordinate its e-th is.
//
// As computed (T): coordinate lane + 32 e, so a warp's loads of one e are consecutive elements;
// those past a runtime D (HEAD_DIM = 0) read as 0 and are never summed.
template <typename T>
struct PlainRead {
    using Stored = T;
    __device__ __forceinline__ static int dim(int lane, int e, int) { return lane + 32 * e; }
    template <int PER_LANE, int HEAD_DIM>
    __device__ __forceinline__ void read(const T* vec, int lane, int D, float (&out)[PER_LANE]) const {
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int d = lane + 32 * e;
            out[e] = HEAD_DIM || d < D ? to_f32(vec[d]) : 0.0f;
        }
    }
    template <int PER_LANE, int HEAD_DIM>
    __device__ __forceinline__ void key(const T* vec, int lane, int D, float (&out)[PER_LANE]) const {
        read<PER_LANE, HEAD_DIM>(vec, lane, D, out);
    }
    template <int PER_LANE, int HEAD_DIM>
    __device__ __forceinline__ void value(const T* vec, int lane, int D, float (&out)[PER_LANE]) const {
        read<PER_LANE, HEAD_DIM>(vec, lane, D, out);
    }
};

// Codes (kv_codes.cuh): coordinates lane · PER_LANE + e, so a lane's codes are a few adjacent
// bytes it loads at once. Keys and values each with their own format.
struct CodedRead {
    using Stored = uint8_t;
    PartCodes keys, values;
    __device__ __forceinline__ static int dim(int lane, int e, int per_lane) { return lane * per_lane + e; }
    template <int PER_LANE, int HEAD_DIM>
    __device__ __forceinline__ void key(const uint8_t* vec, int lane, int D, float (&out)[PER_LANE]) const {
        read_lane<PER_LANE>(vec, lane, D, keys, out);
    }
    template <int PER_LANE, int HEAD_DIM>
    __device__ __forceinline__ void value(const uint8_t* vec, int lane, int D, float (&out)[PER_LANE]) const {
        read_lane<PER_LANE>(vec, lane, D, values, out);
    }
};

// Flash-decoding, first half: one block per (QG query heads of one KV head and query, row,
// split of SPLIT_KEYS keys). q [B, Hq, T, D]; query i of a row sits at position L - T + i and
// sees keys first..=pos (first = 0, or the window's start). The block's warps each walk every
// ATTN_WARPS-th group of KEY_GROUP keys of the split with an online softmax in f32, then merge;
// the block writes each query's partial (max, sum of exponentials, weighted sum of values [D])
// to `partial` [B, Hq, T, splits, D + 2] — an empty one (max -inf) when it sees no key.
//
// QG = 1 is the plain kernel: one query head per block, any D up to MAX_HEAD_DIM (HEAD_DIM = 0;
// a lane holds MAX_PER_LANE elements of its query and sum, those past D unused). The grouped
// kernels (QG > 1, HEAD_DIM = D at compile time so that a lane holds only D / 32 of each) load
// every key and value element once for the QG heads that share its KV head. Per query, every
// operation is the plain kernel's, in its order: the same warp takes the same keys, each score
// is the same lane sums (the lane's elements in order) reduced by the same butterflies, the
// online softmax and the weighted sums are updated with the same operations per key group, and
// the merge sums the warps in order. The products, sums and fused multiply-adds are written as
// intrinsics (__fmul_rn, __fadd_rn, __fmaf_rn), which the compiler neither fuses nor splits, so
// that how the code is laid out (one query or several interleaved, a branch or a select) cannot
// change which of them it fuses: each is what the plain kernel compiled to when they were plain
// `*` and `+` (in its PTX, the score and weighted-sum terms and l · correction + p[0] fused, the
// rest not; ptxas fused nothing further, every expf's result read by its own last FMUL only),
// so the plain kernel kept its bits and the grouped kernels' partials are the same bits.
//
// `Read` says how vectors are stored (PlainRead: as computed; CodedRead: quantized, which takes
// HEAD_DIM at compile time and lays a lane's coordinates side by side). The plain kernels'
// loops below are the ones their bits were established with; the coded ones read a lane's
// coordinates of a vector at once and then run the same sums.
template <int QG, int HEAD_DIM, typename T, typename Kv, typename Read>
__device__ void attention_split(const T* q, const Kv kv, const Read read, float* partial, int Hq, int Hkv, int Tq,
                                int head_dim, int splits, float scale, int window) {
    constexpr bool CODED = !std::is_same<typename Read::Stored, T>::value;
    static_assert(!CODED || HEAD_DIM > 0, "coded kernels know D");
    static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= MAX_HEAD_DIM, "a lane holds D / 32 elements");
    static_assert(QG >= 1 && QG <= ATTN_WARPS && (QG == 1 || HEAD_DIM > 0), "grouped blocks know D");
    constexpr int PER_LANE = HEAD_DIM ? HEAD_DIM / 32 : MAX_PER_LANE;
    // Queries merged at once: as many as a warp's row of MAX_HEAD_DIM in warp_acc holds.
    constexpr int MERGED = HEAD_DIM == 0 ? 1 : QG < MAX_HEAD_DIM / HEAD_DIM ? QG : MAX_HEAD_DIM / HEAD_DIM;
    static_assert(QG % MERGED == 0, "whole rounds of merged queries");
    const int D = HEAD_DIM ? HEAD_DIM : head_dim;
    __shared__ float warp_max[QG][ATTN_WARPS], warp_sum_exp[QG][ATTN_WARPS];
    __shared__ float warp_acc[ATTN_WARPS][MAX_HEAD_DIM];
    const int split = blockIdx.z;
    const auto r = kv.row(blockIdx.y, D, split);
    const int h = blockIdx.x / Tq * QG, i = blockIdx.x % Tq, kvh = h / (Hq / Hkv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int len = r.len();
    const int pos = len - Tq + i, first = window > 0 ? max(0, pos + 1 - window) : 0;
    const int from = max(first, split * SPLIT_KEYS), to = min(pos, (split + 1) * SPLIT_KEYS - 1);
    // The block's first query; query u of the group (head h + u) is Tq further per u.
    const long long query = ((long long)blockIdx.y * Hq + h) * Tq + i;
    const auto* kh = r.keys(kvh);
    const auto* vh = r.values(kvh);
    float qv[QG][PER_LANE], acc[QG][PER_LANE];
#pragma unroll
    for (int u = 0; u < QG; ++u) {
        const T* qr = q + (query + u * Tq) * D;
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int d = Read::dim(lane, e, PER_LANE);
            qv[u][e] = HEAD_DIM || d < D ? __fmul_rn(to_f32(qr[d]), scale) : 0.0f;
            acc[u][e] = 0.0f;
        }
    }
    // Each warp takes KEY_GROUP consecutive keys at a time (every ATTN_WARPS-th group of the
    // split): their dot products and reductions are independent, so their memory and shuffle
    // latencies overlap instead of adding up key after key.
    float m[QG], l[QG];
#pragma unroll
    for (int u = 0; u < QG; ++u) {
        m[u] = -INFINITY;
        l[u] = 0.0f;
    }
    for (int j0 = from + warp * KEY_GROUP; j0 <= to; j0 += ATTN_WARPS * KEY_GROUP) {
        // Each key's offset once: through a block table it is a lookup, which the value loop
        // below would otherwise repeat for every element a lane sums (measured on an H200 on
        // 2026-12-03 under ncu, when the lookup was a global load: the paged kernel took 22.4 µs
        // where the contiguous one took 12.5, for 8 rows of ~80 keys).
        long long offset[KEY_GROUP];
#pragma unroll
        for (int g = 0; g < KEY_GROUP; ++g) offset[g] = r.at(min(j0 + g, to));
        float s[QG][KEY_GROUP];
#pragma unroll
        for (int g = 0; g < KEY_GROUP; ++g) {
#pragma unroll
            for (int u = 0; u < QG; ++u) s[u][g] = 0.0f;
            if constexpr (CODED) {
                float k[PER_LANE];
                read.template key<PER_LANE, HEAD_DIM>(kh + offset[g] * r.key_stride, lane, D, k);
#pragma unroll
                for (int e = 0; e < PER_LANE; ++e) {
#pragma unroll
                    for (int u = 0; u < QG; ++u) s[u][g] = __fmaf_rn(qv[u][e], k[e], s[u][g]);
                }
            } else {
                const T* kj = kh + offset[g] * r.key_stride;
#pragma unroll
                for (int e = 0; e < PER_LANE; ++e) {
                    const int d = lane + 32 * e;
                    if (HEAD_DIM || d < D) {
                        const float k = to_f32(kj[d]);
#pragma unroll
                        for (int u = 0; u < QG; ++u) s[u][g] = __fmaf_rn(qv[u][e], k, s[u][g]);
                    }
                }
            }
        }
        float correction[QG], p[QG][KEY_GROUP];
#pragma unroll
        for (int u = 0; u < QG; ++u) {
            float m_new = m[u];
#pragma unroll
            for (int g = 0; g < KEY_GROUP; ++g) {
                s[u][g] = j0 + g <= to ? warp_sum(s[u][g]) : -INFINITY;
                m_new = fmaxf(m_new, s[u][g]);
            }
            correction[u] = expf(m[u] - m_new);
            // l · correction + p[0] rounded once, then the other p in order.
#pragma unroll
            for (int g = 0; g < KEY_GROUP; ++g) {
                p[u][g] = expf(s[u][g] - m_new);
                l[u] = g == 0 ? __fmaf_rn(l[u], correction[u], p[u][g]) : __fadd_rn(l[u], p[u][g]);
            }
            m[u] = m_new;
        }
        if constexpr (CODED) {
            // Each element's sum as below (times the correction, then the keys in order), with
            // a lane's coordinates of each value read at once.
#pragma unroll
            for (int u = 0; u < QG; ++u) {
#pragma unroll
                for (int e = 0; e < PER_LANE; ++e) acc[u][e] = __fmul_rn(acc[u][e], correction[u]);
            }
#pragma unroll
            for (int g = 0; g < KEY_GROUP; ++g) {
                if (j0 + g > to) continue;
                float v[PER_LANE];
                read.template value<PER_LANE, HEAD_DIM>(vh + offset[g] * r.value_stride, lane, D, v);
#pragma unroll
                for (int u = 0; u < QG; ++u) {
#pragma unroll
                    for (int e = 0; e < PER_LANE; ++e) acc[u][e] = __fmaf_rn(p[u][g], v[e], acc[u][e]);
                }
            }
        } else {
#pragma unroll
            for (int e = 0; e < PER_LANE; ++e) {
                const int d = lane + 32 * e;
                if (!(HEAD_DIM || d < D)) continue;
                float v[KEY_GROUP];
#pragma unroll
                for (int g = 0; g < KEY_GROUP; ++g) v[g] = j0 + g <= to ? to_f32(vh[offset[g] * r.value_stride + d]) : 0.0f;
#pragma unroll
                for (int u = 0; u < QG; ++u) {
                    float x = __fmul_rn(acc[u][e], correction[u]);
#pragma unroll
                    for (int g = 0; g < KEY_GROUP; ++g) {
                        if (j0 + g <= to) x = __fmaf_rn(p[u][g], v[g], x);
                    }
                    acc[u][e] = x;
                }
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int u = 0; u < QG; ++u) {
            warp_max[u][warp] = m[u];
            warp_sum_exp[u][warp] = l[u];
        }
    }
    __syncthreads();
    float block_max[QG];
#pragma unroll
    for (int u = 0; u < QG; ++u) {
        block_max[u] = -INFINITY;
        for (int w = 0; w < ATTN_WARPS; ++w) block_max[u] = fmaxf(block_max[u], warp_max[u][w]);
    }
    // MERGED queries at a time: each warp's weighted sums in warp_acc, then the warps' sums per
    // element in warp order.
#pragma unroll
    for (int u0 = 0; u0 < QG; u0 += MERGED) {
        if (u0 > 0) __syncthreads();  // the previous round's readers are done with warp_acc
#pragma unroll
        for (int u = u0; u < u0 + MERGED; ++u) {
            const float mine = m[u] == -INFINITY ? 0.0f : expf(m[u] - block_max[u]);
#pragma unroll
            for (int e = 0; e < PER_LANE; ++e) {
                const int d = Read::dim(lane, e, PER_LANE);
                if (HEAD_DIM || d < D) warp_acc[warp][(u - u0) * D + d] = __fmul_rn(acc[u][e], mine);
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = u0; u < u0 + MERGED; ++u) {
            if (threadIdx.x == 32 * (u - u0)) {
                float block_sum = 0.0f;
                for (int w = 0; w < ATTN_WARPS; ++w) {
                    if (warp_max[u][w] != -INFINITY) {
                        block_sum = __fmaf_rn(warp_sum_exp[u][w], expf(warp_max[u][w] - block_max[u]), block_sum);
                    }
                }
                float* out = partial + ((query + u * Tq) * splits + split) * (D + 2);
                out[0] = block_max[u];
                out[1] = block_sum;
            }
        }
        for (int x = threadIdx.x; x < MERGED * D; x += ATTN_WARPS * 32) {
            int u = 0, d = x;
            if constexpr (MERGED > 1) {
                u = x / HEAD_DIM;
                d = x % HEAD_DIM;
            }
            float sum = 0.0f;
            for (int w = 0; w < ATTN_WARPS; ++w) sum = __fadd_rn(sum, warp_acc[w][x]);
            partial[((query + (u0 + u) * Tq) * splits + split) * (D + 2) + 2 + d] = sum;
        }
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

// The NeoX half-split rotary embedding in f32, rounded to T once (as transformers rotates a
// vision tower's queries and keys: in f32, then cast back): x [B, T, H, D] with strides sb, st,
// sh (d contiguous), cos / sin f32 [B·T, half]; each product and the sum or difference rounded
// to f32 (no fused multiply-add), dims past 2·half unrotated. out [B, H, T, D] contiguous. One
// thread per rotated pair (d, d + half) or unrotated dim, so each input is read once.
template <typename T>
__device__ void rope_f32(const T* x, const float* cos, const float* sin, T* out, int B, int Tn, int H, int D, int half,
                         long long sb, long long st, long long sh) {
    const int per_row = D - half;  // half pairs, then D - 2·half unrotated dims
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * H * Tn * per_row) return;
    const int p = idx % per_row, t = (idx / per_row) % Tn, h = (idx / ((long long)per_row * Tn)) % H;
    const int b = idx / ((long long)per_row * Tn * H);
    const T* xr = x + b * sb + t * st + h * sh;
    T* o = out + (((long long)b * H + h) * Tn + t) * D;
    if (p >= half) {
        o[p + half] = xr[p + half];
        return;
    }
    const long long at = ((long long)b * Tn + t) * half + p;
    const float x1 = to_f32(xr[p]), x2 = to_f32(xr[p + half]), c = cos[at], s = sin[at];
    o[p] = from_f32<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    o[p + half] = from_f32<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
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

// The split kernels over rows in their own buffers and over a paged pool, for QG query heads of
// HEAD_DIM per block, named attention_split<SUFFIX>_NAME and attention_split_paged<SUFFIX>_NAME.
#define SPLIT_KERNELS(T, NAME, QG, HEAD_DIM, SUFFIX)                                                              \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                                                \
        attention_split##SUFFIX##_##NAME(const T* q, const KvRow* rows, const int* lens, float* partial, int Hq,  \
                                         int Hkv, int Tq, int D, int splits, float scale, int window) {           \
        await_previous_kernel();                                                                                  \
        attention_split<QG, HEAD_DIM, T>(q, ContiguousKv<T>{rows, lens}, PlainRead<T>{}, partial, Hq, Hkv, Tq, D, \
                                         splits, scale, window);                                                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) attention_split_paged##SUFFIX##_##NAME(          \
        const T* q, const T* k, const T* v, const int* tables, const int* lens, int max_blocks, int shift,        \
        float* partial, int Hq, int Hkv, int Tq, int D, int splits, float scale, int window) {                    \
        await_previous_kernel();                                                                                  \
        attention_split<QG, HEAD_DIM, T>(q, PagedKv<T>{k, v, tables, lens, max_blocks, shift, Hkv, D, D},         \
                                         PlainRead<T>{}, partial, Hq, Hkv, Tq, D, splits, scale, window);         \
    }

// TurboQuant's 2^bits centroids (none for affine codes) copied by the block's threads into
// `staged`, where every coordinate's lookup finds them.
__device__ __forceinline__ void stage_centroids(const float* centroids, int bits, float* staged) {
    if (!centroids) return;
    for (int i = threadIdx.x; i < (1 << bits); i += blockDim.x) staged[i] = centroids[i];
}

// The split kernel over a paged pool of codes (kv_codes.cuh), keys and values each described by
// bits, group (0: TurboQuant), bytes per vector and centroids: attention_split_codes<SUFFIX>_NAME.
#define CODED_SPLIT_KERNEL(T, NAME, QG, HEAD_DIM, SUFFIX)                                                         \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) attention_split_codes##SUFFIX##_##NAME(          \
        const T* q, const uint8_t* k, const uint8_t* v, const int* tables, const int* lens, int max_blocks,       \
        int shift, float* partial, int Hq, int Hkv, int Tq, int D, int splits, float scale, int window,           \
        int key_bits, int key_group, int key_width, const float* key_centroids, int value_bits, int value_group,  \
        int value_width, const float* value_centroids) {                                                          \
        await_previous_kernel();                                                                                  \
        __shared__ float centroids[2][256];                                                                       \
        stage_centroids(key_centroids, key_bits, centroids[0]);                                                   \
        stage_centroids(value_centroids, value_bits, centroids[1]);                                               \
        __syncthreads();                                                                                          \
        const CodedRead read{{key_bits, key_group, key_width, key_centroids ? centroids[0] : nullptr, nullptr},   \
                             {value_bits, value_group, value_width, value_centroids ? centroids[1] : nullptr,     \
                              nullptr}};                                                                          \
        attention_split<QG, HEAD_DIM, T>(                                                                         \
            q, PagedKv<uint8_t>{k, v, tables, lens, max_blocks, shift, Hkv, key_width, value_width}, read, partial, \
            Hq, Hkv, Tq, D, splits, scale, window);                                                               \
    }

// Encodes vectors x [B, H, T, D] (strides sb, sh, st; TurboQuant's rotated copy `rotated`
// contiguous f32) into codes, one warp per vector: into a paged pool [rows, H, width] at each
// row's positions lens[b] - T .. through its block table (write_paged's addressing), or, without
// tables, into out [B, H, T, width].
constexpr int CODE_WARPS = 8;

template <typename T>
__device__ void encode_codes(const T* x, const float* rotated, uint8_t* out, const int* tables, const int* lens,
                             int max_blocks, int shift, int B, int H, int Tn, int D, long long sb, long long sh,
                             long long st, PartCodes codes) {
    __shared__ uint8_t scratch[CODE_WARPS][MAX_HEAD_DIM];
    const long long n = (long long)blockIdx.x * CODE_WARPS + threadIdx.x / 32;
    if (n >= (long long)B * H * Tn) return;
    const int t = n % Tn, h = (n / Tn) % H, b = n / ((long long)Tn * H);
    long long at = n;
    if (tables) {
        const int p = lens[b] - Tn + t;
        const long long block = tables[(long long)b * max_blocks + (p >> shift)];
        at = ((block << shift) | (p & ((1 << shift) - 1))) * H + h;
    }
    encode_vector<T>(x + b * sb + h * sh + t * st, rotated ? rotated + n * D : nullptr, out + at * codes.width, D,
                     codes, scratch[threadIdx.x / 32]);
}

// Each vector of x [B, H, T, D] (contiguous) times its head's matrix of m [Hm, D, D] (f32, heads
// G·k .. G·k + G on matrix k, G = H / Hm) as a row vector, into out [B, H, T, D] f32: TurboQuant's
// rotations. Block (k, i) takes TURN_VECTORS of matrix k's vectors and a thread per output
// coordinate, which sums over the input coordinates in order: a vector's bits do not depend on
// which or how many vectors share its block (a batched matmul's would), so a rotated key, query
// or output is the same alone or batched, decoded or verified.
constexpr int TURN_VECTORS = 8;

template <typename T>
__device__ void turn_rows(const T* x, const float* m, float* out, int B, int H, int Tn, int D, int Hm) {
    __shared__ float xs[TURN_VECTORS][MAX_HEAD_DIM];
    const int k = blockIdx.x, G = H / Hm, per_matrix = B * G * Tn;
    const int first = blockIdx.y * TURN_VECTORS, count = min(TURN_VECTORS, per_matrix - first);
    long long rows[TURN_VECTORS];
    for (int v = 0; v < count; ++v) {
        const int i = first + v, b = i / (G * Tn), rest = i % (G * Tn);
        rows[v] = ((long long)b * H + k * G + rest / Tn) * Tn + rest % Tn;
        for (int d = threadIdx.x; d < D; d += blockDim.x) xs[v][d] = to_f32(x[rows[v] * D + d]);
    }
    __syncthreads();
    const float* mk = m + (long long)k * D * D;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        float acc[TURN_VECTORS];
#pragma unroll
        for (int v = 0; v < TURN_VECTORS; ++v) acc[v] = 0.0f;
        for (int c = 0; c < D; ++c) {
            const float w = mk[(long long)c * D + j];
#pragma unroll
            for (int v = 0; v < TURN_VECTORS; ++v) acc[v] = __fmaf_rn(xs[v][c], w, acc[v]);
        }
        for (int v = 0; v < count; ++v) out[rows[v] * D + j] = acc[v];
    }
}

// Codes [vectors, width] as attention reads them, into out [vectors, D]: one warp per vector.
template <typename T>
__device__ void decode_codes(const uint8_t* codes, T* out, long long vectors, int D, PartCodes p) {
    const long long n = (long long)blockIdx.x * CODE_WARPS + threadIdx.x / 32;
    if (n >= vectors) return;
    decode_vector<T>(codes + n * p.width, out + n * D, D, p);
}

// The plain split kernels, and grouped ones for 2 and 4 query heads of 64, 128 or 256 per block
// (attention.rs picks them).
#define INSTANTIATE(T, NAME)                                                                                   \
    SPLIT_KERNELS(T, NAME, 1, 0, )                                                                             \
    SPLIT_KERNELS(T, NAME, 2, 64, _g2_d64)                                                                     \
    SPLIT_KERNELS(T, NAME, 2, 128, _g2_d128)                                                                   \
    SPLIT_KERNELS(T, NAME, 2, 256, _g2_d256)                                                                   \
    SPLIT_KERNELS(T, NAME, 4, 64, _g4_d64)                                                                     \
    SPLIT_KERNELS(T, NAME, 4, 128, _g4_d128)                                                                   \
    SPLIT_KERNELS(T, NAME, 4, 256, _g4_d256)                                                                   \
    CODED_SPLIT_KERNEL(T, NAME, 1, 64, _g1_d64)                                                                \
    CODED_SPLIT_KERNEL(T, NAME, 1, 128, _g1_d128)                                                              \
    CODED_SPLIT_KERNEL(T, NAME, 1, 256, _g1_d256)                                                              \
    CODED_SPLIT_KERNEL(T, NAME, 2, 64, _g2_d64)                                                                \
    CODED_SPLIT_KERNEL(T, NAME, 2, 128, _g2_d128)                                                              \
    CODED_SPLIT_KERNEL(T, NAME, 2, 256, _g2_d256)                                                              \
    CODED_SPLIT_KERNEL(T, NAME, 4, 64, _g4_d64)                                                                \
    CODED_SPLIT_KERNEL(T, NAME, 4, 128, _g4_d128)                                                              \
    CODED_SPLIT_KERNEL(T, NAME, 4, 256, _g4_d256)                                                              \
    extern "C" __global__ void __launch_bounds__(CODE_WARPS * 32) encode_codes_##NAME(                         \
        const T* x, const float* rotated, uint8_t* out, const int* tables, const int* lens, int max_blocks,    \
        int shift, int B, int H, int Tn, int D, long long sb, long long sh, long long st, int bits, int group,  \
        int width, const float* centroids, const float* boundaries) {                                          \
        await_previous_kernel();                                                                               \
        encode_codes<T>(x, rotated, out, tables, lens, max_blocks, shift, B, H, Tn, D, sb, sh, st,             \
                        PartCodes{bits, group, width, centroids, boundaries});                                 \
    }                                                                                                          \
    extern "C" __global__ void turn_rows_##NAME(const T* x, const float* m, float* out, int B, int H, int Tn,  \
                                                int D, int Hm) {                                               \
        await_previous_kernel();                                                                               \
        turn_rows<T>(x, m, out, B, H, Tn, D, Hm);                                                              \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(CODE_WARPS * 32) decode_codes_##NAME(                         \
        const uint8_t* codes, T* out, long long vectors, int D, int bits, int group, int width,                \
        const float* centroids) {                                                                              \
        await_previous_kernel();                                                                               \
        decode_codes<T>(codes, out, vectors, D, PartCodes{bits, group, width, centroids, nullptr});            \
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
    }                                                                                                          \
    extern "C" __global__ void rope_f32_##NAME(const T* x, const float* cos, const float* sin, T* out, int B,  \
                                               int Tn, int H, int D, int half, long long sb, long long st,     \
                                               long long sh) {                                                 \
        await_previous_kernel();                                                                               \
        rope_f32<T>(x, cos, sin, out, B, Tn, H, D, half, sb, st, sh);                                          \
    }
STRATA_FOR_DTYPES(INSTANTIATE)

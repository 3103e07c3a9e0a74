// Attention over a whole prompt block without writing scores out (flash attention): each block
// of FLASH_WARPS warps takes 16 queries a warp of one (row, query head), walks the keys it sees in
// tiles, computes scores and weighted values on the tensor cores (mma.sync m16n8k16, f32
// accumulators) and keeps a running softmax per query in registers. Memory traffic is the
// queries, keys and values once per block: linear in the prompt, where scores would be
// quadratic. Keys and values stream through shared memory two tiles deep (cp.async).
//
// q [B, Hq, T, D], k and v [B, Hkv, L, D] (strides in elements for b, h and position; d
// contiguous, rows 16-byte aligned), out [B, Hq, T, D] with strides ob, oh, ot (d contiguous). Query head h reads KV head
// h / (Hq / Hkv). With `causal`, query i sits at position L - T + i and sees keys up to it (the
// last `window` of them when window > 0); otherwise every query sees all L keys. Only 16-bit
// dtypes: the tensor cores multiply them.
#include <type_traits>

#include "common.cuh"

constexpr int FLASH_WARPS = 4;
constexpr int FLASH_QUERIES = 16 * FLASH_WARPS;

// Keys per tile: fewer at D = 256, whose output accumulators take half a thread's registers.
template <int D> __host__ __device__ constexpr int flash_keys() { return D <= 128 ? 64 : 32; }
// Shared-memory row of D elements, padded by 16 bytes so that ldmatrix's 8 rows fall on
// distinct banks.
template <int D> __host__ __device__ constexpr int flash_stride() { return D + 8; }

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global → shared, zeros where !valid (the source is then not read).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}

// c += a b for a 16×16 A (row-major fragments) and a 16×8 B (column fragments b0, b1).
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two floats rounded to T, the first in the low half (the lower column of a fragment).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        __nv_bfloat162 x = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned*>(&x);
    } else {
        __half2 x = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<unsigned*>(&x);
    }
}

template <typename T, int D>
__device__ void flash_attention(const T* q, const T* k, const T* v, T* out, long long qb, long long qh, long long qt,
                                long long kb, long long kh, long long kt, long long vb, long long vh, long long vt,
                                long long ob, long long oh, long long ot, int Hq, int Hkv, int Tq, int L, int causal,
                                float scale, int window) {
    constexpr int KEYS = flash_keys<D>(), S = flash_stride<D>(), CHUNKS = D / 8;
    extern __shared__ __align__(16) unsigned char shared[];
    T* sq = reinterpret_cast<T*>(shared);  // [FLASH_QUERIES][S]
    T* sk = sq + FLASH_QUERIES * S;        // [2][KEYS][S]
    T* sv = sk + 2 * KEYS * S;             // [2][KEYS][S]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int i0 = blockIdx.x * FLASH_QUERIES, h = blockIdx.y, b = blockIdx.z;
    const T* qs = q + b * qb + h * qh;
    const T* ks = k + b * kb + (h / (Hq / Hkv)) * kh;
    const T* vs = v + b * vb + (h / (Hq / Hkv)) * vh;
    await_previous_kernel();

    // The keys some query of the block sees, [lo, hi), and those every one sees, [all_lo, all_hi).
    const int shift = L - Tq, last = min(i0 + FLASH_QUERIES, Tq) - 1;
    const bool windowed = causal && window > 0;
    const int hi = causal ? min(L, shift + last + 1) : L;
    const int lo = windowed ? max(0, shift + i0 + 1 - window) : 0;
    const int all_hi = causal ? min(L, shift + i0 + 1) : L;
    const int all_lo = windowed ? max(0, shift + last + 1 - window) : 0;

    for (int c = threadIdx.x; c < FLASH_QUERIES * CHUNKS; c += blockDim.x) {
        const int r = c / CHUNKS, col = c % CHUNKS * 8;
        const bool valid = i0 + r < Tq;
        copy16(sq + r * S + col, valid ? qs + (i0 + r) * qt + col : qs, valid);
    }
    auto load_tile = [&](int tile, int buffer) {
        const int j0 = tile * KEYS;
        for (int c = threadIdx.x; c < KEYS * CHUNKS; c += blockDim.x) {
            const int r = c / CHUNKS, col = c % CHUNKS * 8;
            const bool valid = j0 + r < L;
            copy16(sk + (buffer * KEYS + r) * S + col, valid ? ks + (j0 + r) * kt + col : ks, valid);
            copy16(sv + (buffer * KEYS + r) * S + col, valid ? vs + (j0 + r) * vt + col : vs, valid);
        }
    };
    const int first_tile = lo / KEYS, end_tile = (hi + KEYS - 1) / KEYS;
    if (first_tile < end_tile) load_tile(first_tile, 0);
    copies_commit();

    // This thread's accumulators: rows g = lane / 4 and g + 8 of the warp's 16 queries, columns
    // 2 (lane % 4) and one more of each 8-wide tile.
    float o[D / 8][4] = {};
    float running_max[2] = {-INFINITY, -INFINITY}, running_sum[2] = {0.0f, 0.0f};
    const float scale_log2 = scale * 1.4426950408889634f;
    const int row0 = i0 + warp * 16 + lane / 4;
    for (int tile = first_tile; tile < end_tile; ++tile) {
        const int buffer = (tile - first_tile) & 1;
        if (tile + 1 < end_tile) load_tile(tile + 1, buffer ^ 1);
        copies_commit();
        copies_wait<1>();
        __syncthreads();
        const T* tk = sk + buffer * KEYS * S;
        const T* tv = sv + buffer * KEYS * S;

        float s[KEYS / 8][4] = {};
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            unsigned a[4];
            ldmatrix_x4(a, sq + (warp * 16 + (lane & 15)) * S + kc * 16 + (lane / 16) * 8);
#pragma unroll
            for (int n = 0; n < KEYS / 8; n += 2) {
                unsigned bk[4];
                ldmatrix_x4(bk, tk + (n * 8 + (lane & 7) + (lane / 16) * 8) * S + kc * 16 + ((lane / 8) & 1) * 8);
                mma16816<T>(s[n], a, bk[0], bk[1]);
                mma16816<T>(s[n + 1], a, bk[2], bk[3]);
            }
        }

        // Scores in log2 units, masked where some query of the block does not see the tile.
        const int j0 = tile * KEYS;
        const bool masked = j0 < all_lo || j0 + KEYS > all_hi;
#pragma unroll
        for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[n][e] * scale_log2;
                if (masked) {
                    const int j = j0 + n * 8 + 2 * (lane % 4) + (e & 1), pos = shift + row0 + (e / 2) * 8;
                    const bool seen = j < L && (!causal || j <= pos) && (!windowed || j > pos - window);
                    x = seen ? x : -INFINITY;
                }
                s[n][e] = x;
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float m = running_max[r];
#pragma unroll
            for (int n = 0; n < KEYS / 8; ++n) m = fmaxf(m, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            // A query that has seen no key yet keeps a zero sum (its scores are all -inf).
            const float base = m == -INFINITY ? 0.0f : m;
            const float rescale = exp2f(running_max[r] - base);
            running_max[r] = m;
            running_sum[r] *= rescale;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[n][2 * r] *= rescale;
                o[n][2 * r + 1] *= rescale;
            }
#pragma unroll
            for (int n = 0; n < KEYS / 8; ++n) {
                s[n][2 * r] = exp2f(s[n][2 * r] - base);
                s[n][2 * r + 1] = exp2f(s[n][2 * r + 1] - base);
                running_sum[r] += s[n][2 * r] + s[n][2 * r + 1];
            }
        }

        // o += p v: the scores' accumulators are the A fragments of p, two 8-key tiles a chunk.
#pragma unroll
        for (int kc = 0; kc < KEYS / 16; ++kc) {
            const unsigned a[4] = {pack2<T>(s[2 * kc][0], s[2 * kc][1]), pack2<T>(s[2 * kc][2], s[2 * kc][3]),
                                   pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                                   pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                unsigned bv[4];
                ldmatrix_x4_trans(bv, tv + (kc * 16 + (lane & 7) + ((lane / 8) & 1) * 8) * S + n * 8 + (lane / 16) * 8);
                mma16816<T>(o[n], a, bv[0], bv[1]);
                mma16816<T>(o[n + 1], a, bv[2], bv[3]);
            }
        }
        __syncthreads();  // everyone is done with this buffer before the next tile's loads refill it
    }
    copies_wait<0>();

    T* os = out + b * ob + h * oh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = running_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        const int row = row0 + r * 8;
        if (row >= Tq) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            *reinterpret_cast<unsigned*>(os + row * ot + n * 8 + 2 * (lane % 4)) =
                pack2<T>(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        }
    }
}

#define INSTANTIATE(T, NAME, D)                                                                                     \
    extern "C" __global__ void __launch_bounds__(FLASH_WARPS * 32)                                                 \
        flash_attention_d##D##_##NAME(const T* q, const T* k, const T* v, T* out, long long qb, long long qh,      \
                                      long long qt, long long kb, long long kh, long long kt, long long vb,        \
                                      long long vh, long long vt, long long ob, long long oh, long long ot,        \
                                      int Hq, int Hkv, int Tq, int L, int causal, float scale, int window) {       \
        flash_attention<T, D>(q, k, v, out, qb, qh, qt, kb, kh, kt, vb, vh, vt, ob, oh, ot, Hq, Hkv, Tq, L,        \
                              causal, scale, window);                                                              \
    }
#define INSTANTIATE_DIMS(T, NAME) INSTANTIATE(T, NAME, 64) INSTANTIATE(T, NAME, 128) INSTANTIATE(T, NAME, 256)
INSTANTIATE_DIMS(__nv_bfloat16, bf16)
INSTANTIATE_DIMS(__half, f16)

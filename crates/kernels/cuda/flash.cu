// Attention over a whole prompt block without writing scores out (flash attention): each block
// of FLASH_WARPS warps takes 16 or 32 queries a warp of one (row, query head), walks the keys
// it sees in tiles, computes scores and weighted values on the tensor cores (mma.sync m16n8k16,
// f32 accumulators) and keeps a running softmax per query in registers. Memory traffic is the
// queries, keys and values once per block: linear in the prompt, where scores would be
// quadratic. Keys and values stream through shared memory two tiles deep (cp.async).
//
// q [B, Hq, T, D], k and v [B, Hkv, L, D] (strides in elements for b, h and position; d
// contiguous, rows 16-byte aligned), out [B, Hq, T, D] with strides ob, oh, ot (d contiguous).
// Query head h reads KV head h / (Hq / Hkv). With `causal`, query i sits at position L - T + i
// and sees keys up to it (the last `window` of them when window > 0); otherwise every query
// sees all L keys. Only 16-bit dtypes: the tensor cores multiply them.
#include <type_traits>

#include "common.cuh"

constexpr int FLASH_WARPS = 4;

// Query tiles of 16 a warp: two at D = 64, so each key and value fragment read from shared
// memory feeds two products; one at the wider heads, whose accumulators fill the registers.
template <int D> __host__ __device__ constexpr int flash_tiles() { return D <= 64 ? 2 : 1; }
template <int D> __host__ __device__ constexpr int flash_queries() { return 16 * flash_tiles<D>() * FLASH_WARPS; }
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

// 2^x by the special-function unit (0 for -inf).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <typename T, int D>
__device__ void flash_attention(const T* q, const T* k, const T* v, T* out, long long qb, long long qh, long long qt,
                                long long kb, long long kh, long long kt, long long vb, long long vh, long long vt,
                                long long ob, long long oh, long long ot, int Hq, int Hkv, int Tq, int L, int causal,
                                float scale, int window) {
    constexpr int KEYS = flash_keys<D>(), S = flash_stride<D>(), CHUNKS = D / 8;
    constexpr int MT = flash_tiles<D>(), QUERIES = flash_queries<D>();
    extern __shared__ __align__(16) unsigned char shared[];
    T* sq = reinterpret_cast<T*>(shared);  // [QUERIES][S]
    T* sk = sq + QUERIES * S;              // [2][KEYS][S]
    T* sv = sk + 2 * KEYS * S;             // [2][KEYS][S]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int i0 = blockIdx.x * QUERIES, h = blockIdx.y, b = blockIdx.z;
    const T* qs = q + b * qb + h * qh;
    const T* ks = k + b * kb + (h / (Hq / Hkv)) * kh;
    const T* vs = v + b * vb + (h / (Hq / Hkv)) * vh;
    await_previous_kernel();

    // The keys some query of the block sees, [lo, hi), and those every one sees, [all_lo, all_hi).
    const int shift = L - Tq, last = min(i0 + QUERIES, Tq) - 1;
    const bool windowed = causal && window > 0;
    const int hi = causal ? min(L, shift + last + 1) : L;
    const int lo = windowed ? max(0, shift + i0 + 1 - window) : 0;
    const int all_hi = causal ? min(L, shift + i0 + 1) : L;
    const int all_lo = windowed ? max(0, shift + last + 1 - window) : 0;

    for (int c = threadIdx.x; c < QUERIES * CHUNKS; c += blockDim.x) {
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

    // This thread's accumulators, per query tile m: rows g = lane / 4 and g + 8 of the tile's
    // 16 queries, columns 2 (lane % 4) and one more of each 8-wide tile.
    float o[MT][D / 8][4] = {};
    float running_max[MT][2], running_sum[MT][2] = {};
#pragma unroll
    for (int m = 0; m < MT; ++m) running_max[m][0] = running_max[m][1] = -INFINITY;
    const float scale_log2 = scale * 1.4426950408889634f;
    const int row0 = i0 + warp * 16 * MT + lane / 4;
    for (int tile = first_tile; tile < end_tile; ++tile) {
        const int buffer = (tile - first_tile) & 1;
        if (tile + 1 < end_tile) load_tile(tile + 1, buffer ^ 1);
        copies_commit();
        copies_wait<1>();
        __syncthreads();
        const T* tk = sk + buffer * KEYS * S;
        const T* tv = sv + buffer * KEYS * S;

        float s[MT][KEYS / 8][4] = {};
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            unsigned a[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                ldmatrix_x4(a[m], sq + (warp * 16 * MT + m * 16 + (lane & 15)) * S + kc * 16 + (lane / 16) * 8);
            }
#pragma unroll
            for (int n = 0; n < KEYS / 8; n += 2) {
                unsigned bk[4];
                ldmatrix_x4(bk, tk + (n * 8 + (lane & 7) + (lane / 16) * 8) * S + kc * 16 + ((lane / 8) & 1) * 8);
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    mma16816<T>(s[m][n], a[m], bk[0], bk[1]);
                    mma16816<T>(s[m][n + 1], a[m], bk[2], bk[3]);
                }
            }
        }

        // Scores in log2 units, masked where some query of the block does not see the tile.
        const int j0 = tile * KEYS;
        const bool masked = j0 < all_lo || j0 + KEYS > all_hi;
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
            for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = s[m][n][e] * scale_log2;
                    if (masked) {
                        const int j = j0 + n * 8 + 2 * (lane % 4) + (e & 1), pos = shift + row0 + m * 16 + (e / 2) * 8;
                        const bool seen = j < L && (!causal || j <= pos) && (!windowed || j > pos - window);
                        x = seen ? x : -INFINITY;
                    }
                    s[m][n][e] = x;
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = running_max[m][r];
#pragma unroll
                for (int n = 0; n < KEYS / 8; ++n) mx = fmaxf(mx, fmaxf(s[m][n][2 * r], s[m][n][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                // A query that has seen no key yet keeps a zero sum (its scores are all -inf).
                const float base = mx == -INFINITY ? 0.0f : mx;
                const float rescale = exp2_approx(running_max[m][r] - base);
                running_max[m][r] = mx;
                running_sum[m][r] *= rescale;
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    o[m][n][2 * r] *= rescale;
                    o[m][n][2 * r + 1] *= rescale;
                }
#pragma unroll
                for (int n = 0; n < KEYS / 8; ++n) {
                    s[m][n][2 * r] = exp2_approx(s[m][n][2 * r] - base);
                    s[m][n][2 * r + 1] = exp2_approx(s[m][n][2 * r + 1] - base);
                    running_sum[m][r] += s[m][n][2 * r] + s[m][n][2 * r + 1];
                }
            }
        }

        // o += p v: the scores' accumulators are the A fragments of p, two 8-key tiles a chunk.
#pragma unroll
        for (int kc = 0; kc < KEYS / 16; ++kc) {
            unsigned a[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                a[m][0] = pack2<T>(s[m][2 * kc][0], s[m][2 * kc][1]);
                a[m][1] = pack2<T>(s[m][2 * kc][2], s[m][2 * kc][3]);
                a[m][2] = pack2<T>(s[m][2 * kc + 1][0], s[m][2 * kc + 1][1]);
                a[m][3] = pack2<T>(s[m][2 * kc + 1][2], s[m][2 * kc + 1][3]);
            }
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                unsigned bv[4];
                ldmatrix_x4_trans(bv, tv + (kc * 16 + (lane & 7) + ((lane / 8) & 1) * 8) * S + n * 8 + (lane / 16) * 8);
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    mma16816<T>(o[m][n], a[m], bv[0], bv[1]);
                    mma16816<T>(o[m][n + 1], a[m], bv[2], bv[3]);
                }
            }
        }
        __syncthreads();  // everyone is done with this buffer before the next tile's loads refill it
    }
    copies_wait<0>();

    T* os = out + b * ob + h * oh;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = running_sum[m][r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            const int row = row0 + m * 16 + r * 8;
            if (row >= Tq) continue;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                *reinterpret_cast<unsigned*>(os + row * ot + n * 8 + 2 * (lane % 4)) =
                    pack2<T>(o[m][n][2 * r] * inv, o[m][n][2 * r + 1] * inv);
            }
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

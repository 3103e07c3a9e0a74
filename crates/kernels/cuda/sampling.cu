// The greedy sampling tail on the device: each row's argmax, so only token ids cross to the host.
#include "common.cuh"

constexpr int ARGMAX_THREADS = 256;
constexpr int ARGMAX_CHUNK = 8192;  // logits per block: a 248K vocabulary takes 31 blocks a row

// A candidate as one 64-bit key that orders as the first maximum does: the value's bits mapped
// to an unsigned order above, the index's complement below (ties go to the lower index). -0.0
// counts as +0.0; every real value's key is non-zero, so 0 means "none" and NaN never enters.
__device__ __forceinline__ unsigned long long argmax_key(float value, int index) {
    const unsigned int bits = __float_as_uint(value == 0.0f ? 0.0f : value);
    const unsigned int ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((unsigned long long)ordered << 32) | (0xFFFFFFFFu - (unsigned int)index);
}

// Grid (chunks of ARGMAX_CHUNK, rows) over logits [R, V] (f32); each block folds the best key of
// its chunk into keys[row] (zeroed before) with one atomic max per warp. The id is the key's
// low word complemented, 0 for a row of NaN or one whose mask allows nothing (key 0): the caller
// decodes it. Masks (structured output; null: none): `words` u32 a mask, bit i % 32 of word
// i / 32 allowing token i; row r reads mask mask_of[r], none where that is negative.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_keys_f32(const float* logits, unsigned long long* keys, int V, const unsigned int* masks,
                    const int* mask_of, int words) {
    await_previous_kernel();
    const float* row = logits + (long long)blockIdx.y * V;
    const int which = masks ? mask_of[blockIdx.y] : -1;
    const unsigned int* mask = which >= 0 ? masks + (long long)which * words : nullptr;
    const int end = min(V, (int)(blockIdx.x + 1) * ARGMAX_CHUNK);
    unsigned long long best = 0;
    for (int i = blockIdx.x * ARGMAX_CHUNK + threadIdx.x; i < end; i += ARGMAX_THREADS) {
        const float value = row[i];
        const bool allowed = !mask || (mask[i >> 5] >> (i & 31)) & 1u;
        if (!isnan(value) && allowed) best = max(best, argmax_key(value, i));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, offset));
    if (threadIdx.x % 32 == 0 && best != 0) atomicMax(keys + blockIdx.y, best);
}

// ---- Adjustments and draws: the arithmetic of src/sampling.rs, operation for operation (every
// rounding explicit, so nvcc fuses nothing the CPU path does not), so a row draws the same token
// on either.

// One thread an entry of `entries` (5 u32 words: row, token, bias, repetition, subtract bits):
// the logit bias, then the repetition penalty, then presence and frequency, in place.
extern "C" __global__ void adjust_f32(float* logits, int V, const unsigned int* entries, int n) {
    await_previous_kernel();
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const unsigned int* a = entries + 5 * e;
    float* logit = logits + (long long)a[0] * V + a[1];
    const float repetition = __uint_as_float(a[3]);
    float x = __fadd_rn(*logit, __uint_as_float(a[2]));
    if (repetition != 1.0f) x = x > 0.0f ? __fdiv_rn(x, repetition) : __fmul_rn(x, repetition);
    *logit = __fsub_rn(x, __uint_as_float(a[4]));
}

// A value's place in a descending-order key (order_key in sampling.rs).
__device__ __forceinline__ unsigned int order_key(float z) {
    const unsigned int bits = __float_as_uint(z == 0.0f ? 0.0f : z);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float from_order_key(unsigned int key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// exp(x) for x <= 0 (exp_le0 in sampling.rs).
__device__ __forceinline__ float exp_le0(float x) {
    if (x < -87.0f) return 0.0f;
    const float n = floorf(__fadd_rn(__fmul_rn(x, __uint_as_float(0x3fb8aa3bu)), 0.5f));
    float r = __fmaf_rn(-n, __uint_as_float(0x3f318000u), x);
    r = __fmaf_rn(-n, __uint_as_float(0xb95e8083u), r);
    const unsigned int taylor[8] = {0x39500d01u, 0x3ab60b61u, 0x3c088889u, 0x3d2aaaabu,
                                    0x3e2aaaabu, 0x3f000000u, 0x3f800000u, 0x3f800000u};
    float p = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) p = __fmaf_rn(r, p, __uint_as_float(taylor[k]));
    return __fmul_rn(p, __uint_as_float((unsigned int)((int)n + 127) << 23));
}

// ln(x) for a positive normal x (ln_pos in sampling.rs).
__device__ __forceinline__ float ln_pos(float x) {
    const unsigned int bits = __float_as_uint(x);
    int e = (int)((bits >> 23) & 0xffu) - 127;
    float f = __uint_as_float((bits & 0x007fffffu) | 0x3f800000u);
    if (f > __uint_as_float(0x3fb504f3u)) {
        f = __fmul_rn(f, 0.5f);
        e += 1;
    }
    const float s = __fdiv_rn(__fsub_rn(f, 1.0f), __fadd_rn(f, 1.0f));
    const float s2 = __fmul_rn(s, s);
    const unsigned int series[6] = {0x3dba2e8cu, 0x3de38e39u, 0x3e124925u, 0x3e4ccccdu, 0x3eaaaaabu, 0x3f800000u};
    float p = 0.0f;
#pragma unroll
    for (int k = 0; k < 6; ++k) p = __fmaf_rn(s2, p, __uint_as_float(series[k]));
    return __fmaf_rn((float)e, __uint_as_float(0x3f317218u), __fmul_rn(__fadd_rn(s, s), p));
}

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// The race's noise for `token` at (seed, position) (gumbel in sampling.rs).
__device__ __forceinline__ float gumbel(unsigned long long seed, unsigned long long position, unsigned int token) {
    const unsigned long long h =
        mix64(mix64(seed ^ (position * 0x9e3779b97f4a7c15ull)) ^ ((unsigned long long)token * 0xd1b54a32d192ed03ull));
    const float u = __fmul_rn(__fadd_rn((float)(unsigned int)(h >> 41), 0.5f), 1.0f / 8388608.0f);
    return -ln_pos(-ln_pos(u));
}

constexpr int DRAW_THREADS = 1024;
constexpr int DRAW_BUCKETS = 2048;  // the widest digit of a key: 11 bits
constexpr unsigned int DRAW_KEPT = 1024;  // the largest top-k gathered in shared memory

// Sums and maxima over a drawing block; every thread gets the result.
__device__ __forceinline__ unsigned long long draw_block_sum(unsigned long long x, unsigned long long* scratch) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
    __syncthreads();
    x = scratch[threadIdx.x % 32];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

__device__ __forceinline__ unsigned long long draw_block_max(unsigned long long x, unsigned long long* scratch) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, offset));
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
    __syncthreads();
    x = scratch[threadIdx.x % 32];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

// What a selection found: the key at which the running measure of the members, taken in
// descending key order, first reaches the target; the measure of the members above that key,
// and of those at it.
struct Selected {
    unsigned int key;
    unsigned long long above, at;
};

// Radix selection over 32-bit keys in three digits (11, 11, 10 bits), one histogram pass over
// the row each. `member(i, key, measure)` says whether element i takes part, with its key and
// measure. The target must not exceed the members' total measure.
template <typename Member>
__device__ Selected select_desc(int V, Member member, unsigned long long target, unsigned long long* hist,
                                Selected* found) {
    const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    unsigned int prefix = 0;
    unsigned long long above = 0, at = 0;
    for (int round = 0; round < 3; ++round) {
        const int shift = shifts[round], buckets = 1 << widths[round];
        for (int b = threadIdx.x; b < buckets; b += DRAW_THREADS) hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += DRAW_THREADS) {
            unsigned int key;
            unsigned long long measure;
            if (member(i, key, measure) && (round == 0 || (key >> (shift + widths[round])) == prefix) && measure)
                atomicAdd(hist + ((key >> shift) & (buckets - 1)), measure);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l sums buckets [buckets - (l+1)·per, buckets - l·per): lane 0 the highest keys.
            const int lane = threadIdx.x, per = buckets / 32, top = buckets - lane * per;
            unsigned long long mine = 0;
            for (int b = top - 1; b >= top - per; --b) mine += hist[b];
            unsigned long long before = mine;  // inclusive scan over lanes, lane 0 first
#pragma unroll
            for (int offset = 1; offset < 32; offset <<= 1) {
                const unsigned long long other = __shfl_up_sync(0xffffffffu, before, offset);
                if (lane >= offset) before += other;
            }
            const unsigned int reaching = __ballot_sync(0xffffffffu, above + before >= target);
            const int first = reaching ? __ffs(reaching) - 1 : 31;
            if (lane == first) {
                unsigned long long sum = above + before - mine;
                int b = top - 1;
                for (; b > top - per && sum + hist[b] < target; --b) sum += hist[b];
                found->key = (unsigned int)b;
                found->above = sum;
                found->at = hist[b];
            }
        }
        __syncthreads();
        prefix = (prefix << widths[round]) | found->key;
        above = found->above;
        at = found->at;
        __syncthreads();  // everyone has read `found` and `hist` before the next round
    }
    return Selected{prefix, above, at};
}

// One block a drawn row (draw_row in sampling.rs): `params` holds 10 u32 words a drawn row (row,
// top_k, temperature, top_p, min-p's least log-weight, seed low / high, position low / high,
// unused); masks as argmax_keys reads them. Overwrites keys[row], the row's argmax as
// argmax_keys left it, with the winner's key — or leaves it where the row has no candidate.
extern "C" __global__ void __launch_bounds__(DRAW_THREADS)
    draw_f32(const float* logits, int V, const unsigned int* params, const unsigned int* masks, const int* mask_of,
             int words, unsigned long long* keys) {
    await_previous_kernel();
    __shared__ unsigned long long hist[DRAW_BUCKETS];
    __shared__ unsigned long long scratch[32];
    __shared__ Selected found;
    const unsigned int* p = params + 10 * blockIdx.x;
    const unsigned int row = p[0], top_k = p[1];
    const float temperature = __uint_as_float(p[2]), top_p = __uint_as_float(p[3]), floor = __uint_as_float(p[4]);
    const unsigned long long seed = p[5] | ((unsigned long long)p[6] << 32);
    const unsigned long long position = p[7] | ((unsigned long long)p[8] << 32);
    const float* l = logits + (long long)row * V;
    const int which = masks ? mask_of[row] : -1;
    const unsigned int* mask = which >= 0 ? masks + (long long)which * words : nullptr;
    auto allowed = [&](int i) { return !mask || (mask[i >> 5] >> (i & 31)) & 1u; };
    // A candidate: allowed, with a finite scaled logit; its key.
    auto candidate = [&](int i, unsigned int& key) {
        if (!allowed(i)) return false;
        const float z = __fdiv_rn(l[i], temperature);
        key = order_key(z);
        return isfinite(z);
    };

    unsigned long long count = 0;
    unsigned int top = 0;
    for (int i = threadIdx.x; i < V; i += DRAW_THREADS) {
        unsigned int key;
        if (candidate(i, key)) {
            ++count;
            top = max(top, key);
        }
    }
    count = draw_block_sum(count, scratch);
    top = (unsigned int)draw_block_max(top, scratch);
    if (count == 0) return;  // no candidate: the argmax, as the CPU path takes it
    const float z_max = from_order_key(top);
    auto weight = [&](unsigned int key) {
        return (unsigned long long)__fmul_rn(exp_le0(__fsub_rn(from_order_key(key), z_max)), 4294967296.0f);
    };

    // Top-k: the k-th candidate's key, and of the candidates at it the last index kept.
    unsigned int k_key = 0, k_last = 0xffffffffu;
    if (top_k > 0 && top_k < count) {
        const Selected s = select_desc(
            V, [&](int i, unsigned int& key, unsigned long long& m) { m = 1; return candidate(i, key); }, top_k, hist,
            &found);
        k_key = s.key;
        const unsigned long long wanted = top_k - s.above;
        if (wanted < s.at) {
            const Selected last = select_desc(
                V,
                [&](int i, unsigned int& key, unsigned long long& m) {
                    unsigned int z;
                    m = 1;
                    key = ~(unsigned int)i;
                    return candidate(i, z) && z == k_key;
                },
                wanted, hist, &found);
            k_last = ~last.key;
        }
    }
    auto in_top_k = [&](int i, unsigned int key) { return key > k_key || (key == k_key && (unsigned int)i <= k_last); };

    // A top-k that fits shared memory is gathered there in one more walk of the row; top-p and
    // the race then walk those k entries instead of the vocabulary (in any order: every step
    // below orders by key and index, and sums integers).
    __shared__ unsigned int kept_key[DRAW_KEPT], kept_index[DRAW_KEPT];
    __shared__ unsigned int kept;
    const bool gathered = top_k > 0 && top_k < count && top_k <= DRAW_KEPT;
    if (gathered) {
        if (threadIdx.x == 0) kept = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += DRAW_THREADS) {
            unsigned int key;
            if (candidate(i, key) && in_top_k(i, key)) {
                const unsigned int slot = atomicAdd(&kept, 1u);
                kept_key[slot] = key;
                kept_index[slot] = (unsigned int)i;
            }
        }
        __syncthreads();
    }
    const int members = gathered ? (int)kept : V;
    // Member j of the top-k: its key and token index.
    auto member = [&](int j, unsigned int& key, unsigned int& index) {
        if (gathered) {
            key = kept_key[j];
            index = kept_index[j];
            return true;
        }
        index = (unsigned int)j;
        return candidate(j, key) && in_top_k(j, key);
    };

    // Top-p, over the top-k: where the running weight reaches top_p of theirs.
    unsigned int p_key = 0, p_last = 0xffffffffu;
    if (top_p < 1.0f) {
        unsigned long long total = 0;
        for (int j = threadIdx.x; j < members; j += DRAW_THREADS) {
            unsigned int key, index;
            if (member(j, key, index)) total += weight(key);
        }
        total = draw_block_sum(total, scratch);
        const unsigned long long target = max(1ull, (unsigned long long)ceil(__dmul_rn((double)top_p, (double)total)));
        const Selected s = select_desc(
            members,
            [&](int j, unsigned int& key, unsigned long long& m) {
                unsigned int index;
                if (!member(j, key, index)) return false;
                m = weight(key);
                return true;
            },
            target, hist, &found);
        p_key = s.key;
        const unsigned long long w = weight(p_key);
        const unsigned long long wanted = (target - s.above + w - 1) / w;
        if (wanted < s.at / w) {
            const Selected last = select_desc(
                members,
                [&](int j, unsigned int& key, unsigned long long& m) {
                    unsigned int z, index;
                    m = 1;
                    const bool at_cut = member(j, z, index) && z == p_key;
                    key = ~index;
                    return at_cut;
                },
                wanted, hist, &found);
            p_last = ~last.key;
        }
    }

    // The race among the candidates every filter keeps.
    unsigned long long best = 0;
    for (int j = threadIdx.x; j < members; j += DRAW_THREADS) {
        unsigned int key, index;
        if (!member(j, key, index)) continue;
        if (key < p_key || (key == p_key && index > p_last)) continue;
        const float d = __fsub_rn(from_order_key(key), z_max);
        if (!(d >= floor)) continue;
        best = max(best, argmax_key(__fadd_rn(d, gumbel(seed, position, index)), (int)index));
    }
    best = draw_block_max(best, scratch);
    if (threadIdx.x == 0) keys[row] = best;
}

// A mixture of experts' routing and its weighted sum, on the GPU, so that a decode step never
// reads its routes back to the host (and can be recorded as a CUDA graph). The experts' matmuls
// between them are matmul.cu's `matmul_gathered`.
#include "common.cuh"

// Experts a route kernel takes (each lane of a warp holds MAX_EXPERTS / 32 router logits); a
// token's k picks take a lane each, so k <= 32 (experts.rs checks both).
constexpr int MAX_EXPERTS = 1024;
constexpr int ROUTE_THREADS = 1024;

// Each token's route from its router logits `[n, E]`, in transformers' order of operations: the
// softmax in f32, the k experts of highest probability (the lower index first among equals),
// their probabilities over the sum of the k. Writes, for pair p = t·k + s (a token's experts in
// ascending order), `experts[p]` and `weights[p]`; then `order`, the n·k pairs grouped by expert,
// which the gathered matmul runs in so that the pairs of one expert follow each other and its
// weights are read from memory once and from the L2 cache after that. (Within an expert the
// pairs' order is that of atomics, which changes no result: each pair is computed alone.)
//
// One block: a warp per token, then the whole block for the grouping.
template <typename T>
__device__ void moe_route(const T* logits, int n, int E, int k, unsigned* experts, float* weights, unsigned* order) {
    __shared__ int count[MAX_EXPERTS];
    __shared__ int start[MAX_EXPERTS];
    await_previous_kernel();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int per_lane = (E + 31) / 32;
    for (int t = warp; t < n; t += warps) {
        float p[MAX_EXPERTS / 32];
        float top = -INFINITY;
        for (int j = 0; j < per_lane; ++j) {
            const int e = lane + 32 * j;
            p[j] = e < E ? to_f32(logits[(long long)t * E + e]) : -INFINITY;
            top = fmaxf(top, p[j]);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
        float total = 0.0f;
        for (int j = 0; j < per_lane; ++j) {
            p[j] = lane + 32 * j < E ? expf(p[j] - top) : 0.0f;
            total += p[j];
        }
        total = warp_sum(total);
        // k rounds of a warp argmax over the experts not taken yet; lane s keeps the s-th pick,
        // and the sum of the picks' probabilities runs in the order they are picked (highest
        // first), as transformers sums them.
        unsigned taken = 0;
        int mine = -1;
        float my_p = 0.0f, kept = 0.0f;
        for (int s = 0; s < k; ++s) {
            float best = -1.0f;
            int best_e = E;
            for (int j = 0; j < per_lane; ++j) {
                const int e = lane + 32 * j;
                if (e < E && !(taken >> j & 1u) && p[j] > best) best = p[j], best_e = e;
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) {
                const float other = __shfl_xor_sync(0xffffffffu, best, offset);
                const int other_e = __shfl_xor_sync(0xffffffffu, best_e, offset);
                if (other > best || (other == best && other_e < best_e)) best = other, best_e = other_e;
            }
            best_e = min(best_e, E - 1);  // NaN logits pick nothing: stay in bounds
            if (best_e % 32 == lane) taken |= 1u << (best_e / 32);
            const float prob = best / total;
            kept += prob;
            if (lane == s) mine = best_e, my_p = prob;
        }
        // Ascending by expert: a pick's place is the number of picks of lower index (or of the
        // same, picked earlier: only NaN logits repeat one), so every slot is written.
        int rank = 0;
        for (int s = 0; s < k; ++s) {
            const int other = __shfl_sync(0xffffffffu, mine, s);
            rank += other < mine || (other == mine && s < lane);
        }
        if (lane < k) {
            experts[(long long)t * k + rank] = mine;
            weights[(long long)t * k + rank] = my_p / kept;
        }
    }
    // The pairs grouped by expert: a count per expert, its exclusive prefix sum, then each pair
    // placed at its expert's next free slot.
    const int pairs = n * k;
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();  // also makes every warp's `experts` visible to the block
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&count[experts[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int sum = 0;
        for (int e = 0; e < E; ++e) start[e] = sum, sum += count[e];
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) order[atomicAdd(&start[experts[p]], 1)] = p;
}

// out [n, H] = Σ_s weight[t·k + s] · y[t·k + s] over a token's k pairs in ascending expert order,
// each weight rounded to T, each product and each partial sum stored in T: the bits of scaling
// each expert's output by its weight and adding them one by one in T. The multiply and the add
// are kept apart (__fmul_rn, __fadd_rn): in f32, where storing rounds nothing, the compiler
// would fuse them into one rounding. One thread per element.
template <typename T>
__device__ void moe_combine(const T* y, const float* weights, T* out, int n, int H, int k) {
    await_previous_kernel();
    const long long t = blockIdx.x;
    const int h = blockIdx.y * blockDim.x + threadIdx.x;
    if (t >= n || h >= H) return;
    const auto scaled = [&](int s) {
        const long long p = t * k + s;
        return round_to<T>(__fmul_rn(to_f32(y[p * H + h]), round_to<T>(weights[p])));
    };
    float sum = scaled(0);
    for (int s = 1; s < k; ++s) sum = round_to<T>(__fadd_rn(sum, scaled(s)));
    out[t * H + h] = from_f32<T>(sum);
}

#define INSTANTIATE(T, NAME)                                                                                     \
    extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)                                                  \
        moe_route_##NAME(const T* logits, int n, int E, int k, unsigned* experts, float* weights, unsigned* order) { \
        moe_route<T>(logits, n, E, k, experts, weights, order);                                                  \
    }                                                                                                            \
    extern "C" __global__ void moe_combine_##NAME(const T* y, const float* weights, T* out, int n, int H, int k) { \
        moe_combine<T>(y, weights, out, n, H, k);                                                                \
    }
STRATA_FOR_DTYPES(INSTANTIATE)

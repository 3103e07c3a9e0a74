// The greedy sampling tail on the device: each row's argmax, so only token ids cross to the host.
#include "common.cuh"

constexpr int ARGMAX_THREADS = 1024;

// Whether candidate (value, index) beats the best so far (best, at), `at == none` meaning no
// candidate yet: the larger value wins, ties go to the lower index, NaN never wins — the first
// maximum, as a left-to-right scan finds it.
__device__ __forceinline__ bool beats(float value, int index, float best, int at, int none) {
    if (index == none || isnan(value)) return false;
    return at == none || value > best || (value == best && index < at);
}

// One block per row of logits [R, V] (f32); ids [R] u32 (0 for a row of NaN).
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_rows_f32(const float* logits, unsigned int* ids, int V) {
    __shared__ float best_value[ARGMAX_THREADS / 32];
    __shared__ int best_index[ARGMAX_THREADS / 32];
    const float* row = logits + (long long)blockIdx.x * V;
    float best = 0.0f;
    int at = V;
    for (int i = threadIdx.x; i < V; i += ARGMAX_THREADS) {
        if (beats(row[i], i, best, at, V)) {
            best = row[i];
            at = i;
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_at = __shfl_xor_sync(0xffffffffu, at, offset);
        if (beats(other, other_at, best, at, V)) {
            best = other;
            at = other_at;
        }
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        best_value[warp] = best;
        best_index[warp] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ARGMAX_THREADS / 32; ++w) {
            if (beats(best_value[w], best_index[w], best, at, V)) {
                best = best_value[w];
                at = best_index[w];
            }
        }
        ids[blockIdx.x] = at == V ? 0 : at;
    }
}

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

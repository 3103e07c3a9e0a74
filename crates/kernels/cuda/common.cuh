// Shared by strata's CUDA kernels: dtype conversions and warp / block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half(x); }

// `x` rounded to T and back: what storing an intermediate in the model dtype does.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_f32(from_f32<T>(x)); }

// strata launches its kernels as programmatic dependents of the kernel before them (compute
// capability 9.0 and up): a kernel's blocks may start while that kernel still runs, and wait
// here until it has finished and its writes are visible. Every kernel calls this before it reads
// anything another kernel wrote or writes anything at all, in every thread (a kernel that ended
// without waiting could end before the kernel it follows, and the one after it would then not
// wait for that one); only what no kernel writes (weights) may be read before. Then the kernel
// after it may be launched, to wait in turn.
__device__ __forceinline__ void await_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Sum over a block of `blockDim.x` threads (a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float x) {
    __shared__ float partial[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    x = warp_sum(x);
    __syncthreads();  // a previous call's readers are done with `partial`
    if (lane == 0) partial[warp] = x;
    __syncthreads();
    return warp_sum(lane < warps ? partial[lane] : 0.0f);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// Instantiates `kernel<T>` as extern "C" `name_f32`, `name_bf16`, `name_f16`.
#define STRATA_FOR_DTYPES(INSTANTIATE) \
    INSTANTIATE(float, f32)            \
    INSTANTIATE(__nv_bfloat16, bf16)   \
    INSTANTIATE(__half, f16)

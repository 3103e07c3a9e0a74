// Quantized KV codes on the GPU, in the layout of crates/kernels/src/kv_quant.rs (which says what
// they mean): per head vector, `bits`-wide codes packed little-endian from bit 0 (code n at bits
// n·bits ..), then an affine format's bf16 (scale, bias) per group of `group` coordinates, or
// TurboQuant's bf16 norm. TurboQuant codes are read short of their rotation (centroid · norm):
// attention turns its queries and output instead (kv_quant.rs, `KvCoding::read`).
//
// Encoding follows the CPU codec's arithmetic step for step (the same roundings, the same bf16
// neighbours), so a vector encodes to the same bytes on either device where its inputs are the
// same; TurboQuant's rotation is a matmul whose sums may round differently from the CPU's.
#pragma once
#include <cstdint>

#include "common.cuh"

// Which family a part's codes are (`group` > 0 is affine).
struct PartCodes {
    int bits, group, width;
    // TurboQuant: 2^bits centroids and the 2^bits - 1 boundaries between them (f32, device).
    const float* centroids;
    const float* boundaries;

    __device__ __forceinline__ int code_bytes(int D) const { return D * bits / 8; }
};

__device__ __forceinline__ float bf16_bytes_to_f32(const uint8_t* p) {
    const unsigned short bits = (unsigned short)p[0] | ((unsigned short)p[1] << 8);
    return __uint_as_float((unsigned)bits << 16);
}

// x's bf16 bits, rounded to nearest even as __float2bfloat16_rn rounds (a NaN stays a quiet NaN),
// computed on 32-bit integers. Storing the intrinsic's 16-bit result byte by byte wrote a wrong
// low byte on an H100 (high byte right; seemingly the byte store read the other half of the
// 32-bit register holding it), so the codes' parameters never pass through a 16-bit register.
__device__ __forceinline__ unsigned bf16_bits_rn(float x) {
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ void f32_to_bf16_bytes(float x, uint8_t* p) {
    const unsigned bits = bf16_bits_rn(x);
    p[0] = (uint8_t)(bits & 0xffu);
    p[1] = (uint8_t)(bits >> 8);
}

// bf16 neighbours as kv_quant.rs's bf16_at_most / bf16_at_least pick them.
__device__ __forceinline__ float bf16_bits_value(unsigned short b) { return __uint_as_float((unsigned)b << 16); }

__device__ __forceinline__ float bf16_at_most(float x) {
    unsigned short b = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    const float v = bf16_bits_value(b);
    if (v <= x) return v;
    if (v > 0.0f) return bf16_bits_value(b - 1);
    if (v == 0.0f) return bf16_bits_value(0x8001);  // the least negative subnormal
    return bf16_bits_value(b + 1);
}

__device__ __forceinline__ float bf16_at_least(float x) {
    const unsigned short b = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    const float v = bf16_bits_value(b);
    return v >= x ? v : bf16_bits_value(b + 1);
}

// A code (below 2^23) as a float, exactly as (float)code: set as the low mantissa bits of 2^23
// and 2^23 taken away — a logic op and an add, which run at the full rate, where an
// integer-to-float conversion runs at a fraction of it.
__device__ __forceinline__ float code_to_f32(unsigned code) {
    return __fsub_rn(__uint_as_float(0x4B000000u | code), 8388608.0f);
}

// Code n of `bits` from packed bytes (any alignment).
__device__ __forceinline__ unsigned code_at(const uint8_t* codes, int n, int bits) {
    const int bit = n * bits, byte = bit >> 3, shift = bit & 7;
    unsigned w = codes[byte];
    if (shift + bits > 8) w |= (unsigned)codes[byte + 1] << 8;
    return (w >> shift) & ((1u << bits) - 1);
}

// Coordinate d of a vector's code as attention reads it (TurboQuant short of its rotation), in f32.
__device__ __forceinline__ float read_coordinate(const uint8_t* vec, int d, int D, const PartCodes& p) {
    const unsigned c = code_at(vec, d, p.bits);
    const uint8_t* tail = vec + p.code_bytes(D);
    if (p.group > 0) {
        const uint8_t* params = tail + 4 * (d / p.group);
        return __fadd_rn(bf16_bytes_to_f32(params + 2), __fmul_rn((float)c, bf16_bytes_to_f32(params)));
    }
    return __fmul_rn(__ldg(p.centroids + c), bf16_bytes_to_f32(tail));
}

// A lane's PER_LANE consecutive coordinates lane · PER_LANE .. of a vector's code, as
// read_coordinate reads each (TurboQuant's centroids from wherever p points: attention stages
// them in shared memory). The vector starts 2-byte aligned (widths are even for the head
// dims the kernels take) and the lane's codes span at most 64 bits from an even byte, so they
// come in at most four 2-byte loads instead of one load per coordinate.
template <int PER_LANE>
__device__ __forceinline__ void read_lane(const uint8_t* vec, int lane, int D, const PartCodes& p, float (&out)[PER_LANE]) {
    const int first = lane * PER_LANE * p.bits;
    const unsigned short* words = reinterpret_cast<const unsigned short*>(vec) + (first >> 4);
    const int shift = first & 15, span = shift + PER_LANE * p.bits;
    unsigned long long w = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (16 * i < span) w |= (unsigned long long)words[i] << (16 * i);
    }
    w >>= shift;
    const unsigned mask = (1u << p.bits) - 1;
    const uint8_t* tail = vec + p.code_bytes(D);
    if (p.group > 0) {
        // A lane's coordinates lie in one group (PER_LANE ≤ 16 < 32 ≤ group, both powers of two).
        const uint8_t* params = tail + 4 * (lane * PER_LANE / p.group);
        const float scale = bf16_bytes_to_f32(params), bias = bf16_bytes_to_f32(params + 2);
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            out[e] = __fadd_rn(bias, __fmul_rn(code_to_f32((unsigned)(w & mask)), scale));
            w >>= p.bits;
        }
    } else {
        const float norm = bf16_bytes_to_f32(tail);
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            out[e] = __fmul_rn(p.centroids[w & mask], norm);
            w >>= p.bits;
        }
    }
}

// Encodes one vector per warp: `x` (D values, any stride-1 layout) into `out` (p.width bytes);
// TurboQuant codes `rotated` (R·x, f32) and keeps x's norm. `scratch` holds D codes (the warp's
// shared memory). Every lane of the warp calls it.
template <typename T>
__device__ void encode_vector(const T* x, const float* rotated, uint8_t* out, int D, const PartCodes& p,
                              uint8_t* scratch) {
    const int lane = threadIdx.x % 32;
    const int code_bytes = p.code_bytes(D);
    if (p.group > 0) {
        const float levels = (float)((1 << p.bits) - 1);
        for (int g = 0; g < D / p.group; ++g) {
            float lo = INFINITY, hi = -INFINITY;
            for (int d = g * p.group + lane; d < (g + 1) * p.group; d += 32) {
                const float v = to_f32(x[d]);
                if (isfinite(v)) {
                    lo = fminf(lo, v);
                    hi = fmaxf(hi, v);
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
                hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
            }
            if (!(lo <= hi)) lo = hi = 0.0f;
            const float bias = bf16_at_most(lo);
            const float scale = bf16_at_least(__fdiv_rn(__fsub_rn(hi, bias), levels));
            for (int d = g * p.group + lane; d < (g + 1) * p.group; d += 32) {
                float q = 0.0f;
                if (scale > 0.0f) q = fminf(fmaxf(roundf(__fdiv_rn(__fsub_rn(to_f32(x[d]), bias), scale)), 0.0f), levels);
                scratch[d] = (uint8_t)q;  // NaN compares false both ways above: 0, as Rust's cast
            }
            if (lane == 0) {
                f32_to_bf16_bytes(scale, out + code_bytes + 4 * g);
                f32_to_bf16_bytes(bias, out + code_bytes + 4 * g + 2);
            }
        }
    } else {
        double ss = 0.0;
        for (int d = lane; d < D; d += 32) {
            const double v = (double)to_f32(x[d]);
            ss += v * v;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        float norm = (float)sqrt(ss);
        if (!isfinite(norm)) norm = 0.0f;
        const float inv = norm > 0.0f ? __fdiv_rn(1.0f, norm) : 0.0f;
        const int cells = 1 << p.bits;
        for (int d = lane; d < D; d += 32) {
            const float y = __fmul_rn(rotated[d], inv);
            // How many boundaries lie below y (Rust's partition_point(|b| b < y)).
            int lo = 0, hi = cells - 1;
            while (lo < hi) {
                const int mid = (lo + hi) / 2;
                if (p.boundaries[mid] < y) lo = mid + 1;
                else hi = mid;
            }
            scratch[d] = (uint8_t)lo;
        }
        if (lane == 0) f32_to_bf16_bytes(norm, out + code_bytes);
    }
    __syncwarp();
    // Byte b holds the bits 8b .. 8b + 7 of the packed codes.
    for (int b = lane; b < code_bytes; b += 32) {
        unsigned byte = 0;
        for (int n = 8 * b / p.bits; n * p.bits < 8 * b + 8; ++n) {
            const int at = n * p.bits - 8 * b;  // the code's first bit relative to the byte's
            const unsigned c = scratch[n];
            byte |= at >= 0 ? c << at : c >> -at;
        }
        out[b] = byte & 0xff;
    }
    __syncwarp();  // the scratch is the next vector's
}

// Decodes one vector per warp as attention reads it (TurboQuant short of its rotation) into `out`.
template <typename T>
__device__ void decode_vector(const uint8_t* vec, T* out, int D, const PartCodes& p) {
    for (int d = threadIdx.x % 32; d < D; d += 32) out[d] = from_f32<T>(read_coordinate(vec, d, D, p));
}

// The Gated DeltaNet layer's recurrent kernels: causal conv1d + SiLU, and the gated delta rule
// stepped token by token. Outputs go to fresh memory (state in, new state out), which is what
// lets a speculative round keep the state from before it by reference — except in a recorded
// CUDA-graph decode step, whose state buffers the graph holds alone and updates in place (the
// one-token conv step below, and the delta rule given the same buffer as input and output).
#include <mma.h>

#include "common.cuh"

constexpr int MAX_CONV_KERNEL = 8;
constexpr int CONV_TOKENS = 16;

// A conv output's sum, oldest input first as the reference sums, each tap one rounded
// multiply-add: the window kernel and the one-token step must give the same bits, and left to
// itself the compiler contracts `a * b + c * d` into either of two fused multiply-adds.
__device__ __forceinline__ float conv_first_tap(float input, float weight) { return __fmul_rn(input, weight); }
__device__ __forceinline__ float conv_next_tap(float acc, float input, float weight) { return __fmaf_rn(input, weight, acc); }

// Depthwise causal conv1d + SiLU over `T` tokens. One thread per (row, run of CONV_TOKENS indices,
// channel): output i < T is computed from the K inputs ending at token i (the first K - 1 - i of
// them from the state); index i < K - 1 also writes new_state[i], the input K - 1 positions before
// the window's end. A thread loads all the inputs its run reads before it sums any, with the run
// unrolled so they stay in registers. The kernel is a stream through memory whose instructions,
// not its bytes, set its pace: the taps are a template parameter (TAPS > 0: K == TAPS; 0: any K up
// to MAX_CONV_KERNEL, each tap and input predicated), and a run inside the window (past the state,
// short of the end) reads x without a test per input. x [B, T, C] with `x_stride` between tokens,
// state and new_state [B, K - 1, C] (token-major), w [C, K] f32, y [B, T, C], C > 0 (the launcher
// skips empty outputs). blockIdx.x counts (row, run, block of channels), the channels fastest,
// over B · runs of max(T, K - 1) indices: blocks running together read whole token rows rather
// than the same few channels of many tokens (no 64-bit division per thread: that cost more than
// the convolution).
template <typename T, int TAPS>
__device__ void causal_conv1d_silu(const T* __restrict__ x, long long x_stride, const T* __restrict__ state,
                                   const float* __restrict__ w, T* __restrict__ y, T* __restrict__ new_state, int B,
                                   int Tn, int C, int K) {
    constexpr int MAX_TAPS = TAPS ? TAPS : MAX_CONV_KERNEL, WINDOW = CONV_TOKENS + MAX_TAPS - 1;
    const int k = TAPS ? TAPS : K, hist = k - 1, span = max(Tn, hist), runs = (span + CONV_TOKENS - 1) / CONV_TOKENS;
    const int channel_blocks = (C + blockDim.x - 1) / blockDim.x, row_run = blockIdx.x / channel_blocks;
    const int c = (blockIdx.x % channel_blocks) * blockDim.x + threadIdx.x;
    if (c >= C || row_run >= B * runs) return;
    const int b = row_run / runs, i0 = (row_run % runs) * CONV_TOKENS;
    // Input j of the window [state; x], as f32.
    auto input = [&](int j) {
        return j < hist ? to_f32(state[((long long)b * hist + j) * C + c]) : to_f32(x[((long long)b * Tn + j - hist) * x_stride + c]);
    };
    // in[j] is input i0 + j.
    float in[WINDOW], weight[MAX_TAPS];
    const bool inside = i0 >= hist && i0 + CONV_TOKENS <= Tn;
    if (inside) {
        const T* window_start = x + ((long long)b * Tn + i0 - hist) * x_stride + c;
#pragma unroll
        for (int j = 0; j < WINDOW; ++j) in[j] = j < CONV_TOKENS + hist ? to_f32(window_start[j * x_stride]) : 0.0f;
    } else {
#pragma unroll
        for (int j = 0; j < WINDOW; ++j) in[j] = j < CONV_TOKENS + hist && i0 + j < Tn + hist ? input(i0 + j) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < MAX_TAPS; ++j) weight[j] = j < k ? w[(long long)c * k + j] : 0.0f;
    T* out = y + ((long long)b * Tn + i0) * C + c;
#pragma unroll
    for (int t = 0; t < CONV_TOKENS; ++t) {
        if (inside || i0 + t < Tn) {
            float acc = conv_first_tap(in[t], weight[0]);
#pragma unroll
            for (int j = 1; j < MAX_TAPS; ++j) {
                if (j < k) acc = conv_next_tap(acc, in[t + j], weight[j]);
            }
            out[(long long)t * C] = from_f32<T>(silu(acc));
        }
    }
    if (i0 < hist) {
        for (int i = i0; i < min(i0 + CONV_TOKENS, hist); ++i)
            new_state[((long long)b * hist + i) * C + c] = from_f32<T>(input(Tn + i));
    }
}

// One token per row of causal_conv1d_silu with the window updated in place (a recorded decode
// step, whose window buffer stays put): one thread per (row, channel) reads its K - 1 stored
// inputs and the new one, writes y and shifts the window by one. The same sums in the same order.
// Row b's window is state[slots[b]] where `slots` is given (a state pool's slots), else state[b];
// a row whose slot is negative (a padding row of a recorded batch) is skipped, its y not written.

template <typename T>
__device__ void causal_conv1d_silu_step(const T* x, long long x_stride, T* state, const int* slots, const float* w,
                                        T* y, int B, int C, int K) {
    const int hist = K - 1, b = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C || b >= B) return;
    const int slot = slots ? slots[b] : b;
    if (slot < 0) return;
    T* window = state + (long long)slot * hist * C + c;
    float input[MAX_CONV_KERNEL];
#pragma unroll
    for (int j = 0; j < MAX_CONV_KERNEL; ++j) {
        if (j < hist) input[j] = to_f32(window[(long long)j * C]);
        else if (j == hist) input[j] = to_f32(x[(long long)b * x_stride + c]);
    }
    float acc = conv_first_tap(input[0], w[(long long)c * K]);
#pragma unroll
    for (int j = 1; j < MAX_CONV_KERNEL; ++j) {
        if (j < K) acc = conv_next_tap(acc, input[j], w[(long long)c * K + j]);
    }
    y[(long long)b * C + c] = from_f32<T>(silu(acc));
#pragma unroll
    for (int j = 0; j < MAX_CONV_KERNEL - 1; ++j) {
        if (j < hist) window[(long long)j * C] = from_f32<T>(input[j + 1]);
    }
}

// The gated delta rule over `T` tokens, per value head h (key head h / (Hv / Hk)):
//   q, k = l2norm(q), l2norm(k); q *= 1 / sqrt(Dk)
//   g = -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b)
//   S = exp(g) S;  S += beta (v - S k) k^T;  o = S q
// Rows of S ([Dv, Dk] per head) are independent, so each warp keeps ROWS_PER_WARP rows in
// registers (lanes split Dk) and walks all tokens. Per tile of TOKEN_TILE tokens the block first
// stages everything a step reads from memory in shared memory — normalised q / k, the gates and
// its rows' v — so the per-token chain is register and shared-memory work only, and writes its
// rows' outputs for the tile at once. (Two rows per warp: the chain is latency bound, so more
// warps per multiprocessor hide it better. With the staging, a 512-token launch of the 4B shape
// went from 0.65 to 0.37 ms on an H200, against four rows per warp without it.) A row's
// arithmetic is the same whatever the number of tokens or rows in the call, so a verify block
// computes each position exactly as decoding it alone would. q, k, v are [B, T, H, D] with the
// given token strides and contiguous heads; a and beta_logits [B, T, Hv] with `gate_stride`
// between tokens. Row b's state is s_in / s_out [slots[b]] where `slots` is given (the rows' slots
// of a state pool, updated in place), else [b]; a row whose slot is negative (a padding row of a
// recorded batch) is skipped, its outputs not written. The state is stored in S (f32, or bf16) and
// held in f32, rounded to S after every token.
// Each lane holds PER_LANE of a row's Dk columns (Dk <= 32 · PER_LANE): a kernel is compiled for
// 32, 128 and 256 columns, so a 128-wide head does not hold (and stage) twice its registers. The
// q / k tile in shared memory is as long as the call's tokens (up to TOKEN_TILE): a decode step's
// block takes 1 KB, not 32, and registers and shared memory let several times more blocks run on
// a multiprocessor, whose state loads are what keeps the memory busy. Neither choice changes a
// row's arithmetic (the columns past Dk add exact zeros).
constexpr int DELTA_WARPS = 4;
constexpr int ROWS_PER_WARP = 2;
constexpr int BLOCK_ROWS = DELTA_WARPS * ROWS_PER_WARP;
constexpr int TOKEN_TILE = 16;
// Blocks a multiprocessor is to hold at once for 128-wide heads (registers capped to fit them,
// spilling 12 bytes): a wide decode step is paced by how many state loads are in flight. 12
// took a 64-row step of the 4B shape from 110 to 108 µs (f32 state) and 134 to 112 µs (bf16) on
// an H100, 256 rows from 520 to 474 and 536 to 441 µs, against 8 blocks with the registers free
// (scripts/cuda/delta-step-bench.cu); end to end, 64-row decode +5% (f32) and +15% (bf16),
// 256 rows +13% (docs/benchmarks.md). Other widths are not capped (256-wide heads would spill
// over 100 bytes; neither is measured).
constexpr int STEPS_MIN_BLOCKS = 12;

template <typename T, typename S, int PER_LANE>
__device__ void gated_delta_steps(const T* q, const T* k, const T* v, long long q_stride, long long k_stride,
                                  long long v_stride, const T* a, const T* beta_logits, long long gate_stride,
                                  const float* a_log,
                                  const float* dt_bias, const S* s_in, S* s_out, const int* slots, float* o,
                                  int B, int Tn, int Hk, int Hv, int Dk, int Dv) {
    // q and k of the tile's tokens, normalised: [min(Tn, TOKEN_TILE)][Dk] each.
    extern __shared__ __align__(128) unsigned char shared[];
    float* q_tile = reinterpret_cast<float*>(shared);
    float* k_tile = q_tile + min(Tn, TOKEN_TILE) * Dk;
    __shared__ float v_tile[TOKEN_TILE][BLOCK_ROWS];
    __shared__ float o_tile[TOKEN_TILE][BLOCK_ROWS];
    __shared__ float decay_tile[TOKEN_TILE];
    __shared__ float beta_tile[TOKEN_TILE];
    const int b = blockIdx.x / Hv, h = blockIdx.x % Hv, hk = h / (Hv / Hk);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int block_row = blockIdx.y * BLOCK_ROWS;
    const int warp_row = warp * ROWS_PER_WARP;  // within the block
    const int slot = slots ? slots[b] : b;
    if (slot < 0) return;  // the whole block: every thread has this row
    const long long head = (long long)slot * Hv + h;
    const float q_scale = rsqrtf((float)Dk);
    const float neg_a = -expf(a_log[h]);

    float s[ROWS_PER_WARP][PER_LANE];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int row = block_row + warp_row + r;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int d = lane + 32 * i;
            s[r][i] = (row < Dv && d < Dk) ? to_f32(s_in[(head * Dv + row) * Dk + d]) : 0.0f;
        }
    }
    for (int t0 = 0; t0 < Tn; t0 += TOKEN_TILE) {
        const int tile = min(TOKEN_TILE, Tn - t0);
        __syncthreads();
        for (int tt = warp; tt < tile; tt += DELTA_WARPS) {
            const long long tok = (long long)b * Tn + t0 + tt;
            const T* qt = q + tok * q_stride + (long long)hk * Dk;
            const T* kt = k + tok * k_stride + (long long)hk * Dk;
            float qv[PER_LANE], kv[PER_LANE], qq = 0.0f, kk = 0.0f;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                const int d = lane + 32 * i;
                qv[i] = d < Dk ? to_f32(qt[d]) : 0.0f;
                kv[i] = d < Dk ? to_f32(kt[d]) : 0.0f;
                qq += qv[i] * qv[i];
                kk += kv[i] * kv[i];
            }
            const float q_inv = rsqrtf(warp_sum(qq) + 1e-6f) * q_scale, k_inv = rsqrtf(warp_sum(kk) + 1e-6f);
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                const int d = lane + 32 * i;
                if (d < Dk) {
                    q_tile[tt * Dk + d] = qv[i] * q_inv;
                    k_tile[tt * Dk + d] = kv[i] * k_inv;
                }
            }
            if (lane < BLOCK_ROWS) {
                const int row = block_row + lane;
                v_tile[tt][lane] = row < Dv ? to_f32(v[tok * v_stride + (long long)h * Dv + row]) : 0.0f;
            } else if (lane == BLOCK_ROWS) {
                const float x = to_f32(a[tok * gate_stride + h]) + dt_bias[h];
                const float softplus = fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
                decay_tile[tt] = expf(neg_a * softplus);
                beta_tile[tt] = 1.0f / (1.0f + expf(-to_f32(beta_logits[tok * gate_stride + h])));
            }
        }
        __syncthreads();
        for (int tt = 0; tt < tile; ++tt) {
            const float decay = decay_tile[tt], beta = beta_tile[tt];
            float kv[PER_LANE], qv[PER_LANE];
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                const int d = lane + 32 * i;
                kv[i] = d < Dk ? k_tile[tt * Dk + d] : 0.0f;
                qv[i] = d < Dk ? q_tile[tt * Dk + d] : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < ROWS_PER_WARP; ++r) {
                float remembered = 0.0f;
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) {
                    s[r][i] *= decay;
                    remembered += s[r][i] * kv[i];
                }
                remembered = warp_sum(remembered);
                const float delta = beta * (v_tile[tt][warp_row + r] - remembered);
                float out = 0.0f;
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) {
                    s[r][i] += delta * kv[i];
                    out += s[r][i] * qv[i];
                }
                out = warp_sum(out);
                if (lane == 0) o_tile[tt][warp_row + r] = out;
                // The state as stored between tokens (a no-op for f32): a verify block leaves
                // each position what decoding it alone would.
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) s[r][i] = round_to<S>(s[r][i]);
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < tile * BLOCK_ROWS; i += DELTA_WARPS * 32) {
            const int tt = i / BLOCK_ROWS, row = block_row + i % BLOCK_ROWS;
            if (row < Dv) o[(((long long)b * Tn + t0 + tt) * Hv + h) * Dv + row] = o_tile[tt][i % BLOCK_ROWS];
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int row = block_row + warp_row + r;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (row < Dv && d < Dk) s_out[(head * Dv + row) * Dk + d] = from_f32<S>(s[r][i]);
        }
    }
}

// The chunked kernels use bf16 tensor cores: compiled for compute capability 8.0 on only (the
// launcher finds them missing otherwise and steps token by token).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// The gated delta rule over a prompt in the chunk-parallel (WY / UT-transform) form on tensor
// cores, for bf16 / f16 inputs with 128-wide heads (see `chunked` in src/gated_delta.rs for the
// algebra). Within a chunk of CHUNK tokens every interaction is a matrix product; only the state
// passes from chunk to chunk. Two kernels:
//  - chunk_prepare, one block per (row · value head, chunk), all chunks at once: the gates, the
//    normalised q / k, the chunk's causal q·k scores, and the UT transform T = (I + L)⁻¹ by
//    forward substitution, giving per chunk W = T diag(β e^G) K (stored negated) and
//    U = T diag(β) V;
//  - chunk_scan, one block per (row · value head, SCAN_COLS state columns), walking the chunks
//    in order with its slice of the state in tensor-core accumulators: V' = U − W Sᵀ,
//    O = e^G Q Sᵀ + P V', S = e^{G_last} S + V'ᵀ (e^{G_last − G} K).
// Operands of the products are in the model dtype, products accumulate in f32, the state is f32
// between chunks (rounded to the model dtype as an operand, as V' is).
constexpr int CHUNK = 64;
constexpr int CHUNK_HEAD = 128;  // Dk and Dv the chunked kernels take
constexpr int CHUNK_WARPS = 4;
constexpr int CHUNK_THREADS = 32 * CHUNK_WARPS;  // the chunked kernels' block size; loops unroll over it
constexpr int SCAN_COLS = 32;
constexpr int HEAD_TILES = CHUNK_HEAD / 16;
constexpr int PIECES = CHUNK_HEAD / 8;  // 16-byte pieces of a head's 16-bit row
// Row lengths of shared-memory tiles, padded by 16 bytes so the rows of a tensor-core tile fall
// in different banks: head-wide and chunk-wide 16-bit tiles, f32 chunk-wide and scan-wide ones.
constexpr int WIDE_ROW = CHUNK_HEAD + 8, T_ROW = CHUNK + 8, P_ROW = CHUNK + 8, MAT_ROW = CHUNK + 4,
              U_ROW = SCAN_COLS + 8, COLS_ROW = SCAN_COLS + 8, SCRATCH_ROW = SCAN_COLS + 4;
static_assert(CHUNK == 16 * CHUNK_WARPS, "each warp owns 16 tokens of a chunk");
static_assert(CHUNK_HEAD == 32 * CHUNK_WARPS, "each scan warp owns 32 key dims of the state");

namespace wm = nvcuda::wmma;
template <typename T, typename Layout> using OperandA = wm::fragment<wm::matrix_a, 16, 16, 16, T, Layout>;
template <typename T, typename Layout> using OperandB = wm::fragment<wm::matrix_b, 16, 16, 16, T, Layout>;
using Accumulator = wm::fragment<wm::accumulator, 16, 16, 16, float>;

// q, k, v [B, T, H, 128] with token strides; a, beta_logits [B, T, Hv] with `gate_stride`.
// Rows of q, k, v start 16-byte aligned (token strides multiples of 8). Outputs per (row · value head), rows padded to N · CHUNK tokens: qg = e^G q̂ / √Dk, kw =
// e^{G_last − G} k̂, w_neg = −W, u = U [·, N·CHUNK, 128]; p [·, N, CHUNK, CHUNK] = lower(q k̂ᵀ ∘ Γ);
// chunk_decay [·, N] = e^{G_last}. Tokens past T are zero with g = β = 0, which leaves the state
// alone.
template <typename T>
__device__ void gated_delta_chunk_prepare(const T* q, const T* k, const T* v, long long q_stride, long long k_stride,
                                          long long v_stride, const T* a, const T* beta_logits,
                                          long long gate_stride, const float* a_log, const float* dt_bias, T* qg,
                                          T* kw, T* w_neg, float* u, T* p, float* chunk_decay, int Tn, int Hk,
                                          int Hv, int N) {
    // Dynamic shared memory (52992 bytes, over the 48 KiB a static array may take): two
    // [CHUNK][WIDE_ROW] tiles of T, a [CHUNK][MAT_ROW] f32 matrix, three f32 vectors of CHUNK.
    // Rows are padded by 16 bytes so a tensor-core tile's rows fall in different banks.
    extern __shared__ __align__(128) unsigned char shared[];
    T* kb = reinterpret_cast<T*>(shared);  // k̂, later β e^G k̂
    T* xb = kb + CHUNK * WIDE_ROW;         // q̂ / √Dk; later T in f32 ([CHUNK][CHUNK]); later β v
    float* mat = reinterpret_cast<float*>(xb + CHUNK * WIDE_ROW);  // q k̂ᵀ, then L
    float* cum = mat + CHUNK * MAT_ROW;      // G, the within-chunk cumulative log decay
    float* beta = cum + CHUNK;
    float* k_write = beta + CHUNK;         // per token: β e^G / |k|
    const int n = blockIdx.y, bh = blockIdx.x, b = bh / Hv, h = bh % Hv, hk = h / (Hv / Hk);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t0 = n * CHUNK;
    const long long rows = ((long long)bh * N + n) * CHUNK;  // this chunk's first row in the outputs

    if (threadIdx.x < CHUNK) {
        const int t = t0 + threadIdx.x;
        float g = 0.0f, bt = 0.0f;
        if (t < Tn) {
            const long long tok = (long long)b * Tn + t;
            const float x = to_f32(a[tok * gate_stride + h]) + dt_bias[h];
            g = -expf(a_log[h]) * (fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))));
            bt = 1.0f / (1.0f + expf(-to_f32(beta_logits[tok * gate_stride + h])));
        }
        cum[threadIdx.x] = g;
        beta[threadIdx.x] = bt;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < CHUNK; ++i) cum[i] += cum[i - 1];
        chunk_decay[(long long)bh * N + n] = expf(cum[CHUNK - 1]);
    }
    __syncthreads();

    // The chunk's raw q and k, in 16-byte pieces by every thread at once, then normalised in
    // place by a warp per token, as the step kernel normalises them.
    const uint4 zero = make_uint4(0, 0, 0, 0);
    auto piece = [&](const T* x, long long stride, int head, int e) {
        const int tt = e / PIECES, t = t0 + tt;
        const T* at = x + ((long long)b * Tn + t) * stride + (long long)head * CHUNK_HEAD + (e % PIECES) * 8;
        return t < Tn ? *reinterpret_cast<const uint4*>(at) : zero;
    };
#pragma unroll
    for (int e = threadIdx.x; e < CHUNK * PIECES; e += CHUNK_THREADS) {
        const int at = (e / PIECES) * WIDE_ROW + (e % PIECES) * 8;
        *reinterpret_cast<uint4*>(kb + at) = piece(k, k_stride, hk, e);
        *reinterpret_cast<uint4*>(xb + at) = piece(q, q_stride, hk, e);
    }
    __syncthreads();
    const float q_scale = rsqrtf((float)CHUNK_HEAD);
    for (int tt = warp; tt < CHUNK; tt += CHUNK_WARPS) {
        float qv[CHUNK_HEAD / 32], kv[CHUNK_HEAD / 32], qq = 0.0f, kk = 0.0f;
#pragma unroll
        for (int i = 0; i < CHUNK_HEAD / 32; ++i) {
            const int d = lane + 32 * i;
            qv[i] = to_f32(xb[tt * WIDE_ROW + d]);
            kv[i] = to_f32(kb[tt * WIDE_ROW + d]);
            qq += qv[i] * qv[i];
            kk += kv[i] * kv[i];
        }
        const float q_inv = rsqrtf(warp_sum(qq) + 1e-6f) * q_scale, k_inv = rsqrtf(warp_sum(kk) + 1e-6f);
        const float from_start = expf(cum[tt]), to_end = expf(cum[CHUNK - 1] - cum[tt]);
        if (lane == 0) k_write[tt] = beta[tt] * from_start * k_inv;
#pragma unroll
        for (int i = 0; i < CHUNK_HEAD / 32; ++i) {
            const int d = lane + 32 * i;
            kb[tt * WIDE_ROW + d] = from_f32<T>(kv[i] * k_inv);
            xb[tt * WIDE_ROW + d] = from_f32<T>(qv[i] * q_inv);
            qg[(rows + tt) * CHUNK_HEAD + d] = from_f32<T>(qv[i] * q_inv * from_start);
            kw[(rows + tt) * CHUNK_HEAD + d] = from_f32<T>(kv[i] * k_inv * to_end);
        }
    }
    __syncthreads();

    // mat = x k̂ᵀ on and below the diagonal blocks (warp w: token block w).
    auto scores = [&](const T* x) {
        for (int j = 0; j <= warp; ++j) {
            Accumulator acc;
            wm::fill_fragment(acc, 0.0f);
#pragma unroll
            for (int kk = 0; kk < HEAD_TILES; ++kk) {
                OperandA<T, wm::row_major> fx;
                OperandB<T, wm::col_major> fk;
                wm::load_matrix_sync(fx, x + warp * 16 * WIDE_ROW + kk * 16, WIDE_ROW);
                wm::load_matrix_sync(fk, kb + j * 16 * WIDE_ROW + kk * 16, WIDE_ROW);
                wm::mma_sync(acc, fx, fk, acc);
            }
            wm::store_matrix_sync(mat + warp * 16 * MAT_ROW + j * 16, acc, MAT_ROW, wm::mem_row_major);
        }
    };
    scores(xb);
    __syncthreads();
    T* pc = p + rows * CHUNK;
    for (int e = threadIdx.x; e < CHUNK * CHUNK; e += CHUNK_THREADS) {
        const int i = e / CHUNK, j = e % CHUNK;
        pc[e] = from_f32<T>(j <= i ? mat[i * MAT_ROW + j] * expf(cum[i] - cum[j]) : 0.0f);
    }
    __syncthreads();
    scores(kb);
    __syncthreads();
    for (int e = threadIdx.x; e < CHUNK * CHUNK; e += CHUNK_THREADS) {
        const int i = e / CHUNK, j = e % CHUNK;
        mat[i * MAT_ROW + j] = j < i ? beta[i] * mat[i * MAT_ROW + j] * expf(cum[i] - cum[j]) : 0.0f;  // L
    }
    __syncthreads();

    // T = (I + L)⁻¹ by blocks of 16 tokens. Warp w inverts diagonal block w by forward
    // substitution (lane c < 16 takes column c: T_ic = δ_ic − Σ_{c≤j<i} L_ij T_jc); then the
    // blocks below the diagonal, one diagonal distance at a time (each distance's blocks are
    // independent): T_ij = −T_ii Σ_{j≤k<i} L_ik T_kj, lane (c, half) taking 8 rows of column c.
    float* tf = reinterpret_cast<float*>(xb);
    for (int e = threadIdx.x; e < CHUNK * CHUNK; e += CHUNK_THREADS) tf[e] = 0.0f;
    __syncthreads();
    if (lane < 16) {
        const int base = 16 * warp, c = lane;
        for (int i = 0; i < 16; ++i) {
            float acc = 0.0f;
            for (int j = c; j < i; ++j) acc += mat[(base + i) * MAT_ROW + base + j] * tf[(base + j) * CHUNK + base + c];
            tf[(base + i) * CHUNK + base + c] = i < c ? 0.0f : i == c ? 1.0f : -acc;
        }
    }
    for (int distance = 1; distance < CHUNK_WARPS; ++distance) {
        __syncthreads();
        if (warp + distance >= CHUNK_WARPS) continue;
        const int bi = 16 * (warp + distance), bj = 16 * warp, c = lane % 16, r0 = 8 * (lane / 16);
        float acc[8] = {};
        for (int kk = bj; kk < bi; ++kk) {
            const float t_kc = tf[kk * CHUNK + bj + c];
#pragma unroll
            for (int r = 0; r < 8; ++r) acc[r] += mat[(bi + r0 + r) * MAT_ROW + kk] * t_kc;
        }
        float* block = tf + bi * CHUNK + bj;  // holds the sum until T_ij replaces it
#pragma unroll
        for (int r = 0; r < 8; ++r) block[(r0 + r) * CHUNK + c] = acc[r];
        __syncwarp();
        float out[8] = {};
        for (int m = 0; m < 16; ++m) {
            const float sum_mc = block[m * CHUNK + c];
#pragma unroll
            for (int r = 0; r < 8; ++r) out[r] -= tf[(bi + r0 + r) * CHUNK + bi + m] * sum_mc;
        }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < 8; ++r) block[(r0 + r) * CHUNK + c] = out[r];
    }
    __syncthreads();
    T* tb = reinterpret_cast<T*>(mat);  // T as an operand; L is done with
    for (int e = threadIdx.x; e < CHUNK * CHUNK; e += CHUNK_THREADS) tb[(e / CHUNK) * T_ROW + e % CHUNK] = from_f32<T>(tf[e]);
    __syncthreads();
#pragma unroll
    for (int e = threadIdx.x; e < CHUNK * PIECES; e += CHUNK_THREADS) {
        const int tt = e / PIECES;
        uint4 kp = piece(k, k_stride, hk, e), vp = piece(v, v_stride, h, e);
        T* kx = reinterpret_cast<T*>(&kp);
        T* vx = reinterpret_cast<T*>(&vp);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            kx[i] = from_f32<T>(to_f32(kx[i]) * k_write[tt]);
            vx[i] = from_f32<T>(to_f32(vx[i]) * beta[tt]);
        }
        const int at = tt * WIDE_ROW + (e % PIECES) * 8;
        *reinterpret_cast<uint4*>(kb + at) = kp;
        *reinterpret_cast<uint4*>(xb + at) = vp;
    }
    __syncthreads();

    // W and U, token block `warp` (T is lower triangular: blocks past the diagonal are zero).
    float* scratch = reinterpret_cast<float*>(tb + CHUNK * T_ROW) + warp * 256;
    for (int ct = 0; ct < HEAD_TILES; ++ct) {
        Accumulator w_acc, u_acc;
        wm::fill_fragment(w_acc, 0.0f);
        wm::fill_fragment(u_acc, 0.0f);
        for (int kk = 0; kk <= warp; ++kk) {
            OperandA<T, wm::row_major> ft;
            OperandB<T, wm::row_major> fk, fv;
            wm::load_matrix_sync(ft, tb + warp * 16 * T_ROW + kk * 16, T_ROW);
            wm::load_matrix_sync(fk, kb + kk * 16 * WIDE_ROW + ct * 16, WIDE_ROW);
            wm::load_matrix_sync(fv, xb + kk * 16 * WIDE_ROW + ct * 16, WIDE_ROW);
            wm::mma_sync(w_acc, ft, fk, w_acc);
            wm::mma_sync(u_acc, ft, fv, u_acc);
        }
        wm::store_matrix_sync(u + (rows + warp * 16) * CHUNK_HEAD + ct * 16, u_acc, CHUNK_HEAD, wm::mem_row_major);
        wm::store_matrix_sync(scratch, w_acc, 16, wm::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32)
            w_neg[(rows + warp * 16 + e / 16) * CHUNK_HEAD + ct * 16 + e % 16] = from_f32<T>(-scratch[e]);
        __syncwarp();
    }
}

// Asynchronous 16-byte copies from global to shared memory (they bypass registers and L1).
__device__ __forceinline__ void copy_async(void* shared_at, const void* global_at) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(shared_at));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(global_at));
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING> __device__ __forceinline__ void copies_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// One chunk's operands of the scan in shared memory, rows padded by 16 bytes so the 16 rows of
// a tensor-core tile fall in different banks.
template <typename T> struct ScanChunk {
    T w_neg[CHUNK * WIDE_ROW], qg[CHUNK * WIDE_ROW], kw[CHUNK * WIDE_ROW], p[CHUNK * P_ROW];
    float u[CHUNK * U_ROW];
};

// s_in, s_out [B, Hv, 128, 128] f32 (S as [Dv, Dk]); o [B, T, Hv, 128] f32. Block
// (row · value head, blockIdx.y) keeps state columns (value dims) blockIdx.y · SCAN_COLS onward
// as Sᵀ tiles: warp w holds key dims 32w..32w+31. While it works on a chunk, the next chunk's
// operands are on their way into the other of two buffers (dynamic shared memory, 2 ScanChunk).
template <typename T>
__device__ void gated_delta_chunk_scan(const T* qg, const T* kw, const T* w_neg, const float* u, const T* p,
                                       const float* chunk_decay, const float* s_in, float* s_out, float* o, int Tn,
                                       int Hv, int N) {
    extern __shared__ __align__(128) unsigned char shared[];
    ScanChunk<T>* buffers = reinterpret_cast<ScanChunk<T>*>(shared);
    __shared__ __align__(32) T sb[CHUNK_HEAD * COLS_ROW];              // Sᵀ as an operand, [key][col]
    __shared__ __align__(32) T vb[CHUNK * COLS_ROW];                   // V' as an operand, [token][col]
    __shared__ __align__(32) float scratch[CHUNK_HEAD * SCRATCH_ROW];  // accumulators on their way
    const int bh = blockIdx.x, b = bh / Hv, h = bh % Hv, col0 = blockIdx.y * SCAN_COLS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long head = (long long)bh * CHUNK_HEAD * CHUNK_HEAD;

    auto fetch = [&](int n) {
        ScanChunk<T>& to = buffers[n % 2];
        const long long rows = ((long long)bh * N + n) * CHUNK;
        for (int e = threadIdx.x; e < CHUNK * PIECES; e += CHUNK_THREADS) {
            const int r = e / PIECES, at = r * WIDE_ROW + (e % PIECES) * 8;
            const long long from = (rows + r) * CHUNK_HEAD + (e % PIECES) * 8;
            copy_async(to.w_neg + at, w_neg + from);
            copy_async(to.qg + at, qg + from);
            copy_async(to.kw + at, kw + from);
        }
        for (int e = threadIdx.x; e < CHUNK * CHUNK / 8; e += CHUNK_THREADS) {
            const int r = e / (CHUNK / 8), c = (e % (CHUNK / 8)) * 8;
            copy_async(to.p + r * P_ROW + c, p + (rows + r) * CHUNK + c);
        }
        for (int e = threadIdx.x; e < CHUNK * SCAN_COLS / 4; e += CHUNK_THREADS) {
            const int r = e / (SCAN_COLS / 4), c = (e % (SCAN_COLS / 4)) * 4;
            copy_async(to.u + r * U_ROW + c, u + (rows + r) * CHUNK_HEAD + col0 + c);
        }
        copies_commit();
    };

    Accumulator s[2][2];  // Sᵀ[32 warp + 16 r .., col0 + 16 c ..]
    auto state_at = [&](int r, int c) { return head + (long long)(col0 + 16 * c) * CHUNK_HEAD + 32 * warp + 16 * r; };
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < 2; ++c) wm::load_matrix_sync(s[r][c], s_in + state_at(r, c), CHUNK_HEAD, wm::mem_col_major);
    fetch(0);

    for (int n = 0; n < N; ++n) {
        const ScanChunk<T>& at = buffers[n % 2];
        __syncthreads();  // the previous chunk is done with sb, vb, scratch and the other buffer
        if (n + 1 < N) {
            fetch(n + 1);
            copies_wait<1>();  // this thread's copies of chunk n have landed
        } else {
            copies_wait<0>();
        }
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int c = 0; c < 2; ++c)
                wm::store_matrix_sync(scratch + (32 * warp + 16 * r) * SCRATCH_ROW + 16 * c, s[r][c], SCRATCH_ROW,
                                      wm::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 32 * SCAN_COLS; e += 32) {
            const int row = 32 * warp + e / SCAN_COLS, col = e % SCAN_COLS;
            sb[row * COLS_ROW + col] = from_f32<T>(scratch[row * SCRATCH_ROW + col]);
        }
        __syncthreads();  // sb, and every thread's copies of chunk n

        // V' = U − W Sᵀ, this warp's 16 tokens
        const int own = 16 * warp;
        Accumulator fresh[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) wm::load_matrix_sync(fresh[c], at.u + own * U_ROW + 16 * c, U_ROW, wm::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < HEAD_TILES; ++kk) {
            OperandA<T, wm::row_major> fw;
            wm::load_matrix_sync(fw, at.w_neg + own * WIDE_ROW + 16 * kk, WIDE_ROW);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                OperandB<T, wm::row_major> fs;
                wm::load_matrix_sync(fs, sb + 16 * kk * COLS_ROW + 16 * c, COLS_ROW);
                wm::mma_sync(fresh[c], fw, fs, fresh[c]);
            }
        }
        float* own_scratch = scratch + own * SCRATCH_ROW;
#pragma unroll
        for (int c = 0; c < 2; ++c) wm::store_matrix_sync(own_scratch + 16 * c, fresh[c], SCRATCH_ROW, wm::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 16 * SCAN_COLS; e += 32) {
            const int row = e / SCAN_COLS, col = e % SCAN_COLS;
            vb[(own + row) * COLS_ROW + col] = from_f32<T>(own_scratch[row * SCRATCH_ROW + col]);
        }
        __syncthreads();

        // O = e^G Q Sᵀ + P V' (P is lower triangular: token blocks up to this warp's)
        Accumulator out[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) wm::fill_fragment(out[c], 0.0f);
#pragma unroll
        for (int kk = 0; kk < HEAD_TILES; ++kk) {
            OperandA<T, wm::row_major> fq;
            wm::load_matrix_sync(fq, at.qg + own * WIDE_ROW + 16 * kk, WIDE_ROW);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                OperandB<T, wm::row_major> fs;
                wm::load_matrix_sync(fs, sb + 16 * kk * COLS_ROW + 16 * c, COLS_ROW);
                wm::mma_sync(out[c], fq, fs, out[c]);
            }
        }
        for (int kk = 0; kk <= warp; ++kk) {
            OperandA<T, wm::row_major> fp;
            wm::load_matrix_sync(fp, at.p + own * P_ROW + 16 * kk, P_ROW);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                OperandB<T, wm::row_major> fv;
                wm::load_matrix_sync(fv, vb + 16 * kk * COLS_ROW + 16 * c, COLS_ROW);
                wm::mma_sync(out[c], fp, fv, out[c]);
            }
        }
        const int first = n * CHUNK + own, valid = min(16, Tn - first);
        float* o_rows = o + (((long long)b * Tn + first) * Hv + h) * CHUNK_HEAD + col0;
        const long long o_stride = (long long)Hv * CHUNK_HEAD;
        if (valid == 16) {
#pragma unroll
            for (int c = 0; c < 2; ++c) wm::store_matrix_sync(o_rows + 16 * c, out[c], o_stride, wm::mem_row_major);
        } else if (valid > 0) {  // the prompt's last, partial chunk
#pragma unroll
            for (int c = 0; c < 2; ++c) wm::store_matrix_sync(own_scratch + 16 * c, out[c], SCRATCH_ROW, wm::mem_row_major);
            __syncwarp();
            for (int e = lane; e < valid * SCAN_COLS; e += 32)
                o_rows[(e / SCAN_COLS) * o_stride + e % SCAN_COLS] = own_scratch[(e / SCAN_COLS) * SCRATCH_ROW + e % SCAN_COLS];
        }

        // S = e^{G_last} S + (e^{G_last − G} K)ᵀ V'
        const float decay = chunk_decay[(long long)bh * N + n];
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
                for (int i = 0; i < s[r][c].num_elements; ++i) s[r][c].x[i] *= decay;
#pragma unroll
        for (int kk = 0; kk < CHUNK / 16; ++kk) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                OperandA<T, wm::col_major> fk;
                wm::load_matrix_sync(fk, at.kw + 16 * kk * WIDE_ROW + 32 * warp + 16 * r, WIDE_ROW);
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    OperandB<T, wm::row_major> fv;
                    wm::load_matrix_sync(fv, vb + 16 * kk * COLS_ROW + 16 * c, COLS_ROW);
                    wm::mma_sync(s[r][c], fk, fv, s[r][c]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < 2; ++c) wm::store_matrix_sync(s_out + state_at(r, c), s[r][c], CHUNK_HEAD, wm::mem_col_major);
}

#endif  // compute capability 8.0

// Copies row i of `src` ([n / row_len rows] of `row_len` elements) to row rows[i] of `dst`: how
// a batch's new recurrent state goes back into its rows' slots of a state pool. One thread per
// element.
template <typename T>
__device__ void scatter_rows(const T* src, T* dst, const int* rows, long long row_len, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    dst[(long long)rows[i / row_len] * row_len + i % row_len] = src[i];
}

#define INSTANTIATE(T, NAME)                                                                                     \
    extern "C" __global__ void causal_conv1d_silu_##NAME(const T* x, long long x_stride, const T* state,        \
                                                         const float* w, T* y, T* new_state, int B, int Tn,     \
                                                         int C, int K) {                                        \
        await_previous_kernel();                                                                                \
        if (K == 4) causal_conv1d_silu<T, 4>(x, x_stride, state, w, y, new_state, B, Tn, C, K);                \
        else causal_conv1d_silu<T, 0>(x, x_stride, state, w, y, new_state, B, Tn, C, K);                       \
    }                                                                                                            \
    extern "C" __global__ void causal_conv1d_silu_step_##NAME(const T* x, long long x_stride, T* state,       \
                                                              const int* slots, const float* w, T* y, int B, \
                                                              int C, int K) {                               \
        await_previous_kernel();                                                                               \
        causal_conv1d_silu_step<T>(x, x_stride, state, slots, w, y, B, C, K);                                   \
    }                                                                                                            \
    extern "C" __global__ void scatter_rows_##NAME(const T* src, T* dst, const int* rows, long long row_len,    \
                                                   long long n) {                                              \
        await_previous_kernel();                                                                               \
        scatter_rows<T>(src, dst, rows, row_len, n);                                                            \
    }                                                                                                            \
    INSTANTIATE_STEPS(T, float, , NAME)                                                                          \
    INSTANTIATE_STEPS(T, __nv_bfloat16, _bf16_state, NAME)
// The step kernels for a state stored in S (f32, or bf16 with --mamba-ssm-cache-dtype), one per
// head width: gated_delta_steps[_bf16_state]_k{32,128,256}_NAME.
#define INSTANTIATE_STEPS(T, S, STATE, NAME)                                                                     \
    STEPS_KERNEL(T, S, 1, 1, gated_delta_steps##STATE##_k32_##NAME)                                              \
    STEPS_KERNEL(T, S, 4, STEPS_MIN_BLOCKS, gated_delta_steps##STATE##_k128_##NAME)                              \
    STEPS_KERNEL(T, S, 8, 1, gated_delta_steps##STATE##_k256_##NAME)
#define STEPS_KERNEL(T, S, PER_LANE, MIN_BLOCKS, KERNEL)                                                         \
    extern "C" __global__ void __launch_bounds__(DELTA_WARPS * 32, MIN_BLOCKS) KERNEL(                           \
        const T* q, const T* k, const T* v, long long q_stride, long long k_stride, long long v_stride,         \
        const T* a, const T* beta_logits, long long gate_stride, const float* a_log, const float* dt_bias,      \
        const S* s_in, S* s_out, const int* slots, float* o, int B, int Tn, int Hk, int Hv, int Dk, int Dv) {   \
        await_previous_kernel();                                                                                \
        gated_delta_steps<T, S, PER_LANE>(q, k, v, q_stride, k_stride, v_stride, a, beta_logits, gate_stride,   \
                                          a_log, dt_bias, s_in, s_out, slots, o, B, Tn, Hk, Hv, Dk, Dv);        \
    }
STRATA_FOR_DTYPES(INSTANTIATE)

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// The chunked kernels take tensor-core operand types only.
#define INSTANTIATE_CHUNKED(T, NAME)                                                                             \
    extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) gated_delta_chunk_prepare_##NAME(             \
        const T* q, const T* k, const T* v, long long q_stride, long long k_stride, long long v_stride,         \
        const T* a, const T* beta_logits, long long gate_stride, const float* a_log, const float* dt_bias, T* qg, \
        T* kw, T* w_neg, float* u, T* p, float* chunk_decay, int Tn, int Hk, int Hv, int N) {                   \
        await_previous_kernel();                                                                                \
        gated_delta_chunk_prepare<T>(q, k, v, q_stride, k_stride, v_stride, a, beta_logits, gate_stride, a_log,  \
                                     dt_bias, qg, kw, w_neg, u, p, chunk_decay, Tn, Hk, Hv, N);                  \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) gated_delta_chunk_scan_##NAME(                \
        const T* qg, const T* kw, const T* w_neg, const float* u, const T* p, const float* chunk_decay,         \
        const float* s_in, float* s_out, float* o, int Tn, int Hv, int N) {                                      \
        await_previous_kernel();                                                                                 \
        gated_delta_chunk_scan<T>(qg, kw, w_neg, u, p, chunk_decay, s_in, s_out, o, Tn, Hv, N);                  \
    }
INSTANTIATE_CHUNKED(__nv_bfloat16, bf16)
INSTANTIATE_CHUNKED(__half, f16)
#endif

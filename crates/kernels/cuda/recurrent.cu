// The Gated DeltaNet layer's recurrent kernels: causal conv1d + SiLU, and the gated delta rule
// stepped token by token. Outputs go to fresh memory (state in, new state out), which is what
// lets a speculative round keep the state from before it by reference — except in a recorded
// CUDA-graph decode step, whose state buffers the graph holds alone and updates in place (the
// one-token conv step below, and the delta rule given the same buffer as input and output).
#include "common.cuh"

// Depthwise causal conv1d + SiLU over `T` tokens. One thread per (row, index, channel): for
// index i < T it computes y[i] from the K inputs ending at token i (the first K - 1 - i of them
// from the state), and for i < K - 1 it writes new_state[i], the input K - 1 positions before
// the window's end. x [B, T, C] with `x_stride` between tokens, state and new_state
// [B, K - 1, C] (token-major), w [C, K] f32, y [B, T, C]; blockIdx.x is (row, index) over
// B · max(T, K - 1), blockIdx.y · blockDim.x + threadIdx.x the channel (no 64-bit division per
// thread: that cost more than the convolution).
template <typename T>
__device__ void causal_conv1d_silu(const T* x, long long x_stride, const T* state, const float* w, T* y, T* new_state,
                                   int B, int Tn, int C, int K) {
    const int hist = K - 1, span = max(Tn, hist);
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C || (int)blockIdx.x >= B * span) return;
    const int i = blockIdx.x % span, b = blockIdx.x / span;
    // Input j of the window [state; x], as f32.
    auto input = [&](int j) {
        return j < hist ? to_f32(state[((long long)b * hist + j) * C + c]) : to_f32(x[((long long)b * Tn + j - hist) * x_stride + c]);
    };
    if (i < Tn) {
        // Oldest input first, as the reference sums.
        float acc = input(i) * w[(long long)c * K];
        for (int j = 1; j < K; ++j) acc += input(i + j) * w[(long long)c * K + j];
        y[((long long)b * Tn + i) * C + c] = from_f32<T>(silu(acc));
    }
    if (i < hist) new_state[((long long)b * hist + i) * C + c] = from_f32<T>(input(Tn + i));
}

// One token per row of causal_conv1d_silu with the window updated in place (a recorded decode
// step, whose window buffer stays put): one thread per (row, channel) reads its K - 1 stored
// inputs and the new one, writes y and shifts the window by one. The same sums in the same order.
constexpr int MAX_CONV_KERNEL = 8;

template <typename T>
__device__ void causal_conv1d_silu_step(const T* x, long long x_stride, T* state, const float* w, T* y, int B, int C,
                                        int K) {
    const int hist = K - 1, b = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C || b >= B) return;
    T* window = state + (long long)b * hist * C + c;
    float input[MAX_CONV_KERNEL];
#pragma unroll
    for (int j = 0; j < MAX_CONV_KERNEL; ++j) {
        if (j < hist) input[j] = to_f32(window[(long long)j * C]);
        else if (j == hist) input[j] = to_f32(x[(long long)b * x_stride + c]);
    }
    float acc = input[0] * w[(long long)c * K];
#pragma unroll
    for (int j = 1; j < MAX_CONV_KERNEL; ++j) {
        if (j < K) acc += input[j] * w[(long long)c * K + j];
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
// between tokens.
constexpr int DELTA_WARPS = 4;
constexpr int ROWS_PER_WARP = 2;
constexpr int BLOCK_ROWS = DELTA_WARPS * ROWS_PER_WARP;
constexpr int MAX_PER_LANE = 8;  // Dk <= 256
constexpr int TOKEN_TILE = 16;
constexpr int MAX_DK = 32 * MAX_PER_LANE;

template <typename T>
__device__ void gated_delta_steps(const T* q, const T* k, const T* v, long long q_stride, long long k_stride,
                                  long long v_stride, const T* a, const T* beta_logits, long long gate_stride,
                                  const float* a_log,
                                  const float* dt_bias, const float* s_in, float* s_out, float* o, int B, int Tn,
                                  int Hk, int Hv, int Dk, int Dv) {
    __shared__ float q_tile[TOKEN_TILE][MAX_DK];
    __shared__ float k_tile[TOKEN_TILE][MAX_DK];
    __shared__ float v_tile[TOKEN_TILE][BLOCK_ROWS];
    __shared__ float o_tile[TOKEN_TILE][BLOCK_ROWS];
    __shared__ float decay_tile[TOKEN_TILE];
    __shared__ float beta_tile[TOKEN_TILE];
    const int b = blockIdx.x / Hv, h = blockIdx.x % Hv, hk = h / (Hv / Hk);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int block_row = blockIdx.y * BLOCK_ROWS;
    const int warp_row = warp * ROWS_PER_WARP;  // within the block
    const long long head = (long long)b * Hv + h;
    const float q_scale = rsqrtf((float)Dk);
    const float neg_a = -expf(a_log[h]);

    float s[ROWS_PER_WARP][MAX_PER_LANE];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int row = block_row + warp_row + r;
#pragma unroll
        for (int i = 0; i < MAX_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            s[r][i] = (row < Dv && d < Dk) ? s_in[(head * Dv + row) * Dk + d] : 0.0f;
        }
    }
    for (int t0 = 0; t0 < Tn; t0 += TOKEN_TILE) {
        const int tile = min(TOKEN_TILE, Tn - t0);
        __syncthreads();
        for (int tt = warp; tt < tile; tt += DELTA_WARPS) {
            const long long tok = (long long)b * Tn + t0 + tt;
            const T* qt = q + tok * q_stride + (long long)hk * Dk;
            const T* kt = k + tok * k_stride + (long long)hk * Dk;
            float qv[MAX_PER_LANE], kv[MAX_PER_LANE], qq = 0.0f, kk = 0.0f;
#pragma unroll
            for (int i = 0; i < MAX_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                qv[i] = d < Dk ? to_f32(qt[d]) : 0.0f;
                kv[i] = d < Dk ? to_f32(kt[d]) : 0.0f;
                qq += qv[i] * qv[i];
                kk += kv[i] * kv[i];
            }
            const float q_inv = rsqrtf(warp_sum(qq) + 1e-6f) * q_scale, k_inv = rsqrtf(warp_sum(kk) + 1e-6f);
#pragma unroll
            for (int i = 0; i < MAX_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                if (d < Dk) {
                    q_tile[tt][d] = qv[i] * q_inv;
                    k_tile[tt][d] = kv[i] * k_inv;
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
            float kv[MAX_PER_LANE], qv[MAX_PER_LANE];
#pragma unroll
            for (int i = 0; i < MAX_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                kv[i] = d < Dk ? k_tile[tt][d] : 0.0f;
                qv[i] = d < Dk ? q_tile[tt][d] : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < ROWS_PER_WARP; ++r) {
                float remembered = 0.0f;
#pragma unroll
                for (int i = 0; i < MAX_PER_LANE; ++i) {
                    s[r][i] *= decay;
                    remembered += s[r][i] * kv[i];
                }
                remembered = warp_sum(remembered);
                const float delta = beta * (v_tile[tt][warp_row + r] - remembered);
                float out = 0.0f;
#pragma unroll
                for (int i = 0; i < MAX_PER_LANE; ++i) {
                    s[r][i] += delta * kv[i];
                    out += s[r][i] * qv[i];
                }
                out = warp_sum(out);
                if (lane == 0) o_tile[tt][warp_row + r] = out;
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
        for (int i = 0; i < MAX_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (row < Dv && d < Dk) s_out[(head * Dv + row) * Dk + d] = s[r][i];
        }
    }
}

#define INSTANTIATE(T, NAME)                                                                                     \
    extern "C" __global__ void causal_conv1d_silu_##NAME(const T* x, long long x_stride, const T* state,        \
                                                         const float* w, T* y, T* new_state, int B, int Tn,     \
                                                         int C, int K) {                                        \
        causal_conv1d_silu<T>(x, x_stride, state, w, y, new_state, B, Tn, C, K);                                \
    }                                                                                                            \
    extern "C" __global__ void causal_conv1d_silu_step_##NAME(const T* x, long long x_stride, T* state,       \
                                                              const float* w, T* y, int B, int C, int K) {  \
        causal_conv1d_silu_step<T>(x, x_stride, state, w, y, B, C, K);                                          \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(DELTA_WARPS * 32) gated_delta_steps_##NAME(                     \
        const T* q, const T* k, const T* v, long long q_stride, long long k_stride, long long v_stride,         \
        const T* a, const T* beta_logits, long long gate_stride, const float* a_log, const float* dt_bias,      \
        const float* s_in, float* s_out, float* o, int B, int Tn, int Hk, int Hv, int Dk, int Dv) {             \
        gated_delta_steps<T>(q, k, v, q_stride, k_stride, v_stride, a, beta_logits, gate_stride, a_log, dt_bias, \
                             s_in, s_out, o, B, Tn, Hk, Hv, Dk, Dv);                                            \
    }
STRATA_FOR_DTYPES(INSTANTIATE)

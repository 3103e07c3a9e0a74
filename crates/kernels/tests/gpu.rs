//! Each kernel on the GPU against the CPU kernel (the reference). Compiled only with
//! `--features cuda` and run on a GPU machine (scripts/cuda/build.sh --tests, then the binary).
//! Tolerances: f32 1e-4 absolute (other summation orders); bf16 / f16 2e-2 of the output's scale
//! (inputs and outputs rounded to 8 mantissa bits, and in the chunked DeltaNet the operands of
//! its tensor-core products too). Recurrent state is f32 on both.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use strata_kernels::attention::{
    causal_attention, causal_attention_rows, flash_attention, full_attention, gated_attention_rows, norm_rope, rope_f32,
    sigmoid_gate, write_rows, DecodeRows, PagedDecodeRows, Scoring,
};
use strata_kernels::conv1d::{causal_conv1d_silu, causal_conv1d_silu_step_in_place};
use strata_kernels::experts::{combine, matmul_gathered, route, Routes};
use strata_kernels::gated_delta::{gated_delta_rule, gated_delta_rule_in_place, on_tensor_cores, Gating, Inputs};
use strata_kernels::kv_quant::{Affine, KvCodec, LayerCodes, PartCodes, Turbo, TurboVariant};
use strata_kernels::matmul::matmul_t;
use strata_kernels::norm::{
    add_bias_act, add_layer_norm, add_rms_norm, gated_rms_norm, layer_norm, rms_norm, silu_mul, Activation,
};
use strata_kernels::sampling::{argmax_rows, draw_rows, first_allowed_max, first_max, Adjust, Draw};

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA GPU")
}

/// Deterministic values in [-scale, scale].
fn values(shape: &[usize], scale: f32, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.618 + seed as f32 * 1.37).sin() * 43758.547).fract() * scale).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// Block tables for rows of `lens` positions in blocks of `block_size`: the ids `0..total` (the
/// rows' blocks and `spare` more) in a shuffled order of their own (`seed`), dealt to the rows in
/// turn. Returns the tables and `total`.
fn deal_blocks(lens: &[usize], block_size: usize, spare: usize, seed: u64) -> (Vec<Vec<usize>>, usize) {
    let blocks: Vec<usize> = lens.iter().map(|l| l.div_ceil(block_size)).collect();
    let total = blocks.iter().sum::<usize>() + spare;
    let order = values(&[total], 1.0, seed).to_vec1::<f32>().unwrap();
    let mut ids: Vec<usize> = (0..total).collect();
    ids.sort_by(|&a, &b| order[a].total_cmp(&order[b]));
    let mut dealt = ids.into_iter();
    (blocks.iter().map(|&n| dealt.by_ref().take(n).collect()).collect(), total)
}

fn assert_close(what: &str, dtype: DType, got: &Tensor, want: &Tensor) {
    let flat = |x: &Tensor| {
        x.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let (got, want) = (flat(got), flat(want));
    assert_eq!(got.len(), want.len(), "{what}: sizes differ");
    let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    let scale = want.iter().map(|x| x.abs()).fold(0.0, f32::max);
    let limit = if dtype == DType::F32 { 1e-4 } else { 2e-2 * scale.max(1.0) };
    assert!(diff <= limit, "{what} ({dtype:?}): differs by {diff} (limit {limit}, output scale {scale})");
}

/// Inputs of the gated delta rule for `b` rows of `t` tokens; q, k, v are cut from one
/// `[B, T, 2·Hk·Dk + Hv·Dv]` tensor as the model cuts them from its conv output.
struct DeltaInputs {
    mixed: Tensor,
    a: Tensor,
    gate: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    heads: (usize, usize, usize, usize),
}

impl DeltaInputs {
    fn new(b: usize, t: usize, (hk, hv, dk, dv): (usize, usize, usize, usize), dtype: DType) -> Self {
        let f = |x: Tensor| x.to_dtype(dtype).unwrap();
        Self {
            mixed: f(values(&[b, t, 2 * hk * dk + hv * dv], 1.0, 1)),
            a: f(values(&[b, t, hv], 2.0, 4)),
            gate: f(values(&[b, t, hv], 2.0, 5)),
            a_log: values(&[hv], 1.0, 6),
            dt_bias: values(&[hv], 1.0, 7),
            state: values(&[b, hv, dv, dk], 0.5, 8),
            heads: (hk, hv, dk, dv),
        }
    }

    /// Runs tokens `from..from + len` from `state` on `dev`.
    fn run(&self, dev: &Device, from: usize, len: usize, state: &Tensor) -> (Tensor, Tensor) {
        self.with(dev, from, len, |inputs, gating| gated_delta_rule(inputs, gating, &state.to_device(dev).unwrap()).unwrap())
    }

    /// `f` of the recurrence's inputs for tokens `from..from + len` on `dev`.
    fn with<R>(&self, dev: &Device, from: usize, len: usize, f: impl FnOnce(&Inputs, &Gating) -> R) -> R {
        let (hk, hv, dk, dv) = self.heads;
        let on = |x: &Tensor| x.to_device(dev).unwrap();
        let mixed = on(&self.mixed).narrow(1, from, len).unwrap();
        let (b, t, _) = mixed.dims3().unwrap();
        let q = mixed.narrow(2, 0, hk * dk).unwrap().reshape((b, t, hk, dk)).unwrap();
        let k = mixed.narrow(2, hk * dk, hk * dk).unwrap().reshape((b, t, hk, dk)).unwrap();
        let v = mixed.narrow(2, 2 * hk * dk, hv * dv).unwrap().reshape((b, t, hv, dv)).unwrap();
        // a and the gate logits as the model has them: two narrows of one projection output.
        let gates = Tensor::cat(&[&self.a, &self.gate], 2).unwrap();
        let cut = |at: usize| on(&gates).narrow(1, from, len).unwrap().narrow(2, at, hv).unwrap();
        let (a_log, dt_bias) = (on(&self.a_log), on(&self.dt_bias));
        let gating = Gating { a_log: &a_log, dt_bias: &dt_bias };
        f(&Inputs { q: &q, k: &k, v: &v, a: &cut(0), b: &cut(hv) }, &gating)
    }
}

#[test]
fn gated_delta_rule_on_gpu_matches_cpu() {
    let gpu = gpu();
    // Step by step (a decode step, a verify block, f32 at any length: the step kernel) and, for
    // 16-bit inputs with Qwen3.5's 128-wide heads (keys grouped), by chunks on tensor cores:
    // exactly one chunk, three with the last padded, and eleven carrying the state further.
    for heads in [(2, 4, 32, 16), (1, 2, 128, 128)] {
        for (b, t) in [(1, 1), (2, 1), (2, 7), (1, 64), (2, 150), (1, 700)] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let inputs = DeltaInputs::new(b, t, heads, dtype);
                let chunked = inputs.with(&gpu, 0, t, |inputs, _| on_tensor_cores(inputs).unwrap());
                let want_chunked = dtype != DType::F32 && heads.2 == 128 && t >= 64;
                assert_eq!(chunked, want_chunked, "{dtype:?}, heads {heads:?}, {t} tokens: chunked path taken");
                // The state f32, or stored in bf16: rounded after every token step by step (as
                // on the CPU), once per call by chunks (the CPU's f32 run rounded at its end); a
                // tie may round the other way, so held to the bf16 limits.
                for stored in [DType::F32, DType::BF16] {
                    let state = inputs.state.to_dtype(stored).unwrap();
                    let (want_out, want_state) = match stored == DType::BF16 && want_chunked {
                        true => {
                            let (out, state) = inputs.run(&Device::Cpu, 0, t, &inputs.state);
                            (out, state.to_dtype(DType::BF16).unwrap())
                        }
                        false => inputs.run(&Device::Cpu, 0, t, &state),
                    };
                    let (out, new_state) = inputs.run(&gpu, 0, t, &state);
                    assert_eq!(new_state.dtype(), stored);
                    let what = format!("gated delta, heads {heads:?}, {b} rows of {t} tokens, {stored:?} state");
                    let limits = if stored == DType::BF16 { DType::BF16 } else { dtype };
                    assert_close(&format!("{what}: output"), limits, &out, &want_out);
                    assert_close(&format!("{what}: state"), limits, &new_state, &want_state);
                }
            }
        }
    }
}

/// What speculative rollback relies on: a verify block of several tokens leaves, bit for bit,
/// the outputs and state of decoding its tokens one at a time (an f32 state, or a bf16 one).
#[test]
fn gated_delta_steps_on_gpu_do_not_depend_on_block_length() {
    let gpu = gpu();
    let inputs = DeltaInputs::new(3, 6, (2, 4, 128, 128), DType::BF16);
    for stored in [DType::F32, DType::BF16] {
        let start = inputs.state.to_dtype(stored).unwrap();
        let (block_out, block_state) = inputs.run(&gpu, 0, 6, &start);
        let mut state = start.to_device(&gpu).unwrap();
        for t in 0..6 {
            let (out, next) = inputs.run(&gpu, t, 1, &state);
            let want = block_out.narrow(1, t, 1).unwrap();
            assert_eq!(diff_bits(&out, &want), 0, "output of token {t} alone differs from the block's ({stored:?} state)");
            state = next;
        }
        assert_eq!(diff_bits(&state, &block_state), 0, "state after single steps differs from the block's ({stored:?})");
    }
}

/// A recorded decode step over a state pool: the in-place conv step and delta rule read and write
/// each row's slot, give the fresh-output kernels' bits, skip a padding row (slot -1) and leave
/// every other slot as it was.
#[test]
fn in_place_steps_over_pool_slots_match_fresh_outputs() {
    let gpu = gpu();
    let on = |x: &Tensor| x.to_device(&gpu).unwrap();
    let slots = [4i32, 1, -1, 2];
    let slot_tensor = Tensor::new(&slots[..], &gpu).unwrap();
    let real = [0usize, 1, 3];
    // Rows of `fresh` at their slots of a 6-slot pool whose other slots hold `fill`.
    let pool_of = |fresh: &Tensor, fill: f32| {
        let mut dims = fresh.dims().to_vec();
        dims[0] = 6;
        let pool = (Tensor::ones(dims, fresh.dtype(), &gpu).unwrap() * fill as f64).unwrap();
        for &r in &real {
            pool.slice_set(&on(fresh).narrow(0, r, 1).unwrap(), 0, slots[r] as usize).unwrap();
        }
        pool
    };
    let check = |what: &str, pool: &Tensor, want: &Tensor, fill: f32| {
        for (slot, row) in [(4, Some(0)), (1, Some(1)), (2, Some(3)), (0, None), (3, None), (5, None)] {
            let got = pool.narrow(0, slot, 1).unwrap();
            match row {
                Some(r) => assert_eq!(diff_bits(&got, &want.narrow(0, r, 1).unwrap()), 0, "{what}: slot {slot}"),
                None => {
                    let untouched = (got.ones_like().unwrap() * fill as f64).unwrap();
                    assert_eq!(diff_bits(&got, &untouched), 0, "{what}: slot {slot} held by no row was written");
                }
            }
        }
    };
    for dtype in [DType::F32, DType::BF16] {
        let inputs = DeltaInputs::new(4, 1, (2, 4, 128, 128), dtype);
        for stored in [DType::F32, DType::BF16] {
            let state = inputs.state.to_dtype(stored).unwrap();
            let (want_out, want_state) = inputs.run(&gpu, 0, 1, &state);
            let pool = pool_of(&state, 9.0);
            let out = inputs.with(&gpu, 0, 1, |i, g| gated_delta_rule_in_place(i, g, &pool, Some(&slot_tensor)).unwrap());
            for &r in &real {
                let (got, want) = (out.narrow(0, r, 1).unwrap(), want_out.narrow(0, r, 1).unwrap());
                assert_eq!(diff_bits(&got, &want), 0, "delta rule output of row {r} ({dtype:?}, {stored:?} state)");
            }
            check(&format!("delta rule state ({dtype:?}, {stored:?} state)"), &pool, &want_state, 9.0);
        }

        let (c, kernel) = (48, 4);
        let x = values(&[4, 1, c], 1.0, 21).to_dtype(dtype).unwrap();
        let state = values(&[4, kernel - 1, c], 1.0, 22).to_dtype(dtype).unwrap();
        let w = values(&[c, kernel], 0.5, 23);
        let (want_y, want_window) = causal_conv1d_silu(&on(&x), &on(&state), &on(&w)).unwrap();
        let pool = pool_of(&state, 7.0);
        let y = causal_conv1d_silu_step_in_place(&on(&x), &pool, &on(&w), Some(&slot_tensor)).unwrap();
        for &r in &real {
            assert_eq!(diff_bits(&y.narrow(0, r, 1).unwrap(), &want_y.narrow(0, r, 1).unwrap()), 0, "conv output of row {r}");
        }
        check(&format!("conv window ({dtype:?})"), &pool, &want_window, 7.0);
    }
}

/// How many elements differ in their bits.
fn diff_bits(a: &Tensor, b: &Tensor) -> usize {
    let bits = |x: &Tensor| {
        x.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    bits(a).iter().zip(bits(b)).filter(|(x, y)| x.to_bits() != y.to_bits()).count()
}

#[test]
fn causal_conv1d_on_gpu_matches_cpu() {
    let gpu = gpu();
    let b = 2;
    // A decode step, windows shorter than the state (the new state mixes old state and input),
    // within one thread's run of tokens and across runs (the first, one inside the window, the
    // last); the model keeps its conv weight in f32. The model's 4 taps have their own
    // instantiation of the kernel, other widths the general one; 300 channels take two blocks
    // of threads, the second partly. One token at every width from 2 to 8 taps in f32: the
    // in-place step must give the window kernel's bits (what a recorded decode step relies on).
    let one_token = (2..=8).map(|kernel| (1, DType::F32, DType::F32, kernel, 48));
    for (t, dtype, w_dtype, kernel, c) in [
        (1, DType::BF16, DType::F32, 4, 48),
        (2, DType::F32, DType::F32, 4, 48),
        (5, DType::F32, DType::F32, 4, 48),
        (5, DType::BF16, DType::BF16, 4, 48),
        (40, DType::F32, DType::F32, 4, 48),
        (40, DType::BF16, DType::F32, 4, 48),
        (40, DType::BF16, DType::F32, 4, 300),
        (2, DType::BF16, DType::F32, 6, 48),
        (40, DType::BF16, DType::F32, 3, 48),
        (40, DType::F32, DType::F32, 7, 300),
    ]
    .into_iter()
    .chain(one_token)
    {
        // The input as a narrow of a wider projection output, as the model passes it.
        let x = values(&[b, t, c + 8], 1.0, 11).to_dtype(dtype).unwrap().narrow(2, 0, c).unwrap();
        let state = values(&[b, kernel - 1, c], 1.0, 12).to_dtype(dtype).unwrap();
        let w = values(&[c, kernel], 0.5, 13).to_dtype(w_dtype).unwrap();
        let (want_y, want_state) = causal_conv1d_silu(&x, &state, &w).unwrap();
        let on = |x: &Tensor| x.to_device(&gpu).unwrap();
        let (y, new_state) = causal_conv1d_silu(&on(&x), &on(&state), &on(&w)).unwrap();
        assert_close("conv1d output", dtype, &y, &want_y);
        assert_close("conv1d state", dtype, &new_state, &want_state);
        if t == 1 {
            // The in-place step of a recorded decode step: the same bits as the fresh-output
            // kernel, the window updated where it lies.
            let window = on(&state).copy().unwrap();
            let stepped = causal_conv1d_silu_step_in_place(&on(&x), &window, &on(&w), None).unwrap();
            let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(
                bits(&stepped) == bits(&y) && bits(&window) == bits(&new_state),
                "in-place conv step differs ({kernel} taps, {dtype:?})"
            );
        }
    }
}

#[test]
fn causal_attention_on_gpu_matches_cpu() {
    let gpu = gpu();
    let (hq, hkv, d) = (8, 2, 64);
    // Decode (one query), a verify block and a prefill block; full and sliding-window.
    // A decode step, a verify block and a prompt block, short and over several splits of keys.
    for (t, l) in [(1, 37), (5, 40), (96, 96), (3, 1300), (40, 1100)] {
        for scoring in [Scoring::scaled(0.125), Scoring { scale: 0.125, window: Some(16) }] {
            for dtype in [DType::F32, DType::BF16] {
                let q = values(&[hq, t, d], 1.0, 21).to_dtype(dtype).unwrap();
                let k = values(&[hkv, l, d], 1.0, 22).to_dtype(dtype).unwrap();
                let v = values(&[hkv, l, d], 1.0, 23).to_dtype(dtype).unwrap();
                let want = causal_attention(&q, &k, &v, scoring).unwrap();
                let on = |x: &Tensor| x.to_device(&gpu).unwrap();
                let got = causal_attention(&on(&q), &on(&k), &on(&v), scoring).unwrap();
                assert_close(&format!("attention t={t} l={l} {scoring:?}"), dtype, &got, &want);
            }
        }
    }
}

/// The flash kernels against attention in f32 over the same (rounded) inputs: every head width
/// they take, bf16 and f16, causal (with a cached prefix, a sliding window, grouped queries) and
/// not (a vision tower's), query counts off the 64-query blocks, keys and values read through
/// strided views of longer buffers. The limit is tight enough that one key seen or missed shows
/// (it moves an output by about a value over the keys seen): the kernels round only the
/// probabilities and the output to the dtype.
#[test]
fn flash_attention_on_gpu_matches_f32_attention() {
    let gpu = gpu();
    let on = |x: &Tensor, dtype: DType| x.to_dtype(dtype).unwrap().to_device(&gpu).unwrap();
    let rounded = |x: &Tensor, dtype: DType| x.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
    let check = |what: String, got: &Tensor, want: &Tensor| {
        let flat = |x: &Tensor| {
            x.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        let (got, want) = (flat(got), flat(want));
        let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(diff <= 4e-3, "{what}: differs from f32 attention by {diff}");
    };
    for d in [64, 128, 256] {
        let scale = 2.0 / (d as f64).sqrt();
        for dtype in [DType::BF16, DType::F16] {
            // Causal: (queries, keys) with the queries the last positions; capacity past the keys.
            for (t, l, window) in [(65, 65, None), (130, 300, None), (200, 200, Some(48)), (77, 500, Some(100))] {
                let (hq, hkv, capacity) = (8, 2, l + 24);
                let q = values(&[1, hq, t, d], 1.0, 31);
                let k_buf = values(&[1, hkv, capacity, d], 1.0, 32);
                let v_buf = values(&[1, hkv, capacity, d], 1.0, 33);
                let scoring = Scoring { scale, window };
                let (k, v) = (k_buf.narrow(2, 0, l).unwrap(), v_buf.narrow(2, 0, l).unwrap());
                let want = causal_attention(
                    &rounded(&q, dtype).squeeze(0).unwrap(),
                    &rounded(&k, dtype).squeeze(0).unwrap(),
                    &rounded(&v, dtype).squeeze(0).unwrap(),
                    scoring,
                )
                .unwrap();
                let (k, v) = (on(&k_buf, dtype).narrow(2, 0, l).unwrap(), on(&v_buf, dtype).narrow(2, 0, l).unwrap());
                let got = flash_attention(&on(&q, dtype), &k, &v, scoring, true).unwrap().expect("the flash kernel takes these");
                check(format!("causal d={d} {dtype:?} t={t} l={l} window={window:?}"), &got.squeeze(0).unwrap(), &want);
            }
            // Every query sees every key, two images in a batch.
            for n in [64, 100, 333] {
                let (q, k, v) = (values(&[2, 4, n, d], 1.0, 34), values(&[2, 4, n, d], 1.0, 35), values(&[2, 4, n, d], 1.0, 36));
                let want = full_attention(&rounded(&q, dtype), &rounded(&k, dtype), &rounded(&v, dtype), scale).unwrap();
                let got = flash_attention(&on(&q, dtype), &on(&k, dtype), &on(&v, dtype), Scoring::scaled(scale), false)
                    .unwrap()
                    .expect("the flash kernel takes these");
                check(format!("full d={d} {dtype:?} n={n}"), &got, &want);
                let through = full_attention(&on(&q, dtype), &on(&k, dtype), &on(&v, dtype), scale).unwrap();
                assert_eq!(diff_bits(&through, &got), 0, "full_attention takes the flash kernel");
            }
        }
    }
}

#[test]
fn matmul_t_on_gpu_matches_cpu() {
    let gpu = gpu();
    // Decode batches through strata's streaming kernel (one with the widest batch it takes and
    // a long row; 4 warps per weight row for the first two, 2 for the next two, whose odd row
    // counts leave a partial last block), a row length it leaves to cuBLAS in bf16 (100 is not a whole
    // number of 16-byte pieces; f32 streams it), and a prefill block.
    let shapes = [(1, 256, 384), (4, 2560, 300), (2, 512, 4099), (3, 64, 9001), (7, 512, 128), (3, 100, 50), (130, 256, 96)];
    for (m, k, n) in shapes {
        for dtype in [DType::F32, DType::BF16] {
            let x = values(&[m, k], 1.0, 31).to_dtype(dtype).unwrap();
            let w = values(&[n, k], 0.1, 32).to_dtype(dtype).unwrap();
            let want = matmul_t(&x, &w).unwrap();
            let got = matmul_t(&x.to_device(&gpu).unwrap(), &w.to_device(&gpu).unwrap()).unwrap();
            assert_close(&format!("matmul {m}x{k}x{n}"), dtype, &got, &want);
        }
    }
}

/// A mixture of experts on the GPU against the host: each token's route (the same experts, the
/// weights within float rounding; the pairs grouped by expert), each pair's gathered matmul
/// bit for bit the streaming matmul of its token and expert alone, and the weighted sum the
/// bits of the tensor-op twin on the same pairs.
#[test]
fn experts_on_gpu_route_gather_and_sum_as_the_host() {
    let gpu = gpu();
    let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // (tokens, experts, k, hidden, inter): the 35B-A3B's routing (8 of 256) and width, the
    // widest route the kernel takes, and a batch of decode rows; both splits of the streaming
    // kernel on each projection (below 2048 rows 4 warps a row, from there 2).
    for (n, count, k, hidden, inter) in [(1, 256, 8, 2048, 64), (3, 1000, 32, 64, 96), (37, 12, 3, 256, 1024)] {
        for dtype in [DType::F32, DType::BF16] {
            let logits = values(&[n, count], 4.0, 51).to_dtype(dtype).unwrap();
            let host: Vec<Vec<(usize, f32)>> =
                logits.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap().iter().map(|l| route(l, k)).collect();
            let routes = Routes::on_device(&logits.to_device(&gpu).unwrap(), k).unwrap().expect("a GPU routes on the device");
            let what = format!("{n} tokens, {k} of {count} experts, {dtype:?}");
            let experts = routes.experts.to_vec1::<u32>().unwrap();
            let weights = routes.weights.to_vec1::<f32>().unwrap();
            for (t, want) in host.iter().enumerate() {
                for (s, &(e, w)) in want.iter().enumerate() {
                    let p = t * k + s;
                    assert_eq!(experts[p] as usize, e, "{what}: token {t} pick {s}");
                    assert!((weights[p] - w).abs() <= 1e-6, "{what}: token {t} weight {} against {w}", weights[p]);
                }
            }

            let x = values(&[n, hidden], 1.0, 52).to_dtype(dtype).unwrap().to_device(&gpu).unwrap();
            let gate_up = values(&[count, 2 * inter, hidden], 0.1, 53).to_dtype(dtype).unwrap().to_device(&gpu).unwrap();
            let down = values(&[count, hidden, inter], 0.1, 54).to_dtype(dtype).unwrap().to_device(&gpu).unwrap();
            let h = matmul_gathered(&x, &gate_up, &routes, k).unwrap();
            let act = silu_mul(&h.narrow(1, 0, inter).unwrap(), &h.narrow(1, inter, inter).unwrap()).unwrap();
            let y = matmul_gathered(&act, &down, &routes, 1).unwrap();
            for (p, &e) in experts.iter().enumerate() {
                let alone = matmul_t(&x.narrow(0, p / k, 1).unwrap(), &gate_up.get(e as usize).unwrap()).unwrap();
                assert!(bits(&alone) == bits(&h.narrow(0, p, 1).unwrap()), "{what}: pair {p}'s gate-up");
                let alone = matmul_t(&act.narrow(0, p, 1).unwrap(), &down.get(e as usize).unwrap()).unwrap();
                assert!(bits(&alone) == bits(&y.narrow(0, p, 1).unwrap()), "{what}: pair {p}'s down");
            }
            // The sum against its twin, on the device's routes moved to the host.
            let on_host: Vec<Vec<(usize, f32)>> =
                (0..n).map(|t| (0..k).map(|s| (experts[t * k + s] as usize, weights[t * k + s])).collect()).collect();
            let twin = combine(&y.to_device(&Device::Cpu).unwrap(), &Routes::from_host(&on_host, count, &Device::Cpu).unwrap());
            assert!(bits(&combine(&y, &routes).unwrap()) == bits(&twin.unwrap()), "{what}: weighted sums");
        }
    }
}

#[test]
fn streaming_matmul_gives_each_row_the_same_bits_alone_or_batched() {
    let gpu = gpu();
    // Two warps per weight row (the first three, the last two with a partial last block) and
    // four (below 2048 rows); every row count the kernel takes against each row alone.
    for (k, n) in [(2560, 2560), (512, 4099), (64, 9001), (1024, 1500)] {
        let x = values(&[4, k], 1.0, 41).to_dtype(DType::BF16).unwrap().to_device(&gpu).unwrap();
        let w = values(&[n, k], 0.1, 42).to_dtype(DType::BF16).unwrap().to_device(&gpu).unwrap();
        let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let batched = matmul_t(&x, &w).unwrap();
        // The same rows as a narrow of a wider tensor (as a joined projection's outputs are).
        let wide = Tensor::cat(&[&x, &x], 1).unwrap().narrow(1, k, k).unwrap();
        assert!(bits(&matmul_t(&wide, &w).unwrap()) == bits(&batched), "{k}x{n}: strided rows differ");
        for r in 0..4 {
            let alone = matmul_t(&x.narrow(0, r, 1).unwrap(), &w).unwrap();
            assert!(bits(&alone) == bits(&batched.narrow(0, r, 1).unwrap()), "{k}x{n}: row {r} differs alone");
        }
        for m in 2..4 {
            let fewer = matmul_t(&x.narrow(0, 0, m).unwrap(), &w).unwrap();
            assert!(bits(&fewer) == bits(&batched.narrow(0, 0, m).unwrap()), "{k}x{n}: {m} rows differ from 4");
        }
    }
}

#[test]
fn norms_and_swiglu_on_gpu_match_cpu() {
    let gpu = gpu();
    let on = |x: &Tensor| x.to_device(&gpu).unwrap();
    // Decode rows and a prefill block; widths below, at and above one warp's 32 lanes, and
    // widths whose rows are not all 16-byte aligned (SwiGLU's kernel then loads element-wise).
    // The per-head gated norm takes 1 to 8 items per lane (24 .. 256 wide); at 2560 it falls
    // back to tensor ops.
    for (rows, d) in [(1, 2560), (3, 128), (70, 24), (5, 100), (4, 37), (6, 70), (3, 200), (5, 256)] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let what = |op: &str| format!("{op}, {rows} rows of {d}");
            let x = values(&[rows, d], 2.0, 41).to_dtype(dtype).unwrap();
            let h = values(&[rows, d], 2.0, 42).to_dtype(dtype).unwrap();
            let scale = values(&[d], 1.5, 43);
            let got = rms_norm(&on(&x), &on(&scale), 1e-6).unwrap();
            assert_close(&what("rms_norm"), dtype, &got, &rms_norm(&x, &scale, 1e-6).unwrap());

            let (sum, normed) = add_rms_norm(&on(&x), &on(&h), &on(&scale), 1e-6).unwrap();
            let (want_sum, want_normed) = add_rms_norm(&x, &h, &scale, 1e-6).unwrap();
            assert_close(&what("add_rms_norm sum"), dtype, &sum, &want_sum);
            assert_close(&what("add_rms_norm"), dtype, &normed, &want_normed);

            // LayerNorm (a vision tower's): rows off zero, so the mean matters; parameters in
            // the rows' dtype.
            let shifted = (&x + 3.0).unwrap();
            let (weight, bias) = (values(&[d], 1.5, 47).to_dtype(dtype).unwrap(), values(&[d], 0.5, 48).to_dtype(dtype).unwrap());
            let got = layer_norm(&on(&shifted), &on(&weight), &on(&bias), 1e-6).unwrap();
            assert_close(&what("layer_norm"), dtype, &got, &layer_norm(&shifted, &weight, &bias, 1e-6).unwrap());
            let (sum, normed) = add_layer_norm(&on(&shifted), &on(&h), &on(&weight), &on(&bias), 1e-6).unwrap();
            let (want_sum, want_normed) = add_layer_norm(&shifted, &h, &weight, &bias, 1e-6).unwrap();
            assert_close(&what("add_layer_norm sum"), dtype, &sum, &want_sum);
            assert_close(&what("add_layer_norm"), dtype, &normed, &want_normed);
            for act in [Activation::Identity, Activation::GeluTanh, Activation::GeluErf] {
                let got = add_bias_act(&on(&x), &on(&bias), act).unwrap();
                assert_close(&what(&format!("add_bias_act {act:?}")), dtype, &got, &add_bias_act(&x, &bias, act).unwrap());
            }

            let recurrent_out = values(&[rows, d], 3.0, 44);
            let got = gated_rms_norm(&on(&recurrent_out), &on(&h), &on(&scale), 1e-6).unwrap();
            let want = gated_rms_norm(&recurrent_out, &h, &scale, 1e-6).unwrap();
            assert_close(&what("gated_rms_norm"), dtype, &got, &want);
            // Per head: x [rows, 3, D] against a gate cut as [rows, 3·D] from a wider output.
            let heads_out = values(&[rows, 3, d], 3.0, 45);
            let wide = values(&[rows, 3 * d + 5], 2.0, 46).to_dtype(dtype).unwrap();
            let gate = |w: &Tensor| w.narrow(1, 5, 3 * d).unwrap();
            let got = gated_rms_norm(&on(&heads_out), &gate(&on(&wide)), &on(&scale), 1e-6).unwrap();
            let want = gated_rms_norm(&heads_out, &gate(&wide), &scale, 1e-6).unwrap();
            assert_close(&what("gated_rms_norm per head"), dtype, &got, &want);

            assert_close(&what("silu_mul"), dtype, &silu_mul(&on(&x), &on(&h)).unwrap(), &silu_mul(&x, &h).unwrap());
            // The two halves of one [gate | up] output.
            let halves = |w: &Tensor| (w.narrow(1, 0, d).unwrap(), w.narrow(1, d, d).unwrap());
            let packed = Tensor::cat(&[&x, &h], 1).unwrap();
            let ((g, u), (g_gpu, u_gpu)) = (halves(&packed), halves(&on(&packed)));
            assert_close(&what("silu_mul of halves"), dtype, &silu_mul(&g_gpu, &u_gpu).unwrap(), &silu_mul(&g, &u).unwrap());
        }
    }
}

#[test]
fn norm_rope_on_gpu_matches_cpu() {
    let gpu = gpu();
    let on = |x: &Tensor| x.to_device(&gpu).unwrap();
    // q is cut per head from q_proj's [q | gate] (strided heads); a partial rotary of 16 of 64
    // dims (Qwen3.5's quarter) and a full one.
    for (b, t, h, d, half) in [(1, 1, 4, 64, 8), (2, 5, 3, 64, 8), (2, 3, 2, 32, 16)] {
        for dtype in [DType::F32, DType::BF16] {
            let qg = values(&[b, t, h, 2 * d], 2.0, 51).to_dtype(dtype).unwrap();
            let scale = values(&[d], 1.5, 52);
            let (cos, sin) = (values(&[b, 1, t, half], 1.0, 53), values(&[b, 1, t, half], 1.0, 54));
            let x = qg.narrow(3, 0, d).unwrap();
            let want = norm_rope(&x, &scale, 1e-6, &cos, &sin).unwrap();
            let got = norm_rope(&on(&qg).narrow(3, 0, d).unwrap(), &on(&scale), 1e-6, &on(&cos), &on(&sin)).unwrap();
            assert_close(&format!("norm_rope {b}x{t}x{h}x{d} half {half}"), dtype, &got, &want);
        }
    }
}

/// A batch's KV append and attention, rows of different lengths in buffers with spare
/// capacity (as the KV store keeps them): one kernel each on the GPU, per row on the CPU.
/// The f32 rotation (a vision tower's) is the CPU's arithmetic: the same bits, read through
/// strided views (queries and keys cut from one projection).
#[test]
fn rope_f32_on_gpu_is_the_cpus_bits() {
    let gpu = gpu();
    let on = |x: &Tensor| x.to_device(&gpu).unwrap();
    for (b, t, h, d, half) in [(1, 37, 4, 64, 32), (2, 5, 3, 64, 16)] {
        for dtype in [DType::F32, DType::BF16] {
            let qkv = values(&[b, t, 3, h, d], 4.0, 55).to_dtype(dtype).unwrap();
            let (cos, sin) = (values(&[b, 1, t, half], 1.0, 56), values(&[b, 1, t, half], 1.0, 57));
            let x = |qkv: &Tensor| qkv.narrow(2, 1, 1).unwrap().squeeze(2).unwrap();
            let want = rope_f32(&x(&qkv), &cos, &sin).unwrap();
            let got = rope_f32(&x(&on(&qkv)), &on(&cos), &on(&sin)).unwrap();
            assert_eq!(diff_bits(&got, &want), 0, "rope_f32 {b}x{t}x{h}x{d} half {half} {dtype:?}");
        }
    }
}

#[test]
fn batched_kv_append_and_attention_on_gpu_match_cpu() {
    let gpu = gpu();
    let (hq, hkv, d) = (8, 2, 64);
    // Three rows in one split under a window, and one row (the batch-1 decode) whose whole
    // history spans two splits of 512 keys.
    let cases = [(vec![5, 30, 0], 48, Some(20)), (vec![600], 640, None)];
    let runs = [(1, DType::BF16), (4, DType::F32), (4, DType::BF16), (1, DType::F16)];
    for ((lens, cap, window), (t, dtype)) in cases.iter().flat_map(|c| runs.map(|r| (c, r))) {
        let (lens, cap, scoring) = (lens.as_slice(), *cap, Scoring { scale: 0.125, window: *window });
        let run = |dev: &Device| {
            let buffers: Vec<(Tensor, Tensor)> = (0..lens.len() as u64)
                .map(|r| {
                    let buf = |seed| values(&[hkv, cap, d], 1.0, seed).to_dtype(dtype).unwrap().to_device(dev).unwrap();
                    (buf(60 + r), buf(70 + r))
                })
                .collect();
            let new_k = values(&[lens.len(), hkv, t, d], 1.0, 80).to_dtype(dtype).unwrap().to_device(dev).unwrap();
            // Values arrive transposed from [B, T, Hkv, D], as the model hands them over.
            let new_v = values(&[lens.len(), t, hkv, d], 1.0, 81).to_dtype(dtype).unwrap().to_device(dev).unwrap();
            let new_v = new_v.transpose(1, 2).unwrap();
            write_rows(&new_k, &buffers.iter().zip(lens).map(|((k, _), &l)| (k, l)).collect::<Vec<_>>()).unwrap();
            write_rows(&new_v, &buffers.iter().zip(lens).map(|((_, v), &l)| (v, l)).collect::<Vec<_>>()).unwrap();
            let history: Vec<(Tensor, Tensor)> = buffers
                .iter()
                .zip(lens)
                .map(|((k, v), l)| (k.narrow(1, 0, l + t).unwrap(), v.narrow(1, 0, l + t).unwrap()))
                .collect();
            let q = values(&[lens.len(), hq, t, d], 1.0, 82).to_dtype(dtype).unwrap().to_device(dev).unwrap();
            let out = causal_attention_rows(&q, &history, scoring).unwrap();
            // The output gate cut from a wider per-head [q | gate] projection, as Qwen3.5 cuts it.
            let wide = values(&[lens.len(), t, hq, 2 * d], 3.0, 83).to_dtype(dtype).unwrap().to_device(dev).unwrap();
            let gate = wide.narrow(3, d, d).unwrap();
            let gated = gated_attention_rows(&q, &history, scoring, &gate).unwrap();
            (buffers, out, gate, gated)
        };
        let (want_buffers, want, _, want_gated) = run(&Device::Cpu);
        let (buffers, got, gate, gated) = run(&gpu);
        for (r, ((k, v), (wk, wv))) in buffers.iter().zip(&want_buffers).enumerate() {
            assert_close(&format!("keys of row {r} after the append, t={t}, lens {lens:?}"), dtype, k, wk);
            assert_close(&format!("values of row {r} after the append, t={t}, lens {lens:?}"), dtype, v, wv);
        }
        assert_close(&format!("batched attention, t={t}, lens {lens:?}"), dtype, &got, &want);
        assert_eq!(gated.dims(), [lens.len(), t, hq * d]);
        assert_close(&format!("batched gated attention, t={t}, lens {lens:?}"), dtype, &gated, &want_gated);
        // The gate in the combining kernel gives the bits of the separate sigmoid and product.
        let separate = sigmoid_gate(&got, &gate).unwrap();
        let (gated, separate) = (gated.to_dtype(DType::F32).unwrap(), separate.to_dtype(DType::F32).unwrap());
        assert_eq!(diff_bits(&gated, &separate), 0, "gate in the combine kernel, {dtype:?}, t={t}, lens {lens:?}");
    }
}

/// Greedy ids on the device: the first maximum of each row, as the CPU sampler picks it, also
/// when rounding to bf16 has made ties among the top logits, and within structured output's
/// token masks.
#[test]
fn argmax_rows_on_gpu_takes_the_first_maximum() {
    let gpu = gpu();
    let (rows, vocab) = (7, 248_320);
    let logits = values(&[rows, vocab], 8.0, 91).to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
    let mut data = logits.to_vec2::<f32>().unwrap();
    // Row 1: the maximum twice, in different blocks; row 2: a NaN before its maximum; row 3: all
    // equal; row 4: all NaN; row 5: a maximum of 0 as -0.0 before +0.0 (equal, so the first).
    data[1][7] = 100.0;
    data[1][vocab - 3] = 100.0;
    data[2][0] = f32::NAN;
    data[2][vocab - 1] = 200.0;
    data[3].iter_mut().for_each(|x| *x = -1.0);
    data[4].iter_mut().for_each(|x| *x = f32::NAN);
    data[5].iter_mut().for_each(|x| *x = -1.0);
    (data[5][20], data[5][9000]) = (-0.0, 0.0);
    let want: Vec<u32> = data.iter().map(|row| first_max(row)).collect();
    assert_eq!(&want[1..6], &[7, vocab as u32 - 1, 0, 0, 20]);
    let logits = Tensor::new(data.clone(), &gpu).unwrap();
    assert_eq!(argmax_rows(&logits, &[]).unwrap(), want);

    // Masked (structured output): row 0 allows every third token, row 1 only the later of its
    // two maxima and a few others, row 2 nothing, row 6 a mask one word short (its last 32
    // tokens not allowed); rows 3-5 none.
    let words = vocab.div_ceil(32);
    let thirds: Vec<u32> = (0..words).map(|w| (0..32).filter(|b| (w * 32 + b) % 3 == 0).fold(0, |m, b| m | 1 << b)).collect();
    let mut later = vec![0u32; words];
    for t in [5, 7 + 32, vocab - 3, 100_000] {
        later[t / 32] |= 1 << (t % 32);
    }
    let nothing = vec![0u32; words];
    let short = vec![u32::MAX; words - 1];
    let masks = [Some(&thirds[..]), Some(&later[..]), Some(&nothing[..]), None, None, None, Some(&short[..])];
    let want: Vec<u32> = data.iter().zip(&masks).map(|(row, mask)| first_allowed_max(row, *mask)).collect();
    assert_eq!(want[1], vocab as u32 - 3);
    assert_eq!(want[2], 0);
    assert_eq!(argmax_rows(&logits, &masks).unwrap(), want);
}

/// Seeded draws on the GPU pick the CPU twin's token in every row: temperatures, top-k, top-p
/// and min-p alone and together, ties at each cut (bf16-rounded logits, a block of equal
/// maxima), masks, logit adjustments, and rows whose mask leaves no finite candidate.
#[test]
fn draws_on_gpu_pick_the_cpu_twins_token() {
    let gpu = gpu();
    let (rows, vocab) = (48, 248_320);
    let mut data =
        values(&[rows, vocab], 12.0, 17).to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    for (r, row) in data.iter_mut().enumerate() {
        // 30 equal maxima in a few rows: top-k 20 and small top-p cut inside the tie.
        if r % 4 == 1 {
            (0..30).for_each(|j| row[j * 7919 % vocab] = 20.0);
        }
        if r % 6 == 2 {
            row[r * 11] = f32::NEG_INFINITY;
            row[r * 13] = f32::NAN;
        }
    }
    let words = vocab.div_ceil(32);
    let thirds: Vec<u32> = (0..words).map(|w| (0..32).filter(|b| (w * 32 + b) % 3 == 0).fold(0, |m, b| m | 1 << b)).collect();
    let mut no_candidate = vec![0u32; words]; // row 2's -inf (22) and NaN (26) alone
    no_candidate[0] |= (1 << 22) | (1 << 26);
    let settings = [
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.7, 20, 0.95, 0.0),
        (1.0, 0, 0.9, 0.0),
        (0.6, 0, 1.0, 0.05),
        (1.3, 50, 1.0, 0.0),
        (0.05, 0, 0.5, 0.0),
        (1.0, 20, 0.8, 0.1),
        (2.0, 0, 0.999, 0.0),
        (1.0, 1, 1.0, 0.0),
    ];
    for position in [0u64, 1, 977] {
        let draws: Vec<Draw> = (0..rows)
            .map(|r| {
                let (temperature, top_k, top_p, min_p) = settings[r % settings.len()];
                Draw { temperature, top_k, top_p, min_p, seed: 1000 + r as u64 % 5, position }
            })
            .collect();
        let masks: Vec<Option<&[u32]>> = (0..rows)
            .map(|r| match r % 5 {
                3 => Some(&thirds[..]),
                _ if r == 2 => Some(&no_candidate[..]),
                _ => None,
            })
            .collect();
        let adjust: Vec<Adjust> = (0..rows as u32)
            .filter(|r| r % 3 == 0)
            .flat_map(|row| {
                (0..40).map(move |j| Adjust {
                    row,
                    token: j * 6133 % vocab as u32,
                    bias: (j % 5) as f32 - 2.0,
                    repetition: 1.0 + (j % 3) as f32 * 0.15,
                    subtract: (j % 4) as f32 * 0.4,
                })
            })
            .collect();
        let want = draw_rows(&Tensor::new(data.clone(), &Device::Cpu).unwrap(), &draws, &masks, &adjust).unwrap();
        let got = draw_rows(&Tensor::new(data.clone(), &gpu).unwrap(), &draws, &masks, &adjust).unwrap();
        assert_eq!(got, want, "position {position}");
        assert_eq!(want[2], 22, "a row without candidates takes its argmax, NaN never");
    }
}

/// A query's attention on the GPU is the same bits decoded alone, in a verify block, or batched
/// with rows of other lengths (keys are split at fixed positions, merged in order).
#[test]
fn attention_on_gpu_does_not_depend_on_block_or_batch() {
    let gpu = gpu();
    let (hq, hkv, d, t) = (8, 2, 128, 4);
    let scoring = Scoring::scaled(0.1);
    let on = |x: Tensor| x.to_dtype(DType::BF16).unwrap().to_device(&gpu).unwrap();
    let (long_k, long_v) = (on(values(&[hkv, 1300, d], 1.0, 95)), on(values(&[hkv, 1300, d], 1.0, 96)));
    let (short_k, short_v) = (on(values(&[hkv, 40, d], 1.0, 97)), on(values(&[hkv, 40, d], 1.0, 98)));
    let q = on(values(&[2, hq, t, d], 1.0, 99));
    let batched = causal_attention_rows(&q, &[(long_k.clone(), long_v.clone()), (short_k, short_v)], scoring).unwrap();
    let block = causal_attention(&q.get(0).unwrap(), &long_k, &long_v, scoring).unwrap();
    let f32 = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
    assert_eq!(diff_bits(&f32(&batched.get(0).unwrap()), &f32(&block)), 0, "batched differs from alone");
    for i in 0..t {
        let len = 1300 - t + i + 1;
        let (k, v) = (long_k.narrow(1, 0, len).unwrap(), long_v.narrow(1, 0, len).unwrap());
        let alone = causal_attention(&q.get(0).unwrap().narrow(1, i, 1).unwrap(), &k, &v, scoring).unwrap();
        assert_eq!(diff_bits(&f32(&alone), &f32(&block.narrow(1, i, 1).unwrap())), 0, "query {i} decoded alone differs");
    }
}

#[test]
fn decode_attention_over_long_histories_on_gpu_matches_cpu() {
    // Histories across several 512-key splits, lengths not multiples of the warps' key groups,
    // the 4B shape's head width; with and without a window.
    let gpu = gpu();
    let (hq, hkv, d) = (16, 4, 256);
    for (dtype, window) in [(DType::BF16, None), (DType::F32, Some(700))] {
        let run = |dev: &Device| {
            let history: Vec<(Tensor, Tensor)> = [1100usize, 517, 1]
                .iter()
                .enumerate()
                .map(|(r, &l)| {
                    let kv = |seed| values(&[hkv, l, d], 1.0, seed).to_dtype(dtype).unwrap().to_device(dev).unwrap();
                    (kv(90 + r as u64), kv(95 + r as u64))
                })
                .collect();
            let q = values(&[history.len(), hq, 1, d], 1.0, 99).to_dtype(dtype).unwrap().to_device(dev).unwrap();
            causal_attention_rows(&q, &history, Scoring { scale: 1.0 / 16.0, window }).unwrap()
        };
        assert_close(
            &format!("decode attention over long histories, {dtype:?}, window {window:?}"),
            dtype,
            &run(&gpu),
            &run(&Device::Cpu),
        );
    }
}

/// Paged KV — one pool shared by the rows through block tables in shuffled order — against rows
/// in their own buffers holding the same histories: the same append, only where the tables say,
/// and the same attention bit for bit, for decode steps and verify blocks, a row within its
/// first block, one just past a block boundary and one across two splits of 512 keys.
#[test]
fn paged_decode_attention_on_gpu_matches_contiguous() {
    let gpu = gpu();
    let (hq, hkv, d, cap) = (8, 2, 64, 720usize);
    // Each row's length before the step (the last row's verify block crosses a boundary of 16
    // and of 64 positions); the pool has a few blocks no table holds.
    let (past, spare) = ([0usize, 16, 702], 3);
    let flat = |x: &Tensor| {
        x.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let f32 = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
    let runs = [DType::F32, DType::BF16, DType::F16].into_iter().flat_map(|dtype| {
        [1, 16, 64].into_iter().flat_map(move |block_size| [1, 3].into_iter().map(move |t| (dtype, block_size, t)))
    });
    for (dtype, block_size, t) in runs {
        let lens: Vec<usize> = past.iter().map(|p| p + t).collect();
        let on_gpu = |x: Tensor| x.to_dtype(dtype).unwrap().to_device(&gpu).unwrap();
        // Block ids in an order of their own, dealt to the rows in turn; table entries past a
        // row's blocks are 0 (another row's block, or a spare one).
        let max_blocks = cap.div_ceil(block_size);
        let (tables, total) = deal_blocks(&lens, block_size, spare, 40);
        let pool_row = |r: usize, p: usize| tables[r][p / block_size] * block_size + p % block_size;
        // Per row, its keys and values [Hkv, cap, D]; the pools [rows, Hkv, D] start as other
        // values, with each row's history copied to its pool rows.
        let buffers: Vec<[Tensor; 2]> =
            (0..3).map(|r| [60, 70].map(|seed| values(&[hkv, cap, d], 1.0, seed + r).to_dtype(dtype).unwrap())).collect();
        let initial = [50, 51].map(|seed| flat(&values(&[total * block_size, hkv, d], 1.0, seed).to_dtype(dtype).unwrap()));
        let mut pools = initial.clone();
        for (side, pool) in pools.iter_mut().enumerate() {
            for (r, row) in buffers.iter().enumerate() {
                let data = flat(&row[side]);
                for (p, h) in (0..past[r]).flat_map(|p| (0..hkv).map(move |h| (p, h))) {
                    let at = (pool_row(r, p) * hkv + h) * d;
                    pool[at..at + d].copy_from_slice(&data[(h * cap + p) * d..][..d]);
                }
            }
        }
        let pools = pools.map(|data| on_gpu(Tensor::from_vec(data, (total * block_size, hkv, d), &Device::Cpu).unwrap()));
        let table_data: Vec<i32> =
            tables.iter().flat_map(|row| (0..max_blocks).map(|i| row.get(i).map_or(0, |&id| id as i32))).collect();
        let table = Tensor::from_vec(table_data, (3, max_blocks), &gpu).unwrap();
        let lens_t = Tensor::from_vec(lens.iter().map(|&l| l as i32).collect::<Vec<_>>(), 3, &gpu).unwrap();
        // The step's inputs, as in batched_kv_append_and_attention_on_gpu_match_cpu.
        let new_k = on_gpu(values(&[3, hkv, t, d], 1.0, 80));
        let new_v = on_gpu(values(&[3, t, hkv, d], 1.0, 81)).transpose(1, 2).unwrap();
        let q = on_gpu(values(&[3, hq, t, d], 1.0, 82));
        let gate = on_gpu(values(&[3, t, hq, 2 * d], 3.0, 83)).narrow(3, d, d).unwrap();
        let paged = PagedDecodeRows::new(&pools[0], &pools[1], block_size, &table).unwrap();
        for scoring in [Scoring::scaled(0.125), Scoring { scale: 0.125, window: Some(20) }] {
            let what = format!("{dtype:?}, block size {block_size}, t={t}, lens {lens:?}, {scoring:?}");
            let rows: Vec<(Tensor, Tensor)> =
                buffers.iter().map(|[k, v]| (k.to_device(&gpu).unwrap(), v.to_device(&gpu).unwrap())).collect();
            let want_gated =
                DecodeRows::new(&rows).unwrap().append_attend_gated(&q, &new_k, &new_v, &lens_t, scoring, &gate).unwrap();
            let history: Vec<(Tensor, Tensor)> =
                rows.iter().zip(&lens).map(|((k, v), &l)| (k.narrow(1, 0, l).unwrap(), v.narrow(1, 0, l).unwrap())).collect();
            let want = causal_attention_rows(&q, &history, scoring).unwrap();
            let gated = paged.append_attend_gated(&q, &new_k, &new_v, &lens_t, scoring, &gate).unwrap();
            // A second append of the same keys and values at the same positions changes nothing.
            let plain = paged.append_attend(&q, &new_k, &new_v, &lens_t, scoring).unwrap();
            assert_eq!(diff_bits(&f32(&gated), &f32(&want_gated)), 0, "paged gated attention, {what}");
            assert_eq!(diff_bits(&f32(&plain), &f32(&want)), 0, "paged attention, {what}");
            // The pools: the new positions hold the buffers' new keys and values, every other
            // pool row (history, rows past the lengths, spare blocks) is as it was.
            for (side, (pool, initial)) in pools.iter().zip(&initial).enumerate() {
                let (pool, mut expected) = (flat(pool), initial.clone());
                let mut written = vec![false; total * block_size];
                for (r, row) in rows.iter().enumerate() {
                    let data = flat(if side == 0 { &row.0 } else { &row.1 });
                    for (p, h) in (0..lens[r]).flat_map(|p| (0..hkv).map(move |h| (p, h))) {
                        let at = (pool_row(r, p) * hkv + h) * d;
                        expected[at..at + d].copy_from_slice(&data[(h * cap + p) * d..][..d]);
                        written[pool_row(r, p)] |= p >= past[r];
                    }
                }
                let differs = |row: usize| {
                    let at = row * hkv * d;
                    pool[at..at + hkv * d].iter().zip(&expected[at..at + hkv * d]).any(|(a, b)| a.to_bits() != b.to_bits())
                };
                let side = ["keys", "values"][side];
                let (new, old): (Vec<usize>, Vec<usize>) = (0..total * block_size).partition(|&row| written[row]);
                assert_eq!(new.len(), 3 * t, "{side}: pool rows written, {what}");
                assert!(!new.iter().any(|&row| differs(row)), "{side}: new positions in the pool, {what}");
                assert!(!old.iter().any(|&row| differs(row)), "{side}: pool rows not written changed, {what}");
            }
        }
        // What the pool cannot take: a block size that is not a power of two, pools that differ,
        // a step of another batch.
        assert!(PagedDecodeRows::new(&pools[0], &pools[1], 3, &table).is_err());
        assert!(PagedDecodeRows::new(&pools[0], &pools[1].narrow(1, 0, 1).unwrap(), block_size, &table).is_err());
        let two = |x: &Tensor| x.narrow(0, 0, 2).unwrap();
        assert!(paged.append_attend(&two(&q), &two(&new_k), &two(&new_v), &two(&lens_t), Scoring::scaled(0.125)).is_err());
    }
}

/// The grouped split kernels — a block for the query heads that share a KV head, which wide
/// batches take — give each query the bits of the plain kernel, a block per head, which a row
/// alone takes: over rows in their own buffers and over a paged pool (tables in shuffled order),
/// for groups of 4 (the 4B shape), 2 and 8 heads (two blocks per KV head) at each head width they
/// are compiled for, decode steps and verify blocks under a window, histories over up to three
/// splits of 512 keys. The wide batches make at least 400 plain blocks, past the two waves of an
/// H200's 132 multiprocessors from which the grouped kernels are taken; a row alone, at most 144.
#[test]
fn grouped_attention_on_gpu_gives_each_query_its_bits_alone() {
    let gpu = gpu();
    let f32 = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
    let (longest, block_size) = (1100usize, 16usize);
    for ((hq, hkv, d), dtype) in [((16, 4, 256), DType::BF16), ((8, 4, 128), DType::F16), ((8, 1, 64), DType::F32)] {
        for (t, scoring) in [(1, Scoring::scaled(0.1)), (3, Scoring { scale: 0.1, window: Some(300) })] {
            let rows = 400usize.div_ceil(hq * t * longest.div_ceil(512)).max(3);
            let lens: Vec<usize> = (0..rows).map(|r| longest - (r * 389) % 1000).collect();
            let what = format!("{hq} heads over {hkv} of {d}, {dtype:?}, t={t}, {rows} rows, {scoring:?}");
            // Every row's keys and values [Hkv, longest, D], its history the first lens[r].
            let data = [41, 42].map(|seed| values(&[rows, hkv, longest, d], 1.0, seed));
            let on_gpu = |x: &Tensor| x.to_dtype(dtype).unwrap().to_device(&gpu).unwrap();
            let [keys, vals] = data.each_ref().map(on_gpu);
            let history: Vec<(Tensor, Tensor)> = (0..rows)
                .map(|r| {
                    let side = |x: &Tensor| x.get(r).unwrap().narrow(1, 0, lens[r]).unwrap();
                    (side(&keys), side(&vals))
                })
                .collect();
            let q = on_gpu(&values(&[rows, hq, t, d], 1.0, 43));
            let wide = causal_attention_rows(&q, &history, scoring).unwrap();
            // The same rows in a paged pool: row r's blocks taken from the end of the pool
            // backwards, its last t positions written by the step's append.
            let blocks: Vec<usize> = lens.iter().map(|l| l.div_ceil(block_size)).collect();
            let total: usize = blocks.iter().sum();
            let mut next = total;
            let tables: Vec<Vec<usize>> = blocks
                .iter()
                .map(|&n| {
                    (0..n)
                        .map(|_| {
                            next -= 1;
                            next
                        })
                        .collect()
                })
                .collect();
            let flat = data.each_ref().map(|x| x.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            let pools = flat.each_ref().map(|src| {
                let mut pool = vec![0f32; total * block_size * hkv * d];
                for (r, table) in tables.iter().enumerate() {
                    for (p, h) in (0..lens[r] - t).flat_map(|p| (0..hkv).map(move |h| (p, h))) {
                        let at = ((table[p / block_size] * block_size + p % block_size) * hkv + h) * d;
                        pool[at..at + d].copy_from_slice(&src[((r * hkv + h) * longest + p) * d..][..d]);
                    }
                }
                on_gpu(&Tensor::from_vec(pool, (total * block_size, hkv, d), &Device::Cpu).unwrap())
            });
            let max_blocks = longest.div_ceil(block_size);
            let table_data: Vec<i32> =
                tables.iter().flat_map(|row| (0..max_blocks).map(|i| row.get(i).map_or(0, |&id| id as i32))).collect();
            let table = Tensor::from_vec(table_data, (rows, max_blocks), &gpu).unwrap();
            let lens_t = Tensor::from_vec(lens.iter().map(|&l| l as i32).collect::<Vec<_>>(), rows, &gpu).unwrap();
            // The rows' last t keys or values [B, Hkv, t, D], as the step appends them.
            let last = |x: &Tensor| {
                let rows: Vec<Tensor> =
                    lens.iter().enumerate().map(|(r, &l)| x.get(r).unwrap().narrow(1, l - t, t).unwrap()).collect();
                Tensor::stack(&rows, 0).unwrap()
            };
            let paged = PagedDecodeRows::new(&pools[0], &pools[1], block_size, &table).unwrap();
            let paged = paged.append_attend(&q, &last(&keys), &last(&vals), &lens_t, scoring).unwrap();
            for r in 0..rows {
                let alone = causal_attention_rows(&q.narrow(0, r, 1).unwrap(), &history[r..=r], scoring).unwrap();
                let row = |x: &Tensor| f32(&x.narrow(0, r, 1).unwrap());
                assert_eq!(diff_bits(&row(&wide), &f32(&alone)), 0, "row {r} batched differs from alone, {what}");
                assert_eq!(diff_bits(&row(&paged), &f32(&alone)), 0, "row {r} paged differs from alone, {what}");
            }
        }
    }
}

/// One head's CPU codec and the formats the quantized-KV tests run: every affine width at each
/// group, TurboQuant from 1 to 8 bits.
enum Cpu {
    Affine(Affine),
    Turbo(Vec<Turbo>),
}

impl Cpu {
    fn affine(d: usize, bits: u32, group: usize) -> Self {
        Cpu::Affine(Affine::new(d, bits, group).unwrap())
    }

    /// A TurboQuant codec per head, each with its own rotation.
    fn turbo(d: usize, bits: u32, heads: usize) -> Self {
        Cpu::Turbo((0..heads).map(|h| Turbo::new(d, bits, TurboVariant::Mse, 100 + h as u64).unwrap()).collect())
    }

    fn head(&self, h: usize) -> &dyn KvCodec {
        match self {
            Cpu::Affine(a) => a,
            Cpu::Turbo(t) => &t[h],
        }
    }

    fn device(&self, gpu: &Device) -> PartCodes {
        match self {
            Cpu::Affine(a) => PartCodes::affine(a),
            Cpu::Turbo(t) => PartCodes::turbo(&t.iter().collect::<Vec<_>>(), gpu).unwrap(),
        }
    }

    /// Head `h`'s vector as attention reads it: decoded, or short of the rotation.
    fn read(&self, h: usize, code: &[u8], out: &mut [f32]) {
        match self {
            Cpu::Affine(a) => a.decode(code, out),
            Cpu::Turbo(t) => t[h].decode_rotated(code, out),
        }
    }
}

fn formats(d: usize, heads: usize) -> Vec<(String, Cpu)> {
    let mut all = Vec::new();
    for bits in [2, 3, 4, 5, 6, 8] {
        for group in [32, 64, 128].into_iter().filter(|g| d % g == 0) {
            all.push((format!("affine{bits}-g{group}"), Cpu::affine(d, bits, group)));
        }
    }
    all.extend((1..=8).map(|bits| (format!("turbo{bits}"), Cpu::turbo(d, bits, heads))));
    all
}

/// Vectors `[b, heads, t, d]`: mixed scales, and a zero vector, a constant one and one with an
/// outlier among them.
fn kv_vectors(b: usize, heads: usize, t: usize, d: usize, seed: u64) -> Tensor {
    let mut data = values(&[b, heads, t, d], 2.0, seed).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    data[..d].fill(0.0);
    data[d..2 * d].fill(0.75);
    data[2 * d + 5] = 40.0;
    Tensor::from_vec(data, (b, heads, t, d), &Device::Cpu).unwrap()
}

fn bytes(t: &Tensor) -> Vec<u8> {
    t.to_device(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<u8>().unwrap()
}

/// Quantized KV on the GPU (quantize on append, read in place): every affine format encodes to
/// the CPU codec's bytes, from f32 and from bf16 inputs; TurboQuant, whose rotation is a matmul
/// that may round otherwise than the CPU's sums, to the same bytes for all but a rare vector; and
/// codes read on the GPU are what the CPU reads from the same bytes, bit for bit.
#[test]
fn kv_codes_on_gpu_are_the_cpu_codecs() {
    let gpu = gpu();
    let (b, heads, t) = (4, 3, 16);
    for d in [64, 128, 256] {
        let x = kv_vectors(b, heads, t, d, 7);
        for (name, cpu) in formats(d, heads) {
            let codes = cpu.device(&gpu);
            let width = codes.width();
            assert_eq!(width, cpu.head(0).bytes(), "{name}, d {d}: width");
            for dtype in [DType::F32, DType::BF16] {
                let x = x.to_dtype(dtype).unwrap();
                let got = bytes(&codes.encode(&x.to_device(&gpu).unwrap()).unwrap());
                let inputs = x.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let mut want = vec![0u8; got.len()];
                for (i, (v, code)) in inputs.chunks(d).zip(want.chunks_mut(width)).enumerate() {
                    cpu.head(i / t % heads).encode(v, code);
                }
                // The same vectors through a pool (one block of 16 positions per row).
                let pools = [0, 1].map(|_| Tensor::zeros((b * t, heads, width), DType::U8, &gpu).unwrap());
                let tables = Tensor::from_vec((0..b as i32).collect::<Vec<_>>(), (b, 1), &gpu).unwrap();
                let lens = Tensor::from_vec(vec![t as i32; b], b, &gpu).unwrap();
                let layer = LayerCodes { keys: codes.clone(), values: codes.clone() };
                let rows = PagedDecodeRows::coded(&pools[0], &pools[1], t, &tables, &layer).unwrap();
                let xg = x.to_device(&gpu).unwrap();
                rows.write(&xg, &xg, &lens).unwrap();
                let pooled = bytes(&pools[0]);
                let pool_differs = (0..b * heads * t)
                    .filter(|&i| {
                        let (r, h, p) = (i / (heads * t), i / t % heads, i % t);
                        pooled[((r * t + p) * heads + h) * width..][..width] != want[i * width..][..width]
                    })
                    .count();
                let differing: Vec<usize> =
                    (0..b * heads * t).filter(|&i| got[i * width..][..width] != want[i * width..][..width]).collect();
                let allowed = if name.starts_with("turbo") { b * heads * t / 50 } else { 0 };
                if let Some(&i) = differing.first().filter(|_| differing.len() > allowed) {
                    panic!(
                        "{name}, d {d}, {dtype:?}: {} vectors coded otherwise than on the CPU ({pool_differs} through a pool); vector {i}: {:?}\n got  {:?}\n want {:?}",
                        differing.len(),
                        &inputs[i * d..][..8],
                        &got[i * width..][..width],
                        &want[i * width..][..width]
                    );
                }
                // Reading: the CPU's codes, read on both.
                let stored = Tensor::from_vec(want.clone(), (b, heads, t, width), &Device::Cpu).unwrap();
                let read = codes.read(&stored.to_device(&gpu).unwrap(), DType::F32).unwrap();
                let read = read.to_device(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let mut expected = vec![0f32; read.len()];
                for (i, (code, out)) in want.chunks(width).zip(expected.chunks_mut(d)).enumerate() {
                    cpu.read(i / t % heads, code, out);
                }
                let same = read.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{name}, d {d}, {dtype:?}: codes read otherwise than on the CPU");
            }
        }
    }
}

/// Attention reading a paged pool of codes in place, after quantizing a step's keys and values
/// into it: within the tolerance of the reference attention over the pool's codes decoded on the
/// CPU (TurboQuant's fully, rotation undone), gated and not, for decode steps and verify blocks,
/// affine and TurboQuant (keys and values at their own bits), a head dim of each width the
/// kernels are built for; and each query's bits are the same in a wide batch (grouped kernels)
/// as in its row alone.
#[test]
fn coded_paged_attention_on_gpu_matches_decoded_attention() {
    let gpu = gpu();
    let (hq, hkv, block_size, cap) = (16, 4, 16usize, 720usize);
    let past = [0usize, 16, 530];
    let f32s = |x: &Tensor| {
        x.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    for d in [64, 128, 256] {
        let formats = [
            ("affine4-g64", Cpu::affine(d, 4, 64), Cpu::affine(d, 4, 64)),
            ("affine3-g32/affine8-g64", Cpu::affine(d, 3, 32), Cpu::affine(d, 8, 64)),
            ("turbo4", Cpu::turbo(d, 4, hkv), Cpu::turbo(d, 4, hkv)),
            ("turbo-k5v3", Cpu::turbo(d, 5, hkv), Cpu::turbo(d, 3, hkv)),
        ];
        for (name, key_codec, value_codec) in formats {
            let codes = LayerCodes { keys: key_codec.device(&gpu), values: value_codec.device(&gpu) };
            let widths = [codes.keys.width(), codes.values.width()];
            for (dtype, t) in [(DType::F32, 1), (DType::F32, 3), (DType::BF16, 1), (DType::BF16, 3)] {
                let lens: Vec<usize> = past.iter().map(|p| p + t).collect();
                let on_gpu = |x: Tensor| x.to_dtype(dtype).unwrap().to_device(&gpu).unwrap();
                // Rows' blocks dealt in turn from a shuffled order; each row's history encoded
                // by the CPU codecs into its pool rows.
                let max_blocks = cap.div_ceil(block_size);
                let (tables, total) = deal_blocks(&lens, block_size, 2, 41);
                let pool_row = |r: usize, p: usize| tables[r][p / block_size] * block_size + p % block_size;
                let history = [0, 1].map(|side| kv_vectors(3, hkv, cap, d, 90 + side as u64).to_dtype(dtype).unwrap());
                let mut pools = widths.map(|w| vec![0u8; total * block_size * hkv * w]);
                for (side, pool) in pools.iter_mut().enumerate() {
                    let (codec, w) = ([&key_codec, &value_codec][side], widths[side]);
                    let data = f32s(&history[side]);
                    for (r, h, p) in (0..3).flat_map(|r| (0..hkv).flat_map(move |h| (0..past[r]).map(move |p| (r, h, p)))) {
                        let at = (pool_row(r, p) * hkv + h) * w;
                        codec.head(h).encode(&data[((r * hkv + h) * cap + p) * d..][..d], &mut pool[at..at + w]);
                    }
                }
                let pools: Vec<Tensor> = pools
                    .into_iter()
                    .zip(widths)
                    .map(|(p, w)| Tensor::from_vec(p, (total * block_size, hkv, w), &gpu).unwrap())
                    .collect();
                let table_data: Vec<i32> =
                    tables.iter().flat_map(|row| (0..max_blocks).map(|i| row.get(i).map_or(0, |&id| id as i32))).collect();
                let table = Tensor::from_vec(table_data, (3, max_blocks), &gpu).unwrap();
                let lens_t = Tensor::from_vec(lens.iter().map(|&l| l as i32).collect::<Vec<_>>(), 3, &gpu).unwrap();
                // The step: keys and values at positions past .. past + t of each row's history.
                let step = |side: usize| {
                    let rows: Vec<Tensor> =
                        (0..3).map(|r| history[side].get(r).unwrap().narrow(1, past[r], t).unwrap()).collect();
                    Tensor::stack(&rows, 0).unwrap().to_device(&gpu).unwrap()
                };
                let (new_k, new_v) = (step(0), step(1));
                let q = on_gpu(values(&[3, hq, t, d], 1.0, 92));
                let gate = on_gpu(values(&[3, t, hq, d], 3.0, 93));
                let paged = PagedDecodeRows::coded(&pools[0], &pools[1], block_size, &table, &codes).unwrap();
                let scoring = Scoring::scaled(1.0 / (d as f64).sqrt());
                let got = paged.append_attend(&q, &new_k, &new_v, &lens_t, scoring).unwrap();
                let gated = paged.append_attend_gated(&q, &new_k, &new_v, &lens_t, scoring, &gate).unwrap();
                // The reference: every row's codes in the pool (the step's as the GPU wrote
                // them) decoded on the CPU, attended in f32.
                let stored = pools.iter().map(bytes).collect::<Vec<_>>();
                let rows: Vec<(Tensor, Tensor)> = (0..3)
                    .map(|r| {
                        let part = |side: usize| {
                            let (codec, w) = ([&key_codec, &value_codec][side], widths[side]);
                            let mut out = vec![0f32; hkv * lens[r] * d];
                            for (h, p) in (0..hkv).flat_map(|h| (0..lens[r]).map(move |p| (h, p))) {
                                let at = (pool_row(r, p) * hkv + h) * w;
                                codec.head(h).decode(&stored[side][at..at + w], &mut out[(h * lens[r] + p) * d..][..d]);
                            }
                            Tensor::from_vec(out, (hkv, lens[r], d), &Device::Cpu).unwrap()
                        };
                        (part(0), part(1))
                    })
                    .collect();
                let q_cpu = q.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
                let want = causal_attention_rows(&q_cpu, &rows, scoring).unwrap();
                let gate_cpu = gate.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
                let what = format!("{name}, d {d}, {dtype:?}, t={t}");
                assert_close(&format!("coded attention, {what}"), dtype, &got, &want);
                assert_close(&format!("coded gated attention, {what}"), dtype, &gated, &sigmoid_gate(&want, &gate_cpu).unwrap());
                // The last row alone, through a table of its own: the same bits.
                let alone_table = table.narrow(0, 2, 1).unwrap();
                let alone = PagedDecodeRows::coded(&pools[0], &pools[1], block_size, &alone_table, &codes).unwrap();
                let last = |x: &Tensor| x.narrow(0, 2, 1).unwrap();
                let solo = alone.append_attend(&last(&q), &last(&new_k), &last(&new_v), &last(&lens_t), scoring).unwrap();
                assert_eq!(
                    diff_bits(&last(&got).to_dtype(DType::F32).unwrap(), &solo.to_dtype(DType::F32).unwrap()),
                    0,
                    "alone vs batched, {what}"
                );
            }
        }
    }
}

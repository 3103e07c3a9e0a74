//! Each kernel on the GPU against the CPU kernel (the reference). Compiled only with
//! `--features cuda` and run on a GPU machine (scripts/cuda/build.sh --tests, then the binary).
//! Tolerances: f32 1e-4 absolute (other summation orders); bf16 2e-2 of the output's scale
//! (inputs and outputs rounded to 8 mantissa bits). Recurrent state is f32 on both.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use strata_kernels::attention::{causal_attention, Scoring};
use strata_kernels::conv1d::causal_conv1d_silu;
use strata_kernels::gated_delta::{gated_delta_rule, Gating};
use strata_kernels::matmul::matmul_t;

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA GPU")
}

/// Deterministic values in [-scale, scale].
fn values(shape: &[usize], scale: f32, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.618 + seed as f32 * 1.37).sin() * 43758.547).fract() * scale).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
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

#[test]
fn gated_delta_rule_on_gpu_matches_cpu() {
    let gpu = gpu();
    // Step by step (a decode or verify block) and by chunks (prefill: three, the last padded).
    for (t, dtype) in [(7, DType::F32), (7, DType::BF16), (150, DType::F32), (150, DType::BF16)] {
        let (b, hk, hv, dk, dv) = (2, 2, 4, 32, 16);
        let inputs = [
            values(&[b, t, hk, dk], 1.0, 1),
            values(&[b, t, hk, dk], 1.0, 2),
            values(&[b, t, hv, dv], 1.0, 3),
            values(&[b, t, hv], 2.0, 4),
            values(&[b, t, hv], 2.0, 5),
        ]
        .map(|x| x.to_dtype(dtype).unwrap());
        let (a_log, dt_bias, state) = (values(&[hv], 1.0, 6), values(&[hv], 1.0, 7), values(&[b, hv, dv, dk], 0.5, 8));
        let run = |dev: &Device| {
            let [q, k, v, a, gate] = inputs.clone().map(|x| x.to_device(dev).unwrap());
            let (a_log, dt_bias) = (a_log.to_device(dev).unwrap(), dt_bias.to_device(dev).unwrap());
            let gating = Gating { a_log: &a_log, dt_bias: &dt_bias };
            gated_delta_rule(&q, &k, &v, &a, &gate, &gating, &state.to_device(dev).unwrap()).unwrap()
        };
        let (want_out, want_state) = run(&Device::Cpu);
        let (out, new_state) = run(&gpu);
        assert_close(&format!("gated delta output, {t} tokens"), dtype, &out, &want_out);
        assert_close(&format!("gated delta state, {t} tokens"), dtype, &new_state, &want_state);
    }
}

#[test]
fn causal_conv1d_on_gpu_matches_cpu() {
    let gpu = gpu();
    let (b, t, c, kernel) = (2, 5, 48, 4);
    for dtype in [DType::F32, DType::BF16] {
        let x = values(&[b, t, c], 1.0, 11).to_dtype(dtype).unwrap();
        let state = values(&[b, kernel - 1, c], 1.0, 12).to_dtype(dtype).unwrap();
        let w = values(&[c, kernel], 0.5, 13).to_dtype(dtype).unwrap();
        let (want_y, want_state) = causal_conv1d_silu(&x, &state, &w).unwrap();
        let on = |x: &Tensor| x.to_device(&gpu).unwrap();
        let (y, new_state) = causal_conv1d_silu(&on(&x), &on(&state), &on(&w)).unwrap();
        assert_close("conv1d output", dtype, &y, &want_y);
        assert_close("conv1d state", dtype, &new_state, &want_state);
    }
}

#[test]
fn causal_attention_on_gpu_matches_cpu() {
    let gpu = gpu();
    let (hq, hkv, d) = (8, 2, 64);
    // Decode (one query), a verify block and a prefill block; full and sliding-window.
    for (t, l) in [(1, 37), (5, 40), (96, 96)] {
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

#[test]
fn matmul_t_on_gpu_matches_cpu() {
    let gpu = gpu();
    for (m, k, n) in [(1, 256, 384), (7, 512, 128), (130, 256, 96)] {
        for dtype in [DType::F32, DType::BF16] {
            let x = values(&[m, k], 1.0, 31).to_dtype(dtype).unwrap();
            let w = values(&[n, k], 0.1, 32).to_dtype(dtype).unwrap();
            let want = matmul_t(&x, &w).unwrap();
            let got = matmul_t(&x.to_device(&gpu).unwrap(), &w.to_device(&gpu).unwrap()).unwrap();
            assert_close(&format!("matmul {m}x{k}x{n}"), dtype, &got, &want);
        }
    }
}

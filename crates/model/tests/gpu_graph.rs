//! On a GPU (built with `--features cuda`, run on the GPU machine): decode steps replayed from a
//! captured CUDA graph give the same logits, bit for bit, as the eager forward, across rows
//! crossing into new KV blocks, rows leaving the batch and rows of different lengths; and they
//! leave the same state behind. The state lives in a pool, so only a new batch-size bucket
//! records again.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use strata_model::{Logits, Model, ModelFolder};
use strata_state::{BatchState, KvFormat, KvPolicy, LayerState, PoolSize, StatePool};

mod common;
use common::{assert_cohorts_match_alone, assert_segments_match_alone, fixtures};

/// Single-row states of `pool` after prompts of different lengths, merged into one batch.
fn batch(model: &Model, pool: &StatePool, lens: &[usize]) -> BatchState {
    let mut batch: Option<BatchState> = None;
    for (r, &len) in lens.iter().enumerate() {
        let prompt: Vec<u32> = (0..len as u32).map(|t| (t * 31 + r as u32 * 5 + 3) % 400).collect();
        let mut s = pool.new_state(1).unwrap();
        model.forward(&Tensor::new(vec![prompt], model.device()).unwrap(), &mut s, Logits::Last).unwrap();
        match &mut batch {
            Some(b) => b.merge(&s).unwrap(),
            None => batch = Some(s),
        }
    }
    batch.unwrap()
}

/// The GPU, readied for inference.
fn cuda() -> Device {
    let device = Device::new_cuda(0).expect("a CUDA GPU");
    let Device::Cuda(gpu) = &device else { unreachable!("asked for CUDA") };
    strata_kernels::prepare_device(gpu).unwrap();
    device
}

/// One decode step of `tokens` on both batches: replayed from a graph on `graphed`, eagerly on
/// `eager`; their logits.
fn step_both(model: &Model, tokens: &Tensor, graphed: &mut BatchState, eager: &mut BatchState) -> (Tensor, Tensor) {
    model.set_decode_graphs(true);
    let got = model.forward(tokens, graphed, Logits::Last).unwrap();
    model.set_decode_graphs(false);
    (got, model.forward(tokens, eager, Logits::Last).unwrap())
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

fn assert_same_state(a: &BatchState, b: &BatchState, what: &str) {
    assert_eq!(a.positions, b.positions, "{what}: positions");
    for r in 0..a.rows() {
        let (a, b) = (a.extract(r).unwrap(), b.extract(r).unwrap());
        for (i, (a, b)) in a.layers.iter().zip(&b.layers).enumerate() {
            match (a, b) {
                (LayerState::Attention(a), LayerState::Attention(b)) => {
                    let ((ka, va), (kb, vb)) = (a.history(0).unwrap(), b.history(0).unwrap());
                    assert!(bits(&ka) == bits(&kb) && bits(&va) == bits(&vb), "{what}: row {r} layer {i} KV differs");
                }
                (LayerState::Recurrent(a), LayerState::Recurrent(b)) => {
                    let ((a_conv, a_ssm), (b_conv, b_ssm)) = (a.tensors().unwrap(), b.tensors().unwrap());
                    assert!(bits(&a_conv) == bits(&b_conv), "{what}: row {r} layer {i} conv state differs");
                    assert!(bits(&a_ssm) == bits(&b_ssm), "{what}: row {r} layer {i} recurrent state differs");
                }
                _ => panic!("layer kinds differ"),
            }
        }
    }
}

#[test]
fn graph_replays_match_eager_steps_bit_for_bit() {
    let device = cuda();
    for dir in fixtures() {
        // The compute dtype, and the recurrent state's (bf16: --mamba-ssm-cache-dtype).
        let combinations =
            [(DType::F32, DType::F32), (DType::F32, DType::BF16), (DType::BF16, DType::F32), (DType::BF16, DType::BF16)];
        for (dtype, stored) in combinations {
            let mut model = ModelFolder::open(&dir).unwrap().load(dtype, &device).unwrap();
            model.set_ssm_cache_dtype(stored).unwrap();
            let Model::Qwen35(qwen) = &model else { panic!("fixtures are Qwen3.5") };
            // Rows at 3, 14 and 30 positions in blocks of 16: each crosses into new blocks mid-run.
            let pool = StatePool::new(&model.state_spec(), 16, PoolSize::Fixed(64), PoolSize::Fixed(8), &device).unwrap();
            let lens = [3, 14, 30];
            let (mut graphed, mut eager) = (batch(&model, &pool, &lens), batch(&model, &pool, &lens));
            let before = qwen.decode_graph_stats();
            for step in 0..40u32 {
                if step == 25 {
                    // The middle row leaves: a new layout, recorded again.
                    graphed.filter(&[0, 2]).unwrap();
                    eager.filter(&[0, 2]).unwrap();
                }
                let rows: Vec<Vec<u32>> = (0..graphed.rows() as u32).map(|r| vec![(step * 7 + r * 13 + 1) % 400]).collect();
                let tokens = Tensor::new(rows, &device).unwrap();
                let (got, want) = step_both(&model, &tokens, &mut graphed, &mut eager);
                let what = format!("{} {dtype:?} ({stored:?} state) step {step}", dir.display());
                assert!(bits(&got) == bits(&want), "{what}: logits differ");
            }
            assert_same_state(&graphed, &eager, &format!("{} {dtype:?} ({stored:?} state)", dir.display()));
            let after = qwen.decode_graph_stats();
            let (recorded, replayed) = (after.recordings - before.recordings, after.replays - before.replays);
            assert!(after.replay_gpu_ns > before.replay_gpu_ns, "replays are timed on the GPU");
            // Two batch-size buckets (3 rows run as 4, then 2): each runs its first step eagerly,
            // records on its second and replays from then on, new blocks and all.
            assert_eq!(recorded, 2, "{}: recordings", dir.display());
            assert_eq!(replayed, 36, "{}: replays of 40 steps", dir.display());
        }
    }
}

/// Prompts prefilled together on the GPU (f32 fixtures): each row's logits within 1e-4 of its
/// chunk fed alone, and the same greedy tokens (the CPU twin is cohort_prefill.rs).
#[test]
fn a_row_prefilled_in_a_cohort_on_gpu_has_the_logits_it_has_alone() {
    let device = cuda();
    for dir in fixtures() {
        let model = ModelFolder::open(&dir).unwrap().load(DType::F32, &device).unwrap();
        assert_cohorts_match_alone(&model, 1e-4, &dir.display().to_string());
    }
}

/// Segments of different lengths in one forward on the GPU (f32 fixtures): each segment's
/// logits and hidden states within 1e-4 of a forward of it alone, the same greedy tokens (the
/// CPU twin, bit for bit, is in cohort_prefill.rs).
#[test]
fn segments_of_different_lengths_on_gpu_give_each_its_logits_alone() {
    let device = cuda();
    for dir in fixtures() {
        let model = ModelFolder::open(&dir).unwrap().load(DType::F32, &device).unwrap();
        assert_segments_match_alone(&model, 1e-4, &dir.display().to_string());
    }
}

/// Quantized KV on the GPU (the head-dim-128 fixture, f32): decode steps replayed from a graph
/// give the eager steps' logits bit for bit, the pool holding codes that the kernels write and
/// read in place; and a row's logits over its prompt and decode steps on the GPU are those of the
/// CPU in the same format, within a quarter of what the format moves them by against unquantized
/// KV (the codecs give the same bytes for the same inputs — kernels' GPU test — but each device's
/// keys and values differ in their last bits, and TurboQuant's rotation is a matmul on each, so a
/// rare coordinate takes the neighbouring code).
#[test]
fn quantized_kv_on_gpu_replays_and_matches_the_cpu() {
    let device = cuda();
    let dir = fixtures().into_iter().find(|d| d.ends_with("qwen3_5-tiny-d")).expect("the head-dim-128 fixture");
    let plain = ModelFolder::open(&dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
    for format in ["affine4-g64", "affine8-g32", "turbo4", "turbo-k4v3"] {
        let policy: KvPolicy = format.parse::<KvFormat>().unwrap().into();
        let load = |device: &Device| {
            let mut model = ModelFolder::open(&dir).unwrap().load(DType::F32, device).unwrap();
            model.set_kv_format(policy.clone()).unwrap();
            model
        };
        let (model, cpu) = (load(&device), load(&Device::Cpu));
        let Model::Qwen35(qwen) = &model else { panic!("the fixture is Qwen3.5") };
        let pool = StatePool::new(&model.state_spec(), 16, PoolSize::Fixed(64), PoolSize::Fixed(8), &device).unwrap();
        let lens = [3, 14, 30];
        let (mut graphed, mut eager) = (batch(&model, &pool, &lens), batch(&model, &pool, &lens));
        let before = qwen.decode_graph_stats();
        for step in 0..12u32 {
            let rows: Vec<Vec<u32>> = (0..3).map(|r| vec![(step * 7 + r * 13 + 1) % 400]).collect();
            let tokens = Tensor::new(rows, &device).unwrap();
            let (got, want) = step_both(&model, &tokens, &mut graphed, &mut eager);
            assert!(bits(&got) == bits(&want), "{format} step {step}: logits differ");
        }
        assert_same_state(&graphed, &eager, format);
        let after = qwen.decode_graph_stats();
        assert_eq!(after.recordings - before.recordings, 1, "{format}: one recording");
        assert_eq!(after.replays - before.replays, 10, "{format}: replays of 12 steps");
        // One row on both devices, and on the CPU with unquantized KV: a prompt, then decode steps.
        let mut states = [model.new_state(1).unwrap(), cpu.new_state(1).unwrap(), plain.new_state(1).unwrap()];
        let prompt: Vec<u32> = (0..40u32).map(|t| (t * 17 + 5) % 400).collect();
        let steps = std::iter::once(prompt).chain((0..6u32).map(|s| vec![(s * 29 + 3) % 400]));
        for (i, tokens) in steps.enumerate() {
            let [on_gpu, on_cpu, unquantized] = &mut states;
            let run = |model: &Model, state: &mut BatchState, device: &Device| {
                let logits = model.forward(&Tensor::new(vec![tokens.clone()], device).unwrap(), state, Logits::All).unwrap();
                logits.to_device(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
            };
            let (g, c, p) =
                (run(&model, on_gpu, &device), run(&cpu, on_cpu, &Device::Cpu), run(&plain, unquantized, &Device::Cpu));
            let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            // The devices' keys and values differ in their last bits, so a coordinate on a
            // rounding boundary may take the neighbouring code: the GPU is held to a small part
            // of what the format itself moves the logits by.
            let (diff, quantization) = (max_diff(&g, &c), max_diff(&c, &p));
            let bound = (quantization / 4.0).max(1e-3);
            assert!(
                diff <= bound,
                "{format}, forward {i}: GPU logits differ from the CPU's by {diff} (bound {bound}; the format moves them by {quantization})"
            );
        }
    }
}

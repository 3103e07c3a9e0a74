//! Images through the Qwen3.5 vision path against transformers (the fixture written by
//! scripts/oracle/make_vision_fixture.py): the processor's pixels, the tower's merged tokens,
//! the positions, logits and greedy tokens of a prompt with two images — on the CPU, and on
//! the GPU too in a CUDA build (`scripts/cuda/build.sh --tests` builds this file as well).

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use strata_model::{ImageLimits, ModelFolder};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/vision/qwen3_5-vl-tiny-g")
}

fn reference() -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture().join("reference.safetensors"), &Device::Cpu).unwrap()
}

/// The CPU, and the GPU in a CUDA build.
fn devices() -> Vec<Device> {
    #[cfg(feature = "cuda")]
    {
        let device = Device::new_cuda(0).expect("a CUDA GPU");
        let Device::Cuda(gpu) = &device else { unreachable!("asked for CUDA") };
        strata_kernels::prepare_device(gpu).unwrap();
        vec![Device::Cpu, device]
    }
    #[cfg(not(feature = "cuda"))]
    vec![Device::Cpu]
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (a.to_device(&Device::Cpu).unwrap(), b.to_device(&Device::Cpu).unwrap());
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

fn image(name: &str) -> Vec<u8> {
    std::fs::read(fixture().join(name)).unwrap()
}

#[test]
fn pixels_match_the_processor() {
    let folder = ModelFolder::open(&fixture()).unwrap();
    let processor = folder.image_processor.as_ref().expect("the fixture has preprocessor_config.json");
    let want = reference();
    for (name, key) in [("image-a.png", "a"), ("image-b.png", "b")] {
        let prepared = processor.prepare(&image(name), ImageLimits::default()).unwrap();
        let grid: Vec<i64> = want[&format!("grid_{key}")].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(prepared.grid.map(|g| g as i64).to_vec(), grid, "{name}: grid");
        let pixels = prepared.pixel_values(processor.temporal_patch_size, &Device::Cpu, DType::F32).unwrap();
        let d = max_diff(&pixels, &want[&format!("pixels_{key}")]);
        // No resize: only the arithmetic of rescale and normalize differs. Resized: what the
        // resize allows (below), through the normalization's std of 0.5.
        let allowed = if key == "a" { 1e-6 } else { 2.0 / 255.0 / 0.5 + 1e-6 };
        assert!(d <= allowed, "{name}: pixel values differ by {d}");
    }
    // The resized image, in [0, 1] before normalization.
    let decoded = strata_model::images::decode(&image("image-b.png"), ImageLimits::default()).unwrap();
    let resized = processor.resize(decoded).unwrap();
    let (w, h) = (resized.width() as usize, resized.height() as usize);
    let ours = Tensor::from_vec(resized.into_raw(), (h, w, 3), &Device::Cpu).unwrap().permute((2, 0, 1)).unwrap();
    let ours = (ours.to_dtype(DType::F32).unwrap() / 255.0).unwrap();
    let d = max_diff(&ours, &want["resized_b"]);
    assert!(d <= 2.0 / 255.0 + 1e-6, "resized image-b.png differs by {} / 255", d * 255.0);
}

#[test]
fn vision_tower_matches_transformers() {
    for device in devices() {
        let folder = ModelFolder::open(&fixture()).unwrap();
        let tower = folder.load_vision(DType::F32, &device).unwrap();
        merged_tokens_match(&folder, &tower);
    }
}

fn merged_tokens_match(folder: &ModelFolder, tower: &strata_model::VisionTower) {
    let processor = folder.image_processor.as_ref().unwrap();
    let want = reference();
    for (name, key) in [("image-a.png", "a"), ("image-b.png", "b")] {
        let prepared = processor.prepare(&image(name), ImageLimits::default()).unwrap();
        // Fed the processor's own pixels, so only the tower is compared.
        let theirs: Vec<f32> = want[&format!("pixels_{key}")].flatten_all().unwrap().to_vec1().unwrap();
        let prepared = strata_model::PreparedImage { pixels: strata_model::Pixels::Values(theirs), ..prepared };
        let got = tower.forward(&prepared).unwrap();
        let d = max_diff(&got, &want[&format!("features_{key}")]);
        assert!(d < 1e-4, "{name}: merged tokens differ by {d}");
    }
}

/// The fixture's prompt through the text model with its two images, fed in `chunks` (lengths),
/// then `decode` greedy tokens: every prompt position's logits and the greedy tokens. The
/// images' pixels are strata's own, or (`their_pixels`) the processor's.
fn run_prompt(
    model: &strata_model::Model,
    tower: &strata_model::VisionTower,
    chunks: &[usize],
    decode: usize,
    their_pixels: bool,
) -> (Tensor, Vec<u32>) {
    use strata_model::{ImagePrompt, Logits};
    let folder = ModelFolder::open(&fixture()).unwrap();
    let processor = folder.image_processor.as_ref().unwrap();
    let want = reference();
    let tokens: Vec<u32> = want["tokens"].to_vec1::<i64>().unwrap().into_iter().map(|t| t as u32).collect();
    let images: Vec<_> = [("image-a.png", "pixels_a"), ("image-b.png", "pixels_b")]
        .iter()
        .map(|(name, key)| {
            let ours = processor.prepare(&image(name), ImageLimits::default()).unwrap();
            match their_pixels {
                true => strata_model::PreparedImage {
                    pixels: strata_model::Pixels::Values(want[*key].flatten_all().unwrap().to_vec1().unwrap()),
                    ..ours
                },
                false => ours,
            }
        })
        .collect();
    let prompt = ImagePrompt::new(tower, &tokens, &images).unwrap();
    let mut state = model.new_state(1).unwrap();
    let (mut logits, mut at) = (Vec::new(), 0);
    for &len in chunks {
        let row = Tensor::new(&tokens[at..at + len], model.device()).unwrap().unsqueeze(0).unwrap();
        let input = prompt.inputs(at..at + len).unwrap();
        logits.push(model.forward_images(&row, &input, &mut state, Logits::All).unwrap().squeeze(0).unwrap());
        at += len;
    }
    assert_eq!(at, tokens.len(), "chunks cover the prompt");
    let logits = Tensor::cat(&logits, 0).unwrap();
    let logits = logits.to_device(&Device::Cpu).unwrap();
    let argmax = |t: &Tensor| t.to_device(&Device::Cpu).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap();
    let mut greedy = vec![argmax(&logits.get(tokens.len() - 1).unwrap())];
    while greedy.len() < decode {
        // Plain decode steps: the state carries the rotary offset the images left.
        let row = Tensor::new(&[*greedy.last().unwrap()], model.device()).unwrap().unsqueeze(0).unwrap();
        let next = model.forward(&row, &mut state, Logits::Last).unwrap().squeeze(0).unwrap();
        greedy.push(argmax(&next));
    }
    (logits, greedy)
}

#[test]
fn prompt_with_images_matches_transformers() {
    for device in devices() {
        let folder = ModelFolder::open(&fixture()).unwrap();
        let (model, tower) = (folder.load(DType::F32, &device).unwrap(), folder.load_vision(DType::F32, &device).unwrap());
        prompt_matches(&model, &tower);
    }
}

fn prompt_matches(model: &strata_model::Model, tower: &strata_model::VisionTower) {
    let want = reference();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap()).unwrap();
    let greedy_want: Vec<u32> = json["greedy_tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();

    // The positions and decode offset transformers computes.
    let tokens: Vec<u32> = want["tokens"].to_vec1::<i64>().unwrap().into_iter().map(|t| t as u32).collect();
    let grids = [[1, 6, 8], [1, 12, 18]];
    let (positions, delta) = strata_model::mrope_positions(&tokens, &grids, tower.config()).unwrap();
    let theirs = want["position_ids"].to_dtype(DType::U32).unwrap().t().unwrap().to_vec2::<u32>().unwrap();
    assert_eq!(positions.iter().map(|p| p.map(|x| x as u32).to_vec()).collect::<Vec<_>>(), theirs);
    assert_eq!(delta, json["rope_delta"].as_i64().unwrap());

    // With the processor's pixels, the text model's logits; with strata's own (one resized
    // image, within a level of the processor's), the greedy tokens.
    let n = tokens.len();
    let (logits, greedy) = run_prompt(model, tower, &[n], greedy_want.len(), true);
    let d = max_diff(&logits, &want["logits"]);
    assert!(d < 1e-4, "logits differ by {d}");
    assert_eq!(greedy, greedy_want, "greedy tokens");
    let (_, greedy) = run_prompt(model, tower, &[n], greedy_want.len(), false);
    assert_eq!(greedy, greedy_want, "greedy tokens from strata's own pixels");

    // Chunks that cut through both images give the same.
    let (chunked, greedy) = run_prompt(model, tower, &[9, 30, 1, 41, n - 81], greedy_want.len(), true);
    let d = max_diff(&chunked, &logits);
    assert!(d < 1e-4, "chunked prefill's logits differ by {d}");
    assert_eq!(greedy, greedy_want, "greedy tokens after a chunked prefill");
}

#[test]
fn image_tokens_and_images_must_agree() {
    let folder = ModelFolder::open(&fixture()).unwrap();
    let tower = folder.load_vision(DType::F32, &Device::Cpu).unwrap();
    let cfg = tower.config();
    let pad = cfg.image_token_id;
    let tokens = [5, cfg.vision_start_token_id, pad, pad, pad, cfg.vision_end_token_id, 7];
    // 2x4 patches merge to 1x2 tokens: three pads are one too many.
    let err = strata_model::mrope_positions(&tokens, &[[1, 2, 4]], cfg).unwrap_err().to_string();
    assert!(err.contains("run of 3 image tokens"), "{err}");
    let err = strata_model::mrope_positions(&tokens, &[], cfg).unwrap_err().to_string();
    assert!(err.contains("more runs of image tokens"), "{err}");
    let err = strata_model::mrope_positions(&[5, 7], &[[1, 2, 2]], cfg).unwrap_err().to_string();
    assert!(err.contains("more images were given"), "{err}");
    // A 2x6 grid: three tokens on one row, text resuming past the wider side.
    let (positions, delta) = strata_model::mrope_positions(&tokens, &[[1, 2, 6]], cfg).unwrap();
    assert_eq!(positions, [[0; 3], [1; 3], [2, 2, 2], [2, 2, 3], [2, 2, 4], [5; 3], [6; 3]]);
    assert_eq!(delta, 0);
}

//! Prompts prefilled together: rows at different positions (fresh, or after cached prefixes of
//! different lengths) feed equal chunks as rows of one forward, and each row's logits are
//! those of feeding its chunk alone, within 1e-5 (f32), with the same greedy token everywhere.
//! Where a row's chunk is short enough for the batch-invariant kernels, the bits are the same.

use candle_core::{DType, Device, Tensor};
use strata_kernels::matmul::MAX_EXACT_ROWS;
use strata_model::{Logits, Model, ModelFolder};
use strata_state::BatchState;

mod common;
use common::fixtures;

/// A single-row state after `prefix`.
fn after(model: &Model, prefix: &[u32]) -> BatchState {
    let mut state = model.new_state(1).unwrap();
    if !prefix.is_empty() {
        model.forward(&ids(&[prefix.to_vec()]), &mut state, Logits::Last).unwrap();
    }
    state
}

/// `[rows, len]` token ids.
fn ids(rows: &[Vec<u32>]) -> Tensor {
    Tensor::new(rows.to_vec(), &Device::Cpu).unwrap()
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    let t = t.to_dtype(DType::F32).unwrap();
    let vocab = *t.dims().last().unwrap();
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().chunks(vocab).map(<[f32]>::to_vec).collect()
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold(0, |best, (i, x)| if *x > v[best] { i } else { best })
}

#[test]
fn a_row_prefilled_in_a_cohort_has_the_logits_it_has_alone() {
    for dir in fixtures() {
        let model = ModelFolder::open(&dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
        let vocab = model.vocab_size() as u32;
        let text: Vec<u32> = (0..400u32).map(|i| (i * 7919 + 13) % vocab).collect();
        // Chunks short enough for the step-by-step recurrence and long enough for the chunked
        // one; the whole cohort past the batch-invariant matmul's rows.
        for (prefixes, chunk) in [(&[0usize, 5, 13][..], 24usize), (&[0, 40][..], 70), (&[3, 3, 0, 17][..], 9)] {
            let starts: Vec<usize> = prefixes.iter().enumerate().map(|(r, &p)| 50 * r + p).collect();
            let feeds: Vec<Vec<u32>> = starts.iter().map(|&s| text[s..s + chunk].to_vec()).collect();
            let states: Vec<BatchState> =
                prefixes.iter().enumerate().map(|(r, &p)| after(&model, &text[50 * r..50 * r + p])).collect();

            let mut cohort = states[0].clone();
            states[1..].iter().for_each(|s| cohort.merge(s).unwrap());
            let together = model.forward(&ids(&feeds), &mut cohort, Logits::All).unwrap();
            assert_eq!(cohort.positions, prefixes.iter().map(|p| p + chunk).collect::<Vec<_>>());
            for (r, (feed, mut alone)) in feeds.iter().zip(states).enumerate() {
                let solo = model.forward(&ids(&[feed.clone()]), &mut alone, Logits::All).unwrap();
                let (got, want) = (rows(&together.get(r).unwrap()), rows(&solo.get(0).unwrap()));
                for (t, (g, w)) in got.iter().zip(&want).enumerate() {
                    let diff = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    let what = format!("{}: row {r} of {prefixes:?}, position {t} of {chunk}", dir.display());
                    assert!(diff <= 1e-5, "{what}: logits differ by {diff}");
                    if chunk <= MAX_EXACT_ROWS {
                        assert_eq!(diff, 0.0, "{what}: positions the batch-invariant kernels take keep their bits");
                    }
                    assert_eq!(argmax(g), argmax(w), "{what}: greedy token");
                }
            }
        }
    }
}

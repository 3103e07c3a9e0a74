//! Prompts prefilled together on CPU: rows at different positions (fresh, or after prefixes of
//! different lengths) feed equal chunks as rows of one forward, and each row's logits are those
//! of feeding its chunk alone — within 1e-5 (f32), the same greedy token everywhere, and the
//! same bits where a row's chunk is short enough for the batch-invariant kernels. (The CUDA twin
//! is in gpu_graph.rs.)

use candle_core::{DType, Device};
use strata_model::ModelFolder;

mod common;
use common::{assert_cohorts_match_alone, assert_segments_match_alone, fixtures};

#[test]
fn a_row_prefilled_in_a_cohort_has_the_logits_it_has_alone() {
    for dir in fixtures() {
        let model = ModelFolder::open(&dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
        assert_cohorts_match_alone(&model, 1e-5, &dir.display().to_string());
    }
}

#[test]
fn segments_of_different_lengths_in_one_forward_give_each_its_logits_alone() {
    for dir in fixtures() {
        let model = ModelFolder::open(&dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
        assert_segments_match_alone(&model, 0.0, &dir.display().to_string());
    }
}

//! Speculative rounds roll back exactly: after a verify forward over drafted tokens and a
//! partial accept, every row's state — attention KV, conv window and recurrent matrix — equals
//! bit for bit the state of a forward over only its kept tokens, in a batch whose rows keep
//! different counts; and a round made of several forwards (a draft model's steps) rolls back too.

use candle_core::{DType, Device, Tensor};
use strata_model::{Logits, Model, ModelFolder};
use strata_state::{BatchState, LayerState};

mod common;
use common::fixtures;

fn tokens(rows: &[Vec<u32>]) -> Tensor {
    Tensor::new(rows.to_vec(), &Device::Cpu).unwrap()
}

/// Single-row states after prompts of different lengths, merged into one batch.
fn batch(model: &Model, prompts: &[Vec<u32>]) -> BatchState {
    let mut batch: Option<BatchState> = None;
    for p in prompts {
        let mut s = model.new_state(1).unwrap();
        model.forward(&tokens(&[p.clone()]), &mut s, Logits::Last).unwrap();
        match &mut batch {
            Some(b) => b.merge(&s).unwrap(),
            None => batch = Some(s),
        }
    }
    batch.unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

/// Every layer of row `r` of `got` equals the single-row state `want`, bit for bit.
fn assert_row_equal(got: &BatchState, r: usize, want: &BatchState, what: &str) {
    let row = got.extract(r).unwrap();
    assert_eq!(row.positions, want.positions, "{what}: positions");
    for (i, (a, b)) in row.layers.iter().zip(&want.layers).enumerate() {
        match (a, b) {
            (LayerState::Attention(a), LayerState::Attention(b)) => {
                let ((ka, va), (kb, vb)) = (a.history(0).unwrap(), b.history(0).unwrap());
                assert!(bits(&ka) == bits(&kb) && bits(&va) == bits(&vb), "{what}: layer {i} KV differs");
            }
            (LayerState::Recurrent(a), LayerState::Recurrent(b)) => {
                let ((a_conv, a_ssm), (b_conv, b_ssm)) = (a.tensors().unwrap(), b.tensors().unwrap());
                assert!(bits(&a_conv) == bits(&b_conv), "{what}: layer {i} conv state differs");
                assert!(bits(&a_ssm) == bits(&b_ssm), "{what}: layer {i} recurrent state differs");
            }
            _ => panic!("layer kinds differ"),
        }
    }
}

#[test]
fn rollback_equals_a_forward_over_only_the_kept_tokens() {
    for dir in fixtures() {
        let model = ModelFolder::open(&dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
        let prompts: Vec<Vec<u32>> =
            (0..4).map(|r| (0..(5 + 7 * r as u32)).map(|t| (t * 31 + r as u32 * 5 + 3) % 500).collect()).collect();
        // Each row verifies its last token and 5 drafts; they keep 1, 3, 6 (all) and 4 positions.
        let drafted: Vec<Vec<u32>> = (0..4).map(|r| (0..6).map(|t| (t * 17 + r * 101 + 9) % 500).collect()).collect();
        let keep = [1, 3, 6, 4];
        let mut state = batch(&model, &prompts);
        let round = model.open_round(&mut state).unwrap();
        model.forward(&tokens(&drafted), &mut state, Logits::All).unwrap();
        model.close_round(&mut state, round, &keep).unwrap();
        for r in 0..4 {
            let mut want = batch(&model, &prompts[r..=r]);
            model.forward(&tokens(&[drafted[r][..keep[r]].to_vec()]), &mut want, Logits::All).unwrap();
            assert_row_equal(&state, r, &want, &format!("{dir:?} row {r}"));
        }
        // The rolled-back batch decodes on exactly like the reference states.
        let next: Vec<Vec<u32>> = (0..4).map(|r| vec![(r * 7 + 1) as u32]).collect();
        let got = model.forward(&tokens(&next), &mut state, Logits::Last).unwrap();
        for r in 0..4 {
            let mut want = batch(&model, &prompts[r..=r]);
            model.forward(&tokens(&[drafted[r][..keep[r]].to_vec()]), &mut want, Logits::All).unwrap();
            let logits = model.forward(&tokens(&next[r..=r]), &mut want, Logits::Last).unwrap();
            assert_eq!(bits(&got.get(r).unwrap()), bits(&logits.get(0).unwrap()), "{dir:?} row {r}: logits after rollback");
        }
    }
}

#[test]
fn a_round_of_several_forwards_rolls_back() {
    let dir = &fixtures()[1];
    let model = ModelFolder::open(dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
    let prompts = vec![vec![5, 6, 7, 8, 9], vec![10, 11, 12]];
    let steps = [[40u32, 41], [42, 43], [44, 45], [46, 47]];
    let mut state = batch(&model, &prompts);
    let round = model.open_round(&mut state).unwrap();
    for step in steps {
        model.forward(&tokens(&[vec![step[0]], vec![step[1]]]), &mut state, Logits::Last).unwrap();
    }
    let keep = [2, 0];
    model.close_round(&mut state, round, &keep).unwrap();
    for r in 0..2 {
        let mut want = batch(&model, &prompts[r..=r]);
        let kept: Vec<u32> = steps[..keep[r]].iter().map(|s| s[r]).collect();
        if !kept.is_empty() {
            model.forward(&tokens(&[kept]), &mut want, Logits::Last).unwrap();
        }
        assert_row_equal(&state, r, &want, &format!("row {r}"));
    }
    // A closed round cannot be closed again, and keeping more than was fed is refused.
    let round = model.open_round(&mut state).unwrap();
    assert!(model.close_round(&mut state, round, &[1, 0]).is_err());
}

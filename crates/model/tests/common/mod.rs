//! What the model's test files share: the Qwen3.5 fixture folders.

use std::path::PathBuf;

/// Every Qwen3.5 fixture folder (dense ones live under `fixtures/dense/`).
pub fn fixtures() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).filter(|p| p.join("config.json").exists()).collect();
    dirs.sort();
    assert!(dirs.len() >= 3, "fixtures missing under {}", root.display());
    dirs
}

/// Rows at different positions (fresh, or after prefixes of different lengths, in a state
/// pool as the engine keeps them) feed equal chunks as rows of one forward: each row's logits
/// at every position are within `tolerance` of feeding its chunk alone, with the same greedy
/// token, and on CPU bit for bit where the chunk is short enough for the batch-invariant
/// kernels. Chunks short enough for the step-by-step recurrence and long enough for the chunked
/// one; cohorts past the batch-invariant matmul's rows; rows of equal and unequal lengths.
#[allow(dead_code)] // not every test file prefills cohorts
pub fn assert_cohorts_match_alone(model: &strata_model::Model, tolerance: f32, what: &str) {
    use candle_core::{DType, Tensor};
    use strata_model::Logits;
    use strata_state::{PoolSize, StatePool};

    let device = model.device();
    let pool = StatePool::new(&model.state_spec(), 16, PoolSize::Growing, PoolSize::Growing, device).unwrap();
    let ids = |rows: &[Vec<u32>]| Tensor::new(rows.to_vec(), device).unwrap();
    let rows = |t: &Tensor| -> Vec<Vec<f32>> {
        let t = t.to_dtype(DType::F32).unwrap();
        let vocab = *t.dims().last().unwrap();
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().chunks(vocab).map(<[f32]>::to_vec).collect()
    };
    let argmax = |v: &[f32]| v.iter().enumerate().fold(0, |best, (i, x)| if *x > v[best] { i } else { best });
    let vocab = model.vocab_size() as u32;
    let text: Vec<u32> = (0..400u32).map(|i| (i * 7919 + 13) % vocab).collect();
    // Equal prefixes make rows equally long: their attention runs as one batch.
    let cases =
        [(&[0usize, 5, 13][..], 24usize), (&[0, 40][..], 70), (&[3, 3, 0, 17][..], 9), (&[0, 0, 0][..], 70), (&[6, 6][..], 24)];
    for (prefixes, chunk) in cases {
        let states: Vec<_> = prefixes
            .iter()
            .enumerate()
            .map(|(r, &p)| {
                let mut state = pool.new_state(1).unwrap();
                if p > 0 {
                    model.forward(&ids(&[text[50 * r..50 * r + p].to_vec()]), &mut state, Logits::Last).unwrap();
                }
                state
            })
            .collect();
        let feeds: Vec<Vec<u32>> =
            prefixes.iter().enumerate().map(|(r, &p)| text[50 * r + p..50 * r + p + chunk].to_vec()).collect();
        let mut cohort = pool.new_state(0).unwrap();
        states.iter().for_each(|s| cohort.merge(s).unwrap());
        let together = model.forward(&ids(&feeds), &mut cohort, Logits::All).unwrap();
        assert_eq!(cohort.positions, prefixes.iter().map(|p| p + chunk).collect::<Vec<_>>());
        for (r, (feed, mut alone)) in feeds.iter().zip(states).enumerate() {
            let solo = model.forward(&ids(&[feed.clone()]), &mut alone, Logits::All).unwrap();
            let (got, want) = (rows(&together.get(r).unwrap()), rows(&solo.get(0).unwrap()));
            for (t, (g, w)) in got.iter().zip(&want).enumerate() {
                let diff = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                let what = format!("{what}: row {r} of {prefixes:?}, position {t} of {chunk}");
                assert!(diff <= tolerance, "{what}: logits differ by {diff}");
                assert_eq!(argmax(g), argmax(w), "{what}: greedy token");
                if device.is_cpu() && chunk <= strata_kernels::matmul::MAX_EXACT_ROWS {
                    assert_eq!(diff, 0.0, "{what}: positions the batch-invariant kernels take keep their bits");
                }
            }
        }
    }
}

/// Segments of different shapes in one forward (`Model::forward_segments`): a decode batch of
/// rows at different positions, a verify-like block of three positions per row, a long prompt's
/// chunk and a two-row cohort — each segment's logits (and final hidden states) are those of a
/// forward of it alone: bit for bit on CPU, where every segment keeps the kernels it has alone
/// (a decode row stays in the batch-invariant matmul beside a 70-token chunk), and within
/// `tolerance` with the same greedy tokens elsewhere. Every segment's rows advance by its own
/// length.
#[allow(dead_code)] // not every test file runs segments
pub fn assert_segments_match_alone(model: &strata_model::Model, tolerance: f32, what: &str) {
    use candle_core::{DType, Tensor};
    use strata_model::{Logits, Segment};
    use strata_state::{BatchState, PoolSize, StatePool};

    let device = model.device();
    let pool = StatePool::new(&model.state_spec(), 16, PoolSize::Growing, PoolSize::Growing, device).unwrap();
    let vocab = model.vocab_size() as u32;
    let text: Vec<u32> = (0..600u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let ids = |rows: &[Vec<u32>]| Tensor::new(rows.to_vec(), device).unwrap();
    // (each row's prefix, positions fed, which logits); rows take text from their own offset.
    let plans: [(&[usize], usize, Logits); 4] =
        [(&[5, 13, 30], 1, Logits::Last), (&[8, 20], 3, Logits::All), (&[0], 70, Logits::Last), (&[0, 7], 24, Logits::All)];
    let mut offset = 0;
    let mut feeds = Vec::new();
    for (prefixes, len, _) in plans {
        feeds.push(
            prefixes
                .iter()
                .map(|&p| {
                    offset += 50;
                    (text[offset..offset + p].to_vec(), text[offset + p..offset + p + len].to_vec())
                })
                .collect::<Vec<_>>(),
        );
    }
    // Each segment's rows after their prefixes, merged into one state.
    let states = || -> Vec<BatchState> {
        feeds
            .iter()
            .map(|rows| {
                let mut merged = pool.new_state(0).unwrap();
                for (prefix, _) in rows {
                    let mut state = pool.new_state(1).unwrap();
                    if !prefix.is_empty() {
                        model.forward(&ids(&[prefix.clone()]), &mut state, Logits::Last).unwrap();
                    }
                    merged.merge(&state).unwrap();
                }
                merged
            })
            .collect()
    };
    let tokens: Vec<Tensor> = feeds.iter().map(|rows| ids(&rows.iter().map(|(_, f)| f.clone()).collect::<Vec<_>>())).collect();
    // Plain forwards, and (where the model has them) forwards returning hidden states too.
    let hides = model.forward_with_hidden(&tokens[3], &mut states().pop().unwrap(), Logits::All).is_ok();
    for hidden in [false, true].into_iter().filter(|&h| !h || hides) {
        let mut together_states = states();
        let mut segments: Vec<Segment> = together_states
            .iter_mut()
            .zip(&tokens)
            .zip(&plans)
            .map(|((state, tokens), &(_, _, logits))| Segment { tokens, state, logits, images: None })
            .collect();
        let together = model.forward_segments(&mut segments, hidden).unwrap();
        let flat = |t: &Tensor| -> Vec<f32> { t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap() };
        for (k, ((mut alone, (prefixes, len, logits)), out)) in states().into_iter().zip(plans).zip(&together).enumerate() {
            let what = format!("{what}: segment {k} ({} rows of {len}), hidden {hidden}", prefixes.len());
            let mut one = [Segment { tokens: &tokens[k], state: &mut alone, logits, images: None }];
            let solo = model.forward_segments(&mut one, hidden).unwrap().pop().unwrap();
            assert_eq!(out.logits.dims(), solo.logits.dims(), "{what}: logits' shape");
            let want_positions: Vec<usize> = prefixes.iter().map(|p| p + len).collect();
            assert_eq!(together_states[k].positions, want_positions, "{what}: positions");
            let pairs = [Some((&out.logits, &solo.logits)), out.hidden.as_ref().zip(solo.hidden.as_ref())];
            for (got, want) in pairs.into_iter().flatten() {
                let (got, want) = (flat(got), flat(want));
                let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                match device.is_cpu() {
                    true => assert_eq!(diff, 0.0, "{what}: each segment keeps the bits it has alone"),
                    false => assert!(diff <= tolerance, "{what}: differ by {diff}"),
                }
            }
            let width = model.vocab_size();
            let argmax = |v: &[f32]| v.iter().enumerate().fold(0, |best, (i, x)| if *x > v[best] { i } else { best });
            let (got, want) = (flat(&out.logits), flat(&solo.logits));
            for (g, w) in got.chunks(width).zip(want.chunks(width)) {
                assert_eq!(argmax(g), argmax(w), "{what}: greedy token");
            }
        }
        assert_eq!(together.len(), plans.len());
        assert_eq!(together.iter().all(|o| o.hidden.is_some()), hidden, "hidden states where asked for");
    }
}

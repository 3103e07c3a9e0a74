//! Per-request sampling settings, and the [`Sampler`] that turns them into the kernels' terms: a
//! [`Draw`] (temperature, top-k, top-p, min-p, seed, position) and the logit [`Adjust`]ments
//! (bias, repetition, presence and frequency penalties), applied in transformers' order. The
//! draw itself is `strata_kernels::sampling`'s: on the device for a batch, its CPU twin for
//! logits already on the host — the same token either way.

use std::collections::BTreeMap;

use strata_kernels::sampling::{draw_row, Adjust, Draw};

use crate::structured::TokenMask;

/// Temperatures below this sample greedily (as vLLM does): dividing logits by a smaller one
/// overflows f32 — a temperature of 1e-46 is 0 as f32 — where the distribution is one-hot in all
/// but exact ties anyway.
pub const MIN_TEMPERATURE: f64 = 1e-5;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Below [`MIN_TEMPERATURE`] (0 included) means greedy.
    pub temperature: f64,
    /// 0 means off.
    pub top_k: usize,
    /// 1 means off.
    pub top_p: f64,
    /// 0 means off.
    pub min_p: f64,
    /// 1 means off; divides positive (multiplies negative) logits of every token seen so far.
    pub repetition_penalty: f64,
    /// Subtracted once from the logit of every generated token.
    pub presence_penalty: f64,
    /// Subtracted from each generated token's logit once per occurrence.
    pub frequency_penalty: f64,
    /// Added to the logits of these tokens before anything else (OpenAI `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature < MIN_TEMPERATURE
    }

    /// Checks ranges; the message names the parameter.
    pub fn validate(&self) -> Result<(), String> {
        let checks = [
            (self.temperature.is_finite() && self.temperature >= 0.0, "temperature must be >= 0"),
            (self.top_p > 0.0 && self.top_p <= 1.0, "top_p must be in (0, 1]"),
            ((0.0..=1.0).contains(&self.min_p), "min_p must be in [0, 1]"),
            // As f32, which the logits are: 1e-46 would be 0, and divide them into infinities.
            ((self.repetition_penalty as f32).is_normal() && self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
            // OpenAI's range: -1e39 would be -inf as f32, and lift a token to +inf.
            ((-2.0..=2.0).contains(&self.presence_penalty), "presence_penalty must be in [-2, 2]"),
            ((-2.0..=2.0).contains(&self.frequency_penalty), "frequency_penalty must be in [-2, 2]"),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, msg)) => Err(msg.to_string()),
            None => Ok(()),
        }
    }
}

/// The sampling settings a request or command line chose; every one left out comes from the
/// model's `generation_config.json` (its authors' recommendation), then from the neutral value.
/// The one place both the server and the CLI resolve defaults.
#[derive(Clone, Debug, Default)]
pub struct SamplingChoice {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
}

impl SamplingChoice {
    /// The parameters to sample with; the error names the parameter out of range.
    pub fn resolve(self, g: &strata_model::GenerationConfig) -> Result<SamplingParams, String> {
        let sampled = g.do_sample.unwrap_or(true);
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(if sampled { g.temperature.unwrap_or(1.0) } else { 0.0 }),
            top_p: self.top_p.or(g.top_p).unwrap_or(1.0),
            top_k: self.top_k.or(g.top_k).unwrap_or(0),
            min_p: self.min_p.or(g.min_p).unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.or(g.repetition_penalty).unwrap_or(1.0),
            presence_penalty: self.presence_penalty.or(g.presence_penalty).unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.or(g.frequency_penalty).unwrap_or(0.0),
            logit_bias: self.logit_bias,
            seed: self.seed,
        };
        params.validate()?;
        Ok(params)
    }
}

/// A request's sampling: its parameters and the seed of its draws (the request's, or a random
/// one). Stateless beyond that: output token `n` is drawn from (seed, n), so a row draws the
/// same tokens alone or batched, with or without speculation, and resumed from a checkpoint.
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        Self { params, seed }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// How output token `position` (its index in the output) is chosen.
    pub fn draw(&self, position: usize) -> Draw {
        let p = &self.params;
        if p.is_greedy() {
            return Draw::GREEDY;
        }
        Draw {
            temperature: p.temperature as f32,
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p as f32,
            min_p: p.min_p as f32,
            seed: self.seed,
            position: position as u64,
        }
    }

    /// Whether any logit is adjusted before the draw.
    fn adjusts(&self) -> bool {
        let p = &self.params;
        !p.logit_bias.is_empty() || p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    /// The adjustments of row `row`'s logits (of `vocab` tokens) before its next draw, one per
    /// token: the logit bias (repeated tokens summed); the repetition penalty on every token of
    /// `context` (prompt and output so far); the presence and frequency penalties on each token
    /// of `generated` (the output), by its count. `drafted` (speculative tokens fed after the
    /// row's own, before the position drawn) counts as both.
    pub fn adjustments(&self, row: u32, vocab: usize, context: &[u32], generated: &[u32], drafted: &[u32]) -> Vec<Adjust> {
        if !self.adjusts() {
            return Vec::new();
        }
        let p = &self.params;
        let mut by_token: BTreeMap<u32, Adjust> = BTreeMap::new();
        let none = |token| Adjust { row, token, bias: 0.0, repetition: 1.0, subtract: 0.0 };
        for &(token, bias) in &p.logit_bias {
            by_token.entry(token).or_insert(none(token)).bias += bias;
        }
        if p.repetition_penalty != 1.0 {
            for &token in context.iter().chain(drafted) {
                by_token.entry(token).or_insert(none(token)).repetition = p.repetition_penalty as f32;
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
            for &token in generated.iter().chain(drafted) {
                *counts.entry(token).or_default() += 1;
            }
            for (token, n) in counts {
                by_token.entry(token).or_insert(none(token)).subtract =
                    (p.presence_penalty + p.frequency_penalty * f64::from(n)) as f32;
            }
        }
        by_token.into_values().filter(|a| (a.token as usize) < vocab).collect()
    }

    /// Picks the next token from one row of `logits` on the host, among the tokens `allowed`
    /// allows (structured output; `None`: any): the token the device would draw from them.
    /// `context` is every token so far (prompt and output), `generated` the output alone.
    pub fn sample(&self, logits: &[f32], allowed: Option<&TokenMask>, context: &[u32], generated: &[u32]) -> u32 {
        let mut logits = logits.to_vec();
        for a in self.adjustments(0, logits.len(), context, generated, &[]) {
            logits[a.token as usize] = a.apply(logits[a.token as usize]);
        }
        draw_row(&logits, &self.draw(generated.len()), allowed.map(TokenMask::words))
    }

    /// Speculative verification of a drafted token at this position: the draft stands when it
    /// is the token [`Sampler::sample`] draws here. Draws are keyed by position, so a sampled
    /// draft stands with the target's probability of it and every emitted token is the one
    /// decoding without drafts would emit. Returns the token to emit and whether it is the
    /// draft.
    pub fn verify(
        &self,
        logits: &[f32],
        allowed: Option<&TokenMask>,
        context: &[u32],
        generated: &[u32],
        draft: u32,
    ) -> (u32, bool) {
        let token = self.sample(logits, allowed, context, generated);
        (token, token == draft)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(f: impl FnOnce(&mut SamplingParams)) -> Sampler {
        let mut p = SamplingParams { temperature: 1.0, seed: Some(7), ..SamplingParams::greedy() };
        f(&mut p);
        Sampler::new(p)
    }

    #[test]
    fn greedy_and_penalties() {
        let logits = [1.0, 3.0, 2.0];
        assert_eq!(Sampler::new(SamplingParams::greedy()).sample(&logits, None, &[], &[]), 1);
        let s = sampler(|p| {
            p.temperature = 0.0;
            p.repetition_penalty = 2.0;
        });
        assert_eq!(s.sample(&logits, None, &[1], &[]), 2); // 3/2 = 1.5 < 2
        let s = sampler(|p| {
            p.temperature = 0.0;
            p.frequency_penalty = 0.6;
        });
        assert_eq!(s.sample(&logits, None, &[1, 1], &[1, 1]), 2); // 3 - 1.2 = 1.8 < 2
        let s = sampler(|p| {
            p.temperature = 0.0;
            p.logit_bias = vec![(0, 1.5), (0, 1.0), (9, 50.0)]; // repeated: summed; past the vocabulary: ignored
        });
        assert_eq!(s.sample(&logits, None, &[], &[]), 0); // 1 + 2.5 = 3.5 > 3
    }

    #[test]
    fn adjustments_merge_per_token_in_transformers_order() {
        let s = sampler(|p| {
            p.logit_bias = vec![(4, 1.0)];
            p.repetition_penalty = 1.5;
            p.presence_penalty = 0.5;
            p.frequency_penalty = 0.25;
        });
        let got = s.adjustments(3, 10, &[8, 4, 4, 2], &[4, 4, 2], &[]);
        let a = |token, bias, repetition, subtract| Adjust { row: 3, token, bias, repetition, subtract };
        assert_eq!(got, [a(2, 0.0, 1.5, 0.75), a(4, 1.0, 1.5, 1.0), a(8, 0.0, 1.5, 0.0)]);
        // Drafted tokens count as context and output alike.
        assert_eq!(s.adjustments(3, 10, &[8, 4], &[4], &[4, 2]), got);
        assert!(sampler(|_| {}).adjustments(0, 10, &[1, 2], &[2], &[]).is_empty());
    }

    #[test]
    fn a_temperature_too_small_for_f32_samples_greedily() {
        // 1e-46 is 0 as f32: dividing by it gave NaN probabilities and the worst candidate.
        for t in [1e-46, 1e-6] {
            let s = sampler(|p| p.temperature = t);
            assert_eq!(s.sample(&[1.0, 3.0, 2.0, -1.0], None, &[], &[]), 1, "temperature {t}");
        }
        let mut p = SamplingParams::greedy();
        let out_of_range: [(&str, fn(&mut SamplingParams)); 3] = [
            ("repetition_penalty", |q| q.repetition_penalty = 1e-46),
            ("presence_penalty", |q| q.presence_penalty = -1e39),
            ("frequency_penalty", |q| q.frequency_penalty = 2.5),
        ];
        for (field, set) in out_of_range {
            let mut q = p.clone();
            set(&mut q);
            assert!(q.validate().unwrap_err().starts_with(field), "{q:?}");
        }
        p.presence_penalty = -2.0;
        p.frequency_penalty = 2.0;
        assert_eq!(p.validate(), Ok(()));
    }

    /// How often each token is drawn over 20,000 output positions.
    fn counts(s: &Sampler, logits: &[f32]) -> Vec<usize> {
        let mut c = vec![0; logits.len()];
        let mut generated = Vec::new();
        for _ in 0..20_000 {
            let t = s.sample(logits, None, &[], &generated);
            c[t as usize] += 1;
            generated.push(t);
        }
        c
    }

    #[test]
    fn filters_restrict_support_and_draws_follow_probabilities() {
        let logits: Vec<f32> = vec![2.0, 1.0, 0.0, -1.0, -9.0];
        let c = counts(&sampler(|p| p.top_k = 2), &logits);
        assert_eq!(c[2] + c[3] + c[4], 0);
        // Softmax over {2, 1}: p0 = 0.731.
        assert!((c[0] as f64 / 20_000.0 - 0.731).abs() < 0.02, "{c:?}");
        // Full softmax: 0.644, 0.237, 0.087, 0.032, ~0. top_p 0.7 and min_p 0.3 both keep two.
        for c in [counts(&sampler(|p| p.top_p = 0.7), &logits), counts(&sampler(|p| p.min_p = 0.3), &logits)] {
            assert_eq!(c[2] + c[3] + c[4], 0, "{c:?}");
            assert!((c[0] as f64 / 20_000.0 - 0.731).abs() < 0.02, "{c:?}");
        }
    }

    #[test]
    fn a_token_depends_on_seed_and_output_position_alone() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let run = |seed| {
            let s = sampler(|p| p.seed = Some(seed));
            let mut out = Vec::new();
            for _ in 0..30 {
                out.push(s.sample(&logits, None, &[], &out));
            }
            out
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
        // Resuming at position 8 is a new sampler with the output so far: nothing else to carry.
        let whole = run(5);
        let resumed = sampler(|p| p.seed = Some(5));
        assert_eq!(resumed.sample(&logits, None, &[], &whole[..8]), whole[8]);
        // A draft stands exactly when it is the token drawn there.
        assert_eq!(resumed.verify(&logits, None, &[], &whole[..8], whole[8]), (whole[8], true));
        let other = (whole[8] + 1) % 50;
        assert_eq!(resumed.verify(&logits, None, &[], &whole[..8], other), (whole[8], false));
    }
}

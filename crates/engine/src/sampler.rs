//! Per-request sampling: penalties, temperature, top-k, top-p, min-p, and a seeded RNG.
//! Processing order follows transformers, after the logit bias: repetition penalty, presence/frequency penalties,
//! temperature, top-k, top-p, min-p, then a draw.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata_kernels::sampling::first_max;

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

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Random draws made so far: a seeded sampler that replays this many is where it was.
    draws: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_rng(&mut rand::rng()),
        };
        Self { params, rng, draws: 0 }
    }

    /// A sampler in the state `Sampler::new(params)` reaches after `draws` random draws, for
    /// resuming a seeded generation exactly.
    pub fn resumed(params: SamplingParams, draws: u64) -> Self {
        let mut sampler = Self::new(params);
        for _ in 0..draws {
            sampler.draw();
        }
        sampler
    }

    pub fn draws(&self) -> u64 {
        self.draws
    }

    fn draw(&mut self) -> f64 {
        self.draws += 1;
        self.rng.random::<f64>()
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether this sampler's choice is the logits' argmax as they come: greedy, with no bias
    /// or penalty that reads or changes them first.
    pub fn is_plain_argmax(&self) -> bool {
        let p = &self.params;
        p.is_greedy()
            && p.logit_bias.is_empty()
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
    }

    /// Picks the next token from `logits` (one row, f32), among the tokens `allowed` allows
    /// (structured output; `None`: any). `context` is every token so far (prompt and output),
    /// `generated` the output alone.
    pub fn sample(&mut self, logits: &[f32], allowed: Option<&TokenMask>, context: &[u32], generated: &[u32]) -> u32 {
        match self.distribution(logits, allowed, context, generated) {
            Choice::Greedy(id) => id,
            Choice::Weighted { ids, probs } => self.pick(&ids, &probs),
        }
    }

    /// Speculative verification of a drafted token at this position. Greedy: the draft stands
    /// when it is the target's choice. Sampling (drafts are proposed deterministically, a point
    /// mass): the draft stands with the target's probability of it, else a token is drawn from
    /// the target's distribution without it — so each emitted token is distributed exactly as
    /// [`Sampler::sample`] would draw it. Returns the token to emit and whether it is the draft.
    pub fn verify(
        &mut self,
        logits: &[f32],
        allowed: Option<&TokenMask>,
        context: &[u32],
        generated: &[u32],
        draft: u32,
    ) -> (u32, bool) {
        match self.distribution(logits, allowed, context, generated) {
            Choice::Greedy(id) => (id, id == draft),
            Choice::Weighted { ids, mut probs } => {
                let at = ids.iter().position(|&id| id == draft as usize);
                let p_draft = at.map_or(0.0, |i| probs[i]) / probs.iter().sum::<f64>();
                if at.is_some() && self.draw() < p_draft {
                    return (draft, true);
                }
                if let Some(i) = at.filter(|_| probs.len() > 1) {
                    probs[i] = 0.0;
                }
                (self.pick(&ids, &probs), false)
            }
        }
    }

    /// The distribution the next token is drawn from, after bias, penalties and filters.
    fn distribution(&self, logits: &[f32], allowed: Option<&TokenMask>, context: &[u32], generated: &[u32]) -> Choice {
        let p = &self.params;
        let mut logits = logits.to_vec();
        if let Some(allowed) = allowed {
            allowed.restrict(&mut logits);
        }
        for &(t, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; logits.len()];
            for &t in context {
                if let Some(l) = logits.get_mut(t as usize) {
                    if !std::mem::replace(&mut seen[t as usize], true) {
                        let r = p.repetition_penalty as f32;
                        *l = if *l > 0.0 { *l / r } else { *l * r };
                    }
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts = std::collections::HashMap::new();
            for &t in generated {
                *counts.entry(t as usize).or_insert(0u32) += 1;
            }
            for (t, n) in counts {
                if let Some(l) = logits.get_mut(t) {
                    *l -= (p.presence_penalty + p.frequency_penalty * n as f64) as f32;
                }
            }
        }
        if p.is_greedy() {
            return Choice::Greedy(first_max(&logits));
        }
        let t = p.temperature as f32;
        // Candidates sorted by logit, best first.
        let mut idx: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
        if idx.is_empty() {
            return Choice::Greedy(first_max(&logits));
        }
        idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if p.top_k > 0 {
            idx.truncate(p.top_k);
        }
        let max = logits[idx[0]] / t;
        let mut probs: Vec<f64> = idx.iter().map(|&i| ((logits[i] / t - max) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs.iter().position(|&x| {
                acc += x;
                acc >= p.top_p
            });
            let keep = keep.map_or(probs.len(), |k| k + 1);
            probs.truncate(keep);
            idx.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            let keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
            probs.truncate(keep);
            idx.truncate(keep);
        }
        Choice::Weighted { ids: idx, probs }
    }

    /// One draw from unnormalised weights `probs` over `ids`.
    fn pick(&mut self, ids: &[usize], probs: &[f64]) -> u32 {
        let total: f64 = probs.iter().sum();
        let mut draw = self.draw() * total;
        for (k, &x) in probs.iter().enumerate() {
            draw -= x;
            if draw < 0.0 && x > 0.0 {
                return ids[k] as u32;
            }
        }
        let last = probs.iter().rposition(|&x| x > 0.0).unwrap_or(probs.len() - 1);
        ids[last] as u32
    }
}

/// What the sampler draws the next token from.
enum Choice {
    Greedy(u32),
    /// Candidate ids and their (unnormalised) probabilities, best first.
    Weighted {
        ids: Vec<usize>,
        probs: Vec<f64>,
    },
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
        let mut s = sampler(|p| {
            p.temperature = 0.0;
            p.repetition_penalty = 2.0;
        });
        assert_eq!(s.sample(&logits, None, &[1], &[]), 2); // 3/2 = 1.5 < 2
        let mut s = sampler(|p| {
            p.temperature = 0.0;
            p.frequency_penalty = 0.6;
        });
        assert_eq!(s.sample(&logits, None, &[1, 1], &[1, 1]), 2); // 3 - 1.2 = 1.8 < 2
    }

    #[test]
    fn a_temperature_too_small_for_f32_samples_greedily() {
        // 1e-46 is 0 as f32: dividing by it gave NaN probabilities and the worst candidate.
        for t in [1e-46, 1e-6] {
            let mut s = sampler(|p| p.temperature = t);
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

    #[test]
    fn filters_restrict_support_and_draws_follow_probabilities() {
        let logits: Vec<f32> = vec![2.0, 1.0, 0.0, -1.0, -9.0];
        let count = |s: &mut Sampler| {
            let mut c = [0usize; 5];
            for _ in 0..20_000 {
                c[s.sample(&logits, None, &[], &[]) as usize] += 1;
            }
            c
        };
        let c = count(&mut sampler(|p| p.top_k = 2));
        assert_eq!(c[2] + c[3] + c[4], 0);
        // Softmax over {2, 1}: p0 = 0.731.
        assert!((c[0] as f64 / 20_000.0 - 0.731).abs() < 0.02, "{c:?}");
        // Full softmax: 0.644, 0.237, 0.087, 0.032, ~0. top_p 0.7 and min_p 0.3 both keep two.
        for c in [count(&mut sampler(|p| p.top_p = 0.7)), count(&mut sampler(|p| p.min_p = 0.3))] {
            assert_eq!(c[2] + c[3] + c[4], 0, "{c:?}");
            assert!((c[0] as f64 / 20_000.0 - 0.731).abs() < 0.02, "{c:?}");
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let run = |seed| {
            let mut s = sampler(|p| p.seed = Some(seed));
            (0..30).map(|_| s.sample(&logits, None, &[], &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn resumed_sampler_continues_the_same_sequence() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut whole = sampler(|p| p.seed = Some(5));
        let all: Vec<u32> = (0..20).map(|_| whole.sample(&logits, None, &[], &[])).collect();
        let mut first = sampler(|p| p.seed = Some(5));
        for _ in 0..8 {
            first.sample(&logits, None, &[], &[]);
        }
        let mut rest = Sampler::resumed(first.params().clone(), first.draws());
        let tail: Vec<u32> = (8..20).map(|_| rest.sample(&logits, None, &[], &[])).collect();
        assert_eq!(tail, all[8..]);
    }
}

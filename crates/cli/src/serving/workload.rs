//! What the serving benchmark sends, and when: random token-id prompts, and Poisson arrivals.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Requests per second of a run's arrivals.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rate {
    PerSecond(f64),
    /// `inf`: every request at once.
    Unlimited,
}

impl FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("inf") {
            return Ok(Rate::Unlimited);
        }
        match s.parse::<f64>() {
            Ok(r) if r.is_finite() && r > 0.0 => Ok(Rate::PerSecond(r)),
            _ => Err(format!("`{s}` is not a request rate (requests per second above 0, or inf)")),
        }
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Rate::PerSecond(r) => write!(f, "{r}"),
            Rate::Unlimited => f.write_str("inf"),
        }
    }
}

impl Rate {
    /// As vLLM writes it in its results: a number, or the string `inf`.
    pub fn json(self) -> serde_json::Value {
        match self {
            Rate::PerSecond(r) => r.into(),
            Rate::Unlimited => "inf".into(),
        }
    }
}

/// One request of the workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
}

/// `n` requests of random token ids below `vocab_size`, prompt and output lengths drawn
/// uniformly from [len·(1−ratio), len·(1+ratio)] (vLLM's `--random-range-ratio`), at least 1:
/// the same requests for the same seed, so every rate of a sweep, and every server, gets the
/// same workload.
pub fn requests(n: usize, (prompt_len, output_len): (usize, usize), ratio: f64, vocab_size: usize, seed: u64) -> Vec<Request> {
    let mut rng = StdRng::seed_from_u64(seed);
    let vocab = u32::try_from(vocab_size).unwrap_or(u32::MAX);
    (0..n)
        .map(|_| {
            let prompt_len = around(prompt_len, ratio, &mut rng);
            let max_tokens = around(output_len, ratio, &mut rng);
            Request { prompt: (0..prompt_len).map(|_| rng.random_range(0..vocab)).collect(), max_tokens }
        })
        .collect()
}

fn around(len: usize, ratio: f64, rng: &mut StdRng) -> usize {
    let low = (len as f64 * (1.0 - ratio)).floor() as usize;
    let high = (len as f64 * (1.0 + ratio)).ceil() as usize;
    rng.random_range(low.max(1)..=high.max(1))
}

/// When each of `n` requests is sent, from the run's start: a Poisson process at `rate` (the
/// first at once, then exponential gaps of mean 1/rate, as `vllm bench serve` draws them);
/// all at once for `inf`. A seed draws the same pattern at every rate, scaled.
pub fn arrivals(n: usize, rate: Rate, seed: u64) -> Vec<Duration> {
    let Rate::PerSecond(rate) = rate else { return vec![Duration::ZERO; n] };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut at = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                // Inverse transform: 1 − U is in (0, 1], so the logarithm is finite.
                at += -(1.0 - rng.random::<f64>()).ln() / rate;
            }
            Duration::from_secs_f64(at)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_as_vllm_writes_them() {
        assert_eq!("inf".parse(), Ok(Rate::Unlimited));
        assert_eq!("2.5".parse(), Ok(Rate::PerSecond(2.5)));
        for bad in ["0", "-1", "nan", "fast"] {
            assert!(bad.parse::<Rate>().is_err(), "{bad}");
        }
        assert_eq!((Rate::PerSecond(16.0).to_string(), Rate::Unlimited.to_string()), ("16".into(), "inf".into()));
        assert_eq!((Rate::PerSecond(4.0).json(), Rate::Unlimited.json()), (4.0.into(), "inf".into()));
    }

    #[test]
    fn poisson_gaps_average_one_over_the_rate() {
        let n = 20_000;
        let at = arrivals(n, Rate::PerSecond(4.0), 7);
        assert_eq!(at[0], Duration::ZERO);
        assert!(at.windows(2).all(|w| w[0] <= w[1]));
        let mean_gap = at[n - 1].as_secs_f64() / (n - 1) as f64;
        assert!((mean_gap - 0.25).abs() < 0.25 * 0.03, "mean gap {mean_gap} s at 4 requests/s");
        // Exponential gaps: as many shorter as longer than the mean·ln 2 (their median).
        let gaps: Vec<f64> = at.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
        let below_median = gaps.iter().filter(|&&g| g < 0.25 * 2f64.ln()).count() as f64 / gaps.len() as f64;
        assert!((below_median - 0.5).abs() < 0.02, "{below_median} of the gaps below the median");
        // The same seed draws the same pattern at every rate.
        let faster = arrivals(n, Rate::PerSecond(8.0), 7);
        assert!((faster[100].as_secs_f64() * 2.0 - at[100].as_secs_f64()).abs() < 1e-9);
    }

    #[test]
    fn an_unlimited_rate_sends_everything_at_once() {
        assert_eq!(arrivals(5, Rate::Unlimited, 7), vec![Duration::ZERO; 5]);
    }

    #[test]
    fn workloads_are_fixed_by_the_seed_and_lengths_stay_in_range() {
        let fixed = requests(50, (16, 8), 0.0, 100, 3);
        assert_eq!(fixed, requests(50, (16, 8), 0.0, 100, 3));
        assert_ne!(fixed, requests(50, (16, 8), 0.0, 100, 4));
        assert!(fixed.iter().all(|r| r.prompt.len() == 16 && r.max_tokens == 8));
        assert!(fixed.iter().flat_map(|r| &r.prompt).all(|&t| t < 100));
        assert_ne!(fixed[0].prompt, fixed[1].prompt);

        let spread = requests(2_000, (100, 10), 0.5, 100, 3);
        let prompt_lens: Vec<usize> = spread.iter().map(|r| r.prompt.len()).collect();
        let output_lens: Vec<usize> = spread.iter().map(|r| r.max_tokens).collect();
        assert_eq!((prompt_lens.iter().min(), prompt_lens.iter().max()), (Some(&50), Some(&150)));
        assert_eq!((output_lens.iter().min(), output_lens.iter().max()), (Some(&5), Some(&15)));
        let mean = prompt_lens.iter().sum::<usize>() as f64 / prompt_lens.len() as f64;
        assert!((mean - 100.0).abs() < 2.0, "mean prompt length {mean}");
        // Never empty, however wide the range.
        assert!(requests(200, (1, 1), 0.99, 100, 3).iter().all(|r| !r.prompt.is_empty() && r.max_tokens >= 1));
    }
}

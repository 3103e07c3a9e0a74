//! A run's metrics, as `vllm bench serve` defines them.

use std::time::Duration;

/// What a request that succeeded measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub prompt_tokens: usize,
    /// Generated tokens, as the server's usage counts them.
    pub output_tokens: usize,
    /// From sending the request to its first output chunk.
    pub ttft: Duration,
    /// From sending the request to its last output chunk.
    pub latency: Duration,
    /// The gaps between its consecutive output chunks.
    pub itl: Vec<Duration>,
}

/// Mean, median and 99th percentile of a latency, in milliseconds (all 0 when nothing was
/// measured, as vLLM reports it).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Spread {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

impl Spread {
    fn of(mut ms: Vec<f64>) -> Self {
        if ms.is_empty() {
            return Self::default();
        }
        ms.sort_by(f64::total_cmp);
        Self { mean: ms.iter().sum::<f64>() / ms.len() as f64, p50: percentile(&ms, 50.0), p99: percentile(&ms, 99.0) }
    }
}

/// The `p`th percentile of sorted values, interpolated linearly between the nearest ranks
/// (numpy's default, which vLLM uses).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let (below, above) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[below] + (sorted[above] - sorted[below]) * (rank - below as f64)
}

/// One run at one request rate.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub completed: usize,
    pub failed: usize,
    /// From the first request sent to the last one done.
    pub duration_s: f64,
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// Completed requests, their output tokens, and their prompt and output tokens together,
    /// per second of the run.
    pub req_s: f64,
    pub output_tok_s: f64,
    pub total_tok_s: f64,
    pub ttft: Spread,
    /// Time per output token after the first, of each request with more than one.
    pub tpot: Spread,
    /// Inter-token latency: the gaps between consecutive output chunks of all requests.
    pub itl: Spread,
    /// End-to-end latency.
    pub e2el: Spread,
    /// Why the first failed request failed.
    pub first_error: Option<String>,
    /// What strata's engine counted during the run, where it runs in this process.
    pub engine: Option<strata_engine::Counters>,
}

impl Summary {
    /// The metrics of a run that took `duration`; failed requests count only as failures.
    pub fn of(results: &[Result<Completion, String>], duration: Duration) -> Self {
        let done: Vec<&Completion> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let duration_s = duration.as_secs_f64();
        let per_second = |n: usize| if duration_s > 0.0 { n as f64 / duration_s } else { 0.0 };
        let input_tokens = done.iter().map(|c| c.prompt_tokens).sum();
        let output_tokens = done.iter().map(|c| c.output_tokens).sum();
        let tpot = done
            .iter()
            .filter(|c| c.output_tokens > 1)
            .map(|c| ms(c.latency.saturating_sub(c.ttft)) / (c.output_tokens - 1) as f64)
            .collect();
        Self {
            completed: done.len(),
            failed: results.len() - done.len(),
            duration_s,
            input_tokens,
            output_tokens,
            req_s: per_second(done.len()),
            output_tok_s: per_second(output_tokens),
            total_tok_s: per_second(input_tokens + output_tokens),
            ttft: Spread::of(done.iter().map(|c| ms(c.ttft)).collect()),
            tpot: Spread::of(tpot),
            itl: Spread::of(done.iter().flat_map(|c| c.itl.iter().map(|&gap| ms(gap))).collect()),
            e2el: Spread::of(done.iter().map(|c| ms(c.latency)).collect()),
            first_error: results.iter().find_map(|r| r.as_ref().err().cloned()),
            engine: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(values: &[u64]) -> Vec<Duration> {
        values.iter().map(|&v| Duration::from_millis(v)).collect()
    }

    #[test]
    fn percentiles_interpolate_between_ranks_as_numpy_does() {
        let sorted = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&sorted, 50.0), 2.5);
        assert!((percentile(&sorted, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!((percentile(&sorted, 0.0), percentile(&sorted, 100.0)), (1.0, 4.0));
        assert_eq!(percentile(&[5.0], 99.0), 5.0);
        let spread = Spread::of(vec![4.0, 1.0, 3.0, 2.0]);
        assert_eq!((spread.mean, spread.p50), (2.5, 2.5));
    }

    #[test]
    fn a_run_summed_by_hand() {
        let results = vec![
            // 5 tokens: TPOT (500 − 100) / 4 = 100 ms.
            Ok(Completion {
                prompt_tokens: 10,
                output_tokens: 5,
                ttft: Duration::from_millis(100),
                latency: Duration::from_millis(500),
                itl: ms(&[50, 150, 100, 100]),
            }),
            Err("HTTP 500: boom".to_string()),
            // One token: no TPOT, no gap.
            Ok(Completion {
                prompt_tokens: 20,
                output_tokens: 1,
                ttft: Duration::from_millis(200),
                latency: Duration::from_millis(200),
                itl: vec![],
            }),
            Err("later".to_string()),
        ];
        let s = Summary::of(&results, Duration::from_secs(2));
        assert_eq!((s.completed, s.failed, s.input_tokens, s.output_tokens), (2, 2, 30, 6));
        assert_eq!((s.duration_s, s.req_s, s.output_tok_s, s.total_tok_s), (2.0, 1.0, 3.0, 18.0));
        let close = |got: Spread, want: (f64, f64, f64)| {
            assert!(
                (got.mean - want.0).abs() < 1e-9 && (got.p50 - want.1).abs() < 1e-9 && (got.p99 - want.2).abs() < 1e-9,
                "{got:?} vs {want:?}"
            );
        };
        close(s.ttft, (150.0, 150.0, 100.0 + 100.0 * 0.99));
        close(s.tpot, (100.0, 100.0, 100.0));
        // Gaps sorted 50, 100, 100, 150: p99 at rank 2.97.
        close(s.itl, (100.0, 100.0, 100.0 + 50.0 * 0.97));
        close(s.e2el, (350.0, 350.0, 200.0 + 300.0 * 0.99));
        assert_eq!(s.first_error.as_deref(), Some("HTTP 500: boom"));
    }

    #[test]
    fn a_run_where_everything_failed_reports_zeros() {
        let s = Summary::of(&[Err("refused".into())], Duration::from_millis(3));
        assert_eq!((s.completed, s.failed, s.req_s, s.output_tok_s), (0, 1, 0.0, 0.0));
        assert_eq!((s.ttft, s.tpot, s.itl, s.e2el), (Spread::default(), Spread::default(), Spread::default(), Spread::default()));
    }
}

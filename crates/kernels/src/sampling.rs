//! Choosing each row's next token where the logits are: the greedy argmax, and seeded draws with
//! temperature, top-k, top-p and min-p, after logit adjustments (bias, penalties) and within a
//! row's mask (structured output). On CUDA it is a few kernels and only token ids cross to the
//! host (and the small inputs to the device); the CPU path is the same arithmetic, operation for
//! operation, so a row draws the same token on either.
//!
//! A draw is a race (the Gumbel-max trick): each candidate's key is its log-weight plus
//! `-ln(-ln u)` for a uniform `u` hashed from (seed, position, token), and the largest key wins.
//! That draws exactly from the filtered softmax, needs no sort and no running sum, and depends on
//! nothing but the row's logits and (seed, position): a row draws the same token alone or in any
//! batch, a checkpoint resumes with no sampler state, and a speculative round's drafted position
//! draws the very token plain decoding would — a draft stands when it is that token, which it is
//! with the target's probability of it.

use candle_core::{DType, Tensor};

use crate::Result;

/// The index of the first maximum of `logits` (NaN never wins; 0 for an empty or all-NaN row).
pub fn first_max(logits: &[f32]) -> u32 {
    first_allowed_max(logits, None)
}

/// [`first_max`] among the entries `mask` allows: bit `i % 32` of word `i / 32` (`None`: all;
/// entries past the mask's words are not allowed). 0 where it allows none.
pub fn first_allowed_max(logits: &[f32], mask: Option<&[u32]>) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if !x.is_nan() && best.is_none_or(|(_, b)| x > b) && allowed(mask, i) {
            best = Some((i, x));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

fn allowed(mask: Option<&[u32]>, i: usize) -> bool {
    mask.is_none_or(|words| words.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1))
}

/// [`first_allowed_max`] of each row of `logits` `[R, V]`, row `r` within `masks[r]` (no masks:
/// every row unrestricted).
pub fn argmax_rows(logits: &Tensor, masks: &[Option<&[u32]>]) -> Result<Vec<u32>> {
    draw_rows(logits, &vec![Draw::GREEDY; logits.dim(0)?], masks, &[])
}

/// How one row of logits becomes a token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    /// Not above 0: the argmax (the rest is then unused).
    pub temperature: f32,
    /// Only the `top_k` best candidates (0: all).
    pub top_k: u32,
    /// Only the fewest best candidates whose probabilities reach `top_p` (1: all).
    pub top_p: f32,
    /// Only candidates at least `min_p` times as likely as the best (0: all).
    pub min_p: f32,
    pub seed: u64,
    /// Which draw of the seed's stream this is: the index of the output token being chosen.
    pub position: u64,
}

impl Draw {
    pub const GREEDY: Draw = Draw { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0, position: 0 };

    fn is_greedy(&self) -> bool {
        !(self.temperature > 0.0)
    }

    /// The least log-weight (relative to the best) min-p keeps, as both paths compare it.
    fn min_log_weight(&self) -> f32 {
        if self.min_p > 0.0 {
            (self.min_p as f64).ln() as f32
        } else {
            f32::NEG_INFINITY
        }
    }
}

/// A change to one logit before the draw, in transformers' order: `bias` added (OpenAI's
/// `logit_bias`), then a `repetition` penalty dividing a positive logit and multiplying a
/// negative one (1: none), then `subtract` taken off (presence and frequency penalties).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adjust {
    /// The row of the logits it applies to.
    pub row: u32,
    pub token: u32,
    pub bias: f32,
    pub repetition: f32,
    pub subtract: f32,
}

impl Adjust {
    /// `logit` adjusted (the CUDA kernel's arithmetic, rounding for rounding).
    pub fn apply(&self, logit: f32) -> f32 {
        let mut x = logit + self.bias;
        if self.repetition != 1.0 {
            x = if x > 0.0 { x / self.repetition } else { x * self.repetition };
        }
        x - self.subtract
    }
}

/// Each row's token from `logits` `[R, V]`: row `r` adjusted by the `adjust` entries naming it
/// (at most one per token), restricted to `masks[r]` (no masks: none), then chosen as `draws[r]`
/// says.
pub fn draw_rows(logits: &Tensor, draws: &[Draw], masks: &[Option<&[u32]>], adjust: &[Adjust]) -> Result<Vec<u32>> {
    let logits = logits.to_dtype(DType::F32)?;
    let (rows, vocab) = logits.dims2()?;
    if draws.len() != rows || (!masks.is_empty() && masks.len() != rows) {
        candle_core::bail!("draw_rows: {} draws and {} masks for {rows} rows", draws.len(), masks.len());
    }
    if let Some(a) = adjust.iter().find(|a| a.row as usize >= rows || a.token as usize >= vocab) {
        candle_core::bail!("draw_rows: an adjustment of token {} in row {} outside [{rows}, {vocab}]", a.token, a.row);
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        return gpu::draw_rows(&logits.contiguous()?, draws, masks, adjust);
    }
    let mut data = logits.to_vec2::<f32>()?;
    for a in adjust {
        let logit = &mut data[a.row as usize][a.token as usize];
        *logit = a.apply(*logit);
    }
    let mask = |r: usize| masks.get(r).copied().flatten();
    Ok(data.iter().zip(draws).enumerate().map(|(r, (row, draw))| draw_row(row, draw, mask(r))).collect())
}

/// The token `draw` picks from one row of (adjusted) `logits`, within `mask`: the argmax when
/// greedy; otherwise a race among the candidates (allowed tokens whose scaled logit
/// `z = logit / temperature` is finite) that the filters keep. Candidates are ordered best first
/// (ties: lower index first); top-k keeps the first k, top-p the fewest first ones whose weights
/// (`exp(z - z_max)` in 2^-32 units, summed exactly) reach `top_p` of the top-k's, min-p those
/// with `z - z_max` at least `ln(min_p)` — each a prefix of the order, so together the shortest.
/// A row with no candidate (all masked or infinite) takes its argmax.
pub fn draw_row(logits: &[f32], draw: &Draw, mask: Option<&[u32]>) -> u32 {
    if draw.is_greedy() {
        return first_allowed_max(logits, mask);
    }
    let mut kept: Vec<(u32, u32)> = (0..logits.len())
        .filter(|&i| allowed(mask, i))
        .map(|i| (logits[i] / draw.temperature, i as u32))
        .filter(|(z, _)| z.is_finite())
        .map(|(z, i)| (order_key(z), i))
        .collect();
    let Some(&(top, _)) = kept.iter().max_by_key(|(key, _)| *key) else { return first_allowed_max(logits, mask) };
    let z_max = from_order_key(top);
    let best_first = |a: &(u32, u32), b: &(u32, u32)| b.0.cmp(&a.0).then(a.1.cmp(&b.1));
    let k = draw.top_k as usize;
    if k > 0 && k < kept.len() {
        kept.select_nth_unstable_by(k - 1, best_first);
        kept.truncate(k);
    }
    if draw.top_p < 1.0 {
        kept.sort_unstable_by(best_first);
        let weights: Vec<u64> = kept.iter().map(|&(key, _)| weight(from_order_key(key) - z_max)).collect();
        let target = top_p_target(draw.top_p, weights.iter().sum());
        let mut sum = 0;
        let reached = weights.iter().position(|&w| {
            sum += w;
            sum >= target
        });
        kept.truncate(reached.map_or(kept.len(), |j| j + 1));
    }
    let floor = draw.min_log_weight();
    let mut best: Option<(f32, u32)> = None;
    for (key, i) in kept {
        let d = from_order_key(key) - z_max;
        if d >= floor {
            let race = d + gumbel(draw.seed, draw.position, i);
            if best.is_none_or(|(b, bi)| race > b || (race == b && i < bi)) {
                best = Some((race, i));
            }
        }
    }
    best.map_or(0, |(_, i)| i)
}

/// `z`'s place in a descending-order u32 key (larger float, larger key; -0.0 as +0.0), as the
/// CUDA kernels order values.
fn order_key(z: f32) -> u32 {
    let bits = if z == 0.0 { 0 } else { z.to_bits() };
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

fn from_order_key(key: u32) -> f32 {
    f32::from_bits(if key & 0x8000_0000 != 0 { key & 0x7fff_ffff } else { !key })
}

/// A candidate's weight `exp(d)` (d = z - z_max ≤ 0) in units of 2^-32, so that sums are exact
/// and the same in any order.
fn weight(d: f32) -> u64 {
    (exp_le0(d) * 4_294_967_296.0) as u64
}

/// The running weight top-p stops at: `top_p` of `total`, rounded up, and at least the first
/// candidate's.
fn top_p_target(top_p: f32, total: u64) -> u64 {
    ((top_p as f64 * total as f64).ceil() as u64).max(1)
}

/// `exp(x)` for `x ≤ 0` from `+`, `*` and fused multiply-adds alone, so the CUDA kernel computes
/// the same bits (libm's and CUDA's `exp` may differ in the last place): 2^n · e^r with
/// |r| ≤ ln2 / 2 and a degree-7 Taylor polynomial (relative error ~1e-7); 0 below 2^-126.
fn exp_le0(x: f32) -> f32 {
    if x < -87.0 {
        return 0.0;
    }
    let n = (x * LOG2_E + 0.5).floor();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let p = EXP_TAYLOR.iter().fold(0.0f32, |p, &c| r.mul_add(p, c));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `ln(x)` for a positive normal `x`, from `+`, `*`, `/` and fused multiply-adds alone (as
/// [`exp_le0`]): x = 2^e · f with f in [√½, √2), ln f = 2·atanh((f-1)/(f+1)) as an odd series.
fn ln_pos(x: f32) -> f32 {
    let bits = x.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 127;
    let mut f = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    if f > SQRT_2 {
        f *= 0.5;
        e += 1;
    }
    let s = (f - 1.0) / (f + 1.0);
    let s2 = s * s;
    let p = ATANH_SERIES.iter().fold(0.0f32, |p, &c| s2.mul_add(p, c));
    (e as f32).mul_add(LN_2, (s + s) * p)
}

/// The race's noise for `token` at (seed, position): `-ln(-ln u)` of a uniform `u` hashed from
/// the three (splitmix64's finaliser): 23 bits and a half, so `u` is exact and strictly inside
/// (0, 1) (24 bits would round the last step up to 1).
fn gumbel(seed: u64, position: u64, token: u32) -> f32 {
    let h = mix(mix(seed ^ position.wrapping_mul(0x9e37_79b9_7f4a_7c15)) ^ u64::from(token).wrapping_mul(0xd1b5_4a32_d192_ed03));
    let u = ((h >> 41) as f32 + 0.5) * (1.0 / 8_388_608.0);
    -ln_pos(-ln_pos(u))
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

// The constants by their bits, as cuda/sampling.cu spells them.
const LOG2_E: f32 = f32::from_bits(0x3fb8_aa3b);
const LN_2: f32 = f32::from_bits(0x3f31_7218);
/// ln 2 in two parts (cephes'), for an exact-enough `x - n·ln2`.
const LN2_HI: f32 = f32::from_bits(0x3f31_8000);
const LN2_LO: f32 = f32::from_bits(0xb95e_8083);
const SQRT_2: f32 = f32::from_bits(0x3fb5_04f3);
/// 1/7!, 1/6!, …, 1/1!, 1/0!, highest first (Horner).
const EXP_TAYLOR: [f32; 8] = [
    f32::from_bits(0x39500d01),
    f32::from_bits(0x3ab60b61),
    f32::from_bits(0x3c088889),
    f32::from_bits(0x3d2aaaab),
    f32::from_bits(0x3e2aaaab),
    0.5,
    1.0,
    1.0,
];
/// 1/11, 1/9, …, 1/3, 1, highest first: atanh(s)/s = Σ s^2k / (2k+1).
const ATANH_SERIES: [f32; 6] = [
    f32::from_bits(0x3dba2e8c),
    f32::from_bits(0x3de38e39),
    f32::from_bits(0x3e124925),
    f32::from_bits(0x3e4ccccd),
    f32::from_bits(0x3eaaaaab),
    1.0,
];

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::{DType, Tensor};

    use super::{Adjust, Draw};
    use crate::cuda::{self, Arg};
    use crate::Result;

    /// Logits per block and threads per block of the argmax kernel; threads of a drawing block
    /// (cuda/sampling.cu).
    const CHUNK: usize = 8192;
    const THREADS: u32 = 256;
    const DRAW_THREADS: u32 = 1024;
    /// u32 words of a drawn row's parameters, and of an adjustment, as the kernels read them.
    const DRAW_WORDS: usize = 10;
    const ADJUST_WORDS: usize = 5;

    /// Three launches on the device's stream, one copy back: the adjustments in place on a copy
    /// of the logits; every row's argmax key, each block of a row folding its chunk's best into
    /// the row's key with an atomic max (a row is ~31 blocks, not one block walking the whole
    /// vocabulary); then one block per drawn row overwriting its key with the race's winner (a
    /// row without candidates keeps its argmax, as the CPU path takes it).
    pub(super) fn draw_rows(logits: &Tensor, draws: &[Draw], masks: &[Option<&[u32]>], adjust: &[Adjust]) -> Result<Vec<u32>> {
        let (rows, vocab) = logits.dims2()?;
        if rows == 0 || vocab == 0 {
            return Ok(vec![0; rows]);
        }
        let device = logits.device();
        let words = vocab.div_ceil(32);
        let (mut packed, mut which) = (Vec::new(), vec![-1i32; rows]);
        for (r, mask) in masks.iter().enumerate() {
            if let Some(mask) = mask {
                which[r] = (packed.len() / words) as i32;
                let from = packed.len();
                packed.extend(mask.iter().take(words));
                packed.resize(from + words, 0); // a short mask allows nothing past its end
            }
        }
        let masked = match packed.len() {
            0 => None,
            n => Some((Tensor::from_vec(packed, n, device)?, Tensor::new(which, device)?)),
        };
        let logits = match adjust.len() {
            0 => logits.clone(),
            n => {
                let adjusted = logits.copy()?;
                let entries: Vec<u32> = adjust
                    .iter()
                    .flat_map(|a| [a.row, a.token, a.bias.to_bits(), a.repetition.to_bits(), a.subtract.to_bits()])
                    .collect();
                let entries = Tensor::from_vec(entries, n * ADJUST_WORDS, device)?;
                let cfg = LaunchConfig { grid_dim: (n.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                let args = [Arg::at(&adjusted)?, Arg::dim(vocab)?, Arg::at(&entries)?, Arg::dim(n)?];
                cuda::launch(device, &cuda::SAMPLING, "adjust", DType::F32, cfg, &args)?;
                adjusted
            }
        };
        let mask_args = || -> Result<[Arg; 3]> {
            Ok([
                Arg::at_or_null(masked.as_ref().map(|(m, _)| m))?,
                Arg::at_or_null(masked.as_ref().map(|(_, w)| w))?,
                Arg::dim(words)?,
            ])
        };
        let keys = Tensor::zeros(rows, DType::I64, device)?;
        let chunks = u32::try_from(vocab.div_ceil(CHUNK)).map_err(candle_core::Error::wrap)?;
        let rows_y = u32::try_from(rows).ok().filter(|&r| r <= 65_535);
        let rows_y = rows_y.ok_or_else(|| candle_core::Error::Msg(format!("argmax of {rows} rows exceeds a CUDA grid")))?;
        let cfg = LaunchConfig { grid_dim: (chunks, rows_y, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let [m, w, n] = mask_args()?;
        let args = [Arg::at(&logits)?, Arg::at(&keys)?, Arg::dim(vocab)?, m, w, n];
        cuda::launch(device, &cuda::SAMPLING, "argmax_keys", DType::F32, cfg, &args)?;
        let drawn: Vec<u32> = draws
            .iter()
            .enumerate()
            .filter(|(_, d)| !d.is_greedy())
            .flat_map(|(r, d)| {
                let (seed, position) = (d.seed, d.position);
                [
                    r as u32,
                    d.top_k,
                    d.temperature.to_bits(),
                    d.top_p.to_bits(),
                    d.min_log_weight().to_bits(),
                    seed as u32,
                    (seed >> 32) as u32,
                    position as u32,
                    (position >> 32) as u32,
                    0,
                ]
            })
            .collect();
        if !drawn.is_empty() {
            let n = drawn.len() / DRAW_WORDS;
            let params = Tensor::from_vec(drawn, n * DRAW_WORDS, device)?;
            let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (DRAW_THREADS, 1, 1), shared_mem_bytes: 0 };
            let [m, w, words] = mask_args()?;
            let args = [Arg::at(&logits)?, Arg::dim(vocab)?, Arg::at(&params)?, m, w, words, Arg::at(&keys)?];
            cuda::launch(device, &cuda::SAMPLING, "draw", DType::F32, cfg, &args)?;
        }
        // The key's low word is the index complemented; no key (0) is a row of NaN.
        Ok(keys.to_vec1::<i64>()?.into_iter().map(|key| if key == 0 { 0 } else { u32::MAX - key as u32 }).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn first_max_takes_the_first_of_ties_and_skips_nan() {
        assert_eq!(first_max(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(first_max(&[f32::NAN, -1.0, f32::NAN, 0.5]), 3);
        assert_eq!(first_max(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(first_max(&[f32::NAN]), 0);
        assert_eq!(first_max(&[]), 0);
    }

    #[test]
    fn first_allowed_max_skips_what_the_mask_forbids() {
        let logits: Vec<f32> = (0..70).map(|i| (i % 7) as f32).collect(); // maxima at 6, 13, 20, ...
        assert_eq!(first_allowed_max(&logits, None), 6);
        // Word 0 allows 3 and 13; word 1 allows 34 (= 32 + 2); nothing past the words (64+).
        let mask = [(1 << 3) | (1 << 13), 1 << 2];
        assert_eq!(first_allowed_max(&logits, Some(&mask)), 13);
        assert_eq!(first_allowed_max(&logits, Some(&[1 << 3, 1 << 2])), 34); // 34 % 7 = 6 > 3
        assert_eq!(first_allowed_max(&logits, Some(&[0, 0])), 0);
        let rows = Tensor::new(&[[1f32, 5.0, 2.0], [4.0, 0.0, 9.0]], &Device::Cpu).unwrap();
        assert_eq!(argmax_rows(&rows, &[]).unwrap(), [1, 2]);
        assert_eq!(argmax_rows(&rows, &[Some(&[0b101]), None]).unwrap(), [2, 2]);
    }

    #[test]
    fn exp_and_ln_are_accurate_to_a_few_ulps() {
        for k in 0..20_000 {
            let x = -(k as f32) * 0.0043;
            let (got, want) = (exp_le0(x) as f64, (x as f64).exp());
            assert!((got - want).abs() <= 4e-7 * want, "exp({x}) = {got}, not {want}");
        }
        assert_eq!(exp_le0(0.0), 1.0);
        assert_eq!(exp_le0(-100.0), 0.0);
        assert_eq!(exp_le0(f32::NEG_INFINITY), 0.0);
        for k in 1..20_000 {
            let x = (k as f32 / 20_000.0).powi(3) * 40.0;
            let (got, want) = (ln_pos(x) as f64, (x as f64).ln());
            assert!((got - want).abs() <= 3e-7 * want.abs().max(1.0), "ln({x}) = {got}, not {want}");
        }
    }

    fn draw(f: impl FnOnce(&mut Draw)) -> Draw {
        let mut d = Draw { temperature: 1.0, seed: 7, ..Draw::GREEDY };
        f(&mut d);
        d
    }

    /// How often each token wins over `n` positions.
    fn counts(logits: &[f32], d: Draw, mask: Option<&[u32]>, n: u64) -> Vec<usize> {
        let mut c = vec![0; logits.len()];
        for position in 0..n {
            c[draw_row(logits, &Draw { position, ..d }, mask) as usize] += 1;
        }
        c
    }

    #[test]
    fn draws_follow_the_softmax_of_what_the_filters_keep() {
        let logits = [2.0f32, 1.0, 0.0, -1.0, -9.0];
        let n = 40_000;
        let share = |c: &[usize], i: usize| c[i] as f64 / n as f64;
        // Full softmax at temperature 1: 0.644, 0.237, 0.087, 0.032, ~0.
        let c = counts(&logits, draw(|_| {}), None, n);
        for (i, p) in [0.644, 0.237, 0.087, 0.032].into_iter().enumerate() {
            assert!((share(&c, i) - p).abs() < 0.01, "token {i}: {c:?}");
        }
        // Temperature 2 flattens it: softmax of [1, 0.5, 0, -0.5, -4.5].
        let c = counts(&logits, draw(|d| d.temperature = 2.0), None, n);
        assert!((share(&c, 0) - 0.455).abs() < 0.01, "{c:?}");
        // top_k 2, top_p 0.7 and min_p 0.3 each keep {0, 1}: 0.731 / 0.269.
        for d in [draw(|d| d.top_k = 2), draw(|d| d.top_p = 0.7), draw(|d| d.min_p = 0.3)] {
            let c = counts(&logits, d, None, n);
            assert_eq!(c[2] + c[3] + c[4], 0, "{d:?}: {c:?}");
            assert!((share(&c, 0) - 0.731).abs() < 0.01, "{d:?}: {c:?}");
        }
        // top_p 0.95 needs the third (0.644 + 0.237 = 0.881), not the fourth.
        let c = counts(&logits, draw(|d| d.top_p = 0.95), None, n);
        assert!(c[2] > 0 && c[3] + c[4] == 0, "{c:?}");
        // A mask leaves 1 and 3: softmax of [1, -1].
        let c = counts(&logits, draw(|_| {}), Some(&[0b01010]), n);
        assert_eq!(c[0] + c[2] + c[4], 0, "{c:?}");
        assert!((share(&c, 1) - 0.881).abs() < 0.01, "{c:?}");
    }

    #[test]
    fn filters_cut_ties_by_index() {
        // Three equal best, two equal next: top-k 2 keeps the first two of the best.
        let logits = [0.0f32, 3.0, 1.0, 3.0, 3.0, 1.0];
        let kept = |d: Draw| counts(&logits, d, None, 3000).iter().map(|&c| c > 0).collect::<Vec<_>>();
        assert_eq!(kept(draw(|d| d.top_k = 2)), [false, true, false, true, false, false]);
        assert_eq!(kept(draw(|d| d.top_k = 4)), [false, true, true, true, true, false]);
        // Each best is 0.301 of the whole, each 1.0 is 0.041: top_p 0.5 needs two of the best,
        // 0.92 all three and the first 1.0 (0.904 + 0.041 = 0.944), 0.95 both 1.0s.
        assert_eq!(kept(draw(|d| d.top_p = 0.5)), [false, true, false, true, false, false]);
        assert_eq!(kept(draw(|d| d.top_p = 0.92)), [false, true, true, true, true, false]);
        assert_eq!(kept(draw(|d| d.top_p = 0.95)), [false, true, true, true, true, true]);
        // top_p over the top-k: of the first two best, one reaches 0.5.
        assert_eq!(kept(draw(|d| (d.top_k, d.top_p) = (2, 0.5))), [false, true, false, false, false, false]);
    }

    #[test]
    fn a_draw_depends_on_seed_and_position_alone() {
        let logits: Vec<f32> = (0..300).map(|i| (i as f32 * 0.7).sin() * 3.0).collect();
        let d = draw(|d| d.top_p = 0.9);
        let run = |seed| (0..40).map(|position| draw_row(&logits, &Draw { seed, position, ..d }, None)).collect::<Vec<_>>();
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
        // A batch draws each row as alone, with its own adjustments.
        let rows = Tensor::new(vec![logits.clone(), logits.iter().rev().copied().collect::<Vec<_>>()], &Device::Cpu).unwrap();
        let draws = [Draw { position: 3, ..d }, Draw::GREEDY];
        let bias = Adjust { row: 1, token: 5, bias: 100.0, repetition: 1.0, subtract: 0.0 };
        assert_eq!(draw_rows(&rows, &draws, &[], &[bias]).unwrap(), [draw_row(&logits, &draws[0], None), 5]);
    }

    #[test]
    fn adjustments_apply_in_transformers_order() {
        let a = |bias, repetition, subtract| Adjust { row: 0, token: 0, bias, repetition, subtract };
        assert_eq!(a(1.0, 2.0, 0.5).apply(3.0), 1.5); // (3 + 1) / 2 - 0.5
        assert_eq!(a(-4.0, 2.0, 0.0).apply(3.0), -2.0); // (3 - 4) · 2
        assert_eq!(a(0.0, 1.0, 1.2).apply(3.0), 3.0 - 1.2f32);
    }

    #[test]
    fn a_row_without_candidates_takes_its_argmax() {
        let logits = [f32::NEG_INFINITY, 1.0, f32::NAN, 2.0];
        assert_eq!(draw_row(&logits, &draw(|_| {}), Some(&[0b0001])), 0);
        assert_eq!(draw_row(&[f32::NAN; 3], &draw(|_| {}), None), 0);
    }
}

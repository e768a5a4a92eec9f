//! The steps of the sampler chain as pure functions over a logits row or a [`Candidates`]
//! list. [`crate::Sampler`] only adds state (penalty history, RNG, reused buffers) around them.
//!
//! Semantics follow llama.cpp's `src/llama-sampler.cpp` step by step (each function names its
//! counterpart); the one deliberate difference is that ties are broken by ascending token id
//! everywhere (llama.cpp's greedy sampler does the same, its sorts leave ties unordered). Two
//! consequences of working on a candidate list: tokens whose logit is −∞ or NaN are never
//! candidates (they have probability 0 either way), and an all-(−∞) row yields an empty list.
//!
//! Order of the default chain ([`chain`]): penalties → top-k → top-p → min-p → temperature →
//! softmax. Top-p and min-p see the *untempered* logits; temperature only reshapes what is left.

use crate::candidates::rank;
use crate::{Candidate, Candidates, SamplerParams, TokenId};

/// Lanes of the vectorised sums over candidates (independent partial sums, added at the end).
const LANES: usize = 8;

/// Candidates per block of the softmax's exponentials.
const BLOCK: usize = 64;

/// How many logits the selection loops test at once: wide enough for the comparison to compile
/// to a couple of SIMD compares and a mask test.
const CHUNK: usize = 16;
/// [`CHUNK`] as a token-id step.
const CHUNK_IDS: TokenId = 16;
const _: () = assert!(CHUNK_IDS as usize == CHUNK);

/// Rounds an `f64` to the nearest `f32`.
#[allow(
    clippy::cast_possible_truncation,
    reason = "rounding a probability or log-probability to f32 is the intent"
)]
fn to_f32(x: f64) -> f32 {
    x as f32
}

/// The prefix of `logits` that token ids can address (2^32 entries on 64-bit targets; all of
/// it on smaller ones).
fn addressable(logits: &[f32]) -> &[f32] {
    let max = usize::try_from(u64::from(TokenId::MAX) + 1).unwrap_or(usize::MAX);
    &logits[..logits.len().min(max)]
}

/// Token id → index. Lossless: a `TokenId` is 32 bits and specula targets ≥ 32-bit platforms.
pub(crate) fn index(id: TokenId) -> usize {
    usize::try_from(id).unwrap_or(usize::MAX)
}

/// Repetition, frequency and presence penalties (llama.cpp `llama_sampler_penalties_apply`).
///
/// For every `(token, count)` with `count > 0` in `counts` (the occurrences of that token in the
/// penalty window): a logit `<= 0` is multiplied by `repeat_penalty`, a positive one divided by
/// it (dividing a negative logit would make the token *more* likely), then
/// `count × frequency_penalty + presence_penalty` is subtracted. Tokens outside `logits` are
/// skipped.
pub fn apply_penalties(
    logits: &mut [f32],
    counts: &[(TokenId, u32)],
    repeat_penalty: f32,
    frequency_penalty: f32,
    presence_penalty: f32,
) {
    for &(id, count) in counts {
        if count == 0 {
            continue;
        }
        let Some(l) = logits.get_mut(index(id)) else {
            continue;
        };
        if *l <= 0.0 {
            *l *= repeat_penalty;
        } else {
            *l /= repeat_penalty;
        }
        #[allow(
            clippy::cast_precision_loss,
            reason = "a window count is far below 2^24, exact in f32"
        )]
        let count = count as f32;
        *l -= count * frequency_penalty + presence_penalty;
    }
}

/// The index of the largest logit, the lowest index among equal maxima (llama.cpp
/// `llama_sampler_greedy_apply`). NaN and −∞ never win; `None` when every logit is one of them.
///
/// Two passes, both over whole chunks of 16 logits so that they vectorise: the maximum
/// (NaN-ignoring compares in independent lanes), then the first chunk holding it.
#[must_use]
pub fn argmax(logits: &[f32]) -> Option<TokenId> {
    let logits = addressable(logits);
    let max = max_value(logits);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let (chunks, tail) = logits.as_chunks::<CHUNK>();
    let chunk_hit = chunks.iter().position(|chunk| {
        let mut hit = false;
        for &x in chunk {
            hit |= x == max;
        }
        hit
    });
    let pos = match chunk_hit {
        Some(ci) => ci * CHUNK + chunks[ci].iter().position(|&x| x == max)?,
        None => chunks.len() * CHUNK + tail.iter().position(|&x| x == max)?,
    };
    TokenId::try_from(pos).ok()
}

/// The largest value of `xs`, ignoring NaN; −∞ for an empty or all-NaN slice.
fn max_value(xs: &[f32]) -> f32 {
    let mut best = [f32::NEG_INFINITY; CHUNK];
    let (chunks, tail) = xs.as_chunks::<CHUNK>();
    for chunk in chunks {
        for lane in 0..CHUNK {
            best[lane] = if chunk[lane] > best[lane] {
                chunk[lane]
            } else {
                best[lane]
            };
        }
    }
    best.iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// The `k` highest-ranked tokens of `logits`, into `out` in rank order (llama.cpp
/// `llama_sampler_top_k_impl`; `k >= logits.len()` keeps every candidate, `k = 0` none).
///
/// Never sorts the vocabulary: one streaming pass keeps every logit above a running threshold
/// in a buffer of about `2k`; when the buffer fills, a quickselect keeps the best `k` and raises
/// the threshold to the `k`-th logit. Ids arrive in ascending order, so a logit equal to the
/// threshold ranks below everything kept and can be skipped. Most chunks of 16 logits fail the
/// threshold test as a whole, which is what makes the pass cheap.
pub fn top_k(logits: &[f32], k: usize, out: &mut Candidates) {
    out.clear();
    let logits = addressable(logits);
    let k = k.min(logits.len());
    if k == 0 {
        out.sorted = true;
        return;
    }
    let cap = k.saturating_mul(2).max(k.saturating_add(256));
    let items = &mut out.items;
    items.reserve(cap);
    let mut threshold = f32::NEG_INFINITY;
    let mut keep_above = |first: TokenId, xs: &[f32], threshold: &mut f32| {
        for (id, &x) in (first..=TokenId::MAX).zip(xs) {
            if x > *threshold {
                items.push(Candidate {
                    id,
                    logit: x,
                    p: 0.0,
                });
                if items.len() >= cap {
                    items.select_nth_unstable_by(k - 1, rank);
                    items.truncate(k);
                    *threshold = items[k - 1].logit;
                }
            }
        }
    };
    let (chunks, tail) = logits.as_chunks::<CHUNK>();
    let mut first: TokenId = 0;
    for chunk in chunks {
        let mut hit = false;
        for &x in chunk {
            hit |= x > threshold;
        }
        if hit {
            keep_above(first, chunk, &mut threshold);
        }
        first = first.wrapping_add(CHUNK_IDS);
    }
    keep_above(first, tail, &mut threshold);
    if items.len() > k {
        items.select_nth_unstable_by(k - 1, rank);
        items.truncate(k);
    }
    items.sort_unstable_by(rank);
    out.sorted = true;
}

/// The largest logit in the list.
fn max_logit(c: &Candidates) -> Option<f32> {
    if c.sorted {
        c.items.first().map(|x| x.logit)
    } else {
        c.items.iter().map(|x| x.logit).reduce(f32::max)
    }
}

/// `e^x` for the `x <= 0` that softmax produces (`logit − max`), in `f32`, branch-free so that
/// loops over it vectorise. Cephes' `expf` scheme: `x = n ln 2 + r` with `n` rounded to nearest
/// (the 1.5·2^23 trick, which also yields `n`'s bits) and `|r| <= ln 2 / 2`, a degree-5
/// polynomial for `e^r` and the exponent spliced in as bits. Relative error below 2^-22
/// (tested against `f64::exp`); inputs below −87.33 (results under the smallest normal `f32`),
/// −∞ and NaN give 0, inputs above 88 are clamped to 88.
#[must_use]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = if x < 88.0 { x } else { 88.0 };
    let v = xc * LOG2E + ROUND;
    let n = v - ROUND;
    // `n` as a two's-complement integer: the low mantissa bits of `v`.
    let n_bits = v.to_bits().wrapping_sub(ROUND.to_bits());
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut poly = 1.987_569_1e-4_f32;
    poly = poly * r + 1.398_2e-3;
    poly = poly * r + 8.333_452e-3;
    poly = poly * r + 4.166_579_6e-2;
    poly = poly * r + 1.666_666_5e-1;
    poly = poly * r + 0.5;
    let er = poly * r * r + r + 1.0;
    let scale = f32::from_bits(n_bits.wrapping_add(127).wrapping_shl(23));
    if x >= -87.33 { er * scale } else { 0.0 }
}

/// Σ p over a slice, in `f64`, in [`LANES`] fixed partial sums (deterministic order).
pub(crate) fn mass(items: &[Candidate]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let (chunks, tail) = items.as_chunks::<LANES>();
    for chunk in chunks {
        for lane in 0..LANES {
            acc[lane] += f64::from(chunk[lane].p);
        }
    }
    let tail_sum: f64 = tail.iter().map(|c| f64::from(c.p)).sum();
    acc.iter().sum::<f64>() + tail_sum
}

/// Sets `p` to the softmax of the logits (llama.cpp `llama_sampler_softmax_impl`), with [`exp`]
/// and the normaliser accumulated as `f32` sums of 64-token blocks added in `f64` (llama.cpp's
/// `dist` sums in `f64`). If some logits are +∞ they share the mass equally.
pub fn softmax(c: &mut Candidates) {
    let Some(max) = max_logit(c) else {
        return;
    };
    if max == f32::INFINITY {
        let n = c.items.iter().filter(|x| x.logit == max).count();
        #[allow(
            clippy::cast_precision_loss,
            reason = "1/n rounded to f32 is the intent"
        )]
        let share = 1.0 / n as f32;
        for x in &mut c.items {
            x.p = if x.logit == max { share } else { 0.0 };
        }
        return;
    }
    // Blocks of logits are gathered into a buffer so that the exponentials run as a plain
    // loop over `f32`s, which vectorises (computed field by field on the array of structs,
    // they do not). Each block is summed in `f32` lanes (64 terms, each <= 1), the blocks in
    // `f64`.
    let mut sum = 0.0f64;
    let mut buf = [0.0f32; BLOCK];
    for block in c.items.chunks_mut(BLOCK) {
        let buf = &mut buf[..block.len()];
        for (b, x) in buf.iter_mut().zip(block.iter()) {
            *b = x.logit - max;
        }
        for b in buf.iter_mut() {
            *b = exp(*b);
        }
        for (x, &e) in block.iter_mut().zip(buf.iter()) {
            x.p = e;
        }
        sum += f64::from(lane_sum(buf));
    }
    // `sum >= 1`: the maximum contributes exp(0).
    let inv = to_f32(1.0 / sum);
    for x in &mut c.items {
        x.p *= inv;
    }
}

/// Σ xs in `f32`, in [`LANES`] independent partial sums (fixed order, so deterministic; the
/// compiler vectorises it).
fn lane_sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (chunks, tail) = xs.as_chunks::<LANES>();
    for chunk in chunks {
        for lane in 0..LANES {
            acc[lane] += chunk[lane];
        }
    }
    acc.iter().chain(tail).sum()
}

/// Moves the `m` highest-ranked entries of `items` to its front, in rank order (the rest
/// follows in no particular order). Same streaming threshold pass as [`top_k`], but in place:
/// an entry above the threshold is swapped into the growing front. `items` must be in
/// ascending id order (as an unsorted [`Candidates`] is), which is what lets an entry equal to
/// the threshold be skipped.
fn front_top(items: &mut [Candidate], m: usize) {
    let n = items.len();
    let m = m.min(n);
    if m == 0 {
        return;
    }
    let cap = m.saturating_mul(2).max(m.saturating_add(256)).min(n);
    let mut front = 0;
    let mut threshold = f32::NEG_INFINITY;
    for i in 0..n {
        if items[i].logit > threshold {
            items.swap(front, i);
            front += 1;
            if front == cap && i + 1 < n {
                items[..front].select_nth_unstable_by(m - 1, rank);
                front = m;
                threshold = items[m - 1].logit;
            }
        }
    }
    if front > m {
        items[..front].select_nth_unstable_by(m - 1, rank);
    }
    items[..m].sort_unstable_by(rank);
}

/// Within `items` (whose first `sorted` entries are the highest-ranked, in rank order, and
/// whose rest all rank below them), the smallest `keep` such that the top `keep` entries in
/// rank order carry at least `target` of probability mass; those entries end up at the front.
/// The sorted front is scanned first; past it, a quickselect on rank halves the remaining range
/// by mass, so nothing beyond the answer is ever sorted. Returns `items.len()` when the whole
/// list falls short (by rounding).
fn nucleus(items: &mut [Candidate], sorted: usize, target: f64) -> usize {
    let mut acc = 0.0f64;
    for (i, c) in items[..sorted].iter().enumerate() {
        acc += f64::from(c.p);
        if acc >= target {
            return i + 1;
        }
    }
    let (mut lo, mut hi) = (sorted, items.len());
    while hi - lo > 64 {
        let mid = lo + (hi - lo) / 2;
        items[lo..hi].select_nth_unstable_by(mid - lo, rank);
        let left = mass(&items[lo..=mid]);
        if acc + left >= target {
            hi = mid + 1;
        } else {
            acc += left;
            lo = mid + 1;
        }
    }
    items[lo..hi].sort_unstable_by(rank);
    for (i, c) in (lo..).zip(&items[lo..hi]) {
        acc += f64::from(c.p);
        if acc >= target {
            return i + 1;
        }
    }
    hi
}

/// Nucleus truncation (llama.cpp `llama_sampler_top_p_apply` with `min_keep = 0`): keep the
/// shortest rank-order prefix whose probability (softmax over the current list) reaches `p`.
/// The token that crosses `p` is kept, so at least one token survives. `p >= 1` does nothing.
///
/// An unsorted list is never sorted whole: the best 256 are moved to the front and sorted
/// (llama.cpp's adaptive first guess); if their mass falls short of `p`, the cut is found by a
/// mass-guided quickselect and the kept tokens beyond the first 256 stay unsorted (the list
/// then reports [`Candidates::is_sorted`] false).
pub fn top_p(c: &mut Candidates, p: f32) {
    if p >= 1.0 || c.items.is_empty() {
        return;
    }
    softmax(c);
    let sorted = if c.sorted {
        c.items.len()
    } else {
        let m = c.items.len().min(256);
        front_top(&mut c.items, m);
        m
    };
    let keep = nucleus(&mut c.items, sorted, f64::from(p));
    c.items.truncate(keep);
    c.sorted = c.sorted || keep <= sorted;
}

/// Min-p truncation (llama.cpp `llama_sampler_min_p_apply` with `min_keep = 0`): keep the
/// tokens whose probability is at least `p` × the largest probability, tested on logits as
/// `logit >= max_logit + ln p`. The maximum always survives. `p <= 0` does nothing; list order
/// is preserved.
pub fn min_p(c: &mut Candidates, p: f32) {
    if p <= 0.0 {
        return;
    }
    let Some(max) = max_logit(c) else {
        return;
    };
    let min_logit = max + p.ln();
    if c.sorted {
        let keep = c.items[1..]
            .iter()
            .position(|x| x.logit < min_logit)
            .map_or(c.items.len(), |i| i + 1);
        c.items.truncate(keep);
    } else {
        c.items.retain(|x| x.logit >= min_logit);
    }
}

/// Temperature (llama.cpp `llama_sampler_temp_impl`): divide every logit by `t`; `t <= 0` (or
/// NaN) keeps only the highest-ranked token, i.e. greedy. `t = 1` does nothing.
pub fn temperature(c: &mut Candidates, t: f32) {
    if t > 0.0 {
        if t != 1.0 {
            for x in &mut c.items {
                x.logit /= t;
            }
        }
        return;
    }
    if let Some(&best) = c.top() {
        c.items.clear();
        c.items.push(best);
    }
    c.sorted = true;
}

/// The whole chain after penalties: `logits` (already penalised) → the final distribution in
/// `out`, with `p` normalised. A greedy `params` gives the argmax with `p = 1`; the truncation
/// steps cannot remove the maximum, so this equals running them first.
///
/// `top_k = 0` or `top_k >= logits.len()` starts from every candidate (unsorted); otherwise
/// from the sorted top-k.
pub fn chain(logits: &[f32], params: &SamplerParams, out: &mut Candidates) {
    if params.is_greedy() || params.temperature.is_nan() {
        out.clear();
        if let Some(id) = argmax(logits) {
            out.items.push(Candidate {
                id,
                logit: logits[index(id)],
                p: 1.0,
            });
        }
        out.sorted = true;
        return;
    }
    let k = usize::try_from(params.top_k).unwrap_or(usize::MAX);
    if k > 0 && k < logits.len() {
        top_k(logits, k, out);
    } else {
        out.fill_from_logits(logits);
    }
    top_p(out, params.top_p);
    min_p(out, params.min_p);
    temperature(out, params.temperature);
    softmax(out);
}

/// `ln Σ exp(logit)` over the row (−∞ and NaN entries contribute nothing), computed around the
/// maximum with [`exp`] and `f64` partial sums; `None` when no logit is finite or +∞.
#[must_use]
pub fn log_sum_exp(logits: &[f32]) -> Option<f32> {
    let max = logits[index(argmax(logits)?)];
    if max == f32::INFINITY {
        return Some(f32::INFINITY);
    }
    let mut sum = 0.0f64;
    let mut buf = [0.0f32; BLOCK];
    for block in logits.chunks(BLOCK) {
        let buf = &mut buf[..block.len()];
        for (b, &x) in buf.iter_mut().zip(block) {
            *b = exp(x - max);
        }
        sum += f64::from(lane_sum(buf));
    }
    Some(max + to_f32(sum.ln()))
}

/// The `n` most likely tokens with their log-probabilities under the softmax of the *raw*
/// `logits` (what OpenAI's `logprobs` report), in rank order, into `out` (cleared first).
/// `scratch` is a reusable buffer. +∞ logits share probability 1 (`-ln m` for `m` of them).
pub fn top_logprobs(
    logits: &[f32],
    n: usize,
    scratch: &mut Candidates,
    out: &mut Vec<(TokenId, f32)>,
) {
    out.clear();
    if n == 0 {
        return;
    }
    let Some(lse) = log_sum_exp(logits) else {
        return;
    };
    top_k(logits, n, scratch);
    if lse == f32::INFINITY {
        #[allow(clippy::cast_precision_loss, reason = "a token count, ln taken in f32")]
        let m = logits.iter().filter(|&&x| x == f32::INFINITY).count() as f32;
        out.extend(scratch.iter().map(|c| {
            let lp = if c.logit == f32::INFINITY {
                -m.ln()
            } else {
                f32::NEG_INFINITY
            };
            (c.id, lp)
        }));
        return;
    }
    out.extend(scratch.iter().map(|c| (c.id, c.logit - lse)));
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEG_INF: f32 = f32::NEG_INFINITY;

    fn ids(c: &Candidates) -> Vec<TokenId> {
        c.iter().map(|c| c.id).collect()
    }

    fn probs(c: &Candidates) -> Vec<f32> {
        c.iter().map(|c| c.p).collect()
    }

    fn assert_close(got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= tol, "{got:?} vs {want:?}");
        }
    }

    /// Candidates with the given logits (ids 0..), in id order, unsorted.
    fn cands(logits: &[f32]) -> Candidates {
        Candidates::from_logits(logits)
    }

    #[test]
    fn penalties_divide_positive_and_multiply_non_positive_logits() {
        let mut l = [2.0, -2.0, 0.0, 4.0, 1.0];
        // Token 3 is not in the window; token 4 has count 0 and is skipped; token 9 is outside.
        apply_penalties(
            &mut l,
            &[(0, 1), (1, 1), (2, 2), (4, 0), (9, 3)],
            2.0,
            0.0,
            0.0,
        );
        assert_eq!(l, [1.0, -4.0, 0.0, 4.0, 1.0]);
    }

    #[test]
    fn frequency_and_presence_penalties_subtract_per_count_and_once() {
        let mut l = [2.0, -2.0, 1.0];
        apply_penalties(&mut l, &[(0, 3), (1, 1)], 1.0, 0.5, 0.25);
        // 2 - (3 * 0.5 + 0.25) and -2 - (1 * 0.5 + 0.25).
        assert_eq!(l, [0.25, -2.75, 1.0]);
        // Repeat penalty first, then the subtraction (llama.cpp's order).
        let mut l = [3.0];
        apply_penalties(&mut l, &[(0, 2)], 1.5, 1.0, 1.0);
        assert_eq!(l, [3.0 / 1.5 - 3.0]);
    }

    #[test]
    fn argmax_breaks_ties_by_lowest_id() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), Some(1));
        assert_eq!(argmax(&[0.5; 40]), Some(0));
        // The tie spans a chunk boundary and the tail.
        let mut l = vec![0.0f32; 37];
        l[35] = 9.0;
        l[20] = 9.0;
        assert_eq!(argmax(&l), Some(20));
        l[20] = 0.0;
        assert_eq!(argmax(&l), Some(35));
        // -0.0 and 0.0 are equal.
        assert_eq!(argmax(&[-1.0, -0.0, 0.0]), Some(1));
    }

    #[test]
    fn argmax_skips_nan_and_neg_inf() {
        assert_eq!(argmax(&[NEG_INF, f32::NAN, -5.0, f32::NAN]), Some(2));
        assert_eq!(argmax(&[NEG_INF; 20]), None);
        assert_eq!(argmax(&[f32::NAN; 3]), None);
        assert_eq!(argmax(&[]), None);
        assert_eq!(argmax(&[-1.0, f32::INFINITY, f32::INFINITY]), Some(1));
    }

    #[test]
    fn top_k_keeps_the_best_in_rank_order() {
        let mut c = Candidates::new();
        top_k(&[1.0, 3.0, 2.0, 3.0, NEG_INF], 2, &mut c);
        assert_eq!(ids(&c), [1, 3]);
        assert!(c.is_sorted());
        top_k(&[1.0, 3.0, 2.0, 3.0, NEG_INF], 3, &mut c);
        assert_eq!(ids(&c), [1, 3, 2]);
    }

    #[test]
    fn top_k_with_all_equal_logits_keeps_lowest_ids() {
        let mut c = Candidates::new();
        top_k(&[0.25; 1000], 5, &mut c);
        assert_eq!(ids(&c), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn top_k_larger_than_vocab_keeps_every_finite_logit() {
        let mut c = Candidates::new();
        top_k(&[1.0, NEG_INF, 2.0, f32::NAN], 10, &mut c);
        assert_eq!(ids(&c), [2, 0]);
        top_k(&[1.0, 2.0], 0, &mut c);
        assert!(c.is_empty());
        top_k(&[NEG_INF; 4], 2, &mut c);
        assert!(c.is_empty());
    }

    #[test]
    fn top_k_matches_a_full_sort_through_many_compactions() {
        // Ascending logits make every token beat the threshold, so the buffer compacts often.
        let l: Vec<f32> = (0..5000u16).map(|i| f32::from(i % 997) * 0.5).collect();
        let mut c = Candidates::new();
        top_k(&l, 7, &mut c);
        let mut want: Vec<(f32, TokenId)> = (0..).zip(&l).map(|(i, &x)| (x, i)).collect();
        want.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let want: Vec<TokenId> = want.iter().take(7).map(|&(_, i)| i).collect();
        assert_eq!(ids(&c), want);
    }

    #[test]
    fn softmax_by_hand() {
        let mut c = cands(&[0.0, 2f32.ln(), 3f32.ln(), NEG_INF]);
        softmax(&mut c);
        assert_close(&probs(&c), &[1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0], 1e-6);
        // All-equal logits: uniform.
        let mut c = cands(&[7.0; 4]);
        softmax(&mut c);
        assert_close(&probs(&c), &[0.25; 4], 1e-7);
        // +inf takes all the mass, shared.
        let mut c = cands(&[1.0, f32::INFINITY, 5.0, f32::INFINITY]);
        softmax(&mut c);
        assert_eq!(probs(&c), [0.0, 0.5, 0.0, 0.5]);
        // Large logits do not overflow. (The difference is taken after rounding to f32,
        // whose spacing at 1000 is 2^-14.)
        let big = 1000.0 + 2f32.ln();
        let d = f64::from(big - 1000.0);
        let mut c = cands(&[1000.0, big]);
        softmax(&mut c);
        let want = 1.0 / (1.0 + d.exp());
        assert_close(&probs(&c), &[to_f32(want), to_f32(1.0 - want)], 1e-6);
    }

    /// Logits whose softmax is `0.5, 0.3, 0.15, 0.05`, given in a scrambled id order.
    fn four() -> Candidates {
        cands(&[0.15f32.ln(), 0.5f32.ln(), 0.05f32.ln(), 0.3f32.ln()])
    }

    #[test]
    fn top_p_keeps_the_token_that_crosses_p() {
        for (p, want) in [
            (0.3, vec![1]),
            (0.5 - 1e-4, vec![1]),
            (0.6, vec![1, 3]),
            (0.8 - 1e-4, vec![1, 3]),
            (0.9, vec![1, 3, 0]),
            (0.99, vec![1, 3, 0, 2]),
        ] {
            let mut c = four();
            top_p(&mut c, p);
            assert_eq!(ids(&c), want, "p = {p}");
            assert!(c.is_sorted());
        }
        // Even a tiny p keeps one token.
        let mut c = four();
        top_p(&mut c, f32::MIN_POSITIVE);
        assert_eq!(ids(&c), [1]);
    }

    #[test]
    fn top_p_one_is_a_no_op() {
        let mut c = four();
        top_p(&mut c, 1.0);
        assert_eq!(c, four());
    }

    #[test]
    fn top_p_with_ties_orders_by_id() {
        let mut c = cands(&[1.0; 4]);
        top_p(&mut c, 0.5);
        assert_eq!(ids(&c), [0, 1]);
    }

    #[test]
    fn top_p_past_the_first_256_uses_the_mass_quickselect() {
        // 3000 equal logits: p = 0.5 needs exactly 1500 tokens, ids 0..1500.
        let mut c = cands(&[0.0; 3000]);
        top_p(&mut c, 0.5 + 1e-5);
        let mut got = ids(&c);
        got.sort_unstable();
        assert_eq!(got, (0..1501).collect::<Vec<_>>());
        assert!(!c.is_sorted());
        // The first 256 are sorted, the rest rank below them.
        assert_eq!(ids(&c)[..256], (0..256).collect::<Vec<_>>());
    }

    #[test]
    fn min_p_is_relative_to_the_largest_probability() {
        // Relative probabilities 1, 0.5, 0.1, 0.04.
        let l = [0.5f32.ln(), 0.0, 0.04f32.ln(), 0.1f32.ln()];
        let mut c = cands(&l);
        min_p(&mut c, 0.05);
        assert_eq!(ids(&c), [0, 1, 3]);
        let mut c = cands(&l);
        min_p(&mut c, 0.11);
        assert_eq!(ids(&c), [0, 1]);
        // Sorted input: same set, rank order kept.
        let mut c = cands(&l);
        c.sort();
        min_p(&mut c, 0.05);
        assert_eq!(ids(&c), [1, 0, 3]);
        // min_p = 0 does nothing; min_p = 1 keeps exactly the maxima.
        let mut c = cands(&l);
        min_p(&mut c, 0.0);
        assert_eq!(c, cands(&l));
        let mut c = cands(&[2.0, 1.0, 2.0]);
        min_p(&mut c, 1.0);
        assert_eq!(ids(&c), [0, 2]);
    }

    #[test]
    fn temperature_scales_or_goes_greedy() {
        let mut c = cands(&[1.0, 4.0, -2.0]);
        temperature(&mut c, 2.0);
        assert_eq!(
            c.iter().map(|c| c.logit).collect::<Vec<_>>(),
            [0.5, 2.0, -1.0]
        );
        let mut c = cands(&[1.0, 4.0, -2.0]);
        temperature(&mut c, 1.0);
        assert_eq!(c, cands(&[1.0, 4.0, -2.0]));
        let mut c = cands(&[1.0, 4.0, 3.0, 4.0]);
        temperature(&mut c, 0.0);
        assert_eq!(ids(&c), [1]);
        assert_eq!(c.as_slice()[0].logit, 4.0);
    }

    #[test]
    fn chain_greedy_is_argmax_with_probability_one() {
        let mut c = Candidates::new();
        chain(&[0.0, 5.0, 5.0, NEG_INF], &SamplerParams::greedy(), &mut c);
        assert_eq!(
            c.as_slice(),
            [Candidate {
                id: 1,
                logit: 5.0,
                p: 1.0
            }]
        );
        chain(&[NEG_INF; 3], &SamplerParams::greedy(), &mut c);
        assert!(c.is_empty());
    }

    #[test]
    fn chain_default_by_hand() {
        // Probabilities 0.5, 0.3, 0.15, 0.05 (ids 1, 3, 0, 2). Default: top-k 40 keeps all,
        // top-p 0.95 keeps 1, 3, 0 (cum 0.95 — to avoid the boundary use p = 0.9), min-p 0.05
        // keeps all of those (0.15 >= 0.025), temperature 0.8 sharpens.
        let params = SamplerParams {
            top_p: 0.9,
            ..SamplerParams::default()
        };
        let mut c = Candidates::new();
        chain(
            &[0.15f32.ln(), 0.5f32.ln(), 0.05f32.ln(), 0.3f32.ln()],
            &params,
            &mut c,
        );
        assert_eq!(ids(&c), [1, 3, 0]);
        let w: Vec<f64> = [0.5f64, 0.3, 0.15]
            .iter()
            .map(|p| p.powf(1.0 / 0.8))
            .collect();
        let z: f64 = w.iter().sum();
        let want: Vec<f32> = w.iter().map(|x| to_f32(x / z)).collect();
        assert_close(&probs(&c), &want, 1e-6);
    }

    #[test]
    fn chain_without_truncation_is_the_softmax_over_finite_logits() {
        let mut c = Candidates::new();
        chain(
            &[0.0, NEG_INF, 2f32.ln()],
            &SamplerParams::unmodified(),
            &mut c,
        );
        assert_eq!(ids(&c), [0, 2]);
        assert_close(&probs(&c), &[1.0 / 3.0, 2.0 / 3.0], 1e-6);
    }

    #[test]
    fn exp_is_accurate_on_the_softmax_domain() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(NEG_INF), 0.0);
        assert_eq!(exp(f32::NAN), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        let mut worst = 0.0f64;
        for i in 0..=1_000_000u32 {
            let x = -87.3 * f64::from(i) / 1e6;
            let x32 = to_f32(x);
            let want = f64::from(x32).exp();
            let rel = (f64::from(exp(x32)) - want).abs() / want;
            worst = worst.max(rel);
        }
        assert!(worst < 2.0f64.powi(-22), "worst relative error {worst:e}");
    }

    #[test]
    fn log_sum_exp_and_top_logprobs_by_hand() {
        let l = [0.0, 0.0, NEG_INF, f32::NAN, 3f32.ln() + 0.0];
        // ln(1 + 1 + 3) = ln 5.
        let lse = log_sum_exp(&l).expect("finite logits");
        assert!((lse - 5f32.ln()).abs() < 1e-6, "{lse}");
        let (mut scratch, mut out) = (Candidates::new(), Vec::new());
        top_logprobs(&l, 2, &mut scratch, &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!((out[0].0, out[1].0), (4, 0));
        assert!((out[0].1 - (0.6f32).ln()).abs() < 1e-6);
        assert!((out[1].1 - (0.2f32).ln()).abs() < 1e-6);
        top_logprobs(&l, 0, &mut scratch, &mut out);
        assert!(out.is_empty());
        assert_eq!(log_sum_exp(&[NEG_INF]), None);
        top_logprobs(
            &[1.0, f32::INFINITY, f32::INFINITY],
            3,
            &mut scratch,
            &mut out,
        );
        assert_eq!(out[0], (1, -(2f32.ln())));
        assert_eq!(out[2], (0, NEG_INF));
    }
}

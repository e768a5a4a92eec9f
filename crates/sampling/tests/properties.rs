//! Properties of the sampler chain over random logits, parameters and histories: the
//! distribution is normalised, lives inside the top-k, equals a naive sort-everything
//! reference of llama.cpp's chain; greedy is argmax; sampling is deterministic under a seed and
//! `restore(state())` replays it exactly.

use proptest::prelude::*;
use specula_sampling::{Candidates, Sampler, SamplerParams, TokenId, steps};

const NEG_INF: f32 = f32::NEG_INFINITY;

/// Logits with plenty of exact ties (small integers) and some −∞ (masked tokens).
fn logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -20.0f32..20.0,
        3 => (-4i8..4).prop_map(f32::from),
        1 => Just(NEG_INF),
    ]
}

/// A row with at least one finite logit.
fn row(max_len: usize) -> impl Strategy<Value = Vec<f32>> {
    (
        prop::collection::vec(logit(), 1..max_len),
        any::<prop::sample::Index>(),
    )
        .prop_map(|(mut v, i)| {
            let i = i.index(v.len());
            if v[i] == NEG_INF {
                v[i] = 0.0;
            }
            v
        })
}

/// A long row of nearly equal logits: the probability mass is spread so thin that top-p needs
/// more than the first 256 tokens, which exercises the mass-guided quickselect.
fn flat_row() -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![4 => -1.0f32..1.0, 1 => (-2i8..2).prop_map(f32::from)],
        300..4000,
    )
}

fn params() -> impl Strategy<Value = SamplerParams> {
    (
        prop_oneof![1 => Just(0.0f32), 4 => 0.05f32..2.0],
        prop_oneof![1 => Just(0u32), 3 => 1u32..60],
        prop_oneof![1 => Just(1.0f32), 3 => 0.05f32..1.0],
        prop_oneof![1 => Just(0.0f32), 2 => 0.0f32..0.3],
        prop_oneof![1 => Just(1.0f32), 1 => 0.5f32..2.0],
        0u32..16,
        prop_oneof![1 => Just(0.0f32), 1 => -1.0f32..1.0],
        prop_oneof![1 => Just(0.0f32), 1 => -1.0f32..1.0],
        any::<u64>(),
    )
        .prop_map(
            |(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, pp, fp, seed)| {
                SamplerParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    repeat_penalty,
                    repeat_last_n,
                    presence_penalty: pp,
                    frequency_penalty: fp,
                    seed,
                    n_probs: 0,
                }
            },
        )
}

/// A case: logits, parameters and an accepted history (token ids reduced into the vocabulary).
fn case(max_len: usize) -> impl Strategy<Value = (Vec<f32>, SamplerParams, Vec<TokenId>)> {
    (
        row(max_len),
        params(),
        prop::collection::vec(any::<prop::sample::Index>(), 0..24),
    )
        .prop_map(|(logits, params, hist)| {
            let hist = hist
                .iter()
                .map(|i| TokenId::try_from(i.index(logits.len())).expect("small vocab"))
                .collect();
            (logits, params, hist)
        })
}

fn sampler_with(params: SamplerParams, vocab: usize, history: &[TokenId]) -> Sampler {
    let mut s = Sampler::new(params, vocab).expect("valid params");
    for &t in history {
        s.accept(t).expect("in vocabulary");
    }
    s
}

/// Penalised logits, written independently of the crate: counts over the last `n` tokens,
/// then llama.cpp's formula.
fn penalised(logits: &[f32], p: &SamplerParams, history: &[TokenId]) -> Vec<f32> {
    let mut out = logits.to_vec();
    let n = usize::try_from(p.repeat_last_n).expect("small");
    if !p.penalties_enabled() {
        return out;
    }
    let window = &history[history.len().saturating_sub(n)..];
    let mut counts = std::collections::BTreeMap::<TokenId, u16>::new();
    for &t in window {
        *counts.entry(t).or_default() += 1;
    }
    for (&t, &c) in &counts {
        let l = &mut out[usize::try_from(t).expect("small")];
        if *l <= 0.0 {
            *l *= p.repeat_penalty;
        } else {
            *l /= p.repeat_penalty;
        }
        *l -= f32::from(c) * p.frequency_penalty + p.presence_penalty;
    }
    out
}

/// Finite candidates in rank order: logit descending, id ascending.
fn ranked(logits: &[f32]) -> Vec<(TokenId, f32)> {
    let mut v: Vec<(TokenId, f32)> = (0..)
        .zip(logits.iter().copied())
        .filter(|&(_, x)| x > NEG_INF)
        .collect();
    v.sort_by(|a, b| b.1.partial_cmp(&a.1).expect("no NaN").then(a.0.cmp(&b.0)));
    v
}

fn softmax64(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(NEG_INF, f32::max);
    let e: Vec<f64> = logits.iter().map(|&x| f64::from(x - max).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

/// llama.cpp's chain on a fully sorted list, in `f64`: top-k, top-p, min-p, temperature,
/// softmax. `None` when a top-p or min-p decision is too close to call in floating point.
fn reference(logits: &[f32], p: &SamplerParams) -> Option<Vec<(TokenId, f64)>> {
    let mut v = ranked(logits);
    if p.is_greedy() {
        return Some(vec![(v[0].0, 1.0)]);
    }
    let k = usize::try_from(p.top_k).expect("small");
    if k > 0 {
        v.truncate(k);
    }
    if p.top_p < 1.0 {
        let probs = softmax64(&v.iter().map(|c| c.1).collect::<Vec<_>>());
        let target = f64::from(p.top_p);
        let mut cum = 0.0;
        let mut keep = v.len();
        for (i, q) in probs.iter().enumerate() {
            cum += q;
            if (cum - target).abs() < 1e-4 {
                return None;
            }
            if cum >= target {
                keep = i + 1;
                break;
            }
        }
        v.truncate(keep);
    }
    if p.min_p > 0.0 {
        let min_logit = v[0].1 + p.min_p.ln();
        if v.iter().any(|c| (c.1 - min_logit).abs() < 1e-4) {
            return None;
        }
        v.retain(|c| c.1 >= min_logit);
    }
    let scaled: Vec<f32> = v.iter().map(|c| c.1 / p.temperature).collect();
    let probs = softmax64(&scaled);
    Some(v.iter().map(|c| c.0).zip(probs).collect())
}

proptest! {
    #[test]
    fn distribution_is_normalised_and_inside_the_top_k((logits, params, hist) in case(400)) {
        let mut s = sampler_with(params, logits.len(), &hist);
        let eff = penalised(&logits, &params, &hist);
        let dist = s.distribution(&logits).expect("a finite logit").clone();
        let total: f64 = dist.iter().map(|c| f64::from(c.p)).sum();
        prop_assert!((total - 1.0).abs() < 1e-5, "sum {total}");
        prop_assert!(dist.iter().all(|c| c.p >= 0.0 && c.p <= 1.0));
        let mut ids: Vec<TokenId> = dist.iter().map(|c| c.id).collect();
        ids.sort_unstable();
        ids.dedup();
        prop_assert_eq!(ids.len(), dist.len(), "duplicate ids");
        let k = usize::try_from(params.top_k).expect("small");
        let allowed: Vec<TokenId> = ranked(&eff)
            .iter()
            .take(if k == 0 { usize::MAX } else { k })
            .map(|c| c.0)
            .collect();
        for c in &dist {
            prop_assert!(allowed.contains(&c.id), "token {} outside the top-{}", c.id, k);
        }
    }

    #[test]
    fn distribution_matches_the_sort_everything_reference((logits, params, hist) in case(1500)) {
        let eff = penalised(&logits, &params, &hist);
        let want = reference(&eff, &params);
        prop_assume!(want.is_some());
        let want = want.expect("assumed");
        let mut s = sampler_with(params, logits.len(), &hist);
        let dist = s.distribution(&logits).expect("a finite logit");
        let mut got: Vec<(TokenId, f32)> = dist.iter().map(|c| (c.id, c.p)).collect();
        got.sort_by_key(|c| c.0);
        let mut want = want;
        want.sort_by_key(|c| c.0);
        prop_assert_eq!(
            got.iter().map(|c| c.0).collect::<Vec<_>>(),
            want.iter().map(|c| c.0).collect::<Vec<_>>()
        );
        for (g, w) in got.iter().zip(&want) {
            prop_assert!((f64::from(g.1) - w.1).abs() < 1e-5, "token {}: {} vs {}", g.0, g.1, w.1);
        }
    }

    #[test]
    fn top_p_alone_matches_the_reference_on_long_rows(
        logits in prop_oneof![row(4000), flat_row()],
        top_p in 0.05f32..1.0,
    ) {
        let params = SamplerParams { top_p, ..SamplerParams::unmodified() };
        let want = reference(&logits, &params);
        prop_assume!(want.is_some());
        let mut want: Vec<TokenId> = want.expect("assumed").iter().map(|c| c.0).collect();
        let mut c = Candidates::from_logits(&logits);
        steps::top_p(&mut c, top_p);
        let mut got: Vec<TokenId> = c.iter().map(|c| c.id).collect();
        got.sort_unstable();
        want.sort_unstable();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn top_k_matches_a_full_sort(logits in row(5000), k in 1usize..400) {
        let mut c = Candidates::new();
        steps::top_k(&logits, k, &mut c);
        let want: Vec<TokenId> = ranked(&logits).iter().take(k).map(|c| c.0).collect();
        prop_assert_eq!(c.iter().map(|c| c.id).collect::<Vec<_>>(), want);
    }

    #[test]
    fn greedy_is_argmax(logits in row(3000), seed in any::<u64>()) {
        let params = SamplerParams { seed, ..SamplerParams::greedy() };
        let mut s = Sampler::new(params, logits.len()).expect("valid");
        let want = ranked(&logits)[0].0;
        prop_assert_eq!(s.sample(&logits), Ok(want));
        prop_assert_eq!(steps::argmax(&logits), Some(want));
    }

    #[test]
    fn same_seed_same_samples((logits, params, hist) in case(300)) {
        let mut a = sampler_with(params, logits.len(), &hist);
        let mut b = sampler_with(params, logits.len(), &hist);
        for _ in 0..16 {
            let ta = a.sample(&logits).expect("a finite logit");
            let tb = b.sample(&logits).expect("a finite logit");
            prop_assert_eq!(ta, tb);
            a.accept(ta).expect("in vocabulary");
            b.accept(tb).expect("in vocabulary");
        }
    }

    #[test]
    fn restore_of_state_replays_the_next_samples((logits, params, hist) in case(300)) {
        let mut s = sampler_with(params, logits.len(), &hist);
        let snapshot = s.state();
        let run = |s: &mut Sampler| -> Vec<TokenId> {
            (0..12)
                .map(|_| {
                    let t = s.sample(&logits).expect("a finite logit");
                    s.accept(t).expect("in vocabulary");
                    t
                })
                .collect()
        };
        let first = run(&mut s);
        s.restore(&snapshot).expect("own state");
        prop_assert_eq!(s.state(), snapshot);
        let again = run(&mut s);
        prop_assert_eq!(first, again);
    }

    #[test]
    fn sampled_token_has_positive_probability((logits, params, hist) in case(300)) {
        let mut s = sampler_with(params, logits.len(), &hist);
        let dist = s.distribution(&logits).expect("a finite logit").clone();
        let t = s.sample(&logits).expect("a finite logit");
        prop_assert!(dist.prob(t) > 0.0, "token {} has p = 0", t);
    }
}

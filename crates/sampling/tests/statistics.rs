//! Sampling frequencies match the distribution they are drawn from. Pearson's chi-square
//! against probabilities computed here in `f64` from the logits (not by the crate), with a fixed
//! seed, so each test is deterministic: the thresholds are generous (p-values around 1e-6 or
//! smaller for a correct sampler) and a pass or failure repeats exactly.

use specula_sampling::{Sampler, SamplerParams, TokenId};

/// Softmax of `logits / t` in `f64`.
fn softmax(logits: &[f32], t: f64) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = logits
        .iter()
        .map(|&x| ((f64::from(x) - f64::from(max)) / t).exp())
        .collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

/// Counts of `n` samples per token.
fn counts(sampler: &mut Sampler, logits: &[f32], n: usize) -> Vec<u64> {
    let mut c = vec![0u64; logits.len()];
    for _ in 0..n {
        let t = sampler.sample(logits).expect("finite logits");
        c[usize::try_from(t).expect("small vocab")] += 1;
    }
    c
}

/// Pearson's statistic over the tokens with positive expected probability.
fn chi_square(observed: &[u64], probs: &[f64], n: usize) -> f64 {
    #[allow(clippy::cast_precision_loss, reason = "sample counts far below 2^52")]
    let n = n as f64;
    observed
        .iter()
        .zip(probs)
        .filter(|&(_, &p)| p > 0.0)
        .map(|(&o, &p)| {
            #[allow(clippy::cast_precision_loss, reason = "sample counts far below 2^52")]
            let o = o as f64;
            let e = n * p;
            (o - e) * (o - e) / e
        })
        .sum()
}

#[test]
fn temperature_one_without_truncation_matches_softmax() {
    let logits = [1.0, 0.5, -0.3, 2.0, 0.0, -1.5, 1.2, 0.8, -0.7, 0.3];
    let params = SamplerParams {
        seed: 12_345,
        ..SamplerParams::unmodified()
    };
    let mut s = Sampler::new(params, logits.len()).expect("valid");
    let n = 200_000;
    let observed = counts(&mut s, &logits, n);
    let chi2 = chi_square(&observed, &softmax(&logits, 1.0), n);
    // 9 degrees of freedom: P(chi2 > 50) ≈ 1e-7.
    assert!(chi2 < 50.0, "chi2 = {chi2}, counts {observed:?}");
}

#[test]
fn many_tokens_across_sampling_blocks_match_softmax() {
    // 1000 tokens (16 blocks of the blocked inverse CDF) with mass spread evenly enough that
    // every expected count is above 60.
    let logits: Vec<f32> = (0..1000u16)
        .map(|i| f32::from((i * 37) % 101) / 50.0 - 1.0)
        .collect();
    let params = SamplerParams {
        seed: 99,
        ..SamplerParams::unmodified()
    };
    let mut s = Sampler::new(params, logits.len()).expect("valid");
    let n = 300_000;
    let observed = counts(&mut s, &logits, n);
    let chi2 = chi_square(&observed, &softmax(&logits, 1.0), n);
    // 999 degrees of freedom: mean 999, standard deviation ≈ 44.7; 1300 is 6.7 sigma.
    assert!(chi2 < 1300.0, "chi2 = {chi2}");
}

#[test]
fn truncated_tempered_chain_matches_its_distribution() {
    // Rank order 3, 6, 0, 7, 1, 9, 4, 2, 8, 5. top-k 6 keeps 3, 6, 0, 7, 1, 9, whose softmax
    // is 0.396, 0.178, 0.146, 0.119, 0.088, 0.072: cumulative 0.839 after four, 0.928 after
    // five, so top-p 0.85 keeps five; min-p 0.25 then drops token 1 (0.088 < 0.25 × 0.396 =
    // 0.099); temperature 0.7 reshapes the remaining four.
    let logits = [1.0f32, 0.5, -0.3, 2.0, 0.0, -1.5, 1.2, 0.8, -0.7, 0.3];
    let params = SamplerParams {
        temperature: 0.7,
        top_k: 6,
        top_p: 0.85,
        min_p: 0.25,
        seed: 2024,
        ..SamplerParams::default()
    };
    let kept: [TokenId; 4] = [3, 6, 0, 7];
    let mut s = Sampler::new(params, logits.len()).expect("valid");
    let dist = s.distribution(&logits).expect("finite logits");
    let mut ids: Vec<TokenId> = dist.iter().map(|c| c.id).collect();
    ids.sort_unstable();
    let mut want_ids = kept.to_vec();
    want_ids.sort_unstable();
    assert_eq!(ids, want_ids);

    let kept_logits: Vec<f32> = kept
        .iter()
        .map(|&t| logits[usize::try_from(t).expect("small")])
        .collect();
    let kept_probs = softmax(&kept_logits, 0.7);
    let mut probs = vec![0.0f64; logits.len()];
    for (&t, &p) in kept.iter().zip(&kept_probs) {
        probs[usize::try_from(t).expect("small")] = p;
    }
    let n = 200_000;
    let observed = counts(&mut s, &logits, n);
    for (t, (&o, &p)) in observed.iter().zip(&probs).enumerate() {
        if p == 0.0 {
            assert_eq!(
                o, 0,
                "token {t} is outside the distribution but was sampled"
            );
        }
    }
    let chi2 = chi_square(&observed, &probs, n);
    // 3 degrees of freedom: P(chi2 > 35) ≈ 1e-7.
    assert!(chi2 < 35.0, "chi2 = {chi2}, counts {observed:?}");
}

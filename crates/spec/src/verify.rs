//! Verifiers: which draft tokens the target keeps, and the one token it adds.
//!
//! Both verifiers apply the target's whole sampler chain (penalties, top-k, top-p, min-p,
//! temperature) to each verify row, advancing the sampler token by token exactly as a plain
//! decode would, so the output has the target's distribution for any draft (see
//! `../shared/research/speculative.md` §4):
//!
//! - [`sample_and_match`]: draw `y ~ p` at each row and keep going while `y` equals the draft
//!   token. Greedy (temperature 0) is its special case, and with a deterministic drafter it is
//!   distributionally the same as rejection sampling.
//! - [`rejection`]: standard speculative sampling for drafters that give their distribution
//!   `q`: accept `d ~ q` with probability `min(1, p(d)/q(d))`, else draw from
//!   `norm(max(0, p − q))` and stop; after a fully accepted draft draw a bonus token from `p`.

use specula_sampling::Sampler;

use crate::SpecError;

/// The outcome of verifying one draft.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// The tokens to commit: the accepted draft tokens, then one token of the target's own.
    pub tokens: Vec<u32>,
    /// How many draft tokens were accepted (`tokens.len() − 1`).
    pub accepted: usize,
}

/// Checks that `rows` holds `draft.len() + 1` rows of `n_vocab` logits.
fn check_rows(rows: &[f32], n_vocab: usize, draft: &[u32]) -> Result<(), SpecError> {
    if n_vocab == 0 || rows.len() != (draft.len() + 1) * n_vocab {
        return Err(SpecError::Rows {
            got: rows.len(),
            draft: draft.len(),
            n_vocab,
        });
    }
    Ok(())
}

/// Sample-and-match over the verify rows `rows` (`draft.len() + 1` rows of `n_vocab` logits:
/// row `i` is the target's prediction after the anchor and `draft[..i]`).
///
/// # Errors
/// Rows that do not match the draft, or a sampler error.
pub fn sample_and_match(
    sampler: &mut Sampler,
    rows: &[f32],
    n_vocab: usize,
    draft: &[u32],
) -> Result<Verdict, SpecError> {
    check_rows(rows, n_vocab, draft)?;
    let (drafted, last) = rows.split_at(draft.len() * n_vocab);
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (i, (row, &d)) in drafted.chunks_exact(n_vocab).zip(draft).enumerate() {
        let y = sampler.sample(row)?;
        sampler.accept(y)?;
        tokens.push(y);
        if y != d {
            return Ok(Verdict {
                tokens,
                accepted: i,
            });
        }
    }
    // Every draft token matched: the last row gives the bonus token.
    let y = sampler.sample(last)?;
    sampler.accept(y)?;
    tokens.push(y);
    Ok(Verdict {
        tokens,
        accepted: draft.len(),
    })
}

/// Greedy verification from the target's argmax of each verify row (`ids`, `draft.len() + 1`
/// of them, row `i` the target's choice after the anchor and `draft[..i]`): the verdict
/// [`sample_and_match`] gives with a greedy sampler that changes no logit, without the rows'
/// logits (a backend reads out only the argmaxes). Each kept token is accepted by `sampler`,
/// as a plain decode would. An id of `u32::MAX` marks a row of only NaN and −∞
/// ([`specula_sampling::SamplingError::NoCandidates`] where the verdict reads it).
///
/// # Errors
/// A count of ids that does not match the draft, a row without candidates, or a sampler
/// error.
pub fn match_argmax(
    sampler: &mut Sampler,
    ids: &[u32],
    draft: &[u32],
) -> Result<Verdict, SpecError> {
    if ids.len() != draft.len() + 1 {
        return Err(SpecError::Rows {
            got: ids.len(),
            draft: draft.len(),
            n_vocab: 1,
        });
    }
    let mut tokens = Vec::with_capacity(ids.len());
    for (i, &y) in ids.iter().enumerate() {
        if y == u32::MAX {
            return Err(specula_sampling::SamplingError::NoCandidates.into());
        }
        sampler.accept(y)?;
        tokens.push(y);
        if draft.get(i).is_none_or(|&d| d != y) {
            return Ok(Verdict {
                tokens,
                accepted: i,
            });
        }
    }
    unreachable!("the last id has no draft token to match")
}

/// The sampler's final distribution for `row` as a dense vector over the vocabulary.
fn dense(sampler: &mut Sampler, row: &[f32], n_vocab: usize) -> Result<Vec<f64>, SpecError> {
    let mut p = vec![0.0f64; n_vocab];
    for c in sampler.distribution(row)?.iter() {
        if let Some(slot) = usize::try_from(c.id).ok().and_then(|i| p.get_mut(i)) {
            *slot += f64::from(c.p);
        }
    }
    Ok(p)
}

/// Inverse-CDF draw from weights `w` (any non-negative scale) with `u ∈ [0, 1)`; `None` when
/// they sum to zero.
fn draw(w: &[f64], u: f64) -> Option<u32> {
    let total: f64 = w.iter().sum();
    if total <= 0.0 {
        return None;
    }
    let target = u * total;
    let mut acc = 0.0;
    let mut last = None;
    for (i, &x) in w.iter().enumerate() {
        if x > 0.0 {
            acc += x;
            last = u32::try_from(i).ok();
            if acc > target {
                return last;
            }
        }
    }
    last
}

/// Standard rejection sampling over the verify rows `rows`, for a draft whose token `i` was
/// drawn from `q[i]` (the drafter's final distribution, dense over the vocabulary).
///
/// # Errors
/// Rows or distributions that do not match the draft, or a sampler error.
pub fn rejection(
    sampler: &mut Sampler,
    rows: &[f32],
    n_vocab: usize,
    draft: &[u32],
    q: &[Vec<f32>],
) -> Result<Verdict, SpecError> {
    check_rows(rows, n_vocab, draft)?;
    let rows: Vec<&[f32]> = rows.chunks_exact(n_vocab).collect();
    if q.len() != draft.len() || q.iter().any(|q| q.len() != n_vocab) {
        return Err(SpecError::Distributions {
            got: q.len(),
            draft: draft.len(),
            n_vocab,
        });
    }
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (i, (&d, q)) in draft.iter().zip(q).enumerate() {
        let p = dense(sampler, rows[i], n_vocab)?;
        let di = usize::try_from(d).unwrap_or(usize::MAX);
        let (pd, qd) = (
            p.get(di).copied().unwrap_or(0.0),
            q.get(di).copied().map_or(0.0, f64::from),
        );
        let u = sampler.next_uniform();
        if qd > 0.0 && u < (pd / qd).min(1.0) {
            sampler.accept(d)?;
            tokens.push(d);
            continue;
        }
        // Rejected: a draw from the residual max(0, p − q) (from p when it is empty, which
        // happens only when p = q and then any token is a draw from p).
        let residual: Vec<f64> = p
            .iter()
            .zip(q)
            .map(|(&p, &q)| (p - f64::from(q)).max(0.0))
            .collect();
        let u = sampler.next_uniform();
        let y = draw(&residual, u)
            .or_else(|| draw(&p, u))
            .ok_or(specula_sampling::SamplingError::NoCandidates)?;
        sampler.accept(y)?;
        tokens.push(y);
        return Ok(Verdict {
            tokens,
            accepted: i,
        });
    }
    // Every draft token accepted: a bonus token from the last row.
    let y = sampler.sample(rows[draft.len()])?;
    sampler.accept(y)?;
    tokens.push(y);
    Ok(Verdict {
        tokens,
        accepted: draft.len(),
    })
}

#[cfg(test)]
mod tests {
    use specula_sampling::{SamplerParams, SamplingError};

    use super::*;

    fn logits_of(p: &[f64]) -> Vec<f32> {
        #[allow(clippy::cast_possible_truncation, reason = "test logits")]
        p.iter().map(|&x| x.ln() as f32).collect()
    }

    /// The argmax verdict is sample-and-match's with a greedy sampler, for every draft.
    #[test]
    fn argmax_verdicts_are_greedy_sample_and_match() {
        let n_vocab = 6;
        let rows: Vec<f32> = [
            [0.0, 5.0, 1.0, 5.0, 2.0, 0.0],
            [3.0, 0.0, 1.0, 2.0, 2.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 9.0],
            [1.0, 0.0, 4.0, 2.0, 2.0, 0.0],
        ]
        .concat();
        let ids = [1u32, 0, 5, 2];
        for draft in [&[1u32, 0, 5][..], &[1, 0, 4], &[2, 0, 5], &[1, 0]] {
            let rows = &rows[..(draft.len() + 1) * n_vocab];
            let mut a = Sampler::new(SamplerParams::greedy(), n_vocab).unwrap();
            let mut b = Sampler::new(SamplerParams::greedy(), n_vocab).unwrap();
            let want = sample_and_match(&mut a, rows, n_vocab, draft).unwrap();
            let got = match_argmax(&mut b, &ids[..=draft.len()], draft).unwrap();
            assert_eq!(got, want, "{draft:?}");
        }
        let mut s = Sampler::new(SamplerParams::greedy(), n_vocab).unwrap();
        assert!(matches!(
            match_argmax(&mut s, &[1, 2], &[1, 2, 3]),
            Err(SpecError::Rows { .. })
        ));
        let mut s = Sampler::new(SamplerParams::greedy(), n_vocab).unwrap();
        assert!(matches!(
            match_argmax(&mut s, &[1, u32::MAX], &[1]),
            Err(SpecError::Sampling(SamplingError::NoCandidates))
        ));
        // A row without candidates after the first mismatch is never read.
        let mut s = Sampler::new(SamplerParams::greedy(), n_vocab).unwrap();
        assert_eq!(
            match_argmax(&mut s, &[2, u32::MAX], &[1]).unwrap().accepted,
            0
        );
    }

    #[test]
    fn greedy_keeps_the_matching_prefix_and_adds_the_argmax() {
        let mut s = Sampler::new(SamplerParams::greedy(), 4).unwrap();
        // Row argmaxes: 2, 1, 3.
        let rows = [
            0.0, 0.1, 5.0, 0.0, //
            0.0, 4.0, 1.0, 0.0, //
            0.0, 0.0, 0.0, 1.0,
        ];
        let v = sample_and_match(&mut s, &rows, 4, &[2, 1]).unwrap();
        assert_eq!(
            v,
            Verdict {
                tokens: vec![2, 1, 3],
                accepted: 2
            }
        );
        let v = sample_and_match(&mut s, &rows, 4, &[2, 0]).unwrap();
        assert_eq!(
            v,
            Verdict {
                tokens: vec![2, 1],
                accepted: 1
            }
        );
        let v = sample_and_match(&mut s, &rows, 4, &[0, 1]).unwrap();
        assert_eq!(
            v,
            Verdict {
                tokens: vec![2],
                accepted: 0
            }
        );
        assert!(sample_and_match(&mut s, &rows[..8], 4, &[2, 1]).is_err());
    }

    /// Empirical distribution of the first emitted token (one row of p, draft from q) over
    /// `n` seeded trials.
    fn first_token_freq(verifier: &str, p: &[f64], q: &[f64], n: usize) -> Vec<f64> {
        let params = SamplerParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..SamplerParams::default()
        };
        let v = p.len();
        let rows: Vec<f32> = [logits_of(p), logits_of(p)].concat();
        let qf: Vec<f32> = {
            #[allow(clippy::cast_possible_truncation, reason = "test distribution")]
            q.iter().map(|&x| x as f32).collect()
        };
        let mut counts = vec![0.0; v];
        let mut draft_rng = Sampler::new(SamplerParams { seed: 7, ..params }, v).unwrap();
        for trial in 0..n {
            let mut s = Sampler::new(
                SamplerParams {
                    seed: u64::try_from(trial).unwrap() + 1000,
                    ..params
                },
                v,
            )
            .unwrap();
            let d = draw(q, draft_rng.next_uniform()).unwrap();
            let verdict = match verifier {
                "match" => sample_and_match(&mut s, &rows, v, &[d]).unwrap(),
                _ => rejection(&mut s, &rows, v, &[d], std::slice::from_ref(&qf)).unwrap(),
            };
            counts[usize::try_from(verdict.tokens[0]).unwrap()] += 1.0;
        }
        #[allow(clippy::cast_precision_loss, reason = "trial counts")]
        counts.iter().map(|c| c / n as f64).collect()
    }

    fn tv(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f64>() / 2.0
    }

    #[test]
    fn both_verifiers_emit_the_target_distribution_for_any_draft_distribution() {
        // vLLM-style convergence: the distance to the target shrinks as trials grow, and ends
        // far below the distance between target and draft.
        let p = [0.05, 0.4, 0.1, 0.25, 0.0, 0.2];
        let q = [0.5, 0.05, 0.05, 0.1, 0.2, 0.1];
        for verifier in ["match", "reject"] {
            let small = tv(&first_token_freq(verifier, &p, &q, 200), &p);
            let large = tv(&first_token_freq(verifier, &p, &q, 20_000), &p);
            assert!(large < 0.02, "{verifier}: TV {large} after 20k trials");
            assert!(
                large < small,
                "{verifier}: TV did not shrink ({small} → {large})"
            );
            assert!(
                large * 10.0 < tv(&p, &q),
                "{verifier}: TV {large} vs p–q {}",
                tv(&p, &q)
            );
        }
    }

    #[test]
    fn rejection_accepts_everything_when_draft_equals_target_and_draws_a_bonus() {
        let p = [0.1, 0.2, 0.3, 0.4];
        let params = SamplerParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 3,
            ..SamplerParams::default()
        };
        let rows: Vec<f32> = [logits_of(&p), logits_of(&p), logits_of(&p)].concat();
        #[allow(clippy::cast_possible_truncation, reason = "test distribution")]
        let q: Vec<f32> = p.iter().map(|&x| x as f32).collect();
        for seed in 0..50 {
            let mut s = Sampler::new(SamplerParams { seed, ..params }, 4).unwrap();
            let v = rejection(&mut s, &rows, 4, &[3, 2], &[q.clone(), q.clone()]).unwrap();
            // p(d)/q(d) = 1 up to f32 rounding of q: accepted (almost) surely.
            assert!(v.accepted >= 1, "seed {seed}: {v:?}");
            assert_eq!(v.tokens.len(), v.accepted + 1);
        }
        let mut s = Sampler::new(params, 4).unwrap();
        assert!(rejection(&mut s, &rows, 4, &[3, 2], &[q]).is_err());
    }

    #[test]
    fn seeded_verification_repeats() {
        let p = [0.3, 0.3, 0.4];
        let rows: Vec<f32> = [logits_of(&p), logits_of(&p)].concat();
        let params = SamplerParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 11,
            ..SamplerParams::default()
        };
        let run = || {
            let mut s = Sampler::new(params, 3).unwrap();
            (0..20)
                .map(|_| sample_and_match(&mut s, &rows, 3, &[2]).unwrap().tokens)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }
}

//! The stateful sampler: penalty history, random stream and reused buffers around the pure
//! chain of [`crate::steps`].

use crate::history::History;
use crate::steps::{self, index};
use crate::{Candidates, Rng, SamplerParams, SamplingError, TokenId};

/// A complete snapshot of a [`Sampler`]'s mutable state: the random stream and the penalty
/// window. `restore(&state())` puts the sampler back exactly, so the samples that follow are
/// the ones that followed the snapshot (speculative decoding takes one before verifying a
/// draft and restores it to roll back rejected tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SamplerState {
    /// The random stream.
    pub rng: Rng,
    /// The accepted tokens the penalties look at, oldest first (at most `repeat_last_n`).
    pub history: Vec<TokenId>,
}

/// The sampler chain for one sequence (llama.cpp's default chain: penalties → top-k → top-p →
/// min-p → temperature → dist), with its own seeded random stream and penalty history.
///
/// Per token: [`Sampler::sample`] (or [`Sampler::distribution`] when the caller needs the
/// probabilities, as verifiers do), then [`Sampler::accept`] with the token actually emitted.
/// Sampling does not accept by itself, because a verifier samples rows it may later reject.
///
/// Buffers are kept between calls, so after the first token no call allocates except
/// [`Sampler::state`] and the `Vec` that [`Sampler::sample_with_logprobs`] returns.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplerParams,
    vocab_size: usize,
    rng: Rng,
    history: History,
    /// The logits row with penalties applied (only used while a penalty is active).
    penalised: Vec<f32>,
    /// The last distribution.
    dist: Candidates,
    /// Scratch for the logprobs selection.
    scratch: Candidates,
}

impl Sampler {
    /// A sampler for a vocabulary of `vocab_size` tokens, its stream seeded with
    /// `params.seed`.
    ///
    /// # Errors
    /// [`SamplingError::InvalidParam`] from [`SamplerParams::validate`];
    /// [`SamplingError::InvalidVocabSize`] for 0 or more than 2^32 tokens.
    pub fn new(params: SamplerParams, vocab_size: usize) -> Result<Self, SamplingError> {
        params.validate()?;
        let max_vocab = u64::from(TokenId::MAX) + 1;
        if vocab_size == 0 || u64::try_from(vocab_size).map_or(true, |v| v > max_vocab) {
            return Err(SamplingError::InvalidVocabSize { vocab_size });
        }
        Ok(Self {
            params,
            vocab_size,
            rng: Rng::seed_from_u64(params.seed),
            history: History::new(usize::try_from(params.repeat_last_n).unwrap_or(usize::MAX)),
            penalised: Vec::new(),
            dist: Candidates::new(),
            scratch: Candidates::new(),
        })
    }

    /// The parameters.
    #[must_use]
    pub fn params(&self) -> &SamplerParams {
        &self.params
    }

    /// The vocabulary size every logits row must have.
    #[must_use]
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Records `token` as emitted: it enters the penalty window (dropping the oldest once the
    /// window holds `repeat_last_n` tokens). The random stream is not touched.
    ///
    /// # Errors
    /// [`SamplingError::TokenOutOfRange`] for a token outside the vocabulary.
    pub fn accept(&mut self, token: TokenId) -> Result<(), SamplingError> {
        self.check_token(token)?;
        self.history.push(token);
        Ok(())
    }

    /// The final sampling distribution for `logits` after the whole chain (penalties from the
    /// accepted history included): the tokens with non-zero probability and their normalised
    /// probabilities. Does not draw from the random stream. Greedy parameters give the argmax
    /// with probability 1.
    ///
    /// # Errors
    /// [`SamplingError::LogitsLength`] for a row of the wrong length;
    /// [`SamplingError::NoCandidates`] when every logit is −∞ or NaN.
    pub fn distribution(&mut self, logits: &[f32]) -> Result<&Candidates, SamplingError> {
        self.run_chain(logits)?;
        Ok(&self.dist)
    }

    /// Samples a token from [`Sampler::distribution`] by inverse CDF with one uniform draw
    /// (greedy included, as llama.cpp's `dist` sampler does, so that the stream position
    /// depends only on the number of samples taken). The lowest id wins ties under greedy.
    ///
    /// # Errors
    /// As [`Sampler::distribution`]; on error nothing is drawn.
    pub fn sample(&mut self, logits: &[f32]) -> Result<TokenId, SamplingError> {
        self.run_chain(logits)?;
        let u = self.rng.next_f64();
        self.dist.sample(u).ok_or(SamplingError::NoCandidates)
    }

    /// [`Sampler::sample`], plus the `n` most likely tokens under the softmax of the *raw*
    /// logits (before penalties, truncation and temperature) with their log-probabilities, in
    /// rank order, as OpenAI's `top_logprobs` reports them. `n = 0` skips that work.
    ///
    /// # Errors
    /// As [`Sampler::sample`].
    pub fn sample_with_logprobs(
        &mut self,
        logits: &[f32],
        n: usize,
    ) -> Result<(TokenId, Vec<(TokenId, f32)>), SamplingError> {
        let token = self.sample(logits)?;
        let mut top = Vec::with_capacity(n.min(self.vocab_size));
        steps::top_logprobs(logits, n, &mut self.scratch, &mut top);
        Ok((token, top))
    }

    /// One uniform draw in `[0, 1)` from the sampler's stream, for verifiers that make their
    /// own random decisions (rejection sampling's accept test) on the same reproducible stream.
    pub fn next_uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// A snapshot of the random stream and penalty window.
    #[must_use]
    pub fn state(&self) -> SamplerState {
        SamplerState {
            rng: self.rng,
            history: self.history.tokens().collect(),
        }
    }

    /// Puts the sampler back to `state`. A history longer than this sampler's window
    /// contributes its newest `repeat_last_n` tokens.
    ///
    /// # Errors
    /// [`SamplingError::TokenOutOfRange`] if the history names a token outside the vocabulary;
    /// the sampler is then left unchanged.
    pub fn restore(&mut self, state: &SamplerState) -> Result<(), SamplingError> {
        for &t in &state.history {
            self.check_token(t)?;
        }
        self.rng = state.rng;
        self.history.clear();
        for &t in &state.history {
            self.history.push(t);
        }
        Ok(())
    }

    /// Back to the state right after [`Sampler::new`]: the stream reseeded from
    /// `params.seed`, the penalty window emptied.
    pub fn reset(&mut self) {
        self.rng = Rng::seed_from_u64(self.params.seed);
        self.history.clear();
    }

    fn check_token(&self, token: TokenId) -> Result<(), SamplingError> {
        if index(token) < self.vocab_size {
            Ok(())
        } else {
            Err(SamplingError::TokenOutOfRange {
                token,
                vocab_size: self.vocab_size,
            })
        }
    }

    /// Runs the chain on `logits` into `self.dist`.
    fn run_chain(&mut self, logits: &[f32]) -> Result<(), SamplingError> {
        if logits.len() != self.vocab_size {
            return Err(SamplingError::LogitsLength {
                expected: self.vocab_size,
                got: logits.len(),
            });
        }
        let p = &self.params;
        let counts = self.history.counts();
        let row: &[f32] = if p.penalties_enabled() && !counts.is_empty() {
            self.penalised.clear();
            self.penalised.extend_from_slice(logits);
            steps::apply_penalties(
                &mut self.penalised,
                counts,
                p.repeat_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            );
            &self.penalised
        } else {
            logits
        };
        steps::chain(row, p, &mut self.dist);
        if self.dist.is_empty() {
            return Err(SamplingError::NoCandidates);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(params: SamplerParams, vocab: usize) -> Sampler {
        Sampler::new(params, vocab).expect("valid sampler")
    }

    #[test]
    fn new_rejects_bad_params_and_vocab() {
        let bad = SamplerParams {
            top_p: 0.0,
            ..SamplerParams::default()
        };
        assert!(matches!(
            Sampler::new(bad, 10),
            Err(SamplingError::InvalidParam { field: "top_p", .. })
        ));
        assert_eq!(
            Sampler::new(SamplerParams::default(), 0).map(|_| ()),
            Err(SamplingError::InvalidVocabSize { vocab_size: 0 })
        );
    }

    #[test]
    fn wrong_length_and_out_of_range_tokens_are_errors() {
        let mut s = sampler(SamplerParams::default(), 4);
        assert_eq!(
            s.sample(&[0.0; 5]),
            Err(SamplingError::LogitsLength {
                expected: 4,
                got: 5
            })
        );
        assert_eq!(
            s.accept(4),
            Err(SamplingError::TokenOutOfRange {
                token: 4,
                vocab_size: 4
            })
        );
        let bad = SamplerState {
            rng: Rng::seed_from_u64(1),
            history: vec![1, 9],
        };
        let before = s.state();
        assert!(s.restore(&bad).is_err());
        assert_eq!(s.state(), before);
    }

    #[test]
    fn all_neg_inf_logits_are_an_error_and_draw_nothing() {
        let mut s = sampler(SamplerParams::default(), 3);
        let before = s.state();
        assert_eq!(
            s.sample(&[f32::NEG_INFINITY; 3]),
            Err(SamplingError::NoCandidates)
        );
        assert_eq!(
            s.distribution(&[f32::NAN; 3]).map(|_| ()),
            Err(SamplingError::NoCandidates)
        );
        assert_eq!(s.state(), before);
        let mut g = sampler(SamplerParams::greedy(), 3);
        assert_eq!(
            g.sample(&[f32::NEG_INFINITY; 3]),
            Err(SamplingError::NoCandidates)
        );
    }

    #[test]
    fn greedy_takes_lowest_id_among_maxima_and_draws_once() {
        let mut s = sampler(SamplerParams::greedy(), 4);
        let mut rng = s.state().rng;
        assert_eq!(s.sample(&[1.0, 7.0, 7.0, 2.0]), Ok(1));
        rng.next_u64();
        assert_eq!(s.state().rng, rng);
    }

    #[test]
    fn sample_is_the_inverse_cdf_of_the_distribution_at_the_next_draw() {
        let logits = [0.1, 1.5, -0.3, 1.2, 0.9, f32::NEG_INFINITY];
        let mut s = sampler(
            SamplerParams {
                seed: 3,
                ..SamplerParams::unmodified()
            },
            logits.len(),
        );
        for _ in 0..50 {
            let dist = s.distribution(&logits).expect("finite logits").clone();
            let mut rng = s.state().rng;
            let want = dist.sample(rng.next_f64());
            assert_eq!(s.sample(&logits).ok(), want);
        }
    }

    #[test]
    fn repeat_penalty_pushes_greedy_off_a_repeated_token() {
        let params = SamplerParams {
            repeat_penalty: 2.0,
            repeat_last_n: 2,
            ..SamplerParams::greedy()
        };
        let logits = [3.0, 2.0, 1.0, -1.0];
        let mut s = sampler(params, 4);
        assert_eq!(s.sample(&logits), Ok(0));
        s.accept(0).expect("in vocabulary");
        // 3 / 2 = 1.5 < 2.
        assert_eq!(s.sample(&logits), Ok(1));
        s.accept(1).expect("in vocabulary");
        // Both penalised: 1.5 vs 1.0 vs 1.0 → 0 again.
        assert_eq!(s.sample(&logits), Ok(0));
        s.accept(2).expect("in vocabulary");
        s.accept(2).expect("in vocabulary");
        // Window of 2 now holds [2, 2]: token 0 is free again.
        assert_eq!(s.state().history, [2, 2]);
        assert_eq!(s.sample(&logits), Ok(0));
        // The distribution sees the penalty too (logit 1.0 / 2).
        let d = s.distribution(&logits).expect("finite logits");
        assert_eq!(d.as_slice()[0].logit, 3.0);
    }

    #[test]
    fn presence_penalty_with_negative_logits_multiplies() {
        let params = SamplerParams {
            repeat_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplerParams::unmodified()
        };
        let mut s = sampler(params, 3);
        s.accept(1).expect("in vocabulary");
        s.accept(1).expect("in vocabulary");
        let d = s.distribution(&[0.0, -1.0, 0.5]).expect("finite").clone();
        // -1 * 2 - (2 * 0.25 + 0.5) = -3.
        assert_eq!(d.get(1).map(|c| c.logit), Some(-3.0));
        assert_eq!(d.get(2).map(|c| c.logit), Some(0.5));
    }

    #[test]
    fn logprobs_use_raw_logits() {
        let params = SamplerParams {
            repeat_penalty: 100.0,
            ..SamplerParams::greedy()
        };
        let mut s = sampler(params, 3);
        s.accept(0).expect("in vocabulary");
        // Raw probabilities 0.5, 0.25, 0.25; the penalty takes token 0 to ln(4) / 100.
        let logits = [4f32.ln(), 2f32.ln(), 2f32.ln()];
        let (token, top) = s.sample_with_logprobs(&logits, 2).expect("finite");
        assert_eq!(token, 1, "token 0 penalised away");
        assert_eq!(top.len(), 2);
        assert_eq!(top[0].0, 0);
        assert!((top[0].1 - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(top[1].0, 1);
        assert!((top[1].1 - 0.25f32.ln()).abs() < 1e-6);
        let (_, none) = s.sample_with_logprobs(&logits, 0).expect("finite");
        assert!(none.is_empty());
        let (_, all) = s.sample_with_logprobs(&logits, 10).expect("finite");
        assert_eq!(all.len(), 3);
    }

    #[test]
    fn reset_restarts_the_stream_and_clears_history() {
        let logits = [0.3, 0.2, 0.1, 0.4];
        let params = SamplerParams {
            seed: 11,
            ..SamplerParams::unmodified()
        };
        let mut s = sampler(params, 4);
        let first: Vec<TokenId> = (0..20)
            .map(|_| {
                let t = s.sample(&logits).expect("finite");
                s.accept(t).expect("in vocabulary");
                t
            })
            .collect();
        s.reset();
        assert!(s.state().history.is_empty());
        let again: Vec<TokenId> = (0..20)
            .map(|_| {
                let t = s.sample(&logits).expect("finite");
                s.accept(t).expect("in vocabulary");
                t
            })
            .collect();
        assert_eq!(first, again);
    }

    #[test]
    fn restore_truncates_a_long_history_to_the_window() {
        let params = SamplerParams {
            repeat_last_n: 3,
            ..SamplerParams::default()
        };
        let mut s = sampler(params, 10);
        let state = SamplerState {
            rng: Rng::seed_from_u64(2),
            history: vec![1, 2, 3, 4, 5],
        };
        s.restore(&state).expect("tokens in vocabulary");
        assert_eq!(s.state().history, [3, 4, 5]);
        assert_eq!(s.state().rng, Rng::seed_from_u64(2));
    }
}

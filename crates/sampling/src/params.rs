//! Sampler parameters, with llama.cpp's defaults and a validation that names the bad field.

use crate::SamplingError;

/// Seed of [`SamplerParams::default`]. A fixed value, so that a default sampler is reproducible;
/// pass [`crate::entropy_seed`] for a different stream per run (llama.cpp's default).
pub const DEFAULT_SEED: u64 = 0xFFFF_FFFF;

/// The parameters of the sampler chain. Field meanings and defaults follow llama.cpp's
/// `common_params_sampling` (`common/common.h`); a value that disables a step is noted per
/// field. Construct with struct-update syntax over [`Default`] and check with
/// [`SamplerParams::validate`] (which [`crate::Sampler::new`] also calls).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerParams {
    /// Logits are divided by this after truncation; `0.0` means greedy (argmax). Default `0.8`.
    pub temperature: f32,
    /// Keep the `top_k` highest logits; `0` disables. Default `40`.
    pub top_k: u32,
    /// Keep the smallest prefix (by probability) whose mass reaches `top_p`; `1.0` disables.
    /// Default `0.95`.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` × the largest probability; `0.0`
    /// disables. Default `0.05`.
    pub min_p: f32,
    /// Repetition penalty: a positive logit of a recent token is divided by it, a non-positive
    /// one multiplied; `1.0` disables. Default `1.0`.
    pub repeat_penalty: f32,
    /// How many of the most recently accepted tokens the penalties look at; `0` disables all
    /// three penalties. Default `64`. (llama.cpp's `-1`, "the whole context", is the caller's to
    /// translate into the context size.)
    pub repeat_last_n: u32,
    /// Subtracted once from the logit of every token present in the window (OpenAI
    /// `presence_penalty`). Default `0.0`.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the window (OpenAI
    /// `frequency_penalty`). Default `0.0`.
    pub frequency_penalty: f32,
    /// Seed of the random stream. Default [`DEFAULT_SEED`].
    pub seed: u64,
    /// How many top log-probabilities a caller wants reported per token (OpenAI
    /// `top_logprobs`); `0` for none. Default `0`. The sampler itself does not read it: pass it
    /// to [`crate::Sampler::sample_with_logprobs`].
    pub n_probs: u32,
}

impl Default for SamplerParams {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: DEFAULT_SEED,
            n_probs: 0,
        }
    }
}

impl SamplerParams {
    /// Greedy decoding: temperature 0, every other step at its default (none of them can
    /// change the argmax except the penalties, which are off by default).
    #[must_use]
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Temperature 1 with every truncation disabled: the model's own softmax distribution.
    #[must_use]
    pub fn unmodified() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Self::default()
        }
    }

    /// Whether sampling reduces to argmax (temperature 0).
    #[must_use]
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Whether sampling is the plain argmax of the logits: greedy, no penalty that could
    /// change a logit, no probabilities to report. A backend may then read out only each
    /// row's argmax instead of the row.
    #[must_use]
    pub fn is_argmax(&self) -> bool {
        self.is_greedy() && !self.penalties_enabled() && self.n_probs == 0
    }

    /// Whether any of the three penalties can change a logit (llama.cpp's `is_disabled`,
    /// negated).
    #[must_use]
    pub fn penalties_enabled(&self) -> bool {
        self.repeat_last_n > 0
            && (self.repeat_penalty != 1.0
                || self.frequency_penalty != 0.0
                || self.presence_penalty != 0.0)
    }

    /// Checks every field against its domain; the error names the first bad field.
    ///
    /// # Errors
    /// [`SamplingError::InvalidParam`] for: a temperature that is negative or not finite; a
    /// `top_p` outside `(0, 1]`; a `min_p` outside `[0, 1]`; a `repeat_penalty` that is not
    /// positive and finite; a presence or frequency penalty that is not finite.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let checks: [(&'static str, f32, bool, &'static str); 6] = [
            (
                "temperature",
                self.temperature,
                self.temperature.is_finite() && self.temperature >= 0.0,
                "a finite value >= 0 (0 = greedy)",
            ),
            (
                "top_p",
                self.top_p,
                self.top_p > 0.0 && self.top_p <= 1.0,
                "a value in (0, 1] (1 = disabled)",
            ),
            (
                "min_p",
                self.min_p,
                (0.0..=1.0).contains(&self.min_p),
                "a value in [0, 1] (0 = disabled)",
            ),
            (
                "repeat_penalty",
                self.repeat_penalty,
                self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0,
                "a finite value > 0 (1 = disabled)",
            ),
            (
                "presence_penalty",
                self.presence_penalty,
                self.presence_penalty.is_finite(),
                "a finite value (0 = disabled)",
            ),
            (
                "frequency_penalty",
                self.frequency_penalty,
                self.frequency_penalty.is_finite(),
                "a finite value (0 = disabled)",
            ),
        ];
        match checks.into_iter().find(|&(_, _, ok, _)| !ok) {
            Some((field, value, _, expected)) => Err(SamplingError::InvalidParam {
                field,
                value: f64::from(value),
                expected,
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_llama_cpp_defaults() {
        let p = SamplerParams::default();
        assert_eq!(p.temperature, 0.8);
        assert_eq!(p.top_k, 40);
        assert_eq!(p.top_p, 0.95);
        assert_eq!(p.min_p, 0.05);
        assert_eq!(p.repeat_penalty, 1.0);
        assert_eq!(p.repeat_last_n, 64);
        assert_eq!(p.presence_penalty, 0.0);
        assert_eq!(p.frequency_penalty, 0.0);
        assert_eq!(p.n_probs, 0);
        assert!(!p.penalties_enabled());
        assert!(!p.is_greedy());
        assert_eq!(p.validate(), Ok(()));
        assert!(SamplerParams::greedy().is_greedy());
        assert_eq!(SamplerParams::unmodified().validate(), Ok(()));
    }

    fn bad_field(p: SamplerParams) -> &'static str {
        match p.validate() {
            Err(SamplingError::InvalidParam { field, .. }) => field,
            other => panic!("expected InvalidParam, got {other:?}"),
        }
    }

    #[test]
    fn invalid_values_name_their_field() {
        let d = SamplerParams::default();
        let cases: [(SamplerParams, &str); 13] = [
            (
                SamplerParams {
                    temperature: -0.1,
                    ..d
                },
                "temperature",
            ),
            (
                SamplerParams {
                    temperature: f32::NAN,
                    ..d
                },
                "temperature",
            ),
            (
                SamplerParams {
                    temperature: f32::INFINITY,
                    ..d
                },
                "temperature",
            ),
            (SamplerParams { top_p: 0.0, ..d }, "top_p"),
            (SamplerParams { top_p: 1.01, ..d }, "top_p"),
            (
                SamplerParams {
                    top_p: f32::NAN,
                    ..d
                },
                "top_p",
            ),
            (SamplerParams { min_p: -0.01, ..d }, "min_p"),
            (SamplerParams { min_p: 1.5, ..d }, "min_p"),
            (
                SamplerParams {
                    repeat_penalty: 0.0,
                    ..d
                },
                "repeat_penalty",
            ),
            (
                SamplerParams {
                    repeat_penalty: -1.0,
                    ..d
                },
                "repeat_penalty",
            ),
            (
                SamplerParams {
                    presence_penalty: f32::NAN,
                    ..d
                },
                "presence_penalty",
            ),
            (
                SamplerParams {
                    frequency_penalty: f32::NEG_INFINITY,
                    ..d
                },
                "frequency_penalty",
            ),
            (
                SamplerParams {
                    repeat_penalty: f32::INFINITY,
                    ..d
                },
                "repeat_penalty",
            ),
        ];
        for (p, field) in cases {
            assert_eq!(bad_field(p), field, "{p:?}");
        }
    }

    #[test]
    fn boundary_values_are_valid() {
        let d = SamplerParams::default();
        for p in [
            SamplerParams {
                temperature: 0.0,
                ..d
            },
            SamplerParams { top_p: 1.0, ..d },
            SamplerParams {
                top_p: f32::MIN_POSITIVE,
                ..d
            },
            SamplerParams { min_p: 0.0, ..d },
            SamplerParams { min_p: 1.0, ..d },
            SamplerParams {
                top_k: 0,
                repeat_last_n: 0,
                ..d
            },
            SamplerParams {
                presence_penalty: -2.0,
                frequency_penalty: 2.0,
                ..d
            },
        ] {
            assert_eq!(p.validate(), Ok(()), "{p:?}");
        }
    }

    #[test]
    fn error_message_names_field_value_and_range() {
        let p = SamplerParams {
            top_p: 1.5,
            ..SamplerParams::default()
        };
        let msg = p.validate().expect_err("invalid").to_string();
        assert_eq!(
            msg,
            "sampler parameter `top_p` = 1.5: expected a value in (0, 1] (1 = disabled)"
        );
    }
}

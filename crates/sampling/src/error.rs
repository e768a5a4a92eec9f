//! The crate's error type.

use crate::TokenId;

/// Errors of this crate: bad parameters, logits that do not fit the sampler, tokens outside
/// the vocabulary.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SamplingError {
    /// A sampler parameter outside its domain.
    #[error("sampler parameter `{field}` = {value}: expected {expected}")]
    InvalidParam {
        /// The field of [`crate::SamplerParams`].
        field: &'static str,
        /// The value given (integers and `f32`s convert to `f64` exactly).
        value: f64,
        /// The accepted range, in words.
        expected: &'static str,
    },
    /// A vocabulary size of 0, or one too large for a [`TokenId`].
    #[error("vocabulary size {vocab_size}: expected 1..=4294967295 tokens")]
    InvalidVocabSize {
        /// The size given.
        vocab_size: usize,
    },
    /// A logits row whose length is not the sampler's vocabulary size.
    #[error("logits row has {got} entries, the sampler's vocabulary has {expected}")]
    LogitsLength {
        /// The sampler's vocabulary size.
        expected: usize,
        /// The row's length.
        got: usize,
    },
    /// A token id (accepted, or in a restored history) outside the vocabulary.
    #[error("token {token} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfRange {
        /// The token.
        token: TokenId,
        /// The sampler's vocabulary size.
        vocab_size: usize,
    },
    /// Every logit is −∞ or NaN, so no token has positive probability.
    #[error("no candidate token: every logit is -inf or NaN")]
    NoCandidates,
}

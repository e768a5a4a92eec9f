//! The sampler chain: from a row of logits to the next token, reproducibly, and to the exact
//! distribution that token was drawn from.
//!
//! Lossless speculative decoding needs the verifier to see the same distribution the plain
//! sampler draws from (research/speculative.md §4), so this crate exposes the final, truncated
//! and tempered distribution ([`Sampler::distribution`]) and not only a sampled id. The math is
//! pure functions over logits ([`steps`]); [`Sampler`] adds the state around them.
//!
//! - [`SamplerParams`] — temperature, top-k, top-p, min-p, repetition / presence / frequency
//!   penalties, seed, logprob count; llama.cpp's defaults; [`SamplerParams::validate`].
//! - [`Sampler`] — one sequence's chain: [`Sampler::sample`], [`Sampler::distribution`],
//!   [`Sampler::sample_with_logprobs`], [`Sampler::accept`] (penalty history),
//!   [`Sampler::state`] / [`Sampler::restore`] (rollback), [`Sampler::reset`].
//! - [`Candidates`] / [`Candidate`] — a candidate list; after the chain, the distribution
//!   (`prob(token)`, inverse-CDF `sample(u)`).
//! - [`steps`] — penalties, argmax, top-k (partial selection, never a full sort), top-p,
//!   min-p, temperature, softmax, the whole [`steps::chain`], log-softmax top-n.
//! - [`Rng`] — xoshiro256** seeded by SplitMix64, written out here so a seed means the same
//!   stream in every version; [`entropy_seed`] for a per-run seed.
//! - [`SamplingError`] — bad parameters (naming the field), logits of the wrong length, tokens
//!   outside the vocabulary, rows with no finite logit.
//!
//! Semantics follow llama.cpp's `common/sampling.cpp` and `src/llama-sampler.cpp` step by
//! step; ties are broken by ascending token id throughout (see [`steps`]).
//!
//! ```
//! use specula_sampling::{Sampler, SamplerParams};
//!
//! let logits = [0.5f32, 2.0, 1.0, f32::NEG_INFINITY, 2.0];
//!
//! // Greedy: the argmax, lowest id among equal maxima.
//! let mut greedy = Sampler::new(SamplerParams::greedy(), logits.len())?;
//! assert_eq!(greedy.sample(&logits)?, 1);
//!
//! // Seeded sampling with llama.cpp's defaults; the distribution a verifier would use.
//! let params = SamplerParams { seed: 42, ..SamplerParams::default() };
//! let mut sampler = Sampler::new(params, logits.len())?;
//! let dist = sampler.distribution(&logits)?;
//! assert_eq!(dist.prob(3), 0.0); // -inf never has mass
//! assert!((dist.iter().map(|c| c.p).sum::<f32>() - 1.0).abs() < 1e-6);
//!
//! // Snapshot, sample, roll back: the same token comes out again.
//! let snapshot = sampler.state();
//! let first = sampler.sample(&logits)?;
//! sampler.restore(&snapshot)?;
//! assert_eq!(sampler.sample(&logits)?, first);
//! sampler.accept(first)?;
//! # Ok::<(), specula_sampling::SamplingError>(())
//! ```

mod candidates;
mod error;
mod history;
mod mask;
mod params;
mod rng;
mod sampler;
pub mod steps;

pub use candidates::{Candidate, Candidates};
pub use error::SamplingError;
pub use mask::LogitsMask;
pub use params::{DEFAULT_SEED, SamplerParams};
pub use rng::{Rng, SplitMix64, entropy_seed};
pub use sampler::{Sampler, SamplerState};

/// A token id, as in GGUF vocabularies and llama.cpp's `llama_token` (which is `i32` there;
/// ids are never negative, so specula uses `u32`).
pub type TokenId = u32;

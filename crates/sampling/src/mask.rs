//! A constraint on what may be sampled, applied to the logits before the sampler chain (a
//! grammar: structured output). The engine's loops call it; `specula-grammar` implements it.

/// A per-generation mask over the logits, with a state that advances as tokens are committed.
pub trait LogitsMask {
    /// How many leading tokens of `draft` it accepts from the current state (the state is
    /// unchanged): a speculative round's draft is cut there before the verify.
    fn valid_prefix(&mut self, draft: &[u32]) -> usize;

    /// Masks the rows of a verify batch `[anchor, draft…]` (one row when `draft` is empty):
    /// row `i`, of `n_vocab` logits, with the state after `draft[..i]`; a rejected token gets
    /// −∞. The state is the current one afterwards.
    ///
    /// # Errors
    /// The mask's own failure, as a message.
    fn mask_rows(&mut self, rows: &mut [f32], n_vocab: usize, draft: &[u32]) -> Result<(), String>;

    /// Advances the state past committed tokens.
    ///
    /// # Errors
    /// A token the state does not allow, as a message.
    fn accept(&mut self, tokens: &[u32]) -> Result<(), String>;
}

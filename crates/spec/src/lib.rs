//! Speculative decoding without changing the output.
//!
//! A [`Drafter`] proposes the next tokens cheaply; the target model runs the anchor and the
//! proposals in one batched forward, and a verifier ([`verify`]) keeps the longest prefix the
//! target itself would have produced, plus one token of its own. With batch-invariant target
//! kernels (row `i` of a verify batch has the bits of a one-token decode) greedy speculative
//! output is the plain greedy output token for token, and sampled output has exactly the
//! target's distribution.
//!
//! - [`Drafter`]: the lifecycle `begin / process / draft / accept / state · restore`, shared by
//!   every method (n-gram here; a draft model, DFlash and EAGLE3 in `specula-engine`, which
//!   ask the loop for target hidden states through [`Drafter::target_taps`] and receive them in
//!   [`Drafter::process_features`]);
//!   [`DrafterChain`] asks several in priority order, the first non-empty draft wins.
//! - [`BatchDrafter`]: every active sequence of a step in one call (draft asks of all, the
//!   target's rows of all with their features as rows of one batch); [`PerSeq`] serves
//!   per-sequence drafters through it, each sequence's call isolated from the others'.
//! - [`ngram`]: prompt lookup ([`ngram::NgramSimple`]) and an n-gram cache
//!   ([`ngram::NgramCache`]), drafters that need no second model.
//! - [`verify`]: sample-and-match (greedy is its temperature-0 case) and standard rejection
//!   sampling for drafters that give their distribution `q`.
//! - [`SpecStats`]: drafted, accepted, rounds, per-position acceptance — counted once per
//!   verified round.
//! - [`policy::Adaptive`]: the draft length of each round from measured acceptance and measured
//!   costs, down to not drafting, so that speculation does not make generation slower.
//!
//! ```
//! use specula_spec::{DraftParams, Drafter, ngram::NgramSimple};
//! let mut d = NgramSimple::new(1, 3);
//! d.begin(&[5, 6, 7, 8, 5]).unwrap();
//! // After `… 5` comes `6 7 8` earlier in the history.
//! let draft = d.draft(&DraftParams { history: &[5, 6, 7, 8, 5], n_max: 3, p_min: 0.0, window: None }).unwrap();
//! assert_eq!(draft, vec![6, 7, 8]);
//! ```

pub mod batch;
pub mod ngram;
pub mod policy;
pub mod verify;

mod stats;

pub use batch::{BatchDrafter, DraftAsk, Features, One, PerSeq, SeqFeed};
pub use stats::SpecStats;

/// Errors of drafters and verifiers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// The sampler refused a step (e.g. logits of the wrong length).
    #[error(transparent)]
    Sampling(#[from] specula_sampling::SamplingError),
    /// A drafter's own failure (a draft model's forward pass, …), with its cause.
    #[error("drafter {drafter}")]
    Drafter {
        /// The drafter's name.
        drafter: &'static str,
        /// What went wrong inside it (the draft model's or drafter network's error).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The verifier was given target rows that do not match the draft.
    #[error(
        "verify: {got} logits for a draft of {draft} tokens over {n_vocab} ids (want {} rows of {n_vocab})",
        draft + 1
    )]
    Rows {
        /// Logits given.
        got: usize,
        /// Draft tokens.
        draft: usize,
        /// Vocabulary size (logits per row).
        n_vocab: usize,
    },
    /// The rejection-sampling verifier was given draft distributions that do not match the
    /// draft.
    #[error(
        "verify: {got} draft distributions for {draft} draft tokens over {n_vocab} ids (want {draft} of {n_vocab} values)"
    )]
    Distributions {
        /// Distributions given.
        got: usize,
        /// Draft tokens.
        draft: usize,
        /// Vocabulary size.
        n_vocab: usize,
    },
    /// Target features (or what a drafter made of them) that do not fit the tokens they came
    /// with: the target must capture the drafter's taps for every token it runs.
    #[error("{drafter}: {got} feature values for {tokens} tokens (want {tokens} rows of {width})")]
    Features {
        /// The drafter's name.
        drafter: &'static str,
        /// Values given.
        got: usize,
        /// Tokens of the batch.
        tokens: usize,
        /// Values per token.
        width: usize,
    },
    /// Features left on a backend handed to a drafter that does not run there.
    #[error("{drafter}: target features on a backend this drafter does not run on")]
    DeviceFeatures {
        /// The drafter's name.
        drafter: &'static str,
    },
    /// Drafters of one batch that ask for different target taps (one batch of features has
    /// one row layout).
    #[error(
        "the drafter of sequence {seq} taps {taps:?}, that of sequence 0 {first:?}: one batch of features needs the same taps for all"
    )]
    Taps {
        /// The sequence whose drafter differs.
        seq: usize,
        /// Its taps.
        taps: Vec<usize>,
        /// The taps of sequence 0.
        first: Vec<usize>,
    },
    /// A drafter panicked (a bug), caught by [`PerSeq`]: only its sequence fails.
    #[error("{drafter} panicked: {message}")]
    Panicked {
        /// The drafter's name.
        drafter: &'static str,
        /// The panic's message.
        message: String,
    },
    /// A state handed to [`Drafter::restore`] was not made by that drafter.
    #[error("{0}: not a state of this drafter")]
    ForeignState(&'static str),
}

impl SpecError {
    /// A drafter's failure caused by `source` (a model's, an engine's error).
    pub fn drafter(
        drafter: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Drafter {
            drafter,
            source: Box::new(source),
        }
    }
}

/// A drafter's saved state, opaque to the loop.
pub type DrafterState = Box<dyn std::any::Any + Send>;

/// What a drafter is asked for in a round.
#[derive(Clone, Copy, Debug)]
pub struct DraftParams<'a> {
    /// Every committed token of the sequence, prompt included; the last one is the anchor
    /// the target has not run yet, which the draft continues.
    pub history: &'a [u32],
    /// At most this many tokens.
    pub n_max: usize,
    /// Model drafters stop at the first position whose top-1 probability is below this.
    pub p_min: f32,
    /// `Some(w)` for a probe (the speculative policy checks whether drafting pays again,
    /// [`policy::Adaptive`]): a drafter that keeps context of target positions and has more
    /// than `w` committed positions to catch up with may instead restart its context from the
    /// last `w`, so that a probe costs the same however long the drafter sat idle. A draft
    /// asked for later without a window (drafting pays) may bring the skipped context back.
    /// `None`: every committed position is context.
    pub window: Option<usize>,
}

/// A source of draft tokens, with the lifecycle llama.cpp's speculative framework uses.
pub trait Drafter {
    /// A short name (`ngram-simple`, `draft-simple`, …) for statistics and errors.
    fn name(&self) -> &'static str;

    /// A new sequence: `prompt` is what the target is about to run. Its last token is the
    /// anchor of the first draft; the rest reaches the target (and [`Drafter::process`] or
    /// [`Drafter::process_features`]) before that draft when the drafter asks for target
    /// taps, else possibly only in front of the first verify batch.
    ///
    /// # Errors
    /// A drafter's own failure (e.g. a draft model's prefill).
    fn begin(&mut self, prompt: &[u32]) -> Result<(), SpecError>;

    /// [`Drafter::begin`] for a target that already holds the first `reused` positions of
    /// `prompt` (a prompt-cache hit; 0 for a fresh cache) and runs only the rest. A drafter
    /// that keeps context of target positions (DFlash's injected KV, EAGLE-3's features)
    /// keeps it for at most those positions and returns how many of them it holds: the
    /// target must run the positions from there on, so that the drafter sees them. The
    /// default, for drafters that follow the tokens alone, calls `begin` and returns
    /// `reused`.
    ///
    /// # Errors
    /// As [`Drafter::begin`].
    fn begin_reusing(&mut self, prompt: &[u32], reused: usize) -> Result<usize, SpecError> {
        self.begin(prompt)?;
        Ok(reused)
    }

    /// The longest draft this drafter can make in a round (DFlash: its block size minus the
    /// anchor), `None` when only the loop's `n_max` bounds it.
    fn max_draft(&self) -> Option<usize> {
        None
    }

    /// The target ran `tokens` at positions `pos0..` (a prompt chunk, or a verify batch — with
    /// the prompt in front of the first one's anchor when the prompt was not run before — before
    /// its rejected rows are rolled back). Drafters that learn from the target's tokens hook in
    /// here (those that learn from its hidden states use [`Drafter::process_features`]); the
    /// default ignores it.
    ///
    /// # Errors
    /// A drafter's own failure.
    fn process(&mut self, tokens: &[u32], pos0: usize) -> Result<(), SpecError> {
        let _ = (tokens, pos0);
        Ok(())
    }

    /// The target hidden states this drafter learns from, as tap indices of the target's
    /// layer-input convention (`i` is the input of layer `i`, i.e. the output of Hugging Face
    /// layer `i − 1`; the target's layer count is the pre-final-norm state). The loop captures
    /// them in every target forward and hands them to [`Drafter::process_features`]. The
    /// default asks for none.
    fn target_taps(&self) -> &[usize] {
        &[]
    }

    /// [`Drafter::process`] with the captured target states of the batch: `features` is
    /// row-major `[tokens.len(), target_taps().len() · n_embd_target]`, each row the taps laid
    /// side by side in [`Drafter::target_taps`] order. The default ignores the features.
    ///
    /// # Errors
    /// A drafter's own failure.
    fn process_features(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &[f32],
    ) -> Result<(), SpecError> {
        let _ = features;
        self.process(tokens, pos0)
    }

    /// Whether this drafter reads the target's features where the target computed them
    /// ([`Drafter::process_device_features`]): a drafter running on the target's backend, so
    /// that the features of a round never travel to the host and back. The default: no.
    fn takes_device_features(&self) -> bool {
        false
    }

    /// [`Drafter::process_features`] with the features left on the target's backend: rows
    /// `rows` of `features`, the backend's tensor (`B::Tensor`, `[_, taps · n_embd]`, each
    /// row the taps side by side), type-erased. Called only when
    /// [`Drafter::takes_device_features`]; the default refuses.
    ///
    /// # Errors
    /// [`SpecError::DeviceFeatures`] for a tensor of another backend (or by default), and
    /// the drafter's own failures.
    fn process_device_features(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &(dyn std::any::Any + Send + Sync),
        rows: std::ops::Range<usize>,
    ) -> Result<(), SpecError> {
        let _ = (tokens, pos0, features, rows);
        Err(SpecError::DeviceFeatures {
            drafter: self.name(),
        })
    }

    /// Up to `p.n_max` tokens to follow `p.history` (possibly none).
    ///
    /// # Errors
    /// A drafter's own failure.
    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError>;

    /// The target accepted the first `n` tokens of this drafter's last draft.
    fn accept(&mut self, n: usize) {
        let _ = n;
    }

    /// Whether this drafter ends a draft by itself where it becomes unsure (its top-1
    /// probability below [`DraftParams::p_min`]), as a draft model does: an adaptive policy
    /// then only decides whether to draft and how long a draft may grow, and leaves where a
    /// draft ends to the drafter, which knows token by token.
    fn stops_when_unsure(&self) -> bool {
        false
    }

    /// A snapshot of the drafter's per-sequence state (for checkpoints and prompt caches).
    fn state(&self) -> DrafterState;

    /// Goes back to a snapshot made by [`Drafter::state`].
    ///
    /// # Errors
    /// [`SpecError::ForeignState`] for a snapshot of another drafter.
    fn restore(&mut self, state: &DrafterState) -> Result<(), SpecError>;
}

/// Several drafters asked in priority order: the first non-empty draft wins, and only the
/// drafter that made it hears [`Drafter::accept`].
pub struct DrafterChain {
    drafters: Vec<Box<dyn Drafter>>,
    last: Option<usize>,
}

impl std::fmt::Debug for DrafterChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrafterChain")
            .field(
                "drafters",
                &self.drafters.iter().map(|d| d.name()).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl DrafterChain {
    /// The drafters in priority order.
    #[must_use]
    pub fn new(drafters: Vec<Box<dyn Drafter>>) -> Self {
        Self {
            drafters,
            last: None,
        }
    }

    /// The drafter that made the last non-empty draft.
    #[must_use]
    pub fn last_name(&self) -> Option<&'static str> {
        self.last.map(|i| self.drafters[i].name())
    }
}

impl Drafter for DrafterChain {
    fn name(&self) -> &'static str {
        "chain"
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<(), SpecError> {
        self.last = None;
        self.drafters.iter_mut().try_for_each(|d| d.begin(prompt))
    }

    /// The context every drafter of the chain holds.
    fn begin_reusing(&mut self, prompt: &[u32], reused: usize) -> Result<usize, SpecError> {
        self.last = None;
        let mut held = reused;
        for d in &mut self.drafters {
            held = held.min(d.begin_reusing(prompt, reused)?);
        }
        Ok(held)
    }

    /// The longest draft of any drafter of the chain.
    fn max_draft(&self) -> Option<usize> {
        self.drafters
            .iter()
            .map(|d| d.max_draft())
            .try_fold(0, |m, d| d.map(|d| m.max(d)))
    }

    fn process(&mut self, tokens: &[u32], pos0: usize) -> Result<(), SpecError> {
        self.drafters
            .iter_mut()
            .try_for_each(|d| d.process(tokens, pos0))
    }

    /// The taps of the first drafter that asks for any: one feature capture per target
    /// forward serves one feature drafter (DFlash or EAGLE3) in a chain.
    fn target_taps(&self) -> &[usize] {
        self.drafters
            .iter()
            .map(|d| d.target_taps())
            .find(|t| !t.is_empty())
            .unwrap_or(&[])
    }

    fn process_features(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &[f32],
    ) -> Result<(), SpecError> {
        let mut fed = false;
        for d in &mut self.drafters {
            if !fed && !d.target_taps().is_empty() {
                fed = true;
                d.process_features(tokens, pos0, features)?;
            } else {
                d.process(tokens, pos0)?;
            }
        }
        Ok(())
    }

    /// Whether the chain's feature drafter ([`DrafterChain::target_taps`]) does.
    fn takes_device_features(&self) -> bool {
        self.drafters
            .iter()
            .find(|d| !d.target_taps().is_empty())
            .is_some_and(|d| d.takes_device_features())
    }

    fn process_device_features(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &(dyn std::any::Any + Send + Sync),
        rows: std::ops::Range<usize>,
    ) -> Result<(), SpecError> {
        let mut fed = false;
        for d in &mut self.drafters {
            if !fed && !d.target_taps().is_empty() {
                fed = true;
                d.process_device_features(tokens, pos0, features, rows.clone())?;
            } else {
                d.process(tokens, pos0)?;
            }
        }
        Ok(())
    }

    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        self.last = None;
        for (i, d) in self.drafters.iter_mut().enumerate() {
            let draft = d.draft(p)?;
            if !draft.is_empty() {
                self.last = Some(i);
                return Ok(draft);
            }
        }
        Ok(Vec::new())
    }

    fn stops_when_unsure(&self) -> bool {
        self.drafters.iter().all(|d| d.stops_when_unsure())
    }

    fn accept(&mut self, n: usize) {
        if let Some(i) = self.last {
            self.drafters[i].accept(n);
        }
    }

    fn state(&self) -> DrafterState {
        Box::new(
            self.drafters
                .iter()
                .map(|d| d.state())
                .collect::<Vec<DrafterState>>(),
        )
    }

    fn restore(&mut self, state: &DrafterState) -> Result<(), SpecError> {
        let states = state
            .downcast_ref::<Vec<DrafterState>>()
            .filter(|s| s.len() == self.drafters.len())
            .ok_or(SpecError::ForeignState("chain"))?;
        for (d, s) in self.drafters.iter_mut().zip(states) {
            d.restore(s)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A drafter that holds context for its first `held` positions and drafts at most `max`.
    struct Held {
        held: usize,
        max: Option<usize>,
    }

    impl Drafter for Held {
        fn name(&self) -> &'static str {
            "held"
        }
        fn begin(&mut self, _prompt: &[u32]) -> Result<(), SpecError> {
            Ok(())
        }
        fn begin_reusing(&mut self, _prompt: &[u32], reused: usize) -> Result<usize, SpecError> {
            self.held = self.held.min(reused);
            Ok(self.held)
        }
        fn max_draft(&self) -> Option<usize> {
            self.max
        }
        fn draft(&mut self, _p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
            Ok(Vec::new())
        }
        fn state(&self) -> DrafterState {
            Box::new(())
        }
        fn restore(&mut self, _s: &DrafterState) -> Result<(), SpecError> {
            Ok(())
        }
    }

    /// A chain reuses only what every member holds, and drafts at most its longest member's
    /// draft (unbounded when one member is).
    #[test]
    fn a_chain_reuses_what_all_its_drafters_hold() {
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8];
        let mut c = DrafterChain::new(vec![
            Box::new(ngram::NgramSimple::default()),
            Box::new(Held {
                held: 3,
                max: Some(5),
            }),
        ]);
        assert_eq!(c.begin_reusing(&prompt, 6).unwrap(), 3);
        assert_eq!(c.begin_reusing(&prompt, 2).unwrap(), 2);
        assert_eq!(c.max_draft(), None);
        let mut c = DrafterChain::new(vec![
            Box::new(Held {
                held: 9,
                max: Some(3),
            }),
            Box::new(Held {
                held: 9,
                max: Some(7),
            }),
        ]);
        assert_eq!(c.begin_reusing(&prompt, 6).unwrap(), 6);
        assert_eq!(c.max_draft(), Some(7));
        // The default: a drafter that follows the tokens alone reuses everything.
        let mut n = ngram::NgramSimple::default();
        assert_eq!(n.begin_reusing(&prompt, 7).unwrap(), 7);
        assert_eq!(n.max_draft(), None);
    }
}

//! A smaller model of the same vocabulary as a drafter (llama.cpp's `draft-simple`), the
//! vocabulary check that allows it, and the head restriction of `--spec-draft-vocab`.

use specula_spec::{DraftParams, Drafter, DrafterState, SpecError};
use specula_tensor::Backend;
use specula_tokenizer::{TokenAttr, Tokenizer, VocabKind};

use crate::{Checkpoint, Engine, EngineError, Result, Rewound, Rollback, Session};

/// Why a draft model cannot draft for a target.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum VocabMismatch {
    /// Different tokenizer families.
    #[error("the draft's vocabulary is {draft}, the target's {target}")]
    Kind {
        /// The target's.
        target: String,
        /// The draft's.
        draft: String,
    },
    /// Vocabulary sizes further apart than llama.cpp allows (128).
    #[error("the draft has {draft} tokens, the target {target} (more than 128 apart)")]
    Size {
        /// The target's.
        target: usize,
        /// The draft's.
        draft: usize,
    },
    /// A token that means different things.
    #[error("token {id} is `{draft}` in the draft but `{target}` in the target")]
    Token {
        /// The id.
        id: u32,
        /// The target's text.
        target: String,
        /// The draft's text.
        draft: String,
    },
    /// Different special tokens.
    #[error("the draft's {what} token is {draft:?}, the target's {target:?}")]
    Special {
        /// Which one (`BOS`, `EOS`).
        what: &'static str,
        /// The target's.
        target: Option<u32>,
        /// The draft's.
        draft: Option<u32>,
    },
}

/// Whether a draft model's tokens mean the target's (llama.cpp's rules for `draft-simple`:
/// same vocabulary type, same BOS/EOS, sizes within 128, identical texts from id 5 on).
///
/// # Errors
/// The first difference found.
pub fn check_vocab(
    target: &Tokenizer,
    draft: &Tokenizer,
) -> std::result::Result<(), VocabMismatch> {
    if target.kind() != draft.kind() {
        return Err(VocabMismatch::Kind {
            target: format!("{:?}", target.kind()),
            draft: format!("{:?}", draft.kind()),
        });
    }
    let (nt, nd) = (target.n_tokens(), draft.n_tokens());
    if nt.abs_diff(nd) > 128 {
        return Err(VocabMismatch::Size {
            target: nt,
            draft: nd,
        });
    }
    let (st, sd) = (target.special_tokens(), draft.special_tokens());
    for (what, t, d) in [("BOS", st.bos, sd.bos), ("EOS", st.eos, sd.eos)] {
        if t != d {
            return Err(VocabMismatch::Special {
                what,
                target: t,
                draft: d,
            });
        }
    }
    for id in 5..u32::try_from(nt.min(nd)).unwrap_or(u32::MAX) {
        let (t, d) = (target.token_text(id), draft.token_text(id));
        if t != d {
            return Err(VocabMismatch::Token {
                id,
                target: t.unwrap_or("").to_owned(),
                draft: d.unwrap_or("").to_owned(),
            });
        }
    }
    Ok(())
}

/// A smaller model of the same vocabulary as a drafter (llama.cpp's `draft-simple`): it keeps
/// its own cache in step with the committed history (only the part that changed is run again)
/// and drafts greedily, stopping where its top-1 probability falls below `p_min`.
pub struct DraftModel<B: Backend> {
    engine: std::sync::Arc<Engine<B>>,
    session: Session<B>,
    /// The tokens in the draft cache, in order.
    cached: Vec<u32>,
    logits: Vec<f32>,
    /// Rollbacks by replay and the rows they ran again.
    replays: (usize, usize),
    /// For a cache that rolls back by replay: its state when it held exactly the history of
    /// the last draft, before the draft tokens were run.
    checkpoint: Option<Checkpoint>,
    /// Prompt positions the last [`Drafter::begin`] kept from the cache.
    reused: usize,
}

impl<B: Backend> std::fmt::Debug for DraftModel<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModel")
            .field("engine", &self.engine)
            .field("cached", &self.cached.len())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> DraftModel<B> {
    /// A drafter from `engine` with its own session of `n_ctx` cells; `target` is the
    /// tokenizer of the model it drafts for.
    ///
    /// # Errors
    /// [`EngineError::Vocab`] when the vocabularies differ; errors making the session.
    pub fn new(
        engine: Engine<B>,
        target: &Tokenizer,
        n_ctx: usize,
        k_type: specula_tensor::QType,
        v_type: specula_tensor::QType,
    ) -> Result<Self> {
        Self::shared(std::sync::Arc::new(engine), target, n_ctx, k_type, v_type)
    }

    /// [`DraftModel::new`] over a draft engine shared with other drafters (one per server
    /// slot): each keeps its own session, the weights are loaded once.
    ///
    /// # Errors
    /// As [`DraftModel::new`].
    pub fn shared(
        engine: std::sync::Arc<Engine<B>>,
        target: &Tokenizer,
        n_ctx: usize,
        k_type: specula_tensor::QType,
        v_type: specula_tensor::QType,
    ) -> Result<Self> {
        check_vocab(target, &engine.tokenizer)?;
        let session = engine.session(n_ctx, k_type, v_type)?;
        Ok(Self {
            engine,
            session,
            cached: Vec::new(),
            logits: Vec::new(),
            replays: (0, 0),
            checkpoint: None,
            reused: 0,
        })
    }

    /// Rolls the draft cache back by checkpoint and replay instead of trimming
    /// ([`Session::force_replay`]).
    pub fn force_replay(&mut self) {
        self.session.force_replay();
    }

    /// Replays the draft cache has run instead of trimming, and the rows they ran again.
    #[must_use]
    pub fn replays(&self) -> (usize, usize) {
        self.replays
    }

    /// Positions of the prompt that the last [`Drafter::begin`] found in the draft cache and
    /// did not run again.
    #[must_use]
    pub fn reused(&self) -> usize {
        self.reused
    }

    /// Takes the cache back to its first `n` tokens.
    fn rewind(&mut self, n: usize) -> std::result::Result<(), SpecError> {
        let r = self
            .engine
            .rewind(
                &mut self.session,
                n,
                self.checkpoint.as_ref(),
                &self.cached[..n],
            )
            .map_err(Self::err)?;
        if let Rewound::Replayed(rows) = r {
            self.replays.0 += 1;
            self.replays.1 += rows;
        }
        self.cached.truncate(n);
        if self.checkpoint.is_some_and(|c| c.n_past() > n) {
            self.checkpoint = None;
        }
        Ok(())
    }

    fn err(e: EngineError) -> SpecError {
        SpecError::drafter("draft-simple", e)
    }

    /// Brings the cache to `tokens` (rerunning only what differs) and returns the logits of
    /// the last one.
    fn sync(&mut self, tokens: &[u32]) -> std::result::Result<(), SpecError> {
        let common = crate::common_prefix(&self.cached, tokens)
            // The last token is always run: its logits start the draft.
            .min(tokens.len().saturating_sub(1));
        self.rewind(common)?;
        let feed = &tokens[common..];
        self.engine
            .prefill_into(&mut self.session, feed, feed.len() - 1, &mut self.logits)
            .map_err(Self::err)?;
        self.cached.extend_from_slice(feed);
        if self.session.rollback() != Rollback::Trim {
            self.checkpoint = Some(self.session.checkpoint());
        }
        Ok(())
    }
}

/// The `n` most frequent ordinary tokens of `tok` by the vocabulary's own ranking (BPE ids
/// are merge ranks, learned most frequent first; SentencePiece scores are log frequencies),
/// plus every control, user-defined and end-of-generation token, in id order: the head rows a
/// draft model keeps with `--spec-draft-vocab` ([`Engine::restrict_draft_vocab`]).
#[must_use]
pub fn frequent_tokens(tok: &Tokenizer, n: usize) -> Vec<u32> {
    let n_tokens = u32::try_from(tok.n_tokens()).unwrap_or(u32::MAX);
    let special = TokenAttr::CONTROL | TokenAttr::USER_DEFINED;
    let (mut keep, mut ordinary): (Vec<u32>, Vec<u32>) = (0..n_tokens)
        .filter(|&t| !tok.token_attr(t).intersects(TokenAttr::UNUSED))
        .partition(|&t| tok.token_attr(t).intersects(special) || tok.is_eog(t));
    if tok.kind() == VocabKind::Spm {
        // Stable: equal scores keep id order.
        ordinary.sort_by(|&a, &b| tok.token_score(b).total_cmp(&tok.token_score(a)));
    }
    keep.extend(ordinary.into_iter().take(n));
    keep.sort_unstable();
    keep
}

impl<B: Backend> Engine<B> {
    /// Cuts this (draft) model's output head to [`frequent_tokens`]`(n)`; returns how many
    /// rows it kept. Drafting then never proposes a token outside them, which verification
    /// handles like any rejected draft.
    ///
    /// # Errors
    /// Errors of [`specula_models::Model::restrict_head`].
    pub fn restrict_draft_vocab(&mut self, n: usize) -> Result<usize> {
        let ids = frequent_tokens(&self.tokenizer, n);
        self.model.restrict_head(&self.backend, &ids)?;
        Ok(ids.len())
    }
}

/// The argmax (lowest id among equals) and its softmax probability.
pub(crate) fn top1(logits: &[f32]) -> (u32, f32) {
    let (mut best, mut max) = (0usize, f32::NEG_INFINITY);
    for (i, &x) in logits.iter().enumerate() {
        if x > max {
            (best, max) = (i, x);
        }
    }
    let sum: f64 = logits.iter().map(|&x| f64::from((x - max).exp())).sum();
    #[allow(
        clippy::cast_possible_truncation,
        reason = "a probability in [0, 1] as f32"
    )]
    let p = (1.0 / sum) as f32;
    (u32::try_from(best).unwrap_or(0), p)
}

impl<B: Backend> Drafter for DraftModel<B> {
    fn name(&self) -> &'static str {
        "draft-simple"
    }

    fn stops_when_unsure(&self) -> bool {
        true
    }

    fn begin(&mut self, prompt: &[u32]) -> std::result::Result<(), SpecError> {
        // Everything but the anchor, as the target holds it; too long a prompt for the draft
        // context leaves the cache empty and the drafter idle.
        let head = &prompt[..prompt.len().saturating_sub(1)];
        if head.is_empty() || head.len() >= self.session.n_ctx() {
            self.session.reset();
            self.cached.clear();
            self.checkpoint = None;
            self.reused = 0;
            return Ok(());
        }
        // What the cache holds of this prompt from the last request (a conversation's earlier
        // turns, a shared system prompt) stays: the rows of a position do not depend on the
        // batch that ran them, so kept rows are the rows a fresh prefill would write.
        let common = crate::common_prefix(&self.cached, head);
        self.rewind(common)?;
        self.checkpoint = None;
        self.reused = common;
        let feed = &head[common..];
        if !feed.is_empty() {
            self.engine
                .prefill_into(&mut self.session, feed, feed.len(), &mut self.logits)
                .map_err(Self::err)?;
            self.cached.extend_from_slice(feed);
        }
        Ok(())
    }

    fn draft(&mut self, p: &DraftParams<'_>) -> std::result::Result<Vec<u32>, SpecError> {
        let n_ctx = self.session.n_ctx();
        if p.history.is_empty() || p.history.len() + 1 > n_ctx || p.n_max == 0 {
            return Ok(Vec::new());
        }
        self.sync(p.history)?;
        let mut out = Vec::with_capacity(p.n_max);
        loop {
            let (at, prob) = top1(&self.logits);
            let tok = self
                .engine
                .model
                .head_ids()
                .map_or(at, |ids| ids[at as usize]);
            if prob < p.p_min {
                break;
            }
            out.push(tok);
            if out.len() == p.n_max || self.session.n_past() + 1 >= n_ctx {
                break;
            }
            self.engine
                .prefill_into(&mut self.session, &[tok], 0, &mut self.logits)
                .map_err(Self::err)?;
            self.cached.push(tok);
        }
        Ok(out)
    }

    fn state(&self) -> DrafterState {
        // The cache follows the history by itself (`sync`); the tokens are the state.
        Box::new(self.cached.clone())
    }

    fn restore(&mut self, state: &DrafterState) -> std::result::Result<(), SpecError> {
        let tokens = state
            .downcast_ref::<Vec<u32>>()
            .ok_or(SpecError::ForeignState("draft-simple"))?;
        // Keep the cache's common prefix; the next draft runs the rest.
        let common = crate::common_prefix(&self.cached, tokens);
        self.rewind(common)
    }
}

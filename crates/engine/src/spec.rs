//! The speculative decode loop, and a second model as a drafter.
//!
//! Each round drafts up to `k` tokens after the anchor (the last committed token, not yet in
//! the target's cache), runs `[anchor, d1..dk]` through the target in one forward, keeps what
//! [`specula_spec::verify::sample_and_match`] accepts plus one token of the target's own, and
//! rolls the rejected rows back out of the cache ([`Engine::rewind`]: a trim, or for a memory
//! that cannot trim the checkpoint taken before the verify, restored, and the accepted rows run
//! again). The first round opens as in llama.cpp's
//! `llama-speculative-simple`: the prompt's last token anchors it, so the first generated
//! token is drafted and verified like every later one, and drafts and acceptance come out the
//! same as llama.cpp's. The rest of the prompt is prefilled before that round for a feature
//! drafter (which needs its hidden states to draft), and otherwise runs in front of the
//! round's verify rows, in the same forward (the server's slots also anchor their first step
//! at the last prompt token).
//! The target's kernels are batch-invariant, so every verify row (and every replayed row) has
//! the bits of a one-token decode and greedy output is the plain greedy output token for token
//! (`tests/spec.rs` checks it for random drafters on a tiny model and on a real pair). `k`
//! comes from [`specula_spec::policy::Adaptive`] unless fixed.

use std::time::Instant;

use specula_spec::policy::Adaptive;
use specula_spec::verify::sample_and_match;
use specula_spec::{DraftParams, Drafter, DrafterState, SpecError, SpecStats};
use specula_tensor::Backend;
use specula_tokenizer::{DecodeOptions, TokenAttr, Tokenizer, VocabKind};

use crate::{
    Checkpoint, Engine, EngineError, GenerateOptions, Generation, Result, Rewound, Rollback,
    Session, ms, top_k_logits,
};

/// How a generation drafts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpecOptions {
    /// At most this many draft tokens per round (`--spec-draft-n-max`).
    pub n_max: usize,
    /// Drafts shorter than this are not verified (`--spec-draft-n-min`).
    pub n_min: usize,
    /// Model drafters stop at a position whose top-1 probability is below this
    /// (`--spec-draft-p-min`).
    pub p_min: f32,
    /// Choose each round's draft length from measured acceptance and costs (else always ask
    /// for `n_max`).
    pub adaptive: bool,
}

impl Default for SpecOptions {
    fn default() -> Self {
        Self {
            n_max: 16,
            n_min: 0,
            p_min: 0.75,
            adaptive: true,
        }
    }
}

impl<B: Backend> Engine<B> {
    /// [`Engine::generate`] with speculative rounds from `drafter`: the same tokens for greedy
    /// sampling, the same distribution otherwise, and the acceptance statistics in
    /// [`Generation::spec`]. Teacher forcing (`force_ids`) has nothing to speculate on and
    /// runs [`Engine::generate`].
    ///
    /// # Errors
    /// As [`Engine::generate`], and a drafter's own failures.
    pub fn generate_speculative(
        &self,
        s: &mut Session<B>,
        prompt: &[u32],
        opts: &GenerateOptions,
        drafter: &mut dyn Drafter,
        spec: &SpecOptions,
        mut on_token: impl FnMut(u32),
    ) -> Result<Generation> {
        if opts.force_ids.is_some() {
            return self.generate(s, prompt, opts, on_token);
        }
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let n_predict = opts.n_predict;
        let needed = s.n_past + prompt.len() + n_predict;
        if needed > s.n_ctx {
            return Err(EngineError::ContextFull {
                needed,
                prompt: s.n_past + prompt.len(),
                predict: n_predict,
                n_ctx: s.n_ctx,
            });
        }
        if n_predict == 0 {
            // Nothing to draft for: the prompt is evaluated as plain decoding does.
            let mut out = self.generate(s, prompt, opts, on_token)?;
            out.spec = Some(SpecStats::default());
            return Ok(out);
        }
        let n_vocab = self.model.hparams().n_vocab;
        let (mut sampler, mut out) = self.start(prompt, opts)?;
        let t0 = Instant::now();
        // llama-speculative-simple's convention: the prompt's last token is the anchor of the
        // first round, so the first generated token is drafted and verified like every other.
        let mut logits = Vec::new();
        // Feature drafters (DFlash, EAGLE3) see the target's hidden states of every batch.
        let mut taps = specula_models::Taps {
            layers: drafter.target_taps().to_vec(),
            rows: Vec::new(),
        };
        let mut features = Vec::new();
        drafter.begin(prompt).map_err(EngineError::Spec)?;
        let head = &prompt[..prompt.len() - 1];
        // Prompt tokens before the anchor that the first verify batch carries. A feature
        // drafter needs the target's hidden states of the prompt before it can draft, so the
        // head is prefilled first (one forward more than plain decoding); any other drafter
        // drafts round one from the prompt alone, and the head rides in front of that round's
        // verify rows: one forward for prompt and round, as plain decoding's prefill.
        let mut lead = 0;
        if !taps.layers.is_empty() && !head.is_empty() {
            // No logits: nothing is sampled from the head.
            self.run_for(
                s,
                head,
                head.len(),
                &mut logits,
                &mut taps,
                &mut features,
                drafter,
            )?;
        } else {
            lead = head.len();
        }
        out.timings.prompt_n = prompt.len();
        out.timings.prompt_ms = ms(t0);
        let mut history = prompt.to_vec();

        let mut t1 = Instant::now();
        let mut stats = SpecStats::default();
        let mut policy = Adaptive::new(spec.n_max)
            .self_limiting(spec.p_min > 0.0 && drafter.stops_when_unsure());
        let mut batch = Vec::with_capacity(spec.n_max + 1);
        // The first anchor, the last prompt token, is new to the drafter.
        let mut since_draft = 1usize;
        'rounds: while !out.stopped_at_eog && out.generated_ids.len() < n_predict {
            let left = n_predict - out.generated_ids.len();
            let lead = std::mem::take(&mut lead);
            // The anchor's position.
            let base = s.n_past + lead;
            // Room for drafts: the context after the anchor, and the budget after the token
            // the target adds.
            let room = (s.n_ctx - base - 1).min(left - 1);
            let k = if spec.adaptive {
                policy.next(room)
            } else {
                spec.n_max.min(room)
            };
            let td = Instant::now();
            let mut draft = if k > 0 {
                drafter
                    .draft(&DraftParams {
                        history: &history,
                        n_max: k,
                        p_min: spec.p_min,
                    })
                    .map_err(EngineError::Spec)?
            } else {
                Vec::new()
            };
            draft.truncate(k);
            if draft.len() < spec.n_min || draft.iter().any(|&d| d as usize >= n_vocab) {
                draft.clear();
            }
            let draft_s = td.elapsed().as_secs_f64();
            // Committed tokens the drafter had not seen when it was last asked.
            let caught_up = if k > 0 {
                std::mem::replace(&mut since_draft, 0)
            } else {
                0
            };

            // `lead` prompt tokens, the anchor, the draft.
            batch.clear();
            batch.extend_from_slice(&history[history.len() - 1 - lead..]);
            batch.extend_from_slice(&draft);
            // A memory that cannot trim comes back to this state on a partial rejection.
            let ck = (s.rollback() == Rollback::Replay).then(|| s.checkpoint());
            let tv = Instant::now();
            let in_drafter = self.run_for(
                s,
                &batch,
                lead,
                &mut logits,
                &mut taps,
                &mut features,
                drafter,
            )?;
            // The drafter's share (feature injection) is drafting cost, not verification.
            let verify_s = tv.elapsed().as_secs_f64() - in_drafter;
            let draft_s = draft_s + in_drafter;
            if lead > 0 {
                // As in plain decoding, the prompt's time is that of the forward that gives
                // the first token's logits.
                out.timings.prompt_ms = ms(t0);
                t1 = Instant::now();
            }

            let verdict = sample_and_match(&mut sampler, &logits, n_vocab, &draft)
                .map_err(EngineError::Spec)?;
            // Acceptance first: a drafter's work there (DFlash's deferred injection) is drafting
            // cost too.
            let ta = Instant::now();
            if !draft.is_empty() {
                drafter.accept(verdict.accepted);
            }
            let draft_s = draft_s + ta.elapsed().as_secs_f64();
            stats.record(draft.len(), verdict.accepted);
            if lead == 0 {
                // A verify that carried the prompt says nothing about a verify's cost.
                policy.record(draft.len(), verdict.accepted, verify_s, draft_s, caught_up);
            }
            // The cache keeps the anchor and the accepted drafts (and the prompt rows in front
            // of the first round's anchor, which a replay runs again too).
            let keep = 1 + verdict.accepted;
            let rewound = match self.rewind(s, base + keep, ck.as_ref(), &batch[..lead + keep]) {
                // A sliding-window ring that a verify of more rows than one forward writes has
                // overwritten: the replay starts before this round, from the history.
                Err(EngineError::Rewind { .. }) => {
                    let mut tail = history.clone();
                    tail.extend_from_slice(&draft[..verdict.accepted]);
                    self.rewind(s, base + keep, ck.as_ref(), &tail)?
                }
                r => r?,
            };
            if let Rewound::Replayed(rows) = rewound {
                stats.record_replay(rows);
            }
            // The drafter has seen the accepted drafts (it made them); the target's own token
            // is new to it.
            since_draft += 1;
            for (i, &id) in verdict.tokens.iter().enumerate() {
                if opts.top_logits > 0 {
                    let row = &logits[i * n_vocab..(i + 1) * n_vocab];
                    out.top_logits.push(top_k_logits(row, opts.top_logits));
                }
                out.generated_ids.push(id);
                history.push(id);
                on_token(id);
                if opts.stop_at_eog && self.tokenizer.is_eog(id) {
                    out.stopped_at_eog = true;
                    break 'rounds;
                }
                if out.generated_ids.len() == n_predict {
                    break 'rounds;
                }
            }
        }
        out.timings.predicted_n = out.generated_ids.len();
        out.timings.predicted_ms = ms(t1);
        out.text = self.tokenizer.decode(
            &out.generated_ids,
            DecodeOptions {
                remove_special: false,
                render_special: false,
            },
        );
        out.spec = Some(stats);
        Ok(out)
    }
}

impl<B: Backend> Engine<B> {
    /// Runs a target batch (prompt or verify) and tells the drafter, with the hidden states it
    /// taps when it asks for any; returns the seconds the drafter took.
    #[allow(
        clippy::too_many_arguments,
        reason = "the loop's buffers, reused across rounds"
    )]
    fn run_for(
        &self,
        s: &mut Session<B>,
        ids: &[u32],
        first: usize,
        logits: &mut Vec<f32>,
        taps: &mut specula_models::Taps,
        features: &mut Vec<f32>,
        drafter: &mut dyn Drafter,
    ) -> Result<f64> {
        let pos0 = s.n_past;
        if taps.layers.is_empty() {
            self.prefill_into(s, ids, first, logits)?;
            let t = Instant::now();
            drafter.process(ids, pos0).map_err(EngineError::Spec)?;
            Ok(t.elapsed().as_secs_f64())
        } else {
            self.prefill_with_features(s, ids, first, logits, taps, features)?;
            let t = Instant::now();
            drafter
                .process_features(ids, pos0, features)
                .map_err(EngineError::Spec)?;
            Ok(t.elapsed().as_secs_f64())
        }
    }
}

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
        if self.session.rollback() == Rollback::Replay {
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

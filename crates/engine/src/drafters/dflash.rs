//! DFlash (and DFlash2) as a [`Drafter`]: the draft cache follows the committed target
//! positions through KV injection, and each round drafts a whole block in one forward (DFlash:
//! the argmax of each row; DFlash2: the candidate selector's walk from the anchor).
//!
//! The network is [`specula_models::dflash::Dflash`]; this module owns its cache and decides
//! when target features become draft context ([`Injection`]):
//!
//! - **eager** (llama.cpp upstream): every target batch is injected as soon as the target ran
//!   it, rejected verify rows included; the next draft forgets positions past the committed
//!   ones (cell = position, so the next injection overwrites them).
//! - **deferred**: target batches are stashed and injected only when a draft needs them, in one
//!   pass: a verify batch of this drafter's own draft keeps its committed rows (anchor +
//!   accepted drafts) once [`Drafter::accept`] says how many, and any other batch (a plain
//!   decode step, a verify of another drafter's draft) is committed as it comes. Rejected rows
//!   are never encoded, and while the speculative policy decodes without drafts the context
//!   of many steps is encoded at once, a matrix product instead of a vector product per step
//!   (up to [`INJECT_CHUNK`] rows wait; a longer stash is injected).
//!
//! A probe ([`DraftParams::window`]) that would catch up with more than its window of
//! committed rows restarts the context from the window instead (deferred injection): the
//! cache then holds positions `base..` (cell = position − base; attention reads only the
//! cache, and RoPE scores depend on position differences alone), and the rows before the
//! window are held until the next draft. If that draft is not a probe (drafting paid) and
//! nothing was injected in between, they are brought back; else dropped. While the drafter
//! only answers probes, a stash that reaches [`INJECT_CHUNK`] committed rows keeps the last
//! window of them instead of injecting them all.
//!
//! Either way, between rounds the cache and the stash's committed rows together hold context
//! for exactly the committed target positions from `base` on — the invariant a snapshot ([`Drafter::state`],
//! which carries the stash) or a prompt-cache reuse ([`Drafter::begin`] injects the stash
//! first) relies on (llama.cpp fork bug TheTom#231: a flush deferred into `draft()` left
//! snapshots and cache hits without context, so those requests drafted nothing).

use std::ops::Range;
use std::sync::Arc;

use specula_gguf::Gguf;
use specula_models::dflash::{Dflash, DflashScratch};
use specula_quant::QType;
use specula_spec::{DraftParams, Drafter, DrafterState, SpecError};
use specula_tensor::Backend;

use super::rows::{self, DevRows};
use crate::{Engine, EngineError, Result};

/// When target features are written into the draft cache (`--dflash-defer-injection`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Injection {
    /// Inject every target batch right after the target ran it.
    Eager,
    /// Inject a verify batch's committed rows once acceptance is known.
    #[default]
    Deferred,
}

/// Target batches not yet injected (deferred injection): positions `pos0..pos0 + len`, the
/// first `committed` of them committed, the rest a verify batch waiting for its acceptance.
/// Their features stay on the backend, one row per token.
struct Stash<B: Backend> {
    pos0: usize,
    tokens: Vec<u32>,
    features: DevRows<B>,
    committed: usize,
}

impl<B: Backend> Stash<B> {
    /// An empty stash from `pos0` for features `width` wide.
    fn new(be: &B, pos0: usize, width: usize) -> Self {
        Self {
            pos0,
            tokens: Vec::new(),
            features: DevRows::new(be, width),
            committed: 0,
        }
    }

    /// Keeps the first `n` rows (the rest are not in the target's cache).
    fn truncate(&mut self, n: usize) {
        let n = n.min(self.tokens.len());
        self.tokens.truncate(n);
        self.features.truncate(n);
        self.committed = self.committed.min(n);
    }

    fn end(&self) -> usize {
        self.pos0 + self.tokens.len()
    }

    /// Appends `tokens` with rows `rows` of `features`, on the backend.
    fn append(&mut self, be: &B, tokens: &[u32], features: &B::Tensor, rows: Range<usize>) {
        self.features.append(be, features, rows);
        self.tokens.extend_from_slice(tokens);
    }

    /// Drops the first `d` rows.
    fn drain_front(&mut self, be: &B, d: usize) {
        let d = d.min(self.tokens.len());
        self.features.drain_front(be, d);
        self.tokens.drain(..d);
        self.pos0 += d;
        self.committed -= d.min(self.committed);
    }

    /// A copy of the first `n` rows (tokens and features).
    fn head(&self, be: &B, n: usize) -> Self {
        let n = n.min(self.tokens.len());
        Self {
            pos0: self.pos0,
            tokens: self.tokens[..n].to_vec(),
            features: self.features.head(be, n),
            committed: self.committed.min(n),
        }
    }
}

/// What [`Drafter::state`] saves.
struct State<B: Backend> {
    /// Tokens of positions `0..len`; the cache holds the context of `base..len`.
    ctx_tokens: Vec<u32>,
    stash: Option<Stash<B>>,
}

/// Rows injected per pass (bounds the scratch memory of long prompts), and the most committed
/// rows a stash keeps before it is injected.
const INJECT_CHUNK: usize = 512;

/// A DFlash drafter for one target.
pub struct DflashDrafter<B: Backend> {
    backend: Arc<B>,
    net: Arc<Dflash<B>>,
    kv: B::Kv,
    n_ctx: usize,
    scratch: DflashScratch<B>,
    taps: Vec<usize>,
    policy: Injection,
    /// The tokens of positions `0..ctx_tokens.len()`; the cache holds the context K/V of
    /// positions `base..ctx_tokens.len()`, position `p` in cell `p − base`.
    ctx_tokens: Vec<u32>,
    /// First position of the cache's context (0 unless a probe restarted it from a window).
    base: usize,
    stash: Option<Stash<B>>,
    /// The committed rows a windowed restart skipped (with the window's), for the next draft.
    held: Option<Stash<B>>,
    /// The last draft was a probe asked with this window.
    probing: Option<usize>,
    last_draft: Vec<u32>,
    block: Vec<u32>,
    rows: Vec<usize>,
    /// Each draft row's top-1 and its probability.
    ids: Vec<u32>,
    probs: Vec<f32>,
}

impl<B: Backend> std::fmt::Debug for DflashDrafter<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DflashDrafter")
            .field("net", &self.net)
            .field("policy", &self.policy)
            .field("context", &self.ctx_tokens.len())
            .finish_non_exhaustive()
    }
}

fn err(e: impl std::error::Error + Send + Sync + 'static) -> SpecError {
    SpecError::drafter("draft-dflash", e)
}

impl<B: Backend> DflashDrafter<B> {
    /// A drafter from the draft GGUF `file` for `target`, running on `backend` with a cache of
    /// `n_ctx` cells in the given formats.
    ///
    /// # Errors
    /// Loading errors of the draft (unsupported variants by name, shapes, taps past the
    /// target's layers, a MASK id outside the vocabulary) and cache formats the backend refuses.
    pub fn new(
        backend: Arc<B>,
        file: Arc<Gguf>,
        target: &Engine<B>,
        n_ctx: usize,
        k_type: QType,
        v_type: QType,
        policy: Injection,
    ) -> Result<Self> {
        let net = Dflash::load(&*backend, file, &target.model)?;
        Self::shared(backend, Arc::new(net), n_ctx, k_type, v_type, policy)
    }

    /// A drafter over a network (and the backend it runs on) shared with other drafters, one
    /// per server slot: the weights are loaded once ([`Dflash::load`]), each drafter keeps its
    /// own cache, context and scratch.
    ///
    /// # Errors
    /// A MASK id outside the vocabulary and cache formats the backend refuses.
    pub fn shared(
        backend: Arc<B>,
        net: Arc<Dflash<B>>,
        n_ctx: usize,
        k_type: QType,
        v_type: QType,
        policy: Injection,
    ) -> Result<Self> {
        let mask = net.hparams().mask_token_id;
        if mask as usize >= net.n_vocab() {
            return Err(EngineError::BadToken {
                id: mask,
                n_vocab: net.n_vocab(),
            });
        }
        let kv = backend
            .kv_new(net.kv_shape(n_ctx, k_type, v_type))
            .map_err(specula_models::ModelError::from)?;
        let scratch = net.scratch(&backend);
        let taps = net.hparams().target_layers.clone();
        Ok(Self {
            backend,
            net,
            kv,
            n_ctx,
            scratch,
            taps,
            policy,
            ctx_tokens: Vec::new(),
            base: 0,
            stash: None,
            held: None,
            probing: None,
            last_draft: Vec::new(),
            block: Vec::new(),
            rows: Vec::new(),
            ids: Vec::new(),
            probs: Vec::new(),
        })
    }

    /// The backend the drafter runs on.
    #[must_use]
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The network.
    #[must_use]
    pub fn net(&self) -> &Dflash<B> {
        &self.net
    }

    /// Positions whose context the drafter holds: in its cache, or committed in the stash
    /// that waits to be injected (deferred injection).
    #[must_use]
    pub fn context_len(&self) -> usize {
        match &self.stash {
            Some(st) if st.pos0 <= self.ctx_tokens.len() => st.pos0 + st.committed,
            _ => self.ctx_tokens.len(),
        }
    }

    /// First position of the cache's context: 0 unless a probe restarted it from a window.
    #[must_use]
    pub fn context_start(&self) -> usize {
        self.base
    }

    /// Keeps the tokens (and context) of positions `0..n`.
    fn truncate_ctx(&mut self, n: usize) {
        self.ctx_tokens.truncate(n);
        self.base = self.base.min(self.ctx_tokens.len());
    }

    /// Writes the context of `tokens` at `pos0..` into the cache, from rows `rows` of
    /// `features` (on the backend). A batch that starts past the context leaves a gap: the
    /// cache then ends where the gap starts.
    fn inject(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &B::Tensor,
        rows: Range<usize>,
    ) -> Result<(), SpecError> {
        let n = tokens.len();
        self.check_features(n, features, &rows)?;
        // A batch that rewrites positions before the cache's context starts it again there.
        self.truncate_ctx(pos0.min(self.ctx_tokens.len()));
        if pos0 > self.ctx_tokens.len() || pos0 - self.base + n > self.n_ctx {
            // Context the target never showed us (or past the cache): no drafting on top of it.
            return Ok(());
        }
        let local0 = pos0 - self.base;
        let mut pos = Vec::with_capacity(INJECT_CHUNK);
        for start in (0..n).step_by(INJECT_CHUNK) {
            let end = (start + INJECT_CHUNK).min(n);
            pos.clear();
            pos.extend(
                (local0 + start..local0 + end).map(|p| u32::try_from(p).unwrap_or(u32::MAX)),
            );
            self.net
                .inject_rows(
                    &self.backend,
                    &mut self.kv,
                    self.n_ctx,
                    &mut self.scratch,
                    features,
                    rows.start + start..rows.start + end,
                    &pos,
                )
                .map_err(err)?;
        }
        self.ctx_tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Rows `rows` of `features` are `n` rows of this drafter's feature width.
    fn check_features(
        &self,
        n: usize,
        features: &B::Tensor,
        rows: &Range<usize>,
    ) -> Result<(), SpecError> {
        let w = self.net.feature_width();
        let (t_rows, t_cols) = self.backend.shape(features);
        if t_cols != w || rows.len() != n || rows.end > t_rows {
            return Err(SpecError::Features {
                drafter: "draft-dflash",
                got: rows.len().min(t_rows.saturating_sub(rows.start)) * t_cols,
                tokens: n,
                width: w,
            });
        }
        Ok(())
    }

    /// Restarts the context at `start` (≥ the stash's first row, ≤ its committed end): the
    /// stash's rows before it become tokens without context, the cache holds nothing yet.
    /// `history` supplies the tokens of a gap between the context and the stash.
    fn skip_to(&mut self, start: usize, history: &[u32]) {
        let Some(st) = self.stash.as_mut() else {
            return;
        };
        if st.pos0 > self.ctx_tokens.len() {
            if history.len() < st.pos0 {
                return;
            }
            self.ctx_tokens.clear();
            self.ctx_tokens.extend_from_slice(&history[..st.pos0]);
        }
        self.ctx_tokens.truncate(st.pos0);
        let d = start.clamp(st.pos0, st.pos0 + st.committed) - st.pos0;
        self.ctx_tokens.extend_from_slice(&st.tokens[..d]);
        st.drain_front(&self.backend, d);
        self.base = self.ctx_tokens.len();
        if st.tokens.is_empty() {
            self.stash = None;
        }
    }

    /// Before a probe's draft: when more than `window` committed rows wait (or the stash does
    /// not join the context), restart the context from the last `window` of them, holding the
    /// committed rows for [`DflashDrafter::bring_back`].
    fn window_to(&mut self, committed: usize, window: usize, history: &[u32]) {
        let Some(st) = &self.stash else {
            return;
        };
        let joined = st.pos0 <= self.ctx_tokens.len();
        let waiting = committed.saturating_sub(self.ctx_tokens.len().max(st.pos0));
        if joined && waiting <= window {
            return;
        }
        let n = committed.saturating_sub(st.pos0).min(st.committed);
        self.held = (joined && n > 0).then(|| {
            let mut h = st.head(&self.backend, n);
            h.committed = n;
            h
        });
        self.skip_to(committed.saturating_sub(window), history);
    }

    /// A draft that is not a probe after a windowed restart: if the cache still holds just
    /// the window (nothing injected since), the held rows are injected from their start, and
    /// the context is whole again.
    fn bring_back(&mut self) -> Result<(), SpecError> {
        let Some(h) = self.held.take() else {
            return Ok(());
        };
        let intact = h.pos0 < self.base
            && h.end() == self.ctx_tokens.len()
            && self.ctx_tokens[h.pos0..] == h.tokens[..];
        if intact {
            self.ctx_tokens.truncate(h.pos0);
            self.base = h.pos0;
            self.inject(&h.tokens, h.pos0, h.features.tensor(), 0..h.tokens.len())?;
        }
        Ok(())
    }

    /// Injects the first `keep` rows of the stash and drops it.
    fn flush(&mut self, keep: usize) -> Result<(), SpecError> {
        if let Some(st) = self.stash.take() {
            let keep = keep.min(st.tokens.len());
            self.inject(&st.tokens[..keep], st.pos0, st.features.tensor(), 0..keep)?;
        }
        Ok(())
    }

    /// Injects the stash's committed rows, keeping the rows that wait for acceptance.
    fn flush_committed(&mut self) -> Result<(), SpecError> {
        let Some(mut st) = self.stash.take() else {
            return Ok(());
        };
        let n = st.committed;
        if n == 0 {
            self.stash = Some(st);
            return Ok(());
        }
        let r = self.inject(&st.tokens[..n], st.pos0, st.features.tensor(), 0..n);
        st.drain_front(&self.backend, n);
        if !st.tokens.is_empty() {
            self.stash = Some(st);
        }
        r
    }

    /// [`Drafter::process_features`] with rows `rows` of `features` on the backend.
    fn take_in(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &B::Tensor,
        rows: Range<usize>,
    ) -> Result<(), SpecError> {
        self.check_features(tokens.len(), features, &rows)?;
        // A stash reaching into this batch holds rows of a round whose acceptance never came:
        // the target's cache keeps them only up to where this batch starts, all committed.
        if let Some(st) = self.stash.as_mut() {
            st.truncate(pos0.saturating_sub(st.pos0));
            st.committed = st.tokens.len();
        }
        if self.policy == Injection::Eager {
            self.flush(usize::MAX)?;
            return self.inject(tokens, pos0, features, rows);
        }
        let own_verify = !self.last_draft.is_empty()
            && tokens.len() == self.last_draft.len() + 1
            && tokens[1..] == self.last_draft[..];
        if self.stash.as_ref().is_some_and(|st| st.end() != pos0) {
            // A gap before this batch: what the stash holds goes in first.
            self.flush(usize::MAX)?;
        }
        let w = self.net.feature_width();
        let be = &self.backend;
        let st = self.stash.get_or_insert_with(|| Stash::new(be, pos0, w));
        st.append(be, tokens, features, rows);
        if !own_verify {
            st.committed = st.tokens.len();
        }
        if st.committed >= INJECT_CHUNK {
            let joined = st.pos0 <= self.ctx_tokens.len();
            if let (Some(window), true) = (self.probing, joined) {
                // Only probes are asked: the next one restarts from its window anyway.
                let start = st.pos0 + st.committed - window.min(st.committed);
                self.held = None;
                self.skip_to(start, &[]);
            } else {
                self.flush_committed()?;
            }
        }
        Ok(())
    }
}

impl<B: Backend + 'static> Drafter for DflashDrafter<B> {
    fn name(&self) -> &'static str {
        "draft-dflash"
    }

    fn stops_when_unsure(&self) -> bool {
        true
    }

    fn target_taps(&self) -> &[usize] {
        &self.taps
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<(), SpecError> {
        // The cache may hold the context of an earlier request sharing this prompt's prefix
        // (a prompt-cache hit: the target will not run those positions again); the batches
        // that follow overwrite the rest. A cell's context depends only on the tokens up to
        // its position, so a common prefix is valid context whatever ran since. The earlier
        // request's committed rows still in the stash are part of that context.
        self.flush_committed()?;
        self.stash = None;
        self.held = None;
        self.probing = None;
        self.last_draft.clear();
        let common = crate::common_prefix(&self.ctx_tokens, prompt);
        self.truncate_ctx(common);
        Ok(())
    }

    fn begin_reusing(&mut self, prompt: &[u32], reused: usize) -> Result<usize, SpecError> {
        // Context for exactly the positions the target reuses (or fewer, when this drafter
        // sat out a request that wrote them: the target then runs them again).
        self.begin(prompt)?;
        self.truncate_ctx(reused);
        Ok(self.ctx_tokens.len())
    }

    fn max_draft(&self) -> Option<usize> {
        Some(self.net.hparams().block_size - 1)
    }

    fn process(&mut self, tokens: &[u32], pos0: usize) -> Result<(), SpecError> {
        // Without features nothing can be injected: the context ends before this batch.
        self.flush(usize::MAX)?;
        self.truncate_ctx(pos0);
        let _ = tokens;
        Ok(())
    }

    fn process_features(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &[f32],
    ) -> Result<(), SpecError> {
        let w = self.net.feature_width();
        let t = rows::upload(&*self.backend, "draft-dflash", tokens.len(), w, features)?;
        self.take_in(tokens, pos0, &t, 0..tokens.len())
    }

    fn takes_device_features(&self) -> bool {
        true
    }

    fn process_device_features(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &(dyn std::any::Any + Send + Sync),
        rows: Range<usize>,
    ) -> Result<(), SpecError> {
        let t = rows::on_backend::<B>("draft-dflash", features)?;
        self.take_in(tokens, pos0, t, rows)
    }

    fn accept(&mut self, n: usize) {
        // The anchor and `n` drafts of the verify batch at the stash's end are committed; the
        // rest were rejected. They are injected when a draft needs them.
        if let Some(st) = self.stash.as_mut() {
            let keep = st.committed + n + 1;
            st.truncate(keep);
            st.committed = st.tokens.len();
        }
    }

    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        self.last_draft.clear();
        let Some(&anchor) = p.history.last() else {
            return Ok(Vec::new());
        };
        // The anchor's position: everything before it is committed target context.
        let committed = p.history.len() - 1;
        self.probing = p.window;
        if self.policy == Injection::Deferred {
            match p.window {
                Some(w) => {
                    self.held = None;
                    self.window_to(committed, w, p.history);
                }
                None => {
                    self.bring_back()?;
                    // A stash that does not join the context (the target ran positions this
                    // drafter never saw): the context restarts at the stash.
                    if self
                        .stash
                        .as_ref()
                        .is_some_and(|st| st.pos0 > self.ctx_tokens.len())
                    {
                        self.skip_to(0, p.history);
                    }
                }
            }
        }
        if let Some(st) = &self.stash {
            let keep = committed.saturating_sub(st.pos0);
            self.flush(keep)?;
        }
        // (An injection failure above is this draft's error; the context then ends where it
        // failed, so later drafts stay correct.)
        // Rows past the committed ones were rejected (eager injection writes them).
        let common = crate::common_prefix(&self.ctx_tokens, p.history);
        self.truncate_ctx(common.min(committed));
        let block_size = self.net.hparams().block_size;
        let k = p
            .n_max
            .min(block_size - 1)
            .min(self.n_ctx.saturating_sub(committed - self.base + 1));
        if k == 0 || self.ctx_tokens.len() < committed {
            return Ok(Vec::new());
        }
        let mask = self.net.hparams().mask_token_id;
        self.block.clear();
        self.block.push(anchor);
        self.block.resize(k + 1, mask);
        self.rows.clear();
        self.rows.extend(1..=k);
        if self.net.is_dflash2() {
            // DFlash2: the selector walks the candidates from the anchor (each row's top-K
            // read out on the backend).
            let out = self
                .net
                .block_select(
                    &self.backend,
                    &mut self.kv,
                    self.n_ctx,
                    &mut self.scratch,
                    &self.block,
                    committed - self.base,
                    &self.rows,
                    anchor,
                    p.p_min,
                )
                .map_err(err)?;
            self.last_draft.clone_from(&out);
            return Ok(out);
        }
        // Each row's top-1 and its probability, read out on the backend.
        self.net
            .block_top1(
                &self.backend,
                &mut self.kv,
                self.n_ctx,
                &mut self.scratch,
                &self.block,
                committed - self.base,
                &self.rows,
                &mut self.ids,
                &mut self.probs,
            )
            .map_err(err)?;
        let mut out = Vec::with_capacity(k);
        for (&tok, &prob) in self.ids.iter().zip(&self.probs) {
            if tok == specula_tensor::NO_ARGMAX || prob < p.p_min {
                break;
            }
            out.push(tok);
        }
        self.last_draft.clone_from(&out);
        Ok(out)
    }

    fn state(&self) -> DrafterState {
        Box::new(State::<B> {
            ctx_tokens: self.ctx_tokens.clone(),
            stash: self
                .stash
                .as_ref()
                .map(|st| st.head(&self.backend, st.tokens.len())),
        })
    }

    fn restore(&mut self, state: &DrafterState) -> Result<(), SpecError> {
        let st = state
            .downcast_ref::<State<B>>()
            .ok_or(SpecError::ForeignState("draft-dflash"))?;
        // Cells are positions: what the cache still holds of the snapshot is the common prefix
        // of both token lists; the rest comes back with the next target batches.
        let common = crate::common_prefix(&self.ctx_tokens, &st.ctx_tokens);
        self.truncate_ctx(common);
        self.stash = st
            .stash
            .as_ref()
            .map(|x| x.head(&self.backend, x.tokens.len()));
        self.held = None;
        self.last_draft.clear();
        Ok(())
    }
}

//! EAGLE-3 as a [`Drafter`]: chain drafting in feature space.
//!
//! Target batches are encoded lazily (`g = fc(features)`, kept on the backend: one row of the
//! head's width per position; the features come as a backend tensor when the target captures
//! them there, [`Drafter::process_device_features`]): a batch's raw features wait until a draft needs them and are
//! then encoded with every other waiting row in one matrix product (at most
//! [`ENCODE_CHUNK`] rows wait; a longer wait is encoded), so steps the policy runs without a
//! draft cost the drafter nothing but a copy. The head's cache holds pairs `(token[P + 1], g[P])` at
//! positions `P`; a pair can only be written once the token after `P` is committed, so pairs
//! are written lazily, in one batch, when a draft is asked for — only ever for committed
//! positions (no rollback needed, and a snapshot is complete whenever it is taken). The draft
//! then seeds with `(anchor, g[N − 1])` at `N − 1` and chains greedily: each step's token is
//! the argmax (mapped through `d2t`), its `g` the previous step's prenorm state, stopping at
//! `n_max` or where the top-1 probability falls below `p_min` (llama.cpp's `draft-eagle3`).
//!
//! A probe ([`DraftParams::window`]) with more than its window of pairs to write restarts the
//! head's context at the window: pairs from `pairs_base` on, position `P` in cell
//! `P − pairs_base` (RoPE scores depend on position differences alone). Raw rows before the
//! window are not encoded: they are held, with the `g` rows before them, and the next draft
//! that is not a probe (drafting paid) encodes them and writes the pairs from the first held
//! position again.

use std::ops::Range;
use std::sync::Arc;

use specula_gguf::Gguf;
use specula_models::eagle3::{Eagle3, Eagle3Scratch};
use specula_quant::QType;
use specula_spec::{DraftParams, Drafter, DrafterState, SpecError};
use specula_tensor::Backend;

use super::rows::{self, DevRows};
use crate::{Engine, Result};

/// What [`Drafter::state`] saves: the head's context.
struct State<B: Backend> {
    seq: Vec<u32>,
    g: DevRows<B>,
    g_base: usize,
    raw: DevRows<B>,
    pairs: usize,
}

/// What a windowed restart set aside: `g` rows of positions `g_base..`, then raw rows up to
/// the window.
struct Held<B: Backend> {
    g_base: usize,
    g: DevRows<B>,
    raw: DevRows<B>,
}

/// The most rows whose raw features wait to be encoded; a batch that would pass it encodes
/// what waits first (bounds the host memory of long runs without drafts).
const ENCODE_CHUNK: usize = 512;

/// An EAGLE-3 drafter for one target.
pub struct Eagle3Drafter<B: Backend> {
    backend: Arc<B>,
    net: Arc<Eagle3<B>>,
    kv: B::Kv,
    n_ctx: usize,
    scratch: Eagle3Scratch<B>,
    taps: Vec<usize>,
    /// Tokens at positions `0..seq.len()` whose features are known (target-run positions).
    seq: Vec<u32>,
    /// `g` of positions `g_base..`…
    g: DevRows<B>,
    /// First position with a `g` row (0 unless a probe restarted the context).
    g_base: usize,
    /// Rows set aside by a probe's windowed restart.
    held: Option<Held<B>>,
    /// The last draft was a probe asked with this window.
    probing: Option<usize>,
    /// …and the raw features of the rest, waiting to be encoded (`feature_width` per row).
    raw: DevRows<B>,
    /// Pairs written into the cache: positions `pairs_base..pairs`.
    pairs: usize,
    /// First position whose pair the cache holds (0 unless a probe restarted it).
    pairs_base: usize,
    tokens: Vec<u32>,
    pos: Vec<u32>,
    /// Row indices into `g`.
    rows: Vec<usize>,
    /// The chain's current `g` row (the previous step's prenorm state).
    chain_g: B::Tensor,
    /// The chain's row indices: the seed's `g` row, and row 0 (each later step's prenorm).
    seed_row: B::Index,
    row0: B::Index,
    /// Each chain step's top-1 and its probability.
    ids: Vec<u32>,
    probs: Vec<f32>,
}

impl<B: Backend> std::fmt::Debug for Eagle3Drafter<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eagle3Drafter")
            .field("net", &self.net)
            .field("pairs", &self.pairs)
            .finish_non_exhaustive()
    }
}

fn err(e: impl std::error::Error + Send + Sync + 'static) -> SpecError {
    SpecError::drafter("draft-eagle3", e)
}

impl<B: Backend> Eagle3Drafter<B> {
    /// A drafter from the head GGUF `file` for `target`, on `backend`, with a cache of
    /// `n_ctx` cells.
    ///
    /// # Errors
    /// Loading errors of the head and cache formats the backend refuses.
    pub fn new(
        backend: Arc<B>,
        file: Arc<Gguf>,
        target: &Engine<B>,
        n_ctx: usize,
        k_type: QType,
        v_type: QType,
    ) -> Result<Self> {
        let net = Eagle3::load(&*backend, file, &target.model)?;
        Self::shared(backend, Arc::new(net), n_ctx, k_type, v_type)
    }

    /// A drafter over a head (and the backend it runs on) shared with other drafters, one per
    /// server slot: the weights are loaded once ([`Eagle3::load`]), each drafter keeps its own
    /// cache, features and scratch.
    ///
    /// # Errors
    /// Cache formats the backend refuses.
    pub fn shared(
        backend: Arc<B>,
        net: Arc<Eagle3<B>>,
        n_ctx: usize,
        k_type: QType,
        v_type: QType,
    ) -> Result<Self> {
        let kv = backend
            .kv_new(net.kv_shape(n_ctx, k_type, v_type))
            .map_err(specula_models::ModelError::from)?;
        let scratch = net.scratch(&backend);
        let taps = net.hparams().target_layers.clone();
        let g = DevRows::new(&*backend, net.hparams().n_embd);
        let raw = DevRows::new(&*backend, net.feature_width());
        let chain_g = backend.zeros(0, 0);
        let (seed_row, row0) = (backend.index(&[]), backend.index(&[0]));
        Ok(Self {
            backend,
            net,
            kv,
            n_ctx,
            scratch,
            taps,
            seq: Vec::new(),
            g,
            raw,
            pairs: 0,
            pairs_base: 0,
            g_base: 0,
            held: None,
            probing: None,
            tokens: Vec::new(),
            pos: Vec::new(),
            rows: Vec::new(),
            chain_g,
            seed_row,
            row0,
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
    pub fn net(&self) -> &Eagle3<B> {
        &self.net
    }

    /// Pairs the head's cache holds (positions `0..pairs`).
    #[must_use]
    pub fn pairs(&self) -> usize {
        self.pairs
    }
}

impl<B: Backend + 'static> Drafter for Eagle3Drafter<B> {
    fn name(&self) -> &'static str {
        "draft-eagle3"
    }

    fn stops_when_unsure(&self) -> bool {
        true
    }

    fn target_taps(&self) -> &[usize] {
        &self.taps
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<(), SpecError> {
        self.probing = None;
        let common = crate::common_prefix(&self.seq, prompt);
        self.truncate(common);
        Ok(())
    }

    fn begin_reusing(&mut self, prompt: &[u32], reused: usize) -> Result<usize, SpecError> {
        // Features of exactly the positions the target reuses (or fewer, when this drafter
        // sat out a request that wrote them: the target then runs them again).
        self.begin(prompt)?;
        self.truncate(reused.min(self.seq.len()));
        Ok(self.seq.len())
    }

    fn process(&mut self, _tokens: &[u32], pos0: usize) -> Result<(), SpecError> {
        self.truncate(pos0.min(self.seq.len()));
        Ok(())
    }

    fn process_features(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &[f32],
    ) -> Result<(), SpecError> {
        let w = self.net.feature_width();
        let t = rows::upload(&*self.backend, "draft-eagle3", tokens.len(), w, features)?;
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
        let t = rows::on_backend::<B>("draft-eagle3", features)?;
        self.take_in(tokens, pos0, t, rows)
    }

    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        let Some(&anchor) = p.history.last() else {
            return Ok(Vec::new());
        };
        let n = p.history.len() - 1;
        let common = crate::common_prefix(&self.seq, p.history);
        self.truncate(common);
        if n == 0 || self.seq.len() < n {
            return Ok(Vec::new());
        }
        self.probing = p.window;
        match p.window {
            // A probe: at most `w` pairs to write, else the context restarts at the window.
            Some(w) if (n - 1).saturating_sub(self.pairs) > w => self.window_to(n - 1 - w),
            Some(_) => {}
            // Drafting pays: the whole context again.
            None => self.bring_back()?,
        }
        let base = self.pairs_base;
        let k = p.n_max.min(self.n_ctx.saturating_sub(n - base + 1));
        // The seed needs `g` of the position before the anchor's: a context that starts later
        // (cut back to a shared prefix ending there) has nothing to draft from.
        if k == 0 || n - 1 < self.g_base {
            return Ok(Vec::new());
        }
        self.encode_waiting()?;
        // Pairs of the committed positions not written yet: (token[P + 1], g[P]), P < N − 1.
        if self.pairs + 1 < n {
            self.tokens.clear();
            self.tokens.extend_from_slice(&p.history[self.pairs + 1..n]);
            self.pos.clear();
            self.pos.extend(
                (self.pairs - base..n - 1 - base).map(|q| u32::try_from(q).unwrap_or(u32::MAX)),
            );
            self.rows.clear();
            self.rows
                .extend(self.pairs - self.g_base..n - 1 - self.g_base);
            self.net
                .decode_rows(
                    &self.backend,
                    &mut self.kv,
                    self.n_ctx,
                    &mut self.scratch,
                    &self.tokens,
                    self.g.tensor(),
                    &self.rows,
                    &self.pos,
                    None,
                )
                .map_err(err)?;
            self.pairs = n - 1;
        }
        // The chain: seed (anchor, g[N − 1]) at N − 1, then (draft, prenorm) onwards.
        let seed = u32::try_from(n - 1 - self.g_base).unwrap_or(u32::MAX);
        self.backend.set_index(&mut self.seed_row, &[seed]);
        self.backend
            .copy_rows(self.g.tensor(), &self.seed_row, &mut self.chain_g);
        let mut tok = anchor;
        let mut out = Vec::with_capacity(k);
        for step in 0..k {
            let pos = u32::try_from(n - 1 - base + step).unwrap_or(u32::MAX);
            self.net
                .decode_rows(
                    &self.backend,
                    &mut self.kv,
                    self.n_ctx,
                    &mut self.scratch,
                    &[tok],
                    &self.chain_g,
                    &[0],
                    &[pos],
                    Some((&mut self.ids, &mut self.probs)),
                )
                .map_err(err)?;
            let (t, prob) = (self.ids[0], self.probs[0]);
            if t == specula_tensor::NO_ARGMAX || prob < p.p_min {
                break;
            }
            out.push(t);
            tok = t;
            self.backend
                .copy_rows(self.scratch.prenorm_rows(), &self.row0, &mut self.chain_g);
        }
        Ok(out)
    }

    fn state(&self) -> DrafterState {
        let be = &*self.backend;
        Box::new(State::<B> {
            seq: self.seq.clone(),
            g: self.g.copy(be),
            g_base: self.g_base,
            raw: self.raw.copy(be),
            pairs: self.pairs,
        })
    }

    fn restore(&mut self, state: &DrafterState) -> Result<(), SpecError> {
        let st = state
            .downcast_ref::<State<B>>()
            .ok_or(SpecError::ForeignState("draft-eagle3"))?;
        // Cells are positions: the cache still holds the pairs of the common prefix.
        let common = crate::common_prefix(&self.seq, &st.seq);
        let pairs = self.pairs.min(st.pairs).min(common.saturating_sub(1));
        self.seq.clone_from(&st.seq);
        self.g = st.g.copy(&self.backend);
        self.g_base = st.g_base;
        self.raw = st.raw.copy(&self.backend);
        self.held = None;
        self.pairs = pairs;
        self.pairs_base = self.pairs_base.min(pairs);
        if self.pairs < self.g_base {
            // Pairs from here on need `g` rows the snapshot does not have: start there.
            self.pairs = self.g_base;
            self.pairs_base = self.g_base;
        }
        Ok(())
    }
}

impl<B: Backend> Eagle3Drafter<B> {
    /// [`Drafter::process_features`] with rows `rows` of `features` on the backend.
    fn take_in(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &B::Tensor,
        rows: Range<usize>,
    ) -> Result<(), SpecError> {
        let w = self.net.feature_width();
        let (t_rows, t_cols) = self.backend.shape(features);
        if t_cols != w || rows.len() != tokens.len() || rows.end > t_rows {
            return Err(SpecError::Features {
                drafter: "draft-eagle3",
                got: rows.len().min(t_rows.saturating_sub(rows.start)) * t_cols,
                tokens: tokens.len(),
                width: w,
            });
        }
        if pos0 > self.seq.len() {
            // The target ran positions we never saw: no context past the gap.
            return Ok(());
        }
        self.truncate(pos0);
        if self.raw.len() + tokens.len() > ENCODE_CHUNK {
            let g_end = self.g_base + self.g.len();
            match self.probing {
                // Only probes are asked: the next one starts from its window anyway.
                Some(window) if self.seq.len() > g_end + window => {
                    self.window_to(self.seq.len() - window);
                    self.held = None;
                }
                _ => self.encode_waiting()?,
            }
        }
        self.raw.append(&self.backend, features, rows);
        self.seq.extend_from_slice(tokens);
        Ok(())
    }

    /// Keeps the context of positions `0..n`: pairs need the token after them.
    fn truncate(&mut self, n: usize) {
        let g_end = self.g_base + self.g.len();
        self.seq.truncate(n);
        if n < self.g_base {
            // Before the context's start: it starts again at `n`.
            self.g.truncate(0);
            self.raw.truncate(0);
            self.g_base = n;
            self.held = None;
        }
        self.g.truncate(n - self.g_base);
        self.raw.truncate(n.saturating_sub(g_end));
        self.pairs = self.pairs.min(n.saturating_sub(1));
        if self.pairs < self.g_base {
            self.pairs = self.g_base;
            self.pairs_base = self.g_base;
        }
        self.pairs_base = self.pairs_base.min(self.pairs);
    }

    /// A probe's restart at `start`: pairs from there on; when the window's rows are all
    /// still raw, the rows before it are held, not encoded.
    fn window_to(&mut self, start: usize) {
        let g_end = self.g_base + self.g.len();
        if start > g_end {
            let be = &*self.backend;
            let width = self.net.hparams().n_embd;
            self.held = Some(Held {
                g_base: self.g_base,
                g: std::mem::replace(&mut self.g, DevRows::new(be, width)),
                raw: self.raw.drain_front(be, start - g_end),
            });
            self.g_base = start;
        }
        self.pairs = start;
        self.pairs_base = start;
    }

    /// A draft that is not a probe: held rows are encoded and joined to the context again,
    /// and the pairs are written from the first position with a `g` row.
    fn bring_back(&mut self) -> Result<(), SpecError> {
        if let Some(h) = self.held.take()
            && h.g_base + h.g.len() + h.raw.len() == self.g_base
        {
            let mut g = h.g;
            if h.raw.len() > 0 {
                self.net
                    .encode_rows(
                        &self.backend,
                        &mut self.scratch,
                        h.raw.tensor(),
                        0..h.raw.len(),
                    )
                    .map_err(err)?;
                g.append(&self.backend, self.scratch.g_rows(), 0..h.raw.len());
            }
            g.extend(&self.backend, &self.g);
            self.g = g;
            self.g_base = h.g_base;
        }
        if self.pairs_base > self.g_base {
            self.pairs = self.g_base;
            self.pairs_base = self.g_base;
        }
        Ok(())
    }

    /// Encodes the waiting raw features in one pass, appending their `g` rows.
    fn encode_waiting(&mut self) -> Result<(), SpecError> {
        let rows = self.raw.len();
        if rows == 0 {
            return Ok(());
        }
        self.net
            .encode_rows(&self.backend, &mut self.scratch, self.raw.tensor(), 0..rows)
            .map_err(err)?;
        let (got, width) = self.backend.shape(self.scratch.g_rows());
        if got != rows {
            return Err(SpecError::Features {
                drafter: "draft-eagle3",
                got: got * width,
                tokens: rows,
                width,
            });
        }
        self.g.append(&self.backend, self.scratch.g_rows(), 0..rows);
        self.raw.truncate(0);
        Ok(())
    }
}

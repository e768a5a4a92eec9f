//! The engine: one model, its tokenizer, and sessions that run prompts through it.
//!
//! - [`Engine`] — a [`Model`] on a [`Backend`] with its [`Tokenizer`].
//! - [`Session`] — one sequence: its KV cache, activation buffers and how many positions it
//!   holds. [`Engine::prefill`] runs prompt tokens in chunks of `n_batch`; [`Engine::decode`]
//!   runs one token.
//! - [`Engine::generate`] — prefill, then sample (or teacher-force) token by token until the
//!   budget, an end-of-generation token or the context end; returns ids, text and llama.cpp-style
//!   [`Timings`].
//!
//! - [`SpecSeq`] — one speculative round, the same for `run`, `bench` and `serve`: [`plan`]
//!   (draft length, one drafter call for every sequence, clamp, rows, checkpoint), the caller's
//!   forward, [`SpecSeq::commit`] (verify, accept, statistics and policy, rollback).
//! - [`Engine::generate_speculative`] — [`Engine::generate`] with speculative rounds from any
//!   [`specula_spec::Drafter`]; [`Engine::decode_multi_isolated`] — a batched forward in which
//!   a failing entry fails alone.
//! - [`drafters`] — the drafters that drive a model: [`DraftModel`], a smaller model of the
//!   same vocabulary.
//! - [`Rollback`] — how a session takes rejected rows back: a trim, or [`Session::checkpoint`]
//!   before the verify and [`Engine::rewind`] (restore, run the accepted rows again) after it.
//! - in [`drafters`] too: [`DflashDrafter`], a DFlash block drafter fed with the target's
//!   hidden states (KV injection, eager or deferred: [`Injection`]), and [`Eagle3Drafter`], an
//!   EAGLE-3 head drafting a chain in feature space.

pub mod drafters;
mod extract;
mod rollback;
mod round;
mod spec;
mod state;

use std::sync::Arc;
use std::time::Instant;

use specula_models::{Model, ModelError, Scratch, SeqRows, TapSink};
use specula_quant::QType;
use specula_sampling::{LogitsMask, Sampler, SamplerParams, SamplingError};
use specula_tensor::Backend;
use specula_tokenizer::{DecodeOptions, Tokenizer};

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The request does not fit the context.
    #[error(
        "{needed} positions are needed ({prompt} prompt tokens + {predict} to generate) but the context holds {n_ctx}; raise the context size (-c) or shorten the request"
    )]
    ContextFull {
        /// Positions needed.
        needed: usize,
        /// Prompt tokens.
        prompt: usize,
        /// Tokens to generate.
        predict: usize,
        /// Context size.
        n_ctx: usize,
    },
    /// An empty prompt (a model needs at least one token to predict from).
    #[error("the prompt is empty: nothing to predict from")]
    EmptyPrompt,
    /// A token id past the vocabulary.
    #[error("token id {id} is outside the vocabulary of {n_vocab} tokens")]
    BadToken {
        /// The id.
        id: u32,
        /// Vocabulary size.
        n_vocab: usize,
    },
    /// Model error.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Sampler error.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// Feature extraction was asked for something it cannot do.
    #[error("feature extraction: {0}")]
    Extract(String),
    /// The generation's logits mask (a grammar) failed.
    #[error("the output constraint failed: {0}")]
    Mask(String),
    /// A drafter or verifier failed.
    #[error(transparent)]
    Spec(specula_spec::SpecError),
    /// A draft model's vocabulary is not the target's.
    #[error("the draft model cannot draft for this target")]
    Vocab(#[from] VocabMismatch),
    /// A checkpoint of positions the session no longer holds.
    #[error(
        "cannot restore a checkpoint of {checkpoint} positions: the session holds only {n_past} now"
    )]
    StaleCheckpoint {
        /// Positions of the checkpoint.
        checkpoint: usize,
        /// Positions the session holds.
        n_past: usize,
    },
    /// A rollback by replay without the ids to replay.
    #[error(
        "cannot roll back to {to} positions by replay from position {from}: the ids are known only from position {known}"
    )]
    Rewind {
        /// Positions to keep.
        to: usize,
        /// Where the replay would start.
        from: usize,
        /// First position whose id was given.
        known: usize,
    },
    /// KV cache formats the model's heads cannot be stored in.
    #[error(transparent)]
    Kv(#[from] specula_kv::KvError),
    /// Saved session state that does not fit the session it is loaded into
    /// ([`Engine::load_session`]).
    #[error("saved session state: {0}")]
    SessionState(String),
    /// A forward panicked (a bug), caught by [`Engine::decode_multi_isolated`].
    #[error("the forward panicked: {message}")]
    Panicked {
        /// The panic's message.
        message: String,
    },
}

pub use drafters::{
    DflashDrafter, DraftModel, Eagle3Drafter, Injection, VocabMismatch, check_vocab,
    frequent_tokens,
};
pub use extract::{ExtractOptions, SeqFeatures};
pub use rollback::{Checkpoint, Rewound};
pub use round::{FeatureBuf, PlanEntry, RoundCost, SpecSeq, plan};
pub use spec::SpecOptions;
pub use specula_kv::Rollback;

/// Result alias.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// The text whose K and V rows fix the offsets of every session's quantized cache
/// ([`Engine::session`]): prose and code, as the caches hold. The offsets take the part all
/// rows share (K biases, massive-activation channels) out of the quantization blocks, which
/// any text shows.
pub const KV_CALIBRATION_TEXT: &str = "The cache stores the keys and values of every position \
    that came before, so that each new token attends to the whole context without computing it \
    again. Here is a short program that reads a file, counts its words and prints the most \
    common ones:\n\nimport collections\nimport sys\n\n\ndef main(path):\n    with open(path, \
    encoding=\"utf-8\") as f:\n        words = f.read().lower().split()\n    counts = \
    collections.Counter(words)\n    for word, n in counts.most_common(10):\n        \
    print(f\"{n:6d} {word}\")\n\n\nif __name__ == \"__main__\":\n    main(sys.argv[1])\n\n\
    It runs in linear time; the dictionary holds one entry per distinct word.\n";

/// How many tokens of [`KV_CALIBRATION_TEXT`] a session runs to fix its cache offsets.
pub const KV_CALIBRATION_TOKENS: usize = 128;

/// A model with its tokenizer on a backend.
pub struct Engine<B: Backend> {
    /// The device: one backend instance, shared with the drafters that run beside the model
    /// (`Arc::clone` it for [`drafters::DflashDrafter::new`] and the others).
    pub backend: Arc<B>,
    /// The model.
    pub model: Model<B>,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Tokens per prefill chunk.
    pub n_batch: usize,
    /// Per-layer cache formats that differ from a session's `-ctk` / `-ctv`
    /// (`--cache-type-k-layers`), applied to every session of this engine.
    pub kv_overrides: Vec<specula_tensor::LayerOverride>,
    /// Sliding-window layers keep a cell per position of the context (`--swa-full`), instead
    /// of a ring of `window + n_batch` cells (llama.cpp's SWA cache; the default).
    pub swa_full: bool,
    /// States a recurrent layer keeps after the last rows of a forward
    /// ([`specula_tensor::RecurrentLayers::snapshots`]; [`Model::DEFAULT_SNAPSHOTS`]): a
    /// rejected draft tail of up to this many rows is taken back by selecting one, a longer one
    /// by replay. 0: replay always.
    pub recurrent_snapshots: usize,
}

impl<B: Backend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.backend.name())
            .field("model", &self.model)
            .field("n_batch", &self.n_batch)
            .field("swa_full", &self.swa_full)
            .finish_non_exhaustive()
    }
}

/// One sequence's state.
pub struct Session<B: Backend> {
    kv: B::Kv,
    layout: specula_kv::KvLayout,
    scratch: Scratch<B>,
    pos: Vec<u32>,
    rows: Vec<usize>,
    /// The argmax of each logits row of the latest prefill, when the scratch reads them out
    /// ([`Session::set_argmax`]).
    ids: Vec<u32>,
    n_past: usize,
    n_ctx: usize,
    rollback: specula_kv::Rollback,
    ring: Option<SwaRing>,
    /// Recurrent layers: where the latest forward started and ended, and the snapshots they
    /// keep (`None` for a model that only attends).
    recurrent: Option<RecurrentTrack>,
}

/// What a session's recurrent layers hold: the state before the latest forward (at
/// `start`), after it (`end`), and after each of its last `snapshots` rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecurrentTrack {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) snapshots: usize,
}

impl RecurrentTrack {
    /// Whether a forward may start at `n`.
    pub(crate) fn holds(&self, n: usize) -> bool {
        n == 0
            || n == self.start
            || n == self.end
            || (n > self.start && n < self.end && self.end - n <= self.snapshots)
    }
}

/// The bookkeeping of a session's sliding-window ring: the position each ring cell holds
/// (`EMPTY` for a cell never written), and the same laid out in position order — `held[p]` is
/// `p` while cell `p % ring` holds position `p`, else `EMPTY` — which the sliding-window layers
/// attend over (entry `j` is cell `j % ring`, [`specula_tensor::Backend::attention`]): the keys
/// are visited in position order, as in a full-size cache, with the same bits. A cell left by
/// rows that were taken back holds a position past every query until rewritten, so the mask
/// hides it.
#[derive(Clone, Debug)]
pub(crate) struct SwaRing {
    window: usize,
    pos: Vec<u32>,
    held: Vec<u32>,
    cells: Vec<usize>,
}

impl SwaRing {
    const EMPTY: u32 = u32::MAX;

    /// Places rows at `pos` (the cell of each into `cells`) and records their positions.
    fn place(&mut self, pos: &[u32]) {
        let n = self.pos.len();
        self.cells.clear();
        for &p in pos {
            let c = p as usize % n;
            self.cells.push(c);
            let old = std::mem::replace(&mut self.pos[c], p);
            if let Some(h) = self.held.get_mut(old as usize) {
                *h = Self::EMPTY;
            }
            self.held[p as usize] = p;
        }
    }

    /// Forgets every position.
    fn clear(&mut self) {
        self.pos.fill(Self::EMPTY);
        self.held.fill(Self::EMPTY);
    }

    fn holds(&self, p: usize) -> bool {
        self.pos[p % self.pos.len()] as usize == p
    }

    /// Whether the ring holds every earlier position a query at `n` sees (`n − window + 1 ..
    /// n`): then the cache continues from `n` exactly as if nothing past `n` had been written.
    fn window_intact(&self, n: usize) -> bool {
        (n.saturating_sub(self.window.saturating_sub(1))..n).all(|p| self.holds(p))
    }
}

/// Rows at `pos` (a session's next rows, contiguous) as its sliding-window ring places them.
fn place<'a>(ring: &'a mut Option<SwaRing>, pos: &[u32]) -> Option<specula_models::Ring<'a>> {
    ring.as_mut().map(|r| {
        r.place(pos);
        let end = pos.iter().max().map_or(0, |&m| m as usize + 1);
        specula_models::Ring {
            cells: &r.cells,
            kv_pos: &r.held[..end],
        }
    })
}

impl<B: Backend> std::fmt::Debug for Session<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("n_past", &self.n_past)
            .field("n_ctx", &self.n_ctx)
            .field("swa_ring", &self.ring.as_ref().map(|r| r.pos.len()))
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Session<B> {
    /// Positions filled so far.
    #[must_use]
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Context size (KV cells).
    #[must_use]
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// From the next forward on, read out only the argmax of each logits row (`true`,
    /// [`Session::argmax_ids`]) and return no logits, or the rows (`false`, the default).
    /// Greedy decoding needs nothing else, and on a device only the ids are downloaded.
    pub fn set_argmax(&mut self, on: bool) {
        self.scratch.set_argmax(on);
    }

    /// The argmax of each logits row the latest prefill asked for, in order, after
    /// [`Session::set_argmax`] (`specula_tensor::NO_ARGMAX` for a row of only NaN and −∞).
    #[must_use]
    pub fn argmax_ids(&self) -> &[u32] {
        &self.ids
    }

    /// The cache's formats and memory accounting (bytes per token, per layer, in all).
    #[must_use]
    pub fn kv_layout(&self) -> &specula_kv::KvLayout {
        &self.layout
    }

    /// Bytes of KV cache the filled positions occupy (a sliding-window ring at most its size).
    #[must_use]
    pub fn kv_bytes_used(&self) -> usize {
        self.layout.bytes_for(self.n_past)
    }

    /// Cells of the sliding-window layers' ring, when they keep one (else they have a cell per
    /// position, as the other layers).
    #[must_use]
    pub fn swa_ring(&self) -> Option<usize> {
        self.ring.as_ref().map(|r| r.pos.len())
    }

    /// The most rows one forward may write for this session: `ring − window` with a
    /// sliding-window ring (more would overwrite positions the batch's first query still
    /// sees), else unbounded. The engine splits larger batches.
    #[must_use]
    pub fn max_rows(&self) -> usize {
        self.ring
            .as_ref()
            .map_or(usize::MAX, |r| (r.pos.len() - r.window).max(1))
    }

    /// Records that a forward of `rows` rows starts at the current position (what the
    /// recurrent layers will hold after it).
    pub(crate) fn begin_forward(&mut self, rows: usize) {
        if let Some(r) = &mut self.recurrent {
            r.start = self.n_past;
            r.end = self.n_past + rows;
        }
    }

    /// Forgets everything after the first `n` positions (their cells are overwritten by the
    /// next tokens; recurrent layers continue from the state they kept for `n`): a trim, for a
    /// memory that can ([`Session::can_trim_to`]); otherwise [`Engine::rewind`] takes rows
    /// back.
    pub fn truncate(&mut self, n: usize) {
        debug_assert!(
            self.can_trim_to(n),
            "a trim to {n} of {} positions on a memory that rolls back by replay",
            self.n_past
        );
        self.n_past = self.n_past.min(n);
    }
}

/// What a batched forward ([`Engine::decode_multi`]) reads out for the logits rows its
/// entries ask for, entry after entry: the rows themselves, or — after
/// [`Scratch::set_argmax`] — only each row's argmax, so a batch of greedy rows downloads one
/// id per row and no logits.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Readout {
    /// `n_rows × n_vocab` logits (empty in argmax mode).
    pub logits: Vec<f32>,
    /// One argmax per row in argmax mode ([`specula_tensor::NO_ARGMAX`] for a row of only
    /// NaN and −∞); empty otherwise.
    pub ids: Vec<u32>,
}

impl Readout {
    fn clear(&mut self) {
        self.logits.clear();
        self.ids.clear();
    }

    fn append(&mut self, other: &Self) {
        self.logits.extend_from_slice(&other.logits);
        self.ids.extend_from_slice(&other.ids);
    }
}

/// One sequence's tokens in an [`Engine::decode_multi`] batch.
pub struct BatchEntry<'a, B: Backend> {
    /// The sequence (its cache and position).
    pub session: &'a mut Session<B>,
    /// Tokens to run after what the session holds.
    pub tokens: &'a [u32],
    /// Logits are returned for `tokens[logits_from..]`.
    pub logits_from: usize,
    /// Target hidden states to capture for this entry's rows, for a feature drafter; `None`
    /// (every entry of a plain batch) costs nothing.
    pub capture: Option<Capture<'a, B>>,
}

/// Where a prefill's captured hidden states go.
enum Sink<'a, B: Backend> {
    /// Host tap buffers, interleaved into `features` after each forward.
    Host {
        taps: &'a mut specula_models::Taps,
        features: &'a mut Vec<f32>,
    },
    /// A backend tensor of every row's taps side by side; a prefill of several forwards
    /// captures each into `chunk` and puts its rows in place.
    Device {
        layers: &'a [usize],
        features: &'a mut B::Tensor,
        chunk: Option<B::Tensor>,
    },
}

/// The hidden states a [`BatchEntry`] captures: `taps.layers` are asked for (the layer-input
/// convention of [`specula_models::Taps`]); `features` (cleared first) receives
/// `[tokens.len(), taps · n_embd]` row-major, each row the taps side by side — what
/// [`specula_spec::Drafter::process_features`] takes, as [`Engine::prefill_with_features`]
/// gives it.
pub struct Capture<'a, B: Backend> {
    /// The taps (their `rows` are the engine's buffers).
    pub taps: &'a mut specula_models::Taps,
    /// The entry's features (left empty when they go to `device`).
    pub features: &'a mut Vec<f32>,
    /// `Some`: the features go into this backend tensor instead, `[tokens.len(), taps ·
    /// n_embd]` ([`specula_models::TapSink::Device`]) — for a drafter that reads them there
    /// ([`specula_spec::Drafter::takes_device_features`]).
    pub device: Option<&'a mut B::Tensor>,
}

impl<B: Backend> std::fmt::Debug for Capture<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("taps", &self.taps.layers)
            .field("features", &self.features.len())
            .field("device", &self.device.is_some())
            .finish()
    }
}

impl<B: Backend> std::fmt::Debug for BatchEntry<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchEntry")
            .field("session", &self.session)
            .field("tokens", &self.tokens)
            .field("logits_from", &self.logits_from)
            .field("capture", &self.capture)
            .finish()
    }
}

/// Timings as llama.cpp reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    /// Prompt tokens processed.
    pub prompt_n: usize,
    /// Milliseconds of prompt processing.
    pub prompt_ms: f64,
    /// Tokens generated.
    pub predicted_n: usize,
    /// Milliseconds of generation.
    pub predicted_ms: f64,
}

/// What [`Engine::generate`] should do.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub n_predict: usize,
    /// Sampler settings.
    pub sampler: SamplerParams,
    /// Teacher forcing: feed these ids instead of sampling (and stop after them).
    pub force_ids: Option<Vec<u32>>,
    /// Keep the top-K `(id, logit)` pairs of each generated position.
    pub top_logits: usize,
    /// Stop at end-of-generation tokens.
    pub stop_at_eog: bool,
}

impl GenerateOptions {
    /// `n_predict` greedy tokens, not stopping at end-of-generation tokens (what tests and
    /// benchmarks compare runs with).
    #[must_use]
    pub fn greedy(n_predict: usize) -> Self {
        Self {
            n_predict,
            sampler: SamplerParams::greedy(),
            force_ids: None,
            top_logits: 0,
            stop_at_eog: false,
        }
    }
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            n_predict: 128,
            sampler: SamplerParams::default(),
            force_ids: None,
            top_logits: 0,
            stop_at_eog: true,
        }
    }
}

/// The result of [`Engine::generate`].
#[derive(Clone, Debug, Default)]
pub struct Generation {
    /// Prompt ids.
    pub prompt_ids: Vec<u32>,
    /// Generated (or forced) ids.
    pub generated_ids: Vec<u32>,
    /// Generated text.
    pub text: String,
    /// Top logits per generated position, when asked for.
    pub top_logits: Vec<Vec<(u32, f32)>>,
    /// Timings.
    pub timings: Timings,
    /// Whether generation stopped at an end-of-generation token.
    pub stopped_at_eog: bool,
    /// Drafted and accepted tokens, for a speculative generation.
    pub spec: Option<specula_spec::SpecStats>,
}

/// The `k` largest `(id, logit)` pairs, largest first, lowest id first among equals.
#[must_use]
pub fn top_k_logits(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..u32::try_from(logits.len()).unwrap_or(u32::MAX)).collect();
    let cmp = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(k - 1, cmp);
    idx.truncate(k);
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, logits[i as usize])).collect()
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

impl<B: Backend> Engine<B> {
    /// An engine with the default prefill chunk (512 tokens).
    pub fn new(backend: B, model: Model<B>, tokenizer: Tokenizer) -> Self {
        Self::shared(Arc::new(backend), model, tokenizer)
    }

    /// [`Engine::new`] on a backend instance shared with another engine (a draft model beside
    /// its target) or with drafters.
    pub fn shared(backend: Arc<B>, model: Model<B>, tokenizer: Tokenizer) -> Self {
        Self {
            backend,
            model,
            tokenizer,
            n_batch: 512,
            kv_overrides: Vec::new(),
            swa_full: false,
            recurrent_snapshots: Model::<B>::DEFAULT_SNAPSHOTS,
        }
    }

    /// A fresh session of `n_ctx` positions with the given cache formats.
    ///
    /// # Errors
    /// If the backend cannot allocate the cache.
    pub fn session(&self, n_ctx: usize, k_type: QType, v_type: QType) -> Result<Session<B>> {
        let shape = self.kv_shape(n_ctx, k_type, v_type);
        let mut s = Session {
            layout: self.kv_layout(n_ctx, k_type, v_type)?,
            kv: self
                .backend
                .kv_new(shape.clone())
                .map_err(specula_models::ModelError::from)?,
            scratch: self.model.scratch(&self.backend),
            pos: Vec::new(),
            rows: Vec::new(),
            ids: Vec::new(),
            n_past: 0,
            n_ctx,
            rollback: match &shape.recurrent {
                Some(r) if r.snapshots > 0 => specula_kv::Rollback::Snapshot,
                Some(_) => specula_kv::Rollback::Replay,
                None => specula_kv::Rollback::Trim,
            },
            recurrent: shape.recurrent.as_ref().map(|r| RecurrentTrack {
                start: 0,
                end: 0,
                snapshots: r.snapshots,
            }),
            ring: shape.swa.as_ref().map(|w| SwaRing {
                window: self.model.hparams().swa.as_ref().map_or(1, |s| s.window),
                pos: vec![SwaRing::EMPTY; w.n_cells],
                held: vec![SwaRing::EMPTY; n_ctx],
                cells: Vec::new(),
            }),
        };
        self.calibrate_kv(&mut s)?;
        Ok(s)
    }

    /// Fixes the per-head offsets of a fresh session's quantized planes
    /// ([`specula_kv::Plane::calibrate`]: the mean of a plane's first write) from a fixed
    /// input: the first [`KV_CALIBRATION_TOKENS`] tokens of [`KV_CALIBRATION_TEXT`] (fewer
    /// when the context or a sliding-window ring holds fewer), run in one forward, then the
    /// session is emptied. Every session of this engine with these formats and context gets the
    /// same offsets, whatever it runs later, so a sequence's rows are stored, and its output
    /// computed, exactly as on a fresh session: no dependence on earlier requests of a reused
    /// server slot, on the prefill chunking, on which prefix a prompt-cache hit reuses, or on
    /// rewinds and replays. A session whose every plane is a float format skips it.
    fn calibrate_kv(&self, s: &mut Session<B>) -> Result<()> {
        let float = |t: QType| matches!(t, QType::F32 | QType::F16 | QType::BF16);
        if s.layout
            .layers
            .iter()
            .all(|l| float(l.types.k) && float(l.types.v))
        {
            return Ok(());
        }
        let n_vocab = self.model.hparams().n_vocab;
        let room = s
            .ring
            .as_ref()
            .map_or(s.n_ctx, |r| r.pos.len().min(s.n_ctx))
            .min(KV_CALIBRATION_TOKENS);
        let mut ids: Vec<u32> = self
            .tokenizer
            .encode(KV_CALIBRATION_TEXT)
            .into_iter()
            .filter(|&id| (id as usize) < n_vocab)
            .take(room)
            .collect();
        if ids.is_empty() {
            // A vocabulary that cannot spell the text: the first token ids instead.
            ids = (0..u32::try_from(room.min(n_vocab)).unwrap_or(u32::MAX)).collect();
        }
        if ids.is_empty() {
            return Ok(());
        }
        let pos: Vec<u32> = (0..u32::try_from(ids.len()).unwrap_or(u32::MAX)).collect();
        self.model.forward(
            &self.backend,
            &mut s.kv,
            &mut s.scratch,
            &ids,
            &pos,
            &[],
            None,
        )?;
        s.reset();
        Ok(())
    }

    /// Cells of the sliding-window ring of this engine's sessions: `window + n_batch`
    /// (llama.cpp's `n_swa + n_ubatch`) unless `--swa-full`, `None` for a model without
    /// sliding-window layers. A context at most this large keeps a cell per position.
    #[must_use]
    pub fn swa_ring(&self) -> Option<usize> {
        let w = self.model.hparams().swa.as_ref()?;
        (!self.swa_full).then(|| w.window + self.n_batch.max(1))
    }

    /// The layout (formats, stored head widths, bytes per token) a session of `n_ctx` cells
    /// with these cache formats would have, without allocating it: for planning memory and for
    /// rejecting a format the model's heads cannot use before any work.
    ///
    /// # Errors
    /// [`EngineError::Kv`] when the heads cannot be stored in `k_type` / `v_type`.
    pub fn kv_layout(
        &self,
        n_ctx: usize,
        k_type: QType,
        v_type: QType,
    ) -> Result<specula_kv::KvLayout> {
        Ok(specula_kv::KvLayout::new(
            &self.kv_shape(n_ctx, k_type, v_type),
        )?)
    }

    /// The shape of a session's cache: the model's, with this engine's sliding-window ring
    /// and per-layer overrides.
    fn kv_shape(&self, n_ctx: usize, k_type: QType, v_type: QType) -> specula_tensor::KvShape {
        let mut shape = self
            .model
            .kv_shape_ring(n_ctx, self.swa_ring(), k_type, v_type);
        shape.overrides.clone_from(&self.kv_overrides);
        if let Some(r) = &mut shape.recurrent {
            r.snapshots = self.recurrent_snapshots;
        }
        shape
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        let n_vocab = self.model.hparams().n_vocab;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= n_vocab) {
            return Err(EngineError::BadToken { id, n_vocab });
        }
        Ok(())
    }

    /// Runs `ids` after what the session holds, in chunks of `n_batch`, and returns the
    /// logits of every token when `all_logits` (row-major), else of the last token only.
    ///
    /// # Errors
    /// Empty input, ids outside the vocabulary, or not enough context left.
    pub fn prefill(&self, s: &mut Session<B>, ids: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        let first = if all_logits {
            0
        } else {
            ids.len().saturating_sub(1)
        };
        self.prefill_from(s, ids, first)
    }

    /// Like [`Engine::prefill`], returning the logits of `ids[first..]` (row-major) — e.g. the
    /// scored second half of a perplexity window, without computing the output head for the
    /// rest.
    ///
    /// # Errors
    /// As [`Engine::prefill`].
    pub fn prefill_from(&self, s: &mut Session<B>, ids: &[u32], first: usize) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.prefill_into(s, ids, first, &mut out)?;
        Ok(out)
    }

    /// [`Engine::prefill_from`] into a caller's buffer (cleared first), so a decode loop
    /// allocates nothing per token.
    ///
    /// # Errors
    /// As [`Engine::prefill`].
    pub fn prefill_into(
        &self,
        s: &mut Session<B>,
        ids: &[u32],
        first: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.prefill_impl(s, ids, first, out, None)
    }

    /// [`Engine::prefill_into`] that also captures the target hidden states a feature drafter
    /// asks for: `taps.layers` in the layer-input convention of [`specula_models::Taps`], and
    /// `features` (cleared first) row-major `[ids.len(), taps · n_embd]`, each row the taps
    /// side by side in `taps.layers` order — what [`specula_spec::Drafter::process_features`]
    /// takes.
    ///
    /// # Errors
    /// As [`Engine::prefill`], and a tap past the model's layers.
    pub fn prefill_with_features(
        &self,
        s: &mut Session<B>,
        ids: &[u32],
        first: usize,
        out: &mut Vec<f32>,
        taps: &mut specula_models::Taps,
        features: &mut Vec<f32>,
    ) -> Result<()> {
        self.check_taps(&taps.layers)?;
        features.clear();
        self.prefill_impl(s, ids, first, out, Some(Sink::Host { taps, features }))
    }

    /// [`Engine::prefill_with_features`] with the features left on the backend: `features`
    /// becomes `[ids.len(), layers.len() · n_embd]`, each row the taps side by side
    /// ([`specula_models::TapSink::Device`]) — what a drafter on the target's backend takes
    /// ([`specula_spec::Drafter::process_device_features`]) without a trip through the host.
    ///
    /// # Errors
    /// As [`Engine::prefill_with_features`].
    pub fn prefill_with_device_features(
        &self,
        s: &mut Session<B>,
        ids: &[u32],
        first: usize,
        out: &mut Vec<f32>,
        layers: &[usize],
        features: &mut B::Tensor,
    ) -> Result<()> {
        self.check_taps(layers)?;
        self.prefill_impl(
            s,
            ids,
            first,
            out,
            Some(Sink::Device {
                layers,
                features,
                chunk: None,
            }),
        )
    }

    fn check_taps(&self, layers: &[usize]) -> Result<()> {
        let n_layer = self.model.hparams().n_layer;
        if let Some(&t) = layers.iter().find(|&&t| t > n_layer) {
            return Err(EngineError::Model(ModelError::Tap { tap: t, n_layer }));
        }
        Ok(())
    }

    /// Appends the `n` rows of `taps` to `features`, each row the taps side by side.
    fn interleave(&self, taps: &specula_models::Taps, n: usize, features: &mut Vec<f32>) {
        let n_embd = self.model.hparams().n_embd;
        features.reserve(n * n_embd * taps.rows.len());
        for r in 0..n {
            for rows in &taps.rows {
                features.extend_from_slice(&rows[r * n_embd..(r + 1) * n_embd]);
            }
        }
    }

    fn prefill_impl(
        &self,
        s: &mut Session<B>,
        ids: &[u32],
        first: usize,
        out: &mut Vec<f32>,
        mut capture: Option<Sink<'_, B>>,
    ) -> Result<()> {
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.check_ids(ids)?;
        if s.n_past + ids.len() > s.n_ctx {
            return Err(EngineError::ContextFull {
                needed: s.n_past + ids.len(),
                prompt: s.n_past + ids.len(),
                predict: 0,
                n_ctx: s.n_ctx,
            });
        }
        out.clear();
        s.ids.clear();
        let m = self.n_batch.max(1).min(s.max_rows());
        // With a sliding-window ring, the chunks are aligned to the end: the last forward
        // writes the last `m` rows, so taking back any of them (a rejected draft tail) is a
        // trim that leaves the window the next query needs.
        let lead = if s.ring.is_some() { ids.len() % m } else { 0 };
        let mut base = 0;
        while base < ids.len() {
            let end = if base == 0 && lead > 0 {
                lead
            } else {
                (base + m).min(ids.len())
            };
            let chunk = &ids[base..end];
            let start = u32::try_from(s.n_past).unwrap_or(u32::MAX);
            s.pos.clear();
            s.pos.extend((start..).take(chunk.len()));
            s.rows.clear();
            s.rows
                .extend((0..chunk.len()).filter(|&r| base + r >= first));
            s.begin_forward(chunk.len());
            let ring = place(&mut s.ring, &s.pos);
            let whole = base == 0 && end == ids.len();
            let sink = match capture.as_mut() {
                None => None,
                Some(Sink::Host { taps, .. }) => Some(TapSink::Host(taps)),
                // One forward writes the features in place; several write chunks that are
                // put into their rows.
                Some(Sink::Device {
                    layers, features, ..
                }) if whole => Some(TapSink::Device {
                    layers,
                    features: &mut **features,
                }),
                Some(Sink::Device { layers, chunk, .. }) => Some(TapSink::Device {
                    layers,
                    features: chunk.get_or_insert_with(|| self.backend.zeros(0, 0)),
                }),
            };
            let logits = self.model.forward_to(
                &self.backend,
                &mut s.kv,
                &mut s.scratch,
                chunk,
                &s.pos,
                &s.rows,
                sink,
                ring,
            )?;
            out.extend_from_slice(logits);
            if s.scratch.argmax() {
                s.ids.extend_from_slice(s.scratch.argmax_ids());
            }
            s.n_past += chunk.len();
            match capture.as_mut() {
                Some(Sink::Host { taps, features }) => {
                    self.interleave(taps, chunk.len(), features);
                }
                Some(Sink::Device {
                    layers,
                    features,
                    chunk: Some(c),
                }) if !whole => {
                    if base == 0 {
                        let width = layers.len() * self.model.hparams().n_embd;
                        self.backend.resize(features, ids.len(), width);
                    }
                    let rows = self.backend.index_range(base..end);
                    self.backend.put_rows(c, &rows, features);
                }
                _ => {}
            }
            base = end;
        }
        Ok(())
    }

    /// Activation buffers for [`Engine::decode_multi`] (one set serves every batch).
    #[must_use]
    pub fn scratch(&self) -> Scratch<B> {
        self.model.scratch(&self.backend)
    }

    /// Runs the tokens of several sessions as one batch ([`Model::forward_multi`]: matmuls
    /// over all rows, attention per session on its own cache) and writes the logits of each
    /// entry's rows `tokens[logits_from..]` into `out` (cleared first), entry after entry.
    /// With batch-invariant kernels every row has the bits it has when its session runs
    /// alone. Each session's position advances by its tokens. An entry with a
    /// [`BatchEntry::capture`] also gets the hidden states of its own rows.
    ///
    /// # Errors
    /// An entry with no tokens, ids outside the vocabulary, a tap past the model's layers, or
    /// not enough context left in a session (checked for all entries before any work).
    pub fn decode_multi(
        &self,
        entries: &mut [BatchEntry<'_, B>],
        scratch: &mut Scratch<B>,
        out: &mut Readout,
    ) -> Result<()> {
        for e in entries.iter() {
            if e.tokens.is_empty() {
                return Err(EngineError::EmptyPrompt);
            }
            self.check_ids(e.tokens)?;
            if let Some(c) = &e.capture {
                self.check_taps(&c.taps.layers)?;
            }
            let s = &e.session;
            if s.n_past + e.tokens.len() > s.n_ctx {
                return Err(EngineError::ContextFull {
                    needed: s.n_past + e.tokens.len(),
                    prompt: s.n_past + e.tokens.len(),
                    predict: 0,
                    n_ctx: s.n_ctx,
                });
            }
        }
        out.clear();
        if entries.is_empty() {
            return Ok(());
        }
        if entries
            .iter()
            .any(|e| e.tokens.len() > e.session.max_rows())
        {
            return self.decode_multi_split(entries, scratch, out);
        }
        for e in entries.iter_mut() {
            let start = u32::try_from(e.session.n_past).unwrap_or(u32::MAX);
            e.session.begin_forward(e.tokens.len());
            e.session.pos.clear();
            e.session.pos.extend((start..).take(e.tokens.len()));
            e.session.rows.clear();
            e.session
                .rows
                .extend(e.logits_from.min(e.tokens.len())..e.tokens.len());
        }
        let mut seqs: Vec<SeqRows<'_, B>> = entries
            .iter_mut()
            .map(|e| {
                let s = &mut *e.session;
                SeqRows {
                    kv: &mut s.kv,
                    tokens: e.tokens,
                    pos: &s.pos,
                    logits_rows: &s.rows,
                    taps: e.capture.as_mut().map(|c| match c.device.as_mut() {
                        Some(t) => TapSink::Device {
                            layers: &c.taps.layers,
                            features: &mut **t,
                        },
                        None => TapSink::Host(&mut *c.taps),
                    }),
                    ring: place(&mut s.ring, &s.pos),
                }
            })
            .collect();
        let logits = self
            .model
            .forward_multi(&self.backend, &mut seqs, scratch)?;
        out.logits.extend_from_slice(logits);
        drop(seqs);
        if scratch.argmax() {
            out.ids.extend_from_slice(scratch.argmax_ids());
        }
        for e in entries.iter_mut() {
            e.session.n_past += e.tokens.len();
            if let Some(c) = &mut e.capture {
                c.features.clear();
                if c.device.is_none() {
                    self.interleave(c.taps, e.tokens.len(), c.features);
                }
            }
        }
        Ok(())
    }

    /// [`Engine::decode_multi`] that isolates failing entries: when the batch fails (an error,
    /// or a panic), every session goes back to the position it had, and the entries run one at
    /// a time. `failed` (cleared first) gets the index and error of each entry that fails
    /// alone; `out` the logits of the others, entry after entry (with batch-invariant kernels,
    /// the bits the whole batch gives). A failed entry's session is at its old position, but its
    /// cells past it (and its sliding-window ring's) may be half written: reset it before reuse.
    pub fn decode_multi_isolated(
        &self,
        entries: &mut [BatchEntry<'_, B>],
        scratch: &mut Scratch<B>,
        out: &mut Readout,
        failed: &mut Vec<(usize, EngineError)>,
    ) {
        failed.clear();
        let bases: Vec<usize> = entries.iter().map(|e| e.session.n_past).collect();
        let Err(err) = self.decode_multi_caught(entries, scratch, out) else {
            return;
        };
        for (e, &b) in entries.iter_mut().zip(&bases) {
            e.session.n_past = b;
        }
        out.clear();
        if entries.len() == 1 {
            failed.push((0, err));
            return;
        }
        let mut part = Readout::default();
        for i in 0..entries.len() {
            match self.decode_multi_caught(&mut entries[i..=i], scratch, &mut part) {
                Ok(()) => out.append(&part),
                Err(e) => {
                    entries[i].session.n_past = bases[i];
                    failed.push((i, e));
                }
            }
        }
    }

    /// [`Engine::decode_multi`], a panic becoming [`EngineError::Panicked`].
    fn decode_multi_caught(
        &self,
        entries: &mut [BatchEntry<'_, B>],
        scratch: &mut Scratch<B>,
        out: &mut Readout,
    ) -> Result<()> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.decode_multi(entries, scratch, out)
        }))
        .unwrap_or_else(|p| {
            Err(EngineError::Panicked {
                message: specula_spec::batch::panic_message(p.as_ref()),
            })
        })
    }

    /// [`Engine::decode_multi`] of entries with more rows than their session's sliding-window
    /// ring takes in one forward ([`Session::max_rows`]): forwards of at most that many rows
    /// per session, aligned to the end of each entry (as [`Engine::prefill`]), the logits and
    /// features gathered entry after entry as one forward gives them. Batch-invariant kernels
    /// give every row the bits of the unsplit batch.
    fn decode_multi_split(
        &self,
        entries: &mut [BatchEntry<'_, B>],
        scratch: &mut Scratch<B>,
        out: &mut Readout,
    ) -> Result<()> {
        let n = entries.len();
        let mut done = vec![0usize; n];
        let mut logits: Vec<Readout> = vec![Readout::default(); n];
        let mut feats: Vec<Vec<f32>> = vec![Vec::new(); n];
        let mut part_feats: Vec<Vec<f32>> = vec![Vec::new(); n];
        // Device captures: each piece's rows, put into the entry's tensor at their offset.
        let mut part_dev: Vec<B::Tensor> = (0..n).map(|_| self.backend.zeros(0, 0)).collect();
        let n_embd = self.model.hparams().n_embd;
        for e in entries.iter_mut() {
            if let Some(c) = e.capture.as_mut()
                && let Some(t) = c.device.as_mut()
            {
                let width = c.taps.layers.len() * n_embd;
                self.backend.resize(t, e.tokens.len(), width);
            }
        }
        let mut part = Readout::default();
        loop {
            let mut idx = Vec::with_capacity(n);
            let mut rows = Vec::with_capacity(n);
            let mut sub: Vec<BatchEntry<'_, B>> = Vec::with_capacity(n);
            let mut starts = Vec::with_capacity(n);
            for (i, ((e, pf), pd)) in entries
                .iter_mut()
                .zip(part_feats.iter_mut())
                .zip(part_dev.iter_mut())
                .enumerate()
            {
                let len = e.tokens.len();
                if done[i] == len {
                    continue;
                }
                let m = e.session.max_rows().min(len);
                // The first piece takes the remainder, so the last forward has `m` rows.
                let take = if done[i] == 0 && len % m != 0 {
                    len % m
                } else {
                    m
                };
                let tokens: &[u32] = e.tokens;
                let piece = &tokens[done[i]..done[i] + take];
                let logits_from = e.logits_from.saturating_sub(done[i]).min(take);
                idx.push(i);
                rows.push(take - logits_from);
                starts.push(done[i]);
                sub.push(BatchEntry {
                    session: &mut *e.session,
                    tokens: piece,
                    logits_from,
                    capture: e.capture.as_mut().map(|c| Capture {
                        taps: &mut *c.taps,
                        features: pf,
                        device: c.device.is_some().then_some(&mut *pd),
                    }),
                });
                done[i] += take;
            }
            if sub.is_empty() {
                break;
            }
            self.decode_multi(&mut sub, scratch, &mut part)?;
            drop(sub);
            let total: usize = rows.iter().sum();
            let width = part.logits.len().checked_div(total).unwrap_or(0);
            let (mut off, mut id_off) = (0, 0);
            for ((&i, &r), &at) in idx.iter().zip(&rows).zip(&starts) {
                if let Some(t) = entries[i].capture.as_mut().and_then(|c| c.device.as_mut()) {
                    let (piece_rows, _) = self.backend.shape(&part_dev[i]);
                    let to = self.backend.index_range(at..at + piece_rows);
                    self.backend.put_rows(&part_dev[i], &to, t);
                }
                logits[i]
                    .logits
                    .extend_from_slice(&part.logits[off..off + r * width]);
                off += r * width;
                if !part.ids.is_empty() {
                    logits[i]
                        .ids
                        .extend_from_slice(&part.ids[id_off..id_off + r]);
                    id_off += r;
                }
                feats[i].append(&mut part_feats[i]);
            }
        }
        for (i, e) in entries.iter_mut().enumerate() {
            out.append(&logits[i]);
            if let Some(c) = &mut e.capture {
                *c.features = std::mem::take(&mut feats[i]);
            }
        }
        Ok(())
    }

    /// Runs one token and returns its logits.
    ///
    /// # Errors
    /// As [`Engine::prefill`].
    pub fn decode(&self, s: &mut Session<B>, id: u32) -> Result<Vec<f32>> {
        self.prefill(s, &[id], false)
    }

    /// The sampler of a generation with the prompt in its history, and the result to fill.
    fn start(&self, prompt: &[u32], opts: &GenerateOptions) -> Result<(Sampler, Generation)> {
        self.check_ids(prompt)?;
        let mut sampler = Sampler::new(opts.sampler, self.model.hparams().n_vocab)?;
        for &id in prompt {
            sampler.accept(id)?;
        }
        let out = Generation {
            prompt_ids: prompt.to_vec(),
            ..Generation::default()
        };
        Ok((sampler, out))
    }

    /// Prefills `prompt`, then generates up to `opts.n_predict` tokens, calling `on_token`
    /// with each new id.
    ///
    /// # Errors
    /// [`EngineError::ContextFull`] when prompt + budget exceed the context (checked before
    /// any work), and the errors of [`Engine::prefill`].
    pub fn generate(
        &self,
        s: &mut Session<B>,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: impl FnMut(u32),
    ) -> Result<Generation> {
        self.generate_masked(s, prompt, opts, None, on_token)
    }

    /// [`Engine::generate`] with each sampled row through `mask` first (a grammar: the
    /// tokens it rejects cannot be sampled), its state advanced by every generated token.
    /// Teacher forcing (`force_ids`) does not consult it.
    ///
    /// # Errors
    /// As [`Engine::generate`], and [`EngineError::Mask`].
    pub fn generate_masked(
        &self,
        s: &mut Session<B>,
        prompt: &[u32],
        opts: &GenerateOptions,
        mask: Option<&mut dyn LogitsMask>,
        on_token: impl FnMut(u32),
    ) -> Result<Generation> {
        // Plain greedy decoding reads each step's argmax, not its logits.
        let argmax = opts.force_ids.is_none()
            && mask.is_none()
            && opts.top_logits == 0
            && opts.sampler.is_argmax();
        let was = s.scratch.argmax();
        s.set_argmax(argmax);
        let r = self.generate_steps(s, prompt, opts, mask, on_token);
        s.set_argmax(was);
        r
    }

    /// [`Engine::generate_masked`]'s loop; with the session reading out argmaxes
    /// ([`Session::set_argmax`]) each step takes the target's argmax for the token.
    fn generate_steps(
        &self,
        s: &mut Session<B>,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut mask: Option<&mut dyn LogitsMask>,
        mut on_token: impl FnMut(u32),
    ) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let n_predict = opts
            .force_ids
            .as_ref()
            .map_or(opts.n_predict, |f| f.len().min(opts.n_predict.max(f.len())));
        let needed = s.n_past + prompt.len() + n_predict;
        if needed > s.n_ctx {
            return Err(EngineError::ContextFull {
                needed,
                prompt: s.n_past + prompt.len(),
                predict: n_predict,
                n_ctx: s.n_ctx,
            });
        }
        if let Some(f) = &opts.force_ids {
            self.check_ids(f)?;
        }
        let (mut sampler, mut out) = self.start(prompt, opts)?;
        let t0 = Instant::now();
        let mut logits = self.prefill(s, prompt, false)?;
        out.timings.prompt_n = prompt.len();
        out.timings.prompt_ms = ms(t0);

        let t1 = Instant::now();
        let mut masked = Vec::new();
        for i in 0..n_predict {
            if opts.top_logits > 0 {
                out.top_logits.push(top_k_logits(&logits, opts.top_logits));
            }
            let id = match (&opts.force_ids, mask.as_deref_mut()) {
                (Some(f), _) => f[i],
                (None, None) if s.scratch.argmax() => match s.ids.last() {
                    Some(&id) if id != specula_tensor::NO_ARGMAX => id,
                    _ => return Err(SamplingError::NoCandidates.into()),
                },
                (None, None) => sampler.sample(&logits)?,
                (None, Some(m)) => {
                    masked.clear();
                    masked.extend_from_slice(&logits);
                    let n_vocab = masked.len();
                    m.mask_rows(&mut masked, n_vocab, &[])
                        .map_err(EngineError::Mask)?;
                    let id = sampler.sample(&masked)?;
                    m.accept(&[id]).map_err(EngineError::Mask)?;
                    id
                }
            };
            sampler.accept(id)?;
            out.generated_ids.push(id);
            on_token(id);
            if opts.force_ids.is_none() && opts.stop_at_eog && self.tokenizer.is_eog(id) {
                out.stopped_at_eog = true;
                break;
            }
            if i + 1 < n_predict {
                self.prefill_into(s, &[id], 0, &mut logits)?;
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
        Ok(out)
    }
}

/// How many tokens `a` and `b` share from the start.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_by_logit_then_id() {
        let l = [0.5, 3.0, 3.0, -1.0, 2.0];
        assert_eq!(top_k_logits(&l, 3), vec![(1, 3.0), (2, 3.0), (4, 2.0)]);
        assert_eq!(top_k_logits(&l, 10).len(), 5);
        assert!(top_k_logits(&l, 0).is_empty());
    }
}

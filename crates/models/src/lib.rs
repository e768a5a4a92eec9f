//! Models: GGUF weights and the forward passes of the architectures specula runs.
//!
//! - [`Model`] — a loaded model: [`Hparams`] plus its weights on a [`Backend`]; weights stay
//!   in their GGUF block format, borrowed from the memory-mapped file.
//! - [`Model::forward`] — one batch of tokens at given positions through every layer, writing
//!   K/V into the cache and returning the logits of the rows asked for.
//! - [`Taps`] — hidden-state capture for drafters: tap `i` is the *input* of layer `i` (the
//!   output of layer `i − 1`); tap `n_layer` is the state before the final norm.
//!
//! - [`dflash::Dflash`], [`eagle3::Eagle3`] — the DFlash and EAGLE-3 draft networks, loaded
//!   from llama.cpp's `dflash` / `eagle3` GGUFs for a target [`Model`] whose embedding and
//!   head they borrow ([`Model::token_embedding`], [`Model::output_head`]).
//!
//! Architectures: `llama` (SmolLM2), `qwen2` (Qwen2.5: Q/K/V biases, NeoX RoPE), `qwen3`
//! (per-head RMS QK-norm), `gemma3` (Gemma 3 text: scaled embeddings, QK-norm, sandwich norms,
//! GELU-gated FFN, sliding-window layers — a mask, over a cache that keeps every position or over
//! a ring of the last positions ([`Ring`], [`Model::forward_ring`]) — with their own RoPE base). Tensor names are llama.cpp's (`blk.N.attn_q.weight`, …).
//!
//! ```no_run
//! use std::sync::Arc;
//! # fn demo<B: specula_tensor::Backend>(backend: &B) -> Result<(), Box<dyn std::error::Error>> {
//! let file = Arc::new(specula_gguf::Gguf::open("model.gguf")?);
//! let model = specula_models::Model::load(backend, file)?;
//! let mut kv = model.new_kv(backend, 512, specula_quant::QType::F16, specula_quant::QType::F16)?;
//! let mut scratch = model.scratch(backend);
//! let logits = model.forward(backend, &mut kv, &mut scratch, &[1, 2, 3], &[0, 1, 2], &[2], None)?;
//! assert_eq!(logits.len(), model.hparams().n_vocab);
//! # Ok(()) }
//! ```

mod arch;
pub mod dflash;
pub mod eagle3;
mod hparams;
mod index;
mod linear;
mod moe;
pub mod spec;

use std::sync::Arc;

use specula_gguf::Gguf;
use specula_quant::QType;
use specula_tensor::{
    AttentionParams, Backend, ByteSource, GateAct, KvShape, SeqAttention, TensorError, WeightDesc,
};

use spec::{Act, AttnGate, AttnSpec, DeltaNetSpec, FfnSpec, Gating, LayerSpec, MixerSpec, MoeSpec};

/// The bytes of an open GGUF file, lent to the backend's weights.
struct FileBytes(Arc<Gguf>);

impl ByteSource for FileBytes {
    fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }

    fn release(&self, range: std::ops::Range<usize>) {
        self.0.release(range);
    }
}

pub use hparams::{Arch, Hparams, SlidingWindow};
pub(crate) use hparams::{
    AttnHparams, count, finite_f32, get_usize, int_bound, mul, opt_usize, scale_f32,
};
pub use linear::Linear;

/// Errors while loading or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// `general.architecture` names an architecture this crate does not run.
    #[error(
        "unsupported architecture `{arch}` (supported: llama, qwen2, qwen3, gemma3, qwen3moe, qwen35, qwen35moe, qwen3next, laguna, gemma4)"
    )]
    UnsupportedArch {
        /// The name found.
        arch: String,
    },
    /// A multimodal projector file (llama.cpp's `clip` mmproj) given as a model.
    #[error(
        "`{arch}` is a multimodal projector (mmproj) file: specula runs language models; give the text model's GGUF"
    )]
    Projector {
        /// The architecture found.
        arch: String,
    },
    /// A vision-tower or projector tensor in a language model's file.
    #[error(
        "tensor `{name}` belongs to a vision tower or multimodal projector: specula runs the text model only (give a GGUF without it)"
    )]
    Multimodal {
        /// The tensor name.
        name: String,
    },
    /// A required metadata key is missing.
    #[error("missing metadata key `{key}`")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A metadata value that cannot be used.
    #[error("metadata key `{key}`: {detail}")]
    BadValue {
        /// The key.
        key: String,
        /// What is wrong.
        detail: String,
    },
    /// A required tensor is missing.
    #[error("missing tensor `{name}`")]
    MissingTensor {
        /// The tensor name.
        name: String,
    },
    /// A tensor whose shape does not match the hyperparameters.
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    BadShape {
        /// The tensor name.
        name: String,
        /// Shape expected (ggml order).
        expected: Vec<usize>,
        /// Shape found.
        got: Vec<usize>,
    },
    /// A tensor type this crate cannot use.
    #[error("tensor `{name}` has ggml type {ty}, which specula does not implement")]
    UnsupportedType {
        /// The tensor name.
        name: String,
        /// The type name.
        ty: String,
    },
    /// An integer hyperparameter outside what the architecture can run (checked at load).
    #[error("metadata key `{key}` = {value}: expected {expected}")]
    HparamRange {
        /// The key.
        key: String,
        /// The value found (or derived from the key, e.g. a head size).
        value: u64,
        /// The bound it must satisfy.
        expected: String,
    },
    /// A float hyperparameter outside what the architecture can run (checked at load).
    #[error("metadata key `{key}` = {value:?}: expected {expected}")]
    HparamFloat {
        /// The key.
        key: String,
        /// The value found.
        value: f32,
        /// The bound it must satisfy.
        expected: String,
    },
    /// A negative value under a key that counts something.
    #[error("metadata key `{key}` = {value}: expected an unsigned integer")]
    NegativeHparam {
        /// The key.
        key: String,
        /// The value found.
        value: i64,
    },
    /// A metadata value of the wrong type.
    #[error("metadata key `{key}` holds {found}, expected {expected}")]
    HparamType {
        /// The key.
        key: String,
        /// The GGUF type found.
        found: String,
        /// What the key must hold.
        expected: &'static str,
    },
    /// A layer tensor past the model's layer count (the count and the tensors disagree).
    #[error("tensor `{name}` belongs to layer {layer}, but `{key}` = {n_layer}")]
    ExtraLayer {
        /// The tensor name.
        name: String,
        /// Its layer.
        layer: usize,
        /// The layer-count key.
        key: String,
        /// The layer count.
        n_layer: usize,
    },
    /// A token id past the vocabulary (the rows of the token embedding).
    #[error("token {token} is past the vocabulary of {n_vocab}")]
    TokenOutOfVocab {
        /// The token.
        token: u32,
        /// The vocabulary size.
        n_vocab: usize,
    },
    /// A token embedding that is not a `[n_embd, n_vocab]` matrix with at least one row.
    #[error("tensor `{name}` has shape {got:?}, expected [{n_embd}, n_vocab ≥ 1]")]
    EmbeddingShape {
        /// The tensor name.
        name: String,
        /// Shape found (ggml order).
        got: Vec<u64>,
        /// The hidden size.
        n_embd: usize,
    },
    /// A quantized tensor whose rows the block format cannot cut.
    #[error("tensor `{name}`")]
    Rows {
        /// The tensor name.
        name: String,
        /// Why.
        #[source]
        source: specula_quant::QuantError,
    },
    /// An output head cut to no tokens ([`Model::restrict_head`]).
    #[error("an output head cut to no tokens (want at least one id)")]
    EmptyHead,
    /// A token id past the vocabulary.
    #[error("{what}: token {id} is outside the vocabulary of {n_vocab} ids")]
    TokenPastVocab {
        /// The forward or operation (`output head`, `DFlash block`, …).
        what: &'static str,
        /// The id.
        id: u32,
        /// Vocabulary size.
        n_vocab: usize,
    },
    /// A batch without sequences.
    #[error("a batch needs at least one sequence")]
    NoSequences,
    /// A batch sequence whose positions do not match its tokens.
    #[error(
        "sequence {seq} of the batch has {tokens} tokens and {positions} positions (want one position per token, at least one token)"
    )]
    Positions {
        /// Index of the sequence in the batch (0 for a one-sequence batch).
        seq: usize,
        /// Tokens.
        tokens: usize,
        /// Positions.
        positions: usize,
    },
    /// Logits asked for a row the batch does not have.
    #[error("{what}: logits asked for row {row} of {rows} rows")]
    LogitsRow {
        /// The batch (`sequence 2 of the batch`, `DFlash block`, …).
        what: String,
        /// The row asked for.
        row: usize,
        /// Rows of the batch.
        rows: usize,
    },
    /// A sliding-window ring placement that does not fit the batch or the ring.
    #[error(
        "a ring placement of {rows} rows into {cells} cells for a {tokens}-token batch (want one cell below {cells} per token)"
    )]
    RingPlacement {
        /// Rows placed.
        rows: usize,
        /// Cells of the ring.
        cells: usize,
        /// Tokens of the batch.
        tokens: usize,
    },
    /// A target tap past the target's layers.
    #[error("tap {tap} is past the target's {n_layer} layers (want at most {n_layer})")]
    Tap {
        /// The tap (0 = the embeddings, `l` = the output of layer `l − 1`).
        tap: usize,
        /// Layers of the target.
        n_layer: usize,
    },
    /// Features that are not whole rows for the tokens they come with.
    #[error("{what}: {got} feature values for {rows} rows of {width} (want {})", rows * width)]
    Features {
        /// The forward (`DFlash injection`, `EAGLE-3 encoder`).
        what: &'static str,
        /// Values given.
        got: usize,
        /// Rows expected.
        rows: usize,
        /// Values per row.
        width: usize,
    },
    /// A drafter decoder's inputs that do not fit each other.
    #[error(
        "{what}: {tokens} tokens, {positions} positions and {values} values (want one position and one row of {width} values per token, at least one token)"
    )]
    DecoderRows {
        /// The forward.
        what: &'static str,
        /// Tokens.
        tokens: usize,
        /// Positions.
        positions: usize,
        /// Values.
        values: usize,
        /// Values per row.
        width: usize,
    },
    /// Rows at positions past a drafter's cache (or no rows at all).
    #[error(
        "{what}: {rows} rows at position {pos} do not fit a {n_ctx}-cell cache (want at least one row, ending at most at {n_ctx})"
    )]
    PastCache {
        /// The forward.
        what: &'static str,
        /// Rows.
        rows: usize,
        /// First (or offending) position.
        pos: usize,
        /// Cells of the cache.
        n_ctx: usize,
    },
    /// Positions of a sequence that do not follow each other, on a model with recurrent layers
    /// (their state folds the rows in order).
    #[error(
        "sequence {seq} of the batch: a model with recurrent layers needs consecutive positions"
    )]
    RecurrentPositions {
        /// Index of the sequence in the batch.
        seq: usize,
    },
    /// A forward starting at a position whose recurrent state the cache did not keep.
    #[error(
        "sequence {seq} of the batch starts at position {pos}, whose recurrent state the cache does not hold (replay from a kept position)"
    )]
    RecurrentState {
        /// Index of the sequence in the batch.
        seq: usize,
        /// The first position of the forward.
        pos: u32,
    },
    /// A scale tensor llama.cpp reads that no matrix of this model applies.
    #[error("tensor `{name}` is {what}: refusing the model rather than computing without it")]
    UnappliedScale {
        /// The tensor name.
        name: String,
        /// What it is and why it is not applied.
        what: &'static str,
    },
    /// A per-tensor scale that is not a finite number.
    #[error("tensor `{name}` holds the scale {value}, expected a finite number")]
    BadScale {
        /// The tensor name.
        name: String,
        /// The value found.
        value: f32,
    },
    /// An error of the backend.
    #[error(transparent)]
    Backend(#[from] TensorError),
}

/// Result alias.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// The weights of one layer, as its [`LayerSpec`] names them.
#[derive(Debug)]
struct Layer<W> {
    /// The learned scalar on the layer's output ([`LayerSpec::out_scale`]).
    out_scale: Option<f32>,
    attn_norm: W,
    mixer: Mixer<W>,
    /// Gemma's sandwich norms: on the mixer output before the residual add, and on the FFN
    /// output before its residual add.
    post_attn_norm: Option<W>,
    ffn_norm: W,
    ffn: Ffn<W>,
    post_ffw_norm: Option<W>,
    /// The layer's per-layer input gate (Gemma 4 E2B / E4B, [`Hparams::per_layer_input`]).
    input: Option<LayerInput<W>>,
}

/// How a layer takes in its per-layer input after its FFN (llama.cpp `gemma4.cpp`):
/// `x += post_norm(proj(gelu(inp_gate · x) ⊙ input))`.
#[derive(Debug)]
struct LayerInput<W> {
    gate: Linear<W>,
    proj: Linear<W>,
    post_norm: W,
}

/// The model-wide tensors of per-layer inputs (Gemma 4 E2B / E4B): every layer's input of
/// `width` values is `(rms_norm(proj · x₀ / √n_embd) + embd[token] · √width) / √2`, from the
/// scaled token embedding `x₀` (llama.cpp `project_per_layer_inputs`).
#[derive(Debug)]
struct PerLayerInputs<W> {
    /// `per_layer_token_embd`: `n_layer · width` values per token.
    embd: W,
    /// `per_layer_model_proj`: `n_embd → n_layer · width`.
    proj: Linear<W>,
    /// `per_layer_proj_norm`: the norm of each layer's `width` projected values.
    norm: W,
    width: usize,
}

/// The weights of a layer's mixer.
#[derive(Debug)]
enum Mixer<W> {
    Attention(AttnWeights<W>),
    DeltaNet(DeltaWeights<W>),
}

/// The tensors of a gated delta-net mixer.
#[derive(Debug)]
struct DeltaWeights<W> {
    /// `attn_qkv`: Q, K and V side by side, before the convolution.
    qkv: Linear<W>,
    /// `attn_gate`: the output gate `z`.
    z: Linear<W>,
    /// `ssm_conv1d`: `[kernel, channels]`.
    conv: W,
    dt_bias: W,
    a: W,
    beta: Linear<W>,
    alpha: Linear<W>,
    /// `ssm_norm`: the per-head RMS norm of the output.
    norm: W,
    out: Linear<W>,
}

/// The projections (and optional biases and QK-norms) of an attention mixer.
#[derive(Debug)]
struct AttnWeights<W> {
    /// `attn_gate`: Laguna's softplus output gate.
    gate: Option<Linear<W>>,
    wq: Linear<W>,
    /// `None` in a layer that reads another layer's K/V ([`AttnSpec::kv_source`]).
    wk: Option<Linear<W>>,
    /// `None` where V is the K projection ([`AttnSpec::v_from_k`]) or comes from another
    /// layer.
    wv: Option<Linear<W>>,
    /// Ones of a V head's size: the weight of the unweighted V norm ([`AttnSpec::v_norm`]).
    v_norm: Option<W>,
    wo: Linear<W>,
    bq: Option<W>,
    bk: Option<W>,
    bv: Option<W>,
    q_norm: Option<W>,
    k_norm: Option<W>,
}

/// Gemma 4's dense MLP and experts side by side, with their norms and the router's input
/// scale.
#[derive(Debug)]
struct Parallel<W> {
    gate: Linear<W>,
    up: Linear<W>,
    down: Linear<W>,
    post_1: W,
    pre_2: W,
    post_2: W,
    router_scale: W,
    moe: moe::MoeWeights<W>,
}

/// The weights of a layer's FFN.
#[derive(Debug)]
enum Ffn<W> {
    Parallel(Box<Parallel<W>>),
    Dense {
        gate: Linear<W>,
        up: Linear<W>,
        down: Linear<W>,
    },
    Moe(moe::MoeWeights<W>),
}

/// Hidden-state capture: which layer inputs to keep, and what was kept by the last forward
/// (row-major `[n_tokens, n_embd]` per tap, in the order of `layers`).
#[derive(Clone, Debug, Default)]
pub struct Taps {
    /// Tap indices: `i` is the input of layer `i`; `n_layer` is the pre-final-norm state.
    pub layers: Vec<usize>,
    /// One host buffer per tap, filled by [`Model::forward`].
    pub rows: Vec<Vec<f32>>,
}

/// Where a forward puts the hidden states it captures.
#[derive(Debug)]
pub enum TapSink<'a, B: Backend> {
    /// One host buffer per tap ([`Taps::rows`]).
    Host(&'a mut Taps),
    /// One backend tensor, resized to `[n_tokens, layers.len() · n_embd]`: each row the taps
    /// side by side in `layers` order (a feature drafter's input), written on the backend
    /// ([`Backend::put_cols`]) — the states never reach the host.
    Device {
        /// Tap indices, as [`Taps::layers`].
        layers: &'a [usize],
        /// The features.
        features: &'a mut B::Tensor,
    },
}

impl<B: Backend> TapSink<'_, B> {
    /// The tap indices asked for.
    #[must_use]
    pub fn layers(&self) -> &[usize] {
        match self {
            Self::Host(t) => &t.layers,
            Self::Device { layers, .. } => layers,
        }
    }
}

impl<B: Backend> Scratch<B> {
    /// Reads out each logits row's argmax instead of the row (`true`), or the rows (`false`,
    /// the default), from the next forward on.
    pub fn set_argmax(&mut self, on: bool) {
        self.argmax = on;
    }

    /// Whether forwards read out argmaxes ([`Scratch::set_argmax`]).
    #[must_use]
    pub fn argmax(&self) -> bool {
        self.argmax
    }

    /// The argmax of each logits row of the last forward that read them out
    /// ([`Scratch::set_argmax`]): [`specula_tensor::NO_ARGMAX`] for a row of only NaN and −∞.
    #[must_use]
    pub fn argmax_ids(&self) -> &[u32] {
        &self.ids
    }
}

/// What a forward calls at each tap point (a layer's input, then the pre-final-norm state)
/// with the batch's hidden state in `Scratch::x`.
type TapFn<'a, B> = dyn FnMut(&B, &mut Scratch<B>, usize) + 'a;

/// Reusable activation buffers of one forward pass.
///
/// A forward returns the logits of the rows asked for, downloaded to the host; after
/// [`Scratch::set_argmax`] it downloads only each row's argmax
/// ([`Backend::argmax_rows`], read by [`Scratch::argmax_ids`]) and returns no logits — what
/// greedy decoding and greedy verification need.
#[derive(Debug)]
pub struct Scratch<B: Backend> {
    x: B::Tensor,
    cur: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    proj: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
    act: B::Tensor,
    sel: B::Tensor,
    norm: B::Tensor,
    logits: B::Tensor,
    /// The index tensors of the current forward (taken out while it runs).
    ix: Option<index::ForwardIndex<B>>,
    host: Vec<f32>,
    /// Whether a forward reads out the argmax of each logits row ([`Scratch::set_argmax`])
    /// instead of the rows.
    argmax: bool,
    /// The argmax of each logits row of the last forward, when `argmax`.
    ids: Vec<u32>,
    /// [`Model::forward_multi`]: the batch's tokens, positions and logits rows.
    all_tokens: Vec<u32>,
    all_pos: Vec<u32>,
    all_logits_rows: Vec<usize>,
    /// One sequence's rows of a tapped hidden state ([`Model::forward_multi`]).
    tap_rows: B::Tensor,
    /// The buffers of a mixture-of-experts FFN.
    moe: moe::MoeScratch<B>,
    /// A gated attention's query-and-gate projection, and its gate.
    qg: B::Tensor,
    attn_gate: B::Tensor,
    /// The buffers of a gated delta-net mixer.
    dn: DeltaBuffers<B>,
    /// The buffers of Gemma 4's parallel FFN.
    par: ParallelBuffers<B>,
    /// The buffers of per-layer inputs.
    inputs: InputBuffers<B>,
}

/// Per-layer inputs: every layer's (`[n_tokens, n_layer · width]`), the token part of them,
/// and one layer's gate, slice and gated product.
#[derive(Debug)]
struct InputBuffers<B: Backend> {
    all: B::Tensor,
    embd: B::Tensor,
    gate: B::Tensor,
    slice: B::Tensor,
    act: B::Tensor,
}

/// Gemma 4's parallel FFN: the dense MLP's normed output, the router's input, the experts'.
#[derive(Debug)]
struct ParallelBuffers<B: Backend> {
    dense: B::Tensor,
    router: B::Tensor,
    experts: B::Tensor,
}

/// The buffers of a gated delta-net mixer over a batch: its projections, its output, one
/// sequence's rows of them ([`Model::forward_multi`]) and the rule's own buffers.
#[derive(Debug)]
struct DeltaBuffers<B: Backend> {
    mixed: B::Tensor,
    alpha: B::Tensor,
    beta: B::Tensor,
    out: B::Tensor,
    seq_mixed: B::Tensor,
    seq_alpha: B::Tensor,
    seq_beta: B::Tensor,
    seq_out: B::Tensor,
    scratch: DeltaScratch<B>,
}

/// The convolution's output and the Q, K, V cut from it.
#[derive(Debug)]
struct DeltaScratch<B: Backend> {
    conv: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
}

/// One sequence's rows in a [`Model::forward_multi`] batch: its own cache, its tokens at their
/// positions (contiguous with what its cache holds), and which of its rows need logits.
pub struct SeqRows<'a, B: Backend> {
    /// The sequence's cache.
    pub kv: &'a mut B::Kv,
    /// Its tokens.
    pub tokens: &'a [u32],
    /// Their positions.
    pub pos: &'a [u32],
    /// Rows (indices into `tokens`) whose logits are wanted.
    pub logits_rows: &'a [usize],
    /// Hidden states to capture for this sequence's rows only (a feature drafter's taps), on
    /// the host or into a backend tensor of this sequence's rows; `None` costs nothing.
    pub taps: Option<TapSink<'a, B>>,
    /// Where the rows go in the sliding-window layers when their cache keeps a ring; `None`:
    /// cell = position in every layer.
    pub ring: Option<Ring<'a>>,
}

/// One sequence's rows in the ring of its sliding-window layers (a cache made with
/// [`Model::kv_shape_ring`]): the cell each row is written to (`pos % ring`) and, once they are
/// written, the ring in position order — entry `p` is `p` where cell `p % ring` holds position
/// `p`, `u32::MAX` (seen by no query) elsewhere ([`specula_tensor::Backend::attention`]). The
/// caller keeps the ring's positions across forwards, and must never write rows over positions
/// a query of the batch still needs: with a window `w` and a ring of `r` cells, a forward
/// writes at most `r − w + 1` rows per sequence.
#[derive(Clone, Copy, Debug)]
pub struct Ring<'a> {
    /// The ring cell of each row.
    pub cells: &'a [usize],
    /// The ring in position order after the write (the attention's `kv_pos`).
    pub kv_pos: &'a [u32],
}

impl<B: Backend> std::fmt::Debug for SeqRows<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqRows")
            .field("tokens", &self.tokens)
            .field("pos", &self.pos)
            .field("logits_rows", &self.logits_rows)
            .field("taps", &self.taps.as_ref().map(TapSink::layers))
            .finish_non_exhaustive()
    }
}

/// A loaded model on a backend.
pub struct Model<B: Backend> {
    hp: Hparams,
    /// Shared with drafters that borrow the target's embedding (DFlash, EAGLE3).
    tok_embd: Arc<B::Weight>,
    output_norm: B::Weight,
    /// `None` when the embedding is tied (the output projection is `tok_embd`).
    output: Option<Arc<B::Weight>>,
    /// The per-tensor scale of `output` (`output.scale`, NVFP4 exports; never of a tied head).
    output_scale: Option<f32>,
    /// The token of each output row when the head was cut to a subset of the vocabulary
    /// ([`Model::restrict_head`]); `None` when row `i` is token `i`.
    head_ids: Option<Vec<u32>>,
    layers: Vec<Layer<B::Weight>>,
    /// Per-layer inputs (Gemma 4 E2B / E4B).
    inputs: Option<PerLayerInputs<B::Weight>>,
    file: Arc<Gguf>,
}

impl<B: Backend> std::fmt::Debug for Model<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("hparams", &self.hp)
            .field("tied_output", &self.output.is_none())
            .finish_non_exhaustive()
    }
}

/// Looks a tensor up, checks its shape, and hands it to the backend.
struct Loader<'a, B: Backend> {
    backend: &'a B,
    file: &'a Arc<Gguf>,
    /// The matrices whose per-tensor scales are applied.
    scales: linear::Scales,
}

impl<'a, B: Backend> Loader<'a, B> {
    fn new(backend: &'a B, file: &'a Arc<Gguf>) -> Self {
        Self {
            backend,
            file,
            scales: linear::Scales::default(),
        }
    }

    /// Matrix `<base>.weight` (required, prepared for matmul) with its optional per-tensor
    /// scale `<base>.scale`.
    fn linear(&self, base: &str, dims: &[usize]) -> Result<Linear<B::Weight>> {
        Ok(Linear {
            w: self.mat(&format!("{base}.weight"), dims)?,
            scale: self.scales.read(self.file, base)?,
        })
    }

    /// [`Loader::linear`] for a matrix the file may not have.
    fn linear_opt(&self, base: &str, dims: &[usize]) -> Result<Option<Linear<B::Weight>>> {
        let Some(mut w) = self.get(&format!("{base}.weight"), dims)? else {
            return Ok(None);
        };
        self.backend.prepare_matmul(&mut w);
        Ok(Some(Linear {
            w,
            scale: self.scales.read(self.file, base)?,
        }))
    }

    /// The index and type of tensor `name`.
    fn find(&self, name: &str) -> Result<(usize, QType)> {
        let idx = self
            .file
            .tensors()
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_owned(),
            })?;
        let info = &self.file.tensors()[idx];
        let ty = QType::from_ggml_id(info.ty.id()).ok_or_else(|| ModelError::UnsupportedType {
            name: name.to_owned(),
            ty: info.ty.name().to_owned(),
        })?;
        Ok((idx, ty))
    }

    fn get(&self, name: &str, dims: &[usize]) -> Result<Option<B::Weight>> {
        let Some(idx) = self.file.tensors().iter().position(|t| t.name == name) else {
            return Ok(None);
        };
        let info = &self.file.tensors()[idx];
        let got: Vec<usize> = crate::dims_of(info);
        if got != dims {
            return Err(ModelError::BadShape {
                name: name.to_owned(),
                expected: dims.to_vec(),
                got,
            });
        }
        let ty = QType::from_ggml_id(info.ty.id()).ok_or_else(|| ModelError::UnsupportedType {
            name: name.to_owned(),
            ty: info.ty.name().to_owned(),
        })?;
        let owner: Arc<dyn ByteSource> = Arc::new(FileBytes(Arc::clone(self.file)));
        let w = self.backend.weight(WeightDesc {
            name,
            ty,
            dims: &got,
            data: self.file.tensor_data(idx),
            owner,
        })?;
        Ok(Some(w))
    }

    /// A matrix the model multiplies by: loaded, then handed to the backend's
    /// [`Backend::prepare_matmul`].
    fn mat(&self, name: &str, dims: &[usize]) -> Result<B::Weight> {
        let mut w = self.req(name, dims)?;
        self.backend.prepare_matmul(&mut w);
        Ok(w)
    }

    /// The tensors of layer `il` that `spec` names (`blk.<il>.…`).
    fn layer(
        &self,
        arch: &str,
        il: usize,
        e: usize,
        spec: &LayerSpec,
        input_width: Option<usize>,
    ) -> Result<Layer<B::Weight>> {
        let n = |s: &str| format!("blk.{il}.{s}");
        let post = |name: &str| -> Result<Option<B::Weight>> {
            if spec.post_norms {
                self.req(&n(name), &[e]).map(Some)
            } else {
                Ok(None)
            }
        };
        let mixer = match &spec.mixer {
            MixerSpec::Attention(a) => Mixer::Attention(self.attention(arch, il, e, a)?),
            MixerSpec::DeltaNet(d) => Mixer::DeltaNet(self.delta_net(il, e, d)?),
        };
        let ffn = match &spec.ffn {
            FfnSpec::Dense { n_ff, .. } => Ffn::Dense {
                gate: self.linear(&n("ffn_gate"), &[e, *n_ff])?,
                up: self.linear(&n("ffn_up"), &[e, *n_ff])?,
                down: self.linear(&n("ffn_down"), &[*n_ff, e])?,
            },
            FfnSpec::Moe(m) => Ffn::Moe(self.moe(il, e, m, false)?),
            FfnSpec::Parallel { n_ff, moe, .. } => Ffn::Parallel(Box::new(Parallel {
                gate: self.linear(&n("ffn_gate"), &[e, *n_ff])?,
                up: self.linear(&n("ffn_up"), &[e, *n_ff])?,
                down: self.linear(&n("ffn_down"), &[*n_ff, e])?,
                post_1: self.req(&n("post_ffw_norm_1.weight"), &[e])?,
                pre_2: self.req(&n("pre_ffw_norm_2.weight"), &[e])?,
                post_2: self.req(&n("post_ffw_norm_2.weight"), &[e])?,
                router_scale: self.req(&n("ffn_gate_inp.scale"), &[e])?,
                moe: self.moe(il, e, moe, true)?,
            })),
        };
        let out_scale = if spec.out_scale {
            Some(self.host_vector(&n("layer_output_scale.weight"), 1)?[0])
        } else {
            None
        };
        let input = match input_width {
            Some(w) => Some(LayerInput {
                gate: self.linear(&n("inp_gate"), &[e, w])?,
                proj: self.linear(&n("proj"), &[w, e])?,
                post_norm: self.req(&n("post_norm.weight"), &[e])?,
            }),
            None => None,
        };
        Ok(Layer {
            out_scale,
            attn_norm: self.req(&n("attn_norm.weight"), &[e])?,
            mixer,
            post_attn_norm: post("post_attention_norm.weight")?,
            ffn_norm: self.req(&n(&format!("{}.weight", spec.ffn_norm)), &[e])?,
            ffn,
            post_ffw_norm: post("post_ffw_norm.weight")?,
            input,
        })
    }

    /// A mixture of experts' tensors: the router (`ffn_gate_inp`; with `vector_scaled_router`
    /// its `.scale` is Gemma 4's router input scale, read by the caller, not a per-tensor
    /// scale), the stacked experts (gate and up apart, or fused in `ffn_gate_up_exps`, gate
    /// first), the correction bias and the shared expert the spec names.
    fn moe(
        &self,
        il: usize,
        e: usize,
        m: &MoeSpec,
        vector_scaled_router: bool,
    ) -> Result<moe::MoeWeights<B::Weight>> {
        let n = |s: &str| format!("blk.{il}.{s}");
        let f = m.n_ff;
        let (gate, up) = if self.file.tensor(&n("ffn_gate_up_exps.weight")).is_some() {
            // Fused, gate rows first in each expert.
            let base = n("ffn_gate_up_exps");
            let scales = self.scales.read_per_expert(self.file, &base, m.n_expert)?;
            let mut v = self.expert_views(&base, e, 2 * f, m.n_expert, &[0..f, f..2 * f])?;
            let up = v.pop().unwrap_or_default();
            let gate = v.pop().unwrap_or_default();
            (
                moe::Experts {
                    w: gate,
                    scales: scales.clone(),
                },
                moe::Experts { w: up, scales },
            )
        } else {
            (
                self.experts(&n("ffn_gate_exps"), e, f, m.n_expert)?,
                self.experts(&n("ffn_up_exps"), e, f, m.n_expert)?,
            )
        };
        let down = self.experts(&n("ffn_down_exps"), f, e, m.n_expert)?;
        let shared = match &m.shared {
            Some(sh) => Some(moe::SharedWeights {
                gate: self.linear(&n("ffn_gate_shexp"), &[e, sh.n_ff])?,
                up: self.linear(&n("ffn_up_shexp"), &[e, sh.n_ff])?,
                down: self.linear(&n("ffn_down_shexp"), &[sh.n_ff, e])?,
                gate_inp: if sh.gated {
                    // One output per row: `[n_embd, 1]`, or a vector of `n_embd` (the
                    // shape llama.cpp asks for, which drops the trailing 1).
                    let name = n("ffn_gate_inp_shexp.weight");
                    let vector = self.file.tensor(&name).is_some_and(|t| t.dims.len() == 1);
                    Some(if vector {
                        self.mat_as(&name, &[e], &[e, 1])?
                    } else {
                        self.mat(&name, &[e, 1])?
                    })
                } else {
                    None
                },
            }),
            None => None,
        };
        let bias = match m.gating {
            Gating::Sigmoid { bias: true } => {
                Some(self.req(&n("exp_probs_b.bias"), &[m.n_expert])?)
            }
            _ => None,
        };
        let router = if vector_scaled_router {
            self.scales.mark_applied(&n("ffn_gate_inp"));
            Linear {
                w: self.mat(&n("ffn_gate_inp.weight"), &[e, m.n_expert])?,
                scale: None,
            }
        } else {
            self.linear(&n("ffn_gate_inp"), &[e, m.n_expert])?
        };
        Ok(moe::MoeWeights {
            router,
            bias,
            gate,
            up,
            down,
            shared,
        })
    }

    /// An attention mixer's tensors. Biases are read when the file has them (llama.cpp's
    /// `llama` graph takes optional ones) and required where the spec says so.
    fn attention(
        &self,
        arch: &str,
        il: usize,
        e: usize,
        a: &AttnSpec,
    ) -> Result<AttnWeights<B::Weight>> {
        let n = |s: &str| format!("blk.{il}.{s}");
        let heads = format!("{arch}.attention.head_count");
        let kv_heads = format!("{arch}.attention.head_count_kv");
        let qd = mul(&heads, a.n_head, a.head_dim_k)?;
        let kd = mul(&kv_heads, a.n_head_kv, a.head_dim_k)?;
        let vd = mul(&kv_heads, a.n_head_kv, a.head_dim_v)?;
        let od = mul(&heads, a.n_head, a.head_dim_v)?;
        let bias = |name: &str, d: usize| -> Result<Option<B::Weight>> {
            if a.qkv_bias {
                self.req(&n(name), &[d]).map(Some)
            } else {
                self.get(&n(name), &[d])
            }
        };
        let qk_norm = |name: &str| -> Result<Option<B::Weight>> {
            if a.qk_norm {
                self.req(&n(name), &[a.head_dim_k]).map(Some)
            } else {
                Ok(None)
            }
        };
        // A query-gated attention's Q projection holds each head's query, then its gate.
        let q_out = if a.gate == Some(AttnGate::QuerySigmoid) {
            mul(&heads, qd, 2)?
        } else {
            qd
        };
        let gate = match a.gate {
            Some(AttnGate::Softplus) => {
                // One value per head, or per element: the tensor's width says which.
                let name = n("attn_gate.weight");
                let width = self
                    .file
                    .tensor(&name)
                    .and_then(|t| t.dims.get(1))
                    .and_then(|&d| usize::try_from(d).ok());
                let w = if width == Some(qd) { qd } else { a.n_head };
                Some(self.linear(&n("attn_gate"), &[e, w])?)
            }
            _ => None,
        };
        let wq = self.linear(&n("attn_q"), &[e, q_out])?;
        let wo = self.linear(&n("attn_output"), &[od, e])?;
        let q_norm = qk_norm("attn_q_norm.weight")?;
        if a.kv_source.is_some() {
            // K and V come from the source layer's cache.
            return Ok(AttnWeights {
                gate,
                wq,
                wk: None,
                wv: None,
                v_norm: None,
                wo,
                bq: bias("attn_q.bias", qd)?,
                bk: None,
                bv: None,
                q_norm,
                k_norm: None,
            });
        }
        Ok(AttnWeights {
            gate,
            wq,
            wk: Some(self.linear(&n("attn_k"), &[e, kd])?),
            wv: if a.v_from_k {
                None
            } else {
                Some(self.linear(&n("attn_v"), &[e, vd])?)
            },
            v_norm: if a.v_norm {
                Some(self.ones(a.head_dim_v)?)
            } else {
                None
            },
            wo,
            bq: bias("attn_q.bias", qd)?,
            bk: bias("attn_k.bias", kd)?,
            bv: bias("attn_v.bias", vd)?,
            q_norm,
            k_norm: qk_norm("attn_k_norm.weight")?,
        })
    }

    /// A gated delta-net mixer's tensors (llama.cpp `qwen35.cpp` `load_block_trunk`).
    fn delta_net(&self, il: usize, e: usize, d: &DeltaNetSpec) -> Result<DeltaWeights<B::Weight>> {
        let n = |s: &str| format!("blk.{il}.{s}");
        let ch = d.conv_channels();
        let vd = d.n_head_v * d.head_dim;
        let (beta, alpha) = if d.fused_beta_alpha {
            // `ssm_ba`: per key head, its value heads' β rows, then their α rows.
            let base = n("ssm_ba");
            let hv = d.n_head_v;
            let r = hv / d.n_head_k;
            let ba = |alpha: bool| -> Vec<usize> {
                (0..hv)
                    .map(|h| (h / r) * 2 * r + usize::from(alpha) * r + h % r)
                    .collect()
            };
            let scale = self.scales.read(self.file, &base)?;
            let name = format!("{base}.weight");
            (
                Linear {
                    w: self.rows_of(&name, e, 2 * hv, &ba(false))?,
                    scale,
                },
                Linear {
                    w: self.rows_of(&name, e, 2 * hv, &ba(true))?,
                    scale,
                },
            )
        } else {
            (
                self.linear(&n("ssm_beta"), &[e, d.n_head_v])?,
                self.linear(&n("ssm_alpha"), &[e, d.n_head_v])?,
            )
        };
        let (qkv, z) = if d.grouped && self.file.tensor(&n("attn_qkv.weight")).is_none() {
            // Qwen3-Next GGUFs of the first converters keep Hugging Face's fused `ssm_in`:
            // per key head its Q, K, V and Z rows (llama.cpp's legacy path); the same rows,
            // regrouped, are `attn_qkv` and `attn_gate`.
            let (dk, r) = (d.head_dim, d.n_head_v / d.n_head_k);
            let (dv, hk) = (r * d.head_dim, d.n_head_k);
            let group = 2 * dk + 2 * dv;
            let part = |off: usize, len: usize| {
                (0..hk).flat_map(move |g| g * group + off..g * group + off + len)
            };
            let qkv_rows: Vec<usize> = part(0, dk)
                .chain(part(dk, dk))
                .chain(part(2 * dk, dv))
                .collect();
            let z_rows: Vec<usize> = part(2 * dk + dv, dv).collect();
            let base = n("ssm_in");
            let scale = self.scales.read(self.file, &base)?;
            let name = format!("{base}.weight");
            let rows = hk * group;
            (
                Linear {
                    w: self.rows_of(&name, e, rows, &qkv_rows)?,
                    scale,
                },
                Linear {
                    w: self.rows_of(&name, e, rows, &z_rows)?,
                    scale,
                },
            )
        } else {
            (
                self.linear(&n("attn_qkv"), &[e, ch])?,
                self.linear(&n("attn_gate"), &[e, vd])?,
            )
        };
        Ok(DeltaWeights {
            qkv,
            z,
            conv: self.req(&n("ssm_conv1d.weight"), &[d.conv_kernel, ch])?,
            dt_bias: self.req(&n("ssm_dt.bias"), &[d.n_head_v])?,
            a: self.req(&n("ssm_a"), &[d.n_head_v])?,
            beta,
            alpha,
            norm: self.req(&n("ssm_norm.weight"), &[d.head_dim])?,
            out: self.linear(&n("ssm_out"), &[vd, e])?,
        })
    }

    /// The matrix of the rows `rows` (in that order) of matrix `name` (`[n_in, n_rows]`), as a
    /// weight of its own over a copy of those rows' bytes: a row's bits, and so its products,
    /// are the fused matrix's.
    fn rows_of(&self, name: &str, n_in: usize, n_rows: usize, rows: &[usize]) -> Result<B::Weight> {
        let (idx, ty) = self.find(name)?;
        let got = dims_of(&self.file.tensors()[idx]);
        if got != [n_in, n_rows] || rows.iter().any(|&r| r >= n_rows) {
            return Err(ModelError::BadShape {
                name: name.to_owned(),
                expected: vec![n_in, n_rows],
                got,
            });
        }
        let row = ty.row_bytes(n_in).map_err(|source| ModelError::Rows {
            name: name.to_owned(),
            source,
        })?;
        let data = self.file.tensor_data(idx);
        let bytes: Arc<Vec<u8>> = Arc::new(
            rows.iter()
                .flat_map(|&r| &data[r * row..(r + 1) * row])
                .copied()
                .collect(),
        );
        let mut w = self.backend.weight(WeightDesc {
            name,
            ty,
            dims: &[n_in, rows.len()],
            data: bytes.as_slice(),
            owner: Arc::clone(&bytes) as Arc<dyn ByteSource>,
        })?;
        self.backend.prepare_matmul(&mut w);
        Ok(w)
    }

    /// A vector of `n` ones (the weight of a norm without one).
    fn ones(&self, n: usize) -> Result<B::Weight> {
        let bytes: Arc<Vec<u8>> = Arc::new(1.0f32.to_le_bytes().repeat(n));
        let w = self.backend.weight(WeightDesc {
            name: "ones",
            ty: QType::F32,
            dims: &[n],
            data: bytes.as_slice(),
            owner: Arc::clone(&bytes) as Arc<dyn ByteSource>,
        })?;
        Ok(w)
    }

    /// The `n` values of vector `name` on the host (a router's selection bias).
    fn host_vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        // Shape and type checked as any tensor's.
        drop(self.req(name, &[n])?);
        let (_, ty) = self.find(name)?;
        let mut v = vec![0.0; n];
        specula_quant::dequantize_row(
            ty,
            self.file.tensor_data_by_name(name).unwrap_or(&[]),
            &mut v,
        )
        .map_err(|source| ModelError::Rows {
            name: name.to_owned(),
            source,
        })?;
        Ok(v)
    }

    /// The tensor `name` of shape `file_dims`, multiplied by as a matrix of `dims` (the same
    /// values: a vector used as a one-output projection).
    fn mat_as(&self, name: &str, file_dims: &[usize], dims: &[usize]) -> Result<B::Weight> {
        // Shape and type checked as any tensor's.
        drop(self.req(name, file_dims)?);
        let (idx, ty) = self.find(name)?;
        let owner: Arc<dyn ByteSource> = Arc::new(FileBytes(Arc::clone(self.file)));
        let mut w = self.backend.weight(WeightDesc {
            name,
            ty,
            dims,
            data: self.file.tensor_data(idx),
            owner,
        })?;
        self.backend.prepare_matmul(&mut w);
        Ok(w)
    }

    /// One projection of a stack of experts: the `[n_in, n_out, n_expert]` tensor
    /// `{base}.weight` as one matrix per expert, and the per-expert scales the file has.
    fn experts(
        &self,
        base: &str,
        n_in: usize,
        n_out: usize,
        n_expert: usize,
    ) -> Result<moe::Experts<B::Weight>> {
        let scales = self.scales.read_per_expert(self.file, base, n_expert)?;
        let w = self
            .expert_views(
                base,
                n_in,
                n_out,
                n_expert,
                std::slice::from_ref(&(0..n_out)),
            )?
            .pop()
            .unwrap_or_default();
        Ok(moe::Experts { w, scales })
    }

    /// Views of the stacked `[n_in, n_rows, n_expert]` tensor `{base}.weight`
    /// ([`Backend::weight_views`]: one copy of the stack on a device): for each range of
    /// `parts` (rows inside an expert: all of them, or a fused tensor's gate and up halves),
    /// that range of every expert, by expert id.
    fn expert_views(
        &self,
        base: &str,
        n_in: usize,
        n_rows: usize,
        n_expert: usize,
        parts: &[std::ops::Range<usize>],
    ) -> Result<Vec<Vec<B::Weight>>> {
        let name = format!("{base}.weight");
        let (idx, ty) = self.find(&name)?;
        let got: Vec<usize> = crate::dims_of(&self.file.tensors()[idx]);
        if got != [n_in, n_rows, n_expert] {
            return Err(ModelError::BadShape {
                name,
                expected: vec![n_in, n_rows, n_expert],
                got,
            });
        }
        let ranges: Vec<std::ops::Range<usize>> = (0..n_expert)
            .flat_map(|x| {
                parts
                    .iter()
                    .map(move |p| x * n_rows + p.start..x * n_rows + p.end)
            })
            .collect();
        let owner: Arc<dyn ByteSource> = Arc::new(FileBytes(Arc::clone(self.file)));
        let views = self.backend.weight_views(
            &WeightDesc {
                name: &name,
                ty,
                dims: &[n_in, n_rows * n_expert],
                data: self.file.tensor_data(idx),
                owner,
            },
            &ranges,
        )?;
        let mut out: Vec<Vec<B::Weight>> = parts.iter().map(|_| Vec::new()).collect();
        for (i, mut w) in views.into_iter().enumerate() {
            self.backend.prepare_matmul(&mut w);
            out[i % parts.len()].push(w);
        }
        Ok(out)
    }

    fn req(&self, name: &str, dims: &[usize]) -> Result<B::Weight> {
        self.get(name, dims)?
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_owned(),
            })
    }
}

/// A tensor's dimensions (ggml order) as `usize` (a dimension past `usize` as `usize::MAX`,
/// which no expected shape equals).
pub(crate) fn dims_of(info: &specula_gguf::TensorInfo) -> Vec<usize> {
    info.dims
        .iter()
        .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
        .collect()
}

/// The layer of a `blk.N.…` tensor name.
fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("blk.")?;
    rest.split_once('.')?.0.parse().ok()
}

/// Refuses layer tensors past `n_layer` (the count under `key`): a file whose layer count and
/// tensors disagree is not the model it claims to be (llama.cpp: "wrong number of tensors").
pub(crate) fn check_layer_tensors(file: &Gguf, key: &str, n_layer: usize) -> Result<()> {
    for t in file.tensors() {
        if let Some(layer) = layer_of(&t.name)
            && layer >= n_layer
        {
            return Err(ModelError::ExtraLayer {
                name: t.name.clone(),
                layer,
                key: key.to_owned(),
                n_layer,
            });
        }
    }
    Ok(())
}

/// A language model's file, not a multimodal one: vision-tower and projector tensors (`v.*`,
/// `mm.*`, as llama.cpp's `clip` files name them) are refused by name rather than ignored.
fn check_text_only(file: &Gguf) -> Result<()> {
    match file
        .tensors()
        .iter()
        .find(|t| t.name.starts_with("v.") || t.name.starts_with("mm."))
    {
        Some(t) => Err(ModelError::Multimodal {
            name: t.name.clone(),
        }),
        None => Ok(()),
    }
}

/// Each layer has tensors of its own, so `block_count` cannot exceed the file's tensor count:
/// checked before anything is sized by it (Gemma's per-layer window pattern).
fn check_block_count(file: &Gguf) -> Result<()> {
    let Some(arch) = file.metadata().get_str("general.architecture") else {
        return Ok(());
    };
    let key = format!("{arch}.block_count");
    let n_tensors = file.tensors().len();
    match opt_usize(file.metadata(), &key) {
        Ok(Some(n)) if n > n_tensors => Err(int_bound(
            &key,
            n,
            format!("at most the {n_tensors} tensors of the file (every layer has its own)"),
        )),
        _ => Ok(()),
    }
}

/// The tokenizer's vocabulary must fit the embedding: a token past its rows would reach the
/// embedding lookup with no row to read.
fn check_vocab(file: &Gguf, n_vocab: usize) -> Result<()> {
    const KEY: &str = "tokenizer.ggml.tokens";
    if let Some(a) = file.metadata().get_array(KEY)
        && a.len() > n_vocab
    {
        return Err(int_bound(
            KEY,
            a.len(),
            format!("at most the {n_vocab} rows of `token_embd.weight` (tokens in the vocabulary)"),
        ));
    }
    Ok(())
}

impl<B: Backend> Model<B> {
    /// Loads a model from an open GGUF file.
    ///
    /// # Errors
    /// Unsupported architecture or tensor type, missing keys or tensors, wrong shapes.
    pub fn load(backend: &B, file: Arc<Gguf>) -> Result<Self> {
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor {
                name: "token_embd.weight".into(),
            })?;
        let n_vocab = embd
            .dims
            .get(1)
            .and_then(|&d| usize::try_from(d).ok())
            .unwrap_or(0);
        check_block_count(&file)?;
        let mut hp = Hparams::from_metadata(file.metadata(), n_vocab)?;
        arch::finish(&mut hp, &file)?;
        let embd_dims: Vec<u64> = embd.dims.clone();
        if n_vocab == 0 || embd_dims.len() != 2 {
            return Err(ModelError::EmbeddingShape {
                name: "token_embd.weight".into(),
                got: embd_dims,
                n_embd: hp.n_embd,
            });
        }
        check_vocab(&file, n_vocab)?;
        check_layer_tensors(
            &file,
            &format!("{}.block_count", hp.arch.name()),
            hp.n_layer + hp.n_mtp,
        )?;
        check_text_only(&file)?;
        let l = Loader::new(backend, &file);
        let e = hp.n_embd;
        let mut tok_embd = l.req("token_embd.weight", &[e, n_vocab])?;
        let output_norm = l.req("output_norm.weight", &[e])?;
        let output = l.linear_opt("output", &[e, n_vocab])?;
        // The output projection (the token embedding when tied) is a matmul weight.
        if output.is_none() {
            backend.prepare_matmul(&mut tok_embd);
        }
        // The layers' tensors were counted above: a huge `block_count` is a missing tensor,
        // not an allocation.
        let inputs = match hp.per_layer_input {
            Some(width) => {
                let all = mul(
                    &format!("{}.embedding_length_per_layer_input", hp.arch.name()),
                    width,
                    hp.n_layer,
                )?;
                Some(PerLayerInputs {
                    embd: l.req("per_layer_token_embd.weight", &[all, n_vocab])?,
                    proj: l.linear("per_layer_model_proj", &[e, all])?,
                    norm: l.req("per_layer_proj_norm.weight", &[width])?,
                    width,
                })
            }
            None => None,
        };
        let mut layers = Vec::with_capacity(hp.n_layer.min(file.tensors().len()));
        for (il, spec) in hp.layers.iter().enumerate() {
            layers.push(l.layer(hp.arch.name(), il, e, spec, hp.per_layer_input)?);
        }
        l.scales.check(&file)?;
        let output_scale = output.as_ref().and_then(|o| o.scale);
        Ok(Self {
            hp,
            tok_embd: Arc::new(tok_embd),
            output_norm,
            output: output.map(|o| Arc::new(o.w)),
            output_scale,
            head_ids: None,
            layers,
            inputs,
            file,
        })
    }

    /// The hyperparameters.
    #[must_use]
    pub fn hparams(&self) -> &Hparams {
        &self.hp
    }

    /// The token embedding, shared (drafters without their own borrow it, as llama.cpp's
    /// DFlash and EAGLE3 drafts do through `ctx_other`).
    #[must_use]
    pub fn token_embedding(&self) -> Arc<B::Weight> {
        Arc::clone(&self.tok_embd)
    }

    /// The output projection (the token embedding when tied), shared like
    /// [`Model::token_embedding`]; it was prepared for matmul at load.
    #[must_use]
    pub fn output_head(&self) -> Arc<B::Weight> {
        Arc::clone(self.output.as_ref().unwrap_or(&self.tok_embd))
    }

    /// [`Model::output_head`] with its per-tensor scale: what a drafter that borrows the
    /// target's head multiplies by.
    #[must_use]
    pub fn output_linear(&self) -> Linear<Arc<B::Weight>> {
        Linear {
            w: self.output_head(),
            scale: self.output_scale,
        }
    }

    /// Cuts the output head to the rows of `ids`, in that order: from then on a logits row
    /// holds `ids.len()` values, value `i` the logit of token `ids[i]`
    /// ([`Model::head_ids`]). The rows are copied from the file's head, bytes unchanged, so
    /// each kept logit equals the full head's. For a draft model: its head is a large share
    /// of a decode step (Qwen2.5-0.5B: 138 of 374 MiB), and drafting over the tokens that
    /// occur most often loses little acceptance (FR-Spec, arXiv:2502.14856; EAGLE-3's draft
    /// vocabulary does the same).
    ///
    /// # Errors
    /// [`ModelError::EmptyHead`] for an empty `ids`, [`ModelError::TokenPastVocab`] for an id
    /// past the vocabulary; errors of the
    /// backend making the weight.
    pub fn restrict_head(&mut self, backend: &B, ids: &[u32]) -> Result<()> {
        let n_vocab = self.hp.n_vocab;
        if ids.is_empty() {
            return Err(ModelError::EmptyHead);
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(ModelError::TokenPastVocab {
                what: "output head",
                id: bad,
                n_vocab,
            });
        }
        let name = if self.output.is_some() {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let rows: Vec<usize> = ids.iter().map(|&t| t as usize).collect();
        let w = Loader::new(backend, &self.file).rows_of(name, self.hp.n_embd, n_vocab, &rows)?;
        self.output = Some(Arc::new(w));
        self.head_ids = Some(ids.to_vec());
        Ok(())
    }

    /// The token of each logit when the head was cut ([`Model::restrict_head`]); `None` for
    /// the full vocabulary in id order.
    #[must_use]
    pub fn head_ids(&self) -> Option<&[u32]> {
        self.head_ids.as_deref()
    }

    /// The GGUF file the weights come from.
    #[must_use]
    pub fn file(&self) -> &Arc<Gguf> {
        &self.file
    }

    /// Snapshots a recurrent layer keeps after the last rows of a forward: enough to take back
    /// any part of a verify batch of the default draft length (16) without replaying.
    pub const DEFAULT_SNAPSHOTS: usize = 16;

    /// Allocates a KV cache of `n_ctx` cells.
    ///
    /// # Errors
    /// If the backend cannot store the cache in these formats.
    pub fn new_kv(&self, backend: &B, n_ctx: usize, k_type: QType, v_type: QType) -> Result<B::Kv> {
        Ok(backend.kv_new(self.kv_shape(n_ctx, k_type, v_type))?)
    }

    /// The shape of a cache of `n_ctx` cells for this model (for memory accounting and checks
    /// before allocating).
    #[must_use]
    pub fn kv_shape(&self, n_ctx: usize, k_type: QType, v_type: QType) -> KvShape {
        self.kv_shape_ring(n_ctx, None, k_type, v_type)
    }

    /// [`Model::kv_shape`] whose sliding-window layers keep a ring of `ring` cells (llama.cpp's
    /// SWA cache) when the model has such layers and `ring` is below `n_ctx`; their rows are
    /// then placed by [`Model::forward_ring`]. `None`: `n_ctx` cells in every layer.
    #[must_use]
    pub fn kv_shape_ring(
        &self,
        n_ctx: usize,
        ring: Option<usize>,
        k_type: QType,
        v_type: QType,
    ) -> KvShape {
        let swa = match (&self.hp.swa, ring) {
            (Some(w), Some(r)) if r < n_ctx => Some(specula_tensor::SwaCells {
                n_cells: r,
                layers: w.layers.clone(),
            }),
            _ => None,
        };
        KvShape {
            n_layer: self.hp.n_layer,
            n_ctx,
            n_kv_head: self.hp.n_head_kv,
            head_dim_k: self.hp.head_dim_k,
            head_dim_v: self.hp.head_dim_v,
            k_type,
            v_type,
            overrides: Vec::new(),
            swa,
            recurrent: self.recurrent_layers(),
            heads: self.layer_heads(),
            shared: self.shared_layers(),
        }
    }

    /// Per layer, the layer whose K/V it reads ([`spec::Memory::Shared`]); empty when every
    /// layer keeps its own.
    fn shared_layers(&self) -> Vec<Option<usize>> {
        let shared: Vec<Option<usize>> = self
            .hp
            .layers
            .iter()
            .map(|l| match l.memory() {
                spec::Memory::Shared { source } => Some(source),
                spec::Memory::Kv { .. } | spec::Memory::Recurrent(_) => None,
            })
            .collect();
        if shared.iter().any(Option::is_some) {
            shared
        } else {
            Vec::new()
        }
    }

    /// The layer whose cache layer `il` attends over: its own, or its source.
    fn kv_layer(&self, il: usize) -> usize {
        match &self.hp.layers[il].mixer {
            MixerSpec::Attention(AttnSpec {
                kv_source: Some(src),
                ..
            }) => *src,
            _ => il,
        }
    }

    /// Per-layer K/V heads when the attention layers differ (Gemma 4); empty otherwise.
    fn layer_heads(&self) -> Vec<specula_tensor::LayerHeads> {
        let heads: Vec<specula_tensor::LayerHeads> = self
            .hp
            .layers
            .iter()
            .map(|l| match &l.mixer {
                // A shared layer's heads are its source's (the spec checks it).
                MixerSpec::Attention(a) => specula_tensor::LayerHeads {
                    n_kv_head: a.n_head_kv,
                    head_dim_k: a.head_dim_k,
                    head_dim_v: a.head_dim_v,
                },
                // A recurrent layer keeps no cells: the model-wide shape stands in.
                MixerSpec::DeltaNet(_) => specula_tensor::LayerHeads {
                    n_kv_head: self.hp.n_head_kv,
                    head_dim_k: self.hp.head_dim_k,
                    head_dim_v: self.hp.head_dim_v,
                },
            })
            .collect();
        let uniform = heads.iter().all(|h| {
            (h.n_kv_head, h.head_dim_k, h.head_dim_v)
                == (self.hp.n_head_kv, self.hp.head_dim_k, self.hp.head_dim_v)
        });
        if uniform { Vec::new() } else { heads }
    }

    /// The recurrent layers' states ([`spec::Memory::Recurrent`]), each keeping
    /// [`Model::DEFAULT_SNAPSHOTS`] snapshots; `None` for a model that only attends.
    fn recurrent_layers(&self) -> Option<specula_tensor::RecurrentLayers> {
        let layers: Vec<Option<specula_tensor::RecurrentShape>> = self
            .hp
            .layers
            .iter()
            .map(|l| match l.memory() {
                spec::Memory::Recurrent(r) => Some(r),
                spec::Memory::Kv { .. } | spec::Memory::Shared { .. } => None,
            })
            .collect();
        layers
            .iter()
            .any(Option::is_some)
            .then_some(specula_tensor::RecurrentLayers {
                layers,
                snapshots: Self::DEFAULT_SNAPSHOTS,
            })
    }

    /// Fresh activation buffers.
    #[must_use]
    pub fn scratch(&self, backend: &B) -> Scratch<B> {
        let z = || backend.zeros(0, 0);
        Scratch {
            x: z(),
            cur: z(),
            q: z(),
            k: z(),
            v: z(),
            attn: z(),
            proj: z(),
            gate: z(),
            up: z(),
            act: z(),
            sel: z(),
            norm: z(),
            logits: z(),
            ix: None,
            host: Vec::new(),
            argmax: false,
            ids: Vec::new(),
            all_tokens: Vec::new(),
            all_pos: Vec::new(),
            all_logits_rows: Vec::new(),
            tap_rows: z(),
            moe: moe::MoeScratch::new(backend),
            qg: z(),
            attn_gate: z(),
            par: ParallelBuffers {
                dense: z(),
                router: z(),
                experts: z(),
            },
            inputs: InputBuffers {
                all: z(),
                embd: z(),
                gate: z(),
                slice: z(),
                act: z(),
            },
            dn: DeltaBuffers {
                mixed: z(),
                alpha: z(),
                beta: z(),
                out: z(),
                seq_mixed: z(),
                seq_alpha: z(),
                seq_beta: z(),
                seq_out: z(),
                scratch: DeltaScratch {
                    conv: z(),
                    q: z(),
                    k: z(),
                    v: z(),
                },
            },
        }
    }

    /// The attention spec of layer `il`, which must attend.
    fn attn_spec(&self, il: usize) -> &AttnSpec {
        match &self.hp.layers[il].mixer {
            MixerSpec::Attention(a) => a,
            MixerSpec::DeltaNet(_) => unreachable!("layer {il} is recurrent"),
        }
    }

    /// Whether the model has recurrent layers (their memory cannot be trimmed).
    #[must_use]
    pub fn is_recurrent(&self) -> bool {
        self.hp
            .layers
            .iter()
            .any(|l| matches!(l.mixer, MixerSpec::DeltaNet(_)))
    }

    /// A recurrent model's sequence must continue where its memory is: consecutive positions
    /// from one its recurrent layers kept ([`Backend::kv_holds`]).
    fn check_recurrent(&self, be: &B, kv: &B::Kv, seq: usize, pos: &[u32]) -> Result<()> {
        if !self.is_recurrent() {
            return Ok(());
        }
        let p0 = pos[0];
        if pos
            .iter()
            .enumerate()
            .any(|(i, &p)| u32::try_from(i).ok().and_then(|i| p0.checked_add(i)) != Some(p))
        {
            return Err(ModelError::RecurrentPositions { seq });
        }
        if !be.kv_holds(kv, p0 as usize) {
            return Err(ModelError::RecurrentState { seq, pos: p0 });
        }
        Ok(())
    }

    /// Layer `il`'s delta rule for one sequence's rows from `pos0`: the convolution over
    /// `mixed` (Q, K, V side by side), SiLU, the split, the gated rule into `out`.
    #[allow(
        clippy::too_many_arguments,
        reason = "the rule's inputs are all needed"
    )]
    fn delta_rule(
        &self,
        be: &B,
        kv: &mut B::Kv,
        dn: &mut DeltaScratch<B>,
        il: usize,
        pos0: usize,
        mixed: &B::Tensor,
        alpha: &B::Tensor,
        beta: &B::Tensor,
        out: &mut B::Tensor,
    ) {
        let (Mixer::DeltaNet(w), MixerSpec::DeltaNet(d)) =
            (&self.layers[il].mixer, &self.hp.layers[il].mixer)
        else {
            unreachable!("layer {il} is not recurrent");
        };
        let ch = d.conv_channels();
        let kd = d.n_head_k * d.head_dim;
        be.ssm_conv(kv, il, pos0, mixed, &w.conv, &mut dn.conv);
        be.silu(&mut dn.conv);
        be.gather_cols(&dn.conv, ch, 0..kd, &mut dn.q);
        be.gather_cols(&dn.conv, ch, kd..2 * kd, &mut dn.k);
        be.gather_cols(&dn.conv, ch, 2 * kd..ch, &mut dn.v);
        let p = specula_tensor::DeltaNetParams {
            layer: il,
            pos0,
            eps: self.hp.rms_eps,
        };
        be.gated_delta_net(
            kv, &p, &dn.q, &dn.k, &dn.v, alpha, beta, &w.dt_bias, &w.a, out,
        );
    }

    /// The attention call of layer `il` for queries at `q_pos` over cells at `kv_pos`: the
    /// layer's heads, scale and mask. Every forward (prefill chunks, decode, verify rows,
    /// several sequences) attends through this, so they agree.
    fn attn_params<'p>(
        &self,
        il: usize,
        q_pos: &'p B::Index,
        kv_pos: &'p B::Index,
    ) -> AttentionParams<'p, B::Index> {
        let a = self.attn_spec(il);
        AttentionParams {
            layer: self.kv_layer(il),
            n_head: a.n_head,
            q_pos,
            kv_pos,
            scale: a.scale,
            mask: a.mask,
            softcap: None,
        }
    }

    /// Runs `tokens` at positions `pos` (one sequence; cache cell = position) through the
    /// model, writing their K/V into the cache, and returns the logits of the batch rows in
    /// `logits_rows` (row-major, `logits_rows.len() · n_vocab`). Positions must be contiguous
    /// with what the cache holds: the attention reads cells `0..=max(pos)`.
    ///
    /// # Errors
    /// An empty or inconsistent batch, or positions past the cache.
    #[allow(
        clippy::too_many_arguments,
        reason = "the forward pass's inputs are all needed"
    )]
    pub fn forward<'s>(
        &self,
        be: &B,
        kv: &mut B::Kv,
        s: &'s mut Scratch<B>,
        tokens: &[u32],
        pos: &[u32],
        logits_rows: &[usize],
        taps: Option<&mut Taps>,
    ) -> Result<&'s [f32]> {
        self.forward_ring(be, kv, s, tokens, pos, logits_rows, taps, None)
    }

    /// [`Model::forward`] on a cache whose sliding-window layers keep a ring
    /// ([`Model::kv_shape_ring`]): those layers write the rows into `ring.cells` and attend over
    /// the ring's cells at `ring.kv_pos`; the other layers as [`Model::forward`].
    ///
    /// # Errors
    /// As [`Model::forward`], and a ring whose cells are not one per row.
    #[allow(
        clippy::too_many_arguments,
        reason = "the forward pass's inputs are all needed"
    )]
    pub fn forward_ring<'s>(
        &self,
        be: &B,
        kv: &mut B::Kv,
        s: &'s mut Scratch<B>,
        tokens: &[u32],
        pos: &[u32],
        logits_rows: &[usize],
        taps: Option<&mut Taps>,
        ring: Option<Ring<'_>>,
    ) -> Result<&'s [f32]> {
        self.forward_to(
            be,
            kv,
            s,
            tokens,
            pos,
            logits_rows,
            taps.map(TapSink::Host),
            ring,
        )
    }

    /// [`Model::forward_ring`] with the captured hidden states going to `sink` (on the host,
    /// or into a backend tensor that a feature drafter reads where it lies).
    ///
    /// # Errors
    /// As [`Model::forward_ring`].
    #[allow(
        clippy::too_many_arguments,
        reason = "the forward pass's inputs are all needed"
    )]
    pub fn forward_to<'s>(
        &self,
        be: &B,
        kv: &mut B::Kv,
        s: &'s mut Scratch<B>,
        tokens: &[u32],
        pos: &[u32],
        logits_rows: &[usize],
        mut taps: Option<TapSink<'_, B>>,
        ring: Option<Ring<'_>>,
    ) -> Result<&'s [f32]> {
        let n = tokens.len();
        Self::check_ring(ring.as_ref(), n)?;
        if n == 0 || pos.len() != n {
            return Err(ModelError::Positions {
                seq: 0,
                tokens: n,
                positions: pos.len(),
            });
        }
        if let Some(&bad) = logits_rows.iter().find(|&&r| r >= n) {
            return Err(ModelError::LogitsRow {
                what: "the batch".into(),
                row: bad,
                rows: n,
            });
        }
        let n_embd = self.hp.n_embd;
        match taps.as_mut() {
            Some(TapSink::Host(t)) => t.rows.resize(t.layers.len(), Vec::new()),
            Some(TapSink::Device { layers, features }) => {
                be.resize(features, n, layers.len() * n_embd);
            }
            None => {}
        }
        let want = taps.is_some();
        let mut capture = |be: &B, s: &mut Scratch<B>, layer: usize| match taps.as_mut() {
            Some(TapSink::Host(t)) => {
                for (i, &l) in t.layers.iter().enumerate() {
                    if l == layer {
                        be.to_host(&s.x, &mut t.rows[i]);
                    }
                }
            }
            Some(TapSink::Device { layers, features }) => {
                for (i, &l) in layers.iter().enumerate() {
                    if l == layer {
                        be.put_cols(&s.x, i * n_embd, features);
                    }
                }
            }
            None => {}
        };
        let tap: Option<&mut TapFn<'_, B>> = if want { Some(&mut capture) } else { None };

        self.check_recurrent(be, kv, 0, pos)?;
        self.check_tokens(tokens)?;
        let mut ix = s.ix.take().unwrap_or_else(|| index::ForwardIndex::new(be));
        ix.fill_batch(be, tokens, logits_rows);
        ix.fill_seq(be, 0, None, pos, ring.as_ref());
        let seq = &ix.seqs[0];
        let result = self.layers_and_head(be, s, &ix, &seq.pos, tap, &mut |be, s, il| {
            if let MixerSpec::DeltaNet(_) = &self.hp.layers[il].mixer {
                let dn = &mut s.dn;
                self.delta_rule(
                    be,
                    kv,
                    &mut dn.scratch,
                    il,
                    pos[0] as usize,
                    &dn.mixed,
                    &dn.alpha,
                    &dn.beta,
                    &mut dn.out,
                );
                return;
            }
            let (cells, kv_pos) = seq.cells(ring.is_some() && self.hp.is_swa(il));
            if self.kv_layer(il) == il {
                be.kv_write(kv, il, cells, &s.k, &s.v);
            }
            be.attention(
                &s.q,
                kv,
                &self.attn_params(il, &seq.pos, kv_pos),
                &mut s.attn,
            );
        });
        s.ix = Some(ix);
        result?;
        Ok(&s.host)
    }

    /// Runs the rows of several sequences, each on its own cache, as one batch: the matmuls
    /// (and norms, RoPE, FFN) run over all rows together, the attention of each sequence over
    /// its own cache. Returns the logits of every sequence's `logits_rows`, sequence after
    /// sequence (row-major). With batch-invariant kernels each row has the bits it would have
    /// in [`Model::forward`] of its sequence alone, so a sequence's output does not depend on
    /// what else runs with it (continuous batching in a server). A sequence with
    /// [`SeqRows::taps`] gets its own rows of the tapped hidden states (the bits
    /// [`Model::forward`] would capture for it alone); sequences without pay nothing.
    ///
    /// # Errors
    /// An empty or inconsistent batch, or positions past a cache.
    pub fn forward_multi<'s>(
        &self,
        be: &B,
        seqs: &mut [SeqRows<'_, B>],
        s: &'s mut Scratch<B>,
    ) -> Result<&'s [f32]> {
        if let [one] = seqs {
            let taps = match one.taps.as_mut() {
                None => None,
                Some(TapSink::Host(t)) => Some(TapSink::Host(t)),
                Some(TapSink::Device { layers, features }) => Some(TapSink::Device {
                    layers,
                    features: &mut **features,
                }),
            };
            return self.forward_to(
                be,
                one.kv,
                s,
                one.tokens,
                one.pos,
                one.logits_rows,
                taps,
                one.ring,
            );
        }
        if seqs.is_empty() {
            return Err(ModelError::NoSequences);
        }
        let mut all_tokens = std::mem::take(&mut s.all_tokens);
        let mut all_pos = std::mem::take(&mut s.all_pos);
        let mut all_rows = std::mem::take(&mut s.all_logits_rows);
        all_tokens.clear();
        all_pos.clear();
        all_rows.clear();
        for (i, q) in seqs.iter().enumerate() {
            let n = q.tokens.len();
            if n == 0 || q.pos.len() != n {
                return Err(ModelError::Positions {
                    seq: i,
                    tokens: n,
                    positions: q.pos.len(),
                });
            }
            if let Some(&bad) = q.logits_rows.iter().find(|&&r| r >= n) {
                return Err(ModelError::LogitsRow {
                    what: format!("sequence {i} of the batch"),
                    row: bad,
                    rows: n,
                });
            }
            Self::check_ring(q.ring.as_ref(), n)?;
            self.check_recurrent(be, q.kv, i, q.pos)?;
            let off = all_tokens.len();
            all_rows.extend(q.logits_rows.iter().map(|&r| off + r));
            all_tokens.extend_from_slice(q.tokens);
            all_pos.extend_from_slice(q.pos);
        }
        if let Err(e) = self.check_tokens(&all_tokens) {
            s.all_tokens = all_tokens;
            s.all_pos = all_pos;
            s.all_logits_rows = all_rows;
            return Err(e);
        }
        // Every index tensor of the forward, once: the batch's, and each sequence's rows,
        // positions and cells, which every layer then reads.
        let mut ix = s.ix.take().unwrap_or_else(|| index::ForwardIndex::new(be));
        ix.fill_batch(be, &all_tokens, &all_rows);
        be.set_index(&mut ix.pos, &all_pos);
        let mut off = 0;
        for (i, q) in seqs.iter().enumerate() {
            let n = q.tokens.len();
            ix.fill_seq(be, i, Some(off..off + n), q.pos, q.ring.as_ref());
            off += n;
        }
        // The sequences that capture hidden states: taken out of `seqs` for the forward (the
        // attention borrows `seqs`), put back after it.
        let mut tapped: Vec<(usize, TapSink<'_, B>)> = Vec::new();
        let n_embd = self.hp.n_embd;
        for (i, q) in seqs.iter_mut().enumerate() {
            let n = q.tokens.len();
            if let Some(mut t) = q.taps.take() {
                match &mut t {
                    TapSink::Host(t) => t.rows.resize(t.layers.len(), Vec::new()),
                    TapSink::Device { layers, features } => {
                        be.resize(features, n, layers.len() * n_embd);
                    }
                }
                tapped.push((i, t));
            }
        }
        let want = !tapped.is_empty();
        let seq_ix = &ix.seqs;
        let mut capture = |be: &B, s: &mut Scratch<B>, layer: usize| {
            for (seq, t) in &mut tapped {
                for i in 0..t.layers().len() {
                    if t.layers()[i] != layer {
                        continue;
                    }
                    be.copy_rows(&s.x, &seq_ix[*seq].rows, &mut s.tap_rows);
                    match t {
                        TapSink::Host(t) => be.to_host(&s.tap_rows, &mut t.rows[i]),
                        TapSink::Device { features, .. } => {
                            be.put_cols(&s.tap_rows, i * n_embd, features);
                        }
                    }
                }
            }
        };
        let tap: Option<&mut TapFn<'_, B>> = if want { Some(&mut capture) } else { None };
        let hp = &self.hp;
        let total = all_tokens.len();
        let result = self.layers_and_head(be, s, &ix, &ix.pos, tap, &mut |be, s, il| {
            if let MixerSpec::DeltaNet(_) = &hp.layers[il].mixer {
                for (i, (q, qi)) in seqs.iter_mut().zip(seq_ix).enumerate() {
                    let dn = &mut s.dn;
                    be.copy_rows(&dn.mixed, &qi.rows, &mut dn.seq_mixed);
                    be.copy_rows(&dn.alpha, &qi.rows, &mut dn.seq_alpha);
                    be.copy_rows(&dn.beta, &qi.rows, &mut dn.seq_beta);
                    self.delta_rule(
                        be,
                        q.kv,
                        &mut dn.scratch,
                        il,
                        q.pos[0] as usize,
                        &dn.seq_mixed,
                        &dn.seq_alpha,
                        &dn.seq_beta,
                        &mut dn.seq_out,
                    );
                    // Into the batch's rows, on the backend (sized by the first sequence).
                    if i == 0 {
                        let cols = be.shape(&dn.seq_out).1;
                        be.resize(&mut dn.out, total, cols);
                    }
                    be.put_rows(&dn.seq_out, &qi.rows, &mut dn.out);
                }
                return;
            }
            // Every sequence's K/V write and attention, as one op over the batch's rows.
            let own = self.kv_layer(il) == il;
            let mut off = 0;
            let mut att: Vec<SeqAttention<'_, B::Kv, B::Index>> = seqs
                .iter_mut()
                .zip(seq_ix)
                .map(|(q, qi)| {
                    let n = q.tokens.len();
                    let (cells, kv_pos) = qi.cells(q.ring.is_some() && hp.is_swa(il));
                    let a = SeqAttention {
                        kv: &mut *q.kv,
                        rows: off..off + n,
                        row_index: &qi.rows,
                        cells: own.then_some(cells),
                        params: self.attn_params(il, &qi.pos, kv_pos),
                    };
                    off += n;
                    a
                })
                .collect();
            be.attention_seqs(&s.q, &s.k, &s.v, &mut att, &mut s.attn);
        });
        s.ix = Some(ix);
        s.all_tokens = all_tokens;
        s.all_pos = all_pos;
        s.all_logits_rows = all_rows;
        for (i, t) in tapped {
            seqs[i].taps = Some(t);
        }
        result?;
        Ok(&s.host)
    }

    fn check_ring(ring: Option<&Ring<'_>>, n: usize) -> Result<()> {
        match ring {
            Some(r) if r.cells.len() != n || r.cells.iter().any(|&c| c >= r.kv_pos.len()) => {
                Err(ModelError::RingPlacement {
                    rows: r.cells.len(),
                    cells: r.kv_pos.len(),
                    tokens: n,
                })
            }
            _ => Ok(()),
        }
    }

    /// Q, K and V of an attention mixer from `s.cur` into `s.q`, `s.k`, `s.v`: projections,
    /// biases, QK-norm, RoPE at `pos`.
    fn qkv(
        be: &B,
        s: &mut Scratch<B>,
        w: &AttnWeights<B::Weight>,
        a: &AttnSpec,
        eps: f32,
        pos: &B::Index,
    ) {
        if let Some(g) = &w.gate {
            // From the layer's normed input, as the projections.
            g.matmul(be, &s.cur, &mut s.attn_gate);
        }
        if a.gate == Some(AttnGate::QuerySigmoid) {
            // Each head's query, then its gate.
            let hd = a.head_dim_k;
            w.wq.matmul(be, &s.cur, &mut s.qg);
            be.gather_cols(&s.qg, 2 * hd, 0..hd, &mut s.q);
            be.gather_cols(&s.qg, 2 * hd, hd..2 * hd, &mut s.attn_gate);
        } else {
            w.wq.matmul(be, &s.cur, &mut s.q);
        }
        if let Some(b) = &w.bq {
            be.add_vector(&mut s.q, b);
        }
        if let Some(qn) = &w.q_norm {
            be.rms_norm_groups(&mut s.q, a.head_dim_k, qn, eps);
        }
        be.rope(&mut s.q, a.head_dim_k, pos, &a.rope);
        // A KV-shared layer reads K and V from its source's cache.
        let Some(wk) = &w.wk else {
            return;
        };
        wk.matmul(be, &s.cur, &mut s.k);
        match &w.wv {
            Some(wv) => wv.matmul(be, &s.cur, &mut s.v),
            // V is K's projection, before K's norm and RoPE.
            None => {
                let cols = be.shape(&s.k).1;
                be.gather_cols(&s.k, cols, 0..cols, &mut s.v);
            }
        }
        if let Some(b) = &w.bk {
            be.add_vector(&mut s.k, b);
        }
        if let Some(b) = &w.bv {
            be.add_vector(&mut s.v, b);
        }
        if let Some(kn) = &w.k_norm {
            be.rms_norm_groups(&mut s.k, a.head_dim_k, kn, eps);
        }
        if let Some(ones) = &w.v_norm {
            be.rms_norm_groups(&mut s.v, a.head_dim_v, ones, eps);
        }
        be.rope(&mut s.k, a.head_dim_k, pos, &a.rope);
    }

    /// Every layer's input from the scaled token embeddings in `s.x` into `s.inputs.all`:
    /// `(rms_norm(proj · x / √n_embd) + embd[token] · √width) / √2`, normed per layer
    /// (llama.cpp `build_inp_per_layer`, `project_per_layer_inputs`).
    fn per_layer_inputs(
        &self,
        be: &B,
        s: &mut Scratch<B>,
        p: &PerLayerInputs<B::Weight>,
        tokens: &B::Index,
    ) {
        let b = &mut s.inputs;
        #[allow(
            clippy::cast_precision_loss,
            reason = "widths, as llama.cpp converts them"
        )]
        let (width, n_embd) = (p.width as f32, self.hp.n_embd as f32);
        be.get_rows(&p.embd, tokens, &mut b.embd);
        be.scale(&mut b.embd, width.sqrt());
        p.proj.matmul(be, &s.x, &mut b.all);
        be.scale(&mut b.all, 1.0 / n_embd.sqrt());
        be.rms_norm_groups(&mut b.all, p.width, &p.norm, self.hp.rms_eps);
        be.add(&mut b.all, &b.embd);
        be.scale(&mut b.all, 1.0 / 2f32.sqrt());
    }

    /// `x += proj`, through the sandwich norm `post` when the layer has one.
    fn residual(be: &B, s: &mut Scratch<B>, post: Option<&B::Weight>, eps: f32) {
        if let Some(w) = post {
            be.rms_norm(&s.proj, Some(w), eps, &mut s.cur);
            be.add(&mut s.x, &s.cur);
        } else {
            be.add(&mut s.x, &s.proj);
        }
    }

    /// Every token must be a row of the embedding.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let n_vocab = self.hp.n_vocab;
        match tokens.iter().find(|&&t| t as usize >= n_vocab) {
            Some(&token) => Err(ModelError::TokenOutOfVocab { token, n_vocab }),
            None => Ok(()),
        }
    }

    /// Every layer around the attention `attend` computes (from `s.q/k/v` into `s.attn`,
    /// writing the cache), then the output head for the rows `ix.logits` into `s.host`; the
    /// tokens `ix.tokens` (checked) at positions `pos`.
    fn layers_and_head(
        &self,
        be: &B,
        s: &mut Scratch<B>,
        ix: &index::ForwardIndex<B>,
        pos: &B::Index,
        mut tap: Option<&mut TapFn<'_, B>>,
        attend: &mut dyn FnMut(&B, &mut Scratch<B>, usize),
    ) -> Result<()> {
        let hp = &self.hp;
        be.get_rows(&self.tok_embd, &ix.tokens, &mut s.x);
        if let Some(f) = hp.embd_scale {
            be.scale(&mut s.x, f);
        }
        if let Some(p) = &self.inputs {
            self.per_layer_inputs(be, s, p, &ix.tokens);
        }
        for (il, (layer, spec)) in self.layers.iter().zip(&hp.layers).enumerate() {
            if let Some(f) = tap.as_deref_mut() {
                f(be, s, il);
            }
            be.rms_norm(&s.x, Some(&layer.attn_norm), hp.rms_eps, &mut s.cur);
            match (&layer.mixer, &spec.mixer) {
                (Mixer::Attention(w), MixerSpec::Attention(a)) => {
                    Self::qkv(be, s, w, a, hp.rms_eps, pos);
                    attend(be, s, il);
                    match a.gate {
                        Some(AttnGate::QuerySigmoid) => {
                            be.gate_mul(&mut s.attn, &s.attn_gate, GateAct::Sigmoid);
                        }
                        Some(AttnGate::Softplus) => {
                            be.gate_mul(&mut s.attn, &s.attn_gate, GateAct::Softplus);
                        }
                        None => {}
                    }
                    w.wo.matmul(be, &s.attn, &mut s.proj);
                }
                (Mixer::DeltaNet(w), MixerSpec::DeltaNet(d)) => {
                    w.qkv.matmul(be, &s.cur, &mut s.dn.mixed);
                    w.z.matmul(be, &s.cur, &mut s.gate);
                    w.alpha.matmul(be, &s.cur, &mut s.dn.alpha);
                    w.beta.matmul(be, &s.cur, &mut s.dn.beta);
                    attend(be, s, il);
                    // The gated norm: RMS-normed per head, times silu(z).
                    be.rms_norm_groups(&mut s.dn.out, d.head_dim, &w.norm, hp.rms_eps);
                    be.swiglu(&s.gate, &s.dn.out, &mut s.act);
                    w.out.matmul(be, &s.act, &mut s.proj);
                }
                _ => unreachable!("layer {il}: the weights were loaded from this spec"),
            }
            Self::residual(be, s, layer.post_attn_norm.as_ref(), hp.rms_eps);

            be.rms_norm(&s.x, Some(&layer.ffn_norm), hp.rms_eps, &mut s.cur);
            match (&layer.ffn, &spec.ffn) {
                (Ffn::Dense { gate, up, down }, FfnSpec::Dense { act, .. }) => {
                    gate.matmul(be, &s.cur, &mut s.gate);
                    up.matmul(be, &s.cur, &mut s.up);
                    match act {
                        Act::Silu => be.swiglu(&s.gate, &s.up, &mut s.act),
                        Act::GeluTanh => be.geglu(&s.gate, &s.up, &mut s.act),
                    }
                    down.matmul(be, &s.act, &mut s.proj);
                }
                (Ffn::Moe(w), FfnSpec::Moe(m)) => {
                    moe::forward(be, m, w, &s.cur, None, &mut s.moe, &mut s.proj);
                }
                (Ffn::Parallel(w), FfnSpec::Parallel { act, moe: m, .. }) => {
                    // The dense MLP on `ffn_norm(x)` (in `s.cur`), normed.
                    w.gate.matmul(be, &s.cur, &mut s.gate);
                    w.up.matmul(be, &s.cur, &mut s.up);
                    match act {
                        Act::Silu => be.swiglu(&s.gate, &s.up, &mut s.act),
                        Act::GeluTanh => be.geglu(&s.gate, &s.up, &mut s.act),
                    }
                    w.down.matmul(be, &s.act, &mut s.proj);
                    be.rms_norm(&s.proj, Some(&w.post_1), hp.rms_eps, &mut s.par.dense);
                    // The experts on `pre_ffw_norm_2(x)`, routed on `x` RMS-normed, scaled.
                    be.rms_norm(&s.x, Some(&w.pre_2), hp.rms_eps, &mut s.cur);
                    be.rms_norm(&s.x, Some(&w.router_scale), hp.rms_eps, &mut s.par.router);
                    #[allow(
                        clippy::cast_precision_loss,
                        reason = "a hidden size, as llama.cpp converts it"
                    )]
                    be.scale(&mut s.par.router, 1.0 / (hp.n_embd as f32).sqrt());
                    moe::forward(
                        be,
                        m,
                        &w.moe,
                        &s.cur,
                        Some(&s.par.router),
                        &mut s.moe,
                        &mut s.par.experts,
                    );
                    be.rms_norm(&s.par.experts, Some(&w.post_2), hp.rms_eps, &mut s.proj);
                    be.add(&mut s.proj, &s.par.dense);
                }
                _ => unreachable!("layer {il}: the weights were loaded from this spec"),
            }
            Self::residual(be, s, layer.post_ffw_norm.as_ref(), hp.rms_eps);
            if let (Some(w), Some(p)) = (&layer.input, &self.inputs) {
                // x += post_norm(proj(gelu(inp_gate · x) ⊙ the layer's input))
                let b = &mut s.inputs;
                w.gate.matmul(be, &s.x, &mut b.gate);
                let all = p.width * hp.n_layer;
                be.gather_cols(&b.all, all, il * p.width..(il + 1) * p.width, &mut b.slice);
                be.geglu(&b.gate, &b.slice, &mut b.act);
                w.proj.matmul(be, &b.act, &mut s.proj);
                Self::residual(be, s, Some(&w.post_norm), hp.rms_eps);
            }
            if let Some(f) = layer.out_scale {
                be.scale(&mut s.x, f);
            }
        }
        if let Some(f) = tap {
            f(be, s, hp.n_layer);
        }

        s.ids.clear();
        if be.index_len(&ix.logits) == 0 {
            s.host.clear();
            return Ok(());
        }
        be.copy_rows(&s.x, &ix.logits, &mut s.sel);
        be.rms_norm(&s.sel, Some(&self.output_norm), hp.rms_eps, &mut s.norm);
        let head = Linear {
            w: self.output.as_ref().unwrap_or(&self.tok_embd).as_ref(),
            scale: self.output_scale,
        };
        head.matmul(be, &s.norm, &mut s.logits);
        if let Some(c) = hp.final_softcap {
            be.softcap(&mut s.logits, c);
        }
        if s.argmax {
            be.argmax_rows(&s.logits, &mut s.ids);
            s.host.clear();
        } else {
            be.to_host(&s.logits, &mut s.host);
        }
        Ok(())
    }
}

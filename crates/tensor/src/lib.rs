//! The op set every device implements, and the host-side descriptions models hand to it.
//!
//! Models are written once against [`Backend`] and run unchanged on the CPU backend
//! (`specula-cpu`) and, later, the CubeCL backend (`kernels/`). A backend owns three kinds of
//! device objects:
//!
//! - [`Backend::Tensor`] — an f32 activation matrix, row-major `[rows, cols]`; one row per
//!   token of the batch.
//! - [`Backend::Weight`] — a weight in its GGUF block format ([`QType`]), created from a
//!   [`WeightDesc`] that borrows the bytes of the memory-mapped file; never dequantized
//!   wholesale at load.
//! - [`Backend::Kv`] — the key/value cache of all layers, in the [`QType`]s chosen for K and V.
//!
//! **Batch invariance.** Every op must give, for one row, bit-identical results whether that
//! row is computed alone (decode) or inside a batch (prefill, speculative verification): the
//! reduction along the inner dimension runs in one fixed order, and batching only tiles over
//! rows and output columns. Speculative decoding relies on this to reproduce plain greedy
//! output exactly.
//!
//! ```
//! use specula_tensor::{RopeConfig, RopeKind};
//! let rope = RopeConfig::new(RopeKind::Neox, 64, 1e6);
//! assert_eq!(rope.n_rot, 64);
//! ```

use std::sync::Arc;

pub use specula_quant::QType;

pub mod timeline;
pub use timeline::{StateSource, StateTimeline};

/// Errors a backend reports.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// A weight in a format this backend cannot use for the op.
    #[error("weight `{name}`: format {ty} is not supported by the {backend} backend for {op}")]
    UnsupportedWeight {
        /// Tensor name.
        name: String,
        /// Its format.
        ty: QType,
        /// Backend name.
        backend: &'static str,
        /// What it would be used for.
        op: &'static str,
    },
    /// Something this backend cannot do (yet): a cache format, a layer kind.
    #[error("the {backend} backend does not support {what}")]
    Unsupported {
        /// Backend name.
        backend: &'static str,
        /// What was asked for.
        what: String,
    },
    /// Shapes that do not fit together.
    #[error("{op}: shape mismatch: {detail}")]
    Shape {
        /// The op.
        op: &'static str,
        /// What does not fit.
        detail: String,
    },
    /// A weight whose byte length does not match its type and shape.
    #[error("weight `{name}`: {got} bytes, its type {ty} and shape {dims:?} need {expected}")]
    WeightSize {
        /// Tensor name.
        name: String,
        /// Format.
        ty: QType,
        /// Shape (`ne0` first).
        dims: Vec<usize>,
        /// Bytes expected.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// An error of the KV cache (a `specula_kv::KvError`: this crate sits below `specula-kv`,
    /// so it keeps the error as its source, whole).
    #[error(transparent)]
    Kv(Box<dyn std::error::Error + Send + Sync>),
    /// A block-format error from `specula-quant`.
    #[error(transparent)]
    Quant(#[from] specula_quant::QuantError),
}

/// Result alias.
pub type Result<T, E = TensorError> = std::result::Result<T, E>;

/// What [`Backend::argmax_rows`] gives a row with no value above −∞ (every one NaN or −∞).
pub const NO_ARGMAX: u32 = u32::MAX;

/// The index of the largest value of `row`, the lowest among equal maxima; NaN and −∞ never
/// win, and a row of nothing else gives [`NO_ARGMAX`] ([`Backend::argmax_rows`] of one row).
#[must_use]
pub fn argmax_row(row: &[f32]) -> u32 {
    // The maximum in sixteen independent lanes (it vectorises; NaN never wins), then the
    // first position holding it.
    let mut lanes = [f32::NEG_INFINITY; 16];
    let (chunks, tail) = row.as_chunks::<16>();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            // `max` keeps the lane when `v` is NaN: one vector max per chunk.
            *l = l.max(v);
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    if max == f32::NEG_INFINITY {
        return NO_ARGMAX;
    }
    // The first chunk holding the maximum (a compare per chunk that vectorises), then its
    // first position.
    let at = chunks
        .iter()
        .position(|c| c.iter().fold(false, |hit, &v| hit | (v == max)))
        .map_or(chunks.len() * 16, |ci| ci * 16);
    row[at..]
        .iter()
        .position(|&v| v == max)
        .and_then(|i| u32::try_from(at + i).ok())
        .unwrap_or(NO_ARGMAX)
}

/// [`argmax_row`] and the softmax probability of that maximum, `1 / Σ exp(x − max)` (each
/// `exp` in f32, summed in f64 in column order; NaN counts for nothing): a drafter's top-1
/// and how sure it is ([`Backend::top1_rows`] of one row). A row with no winner gives
/// ([`NO_ARGMAX`], 0).
#[must_use]
pub fn top1_row(row: &[f32]) -> (u32, f32) {
    let id = argmax_row(row);
    if id == NO_ARGMAX {
        return (NO_ARGMAX, 0.0);
    }
    let max = row[id as usize];
    let sum: f64 = row
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| f64::from((x - max).exp()))
        .sum();
    #[allow(
        clippy::cast_possible_truncation,
        reason = "a probability in [0, 1] as f32"
    )]
    let p = (1.0 / sum) as f32;
    (id, p)
}

/// `f32` bits as a key whose unsigned order is [`f32::total_cmp`]'s (−NaN < −∞ < … < −0 < +0
/// < … < +∞ < +NaN).
#[must_use]
pub fn total_order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b >> 31 == 1 { !b } else { b | 0x8000_0000 }
}

/// Appends the `k` largest values of `row` to `ids` and `vals`, from the largest, in
/// [`f32::total_cmp`] order with equal values by lower column first (all of them when the row
/// has fewer): a drafter's candidates ([`Backend::topk_rows`] of one row).
pub fn topk_row(row: &[f32], k: usize, ids: &mut Vec<u32>, vals: &mut Vec<f32>) {
    let mut idx: Vec<u32> = (0..u32::try_from(row.len()).unwrap_or(u32::MAX)).collect();
    let cmp = |x: &u32, y: &u32| row[*y as usize].total_cmp(&row[*x as usize]).then(x.cmp(y));
    let k = k.min(idx.len());
    if k == 0 {
        return;
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    vals.extend(idx.iter().map(|&i| row[i as usize]));
    ids.extend(idx);
}

/// DFlash2's grouped dynamic causal convolution inside one block of `n` rows of `e` values:
/// `out[i][c] = Σ_{t < min(kernel, i + 1)} (base[side][t][c] + dynamic[i][side][t][c / group])
/// · x[i − t][c]`, summed in `t` order from 0, rows before the block read as zero (Inco AI /
/// z-lab `GroupedDynamicCausalConv`). `base` is `[2][kernel][e]`, `dynamic` `[n][2][kernel]
/// [e / group]` ([`Backend::block_conv`] on the host).
pub fn block_conv_rows(
    x: &[f32],
    dynamic: &[f32],
    base: &[f32],
    side: usize,
    (e, kernel, group): (usize, usize, usize),
    out: &mut Vec<f32>,
) {
    let n = x.len() / e.max(1);
    let groups = e / group.max(1);
    let per_row = 2 * kernel * groups;
    out.clear();
    out.resize(n * e, 0.0);
    for i in 0..n {
        let dy = &dynamic[i * per_row + side * kernel * groups..];
        for t in 0..kernel.min(i + 1) {
            let src = &x[(i - t) * e..(i - t + 1) * e];
            let b = &base[(side * kernel + t) * e..(side * kernel + t + 1) * e];
            let o = &mut out[i * e..(i + 1) * e];
            for c in 0..e {
                o[c] += (b[c] + dy[t * groups + c / group]) * src[c];
            }
        }
    }
}

/// How a mixture of experts weighs its experts ([`Backend::moe_route`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeRoute {
    /// Experts per row.
    pub n_used: usize,
    /// Each expert's score is the sigmoid of its logit (else a softmax over the row).
    pub sigmoid: bool,
    /// The chosen experts' weights are divided by their sum.
    pub norm: bool,
    /// Every weight is multiplied by this (`expert_weights_scale`; 1 for none).
    pub scale: f32,
}

/// A mixture's experts for [`Backend::moe_ffn`]: each projection's weights by expert id
/// (views of one stack, [`Backend::weight_views`]) and its per-expert scales where the file has
/// them.
#[derive(Debug)]
pub struct MoeExperts<'a, W> {
    /// `ffn_gate_exps`, one matrix per expert.
    pub gate: &'a [W],
    /// `ffn_up_exps`.
    pub up: &'a [W],
    /// `ffn_down_exps`.
    pub down: &'a [W],
    /// The gate projection's scale per expert.
    pub gate_scales: Option<&'a [f32]>,
    /// The up projection's.
    pub up_scales: Option<&'a [f32]>,
    /// The down projection's.
    pub down_scales: Option<&'a [f32]>,
    /// GeGLU (tanh GELU of the gate) rather than SwiGLU.
    pub geglu: bool,
}

/// Routes one row of router logits `x` ([`Backend::moe_route`] on the host): each expert's
/// score (softmax over the row: `m` the maximum, `e^(x − m)` each, times `1 / Σ` summed in
/// expert order; or the sigmoid `1 / (1 + e^−x)`); the `n_used` experts of highest selection
/// score (the score plus `bias`, where given) in [`f32::total_cmp`] order, equal ones by lower
/// expert first; each one's weight its score, divided by the chosen scores' sum (added in
/// selection order) when `p.norm`, times `p.scale`. Appends the chosen experts to `ids` and
/// their weights to `w` by increasing expert id. `scratch` is reused between rows.
pub fn route_row(
    x: &[f32],
    p: &MoeRoute,
    bias: Option<&[f32]>,
    scratch: &mut Vec<f32>,
    ids: &mut Vec<u32>,
    w: &mut Vec<f32>,
) {
    let probs = scratch;
    probs.clear();
    if p.sigmoid {
        probs.extend(x.iter().map(|&v| 1.0 / (1.0 + (-v).exp())));
    } else {
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        probs.extend(x.iter().map(|&v| (v - m).exp()));
        let sum: f32 = probs.iter().sum();
        let inv = 1.0 / sum;
        for v in probs.iter_mut() {
            *v *= inv;
        }
    }
    let sel = |e: usize| probs[e] + bias.map_or(0.0, |b| b[e]);
    // `n_used` passes, each taking the first expert after the previous pick in (selection
    // score descending by `total_cmp`, expert ascending) order: no sort and no allocation
    // per row of a decode step.
    let k = p.n_used.min(x.len());
    let start = ids.len();
    let mut prev: Option<(f32, usize)> = None;
    let mut sum = 0.0f32;
    for _ in 0..k {
        let mut best: Option<(f32, usize)> = None;
        for e in 0..x.len() {
            let v = sel(e);
            let after = prev.is_none_or(|(pv, pe)| v.total_cmp(&pv).then(pe.cmp(&e)).is_lt());
            if after && best.is_none_or(|(bv, _)| v.total_cmp(&bv).is_gt()) {
                best = Some((v, e));
            }
        }
        let Some((_, e)) = best else { break };
        sum += probs[e];
        ids.push(u32::try_from(e).unwrap_or(u32::MAX));
        prev = best;
    }
    for i in start..ids.len() {
        let mut v = probs[ids[i] as usize];
        if p.norm {
            v /= sum;
        }
        w.push(v * p.scale);
    }
    // By increasing expert id (an insertion sort of `n_used` pairs): the order
    // [`Backend::moe_combine`] adds them in.
    for i in start + 1..ids.len() {
        let mut j = i;
        while j > start && ids[j - 1] > ids[j] {
            ids.swap(j - 1, j);
            w.swap(j - 1, j);
            j -= 1;
        }
    }
}

/// Memory that weights can borrow from for as long as they live (a model file's memory map, a
/// test's byte vector). It must return the same bytes on every call.
pub trait ByteSource: Send + Sync {
    /// All the bytes.
    fn bytes(&self) -> &[u8];

    /// A hint that `range` of the bytes will not be read soon (a backend copied them), so
    /// memory that holds them may be given back to the OS; they stay readable (a memory map
    /// reads them again from the page cache). The default does nothing.
    fn release(&self, range: std::ops::Range<usize>) {
        let _ = range;
    }
}

impl ByteSource for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// A weight as it lies in the model file: what a backend needs to make a [`Backend::Weight`].
#[derive(Clone)]
pub struct WeightDesc<'a> {
    /// Tensor name (for errors).
    pub name: &'a str,
    /// Block format.
    pub ty: QType,
    /// Dimensions in ggml order: `dims[0]` is the row length (the reduction dimension of a
    /// matmul), `dims[1]` the number of rows (output features). Vectors have one dim.
    pub dims: &'a [usize],
    /// The bytes, borrowed from `owner` (usually the memory map of the file).
    pub data: &'a [u8],
    /// Where `data` lives: a backend that does not copy the bytes keeps this and the range
    /// of `data` inside it ([`WeightDesc::range_in_owner`]), and re-borrows safely.
    pub owner: Arc<dyn ByteSource>,
}

impl WeightDesc<'_> {
    /// The position of `data` inside `owner.bytes()`.
    ///
    /// # Errors
    /// [`TensorError::Shape`] if `data` does not lie inside the owner's bytes.
    pub fn range_in_owner(&self) -> Result<std::ops::Range<usize>> {
        let all = self.owner.bytes();
        let base = all.as_ptr().addr();
        let start = self.data.as_ptr().addr().wrapping_sub(base);
        let end = start.wrapping_add(self.data.len());
        if self.data.as_ptr().addr() < base || start > end || end > all.len() {
            return Err(TensorError::Shape {
                op: "weight",
                detail: format!("the bytes of `{}` do not lie inside their owner", self.name),
            });
        }
        Ok(start..end)
    }

    /// `(n_in, n_rows)` of this matrix, with every range of `rows` inside its rows: what
    /// [`Backend::weight_views`] checks before it makes any view.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when `dims` is not a matrix's or a range is past its rows.
    pub fn view_rows(&self, rows: &[std::ops::Range<usize>]) -> Result<(usize, usize)> {
        let &[n_in, n_rows] = self.dims else {
            return Err(TensorError::Shape {
                op: "weight_views",
                detail: format!("`{}` has dims {:?}, not a matrix", self.name, self.dims),
            });
        };
        if let Some(r) = rows.iter().find(|r| r.start > r.end || r.end > n_rows) {
            return Err(TensorError::Shape {
                op: "weight_views",
                detail: format!("rows {r:?} of `{}`, which has {n_rows} rows", self.name),
            });
        }
        Ok((n_in, n_rows))
    }
}

impl std::fmt::Debug for WeightDesc<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightDesc")
            .field("name", &self.name)
            .field("ty", &self.ty)
            .field("dims", &self.dims)
            .field("bytes", &self.data.len())
            .finish_non_exhaustive()
    }
}

/// Which pairs of a head RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    /// Adjacent pairs `(2i, 2i + 1)` (llama.cpp `LLAMA_ROPE_TYPE_NORM`; llama).
    Normal,
    /// Halves `(i, i + n_rot/2)` (`LLAMA_ROPE_TYPE_NEOX`; qwen2, qwen3, gemma).
    Neox,
}

/// YaRN context extension parameters (`rope.scaling.*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// Context length the model was trained with.
    pub orig_ctx: usize,
    /// Extrapolation mix factor (`ext_factor`).
    pub ext_factor: f32,
    /// Attention magnitude factor.
    pub attn_factor: f32,
    /// Correction range start (`beta_fast`).
    pub beta_fast: f32,
    /// Correction range end (`beta_slow`).
    pub beta_slow: f32,
}

/// Rotary position embedding of one model.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// Pairing of dimensions.
    pub kind: RopeKind,
    /// Rotated dimensions per head (≤ head_dim; the rest pass through — partial RoPE).
    pub n_rot: usize,
    /// θ (`rope.freq_base`).
    pub freq_base: f32,
    /// Linear position scaling (`1 / rope.scaling.factor`), 1.0 when unscaled.
    pub freq_scale: f32,
    /// YaRN, when the model uses it.
    pub yarn: Option<Yarn>,
    /// Per rotated pair `i`, a divisor of its frequency (`rope_freqs`, ggml's
    /// `freq_factors`): Gemma 4's proportional RoPE gives the pairs it does not rotate `1e30`.
    pub freq_factors: Option<std::sync::Arc<[f32]>>,
}

impl RopeConfig {
    /// Plain RoPE with no scaling.
    #[must_use]
    pub fn new(kind: RopeKind, n_rot: usize, freq_base: f32) -> Self {
        Self {
            kind,
            n_rot,
            freq_base,
            freq_scale: 1.0,
            yarn: None,
            freq_factors: None,
        }
    }
}

/// Which keys a query may attend to. Positions are absolute token positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    /// Keys at positions `≤` the query's.
    Causal,
    /// Causal, and only the last `window` positions (`pos_q − pos_k < window`).
    SlidingWindow(usize),
    /// Every key in the cache (drafter blocks, encoders).
    None,
}

/// Cache formats of a range of layers that differ from the cache's `k_type` / `v_type`
/// (`--cache-type-k-layers 0-3:q8_0`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerOverride {
    /// First layer of the range.
    pub first: usize,
    /// Last layer of the range (inclusive).
    pub last: usize,
    /// Format of K in these layers, when it differs.
    pub k: Option<QType>,
    /// Format of V in these layers, when it differs.
    pub v: Option<QType>,
}

/// Shape of the KV cache a model asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Layers.
    pub n_layer: usize,
    /// Cells (the context size).
    pub n_ctx: usize,
    /// K/V heads per layer.
    pub n_kv_head: usize,
    /// Values per K head.
    pub head_dim_k: usize,
    /// Values per V head.
    pub head_dim_v: usize,
    /// Format of K.
    pub k_type: QType,
    /// Format of V.
    pub v_type: QType,
    /// Per-layer formats that differ from `k_type` / `v_type`; a later entry wins where
    /// ranges overlap. Empty: every layer uses `k_type` / `v_type`.
    pub overrides: Vec<LayerOverride>,
    /// Layers that keep fewer cells than `n_ctx` (sliding-window layers holding a ring of the
    /// last positions, llama.cpp's SWA cache); `None`: every layer has `n_ctx` cells.
    pub swa: Option<SwaCells>,
    /// Layers whose memory is a recurrent state rather than K/V cells (gated delta-net);
    /// `None`: every layer attends.
    pub recurrent: Option<RecurrentLayers>,
    /// Per layer: its K/V heads and head sizes, where layers differ (Gemma 4's global layers
    /// have fewer, wider heads than its sliding ones); empty: `n_kv_head`, `head_dim_k`,
    /// `head_dim_v` in every layer.
    pub heads: Vec<LayerHeads>,
    /// Per layer: the earlier layer whose cells it attends over instead of keeping its own
    /// (Gemma 4's KV-shared layers; `None`: its own cells); empty: every layer keeps its own.
    /// A shared layer has no cells and is never written.
    pub shared: Vec<Option<usize>>,
}

/// The K/V heads of one layer of a cache ([`KvShape::heads`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerHeads {
    /// K/V heads.
    pub n_kv_head: usize,
    /// Values per K head.
    pub head_dim_k: usize,
    /// Values per V head.
    pub head_dim_v: usize,
}

/// The recurrent layers of a cache and the snapshots each keeps.
///
/// A recurrent layer folds every row it sees into a fixed-size state, so dropping rows cannot
/// give the earlier state back. Each layer therefore keeps, besides its current state, the state
/// before the latest forward and the states after each of that forward's last `snapshots` rows:
/// a later forward that starts at one of those positions (a verify batch whose draft tail was
/// rejected) continues from the kept state — selecting a snapshot instead of replaying. A
/// forward starting at position 0 starts from the zero state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecurrentLayers {
    /// Per layer: its recurrent state, or `None` for a layer with K/V cells.
    pub layers: Vec<Option<RecurrentShape>>,
    /// States kept after the last rows of a forward (0: only the state before it).
    pub snapshots: usize,
}

/// The state of one gated delta-net layer (Qwen3.5 / Qwen3-Next linear attention): the
/// causal convolution's last `conv_kernel − 1` inputs of `conv_channels` values, and one
/// `head_dim × head_dim` f32 matrix per value head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecurrentShape {
    /// Taps of the causal depthwise convolution.
    pub conv_kernel: usize,
    /// Channels it convolves (Q, K and V side by side).
    pub conv_channels: usize,
    /// Key heads (a divisor of `n_head_v`; value head `h` reads key head `h % n_head_k`, or
    /// `h / (n_head_v / n_head_k)` when `grouped`).
    pub n_head_k: usize,
    /// Value heads (one state matrix each).
    pub n_head_v: usize,
    /// Values per key and per value head.
    pub head_dim: usize,
    /// Value heads grouped by key head (Qwen3-Next) rather than tiled over them (Qwen3.5).
    pub grouped: bool,
}

impl RecurrentShape {
    /// f32 values of the convolution state.
    #[must_use]
    pub fn conv_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_channels
    }

    /// f32 values of the delta-rule state.
    #[must_use]
    pub fn state_len(&self) -> usize {
        self.n_head_v * self.head_dim * self.head_dim
    }
}

/// The activation of a multiplicative gate ([`Backend::gate_mul`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateAct {
    /// `σ(g) = 1 / (1 + e^{−g})`.
    Sigmoid,
    /// `softplus(g) = ln(1 + e^g)` (`g` itself past 20, as ggml computes it).
    Softplus,
}

/// The per-row inputs of a gated delta-rule step, as [`Backend::gated_delta_net`] reads them.
#[derive(Clone, Copy, Debug)]
pub struct DeltaNetParams {
    /// Layer index into the cache (a recurrent layer).
    pub layer: usize,
    /// Position of the batch's first row: the state continues from what the layer kept for
    /// that position.
    pub pos0: usize,
    /// RMS-norm epsilon of the L2 normalization of Q and K (`x / √(Σx² + eps)`).
    pub eps: f32,
}

/// The sliding-window layers of a cache that keep a ring of `n_cells` cells instead of
/// `n_ctx`: position `p` lives in cell `p % n_cells`, and the caller passes the ring laid out
/// in position order as `kv_pos` to [`Backend::attention`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwaCells {
    /// Cells of each ring.
    pub n_cells: usize,
    /// Per layer: whether it keeps the ring (else `n_ctx` cells).
    pub layers: Vec<bool>,
}

impl KvShape {
    /// A cache whose every layer has `n_ctx` cells of `n_kv_head` heads of `head_dim` values
    /// for K and V, in `k_type` / `v_type` (no overrides, rings, recurrent layers or per-layer
    /// heads).
    #[must_use]
    pub fn uniform(
        n_layer: usize,
        n_ctx: usize,
        n_kv_head: usize,
        head_dim: usize,
        k_type: QType,
        v_type: QType,
    ) -> Self {
        Self {
            n_layer,
            n_ctx,
            n_kv_head,
            head_dim_k: head_dim,
            head_dim_v: head_dim,
            k_type,
            v_type,
            overrides: Vec::new(),
            swa: None,
            recurrent: None,
            heads: Vec::new(),
            shared: Vec::new(),
        }
    }

    /// The K and V formats of layer `l`.
    #[must_use]
    pub fn layer_types(&self, l: usize) -> (QType, QType) {
        let (mut k, mut v) = (self.k_type, self.v_type);
        for o in &self.overrides {
            if (o.first..=o.last).contains(&l) {
                k = o.k.unwrap_or(k);
                v = o.v.unwrap_or(v);
            }
        }
        (k, v)
    }

    /// The K/V heads of layer `l` ([`KvShape::heads`], else the cache-wide ones).
    #[must_use]
    pub fn layer_heads(&self, l: usize) -> LayerHeads {
        self.heads.get(l).copied().unwrap_or(LayerHeads {
            n_kv_head: self.n_kv_head,
            head_dim_k: self.head_dim_k,
            head_dim_v: self.head_dim_v,
        })
    }

    /// Whether layer `l` keeps a recurrent state ([`KvShape::recurrent`]) instead of cells.
    #[must_use]
    pub fn is_recurrent(&self, l: usize) -> bool {
        self.recurrent
            .as_ref()
            .is_some_and(|r| r.layers.get(l).is_some_and(Option::is_some))
    }

    /// The layer whose cells layer `l` attends over ([`KvShape::shared`]), when not its own.
    #[must_use]
    pub fn shared_source(&self, l: usize) -> Option<usize> {
        self.shared.get(l).copied().flatten()
    }

    /// Cells of layer `l`: none for a recurrent layer or one that reads another layer's
    /// ([`KvShape::shared`]), the ring's for a sliding-window layer of [`KvShape::swa`], else
    /// `n_ctx`.
    #[must_use]
    pub fn layer_cells(&self, l: usize) -> usize {
        if self.is_recurrent(l) || self.shared_source(l).is_some() {
            return 0;
        }
        match &self.swa {
            Some(w) if w.layers.get(l).copied().unwrap_or(false) => w.n_cells,
            _ => self.n_ctx,
        }
    }
}

/// One attention call: `n_head` query heads over the cache cells of `layer`. The positions are
/// index tensors of the backend ([`Backend::Index`]) in [`Backend::attention`], host slices
/// (the default `I`) inside a backend's own kernels.
#[derive(Debug)]
pub struct AttentionParams<'a, I: ?Sized = [u32]> {
    /// Layer index into the cache: the layer whose cells are read (for a KV-shared layer, its
    /// source, [`KvShape::shared`]).
    pub layer: usize,
    /// Query heads (a multiple of the cache's K/V heads: grouped-query attention).
    pub n_head: usize,
    /// Position of each query row.
    pub q_pos: &'a I,
    /// Position of each cache cell `0..kv_len` (cells past `kv_len` are not read; in a ring,
    /// entry `j` is cell `j % cells`, see [`Backend::attention`]).
    pub kv_pos: &'a I,
    /// Score scale, usually `1/√head_dim`.
    pub scale: f32,
    /// Mask rule.
    pub mask: Mask,
    /// Logit soft-capping (`tanh(x/c)·c`), when the model uses it.
    pub softcap: Option<f32>,
}

impl<I: ?Sized> Clone for AttentionParams<'_, I> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<I: ?Sized> Copy for AttentionParams<'_, I> {}

impl<'a, I: ?Sized> AttentionParams<'a, I> {
    /// The same call with the positions `q_pos` and `kv_pos` (a backend's index tensors read
    /// as its kernels want them).
    #[must_use]
    pub fn with_positions<J: ?Sized>(&self, q_pos: &'a J, kv_pos: &'a J) -> AttentionParams<'a, J> {
        AttentionParams {
            layer: self.layer,
            n_head: self.n_head,
            q_pos,
            kv_pos,
            scale: self.scale,
            mask: self.mask,
            softcap: self.softcap,
        }
    }
}

/// One sequence of a batch's attention ([`Backend::attention_seqs`]): consecutive rows of the
/// batch that attend over the sequence's own cache. `Kv` and `I` are a backend's
/// [`Backend::Kv`] and [`Backend::Index`].
#[derive(Debug)]
pub struct SeqAttention<'a, Kv, I: ?Sized> {
    /// The sequence's cache.
    pub kv: &'a mut Kv,
    /// Its rows of the batch (of `q`, `k`, `v` and the output).
    pub rows: std::ops::Range<usize>,
    /// The same rows as an index tensor, for a backend that gathers them.
    pub row_index: &'a I,
    /// The cells its K and V rows are written to before it attends (layer `params.layer`),
    /// or `None` when the layer reads cells another layer wrote (K/V sharing).
    pub cells: Option<&'a I>,
    /// Its attention: the layer read, the heads, its rows' and its cells' positions, the mask.
    pub params: AttentionParams<'a, I>,
}

/// The op set. Shapes are `[rows, cols]` of f32 activations; weights are `[n_out, n_in]` in
/// ggml order `dims = [n_in, n_out]`. Ops write into caller-provided outputs so a forward pass
/// can reuse its buffers across tokens.
pub trait Backend: Send + Sync {
    /// An f32 activation matrix on the device.
    type Tensor: Send + Sync + 'static;
    /// A weight (matrix or vector) in its block format.
    type Weight: Send + Sync;
    /// The KV cache of all layers.
    type Kv: Send + Sync;
    /// A vector of `u32` indices on the device: token ids, positions, cache cells, row
    /// numbers. A forward builds each of its index tensors once from the host and every layer
    /// and op that reads them shares it, so a layer uploads nothing.
    type Index: Send + Sync + std::fmt::Debug + 'static;
    /// A mixture of experts' routing of a batch on the device ([`Backend::moe_route`]): each
    /// row's experts and their weights.
    type Routes: Send + Sync + std::fmt::Debug + 'static;

    /// A short name (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    /// Makes a weight from file bytes (may keep `desc.owner` and borrow, or copy to the
    /// device).
    ///
    /// # Errors
    /// If the byte length does not match type and shape, or the format is unsupported.
    fn weight(&self, desc: WeightDesc<'_>) -> Result<Self::Weight>;

    /// Tells the backend that `w` is a matrix the model multiplies by (`matmul`), so that it
    /// may rearrange it for its matmul kernels (the CPU backend packs rows for its
    /// micro-kernels); `get_rows` keeps working on it. Weights only gathered by `get_rows` (an
    /// untied token embedding) are not passed here. The default does nothing.
    fn prepare_matmul(&self, w: &mut Self::Weight) {
        let _ = w;
    }

    /// A zeroed `[rows, cols]` tensor.
    fn zeros(&self, rows: usize, cols: usize) -> Self::Tensor;
    /// A tensor holding `data` (row-major, `rows · cols` values).
    #[allow(
        clippy::wrong_self_convention,
        reason = "the backend (self) makes the tensor from host data"
    )]
    fn from_host(&self, rows: usize, cols: usize, data: &[f32]) -> Self::Tensor;
    /// Copies a tensor to the host.
    fn to_host(&self, t: &Self::Tensor, out: &mut Vec<f32>);
    /// `(rows, cols)` of a tensor.
    fn shape(&self, t: &Self::Tensor) -> (usize, usize);
    /// An index tensor holding `v` (one upload).
    fn index(&self, v: &[u32]) -> Self::Index;
    /// Makes `i` hold `v` (one upload; storage reused where the backend can).
    fn set_index(&self, i: &mut Self::Index, v: &[u32]) {
        *i = self.index(v);
    }
    /// The number of indices `i` holds.
    fn index_len(&self, i: &Self::Index) -> usize;
    /// An index tensor holding `r` (rows `r` of a tensor; one upload).
    fn index_range(&self, r: std::ops::Range<usize>) -> Self::Index {
        let v: Vec<u32> = r.map(|i| u32::try_from(i).unwrap_or(u32::MAX)).collect();
        self.index(&v)
    }
    /// Changes the number of rows of `t` (reusing its storage when it is large enough); the
    /// contents become unspecified.
    fn resize(&self, t: &mut Self::Tensor, rows: usize, cols: usize);

    /// `out[r]` = the column of the largest value of row `r` of `x`, the lowest among equal
    /// maxima; NaN and −∞ never win, and a row of nothing else gives [`NO_ARGMAX`]
    /// (llama.cpp's greedy sampler, `specula_sampling::steps::argmax`). Only the indices
    /// reach the host: greedy decoding and greedy verification read a row's argmax without
    /// downloading its logits. The default downloads `x` and scans it on the host.
    fn argmax_rows(&self, x: &Self::Tensor, out: &mut Vec<u32>) {
        let (rows, cols) = self.shape(x);
        let mut host = Vec::with_capacity(rows * cols);
        self.to_host(x, &mut host);
        out.clear();
        out.extend(host.chunks_exact(cols.max(1)).take(rows).map(argmax_row));
    }

    /// `ids[r]`, `probs[r]` = [`top1_row`] of row `r` of `x` (both cleared first): a
    /// drafter's top-1 token of each draft row and its probability, without the rows reaching
    /// the host. Backends sum the probability's denominator in their own order (within
    /// rounding of the reference). The default downloads `x` and scans it on the host.
    fn top1_rows(&self, x: &Self::Tensor, ids: &mut Vec<u32>, probs: &mut Vec<f32>) {
        let (rows, cols) = self.shape(x);
        let mut host = Vec::with_capacity(rows * cols);
        self.to_host(x, &mut host);
        ids.clear();
        probs.clear();
        for row in host.chunks_exact(cols.max(1)).take(rows) {
            let (id, p) = top1_row(row);
            ids.push(id);
            probs.push(p);
        }
    }

    /// `ids`, `vals` (both cleared first) = [`topk_row`] of every row of `x`, `min(k, cols)`
    /// per row, row after row: DFlash2's candidates without the logits rows reaching the host.
    /// The default downloads `x` and scans it on the host.
    fn topk_rows(&self, x: &Self::Tensor, k: usize, ids: &mut Vec<u32>, vals: &mut Vec<f32>) {
        let (rows, cols) = self.shape(x);
        let mut host = Vec::with_capacity(rows * cols);
        self.to_host(x, &mut host);
        ids.clear();
        vals.clear();
        for row in host.chunks_exact(cols.max(1)).take(rows) {
            topk_row(row, k, ids, vals);
        }
    }

    /// `out` = [`block_conv_rows`] of the rows of `x` (`[n, e]`, one block) with `dynamic`
    /// (`[n, 2 · kernel · e / group]`) and `base` (`[2 · kernel, e]`) on `side` (0: before a
    /// sublayer, 1: after it): DFlash2's convolutions on the backend. The default computes
    /// on the host.
    #[allow(
        clippy::too_many_arguments,
        reason = "the convolution's operands and shape"
    )]
    fn block_conv(
        &self,
        x: &Self::Tensor,
        dynamic: &Self::Tensor,
        base: &Self::Tensor,
        side: usize,
        kernel: usize,
        group: usize,
        out: &mut Self::Tensor,
    ) {
        let (rows, e) = self.shape(x);
        let (mut hx, mut hd, mut hb, mut ho) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        self.to_host(x, &mut hx);
        self.to_host(dynamic, &mut hd);
        self.to_host(base, &mut hb);
        block_conv_rows(&hx, &hd, &hb, side, (e, kernel, group), &mut ho);
        *out = self.from_host(rows, e, &ho);
    }

    /// `out[i] = src[rows[i]]`: gathers rows (e.g. the rows whose logits are wanted).
    fn copy_rows(&self, src: &Self::Tensor, rows: &Self::Index, out: &mut Self::Tensor);
    /// `dst[rows[i]] = src[i]`: scatters rows into a tensor of the same width, leaving its
    /// other rows as they are (one sequence's attention output into the batch's, with no
    /// trip through the host). `rows` are distinct and below `dst`'s row count.
    fn put_rows(&self, src: &Self::Tensor, rows: &Self::Index, dst: &mut Self::Tensor);
    /// `dst[r][col0 .. col0 + src.cols] = src[r]` for every row (`dst` has `src`'s row count):
    /// writes `src` into a column range of `dst`, leaving `dst`'s other columns as they are —
    /// a captured hidden state into its place in the rows of a feature drafter's input,
    /// without a trip through the host.
    fn put_cols(&self, src: &Self::Tensor, col0: usize, dst: &mut Self::Tensor);
    /// `x = 0` where `x` is NaN, else `x` clamped to `[−limit, limit]` (llama.cpp's guard on
    /// target features before a drafter reads them: massive activations must not poison a
    /// draft cache through f16 staging).
    fn clamp_finite(&self, x: &mut Self::Tensor, limit: f32);
    /// `out[r] = table[ids[r]]` (dequantized embedding rows).
    fn get_rows(&self, table: &Self::Weight, ids: &Self::Index, out: &mut Self::Tensor);
    /// `out = x · wᵀ`: `x` is `[rows, n_in]`, `out` is `[rows, n_out]`.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight, out: &mut Self::Tensor);
    /// `x[r] += b` for every row (bias).
    fn add_vector(&self, x: &mut Self::Tensor, b: &Self::Weight);
    /// `out[r] = x[r] / rms(x[r]) · w` per row (`w` may be absent: no scaling).
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: Option<&Self::Weight>,
        eps: f32,
        out: &mut Self::Tensor,
    );
    /// RMS-normalises each `group`-sized slice of every row in place and multiplies by `w`
    /// (length `group`): QK-norm per head.
    fn rms_norm_groups(&self, x: &mut Self::Tensor, group: usize, w: &Self::Weight, eps: f32);
    /// Rotates each `head_dim` slice of row `r` by position `pos[r]`.
    fn rope(&self, x: &mut Self::Tensor, head_dim: usize, pos: &Self::Index, cfg: &RopeConfig);
    /// `out = silu(gate) ⊙ up`.
    fn swiglu(&self, gate: &Self::Tensor, up: &Self::Tensor, out: &mut Self::Tensor);
    /// `out = gelu_tanh(gate) ⊙ up` (GELU as ggml-cpu computes it: through an f16 table).
    fn geglu(&self, gate: &Self::Tensor, up: &Self::Tensor, out: &mut Self::Tensor);
    /// `a += b`.
    fn add(&self, a: &mut Self::Tensor, b: &Self::Tensor);
    /// `a *= s`.
    fn scale(&self, a: &mut Self::Tensor, s: f32);
    /// `x = c · tanh(x / c)` (logit soft-capping).
    fn softcap(&self, x: &mut Self::Tensor, c: f32);
    /// `x = silu(x)` (`x · σ(x)`).
    fn silu(&self, x: &mut Self::Tensor);
    /// `x ⊙= act(gate)`, each gate column scaling `x.cols / gate.cols` consecutive columns of
    /// `x`: one per element (Qwen3.5's gated attention), one per head (Laguna's per-head
    /// gate), one per row (a shared expert's gate).
    fn gate_mul(&self, x: &mut Self::Tensor, gate: &Self::Tensor, act: GateAct);
    /// Columns of `src` cut into groups of `stride`: `out` row `r` is the concatenation, over
    /// the groups `g`, of `src[r][g·stride + range]` (a slice of every head, or with
    /// `stride = cols` one column range).
    fn gather_cols(
        &self,
        src: &Self::Tensor,
        stride: usize,
        range: std::ops::Range<usize>,
        out: &mut Self::Tensor,
    );

    /// Makes one weight per range of rows of the matrix `desc` (`dims = [n_in, rows]`; a
    /// stack of experts is its experts' rows one after the other): the experts of a mixture,
    /// which [`Backend::matmul_id`] reads by id. A backend may keep them as views of one copy
    /// of `desc`. The default makes each from its bytes with [`Backend::weight`].
    ///
    /// # Errors
    /// As [`Backend::weight`]; a range past the matrix's rows.
    fn weight_views(
        &self,
        desc: &WeightDesc<'_>,
        rows: &[std::ops::Range<usize>],
    ) -> Result<Vec<Self::Weight>> {
        let (n_in, _) = desc.view_rows(rows)?;
        let per = desc.ty.row_bytes(n_in).map_err(|e| TensorError::Shape {
            op: "weight_views",
            detail: format!("`{}`: {e}", desc.name),
        })?;
        rows.iter()
            .map(|r| {
                if r.end.checked_mul(per).is_none_or(|b| desc.data.len() < b) {
                    return Err(TensorError::Shape {
                        op: "weight_views",
                        detail: format!(
                            "rows {r:?} of `{}`: {} bytes hold fewer",
                            desc.name,
                            desc.data.len()
                        ),
                    });
                }
                self.weight(WeightDesc {
                    name: desc.name,
                    ty: desc.ty,
                    dims: &[n_in, r.end - r.start],
                    data: &desc.data[r.start * per..r.end * per],
                    owner: Arc::clone(&desc.owner),
                })
            })
            .collect()
    }

    /// An empty routing, for [`Backend::moe_route`] to fill.
    fn routes(&self) -> Self::Routes;
    /// Routes every row of `logits` (`[n, n_expert]` router logits) as [`route_row`] does,
    /// with `bias` (a vector of `n_expert`) as the selection's correction: `n_used` experts
    /// per row and their weights, on the backend.
    fn moe_route(
        &self,
        logits: &Self::Tensor,
        p: &MoeRoute,
        bias: Option<&Self::Weight>,
        out: &mut Self::Routes,
    );
    /// The routing's expert ids and weights (`n · n_used` each, row after row, each row's by
    /// increasing id), downloaded.
    fn routes_to_host(&self, r: &Self::Routes, ids: &mut Vec<u32>, w: &mut Vec<f32>);
    /// The experts of a routing over their rows: row `p = i · n_used + j` of `out`
    /// (`[n · n_used, n_out]`) is row `per_pair ? p : i` of `x` times expert `e = ids[p]`
    /// (`experts[e]`, all of one shape), then times `scales[e]` where given — with the bits
    /// [`Backend::matmul`] (and [`Backend::scale`]) give that row alone, so a row's result does
    /// not depend on how many rows chose the same expert.
    #[allow(
        clippy::too_many_arguments,
        reason = "the product's operands and the routing"
    )]
    fn matmul_id(
        &self,
        x: &Self::Tensor,
        experts: &[Self::Weight],
        scales: Option<&[f32]>,
        r: &Self::Routes,
        per_pair: bool,
        out: &mut Self::Tensor,
    );
    /// `out[i] = ((0 + w[i,0] · y[i·n_used]) + w[i,1] · y[i·n_used + 1]) + …` over a row's
    /// experts in increasing id order, each product rounded, then added: the weighted sum of
    /// the experts' outputs (`y`, `[n · n_used, cols]`), `out` `[n, cols]`.
    fn moe_combine(&self, y: &Self::Tensor, r: &Self::Routes, out: &mut Self::Tensor);

    /// `out = Σ_j w[i,j] · down(act(gate(x_i)) ⊙ up(x_i))` over each row's routed experts: a
    /// mixture's expert MLPs for every row of `x`, with the bits of the default — the three
    /// projections by [`Backend::matmul_id`], the gated activation over all pairs, the weighted
    /// sum by [`Backend::moe_combine`]. A backend may run it otherwise (the CPU backend runs
    /// each expert's MLP over its rows as one pass, without the pairs' intermediate tensors)
    /// as long as every row gets those bits.
    fn moe_ffn(
        &self,
        x: &Self::Tensor,
        experts: &MoeExperts<'_, Self::Weight>,
        r: &Self::Routes,
        out: &mut Self::Tensor,
    ) {
        let z = || self.zeros(0, 0);
        let (mut gate, mut up, mut act, mut y) = (z(), z(), z(), z());
        self.matmul_id(x, experts.gate, experts.gate_scales, r, false, &mut gate);
        self.matmul_id(x, experts.up, experts.up_scales, r, false, &mut up);
        if experts.geglu {
            self.geglu(&gate, &up, &mut act);
        } else {
            self.swiglu(&gate, &up, &mut act);
        }
        self.matmul_id(&act, experts.down, experts.down_scales, r, true, &mut y);
        self.moe_combine(&y, r, out);
    }

    /// Allocates the cache.
    ///
    /// # Errors
    /// If a format cannot be used for the cache on this backend.
    fn kv_new(&self, shape: KvShape) -> Result<Self::Kv>;
    /// Writes K and V rows (`[n_tokens, n_kv_head · head_dim]`) of `layer` into `cells`
    /// (each below the layer's cell count, [`KvShape::layer_cells`]).
    fn kv_write(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        cells: &Self::Index,
        k: &Self::Tensor,
        v: &Self::Tensor,
    );
    /// Appends the stored state of cells `0..n` of every layer (`0..min(n, cells)` in a layer of
    /// fewer cells, [`KvShape::layer_cells`]) to `out`, in a layout of the backend's choosing
    /// that [`Backend::kv_import`] reads back into a cache of the same shape: a slot saved to a
    /// file. A backend that cannot read its cache back answers an error (the default).
    ///
    /// # Errors
    /// [`TensorError::Shape`] when `n` is past the cache's cells, or the backend cannot export.
    fn kv_export(&self, kv: &Self::Kv, n: usize, out: &mut Vec<u8>) -> Result<()> {
        let _ = (kv, n, out);
        Err(TensorError::Shape {
            op: "kv_export",
            detail: format!("the {} backend cannot export its KV cache", self.name()),
        })
    }

    /// Writes back what [`Backend::kv_export`] wrote for `n` cells (all of `bytes`); the cells
    /// past `n` keep what they hold.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when `bytes` is not the export of `n` cells of a cache of this
    /// shape, or the backend cannot import.
    fn kv_import(&self, kv: &mut Self::Kv, n: usize, bytes: &[u8]) -> Result<()> {
        let _ = (kv, n, bytes);
        Err(TensorError::Shape {
            op: "kv_import",
            detail: format!("the {} backend cannot import a KV cache", self.name()),
        })
    }

    /// The causal depthwise convolution of recurrent layer `layer` over the rows of `x`
    /// (`[n, conv_channels]`, one sequence's consecutive positions from `pos0`): row `t` of
    /// `out` is `Σ_k w[c][k] · in[t + k][c]` over the layer's state (the `kernel − 1` inputs
    /// before `pos0`) followed by `x`; `w` is `ssm_conv1d` (ggml dims `[kernel, channels]`).
    /// The state becomes the last `kernel − 1` inputs, with snapshots as
    /// [`RecurrentLayers`] says.
    fn ssm_conv(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        pos0: usize,
        x: &Self::Tensor,
        w: &Self::Weight,
        out: &mut Self::Tensor,
    );
    /// The gated delta rule of recurrent layer `p.layer` over one sequence's consecutive rows
    /// from `p.pos0`: per row and value head `h` (key head `h % n_head_k`), with `q`, `k`
    /// L2-normalized (`x / √(Σx² + eps)`), `q` scaled by `1/√head_dim`, the decay's log
    /// `g = a[h] · softplus(alpha[h] + dt_bias[h])`, the strength `β = σ(beta[h])` and the
    /// state `S` (`head_dim × head_dim`): `S ← S·e^g`, `d = β·(v − Sᵀk)`, `S ← S + k dᵀ`,
    /// `o = Sᵀq`. `q`, `k` are `[n, n_head_k · head_dim]`, `v` and `out`
    /// `[n, n_head_v · head_dim]`, `alpha` and `beta` `[n, n_head_v]`; `dt_bias` and `a` are
    /// vectors of `n_head_v` (`ssm_dt.bias`, `ssm_a`). The state continues from what the layer
    /// kept for `pos0`, with snapshots as [`RecurrentLayers`] says.
    #[allow(
        clippy::too_many_arguments,
        reason = "the rule's inputs are all needed"
    )]
    fn gated_delta_net(
        &self,
        kv: &mut Self::Kv,
        p: &DeltaNetParams,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        alpha: &Self::Tensor,
        beta: &Self::Tensor,
        dt_bias: &Self::Weight,
        a: &Self::Weight,
        out: &mut Self::Tensor,
    );
    /// Whether a forward may start at position `pos` of `kv`: always for K/V cells (a forward
    /// writes its cells); for recurrent layers only at a position whose state they kept
    /// ([`RecurrentLayers`]).
    fn kv_holds(&self, kv: &Self::Kv, pos: usize) -> bool;

    /// Attention of `q` (`[n_q, n_head · head_dim_k]`) over cells `0..kv_pos.len()` of the
    /// layer; writes `[n_q, n_head · head_dim_v]`. In a layer of fewer cells than `kv_pos`
    /// (a sliding-window ring, [`KvShape::layer_cells`]) entry `j` is cell `j % cells`: the
    /// caller lays the ring out in position order (entry `j` is position `j` where the ring
    /// holds it, an unseen position elsewhere), so the keys are visited in the order, and
    /// summed with the bits, of a full-size cache.
    fn attention(
        &self,
        q: &Self::Tensor,
        kv: &Self::Kv,
        params: &AttentionParams<'_, Self::Index>,
        out: &mut Self::Tensor,
    );

    /// The attention of a batch of several sequences, each over its own cache, as one op: for
    /// every sequence, its rows of `k` and `v` are written to its `cells` ([`Backend::kv_write`])
    /// and its rows of `q` attend over its cache ([`Backend::attention`]) into its rows of
    /// `out` (`[rows of q, n_head · head_dim_v]`; every sequence has the same heads). A
    /// sequence's rows get the bits those two ops give its rows alone, so the batch changes no
    /// sequence's output. The sequences' rows are disjoint; rows of `out` no sequence covers
    /// are unspecified. The default is that definition, a gather and a scatter of each
    /// sequence's rows around the two ops; a backend answers it with fewer passes (no gathers,
    /// one parallel region over every sequence's work).
    fn attention_seqs(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        seqs: &mut [SeqAttention<'_, Self::Kv, Self::Index>],
        out: &mut Self::Tensor,
    ) {
        attention_seqs_apart(self, q, k, v, seqs, out);
    }
}

/// [`Backend::attention_seqs`] by its definition, the default of the op: each sequence's
/// rows gathered ([`Backend::copy_rows`]), written to its cache ([`Backend::kv_write`]),
/// attended ([`Backend::attention`]) and scattered into `out` ([`Backend::put_rows`]).
pub fn attention_seqs_apart<B: Backend + ?Sized>(
    be: &B,
    q: &B::Tensor,
    k: &B::Tensor,
    v: &B::Tensor,
    seqs: &mut [SeqAttention<'_, B::Kv, B::Index>],
    out: &mut B::Tensor,
) {
    let (mut sq, mut sk, mut sv, mut so) = (
        be.zeros(0, 0),
        be.zeros(0, 0),
        be.zeros(0, 0),
        be.zeros(0, 0),
    );
    let total = be.shape(q).0;
    for (i, s) in seqs.iter_mut().enumerate() {
        be.copy_rows(q, s.row_index, &mut sq);
        if let Some(cells) = s.cells {
            be.copy_rows(k, s.row_index, &mut sk);
            be.copy_rows(v, s.row_index, &mut sv);
            be.kv_write(s.kv, s.params.layer, cells, &sk, &sv);
        }
        be.attention(&sq, s.kv, &s.params, &mut so);
        if i == 0 {
            let cols = be.shape(&so).1;
            be.resize(out, total, cols);
        }
        be.put_rows(&so, s.row_index, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc<'a>(data: &'a [u8], owner: Arc<dyn ByteSource>) -> WeightDesc<'a> {
        WeightDesc {
            name: "w",
            ty: QType::F32,
            dims: &[1],
            data,
            owner,
        }
    }

    /// The first maximum wins; NaN and −∞ never do.
    #[test]
    fn argmax_row_takes_the_first_maximum_and_skips_nan() {
        let inf = f32::INFINITY;
        assert_eq!(argmax_row(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax_row(&[f32::NAN, -1.0, f32::NAN]), 1);
        assert_eq!(argmax_row(&[-inf, 5.0, inf, inf]), 2);
        assert_eq!(argmax_row(&[f32::NAN, -inf]), NO_ARGMAX);
        assert_eq!(argmax_row(&[]), NO_ARGMAX);
    }

    fn route(p: &MoeRoute, x: &[f32], bias: Option<&[f32]>) -> (Vec<u32>, Vec<f32>) {
        let (mut ids, mut w) = (Vec::new(), Vec::new());
        for row in x.chunks_exact(4) {
            route_row(row, p, bias, &mut Vec::new(), &mut ids, &mut w);
        }
        (ids, w)
    }

    /// Top-2 of a softmax, renormalized: the two largest logits win, their weights are their
    /// softmax shares of the pair (`e^a / (e^a + e^b)`), listed by increasing expert, and
    /// each row is routed on its own.
    #[test]
    fn top_k_softmax_renormalized() {
        let p = MoeRoute {
            n_used: 2,
            sigmoid: false,
            norm: true,
            scale: 1.0,
        };
        let logits = [0.0, 2.0, 1.0, -1.0, /* row 1 */ 3.0, 3.0, 0.0, 0.0];
        let (ids, w) = route(&p, &logits, None);
        assert_eq!(ids, [1, 2, 0, 1]);
        let w1 = 1.0 / (1.0 + (-1.0f32).exp());
        assert!((w[0] - w1).abs() < 1e-6 && (w[1] - (1.0 - w1)).abs() < 1e-6);
        // Equal logits: equal weights.
        assert!((w[2] - 0.5).abs() < 1e-6 && (w[3] - 0.5).abs() < 1e-6);
        // Without renormalization the weights are the softmax scores over all experts, times
        // the scale.
        let p1 = MoeRoute {
            n_used: 1,
            norm: false,
            scale: 2.5,
            ..p
        };
        let (ids, w) = route(&p1, &logits[..4], None);
        let z: f32 = logits[..4].iter().map(|v| v.exp()).sum();
        assert_eq!(ids, [1]);
        assert!((w[0] - 2.5 * 2.0f32.exp() / z).abs() < 1e-5);
        // A tie for the last place goes to the lower expert.
        let (ids, _) = route(&p1, &[1.0, 4.0, 4.0, 0.0], None);
        assert_eq!(ids, [1]);
    }

    /// Sigmoid routing with a correction bias: the bias moves the choice, not the weights.
    #[test]
    fn a_correction_bias_chooses_but_does_not_weigh() {
        let p = MoeRoute {
            n_used: 1,
            sigmoid: true,
            norm: false,
            scale: 1.0,
        };
        let logits = [2.0, 0.0, 1.0, -1.0];
        let (ids, w) = route(&p, &logits, Some(&[0.0, 0.0, 0.0, 5.0]));
        assert_eq!(ids, [3]);
        let s = 1.0 / (1.0 + 1.0f32.exp());
        assert!((w[0] - s).abs() < 1e-6);
        assert_eq!(route(&p, &logits, None).0, [0]);
    }

    /// A weight may only borrow bytes its owner keeps alive: a slice from elsewhere is refused,
    /// so backends can re-borrow by range without `unsafe`.
    #[test]
    fn weight_bytes_must_lie_inside_their_owner() {
        let owner = Arc::new(vec![1u8, 2, 3, 4, 5, 6, 7, 8]);
        let inside = &owner[2..6];
        assert_eq!(desc(inside, owner.clone()).range_in_owner().unwrap(), 2..6);
        assert_eq!(
            desc(&owner[8..], owner.clone()).range_in_owner().unwrap(),
            8..8
        );
        let elsewhere = vec![0u8; 4];
        let err = desc(&elsewhere, owner.clone())
            .range_in_owner()
            .unwrap_err();
        assert!(err.to_string().contains("do not lie inside"), "{err}");
    }
}

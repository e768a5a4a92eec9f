//! Which format each layer's K and V use, how wide a stored head is, and what a token costs.

use specula_quant::QType;
use specula_tensor::{KvShape, LayerOverride};

use crate::{KvError, Result};

/// The formats a cache can store K and V in (llama.cpp's `-ctk` / `-ctv` names).
pub const CACHE_TYPES: &[QType] = &[
    QType::F32,
    QType::F16,
    QType::BF16,
    QType::Q8_0,
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::IQ4_NL,
    QType::Turbo2,
    QType::Turbo3,
    QType::Turbo4,
];

/// The cache format named `name` (`f16`, `q8_0`, `turbo4`, …, case-insensitive).
///
/// # Errors
/// [`KvError::UnknownType`] for a name that is not one of [`CACHE_TYPES`].
pub fn parse_cache_type(name: &str) -> Result<QType> {
    QType::from_name(name)
        .filter(|t| CACHE_TYPES.contains(t))
        .ok_or_else(|| KvError::UnknownType(name.to_owned()))
}

/// Per-layer formats of K (`v = false`) or V from a `--cache-type-k-layers` /
/// `--cache-type-v-layers` spec: comma-separated `LAYERS:TYPE` items, `LAYERS` one layer `N` or
/// an inclusive range `A-B` (0-based), e.g. `0-3:q8_0,28-29:q8_0`. Later items win where
/// ranges overlap; whether the layers exist is checked against the model by [`KvLayout::new`].
///
/// # Errors
/// [`KvError::Shape`] for a malformed item or a range that runs backwards;
/// [`KvError::UnknownType`] for a name that is not one of [`CACHE_TYPES`].
pub fn parse_layer_types(spec: &str, v: bool) -> Result<Vec<LayerOverride>> {
    let bad = |item: &str, why: &str| {
        KvError::Shape(format!(
            "per-layer cache type `{item}`: {why} (expected LAYERS:TYPE, LAYERS `N` or `A-B`, e.g. 0-3:q8_0)"
        ))
    };
    spec.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            let (layers, ty) = item.split_once(':').ok_or_else(|| bad(item, "no `:`"))?;
            let ty = parse_cache_type(ty.trim())?;
            let num = |x: &str| {
                x.trim()
                    .parse::<usize>()
                    .map_err(|_| bad(item, "a layer is not a non-negative number"))
            };
            let (first, last) = match layers.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                None => (num(layers)?, num(layers)?),
            };
            if first > last {
                return Err(bad(item, "the range runs backwards"));
            }
            Ok(LayerOverride {
                first,
                last,
                k: (!v).then_some(ty),
                v: v.then_some(ty),
            })
        })
        .collect()
}

/// Whether `ty` is a TurboQuant type (stored in the rotated domain, 128-value groups).
#[must_use]
pub fn is_turbo(ty: QType) -> bool {
    matches!(ty, QType::Turbo2 | QType::Turbo3 | QType::Turbo4)
}

/// The width a head of `head_dim` values is stored with in format `ty`: turbo heads are
/// zero-padded to the next multiple of 128 (one rotation group per 128 values, research note
/// `quant.md` §5.7); every other format stores the head as is and needs it to be a whole number
/// of its blocks.
///
/// # Errors
/// [`KvError::HeadDim`] when the head cannot be stored in `ty`.
pub fn stored_head_dim(what: &'static str, ty: QType, head_dim: usize) -> Result<usize> {
    if !CACHE_TYPES.contains(&ty) {
        return Err(KvError::UnsupportedType { what, ty });
    }
    if head_dim == 0 {
        return Err(KvError::HeadDim {
            what,
            ty,
            head_dim,
            need: "a positive head dim",
        });
    }
    if is_turbo(ty) {
        return Ok(head_dim.div_ceil(QType::Turbo4.block_size()) * QType::Turbo4.block_size());
    }
    if !head_dim.is_multiple_of(ty.block_size()) {
        return Err(KvError::HeadDim {
            what,
            ty,
            head_dim,
            need: "a head dim that is a multiple of 32 (use f16, or a turbo type, which pads)",
        });
    }
    Ok(head_dim)
}

/// How the heads of a plane are rotated before they are quantized; attention rotates queries
/// the same way (K) or its output back (V). Every rotation here is orthonormal, so attention in
/// the rotated domain equals attention in the model's domain up to quantization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rotation {
    /// Stored as is (float formats, and block formats whose head dim is not a multiple of 64).
    None,
    /// The normalized Sylvester–Hadamard transform on consecutive groups of this many values —
    /// upstream llama.cpp's rotation of quantized caches (`attn_rot_k` / `attn_rot_v`,
    /// `llama-kv-cache.cpp`): for K the largest power of two ≥ 64 dividing the head dim, for V
    /// groups of 64. It spreads outlier channels over the whole group, which plain block
    /// formats (q8_0, q4_0, …) cannot hold; without it llama.cpp's q4_0 cache KLD on SmolLM2
    /// is 3.4 × higher (0.211 vs 0.062, measured, `LLAMA_ATTN_ROT_DISABLE=1`).
    Hadamard(usize),
    /// TurboQuant: the cache's randomized 128-group Walsh–Hadamard transform, applied inside
    /// the turbo quantizer, the head padded to a multiple of 128 by [`turbo_pad`].
    Turbo,
}

/// Whether `ty` is a float format (stored without rotation).
fn is_float(ty: QType) -> bool {
    matches!(ty, QType::F32 | QType::F16 | QType::BF16)
}

/// The rotation of a K plane of format `ty` with heads of `head_dim` values.
#[must_use]
pub fn k_rotation(ty: QType, head_dim: usize) -> Rotation {
    if is_turbo(ty) {
        Rotation::Turbo
    } else if is_float(ty) || head_dim == 0 || !head_dim.is_multiple_of(64) {
        Rotation::None
    } else {
        // The largest power of two dividing the head dim (≥ 64 since 64 divides it).
        Rotation::Hadamard(1 << head_dim.trailing_zeros())
    }
}

/// The rotation of a V plane.
#[must_use]
pub fn v_rotation(ty: QType, head_dim: usize) -> Rotation {
    if is_turbo(ty) {
        Rotation::Turbo
    } else if is_float(ty) || head_dim == 0 || !head_dim.is_multiple_of(64) {
        Rotation::None
    } else {
        Rotation::Hadamard(64)
    }
}

/// Applies the normalized Sylvester–Hadamard transform (`H/√n`, its own inverse) to each
/// consecutive group of `n` values of `x` (`n` a power of two; `x.len()` a multiple of `n`).
///
/// # Panics
/// If `n` is not a power of two or does not divide `x.len()`.
pub fn hadamard(x: &mut [f32], n: usize) {
    assert!(
        n.is_power_of_two() && x.len().is_multiple_of(n),
        "hadamard: groups of {n} in {} values",
        x.len()
    );
    #[allow(clippy::cast_precision_loss, reason = "n is a small power of two")]
    let scale = 1.0 / (n as f32).sqrt();
    for g in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (g[j], g[j + h]);
                    g[j] = a + b;
                    g[j + h] = a - b;
                }
            }
            h *= 2;
        }
        for v in g.iter_mut() {
            *v *= scale;
        }
    }
}

/// K and V formats of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerTypes {
    /// Format of K.
    pub k: QType,
    /// Format of V.
    pub v: QType,
}

/// Geometry of one layer's K and V rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerLayout {
    /// Formats.
    pub types: LayerTypes,
    /// Values a K head is stored with (the model's head dim, padded for turbo).
    pub k_dim: usize,
    /// Values a V head is stored with.
    pub v_dim: usize,
    /// Bytes of one K head of one cell.
    pub k_head_bytes: usize,
    /// Bytes of one V head of one cell.
    pub v_head_bytes: usize,
    /// Rotation of K heads.
    pub k_rot: Rotation,
    /// Rotation of V heads.
    pub v_rot: Rotation,
}

/// The layout of a whole cache: per-layer formats and what a token costs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// The shape the model asked for.
    pub shape: KvShape,
    /// One entry per layer.
    pub layers: Vec<LayerLayout>,
}

impl KvLayout {
    /// The layout with `shape.k_type` / `shape.v_type` in every layer but those of
    /// `shape.overrides`.
    ///
    /// # Errors
    /// [`KvError::Shape`] when an override names a layer the model does not have; as
    /// [`KvLayout::with_types`].
    pub fn new(shape: &KvShape) -> Result<Self> {
        if let Some(o) = shape
            .overrides
            .iter()
            .find(|o| o.first > o.last || o.last >= shape.n_layer)
        {
            return Err(KvError::Shape(format!(
                "a per-layer cache format for layers {}-{} of a {}-layer model",
                o.first, o.last, shape.n_layer
            )));
        }
        let types: Vec<LayerTypes> = (0..shape.n_layer)
            .map(|l| {
                let (k, v) = shape.layer_types(l);
                LayerTypes { k, v }
            })
            .collect();
        Self::with_types(shape, &types)
    }

    /// The layout with per-layer formats (`types[l]` for layer `l`; `shape.k_type`/`v_type` are
    /// ignored).
    ///
    /// # Errors
    /// [`KvError::Shape`] when `types` does not have one entry per layer or the shape is empty;
    /// [`KvError::UnsupportedType`] / [`KvError::HeadDim`] when a layer's heads cannot be stored
    /// in its formats.
    pub fn with_types(shape: &KvShape, types: &[LayerTypes]) -> Result<Self> {
        if types.len() != shape.n_layer {
            return Err(KvError::Shape(format!(
                "{} per-layer formats for {} layers",
                types.len(),
                shape.n_layer
            )));
        }
        if shape.n_kv_head == 0 || shape.n_ctx == 0 {
            return Err(KvError::Shape(format!(
                "a cache needs at least one K/V head and one cell (got {} heads, {} cells)",
                shape.n_kv_head, shape.n_ctx
            )));
        }
        if let Some(w) = &shape.swa
            && (w.layers.len() != shape.n_layer || w.n_cells == 0 || w.n_cells > shape.n_ctx)
        {
            return Err(KvError::Shape(format!(
                "a sliding-window ring of {} cells over {} layers, for a {}-layer cache of {} cells (needs one flag per layer and 1..=n_ctx cells)",
                w.n_cells,
                w.layers.len(),
                shape.n_layer,
                shape.n_ctx
            )));
        }
        if !shape.heads.is_empty() && shape.heads.len() != shape.n_layer {
            return Err(KvError::Shape(format!(
                "per-layer heads for {} of {} layers",
                shape.heads.len(),
                shape.n_layer
            )));
        }
        if !shape.shared.is_empty() && shape.shared.len() != shape.n_layer {
            return Err(KvError::Shape(format!(
                "KV sharing given for {} of {} layers",
                shape.shared.len(),
                shape.n_layer
            )));
        }
        for (l, src) in shape.shared.iter().enumerate() {
            if let Some(src) = *src
                && (src >= l
                    || shape.shared_source(src).is_some()
                    || shape.is_recurrent(src)
                    || shape.is_recurrent(l)
                    || shape.layer_heads(src) != shape.layer_heads(l))
            {
                return Err(KvError::Shape(format!(
                    "layer {l} reads the cells of layer {src}, which must be an earlier layer with cells of its own and the same heads"
                )));
            }
        }
        let layers = types
            .iter()
            .enumerate()
            .map(|(l, &t)| {
                let h = shape.layer_heads(l);
                if h.n_kv_head == 0 {
                    return Err(KvError::Shape(format!("layer {l} has no K/V head")));
                }
                let k_dim = stored_head_dim("K", t.k, h.head_dim_k)?;
                let v_dim = stored_head_dim("V", t.v, h.head_dim_v)?;
                Ok(LayerLayout {
                    types: t,
                    k_dim,
                    v_dim,
                    k_head_bytes: t.k.row_bytes(k_dim)?,
                    v_head_bytes: t.v.row_bytes(v_dim)?,
                    k_rot: k_rotation(t.k, h.head_dim_k),
                    v_rot: v_rotation(t.v, h.head_dim_v),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            shape: shape.clone(),
            layers,
        })
    }

    /// Bytes one token (cell) takes in layer `l`, K and V together.
    #[must_use]
    pub fn bytes_per_token_layer(&self, l: usize) -> usize {
        if self.shape.shared_source(l).is_some() {
            return 0;
        }
        let ly = &self.layers[l];
        self.shape.layer_heads(l).n_kv_head * (ly.k_head_bytes + ly.v_head_bytes)
    }

    /// Bytes one token takes over all layers (one cell of every layer; a sliding-window ring
    /// stops growing at its size: [`KvLayout::bytes_for`]).
    #[must_use]
    pub fn bytes_per_token(&self) -> usize {
        (0..self.layers.len())
            .map(|l| self.bytes_per_token_layer(l))
            .sum()
    }

    /// Bytes the first `n_tokens` positions occupy: every layer's cells up to its own cell count
    /// ([`KvShape::layer_cells`]: `n_ctx`, or the ring of a sliding-window layer).
    #[must_use]
    pub fn bytes_for(&self, n_tokens: usize) -> usize {
        (0..self.layers.len())
            .map(|l| self.bytes_per_token_layer(l) * n_tokens.min(self.shape.layer_cells(l)))
            .sum()
    }

    /// Bytes of the whole cache (every layer's cells), and of the recurrent layers' states:
    /// the current one, the one before the latest forward and the snapshots, f32.
    #[must_use]
    pub fn total_bytes(&self) -> usize {
        self.bytes_for(self.shape.n_ctx) + self.recurrent_bytes()
    }

    /// Bytes of the recurrent layers' states ([`KvShape::recurrent`]).
    #[must_use]
    pub fn recurrent_bytes(&self) -> usize {
        self.shape.recurrent.as_ref().map_or(0, |r| {
            let per: usize = r
                .layers
                .iter()
                .flatten()
                .map(|l| 4 * (l.conv_len() + l.state_len()))
                .sum();
            per * (2 + r.snapshots)
        })
    }

    /// Stored bits per model value (K and V of every layer, padding included): 16 for f16,
    /// 8.5 for q8_0, 4.125 for turbo4 with 128-wide heads, 8.25 for turbo4 with 64-wide heads.
    #[must_use]
    #[allow(
        clippy::cast_precision_loss,
        reason = "byte counts of a cache are far below 2^52"
    )]
    pub fn bits_per_value(&self) -> f64 {
        let values: usize = (0..self.layers.len())
            .filter(|&l| self.shape.shared_source(l).is_none())
            .map(|l| {
                let h = self.shape.layer_heads(l);
                h.n_kv_head * (h.head_dim_k + h.head_dim_v)
            })
            .sum();
        8.0 * self.bytes_per_token() as f64 / values as f64
    }

    /// Whether any layer stores K in a turbo format (queries are rotated for it).
    #[must_use]
    pub fn any_turbo(&self) -> bool {
        self.layers
            .iter()
            .any(|l| is_turbo(l.types.k) || is_turbo(l.types.v))
    }
}

/// Weight of the fine stage of a turbo head stored in two stages, per format (chosen by the
/// relative error of Gaussian 64-value heads over a grid of weights: turbo2 0.0089 at 0.25,
/// turbo3 0.0006 at 0.15, turbo4 0.00004 at 0.075).
fn fine_weight(ty: QType) -> Option<f32> {
    match ty {
        QType::Turbo2 => Some(0.25),
        QType::Turbo3 => Some(0.15),
        QType::Turbo4 => Some(0.075),
        _ => None,
    }
}

/// The fine stage's weight `β` when a turbo head of `hd` values stored in `dim` is kept in
/// two stages (`None`: padded with signed copies, [`turbo_pad`]).
///
/// A 64-value head has 128 codes, twice what it needs. It is rotated with the fork's
/// 64-value variant of the rotation (`wht::forward64`, the rotation `GGML_OP_TURBO_WHT` uses
/// for 64-wide groups) to `z`, and stored as two 64-code halves `y = s·(c_a, c_b)` (the
/// block's one norm `s` and its centroid codes, decoded as the reference decodes them) that
/// attention reads back as `z ≈ y_a + β·y_b`: every rotated value has `levels²` values
/// `c_i + β·c_j` to pick from — a 16-level scalar quantizer out of two 4-level turbo2 halves.
/// The encoder picks each value's pair and the norm exactly (`refine.rs`). Relative error of
/// a 64-value head against the signed copies with refined codes: turbo2 0.0089 vs 0.019,
/// turbo3 0.0006 vs 0.0045, turbo4 0.00004 vs 0.0011.
#[must_use]
pub fn turbo_two_stage(ty: QType, hd: usize, dim: usize) -> Option<f32> {
    if hd == specula_quant::wht::HALF && dim == specula_quant::wht::GROUP {
        fine_weight(ty)
    } else {
        None
    }
}

/// Turns a query head for a turbo K (`x[..hd]`, `x.len()` the stored width) into the domain
/// its codes are stored in, so that `⟨x', decoded k⟩` is `q ·` the key attention reads back:
/// two stages ([`turbo_two_stage`]) `(R₆₄q, β·R₆₄q)`, else the padded query rotated forward.
pub fn turbo_query(ty: QType, x: &mut [f32], hd: usize) {
    use specula_quant::wht;
    if let Some(beta) = turbo_two_stage(ty, hd, x.len()) {
        let (coarse, fine) = x.split_at_mut(wht::HALF);
        wht::forward64(coarse.try_into().expect("64 values"));
        for (f, &c) in fine.iter_mut().zip(coarse.iter()) {
            *f = beta * c;
        }
    } else {
        turbo_pad_query(x, hd);
        wht::forward_row(x);
    }
}

/// Reads a decoded turbo V head (or an attention output in its domain, `x.len()` the stored
/// width) back into the model's domain, in `x[..hd]`: two stages `R₆₄ᵀ(y_a + β·y_b)`, else
/// the rotation back and the mean of the copies ([`turbo_fold`]).
pub fn turbo_read(ty: QType, x: &mut [f32], hd: usize) {
    use specula_quant::wht;
    if let Some(beta) = turbo_two_stage(ty, hd, x.len()) {
        let (coarse, fine) = x.split_at_mut(wht::HALF);
        for (c, &f) in coarse.iter_mut().zip(fine.iter()) {
            *c += beta * f;
        }
        wht::inverse64(coarse.try_into().expect("64 values"));
    } else {
        wht::inverse_row(x);
        turbo_fold(x, hd);
    }
}

/// `1 / copies` of head value `i` in a head of `hd` values padded to `dim` (the value and its
/// signed copies): every value has `pad / hd + 1` of them, the first `pad % hd` one more.
#[inline]
fn inv_copies(hd: usize, dim: usize) -> (f32, f32, usize) {
    let pad = dim - hd;
    #[allow(clippy::cast_precision_loss, reason = "a count of at most dim / hd")]
    let base = (pad / hd + 1) as f32;
    (1.0 / (base + 1.0), 1.0 / base, pad % hd)
}

/// The sign of padding value `t`: a fixed ±1 pattern (the fork's second WHT sign table), so a
/// copy does not line up with its original after the rotation.
fn pad_sign(t: usize) -> f32 {
    specula_quant::wht::S2[t % specula_quant::wht::GROUP]
}

/// Pads a turbo head of `hd` values (in `x[..hd]`) to `x.len()` with signed copies of itself,
/// `x[hd + t] = σ_t · x[t mod hd]`.
///
/// The fork pads with zeros; then the 128-group rotation makes both halves of the rotated
/// group equal up to sign, the two halves get the same code, and their quantization errors
/// add up in the head instead of averaging out, so half the stored bits are wasted. With
/// signed copies the halves are independent, the attention reads the head as the mean of its
/// copies ([`turbo_pad_query`], [`turbo_fold`]), and the error of a 64-value head halves at
/// the same memory (tested in `tests.rs`).
pub fn turbo_pad(x: &mut [f32], hd: usize) {
    let (head, rest) = x.split_at_mut(hd);
    for (c, chunk) in rest.chunks_mut(hd).enumerate() {
        for (j, (o, &v)) in chunk.iter_mut().zip(head.iter()).enumerate() {
            *o = pad_sign(c * hd + j) * v;
        }
    }
}

/// Pads a query head for a turbo K padded by [`turbo_pad`]: every copy of value `i` gets
/// `q_i / c_i` (with its sign), so `⟨q', k'⟩` is `q` dotted with the mean of `k`'s copies.
pub fn turbo_pad_query(x: &mut [f32], hd: usize) {
    let (more, fewer, rem) = inv_copies(hd, x.len());
    let (head, rest) = x.split_at_mut(hd);
    for (i, v) in head.iter_mut().enumerate() {
        *v *= if i < rem { more } else { fewer };
    }
    for (c, chunk) in rest.chunks_mut(hd).enumerate() {
        for (j, (o, &v)) in chunk.iter_mut().zip(head.iter()).enumerate() {
            *o = pad_sign(c * hd + j) * v;
        }
    }
}

/// Folds a padded turbo V head (or attention output) back onto its `hd` values: the mean of
/// each value's copies, in `x[..hd]`.
pub fn turbo_fold(x: &mut [f32], hd: usize) {
    let (more, fewer, rem) = inv_copies(hd, x.len());
    let (head, rest) = x.split_at_mut(hd);
    for (c, chunk) in rest.chunks(hd).enumerate() {
        for (j, (o, &v)) in head.iter_mut().zip(chunk).enumerate() {
            *o += pad_sign(c * hd + j) * v;
        }
    }
    for (i, v) in head.iter_mut().enumerate() {
        *v *= if i < rem { more } else { fewer };
    }
}

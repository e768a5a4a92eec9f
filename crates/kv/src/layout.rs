//! Which format each layer's K and V use, how wide a stored head is, and what a token costs.

use specula_quant::QType;
use specula_tensor::KvShape;

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
    /// The layout with `shape.k_type` / `shape.v_type` in every layer.
    ///
    /// # Errors
    /// As [`KvLayout::with_types`].
    pub fn new(shape: &KvShape) -> Result<Self> {
        let t = LayerTypes {
            k: shape.k_type,
            v: shape.v_type,
        };
        Self::with_types(shape, &vec![t; shape.n_layer])
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
        let layers = types
            .iter()
            .map(|&t| {
                let k_dim = stored_head_dim("K", t.k, shape.head_dim_k)?;
                let v_dim = stored_head_dim("V", t.v, shape.head_dim_v)?;
                Ok(LayerLayout {
                    types: t,
                    k_dim,
                    v_dim,
                    k_head_bytes: t.k.row_bytes(k_dim)?,
                    v_head_bytes: t.v.row_bytes(v_dim)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            shape: *shape,
            layers,
        })
    }

    /// Bytes one token (cell) takes in layer `l`, K and V together.
    #[must_use]
    pub fn bytes_per_token_layer(&self, l: usize) -> usize {
        let ly = &self.layers[l];
        self.shape.n_kv_head * (ly.k_head_bytes + ly.v_head_bytes)
    }

    /// Bytes one token takes over all layers.
    #[must_use]
    pub fn bytes_per_token(&self) -> usize {
        (0..self.layers.len())
            .map(|l| self.bytes_per_token_layer(l))
            .sum()
    }

    /// Bytes of the whole cache (`n_ctx` cells).
    #[must_use]
    pub fn total_bytes(&self) -> usize {
        self.bytes_per_token() * self.shape.n_ctx
    }

    /// Stored bits per model value (K and V of every layer, padding included): 16 for f16,
    /// 8.5 for q8_0, 4.125 for turbo4 with 128-wide heads, 8.25 for turbo4 with 64-wide heads.
    #[must_use]
    #[allow(
        clippy::cast_precision_loss,
        reason = "byte counts of a cache are far below 2^52"
    )]
    pub fn bits_per_value(&self) -> f64 {
        let values = self.layers.len()
            * self.shape.n_kv_head
            * (self.shape.head_dim_k + self.shape.head_dim_v);
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

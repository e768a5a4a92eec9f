//! The KV cache, independent of the device that computes with it.
//!
//! - [`KvLayout`] — per-layer K and V formats (any of [`CACHE_TYPES`], chosen independently),
//!   stored head widths (turbo heads zero-padded to 128) and memory accounting: bytes per token,
//!   per layer, for the whole cache, and the stored bits per value.
//! - [`Plane`] — host storage of one layer's K or V: rows quantized on write with the block
//!   quantizers of `specula-quant` (ggml's `set_rows`), read one head of one cell at a time —
//!   never dequantized as a whole. The CPU backend keeps its cache in planes.
//! - [`Cells`] — position and sequence set of every cell, with `seq_rm`, `seq_cp`, `seq_keep`,
//!   `seq_add` (recording the RoPE shift K needs), visibility under a [`Mask`], and pruning of
//!   sliding-window sub-caches; [`Cells::can_trim_to`] says whether removing a suffix leaves
//!   what the next query needs.
//! - [`Rollback`] — how a memory takes back rejected draft rows: a trim, or restoring a
//!   checkpoint ([`Plane::save`] / [`Plane::restore`] of the cells a write overwrites, a copy of
//!   the [`Cells`]) and running the accepted rows again.
//!
//! Quantized caches are stored in a rotated domain ([`Rotation`]): block formats (q8_0, q4_0,
//! …) under upstream llama.cpp's Hadamard rotation, TurboQuant formats under the fork's
//! randomized 128-group Walsh–Hadamard transform (research note `quant.md` §5). Attention
//! rotates queries forward for a rotated K and its output back for a rotated V.
//!
//! ```
//! use specula_kv::{KvLayout, parse_cache_type};
//! use specula_tensor::KvShape;
//!
//! let shape = KvShape {
//!     n_layer: 30, n_ctx: 4096, n_kv_head: 3, head_dim_k: 64, head_dim_v: 64,
//!     k_type: parse_cache_type("q8_0")?, v_type: parse_cache_type("turbo4")?,
//!     overrides: Vec::new(), swa: None, recurrent: None, heads: Vec::new(), shared: Vec::new(),
//! };
//! let layout = KvLayout::new(&shape)?;
//! // q8_0: 34 bytes per 32 values; turbo4: 66 bytes per 128 values, 64-wide heads padded.
//! assert_eq!(layout.bytes_per_token_layer(0), 3 * (2 * 34 + 66));
//! # Ok::<(), specula_kv::KvError>(())
//! ```

mod cells;
mod layout;
mod plane;
mod refine;

pub use cells::{Cells, MAX_SEQ, SeqId};
pub use layout::{
    CACHE_TYPES, KvLayout, LayerLayout, LayerTypes, Rotation, hadamard, is_turbo, k_rotation,
    parse_cache_type, parse_layer_types, stored_head_dim, turbo_fold, turbo_pad, turbo_pad_query,
    turbo_query, turbo_read, turbo_two_stage, v_rotation,
};
pub use plane::{Plane, RowEncoder, SavedCells, quantize_head};
pub use refine::{TwoStageTables, two_stage_tables};
use specula_quant::QType;
pub use specula_tensor::{LayerOverride, Mask};

/// How a memory takes back the rows of a rejected draft tail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rollback {
    /// The rows past a position are dropped and the rest is exactly what it was: attention KV
    /// whose cells are positions (llama.cpp's partial `seq_rm`).
    Trim,
    /// Dropping rows cannot give back the earlier state (a sliding window that pruned cells, a
    /// ring buffer that wrapped, a recurrent state folded over the rows): a checkpoint is taken
    /// before the verify forward, restored on a partial rejection, and the accepted rows are
    /// run again.
    Replay,
    /// A recurrent state keeps the state before the latest forward and snapshots after its
    /// last rows ([`specula_tensor::RecurrentLayers`]): taking back a draft tail selects one (the
    /// next forward starts at its position) instead of replaying; further back, or past the
    /// snapshots kept, a checkpoint is restored and the accepted rows run again.
    Snapshot,
}

impl Rollback {
    /// `trim`, `replay` or `snapshot`, as logs, `/slots` and `--spec-rollback` name it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Trim => "trim",
            Self::Replay => "replay",
            Self::Snapshot => "snapshot",
        }
    }
}

/// Errors of the KV cache.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// A cache type name that is not one of [`CACHE_TYPES`].
    #[error(
        "unknown KV cache type `{0}` (expected one of f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, turbo2, turbo3, turbo4)"
    )]
    UnknownType(String),
    /// A format that is not a cache format.
    #[error("{what} cache type {ty} is not a KV cache format")]
    UnsupportedType {
        /// `K` or `V`.
        what: &'static str,
        /// The format.
        ty: QType,
    },
    /// A head dim the format cannot store.
    #[error("{what} cache type {ty} cannot store heads of {head_dim} values: it needs {need}")]
    HeadDim {
        /// `K` or `V`.
        what: &'static str,
        /// The format.
        ty: QType,
        /// The model's head dim.
        head_dim: usize,
        /// What the format needs.
        need: &'static str,
    },
    /// Shapes that do not fit.
    #[error("KV cache: {0}")]
    Shape(String),
    /// Not enough free cells.
    #[error("KV cache full: {needed} cells needed, {free} free of {n_cells}")]
    Full {
        /// Cells asked for.
        needed: usize,
        /// Cells free.
        free: usize,
        /// Cells in all.
        n_cells: usize,
    },
    /// A bad sequence operation.
    #[error("KV cache: {0}")]
    Seq(String),
    /// A block-format error.
    #[error(transparent)]
    Quant(#[from] specula_quant::QuantError),
}

/// Result alias.
pub type Result<T, E = KvError> = std::result::Result<T, E>;

impl From<KvError> for specula_tensor::TensorError {
    fn from(e: KvError) -> Self {
        Self::Kv(Box::new(e))
    }
}

#[cfg(test)]
mod tests;

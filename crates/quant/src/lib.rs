//! Block formats: the numbers every other specula crate trusts.
//!
//! Every ggml weight type specula loads and the TurboQuant KV-cache types, each as a
//! `#[repr(C)]` block ([`blocks`]) with a scalar reference `quantize_row_*` /
//! `dequantize_row_*`, plus the dot products the matmul kernels are built from ([`dot`]), with
//! SIMD paths chosen at run time and a scalar reference they are tested against.
//!
//! - [`QType`] — a block format: geometry, ggml id, the activation type its dot product takes.
//! - [`quantize_row`] / [`dequantize_row`] / [`vec_dot`] — byte-level entry points that check
//!   lengths and dispatch on a [`QType`]; per-format typed functions live in the modules.
//! - [`wht`] — the fixed randomized Walsh–Hadamard rotation of the turbo types.
//! - [`QuantError`] — rows that are not whole blocks, length mismatches, unsupported operations.
//!
//! Formats and rounding rules: `ggml/src/ggml-quants.c` (upstream ggml, as vendored by
//! llama-cpp-python 0.3.36) and the TurboQuant fork (post-PR #197 centroids); the oracles are
//! gguf-py 0.19.0, llama.cpp's quantizers, and a numpy reimplementation of the turbo codec
//! (`reference/`).
//!
//! ```
//! use specula_quant::{QType, dequantize_row, quantize_row};
//!
//! let x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) / 8.0).collect();
//! let mut q = vec![0u8; QType::Q8_0.row_bytes(64)?];
//! quantize_row(QType::Q8_0, &x, &mut q)?;
//! let mut y = vec![0f32; 64];
//! dequantize_row(QType::Q8_0, &q, &mut y)?;
//! assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 0.02));
//! # Ok::<(), specula_quant::QuantError>(())
//! ```

pub mod blocks;
pub mod dot;
pub mod fp;
pub mod fp4;
pub mod iq4;
pub mod kquants;
pub mod legacy;
pub mod turbo;
pub mod wht;

use blocks::*;

/// Errors of this crate.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum QuantError {
    /// A row length that is not a whole number of blocks.
    #[error("{ty}: a row of {n} values is not a whole number of {block}-value blocks")]
    RowNotBlockMultiple {
        /// The format.
        ty: QType,
        /// The row length.
        n: usize,
        /// The block size.
        block: usize,
    },
    /// A buffer of the wrong length.
    #[error("{ty}: {what} has {got} {unit}, expected {expected}")]
    LengthMismatch {
        /// The format.
        ty: QType,
        /// Which buffer.
        what: &'static str,
        /// What was expected.
        expected: usize,
        /// What was given.
        got: usize,
        /// Bytes or values.
        unit: &'static str,
    },
    /// An operation the format does not have (e.g. quantizing to an activation-only type
    /// through a path that needs a weight type).
    #[error("{ty}: {op} is not supported")]
    Unsupported {
        /// The format.
        ty: QType,
        /// The operation.
        op: &'static str,
    },
    /// A ggml type id or name this crate does not implement.
    #[error("unknown or unsupported quantization type {0}")]
    UnknownType(String),
}

/// Result alias for this crate.
pub type Result<T, E = QuantError> = std::result::Result<T, E>;

macro_rules! qtypes {
    ($( $v:ident = $name:literal, $ggml:expr, $block:expr, $bytes:expr; )*) => {
        /// A block format.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[allow(non_camel_case_types, reason = "names follow ggml's type names")]
        pub enum QType { $( #[doc = $name] $v, )* }

        impl QType {
            /// Every format, weight and KV types alike.
            pub const ALL: &'static [QType] = &[$(QType::$v),*];

            /// The lower-case name (`q4_k`, `turbo3`).
            #[must_use]
            pub fn name(self) -> &'static str {
                match self { $( QType::$v => $name, )* }
            }

            /// The ggml type id, for formats that can appear in a GGUF file.
            #[must_use]
            pub fn ggml_id(self) -> Option<u32> {
                match self { $( QType::$v => $ggml, )* }
            }

            /// Values per block.
            #[must_use]
            pub fn block_size(self) -> usize {
                match self { $( QType::$v => $block, )* }
            }

            /// Bytes per block.
            #[must_use]
            pub fn type_size(self) -> usize {
                match self { $( QType::$v => $bytes, )* }
            }
        }
    };
}

qtypes! {
    F32 = "f32", Some(0), 1, 4;
    F16 = "f16", Some(1), 1, 2;
    BF16 = "bf16", Some(30), 1, 2;
    Q4_0 = "q4_0", Some(2), QK, size_of::<BlockQ4_0>();
    Q4_1 = "q4_1", Some(3), QK, size_of::<BlockQ4_1>();
    Q5_0 = "q5_0", Some(6), QK, size_of::<BlockQ5_0>();
    Q5_1 = "q5_1", Some(7), QK, size_of::<BlockQ5_1>();
    Q8_0 = "q8_0", Some(8), QK, size_of::<BlockQ8_0>();
    Q8_1 = "q8_1", Some(9), QK, size_of::<BlockQ8_1>();
    Q2_K = "q2_k", Some(10), QK_K, size_of::<BlockQ2K>();
    Q3_K = "q3_k", Some(11), QK_K, size_of::<BlockQ3K>();
    Q4_K = "q4_k", Some(12), QK_K, size_of::<BlockQ4K>();
    Q5_K = "q5_k", Some(13), QK_K, size_of::<BlockQ5K>();
    Q6_K = "q6_k", Some(14), QK_K, size_of::<BlockQ6K>();
    Q8_K = "q8_k", Some(15), QK_K, size_of::<BlockQ8K>();
    IQ4_NL = "iq4_nl", Some(20), QK, size_of::<BlockIq4Nl>();
    IQ4_XS = "iq4_xs", Some(23), QK_K, size_of::<BlockIq4Xs>();
    MXFP4 = "mxfp4", Some(39), QK, size_of::<BlockMxfp4>();
    NVFP4 = "nvfp4", Some(40), QK_NVFP4, size_of::<BlockNvfp4>();
    Turbo2 = "turbo2", None, QK_TURBO, size_of::<BlockTurbo2>();
    Turbo3 = "turbo3", None, QK_TURBO, size_of::<BlockTurbo3>();
    Turbo4 = "turbo4", None, QK_TURBO, size_of::<BlockTurbo4>();
}

impl QType {
    /// The format with this ggml type id.
    #[must_use]
    pub fn from_ggml_id(id: u32) -> Option<Self> {
        Self::ALL.iter().copied().find(|t| t.ggml_id() == Some(id))
    }

    /// The format with this name, case-insensitively (`Q4_K`, `q4_k`, `turbo3`).
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Bytes of a row of `n` values.
    ///
    /// # Errors
    /// [`QuantError::RowNotBlockMultiple`] if `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return Err(QuantError::RowNotBlockMultiple {
                ty: self,
                n,
                block: self.block_size(),
            });
        }
        Ok(n / self.block_size() * self.type_size())
    }

    /// Bits per value.
    #[must_use]
    #[allow(clippy::cast_precision_loss, reason = "small constants, exact in f64")]
    pub fn bits_per_weight(self) -> f64 {
        8.0 * self.type_size() as f64 / self.block_size() as f64
    }

    /// The activation format the dot product of a weight row of this format takes, as in
    /// ggml-cpu's `vec_dot_type`: Q8_0 for the 32-value formats (and NVFP4), Q8_1 for the
    /// formats with a min, Q8_K for the 256-value super-block formats, f32 for float weights
    /// and for the turbo KV types (attention reads them against f32 queries).
    #[must_use]
    pub fn vec_dot_type(self) -> QType {
        match self {
            Self::Q4_0 | Self::Q5_0 | Self::Q8_0 | Self::IQ4_NL | Self::MXFP4 | Self::NVFP4 => {
                Self::Q8_0
            }
            Self::Q4_1 | Self::Q5_1 => Self::Q8_1,
            Self::Q2_K | Self::Q3_K | Self::Q4_K | Self::Q5_K | Self::Q6_K | Self::IQ4_XS => {
                Self::Q8_K
            }
            Self::Q8_1 | Self::Q8_K => self,
            Self::F32 | Self::F16 | Self::BF16 | Self::Turbo2 | Self::Turbo3 | Self::Turbo4 => {
                Self::F32
            }
        }
    }
}

impl std::fmt::Display for QType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn check_lengths(ty: QType, values: usize, bytes: usize) -> Result<()> {
    let expected = ty.row_bytes(values)?;
    if bytes != expected {
        return Err(QuantError::LengthMismatch {
            ty,
            what: "the quantized row",
            expected,
            got: bytes,
            unit: "bytes",
        });
    }
    Ok(())
}

/// Views whole blocks inside a byte slice (all blocks have alignment 1).
fn blocks_of<B: bytemuck::Pod>(bytes: &[u8]) -> &[B] {
    bytemuck::cast_slice(bytes)
}

fn blocks_of_mut<B: bytemuck::Pod>(bytes: &mut [u8]) -> &mut [B] {
    bytemuck::cast_slice_mut(bytes)
}

macro_rules! dispatch_rows {
    ($ty:expr, $x:ident, $y:ident, $dir:ident) => {
        match $ty {
            QType::F32 => dispatch_rows!(@$dir fp::quantize_row_f32, fp::dequantize_row_f32, [u8; 4], $x, $y),
            QType::F16 => dispatch_rows!(@$dir fp::quantize_row_f16, fp::dequantize_row_f16, Half, $x, $y),
            QType::BF16 => dispatch_rows!(@$dir fp::quantize_row_bf16, fp::dequantize_row_bf16, [u8; 2], $x, $y),
            QType::Q4_0 => dispatch_rows!(@$dir legacy::quantize_row_q4_0, legacy::dequantize_row_q4_0, BlockQ4_0, $x, $y),
            QType::Q4_1 => dispatch_rows!(@$dir legacy::quantize_row_q4_1, legacy::dequantize_row_q4_1, BlockQ4_1, $x, $y),
            QType::Q5_0 => dispatch_rows!(@$dir legacy::quantize_row_q5_0, legacy::dequantize_row_q5_0, BlockQ5_0, $x, $y),
            QType::Q5_1 => dispatch_rows!(@$dir legacy::quantize_row_q5_1, legacy::dequantize_row_q5_1, BlockQ5_1, $x, $y),
            QType::Q8_0 => dispatch_rows!(@$dir legacy::quantize_row_q8_0, legacy::dequantize_row_q8_0, BlockQ8_0, $x, $y),
            QType::Q8_1 => dispatch_rows!(@$dir legacy::quantize_row_q8_1, legacy::dequantize_row_q8_1, BlockQ8_1, $x, $y),
            QType::Q2_K => dispatch_rows!(@$dir kquants::quantize_row_q2_k, kquants::dequantize_row_q2_k, BlockQ2K, $x, $y),
            QType::Q3_K => dispatch_rows!(@$dir kquants::quantize_row_q3_k, kquants::dequantize_row_q3_k, BlockQ3K, $x, $y),
            QType::Q4_K => dispatch_rows!(@$dir kquants::quantize_row_q4_k, kquants::dequantize_row_q4_k, BlockQ4K, $x, $y),
            QType::Q5_K => dispatch_rows!(@$dir kquants::quantize_row_q5_k, kquants::dequantize_row_q5_k, BlockQ5K, $x, $y),
            QType::Q6_K => dispatch_rows!(@$dir kquants::quantize_row_q6_k, kquants::dequantize_row_q6_k, BlockQ6K, $x, $y),
            QType::Q8_K => dispatch_rows!(@$dir kquants::quantize_row_q8_k, kquants::dequantize_row_q8_k, BlockQ8K, $x, $y),
            QType::IQ4_NL => dispatch_rows!(@$dir iq4::quantize_row_iq4_nl, iq4::dequantize_row_iq4_nl, BlockIq4Nl, $x, $y),
            QType::IQ4_XS => dispatch_rows!(@$dir iq4::quantize_row_iq4_xs, iq4::dequantize_row_iq4_xs, BlockIq4Xs, $x, $y),
            QType::MXFP4 => dispatch_rows!(@$dir fp4::quantize_row_mxfp4, fp4::dequantize_row_mxfp4, BlockMxfp4, $x, $y),
            QType::NVFP4 => dispatch_rows!(@$dir fp4::quantize_row_nvfp4, fp4::dequantize_row_nvfp4, BlockNvfp4, $x, $y),
            QType::Turbo2 => dispatch_rows!(@$dir turbo::quantize_row_turbo2, turbo::dequantize_row_turbo2, BlockTurbo2, $x, $y),
            QType::Turbo3 => dispatch_rows!(@$dir turbo::quantize_row_turbo3, turbo::dequantize_row_turbo3, BlockTurbo3, $x, $y),
            QType::Turbo4 => dispatch_rows!(@$dir turbo::quantize_row_turbo4, turbo::dequantize_row_turbo4, BlockTurbo4, $x, $y),
        }
    };
    (@quantize $q:path, $d:path, $b:ty, $x:ident, $y:ident) => { $q($x, blocks_of_mut::<$b>($y)) };
    (@dequantize $q:path, $d:path, $b:ty, $x:ident, $y:ident) => { $d(blocks_of::<$b>($x), $y) };
}

/// Quantizes one row of `src.len()` values into `dst` with the format's reference quantizer —
/// the one `llama-quantize` uses (for IQ4_NL that is the `ntry = 7` search of
/// `ggml_quantize_chunk`; the KV-cache variant is [`iq4::quantize_row_iq4_nl_ref`]). Turbo rows
/// are stored in the rotated domain.
///
/// # Errors
/// If `src.len()` is not a whole number of blocks or `dst` is not exactly one row long.
pub fn quantize_row(ty: QType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_lengths(ty, src.len(), dst.len())?;
    dispatch_rows!(ty, src, dst, quantize);
    Ok(())
}

/// Dequantizes one row: `src` holds whole blocks, `dst` receives their values (turbo rows stay
/// in the rotated domain; see [`wht`]).
///
/// # Errors
/// If `dst.len()` is not a whole number of blocks or `src` is not exactly one row long.
pub fn dequantize_row(ty: QType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_lengths(ty, dst.len(), src.len())?;
    dispatch_rows!(ty, src, dst, dequantize);
    Ok(())
}

/// Dot product of a weight row `w` of format `ty` and an activation row `a` of format
/// `ty.vec_dot_type()`, both `n` values long, with the fastest kernel this CPU has.
///
/// # Errors
/// If `n` is not a whole number of blocks of either format or a row has the wrong length.
pub fn vec_dot(ty: QType, n: usize, w: &[u8], a: &[u8]) -> Result<f32> {
    check_lengths(ty, n, w.len())?;
    let at = ty.vec_dot_type();
    check_lengths(at, n, a.len())?;
    dot::vec_dot_bytes(ty, w, a)
}

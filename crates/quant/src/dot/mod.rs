//! Dot products of a weight row and an activation row: the inner loop of every matmul.
//!
//! One kernel per weight format × its activation format ([`QType::vec_dot_type`]): the
//! 32-value formats against Q8_0 (Q4_1 / Q5_1 against Q8_1), NVFP4's 64-value blocks against
//! pairs of Q8_0 blocks, the 256-value K-quants and IQ4_XS against Q8_K, and float weights
//! against f32 activations.
//!
//! - [`scalar`] — the reference: an exact integer sum per block, then one f32 term per block
//!   added in block order, with ggml's per-type formula (`ggml-cpu/quants.c`, the `_generic`
//!   kernels). Float rows sum f32 products in f64 (`ggml-cpu/vec.cpp`).
//! - [`SimdLevel`] / [`Kernels`] — a table of kernels per instruction-set level, chosen once at
//!   run time ([`Kernels::active`]); `SPECULA_SIMD=scalar|avx2|avx512|neon` forces a level.
//! - [`q4_0_q8_0`] … [`bf16_f32`] — the typed kernels of the active table;
//!   [`crate::vec_dot`] — the byte-level entry point.
//!
//! Which kernels have SIMD code, per level (the rest run the next level down, ending at scalar):
//!
//! | level | kernels |
//! |---|---|
//! | `avx2` (AVX2 + FMA + F16C) | all: q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, mxfp4, nvfp4, q2_K … q6_K, iq4_xs, f32, f16, bf16 |
//! | `avx512` (F + BW + VL + VNNI, plus the above) | q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K, q6_K, f32, f16, bf16 |
//! | `neon` (aarch64) | q4_0, q8_0, f32 |
//!
//! At the `avx512` level IQ4_NL, MXFP4, NVFP4, Q2_K, Q3_K and IQ4_XS run the AVX2 kernels (an
//! AVX-512 version of the first two measured slower on Zen 5; the others are rare in the models
//! specula runs).
//!
//! **Results.** Every quantized SIMD kernel computes the same per-block integer sums as the
//! scalar reference (exactly, for any block bytes: no saturating pair sums, no sign tricks that
//! break on −128) and adds the same f32 terms in the same order, so it returns the same bits on
//! every CPU. That order is sequential, which makes the f32 adds one dependency chain; on the
//! 32-value formats keeping eight partial sums instead measured 15–25 % faster (Zen 5), a price
//! paid for results that do not depend on the machine. The float kernels keep f32 lanes and
//! agree with the reference to within the rounding of a sum of `n` terms; on x86 they keep the
//! same sixteen lanes and lane sum at both levels (AVX2 holds each AVX-512 vector as two
//! halves), so AVX2 and AVX-512 give the same bits for every format.

use std::borrow::Cow;
use std::sync::OnceLock;

use crate::blocks::{
    BlockIq4Nl, BlockIq4Xs, BlockMxfp4, BlockNvfp4, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1,
    BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0, BlockQ8_1, BlockQ8K, Half,
};
use crate::{QType, QuantError, Result};

pub mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

/// An instruction-set level of the dot-product kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum SimdLevel {
    /// Portable Rust, the reference.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// x86-64 AVX-512 F, BW, VL and VNNI (Ice Lake, Zen 4 and later), plus the AVX2 set.
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl SimdLevel {
    /// Every level, supported here or not.
    pub const ALL: &'static [SimdLevel] = &[Self::Scalar, Self::Avx2, Self::Avx512, Self::Neon];

    /// The lower-case name used by `SPECULA_SIMD`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
            Self::Neon => "neon",
        }
    }

    /// The level with this name, case-insensitively.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|l| l.name().eq_ignore_ascii_case(name.trim()))
    }

    /// Whether this CPU can run the level's kernels.
    #[must_use]
    pub fn is_supported(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                Self::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Self::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(
                unreachable_patterns,
                reason = "which levels exist depends on the target architecture"
            )]
            _ => false,
        }
    }

    /// The levels this CPU supports, scalar first.
    #[must_use]
    pub fn supported() -> Vec<SimdLevel> {
        Self::ALL
            .iter()
            .copied()
            .filter(|l| l.is_supported())
            .collect()
    }

    /// The fastest level this CPU supports.
    #[must_use]
    pub fn best() -> SimdLevel {
        Self::supported()
            .into_iter()
            .max()
            .unwrap_or(SimdLevel::Scalar)
    }

    /// The level [`Kernels::active`] runs: `SPECULA_SIMD` if it names a supported level,
    /// otherwise [`SimdLevel::best`]. Read once per process.
    #[must_use]
    pub fn active() -> SimdLevel {
        Kernels::active().level()
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Panics unless `a` has `per` activation blocks for each of the `w` weight blocks.
#[inline]
fn check_blocks(w: usize, a: usize, per: usize) {
    assert_eq!(
        w * per,
        a,
        "dot product: {w} weight blocks need {} activation blocks, got {a}",
        w * per
    );
}

macro_rules! kernel_set {
    ($( $name:ident ($w:ty, $a:ty) $doc:literal; )*) => {
        /// The dot-product kernels of one [`SimdLevel`], as function pointers: fetch the table
        /// once ([`Kernels::active`], [`Kernels::for_level`]) and call it in the hot loop.
        ///
        /// Each kernel takes a weight row and an activation row as whole blocks and panics if
        /// their lengths do not match (the same number of blocks, two Q8_0 blocks per NVFP4
        /// block, one f32 per float weight).
        #[derive(Clone, Copy)]
        pub struct Kernels {
            level: SimdLevel,
            $( $name: fn(&[$w], &[$a]) -> f32, )*
        }

        impl Kernels {
            $(
                #[doc = $doc]
                #[must_use]
                #[inline]
                pub fn $name(&self, w: &[$w], a: &[$a]) -> f32 {
                    (self.$name)(w, a)
                }
            )*
        }

        $(
            #[doc = $doc]
            #[doc = ""]
            #[doc = "Runs the kernel of [`Kernels::active`]."]
            #[doc = ""]
            #[doc = "# Panics"]
            #[doc = "If `a` does not have the length `w` needs."]
            #[must_use]
            #[inline]
            pub fn $name(w: &[$w], a: &[$a]) -> f32 {
                Kernels::active().$name(w, a)
            }
        )*

        const SCALAR: Kernels = Kernels {
            level: SimdLevel::Scalar,
            $( $name: scalar::$name, )*
        };
    };
}

kernel_set! {
    q4_0_q8_0(BlockQ4_0, BlockQ8_0) "Q4_0 weights · Q8_0 activations.";
    q4_1_q8_1(BlockQ4_1, BlockQ8_1) "Q4_1 weights · Q8_1 activations.";
    q5_0_q8_0(BlockQ5_0, BlockQ8_0) "Q5_0 weights · Q8_0 activations.";
    q5_1_q8_1(BlockQ5_1, BlockQ8_1) "Q5_1 weights · Q8_1 activations.";
    q8_0_q8_0(BlockQ8_0, BlockQ8_0) "Q8_0 weights · Q8_0 activations.";
    iq4_nl_q8_0(BlockIq4Nl, BlockQ8_0) "IQ4_NL weights · Q8_0 activations.";
    mxfp4_q8_0(BlockMxfp4, BlockQ8_0) "MXFP4 weights · Q8_0 activations.";
    nvfp4_q8_0(BlockNvfp4, BlockQ8_0) "NVFP4 weights · Q8_0 activations (two per block; the per-tensor scale is the caller's).";
    q2_k_q8_k(BlockQ2K, BlockQ8K) "Q2_K weights · Q8_K activations.";
    q3_k_q8_k(BlockQ3K, BlockQ8K) "Q3_K weights · Q8_K activations.";
    q4_k_q8_k(BlockQ4K, BlockQ8K) "Q4_K weights · Q8_K activations.";
    q5_k_q8_k(BlockQ5K, BlockQ8K) "Q5_K weights · Q8_K activations.";
    q6_k_q8_k(BlockQ6K, BlockQ8K) "Q6_K weights · Q8_K activations.";
    iq4_xs_q8_k(BlockIq4Xs, BlockQ8K) "IQ4_XS weights · Q8_K activations.";
    f32_f32(f32, f32) "f32 weights · f32 activations.";
    f16_f32(Half, f32) "f16 weights · f32 activations.";
    bf16_f32([u8; 2], f32) "bf16 weights (little-endian bytes) · f32 activations.";
}

/// Builds a safe table entry around an `unsafe fn` kernel of a SIMD module: the entry checks the
/// row lengths, then calls the kernel.
macro_rules! simd_entry {
    ($module:ident :: $name:ident, $per:literal) => {
        |w, a| {
            check_blocks(w.len(), a.len(), $per);
            // SAFETY: this entry lives only in the table of its level, and `Kernels::for_level`
            // and `Kernels::active` hand that table out only after `SimdLevel::is_supported`
            // has detected the level's CPU features (the kernel's `#[target_feature]` set).
            // Lengths were checked above; the kernel reads only inside the two slices.
            unsafe { $module::$name(w, a) }
        }
    };
}

#[cfg(target_arch = "x86_64")]
const AVX2: Kernels = Kernels {
    level: SimdLevel::Avx2,
    q4_0_q8_0: simd_entry!(avx2::q4_0_q8_0, 1),
    q4_1_q8_1: simd_entry!(avx2::q4_1_q8_1, 1),
    q5_0_q8_0: simd_entry!(avx2::q5_0_q8_0, 1),
    q5_1_q8_1: simd_entry!(avx2::q5_1_q8_1, 1),
    q8_0_q8_0: simd_entry!(avx2::q8_0_q8_0, 1),
    iq4_nl_q8_0: simd_entry!(avx2::iq4_nl_q8_0, 1),
    mxfp4_q8_0: simd_entry!(avx2::mxfp4_q8_0, 1),
    nvfp4_q8_0: simd_entry!(avx2::nvfp4_q8_0, 2),
    q2_k_q8_k: simd_entry!(avx2::q2_k_q8_k, 1),
    q3_k_q8_k: simd_entry!(avx2::q3_k_q8_k, 1),
    q4_k_q8_k: simd_entry!(avx2::q4_k_q8_k, 1),
    q5_k_q8_k: simd_entry!(avx2::q5_k_q8_k, 1),
    q6_k_q8_k: simd_entry!(avx2::q6_k_q8_k, 1),
    iq4_xs_q8_k: simd_entry!(avx2::iq4_xs_q8_k, 1),
    f32_f32: simd_entry!(avx2::f32_f32, 1),
    f16_f32: simd_entry!(avx2::f16_f32, 1),
    bf16_f32: simd_entry!(avx2::bf16_f32, 1),
};

#[cfg(target_arch = "x86_64")]
const AVX512: Kernels = Kernels {
    level: SimdLevel::Avx512,
    q4_0_q8_0: simd_entry!(avx512::q4_0_q8_0, 1),
    q4_1_q8_1: simd_entry!(avx512::q4_1_q8_1, 1),
    q5_0_q8_0: simd_entry!(avx512::q5_0_q8_0, 1),
    q5_1_q8_1: simd_entry!(avx512::q5_1_q8_1, 1),
    q8_0_q8_0: simd_entry!(avx512::q8_0_q8_0, 1),
    q4_k_q8_k: simd_entry!(avx512::q4_k_q8_k, 1),
    q5_k_q8_k: simd_entry!(avx512::q5_k_q8_k, 1),
    q6_k_q8_k: simd_entry!(avx512::q6_k_q8_k, 1),
    f32_f32: simd_entry!(avx512::f32_f32, 1),
    f16_f32: simd_entry!(avx512::f16_f32, 1),
    bf16_f32: simd_entry!(avx512::bf16_f32, 1),
    ..AVX2
};

#[cfg(target_arch = "aarch64")]
const NEON: Kernels = Kernels {
    level: SimdLevel::Neon,
    q4_0_q8_0: simd_entry!(neon::q4_0_q8_0, 1),
    q8_0_q8_0: simd_entry!(neon::q8_0_q8_0, 1),
    f32_f32: simd_entry!(neon::f32_f32, 1),
    ..SCALAR
};

static SCALAR_TABLE: Kernels = SCALAR;
#[cfg(target_arch = "x86_64")]
static AVX2_TABLE: Kernels = AVX2;
#[cfg(target_arch = "x86_64")]
static AVX512_TABLE: Kernels = AVX512;
#[cfg(target_arch = "aarch64")]
static NEON_TABLE: Kernels = NEON;

static ACTIVE: OnceLock<&'static Kernels> = OnceLock::new();

impl Kernels {
    /// The table of `level`, or `None` if this CPU does not support it.
    #[must_use]
    pub fn for_level(level: SimdLevel) -> Option<&'static Kernels> {
        if !level.is_supported() {
            return None;
        }
        match level {
            SimdLevel::Scalar => Some(&SCALAR_TABLE),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => Some(&AVX2_TABLE),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => Some(&AVX512_TABLE),
            #[cfg(target_arch = "aarch64")]
            SimdLevel::Neon => Some(&NEON_TABLE),
            #[allow(
                unreachable_patterns,
                reason = "which levels exist depends on the target architecture"
            )]
            _ => None,
        }
    }

    /// The table every untyped call uses: the level named by `SPECULA_SIMD` if this CPU
    /// supports it (unknown names and unsupported levels are ignored), otherwise the fastest
    /// supported level. Chosen on first use and cached for the life of the process.
    #[must_use]
    pub fn active() -> &'static Kernels {
        ACTIVE.get_or_init(|| {
            let forced = std::env::var("SPECULA_SIMD")
                .ok()
                .and_then(|v| SimdLevel::from_name(&v));
            forced
                .and_then(Kernels::for_level)
                .or_else(|| Kernels::for_level(SimdLevel::best()))
                .unwrap_or(&SCALAR_TABLE)
        })
    }

    /// The level of this table.
    #[must_use]
    pub fn level(&self) -> SimdLevel {
        self.level
    }

    /// [`crate::vec_dot`] with this table's kernels: the dot product of a weight row `w` of
    /// format `ty` and an activation row `a` of format `ty.vec_dot_type()`, both `n` values.
    ///
    /// # Errors
    /// If `n` is not a whole number of blocks of either format, a row has the wrong length, or
    /// `ty` is not a weight format (Q8_1, Q8_K and the turbo KV types have no dot product here).
    pub fn vec_dot(&self, ty: QType, n: usize, w: &[u8], a: &[u8]) -> Result<f32> {
        crate::check_lengths(ty, n, w.len())?;
        crate::check_lengths(ty.vec_dot_type(), n, a.len())?;
        self.vec_dot_bytes(ty, w, a)
    }

    /// Dispatches on `ty` over rows whose lengths were checked.
    fn vec_dot_bytes(&self, ty: QType, w: &[u8], a: &[u8]) -> Result<f32> {
        use bytemuck::cast_slice as c;
        Ok(match ty {
            QType::Q4_0 => self.q4_0_q8_0(c(w), c(a)),
            QType::Q4_1 => self.q4_1_q8_1(c(w), c(a)),
            QType::Q5_0 => self.q5_0_q8_0(c(w), c(a)),
            QType::Q5_1 => self.q5_1_q8_1(c(w), c(a)),
            QType::Q8_0 => self.q8_0_q8_0(c(w), c(a)),
            QType::IQ4_NL => self.iq4_nl_q8_0(c(w), c(a)),
            QType::MXFP4 => self.mxfp4_q8_0(c(w), c(a)),
            QType::NVFP4 => self.nvfp4_q8_0(c(w), c(a)),
            QType::Q2_K => self.q2_k_q8_k(c(w), c(a)),
            QType::Q3_K => self.q3_k_q8_k(c(w), c(a)),
            QType::Q4_K => self.q4_k_q8_k(c(w), c(a)),
            QType::Q5_K => self.q5_k_q8_k(c(w), c(a)),
            QType::Q6_K => self.q6_k_q8_k(c(w), c(a)),
            QType::IQ4_XS => self.iq4_xs_q8_k(c(w), c(a)),
            QType::F32 => self.f32_f32(&f32_row(w), &f32_row(a)),
            QType::F16 => self.f16_f32(c(w), &f32_row(a)),
            QType::BF16 => self.bf16_f32(c(w), &f32_row(a)),
            QType::Q8_1 | QType::Q8_K | QType::Turbo2 | QType::Turbo3 | QType::Turbo4 => {
                return Err(QuantError::Unsupported { ty, op: "vec_dot" });
            }
        })
    }
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("level", &self.level)
            .finish_non_exhaustive()
    }
}

/// An f32 row from little-endian bytes: borrowed when the bytes are 4-aligned (a memory-mapped
/// tensor, a `Vec<f32>` viewed as bytes), copied otherwise.
fn f32_row(bytes: &[u8]) -> Cow<'_, [f32]> {
    match bytemuck::try_cast_slice::<u8, f32>(bytes) {
        Ok(v) if cfg!(target_endian = "little") => Cow::Borrowed(v),
        _ => Cow::Owned(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
    }
}

/// The dot product behind [`crate::vec_dot`], on rows whose lengths were checked, with the
/// active kernels.
pub(crate) fn vec_dot_bytes(ty: QType, w: &[u8], a: &[u8]) -> Result<f32> {
    Kernels::active().vec_dot_bytes(ty, w, a)
}

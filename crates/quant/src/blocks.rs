//! The block layouts, one `#[repr(C)]` struct per format, each with a compile-time size check.
//!
//! Layouts follow `ggml/src/ggml-common.h` (upstream ggml) and, for the turbo types, the
//! TurboQuant fork's post-PR #197 layout (research note `quant.md` §5.2). Every field is a byte
//! array, so every block has alignment 1: a `&[u8]` of whole blocks (a tensor inside a memory
//! map, a KV-cache row) can be viewed as `&[Block]` wherever it starts.

use bytemuck::{Pod, Zeroable};

/// An IEEE binary16 value stored as two little-endian bytes (ggml's `ggml_half`).
#[repr(transparent)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Half(pub [u8; 2]);

impl Half {
    /// Rounds `x` to the nearest binary16 (ties to even, overflow to infinity), as
    /// `GGML_FP32_TO_FP16` does.
    #[must_use]
    #[inline]
    pub fn from_f32(x: f32) -> Self {
        Self(half::f16::from_f32(x).to_bits().to_le_bytes())
    }

    /// The exact f32 value.
    #[must_use]
    #[inline]
    pub fn to_f32(self) -> f32 {
        half::f16::from_bits(u16::from_le_bytes(self.0)).to_f32()
    }

    /// The raw bits.
    #[must_use]
    #[inline]
    pub fn to_bits(self) -> u16 {
        u16::from_le_bytes(self.0)
    }
}

impl std::fmt::Debug for Half {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.to_f32())
    }
}

/// An f32 stored as four little-endian bytes (used inside `block_q8_K`).
#[repr(transparent)]
#[derive(Clone, Copy, Default, PartialEq, Pod, Zeroable)]
pub struct F32Le(pub [u8; 4]);

impl F32Le {
    /// Stores `x`.
    #[must_use]
    #[inline]
    pub fn new(x: f32) -> Self {
        Self(x.to_le_bytes())
    }

    /// The value.
    #[must_use]
    #[inline]
    pub fn get(self) -> f32 {
        f32::from_le_bytes(self.0)
    }
}

impl std::fmt::Debug for F32Le {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.get())
    }
}

/// Values per block of the legacy formats (`QK4_0` … `QK8_1`).
pub const QK: usize = 32;
/// Values per super-block of the K-quants and IQ4_XS (`QK_K`).
pub const QK_K: usize = 256;
/// Values per block of NVFP4 (`QK_NVFP4`); each has four 16-value sub-blocks.
pub const QK_NVFP4: usize = 64;
/// Values per block of the turbo types: one Walsh–Hadamard rotation group.
pub const QK_TURBO: usize = 128;

macro_rules! block {
    ($(#[$m:meta])* $name:ident = $size:literal { $($(#[$fm:meta])* $field:ident: $ty:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
        pub struct $name { $($(#[$fm])* pub $field: $ty),* }
        const _: () = assert!(size_of::<$name>() == $size);
        const _: () = assert!(align_of::<$name>() == 1);
    };
}

block!(
    /// Q4_0: `x = d · (q − 8)`, 4-bit q; low nibbles are elements 0..16, high nibbles 16..32.
    BlockQ4_0 = 18 { d: Half, qs: [u8; 16] }
);
block!(
    /// Q4_1: `x = d · q + m`.
    BlockQ4_1 = 20 { d: Half, m: Half, qs: [u8; 16] }
);
block!(
    /// Q5_0: `x = d · (q − 16)`, 5th bits in `qh` (bit j is element j).
    BlockQ5_0 = 22 { d: Half, qh: [u8; 4], qs: [u8; 16] }
);
block!(
    /// Q5_1: `x = d · q + m`.
    BlockQ5_1 = 24 { d: Half, m: Half, qh: [u8; 4], qs: [u8; 16] }
);
block!(
    /// Q8_0: `x = d · q`, q signed 8-bit.
    BlockQ8_0 = 34 { d: Half, qs: [i8; 32] }
);
block!(
    /// Q8_1: Q8_0 plus `s = d · Σq` (activation type for Q4_1 / Q5_1 dot products).
    BlockQ8_1 = 36 { d: Half, s: Half, qs: [i8; 32] }
);
block!(
    /// Q8_K: activation type of the K-quant dot products; f32 scale and 16-value partial sums.
    BlockQ8K = 292 { d: F32Le, qs: [i8; 256], bsums: [[u8; 2]; 16] }
);
block!(
    /// Q2_K: 16 sub-blocks of 16 with 4-bit scale and min.
    BlockQ2K = 84 { scales: [u8; 16], qs: [u8; 64], d: Half, dmin: Half }
);
block!(
    /// Q3_K: 16 sub-blocks of 16 with 6-bit scales; high bits in `hmask`.
    BlockQ3K = 110 { hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: Half }
);
block!(
    /// Q4_K: 8 sub-blocks of 32 with 6-bit scale and min.
    BlockQ4K = 144 { d: Half, dmin: Half, scales: [u8; 12], qs: [u8; 128] }
);
block!(
    /// Q5_K: Q4_K plus fifth bits in `qh`.
    BlockQ5K = 176 { d: Half, dmin: Half, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128] }
);
block!(
    /// Q6_K: 16 sub-blocks of 16 with signed 8-bit scales; `d` comes last.
    BlockQ6K = 210 { ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: Half }
);
block!(
    /// IQ4_NL: `x = d · kvalues_iq4nl[q]`, nibble order as Q4_0.
    BlockIq4Nl = 18 { d: Half, qs: [u8; 16] }
);
block!(
    /// IQ4_XS: 8 sub-blocks of 32 with 6-bit scales (low 4 bits in `scales_l`, high 2 in
    /// `scales_h`), IQ4_NL codebook.
    BlockIq4Xs = 136 { d: Half, scales_h: [u8; 2], scales_l: [u8; 4], qs: [u8; 128] }
);
block!(
    /// MXFP4: E8M0 shared exponent `e`, 32 E2M1 codes.
    BlockMxfp4 = 17 { e: u8, qs: [u8; 16] }
);
block!(
    /// NVFP4: four UE4M3 sub-block scales (16 values each), 64 E2M1 codes; sub-block s uses
    /// `qs[8s..8s+8]` (low nibble element 16s+j, high nibble 16s+8+j).
    BlockNvfp4 = 36 { d: [u8; 4], qs: [u8; 32] }
);
block!(
    /// turbo2: corrected norm and 2-bit Lloyd–Max codes of the rotated unit vector.
    BlockTurbo2 = 34 { norm: Half, qs: [u8; 32] }
);
block!(
    /// turbo3: low 2 bits of each code in `qs`, the third bit in `signs` (historical name).
    BlockTurbo3 = 50 { norm: Half, qs: [u8; 32], signs: [u8; 16] }
);
block!(
    /// turbo4 (post-PR #197, 4.125 bpw): 4-bit codes, element 2c in the low nibble of `qs[c]`.
    BlockTurbo4 = 66 { norm: Half, qs: [u8; 64] }
);

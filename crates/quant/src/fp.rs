//! Plain float rows: f32, f16 (IEEE binary16) and bf16 (brain float).
//!
//! Conversions follow ggml (`ggml-impl.h`): f32→f16 rounds to nearest even with overflow to
//! infinity; f32→bf16 rounds to nearest even and turns NaN into a quiet NaN; both decodes are
//! exact.

use crate::blocks::Half;

/// Copies f32 values into little-endian bytes.
pub fn quantize_row_f32(x: &[f32], y: &mut [[u8; 4]]) {
    debug_assert_eq!(x.len(), y.len());
    for (v, o) in x.iter().zip(y) {
        *o = v.to_le_bytes();
    }
}

/// Reads little-endian f32 values.
pub fn dequantize_row_f32(x: &[[u8; 4]], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (b, o) in x.iter().zip(y) {
        *o = f32::from_le_bytes(*b);
    }
}

/// Rounds to binary16.
pub fn quantize_row_f16(x: &[f32], y: &mut [Half]) {
    debug_assert_eq!(x.len(), y.len());
    for (v, o) in x.iter().zip(y) {
        *o = Half::from_f32(*v);
    }
}

/// Widens binary16 to f32 (exact).
pub fn dequantize_row_f16(x: &[Half], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (h, o) in x.iter().zip(y) {
        *o = h.to_f32();
    }
}

/// f32 → bf16 bits as `ggml_compute_fp32_to_bf16`: round to nearest even on the upper 16
/// bits; NaN keeps its sign and top mantissa bits and is forced quiet.
#[must_use]
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    let hi = if (u & 0x7fff_ffff) > 0x7f80_0000 {
        (u >> 16) | 64
    } else {
        (u + (0x7fff + ((u >> 16) & 1))) >> 16
    };
    // `hi` is the upper half of a 32-bit word: at most 0xffff.
    u16::try_from(hi).unwrap_or(u16::MAX)
}

/// bf16 bits → f32 (exact).
#[must_use]
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Rounds to bf16.
pub fn quantize_row_bf16(x: &[f32], y: &mut [[u8; 2]]) {
    debug_assert_eq!(x.len(), y.len());
    for (v, o) in x.iter().zip(y) {
        *o = f32_to_bf16(*v).to_le_bytes();
    }
}

/// Widens bf16 to f32 (exact).
pub fn dequantize_row_bf16(x: &[[u8; 2]], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (b, o) in x.iter().zip(y) {
        *o = bf16_to_f32(u16::from_le_bytes(*b));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_keeps_nan_quiet() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties go to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is halfway too: ties go to even (1 + 2^-6 → 0x3f82).
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(f32_to_bf16(-0.0), 0x8000);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
    }
}
